"""Catalogue entries of :mod:`refdml.prototypes`: the ridge fit, in both forms."""

from __future__ import annotations

import numpy as np

from refdml.gradcheck.catalog import OperatorSpec, register
from refdml.prototypes import ridge_fit_backward, ridge_fit_forward


def _ridge_inputs(n_samples: int, n_prototypes: int):
    def make(rng: np.random.Generator) -> dict:
        Z = rng.dirichlet(np.ones(n_prototypes), size=n_samples)
        Y = rng.standard_normal((n_samples, 3))
        return {"Z": Z, "Y": Y, "ridge": 0.3}
    return make


def _ridge_pair(form: str):
    def forward(Z, Y, ridge):
        return ridge_fit_forward(Z, Y, ridge=ridge, form=form)
    return forward


register(OperatorSpec(
    name="prototypes.ridge_fit_primal",
    forward=_ridge_pair("primal"),
    backward=ridge_fit_backward,
    make_inputs=_ridge_inputs(7, 4),
    paper="XML Eq. (2.8), primal form V = (Z^T Z + ridge I)^{-1} Z^T Y",
))
register(OperatorSpec(
    name="prototypes.ridge_fit_kernel",
    forward=_ridge_pair("kernel"),
    backward=ridge_fit_backward,
    make_inputs=_ridge_inputs(4, 7),
    paper="XML Eq. (2.8) / GSP (P3), kernel form V = Z^T (Z Z^T + ridge I)^{-1} Y",
))
