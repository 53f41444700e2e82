"""Private helpers of the OT fast path's array path: input checks, the scaled solve, the
ground cost and the pair costs."""

from __future__ import annotations

import math

import numpy as np

from refdml._numerics import _REFINE, common_scale
from refdml._backend import get_backend
from refdml.gpu.ot import _sinkhorn as _solver
from refdml._validation import as_fast_array, check_fast_upstream, data_checks, result_dtype
from refdml.gpu.distances import scaled_sq
from refdml._shared.ot import (
    OTBatch,
    batch_shape,
    centred,
    check_gradient,
    cost_unit,
    normalised_sq,
    points_factor,
)
from refdml._shared.ot import ground_cost_backward as _reference_ground_cost_backward


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
    with ns.errstate(over="ignore"):
        mass = scaled_mass * peak[..., 0]
    return w / scaled_mass[..., None], mass


def _cost_and_weights(a, b, cost):
    ns = get_backend(a, b, cost)
    dtype = result_dtype(*(as_fast_array(v, k, ns=ns) for v, k in ((a, "a"), (b, "b"))),
                         as_fast_array(cost, "cost", min_ndim=2, ns=ns))
    cost = as_fast_array(cost, "cost", min_ndim=2, dtype=dtype, ns=ns)
    a, a_mass = _weights(a, "a", cost.shape[-2], ns, dtype)
    b, b_mass = _weights(b, "b", cost.shape[-1], ns, dtype)
    return ns.xp, a, a_mass, b, b_mass, cost


def _as_batch(xp, a, b, cost):
    n, m = cost.shape[-2:]
    shape = batch_shape(a.shape, b.shape, cost.shape)
    cost_b = xp.broadcast_to(cost, shape + (n, m)).reshape(-1, n, m)
    a_b = xp.broadcast_to(a, shape + (n,)).reshape(-1, n)
    b_b = xp.broadcast_to(b, shape + (m,)).reshape(-1, m)
    return xp.ascontiguousarray(a_b), xp.ascontiguousarray(b_b), xp.array(cost_b), shape


def _unbatch(array, batch_shape):
    out = array.reshape(tuple(batch_shape) + tuple(array.shape[1:]))
    return out.item() if out.ndim == 0 else out          # a Python scalar: one sync on CuPy


def _divided(xp, array, power_of_two: float):
    """``array / power_of_two`` exactly, by ``ldexp``: ``array * (1 / s)`` cast ``1 / s`` to
    the dtype first, which overflows float32 for ``s`` below ``2^-128`` (subnormal data)."""
    return xp.ldexp(array, 1 - math.frexp(power_of_two)[1])


def _solve_scaled(xp, a, b, cost, *, eps, max_iter, tol, eps_scaling, impl, stacklevel=5):
    """Solve on the cost divided by one power of two (max |C| in [0.5, 1)); see the reference.
    ``impl``: the implementation the public function chose (a member of
    :data:`refdml.gpu.ot.IMPLEMENTATIONS`).

    One transfer on CuPy reads max |C|, max C and the smallest of the problems' max C (the
    solver's ``largest`` and ``smallest``, divided on the host by the power of two: exact).
    """
    peak, largest, smallest = xp.stack([
        xp.max(xp.abs(cost)), xp.max(cost), xp.min(xp.max(cost, axis=(1, 2)))]).tolist()
    unit = float(common_scale(np.array(peak)))
    cost = _divided(xp, cost, unit)
    _solver.check_relative_eps(eps / unit, peak / unit, cost.dtype, user_eps=eps,
                               data_name="cost", unit=unit)
    return _solver.solve_batch(xp, a, b, cost, eps=eps / unit, max_iter=max_iter, tol=tol,
                               eps_scaling=eps_scaling, unit=unit, warn_stacklevel=stacklevel,
                               largest=largest / unit, smallest=smallest / unit, impl=impl)


# --------------------------------------------------------------------------- ground cost
def _cloud_sq(xp, x, y, self_pairs: bool):
    """``||x_i - y_j||^2`` (P, n, m) of clouds in the unit ball; self: symmetric, 0 diagonal.

    The Gram identity of :func:`refdml.gpu.distances.scaled_sq`, with its near-pair rule
    (recomputed from explicit differences where the backend refines them, as the
    reference's: :meth:`refdml._backend.Backend.refine`, the family
    docstring)."""
    sq = scaled_sq(get_backend(x, y), x, y, self_pairs)
    if self_pairs:
        sq = 0.5 * (sq + xp.swapaxes(sq, 1, 2))
    return sq


# Largest Gram matrix of all points (entries) that _cross_sq builds instead of K small ones.
_GRAM_ENTRIES = 1 << 24


def _cross_sq(xp, clouds, first, second):
    """``||x_i - y_j||^2`` (K, n, n) for the clouds of every pair (``first[k]``, ``second[k]``,
    two different clouds) of ``clouds`` (B, n, d) in the unit ball: the array path's pair
    costs.

    When the pairs cover at least a quarter of all ``B^2`` and the ``(B n, B n)`` Gram
    matrix is small, one product of all points (the Gram identity as :func:`_cloud_sq`, the
    blocks of the pairs gathered) instead of ``K`` small products of gathered ``(n, d)``
    clouds: one large GEMM and no (K, n, d) copies; its near pairs are then refined where
    the backend refines them (:func:`_refine_pairs`), so that either route gives
    :func:`_cloud_sq`'s values.
    """
    n_clouds, n, d = clouds.shape
    if 4 * first.shape[0] < n_clouds * n_clouds or (n_clouds * n) ** 2 > _GRAM_ENTRIES:
        return _cloud_sq(xp, clouds[first], clouds[second], False)
    flat = clouds.reshape(n_clouds * n, d)
    norms = xp.sum(flat * flat, axis=1).reshape(n_clouds, n)
    gram = (flat @ flat.T).reshape(n_clouds, n, n_clouds, n)
    sq = gram[first, :, second, :]                   # (K, n, n): the advanced axis first
    sq *= -2.0
    sq += norms[first][:, :, None]
    sq += norms[second][:, None, :]
    get_backend(sq).refine(_refine_pairs, xp, clouds, first, second, sq, norms)
    return xp.maximum(sq, sq.dtype.type(0), out=sq)


def _refine_pairs(xp, clouds, first, second, sq, norms) -> None:
    """Recompute in place, from explicit differences, the entries of ``sq`` (K, n, n) below
    ``_REFINE (|x_i|^2 + |y_j|^2)``, ``x = clouds[first[k]]``, ``y = clouds[second[k]]``,
    ``norms`` (B, n) the squared norms: the reference's near-pair rule (as
    :func:`refdml.gpu.distances.scaled_sq`'s) on the Gram blocks, without gathering the
    clouds of every pair. The pairs' count is read on the host."""
    magnitude = norms[first][:, :, None] + norms[second][:, None, :]
    k, i, j = xp.nonzero(sq <= _REFINE * magnitude)
    if k.shape[0]:
        diff = clouds[first[k], i] - clouds[second[k], j]
        sq[k, i, j] = xp.einsum("kd,kd->k", diff, diff)


def _ground_cost_backward(xp, x, y, sq, p, d_cost):
    """The reference's :func:`refdml._shared.ot.ground_cost_backward` on ``xp``'s
    arrays, after refusing a ``p`` beyond the dtype (float32): at the largest distance the
    gradient is ``p`` times the cost."""
    if p != 2.0 and p > float(np.finfo(sq.dtype).max):
        raise ValueError(
            f"p == {p:g} is beyond {np.dtype(sq.dtype).name}'s range: the gradient "
            "p ||x - y||^(p-1) cannot be formed in it; use float64"
        )
    return _reference_ground_cost_backward(x, y, sq, p, d_cost, xp=xp)


def _to_points(ns, gradient, unit: float, scale: float, sq_unit: float, name: str, p: float):
    """``gradient`` (w.r.t. the scaled points) times ``unit / (scale sq_unit)``, the
    reference's chain-rule factor, applied as a power of two where it is one and beyond
    the dtype (float32 data near its subnormals); a result beyond the dtype is named
    (checked on NumPy, on CuPy while data checks are on)."""
    xp = ns.xp
    factor = points_factor(unit, scale, sq_unit)
    info = np.finfo(gradient.dtype)
    mantissa, exponent = math.frexp(factor)
    with ns.errstate(over="ignore", invalid="ignore", under="ignore"):
        if factor == 0.0 or info.tiny <= abs(factor) <= info.max or not math.isfinite(factor):
            out = gradient * factor
        else:
            out = xp.ldexp(gradient * mantissa, exponent)
    if data_checks(ns):
        check_gradient(xp, out, name, p)
    return out


def left_range_message(dtype_name: str) -> str:
    """The ValueError of a transport-cost gradient whose implicit solve itself came out
    non-finite: float32 at a small eps against the costs, where the system's eigenvalues
    (~``exp(-C / eps)``) have no finite inverse; not an overflow of the gradient."""
    return (f"the gradients of value='transport_cost' are not finite in {dtype_name} at these "
            f"inputs: their implicit system has eigenvalues ~exp(-C / eps) without a finite "
            f"inverse in {dtype_name} (eps small against the costs); use float64, or a larger "
            f"eps")


def _scaled_points(xp, *arrays):
    """``(scale, arrays / scale ...)``: the reference's power of two (``common_scale``) and the
    arrays divided by it (exact, :func:`_divided`)."""
    peak = max(xp.stack([xp.max(xp.abs(v)) for v in arrays]).tolist())   # one transfer on CuPy
    scale = float(common_scale(np.array(peak)))
    return (scale, *(_divided(xp, v, scale) for v in arrays))


def _sq_and_unit(p: float, scale: float, names: str, *sqs):
    """``(unit, sq_unit, sq ...)``: the squared distances divided by the reference's
    ``sq_unit`` (:func:`refdml._shared.ot.normalised_sq`) and the costs' unit."""
    sq_unit, *normalised = normalised_sq(p, *sqs)
    return (cost_unit(scale, p, names, sq_unit), sq_unit, *normalised)


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


def _ot_vjp(xp, batch: OTBatch, value: str, d_value):
    """Gradients of ``sum_p d_value[p] OT_p`` w.r.t. the cost and the simplex weights."""
    if value == "regularized":
        d_cost, da, db = batch.plan, batch.f, batch.g
    else:
        d_cost, da, db = _transport_cost_vjp(xp, batch)
    da, db = centred(xp, da, batch.a), centred(xp, db, batch.b)
    scale = batch.unit * d_value[:, None]
    return d_cost * d_value[:, None, None], da * scale, db * scale


def _transport_cost_vjp(xp, batch: OTBatch):
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
    # Eigenvalues below the dtype's normal range (float32 at eps ~ C / 100: couplings of
    # e^-94) have no finite inverse: the products come out inf/NaN, and the callers'
    # finiteness checks name it (ValueError) rather than a warning here.
    with get_backend(plan).errstate(over="ignore", invalid="ignore"):
        inv = xp.where(keep, 1.0 / xp.where(keep, eigval, 1.0), 0.0).astype(plan.dtype)
        coeff = (xp.swapaxes(eigvec, 1, 2) @ rhs[:, :, None])[:, :, 0]
        z = (eigvec @ (inv * coeff)[:, :, None])[:, :, 0]
    w = (u - (plan @ z[:, :, None])[:, :, 0]) / a
    d_cost = plan * (1.0 + (w[:, :, None] + z[:, None, :] - cost) * (1.0 / eps))
    return d_cost, w, z
