"""What the autodiff frameworks' sides (:mod:`refdml.conformance._torch`,
:mod:`refdml.conformance._jax`) share; imports neither framework."""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml.conformance._formats import FORMATS
from refdml.conformance._protocol import StructureError

__all__ = ["check_output_shapes", "describe_type", "floating_dtype", "host_values"]


def floating_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy floating dtype (float16, float32, float64); ``TypeError`` else."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or parsed.kind != "f":
        raise TypeError(f"dtype must be a floating dtype such as 'float32', got {dtype!r}")
    return parsed


def host_values(array: np.ndarray, dtype: str | None) -> tuple[np.ndarray, bool]:
    """A floating ``array`` ready to become a framework's array in ``dtype``: cast to it
    with NumPy, or, for ``"bfloat16"`` (which NumPy lacks), rounded to bfloat16 and held
    as float32, which carries every bfloat16 value exactly. The flag says that the
    framework still has to cast the result to its bfloat16 (exactly: no second
    rounding). Integer and boolean arrays, and ``dtype=None``, pass unchanged."""
    array = np.asarray(array)
    if array.dtype.kind != "f" or dtype is None:
        return array, False
    if dtype == "bfloat16":
        with np.errstate(over="ignore"):
            return FORMATS["bfloat16"].round(array).astype(np.float32), True
    return array.astype(floating_dtype(dtype), copy=False), False


def describe_type(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


def check_output_shapes(outputs: tuple[np.ndarray, ...],
                        cotangents: tuple[np.ndarray, ...]) -> None:
    """``StructureError`` where the outputs' count or shapes are not those of the
    cotangents (the reference's outputs): the vector-Jacobian product needs them equal."""
    if len(outputs) != len(cotangents):
        raise StructureError(f"the implementation returned {len(outputs)} output(s), the "
                             f"reference {len(cotangents)}")
    for position, (output, cotangent) in enumerate(zip(outputs, cotangents)):
        if output.shape != np.shape(cotangent):
            raise StructureError(f"output {position} has shape {output.shape}, the "
                                 f"reference's {np.shape(cotangent)}")
