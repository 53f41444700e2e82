r"""The LP (P1) of GSP, solved exactly by two independent solvers (validation only).

.. math::
    \min_{\rho,\pi\ge 0} \sum_{ij} c_{ij}\pi_{ij}
    \quad\text{s.t.}\quad \rho_j + \sum_i\pi_{ij} = 1/n,\; \sum_{ij}\pi_{ij} = \mu

Shapes: cost ``(B, m, n)``, rho ``(B, n)``, pi ``(B, m, n)``.

The argmin is invariant under a positive scaling of the cost, so each image's cost is
divided by a power of two (exact) that brings its largest magnitude into [0.5, 1)
before the solver sees it: HiGHS and POT then see a well-scaled problem at any scale
(1e-300 .. 1e300), and the objective is evaluated on the cost as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale
from refdml._validation import as_float_array, check_scalar

__all__ = ["P1Result", "solve_p1_linprog", "solve_p1_pot"]


@dataclass(frozen=True)
class P1Result:
    """Solution of the LP (P1) for each image."""

    rho: np.ndarray        # (B, n) residual (discarded) mass
    pi: np.ndarray         # (B, m, n) transport plan
    objective: np.ndarray  # (B,) sum_ij c_ij pi_ij


def check_cost(cost) -> np.ndarray:
    return as_float_array(cost, "cost", ndim=3)


def check_mu(mu) -> float:
    return check_scalar(mu, "mu", low=0.0, high=1.0, low_inclusive=False)


def _p1_linprog_one(cost: np.ndarray, mu: float) -> tuple[np.ndarray, np.ndarray]:
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix, hstack, identity, vstack

    m, n = cost.shape
    # Variables: pi flattened row-major (pi_ij at i * n + j), then rho.
    column_sums = coo_matrix(np.tile(np.eye(n), (1, m)))
    column_rows = hstack([column_sums, identity(n)])
    mass_row = coo_matrix(np.concatenate([np.ones(m * n), np.zeros(n)])[None, :])
    a_eq = vstack([column_rows, mass_row]).tocsr()
    b_eq = np.concatenate([np.full(n, 1.0 / n), [mu]])
    objective = np.concatenate([cost.ravel(), np.zeros(n)])
    solution = linprog(objective, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if solution.status != 0:
        raise RuntimeError(f"linprog failed on (P1): {solution.message}")
    x = np.maximum(solution.x, 0.0)
    return x[m * n:], x[: m * n].reshape(m, n)


def _p1_pot_one(cost: np.ndarray, mu: float) -> tuple[np.ndarray, np.ndarray]:
    import ot

    m, n = cost.shape
    source = np.full(n, 1.0 / n)
    # Capacity mu per prototype never binds: one prototype may take all the mass.
    capacity = np.full(m, mu)
    # n * (1/n) can round below 1; POT rejects a mass above sum(source) by one ulp.
    mass = min(mu, float(source.sum()))
    plan = ot.partial.partial_wasserstein(source, capacity, np.ascontiguousarray(cost.T), m=mass)
    pi = np.asarray(plan, dtype=np.float64).T
    rho = np.maximum(1.0 / n - pi.sum(axis=0), 0.0)
    return rho, pi


def _solve_p1(cost, mu, one) -> P1Result:
    cost = check_cost(cost)
    mu = check_mu(mu)
    # Exact power-of-two rescaling per image: same argmin, a well-scaled LP.
    rhos, pis = zip(*(one(c / common_scale(c), mu) for c in cost))
    pi = np.stack(pis)
    return P1Result(rho=np.stack(rhos), pi=pi, objective=np.sum(cost * pi, axis=(1, 2)))


def solve_p1_linprog(cost, *, mu) -> P1Result:
    r"""Solve the LP (P1) exactly for each image with ``scipy.optimize.linprog`` (HiGHS).

    .. math::
        \min_{\rho,\pi\ge 0} \sum_{ij} c_{ij}\pi_{ij}
        \quad\text{s.t.}\quad \rho_j + \sum_i\pi_{ij} = 1/n,\; \sum_{ij}\pi_{ij} = \mu

    Parameters
    ----------
    cost : array (B, m, n)
        Any finite costs; each image is rescaled by a power of two before HiGHS sees it.
    mu : float in (0, 1]

    Returns
    -------
    P1Result
        ``rho`` (B, n), ``pi`` (B, m, n), ``objective`` (B,). Its optimum moves the
        ``mu`` cheapest features (by ``min_i c_ij``) to their nearest prototype, the
        last one fractionally; ties make the solution non-unique.
    """
    return _solve_p1(cost, mu, _p1_linprog_one)


def solve_p1_pot(cost, *, mu) -> P1Result:
    """Solve (P1) as partial optimal transport with ``ot.partial.partial_wasserstein``.

    Source: the ``n`` features with mass ``1/n`` each; target: the ``m`` prototypes,
    each with capacity ``mu`` (so capacity never binds); transported mass ``mu``. The
    untransported source mass is ``rho``. An independent second solver for (P1)
    (network simplex instead of HiGHS); same arguments, rescaling and result as
    :func:`solve_p1_linprog`.
    """
    return _solve_p1(cost, mu, _p1_pot_one)
