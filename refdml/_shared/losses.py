"""What the fast path shares with :mod:`refdml.losses` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.losses` validates hyperparameters and contexts with the reference's own
checks, and words its errors with the reference's messages, so that both paths refuse the
same inputs with the same ``ValueError``:

- ``check_reduction(reduction)``: one of ``REDUCTIONS``.
- ``check_contrastive_margins(form, pos_margin, neg_margin)``: the form's default margins
  for None, then their ranges.
- ``check_generalized_margins(alpha, beta)``: ASAP Eq. (4.2)'s ``beta >= alpha > 0``, the
  margins finite.
- ``check_multi_similarity(alpha, beta, base, mining_margin, reduction, n)``: the
  multi-similarity hyperparameters, checked, in the order of the forward's arguments.
- ``check_multi_similarity_scales(alpha, beta, n, dtype)``,
  ``check_proxy_anchor_scales(alpha, delta, n, dtype)``,
  ``check_proxy_nca_temperature(temperature, dtype)``,
  ``check_soft_triple_scales(lambda_, gamma, delta, dtype)``: the hyperparameters whose
  terms would lie beyond ``dtype``'s range, refused before any arithmetic.
- ``check_loss_context(ctx, cls, loss)``: a backward's context of the right class and loss.
- ``cosine_gradient_overflow(gradient, name, dtype_name)``: the message of a cosine loss's
  gradient beyond the dtype.
- ``finite_loss_message(loss, hyperparameters, dtype)``: the message of a cosine loss whose
  value or gradient overflows (its hyperparameters set its scale).
- ``hyperparameter_cause(loss, **hyperparameters)``: the cause, for that message, of a sum
  of terms beyond float64.
- ``hinge_cause(values, pos_margin, neg_margin)``: why a sum of contrastive hinge terms
  exceeds float64 (the margins or the distances, the larger).
- ``SOFT_TRIPLE_EPS``: the small constant under the square root of SoftTriple's
  regulariser (the authors' code), one number for both paths.
- ``COSINE_WHY``: the reason in the zero-row error of a cosine loss's embeddings.
- ``TWO_64``: ``2.0**64``, the power of two by which a sum of terms beyond float64 is
  rescaled before its mean is taken (the reduction's overflow rule).
"""

from __future__ import annotations

from refdml.losses._common import (
    _COSINE_WHY as COSINE_WHY,
    _TWO_64 as TWO_64,
    check_contrastive_margins,
    check_generalized_margins,
    check_loss_context,
    check_multi_similarity_scales,
    check_proxy_anchor_scales,
    check_proxy_nca_temperature,
    check_reduction,
    check_soft_triple_scales,
    cosine_gradient_overflow,
    finite_loss_message,
    hyperparameter_cause,
)
from refdml.losses._pair import _hinge_cause as hinge_cause, check_multi_similarity
from refdml.losses._proxy import _SOFT_TRIPLE_EPS as SOFT_TRIPLE_EPS

__all__ = [
    "COSINE_WHY",
    "SOFT_TRIPLE_EPS",
    "TWO_64",
    "check_contrastive_margins",
    "check_generalized_margins",
    "check_loss_context",
    "check_multi_similarity",
    "check_multi_similarity_scales",
    "check_proxy_anchor_scales",
    "check_proxy_nca_temperature",
    "check_reduction",
    "check_soft_triple_scales",
    "cosine_gradient_overflow",
    "finite_loss_message",
    "hinge_cause",
    "hyperparameter_cause",
]
