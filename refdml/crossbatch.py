"""Cross-batch regularisers: the XML loss (XML Eqs. 2.10-2.11) and the zero-shot loss (GSP 4.3).

Both split a batch into two halves with disjoint class sets, fit a ridge predictor
(:func:`refdml.prototypes.ridge_fit`) on each half, and score the predictions it makes
for the *other* half. Arrays are batch-first: histograms ``Z`` (b, m), embeddings ``Y``
(b, d), class embeddings ``Upsilon`` (c, d); the papers write the transposes.

``cross_fit``: ``P[i] = Z[i] V_2`` for ``i`` in half 1 and ``Z[i] V_1`` for ``i`` in half 2,
    ``V_k = ridge_fit(Z_k, T_k, eps)``; a forward/backward pair shared by both losses.
``xml_loss``: ``(1 - lam) L_DML(Y) + lam (L(Y_hat_1) + L(Y_hat_2))`` (Eqs. 2.10, 2.11).
``zero_shot_loss``: softmax cross-entropy of ``scale * Upsilon_hat Upsilon^T`` with the
    labels, averaged over the whole batch (GSP Algorithm 4).
``zero_shot_loss_printed``: the printed GSP Eq. (4.4), a different function (see there).
``class_disjoint_split``: the random class-disjoint split both losses use.

Paper notes (details in ``docs/prototypes.md``):

* XML prints ``Y_hat_1 = V_2 Z_1`` and, in the same paragraph, the prototypes both as
  ``(Z Z^T + eps I)^{-1} Z Y^T`` (``m x d``) and as ``Y (Z^T Z + eps I)^{-1} Z^T``
  (``d x m``): one is the transpose of the other. Batch-first, both are ``V`` (m, d)
  and the predictions are ``Z_1 V_2``. The fits use ``eps`` (as in Eq. 2.10's
  paragraph), not the ``eps / 2`` of the decomposition (2.9).
* GSP Eq. (4.4) sums ``j`` over all classes including ``j = y_i`` (a term ``e^0 = 1``),
  so it equals ``log(2 + sum_{j != y_i} ...)`` where the cross-entropy has
  ``log(1 + sum_{j != y_i} ...)``; it averages each half separately where Algorithm 4
  averages over the concatenation; and it has no scale, which the authors' code sets
  to 9.5 (its ridge weight is ``eps = 0.05``, as in Algorithm 4).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    as_float_array,
    as_label_array,
    check_rng,
    check_same_length,
    check_scalar,
)
from refdml.gradcheck.registry import OperatorSpec, register
from refdml.prototypes import RidgeContext, _ridge_backward, _ridge_forward

__all__ = [
    "CrossFitContext",
    "CrossFitGrads",
    "XMLGrads",
    "ZeroShotGrads",
    "class_disjoint_split",
    "cross_fit",
    "cross_fit_backward",
    "cross_fit_forward",
    "xml_loss",
    "zero_shot_loss",
    "zero_shot_loss_printed",
]

# Softmax scale of the authors' ZSR code (GSP); Algorithm 4 as printed has none.
DEFAULT_ZERO_SHOT_SCALE = 9.5


@dataclass(frozen=True)
class CrossFitGrads:
    Z: np.ndarray
    targets: np.ndarray


@dataclass(frozen=True)
class CrossFitContext:
    Z: np.ndarray
    first: np.ndarray        # indices of half 1
    second: np.ndarray       # indices of half 2
    fit_first: RidgeContext  # V_1 fitted on half 1
    fit_second: RidgeContext


@dataclass(frozen=True)
class XMLGrads:
    Z: np.ndarray
    Y: np.ndarray


@dataclass(frozen=True)
class ZeroShotGrads:
    Z: np.ndarray
    class_embeddings: np.ndarray


# --------------------------------------------------------------------------- the split


def class_disjoint_split(labels, *, rng=None) -> np.ndarray:
    """A boolean mask over the batch: ``True`` = half 1, ``False`` = half 2.

    The classes are visited in a random order (from ``rng``) and each is put whole into
    the half that has fewer samples so far, so the halves are class-disjoint, cover the
    batch, both non-empty and balanced in size up to the largest class. Deterministic
    given ``labels`` and ``rng``. Fewer than two classes: ValueError.
    """
    labels = as_label_array(labels, "labels")
    return _draw_split(labels, check_rng(rng))


def _draw_split(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    classes, counts = np.unique(labels, return_counts=True)
    if classes.size < 2:
        raise ValueError(
            f"labels contain {classes.size} class(es); a batch with fewer than two classes "
            "cannot be split into two class-disjoint halves"
        )
    sizes = [0, 0]
    in_first = np.zeros(classes.size, dtype=bool)
    for k in rng.permutation(classes.size):
        half = 0 if sizes[0] <= sizes[1] else 1
        in_first[k] = half == 0
        sizes[half] += counts[k]
    return np.isin(labels, classes[in_first])


def _check_split(split, labels: np.ndarray, rng) -> np.ndarray:
    if split is None:
        return _draw_split(labels, check_rng(rng))
    mask = np.asarray(split)
    if mask.dtype != bool:
        raise TypeError(f"split must be a boolean mask over the batch, got dtype {mask.dtype}")
    if mask.shape != labels.shape:
        raise ValueError(f"split has shape {mask.shape}, expected {labels.shape} (one per sample)")
    if mask.all() or not mask.any():
        raise ValueError("split leaves one half empty; both halves need samples")
    shared = np.intersect1d(labels[mask], labels[~mask])
    if shared.size:
        raise ValueError(f"split is not class-disjoint: classes {shared.tolist()} are in both halves")
    return mask.copy()


# --------------------------------------------------------------------------- cross fit


def _cross_fit_forward(Z: np.ndarray, targets: np.ndarray, mask: np.ndarray, eps: float):
    first, second = np.flatnonzero(mask), np.flatnonzero(~mask)
    V1, fit_first = _ridge_forward(Z[first], targets[first], eps, "auto")
    V2, fit_second = _ridge_forward(Z[second], targets[second], eps, "auto")
    predictions = np.empty((Z.shape[0], targets.shape[1]))
    predictions[first] = Z[first] @ V2
    predictions[second] = Z[second] @ V1
    return predictions, CrossFitContext(Z, first, second, fit_first, fit_second)


def _cross_fit_backward(ctx: CrossFitContext, d_pred: np.ndarray) -> CrossFitGrads:
    first, second = ctx.first, ctx.second
    V1, V2 = ctx.fit_first.V, ctx.fit_second.V
    d_first, d_second = d_pred[first], d_pred[second]
    d_Z = np.empty_like(ctx.Z)
    d_targets = np.empty_like(d_pred)
    # Half 1 enters through its prediction Z_1 V_2 and through the fit V_1 that half 2 uses.
    from_V1 = _ridge_backward(ctx.fit_first, ctx.Z[second].T @ d_second)
    from_V2 = _ridge_backward(ctx.fit_second, ctx.Z[first].T @ d_first)
    d_Z[first] = d_first @ V2.T + from_V1.Z
    d_Z[second] = d_second @ V1.T + from_V2.Z
    d_targets[first] = from_V1.Y
    d_targets[second] = from_V2.Y
    return CrossFitGrads(Z=d_Z, targets=d_targets)


def cross_fit_forward(Z, targets, split, *, eps) -> tuple[np.ndarray, CrossFitContext]:
    """Cross predictions ``P`` (b, d); returns ``(P, ctx)``.

    ``P[i] = Z[i] V_2`` for ``split[i]`` and ``Z[i] V_1`` otherwise, with
    ``V_k = ridge_fit(Z[half k], targets[half k], eps=eps)``. ``split`` is a boolean
    mask with both halves non-empty (class-disjointness is the caller's business).
    """
    Z = as_float_array(Z, "Z", ndim=2)
    targets = as_float_array(targets, "targets", ndim=2)
    check_same_length(Z, "Z", targets, "targets")
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    mask = np.asarray(split)
    if mask.dtype != bool:
        raise TypeError(f"split must be a boolean mask over the batch, got dtype {mask.dtype}")
    if mask.shape != (Z.shape[0],):
        raise ValueError(f"split has shape {mask.shape}, expected ({Z.shape[0]},) (one per sample)")
    if mask.all() or not mask.any():
        raise ValueError("split leaves one half empty; both halves need samples")
    return _cross_fit_forward(Z, targets, mask, eps)


def cross_fit_backward(ctx: CrossFitContext, d_predictions) -> CrossFitGrads:
    """Gradients ``.Z`` (b, m) and ``.targets`` (b, d) of ``<d_predictions, P>``."""
    return _cross_fit_backward(ctx, np.asarray(d_predictions, dtype=np.float64))


def cross_fit(Z, targets, split, *, eps) -> np.ndarray:
    """Cross predictions (no context kept); see :func:`cross_fit_forward`."""
    return cross_fit_forward(Z, targets, split, eps=eps)[0]


# --------------------------------------------------------------------------- XML loss


def _default_base_loss() -> Callable[..., Any]:
    from refdml.losses import contrastive

    return contrastive


def _apply_base_loss(base_loss, embeddings, labels, kwargs) -> tuple[float, np.ndarray]:
    value, grads = base_loss(embeddings, labels, **kwargs)
    d_embeddings = np.asarray(grads.embeddings, dtype=np.float64)
    if d_embeddings.shape != embeddings.shape:
        raise ValueError(
            f"base_loss returned a gradient of shape {d_embeddings.shape} for embeddings of "
            f"shape {embeddings.shape}"
        )
    return float(value), d_embeddings


def xml_loss(
    Z,
    Y,
    labels,
    *,
    eps,
    base_loss: Callable[..., Any] | None = None,
    base_loss_kwargs: Mapping[str, Any] | None = None,
    split=None,
    rng=None,
    lam: float = 1.0,
) -> tuple[float, XMLGrads]:
    r"""Cross-batch metric learning loss, XML Eqs. (2.10)-(2.11).

    .. math::

        V_k = \arg\min_V \|Z_k V - Y_k\|_F^2 + \varepsilon \|V\|_F^2, \quad
        \hat Y_1 = Z_1 V_2, \quad \hat Y_2 = Z_2 V_1,

        \mathcal{L} = (1 - \lambda)\, \ell(Y, L)
                      + \lambda \big(\ell(\hat Y_1, L_1) + \ell(\hat Y_2, L_2)\big),

    where ``(Z_k, Y_k, L_k)`` are the two class-disjoint halves and ``ell`` the base loss.
    With the default ``lam = 1`` the value is ``L_XML`` alone (and the base loss is not
    evaluated on ``Y``); ``lam = 0`` gives ``L_DML`` alone.

    Parameters
    ----------
    Z : array (b, m)
        Histograms (XML Eq. 2.4), one row per sample.
    Y : array (b, d)
        Embeddings (GAP representations).
    labels : int array (b,)
        Class labels; at least two classes.
    eps : float > 0
        Ridge weight of each half's fit.
    base_loss : callable, optional
        ``value, grads = base_loss(embeddings, labels, **base_loss_kwargs)`` with
        ``grads.embeddings``; any loss of :mod:`refdml.losses`. Default
        :func:`refdml.losses.contrastive`.
    base_loss_kwargs : mapping, optional
        Keyword arguments of the base loss.
    split : bool array (b,), optional
        Fixes the halves (``True`` = half 1); must be class-disjoint. Default: drawn by
        :func:`class_disjoint_split` from ``rng``.
    rng : None, int or numpy.random.Generator
        Draws the split when ``split`` is None.
    lam : float in [0, 1]
        The ``lambda`` of Eq. (2.11).

    Returns
    -------
    value : float
    grads : XMLGrads
        ``.Z`` (b, m) and ``.Y`` (b, d), through the closed-form fits.
    """
    Z = as_float_array(Z, "Z", ndim=2)
    Y = as_float_array(Y, "Y", ndim=2)
    check_same_length(Z, "Z", Y, "Y")
    labels = as_label_array(labels, "labels", length=Z.shape[0])
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    lam = check_scalar(lam, "lam", low=0.0, high=1.0)
    if base_loss is None:
        base_loss = _default_base_loss()
    elif not callable(base_loss):
        raise TypeError(f"base_loss must be callable, got {base_loss!r}")
    kwargs = dict(base_loss_kwargs or {})
    mask = _check_split(split, labels, rng)

    value = 0.0
    d_Y = np.zeros_like(Y)
    d_Z = np.zeros_like(Z)
    if lam > 0.0:
        predictions, ctx = _cross_fit_forward(Z, Y, mask, eps)
        d_pred = np.empty_like(predictions)
        for half in (mask, ~mask):
            half_value, half_grad = _apply_base_loss(base_loss, predictions[half], labels[half], kwargs)
            value += lam * half_value
            d_pred[half] = lam * half_grad
        cross = _cross_fit_backward(ctx, d_pred)
        d_Z += cross.Z
        d_Y += cross.targets
    if lam < 1.0:
        dml_value, dml_grad = _apply_base_loss(base_loss, Y, labels, kwargs)
        value += (1.0 - lam) * dml_value
        d_Y += (1.0 - lam) * dml_grad
    return value, XMLGrads(Z=d_Z, Y=d_Y)


# --------------------------------------------------------------------------- zero-shot loss


def _check_zero_shot_inputs(Z, labels, class_embeddings, eps):
    Z = as_float_array(Z, "Z", ndim=2)
    class_embeddings = as_float_array(class_embeddings, "class_embeddings", ndim=2)
    labels = as_label_array(labels, "labels", length=Z.shape[0])
    n_classes = class_embeddings.shape[0]
    if labels.min() < 0 or labels.max() >= n_classes:
        bad = labels[(labels < 0) | (labels >= n_classes)][0]
        raise ValueError(
            f"labels contain {bad}, but class_embeddings has rows for classes 0..{n_classes - 1}"
        )
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    return Z, labels, class_embeddings, eps


def _log_softmax_rows(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def zero_shot_loss(
    Z,
    labels,
    class_embeddings,
    *,
    eps: float = 0.05,
    scale: float = DEFAULT_ZERO_SHOT_SCALE,
    split=None,
    rng=None,
) -> tuple[float, ZeroShotGrads]:
    r"""Cross-batch zero-shot regularisation, GSP Sec. 4.3, (P3) and Algorithm 4.

    Paper (columns): ``A_k = Upsilon_k (Z_k^T Z_k + eps I)^{-1} Z_k^T`` with
    ``Upsilon_k = [upsilon_{y_i}]_{i in b_k}``, predictions ``Upsilon_hat_1 = A_2 Z_1``,
    ``Upsilon_hat_2 = A_1 Z_2``. Batch-first: ``A_k^T = ridge_fit(Z_k, Upsilon[labels_k], eps)``
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
    eps : float > 0
        Ridge weight (0.05 in the paper).
    scale : float > 0
        Softmax scale (9.5 in the authors' code; Algorithm 4 as printed has 1).
    split, rng
        As in :func:`xml_loss`.

    Returns
    -------
    value : float
    grads : ZeroShotGrads
        ``.Z`` (b, m) and ``.class_embeddings`` (c, d); the class embeddings receive
        gradient both as regression targets and as softmax weights.
    """
    Z, labels, class_embeddings, eps = _check_zero_shot_inputs(Z, labels, class_embeddings, eps)
    scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
    mask = _check_split(split, labels, rng)
    b = Z.shape[0]

    predictions, ctx = _cross_fit_forward(Z, class_embeddings[labels], mask, eps)
    logits = scale * predictions @ class_embeddings.T
    log_prob = _log_softmax_rows(logits)
    rows = np.arange(b)
    value = -float(np.mean(log_prob[rows, labels]))

    d_logits = np.exp(log_prob)
    d_logits[rows, labels] -= 1.0
    d_logits /= b
    return value, _zero_shot_backward(ctx, d_logits, scale, predictions, class_embeddings, labels)


def _zero_shot_backward(ctx, d_scores, scale, predictions, class_embeddings, labels) -> ZeroShotGrads:
    """Back from ``d_scores`` of ``scale * predictions @ class_embeddings.T``."""
    d_pred = scale * d_scores @ class_embeddings
    d_classes = scale * d_scores.T @ predictions
    cross = _cross_fit_backward(ctx, d_pred)
    np.add.at(d_classes, labels, cross.targets)
    return ZeroShotGrads(Z=cross.Z, class_embeddings=d_classes)


def zero_shot_loss_printed(
    Z, labels, class_embeddings, *, eps: float = 0.05, split=None, rng=None
) -> tuple[float, ZeroShotGrads]:
    r"""GSP Eq. (4.4) exactly as printed.

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

    Parameters and returns as in :func:`zero_shot_loss` (without ``scale``).
    """
    Z, labels, class_embeddings, eps = _check_zero_shot_inputs(Z, labels, class_embeddings, eps)
    mask = _check_split(split, labels, rng)
    b = Z.shape[0]
    rows = np.arange(b)

    predictions, ctx = _cross_fit_forward(Z, class_embeddings[labels], mask, eps)
    scores = predictions @ class_embeddings.T
    true_scores = scores[rows, labels]
    augmented = np.concatenate([scores, true_scores[:, None]], axis=1)
    log_prob = _log_softmax_rows(augmented)
    per_sample = -log_prob[:, -1]  # logsumexp(augmented) - s_{y_i}
    weight = np.where(mask, 1.0 / np.count_nonzero(mask), 1.0 / np.count_nonzero(~mask))
    value = float(np.sum(weight * per_sample))

    prob = np.exp(log_prob)
    d_scores = prob[:, :-1]
    # s_{y_i} appears as the extra logit and is subtracted once.
    d_scores[rows, labels] += prob[:, -1] - 1.0
    d_scores *= weight[:, None]
    return value, _zero_shot_backward(ctx, d_scores, 1.0, predictions, class_embeddings, labels)


# --------------------------------------------------------------------------- registry


def _labels_two_per_class(n_classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.repeat(np.arange(n_classes), 2))


def _cross_fit_inputs(rng: np.random.Generator) -> dict:
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "targets": rng.standard_normal((labels.size, 3)),
        "split": labels < 2,
        "eps": 0.2,
    }


def _zero_shot_inputs(rng: np.random.Generator) -> dict:
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "labels": labels,
        # One class (4) absent from the batch: it still receives softmax gradient.
        "class_embeddings": 0.5 * rng.standard_normal((5, 3)),
        "split": labels < 2,
    }


def _xml_inputs(rng: np.random.Generator) -> dict:
    # Contrastive (pos_margin 0, neg_margin 100) is smooth where every negative pair
    # is inside the margin and no two points coincide, which holds here.
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "Y": rng.standard_normal((labels.size, 3)),
        "labels": labels,
        "eps": 0.2,
        "split": labels < 2,
        "lam": 0.7,
        "base_loss_kwargs": {"pos_margin": 0.0, "neg_margin": 100.0},
    }


register(OperatorSpec(
    name="crossbatch.cross_fit",
    forward=cross_fit_forward,
    backward=cross_fit_backward,
    make_inputs=_cross_fit_inputs,
    paper="XML Eq. (2.10) predictions Y_hat_1 = V_2 Z_1, Y_hat_2 = V_1 Z_2; GSP Alg. 4",
))
register(OperatorSpec(
    name="crossbatch.zero_shot_loss",
    forward=zero_shot_loss,
    backward=None,
    make_inputs=_zero_shot_inputs,
    paper="GSP Sec. 4.3, (P3) and Algorithm 4 (softmax cross-entropy, scale 9.5)",
    is_loss=True,
))
register(OperatorSpec(
    name="crossbatch.zero_shot_loss_printed",
    forward=zero_shot_loss_printed,
    backward=None,
    make_inputs=_zero_shot_inputs,
    paper="GSP Eq. (4.4) as printed",
    is_loss=True,
))
register(OperatorSpec(
    name="crossbatch.xml_loss",
    forward=xml_loss,
    backward=None,
    make_inputs=_xml_inputs,
    paper="XML Eqs. (2.10)-(2.11) with the contrastive base loss",
    is_loss=True,
    wrt=("Z", "Y"),
))
