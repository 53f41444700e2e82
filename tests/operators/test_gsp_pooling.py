"""The GSP pooling layer (Alg. 2, Eqs. 4.1 and 4.3): forward against loops, backward against FD."""

import functools
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from scipy.special import logsumexp

from refdml import ConvergenceWarning, gsp
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst


def _pool(features, prototypes, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return gsp.gsp_pool_forward(features, prototypes, **kwargs)


def _p2_by_bisection(cost, mu, inverse_temperature):
    """(P2) for one image from scratch: bisection on t in sum_ij pi_ij(t) = mu, plain exp."""
    m, n = cost.shape
    kernel = np.exp(-inverse_temperature * cost)
    s = kernel.sum(axis=0)

    def mass(log_t):
        t = np.exp(log_t)
        return sum(t * s_j / (1.0 + t * s_j) for s_j in s) / n

    lo, hi = -60.0, 60.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if mass(mid) < mu else (lo, mid)
    t = np.exp(0.5 * (lo + hi))
    rho = (1.0 / n) / (1.0 + t * s)
    return rho, t * kernel * rho[None, :]


def _loop_pool(features, prototypes, mu, inverse_temperature, p):
    """Alg. 2 written out per image and per feature."""
    batch, n, d = features.shape
    pooled, z = [], []
    for b in range(batch):
        cost = np.array([
            [np.linalg.norm(w / max(1.0, np.linalg.norm(w)) - f / max(1.0, np.linalg.norm(f))) for f in features[b]]
            for w in prototypes
        ])
        rho, pi = _p2_by_bisection(cost, mu, inverse_temperature)
        total = np.zeros(d)
        for j in range(n):
            total += ((1.0 - n * rho[j]) / mu * features[b, j]) ** p
        pooled.append((total / n) ** (1.0 / p))
        z.append(pi.sum(axis=1) / mu)
    return np.array(pooled), np.array(z)


@pytest.mark.parametrize("p", [1.0, 2.0, 3.5])
@pytest.mark.parametrize("mu, inverse_temperature", [(0.3, 5.0), (0.7, 0.5)])
def test_pool_forward_matches_a_loop(p, mu, inverse_temperature):
    rng = np.random.default_rng(0)
    features = rng.uniform(0.0, 1.0, (2, 6, 3)) * rng.uniform(0.5, 2.0, (2, 6, 1))
    prototypes = rng.standard_normal((4, 3))
    pooled, z = gsp.gsp_pool(features, prototypes, mu=mu, inverse_temperature=inverse_temperature, p=p)
    pooled_ref, z_ref = _loop_pool(features, prototypes, mu, inverse_temperature, p)
    np.testing.assert_allclose(pooled, pooled_ref, rtol=1e-11)
    np.testing.assert_allclose(z, z_ref, rtol=1e-11)
    np.testing.assert_allclose(z.sum(axis=1), 1.0, rtol=1e-13)


def test_eq_4_1_form_for_p_one():
    rng = np.random.default_rng(1)
    features, prototypes = rng.standard_normal((3, 5, 4)), rng.standard_normal((2, 4))
    (pooled, _), ctx = gsp.gsp_pool_forward(features, prototypes, mu=0.4, inverse_temperature=2.0)
    rho = ctx.transport.rho
    eq_4_1 = np.einsum("bj,bjd->bd", (1.0 / 5 - rho) / 0.4, features)
    np.testing.assert_allclose(pooled, eq_4_1, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("method", ["exact", "fixed_point"])
def test_mu_one_is_global_average_pooling(method):
    rng = np.random.default_rng(2)
    features = rng.standard_normal((3, 7, 4))
    prototypes = rng.standard_normal((5, 4))
    pooled, z = gsp.gsp_pool(features, prototypes, mu=1.0, inverse_temperature=3.0, method=method)
    np.testing.assert_allclose(pooled, features.mean(axis=1), rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(z.sum(axis=1), 1.0, rtol=1e-14)
    positive = np.abs(features)
    gem, _ = gsp.gsp_pool(positive, prototypes, mu=1.0, inverse_temperature=3.0, p=3.0, method=method)
    np.testing.assert_allclose(gem, np.mean(positive**3, axis=1) ** (1 / 3), rtol=1e-14)


def _inputs(rng, positive=False):
    features = rng.uniform(0.1, 0.7, (2, 4, 3)) if positive else rng.standard_normal((2, 4, 3)) * 0.8
    return {"features": features, "prototypes": rng.standard_normal((3, 3))}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "options",
    [
        {"mu": 0.3, "inverse_temperature": 5.0},
        {"mu": 0.05, "inverse_temperature": 1.0},
        {"mu": 0.9, "inverse_temperature": 20.0},
        {"mu": 1.0, "inverse_temperature": 2.0},
        {"mu": 0.4, "inverse_temperature": 3.0, "p": 2.0},
        {"mu": 0.4, "inverse_temperature": 3.0, "p": 4.5},
        {"mu": 0.4, "inverse_temperature": 3.0, "method": "fixed_point", "max_iter": 100},
    ],
)
def test_pool_gradients_fixed_seeds(seed, options):
    inputs = _inputs(np.random.default_rng(seed), positive=options.get("p", 1.0) > 1.0)
    _assert_away_from_kinks(inputs)
    forward = functools.partial(_pool, **options)
    assert_gradients(check_gradients(forward, gsp.gsp_pool_backward, inputs, rng=seed), rtol=1e-6)


def _assert_away_from_kinks(inputs):
    for name in ("features", "prototypes"):
        assert np.all(np.abs(np.linalg.norm(inputs[name], axis=-1) - 1.0) > 1e-3), name
    assert gsp.cost_map(inputs["features"], inputs["prototypes"]).min() > 0.05


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 4, 30])
@pytest.mark.parametrize("p", [1.0, 3.0])
def test_pool_unrolled_gradients_fixed_seeds(seed, k, p):
    inputs = _inputs(np.random.default_rng(seed), positive=p > 1.0)
    forward = functools.partial(
        _pool, mu=0.3, inverse_temperature=4.0, p=p, method="fixed_point", max_iter=k, tol=0.0,
        backward="unrolled",
    )
    assert_gradients(check_gradients(forward, gsp.gsp_pool_backward, inputs, rng=seed), rtol=1e-6)


@given(
    rst.points_in_unit_ball(4, 3, min_radius=0.05, max_radius=0.95),
    rst.points_on_sphere(3, 3, radius=1.6),
    st.floats(0.05, 0.95),
    st.floats(0.5, 8.0),
    st.sampled_from([1.0, 2.5]),
)
def test_pool_gradients_hypothesis(points, prototypes, mu, inverse_temperature, p):
    # Norms in (0.05, 0.95) and (1.5, 2.9): away from the clip's kink at 1.
    features = points[None] * np.array([1.0, 3.0, 1.0, 2.0])[None, :, None]
    if p > 1.0:
        features = np.abs(features)
        assume(features.min() > 1e-3)
    assume(np.all(np.abs(np.linalg.norm(features, axis=-1) - 1.0) > 1e-2))
    assume(gsp.cost_map(features, prototypes).min() > 0.05)  # norm kink at c = 0
    forward = functools.partial(_pool, mu=mu, inverse_temperature=inverse_temperature, p=p)
    inputs = {"features": features, "prototypes": prototypes}
    # atol: hypothesis also draws degenerate inputs (every point equal, every prototype
    # equal) whose prototype gradient vanishes; the central differences then return their
    # own rounding, ~5e-12 (found draw), with nothing for rtol to scale against. 1e-10 is
    # far below the O(0.1-1) gradients of the generic draws.
    assert_gradients(check_gradients(forward, gsp.gsp_pool_backward, inputs, rng=0), rtol=1e-6,
                     atol=1e-10)


def test_unrolled_pool_gradient_approaches_closed_form():
    rng = np.random.default_rng(3)
    inputs = _inputs(rng)
    d_pooled, d_z = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    _, exact_ctx = gsp.gsp_pool_forward(**inputs, mu=0.3, inverse_temperature=3.0)
    closed = gsp.gsp_pool_backward(exact_ctx, d_pooled, d_z)
    errors = []
    for k in (3, 10, 30, 90):
        _, ctx = _pool(
            **inputs, mu=0.3, inverse_temperature=3.0, method="fixed_point", max_iter=k, tol=0.0,
            backward="unrolled",
        )
        unrolled = gsp.gsp_pool_backward(ctx, d_pooled, d_z)
        errors.append(max(np.abs(unrolled.features - closed.features).max(),
                          np.abs(unrolled.prototypes - closed.prototypes).max()))
    assert all(b < a for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-10


def test_float32_and_inverse_temperature_200_give_finite_correct_results():
    rng = np.random.default_rng(4)
    features = rng.standard_normal((2, 6, 3)).astype(np.float32)
    prototypes = rng.standard_normal((4, 3)).astype(np.float32)
    (pooled, z), ctx = gsp.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=200.0)
    (pooled64, z64), _ = gsp.gsp_pool_forward(
        features.astype(np.float64), prototypes.astype(np.float64), mu=0.3, inverse_temperature=200.0
    )
    assert pooled.dtype == np.float64
    # Exactly equal by construction: float32 input is widened to float64 on entry.
    np.testing.assert_array_equal(pooled, pooled64)
    np.testing.assert_array_equal(z, z64)
    grads = gsp.gsp_pool_backward(ctx, np.ones((2, 3)), np.ones((2, 4)))
    assert np.all(np.isfinite(grads.features)) and np.all(np.isfinite(grads.prototypes))
    assert np.all(np.isfinite(pooled)) and np.all(np.isfinite(z))
    np.testing.assert_allclose(z.sum(axis=1), 1.0, rtol=1e-12)


def test_pool_bad_input():
    rng = np.random.default_rng(5)
    features, prototypes = rng.standard_normal((1, 4, 3)), rng.standard_normal((2, 3))
    with pytest.raises(ValueError, match=r"features\[\(0, \d, \d\)\] == .* is negative; p == 2.0 > 1"):
        gsp.gsp_pool(features, prototypes, mu=0.3, inverse_temperature=1.0, p=2.0)
    with pytest.raises(ValueError, match=r"p == 0.5, must be in \[1, inf\)"):
        gsp.gsp_pool(np.abs(features), prototypes, mu=0.3, inverse_temperature=1.0, p=0.5)
    with pytest.raises(ValueError, match="same last dimension"):
        gsp.gsp_pool(features, np.ones((2, 4)), mu=0.3, inverse_temperature=1.0)
    with pytest.raises(ValueError, match="mu == 0.0"):
        gsp.gsp_pool(features, prototypes, mu=0.0, inverse_temperature=1.0)
    with pytest.raises(ValueError, match="backward == 'unrolled' needs method='fixed_point'"):
        gsp.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=1.0, backward="unrolled")
    with pytest.raises(ValueError, match="backward == 'implicit'"):
        gsp.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=1.0, backward="implicit")
    with pytest.raises(ValueError, match="inverse_temperature == 0.0"):
        gsp.gsp_pool(features, prototypes, mu=0.3, inverse_temperature=0.0)
    (_, _), ctx = gsp.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=1.0)
    with pytest.raises(ValueError, match=r"d_z has shape \(1, 3\), must be \(1, 2\)"):
        gsp.gsp_pool_backward(ctx, None, np.ones((1, 3)))
    with pytest.raises(ValueError, match="d_pooled must be finite"):
        gsp.gsp_pool_backward(ctx, np.full((1, 3), np.nan), None)
    with pytest.raises(TypeError, match="ctx must be the PoolContext"):
        gsp.gsp_pool_backward(ctx.transport, np.ones((1, 3)), None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'backward'"):
        gsp.gsp_pool_backward(ctx, np.ones((1, 3)), None, backward="unrolled")


@pytest.mark.parametrize("p", [1.0, 3.0])
def test_pool_and_its_gradient_at_extreme_scales(p):
    """Right and finite for features X = s f, s in 1e-300 .. 1e300 (NaN before).

    Reference: the same regime at a moderate t. Above the ball (s, t >= 1e3) the cost
    sees X / ||X|| only; below it (s, t <= 1e-20) the cost is ||wbar - X|| = ||wbar||
    to 1e-20 relative. So pooled / s and z do not depend on s; through ``pooled`` the
    feature gradient does not and the prototype gradient is proportional to s; through
    ``z`` the prototype gradient does not and the feature gradient is proportional to
    1 / s above the ball and independent of s below it.
    """
    rng = np.random.default_rng(30)
    features = np.abs(rng.standard_normal((2, 5, 3))) + 0.1
    prototypes = rng.standard_normal((4, 3))
    d_pooled, d_z = rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    options = dict(mu=0.4, inverse_temperature=3.0, p=p)
    for s in (1e-300, 1e-150, 1e150, 1e300):
        t = 1e3 if s > 1.0 else 1e-20
        (pooled, z), ctx = gsp.gsp_pool_forward(features * s, prototypes, **options)
        (ref_pooled, ref_z), ref_ctx = gsp.gsp_pool_forward(features * t, prototypes, **options)
        np.testing.assert_allclose(pooled / s, ref_pooled / t, rtol=1e-12)
        np.testing.assert_allclose(z, ref_z, rtol=1e-12)
        by_pooled = gsp.gsp_pool_backward(ctx, d_pooled, None)
        ref = gsp.gsp_pool_backward(ref_ctx, d_pooled, None)
        np.testing.assert_allclose(by_pooled.features, ref.features, rtol=1e-10)
        if s > 1.0:
            np.testing.assert_allclose(by_pooled.prototypes / s, ref.prototypes / t, rtol=1e-10)
        else:
            # Below the ball the weights are uniform to O(s): this gradient is O(s^2).
            np.testing.assert_allclose(by_pooled.prototypes, 0.0, atol=s * 1e-15)
            np.testing.assert_allclose(ref.prototypes, 0.0, atol=t * 1e-15)
        by_z = gsp.gsp_pool_backward(ctx, None, d_z)
        ref = gsp.gsp_pool_backward(ref_ctx, None, d_z)
        np.testing.assert_allclose(by_z.prototypes, ref.prototypes, rtol=1e-10)
        feature_factor = t / s if s > 1.0 else 1.0
        np.testing.assert_allclose(by_z.features, ref.features * feature_factor, rtol=1e-10)


def test_pool_with_extreme_prototypes_and_huge_inverse_temperature():
    rng = np.random.default_rng(31)
    features, prototypes = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3))
    for s in (1e-300, 1e300):
        (pooled, z), ctx = gsp.gsp_pool_forward(features * s, prototypes * s, mu=0.4, inverse_temperature=1e16)
        grads = gsp.gsp_pool_backward(ctx, np.ones((2, 3)), np.ones((2, 4)))
        assert np.all(np.isfinite(pooled)) and np.all(np.isfinite(z))
        assert np.all(np.isfinite(grads.features)) and np.all(np.isfinite(grads.prototypes))
        np.testing.assert_allclose(z.sum(axis=1), 1.0, rtol=1e-14)
        np.testing.assert_allclose(ctx.weights.mean(axis=1), 1.0, rtol=1e-13)


# ---------------------------------------------------------------- issue 20: extreme magnitudes


def _power_mean_oracle(y, p):
    """``((1/n) sum_j y_j^p)^(1/p)`` and its derivative in y, from logarithms (float64),
    independent of the layer; None where ``p log y`` overflows."""
    n = y.shape[1]
    with np.errstate(over="ignore"):
        logs = p * np.log(y)
    if not np.all(np.isfinite(logs)):
        return None
    log_pooled = (logsumexp(logs, axis=1) - np.log(n)) / p
    derivative = np.exp((p - 1.0) * (np.log(y) - log_pooled[:, None, :]) - np.log(n))
    return np.exp(log_pooled), derivative


@pytest.mark.parametrize("p", [2000.0, 1e5, 1e15, 1e38, 1e300])
def test_gemean_at_large_p_is_the_power_mean_and_then_max_pooling(p):
    # At mu = 1 the weights are 1: pooled is the power mean of the features and the
    # gradient (through pooled alone) its derivative. The mean once underflowed to 0 for
    # p >= ~2000 (pooled was 0); the backward raised the rounded y / pooled to p - 1 and
    # gave 1/n, not 1, at the largest entry from p ~ 1e17.
    rng = np.random.default_rng(40)
    # One entry per (image, channel) in [1.5, 2], the others in [0.2, 1]: no tie at the top.
    features = rng.uniform(0.2, 1.0, (2, 5, 3))
    winner = rng.integers(0, 5, (2, 1, 3))
    np.put_along_axis(features, winner, rng.uniform(1.5, 2.0, (2, 1, 3)), axis=1)
    d_pooled = rng.standard_normal((2, 3))
    (pooled, _), ctx = gsp.gsp_pool_forward(features, np.eye(3), mu=1.0, inverse_temperature=1.0,
                                            p=p)
    grads = gsp.gsp_pool_backward(ctx, d_pooled, None)
    oracle = _power_mean_oracle(features, p) if p <= 1e5 else None
    if oracle is not None:
        # The oracle's exponent (p - 1) log(y / pooled) carries p times float64's rounding
        # of the logarithms: ~1e5 * 1e-16 relative at p = 1e5.
        np.testing.assert_allclose(pooled, oracle[0], rtol=1e-13)
        np.testing.assert_allclose(grads.features, oracle[1] * d_pooled[:, None, :], rtol=1e-9,
                                   atol=1e-300)
    else:
        # Max pooling: every other entry is below 2/3 of the largest, so its t^p is 0 for
        # p >= 1e15 and M = 1/n exactly; the derivative at the largest entry is
        # (1/n) (1/n)^(1/p - 1) = n^(-1/p) = 1 - O(1e-15), 0 elsewhere.
        # pooled = max (1/n)^(1/p): below the largest entry by log(n) / p <= 1.7e-15.
        np.testing.assert_allclose(pooled, features.max(axis=1), rtol=1e-14)
        is_max = np.zeros(features.shape)
        np.put_along_axis(is_max, winner, 1.0, axis=1)
        np.testing.assert_allclose(grads.features, is_max * d_pooled[:, None, :], rtol=1e-13,
                                   atol=0.0)


@pytest.mark.parametrize("p", [50.0, 2000.0, 1e5])
@pytest.mark.parametrize("backward", ["closed_form", "unrolled"])
def test_gemean_gradients_at_large_p_match_finite_differences(p, backward):
    # The whole layer (mu = 0.3: the weights move with the cost) at moderate and large p,
    # away from ties of the largest weighted feature (smooth there).
    rng = np.random.default_rng(41)
    features = rng.uniform(0.2, 1.0, (2, 4, 3)) * np.array([0.5, 0.8, 1.6, 2.2])[None, :, None]
    inputs = {"features": features, "prototypes": rng.standard_normal((3, 3))}
    _assert_away_from_kinks(inputs)
    options = dict(mu=0.3, inverse_temperature=2.0, p=p)
    if backward == "unrolled":
        options.update(method="fixed_point", max_iter=20, tol=0.0, backward="unrolled")
    forward = functools.partial(_pool, **options)
    assert_gradients(check_gradients(forward, gsp.gsp_pool_backward, inputs, rng=3), rtol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), log10_p=st.floats(0.5, 300.0))
def test_gemean_at_any_p_is_between_the_mean_and_the_max_hypothesis(seed, log10_p):
    # Power means grow with p from the arithmetic mean to the maximum; the gradient
    # through pooled is non-negative and sums to at most 1 per channel (d/dy of a mean
    # of order p >= 1 is (1/n) t^(p-1) M^(1/p - 1), and sum_j (1/n) t_j^(p-1) <= M^(1 - 1/p)).
    rng = np.random.default_rng(seed)
    features = rng.uniform(0.1, 3.0, (2, 5, 3))
    (pooled, _), ctx = gsp.gsp_pool_forward(features, np.eye(3), mu=1.0, inverse_temperature=1.0,
                                            p=10.0**log10_p)
    assert np.all(pooled >= features.mean(axis=1) * (1 - 1e-12))
    assert np.all(pooled <= features.max(axis=1) * (1 + 1e-12))
    grads = gsp.gsp_pool_backward(ctx, np.ones((2, 3)), None)
    assert np.all(grads.features >= 0.0)
    assert np.all(grads.features.sum(axis=1) <= 1.0 + 1e-12)


def _small_mu_oracle(features, prototypes, inverse_temperature):
    """The limit mu -> 0 of (w, pooled, z), independent of the solver: all logits tend to
    -inf, sigma_j ~ e^(tau + l_j), so w_j = sigma_j / mu = n softmax_j(l) (l_j =
    logsumexp_i(-ε c_ij)) and z_i = (1/n) sum_j A_ij w_j, A = softmax_i(-ε c); the next
    order is O(mu)."""
    cost = gsp.cost_map(features, prototypes)                  # (B, m, n)
    n = features.shape[1]
    log_s = logsumexp(-inverse_temperature * cost, axis=1)     # (B, n)
    weights = n * np.exp(log_s - logsumexp(log_s, axis=1, keepdims=True))
    assignment = np.exp(-inverse_temperature * cost - log_s[:, None, :])
    pooled = np.einsum("bn,bnd->bd", weights / n, features)
    z = np.einsum("bmn,bn->bm", assignment, weights) / n
    return weights, pooled, z


@pytest.mark.parametrize("mu", [float(np.finfo(float).tiny), 2.3e-308, 1e-300, 1e-200])
def test_small_mu_is_the_limit_and_its_backward_computes(mu):
    # sigma_j ~ mu are subnormal near float64's least normal mu: scipy's expit returned 0
    # below x ~ -709.78 (weights of 0 where the limit has 0.06), and the backward formed
    # (n / mu) d_w = inf (a RuntimeWarning, inf - inf).
    rng = np.random.default_rng(42)
    features, prototypes = rng.standard_normal((2, 6, 3)), rng.standard_normal((4, 3))
    weights, pooled, z = _small_mu_oracle(features, prototypes, 5.0)
    (got_pooled, got_z), ctx = gsp.gsp_pool_forward(features, prototypes, mu=mu,
                                                    inverse_temperature=5.0)
    # The solve stops at |logit g - logit mu| <= 16 u (1 + |logit mu|) ~ 2.5e-12 here (it
    # moves every w by that relative amount); the subnormal sigma add <= 2^-1075 / mu.
    tolerance = 16 * np.finfo(float).eps * (1 + abs(np.log(mu))) * 4
    np.testing.assert_allclose(ctx.weights, weights, rtol=tolerance)
    np.testing.assert_allclose(got_pooled, pooled, rtol=0, atol=tolerance * np.abs(pooled).max())
    np.testing.assert_allclose(got_z, z, rtol=tolerance)
    d_pooled, d_z = rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    _, limit_ctx = gsp.gsp_pool_forward(features, prototypes, mu=1e-150, inverse_temperature=5.0)
    limit = gsp.gsp_pool_backward(limit_ctx, d_pooled, d_z)
    grads = gsp.gsp_pool_backward(ctx, d_pooled, d_z)
    for name in ("features", "prototypes"):
        want = getattr(limit, name)
        np.testing.assert_allclose(getattr(grads, name), want, rtol=0,
                                   atol=1e-12 * np.abs(want).max())
    _, unrolled_ctx = _pool(features, prototypes, mu=mu, inverse_temperature=5.0,
                            method="fixed_point", max_iter=60, tol=0.0, backward="unrolled")
    unrolled = gsp.gsp_pool_backward(unrolled_ctx, d_pooled, d_z)
    for name in ("features", "prototypes"):
        want = getattr(limit, name)
        # 60 fixed-point steps contract by r ~ mu: converged to rounding.
        np.testing.assert_allclose(getattr(unrolled, name), want, rtol=0,
                                   atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("mu", [2.3e-308, 1e-300])
@pytest.mark.parametrize("backward", ["closed_form", "unrolled"])
def test_small_mu_gradients_match_finite_differences(mu, backward):
    rng = np.random.default_rng(43)
    inputs = _inputs(rng)
    _assert_away_from_kinks(inputs)
    options = dict(mu=mu, inverse_temperature=3.0)
    if backward == "unrolled":
        options.update(method="fixed_point", max_iter=5, tol=0.0, backward="unrolled")
    forward = functools.partial(_pool, **options)
    assert_gradients(check_gradients(forward, gsp.gsp_pool_backward, inputs, rng=4), rtol=1e-6)


@pytest.mark.parametrize("mu", [1e-310, 5e-324])
def test_subnormal_mu_is_named(mu):
    # At a subnormal mu, sigma_j ~ mu keeps too few digits for w = sigma / mu (the layer
    # returned zeros at 1e-310).
    inputs = _inputs(np.random.default_rng(44))
    with pytest.raises(ValueError, match=rf"^mu == {mu!r} is subnormal; the pooling layer needs "
                                         r"mu >= 2.2250738585072014e-308"):
        gsp.gsp_pool_forward(**inputs, mu=mu, inverse_temperature=5.0)


@pytest.mark.parametrize("p", [1.0, 3.0, 1e300])
def test_pooling_of_features_near_the_largest_float64(p):
    # Weights up to ~3 times features near 1.5e308: w f overflowed (inf, a RuntimeWarning),
    # though pooled is a mean (p = 1) or at most max w f / n^(1/p) < max f (p = 3); at
    # p = 1e300 it is max w f itself, beyond float64: named. Above norm 1 the cost sees
    # f / ||f|| only: scaling f by a power of two t scales pooled by t, the gradient through
    # pooled of the features not at all (degree 0), of the prototypes by t (degree 1); the
    # upstream 1e-3 keeps the latter (~ε |f| |d_pooled|) within float64.
    rng = np.random.default_rng(45)
    features = rng.uniform(0.2, 1.0, (2, 5, 3))
    features[:, 0] = [1.0, 0.9, 0.8]                      # the largest weight below
    prototypes = np.array([[1.0, 0.9, 0.8], [-1.0, 0.5, 0.1], [0.2, -1.0, 0.3]])
    args = dict(mu=0.2, inverse_temperature=10.0, p=p)
    big, moderate = 2.0**1023, 2.0**10
    if p > 1e100:
        with pytest.raises(ValueError, match=r"^GeMean \(p == 1e\+300\) of these weighted "
                                             r"features exceeds float64's range"):
            gsp.gsp_pool_forward(features * big, prototypes, **args)
        return
    (pooled, _), ctx = gsp.gsp_pool_forward(features * big, prototypes, **args)
    with np.errstate(over="ignore"):
        assert np.isinf(np.max(ctx.weights[:, :, None] * (features * big)))
    (ref_pooled, _), ref_ctx = gsp.gsp_pool_forward(features * moderate, prototypes, **args)
    np.testing.assert_allclose(pooled / big, ref_pooled / moderate, rtol=1e-13)
    d_pooled = 1e-3 * rng.standard_normal((2, 3))
    got = gsp.gsp_pool_backward(ctx, d_pooled, None)
    want = gsp.gsp_pool_backward(ref_ctx, d_pooled, None)
    np.testing.assert_allclose(got.features, want.features, rtol=0,
                               atol=1e-12 * np.abs(want.features).max())
    np.testing.assert_allclose(got.prototypes / big, want.prototypes / moderate, rtol=0,
                               atol=1e-12 * np.abs(want.prototypes / moderate).max())
    # The gradient is linear in d_pooled: this factor puts it 10x beyond float64.
    factor = np.finfo(float).max / np.abs(got.prototypes).max() * 10
    with pytest.raises(ValueError, match=r"^the gradient with respect to prototypes overflows "
                                         r"float64"):
        gsp.gsp_pool_backward(ctx, factor * d_pooled, None)
