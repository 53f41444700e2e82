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

import re
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

__all__ = ["DEVICES", "FRAMEWORKS", "Evaluation", "Framework", "NumpyFramework",
           "StructureError", "check_device", "flatten_outputs", "get_framework",
           "named_gradient"]

#: The devices a conformance check may run on, per framework, as the message names them.
#: Only these: a device such as torch's ``"meta"`` (tensors without data) or ``"mps"``
#: (whose float64 is missing) would run and report the implementation as failing, where
#: the fault is the device. ``None`` is the framework's default (the CPU for NumPy and
#: PyTorch, JAX's first device, CuPy's current one).
DEVICES: dict[str, tuple[str, ...]] = {
    "numpy": ("cpu",),
    "torch": ("cpu", "cuda", "cuda:N"),
    "jax": ("cpu", "gpu", "cuda", "tpu"),
    "cupy": ("cuda", "cuda:N"),
}
_PATTERNS = {
    "numpy": re.compile(r"cpu"),
    "torch": re.compile(r"cpu|cuda(?::\d+)?"),
    "jax": re.compile(r"cpu|gpu|cuda|tpu"),
    "cupy": re.compile(r"(?:cuda|gpu)(?::\d+)?"),   # 'gpu' as well, as CuPy's docs say
}

_DEVICE_HINTS = {"cupy": " (CuPy arrays live on a GPU; 'numpy' checks a pair on the CPU)"}


def check_device(framework: str, device: Any) -> str | None:
    """``device`` when ``framework`` (one of :data:`FRAMEWORKS`) can run a conformance
    check on it, as written; None for the framework's default.

    Only the form is checked here, without importing the framework (whether the device is
    present is asked of the framework by :func:`get_framework`). Raises TypeError for a
    device that is not None or a string, ValueError naming the device and the devices the
    framework supports (:data:`DEVICES`) otherwise, the empty string included.
    """
    check_choice(framework, "framework", FRAMEWORKS)
    if device is None:
        return None
    if not isinstance(device, str):
        raise TypeError(f"device must be None or a string such as 'cpu' or 'cuda', got "
                        f"{_describe(device)}")
    if _PATTERNS[framework].fullmatch(device) is None:
        names = ["None", *map(repr, DEVICES[framework])]
        supported = ", ".join(names[:-1]) + " or " + names[-1]
        raise ValueError(f"device == {device!r}, must be {supported} for framework "
                         f"{framework!r}{_DEVICE_HINTS.get(framework, '')}")
    return device


def get_framework(name: str, *, backward: Callable[..., Any] | None = None,
                  device: str | None = None) -> Framework:
    """The :class:`Framework` called ``name`` (one of :data:`FRAMEWORKS`).

    ``backward`` is the pair protocol's backward (``"numpy"`` and ``"cupy"`` only; refused
    for ``"torch"``/``"jax"``, whose products come from autodiff); ``device`` is the
    framework's device (``"cuda"``, ``"cpu"``; None: the framework's default), one of
    :data:`DEVICES` (:func:`check_device`), refused before any work when the framework
    does not see it.
    """
    check_choice(name, "framework", FRAMEWORKS)
    device = check_device(name, device)   # before any import: the form of the device
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
    return NumpyFramework(backward)


class NumpyFramework:
    """NumPy implementations in refdml's pair protocol (see the module docstring)."""

    name = "numpy"
    pair = True

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
