"""Catalogue entries of :mod:`refdml.prototypes`: the ridge fit, in both forms."""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.gpu import prototypes as fast
from refdml.prototypes import ridge_fit_backward, ridge_fit_forward


def _ridge_inputs(n_samples: int, n_prototypes: int, form: str):
    def make(rng: np.random.Generator) -> dict:
        Z = rng.dirichlet(np.ones(n_prototypes), size=n_samples)
        Y = rng.standard_normal((n_samples, 3))
        return {"Z": Z, "Y": Y, "ridge": 0.3, "form": form}
    return make


OPERATORS = (
    OperatorSpec(
        name="prototypes.ridge_fit_primal",
        forward=ridge_fit_forward,
        backward=ridge_fit_backward,
        make_inputs=_ridge_inputs(7, 4, "primal"),
        mirror=fast.ridge_fit_forward,
        mirror_backward=fast.ridge_fit_backward,
        paper="XML Eq. (2.8), primal form V = (Z^T Z + ridge I)^{-1} Z^T Y",
    ),
    OperatorSpec(
        name="prototypes.ridge_fit_kernel",
        forward=ridge_fit_forward,
        backward=ridge_fit_backward,
        make_inputs=_ridge_inputs(4, 7, "kernel"),
        mirror=fast.ridge_fit_forward,
        mirror_backward=fast.ridge_fit_backward,
        paper="XML Eq. (2.8) / GSP (P3), kernel form V = Z^T (Z Z^T + ridge I)^{-1} Y",
    ),
)
