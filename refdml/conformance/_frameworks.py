"""How a conformance check talks to the framework an implementation is written in.

A :class:`Framework` turns the reference's NumPy inputs into the framework's arrays, runs
the implementation, takes the vector-Jacobian product of its outputs with given
cotangents, and turns everything back into NumPy:

* ``"torch"`` and ``"jax"``: the products come from their autodiff (``torch.autograd.grad``,
  ``jax.vjp``); their modules (:mod:`refdml.conformance._torch`,
  :mod:`refdml.conformance._jax`) import the framework and are imported only when asked
  for, so neither is a dependency of refdml;
* ``"numpy"`` and ``"cupy"``: the implementation is a pair in refdml's protocol,
  ``forward(**inputs) -> (outputs, ctx)`` with ``backward(ctx, *cotangents) -> grads``
  (a mapping, or an object with one attribute per differentiated input).

Arrays cross by DLPack where the framework supports it (no copy on the same device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from refdml._validation import _describe, check_choice
from refdml.conformance._protocol import (
    FRAMEWORKS,
    Evaluation,
    Framework,
    StructureError,
    flatten_outputs,
    named_gradient,
    run_pair,
)

__all__ = ["FRAMEWORKS", "Evaluation", "Framework", "NumpyFramework", "StructureError",
           "flatten_outputs", "get_framework", "named_gradient"]


def get_framework(name: str, *, backward: Callable[..., Any] | None = None,
                  device: str | None = None) -> Framework:
    """The :class:`Framework` called ``name`` (one of :data:`FRAMEWORKS`).

    ``backward`` is the pair protocol's backward (``"numpy"`` and ``"cupy"`` only; refused
    for ``"torch"``/``"jax"``, whose products come from autodiff); ``device`` is the
    framework's device (``"cuda"``, ``"cpu"``; None: the framework's default).
    """
    check_choice(name, "framework", FRAMEWORKS)
    if device is not None and not isinstance(device, str):
        raise TypeError(f"device must be None or a string such as 'cpu' or 'cuda', got "
                        f"{_describe(device)}")
    if name in ("torch", "jax"):
        if backward is not None:
            raise ValueError(f"backward is given for framework == {name!r}, whose "
                             "vector-Jacobian products come from its autodiff; pass "
                             "backward only with 'numpy' or 'cupy'")
    elif backward is None:
        raise TypeError(f"framework == {name!r} needs backward=, the pair protocol's "
                        "backward(ctx, *cotangents) -> grads")
    elif not callable(backward):
        raise TypeError(f"backward must be callable, got {_describe(backward)}")
    # Each framework's module imports the framework itself, so only the one asked for is
    # imported (none of them is a dependency of refdml).
    if name == "torch":
        from refdml.conformance import _torch

        return _torch.make_framework(device=device)
    if name == "jax":
        from refdml.conformance import _jax

        return _jax.make_framework(device=device)
    if name == "cupy":
        from refdml.conformance import _cupy

        return _cupy.make_framework(backward=backward, device=device)
    if device not in (None, "cpu"):
        raise ValueError(f"device == {device!r}, must be None or 'cpu' for framework "
                         "'numpy'")
    return NumpyFramework(backward)


class NumpyFramework:
    """NumPy implementations in refdml's pair protocol (see the module docstring)."""

    name = "numpy"

    def __init__(self, backward: Callable[..., Any]) -> None:
        self.backward = backward

    def asarray(self, value: np.ndarray, dtype: str | None) -> np.ndarray:
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.floating):
            return value.astype(dtype or np.float64, copy=True)
        return value.copy()

    def run(self, call, inputs, wrt, cotangents) -> Evaluation:
        return run_pair(call, inputs, wrt, cotangents, self.backward, label="NumPy",
                        to_host=np.asarray, to_device=lambda array: array)
