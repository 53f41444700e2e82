"""Gradient checks of hand-written backward passes, and the catalogue of every operator.

>>> import numpy as np
>>> from refdml.gradcheck import check_gradients, assert_gradients
>>> def forward(x):
...     return np.sin(x), x
>>> def backward(x, d_out):
...     return {"x": np.cos(x) * d_out}
>>> result = check_gradients(forward, backward, {"x": np.linspace(0, 1, 5)}, rng=0)
>>> assert_gradients(result, rtol=1e-7)

The catalogue, :mod:`refdml.gradcheck.catalog`, has one :class:`OperatorSpec` per
differentiable operator of refdml (its forward/backward pair, input maker, paper equation,
tolerance and fast-path mirror); ``refdml gradcheck`` and the test suite loop over
:func:`all_operators`. See :mod:`refdml.gradcheck._core` for the conventions and what the
harness refuses, and :mod:`refdml.gradcheck.strategies` for hypothesis strategies of
well-conditioned inputs.
"""

from refdml.gradcheck._core import (
    FULL_JACOBIAN_LIMIT,
    VJP_LIMIT,
    GradcheckError,
    GradcheckResult,
    InputCheck,
    assert_gradients,
    check_gradients,
    check_loss,
)
from refdml.gradcheck.catalog import OperatorSpec, all_operators, register

__all__ = [
    "FULL_JACOBIAN_LIMIT",
    "VJP_LIMIT",
    "GradcheckError",
    "GradcheckResult",
    "InputCheck",
    "OperatorSpec",
    "all_operators",
    "assert_gradients",
    "check_gradients",
    "check_loss",
    "register",
]
