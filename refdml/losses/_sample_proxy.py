r"""Pair losses between samples and proxies: the contrastive and multi-similarity losses
with every pair ``(x_i, p_k)`` of a batch sample and a proxy, as ASAP pairs its proxies
with pair losses (C1-ASAP, C2-ASAP, MS-ASAP; ASAP Sec. 5.1, Table 1).

ASAP Eq. (4.11) replaces the sample ``z_{s_k(i)}`` of class ``i`` by a proxy ``rho_i`` and
averages the pair loss over every proxy and every batch sample,

.. math::

    \frac{1}{m |\rho|} \sum_{\rho \times [m]} \ell(\rho_i, z_j; \theta),

so the loss ``ell`` is the pair loss the batch version uses, between a sample and a proxy:
a same-class pair is a positive, any other a negative. With one proxy per class and no
regulariser this is the loss of a plain proxy method (``LossObjective``); with several
proxies per class it is the base of :class:`refdml.train.objectives.ASAPObjective`.

Normalisation: both sets are compared on the unit sphere. ASAP initialises the proxies
as sample embeddings, which the model L2-normalises, and the proxy losses of
:mod:`refdml.losses._proxy` compare by cosine; on unit rows the Euclidean distance is
``d_ik = ||x^_i - p^_k|| = sqrt(2 - 2 cos(x_i, p_k))``, so the C2 margins keep their
meaning for the embeddings (unit rows too), and the gradient with respect to a proxy is
tangent to its sphere (the proxies' norms do not drift to shrink or grow every distance).
As for the other proxy losses, each row is divided by its own power of two first
(:func:`._common.cross_cosine`): the value is the same at any scale 1e-300 .. 1e300, and
the gradient of a row scales as the inverse of the row's norm.
"""

from __future__ import annotations

import numpy as np

from refdml._validation import check_choice
from refdml.distances import _euclidean_forward
from refdml.losses._common import (
    ProxyLossContext,
    ProxyLossGrads,
    check_contrastive_margins,
    check_d_value,
    check_loss_context,
    check_proxy_inputs,
    check_reduction,
    cross_cosine,
    proxy_backward,
)
from refdml.losses._pair import (
    _FORMS,
    multi_similarity_terms,
    check_multi_similarity,
    hinge_terms,
)

__all__ = [
    "proxy_contrastive",
    "proxy_contrastive_backward",
    "proxy_contrastive_forward",
    "proxy_multi_similarity",
    "proxy_multi_similarity_backward",
    "proxy_multi_similarity_forward",
]


# ------------------------------------------------------------------ contrastive


def _proxy_contrastive_forward(
    x, labels, proxies, proxy_labels, pos_margin, neg_margin, form, reduction,
) -> tuple[float, ProxyLossContext]:
    similarity, cosine_ctx, x_scale, p_scale = cross_cosine(x, proxies)
    same = labels[:, None] == proxy_labels[None, :]
    if form == "cosine":
        value, d_similarity = hinge_terms(similarity, same, pos_margin, neg_margin, form,
                                          reduction)
    else:
        # The distance of the unit rows from explicit differences where they are close
        # (refdml.distances.euclidean), not sqrt(2 - 2 s), which has no correct digit below
        # about 1e-8; d d / d s = -1 / d, subgradient 0 at d = 0.
        distance, _ = _euclidean_forward(cosine_ctx.x_unit, cosine_ctx.y_unit)
        value, d_distance = hinge_terms(distance, same, pos_margin, neg_margin, form,
                                        reduction)
        positive = distance > 0.0
        d_similarity = np.where(positive, -d_distance / np.where(positive, distance, 1.0), 0.0)
    ctx = ProxyLossContext("proxy_contrastive", cosine_ctx, d_similarity, x_scale, p_scale)
    return value, ctx


def proxy_contrastive_forward(
    embeddings, labels, *, proxies, proxy_labels=None, pos_margin=None, neg_margin=None,
    form="euclidean", reduction="mean",
) -> tuple[float, ProxyLossContext]:
    r"""Contrastive loss over every (sample, proxy) pair; returns ``(value, ctx)``.

    ``form="euclidean"`` (C2, ASAP's C2-ASAP) on the unit rows ``x^_i``, ``p^_k``
    (module docstring), with ``d_ik = ||x^_i - p^_k||``::

        l(i, k) = [d_ik - m+]_+   if y_i == class(p_k),     [m- - d_ik]_+   otherwise;

    ``form="cosine"`` (C1, C1-ASAP) on ``s_ik = cos(x_i, p_k)``:
    ``[m+ - s_ik]_+`` and ``[s_ik - m-]_+``. The margins' defaults and ranges are those
    of :func:`refdml.losses.contrastive_forward`: C2 ``(m+, m-) = (0, 0.3841)``, the CUB
    values of ASAP App. A.2; C1 ``(1, 0.5)``.

    ``reduction="mean"`` divides the sum of the ``n * n_proxies`` terms by their number,
    the ``1 / (m |rho|)`` of ASAP Eq. (4.11) (``"sum"``: no division;
    ``"mean_nonzero"``: by the number of non-zero terms). Every pair has a term.

    Gradient. With ``g_ik = d value / d l(i, k) * d l / d d_ik`` (``+1 / (n K)`` on an
    active positive, ``-1 / (n K)`` on an active negative, 0 on an inactive hinge, for
    ``"mean"`` over ``K`` proxies), and ``d_ik = sqrt(2 - 2 s_ik)`` on unit rows,

    .. math::

        \frac{\partial\, \mathrm{value}}{\partial s_{ik}} = -\frac{g_{ik}}{d_{ik}}
        \quad (d_{ik} > 0), \qquad 0 \text{ at } d_{ik} = 0,

    and the cosine's backward carries it to the rows:
    ``d s_ik / d x_i = (I - x^_i x^_i^T) p^_k / ||x_i||`` (and symmetrically for
    ``p_k``). The factor ``(I - x^ x^^T) p^`` has norm ``sqrt(1 - s^2) = d sqrt(1 - d^2/4)``,
    so ``|d d_ik / d x_i| <= 1 / ||x_i||``: bounded as the Euclidean distance's
    unit-vector gradient, even for a sample next to a proxy. At ``d = 0`` (a sample on a
    proxy's direction) the distance is not differentiable and the subgradient 0 is taken,
    as :func:`refdml.distances.euclidean_backward` does. The cosine form needs no such
    step: ``d value / d s_ik`` is the hinge's slope.

    Parameters
    ----------
    embeddings : array (n, d)
    labels : int array (n,)
    proxies : array (n_proxies, d)
    proxy_labels : int array (n_proxies,), optional
        Each proxy's class (default ``arange(n_proxies)``); every class of ``labels``
        needs a proxy.
    pos_margin, neg_margin : float, optional
    form : {"euclidean", "cosine"}
    reduction : {"mean", "mean_nonzero", "sum"}
    """
    x, y, p, p_labels = check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    form = check_choice(form, "form", _FORMS)
    reduction = check_reduction(reduction)
    pos_margin, neg_margin = check_contrastive_margins(form, pos_margin, neg_margin)
    return _proxy_contrastive_forward(x, y, p, p_labels, pos_margin, neg_margin, form,
                                      reduction)


def proxy_contrastive_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (sample-proxy
    contrastive)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_contrastive")
    return proxy_backward(ctx, check_d_value(d_value))


def proxy_contrastive(
    embeddings, labels, *, proxies, proxy_labels=None, pos_margin=None, neg_margin=None,
    form="euclidean", reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """Sample-proxy contrastive loss and its gradients; see :func:`proxy_contrastive_forward`."""
    value, ctx = proxy_contrastive_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels,
        pos_margin=pos_margin, neg_margin=neg_margin, form=form, reduction=reduction,
    )
    return value, proxy_contrastive_backward(ctx)


# ------------------------------------------------------------- multi-similarity


def proxy_multi_similarity_forward(
    embeddings, labels, *, proxies, proxy_labels=None, alpha=2.0, beta=40.0, base=0.5,
    mining_margin=0.1, reduction="mean",
) -> tuple[float, ProxyLossContext]:
    r"""Multi-similarity loss with each sample an anchor and the proxies its pairs.

    Wang et al. 2019 (Eq. 9, the mining of Eqs. 7-8) as
    :func:`refdml.losses.multi_similarity_forward` computes it within a batch, with the
    candidates of anchor ``x_i`` the proxies: ``P_i`` its own class's, ``N_i`` the
    others'. On ``s_ik = cos(x_i, p_k)``::

        l_i = 1/alpha log(1 + sum_{k in P_i mined} exp(-alpha (s_ik - base)))
            + 1/beta  log(1 + sum_{k in N_i mined} exp( beta (s_ik - base)))

    a negative mined if ``s_ik + mining_margin > min_{p in P_i} s_ip``, a positive if
    ``s_ik - mining_margin < max_{q in N_i} s_iq``. Every sample has a positive (its class
    has a proxy); a sample without a negative (proxies of one class only) has no term.
    ``"mean"`` averages over the samples with a term: MS is a per-anchor loss, and its
    ``1 / m`` over the batch is the ``1 / m`` of ASAP Eq. (4.11) (the sum over the proxies
    is inside each anchor's log-sum-exp, as the sum over the batch's pairs is in MS).
    Defaults ``(alpha, beta, base) = (2, 40, 0.5)`` (CUB-200, GSP supp. 1.6.7, ASAP
    App. A.2), ``mining_margin`` 0.1.

    Gradient. With ``w+_ik = exp(-alpha (s_ik - base)) / (1 + sum_{P_i mined} ...)`` the
    softmax weight of a mined positive (its extra logit 0 the ``1 +``) and ``w-_ik``
    likewise for a mined negative, ``d l_i / d s_ik = w-_ik - w+_ik`` (the ``1 / alpha``
    and ``1 / beta`` cancel the logits' slopes); the mined sets are piecewise constant, so
    their derivative is 0. The cosine's backward carries ``d value / d s`` to the
    embeddings and the proxies, as for the other proxy losses.

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
    alpha, beta : float > 0
        Scales of the positive and the negative terms (defaults 2 and 40).
    base : float
        The similarity offset, the paper's ``lambda`` (default 0.5).
    mining_margin : float >= 0
        The mining margin, the paper's ``epsilon`` (default 0.1).
    reduction : {"mean", "sum", "mean_nonzero"}
        How the terms are reduced (see above).
    """
    x, y, p, p_labels = check_proxy_inputs(embeddings, labels, proxies, proxy_labels)
    hyperparameters = check_multi_similarity(alpha, beta, base, mining_margin, reduction,
                                             p.shape[0])
    similarity, cosine_ctx, x_scale, p_scale = cross_cosine(x, p)
    same = y[:, None] == p_labels[None, :]
    value, d_similarity = multi_similarity_terms(similarity, same, ~same,
                                                       *hyperparameters)
    ctx = ProxyLossContext("proxy_multi_similarity", cosine_ctx, d_similarity, x_scale,
                           p_scale)
    return value, ctx


def proxy_multi_similarity_backward(ctx: ProxyLossContext, d_value=1.0) -> ProxyLossGrads:
    """Gradients ``.embeddings``, ``.proxies`` of ``d_value * value`` (sample-proxy MS)."""
    ctx = check_loss_context(ctx, ProxyLossContext, "proxy_multi_similarity")
    return proxy_backward(ctx, check_d_value(d_value))


def proxy_multi_similarity(
    embeddings, labels, *, proxies, proxy_labels=None, alpha=2.0, beta=40.0, base=0.5,
    mining_margin=0.1, reduction="mean",
) -> tuple[float, ProxyLossGrads]:
    """Sample-proxy multi-similarity loss and its gradients; see
    :func:`proxy_multi_similarity_forward`."""
    value, ctx = proxy_multi_similarity_forward(
        embeddings, labels, proxies=proxies, proxy_labels=proxy_labels, alpha=alpha,
        beta=beta, base=base, mining_margin=mining_margin, reduction=reduction,
    )
    return value, proxy_multi_similarity_backward(ctx)
