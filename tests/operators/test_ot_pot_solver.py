"""``solver="pot"`` of the Sinkhorn divergence (POT's log-domain Sinkhorn) against refdml's own
solver, at ordinary eps and at POT's weak points, and its backward by finite differences.

How close the two must be is derived from what each solve reports: ``R``, the L1 marginal
errors of the three problems of Eq. (4) weighted as they enter it (1, 1/2, 1/2), summed
over both solvers, plus ``ROUNDING`` for the solves' own rounding. With ``D`` the largest
distance, ``C = D^p`` the largest cost and ``w`` the smallest normalised weight:

* value: ``|dSD| <= C R``. For the regularised value this is a bound: the dual is concave,
  its gradient at the returned potentials is the marginal error, and the potentials (and
  the optimal ones) vary by at most ``C`` over the points, so each term is within ``C r``
  of its optimum. The transport cost is first order in the plan's error; measured at most
  0.13 of the same bound.
* gradients w.r.t. the points: ``|up| p D^(p-1) R max(1, C / eps) / w``: a marginal error
  ``r`` on a row of weight ``w`` moves its potential by up to ``eps r / w`` and the plan by
  up to ``r / w`` of itself; the transport cost's implicit gradient carries a factor
  ``C / eps`` more. Measured at most 0.1 of it.
* gradients w.r.t. the weights (times the weights' sum): ``|up| max(eps, C) R / w``: the
  potentials' error itself (``eps`` above the cost: the potentials' spread is ``C`` but
  their error scales with ``eps``). Measured at most 0.5 of it where the solves converge,
  and 0.05 for the regularised value at small eps where POT's do not; 5 for the transport
  cost there (its implicit gradient on a nearly decoupled plan that misses its marginals),
  which the drawn small-eps test therefore leaves out.

The measured fractions: ``python scripts/bench_ot_solvers.py --accuracy`` (100 drawn
problems per convention at eps from 1/4 to 4 times the largest cost, and 100 from 0.003 to
0.1; docs/ot.md, "Which solver", has the table).
"""

import functools
import re
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from refdml import ConvergenceWarning
from refdml import ot as rot
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst
from refdml.ot._divergence import SOLVERS
from refdml.ot._sinkhorn import _eps_schedule

TIGHT = dict(tol=1e-12, max_iter=20000)
# The solves' own rounding, in units of the marginal error: a few hundred ulps of sums of
# weights that add up to 1.
ROUNDING = 1e-13
VALUES = ("regularized", "transport_cost")


def _grid(rng, n_points):
    """2-d points of a grid of spacing 0.4, jittered by at most 0.1: no two closer than 0.2
    (away from the kink of ||x - y||^p at p = 1; the catalogue's maker)."""
    side = int(np.ceil(np.sqrt(n_points)))
    cells = np.stack(np.meshgrid(np.arange(side), np.arange(side)), -1).reshape(-1, 2)
    chosen = cells[rng.permutation(cells.shape[0])[:n_points]]
    return 0.4 * (chosen - (side - 1) / 2.0) + rng.uniform(-0.1, 0.1, (n_points, 2))


def _grid_problem(seed):
    rng = np.random.default_rng(seed)
    points = _grid(rng, 9)
    return points[:5], points[5:], rng.uniform(0.5, 1.5, 5), rng.uniform(0.5, 1.5, 4)


def _largest_distance(x, y):
    points = np.concatenate([x, y])
    return max(float(np.max(np.linalg.norm(points[:, None] - points[None], axis=-1))), 1e-300)


def _smallest_distance(x, y):
    """The smallest distance between two of the points (of either cloud). At p = 1 the
    drawn clouds keep it above 0.01: points an ulp apart sit on the kink of ||x - y||, where
    the gradient's direction is that of the rounding (the kink tests below take exact
    coincidence instead, where the backward takes the subgradient 0)."""
    points = np.concatenate([x, y])
    gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)
    return float(np.min(gaps[~np.eye(len(points), dtype=bool)], initial=np.inf))


def _both(x, y, a=None, b=None, **kwargs):
    return {solver: rot.sinkhorn_divergence_forward(x, y, a, b, solver=solver, **kwargs)
            for solver in SOLVERS}


def _weighted_residual(ctx) -> float:
    return float(ctx.xy.marginal_error[0]
                 + 0.5 * (ctx.xx.marginal_error[0] + ctx.yy.marginal_error[0]))


def _converged(ctx) -> list[bool]:
    return [bool(term.converged[0]) for term in (ctx.xy, ctx.xx, ctx.yy)]


def _iterations(ctx) -> list[int]:
    return [int(term.n_iter[0]) for term in (ctx.xy, ctx.xx, ctx.yy)]


def _assert_solvers_agree(x, y, a, b, runs, *, eps, p, upstream):
    """Values and gradients of both solvers within the tolerances of the module docstring."""
    (sd_ref, ctx_ref), (sd_pot, ctx_pot) = runs["refdml"], runs["pot"]
    assert ctx_ref.solver == "refdml" and ctx_pot.solver == "pot"
    distance = _largest_distance(x, y)
    largest_cost = distance ** p
    residual = _weighted_residual(ctx_ref) + _weighted_residual(ctx_pot) + ROUNDING
    assert abs(sd_pot - sd_ref) <= largest_cost * residual, (sd_pot, sd_ref, residual)

    n, m = len(x), len(y)
    a = np.full(n, 1.0) if a is None else np.asarray(a, dtype=float)
    b = np.full(m, 1.0) if b is None else np.asarray(b, dtype=float)
    smallest = min(float((a / a.sum()).min()), float((b / b.sum()).min()))
    grads_ref = rot.sinkhorn_divergence_backward(ctx_ref, upstream)
    grads_pot = rot.sinkhorn_divergence_backward(ctx_pot, upstream)
    points_tol = (abs(upstream) * p * distance ** (p - 1) * residual
                  * max(1.0, largest_cost / eps) / smallest)
    for name in ("x", "y"):
        np.testing.assert_allclose(getattr(grads_pot, name), getattr(grads_ref, name), rtol=0,
                                   atol=points_tol, err_msg=name)
    if ctx_ref.weights_given:
        weights_tol = abs(upstream) * max(eps, largest_cost) * residual / smallest
        for name, weights in (("a", a), ("b", b)):
            np.testing.assert_allclose(getattr(grads_pot, name), getattr(grads_ref, name),
                                       rtol=0, atol=weights_tol / weights.sum(), err_msg=name)


# --------------------------------------------------------------------------- ordinary eps


@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_pot_matches_refdml_at_ordinary_eps(seed, p, value):
    x, y, a, b = _grid_problem(seed)
    eps = 0.5 * _largest_distance(x, y) ** p
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no ConvergenceWarning, no RuntimeWarning, no POT's
        runs = _both(x, y, a, b, eps=eps, p=p, value=value, **TIGHT)
    for solver, (_, ctx) in runs.items():
        assert all(_converged(ctx)), (solver, _iterations(ctx))
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=p, upstream=-1.7)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), n=st.integers(1, 5), m=st.integers(1, 5), p=st.sampled_from([1.0, 2.0]),
       value=st.sampled_from(VALUES), log_ratio=st.floats(np.log(0.25), np.log(4.0)),
       upstream=st.floats(0.1, 3.0))
def test_pot_matches_refdml_on_drawn_clouds(data, n, m, p, value, log_ratio, upstream):
    # eps from 1/4 to 4 times the largest cost: every kernel entry is at least e^-4, the
    # alternating iteration contracts by tanh(1)^2 or better per step, and both solvers
    # converge to tol = 1e-12 (at most 261 iterations of POT's measured).
    x = data.draw(rst.points_in_unit_ball(n, 2), label="x")
    y = data.draw(rst.points_in_unit_ball(m, 2), label="y")
    a = data.draw(rst.simplex_vectors(n), label="a")
    b = data.draw(rst.simplex_vectors(m), label="b")
    assume(_largest_distance(x, y) > 0.05)    # eps is relative to the largest cost
    assume(p == 2.0 or _smallest_distance(x, y) > 0.01)
    eps = float(np.exp(log_ratio)) * _largest_distance(x, y) ** p
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        runs = _both(x, y, a, b, eps=eps, p=p, value=value, **TIGHT)
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=p, upstream=upstream)


@pytest.mark.parametrize("p", [1.0, 2.0])
def test_pot_matches_refdml_at_large_eps(p):
    # eps = 1e6 times the largest cost: POT stops after one iteration (the plan is a b^T to
    # 1e-6) and its potentials, eps (log_u - log a), hold eps ulp of cancellation: its weight
    # gradients are ~1e-7 off (docs/ot.md); the tolerance's max(eps, C) says so.
    x, y, a, b = _grid_problem(3)
    eps = 1e6 * _largest_distance(x, y) ** p
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = _both(x, y, a, b, eps=eps, p=p, **TIGHT)
    assert _iterations(runs["pot"][1]) == [1, 1, 1]
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=p, upstream=0.9)


# ------------------------------------------------------------------- POT's weak points


@pytest.mark.parametrize("p, seed, eps", [
    # eps = d^p / 6 with d = 0.2 the smallest gap of the grid: nearest neighbours couple by
    # e^-6 ~ 2e-3, far above tol, and the self plans nearly decouple into single points.
    # p = 1 reaches this at eps ~ 0.03 of the largest cost, p = 2 only at ~0.005: at p = 1
    # the small distances are a larger fraction of the largest cost.
    (1.0, 1, 0.2 / 6),
    (2.0, 5, 0.2 ** 2 / 6),
])
@pytest.mark.parametrize("value", VALUES)
def test_pot_self_terms_stall_where_the_self_plan_nearly_decouples(p, seed, eps, value):
    x, y, a, b = _grid_problem(seed)
    max_iter = 2000
    with pytest.warns(ConvergenceWarning, match=f"stopped at max_iter={max_iter} iterations"):
        runs = _both(x, y, a, b, eps=eps, p=p, value=value, tol=1e-12, max_iter=max_iter)
    ctx_ref, ctx_pot = runs["refdml"][1], runs["pot"][1]
    # refdml's averaged update converges the self terms in a few iterations; POT's
    # alternating one stops at max_iter there, and says so (residual, converged, warning).
    assert all(_converged(ctx_ref)) and max(_iterations(ctx_ref)[1:]) <= 10
    assert _converged(ctx_pot) == [True, False, False]
    assert _iterations(ctx_pot)[1:] == [max_iter, max_iter]
    for term in (ctx_pot.xx, ctx_pot.yy):
        assert term.marginal_error[0] > 1e-12
    # The cross problems are no harder for POT: the same alternating iteration.
    assert abs(_iterations(ctx_pot)[0] - _iterations(ctx_ref)[0]) <= 10
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=p, upstream=1.3)


@settings(max_examples=20, deadline=None)
@given(data=st.data(), n=st.integers(2, 5), m=st.integers(2, 5), p=st.sampled_from([1.0, 2.0]),
       log_ratio=st.floats(np.log(0.003), np.log(0.1)))
def test_pot_at_small_eps_agrees_within_what_it_reports(data, n, m, p, log_ratio):
    # Where the solvers do not converge in max_iter, the tolerance grows with the marginal
    # errors they report; and what they report is consistent: converged iff the error is
    # at most tol, and a ConvergenceWarning iff some problem is not. The regularised value
    # only: where a plan nearly decouples, the marginal error bounds neither the potentials
    # nor the transport cost's implicit gradient (a cross plan 1e-3 off its marginals gave
    # weight gradients 0.03 apart, 30 times this tolerance), so the transport cost is held
    # at the fixed weak points above.
    value = "regularized"
    x = data.draw(rst.points_in_unit_ball(n, 2), label="x")
    y = data.draw(rst.points_in_unit_ball(m, 2), label="y")
    a = data.draw(rst.simplex_vectors(n), label="a")
    b = data.draw(rst.simplex_vectors(m), label="b")
    assume(_largest_distance(x, y) > 0.05)    # eps is relative to the largest cost
    assume(p == 2.0 or _smallest_distance(x, y) > 0.01)
    eps = float(np.exp(log_ratio)) * _largest_distance(x, y) ** p
    tol = 1e-12
    runs = {}
    for solver in SOLVERS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs[solver] = rot.sinkhorn_divergence_forward(
                x, y, a, b, eps=eps, p=p, value=value, tol=tol, max_iter=300, solver=solver)
        ctx = runs[solver][1]
        for term in (ctx.xy, ctx.xx, ctx.yy):
            assert bool(term.converged[0]) == (term.marginal_error[0] <= tol)
        # Nothing but refdml's own warning, and it exactly when a problem did not converge.
        assert all(w.category is ConvergenceWarning for w in caught), [
            str(w.message) for w in caught]
        assert bool(caught) == (not all(_converged(ctx)))
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=p, upstream=-0.6)


def test_pot_at_tiny_eps_with_p1_and_eps_scaling():
    # eps = 1e-3 of the largest cost at p = 1: exp(-C / eps) underflows for every pair but a
    # point and itself, POT's log-domain iteration is unaffected (its plan underflows to 0
    # where it should; its exp(log_u) would overflow, which refdml does not use: no
    # RuntimeWarning), its self plans are diagonal to the last bit and converge in one
    # iteration; eps_scaling takes both solvers' cross problem down in stages.
    x, y, a, b = _grid_problem(2)
    eps = 1e-3 * _largest_distance(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = _both(x, y, a, b, eps=eps, p=1.0, tol=1e-12, max_iter=5000, eps_scaling=0.5)
    for _, ctx in runs.values():
        assert all(_converged(ctx))
    # One call of POT per stage, each converged after 10 k + 1 iterations: the count is the
    # number of stages modulo 10.
    cross = runs["pot"][1].xy
    stages = len(_eps_schedule(cross.cost, cross.eps, 0.5))
    assert stages > 10
    assert int(cross.n_iter[0]) % 10 == stages % 10
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=1.0, upstream=2.1)


@pytest.mark.parametrize("value", VALUES)
def test_pot_at_the_kinks_of_p1(value):
    # Coincident points within and across the clouds: zero costs off the diagonal, where
    # ||x - y|| has a kink and the backward takes the subgradient 0 (the same backward for
    # both solvers, on the plans each one found).
    x, y, a, b = _grid_problem(4)
    x[3] = x[0]
    y[1] = x[2]
    eps = 0.3 * _largest_distance(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = _both(x, y, a, b, eps=eps, p=1.0, value=value, **TIGHT)
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=1.0, upstream=-0.8)


def test_pot_symmetrises_the_self_terms():
    # POT's alternating iteration leaves f != g on OT(mu, mu); the result is the pair
    # ((f + g) / 2, (f + g) / 2), whose plan is symmetric to the last bit. Without it the
    # transport cost's weight gradient was ~1e19 on this decoupled self plan (two points
    # 0.86 apart at eps 0.0085: the Schur complement of the implicit gradient is ~1e-38).
    x = np.array([[-0.02089486, 0.05044704], [0.83479263, 0.03853831]])
    y = np.array([[-0.0165654, 0.33357661], [-0.2024851, 0.19735023]])
    a, b = np.array([0.5384871, 0.05098077]), np.array([0.84304936, 0.3871295])
    eps = 0.0085
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs = _both(x, y, a, b, eps=eps, p=2.0, value="transport_cost", **TIGHT)
    # The self plan of x decouples: its off-diagonal entries are ~1e-38.
    assert runs["refdml"][1].xx.plan[0, 0, 1] < 1e-30
    # Exact by construction: g is a copy of f, and the plan is formed from h_i + h_j and
    # the self cost, which refdml.ot._divergence symmetrises as (S + S^T) / 2 (a sum of two
    # floats does not depend on their order).
    for term in (runs["pot"][1].xx, runs["pot"][1].yy):
        np.testing.assert_array_equal(term.f, term.g)
        np.testing.assert_array_equal(term.plan[0], term.plan[0].T)
    _assert_solvers_agree(x, y, a, b, runs, eps=eps, p=2.0, upstream=1.0)


# ------------------------------------------------------------------ finite differences


@pytest.mark.parametrize("p, value", [(2.0, "regularized"), (2.0, "transport_cost"),
                                      (1.0, "regularized"), (1.0, "transport_cost")])
@pytest.mark.parametrize("seed", [0, 1])
def test_backward_of_a_pot_context_matches_central_differences(p, value, seed):
    # The harness contracts the outputs with a standard normal upstream gradient (never 1)
    # and differentiates x, y, a and b by central differences of the forward with POT's
    # solver. Points on the grid: no two closer than 0.2, away from the kink at p = 1.
    x, y, a, b = _grid_problem(seed)
    eps = 0.5 * _largest_distance(x, y) ** p
    forward = functools.partial(rot.sinkhorn_divergence_forward, eps=eps, p=p, value=value,
                                solver="pot", **TIGHT)
    result = check_gradients(forward, rot.sinkhorn_divergence_backward,
                             {"x": x, "y": y, "a": a, "b": b}, rng=seed)
    assert_gradients(result, rtol=1e-6)


# ----------------------------------------------------------- what the solver reports


def test_pot_counts_its_iterations_as_pot_checks_them():
    # POT checks its marginal every 10th iteration (0, 10, 20, ...) and stops right after
    # a check: a converged solve has run 10 k + 1 iterations.
    x, y, a, b = _grid_problem(0)
    _, ctx = rot.sinkhorn_divergence_forward(x, y, a, b, eps=0.3, p=2.0, solver="pot", **TIGHT)
    assert all(_converged(ctx))
    assert all(count % 10 == 1 for count in _iterations(ctx)), _iterations(ctx)


def test_tol_zero_runs_max_iter_iterations_without_warning():
    x, y, a, b = _grid_problem(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # neither refdml's warning nor POT's own
        _, ctx = rot.sinkhorn_divergence_forward(x, y, a, b, eps=0.3, p=2.0, tol=0.0,
                                                 max_iter=7, solver="pot")
    assert _iterations(ctx) == [7, 7, 7]
    assert _converged(ctx) == [False, False, False]


def test_non_convergence_is_refdmls_warning_not_pots():
    x, y, a, b = _grid_problem(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, ctx = rot.sinkhorn_divergence_forward(x, y, a, b, eps=0.05, p=2.0, tol=1e-12,
                                                 max_iter=3, solver="pot")
    assert [w.category for w in caught] == [ConvergenceWarning] * 3, [str(w.message) for w in caught]
    assert all("stopped at max_iter=3 iterations above tol=1e-12" in str(w.message)
               for w in caught)
    assert _iterations(ctx) == [3, 3, 3]
    assert not any(_converged(ctx))


def test_one_call_is_forward_then_backward_of_one():
    x, y, a, b = _grid_problem(1)
    sd, grads = rot.sinkhorn_divergence(x, y, a, b, eps=0.4, p=1.0, solver="pot", **TIGHT)
    sd_ctx, ctx = rot.sinkhorn_divergence_forward(x, y, a, b, eps=0.4, p=1.0, solver="pot",
                                                  **TIGHT)
    assert ctx.solver == "pot"
    expected = rot.sinkhorn_divergence_backward(ctx, 1.0)
    assert sd == sd_ctx
    for name in ("x", "y", "a", "b"):
        np.testing.assert_array_equal(getattr(grads, name), getattr(expected, name))


# --------------------------------------------------- refusals and scale: the data's, not a solver's


@pytest.mark.parametrize("solver, error, match", [
    ("sinkhorn_log", ValueError, r"^solver == 'sinkhorn_log', must be one of \('refdml', 'pot'\)$"),
    ("POT", ValueError, r"^solver == 'POT', must be one of \('refdml', 'pot'\)$"),
    (None, TypeError, r"^solver must be one of \('refdml', 'pot'\), got None"),
])
def test_a_bad_solver_is_refused_by_name(solver, error, match):
    x, y, _, _ = _grid_problem(0)
    with pytest.raises(error, match=match):
        rot.sinkhorn_divergence_forward(x, y, eps=0.5, solver=solver)
    with pytest.raises(error, match=match):
        rot.sinkhorn_divergence(x, y, eps=0.5, solver=solver)


def test_solver_is_keyword_only():
    x, y, _, _ = _grid_problem(0)
    with pytest.raises(TypeError):
        rot.sinkhorn_divergence_forward(x, y, None, None, 0.5, 2, "regularized", 1000, 1e-9,
                                        None, "pot")


def _refusal(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def _unit_cloud():
    x, y, _, _ = _grid_problem(5)
    return x / _largest_distance(x, y), y / _largest_distance(x, y)


@pytest.mark.parametrize("case", [
    "eps too small for the data", "eps too large for the data", "data beyond float64",
    "data below float64", "p beyond the data's range", "p below 1", "NaN in x",
])
def test_refusals_are_the_same_for_both_solvers(case):
    x, y = _unit_cloud()     # largest distance 1 (to rounding)
    kwargs = {
        "eps too small for the data": dict(x=x, y=y, eps=1e-20, p=2),
        "eps too large for the data": dict(x=x, y=y, eps=1e20, p=2),
        "data beyond float64": dict(x=1e200 * x, y=1e200 * y, eps=1.0, p=2),
        "data below float64": dict(x=1e-200 * x, y=1e-200 * y, eps=1.0, p=2),
        "p beyond the data's range": dict(x=3 * x, y=3 * y, eps=0.1, p=1e38),
        "p below 1": dict(x=x, y=y, eps=0.1, p=0.5),
        "NaN in x": dict(x=np.where(np.arange(x.size).reshape(x.shape) == 3, np.nan, x), y=y,
                         eps=0.1, p=2),
    }[case]
    refusals = {solver: _refusal(lambda: rot.sinkhorn_divergence_forward(**kwargs,
                                                                         solver=solver))
                for solver in SOLVERS}
    assert refusals["pot"] == refusals["refdml"]


@pytest.mark.parametrize("scale", [1e-100, 1e100])
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_pot_divergence_is_p_homogeneous_with_eps_in_cost_units(scale, p):
    # The clouds are divided by a power of two before either solver sees them: POT solves
    # the same scaled problem at 1e-100 and 1e100 as at 1 (tolerances of the own solver's
    # test in test_ot.py: the scaled inputs round differently).
    x, y, a, b = _grid_problem(6)
    sd, grads = rot.sinkhorn_divergence(x, y, a, b, eps=0.5, p=p, solver="pot", **TIGHT)
    sd_s, grads_s = rot.sinkhorn_divergence(scale * x, scale * y, a, b, eps=0.5 * scale ** p,
                                            p=p, solver="pot", **TIGHT)
    np.testing.assert_allclose(sd_s, scale ** p * sd, rtol=1e-10)
    np.testing.assert_allclose(grads_s.x, scale ** (p - 1) * grads.x, rtol=1e-8,
                               atol=1e-10 * scale ** (p - 1) * np.abs(grads.x).max())
    np.testing.assert_allclose(grads_s.a, scale ** p * grads.a, rtol=1e-8,
                               atol=1e-10 * scale ** p * np.abs(grads.a).max())


def test_the_refusal_message_names_the_allowed_solvers_as_the_code_lists_them():
    # The message is built from SOLVERS: a new solver shows up in it.
    with pytest.raises(ValueError, match=re.escape(repr(SOLVERS))):
        rot.sinkhorn_divergence_forward(np.zeros((1, 1)), np.ones((1, 1)), eps=1.0,
                                        solver="other")
