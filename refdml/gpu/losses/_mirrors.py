"""The public functions of :mod:`refdml.gpu.losses`: the nine losses' forward / backward
pairs and their one-call forms, each a few lines over the family's pieces.

A public forward validates once (the reference's checks and messages, through
:mod:`refdml._shared.losses`), chooses the masked log-sum-exp's implementation once where
it takes any (``lse = IMPLEMENTATIONS.choose(x)``: array path, CPU twin or CUDA kernel) and
runs all its log-sum-exps on that one, then reads straight through its loss's terms, which
sit beside it here: the terms are the same maths on every implementation, written once
against the backend (the pieces they share are in :mod:`refdml.gpu.losses._array` and
:mod:`refdml.gpu.losses._pairwise`). The value is reduced in float64 and left on the
device (:func:`_loss_value`); the context keeps ``d value / d matrix`` for the backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._backend import Backend, get_backend, to_numpy
from refdml._shared.losses import (
    SOFT_TRIPLE_EPS,
    check_contrastive_margins,
    check_generalized_margins,
    check_loss_context,
    check_multi_similarity,
    check_proxy_anchor_scales,
    check_proxy_nca_temperature,
    check_reduction,
    check_soft_triple_scales,
    cosine_gradient_overflow,
    finite_loss_message,
    hinge_cause,
    hyperparameter_cause,
)
from refdml._validation import (
    as_fast_array, check_choice, check_fast_upstream, check_scalar, data_checks, fast_labels,
    result_dtype,
)
from refdml.distances import CosineContext
from refdml.gpu.losses._array import (
    cosine_bound,
    exclusion,
    exp_fits,
    exp_limit,
    mean_terms,
    reduce_terms,
    terms_dtype,
    upper_pairs,
    upper_weights,
)
from refdml.gpu.linalg import matmul
from refdml.gpu.losses._kernels import IMPLEMENTATIONS
from refdml.gpu.distances import scaled_sq
from refdml.gpu.losses._pairwise import (
    cosine_backward_sum,
    cross_cosine,
    self_cosine,
    self_euclidean,
    self_pairwise_backward,
)
from refdml.gpu.normalize import is_ones_column, ones_column
from refdml.losses import LossGrads, PairwiseLossContext, ProxyLossContext, ProxyLossGrads

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
    "proxy_anchor",
    "proxy_anchor_backward",
    "proxy_anchor_forward",
    "proxy_contrastive",
    "proxy_contrastive_backward",
    "proxy_contrastive_forward",
    "proxy_multi_similarity",
    "proxy_multi_similarity_backward",
    "proxy_multi_similarity_forward",
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

_FORMS = ("euclidean", "cosine")
_MINING = ("all", "batch_hard")
# Largest 2 / gamma for which exp(-2 / gamma) is a normal number with room to spare.
_SHIFT_LIMIT = {"float32": 80.0, "float64": 700.0}


# ----------------------------------------------------------------------- input checks


def _embeddings_labels(embeddings, labels) -> tuple[Backend, Any, Any]:
    ns = get_backend(embeddings, labels)
    x = as_fast_array(embeddings, "embeddings", ndim=2, ns=ns)
    y = fast_labels(labels, "labels", ns, length=x.shape[0])
    return ns, x, y


def _proxy_inputs(embeddings, labels, proxies, proxy_labels):
    ns = get_backend(embeddings, labels, proxies, proxy_labels)
    xp = ns.xp
    dtype = result_dtype(embeddings, proxies) if hasattr(embeddings, "dtype") and hasattr(
        proxies, "dtype") else None
    x = as_fast_array(embeddings, "embeddings", ndim=2, dtype=dtype, ns=ns)
    y = fast_labels(labels, "labels", ns, length=x.shape[0])
    p = as_fast_array(proxies, "proxies", ndim=2, dtype=x.dtype, ns=ns)
    if p.shape[1] != x.shape[1]:
        raise ValueError(
            f"proxies have dimension {p.shape[1]} but embeddings have dimension {x.shape[1]} "
            f"(proxies.shape={tuple(p.shape)})"
        )
    if proxy_labels is None:
        p_labels = xp.arange(p.shape[0], dtype=xp.int64)
    else:
        p_labels = fast_labels(proxy_labels, "proxy_labels", ns)
        if p_labels.size != p.shape[0]:
            raise ValueError(
                f"proxy_labels has length {p_labels.size}, but there are {p.shape[0]} proxies "
                "(one label per proxy)"
            )
    same = y[:, None] == p_labels[None, :]        # (n, n_proxies): proxy k has i's class
    if data_checks(ns):
        if proxy_labels is None:                   # proxy k is class k
            covered = (y >= 0) & (y < p.shape[0])
        else:
            covered = xp.any(same, axis=1)
        if not bool(xp.all(covered)):
            missing = int(xp.min(xp.where(covered, xp.max(y), y)))
            raise ValueError(
                f"labels has class {missing}, which no proxy represents "
                f"(proxy_labels covers {int(xp.unique(p_labels).size)} classes)"
            )
    return ns, x, y, p, p_labels, same


def _d_value(ctx, d_value) -> Any:
    dtype = ctx.d_matrix.dtype if isinstance(ctx, PairwiseLossContext) else ctx.d_similarity.dtype
    ref = ctx.d_matrix if isinstance(ctx, PairwiseLossContext) else ctx.d_similarity
    return check_fast_upstream(d_value, "d_value", (), get_backend(ref), dtype)


def _pairwise_backward(ctx: PairwiseLossContext, d_value) -> LossGrads:
    ns = get_backend(ctx.d_matrix)
    upstream = _d_value(ctx, d_value)
    # Not finite only where it overflows (inf times 0 included): checked below.
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        g = upstream * ctx.d_matrix
        d_x = self_pairwise_backward(ns, ctx.metric_ctx, g)
        if not is_ones_column(ns, ctx.row_scale):
            d_x = d_x / ctx.row_scale
    if isinstance(ctx.metric_ctx, CosineContext):
        _check_gradient(ns, d_x, "embeddings", d_value=upstream)
    else:
        # The context holds x / s and D / s (scale-free): the gradient is d_value times a
        # sum of unit vectors weighted by d value / d D, finite at any scale of x.
        _check_gradient(ns, d_x, "embeddings", why=(
            f"it is d_value == {_shown(upstream)} times a sum of unit vectors, beyond "
            f"{np.dtype(d_x.dtype).name}; use a smaller d_value"))
    return LossGrads(embeddings=d_x)


def _proxy_backward(ctx: ProxyLossContext, d_value) -> ProxyLossGrads:
    ns = get_backend(ctx.d_similarity)
    upstream = _d_value(ctx, d_value)
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        g = (ctx.d_similarity if isinstance(upstream, float) and upstream == 1.0
             else upstream * ctx.d_similarity)
        d_x, d_p = cosine_backward_sum(ns, ctx.cosine_ctx, g)
        if ctx.regularizer_ctx is not None:
            d_p = d_p + self_pairwise_backward(ns, ctx.regularizer_ctx,
                                               upstream * ctx.d_regularizer)
        if not is_ones_column(ns, ctx.embedding_scale):
            d_x = d_x / ctx.embedding_scale
        if not is_ones_column(ns, ctx.proxy_scale):
            d_p = d_p / ctx.proxy_scale
    _check_gradient(ns, d_x, "embeddings", d_value=upstream)
    _check_gradient(ns, d_p, "proxies", d_value=upstream)
    return ProxyLossGrads(embeddings=d_x, proxies=d_p)


def _shown(d_value: Any) -> str:
    return repr(d_value) if isinstance(d_value, float) else str(to_numpy(d_value))


def _check_gradient(ns: Backend, gradient: Any, name: str, why: str | None = None,
                    d_value: Any = 1.0) -> None:
    """The reference's ValueError for a gradient beyond the dtype (on CuPy: one
    synchronisation, while data checks are on); a ``d_value`` beyond 1 in magnitude is
    named beside the cosine's cause, as it scales the gradient."""
    if not data_checks(ns) or bool(ns.xp.all(ns.xp.isfinite(gradient))):
        return
    dtype_name = np.dtype(gradient.dtype).name
    if why is None:
        message = cosine_gradient_overflow(to_numpy(gradient), name, dtype_name)
        if not abs(float(d_value)) <= 1.0:
            message += f" (or use a smaller d_value: d_value == {_shown(d_value)} scales it)"
        raise ValueError(message)
    host = to_numpy(gradient)
    row = int(np.flatnonzero(~np.all(np.isfinite(host), axis=-1))[0])
    raise ValueError(f"the gradient with respect to {name} overflows {dtype_name} at row {row}: "
                     f"{why}")


def _loss_value(value: Any, reduction: str, cause) -> Any:
    """The loss value: a Python float on NumPy (and where a forward has read it already), a
    0-d float64 array on CuPy, not read (no synchronisation). Beyond float64 the
    reference's ValueError, ``cause()`` naming the parameters; on CuPy a data check."""
    if isinstance(value, float):
        finite = np.isfinite(value)
    else:
        ns = get_backend(value)
        value = value[()]          # NumPy: a scalar; CuPy: still a 0-d device array
        if isinstance(value, np.generic):
            value = float(value)
            finite = np.isfinite(value)
        else:
            finite = not data_checks(ns) or bool(ns.xp.isfinite(value))
    if not finite:
        raise ValueError(
            f"the loss value (reduction={reduction!r}) exceeds the float64 range: {cause()}"
        )
    return value


def _check_finite_loss(ns: Backend, arrays, loss: str, hyperparameters: dict,
                       dtype: Any) -> None:
    """The saved derivatives of a cosine loss finite (as the reference checks), on NumPy
    and on CuPy while data checks are on (one synchronisation)."""
    if data_checks(ns) and not all(bool(ns.xp.all(ns.xp.isfinite(a))) for a in arrays):
        raise ValueError(finite_loss_message(loss, hyperparameters, dtype))


# ------------------------------------------------------------------ pair hinge losses


def _pair_hinge_forward(ns, x, labels, pos_margin, neg_margin, form, reduction, loss):
    if form == "euclidean":
        matrix, metric_ctx, scale = self_euclidean(ns, x)
    else:
        matrix, metric_ctx, scale = self_cosine(ns, x)
    upper = upper_pairs(ns, x.shape[0])
    same = labels[:, None] == labels[None, :]
    value, d_matrix = _hinge_terms(ns, matrix, same, pos_margin, neg_margin, form, reduction,
                                   x.dtype, pairs=upper)
    ctx = PairwiseLossContext(loss=loss, metric_ctx=metric_ctx, d_matrix=d_matrix,
                              row_scale=scale)

    def cause() -> str:
        return hinge_cause(to_numpy(matrix[upper]), pos_margin, neg_margin)

    return _loss_value(value, reduction, cause), ctx


def _hinge_terms(ns, matrix, same, pos_margin, neg_margin, form, reduction, dtype, pairs=None):
    """The contrastive hinges on ``matrix`` (distances, or cosines for ``form="cosine"``,
    where the metric's sign flips): the value (not read) and d value / d matrix in
    ``dtype``. ``pairs``: the upper-triangular mask of a set with itself (its ``(n, n)``
    matrix holds each pair once above the diagonal); None: every entry is a pair."""
    xp = ns.xp
    sign = 1.0 if form == "euclidean" else -1.0
    dt = terms_dtype(dtype, pos_margin, neg_margin).type
    # iota = +1 positives, -1 negatives: pre = sign iota (matrix - margin of the pair), as
    # sign iota matrix - sign iota margin (multiplications by +-1 are exact); each factor
    # one where over the pairs.
    signed = xp.where(same, dt(sign), dt(-sign))
    signed_margin = xp.where(same, dt(sign * pos_margin), dt(-sign * neg_margin))
    pre = signed * matrix
    pre -= signed_margin
    active = pre > 0
    if pairs is not None:
        active &= pairs
    terms = pre * active
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if reduction == "mean" and pairs is not None:
            # The pairs i < j number n (n - 1) / 2, known on the host: no count on the
            # device, and d mean / d terms is a kept constant.
            n = matrix.shape[0]
            value = mean_terms(ns, terms, float(max(n * (n - 1) // 2, 1)))
            d_terms = upper_weights(ns, n, terms.dtype)
        else:
            value, d_terms = reduce_terms(ns, terms, reduction, pairs)
    return value, (d_terms * (signed * active)).astype(dtype, copy=False)


def contrastive_forward(
    embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean", reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """Contrastive loss (C2 Euclidean or C1 cosine); see :func:`refdml.losses.contrastive_forward`.

    Returns ``(value, ctx)``, ``value`` a Python float on NumPy, a 0-d float64 array on CuPy.
    """
    ns, x, y = _embeddings_labels(embeddings, labels)
    form = check_choice(form, "form", _FORMS)
    reduction = check_reduction(reduction)
    pos_margin, neg_margin = check_contrastive_margins(form, pos_margin, neg_margin)
    return _pair_hinge_forward(ns, x, y, pos_margin, neg_margin, form, reduction, "contrastive")


def contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` of ``d_value * value`` of the contrastive loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "contrastive")
    return _pairwise_backward(ctx, d_value)


def contrastive(embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean",
                reduction="mean") -> tuple[float, LossGrads]:
    """Contrastive loss and its gradient; see :func:`contrastive_forward`."""
    value, ctx = contrastive_forward(embeddings, labels, pos_margin=pos_margin,
                                     neg_margin=neg_margin, form=form, reduction=reduction)
    return value, contrastive_backward(ctx)


def generalized_contrastive_forward(
    embeddings, labels, *, alpha, beta, reduction="mean",
) -> tuple[float, PairwiseLossContext]:
    """ASAP Eq. (4.2): C2 with ``m+ = beta - alpha``, ``m- = beta + alpha``; ``(value, ctx)``."""
    ns, x, y = _embeddings_labels(embeddings, labels)
    reduction = check_reduction(reduction)
    alpha, beta = check_generalized_margins(alpha, beta)
    return _pair_hinge_forward(ns, x, y, beta - alpha, beta + alpha, "euclidean", reduction,
                               "generalized_contrastive")


def generalized_contrastive_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` of ``d_value * value`` of the generalized contrastive loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "generalized_contrastive")
    return _pairwise_backward(ctx, d_value)


def generalized_contrastive(embeddings, labels, *, alpha, beta, reduction="mean"):
    """ASAP Eq. (4.2) loss and gradient; see :func:`generalized_contrastive_forward`."""
    value, ctx = generalized_contrastive_forward(embeddings, labels, alpha=alpha, beta=beta,
                                                 reduction=reduction)
    return value, generalized_contrastive_backward(ctx)


# ----------------------------------------------------------------------------- triplet


def _triplet_terms(ns, distance, positive, negative, order, margin, mining, reduction, dtype):
    """The triplet terms in ``distance``'s dtype: ``(value, terms, d_matrix)``, ``d_matrix``
    (d value / d distance) cast to ``dtype``. ``order``: the positives of each anchor first
    (``mining="all"``), else None."""
    xp = ns.xp
    n = distance.shape[0]
    rows = xp.arange(n)[:, None]
    work = distance.dtype
    if mining == "all":
        is_pos = xp.take_along_axis(positive, order, axis=1)                # (n, P)
        d_ap = xp.take_along_axis(distance, order, axis=1)
        valid = is_pos[:, :, None] & negative[:, None, :]                   # (n, P, n)
        with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
            pre = d_ap[:, :, None] - distance[:, None, :] + margin
            terms = xp.where(valid, xp.maximum(pre, 0), 0).astype(work, copy=False)
            value, d_terms = reduce_terms(ns, terms, reduction, valid)
        active = xp.where(pre > 0, d_terms, 0).astype(dtype, copy=False)
        d_matrix = -xp.sum(active, axis=1)
        # ``order`` is a permutation per row: the assignment never collides.
        d_pos = xp.zeros_like(d_matrix)
        d_pos[rows, order] = xp.sum(active, axis=2)
        return value, terms, d_matrix + d_pos
    valid = xp.any(positive, axis=1) & xp.any(negative, axis=1)
    pos = xp.argmax(distance - exclusion(ns, positive, work), axis=1)
    neg = xp.argmin(distance + exclusion(ns, negative, work), axis=1)
    d_ap = xp.take_along_axis(distance, pos[:, None], axis=1)[:, 0]
    d_an = xp.take_along_axis(distance, neg[:, None], axis=1)[:, 0]
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        pre = d_ap - d_an + margin
        terms = xp.where(valid, xp.maximum(pre, 0), 0).astype(work, copy=False)
        value, d_terms = reduce_terms(ns, terms, reduction, valid)
    active = xp.where(pre > 0, d_terms, 0).astype(dtype, copy=False)
    # pos != neg on every row (same class vs not): the two assignments never collide.
    d_matrix = xp.zeros((n, n), dtype=dtype)
    d_matrix[rows[:, 0], pos] = active
    d_matrix[rows[:, 0], neg] = -active
    return value, terms, d_matrix


def _triplet_forward(ns, x, labels, margin, mining, reduction):
    xp = ns.xp
    n = x.shape[0]
    distance, metric_ctx, scale = self_euclidean(ns, x)
    same = labels[:, None] == labels[None, :]
    positive = same & ~xp.eye(n, dtype=bool)
    negative = ~same
    order = None
    if mining == "all":
        # The positives of each anchor first (stable sort), padded to P columns.
        width = int(xp.max(xp.sum(positive, axis=1)))  # label bookkeeping: one sync
        order = xp.argsort(~positive, axis=1, kind="stable")[:, :width]
    args = (positive, negative, order, margin, mining, reduction, x.dtype)
    work = terms_dtype(x.dtype, margin)
    value, terms, d_matrix = _triplet_terms(ns, distance.astype(work, copy=False), *args)
    with np.errstate(over="ignore", invalid="ignore"):
        out = float(value)                             # the sync of the value
    if not np.isfinite(out) and work != np.float64 and not bool(xp.all(xp.isfinite(terms))):
        # A float32 term d_ap + margin beyond float32 (both in range): float64 holds it,
        # as in the reference; the gradient (+-1 / count) is O(1) either way.
        value, terms, d_matrix = _triplet_terms(ns, distance.astype(np.float64), *args)
        with np.errstate(over="ignore", invalid="ignore"):
            out = float(value)
    ctx = PairwiseLossContext(loss="triplet", metric_ctx=metric_ctx, d_matrix=d_matrix,
                              row_scale=scale)

    def cause() -> str:
        largest = float(xp.max(distance)) if distance.size else 0.0
        if margin > largest:
            return f"the margin is too large (margin == {margin!r}, largest distance {largest:.3g})"
        return f"the embeddings are too far apart (largest distance {largest:.3g})"

    if not np.isfinite(out) and not bool(xp.all(xp.isfinite(terms))):
        raise ValueError(
            f"a triplet term d_ap - d_an + margin exceeds the float64 range: {cause()}"
        )
    return _loss_value(out, reduction, cause), ctx


def triplet_forward(embeddings, labels, *, margin=0.0961, mining="all", reduction="mean"):
    """Triplet loss (``"all"`` triplets or ``"batch_hard"``); see
    :func:`refdml.losses.triplet_forward`. ``(value, ctx)``; one sync (two with ``"all"``)."""
    ns, x, y = _embeddings_labels(embeddings, labels)
    margin = check_scalar(margin, "margin", low=0.0, low_inclusive=False)
    mining = check_choice(mining, "mining", _MINING)
    reduction = check_reduction(reduction)
    return _triplet_forward(ns, x, y, margin, mining, reduction)


def triplet_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` of ``d_value * value`` of the triplet loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "triplet")
    return _pairwise_backward(ctx, d_value)


def triplet(embeddings, labels, *, margin=0.0961, mining="all", reduction="mean"):
    """Triplet loss and its gradient; see :func:`triplet_forward`."""
    value, ctx = triplet_forward(embeddings, labels, margin=margin, mining=mining,
                                 reduction=reduction)
    return value, triplet_backward(ctx)


# -------------------------------------------------------------------- multi-similarity


def _multi_similarity_forward(ns, lse_impl, x, labels, alpha, beta, base, mining_margin,
                              reduction):
    xp = ns.xp
    s, metric_ctx, scale = self_cosine(ns, x)
    same = labels[:, None] == labels[None, :]
    value, d_matrix, cause = _multi_similarity_terms(
        ns, lse_impl, s, same & ~xp.eye(x.shape[0], dtype=bool), ~same, alpha, beta, base,
        mining_margin, reduction, x.dtype)
    ctx = PairwiseLossContext(loss="multi_similarity", metric_ctx=metric_ctx, d_matrix=d_matrix,
                              row_scale=scale)
    return _loss_value(value, reduction, cause), ctx


def _multi_similarity_terms(ns, lse_impl, s, positive, negative, alpha, beta, base,
                            mining_margin, reduction, dtype):
    """Multi-similarity with each row of ``s`` an anchor and ``positive`` / ``negative`` its
    candidates: the value (not read), d value / d s in ``dtype``, and the cause of a value
    beyond float64 (for :func:`_loss_value`)."""
    xp = ns.xp
    valid = xp.any(positive, axis=1) & xp.any(negative, axis=1)
    hardest_pos = xp.min(s + exclusion(ns, positive, dtype), axis=1)
    hardest_neg = xp.max(s - exclusion(ns, negative, dtype), axis=1)
    # Cosines lie in [-1, 1] (to rounding): any margin beyond 4 mines every pair, as 4
    # does, and 4 is a number of every dtype (1e300 is not a float32).
    mining_margin = min(mining_margin, 4.0)
    mined_neg = negative & (s + mining_margin > hardest_pos[:, None])
    mined_pos = positive & (s - mining_margin < hardest_neg[:, None])
    keep = xp.any(mined_neg, axis=1) & xp.any(mined_pos, axis=1)
    mined_pos &= keep[:, None]
    mined_neg &= keep[:, None]
    # |s - base| <= 2: logits beyond the dtype (float32, alpha > 1.7e38) are taken in float64.
    logits = s.astype(terms_dtype(dtype, 2.0 * alpha, 2.0 * beta), copy=False) - base
    lse_pos, w_pos = lse_impl.masked_logsumexp(-alpha * logits, mined_pos, extra_zero=True)
    lse_neg, w_neg = lse_impl.masked_logsumexp(beta * logits, mined_neg, extra_zero=True)
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        # The (n,) terms in float64: lse / alpha ~ log(n) / alpha is beyond float32 for a
        # small alpha, while the gradient (softmax weights) is O(1) at any alpha.
        terms = xp.where(keep, lse_pos.astype(xp.float64) / alpha
                         + lse_neg.astype(xp.float64) / beta, 0)
        value, d_terms = reduce_terms(ns, terms, reduction, valid)
    d_s = (d_terms[:, None] * (w_neg - w_pos)).astype(dtype, copy=False)

    def cause() -> str:
        return (f"alpha == {alpha!r} or beta == {beta!r} is too small for a sum of "
                f"{int(xp.sum(keep))} terms log(1 + sum exp(...)) / alpha (or / beta)")

    return value, d_s, cause


def multi_similarity_forward(embeddings, labels, *, alpha=2.0, beta=40.0, base=0.5,
                             mining_margin=0.1, reduction="mean"):
    """Multi-similarity loss (Wang et al. 2019); see
    :func:`refdml.losses.multi_similarity_forward`. ``(value, ctx)``."""
    ns, x, y = _embeddings_labels(embeddings, labels)
    # The reference's checks, its scales' in float64: the terms are float64 in either dtype.
    hyperparameters = check_multi_similarity(alpha, beta, base, mining_margin, reduction,
                                             x.shape[0])
    return _multi_similarity_forward(ns, IMPLEMENTATIONS.choose(x), x, y, *hyperparameters)


def multi_similarity_backward(ctx: PairwiseLossContext, d_value=1.0) -> LossGrads:
    """Gradient ``.embeddings`` of ``d_value * value`` of the multi-similarity loss."""
    ctx = check_loss_context(ctx, PairwiseLossContext, "multi_similarity")
    return _pairwise_backward(ctx, d_value)


def multi_similarity(embeddings, labels, *, alpha=2.0, beta=40.0, base=0.5,
                     mining_margin=0.1, reduction="mean"):
    """Multi-similarity loss and its gradient; see :func:`multi_similarity_forward`."""
    value, ctx = multi_similarity_forward(embeddings, labels, alpha=alpha, beta=beta, base=base,
                                          mining_margin=mining_margin, reduction=reduction)
    return value, multi_similarity_backward(ctx)


# ------------------------------------------------------------------------ proxy losses


def _proxy_ctx(ns, loss, x, p, cosine_ctx, d_similarity, regularizer_ctx=None,
               d_regularizer=None):
    return ProxyLossContext(
        loss=loss, cosine_ctx=cosine_ctx, d_similarity=d_similarity.astype(x.dtype, copy=False),
        embedding_scale=ones_column(ns, x.shape[0], x.dtype),
        proxy_scale=ones_column(ns, p.shape[0], x.dtype),
        regularizer_ctx=regularizer_ctx, d_regularizer=d_regularizer,
    )


def proxy_anchor_forward(embeddings, labels, *, proxies, proxy_labels=None, delta=0.1,
                         alpha=32.0, reduction="mean"):
    """Proxy-Anchor loss (Kim et al. 2020, Eq. 4); see
    :func:`refdml.losses.proxy_anchor_forward`. ``(value, ctx)``."""
    ns, x, y, p, p_labels, same = _proxy_inputs(embeddings, labels, proxies, proxy_labels)
    delta = check_scalar(delta, "delta", low=0.0)
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    reduction = check_reduction(reduction)
    check_proxy_anchor_scales(alpha, delta, x.shape[0], x.dtype)
    lse_impl = IMPLEMENTATIONS.choose(x)
    similarity, cosine_ctx = cross_cosine(ns, x, p)
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        value, d_similarity = _proxy_anchor_terms(ns, lse_impl, x, similarity, same, alpha,
                                                  delta, reduction)
    hyperparameters = {"alpha": alpha, "delta": delta}
    value = _loss_value(value, reduction, hyperparameter_cause("proxy_anchor", **hyperparameters))
    _check_finite_loss(ns, [d_similarity], "proxy_anchor", hyperparameters, x.dtype)
    return value, _proxy_ctx(ns, "proxy_anchor", x, p, cosine_ctx, d_similarity)


def _proxy_anchor_terms(ns, lse_impl, x, similarity, same, alpha, delta, reduction):
    """The Proxy-Anchor value (a device scalar) and ``d value / d similarity``."""
    xp = ns.xp
    if exp_fits(x.dtype, alpha * cosine_bound(x.dtype, x.shape[1]), x.shape[0]) and (
            alpha * delta <= exp_limit(x.dtype)):
        # Arithmetic path (no ``where``): shifted by alpha * delta, the logits of both sums
        # are +-alpha * s, bounded, so E = exp(alpha s) and 1 / E are normal numbers and
        # the masks are 0/1 factors; the extra logit 0 becomes exp(-alpha delta).
        same_f = same.astype(x.dtype)
        with ns.errstate(over="ignore", divide="ignore"):
            e_neg = xp.exp(alpha * similarity)
        e_pos = same_f / e_neg              # positives: exp(-alpha (s - delta) - alpha delta)
        e_neg -= e_neg * same_f             # negatives: exp(alpha (s + delta) - alpha delta)
        extra = float(np.exp(-alpha * delta))
        total_pos = xp.sum(e_pos, axis=0) + extra
        total_neg = xp.sum(e_neg, axis=0) + extra
        lse_pos = xp.log(total_pos) + alpha * delta
        lse_neg = xp.log(total_neg) + alpha * delta
        value_pos, d_pos = reduce_terms(ns, lse_pos, reduction, xp.any(same, axis=0))
        value_neg, d_neg = reduce_terms(ns, lse_neg, reduction)
        d_similarity = e_neg * (alpha * d_neg / total_neg)
        d_similarity -= e_pos * (alpha * d_pos / total_pos)
    else:
        # Large alpha: the shifted masked log-sum-exp (``where`` masks), per proxy row.
        same_t = same.T                                             # (n_proxies, n)
        lse_pos, w_pos = lse_impl.masked_logsumexp(-alpha * (similarity.T - delta), same_t,
                                                   extra_zero=True)
        lse_neg, w_neg = lse_impl.masked_logsumexp(alpha * (similarity.T + delta), ~same_t,
                                                   extra_zero=True)
        value_pos, d_pos = reduce_terms(ns, lse_pos, reduction, xp.any(same_t, axis=1))
        value_neg, d_neg = reduce_terms(ns, lse_neg, reduction)
        d_similarity = alpha * (d_neg[:, None] * w_neg - d_pos[:, None] * w_pos).T
    return value_pos + value_neg, d_similarity


def proxy_anchor_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (Proxy-Anchor)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_anchor")
    return _proxy_backward(ctx, d_value)


def proxy_anchor(embeddings, labels, *, proxies, proxy_labels=None, delta=0.1, alpha=32.0,
                 reduction="mean"):
    """Proxy-Anchor loss and its gradients; see :func:`proxy_anchor_forward`."""
    value, ctx = proxy_anchor_forward(embeddings, labels, proxies=proxies,
                                      proxy_labels=proxy_labels, delta=delta, alpha=alpha,
                                      reduction=reduction)
    return value, proxy_anchor_backward(ctx)


def proxy_nca_forward(embeddings, labels, *, proxies, proxy_labels=None, temperature=0.11,
                      reduction="mean"):
    """ProxyNCA++ loss (Teh et al. 2020, Eq. 5); see :func:`refdml.losses.proxy_nca_forward`."""
    ns, x, y, p, p_labels, same = _proxy_inputs(embeddings, labels, proxies, proxy_labels)
    temperature = check_scalar(temperature, "temperature", low=0.0, low_inclusive=False)
    reduction = check_reduction(reduction)
    check_proxy_nca_temperature(temperature, x.dtype)
    lse_impl = IMPLEMENTATIONS.choose(x)
    similarity, cosine_ctx = cross_cosine(ns, x, p)
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        value, d_similarity = _proxy_nca_terms(ns, lse_impl, x, p, similarity, same,
                                               temperature, reduction)
    hyperparameters = {"temperature": temperature}
    value = _loss_value(value, reduction, hyperparameter_cause("proxy_nca", **hyperparameters))
    _check_finite_loss(ns, [d_similarity], "proxy_nca", hyperparameters, x.dtype)
    return value, _proxy_ctx(ns, "proxy_nca", x, p, cosine_ctx, d_similarity)


def _proxy_nca_terms(ns, lse_impl, x, p, similarity, same, temperature, reduction):
    """The ProxyNCA++ value (a device scalar) and ``d value / d similarity``."""
    xp = ns.xp
    # The logits -(2 - 2 s) / T are logit_slope * s - logit_slope: d logit / d s.
    logit_slope = 2 / temperature
    if exp_fits(x.dtype, logit_slope * cosine_bound(x.dtype, x.shape[1]), p.shape[0]):
        # Arithmetic path (no ``where``): the logits -(2 - 2 s) / T shifted by 2 / T are
        # (2 / T) s, bounded, so E = exp(2 s / T) are normal numbers, the positive mask
        # is a 0/1 factor, and the shift cancels in lse_all - lse_pos.
        with ns.errstate(over="ignore", divide="ignore"):
            e_all = xp.exp(logit_slope * similarity)
        e_pos = e_all * same.astype(x.dtype)
        total_all = xp.sum(e_all, axis=1)
        total_pos = xp.sum(e_pos, axis=1)
        terms = xp.maximum(xp.log(total_all) - xp.log(total_pos), 0)
        value, d_terms = reduce_terms(ns, terms, reduction)
        d_terms = logit_slope * d_terms
        d_similarity = e_all * (d_terms / total_all)[:, None]
        d_similarity -= e_pos * (d_terms / total_pos)[:, None]
    else:
        # Small temperature: the shifted masked log-sum-exp.
        logits = -(2 - 2 * similarity) / temperature
        lse_all, softmax_all = lse_impl.masked_logsumexp(logits)
        lse_pos, softmax_pos = lse_impl.masked_logsumexp(logits, same)
        terms = xp.maximum(lse_all - lse_pos, 0)
        value, d_terms = reduce_terms(ns, terms, reduction)
        d_similarity = logit_slope * d_terms[:, None] * (softmax_all - softmax_pos)
    return value, d_similarity


def proxy_nca_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (ProxyNCA++)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_nca")
    return _proxy_backward(ctx, d_value)


def proxy_nca(embeddings, labels, *, proxies, proxy_labels=None, temperature=0.11,
              reduction="mean"):
    """ProxyNCA++ loss and its gradients; see :func:`proxy_nca_forward`."""
    value, ctx = proxy_nca_forward(embeddings, labels, proxies=proxies,
                                   proxy_labels=proxy_labels, temperature=temperature,
                                   reduction=reduction)
    return value, proxy_nca_backward(ctx)


def soft_triple_forward(embeddings, labels, *, proxies, proxy_labels=None, lambda_=20.0,
                        gamma=0.1, tau=0.2, delta=0.01, reduction="mean"):
    """SoftTriple loss with its regulariser (Qian et al. 2019); see
    :func:`refdml.losses.soft_triple_forward`. The per-class softmax over the centres is
    one masked log-sum-exp over an ``(n, m, m)`` block (:func:`_centre_classes`: no
    ``unique``, whose size a device cannot know without a synchronisation). On CuPy the
    value is a 0-d device array, read (one synchronisation, both checks) only while the
    data checks are on; inside a training step they are the step's, and the forward reads
    nothing (a captured step can hold it)."""
    ns, x, y, p, p_labels, same = _proxy_inputs(embeddings, labels, proxies, proxy_labels)
    lambda_ = check_scalar(lambda_, "lambda_", low=0.0, low_inclusive=False)
    gamma = check_scalar(gamma, "gamma", low=0.0, low_inclusive=False)
    tau = check_scalar(tau, "tau", low=0.0)
    delta = check_scalar(delta, "delta", low=0.0)
    reduction = check_reduction(reduction)
    check_soft_triple_scales(lambda_, gamma, delta, x.dtype)
    hyperparameters = {"lambda_": lambda_, "gamma": gamma, "tau": tau, "delta": delta}
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
        result = _soft_triple_terms(ns, IMPLEMENTATIONS.choose(x), x, y, p, p_labels, lambda_,
                                    gamma, tau, delta, reduction)
    value = result.value
    if data_checks(ns):
        # As the reference: the reduction of the terms first, then the regulariser's share;
        # both reach the host in one transfer (the forward's one synchronisation).
        value_terms, value = ns.xp.stack([result.value_terms, result.value]).tolist()
        _loss_value(value_terms, reduction,
                    hyperparameter_cause("soft_triple", **hyperparameters))
        if not np.isfinite(value):
            raise ValueError(finite_loss_message("soft_triple", hyperparameters, x.dtype))
    _check_finite_loss(ns, result.derivatives, "soft_triple", hyperparameters, x.dtype)
    return value, result.ctx


def _centre_classes(ns: Backend, p_labels: Any) -> tuple[Any, Any]:
    """``(member, first)`` of the centres' classes without ``unique``: ``first`` (m,) bool,
    centre ``r`` is the first of its class; ``member`` (m, m), ``member[r, i] = 1`` where
    centre ``i``'s class has its first centre at ``r``. A first centre's row is its class's
    row of the reference's (C, m) membership (the classes in the order of their first
    centre, not sorted; the sums over classes take their terms in that order); every other
    row is 0. Fixed shapes, no synchronisation."""
    xp = ns.xp
    m = p_labels.shape[0]
    centres = xp.arange(m)
    leader = xp.argmax(p_labels[:, None] == p_labels[None, :], axis=1)   # the class's first
    first = leader == centres
    member = leader[None, :] == centres[:, None]
    return member, first


@dataclass(frozen=True)
class _SoftTripleTerms:
    """What :func:`_soft_triple_terms` computes: the reduction of the terms and the value
    with the regulariser's share (0-d device arrays, not yet read), the context, and the
    derivative arrays it keeps (checked finite by the forward)."""

    value_terms: Any
    value: Any
    ctx: ProxyLossContext
    derivatives: tuple


def _soft_triple_terms(ns, lse_impl, x, y, p, p_labels, lambda_, gamma, tau, delta,
                       reduction) -> _SoftTripleTerms:
    """The SoftTriple terms, their value and the context (:class:`_SoftTripleTerms`)."""
    xp = ns.xp
    s, cosine_ctx = cross_cosine(ns, x, p)
    # The classes as the centres that come first in them: the rows of a class are those
    # of ``first``; the others are empty and masked out of every sum over classes.
    member, first = _centre_classes(ns, p_labels)
    member = member.astype(x.dtype)                                       # (m, m)
    if 2 / gamma <= _SHIFT_LIMIT[np.dtype(x.dtype).name]:
        # s in [-1, 1]: one shift 1 / gamma for every class keeps exp(s / gamma - 1 / gamma)
        # in [exp(-2 / gamma), 1], normal numbers; class sums are one matrix product.
        with ns.errstate(over="ignore", divide="ignore"):
            weights = xp.exp((s - 1) / gamma)
        total = matmul(ns, weights, member.T)                             # (n, m): 0 off first
        relaxed = matmul(ns, weights * s, member.T) / xp.where(first, total, 1)
        weight = weights / matmul(ns, total, member)                      # q_ik, (n, m)
    else:
        # Small gamma: the per-class shift of the masked log-sum-exp, an (n, m, m) block.
        _, q = lse_impl.masked_logsumexp((s / gamma)[:, None, :], member[None, :, :] > 0)
        weight = xp.sum(q, axis=1)
        relaxed = xp.sum(q * s[:, None, :], axis=2)
    own = (y[:, None] == p_labels[None, :]) & first                      # (n, m)
    logits = lambda_ * (relaxed - delta * own)
    lse, softmax = lse_impl.masked_logsumexp(logits, xp.broadcast_to(first, logits.shape))
    terms = xp.maximum(lse - xp.sum(xp.where(own, logits, 0), axis=1), 0)
    value, d_terms = reduce_terms(ns, terms, reduction)
    d_relaxed = lambda_ * d_terms[:, None] * (softmax - own)
    d_similarity = (matmul(ns, d_relaxed, member) * weight
                    * (1 + (s - matmul(ns, relaxed, member)) / gamma))
    if tau == 0.0:
        ctx = _proxy_ctx(ns, "soft_triple", x, p, cosine_ctx, d_similarity)
        return _SoftTripleTerms(value_terms=value, value=value, ctx=ctx,
                                derivatives=(d_similarity,))
    # Regulariser over the pairs t < s of centres of one class (none: 0, no sync needed).
    counts = xp.sum(member, axis=1)
    denominator = xp.sum(counts * (counts - 1))
    safe = xp.maximum(denominator, 1)
    p_unit, p_norm_ctx = cosine_ctx.y_unit, cosine_ctx.y_norm_ctx
    center_sim = matmul(ns, p_unit, p_unit.T)
    center_ctx = CosineContext(x_unit=p_unit, y_unit=p_unit, x_norm_ctx=p_norm_ctx,
                               y_norm_ctx=p_norm_ctx, shape=tuple(center_sim.shape))
    pairs = (p_labels[:, None] == p_labels[None, :]) & upper_pairs(ns, p.shape[0])
    root = xp.sqrt(xp.where(pairs, 2 + SOFT_TRIPLE_EPS - 2 * center_sim, 1))
    regularized = value + tau * xp.sum(xp.where(pairs, root, 0), dtype=xp.float64) / safe
    d_regularizer = xp.where(pairs, -tau / (safe * root), 0).astype(x.dtype, copy=False)
    ctx = _proxy_ctx(ns, "soft_triple", x, p, cosine_ctx, d_similarity, center_ctx,
                     d_regularizer)
    return _SoftTripleTerms(value_terms=value, value=regularized, ctx=ctx,
                            derivatives=(d_similarity, d_regularizer))


def soft_triple_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` (the centres) of ``d_value * value``."""
    ctx = check_loss_context(ctx, ProxyLossContext, "soft_triple")
    return _proxy_backward(ctx, d_value)


def soft_triple(embeddings, labels, *, proxies, proxy_labels=None, lambda_=20.0, gamma=0.1,
                tau=0.2, delta=0.01, reduction="mean"):
    """SoftTriple loss and its gradients; see :func:`soft_triple_forward`."""
    value, ctx = soft_triple_forward(embeddings, labels, proxies=proxies,
                                     proxy_labels=proxy_labels, lambda_=lambda_, gamma=gamma,
                                     tau=tau, delta=delta, reduction=reduction)
    return value, soft_triple_backward(ctx)


# ------------------------------------------------ pair losses between samples and proxies


def proxy_contrastive_forward(embeddings, labels, *, proxies, proxy_labels=None,
                              pos_margin=None, neg_margin=None, form="euclidean",
                              reduction="mean"):
    """Contrastive loss over every (sample, proxy) pair, on unit rows; see
    :func:`refdml.losses.proxy_contrastive_forward`. ``(value, ctx)``."""
    ns, x, y, p, p_labels, same = _proxy_inputs(embeddings, labels, proxies, proxy_labels)
    form = check_choice(form, "form", _FORMS)
    reduction = check_reduction(reduction)
    pos_margin, neg_margin = check_contrastive_margins(form, pos_margin, neg_margin)
    similarity, cosine_ctx = cross_cosine(ns, x, p)
    if form == "cosine":
        matrix = similarity
        value, d_similarity = _hinge_terms(ns, similarity, same, pos_margin, neg_margin, form,
                                           reduction, x.dtype)
    else:
        # The unit rows' distances, near pairs refined where the backend refines (as the
        # reference's); d d / d s = -1 / d, subgradient 0 at d = 0.
        matrix = ns.xp.sqrt(scaled_sq(ns, cosine_ctx.x_unit, cosine_ctx.y_unit, False))
        value, d_distance = _hinge_terms(ns, matrix, same, pos_margin, neg_margin, form,
                                         reduction, x.dtype)
        coincident = matrix == 0
        d_similarity = -d_distance / (matrix + coincident)
        d_similarity *= ~coincident

    def cause() -> str:
        return hinge_cause(to_numpy(matrix), pos_margin, neg_margin)

    value = _loss_value(value, reduction, cause)
    return value, _proxy_ctx(ns, "proxy_contrastive", x, p, cosine_ctx, d_similarity)


def proxy_contrastive_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (sample-proxy
    contrastive)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_contrastive")
    return _proxy_backward(ctx, d_value)


def proxy_contrastive(embeddings, labels, *, proxies, proxy_labels=None, pos_margin=None,
                      neg_margin=None, form="euclidean", reduction="mean"):
    """Sample-proxy contrastive loss and its gradients; see :func:`proxy_contrastive_forward`."""
    value, ctx = proxy_contrastive_forward(embeddings, labels, proxies=proxies,
                                           proxy_labels=proxy_labels, pos_margin=pos_margin,
                                           neg_margin=neg_margin, form=form,
                                           reduction=reduction)
    return value, proxy_contrastive_backward(ctx)


def proxy_multi_similarity_forward(embeddings, labels, *, proxies, proxy_labels=None,
                                   alpha=2.0, beta=40.0, base=0.5, mining_margin=0.1,
                                   reduction="mean"):
    """Multi-similarity with the samples as anchors and the proxies as their pairs; see
    :func:`refdml.losses.proxy_multi_similarity_forward`. ``(value, ctx)``."""
    ns, x, y, p, p_labels, same = _proxy_inputs(embeddings, labels, proxies, proxy_labels)
    hyperparameters = check_multi_similarity(alpha, beta, base, mining_margin, reduction,
                                             p.shape[0])
    similarity, cosine_ctx = cross_cosine(ns, x, p)
    value, d_similarity, cause = _multi_similarity_terms(
        ns, IMPLEMENTATIONS.choose(x), similarity, same, ~same, *hyperparameters, x.dtype)
    value = _loss_value(value, reduction, cause)
    return value, _proxy_ctx(ns, "proxy_multi_similarity", x, p, cosine_ctx, d_similarity)


def proxy_multi_similarity_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (sample-proxy MS)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_multi_similarity")
    return _proxy_backward(ctx, d_value)


def proxy_multi_similarity(embeddings, labels, *, proxies, proxy_labels=None, alpha=2.0,
                           beta=40.0, base=0.5, mining_margin=0.1, reduction="mean"):
    """Sample-proxy multi-similarity loss and its gradients; see
    :func:`proxy_multi_similarity_forward`."""
    value, ctx = proxy_multi_similarity_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels, alpha=alpha, beta=beta,
        base=base, mining_margin=mining_margin, reduction=reduction)
    return value, proxy_multi_similarity_backward(ctx)
