"""A registry of every operator with a hand-written backward.

Each operator module registers its forward/backward pairs at import time with
:func:`register`; :func:`all_operators` imports the modules listed in
``OPERATOR_MODULES`` and returns every spec. ``refdml gradcheck`` and the test suite
loop over it, so an operator without a check (or a mirror) is a failing test, not a
forgotten one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["OPERATOR_MODULES", "OperatorSpec", "all_operators", "get", "register"]

OPERATOR_MODULES = (
    "refdml.normalize",
    "refdml.distances",
    "refdml.gsp",
    "refdml.histogram",
    "refdml.losses",
    "refdml.prototypes",
    "refdml.crossbatch",
    "refdml.ot",
)


@dataclass(frozen=True)
class OperatorSpec:
    """How to check one operator.

    Attributes
    ----------
    name : str
        Dotted name, e.g. ``"gsp.weight_transport"``.
    forward, backward : callable
        The pair, following the conventions of :mod:`refdml.gradcheck`.
        For a loss (``value, grads = loss(**inputs)``) set ``is_loss=True`` and give
        the loss as ``forward``; ``backward`` is then unused.
    make_inputs : callable
        ``make_inputs(rng) -> dict`` of well-conditioned example inputs.
    paper : str
        The equation, proposition or algorithm it implements.
    wrt : tuple of str, optional
        Inputs to differentiate (default: every float array input).
    rtol, atol : float
        Tolerance of the check.
    """

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any] | None
    make_inputs: Callable[[np.random.Generator], Mapping[str, Any]]
    paper: str
    wrt: tuple[str, ...] | None = None
    rtol: float = 1e-6
    atol: float = 0.0
    is_loss: bool = False
    mode: str = "auto"
    tags: tuple[str, ...] = field(default_factory=tuple)

    def check(self, rng: Any = None):
        """Run the gradient check on freshly made inputs; return the GradcheckResult."""
        from refdml._validation import check_rng
        from refdml.gradcheck._core import check_gradients, check_loss

        rng = check_rng(rng)
        inputs = dict(self.make_inputs(rng))
        if self.is_loss:
            return check_loss(self.forward, inputs, wrt=self.wrt, mode=self.mode, rng=rng)
        return check_gradients(
            self.forward, self.backward, inputs, wrt=self.wrt, mode=self.mode, rng=rng
        )


_REGISTRY: dict[str, OperatorSpec] = {}


def register(spec: OperatorSpec) -> OperatorSpec:
    """Add ``spec`` to the registry (re-registering the same name replaces it)."""
    _REGISTRY[spec.name] = spec
    return spec


def all_operators() -> list[OperatorSpec]:
    """Import every operator module and return the registered specs, sorted by name."""
    for module in OPERATOR_MODULES:
        importlib.import_module(module)
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def get(name: str) -> OperatorSpec:
    """Return the spec registered under ``name``."""
    all_operators()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no operator named {name!r}; known: {sorted(_REGISTRY)}") from None
