"""The floating formats of refdml.conformance and its own rounding to them
(:mod:`refdml.conformance._formats`).

The rounding is checked against independent computations: NumPy's casts for the formats
NumPy has (float16, float32: its C conversion routines, a different algorithm), exact
rational arithmetic (``fractions.Fraction``: the nearest representable number found by a
readable search, ties to the even significand) for bfloat16, and, where JAX is installed,
the ``ml_dtypes`` bfloat16 cast that JAX uses.
"""

from __future__ import annotations

import math
from fractions import Fraction

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from numpy.testing import assert_array_equal

from refdml.conformance._check import _not_admitted, unrepresentable
from refdml.conformance._formats import DTYPES, FORMATS, unsupported

BF16 = FORMATS["bfloat16"]


def _nearest_bfloat16(value: float) -> float:
    """``value`` rounded to bfloat16 with exact rationals: the significand is the integer
    nearest ``value / ulp`` (ties to even), ``ulp`` the spacing at ``value``'s binade (or
    the subnormal spacing below the normal range); beyond the largest finite number by half
    an ulp or more, infinity."""
    if value == 0 or not math.isfinite(value):
        return value
    exact = Fraction(value)
    magnitude = abs(exact)
    exponent = -126  # the binade [2**e, 2**(e+1)) holding |value|, at least the normal one
    while Fraction(2) ** (exponent + 1) <= magnitude:
        exponent += 1
    ulp = Fraction(2) ** (exponent - 7)
    units, remainder = divmod(magnitude, ulp)
    if remainder * 2 > ulp or (remainder * 2 == ulp and units % 2 == 1):
        units += 1
    rounded = units * ulp
    # The largest finite bfloat16 is (2 - 2**-7) * 2**127; the next step would be 2**128.
    if rounded >= Fraction(2) ** 128:
        return math.copysign(math.inf, value)
    return math.copysign(float(rounded), value)


def test_the_formats_match_numpys_finfo():
    for name in ("float16", "float32", "float64"):
        info = np.finfo(name)
        fmt = FORMATS[name]
        assert (fmt.eps, fmt.max, fmt.tiny) == (float(info.eps), float(info.max),
                                                float(info.tiny))
        assert fmt.smallest_subnormal == float(info.smallest_subnormal)


def test_bfloat16_is_float32s_range_with_an_8_bit_significand():
    assert BF16.eps == 2.0 ** -7
    assert BF16.max == 3.3895313892515355e38  # 0x7F7F
    assert BF16.tiny == FORMATS["float32"].tiny
    assert BF16.smallest_subnormal == 2.0 ** -133


@pytest.mark.parametrize("name", ["float16", "float32", "float64"])
@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.floats(allow_nan=False, width=64), min_size=1, max_size=20))
def test_rounding_agrees_with_numpys_cast(name, values):
    x = np.array(values, dtype=np.float64)
    with np.errstate(over="ignore"):
        expected = x.astype(name).astype(np.float64)
    rounded = FORMATS[name].round(x)
    assert_array_equal(rounded, expected)
    assert_array_equal(np.signbit(rounded), np.signbit(expected))


@settings(max_examples=500, deadline=None)
@given(value=st.one_of(
    st.floats(allow_nan=False, width=64),
    st.floats(min_value=-1e-37, max_value=1e-37),          # subnormal and underflow
    st.floats(min_value=3.3e38, max_value=3.41e38),         # the overflow threshold
))
def test_bfloat16_rounding_agrees_with_exact_rationals(value):
    rounded = float(BF16.round(np.array([value]))[0])
    assert rounded == _nearest_bfloat16(value)
    assert math.copysign(1.0, rounded) == math.copysign(1.0, value)


def test_bfloat16_rounding_at_its_edges():
    one_ulp = 2.0 ** -7
    cases = {
        1.0 + one_ulp / 2: 1.0,                   # a tie: to the even significand
        1.0 + 3 * one_ulp / 2: 1.0 + 2 * one_ulp,  # the other tie, up to even
        1.0 + one_ulp / 2 + 2.0 ** -40: 1.0 + one_ulp,  # just above the tie
        BF16.max: BF16.max,
        BF16.max + 2.0 ** 119: math.inf,         # half an ulp above the largest: overflow
        BF16.max + 2.0 ** 118: BF16.max,         # a quarter: still the largest
        2.0 ** -134: 0.0,                        # half the smallest subnormal: a tie to 0
        1.5 * 2.0 ** -133: 2.0 ** -132,          # a subnormal tie, up to even
        -0.0: -0.0,
        1e300: math.inf,
        -1e-300: -0.0,
    }
    rounded = BF16.round(np.array(list(cases)))
    for (value, wanted), got in zip(cases.items(), rounded):
        assert got == wanted and np.signbit(got) == np.signbit(wanted), (value, got, wanted)
    assert np.isnan(BF16.round(np.array([np.nan]))[0])


def test_bfloat16_rounding_agrees_with_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")  # installed with JAX
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(20_000) * 10.0 ** rng.integers(-45, 39, 20_000),
                        rng.standard_normal(1_000) * 1e-40])
    with np.errstate(over="ignore"):
        expected = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    assert_array_equal(BF16.round(x), expected)


def test_only_torch_and_jax_have_bfloat16():
    assert DTYPES == ("float64", "float32", "float16", "bfloat16")
    for framework in ("torch", "jax"):
        assert all(unsupported(framework, dtype) is None for dtype in DTYPES)
    for framework, library in (("numpy", "NumPy"), ("cupy", "CuPy")):
        assert all(unsupported(framework, dtype) is None for dtype in DTYPES[:3])
        why = unsupported(framework, "bfloat16")
        assert why.startswith("dtype == 'bfloat16' needs framework 'torch' or 'jax': "
                              f"{library} has no bfloat16")
        assert "\n" not in why


# ------------------------------------------------------------------ admitting a case


@pytest.mark.parametrize("stated, dtype, admitted", [
    (None, "bfloat16", True),
    (("float32",), "float32", True),
    (("float32",), "bfloat16", True),    # the same exponent range
    (("float32",), "float16", False),
    (("float64",), "bfloat16", False),
    (("float64",), "float32", False),
    (("float64", "float32"), "bfloat16", True),
])
def test_a_stated_case_is_admitted_in_the_formats_of_its_range(stated, dtype, admitted):
    why = _not_admitted(stated, dtype)
    assert (why is None) == admitted
    if not admitted:
        assert why == (f"the entry states it for {' and '.join(stated)} only: its extremes "
                       f"probe that range, not {dtype}'s")


def test_unrepresentable_inputs_say_why():
    x = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert unrepresentable({"x": x, "eps": 0.5, "tol": 1e-12}, "bfloat16") is None
    assert unrepresentable({"x": x * 1e37}, "bfloat16") is None
    assert unrepresentable({"x": x * 1e39}, "bfloat16") == (
        "x beyond bfloat16's range (largest finite 3.39e+38)")
    assert unrepresentable({"x": x * 1e5}, "float16") == (
        "x beyond float16's range (largest finite 6.55e+04)")
    assert unrepresentable({"x": x, "eps": 1e6}, "float16") == (
        "eps == 1000000.0 beyond float16's range (largest finite 6.55e+04)")
    # An integer hyperparameter is a count, and a tiny real one is compared with (a
    # stopping tolerance): neither is refused.
    assert unrepresentable({"x": x, "max_iter": 10**6, "tol": 1e-30}, "float16") is None
    assert unrepresentable({"x": x * 1e-50}, "bfloat16") == (
        "every non-zero element of x underflows to 0 in bfloat16 (smallest 9.184e-41)")
    # Some elements underflowing is a rounding, not another case.
    assert unrepresentable({"x": np.array([1.0, 1e-50])}, "bfloat16") is None
