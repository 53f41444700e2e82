"""The array module of an input: NumPy (with SciPy) or CuPy (with cupyx.scipy).

The fast path in :mod:`refdml.gpu` is written once against the module of its inputs, so
the same code runs on NumPy arrays (CI, laptops) and on CuPy arrays (a GPU). CuPy is never
imported unless an input already is a CuPy array, so importing refdml works without it.

>>> import numpy as np
>>> ns = array_namespace(np.zeros(3))
>>> ns.xp is np, ns.special.__name__
(True, 'scipy.special')
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import scipy.special

__all__ = ["ArrayNamespace", "array_namespace", "is_cupy_array", "to_numpy"]


@dataclass(frozen=True)
class ArrayNamespace:
    """``xp`` (numpy or cupy) and ``special`` (scipy.special or cupyx.scipy.special)."""

    xp: ModuleType
    special: ModuleType

    @property
    def on_gpu(self) -> bool:
        return self.xp is not np


_NUMPY = ArrayNamespace(xp=np, special=scipy.special)


def is_cupy_array(value: Any) -> bool:
    """True for a ``cupy.ndarray`` (checked without importing CuPy)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def array_namespace(*arrays: Any) -> ArrayNamespace:
    """The namespace of the inputs; mixing NumPy and CuPy arrays is a ``TypeError``."""
    kinds = {is_cupy_array(a) for a in arrays if a is not None and not np.isscalar(a)}
    if kinds == {True, False}:
        raise TypeError(
            "inputs mix NumPy and CuPy arrays; move them to one device first "
            "(cupy.asarray(x) or cupy.asnumpy(x))"
        )
    if kinds == {True}:
        import cupy
        import cupyx.scipy.special

        return ArrayNamespace(xp=cupy, special=cupyx.scipy.special)
    return _NUMPY


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (for comparisons with the reference)."""
    if is_cupy_array(value):
        return value.get()
    return np.asarray(value)
