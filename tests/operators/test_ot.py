"""Entropic OT, Sinkhorn divergences and Wasserstein losses against POT, LP limits and
finite differences."""

import functools
import re
import warnings

import mpmath as mp
import numpy as np
import ot as pot
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml import ConvergenceWarning
from refdml import ot as rot
from refdml.catalog import get as catalogue_entry
from refdml.ot._divergence import _ground_cost, _self_sq_dist
from refdml.ot._sinkhorn import _solve_batch
from refdml.gradcheck import strategies as rst

TIGHT = dict(tol=1e-12, max_iter=20000)


def _problem(seed, n=6, m=5, d=3):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((n, d)), rng.standard_normal((m, d))
    a = rng.uniform(0.5, 1.5, n)
    b = rng.uniform(0.5, 1.5, m)
    return x, y, a / a.sum(), b / b.sum(), pot.dist(x, y)


def _pot_plan(a, b, cost, eps):
    plan, log = pot.sinkhorn(a, b, cost, eps, method="sinkhorn_log", stopThr=1e-14,
                             numItermax=50000, log=True)
    return plan, log


def _kl_value(plan, a, b, cost, eps):
    """<pi, C> + eps KL(pi | a x b), evaluated directly on a plan."""
    return float(np.sum(plan * cost) + eps * np.sum(plan * np.log(plan / np.outer(a, b))))


# ---------------------------------------------------------------------------- sinkhorn


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sinkhorn_matches_pot_plan_cost_and_potentials(seed):
    _, _, a, b, cost = _problem(seed)
    eps = 0.3 * cost.mean()
    res = rot.sinkhorn(a, b, cost, eps=eps, **TIGHT)
    plan, log = _pot_plan(a, b, cost, eps)
    assert res.converged
    np.testing.assert_allclose(res.plan, plan, rtol=0, atol=1e-12)
    transport = pot.sinkhorn2(a, b, cost, eps, method="sinkhorn_log", stopThr=1e-15,
                              numItermax=200000)
    np.testing.assert_allclose(res.transport_cost, transport, rtol=1e-11)
    # POT: pi = exp(log_u + log_v - C/eps), ours: pi = a b exp((f + g - C)/eps).
    f_shift = res.f - eps * (log["log_u"] - np.log(a))
    g_shift = res.g - eps * (log["log_v"] - np.log(b))
    np.testing.assert_allclose(f_shift - f_shift.mean(), 0.0, atol=1e-10 * np.abs(res.f).max())
    np.testing.assert_allclose(g_shift - g_shift.mean(), 0.0, atol=1e-10 * np.abs(res.g).max())
    np.testing.assert_allclose(f_shift.mean() + g_shift.mean(), 0.0, atol=1e-10)
    # Value of Eq. (3) on POT's plan (a different algorithm and a primal formula).
    np.testing.assert_allclose(res.value, _kl_value(plan, a, b, cost, eps), rtol=1e-11)


def test_value_differs_from_pot_entropy_convention_by_the_marginal_entropies():
    # POT penalises reg * sum pi (log pi - 1); KL(pi | a x b) differs by a constant on Pi(a, b).
    _, _, a, b, cost = _problem(3)
    eps = 0.5
    res = rot.sinkhorn(a, b, cost, eps=eps, **TIGHT)
    plan, _ = _pot_plan(a, b, cost, eps)
    pot_objective = np.sum(plan * cost) + eps * np.sum(plan * (np.log(plan) - 1.0))
    constant = eps * (-1.0 + a @ np.log(a) + b @ np.log(b))
    np.testing.assert_allclose(res.value, pot_objective - constant, rtol=1e-11)


@pytest.mark.parametrize("relative_eps", [1e-2, 1e-3])
def test_small_eps_is_finite_and_brackets_the_exact_ot(relative_eps):
    _, _, a, b, cost = _problem(4, n=8, m=7)
    eps = relative_eps * cost.max()
    exact = pot.emd2(a, b, cost)
    for scaling in (None, 0.5):
        res = rot.sinkhorn(a, b, cost, eps=eps, tol=1e-10, max_iter=100000, eps_scaling=scaling)
        assert res.converged and np.all(np.isfinite(res.plan))
        # W <= <pi, C> <= OT_eps <= W + eps * KL(pi* | a x b) <= W + eps log min(n, m).
        # A plan off its marginals by tol can undercut W by tol * max(C).
        assert exact - 1e-10 * cost.max() <= res.transport_cost <= res.value + 1e-12
        assert res.value <= exact + eps * np.log(7) + 1e-12
    np.testing.assert_allclose(res.transport_cost, exact, rtol=0, atol=eps * np.log(7))


def test_eps_scaling_reaches_the_same_solution_in_fewer_iterations():
    _, _, a, b, cost = _problem(5, n=10, m=9)
    eps = 2e-3 * cost.max()
    plain = rot.sinkhorn(a, b, cost, eps=eps, tol=1e-10, max_iter=100000)
    scaled = rot.sinkhorn(a, b, cost, eps=eps, tol=1e-10, max_iter=100000, eps_scaling=0.5)
    np.testing.assert_allclose(scaled.plan, plain.plan, atol=1e-9)
    np.testing.assert_allclose(scaled.value, plain.value, rtol=1e-9)
    assert scaled.n_iter < plain.n_iter


def test_batched_equals_one_problem_at_a_time():
    rng = np.random.default_rng(6)
    cost = rng.uniform(0, 2, (2, 3, 5, 4))
    a = rng.uniform(0.2, 1, (3, 5))            # broadcasts over the first batch axis
    b = rng.uniform(0.2, 1, 4)
    res = rot.sinkhorn(a, b, cost, eps=0.2, **TIGHT)
    assert res.plan.shape == (2, 3, 5, 4) and res.value.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            single = rot.sinkhorn(a[j], b, cost[i, j], eps=0.2, **TIGHT)
            np.testing.assert_allclose(res.plan[i, j], single.plan, atol=1e-14)
            np.testing.assert_allclose(res.value[i, j], single.value, rtol=1e-13)
            # Exactly equal by construction: every step works per problem (row sums by
            # einsum, per-row reductions, elementwise maps; no BLAS, nothing mixes problems
            # without eps-scaling), so a problem's residuals have the same bits in a batch.
            assert res.n_iter[i, j] == single.n_iter


def test_weights_are_normalised():
    _, _, a, b, cost = _problem(7)
    ref = rot.sinkhorn(a, b, cost, eps=0.4, **TIGHT)
    scaled = rot.sinkhorn(3 * a, 0.5 * b, cost, eps=0.4, **TIGHT)
    np.testing.assert_allclose(scaled.plan, ref.plan, atol=1e-15)


def test_non_convergence_warns_and_reports():
    _, _, a, b, cost = _problem(8)
    with pytest.warns(ConvergenceWarning, match="stopped at max_iter=3 iterations above tol"):
        res = rot.sinkhorn(a, b, cost, eps=1e-3, max_iter=3, tol=1e-12)
    assert not res.converged and res.n_iter == 3 and res.residual == res.marginal_error
    assert res.marginal_error > 1e-12 and np.isfinite(res.value)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(eps=0.0), ValueError, "eps == 0.0"),
        (dict(eps=-1.0), ValueError, "eps == -1.0"),
        (dict(eps=0.1, tol=-1.0), ValueError, "tol == -1.0"),
        (dict(eps=0.1, max_iter=0), ValueError, "max_iter == 0"),
        (dict(eps=0.1, eps_scaling=1.0), ValueError, "eps_scaling == 1.0"),
        (dict(eps="big"), TypeError, "eps must be a real number"),
    ],
)
def test_solver_arguments_are_validated(kwargs, error, match):
    _, _, a, b, cost = _problem(0)
    with pytest.raises(error, match=match):
        rot.sinkhorn(a, b, cost, **kwargs)


def test_weights_and_cost_are_validated():
    _, _, a, b, cost = _problem(0)
    with pytest.raises(ValueError, match="a must be positive"):
        rot.sinkhorn(np.r_[0.0, a[1:]], b, cost, eps=0.1)
    with pytest.raises(ValueError, match="b has 4 entries"):
        rot.sinkhorn(a, b[:4], cost, eps=0.1)
    with pytest.raises(ValueError, match="cost must be finite"):
        rot.sinkhorn(a, b, np.where(cost > 1, np.nan, cost), eps=0.1)
    with pytest.raises(ValueError, match="value == 'exact'"):
        rot.entropic_ot_forward(a, b, cost, eps=0.1, value="exact")


def test_weight_gradient_is_the_centred_potential():
    _, _, a, b, cost = _problem(9)
    value, ctx = rot.entropic_ot_forward(a, b, cost, eps=0.3, **TIGHT)
    grads = rot.entropic_ot_backward(ctx, 1.0)
    res = rot.sinkhorn(a, b, cost, eps=0.3, **TIGHT)
    np.testing.assert_allclose(grads.a, res.f - a @ res.f, atol=1e-12)
    np.testing.assert_allclose(grads.cost, res.plan, atol=1e-15)
    np.testing.assert_allclose(a @ grads.a, 0.0, atol=1e-14)


# ---------------------------------------------------------------- Sinkhorn divergence


def _pot_divergence_transport(x, y, eps):
    """POT's debiased divergence from <pi, C> terms (it clips at 0; we do not)."""
    kw = dict(method="sinkhorn_log", stopThr=1e-15, numItermax=200000)
    n, m = len(x), len(y)
    a, b = np.full(n, 1 / n), np.full(m, 1 / m)
    terms = [pot.sinkhorn2(p, q, pot.dist(u, v), eps, **kw)
             for p, q, u, v in ((a, b, x, y), (a, a, x, x), (b, b, y, y))]
    return terms[0] - 0.5 * (terms[1] + terms[2])


def test_transport_divergence_matches_pot_empirical_sinkhorn_divergence():
    rng = np.random.default_rng(10)
    x, y = rng.standard_normal((7, 2)), rng.standard_normal((6, 2)) + 1.0
    eps = 0.5
    ours, _ = rot.sinkhorn_divergence(x, y, eps=eps, p=2, value="transport_cost", **TIGHT)
    theirs = pot.bregman.empirical_sinkhorn_divergence(
        x, y, eps, metric="sqeuclidean", stopThr=1e-15, numIterMax=200000
    )
    assert ours > 0.1  # POT clips at 0; compare where it does not
    np.testing.assert_allclose(ours, float(theirs), rtol=1e-9)
    np.testing.assert_allclose(ours, _pot_divergence_transport(x, y, eps), rtol=1e-9)


def test_regularized_divergence_matches_kl_values_on_pot_plans():
    rng = np.random.default_rng(11)
    # Costs of the order of eps: POT's alternating iteration is slow on nearly diagonal
    # self-transport plans.
    x, y = 0.5 * rng.standard_normal((5, 3)), 0.5 * rng.standard_normal((4, 3))
    a, b = rng.uniform(0.5, 1, 5), rng.uniform(0.5, 1, 4)
    a, b = a / a.sum(), b / b.sum()
    eps = 0.4
    terms = []
    for p_, q_, u, v in ((a, b, x, y), (a, a, x, x), (b, b, y, y)):
        cost = pot.dist(u, v)
        plan, _ = _pot_plan(p_, q_, cost, eps)
        terms.append(_kl_value(plan, p_, q_, cost, eps))
    ours, _ = rot.sinkhorn_divergence(x, y, a, b, eps=eps, p=2, **TIGHT)
    np.testing.assert_allclose(ours, terms[0] - 0.5 * (terms[1] + terms[2]), rtol=1e-10)


@pytest.mark.parametrize("value", ["regularized", "transport_cost"])
@pytest.mark.parametrize("p", [1, 2])
def test_divergence_of_a_measure_with_itself_is_zero(value, p):
    rng = np.random.default_rng(12)
    x = rng.standard_normal((6, 3))
    a = rng.uniform(0.5, 1, 6)
    # eps of the order of the costs: a nearly diagonal plan would converge very slowly.
    sd, grads = rot.sinkhorn_divergence(x, x, a, a, eps=2.0, p=p, value=value, **TIGHT)
    np.testing.assert_allclose(sd, 0.0, atol=1e-12)
    # Eq. (4) is stationary at nu = mu: the gradients vanish too.
    np.testing.assert_allclose(grads.x + grads.y, 0.0, atol=1e-10)


def test_self_terms_use_the_symmetric_solver_consistently():
    rng = np.random.default_rng(13)
    x = 0.5 * rng.standard_normal((1, 5, 2))
    cost = _ground_cost(_self_sq_dist(x, 2.0), 2.0)
    w = np.full((1, 5), 0.2)
    sym = _solve_batch(w, w.copy(), cost, eps=1.0, max_iter=20000, tol=1e-12,
                           eps_scaling=None, symmetric=True)
    gen = _solve_batch(w, w.copy(), cost, eps=1.0, max_iter=20000, tol=1e-12,
                           eps_scaling=None)
    assert sym.converged.all() and gen.converged.all()
    assert sym.n_iter[0] < gen.n_iter[0]
    np.testing.assert_allclose(sym.value, gen.value, rtol=1e-12)
    # Marginals agree to 1e-12; nearly decoupled flows of the plan less tightly.
    np.testing.assert_allclose(sym.plan, gen.plan, atol=1e-10)


@settings(max_examples=10)
@given(rst.points_in_unit_ball(4, 2), rst.points_in_unit_ball(5, 2),
       st.sampled_from([1.0, 1.5, 2.0]), st.floats(0.1, 1.0))
def test_regularized_divergence_is_nonnegative(x, y, p, eps):
    sd, _ = rot.sinkhorn_divergence(x, y, eps=eps, p=p, tol=1e-11, max_iter=20000)
    assert sd >= -1e-12


@pytest.mark.parametrize("value", ["regularized", "transport_cost"])
def test_divergence_is_negative_for_p_above_2(value):
    # exp(-|x|^p / eps) is not a positive definite kernel for p > 2: Feydy et al.'s
    # positivity theorem does not apply, and SD(delta_0, (delta_-1 + delta_1)/2) < 0.
    x, y = np.array([[0.0]]), np.array([[-1.0], [1.0]])
    sd, _ = rot.sinkhorn_divergence(x, y, eps=10.0, p=4, value=value, **TIGHT)
    assert sd < -0.3


def test_uniform_weights_give_no_weight_gradient():
    rng = np.random.default_rng(14)
    _, grads = rot.sinkhorn_divergence(rng.standard_normal((3, 2)), rng.standard_normal((4, 2)),
                                       eps=0.5)
    assert grads.a is None and grads.b is None and grads.x.shape == (3, 2)


def test_pairwise_matrix_matches_single_pairs():
    rng = np.random.default_rng(15)
    clouds = rng.standard_normal((4, 5, 3))
    for value in ("regularized", "transport_cost"):
        matrix = rot.pairwise_sinkhorn_divergence(clouds, eps=0.5, p=2, value=value, **TIGHT)
        np.testing.assert_array_equal(np.diag(matrix), 0.0)
        for i in range(4):
            for j in range(i + 1, 4):
                single, _ = rot.sinkhorn_divergence_forward(clouds[i], clouds[j], eps=0.5, p=2,
                                                            value=value, **TIGHT)
                np.testing.assert_allclose(matrix[i, j], single, rtol=1e-10)
                assert matrix[j, i] == matrix[i, j]


# ---------------------------------------------------------------- Wasserstein losses


def _loop_divergence(x, y, eps, p):
    """d_w by POT plans and the KL value of Eq. (3): independent of refdml's solver."""
    def term(u, v):
        cost = pot.dist(u, v, metric="euclidean") ** p
        w_u, w_v = np.full(len(u), 1 / len(u)), np.full(len(v), 1 / len(v))
        plan, _ = _pot_plan(w_u, w_v, cost, eps)
        return _kl_value(plan, w_u, w_v, cost, eps)
    return term(x, y) - 0.5 * (term(x, x) + term(y, y))


def _loop_wcontrastive(features, labels, margin, eps, p):
    total, count = 0.0, 0
    for i in range(len(features)):
        for j in range(i + 1, len(features)):
            d = _loop_divergence(features[i], features[j], eps, p)
            total += d if labels[i] == labels[j] else max(margin - d, 0.0)
            count += 1
    return total / count


def _loop_wtriplet(features, labels, margin, eps, p):
    total, count = 0.0, 0
    for a in range(len(features)):
        for q in range(len(features)):
            for n in range(len(features)):
                if a != q and labels[a] == labels[q] and labels[n] != labels[a]:
                    dp = _loop_divergence(features[a], features[q], eps, p)
                    dn = _loop_divergence(features[a], features[n], eps, p)
                    total += max(dp - dn + margin, 0.0)
                    count += 1
    return total / count


@pytest.mark.parametrize("p", [1, 2])
def test_wasserstein_losses_match_a_loop_over_pot(p):
    rng = np.random.default_rng(16)
    features = 0.5 * rng.standard_normal((5, 4, 2))   # costs ~ eps, see above
    labels = np.array([0, 0, 1, 1, 2])
    eps = 0.5
    # A margin between the divergences so that some hinges are active and some are not.
    matrix = rot.pairwise_sinkhorn_divergence(features, eps=eps, p=p, **TIGHT)
    margin = float(np.median(matrix[np.triu_indices(5, 1)]))
    value, grads = rot.wcontrastive(features, labels, margin=margin, eps=eps, p=p, **TIGHT)
    np.testing.assert_allclose(value, _loop_wcontrastive(features, labels, margin, eps, p),
                               rtol=1e-9)
    value, grads = rot.wtriplet(features, labels, margin=0.3 * margin, eps=eps, p=p, **TIGHT)
    np.testing.assert_allclose(value, _loop_wtriplet(features, labels, 0.3 * margin, eps, p),
                               rtol=1e-9)
    assert grads.features.shape == features.shape


def test_wcontrastive_inactive_negative_hinges_have_no_gradient():
    rng = np.random.default_rng(17)
    features = rng.standard_normal((2, 3, 2)) * 0.1
    features[1] += 5.0
    value, grads = rot.wcontrastive(features, [0, 1], margin=1.0, eps=0.5)
    assert value == 0.0
    np.testing.assert_array_equal(grads.features, 0.0)


def test_losses_with_explicit_pairs_and_triplets():
    rng = np.random.default_rng(18)
    features = 0.5 * rng.standard_normal((4, 3, 2))
    labels = np.array([0, 0, 1, 1])
    pairs = np.array([[0, 1], [1, 0], [0, 2]])   # a repeated pair counts twice
    value, _ = rot.wcontrastive(features, labels, margin=50.0, eps=0.5, pairs=pairs, **TIGHT)
    d01 = _loop_divergence(features[0], features[1], 0.5, 1)
    d02 = _loop_divergence(features[0], features[2], 0.5, 1)
    np.testing.assert_allclose(value, (2 * d01 + 50.0 - d02) / 3, rtol=1e-9)
    value, _ = rot.wtriplet(features, labels, margin=50.0, eps=0.5,
                            triplets=np.array([[0, 1, 2]]), **TIGHT)
    np.testing.assert_allclose(value, d01 - d02 + 50.0, rtol=1e-9)


def test_losses_validate_inputs():
    features = np.zeros((3, 2, 2))
    with pytest.raises(ValueError, match="labels has length 2"):
        rot.wcontrastive(features, [0, 1], margin=1.0, eps=0.5)
    with pytest.raises(ValueError, match="margin == -1.0"):
        rot.wtriplet(features, [0, 0, 1], margin=-1.0, eps=0.5)
    with pytest.raises(ValueError, match="features must have 3 dimensions"):
        rot.wcontrastive(np.zeros((3, 2)), [0, 0, 1], margin=1.0, eps=0.5)
    with pytest.raises(ValueError, match="pairs must join two different images"):
        rot.wcontrastive(features, [0, 0, 1], margin=1.0, eps=0.5, pairs=[[1, 1]])
    with pytest.raises(ValueError, match="p == 0.5"):
        rot.wcontrastive(features, [0, 0, 1], margin=1.0, eps=0.5, p=0.5)
    value, grads = rot.wtriplet(features, [0, 1, 2], margin=1.0, eps=0.5)   # no triplet
    assert value == 0.0 and not grads.features.any()


def test_no_runtime_warning_at_tiny_eps_for_the_losses():
    rng = np.random.default_rng(19)
    features = rng.standard_normal((3, 4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        value, grads = rot.wcontrastive(features, [0, 0, 1], margin=1.0, eps=1e-3,
                                        eps_scaling=0.5, max_iter=2000)
    assert np.isfinite(value) and np.all(np.isfinite(grads.features))


# ---------------------------------------------------------------- tol = 0: a fixed count


def test_tol_zero_runs_max_iter_iterations_without_warning():
    _, _, a, b, cost = _problem(20)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        res = rot.sinkhorn(a, b, cost, eps=0.3, tol=0.0, max_iter=7)
        sd, _ = rot.sinkhorn_divergence_forward(np.eye(3), np.eye(3)[::-1] + 1.0, eps=0.5,
                                                tol=0.0, max_iter=5)
    assert res.n_iter == 7 and not res.converged and res.marginal_error > 0.0
    assert np.isfinite(sd)
    # The same 7 iterations as a run stopped by max_iter under a tol it cannot reach.
    with pytest.warns(ConvergenceWarning, match="stopped at max_iter=7"):
        ref = rot.sinkhorn(a, b, cost, eps=0.3, tol=1e-300, max_iter=7)
    np.testing.assert_array_equal(res.plan, ref.plan)    # the same 7 steps, the same code


# ---------------------------------------------------------------- extreme but finite scale


@pytest.mark.parametrize("scale", [1e-100, 1e100])
@pytest.mark.parametrize("p", [1.0, 2.0])
@pytest.mark.parametrize("value", ["regularized", "transport_cost"])
def test_divergence_is_p_homogeneous_with_eps_in_cost_units(scale, p, value):
    rng = np.random.default_rng(21)
    x, y = 0.5 * rng.standard_normal((5, 2)), 0.5 * rng.standard_normal((4, 2)) + 0.3
    a, b = rng.uniform(0.5, 1.5, 5), rng.uniform(0.5, 1.5, 4)
    sd, grads = rot.sinkhorn_divergence(x, y, a, b, eps=0.5, p=p, value=value, **TIGHT)
    sd_s, grads_s = rot.sinkhorn_divergence(scale * x, scale * y, a, b, eps=0.5 * scale ** p,
                                            p=p, value=value, **TIGHT)
    np.testing.assert_allclose(sd_s, scale ** p * sd, rtol=1e-10)
    np.testing.assert_allclose(grads_s.x, scale ** (p - 1) * grads.x, rtol=1e-8,
                               atol=1e-10 * scale ** (p - 1) * np.abs(grads.x).max())
    np.testing.assert_allclose(grads_s.a, scale ** p * grads.a, rtol=1e-8,
                               atol=1e-10 * scale ** p * np.abs(grads.a).max())


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_entropic_ot_of_an_extreme_cost_matrix_scales_with_it(scale):
    _, _, a, b, cost = _problem(22)
    value, ctx = rot.entropic_ot_forward(a, b, cost, eps=0.4, **TIGHT)
    value_s, ctx_s = rot.entropic_ot_forward(a, b, scale * cost, eps=0.4 * scale, **TIGHT)
    np.testing.assert_allclose(value_s, scale * value, rtol=1e-12)
    grads, grads_s = rot.entropic_ot_backward(ctx, 1.0), rot.entropic_ot_backward(ctx_s, 1.0)
    np.testing.assert_allclose(grads_s.cost, grads.cost, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(grads_s.a, scale * grads.a, rtol=1e-9, atol=1e-12 * scale)


def test_p1_divergence_of_clouds_at_1e300_is_right():
    # p = 1: the costs ~1e300 are representable (p = 2 would overflow, see below).
    rng = np.random.default_rng(23)
    x, y = rng.standard_normal((4, 2)), rng.standard_normal((3, 2)) + 1.0
    sd, _ = rot.sinkhorn_divergence(x, y, eps=0.5, p=1, **TIGHT)
    sd_s, grads = rot.sinkhorn_divergence(1e300 * x, 1e300 * y, eps=0.5e300, p=1, **TIGHT)
    np.testing.assert_allclose(sd_s, 1e300 * sd, rtol=1e-10)
    assert np.all(np.isfinite(grads.x))


@pytest.mark.parametrize(
    "scale, p, eps, match",
    [
        # eps ~ 1e-200 C: the data (far further from 1 than eps) lead the message.
        (1e100, 2, 0.5, r" out of range for eps == 0\.5: .* below 1e-13"),
        (1e-100, 2, 0.5, r" out of range for eps == 0\.5: .* above 1e\+12"),
        (1e200, 2, 1.0, r" \(magnitude .* overflows float64"),   # costs ~1e400
        (1e-200, 2, 1.0, r" \(magnitude .* underflows float64"),  # costs ~1e-400
    ],
)
def test_unresolvable_scales_are_named_errors_not_nan(scale, p, eps, match):
    rng = np.random.default_rng(24)
    x, y = scale * rng.standard_normal((4, 2)), scale * rng.standard_normal((3, 2))
    with pytest.raises(ValueError, match="x and y" + match):
        rot.sinkhorn_divergence_forward(x, y, eps=eps, p=p)
    with pytest.raises(ValueError, match="clouds" + match):
        rot.pairwise_sinkhorn_divergence_forward(np.stack([x[:3], y]), eps=eps, p=p)
    with pytest.raises(ValueError, match="features" + match):
        rot.wcontrastive_forward(np.stack([x[:3], y]), [0, 1], margin=1.0, eps=eps, p=p)


@pytest.mark.parametrize("scale", [1e-100, 1e100])
@pytest.mark.parametrize("p", [1.0, 2.0])
def test_wasserstein_losses_and_pairwise_are_p_homogeneous(scale, p):
    rng = np.random.default_rng(25)
    features = 0.5 * rng.standard_normal((4, 3, 2))
    labels = np.array([0, 0, 1, 1])
    unit = scale ** p
    matrix = rot.pairwise_sinkhorn_divergence(features, eps=0.5, p=p, **TIGHT)
    matrix_s = rot.pairwise_sinkhorn_divergence(scale * features, eps=0.5 * unit, p=p, **TIGHT)
    np.testing.assert_allclose(matrix_s, unit * matrix, rtol=1e-10)
    margin = float(np.median(matrix[np.triu_indices(4, 1)]))
    for loss in (rot.wcontrastive, rot.wtriplet):
        value, grads = loss(features, labels, margin=margin, eps=0.5, p=p, **TIGHT)
        value_s, grads_s = loss(scale * features, labels, margin=unit * margin, eps=0.5 * unit,
                                p=p, **TIGHT)
        np.testing.assert_allclose(value_s, unit * value, rtol=1e-10)
        np.testing.assert_allclose(grads_s.features, scale ** (p - 1) * grads.features,
                                   rtol=1e-8, atol=1e-10 * scale ** (p - 1))


# ---------------------------------------------------------------- bad input, named errors


def _contexts():
    rng = np.random.default_rng(26)
    x, y = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    _, _, a, b, cost = _problem(26)
    clouds = rng.standard_normal((3, 2, 2))
    return {
        rot.entropic_ot_backward: (rot.entropic_ot_forward(a, b, cost, eps=1.0)[1], ()),
        rot.sinkhorn_divergence_backward: (rot.sinkhorn_divergence_forward(x, y, eps=1.0)[1], ()),
        rot.pairwise_sinkhorn_divergence_backward:
            (rot.pairwise_sinkhorn_divergence_forward(clouds, eps=1.0)[1], (3, 3)),
        rot.wcontrastive_backward:
            (rot.wcontrastive_forward(clouds, [0, 0, 1], margin=1.0, eps=1.0)[1], ()),
        rot.wtriplet_backward:
            (rot.wtriplet_forward(clouds, [0, 0, 1], margin=1.0, eps=1.0)[1], ()),
    }


def test_every_backward_refuses_a_context_of_another_ot_operator():
    contexts = _contexts()
    for backward, (_, shape) in contexts.items():
        for other, (ctx, _) in contexts.items():
            if other is not backward:
                with pytest.raises(TypeError, match="ctx must be the"):
                    backward(ctx, np.ones(shape))


@pytest.mark.parametrize(
    "upstream, error, match",
    [
        (np.nan, ValueError, "must be finite"),
        (np.inf, ValueError, "must be finite"),
        ("1", TypeError, "real numbers"),
        (None, TypeError, "got None"),
        (np.ones(2), ValueError, "has shape"),
    ],
)
def test_every_backward_names_its_bad_upstream(upstream, error, match):
    for backward, (ctx, shape) in _contexts().items():
        bad = np.full(shape, upstream) if shape and np.ndim(upstream) == 0 and upstream is not None \
            and not isinstance(upstream, str) else upstream
        with pytest.raises(error, match=match):
            backward(ctx, bad)


def test_pairwise_backward_adds_both_triangles_and_handles_one_cloud():
    rng = np.random.default_rng(27)
    clouds = 0.5 * rng.standard_normal((3, 3, 2))
    _, ctx = rot.pairwise_sinkhorn_divergence_forward(clouds, eps=0.5, **TIGHT)
    upper = np.triu(rng.standard_normal((3, 3)), 1)
    full = rot.pairwise_sinkhorn_divergence_backward(ctx, upper + upper.T + np.diag([5.0, 6, 7]))
    doubled = rot.pairwise_sinkhorn_divergence_backward(ctx, 2.0 * upper)
    np.testing.assert_allclose(full.clouds, doubled.clouds, rtol=1e-13, atol=1e-15)
    out, ctx = rot.pairwise_sinkhorn_divergence_forward(clouds[:1], eps=0.5)
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(rot.pairwise_sinkhorn_divergence_backward(ctx, np.ones((1, 1))).clouds, 0.0)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=0.0), ValueError, "eps == 0.0"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=-1.0), ValueError, "eps == -1.0"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=np.nan), ValueError, "eps == nan"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=1.0, p=0.5), ValueError, "p == 0.5"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=1.0, p="2"), TypeError, "p must be"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=1.0, tol=-1.0), ValueError, "tol == -1.0"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, eps=1.0, value="transport"), ValueError,
         r"value == 'transport', must be one of \('regularized', 'transport_cost'\)"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, np.zeros(3), eps=1.0), ValueError,
         "a must be positive"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, None, -np.ones(2), eps=1.0), ValueError,
         "b must be positive"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, np.ones(2), eps=1.0), ValueError,
         "a has 2 entries"),
        (lambda x, y: rot.sinkhorn_divergence(x, y, np.ones((1, 3)), eps=1.0), ValueError,
         "a must be 1-d"),
        (lambda x, y: rot.sinkhorn_divergence(x, y[:, :1], eps=1.0), ValueError, "same dimension"),
        (lambda x, y: rot.sinkhorn_divergence(x, np.full((2, 2), np.nan), eps=1.0), ValueError,
         "y must be finite"),
        (lambda x, y: rot.pairwise_sinkhorn_divergence(x, eps=1.0), ValueError,
         "clouds must have 3 dimensions"),
        (lambda x, y: rot.entropic_ot_forward(np.ones(3), np.ones(2), np.ones((3, 2)),
                                              eps=1.0, value="kind"), ValueError, "value =="),
        (lambda x, y: rot.wtriplet(np.stack([x, x]), [0, 1], margin=1.0, eps=1.0,
                                   triplets=[[0, 0, 1]]), ValueError, "anchor != positive"),
        (lambda x, y: rot.wcontrastive(np.stack([x, x]), [0, 1], margin=1.0, eps=1.0,
                                       pairs=[[0, 1.5]]), TypeError, "pairs must be an integer"),
        (lambda x, y: rot.wcontrastive(np.stack([x, x]), [0, 1], margin=1.0, eps=1.0,
                                       pairs=[[0, 2]]), ValueError, "pairs holds indices"),
    ],
)
def test_bad_input_is_a_named_error(call, error, match):
    rng = np.random.default_rng(28)
    with pytest.raises(error, match=match):
        call(rng.standard_normal((3, 2)), rng.standard_normal((2, 2)))


def test_weights_of_any_finite_scale_are_normalised():
    _, _, a, b, cost = _problem(29)
    ref = rot.sinkhorn(a, b, cost, eps=0.4, **TIGHT)
    for s in (1e-300, 1e300):
        res = rot.sinkhorn(s * a, s * b, cost, eps=0.4, **TIGHT)
        np.testing.assert_allclose(res.plan, ref.plan, rtol=1e-12, atol=1e-15)
    # sum(a) = 1.8e308 * 6 overflows; the normalised weights do not.
    value, ctx = rot.entropic_ot_forward(np.full(6, 1.7e308), b, cost, eps=0.4, **TIGHT)
    assert np.isfinite(value)
    assert np.all(np.isfinite(rot.entropic_ot_backward(ctx, 1.0).a))


# ------------------------------------------------------- issue 20: the eps-range messages
#
# Only eps / max C matters: SD_eps(s x, s y) = s^p SD_{eps / s^p}(x, y). With the costs of
# features at 1e-200 (p = 1) and eps = 0.1 the ratio is ~1e199: beyond float64 whatever the
# rescaling, so the loss is refused, naming the features (further from 1 than eps), the
# range of the largest cost that eps allows and the range of eps that the features allow.


def _largest_cost(features, p):
    """max ||x - y||^p over every pair of points of every pair of clouds (self pairs too),
    from explicit differences (independent of the solver's Gram-based distances)."""
    points = features.reshape(-1, features.shape[-1])
    return float(np.max(np.linalg.norm(points[:, None] - points[None], axis=-1) ** p))


def _interval(message, after):
    """The first "[lo, hi]" in ``message`` after the text ``after``."""
    import re

    tail = message[message.index(after) + len(after):]
    low, high = re.search(r"\[([^,\]]+), ([^\]]+)\]", tail).groups()
    return float(low), float(high)


@pytest.mark.parametrize("loss", [rot.wcontrastive, rot.wtriplet])
@pytest.mark.parametrize("scale", [1e-200, 1e200])
def test_features_at_an_unresolvable_scale_are_named_with_the_ranges(loss, scale):
    rng = np.random.default_rng(40)
    unit_features = rng.standard_normal((4, 3, 2))
    eps, p = 0.1, 1
    with pytest.raises(ValueError) as info:
        loss(scale * unit_features, [0, 0, 1, 1], margin=1.0, eps=eps, p=p)
    message = str(info.value)
    assert message.startswith("features out of range for eps == 0.1:")
    # The largest cost at this eps: [eps / 1e12, eps / 1e-13] (printed to 3 digits).
    np.testing.assert_allclose(_interval(message, "must lie in "), (eps / 1e12, eps / 1e-13),
                               rtol=5e-3)
    # The eps these features allow: [1e-13, 1e12] times their largest cost.
    largest = scale ** p * _largest_cost(unit_features, p)   # squares of 1e-200 underflow
    np.testing.assert_allclose(_interval(message, "eps must lie in "),
                               (1e-13 * largest, 1e12 * largest), rtol=5e-3)


def test_the_stated_eps_range_is_usable():
    # Features at 1e-200: an eps at the centre (log scale) of the range the message states
    # solves, and gives the unscaled loss times 1e-200 (p = 1 homogeneity).
    rng = np.random.default_rng(41)
    features = rng.standard_normal((4, 3, 2))
    with pytest.raises(ValueError) as info:
        rot.wcontrastive_forward(1e-200 * features, [0, 0, 1, 1], margin=1.0, eps=0.1)
    low, high = _interval(str(info.value), "eps must lie in ")
    eps = float(np.sqrt(low) * np.sqrt(high))     # low * high underflows
    loss, _ = rot.wcontrastive_forward(1e-200 * features, [0, 0, 1, 1], margin=1e-200,
                                       eps=eps, **TIGHT)
    expected, _ = rot.wcontrastive_forward(features, [0, 0, 1, 1], margin=1.0,
                                           eps=eps * 1e200, **TIGHT)
    np.testing.assert_allclose(loss, 1e-200 * expected, rtol=1e-9)


@pytest.mark.parametrize("eps, side", [(1e-300, "below 1e-13"), (1e300, "above 1e\\+12")])
def test_an_extreme_eps_with_unit_features_names_eps(eps, side):
    import re

    features = np.random.default_rng(42).standard_normal((4, 3, 2))
    shown = re.escape(repr(eps))
    with pytest.raises(ValueError, match=rf"^eps == {shown} is .* times the largest cost .*{side}"):
        rot.wcontrastive_forward(features, [0, 0, 1, 1], margin=1.0, eps=eps)
    with pytest.raises(ValueError, match=rf"^eps == {shown} is .*for the cost given"):
        rot.sinkhorn(np.ones(3), np.ones(2), np.arange(6.0).reshape(3, 2), eps=eps)


def test_a_batch_of_weights_that_does_not_fit_the_cost_is_named():
    cost = np.ones((2, 4, 5))
    with pytest.raises(ValueError, match=r"^a has batch shape \(3,\) .* batch shape \(2,\) of cost"):
        rot.sinkhorn(np.ones((3, 4)), np.ones(5), cost, eps=0.5)
    with pytest.raises(ValueError, match=r"^b has batch shape \(3,\)"):
        rot.entropic_ot_forward(np.ones(4), np.ones((3, 5)), cost, eps=0.5)
    with pytest.raises(ValueError, match=r"^a and b have batch shapes \(2,\) and \(3,\)"):
        rot.sinkhorn(np.ones((2, 4)), np.ones((3, 5)), np.ones((4, 5)), eps=0.5)
    # Broadcasting batches still work: (2, 1) weights against a (2, 3) batch of costs.
    result = rot.sinkhorn(np.ones((2, 1, 4)), np.ones(5), np.ones((2, 3, 4, 5)), eps=0.5)
    assert result.plan.shape == (2, 3, 4, 5)


def test_a_max_iter_beyond_int64_is_named():
    # The solver counts iterations in int64 (refdml.ot._sinkhorn._check_solver_args).
    clouds = np.random.default_rng(43).standard_normal((3, 4, 2))
    with pytest.raises(ValueError, match="max_iter == 1180591620717411303424"):
        rot.pairwise_sinkhorn_divergence(clouds, eps=0.5, max_iter=2**70)


def test_gradients_of_weights_of_subnormal_mass_are_named():
    # d/da f(a / sum a) scales as 1 / sum(a): beyond float64 at sum(a) ~ 3e-310.
    _, _, a, b, cost = _problem(44, n=3, m=2)
    _, ctx = rot.entropic_ot_forward(1e-310 * a, b, cost, eps=0.5)
    with pytest.raises(ValueError, match=r"gradient with respect to a overflows float64.*sum\(a\)"):
        rot.entropic_ot_backward(ctx, 1.0)
    rng = np.random.default_rng(45)
    x, y = rng.standard_normal((3, 2)), rng.standard_normal((2, 2))
    _, ctx = rot.sinkhorn_divergence_forward(x, y, a, 1e-310 * b, eps=0.5)
    with pytest.raises(ValueError, match=r"gradient with respect to b overflows float64"):
        rot.sinkhorn_divergence_backward(ctx, 1.0)


def test_an_eps_scaling_too_close_to_one_is_named_not_a_hang():
    # q = 1 - 1e-16 lowers eps by one ulp per stage: ~6e16 stages from max C to eps.
    _, _, a, b, cost = _problem(46)
    eps = 1e-3 * float(cost.max())
    with pytest.raises(ValueError, match=r"^eps_scaling == 0.9999999999999999 needs 6\.\d+e\+16 "):
        rot.sinkhorn(a, b, cost, eps=eps, eps_scaling=1 - 1e-16)
    with pytest.raises(ValueError, match=r"^eps_scaling == 0.9999999999999999 needs"):
        rot.pairwise_sinkhorn_divergence(np.stack([_problem(47)[0]] * 3), eps=eps,
                                         eps_scaling=1 - 1e-16)


# ------------------------------------------------------- issue 20: any p, coincident points


def _cloud_at_unit_distance():
    """Clouds whose largest distance is exactly 1 (x_0 = (0, 0), y_0 = (1, 0); every other
    distance at most 0.9), so that ||x - y||^p is representable at every p."""
    x = np.array([[0.0, 0.0], [0.5, 0.0], [0.2, 0.3]])
    y = np.array([[1.0, 0.0], [0.7, 0.1]])
    return x, y


@pytest.mark.parametrize("p", [1e5, 1e38, 1e300])
def test_divergence_at_huge_p_is_that_of_the_limit_costs(p):
    # Every cost (D / D_max)^p but the largest (1) is 0 at these p (0.9^1e5 underflows):
    # the divergence is that of the 0/1 cost matrices, solved directly (once the scaled
    # cost 2^p overflowed, or the unit s^p: a RuntimeWarning, or a refusal).
    x, y = _cloud_at_unit_distance()
    eps = 0.1
    sd, grads = rot.sinkhorn_divergence(x, y, eps=eps, p=p, **TIGHT)

    def limit(u, v):
        distance = np.linalg.norm(u[:, None] - v[None], axis=-1)
        cost = (distance == 1.0).astype(float)
        return rot.entropic_ot_forward(np.full(len(u), 1 / len(u)), np.full(len(v), 1 / len(v)),
                                       cost, eps=eps, **TIGHT)[0]

    expected = limit(x, y) - 0.5 * (limit(x, x) + limit(y, y))
    np.testing.assert_allclose(sd, expected, rtol=1e-12)
    # The gradient is p times the cost's derivative at the one pair of distance 1: it
    # moves x_0 and y_0 along their difference, nothing else.
    assert np.all(np.isfinite(grads.x)) and np.all(np.isfinite(grads.y))
    np.testing.assert_allclose(grads.x[1:], 0.0, atol=0.0)
    np.testing.assert_allclose(grads.x[0, 1], 0.0, atol=0.0)
    np.testing.assert_allclose(grads.x[0, 0], -grads.y[0, 0], rtol=1e-12)
    assert grads.x[0, 0] < 0.0


@pytest.mark.parametrize("p", [3.0, 7.0, 40.0])
def test_divergence_gradients_at_larger_p_match_finite_differences(p):
    # (D / D_max)^p in the unit D_max^p: eps in the cost's units, scaled with it.
    from refdml.gradcheck import assert_gradients, check_gradients

    rng = np.random.default_rng(50)
    x, y = rng.uniform(-1, 1, (4, 2)), rng.uniform(-1, 1, (3, 2))
    largest = np.max(np.linalg.norm(np.concatenate([x, y])[:, None] - np.concatenate([x, y])[None],
                                    axis=-1)) ** p

    def forward(x, y):
        return rot.sinkhorn_divergence_forward(x, y, eps=0.2 * largest, p=p, **TIGHT)

    result = check_gradients(forward, rot.sinkhorn_divergence_backward, {"x": x, "y": y}, rng=5)
    assert_gradients(result, rtol=1e-6)


def test_p_beyond_the_range_of_the_data_is_named():
    # Largest distance 3: 3^p is a float64 in [2^-1000, 2^1000] for p <= 1000 / log2(3).
    x, y = _cloud_at_unit_distance()
    fits = 1000.0 / np.log2(3.0)
    for call in (lambda p: rot.sinkhorn_divergence(3 * x, 3 * y, eps=0.1, p=p),
                 lambda p: rot.wcontrastive(np.stack([3 * x[:2], 3 * y]), [0, 1], margin=1.0,
                                            eps=0.1, p=p)):
        for p in (1000.0, 1e38):
            with pytest.raises(ValueError, match=rf"^p == {re.escape(f'{p:g}')}: the largest "
                                                 r"cost \|\|x - y\|\|"
                                                 rf"\^p of .* \(largest distance 3\) is 2\^.*, it "
                                                 rf"overflows float64 .* p <= {fits:.4g} keeps"):
                call(p)


def test_weight_gradient_is_zero_where_the_points_coincide():
    # y scaled by 1e-300 next to x of order 1: every y_j is at the same distance from each
    # x_i (to float64), so the divergence does not depend on b; its gradient, (g - <g, b>) /
    # |b| in both conventions, is 0. The projection is taken against the largest weight:
    # equal potentials give 0, where <g, b> left an ulp of |g| along (1, ..., 1). Bounded by
    # the rounding of the potentials (they may differ by an ulp: BLAS mat-vecs).
    rng = np.random.default_rng(51)
    x, y = 3 * rng.standard_normal((5, 3)), 1e-300 * rng.standard_normal((4, 3)) + 1.0
    a, b = rng.uniform(0.5, 1.0, 5), rng.uniform(0.5, 1.0, 4)
    for value in ("regularized", "transport_cost"):
        sd, ctx = rot.sinkhorn_divergence_forward(x, y, a, b, eps=0.1, value=value, **TIGHT)
        grads = rot.sinkhorn_divergence_backward(ctx, 1.0)
        scale = ctx.unit * np.abs(ctx.xy.g).max() / ctx.b_mass
        np.testing.assert_allclose(grads.b, 0.0, atol=64 * np.finfo(float).eps * scale * 4)
        assert np.abs(grads.a).max() > 1e-3


# ------------------------------------------------- large eps against a 50-digit Sinkhorn
#
# At eps >> C the plan is a b^T (1 + O(C / eps)): a kernel iteration keeps the potentials
# only to eps ulp, and its stopping rule (L1 marginal error <= tol) only to eps tol, i.e.
# 1e-10 and 1e-6 of the cost at eps = 1e6 C. The oracle below is independent of refdml:
# alternating log-domain Sinkhorn in mpmath at 50 digits, run to a fixed point, its value
# <a, f> + <b, g> (columns exact), gradients by central differences (step 1e-20: truncation
# ~1e-40, cancellation ~1e-30). Tolerance 1e-12 relative (to the largest entry of each
# gradient): the fixed solver is at the rounding of the cost (~1e-15 measured), the old one
# was 4e-9 (value) and 7e-5 (weight gradients) off on the divergence, 1e-9 on entropic OT.

_MP_DIGITS = 50
_MP_STEP = "1e-20"
_LARGE_EPS_RTOL = 1e-12


def _mp_ot(cost, a, b, eps):
    """Regularised value <pi, C> + eps KL(pi | a x b) of lists of mpf (weights normalised)."""
    a = [v / mp.fsum(a) for v in a]
    b = [v / mp.fsum(b) for v in b]
    f, g = [mp.mpf(0)] * len(a), [mp.mpf(0)] * len(b)
    stop = mp.mpf(10) ** (10 - _MP_DIGITS) * (1 + max(abs(c) for row in cost for c in row))
    for _ in range(2000):
        new_f = [-eps * mp.log(mp.fsum(b_j * mp.exp((g_j - c_ij) / eps)
                                       for b_j, g_j, c_ij in zip(b, g, row)))
                 for row in cost]
        g = [-eps * mp.log(mp.fsum(a_i * mp.exp((f_i - row[j]) / eps)
                                   for a_i, f_i, row in zip(a, new_f, cost)))
             for j in range(len(b))]
        change = max(abs(u - v) for u, v in zip(new_f, f))
        f = new_f
        if change < stop:
            return mp.fsum(u * v for u, v in zip(a, f)) + mp.fsum(u * v for u, v in zip(b, g))
    raise AssertionError("the mpmath Sinkhorn did not reach its fixed point")


def _mp_sq_cost(x, y):
    return [[mp.fsum((p - q) ** 2 for p, q in zip(xi, yj)) for yj in y] for xi in x]


def _mp_divergence(x, y, a, b, eps):
    """Eq. (4) with p = 2 on nested lists of mpf."""
    return (_mp_ot(_mp_sq_cost(x, y), a, b, eps)
            - (_mp_ot(_mp_sq_cost(x, x), a, a, eps) + _mp_ot(_mp_sq_cost(y, y), b, b, eps)) / 2)


def _to_mp(array):
    """Nested lists of mpf holding the float64 entries exactly."""
    if np.ndim(array) > 1:
        return [_to_mp(row) for row in array]
    return [mp.mpf(float(v)) for v in array]


def _mp_value_and_gradients(function, arrays, eps):
    """``function(**arrays_as_mpf, eps)`` and its central differences w.r.t. every array."""
    args = {name: _to_mp(np.asarray(value, dtype=float)) for name, value in arrays.items()}
    eps, step = mp.mpf(float(eps)), mp.mpf(_MP_STEP)
    value = function(**args, eps=eps)
    gradients = {}
    for name, base in arrays.items():
        grad = np.empty(np.shape(base))
        for index in np.ndindex(grad.shape):
            sides = []
            for sign in (1, -1):
                moved = _to_mp(np.asarray(base, dtype=float))
                entry = moved
                for k in index[:-1]:
                    entry = entry[k]
                entry[index[-1]] += sign * step
                sides.append(function(**{**args, name: moved}, eps=eps))
            grad[index] = float((sides[0] - sides[1]) / (2 * step))
        gradients[name] = grad
    return float(value), gradients


def _assert_matches_oracle(value, grads, expected_value, expected_grads, upstream):
    np.testing.assert_allclose(value, expected_value, rtol=_LARGE_EPS_RTOL, atol=0)
    for name, expected in expected_grads.items():
        expected = upstream * expected
        np.testing.assert_allclose(getattr(grads, name), expected, rtol=0,
                                   atol=_LARGE_EPS_RTOL * np.abs(expected).max(), err_msg=name)


def _catalogue_case(entry, name):
    (case,) = [c for c in catalogue_entry(entry).reference_inputs(np.random.default_rng(0))
               if c.name == name]
    return dict(case.inputs)


@functools.cache
def _large_eps_divergence_case():
    """The catalogue's case (eps = 1e6 times the largest cost; tol = 1e-12) and its oracle."""
    inputs = _catalogue_case("ot.sinkhorn_divergence", "large eps (1e6 of the largest cost)")
    assert inputs["p"] == 2 and inputs["eps"] > 1e5
    arrays = {name: inputs[name] for name in ("x", "y", "a", "b")}
    with mp.workdps(_MP_DIGITS):
        expected, expected_grads = _mp_value_and_gradients(_mp_divergence, arrays, inputs["eps"])
    return inputs, expected, expected_grads


def test_large_eps_divergence_matches_a_50_digit_sinkhorn():
    # Its weight gradients were off by up to 1.7e-4 of an entry before the solve ended with
    # exact log-domain half steps (refdml.ot._sinkhorn._finish_large_eps).
    inputs, expected, expected_grads = _large_eps_divergence_case()
    upstream = -0.7
    sd, ctx = rot.sinkhorn_divergence_forward(**inputs)
    _assert_matches_oracle(sd, rot.sinkhorn_divergence_backward(ctx, upstream), expected,
                           expected_grads, upstream)


def test_large_eps_divergence_by_pot_keeps_fewer_digits_of_the_weight_gradients():
    # solver="pot" on the same case: POT stops after one iteration, and its potentials,
    # eps (log_u - log a), are differences of numbers ~log(n) at eps = 1e6 C, an ulp of
    # which is ~1e-10 of the cost; its stopping rule leaves eps tol more. Measured 9e-8
    # (a) and 8e-8 (b) of the largest entry, 1e-6 here; the value and the gradients w.r.t.
    # the points (from the plan, not the potentials) keep the oracle's tolerance.
    inputs, expected, expected_grads = _large_eps_divergence_case()
    upstream = -0.7
    sd, ctx = rot.sinkhorn_divergence_forward(**inputs, solver="pot")
    grads = rot.sinkhorn_divergence_backward(ctx, upstream)
    _assert_matches_oracle(sd, grads, expected, {k: expected_grads[k] for k in ("x", "y")},
                           upstream)
    for name in ("a", "b"):
        want = upstream * expected_grads[name]
        error = np.abs(getattr(grads, name) - want).max() / np.abs(want).max()
        assert 1e-12 < error <= 1e-6, (name, error)


def test_large_eps_entropic_ot_matches_a_50_digit_sinkhorn():
    inputs = _catalogue_case("ot.entropic_ot", "large eps (1e6 of the largest cost)")
    assert inputs["eps"] > 1e5 * np.abs(inputs["cost"]).max()
    arrays = {name: inputs[name] for name in ("a", "b", "cost")}
    with mp.workdps(_MP_DIGITS):
        expected, expected_grads = _mp_value_and_gradients(_mp_ot, arrays, inputs["eps"])
    upstream = 1.3
    value, ctx = rot.entropic_ot_forward(**inputs)
    _assert_matches_oracle(value, rot.entropic_ot_backward(ctx, upstream), expected,
                           expected_grads, upstream)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), log10_ratio=st.floats(-0.5, 11.0),
       symmetric=st.booleans())
def test_entropic_ot_from_eps_near_the_cost_to_1e11_times_it_matches_mpmath(
        seed, log10_ratio, symmetric):
    # Both sides of the threshold eps = max C where the final half steps start, and up to
    # 1e11 (of the 1e12 allowed). A symmetric problem (b = a, C = C^T) is the problem of the
    # divergence's self terms (solved here by the alternating iteration, by the averaged
    # one in the test above). Below the threshold the stopping rule bounds the potentials'
    # error by eps tol <= max C tol: 1e-11 of the gradients measured, hence 1e-10 here.
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1.0, 1.0, (3, 2))
    y = x if symmetric else rng.uniform(-1.0, 1.0, (2, 2))
    cost = np.sum((x[:, None] - y[None]) ** 2, axis=-1)
    a = rng.uniform(0.5, 1.5, 3)
    b = a.copy() if symmetric else rng.uniform(0.5, 1.5, 2)
    eps = 10.0 ** log10_ratio * cost.max()
    with mp.workdps(_MP_DIGITS):
        expected, expected_grads = _mp_value_and_gradients(
            _mp_ot, {"a": a, "b": b, "cost": cost}, eps)
    upstream = rng.uniform(0.5, 2.0)
    value, ctx = rot.entropic_ot_forward(a, b, cost, eps=eps, tol=1e-12, max_iter=5000)
    grads = rot.entropic_ot_backward(ctx, upstream)
    np.testing.assert_allclose(value, expected, rtol=1e-10, atol=0)
    for name, want in expected_grads.items():
        want = upstream * want
        np.testing.assert_allclose(getattr(grads, name), want, rtol=0,
                                   atol=1e-10 * np.abs(want).max(), err_msg=name)
