"""Products and small Cholesky solves, compiled: the entry maths shared by the CPU twins and
the CUDA kernels of :mod:`refdml.gpu.linalg._cuda`, and the twins.

Each function computes one entry (a product's) or one column (a factor's, a solve's) from
arrays and indices, so that a CPU loop and a CUDA thread run the very same code.

Rounding: every sum accumulates in float64 over exact products (a float32 times a float32
is exact in float64), and is rounded once, when stored, to the output's dtype. So a float32
product's entry is the float64 sum rounded once to float32, within one rounding of the exact
value where the float64 sum's error is negligible: closer than cuBLAS's float32 GEMM, which
sums in float32 in an order of its own. In float64 the sums run in index order, ``k = 0, 1,
...`` (BLAS's order is its own), so the two agree to the dot products' rounding, not bit for
bit.

The Cholesky factor is column by column (``L[j, j] = sqrt(a[j, j] - sum_k L[j, k]^2)``, then
``L[i, j] = (a[i, j] - sum_k L[i, k] L[j, k]) / L[j, j]`` below it), reading the lower
triangle of ``a`` only. A pivot that is not positive (``a`` not positive definite, or NaN)
makes ``L[j, j]`` NaN, and every entry computed from it NaN: the factor says so where
cuSOLVER would leave a partial factor and a code that CuPy does not read. The twins run with
NumPy's error model (a division by zero is ``inf``/``nan``, as on a GPU).
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.jit import njit, prange

__all__ = ["cho_solve_column", "cho_solve_cpu", "cholesky_column", "cholesky_cpu",
           "cholesky_pivot", "matmul_cpu", "product_entry"]


@njit(cache=True, inline="always", error_model="numpy")
def product_entry(a, b, z, i, j):
    """Entry ``(i, j)`` of product ``z`` of the stacks ``a`` (za, m, k) and ``b`` (zb, k, n):
    ``sum_k a[z', i, k] b[z'', k, j]`` in float64, where a stack of one matrix (``za == 1``)
    serves every ``z`` (broadcast)."""
    za = z if a.shape[0] > 1 else 0
    zb = z if b.shape[0] > 1 else 0
    acc = 0.0
    for k in range(a.shape[2]):
        acc += np.float64(a[za, i, k]) * np.float64(b[zb, k, j])
    return acc


@njit(cache=True, inline="always", error_model="numpy")
def cholesky_pivot(a, lower, j):
    """``L[j, j] = sqrt(a[j, j] - sum_{k < j} L[j, k]^2)`` into ``lower``, from the columns
    before ``j``; NaN where the difference is not positive (or is NaN)."""
    s = np.float64(a[j, j])
    for k in range(j):
        v = np.float64(lower[j, k])
        s -= v * v
    if s > 0.0:
        lower[j, j] = math.sqrt(s)
    else:
        lower[j, j] = math.nan


@njit(cache=True, inline="always", error_model="numpy")
def cholesky_column(a, lower, j, i):
    """``L[i, j] = (a[i, j] - sum_{k < j} L[i, k] L[j, k]) / L[j, j]`` for ``i > j``, from the
    columns before ``j`` and the pivot ``L[j, j]``."""
    s = np.float64(a[i, j])
    for k in range(j):
        s -= np.float64(lower[i, k]) * np.float64(lower[j, k])
    lower[i, j] = s / np.float64(lower[j, j])


@njit(cache=True, inline="always", error_model="numpy")
def cho_solve_column(lower, rhs, out, c):
    """Column ``c`` of ``(L L^T)^{-1} rhs`` into ``out``: ``L y = rhs[:, c]`` forward, then
    ``L^T x = y`` backward, ``y`` kept in ``out`` (``out`` may be ``rhs``)."""
    n = lower.shape[0]
    for i in range(n):
        s = np.float64(rhs[i, c])
        for k in range(i):
            s -= np.float64(lower[i, k]) * np.float64(out[k, c])
        out[i, c] = s / np.float64(lower[i, i])
    for i in range(n - 1, -1, -1):
        s = np.float64(out[i, c])
        for k in range(i + 1, n):
            s -= np.float64(lower[k, i]) * np.float64(out[k, c])
        out[i, c] = s / np.float64(lower[i, i])


@njit(cache=True, parallel=True, error_model="numpy")
def matmul_cpu(a, b, c):
    """The product twin: every entry of ``c`` (z, m, n) by :func:`product_entry`, the rows of
    all products in parallel."""
    m = c.shape[1]
    for zi in prange(c.shape[0] * m):
        z, i = zi // m, zi % m
        for j in range(c.shape[2]):
            c[z, i, j] = product_entry(a, b, z, i, j)


@njit(cache=True, error_model="numpy")
def cholesky_cpu(a, lower):
    """The factor twin: ``lower`` (n, n) the lower Cholesky factor of ``a``, zero above the
    diagonal, column by column."""
    n = a.shape[0]
    for i in range(n):
        for j in range(i + 1, n):
            lower[i, j] = 0.0
    for j in range(n):
        cholesky_pivot(a, lower, j)
        for i in range(j + 1, n):
            cholesky_column(a, lower, j, i)


@njit(cache=True, parallel=True, error_model="numpy")
def cho_solve_cpu(lower, rhs, out):
    """The solve twin: every column of ``out`` by :func:`cho_solve_column`, in parallel."""
    for c in prange(rhs.shape[1]):
        cho_solve_column(lower, rhs, out, c)
