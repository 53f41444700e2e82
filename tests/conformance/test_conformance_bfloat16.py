"""``check_implementation`` in bfloat16 and float16, with JAX (which CI has): the
independent JAX implementations of tests/conformance/impls_jax*.py, correct and broken,
held to the reference at the tolerance derived from each format's significand.

* The correct ones pass in bfloat16, on the seeds and on the hard cases bfloat16's range
  admits (float32's: ``"float32 range edge"``, ``"float32 edge"``), and the float64-only
  cases are listed as skipped with the reason.
* Each planted defect fails with its cause at the case that exposes it. One of them
  (``contrastive_in_float16``: mixed precision with the wrong half type) is right to
  bfloat16's precision on every ordinary batch and wrong only at the float32-range case.
* float16 against the same standard: the same correct losses and GSP layer pass, and a
  case whose hyperparameter float16 cannot hold is skipped, with the reason.

Expected locations come from the cases' inputs (NumPy), never from the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import impls_jax as gsp_ot  # noqa: E402  (needs JAX)
import impls_jax_losses as losses  # noqa: E402

from refdml.catalog import get  # noqa: E402
from refdml.conformance import check_implementation, get_framework  # noqa: E402
from refdml.conformance._formats import FORMATS  # noqa: E402

F64_ONLY = "the entry states it for float64 only: its extremes probe that range, not {}'s"


def check(impl, op, dtype="bfloat16", **options):
    options = {"seeds": 2, "search": False, "error_cases": False, **options}
    return check_implementation(impl, op, framework="jax", dtype=dtype, **options)


def stated_for(op, dtypes):
    """The names of the entry's reference cases stated for exactly ``dtypes``."""
    return {c.name for c in get(op).reference_inputs(np.random.default_rng(0))
            if c.dtypes == dtypes}


# ------------------------------------------------------------------------- the adapter


def test_jax_arrays_in_bfloat16_hold_the_rounded_values():
    fw = get_framework("jax")
    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, np.pi, -1e-40, 3e38, 1e39])
    array = fw.asarray(x, "bfloat16")
    assert array.dtype == jnp.bfloat16
    # Returned as is: an arithmetic operation would flush the subnormal (XLA's CPU runs
    # with flush-to-zero).
    evaluation = fw.run(lambda i: i["x"], {"x": array}, ("x",), None)
    with np.errstate(over="ignore"):
        assert_array_equal(evaluation.outputs[0], FORMATS["bfloat16"].round(x))
    assert_array_equal(evaluation.outputs[0][:2], [1.0, 1.0 + 2.0 ** -6])  # ties to even


def test_the_vjp_in_bfloat16_is_the_derivative_to_bfloat16_precision():
    fw = get_framework("jax")
    x = FORMATS["bfloat16"].round(np.linspace(-2.0, 2.0, 7))
    cotangent = FORMATS["bfloat16"].round(np.linspace(0.5, 1.5, 7))
    evaluation = fw.run(lambda i: jnp.sin(i["x"]), {"x": fw.asarray(x, "bfloat16")}, ("x",),
                        (cotangent,))
    # One bfloat16 rounding of cos(x) * cotangent, at most: half an ulp, relative 2**-8.
    np.testing.assert_allclose(evaluation.grads["x"], np.cos(x) * cotangent, rtol=2.0 ** -7)


# ---------------------------------------------------------------------- correct ones


@pytest.mark.parametrize("impl, op, hard_cases", [
    (losses.contrastive, "losses.contrastive", {"duplicate points", "float32 range edge"}),
    (losses.triplet, "losses.triplet", {"duplicate points", "exact ties", "float32 range edge"}),
    (losses.proxy_nca, "losses.proxy_nca", {"small temperature", "float32 range edge"}),
    (gsp_ot.gsp_pool, "gsp.pool", {"mu == 1 (GAP, Thm 4.1)", "float32 edge"}),
], ids=["contrastive", "triplet", "proxy_nca", "gsp_pool"])
def test_correct_implementations_pass_in_bfloat16(impl, op, hard_cases):
    report = check(impl, op)
    assert report.passed, report.summary()
    # The float32 cases are admitted by bfloat16's range, and compared.
    assert hard_cases <= set(report.cases), report.cases
    # The float64 ones are not, and the report says so.
    skipped = dict(report.skipped)
    assert set(skipped) == stated_for(op, ("float64",))
    assert set(skipped.values()) == {F64_ONLY.format("bfloat16")}
    # The tolerance is the rule at bfloat16's eps: 16 * 2**-7 at kappa 1.
    assert {t.base for t in report.tolerances} == {0.125}
    assert "skipped (not representable in bfloat16" in report.summary()


def test_sinkhorn_in_bfloat16_passes_and_the_small_eps_case_is_beyond_it():
    op = "ot.sinkhorn_divergence"
    report = check(gsp_ot.sinkhorn_divergence, op)
    assert report.passed, report.summary()
    beyond = {t.case for t in report.tolerances if t.beyond_dtype}
    small_eps = {c.name for c in get(op).reference_inputs(np.random.default_rng(0))
                 if c.name.startswith("small eps")}
    # At eps a hundredth of the largest cost the solve amplifies roundoff ~17 times more
    # than at make_inputs' eps: 17 * 16 * 2**-7 > 1, no digit of bfloat16 is left.
    assert beyond == small_eps, beyond
    assert all(t.rtol == np.inf for t in report.tolerances if t.beyond_dtype)
    assert "beyond bfloat16" in report.summary()
    # In float32 the same case is compared by value.
    float32 = check(gsp_ot.sinkhorn_divergence, op, "float32", seeds=1)
    assert float32.passed and not any(t.beyond_dtype for t in float32.tolerances)


# -------------------------------------------------------------------- planted defects


def test_computing_in_float16_fails_only_where_bfloat16s_range_is_needed():
    report = check(losses.contrastive_in_float16, "losses.contrastive")
    assert {(f.case, f.quantity, f.cause) for f in report.failures} == {
        ("float32 range edge", "output 0", "value"),
        ("float32 range edge", "grad embeddings", "non-finite")}, report.summary()
    x = dict({c.name: c.inputs for c in get("losses.contrastive").reference_inputs(
        np.random.default_rng(0))})["float32 range edge"]["embeddings"]
    assert np.max(np.abs(x)) > FORMATS["float16"].max      # why: beyond float16's range
    assert np.max(np.abs(x)) < FORMATS["bfloat16"].max      # and within bfloat16's
    # Where float16's range suffices it is more precise than bfloat16: a pass.
    assert check(losses.contrastive_in_float16, "losses.contrastive",
                 reference_cases=False).passed


def test_a_naive_softmax_fails_in_bfloat16_at_the_small_temperature():
    report = check(losses.proxy_nca_naive_softmax, "losses.proxy_nca")
    assert {f.case for f in report.failures} == {"small temperature"}, report.summary()
    assert {f.cause for f in report.failures} == {"non-finite"}


def test_a_sqrt_norm_is_nan_in_bfloat16_at_the_duplicate_points():
    report = check(losses.contrastive_nan_at_ties, "losses.contrastive")
    assert {(f.case, f.quantity, f.cause) for f in report.failures} == {
        ("duplicate points", "grad embeddings", "non-finite")}, report.summary()
    x = FORMATS["bfloat16"].round(dict({c.name: c.inputs for c in get(
        "losses.contrastive").reference_inputs(np.random.default_rng(0))})[
        "duplicate points"]["embeddings"])
    coincident = {i for i in range(len(x)) for j in range(len(x))
                  if i != j and np.array_equal(x[i], x[j])}
    assert report.failures[0].index[0] in coincident


def _active_fraction(inputs) -> float:
    """Active triplets / valid triplets of ``inputs`` (NumPy, at bfloat16's values)."""
    x = FORMATS["bfloat16"].round(inputs["embeddings"])
    labels, margin = inputs["labels"], inputs["margin"]
    d = np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)
    same = labels[:, None] == labels[None, :]
    valid = (same & ~np.eye(len(labels), dtype=bool))[:, :, None] & ~same[:, None, :]
    active = valid & (d[:, :, None] - d[:, None, :] + margin > 0)
    return active.sum() / valid.sum() if active.any() else 1.0


def test_averaging_over_the_active_triplets_fails_where_it_exceeds_bfloat16s_tolerance():
    op = "losses.triplet"
    report = check(losses.triplet_mean_of_active, op)
    cases = {f"seed {k}": get(op).make_inputs(np.random.default_rng(k)) for k in range(2)}
    cases.update({c.name: c.inputs for c in get(op).reference_inputs(np.random.default_rng(0))
                  if c.name in report.cases})
    failing = {f.case for f in report.failures if f.quantity == "output 0"}
    rtol = {t.case: t.rtol for t in report.tolerances if t.quantity == "output 0"}
    must_fail, must_pass = set(), set()
    for name, inputs in cases.items():
        # Dividing by the active triplets instead of all: the value is 1/f times the
        # reference's, a relative error of 1/f - 1. Which triplets are active is decided
        # in bfloat16 by the implementation (a hinge within rounding of 0 may flip), so
        # only clear cases are predicted: twice the tolerance, or no error at all.
        predicted = 1.0 / _active_fraction(inputs) - 1.0
        if predicted > 2 * rtol[name]:
            must_fail.add(name)
        elif predicted == 0:
            must_pass.add(name)
    assert must_fail <= failing and not must_pass & failing, report.summary()
    assert len(must_fail) >= 2 and len(must_pass) >= 2, (must_fail, must_pass)


# ---------------------------------------------------------------------------- float16


@pytest.mark.parametrize("impl, op", [
    (losses.contrastive, "losses.contrastive"),
    (losses.triplet, "losses.triplet"),
    (losses.proxy_nca, "losses.proxy_nca"),
    (gsp_ot.gsp_pool, "gsp.pool"),
], ids=["contrastive", "triplet", "proxy_nca", "gsp_pool"])
def test_the_same_standard_in_float16(impl, op):
    report = check(impl, op, "float16")
    assert report.passed, report.summary()
    assert {t.base for t in report.tolerances} == {16 * 2.0 ** -10}
    skipped = dict(report.skipped)
    # float16 admits neither float64's cases nor float32's (another range).
    assert stated_for(op, ("float64",)) | stated_for(op, ("float32",)) <= set(skipped)


def test_float16_skips_a_case_whose_hyperparameter_it_cannot_hold():
    name = "a prototype on a feature, duplicate features, ε = 1e6"
    inputs = {c.name: c.inputs for c in get("gsp.pool").reference_inputs(
        np.random.default_rng(0))}[name]
    assert inputs["inverse_temperature"] > FORMATS["float16"].max
    report = check(gsp_ot.gsp_pool, "gsp.pool", "float16", seeds=1)
    assert dict(report.skipped)[name] == (
        f"inverse_temperature == {inputs['inverse_temperature']!r} beyond float16's range "
        "(largest finite 6.55e+04)")
