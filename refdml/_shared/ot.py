"""What the fast path shares with :mod:`refdml.ot` (internal; see :mod:`refdml._shared`).

refdml.gpu.ot solves many problems in one batch with its own solver, but its inputs, its
messages, its results and every closed form around the solve are the reference's: the
mirror holds the same context types, refuses the same inputs with the same words and
ends a solve the same way. One line per name: what it is, and why the fast path takes it.

The solver's batch and driver (refdml.gpu.ot._sinkhorn):

- ``OTBatch``: the reference's batch of solved problems (plan, potentials, counts); the
  fast path fills the same type, so the backward reads one context type.
- ``STAGE_TOL``: the tolerance of the intermediate eps-scaling stages.
- ``check_schedule_length``: the reference's refusal of an eps-scaling schedule too long.
- ``large_eps_half_steps``: the three exact log-domain half steps that end a solve whose
  ``eps`` exceeds its costs, written for either array module.
- ``mass_excess``: ``mass - 1`` of the regularised value summed through ``expm1``.
- ``relative_eps_message``: the message of an ``eps`` the dtype cannot resolve against
  the costs (the fast path applies it at float32's limits too).

Checks and messages (refdml.gpu.ot, its _common and _pairs modules):

- ``VALUES``: the two OT values (``"regularized"``, ``"transport_cost"``).
- ``check_solver_args``: the checks of ``eps``, ``max_iter``, ``tol``, ``eps_scaling``.
- ``check_p``: the check of the ground cost's power ``p``.
- ``batch_shape``: the broadcast batch shape of ``a``, ``b``, ``cost`` (and its message).
- ``weight_gradient_message``: the message of a weight gradient beyond the dtype.
- ``check_output``, ``check_gradient``: the finiteness checks of a divergence and of a
  gradient w.r.t. the points, with their messages (they take ``xp``).
- ``COST_NAME``: how the messages name the ground cost of point clouds.

Closed forms of the divergences (refdml.gpu.ot._common):

- ``ground_cost``, ``ground_cost_backward``: ``C = D^(p/2)`` from squared distances and its
  vector-Jacobian product (the latter takes ``xp``).
- ``normalised_sq``, ``cost_unit``, ``points_factor``: the exact rescalings of the squared
  distances and of the costs, and the chain-rule factor back to the unscaled points.
- ``centred``: the weight gradient projected on the simplex's tangent space (takes ``xp``).
- ``PairsContext``: the reference's context of the all-pairs divergence and the losses.
"""

from __future__ import annotations

from refdml.ot._divergence import (
    _COST_NAME as COST_NAME,
    _PairsContext as PairsContext,
    _check_gradient as check_gradient,
    _check_output as check_output,
    _check_p as check_p,
    _cost_unit as cost_unit,
    _ground_cost as ground_cost,
    _ground_cost_backward as ground_cost_backward,
    _normalised_sq as normalised_sq,
    _points_factor as points_factor,
)
from refdml.ot._entropic import centred
from refdml.ot._sinkhorn import (
    _STAGE_TOL as STAGE_TOL,
    VALUES,
    _OTBatch as OTBatch,
    _batch_shape as batch_shape,
    _check_schedule_length as check_schedule_length,
    _check_solver_args as check_solver_args,
    _large_eps_half_steps as large_eps_half_steps,
    _mass_excess as mass_excess,
    _relative_eps_message as relative_eps_message,
    _weight_gradient_message as weight_gradient_message,
)

__all__ = [
    "COST_NAME",
    "OTBatch",
    "STAGE_TOL",
    "PairsContext",
    "VALUES",
    "batch_shape",
    "centred",
    "check_gradient",
    "check_output",
    "check_p",
    "check_schedule_length",
    "check_solver_args",
    "cost_unit",
    "ground_cost",
    "ground_cost_backward",
    "large_eps_half_steps",
    "mass_excess",
    "normalised_sq",
    "points_factor",
    "relative_eps_message",
    "weight_gradient_message",
]
