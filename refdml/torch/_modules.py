"""Thin ``torch.nn.Module`` classes over refdml's PyTorch ops (:mod:`refdml.torch._ops`).

Each module keeps its hyperparameters as attributes (shown by ``repr``) and its learned
arrays as ``nn.Parameter``: the GSP layer's prototypes, a proxy loss's proxies. The maths,
the checks and the gradients are refdml's; a module only calls :func:`refdml.torch.op`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from refdml.torch._ops import op

__all__ = [
    "ClipNormalize", "ContrastiveLoss", "GSPPool", "GeneralizedContrastiveLoss", "L2Normalize",
    "MultiSimilarityLoss", "PairwiseSinkhornDivergence", "ProxyAnchorLoss",
    "ProxyContrastiveLoss", "ProxyMultiSimilarityLoss", "ProxyNCALoss", "SinkhornDivergence",
    "SoftTripleLoss", "TripletLoss", "WContrastiveLoss", "WTripletLoss", "XMLLoss",
    "ZeroShotLoss",
]


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} == {value!r}, must be >= 1")
    return value


class _OpModule(nn.Module):
    """A module calling one op with fixed hyperparameters."""

    _op_name = ""

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = dict(options)
        self._op = op(self._op_name)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


class L2Normalize(_OpModule):
    """``x / ||x||`` over the last axis (:func:`refdml.normalize.l2_normalize_forward`)."""

    _op_name = "normalize.l2_normalize"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x=x)


class ClipNormalize(_OpModule):
    """``x / max(1, ||x||)`` (GSP's clip to the unit ball,
    :func:`refdml.normalize.clip_normalize_forward`)."""

    _op_name = "normalize.clip_normalize"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x=x)


class GSPPool(_OpModule):
    """Generalized Sum Pooling (GSP Alg. 2) with learned prototypes.

    ``features (B, n, d) -> (pooled (B, d), z (B, m))``: refdml's (P2) solve and its
    closed-form backward (:func:`refdml.gsp.gsp_pool_forward`). The prototypes are an
    ``nn.Parameter`` ``(m, d)``, drawn N(0, 1/d) as :class:`refdml.train.layers.GSPHead`'s,
    from PyTorch's generator (``torch.manual_seed``), or given as ``prototypes``.

    Parameters
    ----------
    n_prototypes, dim : int
        ``m`` and ``d``.
    mu : float in (0, 1]
        The fraction of the features' mass transported (GSP Eq. 5).
    inverse_temperature : float > 0
        The entropic smoothing of (P2).
    p : float >= 1
        Generalised-mean exponent of the pooling (1: the sum pooling of the paper).
    prototypes : tensor (m, d), optional
        Initial values (copied).
    **options
        Further keywords of :func:`refdml.gpu.gsp.gsp_pool_forward` (``method``,
        ``max_iter``, ``tol``).
    """

    _op_name = "gsp.pool"

    def __init__(self, n_prototypes: int, dim: int, *, mu: float, inverse_temperature: float,
                 p: float = 1.0, prototypes: torch.Tensor | None = None,
                 dtype: torch.dtype | None = None, **options: Any) -> None:
        super().__init__(mu=mu, inverse_temperature=inverse_temperature, p=p, **options)
        m, d = _positive_int(n_prototypes, "n_prototypes"), _positive_int(dim, "dim")
        if prototypes is None:
            values = torch.randn(m, d, dtype=dtype) / math.sqrt(d)
        else:
            if not isinstance(prototypes, torch.Tensor):
                raise TypeError(f"prototypes must be a torch.Tensor, got "
                                f"{type(prototypes).__name__}")
            if tuple(prototypes.shape) != (m, d):
                raise ValueError(f"prototypes has shape {tuple(prototypes.shape)}, expected "
                                 f"(n_prototypes, dim) == {(m, d)}")
            values = prototypes.detach().clone().to(dtype or prototypes.dtype)
        self.prototypes = nn.Parameter(values)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(features=features, prototypes=self.prototypes, **self.options)


class _PairLoss(_OpModule):
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._op(embeddings=embeddings, labels=labels, **self.options)


class ContrastiveLoss(_PairLoss):
    """The contrastive loss (:func:`refdml.losses.contrastive_forward`; keywords
    ``pos_margin``, ``neg_margin``, ``form``, ``reduction``)."""

    _op_name = "losses.contrastive"


class TripletLoss(_PairLoss):
    """The triplet loss (:func:`refdml.losses.triplet_forward`; ``margin``, ``mining``)."""

    _op_name = "losses.triplet"


class MultiSimilarityLoss(_PairLoss):
    """The multi-similarity loss (:func:`refdml.losses.multi_similarity_forward`)."""

    _op_name = "losses.multi_similarity"


class GeneralizedContrastiveLoss(_PairLoss):
    """ASAP Eq. (4.2) (:func:`refdml.losses.generalized_contrastive_forward`; ``alpha``,
    ``beta``)."""

    _op_name = "losses.generalized_contrastive"


class _ProxyLoss(_OpModule):
    """A loss against learned proxies: ``proxies`` an ``nn.Parameter``
    ``(n_classes * proxies_per_class, dim)`` drawn N(0, 1/dim) (or given), their classes a
    buffer ``proxy_labels`` (``proxies_per_class`` consecutive rows per class)."""

    def __init__(self, n_classes: int, dim: int, *, proxies_per_class: int = 1,
                 proxies: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        n = _positive_int(n_classes, "n_classes")
        d = _positive_int(dim, "dim")
        k = _positive_int(proxies_per_class, "proxies_per_class")
        if proxies is None:
            values = torch.randn(n * k, d, dtype=dtype) / math.sqrt(d)
        else:
            if not isinstance(proxies, torch.Tensor):
                raise TypeError(f"proxies must be a torch.Tensor, got {type(proxies).__name__}")
            if tuple(proxies.shape) != (n * k, d):
                raise ValueError(f"proxies has shape {tuple(proxies.shape)}, expected "
                                 f"(n_classes * proxies_per_class, dim) == {(n * k, d)}")
            values = proxies.detach().clone().to(dtype or proxies.dtype)
        self.proxies = nn.Parameter(values)
        self.register_buffer("proxy_labels", torch.arange(n).repeat_interleave(k))

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._op(embeddings=embeddings, labels=labels, proxies=self.proxies,
                        proxy_labels=self.proxy_labels.to(labels.device), **self.options)


class ProxyNCALoss(_ProxyLoss):
    """ProxyNCA++ (:func:`refdml.losses.proxy_nca_forward`; ``temperature``)."""

    _op_name = "losses.proxy_nca"


class ProxyAnchorLoss(_ProxyLoss):
    """Proxy-Anchor (:func:`refdml.losses.proxy_anchor_forward`; ``alpha``, ``delta``)."""

    _op_name = "losses.proxy_anchor"


class SoftTripleLoss(_ProxyLoss):
    """SoftTriple (:func:`refdml.losses.soft_triple_forward`)."""

    _op_name = "losses.soft_triple"


class ProxyContrastiveLoss(_ProxyLoss):
    """C1-/C2-ASAP: the contrastive loss over (sample, proxy) pairs
    (:func:`refdml.losses.proxy_contrastive_forward`)."""

    _op_name = "losses.proxy_contrastive"


class ProxyMultiSimilarityLoss(_ProxyLoss):
    """MS-ASAP: multi-similarity over (sample, proxy) pairs
    (:func:`refdml.losses.proxy_multi_similarity_forward`)."""

    _op_name = "losses.proxy_multi_similarity"


class XMLLoss(_OpModule):
    """Cross-batch metric learning's loss (:func:`refdml.crossbatch.xml_loss_forward`):
    ``forward(Z, Y, labels, split=None)``; keywords ``ridge``, ``lambda_``,
    ``base_loss_kwargs``."""

    _op_name = "crossbatch.xml_loss"

    def forward(self, Z, Y, labels, split=None):  # noqa: N803 - the paper's names
        return self._op(Z=Z, Y=Y, labels=labels, split=split, **self.options)


class ZeroShotLoss(_OpModule):
    """The zero-shot regulariser (:func:`refdml.crossbatch.zero_shot_loss_forward`):
    ``forward(Z, labels, class_embeddings, split=None)``."""

    _op_name = "crossbatch.zero_shot_loss"

    def forward(self, Z, labels, class_embeddings, split=None):  # noqa: N803
        return self._op(Z=Z, labels=labels, class_embeddings=class_embeddings, split=split,
                        **self.options)


class WContrastiveLoss(_OpModule):
    """Wasserstein DML's contrastive loss, Eq. (1) (:func:`refdml.ot.wcontrastive_forward`):
    ``forward(features (B, n, d), labels (B,))``; keywords ``margin``, ``eps``, ``p``."""

    _op_name = "ot.wcontrastive"

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self._op(features=features, labels=labels, **self.options)


class WTripletLoss(WContrastiveLoss):
    """Wasserstein DML's triplet loss, Eq. (2) (:func:`refdml.ot.wtriplet_forward`)."""

    _op_name = "ot.wtriplet"


class SinkhornDivergence(_OpModule):
    """The Sinkhorn divergence, Eq. (4) (:func:`refdml.ot.sinkhorn_divergence_forward`).

    ``forward(x, y, a=None, b=None)``: clouds ``(n, d)`` and ``(m, d)`` give a 0-d tensor;
    batches ``(B, n, d)`` and ``(B, m, d)`` (weights ``(B, n)``, ``(B, m)``) give ``(B,)``,
    one refdml solve per problem (refdml has no batched divergence of unequal clouds; for
    every pair of one batch of equal clouds, :class:`PairwiseSinkhornDivergence` solves
    them together). Keywords ``eps``, ``p``, ``value``, ``max_iter``, ``tol``.
    """

    _op_name = "ot.sinkhorn_divergence"

    def forward(self, x, y, a=None, b=None):
        if not isinstance(x, torch.Tensor) or x.dim() != 3:
            return self._op(x=x, y=y, a=a, b=b, **self.options)
        if not isinstance(y, torch.Tensor) or y.dim() != 3 or y.shape[0] != x.shape[0]:
            raise ValueError(f"x has shape {tuple(x.shape)}: a batch, so y must be (B, m, d) "
                             f"with the same B, got {getattr(y, 'shape', type(y).__name__)}")
        return torch.stack([
            self._op(x=x[k], y=y[k], a=None if a is None else a[k],
                     b=None if b is None else b[k], **self.options)
            for k in range(x.shape[0])
        ])


class PairwiseSinkhornDivergence(_OpModule):
    """The ``(B, B)`` Sinkhorn divergences between all pairs of ``B`` uniform clouds
    ``(B, n, d)``, solved in one batch (:func:`refdml.ot.pairwise_sinkhorn_divergence_forward`)."""

    _op_name = "ot.pairwise_sinkhorn_divergence"

    def forward(self, clouds: torch.Tensor) -> torch.Tensor:
        return self._op(clouds=clouds, **self.options)
