"""Gradient checks of hand-written backward passes, and the parity rule of the fast path.

>>> import numpy as np
>>> from refdml.gradcheck import check_gradients, assert_gradients
>>> def forward(x):
...     return np.sin(x), x
>>> def backward(x, d_out):
...     return {"x": np.cos(x) * d_out}
>>> result = check_gradients(forward, backward, {"x": np.linspace(0, 1, 5)}, rng=0)
>>> assert_gradients(result, rtol=1e-7)

``mode="fast"`` compares one random direction per input (two forward calls, whatever its
size) and localises a failure to one element; every result names its worst element, the
values there and the tolerance; inputs are checked at their own dtype (float16, float32,
float64) with :func:`default_tolerances`; a check point on a kink (ReLU at 0) is reported
as such (:class:`NonDifferentiablePoint`); ``nondet_tol`` bounds a non-deterministic backward.

The harness knows no operator: the catalogue above it, :mod:`refdml.catalog`, describes
each differentiable operator of refdml (its forward/backward pair, input maker, paper
equation, tolerance and fast-path mirror) and hands those callables to the functions here.
See :mod:`refdml.gradcheck._core` for the conventions and what the harness refuses,
:mod:`refdml.gradcheck.strategies` for hypothesis strategies of well-conditioned inputs,
and :mod:`refdml.gradcheck.parity` for the comparison of a mirror with the float64
reference (``refdml gpu-check``).
"""

from refdml.gradcheck._core import (
    FULL_JACOBIAN_LIMIT,
    MODES,
    VJP_LIMIT,
    GradcheckError,
    GradcheckResult,
    InputCheck,
    Kink,
    NonDifferentiablePoint,
    assert_gradients,
    check_gradients,
    check_loss,
    default_tolerances,
)

__all__ = [
    "FULL_JACOBIAN_LIMIT",
    "MODES",
    "VJP_LIMIT",
    "GradcheckError",
    "GradcheckResult",
    "InputCheck",
    "Kink",
    "NonDifferentiablePoint",
    "assert_gradients",
    "check_gradients",
    "check_loss",
    "default_tolerances",
]
