"""Wasserstein DML losses, Eqs. (1)-(2): forward/backward pairs and one-call wrappers.

Image ``i`` is the uniform measure on its ``n`` local features ``features[i]`` (n, d);
``d_w(i, j)`` is the Sinkhorn divergence of Eq. (4) between two images, cost
``||x - y||^p`` (default p = 1, the paper's ``d_w = W_1``), see :mod:`refdml.ot._divergence`.

.. math::

    L_{\\text{contrastive}} = \\frac{1}{|P|} \\sum_{(i,j) \\in P} [y_i = y_j]\\, d_w(i, j)
        + [y_i \\ne y_j]\\, [\\gamma - d_w(i, j)]_+

    L_{\\text{triplet}} = \\frac{1}{|T|} \\sum_{(a,p,n) \\in T} [d_w(a, p) - d_w(a, n) + \\gamma]_+

Printed vs implemented: Eqs. (1)-(2)'s ``1/b`` is implemented as the mean over the pairs
(triplets) used. The hinges use the subgradient 0 at the kink.

The forward solves every distinct pair of images once (all problems in one batch) and keeps
the derivative of the loss w.r.t. each divergence (the hinge pattern) in the context; the
backward multiplies it by ``d_value`` and walks the divergences back to the features.

Scale: features of any magnitude for which ``eps / max ||x - y||^p`` lies in
``[1e-13, 1e12]`` (at ``eps = 0.1``, ``p = 1``: largest distances from 1e-13 to 1e12).
Outside, float64 cannot resolve ``eps`` against the costs whatever the rescaling, and a
``ValueError`` names ``features`` (or ``eps``, if that is the further from 1) with both
ranges; the derivation is in :mod:`refdml.ot._divergence`, "Scale".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._validation import (
    as_label_array,
    check_choice,
    check_context,
    check_scalar,
    check_upstream,
)
from refdml.ot._divergence import (
    _check_cloud_batch,
    _check_p,
    _pair_divergences,
    _pair_divergences_backward,
    _PairsContext,
)
from refdml.ot._sinkhorn import VALUES, _check_solver_args

__all__ = [
    "WContrastiveContext",
    "WassersteinLossGrads",
    "WTripletContext",
    "wcontrastive",
    "wcontrastive_backward",
    "wcontrastive_forward",
    "wtriplet",
    "wtriplet_backward",
    "wtriplet_forward",
]


@dataclass(frozen=True)
class WassersteinLossGrads:
    features: np.ndarray     # (B, n, d)


@dataclass(frozen=True)
class WContrastiveContext:
    """Context of :func:`wcontrastive_forward`.

    ``divergences`` is None when there is no pair (loss 0, gradient 0).
    """

    shape: tuple[int, int, int]          # (B, n, d) of the features
    divergences: _PairsContext | None    # the distinct pairs of images, solved
    d_unique: np.ndarray                 # dL/d d_w for each distinct pair (at d_value = 1)


@dataclass(frozen=True)
class WTripletContext:
    """Context of :func:`wtriplet_forward` (same fields as :class:`WContrastiveContext`)."""

    shape: tuple[int, int, int]
    divergences: _PairsContext | None
    d_unique: np.ndarray


def _check_loss_args(features, labels, margin, eps, p, value, max_iter, tol, eps_scaling):
    features = _check_cloud_batch(features, "features")
    labels = as_label_array(labels, "labels", length=features.shape[0])
    margin = check_scalar(margin, "margin", low=0.0)
    check_choice(value, "value", VALUES)
    solver = _check_solver_args(eps, max_iter, tol, eps_scaling)
    return features, labels, margin, _check_p(p), solver


def _check_index_rows(rows, name: str, width: int, n_items: int) -> np.ndarray:
    array = np.asarray(rows)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        if array.size == 0 and array.ndim == 2 and array.shape[1] == width:
            return np.zeros((0, width), dtype=np.int64)
        raise TypeError(f"{name} must be an integer array of shape (K, {width}), got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (K, {width}), got {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= n_items):
        raise ValueError(
            f"{name} holds indices outside [0, {n_items}), got {array.min()}..{array.max()}"
        )
    return array.astype(np.int64)


def _accumulate(d_rows: np.ndarray, inverse: np.ndarray, n_unique: int) -> np.ndarray:
    d_unique = np.zeros(n_unique)
    np.add.at(d_unique, inverse, d_rows)
    return d_unique


def wcontrastive_forward(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein contrastive loss, Eq. (1); returns ``(loss, ctx)``.

    Parameters
    ----------
    features : (B, n, d) local features; image ``i`` is the uniform measure on ``features[i]``.
    labels : (B,) integer class labels.
    margin : float >= 0, the paper's ``gamma``, in the units of ``d_w`` (cost ``||x - y||^p``).
    eps : float > 0, the entropic regularisation of ``d_w``, in cost units.
    p : float >= 1, exponent of the ground cost (default 1: ``d_w`` approximates ``W_1``).
    value : ``"regularized"`` (the paper's) or ``"transport_cost"``, see Eq. (4).
    pairs : (K, 2) integer pairs of different images (repeats count); default every
        unordered pair ``i < j``.
    max_iter, tol, eps_scaling : as in :func:`refdml.ot.sinkhorn`.
    """
    features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _check_loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    n_images = features.shape[0]
    if pairs is None:
        first, second = np.triu_indices(n_images, k=1)
        pairs = np.stack([first, second], axis=1)
    pairs = _check_index_rows(pairs, "pairs", 2, n_images)
    if pairs.shape[0] == 0:
        return 0.0, WContrastiveContext(features.shape, None, np.zeros(0))
    if np.any(pairs[:, 0] == pairs[:, 1]):
        row = int(np.flatnonzero(pairs[:, 0] == pairs[:, 1])[0])
        raise ValueError(f"pairs must join two different images, got {pairs[row].tolist()} at row {row}")
    d_w, inverse, divergences = _pair_divergences(
        features, pairs, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling, name="features",
    )
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    hinge = margin - d_w
    terms = np.where(same, d_w, np.maximum(hinge, 0.0))
    count = pairs.shape[0]
    d_rows = np.where(same, 1.0, np.where(hinge > 0.0, -1.0, 0.0)) / count
    d_unique = _accumulate(d_rows, inverse, divergences.pairs.shape[0])
    return float(terms.sum() / count), WContrastiveContext(features.shape, divergences, d_unique)


def wcontrastive_backward(ctx: WContrastiveContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (``d_value`` a real number)."""
    check_context(ctx, "ctx", WContrastiveContext)
    return _loss_backward(ctx, float(check_upstream(d_value, "d_value", ())))


def _loss_backward(ctx, d_value: float) -> WassersteinLossGrads:
    if ctx.divergences is None:
        return WassersteinLossGrads(np.zeros(ctx.shape))
    return WassersteinLossGrads(
        _pair_divergences_backward(ctx.divergences, d_value * ctx.d_unique, "features")
    )


def wcontrastive(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                 max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein contrastive loss, Eq. (1) (``grads.features``).

    One call of :func:`wcontrastive_forward` and :func:`wcontrastive_backward`.
    """
    loss, ctx = wcontrastive_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, pairs=pairs,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wcontrastive_backward(ctx, 1.0)


def _all_triplets(labels: np.ndarray) -> np.ndarray:
    same = labels[:, None] == labels[None, :]
    anchor, positive = np.nonzero(same & ~np.eye(labels.size, dtype=bool))
    rows = []
    for a_idx, p_idx in zip(anchor, positive):
        negatives = np.flatnonzero(~same[a_idx])
        rows.append(np.stack([np.full(negatives.size, a_idx), np.full(negatives.size, p_idx),
                              negatives], axis=1))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(rows).astype(np.int64)


def wtriplet_forward(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
                     max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein triplet loss, Eq. (2); returns ``(loss, ctx)``.

    ``triplets`` (K, 3) integer ``(anchor, positive, negative)`` rows with
    ``anchor != positive`` and ``anchor != negative``; default every ``(a, p, n)`` with
    ``y_a = y_p != y_n``, ``a != p``. Without any triplet the loss is 0. Other parameters
    as in :func:`wcontrastive_forward`.
    """
    features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _check_loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    n_images = features.shape[0]
    triplets = _all_triplets(labels) if triplets is None else _check_index_rows(
        triplets, "triplets", 3, n_images
    )
    if triplets.shape[0] == 0:
        return 0.0, WTripletContext(features.shape, None, np.zeros(0))
    bad = (triplets[:, 0] == triplets[:, 1]) | (triplets[:, 0] == triplets[:, 2])
    if np.any(bad):
        row = int(np.flatnonzero(bad)[0])
        raise ValueError(
            "triplets must have anchor != positive and anchor != negative, got "
            f"{triplets[row].tolist()} at row {row}"
        )
    pairs = np.concatenate([triplets[:, [0, 1]], triplets[:, [0, 2]]])
    d_w, inverse, divergences = _pair_divergences(
        features, pairs, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling, name="features",
    )
    count = triplets.shape[0]
    hinge = d_w[:count] - d_w[count:] + margin
    active = (hinge > 0.0).astype(np.float64) / count
    d_unique = _accumulate(np.concatenate([active, -active]), inverse, divergences.pairs.shape[0])
    loss = float(np.maximum(hinge, 0.0).sum() / count)
    return loss, WTripletContext(features.shape, divergences, d_unique)


def wtriplet_backward(ctx: WTripletContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (``d_value`` a real number)."""
    check_context(ctx, "ctx", WTripletContext)
    return _loss_backward(ctx, float(check_upstream(d_value, "d_value", ())))


def wtriplet(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
             max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein triplet loss, Eq. (2) (``grads.features``).

    One call of :func:`wtriplet_forward` and :func:`wtriplet_backward`.
    """
    loss, ctx = wtriplet_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, triplets=triplets,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wtriplet_backward(ctx, 1.0)
