"""Fast-path mirror of the differentiable part of :mod:`refdml.histogram` (XML Sec. 2.1):
the entropic histogram (2.4) and the convex combination (2.3), NumPy or CuPy, float32 or
float64. ``histogram_lp`` and ``histogram_closed_form`` are validation only (no mirror).

Scores ``s = nu^T x`` are one batched matrix product of the features and the prototypes,
each divided by a power of two (0-d arrays, exact, no synchronisation); the logits are
``((inverse_temperature s') s_f) s_p`` as in the reference and the softmax over the
prototypes is the losses family's masked log-sum-exp (log-domain: finite in float32 at any
``inverse_temperature`` whose logits fit the dtype), its implementation chosen once per call
by :data:`refdml.gpu.losses.IMPLEMENTATIONS` (array path, CPU twin or CUDA kernel).
``ValueError`` where the logits overflow the dtype (one synchronisation on CuPy while data
checks are on). The context keeps the assignment: the backward is matrix products only.

The convex combination is the reference's xp-generic kernel (``convex_forward_xp`` /
``convex_backward_xp`` of :mod:`refdml._shared.histogram`), and so is the softmax backward
of the entropic histogram (``entropic_d_scores_xp``). The entropic forward is this
module's own: the log-domain masked softmax and batched products in place of the
reference's ``scipy.special.softmax`` and ``einsum`` (a different evaluation, and float32
needs the log domain); the backward's contractions are batched products for the same reason.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import (
    as_fast_array, check_context, check_fast_upstream, check_scalar, data_checks, result_dtype,
)
from refdml._backend import get_backend
from refdml.gpu.distances import common_scale
from refdml.gpu import losses as _losses
from refdml._shared.histogram import (
    convex_backward_xp,
    convex_forward_xp,
    entropic_d_scores_xp,
)
from refdml.histogram import (
    ConvexCombinationContext,
    ConvexCombinationGrads,
    HistogramEntropicContext,
    HistogramGrads,
)

__all__ = [
    "ConvexCombinationContext",
    "ConvexCombinationGrads",
    "HistogramEntropicContext",
    "HistogramGrads",
    "convex_combination",
    "convex_combination_backward",
    "convex_combination_forward",
    "histogram_entropic",
    "histogram_entropic_backward",
    "histogram_entropic_forward",
]


def _features_prototypes(features, prototypes):
    ns = get_backend(features, prototypes)
    dtype = result_dtype(features, prototypes) if hasattr(features, "dtype") and hasattr(
        prototypes, "dtype") else None
    features = as_fast_array(features, "features", ndim=3, dtype=dtype, ns=ns)
    prototypes = as_fast_array(prototypes, "prototypes", ndim=2, dtype=features.dtype, ns=ns)
    if features.shape[2] != prototypes.shape[1]:
        raise ValueError(
            "features and prototypes must have the same last dimension, got "
            f"features.shape={tuple(features.shape)}, prototypes.shape={tuple(prototypes.shape)}"
        )
    return ns, features, prototypes


def histogram_entropic_forward(features, prototypes, *, inverse_temperature):
    """Entropic histogram (2.4): ``z_i = (1/n) sum_j softmax_i(t nu_i^T x_j)`` with ``t`` the
    ``inverse_temperature``; ``(z, ctx)``.

    ``features (B, n, d)``, ``prototypes (m, d)`` -> ``z (B, m)``; ``inverse_temperature``
    is the paper's ε (varepsilon). See :func:`refdml.histogram.histogram_entropic_forward`.
    """
    ns, features, prototypes = _features_prototypes(features, prototypes)
    inverse_temperature = check_scalar(
        inverse_temperature, "inverse_temperature", low=0.0, low_inclusive=False
    )
    xp = ns.xp
    scale_f, scale_p = common_scale(xp, features), common_scale(xp, prototypes)
    scaled = (prototypes / scale_p) @ xp.swapaxes(features / scale_f, 1, 2)   # (B, m, n)
    with ns.errstate(over="ignore", divide="ignore"):
        logits = (inverse_temperature * scaled) * scale_f * scale_p
    if data_checks(ns) and not bool(xp.all(xp.isfinite(logits))):
        raise ValueError(
            f"inverse_temperature * nu^T x overflows {np.dtype(logits.dtype).name} "
            f"(inverse_temperature == {inverse_temperature:g})"
        )
    _, assignment = _losses.IMPLEMENTATIONS.choose(logits).masked_logsumexp(logits, axis=1)
    z = xp.mean(assignment, axis=2)
    return z, HistogramEntropicContext(features=features, prototypes=prototypes,
                                       assignment=assignment,
                                       inverse_temperature=inverse_temperature)


def histogram_entropic_backward(ctx: HistogramEntropicContext, d_z) -> HistogramGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d, summed over the batch)."""
    check_context(ctx, "ctx", HistogramEntropicContext)
    ns = get_backend(ctx.assignment)
    xp = ns.xp
    a = ctx.assignment
    batch, m, n = a.shape
    d_z = check_fast_upstream(d_z, "d_z", (batch, m), ns, a.dtype)
    d_scores = entropic_d_scores_xp(xp, ctx, d_z)
    d_features = xp.swapaxes(d_scores, 1, 2) @ ctx.prototypes
    d_prototypes = (
        xp.swapaxes(d_scores, 0, 1).reshape(m, batch * n) @ ctx.features.reshape(batch * n, -1)
    )
    return HistogramGrads(features=d_features, prototypes=d_prototypes)


def histogram_entropic(features, prototypes, *, inverse_temperature) -> Any:
    """The entropic histogram ``z`` (B, m) (no context kept)."""
    return histogram_entropic_forward(
        features, prototypes, inverse_temperature=inverse_temperature)[0]


def convex_combination_forward(z, prototypes):
    """Eq. (2.3): ``y_hat[b] = sum_k z[b, k] nu_k``, shape (B, d); ``(y_hat, ctx)``."""
    ns = get_backend(z, prototypes)
    dtype = result_dtype(z, prototypes) if hasattr(z, "dtype") and hasattr(
        prototypes, "dtype") else None
    z = as_fast_array(z, "z", ndim=2, dtype=dtype, ns=ns)
    prototypes = as_fast_array(prototypes, "prototypes", ndim=2, dtype=z.dtype, ns=ns)
    return convex_forward_xp(ns.xp, z, prototypes, check=data_checks(ns))


def convex_combination_backward(ctx: ConvexCombinationContext, d_y) -> ConvexCombinationGrads:
    """Gradients ``.z`` (B, m) and ``.prototypes`` (m, d); ``d_y`` of shape (B, d)."""
    check_context(ctx, "ctx", ConvexCombinationContext)
    ns = get_backend(ctx.z)
    d_y = check_fast_upstream(d_y, "d_y", (ctx.z.shape[0], ctx.prototypes.shape[1]), ns,
                              ctx.z.dtype)
    return convex_backward_xp(ns.xp, ctx, d_y, check=data_checks(ns))


def convex_combination(z, prototypes) -> Any:
    """``sum_k z_k nu_k`` per row of ``z`` (no context kept)."""
    return convex_combination_forward(z, prototypes)[0]
