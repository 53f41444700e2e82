"""check_implementation with the NumPy framework (the pair protocol): correct implementations
pass, planted defects fail with the right cause and location, arguments are validated."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import catalog
from refdml.catalog import Case, ErrorCase
from refdml.conformance import CAUSES, check_implementation
from refdml.conformance._tolerance import compare, conditioning, measure, round_digits

# Small budgets: every check below runs in well under a second.
FAST = dict(seeds=2, search=False)


def _check_pair(forward, backward, op, **kwargs):
    return check_implementation(forward, op, framework="numpy", backward=backward,
                                **{**FAST, **kwargs})


# -- an independent implementation: the contrastive loss as a loop over pairs -------------

@dataclass(frozen=True)
class _LoopContext:
    x: np.ndarray
    terms: tuple[tuple[int, int, float], ...]  # (i, j, sign of d(term)/d(distance))
    n_pairs: int


def loop_contrastive(*, defect: str | None = None):
    """The Euclidean contrastive loss (mean over unordered pairs of ``[d - m+]_+`` for a
    positive pair, ``[m- - d]_+`` for a negative one) written from its definition, with a
    hand backward; ``defect`` plants one mistake."""

    def forward(embeddings, labels, pos_margin, neg_margin):
        x = np.asarray(embeddings, dtype=np.float64)
        n = x.shape[0]
        value, terms = 0.0, []
        for i in range(n):
            for j in range(i + 1, n):
                d = float(np.sqrt(np.sum((x[i] - x[j]) ** 2)))
                if labels[i] == labels[j]:
                    if d > pos_margin:
                        value += d - pos_margin
                        terms.append((i, j, 1.0))
                elif d < neg_margin and defect != "drop negatives":
                    value += neg_margin - d
                    terms.append((i, j, -1.0))
        n_pairs = n * (n - 1) // 2
        return value / n_pairs, _LoopContext(x, tuple(terms), n_pairs)

    def backward(ctx, d_value):
        grad = np.zeros_like(ctx.x)
        scale = float(d_value) / ctx.n_pairs
        for i, j, sign in ctx.terms:
            diff = ctx.x[i] - ctx.x[j]
            d = np.sqrt(np.sum(diff ** 2))
            if defect == "nan at zero distance" or d > 0:
                unit = diff / d
            else:
                unit = np.zeros_like(diff)  # the subgradient 0 at a coincident pair
            grad[i] += scale * sign * unit
            grad[j] -= scale * sign * unit
        if defect == "scaled element":
            grad[2, 1] *= 1.5
        return {"embeddings": grad}

    return forward, backward


def _with_entry(monkeypatch, name, **changes):
    """Replace a catalogue entry for one test (its own hard cases, errors, invariants)."""
    spec = dataclasses.replace(catalog.get(name), **changes)
    monkeypatch.setitem(catalog._CATALOGUE, name, spec)
    return spec


def _duplicate_points(rng):
    inputs = dict(catalog.get("losses.contrastive").make_inputs(np.random.default_rng(0)))
    x = inputs["embeddings"].copy()
    # Rows 0 and 3 have different labels (make_inputs' labels start 0 0 0 1 1): a negative
    # pair at distance 0, whose hinge is active.
    assert inputs["labels"][0] != inputs["labels"][3]
    x[3] = x[0]
    inputs["embeddings"] = x
    return (Case("duplicate points", inputs, "a negative pair at distance 0"),
            Case("float32 only", inputs, "admitted at float32 only", dtypes=("float32",)))


# -- correct implementations pass -----------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("spec", catalog.all_operators(), ids=lambda s: s.name)
def test_reference_and_mirror_pairs_pass(spec, dtype):
    """refdml's own pair and its fast-path mirror agree with the reference on make_inputs.

    The mirrors are held to make_inputs only: some use the Gram identity and are known to
    lose digits on the hard cases (nearby points), which is what a conformance check
    reports for them, and what the reference cases are for.
    """
    report = _check_pair(spec.forward, spec.backward, spec.name, dtype=dtype, seeds=1,
                         reference_cases=False, error_cases=False)
    assert report.passed, report.summary()
    assert report.cases == ("seed 0",)
    if spec.mirror is not None:
        forward, backward = spec.mirror_pair()
        report = _check_pair(forward, backward, spec.name, dtype=dtype, seeds=1,
                             reference_cases=False, error_cases=False)
        assert report.passed, report.summary()


@pytest.mark.parametrize("spec", [s for s in catalog.all_operators()
                                  if s.reference_inputs is not None],
                         ids=lambda s: s.name)
def test_reference_pair_passes_its_reference_cases(spec):
    report = _check_pair(spec.forward, spec.backward, spec.name, seeds=1)
    assert report.passed, report.summary()
    assert len(report.cases) >= 2
    # The reference refuses none of its own error inputs.
    assert all(o.outcome == "refused" for o in report.error_outcomes), report.summary()


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16"])
def test_independent_loop_implementation_passes(monkeypatch, dtype):
    _with_entry(monkeypatch, "losses.contrastive", reference_inputs=_duplicate_points)
    forward, backward = loop_contrastive()
    # The loop computes in float64 whatever it is given: in float16 it says so.
    upcast = {"output_dtype": "float64"} if dtype == "float16" else {}
    report = _check_pair(forward, backward, "losses.contrastive", dtype=dtype, seeds=3,
                         search=True, max_examples=5, **upcast)
    assert report.passed, report.summary()
    expected = ["seed 0", "seed 1", "seed 2", "duplicate points"]
    if dtype == "float32":
        expected.append("float32 only")
    assert list(report.cases) == expected
    assert report.search is not None and report.search.examples > 0
    assert report.summary().splitlines()[-1].startswith(f"PASS losses.contrastive (numpy, {dtype})")
    # Every quantity of every case has its tolerance stated: max(base, 16 eps_dtype kappa).
    eps = float(np.finfo(dtype).eps)
    quantities = {(t.case, t.quantity) for t in report.tolerances}
    assert quantities == {(case, q) for case in report.cases
                          for q in ("output 0", "grad embeddings")}
    for t in report.tolerances:
        assert t.kappa >= 1.0
        assert_allclose(t.rtol, max(t.base, 16 * eps * t.kappa), rtol=1e-12)


def test_adapter_maps_the_signature():
    forward, backward = loop_contrastive()

    def my_loss(x, y, margins):
        return forward(x, y, *margins)

    report = check_implementation(
        my_loss, "losses.contrastive", framework="numpy", backward=backward,
        adapter=lambda impl, inputs: impl(inputs["embeddings"], inputs["labels"],
                                          (inputs["pos_margin"], inputs["neg_margin"])),
        reference_cases=False, **FAST)
    assert report.passed, report.summary()


# -- planted defects fail with the right cause and location -----------------------------------

def test_gradient_wrong_on_one_element_is_located():
    forward, backward = loop_contrastive(defect="scaled element")
    report = _check_pair(forward, backward, "losses.contrastive", seeds=3,
                         reference_cases=False, error_cases=False)
    assert not report.passed
    assert len(report.failures) == 3, report.summary()
    for failure in report.failures:
        assert (failure.cause, failure.quantity, failure.index) == (
            "gradient", "grad embeddings", (2, 1))
        # The planted factor, seen through the report's two values.
        assert_allclose(failure.impl_value, 1.5 * failure.ref_value, rtol=1e-9)
        assert failure.error > failure.tolerance
    assert report.summary().splitlines()[-1] == (
        "FAIL losses.contrastive (numpy, float64): 3 failures in 3 of 3 cases: gradient x3")


def test_nan_at_zero_distance_is_non_finite(monkeypatch):
    _with_entry(monkeypatch, "losses.contrastive", reference_inputs=_duplicate_points)
    forward, backward = loop_contrastive(defect="nan at zero distance")
    report = _check_pair(forward, backward, "losses.contrastive", error_cases=False)
    assert [(f.case, f.cause, f.quantity) for f in report.failures] == [
        ("duplicate points", "non-finite", "grad embeddings")]
    failure = report.failures[0]
    assert failure.index == (0, 0)  # row 0, the first row of the coincident pair
    assert np.isnan(failure.impl_value) and np.isfinite(failure.ref_value)
    assert list(report.failures_by_cause()) == ["non-finite"]


def test_forward_that_drops_a_term_fails_on_the_value():
    forward, backward = loop_contrastive(defect="drop negatives")
    report = _check_pair(forward, backward, "losses.contrastive", reference_cases=False)
    values = [f for f in report.failures if f.quantity == "output 0"]
    assert [f.cause for f in values] == ["value", "value"]
    for failure in values:
        assert failure.index == ()  # a scalar loss
        assert failure.impl_value < failure.ref_value  # the dropped terms are positive
        assert failure.error > failure.tolerance


def test_solver_stopped_early_gets_the_not_converged_hint():
    spec = catalog.get("ot.entropic_ot")

    def early(**inputs):
        # Stands for an implementation whose own stopping rule is loose.
        return spec.forward(**dict(inputs, tol=1e-4))

    report = _check_pair(early, spec.backward, "ot.entropic_ot", reference_cases=False,
                         error_cases=False)
    assert not report.passed
    values = [f for f in report.failures if f.quantity == "output 0"]
    assert [f.cause for f in values] == ["value", "value"], report.summary()
    for failure in values:
        assert failure.hint is not None and "tol=0.0001" in failure.hint
        assert "not converged" in failure.hint
    assert "hint: not converged" in report.summary()


def test_wrong_output_shape_and_count_are_structure():
    forward, backward = loop_contrastive()

    def as_vector(**inputs):
        value, ctx = forward(**inputs)
        return np.array([value]), ctx

    report = _check_pair(as_vector, backward, "losses.contrastive", reference_cases=False,
                         error_cases=False)
    assert {(f.cause, f.quantity) for f in report.failures} == {("structure", "output 0")}
    assert "shape (1,)" in report.failures[0].message
    # No error to state: NaN in the report, a string in its JSON form.
    assert np.isnan(report.failures[0].error)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["failures"][0]["error"] == "nan" and data["failures"][0]["index"] is None

    spec = catalog.get("gsp.pool")

    def pooled_only(**inputs):
        (pooled, _), ctx = spec.forward(**inputs)
        return pooled, ctx

    report = _check_pair(pooled_only, spec.backward, "gsp.pool", reference_cases=False,
                         error_cases=False)
    assert {(f.cause, f.quantity) for f in report.failures} == {("structure", "outputs")}
    assert "1 output(s), the reference 2" in report.failures[0].message


def test_raising_forward_and_backward():
    forward, backward = loop_contrastive()

    def boom(**inputs):
        raise RuntimeError("boom in forward")

    report = _check_pair(boom, backward, "losses.contrastive", reference_cases=False,
                         error_cases=False)
    assert [(f.cause, f.quantity) for f in report.failures] == [("raised", "forward")] * 2
    assert "RuntimeError: boom in forward" in report.failures[0].message

    def bad_backward(ctx, d_value):
        raise FloatingPointError("boom in backward")

    report = _check_pair(forward, bad_backward, "losses.contrastive", reference_cases=False,
                         error_cases=False)
    # The forward's values are still compared (and agree): only the gradients are blamed.
    assert [(f.cause, f.quantity) for f in report.failures] == [("raised", "gradients")] * 2
    assert "FloatingPointError: boom in backward" in report.failures[0].message


def test_missing_gradient():
    forward, _ = loop_contrastive()
    report = _check_pair(forward, lambda ctx, d_value: {}, "losses.contrastive",
                         reference_cases=False, error_cases=False)
    assert [(f.cause, f.quantity) for f in report.failures] == [
        ("missing gradient", "grad embeddings")] * 2


def test_constraint_residual(monkeypatch):
    def unit_rows(inputs, outputs):
        norms = np.linalg.norm(outputs[0], axis=-1)
        return {"unit rows": float(np.max(np.abs(norms - 1.0)))}

    spec = _with_entry(monkeypatch, "normalize.l2_normalize", invariants=unit_rows,
                       reference_inputs=None, error_inputs=None)

    def stretched(**inputs):
        y, ctx = spec.forward(**inputs)
        return y * (1 + 1e-3), ctx

    report = _check_pair(stretched, spec.backward, "normalize.l2_normalize")
    constraint = [f for f in report.failures if f.cause == "constraint"]
    assert [f.quantity for f in constraint] == ["unit rows", "unit rows"]
    assert_allclose([f.error for f in constraint], 1e-3, rtol=1e-6)
    # The reference itself satisfies it.
    assert _check_pair(spec.forward, spec.backward, "normalize.l2_normalize").passed


def test_error_inputs_are_reported_never_failed(monkeypatch):
    def errors(rng):
        return (ErrorCase("nan embeddings", {"embeddings": np.full((4, 2), np.nan),
                                             "labels": np.array([0, 0, 1, 1]),
                                             "pos_margin": 0.2, "neg_margin": 0.9},
                          ValueError, "embeddings"),
                ErrorCase("negative margin", {"embeddings": np.eye(4, 2),
                                              "labels": np.array([0, 0, 1, 1]),
                                              "pos_margin": -0.2, "neg_margin": 0.9},
                          ValueError, "pos_margin"))

    _with_entry(monkeypatch, "losses.contrastive", error_inputs=errors, reference_inputs=None)
    forward, backward = loop_contrastive()  # refuses nothing (its comparisons skip a NaN)
    report = _check_pair(forward, backward, "losses.contrastive")
    assert report.passed
    assert [(o.case, o.outcome) for o in report.error_outcomes] == [
        ("nan embeddings", "returned finite"), ("negative margin", "returned finite")]
    assert "refused 0 of 2 error inputs" in report.verdict()

    def total(embeddings, labels, pos_margin, neg_margin):
        return np.sum(embeddings), None

    report = _check_pair(total, backward, "losses.contrastive")
    assert [o.outcome for o in report.error_outcomes] == [
        "returned non-finite", "returned finite"]

    spec = catalog.get("losses.contrastive")
    report = _check_pair(spec.forward, spec.backward, "losses.contrastive")
    assert [o.outcome for o in report.error_outcomes] == ["refused", "refused"]

    def keyerror(**inputs):
        raise KeyError("labels")

    report = check_implementation(keyerror, "losses.contrastive", framework="numpy",
                                  backward=backward, seeds=1, search=False)
    assert [o.outcome for o in report.error_outcomes] == ["raised another type"] * 2


def test_search_shrinks_to_a_minimal_case():
    forward, backward = loop_contrastive(defect="scaled element")
    report = _check_pair(forward, backward, "losses.contrastive", seeds=1,
                         reference_cases=False, error_cases=False, search=True,
                         max_examples=5)
    search = report.search
    # The defect shows on every draw, so hypothesis shrinks to its smallest one.
    assert search.found and (search.seed, search.digits) == (0, 2)
    assert report.cases[-1] == "search seed=0 digits=2"
    assert {f.cause for f in search.failures} == {"gradient"}
    data = report.to_dict()
    json.dumps(data, allow_nan=False)
    assert data["search"]["seed"] == 0 and data["search"]["digits"] == 2
    # The minimal case's inputs are make_inputs(seed 0) rounded to 2 significant digits.
    expected = catalog.get("losses.contrastive").make_inputs(np.random.default_rng(0))
    assert_allclose(np.array(data["search"]["inputs"]["embeddings"]),
                    round_digits(expected["embeddings"], 2), rtol=1e-15)


def test_report_to_dict_and_summary():
    forward, backward = loop_contrastive(defect="nan at zero distance")
    report = _check_pair(forward, backward, "losses.contrastive", reference_cases=False)
    data = report.to_dict()
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["passed"] is True and data["op"] == "losses.contrastive"
    forward, backward = loop_contrastive(defect="drop negatives")
    report = _check_pair(forward, backward, "losses.contrastive", reference_cases=False,
                         error_cases=False)
    data = report.to_dict()
    json.dumps(data, allow_nan=False)
    assert data["passed"] is False and len(data["failures"]) == len(report.failures)
    summary = report.summary()
    assert summary.splitlines()[-1] == report.verdict()
    assert re.search(r"^value \(2\):", summary, re.M)
    assert set(report.failures_by_cause()) <= set(CAUSES)


# -- tolerance machinery ----------------------------------------------------------------------

def test_compare_is_normwise_relative():
    found = compare(np.array([1.0, 2.0, 10.0]), np.array([1.0, 2.5, 10.0]), 0.0)
    assert found.index == (1,)
    assert_allclose(found.error, 0.5 / 10.0, rtol=1e-15)
    # An all-zero reference is measured against the fallback scale.
    found = compare(np.array([0.0, 1e-3]), np.zeros(2), 2.0)
    assert_allclose(found.error, 1e-3 / 2.0, rtol=1e-15)


def test_conditioning_measures_cancellation():
    # f(x) = x - 1 at x = 1 + 1e-4: a relative move r of x moves f by r (1 + 1e-4) / 1e-4.
    x = np.array([1.0 + 1e-4])
    kappa = conditioning(lambda inputs: {"output 0": inputs["x"] - 1.0}, {"x": x},
                         {"output 0": x - 1.0}, np.random.default_rng(0))
    assert 10.0 < kappa["output 0"] <= (1 + 1e-4) / 1e-4 * 1.001
    kappa = conditioning(lambda inputs: {"output 0": 2.0 * inputs["x"]}, {"x": x},
                         {"output 0": 2.0 * x}, np.random.default_rng(0))
    assert kappa["output 0"] == 1.0  # floored at 1


def test_conditioning_tells_a_jump_from_a_steep_slope():
    # The gradient of max(x0, x1) at the tie x0 == x1 (ties go to the first): under any
    # move with u1 > u0, however small, it jumps from (1, 0) to (0, 1). x2's entry, 0.5 x2,
    # is smooth: it stays in the comparison and sets kappa.
    def grad_of_max(inputs):
        x = inputs["x"]
        grad = np.zeros(3)
        grad[int(np.argmax(x[:2]))] = 1.0
        grad[2] = 0.5 * x[2]
        return {"grad x": grad}
    x = np.array([1.0, 1.0, 2.0])
    found = measure(grad_of_max, {"x": x}, grad_of_max({"x": x}), np.random.default_rng(0))
    assert found["grad x"].jumps is not None
    assert found["grad x"].jumps.tolist() == [True, True, False]
    assert found["grad x"].kappa == 1.0   # 0.5 x2 moves like x2: slope 1, floored at 1
    # Where every element jumps, the whole quantity is unresolved: kappa = inf.
    def first_of_tie(inputs):
        return {"grad x": grad_of_max(inputs)["grad x"][:2]}
    kappa = conditioning(first_of_tie, {"x": x}, first_of_tie({"x": x}),
                         np.random.default_rng(0))
    assert kappa["grad x"] == np.inf
    # A steep but smooth quantity, sin(1e5 x) near a zero: kappa = |x f'(x) / f(x)|, large
    # but finite: its change shrinks with the step.
    x = np.array([(np.pi - 1e-3) / 1e5])   # near a zero of sin: kappa ~ 3e3, above JUMP_FLOOR
    def steep(inputs):
        return {"output 0": np.sin(1e5 * inputs["x"])}
    kappa = conditioning(steep, {"x": x}, {"output 0": np.sin(1e5 * x)},
                         np.random.default_rng(0))
    expected = abs(1e5 * x[0] / np.tan(1e5 * x[0]))  # |x f'(x) / f(x)|, the relative slope
    # The move of x is r * u with u uniform in (-1, 1): kappa is |u| times the slope, for
    # the larger |u| of two draws (so at most the slope, and not orders below it).
    assert np.isfinite(kappa["output 0"])
    assert expected / 20 < kappa["output 0"] <= 1.01 * expected


def test_round_digits():
    assert_allclose(round_digits(np.array([123456.0, -0.0012345, 0.0]), 2),
                    [120000.0, -0.0012, 0.0], rtol=1e-15)


# -- argument validation ----------------------------------------------------------------------

def _call(**changes):
    forward, backward = loop_contrastive()
    kwargs = dict(framework="numpy", backward=backward, seeds=1, search=False)
    kwargs.update(changes)
    impl = kwargs.pop("impl", forward)
    op = kwargs.pop("op", "losses.contrastive")
    return check_implementation(impl, op, **kwargs)


@pytest.mark.parametrize("changes, error, match", [
    (dict(impl=3), TypeError, "impl must be callable"),
    (dict(op="losses.nope"), ValueError, r"op == 'losses.nope'.*gsp\.pool"),
    (dict(op=3), TypeError, "op must be"),
    (dict(framework="tensorflow"), ValueError, "framework == 'tensorflow'"),
    (dict(framework=None), TypeError, "framework must be one of"),
    (dict(dtype="int32"), ValueError, "dtype == 'int32'"),
    (dict(dtype=3), TypeError, "dtype must be one of"),
    # None would be NumPy's float64: a default silently put in place of a missing value.
    (dict(dtype=None), TypeError, r"dtype must be one of .*got None"),
    (dict(dtype=np.int32), ValueError, "dtype == 'int32'"),
    (dict(dtype="bfloat16"), ValueError,
     "dtype == 'bfloat16' needs framework 'torch' or 'jax': NumPy has no bfloat16"),
    (dict(backward=None), TypeError, "needs backward="),
    (dict(backward=3), TypeError, "backward must be callable"),
    (dict(framework="torch"), ValueError, "backward is given for framework == 'torch'"),
    (dict(framework="jax"), ValueError, "backward is given for framework == 'jax'"),
    (dict(adapter=3), TypeError, "adapter must be None or callable"),
    (dict(device="cuda"), ValueError, "device == 'cuda'"),
    (dict(device=0), TypeError, "device must be None or a string"),
    (dict(seeds=0), ValueError, "seeds == 0"),
    (dict(seeds=1.5), TypeError, "seeds must be an integer"),
    (dict(seeds=True), TypeError, "seeds must be an integer"),
    (dict(seeds=10**9), ValueError, "seeds == 1000000000, must be <= 1000"),
    (dict(reference_cases="yes"), TypeError, "reference_cases must be True or False"),
    (dict(error_cases=1), TypeError, "error_cases must be True or False"),
    (dict(search=None), TypeError, "search must be True or False"),
    (dict(max_examples=0), ValueError, "max_examples == 0"),
    (dict(max_examples=10**7), ValueError, "max_examples == 10000000, must be <= 10000"),
    (dict(rng=-1), ValueError, "rng == -1"),
    (dict(rng=1.5), TypeError, "rng must be None, an int or a numpy Generator"),
])
def test_arguments_are_validated(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


def test_a_refused_argument_starts_no_work():
    calls = []

    def impl(**inputs):
        calls.append(inputs)
        raise AssertionError("called")

    with pytest.raises(ValueError, match="seeds == 1000000000"):
        check_implementation(impl, "losses.contrastive", framework="numpy",
                             backward=lambda ctx, *d: {}, seeds=10**9)
    assert calls == []


def test_dtype_accepts_numpy_dtypes():
    assert _call(dtype=np.float32).dtype == "float32"


def test_numpy_pair_must_return_a_pair():
    forward, backward = loop_contrastive()
    report = _call(impl=lambda **inputs: forward(**inputs)[0], reference_cases=False,
                   error_cases=False)
    assert [(f.cause, f.quantity) for f in report.failures] == [("structure", "outputs")]
    assert "pair (outputs, ctx)" in report.failures[0].message


def test_search_assumes_away_inputs_the_reference_refuses(monkeypatch):
    spec = catalog.get("losses.contrastive")

    def every_other_refused(rng):
        inputs = dict(spec.make_inputs(rng))
        if rng.integers(2):
            inputs["embeddings"] = np.full_like(inputs["embeddings"], np.nan)
        return inputs

    _with_entry(monkeypatch, "losses.contrastive", make_inputs=every_other_refused,
                reference_inputs=None, error_inputs=None)
    forward, backward = loop_contrastive()
    report = _check_pair(forward, backward, "losses.contrastive", seeds=4, search=True,
                         max_examples=6)
    assert report.passed, report.summary()
    # Seeds whose inputs the reference refuses are skipped, with the reason, not compared.
    assert report.skipped and all("raised ValueError" in why for _, why in report.skipped)
    assert len(report.cases) + len(report.skipped) == 4
    assert report.search.examples > 0 and not report.search.found

    _with_entry(monkeypatch, "losses.contrastive",
                make_inputs=lambda rng: dict(spec.make_inputs(rng), pos_margin=-1.0))
    report = _check_pair(forward, backward, "losses.contrastive", search=True,
                         max_examples=3)
    assert report.search.examples == 0
    assert report.search.note == "the reference refused every draw"
    assert not report.passed
    assert report.verdict() == (
        "FAIL losses.contrastive (numpy, float64): no case compared (the reference refused all 2)")


def test_elements_where_the_reference_jumps_are_left_out_and_no_others():
    # losses.contrastive's "duplicate points" case: the rows of coincident points jump (the
    # subgradient 0 of ||x_i - x_j|| at 0 is one choice of many), the others are compared.
    # A backward wrong by 50% on one row that coincides with no other must still fail there.
    spec = catalog.get("losses.contrastive")
    (case,) = [c for c in spec.reference_inputs(np.random.default_rng(0))
               if c.name == "duplicate points"]
    x = case.inputs["embeddings"]
    apart = np.linalg.norm(x[:, None] - x[None], axis=-1) + np.eye(len(x))
    coincident = np.flatnonzero(np.any(apart == 0.0, axis=1))
    clear = int(np.setdiff1d(np.arange(len(x)), coincident)[0])

    def backward(ctx, d_value):
        grads = spec.backward(ctx, d_value)
        wrong = np.array(grads.embeddings, copy=True)
        wrong[clear] *= 1.5
        return {"embeddings": wrong}

    report = check_implementation(spec.forward, "losses.contrastive", framework="numpy",
                                  backward=backward, seeds=1, search=False,
                                  error_cases=False)
    duplicate = [f for f in report.failures if f.case == "duplicate points"]
    assert [(f.quantity, f.cause, f.index[0]) for f in duplicate] == [
        ("grad embeddings", "gradient", clear)]
    jumping = [t for t in report.tolerances
               if t.case == "duplicate points" and t.quantity == "grad embeddings"]
    assert jumping[0].resolved and jumping[0].jumping > 0
    assert jumping[0].jumping <= coincident.size * x.shape[1]


def _reference_with_offset(spec, offset, case_name):
    """The reference pair, its value moved by ``offset`` on the named hard case only."""
    target = {c.name: c for c in spec.reference_inputs(np.random.default_rng(0))}[case_name]

    def forward(**inputs):
        value, ctx = spec.forward(**inputs)
        same = all(np.array_equal(np.asarray(inputs[k]), np.asarray(target.inputs[k]))
                   for k in ("x", "y"))
        return (value + offset if same else value), ctx

    return forward


@pytest.mark.parametrize("offset, passes", [(1e-16, True), (1e-12, True), (1e-9, False)])
def test_a_quantity_that_cancels_to_zero_is_held_to_the_cancelling_terms(offset, passes):
    # ot.sinkhorn_divergence of a cloud with itself is 0 by cancellation: the reference
    # returns rounding noise (~1e-16) there, so a relative error means nothing. The case's
    # scale_inputs give the size of the terms that cancel (the clouds apart), and an offset
    # within the base tolerance (1e-10 in float64) of them agrees: 1e-16 and 1e-12 do,
    # 1e-9 does not.
    spec = catalog.get("ot.sinkhorn_divergence")
    case_name = "identical clouds (SD == 0)"
    forward = _reference_with_offset(spec, offset, case_name)
    report = check_implementation(forward, "ot.sinkhorn_divergence", framework="numpy",
                                  backward=spec.backward, seeds=1, search=False,
                                  error_cases=False)
    identical = [f for f in report.failures if f.case == case_name]
    assert (not identical) == passes, report.summary()
    if not passes:
        assert [(f.quantity, f.cause) for f in identical] == [("output 0", "value")]
    case = {c.name: c for c in spec.reference_inputs(np.random.default_rng(0))}[case_name]
    terms = abs(float(spec.forward(**case.scale_inputs)[0]))
    floor = [t for t in report.tolerances
             if t.case == case_name and t.quantity == "output 0"][0]
    assert_allclose(floor.atol, spec.mirror_tolerance("float64") * terms, rtol=1e-6)


def test_ot_cases_scale_the_base_tolerance_by_their_cost_over_eps():
    spec = catalog.get("ot.sinkhorn_divergence")
    report = check_implementation(spec.forward, "ot.sinkhorn_divergence", framework="numpy",
                                  backward=spec.backward, dtype="float32", seeds=1,
                                  search=False, error_cases=False)

    def cost_over_eps(inputs):  # independently of the catalogue's helper: all the points
        points = np.concatenate([inputs["x"], inputs["y"]])
        gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)
        return float(np.max(gaps) ** inputs["p"]) / inputs["eps"]

    calibration = max(cost_over_eps(spec.make_inputs(np.random.default_rng(k)))
                      for k in range(3))
    cases = {c.name: c for c in spec.reference_inputs(np.random.default_rng(0))}
    name = "small eps (1/100 of the largest cost)"
    # The float32-rounded inputs the check used: the ratio is the same to float32's precision.
    expected = spec.mirror_tolerance("float32") * cost_over_eps(cases[name].inputs) / calibration
    base = {t.base for t in report.tolerances if t.case == name}
    assert len(base) == 1 and abs(base.pop() / expected - 1.0) < 1e-5
    # make_inputs itself keeps the catalogue's tolerance.
    assert {t.base for t in report.tolerances if t.case == "seed 0"} == {
        spec.mirror_tolerance("float32")}


def test_measure_sees_the_reference_rounding_noise_and_not_its_slope():
    rng = np.random.default_rng(0)
    x = rng.uniform(1.0, 2.0, 50)
    # (x + 1e4) - 1e4 - x is 0 exactly, computed with about eps * 1e4 of rounding error.
    def cancelling(inputs):
        return {"output 0": (inputs["x"] + 1e4) - 1e4 - inputs["x"]}
    noisy = measure(cancelling, {"x": x}, cancelling({"x": x}), np.random.default_rng(1))
    eps = np.finfo(np.float64).eps
    assert eps < noisy["output 0"].noise <= 4 * eps * 1e4
    # 3 x moves by 3 x r, the slope: removed, leaving at most a few ulps of 3 x.
    def linear(inputs):
        return {"output 0": 3.0 * inputs["x"]}
    smooth = measure(linear, {"x": x}, linear({"x": x}), np.random.default_rng(1))
    assert smooth["output 0"].noise <= 4 * eps * 6.0
