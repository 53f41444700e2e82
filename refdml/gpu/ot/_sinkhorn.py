r"""The batched log-domain Sinkhorn solver of :mod:`refdml.gpu.ot` (array path, NumPy or CuPy).

The maths is the reference's (:mod:`refdml.ot._sinkhorn`, docs/ot.md Sec. 2); the
iteration is not. The reference iterates on kernel scalings (one mat-vec per half step)
and rebuilds the kernel in the log domain when a scaling leaves ``[e^-30, e^30]``; in
float32 that window is too narrow to be worth it, so here every half step is a
log-sum-exp, on potentials in units of ``eps`` (``phi = f / eps``, ``psi = g / eps``)
and the cost divided by ``eps`` (``S = C / eps``)::

    psi_j <- -log sum_i exp(log a_i + phi_i - S_ij)        (columns exact)
    phi_i <- -log sum_j exp(log b_j + psi_j - S_ij)

Every exponent has its row maximum subtracted (:func:`lse_half_step`), so nothing
overflows or underflows whatever ``eps`` is relative to the cost: float32 stays finite
down to ``eps = 1e-4`` of the largest cost (the check below refuses less). The residual
(L1 error of the row marginal of the plan with columns exact) is free: the row sums of
``a_i b_j exp(phi_i + psi_j - S_ij)`` are ``a_i exp(phi_i - phi'_i)`` with ``phi'`` the
next half step. Symmetric problems (``OT(mu, mu)``) use the averaged update
``phi <- (phi + T(phi)) / 2`` (Feydy et al.) as the reference does. A problem whose
``eps`` exceeds its largest cost ends, as the reference's, with three exact log-domain half
steps (:func:`_finish_large_eps`; on CuPy without a synchronisation), and the value's
mass term is summed through ``expm1`` (:func:`batch_value`).

On NumPy the loop runs on kernel scalings instead (:func:`_stage_scaling`, one
matrix-vector product per half step, :func:`_kernel_half_step`), with the log-domain half
step as its absorption and fallback: faster than the log-domain loop, since a mat-vec
costs a fraction of an exponential per entry.

Convergence check (the one synchronisation of the loop on CuPy): every iteration on
NumPy (free), every :data:`CHECK_EVERY_GPU` iterations on CuPy. Converged problems are
written out and dropped from the working arrays (compaction) once at least an eighth of
them (or all) are done, so the batch shrinks as problems converge.

float32: the marginal error cannot go below the rounding of the exponents,
``~ u * max(S)`` (measured: below 0.1 of that); a positive ``tol`` below :func:`residual_floor` is raised to it.

The seam. The family's implementations (:data:`refdml.gpu.ot.IMPLEMENTATIONS`: the array
path :class:`refdml.gpu.ot._array.ArrayPath`, the CPU twins and the CUDA kernels,
:class:`refdml.gpu.ot._kernels.CpuPath` and :class:`~refdml.gpu.ot._kernels.CudaPath`) are
objects of one interface. Each public function of refdml.gpu.ot chooses one per call
(``impl = IMPLEMENTATIONS.choose(x)``) and hands it down; the solver calls
``impl.lse_half_step``, ``impl.takes_small`` and ``impl.solve_small`` and never asks which
implementation it holds. Where NumPy and CuPy take different steps (the stabiliser of the
array path's half step, the kernel-scaling loop, the large-eps finish, the check cadence),
the backend says which (:attr:`refdml._backend.Backend.gathers_rows`,
:meth:`~refdml._backend.Backend.check_every`): the same quantities either way, computed in
the order that is cheaper there.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import numpy as np

from refdml._backend import get_backend
from refdml.gpu.ot._small import finish_batch, solve_small_batch
from refdml._shared.ot import (
    OTBatch,
    check_schedule_length,
    large_eps_half_steps,
    mass_excess,
    relative_eps_message,
)

__all__ = ["CHECK_EVERY_GPU", "batch_transport_cost", "batch_value", "check_relative_eps",
           "lse_half_step", "residual_floor", "solve_batch"]

#: Iterations between two convergence checks on CuPy (each check synchronises once).
CHECK_EVERY_GPU = 10
# Intermediate eps-scaling stages only warm-start the next one (as the reference).
_STAGE_TOL = 1e-3
# eps relative to the largest cost that the dtype resolves (reference: float64 limits).
# float32: below 1e-4 the exponents C / eps > 1e4 carry an absolute rounding error
# above 1e-3 (a 0.1 % error of every plan entry); above 1e3 the potentials' rounding
# error exceeds ~1e-4 of the cost.
_RELATIVE_EPS = {np.dtype(np.float64): (1e-13, 1e12), np.dtype(np.float32): (1e-4, 1e3)}
# residual_floor = _FLOOR_FACTOR * u * (1 + max S); the computed residual reaches ~0.1 u max(S).
_FLOOR_FACTOR = 1.0
# Kernel-scaling loop (where the backend gathers rows, NumPy; a switch for the tests):
# scalings are folded into the potentials once they leave
# [e^-B, e^B] (the reference: B = 30 in float64). float32: e^B (1 + n) stays far below its
# largest value, and below its tiny the products would run on subnormals.
_USE_SCALING = True
_ABSORB = {np.dtype(np.float64): 30.0, np.dtype(np.float32): 20.0}


def residual_floor(dtype: Any, largest_scaled_cost: float) -> float:
    """Smallest marginal error the dtype reaches with ``max(C / eps) = largest_scaled_cost``.

    float64 at the catalogue's scales: ~1e-14 (below any tol anyone asks); float32 with
    costs in [0, 4] and ``eps = 0.1``: ~5e-6.
    """
    return _FLOOR_FACTOR * float(np.finfo(dtype).eps) * (1.0 + largest_scaled_cost)


def check_relative_eps(eps: float, largest_cost: float, dtype: Any, *, user_eps: float,
                       cost_name: str = "the largest cost", data_name: str | None = None,
                       unit: float = 1.0, p: float | None = None) -> None:
    """Refuse an ``eps`` that ``dtype`` cannot resolve against the cost: the reference's
    check and message (:func:`refdml._shared.ot.relative_eps_message`) at the dtype's
    limits."""
    low, high = _RELATIVE_EPS[np.dtype(dtype)]
    message = relative_eps_message(
        eps, largest_cost, low=low, high=high, dtype_name=np.dtype(dtype).name,
        user_eps=user_eps, cost_name=cost_name, data_name=data_name, unit=unit, p=p,
    )
    if message is not None:
        raise ValueError(message)


def lse_half_step(xp, scaled_cost, potential, log_weight, previous=None, out=None):
    """``-log sum_j exp(log_weight_j + potential_j - scaled_cost_ij)``: (P, n) from (P, n, m).

    The one fused operation of the solver (a CuPy kernel will replace this array path:
    one read of ``scaled_cost`` per half step). The reduction runs over the last,
    contiguous axis; ``out`` is a (P, n, m) work buffer (or None).

    Stabiliser. Where the backend gathers rows (NumPy,
    :attr:`refdml._backend.Backend.gathers_rows`) and ``previous`` (the potential this step
    replaces) is given, ``previous`` is added to the exponents, which saves two passes over
    the (P, n, m) array: when the other marginal is exact,
    ``exp(log_weight_j + potential_j - S_ij + previous_i)`` is the plan entry over ``a_i``,
    at most ``1 / a_i``; the rows whose sum leaves the normal range (a far-off start, or
    the symmetric update) are redone with the maximum. Otherwise (CuPy, where those rows'
    count would be a synchronisation) the row maximum is subtracted, so the sum is in
    ``[1, m]``. Both give the log-sum-exp to rounding.

    The array path's half step (:meth:`refdml.gpu.ot._array.ArrayPath.lse_half_step`); the
    compiled implementations' (:meth:`refdml.gpu.ot._kernels.KernelPath.lse_half_step`: one
    pass, online log-sum-exp, no temporary) are checked against it.
    """
    backend = get_backend(scaled_cost)
    z = xp.subtract((log_weight + potential)[:, None, :], scaled_cost, out=out)
    if previous is None or not backend.gathers_rows:
        peak = xp.max(z, axis=2, keepdims=True)
        z -= peak
        xp.exp(z, out=z)
        return -(peak[:, :, 0] + xp.log(xp.sum(z, axis=2)))
    z += previous[:, :, None]
    xp.exp(z, out=z)
    total = xp.sum(z, axis=2)
    info = np.finfo(total.dtype)
    bad = xp.flatnonzero(~((total >= info.tiny / info.eps) & (total <= info.max / 2)))
    with backend.errstate(divide="ignore"):
        result = previous - xp.log(total)
    if bad.size:
        rows = bad // total.shape[1], bad % total.shape[1]
        redo = (log_weight + potential)[rows[0]] - scaled_cost[rows]
        peak = xp.max(redo, axis=1, keepdims=True)
        result[rows] = -(peak[:, 0] + xp.log(xp.sum(xp.exp(redo - peak), axis=1)))
    return result


def _view(work, shape):
    """The first ``prod(shape)`` entries of the flat work buffer, as an array of ``shape``."""
    return work[: shape[0] * shape[1] * shape[2]].reshape(shape)


def _row_error(xp, a, phi, phi_next):
    """L1 error of the row marginal ``a_i exp(phi_i - phi'_i)`` against ``a``."""
    return xp.sum(a * xp.abs(xp.expm1(phi - phi_next)), axis=1)


def _kernel_half_step(xp, kernel, scaling, columns=False):
    """``K s`` (rows) or ``K^T s`` (``columns``): (P, n) or (P, m) from ``kernel`` (P, n, m).

    The kernel-scaling counterpart of :func:`lse_half_step` (same role: the one pass over
    the (P, n, m) array per half step, the place of a future CuPy kernel): a batched
    matrix-vector product instead of an exponential per entry.
    """
    if columns:
        return xp.matmul(scaling[:, None, :], kernel)[:, 0, :]
    return xp.matmul(kernel, scaling[:, :, None])[:, :, 0]


def _absorbed_kernel(xp, log_a, log_b, scaled, phi, psi, out=None):
    """``K_ij = a_i b_j exp(phi_i + psi_j - S_ij)`` (the plan of ``phi``, ``psi``), subnormals
    flushed to 0 (they carry no digit the sums need and slow the products down)."""
    kernel = xp.subtract((log_b + psi)[:, None, :], scaled, out=out)
    kernel += (log_a + phi)[:, :, None]
    xp.exp(kernel, out=kernel)
    kernel[kernel < np.finfo(kernel.dtype).tiny] = 0.0
    return kernel


def _stage_scaling(xp, impl, a, b, log_a, log_b, scaled, scaled_t, phi, psi, *, tol,
                   max_iter, symmetric):
    """:func:`_stage` on kernel scalings (where the backend gathers rows: NumPy); same
    arguments, same results to the stopping tolerance (the same iteration, other roundings).

    The potentials are absorbed into a kernel ``K`` (:func:`_absorbed_kernel`) with the
    columns exact (``psi`` a log-domain half step of ``phi``; symmetric: ``phi`` one
    averaged log-domain step, ``K`` the geometric mean of the two half kernels, entries
    ``<= sqrt(a_i a_j)``), and iterate on scalings ``u``, ``v`` (``pi = u K v``, true
    potentials ``phi + log u``, ``psi + log v``) with one matrix-vector product per half
    step. A problem whose scaling leaves ``[e^-B, e^B]`` (:data:`_ABSORB`) or whose
    marginal of ``K`` falls below the dtype's ``tiny`` is re-absorbed through the
    log-domain step (``impl.lse_half_step``), so nothing overflows or underflows whatever
    ``eps`` is. The residual is the reference's: ``sum_i |u_i (K v)_i - a_i|``.
    """
    dtype = scaled.dtype
    backend = get_backend(scaled)
    tiny = float(np.finfo(dtype).tiny)
    high = float(np.exp(_ABSORB[np.dtype(dtype)]))
    low = 1.0 / high
    n_problems = scaled.shape[0]
    out_phi, out_psi = phi.copy(), psi.copy()
    out_iter = xp.zeros(n_problems, dtype=xp.int64)
    out_err = xp.full(n_problems, np.inf, dtype=dtype)
    index = xp.arange(n_problems)
    phi, psi = phi.copy(), psi.copy()

    def absorb(rows):
        """Fold the scalings of ``rows`` into the potentials; rebuild their kernel."""
        sub = (slice(None),) if rows is None else (rows,)
        # scaled / scaled_t keep every problem (compaction copies only the kernel).
        problems = index if rows is None else index[rows]
        out = kernel if rows is None else None
        phi_r = phi[sub] + xp.log(u[sub])
        la, s = log_a[sub], scaled[problems]
        if symmetric:
            phi_r = 0.5 * (phi_r + impl.lse_half_step(xp, s, phi_r, la))
            psi_r = phi_r
            k = _absorbed_kernel(xp, la, la, s, phi_r, phi_r, out=out)
        else:
            psi_r = impl.lse_half_step(xp, scaled_t[problems], phi_r, la)
            k = _absorbed_kernel(xp, la, log_b[sub], s, phi_r, psi_r, out=out)
        phi[sub] = phi_r
        if not symmetric:
            psi[sub] = psi_r
        if rows is not None:
            kernel[sub] = k
        u[sub] = 1.0
        if not symmetric:
            v[sub] = 1.0

    kernel = xp.empty_like(scaled)
    u = xp.ones_like(phi)
    v = u if symmetric else xp.ones_like(psi)
    absorb(None)
    if symmetric:
        psi = phi
    for it in range(max_iter + 1):
        row = _kernel_half_step(xp, kernel, v)
        err = xp.sum(xp.abs(u * row - a), axis=1)
        done = (err <= tol) if it < max_iter else xp.ones(err.shape, dtype=bool)
        n_done = int(xp.count_nonzero(done))
        if n_done:
            rows = index[done]
            with backend.errstate(divide="ignore"):
                out_phi[rows] = phi[done] + xp.log(u[done])
                out_psi[rows] = psi[done] + xp.log(v[done])
            out_iter[rows] = it
            out_err[rows] = err[done]
            if n_done == done.shape[0]:
                break
            keep = ~done
            index, a, log_a, phi, u, row = index[keep], a[keep], log_a[keep], phi[keep], u[keep], row[keep]
            kernel = kernel[keep]
            if symmetric:
                psi, v = phi, u
            else:
                b, log_b, psi, v = b[keep], log_b[keep], psi[keep], v[keep]
        if symmetric:
            u *= a / xp.maximum(row, tiny)
            xp.sqrt(u, out=u)
            col = row
        else:
            xp.divide(a, xp.maximum(row, tiny), out=u)
            col = _kernel_half_step(xp, kernel, u, columns=True)
            xp.divide(b, xp.maximum(col, tiny), out=v)
        bad = ((xp.max(u, axis=1) > high) | (xp.min(u, axis=1) < low)
               | (xp.min(row, axis=1) < tiny))
        if not symmetric:
            bad |= (xp.max(v, axis=1) > high) | (xp.min(v, axis=1) < low) | (xp.min(col, axis=1) < tiny)
        if bool(xp.any(bad)):
            absorb(xp.flatnonzero(bad))
    return out_phi, out_psi, out_iter, out_err


def _true_rows(xp, mask, count: int):
    """The indices of the ``count`` true entries of the 1-d ``mask``, ascending, with no
    synchronisation: the k-th true entry is where the running count first reaches k."""
    return xp.searchsorted(xp.cumsum(mask), xp.arange(1, count + 1), side="left")


def _stage(xp, impl, a, b, log_a, log_b, scaled, scaled_t, phi, psi, *, tol, max_iter,
           symmetric, check_every):
    """Sinkhorn at one eps for P problems; returns phi, psi, n_iter, error (all (P, ...)).
    ``impl``: the implementation of the half steps (an ``IMPLEMENTATIONS`` member).

    ``scaled`` = C / eps (P, n, m), ``scaled_t`` its transpose, contiguous (None when
    symmetric). On return ``psi`` is exact for the columns (non-symmetric problems).
    """
    n_problems = scaled.shape[0]
    out_phi, out_psi = phi.copy(), psi.copy()
    out_iter = xp.zeros(n_problems, dtype=xp.int64)
    out_err = xp.full(n_problems, np.inf, dtype=phi.dtype)
    index = xp.arange(n_problems)                 # problem of each working row
    live = xp.ones(n_problems, dtype=bool)        # working rows not yet written out
    work = xp.empty(scaled.size, dtype=scaled.dtype)   # the buffer of every half step
    if symmetric:
        psi = phi
        following = impl.lse_half_step(xp, scaled, phi, log_a, out=_view(work, scaled.shape))
    else:
        psi = impl.lse_half_step(xp, scaled_t, phi, log_a, out=_view(work, scaled_t.shape))
        following = impl.lse_half_step(xp, scaled, psi, log_b, out=_view(work, scaled.shape))
    n_live = n_problems                           # live rows, counted on the host
    for it in range(max_iter + 1):
        if it % check_every == 0 or it == max_iter:
            err = _row_error(xp, a, phi, following)
            done = live & ((err <= tol) if it < max_iter else True)
            # One synchronisation on CuPy: does any problem stop here? The rows are then
            # gathered by index, not by mask (a CuPy mask index reads its count again).
            n_done = int(xp.count_nonzero(done))
            if n_done:
                picked = _true_rows(xp, done, n_done)
                rows = index[picked]
                out_phi[rows] = phi[picked]
                out_psi[rows] = psi[picked]
                out_iter[rows] = it
                out_err[rows] = err[picked]
                live &= ~done
                n_live -= n_done                  # done is a subset of live
                if n_live == 0:
                    break
                if live.shape[0] - n_live >= max(1, live.shape[0] // 8):
                    keep = _true_rows(xp, live, n_live)
                    index, live = index[keep], live[keep]
                    a, log_a, phi, following = a[keep], log_a[keep], phi[keep], following[keep]
                    scaled = scaled[keep]
                    if not symmetric:
                        b, log_b, scaled_t = b[keep], log_b[keep], scaled_t[keep]
                        psi = psi[keep]
        if symmetric:
            phi = 0.5 * (phi + following)
            psi = phi
            following = impl.lse_half_step(xp, scaled, phi, log_a, phi, out=_view(work, scaled.shape))
        else:
            phi = following
            psi = impl.lse_half_step(xp, scaled_t, phi, log_a, psi, out=_view(work, scaled_t.shape))
            following = impl.lse_half_step(xp, scaled, psi, log_b, phi, out=_view(work, scaled.shape))
    return out_phi, out_psi, out_iter, out_err


def solve_batch(xp, a, b, cost, *, eps, max_iter, tol, eps_scaling, symmetric=False,
                unit=1.0, want_plan=True, warn_stacklevel=4, small_kernels=False,
                largest=None, smallest=None, impl) -> OTBatch:
    """P problems (a (P, n), b (P, m) on the simplex, cost (P, n, m) in units of ``unit``
    with its largest entry in [0.5, 1), ``eps`` in the same units) in one batch.

    Returns the reference's :class:`refdml._shared.ot.OTBatch` holding arrays of
    ``xp`` (potentials ``f = eps phi`` in units of ``unit``). ``tol`` is raised to
    :func:`residual_floor` of the dtype when positive and below it.

    ``impl``: the implementation that runs (a member of
    :data:`refdml.gpu.ot.IMPLEMENTATIONS`, chosen once by the public function that calls
    this). Its ``lse_half_step`` runs the half steps of the loop below. ``small_kernels``:
    problems that ``impl.takes_small`` (the kernels': at most
    :data:`refdml.gpu.ot._small.MAX_POINTS` = 128 points per side; the array path: none)
    run ``impl.solve_small``, the small-problem Numba kernel (the CPU twin or the
    ``@cuda.jit`` kernel; same iterations, stopping rule and residual as the loop below),
    through the driver :func:`refdml.gpu.ot._small.solve_small_batch`; the others run the
    loop below.

    Both paths end as the reference's solve does where ``eps`` exceeds a problem's largest
    cost (:func:`_finish_large_eps`). ``largest`` (max C over the batch) and ``smallest``
    (the smallest over the problems of their max C) are Python floats a caller may already
    hold; ``largest`` is read here otherwise (one synchronisation on CuPy), ``smallest``
    spares CuPy the finish's work where ``eps <= smallest``.
    """
    dtype = cost.dtype
    backend = get_backend(cost)
    check_every = backend.check_every(CHECK_EVERY_GPU)
    if largest is None:                                   # (the caller may know it)
        largest = float(xp.max(cost)) if cost.size else 0.0   # one synchronisation on CuPy
    if tol > 0.0:
        tol = max(tol, residual_floor(dtype, largest / eps))
    # Every comparison err <= tol casts tol to the dtype: 1e300 overflowed float32 (a
    # RuntimeWarning). A finite err (the L1 marginal error, at most 2) is <= either bound.
    tol = min(tol, float(np.finfo(dtype).max))
    log_a, log_b = xp.log(a), xp.log(b)
    n_problems, n, m = cost.shape
    phi = xp.zeros((n_problems, n), dtype=dtype)
    psi = xp.zeros((n_problems, m), dtype=dtype)
    n_iter = xp.zeros(n_problems, dtype=xp.int64)
    schedule = [eps]
    if eps_scaling is not None:
        check_schedule_length(largest, eps, eps_scaling)
        schedule, level = [], largest
        while level > eps:
            schedule.append(level)
            level *= eps_scaling
        schedule.append(eps)
    if smallest is None and n_problems == 1:
        smallest = largest                  # max C of the one problem <= its max |C|
    if small_kernels and n_problems and impl.takes_small(n, m):
        batch = solve_small_batch(
            xp, a, b, cost, schedule=schedule, eps=eps, max_iter=max_iter, tol=tol,
            symmetric=symmetric, unit=unit, absorb=_ABSORB[np.dtype(dtype)],
            warn_stacklevel=warn_stacklevel + 1,
            solve_small=functools.partial(impl.solve_small, xp),
        )
        return _finish_large_eps(xp, batch, smallest)
    previous = schedule[0]
    for k, level in enumerate(schedule):
        last = k == len(schedule) - 1
        phi, psi = phi * (previous / level), psi * (previous / level)
        scaled = cost * (1.0 / level)
        scaled_t = None if symmetric else xp.ascontiguousarray(xp.swapaxes(scaled, 1, 2))
        stage_tol = tol if last else max(tol, _STAGE_TOL)
        if _USE_SCALING and backend.gathers_rows:
            phi, psi, it, err = _stage_scaling(
                xp, impl, a, b, log_a, log_b, scaled, scaled_t, phi, psi, tol=stage_tol,
                max_iter=max_iter, symmetric=symmetric,
            )
        else:
            phi, psi, it, err = _stage(
                xp, impl, a, b, log_a, log_b, scaled, scaled_t, phi, psi, tol=stage_tol,
                max_iter=max_iter, symmetric=symmetric, check_every=check_every,
            )
        n_iter += it
        previous = level
    plan = None
    if want_plan:
        plan = (log_a + phi)[:, :, None] + (log_b + psi)[:, None, :] - scaled
        xp.exp(plan, out=plan)
    batch = finish_batch(xp, a, b, cost, eps, phi, psi, plan, n_iter, err, tol, max_iter, unit,
                         warn_stacklevel + 1)
    return _finish_large_eps(xp, batch, smallest)


def _finish_large_eps(xp, batch: OTBatch, smallest: float | None, *,
                      gather: bool | None = None) -> OTBatch:
    """The reference's end of a solve (:func:`refdml.ot._sinkhorn._finish_large_eps`) on
    ``xp``'s arrays: every problem whose ``eps`` exceeds its largest ``|C|`` gets three exact
    log-domain half steps from ``f``, ``g = G(f)``, ``f = F(g)``, ``g = G(f)``, and its plan
    from them; the other problems are returned as they are.

    The half steps are the reference's own (:func:`refdml._shared.ot.large_eps_half_steps`,
    written for either array module); the selection of problems is this function's.
    Why (docs/ot.md, Sec. 2): at ``eps >> C`` the iteration holds the potentials only to
    ``eps ulp`` and ``eps tol``, and each half step contracts that error by
    ``tanh(max C / (4 eps)) < 1/4``. The potentials here are in units of ``unit`` as the
    reference's (``batch.f``, ``batch.g``), so the exponents are the reference's
    ``(f - C) / eps``. ``n_iter``, ``marginal_error`` and ``converged`` stay the stopping
    rule's, as the reference's.

    Which problems: where the backend gathers rows (NumPy,
    :attr:`refdml._backend.Backend.gathers_rows`) they are gathered (free). On CuPy that
    would read a mask back, so no problem is gathered: where the host knows that none needs
    it (``eps <= smallest``, the smallest over the problems of their largest cost: a
    caller's Python float, or ``largest`` for one problem) nothing is computed; otherwise
    every problem's half steps are computed and kept where ``eps > max |C|`` (``where``;
    three half steps more work, no synchronisation). ``gather``: None asks the backend
    (the tests run both choices on NumPy).
    """
    eps, cost = batch.eps, batch.cost
    if batch.cost.shape[0] == 0 or (smallest is not None and eps <= smallest):
        return batch
    backend = get_backend(cost)
    far = eps > xp.max(xp.abs(cost), axis=(1, 2))
    if gather is None:
        gather = backend.gathers_rows
    if gather:
        if not far.any():
            return batch
        rows = far
    else:
        rows = slice(None)
    a, b, cost = batch.a[rows], batch.b[rows], cost[rows]
    with backend.errstate(divide="ignore"):  # a weight below the dtype's tiny: no mass (reference)
        log_a, log_b = xp.log(a), xp.log(b)

    f, g, plan = large_eps_half_steps(log_a, a, log_b, b, cost, eps, batch.f[rows],
                                       want_plan=batch.plan is not None)
    if gather:
        f_all, g_all = batch.f.copy(), batch.g.copy()
        f_all[far], g_all[far] = f, g
        if plan is not None:
            plan_all = batch.plan.copy()
            plan_all[far] = plan
            plan = plan_all
    else:
        f_all = xp.where(far[:, None], f, batch.f)
        g_all = xp.where(far[:, None], g, batch.g)
        if plan is not None:
            plan = xp.where(far[:, None, None], plan, batch.plan)
    return replace(batch, f=f_all, g=g_all, plan=plan)


def batch_value(xp, batch: OTBatch):
    """Regularised value ``unit (<a, f> + <b, g> - eps (mass - 1))`` (P,), like the reference.

    ``mass - 1`` is summed as ``sum_ij a_i b_j expm1((f_i + g_j - C_ij) / eps)``, as the
    reference's :attr:`refdml._shared.ot.OTBatch.value`: at ``eps >> C`` the plan is
    ``a b^T`` to ``O(C / eps)`` and ``sum(plan) - 1`` would cost ``eps ulp``.
    """
    excess = mass_excess(batch.a, batch.b, batch.f, batch.g, batch.cost, batch.eps)
    scaled = xp.sum(batch.a * batch.f, axis=1) + xp.sum(batch.b * batch.g, axis=1)
    return batch.unit * (scaled - batch.eps * excess)


def batch_transport_cost(xp, batch: OTBatch):
    """``unit <pi, C>`` (P,)."""
    flat = batch.plan.shape[0], -1
    # einsum: no (P, n, m) temporary, as multiply-then-sum would make.
    return batch.unit * xp.einsum("pk,pk->p", batch.plan.reshape(flat), batch.cost.reshape(flat))
