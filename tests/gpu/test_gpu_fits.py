"""The fast path of histogram, prototypes and crossbatch beyond the parity suite: bad input
named, float32 at extreme hyperparameters, the drawn split, no recomputation."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import crossbatch as ref_crossbatch
from refdml import histogram as ref_histogram
from refdml import prototypes as ref_prototypes
from refdml.gpu import crossbatch, histogram, prototypes


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_histogram_float32_finite_at_inverse_temperature_200():
    rng = _rng()
    f, p = rng.standard_normal((3, 5, 4)), rng.standard_normal((6, 4))
    z, ctx = histogram.histogram_entropic_forward(
        f.astype(np.float32), p.astype(np.float32), inverse_temperature=200.0)
    grads = histogram.histogram_entropic_backward(ctx, np.ones((3, 6), np.float32))
    ref_z, ref_ctx = ref_histogram.histogram_entropic_forward(f, p, inverse_temperature=200.0)
    assert z.dtype == np.float32 and np.all(np.isfinite(z))
    assert_allclose(z, ref_z, atol=1e-4)
    assert np.all(np.isfinite(grads.features)) and np.all(np.isfinite(grads.prototypes))


def test_histogram_bad_input_is_named():
    with pytest.raises(ValueError, match="features and prototypes must have the same last"):
        histogram.histogram_entropic_forward(np.ones((2, 3, 4)), np.ones((5, 3)),
                                             inverse_temperature=1.0)
    with pytest.raises(ValueError, match="inverse_temperature == -1.0"):
        histogram.histogram_entropic_forward(np.ones((2, 3, 4)), np.ones((5, 4)),
                                             inverse_temperature=-1.0)
    with pytest.raises(ValueError, match="overflows float32"):
        histogram.histogram_entropic_forward(np.full((1, 2, 2), 1e30, np.float32),
                                             np.full((2, 2), 1e30, np.float32),
                                             inverse_temperature=1.0)
    _, ctx = histogram.convex_combination_forward(np.ones((2, 3)), np.ones((3, 4)))
    with pytest.raises(ValueError, match="d_y has shape"):
        histogram.convex_combination_backward(ctx, np.ones((4, 2)))


def test_ridge_fit_at_extreme_scales_and_singular_named():
    rng = _rng(1)
    Z, Y = rng.dirichlet(np.ones(4), size=7), rng.standard_normal((7, 3))
    for scale in (1e-30, 1e30):
        got = prototypes.ridge_fit((scale * Z).astype(np.float32), Y.astype(np.float32),
                                   ridge=0.3 * scale**2)
        assert_allclose(got * scale, ref_prototypes.ridge_fit(Z, Y, ridge=0.3),
                        rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="numerically singular: ridge == 1e-30"):
        prototypes.ridge_fit(np.ones((5, 3)), np.ones((5, 2)), ridge=1e-30)
    with pytest.raises(ValueError, match="Z has 5 rows but Y has 4"):
        prototypes.ridge_fit(np.ones((5, 3)), np.ones((4, 2)), ridge=1.0)


def test_float32_ridge_fit_solves_a_well_conditioned_system_in_float64():
    """Concentrated histograms (every row ~0.75 on one prototype), ridge 0.05: condition
    number ~360. The first version checked and solved this in float32 with the threshold
    1e3 n eps(float32) and refused it as singular (a training run of refdml reproduce
    stopped); float32 data now give the float64 reference's fit and gradients to float32's
    precision, in float32."""
    rng = _rng(3)
    Z = 0.25 * rng.dirichlet(np.full(128, 0.1), size=32)
    Z[:, 0] += 0.75
    Y = rng.standard_normal((32, 64))
    assert 300 < np.linalg.cond(Z @ Z.T + 0.05 * np.eye(32)) < 400
    for form in ("kernel", "primal"):
        V, ctx = prototypes.ridge_fit_forward(Z.astype(np.float32), Y.astype(np.float32),
                                              ridge=0.05, form=form)
        V_ref, ctx_ref = ref_prototypes.ridge_fit_forward(Z, Y, ridge=0.05, form=form)
        assert V.dtype == np.float32
        assert_allclose(V, V_ref, rtol=0, atol=1e-4 * np.abs(V_ref).max())
        d_V = rng.standard_normal(V.shape)
        grads = prototypes.ridge_fit_backward(ctx, d_V.astype(np.float32))
        want = ref_prototypes.ridge_fit_backward(ctx_ref, d_V)
        for got, ref in ((grads.Z, want.Z), (grads.Y, want.Y)):
            assert got.dtype == np.float32
            assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    # the zero-shot loss that stopped the run: its cross fits on such halves
    labels = np.repeat(np.arange(8), 4)
    value, _ = crossbatch.zero_shot_loss_forward(Z.astype(np.float32), labels,
                                                 rng.standard_normal((8, 16)).astype(np.float32),
                                                 ridge=0.05, rng=0)
    assert np.isfinite(value)
    # float32 data that are singular in float64 too are still refused, by name
    with pytest.raises(ValueError, match="numerically singular: ridge == 1e-30.*in float64"):
        prototypes.ridge_fit(np.ones((5, 3), np.float32), np.ones((5, 2), np.float32),
                             ridge=1e-30)


def test_crossbatch_drawn_split_matches_reference_and_bad_split_named():
    rng = _rng(2)
    labels = np.repeat(np.arange(4), 2)
    Z = rng.dirichlet(np.ones(5), size=8)
    upsilon = rng.standard_normal((4, 3))
    value, ctx = crossbatch.zero_shot_loss_forward(Z, labels, upsilon, rng=7)
    expected, _ = ref_crossbatch.zero_shot_loss_forward(Z, labels, upsilon, rng=7)
    assert_allclose(value, expected, rtol=1e-12)
    Y = rng.standard_normal((8, 3))
    value, _ = crossbatch.xml_loss_forward(Z, Y, labels, ridge=0.2, rng=3, lambda_=0.5)
    expected, _ = ref_crossbatch.xml_loss_forward(Z, Y, labels, ridge=0.2, rng=3, lambda_=0.5)
    assert_allclose(value, expected, rtol=1e-12)
    with pytest.raises(ValueError, match=r"split is not class-disjoint: classes \[0\]"):
        crossbatch.zero_shot_loss_forward(Z, labels, upsilon, split=np.arange(8) < 1)
    with pytest.raises(ValueError, match="labels contain 4"):
        crossbatch.zero_shot_loss_forward(Z, labels + 1, upsilon)
    with pytest.raises(TypeError, match="split must be a boolean mask"):
        crossbatch.cross_fit_forward(Z, Y, np.arange(8), ridge=0.2)
    with pytest.raises(ValueError, match="split leaves one half empty"):
        crossbatch.cross_fit_forward(Z, Y, np.ones(8, dtype=bool), ridge=0.2)


def test_cross_fit_backward_does_not_refit(monkeypatch):
    rng = _rng(3)
    Z, T = rng.dirichlet(np.ones(5), size=8), rng.standard_normal((8, 3))
    P, ctx = crossbatch.cross_fit_forward(Z, T, np.arange(8) < 4, ridge=0.2)

    def boom(*args, **kwargs):
        raise AssertionError("the backward refitted")

    monkeypatch.setattr(crossbatch, "_fit_normalised", boom)
    grads = crossbatch.cross_fit_backward(ctx, np.ones_like(P))
    assert grads.Z.shape == Z.shape


@pytest.mark.parametrize("n_prototypes, n_first", [(5, 4), (3, 4), (5, 6), (4, 2)])
def test_cross_fit_matches_reference_in_every_pairing_of_forms(n_prototypes, n_first):
    """Both halves in the kernel form (one joint block-diagonal system), both in the primal
    form, and one of each (two systems): the predictions and both gradients are the
    reference's, in float64 and float32, with the halves interleaved in the batch."""
    rng = _rng(4)
    b = 8
    Z = rng.dirichlet(np.ones(n_prototypes), size=b)
    T = rng.standard_normal((b, 3))
    split = np.zeros(b, dtype=bool)
    split[rng.permutation(b)[:n_first]] = True
    d_P = rng.standard_normal((b, 3))
    P_ref, ctx_ref = ref_crossbatch.cross_fit_forward(Z, T, split, ridge=0.2)
    want = ref_crossbatch.cross_fit_backward(ctx_ref, d_P)
    for dtype, rtol in ((np.float64, 1e-10), (np.float32, 1e-4)):
        P, ctx = crossbatch.cross_fit_forward(Z.astype(dtype), T.astype(dtype), split,
                                              ridge=0.2)
        grads = crossbatch.cross_fit_backward(ctx, d_P.astype(dtype))
        assert P.dtype == grads.Z.dtype == grads.targets.dtype == dtype
        joint = n_prototypes > max(n_first, b - n_first)
        assert (ctx.joint is not None) == joint
        for got, ref in ((P, P_ref), (grads.Z, want.Z), (grads.targets, want.targets)):
            assert_allclose(got, ref, rtol=0, atol=rtol * np.abs(ref).max())
