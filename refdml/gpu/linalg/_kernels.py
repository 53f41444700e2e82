"""The compiled members of the products and Cholesky solves, their launches, and the
family's :data:`IMPLEMENTATIONS`.

:class:`CpuPath` runs the CPU twins of :mod:`refdml.gpu.linalg._compiled` and
:class:`CudaPath` the kernels of :mod:`refdml.gpu.linalg._cuda`; both have the interface of
:class:`~refdml.gpu.linalg._array.ArrayPath` and are built on first use. They share the
shaping (:class:`_Compiled`): ``matmul``'s rules reduced to one stack product
``(z, m, k) @ (z, k, n)`` on C-contiguous operands of one float dtype (a copy where an
operand is a transposed or otherwise strided view), the result written into ``out`` where
one is given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._backend import Backend
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.linalg._array import ArrayPath

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath"]

#: The largest grid extent along a CUDA grid's y and z axes: a longer stack is launched in
#: parts.
_GRID_YZ = 65535


def _float_dtype(*arrays: Any) -> np.dtype:
    dtype = np.result_type(*(a.dtype for a in arrays))
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"the products and solves of refdml.gpu.linalg take float32 or "
                        f"float64 arrays, got {', '.join(str(a.dtype) for a in arrays)}")
    return dtype


def _stack(xp: Any, a: Any, dtype: np.dtype) -> Any:
    """``a`` (2-D or 3-D) as a C-contiguous stack (z, rows, cols) of ``dtype``."""
    a = xp.ascontiguousarray(a.astype(dtype, copy=False))
    return a.reshape((1,) + a.shape) if a.ndim == 2 else a


class _Compiled:
    """What both compiled members share: the shapes of ``matmul`` and the outputs."""

    def matmul(self, backend: Backend, a: Any, b: Any, out: Any = None) -> Any:
        xp = backend.xp
        if not 1 <= a.ndim <= 3 or not 1 <= b.ndim <= 3:
            raise ValueError(f"refdml.gpu.linalg.matmul takes 1-D to 3-D operands, got "
                             f"shapes {a.shape} and {b.shape}")
        dtype = _float_dtype(a, b)
        a2 = a.reshape(1, -1) if a.ndim == 1 else a           # (k,) -> (1, k)
        b2 = b.reshape(-1, 1) if b.ndim == 1 else b           # (k,) -> (k, 1)
        za = a2.shape[0] if a2.ndim == 3 else 1
        zb = b2.shape[0] if b2.ndim == 3 else 1
        m, k = a2.shape[-2:]
        if b2.shape[-2] != k or (za != zb and 1 not in (za, zb)):
            raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not match")
        z, n = max(za, zb), b2.shape[-1]
        shape = (z, m, n) if max(a.ndim, b.ndim) == 3 else (m, n)
        if a.ndim == 1:
            shape = shape[:-2] + shape[-1:]
        if b.ndim == 1:
            shape = shape[:-1]
        if out is not None and (tuple(out.shape) != shape or out.dtype != dtype):
            raise ValueError(f"matmul: out has shape {tuple(out.shape)} and dtype {out.dtype}, "
                             f"the product {shape} and {dtype}")
        c = xp.empty((z, m, n), dtype=dtype)
        if c.size:
            if k == 0:
                c.fill(0)
            else:
                self._matmul(_stack(xp, a2, dtype), _stack(xp, b2, dtype), c)
        c = c.reshape(shape)
        if out is None:
            return c
        out[...] = c
        return out

    def cholesky(self, backend: Backend, a: Any) -> Any:
        xp = backend.xp
        dtype = _float_dtype(a)
        if a.ndim != 2 or a.shape[0] != a.shape[1]:
            raise ValueError(f"cholesky takes a square matrix, got shape {a.shape}")
        lower = xp.empty(a.shape, dtype=dtype)
        if a.size:
            self._cholesky(xp.ascontiguousarray(a.astype(dtype, copy=False)), lower)
        return lower

    def cho_solve(self, backend: Backend, lower: Any, rhs: Any) -> Any:
        xp = backend.xp
        dtype = _float_dtype(lower, rhs)
        if (lower.ndim != 2 or rhs.ndim != 2 or lower.shape[0] != lower.shape[1]
                or rhs.shape[0] != lower.shape[0]):
            raise ValueError(f"cho_solve takes a square factor and a right-hand side of as "
                             f"many rows, got shapes {lower.shape} and {rhs.shape}")
        out = xp.empty(rhs.shape, dtype=dtype)
        if out.size:
            self._cho_solve(xp.ascontiguousarray(lower.astype(dtype, copy=False)),
                            xp.ascontiguousarray(rhs.astype(dtype, copy=False)), out)
        return out


class CpuPath(_Compiled):
    """The compiled CPU twins, NumPy arrays only. Building it imports the twins' module
    (and Numba)."""

    def __init__(self) -> None:
        from refdml.gpu.linalg import _compiled

        self._compiled = _compiled

    def _matmul(self, a: Any, b: Any, c: Any) -> None:
        with parallel_launch():           # the threading layer's guard (fork safety)
            self._compiled.matmul_cpu(a, b, c)

    def _cholesky(self, a: Any, lower: Any) -> None:
        self._compiled.cholesky_cpu(a, lower)

    def _cho_solve(self, lower: Any, rhs: Any, out: Any) -> None:
        with parallel_launch():
            self._compiled.cho_solve_cpu(lower, rhs, out)


class CudaPath(_Compiled):
    """The CUDA kernels of :mod:`refdml.gpu.linalg._cuda`: one launch per product (more for
    a stack longer than a grid axis holds), one per factor, one per
    solve; nothing read back, nothing allocated outside CuPy's pool, so they run inside a
    captured graph. CuPy arrays on a GPU, NumPy arrays under Numba's simulator. Building it
    imports the kernels' module (and ``numba.cuda``)."""

    def __init__(self) -> None:
        from refdml.gpu.linalg import _cuda

        self._cuda = _cuda

    def _matmul(self, a: Any, b: Any, c: Any) -> None:
        columns, rows = self._cuda.MATMUL_BLOCK
        z, m, n = c.shape
        if -(-n // columns) > _GRID_YZ:
            raise ValueError(f"matmul: {n} columns, more than the kernel's grid holds "
                             f"({_GRID_YZ * columns})")
        grid = (-(-m // rows), -(-n // columns))
        for z0 in range(0, z, _GRID_YZ):        # a stack longer than the grid's z axis
            part = slice(z0, min(z, z0 + _GRID_YZ))
            cuda_launch(self._cuda.refdml_linalg_matmul, grid + (part.stop - z0,),
                        (columns, rows), a if a.shape[0] == 1 else a[part],
                        b if b.shape[0] == 1 else b[part], c[part])

    def _cholesky(self, a: Any, lower: Any) -> None:
        threads = min(BLOCK * 2, max(32, -(-a.shape[0] // 32) * 32))
        cuda_launch(self._cuda.refdml_linalg_cholesky, 1, threads, a, lower)

    def _cho_solve(self, lower: Any, rhs: Any, out: Any) -> None:
        cuda_launch(self._cuda.refdml_linalg_cho_solve, -(-rhs.shape[1] // BLOCK), BLOCK,
                    lower, rhs, out)


#: The products and Cholesky solves of the fast path (:mod:`refdml.gpu.linalg`). "auto"
#: keeps BLAS and LAPACK on both backends: the kernels are for a captured step, where CuPy
#: refuses cuBLAS and cuSOLVER (:func:`refdml.gpu.linalg.member` chooses them there).
IMPLEMENTATIONS: Implementations = Implementations(
    family="linalg", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="array", auto_cupy="array",
    measured=("not a speed choice: BLAS and cuBLAS are the fast products; the kernels run "
              "where CuPy refuses cuBLAS and cuSOLVER, inside a captured graph "
              "(refdml.gpu.linalg's docstring)"))
