r"""Small-problem Sinkhorn: one OT problem of at most 128 x 128 points per thread block.

A Numba ``@cuda.jit`` kernel (:func:`cuda_kernel`, one block per problem) and its compiled
CPU twin (:func:`refdml_ot_sinkhorn_small_cpu`, ``prange`` over problems) run the solver
of :func:`refdml.gpu._ot_sinkhorn._stage_scaling` (itself the reference's,
:func:`refdml.ot._sinkhorn._stage`) for every problem of a batch, every eps-scaling stage
and every iteration without leaving the kernel. Both call the scalar functions below
(one source of truth), so they take the same steps in the same order.

The iteration (docs/ot.md Sec. 2). Potentials ``phi``, ``psi`` in units of the current
``eps`` level, ``S = C / level``. An *absorption* folds the scalings into the potentials
and rebuilds the kernel with the columns exact::

    psi_j = -LSE_i(log a_i + phi_i - S_ij)                        (non-symmetric)
    K_ij  = a_i b_j exp(phi_i + psi_j - S_ij) = E_ij b_j / s_j    (E_ij = exp(z_ij - max_i z_ij))
    phi_i <- (phi_i + T(phi)_i) / 2,  T(phi)_i = -LSE_j(log a_j + phi_j - S_ij),
    K_ij  = a_i a_j exp(phi_i + phi_j - S_ij)                      (symmetric, OT(mu, mu))

(one exponential per entry for the non-symmetric rebuild: the column log-sum-exp keeps
its terms ``E_ij`` and scales them). Between absorptions the iterations run on scalings
``u``, ``v`` (plan ``u_i K_ij v_j``), two multiply-adds per entry::

    row = K v;  residual = sum_i |u_i row_i - a_i|;  stop if residual <= tol (or max_iter)
    u = a / max(row, tiny);  col = K^T u;  v = b / max(col, tiny)
    symmetric: u = sqrt(u a / max(row, tiny)), v = u

and a problem whose scaling leaves ``[e^-B, e^B]`` (or whose row / column mass falls
below ``tiny``) is absorbed again. The stopping rule, the residual and the iteration count
are those of the array path (so ``n_iter``, ``marginal_error`` and ``converged`` agree with
it, except where a residual lies within rounding of its threshold), the eps-scaling stages
too (intermediate stages stop at ``max(tol, 1e-3)``).
The kernel writes the plan ``u_i K_ij v_j`` (no further exponential) and the potentials
``phi + log u``, ``psi + log v``.

dtype: potentials, scalings, sums and the residual are float64 in both twins (float32
inputs accumulate in float64); the CUDA kernel stores ``K`` (and the plan) in the input's
dtype, the CPU twin in float64 (float32 problems are widened on the host: one compiled
signature, half the cold compile time) and rounds the plan back. ``B`` and ``tiny`` are
the array path's for the input dtype, so the float32
kernel flushes and absorbs where the float32 array path does.

CUDA launch: one block per problem, ``threads = min(BLOCK, 32 ceil(max(n, m) / 32))``
threads (a warp multiple up to :data:`refdml.gpu._numba_support.BLOCK` = 128 = the largest
problem): thread ``i`` owns row ``i`` (the row product, ``u_i``) and column ``i`` (the
column product and column log-sum-exp, ``v_i``); the residual is summed by thread 0 in
row order (the CPU twin's order). ``K`` lives in shared memory when it fits
:data:`TILE_BYTES` (49 x 49 float64: 19 KB; up to 69 x 69 float64 or 98 x 98 float32),
else in the plan output in global memory (still one block per problem; L1/L2-resident).
The cost is read from global memory at each absorption only. Nothing reaches the host:
the outputs are arrays of the input's module.

The CPU twin uses ``fastmath`` reassociation/contraction (vectorised sums; no
``nnan``/``ninf``: the log-sum-exp handles ``-inf``): its sums differ from the CUDA
kernel's in the last bits only, and so do its sums on two CPU targets (vector width, FMA).
So do the residuals, and an iteration count (a test ``residual <= tol``) can differ
between two of them only where a residual lies within that rounding of its threshold:
tests/test_gpu_kernels_ot.py compares counts where a margin certifies them.

Also here (the same topic, one file of ~570 lines): the pair-cost assembly of the CPU route
(:func:`refdml_ot_pair_sq_cpu`) and the log-sum-exp half step of the general batched solver
(:func:`lse_half_step`).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import cuda, njit, prange

from refdml.gpu._numba_scalar import lse_push, lse_value
from refdml.gpu._numba_support import BLOCK, cuda_launch, cuda_simulator, parallel_launch

__all__ = ["MAX_POINTS", "TILE_BYTES", "cuda_kernel", "refdml_ot_sinkhorn_small_cpu",
           "solve_small"]

#: Largest problem (points per side) of the small-problem kernel: one thread per point.
MAX_POINTS = BLOCK
#: Shared memory for the kernel tile per block (the rest of the 48 KB static limit holds
#: the ten float64 vectors of length BLOCK).
TILE_BYTES = 36 * 1024
_FASTMATH = {"reassoc", "contract"}


# --------------------------------------------------------------------------- scalar maths
@njit(cache=True, inline="always")
def log_kernel_exponent(log_weight, potential, cost, inv_level):
    """``log w + potential - C / level``: one term of a half step's log-sum-exp."""
    return log_weight + potential - cost * inv_level


@njit(cache=True, inline="always")
def potential_from_lse(peak, total):
    """The potential ``-LSE = -(peak + log total)`` of a two-pass log-sum-exp."""
    return -(peak + math.log(total))


@njit(cache=True, inline="always")
def flush(value, tiny):
    """Kernel entries below the dtype's ``tiny`` are 0 (as the array path)."""
    return value if value >= tiny else 0.0


@njit(cache=True, inline="always")
def scaling_update(weight, mass, tiny):
    """``u = a / max(K v, tiny)``: the non-symmetric potential (scaling) update."""
    return weight / max(mass, tiny)


@njit(cache=True, inline="always")
def symmetric_scaling_update(scaling, weight, mass, tiny):
    """``u <- sqrt(u a / max(K u, tiny))``: the averaged update of OT(mu, mu)."""
    return math.sqrt(scaling * weight / max(mass, tiny))


@njit(cache=True, inline="always")
def residual_term(scaling, mass, weight):
    """``|u_i (K v)_i - a_i|``: one row's share of the L1 marginal error."""
    return abs(scaling * mass - weight)


@njit(cache=True, inline="always")
def needs_absorb(scaling, mass, tiny, high, low):
    """A scaling outside ``[low, high]`` or a mass below ``tiny``: rebuild the kernel."""
    return scaling > high or scaling < low or mass < tiny


@njit(cache=True, inline="always")
def symmetric_average(potential, lse):
    """``(phi + T(phi)) / 2`` with ``T(phi) = -lse``."""
    return 0.5 * (potential - lse)


# --------------------------------------------------------------------------- CPU twin
@njit(cache=True, fastmath=_FASTMATH)
def _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak, total):
    n, m = cost.shape
    for i in range(n):
        phi[i] += math.log(u[i])
    if symmetric:
        for i in range(n):
            mx, s = -math.inf, 0.0
            for j in range(n):
                mx, s = lse_push(mx, s, log_kernel_exponent(la[j], phi[j], cost[i, j], inv))
            total[i] = lse_value(mx, s)
        for i in range(n):
            phi[i] = symmetric_average(phi[i], total[i])
        for i in range(n):
            base = la[i] + phi[i]
            for j in range(n):
                kernel[i, j] = flush(math.exp(base + la[j] + phi[j] - cost[i, j] * inv), tiny)
            u[i] = 1.0
        return
    for j in range(m):
        peak[j] = -math.inf
        total[j] = 0.0
    for i in range(n):
        for j in range(m):
            peak[j] = max(peak[j], log_kernel_exponent(la[i], phi[i], cost[i, j], inv))
    for i in range(n):
        for j in range(m):
            e = math.exp(log_kernel_exponent(la[i], phi[i], cost[i, j], inv) - peak[j])
            kernel[i, j] = e
            total[j] += e
    for j in range(m):
        psi[j] = potential_from_lse(peak[j], total[j])
        total[j] = math.exp(lb[j]) / total[j]
        v[j] = 1.0
    for i in range(n):
        for j in range(m):
            kernel[i, j] = flush(kernel[i, j] * total[j], tiny)
        u[i] = 1.0


@njit(cache=True, fastmath=_FASTMATH)
def _cpu_problem(cost, a, b, phi, psi, schedule, stage_tol, max_iter, symmetric, tiny, high,
                 low, kernel):
    """One problem, every stage; returns ``(iterations, residual)``; ``kernel`` -> plan."""
    n, m = cost.shape
    la, lb = np.log(a), np.log(b)
    u, row = np.ones(n), np.empty(n)
    v, col = (u, row) if symmetric else (np.ones(m), np.empty(m))
    peak, total = np.empty(max(n, m)), np.empty(max(n, m))
    if symmetric:
        psi = phi
    n_iter, err = 0, math.inf
    previous = schedule[0]
    for k in range(schedule.shape[0]):
        level = schedule[k]
        inv = 1.0 / level
        for i in range(n):
            phi[i] *= previous / level
        if not symmetric:
            for j in range(m):
                psi[j] *= previous / level
        for i in range(n):
            u[i] = 1.0
        _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak, total)
        tol = stage_tol[k]
        for it in range(max_iter + 1):
            err = 0.0
            for i in range(n):
                r = 0.0
                for j in range(m):
                    r += kernel[i, j] * v[j]
                row[i] = r
            for i in range(n):                      # in row order, as the CUDA kernel
                err += residual_term(u[i], row[i], a[i])
            if err <= tol or it == max_iter:
                n_iter += it
                break
            bad = False
            if symmetric:
                for i in range(n):
                    u[i] = symmetric_scaling_update(u[i], a[i], row[i], tiny)
                    bad |= needs_absorb(u[i], row[i], tiny, high, low)
            else:
                for i in range(n):
                    u[i] = scaling_update(a[i], row[i], tiny)
                    bad |= needs_absorb(u[i], row[i], tiny, high, low)
                for j in range(m):
                    col[j] = 0.0
                for i in range(n):
                    for j in range(m):
                        col[j] += kernel[i, j] * u[i]
                for j in range(m):
                    v[j] = scaling_update(b[j], col[j], tiny)
                    bad |= needs_absorb(v[j], col[j], tiny, high, low)
            if bad:
                _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak,
                            total)
        # fold the scalings in: the stage's potentials, and (last stage) the plan
        for i in range(n):
            for j in range(m):
                kernel[i, j] *= u[i] * v[j]
        for i in range(n):
            phi[i] += math.log(u[i])
        if not symmetric:
            for j in range(m):
                psi[j] += math.log(v[j])
        previous = level
    return n_iter, err


@njit(parallel=True, cache=True)
def refdml_ot_sinkhorn_small_cpu(cost, a, b, phi, psi, schedule, stage_tol, max_iter,
                                 symmetric, tiny, high, low, plan, n_iter, err):
    """CPU twin: every problem of ``cost`` (P, n, m) in a ``prange`` (see the module doc).

    In/out: ``phi`` (P, n), ``psi`` (P, m) float64 (start -> solution, units of the last
    ``eps``); out: ``plan`` (P, n, m) (input dtype), ``n_iter`` (P,) int64, ``err`` (P,).
    """
    for p in prange(cost.shape[0]):
        it, e = _cpu_problem(cost[p], a[p], b[p], phi[p], psi[p], schedule, stage_tol, max_iter,
                             symmetric, tiny, high, low, plan[p])
        n_iter[p] = it
        err[p] = e
        if symmetric:
            psi[p, :] = phi[p, :]


# --------------------------------------------------------------------------- CUDA kernel
@cuda.jit(device=True)
def _cuda_absorb(cost, p, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, total):
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    n, m = cost.shape[1], cost.shape[2]
    if t < n:
        phi[t] += math.log(u[t])
    cuda.syncthreads()
    if symmetric:
        if t < n:
            mx, s = -math.inf, 0.0
            for j in range(n):
                mx, s = lse_push(mx, s, log_kernel_exponent(la[j], phi[j], cost[p, t, j], inv))
            total[t] = lse_value(mx, s)
        cuda.syncthreads()
        if t < n:
            phi[t] = symmetric_average(phi[t], total[t])
            u[t] = 1.0
        cuda.syncthreads()
        for idx in range(t, n * n, nt):
            i, j = idx // n, idx % n
            kernel[idx] = flush(math.exp(la[i] + phi[i] + la[j] + phi[j] - cost[p, i, j] * inv),
                                tiny)
        cuda.syncthreads()
        return
    if t < m:
        mx = -math.inf
        for i in range(n):
            mx = max(mx, log_kernel_exponent(la[i], phi[i], cost[p, i, t], inv))
        s = 0.0
        for i in range(n):
            e = math.exp(log_kernel_exponent(la[i], phi[i], cost[p, i, t], inv) - mx)
            kernel[i * m + t] = e
            s += e
        psi[t] = potential_from_lse(mx, s)
        scale = math.exp(lb[t]) / s
        for i in range(n):
            kernel[i * m + t] = flush(kernel[i * m + t] * scale, tiny)
        v[t] = 1.0
    if t < n:
        u[t] = 1.0
    cuda.syncthreads()


@cuda.jit(device=True)
def _cuda_problem(cost, a, b, p, phi_out, psi_out, schedule, stage_tol, max_iter, symmetric,
                  tiny, high, low, kernel, la, lb, phi, psi, u, v, row, terms, total, flags):
    """One block solves problem ``p``; ``kernel`` (flat n * m) is the shared tile or the plan."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    n, m = cost.shape[1], cost.shape[2]
    if t < n:
        la[t] = math.log(a[p, t])
        phi[t] = phi_out[p, t]
    if t < m:
        lb[t] = math.log(b[p, t])
        psi[t] = psi_out[p, t]
    n_iter, err = 0, math.inf
    previous = schedule[0]
    for k in range(schedule.shape[0]):
        level = schedule[k]
        inv = 1.0 / level
        cuda.syncthreads()
        if t < n:
            phi[t] *= previous / level
            u[t] = 1.0
        if t < m:
            psi[t] *= previous / level
        if t == 0:
            flags[0] = 0
            flags[1] = 0
            flags[2] = 0
        cuda.syncthreads()
        if symmetric:
            _cuda_absorb(cost, p, la, la, phi, phi, u, u, kernel, inv, tiny, symmetric, total)
        else:
            _cuda_absorb(cost, p, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, total)
        tol = stage_tol[k]
        for it in range(max_iter + 1):
            # (A) row products and each row's residual term; flags[it % 3] is this
            # iteration's absorb flag, flags[(it + 1) % 3] (last read two iterations ago,
            # before a barrier every thread has passed since) is reset for the next.
            if t < n:
                r = 0.0
                if symmetric:
                    for j in range(n):
                        r += kernel[t * n + j] * u[j]
                else:
                    for j in range(m):
                        r += kernel[t * m + j] * v[j]
                row[t] = r
                terms[t] = residual_term(u[t], r, a[p, t])
            if t == 0:
                flags[(it + 1) % 3] = 0
            cuda.syncthreads()
            # (B) every thread sums the residual in row order (the CPU twin's order), so
            # every thread takes the same branch; then the scaling updates.
            err = 0.0
            for i in range(n):
                err += terms[i]
            if err <= tol or it == max_iter:
                n_iter += it
                break
            if t < n:
                if symmetric:
                    u[t] = symmetric_scaling_update(u[t], a[p, t], row[t], tiny)
                else:
                    u[t] = scaling_update(a[p, t], row[t], tiny)
                if needs_absorb(u[t], row[t], tiny, high, low):
                    flags[it % 3] = 1
            cuda.syncthreads()
            if not symmetric:
                if t < m:
                    c = 0.0
                    for i in range(n):
                        c += kernel[i * m + t] * u[i]
                    v[t] = scaling_update(b[p, t], c, tiny)
                    if needs_absorb(v[t], c, tiny, high, low):
                        flags[it % 3] = 1
                cuda.syncthreads()
            if flags[it % 3] != 0:
                if symmetric:
                    _cuda_absorb(cost, p, la, la, phi, phi, u, u, kernel, inv, tiny, symmetric,
                                 total)
                else:
                    _cuda_absorb(cost, p, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric,
                                 total)
        cuda.syncthreads()
        for idx in range(t, n * m, nt):
            i, j = idx // m, idx % m
            kernel[idx] *= u[i] * (u[j] if symmetric else v[j])
        cuda.syncthreads()
        if t < n:
            phi[t] += math.log(u[t])
        if t < m and not symmetric:
            psi[t] += math.log(v[t])
        previous = schedule[k]
    cuda.syncthreads()
    return n_iter, err


@functools.lru_cache(maxsize=None)
def cuda_kernel(dtype):
    """The ``@cuda.jit`` kernel ``refdml_ot_sinkhorn_small`` for a plan of ``dtype``.

    Signature as :func:`refdml_ot_sinkhorn_small_cpu`, with ``plan`` flat (P, n * m) and a
    launch of one block per problem: ``kernel[P, threads](...)`` (see the module doc).
    """
    tile_type = numba.from_dtype(np.dtype(dtype))
    tile_size = TILE_BYTES // np.dtype(dtype).itemsize

    @cuda.jit
    def refdml_ot_sinkhorn_small(cost, a, b, phi_out, psi_out, schedule, stage_tol, max_iter,
                                 symmetric, tiny, high, low, plan, n_iter, err):
        p = cuda.blockIdx.x
        if p >= cost.shape[0]:
            return
        t = cuda.threadIdx.x
        n, m = cost.shape[1], cost.shape[2]
        tile = cuda.shared.array(tile_size, tile_type)
        la = cuda.shared.array(BLOCK, numba.float64)
        lb = cuda.shared.array(BLOCK, numba.float64)
        phi = cuda.shared.array(BLOCK, numba.float64)
        psi = cuda.shared.array(BLOCK, numba.float64)
        u = cuda.shared.array(BLOCK, numba.float64)
        v = cuda.shared.array(BLOCK, numba.float64)
        row = cuda.shared.array(BLOCK, numba.float64)
        terms = cuda.shared.array(BLOCK, numba.float64)
        total = cuda.shared.array(BLOCK, numba.float64)
        flags = cuda.shared.array(3, numba.int32)
        in_shared = n * m <= tile_size
        if in_shared:
            it, e = _cuda_problem(cost, a, b, p, phi_out, psi_out, schedule, stage_tol, max_iter,
                                  symmetric, tiny, high, low, tile, la, lb, phi, psi, u, v, row,
                                  terms, total, flags)
            for idx in range(t, n * m, cuda.blockDim.x):
                plan[p, idx] = tile[idx]
        else:
            it, e = _cuda_problem(cost, a, b, p, phi_out, psi_out, schedule, stage_tol, max_iter,
                                  symmetric, tiny, high, low, plan[p], la, lb, phi, psi, u, v,
                                  row, terms, total, flags)
        if t < n:
            phi_out[p, t] = phi[t]
        if t < m:
            psi_out[p, t] = phi[t] if symmetric else psi[t]
        if t == 0:
            n_iter[p] = it
            err[p] = e

    return refdml_ot_sinkhorn_small


def threads_per_problem(n: int, m: int) -> int:
    """Threads of one block: a warp multiple covering every point, at most ``BLOCK``.

    Under Numba's CUDA simulator (every thread a Python thread, warps meaningless) exactly
    ``max(n, m)`` threads, which keeps CI's simulated runs short.
    """
    if cuda_simulator():
        return max(n, m)
    return min(BLOCK, 32 * -(-max(n, m) // 32))


# --------------------------------------------------------------------------- launcher
def solve_small(xp, kernel: str, a, b, cost, *, schedule, stage_tol, max_iter, symmetric,
                tiny, high, low):
    """Run the ``"cpu"`` twin or the ``"cuda"`` kernel on P problems of at most 128 points.

    ``a`` (P, n), ``b`` (P, m) on the simplex, ``cost`` (P, n, m) (arrays of ``xp``);
    ``schedule`` / ``stage_tol`` the eps levels and their tolerances. Returns ``phi``,
    ``psi`` (input dtype, units of the last level), ``n_iter`` (int64), ``err`` and the plan,
    all arrays of ``xp`` (nothing reaches the host).
    """
    n_problems, n, m = cost.shape
    if max(n, m) > MAX_POINTS:
        raise ValueError(f"the small-problem kernel takes at most {MAX_POINTS} points, "
                         f"got {n} x {m}")
    dtype = cost.dtype
    cost = xp.ascontiguousarray(cost)
    a = xp.ascontiguousarray(a, dtype=xp.float64)
    b = xp.ascontiguousarray(b, dtype=xp.float64)
    phi = xp.zeros((n_problems, n), dtype=xp.float64)
    psi = xp.zeros((n_problems, m), dtype=xp.float64)
    plan = xp.empty((n_problems, n, m), dtype=dtype)
    n_iter = xp.zeros(n_problems, dtype=xp.int64)
    err = xp.full(n_problems, np.inf, dtype=xp.float64)
    schedule = xp.asarray(np.asarray(schedule, dtype=np.float64))
    stage_tol = xp.asarray(np.asarray(stage_tol, dtype=np.float64))
    args = (schedule, stage_tol, int(max_iter), bool(symmetric), float(tiny), float(high),
            float(low))
    if n_problems:
        if kernel == "cpu":
            if dtype != np.float64:
                # One compiled signature (float64; halves the cold compile time): float32
                # problems are widened on the host and the plan rounded back.
                wide = np.empty(plan.shape)
                with parallel_launch():
                    refdml_ot_sinkhorn_small_cpu(cost.astype(np.float64), a, b, phi, psi,
                                                 *args, wide, n_iter, err)
                plan[...] = wide
            else:
                with parallel_launch():
                    refdml_ot_sinkhorn_small_cpu(cost, a, b, phi, psi, *args, plan, n_iter, err)
        elif kernel == "cuda":
            cuda_launch(cuda_kernel(np.dtype(dtype)), n_problems, threads_per_problem(n, m),
                        cost, a, b, phi, psi, *args, plan.reshape(n_problems, n * m), n_iter,
                        err)
        else:
            raise ValueError(f"kernel == {kernel!r}, must be 'cpu' or 'cuda'")
    return phi.astype(dtype, copy=False), psi.astype(dtype, copy=False), n_iter, \
        err.astype(dtype, copy=False), plan


# --------------------------------------------------------------------------- pair costs (CPU)
@njit(parallel=True, cache=True)
def refdml_ot_pair_sq_cpu(points, norms, first, second, refine, out):
    """``out[k, i, j] = max(|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>, 0)``, x = cloud ``first[k]``,
    y = cloud ``second[k]`` of ``points`` (B, n, d), ``norms`` (B, n) their squared norms.

    One ``prange`` over pairs; each pair's (n, n) Gram block is one ``np.dot`` (a
    single-threaded BLAS GEMM: the caller holds BLAS at one thread, so Numba's threads are
    the only ones) and is turned into costs while it is in cache: no Gram matrix of all
    points, no gathered copies, and no BLAS thread pool left spinning against the solver's
    threads. Entries ``<= refine (|x_i|^2 + |y_j|^2)`` are recomputed from the explicit
    difference (the reference's refinement, refdml._numerics; ``refine < 0``: never). A
    pair ``first[k] == second[k]`` is a cloud with itself: 0 on the diagonal and the mean of
    the two triangles, as the reference's ``_self_sq_dist`` (exactly symmetric).
    """
    n, d = points.shape[1], points.shape[2]
    for k in prange(first.shape[0]):
        f, s = first[k], second[k]
        gram = np.dot(points[f], points[s].T)
        for i in range(n):
            for j in range(n):
                magnitude = norms[f, i] + norms[s, j]
                value = magnitude - 2.0 * gram[i, j]
                if value <= refine * magnitude:
                    value = 0.0
                    for c in range(d):
                        diff = points[f, i, c] - points[s, j, c]
                        value += diff * diff
                out[k, i, j] = max(value, 0.0)
        if f == s:
            for i in range(n):
                out[k, i, i] = 0.0
                for j in range(i + 1, n):
                    mean = 0.5 * (out[k, i, j] + out[k, j, i])
                    out[k, i, j] = mean
                    out[k, j, i] = mean


# --------------------------------------------------------------------------- LSE half step
@njit(parallel=True, cache=True)
def refdml_ot_lse_half_step_cpu(scaled_cost, weighted_potential, out):
    """CPU twin of the half step: ``out[p, i] = -LSE_j(w[p, j] - S[p, i, j])``, rows in a prange."""
    n_problems, n, m = scaled_cost.shape
    for r in prange(n_problems * n):
        p, i = r // n, r % n
        mx, s = -math.inf, 0.0
        for j in range(m):
            mx, s = lse_push(mx, s, weighted_potential[p, j] - scaled_cost[p, i, j])
        out[p, i] = -lse_value(mx, s)


@cuda.jit
def refdml_ot_lse_half_step(scaled_cost, weighted_potential, out):
    """The half step on the GPU: one thread per row ``(p, i)``, a 1-D grid of BLOCK threads."""
    r = cuda.grid(1)
    n_problems, n, m = scaled_cost.shape
    if r >= n_problems * n:
        return
    p, i = r // n, r % n
    mx, s = -math.inf, 0.0
    for j in range(m):
        mx, s = lse_push(mx, s, weighted_potential[p, j] - scaled_cost[p, i, j])
    out[p, i] = -lse_value(mx, s)


def _launch_signatures(dt):
    """The Numba signature of each kernel's launch for a cost of dtype ``dt``: the small
    problems' (:func:`solve_small`, the kernel :func:`cuda_kernel` builds for ``dt``; the
    state float64, the plan flat (P, n m)) and the half step's (:func:`lse_half_step`; its
    arrays as :mod:`refdml.gpu._ot_sinkhorn` passes them, contiguous)."""
    f8_1, f8_2 = "float64[::1]", "float64[:, ::1]"
    return {
        "refdml_ot_sinkhorn_small": (f"void({dt}[:, :, ::1], {f8_2}, {f8_2}, {f8_2}, {f8_2}, "
                                     f"{f8_1}, {f8_1}, int64, boolean, float64, float64, "
                                     f"float64, {dt}[:, ::1], int64[::1], {f8_1})"),
        "refdml_ot_lse_half_step": f"void({dt}[:, :, ::1], {dt}[:, ::1], {dt}[:, ::1])",
    }


#: The argument types of every launch of this module's CUDA kernels, by the cost's dtype:
#: kernel name -> {dtype: Numba signature}. :mod:`refdml.gpu._cuda_compile` compiles each
#: for real GPUs; keep :func:`_launch_signatures` in step with the launches.
CUDA_SIGNATURES = {
    name: {dt: _launch_signatures(dt)[name] for dt in ("float32", "float64")}
    for name in _launch_signatures("float64")
}


def lse_half_step(xp, kernel: str, scaled_cost, weighted_potential):
    r"""``f_i = -LSE_j(w_j - S_ij)`` (P, n) for ``S`` (P, n, m), ``w`` (P, m): the log-sum-exp
    half step of the batched Sinkhorn of :mod:`refdml.gpu._ot_sinkhorn` (``w = log b + psi``),
    by the ``"cpu"`` twin or the ``"cuda"`` kernel.

    One pass over ``S`` with the online log-sum-exp (:func:`refdml.gpu._numba_scalar.lse_push`:
    the running maximum is the stabiliser, so nothing overflows whatever ``S`` is), no
    (P, n, m) temporary (the array path writes one and makes three passes). One thread per
    row; launch: ``ceil(P n / BLOCK)`` blocks of BLOCK threads (under the simulator at most
    ``P n`` threads). Accumulates in float64; the output has the input's dtype and module.
    """
    n_problems, n, m = scaled_cost.shape
    out = xp.empty((n_problems, n), dtype=scaled_cost.dtype)
    weighted_potential = weighted_potential.astype(scaled_cost.dtype, copy=False)
    rows = n_problems * n
    if rows == 0:
        return out
    if kernel == "cpu":
        with parallel_launch():
            refdml_ot_lse_half_step_cpu(scaled_cost, weighted_potential, out)
    elif kernel == "cuda":
        threads = min(BLOCK, rows) if cuda_simulator() else BLOCK
        cuda_launch(refdml_ot_lse_half_step, -(-rows // threads), threads, scaled_cost,
                    weighted_potential, out)
    else:
        raise ValueError(f"kernel == {kernel!r}, must be 'cpu' or 'cuda'")
    return out
