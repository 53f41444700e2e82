"""The compiled members of greedy k-center, their launches, and the family's
:data:`IMPLEMENTATIONS`.

:class:`CpuPath` runs the compiled CPU twin
(:func:`refdml.gpu.kcenter._compiled.farthest_first_cpu`) and :class:`CudaPath` the CUDA
kernels of :mod:`refdml.gpu.kcenter._cuda`; both have the interface of
:class:`~refdml.gpu.kcenter._array.ArrayPath` (its docstring states it). The CUDA member is
built on first use (``load_cuda=CudaPath``): only then are :mod:`refdml.gpu.kcenter._cuda`
and ``numba.cuda`` imported; the CPU member, built on first use too (``load_cpu=CpuPath``),
imports the twin's module (and Numba), so the array path runs where Numba is not installed.
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu.kcenter._array import ArrayPath

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath"]


class CpuPath:
    """The compiled CPU twin (:func:`refdml.gpu.kcenter._compiled.farthest_first_cpu`), NumPy
    arrays only: one fused update + arg-max pass over the points per pick. Building it imports
    the twin's module (and Numba)."""

    def __init__(self) -> None:
        from refdml.gpu.kcenter import _compiled

        self.compiled = _compiled

    def farthest_first(self, backend: Backend, points: Any, k: int, min_sq: Any, first: Any):
        return self.compiled.farthest_first_cpu(points, k, min_sq,
                                                None if first is None else int(first[0]))


class CudaPath:
    """The CUDA kernels of :mod:`refdml.gpu.kcenter._cuda`: ``refdml_kcenter_prepare`` once
    per call (a transposed copy of the points, read coalesced by every pick), then
    ``refdml_kcenter_step`` once per pick; CuPy arrays on a GPU, NumPy arrays under Numba's
    simulator. Building it imports the kernels' module (and ``numba.cuda``)."""

    def __init__(self) -> None:
        from refdml.gpu.kcenter import _cuda

        self._prepare = _cuda.refdml_kcenter_prepare
        self._step = _cuda.refdml_kcenter_step

    def farthest_first(self, backend: Backend, points: Any, k: int, min_sq: Any, first: Any):
        """The interface's ``farthest_first`` (``min_sq`` updated in place), with no
        synchronisation: ``first`` None starts from one ``xp.argmax`` left on the device.
        Memory: a transposed copy of the points (``n d`` values) besides the input.
        Launches: 1 + ``k``."""
        from refdml.gpu.kcenter._compiled import Q, StepBuffers

        xp = backend.xp
        n, d = points.shape
        points = xp.ascontiguousarray(points)
        n_blocks = -(-n // BLOCK)
        points_t = xp.empty((d, n), dtype=points.dtype)
        sq_norms = xp.empty(n, dtype=points.dtype)
        cuda_launch(self._prepare, n_blocks, BLOCK, points, points_t, sq_norms)
        if first is None:
            q = xp.asarray(xp.argmax(min_sq, keepdims=True), dtype=xp.int64)
        else:
            q = xp.asarray(first, dtype=xp.int64).reshape(1)
        state = xp.zeros(3, dtype=xp.int64)
        state[Q:Q + 1] = q                           # on the device: no synchronisation
        indices = xp.empty(k, dtype=xp.int64)
        indices[0:1] = q
        buffers = StepBuffers(
            points=points, points_t=points_t, sq_norms=sq_norms, min_sq=min_sq, state=state,
            block_max=xp.empty(n_blocks, dtype=xp.float64),
            block_arg=xp.empty(n_blocks, dtype=xp.int64),
            indices=indices, radii_sq=xp.empty(k, dtype=xp.float64))
        arguments = buffers.arguments()
        for _ in range(k):
            cuda_launch(self._step, n_blocks, BLOCK, *arguments)
        return indices, xp.sqrt(xp.maximum(buffers.radii_sq, 0.0)).astype(points.dtype)


#: The traversals of the fast path, chosen once per call (:mod:`refdml.gpu.kcenter`).
IMPLEMENTATIONS: Implementations = Implementations(
    family="kcenter", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="cpu", auto_cupy="cuda",
    measured=("docs/gpu/kernels.md, section 'Numba kernels: greedy k-center and retrieval "
              "top-K'; CuPy, the CUDA kernels against the array path: python "
              "scripts/bench_gpu.py --device cuda --only kcenter; NumPy, the CPU twin "
              "against the reference's readable traversal: python scripts/bench_gpu.py "
              "--only kcenter"))
