"""The compiled members of the L2 normalisation, their launches, and the family's
:data:`IMPLEMENTATIONS`.

:class:`CpuPath` runs the CPU twins of :mod:`refdml.gpu.normalize._compiled` and
:class:`CudaPath` the kernels of :mod:`refdml.gpu.normalize._cuda`; both have the interface
of :class:`~refdml.gpu.normalize._array.ArrayPath` (its docstring states it) and are built on
first use, so the array path runs where Numba is not installed.
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.normalize._array import ArrayPath
from refdml.normalize import L2NormalizeContext

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath"]


def _rows(xp: Any, a: Any, rows: int, width: int) -> Any:
    """``a`` as a C-contiguous ``(rows, width)`` array (a view where it already is one)."""
    return xp.ascontiguousarray(a).reshape(rows, width)


def _per_row(xp: Any, a: Any, keep: tuple, rows: int, dtype: Any) -> Any:
    """A keepdims per-row array as a C-contiguous ``(rows,)`` one (a view where it is one
    already; a broadcast one is copied)."""
    a = a.astype(dtype, copy=False)
    if a.shape != keep:
        a = xp.broadcast_to(a, keep)
    return xp.ascontiguousarray(a).reshape(rows)


class _RowKernels:
    """Both compiled members: the arrays flattened to rows, the outputs allocated, then
    ``_forward`` / ``_backward`` run on them (a twin call, or one launch)."""

    def l2_forward(self, backend: Backend, x: Any) -> tuple[Any, Any, Any]:
        xp = backend.xp
        d = x.shape[-1]
        rows = x.size // d
        flat = _rows(xp, x, rows, d)
        y = xp.empty_like(flat)
        scale = xp.empty(rows, dtype=x.dtype)
        scaled_norm = xp.empty(rows, dtype=x.dtype)
        self._forward(rows, flat, y, scale, scaled_norm)
        keep = x.shape[:-1] + (1,)
        return y.reshape(x.shape), scale.reshape(keep), scaled_norm.reshape(keep)

    def l2_backward(self, backend: Backend, ctx: L2NormalizeContext, d_y: Any,
                    unit_scale: bool) -> Any:
        xp = backend.xp
        y = ctx.y
        d = y.shape[-1]
        rows = y.size // d
        dtype = y.dtype
        keep = y.shape[:-1] + (1,)
        # A unit scale is divided by too (exactly): one kernel for both. The kept unit
        # column (NumPy only: unit_scale is never True on CuPy) is read-only, and Numba's
        # simulator writes every argument back; a fresh column of ones replaces it.
        scale = (xp.ones(rows, dtype=dtype) if unit_scale
                 else _per_row(xp, ctx.scale, keep, rows, dtype))
        norm = _per_row(xp, ctx.scaled_norm, keep, rows, dtype)
        flat_y = _rows(xp, y, rows, d)
        flat_d = _rows(xp, d_y.astype(dtype, copy=False), rows, d)
        grad = xp.empty_like(flat_y)
        self._backward(rows, flat_y, flat_d, scale, norm, grad)
        return grad.reshape(y.shape)


class CpuPath(_RowKernels):
    """The compiled CPU twins, NumPy arrays only (a ``prange`` over the rows). Building it
    imports the twins' module (and Numba)."""

    def __init__(self) -> None:
        from refdml.gpu.normalize import _compiled

        self._compiled = _compiled

    def _forward(self, rows: int, x: Any, y: Any, scale: Any, scaled_norm: Any) -> None:
        with parallel_launch():           # the threading layer's guard (fork safety)
            self._compiled.l2_forward_cpu(x, y, scale, scaled_norm)

    def _backward(self, rows: int, y: Any, d_y: Any, scale: Any, scaled_norm: Any,
                  grad: Any) -> None:
        with parallel_launch():
            self._compiled.l2_backward_cpu(y, d_y, scale, scaled_norm, grad)


class CudaPath(_RowKernels):
    """The CUDA kernels of :mod:`refdml.gpu.normalize._cuda`, one launch each way, no
    synchronisation; CuPy arrays on a GPU, NumPy arrays under Numba's simulator. Building
    it imports the kernels' module (and ``numba.cuda``)."""

    def __init__(self) -> None:
        from refdml.gpu.normalize import _cuda

        self._forward_kernel = _cuda.refdml_normalize_l2_forward
        self._backward_kernel = _cuda.refdml_normalize_l2_backward

    def _forward(self, rows: int, x: Any, y: Any, scale: Any, scaled_norm: Any) -> None:
        cuda_launch(self._forward_kernel, -(-rows // BLOCK), BLOCK, x, y, scale, scaled_norm)

    def _backward(self, rows: int, y: Any, d_y: Any, scale: Any, scaled_norm: Any,
                  grad: Any) -> None:
        cuda_launch(self._backward_kernel, -(-rows // BLOCK), BLOCK, y, d_y, scale,
                    scaled_norm, grad)


#: The L2 normalisations of the fast path, chosen once per call (:mod:`refdml.gpu.normalize`).
#: On NumPy "auto" keeps the array path: the reference's own arithmetic, and a handful of
#: vectorised passes that cost no launches; on CuPy the kernels replace 9 + 5 launches by 1 + 1.
IMPLEMENTATIONS: Implementations = Implementations(
    family="normalize", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="array", auto_cupy="cuda",
    measured=("counted, not timed: launches per forward + backward on the CuPy stand-in, "
              "tests/gpu/test_gpu_launch_counts.py (the catalogue's normalize.l2_normalize "
              "rows)"))
