"""The fast path's all-pairs divergence on its compiled CPU twin, in float64, against the
reference (:func:`refdml.ot.pairwise_sinkhorn_divergence_forward`, the readable NumPy form).

:func:`refdml.gpu.ot.pairwise_sinkhorn_divergence_forward` on NumPy runs the CPU twin of the
small-problem Sinkhorn kernel (clouds of at most 128 points) under ``use_kernels("cpu")``
(and under "auto"). It is the same solver, so they must agree: divergences and gradients
(the reference's backward on either context, and the fast backward on its own) to 1e-10
relative, iteration counts and ``converged`` exactly where the stopping margin certifies
them (:func:`_stops_certified`), the same ConvergenceWarning.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.exceptions import ConvergenceWarning
from refdml.gpu import ot as fast_ot
from refdml.gpu import use_kernels
from refdml.ot import pairwise_sinkhorn_divergence_backward
from refdml.ot import pairwise_sinkhorn_divergence_forward as readable
from refdml.ot import _sinkhorn

pytestmark = pytest.mark.cpu_exact

RTOL = 1e-10
# Stopping margin, in units of n eps (n points per cloud). The routes' L1 marginal errors
# (sums of n terms |u_i (K v)_i - a_i| with sum a = 1) at one iteration differ by rounding:
# at most 0.6 n eps in 60 random draws like the hypothesis test's. A stopping test
# ``error <= threshold`` can go the other way only where an error lies that close to its
# threshold, so counts are compared exactly where every count of the readable route stays
# when every threshold moves by 64 n eps either way (100 times the rounding seen).
MARGIN_ULPS = 64


def _counts(clouds, shift, kw):
    """The readable route's counts and flags with ``tol`` and the eps-scaling stages'
    threshold (``refdml.ot._sinkhorn._STAGE_TOL``) moved by ``shift``."""
    stage_tol = _sinkhorn._STAGE_TOL
    _sinkhorn._STAGE_TOL = stage_tol + shift
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            # residuals are >= 0: tol = 0 stops only at an exact 0, compared with tol = margin
            _, ctx = readable(clouds, **{**kw, "tol": max(kw.get("tol", 1e-9) + shift, 0.0)})
    finally:
        _sinkhorn._STAGE_TOL = stage_tol
    batches = (ctx.pairs.cross, ctx.pairs.self_)
    return [(batch.n_iter.tolist(), batch.converged.tolist()) for batch in batches]


def _stops_certified(clouds, **kw) -> bool:
    """Whether no stopping test of these clouds lies within the margin of its threshold."""
    margin = MARGIN_ULPS * clouds.shape[1] * np.finfo(np.float64).eps
    return _counts(clouds, -margin, kw) == _counts(clouds, margin, kw)


def twin_forward(clouds, **kw):
    """The fast path's forward on its compiled CPU twin (float64 NumPy input)."""
    with use_kernels("cpu"):
        return fast_ot.pairwise_sinkhorn_divergence_forward(clouds, **kw)


def _both(clouds, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return twin_forward(clouds, **kw), readable(clouds, **kw)


def _assert_equivalent(clouds, seed=0, *, certified=None, **kw):
    if certified is None:
        certified = _stops_certified(clouds, **kw)
    assert certified, "a residual within the stopping margin of its threshold: pick another input"
    (fast, fast_ctx), (ref, ref_ctx) = _both(clouds, **kw)
    assert fast.dtype == ref.dtype == np.float64
    assert_allclose(fast, ref, rtol=0, atol=RTOL * max(np.abs(ref).max(), 1e-300))
    for batch in ("cross", "self_"):
        got, want = getattr(fast_ctx.pairs, batch), getattr(ref_ctx.pairs, batch)
        assert_array_equal(got.n_iter, want.n_iter)
        assert_array_equal(got.converged, want.converged)
    upstream = np.random.default_rng(seed).standard_normal(fast.shape)
    g_ref = pairwise_sinkhorn_divergence_backward(ref_ctx, upstream).clouds
    for g_fast in (pairwise_sinkhorn_divergence_backward(fast_ctx, upstream).clouds,
                   fast_ot.pairwise_sinkhorn_divergence_backward(fast_ctx, upstream).clouds):
        assert_allclose(g_fast, g_ref, rtol=0, atol=RTOL * np.abs(g_ref).max())


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("value", ["regularized", "transport_cost"])
@pytest.mark.parametrize("eps_scaling", [None, 0.5])
def test_twin_matches_readable_form(p, value, eps_scaling):
    clouds = np.random.default_rng(p).uniform(-1, 1, (5, 6, 3))
    _assert_equivalent(clouds, eps=0.1, p=p, value=value, tol=1e-9, eps_scaling=eps_scaling)


def test_twin_at_scale_and_small_eps():
    clouds = 1e150 * np.random.default_rng(3).uniform(-1, 1, (4, 7, 2))
    _assert_equivalent(clouds, eps=1e300 * 0.01, p=2, tol=1e-9, max_iter=3000)


def test_twin_near_coincident_points_p1():
    # Two points 2e-4 apart (found by hypothesis): p = 1 amplifies any rounding of their
    # squared distance in the gradient; the compiled costs refine near pairs as _sq_dist.
    clouds = np.random.default_rng(3255707).uniform(-1, 1, (3, 7, 1))
    _assert_equivalent(clouds, seed=3255707, eps=1.0, p=1, tol=1e-10, max_iter=2000)


def test_twin_warns_like_the_readable_form():
    clouds = np.random.default_rng(4).uniform(-1, 1, (3, 5, 2))
    for forward in (twin_forward, readable):
        with pytest.warns(ConvergenceWarning, match="max_iter=2 iterations"):
            forward(clouds, eps=0.01, max_iter=2, tol=1e-9)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            forward(clouds, eps=0.01, max_iter=2, tol=0.0)


@pytest.mark.parametrize("forward", [twin_forward, readable], ids=["twin", "reference"])
def test_one_cloud_and_bad_input_as_the_reference(forward):
    out, ctx = forward(np.ones((1, 3, 2)), eps=0.5)
    assert_array_equal(out, [[0.0]]) and ctx.pairs is None
    with pytest.raises(ValueError, match="clouds"):
        forward(np.ones((3, 2)), eps=0.5)
    with pytest.raises(ValueError, match="eps"):
        forward(np.ones((2, 3, 2)), eps=-1.0)
    with pytest.raises(ValueError, match="clouds"):
        forward(np.full((2, 3, 2), np.nan), eps=0.5)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), n_clouds=st.integers(2, 5), n=st.integers(1, 9),
       d=st.integers(1, 4), eps=st.sampled_from([1.0, 0.1, 0.02]), p=st.sampled_from([1, 2]))
def test_twin_hypothesis(seed, n_clouds, n, d, eps, p):
    clouds = np.random.default_rng(seed).uniform(-1, 1, (n_clouds, n, d))
    kw = dict(eps=eps, p=p, tol=1e-10, max_iter=2000)
    assume(_stops_certified(clouds, **kw))       # ~5% of draws sit at a stopping boundary
    _assert_equivalent(clouds, seed=seed, certified=True, **kw)
