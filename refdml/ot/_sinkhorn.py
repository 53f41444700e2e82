"""The batched log-domain Sinkhorn solver of entropic OT (Wasserstein DML Eq. (3)).

For weights ``a`` (n,), ``b`` (m,) on the simplex and a cost ``C`` (n, m)::

    OT_eps(a, b) = min_{pi in Pi(a, b)}  <pi, C> + eps KL(pi | a (x) b)

with ``KL(pi | a (x) b) = sum_ij pi_ij log(pi_ij / (a_i b_j))``. The optimal plan is
``pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` for dual potentials ``f``, ``g``, and
``OT_eps = <a, f> + <b, g>``. The potentials are unique only up to ``(f + t, g - t)``.

``eps`` is the entropic regularisation (POT's ``reg``), a temperature in the units of the
cost: the kernel is ``exp(-C / eps)``, larger ``eps`` is smoother.

POT's ``ot.sinkhorn`` penalises ``reg * sum pi (log pi - 1)`` instead of the KL to
``a (x) b``: the difference is constant on ``Pi(a, b)``, so the plans agree and the values
differ; ``ot.sinkhorn2`` returns ``<pi, C>`` alone (our ``transport_cost``).

Solver details (kernel absorption, the symmetric update, eps-scaling): docs/ot.md, Sec. 2.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale
from refdml._validation import as_float_array, check_scalar
from refdml._backend import get_backend
from refdml.exceptions import ConvergenceWarning

__all__ = ["SinkhornResult", "sinkhorn"]

#: The OT value conventions: the regularised value of Eq. (3), or ``<pi, C>`` alone.
VALUES = ("regularized", "transport_cost")
# Scalings outside [exp(-_ABSORB), exp(_ABSORB)] are folded into the potentials and the
# kernel is rebuilt in the log domain; inside that range the kernel iteration is exact
# in float64 and costs one batched mat-vec per half step instead of an exp per entry.
_ABSORB = 30.0
_ABSORB_HIGH = float(np.exp(_ABSORB))
_ABSORB_LOW = float(np.exp(-_ABSORB))
# A row or column mass below this cannot be rescaled without losing digits: rebuild.
_TINY = 1e-250
# Intermediate eps-scaling stages only warm-start the next one.
_STAGE_TOL = 1e-3
# Most eps-scaling stages (eps_scaling = 0.999 from 1 down to 1e-13 takes 3e4).
_MAX_STAGES = 1e5
# eps relative to the largest cost that float64 resolves. Below _MIN_RELATIVE_EPS the
# kernel exp(-C / eps) cannot tell apart costs that differ by their own rounding error;
# above _MAX_RELATIVE_EPS the potentials' rounding error eps * 2^-52 exceeds ~1e-4 of the
# cost, so the regularised value would have no correct digits left in its eps-dependence.
_MIN_RELATIVE_EPS = 1e-13
_MAX_RELATIVE_EPS = 1e12


# ----------------------------------------------------------------------------------------
# Result objects


@dataclass(frozen=True)
class SinkhornResult:
    """Solution of one (or a batch of) entropic OT problems.

    Leading batch dimensions ``...`` are those of the inputs; for a single problem the
    scalar fields are Python scalars.

    Attributes
    ----------
    plan : (..., n, m) optimal coupling ``pi``.
    f, g : (..., n), (..., m) dual potentials, ``pi = a b^T exp((f + g^T - C) / eps)``.
    value : regularised value of Eq. (3), ``<pi, C> + eps KL(pi | a (x) b) = <a,f> + <b,g>``.
    transport_cost : ``<pi, C>``.
    n_iter : Sinkhorn iterations (over all eps-scaling stages; each stage starts with one
        extra log-domain half step, and where ``eps`` exceeds the largest cost the solve
        ends with three exact log-domain half steps that keep the potentials' digits,
        neither counted).
    marginal_error : L1 violation of the row marginal at the last counted iteration (the
        stopping rule's; where ``eps`` exceeds the largest cost the plan returned is three
        uncounted half steps further, its error at most this up to rounding). Columns are
        exact on return.
    converged : ``marginal_error <= tol``. The plan itself can be further off than ``tol``
        where it nearly decouples into blocks (eps small against the gaps between
        clusters): the flows between blocks barely move the marginals.
    eps : the regularisation.
    """

    plan: np.ndarray
    f: np.ndarray
    g: np.ndarray
    value: np.ndarray | float
    transport_cost: np.ndarray | float
    n_iter: np.ndarray | int
    marginal_error: np.ndarray | float
    converged: np.ndarray | bool
    eps: float

    @property
    def residual(self):
        """Alias of ``marginal_error`` (the residual every refdml solver reports)."""
        return self.marginal_error


@dataclass(frozen=True)
class _OTBatch:
    """P independent problems of equal size, weights normalised, solved.

    The solver works in rescaled units: ``cost`` and ``eps`` here are the user's divided
    by ``unit`` (a power of two, so exactly), and so are ``f`` and ``g``; ``value`` and
    ``transport_cost`` are returned in the user's units. The plan does not depend on it.
    """

    a: np.ndarray            # (P, n) on the simplex
    b: np.ndarray            # (P, m)
    cost: np.ndarray         # (P, n, m), in units of `unit`
    eps: float               # in units of `unit`
    f: np.ndarray            # (P, n), in units of `unit`
    g: np.ndarray            # (P, m)
    plan: np.ndarray         # (P, n, m)
    n_iter: np.ndarray       # (P,)
    marginal_error: np.ndarray
    converged: np.ndarray
    unit: float = 1.0

    @property
    def value(self) -> np.ndarray:
        # The dual objective; its last term, eps (mass - 1), vanishes when the plan has unit
        # mass (exactly so after a column update). mass - 1 is summed as
        # sum a_i b_j expm1((f_i + g_j - C_ij) / eps), not as sum(plan) - 1: at eps >> C the
        # plan is a b^T to ~C / eps and sum(plan) - 1 would cost eps * ulp (docs/ot.md).
        excess = _mass_excess(self.a, self.b, self.f, self.g, self.cost, self.eps)
        scaled = (np.einsum("pi,pi->p", self.a, self.f) + np.einsum("pj,pj->p", self.b, self.g)
                  - self.eps * excess)
        return self.unit * scaled

    @property
    def transport_cost(self) -> np.ndarray:
        return self.unit * np.einsum("pij,pij->p", self.plan, self.cost)


# ----------------------------------------------------------------------------------------
# The batched solver


def _log_g_update(log_a, b, cost, f, eps):
    """Exact g-update in the log domain; returns g and the plan for unit scalings.

    ``g_j = -eps log sum_i a_i exp((f_i - C_ij) / eps)``. The returned kernel
    ``K_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` has columns summing to ``b`` exactly,
    so every entry is at most 1: nothing can overflow, small entries may underflow.
    """
    exponent = (f[:, :, None] - cost) / eps
    exponent += log_a[:, :, None]
    peak = exponent.max(axis=1, keepdims=True)
    exponent -= peak
    np.exp(exponent, out=exponent)
    mass = exponent.sum(axis=1, keepdims=True)          # >= 1: the peak contributes 1
    g = -eps * (peak[:, 0, :] + np.log(mass[:, 0, :]))
    exponent *= b[:, None, :] / mass
    return g, exponent


def _log_symmetric_update(log_a, cost, f, eps):
    """Averaged symmetric update ``f <- (f + T(f)) / 2`` in the log domain (Feydy et al.).

    ``T(f)_i = -eps log sum_j a_j exp((f_j - C_ij) / eps)``. Returns the new ``f`` and
    ``K_ij = a_i a_j exp((f_i + f_j - C_ij) / eps)``, the geometric mean of a kernel with
    rows summing to ``a`` and its transpose, hence ``K_ij <= sqrt(a_i a_j) <= 1``.
    """
    exponent = (f[:, None, :] - cost) / eps
    exponent += log_a[:, None, :]
    peak = exponent.max(axis=2, keepdims=True)
    lse = peak[:, :, 0] + np.log(np.exp(exponent - peak).sum(axis=2))
    f_new = 0.5 * (f - eps * lse)
    exponent += log_a[:, :, None] + (f_new[:, :, None] + f_new[:, None, :] - f[:, None, :]) / eps
    return f_new, np.exp(exponent, out=exponent)


def _log_weighted_sum_exp(log_w, w, h, axis):
    """``log sum_k w_k exp(h_k)`` along ``axis``, ``w`` on the simplex (``log_w`` its log).

    Two forms, each entry taking the more accurate. With ``M = max_k h_k`` and
    ``y = sum_k w_k expm1(h_k - M)`` (terms of one sign, so ``y`` is exact to a few ulp of
    itself), the value is ``M + log1p(y)``, accurate to a few ulp of ``|y|`` while
    ``y >= -1/2``. At ``eps >> C`` every ``h_k - M`` is ``O(C / eps)`` and so is ``y``:
    this keeps the potential ``-eps LSE`` to the cost's own rounding, where the usual
    ``P + log(sum exp(log w + h - P))`` rounds a sum near 1 to an ulp, ``eps ulp`` in the
    potential (``eps / C`` times more). Where ``y < -1/2`` (``h`` spread over units, a small
    weight at its peak) ``log1p`` near -1 would magnify the rounding of ``y``: the usual form.
    Written for NumPy or CuPy arrays (the fast path's solver ends its solves with it too),
    in their dtype.
    """
    xp = get_backend(h).xp
    peak = xp.max(h, axis=axis, keepdims=True)
    y = xp.sum(w * xp.expm1(h - peak), axis=axis)
    z = log_w + h
    top = xp.max(z, axis=axis, keepdims=True)
    usual = xp.squeeze(top, axis) + xp.log(xp.sum(xp.exp(z - top), axis=axis))
    near = xp.squeeze(peak, axis) + xp.log1p(xp.maximum(y, -0.5))
    return xp.where(y >= -0.5, near, usual)


def _finish_large_eps(log_a, a, b, cost, eps, f, g, plan):
    """End the solve of every problem whose ``eps`` exceeds its largest cost with three
    exact log-domain half steps from ``f``: ``g = G(f)``, ``f = F(g)``, ``g = G(f)``.

    ``f``, ``g`` (P, n), (P, m) and ``plan`` (P, n, m) from :func:`_stage` are updated in
    place on those problems (columns exact there too) and returned. Why: the kernel
    iteration holds the potentials' information in the last digits of
    ``K_ij = a_i b_j exp(O(C / eps))`` and stops on an L1 marginal error ``tol``, which
    fixes them to ``eps ulp`` and ``eps tol`` (the averaged symmetric update approaches
    the latter at rate 1/2 when ``eps >> C``): at ``eps = 1e6 C``, 1e-10 and 1e-6 of the
    cost. Each half step contracts the non-constant part of an error by
    ``kappa = tanh(max C / (4 eps)) < 1/4`` (Birkhoff-Hopf), so ``f`` comes out with
    ``kappa^2`` of it and ``g`` with ``kappa^3``, and its log-sum-exp
    (:func:`_log_weighted_sum_exp`) keeps the cost's own digits. Where ``eps <= max C``
    both limits are already below ``tol`` times the cost, and the problem is left as it
    is. The constant part of an error (the gauge ``(f + t, g - t)``) changes neither the
    value nor the centred weight gradients; a symmetric problem gets ``g != f`` by it.
    """
    far = eps > np.abs(cost).max(axis=(1, 2))
    if not far.any():
        return f, g, plan
    log_a, a, cost, b = log_a[far], a[far], cost[far], b[far]
    with np.errstate(divide="ignore"):  # a weight below 2^-1074 after normalising: no mass
        log_b = np.log(b)
    f[far], g[far], plan[far] = _large_eps_half_steps(log_a, a, log_b, b, cost, eps, f[far])
    return f, g, plan


def _large_eps_half_steps(log_a, a, log_b, b, cost, eps, f, *, want_plan=True):
    """``(f, g, plan)`` after the half steps ``g = G(f)``, ``f = F(g)``, ``g = G(f)`` of
    :func:`_finish_large_eps` (P problems, ``log_a``/``log_b`` the weights' logs; ``plan``
    None without ``want_plan``), on NumPy or CuPy arrays: the fast path's solver ends
    with them too."""
    xp = get_backend(f).xp

    def g_from(f):
        return -eps * _log_weighted_sum_exp(log_a[:, :, None], a[:, :, None],
                                            (f[:, :, None] - cost) / eps, axis=1)

    g = g_from(f)
    f = -eps * _log_weighted_sum_exp(log_b[:, None, :], b[:, None, :],
                                     (g[:, None, :] - cost) / eps, axis=2)
    g = g_from(f)
    plan = None
    if want_plan:
        plan = xp.exp(log_a[:, :, None] + log_b[:, None, :]
                      + (f[:, :, None] + g[:, None, :] - cost) / eps)
    return f, g, plan


def _mass_excess(a, b, f, g, cost, eps):
    """``mass - 1`` of the plan ``a_i b_j exp((f_i + g_j - C_ij) / eps)`` (P,), summed as
    ``sum a_i b_j expm1(...)``: at ``eps >> C`` the plan is ``a b^T`` to ``O(C / eps)`` and
    ``sum(plan) - 1`` would cost ``eps ulp``. NumPy or CuPy arrays (the fast path's value
    uses it too)."""
    xp = get_backend(f).xp
    exponent = (f[:, :, None] + g[:, None, :] - cost) / eps
    return xp.einsum("pi,pj,pij->p", a, b, xp.expm1(exponent))


def _stage(log_a, a, b, cost, eps, f, g, *, tol, max_iter, want_plan, symmetric):
    """Sinkhorn at one eps for P problems, freezing each problem once it converges.

    Iterations run on scalings ``u``, ``v`` of a kernel with the potentials absorbed
    (``pi = u K v``); the kernel is rebuilt in the log domain when a scaling leaves
    ``exp(+-_ABSORB)``. Symmetric problems (``b = a``, ``C = C^T``) use one scaling and
    the averaged update ``u <- sqrt(u a / (K u))``: alternating updates converge very
    slowly there when the plan is nearly diagonal. Returns potentials, plans (if
    asked), iterations and errors.
    """
    n_problems = cost.shape[0]
    out_f, out_g = f.copy(), g.copy()
    out_plan = np.empty_like(cost) if want_plan else None
    out_iter = np.zeros(n_problems, dtype=np.int64)
    out_err = np.full(n_problems, np.inf)

    active = np.arange(n_problems)
    la, aa, bb, cc = log_a, a, b, cost
    ff = f.copy()
    if symmetric:
        ff, kernel = _log_symmetric_update(la, cc, ff, eps)
        gg = ff
    else:
        gg, kernel = _log_g_update(la, bb, cc, ff, eps)
    u = np.ones_like(aa)
    v = u if symmetric else np.ones_like(bb)
    for it in range(max_iter + 1):
        row = np.einsum("pij,pj->pi", kernel, v)
        err = np.abs(u * row - aa).sum(axis=1)
        done = err <= tol
        if it == max_iter:
            done[:] = True
        if done.any():
            idx = active[done]
            out_f[idx] = ff[done] + eps * np.log(u[done])
            out_g[idx] = gg[done] + eps * np.log(v[done])
            if want_plan:
                out_plan[idx] = u[done, :, None] * kernel[done] * v[done, None, :]
            out_iter[idx] = it
            out_err[idx] = err[done]
            keep = ~done
            if not keep.any():
                break
            active = active[keep]
            la, aa, bb, cc = la[keep], aa[keep], bb[keep], cc[keep]
            ff, u, row, kernel = ff[keep], u[keep], row[keep], kernel[keep]
            gg = ff if symmetric else gg[keep]
            v = u if symmetric else v[keep]
        if symmetric:
            u = np.sqrt(u * aa / np.maximum(row, _TINY))
            v = u
            col = row
        else:
            u = aa / np.maximum(row, _TINY)
            col = np.einsum("pij,pi->pj", kernel, u)
            v = bb / np.maximum(col, _TINY)
        rebuild = (
            (u.max(axis=1) > _ABSORB_HIGH) | (u.min(axis=1) < _ABSORB_LOW)
            | (v.max(axis=1) > _ABSORB_HIGH) | (v.min(axis=1) < _ABSORB_LOW)
            | (row.min(axis=1) < _TINY) | (col.min(axis=1) < _TINY)
        )
        if rebuild.any():
            ff[rebuild] += eps * np.log(u[rebuild])
            if symmetric:
                f_new, k_new = _log_symmetric_update(la[rebuild], cc[rebuild], ff[rebuild], eps)
                ff[rebuild] = f_new
                gg = ff
            else:
                f_new, k_new = _log_g_update(la[rebuild], bb[rebuild], cc[rebuild], ff[rebuild], eps)
                gg[rebuild] = f_new
            kernel[rebuild] = k_new
            u[rebuild] = 1.0
            if not symmetric:
                v[rebuild] = 1.0
    return out_f, out_g, out_plan, out_iter, out_err


def _check_schedule_length(start: float, eps: float, eps_scaling: float) -> None:
    """Refuse an ``eps_scaling`` so close to 1 that the schedule ``start, start q, ...``
    down to ``eps`` has more than ``_MAX_STAGES`` stages (it would run, or be built, for
    hours: at ``q = 1 - 1e-16`` each stage lowers eps by one ulp)."""
    if not start > eps:
        return
    with np.errstate(divide="ignore"):
        stages = float(np.log(eps / start) / np.log(eps_scaling))
    if not stages <= _MAX_STAGES:
        raise ValueError(
            f"eps_scaling == {eps_scaling!r} needs {stages:.3g} eps-scaling stages from the "
            f"largest cost down to eps (eps / max C == {eps / start:.3g}), more than "
            f"{_MAX_STAGES:g}: take a smaller factor (0.5 halves eps at each stage)"
        )


def _eps_schedule(cost: np.ndarray, eps: float, eps_scaling: float | None) -> list[float]:
    if eps_scaling is None:
        return [eps]
    start = float(np.max(cost))
    _check_schedule_length(start, eps, eps_scaling)
    schedule = []
    level = start
    while level > eps:
        schedule.append(level)
        level *= eps_scaling
    return schedule + [eps]


def _solve_batch(a, b, cost, *, eps, max_iter, tol, eps_scaling, symmetric=False,
                 unit=1.0) -> _OTBatch:
    """Solve P problems (a (P,n), b (P,m) on the simplex, cost (P,n,m)) together.

    ``symmetric=True`` promises ``b = a`` and ``C = C^T`` (the terms OT(mu, mu) of Eq. (4)).
    ``cost`` and ``eps`` are in units of ``unit`` (see :class:`_OTBatch`).
    """
    log_a = np.log(a)
    n_problems, n, m = cost.shape
    f = np.zeros((n_problems, n))
    g = np.zeros((n_problems, m))
    n_iter = np.zeros(n_problems, dtype=np.int64)
    schedule = _eps_schedule(cost, eps, eps_scaling)
    for level in schedule[:-1]:
        f, g, _, it, _ = _stage(
            log_a, a, b, cost, level, f, g,
            tol=max(tol, _STAGE_TOL), max_iter=max_iter, want_plan=False, symmetric=symmetric,
        )
        n_iter += it
    f, g, plan, it, err = _stage(
        log_a, a, b, cost, eps, f, g, tol=tol, max_iter=max_iter, want_plan=True,
        symmetric=symmetric,
    )
    n_iter += it
    f, g, plan = _finish_large_eps(log_a, a, b, cost, eps, f, g, plan)
    converged = err <= tol
    _warn_unconverged(err, converged, max_iter=max_iter, tol=tol, stacklevel=4)
    return _OTBatch(a, b, cost, eps, f, g, plan, n_iter, err, converged, unit)


def _warn_unconverged(err, converged, *, max_iter, tol, stacklevel) -> None:
    """The :class:`refdml.ConvergenceWarning` of a batch solve (``err``, ``converged``
    (P,)), shared by refdml's solver and POT's (:mod:`refdml.ot._pot`); ``stacklevel`` as
    the caller would give it to ``warnings.warn``.

    tol = 0 asks for a fixed number of iterations: converged only where the residual is
    exactly 0, and no warning (the count was asked for). Otherwise the solvers stop only
    on tol or on max_iter, so the warning says why they stopped.
    """
    if tol > 0.0 and not converged.all():
        warnings.warn(
            f"Sinkhorn stopped at max_iter={max_iter} iterations above tol={tol:g} for "
            f"{int((~converged).sum())} of {converged.size} problem(s) (largest marginal "
            f"error {float(err.max()):.3g}); increase max_iter, eps, or use eps_scaling",
            ConvergenceWarning,
            stacklevel=stacklevel + 1,
        )


# ----------------------------------------------------------------------------------------
# Input checks shared by the public functions of refdml.ot


def _check_solver_args(eps, max_iter, tol, eps_scaling):
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    # The iteration counters are int64 (so are the fast path's compiled solver's).
    max_iter = check_scalar(max_iter, "max_iter", low=1, high=np.iinfo(np.int64).max,
                            integer=True)
    tol = check_scalar(tol, "tol", low=0.0)
    if eps_scaling is not None:
        eps_scaling = check_scalar(
            eps_scaling, "eps_scaling", low=0.0, high=1.0, low_inclusive=False,
            high_inclusive=False,
        )
    return eps, max_iter, tol, eps_scaling


def _solve_scaled(a, b, cost, *, eps, max_iter, tol, eps_scaling) -> _OTBatch:
    """:func:`_solve_batch` on a user's cost matrix of any finite scale.

    The cost and ``eps`` are divided by one power of two (exact) so that the largest cost
    is in [0.5, 1): every exponent ``(f + g - C) / eps`` and every sum stays in range.
    """
    unit = common_scale(cost)
    cost = cost / unit
    scaled_eps = eps / unit
    _check_relative_eps(scaled_eps, float(np.max(np.abs(cost))), user_eps=eps,
                        data_name="cost", unit=unit)
    return _solve_batch(a, b, cost, eps=scaled_eps, max_iter=max_iter, tol=tol,
                        eps_scaling=eps_scaling, unit=unit)


def _check_relative_eps(eps: float, largest_cost: float, *, user_eps: float | None = None,
                        cost_name: str = "the largest cost", data_name: str | None = None,
                        unit: float = 1.0, p: float | None = None) -> None:
    """Refuse an ``eps`` that float64 cannot resolve against the cost scale.

    ``eps`` and ``largest_cost`` in the same (possibly rescaled) units, ``unit`` the
    power of two they were divided by; ``user_eps`` is the value the user passed, for the
    message. A zero cost is fine at any ``eps``. See :func:`_relative_eps_message`.
    """
    message = _relative_eps_message(
        eps, largest_cost, low=_MIN_RELATIVE_EPS, high=_MAX_RELATIVE_EPS, dtype_name="float64",
        user_eps=user_eps, cost_name=cost_name, data_name=data_name, unit=unit, p=p,
    )
    if message is not None:
        raise ValueError(message)


def _format_log2(log2_value: float) -> str:
    """``2 ** log2_value`` as ``"%.3g"`` would print it, also beyond float64's range."""
    if abs(log2_value) < 1000.0:
        return f"{float(np.exp2(log2_value)):.3g}"
    log10_value = log2_value * float(np.log10(2.0))
    exponent = int(np.floor(log10_value))
    mantissa = float(10.0 ** (log10_value - exponent))
    if mantissa >= 9.995:  # "%.3g" would round it up to 10
        mantissa, exponent = 1.0, exponent + 1
    return f"{mantissa:.3g}e{exponent:+03d}"


def _interval(low_log2: float, high_log2: float) -> str:
    return f"[{_format_log2(low_log2)}, {_format_log2(high_log2)}]"


def _relative_eps_message(eps: float, largest_cost: float, *, low: float, high: float,
                          dtype_name: str, user_eps: float | None = None,
                          cost_name: str = "the largest cost", data_name: str | None = None,
                          unit: float = 1.0, p: float | None = None) -> str | None:
    """The message of an ``eps`` that ``dtype_name`` cannot resolve, or None if it can.

    Only the ratio ``eps / max C`` matters (scaling the data, hence the costs, and eps
    together changes nothing), so which of the two is "wrong" is a judgement: the message
    leads with the one further from 1 on a log scale (``eps`` on a tie) and gives both
    remedies, the range of the largest cost at this ``eps`` and the range of ``eps`` at
    these data. ``data_name`` names the data parameter (``"features"``, ``"cost"``, ...);
    without it the message leads with ``eps``. ``p``: the exponent of a ground cost
    ``||x - y||^p``, to translate the cost range into one of distances. Shared by the
    reference and the fast path (which passes its dtype's limits) so that both say the same.
    """
    if largest_cost == 0.0:
        return None
    ratio = eps / largest_cost
    if low <= ratio <= high:
        return None
    shown = eps if user_eps is None else user_eps
    too_small = not ratio >= low
    # Logarithms of the user's values: the costs times `unit` may lie beyond float64.
    log2_eps = float(np.log2(shown))
    log2_cost = float(np.log2(largest_cost)) + float(np.log2(unit))
    log2_ratio = log2_eps - log2_cost
    limit = low if too_small else high
    side = "below" if too_small else "above"
    alternative = "an exact OT solver" if dtype_name == "float64" else "float64 or an exact solver"
    if too_small:
        reason = (f"in {dtype_name} the kernel exp(-C / eps) cannot resolve the costs "
                  f"({alternative} may)")
    else:
        reason = (f"the regularised value would have no correct digits left in {dtype_name} "
                  "(the plan is the independent coupling a b^T)")
    log2_low, log2_high = float(np.log2(low)), float(np.log2(high))
    eps_range = _interval(log2_cost + log2_low, log2_cost + log2_high)
    cost_range = _interval(log2_eps - log2_high, log2_eps - log2_low)
    given = "here" if data_name is None else f"for the {data_name} given"
    distances = ""
    if p is not None:
        distances = (f" (with p == {p:g}: the largest distance ||x - y|| in "
                     f"{_interval((log2_eps - log2_high) / p, (log2_eps - log2_low) / p)})")
    if data_name is not None and abs(log2_cost) > abs(log2_eps):
        return (
            f"{data_name} out of range for eps == {shown!r}: {cost_name} is "
            f"{_format_log2(log2_cost)}, and eps is {_format_log2(log2_ratio)} times it, "
            f"{side} {limit:g}: {reason}. At eps == {shown!r}, {cost_name} must lie in "
            f"{cost_range}{distances}: rescale {data_name}, or scale eps with the data (eps "
            f"is in the units of the cost; {given}, eps must lie in {eps_range})"
        )
    return (
        f"eps == {shown!r} is {_format_log2(log2_ratio)} times {cost_name}, {side} "
        f"{limit:g}: {reason}. eps is in the units of the cost, so scale it with the data: "
        f"{given}, eps must lie in {eps_range}"
    )


def _check_weights(w, name: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positive weights of length ``size`` (leading batch dims allowed); returns (w/|w|, |w|)."""
    w = as_float_array(w, name, min_ndim=1)
    if w.shape[-1] != size:
        raise ValueError(f"{name} has {w.shape[-1]} entries along its last axis, expected {size}")
    if np.any(w <= 0.0):
        bad = tuple(int(i) for i in np.argwhere(w <= 0.0)[0])
        raise ValueError(
            f"{name} must be positive, got {w[bad]} at index {bad} "
            "(drop zero-weight points instead)"
        )
    # Divide by the largest weight first: the sum of weights near 1e308 must not overflow.
    peak = w.max(axis=-1, keepdims=True)
    w = w / peak
    scaled_mass = w.sum(axis=-1)
    with np.errstate(over="ignore"):
        mass = scaled_mass * peak[..., 0]
    return w / scaled_mass[..., None], mass


def _batch_shape(a_shape, b_shape, cost_shape) -> tuple[int, ...]:
    """The common batch shape of ``a`` (..., n), ``b`` (..., m) and ``cost`` (..., n, m).

    A ``ValueError`` names the weights whose leading dimensions do not broadcast with
    the cost's (or with each other's), with the shapes.
    """
    a_batch, b_batch, cost_batch = tuple(a_shape[:-1]), tuple(b_shape[:-1]), tuple(cost_shape[:-2])
    for name, batch, shape in (("a", a_batch, a_shape), ("b", b_batch, b_shape)):
        try:
            np.broadcast_shapes(cost_batch, batch)
        except ValueError:
            raise ValueError(
                f"{name} has batch shape {batch} (shape {tuple(shape)} without its last axis), "
                f"which does not broadcast with the batch shape {cost_batch} of cost (shape "
                f"{tuple(cost_shape)})"
            ) from None
    try:
        return np.broadcast_shapes(cost_batch, a_batch, b_batch)
    except ValueError:
        raise ValueError(
            f"a and b have batch shapes {a_batch} and {b_batch} (shapes without the last "
            f"axis), which do not broadcast with each other and cost's {cost_batch}"
        ) from None


def _weight_gradient(gradient: np.ndarray, mass, name: str) -> np.ndarray:
    """``gradient / mass``: from the normalised weights back to the weights as given.

    The gradient w.r.t. ``a`` scales as ``1 / sum(a)``: beyond float64 for weights of
    subnormal sum (a named ValueError, never ``inf``).
    """
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        out = gradient / mass
    if not np.all(np.isfinite(out)):
        raise ValueError(_weight_gradient_message(name, float(np.min(mass)), "float64"))
    return out


def _weight_gradient_message(name: str, mass: float, dtype_name: str) -> str:
    return (
        f"the gradient with respect to {name} overflows {dtype_name}: {name} enters through "
        f"{name} / sum({name}), so its gradient scales as 1 / sum({name}), and sum({name}) == "
        f"{mass:.3g}; rescale {name}"
    )


def _as_batch(a, b, cost):
    """Broadcast weights and cost to (P, n), (P, m), (P, n, m); return the batch shape too."""
    n, m = cost.shape[-2:]
    batch_shape = _batch_shape(a.shape, b.shape, cost.shape)
    cost_b = np.broadcast_to(cost, batch_shape + (n, m)).reshape(-1, n, m)
    a_b = np.broadcast_to(a, batch_shape + (n,)).reshape(-1, n)
    b_b = np.broadcast_to(b, batch_shape + (m,)).reshape(-1, m)
    return np.ascontiguousarray(a_b), np.ascontiguousarray(b_b), np.array(cost_b), batch_shape


def _unbatch(array: np.ndarray, batch_shape: tuple[int, ...]):
    out = array.reshape(batch_shape + array.shape[1:])
    return out.item() if out.ndim == 0 else out


# ----------------------------------------------------------------------------------------
# Public solver


def sinkhorn(a, b, cost, *, eps, max_iter=1000, tol=1e-9, eps_scaling=None) -> SinkhornResult:
    """Entropic OT of Eq. (3) by log-stabilised Sinkhorn, for one problem or a batch.

    .. math::

        \\min_{\\pi \\in \\Pi(a, b)} \\langle \\pi, C \\rangle
        + \\varepsilon\\, \\mathrm{KL}(\\pi \\,\\|\\, a \\otimes b)

    Parameters
    ----------
    a : (..., n) positive weights (normalised to sum 1).
    b : (..., m) positive weights (normalised to sum 1).
    cost : (..., n, m) cost matrix; leading dimensions of ``a``, ``b`` and ``cost``
        broadcast, and every problem of the batch is solved in one vectorised loop.
    eps : float > 0, the entropic regularisation (a temperature, in the units of
        ``cost``). Down to ``1e-3`` of the cost scale the iteration converges in
        reasonable time; use ``eps_scaling`` there for speed. Outside
        ``[1e-13, 1e12]`` times the largest ``|C|`` float64 cannot resolve the problem:
        ``ValueError``. The cost may have any finite scale (it is rescaled exactly).
    max_iter : iterations per eps stage.
    tol : float >= 0, L1 marginal error at which a problem is converged (and frozen).
        ``tol = 0`` runs exactly ``max_iter`` iterations (per stage) and does not warn.
    eps_scaling : None or a factor in (0, 1): solve at ``max(C), max(C) q, ...`` down to
        ``eps``, each stage warm-starting the next (only loosely converged). A factor so
        close to 1 that this takes more than 1e5 stages is a ``ValueError``.

    Returns
    -------
    SinkhornResult
        Warns :class:`refdml.ConvergenceWarning` if a problem did not reach ``tol``.
    """
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    cost = as_float_array(cost, "cost", min_ndim=2)
    a, _ = _check_weights(a, "a", cost.shape[-2])
    b, _ = _check_weights(b, "b", cost.shape[-1])
    a_b, b_b, cost_b, batch_shape = _as_batch(a, b, cost)
    batch = _solve_scaled(a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling)
    return SinkhornResult(
        plan=_unbatch(batch.plan, batch_shape),
        f=_unbatch(batch.unit * batch.f, batch_shape),
        g=_unbatch(batch.unit * batch.g, batch_shape),
        value=_unbatch(batch.value, batch_shape),
        transport_cost=_unbatch(batch.transport_cost, batch_shape),
        n_iter=_unbatch(batch.n_iter, batch_shape),
        marginal_error=_unbatch(batch.marginal_error, batch_shape),
        converged=_unbatch(batch.converged, batch_shape),
        eps=eps,
    )


