"""Input validation shared by the public functions.

Public functions validate once, with these helpers, and raise ``TypeError`` for a
wrong type and ``ValueError`` for a bad value, naming the parameter and the value.
Private kernels assume valid input.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

__all__ = [
    "as_float_array",
    "as_label_array",
    "check_scalar",
    "check_rng",
    "check_choice",
    "check_float_dtype",
    "check_features_prototypes",
    "check_same_length",
    "check_context",
    "check_upstream",
]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def as_float_array(
    value: Any,
    name: str,
    *,
    ndim: int | tuple[int, ...] | None = None,
    min_ndim: int | None = None,
    allow_empty: bool = False,
    finite: bool = True,
    copy: bool = True,
) -> np.ndarray:
    """Return ``value`` as a float64 array, checking type, rank, size and finiteness.

    Integer and float inputs (including float32) are accepted and converted to float64;
    booleans, complex numbers, strings and objects raise ``TypeError``. With
    ``copy=False`` a float64 input is returned without a copy (for read-only use of
    large inputs); otherwise the result is always a new array.
    """
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be an array of real numbers, got {_describe(value)}")
    array = np.asarray(value)
    if array.dtype == bool or not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise TypeError(
            f"{name} must be an array of real numbers, got dtype {array.dtype}"
        )
    array = np.array(array, dtype=np.float64, copy=True if copy else None)
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if array.ndim not in allowed:
            raise ValueError(
                f"{name} must have {' or '.join(map(str, allowed))} dimensions, "
                f"got shape {array.shape}"
            )
    if min_ndim is not None and array.ndim < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimensions, got shape {array.shape}"
        )
    if not allow_empty and array.size == 0:
        raise ValueError(f"{name} must not be empty, got shape {array.shape}")
    if finite and not np.all(np.isfinite(array)):
        bad = np.argwhere(~np.isfinite(array))[0]
        raise ValueError(
            f"{name} must be finite, got {array[tuple(bad)]} at index {tuple(int(i) for i in bad)}"
        )
    return array


def as_label_array(value: Any, name: str, *, length: int | None = None) -> np.ndarray:
    """Return integer class labels as a 1-d int64 array (optionally of a given length)."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"{name} must be a 1-d array of integer labels, got {_describe(value)}")
    array = np.asarray(value)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        # Integral floats beyond int64 (1e300) would not survive the cast: refused below.
        if np.issubdtype(array.dtype, np.floating) and np.all(np.isfinite(array)) and np.all(
            array == np.round(array)
        ) and np.all(np.abs(array) < 2.0**63):
            array = array.astype(np.int64)
        else:
            raise TypeError(f"{name} must hold integer labels, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {array.shape}")
    if length is not None and array.shape[0] != length:
        raise ValueError(
            f"{name} has length {array.shape[0]}, but {length} labels are needed "
            "(one per embedding)"
        )
    return array.astype(np.int64, copy=True)


def check_scalar(
    value: Any,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
    integer: bool = False,
) -> float | int:
    """Check a real (or integer) scalar against an interval; return it as float (int)."""
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        if isinstance(value, np.ndarray) and value.ndim == 0 and not integer:
            value = value.item()
        else:
            wanted = "an integer" if integer else "a real number"
            raise TypeError(f"{name} must be {wanted}, got {_describe(value)}")
    value = int(value) if integer else float(value)
    if not integer and not np.isfinite(value):
        raise ValueError(f"{name} == {value}, must be finite")
    # Integers are counts, sizes and indices for NumPy: beyond int64 they would overflow there.
    if integer and not -(2**63) <= value < 2**63:
        raise ValueError(f"{name} == {value}, must fit in int64 (|{name}| < 2**63)")
    lo_ok = low is None or (value >= low if low_inclusive else value > low)
    hi_ok = high is None or (value <= high if high_inclusive else value < high)
    if not (lo_ok and hi_ok):
        left = "-inf" if low is None else f"{low:g}"
        right = "inf" if high is None else f"{high:g}"
        interval = (
            ("[" if low_inclusive and low is not None else "(")
            + f"{left}, {right}"
            + ("]" if high_inclusive and high is not None else ")")
        )
        raise ValueError(f"{name} == {value!r}, must be in {interval}")
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Check that ``value`` is one of the allowed strings."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {choices}, got {_describe(value)}")
    if value not in choices:
        raise ValueError(f"{name} == {value!r}, must be one of {choices}")
    return value


def check_float_dtype(value: Any, name: str = "dtype") -> np.dtype:
    """``value`` (``np.float32``, ``"float64"``, ...) as the dtype float32 or float64.

    ``TypeError`` naming ``name`` for anything else, ``None`` included (NumPy would read
    it as float64: a parameter documented as float32 or float64 takes one of them).
    """
    wanted = f"{name} must be float32 or float64"
    if value is None:
        raise TypeError(f"{wanted}, got None")
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise TypeError(f"{wanted}, got {_describe(value)}") from None
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"{wanted}, got {dtype}")
    return dtype


def check_rng(rng: Any) -> np.random.Generator:
    """Turn ``None``, an int seed or a Generator into a Generator (never the global one)."""
    if rng is None or isinstance(rng, (numbers.Integral, np.random.SeedSequence)):
        if isinstance(rng, bool):
            raise TypeError(f"rng must be None, an int or a numpy Generator, got {rng!r}")
        if isinstance(rng, numbers.Integral) and rng < 0:
            raise ValueError(f"rng == {int(rng)}, must be a non-negative seed (or None, or a Generator)")
        return np.random.default_rng(rng)
    if isinstance(rng, np.random.Generator):
        return rng
    raise TypeError(f"rng must be None, an int or a numpy Generator, got {_describe(rng)}")


def check_same_length(a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    """Check that two arrays have the same leading dimension."""
    if a.shape[0] != b.shape[0]:
        raise ValueError(
            f"{a_name} has {a.shape[0]} rows but {b_name} has {b.shape[0]}; they must match"
        )


def check_features_prototypes(features, prototypes) -> tuple[np.ndarray, np.ndarray]:
    """Validate per-image local features (B, n, d) and prototypes (m, d) of the same d."""
    features = as_float_array(features, "features", ndim=3)
    prototypes = as_float_array(prototypes, "prototypes", ndim=2)
    if features.shape[2] != prototypes.shape[1]:
        raise ValueError(
            "features and prototypes must have the same last dimension, got "
            f"features.shape={features.shape}, prototypes.shape={prototypes.shape}"
        )
    return features, prototypes


def check_context(ctx: Any, name: str, cls: type | tuple[type, ...]) -> Any:
    """Check that a backward was handed the context its own forward returns.

    Raises ``TypeError`` naming the parameter, the expected and the given type: a
    context of another operator (or a tuple, or None) must not reach the arithmetic,
    where it would give an ``AttributeError`` or a plausible but wrong gradient.
    """
    if not isinstance(ctx, cls):
        wanted = (
            " or ".join(c.__name__ for c in cls) if isinstance(cls, tuple) else cls.__name__
        )
        raise TypeError(
            f"{name} must be the {wanted} returned by the matching forward, "
            f"got {type(ctx).__name__}"
        )
    return ctx


def check_upstream(
    value: Any, name: str, shape: tuple[int, ...], *, allow_none: bool = False
) -> np.ndarray | None:
    """Validate an upstream gradient: real, exactly ``shape`` (no broadcasting), finite.

    Returns a float64 array (a 0-d array for a scalar output). ``None`` is returned
    unchanged only when ``allow_none`` (the caller documents that it means zero).
    A scalar output (``shape == ()``) also accepts a Python or NumPy real number.
    """
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be an array of shape {shape}, got None")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be an array of real numbers, got {_describe(value)}")
    array = np.asarray(value)
    if array.dtype == bool or not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise TypeError(f"{name} must be an array of real numbers, got dtype {array.dtype}")
    if array.shape != tuple(shape):
        raise ValueError(
            f"{name} has shape {array.shape}, must be {tuple(shape)} (the shape of the "
            "forward's output; it is not broadcast)"
        )
    array = np.array(array, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        if array.ndim == 0:
            raise ValueError(f"{name} == {array.item()}, must be finite")
        bad = np.argwhere(~np.isfinite(array))[0]
        raise ValueError(
            f"{name} must be finite, got {array[tuple(bad)]} at index {tuple(int(i) for i in bad)}"
        )
    return array
