r"""GSP on the fast path: cost map, (P2) weight transport and the pooling layer (GeMean too).

The mirror of :mod:`refdml.gsp` (same names, signatures, result and context types,
which are the reference's dataclasses holding arrays of the input's module), written
once against the input's array module (NumPy or CuPy), in the input's dtype (float32
or float64), batched over images with no Python loop over them. The maths, with its
derivations, is the reference's (docs/gsp.md); read that first.

Shapes: features ``(B, n, d)``, prototypes ``(m, d)``, cost / pi ``(B, m, n)``, rho
``(B, n)``, pooled ``(B, d)``, z ``(B, m)``. ``inverse_temperature`` is the paper's ε
(varepsilon), multiplying the cost (``exp(-ε c)``; GSP's defaults 0.5 with proxy
losses, 5.0 with pair losses).

What differs from the reference (and why)
------------------------------------------
* ``(B, m, n)`` arrays live as ``(B, n, m)`` in memory and are returned as transposed
  views: the cost map is one ``(B n, d) x (d, m)`` product, the backward two more, and
  every reduction over prototypes runs along the contiguous axis.
* Only ``method="exact"`` (the batched solver of :mod:`refdml.gpu.gsp._transport`) and
  ``backward="closed_form"`` (Prop. 4.3). ``method="fixed_point"`` and
  ``backward="unrolled"`` check the paper's Alg. 3 and are validation only: a
  ``ValueError`` says so (use :mod:`refdml.gsp`). So is (P1).
* float32: a positive ``tol`` below the dtype's residual floor is raised to it (see
  :func:`refdml.gpu.gsp._transport.residual_floor`, ~7.5e-6 for float32 at m n = 3136).
* Small ``mu``: the pooling layer's ``w = sigma / mu`` and ``z`` are O(1) at any mu, but
  ``sigma ~ mu`` is not a float32 below ~1e-38. Below ``_SMALL_MU`` (float32 2^-100) the
  layer takes the array path and float32 solves (P2) in float64, ``z`` is formed from
  ``w`` and the backward never forms ``1 / mu``; so every mu in ``[2.2e-308, 1]`` (a
  normal float64) is computed in both dtypes, and a subnormal mu is a ``ValueError``.
* float32 features near its largest number (1e37-1e38): the pooling backward's
  ``d_w ~ |f| |d_pooled|`` and ``W = d_cost / c'`` can leave float32 where the gradients do
  not; such a backward is redone in float64 on the widened context and cast back
  (:func:`refdml._validation.cast_checked` names a gradient truly beyond float32).
  GeMean is the reference's own ``power_mean`` and its backward (:mod:`refdml._shared.gsp`).
* Cost map: the Gram identity is refined from explicit differences where the squared
  distance is below ``_REFINE[dtype]`` of ``|x|^2 + |y|^2`` (so a float32 cost keeps
  ~1e-6 relative accuracy next to a prototype); ``CostMapContext.scale`` is a 0-d array
  of the input's module (the common power of two of the clipped points), not a float,
  so that it never leaves the device.

Implementations: :data:`GSP` (an :class:`~refdml.gpu._support.modes.Implementations`)
holds the array path written here and in :mod:`refdml.gpu.gsp._transport`, the compiled CPU
twins and the CUDA kernels (:mod:`refdml.gpu.gsp._compiled`, launched by
:mod:`refdml.gpu.gsp._launch`), all behind one interface (``transport``,
``transport_backward``, ``pool_forward``, ``pool_backward``: :class:`_ArrayPath`). Each
public function asks :func:`_path` once and reads straight through. Under
:func:`refdml.gpu.use_kernels`'s ``"auto"`` NumPy input keeps the array path (the CPU twins
measured no faster: ``GSP.measured``) and CuPy input runs the CUDA kernels; ``mu = 1`` and
small ``mu`` have the array path only. The array path stays the kernels' parity twin. The
choice sits beside the array path and the small-mu and extreme-magnitude handling (the
float32 and float64 retries of the pooling backward), so one module reads as one operator.

Synchronisation on CuPy (the results that must reach Python, and the checks): the
input checks (finiteness, GeMean's sign, the points' largest norm against the dtype's
normal range, GeMean's result within the dtype, the pooling backward's finiteness (the
float32 / float64 retries); switched off by
:func:`refdml.gpu.set_finite_checks`), the rows whose squared norm leaves the
plain range (one ``nonzero`` for the features, one for the prototypes: :func:`_row_norm`),
the refinement of the cost map (one ``nonzero``, two when a pair is refined; array path),
the solver's "every image converged?" test once per few sweeps and
``WeightTransportResult.converged`` (a Python bool, like the reference's) on the array
path; on the kernels, ``n_iter`` and ``converged`` in one read.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from refdml.gpu._support.modes import Implementations
from refdml._shared.gsp import (
    check_pool_mu,
    check_transport_args,
    exponent_of,
    pool_gradient_overflow,
    power_mean,
    power_mean_backward,
    upstream_exponent,
    weight_gradient_shift,
)
from refdml._validation import (
    as_fast_array, cast_checked, check_choice, check_context, check_scalar, result_dtype,
)
from refdml._backend import get_backend
from refdml.gpu.gsp import _launch as _gsp_kernels
from refdml.gpu.gsp import _transport as _wt
from refdml.gsp import (
    CostMapContext,
    CostMapGrads,
    PoolContext,
    PoolGrads,
    WeightTransportGrads,
    WeightTransportResult,
)

__all__ = [
    "CostMapContext",
    "CostMapGrads",
    "PoolContext",
    "PoolGrads",
    "WeightTransportGrads",
    "WeightTransportResult",
    "cost_map",
    "cost_map_backward",
    "cost_map_forward",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
    "residual_floor",
    "weight_transport",
    "weight_transport_backward",
]

residual_floor = _wt.residual_floor


@functools.cache
def _threadpools():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()  # scans the loaded BLAS libraries once (a few ms)


def _one_blas_thread(fn):
    """Run ``fn`` with host BLAS limited to one thread (no effect on cuBLAS).

    Why: the GEMMs here are small ((B n, d) x (d, m)); with the user's default BLAS threads on
    a busy machine, OpenBLAS's spinning worker threads slow the pooling layer's forward +
    backward down badly (both paths; docs/gpu.md). On an idle machine one thread costs at
    most the GEMMs' share of parallel speed-up.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _threadpools().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)
    return wrapper


# Squared distances below this fraction of |x|^2 + |y|^2 are recomputed from differences:
# the Gram identity's relative error on c is then <= ~u / fraction (u = unit roundoff).
_REFINE = {np.dtype(np.float32): 0.1, np.dtype(np.float64): 1e-3}
_VALIDATION_ONLY = "is validation only and has no fast path; use refdml.gsp"
# Below this mu the pooling layer takes the array path, and float32 solves (P2) in float64
# (:func:`_pool_transport`): sigma_j ~ mu and pi_ij ~ mu / (n m) would reach float32's
# subnormals (2^-126), where sigma / mu (the weights) and sum_j pi_ij / mu (z) lose digits
# (an absolute error 2^-150 / mu: <= 2^-50 here) and 1 / mu overflows (below 2^-128).
# The float64 bound keeps the compiled kernels' z (from pi) as accurate: m 2^-1075 / mu.
_SMALL_MU = {np.dtype(np.float32): 2.0**-100, np.dtype(np.float64): 2.0**-900}


# --------------------------------------------------------------------------- checks
def _checks_data(ns) -> bool:
    return ns.data_checks


def _features_prototypes(features, prototypes):
    ns = get_backend(features, prototypes)
    # The common dtype from the inputs' own (host data as NumPy makes it), so that each
    # input is converted and checked once: a finiteness check is a synchronisation on CuPy.
    dtype = result_dtype(*(value if hasattr(value, "dtype") else np.asarray(value)
                           for value in (features, prototypes)))
    features = as_fast_array(features, "features", ndim=3, dtype=dtype, ns=ns)
    prototypes = as_fast_array(prototypes, "prototypes", ndim=2, dtype=dtype, ns=ns)
    if features.shape[2] != prototypes.shape[1]:
        raise ValueError(
            "features and prototypes must have the same last dimension, got "
            f"features.shape={tuple(features.shape)}, prototypes.shape={tuple(prototypes.shape)}"
        )
    return ns, features, prototypes


def _upstream(value, name: str, shape, like, *, allow_none: bool = True):
    """An upstream gradient: real, exactly ``shape``, finite, cast to ``like``'s dtype."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be an array of shape {tuple(shape)}, got None")
    ns = get_backend(value, like)
    array = as_fast_array(value, name, dtype=like.dtype, ns=ns)
    if tuple(array.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(array.shape)}, must be {tuple(shape)} (the shape of the "
            "forward's output; it is not broadcast)"
        )
    return array


def _method_backward(method: str, backward: str = "closed_form") -> None:
    if method != "exact":
        raise ValueError(f"method == {method!r} {_VALIDATION_ONLY}; the fast path has 'exact'")
    if backward != "closed_form":
        raise ValueError(
            f"backward == {backward!r} {_VALIDATION_ONLY}; the fast path has 'closed_form'"
        )


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


def _normalised(xp, features, prototypes):
    """The clipped points, their norms and the common power of two ``s`` (0-d array)."""
    features_norm = _row_norm(xp, features, "features")         # (B, n, 1)
    prototypes_norm = _row_norm(xp, prototypes, "prototypes")   # (m, 1)
    # A division, not a product with 1 / max(||f||, 1): that reciprocal is a float32
    # subnormal for ||f|| > 2^126, and CuPy compiles every kernel with -ftz=true (float32
    # subnormals read and stored as 0), which made fbar = 0 on a GPU (docs/gpu.md, "The
    # six hardware-only failures").
    features_bar = features / xp.maximum(features_norm, 1.0)
    prototypes_bar = prototypes / xp.maximum(prototypes_norm, 1.0)
    f_len = xp.minimum(features_norm, 1.0)[:, :, 0]             # ||fbar|| (B, n)
    w_len = xp.minimum(prototypes_norm, 1.0)[:, 0]              # ||wbar|| (m,)
    # One power of two s with max ||bar|| / s in (0.5, 1] (s = 1 for ordinary input): the
    # squares of the scaled points neither overflow nor underflow.
    # (fbar / s) . (wbar / s) = fbar . (wbar / s / s).
    peak = xp.maximum(xp.max(f_len), xp.max(w_len))
    tiny = np.finfo(features.dtype).tiny
    if get_backend(peak).data_checks and float(peak) < tiny:
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


def _cost_map_forward(xp, features, prototypes):
    """Cost ``(B, n, m)`` in memory and the reference's ``CostMapContext`` (cost as a view)."""
    batch, n, d = features.shape
    m = prototypes.shape[0]
    dtype = features.dtype
    features_bar, features_norm, prototypes_bar, prototypes_norm, scale = _normalised(
        xp, features, prototypes
    )
    f_len = xp.minimum(features_norm, 1.0)[:, :, 0]
    w_len = xp.minimum(prototypes_norm, 1.0)[:, 0]
    f_sq = (f_len / scale) ** 2
    w_sq = (w_len / scale) ** 2
    sq = features_bar.reshape(batch * n, d) @ (prototypes_bar * (-2.0 / scale) / scale).T
    sq = sq.reshape(batch, n, m)
    sq += f_sq[:, :, None]
    sq += w_sq
    # Pairs to refine: a superset of sq < r (|x|^2 + |y|^2) (every negative sq among
    # them), found row by row: one compare pass, then nonzero on (B, n) and (K, m).
    small = sq < (_REFINE[np.dtype(dtype)] * (f_sq + xp.max(w_sq)))[:, :, None]
    b, j = xp.nonzero(xp.any(small, axis=2))
    if b.size:
        k, i = xp.nonzero(small[b, j])
        b, j = b[k], j[k]
        diff = (features_bar[b, j] - prototypes_bar[i]) / scale
        sq[b, j, i] = xp.einsum("kd,kd->k", diff, diff)
    cost_t = xp.sqrt(sq, out=sq)  # >= 0: every sq below the threshold was recomputed
    if xp is not np or float(scale) != 1.0:  # free on NumPy; a pass saved
        cost_t *= scale
    ctx = CostMapContext(
        features_bar=features_bar, features_norm=features_norm,
        prototypes_bar=prototypes_bar, prototypes_norm=prototypes_norm,
        cost=cost_t.transpose(0, 2, 1), scale=scale,
    )
    return cost_t, ctx


def _distance_weights(xp, ctx: CostMapContext, d_cost_t):
    """``d_cost / c'`` in place (``c' = c / scale``; 0 where ``c = 0``, the subgradient)."""
    cost_t = ctx.cost.transpose(0, 2, 1)
    d_cost_t *= ctx.scale
    d_cost_t /= xp.where(cost_t > 0, cost_t, np.inf)
    return d_cost_t


def _clip_backward(xp, u_bar, norm, d_bar, extra=None):
    """``d u`` from ``d ubar`` (identity inside the ball, projected outside); ``+ extra``."""
    outside = norm > 1.0
    inverse = 1.0 / xp.maximum(norm, 1.0)
    radial = xp.einsum("...d,...d->...", u_bar, d_bar)[..., None]
    d_u = d_bar * inverse
    d_u -= u_bar * xp.where(outside, radial * inverse, 0)
    if extra is not None:
        d_u += extra
    return d_u


def _cost_map_backward(xp, ctx: CostMapContext, weights_t, d_features_extra=None) -> CostMapGrads:
    """From ``W = d_cost / c'`` (B, n, m), contiguous: the gradients of the raw points.

    ``d ybar_j = r_j y_j - (W x)_j`` (``r_j = sum_i W_ij``) and ``d xbar_i = (sum_j W_ij)
    x_i - sum_j W_ij y_j`` (summed over the batch), ``x = wbar / s``, ``y = fbar / s``:
    two matrix products. The features' clip backward is fused into them: with
    ``k = 1 / max(||f||, 1)`` and ``radial = fbar . d ybar = r ||fbar||^2 / s - fbar . (W x)``,
    ``d f = k (W x) * (-1) + fbar (k r / s - [||f|| > 1] k radial) (+ extra)``: the
    (B, n, d) arrays are touched in four passes.
    """
    batch, n, m = weights_t.shape
    d = ctx.features_bar.shape[2]
    scale = ctx.scale
    flat = weights_t.reshape(batch * n, m)
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
    return CostMapGrads(features=d_features, prototypes=_prototypes_backward(xp, ctx, flat))


def _prototypes_backward(xp, ctx: CostMapContext, flat):
    """``d prototypes`` from ``W`` (B n, m): ``d xbar_i = ((sum_j W_ij) xbar_i - (W^T fbar)_i) / s``
    (one matrix product summing over the whole batch), then the clip backward."""
    batch, n, d = ctx.features_bar.shape
    d_prototypes_bar = (
        ctx.prototypes_bar * xp.sum(flat, axis=0)[:, None]
        - flat.T @ ctx.features_bar.reshape(batch * n, d)
    ) / ctx.scale
    return _clip_backward(xp, ctx.prototypes_bar, ctx.prototypes_norm, d_prototypes_bar)


@_one_blas_thread
def cost_map_forward(features, prototypes) -> tuple[Any, CostMapContext]:
    """GSP cost map ``c[b, i, j] = || wbar_i - fbar_{b,j} ||`` (Alg. 2); ``(cost, ctx)``.

    As :func:`refdml.gsp.cost_map_forward`; ``cost`` (B, m, n) is a transposed view of
    a ``(B, n, m)`` array, in the input's dtype and module.
    """
    ns, features, prototypes = _features_prototypes(features, prototypes)
    cost_t, ctx = _cost_map_forward(ns.xp, features, prototypes)
    return ctx.cost, ctx


@_one_blas_thread
def cost_map_backward(ctx: CostMapContext, d_cost) -> CostMapGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d); ``d_cost`` (B, m, n)."""
    check_context(ctx, "ctx", CostMapContext)
    d_cost = _upstream(d_cost, "d_cost", ctx.cost.shape, ctx.cost, allow_none=False)
    xp = get_backend(d_cost).xp
    weights_t = xp.array(d_cost.transpose(0, 2, 1), order="C", copy=True)  # scaled in place
    return _cost_map_backward(xp, ctx, _distance_weights(xp, ctx, weights_t))


def cost_map(features, prototypes):
    """The GSP cost map (no context kept)."""
    return cost_map_forward(features, prototypes)[0]


# --------------------------------------------------------------------------- (P2)
def weight_transport(
    cost, *, mu, inverse_temperature, method="exact", max_iter=100, tol=1e-12
) -> WeightTransportResult:
    """Solve (P2) for each image; as :func:`refdml.gsp.weight_transport` (``method="exact"``).

    ``cost`` (B, m, n) float32 or float64, NumPy or CuPy; the result's arrays are of
    that dtype and module (``pi``, ``assignment``: transposed views). ``n_iter`` counts
    the vectorised Newton sweeps of both phases (all images at once). A positive
    ``tol`` below :func:`residual_floor` of the dtype is raised to it (``result.tol``).
    """
    cost = as_fast_array(cost, "cost", ndim=3)
    mu, inverse_temperature, method, max_iter, tol = check_transport_args(
        mu, inverse_temperature, method, max_iter, tol
    )
    _method_backward(method)
    xp = get_backend(cost).xp
    return _path(cost, mu).transport(xp, cost.transpose(0, 2, 1), mu, inverse_temperature,
                                     max_iter, tol)


def weight_transport_backward(result: WeightTransportResult, d_rho, d_pi) -> WeightTransportGrads:
    """Prop. 4.3, closed form; as :func:`refdml.gsp.weight_transport_backward`.

    ``d_rho`` (B, n), ``d_pi`` (B, m, n), exactly those shapes; ``None`` means zero.
    """
    check_context(result, "result", WeightTransportResult)
    if result.method != "exact":
        raise ValueError(
            f"result.method == {result.method!r}: a fixed-point result {_VALIDATION_ONLY}"
        )
    d_rho = _upstream(d_rho, "d_rho", result.rho.shape, result.rho)
    d_pi = _upstream(d_pi, "d_pi", result.pi.shape, result.pi)
    xp = get_backend(result.pi).xp
    d_rho = xp.zeros_like(result.rho) if d_rho is None else d_rho
    d_pi = xp.zeros_like(result.pi) if d_pi is None else d_pi
    return WeightTransportGrads(
        cost=_path(result.pi, result.mu).transport_backward(xp, result, d_rho, d_pi))


# --------------------------------------------------------------------------- pooling
def _pool_transport(xp, cost_t, mu, inverse_temperature, max_iter, tol):
    """(P2) on the cost ``(B, n, m)`` in memory and the weights ``w = sigma / mu`` (B, n).

    float32 with ``mu < _SMALL_MU``: sigma ~ mu would underflow, so (P2) is solved in
    float64 (a positive ``tol`` still raised to float32's floor) and the result cast back:
    ``pi``, ``sigma`` round to float32 (to 0 below its range, as they should); ``w`` is
    taken before the cast, O(1) at any normal mu (``refdml.gsp``'s ``check_pool_mu``).
    """
    dtype = cost_t.dtype
    if dtype == np.float64 or mu >= _SMALL_MU[np.dtype(dtype)]:
        result = _wt.transport(xp, cost_t, mu, inverse_temperature, max_iter, tol)
        return result, result.transported * (1.0 / mu)
    if tol > 0.0:
        tol = max(tol, residual_floor(dtype, cost_t.shape[2], cost_t.shape[1]))
    wide = _wt.transport(xp, cost_t.astype(np.float64), mu, inverse_temperature, max_iter, tol)
    weights = (wide.transported * (1.0 / mu)).astype(dtype)
    with np.errstate(over="ignore", under="ignore"):  # t, tau: inf beyond float32, as documented
        narrow = {
            name: getattr(wide, name).astype(dtype)  # order "K": pi stays a transposed view
            for name in ("rho", "pi", "t", "log_t", "residual", "transported", "log_s",
                         "assignment")
        }
    return dataclasses.replace(wide, **narrow), weights


@_one_blas_thread
def gsp_pool_forward(
    features, prototypes, *, mu, inverse_temperature, p=1.0, method="exact", max_iter=100,
    tol=1e-12, backward="closed_form",
) -> tuple[tuple[Any, Any], PoolContext]:
    """GSP pooling layer (Alg. 2, Eqs. 4.1, 4.3): ``((pooled, z), ctx)``.

    As :func:`refdml.gsp.gsp_pool_forward` (``method="exact"``, ``backward="closed_form"``
    only; the others are validation only and raise ``ValueError``). Outputs in the
    input's dtype and module.
    """
    ns, features, prototypes = _features_prototypes(features, prototypes)
    xp = ns.xp
    mu, inverse_temperature, method, max_iter, tol = check_transport_args(
        mu, inverse_temperature, method, max_iter, tol
    )
    p = check_scalar(p, "p", low=1.0)
    backward = check_choice(backward, "backward", ("closed_form", "unrolled"))
    _method_backward(method, backward)
    check_pool_mu(mu)
    if p > 1.0 and _checks_data(ns) and bool(xp.any(features < 0)):
        bad = tuple(int(i) for i in xp.argwhere(features < 0)[0])
        raise ValueError(
            f"features[{bad}] == {features[bad]!r} is negative; p == {p!r} > 1 "
            "(GeMean) needs non-negative features"
        )
    cost_ctx, result, weights, pooled, z = _path(features, mu).pool_forward(
        xp, features, prototypes, mu, inverse_temperature, max_iter, tol, p == 1.0)
    power_ctx = None
    if p != 1.0:
        pooled, power_ctx = power_mean(xp, weights, features, p, _checks_data(ns))
    ctx = PoolContext(features, weights, pooled, p, backward, cost_ctx, result, power_ctx)
    return (pooled, z), ctx


@_one_blas_thread
def gsp_pool_backward(ctx: PoolContext, d_pooled, d_z) -> PoolGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d) of the pooling layer.

    ``d_pooled`` (B, d), ``d_z`` (B, m), exactly those shapes; ``None`` means zero.
    Fused: ``d_pi = d_z / mu`` is never broadcast to (B, m, n); the (B, n, m) array
    ``W = d_cost / c'`` is built in a few passes over the softmax ``A``.
    """
    check_context(ctx, "ctx", PoolContext)
    result = ctx.transport
    d_pooled = _upstream(d_pooled, "d_pooled", ctx.pooled.shape, ctx.pooled)
    d_z = _upstream(d_z, "d_z", result.pi.shape[:2], ctx.pooled)
    ns = get_backend(ctx.pooled)
    xp = ns.xp
    d_pooled = xp.zeros_like(ctx.pooled) if d_pooled is None else d_pooled
    d_z = xp.zeros(result.pi.shape[:2], dtype=ctx.pooled.dtype) if d_z is None else d_z
    # GeMean's d y = d pooled / d (w f) (bounded by |d_pooled|), from the forward's context.
    d_y = None if ctx.p == 1.0 else power_mean_backward(
        xp, ctx.weights, ctx.features, ctx.p, ctx.power_mean, d_pooled)
    path = _path(ctx.pooled, result.mu)
    if not _checks_data(ns):
        return path.pool_backward(xp, ctx, d_pooled, d_z, d_y, check=True)
    # d_weights ~ |f| |d_pooled| and W = d_cost / c' can leave the dtype where the gradients
    # do not (features near its largest number: their gradient through the normalised cost
    # map is O(ε |d_pooled|)). float32: such a backward is redone in float64 and cast back
    # (cast_checked names a gradient truly beyond float32); float64: redone on upstreams
    # divided by powers of two, as the reference (a gradient beyond float64 named). The
    # finiteness test is the synchronisation the overflow check of W made before.
    with np.errstate(over="ignore", invalid="ignore"):
        grads = path.pool_backward(xp, ctx, d_pooled, d_z, d_y, check=False)
    if bool(xp.all(xp.isfinite(grads.features)) & xp.all(xp.isfinite(grads.prototypes))):
        return grads
    if ctx.pooled.dtype == np.float64:
        return _pool_backward_rescaled(xp, ctx, d_pooled, d_z, d_y)
    wide = path.pool_backward(xp, _widened(ctx), d_pooled.astype(np.float64),
                              d_z.astype(np.float64),
                              None if d_y is None else d_y.astype(np.float64), check=True)
    return PoolGrads(
        features=cast_checked(wide.features, np.float32, "the gradient of features", ns),
        prototypes=cast_checked(wide.prototypes, np.float32, "the gradient of prototypes", ns),
    )


def _widened(value):
    """``value`` (a context dataclass, nested) with every float32 array as float64."""
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{
            field.name: _widened(getattr(value, field.name))
            for field in dataclasses.fields(value) if field.init
        })
    if hasattr(value, "dtype") and value.dtype == np.float32:
        return value.astype(np.float64)  # order "K": transposed views keep their layout
    return value


def _gemean_upstream(xp, ctx: PoolContext, d_pooled, d_y):
    """``(d_weights (B, n), direct (B, n, d))``: the upstream of the weights and the direct
    path to the features, from GeMean's ``d_y`` or (``d_y`` None, p = 1) from ``d_pooled``."""
    features, weights = ctx.features, ctx.weights
    if d_y is None:
        upstream = d_pooled * (1.0 / features.shape[1])                  # (B, d)
        return ((features @ upstream[:, :, None])[:, :, 0],
                weights[:, :, None] * upstream[:, None, :])
    return xp.einsum("bnd,bnd->bn", d_y, features), d_y * weights[:, :, None]


def _pool_backward_rescaled(xp, ctx: PoolContext, d_pooled, d_z, d_y) -> PoolGrads:
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
    through = _cost_map_backward(xp, ctx.cost, weights_t)
    with np.errstate(over="ignore", invalid="ignore"):
        grads = PoolGrads(features=xp.ldexp(through.features, k + shift) + direct,
                          prototypes=xp.ldexp(through.prototypes, k + shift))
    for name in ("features", "prototypes"):
        if not bool(xp.all(xp.isfinite(getattr(grads, name)))):
            raise ValueError(pool_gradient_overflow(
                name, exponent_of(d_weights) + shift, ctx.transport.inverse_temperature))
    return grads


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
    weights_t, column = _wt.softmax_centred(xp, assignment_t, d_z[:, None, :])
    weights_t *= (weights * (1.0 / n))[:, :, None]
    per_weight = dataclasses.replace(result, transported=weights)
    weights_t += _wt.marginal_factors(xp, per_weight, d_weights * (-n), column)[:, :, None]
    weights_t *= assignment_t
    # W = d_cost_t / c' = d_cost_t s / c: 0 where c = 0 (the subgradient).
    weights_t *= ctx.cost.scale
    _wt.scale_gradient(xp, weights_t, -result.inverse_temperature, check=check)
    cost_t = ctx.cost.cost.transpose(0, 2, 1)
    weights_t /= xp.where(cost_t > 0, cost_t, np.inf)
    return weights_t


# --------------------------------------------------------------------------- the seam
class _ArrayPath:
    """The array path: the code of this module and of :mod:`refdml.gpu.gsp._transport`,
    written once against NumPy/CuPy (what the kernels are checked against).

    The interface of :data:`GSP`'s members, one method per operation, each given the
    array namespace ``xp`` and validated arguments:
    ``transport(xp, cost_t, mu, inverse_temperature, max_iter, tol)`` (P2) from the cost
    (B, n, m) in memory; ``transport_backward(xp, result, d_rho, d_pi)`` Prop. 4.3's
    ``d_cost`` (B, m, n); ``pool_forward(xp, features, prototypes, mu, inverse_temperature,
    max_iter, tol, p_one)`` the layer's ``(cost context, result, weights, pooled (p = 1,
    else None), z)``; ``pool_backward(xp, ctx, d_pooled, d_z, d_y, check)`` its
    :class:`PoolGrads` (``d_y``: GeMean's, None at p = 1; ``check``: the overflow check of
    ``W``, off where the caller tests the gradients itself).
    """

    def __repr__(self) -> str:
        return "_ArrayPath()"

    def transport(self, xp, cost_t, mu, inverse_temperature, max_iter, tol):
        return _wt.transport(xp, cost_t, mu, inverse_temperature, max_iter, tol)

    def transport_backward(self, xp, result, d_rho, d_pi):
        return _wt.closed_form_backward(xp, result, d_rho, d_pi)

    def pool_forward(self, xp, features, prototypes, mu, inverse_temperature, max_iter, tol,
                     p_one):
        cost_t, cost_ctx = _cost_map_forward(xp, features, prototypes)
        result, weights = _pool_transport(xp, cost_t, mu, inverse_temperature, max_iter, tol)
        n = features.shape[1]
        pooled = None
        if p_one:
            # (w / n) sums to 1: a convex combination, never beyond the largest feature
            # (the sum w . f of float32 features near 3.4e38 overflowed before / n).
            pooled = ((weights * (1.0 / n))[:, None, :] @ features)[:, 0, :]
        # z_i = (1/mu) sum_j pi_ij = (1/n) sum_j A_ij w_j: from the weights, never from pi,
        # which underflows for small mu.
        z = (weights[:, None, :] @ result.assignment.transpose(0, 2, 1))[:, 0, :] * (1.0 / n)
        return cost_ctx, result, weights, pooled, z

    def pool_backward(self, xp, ctx, d_pooled, d_z, d_y, check):
        d_weights, direct = _gemean_upstream(xp, ctx, d_pooled, d_y)
        weights_t = _distance_weights_of_pool(xp, ctx, d_weights, d_z, check)
        return PoolGrads(**vars(_cost_map_backward(xp, ctx.cost, weights_t, direct)))


class _KernelPath:
    """The compiled path (:class:`refdml.gpu.gsp._launch.Compiled`: the CPU twins or the
    CUDA kernels), behind :class:`_ArrayPath`'s interface: the clipped points and their
    scale come from this module's cost map code, the kernels do the rest but the
    prototypes' gradient, a sum over the batch (one GEMM, :func:`_prototypes_backward`)."""

    def __init__(self, compiled: _gsp_kernels.Compiled) -> None:
        self.compiled = compiled

    def __repr__(self) -> str:
        return f"_KernelPath({self.compiled!r})"

    def transport(self, xp, cost_t, mu, inverse_temperature, max_iter, tol):
        return self.compiled.transport(xp, cost_t, mu, inverse_temperature, max_iter, tol)

    def transport_backward(self, xp, result, d_rho, d_pi):
        return self.compiled.transport_backward(xp, result, d_rho, d_pi)

    def pool_forward(self, xp, features, prototypes, mu, inverse_temperature, max_iter, tol,
                     p_one):
        features_bar, features_norm, prototypes_bar, prototypes_norm, scale = _normalised(
            xp, features, prototypes)
        cost_t, result, weights, pooled, z = self.compiled.pool_forward(
            xp, features, features_bar, prototypes_bar, scale, mu, inverse_temperature,
            max_iter, tol, p_one)
        cost_ctx = CostMapContext(
            features_bar=features_bar, features_norm=features_norm,
            prototypes_bar=prototypes_bar, prototypes_norm=prototypes_norm,
            cost=cost_t.transpose(0, 2, 1), scale=scale,
        )
        return cost_ctx, result, weights, pooled, z

    def pool_backward(self, xp, ctx, d_pooled, d_z, d_y, check):
        # p = 1: the kernel forms d_weights and the direct path itself.
        d_weights, direct = (None, None) if d_y is None else _gemean_upstream(
            xp, ctx, d_pooled, d_y)
        distance_weights, d_features = self.compiled.pool_backward(
            xp, ctx, d_pooled, d_z, d_weights, direct, check=check)
        batch, n, m = distance_weights.shape
        flat = distance_weights.reshape(batch * n, m)
        return PoolGrads(features=d_features, prototypes=_prototypes_backward(xp, ctx.cost, flat))


#: GSP's implementations, and the one object that picks one per public call
#: (:func:`_path`). On NumPy "auto" keeps the array path: the CPU twins measured no faster;
#: on CuPy it runs the CUDA kernels.
GSP: Implementations = Implementations(
    "gsp", array=_ArrayPath(), load_cpu=lambda: _KernelPath(_gsp_kernels.CPU),
    load_cuda=lambda: _KernelPath(_gsp_kernels.CUDA), auto_numpy="array", auto_cupy="cuda",
    measured=("GSP layer forward + backward at B=256, m=64, n=49, d=128 (docs/gpu.md): "
              "float32 on an H200 (2026-11-28), CUDA kernels 6.21 ms, array path 19.9 ms; "
              "on the CPU (scripts/bench_gpu.py --only gsp) the twin 0.98-1.14x the array "
              "path's time, its backward slower"),
)


def _path(x, mu: float):
    """The implementation that runs a public call on input ``x``: :data:`GSP`'s choice,
    except that ``mu = 1`` (no solve) and ``mu`` below ``_SMALL_MU`` (float32 solves in
    float64: :func:`_pool_transport`) have the array path only."""
    if mu >= 1.0 or mu < _SMALL_MU[np.dtype(x.dtype)]:
        return GSP.array
    return GSP.choose(x)


def gsp_pool(
    features, prototypes, *, mu, inverse_temperature, p=1.0, method="exact", max_iter=100,
    tol=1e-12,
):
    """``(pooled, z)`` of the GSP layer (no context kept)."""
    return gsp_pool_forward(
        features, prototypes, mu=mu, inverse_temperature=inverse_temperature, p=p,
        method=method, max_iter=max_iter, tol=tol,
    )[0]

#: The family's implementations (registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`).
IMPLEMENTATIONS = GSP
