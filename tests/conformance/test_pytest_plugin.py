"""The pytest plugin (:mod:`refdml.pytest_plugin`), run by pytest's own
``pytester`` on a small user package with a correct and a broken implementation.

The user's test files import nothing from refdml: the plugin comes from the ``pytest11``
entry point. The expected outcome of every item is derived from the cases' inputs and the
formats' ranges (which squares overflow or vanish), not from the reference's outputs.
"""

from __future__ import annotations

import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest

from test_conform_cli import PAIR

from refdml.catalog import get
from refdml.conformance._formats import FORMATS

OP = "normalize.l2_normalize"

# The user's NumPy pairs: the correct pair of the CLI tests, and a naive forward.
PAIRS = PAIR + textwrap.dedent("""\


    def naive_forward(x):
        # The planted defect: the squares of large (small) entries overflow (vanish).
        with np.errstate(all="ignore"):
            norm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
            y = x / norm
        return y, (y, norm)
""")

USER_TESTS = textwrap.dedent("""\
    import pytest

    import mypairs

    CHECK = pytest.mark.refdml_conform("normalize.l2_normalize", framework="numpy",
                                       dtypes=["float64", "float32"], seeds=2, search=False)


    @CHECK
    def test_correct(refdml_conform):
        refdml_conform(mypairs.forward, backward=mypairs.backward)


    @CHECK
    def test_naive(refdml_conform):
        refdml_conform(mypairs.naive_forward, backward=mypairs.backward)
""")


def _outcomes(result) -> dict[str, str]:
    """{test id: PASSED / FAILED / SKIPPED} from the ``-rA`` summary and ``-v`` lines."""
    found = {}
    for line in result.outlines:
        for outcome in ("PASSED", "FAILED", "SKIPPED"):
            if "::" in line and f" {outcome}" in line:
                found[line.split(" ")[0]] = outcome
    return found


def _cases(dtype: str) -> dict[str, dict]:
    """The cases the plugin collects for ``dtype`` (seeds 0, 1 and the reference cases)."""
    spec = get(OP)
    cases = {f"seed {k}": spec.make_inputs(np.random.default_rng(k)) for k in range(2)}
    cases.update({c.name: dict(c.inputs, _dtypes=c.dtypes)
                  for c in spec.reference_inputs(np.random.default_rng(0))})
    return cases


def _expected(dtype: str) -> dict[str, str]:
    """The outcome of each of naive_forward's items, from the inputs: skipped where the
    case is stated for another range; failed where a row's sum of squares leaves the
    format (overflows, or vanishes below its smallest number while the row is not zero);
    passed elsewhere."""
    fmt = FORMATS[dtype]
    expected = {}
    for name, inputs in _cases(dtype).items():
        stated = inputs.get("_dtypes")
        if stated is not None and dtype not in stated and not (
                dtype == "bfloat16" and "float32" in stated):
            expected[name] = "SKIPPED"
            continue
        x = np.abs(fmt.round(inputs["x"]))
        peak = x.max(axis=-1)
        # The largest square of each row, from its exponent: 2 * log2|x| against the range.
        with np.errstate(divide="ignore"):
            log2_square = 2 * np.log2(np.where(peak > 0, peak, 1.0))
        leaves = (log2_square > np.log2(fmt.max)) | (
            (peak > 0) & (log2_square < np.log2(fmt.smallest_subnormal)))
        expected[name] = "FAILED" if leaves.any() else "PASSED"
    return expected


def _id(test: str, dtype: str, case: str) -> str:
    return f"test_user.py::{test}[{dtype}-{'_'.join(case.split())}]"


def test_the_plugin_is_registered_as_a_pytest11_entry_point():
    plugins = {e.name: e.value for e in entry_points(group="pytest11")}
    assert plugins.get("refdml") == "refdml.pytest_plugin"


def test_loading_the_plugin_imports_nothing_heavy():
    """pytest loads the plugin in every session before the session's conftest files: had
    it imported the catalogue (and so numba.cuda), a conftest could no longer switch on
    Numba's CUDA simulator, which broke every simulated kernel test of refdml's own suite."""
    import subprocess
    import sys

    code = ("import sys, refdml.pytest_plugin; "
            "print(sorted(m for m in ('refdml.catalog', 'refdml.conformance', 'numba', "
            "'scipy', 'jax') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_one_item_per_dtype_and_case_with_the_located_failures(pytester):
    pytester.makepyfile(mypairs=PAIRS, test_user=USER_TESTS)
    result = pytester.runpytest("-v", "-rA", "-p", "no:cacheprovider")
    outcomes = _outcomes(result)
    wanted = {}
    for dtype in ("float64", "float32"):
        naive = _expected(dtype)
        for case, outcome in naive.items():
            wanted[_id("test_naive", dtype, case)] = outcome
            wanted[_id("test_correct", dtype, case)] = (
                "SKIPPED" if outcome == "SKIPPED" else "PASSED")
    assert outcomes == wanted, result.stdout.str()
    failed = sum(v == "FAILED" for v in wanted.values())
    assert failed >= 3   # huge and tiny scale in float64, the float32 edge in float32
    result.assert_outcomes(passed=sum(v == "PASSED" for v in wanted.values()), failed=failed,
                           skipped=sum(v == "SKIPPED" for v in wanted.values()))
    # A failure's message is the located report line; a skip names the reason.
    out = result.stdout.str()
    assert "normalize.l2_normalize (numpy, float32): " in out
    assert "'float32 edge':" in out and "output 0: non-finite at (" in out
    assert ("the entry states it for float64 only: its extremes probe that range, not "
            "float32's") in out


def test_dash_k_selects_cases(pytester):
    pytester.makepyfile(mypairs=PAIRS, test_user=USER_TESTS)
    result = pytester.runpytest("-v", "-p", "no:cacheprovider", "-k", "naive and float32_edge")
    assert set(_outcomes(result)) == {_id("test_naive", "float32", "float32 edge"),
                                      _id("test_naive", "float64", "float32 edge")}
    result.assert_outcomes(failed=1, skipped=1)


def test_the_search_is_one_item_that_fails_with_the_shrunk_case(pytester):
    pytester.makepyfile(mypairs=PAIRS, test_user=textwrap.dedent("""\
        import pytest

        import mypairs


        @pytest.mark.refdml_conform("normalize.l2_normalize", framework="numpy", seeds=1,
                                    reference_cases=False, max_examples=5)
        def test_wrong_backward(refdml_conform):
            refdml_conform(mypairs.forward, backward=lambda ctx, d_y: {"x": d_y / ctx[1]})
    """))
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    assert _outcomes(result) == {
        "test_user.py::test_wrong_backward[float64-seed_0]": "FAILED",
        "test_user.py::test_wrong_backward[float64-search]": "FAILED"}
    assert "the search found a disagreement, shrunk to seed=" in result.stdout.str()
    assert "grad x: gradient at (" in result.stdout.str()


@pytest.mark.parametrize("marker, message", [
    ('"normalize.l2_normalize", framework="numpy", dtypes=["bfloat16"]',
     "dtype == 'bfloat16' needs framework 'torch' or 'jax': NumPy has no bfloat16"),
    ('"normalize.l2_normalise", framework="numpy"', "op == 'normalize.l2_normalise' is not in"),
    ('"normalize.l2_normalize"', "needs framework=, one of"),
    ('"normalize.l2_normalize", framework="numpy", seeds=10**6', "seeds == 1000000, must be"),
    ('"normalize.l2_normalize", framework="numpy", dtypes="float32"',
     "dtypes must be a non-empty list of dtype names, got"),
    ('"normalize.l2_normalize", framework="numpy", seed=1', "unknown argument(s) ['seed']"),
])
def test_a_bad_marker_is_a_collection_error_naming_the_argument(pytester, marker, message):
    pytester.makepyfile(mypairs=PAIRS, test_user=textwrap.dedent(f"""\
        import pytest

        import mypairs


        @pytest.mark.refdml_conform({marker})
        def test_it(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)
    """))
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.INTERRUPTED   # errors during collection
    assert message in result.stdout.str()


def test_the_fixture_without_the_marker_says_what_is_missing(pytester):
    pytester.makepyfile(test_user="def test_it(refdml_conform):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret != 0
    assert "uses the refdml_conform fixture without @pytest.mark.refdml_conform" in (
        result.stdout.str() + result.stderr.str())


@pytest.mark.skipif(not Path(__file__).with_name("impls_jax_losses.py").exists(),
                    reason="needs the JAX losses of this folder")
def test_bfloat16_items_with_jax_fail_only_at_the_located_case(pytester):
    pytest.importorskip("jax")
    losses = Path(__file__).with_name("impls_jax_losses.py").read_text()
    pytester.makepyfile(mylosses=losses, test_user=textwrap.dedent("""\
        import pytest

        import mylosses

        CHECK = pytest.mark.refdml_conform("losses.contrastive", framework="jax",
                                           dtypes=["bfloat16"], seeds=2, search=False)


        @CHECK
        def test_correct(refdml_conform):
            refdml_conform(mylosses.contrastive)


        @CHECK
        def test_in_float16(refdml_conform):
            refdml_conform(mylosses.contrastive_in_float16)
    """))
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    outcomes = _outcomes(result)
    failed = {name for name, outcome in outcomes.items() if outcome == "FAILED"}
    assert failed == {"test_user.py::test_in_float16[bfloat16-float32_range_edge]"}, \
        result.stdout.str()
    compared = {name for name, outcome in outcomes.items() if outcome == "PASSED"}
    assert "test_user.py::test_correct[bfloat16-float32_range_edge]" in compared
    assert "grad embeddings: non-finite at (" in result.stdout.str()
