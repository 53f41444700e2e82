"""Greedy k-center, CUDA kernels: each pick one launch, reading the points coalesced.

The traversal, its scalar maths (:func:`refdml.gpu.kcenter._compiled.sq_to_center`,
:func:`refdml.gpu.kcenter._compiled.better`, one source for both targets), the dtype rules
and the compiled CPU twin: :mod:`refdml.gpu.kcenter._compiled`.

Launched by :meth:`refdml.gpu.kcenter._kernels.CudaPath.farthest_first`: one launch per
call to lay the points out for the picks, then one launch per pick, no host round trip and
no argument that changes between picks (the pick's state lives on the device, in ``state``;
the arguments: :class:`refdml.gpu.kcenter._compiled.StepBuffers`).

``refdml_kcenter_prepare`` (once per call; one thread per point)
    Writes the transposed copy ``points_t`` (d, n) and ``|x_i|^2`` (float64 sum in the
    order of the coordinates, stored in the points' dtype). It reads each row with a
    stride of ``d`` (uncoalesced) but writes coalesced: one extra read and write of the
    data per call, amortised over the ``k`` picks.
``refdml_kcenter_step`` (once per pick; one thread per point, ``BLOCK`` a block)
    The block copies the centre's row ``points[q]`` (contiguous, coalesced) into shared
    memory in chunks of :data:`CENTRE_CHUNK` coordinates, as float64; thread ``i`` reads
    ``points_t[j, i]``, so a warp reads 32 consecutive values per coordinate. Each thread
    sums its dot product over ``j = 0 .. d - 1`` in that order, in float64, exactly as the
    first version of this kernel did from the row-major points (the products are the same
    float64 values: widening is exact), updates ``min_sq[i]`` with :func:`sq_to_center`,
    and the block reduces its threads' (value, index) pairs in :func:`better` order
    (:func:`block_argmax`), thread 0 writing the block's pair to ``block_max`` /
    ``block_arg``. The last block to finish then reduces all blocks' pairs: the radius of
    this pick into ``radii_sq``, the next pick into ``state`` and ``indices``.

Last block done (the reduction fused into the update, halving the launches per pick).
Thread 0 of every block stores its block's pair, calls ``cuda.threadfence()`` and then
increments ``state[ARRIVED]`` atomically; the block whose increment returns
``n_blocks - 1`` is the last. Why it reads every block's pair: each writer's fence orders
its pair's stores before its increment for every thread of the device, and the increments
of one counter are totally ordered, so the last block's increment comes after every other
block's, hence after their pairs' stores. The last block's thread 0 shares the verdict
through shared memory across a ``syncthreads()``, and each of its threads calls
``cuda.threadfence()`` again before reading the pairs (the reader's side of the fence
pair: no read of ``block_max`` is served from a copy older than the fence). Every other
block has finished reading ``state[Q]`` and the centre's row before its increment, so the
last block may overwrite ``state`` and reset the counter for the next pick; the next
launch, on the same stream, sees those stores.

Ties and exactness: within a block and across blocks the pairs are merged with
:func:`better` (larger value, or equal value and lower index), ``argmax`` order: the
lowest index among equal distances wins, as in the reference. The arithmetic is the
first version's: float64 products summed in coordinate order, then the Gram identity;
the compiler may contract a product and its sum into an FMA (the documented difference
from the CPU twin and the array path, within the bound of tests/_kcenter_checks.py).

Bytes per pick for ``n`` points of ``d`` coordinates of ``s`` bytes: ``n d s`` of points
(each read once, coalesced), ``2 n s`` of ``min_sq`` (read and written), ``n s`` of
``|x|^2``, plus per block the centre's row (``d s``, from L2) and 16 bytes of its pair:
``n (d + 3) s`` from DRAM. The first version read the same bytes but with the stride of
``d`` between the threads of a warp, so each warp's load of one coordinate touched 32
sectors of 32 bytes for 32 useful elements (eight times the useful traffic through L2 in float32,
four times in float64, where the caches did not hold the rows' sectors until the next coordinate),
and two launches per pick instead of one.
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu._support.launch import BLOCK
from refdml.gpu.kcenter._compiled import ARRIVED, PICK, Q, better, sq_to_center

__all__ = ["CENTRE_CHUNK", "block_argmax", "refdml_kcenter_prepare", "refdml_kcenter_step"]

#: Coordinates of the centre's row held in shared memory at a time (float64: 2 KiB); a
#: larger ``d`` is summed chunk after chunk, in the same order.
CENTRE_CHUNK = 2 * BLOCK

@cuda.jit(device=True)
def block_argmax(s_val, s_arg, t, best, arg):
    """The block's (max, arg-max) of its threads' ``(best, arg)`` pairs, in :func:`better`
    order: a tree reduction in the shared arrays ``s_val`` / ``s_arg`` (``BLOCK`` slots each);
    every thread of the block calls it and gets the result."""
    s_val[t] = best
    s_arg[t] = arg
    cuda.syncthreads()
    width = BLOCK // 2
    while width > 0:
        if t < width and better(s_val[t + width], s_arg[t + width], s_val[t], s_arg[t]):
            s_val[t] = s_val[t + width]
            s_arg[t] = s_arg[t + width]
        cuda.syncthreads()
        width //= 2
    return s_val[0], s_arg[0]


# Launch types (:class:`refdml.gpu.kcenter._kernels.CudaPath`; every array C-contiguous): by
# the points' dtype.
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[:, ::1], {dt}[::1])" for dt in ("float32", "float64")})
def refdml_kcenter_prepare(points, points_t, sq_norms):
    """``points_t = points.T`` (d, n) and ``sq_norms[i] = |x_i|^2``, one thread per point."""
    i = cuda.grid(1)
    if i >= points.shape[0]:
        return
    acc = 0.0
    for j in range(points.shape[1]):
        value = points[i, j]
        points_t[j, i] = value
        acc += np.float64(value) * np.float64(value)
    sq_norms[i] = acc                            # rounds to the array's dtype


@cuda_kernel(cache=True, signatures={
    dt: (f"void({dt}[:, ::1], {dt}[:, ::1], {dt}[::1], {dt}[::1], int64[::1], float64[::1], "
         "int64[::1], int64[::1], float64[::1])") for dt in ("float32", "float64")})
def refdml_kcenter_step(points, points_t, sq_norms, min_sq, state, block_max, block_arg,
                        indices, radii_sq):
    """One pick: update ``min_sq`` from the centre ``state[Q]``; the last block to finish
    writes the radius and the next pick (module docstring: "Last block done")."""
    s_centre = cuda.shared.array(CENTRE_CHUNK, dtype=np.float64)
    s_val = cuda.shared.array(BLOCK, dtype=np.float64)
    s_arg = cuda.shared.array(BLOCK, dtype=np.int64)
    s_last = cuda.shared.array(1, dtype=np.int32)
    n, d = points.shape
    t = cuda.threadIdx.x
    i = cuda.blockIdx.x * BLOCK + t
    q = state[Q]
    dot = 0.0
    for start in range(0, d, CENTRE_CHUNK):
        stop = min(start + CENTRE_CHUNK, d)
        cuda.syncthreads()                       # the previous chunk is read by all
        for j in range(start + t, stop, BLOCK):
            s_centre[j - start] = np.float64(points[q, j])
        cuda.syncthreads()
        if i < n:
            for j in range(start, stop):
                dot += np.float64(points_t[j, i]) * s_centre[j - start]
    best, arg = -math.inf, n
    if i < n:
        m = np.float64(min_sq[i])
        dist = sq_to_center(np.float64(sq_norms[i]), dot, np.float64(sq_norms[q]))
        if dist < m:
            m = dist
        if i == q:
            m = -1.0
        min_sq[i] = m                            # rounds to the array's dtype
        best, arg = np.float64(min_sq[i]), i
    best, arg = block_argmax(s_val, s_arg, t, best, arg)
    n_blocks = cuda.gridDim.x
    if t == 0:
        block_max[cuda.blockIdx.x] = best
        block_arg[cuda.blockIdx.x] = arg
        cuda.threadfence()                       # the pair before the arrival, device-wide
        s_last[0] = 1 if cuda.atomic.add(state, ARRIVED, 1) == n_blocks - 1 else 0
    cuda.syncthreads()
    if s_last[0] == 0:
        return
    cuda.threadfence()                           # the reader's side: see every pair
    best, arg = -math.inf, 2**62
    for b in range(t, n_blocks, BLOCK):
        if better(block_max[b], block_arg[b], best, arg):
            best, arg = block_max[b], block_arg[b]
    best, arg = block_argmax(s_val, s_arg, t, best, arg)
    if t == 0:
        pick = state[PICK]
        radii_sq[pick] = best
        if pick + 1 < indices.shape[0]:
            indices[pick + 1] = arg
        state[Q] = arg
        state[PICK] = pick + 1
        state[ARRIVED] = 0                       # for the next launch (stream-ordered)

