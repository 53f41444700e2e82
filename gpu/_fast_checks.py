"""Checks of the fast path beyond :mod:`refdml.gpu._validation`: upstream gradients,
labels, zero rows. Same rules and wording as :mod:`refdml._validation`, on NumPy or CuPy.

Data-dependent checks (finite upstream, zero rows, integer-valued float labels, classes
without a proxy) read the data: on NumPy they always run; on CuPy each is one reduction
and one device-to-host synchronisation, and runs only while
:data:`refdml.gpu._validation.CHECK_FINITE_ON_GPU` is true (see ``set_finite_checks``).
Shape and type checks never touch the data.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from refdml._validation import _describe
from refdml._xp import ArrayNamespace, is_cupy_array
from refdml.gpu import _validation

__all__ = ["check_fast_upstream", "check_nonzero_rows", "data_checks", "fast_labels"]


def data_checks(ns: ArrayNamespace) -> bool:
    """True where data-dependent checks run (always on NumPy; on CuPy while enabled)."""
    return not ns.on_gpu or _validation.CHECK_FINITE_ON_GPU


def check_fast_upstream(value: Any, name: str, shape: tuple[int, ...], ns: ArrayNamespace,
                        dtype: Any) -> Any:
    """An upstream gradient: real, exactly ``shape``, finite; returned in ``dtype`` on ``ns``.

    A scalar output (``shape == ()``) also accepts a Python or NumPy real number, returned
    as a Python float (no device array needed to scale by it).
    """
    xp = ns.xp
    if value is None:
        raise TypeError(f"{name} must be an array of shape {shape}, got None")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an array of real numbers, got {_describe(value)}")
    if tuple(shape) == () and isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        if not np.isfinite(value):
            raise ValueError(f"{name} == {value}, must be finite")
        return value
    if not is_cupy_array(value):
        value = np.asarray(value)
    kind = np.dtype(value.dtype)
    if kind == bool or not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)):
        raise TypeError(f"{name} must be an array of real numbers, got dtype {kind}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(value.shape)}, must be {tuple(shape)} (the shape of the "
            "forward's output; it is not broadcast)"
        )
    array = _validation.cast_checked(value, dtype, name, ns)
    if data_checks(ns) and not bool(xp.all(xp.isfinite(array))):
        if array.ndim == 0:
            raise ValueError(f"{name} == {array}, must be finite")
        bad = tuple(int(i) for i in xp.argwhere(~xp.isfinite(array))[0])
        raise ValueError(f"{name} must be finite, got {array[bad]} at index {bad}")
    return array


def fast_labels(value: Any, name: str, ns: ArrayNamespace, *, length: int | None = None) -> Any:
    """Integer class labels as a 1-d int64 array of ``ns`` (like ``as_label_array``)."""
    xp = ns.xp
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a 1-d array of integer labels, got {_describe(value)}")
    array = value if is_cupy_array(value) else np.asarray(value)
    kind = np.dtype(array.dtype)
    if kind == bool or not np.issubdtype(kind, np.integer):
        # Integral floats beyond int64 (1e300) would not survive the cast: refused here.
        integral = np.issubdtype(kind, np.floating) and (
            not data_checks(ns)
            or bool(xp.all(xp.isfinite(array)) & xp.all(array == xp.round(array))
                    & xp.all(xp.abs(array) < 2.0**63))
        )
        if not integral:
            raise TypeError(f"{name} must hold integer labels, got dtype {kind}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {tuple(array.shape)}")
    if length is not None and array.shape[0] != length:
        raise ValueError(
            f"{name} has length {array.shape[0]}, but {length} labels are needed "
            "(one per embedding)"
        )
    return xp.asarray(array, dtype=xp.int64)


def check_nonzero_rows(xp: Any, x: Any, name: str, *, why: str, ns: ArrayNamespace) -> None:
    """``ValueError`` naming ``name`` and the first all-zero row (last axis)."""
    if not data_checks(ns):
        return
    zero = ~xp.any(x != 0, axis=-1)
    if bool(xp.any(zero)):
        index = tuple(int(i) for i in xp.argwhere(zero)[0])
        where = index[0] if len(index) == 1 else index
        raise ValueError(f"{name} has a zero vector at row {where}; {why}")
