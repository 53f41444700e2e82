"""Catalogue entries of ``refdml.histogram``: the entropic histogram and the convex combination.

``histogram_lp`` and ``histogram_closed_form`` are validation only and piecewise constant
(no backward), so they have no entry.
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.gpu import histogram as fast
from refdml.histogram import (
    convex_combination_backward,
    convex_combination_forward,
    histogram_entropic_backward,
    histogram_entropic_forward,
)


def _entropic_inputs(rng: np.random.Generator) -> dict:
    return {
        "features": rng.standard_normal((2, 4, 3)),
        "prototypes": rng.standard_normal((3, 3)),
        "inverse_temperature": 2.0,
    }


def _combination_inputs(rng: np.random.Generator) -> dict:
    return {"z": rng.dirichlet(np.ones(3), size=2), "prototypes": rng.standard_normal((3, 4))}


OPERATORS = (
    OperatorSpec(
        name="histogram.entropic",
        forward=histogram_entropic_forward,
        backward=histogram_entropic_backward,
        make_inputs=_entropic_inputs,
        mirror=fast.histogram_entropic_forward,
        mirror_backward=fast.histogram_entropic_backward,
        paper="XML Eq. (2.4), softmax solution (constraint sum_i pi_ij = 1/n)",
        # Its softmax runs refdml.gpu._loss_kernels.masked_logsumexp (Numba kernels).
        mirror_kernels=("cpu", "cuda"),
    ),
    OperatorSpec(
        name="histogram.convex_combination",
        forward=convex_combination_forward,
        backward=convex_combination_backward,
        make_inputs=_combination_inputs,
        mirror=fast.convex_combination_forward,
        mirror_backward=fast.convex_combination_backward,
        paper="XML Eq. (2.3): y_hat = sum_k z_k nu_k",
    ),
)
