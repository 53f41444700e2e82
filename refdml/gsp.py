r"""Generalized Sum Pooling (GSP): cost map, the transport problems (P1)/(P2), the pooling layer.

Shapes: ``B`` images, ``n`` features per image, ``m`` prototypes, ``d`` channels.
features ``(B, n, d)``, prototypes ``(m, d)``, cost ``(B, m, n)``, rho ``(B, n)``,
pi ``(B, m, n)``.

Operators
---------
``cost_map_forward`` / ``cost_map_backward`` (GSP Alg. 2)
    ``c_ij = || wbar_i - fbar_j ||`` with ``ubar = u / max(1, ||u||)``.
``solve_p1_linprog`` / ``solve_p1_pot`` (GSP (P1))
    The LP, exactly, with HiGHS and as a partial optimal-transport problem in POT.
``weight_transport`` / ``weight_transport_backward`` / ``weight_transport_backward_unrolled``
    (GSP (P2), Prop. 4.2, Prop. 4.3) The entropic problem

    .. math::
        \min_{\rho, \pi \ge 0} \sum_{ij} c_{ij}\pi_{ij}
            + \tfrac{1}{\varepsilon}\Big(\sum_{ij}\pi_{ij}\log\pi_{ij} + \sum_j \rho_j\log\rho_j\Big)
        \quad\text{s.t.}\quad \rho_j + \textstyle\sum_i \pi_{ij} = 1/n,\;
        \textstyle\sum_{ij}\pi_{ij} = \mu .

``gsp_pool_forward`` / ``gsp_pool_backward`` (GSP Alg. 2, Eqs. 4.1, 4.3)
    pooled feature and attribute histogram ``z``.

Log-domain reduction (derived in docs/gsp.md)
---------------------------------------------
Stationarity of (P2) gives ``pi_ij = t exp(-eps c_ij) rho_j``. With
``l_j = log s_j = logsumexp_i(-eps c_ij)``, ``tau = log t`` and ``sigma`` the logistic
function, the column constraint gives ``rho_j = (1/n) sigma(-(tau + l_j))`` and

    pi_ij = (1/n) sigma(tau + l_j) softmax_i(-eps c_.j),

and the mass constraint becomes one monotone scalar equation per image,

    g(tau) = (1/n) sum_j sigma(tau + l_j) = mu.

Prop. 4.2's iteration is, in these variables, ``tau <- tau + log mu - log g(tau)``
(from ``tau_0 = 0``, i.e. ``t^(0) = 1``); it contracts with rate
``r = (n/mu) sum_j (sum_i pi_ij)^2 < 1`` at the fixed point, close to 1 when the
transported mass sits on few features (large eps) or mu -> 1. ``method="exact"``
solves ``g(tau) = mu`` by safeguarded Newton instead. Nothing forms ``exp(-eps c)``,
so eps = 200 or float32 inputs neither underflow nor produce NaN.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, log_expit, logsumexp

from refdml._validation import (
    as_float_array,
    check_choice,
    check_features_prototypes,
    check_scalar,
)
from refdml.distances import EuclideanContext, _euclidean_backward, _euclidean_forward
from refdml.exceptions import ConvergenceWarning
from refdml.gradcheck.registry import OperatorSpec, register
from refdml.normalize import ClipNormalizeContext, _clip_backward, _clip_forward

__all__ = [
    "CostMapContext",
    "CostMapGrads",
    "P1Result",
    "PoolContext",
    "PoolGrads",
    "WeightTransportGrads",
    "WeightTransportResult",
    "cost_map",
    "cost_map_backward",
    "cost_map_forward",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
    "solve_p1_linprog",
    "solve_p1_pot",
    "weight_transport",
    "weight_transport_backward",
    "weight_transport_backward_unrolled",
]

_METHODS = ("exact", "fixed_point")
_BACKWARDS = ("closed_form", "unrolled")
_ULP = np.finfo(np.float64).eps


# --------------------------------------------------------------------------- cost map


@dataclass(frozen=True)
class CostMapGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d), summed over the batch


@dataclass(frozen=True)
class CostMapContext:
    features: ClipNormalizeContext
    prototypes: ClipNormalizeContext
    distance: EuclideanContext


def _cost_map_forward(features, prototypes) -> tuple[np.ndarray, CostMapContext]:
    features_bar, features_ctx = _clip_forward(features)
    prototypes_bar, prototypes_ctx = _clip_forward(prototypes)
    # (m, d) against (B, n, d) broadcasts to (B, m, n).
    cost, distance_ctx = _euclidean_forward(prototypes_bar, features_bar)
    return cost, CostMapContext(features_ctx, prototypes_ctx, distance_ctx)


def _cost_map_backward(ctx: CostMapContext, d_cost: np.ndarray) -> CostMapGrads:
    grads = _euclidean_backward(ctx.distance, d_cost)
    return CostMapGrads(
        features=_clip_backward(ctx.features, grads.y),
        prototypes=_clip_backward(ctx.prototypes, grads.x),
    )


def cost_map_forward(features, prototypes) -> tuple[np.ndarray, CostMapContext]:
    """GSP cost map ``c[b, i, j] = || wbar_i - fbar_{b,j} ||`` (Alg. 2); returns ``(cost, ctx)``.

    Parameters
    ----------
    features : array (B, n, d)
    prototypes : array (m, d)

    Returns
    -------
    cost : ndarray (B, m, n)
    ctx : CostMapContext

    Notes
    -----
    Both sets are first mapped into the unit ball, ``u -> u / max(1, ||u||)``.
    Two kinks, with the subgradients the backward uses (never NaN):
    ``c_ij = 0`` (a prototype on a feature): the subgradient 0 of the norm;
    ``||u|| = 1`` exactly: the identity branch of the normalisation.
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    return _cost_map_forward(features, prototypes)


def cost_map_backward(ctx: CostMapContext, d_cost) -> CostMapGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d, summed over the batch)."""
    d_cost = np.asarray(d_cost, dtype=np.float64)
    if d_cost.shape != ctx.distance.distance.shape:
        raise ValueError(
            f"d_cost has shape {d_cost.shape}, expected {ctx.distance.distance.shape}"
        )
    return _cost_map_backward(ctx, d_cost)


def cost_map(features, prototypes) -> np.ndarray:
    """The GSP cost map (no context kept)."""
    return cost_map_forward(features, prototypes)[0]


# --------------------------------------------------------------------------- (P1), the LP


@dataclass(frozen=True)
class P1Result:
    """Solution of the LP (P1) for each image."""

    rho: np.ndarray        # (B, n) residual (discarded) mass
    pi: np.ndarray         # (B, m, n) transport plan
    objective: np.ndarray  # (B,) sum_ij c_ij pi_ij


def _check_cost(cost) -> np.ndarray:
    cost = as_float_array(cost, "cost", ndim=3)
    return cost


def _check_mu(mu) -> float:
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
    cost = _check_cost(cost)
    mu = _check_mu(mu)
    rhos, pis = zip(*(one(c, mu) for c in cost))
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
    (network simplex instead of HiGHS); same arguments and result as
    :func:`solve_p1_linprog`.
    """
    return _solve_p1(cost, mu, _p1_pot_one)


# --------------------------------------------------------------------------- (P2)


@dataclass(frozen=True)
class WeightTransportResult:
    """Solution of the entropic problem (P2) for each image.

    Attributes
    ----------
    rho : (B, n)
        Residual mass ``rho_j``.
    pi : (B, m, n)
        Transport plan.
    t, log_t : (B,)
        The scaling ``t`` of Prop. 4.2 and ``tau = log t``. ``t`` is ``inf`` where
        ``exp(tau)`` overflows (very large eps) and at ``mu = 1``; ``log_t`` is exact.
    n_iter : int
        Newton/bisection steps (``exact``, maximum over images) or fixed-point
        iterations (``fixed_point``, shared by all images); 0 at ``mu = 1``.
    residual : (B,)
        ``max(max_j |rho_j + sum_i pi_ij - 1/n|, |sum_ij pi_ij - mu|)``, from the arrays.
    converged : bool
        ``residual <= tol`` for every image.
    method, mu, eps : the arguments used.
    transported : (B, n)
        ``1 - n rho_j`` (the fraction of feature ``j`` that is transported), computed
        without the cancellation of ``1 - n * rho``.
    log_s : (B, n)
        ``l_j = logsumexp_i(-eps c_ij)``.
    assignment : (B, m, n)
        ``softmax_i(-eps c_ij)``, so that ``pi_ij = (sum_k pi_kj) assignment_ij``.
    tau_history : (B, k + 1) or None
        ``tau_0 = 0, ..., tau_k`` of the fixed-point iteration (``fixed_point`` only,
        ``None`` at ``mu = 1``): all the unrolled backward needs, memory O(k).
    """

    rho: np.ndarray
    pi: np.ndarray
    t: np.ndarray
    log_t: np.ndarray
    n_iter: int
    residual: np.ndarray
    converged: bool
    method: str
    mu: float
    eps: float
    transported: np.ndarray
    log_s: np.ndarray
    assignment: np.ndarray
    tau_history: np.ndarray | None = None

    @property
    def contraction_rate(self) -> np.ndarray:
        """``r = (n / mu) sum_j (sum_i pi_ij)^2`` per image (B,).

        At the solution this is the derivative of Prop. 4.2's map ``tau -> tau'``: the
        fixed-point error shrinks by ``r`` per iteration asymptotically.
        """
        n = self.rho.shape[1]
        return (n / self.mu) * np.sum(self.pi.sum(axis=1) ** 2, axis=1)


@dataclass(frozen=True)
class WeightTransportGrads:
    cost: np.ndarray  # (B, m, n)


def _log_kernel(cost: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``l_j = logsumexp_i(-eps c_ij)`` (B, n) and ``softmax_i(-eps c_ij)`` (B, m, n)."""
    scaled = -eps * cost
    log_s = logsumexp(scaled, axis=1)
    return log_s, np.exp(scaled - log_s[:, None, :])


def _log_g(tau: np.ndarray, log_s: np.ndarray) -> np.ndarray:
    """``log g(tau) = log((1/n) sum_j sigma(tau + l_j))``, per image."""
    return logsumexp(log_expit(tau[:, None] + log_s), axis=1) - np.log(log_s.shape[1])


def _solve_tau_exact(log_s: np.ndarray, mu: float, max_iter: int) -> tuple[np.ndarray, int]:
    """Root of ``g(tau) = mu`` per image by safeguarded Newton in logit space.

    Newton runs on ``phi(tau) = logit(g(tau)) - logit(mu)``, which is exactly linear
    when all ``l_j`` are equal (one step) and stays close to linear otherwise. The
    bracket ``[logit(mu) - max l, logit(mu) - min l]`` holds the root (every sigmoid
    is <= mu at the left end, >= mu at the right); a step that leaves it is replaced
    by bisection. Stops when ``|phi|`` reaches its rounding floor (g = mu to machine
    precision) or the step or the bracket is below a few ulps of tau.
    """
    n = log_s.shape[1]
    logit_mu = np.log(mu) - np.log1p(-mu)
    lo = logit_mu - log_s.max(axis=1)
    hi = logit_mu - log_s.min(axis=1)
    tau = logit_mu - log_s.mean(axis=1)
    active = hi - lo > 4.0 * _ULP * np.maximum(1.0, np.abs(tau))
    tau = np.where(active, tau, lo)
    phi_floor = 16.0 * _ULP * (1.0 + abs(logit_mu))
    n_iter = 0
    while np.any(active) and n_iter < max_iter:
        n_iter += 1
        idx = np.flatnonzero(active)
        t, l = tau[idx], log_s[idx]
        x = t[:, None] + l
        log_sig, log_one_minus = log_expit(x), log_expit(-x)
        log_g = logsumexp(log_sig, axis=1)
        log_one_minus_g = logsumexp(log_one_minus, axis=1)
        phi = log_g - log_one_minus_g - logit_mu
        # phi' = g' / (g (1 - g)) = n sum sigma(1-sigma) / (sum sigma * sum (1-sigma))
        log_slope = (
            np.log(n) + logsumexp(log_sig + log_one_minus, axis=1) - log_g - log_one_minus_g
        )
        lo_i = np.where(phi < 0.0, t, lo[idx])
        hi_i = np.where(phi > 0.0, t, hi[idx])
        # A flat phi (saturated sigmoids) would give a step beyond any bracket; cap
        # the exponent so it stays finite and is replaced by bisection below.
        step = -phi * np.exp(np.minimum(-log_slope, 700.0))
        newton = t + step
        # A step below rounding is convergence, even if it grazes a bracket end that
        # rounding noise in phi has just moved there.
        scale = 4.0 * _ULP * np.maximum(1.0, np.abs(t))
        small = np.abs(step) <= scale
        inside = (newton > lo_i) & (newton < hi_i)
        new = np.where(small | inside, newton, 0.5 * (lo_i + hi_i))
        # phi at its rounding floor: g = mu to machine precision. On a plateau of g
        # (large eps) tau is ill-determined there, but rho and pi are not.
        level = np.abs(phi) <= phi_floor
        done = level | small | (hi_i - lo_i <= scale)
        tau[idx] = np.where(level, t, new)
        lo[idx], hi[idx] = lo_i, hi_i
        active[idx[done]] = False
    return tau, n_iter


def _fixed_point_taus(
    log_s: np.ndarray, mu: float, max_iter: int, tol: float
) -> np.ndarray:
    """Prop. 4.2 in the log domain: ``tau_k = tau_{k-1} + log mu - log g(tau_{k-1})``.

    Returns the history ``(B, k + 1)`` from ``tau_0 = 0`` (``t^(0) = 1``). With
    ``tol > 0`` it stops at the first k where every image's column residual
    ``max_j |rho_j + sum_i pi_ij - 1/n|`` is <= tol (the mass constraint holds exactly
    after each t-update).
    """
    n = log_s.shape[1]
    log_mu = np.log(mu)
    tau = np.zeros(log_s.shape[0])
    history = [tau]
    for _ in range(max_iter):
        new = tau + log_mu - _log_g(tau, log_s)
        history.append(new)
        if tol > 0.0:
            log_sig = log_expit(tau[:, None] + log_s)
            column_mass = np.exp((new - tau)[:, None] + log_sig) / n
            column_residual = np.max(np.abs(column_mass - np.exp(log_sig) / n), axis=1)
            if np.all(column_residual <= tol):
                break
        tau = new
    return np.stack(history, axis=1)


def _assemble(log_s, assignment, tau_prev, tau) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rho = (1/n) sigma(-(tau_prev + l))``, ``pi = exp(tau - tau_prev) (1/n) sigma(tau_prev + l) A``.

    For the exact solution ``tau_prev = tau``. For the k-th fixed-point iterate
    ``tau_prev = tau_{k-1}``: ``rho^(k)`` comes from ``t^(k-1)`` and ``pi^(k)`` from
    ``t^(k)`` as in Prop. 4.2.
    """
    n = log_s.shape[1]
    x = tau_prev[:, None] + log_s
    transported = expit(x)
    rho = expit(-x) / n
    column_mass = np.exp((tau - tau_prev)[:, None] + log_expit(x)) / n
    return rho, column_mass[:, None, :] * assignment, transported


def _residual(rho: np.ndarray, pi: np.ndarray, mu: float) -> np.ndarray:
    n = rho.shape[1]
    column = np.max(np.abs(rho + pi.sum(axis=1) - 1.0 / n), axis=1)
    mass = np.abs(pi.sum(axis=(1, 2)) - mu)
    return np.maximum(column, mass)


def _weight_transport(cost, mu, eps, method, max_iter, tol) -> WeightTransportResult:
    batch, m, n = cost.shape
    log_s, assignment = _log_kernel(cost, eps)
    common = dict(method=method, mu=mu, eps=eps, log_s=log_s, assignment=assignment)
    if mu == 1.0:
        # Thm 4.1's boundary: the root of g(tau) = 1 is tau = +inf, so rho = 0 and
        # every feature sends all of its 1/n to the prototypes by softmax.
        rho = np.zeros((batch, n))
        pi = assignment / n
        return WeightTransportResult(
            rho=rho, pi=pi, t=np.full(batch, np.inf), log_t=np.full(batch, np.inf),
            n_iter=0, residual=_residual(rho, pi, mu), converged=True,
            transported=np.ones((batch, n)), tau_history=None, **common,
        )
    if method == "exact":
        tau, n_iter = _solve_tau_exact(log_s, mu, max_iter)
        tau_prev, history = tau, None
    else:
        history = _fixed_point_taus(log_s, mu, max_iter, tol)
        tau_prev, tau, n_iter = history[:, -2], history[:, -1], history.shape[1] - 1
    rho, pi, transported = _assemble(log_s, assignment, tau_prev, tau)
    residual = _residual(rho, pi, mu)
    converged = bool(np.all(residual <= tol))
    if not converged:
        warnings.warn(
            f"weight_transport(method={method!r}) stopped after {n_iter} iterations with "
            f"residual {float(residual.max()):.3e} > tol={tol:g}",
            ConvergenceWarning,
            stacklevel=3,
        )
    with np.errstate(over="ignore"):
        t = np.exp(tau)
    return WeightTransportResult(
        rho=rho, pi=pi, t=t, log_t=tau, n_iter=int(n_iter), residual=residual,
        converged=converged, transported=transported, tau_history=history, **common,
    )


def _check_transport_args(mu, eps, method, max_iter, tol):
    mu = _check_mu(mu)
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    method = check_choice(method, "method", _METHODS)
    max_iter = check_scalar(max_iter, "max_iter", low=1, integer=True)
    tol = check_scalar(tol, "tol", low=0.0)
    return mu, eps, method, max_iter, tol


def weight_transport(
    cost, *, mu, eps, method="exact", max_iter=100, tol=1e-12
) -> WeightTransportResult:
    r"""Solve the entropic GSP problem (P2) for each image (Prop. 4.2, Alg. 3).

    .. math::
        \min_{\rho,\pi\ge 0} \sum_{ij} c_{ij}\pi_{ij}
        + \tfrac{1}{\varepsilon}\Big(\sum_{ij}\pi_{ij}\log\pi_{ij} + \sum_j\rho_j\log\rho_j\Big)
        \quad\text{s.t.}\quad \rho_j + \sum_i\pi_{ij} = 1/n,\; \sum_{ij}\pi_{ij} = \mu

    Parameters
    ----------
    cost : array (B, m, n)
        Finite costs; float32 is accepted and computed in float64.
    mu : float in (0, 1]
        Transported mass.
    eps : float > 0
        Inverse entropic weight (the paper's epsilon; larger = closer to the LP).
    method : {"exact", "fixed_point"}
        ``"exact"`` (default): solves ``g(tau) = (1/n) sum_j sigmoid(tau + l_j) = mu``
        per image by safeguarded Newton to machine precision (``max_iter`` caps the
        steps; a handful suffice). ``"fixed_point"``: Prop. 4.2 as printed, from
        ``t^(0) = 1``, in the log domain (same iterates); up to ``max_iter`` iterations,
        stopping early once the residual is <= ``tol`` (``tol=0``: exactly
        ``max_iter`` iterations).
    max_iter : int >= 1
    tol : float >= 0
        Residual below which the result counts as converged. Otherwise a
        :class:`refdml.ConvergenceWarning` is emitted and ``converged=False``.

    Returns
    -------
    WeightTransportResult

    Notes
    -----
    Everything is computed from ``l_j = logsumexp_i(-eps c_ij)`` and
    ``softmax_i(-eps c_.j)``: ``rho_j = (1/n) sigmoid(-(tau + l_j))`` and
    ``pi_ij = (1/n) sigmoid(tau + l_j) softmax_i(-eps c_ij)`` (docs/gsp.md).

    ``mu = 1`` (Thm 4.1) is handled explicitly for both methods: ``tau = t = inf``,
    ``rho = 0``, ``pi_ij = (1/n) softmax_i(-eps c_ij)``, ``n_iter = 0``,
    ``converged = True``. (Prop. 4.2's iteration only approaches this limit.)
    """
    cost = _check_cost(cost)
    mu, eps, method, max_iter, tol = _check_transport_args(mu, eps, method, max_iter, tol)
    return _weight_transport(cost, mu, eps, method, max_iter, tol)


def _check_upstream(result: WeightTransportResult, d_rho, d_pi):
    d_rho = np.zeros_like(result.rho) if d_rho is None else np.asarray(d_rho, dtype=np.float64)
    d_pi = np.zeros_like(result.pi) if d_pi is None else np.asarray(d_pi, dtype=np.float64)
    if d_rho.shape != result.rho.shape:
        raise ValueError(f"d_rho has shape {d_rho.shape}, expected {result.rho.shape}")
    if d_pi.shape != result.pi.shape:
        raise ValueError(f"d_pi has shape {d_pi.shape}, expected {result.pi.shape}")
    return d_rho, d_pi


def _weight_transport_backward(result, d_rho, d_pi) -> np.ndarray:
    n = result.rho.shape[1]
    rho, pi, sig = result.rho, result.pi, result.transported
    weighted = pi * d_pi
    q = rho * d_rho + weighted.sum(axis=1)
    # kappa = 1 - mu - n rho^T rho and eta = sum(rho d_rho) - n q^T rho, rewritten with
    # 1 - n rho_j = sig_j (equal on the constraint set) so that neither cancels as
    # mu -> 1 (rho -> 0) or mu -> 0 (n rho -> 1).
    kappa = np.sum(rho * sig, axis=1)
    eta = np.sum(rho * (sig * d_rho - n * weighted.sum(axis=1)), axis=1)
    # eta / kappa is a weighted mean of bounded terms (docs/gsp.md); kappa = 0 only at
    # mu = 1, where rho = 0 and the term vanishes.
    ratio = np.divide(eta, kappa, out=np.zeros_like(eta), where=kappa > 0.0)
    inner = q - ratio[:, None] * rho
    return -result.eps * (weighted - n * pi * inner[:, None, :])


def weight_transport_backward(result: WeightTransportResult, d_rho, d_pi) -> WeightTransportGrads:
    r"""Gradient of the loss with respect to the cost, Prop. 4.3 (closed form, no inverse).

    With ``q = rho * d_rho + (pi * d_pi)^T 1_m``, ``eta = sum(rho * d_rho) - n q^T rho`` and
    ``kappa = 1 - mu - n rho^T rho``:

    .. math::
        \partial L / \partial c = -\varepsilon\Big(\pi\odot \partial_\pi L
            - n\,\pi\,\mathrm{Diag}\big(q - \tfrac{\eta}{\kappa}\rho\big)\Big)

    i.e. ``d_cost_ij = -eps (pi_ij d_pi_ij - n pi_ij (q_j - (eta / kappa) rho_j))``.

    Paper vs this implementation: the printed (4.2) reads
    ``n pi Diag(q - eta / (1 - mu - n rho^T rho)) rho``, which would make the bracket a
    vector times ``rho``. Deriving it from App. A.3 (block inverse of ``H``), or from
    the implicit function theorem on ``g(tau) = mu`` (docs/gsp.md), puts ``rho`` inside
    the Diag, multiplied by ``eta / kappa``; finite differences confirm this reading.

    ``kappa`` and ``eta`` are evaluated as ``sum_j rho_j (1 - n rho_j)`` and
    ``sum_j rho_j ((1 - n rho_j) d_rho_j - n (pi^T d_pi)_j)`` with ``1 - n rho_j`` taken
    from ``result.transported`` (identical on the constraint set), so no cancellation
    occurs as mu -> 1, where both go to 0 while ``eta / kappa`` stays bounded. At
    ``mu = 1`` exactly (``rho = 0``), the result is the softmax gradient
    ``-eps (pi * d_pi - n pi * q)``. Either of ``d_rho``, ``d_pi`` may be ``None`` (zero).
    Applied to a non-converged fixed-point result, this is the paper's practice
    (implicit gradient at an approximate solution); it is exact only at the solution.
    """
    d_rho, d_pi = _check_upstream(result, d_rho, d_pi)
    return WeightTransportGrads(cost=_weight_transport_backward(result, d_rho, d_pi))


def _weight_transport_backward_unrolled(result, d_rho, d_pi) -> np.ndarray:
    n = result.rho.shape[1]
    eps, log_s, assignment, history = result.eps, result.log_s, result.assignment, result.tau_history
    pi = result.pi
    # pi_ij = P_j A_ij with P_j = exp(tau_k - tau_{k-1}) sigma(x_j) / n, x = tau_{k-1} + l;
    # rho_j = (1 - sigma(x_j)) / n.
    d_column = np.sum(assignment * d_pi, axis=1)
    d_cost = -eps * pi * (d_pi - d_column[:, None, :])  # through softmax_i(-eps c)
    column_mass = pi.sum(axis=1)
    sig = result.transported
    d_x = d_column * column_mass * (1.0 - sig) - d_rho * sig * (1.0 - sig) / n
    d_log_s = d_x.copy()
    d_delta = np.sum(d_column * column_mass, axis=1)
    d_tau = d_delta                                # adjoint of tau_k
    d_tau_prev = np.sum(d_x, axis=1) - d_delta     # adjoint of tau_{k-1}, partial
    k = history.shape[1] - 1
    for s in range(k, 0, -1):
        # tau_s = tau_{s-1} + log mu - log g(tau_{s-1}; l):
        #   d tau_s / d l_j       = -sigma_j (1 - sigma_j) / sum sigma
        #   d tau_s / d tau_{s-1} = 1 - sum_j sigma_j (1 - sigma_j) / sum sigma
        x = history[:, s - 1, None] + log_s
        log_sig, log_one_minus = log_expit(x), log_expit(-x)
        weight = np.exp(log_sig + log_one_minus - logsumexp(log_sig, axis=1, keepdims=True))
        d_log_s -= d_tau[:, None] * weight
        d_prev = d_tau * (1.0 - weight.sum(axis=1))
        if s == k:
            d_prev = d_prev + d_tau_prev
        d_tau = d_prev
    return d_cost - eps * assignment * d_log_s[:, None, :]


def weight_transport_backward_unrolled(
    result: WeightTransportResult, d_rho, d_pi
) -> WeightTransportGrads:
    """Exact gradient of the k-step fixed-point iterate (reverse pass through Prop. 4.2).

    ``result`` must come from ``weight_transport(..., method="fixed_point")``; the
    gradient is that of the ``k = result.n_iter`` step map ``cost -> (rho^(k), pi^(k))``
    (for an early-stopped run, of the map with that k). Only ``tau_0..tau_k`` are stored
    (memory O(k) per image); each ``sigma(tau_{s-1} + l)`` is recomputed from them. As k
    grows the result approaches :func:`weight_transport_backward` (at rate ``r^k``,
    ``r`` = :attr:`WeightTransportResult.contraction_rate`). At ``mu = 1`` the result is
    the limit, so this returns the closed-form (softmax) gradient.
    """
    if result.method != "fixed_point":
        raise ValueError(
            f"result.method == {result.method!r}; the unrolled backward needs a result of "
            "method='fixed_point'"
        )
    d_rho, d_pi = _check_upstream(result, d_rho, d_pi)
    if result.tau_history is None:
        return WeightTransportGrads(cost=_weight_transport_backward(result, d_rho, d_pi))
    return WeightTransportGrads(cost=_weight_transport_backward_unrolled(result, d_rho, d_pi))


# --------------------------------------------------------------------------- pooling layer


@dataclass(frozen=True)
class PoolGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d)


@dataclass(frozen=True)
class PoolContext:
    features: np.ndarray   # (B, n, d), raw
    weights: np.ndarray    # (B, n), (1 - n rho) / mu
    pooled: np.ndarray     # (B, d)
    p: float
    cost: CostMapContext
    transport: WeightTransportResult


def _gsp_pool_forward(features, prototypes, mu, eps, p, method, max_iter, tol):
    cost, cost_ctx = _cost_map_forward(features, prototypes)
    result = _weight_transport(cost, mu, eps, method, max_iter, tol)
    weights = result.transported / mu
    weighted = weights[:, :, None] * features
    if p == 1.0:
        pooled = weighted.mean(axis=1)
    else:
        pooled = np.mean(weighted**p, axis=1) ** (1.0 / p)
    z = result.pi.sum(axis=2) / mu
    ctx = PoolContext(features, weights, pooled, p, cost_ctx, result)
    return (pooled, z), ctx


def _gsp_pool_backward(ctx: PoolContext, d_pooled, d_z, backward) -> PoolGrads:
    features, weights, result = ctx.features, ctx.weights, ctx.transport
    n = features.shape[1]
    mu = result.mu
    if ctx.p == 1.0:
        d_weighted = np.broadcast_to(d_pooled[:, None, :] / n, features.shape)
    else:
        # d pooled_c / d x_jc = (1/n) (x_jc / pooled_c)^(p-1); bounded since
        # x_jc <= n^(1/p) pooled_c. Where pooled_c = 0 the 1/p power is not
        # differentiable; the subgradient 0 is used.
        x = weights[:, :, None] * features
        pooled = ctx.pooled[:, None, :]
        positive = pooled > 0.0
        ratio = np.where(positive, x / np.where(positive, pooled, 1.0), 0.0)
        d_weighted = ratio ** (ctx.p - 1.0) * d_pooled[:, None, :] / n
    d_features = d_weighted * weights[:, :, None]
    d_weights = np.sum(d_weighted * features, axis=2)
    d_rho = -(n / mu) * d_weights
    d_pi = np.broadcast_to(d_z[:, :, None] / mu, result.pi.shape)
    if backward == "closed_form":
        d_cost = _weight_transport_backward(result, d_rho, d_pi)
    else:
        if result.method != "fixed_point":
            raise ValueError(
                f"backward == 'unrolled' needs method='fixed_point', got {result.method!r}"
            )
        if result.tau_history is None:
            d_cost = _weight_transport_backward(result, d_rho, d_pi)
        else:
            d_cost = _weight_transport_backward_unrolled(result, d_rho, d_pi)
    through_cost = _cost_map_backward(ctx.cost, d_cost)
    return PoolGrads(features=through_cost.features + d_features, prototypes=through_cost.prototypes)


def gsp_pool_forward(
    features, prototypes, *, mu, eps, p=1.0, method="exact", max_iter=100, tol=1e-12
) -> tuple[tuple[np.ndarray, np.ndarray], PoolContext]:
    r"""GSP pooling layer (Alg. 2): ``((pooled, z), ctx)``.

    With ``(rho, pi)`` the solution of (P2) on the cost map of ``features`` and
    ``prototypes`` (see :func:`cost_map_forward`, :func:`weight_transport`) and the
    pooling weights ``w_j = (1 - n rho_j) / mu``:

    .. math::
        \text{pooled} = \Big(\frac1n\sum_j (w_j f_j)^p\Big)^{1/p},\qquad
        z_i = \frac1\mu \sum_j \pi_{ij}

    ``p = 1`` is Eq. 4.1, ``pooled = sum_j (1/n - rho_j)/mu f_j``; ``p > 1`` is
    GeMean + GSP (element-wise power, needs non-negative features). ``z`` is Eq. 4.3.
    The weights apply to the raw features; only the cost map sees the normalised ones.
    At ``mu = 1``, ``pooled`` is the mean of the features (Thm 4.1, GAP).

    Parameters
    ----------
    features : array (B, n, d)
    prototypes : array (m, d)
    mu, eps, method, max_iter, tol
        As in :func:`weight_transport`.
    p : float >= 1

    Returns
    -------
    (pooled (B, d), z (B, m)), PoolContext
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    mu, eps, method, max_iter, tol = _check_transport_args(mu, eps, method, max_iter, tol)
    p = check_scalar(p, "p", low=1.0)
    if p > 1.0 and np.any(features < 0.0):
        bad = tuple(int(i) for i in np.argwhere(features < 0.0)[0])
        raise ValueError(
            f"features[{bad}] == {features[bad]!r} is negative; p == {p!r} > 1 "
            "(GeMean) needs non-negative features"
        )
    return _gsp_pool_forward(features, prototypes, mu, eps, p, method, max_iter, tol)


def gsp_pool_backward(ctx: PoolContext, d_pooled, d_z, *, backward="closed_form") -> PoolGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d) of the pooling layer.

    Chains ``(pooled, z) -> (rho, pi) -> cost -> normalisation -> (features, prototypes)``
    plus the direct path from ``pooled`` to the raw features. ``backward="closed_form"``
    (default) uses Prop. 4.3; ``backward="unrolled"`` differentiates the k fixed-point
    iterations exactly (needs ``method="fixed_point"`` in the forward). Either of
    ``d_pooled``, ``d_z`` may be ``None`` (zero).
    """
    backward = check_choice(backward, "backward", _BACKWARDS)
    batch, _, dim = ctx.features.shape
    m = ctx.transport.pi.shape[1]
    d_pooled = np.zeros((batch, dim)) if d_pooled is None else np.asarray(d_pooled, dtype=np.float64)
    d_z = np.zeros((batch, m)) if d_z is None else np.asarray(d_z, dtype=np.float64)
    if d_pooled.shape != (batch, dim):
        raise ValueError(f"d_pooled has shape {d_pooled.shape}, expected {(batch, dim)}")
    if d_z.shape != (batch, m):
        raise ValueError(f"d_z has shape {d_z.shape}, expected {(batch, m)}")
    return _gsp_pool_backward(ctx, d_pooled, d_z, backward)


def gsp_pool(features, prototypes, *, mu, eps, p=1.0, method="exact", max_iter=100, tol=1e-12):
    """``(pooled, z)`` of the GSP layer (no context kept)."""
    return gsp_pool_forward(
        features, prototypes, mu=mu, eps=eps, p=p, method=method, max_iter=max_iter, tol=tol
    )[0]


# --------------------------------------------------------------------------- registry


def _mixed_norms(rng: np.random.Generator, shape: tuple[int, ...], radii) -> np.ndarray:
    # Rows inside and outside the unit ball, none near the sphere (the kink of the clip).
    x = rng.standard_normal(shape)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    return x * np.resize(np.asarray(radii), shape[:-1])[..., None]


def _pool_inputs(rng: np.random.Generator) -> dict:
    return {
        "features": _mixed_norms(rng, (2, 4, 3), [0.4, 0.8, 1.5, 2.5]),
        "prototypes": _mixed_norms(rng, (3, 3), [0.6, 1.3, 2.0]),
    }


def _positive_pool_inputs(rng: np.random.Generator) -> dict:
    return {
        "features": rng.uniform(0.1, 0.6, (2, 4, 3)),
        "prototypes": _mixed_norms(rng, (3, 3), [0.6, 1.3, 2.0]),
    }


def _cost_inputs(rng: np.random.Generator) -> dict:
    return {"cost": rng.uniform(0.0, 2.0, (2, 3, 4))}


def _wt_forward(cost, *, mu=0.4, eps=3.0, method="exact", max_iter=100, tol=1e-12):
    with warnings.catch_warnings():
        # A fixed iteration count (tol=0) is intended in the unrolled checks.
        warnings.simplefilter("ignore", ConvergenceWarning)
        result = weight_transport(cost, mu=mu, eps=eps, method=method, max_iter=max_iter, tol=tol)
    return (result.rho, result.pi), result


def _pool_forward(features, prototypes, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return gsp_pool_forward(features, prototypes, **kwargs)


register(OperatorSpec(
    name="gsp.cost_map",
    forward=cost_map_forward,
    backward=cost_map_backward,
    make_inputs=_pool_inputs,
    paper="GSP Alg. 2: c_ij = ||wbar_i - fbar_j||, ubar = u / max(1, ||u||)",
))
register(OperatorSpec(
    name="gsp.weight_transport",
    forward=_wt_forward,
    backward=weight_transport_backward,
    make_inputs=_cost_inputs,
    paper="GSP (P2), Prop. 4.2 (exact root of the marginal equation), Prop. 4.3 closed form",
))
register(OperatorSpec(
    name="gsp.weight_transport_unrolled",
    forward=functools.partial(_wt_forward, method="fixed_point", max_iter=7, tol=0.0),
    backward=weight_transport_backward_unrolled,
    make_inputs=_cost_inputs,
    paper="GSP Prop. 4.2 / Alg. 3 forward, k = 7 iterations, differentiated by unrolling",
))
register(OperatorSpec(
    name="gsp.pool",
    forward=functools.partial(_pool_forward, mu=0.4, eps=3.0),
    backward=gsp_pool_backward,
    make_inputs=_pool_inputs,
    paper="GSP Alg. 2, Eqs. (4.1) and (4.3) with (P2) and Prop. 4.3",
))
register(OperatorSpec(
    name="gsp.pool_gemean",
    forward=functools.partial(_pool_forward, mu=0.4, eps=3.0, p=3.0),
    backward=gsp_pool_backward,
    make_inputs=_positive_pool_inputs,
    paper="GSP Alg. 2, GeMean + GSP (p > 1) and Eq. (4.3)",
))
register(OperatorSpec(
    name="gsp.pool_unrolled",
    forward=functools.partial(
        _pool_forward, mu=0.4, eps=3.0, method="fixed_point", max_iter=6, tol=0.0
    ),
    backward=functools.partial(gsp_pool_backward, backward="unrolled"),
    make_inputs=_pool_inputs,
    paper="GSP Alg. 2 with Alg. 3 (k = 6 iterations), unrolled backward",
))
