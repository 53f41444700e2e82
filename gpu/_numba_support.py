"""Which implementation a fast-path operator runs: the array path or a Numba kernel.

Every Numba kernel in refdml.gpu sits beside its array-path twin (the code written once
against NumPy/CuPy), and the caller picks with :func:`use_kernels`:

``"auto"`` (default)
    A CuPy input runs the ``@cuda.jit`` kernel where one exists; a NumPy input runs the
    compiled CPU twin where one exists; otherwise the array path.
``"array"``
    The array path only (what the kernels are checked against).
``"cpu"``
    The ``@njit`` CPU twin; a CuPy input is a ``ValueError`` (it would copy to the host).
``"cuda"``
    The ``@cuda.jit`` kernel; a NumPy input is accepted only under Numba's CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1``, how CI runs the CUDA kernels), else a ``ValueError``.

The mode is a context variable (thread- and task-safe); its default is the environment
variable ``REFDML_GPU_KERNELS`` or ``"auto"``.

>>> with use_kernels("array"):
...     kernel_mode()
'array'
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

from refdml._xp import is_cupy_array

__all__ = ["BLOCK", "KERNEL_MODES", "cuda_simulator", "kernel_mode", "select_kernel", "use_kernels"]

#: Threads per block of every 1-D launch in refdml.gpu (the one launch-size constant).
BLOCK = 128

KERNEL_MODES = ("auto", "array", "cpu", "cuda")

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("refdml_gpu_kernels", default=None)


def _check_mode(mode: object, name: str) -> str:
    if not isinstance(mode, str) or mode not in KERNEL_MODES:
        raise ValueError(f"{name} == {mode!r}, must be one of {KERNEL_MODES}")
    return mode


def kernel_mode() -> str:
    """The current mode: the innermost :func:`use_kernels`, else ``$REFDML_GPU_KERNELS``, else auto."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    return _check_mode(os.environ.get("REFDML_GPU_KERNELS", "auto"), "REFDML_GPU_KERNELS")


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Run the enclosed fast-path calls with ``mode`` (see the module docstring)."""
    token = _MODE.set(_check_mode(mode, "mode"))
    try:
        yield
    finally:
        _MODE.reset(token)


def cuda_simulator() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def select_kernel(x: Any, *, has_cpu: bool = True, has_cuda: bool = True) -> str:
    """``"array"``, ``"cpu"`` or ``"cuda"``: what an operator given array ``x`` runs now.

    ``has_cpu`` / ``has_cuda`` say which kernels the operator has. Forcing a kernel the
    operator lacks falls back to the array path (every kernel is optional); forcing one
    that cannot take ``x`` (a host kernel on a CuPy array, a CUDA kernel on a NumPy array
    outside the simulator) is a ``ValueError``.
    """
    mode = kernel_mode()
    on_gpu = is_cupy_array(x)
    if mode == "array":
        return "array"
    if mode == "auto":
        if on_gpu:
            return "cuda" if has_cuda else "array"
        return "cpu" if has_cpu else "array"
    if mode == "cpu":
        if on_gpu:
            raise ValueError("kernel mode 'cpu' cannot take a CuPy array (it would copy to the host)")
        return "cpu" if has_cpu else "array"
    if not on_gpu and not cuda_simulator():
        raise ValueError(
            "kernel mode 'cuda' needs CuPy arrays, or NumPy arrays under Numba's CUDA "
            "simulator (NUMBA_ENABLE_CUDASIM=1)"
        )
    return "cuda" if has_cuda else "array"
