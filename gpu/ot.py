r"""Entropic OT on the fast path: Sinkhorn, OT value, Sinkhorn divergences, Wasserstein losses.

The mirror of :mod:`refdml.ot` (same names, signatures, result and context types, which
are the reference's dataclasses holding arrays of the input's module), written once
against the input's array module (NumPy or CuPy), in the input's dtype (float32 or
float64), every problem of a call in one batch (no Python loop over problems or pairs).
The maths and the gradients are the reference's (docs/ot.md); read that first.

What differs from the reference (and why)
------------------------------------------
* The solver (:mod:`refdml.gpu._ot_sinkhorn`) is log-domain at every half step
  (:func:`refdml.gpu._ot_sinkhorn._lse_half_step`, the place of a future CuPy kernel), so
  float32 stays finite down to ``eps = 1e-4`` of the largest cost; below that (float32)
  or ``1e-13`` (float64) a ``ValueError`` says the dtype cannot resolve the costs.
* float32: a positive ``tol`` below the dtype's residual floor (``u (1 + max C /
  eps)``, :func:`refdml.gpu._ot_sinkhorn.residual_floor`) is raised to it; ``converged``
  and the warning refer to the raised tol.
* The implicit (``value="transport_cost"``) gradient's pseudo-inverse cuts eigenvalues
  below ``_PINV_RCOND[dtype]`` of the largest (1e-12 float64, 1e-6 float32).
* Divergences between point clouds use the Gram identity for the squared distances
  (:func:`refdml.gpu.distances._scaled_sq`, points scaled into the unit ball first).

Synchronisation on CuPy (results that reach Python, and checks): the input checks
(finiteness, positive weights; :func:`refdml.gpu._validation.set_finite_checks`), the
largest cost (for the exact power-of-two rescaling, the eps check and the eps-scaling
schedule), the solver's convergence test every
:data:`refdml.gpu._ot_sinkhorn.CHECK_EVERY_GPU` iterations, the warning, the Python
floats the reference returns (one problem's scalars, divergence, loss values, masses),
and the sizes of the unique pairs of the losses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._numerics import common_scale
from refdml._validation import check_choice, check_context
from refdml._xp import array_namespace, is_cupy_array
from refdml.gpu import _ot_sinkhorn as _solver
from refdml.gpu._fast_checks import check_fast_upstream, data_checks, fast_labels
from refdml.gpu._validation import as_fast_array, result_dtype
from refdml.gpu.distances import _scaled_sq, _sum_to_shape
from refdml.ot._divergence import (
    _COST_NAME,
    PairwiseSinkhornDivergenceContext,
    PairwiseSinkhornDivergenceGrads,
    SinkhornDivergenceContext,
    SinkhornDivergenceGrads,
    _check_p,
    _cost_unit,
    _PairsContext,
)
from refdml.ot._entropic import EntropicOTContext, OTGrads
from refdml.ot._sinkhorn import VALUES, SinkhornResult, _check_solver_args, _OTBatch
from refdml.ot._wlosses import (
    WassersteinLossGrads,
    WContrastiveContext,
    WTripletContext,
)
from refdml._validation import check_scalar

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

_PINV_RCOND = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-6}


# --------------------------------------------------------------------------- checks
def _weights(w, name: str, size: int, ns, dtype):
    """Positive weights (leading batch dims allowed); ``(w / |w|, |w|)`` like the reference."""
    xp = ns.xp
    w = as_fast_array(w, name, min_ndim=1, dtype=dtype, ns=ns)
    if w.shape[-1] != size:
        raise ValueError(f"{name} has {w.shape[-1]} entries along its last axis, expected {size}")
    if data_checks(ns) and bool(xp.any(w <= 0)):
        bad = tuple(int(i) for i in xp.argwhere(w <= 0)[0])
        raise ValueError(
            f"{name} must be positive, got {w[bad]} at index {bad} "
            "(drop zero-weight points instead)"
        )
    peak = xp.max(w, axis=-1, keepdims=True)
    w = w / peak
    scaled_mass = xp.sum(w, axis=-1)
    with np.errstate(over="ignore"):
        mass = scaled_mass * peak[..., 0]
    return w / scaled_mass[..., None], mass


def _cost_and_weights(a, b, cost):
    ns = array_namespace(a, b, cost)
    dtype = result_dtype(*(as_fast_array(v, k, ns=ns) for v, k in ((a, "a"), (b, "b"))),
                         as_fast_array(cost, "cost", min_ndim=2, ns=ns))
    cost = as_fast_array(cost, "cost", min_ndim=2, dtype=dtype, ns=ns)
    a, a_mass = _weights(a, "a", cost.shape[-2], ns, dtype)
    b, b_mass = _weights(b, "b", cost.shape[-1], ns, dtype)
    return ns.xp, a, a_mass, b, b_mass, cost


def _as_batch(xp, a, b, cost):
    n, m = cost.shape[-2:]
    batch_shape = np.broadcast_shapes(cost.shape[:-2], a.shape[:-1], b.shape[:-1])
    cost_b = xp.broadcast_to(cost, batch_shape + (n, m)).reshape(-1, n, m)
    a_b = xp.broadcast_to(a, batch_shape + (n,)).reshape(-1, n)
    b_b = xp.broadcast_to(b, batch_shape + (m,)).reshape(-1, m)
    return xp.ascontiguousarray(a_b), xp.ascontiguousarray(b_b), xp.array(cost_b), batch_shape


def _unbatch(array, batch_shape):
    out = array.reshape(tuple(batch_shape) + tuple(array.shape[1:]))
    return out.item() if out.ndim == 0 else out          # a Python scalar: one sync on CuPy


def _solve_scaled(xp, a, b, cost, *, eps, max_iter, tol, eps_scaling, stacklevel=5):
    """Solve on the cost divided by one power of two (max |C| in [0.5, 1)); see the reference."""
    peak = float(xp.max(xp.abs(cost)))                   # one synchronisation on CuPy
    unit = float(common_scale(np.array(peak)))
    cost = cost * (1.0 / unit)
    _solver.check_relative_eps(eps / unit, peak / unit, cost.dtype, user_eps=eps)
    return _solver.solve_batch(xp, a, b, cost, eps=eps / unit, max_iter=max_iter, tol=tol,
                               eps_scaling=eps_scaling, unit=unit, warn_stacklevel=stacklevel)


# --------------------------------------------------------------------------- Sinkhorn
def sinkhorn(a, b, cost, *, eps, max_iter=1000, tol=1e-9, eps_scaling=None) -> SinkhornResult:
    """Entropic OT of Eq. (3), batched, log domain; as :func:`refdml.ot.sinkhorn`.

    Arrays of the result are of the input's module and dtype; ``n_iter`` counts
    iterations to the first convergence check that passed (every iteration on NumPy,
    every ``CHECK_EVERY_GPU`` on CuPy). Warns :class:`refdml.ConvergenceWarning` if a
    problem did not reach ``tol`` (raised to the dtype's floor, see the module docstring).
    """
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    xp, a, _, b, _, cost = _cost_and_weights(a, b, cost)
    a_b, b_b, cost_b, batch_shape = _as_batch(xp, a, b, cost)
    batch = _solve_scaled(xp, a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling)
    return SinkhornResult(
        plan=_unbatch(batch.plan, batch_shape),
        f=_unbatch(batch.unit * batch.f, batch_shape),
        g=_unbatch(batch.unit * batch.g, batch_shape),
        value=_unbatch(_solver.batch_value(xp, batch), batch_shape),
        transport_cost=_unbatch(_solver.batch_transport_cost(xp, batch), batch_shape),
        n_iter=_unbatch(batch.n_iter, batch_shape),
        marginal_error=_unbatch(batch.marginal_error, batch_shape),
        converged=_unbatch(batch.converged, batch_shape),
        eps=eps,
    )


# --------------------------------------------------------------------------- OT value
def _ot_vjp(xp, batch: _OTBatch, value: str, d_value):
    """Gradients of ``sum_p d_value[p] OT_p`` w.r.t. the cost and the simplex weights."""
    if value == "regularized":
        d_cost, da, db = batch.plan, batch.f, batch.g
    else:
        d_cost, da, db = _transport_cost_vjp(xp, batch)
    da = da - xp.sum(da * batch.a, axis=1)[:, None]
    db = db - xp.sum(db * batch.b, axis=1)[:, None]
    scale = batch.unit * d_value[:, None]
    return d_cost * d_value[:, None, None], da * scale, db * scale


def _transport_cost_vjp(xp, batch: _OTBatch):
    """Implicit derivative of ``<pi, C>``: the reference's Schur-complement pseudo-inverse."""
    plan, cost, a, b, eps = batch.plan, batch.cost, batch.a, batch.b, batch.eps
    weighted = plan * cost
    u, v = xp.sum(weighted, axis=2), xp.sum(weighted, axis=1)
    schur = -(xp.swapaxes(plan, 1, 2) @ (plan / a[:, :, None]))
    diag = xp.arange(b.shape[1])
    schur[:, diag, diag] += b
    schur = 0.5 * (schur + xp.swapaxes(schur, 1, 2))
    rhs = v - (xp.swapaxes(plan, 1, 2) @ (u / a)[:, :, None])[:, :, 0]
    eigval, eigvec = xp.linalg.eigh(schur)
    keep = eigval > _PINV_RCOND[np.dtype(plan.dtype)] * eigval[:, -1:]
    inv = xp.where(keep, 1.0 / xp.where(keep, eigval, 1.0), 0.0).astype(plan.dtype)
    coeff = (xp.swapaxes(eigvec, 1, 2) @ rhs[:, :, None])[:, :, 0]
    z = (eigvec @ (inv * coeff)[:, :, None])[:, :, 0]
    w = (u - (plan @ z[:, :, None])[:, :, 0]) / a
    d_cost = plan * (1.0 + (w[:, :, None] + z[:, None, :] - cost) * (1.0 / eps))
    return d_cost, w, z


def entropic_ot_forward(a, b, cost, *, eps, value="regularized", max_iter=1000, tol=1e-9,
                        eps_scaling=None):
    """Differentiable entropic OT, Eq. (3); ``(out, ctx)`` as :func:`refdml.ot.entropic_ot_forward`."""
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    xp, a, a_mass, b, b_mass, cost = _cost_and_weights(a, b, cost)
    a_b, b_b, cost_b, batch_shape = _as_batch(xp, a, b, cost)
    batch = _solve_scaled(xp, a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling)
    out = (_solver.batch_value(xp, batch) if value == "regularized"
           else _solver.batch_transport_cost(xp, batch))
    ctx = EntropicOTContext(
        batch=batch, value=value,
        a_mass=xp.broadcast_to(a_mass, batch_shape).reshape(-1),
        b_mass=xp.broadcast_to(b_mass, batch_shape).reshape(-1),
        batch_shape=tuple(batch_shape), a_shape=tuple(a.shape), b_shape=tuple(b.shape),
    )
    return _unbatch(out, batch_shape), ctx


def entropic_ot_backward(ctx: EntropicOTContext, d_value) -> OTGrads:
    """Gradients of ``<d_value, out>`` w.r.t. ``a``, ``b``, ``cost``; no re-solve."""
    check_context(ctx, "ctx", EntropicOTContext)
    batch = ctx.batch
    ns = array_namespace(batch.plan)
    xp = ns.xp
    d_value = check_fast_upstream(d_value, "d_value", ctx.batch_shape, ns, batch.plan.dtype)
    d_value = xp.reshape(xp.asarray(d_value, dtype=batch.plan.dtype), (-1,))
    d_cost, da, db = _ot_vjp(xp, batch, ctx.value, d_value)
    with np.errstate(over="ignore"):
        da = da / ctx.a_mass[:, None]
        db = db / ctx.b_mass[:, None]
    n, m = d_cost.shape[1:]
    return OTGrads(
        a=_sum_to_shape(da.reshape(ctx.batch_shape + (n,)), ctx.a_shape),
        b=_sum_to_shape(db.reshape(ctx.batch_shape + (m,)), ctx.b_shape),
        cost=d_cost.reshape(ctx.batch_shape + (n, m)),
    )


# --------------------------------------------------------------------------- ground cost
def _cloud_sq(xp, x, y, p: float, self_pairs: bool):
    """``||x_i - y_j||^2`` (P, n, m) of clouds in the unit ball; self: symmetric, 0 diagonal."""
    sq = _scaled_sq(xp, x, y, self_pairs)
    if self_pairs:
        sq = 0.5 * (sq + xp.swapaxes(sq, 1, 2))
    return sq


def _ground_cost(sq, p: float):
    return sq if p == 2.0 else sq ** (0.5 * p)


def _ground_cost_backward(xp, x, y, sq, p, d_cost):
    """Gradients of ``<d_cost, ||x_i - y_j||^p>`` w.r.t. x and y (0 at x_i = y_j)."""
    if p == 2.0:
        w = 2.0 * d_cost
    else:
        positive = sq > 0
        w = xp.where(positive, p * d_cost * xp.where(positive, sq, 1.0) ** (0.5 * p - 1.0), 0.0)
        w = w.astype(sq.dtype, copy=False)
    d_x = xp.sum(w, axis=2)[:, :, None] * x - w @ y
    d_y = xp.sum(w, axis=1)[:, :, None] * y - xp.swapaxes(w, 1, 2) @ x
    return d_x, d_y


def _check_output(xp, values, what: str) -> None:
    if not bool(xp.all(xp.isfinite(values))):
        raise ValueError(f"{what} overflows {np.dtype(values.dtype).name}; rescale the data (or eps)")


def _scale_and_unit(xp, names: str, p: float, *arrays):
    peak = max(float(xp.max(xp.abs(v))) for v in arrays)   # one synchronisation on CuPy
    scale = float(common_scale(np.array(peak)))
    return scale, _cost_unit(scale, p, names)


# --------------------------------------------------------------------------- divergence
def sinkhorn_divergence_forward(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                max_iter=1000, tol=1e-9, eps_scaling=None):
    """Sinkhorn divergence of Eq. (4) between two weighted clouds; ``(sd, ctx)``.

    As :func:`refdml.ot.sinkhorn_divergence_forward`; ``sd`` is a Python float (one sync).
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    ns = array_namespace(x, y, a, b)
    xp = ns.xp
    given = [v for v in (a, b) if v is not None]
    dtype = result_dtype(as_fast_array(x, "x", ndim=2, ns=ns), as_fast_array(y, "y", ndim=2, ns=ns),
                         *(as_fast_array(v, "a", ns=ns) for v in given))
    x = as_fast_array(x, "x", ndim=2, dtype=dtype, ns=ns)
    y = as_fast_array(y, "y", ndim=2, dtype=dtype, ns=ns)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    n, m = x.shape[0], y.shape[0]
    weights_given = bool(given)
    a, a_mass = _weight_vector(xp.full(n, 1.0 / n, dtype=dtype) if a is None else a, "a", n, ns, dtype)
    b, b_mass = _weight_vector(xp.full(m, 1.0 / m, dtype=dtype) if b is None else b, "b", m, ns, dtype)
    scale, unit = _scale_and_unit(xp, "x and y", p, x, y)
    xs, ys = x * (1.0 / scale), y * (1.0 / scale)
    sq_xy = _cloud_sq(xp, xs[None], ys[None], p, False)
    sq_xx = _cloud_sq(xp, xs[None], xs[None], p, True)
    sq_yy = _cloud_sq(xp, ys[None], ys[None], p, True)
    costs = [_ground_cost(sq, p) for sq in (sq_xy, sq_xx, sq_yy)]
    largest = max(float(xp.max(c)) for c in costs)
    _solver.check_relative_eps(eps / unit, largest, dtype, user_eps=eps, cost_name=_COST_NAME)
    solve = dict(eps=eps / unit, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit)
    xy = _solver.solve_batch(xp, a[None], b[None], costs[0], **solve)
    xx = _solver.solve_batch(xp, a[None], a[None], costs[1], symmetric=True, **solve)
    yy = _solver.solve_batch(xp, b[None], b[None], costs[2], symmetric=True, **solve)
    term = _term(xp, value)
    divergence = term(xy) - 0.5 * (term(xx) + term(yy))
    _check_output(xp, divergence, "the Sinkhorn divergence")
    ctx = SinkhornDivergenceContext(
        x=xs, y=ys, scale=scale, unit=unit, a=a, b=b, a_mass=a_mass, b_mass=b_mass,
        weights_given=weights_given, p=p, value=value, sq_xy=sq_xy, sq_xx=sq_xx,
        sq_yy=sq_yy, xy=xy, xx=xx, yy=yy,
    )
    return float(divergence[0]), ctx


def _weight_vector(w, name, size, ns, dtype):
    w_norm, mass = _weights(w, name, size, ns, dtype)
    if w_norm.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {tuple(w_norm.shape)}")
    return w_norm, float(mass)


def _term(xp, value: str):
    if value == "regularized":
        return lambda t: _solver.batch_value(xp, t)
    return lambda t: _solver.batch_transport_cost(xp, t)


def _scalar_upstream(d_value, ns, dtype):
    d = check_fast_upstream(d_value, "d_value", (), ns, dtype)
    return ns.xp.reshape(ns.xp.asarray(d, dtype=dtype), (1,))


def sinkhorn_divergence_backward(ctx: SinkhornDivergenceContext, d_value) -> SinkhornDivergenceGrads:
    """Gradients of ``d_value * sd`` w.r.t. x, y (and a, b when weights were given)."""
    check_context(ctx, "ctx", SinkhornDivergenceContext)
    ns = array_namespace(ctx.x)
    xp = ns.xp
    one = _scalar_upstream(d_value, ns, ctx.x.dtype)
    half = -0.5 * one
    x, y, p = ctx.x[None], ctx.y[None], ctx.p
    d_cost, da_xy, db_xy = _ot_vjp(xp, ctx.xy, ctx.value, one)
    dx_xy, dy_xy = _ground_cost_backward(xp, x, y, ctx.sq_xy, p, d_cost)
    d_cost, da1, da2 = _ot_vjp(xp, ctx.xx, ctx.value, half)
    dx1, dx2 = _ground_cost_backward(xp, x, x, ctx.sq_xx, p, d_cost)
    d_cost, db1, db2 = _ot_vjp(xp, ctx.yy, ctx.value, half)
    dy1, dy2 = _ground_cost_backward(xp, y, y, ctx.sq_yy, p, d_cost)
    to_points = ctx.unit / ctx.scale
    grad_a = grad_b = None
    if ctx.weights_given:
        grad_a = (da_xy + da1 + da2)[0] * (1.0 / ctx.a_mass)
        grad_b = (db_xy + db1 + db2)[0] * (1.0 / ctx.b_mass)
    return SinkhornDivergenceGrads(
        x=(dx_xy + dx1 + dx2)[0] * to_points, y=(dy_xy + dy1 + dy2)[0] * to_points,
        a=grad_a, b=grad_b,
    )


def sinkhorn_divergence(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                        max_iter=1000, tol=1e-9, eps_scaling=None):
    """``sd, grads`` of the Sinkhorn divergence: one call of the pair."""
    divergence, ctx = sinkhorn_divergence_forward(
        x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling,
    )
    return divergence, sinkhorn_divergence_backward(ctx, 1.0)


# --------------------------------------------------------------------------- many pairs
def _index_add(xp, target, index, values) -> None:
    """``target[index] += values`` with repeated indices summed (NumPy or CuPy)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


def _pair_divergences(xp, clouds, unique_pairs, selves, *, eps, p, value, max_iter, tol,
                      eps_scaling, name="clouds"):
    """SD for every row (i, j), i < j, of ``unique_pairs`` (K, 2); ``(values (K,), ctx)``.

    All K cross problems are one batch, the S self problems (``selves``) another.
    """
    n, dtype = clouds.shape[1], clouds.dtype
    scale, unit = _scale_and_unit(xp, name, p, clouds)
    scaled = clouds * (1.0 / scale)
    first, second = unique_pairs[:, 0], unique_pairs[:, 1]
    sq_cross = _cloud_sq(xp, scaled[first], scaled[second], p, False)
    sq_self = _cloud_sq(xp, scaled[selves], scaled[selves], p, True)
    cost_cross, cost_self = _ground_cost(sq_cross, p), _ground_cost(sq_self, p)
    largest = max(float(xp.max(cost_cross)), float(xp.max(cost_self)))
    _solver.check_relative_eps(eps / unit, largest, dtype, user_eps=eps, cost_name=_COST_NAME)
    solve = dict(eps=eps / unit, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit)
    weights = xp.full((1, n), 1.0 / n, dtype=dtype)
    k, s = sq_cross.shape[0], sq_self.shape[0]
    cross = _solver.solve_batch(xp, xp.repeat(weights, k, 0), xp.repeat(weights, k, 0),
                                cost_cross, **solve)
    self_ = _solver.solve_batch(xp, xp.repeat(weights, s, 0), xp.repeat(weights, s, 0),
                                cost_self, symmetric=True, **solve)
    term = _term(xp, value)
    self_value = xp.zeros(clouds.shape[0], dtype=dtype)
    self_value[selves] = term(self_)
    values = term(cross) - 0.5 * (self_value[first] + self_value[second])
    _check_output(xp, values, "the Sinkhorn divergence")
    ctx = _PairsContext(scaled, scale, unit, unique_pairs, selves, sq_cross, sq_self, cross,
                        self_, p, value)
    return values, ctx


def _pair_divergences_backward(xp, ctx: _PairsContext, d_unique):
    """Gradient w.r.t. the (unscaled) clouds of ``sum_k d_unique[k] SD(pairs[k])``."""
    clouds, pairs = ctx.clouds, ctx.pairs
    first, second = pairs[:, 0], pairs[:, 1]
    grad = xp.zeros_like(clouds)
    d_cost, _, _ = _ot_vjp(xp, ctx.cross, ctx.value, d_unique)
    d_x, d_y = _ground_cost_backward(xp, clouds[first], clouds[second], ctx.sq_cross, ctx.p,
                                     d_cost)
    _index_add(xp, grad, first, d_x)
    _index_add(xp, grad, second, d_y)
    d_self = xp.zeros(clouds.shape[0], dtype=clouds.dtype)
    _index_add(xp, d_self, first, -0.5 * d_unique)
    _index_add(xp, d_self, second, -0.5 * d_unique)
    d_cost, _, _ = _ot_vjp(xp, ctx.self_, ctx.value, d_self[ctx.selves])
    x = clouds[ctx.selves]
    d_x1, d_x2 = _ground_cost_backward(xp, x, x, ctx.sq_self, ctx.p, d_cost)
    grad[ctx.selves] += d_x1 + d_x2                    # selves are unique
    return grad * (ctx.unit / ctx.scale)


def _cloud_batch(clouds, name: str):
    ns = array_namespace(clouds)
    clouds = as_fast_array(clouds, name, ndim=3, ns=ns)
    if clouds.shape[1] < 1 or clouds.shape[2] < 1:
        raise ValueError(f"{name} must have shape (B, n, d) with n, d >= 1, got {clouds.shape}")
    return ns, clouds


def pairwise_sinkhorn_divergence_forward(clouds, *, eps, p=2, value="regularized",
                                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """(B, B) Sinkhorn divergences between all pairs of uniform clouds; ``(sd, ctx)``.

    As :func:`refdml.ot.pairwise_sinkhorn_divergence_forward`: the ``B (B - 1) / 2`` cross
    problems are one batch, the ``B`` self problems another.
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    ns, clouds = _cloud_batch(clouds, "clouds")
    xp = ns.xp
    n_clouds = clouds.shape[0]
    out = xp.zeros((n_clouds, n_clouds), dtype=clouds.dtype)
    if n_clouds < 2:
        return out, PairwiseSinkhornDivergenceContext(tuple(clouds.shape), None)
    first, second = xp.triu_indices(n_clouds, k=1)
    values, ctx = _pair_divergences(
        xp, clouds, xp.stack([first, second], axis=1), xp.arange(n_clouds), eps=eps, p=p,
        value=value, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    out[first, second] = values
    out[second, first] = values
    return out, PairwiseSinkhornDivergenceContext(tuple(clouds.shape), ctx)


def pairwise_sinkhorn_divergence_backward(ctx: PairwiseSinkhornDivergenceContext, d_divergence):
    """Gradient of ``<d_divergence, sd>`` w.r.t. the clouds; ``d_divergence`` (B, B)."""
    check_context(ctx, "ctx", PairwiseSinkhornDivergenceContext)
    n_clouds = ctx.shape[0]
    if ctx.pairs is None:
        ns = array_namespace(d_divergence) if hasattr(d_divergence, "shape") else array_namespace()
        check_fast_upstream(d_divergence, "d_divergence", (n_clouds, n_clouds), ns, np.float64)
        return PairwiseSinkhornDivergenceGrads(ns.xp.zeros(ctx.shape))
    ns = array_namespace(ctx.pairs.clouds)
    d = check_fast_upstream(d_divergence, "d_divergence", (n_clouds, n_clouds), ns,
                            ctx.pairs.clouds.dtype)
    first, second = ctx.pairs.pairs[:, 0], ctx.pairs.pairs[:, 1]
    d_unique = d[first, second] + d[second, first]
    return PairwiseSinkhornDivergenceGrads(_pair_divergences_backward(ns.xp, ctx.pairs, d_unique))


def pairwise_sinkhorn_divergence(clouds, *, eps, p=2, value="regularized", max_iter=1000,
                                 tol=1e-9, eps_scaling=None):
    """(B, B) matrix of Sinkhorn divergences (the forward alone)."""
    return pairwise_sinkhorn_divergence_forward(
        clouds, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )[0]


# --------------------------------------------------------------------------- losses
def _loss_args(features, labels, margin, eps, p, value, max_iter, tol, eps_scaling):
    ns, features = _cloud_batch(features, "features")
    labels = fast_labels(labels, "labels", ns, length=features.shape[0])
    margin = check_scalar(margin, "margin", low=0.0)
    check_choice(value, "value", VALUES)
    solver = _check_solver_args(eps, max_iter, tol, eps_scaling)
    return ns, features, labels, margin, _check_p(p), solver


def _index_rows(rows, name: str, width: int, n_items: int, ns):
    """Integer index rows (K, width) in ``[0, n_items)``, as int64 of ``ns`` (reference wording)."""
    xp = ns.xp
    array = rows if is_cupy_array(rows) else np.asarray(rows)
    kind = np.dtype(array.dtype)
    if kind == bool or not np.issubdtype(kind, np.integer):
        if array.size == 0 and array.ndim == 2 and array.shape[1] == width:
            return xp.zeros((0, width), dtype=xp.int64)
        raise TypeError(f"{name} must be an integer array of shape (K, {width}), got dtype {kind}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (K, {width}), got {tuple(array.shape)}")
    array = xp.asarray(array, dtype=xp.int64)
    if array.size and data_checks(ns):
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= n_items:
            raise ValueError(f"{name} holds indices outside [0, {n_items}), got {low}..{high}")
    return array


def _unique_pairs(xp, pairs, n_images: int):
    """Distinct unordered pairs (lexicographic, i < j) and the map from the rows to them."""
    ordered = xp.sort(pairs, axis=1)
    code = ordered[:, 0] * n_images + ordered[:, 1]
    unique, inverse = xp.unique(code, return_inverse=True)
    unique_pairs = xp.stack([unique // n_images, unique % n_images], axis=1)
    return unique_pairs, inverse.reshape(-1), xp.unique(unique_pairs)


def _losses_divergences(ns, features, pairs, eps, p, value, max_iter, tol, eps_scaling):
    xp = ns.xp
    unique_pairs, inverse, selves = _unique_pairs(xp, pairs, features.shape[0])
    values, ctx = _pair_divergences(
        xp, features, unique_pairs, selves, eps=eps, p=p, value=value, max_iter=max_iter,
        tol=tol, eps_scaling=eps_scaling, name="features",
    )
    return values[inverse], inverse, ctx


def _accumulate(xp, d_rows, inverse, n_unique: int, dtype):
    return xp.bincount(inverse, weights=d_rows, minlength=n_unique).astype(dtype)


def wcontrastive_forward(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein contrastive loss, Eq. (1); ``(loss, ctx)`` as the reference (loss: a float)."""
    ns, features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    xp, dtype = ns.xp, features.dtype
    n_images = features.shape[0]
    if pairs is None:
        pairs = xp.stack(xp.triu_indices(n_images, k=1), axis=1)
    pairs = _index_rows(pairs, "pairs", 2, n_images, ns)
    if pairs.shape[0] == 0:
        return 0.0, WContrastiveContext(tuple(features.shape), None, xp.zeros(0, dtype=dtype))
    if data_checks(ns) and bool(xp.any(pairs[:, 0] == pairs[:, 1])):
        row = int(xp.flatnonzero(pairs[:, 0] == pairs[:, 1])[0])
        raise ValueError(
            f"pairs must join two different images, got {pairs[row].tolist()} at row {row}"
        )
    d_w, inverse, divergences = _losses_divergences(ns, features, pairs, eps, p, value,
                                                    max_iter, tol, eps_scaling)
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    hinge = margin - d_w
    terms = xp.where(same, d_w, xp.maximum(hinge, 0))
    count = pairs.shape[0]
    d_rows = xp.where(same, 1.0, xp.where(hinge > 0, -1.0, 0.0)) / count
    d_unique = _accumulate(xp, d_rows, inverse, divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(terms)) / count                   # the Python float: one sync
    return loss, WContrastiveContext(tuple(features.shape), divergences, d_unique)


def _loss_backward(ctx, d_value):
    if ctx.divergences is None:
        ns = array_namespace(ctx.d_unique)
        check_fast_upstream(d_value, "d_value", (), ns, ctx.d_unique.dtype)
        return WassersteinLossGrads(ns.xp.zeros(ctx.shape, dtype=ctx.d_unique.dtype))
    ns = array_namespace(ctx.divergences.clouds)
    d = _scalar_upstream(d_value, ns, ctx.d_unique.dtype)
    return WassersteinLossGrads(_pair_divergences_backward(ns.xp, ctx.divergences, d * ctx.d_unique))


def wcontrastive_backward(ctx: WContrastiveContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (no re-solve)."""
    check_context(ctx, "ctx", WContrastiveContext)
    return _loss_backward(ctx, d_value)


def wcontrastive(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                 max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein contrastive loss (one call of the pair)."""
    loss, ctx = wcontrastive_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, pairs=pairs,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wcontrastive_backward(ctx, 1.0)


def _all_triplets(xp, labels):
    """Every (a, p, n) with y_a = y_p != y_n, a != p, in the reference's order."""
    same = labels[:, None] == labels[None, :]
    positive = same & ~xp.eye(labels.shape[0], dtype=bool)
    mask = positive[:, :, None] & ~same[:, None, :]
    return xp.stack(xp.nonzero(mask), axis=1).astype(xp.int64)


def wtriplet_forward(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
                     max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein triplet loss, Eq. (2); ``(loss, ctx)`` as the reference (loss: a float)."""
    ns, features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    xp, dtype = ns.xp, features.dtype
    n_images = features.shape[0]
    triplets = (_all_triplets(xp, labels) if triplets is None
                else _index_rows(triplets, "triplets", 3, n_images, ns))
    if triplets.shape[0] == 0:
        return 0.0, WTripletContext(tuple(features.shape), None, xp.zeros(0, dtype=dtype))
    bad = (triplets[:, 0] == triplets[:, 1]) | (triplets[:, 0] == triplets[:, 2])
    if data_checks(ns) and bool(xp.any(bad)):
        row = int(xp.flatnonzero(bad)[0])
        raise ValueError(
            "triplets must have anchor != positive and anchor != negative, got "
            f"{triplets[row].tolist()} at row {row}"
        )
    pairs = xp.concatenate([triplets[:, [0, 1]], triplets[:, [0, 2]]])
    d_w, inverse, divergences = _losses_divergences(ns, features, pairs, eps, p, value,
                                                    max_iter, tol, eps_scaling)
    count = triplets.shape[0]
    hinge = d_w[:count] - d_w[count:] + margin
    active = (hinge > 0).astype(dtype) / count
    d_unique = _accumulate(xp, xp.concatenate([active, -active]), inverse,
                           divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(xp.maximum(hinge, 0))) / count    # the Python float: one sync
    return loss, WTripletContext(tuple(features.shape), divergences, d_unique)


def wtriplet_backward(ctx: WTripletContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (no re-solve)."""
    check_context(ctx, "ctx", WTripletContext)
    return _loss_backward(ctx, d_value)


def wtriplet(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
             max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein triplet loss (one call of the pair)."""
    loss, ctx = wtriplet_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, triplets=triplets,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wtriplet_backward(ctx, 1.0)
