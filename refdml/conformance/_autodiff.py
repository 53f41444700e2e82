"""What the autodiff frameworks' sides (:mod:`refdml.conformance._torch`,
:mod:`refdml.conformance._jax`) share; imports neither framework."""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml.conformance._protocol import StructureError

__all__ = ["check_output_shapes", "describe_type", "floating_dtype"]


def floating_dtype(dtype: Any) -> np.dtype:
    """``dtype`` as a NumPy floating dtype (float16, float32, float64); ``TypeError`` else."""
    try:
        parsed = np.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed is None or parsed.kind != "f":
        raise TypeError(f"dtype must be a floating dtype such as 'float32', got {dtype!r}")
    return parsed


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
