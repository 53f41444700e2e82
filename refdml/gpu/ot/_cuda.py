r"""Small-problem Sinkhorn, CUDA kernel: one OT problem of at most 128 x 128 points per block.

The ``@cuda.jit`` kernel (:func:`small_problem_kernel`, one block per problem) of the
small-problem solver whose iteration, scalar maths (one source for both targets) and
compiled CPU twin are in :mod:`refdml.gpu.ot._compiled`; its launch and the family's CUDA
member (:class:`refdml.gpu.ot._kernels.CudaPath`, which imports this module when it is
built) are in :mod:`refdml.gpu.ot._kernels`. The kernel stores ``K`` (and the plan) in the
input's dtype; the potentials, scalings, sums and the residual are float64, as in the twin.

CUDA launch: one block per problem, ``threads = min(BLOCK, 32 ceil(max(n, m) / 32))``
threads (a warp multiple up to :data:`refdml.gpu._support.launch.BLOCK` = 128 = the largest
problem): thread ``i`` owns row ``i`` (the row product, ``u_i``) and column ``i`` (the
column product and column log-sum-exp, ``v_i``); every thread sums the residual terms in
row order (the CPU twin's order). ``K`` lives in shared memory when it fits
:data:`TILE_BYTES` (49 x 49 float64: 19 KB; up to 69 x 69 float64 or 98 x 98 float32),
else in the plan output in global memory (still one block per problem; L1/L2-resident).
The cost is read from global memory at each absorption only. Nothing reaches the host:
the outputs are arrays of the input's module.

Occupancy (``refdml gpu-check --compile-only --arch sm_90``, numba-cuda 0.30, no GPU
needed). Left to itself the compiler gives the small-problem kernel 131 (float64) / 133
(float32) registers per thread, no spill: three blocks of 128 threads per SM, a
theoretical occupancy of 18.75 %, limited by registers. Capped at :data:`MAX_REGISTERS` =
128 it takes 128, still without a spill: four blocks, 25 %; the arithmetic is the same
(the cap changes the allocation of registers, not the operations), so results are too.
At 96 (five blocks) it spills (148-176 B per thread). Shared memory (46,092 B: the tile
and the vectors) allows four blocks of an H200's 228 KB, so it does not limit; moving the
four vectors that only their own thread reads (``lb``, ``psi``, ``row``, ``total``) to
registers would save 4 KB but adds registers, which are the limit.

Also here: the log-sum-exp half step of the general batched solver (the CUDA kernel
:func:`refdml_ot_lse_half_step`; the CPU twin is
:func:`refdml.gpu.ot._compiled.refdml_ot_lse_half_step_cpu`).
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

from refdml.gpu._support.cuda import CudaKernel, cuda, cuda_kernel, register
from refdml.gpu._support.scalar import lse_push, lse_value
from refdml.gpu._support.launch import BLOCK
from refdml.gpu._support.modes import cuda_simulator
from refdml.gpu.ot._compiled import (
    flush,
    log_kernel_exponent,
    needs_absorb,
    potential_from_lse,
    residual_term,
    scaling_update,
    symmetric_average,
    symmetric_scaling_update,
)

__all__ = ["MAX_REGISTERS", "TILE_BYTES", "refdml_ot_lse_half_step", "small_problem_kernel"]

#: Shared memory for the kernel tile per block (the rest of the 48 KB static limit holds
#: the nine float64 vectors of length BLOCK and three int32 flags).
TILE_BYTES = 36 * 1024
#: Registers per thread of the small-problem kernel (its ``max_registers``; module
#: docstring, "Occupancy").
MAX_REGISTERS = 128


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
def small_problem_kernel(dtype):
    """The ``@cuda.jit`` kernel ``refdml_ot_sinkhorn_small`` for a plan of ``dtype``.

    Signature as :func:`refdml.gpu.ot._compiled.refdml_ot_sinkhorn_small_cpu`, with ``plan``
    flat (P, n * m) and a launch of one block per problem: ``kernel[P, threads](...)`` (see
    the module doc). Cached on disk by numba-cuda, one entry per dtype (the closure's
    values are part of the cache key, and pickle the same in every process:
    tests/gpu/test_gpu_compile.py).
    """
    tile_type = numba.from_dtype(np.dtype(dtype))
    tile_size = TILE_BYTES // np.dtype(dtype).itemsize

    # At most MAX_REGISTERS per thread: four blocks of 128 threads per SM instead of three
    # (theoretical occupancy 25 % instead of 18.75 %; registers are what limits it), with
    # no spill (module docstring, "Occupancy"). The simulator's jit takes no such option.
    options = {} if cuda_simulator() else {"max_registers": MAX_REGISTERS}

    @cuda.jit(cache=True, **options)
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


def _small_problem_signature(dt):
    """The launch types of :func:`small_problem_kernel` for a cost of dtype ``dt``
    (:func:`refdml.gpu.ot._kernels.solve_small`: the state float64, the plan flat (P, n m),
    all C-contiguous)."""
    f8_1, f8_2 = "float64[::1]", "float64[:, ::1]"
    return (f"void({dt}[:, :, ::1], {f8_2}, {f8_2}, {f8_2}, {f8_2}, {f8_1}, {f8_1}, int64, "
            f"boolean, float64, float64, float64, {dt}[:, ::1], int64[::1], {f8_1})")


# One kernel per dtype (its shared tile is typed and sized by the dtype), so it is declared
# with a builder rather than @cuda_kernel.
register(CudaKernel(
    name="refdml_ot_sinkhorn_small", module=__name__,
    signatures={dt: _small_problem_signature(dt) for dt in ("float32", "float64")},
    parameters=("cost", "a", "b", "phi_out", "psi_out", "schedule", "stage_tol", "max_iter",
                "symmetric", "tiny", "high", "low", "plan", "n_iter", "err"),
    build=lambda dtype: small_problem_kernel(np.dtype("float64" if dtype == "any" else dtype))))


# --------------------------------------------------------------------------- LSE half step
# Launch types (:meth:`refdml.gpu.ot._kernels.KernelPath.lse_half_step`; the arrays as
# refdml.gpu's batched solver passes them, contiguous), by the cost's dtype.
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, :, ::1], {dt}[:, ::1], {dt}[:, ::1])" for dt in ("float32", "float64")})
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
