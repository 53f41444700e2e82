"""The GSP pooling layer (Alg. 2, Eqs. 4.1 and 4.3): forward against loops, backward against FD."""

import functools
import warnings

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

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
