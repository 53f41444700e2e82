"""The losses family's compiled members and its one implementations object.

:class:`CpuPath` (the ``@njit`` CPU twin ``masked_lse_cpu`` of
:mod:`refdml.gpu.losses._compiled`) and :class:`CudaPath` (the ``@cuda.jit`` kernel
``refdml_loss_masked_lse`` of :mod:`refdml.gpu.losses._cuda`) have the interface of
:class:`refdml.gpu.losses._array.ArrayPath`; both lay the rows out the same way
(:class:`KernelPath`) and hand their kernel one
:class:`~refdml.gpu.losses._compiled.MaskedLseBuffers`. The family has one kernel, so no
table of kernels: each member names its own. :data:`IMPLEMENTATIONS` lists the three and
chooses one per call; :func:`masked_logsumexp` is the one-call form.

Building a member imports its kernels' modules: :class:`CpuPath` the CPU twin's (and Numba),
:class:`CudaPath` the CUDA kernel's as well (and ``numba.cuda``); nothing else here does, so
``import refdml.gpu.losses`` loads no compiled code until a kernel is asked for
(``IMPLEMENTATIONS.cpu`` / ``.cuda``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._backend import get_backend
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.losses._array import ArrayPath

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath", "KernelPath", "masked_logsumexp"]

_ARRAY_PATH = ArrayPath()


class KernelPath:
    """The masked log-sum-exp by a compiled kernel (:class:`ArrayPath`'s interface): the
    rows of the broadcast ``z`` / ``mask`` along ``axis``, made contiguous (one copy where
    they are not), as one :class:`MaskedLseBuffers` that :meth:`launch` fills. Without a
    row to launch over (a 0-d ``z``, empty rows, or none) the array path answers. Building
    one imports the compiled module (Numba)."""

    def __init__(self) -> None:
        from refdml.gpu.losses import _compiled

        self.compiled = _compiled

    def launch(self, buffers: Any) -> None:
        """Fill ``buffers.lse`` and ``buffers.weights`` (each member's kernel)."""
        raise NotImplementedError

    def masked_logsumexp(self, z: Any, mask: Any = None, *, axis: int = -1,
                         extra_zero: bool = False) -> tuple[Any, Any]:
        if not (z.ndim and z.shape[axis] and z.size):
            return _ARRAY_PATH.masked_logsumexp(z, mask, axis=axis, extra_zero=extra_zero)
        xp = get_backend(z, mask).xp
        if mask is not None:
            z, mask = xp.broadcast_arrays(z, mask)
        moved = xp.moveaxis(z, axis, -1)
        shape = moved.shape
        z2 = xp.ascontiguousarray(moved).reshape(-1, shape[-1])
        if mask is None:
            # a placeholder the kernel never reads: kept on a device (nothing to launch for
            # it); on the host a new one (free, and writable: the CUDA simulator copies
            # every argument back)
            ns = get_backend(z)
            mask2 = (ns.kept("refdml.gpu.losses.no_mask", lambda: np.ones((1, 1), dtype=bool))
                     if ns.launch_bound else xp.ones((1, 1), dtype=bool))
        else:
            mask2 = xp.ascontiguousarray(xp.moveaxis(mask, axis, -1), dtype=bool).reshape(
                z2.shape)
        buffers = self.compiled.MaskedLseBuffers(
            z=z2, mask=mask2, has_mask=mask is not None, extra_zero=bool(extra_zero),
            lse=xp.empty(z2.shape[0], dtype=z.dtype), weights=xp.empty(z2.shape, dtype=z.dtype))
        self.launch(buffers)
        return (buffers.lse.reshape(shape[:-1]),
                xp.moveaxis(buffers.weights.reshape(shape), -1, axis))


class CpuPath(KernelPath):
    """The CPU twin ``masked_lse_cpu`` (``prange`` over rows), under the threading-layer
    guard of :func:`refdml.gpu._support.threading_layer.parallel_launch`."""

    def launch(self, buffers: Any) -> None:
        with parallel_launch():
            self.compiled.masked_lse_cpu(*buffers.args())


class CudaPath(KernelPath):
    """The CUDA kernel ``refdml_loss_masked_lse``: one block of :data:`BLOCK` threads per
    row. Building it imports the kernel's module, and with it ``numba.cuda``."""

    def __init__(self) -> None:
        super().__init__()
        from refdml.gpu.losses import _cuda

        self.kernel = _cuda.refdml_loss_masked_lse

    def launch(self, buffers: Any) -> None:
        cuda_launch(self.kernel, buffers.z.shape[0], BLOCK, *buffers.args())


#: The losses family's implementations of the masked log-sum-exp, and the one object that
#: chooses among them (registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`).
IMPLEMENTATIONS: Implementations[ArrayPath] = Implementations(
    family="losses",
    array=_ARRAY_PATH,
    load_cpu=CpuPath,
    load_cuda=CudaPath,
    auto_numpy="array",
    auto_cupy="cuda",
    measured=(
        "NumPy: docs/benchmarks.md, the masked_logsumexp table (array path against the CPU "
        "twin; `python scripts/bench_gpu.py --only lse`), and docs/gpu/kernels.md, "
        "'Masked log-sum-exp'. CuPy: the launches of the kernel and of the array path, "
        "counted on the CuPy stand-in (tests/gpu/test_gpu_launch_counts.py; "
        "`bash scripts/ci_cupy_standin.sh`)."
    ),
)


def masked_logsumexp(z: Any, mask: Any = None, *, axis: int = -1,
                     extra_zero: bool = False) -> tuple[Any, Any]:
    """:meth:`ArrayPath.masked_logsumexp` by the member :data:`IMPLEMENTATIONS` chooses for
    ``z`` (one call; a forward with several log-sum-exps chooses once instead)."""
    return IMPLEMENTATIONS.choose(z).masked_logsumexp(z, mask, axis=axis, extra_zero=extra_zero)
