r"""Numba kernels of the losses: the masked row-wise log-sum-exp and its softmax.

Private module; :func:`refdml.gpu._loss_kernels.masked_logsumexp` dispatches here with
:func:`refdml._compiled._support.select_kernel` and keeps its array code as the fallback
and the twin these kernels are tested against. For each row ``r`` of ``z`` (rows, k) with
mask ``M`` (rows, k) (``None``: every entry):

.. math::
    \mathrm{lse}_r = \log\Big([\text{extra\_zero}] + \sum_{j: M_{rj}} e^{z_{rj}}\Big),\qquad
    w_{rj} = [M_{rj}]\, e^{z_{rj} - \mathrm{lse}_r}

in two passes over the row: the online log-sum-exp of :mod:`refdml._compiled._scalar`
(``lse_push``; ``extra_zero`` pushes one more term 0), then the weights
``exp(z - m) / s`` from its state ``(m, s)``. An empty row gives ``-inf`` (``0`` with
``extra_zero``) and zero weights; entries outside the mask are never read into the result
(NaN there is harmless).

Launch shape (CUDA): one block of :data:`BLOCK` threads per row; threads stride over the
row, their states merged by a tree in shared memory (``lse_merge``). CPU twin: ``prange``
over rows.

dtype: ``z`` float32 or float64 in, the same out; the state and the exponentials in float64
(the sum of a float32 row cannot lose its small terms), results rounded once to the dtype.
Parity with the array path: 1e-12 (float64), 1e-6 (float32), relative.
"""

from __future__ import annotations

import functools
import math

from numba import float64, njit, prange

from refdml._compiled._cuda import cuda
from refdml._compiled._scalar import lse_merge, lse_push, lse_value
from refdml._compiled._support import BLOCK

__all__ = ["cuda_masked_lse", "masked_lse_cpu"]


@njit(cache=True, inline="always")
def _weight(x, m, s):
    """The softmax weight ``exp(x - m) / s`` of a term in the state ``(m, s)``."""
    return math.exp(x - m) / s


@njit(parallel=True, cache=True)
def masked_lse_cpu(z, mask, has_mask, extra_zero, lse, weights):
    """``refdml_loss_masked_lse`` CPU twin: ``lse`` (rows,) and ``weights`` (rows, k)."""
    rows, k = z.shape
    for r in prange(rows):
        m, s = -math.inf, 0.0
        for j in range(k):
            if not has_mask or mask[r, j]:
                m, s = lse_push(m, s, z[r, j])
        if extra_zero:
            m, s = lse_push(m, s, 0.0)
        lse[r] = lse_value(m, s)
        for j in range(k):
            if s > 0.0 and (not has_mask or mask[r, j]):
                weights[r, j] = _weight(z[r, j], m, s)
            else:
                weights[r, j] = 0.0


@functools.cache
def cuda_masked_lse():
    """The ``@cuda.jit`` kernel ``refdml_loss_masked_lse``, built on first use.

    Launch with ``cuda_launch(kernel, rows, BLOCK, z, mask, has_mask, extra_zero, lse, weights)``.
    Cached on disk by numba-cuda (its closure pickles the same in every process, so the
    cache key is stable: tests/gpu/test_gpu_compile.py).
    """

    @cuda.jit(cache=True)
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
                weights[r, j] = _weight(z[r, j], m, s)
            else:
                weights[r, j] = 0.0
            j += BLOCK

    return refdml_loss_masked_lse


#: The argument types of every launch of :func:`cuda_masked_lse`'s kernel
#: (:func:`refdml.gpu._loss_kernels.masked_logsumexp`), by the dtype of ``z``: kernel name
#: -> {dtype: Numba signature}. :mod:`refdml.gpu._cuda_compile` compiles each for real
#: GPUs; keep it in step with the launch (every array C-contiguous, flags Python bools).
CUDA_SIGNATURES = {
    "refdml_loss_masked_lse": {
        dt: f"void({dt}[:, ::1], boolean[:, ::1], boolean, boolean, {dt}[::1], {dt}[:, ::1])"
        for dt in ("float32", "float64")},
}
