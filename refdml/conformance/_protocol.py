"""The protocol between a conformance check and a framework (shared by every framework).

Each framework's module (:mod:`refdml.conformance._torch`, ``_jax``, ``_cupy``, and the
NumPy framework in :mod:`refdml.conformance._frameworks`) imports what it shares from
here, not from ``_frameworks``: ``get_framework`` there imports the framework modules
(only when asked for), so a framework module importing ``_frameworks`` would close a
circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = ["FRAMEWORKS", "Evaluation", "Framework", "StructureError", "flatten_outputs",
           "named_gradient", "run_pair"]

#: The frameworks :func:`refdml.conformance.check_implementation` accepts.
FRAMEWORKS = ("torch", "jax", "numpy", "cupy")


@dataclass(frozen=True)
class Evaluation:
    """What one run of an implementation gave, in NumPy.

    ``outputs`` are the forward's outputs flattened to a tuple (a single array or number
    becomes a 1-tuple), each in the dtype the implementation returned; ``grads`` maps every
    differentiated input to its vector-Jacobian product, or to None where the framework
    reported no dependence (``torch.autograd.grad(..., allow_unused=True)``) or the backward
    returned none; ``grads`` is None when no product was asked for.
    """

    outputs: tuple[np.ndarray, ...]
    grads: Mapping[str, np.ndarray | None] | None


class Framework(Protocol):
    """One framework's side of a conformance check."""

    name: str
    #: True for refdml's pair protocol (NumPy, CuPy): the implementation returns
    #: ``(outputs, ctx)`` and its gradients come from the user's own backward; False where
    #: the framework's autodiff forms them (torch, JAX).
    pair: bool

    def asarray(self, value: np.ndarray, dtype: str | None) -> Any:
        """``value`` as the framework's array: floating arrays cast to ``dtype`` (None:
        kept float64), integer and boolean arrays with their dtype unchanged."""

    def run(
        self,
        call: Callable[[dict[str, Any]], Any],
        inputs: Mapping[str, Any],
        wrt: tuple[str, ...],
        cotangents: tuple[np.ndarray, ...] | None,
    ) -> Evaluation:
        """Run ``call(inputs)`` (``inputs`` already framework arrays or Python values) and,
        unless ``cotangents`` is None, the vector-Jacobian product of its outputs with
        ``cotangents`` (NumPy arrays shaped like the reference's outputs, cast here to the
        dtype of the matching output) with respect to the inputs named in ``wrt``."""


class StructureError(TypeError):
    """An implementation returned outputs or gradients of the wrong structure (not a pair
    ``(outputs, ctx)`` in the pair protocol, a non-real or non-array output): a
    conformance check reports it under the cause ``"structure"``, not ``"raised"``."""


def flatten_outputs(outputs: Any, convert: Callable[[Any], np.ndarray]) -> tuple[np.ndarray, ...]:
    """``outputs`` (an array, a number, or a tuple/list of them) as a tuple of NumPy arrays,
    each converted by ``convert`` and kept in its dtype; ``StructureError`` for a part that
    is not a real array or number. The frameworks share it, so every framework flattens
    outputs as the reference's ``refdml.gradcheck`` does."""
    parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    arrays = []
    for k, part in enumerate(parts):
        if part is None or isinstance(part, (str, bytes, Mapping)):
            raise StructureError(f"output {k} is {type(part).__name__}, not an array or "
                                 "a number")
        try:
            array = np.asarray(convert(part))
        except StructureError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to convert is structural
            raise StructureError(f"output {k} ({type(part).__name__}) cannot be read as an "
                                 f"array: {error}") from error
        if array.dtype == bool or not (np.issubdtype(array.dtype, np.floating)
                                       or np.issubdtype(array.dtype, np.integer)):
            raise StructureError(f"output {k} has dtype {array.dtype}; outputs must be real "
                                 "arrays or numbers")
        arrays.append(array)
    return tuple(arrays)


def named_gradient(grads: Any, name: str) -> Any:
    """The gradient named ``name`` in ``grads`` (a mapping, or an object with one attribute
    per input), None where there is none."""
    if isinstance(grads, Mapping):
        return grads.get(name)
    return getattr(grads, name, None)


def run_pair(call, inputs, wrt, cotangents, backward, *, label: str,
             to_host: Callable[[Any], np.ndarray],
             to_device: Callable[[np.ndarray], Any]) -> Evaluation:
    """One run of an implementation in refdml's pair protocol (the NumPy and CuPy
    frameworks): ``call(inputs) -> (outputs, ctx)`` and, unless ``cotangents`` is None,
    ``backward(ctx, *upstream)`` with each cotangent in its output's dtype, moved by
    ``to_device``; outputs and gradients come back through ``to_host``. ``StructureError``
    where the forward does not return a pair (``label`` names the framework)."""
    returned = call(dict(inputs))
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise StructureError(
            f"a {label} implementation returns a pair (outputs, ctx) in the pair "
            f"protocol, got {type(returned).__name__}"
            + (f" of length {len(returned)}" if isinstance(returned, tuple) else ""))
    outputs, ctx = returned
    arrays = flatten_outputs(outputs, to_host)
    if cotangents is None:
        return Evaluation(arrays, None)
    upstream = [
        to_device(np.asarray(c, dtype=out.dtype if np.issubdtype(out.dtype, np.floating)
                             else np.float64).reshape(np.shape(c)))
        for c, out in zip(cotangents, arrays)
    ]
    grads = backward(ctx, *upstream)
    return Evaluation(arrays, {
        name: None if (g := named_gradient(grads, name)) is None else to_host(g)
        for name in wrt
    })
