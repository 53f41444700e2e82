"""Deep-metric-learning losses with hand-derived gradients.

Every loss is a pure pair ``<name>_forward(embeddings, labels, *, ...) -> (value, ctx)`` and
``<name>_backward(ctx, d_value=1.0) -> grads`` (``d_value`` the scalar upstream gradient,
shape ``()``; the default 1.0 is a convenience); the one-call ``<name>(...)`` returns
``value, grads``. ``grads.embeddings`` has the shape of the embeddings; proxy losses also
return ``grads.proxies``. A backward refuses (``TypeError``) a context that its own forward
did not make, and (``ValueError``) a non-scalar or non-finite ``d_value``.

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
``proxy_contrastive``        C2 / C1 over (sample, proxy) pairs (ASAP)            unit-row ``d``
``proxy_multi_similarity``   MS, samples as anchors, proxies as pairs (ASAP)      cosine ``s``
===========================  ===================================================  ===============

Conventions shared by all losses
--------------------------------
* Distance losses work on the embeddings as given (normalise them first with
  :mod:`refdml.normalize` if wanted); cosine losses normalise inside.
* Pairs are unordered (``i < j``, each pair once, no self-pairs). The ordered double sum
  of ASAP Eq. (3.2) counts each pair twice and adds the ``n`` self-pairs; the mean over
  pairs is the same, and a self-pair term ``(alpha - beta)_+`` is 0 for ``beta >= alpha``.
* ``reduction``: ``"mean"`` averages the terms over every *existing* pair / triplet /
  anchor / proxy (the empirical expectation of ASAP Eq. 3.1), ``"mean_nonzero"`` over the
  terms that are strictly positive, ``"sum"`` adds them. The default of every loss is
  ``"mean"``. The number of non-zero terms is piecewise constant, so its derivative is 0.
* Which terms exist: every unordered pair for the (generalized) contrastive loss, with or
  without a positive pair in the batch; every valid triplet (or anchor, batch-hard) for
  the triplet loss; every anchor with a positive and a negative for multi-similarity
  (its mining needs both; see :mod:`refdml.losses._pair`). No term at all: value ``0.0``
  and an all-zero gradient, never NaN.
* Hinges and mining thresholds are not differentiable on their boundary; the backward
  uses the inactive side there (subgradient 0), and the Euclidean distance uses the
  subgradient 0 at coincident points (see :mod:`refdml.distances`).
* Extreme input: the cosine losses give the same value for embeddings (and proxies) of
  any magnitude 1e-300 .. 1e300 (the gradient scales as the inverse); the Euclidean
  losses are right wherever the distances are finite and raise ``ValueError`` beyond
  (see :mod:`refdml.losses._common`).

The package: ``_common`` (gradients, contexts, reductions, input checks, scale-safe
kernels), ``_pair`` (contrastive, generalized contrastive, triplet, multi-similarity),
``_proxy`` (Proxy-Anchor, ProxyNCA++, SoftTriple), ``_sample_proxy`` (the pair losses
between samples and proxies that ASAP pairs itself with), ``_hyperparameters``
(``PAPER_HYPERPARAMETERS``). Their gradient checks are in
``refdml/catalog/losses.py``.
"""

from __future__ import annotations

from refdml.losses._common import (
    REDUCTIONS,
    LossGrads,
    PairwiseLossContext,
    ProxyLossContext,
    ProxyLossGrads,
)
from refdml.losses._hyperparameters import PAPER_HYPERPARAMETERS
from refdml.losses._pair import (
    contrastive,
    contrastive_backward,
    contrastive_forward,
    generalized_contrastive,
    generalized_contrastive_backward,
    generalized_contrastive_forward,
    multi_similarity,
    multi_similarity_backward,
    multi_similarity_forward,
    triplet,
    triplet_backward,
    triplet_forward,
)
from refdml.losses._proxy import (
    proxy_anchor,
    proxy_anchor_backward,
    proxy_anchor_forward,
    proxy_nca,
    proxy_nca_backward,
    proxy_nca_forward,
    soft_triple,
    soft_triple_backward,
    soft_triple_forward,
)
from refdml.losses._sample_proxy import (
    proxy_contrastive,
    proxy_contrastive_backward,
    proxy_contrastive_forward,
    proxy_multi_similarity,
    proxy_multi_similarity_backward,
    proxy_multi_similarity_forward,
)

__all__ = [
    "LossGrads",
    "PAPER_HYPERPARAMETERS",
    "PairwiseLossContext",
    "ProxyLossContext",
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
