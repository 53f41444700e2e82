"""``check_implementation`` against independent JAX implementations of three losses
(tests/conformance/impls_jax_losses.py): the correct ones pass in float64 and float32 on
every catalogued case (seeds and hard reference inputs), and each planted defect fails
with its cause, on the input case that exposes it and nowhere else.

The JAX implementations are written without refdml; the expected numbers here (which rows
coincide, how many triplets are active) come from the catalogue's inputs with NumPy, not
from the reference's outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

pytest.importorskip("jax")

import impls_jax_losses as impls  # noqa: E402  (needs JAX)

from refdml.catalog import get  # noqa: E402
from refdml.conformance import check_implementation  # noqa: E402

# Two seeds of make_inputs plus every reference case: enough to pass or fail, and quick.
SEEDS = 2


def check(impl, op, dtype, **options):
    options = {"seeds": SEEDS, "search": False, **options}
    return check_implementation(impl, op, framework="jax", dtype=dtype, **options)


def reference_case(op, name):
    """The inputs of the catalogue entry's reference case ``name`` (the rng that
    check_implementation uses for them)."""
    cases = {c.name: c for c in get(op).reference_inputs(np.random.default_rng(0))}
    return cases[name].inputs


# ------------------------------------------------------------------------ correct ones


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("impl, op, hard_cases", [
    (impls.contrastive, "losses.contrastive", {"duplicate points", "one class"}),
    (impls.triplet, "losses.triplet", {"duplicate points", "exact ties", "no positive pair"}),
    (impls.proxy_nca, "losses.proxy_nca", {"small temperature", "one class of proxies"}),
], ids=["contrastive", "triplet", "proxy_nca"])
def test_correct_implementations_pass(impl, op, hard_cases, dtype):
    report = check(impl, op, dtype)
    assert report.passed, report.summary()
    # Not a vacuous pass: the hard cases that break the planted defects were compared.
    assert hard_cases <= set(report.cases), report.cases


@pytest.mark.parametrize("impl, op, dtype", [
    (impls.contrastive, "losses.contrastive_no_positive", "float64"),
    (impls.triplet, "losses.triplet_batch_hard", "float32"),
], ids=["contrastive-no-positive-float64", "triplet-batch-hard-float32"])
def test_correct_implementations_pass_the_other_entries(impl, op, dtype):
    report = check(impl, op, dtype, seeds=1)
    assert report.passed, report.summary()


# -------------------------------------------------------------------- planted defects


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sqrt_distance_is_nan_at_duplicate_points(dtype):
    report = check(impls.contrastive_nan_at_ties, "losses.contrastive", dtype)
    assert not report.passed
    # Only the gradient, only where two embeddings coincide: the values are right.
    assert {(f.case, f.quantity, f.cause) for f in report.failures} == {
        ("duplicate points", "grad embeddings", "non-finite")}, report.summary()
    failure = report.failures[0]
    x = reference_case("losses.contrastive", "duplicate points")["embeddings"]
    coincident = {i for i in range(len(x)) for j in range(len(x))
                  if i != j and np.array_equal(x[i], x[j])}
    assert coincident, "the case has no duplicate rows"
    assert failure.index[0] in coincident
    assert np.isnan(failure.impl_value) and np.isfinite(failure.ref_value)
    assert "non-finite" in report.summary() and "duplicate points" in report.summary()


def _cases(op, seeds, dtype):
    """The inputs of every case check_implementation compares, by name."""
    spec = get(op)
    cases = {f"seed {k}": spec.make_inputs(np.random.default_rng(k)) for k in range(seeds)}
    cases.update({c.name: c.inputs for c in spec.reference_inputs(np.random.default_rng(0))
                  if c.dtypes is None or dtype in c.dtypes})
    return cases


def _some_negative_hinge_active(inputs) -> bool:
    # On x / max|x|: the squares of the 1e170 case would overflow.
    x = inputs["embeddings"]
    peak = np.max(np.abs(x))
    d = np.linalg.norm((x / peak)[:, None, :] - (x / peak)[None, :, :], axis=-1)
    return bool(np.any(d[np.triu_indices(len(x), k=1)] < inputs["neg_margin"] / peak))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_skipping_a_batch_without_positives_drops_its_negative_terms(dtype):
    op = "losses.contrastive_no_positive"
    report = check(impls.contrastive_skips_batch, op, dtype)
    assert not report.passed
    values = [f for f in report.failures if f.quantity == "output 0"]
    # No case of this entry has a positive pair: the value is 0 instead of the mean of the
    # negative hinges, wrong wherever one is active (at the huge scales none is: the
    # margin is negligible next to the distances, and 0 is right).
    cases = _cases(op, SEEDS, dtype)
    assert set(cases) == set(report.cases)
    assert {f.case for f in values} == {
        name for name, inputs in cases.items() if _some_negative_hinge_active(inputs)}
    assert {"seed 0", "seed 1", "exact ties"} <= {f.case for f in values}
    for failure in values:
        assert failure.cause == "value" and failure.impl_value == 0.0 and failure.ref_value > 0
        assert_allclose(failure.error, 1.0, rtol=1e-6)   # |0 - v| / |v|
    # With a positive pair in the batch the guard never fires: same implementation, a pass.
    assert check(impls.contrastive_skips_batch, "losses.contrastive", dtype, seeds=1).passed


def _active_fraction(inputs) -> float:
    """Active triplets / valid triplets of ``inputs``, computed here with NumPy."""
    x, labels, margin = inputs["embeddings"], inputs["labels"], inputs["margin"]
    d = np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)
    same = labels[:, None] == labels[None, :]
    valid = (same & ~np.eye(len(labels), dtype=bool))[:, :, None] & ~same[:, None, :]
    active = valid & (d[:, :, None] - d[:, None, :] + margin > 0)
    return active.sum() / valid.sum()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_mean_over_active_triplets_inflates_the_value(dtype):
    report = check(impls.triplet_mean_of_active, "losses.triplet", dtype)
    assert not report.passed
    failed = {f.case for f in report.failures}
    # Without any triplet both are 0: those cases agree; elsewhere the value is off.
    assert {"seed 0", "seed 1", "exact ties"} <= failed
    assert not failed & {"one class", "no positive pair"}
    first = report.failures[0]
    assert (first.case, first.quantity, first.cause) == ("seed 0", "output 0", "value")
    # Dividing by the active triplets instead of all of them scales the value by
    # all / active: the report's two values say exactly how the terms were dropped.
    inputs = get("losses.triplet").make_inputs(np.random.default_rng(0))
    assert_allclose(first.ref_value / first.impl_value, _active_fraction(inputs),
                    rtol=1e-12 if dtype == "float64" else 1e-5)
    assert any(f.case == "seed 0" and f.cause == "gradient" for f in report.failures)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_naive_softmax_breaks_at_a_small_temperature_only(dtype):
    report = check(impls.proxy_nca_naive_softmax, "losses.proxy_nca", dtype)
    assert not report.passed
    assert {f.case for f in report.failures} == {"small temperature"}, report.summary()
    assert {(f.quantity, f.cause) for f in report.failures} == {
        ("output 0", "non-finite"), ("grad embeddings", "non-finite"),
        ("grad proxies", "non-finite")}
    assert reference_case("losses.proxy_nca", "small temperature")["temperature"] < 0.01


def test_the_search_shrinks_a_disagreement_and_finds_none_in_a_correct_loss():
    found = check(impls.triplet_mean_of_active, "losses.triplet", "float64", seeds=1,
                  search=True, max_examples=5)
    assert found.search is not None and found.search.found
    assert any(f.case.startswith("search ") for f in found.failures)
    clean = check(impls.triplet, "losses.triplet", "float64", seeds=1, search=True,
                  max_examples=5)
    assert clean.passed, clean.summary()
    assert clean.search is not None and not clean.search.found and clean.search.examples > 0
