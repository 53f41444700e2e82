"""Objectives of :mod:`refdml.train`: the losses a model is trained with.

Every objective has ``parameters()``, ``forward(outputs, labels) -> (value, ctx)`` and
``backward(ctx, d_value=1.0) -> d_outputs`` (same structure as ``outputs``; it adds the
gradient of its own parameters into their ``.grad``); see :mod:`._base`.

=============================  ========================================  ===========================
objective                      outputs                                   own parameters
=============================  ========================================  ===========================
:class:`LossObjective`         ``y`` (B, d) (or ``(y, z)``, z unused)    proxies (proxy losses)
:class:`GSPObjective`          ``(y, z)``: GSP Alg. 1 with ZSR           class embeddings (+ base's)
:class:`XMLObjective`          ``(y, z)``: XML Eqs. 2.10-2.11            none
:class:`WassersteinObjective`  local features (B, n, d)                  none
:class:`ASAPObjective`         ``y``: ASAP Alg. 1-2                      proxies (+ regularises the
                                                                         model's parameters)
=============================  ========================================  ===========================

``reference=True`` runs the float64 NumPy reference operators instead of the fast-path
mirrors of :mod:`refdml.gpu` (NumPy or CuPy, float32 or float64).
"""

from refdml.train.objectives._asap import ASAPObjective
from refdml.train.objectives._base import Objective, ObjectiveContext
from refdml.train.objectives._crossbatch import GSPObjective, XMLObjective
from refdml.train.objectives._loss import (LOSSES, PROXY_LOSSES, SAMPLE_PROXY_LOSSES,
                                            LossObjective, proxy_loss_name)
from refdml.train.objectives._wasserstein import WassersteinObjective

__all__ = [
    "LOSSES",
    "PROXY_LOSSES",
    "SAMPLE_PROXY_LOSSES",
    "ASAPObjective",
    "GSPObjective",
    "LossObjective",
    "Objective",
    "ObjectiveContext",
    "WassersteinObjective",
    "XMLObjective",
    "proxy_loss_name",
]
