r"""The kernel path of :mod:`refdml.gpu.gsp`: allocate, launch the Numba kernels, assemble.

Private module. :mod:`refdml.gpu.gsp` calls these where
:func:`refdml._compiled._support.select_kernel` picks ``"cpu"`` (the ``@njit(parallel=True)``
twins of :mod:`refdml._compiled.gsp`) or ``"cuda"`` (the ``@cuda.jit`` kernels, one block of
``BLOCK`` threads per image); the results are the reference's dataclasses, exactly as the
array path (:mod:`refdml.gpu._gsp_transport`) builds them: same tolerance rule
(:func:`residual_floor`), same ``ConvergenceWarning``, same ``ValueError`` where a
gradient overflows the dtype. ``n_iter`` is the reference's count: the most evaluations of
``g`` (pivot search and Newton steps) any image took (the array path counts its vectorised
steps).

``mu = 1`` (Thm 4.1's boundary, no solve) is left to the array path by the caller.

Outputs are allocated with the input's module (NumPy or CuPy); nothing is copied between
host and device. Results that reach Python: ``n_iter`` (one reduction of the per-image step
counts), ``converged`` and the backward's overflow check, as on the array path.
"""

from __future__ import annotations

import math

import numpy as np

from refdml._xp import to_numpy
from refdml.gpu import _gsp_transport as _wt
from refdml._compiled import gsp as _gsp_cpu
from refdml._compiled import gsp_cuda as _gsp_cuda
from refdml._compiled._support import BLOCK, cuda_launch, parallel_launch
from refdml.gsp._transport import WeightTransportResult

__all__ = ["pool_backward", "pool_forward", "transport", "transport_backward"]


def _solver_constants(dtype, mu):
    ulp = float(np.finfo(dtype).eps)
    cap = float(np.log(np.finfo(dtype).max)) - 2.0
    logit_mu = math.log(mu) - math.log1p(-mu)
    phi_floor = 16.0 * ulp * (1.0 + abs(logit_mu))
    return logit_mu, ulp, cap, phi_floor


def _outputs(xp, batch, n, m, dtype):
    return dict(
        assignment=xp.empty((batch, n, m), dtype=dtype),
        lam=xp.empty((batch, n), dtype=dtype),
        log_s=xp.empty((batch, n), dtype=dtype),
        rho=xp.empty((batch, n), dtype=dtype),
        transported=xp.empty((batch, n), dtype=dtype),
        pi=xp.empty((batch, n, m), dtype=dtype),
        order=xp.empty((batch, n), dtype=np.int64),
        image_real=xp.empty((batch, _gsp_cpu.N_REAL), dtype=np.float64),
        image_int=xp.empty((batch, _gsp_cpu.N_INT), dtype=np.int64),
    )


def _result(xp, cost_t, out, mu, inverse_temperature, max_iter, tol):
    """The array path's checks, tolerance rule, warning and result, from the kernel outputs."""
    dtype = cost_t.dtype
    m, n = cost_t.shape[2], cost_t.shape[1]
    if tol > 0.0:
        tol = max(tol, _wt.residual_floor(dtype, m, n))
    image_real, image_int = out["image_real"], out["image_int"]
    residual = image_real[:, 2].astype(dtype)
    counts = xp.stack([xp.max(image_int[:, 0] + image_int[:, 1]), xp.max(image_int[:, 2])])
    sweeps, exhausted = (int(c) for c in to_numpy(counts))  # one synchronisation
    converged = _wt.report_convergence(xp, residual, tol, max_iter, sweeps, bool(exhausted))
    with np.errstate(over="ignore", invalid="ignore"):
        log_t = (image_real[:, 0] - image_real[:, 1]).astype(dtype)  # y - l_p
        t = xp.exp(log_t)
    return WeightTransportResult(
        rho=out["rho"], pi=out["pi"].transpose(0, 2, 1), t=t, log_t=log_t, n_iter=sweeps,
        residual=residual, converged=converged, method="exact", mu=mu,
        inverse_temperature=inverse_temperature, tol=tol, transported=out["transported"],
        log_s=out["log_s"], assignment=out["assignment"].transpose(0, 2, 1), tau_history=None,
    )


# Each kernel by name: its CPU twin and its CUDA kernel (the same arguments; the CUDA
# backward kernels take a scratch array last).
_KERNELS = {
    "transport": (_gsp_cpu.transport_cpu, _gsp_cuda.refdml_gsp_transport),
    "pool_forward": (_gsp_cpu.pool_forward_cpu, _gsp_cuda.refdml_gsp_pool_forward),
    "pool_backward": (_gsp_cpu.pool_backward_cpu, _gsp_cuda.refdml_gsp_pool_backward),
    "transport_backward": (_gsp_cpu.transport_backward_cpu,
                           _gsp_cuda.refdml_gsp_transport_backward),
}


def _launch(xp, kind, name, args, batch, scratch_columns=0):
    """Run GSP kernel ``name`` on ``args``: the ``@cuda.jit`` kernel (``kind == "cuda"``; one
    block of ``BLOCK`` threads per image, none for an empty batch; the backward kernels take a
    (B, ``scratch_columns``) float64 scratch after ``args``) or the CPU twin ``<name>_cpu``."""
    if kind == "cuda":
        if batch:
            kernel = _KERNELS[name][1]
            if scratch_columns:
                args = (*args, xp.empty((batch, scratch_columns), dtype=np.float64))
            cuda_launch(kernel, batch, BLOCK, *args)
    else:
        with np.errstate(all="ignore"), parallel_launch():
            _KERNELS[name][0](*args)


def transport(xp, kind, cost_t, mu, inverse_temperature, max_iter, tol) -> WeightTransportResult:
    """(P2) for every image from the cost (B, n, m) in memory, by the ``kind`` kernel."""
    cost_t = xp.ascontiguousarray(cost_t)
    batch, n, m = cost_t.shape
    out = _outputs(xp, batch, n, m, cost_t.dtype)
    logit_mu, ulp, cap, phi_floor = _solver_constants(cost_t.dtype, mu)
    args = (cost_t, float(inverse_temperature), float(mu), logit_mu, int(max_iter), ulp, cap,
            phi_floor, out["assignment"], out["lam"], out["log_s"], out["rho"],
            out["transported"], out["pi"], out["order"], out["image_real"], out["image_int"])
    _launch(xp, kind, "transport", args, batch)
    return _result(xp, cost_t, out, mu, inverse_temperature, max_iter, tol)


def pool_forward(xp, kind, features, features_bar, prototypes_bar, scale, mu,
                 inverse_temperature, max_iter, tol, p_one):
    """Cost map, (P2), weights, pooled (``p_one``) and z by the ``kind`` kernel.

    ``scale`` is the common power of two (0-d array); returns ``(cost_t, result, weights,
    pooled or None, z)`` with ``cost_t`` (B, n, m) in memory.
    """
    batch, n, d = features.shape
    m = prototypes_bar.shape[0]
    dtype = features.dtype
    if xp is np and float(scale) == 1.0:  # free on NumPy; a pass saved
        fs, ws = features_bar, prototypes_bar
    else:
        fs, ws = features_bar / scale, prototypes_bar / scale
    ws_t = xp.ascontiguousarray(ws.T)
    scale_1 = xp.reshape(scale, (1,)).astype(dtype)
    out = _outputs(xp, batch, n, m, dtype)
    cost_t = xp.empty((batch, n, m), dtype=dtype)
    weights = xp.empty((batch, n), dtype=dtype)
    pooled = xp.empty((batch, d), dtype=dtype)
    z = xp.empty((batch, m), dtype=dtype)
    logit_mu, ulp, cap, phi_floor = _solver_constants(dtype, mu)
    args = (xp.ascontiguousarray(features), xp.ascontiguousarray(fs), ws_t, scale_1, float(inverse_temperature),
            float(mu), logit_mu, int(max_iter), ulp, cap, phi_floor, bool(p_one), cost_t,
            out["assignment"], out["lam"], out["log_s"], out["rho"],
            out["transported"], out["pi"], out["order"], weights, pooled, z,
            out["image_real"], out["image_int"])
    _launch(xp, kind, "pool_forward", args, batch)
    result = _result(xp, cost_t, out, mu, inverse_temperature, max_iter, tol)
    return cost_t, result, weights, (pooled if p_one else None), z


def pool_backward(xp, kind, ctx, d_pooled, d_z, d_weights, direct, check=True):
    """``(W = d_cost / c'`` (B, n, m), d features through the cost map + direct path).

    ``ctx`` is the pool's :class:`refdml.gsp._pool.PoolContext`; ``d_weights`` / ``direct``
    are ``None`` for ``p = 1`` (the kernel forms them) and arrays for GeMean. ``check``:
    ``W``'s overflow check (``False``: the caller tests the gradients itself).
    """
    cost_ctx, result = ctx.cost, ctx.transport
    features = xp.ascontiguousarray(ctx.features)
    batch, n, d = features.shape
    dtype = features.dtype
    p_one = d_weights is None
    if p_one:
        d_weights = xp.empty((1, 1), dtype=dtype)
        direct = xp.empty((1, 1, 1), dtype=dtype)
    scale = cost_ctx.scale
    ws = cost_ctx.prototypes_bar if (xp is np and float(scale) == 1.0) else (
        cost_ctx.prototypes_bar / scale)
    scale_1 = xp.reshape(scale, (1,)).astype(dtype)
    m = ws.shape[0]
    distance_weights = xp.empty((batch, n, m), dtype=dtype)
    d_features = xp.empty((batch, n, d), dtype=dtype)
    args = (features, xp.ascontiguousarray(cost_ctx.features_bar),
            xp.ascontiguousarray(cost_ctx.features_norm[:, :, 0]), xp.ascontiguousarray(ws),
            scale_1, xp.ascontiguousarray(result.assignment.transpose(0, 2, 1)),
            xp.ascontiguousarray(cost_ctx.cost.transpose(0, 2, 1)), result.rho,
            result.transported, ctx.weights, xp.ascontiguousarray(d_pooled),
            xp.ascontiguousarray(d_z), xp.ascontiguousarray(d_weights),
            xp.ascontiguousarray(direct), p_one, float(result.inverse_temperature),
            float(result.mu), distance_weights, d_features)
    _launch(xp, kind, "pool_backward", args, batch, scratch_columns=3 * n)
    if check:
        _wt.check_gradient(xp, distance_weights, result.inverse_temperature)
    return distance_weights, d_features


def transport_backward(xp, kind, result, d_rho, d_pi):
    """Prop. 4.3's ``d_cost`` (B, m, n; a transposed view) by the ``kind`` kernel."""
    assignment_t = xp.ascontiguousarray(result.assignment.transpose(0, 2, 1))
    batch, n, m = assignment_t.shape
    d_cost_t = xp.empty((batch, n, m), dtype=assignment_t.dtype)
    args = (assignment_t, xp.ascontiguousarray(result.rho),
            xp.ascontiguousarray(result.transported), xp.ascontiguousarray(d_rho),
            xp.ascontiguousarray(d_pi.transpose(0, 2, 1)), float(result.inverse_temperature),
            d_cost_t)
    _launch(xp, kind, "transport_backward", args, batch, scratch_columns=3 * n)
    _wt.check_gradient(xp, d_cost_t, result.inverse_temperature)
    return d_cost_t.transpose(0, 2, 1)
