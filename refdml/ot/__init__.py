"""Entropic optimal transport, Sinkhorn divergences and the Wasserstein DML losses.

Wasserstein DML (Dou, Luo & Yang, AAAI 2022 student abstract), Eqs. (1)-(4).

=======================================================  ==========================================
:func:`sinkhorn`                                         batched log-domain Sinkhorn for Eq. (3)
                                                         (``_sinkhorn.py``)
:func:`entropic_ot_forward` / backward                   the value of Eq. (3) or ``<pi, C>``,
                                                         gradients w.r.t. ``a``, ``b``, ``cost``
                                                         (``_entropic.py``)
:func:`sinkhorn_divergence_forward` / backward           Eq. (4) between two weighted clouds
                                                         (``_divergence.py``), by refdml's
                                                         solver or POT's (``solver="pot"``,
                                                         ``_pot.py``)
:func:`sinkhorn_divergence`                              the same, in one call
:func:`pairwise_sinkhorn_divergence_forward` / backward  the (B, B) matrix of Eq. (4) between
                                                         uniform clouds, all in one batch
:func:`wcontrastive_forward` / backward                  Eq. (1) (``_wlosses.py``)
:func:`wtriplet_forward` / backward                      Eq. (2)
=======================================================  ==========================================

Conventions shared by every function here:

* ``eps`` is the entropic regularisation (a temperature in the units of the cost, as
  POT's ``reg``): kernel ``exp(-C / eps)``, larger is smoother.
* ``value`` chooses the OT value: ``"regularized"`` (Eq. (3)'s minimum,
  ``<pi, C> + eps KL(pi | a (x) b)``, the paper's) or ``"transport_cost"`` (``<pi, C>``).
* ``tol >= 0``; ``tol = 0`` runs exactly ``max_iter`` iterations, reports
  ``converged=False`` unless the residual is exactly 0, and does not warn. Otherwise a
  :class:`refdml.ConvergenceWarning` says that ``max_iter`` was reached above ``tol``.
* Weights are any positive numbers, normalised to sum 1 inside.

Derivations of the gradients and the solver's numerical choices: docs/ot.md.
"""

from refdml.ot._divergence import (
    PairwiseSinkhornDivergenceContext,
    PairwiseSinkhornDivergenceGrads,
    SinkhornDivergenceContext,
    SinkhornDivergenceGrads,
    pairwise_sinkhorn_divergence,
    pairwise_sinkhorn_divergence_backward,
    pairwise_sinkhorn_divergence_forward,
    sinkhorn_divergence,
    sinkhorn_divergence_backward,
    sinkhorn_divergence_forward,
)
from refdml.ot._entropic import EntropicOTContext, OTGrads, entropic_ot_backward, entropic_ot_forward
from refdml.ot._sinkhorn import SinkhornResult, sinkhorn
from refdml.ot._wlosses import (
    WContrastiveContext,
    WassersteinLossGrads,
    WTripletContext,
    wcontrastive,
    wcontrastive_backward,
    wcontrastive_forward,
    wtriplet,
    wtriplet_backward,
    wtriplet_forward,
)

__all__ = [
    "EntropicOTContext",
    "OTGrads",
    "PairwiseSinkhornDivergenceContext",
    "PairwiseSinkhornDivergenceGrads",
    "SinkhornDivergenceContext",
    "SinkhornDivergenceGrads",
    "SinkhornResult",
    "WContrastiveContext",
    "WTripletContext",
    "WassersteinLossGrads",
    "entropic_ot_backward",
    "entropic_ot_forward",
    "pairwise_sinkhorn_divergence",
    "pairwise_sinkhorn_divergence_backward",
    "pairwise_sinkhorn_divergence_forward",
    "sinkhorn",
    "sinkhorn_divergence",
    "sinkhorn_divergence_backward",
    "sinkhorn_divergence_forward",
    "wcontrastive",
    "wcontrastive_backward",
    "wcontrastive_forward",
    "wtriplet",
    "wtriplet_backward",
    "wtriplet_forward",
]
