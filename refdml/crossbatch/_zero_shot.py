"""The zero-shot regulariser of GSP Sec. 4.3: Algorithm 4 and the printed Eq. (4.4), as pairs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import masked_logsumexp
from refdml._validation import (
    as_float_array,
    as_label_array,
    check_context,
    check_scalar,
    check_upstream,
)
from refdml.crossbatch._cross_fit import (
    CrossFitContext,
    cross_fit_backward_kernel,
    cross_fit_kernel,
)
from refdml.crossbatch._split import check_split

__all__ = [
    "DEFAULT_ZERO_SHOT_SCALE",
    "ZeroShotContext",
    "ZeroShotGrads",
    "ZeroShotPrintedContext",
    "zero_shot_loss",
    "zero_shot_loss_backward",
    "zero_shot_loss_forward",
    "zero_shot_loss_printed",
    "zero_shot_loss_printed_backward",
    "zero_shot_loss_printed_forward",
]

# Softmax scale of the authors' ZSR code (GSP); Algorithm 4 as printed has none.
DEFAULT_ZERO_SHOT_SCALE = 9.5


@dataclass(frozen=True)
class ZeroShotGrads:
    Z: np.ndarray
    class_embeddings: np.ndarray


@dataclass(frozen=True)
class _ZeroShotState:
    cross: CrossFitContext
    d_scores: np.ndarray          # dL/dS of S = scale P Upsilon^T, (b, c), taken in the forward
    scale: float
    predictions: np.ndarray       # P, (b, d)
    class_embeddings: np.ndarray  # Upsilon, (c, d)
    labels: np.ndarray


@dataclass(frozen=True)
class ZeroShotContext(_ZeroShotState):
    """Context of :func:`zero_shot_loss_forward` (the (b, c) softmax gradient is kept)."""


@dataclass(frozen=True)
class ZeroShotPrintedContext(_ZeroShotState):
    """Context of :func:`zero_shot_loss_printed_forward`."""


def _check_inputs(Z, labels, class_embeddings, ridge):
    Z = as_float_array(Z, "Z", ndim=2)
    class_embeddings = as_float_array(class_embeddings, "class_embeddings", ndim=2)
    labels = as_label_array(labels, "labels", length=Z.shape[0])
    n_classes = class_embeddings.shape[0]
    if labels.min() < 0 or labels.max() >= n_classes:
        bad = labels[(labels < 0) | (labels >= n_classes)][0]
        raise ValueError(
            f"labels contain {bad}, but class_embeddings has rows for classes 0..{n_classes - 1}"
        )
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    return Z, labels, class_embeddings, ridge


def _scores(Z, labels, class_embeddings, ridge, mask, scale):
    predictions, cross = cross_fit_kernel(Z, class_embeddings[labels], mask, ridge)
    with np.errstate(over="ignore", invalid="ignore"):
        scores = scale * (predictions @ class_embeddings.T)
    if not np.all(np.isfinite(scores)):
        raise ValueError(
            "the scores scale * Upsilon_hat Upsilon^T overflow float64 (max |class_embeddings| == "
            f"{np.abs(class_embeddings).max():.3g})"
        )
    return predictions, cross, scores


def _backward(ctx: _ZeroShotState, d_value: float) -> ZeroShotGrads:
    """Back from ``d_scores`` of ``scale * predictions @ class_embeddings.T``."""
    d_scores = d_value * ctx.d_scores
    d_pred = ctx.scale * d_scores @ ctx.class_embeddings
    d_classes = ctx.scale * d_scores.T @ ctx.predictions
    cross = cross_fit_backward_kernel(ctx.cross, d_pred)
    np.add.at(d_classes, ctx.labels, cross.targets)
    return ZeroShotGrads(Z=cross.Z, class_embeddings=d_classes)


def zero_shot_loss_forward(
    Z, labels, class_embeddings, *, ridge: float = 0.05, scale: float = DEFAULT_ZERO_SHOT_SCALE,
    split=None, rng=None,
) -> tuple[float, ZeroShotContext]:
    r"""Cross-batch zero-shot regularisation, GSP Sec. 4.3, (P3) and Algorithm 4.

    Paper (columns): ``A_k = Upsilon_k (Z_k^T Z_k + ϵ I)^{-1} Z_k^T`` with
    ``Upsilon_k = [upsilon_{y_i}]_{i in b_k}``, predictions ``Upsilon_hat_1 = A_2 Z_1``,
    ``Upsilon_hat_2 = A_1 Z_2``. Batch-first: ``A_k^T = ridge_fit(Z_k, Upsilon[labels_k], ridge)``
    (kernel form) and the prediction rows are ``Z_1 A_2^T``, ``Z_2 A_1^T``
    (:func:`cross_fit` with targets ``Upsilon[labels]``). Then

    .. math::

        S = s\, \hat\Upsilon \Upsilon^\top \in \mathbb{R}^{b \times c}, \qquad
        \mathcal{L} = \frac{1}{b} \sum_{i} \Big(\log \sum_{j=1}^c e^{S_{ij}} - S_{i y_i}\Big),

    the softmax cross-entropy of Algorithm 4 over all ``c`` class embeddings, averaged
    over the concatenated halves, with the scale ``s`` of the authors' code.

    Parameters
    ----------
    Z : array (b, m)
        Prototype marginals ``z`` (GSP Eq. 4.3), one row per sample.
    labels : int array (b,)
        Class labels in ``0 .. c-1``; at least two distinct classes.
    class_embeddings : array (c, d)
        The learnable ``Upsilon``, one row per class.
    ridge : float > 0
        Ridge weight, the paper's ϵ (epsilon) of GSP (P3) (0.05 in the paper).
    scale : float > 0
        Softmax scale (9.5 in the authors' code; Algorithm 4 as printed has 1).
    split, rng
        As in :func:`xml_loss`.

    Returns
    -------
    value : float
    ctx : ZeroShotContext
        For :func:`zero_shot_loss_backward`, which gives ``.Z`` (b, m) and
        ``.class_embeddings`` (c, d); the class embeddings receive gradient both as
        regression targets and as softmax weights.
    """
    Z, labels, class_embeddings, ridge = _check_inputs(Z, labels, class_embeddings, ridge)
    scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
    mask = check_split(split, labels, rng)
    b = Z.shape[0]
    predictions, cross, scores = _scores(Z, labels, class_embeddings, ridge, mask, scale)
    lse, softmax = masked_logsumexp(scores, axis=1)
    rows = np.arange(b)
    value = float(np.mean(lse - scores[rows, labels]))
    d_scores = softmax
    d_scores[rows, labels] -= 1.0
    d_scores /= b
    return value, ZeroShotContext(cross, d_scores, scale, predictions, class_embeddings, labels)


def zero_shot_loss_backward(ctx: ZeroShotContext, d_value=1.0) -> ZeroShotGrads:
    """Gradients ``.Z`` (b, m) and ``.class_embeddings`` (c, d) of ``d_value * L`` (scalar ``d_value``)."""
    check_context(ctx, "ctx", ZeroShotContext)
    return _backward(ctx, float(check_upstream(d_value, "d_value", ())))


def zero_shot_loss(Z, labels, class_embeddings, *, ridge: float = 0.05,
                   scale: float = DEFAULT_ZERO_SHOT_SCALE, split=None, rng=None
                   ) -> tuple[float, ZeroShotGrads]:
    """One call: ``(value, grads)`` of :func:`zero_shot_loss_forward` / ``_backward``."""
    value, ctx = zero_shot_loss_forward(Z, labels, class_embeddings, ridge=ridge, scale=scale,
                                        split=split, rng=rng)
    return value, zero_shot_loss_backward(ctx)


def zero_shot_loss_printed_forward(
    Z, labels, class_embeddings, *, ridge: float = 0.05, split=None, rng=None
) -> tuple[float, ZeroShotPrintedContext]:
    r"""GSP Eq. (4.4) exactly as printed; returns ``(value, ctx)``.

    .. math::

        \mathcal{L}_{ZS} = \frac{1}{|b_2|} \sum_{i \in b_2}
            \log\Big(1 + \sum_{j \in [c]} e^{(\upsilon_j - \upsilon_{y_i})^\top A_1 z_i}\Big)
          + \frac{1}{|b_1|} \sum_{i \in b_1}
            \log\Big(1 + \sum_{j \in [c]} e^{(\upsilon_j - \upsilon_{y_i})^\top A_2 z_i}\Big)

    ``A_1 z_i`` for ``i`` in half 2 is the cross prediction of :func:`zero_shot_loss`.
    Differences from Algorithm 4 (not a typo we correct, a different function): the
    inner sum includes ``j = y_i``, contributing ``e^0 = 1``, so each term is
    ``log(2 + sum_{j != y_i} e^{s_j - s_{y_i}})`` against the cross-entropy's
    ``log(1 + ...)``; each half is averaged separately (the sum of two means, against
    one mean over the batch); and there is no scale. Computed stably as the
    log-sum-exp over ``c + 1`` logits (the ``c`` scores and a second copy of
    ``s_{y_i}``) minus ``s_{y_i}``.

    Parameters as in :func:`zero_shot_loss_forward` (without ``scale``).
    """
    Z, labels, class_embeddings, ridge = _check_inputs(Z, labels, class_embeddings, ridge)
    mask = check_split(split, labels, rng)
    rows = np.arange(Z.shape[0])
    predictions, cross, scores = _scores(Z, labels, class_embeddings, ridge, mask, 1.0)
    true_scores = scores[rows, labels]
    augmented = np.concatenate([scores, true_scores[:, None]], axis=1)
    lse, prob = masked_logsumexp(augmented, axis=1)
    per_sample = lse - true_scores
    weight = np.where(mask, 1.0 / np.count_nonzero(mask), 1.0 / np.count_nonzero(~mask))
    value = float(np.sum(weight * per_sample))
    d_scores = prob[:, :-1].copy()
    # s_{y_i} appears as the extra logit and is subtracted once.
    d_scores[rows, labels] += prob[:, -1] - 1.0
    d_scores *= weight[:, None]
    return value, ZeroShotPrintedContext(cross, d_scores, 1.0, predictions, class_embeddings, labels)


def zero_shot_loss_printed_backward(ctx: ZeroShotPrintedContext, d_value=1.0) -> ZeroShotGrads:
    """Gradients ``.Z`` (b, m) and ``.class_embeddings`` (c, d) of ``d_value * L_ZS`` (Eq. 4.4)."""
    check_context(ctx, "ctx", ZeroShotPrintedContext)
    return _backward(ctx, float(check_upstream(d_value, "d_value", ())))


def zero_shot_loss_printed(Z, labels, class_embeddings, *, ridge: float = 0.05, split=None,
                           rng=None) -> tuple[float, ZeroShotGrads]:
    """One call: ``(value, grads)`` of :func:`zero_shot_loss_printed_forward` / ``_backward``."""
    value, ctx = zero_shot_loss_printed_forward(Z, labels, class_embeddings, ridge=ridge,
                                                split=split, rng=rng)
    return value, zero_shot_loss_printed_backward(ctx)
