"""Catalogue entries of :mod:`refdml.prototypes`: the ridge fit, in both forms.

Hard cases (``reference_inputs``): a near-singular system, a ridge far below and far above
the Gram matrix's scale, scales whose Gram matrix leaves the float64 / float32 range.
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    flat,
    replaced,
    scaled,
    truncated,
    with_nan,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu import prototypes as fast
from refdml.prototypes import ridge_fit_backward, ridge_fit_forward


def _ridge_inputs(n_samples: int, n_prototypes: int, form: str):
    def make(rng: np.random.Generator) -> dict:
        Z = rng.dirichlet(np.ones(n_prototypes), size=n_samples)
        Y = rng.standard_normal((n_samples, 3))
        return {"Z": Z, "Y": Y, "ridge": 0.3, "form": form}
    return make



# Conditioning: with Gram eigenvalues of order 1 and a null direction, ridge 1e-8 makes a
# system of condition ~1e8, beyond float32 (eps 6e-8) but comfortably inside float64.
_NEAR_SINGULAR_RIDGE = 1e-8


def _ridge_cases(n_samples: int, n_prototypes: int, form: str):
    make = _ridge_inputs(n_samples, n_prototypes, form)
    other = "kernel" if form == "primal" else "primal"

    def cases(rng: np.random.Generator) -> tuple[Case, ...]:
        inputs = make(rng)
        Z = np.array(inputs["Z"], copy=True)
        if form == "primal":
            # Two identical prototype columns: Z^T Z has a null direction.
            Z[:, 1] = Z[:, 0]
            rank_loss = "two identical prototype columns (Z^T Z singular)"
        else:
            # Two samples with the same histogram: Z Z^T has a null direction.
            Z[1] = Z[0]
            rank_loss = "two samples with the same histogram and different targets (Z Z^T singular)"
        return (
            Case("near-singular, tiny ridge", replaced(inputs, Z=Z, ridge=_NEAR_SINGULAR_RIDGE),
                 f"{rank_loss}, ridge 1e-8: condition ~1e8, so V is determined only to "
                 "~1e-8 relative in float64 and not at all in float32; the gradient with "
                 "respect to Z reaches 1 / ridge along the null direction. A solver that "
                 "drops the ridge, or inverts explicitly, is wrong here", dtypes=("float64",)),
            Case("ridge 1e-12", replaced(inputs, ridge=1e-12),
                 f"ridge far below the rounding level of the Gram matrix: the {form} system is "
                 f"well conditioned (full rank), the {other} one is singular, so an "
                 f"implementation that solves the {other} system returns rounding noise"),
            Case("ridge 1e8", replaced(inputs, ridge=1e8),
                 "the ridge dominates: V ~ Z^T Y / ridge ~ 1e-8; a ridge scaled differently "
                 "(ridge^2, ridge / b) is off by orders of magnitude here, not by a few "
                 "percent"),
            Case("huge scale", scaled(inputs, 1e170, "Z", "Y"),
                 "Z and Y of 1e170: the Gram matrix overflows float64 (inf, then NaN) in a "
                 "naive solve; V ~ 1 is the least-squares fit (ridge negligible) and the "
                 "gradients ~1e-170", dtypes=("float64",)),
            Case("float32 range edge", scaled(inputs, 4e19, "Z", "Y"),
                 "Z and Y of 4e19: the Gram matrix (~1e39) overflows float32 unless the "
                 "system is rescaled; V ~ 1 and the gradients ~1e-19 stay in range",
                 dtypes=("float32",)),
        )

    def errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
        inputs = make(rng)
        singular = np.zeros_like(inputs["Z"])
        singular[:, 0] = 1.0
        return (
            with_nan(inputs, "Z"),
            flat(inputs, "Z"),
            truncated(inputs, "Y"),
            bad_scalar(inputs, "ridge", 0.0, label="ridge exactly 0"),
            ErrorCase("form unknown", replaced(inputs, form="dual"), ValueError,
                      r"form == 'dual'"),
            ErrorCase("numerically singular", replaced(inputs, Z=singular, ridge=1e-300),
                      ValueError, r"numerically singular: ridge == 1e-300"),
        )

    return cases, errors


_PRIMAL_CASES, _PRIMAL_ERRORS = _ridge_cases(7, 4, "primal")
_KERNEL_CASES, _KERNEL_ERRORS = _ridge_cases(4, 7, "kernel")

OPERATORS = (
    OperatorSpec(
        name="prototypes.ridge_fit_primal",
        forward=ridge_fit_forward,
        backward=ridge_fit_backward,
        make_inputs=_ridge_inputs(7, 4, "primal"),
        mirror=fast.ridge_fit_forward,
        mirror_backward=fast.ridge_fit_backward,
        paper="XML Eq. (2.8), primal form V = (Z^T Z + ridge I)^{-1} Z^T Y",
        reference_inputs=_PRIMAL_CASES,
        error_inputs=_PRIMAL_ERRORS,
    ),
    OperatorSpec(
        name="prototypes.ridge_fit_kernel",
        forward=ridge_fit_forward,
        backward=ridge_fit_backward,
        make_inputs=_ridge_inputs(4, 7, "kernel"),
        mirror=fast.ridge_fit_forward,
        mirror_backward=fast.ridge_fit_backward,
        paper="XML Eq. (2.8) / GSP (P3), kernel form V = Z^T (Z Z^T + ridge I)^{-1} Y",
        reference_inputs=_KERNEL_CASES,
        error_inputs=_KERNEL_ERRORS,
    ),
)
