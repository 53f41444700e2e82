r"""The array path of :mod:`refdml.gpu.gsp`: the GSP layer written once against the backend.

Private module. :class:`ArrayPath` is the family's interface (one method per operation,
documented on the class); :class:`~refdml.gpu.gsp._kernels.CpuPath` and
:class:`~refdml.gpu.gsp._kernels.CudaPath` implement the same interface with the compiled
kernels, and :data:`refdml.gpu.gsp.IMPLEMENTATIONS` chooses one per call. The array path
runs on NumPy and CuPy alike (the backend of :mod:`refdml._backend`), in the input's dtype;
it is what the kernels are checked against. Here: the cost map (clipped points, the Gram
identity refined near a prototype, the common power of two) and its backward, the pooling
layer's (P2) solve (:func:`_pool_transport`: float32 at small ``mu`` in float64) and its
backward (:func:`_distance_weights_of_pool`, and the float64 rescaling of
:func:`pool_backward_rescaled`); (P2) itself, the batched Newton solve and Prop. 4.3, is
:mod:`refdml.gpu.gsp._transport`. The maths and its derivations are the reference's
(:mod:`refdml.gsp`, docs/gsp.md); the package's docstring says what differs and why.

Layout: ``(B, m, n)`` arrays (cost, pi, assignment) live as ``(B, n, m)`` in memory
(``cost_t``, ``weights_t``) and are handed out as transposed views.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._backend import Backend, get_backend
from refdml._shared.normalize import clip_backward_xp
from refdml._shared.gsp import exponent_of, pool_gradient_overflow, upstream_exponent, \
    weight_gradient_shift
from refdml.gpu.gsp import _transport as _wt
from refdml.gpu.gsp._transport import TransportArgs
from refdml.gsp import (
    CostMapContext,
    CostMapGrads,
    PoolContext,
    PoolGrads,
    WeightTransportResult,
)

__all__ = ["ArrayPath", "PoolForward", "SMALL_MU", "TransportArgs", "cost_map_backward",
           "cost_map_forward", "distance_weights", "gemean_upstream", "normalised",
           "pool_backward_rescaled", "prototypes_backward"]


@dataclass(frozen=True, kw_only=True)
class PoolForward:
    """What the pooling layer's forward returns from any member of the family
    (:meth:`ArrayPath.pool_forward`): ``cost`` the cost map's context (``cost.cost``
    (B, m, n) a transposed view of a (B, n, m) array), ``transport`` the (P2) result,
    ``weights`` (B, n) ``w = sigma / mu``, ``pooled`` (B, d) at ``p = 1`` (None for GeMean,
    which the caller forms from the weights), ``z`` (B, m)."""

    cost: CostMapContext
    transport: WeightTransportResult
    weights: Any
    pooled: Any | None
    z: Any


# Squared distances below this fraction of |x|^2 + |y|^2 are recomputed from differences:
# the Gram identity's relative error on c is then <= ~u / fraction (u = unit roundoff).
_REFINE = {np.dtype(np.float32): 0.1, np.dtype(np.float64): 1e-3}


# Below this mu the pooling layer takes the array path (refdml.gpu.gsp._mirrors chooses),
# and float32 solves (P2) in float64
# (:func:`_pool_transport`): sigma_j ~ mu and pi_ij ~ mu / (n m) would reach float32's
# subnormals (2^-126), where sigma / mu (the weights) and sum_j pi_ij / mu (z) lose digits
# (an absolute error 2^-150 / mu: <= 2^-50 here) and 1 / mu overflows (below 2^-128).
# The float64 bound keeps the compiled kernels' z (from pi) as accurate: m 2^-1075 / mu.
SMALL_MU = {np.dtype(np.float32): 2.0**-100, np.dtype(np.float64): 2.0**-900}


# --------------------------------------------------------------------------- cost map
def _row_norm(xp, u, name: str = "u"):
    """``||u||`` over the last axis (keepdims), without overflow or underflow of squares.

    The plain sum of squares (one pass) is exact enough wherever it lies in
    ``[2**-100, max/4]`` of the dtype (float64: ``[2**-900, max/4]``); the rows outside
    (tiny or huge entries; found with one ``nonzero``) are recomputed divided by a power
    of two near their largest magnitude (exact). A norm beyond the dtype (float32 rows of
    entries near 3.4e38) is a ``ValueError`` naming ``name``: the clipped point and the
    context's norm could not be formed.
    """
    squares = xp.einsum("...d,...d->...", u, u)
    info = np.finfo(u.dtype)
    low = 2.0 ** (-100 if info.bits == 32 else -900)
    bad = xp.nonzero(~((squares >= low) & (squares <= info.max / 4)))
    norm = xp.sqrt(squares)
    if bad[0].size:
        rows = u[bad]
        peak = xp.max(xp.abs(rows), axis=-1, keepdims=True)
        # Capped at the top binade (2^128 is no float32): the ratio is then below 2.
        exponent = xp.minimum(xp.frexp(peak)[1], info.maxexp - 1)
        scale = xp.where(peak > 0, xp.ldexp(xp.ones_like(peak), exponent), 1)
        scaled = rows / scale
        scaled_norm = xp.sqrt(xp.einsum("kd,kd->k", scaled, scaled))
        with np.errstate(over="ignore"):
            fixed = scaled_norm * scale[:, 0]
        if not bool(xp.all(xp.isfinite(fixed))):   # this branch has synchronised already
            k = int(xp.argmax(~xp.isfinite(fixed)))
            where = tuple(int(i[k]) for i in bad)
            where = where[0] if len(where) == 1 else where
            raise ValueError(
                f"{name}[{where}] has norm {float(scaled_norm[k]) * float(scale[k, 0]):.3g}, "
                f"beyond {np.dtype(u.dtype).name}'s range ({float(info.max):.3g}): rescale "
                f"{name} or use float64"
            )
        norm[bad] = fixed
    return norm[..., None]


def normalised(backend: Backend, features, prototypes):
    """The clipped points, their norms and the common power of two ``s`` (0-d array):
    ``(features_bar, features_norm, prototypes_bar, prototypes_norm, scale)``, the fields
    of the cost map's context but the cost (both members of the family start from them)."""
    xp = backend.xp
    features_norm = _row_norm(xp, features, "features")         # (B, n, 1)
    prototypes_norm = _row_norm(xp, prototypes, "prototypes")   # (m, 1)
    # A division, not a product with 1 / max(||f||, 1): that reciprocal is a float32
    # subnormal for ||f|| > 2^126, and CuPy compiles every kernel with -ftz=true (float32
    # subnormals read and stored as 0), which made fbar = 0 on a GPU (docs/gpu/hardware-failures.md,
    # "The six hardware-only failures").
    features_bar = features / xp.maximum(features_norm, 1.0)
    prototypes_bar = prototypes / xp.maximum(prototypes_norm, 1.0)
    f_len = xp.minimum(features_norm, 1.0)[:, :, 0]             # ||fbar|| (B, n)
    w_len = xp.minimum(prototypes_norm, 1.0)[:, 0]              # ||wbar|| (m,)
    # One power of two s with max ||bar|| / s in (0.5, 1] (s = 1 for ordinary input): the
    # squares of the scaled points neither overflow nor underflow.
    # (fbar / s) . (wbar / s) = fbar . (wbar / s / s).
    peak = xp.maximum(xp.max(f_len), xp.max(w_len))
    tiny = np.finfo(features.dtype).tiny
    if backend.data_checks and float(peak) < tiny:
        # The Gram factor wbar / s^2 and the backward's r / s hold 1 / s, which overflows
        # for a subnormal s (one synchronisation on CuPy, with the data checks).
        raise ValueError(
            f"features and prototypes: their largest norm is {float(peak):.3g}, below "
            f"{np.dtype(features.dtype).name}'s normal range ({tiny:.3g}), where the fast "
            "path's cost map cannot scale them; rescale both (below norm 1 the cost is "
            "homogeneous of degree 1) or use refdml.gsp"
        )
    # peak = 0 (every point 0) gives frexp's (0, 0): s = 2^0 = 1, with no select.
    mantissa, exponent = xp.frexp(peak)
    exponent = exponent - (mantissa == 0.5)
    scale = xp.ldexp(xp.ones_like(peak), exponent)
    return features_bar, features_norm, prototypes_bar, prototypes_norm, scale


def cost_map_forward(backend: Backend, features, prototypes):
    """Cost ``(B, n, m)`` in memory and the reference's ``CostMapContext`` (cost as a view)."""
    xp = backend.xp
    batch, n, d = features.shape
    m = prototypes.shape[0]
    dtype = features.dtype
    features_bar, features_norm, prototypes_bar, prototypes_norm, scale = normalised(
        backend, features, prototypes
    )
    f_len = xp.minimum(features_norm, 1.0)[:, :, 0]
    w_len = xp.minimum(prototypes_norm, 1.0)[:, 0]
    f_sq = (f_len / scale) ** 2
    w_sq = (w_len / scale) ** 2
    gram = (prototypes_bar * (-2.0 / scale) / scale).T
    # Pairs to refine: a superset of sq < r (|x|^2 + |y|^2) (every negative sq among them).
    threshold = _REFINE[np.dtype(dtype)] * (f_sq + xp.max(w_sq))
    unit_scale = backend.known_equal(scale, 1.0)   # a pass saved where the test is free
    cost_t = xp.empty((batch, n, m), dtype=dtype)

    def images(part):
        """The cost of the images ``part``, into ``cost_t[part]``: each image's is its own."""
        sq = cost_t[part]
        xp.matmul(features_bar[part].reshape(-1, d), gram, out=sq.reshape(-1, m))
        sq += f_sq[part][:, :, None]
        sq += w_sq
        # The pairs to refine, row by row: one compare pass, then nonzero on (b, n), (K, m).
        small = sq < threshold[part][:, :, None]
        b, j = xp.nonzero(xp.any(small, axis=2))
        if b.size:
            k, i = xp.nonzero(small[b, j])
            b, j = b[k], j[k]
            diff = (features_bar[part][b, j] - prototypes_bar[i]) / scale
            sq[b, j, i] = xp.einsum("kd,kd->k", diff, diff)
        xp.sqrt(sq, out=sq)  # >= 0: every sq below the threshold was recomputed
        if not unit_scale:
            sq *= scale

    backend.halves(images, batch)
    ctx = CostMapContext(
        features_bar=features_bar, features_norm=features_norm,
        prototypes_bar=prototypes_bar, prototypes_norm=prototypes_norm,
        cost=cost_t.transpose(0, 2, 1), scale=scale,
    )
    return cost_t, ctx


def distance_weights(xp, ctx: CostMapContext, d_cost_t):
    """``d_cost / c'`` in place (``c' = c / scale``; 0 where ``c = 0``, the subgradient)."""
    cost_t = ctx.cost.transpose(0, 2, 1)
    d_cost_t *= ctx.scale
    d_cost_t /= xp.where(cost_t > 0, cost_t, np.inf)
    return d_cost_t


def cost_map_backward(xp, ctx: CostMapContext, weights_t, d_features_extra=None) -> CostMapGrads:
    """From ``W = d_cost / c'`` (B, n, m), contiguous: the gradients of the raw points.

    ``d ybar_j = r_j y_j - (W x)_j`` (``r_j = sum_i W_ij``) and ``d xbar_i = (sum_j W_ij)
    x_i - sum_j W_ij y_j`` (summed over the batch), ``x = wbar / s``, ``y = fbar / s``:
    two matrix products. The features' clip backward is fused into them: with
    ``k = 1 / max(||f||, 1)`` and ``radial = fbar . d ybar = r ||fbar||^2 / s - fbar . (W x)``,
    ``d f = k (W x) * (-1) + fbar (k r / s - [||f|| > 1] k radial) (+ extra)``: the
    (B, n, d) arrays are touched in four passes. (The prototypes, (m, d), take the one clip
    backward, :func:`refdml._shared.normalize.clip_backward_xp`; for the features it would
    cost three more passes over (B, n, d), the largest arrays of the layer.)
    """
    batch, n, m = weights_t.shape
    d = ctx.features_bar.shape[2]
    scale = ctx.scale
    flat = weights_t.reshape(batch * n, m)
    # Reads W and the context only: beside the features' gradient (Backend.alongside).
    d_prototypes = get_backend(flat).alongside(prototypes_backward, xp, ctx, flat)
    features_bar = ctx.features_bar
    # -(W x) with x = wbar / s, as one (B n, m) x (m, d) product.
    d_features = (flat @ (ctx.prototypes_bar * (-1.0 / scale))).reshape(batch, n, d)
    row = xp.sum(weights_t, axis=2) / scale                            # r / s (B, n)
    norm = ctx.features_norm[:, :, 0]
    inverse = 1.0 / xp.maximum(norm, 1.0)
    bar_sq = xp.minimum(norm, 1.0) ** 2                                # ||fbar||^2
    radial = row * bar_sq + xp.einsum("bnd,bnd->bn", features_bar, d_features)
    coefficient = inverse * (row - xp.where(norm > 1.0, radial, 0))
    d_features *= inverse[:, :, None]
    d_features += features_bar * coefficient[:, :, None]
    if d_features_extra is not None:
        d_features += d_features_extra
    return CostMapGrads(features=d_features, prototypes=d_prototypes.result())


def prototypes_backward(xp, ctx: CostMapContext, flat):
    """``d prototypes`` from ``W`` (B n, m): ``d xbar_i = ((sum_j W_ij) xbar_i - (W^T fbar)_i) / s``
    (one matrix product summing over the whole batch), then the clip backward."""
    batch, n, d = ctx.features_bar.shape
    d_prototypes_bar = (
        ctx.prototypes_bar * xp.sum(flat, axis=0)[:, None]
        - flat.T @ ctx.features_bar.reshape(batch * n, d)
    ) / ctx.scale
    return clip_backward_xp(xp, ctx.prototypes_bar, d_prototypes_bar,
                            ctx.prototypes_norm > 1.0, ctx.prototypes_norm)


# --------------------------------------------------------------------------- pooling
def _pool_transport(backend: Backend, cost_t, args: TransportArgs):
    """(P2) on the cost ``(B, n, m)`` in memory and the weights ``w = sigma / mu`` (B, n).

    float32 with ``mu < SMALL_MU``: sigma ~ mu would underflow, so (P2) is solved in
    float64 (a positive ``tol`` still raised to float32's floor) and the result cast back:
    ``pi``, ``sigma`` round to float32 (to 0 below its range, as they should); ``w`` is
    taken before the cast, O(1) at any normal mu (``refdml.gsp``'s ``check_pool_mu``).
    """
    dtype, mu = cost_t.dtype, args.mu
    if dtype == np.float64 or mu >= SMALL_MU[np.dtype(dtype)]:
        result = _wt.transport(backend, cost_t, args, bounded=True)
        return result, result.transported * (1.0 / mu)
    if args.tol > 0.0:
        args = dataclasses.replace(args, tol=max(args.tol, _wt.residual_floor(
            dtype, cost_t.shape[2], cost_t.shape[1])))
    wide = _wt.transport(backend, cost_t.astype(np.float64), args, bounded=True)
    weights = (wide.transported * (1.0 / mu)).astype(dtype)
    with np.errstate(over="ignore", under="ignore"):  # t, tau: inf beyond float32, as documented
        narrow = {
            name: getattr(wide, name).astype(dtype)  # order "K": pi stays a transposed view
            for name in ("rho", "pi", "t", "log_t", "residual", "transported", "log_s",
                         "assignment")
        }
    return dataclasses.replace(wide, **narrow), weights


def gemean_upstream(xp, ctx: PoolContext, d_pooled, d_y):
    """``(d_weights (B, n), direct (B, n, d))``: the upstream of the weights and the direct
    path to the features, from GeMean's ``d_y`` or (``d_y`` None, p = 1) from ``d_pooled``."""
    features, weights = ctx.features, ctx.weights
    if d_y is None:
        upstream = d_pooled * (1.0 / features.shape[1])                  # (B, d)
        return ((features @ upstream[:, :, None])[:, :, 0],
                weights[:, :, None] * upstream[:, None, :])
    return xp.einsum("bnd,bnd->bn", d_y, features), d_y * weights[:, :, None]


def _distance_weights_of_pool(xp, ctx: PoolContext, d_weights, d_z, check: bool):
    """``W = d_cost / c'`` (B, n, m) of the layer's (P2) for the weights' gradient
    ``d_weights`` (B, n) and ``d_z`` (B, m); ``check``: ``W``'s overflow check.

    Prop. 4.3 with d_pi_ij = d_z_i / mu (never broadcast to memory) and d_rho = -(n / mu)
    d_w, as the reference evaluates it: d_cost = -ε A (P (d_pi - a) + w (b - bbar))
    (docs/gsp.md Sec. 3). Both terms are linear in (d_pi, d_rho) and in sigma, so the
    1 / mu moves onto sigma: sigma d_pi = w d_z, and the marginal term is that of
    (d_z, -n d_w) with w = sigma / mu in place of sigma. No 1 / mu is formed (it
    overflows float32 below mu = 2^-128), only the O(1) weights.
    """
    result, weights, n = ctx.transport, ctx.weights, ctx.features.shape[1]
    assignment_t = result.assignment.transpose(0, 2, 1)
    cost_t = ctx.cost.cost.transpose(0, 2, 1)
    backend = get_backend(assignment_t)
    unit_scale = backend.known_equal(ctx.cost.scale, 1.0)
    weights_t = xp.empty(assignment_t.shape, dtype=assignment_t.dtype)

    def images(part):
        """``W`` of the images ``part``, into ``weights_t[part]``: each image's is its own."""
        w_t, a_t = weights_t[part], assignment_t[part]
        _, column = _wt.softmax_centred_rows(xp, a_t, d_z[part], out=w_t)
        w_t *= (weights[part] * (1.0 / n))[:, :, None]
        w_t += _wt.marginal_factors(xp, result.rho[part], weights[part], d_weights[part] * (-n),
                                    column)[:, :, None]
        w_t *= a_t
        # W = d_cost_t / c' = d_cost_t s / c: 0 where c = 0 (the subgradient).
        if not unit_scale:
            w_t *= ctx.cost.scale
        _wt.scale_gradient(xp, w_t, -result.inverse_temperature, check=check)
        c_t = cost_t[part]
        with np.errstate(divide="ignore", invalid="ignore"):
            xp.divide(w_t, c_t, out=w_t)
        xp.copyto(w_t, 0, where=~(c_t > 0))   # c = 0 (and a NaN cost): 0

    backend.halves(images, weights_t.shape[0])
    return weights_t


def pool_backward_rescaled(xp, ctx: PoolContext, d_pooled, d_z, d_y) -> PoolGrads:
    """float64 where the backward's intermediates overflowed (features beyond ~1e300): the
    reference's rescaling (:func:`refdml.gsp._pool._transport_backward`). The direct path
    as it is; the weights' gradient on ``f / 2^shift``, the (linear) rest on the upstream
    ``(d_weights, d_z)`` divided by ``2^(shift + k)``, its result multiplied back by
    ``ldexp``. The array path; synchronises (the exponents)."""
    features, weights, n = ctx.features, ctx.weights, ctx.features.shape[1]
    d_y = xp.broadcast_to((d_pooled * (1.0 / n))[:, None, :], features.shape) if d_y is None \
        else d_y
    direct = d_y * weights[:, :, None]
    shift = weight_gradient_shift(features)
    d_weights = xp.einsum("bnd,bnd->bn", d_y, xp.ldexp(features, -shift))
    d_z = xp.ldexp(d_z, -shift)
    k = upstream_exponent(d_weights, d_z, n)
    weights_t = _distance_weights_of_pool(xp, ctx, xp.ldexp(d_weights, -k), xp.ldexp(d_z, -k),
                                          check=True)
    through = cost_map_backward(xp, ctx.cost, weights_t)
    with np.errstate(over="ignore", invalid="ignore"):
        grads = PoolGrads(features=xp.ldexp(through.features, k + shift) + direct,
                          prototypes=xp.ldexp(through.prototypes, k + shift))
    for name in ("features", "prototypes"):
        if not bool(xp.all(xp.isfinite(getattr(grads, name)))):
            raise ValueError(pool_gradient_overflow(
                name, exponent_of(d_weights) + shift, ctx.transport.inverse_temperature))
    return grads


# --------------------------------------------------------------------------- the interface
class ArrayPath:
    """The array path: the code of this module and of :mod:`refdml.gpu.gsp._transport`,
    written once against the backend (what the kernels are checked against).

    The family's interface, which :class:`~refdml.gpu.gsp._kernels.CpuPath` and
    :class:`~refdml.gpu.gsp._kernels.CudaPath` implement too: one method per operation,
    each given the inputs' :class:`~refdml._backend.Backend` and validated arguments
    (``args``: (P2)'s :class:`~refdml.gpu.gsp._transport.TransportArgs`); (B, m, n) arrays
    are passed and returned in their (B, n, m) memory layout where the name ends in ``_t``.

    ``transport(backend, cost_t, args)``
        (P2) for every image from the cost; a :class:`~refdml.gsp.WeightTransportResult`.
    ``transport_backward(backend, result, d_rho, d_pi)``
        Prop. 4.3's ``d_cost`` (B, m, n) for the upstream ``d_rho`` (B, n), ``d_pi`` (B, m, n).
    ``pool_forward(backend, features, prototypes, args, *, p_one)``
        The layer's cost map, (P2), weights, ``z`` and (``p_one``: ``p = 1``) pooled
        feature: a :class:`PoolForward`.
    ``pool_backward(backend, ctx, d_pooled, d_z, d_y, *, check)``
        The layer's :class:`~refdml.gsp.PoolGrads` from its :class:`~refdml.gsp.PoolContext`;
        ``d_y``: GeMean's gradient of ``w f`` (None at ``p = 1``, formed from ``d_pooled``);
        ``check``: ``W = d_cost / c'``'s overflow check (off where the caller tests the
        gradients itself).
    """

    def __repr__(self) -> str:
        return "ArrayPath()"

    def transport(self, backend: Backend, cost_t, args: TransportArgs) -> WeightTransportResult:
        return _wt.transport(backend, cost_t, args)

    def transport_backward(self, backend: Backend, result: WeightTransportResult, d_rho, d_pi):
        return _wt.closed_form_backward(backend.xp, result, d_rho, d_pi)

    def pool_forward(self, backend: Backend, features, prototypes, args: TransportArgs, *,
                     p_one: bool) -> PoolForward:
        cost_t, cost_ctx = cost_map_forward(backend, features, prototypes)
        result, weights = _pool_transport(backend, cost_t, args)
        n = features.shape[1]
        pooled = None
        if p_one:
            # (w / n) sums to 1: a convex combination, never beyond the largest feature
            # (the sum w . f of float32 features near 3.4e38 overflowed before / n).
            pooled = ((weights * (1.0 / n))[:, None, :] @ features)[:, 0, :]
        # z_i = (1/mu) sum_j pi_ij = (1/n) sum_j A_ij w_j: from the weights, never from pi,
        # which underflows for small mu.
        z = (weights[:, None, :] @ result.assignment.transpose(0, 2, 1))[:, 0, :] * (1.0 / n)
        return PoolForward(cost=cost_ctx, transport=result, weights=weights, pooled=pooled, z=z)

    def pool_backward(self, backend: Backend, ctx: PoolContext, d_pooled, d_z, d_y, *,
                      check: bool) -> PoolGrads:
        xp = backend.xp
        d_weights, direct = gemean_upstream(xp, ctx, d_pooled, d_y)
        weights_t = _distance_weights_of_pool(xp, ctx, d_weights, d_z, check)
        return PoolGrads(**vars(cost_map_backward(xp, ctx.cost, weights_t, direct)))
