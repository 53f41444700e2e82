"""Deep-metric-learning losses with hand-derived gradients.

Every loss is a pure pair ``<name>_forward(embeddings, labels, ...) -> (value, ctx)`` and
``<name>_backward(ctx, d_value=1.0) -> grads``; the public ``<name>(...)`` validates its
input once and returns ``value, grads``. ``grads.embeddings`` has the shape of the
embeddings; proxy losses also return ``grads.proxies``.

===========================  ===================================================  ===============
loss                         term                                                 on
===========================  ===================================================  ===============
``contrastive``              ``[d - m+]_+`` positives, ``[m- - d]_+`` negatives   Euclidean ``d``
``contrastive(form=cosine)`` ``[m+ - s]_+`` positives, ``[s - m-]_+`` negatives   cosine ``s``
``generalized_contrastive``  ``(iota (d - beta) + alpha)_+``                      Euclidean ``d``
``triplet``                  ``[d_ap - d_an + margin]_+``                         Euclidean ``d``
``multi_similarity``         soft-weighted mined pairs (Wang et al. 2019)         cosine ``s``
``proxy_anchor``             Kim et al. 2020                                      cosine ``s``
``proxy_nca``                ProxyNCA++ (Teh et al. 2020)                         cosine ``s``
``soft_triple``              Qian et al. 2019                                     cosine ``s``
===========================  ===================================================  ===============

Conventions shared by all losses
--------------------------------
* Distance losses work on the embeddings as given (normalise them first with
  :mod:`refdml.normalize` if wanted); cosine losses normalise inside.
* Pairs are unordered (``i < j``, each pair once, no self-pairs). The ordered double sum
  of ASAP Eq. (3.2) counts each pair twice and adds the ``n`` self-pairs; the mean over
  pairs is the same, and a self-pair term ``(alpha - beta)_+`` is 0 for ``beta >= alpha``.
* ``reduction``: ``"mean"`` averages the terms over every *valid* pair / triplet / anchor
  / proxy (the empirical expectation of ASAP Eq. 3.1), ``"mean_nonzero"`` over the terms
  that are strictly positive, ``"sum"`` adds them. The default of every loss is
  ``"mean"``. The number of non-zero terms is piecewise constant, so its derivative is 0.
* A batch with no valid positive pair (pair losses, multi-similarity) or no valid
  triplet returns ``0.0`` with an all-zero gradient, never NaN.
* Hinges and mining thresholds are not differentiable on their boundary; the backward
  uses the inactive side there (subgradient 0), and the Euclidean distance uses the
  subgradient 0 at coincident points (see :mod:`refdml.distances`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._validation import as_float_array, as_label_array, check_choice, check_scalar
from refdml.distances import (
    _cosine_backward,
    _cosine_forward,
    _euclidean_backward,
    _euclidean_forward,
)
from refdml.gradcheck.registry import OperatorSpec, register

__all__ = [
    "LossGrads",
    "PAPER_HYPERPARAMETERS",
    "ProxyLossGrads",
    "REDUCTIONS",
    "contrastive",
    "contrastive_backward",
    "contrastive_forward",
    "generalized_contrastive",
    "generalized_contrastive_backward",
    "generalized_contrastive_forward",
    "multi_similarity",
    "multi_similarity_backward",
    "multi_similarity_forward",
    "proxy_anchor",
    "proxy_anchor_backward",
    "proxy_anchor_forward",
    "proxy_nca",
    "proxy_nca_backward",
    "proxy_nca_forward",
    "soft_triple",
    "soft_triple_backward",
    "soft_triple_forward",
    "triplet",
    "triplet_backward",
    "triplet_forward",
]

REDUCTIONS = ("mean", "mean_nonzero", "sum")
_FORMS = ("euclidean", "cosine")
_MINING = ("all", "batch_hard")

# Default margins of `contrastive` per form: C2 with the CUB-200 values of GSP supp. 1.6.7
# (m+, m-) = (0, 0.3841); XBM's C1 on cosine similarity, 1 - s for positives, margin 0.5.
_CONTRASTIVE_DEFAULTS = {"euclidean": (0.0, 0.3841), "cosine": (1.0, 0.5)}


def _per_dataset(cub200, cars196, inshop, sop) -> dict:
    return {"cub200": cub200, "cars196": cars196, "inshop": inshop, "sop": sop}


#: Per-dataset hyperparameters of GSP supp. 1.6.7 and ASAP App. A.2, as keyword arguments:
#: ``contrastive(x, y, **PAPER_HYPERPARAMETERS["contrastive"]["sop"])``. Where the two
#: papers differ (ProxyNCA++ temperature: GSP 0.11, ASAP 0.1) GSP's value is used;
#: SoftTriple is given in ASAP only.
PAPER_HYPERPARAMETERS = {
    "contrastive": _per_dataset(
        {"pos_margin": 0.0, "neg_margin": 0.3841},
        {"pos_margin": 0.2652, "neg_margin": 0.5409},
        {"pos_margin": 0.2858, "neg_margin": 0.5130},
        {"pos_margin": 0.2858, "neg_margin": 0.5130},
    ),
    "contrastive_cosine": _per_dataset(*[{"form": "cosine", "pos_margin": 1.0, "neg_margin": 0.5}] * 4),
    "triplet": _per_dataset({"margin": 0.0961}, {"margin": 0.1190}, {"margin": 0.0451}, {"margin": 0.0451}),
    "multi_similarity": _per_dataset(
        {"alpha": 2.0, "beta": 40.0, "base": 0.5},
        {"alpha": 14.35, "beta": 75.83, "base": 0.66},
        {"alpha": 8.49, "beta": 57.38, "base": 0.41},
        {"alpha": 2.0, "beta": 40.0, "base": 0.5},
    ),
    "proxy_anchor": _per_dataset(*[{"delta": 0.1, "alpha": 32.0}] * 4),
    "proxy_nca": _per_dataset(*[{"temperature": 0.11}] * 4),
    "soft_triple": _per_dataset(
        {"lambda_": 20.0, "gamma": 0.1, "tau": 0.2, "delta": 0.01},
        {"lambda_": 17.69, "gamma": 19.18, "tau": 0.0669, "delta": 0.3588},
        {"lambda_": 20.0, "gamma": 0.1, "tau": 0.2, "delta": 0.01},
        {"lambda_": 100.0, "gamma": 47.9, "tau": 0.2, "delta": 0.3145},
    ),
}


@dataclass(frozen=True)
class LossGrads:
    embeddings: np.ndarray


@dataclass(frozen=True)
class ProxyLossGrads:
    embeddings: np.ndarray
    proxies: np.ndarray


# ----------------------------------------------------------------------------- helpers


def _reduce(terms: np.ndarray, reduction: str) -> tuple[float, np.ndarray]:
    """Reduce non-negative ``terms``; return the value and d value / d terms.

    An empty set of terms (or no non-zero term for ``mean_nonzero``) reduces to 0.
    """
    if reduction == "sum":
        return float(np.sum(terms)), np.ones_like(terms)
    if reduction == "mean":
        count = terms.size
        weight = np.ones_like(terms)
    else:
        weight = (terms > 0.0).astype(np.float64)
        count = int(np.count_nonzero(weight))
    if count == 0:
        return 0.0, np.zeros_like(terms)
    return float(np.sum(terms) / count), weight / count


def _check_embeddings_labels(embeddings, labels) -> tuple[np.ndarray, np.ndarray]:
    x = as_float_array(embeddings, "embeddings", ndim=2)
    y = as_label_array(labels, "labels", length=x.shape[0])
    return x, y


def _check_proxies(proxies, proxy_labels, labels, d: int) -> tuple[np.ndarray, np.ndarray]:
    p = as_float_array(proxies, "proxies", ndim=2)
    if p.shape[1] != d:
        raise ValueError(
            f"proxies have dimension {p.shape[1]} but embeddings have dimension {d} "
            f"(proxies.shape={p.shape})"
        )
    if proxy_labels is None:
        p_labels = np.arange(p.shape[0], dtype=np.int64)
    else:
        p_labels = as_label_array(proxy_labels, "proxy_labels")
        if p_labels.size != p.shape[0]:
            raise ValueError(
                f"proxy_labels has length {p_labels.size}, but there are {p.shape[0]} proxies"
            )
    missing = np.setdiff1d(labels, p_labels)
    if missing.size:
        raise ValueError(
            f"labels has class {int(missing[0])}, which no proxy represents "
            f"(proxy_labels covers {np.unique(p_labels).size} classes)"
        )
    return p, p_labels


def _check_nonzero_rows(x: np.ndarray, name: str) -> None:
    # Cosine similarity of a zero vector is undefined: refuse it here, under the
    # parameter's own name, rather than deep inside the normalisation.
    zero = ~np.any(x != 0.0, axis=1)
    if np.any(zero):
        raise ValueError(
            f"{name} has a zero vector at row {int(np.argmax(zero))}; cosine similarity "
            "needs non-zero vectors"
        )


def _self_euclidean(x: np.ndarray):
    return _euclidean_forward(x, x)


def _self_euclidean_backward(ctx, d_distance: np.ndarray) -> np.ndarray:
    # D is computed as a function of two copies of x; the total derivative adds both.
    grads = _euclidean_backward(ctx, d_distance)
    return grads.x + grads.y


def _self_cosine_backward(ctx, d_similarity: np.ndarray) -> np.ndarray:
    grads = _cosine_backward(ctx, d_similarity)
    return grads.x + grads.y


# ------------------------------------------------------------------ pair hinge losses


@dataclass(frozen=True)
class PairwiseLossContext:
    """Context of a loss that sees the embeddings only through one pairwise matrix."""

    form: str                  # "euclidean" (distances) or "cosine" (similarities)
    metric_ctx: object         # context of that matrix, for its backward
    d_matrix: np.ndarray       # d value / d matrix for an upstream gradient of 1


def _pair_hinge_forward(
    x: np.ndarray, labels: np.ndarray, pos_margin: float, neg_margin: float,
    form: str, reduction: str,
) -> tuple[float, PairwiseLossContext]:
    """Hinge terms over unordered pairs; in the cosine form the sign of the metric flips."""
    n = x.shape[0]
    if form == "euclidean":
        matrix, metric_ctx = _self_euclidean(x)
        sign = 1.0          # positives pulled in: [d - m+]_+ ; negatives pushed: [m- - d]_+
    else:
        matrix, metric_ctx = _cosine_forward(x, x)
        sign = -1.0         # [m+ - s]_+ ; [s - m-]_+
    rows, cols = np.triu_indices(n, k=1)
    same = labels[rows] == labels[cols]
    if not np.any(same):
        return 0.0, PairwiseLossContext(form, metric_ctx, np.zeros((n, n)))
    values = matrix[rows, cols]
    pre = np.where(same, sign * (values - pos_margin), sign * (neg_margin - values))
    terms = np.maximum(pre, 0.0)
    value, d_terms = _reduce(terms, reduction)
    # d term / d matrix entry: +sign on active positives, -sign on active negatives.
    slope = np.where(pre > 0.0, np.where(same, sign, -sign), 0.0)
    d_matrix = np.zeros((n, n))
    d_matrix[rows, cols] = d_terms * slope
    return value, PairwiseLossContext(form, metric_ctx, d_matrix)


def _pairwise_backward(ctx: PairwiseLossContext, d_value: float) -> LossGrads:
    upstream = d_value * ctx.d_matrix
    if ctx.form == "euclidean":
        return LossGrads(embeddings=_self_euclidean_backward(ctx.metric_ctx, upstream))
    return LossGrads(embeddings=_self_cosine_backward(ctx.metric_ctx, upstream))


def _check_reduction(reduction) -> str:
    return check_choice(reduction, "reduction", REDUCTIONS)


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

    A batch without any positive pair returns 0 and a zero gradient.
    """
    x, y = _check_embeddings_labels(embeddings, labels)
    form = check_choice(form, "form", _FORMS)
    reduction = _check_reduction(reduction)
    default_pos, default_neg = _CONTRASTIVE_DEFAULTS[form]
    pos_margin = default_pos if pos_margin is None else pos_margin
    neg_margin = default_neg if neg_margin is None else neg_margin
    if form == "euclidean":
        pos_margin = check_scalar(pos_margin, "pos_margin", low=0.0)
        neg_margin = check_scalar(neg_margin, "neg_margin", low=0.0, low_inclusive=False)
    else:
        pos_margin = check_scalar(pos_margin, "pos_margin", low=-1.0, high=1.0, low_inclusive=False)
        neg_margin = check_scalar(neg_margin, "neg_margin", low=-1.0, high=1.0, high_inclusive=False)
        _check_nonzero_rows(x, "embeddings")
    return _pair_hinge_forward(x, y, pos_margin, neg_margin, form, reduction)


def contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient of the contrastive loss with respect to the embeddings."""
    return _pairwise_backward(ctx, float(d_value))


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
    C2 with ``m+ = beta - alpha`` and ``m- = beta + alpha``.
    """
    x, y = _check_embeddings_labels(embeddings, labels)
    reduction = _check_reduction(reduction)
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    beta = check_scalar(beta, "beta", low=alpha)
    return _pair_hinge_forward(x, y, beta - alpha, beta + alpha, "euclidean", reduction)


def generalized_contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient of the generalized contrastive loss with respect to the embeddings."""
    return _pairwise_backward(ctx, float(d_value))


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
    distance, metric_ctx = _self_euclidean(x)
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
    if anchor.size == 0:
        return 0.0, PairwiseLossContext("euclidean", metric_ctx, np.zeros((n, n)))
    pre = distance[anchor, pos] - distance[anchor, neg] + margin
    terms = np.maximum(pre, 0.0)
    value, d_terms = _reduce(terms, reduction)
    active = np.where(pre > 0.0, d_terms, 0.0)
    d_matrix = np.zeros((n, n))
    np.add.at(d_matrix, (anchor, pos), active)
    np.add.at(d_matrix, (anchor, neg), -active)
    return value, PairwiseLossContext("euclidean", metric_ctx, d_matrix)


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
    0.0451). No valid triplet: value 0, zero gradient.
    """
    x, y = _check_embeddings_labels(embeddings, labels)
    margin = check_scalar(margin, "margin", low=0.0, low_inclusive=False)
    mining = check_choice(mining, "mining", _MINING)
    reduction = _check_reduction(reduction)
    return _triplet_forward(x, y, margin, mining, reduction)


def triplet_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient of the triplet loss with respect to the embeddings."""
    return _pairwise_backward(ctx, float(d_value))


def triplet(
    embeddings, labels, *, margin=0.0961, mining="all", reduction="mean",
) -> tuple[float, LossGrads]:
    """Triplet loss and its gradient; see :func:`triplet_forward`."""
    value, ctx = triplet_forward(embeddings, labels, margin=margin, mining=mining, reduction=reduction)
    return value, triplet_backward(ctx)


# -------------------------------------------------------------------- multi-similarity


def _log1p_sum_exp(z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise ``log(1 + sum_{mask} exp(z))`` and its gradient ``exp(z - lse)`` on the mask.

    The 1 is the ``exp(0)`` of an extra zero logit, which keeps the shift ``max(0, z)``
    finite for rows whose mask is empty.
    """
    masked = np.where(mask, z, -np.inf)
    shift = np.maximum(np.max(masked, axis=1, initial=0.0), 0.0)
    lse = shift + np.log(np.exp(-shift) + np.sum(np.exp(masked - shift[:, None]), axis=1))
    return lse, np.where(mask, np.exp(masked - lse[:, None]), 0.0)


def _multi_similarity_forward(
    x: np.ndarray, labels: np.ndarray, alpha: float, beta: float, base: float,
    mining_margin: float, reduction: str,
) -> tuple[float, PairwiseLossContext]:
    n = x.shape[0]
    similarity, metric_ctx = _cosine_forward(x, x)
    same = labels[:, None] == labels[None, :]
    positive = same & ~np.eye(n, dtype=bool)
    negative = ~same
    valid = positive.any(axis=1) & negative.any(axis=1)
    if not np.any(valid):
        return 0.0, PairwiseLossContext("cosine", metric_ctx, np.zeros((n, n)))
    s = similarity[valid]
    positive, negative = positive[valid], negative[valid]
    # Pair mining (Wang et al. 2019, Eqs. 7-8): a negative is kept if it is more similar
    # than the least similar positive minus the margin, a positive if it is less similar
    # than the most similar negative plus the margin.
    hardest_pos = np.min(np.where(positive, s, np.inf), axis=1)
    hardest_neg = np.max(np.where(negative, s, -np.inf), axis=1)
    mined_neg = negative & (s + mining_margin > hardest_pos[:, None])
    mined_pos = positive & (s - mining_margin < hardest_neg[:, None])
    # An anchor whose mined set is empty on either side contributes 0 (as in the authors' code).
    keep = mined_neg.any(axis=1) & mined_pos.any(axis=1)
    mined_pos &= keep[:, None]
    mined_neg &= keep[:, None]
    lse_pos, w_pos = _log1p_sum_exp(-alpha * (s - base), mined_pos)
    lse_neg, w_neg = _log1p_sum_exp(beta * (s - base), mined_neg)
    terms = np.where(keep, lse_pos / alpha + lse_neg / beta, 0.0)
    value, d_terms = _reduce(terms, reduction)
    d_matrix = np.zeros((n, n))
    d_matrix[valid] = d_terms[:, None] * (w_neg - w_pos)
    return value, PairwiseLossContext("cosine", metric_ctx, d_matrix)


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
    set contributes 0. Defaults (2, 40, 0.5) are the CUB-200 / SOP values of GSP supp.
    1.6.7 (Cars196 (14.35, 75.83, 0.66), In-shop (8.49, 57.38, 0.41)); mining margin 0.1
    as in the paper. The mined sets are piecewise constant in the embeddings: the
    gradient is that of the selected terms.
    """
    x, y = _check_embeddings_labels(embeddings, labels)
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    beta = check_scalar(beta, "beta", low=0.0, low_inclusive=False)
    base = check_scalar(base, "base", low=-1.0, high=1.0)
    mining_margin = check_scalar(mining_margin, "mining_margin", low=0.0)
    reduction = _check_reduction(reduction)
    _check_nonzero_rows(x, "embeddings")
    return _multi_similarity_forward(x, y, alpha, beta, base, mining_margin, reduction)


def multi_similarity_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient of the multi-similarity loss with respect to the embeddings."""
    return _pairwise_backward(ctx, float(d_value))


def multi_similarity(
    embeddings, labels, *, alpha=2.0, beta=40.0, base=0.5, mining_margin=0.1, reduction="mean",
) -> tuple[float, LossGrads]:
    """Multi-similarity loss and its gradient; see :func:`multi_similarity_forward`."""
    value, ctx = multi_similarity_forward(
        embeddings, labels, alpha=alpha, beta=beta, base=base,
        mining_margin=mining_margin, reduction=reduction,
    )
    return value, multi_similarity_backward(ctx)


# ------------------------------------------------------------------------ proxy losses


@dataclass(frozen=True)
class ProxyLossContext:
    """Context of a proxy loss: the cosine matrix and d value / d it (upstream 1)."""

    cosine_ctx: object              # context of cos(embeddings, proxies)
    d_similarity: np.ndarray        # (n, n_proxies)
    regularizer_ctx: object = None  # SoftTriple: context of cos(proxies, proxies)
    d_regularizer: np.ndarray | None = None


def _proxy_backward(ctx: ProxyLossContext, d_value: float) -> ProxyLossGrads:
    grads = _cosine_backward(ctx.cosine_ctx, d_value * ctx.d_similarity)
    d_proxies = grads.y
    if ctx.regularizer_ctx is not None:
        d_proxies = d_proxies + _self_cosine_backward(ctx.regularizer_ctx, d_value * ctx.d_regularizer)
    return ProxyLossGrads(embeddings=grads.x, proxies=d_proxies)


def _check_proxy_inputs(embeddings, labels, proxies, proxy_labels):
    x, y = _check_embeddings_labels(embeddings, labels)
    p, p_labels = _check_proxies(proxies, proxy_labels, y, x.shape[1])
    _check_nonzero_rows(x, "embeddings")
    _check_nonzero_rows(p, "proxies")
    return x, y, p, p_labels


def _proxy_anchor_forward(
    x, labels, proxies, proxy_labels, delta, alpha, reduction,
) -> tuple[float, ProxyLossContext]:
    similarity, cosine_ctx = _cosine_forward(x, proxies)
    same = labels[:, None] == proxy_labels[None, :]            # (n, n_proxies)
    # log(1 + sum_x exp(z)) per proxy: work on the transposes, proxies as rows.
    lse_pos, w_pos = _log1p_sum_exp(-alpha * (similarity.T - delta), same.T)
    lse_neg, w_neg = _log1p_sum_exp(alpha * (similarity.T + delta), ~same.T)
    with_positives = same.any(axis=0)
    value_pos, d_pos = _reduce(lse_pos[with_positives], reduction)
    value_neg, d_neg = _reduce(lse_neg, reduction)
    d_lse_pos = np.zeros(proxies.shape[0])
    d_lse_pos[with_positives] = d_pos
    d_similarity = alpha * (d_neg[:, None] * w_neg - d_lse_pos[:, None] * w_pos).T
    return value_pos + value_neg, ProxyLossContext(cosine_ctx, d_similarity)


def proxy_anchor_forward(
    embeddings, labels, *, proxies, proxy_labels=None, delta=0.1, alpha=32.0, reduction="mean",
) -> tuple[float, ProxyLossContext]:
    """Proxy-Anchor loss (Kim et al. 2020, Eq. 4); returns ``(value, ctx)``.

    With ``s(x, p)`` the cosine similarity, ``P+`` the proxies whose class occurs in the
    batch and ``X_p+`` (``X_p-``) the embeddings of (not of) proxy ``p``'s class::

        1/|P+| sum_{p in P+} log(1 + sum_{x in X_p+} exp(-alpha (s(x, p) - delta)))
      + 1/|P|  sum_{p in P}  log(1 + sum_{x in X_p-} exp( alpha (s(x, p) + delta)))

    ``reduction`` replaces each of the two proxy averages (``"sum"``: no division;
    ``"mean_nonzero"``: divide by the proxies whose term is non-zero, which drops
    proxies without any negative in the batch from the second average). Several proxies
    per class: each is an anchor of its own. Defaults ``delta = 0.1``, ``alpha = 32``
    (GSP supp. 1.6.7, ASAP App. A.2, all datasets).

    ``proxies`` has shape (n_proxies, d); ``proxy_labels`` (default ``arange(n_proxies)``,
    proxy ``k`` for class ``k``) gives each proxy's class.
    """
    x, y, p, p_labels = _check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    delta = check_scalar(delta, "delta", low=0.0)
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    reduction = _check_reduction(reduction)
    return _proxy_anchor_forward(x, y, p, p_labels, delta, alpha, reduction)


def proxy_anchor_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients of the Proxy-Anchor loss with respect to the embeddings and the proxies."""
    return _proxy_backward(ctx, float(d_value))


def proxy_anchor(
    embeddings, labels, *, proxies, proxy_labels=None, delta=0.1, alpha=32.0, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """Proxy-Anchor loss and its gradients; see :func:`proxy_anchor_forward`."""
    value, ctx = proxy_anchor_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels,
        delta=delta, alpha=alpha, reduction=reduction,
    )
    return value, proxy_anchor_backward(ctx)


def _row_logsumexp(z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise ``log sum_{mask} exp(z)`` (every row has a masked entry) and its softmax."""
    masked = np.where(mask, z, -np.inf)
    shift = np.max(masked, axis=1)
    lse = shift + np.log(np.sum(np.exp(masked - shift[:, None]), axis=1))
    return lse, np.where(mask, np.exp(masked - lse[:, None]), 0.0)


def _proxy_nca_forward(
    x, labels, proxies, proxy_labels, temperature, reduction,
) -> tuple[float, ProxyLossContext]:
    similarity, cosine_ctx = _cosine_forward(x, proxies)
    # -||x^ - p^||^2 / T = -(2 - 2 s) / T for unit vectors: the exact squared distance
    # of the paper, without the cancellation of forming it from differences.
    logits = -(2.0 - 2.0 * similarity) / temperature
    same = labels[:, None] == proxy_labels[None, :]
    lse_all, softmax_all = _row_logsumexp(logits, np.ones_like(same))
    lse_pos, softmax_pos = _row_logsumexp(logits, same)
    # A single class of proxies makes every term exactly 0; clip the rounding residue.
    terms = np.maximum(lse_all - lse_pos, 0.0)
    value, d_terms = _reduce(terms, reduction)
    d_similarity = (2.0 / temperature) * d_terms[:, None] * (softmax_all - softmax_pos)
    return value, ProxyLossContext(cosine_ctx, d_similarity)


def proxy_nca_forward(
    embeddings, labels, *, proxies, proxy_labels=None, temperature=0.11, reduction="mean",
) -> tuple[float, ProxyLossContext]:
    """ProxyNCA++ loss (Teh et al. 2020, Eq. 5 with temperature); returns ``(value, ctx)``.

    For each embedding ``x_i`` with class ``y_i``, on L2-normalised ``x^`` and ``p^``::

        l_i = -log( sum_{p of class y_i} exp(-||x^_i - p^||^2 / T)
                    / sum_{all p}        exp(-||x^_i - p^||^2 / T) )

    (ProxyNCA++ keeps the positive proxy in the denominator, unlike ProxyNCA). With one
    proxy per class the numerator is the paper's single term; with several, their sum
    (the probability of the class). ``"mean"`` averages over the embeddings. Default
    ``T = 0.11`` (GSP supp. 1.6.7; ASAP App. A.2 prints 0.1; the ProxyNCA++ paper's
    1/9 rounds to 0.11). Only the ProxyNCA++ loss is implemented; its other components
    (fast-moving proxies, global max pooling, normalised layer) are training choices.
    """
    x, y, p, p_labels = _check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    temperature = check_scalar(temperature, "temperature", low=0.0, low_inclusive=False)
    reduction = _check_reduction(reduction)
    return _proxy_nca_forward(x, y, p, p_labels, temperature, reduction)


def proxy_nca_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients of the ProxyNCA++ loss with respect to the embeddings and the proxies."""
    return _proxy_backward(ctx, float(d_value))


def proxy_nca(
    embeddings, labels, *, proxies, proxy_labels=None, temperature=0.11, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """ProxyNCA++ loss and its gradients; see :func:`proxy_nca_forward`."""
    value, ctx = proxy_nca_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels,
        temperature=temperature, reduction=reduction,
    )
    return value, proxy_nca_backward(ctx)


# Inside the square root of the SoftTriple regulariser, so that two coincident centres
# (s = 1) keep a finite gradient; the authors' code adds the same 1e-5.
_SOFT_TRIPLE_EPS = 1e-5


def _soft_triple_forward(
    x, labels, centers, center_labels, lambda_, gamma, tau, delta, reduction,
) -> tuple[float, ProxyLossContext]:
    n, m = x.shape[0], centers.shape[0]
    similarity, cosine_ctx = _cosine_forward(x, centers)
    classes = np.unique(center_labels)
    # Relaxed similarity per class: softmax(s / gamma)-weighted mean of its centres' s.
    relaxed = np.empty((n, classes.size))
    weight = np.empty((n, m))              # q_ik, the softmax within each class
    for c, cls in enumerate(classes):
        members = center_labels == cls
        _, q = _row_logsumexp(similarity[:, members] / gamma, np.ones((n, members.sum()), bool))
        weight[:, members] = q
        relaxed[:, c] = np.sum(q * similarity[:, members], axis=1)
    own = labels[:, None] == classes[None, :]
    logits = lambda_ * (relaxed - delta * own)
    lse, softmax = _row_logsumexp(logits, np.ones_like(own))
    terms = np.maximum(lse - logits[own], 0.0)
    value, d_terms = _reduce(terms, reduction)
    d_relaxed = lambda_ * d_terms[:, None] * (softmax - own)            # (n, C)
    class_of_center = np.searchsorted(classes, center_labels)
    # d S'_ic / d s_ik = q_ik (1 + (s_ik - S'_ic) / gamma) for centre k of class c.
    d_similarity = (
        d_relaxed[:, class_of_center] * weight
        * (1.0 + (similarity - relaxed[:, class_of_center]) / gamma)
    )

    # Regulariser: tau * sum_c sum_{t<s in c} sqrt(2 + eps - 2 <w_t, w_s>) / sum_c K_c (K_c - 1).
    counts = np.bincount(class_of_center)
    denominator = float(np.sum(counts * (counts - 1)))
    if tau == 0.0 or denominator == 0.0:
        return value, ProxyLossContext(cosine_ctx, d_similarity)
    center_similarity, center_ctx = _cosine_forward(centers, centers)
    pairs = np.triu(center_labels[:, None] == center_labels[None, :], k=1)
    root = np.sqrt(2.0 + _SOFT_TRIPLE_EPS - 2.0 * center_similarity[pairs])
    value += tau * float(np.sum(root)) / denominator
    d_regularizer = np.zeros((m, m))
    d_regularizer[pairs] = -tau / (denominator * root)
    return value, ProxyLossContext(cosine_ctx, d_similarity, center_ctx, d_regularizer)


def soft_triple_forward(
    embeddings, labels, *, proxies, proxy_labels=None, lambda_=20.0, gamma=0.1, tau=0.2,
    delta=0.01, reduction="mean",
) -> tuple[float, ProxyLossContext]:
    """SoftTriple loss (Qian et al. 2019, Eqs. 8-10 and the regulariser); ``(value, ctx)``.

    The proxies are the centres ``w_c^k`` (several per class through ``proxy_labels``).
    With cosine similarities ``s_ik = <x^_i, w^_k>``, for each class ``c``::

        S'_ic = sum_{k in c} q_ik s_ik,   q_ik = softmax_{k in c}(s_ik / gamma)
        l_i   = -log( exp(lambda (S'_iy - delta)) /
                      (exp(lambda (S'_iy - delta)) + sum_{c != y} exp(lambda S'_ic)) )

    and the loss is ``reduce_i l_i + tau R`` with the centre-spreading regulariser
    ``R = sum_c sum_{t<s} sqrt(2 + 1e-5 - 2 <w^_t, w^_s>) / sum_c K_c (K_c - 1)``. The paper
    prints the denominator ``C K (K - 1)`` (equal for ``K`` centres in every class) while
    the double sum has ``C K (K - 1) / 2`` terms, so ``R`` is half the mean pairwise
    distance; kept as printed (and as in the authors' code, which also adds the 1e-5).
    ``gamma`` is the paper's softmax temperature (its ``1 / gamma`` multiplies ``s``).
    ``R`` is 0 with one centre per class. The reduction applies to the ``l_i`` only.
    Defaults (20, 0.1, 0.2, 0.01) are the CUB-200 and In-shop values of ASAP App. A.2
    (Cars196 (17.69, 19.18, 0.0669, 0.3588), SOP (100, 47.9, 0.2, 0.3145)).
    ``lambda_`` is spelled with an underscore because ``lambda`` is a Python keyword.
    """
    x, y, p, p_labels = _check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    lambda_ = check_scalar(lambda_, "lambda_", low=0.0, low_inclusive=False)
    gamma = check_scalar(gamma, "gamma", low=0.0, low_inclusive=False)
    tau = check_scalar(tau, "tau", low=0.0)
    delta = check_scalar(delta, "delta", low=0.0)
    reduction = _check_reduction(reduction)
    return _soft_triple_forward(x, y, p, p_labels, lambda_, gamma, tau, delta, reduction)


def soft_triple_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients of the SoftTriple loss with respect to the embeddings and the centres."""
    return _proxy_backward(ctx, float(d_value))


def soft_triple(
    embeddings, labels, *, proxies, proxy_labels=None, lambda_=20.0, gamma=0.1, tau=0.2,
    delta=0.01, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """SoftTriple loss and its gradients; see :func:`soft_triple_forward`."""
    value, ctx = soft_triple_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels, lambda_=lambda_,
        gamma=gamma, tau=tau, delta=delta, reduction=reduction,
    )
    return value, soft_triple_backward(ctx)


# ------------------------------------------------------------------------ registration

# Registered inputs keep every hinge, mining threshold and argmax this far from its kink,
# so that central differences (step ~ 6e-6 |x|) never straddle one.
_KINK_GAP = 1e-3
_LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])


def _draw_away_from_kinks(rng: np.random.Generator, gap_fn, scale: float = 0.5) -> np.ndarray:
    for _ in range(1000):
        x = scale * rng.standard_normal((_LABELS.size, 4))
        # Also keep points apart: ||x_i - x_j|| has curvature 1 / d, which spoils central
        # differences for d close to the step.
        separated = np.min(_distances(x)[np.triu_indices(_LABELS.size, k=1)]) > 1e-2
        if separated and gap_fn(x) > _KINK_GAP:
            return x
    raise RuntimeError("could not draw inputs away from the kinks in 1000 tries")


def _distances(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)


def _cosines(x: np.ndarray) -> np.ndarray:
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    return unit @ unit.T


def _pair_gap(matrix: np.ndarray, pos_margin: float, neg_margin: float) -> float:
    rows, cols = np.triu_indices(_LABELS.size, k=1)
    same = _LABELS[rows] == _LABELS[cols]
    values = matrix[rows, cols]
    return float(np.min(np.abs(values - np.where(same, pos_margin, neg_margin))))


def _triplet_gap(x: np.ndarray, margin: float) -> float:
    d = _distances(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    pos = same & ~np.eye(_LABELS.size, dtype=bool)
    pre = d[:, :, None] - d[:, None, :] + margin
    gap = np.min(np.abs(pre[pos[:, :, None] & ~same[:, None, :]]))
    # Batch-hard: also a gap between the two largest positive / two smallest negative distances.
    for row in range(_LABELS.size):
        for values in (np.sort(d[row, pos[row]]), np.sort(d[row, ~same[row]])):
            if values.size > 1:
                gap = min(gap, float(np.min(np.diff(values))))
    return float(gap)


def _ms_gap(x: np.ndarray, mining_margin: float) -> float:
    s = _cosines(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    pos = same & ~np.eye(_LABELS.size, dtype=bool)
    gaps = []
    for i in range(_LABELS.size):
        gaps.append(np.abs(s[i, ~same[i]] + mining_margin - s[i, pos[i]].min()))
        gaps.append(np.abs(s[i, pos[i]] - mining_margin - s[i, ~same[i]].max()))
    return float(np.min(np.concatenate(gaps)))


def _contrastive_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(_distances(x), 0.2, 0.9))
    return {"embeddings": x, "labels": _LABELS, "pos_margin": 0.2, "neg_margin": 0.9}


def _contrastive_cosine_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(-_cosines(x), -1.0, -0.2))
    return {"embeddings": x, "labels": _LABELS, "form": "cosine", "neg_margin": 0.2}


def _generalized_contrastive_inputs(rng):
    # m+ = beta - alpha = 0.3, m- = beta + alpha = 0.9.
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(_distances(x), 0.3, 0.9))
    return {"embeddings": x, "labels": _LABELS, "alpha": 0.3, "beta": 0.6}


def _triplet_inputs(rng, mining):
    x = _draw_away_from_kinks(rng, lambda x: _triplet_gap(x, 0.4))
    return {"embeddings": x, "labels": _LABELS, "margin": 0.4, "mining": mining}


def _multi_similarity_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _ms_gap(x, 0.3))
    return {"embeddings": x, "labels": _LABELS, "mining_margin": 0.3}


def _proxy_inputs(rng, **hyper):
    # Two centres per class: the several-proxies-per-class case of ASAP.
    return {
        "embeddings": rng.standard_normal((_LABELS.size, 4)),
        "labels": _LABELS,
        "proxies": rng.standard_normal((8, 4)),
        "proxy_labels": np.repeat(np.arange(4), 2),
        **hyper,
    }


for _name, _loss, _make, _paper in (
    ("contrastive", contrastive, _contrastive_inputs,
     "C2 contrastive with positive margin (GSP supp. 1.6.6; ASAP Sec. 5)"),
    ("contrastive_cosine", contrastive, _contrastive_cosine_inputs,
     "C1 contrastive on cosine similarity (XBM; GSP supp. 1.6.7)"),
    ("generalized_contrastive", generalized_contrastive, _generalized_contrastive_inputs,
     "ASAP Eq. (4.2), generalized contrastive loss"),
    ("triplet", triplet, lambda rng: _triplet_inputs(rng, "all"),
     "triplet loss over all batch triplets (ASAP Sec. 5; GSP supp. 1.6.6)"),
    ("triplet_batch_hard", triplet, lambda rng: _triplet_inputs(rng, "batch_hard"),
     "triplet loss with batch-hard mining (Hermans et al. 2017)"),
    ("multi_similarity", multi_similarity, _multi_similarity_inputs,
     "multi-similarity loss, Wang et al. 2019 Eqs. 7-9"),
    ("proxy_anchor", proxy_anchor, lambda rng: _proxy_inputs(rng, alpha=8.0),
     "Proxy-Anchor loss, Kim et al. 2020 Eq. 4"),
    ("proxy_nca", proxy_nca, lambda rng: _proxy_inputs(rng, temperature=0.5),
     "ProxyNCA++ loss, Teh et al. 2020 Eq. 5"),
    ("soft_triple", soft_triple, lambda rng: _proxy_inputs(rng, lambda_=5.0, gamma=0.3, tau=0.5),
     "SoftTriple loss with regulariser, Qian et al. 2019 Eqs. 8-10"),
):
    register(OperatorSpec(
        name=f"losses.{_name}", forward=_loss, backward=None, make_inputs=_make,
        paper=_paper, is_loss=True,
    ))
