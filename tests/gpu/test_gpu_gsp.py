"""refdml.gpu.gsp beyond the parity suite: errors named, float32 at extreme ε, no recomputation."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose
from scipy.special import logsumexp

from refdml import gsp as reference
from refdml.gpu import use_kernels
from refdml.gpu.gsp import _array as _gsp_array
from refdml.gpu.gsp import _transport as _gsp_transport
from refdml.gpu import gsp as fast
from refdml.gradcheck import check_gradients


def _inputs(rng, batch=3, n=6, m=4, d=5, dtype=np.float64):
    features = rng.standard_normal((batch, n, d)) * rng.uniform(0.3, 2.0, (batch, n, 1))
    prototypes = rng.standard_normal((m, d))
    return features.astype(dtype), prototypes.astype(dtype)


@pytest.fixture
def pool32():
    features, prototypes = _inputs(np.random.default_rng(0), dtype=np.float32)
    return fast.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=5.0)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(features=np.zeros((3, 5))), ValueError, "features must have 3 dimensions"),
        (dict(prototypes=np.zeros((4, 7))), ValueError, "same last dimension"),
        (dict(mu=1.5), ValueError, "mu"),
        (dict(inverse_temperature=0.0), ValueError, "inverse_temperature"),
        (dict(method="fixed_point"), ValueError, "validation only"),
        (dict(method="fixed_point", backward="unrolled"), ValueError, "validation only"),
        (dict(p=0.5), ValueError, "p"),
        (dict(p=2.0), ValueError, "GeMean"),
        (dict(features=np.full((3, 6, 5), np.nan)), ValueError, "features must be finite"),
        (dict(prototypes="abc"), TypeError, "prototypes"),
    ],
)
def test_bad_input_is_named(kwargs, error, words):
    features, prototypes = _inputs(np.random.default_rng(1))
    args = dict(features=features, prototypes=prototypes, mu=0.3, inverse_temperature=5.0)
    args.update(kwargs)
    with pytest.raises(error, match=words):
        fast.gsp_pool_forward(**args)


def test_bad_upstream_and_context_are_named(pool32):
    (pooled, z), ctx = pool32
    with pytest.raises(TypeError, match="ctx must be the PoolContext"):
        fast.gsp_pool_backward(object(), pooled, z)
    with pytest.raises(ValueError, match="d_pooled has shape"):
        fast.gsp_pool_backward(ctx, pooled[:, :2], z)
    bad = z.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="d_z must be finite"):
        fast.gsp_pool_backward(ctx, pooled, bad)
    result = fast.weight_transport(ctx.cost.cost, mu=0.3, inverse_temperature=5.0)
    with pytest.raises(ValueError, match="d_pi has shape"):
        fast.weight_transport_backward(result, None, result.rho)
    with pytest.raises(TypeError, match="result must be the WeightTransportResult"):
        fast.weight_transport_backward(ctx, None, None)


def test_dtype_is_kept_and_none_means_zero(pool32):
    (pooled, z), ctx = pool32
    grads = fast.gsp_pool_backward(ctx, None, None)
    arrays = [pooled, z, grads.features, grads.prototypes, ctx.transport.pi, ctx.transport.rho]
    assert all(a.dtype == np.float32 for a in arrays)
    assert_allclose(grads.features, 0.0, atol=0.0)
    assert_allclose(grads.prototypes, 0.0, atol=0.0)


@pytest.mark.parametrize("inverse_temperature", [0.5, 5.0, 50.0, 200.0])
def test_float32_is_finite_and_converged_at_extreme_inverse_temperature(inverse_temperature):
    rng = np.random.default_rng(2)
    features, prototypes = _inputs(rng, batch=8, n=49, m=16, d=8)
    args = dict(mu=0.3, inverse_temperature=inverse_temperature)
    (ref_pooled, ref_z), ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    d_pooled, d_z = rng.standard_normal(ref_pooled.shape), rng.standard_normal(ref_z.shape)
    ref_grads = reference.gsp_pool_backward(ref_ctx, d_pooled, d_z)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConvergenceWarning, no overflow
        (pooled, z), ctx = fast.gsp_pool_forward(
            features.astype(np.float32), prototypes.astype(np.float32), **args
        )
        grads = fast.gsp_pool_backward(ctx, d_pooled.astype(np.float32), d_z.astype(np.float32))
    result = ctx.transport
    assert result.converged
    assert result.tol == fast.residual_floor(np.float32, 16, 49)
    assert np.all(result.residual <= result.tol)
    for a in (pooled, z, grads.features, grads.prototypes, result.pi, result.rho):
        assert np.all(np.isfinite(a))
    # float32 carries ~1e-7 relative on ε c, so the error grows with ε (here <= ~ε * 1e-6).
    rtol = 1e-5 * max(1.0, inverse_temperature / 5.0)
    assert_allclose(pooled, ref_pooled, atol=rtol * np.abs(ref_pooled).max())
    assert_allclose(z, ref_z, atol=rtol * np.abs(ref_z).max())
    assert_allclose(grads.features, ref_grads.features, atol=rtol * np.abs(ref_grads.features).max())


@pytest.mark.parametrize("inverse_temperature", [1e16, 1e38, 1e300, float(np.finfo(np.float64).max)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_constraints_and_reference_at_huge_inverse_temperature(dtype, inverse_temperature):
    # ε beyond float32's range (1e300) is applied as a power of two: never inf * 0. The
    # constraints hold to the dtype's floor, (rho, pi) are the reference's (the LP's, to
    # rounding), and every gradient through (P2) is 0 as in the reference (no ties).
    rng = np.random.default_rng(8)
    features, prototypes = _inputs(rng, batch=4, n=9, m=5, d=4)
    features, prototypes = features.astype(dtype), prototypes.astype(dtype)
    args = dict(mu=0.3, inverse_temperature=inverse_temperature)
    cost = fast.cost_map(features, prototypes)
    ref = reference.weight_transport(cost.astype(np.float64), **args)
    d_rho, d_pi = rng.standard_normal((4, 9)), rng.standard_normal((4, 5, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConvergenceWarning, no overflow
        result = fast.weight_transport(cost, **args)
        grad = fast.weight_transport_backward(result, d_rho.astype(dtype), d_pi.astype(dtype))
        (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, **args)
        grads = fast.gsp_pool_backward(ctx, rng.standard_normal((4, 4)).astype(dtype), None)
    assert result.converged and np.all(result.residual <= result.tol)
    atol = 1e-14 if dtype == np.float64 else 1e-6
    assert_allclose(result.pi, ref.pi, rtol=0, atol=atol)
    assert_allclose(result.rho, ref.rho, rtol=0, atol=atol)
    assert np.all(grad.cost == 0.0)
    assert np.all(reference.weight_transport_backward(ref, d_rho, d_pi).cost == 0.0)
    (ref_pooled, ref_z), _ = reference.gsp_pool_forward(
        features.astype(np.float64), prototypes.astype(np.float64), **args)
    assert_allclose(pooled, ref_pooled, rtol=0, atol=100 * atol * np.abs(ref_pooled).max())
    assert_allclose(z, ref_z, rtol=0, atol=100 * atol)
    assert np.all(grads.prototypes == 0.0) and np.all(np.isfinite(grads.features))


def _small_mu_case(mu, dtype, kernels, seed=11):
    rng = np.random.default_rng(seed)
    features, prototypes = _inputs(rng, batch=3, n=7, m=5, d=4)
    args = dict(mu=mu, inverse_temperature=5.0)
    (ref_pooled, ref_z), ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    d_pooled, d_z = rng.standard_normal(ref_pooled.shape), rng.standard_normal(ref_z.shape)
    ref = reference.gsp_pool_backward(ref_ctx, d_pooled, d_z)
    with warnings.catch_warnings(), use_kernels(kernels):
        warnings.simplefilter("error")  # no overflow of 1 / mu, no ConvergenceWarning
        (pooled, z), ctx = fast.gsp_pool_forward(
            features.astype(dtype), prototypes.astype(dtype), **args)
        grads = fast.gsp_pool_backward(ctx, d_pooled.astype(dtype), d_z.astype(dtype))
    # float32: the cost carries ~1e-7 relative and the solve's residual floor is
    # 16 u |logit mu| (u = 2^-24), which the weights and gradients carry with a further
    # factor of a few: over 150 seeds at each of 11 mu from 1e-1 to 1e-300 the worst error
    # was 40 u max(1, |logit mu|) (3.8e-5 at mu = 1e-8). A flat 2e-5 failed 23% of seeds at
    # mu = 1e-6 (issue 21's review).
    logit_mu = abs(np.log(mu) - np.log1p(-mu))
    rtol = 64 * 2.0**-24 * max(1.0, logit_mu) if dtype == np.float32 else 1e-12
    for got, want in ((pooled, ref_pooled), (z, ref_z), (grads.features, ref.features),
                      (grads.prototypes, ref.prototypes)):
        assert got.dtype == dtype
        assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())
    assert ctx.transport.converged and ctx.transport.pi.dtype == dtype
    assert ctx.transport.mu == mu
    return ctx


@pytest.mark.parametrize("kernels", ["array", "cpu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mu", [1e-20, 1e-38, 1e-45, 1e-300])
def test_small_mu_matches_the_reference(mu, dtype, kernels):
    # w = sigma / mu and z are O(1) at any mu, while sigma ~ mu is not a float32 below
    # ~1e-38: once 1 / mu overflowed float32 to inf, and inf * 0 gave NaN (issue 20).
    ctx = _small_mu_case(mu, dtype, kernels)
    if dtype == np.float32 and mu < 1e-100:
        # pi, sigma ~ mu are far below float32's least subnormal: 0, as they should be.
        assert np.all(ctx.transport.pi == 0.0) and np.all(ctx.transport.transported == 0.0)


@settings(max_examples=15, deadline=None)
@given(exponent=st.floats(-300.0, -1.0), seed=st.integers(0, 2**16))
def test_small_mu_matches_the_reference_hypothesis(exponent, seed):
    _small_mu_case(10.0**exponent, np.float32, "array", seed=seed)


def test_small_mu_backward_matches_finite_differences():
    # The backward moves 1 / mu onto sigma (w = sigma / mu): checked here against
    # central differences of the fast forward itself (float64, mu = 1e-300).
    rng = np.random.default_rng(12)
    features, prototypes = _inputs(rng, batch=2, n=5, m=3, d=3)
    result = check_gradients(
        lambda features, prototypes: fast.gsp_pool_forward(
            features, prototypes, mu=1e-300, inverse_temperature=2.0),
        fast.gsp_pool_backward, {"features": features, "prototypes": prototypes},
        mode="full", rng=rng,
    )
    assert result.passed(rtol=1e-6), result.max_rel_error


@pytest.mark.parametrize("mu", [1e-310, 5e-324])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_subnormal_mu_is_named(mu, dtype):
    features, prototypes = _inputs(np.random.default_rng(13), dtype=dtype)
    with pytest.raises(ValueError, match=rf"^mu == {mu!r} is subnormal; .* needs mu >= 2.2"):
        fast.gsp_pool_forward(features, prototypes, mu=mu, inverse_temperature=5.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [2000.0, 1e5, 1e38, 1e300])
def test_gemean_at_large_p_is_the_power_mean(dtype, p):
    # At mu = 1 the weights are 1: pooled is the power mean of the features, here from
    # log-sum-exp in float64 (independent of the layer). A power-of-two scale once let
    # every (y / s)^p underflow for p in the thousands: pooled was 0.
    features = np.abs(_inputs(np.random.default_rng(14))[0]) + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (pooled, _), ctx = fast.gsp_pool_forward(
            features.astype(dtype), np.eye(5, dtype=dtype), mu=1.0, inverse_temperature=1.0,
            p=p)
        grads = fast.gsp_pool_backward(ctx, np.ones_like(pooled), None)
    n = features.shape[1]
    with np.errstate(over="ignore"):
        logs = p * np.log(features)
    if np.all(np.isfinite(logs)):
        expected = np.exp((logsumexp(logs, axis=1) - np.log(n)) / p)
    else:  # p beyond float64: the limit, the largest entry
        expected = features.max(axis=1)
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    assert_allclose(pooled, expected, rtol=rtol)
    assert np.all(np.isfinite(grads.features))


def test_gemean_at_large_p_backward_matches_finite_differences():
    rng = np.random.default_rng(15)
    features = np.abs(_inputs(rng, batch=2, n=4, m=3, d=3)[0]) + 0.1
    result = check_gradients(
        lambda features: fast.gsp_pool_forward(
            features, np.eye(3), mu=1.0, inverse_temperature=1.0, p=2000.0),
        fast.gsp_pool_backward, {"features": features}, mode="full", rng=rng,
    )
    assert result.passed(rtol=1e-5), result.max_rel_error


@pytest.mark.parametrize("kernels", ["array", "cpu"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [2000.0, 1e5, 1e15, 1e300])
def test_gemean_at_large_p_matches_the_reference(p, dtype, kernels):
    # The whole layer (mu = 0.3, weights that move with the cost). The fast backward raised
    # the rounded y / pooled to p - 1: its derivative at the largest entry was off by
    # p u from p ~ 1e12 (1.18 at 1e15 where the reference has 1) and was 1/n beyond ~1e17.
    rng = np.random.default_rng(18)
    features, prototypes = _inputs(rng, batch=2, n=5, m=3, d=4)
    features = np.abs(features) + 0.1
    args = dict(mu=0.3, inverse_temperature=2.0, p=p)
    (ref_pooled, ref_z), ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    d_pooled, d_z = rng.standard_normal(ref_pooled.shape), rng.standard_normal(ref_z.shape)
    ref = reference.gsp_pool_backward(ref_ctx, d_pooled, d_z)
    with warnings.catch_warnings(), use_kernels(kernels):
        warnings.simplefilter("error")
        (pooled, z), ctx = fast.gsp_pool_forward(features.astype(dtype),
                                                 prototypes.astype(dtype), **args)
        grads = fast.gsp_pool_backward(ctx, d_pooled.astype(dtype), d_z.astype(dtype))
    rtol = 2e-5 if dtype == np.float32 else 1e-10
    for got, want in ((pooled, ref_pooled), (z, ref_z), (grads.features, ref.features),
                      (grads.prototypes, ref.prototypes)):
        assert got.dtype == dtype
        assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("kernels", ["array", "cpu"])
@pytest.mark.parametrize("p", [1.0, 3.0])
@pytest.mark.parametrize("upstream", [1e-3, 1.0, 10.0, 1e10])
def test_float64_features_near_its_largest_number_are_the_references(upstream, p, kernels):
    # Features near 2^1023 with weights up to ~3: d_weights ~ |f| |d_pooled| and W overflowed
    # (a RuntimeWarning, or an error that blamed inverse_temperature) where the gradients do
    # not. Both now rescale the upstream by powers of two; both name a gradient beyond
    # float64 (the prototypes' ~ε |f| |d_pooled| at the larger upstreams) alike.
    rng = np.random.default_rng(20)
    features = rng.uniform(0.2, 1.0, (2, 5, 3)) * 2.0**1023
    features[:, 0] = np.array([1.0, 0.9, 0.8]) * 2.0**1023
    prototypes = np.array([[1.0, 0.9, 0.8], [-1.0, 0.5, 0.1], [0.2, -1.0, 0.3]])
    args = dict(mu=0.2, inverse_temperature=10.0, p=p)
    d_pooled, d_z = upstream * rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    _, ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    with use_kernels(kernels):
        _, ctx = fast.gsp_pool_forward(features, prototypes, **args)
    try:
        ref = reference.gsp_pool_backward(ref_ctx, d_pooled, d_z)
    except ValueError as error:
        with pytest.raises(ValueError, match=re.escape(str(error))), use_kernels(kernels):
            fast.gsp_pool_backward(ctx, d_pooled, d_z)
        assert upstream >= 10.0
        return
    with warnings.catch_warnings(), use_kernels(kernels):
        warnings.simplefilter("error")
        grads = fast.gsp_pool_backward(ctx, d_pooled, d_z)
    for name in ("features", "prototypes"):
        want = getattr(ref, name)
        assert_allclose(getattr(grads, name), want, rtol=0, atol=1e-10 * np.abs(want).max())


def test_marginal_factors_near_the_largest_float64():
    # b = a - d_rho near +-1.5e308: b_top - b overflowed (inf - inf). The map is linear in
    # (d_rho, column), so 2^k times its value at (d_rho, column) / 2^k (far from overflow,
    # every step exact up to rounding) is the answer; weight <= 1/n keeps it finite.
    rng = np.random.default_rng(19)
    cost = rng.uniform(0.0, 2.0, (2, 3, 5))
    result = fast.weight_transport(cost, mu=0.4, inverse_temperature=2.0)
    d_rho = 1.5e308 * rng.choice([-1.0, 1.0], (2, 5)) * rng.uniform(0.5, 1.0, (2, 5))
    column = rng.standard_normal((2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _gsp_transport.marginal_factors(np, result.rho, result.transported, d_rho,
                                                column)
    scale = 2.0**600
    want = scale * _gsp_transport.marginal_factors(np, result.rho, result.transported,
                                                     d_rho / scale, column / scale)
    assert np.all(np.isfinite(got))
    assert_allclose(got, want, rtol=1e-13)


def test_float32_cost_map_next_to_float32_max():
    # Entries past 2^127 once took the scale 2^128 (inf in float32) and warned; a norm
    # beyond float32 is named (the clipped point would be 0).
    features, prototypes = _inputs(np.random.default_rng(16))
    features, prototypes = features / np.abs(features).max(), prototypes / np.abs(prototypes).max()
    features[0, 0] = [3e38, 0, 0, 0, 0]
    features[1, 2] = [0, -2e38, 1e38, 0, 0]
    prototypes[0] = [0, 0, 0, 1.7e38, 0]
    expected = reference.cost_map(features, prototypes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cost = fast.cost_map(features.astype(np.float32), prototypes.astype(np.float32))
    assert_allclose(cost, expected, rtol=0, atol=1e-6 * expected.max())
    features[2, 1] = [3e38, 3e38, 0, 0, 0]
    with pytest.raises(ValueError, match=r"^features\[\(2, 1\)\] has norm 4.24e\+38, beyond "
                                         r"float32's range \(3.4e\+38\)"):
        fast.cost_map(features.astype(np.float32), prototypes.astype(np.float32))


@pytest.mark.parametrize("dtype, scale", [(np.float64, 1e-310), (np.float32, 1e-40)])
def test_subnormal_points_are_named(dtype, scale):
    features, prototypes = _inputs(np.random.default_rng(17))
    with np.errstate(under="ignore"):
        features, prototypes = (scale * features).astype(dtype), (scale * prototypes).astype(dtype)
    with pytest.raises(ValueError, match=r"^features and prototypes: their largest norm is .*, "
                                         r"below float\d\d's normal range"):
        fast.cost_map(features, prototypes)


def test_gradient_overflow_is_named():
    # An exact tie of the cost at ε = 1e38 on float32: d pi / d c ~ ε / 4 overflows float32.
    cost = np.array([[[0.5, 1.0], [0.5, 2.0]]], np.float32)
    result = fast.weight_transport(cost, mu=0.5, inverse_temperature=1e38)
    d_pi = np.array([[[1e3, 0.0], [-1e3, 0.0]]], np.float32)
    with pytest.raises(ValueError, match=r"d_cost overflows float32: inverse_temperature == 1e\+38"):
        fast.weight_transport_backward(result, None, d_pi)


def test_mu_one_is_global_average_pooling():
    features, prototypes = _inputs(np.random.default_rng(3), dtype=np.float32)
    (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, mu=1.0, inverse_temperature=5.0)
    assert_allclose(pooled, features.mean(axis=1), rtol=1e-6, atol=1e-6)
    assert ctx.transport.converged and np.all(ctx.transport.rho == 0.0)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_float32_cost_map_at_extreme_scales(scale):
    features, prototypes = _inputs(np.random.default_rng(4))
    features, prototypes = features * scale, prototypes * scale
    expected, ref_ctx = reference.cost_map_forward(features, prototypes)
    cost, ctx = fast.cost_map_forward(features.astype(np.float32), prototypes.astype(np.float32))
    assert_allclose(cost, expected, rtol=1e-5, atol=1e-6 * expected.max())
    d_cost = np.random.default_rng(5).standard_normal(cost.shape)
    ref = reference.cost_map_backward(ref_ctx, d_cost)
    got = fast.cost_map_backward(ctx, d_cost.astype(np.float32))
    for name in ("features", "prototypes"):
        want = getattr(ref, name)
        assert_allclose(getattr(got, name), want, atol=1e-4 * np.abs(want).max())


def test_refinement_keeps_float32_cost_accurate_next_to_a_prototype():
    rng = np.random.default_rng(6)
    prototypes = rng.standard_normal((4, 16)) * 0.2
    features = prototypes[None, [0, 1, 2]] + 1e-3 * rng.standard_normal((2, 3, 16))
    expected = reference.cost_map(features, prototypes)
    cost = fast.cost_map(features.astype(np.float32), prototypes.astype(np.float32))
    near = expected < 0.01
    assert near.sum() == 6
    assert_allclose(cost[near], expected[near], rtol=1e-4)


def test_backward_does_not_recompute_the_forward(pool32, monkeypatch):
    (pooled, z), ctx = pool32

    def forbidden(*args, **kwargs):
        raise AssertionError("the backward recomputed part of the forward")

    for name in ("solve", "log_kernel", "transport"):
        monkeypatch.setattr(_gsp_transport, name, forbidden)
    monkeypatch.setattr(_gsp_array, "cost_map_forward", forbidden)
    monkeypatch.setattr(_gsp_array, "_row_norm", forbidden)
    grads = fast.gsp_pool_backward(ctx, pooled, z)
    assert np.all(np.isfinite(grads.features))


def test_tol_zero_asks_for_no_floor_and_warns_not():
    cost = np.random.default_rng(7).uniform(0, 2, (4, 5, 6)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = fast.weight_transport(cost, mu=0.3, inverse_temperature=5.0, tol=0.0)
    assert result.tol == 0.0
    assert result.converged == bool(np.all(result.residual == 0.0))


def test_import_without_cupy(tmp_path):
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import numpy as np\n"
        "from refdml.gpu import gsp, cupy_available\n"
        "assert not cupy_available()\n"
        "(p, z), ctx = gsp.gsp_pool_forward(np.ones((1, 2, 3), np.float32), np.eye(3, dtype=np.float32),"
        " mu=0.5, inverse_temperature=1.0)\n"
        "assert p.dtype == np.float32\n"
    )
    # cwd outside the checkout: the process imports refdml as installed.
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
