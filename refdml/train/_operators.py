"""The operators a training run calls, per implementation: :data:`REFERENCE` and :data:`FAST`.

``REFERENCE`` holds the float64 NumPy reference operators (:mod:`refdml.gsp`,
:mod:`refdml.histogram`, :mod:`refdml.normalize`, :mod:`refdml.losses`,
:mod:`refdml.crossbatch`, :mod:`refdml.ot`); ``FAST`` their mirrors of the same names in
:mod:`refdml.gpu` (NumPy or CuPy, float32 or float64). A layer or an objective built with
``reference=True`` takes its pairs from ``REFERENCE``, else from ``FAST``
(:func:`operators`), and records the choice in its context so the matching backward runs.

Both tables come from static imports and are filled by one function, so they cannot list
different operators, the import graph shows every dependency, and a missing mirror fails
at import rather than mid-run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType

import refdml.crossbatch
import refdml.gpu.crossbatch
import refdml.gpu.gsp
import refdml.gpu.histogram
import refdml.gpu.losses
import refdml.gpu.normalize
import refdml.gpu.ot
import refdml.gsp
import refdml.histogram
import refdml.losses
import refdml.normalize
import refdml.ot
from refdml._validation import _describe, check_choice

__all__ = ["FAST", "REFERENCE", "Operators", "Pair", "check_reference", "operators"]


@dataclass(frozen=True)
class Pair:
    """A forward and its hand-derived backward."""

    forward: Callable
    backward: Callable


@dataclass(frozen=True)
class Operators:
    """One implementation's operators, as the layers and objectives of refdml.train use them.

    ``losses`` maps each loss name to its pair; ``one_call_losses`` maps each loss without
    proxies to its one-call ``value, grads = loss(embeddings, labels, **kwargs)`` (what
    XML's cross-batch term calls as its base loss).
    """

    name: str
    gsp_pool: Pair
    histogram_entropic: Pair
    l2_normalize: Pair
    zero_shot_loss: Pair
    xml_loss: Pair
    wcontrastive: Pair
    wtriplet: Pair
    losses: Mapping[str, Pair]
    one_call_losses: Mapping[str, Callable]

    def loss(self, name, *, parameter: str = "loss") -> Pair:
        """The pair of the loss ``name``; ValueError naming ``parameter`` for another name."""
        return self.losses[check_choice(name, parameter, tuple(self.losses))]

    def one_call_loss(self, name, *, parameter: str = "base") -> Callable:
        """The one-call form of the loss ``name`` (a loss without proxies)."""
        return self.one_call_losses[check_choice(name, parameter, tuple(self.one_call_losses))]


def _table(name: str, *, gsp: ModuleType, histogram: ModuleType, normalize: ModuleType,
           losses: ModuleType, crossbatch: ModuleType, ot: ModuleType) -> Operators:
    return Operators(
        name=name,
        gsp_pool=Pair(gsp.gsp_pool_forward, gsp.gsp_pool_backward),
        histogram_entropic=Pair(histogram.histogram_entropic_forward,
                                histogram.histogram_entropic_backward),
        l2_normalize=Pair(normalize.l2_normalize_forward, normalize.l2_normalize_backward),
        zero_shot_loss=Pair(crossbatch.zero_shot_loss_forward,
                            crossbatch.zero_shot_loss_backward),
        xml_loss=Pair(crossbatch.xml_loss_forward, crossbatch.xml_loss_backward),
        wcontrastive=Pair(ot.wcontrastive_forward, ot.wcontrastive_backward),
        wtriplet=Pair(ot.wtriplet_forward, ot.wtriplet_backward),
        losses=MappingProxyType({
            "contrastive": Pair(losses.contrastive_forward, losses.contrastive_backward),
            "generalized_contrastive": Pair(losses.generalized_contrastive_forward,
                                            losses.generalized_contrastive_backward),
            "multi_similarity": Pair(losses.multi_similarity_forward,
                                     losses.multi_similarity_backward),
            "triplet": Pair(losses.triplet_forward, losses.triplet_backward),
            "proxy_anchor": Pair(losses.proxy_anchor_forward, losses.proxy_anchor_backward),
            "proxy_nca": Pair(losses.proxy_nca_forward, losses.proxy_nca_backward),
            "soft_triple": Pair(losses.soft_triple_forward, losses.soft_triple_backward),
            "proxy_contrastive": Pair(losses.proxy_contrastive_forward,
                                      losses.proxy_contrastive_backward),
            "proxy_multi_similarity": Pair(losses.proxy_multi_similarity_forward,
                                           losses.proxy_multi_similarity_backward),
        }),
        one_call_losses=MappingProxyType({
            "contrastive": losses.contrastive,
            "generalized_contrastive": losses.generalized_contrastive,
            "multi_similarity": losses.multi_similarity,
            "triplet": losses.triplet,
        }),
    )


#: The float64 NumPy reference operators.
REFERENCE = _table("reference", gsp=refdml.gsp, histogram=refdml.histogram,
                   normalize=refdml.normalize, losses=refdml.losses,
                   crossbatch=refdml.crossbatch, ot=refdml.ot)
#: Their fast-path mirrors (NumPy or CuPy arrays).
FAST = _table("fast", gsp=refdml.gpu.gsp, histogram=refdml.gpu.histogram,
              normalize=refdml.gpu.normalize, losses=refdml.gpu.losses,
              crossbatch=refdml.gpu.crossbatch, ot=refdml.gpu.ot)


def check_reference(reference) -> bool:
    """``reference`` as a bool (TypeError naming it for anything else)."""
    if not isinstance(reference, bool):
        raise TypeError(f"reference must be a bool, got {_describe(reference)}")
    return reference


def operators(reference) -> Operators:
    """:data:`REFERENCE` if ``reference`` else :data:`FAST`."""
    return REFERENCE if check_reference(reference) else FAST
