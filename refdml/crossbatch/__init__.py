"""Cross-batch regularisers: the XML loss (XML Eqs. 2.10-2.11) and the zero-shot loss (GSP 4.3).

Both split a batch into two halves with disjoint class sets, fit a ridge predictor
(:func:`refdml.prototypes.ridge_fit`) on each half, and score the predictions it makes
for the *other* half. Arrays are batch-first: histograms ``Z`` (b, m), embeddings ``Y``
(b, d), class embeddings ``Upsilon`` (c, d); the papers write the transposes. The keyword
``ridge`` is the ridge weight of the fits, the paper's ϵ (epsilon) of XML Eq. 2.8 / GSP (P3).

``cross_fit`` (``_cross_fit.py``): ``P[i] = Z[i] V_2`` for ``i`` in half 1 and
    ``Z[i] V_1`` for ``i`` in half 2, ``V_k = ridge_fit(Z_k, T_k, ridge)``.
``xml_loss`` (``_xml.py``): ``(1 - lambda_) L_DML(Y) + lambda_ (L(Y_hat_1) + L(Y_hat_2))``
    (Eqs. 2.10, 2.11).
``zero_shot_loss`` (``_zero_shot.py``): softmax cross-entropy of
    ``scale * Upsilon_hat Upsilon^T`` with the labels, averaged over the whole batch
    (GSP Algorithm 4).
``zero_shot_loss_printed`` (``_zero_shot.py``): the printed GSP Eq. (4.4), a different
    function (see there).
``class_disjoint_split`` (``_split.py``): the random class-disjoint split both losses use.

Every differentiable operator is a pair ``op_forward`` / ``op_backward``; the one-call
forms (``cross_fit -> P``, the losses ``-> (value, grads)``) are thin wrappers.

Paper notes (details in ``docs/prototypes.md``):

* XML prints ``Y_hat_1 = V_2 Z_1`` and, in the same paragraph, the prototypes both as
  ``(Z Z^T + ϵ I)^{-1} Z Y^T`` (``m x d``) and as ``Y (Z^T Z + ϵ I)^{-1} Z^T``
  (``d x m``): one is the transpose of the other. Batch-first, both are ``V`` (m, d)
  and the predictions are ``Z_1 V_2``. The fits use ``ridge`` (as in Eq. 2.10's
  paragraph), not the ``ridge / 2`` of the decomposition (2.9).
* GSP Eq. (4.4) sums ``j`` over all classes including ``j = y_i`` (a term ``e^0 = 1``),
  so it equals ``log(2 + sum_{j != y_i} ...)`` where the cross-entropy has
  ``log(1 + sum_{j != y_i} ...)``; it averages each half separately where Algorithm 4
  averages over the concatenation; and it has no scale, which the authors' code sets
  to 9.5 (its ridge weight is ``ϵ = 0.05``, as in Algorithm 4).
"""

from refdml.crossbatch._cross_fit import (
    CrossFitContext,
    CrossFitGrads,
    cross_fit,
    cross_fit_backward,
    cross_fit_forward,
)
from refdml.crossbatch._split import class_disjoint_split
from refdml.crossbatch._xml import XMLContext, XMLGrads, xml_loss, xml_loss_backward, xml_loss_forward
from refdml.crossbatch._zero_shot import (
    DEFAULT_ZERO_SHOT_SCALE,
    ZeroShotContext,
    ZeroShotGrads,
    ZeroShotPrintedContext,
    zero_shot_loss,
    zero_shot_loss_backward,
    zero_shot_loss_forward,
    zero_shot_loss_printed,
    zero_shot_loss_printed_backward,
    zero_shot_loss_printed_forward,
)

__all__ = [
    "DEFAULT_ZERO_SHOT_SCALE",
    "CrossFitContext",
    "CrossFitGrads",
    "XMLContext",
    "XMLGrads",
    "ZeroShotContext",
    "ZeroShotGrads",
    "ZeroShotPrintedContext",
    "class_disjoint_split",
    "cross_fit",
    "cross_fit_backward",
    "cross_fit_forward",
    "xml_loss",
    "xml_loss_backward",
    "xml_loss_forward",
    "zero_shot_loss",
    "zero_shot_loss_backward",
    "zero_shot_loss_forward",
    "zero_shot_loss_printed",
    "zero_shot_loss_printed_backward",
    "zero_shot_loss_printed_forward",
]
