r"""GSP (P2) on the fast path: batched log-domain solve and Prop. 4.3's closed-form backward.

Private module of :mod:`refdml.gpu.gsp` (which re-exports the public names). The maths
is the reference's (:mod:`refdml.gsp._transport`, docs/gsp.md Secs. 2-3); what differs
is how it is computed:

* Memory layout. Arrays of shape ``(B, m, n)`` (cost, pi, assignment) are held as
  ``(B, n, m)`` in memory and handed out as transposed views, so that the softmax over
  prototypes, the column sums and the matrix products of the backward all run along
  the contiguous axis and the cost map is one large matrix product.
* Solver. ``g(tau) = (1/n) sum_j sigma(tau + l_j) = mu`` is solved for all images at
  once: a fixed small number of vectorised safeguarded-Newton sweeps (``_SWEEPS`` per
  convergence check) on ``phi = logit(g) - logit(mu)``, each image frozen by its own
  mask once converged, then the reference's re-centred second phase. No Python loop
  over images; on CuPy the "every image converged?" test is one synchronisation per
  ``_SWEEPS`` sweeps, and ``converged`` (a Python bool, like the reference's) one more.
* dtype. Everything runs in the input's dtype (float32 or float64), in the log domain
  (``exp`` only of non-positive numbers), so float32 stays finite at any
  ``inverse_temperature`` (tested up to 200).

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

import numpy as np

from refdml.exceptions import ConvergenceWarning
from refdml.gsp._transport import WeightTransportResult

# Newton sweeps between two "every image converged?" checks (one sync each on CuPy; on
# NumPy the check is free, so it runs after every sweep).
_SWEEPS = 3


def residual_floor(dtype, m: int, n: int) -> float:
    """The smallest residual a computation in ``dtype`` can certify (module docstring)."""
    return float((2.0 * math.log2(m * n) + 40.0) * np.finfo(dtype).eps)


def _log_expit(xp, x):
    """``log sigma(x) = min(x, 0) - log1p(exp(-|x|))`` (finite for every finite x)."""
    return xp.minimum(x, 0) - xp.log1p(xp.exp(-xp.abs(x)))


def _expit(xp, x):
    return xp.exp(_log_expit(xp, x))


def _lse(xp, a, axis: int):
    """``log sum exp`` along ``axis`` of small arrays; ``-inf`` for all ``-inf`` rows."""
    peak = xp.max(a, axis=axis, keepdims=True)
    peak = xp.where(xp.isfinite(peak), peak, 0)
    return xp.log(xp.sum(xp.exp(a - peak), axis=axis)) + xp.squeeze(peak, axis=axis)


def _newton(xp, log_s, logit_mu: float, max_iter: int, tau):
    """Safeguarded Newton on ``phi(tau) = logit(g(tau)) - logit(mu)`` for every image.

    The reference's :func:`refdml.gsp._transport._newton`, vectorised over all images
    with a per-image mask (no compaction, no loop over images): bracket
    ``[logit mu - max l, logit mu - min l]``, Newton step in logit space, bisection when
    a step leaves the bracket, an image stops when ``|phi|`` reaches its rounding floor
    or the step or bracket is a few ulps of tau. Returns ``(tau, sweeps, exhausted)``.
    """
    dtype = log_s.dtype
    ulp = float(np.finfo(dtype).eps)
    # exp(-log_slope) is capped below overflow; such a step leaves the bracket anyway.
    cap = float(np.log(np.finfo(dtype).max)) - 2.0
    n = log_s.shape[1]
    log_n = math.log(n)
    lo = logit_mu - xp.max(log_s, axis=1)
    hi = logit_mu - xp.min(log_s, axis=1)
    tau = xp.clip(tau, lo, hi)
    active = (hi - lo) > 4.0 * ulp * xp.maximum(1.0, xp.abs(tau))
    tau = xp.where(active, tau, lo)
    phi_floor = 16.0 * ulp * (1.0 + abs(logit_mu))
    sweeps = 0
    per_check = 1 if xp is np else _SWEEPS
    while sweeps < max_iter:
        for _ in range(min(per_check, max_iter - sweeps)):
            sweeps += 1
            x = tau[:, None] + log_s
            log_sig = _log_expit(xp, x)
            log_one_minus = log_sig - x  # log sigma(-x) = log sigma(x) - x
            log_g = _lse(xp, log_sig, 1)
            log_one_minus_g = _lse(xp, log_one_minus, 1)
            phi = log_g - log_one_minus_g - logit_mu
            log_slope = log_n + _lse(xp, log_sig + log_one_minus, 1) - log_g - log_one_minus_g
            lo = xp.where(active & (phi < 0), tau, lo)
            hi = xp.where(active & (phi > 0), tau, hi)
            step = -phi * xp.exp(xp.minimum(-log_slope, cap))
            newton = tau + step
            scale = 4.0 * ulp * xp.maximum(1.0, xp.abs(tau))
            small = xp.abs(step) <= scale
            inside = (newton > lo) & (newton < hi)
            new = xp.where(small | inside, newton, 0.5 * (lo + hi))
            level = xp.abs(phi) <= phi_floor
            done = level | small | ((hi - lo) <= scale)
            tau = xp.where(active & ~level, new, tau)
            active = active & ~done
        if not bool(xp.any(active)):  # one synchronisation per _SWEEPS sweeps on CuPy
            return tau, sweeps, False
    return tau, sweeps, True


def log_kernel(xp, cost_t, inverse_temperature: float):
    """From the cost ``(B, n, m)`` in memory: ``l`` (B, n), softmax ``A`` (B, n, m), shift (B,).

    ``l_j = logsumexp_i(-ε (c_ij - c_min))`` with ``c_min`` the image's smallest cost
    (the solution depends on ``ε (c - c_min)`` only), so ``exp`` sees only numbers
    ``<= 0`` and nothing overflows at any ε; ``shift = ε c_min`` restores
    ``log t`` and ``l`` of the cost as given. Four passes over the cost.
    """
    column_min = xp.min(cost_t, axis=2, keepdims=True)           # (B, n, 1)
    kernel = cost_t - column_min
    kernel *= -inverse_temperature
    xp.exp(kernel, out=kernel)
    total = xp.sum(kernel, axis=2, keepdims=True)                # >= 1: the minimum gives 1
    kernel *= 1.0 / total
    image_min = xp.min(column_min[:, :, 0], axis=1)              # (B,)
    with np.errstate(over="ignore"):
        spread = inverse_temperature * (column_min[:, :, 0] - image_min[:, None])
        log_s = xp.log(total[:, :, 0]) - spread
        shift = inverse_temperature * image_min
    return log_s, kernel, shift


def solve(xp, log_s, mu: float, max_iter: int):
    """``(x, tau, sweeps, exhausted)``: the reference's two phases (docs/gsp.md Sec. 2)."""
    logit_mu = math.log(mu) - math.log1p(-mu)
    tau, first, exhausted_first = _newton(
        xp, log_s, logit_mu, max_iter, logit_mu - xp.mean(log_s, axis=1)
    )
    anchored = tau[:, None] + log_s
    delta, second, exhausted_second = _newton(
        xp, anchored, logit_mu, max_iter, xp.zeros_like(tau)
    )
    return anchored + delta[:, None], tau + delta, first + second, exhausted_first or exhausted_second


def transport(xp, cost_t, mu, inverse_temperature, max_iter, tol) -> WeightTransportResult:
    """(P2) for every image from the cost ``(B, n, m)`` in memory (see the module docstring)."""
    batch, n, m = cost_t.shape
    dtype = cost_t.dtype
    log_s_shifted, assignment_t, shift = log_kernel(xp, cost_t, inverse_temperature)
    if tol > 0.0:
        tol = max(tol, residual_floor(dtype, m, n))
    check_log_kernel(xp, log_s_shifted, cost_t, inverse_temperature)
    with np.errstate(over="ignore", invalid="ignore"):
        log_s = log_s_shifted - shift[:, None]
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
    x, tau, sweeps, exhausted = solve(xp, log_s_shifted, mu, max_iter)
    transported = _expit(xp, x)
    rho = _expit(xp, -x) * (1.0 / n)
    pi_t = assignment_t * (transported * (1.0 / n))[:, :, None]
    residual = _residual(xp, rho, pi_t, mu)
    converged = report_convergence(xp, residual, tol, max_iter, sweeps, exhausted)
    with np.errstate(over="ignore"):
        log_t = tau + shift
        t = xp.exp(log_t)
    return WeightTransportResult(
        rho=rho, pi=pi_t.transpose(0, 2, 1), t=t, log_t=log_t, n_iter=int(sweeps),
        residual=residual, converged=converged, transported=transported, tau_history=None,
        **common,
    )


def check_log_kernel(xp, log_s_shifted, cost_t, inverse_temperature) -> None:
    """``ValueError`` where ``ε (c - min c)`` overflows the dtype (``l`` not finite).

    On CuPy one synchronisation, unless the data checks are off
    (:func:`refdml.gpu._validation.set_finite_checks`).
    """
    if xp is np or _checks_on_gpu():
        if not bool(xp.all(xp.isfinite(log_s_shifted))):
            b = int(xp.argwhere(~xp.isfinite(log_s_shifted))[0][0])
            raise ValueError(
                f"inverse_temperature * cost overflows {np.dtype(cost_t.dtype).name}: "
                f"inverse_temperature == {inverse_temperature!r} and (max c - min c) == "
                f"{float(xp.max(cost_t[b]) - xp.min(cost_t[b])):.3e} in image {b}; "
                "(P2) at this scale is not representable"
            )


def report_convergence(xp, residual, tol, max_iter, sweeps, exhausted) -> bool:
    """``converged`` (a Python bool: the one result that must reach Python) and the warning."""
    converged = bool(xp.all(residual <= tol))
    if not converged and tol > 0.0:
        worst = float(xp.max(residual))
        if exhausted:
            why = f"reached max_iter == {max_iter} with residual {worst:.3e} > tol == {tol:g}"
        else:
            why = (
                f"stalled after {sweeps} sweeps at the rounding floor of tau with residual "
                f"{worst:.3e} > tol == {tol:g}"
            )
        warnings.warn(
            f"refdml.gpu weight_transport(method='exact') {why}", ConvergenceWarning,
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


def _checks_on_gpu() -> bool:
    from refdml.gpu import _validation

    return _validation.CHECK_FINITE_ON_GPU


def _residual(xp, rho, pi_t, mu):
    n = rho.shape[1]
    column_mass = xp.sum(pi_t, axis=2)
    column = xp.max(xp.abs(rho + column_mass - 1.0 / n), axis=1)
    mass = xp.abs(xp.sum(column_mass, axis=1) - mu)
    return xp.maximum(column, mass)


def closed_form_factors(xp, result: WeightTransportResult, d_rho, weighted_sum):
    """``inner = q - (eta / kappa) rho`` (B, n) of Prop. 4.3 (docs/gsp.md Sec. 3).

    ``weighted_sum`` is ``(pi^T d_pi)_j = sum_i pi_ij d_pi_ij`` (B, n); ``kappa`` and
    ``eta`` are formed as ``sum rho sigma`` and ``sum rho (sigma d_rho - n (pi^T d_pi))``
    with ``sigma = result.transported`` (no cancellation as mu -> 0 or 1).
    """
    n = result.rho.shape[1]
    rho, sig = result.rho, result.transported
    q = rho * d_rho + weighted_sum
    kappa = xp.sum(rho * sig, axis=1)
    eta = xp.sum(rho * (sig * d_rho - n * weighted_sum), axis=1)
    positive = kappa > 0
    ratio = xp.where(positive, eta / xp.where(positive, kappa, 1.0), 0.0)
    return q - ratio[:, None] * rho


def closed_form_backward(xp, result: WeightTransportResult, d_rho, d_pi):
    """``d_cost = -ε (pi * d_pi - n pi * inner[None, :])`` (B, m, n), a transposed view."""
    n = result.rho.shape[1]
    pi_t = result.pi.transpose(0, 2, 1)
    d_cost_t = pi_t * d_pi.transpose(0, 2, 1)
    inner = closed_form_factors(xp, result, d_rho, xp.sum(d_cost_t, axis=2))
    d_cost_t -= pi_t * (n * inner)[:, :, None]
    d_cost_t *= -result.inverse_temperature
    return d_cost_t.transpose(0, 2, 1)
