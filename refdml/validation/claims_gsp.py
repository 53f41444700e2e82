"""Checks of the claims of GSP (Gürbüz, Şener, Alatan, Generalized Sum Pooling).

Every (P2) reference solution comes from :func:`._oracles.p2_scalar` (brentq on the
scalar dual, derived independently in its docstring), itself checked against SLSQP on
the primal in ``gsp.prop4.2``; every (P1) value from ``linprog`` and POT. refdml's own
``refdml.gsp`` is what ``gsp.exact_solver`` and the cross-checks examine.

GSP's ε, the inverse temperature of (P2), is ``inverse_temperature`` here, as in ``refdml.gsp``
(``eps`` is the entropic regularisation of Sinkhorn elsewhere in refdml).

One self-contained check per claim of the main paper, in its order; the
supplement's computational claims (Sec. 1.4, Fig. 9) are in :mod:`.claims_gsp_supp`.
"""

from __future__ import annotations

import warnings

import numpy as np
import ot
from hypothesis import strategies as st
from scipy.special import log_softmax

from refdml import crossbatch as refdml_crossbatch
from refdml import gsp as refdml_gsp
from refdml.exceptions import ConvergenceWarning
from refdml.gradcheck import check_gradients

from ._common import arrays, floats, jsonable_arrays, rel_err
from ._framework import CORRECTION, PRINTED, Finding, Reading, claim, series, Figure
from ._oracles import (
    READINGS_43,
    p1_linprog,
    p2_scalar,
    p2_slsqp,
    prop42_iterate,
    prop43_gradient,
)


def _unit_ball(rng, k, d):
    x = rng.standard_normal((k, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x * rng.uniform(0, 1, (k, 1)) ** (1.0 / d)


def _cost(rng, m, n, d=8):
    """Costs ||w_i - f_j|| between prototypes and features drawn in the unit ball (GSP Alg. 2)."""
    w, f = _unit_ball(rng, m, d), _unit_ball(rng, n, d)
    return np.linalg.norm(w[:, None, :] - f[None, :, :], axis=-1)


@st.composite
def _p2_instance(draw, max_m=4, max_n=5, mu=(0.05, 0.95), inverse_temperature=(0.1, 20.0)):
    m, n = draw(st.integers(1, max_m)), draw(st.integers(1, max_n))
    return draw(arrays((m, n), 0.0, 2.0)), draw(floats(*mu)), draw(floats(*inverse_temperature))


# --------------------------------------------------------------------------- Theorem 4.1


@claim(
    "gsp.thm4.1",
    paper="GSP Theorem 4.1 (App. A.1)",
    statement="If mu = 1, the pooling (4.1) sum_i (1/n - rho*_i)/mu f_i reduces to global average pooling.",
    hypotheses="mu = 1, (rho*, pi*) a solution of (P1)",
    operators=("gsp.",),
)
def check_thm_4_1(ctx) -> Finding:
    rng = ctx.rng("gsp.thm4.1")
    worst_lp, worst_p2, trials = 0.0, 0.0, 0
    sizes = [(3, 4), (8, 16), (16, 49)] + ([] if ctx.quick else [(64, 49)])
    for m, n in sizes:
        for _ in range(3):
            cost = _cost(rng, m, n)
            _, rho, _ = p1_linprog(cost, 1.0)
            worst_lp = max(worst_lp, float(np.max(np.abs((1.0 / n - rho) - 1.0 / n))) * n)
            trials += 1
    # (P2) at mu = 1 by a generic solver: the constraints alone force rho = 0.
    for m, n in ((2, 3), (3, 4)):
        rho, _ = p2_slsqp(_cost(rng, m, n), 1.0, 2.0)
        worst_p2 = max(worst_p2, float(np.max(np.abs(rho))) * n)
    tol = 1e-9

    def violates(inst):
        cost, _, _ = inst
        _, rho, _ = p1_linprog(cost, 1.0)
        return float(np.max(np.abs(rho))) * cost.shape[1] > tol

    cex = ctx.search(_p2_instance(), violates, max_examples=ctx.pick(20, 60))
    # Just outside: mu < 1 does not give GAP.
    outside = {}
    for mu in (0.99, 0.9, 0.5):
        cost = _cost(rng, 4, 9)
        _, rho, _ = p1_linprog(cost, mu)
        outside[str(mu)] = float(np.max(np.abs((1.0 / 9 - rho) / mu - 1.0 / 9))) * 9
    res = refdml_gsp.weight_transport(_cost(rng, 5, 7)[None], mu=1.0, inverse_temperature=3.0)
    cross = float(np.max(np.abs(res.rho)))
    return Finding(
        readings=(Reading(PRINTED, "mu = 1 gives weights p_i = 1/n (LP (P1) by linprog)", worst_lp, tol,
                          None if cex is None else jsonable_arrays(cost=cex[0]), trials=trials),),
        key_number=f"max n|p - 1/n| at mu=1: LP {worst_lp:.1e}, (P2) by SLSQP {worst_p2:.1e}",
        sizes=[{"m": m, "n": n} for m, n in sizes],
        seeds=[ctx.seed],
        details={"max_n_rho_P2_SLSQP_mu1": worst_p2,
                 "outside_mu_lt_1_max_n_abs_p_minus_1_over_n": outside,
                 "refdml_weight_transport_mu1_max_rho": cross,
                 "why": "sum_j rho_j = 1 - mu for every feasible point, so mu = 1 forces rho = 0 (also for (P2))"},
        probe={"mu_below_1_deviation_from_GAP": outside},
    )


# --------------------------------------------------------------------------- Proposition 4.2


def _rate(sol: "object", mu: float) -> float:
    n = sol.rho.shape[0]
    return float((n / mu) * np.sum(sol.pi.sum(axis=0) ** 2))


@claim(
    "gsp.prop4.2",
    paper="GSP Proposition 4.2 (App. A.2)",
    statement="From t(0) = 1, rho(k+1) = (1/n)(1 + t(k) exp(-ε c)^T 1_m)^-1, "
              "t(k+1) = mu (1_m^T exp(-ε c) rho(k+1))^-1 converges to the solution of (P2), "
              "with pi(k) = t(k) exp(-ε c) Diag(rho(k)).",
    hypotheses="0 < mu < 1, inverse temperature ε > 0, finite costs",
    operators=("gsp.weight_transport",),
)
def check_prop_4_2(ctx) -> Finding:
    rng = ctx.rng("gsp.prop4.2")
    # The reference itself, against a generic solver (SLSQP on the primal of (P2)).
    oracle_check = 0.0
    for m, n, mu, inverse_temperature in ((2, 3, 0.3, 1.0), (3, 4, 0.6, 4.0), (3, 3, 0.1, 10.0)):
        cost = _cost(rng, m, n)
        ref = p2_scalar(cost, mu, inverse_temperature)
        rho, pi = p2_slsqp(cost, mu, inverse_temperature)
        oracle_check = max(oracle_check, n * float(np.max(np.abs(rho - ref.rho))), n * float(np.max(np.abs(pi - ref.pi))))
    k_max = ctx.pick(1000, 3000)
    worst, trials, worst_rate = 0.0, 0, 0.0
    rate_pairs = []
    grid = [(m, n, mu, inverse_temperature) for m in (4, 16) for n in (9, 49) for mu in (0.1, 0.3, 0.7)
            for inverse_temperature in (0.5, 5.0, 20.0)]
    if ctx.quick:
        grid = grid[::3]
    for m, n, mu, inverse_temperature in grid:
        cost = _cost(rng, m, n)
        ref = p2_scalar(cost, mu, inverse_temperature)
        _, _, _, errors = prop42_iterate(cost, mu, inverse_temperature, k_max, reference=ref.rho)
        r = _rate(ref, mu)
        worst_rate = max(worst_rate, r)
        if r ** k_max < 1e-14:  # iterations enough in theory: the error must be at rounding level
            worst = max(worst, float(errors[-1]))
            trials += 1
        tail = errors[(errors > 1e-11) & (errors < 1e-3)]
        if tail.size > 3:
            rate_pairs.append((r, float(np.exp(np.mean(np.diff(np.log(tail)))))))
    tol = 1e-10

    def stagnates(inst) -> bool:
        cost, mu, inverse_temperature = inst
        ref = p2_scalar(cost, mu, inverse_temperature)
        _, _, _, err = prop42_iterate(cost, mu, inverse_temperature, 400, reference=ref.rho)
        return err[-1] > 1e-9 and not err[-1] < err[199] * (1 - 1e-9)

    cex = ctx.search(_p2_instance(), stagnates, max_examples=ctx.pick(20, 80))
    # Just outside: mu = 1, where the limit rho = 0, pi = softmax/n is approached only like 1/k.
    cost = _cost(rng, 4, 9)
    limit_rho = np.zeros(9)
    _, _, _, err_mu1 = prop42_iterate(cost, 1.0, 5.0, 1000, reference=limit_rho)
    # Convergence curves on the paper's setting for the figure.
    cost = _cost(rng, 64, 49, d=128)
    curves = []
    ks = np.arange(1, 201)
    for inverse_temperature in (0.5, 5.0, 20.0):
        ref = p2_scalar(cost, 0.3, inverse_temperature)
        _, _, _, e = prop42_iterate(cost, 0.3, inverse_temperature, 200, reference=ref.rho)
        curves.append(series(f"mu=0.3, ε={inverse_temperature:g} (r={_rate(ref, 0.3):.2f})", ks, np.maximum(e, 1e-17)))
    c = _cost(rng, 6, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        res = refdml_gsp.weight_transport(c[None], mu=0.4, inverse_temperature=5.0, method="fixed_point", max_iter=37, tol=0.0)
    mine = prop42_iterate(c, 0.4, 5.0, 37)
    cross = {"same_37th_iterate_rho": rel_err(res.rho[0], mine[0]), "pi": rel_err(res.pi[0], mine[2])}
    return Finding(
        readings=(Reading(PRINTED, f"n max|rho(k) - rho*| -> 0 (measured at k={k_max} where r^k < 1e-14)",
                          worst, tol, None if cex is None else {**jsonable_arrays(cost=cex[0]), "mu": cex[1],
                                                                "inverse_temperature": cex[2]},
                          trials=trials),),
        key_number=f"error at k={k_max}: {worst:.1e}; observed rate = predicted r (max |diff| "
                   f"{max((abs(a - b) for a, b in rate_pairs), default=float('nan')):.1e})",
        sizes=[{"m": m, "n": n, "mu": mu, "inverse_temperature": inverse_temperature}
               for m, n, mu, inverse_temperature in grid],
        seeds=[ctx.seed],
        details={
            "oracle": "brentq on (1/n) sum_j sigmoid(tau + l_j) = mu, validated by SLSQP on the primal",
            "oracle_vs_SLSQP_max_abs": oracle_check,
            "rate_predicted_vs_observed": [{"predicted": a, "observed": b} for a, b in rate_pairs],
            "max_predicted_rate_on_grid": worst_rate,
            "rate_formula": "r = (n/mu) sum_j (sum_i pi_ij)^2 = sum_j p_j^2 / sum_j p_j < 1, p_j = n sum_i pi_ij",
            "outside_mu1_error_at_k_10_100_1000": [float(err_mu1[9]), float(err_mu1[99]), float(err_mu1[999])],
            "outside_mu1_note": "at mu = 1 the iterates still converge (to rho = 0) but sublinearly, error ~ 1/k",
            "refdml_fixed_point_vs_printed_iteration": cross,
        },
        figures=(Figure("gsp_prop42_convergence", "Convergence of the printed iteration, mu = 0.3 (m=64, n=49, d=128)",
                        "iteration k", "n max|rho(k) - rho*|", tuple(curves), yscale="log"),
                 Figure("gsp_prop42_mu1", "Just outside the hypotheses: mu = 1 (m=4, n=9, ε=5), error ~ 1/k",
                        "iteration k", "n max|rho(k) - 0|", (series("mu = 1", np.arange(1, 1001), err_mu1),),
                        xscale="log", yscale="log")),
        probe={"mu": 1.0, "error_at_k": {"10": float(err_mu1[9]), "100": float(err_mu1[99]), "1000": float(err_mu1[999])}},
    )


# --------------------------------------------------------------------------- Proposition 4.3


def _prop43_check(cost, mu, inverse_temperature, reading, seed=0):
    def forward(cost):
        sol = p2_scalar(cost, mu, inverse_temperature)
        return (sol.rho, sol.pi), sol

    def backward(sol, d_rho, d_pi):
        return {"cost": prop43_gradient(sol.rho, sol.pi, d_rho, d_pi, mu, inverse_temperature, reading)}

    return check_gradients(forward, backward, {"cost": cost}, rng=seed, mode="vjp")


def _prop43_error(cost, mu, inverse_temperature, reading, seed=0) -> float:
    return _prop43_check(cost, mu, inverse_temperature, reading, seed).max_rel_error


@claim(
    "gsp.prop4.3",
    paper="GSP Proposition 4.3, Eq. (4.2), Algorithm 3 backward",
    statement="dL/dc = -ε(pi * dL/dpi - n pi Diag(q - eta/(1 - mu - n rho^T rho)) rho), "
              "q = rho * dL/drho + (pi * dL/dpi)^T 1_m, eta = (rho * dL/drho)^T 1_n - n q^T rho.",
    hypotheses="(rho, pi) the solution of (P2), 0 < mu < 1, inverse temperature ε > 0",
    operators=("gsp.weight_transport",),
)
def check_prop_4_3(ctx) -> Finding:
    rng = ctx.rng("gsp.prop4.3")
    errors = {r: 0.0 for r in READINGS_43}
    cases = [(m, n, mu, inverse_temperature) for m, n in ((3, 4), (5, 7)) for mu in (0.2, 0.5, 0.8)
             for inverse_temperature in (1.0, 5.0)]
    if ctx.quick:
        cases = cases[::2]
    for i, (m, n, mu, inverse_temperature) in enumerate(cases):
        cost = _cost(rng, m, n)
        for r in errors:
            errors[r] = max(errors[r], _prop43_error(cost, mu, inverse_temperature, r, seed=i))
    tol = 1e-6
    budget = ctx.pick(15, 50)
    inst = _p2_instance(max_m=3, max_n=4, inverse_temperature=(0.1, 10.0))
    # passed() also accepts differences below the finite-difference noise floor, which matters
    # where the true gradient vanishes (m = n = 1: the constraints fix rho and pi).
    cex = {r: ctx.search(inst, lambda a, r=r: not _prop43_check(*a, r).passed(1e-5), max_examples=budget)
           for r in ("a", "b")}
    as_json = {r: None if c is None else {**jsonable_arrays(cost=c[0]), "mu": c[1], "inverse_temperature": c[2],
                                          "relative_error": _prop43_error(*c, r)} for r, c in cex.items()}
    cost = _cost(rng, 6, 8)
    sol = p2_scalar(cost, 0.3, 5.0)
    d_rho, d_pi = rng.standard_normal(8), rng.standard_normal((6, 8))
    res = refdml_gsp.weight_transport(cost[None], mu=0.3, inverse_temperature=5.0)
    theirs = refdml_gsp.weight_transport_backward(res, d_rho[None], d_pi[None]).cost[0]
    cross = rel_err(theirs, prop43_gradient(sol.rho, sol.pi, d_rho, d_pi, 0.3, 5.0, "b"))
    return Finding(
        readings=(
            Reading(PRINTED, "(a) " + READINGS_43["a"], errors["a"], tol, as_json["a"], trials=len(cases)),
            Reading(CORRECTION, "(b) " + READINGS_43["b"] + " (as derived from App. A.3)", errors["b"], tol,
                    as_json["b"], trials=len(cases)),
            Reading(CORRECTION, "(c) " + READINGS_43["c"], errors["c"], tol, trials=len(cases)),
        ),
        key_number="rel. error vs finite differences: " + ", ".join(f"({r}) {e:.1e}" for r, e in errors.items()),
        sizes=[{"m": m, "n": n, "mu": mu, "inverse_temperature": inverse_temperature}
               for m, n, mu, inverse_temperature in cases],
        seeds=[ctx.seed],
        details={"max_rel_error_by_reading": errors,
                 "oracle": "central differences (refdml.gradcheck, mode vjp) of the brentq (P2) solution map",
                 "refdml_weight_transport_backward_vs_reading_b": cross},
    )


# --------------------------------------------------------------------------- App. A.3: H^{-1}


def _constraint_matrix(m, n):
    A = np.zeros((n + 1, n + m * n))
    for j in range(n):
        A[j, j] = 1.0
        A[j, n + j :: n] = 1.0
    A[n, n:] = 1.0
    return A


def _hinv_errors(cost, mu, inverse_temperature):
    m, n = cost.shape
    sol = p2_scalar(cost, mu, inverse_temperature)
    x = np.concatenate([sol.rho, sol.pi.ravel()])
    A = _constraint_matrix(m, n)
    H = A @ np.diag(x) @ A.T
    b = 1.0 / n - sol.rho
    H_printed = np.block([[np.eye(n) / n, b[:, None]], [b[None, :], np.array([[mu]])]])
    k = 1.0 - mu - n * sol.rho @ sol.rho
    rho_hat = 1.0 - n * sol.rho
    Hinv_printed = np.block([[n * np.eye(n) + np.outer(rho_hat, rho_hat) / k, -rho_hat[:, None] / k],
                             [-rho_hat[None, :] / k, np.array([[1.0 / k]])]])
    return rel_err(H_printed, H), rel_err(Hinv_printed @ H, np.eye(n + 1)), k, float(np.linalg.cond(H))


@claim(
    "gsp.appA3.hinv",
    paper="GSP App. A.3 (block inverse of H)",
    statement="H = A Diag(x) A^T = [[I/n, 1/n - rho], [(1/n - rho)^T, mu]] is positive definite with "
              "H^-1 = [[nI + k^-1 rho_hat rho_hat^T, -k^-1 rho_hat], [-k^-1 rho_hat^T, k^-1]], "
              "k = 1 - mu - n rho^T rho, rho_hat = 1 - n rho.",
    hypotheses="x = (rho, pi) the solution of (P2), 0 < mu < 1",
)
def check_app_a3(ctx) -> Finding:
    rng = ctx.rng("gsp.appA3.hinv")
    worst_h, worst_inv, min_k, trials = 0.0, 0.0, np.inf, 0
    for m, n in ((3, 4), (8, 9), (16, 25)):
        for mu in (0.1, 0.5, 0.9):
            for inverse_temperature in (0.5, 5.0):
                eh, ei, k, cond = _hinv_errors(_cost(rng, m, n), mu, inverse_temperature)
                worst_h, worst_inv, min_k = max(worst_h, eh), max(worst_inv, ei / cond), min(min_k, k)
                trials += 1
    tol = 1e-12  # on ||H^-1_printed H - I|| / cond(H): backward-stable level
    cex = ctx.search(_p2_instance(),
                     lambda a: (lambda e: e[0] > 1e-12 or e[1] / e[3] > tol)(_hinv_errors(*a)),
                     max_examples=ctx.pick(20, 80))
    probe = {}
    cost = _cost(rng, 4, 9)
    for mu in (0.9, 0.99, 0.999, 0.9999):
        _, ei, k, cond = _hinv_errors(cost, mu, 5.0)
        probe[str(mu)] = {"k": k, "cond_H": cond, "inverse_error": ei}
    # mu = 1: rho = 0, so k = 0 and H is singular (positive semidefinite only).
    pi1 = np.exp(log_softmax(-5.0 * cost, axis=0)) / 9
    x1 = np.concatenate([np.zeros(9), pi1.ravel()])
    A = _constraint_matrix(4, 9)
    probe["1.0"] = {"k": 1.0 - 1.0 - 0.0, "min_eigenvalue_H": float(np.linalg.eigvalsh(A @ np.diag(x1) @ A.T)[0])}
    return Finding(
        readings=(Reading(PRINTED, "printed H and H^-1 (error of H^-1 H - I scaled by 1/cond(H))",
                          max(worst_h, worst_inv), tol,
                          None if cex is None else {**jsonable_arrays(cost=cex[0]), "mu": cex[1],
                                                    "inverse_temperature": cex[2]},
                          trials=trials),),
        key_number=f"||H_printed - A Diag(x) A^T|| {worst_h:.1e}, ||H^-1 H - I||/cond {worst_inv:.1e}; mu=1: k=0, H singular",
        sizes=[{"m": m, "n": n} for m, n in ((3, 4), (8, 9), (16, 25))],
        seeds=[ctx.seed],
        details={"max_rel_error_H_form": worst_h, "max_inverse_error_over_cond": worst_inv, "min_k": min_k,
                 "probe_mu_to_1": probe},
        probe={"mu": 1.0, "k": 0.0, "min_eigenvalue_H": probe["1.0"]["min_eigenvalue_H"]},
    )


# --------------------------------------------------------------------------- Eq. (4.4)


def _zs_instance(rng, n_classes=6, per_class=2, m=5, e=4):
    labels = np.repeat(np.arange(n_classes), per_class)
    Z = rng.dirichlet(np.ones(m), size=labels.size)
    U = rng.standard_normal((n_classes, e))
    mask = labels < n_classes // 2  # half 1 = first classes
    return Z, labels, U, mask


def _cross_predictions(Z, labels, U, mask, ridge):
    """A_k = Upsilon_k (Z_k^T Z_k + ridge I)^-1 Z_k^T (paper's columns), predictions of the other half."""
    pred = np.zeros((Z.shape[0], U.shape[1]))
    for fit, apply in ((mask, ~mask), (~mask, mask)):
        Zc, Uc = Z[fit].T, U[labels[fit]].T  # m x b_k, e x b_k
        A = Uc @ np.linalg.solve(Zc.T @ Zc + ridge * np.eye(Zc.shape[1]), Zc.T)
        pred[apply] = (A @ Z[apply].T).T
    return pred


def _zs_losses(Z, labels, U, mask, ridge=0.05):
    pred = _cross_predictions(Z, labels, U, mask, ridge)
    scores = pred @ U.T
    rows = np.arange(labels.size)
    ce = -float(np.mean(log_softmax(scores, axis=1)[rows, labels]))  # Algorithm 4
    printed, corrected, j_fix_only = 0.0, 0.0, 0.0
    for half in (~mask, mask):  # b2 then b1, as printed
        idx = np.flatnonzero(half)
        terms_all, terms_rest = [], []
        for i in idx:  # a readable loop, independent of the vectorised cross-entropy
            diffs = [scores[i, j] - scores[i, labels[i]] for j in range(U.shape[0])]
            terms_all.append(np.log1p(sum(np.exp(d) for d in diffs)))
            terms_rest.append(np.log1p(sum(np.exp(d) for j, d in enumerate(diffs) if j != labels[i])))
        printed += np.mean(terms_all)
        j_fix_only += np.mean(terms_rest)
        corrected += np.sum(terms_rest) / labels.size
    return ce, printed, j_fix_only, corrected


@claim(
    "gsp.eq4.4",
    paper="GSP Eq. (4.4) vs Algorithm 4",
    statement="L_ZS = (1/|b2|) sum_{i in b2} log(1 + sum_{j in [c]} e^{(v_j - v_yi)^T A_1 z_i}) + "
              "(1/|b1|) sum_{i in b1} log(1 + sum_{j in [c]} e^{(v_j - v_yi)^T A_2 z_i}), "
              "'i.e., rearranged soft-max cross-entropy' (Algorithm 4: CrossEntropy(SoftMax(Y_hat^T Upsilon), Y)).",
    hypotheses="class-disjoint halves b1, b2; A_k the ridge fits of (P3)",
    operators=("crossbatch.zero_shot",),
)
def check_eq_4_4(ctx) -> Finding:
    rng = ctx.rng("gsp.eq4.4")
    worst = {"printed": 0.0, "j_fix_only": 0.0, "corrected": 0.0}
    gaps = []
    configs = [(4, 2, 3, 3), (6, 2, 5, 4), (6, 3, 8, 6), (10, 2, 8, 4)]
    for n_classes, per, m, e in configs:
        for _ in range(ctx.pick(2, 5)):
            Z, labels, U, mask = _zs_instance(rng, n_classes, per, m, e)
            ce, printed, j_fix, corrected = _zs_losses(Z, labels, U, mask)
            worst["printed"] = max(worst["printed"], abs(printed - ce) / ce)
            worst["j_fix_only"] = max(worst["j_fix_only"], abs(j_fix - ce) / ce)
            worst["corrected"] = max(worst["corrected"], abs(corrected - ce) / ce)
            gaps.append(printed - ce)
    tol = 1e-12
    Z, labels, U, mask = _zs_instance(np.random.default_rng(0), 4, 1, 3, 2)
    ce, printed, j_fix, corrected = _zs_losses(Z, labels, U, mask)
    cex = {"n_classes": 4, "samples_per_class": 1, **jsonable_arrays(Z=Z, labels=labels, class_embeddings=U, half1=mask),
           "cross_entropy": ce, "printed": printed}
    Z, labels, U, mask = _zs_instance(rng)
    ce, printed, _, _ = _zs_losses(Z, labels, U, mask)
    cross = {"zero_shot_loss(scale=1)_vs_CE": abs(refdml_crossbatch.zero_shot_loss(Z, labels, U, ridge=0.05, scale=1.0, split=mask)[0] - ce) / ce,
             "zero_shot_loss_printed_vs_printed": abs(refdml_crossbatch.zero_shot_loss_printed(Z, labels, U, ridge=0.05, split=mask)[0] - printed) / printed}
    return Finding(
        readings=(
            Reading(PRINTED, "(4.4) as printed equals Algorithm 4's cross-entropy", worst["printed"], tol,
                    cex if worst["printed"] > tol else None, trials=len(gaps)),
            Reading(CORRECTION, "j != y_i only and one mean over the batch: "
                    "L_ZS = (1/|b|) sum_{i in b} log(1 + sum_{j != y_i} e^{(v_j - v_yi)^T A z_i}) with A = A_1 on b2, A_2 on b1",
                    worst["corrected"], tol, trials=len(gaps)),
            Reading(CORRECTION, "j != y_i only, keeping the two per-half means", worst["j_fix_only"], tol, trials=len(gaps)),
        ),
        key_number=f"printed - CE in [{min(gaps):.3g}, {max(gaps):.3g}]; corrected {worst['corrected']:.1e}",
        sizes=[{"classes": c, "per_class": p, "m": m, "embedding_dim": e} for c, p, m, e in configs],
        seeds=[ctx.seed],
        details={"max_relative_difference_to_CE": worst,
                 "printed_minus_CE_range": [min(gaps), max(gaps)],
                 "why": "j = y_i adds e^0 = 1 (log(2 + S) vs log(1 + S), a gap in (0, log 2] per sample); "
                        "two per-half means sum to ~2x the batch mean",
                 "refdml.crossbatch": cross},
    )


# --------------------------------------------------------------------------- (P2) -> (P1)


def _transport_cost(cost, sol):
    return float(np.sum(cost * sol.pi))


@claim(
    "gsp.entropic_limit",
    paper="GSP Sec. 4.2 ((P2) as entropy smoothing of (P1))",
    statement="(P2) is the entropy-smoothed (P1): as ε grows (less smoothing) its solution tends to that of (P1).",
    hypotheses="0 < mu < 1, inverse temperature ε -> infinity",
)
def check_entropic_limit(ctx) -> Finding:
    rng = ctx.rng("gsp.entropic_limit")
    inverse_temperature_grid = np.logspace(-1, 4, ctx.pick(11, 21))
    curves, rho_curves, worst, monotone_violations = [], [], 0.0, 0
    lp_vs_pot = 0.0
    instances = [(4, 9, 0.3), (8, 16, 0.5), (16, 49, 0.3)]
    for m, n, mu in instances:
        cost = _cost(rng, m, n)
        lp_value, lp_rho, _ = p1_linprog(cost, mu)
        pot_plan = ot.partial.partial_wasserstein(np.full(n, 1.0 / n), np.full(m, mu), cost.T, m=mu)
        lp_vs_pot = max(lp_vs_pot, abs(float(np.sum(pot_plan * cost.T)) - lp_value))
        gaps, rho_dist = [], []
        for inverse_temperature in inverse_temperature_grid:
            sol = p2_scalar(cost, mu, inverse_temperature)
            gaps.append(_transport_cost(cost, sol) - lp_value)
            rho_dist.append(float(np.sum(np.abs(sol.rho - lp_rho))))
        gaps = np.array(gaps)
        monotone_violations += int(np.sum(np.diff(gaps) > 1e-12))
        worst = max(worst, gaps[-1] / cost.max())
        curves.append(series(f"m={m}, n={n}, mu={mu}", inverse_temperature_grid, np.maximum(gaps / cost.max(), 1e-17)))
        rho_curves.append(series(f"m={m}, n={n}, mu={mu}", inverse_temperature_grid, np.maximum(rho_dist, 1e-17)))
    tol = 1e-3
    error = worst if monotone_violations == 0 else float("inf")
    return Finding(
        readings=(Reading(PRINTED, f"cost(P2) - cost(P1) decreases in ε to <= {tol:g} max(c) "
                                   f"at ε = {inverse_temperature_grid[-1]:g}",
                          error, tol, None if monotone_violations == 0 else {"monotonicity_violations": monotone_violations},
                          trials=len(instances)),),
        key_number=f"(cost(P2) - LP)/max c = {worst:.1e} at inverse temperature {inverse_temperature_grid[-1]:.0e} (monotone)",
        sizes=[{"m": m, "n": n, "mu": mu} for m, n, mu in instances],
        seeds=[ctx.seed],
        details={"LP_linprog_vs_POT_partial_wasserstein": lp_vs_pot,
                 "inverse_temperature_grid": inverse_temperature_grid.tolist(),
                 "monotonicity_violations": monotone_violations},
        figures=(Figure("gsp_entropic_limit", "(P2) approaching (P1): transport-cost gap vs ε",
                        "inverse temperature ε", "(cost(P2) - cost(P1)) / max c", tuple(curves),
                        xscale="log", yscale="log", thresholds=((f"tolerance {tol:g} at the largest ε", tol),)),
                 Figure("gsp_entropic_limit_rho", "(P2) approaching (P1): distance of rho to the LP's rho* vs ε",
                        "inverse temperature ε", "||rho - rho*||_1", tuple(rho_curves),
                        xscale="log", yscale="log")),
    )


@claim(
    "gsp.sec4.2.uniform_limit",
    paper="GSP Sec. 4.2 (text after (P2))",
    statement="When smoothing is high (ε -> 0), the resulting solution is uniform over features, similar to GAP.",
    hypotheses="0 < mu < 1, inverse temperature ε -> 0",
)
def check_uniform_limit(ctx) -> Finding:
    rng = ctx.rng("gsp.sec4.2.uniform_limit")
    inverse_temperature_grid = np.logspace(-8, 1, 10)
    worst_small, curves = 0.0, []
    for m, n, mu in ((4, 9, 0.3), (16, 49, 0.7)):
        cost = _cost(rng, m, n)
        dev = []
        for inverse_temperature in inverse_temperature_grid:
            sol = p2_scalar(cost, mu, inverse_temperature)
            weights = (1.0 / n - sol.rho) / mu
            dev.append(float(np.max(np.abs(weights - 1.0 / n))) * n)
        worst_small = max(worst_small, dev[0])
        curves.append(series(f"m={m}, n={n}, mu={mu}", inverse_temperature_grid, np.maximum(dev, 1e-17)))
    tol = 1e-6
    return Finding(
        readings=(Reading(PRINTED, f"n max|p_j - 1/n| <= {tol:g} at ε = {inverse_temperature_grid[0]:g}",
                          worst_small, tol, trials=2),),
        key_number=f"n max|p - 1/n| = {worst_small:.1e} at inverse temperature 1e-8",
        sizes=[{"m": 4, "n": 9}, {"m": 16, "n": 49}],
        seeds=[ctx.seed],
        details={"why": "ε -> 0: l_j -> log m for all j, so every feature keeps rho_j = (1 - mu)/n"},
        figures=(Figure("gsp_uniform_limit", "(P2) weights vs ε: deviation from GAP's uniform weights",
                        "inverse temperature ε", "n max_j |p_j - 1/n|", tuple(curves),
                        xscale="log", yscale="log", thresholds=((f"tolerance {tol:g} at the smallest ε", tol),)),),
    )


# --------------------------------------------------------------------------- refdml's exact solver


@claim(
    "gsp.exact_solver",
    paper="refdml.gsp.weight_transport(method='exact') (1-D reduction of (P2))",
    statement="refdml's one-dimensional reduction of (P2) equals the fixed point of Prop. 4.2 (at convergence, 1e-10).",
    hypotheses="0 < mu < 1, inverse temperature ε > 0",
    operators=("gsp.weight_transport",),
)
def check_exact_solver(ctx) -> Finding:
    rng = ctx.rng("gsp.exact_solver")
    worst_fp, worst_oracle, trials = 0.0, 0.0, 0
    cases = [(m, n, mu, inverse_temperature) for m, n in ((4, 9), (16, 49), (64, 49)) for mu in (0.1, 0.3, 0.8)
             for inverse_temperature in (0.5, 5.0, 20.0)]
    if ctx.quick:
        cases = cases[::3]
    for m, n, mu, inverse_temperature in cases:
        cost = _cost(rng, m, n)
        ref = p2_scalar(cost, mu, inverse_temperature)
        if _rate(ref, mu) ** 20000 > 1e-14:
            continue  # too slow for the fixed point to reach the fixed point here
        rho_fp, _, pi_fp, _ = prop42_iterate(cost, mu, inverse_temperature, 20000 if _rate(ref, mu) > 0.9 else 3000)
        res = refdml_gsp.weight_transport(cost[None], mu=mu, inverse_temperature=inverse_temperature, method="exact")
        worst_fp = max(worst_fp, n * float(np.max(np.abs(res.rho[0] - rho_fp))), n * float(np.max(np.abs(res.pi[0] - pi_fp))))
        worst_oracle = max(worst_oracle, n * float(np.max(np.abs(res.rho[0] - ref.rho))))
        trials += 1
    tol = 1e-10

    def disagrees(inst):
        cost, mu, inverse_temperature = inst
        res = refdml_gsp.weight_transport(cost[None], mu=mu, inverse_temperature=inverse_temperature, method="exact")
        return cost.shape[1] * float(np.max(np.abs(res.rho[0] - p2_scalar(cost, mu, inverse_temperature).rho))) > tol

    cex = ctx.search(_p2_instance(), disagrees, max_examples=ctx.pick(25, 100))
    return Finding(
        readings=(Reading(PRINTED, "n max|rho_exact - rho_fixed_point| <= 1e-10", max(worst_fp, worst_oracle), tol,
                          None if cex is None else {**jsonable_arrays(cost=cex[0]), "mu": cex[1],
                                                    "inverse_temperature": cex[2]},
                          trials=trials),),
        key_number=f"vs fixed point {worst_fp:.1e}, vs brentq {worst_oracle:.1e}",
        sizes=[{"m": m, "n": n, "mu": mu, "inverse_temperature": inverse_temperature}
               for m, n, mu, inverse_temperature in cases],
        seeds=[ctx.seed],
        details={"max_vs_fixed_point": worst_fp, "max_vs_brentq_oracle": worst_oracle, "instances_compared": trials},
    )
