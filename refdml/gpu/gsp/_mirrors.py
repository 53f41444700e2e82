"""The public functions of :mod:`refdml.gpu.gsp`: validate once, choose once, read through.

Private module (the package re-exports these names). Each public function checks its
arguments with the reference's rules (:mod:`refdml._shared.gsp`, so that both paths refuse
the same inputs with the same messages), asks :func:`_path` once which member of
:data:`IMPLEMENTATIONS` runs it (the array path, the CPU twins or the CUDA kernels: one
interface, :class:`~refdml.gpu.gsp._array.ArrayPath`), and calls it. What stays here beside
the choice: GeMean (the reference's own ``power_mean`` and its backward, written once against
the backend) and the pooling backward's retries where an intermediate left the dtype (float32
redone in float64; float64 redone on rescaled upstreams, as the reference). The cost map has
the array path only (:mod:`refdml.gpu.gsp._array`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import numpy as np

from refdml._backend import get_backend, hand_operator_checks_to_step
from refdml._deferred import read_now
from refdml._shared.gsp import (
    check_pool_mu,
    check_transport_args,
    power_mean,
    power_mean_backward,
)
from refdml._validation import (
    as_fast_array, cast_checked, check_choice, check_context, check_scalar, result_dtype,
)
from refdml.gpu.gsp import _array
from refdml.gpu.gsp._kernels import IMPLEMENTATIONS, KernelPath
from refdml.gpu.gsp._transport import TransportArgs
from refdml.gsp import (
    CostMapContext,
    CostMapGrads,
    PoolContext,
    PoolGrads,
    WeightTransportGrads,
    WeightTransportResult,
)

__all__ = [
    "cost_map",
    "cost_map_backward",
    "cost_map_forward",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
    "weight_transport",
    "weight_transport_backward",
]


@functools.cache
def _threadpools():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()  # scans the loaded BLAS libraries once (a few ms)


def _one_blas_thread(fn):
    """Run ``fn`` with host BLAS limited to one thread (no effect on cuBLAS).

    Why: the GEMMs here are small ((B n, d) x (d, m)); with the user's default BLAS threads on
    a busy machine, OpenBLAS's spinning worker threads slow the pooling layer's forward +
    backward down badly (both paths; docs/gpu/kernels.md, "Numbers"). On an idle machine one
    thread costs at most the GEMMs' share of parallel speed-up.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _threadpools().limit(limits=1, user_api="blas"):
            return fn(*args, **kwargs)
    return wrapper


_VALIDATION_ONLY = "is validation only and has no fast path; use refdml.gsp"


# --------------------------------------------------------------------------- checks
def _features_prototypes(features, prototypes, *, finite: bool = True):
    """The checked inputs; ``finite=False``: their finiteness not yet checked on a device
    (:func:`_points_finite` or the kernels' own check does it), on NumPy at once as ever."""
    backend = get_backend(features, prototypes)
    # The common dtype from the inputs' own (host data as NumPy makes it), so that each
    # input is converted and checked once: a finiteness check is a synchronisation on CuPy.
    dtype = result_dtype(*(value if hasattr(value, "dtype") else np.asarray(value)
                           for value in (features, prototypes)))
    with _data_checks_later(not finite):
        features = as_fast_array(features, "features", ndim=3, dtype=dtype, ns=backend)
        prototypes = as_fast_array(prototypes, "prototypes", ndim=2, dtype=dtype, ns=backend)
    if features.shape[2] != prototypes.shape[1]:
        raise ValueError(
            "features and prototypes must have the same last dimension, got "
            f"features.shape={tuple(features.shape)}, prototypes.shape={tuple(prototypes.shape)}"
        )
    return backend, features, prototypes


def _data_checks_later(later: bool):
    """Within the block, no data check of CuPy input where ``later`` (the caller has them run
    later, by the kernels, for one read): a check the block skips is one the caller owns.
    NumPy's checks read nothing and run as ever."""
    return hand_operator_checks_to_step() if later else contextlib.nullcontext()


def _points_finite(backend, features, prototypes) -> None:
    """The inputs' finiteness checks (:func:`refdml._validation.as_fast_array`'s) where
    :func:`_features_prototypes` left them for later: on a device (NumPy ran them)."""
    if not backend.free_host_reads:
        as_fast_array(features, "features", ndim=3, dtype=features.dtype, ns=backend)
        as_fast_array(prototypes, "prototypes", ndim=2, dtype=features.dtype, ns=backend)


def _upstream(value, name: str, shape, like, *, allow_none: bool = True, finite: bool = True):
    """An upstream gradient: real, exactly ``shape``, finite, cast to ``like``'s dtype
    (``finite=False``: its data checks left to the caller on a device, as
    :func:`_features_prototypes`)."""
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be an array of shape {tuple(shape)}, got None")
    with _data_checks_later(not finite):
        array = as_fast_array(value, name, dtype=like.dtype, ns=get_backend(value, like))
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


@_one_blas_thread
def cost_map_forward(features, prototypes) -> tuple[Any, CostMapContext]:
    """GSP cost map ``c[b, i, j] = || wbar_i - fbar_{b,j} ||`` (Alg. 2); ``(cost, ctx)``.

    As :func:`refdml.gsp.cost_map_forward`; ``cost`` (B, m, n) is a transposed view of
    a ``(B, n, m)`` array, in the input's dtype and module.
    """
    backend, features, prototypes = _features_prototypes(features, prototypes)
    cost_t, ctx = _array.cost_map_forward(backend, features, prototypes)
    return ctx.cost, ctx


@_one_blas_thread
def cost_map_backward(ctx: CostMapContext, d_cost) -> CostMapGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d); ``d_cost`` (B, m, n)."""
    check_context(ctx, "ctx", CostMapContext)
    d_cost = _upstream(d_cost, "d_cost", ctx.cost.shape, ctx.cost, allow_none=False)
    xp = get_backend(d_cost).xp
    weights_t = xp.array(d_cost.transpose(0, 2, 1), order="C", copy=True)  # scaled in place
    return _array.cost_map_backward(xp, ctx, _array.distance_weights(xp, ctx, weights_t))


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
    args = TransportArgs(mu=mu, inverse_temperature=inverse_temperature, max_iter=max_iter,
                         tol=tol)
    return _path(cost, mu).transport(get_backend(cost), cost.transpose(0, 2, 1), args)


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
    backend = get_backend(result.pi)
    xp = backend.xp
    d_rho = xp.zeros_like(result.rho) if d_rho is None else d_rho
    d_pi = xp.zeros_like(result.pi) if d_pi is None else d_pi
    return WeightTransportGrads(
        cost=_path(result.pi, result.mu).transport_backward(backend, result, d_rho, d_pi))


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
    # The kernels (p = 1) check the points themselves, read with their solve summary: on
    # CuPy the inputs' finiteness is theirs too, and the forward reads once.
    backend, features, prototypes = _features_prototypes(features, prototypes, finite=False)
    xp = backend.xp
    try:
        mu, inverse_temperature, method, max_iter, tol = check_transport_args(
            mu, inverse_temperature, method, max_iter, tol
        )
        p = check_scalar(p, "p", low=1.0)
        backward = check_choice(backward, "backward", ("closed_form", "unrolled"))
        _method_backward(method, backward)
        check_pool_mu(mu)
        path = _path(features, mu)
    except (TypeError, ValueError):
        _points_finite(backend, features, prototypes)  # the data's error first, as ever
        raise
    if not (isinstance(path, KernelPath) and p == 1.0):
        _points_finite(backend, features, prototypes)
    if p > 1.0 and backend.data_checks and bool(xp.any(features < 0)):
        bad = tuple(int(i) for i in xp.argwhere(features < 0)[0])
        raise ValueError(
            f"features[{bad}] == {features[bad]!r} is negative; p == {p!r} > 1 "
            "(GeMean) needs non-negative features"
        )
    args = TransportArgs(mu=mu, inverse_temperature=inverse_temperature, max_iter=max_iter,
                         tol=tol)
    forward = path.pool_forward(backend, features, prototypes, args, p_one=p == 1.0)
    pooled, power_ctx = forward.pooled, None
    if p != 1.0:
        pooled, power_ctx = power_mean(xp, forward.weights, features, p, backend.data_checks)
    ctx = PoolContext(features=features, weights=forward.weights, pooled=pooled, p=p,
                      backward=backward, cost=forward.cost, transport=forward.transport,
                      power_mean=power_ctx)
    return (pooled, forward.z), ctx


@_one_blas_thread
def gsp_pool_backward(ctx: PoolContext, d_pooled, d_z) -> PoolGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d) of the pooling layer.

    ``d_pooled`` (B, d), ``d_z`` (B, m), exactly those shapes; ``None`` means zero.
    Fused: ``d_pi = d_z / mu`` is never broadcast to (B, m, n); the (B, n, m) array
    ``W = d_cost / c'`` is built in a few passes over the softmax ``A``.
    """
    check_context(ctx, "ctx", PoolContext)
    result = ctx.transport
    backend = get_backend(ctx.pooled)
    path = _path(ctx.pooled, result.mu)
    # The kernels check the upstream gradients and their result in one status array: one
    # read, which also decides the retries below (on NumPy the upstreams are checked here).
    folded = isinstance(path, KernelPath) and backend.data_checks
    upstreams = functools.partial(_pool_upstreams, ctx, d_pooled, d_z)
    d_pooled, d_z = upstreams(finite=not folded)
    xp = backend.xp
    d_pooled = xp.zeros_like(ctx.pooled) if d_pooled is None else d_pooled
    d_z = xp.zeros(result.pi.shape[:2], dtype=ctx.pooled.dtype) if d_z is None else d_z
    # GeMean's d y = d pooled / d (w f) (bounded by |d_pooled|), from the forward's context.
    d_y = None if ctx.p == 1.0 else power_mean_backward(
        xp, ctx.weights, ctx.features, ctx.p, ctx.power_mean, d_pooled)
    if not backend.data_checks:
        return path.pool_backward(backend, ctx, d_pooled, d_z, d_y, check=True)
    # d_weights ~ |f| |d_pooled| and W = d_cost / c' can leave the dtype where the gradients
    # do not (features near its largest number: their gradient through the normalised cost
    # map is O(ε |d_pooled|)). float32: such a backward is redone in float64 and cast back
    # (cast_checked names a gradient truly beyond float32); float64: redone on upstreams
    # divided by powers of two, as the reference (a gradient beyond float64 named). The
    # finiteness test is the synchronisation the overflow check of W made before; on the
    # kernels it is their status, read with the upstreams' checks (and, in a deferring scope,
    # with the scope's pending reads: refdml._deferred.read_now).
    with np.errstate(over="ignore", invalid="ignore"):
        if folded:
            grads, status = path.pool_backward_status(backend, ctx, d_pooled, d_z, d_y,
                                                      check=False)
        else:
            grads = path.pool_backward(backend, ctx, d_pooled, d_z, d_y, check=False)
    if folded:
        bits = _status_bits(status)
        if bits & path.compiled.UPSTREAM_NOT_FINITE:
            upstreams(finite=True)                # raises the check's error, naming the entry
        finite = not bits & path.compiled.GRADIENT_NOT_FINITE
    else:
        finite = bool(xp.all(xp.isfinite(grads.features)) & xp.all(xp.isfinite(grads.prototypes)))
    if finite:
        return grads
    if ctx.pooled.dtype == np.float64:
        return _array.pool_backward_rescaled(xp, ctx, d_pooled, d_z, d_y)
    wide = path.pool_backward(backend, _widened(ctx), d_pooled.astype(np.float64),
                              d_z.astype(np.float64),
                              None if d_y is None else d_y.astype(np.float64), check=True)
    return PoolGrads(
        features=cast_checked(wide.features, np.float32, "the gradient of features", backend),
        prototypes=cast_checked(wide.prototypes, np.float32, "the gradient of prototypes",
                                backend),
    )


def _pool_upstreams(ctx: PoolContext, d_pooled, d_z, *, finite: bool):
    """The pooling backward's upstream gradients, checked (:func:`_upstream`)."""
    return (_upstream(d_pooled, "d_pooled", ctx.pooled.shape, ctx.pooled, finite=finite),
            _upstream(d_z, "d_z", ctx.transport.pi.shape[:2], ctx.pooled, finite=finite))


def _status_bits(status) -> int:
    """The OR of the kernels' ``status`` (one read: :func:`refdml._deferred.read_now`)."""
    seen = []
    read_now(status, lambda values, where: seen.append(
        int(np.bitwise_or.reduce(values.astype(np.int64), initial=0))))
    return seen[0]


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


def _path(x, mu: float):
    """The implementation that runs a public call on input ``x``: :data:`IMPLEMENTATIONS`'s
    choice, except that ``mu = 1`` (no solve) and ``mu`` below
    :data:`~refdml.gpu.gsp._array.SMALL_MU` (float32 solves in float64) have the array path
    only."""
    if mu >= 1.0 or mu < _array.SMALL_MU[np.dtype(x.dtype)]:
        return IMPLEMENTATIONS.array
    return IMPLEMENTATIONS.choose(x)


def gsp_pool(
    features, prototypes, *, mu, inverse_temperature, p=1.0, method="exact", max_iter=100,
    tol=1e-12,
):
    """``(pooled, z)`` of the GSP layer (no context kept)."""
    return gsp_pool_forward(
        features, prototypes, mu=mu, inverse_temperature=inverse_temperature, p=p,
        method=method, max_iter=max_iter, tol=tol,
    )[0]
