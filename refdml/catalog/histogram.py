"""Catalogue entries of ``refdml.histogram``: the entropic histogram and the convex combination.

``histogram_lp`` and ``histogram_closed_form`` are validation only and piecewise constant
(no backward), so they have no entry.
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    bad_type,
    replaced,
    scaled,
    with_inf,
    with_nan,
    without_axis,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu import histogram as fast
from refdml.gpu import losses as fast_losses
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


def _tied_prototypes(rng: np.random.Generator) -> dict:
    # Prototype 2 duplicates prototype 0: equal scores for every feature.
    inputs = _entropic_inputs(rng)
    inputs["prototypes"][2] = inputs["prototypes"][0]
    return inputs


def _entropic_reference_inputs(rng: np.random.Generator) -> tuple[Case, ...]:
    base = _entropic_inputs(rng)
    return (
        Case("large inverse temperature (1e6)", replaced(base, inverse_temperature=1e6),
             "exp(ε s) overflows: a softmax without its max subtracted gives inf / inf = "
             "NaN; the reference's assignment is one-hot and its gradient ~0"),
        Case("small inverse temperature (1e-8)", replaced(base, inverse_temperature=1e-8),
             "z is uniform to ~1e-8: an implementation that drops ε (or clamps it) returns "
             "the wrong deviation from 1/m, and the gradient scales as ε"),
        Case("duplicate prototypes at a large inverse temperature",
             replaced(_tied_prototypes(rng), inverse_temperature=1e6),
             "two prototypes tie on every feature: the softmax splits their mass equally "
             "even when sharp; a hard argmax (or a tie-break) gives one of them all of it"),
        Case("duplicate prototypes", _tied_prototypes(rng),
             "exact ties of the scores at a moderate ε: the two tied rows of z and of the "
             "prototypes' gradient must be equal"),
        Case("scores beyond float64 at a tiny inverse temperature",
             replaced(scaled(base, 1e155, "features"), prototypes=1e154 * base["prototypes"],
                      inverse_temperature=2.5e-308),
             "nu^T x ~ 1e309 overflows float64 while ε nu^T x ~ 25 does not: forming the "
             "scores before multiplying by ε gives inf and NaN", dtypes=("float64",)),
        Case("float32 edge: scores beyond float32",
             replaced(scaled(base, 1e20, "features"), prototypes=1e19 * base["prototypes"],
                      inverse_temperature=1e-38),
             "in float32 nu^T x ~ 1e39 overflows (max 3.4e38) while ε nu^T x ~ 10 is "
             "representable", dtypes=("float32",)),
    )


def _entropic_error_inputs(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    base = _entropic_inputs(rng)
    return (
        with_nan(base, "features"),
        with_inf(base, "prototypes"),
        without_axis(base, "features"),
        ErrorCase("last dimensions differ", replaced(base, prototypes=np.ones((3, 4))),
                  ValueError, r"^features and prototypes must have the same last dimension"),
        bad_scalar(base, "inverse_temperature", 0.0),
        bad_scalar(base, "inverse_temperature", -2.0),
        bad_scalar(base, "inverse_temperature", float("inf")),
        bad_type(base, "inverse_temperature", "2.0"),
        ErrorCase("ε nu^T x beyond float64",
                  replaced(scaled(base, 1e200, "features"), prototypes=1e200 * base["prototypes"],
                           inverse_temperature=1e10),
                  ValueError, r"^inverse_temperature \* nu\^T x overflows float64"),
    )


def _simplex_residuals(z: np.ndarray) -> dict:
    """``z`` (B, m) in the simplex: rows sum to 1, entries >= 0."""
    return {"rows sum to 1": float(np.max(np.abs(z.sum(axis=-1) - 1.0))),
            "non-negative": float(max(0.0, -np.min(z)))}


def _entropic_invariants(inputs, outputs) -> dict:
    return _simplex_residuals(np.asarray(outputs[0], dtype=np.float64))


def _combination_reference_inputs(rng: np.random.Generator) -> tuple[Case, ...]:
    base = _combination_inputs(rng)
    vertices = np.zeros((2, 3))
    vertices[0, 2] = vertices[1, 0] = 1.0
    opposite = np.array([[100.0, -99.0, 0.0], [-99.0, 100.0, 0.0]])
    equal_rows = np.tile(1e307 * np.array([[0.5, -0.25, 0.75, -1.0]]), (3, 1))
    f32_rows = np.tile(1e37 * np.array([[0.5, -0.25, 0.75, -1.0]]), (3, 1))
    return (
        Case("vertices of the simplex", replaced(base, z=vertices),
             "one-hot histograms (the LP's solution): y_hat is exactly a prototype, and "
             "the gradient of the zero weights is still d_y . nu_k, not 0"),
        Case("zeros on the simplex's boundary",
             replaced(base, z=np.array([[0.5, 0.0, 0.5], [0.0, 0.25, 0.75]])),
             "exact zero weights: an implementation that works in log(z) gives -inf"),
        Case("huge prototypes (1e300)", scaled(base, 1e300, "prototypes"),
             "a histogram's combination is bounded by max |nu| ~ 1e300: representable "
             "whatever the order of the sum", dtypes=("float64",)),
        Case("weights of opposite signs near float64's maximum",
             {"z": opposite, "prototypes": equal_rows},
             "100 nu_0 overflows float64 while y_hat = 100 nu_0 - 99 nu_1 ~ 1e307 does not "
             "(any real weights are accepted): the plain product is inf", dtypes=("float64",)),
        Case("float32 edge: opposite signs near float32's maximum",
             {"z": np.array([[50.0, -49.0, 0.0], [0.0, -49.0, 50.0]]), "prototypes": f32_rows},
             "50 nu_0 ~ 5e38 overflows float32 while y_hat ~ 1e37 does not",
             dtypes=("float32",)),
    )


def _combination_error_inputs(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    base = _combination_inputs(rng)
    return (
        with_nan(base, "z"),
        with_inf(base, "prototypes"),
        ErrorCase("z flattened to 1-d", replaced(base, z=base["z"].ravel()), ValueError,
                  r"^z must have 2 dimensions"),
        ErrorCase("z and prototypes disagree on m", replaced(base, prototypes=np.ones((4, 4))),
                  ValueError, r"^z has 3 weights per row but there are 4 prototypes"),
        ErrorCase("y_hat beyond float64",
                  replaced(base, z=np.full((2, 3), 1e10), prototypes=np.full((3, 4), 1e300)),
                  ValueError, r"^y_hat = z @ prototypes overflows float64"),
        bad_type(base, "z", np.ones((2, 3), dtype=bool), "z boolean"),
    )


def _combination_invariants(inputs, outputs) -> dict:
    """For a histogram ``z``, ``y_hat`` lies in the prototypes' bounding box (a convex
    combination); other weights carry no constraint (residual 0)."""
    z = np.asarray(inputs["z"], dtype=np.float64)
    prototypes = np.asarray(inputs["prototypes"], dtype=np.float64)
    y_hat = np.asarray(outputs[0], dtype=np.float64)
    histogram = np.all(z >= 0.0, axis=1) & (np.abs(z.sum(axis=1) - 1.0) <= 1e-12)
    low, high = prototypes.min(axis=0), prototypes.max(axis=0)
    scale = np.maximum(np.maximum(np.abs(low), np.abs(high)), np.finfo(np.float64).tiny)
    outside = np.maximum(low - y_hat, 0.0) + np.maximum(y_hat - high, 0.0)
    return {"in the prototypes' box": float(np.max(outside / scale, where=histogram[:, None],
                                                   initial=0.0))}


OPERATORS = (
    OperatorSpec(
        name="histogram.entropic",
        forward=histogram_entropic_forward,
        backward=histogram_entropic_backward,
        make_inputs=_entropic_inputs,
        mirror=fast.histogram_entropic_forward,
        mirror_backward=fast.histogram_entropic_backward,
        paper="XML Eq. (2.4), softmax solution (constraint sum_i pi_ij = 1/n)",
        reference_inputs=_entropic_reference_inputs,
        error_inputs=_entropic_error_inputs,
        invariants=_entropic_invariants,
        # Its softmax is the losses family's masked log-sum-exp (Numba kernels).
        kernel_family=fast_losses.IMPLEMENTATIONS,   # the masked log-sum-exp
    ),
    OperatorSpec(
        name="histogram.convex_combination",
        forward=convex_combination_forward,
        backward=convex_combination_backward,
        make_inputs=_combination_inputs,
        mirror=fast.convex_combination_forward,
        mirror_backward=fast.convex_combination_backward,
        paper="XML Eq. (2.3): y_hat = sum_k z_k nu_k",
        reference_inputs=_combination_reference_inputs,
        error_inputs=_combination_error_inputs,
        invariants=_combination_invariants,
    ),
)
