r"""GSP (P2) on the fast path: batched log-domain solve and Prop. 4.3's closed-form backward.

Private module of :mod:`refdml.gpu.gsp` (which re-exports the public names). The maths
is the reference's (:mod:`refdml.gsp._transport`, docs/gsp.md Secs. 2-3); what differs
is how it is computed:

* Memory layout. Arrays of shape ``(B, m, n)`` (cost, pi, assignment) are held as
  ``(B, n, m)`` in memory and handed out as transposed views, so that the softmax over
  prototypes, the column sums and the matrix products of the backward all run along
  the contiguous axis and the cost map is one large matrix product.
* Solver. ``g(tau) = (1/n) sum_j sigma(tau + l_j) = mu`` is solved for all images at
  once, as the reference does it (docs/gsp.md Sec. 2): the logits are formed as
  ``y + (l_j - l_p)`` in the coordinates of a pivot feature ``p`` (from cost
  differences), ``p`` found by a bisection over the features sorted by their column
  minimum (a fixed ``ceil(log2(n + 1))`` vectorised steps) and a window of
  ``[-1024, 1024]`` (two more), then vectorised safeguarded-Newton sweeps on
  ``phi = logit(g) - logit(mu)`` in that bracket, each image frozen by its own mask once
  converged. No Python loop over images. The "every image converged?" test runs after
  every sweep on NumPy and once per ``_SWEEPS`` sweeps on CuPy, where it is one
  synchronisation (:meth:`refdml._backend.Backend.check_every`); ``converged`` (a Python
  bool, like the reference's) is one more.
* dtype. Everything runs in the input's dtype (float32 or float64), in the log domain
  (``exp`` only of non-positive numbers); products with ``inverse_temperature`` go
  through :func:`_times`, so an ε beyond the dtype's range (1e300 on float32) gives
  ``inf`` where the product overflows and never ``inf * 0``: the constraints hold at
  every finite ε in both dtypes.

Meaningful tolerance in float32 (the residual floor)
----------------------------------------------------
The residual ``max(max_j |rho_j + sum_i pi_ij - 1/n|, |sum_ij pi_ij - mu|)`` is
evaluated from arrays rounded to the dtype's unit roundoff ``u``: every ``pi_ij`` and
``rho_j`` carries ~3 roundings (sigmoid, softmax, product), the column and total sums
over ``m`` and ``m n`` terms of total mass <= 1 add at most ``~log2(m n) u`` (pairwise
summation), and the solve stops at ``|phi| <= 16 u (1 + |logit mu|)`` i.e. ``|g - mu|
<~ 16 u``. So no computation in that dtype can certify a residual below
``~(log2(m n) + 20) u``; the floor used is twice that,

    floor = (2 log2(m n) + 40) u      (float32, m n = 3136: 7.5e-6; float64: 1.4e-14),

and a positive ``tol`` below it is raised to it (``result.tol`` reports the tolerance
applied). ``tol = 0`` keeps its meaning (run to the rounding floor; converged only if
the residual is exactly 0; no warning). float64 at the default ``tol = 1e-12`` is
unaffected.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from refdml._backend import Backend, get_backend
from refdml.exceptions import ConvergenceWarning
from refdml.gsp import WeightTransportResult

# Newton sweeps between two "every image converged?" checks where a check synchronises
# (CuPy); where it is free (NumPy) it runs after every sweep (Backend.check_every).
_SWEEPS = 3


@dataclass(frozen=True, kw_only=True)
class TransportArgs:
    """(P2)'s arguments as the public function checked them
    (:func:`refdml._shared.gsp.check_transport_args`): ``mu`` in (0, 1],
    ``inverse_temperature`` (the paper's ε), ``max_iter`` (Newton sweeps), ``tol`` (as
    given: :func:`transport` raises a positive one to the dtype's :func:`residual_floor`)."""

    mu: float
    inverse_temperature: float
    max_iter: int
    tol: float


def stopping_rules(dtype, logit_mu: float) -> tuple[float, float, float]:
    """``(ulp, cap, phi_floor)`` of a solve in ``dtype``: the dtype's machine epsilon, the
    cap of a Newton step's ``exp`` (below ``log`` of its largest number) and the rounding
    floor of ``|phi|``, ``16 ulp (1 + |logit mu|)``; one statement for the array path and
    the kernels (:class:`refdml.gpu.gsp._compiled.SolverConstants`), which stop alike."""
    ulp = float(np.finfo(dtype).eps)
    return ulp, float(np.log(np.finfo(dtype).max)) - 2.0, 16.0 * ulp * (1.0 + abs(logit_mu))


def residual_floor(dtype, m: int, n: int) -> float:
    """The smallest residual a computation in ``dtype`` can certify (module docstring)."""
    return float((2.0 * math.log2(m * n) + 40.0) * np.finfo(dtype).eps)


def _log_expit(xp, x):
    """``log sigma(x) = min(x, 0) - log1p(exp(-|x|))`` (finite for every finite x)."""
    return xp.minimum(x, 0) - xp.log1p(xp.exp(-xp.abs(x)))


def _expit(xp, x):
    return xp.exp(_log_expit(xp, x))


def _log_expit_pair(xp, x):
    """``log sigma(x)`` and ``log sigma(-x)``, sharing ``log1p(exp(-|x|))``; right at ``±inf``
    (where ``log sigma(x) - x`` would be ``inf - inf``)."""
    tail = xp.log1p(xp.exp(-xp.abs(x)))
    return xp.minimum(x, 0) - tail, -xp.maximum(x, 0) - tail


def _lse(xp, a, axis: int):
    """``log sum exp`` along ``axis`` of small arrays; ``-inf`` for all ``-inf`` rows."""
    peak = xp.max(a, axis=axis, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0)
    return xp.log(xp.sum(xp.exp(a - peak), axis=axis)) + xp.squeeze(peak, axis=axis)


def _times(xp, x, factor: float, out=None):
    """``factor * x`` in ``x``'s dtype for any finite ``factor``, in place with ``out=x``.

    A ``factor`` outside the dtype's normal range (ε = 1e300 on float32) would be cast to
    ``inf`` (or 0) first, and ``inf * 0`` is NaN; it is applied as a power of two instead
    (``ldexp``), so the product is ``±inf`` (0) exactly where it overflows (underflows).
    """
    info = np.finfo(x.dtype)
    with np.errstate(over="ignore", under="ignore"):
        if factor == 0.0 or info.tiny <= abs(factor) <= info.max:
            return xp.multiply(x, factor, out=out)
        mantissa, exponent = math.frexp(factor)
        scaled = xp.multiply(x, mantissa, out=out)
        return xp.ldexp(scaled, exponent, out=scaled)


def _scaled_gap(xp, a, b, inverse_temperature: float):
    """``ε (a - b)`` with no overflow of ``a - b`` (halved first; the reference's
    ``_scaled_gap``): ``±inf`` only where the product overflows."""
    gap = xp.multiply(a, 0.5)
    gap -= xp.multiply(b, 0.5)
    _times(xp, gap, inverse_temperature, out=gap)
    with np.errstate(over="ignore"):
        gap *= 2.0
    return gap


def _phi(xp, y, relative, logit_mu: float):
    """``logit(g) - logit(mu)`` with ``g = (1/n) sum_j sigma(y + relative_j)``, per image."""
    log_sig, log_one_minus = _log_expit_pair(xp, y[:, None] + relative)
    return _lse(xp, log_sig, 1) - _lse(xp, log_one_minus, 1) - logit_mu


def _relative(xp, column_min, lam, inverse_temperature: float, pivot, rows):
    """``l_j - l_p`` (B, n) for the pivot ``p`` (B,) of each image, from cost differences
    (``rows``: ``arange(B)``, to pick each image's entry)."""
    return (lam - lam[rows, pivot][:, None]) - _scaled_gap(
        xp, column_min, column_min[rows, pivot][:, None], inverse_temperature
    )


def _newton(xp, relative, logit_mu: float, max_iter: int, y, lo, hi, *, check_every: int):
    """Safeguarded Newton on ``phi(y) = logit(g(y)) - logit(mu)`` for every image.

    The reference's :func:`refdml.gsp._transport._newton`, vectorised over all images
    with a per-image mask (no compaction, no loop over images): in the bracket
    ``[lo, hi]``, Newton step in logit space, bisection when a step leaves it, an image
    stops when ``|phi|`` reaches its rounding floor or the step or bracket is a few
    ulps of ``y``; "is any image still active?" is read every ``check_every`` sweeps.
    Returns ``(y, sweeps, exhausted)``.
    """
    # exp(-log_slope) is capped below overflow (cap); such a step leaves the bracket anyway.
    ulp, cap, phi_floor = stopping_rules(relative.dtype, logit_mu)
    n = relative.shape[1]
    log_n = math.log(n)
    y = xp.minimum(xp.maximum(y, lo), hi)
    active = (hi - lo) > 4.0 * ulp * xp.maximum(1.0, xp.abs(y))
    y = xp.where(active, y, lo)
    sweeps = 0
    while sweeps < max_iter:
        for _ in range(min(check_every, max_iter - sweeps)):
            sweeps += 1
            log_sig, log_one_minus = _log_expit_pair(xp, y[:, None] + relative)
            log_g = _lse(xp, log_sig, 1)
            log_one_minus_g = _lse(xp, log_one_minus, 1)
            phi = log_g - log_one_minus_g - logit_mu
            log_slope = log_n + _lse(xp, log_sig + log_one_minus, 1) - log_g - log_one_minus_g
            lo = xp.where(active & (phi < 0), y, lo)
            hi = xp.where(active & (phi > 0), y, hi)
            step = -phi * xp.exp(xp.minimum(-log_slope, cap))
            newton = y + step
            scale = 4.0 * ulp * xp.maximum(1.0, xp.abs(y))
            small = xp.abs(step) <= scale
            inside = (newton > lo) & (newton < hi)
            new = xp.where(small | inside, newton, 0.5 * (lo + hi))
            level = xp.abs(phi) <= phi_floor
            done = level | small | ((hi - lo) <= scale)
            y = xp.where(active & ~level, new, y)
            active = active & ~done
        if not bool(xp.any(active)):  # a synchronisation on CuPy
            return y, sweeps, False
    return y, sweeps, True


# |x| beyond which sigma(x) is exactly 0 or 1 in float64 and float32: the search's window.
_SATURATION = 1024.0


def log_kernel(xp, cost_t, inverse_temperature: float, *, bounded: bool = False, out=None):
    """From the cost ``(B, n, m)`` in memory: ``cmin``, ``lam`` (B, n), softmax ``A`` (B, n, m).

    ``cmin_j = min_i c_ij``, ``lam_j = log sum_i exp(-ε (c_ij - cmin_j))`` in ``[0, log m]``
    (so ``l_j = lam_j - ε cmin_j``): ``exp`` sees only numbers ``<= 0``, ``-inf`` where
    ``ε (c - cmin)`` overflows (a weight of exactly 0). ``bounded``: the cost is the pooling
    layer's own (``s`` times a distance of points of norm <= 1: finite, >= 0 and small), so
    ``c - cmin`` cannot overflow and is scaled as it is (six passes over the cost: argmin,
    difference, product, exp, sum, scaling); a cost given by the caller may span more than
    the dtype's range, and its difference is halved first (:func:`_scaled_gap`). ``out``:
    an array of the cost's shape for ``A`` (else a new one).
    """
    # The minimum as the entry at argmin: the same number (NaN where a column has one), in
    # a pass along the contiguous axis that NumPy runs faster than min's.
    column_min = xp.take_along_axis(cost_t, xp.argmin(cost_t, axis=2)[:, :, None], axis=2)
    if bounded:
        kernel = xp.subtract(cost_t, column_min, out=out)
        _times(xp, kernel, -inverse_temperature, out=kernel)
    else:
        gap = _scaled_gap(xp, cost_t, column_min, inverse_temperature)
        kernel = xp.negative(gap, out=gap if out is None else out)
    xp.exp(kernel, out=kernel)
    column_min = column_min[:, :, 0]                             # (B, n)
    total = xp.sum(kernel, axis=2, keepdims=True)                # >= 1: the minimum gives 1
    kernel *= 1.0 / total
    return column_min, xp.log(total[:, :, 0]), kernel


def halves_of_log_kernel(backend: Backend, cost_t, inverse_temperature: float, *,
                         bounded: bool = False):
    """:func:`log_kernel` of each half of the batch (:meth:`Backend.halves`; each image's
    is its own, so the result is the whole batch's)."""
    xp = backend.xp
    assignment_t = xp.empty_like(cost_t)
    parts = backend.halves(lambda part: log_kernel(xp, cost_t[part], inverse_temperature,
                                                   bounded=bounded, out=assignment_t[part]),
                           cost_t.shape[0])
    return (backend.joined([column_min for column_min, _, _ in parts]),
            backend.joined([lam for _, lam, _ in parts]), assignment_t)


def solve(xp, column_min, lam, args: TransportArgs, *, check_every: int):
    """``(x, log_t, sweeps, exhausted)``: the reference's pivot search and Newton (docs/gsp.md).

    ``x = y + (l - l_p)`` (B, n) are the logits at the root, ``log_t = y - l_p`` for the
    cost as given. The search runs a fixed number of vectorised steps for every image
    (no synchronisation); ``sweeps`` counts them and the Newton sweeps (``check_every``:
    :func:`_newton`'s).
    """
    inverse_temperature, mu = args.inverse_temperature, args.mu
    batch, n = column_min.shape
    logit_mu = math.log(mu) - math.log1p(-mu)
    order = xp.argsort(column_min, axis=1, kind="stable")
    rows = xp.arange(batch)
    below = xp.full(batch, -1, dtype=np.int64)
    above = xp.full(batch, n, dtype=np.int64)
    zero = xp.zeros(batch, dtype=column_min.dtype)
    search = max(1, math.ceil(math.log2(n + 1)))
    for _ in range(search):
        active = above - below > 1
        middle = (below + above) // 2
        candidate = order[rows, xp.clip(middle, 0, n - 1)]
        relative = _relative(xp, column_min, lam, inverse_temperature, candidate, rows)
        nonnegative = _phi(xp, zero, relative, logit_mu) >= 0
        above = xp.where(active & nonnegative, middle, above)
        below = xp.where(active & ~nonnegative, middle, below)
    minus = order[rows, xp.minimum(above, n - 1)]
    plus = order[rows, xp.maximum(below, 0)]
    relative_minus = _relative(xp, column_min, lam, inverse_temperature, minus, rows)
    relative_plus = _relative(xp, column_min, lam, inverse_temperature, plus, rows)
    interior = (below >= 0) & (above < n)
    gap = xp.maximum(relative_minus[rows, plus], 0)
    half = xp.minimum(0.5 * gap, _SATURATION)
    use_plus = (below >= 0) & ((above == n) | (_phi(xp, -half, relative_minus, logit_mu) >= 0))
    relative = xp.where(use_plus[:, None], relative_plus, relative_minus)
    lo = xp.where(use_plus, 0.0, xp.where(interior, -half, -np.inf)).astype(gap.dtype)
    hi = xp.where(use_plus, xp.where(interior, gap - half, np.inf), 0.0).astype(gap.dtype)
    far = use_plus & interior & (hi > _SATURATION)
    window = xp.full(batch, _SATURATION, dtype=gap.dtype)
    plateau = far & (_phi(xp, window, relative_plus, logit_mu) < 0)
    hi = xp.where(far, window, hi)
    lo = xp.where(plateau, window, lo)
    lo = xp.maximum(lo, logit_mu - xp.max(relative, axis=1))
    hi = xp.maximum(xp.minimum(hi, logit_mu - xp.min(relative, axis=1)), lo)
    y, sweeps, exhausted = _newton(xp, relative, logit_mu, args.max_iter, xp.zeros_like(lo),
                                   lo, hi, check_every=check_every)
    pivot = xp.where(use_plus, plus, minus)
    with np.errstate(over="ignore", invalid="ignore"):
        log_pivot = lam[rows, pivot] - _times(xp, column_min[rows, pivot], inverse_temperature)
        log_t = y - log_pivot
    return y[:, None] + relative, log_t, search + 2 + sweeps, exhausted


def transport(backend: Backend, cost_t, args: TransportArgs, *,
              bounded: bool = False) -> WeightTransportResult:
    """(P2) for every image from the cost ``(B, n, m)`` in memory (see the module docstring);
    ``bounded``: the pooling layer's own cost (:func:`log_kernel`)."""
    xp = backend.xp
    mu, inverse_temperature, max_iter, tol = (args.mu, args.inverse_temperature, args.max_iter,
                                              args.tol)
    batch, n, m = cost_t.shape
    dtype = cost_t.dtype
    column_min, lam, assignment_t = halves_of_log_kernel(backend, cost_t, inverse_temperature,
                                                         bounded=bounded)
    if tol > 0.0:
        tol = max(tol, residual_floor(dtype, m, n))
    with np.errstate(over="ignore", invalid="ignore"):
        log_s = lam - _times(xp, column_min, inverse_temperature)
    common = dict(
        mu=mu, inverse_temperature=inverse_temperature, tol=tol, method="exact",
        log_s=log_s, assignment=assignment_t.transpose(0, 2, 1),
    )
    if mu == 1.0:
        rho = xp.zeros((batch, n), dtype=dtype)
        pi_t = assignment_t * (1.0 / n)
        inf = xp.full(batch, np.inf, dtype=dtype)
        residual = _residual(xp, rho, pi_t, mu)
        return WeightTransportResult(
            rho=rho, pi=pi_t.transpose(0, 2, 1), t=inf, log_t=inf, n_iter=0,
            residual=residual, converged=True, transported=xp.ones((batch, n), dtype=dtype),
            tau_history=None, **common,
        )
    x, log_t, sweeps, exhausted = solve(xp, column_min, lam, args,
                                        check_every=backend.check_every(_SWEEPS))
    transported = _expit(xp, x)
    rho = _expit(xp, -x) * (1.0 / n)
    pi_t = xp.empty_like(assignment_t)

    def images(part):
        """``pi`` (into ``pi_t``) and the residual of the images ``part``: each image's are
        its own."""
        xp.multiply(assignment_t[part], (transported[part] * (1.0 / n))[:, :, None],
                    out=pi_t[part])
        return _residual(xp, rho[part], pi_t[part], mu)

    residual = backend.joined(backend.halves(images, batch))
    converged = report_convergence(xp, residual, tol, max_iter, sweeps, exhausted)
    with np.errstate(over="ignore"):
        t = xp.exp(log_t)
    return WeightTransportResult(
        rho=rho, pi=pi_t.transpose(0, 2, 1), t=t, log_t=log_t, n_iter=int(sweeps),
        residual=residual, converged=converged, transported=transported, tau_history=None,
        **common,
    )


def report_convergence(xp, residual, tol, max_iter, sweeps, exhausted, converged=None,
                       where: str = "") -> bool:
    """``converged`` (a Python bool: the one result that must reach Python) and the warning.

    ``converged``: already read (the compiled path reads it with the counts, in one
    transfer); None: read here, ``all(residual <= tol)`` (one synchronisation on CuPy).
    ``where``: when a deferred read's value was recorded (``"epoch 3, step 17"``), named in
    the warning.
    """
    if converged is None:
        converged = bool(xp.all(residual <= tol))
    if not converged and tol > 0.0:
        worst = float(xp.max(residual))
        if exhausted:
            why = f"reached max_iter == {max_iter} with residual {worst:.3e} > tol == {tol:g}"
        else:
            why = (
                f"stalled after {sweeps} sweeps at the rounding floor of the logits with "
                f"residual {worst:.3e} > tol == {tol:g}"
            )
        at = f" (at {where})" if where else ""
        warnings.warn(
            f"refdml.gpu weight_transport(method='exact') {why}{at}", ConvergenceWarning,
            stacklevel=_caller_level(),
        )
    return converged


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside refdml.gpu (the user's call), counted
    from the function that calls :func:`warnings.warn` (whichever path got there)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(here):
        frame, level = frame.f_back, level + 1
    return level


def _residual(xp, rho, pi_t, mu):
    n = rho.shape[1]
    column_mass = xp.sum(pi_t, axis=2)
    column = xp.max(xp.abs(rho + column_mass - 1.0 / n), axis=1)
    mass = xp.abs(xp.sum(column_mass, axis=1) - mu)
    return xp.maximum(column, mass)


def marginal_factors(xp, rho, transported, d_rho, column):
    """``w_j (b_j - bbar)`` (B, n) of Prop. 4.3 as the reference evaluates it (docs/gsp.md Sec. 3).

    ``column`` is ``a_j = sum_i A_ij d_pi_ij`` (B, n), ``b = a - d_rho``, ``w_j = rho_j
    sigma_j`` (``rho``, ``sigma = transported``: the result's, (B, n)) and
    ``bbar = sum w b / sum w``, the
    difference taken against the image's largest ``w`` (nothing cancels as ε grows or
    as mu -> 0 or 1; 0 where ``sum w = 0``, i.e. mu = 1), on ``b / 2`` (so that no
    difference of two finite ``b`` overflows).
    """
    weight = rho * transported
    kappa = xp.sum(weight, axis=1)
    # Halved first (exact): b and b_top may each lie near the dtype's largest number
    # (features near 1e38 in float32 make d_rho ~ n |f| |d_pooled|), where their difference
    # would overflow; weight <= 1 / n brings the result back.
    half = column * 0.5 - d_rho * 0.5
    half_top = xp.take_along_axis(half, xp.argmax(weight, axis=1)[:, None], axis=1)
    positive = kappa > 0
    mean_offset = xp.where(
        positive, xp.sum(weight * (half_top - half), axis=1) / xp.where(positive, kappa, 1.0),
        0.0,
    )
    with np.errstate(over="ignore"):  # inf only where w (b - bbar) itself overflows
        return (weight * ((half - half_top) + mean_offset[:, None])) * 2.0


def softmax_centred(xp, assignment_t, d_pi_t):
    """``d_pi_ji - a_j`` (B, n, m, a new array) and ``a_j`` (B, n), against the dominant row.

    ``d_pi_t`` is ``d_pi`` in the (B, n, m) layout (a broadcast view is fine); the
    difference is ``(d_pi_ji - d_pi_jr) + sum_k A_jk (d_pi_jr - d_pi_jk)`` with ``r`` the
    column's largest weight, so that a one-hot ``A`` (large ε) leaves no cancellation.
    """
    top = xp.argmax(assignment_t, axis=2)[:, :, None]
    reference = xp.take_along_axis(xp.broadcast_to(d_pi_t, assignment_t.shape), top, axis=2)
    centred = d_pi_t - reference
    offset = -xp.sum(assignment_t * centred, axis=2, keepdims=True)
    centred += offset
    return centred, xp.sum(assignment_t * d_pi_t, axis=2)


def softmax_centred_rows(xp, assignment_t, d_z, out=None):
    """:func:`softmax_centred` for ``d_pi_ji = d_z_i`` (the pooling layer's: one row ``d_z``
    (B, m) for every column), computed in fewer passes over (B, n, m): the dominant row's
    ``d_z`` is picked from (B, m), ``sum_k A_jk (d_z_k - d_z_r)`` is one contraction with no
    temporary product, and ``a_j = sum_k A_jk d_z_k`` a batched matrix-vector product. The
    same numbers as :func:`softmax_centred` but for the order of each sum's terms. ``out``:
    an array of ``assignment_t``'s shape for the difference (else a new one).
    """
    top = xp.argmax(assignment_t, axis=2)                                  # (B, n)
    centred = xp.subtract(d_z[:, None, :], xp.take_along_axis(d_z, top, axis=1)[:, :, None],
                          out=out)
    centred -= xp.einsum("bnm,bnm->bn", assignment_t, centred)[:, :, None]
    return centred, (assignment_t @ d_z[:, :, None])[:, :, 0]


def scale_gradient(xp, inner, factor: float, check: bool = True):
    """``factor * inner`` in place (``factor = -ε``), checked by :func:`check_gradient`
    (``check=False``: the caller tests the result itself)."""
    _times(xp, inner, factor, out=inner)
    return check_gradient(xp, inner, abs(factor)) if check else inner


def check_gradient(xp, gradient, inverse_temperature: float):
    """``ValueError`` where ``gradient`` (``d_cost``, or ``d_cost / c'``) overflowed the dtype.

    The inner factor is finite by construction, so this is ε times it overflowing: ε near
    the dtype's maximum next to a tie of the cost. On CuPy one synchronisation, unless the
    data checks are off (:func:`refdml.gpu.set_finite_checks`).
    """
    if get_backend(gradient).data_checks and not bool(xp.all(xp.isfinite(gradient))):
        raise ValueError(
            f"d_cost overflows {np.dtype(gradient.dtype).name}: inverse_temperature == "
            f"{inverse_temperature!r}; at this inverse temperature (P2) is this sensitive to "
            "the cost only next to a tie of the cost (a kink of the LP)"
        )
    return gradient


def closed_form_backward(xp, result: WeightTransportResult, d_rho, d_pi):
    """``d_cost = -ε (pi (d_pi - a) + A w (b - bbar))`` (B, m, n), a transposed view."""
    n = result.rho.shape[1]
    assignment_t = result.assignment.transpose(0, 2, 1)
    inner, column = softmax_centred(xp, assignment_t, d_pi.transpose(0, 2, 1))
    inner *= (result.transported * (1.0 / n))[:, :, None]  # pi = A P, P_j = sigma_j / n
    inner += marginal_factors(xp, result.rho, result.transported, d_rho, column)[:, :, None]
    inner *= assignment_t
    return scale_gradient(xp, inner, -result.inverse_temperature).transpose(0, 2, 1)
