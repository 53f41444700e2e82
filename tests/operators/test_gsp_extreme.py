"""GSP (P2) at every finite inverse temperature: constraints, independent oracles, backward.

The solvers form the logits ``tau + l_j`` from cost differences (docs/gsp.md Sec. 2), so
that ``method="exact"`` holds the constraints to rounding for every finite ε up to
``np.finfo(float).max``, and every iterate of ``method="fixed_point"`` holds the mass
constraint there. Oracles, each independent of the code under test:

* a plain bisection on ``tau`` with ``tau + l_j`` in 420-digit decimals (Python's
  ``decimal``; the sigmoids of the once-rounded logits in float64);
* Prop. 4.2 iterated in the same decimals;
* ``scipy.optimize.linprog`` (HiGHS) on the LP (P1), which (P2) equals to rounding once
  ε times every gap of the cost exceeds ~40, and the bound
  ``0 <= <c, pi> - LP <= log(m + 1) / ε`` (docs/gsp.md Sec. 6) at every ε;
* central differences (the gradcheck harness), including of the value
  ``V(c) = <c, pi(c)>``, whose derivative tends to the LP plan (Danskin) as ε grows.
"""

from __future__ import annotations

import decimal
import functools
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml import ConvergenceWarning, gsp
from refdml.gradcheck import assert_gradients, check_gradients

MAX = float(np.finfo(np.float64).max)
EPSILONS = (1e0, 1e2, 1e4, 1e8, 1e12, 1e16, 1e20, 1e30, 1e100, 1e200, 1e300, MAX)
# The stated tolerance of the constraints (total mass 1): rho, pi and their sums carry a
# few roundings each; measured <= 1.4e-15 over these tests.
TOL = 1e-14


def _clustered(rng, shape, inverse_temperature):
    """Costs of which about half lie within 4 / ε above 0 (moderate logits among them at
    any ε) and the rest in [0.5, 2] (saturated, a weight of exactly 0, at large ε)."""
    near = rng.uniform(0.0, 4.0, shape) / inverse_temperature
    return np.where(rng.random(shape) < 0.5, near, rng.uniform(0.5, 2.0, shape))


def _costs(rng, kind, shape, inverse_temperature):
    if kind == "uniform":
        return rng.uniform(0.0, 2.0, shape)
    return _clustered(rng, shape, inverse_temperature)


def _solve(cost, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConvergenceWarning, no RuntimeWarning
        return gsp.weight_transport(cost, **kwargs)


def _assert_feasible(result, atol):
    n = result.rho.shape[1]
    for a in (result.rho, result.pi, result.transported):
        assert np.all(np.isfinite(a))
    assert np.all(result.rho >= 0.0) and np.all(result.pi >= 0.0)
    np.testing.assert_allclose(result.rho + result.pi.sum(axis=1), 1.0 / n, rtol=0, atol=atol)
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), result.mu, rtol=0, atol=atol)


# ----------------------------------------------------------------------------- oracles


def _decimal_solution(cost, mu, inverse_temperature):
    """(P2) for one image (m, n) by plain bisection on tau; ``tau + l_j`` in 420 digits.

    ``l_j = log sum_i exp(-ε c_ij)`` is ``log(sum_i exp(-ε (c_ij - cmin_j))) - ε cmin_j``:
    the products and ``tau + l_j`` are exact to ~1e-100 here, then rounded once to float64
    for the sigmoid. 1300 halvings take a bracket of 1e309 below 1e-80.
    """
    with decimal.localcontext() as context:
        context.prec = 420
        eps = decimal.Decimal(inverse_temperature)
        m, n = cost.shape
        log_s, assignment = [], []
        for j in range(n):
            column = [decimal.Decimal(float(v)) for v in cost[:, j]]
            low = min(column)
            weights = [math.exp(-float(eps * (v - low))) for v in column]
            log_s.append(decimal.Decimal(math.log(sum(weights))) - eps * low)
            assignment.append([w / sum(weights) for w in weights])
        logit = decimal.Decimal(math.log(mu) - math.log1p(-mu))
        lo, hi = logit - max(log_s), logit - min(log_s)
        for _ in range(1300):
            middle = (lo + hi) / 2
            if sum(_sigmoid(float(middle + l)) for l in log_s) / n < mu:
                lo = middle
            else:
                hi = middle
        x = [float((lo + hi) / 2 + l) for l in log_s]
    rho = np.array([_sigmoid(-v) / n for v in x])
    pi = np.array([[_sigmoid(x[j]) / n * assignment[j][i] for j in range(n)] for i in range(m)])
    return rho, pi


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x)) if x > -700.0 else 0.0


def _softplus(x):
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _decimal_prop42(cost, mu, inverse_temperature, k):
    """The k-th iterate of Prop. 4.2 for one image, ``tau_s`` and ``tau_s + l_j`` in 420 digits.

    ``tau_{s+1} = tau_s + log mu - log((1/n) sum_j sigma(x_j))``, ``x = tau_s + l``, with
    the log-sum of ``log sigma(x_j) = (x_j - M) - softplus(x_j) + M`` (``M = max x``) taken
    around ``M`` in decimals; ``rho^(k) = sigma(-x^(k-1)) / n`` and
    ``pi^(k)_ij = exp(tau_k - tau_{k-1}) sigma(x^(k-1)_j) A_ij / n``.
    """
    with decimal.localcontext() as context:
        context.prec = 420
        eps, d = decimal.Decimal(inverse_temperature), decimal.Decimal
        m, n = cost.shape
        log_s, assignment = [], []
        for j in range(n):
            column = [d(float(v)) for v in cost[:, j]]
            low = min(column)
            weights = [math.exp(-float(eps * (v - low))) for v in column]
            log_s.append(d(math.log(sum(weights))) - eps * low)
            assignment.append([w / sum(weights) for w in weights])
        taus = [d(0)]
        for _ in range(k):
            x = [taus[-1] + l for l in log_s]
            top = max(x)
            log_sum = top + d(math.log(sum(
                math.exp(float(v - top) - _softplus(float(v))) for v in x)))
            taus.append(taus[-1] + d(math.log(mu) + math.log(n)) - log_sum)
        x = [taus[-2] + l for l in log_s]
        step = taus[-1] - taus[-2]
        # log(n P_j) = step + log sigma(x_j), formed without subtracting two huge numbers
        log_n_p = [
            float(step) - _softplus(-float(v)) if v >= 0
            else float(step + v) - _softplus(float(v))
            for v in x
        ]
    rho = np.array([_sigmoid(-float(v)) / n for v in x])
    pi = np.array([[math.exp(log_n_p[j]) / n * assignment[j][i] for j in range(n)] for i in range(m)])
    return rho, pi


# ----------------------------------------------------------------------------- exact: constraints


@pytest.mark.parametrize("inverse_temperature", EPSILONS)
@pytest.mark.parametrize("kind", ["uniform", "clustered"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_holds_the_constraints_at_every_inverse_temperature(inverse_temperature, kind, seed):
    rng = np.random.default_rng(seed)
    cost = _costs(rng, kind, (3, 5, 9), inverse_temperature)
    for mu in (0.05, 0.3, 0.5, 0.97):
        result = _solve(cost, mu=mu, inverse_temperature=inverse_temperature)
        assert result.converged and result.n_iter <= 40
        assert np.all(result.residual <= TOL)
        _assert_feasible(result, TOL)
        # transported is sigma(x) = 1 - n rho, formed without the cancellation
        np.testing.assert_allclose(result.transported + 9 * result.rho, 1.0, rtol=0, atol=1e-15)


@settings(max_examples=60)
@given(
    cost=hnp.arrays(
        np.float64, st.tuples(st.integers(1, 2), st.integers(1, 5), st.integers(1, 9)),
        elements=st.one_of(
            st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False),
            st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False),
        ),
    ),
    mu=st.floats(1e-3, 1.0 - 1e-3),
    inverse_temperature=st.one_of(st.floats(1e-3, MAX), st.sampled_from(EPSILONS)),
)
def test_exact_holds_the_constraints_hypothesis(cost, mu, inverse_temperature):
    # Any finite cost (differences up to 2e300 overflow float64, ε c up to 1e308 * 1e300).
    result = _solve(cost, mu=mu, inverse_temperature=inverse_temperature)
    assert result.converged
    _assert_feasible(result, TOL)


@pytest.mark.parametrize("inverse_temperature", [1.0, 30.0, 1e4, 1e16, 1e30, 1e300, MAX])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mu", [0.3, 0.71])
def test_exact_matches_a_decimal_bisection(inverse_temperature, seed, mu):
    # Clustered costs keep several logits moderate at every ε, so the solution is not
    # just the LP's there.
    rng = np.random.default_rng(10 + seed)
    cost = _clustered(rng, (2, 4, 7), inverse_temperature)
    result = _solve(cost, mu=mu, inverse_temperature=inverse_temperature)
    for b in range(2):
        rho, pi = _decimal_solution(cost[b], mu, inverse_temperature)
        np.testing.assert_allclose(result.rho[b], rho, rtol=0, atol=1e-15)
        np.testing.assert_allclose(result.pi[b], pi, rtol=0, atol=1e-15)


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_exact_is_the_lp_at_large_inverse_temperature(seed):
    rng = np.random.default_rng(seed)
    m, n, mu = 5, 9, 0.37  # 3.33 features: the LP keeps one of them fractionally
    cost = rng.uniform(0.0, 2.0, (2, m, n))
    lp = gsp.solve_p1_linprog(cost, mu=mu)
    # (P2) equals the LP to rounding where ε times every gap of the cost (between column
    # minima, and within each column) exceeds ~40: here from ε = 1e8 on.
    ordered = np.sort(cost.min(axis=1), axis=1)
    within = np.sort(cost, axis=1)
    gap = min(np.diff(ordered, axis=1).min(), (within[:, 1] - within[:, 0]).min())
    assert gap * 1e8 > 40.0
    for inverse_temperature in EPSILONS:
        result = _solve(cost, mu=mu, inverse_temperature=inverse_temperature)
        excess = np.sum(cost * result.pi, axis=(1, 2)) - lp.objective
        # 0 <= <c, pi_ε> - LP <= log(m + 1) / ε at every ε (docs/gsp.md Sec. 6)
        assert np.all(excess >= -1e-14)
        assert np.all(excess <= np.log(m + 1) / inverse_temperature + 1e-14)
        if inverse_temperature >= 1e8:
            np.testing.assert_allclose(result.pi, lp.pi, rtol=0, atol=1e-14)
            np.testing.assert_allclose(result.rho, lp.rho, rtol=0, atol=1e-14)


def test_integer_mass_plateau_at_huge_inverse_temperature():
    # mu n = 3 whole features: g has a plateau of width ~ε (cost gap) at mu; every point
    # of it gives the LP's plan to rounding, and the solver ends on one.
    cost = np.random.default_rng(6).uniform(0.0, 2.0, (2, 4, 10))
    lp = gsp.solve_p1_linprog(cost, mu=0.3)
    for inverse_temperature in (1e6, 1e20, 1e300, MAX):
        result = _solve(cost, mu=0.3, inverse_temperature=inverse_temperature)
        assert result.converged
        np.testing.assert_allclose(result.pi, lp.pi, rtol=0, atol=1e-14)


@pytest.mark.parametrize("inverse_temperature", [5.0, 1e30, MAX])
def test_exact_reports_and_warns_when_it_does_not_converge(inverse_temperature):
    cost = _clustered(np.random.default_rng(11), (2, 4, 9), inverse_temperature)
    # An unattainable tolerance: it stops at the rounding floor, and says so.
    with pytest.warns(ConvergenceWarning, match=r"stalled after \d+ steps at the rounding floor"):
        result = gsp.weight_transport(cost, mu=0.3, inverse_temperature=inverse_temperature, tol=1e-30)
    assert not result.converged and result.tol == 1e-30 and 0 < result.n_iter <= 40
    np.testing.assert_allclose(result.residual, np.maximum(
        np.max(np.abs(result.rho + result.pi.sum(axis=1) - 1.0 / 9), axis=1),
        np.abs(result.pi.sum(axis=(1, 2)) - 0.3)), rtol=0, atol=0)
    # One Newton step is not enough here: max_iter is named.
    with pytest.warns(ConvergenceWarning, match=r"reached max_iter == 1 with residual"):
        short = gsp.weight_transport(cost, mu=0.3, inverse_temperature=inverse_temperature, max_iter=1)
    assert not short.converged and np.all(short.residual <= 0.5)


def test_scale_of_the_cost_and_of_inverse_temperature_cancel():
    # (P2) depends on ε c only: (c / s, ε s) is the same problem (s a power of ten, so
    # the products differ by one rounding), up to ε s = float64's maximum.
    rng = np.random.default_rng(7)
    cost = _clustered(rng, (2, 4, 6), 1e10)
    base = _solve(cost, mu=0.4, inverse_temperature=1e10)
    d_rho, d_pi = rng.standard_normal((2, 6)), rng.standard_normal((2, 4, 6))
    base_grad = gsp.weight_transport_backward(base, d_rho, d_pi).cost
    for s in (1e-300, 1e-100, 1e100, 1e298):
        scaled = _solve(cost / s, mu=0.4, inverse_temperature=1e10 * s)
        np.testing.assert_allclose(scaled.pi, base.pi, rtol=1e-12, atol=1e-16)
        np.testing.assert_allclose(scaled.rho, base.rho, rtol=1e-12, atol=1e-16)
        grad = gsp.weight_transport_backward(scaled, d_rho, d_pi).cost
        np.testing.assert_allclose(grad / s, base_grad, rtol=1e-9, atol=1e-9 * np.abs(base_grad).max())


# ----------------------------------------------------------------------------- fixed point


@pytest.mark.parametrize("inverse_temperature", EPSILONS)
@pytest.mark.parametrize("kind", ["uniform", "clustered"])
def test_fixed_point_holds_the_mass_constraint_at_every_iterate(inverse_temperature, kind):
    rng = np.random.default_rng(8)
    cost = _costs(rng, kind, (3, 5, 9), inverse_temperature)
    for k in (1, 2, 7, 60):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = gsp.weight_transport(
                cost, mu=0.3, inverse_temperature=inverse_temperature, method="fixed_point",
                max_iter=k,
            )
        np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), 0.3, rtol=0, atol=TOL)
        assert np.all(result.rho >= 0.0) and np.all(result.rho <= 1.0 / 9)
        assert np.all(result.pi >= 0.0) and np.all(np.isfinite(result.pi))
        # The column residual is reported as it is, and warned about: never silent.
        column = np.max(np.abs(result.rho + result.pi.sum(axis=1) - 1.0 / 9), axis=1)
        np.testing.assert_allclose(result.residual, np.maximum(column, result.residual), rtol=0, atol=0)
        np.testing.assert_allclose(result.residual, column, rtol=0, atol=TOL)
        warned = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
        assert [w for w in caught if not issubclass(w.category, ConvergenceWarning)] == []
        assert bool(warned) == (not result.converged)
        assert result.converged == bool(np.all(result.residual <= 1e-12))


@pytest.mark.parametrize("inverse_temperature", [1.0, 30.0, 1e4, 1e16, 1e100, MAX])
@pytest.mark.parametrize("k", [1, 3, 12])
def test_fixed_point_matches_prop_4_2_in_decimals(inverse_temperature, k):
    rng = np.random.default_rng(9)
    cost = _clustered(rng, (2, 4, 7), inverse_temperature)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = gsp.weight_transport(
            cost, mu=0.35, inverse_temperature=inverse_temperature, method="fixed_point",
            max_iter=k, tol=0.0,
        )
    assert result.n_iter == k
    for b in range(2):
        rho, pi = _decimal_prop42(cost[b], 0.35, inverse_temperature, k)
        np.testing.assert_allclose(result.rho[b], rho, rtol=0, atol=1e-15)
        np.testing.assert_allclose(result.pi[b], pi, rtol=0, atol=1e-15)


def test_fixed_point_says_why_it_does_not_converge_at_large_inverse_temperature():
    cost = np.random.default_rng(10).uniform(0.0, 2.0, (2, 4, 9))
    with pytest.warns(ConvergenceWarning, match=r"reached max_iter == 100 .*inverse_temperature \* \(cost gap\)"):
        result = gsp.weight_transport(cost, mu=0.3, inverse_temperature=1e30, method="fixed_point")
    assert not result.converged and np.all(result.residual > 1e-3)
    np.testing.assert_allclose(result.pi.sum(axis=(1, 2)), 0.3, rtol=0, atol=TOL)


# ----------------------------------------------------------------------------- backward


def _wt(cost, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = gsp.weight_transport(cost, **kwargs)
    return (result.rho, result.pi), result


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1), m=st.integers(1, 4), n=st.integers(1, 6),
    mu=st.floats(0.05, 0.95), log10_inverse_temperature=st.floats(0.0, 300.0),
)
def test_closed_form_gradients_at_any_inverse_temperature_hypothesis(seed, m, n, mu, log10_inverse_temperature):
    # Clustered costs (half within 4 / ε of 0, smooth at this scale; the rest O(1) away,
    # saturated once ε is large) and a step of 1e-3 / ε (1e-4 at most): the differences
    # resolve ~1e-16 / step of the O(0.1) outputs, i.e. atol = 1e-12 ε, which matters only
    # where every feature is saturated and the whole gradient is ~ε exp(-ε gap).
    inverse_temperature = 10.0 ** log10_inverse_temperature
    cost = _clustered(np.random.default_rng(seed), (2, m, n), inverse_temperature)
    forward = functools.partial(_wt, mu=mu, inverse_temperature=inverse_temperature)
    result = check_gradients(
        forward, gsp.weight_transport_backward, {"cost": cost}, rng=seed,
        step=min(1e-4, 1e-3 / inverse_temperature),
    )
    assert_gradients(result, rtol=1e-5, atol=1e-12 * inverse_temperature)


@pytest.mark.parametrize("inverse_temperature", [1e16, 1e100, 1e300])
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_gradients_where_huge_and_moderate_gaps_mix(inverse_temperature, seed):
    # Half the costs within 4 / ε of 0 (smooth at this scale), the rest O(1) away
    # (saturated: weight exactly 0, gradient ~ε exp(-ε gap) = 0). A step of 1e-3 / ε
    # moves the small costs and leaves the large ones bitwise unchanged. Where the
    # printed form rounds (~ε 1e-16 absolute), this would fail by ~1e284 at ε = 1e300.
    rng = np.random.default_rng(20 + seed)
    cost = _clustered(rng, (2, 3, 5), inverse_temperature)
    forward = functools.partial(_wt, mu=0.45, inverse_temperature=inverse_temperature)
    result = check_gradients(
        forward, gsp.weight_transport_backward, {"cost": cost}, rng=seed,
        step=1e-3 / inverse_temperature,
    )
    assert_gradients(result, rtol=1e-5)


@pytest.mark.parametrize("inverse_temperature", [1e8, 1e16, 1e100, MAX])
@pytest.mark.parametrize("seed", [0, 1])
def test_closed_form_gradients_vanish_away_from_ties_at_huge_inverse_temperature(inverse_temperature, seed):
    # Continuous random costs: (rho, pi) are the LP's and constant under the step (the map
    # is piecewise constant at this ε: no gap is crossed by the step, each is > 40 / ε),
    # and the gradient is ~ε exp(-ε gap), 0 in float64. Central differences of outputs
    # ~0.1 at a step of 1e-5 resolve ~1e-11: atol 1e-10 is that resolution.
    cost = np.random.default_rng(30 + seed).uniform(0.0, 2.0, (2, 4, 7))
    ordered, within = np.sort(cost.min(axis=1), axis=1), np.sort(cost, axis=1)
    gap = min(np.diff(ordered, axis=1).min(), (within[:, 1] - within[:, 0]).min())
    assert gap > 1e-3 and inverse_temperature * gap > 1e3
    forward = functools.partial(_wt, mu=0.3, inverse_temperature=inverse_temperature)
    assert_gradients(
        check_gradients(forward, gsp.weight_transport_backward, {"cost": cost}, rng=seed),
        rtol=1e-6, atol=1e-10,
    )
    rng = np.random.default_rng(seed)
    result = _solve(cost, mu=0.3, inverse_temperature=inverse_temperature)
    grad = gsp.weight_transport_backward(result, rng.standard_normal((2, 7)), rng.standard_normal((2, 4, 7))).cost
    assert np.all(np.abs(grad) <= 1e-30)


def _value_forward(cost, **kwargs):
    (_, pi), result = _wt(cost, **kwargs)
    return np.sum(cost * pi, axis=(1, 2)), (cost, result)


def _value_backward(ctx, d_value):
    # d/dc <c, pi(c)> = pi + J^T c: the explicit dependence plus pi's, by Prop. 4.3.
    cost, result = ctx
    through_pi = gsp.weight_transport_backward(result, None, cost * d_value[:, None, None]).cost
    return {"cost": result.pi * d_value[:, None, None] + through_pi}


@pytest.mark.parametrize("inverse_temperature", [3.0, 30.0, 1e4, 1e16, 1e300, MAX])
def test_value_gradient_tends_to_the_lp_plan(inverse_temperature):
    # V(c) = <c, pi(c)> is smooth at moderate ε and piecewise linear in the LP limit, where
    # its gradient is the LP plan (Danskin): checked by central differences at every ε.
    rng = np.random.default_rng(40)
    cost = rng.uniform(0.0, 2.0, (2, 4, 7))
    forward = functools.partial(_value_forward, mu=0.3, inverse_temperature=inverse_temperature)
    assert_gradients(check_gradients(forward, _value_backward, {"cost": cost}, rng=1), rtol=1e-6)
    if inverse_temperature >= 1e4:
        ctx = forward(cost)[1]
        np.testing.assert_allclose(
            _value_backward(ctx, np.ones(2))["cost"], gsp.solve_p1_linprog(cost, mu=0.3).pi,
            rtol=0, atol=1e-14,
        )


@pytest.mark.parametrize("inverse_temperature", [1e16, 1e300])
@pytest.mark.parametrize("k", [1, 4])
def test_unrolled_gradients_where_huge_and_moderate_gaps_mix(inverse_temperature, k):
    rng = np.random.default_rng(50 + k)
    cost = _clustered(rng, (2, 3, 5), inverse_temperature)
    forward = functools.partial(
        _wt, mu=0.45, inverse_temperature=inverse_temperature, method="fixed_point",
        max_iter=k, tol=0.0,
    )
    result = check_gradients(
        forward, gsp.weight_transport_backward_unrolled, {"cost": cost}, rng=k,
        step=1e-3 / inverse_temperature,
    )
    assert_gradients(result, rtol=1e-5)


def test_backward_refuses_a_gradient_that_overflows():
    # An exact tie in a column at ε = float64's maximum: d pi / d c ~ ε / 4 is a kink of
    # the LP; times an upstream gradient of 1e3 it is beyond float64.
    cost = np.array([[[0.5, 1.0], [0.5, 2.0]]])
    result = _solve(cost, mu=0.5, inverse_temperature=MAX)
    d_pi = np.array([[[1e3, 0.0], [-1e3, 0.0]]])
    with pytest.raises(ValueError, match=r"d_cost overflows float64: inverse_temperature == 1\.79"):
        gsp.weight_transport_backward(result, None, d_pi)
    # Away from that tie the same result differentiates to 0.
    assert np.all(gsp.weight_transport_backward(result, np.ones((1, 2)), None).cost == 0.0)


# ----------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("inverse_temperature", [1e16, 1e300, MAX])
def test_pooling_layer_at_huge_inverse_temperature(inverse_temperature):
    rng = np.random.default_rng(60)
    features, prototypes = rng.standard_normal((2, 7, 3)), rng.standard_normal((4, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (pooled, z), ctx = gsp.gsp_pool_forward(
            features, prototypes, mu=0.3, inverse_temperature=inverse_temperature
        )
        grads = gsp.gsp_pool_backward(ctx, rng.standard_normal(pooled.shape), rng.standard_normal(z.shape))
    _assert_feasible(ctx.transport, TOL)
    # The LP's weights: the mu n = 2.1 cheapest features, 1/n each, the third one 0.1/n.
    lp = gsp.solve_p1_linprog(ctx.cost.cost, mu=0.3)
    weights = (1.0 / 7 - lp.rho) / 0.3
    np.testing.assert_allclose(pooled, np.einsum("bn,bnd->bd", weights, features), rtol=0, atol=1e-13)
    # Only the direct path (pooled = sum_j w_j f_j) carries a gradient to the features.
    assert np.all(np.isfinite(grads.features)) and np.all(grads.prototypes == 0.0)
