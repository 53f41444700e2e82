"""The array path of the products and Cholesky solves: the backend's own BLAS and LAPACK
(NumPy and SciPy; CuPy's cuBLAS and cuSOLVER)."""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend

__all__ = ["ArrayPath"]


class ArrayPath:
    """The array path, the family's interface; the compiled members of
    :mod:`refdml.gpu.linalg._kernels` have the same methods.

    ``matmul(backend, a, b, out=None) -> c``
        ``a @ b`` by ``matmul``'s rules, for 1-D to 3-D float operands (a 3-D operand is a
        stack of matrices; a stack of one is broadcast); into ``out`` where given (of the
        result's shape and dtype).
    ``cholesky(backend, a) -> lower``
        The lower Cholesky factor of the symmetric positive definite ``a`` (n, n), zero above
        the diagonal. Not positive definite: NumPy raises ``numpy.linalg.LinAlgError``; CuPy
        (cuSOLVER) returns without reading its status; the kernels give NaN.
    ``cho_solve(backend, lower, rhs) -> x``
        ``(L L^T)^{-1} rhs`` for the lower factor ``L`` (n, n) and ``rhs`` (n, r).
    """

    def matmul(self, backend: Backend, a: Any, b: Any, out: Any = None) -> Any:
        if out is None:
            return backend.xp.matmul(a, b)
        return backend.xp.matmul(a, b, out=out)

    def cholesky(self, backend: Backend, a: Any) -> Any:
        return backend.xp.linalg.cholesky(a)

    def cho_solve(self, backend: Backend, lower: Any, rhs: Any) -> Any:
        solve = backend.linalg.solve_triangular
        half = solve(lower, rhs, lower=True)
        return solve(lower, half, lower=True, trans="T")
