"""The fast-path losses beyond the parity suite: bad input named, float32 finite at
extreme hyperparameters, the small-gamma path of SoftTriple, degenerate batches."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import losses as ref
from refdml.gpu import losses as fast
from refdml.gpu._loss_kernels import masked_logsumexp
from refdml._numerics import masked_logsumexp as ref_masked_logsumexp

LABELS = np.array([0, 0, 1, 1, 2, 2])


def _x(dtype=np.float64, seed=0, n=6, d=4):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(dtype)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="labels has length 5"):
        fast.contrastive_forward(_x(), LABELS[:5])
    with pytest.raises(TypeError, match="labels must hold integer labels"):
        fast.triplet_forward(_x(), LABELS + 0.5)
    with pytest.raises(ValueError, match="embeddings must be finite"):
        fast.triplet_forward(np.full((6, 4), np.nan), LABELS)
    with pytest.raises(ValueError, match="embeddings has a zero vector at row 0"):
        fast.multi_similarity_forward(np.zeros((6, 4)), LABELS)
    with pytest.raises(ValueError, match="labels has class 2, which no proxy represents"):
        fast.proxy_nca_forward(_x(), LABELS, proxies=_x(n=2))
    with pytest.raises(ValueError, match="reduction == 'avg'"):
        fast.contrastive_forward(_x(), LABELS, reduction="avg")
    _, ctx = fast.contrastive_forward(_x(), LABELS)
    with pytest.raises(TypeError, match="returned by contrastive_forward"):
        fast.triplet_backward(ctx)
    with pytest.raises(ValueError, match="d_value == nan, must be finite"):
        fast.contrastive_backward(ctx, float("nan"))
    with pytest.raises(ValueError, match="d_value has shape"):
        fast.contrastive_backward(ctx, np.ones(2))


@pytest.mark.parametrize("name, hyper", [
    ("proxy_anchor", {"alpha": 64.0}),
    ("proxy_nca", {"temperature": 0.01}),
    ("soft_triple", {"lambda_": 100.0, "gamma": 0.01}),   # the (n, C, m) block path
    ("soft_triple", {"lambda_": 100.0, "gamma": 0.05}),   # the shared-shift path
])
def test_float32_finite_at_extreme_hyperparameters(name, hyper):
    x, p = _x(np.float32, 1), _x(np.float32, 2, n=3)
    value, ctx = getattr(fast, f"{name}_forward")(x, LABELS, proxies=p, **hyper)
    grads = getattr(fast, f"{name}_backward")(ctx)
    expected, ref_ctx = getattr(ref, f"{name}_forward")(
        x.astype(np.float64), LABELS, proxies=p.astype(np.float64), **hyper)
    ref_grads = getattr(ref, f"{name}_backward")(ref_ctx)
    assert grads.embeddings.dtype == np.float32 and grads.proxies.dtype == np.float32
    assert np.isfinite(value)
    assert_allclose(value, expected, rtol=1e-4)
    for got, want in ((grads.embeddings, ref_grads.embeddings), (grads.proxies, ref_grads.proxies)):
        assert np.all(np.isfinite(got))
        assert_allclose(got, want, rtol=0, atol=1e-3 * np.max(np.abs(want)))


def test_multi_similarity_float32_at_large_beta():
    x = _x(np.float32, 3)
    value, ctx = fast.multi_similarity_forward(x, LABELS, alpha=50.0, beta=200.0)
    expected, _ = ref.multi_similarity_forward(x.astype(np.float64), LABELS, alpha=50.0, beta=200.0)
    assert np.isfinite(value) and np.all(np.isfinite(fast.multi_similarity_backward(ctx).embeddings))
    assert_allclose(value, expected, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
@pytest.mark.parametrize("mining", ["all", "batch_hard"])
def test_triplet_reductions_and_no_triplet(reduction, mining):
    x = _x()
    for labels in (LABELS, np.arange(6), np.zeros(6, dtype=int)):
        value, ctx = fast.triplet_forward(x, labels, margin=0.5, mining=mining, reduction=reduction)
        expected, ref_ctx = ref.triplet_forward(x, labels, margin=0.5, mining=mining,
                                                reduction=reduction)
        assert_allclose(value, expected, rtol=1e-12)
        assert_allclose(fast.triplet_backward(ctx).embeddings,
                        ref.triplet_backward(ref_ctx).embeddings, rtol=1e-10, atol=1e-14)


def test_masked_logsumexp_matches_reference_and_empty_rows():
    rng = np.random.default_rng(4)
    z = 50 * rng.standard_normal((5, 7))
    mask = rng.random((5, 7)) < 0.5
    mask[2] = False
    lse, soft = masked_logsumexp(np, z, mask)
    ref_lse, ref_soft = ref_masked_logsumexp(z, mask)
    assert_allclose(lse, ref_lse, rtol=1e-14)
    assert_allclose(soft, ref_soft, rtol=1e-14, atol=1e-300)
    lse1, _ = masked_logsumexp(np, z, mask, extra_zero=True)
    assert lse1[2] == 0.0
    assert_allclose(lse1, np.logaddexp(0.0, ref_lse), rtol=1e-14)
