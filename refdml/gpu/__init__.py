"""The fast path: the reference operators again, on NumPy or CuPy arrays (``refdml.gpu``).

``refdml.gpu.<family>`` has the same names, signatures, result and context types as
``refdml.<family>`` (normalize, distances, losses, histogram, prototypes, crossbatch, gsp,
ot, kcenter, metrics), written once against the input's array module, float32 or float64,
batched. ``refdml.gradcheck.parity.check_parity`` and ``refdml gpu-check`` hold each mirror
to the float64 reference; see docs/gpu.md. CuPy is not a dependency: install the wheel for
your CUDA version (``cupy-cuda12x``); without it everything runs on NumPy.

Some mirrors also have compiled Numba kernels beside their array path (a ``@njit`` CPU
twin, a ``@cuda.jit`` kernel, one source): :func:`use_kernels` picks which runs
(``"auto"``, ``"array"``, ``"cpu"``, ``"cuda"``); see :mod:`refdml.gpu._support.modes`.

On CuPy each data-dependent input check (finiteness, zero rows, ...) costs one
device-to-host synchronisation; :func:`set_finite_checks` turns them off for a loop whose
data is already validated (the checks live in :mod:`refdml._validation`).
"""

from __future__ import annotations

import importlib.util

from refdml.gpu._support.modes import kernel_mode, use_kernels
from refdml._backend import set_finite_checks

__all__ = ["cupy_available", "kernel_mode", "numba_cuda_available", "set_finite_checks",
           "use_kernels"]


def cupy_available() -> bool:
    """True when CuPy is installed and sees at least one CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def numba_cuda_available() -> bool:
    """True when Numba's CUDA target (or its simulator) is usable."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        from refdml.gpu._support.cuda import cuda

        return bool(cuda.is_available())
    except Exception:
        return False
