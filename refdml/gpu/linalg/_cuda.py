"""The CUDA kernels of the products and small Cholesky solves: what a captured step runs
instead of cuBLAS and cuSOLVER, which CuPy refuses to call while a stream captures.

Each thread runs the entry or column maths of :mod:`refdml.gpu.linalg._compiled`, the CPU
twins' very functions (that module's docstring states the rounding).

- :func:`refdml_linalg_matmul`: a thread per entry of the product, a block of 8 rows of 32
  consecutive columns (a warp reads 32 consecutive entries of a row of ``b`` and one entry
  of ``a``), the grid's third axis over the stack. No shared-memory tiling: the
  products of a training step are small (tens of thousands of entries, a few hundred terms
  each), and their cost there is the launch, which a captured graph does not pay per step.
- :func:`refdml_linalg_cholesky`: one block for the whole factor, a column at a time: the
  first thread makes the pivot, every thread then makes entries below it, two barriers a
  column. The systems factored in a step are the ridge fits' (the batch's size, tens to
  hundreds of rows).
- :func:`refdml_linalg_cho_solve`: a thread per right-hand column, forward then back
  substitution.
"""

from __future__ import annotations

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu.linalg._compiled import (cho_solve_column, cholesky_column, cholesky_pivot,
                                         product_entry)

__all__ = ["MATMUL_BLOCK", "refdml_linalg_cho_solve", "refdml_linalg_cholesky",
           "refdml_linalg_matmul"]

#: Threads per block of the product: 32 columns by 8 rows.
MATMUL_BLOCK = (32, 8)

# Device functions built from the twins' Python source (an ``@njit`` dispatcher cannot run
# as a device function with array arguments).
_entry = cuda.jit(device=True)(product_entry.py_func)
_pivot = cuda.jit(device=True)(cholesky_pivot.py_func)
_column = cuda.jit(device=True)(cholesky_column.py_func)
_solve_column = cuda.jit(device=True)(cho_solve_column.py_func)


# Launch types (:class:`refdml.gpu.linalg._kernels.CudaPath`): C-contiguous stacks of
# matrices (and matrices) of one dtype.
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, :, ::1], {dt}[:, :, ::1], {dt}[:, :, ::1])"
    for dt in ("float32", "float64")})
def refdml_linalg_matmul(a, b, c):
    """``c[z] = a[z] @ b[z]`` (a stack of one broadcast); a thread per entry of ``c``: the
    grid's x axis over blocks of 8 rows (up to 2^31 - 1 of them), y over blocks of 32
    columns, z over the stack."""
    i = cuda.blockIdx.x * cuda.blockDim.y + cuda.threadIdx.y
    j = cuda.blockIdx.y * cuda.blockDim.x + cuda.threadIdx.x
    z = cuda.blockIdx.z
    if i < c.shape[1] and j < c.shape[2]:
        c[z, i, j] = _entry(a, b, z, i, j)


@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[:, ::1])" for dt in ("float32", "float64")})
def refdml_linalg_cholesky(a, lower):
    """``lower`` the lower Cholesky factor of ``a`` (zero above the diagonal); one block."""
    t = cuda.threadIdx.x
    threads = cuda.blockDim.x
    n = a.shape[0]
    for index in range(t, n * n, threads):
        i = index // n
        j = index - i * n
        if j > i:
            lower[i, j] = 0.0
    for j in range(n):
        if t == 0:
            _pivot(a, lower, j)
        cuda.syncthreads()
        for i in range(j + 1 + t, n, threads):
            _column(a, lower, j, i)
        cuda.syncthreads()


@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[:, ::1], {dt}[:, ::1])" for dt in ("float32", "float64")})
def refdml_linalg_cho_solve(lower, rhs, out):
    """``out = (L L^T)^{-1} rhs``; a thread per column of ``rhs``."""
    c = cuda.grid(1)
    if c < rhs.shape[1]:
        _solve_column(lower, rhs, out, c)
