"""Matrix products and small Cholesky solves of the fast path that a captured CUDA graph can
hold: the ``linalg`` kernel family.

CuPy refuses to call cuBLAS, cuSOLVER and cuRAND while a stream captures a graph: the call
raises ``NotImplementedError`` before anything is queued (CuPy 14; only cuFFT, cuTENSOR,
cuSPARSELt and NCCL calls may be captured, cupy/cupy#6290). A training step captured as a
graph (:class:`refdml.train.TrainingLoop` with ``capture=True``) multiplies matrices in every
layer and factors the ridge fits of its objective, so the fast path's products and solves
that run inside a step go through :func:`matmul`, :func:`cholesky` and :func:`cho_solve`,
which take the family's member :func:`member` chooses:

``array`` (:class:`~refdml.gpu.linalg._array.ArrayPath`)
    The backend's BLAS and LAPACK (NumPy and SciPy; cuBLAS and cuSOLVER through CuPy): what
    runs everywhere except inside a capture, in every kernel mode.
``cuda`` (:class:`~refdml.gpu.linalg._kernels.CudaPath`)
    One CUDA kernel per product, factor or solve (:mod:`refdml.gpu.linalg._cuda`): what runs
    while CuPy's current stream captures (:meth:`refdml._backend.Backend.capturing`).
``cpu`` (:class:`~refdml.gpu.linalg._kernels.CpuPath`)
    The CPU twins of the kernels' entry maths (:mod:`refdml.gpu.linalg._compiled`): the
    kernels' arithmetic checked on the host, at full size, without the simulator.

Neither the kernel mode (:func:`refdml.gpu.use_kernels`) nor "auto" chooses the member: BLAS
is the fast product wherever it may run (a naive kernel is no match for it, and the
uncaptured step's cost on a GPU is its launches, not its products), and inside a capture
nothing else may run. The kernels sum in float64 and round once (:mod:`~refdml.gpu.linalg.
_compiled`), so a captured step's products agree with the uncaptured step's cuBLAS ones to
float32 rounding, not bit for bit. The factor is NaN where a matrix is not positive definite
(the ridge fits' data checks refuse such a system before it is factored).
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml.exceptions import MissingExtraError
from refdml.gpu._support.modes import numba_installed
from refdml.gpu.linalg._kernels import IMPLEMENTATIONS

__all__ = ["cho_solve", "cholesky", "matmul", "member", "warm_up"]


def member(backend: Backend) -> Any:
    """The member that runs now: the CUDA kernels while ``backend``'s current stream captures
    a graph (numba-cuda needed: refdml's ``fast`` extra), else the array path."""
    if not backend.capturing():
        return IMPLEMENTATIONS.array
    if not numba_installed():
        raise MissingExtraError("fast", "numba")
    return IMPLEMENTATIONS.cuda


def matmul(backend: Backend, a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` (``matmul``'s rules, 1-D to 3-D float operands), into ``out`` where given."""
    return member(backend).matmul(backend, a, b, out)


def cholesky(backend: Backend, a: Any) -> Any:
    """The lower Cholesky factor of the symmetric positive definite ``a`` (n, n)."""
    return member(backend).cholesky(backend, a)


def cho_solve(backend: Backend, lower: Any, rhs: Any) -> Any:
    """``(L L^T)^{-1} rhs`` from the lower Cholesky factor ``L`` (n, n); ``rhs`` (n, r)."""
    return member(backend).cho_solve(backend, lower, rhs)


def warm_up(backend: Backend) -> None:
    """Compile and load the CUDA kernels outside any capture: one launch of each, for both
    dtypes, on 1 x 1 arrays. A captured step's first products are its first use of them
    (outside a capture the array path runs), and a kernel's compilation and module load are
    host work that a capture should not contain. Nothing on NumPy, or without numba-cuda
    (a capture then raises :class:`~refdml.exceptions.MissingExtraError`)."""
    if backend.free_host_reads or not numba_installed():
        return
    kernels = IMPLEMENTATIONS.cuda
    for dtype in ("float32", "float64"):
        one = backend.xp.ones((1, 1), dtype=dtype)
        product = kernels.matmul(backend, one, one)
        kernels.cho_solve(backend, kernels.cholesky(backend, one), product)
