"""Input checks of the fast path: like :mod:`refdml._validation`, on NumPy or CuPy arrays.

The reference converts every input to float64; the fast path keeps float32 and float64
(integers become float64) and keeps the array on its device. Type, rank and shape checks
never touch the data. The finiteness check reads every element: on NumPy it always runs;
on CuPy it is a reduction plus one device-to-host synchronisation per input, so it runs
only while :data:`CHECK_FINITE_ON_GPU` is true (default), and a training loop that has
already validated its data may turn it off with :func:`set_finite_checks`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import _describe
from refdml._xp import ArrayNamespace, array_namespace, is_cupy_array

__all__ = ["CHECK_FINITE_ON_GPU", "as_fast_array", "cast_checked", "result_dtype",
           "set_finite_checks"]

CHECK_FINITE_ON_GPU = True
_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def set_finite_checks(enabled: bool) -> None:
    """Turn the finiteness check of CuPy inputs on or off (it synchronises the device)."""
    global CHECK_FINITE_ON_GPU
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {_describe(enabled)}")
    CHECK_FINITE_ON_GPU = enabled


def result_dtype(*arrays: Any) -> np.dtype:
    """float32 when every floating input is float32, else float64 (integers count as float64)."""
    dtypes = [np.dtype(a.dtype) for a in arrays if hasattr(a, "dtype")]
    if dtypes and all(d == np.float32 for d in dtypes):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def cast_checked(array: Any, dtype: Any, name: str, ns: ArrayNamespace) -> Any:
    """``array`` (NumPy or CuPy) as ``dtype`` on ``ns``; narrowing float64 to float32, a finite
    entry beyond float32's range is a ``ValueError`` naming ``name`` and the entry (a cast
    would make it inf, or warn). The check reads the data: on CuPy only while
    :data:`CHECK_FINITE_ON_GPU` (one synchronisation), and only when narrowing.
    """
    xp = ns.xp
    dtype = np.dtype(dtype)
    if (dtype == np.float32 and np.dtype(array.dtype).itemsize > 4
            and np.issubdtype(array.dtype, np.floating) and (not ns.on_gpu or CHECK_FINITE_ON_GPU)):
        array = xp.asarray(array)
        limit = float(np.finfo(np.float32).max)
        beyond = xp.isfinite(array) & (xp.abs(array) > limit)
        if bool(xp.any(beyond)):
            bad = tuple(int(i) for i in xp.argwhere(beyond)[0])
            where = f"[{bad[0] if len(bad) == 1 else bad}]" if bad else ""
            raise ValueError(
                f"{name}{where} == {float(array[bad])!r} is beyond the float32 range "
                f"(|x| <= {limit!r}) of this float32 computation"
            )
    with np.errstate(over="ignore"):  # only inf, -inf and nan are left to overflow
        return xp.asarray(array, dtype=dtype)


def as_fast_array(
    value: Any,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    dtype: Any = None,
    ns: ArrayNamespace | None = None,
) -> Any:
    """Return ``value`` as a float32/float64 array of its own module, checked like the reference.

    ``dtype`` forces a dtype (e.g. the common dtype of several inputs); by default float32
    stays float32 and everything else real becomes float64. Booleans, complex numbers,
    strings and objects raise ``TypeError``; wrong rank, empty and (see module docstring)
    non-finite input raise ``ValueError`` naming ``name``.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be an array of real numbers, got {_describe(value)}")
    ns = ns if ns is not None else array_namespace(value)
    xp = ns.xp
    array = value if is_cupy_array(value) else np.asarray(value)
    kind = np.dtype(array.dtype)
    if kind == bool or not (np.issubdtype(kind, np.floating) or np.issubdtype(kind, np.integer)):
        raise TypeError(f"{name} must be an array of real numbers, got dtype {kind}")
    if dtype is None:
        dtype = kind if kind in _FLOATS else np.dtype(np.float64)
    array = cast_checked(array, dtype, name, ns)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if array.ndim not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, "
                f"got shape {tuple(array.shape)}"
            )
    if min_ndim is not None and array.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got shape {tuple(array.shape)}"
        )
    if array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {tuple(array.shape)}")
    if (not ns.on_gpu or CHECK_FINITE_ON_GPU) and not bool(xp.all(xp.isfinite(array))):
        bad = tuple(int(i) for i in xp.argwhere(~xp.isfinite(array))[0])
        raise ValueError(f"{name} must be finite, got {array[bad]} at index {bad}")
    return array
