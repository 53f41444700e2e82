"""The layout of the fused optimiser's arguments, shared by its array path and its kernels
(no Numba here: the array path runs without it). What each slot means:
:mod:`refdml.gpu.optim._compiled`."""

from __future__ import annotations

__all__ = ["ACTIVE", "BAD_GRAD", "BAD_UPDATE", "BETA1", "BETA2", "DECAY", "GATE", "LR", "N_COEF",
           "N_PLAN", "N_SCALARS", "OFFSET", "RULES", "SCALARS", "SQRT_BC2", "STEP"]

#: The rules by code.
RULES = {"sgd": 0, "adam": 1, "adamw": 2}
#: Columns of ``coef`` (one row per segment, the buffers' dtype): what the update reads,
#: written each step by the preparation pass from ``plan`` and the device's step ``clock``.
ACTIVE, LR, DECAY, SQRT_BC2, STEP = range(5)
N_COEF = 5
#: Columns of ``plan`` (one row per segment, float64, uploaded only when one changes):
#: ``ACTIVE``, ``LR`` (the effective rate), ``DECAY`` (AdamW's ``1 - lr wd``) as in ``coef``,
#: then the segment's step ``OFFSET`` and the rule's ``BETA1``, ``BETA2`` (0 for SGD).
OFFSET, BETA1, BETA2 = 3, 4, 5
N_PLAN = 6
#: Meaning of ``scalars`` per rule: SGD (momentum, weight_decay, nesterov, has_momentum),
#: Adam/AdamW (beta1, 1 - beta1, beta2, 1 - beta2, eps, weight_decay).
SCALARS = {"sgd": ("momentum", "weight_decay", "nesterov", "has_momentum"),
           "adam": ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps",
                    "weight_decay")}
#: Slots of ``status``.
BAD_GRAD, BAD_UPDATE, GATE = range(3)
#: Length of ``scalars`` (the longest rule's).
N_SCALARS = 6
