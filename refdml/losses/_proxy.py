"""Proxy losses: Proxy-Anchor, ProxyNCA++, SoftTriple. Each sees the embeddings and the
proxies only through their cosine similarities (:func:`._common.cross_cosine`), so the
value is invariant to the scale of every embedding and every proxy (1e-300 .. 1e300)
and the gradient of a row scales as the inverse of that row's scale.
"""

from __future__ import annotations

import numpy as np

from refdml._numerics import masked_logsumexp
from refdml._validation import check_scalar
from refdml.distances import _cosine_forward
from refdml.losses._common import (
    ProxyLossContext,
    ProxyLossGrads,
    check_d_value,
    check_finite_loss,
    check_loss_context,
    check_proxy_anchor_scales,
    check_proxy_inputs,
    check_proxy_nca_temperature,
    check_reduction,
    check_soft_triple_scales,
    cross_cosine,
    hyperparameter_cause,
    log1p_sum_exp,
    proxy_backward,
    reduce_terms,
)

__all__ = [
    "proxy_anchor",
    "proxy_anchor_backward",
    "proxy_anchor_forward",
    "proxy_nca",
    "proxy_nca_backward",
    "proxy_nca_forward",
    "soft_triple",
    "soft_triple_backward",
    "soft_triple_forward",
]


# ----------------------------------------------------------------------- Proxy-Anchor


def _proxy_anchor_forward(
    x, labels, proxies, proxy_labels, delta, alpha, reduction,
) -> tuple[float, ProxyLossContext]:
    similarity, cosine_ctx, x_scale, p_scale = cross_cosine(x, proxies)
    same = labels[:, None] == proxy_labels[None, :]            # (n, n_proxies)
    # log(1 + sum_x exp(z)) per proxy: work on the transposes, proxies as rows.
    lse_pos, w_pos = log1p_sum_exp(-alpha * (similarity.T - delta), same.T)
    lse_neg, w_neg = log1p_sum_exp(alpha * (similarity.T + delta), ~same.T)
    with_positives = same.any(axis=0)
    cause = hyperparameter_cause("proxy_anchor", alpha=alpha, delta=delta)
    value_pos, d_pos = reduce_terms(lse_pos[with_positives], reduction, cause)
    value_neg, d_neg = reduce_terms(lse_neg, reduction, cause)
    d_lse_pos = np.zeros(proxies.shape[0])
    d_lse_pos[with_positives] = d_pos
    with np.errstate(over="ignore", invalid="ignore"):
        d_similarity = alpha * (d_neg[:, None] * w_neg - d_lse_pos[:, None] * w_pos).T
        value = value_pos + value_neg
    check_finite_loss(value, [d_similarity], "proxy_anchor", {"alpha": alpha, "delta": delta})
    ctx = ProxyLossContext("proxy_anchor", cosine_ctx, d_similarity, x_scale, p_scale)
    return value, ctx


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

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    proxies : float array (n_proxies, d)
        The learnable proxies, one per row.
    proxy_labels : int array (n_proxies,), optional
        Each proxy's class; default ``arange(n_proxies)`` (proxy ``k`` for class ``k``).
    delta : float
        The margin ``delta`` (default 0.1).
    alpha : float > 0
        The scale ``alpha`` (default 32).
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y, p, p_labels = check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    delta = check_scalar(delta, "delta", low=0.0)
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    reduction = check_reduction(reduction)
    check_proxy_anchor_scales(alpha, delta, x.shape[0])
    return _proxy_anchor_forward(x, y, p, p_labels, delta, alpha, reduction)


def proxy_anchor_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (Proxy-Anchor)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_anchor")
    return proxy_backward(ctx, check_d_value(d_value))


def proxy_anchor(
    embeddings, labels, *, proxies, proxy_labels=None, delta=0.1, alpha=32.0, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """Proxy-Anchor loss and its gradients; see :func:`proxy_anchor_forward`."""
    value, ctx = proxy_anchor_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels,
        delta=delta, alpha=alpha, reduction=reduction,
    )
    return value, proxy_anchor_backward(ctx)


# -------------------------------------------------------------------------- ProxyNCA++


def _proxy_nca_forward(
    x, labels, proxies, proxy_labels, temperature, reduction,
) -> tuple[float, ProxyLossContext]:
    similarity, cosine_ctx, x_scale, p_scale = cross_cosine(x, proxies)
    # -||x^ - p^||^2 / T = -(2 - 2 s) / T for unit vectors: the exact squared distance
    # of the paper, without the cancellation of forming it from differences.
    logits = -(2.0 - 2.0 * similarity) / temperature
    same = labels[:, None] == proxy_labels[None, :]
    lse_all, softmax_all = masked_logsumexp(logits, None, axis=1)
    lse_pos, softmax_pos = masked_logsumexp(logits, same, axis=1)
    # A single class of proxies makes every term exactly 0; clip the rounding residue.
    terms = np.maximum(lse_all - lse_pos, 0.0)
    value, d_terms = reduce_terms(terms, reduction,
                                  hyperparameter_cause("proxy_nca", temperature=temperature))
    d_similarity = (2.0 / temperature) * d_terms[:, None] * (softmax_all - softmax_pos)
    return value, ProxyLossContext("proxy_nca", cosine_ctx, d_similarity, x_scale, p_scale)


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

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    proxies : float array (n_proxies, d)
        The learnable proxies, one per row.
    proxy_labels : int array (n_proxies,), optional
        Each proxy's class; default ``arange(n_proxies)`` (proxy ``k`` for class ``k``).
    temperature : float > 0
        The softmax temperature ``T`` dividing the squared distances (default 0.11).
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y, p, p_labels = check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    temperature = check_scalar(temperature, "temperature", low=0.0, low_inclusive=False)
    reduction = check_reduction(reduction)
    check_proxy_nca_temperature(temperature)
    return _proxy_nca_forward(x, y, p, p_labels, temperature, reduction)


def proxy_nca_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (ProxyNCA++)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_nca")
    return proxy_backward(ctx, check_d_value(d_value))


def proxy_nca(
    embeddings, labels, *, proxies, proxy_labels=None, temperature=0.11, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """ProxyNCA++ loss and its gradients; see :func:`proxy_nca_forward`."""
    value, ctx = proxy_nca_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels,
        temperature=temperature, reduction=reduction,
    )
    return value, proxy_nca_backward(ctx)


# -------------------------------------------------------------------------- SoftTriple

# Inside the square root of the SoftTriple regulariser, so that two coincident centres
# (s = 1) keep a finite gradient; the authors' code adds the same 1e-5.
_SOFT_TRIPLE_EPS = 1e-5


def _soft_triple_forward(
    x, labels, centers, center_labels, lambda_, gamma, tau, delta, reduction,
) -> tuple[float, ProxyLossContext]:
    n, m = x.shape[0], centers.shape[0]
    similarity, cosine_ctx, x_scale, c_scale = cross_cosine(x, centers)
    classes = np.unique(center_labels)
    # Relaxed similarity per class: softmax(s / gamma)-weighted mean of its centres' s.
    relaxed = np.empty((n, classes.size))
    weight = np.empty((n, m))              # q_ik, the softmax within each class
    for c, cls in enumerate(classes):
        members = center_labels == cls
        _, q = masked_logsumexp(similarity[:, members] / gamma, None, axis=1)
        weight[:, members] = q
        relaxed[:, c] = np.sum(q * similarity[:, members], axis=1)
    own = labels[:, None] == classes[None, :]
    logits = lambda_ * (relaxed - delta * own)
    lse, softmax = masked_logsumexp(logits, None, axis=1)
    terms = np.maximum(lse - logits[own], 0.0)
    hyperparameters = {"lambda_": lambda_, "gamma": gamma, "tau": tau, "delta": delta}
    value, d_terms = reduce_terms(terms, reduction,
                                  hyperparameter_cause("soft_triple", **hyperparameters))
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
        check_finite_loss(value, [d_similarity], "soft_triple", hyperparameters)
        ctx = ProxyLossContext("soft_triple", cosine_ctx, d_similarity, x_scale, c_scale)
        return value, ctx
    # The centres as cosine_ctx saw them (each row divided by its power of two).
    scaled = centers / c_scale
    center_similarity, center_ctx = _cosine_forward(scaled, scaled)
    pairs = np.triu(center_labels[:, None] == center_labels[None, :], k=1)
    root = np.sqrt(2.0 + _SOFT_TRIPLE_EPS - 2.0 * center_similarity[pairs])
    d_regularizer = np.zeros((m, m))
    with np.errstate(over="ignore"):
        value += tau * float(np.sum(root)) / denominator
        d_regularizer[pairs] = -tau / (denominator * root)
    check_finite_loss(value, [d_similarity, d_regularizer], "soft_triple", hyperparameters)
    ctx = ProxyLossContext(
        "soft_triple", cosine_ctx, d_similarity, x_scale, c_scale, center_ctx, d_regularizer
    )
    return value, ctx


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

    Parameters
    ----------
    embeddings : float array (n, d)
        One embedding per row.
    labels : int array (n,)
        Class label of each embedding.
    proxies : float array (n_proxies, d)
        The learnable proxies, one per row.
    proxy_labels : int array (n_proxies,), optional
        Each proxy's class; default ``arange(n_proxies)`` (proxy ``k`` for class ``k``).
    lambda_ : float > 0
        The scale ``lambda`` of the class logits (default 20).
    gamma : float > 0
        The softmax temperature over a class's centres (default 0.1).
    tau : float >= 0
        The weight of the centre-spreading regulariser ``R`` (default 0.2).
    delta : float
        The margin subtracted from the true class's similarity (default 0.01).
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y, p, p_labels = check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    lambda_ = check_scalar(lambda_, "lambda_", low=0.0, low_inclusive=False)
    gamma = check_scalar(gamma, "gamma", low=0.0, low_inclusive=False)
    tau = check_scalar(tau, "tau", low=0.0)
    delta = check_scalar(delta, "delta", low=0.0)
    reduction = check_reduction(reduction)
    check_soft_triple_scales(lambda_, gamma, delta)
    return _soft_triple_forward(x, y, p, p_labels, lambda_, gamma, tau, delta, reduction)


def soft_triple_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` (the centres) of ``d_value * value`` (SoftTriple)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "soft_triple")
    return proxy_backward(ctx, check_d_value(d_value))


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
