"""Bad input to the statistics behind refdml reproduce's verdicts and gates (issue 48,
item 6): refused in one message naming the parameter, and the seed for a value of one
seed, never read as something else (a list of metrics as "no seeds", True as +1, a complex
number as its real part, a NaN as a NaN mean)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdml.reproduce.stats import (
    bound_text,
    compare,
    competence,
    gate_text,
    holm,
    paired_bootstrap,
    paired_interval,
    pooled_sd,
    seeds_needed,
    summarise,
    t_test,
    verdict,
)

A = {0: 0.30, 1: 0.32, 2: 0.35}
B = {0: 0.10, 1: 0.11, 2: 0.12}


@pytest.mark.parametrize("call", [
    lambda: compare({**A, 7: math.nan}, {**B, 7: 0.1}, direction=1),
    lambda: compare(A, {**B, 7: math.inf}, direction=1),
    lambda: competence({**A, 7: math.nan}, {**B, 7: 0.1}),
], ids=["compare-a", "compare-b", "competence"])
def test_a_nan_is_refused_naming_its_seed(call):
    with pytest.raises(ValueError, match=r"\[7\] == (nan|inf).*seed 7"):
        call()


@pytest.mark.parametrize(("call", "name"), [
    (lambda: summarise([0.3, math.nan]), r"values\[1\] == nan.*index 1"),
    (lambda: summarise({3: 0.3, 9: math.nan}), r"values\[seed 9\] == nan"),
    (lambda: paired_bootstrap([0.1, math.nan, 0.2]), r"differences\[1\] == nan"),
    (lambda: paired_interval([0.1, 0.2, math.inf]), r"differences\[2\] == inf"),
    (lambda: t_test([math.nan, 0.2]), r"differences\[0\] == nan"),
])
def test_a_nan_in_a_sequence_is_refused_naming_its_index(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("bad", [None, "0.3", b"x", 3, object()])
@pytest.mark.parametrize(("function", "name"), [
    (lambda v: compare(v, B, direction=1), "a"),
    (lambda v: compare(A, v, direction=1), "b"),
    (lambda v: competence(v, B), "trained"),
    (lambda v: competence(A, v), "untrained"),
    (lambda v: summarise(v), "values"),
    (lambda v: paired_bootstrap(v), "differences"),
    (lambda v: paired_interval(v), "differences"),
    (lambda v: holm(v), "p_values"),
    (lambda v: pooled_sd(v, [3]), "sds"),
    (lambda v: pooled_sd([1.0], v), "counts"),
], ids=["compare-a", "compare-b", "competence-trained", "competence-untrained", "summarise",
        "paired_bootstrap", "paired_interval", "holm", "pooled_sd-sds", "pooled_sd-counts"])
def test_none_a_string_or_a_scalar_is_a_type_error_naming_the_parameter(bad, function, name):
    with pytest.raises(TypeError, match=f"^{name} must be"):
        function(bad)


@pytest.mark.parametrize(("call", "name"), [
    (lambda: compare(A, {0: "0.1", 1: 0.1}, direction=1), r"b\[0\]"),
    (lambda: compare({0: None, 1: 0.2}, B, direction=1), r"a\[0\]"),
    (lambda: competence({0: True, 1: 0.2}, B), r"trained\[0\]"),
    (lambda: summarise([0.1, "0.2"]), r"values\[1\]"),
    (lambda: summarise([0.1, None]), r"values\[1\]"),
    (lambda: holm([0.1, "0.2"]), r"p_values\[1\]"),
])
def test_a_value_of_the_wrong_type_is_named(call, name):
    with pytest.raises(TypeError, match=f"^{name} must be a real number"):
        call()


@pytest.mark.parametrize("function", [compare, competence])
def test_a_list_where_a_dict_of_seeds_is_expected_is_refused(function):
    # it used to pair no seeds: "did not learn, n = 0"
    kwargs = {"direction": 1} if function is compare else {}
    with pytest.raises(TypeError, match=r"must be a dict of seed -> metric, got \[0.3"):
        function([0.3, 0.32, 0.35], B, **kwargs)


@pytest.mark.parametrize("confidence", ["0.95", None, True, 0.95j])
def test_a_confidence_that_is_not_a_number_is_a_type_error(confidence):
    for call in (lambda: compare(A, B, direction=1, confidence=confidence),
                 lambda: competence(A, B, confidence=confidence),
                 lambda: paired_bootstrap([0.1, 0.2], confidence=confidence)):
        with pytest.raises(TypeError, match="^confidence must be a real number"):
            call()


@pytest.mark.parametrize("direction", [True, False, 1.0, "1", None])
def test_a_direction_that_is_not_the_integer_1_or_minus_1_is_refused(direction):
    with pytest.raises(TypeError, match="^direction must be the integer 1 or -1"):
        compare(A, B, direction=direction)
    with pytest.raises(TypeError, match="^direction must be the integer 1 or -1"):
        verdict(0.1, 0.2, direction)
    with pytest.raises(ValueError, match="^direction == 2"):
        compare(A, B, direction=2)


@pytest.mark.parametrize("call", [
    lambda d: summarise(d), lambda d: paired_bootstrap(d), lambda d: paired_interval(d),
    lambda d: t_test(d),
])
def test_a_complex_array_is_refused_not_cast_with_a_warning(call):
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no ComplexWarning either
        with pytest.raises(TypeError, match=r"\[0\] must be a real number, got \(0.1\+1j\)"):
            call(np.array([0.1 + 1j, 0.2, 0.3]))


def test_the_other_parameters_are_checked_by_type():
    with pytest.raises(TypeError, match="^min_gain must be a real number"):
        competence(A, B, min_gain="0.02")
    with pytest.raises(TypeError, match="^metric must be a string"):
        competence(A, B, metric=3)
    with pytest.raises(TypeError, match="^resolution must be a real number"):
        compare(A, B, direction=1, resolution=None)
    with pytest.raises(TypeError, match="^n_resamples must be an integer"):
        paired_bootstrap([0.1, 0.2], n_resamples=10.0)
    with pytest.raises(TypeError, match="^seed must be an integer"):
        paired_bootstrap([0.1, 0.2], seed="0")
    with pytest.raises(TypeError, match="^sd must be a real number"):
        seeds_needed(None, 0.02)
    with pytest.raises(TypeError, match="^effect must be a real number"):
        seeds_needed(0.1, "0.02")
    with pytest.raises(TypeError, match=r"^counts\[0\] must be an integer"):
        pooled_sd([1.0], [2.5])
    with pytest.raises(ValueError, match="one count per standard deviation"):
        pooled_sd([1.0, 2.0], [3])
    with pytest.raises(TypeError, match="^effect must be an Effect"):
        bound_text([0.1])
    with pytest.raises(TypeError, match="^gate must be a Gate"):
        gate_text(None)


def test_good_input_still_gives_the_same_numbers():
    # the checks change no result: the dict and the list of one metric summarise alike
    assert summarise({3: 1.0, 5: 2.0, 9: 4.0}) == summarise([1.0, 2.0, 4.0])
    assert summarise(x for x in (1.0, 2.0, 4.0)) == summarise(np.array([1.0, 2.0, 4.0]))
    assert summarise(np.array([1, 2, 4], dtype=np.int64)).mean == pytest.approx(7 / 3)
    effect = compare({np.int64(0): np.float32(0.5), 1: 0.6}, {0: 0.1, 1: 0.1}, direction=-1)
    assert effect.n == 2
    assert competence(A, B).n == 3


@given(st.lists(st.one_of(st.none(), st.text(max_size=3), st.booleans(),
                          st.complex_numbers(allow_nan=False, allow_infinity=False)
                          .filter(lambda z: z.imag != 0)),
                min_size=1, max_size=4),
       st.lists(st.floats(-1, 1), max_size=3))
def test_drawn_bad_entries_are_type_errors_naming_their_index(bad, good):
    values = [*good, *bad]
    with pytest.raises(TypeError, match=rf"^values\[{len(good)}\] must be a real number"):
        summarise(values)


@given(st.dictionaries(st.integers(0, 50), st.floats(0, 1), min_size=2, max_size=6),
       st.sampled_from([math.nan, math.inf, -math.inf]))
def test_drawn_non_finite_metrics_name_their_seed(trained, bad):
    seed = max(trained)
    untrained = {s: 0.0 for s in trained}
    with pytest.raises(ValueError, match=rf"^trained\[{seed}\] == .*seed {seed} must be finite"):
        competence({**trained, seed: bad}, untrained)
