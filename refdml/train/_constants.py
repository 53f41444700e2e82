"""Constant arrays of the layers (patch indices, a row of zeros, a column of ones), kept
per device so that a call neither builds nor uploads them (:meth:`refdml._backend.Backend.kept`).

On a device each upload is a host-to-device copy, and each ``ones``/``full`` a kernel
launch: a layer that made its constants per call would pay one of either every step, and
a captured step (a CUDA graph) cannot replay a copy from host memory that has since
changed. So :func:`constant` builds a constant once on the host, uploads it once per
device and keeps it; later calls get the same device array. On NumPy the host array is
kept read-only.

The kept arrays are shared: callers read them and never write into them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from refdml._backend import MAX_KEPT, get_backend

__all__ = ["constant", "filled"]


def constant(like: Any, key: tuple, build: Callable[[], np.ndarray]) -> Any:
    """``build()`` (a NumPy array, the same for the same ``key``) on ``like``'s array module
    and device: :meth:`refdml._backend.Backend.kept` (read-only on NumPy; on a device
    uploaded once per ``key`` and device, then the kept copy)."""
    return get_backend(like).kept(key, build,
                                 device=getattr(getattr(like, "device", None), "id", None))


@functools.lru_cache(maxsize=MAX_KEPT)
def _host_filled(value: float, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    array = np.full(shape, value, dtype=dtype)
    array.flags.writeable = False
    return array


def filled(like: Any, value: float, shape: tuple[int, ...]) -> Any:
    """``full(shape, value)`` in ``like``'s module, device and dtype, kept (read-only on
    NumPy; not to be written on a device either)."""
    dtype = np.dtype(like.dtype)
    return constant(like, ("filled", float(value), tuple(shape), dtype),
                    lambda: _host_filled(float(value), tuple(shape), dtype))
