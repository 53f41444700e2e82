"""Trainable parameters: a value and an accumulated gradient, nothing else.

There is no tape and no autodiff: a layer's backward returns the gradient of each of its
parameters, and the model adds it into ``Parameter.grad`` (layers shared between two
branches receive both contributions). Optimisers read ``grad`` and update ``value`` in
place; :meth:`Parameter.zero_grad` clears the gradient before the next step.

Arrays are NumPy or CuPy (the module of ``value``), float32 or float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import _describe
from refdml._backend import as_input_array, get_backend

__all__ = ["Parameter"]


class Parameter:
    """A named trainable array ``value`` and its gradient ``grad`` (same shape, dtype, device).

    Parameters
    ----------
    value : array
        Initial value (copied), float32 or float64, NumPy or CuPy; must be finite.
    name : str
        Dotted name used in checkpoints and error messages (``"embed.weight"``).
    """

    __slots__ = ("name", "value", "grad")

    def __init__(self, value: Any, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {_describe(name)}")
        ns = get_backend(value)
        array = as_input_array(value)
        if np.dtype(array.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"{name} must be float32 or float64, got dtype {array.dtype}")
        array = ns.xp.array(array, copy=True)
        if not bool(ns.xp.all(ns.xp.isfinite(array))):
            raise ValueError(f"{name} must be finite")
        self.name = name
        self.value = array
        self.grad = ns.xp.zeros_like(array)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.value.dtype)

    def zero_grad(self) -> None:
        """Set the accumulated gradient to zero (in place)."""
        self.grad[...] = 0

    def accumulate(self, grad: Any) -> None:
        """Add ``grad`` into ``self.grad``.

        ``grad`` is an array of the value's module (NumPy or CuPy), real (float or int;
        not bool, complex or object: TypeError) and exactly this parameter's shape
        (ValueError). Its values are not read here (no device synchronisation): the
        optimiser's step refuses a non-finite gradient.
        """
        # A NumPy scalar is the gradient of a 0-d parameter (x.sum() gives one).
        if not get_backend(self.value).is_own_array(grad):
            raise TypeError(f"gradient for {self.name} must be a {type(self.value).__name__} "
                            f"like its value, got {_describe(grad)}")
        kind = np.dtype(grad.dtype)
        if kind == bool or not (np.issubdtype(kind, np.floating)
                                or np.issubdtype(kind, np.integer)):
            raise TypeError(f"gradient for {self.name} must be real, got dtype {kind}")
        if tuple(grad.shape) != self.shape:
            raise ValueError(
                f"gradient for {self.name} has shape {tuple(grad.shape)}, must be {self.shape}"
            )
        self.grad += grad

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={self.shape}, dtype={self.dtype})"
