"""GSP cost map, the LP (P1) and the entropic problem (P2) with its two backward passes."""

import functools
import warnings

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml import ConvergenceWarning, gsp
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst


def _costs(batch, m, n, low=0.1, high=2.0):
    # low > 0: the harness's step is relative to max|cost|, which must not be subnormal.
    return hnp.arrays(
        np.float64, (batch, m, n),
        elements=st.floats(low, high, allow_nan=False, allow_infinity=False, width=64),
    )


def _wt(cost, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = gsp.weight_transport(cost, **kwargs)
    return (result.rho, result.pi), result


# ----------------------------------------------------------------------------- cost map


def _loop_cost(features, prototypes):
    def clip(u):
        norm = np.sqrt(sum(v * v for v in u))
        return u / max(1.0, norm)

    out = np.empty((features.shape[0], prototypes.shape[0], features.shape[1]))
    for b in range(features.shape[0]):
        for i, w in enumerate(prototypes):
            for j, f in enumerate(features[b]):
                diff = clip(w) - clip(f)
                out[b, i, j] = np.sqrt(sum(v * v for v in diff))
    return out


def test_cost_map_matches_a_loop():
    rng = np.random.default_rng(0)
    features = rng.standard_normal((2, 5, 3)) * rng.uniform(0.2, 3.0, (2, 5, 1))
    prototypes = rng.standard_normal((4, 3)) * rng.uniform(0.2, 3.0, (4, 1))
    np.testing.assert_allclose(
        gsp.cost_map(features, prototypes), _loop_cost(features, prototypes), rtol=1e-13, atol=1e-15
    )


@given(
    rst.points_in_unit_ball(4, 3, min_radius=0.1, max_radius=0.9),
    rst.points_in_unit_ball(3, 3, min_radius=0.1, max_radius=0.9),
    st.sampled_from([0.5, 1.0, 2.5]),
)
def test_cost_map_gradients_hypothesis(features, prototypes, scale):
    features = features[None] * np.array([1.0, 3.0, 0.7, 2.0])[None, :, None]
    prototypes = prototypes * scale
    assume(np.all(np.abs(np.linalg.norm(features, axis=-1) - 1.0) > 1e-2))
    assume(np.all(np.abs(np.linalg.norm(prototypes, axis=-1) - 1.0) > 1e-2))
    assume(gsp.cost_map(features, prototypes).min() > 0.05)  # norm kink at c = 0
    result = check_gradients(
        gsp.cost_map_forward, gsp.cost_map_backward,
        {"features": features, "prototypes": prototypes}, rng=0,
    )
    assert_gradients(result, rtol=1e-6)


def test_cost_map_zero_distance_uses_zero_subgradient():
    features = np.array([[[0.3, 0.4], [2.0, 0.0]]])
    prototypes = np.array([[0.3, 0.4]])  # sits on feature 0: c_00 = 0
    cost, ctx = gsp.cost_map_forward(features, prototypes)
    assert cost[0, 0, 0] == 0.0
    grads = gsp.cost_map_backward(ctx, np.array([[[1.0, 0.0]]]))
    np.testing.assert_array_equal(grads.features, 0.0)
    np.testing.assert_array_equal(grads.prototypes, 0.0)


def test_cost_map_prototype_gradient_sums_over_batch():
    rng = np.random.default_rng(1)
    features = rng.standard_normal((3, 4, 2))
    prototypes = rng.standard_normal((2, 2))
    cost, ctx = gsp.cost_map_forward(features, prototypes)
    g = rng.standard_normal(cost.shape)
    total = gsp.cost_map_backward(ctx, g).prototypes
    per_image = sum(
        gsp.cost_map_backward(gsp.cost_map_forward(features[b:b + 1], prototypes)[1], g[b:b + 1]).prototypes
        for b in range(3)
    )
    np.testing.assert_allclose(total, per_image, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize(
    "features, prototypes, match",
    [
        (np.ones((4, 3)), np.ones((2, 3)), "features must have 3 dimensions"),
        (np.ones((1, 4, 3)), np.ones((2, 2)), "same last dimension"),
        (np.ones((1, 0, 3)), np.ones((2, 3)), "features must not be empty"),
        (np.ones((1, 4, 3)), np.full((2, 3), np.inf), "prototypes must be finite"),
    ],
)
def test_cost_map_bad_input(features, prototypes, match):
    with pytest.raises(ValueError, match=match):
        gsp.cost_map(features, prototypes)


# ----------------------------------------------------------------------------- (P1)


def _greedy_p1(cost, mu):
    """The LP optimum by hand: cheapest features (by min_i c_ij) first, 1/n each, until mu."""
    m, n = cost.shape
    pi = np.zeros((m, n))
    remaining = mu
    for j in sorted(range(n), key=lambda j: cost[:, j].min()):
        if remaining <= 0:
            break
        mass = min(1.0 / n, remaining)
        pi[int(np.argmin(cost[:, j])), j] = mass
        remaining -= mass
    return pi


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mu", [0.13, 0.5, 1.0])
def test_p1_linprog_pot_and_greedy_agree(seed, mu):
    rng = np.random.default_rng(seed)
    cost = rng.uniform(0.0, 2.0, (2, 4, 7))
    exact = gsp.solve_p1_linprog(cost, mu=mu)
    pot = gsp.solve_p1_pot(cost, mu=mu)
    greedy = np.stack([_greedy_p1(c, mu) for c in cost])
    np.testing.assert_allclose(exact.objective, np.sum(cost * greedy, axis=(1, 2)), rtol=1e-10)
    np.testing.assert_allclose(pot.objective, exact.objective, rtol=1e-10)
    # Continuous random costs: the optimum is unique, so the plans agree too.
    np.testing.assert_allclose(exact.pi, greedy, atol=1e-10)
    np.testing.assert_allclose(pot.pi, greedy, atol=1e-10)
    for result in (exact, pot):
        np.testing.assert_allclose(result.rho + result.pi.sum(axis=1), 1.0 / 7, atol=1e-12)
        np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), mu, atol=1e-12)
    if mu == 1.0:
        np.testing.assert_allclose(exact.rho, 0.0, atol=1e-12)  # Thm 4.1


# ----------------------------------------------------------------------------- (P2) forward


def _alg3_literal(cost, mu, inverse_temperature, k):
    """Alg. 3 / Prop. 4.2 exactly as printed (no log domain), one image, k iterations."""
    m, n = cost.shape
    kernel = np.exp(-inverse_temperature * cost)
    t = 1.0
    for _ in range(k):
        rho = (1.0 / n) / (1.0 + t * kernel.sum(axis=0))
        t = mu / (kernel @ rho).sum()
    return rho, t * kernel * rho[None, :]


@pytest.mark.parametrize("k", [1, 2, 5, 17])
@pytest.mark.parametrize("inverse_temperature", [0.5, 8.0])
def test_fixed_point_reproduces_the_printed_iteration(k, inverse_temperature):
    rng = np.random.default_rng(k)
    cost = rng.uniform(0.0, 2.0, (3, 4, 6))
    (rho, pi), result = _wt(cost, mu=0.3, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=k, tol=0.0)
    assert result.n_iter == k
    for b in range(3):
        rho_ref, pi_ref = _alg3_literal(cost[b], 0.3, inverse_temperature, k)
        np.testing.assert_allclose(rho[b], rho_ref, rtol=1e-12)
        np.testing.assert_allclose(pi[b], pi_ref, rtol=1e-11, atol=1e-300)


def _assert_kkt(result, cost, atol):
    """(rho, pi) feasible and log pi_ij - log rho_j + inverse_temperature c_ij constant: the optimum of (P2).

    (P2) is strictly convex; feasibility plus stationarity with multipliers (here
    tau = log t) certifies the unique solution, independently of how it was found.
    """
    n = cost.shape[2]
    np.testing.assert_allclose(result.rho + result.pi.sum(axis=1), 1.0 / n, rtol=0, atol=1e-12)
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), result.mu, rtol=0, atol=1e-12)
    assert np.all(result.rho > 0) and np.all(result.pi >= 0)
    visible = result.pi > 1e-280  # log of what did not underflow
    stationarity = np.log(np.where(visible, result.pi, 1.0)) - np.log(result.rho)[:, None, :] + result.inverse_temperature * cost
    deviation = np.where(visible, stationarity - result.log_t[:, None, None], 0.0)
    np.testing.assert_allclose(deviation, 0.0, atol=atol)


@given(_costs(2, 3, 5), st.floats(0.02, 0.98), st.floats(0.1, 300.0))
def test_exact_solution_is_feasible_and_stationary(cost, mu, inverse_temperature):
    result = gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature)
    assert result.converged and result.n_iter <= 60
    assert np.all(result.residual <= 1e-12)
    _assert_kkt(result, cost, atol=1e-8 * max(1.0, inverse_temperature))


@pytest.mark.parametrize("inverse_temperature", [0.5, 5.0])
@pytest.mark.parametrize("mu", [0.05, 0.3, 0.8])
def test_exact_and_converged_fixed_point_agree(inverse_temperature, mu):
    rng = np.random.default_rng(4)
    cost = rng.uniform(0.0, 2.0, (3, 6, 9))
    exact = gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature)
    fixed = gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=2000, tol=1e-14)
    assert fixed.converged and fixed.n_iter < 2000
    np.testing.assert_allclose(fixed.rho, exact.rho, rtol=0, atol=1e-10 / 9)
    np.testing.assert_allclose(fixed.pi, exact.pi, rtol=0, atol=1e-10 / 9)
    np.testing.assert_allclose(fixed.log_t, exact.log_t, rtol=0, atol=1e-10)


def test_fixed_point_contracts_at_the_predicted_rate():
    rng = np.random.default_rng(5)
    cost = rng.uniform(0.0, 2.0, (2, 5, 8))
    exact = gsp.weight_transport(cost, mu=0.4, inverse_temperature=4.0)
    _, fixed = _wt(cost, mu=0.4, inverse_temperature=4.0, method="fixed_point", max_iter=40, tol=0.0)
    errors = np.abs(fixed.tau_history - exact.log_t[:, None])
    observed = errors[:, 12] / errors[:, 11]
    np.testing.assert_allclose(observed, exact.contraction_rate, rtol=1e-3)
    assert np.all((exact.contraction_rate > 0) & (exact.contraction_rate < 1))


def test_fixed_point_warns_when_not_converged():
    cost = np.random.default_rng(6).uniform(0.0, 2.0, (2, 4, 6))
    with pytest.warns(ConvergenceWarning, match=r"reached max_iter == 3 with residual .* > tol == 1e-12"):
        result = gsp.weight_transport(cost, mu=0.3, inverse_temperature=20.0, method="fixed_point", max_iter=3)
    assert not result.converged and result.n_iter == 3
    assert np.all(result.residual > 1e-12)
    # The mass constraint is exact after each t-update; the column constraints are not.
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), 0.3, atol=1e-15)


def test_fixed_point_stops_early_and_tol_zero_runs_max_iter():
    cost = np.random.default_rng(7).uniform(0.0, 2.0, (2, 4, 6))
    early = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1.0, method="fixed_point", max_iter=500)
    assert early.converged and early.n_iter < 100
    assert early.tau_history.shape == (2, early.n_iter + 1)
    assert np.all(early.residual <= 1e-12)
    # tol = 0: a fixed count, no ConvergenceWarning, converged only at residual 0.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        full = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1.0, method="fixed_point", max_iter=150, tol=0.0)
        exact = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1.0, tol=0.0)
    assert full.n_iter == 150
    assert full.converged == bool(np.all(full.residual == 0.0))
    assert exact.converged == bool(np.all(exact.residual == 0.0))
    np.testing.assert_allclose(full.rho, exact.rho, rtol=1e-12)


def test_large_inverse_temperature_approaches_the_lp():
    rng = np.random.default_rng(8)
    m, n, mu = 4, 10, 0.35  # 3.5 features: the LP keeps one of them fractionally
    cost = rng.uniform(0.0, 2.0, (3, m, n))
    lp = gsp.solve_p1_linprog(cost, mu=mu)
    pot = gsp.solve_p1_pot(cost, mu=mu)
    np.testing.assert_allclose(pot.objective, lp.objective, rtol=1e-10)
    gaps = []
    for inverse_temperature in (3.0, 30.0, 300.0, 3000.0, 30000.0):
        result = gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature)
        gap = np.sum(cost * result.pi, axis=(1, 2)) - lp.objective
        # 0 <= <c, pi_eps> - LP <= (entropy range) / inverse_temperature = log(m + 1) / inverse_temperature (docs/gsp.md)
        assert np.all(gap >= -1e-12)
        assert np.all(gap <= np.log(m + 1) / inverse_temperature + 1e-12)
        gaps.append(gap.max())
    assert gaps[-1] < 1e-4
    # Unique LP solution (continuous costs): rho and pi converge to it.
    np.testing.assert_allclose(result.rho, lp.rho, atol=1e-6)
    np.testing.assert_allclose(result.pi, lp.pi, atol=1e-6)


def test_inverse_temperature_200_and_float32_are_finite_and_correct():
    rng = np.random.default_rng(9)
    cost64 = rng.uniform(0.0, 2.0, (2, 5, 7))
    cost32 = cost64.astype(np.float32)
    result = gsp.weight_transport(cost32, mu=0.3, inverse_temperature=200.0)
    assert result.converged and np.all(np.isfinite(result.pi)) and np.all(np.isfinite(result.rho))
    _assert_kkt(result, cost32.astype(np.float64), atol=1e-9)
    same = gsp.weight_transport(cost32.astype(np.float64), mu=0.3, inverse_temperature=200.0)
    # Exactly equal by construction: float32 input is widened to float64 on entry.
    np.testing.assert_array_equal(result.pi, same.pi)
    # exp(-200 c) alone underflows to 0 for c > 3.7; the log domain only shifts tau.
    base = gsp.weight_transport(cost64, mu=0.3, inverse_temperature=200.0)
    far = gsp.weight_transport(cost64 + 5.0, mu=0.3, inverse_temperature=200.0)
    assert np.all(np.isfinite(far.pi)) and far.converged
    # tau ~ 1000 carries an absolute rounding of ~1e-13, hence rtol 1e-11.
    np.testing.assert_allclose(far.pi, base.pi, rtol=1e-11, atol=1e-15)
    np.testing.assert_allclose(far.log_t, base.log_t + 1000.0, rtol=1e-12)


def test_mu_one_is_handled_explicitly_for_both_methods():
    rng = np.random.default_rng(10)
    cost = rng.uniform(0.0, 2.0, (2, 3, 5))
    softmax = np.exp(-2.0 * cost) / np.exp(-2.0 * cost).sum(axis=1, keepdims=True)
    for method in ("exact", "fixed_point"):
        result = gsp.weight_transport(cost, mu=1.0, inverse_temperature=2.0, method=method)
        assert result.converged and result.n_iter == 0
        assert np.all(np.isinf(result.t)) and np.all(np.isinf(result.log_t))
        np.testing.assert_array_equal(result.rho, 0.0)
        np.testing.assert_allclose(result.pi, softmax / 5, rtol=1e-13)
    # The boundary is the limit of the interior.
    near = gsp.weight_transport(cost, mu=1.0 - 1e-10, inverse_temperature=2.0)
    np.testing.assert_allclose(near.pi, softmax / 5, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"mu": 0.0}, ValueError, r"mu == 0.0, must be in \(0, 1\]"),
        ({"mu": 1.5}, ValueError, r"mu == 1.5, must be in \(0, 1\]"),
        ({"mu": np.nan}, ValueError, "mu == nan, must be finite"),
        ({"inverse_temperature": 0.0}, ValueError, r"inverse_temperature == 0.0, must be in \(0, inf\)"),
        ({"inverse_temperature": -1.0}, ValueError, "inverse_temperature == -1.0"),
        ({"inverse_temperature": np.inf}, ValueError, "inverse_temperature == inf, must be finite"),
        ({"method": "sinkhorn"}, ValueError, "method == 'sinkhorn'"),
        ({"max_iter": 0}, ValueError, "max_iter == 0"),
        ({"max_iter": 2.5}, TypeError, "max_iter must be an integer"),
        ({"tol": -1e-3}, ValueError, "tol == -0.001"),
        ({"mu": "0.3"}, TypeError, "mu must be a real number"),
    ],
)
def test_weight_transport_bad_arguments(kwargs, error, match):
    args = {"mu": 0.3, "inverse_temperature": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        gsp.weight_transport(np.ones((1, 2, 3)), **args)


@pytest.mark.parametrize(
    "cost, match",
    [
        (np.ones((2, 3)), "cost must have 3 dimensions"),
        (np.ones((1, 0, 3)), "cost must not be empty"),
        (np.ones((1, 2, 0)), "cost must not be empty"),
        (np.array([[[1.0, np.nan]]]), "cost must be finite, got nan at index"),
        (np.array([[[1.0, np.inf]]]), "cost must be finite, got inf"),
    ],
)
def test_weight_transport_bad_cost(cost, match):
    with pytest.raises(ValueError, match=match):
        gsp.weight_transport(cost, mu=0.3, inverse_temperature=1.0)


# ----------------------------------------------------------------------------- (P2) backward


def _dense_implicit_gradient(result, d_rho, d_pi):
    """App. A.3 with an explicit solve: -inverse_temperature Ibar (D - D A^T H^-1 A D) dL/dx, one image."""
    rho, pi, inverse_temperature = result.rho[0], result.pi[0], result.inverse_temperature
    m, n = pi.shape
    x = np.concatenate([rho, pi.ravel()])
    a = np.zeros((n + 1, (m + 1) * n))
    a[:n, :n] = np.eye(n)
    a[:n, n:] = np.tile(np.eye(n), (1, m))
    a[n, n:] = 1.0
    d = np.diag(x)
    h = a @ d @ a.T
    jac = d - d @ a.T @ np.linalg.solve(h, a @ d)
    g = np.concatenate([d_rho[0], d_pi[0].ravel()])
    return (-inverse_temperature * (jac @ g)[n:]).reshape(m, n)


@pytest.mark.parametrize("mu", [0.02, 0.3, 0.9, 0.9999])
def test_closed_form_matches_dense_implicit_differentiation(mu):
    rng = np.random.default_rng(11)
    cost = rng.uniform(0.0, 2.0, (1, 3, 5))
    result = gsp.weight_transport(cost, mu=mu, inverse_temperature=3.0)
    d_rho, d_pi = rng.standard_normal((1, 5)), rng.standard_normal((1, 3, 5))
    closed = gsp.weight_transport_backward(result, d_rho, d_pi).cost
    np.testing.assert_allclose(closed[0], _dense_implicit_gradient(result, d_rho, d_pi), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mu, inverse_temperature", [(0.01, 1.0), (0.3, 0.5), (0.3, 20.0), (0.95, 5.0), (1 - 1e-7, 3.0), (1.0, 3.0)])
def test_closed_form_gradients_fixed_seeds(seed, mu, inverse_temperature):
    cost = np.random.default_rng(seed).uniform(0.0, 2.0, (2, 3, 4))
    forward = functools.partial(_wt, mu=mu, inverse_temperature=inverse_temperature)
    assert_gradients(check_gradients(forward, gsp.weight_transport_backward, {"cost": cost}, rng=seed), rtol=1e-6)


@given(_costs(1, 3, 4), st.floats(0.03, 0.97), st.floats(0.3, 8.0))
def test_closed_form_gradients_hypothesis(cost, mu, inverse_temperature):
    forward = functools.partial(_wt, mu=mu, inverse_temperature=inverse_temperature)
    assert_gradients(check_gradients(forward, gsp.weight_transport_backward, {"cost": cost}, rng=0), rtol=1e-6)


def test_printed_reading_of_4_2_is_wrong():
    """(4.2) read literally, ``n pi Diag(q - eta/kappa) rho``, fails finite differences."""
    rng = np.random.default_rng(12)
    cost = rng.uniform(0.0, 2.0, (1, 3, 4))

    def literal_backward(result, d_rho, d_pi):
        rho, pi, n = result.rho, result.pi, result.rho.shape[1]
        q = rho * d_rho + (pi * d_pi).sum(axis=1)
        eta = np.sum(rho * d_rho, axis=1) - n * np.sum(q * rho, axis=1)
        kappa = 1.0 - result.mu - n * np.sum(rho * rho, axis=1)
        inner = (q - (eta / kappa)[:, None]) * rho
        return {"cost": -result.inverse_temperature * (pi * d_pi - n * pi * inner[:, None, :])}

    forward = functools.partial(_wt, mu=0.4, inverse_temperature=2.0)
    literal = check_gradients(forward, literal_backward, {"cost": cost}, rng=0)
    assert literal.max_rel_error > 1e-2
    ours = check_gradients(forward, gsp.weight_transport_backward, {"cost": cost}, rng=0)
    assert_gradients(ours, rtol=1e-6)


def test_closed_form_near_mu_one_is_continuous():
    rng = np.random.default_rng(13)
    cost = rng.uniform(0.0, 2.0, (2, 3, 6))
    d_rho, d_pi = rng.standard_normal((2, 6)), rng.standard_normal((2, 3, 6))
    at_one = gsp.weight_transport_backward(gsp.weight_transport(cost, mu=1.0, inverse_temperature=2.0), d_rho, d_pi).cost
    for gap in (1e-4, 1e-8, 1e-12):
        near = gsp.weight_transport(cost, mu=1.0 - gap, inverse_temperature=2.0)
        grad = gsp.weight_transport_backward(near, d_rho, d_pi).cost
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad, at_one, atol=50 * gap)


@given(_costs(1, 2, 4), st.floats(0.05, 0.95), st.floats(0.3, 6.0), st.integers(1, 30))
def test_unrolled_gradient_is_exact_for_any_k(cost, mu, inverse_temperature, k):
    forward = functools.partial(_wt, mu=mu, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=k, tol=0.0)
    result = check_gradients(forward, gsp.weight_transport_backward_unrolled, {"cost": cost}, rng=1)
    assert_gradients(result, rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("k", [1, 3, 25])
def test_unrolled_gradient_fixed_seeds(seed, k):
    cost = np.random.default_rng(seed).uniform(0.0, 2.0, (2, 3, 4))
    forward = functools.partial(_wt, mu=0.25, inverse_temperature=4.0, method="fixed_point", max_iter=k, tol=0.0)
    assert_gradients(
        check_gradients(forward, gsp.weight_transport_backward_unrolled, {"cost": cost}, rng=seed), rtol=1e-6
    )


def test_unrolled_gradient_converges_to_the_closed_form():
    rng = np.random.default_rng(14)
    cost = rng.uniform(0.0, 2.0, (2, 4, 6))
    d_rho, d_pi = rng.standard_normal((2, 6)), rng.standard_normal((2, 4, 6))
    exact = gsp.weight_transport(cost, mu=0.3, inverse_temperature=3.0)
    closed = gsp.weight_transport_backward(exact, d_rho, d_pi).cost
    errors = []
    for k in (2, 5, 10, 20, 40, 80):
        _, result = _wt(cost, mu=0.3, inverse_temperature=3.0, method="fixed_point", max_iter=k, tol=0.0)
        unrolled = gsp.weight_transport_backward_unrolled(result, d_rho, d_pi).cost
        errors.append(np.abs(unrolled - closed).max() / np.abs(closed).max())
    # Decreasing (like r^k) until the rounding floor of the two gradients (~1e-15 here).
    assert all(b < a or b < 1e-13 for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 1e-10


def test_unrolled_backward_rejects_exact_results_and_bad_shapes():
    cost = np.random.default_rng(15).uniform(0.0, 2.0, (1, 2, 3))
    exact = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1.0)
    with pytest.raises(ValueError, match="needs a result of method='fixed_point'"):
        gsp.weight_transport_backward_unrolled(exact, None, np.zeros((1, 2, 3)))
    with pytest.raises(ValueError, match=r"d_pi has shape \(2, 3\), must be \(1, 2, 3\)"):
        gsp.weight_transport_backward(exact, None, np.zeros((2, 3)))
    with pytest.raises(ValueError, match="d_rho has shape"):
        gsp.weight_transport_backward(exact, np.zeros(3), None)
    with pytest.raises(ValueError, match="d_rho must be finite"):
        gsp.weight_transport_backward(exact, np.full((1, 3), np.inf), None)
    with pytest.raises(TypeError, match="result must be the WeightTransportResult"):
        gsp.weight_transport_backward((exact.rho, exact.pi), None, np.zeros((1, 2, 3)))
    with pytest.raises(TypeError, match="result must be the WeightTransportResult"):
        gsp.weight_transport_backward_unrolled(object(), None, np.zeros((1, 2, 3)))


def test_unrolled_at_mu_one_is_the_closed_form():
    rng = np.random.default_rng(16)
    cost = rng.uniform(0.0, 2.0, (1, 3, 4))
    result = gsp.weight_transport(cost, mu=1.0, inverse_temperature=2.0, method="fixed_point")
    d_pi = rng.standard_normal((1, 3, 4))
    np.testing.assert_array_equal(
        gsp.weight_transport_backward_unrolled(result, None, d_pi).cost,
        gsp.weight_transport_backward(result, None, d_pi).cost,
    )


# ----------------------------------------------------------------------------- extreme input

SCALES = (1e-300, 1e-150, 1e150, 1e300)


def test_cost_map_and_its_gradient_at_extreme_scales():
    rng = np.random.default_rng(20)
    features, prototypes = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3))
    d_cost = rng.standard_normal((2, 4, 5))
    for s in SCALES:
        cost, ctx = gsp.cost_map_forward(features * s, prototypes * s)
        grads = gsp.cost_map_backward(ctx, d_cost)
        # Reference: the same scale regime at a moderate magnitude t (every norm > 1 for
        # s, t >= 1e3: the cost is that of the unit vectors; every norm tiny for
        # s, t <= 1e-20: the cost is t ||w - f|| to 1e-20 relative).
        t = 1e3 if s > 1.0 else 1e-20
        ref, ref_ctx = gsp.cost_map_forward(features * t, prototypes * t)
        ref_grads = gsp.cost_map_backward(ref_ctx, d_cost)
        factor = 1.0 if s > 1.0 else s / t  # cost ~ s below the ball, ~1 outside it
        np.testing.assert_allclose(cost, ref * factor, rtol=1e-13)
        # d cost / d input ~ 1 / s outside the ball, ~ 1 inside it.
        grad_factor = t / s if s > 1.0 else 1.0
        np.testing.assert_allclose(grads.features, ref_grads.features * grad_factor, rtol=1e-12, atol=0)
        np.testing.assert_allclose(grads.prototypes, ref_grads.prototypes * grad_factor, rtol=1e-12, atol=0)
    # Independently: below the ball the cost is the plain distance, by a loop.
    tiny = gsp.cost_map(features * 1e-300, prototypes * 1e-300) / 1e-300
    np.testing.assert_allclose(tiny, _loop_cost(features * 1e-3, prototypes * 1e-3) / 1e-3, rtol=1e-12)


@pytest.mark.parametrize("seed", range(180, 192))
def test_huge_inverse_temperature_satisfies_the_constraints(seed):
    # At inverse_temperature = 1e16, tau ~ 1e16 and one ulp of tau moves a whole
    # feature's mass: a single Newton phase left mass errors up to 0.21 (seed 188).
    rng = np.random.default_rng(seed)
    m, n = rng.integers(2, 6), rng.integers(3, 12)
    cost = rng.uniform(0.0, 2.0, (1, m, n))
    result = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1e16)
    assert result.converged
    # The stated tolerance: Newton stops at 16 ulps of logit(g), ~1e-15 of mass.
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), 0.3, rtol=0, atol=1e-14)
    np.testing.assert_allclose(result.rho + result.pi.sum(axis=1), 1.0 / n, rtol=0, atol=1e-14)
    # Independent: (P2) at this inverse temperature is the LP to rounding.
    lp = gsp.solve_p1_linprog(cost, mu=0.3)
    np.testing.assert_allclose(np.sum(cost * result.pi, axis=(1, 2)), lp.objective, rtol=0, atol=1e-12)


def test_huge_inverse_temperature_fixed_point_warns_truthfully():
    cost = np.random.default_rng(188).uniform(0.0, 2.0, (1, 3, 3))
    # Prop. 4.2 moves log t by O(log n) a step while the stairs of g are ~1e16 wide: it
    # cannot converge in 20 iterations, and says so; its iterate still holds the mass
    # constraint (anchored coordinates, docs/gsp.md), which tau + l_j lost (0.3 -> 0.53).
    with pytest.warns(ConvergenceWarning, match=r"reached max_iter == 20 .*mass constraint holds"):
        result = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1e16, method="fixed_point", max_iter=20)
    assert not result.converged and result.n_iter == 20
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), 0.3, rtol=0, atol=1e-15)
    with pytest.warns(ConvergenceWarning, match=r"reached max_iter == 2 with residual"):
        gsp.weight_transport(cost, mu=0.3, inverse_temperature=5.0, method="fixed_point", max_iter=2)


def test_weight_transport_is_invariant_to_the_scale_of_the_cost():
    rng = np.random.default_rng(21)
    cost = rng.uniform(0.0, 2.0, (2, 3, 6))
    base = gsp.weight_transport(cost, mu=0.3, inverse_temperature=3.0)
    for s in SCALES:
        scaled = gsp.weight_transport(cost * s, mu=0.3, inverse_temperature=3.0 / s)
        np.testing.assert_allclose(scaled.pi, base.pi, rtol=1e-12, atol=1e-16)
        np.testing.assert_allclose(scaled.rho, base.rho, rtol=1e-12, atol=1e-16)
    # cost + 1e300 rounds every entry to exactly 1e300: by symmetry each pi_ij = mu / (m n).
    # The solvers see only cost differences; tau = log t ~ 1e310 is reported as inf.
    shifted = gsp.weight_transport(cost + 1e300, mu=0.3, inverse_temperature=1e10)
    assert shifted.converged and np.all(np.isinf(shifted.log_t))
    np.testing.assert_allclose(shifted.pi, 0.3 / 18, rtol=1e-14)
    # ε c ~ 1e310 overflows, ε (c - c') does too: every weight but the LP's is exactly 0.
    huge = gsp.weight_transport(cost * 1e300, mu=0.3, inverse_temperature=1e10)
    assert huge.converged and np.all(huge.residual <= 1e-15)
    np.testing.assert_allclose(huge.pi, gsp.solve_p1_linprog(cost, mu=0.3).pi, rtol=0, atol=1e-12)
    _, fixed = _wt(cost + 1e300, mu=0.3, inverse_temperature=1e10, method="fixed_point", max_iter=5)
    np.testing.assert_allclose(fixed.pi.sum(axis=(1, 2)), 0.3, rtol=0, atol=1e-15)


def test_p1_solvers_at_extreme_scales():
    cost = np.random.default_rng(22).uniform(0.0, 2.0, (2, 3, 7))
    base = gsp.solve_p1_pot(cost, mu=0.4)
    for s in SCALES:
        for solve in (gsp.solve_p1_linprog, gsp.solve_p1_pot):
            result = solve(cost * s, mu=0.4)
            np.testing.assert_allclose(result.pi, base.pi, rtol=0, atol=1e-12)
            np.testing.assert_allclose(result.objective, base.objective * s, rtol=1e-12)
