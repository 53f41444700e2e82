"""Independent solvers the checks compare against (none of them is refdml's own code).

* :func:`histogram_lp`: XML (2.1) by ``scipy.optimize.linprog`` (HiGHS).
* :func:`p1_linprog`: GSP (P1) by ``linprog``.
* :func:`p2_scalar`: GSP (P2) by ``scipy.optimize.brentq`` on its one-dimensional dual.
  With ``ε`` the inverse temperature of (P2) (``inverse_temperature``, as in
  :func:`refdml.gsp.weight_transport`), stationarity of the Lagrangian gives
  ``rho_j = exp(-ε u_j - 1)`` and ``pi_ij = t exp(-ε c_ij) rho_j``; the column constraints fix
  ``rho_j = 1 / (n (1 + t s_j))`` with ``s_j = sum_i exp(-ε c_ij)``, and the mass constraint
  leaves one equation in ``tau = log t``: ``(1/n) sum_j sigmoid(tau + l_j) = mu``,
  ``l_j = logsumexp_i(-ε c_ij)``, increasing in ``tau`` with range ``(0, 1)``: one root for
  ``0 < mu < 1``. Then ``pi_ij = (1/n) sigmoid(tau + l_j) softmax_i(-ε c_ij)``, computed in that
  stable form.
* :func:`p2_slsqp`: (P2) by a generic constrained solver (SLSQP) on the primal.
* :func:`prop42_iterate` and :func:`prop42_unrolled_backward`: the iteration of GSP
  Prop. 4.2 exactly as printed, and reverse-mode differentiation through its ``k`` steps
  written out by hand (the "automatic differentiation" of GSP Fig. 9).

Every GSP oracle takes the paper's ε as ``inverse_temperature``: in the rest of refdml ``eps``
is the entropic regularisation of Sinkhorn, a temperature.
* :func:`kr_dual_lp`: ``sup_f E_mu f - E_nu f`` over 1-Lipschitz ``f`` (Kantorovich-Rubinstein
  dual, by ``linprog``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq, linprog, minimize
from scipy.special import expit, logit, logsumexp, softmax

__all__ = [
    "P2Solution",
    "histogram_lp",
    "kr_dual_lp",
    "p1_linprog",
    "p2_scalar",
    "p2_slsqp",
    "prop42_iterate",
    "prop42_unrolled_backward",
    "prop43_gradient",
]


def histogram_lp(V: np.ndarray, X: np.ndarray):
    """XML (2.1): ``max sum_ij <v_i, x_j> pi_ij`` s.t. column sums ``1/n``, row sums ``z``.

    ``V`` (m, d) prototypes, ``X`` (n, d) features. Returns ``(value, pi (m, n), z (m,))``.
    """
    m, n = V.shape[0], X.shape[0]
    score = V @ X.T
    c = np.concatenate([-score.ravel(), np.zeros(m)])
    rows = []
    for j in range(n):  # sum_i pi_ij = 1/n
        row = np.zeros(m * n + m)
        row[j : m * n : n] = 1.0
        rows.append(row)
    for i in range(m):  # sum_j pi_ij - z_i = 0
        row = np.zeros(m * n + m)
        row[i * n : (i + 1) * n] = 1.0
        row[m * n + i] = -1.0
        rows.append(row)
    row = np.zeros(m * n + m)
    row[m * n :] = 1.0
    rows.append(row)
    b = np.concatenate([np.full(n, 1.0 / n), np.zeros(m), [1.0]])
    res = linprog(c, A_eq=np.array(rows), b_eq=b, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog failed on (2.1): {res.message}")
    pi = res.x[: m * n].reshape(m, n)
    return -res.fun, pi, res.x[m * n :]


def p1_linprog(cost: np.ndarray, mu: float):
    """GSP (P1) for one cost map ``(m, n)``: returns ``(value, rho (n,), pi (m, n))``."""
    m, n = cost.shape
    c = np.concatenate([np.zeros(n), cost.ravel()])
    rows = []
    for j in range(n):  # rho_j + sum_i pi_ij = 1/n
        row = np.zeros(n + m * n)
        row[j] = 1.0
        row[n + j :: n] = 1.0
        rows.append(row)
    row = np.zeros(n + m * n)
    row[n:] = 1.0
    rows.append(row)
    b = np.concatenate([np.full(n, 1.0 / n), [mu]])
    res = linprog(c, A_eq=np.array(rows), b_eq=b, bounds=(0, None), method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog failed on (P1): {res.message}")
    return res.fun, res.x[:n], res.x[n:].reshape(m, n)


@dataclass(frozen=True)
class P2Solution:
    rho: np.ndarray  # (n,)
    pi: np.ndarray  # (m, n)
    tau: float  # log t


def p2_scalar(cost: np.ndarray, mu: float, inverse_temperature: float) -> P2Solution:
    """GSP (P2) for one cost map ``(m, n)`` and ``0 < mu < 1`` via its scalar dual."""
    n = cost.shape[1]
    scores = -inverse_temperature * cost
    lse = logsumexp(scores, axis=0)  # l_j
    target = logit(mu)

    def excess(tau: float) -> float:
        return float(np.mean(expit(tau + lse)) - mu)

    lo, hi = target - lse.max() - 1.0, target - lse.min() + 1.0
    tau = brentq(excess, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps, maxiter=500)
    share = expit(tau + lse)  # n * sum_i pi_ij
    pi = share[None, :] * softmax(scores, axis=0) / n
    rho = expit(-(tau + lse)) / n
    return P2Solution(rho=rho, pi=pi, tau=tau)


def p2_slsqp(cost: np.ndarray, mu: float, inverse_temperature: float):
    """GSP (P2) by SLSQP on the primal (tiny instances only). Returns ``(rho, pi)``."""
    m, n = cost.shape
    cbar = np.concatenate([np.zeros(n), cost.ravel()])
    A = np.zeros((n + 1, n + m * n))
    for j in range(n):
        A[j, j] = 1.0
        A[j, n + j :: n] = 1.0
    A[n, n:] = 1.0
    b = np.concatenate([np.full(n, 1.0 / n), [mu]])

    def objective(x):
        return float(cbar @ x + np.sum(x * np.log(x)) / inverse_temperature)

    def gradient(x):
        return cbar + (np.log(x) + 1.0) / inverse_temperature

    x0 = np.concatenate([np.full(n, (1 - mu) / n), np.full(m * n, mu / (m * n))])
    res = minimize(
        objective, x0, jac=gradient, method="SLSQP",
        bounds=[(1e-300, None)] * x0.size,
        constraints=[{"type": "eq", "fun": lambda x: A @ x - b, "jac": lambda x: A}],
        options={"ftol": 1e-16, "maxiter": 2000},
    )
    return res.x[:n], res.x[n:].reshape(m, n)


def prop42_iterate(cost: np.ndarray, mu: float, inverse_temperature: float, k: int, *, reference=None):
    """``k`` steps of GSP Prop. 4.2 as printed, from ``t = 1``.

    Returns ``(rho, t, pi, errors)`` where ``errors[i]`` is ``n * max_j |rho^(i+1)_j - ref_j|``
    when a reference ``rho`` is given (else an empty array).
    """
    kappa = np.exp(-inverse_temperature * cost)
    n = cost.shape[1]
    t = 1.0
    errors = []
    rho = None
    for _ in range(k):
        rho = 1.0 / (n * (1.0 + t * kappa.sum(axis=0)))
        t = mu / np.sum(kappa @ rho)
        if reference is not None:
            errors.append(n * np.max(np.abs(rho - reference)))
    pi = t * kappa * rho[None, :]
    return rho, t, pi, np.array(errors)


def prop42_unrolled_backward(cost, mu, inverse_temperature, k, d_rho, d_pi):
    """Gradient w.r.t. ``cost`` of ``<d_rho, rho^(k)> + <d_pi, pi^(k)>``, by reverse mode.

    The forward is the printed iteration (each step recomputes ``kappa^T 1`` and
    ``kappa rho`` as an autodiff graph would); every intermediate is kept, so time and
    memory grow linearly with ``k``.
    """
    kappa = np.exp(-inverse_temperature * cost)
    n = cost.shape[1]
    ts = [1.0]
    rhos, colsums, masses = [], [], []
    for _ in range(k):
        u = kappa.sum(axis=0)
        rho = 1.0 / (n * (1.0 + ts[-1] * u))
        v = kappa @ rho
        colsums.append(u)
        rhos.append(rho)
        masses.append(v.sum())
        ts.append(mu / masses[-1])
    t, rho = ts[-1], rhos[-1]
    d_kappa = d_pi * t * rho[None, :]
    d_t = float(np.sum(d_pi * kappa * rho[None, :]))
    d_rho_k = d_rho + t * np.sum(d_pi * kappa, axis=0)
    for step in range(k - 1, -1, -1):
        rho, u, mass, t_prev = rhos[step], colsums[step], masses[step], ts[step]
        # t_{step+1} = mu / sum(kappa rho): back to kappa and rho
        d_mass = -d_t * mu / mass**2
        d_kappa += d_mass * rho[None, :]
        d_rho_k = d_rho_k + d_mass * kappa.sum(axis=0)
        # rho = 1 / (n (1 + t_prev u)): back to t_prev and u
        d_inner = -d_rho_k * n * rho**2
        d_t = float(np.sum(d_inner * u))
        d_kappa += (d_inner * t_prev)[None, :]
        d_rho_k = np.zeros_like(rho)
    return -inverse_temperature * kappa * d_kappa


READINGS_43 = {
    "a": "literal: -ε(pi*dpi - n [pi Diag(q - eta/k) rho] 1_n^T), the m-vector broadcast over columns",
    "b": "-ε(pi*dpi - n pi Diag(q - (eta/k) rho)), rho inside Diag and multiplied by eta/k",
    "c": "-ε(pi*dpi - n pi Diag(q - eta/k) Diag(rho))",
}


def prop43_gradient(rho, pi, d_rho, d_pi, mu, inverse_temperature, reading: str) -> np.ndarray:
    """GSP Eq. (4.2) under one of the readings in :data:`READINGS_43`."""
    n = rho.shape[0]
    q = rho * d_rho + np.sum(pi * d_pi, axis=0)
    eta = np.sum(rho * d_rho) - n * q @ rho
    kk = 1.0 - mu - n * rho @ rho
    if reading == "a":
        column = pi @ ((q - eta / kk) * rho)
        return -inverse_temperature * (pi * d_pi - n * column[:, None])
    if reading == "b":
        return -inverse_temperature * (pi * d_pi - n * pi * (q - eta / kk * rho)[None, :])
    if reading == "c":
        return -inverse_temperature * (pi * d_pi - n * pi * ((q - eta / kk) * rho)[None, :])
    raise ValueError(f"reading == {reading!r}, must be one of {sorted(READINGS_43)}")


def kr_dual_lp(xs: np.ndarray, a: np.ndarray, ys: np.ndarray, b: np.ndarray) -> float:
    """``sup { sum_i a_i f(x_i) - sum_j b_j f(y_j) : f 1-Lipschitz }`` on the two supports."""
    points = np.concatenate([xs, ys])
    weights = np.concatenate([a, -b])
    N = points.shape[0]
    dist = np.linalg.norm(points[:, None, :] - points[None, :, :], axis=-1)
    rows, rhs = [], []
    for p in range(N):
        for r in range(N):
            if p != r:
                row = np.zeros(N)
                row[p], row[r] = 1.0, -1.0
                rows.append(row)
                rhs.append(dist[p, r])
    bound = float(dist.max()) + 1.0
    res = linprog(-weights, A_ub=np.array(rows), b_ub=np.array(rhs),
                  bounds=[(-bound, bound)] * N, method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog failed on the Kantorovich-Rubinstein dual: {res.message}")
    return -res.fun
