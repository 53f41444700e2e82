r"""GSP (P2): the entropic weight transport, its solvers and its two backward passes.

Shapes: cost ``(B, m, n)``, rho ``(B, n)``, pi ``(B, m, n)``. ``inverse_temperature``
is the paper's ε (varepsilon), which multiplies the cost:

.. math::
    \min_{\rho, \pi \ge 0} \sum_{ij} c_{ij}\pi_{ij}
        + \tfrac{1}{\varepsilon}\Big(\sum_{ij}\pi_{ij}\log\pi_{ij} + \sum_j \rho_j\log\rho_j\Big)
    \quad\text{s.t.}\quad \rho_j + \textstyle\sum_i \pi_{ij} = 1/n,\;
    \textstyle\sum_{ij}\pi_{ij} = \mu .

Log-domain reduction (derived in docs/gsp.md)
---------------------------------------------
Stationarity gives ``pi_ij = t exp(-ε c_ij) rho_j``. With ``l_j = logsumexp_i(-ε c_ij)``,
``tau = log t`` and ``sigma`` the logistic function, the column constraint gives
``rho_j = (1/n) sigma(-(tau + l_j))`` and

    pi_ij = (1/n) sigma(tau + l_j) softmax_i(-ε c_.j),

and the mass constraint becomes one monotone scalar equation per image,

    g(tau) = (1/n) sum_j sigma(tau + l_j) = mu.

Prop. 4.2's iteration is, in these variables, ``tau <- tau + log mu - log g(tau)``
(from ``tau_0 = 0``, i.e. ``t^(0) = 1``); it contracts with rate
``r = (n/mu) sum_j (sum_i pi_ij)^2 < 1`` at the fixed point. ``method="exact"`` solves
``g(tau) = mu`` by safeguarded Newton, then once more in the re-centred variable
``delta`` of ``x_j = (tau + l_j) + delta`` (see :func:`_solve_exact`), so that the mass
constraint holds to rounding even where ``|tau|`` is so large (ε = 1e16) that its own
ulp would move a whole feature's mass. Nothing forms ``exp(-ε c)``.

Length: ~540 lines, over the house ~450 on purpose: the solvers, the result they fill
and the two backward passes that read it are one derivation (docs/gsp.md Secs. 2-4)
and are meant to be read side by side; half of the file is docstring.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
from scipy.special import expit, log_expit, logsumexp

from refdml._validation import check_choice, check_context, check_scalar, check_upstream
from refdml.exceptions import ConvergenceWarning
from refdml.gsp._p1 import check_cost, check_mu

__all__ = [
    "WeightTransportGrads",
    "WeightTransportResult",
    "weight_transport",
    "weight_transport_backward",
    "weight_transport_backward_unrolled",
]

METHODS = ("exact", "fixed_point")
_ULP = np.finfo(np.float64).eps


@dataclass(frozen=True)
class WeightTransportResult:
    """Solution of the entropic problem (P2) for each image; the context of its backward.

    Attributes
    ----------
    rho : (B, n)
        Residual mass ``rho_j``.
    pi : (B, m, n)
        Transport plan.
    t, log_t : (B,)
        The scaling ``t`` of Prop. 4.2 and ``tau = log t``. ``t`` is ``inf`` where
        ``exp(tau)`` overflows (very large inverse_temperature) and at ``mu = 1``.
    n_iter : int
        Newton/bisection steps (``exact``, both phases, maximum over images) or
        fixed-point iterations (``fixed_point``, shared by all images); 0 at ``mu = 1``.
    residual : (B,)
        ``max(max_j |rho_j + sum_i pi_ij - 1/n|, |sum_ij pi_ij - mu|)``, from the arrays.
    converged : bool
        ``residual <= tol`` for every image (``tol = 0``: residual exactly 0).
    method, mu, inverse_temperature, tol : the arguments used.
    transported : (B, n)
        ``sigma(x_j) = 1 - n rho_j`` (the fraction of feature ``j`` that is transported),
        computed without the cancellation of ``1 - n * rho``.
    log_s : (B, n)
        ``l_j = logsumexp_i(-ε c_ij)`` (of ``c - min c`` per image where ``ε c`` itself
        overflows, ``method="exact"`` only; the solution does not change).
    assignment : (B, m, n)
        ``softmax_i(-ε c_ij)``, so that ``pi_ij = (sum_k pi_kj) assignment_ij``.
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
    inverse_temperature: float
    tol: float
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


def _log_kernel(cost: np.ndarray, inverse_temperature: float, shift_allowed: bool):
    """``l_j = logsumexp_i(-ε c_ij)`` (B, n), ``softmax_i(-ε c_ij)`` (B, m, n), shift (B,).

    (P2)'s solution depends on the cost only through ``ε (c - min c)`` per image (the
    mass ``sum pi = mu`` is fixed, so a constant cost shift changes the objective by a
    constant). Where ``ε c`` overflows and ``shift_allowed``, the cost is shifted by its
    per-image minimum; ``shift`` (B,) is ``ε min c`` then, 0 otherwise.
    """
    batch = cost.shape[0]
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = -inverse_temperature * cost
        shift = np.zeros(batch)
        if not np.all(np.isfinite(scaled)) and shift_allowed:
            lowest = cost.min(axis=(1, 2))
            scaled = -inverse_temperature * (cost - lowest[:, None, None])
            shift = inverse_temperature * lowest
    if not np.all(np.isfinite(scaled)):
        b = int(np.argwhere(~np.isfinite(scaled))[0][0])
        spread = float(np.max(cost[b]) - np.min(cost[b])) if shift_allowed else float(np.max(np.abs(cost[b])))
        what = "(max c - min c)" if shift_allowed else "max|c| (the fixed point starts at t = 1 for the cost as given)"
        raise ValueError(
            f"inverse_temperature * cost overflows float64: inverse_temperature == "
            f"{inverse_temperature!r} and {what} == {spread:.3e} in image {b}; "
            "(P2) at this scale is not representable"
        )
    log_s = logsumexp(scaled, axis=1)
    return log_s, np.exp(scaled - log_s[:, None, :]), shift


def _log_g(tau: np.ndarray, log_s: np.ndarray) -> np.ndarray:
    """``log g(tau) = log((1/n) sum_j sigma(tau + l_j))``, per image."""
    return logsumexp(log_expit(tau[:, None] + log_s), axis=1) - np.log(log_s.shape[1])


def _newton(log_s: np.ndarray, mu: float, max_iter: int, tau: np.ndarray | None = None):
    """Root of ``(1/n) sum_j sigma(tau + l_j) = mu`` per image by safeguarded Newton.

    Newton runs on ``phi(tau) = logit(g(tau)) - logit(mu)``, exactly linear when all
    ``l_j`` are equal (one step) and close to linear otherwise. The bracket
    ``[logit(mu) - max l, logit(mu) - min l]`` holds the root; a step that leaves it is
    replaced by bisection. Stops when ``|phi|`` reaches its rounding floor (g = mu to
    machine precision), or the step or the bracket is below a few ulps of tau.
    Starts from ``tau`` (default: ``logit(mu) - mean l``). Returns ``(tau, n_iter,
    exhausted)``, ``exhausted`` true if some image was still active at ``max_iter``.
    """
    n = log_s.shape[1]
    logit_mu = np.log(mu) - np.log1p(-mu)
    lo = logit_mu - log_s.max(axis=1)
    hi = logit_mu - log_s.min(axis=1)
    tau = logit_mu - log_s.mean(axis=1) if tau is None else np.array(tau, dtype=np.float64)
    tau = np.clip(tau, lo, hi)
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
        # (large inverse_temperature) tau is ill-determined there, but rho and pi are not.
        level = np.abs(phi) <= phi_floor
        done = level | small | (hi_i - lo_i <= scale)
        tau[idx] = np.where(level, t, new)
        lo[idx], hi[idx] = lo_i, hi_i
        active[idx[done]] = False
    return tau, n_iter, bool(np.any(active))


def _solve_exact(log_s: np.ndarray, mu: float, max_iter: int):
    """``(x, tau, n_iter, exhausted)`` with ``x_j = tau + l_j`` solving ``g = mu``.

    Phase 1 finds ``tau`` to within a few ulps of ``|tau|``. Where ``|tau|`` is huge
    (ε = 1e16 makes ``l`` ~ -1e16), that ulp (~2) is a large step of ``sigma``: the mass
    would be off by a visible fraction of one feature. Phase 2 therefore re-centres,
    ``a_j = fl(tau + l_j)`` (a rounding of the problem of at most ``ulp(tau + l_j)``,
    i.e. a relative perturbation ~1e-16 of ``ε c``), and solves for ``delta`` near 0,
    where the resolution is fine, so that ``x = a + delta`` satisfies the mass
    constraint to rounding. For ordinary ε phase 2 stops at its first step.
    """
    tau, n_first, exhausted_first = _newton(log_s, mu, max_iter)
    anchored = tau[:, None] + log_s
    delta, n_second, exhausted_second = _newton(
        anchored, mu, max_iter, tau=np.zeros(log_s.shape[0])
    )
    x = anchored + delta[:, None]
    return x, tau + delta, n_first + n_second, exhausted_first or exhausted_second


def _fixed_point_taus(log_s: np.ndarray, mu: float, max_iter: int, tol: float) -> np.ndarray:
    """Prop. 4.2 in the log domain: ``tau_k = tau_{k-1} + log mu - log g(tau_{k-1})``.

    Returns the history ``(B, k + 1)`` from ``tau_0 = 0`` (``t^(0) = 1``). With
    ``tol > 0`` it stops at the first k where every image's column residual
    ``max_j |rho_j + sum_i pi_ij - 1/n|`` is <= tol (the mass constraint holds exactly
    after each t-update, in exact arithmetic).
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


def _assemble(x, log_ratio, assignment) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rho = (1/n) sigma(-x)``, ``pi = exp(log_ratio) (1/n) sigma(x) A``, ``sigma(x)``.

    For the exact solution ``x = tau + l`` and ``log_ratio = 0``. For the k-th
    fixed-point iterate ``x = tau_{k-1} + l`` and ``log_ratio = tau_k - tau_{k-1}``:
    ``rho^(k)`` comes from ``t^(k-1)`` and ``pi^(k)`` from ``t^(k)`` as in Prop. 4.2.
    """
    n = x.shape[1]
    transported = expit(x)
    rho = expit(-x) / n
    column_mass = np.exp(log_ratio[:, None] + log_expit(x)) / n
    return rho, column_mass[:, None, :] * assignment, transported


def _residual(rho: np.ndarray, pi: np.ndarray, mu: float) -> np.ndarray:
    n = rho.shape[1]
    column = np.max(np.abs(rho + pi.sum(axis=1) - 1.0 / n), axis=1)
    mass = np.abs(pi.sum(axis=(1, 2)) - mu)
    return np.maximum(column, mass)


def _weight_transport(cost, mu, inverse_temperature, method, max_iter, tol) -> WeightTransportResult:
    batch, m, n = cost.shape
    log_s, assignment, shift = _log_kernel(cost, inverse_temperature, method == "exact")
    common = dict(
        method=method, mu=mu, inverse_temperature=inverse_temperature, tol=tol,
        log_s=log_s, assignment=assignment,
    )
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
        x, tau, n_iter, exhausted = _solve_exact(log_s, mu, max_iter)
        rho, pi, transported = _assemble(x, np.zeros(batch), assignment)
        history = None
        with np.errstate(over="ignore"):
            tau = tau + shift  # the multiplier of the cost as given
    else:
        history = _fixed_point_taus(log_s, mu, max_iter, tol)
        tau_prev, tau, n_iter = history[:, -2], history[:, -1], history.shape[1] - 1
        rho, pi, transported = _assemble(tau_prev[:, None] + log_s, tau - tau_prev, assignment)
        exhausted = n_iter == max_iter
    residual = _residual(rho, pi, mu)
    converged = bool(np.all(residual <= tol))
    if not converged and tol > 0.0:
        worst = float(residual.max())
        if exhausted:
            why = f"reached max_iter == {max_iter} with residual {worst:.3e} > tol == {tol:g}"
        elif method == "exact":
            why = (
                f"stalled after {n_iter} steps at the rounding floor of tau with residual "
                f"{worst:.3e} > tol == {tol:g} (tol is below what float64 can reach here)"
            )
        else:
            why = (
                f"stopped after {n_iter} iterations (column residual <= tol) but the "
                f"residual of the arrays is {worst:.3e} > tol == {tol:g} (rounding)"
            )
        warnings.warn(f"weight_transport(method={method!r}) {why}", ConvergenceWarning, stacklevel=3)
    with np.errstate(over="ignore"):
        t = np.exp(tau)
    return WeightTransportResult(
        rho=rho, pi=pi, t=t, log_t=tau, n_iter=int(n_iter), residual=residual,
        converged=converged, transported=transported, tau_history=history, **common,
    )


def check_transport_args(mu, inverse_temperature, method, max_iter, tol):
    mu = check_mu(mu)
    inverse_temperature = check_scalar(
        inverse_temperature, "inverse_temperature", low=0.0, low_inclusive=False
    )
    method = check_choice(method, "method", METHODS)
    max_iter = check_scalar(max_iter, "max_iter", low=1, integer=True)
    tol = check_scalar(tol, "tol", low=0.0)
    return mu, inverse_temperature, method, max_iter, tol


def weight_transport(
    cost, *, mu, inverse_temperature, method="exact", max_iter=100, tol=1e-12
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
    inverse_temperature : float > 0
        The paper's ε (varepsilon), an inverse temperature multiplying the cost
        (``exp(-ε c)``): larger is sharper, closer to the LP (P1); towards 0 the weights
        become uniform (GAP). GSP's defaults: 0.5 with proxy losses, 5.0 with pair losses.
    method : {"exact", "fixed_point"}
        ``"exact"`` (default): solves ``g(tau) = (1/n) sum_j sigmoid(tau + l_j) = mu``
        per image by safeguarded Newton to machine precision, in two phases (the second
        re-centred, so that the constraints hold to rounding even at ε = 1e16);
        ``max_iter`` caps the steps of each phase (a handful suffice; a few dozen at
        huge ε). ``"fixed_point"``: Prop. 4.2 as printed, from ``t^(0) = 1``, in the
        log domain (same iterates); up to ``max_iter`` iterations, stopping early once
        the column residual is <= ``tol``.
    max_iter : int >= 1
    tol : float >= 0
        Residual below which the result counts as converged; otherwise a
        :class:`refdml.ConvergenceWarning` says why the solver stopped (max_iter
        reached, or stalled above tol at the rounding floor) and ``converged=False``.
        ``tol = 0`` asks for a fixed count: ``fixed_point`` runs exactly ``max_iter``
        iterations, ``exact`` runs to its rounding floor as always; no warning is
        issued and ``converged`` is true only if the residual is exactly 0.

    Returns
    -------
    WeightTransportResult

    Raises
    ------
    ValueError
        For ``mu`` outside (0, 1], ``inverse_temperature <= 0``, an unknown ``method``,
        ``max_iter < 1``, ``tol < 0``, a cost that is not a finite (B, m, n) array, and
        where ``inverse_temperature * cost`` overflows float64 (``exact``: where
        ``inverse_temperature * (max c - min c)`` does, a constant shift of an image's
        cost leaving its solution unchanged).

    Notes
    -----
    Everything is computed from ``l_j = logsumexp_i(-ε c_ij)`` and
    ``softmax_i(-ε c_.j)``: ``rho_j = (1/n) sigmoid(-(tau + l_j))`` and
    ``pi_ij = (1/n) sigmoid(tau + l_j) softmax_i(-ε c_ij)`` (docs/gsp.md).
    The constraints hold to ``residual`` (~1e-16 for ``exact`` at any ε).

    ``mu = 1`` (Thm 4.1) is handled explicitly for both methods: ``tau = t = inf``,
    ``rho = 0``, ``pi_ij = (1/n) softmax_i(-ε c_ij)``, ``n_iter = 0``,
    ``converged = True``. (Prop. 4.2's iteration only approaches this limit.)
    """
    cost = check_cost(cost)
    mu, inverse_temperature, method, max_iter, tol = check_transport_args(
        mu, inverse_temperature, method, max_iter, tol
    )
    return _weight_transport(cost, mu, inverse_temperature, method, max_iter, tol)


def check_transport_upstream(result, d_rho, d_pi) -> tuple[np.ndarray, np.ndarray]:
    """Validate the result (the context) and the upstream gradients; None means zero."""
    check_context(result, "result", WeightTransportResult)
    d_rho = check_upstream(d_rho, "d_rho", result.rho.shape, allow_none=True)
    d_pi = check_upstream(d_pi, "d_pi", result.pi.shape, allow_none=True)
    d_rho = np.zeros_like(result.rho) if d_rho is None else d_rho
    d_pi = np.zeros_like(result.pi) if d_pi is None else d_pi
    return d_rho, d_pi


def closed_form_backward(result, d_rho, d_pi) -> np.ndarray:
    """Prop. 4.3 on valid input (see :func:`weight_transport_backward`)."""
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
    return -result.inverse_temperature * (weighted - n * pi * inner[:, None, :])


def weight_transport_backward(result: WeightTransportResult, d_rho, d_pi) -> WeightTransportGrads:
    r"""Gradient of the loss with respect to the cost, Prop. 4.3 (closed form, no inverse).

    With ``q = rho * d_rho + (pi * d_pi)^T 1_m``, ``eta = sum(rho * d_rho) - n q^T rho`` and
    ``kappa = 1 - mu - n rho^T rho``:

    .. math::
        \partial L / \partial c = -\varepsilon\Big(\pi\odot \partial_\pi L
            - n\,\pi\,\mathrm{Diag}\big(q - \tfrac{\eta}{\kappa}\rho\big)\Big)

    i.e. ``d_cost_ij = -ε (pi_ij d_pi_ij - n pi_ij (q_j - (eta / kappa) rho_j))``.

    Parameters
    ----------
    result : WeightTransportResult
        The forward's result (its context).
    d_rho : array (B, n) or None
    d_pi : array (B, m, n) or None
        Upstream gradients, exactly of the shapes of ``rho`` and ``pi``; ``None`` means
        zero (an output that the loss does not use).

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
    ``-ε (pi * d_pi - n pi * q)``. Applied to a non-converged fixed-point result, this
    is the paper's practice (implicit gradient at an approximate solution); it is exact
    only at the solution.
    """
    d_rho, d_pi = check_transport_upstream(result, d_rho, d_pi)
    return WeightTransportGrads(cost=closed_form_backward(result, d_rho, d_pi))


def unrolled_backward(result, d_rho, d_pi) -> np.ndarray:
    """Reverse pass through the k fixed-point steps (see :func:`weight_transport_backward_unrolled`)."""
    if result.tau_history is None:  # mu = 1: the closed form is the limit
        return closed_form_backward(result, d_rho, d_pi)
    n = result.rho.shape[1]
    inverse_temperature = result.inverse_temperature
    log_s, assignment, history = result.log_s, result.assignment, result.tau_history
    pi = result.pi
    # pi_ij = P_j A_ij with P_j = exp(tau_k - tau_{k-1}) sigma(x_j) / n, x = tau_{k-1} + l;
    # rho_j = (1 - sigma(x_j)) / n.
    d_column = np.sum(assignment * d_pi, axis=1)
    d_cost = -inverse_temperature * pi * (d_pi - d_column[:, None, :])  # through softmax_i(-ε c)
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
        # sigma(tau_{s-1} + l) is recomputed from the stored taus: O(k B) memory
        # instead of the O(k B n) of keeping every step's sigmoids.
        x = history[:, s - 1, None] + log_s
        log_sig, log_one_minus = log_expit(x), log_expit(-x)
        weight = np.exp(log_sig + log_one_minus - logsumexp(log_sig, axis=1, keepdims=True))
        d_log_s -= d_tau[:, None] * weight
        d_prev = d_tau * (1.0 - weight.sum(axis=1))
        if s == k:
            d_prev = d_prev + d_tau_prev
        d_tau = d_prev
    return d_cost - inverse_temperature * assignment * d_log_s[:, None, :]


def check_unrolled(result) -> None:
    if result.method != "fixed_point":
        raise ValueError(
            f"result.method == {result.method!r}; the unrolled backward needs a result of "
            "method='fixed_point'"
        )


def weight_transport_backward_unrolled(
    result: WeightTransportResult, d_rho, d_pi
) -> WeightTransportGrads:
    """Exact gradient of the k-step fixed-point iterate (reverse pass through Prop. 4.2).

    ``result`` must come from ``weight_transport(..., method="fixed_point")``; the
    gradient is that of the ``k = result.n_iter`` step map ``cost -> (rho^(k), pi^(k))``
    (for an early-stopped run, of the map with that k). ``d_rho`` (B, n) and ``d_pi``
    (B, m, n) as in :func:`weight_transport_backward` (``None`` means zero).

    Memory wins over recomputation here, on purpose: only ``tau_0..tau_k`` are stored
    (O(k) per image), and each step's ``sigma(tau_{s-1} + l)`` (O(n) per image and step)
    is recomputed from them in the reverse pass. As k grows the result approaches
    :func:`weight_transport_backward` (at rate ``r^k``, ``r`` =
    :attr:`WeightTransportResult.contraction_rate`). At ``mu = 1`` the result is the
    limit, so this returns the closed-form (softmax) gradient. A validation operator
    (the paper's Alg. 3 differentiated by unrolling), not part of the layer's default.
    """
    d_rho, d_pi = check_transport_upstream(result, d_rho, d_pi)
    check_unrolled(result)
    return WeightTransportGrads(cost=unrolled_backward(result, d_rho, d_pi))
