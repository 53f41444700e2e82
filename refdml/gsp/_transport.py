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

Any finite ε (docs/gsp.md Sec. 2)
---------------------------------
``tau`` and ``l_j`` grow like ε (up to ~1e308) while the logits ``x_j = tau + l_j`` that
decide the solution stay of order one: formed as ``tau + l_j``, they would carry an
absolute rounding of ``ulp(ε c)``. Both solvers therefore work in the coordinates of an
anchor feature ``p``: ``x_j = y + (l_j - l_p)`` with ``y = tau + l_p`` and
``l_j - l_p = (lam_j - lam_p) - ε (cmin_j - cmin_p)`` formed from cost differences
(``cmin_j = min_i c_ij``, ``lam_j = l_j + ε cmin_j`` in ``[0, log m]``), exact to a few
ulps of itself; ``exp`` only ever sees numbers ``<= 0`` and an overflowing ``ε (c - c')``
is ``inf`` (a weight of exactly 0), never an error.

``method="exact"`` picks ``p`` as the feature whose logit is nearest 0 at the root (a
bisection over the features sorted by ``cmin``, then a window of ``[-1024, 1024]`` around
it, beyond which every sigmoid is 0 or 1 in float64) and solves ``g = mu`` for ``y`` by
safeguarded Newton inside that bracket: the constraints hold to rounding for every finite
ε up to ``np.finfo(float).max``. ``method="fixed_point"`` is Prop. 4.2 as printed (from
``t^(0) = 1``), written as ``y' = log(n mu) - logsumexp_j((l_j - l_p) - softplus(y +
l_j - l_p))`` (no cancellation of ``y``); every iterate satisfies the mass constraint to
rounding at any ε, the column constraints only once converged, and at large ε that takes
~ε times a cost gap iterations (a ``ConvergenceWarning`` says so). Nothing forms
``exp(-ε c)``.

The solvers, the result they fill and the two backward passes that read it are one
derivation (docs/gsp.md Secs. 2-4) and are meant to be read side by side in one module.
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
# |x| beyond which sigma(x) is exactly 0 or 1 in float64 (exp(-745) is below the least
# subnormal): the pivot search's window, with room for misordered pairs (|l - l'| <= log m).
_SATURATION = 1024.0


@dataclass(frozen=True, kw_only=True)
class WeightTransportResult:
    """Solution of the entropic problem (P2) for each image; the context of its backward.

    Attributes
    ----------
    rho : (B, n)
        Residual mass ``rho_j``.
    pi : (B, m, n)
        Transport plan.
    t, log_t : (B,)
        The scaling ``t`` of Prop. 4.2 and ``tau = log t``, for the cost as given. ``t`` is
        ``inf`` where ``exp(tau)`` overflows and at ``mu = 1``; ``tau ~ ε c`` carries an
        absolute rounding of ``ulp(ε c)`` and is ``±inf`` where ``ε c`` overflows (the
        solution, computed from cost differences, is not affected).
    n_iter : int
        ``exact``: evaluations of ``g`` per image (the pivot search, ~log2(n) + 2, and
        the safeguarded Newton steps), maximum over images; ``fixed_point``: iterations
        (shared by all images); 0 at ``mu = 1``.
    residual : (B,)
        ``max(max_j |rho_j + sum_i pi_ij - 1/n|, |sum_ij pi_ij - mu|)``, from the arrays.
    converged : bool
        ``residual <= tol`` for every image (``tol = 0``: residual exactly 0).
    method, mu, inverse_temperature, tol : the arguments used.
    transported : (B, n)
        ``sigma(x_j) = 1 - n rho_j`` (the fraction of feature ``j`` that is transported),
        computed without the cancellation of ``1 - n * rho``.
    log_s : (B, n)
        ``l_j = logsumexp_i(-ε c_ij)``, as ``tau`` rounded to ``ulp(ε c)`` and ``-inf`` or
        ``inf`` where ``ε c`` overflows.
    assignment : (B, m, n)
        ``softmax_i(-ε c_ij)``, so that ``pi_ij = (sum_k pi_kj) assignment_ij``.
    tau_history : (B, k + 1) or None
        ``tau_0 = 0, ..., tau_k`` of the fixed-point iteration (``fixed_point`` only,
        ``None`` at ``mu = 1``), rounded as ``log_t``.
    pivot, relative_log_s, anchored_tau_history : (B,), (B, n), (B, k + 1) or None
        The coordinates the fixed point runs in (``fixed_point`` only, ``None`` at
        ``mu = 1``): an anchor ``a = l_p`` (``p = pivot``, the feature of least
        ``min_i c_ij``) where ``l_p <= 0``, else ``a = 0`` (``pivot == -1``);
        ``relative_log_s = l - a`` formed from cost differences and ``anchored_tau_history
        = tau_s + a``, both free of the rounding of ``tau``: all the unrolled backward
        needs, memory O(k + n).
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
    pivot: np.ndarray | None = None
    relative_log_s: np.ndarray | None = None
    anchored_tau_history: np.ndarray | None = None

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


def _sigmoid(x):
    """``sigma(x)`` down to float64's least subnormal (``x ~ -744.4``).

    scipy's ``expit`` is 0 below ``x ~ -709.78`` (``1 / (1 + e^-x)`` overflows), where
    ``sigma(x) = e^x (1 - e^x + ...)`` is ``e^x`` to float64's precision: the GSP pooling
    weights ``sigma_j / mu`` at ``mu`` near float64's least normal number were 0 there.
    """
    return np.where(x < -700.0, np.exp(np.minimum(x, -700.0)), expit(x))


def _scaled_gap(inverse_temperature: float, a, b):
    """``ε (a - b)`` with no overflow of ``a - b``; ``±inf`` only where the product overflows.

    The halving is exact (but for subnormals, where it moves the product by at most
    ``ε 2^-1075 < 1e-15``), the difference is one rounding (none by Sterbenz where ``a``
    and ``b`` are within a factor 2), the product one more, the doubling none.
    """
    with np.errstate(over="ignore"):
        return (inverse_temperature * (0.5 * a - 0.5 * b)) * 2.0


def _log_kernel(cost: np.ndarray, inverse_temperature: float):
    """``cmin`` (B, n), ``lam`` (B, n) and ``softmax_i(-ε c_ij)`` (B, m, n).

    ``cmin_j = min_i c_ij`` and ``lam_j = log sum_i exp(-ε (c_ij - cmin_j))`` in
    ``[0, log m]``, so that ``l_j = lam_j - ε cmin_j``. ``exp`` sees only numbers ``<= 0``;
    where ``ε (c_ij - cmin_j)`` overflows the weight is exactly 0, as in real arithmetic
    to float64's resolution.
    """
    column_min = cost.min(axis=1)
    weights = np.exp(-_scaled_gap(inverse_temperature, cost, column_min[:, None, :]))
    total = weights.sum(axis=1)  # in [1, m]: the column's minimum contributes exp(0)
    return column_min, np.log(total), weights / total[:, None, :]


def _log_s(column_min: np.ndarray, lam: np.ndarray, inverse_temperature: float) -> np.ndarray:
    """``l_j`` for the cost as given (``±inf`` where ``ε cmin`` overflows)."""
    with np.errstate(over="ignore"):
        return lam - inverse_temperature * column_min


def _relative_log_s(column_min, lam, inverse_temperature: float, pivot) -> np.ndarray:
    """``l_j - l_p`` (B, n) for each image's pivot ``p`` (B,), from cost differences.

    Accurate to a few ulps of itself (and of ``log m``) at any ε, where ``l_j - l_p``
    formed from the rounded ``l`` would be off by ``ulp(ε c)``; ``-inf``/``inf`` where
    ``ε (cmin_j - cmin_p)`` overflows. The pivot's own entry is exactly 0.
    """
    rows = np.arange(column_min.shape[0])
    return (lam - lam[rows, pivot][:, None]) - _scaled_gap(
        inverse_temperature, column_min, column_min[rows, pivot][:, None]
    )


def _phi(y: np.ndarray, relative: np.ndarray, logit_mu: float) -> np.ndarray:
    """``phi(y) = logit(g) - logit(mu)``, ``g = (1/n) sum_j sigma(y + relative_j)``, per image.

    From log-sigmoids, so ``g = 1e-300`` or ``1 - g = 1e-300`` are resolved; ``y`` is
    finite and the pivot's entry of ``relative`` is 0, so neither sum is empty.
    """
    x = y[:, None] + relative
    return logsumexp(log_expit(x), axis=1) - logsumexp(log_expit(-x), axis=1) - logit_mu


def _pivot_search(column_min, lam, inverse_temperature: float, logit_mu: float):
    """Pivot ``p``, ``l - l_p`` and a bracket ``[lo, hi]`` of the root ``y = x_p`` (docs/gsp.md).

    ``phi`` at ``y = 0`` in the coordinates of feature ``q`` is ``>= 0`` iff ``x_q <= 0`` at
    the root, and it grows with ``cmin_q`` (up to pairs whose ``l`` differ by less than
    ``log m``, which may be out of order). Bisection over the features sorted by ``cmin``
    finds two neighbours ``plus`` (``x > 0``) and ``minus`` (``x <= 0``); one of them is
    within ``log m`` of the logit nearest 0. With ``G = l_plus - l_minus`` and
    ``H = min(G/2, 1024)``, the sign of ``phi(-H)`` in ``minus``'s coordinates says which
    is nearer; if the root is more than 1024 from both, every sigmoid is 0 or 1 in
    float64 (``sigma(-1024) = 0``) and ``y = 1024`` in ``plus``'s coordinates solves
    ``g = mu`` to rounding (a plateau of ``g``). Returns ``(pivot, relative, lo, hi,
    evaluations)``, ``evaluations`` (B,) the calls of ``phi`` per image.
    """
    batch, n = column_min.shape
    rows = np.arange(batch)
    order = np.argsort(column_min, axis=1, kind="stable")
    zero = np.zeros(batch)
    below, above = np.full(batch, -1), np.full(batch, n)
    evaluations = np.zeros(batch, dtype=np.int64)
    while np.any(above - below > 1):
        active = above - below > 1
        middle = (below + above) // 2
        candidate = order[rows, np.clip(middle, 0, n - 1)]
        relative = _relative_log_s(column_min, lam, inverse_temperature, candidate)
        nonnegative = _phi(zero, relative, logit_mu) >= 0.0
        above = np.where(active & nonnegative, middle, above)
        below = np.where(active & ~nonnegative, middle, below)
        evaluations += active
    minus = order[rows, np.minimum(above, n - 1)]
    plus = order[rows, np.maximum(below, 0)]
    relative_minus = _relative_log_s(column_min, lam, inverse_temperature, minus)
    relative_plus = _relative_log_s(column_min, lam, inverse_temperature, plus)
    interior = (below >= 0) & (above < n)
    gap = np.maximum(relative_minus[rows, plus], 0.0)  # l_plus - l_minus
    half = np.minimum(0.5 * gap, _SATURATION)
    far_from_minus = _phi(-half, relative_minus, logit_mu) >= 0.0  # root <= -H
    evaluations += interior
    use_plus = (below >= 0) & ((above == n) | far_from_minus)
    relative = np.where(use_plus[:, None], relative_plus, relative_minus)
    lo = np.where(use_plus, 0.0, np.where(interior, -half, -np.inf))
    hi = np.where(use_plus, np.where(interior, gap - half, np.inf), 0.0)  # inf where G is
    far = use_plus & interior & (hi > _SATURATION)
    if np.any(far):
        plateau = _phi(np.full(batch, _SATURATION), relative_plus, logit_mu) < 0.0
        evaluations += far
        hi = np.where(far, _SATURATION, hi)
        lo = np.where(far & plateau, _SATURATION, lo)
    # g's own bracket (every sigmoid <= mu at the left end, >= mu at the right end).
    lo = np.maximum(lo, logit_mu - relative.max(axis=1))
    hi = np.maximum(np.minimum(hi, logit_mu - relative.min(axis=1)), lo)
    return np.where(use_plus, plus, minus), relative, lo, hi, evaluations


def _newton(relative, logit_mu: float, y, lo, hi, max_iter: int):
    """Root of ``phi(y) = 0`` in ``[lo, hi]`` per image by safeguarded Newton.

    ``phi = logit(g) - logit(mu)`` is exactly linear when all ``relative`` are equal
    (one step) and close to linear otherwise. A step that leaves the bracket is replaced
    by bisection. Stops when ``|phi|`` reaches its rounding floor (g = mu to machine
    precision), or the step or the bracket is below a few ulps of ``y``. Returns
    ``(y, steps, exhausted)``: ``steps`` (B,) per image, ``exhausted`` true if some image
    was still active at ``max_iter``.
    """
    n = relative.shape[1]
    lo, hi = lo.copy(), hi.copy()
    y = np.clip(y, lo, hi)
    active = hi - lo > 4.0 * _ULP * np.maximum(1.0, np.abs(y))
    y = np.where(active, y, lo)
    phi_floor = 16.0 * _ULP * (1.0 + abs(logit_mu))
    steps = np.zeros(y.shape[0], dtype=np.int64)
    for _ in range(max_iter):
        if not np.any(active):
            break
        idx = np.flatnonzero(active)
        steps[idx] += 1
        t = y[idx]
        x = t[:, None] + relative[idx]
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
        # (large inverse_temperature) y is ill-determined there, but rho and pi are not.
        level = np.abs(phi) <= phi_floor
        done = level | small | (hi_i - lo_i <= scale)
        y[idx] = np.where(level, t, new)
        lo[idx], hi[idx] = lo_i, hi_i
        active[idx[done]] = False
    return y, steps, bool(np.any(active))


def _solve_exact(column_min, lam, inverse_temperature: float, mu: float, max_iter: int):
    """``(x, log_t, n_iter, exhausted)``: the logits ``x_j = tau + l_j`` solving ``g = mu``.

    ``x = y + (l - l_p)`` in the pivot's coordinates (:func:`_pivot_search`), so that it
    is accurate to a few ulps of ``max(1, |x|)`` at any ε; ``log_t = y - l_p`` for the
    cost as given (rounded to ``ulp(ε c)``, ``±inf`` where that overflows).
    """
    logit_mu = np.log(mu) - np.log1p(-mu)
    pivot, relative, lo, hi, evaluations = _pivot_search(
        column_min, lam, inverse_temperature, logit_mu
    )
    y, steps, exhausted = _newton(relative, logit_mu, np.zeros(len(pivot)), lo, hi, max_iter)
    rows = np.arange(len(pivot))
    with np.errstate(over="ignore"):
        log_t = y - (lam[rows, pivot] - inverse_temperature * column_min[rows, pivot])
    return y[:, None] + relative, log_t, int(np.max(evaluations + steps)), exhausted


def _column_terms(y: np.ndarray, relative: np.ndarray) -> np.ndarray:
    """``relative_j - softplus(y + relative_j)`` (B, n): ``log(s_j rho_j n)`` shifted by ``-a``.

    The summands of Prop. 4.2's t-update ``1/t' = (1/(n mu)) sum_j s_j / (1 + t s_j)`` in
    anchored coordinates; where ``x = y + relative > 0`` it is formed as
    ``-y - softplus(-x)`` (the same number), so that ``relative = inf`` gives ``-y``,
    not ``inf - inf``.
    """
    x = y[:, None] + relative
    with np.errstate(invalid="ignore"):  # the branch np.where discards may be inf - inf
        return np.where(
            x > 0.0, -y[:, None] - np.logaddexp(0.0, -x), relative - np.logaddexp(0.0, x)
        )


def _fixed_point(column_min, lam, inverse_temperature: float, mu: float, max_iter: int,
                 tol: float):
    """Prop. 4.2 in anchored log coordinates: ``(pivot, relative, history)``.

    ``tau_{k+1} = log(n mu) - logsumexp_j(l_j - softplus(tau_k + l_j))`` is the printed
    t-update in the log domain; with ``y = tau + a`` and ``relative = l - a`` it reads
    ``y_{k+1} = log(n mu) - logsumexp_j(relative_j - softplus(y_k + relative_j))``, which
    never subtracts ``y_k`` from itself. The anchor is ``a = l_p`` for the feature ``p`` of
    least ``cmin`` where ``l_p <= 0`` (the first step then jumps ``tau`` by ~``-l_p``,
    after which ``y`` moves by O(log(n / mu)) a step), else ``a = 0`` (``tau`` then stays
    within O(k log(n / mu)) of 0; ``pivot = -1``). ``history`` (B, k + 1) holds ``y_0 = a, ..., y_k``;
    with ``tol > 0`` it stops at the first k where every image's column residual
    ``max_j |rho_j + sum_i pi_ij - 1/n|`` is <= tol.
    """
    batch, n = column_min.shape
    rows = np.arange(batch)
    first = np.argmin(column_min, axis=1)
    log_s = _log_s(column_min, lam, inverse_temperature)
    anchor = log_s[rows, first]
    at_pivot = anchor <= 0.0
    relative = np.where(
        at_pivot[:, None], _relative_log_s(column_min, lam, inverse_temperature, first), log_s
    )
    log_n_mu = np.log(n) + np.log(mu)
    y = np.where(at_pivot, anchor, 0.0)
    history = [y]
    for _ in range(max_iter):
        terms = _column_terms(y, relative)
        new = log_n_mu - logsumexp(terms, axis=1)
        history.append(new)
        if tol > 0.0:
            # rho_j + P_j - 1/n = (exp(new + term_j) - sigma(x_j)) / n
            sig = _sigmoid(y[:, None] + relative)
            column_residual = np.max(np.abs(np.exp(new[:, None] + terms) - sig), axis=1) / n
            if np.all(column_residual <= tol):
                break
        y = new
    return np.where(at_pivot, first, -1), relative, np.stack(history, axis=1)


def _residual(rho: np.ndarray, pi: np.ndarray, mu: float) -> np.ndarray:
    n = rho.shape[1]
    column = np.max(np.abs(rho + pi.sum(axis=1) - 1.0 / n), axis=1)
    mass = np.abs(pi.sum(axis=(1, 2)) - mu)
    return np.maximum(column, mass)


def _weight_transport(cost, mu, inverse_temperature, method, max_iter, tol) -> WeightTransportResult:
    batch, m, n = cost.shape
    column_min, lam, assignment = _log_kernel(cost, inverse_temperature)
    common = dict(
        method=method, mu=mu, inverse_temperature=inverse_temperature, tol=tol,
        log_s=_log_s(column_min, lam, inverse_temperature), assignment=assignment,
    )
    if mu == 1.0:
        # Thm 4.1's boundary: the root of g(tau) = 1 is tau = +inf, so rho = 0 and
        # every feature sends all of its 1/n to the prototypes by softmax.
        rho = np.zeros((batch, n))
        pi = assignment / n
        return WeightTransportResult(
            rho=rho, pi=pi, t=np.full(batch, np.inf), log_t=np.full(batch, np.inf),
            n_iter=0, residual=_residual(rho, pi, mu), converged=True,
            transported=np.ones((batch, n)), **common,
        )
    fixed = {}
    if method == "exact":
        x, log_t, n_iter, exhausted = _solve_exact(
            column_min, lam, inverse_temperature, mu, max_iter
        )
        column_mass = _sigmoid(x) / n
    else:
        pivot, relative, history = _fixed_point(
            column_min, lam, inverse_temperature, mu, max_iter, tol
        )
        n_iter = history.shape[1] - 1
        exhausted = n_iter == max_iter
        x = history[:, -2, None] + relative  # rho^(k) from t^(k-1), pi^(k) from t^(k)
        column_mass = np.exp(history[:, -1, None] + _column_terms(history[:, -2], relative)) / n
        with np.errstate(over="ignore", invalid="ignore"):
            tau_history = history - history[:, :1]  # tau_s = y_s - a (a = y_0)
        tau_history[:, 0] = 0.0  # tau_0 = 0 even where a = -inf
        log_t = tau_history[:, -1]
        fixed = dict(
            tau_history=tau_history, pivot=pivot, relative_log_s=relative,
            anchored_tau_history=history,
        )
    transported = _sigmoid(x)
    rho = _sigmoid(-x) / n
    pi = column_mass[:, None, :] * assignment
    residual = _residual(rho, pi, mu)
    converged = bool(np.all(residual <= tol))
    if not converged and tol > 0.0:
        worst = float(residual.max())
        if exhausted:
            why = f"reached max_iter == {max_iter} with residual {worst:.3e} > tol == {tol:g}"
            if method == "fixed_point":
                why += (
                    " (the mass constraint holds at every iterate, the column constraints only"
                    " at convergence; Prop. 4.2 moves log t by O(log n) per iteration, so at"
                    " large inverse_temperature it needs ~inverse_temperature * (cost gap)"
                    " iterations: method='exact' solves (P2) directly)"
                )
        elif method == "exact":
            why = (
                f"stalled after {n_iter} steps at the rounding floor of the logits with "
                f"residual {worst:.3e} > tol == {tol:g} (tol is below what float64 can "
                "reach here)"
            )
        else:
            why = (
                f"stopped after {n_iter} iterations (column residual <= tol) but the "
                f"residual of the arrays is {worst:.3e} > tol == {tol:g} (rounding)"
            )
        warnings.warn(f"weight_transport(method={method!r}) {why}", ConvergenceWarning, stacklevel=3)
    with np.errstate(over="ignore"):
        t = np.exp(log_t)
    return WeightTransportResult(
        rho=rho, pi=pi, t=t, log_t=log_t, n_iter=int(n_iter), residual=residual,
        converged=converged, transported=transported, **fixed, **common,
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
        per image to machine precision: a bisection over the features for the one whose
        logit is nearest 0 at the root, then safeguarded Newton in its coordinates
        (docs/gsp.md Sec. 2), so that the constraints hold to rounding at every finite
        ε, up to ``np.finfo(float).max``; ``max_iter`` caps the Newton steps (a handful
        suffice, at most ~60 in the window). ``"fixed_point"``: Prop. 4.2 as printed, from
        ``t^(0) = 1``, in the log domain (same iterates); up to ``max_iter`` iterations,
        stopping early once the column residual is <= ``tol``. Each iterate holds the
        mass constraint to rounding at any ε, the column constraints only at
        convergence, which at large ε takes ~ε times a gap of the cost iterations (not
        converged: ``converged=False`` and a warning saying so).
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
        For ``mu`` outside (0, 1], ``inverse_temperature`` not a finite number > 0, an
        unknown ``method``, ``max_iter < 1``, ``tol < 0``, and a cost that is not a
        finite (B, m, n) array. Any finite ``inverse_temperature * cost`` is solved:
        where a product ``ε (c - c')`` overflows, the weight it governs is exactly 0,
        as it is to float64's resolution in real arithmetic.

    Notes
    -----
    Everything is computed from ``l_j = logsumexp_i(-ε c_ij)`` and
    ``softmax_i(-ε c_.j)``: ``rho_j = (1/n) sigmoid(-(tau + l_j))`` and
    ``pi_ij = (1/n) sigmoid(tau + l_j) softmax_i(-ε c_ij)`` (docs/gsp.md), with the
    logits ``tau + l_j`` formed from cost differences. The constraints hold to
    ``residual`` (~1e-16 for ``exact`` at every finite ε; as ε grows the solution
    tends to the LP (P1)'s, which it equals to rounding once ε times every gap of the
    cost exceeds ~40).

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


def _softmax_part(assignment, pi, d_pi):
    """``pi_ij (d_pi_ij - a_j)`` (B, m, n) and ``a_j = sum_i A_ij d_pi_ij`` (B, n).

    ``d_pi_ij - a_j = sum_k A_kj (d_pi_ij - d_pi_kj)`` is formed as ``(d_pi_ij - d_pi_rj)
    + sum_k A_kj (d_pi_rj - d_pi_kj)`` with ``r`` the column's largest weight: where A is
    one-hot to rounding (large ε), the second sum has only tiny terms, where
    ``d_pi_rj - a_j`` would be a cancellation that ε then multiplies.
    """
    top = np.argmax(assignment, axis=1)[:, None, :]
    reference = np.take_along_axis(d_pi, top, axis=1)
    offset = np.sum(assignment * (reference - d_pi), axis=1, keepdims=True)
    return pi * ((d_pi - reference) + offset), np.sum(assignment * d_pi, axis=1)


def _scaled_gradient(inverse_temperature: float, inner: np.ndarray) -> np.ndarray:
    """``-ε inner``; ``ValueError`` where it overflows float64 (``inner`` is finite)."""
    with np.errstate(over="ignore"):
        d_cost = -inverse_temperature * inner
    if not np.all(np.isfinite(d_cost)):
        raise ValueError(
            f"d_cost overflows float64: inverse_temperature == {inverse_temperature!r} times "
            f"a derivative of {float(np.max(np.abs(inner))):.3e}; at this inverse temperature "
            "(P2) is this sensitive to the cost only next to a tie of the cost (a kink of the LP)"
        )
    return d_cost


def closed_form_backward(result, d_rho, d_pi) -> np.ndarray:
    """Prop. 4.3 on valid input (see :func:`weight_transport_backward`).

    Evaluated as ``d_cost_ij = -ε (pi_ij (d_pi_ij - a_j) + A_ij rho_j sigma_j (b_j - bbar))``
    with ``b = a - d_rho`` and ``bbar`` its mean under weights ``rho_j sigma_j``
    (docs/gsp.md Sec. 3): the same number as the printed form, with both differences
    taken against the dominant term so that nothing cancels before ε multiplies it.
    """
    rho, sig, assignment = result.rho, result.transported, result.assignment
    softmax_part, column = _softmax_part(assignment, result.pi, d_pi)
    b = column - d_rho
    # rho_j sigma_j = sigma_j (1 - sigma_j) / n without forming 1 - sigma; kappa = sum is
    # Prop. 4.3's 1 - mu - n rho^T rho, 0 only at mu = 1 (rho = 0: no marginal term).
    weight = rho * sig
    kappa = weight.sum(axis=1)
    rows = np.arange(b.shape[0])
    b_top = b[rows, np.argmax(weight, axis=1)][:, None]
    mean_offset = np.divide(
        np.sum(weight * (b_top - b), axis=1), kappa, out=np.zeros_like(kappa), where=kappa > 0.0
    )
    centred = (b - b_top) + mean_offset[:, None]
    return _scaled_gradient(
        result.inverse_temperature, softmax_part + assignment * (weight * centred)[:, None, :]
    )


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

    Notes
    -----
    Paper vs this implementation: the printed (4.2) reads
    ``n pi Diag(q - eta / (1 - mu - n rho^T rho)) rho``, which would make the bracket a
    vector times ``rho``. Deriving it from App. A.3 (block inverse of ``H``), or from
    the implicit function theorem on ``g(tau) = mu`` (docs/gsp.md), puts ``rho`` inside
    the Diag, multiplied by ``eta / kappa``; finite differences confirm this reading.

    Evaluation: with ``a_j = sum_i A_ij d_pi_ij`` (``A`` the softmax), ``b = a - d_rho``,
    weights ``w_j = rho_j sigma_j`` (``sigma_j = 1 - n rho_j`` from
    ``result.transported``; ``kappa = sum w``) and ``bbar = sum w b / kappa``, the same
    expression reads

        d_cost_ij = -ε (pi_ij (d_pi_ij - a_j) + A_ij w_j (b_j - bbar))   (docs/gsp.md Sec. 3),

    and both differences are taken against the column's (image's) dominant term, so
    that nothing cancels before ε multiplies it: as ε grows the softmax and the
    sigmoids saturate, the true gradient tends to 0 away from ties of the cost (the LP
    is piecewise constant in the cost), and so does this one, to every finite ε (the
    printed form's rounding, ~ε 1e-16, would be ~1e292 at ε = 1e308). Nothing cancels as
    mu -> 1 either, where ``eta`` and ``kappa`` go to 0 together. At ``mu = 1`` exactly
    (``rho = 0``), the result is the softmax gradient ``-ε (pi * d_pi - n pi * q)``.
    Applied to a non-converged fixed-point result, this is the paper's practice
    (implicit gradient at an approximate solution); it is exact only at the solution.

    Raises ``ValueError`` (naming ``inverse_temperature``) where ``d_cost`` itself
    overflows float64: ε near float64's maximum next to an exact tie of the cost.
    """
    d_rho, d_pi = check_transport_upstream(result, d_rho, d_pi)
    return WeightTransportGrads(cost=closed_form_backward(result, d_rho, d_pi))


def unrolled_backward(result, d_rho, d_pi) -> np.ndarray:
    """Reverse pass through the k fixed-point steps (see :func:`weight_transport_backward_unrolled`)."""
    if result.anchored_tau_history is None:  # mu = 1: the closed form is the limit
        return closed_form_backward(result, d_rho, d_pi)
    n = result.rho.shape[1]
    relative, history, pivot = result.relative_log_s, result.anchored_tau_history, result.pivot
    # Forward (anchored, docs/gsp.md Sec. 4): x = y_{k-1} + r, rho_j = sigma(-x_j) / n,
    # log P_j = y_k + T_j(y_{k-1}) - log n with T_j(y) = r_j - softplus(y + r_j), pi = P A,
    # y_s = log(n mu) - logsumexp_j T_j(y_{s-1}); dT_j/dr_j = sigma(-x_j), dT_j/dy = -sigma(x_j).
    softmax_part, column = _softmax_part(result.assignment, result.pi, d_pi)
    k = history.shape[1] - 1
    x = history[:, k - 1, None] + relative
    sig, sig_minus = _sigmoid(x), _sigmoid(-x)
    weighted = column * result.pi.sum(axis=1)          # P_j * dL/dP_j
    through_rho = d_rho * sig * sig_minus / n          # -dL/dx_j through rho
    d_relative = weighted * sig_minus - through_rho
    d_y = weighted.sum(axis=1)                         # adjoint of y_k
    d_y_prev = -np.sum(weighted * sig + through_rho, axis=1)  # of y_{k-1}, direct part
    for s in range(k, 0, -1):
        # sigma(y_{s-1} + r) is recomputed from the stored y: O(k B) memory instead of
        # the O(k B n) of keeping every step's sigmoids.
        x = history[:, s - 1, None] + relative
        share = np.exp(_column_terms(history[:, s - 1], relative))
        share /= share.sum(axis=1, keepdims=True)      # softmax_j T_j, no cancellation
        d_relative -= d_y[:, None] * share * _sigmoid(-x)
        d_prev = d_y * np.sum(share * _sigmoid(x), axis=1)  # = r, the contraction rate, at the root
        d_y = d_prev + d_y_prev if s == k else d_prev
    # l = a + r. Anchored at a pivot p: a = l_p enters through y_0 = a and through every
    # r_j = l_j - l_p (j != p; r_p = 0 is a constant). Anchored at 0: y_0 = 0, r = l.
    d_log_s = d_relative.copy()
    rows = np.flatnonzero(pivot >= 0)
    if rows.size:
        p = pivot[rows]
        others = d_relative[rows].sum(axis=1) - d_relative[rows, p]
        d_log_s[rows, p] = d_y[rows] - others
    return _scaled_gradient(
        result.inverse_temperature, softmax_part + result.assignment * d_log_s[:, None, :]
    )


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

    Memory wins over recomputation here, on purpose: only the anchored ``tau_0..tau_k``
    and ``l - a`` are stored (``result.anchored_tau_history``, ``result.relative_log_s``:
    O(k + n) per image), and each step's ``sigma(tau_{s-1} + l)`` (O(n) per image and
    step) is recomputed from them in the reverse pass, which runs in the same anchored
    coordinates as the forward (docs/gsp.md Sec. 4), so it stays accurate at any ε. As k
    grows the result approaches
    :func:`weight_transport_backward` (at rate ``r^k``, ``r`` =
    :attr:`WeightTransportResult.contraction_rate`). At ``mu = 1`` the result is the
    limit, so this returns the closed-form (softmax) gradient. A validation operator
    (the paper's Alg. 3 differentiated by unrolling), not part of the layer's default.
    """
    d_rho, d_pi = check_transport_upstream(result, d_rho, d_pi)
    check_unrolled(result)
    return WeightTransportGrads(cost=unrolled_backward(result, d_rho, d_pi))
