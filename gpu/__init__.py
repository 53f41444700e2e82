"""CuPy and Numba CUDA mirrors of the reference operators (installed as ``refdml.gpu``).

The mirrors are cross-validated against the NumPy reference by the parity tests. CuPy
is not a dependency: install the wheel for your CUDA version (``cupy-cuda12x``).
Numba CUDA comes with the ``gpu`` extra (``numba-cuda``).
"""

from __future__ import annotations

import importlib.util

__all__ = ["cupy_available", "numba_cuda_available"]


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
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:
        return False
