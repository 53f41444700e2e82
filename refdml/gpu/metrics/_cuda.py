"""Retrieval top-K, CUDA kernel: an ordered float64 scan per query with a running top-K.

What is computed, the order of the ranking and the compiled CPU twin with its float32
certificate: :mod:`refdml.gpu.metrics._compiled` (:func:`refdml.gpu.metrics._compiled.nearest_cpu`).

CUDA (:func:`nearest_cuda`): ``refdml_retrieval_topk``, one thread per query (``BLOCK`` per
block), scanning the references with the same ordered float64 score and keeping its ``K``
best ``(S, j)`` in lexicographic order in global memory: no certificate needed. On a GPU
the CUDA compiler may contract ``acc + t * t`` into an FMA, which rounds once instead of
twice: the neighbours then equal the reference's except between references whose
distances agree to ~1e-16 relative (exact duplicates still tie: the same bits for equal
rows). A first version (no shared-memory tiling of the references; a thread reads its query
row with a stride of ``d``). Measured slower than the array path on a GPU (docs/gpu.md), it
is the ``cuda`` member of ``refdml.gpu.metrics.RETRIEVAL``, run under ``use_kernels("cuda")``
only: ``"auto"`` runs the array path on CuPy.
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu.metrics._compiled import offer
from refdml._numerics import ordered_unit_rows

__all__ = ["nearest_cuda", "refdml_retrieval_topk"]


# ---------------------------------------------------------------------------------- CUDA


# :func:`offer` for the device, from the same source (the CUDA simulator cannot pass its
# arrays to an ``@njit`` function)
_offer_device = cuda.jit(device=True)(offer.py_func)


# The argument types of its launches (:func:`nearest_cuda`), by the data's dtype (cosine
# launches float64 only: its unit rows are made in float64); every array C-contiguous.
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


def nearest_cuda(xp, query, rows, reference, n_keep, same_set, metric):
    """:func:`nearest_cpu`'s contract with the CUDA kernel (CuPy arrays on a GPU, NumPy under
    the simulator); the result stays on the device (no synchronisation)."""
    if metric == "cosine":
        reference = ordered_unit_rows(reference.astype(xp.float64), xp=xp)
        query = reference if same_set else ordered_unit_rows(query.astype(xp.float64), xp=xp)
    if same_set:
        query = reference
    rows = xp.ascontiguousarray(rows.astype(xp.int64))
    best_s = xp.empty((rows.shape[0], n_keep), dtype=xp.float64)
    best_j = xp.empty((rows.shape[0], n_keep), dtype=xp.int64)
    grid = max(1, -(-rows.shape[0] // BLOCK))
    cuda_launch(refdml_retrieval_topk, grid, BLOCK, xp.ascontiguousarray(query), rows,
                xp.ascontiguousarray(reference), bool(same_set), best_s, best_j)
    return best_j
