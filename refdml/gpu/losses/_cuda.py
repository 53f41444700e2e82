"""The masked row-wise log-sum-exp and its softmax, CUDA kernel: one block per row.

The maths, its dtype rules and the CPU twin: :mod:`refdml.gpu.losses._compiled`. Launch shape:
one block of :data:`refdml.gpu._support.launch.BLOCK` threads per row; threads stride over
the row, their online log-sum-exp states merged by a tree in shared memory (``lse_merge``).
Launched by :class:`refdml.gpu.losses._kernels.CudaPath` as ``cuda_launch(refdml_loss_masked_lse,
rows, BLOCK, *buffers.args())`` with ``buffers`` a
:class:`refdml.gpu.losses._compiled.MaskedLseBuffers` (its fields are this kernel's parameters,
in order). Only building that member imports this module (and with it ``numba.cuda``).
"""

from __future__ import annotations

import math

from numba import float64

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu._support.scalar import lse_merge, lse_push, lse_value
from refdml.gpu._support.launch import BLOCK
from refdml.gpu.losses._compiled import softmax_weight

__all__ = ["refdml_loss_masked_lse"]


# Launch types (refdml.gpu's masked log-sum-exp), by the dtype of ``z``: every array
# C-contiguous, the flags Python bools.
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], boolean[:, ::1], boolean, boolean, {dt}[::1], {dt}[:, ::1])"
    for dt in ("float32", "float64")})
def refdml_loss_masked_lse(z, mask, has_mask, extra_zero, lse, weights):
    r = cuda.blockIdx.x
    if r >= z.shape[0]:
        return
    tid = cuda.threadIdx.x
    k = z.shape[1]
    sm = cuda.shared.array((2, BLOCK), float64)
    m, s = -math.inf, 0.0
    j = tid
    while j < k:
        if not has_mask or mask[r, j]:
            m, s = lse_push(m, s, z[r, j])
        j += BLOCK
    sm[0, tid], sm[1, tid] = m, s
    cuda.syncthreads()
    width = 1
    while width < min(k, BLOCK):
        width *= 2
    stride = width // 2
    while stride > 0:
        if tid < stride:
            sm[0, tid], sm[1, tid] = lse_merge(sm[0, tid], sm[1, tid],
                                               sm[0, tid + stride], sm[1, tid + stride])
        cuda.syncthreads()
        stride //= 2
    m, s = sm[0, 0], sm[1, 0]
    if extra_zero:
        m, s = lse_push(m, s, 0.0)
    if tid == 0:
        lse[r] = lse_value(m, s)
    j = tid
    while j < k:
        if s > 0.0 and (not has_mask or mask[r, j]):
            weights[r, j] = softmax_weight(z[r, j], m, s)
        else:
            weights[r, j] = 0.0
        j += BLOCK
