"""Pair and triplet losses: contrastive (C1, C2), generalized contrastive, triplet,
multi-similarity. Each sees the embeddings through one (n, n) matrix: Euclidean
distances (scale-safe, :func:`._common.self_euclidean`) or cosine similarities
(scale-invariant, :func:`._common.self_cosine`).

Which terms exist (the rule for degenerate batches)
---------------------------------------------------
* ``contrastive`` / ``generalized_contrastive``: one term per unordered pair ``i < j``,
  positive or negative. A batch without a positive pair still has its negative terms:
  the loss is their reduction, exactly as when one positive pair is present. Only a batch
  with no pair at all (``n = 1``) gives 0.
* ``triplet``: one term per valid triplet (``"all"``) or per anchor with a positive and a
  negative (``"batch_hard"``); none (e.g. all labels distinct, or one class) gives 0.
* ``multi_similarity``: one term per anchor that has a positive *and* a negative in the
  batch. Its mining is relative (a negative is kept by comparison with the anchor's least
  similar positive, a positive by comparison with its most similar negative), so an
  anchor without positives, or without negatives, has no mined pairs and no term, and is
  not counted by ``"mean"``. No such anchor: 0.
"""

from __future__ import annotations

import numpy as np

from refdml._validation import check_choice, check_scalar
from refdml.losses._common import (
    LossGrads,
    PairwiseLossContext,
    check_contrastive_margins,
    check_cosine_embeddings,
    check_d_value,
    check_embeddings_labels,
    check_generalized_margins,
    check_loss_context,
    check_multi_similarity_scales,
    check_reduction,
    log1p_sum_exp,
    pairwise_backward,
    reduce_terms,
    self_cosine,
    self_euclidean,
)

__all__ = [
    "contrastive",
    "contrastive_backward",
    "contrastive_forward",
    "generalized_contrastive",
    "generalized_contrastive_backward",
    "generalized_contrastive_forward",
    "multi_similarity",
    "multi_similarity_backward",
    "multi_similarity_forward",
    "triplet",
    "triplet_backward",
    "triplet_forward",
]

_FORMS = ("euclidean", "cosine")
_MINING = ("all", "batch_hard")


# ------------------------------------------------------------------ pair hinge losses


def _pair_hinge_forward(
    x: np.ndarray, labels: np.ndarray, pos_margin: float, neg_margin: float,
    form: str, reduction: str, loss: str,
) -> tuple[float, PairwiseLossContext]:
    """Hinge terms over every unordered pair; in the cosine form the metric's sign flips."""
    n = x.shape[0]
    if form == "euclidean":
        matrix, metric_ctx, scale = self_euclidean(x)
    else:
        matrix, metric_ctx, scale = self_cosine(x)
    rows, cols = np.triu_indices(n, k=1)
    value, d_values = hinge_terms(matrix[rows, cols], labels[rows] == labels[cols],
                                  pos_margin, neg_margin, form, reduction)
    d_matrix = np.zeros((n, n))
    d_matrix[rows, cols] = d_values
    return value, PairwiseLossContext(loss, metric_ctx, d_matrix, scale)


def hinge_terms(values: np.ndarray, same: np.ndarray, pos_margin: float, neg_margin: float,
                form: str, reduction: str) -> tuple[float, np.ndarray]:
    """The contrastive hinges of the pair ``values`` (distances, or cosines for
    ``form="cosine"``, where the metric's sign flips), ``same`` marking the positive pairs;
    returns the reduced value and d value / d values (shape of ``values``)."""
    sign = 1.0 if form == "euclidean" else -1.0
    # Euclidean: positives pulled in [d - m+]_+, negatives pushed [m- - d]_+;
    # cosine: [m+ - s]_+ and [s - m-]_+.
    pre = np.where(same, sign * (values - pos_margin), sign * (neg_margin - values))
    terms = np.maximum(pre, 0.0)
    value, d_terms = reduce_terms(terms, reduction,
                                  lambda: _hinge_cause(values, pos_margin, neg_margin))
    # d term / d value: +sign on active positives, -sign on active negatives.
    slope = np.where(pre > 0.0, np.where(same, sign, -sign), 0.0)
    return value, d_terms * slope


def _hinge_cause(values: np.ndarray, pos_margin: float, neg_margin: float) -> str:
    """Why a sum of hinge terms exceeds float64: distances or margins (the larger)."""
    largest = float(np.max(np.abs(values), initial=0.0))
    if max(pos_margin, neg_margin) > largest:
        return (f"the margins are too large (pos_margin == {pos_margin!r}, neg_margin == "
                f"{neg_margin!r}, largest distance {largest:.3g})")
    return f"the embeddings are too far apart (largest distance {largest:.3g})"


def contrastive_forward(
    embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean", reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """Contrastive loss over the unordered pairs of the batch; returns ``(value, ctx)``.

    ``form="euclidean"`` (C2, Hadsell et al. 2006 with the positive margin of Wu et al.
    2017; GSP supp. 1.6.6, ASAP Sec. 5)::

        l(i, j) = [d_ij - m+]_+   if y_i == y_j,     [m- - d_ij]_+   otherwise,

    with ``d_ij = ||x_i - x_j||``. Defaults ``m+ = 0``, ``m- = 0.3841`` (CUB-200, GSP
    supp. 1.6.7; Cars196 (0.2652, 0.5409), In-shop and SOP (0.2858, 0.5130)).

    ``form="cosine"`` (C1, XBM, Wang et al. 2020) on ``s_ij = cos(x_i, x_j)``::

        l(i, j) = [m+ - s_ij]_+   if y_i == y_j,     [s_ij - m-]_+   otherwise,

    defaults ``m+ = 1`` (so the positive term is ``1 - s``) and ``m- = 0.5``. XBM's
    official code adds ``s_ij`` (not ``s_ij - m-``) for each negative with ``s_ij > m-``:
    a loss that jumps by ``m-`` at the margin. Its gradient is the same as that of the
    continuous hinge implemented here almost everywhere; only the value differs, by
    ``m-`` per active negative. XBM also normalises by the batch size over ordered pairs
    (a per-anchor sum); use ``reduction="sum"`` and multiply by ``2 / n`` to get that scale.
    XBM drops positives with ``s > 1 - 1e-5`` to remove self-pairs; here self-pairs are
    excluded by index, so duplicated embeddings still count.

    The reduction runs over all ``n (n - 1) / 2`` pair terms; a batch without any
    positive pair is reduced over its negative terms alone (no special case). The cosine
    form is invariant to the scale of each embedding (same value at 1e-300 and 1e300);
    the Euclidean form is right at any scale where the distances are finite, and raises
    ``ValueError`` where they are not.

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    pos_margin, neg_margin : float, optional
        The margins ``m+`` and ``m-`` (defaults by ``form``, above).
    form : {"euclidean", "cosine"}
        C2 on Euclidean distances or C1 on cosine similarities.
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y = check_embeddings_labels(embeddings, labels)
    form = check_choice(form, "form", _FORMS)
    reduction = check_reduction(reduction)
    pos_margin, neg_margin = check_contrastive_margins(form, pos_margin, neg_margin)
    if form == "cosine":
        check_cosine_embeddings(x)
    return _pair_hinge_forward(x, y, pos_margin, neg_margin, form, reduction, "contrastive")


def contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` (n, d) of ``d_value * value`` of the contrastive loss.

    ``ctx`` must come from :func:`contrastive_forward`; ``d_value`` is the scalar upstream
    gradient (shape ``()``, finite; default 1.0).
    """
    ctx = check_loss_context(ctx, PairwiseLossContext, "contrastive")
    return pairwise_backward(ctx, check_d_value(d_value))


def contrastive(
    embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean", reduction="mean",
) -> tuple[float, LossGrads]:
    """Contrastive loss and its gradient; see :func:`contrastive_forward`.

    Parameters
    ----------
    embeddings : array of shape (n, d)
    labels : int array of shape (n,)
    pos_margin, neg_margin : float, optional
        ``m+`` and ``m-``; default per ``form`` (0 and 0.3841 Euclidean, 1 and 0.5 cosine).
    form : {"euclidean", "cosine"}
    reduction : {"mean", "mean_nonzero", "sum"}
        Over the unordered pairs ``i < j``; default ``"mean"``.

    Returns
    -------
    value : float
    grads : LossGrads
        ``grads.embeddings`` of shape (n, d).
    """
    value, ctx = contrastive_forward(
        embeddings, labels, pos_margin=pos_margin, neg_margin=neg_margin,
        form=form, reduction=reduction,
    )
    return value, contrastive_backward(ctx)


def generalized_contrastive_forward(
    embeddings, labels, *, alpha, beta, reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """Generalized contrastive loss of ASAP Eq. (4.2); returns ``(value, ctx)``.

    ``l(i, j) = (iota_ij (d_ij - beta) + alpha)_+`` with ``iota_ij = +1`` for the same
    class and ``-1`` otherwise, ``d_ij = ||x_i - x_j||``, ``beta >= alpha > 0`` (the
    condition under which Markov's inequality gives the chance-constraint bound). It is
    C2 with ``m+ = beta - alpha`` and ``m- = beta + alpha``; the reduction runs over all
    unordered pairs, with or without a positive pair in the batch.

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    alpha : float > 0
        The hinge's offset ``alpha``, at most ``beta``.
    beta : float >= alpha
        The distance threshold ``beta``.
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y = check_embeddings_labels(embeddings, labels)
    reduction = check_reduction(reduction)
    alpha, beta = check_generalized_margins(alpha, beta)
    return _pair_hinge_forward(
        x, y, beta - alpha, beta + alpha, "euclidean", reduction, "generalized_contrastive"
    )


def generalized_contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` of ``d_value * value`` of the generalized contrastive loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "generalized_contrastive")
    return pairwise_backward(ctx, check_d_value(d_value))


def generalized_contrastive(
    embeddings, labels, *, alpha, beta, reduction="mean",
) -> tuple[float, LossGrads]:
    """ASAP Eq. (4.2) loss and gradient; see :func:`generalized_contrastive_forward`."""
    value, ctx = generalized_contrastive_forward(
        embeddings, labels, alpha=alpha, beta=beta, reduction=reduction
    )
    return value, generalized_contrastive_backward(ctx)


# ----------------------------------------------------------------------------- triplet


def _triplet_forward(
    x: np.ndarray, labels: np.ndarray, margin: float, mining: str, reduction: str,
) -> tuple[float, PairwiseLossContext]:
    n = x.shape[0]
    distance, metric_ctx, scale = self_euclidean(x)
    same = labels[:, None] == labels[None, :]
    positive = same & ~np.eye(n, dtype=bool)
    negative = ~same
    if mining == "all":
        anchor, pos, neg = np.nonzero(positive[:, :, None] & negative[:, None, :])
    else:
        anchor = np.nonzero(positive.any(axis=1) & negative.any(axis=1))[0]
        # Hardest positive / negative per anchor; ties go to the lowest index (argmax).
        pos = np.argmax(np.where(positive, distance, -np.inf)[anchor], axis=1)
        neg = np.argmin(np.where(negative, distance, np.inf)[anchor], axis=1)
    # Distances are finite and >= 0, so d_ap - d_an cannot overflow; adding the margin can.
    with np.errstate(over="ignore"):
        pre = distance[anchor, pos] - distance[anchor, neg] + margin

    def cause() -> str:
        largest = float(np.max(distance, initial=0.0))
        if margin > largest:
            return f"the margin is too large (margin == {margin!r}, largest distance {largest:.3g})"
        return f"the embeddings are too far apart (largest distance {largest:.3g})"

    if not np.all(np.isfinite(pre)):
        raise ValueError(
            f"a triplet term d_ap - d_an + margin exceeds the float64 range: {cause()}"
        )
    terms = np.maximum(pre, 0.0)
    value, d_terms = reduce_terms(terms, reduction, cause)
    active = np.where(pre > 0.0, d_terms, 0.0)
    d_matrix = np.zeros((n, n))
    np.add.at(d_matrix, (anchor, pos), active)
    np.add.at(d_matrix, (anchor, neg), -active)
    return value, PairwiseLossContext("triplet", metric_ctx, d_matrix, scale)


def triplet_forward(
    embeddings, labels, *, margin=0.0961, mining="all", reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """Triplet loss (Weinberger et al. 2006, Schroff et al. 2015); returns ``(value, ctx)``.

    ``l(a, p, n) = [d_ap - d_an + margin]_+`` on Euclidean distances, over

    * ``mining="all"``: every valid triplet of the batch (``y_a == y_p``, ``a != p``,
      ``y_n != y_a``); ``"mean"`` divides by their number;
    * ``mining="batch_hard"`` (Hermans et al. 2017): one triplet per anchor that has a
      positive and a negative, with its farthest positive and nearest negative (ties
      broken by the lowest index); ``"mean"`` divides by the number of such anchors.

    Default margin 0.0961 (CUB-200, GSP supp. 1.6.7; Cars196 0.1190, In-shop and SOP
    0.0451). No valid triplet: value 0, zero gradient. Right at any scale where the
    distances are finite (at 1e160 the margin is negligible); ``ValueError`` beyond.

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    margin : float >= 0
        The margin of ``[d_ap - d_an + margin]_+`` (default 0.0961).
    mining : {"all", "batch_hard"}
        Every valid triplet, or each anchor's farthest positive and nearest negative.
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y = check_embeddings_labels(embeddings, labels)
    margin = check_scalar(margin, "margin", low=0.0, low_inclusive=False)
    mining = check_choice(mining, "mining", _MINING)
    reduction = check_reduction(reduction)
    return _triplet_forward(x, y, margin, mining, reduction)


def triplet_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` (n, d) of ``d_value * value`` of the triplet loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "triplet")
    return pairwise_backward(ctx, check_d_value(d_value))


def triplet(
    embeddings, labels, *, margin=0.0961, mining="all", reduction="mean",
) -> tuple[float, LossGrads]:
    """Triplet loss and its gradient; see :func:`triplet_forward`."""
    value, ctx = triplet_forward(embeddings, labels, margin=margin, mining=mining, reduction=reduction)
    return value, triplet_backward(ctx)


# -------------------------------------------------------------------- multi-similarity


def _multi_similarity_forward(
    x: np.ndarray, labels: np.ndarray, alpha: float, beta: float, base: float,
    mining_margin: float, reduction: str,
) -> tuple[float, PairwiseLossContext]:
    n = x.shape[0]
    similarity, metric_ctx, scale = self_cosine(x)
    same = labels[:, None] == labels[None, :]
    value, d_matrix = multi_similarity_terms(similarity, same & ~np.eye(n, dtype=bool), ~same,
                                             alpha, beta, base, mining_margin, reduction)
    return value, PairwiseLossContext("multi_similarity", metric_ctx, d_matrix, scale)


def multi_similarity_terms(
    similarity: np.ndarray, positive: np.ndarray, negative: np.ndarray, alpha: float,
    beta: float, base: float, mining_margin: float, reduction: str,
) -> tuple[float, np.ndarray]:
    """Multi-similarity with each row an anchor and ``positive`` / ``negative`` (bool, the
    shape of ``similarity``) its candidate pairs; returns the reduced value and d value /
    d similarity. Rows without a positive or without a negative have no term."""
    # Anchors with a positive and a negative: the only ones with a term (module docstring).
    valid = positive.any(axis=1) & negative.any(axis=1)
    s = similarity[valid]
    positive, negative = positive[valid], negative[valid]
    # Pair mining (Wang et al. 2019, Eqs. 7-8): a negative is kept if it is more similar
    # than the least similar positive minus the margin, a positive if it is less similar
    # than the most similar negative plus the margin.
    hardest_pos = np.min(np.where(positive, s, np.inf), axis=1, initial=np.inf)
    hardest_neg = np.max(np.where(negative, s, -np.inf), axis=1, initial=-np.inf)
    mined_neg = negative & (s + mining_margin > hardest_pos[:, None])
    mined_pos = positive & (s - mining_margin < hardest_neg[:, None])
    # An anchor whose mined set is empty on either side contributes 0 (as in the authors' code).
    keep = mined_neg.any(axis=1) & mined_pos.any(axis=1)
    mined_pos &= keep[:, None]
    mined_neg &= keep[:, None]
    lse_pos, w_pos = log1p_sum_exp(-alpha * (s - base), mined_pos)
    lse_neg, w_neg = log1p_sum_exp(beta * (s - base), mined_neg)
    terms = np.where(keep, lse_pos / alpha + lse_neg / beta, 0.0)
    value, d_terms = reduce_terms(
        terms, reduction, lambda: f"alpha == {alpha!r} or beta == {beta!r} is too small for a "
        f"sum of {int(keep.sum())} terms log(1 + sum exp(...)) / alpha (or / beta)",
    )
    d_similarity = np.zeros(similarity.shape)
    d_similarity[valid] = d_terms[:, None] * (w_neg - w_pos)
    return value, d_similarity


def multi_similarity_forward(
    embeddings, labels, *, alpha=2.0, beta=40.0, base=0.5, mining_margin=0.1, reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """Multi-similarity loss (Wang et al. 2019, Eq. 9 with the mining of Eqs. 7-8).

    On the cosine similarities ``s_ij`` of the embeddings (normalised inside, as in the
    paper), for each anchor ``i`` with mined positives ``P_i`` and negatives ``N_i``::

        l_i = 1/alpha log(1 + sum_{k in P_i} exp(-alpha (s_ik - base)))
            + 1/beta  log(1 + sum_{k in N_i} exp( beta (s_ik - base)))

    where a negative ``k`` is mined if ``s_ik + mining_margin > min_{p} s_ip`` and a
    positive if ``s_ik - mining_margin < max_{q} s_iq`` (over all positives / negatives of
    the anchor). ``base`` is the paper's ``lambda``, ``mining_margin`` its ``epsilon``.
    Terms are per anchor; ``"mean"`` divides by the number of anchors that have a
    positive and a negative in the batch (the authors' code divides by the batch size,
    the same number under the usual m-per-class sampling); an anchor with an empty mined
    set contributes 0, an anchor without a positive or without a negative has no term
    (its mining is undefined; see the module docstring). Defaults (2, 40, 0.5) are the
    CUB-200 / SOP values of GSP supp. 1.6.7 (Cars196 (14.35, 75.83, 0.66), In-shop
    (8.49, 57.38, 0.41)); mining margin 0.1 as in the paper. The mined sets are piecewise
    constant in the embeddings: the gradient is that of the selected terms. Invariant to
    the scale of each embedding.

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    alpha, beta : float > 0
        Scales of the positive and the negative terms (defaults 2 and 40).
    base : float
        The similarity offset, the paper's ``lambda`` (default 0.5).
    mining_margin : float >= 0
        The mining margin, the paper's ``epsilon`` (default 0.1).
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y = check_embeddings_labels(embeddings, labels)
    hyperparameters = check_multi_similarity(alpha, beta, base, mining_margin, reduction,
                                             x.shape[0])
    check_cosine_embeddings(x)
    return _multi_similarity_forward(x, y, *hyperparameters)


def check_multi_similarity(alpha, beta, base, mining_margin, reduction, n: int) -> tuple:
    """The multi-similarity hyperparameters, checked: ``(alpha, beta, base, mining_margin,
    reduction)``; ``n`` candidates per anchor bound the terms' size."""
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    beta = check_scalar(beta, "beta", low=0.0, low_inclusive=False)
    base = check_scalar(base, "base", low=-1.0, high=1.0)
    mining_margin = check_scalar(mining_margin, "mining_margin", low=0.0)
    reduction = check_reduction(reduction)
    check_multi_similarity_scales(alpha, beta, n)
    return alpha, beta, base, mining_margin, reduction


def multi_similarity_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` (n, d) of ``d_value * value`` of the multi-similarity loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "multi_similarity")
    return pairwise_backward(ctx, check_d_value(d_value))


def multi_similarity(
    embeddings, labels, *, alpha=2.0, beta=40.0, base=0.5, mining_margin=0.1, reduction="mean",
) -> tuple[float, LossGrads]:
    """Multi-similarity loss and its gradient; see :func:`multi_similarity_forward`."""
    value, ctx = multi_similarity_forward(
        embeddings, labels, alpha=alpha, beta=beta, base=base,
        mining_margin=mining_margin, reduction=reduction,
    )
    return value, multi_similarity_backward(ctx)
