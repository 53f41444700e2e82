"""Greedy k-center, CUDA kernels: each pick's distance update fused with the arg-max.

The traversal, its scalar maths (:func:`refdml._compiled.kcenter.sq_to_center`,
:func:`refdml._compiled.kcenter.better`, one source for both targets), the dtype rules
and the compiled CPU twin: :mod:`refdml._compiled.kcenter`.

CUDA (:func:`farthest_first_cuda`): per pick two launches, no host round trip:
``refdml_kcenter_update`` (one thread per point, ``BLOCK`` threads per block: update, then a
block-level shared-memory arg-max reduction writing one (max, arg-max) per block) and
``refdml_kcenter_pick`` (one block of ``BLOCK`` threads reducing the blocks' pairs: the
radius of this pick and the next pick, left on the device where the next update reads it);
both end in the same shared-memory tree, the device function :func:`block_argmax`.
One thread per point reads its row with a stride of ``d`` (uncoalesced): a first version,
checked only under Numba's CUDA simulator this session (never run on a GPU).
"""

from __future__ import annotations

import math

import numpy as np

from refdml._compiled._cuda import cuda, cuda_kernel
from refdml._compiled._support import BLOCK, cuda_launch
from refdml._compiled.kcenter import better, sq_to_center

__all__ = ["block_argmax", "farthest_first_cuda", "refdml_kcenter_pick",
           "refdml_kcenter_sq_norms", "refdml_kcenter_update"]


# ---------------------------------------------------------------------------------- CUDA


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


# Launch types (:func:`farthest_first_cuda`; every array C-contiguous, Python ints int64):
# by the points' dtype, except where they do not depend on it ("any": the blocks'
# (max, arg-max) are float64 / int64 whatever the points').
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[::1], {dt}[::1], int64[::1], float64[::1], int64[::1])"
    for dt in ("float32", "float64")})
def refdml_kcenter_update(points, sq_norms, min_sq, q_box, block_max, block_arg):
    """One pick's update of ``min_sq`` and each block's (max, arg-max); ``q_box[0]`` the pick."""
    s_val = cuda.shared.array(BLOCK, dtype=np.float64)
    s_arg = cuda.shared.array(BLOCK, dtype=np.int64)
    n = points.shape[0]
    i = cuda.grid(1)
    t = cuda.threadIdx.x
    best, arg = -math.inf, n
    if i < n:
        q = q_box[0]
        m = np.float64(min_sq[i])
        dot = 0.0
        for j in range(points.shape[1]):
            dot += np.float64(points[i, j]) * np.float64(points[q, j])
        dist = sq_to_center(np.float64(sq_norms[i]), dot, np.float64(sq_norms[q]))
        if dist < m:
            m = dist
        if i == q:
            m = -1.0
        min_sq[i] = m                            # rounds to the array's dtype
        best, arg = np.float64(min_sq[i]), i
    best, arg = block_argmax(s_val, s_arg, t, best, arg)
    if t == 0:
        block_max[cuda.blockIdx.x] = best
        block_arg[cuda.blockIdx.x] = arg


@cuda_kernel(cache=True, signatures={
    "any": "void(float64[::1], int64[::1], int64, int64, int64[::1], int64[::1], float64[::1])"})
def refdml_kcenter_pick(block_max, block_arg, n_blocks, pick, q_box, indices, radii_sq):
    """Reduce the blocks' (max, arg-max): ``radii_sq[pick]``, the next pick into ``q_box``."""
    s_val = cuda.shared.array(BLOCK, dtype=np.float64)
    s_arg = cuda.shared.array(BLOCK, dtype=np.int64)
    t = cuda.threadIdx.x
    best, arg = -math.inf, 2**62
    for b in range(t, n_blocks, BLOCK):
        if better(block_max[b], block_arg[b], best, arg):
            best, arg = block_max[b], block_arg[b]
    best, arg = block_argmax(s_val, s_arg, t, best, arg)
    if t == 0:
        radii_sq[pick] = best
        q_box[0] = arg
        if pick + 1 < indices.shape[0]:
            indices[pick + 1] = arg


@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[::1])" for dt in ("float32", "float64")})
def refdml_kcenter_sq_norms(points, out):
    i = cuda.grid(1)
    if i >= points.shape[0]:
        return
    acc = 0.0
    for k in range(points.shape[1]):
        acc += np.float64(points[i, k]) * np.float64(points[i, k])
    out[i] = acc


def farthest_first_cuda(xp, points, k, min_sq, first):
    """``k`` picks with the CUDA kernels (CuPy arrays on a GPU; NumPy under the simulator).

    ``first``: a (1,) int64 array of the input's module, or None (start from the arg-max of
    ``min_sq``: one ``xp.argmax``, left on the device).
    Returns ``(indices (k,) int64, radii (k,) in the points' dtype)``, arrays of ``xp``; no
    synchronisation.
    """
    n = points.shape[0]
    points = xp.ascontiguousarray(points)
    sq_norms = xp.empty(n, dtype=points.dtype)
    n_blocks = -(-n // BLOCK)
    cuda_launch(refdml_kcenter_sq_norms, n_blocks, BLOCK, points, sq_norms)
    block_max = xp.empty(n_blocks, dtype=xp.float64)
    block_arg = xp.empty(n_blocks, dtype=xp.int64)
    indices = xp.empty(k, dtype=xp.int64)
    radii_sq = xp.empty(k, dtype=xp.float64)
    if first is None:
        q_box = xp.asarray(xp.argmax(min_sq, keepdims=True), dtype=xp.int64)
    else:
        q_box = xp.asarray(first, dtype=xp.int64).reshape(1).copy()
    indices[0:1] = q_box
    for pick in range(k):
        cuda_launch(refdml_kcenter_update, n_blocks, BLOCK, points, sq_norms, min_sq, q_box,
                    block_max, block_arg)
        cuda_launch(refdml_kcenter_pick, 1, BLOCK, block_max, block_arg, n_blocks, pick, q_box,
                    indices, radii_sq)
    return indices, xp.sqrt(xp.maximum(radii_sq, 0.0)).astype(points.dtype)
