"""The compiled members of the retrieval top-K, their launches, and the family's
:data:`IMPLEMENTATIONS`.

:class:`CpuPath` runs the compiled CPU twin (:func:`refdml.gpu.metrics._compiled.nearest_cpu`)
and :class:`CudaPath` the CUDA kernel (``refdml_retrieval_topk`` of
:mod:`refdml.gpu.metrics._cuda`); both answer :class:`~refdml.gpu.metrics._array.TopK` as
:class:`~refdml.gpu.metrics._array.ArrayPath` does (its docstring states the interface).
The CUDA member is built on first use (``load_cuda=CudaPath``): only then are
:mod:`refdml.gpu.metrics._cuda` and ``numba.cuda`` imported; the CPU member, built on first
use too (``load_cpu=CpuPath``), imports the twin's module (and Numba), so the array path runs
where Numba is not installed.
"""

from __future__ import annotations

from typing import Any

from refdml._numerics import ordered_unit_rows
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu.metrics._array import ArrayPath, TopK

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath"]


class CpuPath:
    """The compiled CPU twin (:func:`refdml.gpu.metrics._compiled.nearest_cpu`), NumPy arrays
    only. It takes ``K <= MAX_KEEP`` (256) only: its sorted lists cost ``O(K)`` per
    insertion and its re-rank ``O(K^2)`` per query; beyond, the array path answers. Building
    it imports the twin's module (and Numba)."""

    def __init__(self) -> None:
        from refdml.gpu.metrics import _compiled

        self.compiled = _compiled

    def takes(self, request: TopK) -> bool:
        return request.n_keep <= self.compiled.MAX_KEEP

    def nearest(self, request: TopK) -> Any:
        return self.compiled.nearest_cpu(request.query, request.rows, request.reference,
                                         request.n_keep, request.same_set, request.metric)


class CudaPath:
    """The CUDA kernel ``refdml_retrieval_topk`` (:mod:`refdml.gpu.metrics._cuda`): one
    thread per query, an ordered float64 scan of every reference keeping its ``K`` best;
    CuPy arrays on a GPU, NumPy arrays under Numba's simulator. Building it imports the
    kernel's module (and ``numba.cuda``)."""

    def __init__(self) -> None:
        from refdml.gpu.metrics import _cuda

        self._topk = _cuda.refdml_retrieval_topk

    def takes(self, request: TopK) -> bool:
        return True

    def nearest(self, request: TopK) -> Any:
        """The neighbours by one launch; the result stays on the device (no
        synchronisation). Cosine launches the unit rows, made here in float64."""
        xp = request.xp
        query, reference = request.query, request.reference
        if request.metric == "cosine":
            reference = ordered_unit_rows(reference.astype(xp.float64), xp=xp)
            query = reference if request.same_set else ordered_unit_rows(
                query.astype(xp.float64), xp=xp)
        if request.same_set:
            query = reference
        rows = xp.ascontiguousarray(request.rows.astype(xp.int64))
        best_s = xp.empty((rows.shape[0], request.n_keep), dtype=xp.float64)
        best_j = xp.empty((rows.shape[0], request.n_keep), dtype=xp.int64)
        grid = max(1, -(-rows.shape[0] // BLOCK))
        cuda_launch(self._topk, grid, BLOCK, xp.ascontiguousarray(query), rows,
                    xp.ascontiguousarray(reference), bool(request.same_set), best_s, best_j)
        return best_j


#: The retrieval family's implementations, and the one chooser among them.
IMPLEMENTATIONS: Implementations = Implementations(
    family="metrics", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="cpu", auto_cupy="array",
    measured=("docs/gpu/kernels.md, section 'Numba kernels: greedy k-center and retrieval "
              "top-K'; CuPy, the array path against the CUDA kernel: python "
              "scripts/bench_gpu.py --device cuda --only retrieval; NumPy, the CPU twin "
              "against the reference's readable ranking: python scripts/bench_gpu.py --only "
              "metrics"))
