"""The differentiable entropic OT value, Wasserstein DML Eq. (3): forward/backward pair.

``entropic_ot_forward`` returns, per problem, either the regularised value of Eq. (3)
(``value="regularized"``)::

    OT_eps(a, b) = <pi, C> + eps KL(pi | a (x) b) = <a, f> + <b, g>

or the transport cost of the entropic plan alone (``value="transport_cost"``), ``<pi, C>``.

Printed vs implemented: the paper writes ``W^p_{p,eta} = arg min ...``; the ``arg min`` is
the plan, the quantity used is the *minimum*, which is what ``value="regularized"`` returns.

Gradients (no autodiff; derivations in docs/ot.md, Secs. 3-4)
-------------------------------------------------------------
* regularised value: envelope theorem, ``dOT/dC = pi`` and ``dOT/da = f`` on the simplex.
* transport cost: implicit differentiation of the Sinkhorn fixed point. With
  ``u = rowsum(pi * C)``, ``v = colsum(pi * C)`` and ``[w; z]`` a solution of
  ``[[diag a, pi], [pi^T, diag b]] [w; z] = [u; v]`` (singular along ``(1, -1)``; solved
  by a pseudo-inverse of its Schur complement),
  ``d<pi,C>/dC_ij = pi_ij (1 + (w_i + z_j - C_ij)/eps)`` and ``d<pi,C>/da = w``.
* weights: ``a`` and ``b`` are normalised to sum 1 inside (any positive weights are
  accepted), so the value is a function of ``a / sum(a)`` and its gradient is unique:
  ``(f - <f, a/|a|>) / |a|``. Off the simplex the transport problem is infeasible, which is
  why ``f`` itself cannot be the finite-difference gradient of anything. The potentials'
  own ambiguity (``(f + t, g - t)`` solve the same problem) never reaches it: the
  projection removes any constant. It is formed against the largest weight
  (:func:`centred`), so equal potentials (coincident points, e.g. ``y`` scaled by 1e-300:
  the value does not depend on ``b`` there) give exactly 0, not the rounding of ``<f, a>``
  (an ulp of ``|f|`` along ``(1, ..., 1)``, different in every implementation).

The gradients are exact at the fixed point; with the L1 marginal error below ``tol`` they
are accurate to about ``tol`` relative. Where ``eps`` exceeds the largest cost the solve
ends with exact log-domain half steps that bring them to the rounding of the cost
(:func:`refdml.ot._sinkhorn._finish_large_eps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._validation import as_float_array, check_choice, check_context, check_upstream
from refdml.distances import _sum_to_shape
from refdml.ot._sinkhorn import (
    VALUES,
    _as_batch,
    _check_solver_args,
    _check_weights,
    _OTBatch,
    _solve_scaled,
    _unbatch,
    _weight_gradient,
)

__all__ = ["EntropicOTContext", "OTGrads", "entropic_ot_backward", "entropic_ot_forward"]

# Relative eigenvalue cut-off of the pseudo-inverse in the implicit (transport-cost) gradient.
_PINV_RCOND = 1e-12


@dataclass(frozen=True)
class OTGrads:
    """Gradients of the entropic OT value, named like the inputs."""

    a: np.ndarray            # shape of the ``a`` given
    b: np.ndarray
    cost: np.ndarray         # (..., n, m)


@dataclass(frozen=True)
class EntropicOTContext:
    """What :func:`entropic_ot_backward` needs: the solved batch and how to unbatch."""

    batch: _OTBatch
    value: str                       # the convention, "regularized" or "transport_cost"
    a_mass: np.ndarray               # (P,) sum of the weights as given
    b_mass: np.ndarray
    batch_shape: tuple[int, ...]     # shape of the output
    a_shape: tuple[int, ...]         # shapes of the inputs, for summing broadcast gradients
    b_shape: tuple[int, ...]


def centred(xp, values, weights):
    """``values - <values, weights>`` per row (``weights`` on the simplex), as
    ``(v - v_r) - sum_k w_k (v_k - v_r)`` with ``r`` the row's largest weight: exactly 0
    where the values of a row are equal; written against ``xp`` (the fast path's too)."""
    top = xp.argmax(weights, axis=1)[:, None]
    differences = values - xp.take_along_axis(values, top, axis=1)
    return differences - xp.sum(differences * weights, axis=1)[:, None]


def _ot_vjp(batch: _OTBatch, value: str, d_value: np.ndarray):
    """Gradients of ``sum_p d_value[p] * OT_p`` w.r.t. the cost and the (simplex) weights.

    ``d_cost`` is unit-free; the weight gradients are in the user's cost units and in the
    gauge ``<grad_a, a> = 0`` (the gradient of the value as a function of ``a / sum(a)``,
    at ``sum(a) = 1``).
    """
    plan, a, b = batch.plan, batch.a, batch.b
    if value == "regularized":
        d_cost = plan
        da, db = batch.f, batch.g
    else:
        d_cost, da, db = _transport_cost_vjp(batch)
    da, db = centred(np, da, a), centred(np, db, b)
    scale = batch.unit * d_value[:, None]
    return d_cost * d_value[:, None, None], da * scale, db * scale


def _transport_cost_vjp(batch: _OTBatch):
    """Implicit derivative of ``<pi*(C, a, b), C>`` (see the module docstring)."""
    plan, cost, a, b, eps = batch.plan, batch.cost, batch.a, batch.b, batch.eps
    weighted = plan * cost
    u = weighted.sum(axis=2)
    v = weighted.sum(axis=1)
    # Schur complement on z: (diag b - pi^T diag(1/a) pi) z = v - pi^T (u / a). It is
    # symmetric PSD with the constant vector in its kernel (the (t, -t) gauge), and nearly
    # singular when the plan nearly decouples into blocks (small eps): solve by a
    # pseudo-inverse that drops eigenvalues below _PINV_RCOND * max. Where the plan is a
    # numerical permutation every solution gives the same d_cost = pi.
    scaled = plan / a[:, :, None]
    schur = -np.einsum("pij,pik->pjk", plan, scaled)
    m = b.shape[1]
    diag = np.arange(m)
    schur[:, diag, diag] += b
    schur = 0.5 * (schur + np.swapaxes(schur, 1, 2))
    rhs = v - np.einsum("pij,pi->pj", plan, u / a)
    eigval, eigvec = np.linalg.eigh(schur)
    keep = eigval > _PINV_RCOND * eigval[:, -1:]
    inv = np.where(keep, 1.0 / np.where(keep, eigval, 1.0), 0.0)
    z = np.einsum("pjk,pk->pj", eigvec, inv * np.einsum("pjk,pj->pk", eigvec, rhs))
    w = (u - np.einsum("pij,pj->pi", plan, z)) / a
    d_cost = plan * (1.0 + (w[:, :, None] + z[:, None, :] - cost) / eps)
    return d_cost, w, z


def entropic_ot_forward(a, b, cost, *, eps, value="regularized", max_iter=1000, tol=1e-9,
                        eps_scaling=None) -> tuple[np.ndarray | float, EntropicOTContext]:
    """Differentiable entropic OT, Eq. (3); returns ``(out, ctx)``.

    .. math::

        \\mathrm{OT}_\\varepsilon = \\min_{\\pi \\in \\Pi(a, b)} \\langle \\pi, C \\rangle
        + \\varepsilon\\, \\mathrm{KL}(\\pi \\,\\|\\, a \\otimes b)
        \\quad\\text{or}\\quad \\langle \\pi^\\star, C \\rangle

    Parameters as in :func:`refdml.ot.sinkhorn` (``a`` (..., n), ``b`` (..., m), ``cost``
    (..., n, m), broadcast over leading batch dimensions); ``value`` is
    ``"regularized"`` (the paper's) or ``"transport_cost"``. ``out`` has the batch shape
    (a float for one problem).

    Parameters
    ----------
    value : {"regularized", "transport_cost"}
        The regularised value of Eq. (3) (the paper's) or ``<pi*, C>``.
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    cost = as_float_array(cost, "cost", min_ndim=2)
    a, a_mass = _check_weights(a, "a", cost.shape[-2])
    b, b_mass = _check_weights(b, "b", cost.shape[-1])
    a_b, b_b, cost_b, batch_shape = _as_batch(a, b, cost)
    batch = _solve_scaled(a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling)
    out = batch.value if value == "regularized" else batch.transport_cost
    ctx = EntropicOTContext(
        batch=batch,
        value=value,
        a_mass=np.broadcast_to(a_mass, batch_shape).reshape(-1),
        b_mass=np.broadcast_to(b_mass, batch_shape).reshape(-1),
        batch_shape=tuple(batch_shape),
        a_shape=a.shape,
        b_shape=b.shape,
    )
    return _unbatch(out, batch_shape), ctx


def entropic_ot_backward(ctx: EntropicOTContext, d_value) -> OTGrads:
    """Gradients of ``<d_value, out>`` w.r.t. ``a``, ``b`` and ``cost``.

    ``d_value`` has the shape of ``out`` (a number for one problem). ``a`` and ``b`` enter
    through ``a / sum(a)``; gradients of broadcast inputs are summed back to their shapes.
    """
    check_context(ctx, "ctx", EntropicOTContext)
    d_value = check_upstream(d_value, "d_value", ctx.batch_shape).reshape(-1)
    d_cost, da, db = _ot_vjp(ctx.batch, ctx.value, d_value)
    da = _weight_gradient(da, ctx.a_mass[:, None], "a")
    db = _weight_gradient(db, ctx.b_mass[:, None], "b")
    n, m = d_cost.shape[1:]
    d_cost = d_cost.reshape(ctx.batch_shape + (n, m))
    da = da.reshape(ctx.batch_shape + (n,))
    db = db.reshape(ctx.batch_shape + (m,))
    return OTGrads(
        a=_sum_to_shape(da, ctx.a_shape),
        b=_sum_to_shape(db, ctx.b_shape),
        cost=d_cost,
    )
