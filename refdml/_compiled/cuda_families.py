"""Every family of refdml's CUDA kernels, imported: after this import
:data:`refdml._compiled._cuda.KERNELS` lists every kernel (base layer).

One ``<family>_cuda.py`` module per family, beside its CPU twin ``<family>.py``: the
kernels are declared where they are defined (:func:`refdml._compiled._cuda.cuda_kernel`),
so this tuple of modules is the only list, and tests/gpu/test_gpu_compile.py checks that it
names every ``*_cuda.py`` file of the package. Importing it imports ``numba.cuda`` (and
compiles nothing: kernels compile at their first launch).
"""

from __future__ import annotations

from refdml._compiled import gsp_cuda, kcenter_cuda, losses_cuda, retrieval_cuda, sinkhorn_cuda
from refdml._compiled._cuda import KERNELS, CudaKernel

__all__ = ["FAMILIES", "kernels"]

#: The CUDA modules, one per family of operators.
FAMILIES = (gsp_cuda, kcenter_cuda, losses_cuda, retrieval_cuda, sinkhorn_cuda)


def kernels() -> dict[str, CudaKernel]:
    """Every declared CUDA kernel by name, in declaration order."""
    return dict(KERNELS)
