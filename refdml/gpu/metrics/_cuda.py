"""Retrieval top-K, CUDA kernel: an ordered float64 scan per query with a running top-K.

What is computed, the order of the ranking and the compiled CPU twin:
:mod:`refdml.gpu.metrics._compiled` (:func:`refdml.gpu.metrics._compiled.nearest_cpu`); the
twin's float32 certificate: :mod:`refdml.gpu.metrics._certificate`.

``refdml_retrieval_topk``: one thread per query (``BLOCK`` per block), scanning the
references with the same ordered float64 score and keeping its ``K`` best ``(S, j)`` in
lexicographic order in global memory: no certificate needed. On a GPU the CUDA compiler may
contract ``acc + t * t`` into an FMA, which rounds once instead of twice: the neighbours
then equal the reference's except between references whose distances agree to ~1e-16
relative (exact duplicates still tie: the same bits for equal rows). A first version (no
shared-memory tiling of the references; a thread reads its query row with a stride of
``d``). Measured slower than the array path on a GPU (docs/gpu/kernels.md), it is the
``cuda`` member of ``refdml.gpu.metrics.IMPLEMENTATIONS``
(:class:`refdml.gpu.metrics._kernels.CudaPath`, which launches it), run under
``use_kernels("cuda")`` only: ``"auto"`` runs the array path on CuPy.
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu.metrics._compiled import offer

__all__ = ["refdml_retrieval_topk"]


# :func:`offer` for the device, from the same source (the CUDA simulator cannot pass its
# arrays to an ``@njit`` function)
_offer_device = cuda.jit(device=True)(offer.py_func)


# The argument types of its launches (:class:`refdml.gpu.metrics._kernels.CudaPath`), by the
# data's dtype (cosine launches float64 only: its unit rows are made in float64); every
# array C-contiguous.
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], int64[::1], {dt}[:, ::1], boolean, float64[:, ::1], int64[:, ::1])"
    for dt in ("float32", "float64")})
def refdml_retrieval_topk(q, rows, r, same_set, best_s, best_j):
    """One thread per query: an ordered float64 scan keeping the ``K`` best ``(S, j)``."""
    a = cuda.grid(1)
    if a >= rows.shape[0]:
        return
    qi = rows[a]
    n_r, d = r.shape
    n_keep = best_s.shape[1]
    for c in range(n_keep):
        best_s[a, c] = math.inf
        best_j[a, c] = n_r
    for j in range(n_r):
        if same_set and j == qi:
            continue
        acc = 0.0
        for k in range(d):
            t = np.float64(q[qi, k]) - np.float64(r[j, k])
            acc += t * t
        _offer_device(best_s[a], best_j[a], acc, j)

