"""The pytest plugin (:mod:`refdml.pytest_plugin`), run by pytest's own
``pytester`` on a small user package with a correct and a broken implementation.

The user's test files import nothing from refdml: the plugin comes from the ``pytest11``
entry point. The expected outcome of every item is derived from the cases' inputs and the
formats' ranges (which squares overflow or vanish), not from the reference's outputs.
"""

from __future__ import annotations

import re
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


def _section(result, test: str) -> list[str]:
    """The lines pytest prints under ``test``'s header in its ERRORS or FAILURES section
    (``____ ERROR at setup of test_it ____`` or ``____ test_it[...] ____``)."""
    header = re.compile(rf"^_+ (ERROR at setup of )?{re.escape(test)} _+$")
    lines = result.outlines
    start = next((k for k, line in enumerate(lines) if header.match(line)), None)
    assert start is not None, f"no section for {test}:\n" + result.stdout.str()
    section = []
    for line in lines[start + 1:]:
        if line.startswith(("____", "====")):
            break
        section.append(line)
    return section


def _no_frames(result) -> None:
    """A marker's problem is reported as its message alone: no traceback, and no frame of
    pluggy, pytest or refdml."""
    out = result.stdout.str() + result.stderr.str()
    for frame in ("Traceback", "pluggy/", "_pytest/", "refdml/pytest_plugin.py",
                  "refdml/conformance/", "Interrupted", "during collection"):
        assert frame not in out, (frame, out)


def _operators() -> list[str]:
    from refdml.catalog import all_operators

    return [spec.name for spec in all_operators()]


GOOD = 'dtypes=["float64", "float32"], seeds=1, reference_cases=False, search=False'


@pytest.mark.parametrize("marker, message", [
    ('"normalize.l2_normalize", framework="numpy", dtypes=["bfloat16"]',
     "dtype == 'bfloat16' needs framework 'torch' or 'jax': NumPy has no bfloat16"),
    ('"normalize.l2_normalise", framework="numpy"',
     "op 'normalize.l2_normalise' is not a catalogued operator (did you mean "
     "normalize.l2_normalize"),
    ('"normalize.l2norm", framework="numpy"',
     "op 'normalize.l2norm' is not a catalogued operator (did you mean normalize.l2_normalize"),
    ('"no.such_thing", framework="numpy"',
     "op 'no.such_thing' is not a catalogued operator; the operators are: "
     + ", ".join(_operators())),
    ('"normalize.l2_normalize"', "needs framework=, one of"),
    ('"normalize.l2_normalize", framework="tensorflow"',
     "framework == 'tensorflow', must be one of ('torch', 'jax', 'numpy', 'cupy')"),
    ('"normalize.l2_normalize", framework="numpy", dtypes=["float8"]',
     "dtype == 'float8', must be one of ('float64', 'float32', 'float16', 'bfloat16')"),
    ('"normalize.l2_normalize", framework="numpy", dtypes=["float128"]',
     "dtype == 'float128', must be one of"),
    ('"normalize.l2_normalize", framework="numpy", seeds=10**6', "seeds == 1000000, must be"),
    ('"normalize.l2_normalize", framework="numpy", dtypes="float32"',
     "dtypes must be a non-empty list of dtype names, got"),
    ('"normalize.l2_normalize", framework="numpy", seed=1',
     "unknown argument(s) ['seed'] (did you mean 'seeds'?); it takes op and"),
    ('"normalize.l2_normalize", framework="numpy", dtype=["float32"]',
     "unknown argument(s) ['dtype'] (did you mean 'dtypes'?); it takes op and"),
])
def test_a_bad_marker_is_one_line_for_that_test_alone(pytester, marker, message):
    """One line naming the argument and the value, as an error of that test; the other
    test of the file still runs (a collection error would have interrupted the session)."""
    pytester.makepyfile(mypairs=PAIRS, test_user=textwrap.dedent(f"""\
        import pytest

        import mypairs


        @pytest.mark.refdml_conform({marker})
        def test_it(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        def test_other():
            pass
    """))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    [line] = _section(result, "test_it")
    assert line.startswith("@pytest.mark.refdml_conform: ") and message in line, line
    _no_frames(result)


def test_a_file_mixing_good_and_bad_markers_runs_to_the_end(pytester):
    """The good markers' items pass; each bad marker, on a test with or without the
    fixture, is one error with its one line; nothing interrupts the session; a test
    skipped by its skip mark is skipped whatever its marker says."""
    pytester.makepyfile(mypairs=PAIRS, test_user=textwrap.dedent(f"""\
        import pytest

        import mypairs

        OP = "normalize.l2_normalize"


        @pytest.mark.refdml_conform(OP, framework="numpy", {GOOD})
        def test_good(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.refdml_conform("normalize.l2norm", framework="numpy")
        def test_typo_in_op(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.refdml_conform(OP, framework="numpy", dtypes=["float8"])
        def test_unknown_dtype(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.refdml_conform(OP, framework="numpy", dtype=["float32"])
        def test_dtype_for_dtypes(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.refdml_conform(OP, framework="tensorflow", dtypes=["float128"])
        def test_without_the_fixture():
            pass


        @pytest.mark.refdml_conform(OP, framework="numpy", device="mps", {GOOD})
        def test_a_device_numpy_has_not(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.refdml_conform(OP, framework="numpy", {GOOD})
        def test_good_again(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @pytest.mark.skip(reason="skipped by its skip mark")
        @pytest.mark.refdml_conform("no.such_thing", framework="numpy")
        def test_skip_mark_first(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)
    """))
    result = pytester.runpytest("-v", "-rs", "-p", "no:cacheprovider")
    outcomes = _outcomes(result)
    good = {f"test_user.py::{test}[{dtype}-seed_0]" for test in ("test_good", "test_good_again")
            for dtype in ("float64", "float32")}
    assert {name for name, outcome in outcomes.items() if outcome == "PASSED"} == good
    # A skip mark is honoured before the marker is checked.
    result.assert_outcomes(passed=4, errors=6, skipped=1)
    assert "skipped by its skip mark" in result.stdout.str()
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    expected = {
        "test_typo_in_op": "op 'normalize.l2norm' is not a catalogued operator (did you mean "
                           "normalize.l2_normalize",
        "test_unknown_dtype": "dtype == 'float8', must be one of",
        "test_dtype_for_dtypes": "unknown argument(s) ['dtype'] (did you mean 'dtypes'?)",
        "test_without_the_fixture": "framework == 'tensorflow', must be one of",
    }
    for test, message in expected.items():
        [line] = _section(result, test)
        assert line.startswith("@pytest.mark.refdml_conform: ") and message in line, line
    for dtype in ("float64", "float32"):   # the device is refused at each item's setup
        [line] = _section(result, f"test_a_device_numpy_has_not[{dtype}-seed_0]")
        assert line == ("@pytest.mark.refdml_conform: device == 'mps', must be None or "
                        "'cpu' for framework 'numpy'"), line
    _no_frames(result)


NEVER_RAN = ("@pytest.mark.refdml_conform's check never ran: the test returned without "
             "calling the refdml_conform fixture; call refdml_conform(your_implementation) "
             "on every path of its body")


def test_a_marked_test_that_does_not_run_its_check_fails(pytester):
    """The false green: a body that never calls the fixture, calls it in a branch not
    taken, or swallows its failure, does not pass; a body that calls it passes, and a skip
    or xfail raised by the body stays a skip or an xfail."""
    pytester.makepyfile(mypairs=PAIRS, test_user=textwrap.dedent("""\
        import pytest

        import mypairs

        CHECK = pytest.mark.refdml_conform("normalize.l2_normalize", framework="numpy",
                                           dtypes=["float64"], seeds=1,
                                           reference_cases=False, search=False)


        @CHECK
        def test_called(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward)


        @CHECK
        def test_forgotten(refdml_conform):
            mypairs.forward


        @CHECK
        def test_in_a_branch_not_taken(refdml_conform):
            if mypairs.forward is None:
                refdml_conform(mypairs.forward, backward=mypairs.backward)


        @CHECK
        def test_swallows_the_failure(refdml_conform):
            try:
                refdml_conform(mypairs.forward, backward=mypairs.backward_without_projection)
            except BaseException:
                pass


        @CHECK
        def test_skips_itself(refdml_conform):
            pytest.skip("skipped by the body")


        @CHECK
        def test_xfails_itself(refdml_conform):
            pytest.xfail("xfailed by the body")


        @CHECK
        @pytest.mark.xfail(strict=True, reason="the planted defect")
        def test_expected_to_fail(refdml_conform):
            refdml_conform(mypairs.forward, backward=mypairs.backward_without_projection)


        @CHECK
        def test_without_the_fixture():
            pass
    """))
    result = pytester.runpytest("-v", "-rA", "-p", "no:cacheprovider")
    item = "test_user.py::{}[float64-seed_0]".format
    outcomes = _outcomes(result)
    assert outcomes[item("test_called")] == "PASSED"
    for test in ("test_forgotten", "test_in_a_branch_not_taken", "test_swallows_the_failure"):
        assert outcomes[item(test)] == "FAILED", test
    assert outcomes[item("test_skips_itself")] == "SKIPPED"
    result.assert_outcomes(passed=1, failed=3, skipped=1, xfailed=2, errors=1)
    assert _section(result, "test_forgotten[float64-seed_0]") == [NEVER_RAN]
    assert _section(result, "test_in_a_branch_not_taken[float64-seed_0]") == [NEVER_RAN]
    # The swallowed failure comes back as the check's own located failure.
    swallowed = _section(result, "test_swallows_the_failure[float64-seed_0]")
    assert swallowed[0] == ("normalize.l2_normalize (numpy, float64): 1 failure in "
                            "'seed 0':"), swallowed
    assert "grad x: gradient at (" in swallowed[1], swallowed
    assert _section(result, "test_without_the_fixture") == [
        "@pytest.mark.refdml_conform on a test that does not take the refdml_conform "
        "fixture: its check never runs; add refdml_conform to the test's arguments and call "
        "refdml_conform(your_implementation) in its body"]
    out = result.stdout.str()
    assert "skipped by the body" in out and "xfailed by the body" in out
    _no_frames(result)


def test_the_fixture_without_the_marker_is_an_error_of_that_test(pytester):
    pytester.makepyfile(test_user=textwrap.dedent("""\
        def test_it(refdml_conform):
            pass


        def test_other():
            pass
    """))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    [line] = _section(result, "test_it")
    assert "uses the refdml_conform fixture without @pytest.mark.refdml_conform" in line
    _no_frames(result)


# conftest.py of a session without JAX: `import jax` raises ModuleNotFoundError. A
# subprocess, so that the JAX that this session may have imported is not seen.
NO_JAX = "import sys\n\nsys.modules['jax'] = None\n"


@pytest.mark.parametrize("strict", [False, True])
def test_a_framework_that_cannot_be_imported_is_a_skip_with_the_clis_reason(pytester,
                                                                           strict):
    """The reason is ``refdml conform``'s; the test's body does not run (it would raise
    the bare ModuleNotFoundError); with ``refdml_conform_strict`` it is an error."""
    pytester.makeconftest(NO_JAX)
    if strict:
        pytester.makeini("[pytest]\nrefdml_conform_strict = true\n")
    pytester.makepyfile(test_user=textwrap.dedent(f"""\
        import pytest


        @pytest.mark.refdml_conform("losses.contrastive", framework="jax", {GOOD})
        def test_contrastive(refdml_conform):
            import jax

            refdml_conform(jax.numpy.sum)


        def test_other():
            pass
    """))
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    reason = ("framework jax: jax cannot be imported (ModuleNotFoundError: import of jax "
              "halted; None in sys.modules); install it to check a jax implementation")
    out = result.stdout.str()
    if strict:
        result.assert_outcomes(passed=1, errors=2)
        for dtype in ("float64", "float32"):
            assert _section(result, f"test_contrastive[{dtype}-seed_0]") == [
                f"{reason} (refdml_conform_strict is set)"]
    else:
        result.assert_outcomes(passed=1, skipped=2)
        assert f"SKIPPED [2] test_user.py:4: {reason}" in out, out
    assert "No module named" not in out   # the bare error of the test's `import jax`
    _no_frames(result)



@pytest.mark.skipif(not Path(__file__).with_name("impls_jax_losses.py").exists(),
                    reason="needs the JAX losses of this folder")
def test_bfloat16_items_with_jax_fail_only_at_the_located_case(jax_first, pytester):
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


def test_the_marker_declares_an_upcast_with_output_dtype(pytester):
    # A float16 check of an implementation that computes and returns float32: it fails
    # saying what it returned, unless the marker declares the upcast.
    pytester.makepyfile(mypairs=PAIRS + textwrap.dedent("""\


        def upcast_forward(x):
            return forward(np.asarray(x, dtype=np.float32))


        def upcast_backward(ctx, d_y):
            return backward(ctx, np.asarray(d_y, dtype=np.float32))
    """), test_user=textwrap.dedent("""\
        import pytest

        import mypairs

        SETTINGS = dict(framework="numpy", dtypes=["float16"], seeds=1,
                        reference_cases=False, search=False)


        @pytest.mark.refdml_conform("normalize.l2_normalize", **SETTINGS)
        def test_undeclared(refdml_conform):
            refdml_conform(mypairs.upcast_forward, backward=mypairs.upcast_backward)


        @pytest.mark.refdml_conform("normalize.l2_normalize", output_dtype="float32", **SETTINGS)
        def test_declared(refdml_conform):
            refdml_conform(mypairs.upcast_forward, backward=mypairs.upcast_backward)
    """))
    result = pytester.runpytest("-v", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    assert "test_declared[float16-seed_0] PASSED" in result.stdout.str()
    result.stdout.fnmatch_lines(["*output 0 is float32, asked for float16*"])
