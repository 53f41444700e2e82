r"""The compiled path of :mod:`refdml.gpu.gsp`: allocate, launch the Numba kernels, assemble.

Private module. :class:`Compiled` is one class parameterised by how it launches:
:data:`CPU` runs the ``@njit(parallel=True)`` twins of :mod:`refdml.gpu.gsp._compiled`,
:data:`CUDA` the ``@cuda.jit`` kernels of :mod:`refdml.gpu.gsp._cuda` (one block of
``BLOCK`` threads per image). :mod:`refdml.gpu.gsp` holds both, beside its array path, in
its one :class:`~refdml.gpu._support.modes.Implementations` object (``GSP``), which picks
one per call. The results are the reference's dataclasses, exactly as the array path
(:mod:`refdml.gpu.gsp._transport`) builds them: same tolerance rule (:func:`residual_floor`),
same ``ConvergenceWarning``, same ``ValueError`` where a gradient overflows the dtype.
``n_iter`` is the reference's count: the most evaluations of ``g`` (pivot search and Newton
steps) any image took (the array path counts its vectorised steps).

Each kernel is one :class:`GspKernel` (its CPU twin, its CUDA kernel and the parameter
groups it takes: frozen dataclasses of :mod:`refdml.gpu.gsp._compiled` whose fields, in order,
are its parameters); a launch passes the groups, checked against the kernel's layout and
flattened once. :data:`KERNELS` is the family's table of them.

``mu = 1`` (Thm 4.1's boundary, no solve) is left to the array path by the caller.

Outputs are allocated with the input's module (NumPy or CuPy) with ``empty``; nothing is
copied between host and device. What reaches Python: ``n_iter``, "max_iter hit?" and
``converged``, read together in one transfer (:func:`_result`), and the backward's overflow
check, as on the array path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.gpu.gsp import _compiled as _gsp_cpu
from refdml.gpu.gsp import _cuda as _gsp_cuda
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.gsp._compiled import (
    Buffers,
    ImageOutputs,
    PoolGradients,
    PoolInputs,
    PoolOutputs,
    PoolSaved,
    PoolUpstream,
    Scratch,
    SolverConstants,
    TransportGradient,
    TransportInput,
    TransportSaved,
    TransportUpstream,
)
from refdml._backend import to_numpy
from refdml.gpu.gsp import _transport as _wt
from refdml.gsp import WeightTransportResult

__all__ = ["CPU", "CUDA", "Compiled", "GspKernel", "GspKernels", "KERNELS", "launch_cpu",
           "launch_cuda"]


# --------------------------------------------------------------------------- the kernels
@dataclass(frozen=True)
class GspKernel:
    """One GSP kernel: ``cpu`` its ``@njit`` twin, ``cuda`` its ``@cuda.jit`` kernel,
    ``layout`` the parameter groups a launch passes, in order (both take their fields as
    parameters), ``scratch``: the CUDA kernel takes a trailing :class:`Scratch` too."""

    cpu: Callable
    cuda: Any
    layout: tuple[type[Buffers], ...]
    scratch: bool = False

    def parameters(self, *, cuda: bool) -> tuple[str, ...]:
        """The parameter names the launch passes: the layout's fields (and the scratch)."""
        groups = self.layout + ((Scratch,) if cuda and self.scratch else ())
        return tuple(name for group in groups for name in group.names())

    def args(self, groups: tuple[Buffers, ...]) -> tuple:
        """``groups`` flattened into the kernel's arguments (a ``TypeError`` if they are not
        its layout: a wrong group is a bug of the caller, not of the data)."""
        if tuple(type(group) for group in groups) != self.layout:
            raise TypeError(f"{self.cuda.__name__} takes "
                            f"{[group.__name__ for group in self.layout]}, got "
                            f"{[type(group).__name__ for group in groups]}")
        return tuple(value for group in groups for value in group.args())


@dataclass(frozen=True)
class GspKernels:
    """The family's kernels, one per operation of :class:`Compiled`."""

    transport: GspKernel
    pool_forward: GspKernel
    pool_backward: GspKernel
    transport_backward: GspKernel


KERNELS = GspKernels(
    transport=GspKernel(_gsp_cpu.transport_cpu, _gsp_cuda.refdml_gsp_transport,
                        (TransportInput, SolverConstants, ImageOutputs)),
    pool_forward=GspKernel(_gsp_cpu.pool_forward_cpu, _gsp_cuda.refdml_gsp_pool_forward,
                           (PoolInputs, SolverConstants, ImageOutputs, PoolOutputs)),
    pool_backward=GspKernel(_gsp_cpu.pool_backward_cpu, _gsp_cuda.refdml_gsp_pool_backward,
                            (PoolSaved, PoolUpstream, PoolGradients), scratch=True),
    transport_backward=GspKernel(_gsp_cpu.transport_backward_cpu,
                                 _gsp_cuda.refdml_gsp_transport_backward,
                                 (TransportSaved, TransportUpstream, TransportGradient),
                                 scratch=True),
)


# --------------------------------------------------------------------------- how it launches
def launch_cpu(xp, kernel: GspKernel, batch: int, *groups: Buffers, scratch_columns: int = 0):
    """Run ``kernel``'s CPU twin (``prange`` over the images; the twins keep their per-column
    values in local arrays, so ``scratch_columns`` is not used)."""
    with np.errstate(all="ignore"), parallel_launch():
        kernel.cpu(*kernel.args(groups))


def launch_cuda(xp, kernel: GspKernel, batch: int, *groups: Buffers, scratch_columns: int = 0):
    """Launch ``kernel``'s CUDA kernel: one block of ``BLOCK`` threads per image (none for an
    empty batch), with a (B, ``scratch_columns``) float64 :class:`Scratch` where it takes one."""
    if not batch:
        return
    args = kernel.args(groups)
    if kernel.scratch:
        args += Scratch(xp.empty((batch, scratch_columns), dtype=np.float64)).args()
    cuda_launch(kernel.cuda, batch, BLOCK, *args)


def _result(xp, cost_t, out: ImageOutputs, constants: SolverConstants, tol):
    """The array path's tolerance rule, warning and result, from the kernel's outputs.

    One transfer: ``n_iter`` (the most evaluations of ``g``), whether an image hit
    ``max_iter`` and ``converged`` (every residual within ``tol``), reduced on the device.
    """
    dtype = cost_t.dtype
    batch, n, m = cost_t.shape
    mu, max_iter = constants.mu, constants.max_iter
    if tol > 0.0:
        tol = max(tol, _wt.residual_floor(dtype, m, n))
    if batch:
        within = xp.all(out.residual <= tol)
        summary = xp.concatenate((xp.max(out.counts, axis=0), within[None]))
        sweeps, exhausted, converged = (int(c) for c in to_numpy(summary))
    else:  # nothing to reduce (max of an empty array): as the array path, vacuously
        sweeps, exhausted, converged = 0, 0, 1
    converged = _wt.report_convergence(xp, out.residual, tol, max_iter, sweeps,
                                       bool(exhausted), converged=bool(converged))
    with np.errstate(over="ignore"):
        t = xp.exp(out.log_t)
    return WeightTransportResult(
        rho=out.rho, pi=out.pi.transpose(0, 2, 1), t=t, log_t=out.log_t, n_iter=sweeps,
        residual=out.residual, converged=converged, method="exact", mu=mu,
        inverse_temperature=constants.inverse_temperature, tol=tol,
        transported=out.transported, log_s=out.log_s,
        assignment=out.assignment.transpose(0, 2, 1), tau_history=None,
    )


def _scale_1(xp, scale, dtype):
    """The 0-d power of two ``s`` as the (1,) array the kernels read (a view, no copy, where
    it has the dtype already, as the cost map makes it)."""
    return xp.reshape(scale, (1,)).astype(dtype, copy=False)


# --------------------------------------------------------------------------- the operations
class Compiled:
    """The GSP kernels behind one interface, parameterised by ``launch`` (:func:`launch_cpu`
    or :func:`launch_cuda`) and the kernel table (``kernels``, :data:`KERNELS` unless a test
    swaps one)."""

    def __init__(self, launch: Callable, kernels: GspKernels = KERNELS) -> None:
        self.launch = launch
        self.kernels = kernels

    def __repr__(self) -> str:
        return f"Compiled({self.launch.__name__})"

    def transport(self, xp, cost_t, mu, inverse_temperature, max_iter,
                  tol) -> WeightTransportResult:
        """(P2) for every image from the cost (B, n, m) in memory."""
        cost_t = xp.ascontiguousarray(cost_t)  # the user's (B, m, n) cost: one copy
        batch, n, m = cost_t.shape
        out = ImageOutputs.empty(xp, batch, n, m, cost_t.dtype)
        constants = SolverConstants.of(cost_t.dtype, mu, inverse_temperature, max_iter)
        self.launch(xp, self.kernels.transport, batch, TransportInput(cost_t), constants, out)
        return _result(xp, cost_t, out, constants, tol)

    def pool_forward(self, xp, features, features_bar, prototypes_bar, scale, mu,
                     inverse_temperature, max_iter, tol, p_one):
        """Cost map, (P2), weights, pooled (``p_one``) and z.

        ``features_bar`` / ``prototypes_bar``: the clipped points, ``scale`` the common
        power of two (0-d array), which the kernel divides the features by itself (exact);
        the prototypes are divided in the pass that transposes them. Returns ``(cost_t,
        result, weights, pooled or None, z)`` with ``cost_t`` (B, n, m) in memory.
        """
        batch, n, d = features.shape
        m = prototypes_bar.shape[0]
        dtype = features.dtype
        prototypes_scaled_t = xp.empty((d, m), dtype=dtype)
        xp.divide(prototypes_bar.T, scale, out=prototypes_scaled_t)
        inputs = PoolInputs(features=xp.ascontiguousarray(features),
                            features_bar=xp.ascontiguousarray(features_bar),
                            prototypes_scaled_t=prototypes_scaled_t,
                            scale=_scale_1(xp, scale, dtype), p_one=bool(p_one))
        constants = SolverConstants.of(dtype, mu, inverse_temperature, max_iter)
        out = ImageOutputs.empty(xp, batch, n, m, dtype)
        pool = PoolOutputs(cost_t=xp.empty((batch, n, m), dtype=dtype),
                           weights=xp.empty((batch, n), dtype=dtype),
                           pooled=xp.empty((batch, d), dtype=dtype),
                           z=xp.empty((batch, m), dtype=dtype))
        self.launch(xp, self.kernels.pool_forward, batch, inputs, constants, out, pool)
        result = _result(xp, pool.cost_t, out, constants, tol)
        return pool.cost_t, result, pool.weights, (pool.pooled if p_one else None), pool.z

    def pool_backward(self, xp, ctx, d_pooled, d_z, d_weights, direct, check=True):
        """``(W = d_cost / c'`` (B, n, m), d features through the cost map + direct path).

        ``ctx`` is the pool's :class:`refdml.gsp.PoolContext`; ``d_weights`` / ``direct``
        are ``None`` for ``p = 1`` (the kernel forms them) and arrays for GeMean. ``check``:
        ``W``'s overflow check (``False``: the caller tests the gradients itself).
        """
        cost_ctx, result = ctx.cost, ctx.transport
        features = xp.ascontiguousarray(ctx.features)
        batch, n, d = features.shape
        m = cost_ctx.prototypes_bar.shape[0]
        dtype = features.dtype
        p_one = d_weights is None
        if p_one:  # placeholders of the right types: the kernel forms both itself
            d_weights = xp.empty((1, 1), dtype=dtype)
            direct = xp.empty((1, 1, 1), dtype=dtype)
        # Every array below is C-contiguous as the forward (either path) made it: the
        # ascontiguousarray calls are views, and copies only for a context built otherwise.
        saved = PoolSaved(
            features=features, features_bar=xp.ascontiguousarray(cost_ctx.features_bar),
            features_norm=xp.ascontiguousarray(cost_ctx.features_norm[:, :, 0]),
            prototypes_bar=xp.ascontiguousarray(cost_ctx.prototypes_bar),
            scale=_scale_1(xp, cost_ctx.scale, dtype),
            assignment=xp.ascontiguousarray(result.assignment.transpose(0, 2, 1)),
            cost_t=xp.ascontiguousarray(cost_ctx.cost.transpose(0, 2, 1)),
            rho=xp.ascontiguousarray(result.rho),
            transported=xp.ascontiguousarray(result.transported),
            weights=xp.ascontiguousarray(ctx.weights),
            inverse_temperature=float(result.inverse_temperature), mu=float(result.mu))
        upstream = PoolUpstream(d_pooled=xp.ascontiguousarray(d_pooled),
                                d_z=xp.ascontiguousarray(d_z),
                                d_weights=xp.ascontiguousarray(d_weights),
                                direct=xp.ascontiguousarray(direct), p_one=p_one)
        grads = PoolGradients(distance_weights=xp.empty((batch, n, m), dtype=dtype),
                              d_features=xp.empty((batch, n, d), dtype=dtype))
        self.launch(xp, self.kernels.pool_backward, batch, saved, upstream, grads,
                    scratch_columns=3 * n)
        if check:
            _wt.check_gradient(xp, grads.distance_weights, result.inverse_temperature)
        return grads.distance_weights, grads.d_features

    def transport_backward(self, xp, result, d_rho, d_pi):
        """Prop. 4.3's ``d_cost`` (B, m, n; a transposed view)."""
        saved = TransportSaved(
            assignment=xp.ascontiguousarray(result.assignment.transpose(0, 2, 1)),
            rho=xp.ascontiguousarray(result.rho),
            transported=xp.ascontiguousarray(result.transported),
            inverse_temperature=float(result.inverse_temperature))
        batch, n, m = saved.assignment.shape
        upstream = TransportUpstream(d_rho=xp.ascontiguousarray(d_rho),
                                     d_pi=xp.ascontiguousarray(d_pi.transpose(0, 2, 1)))
        gradient = TransportGradient(d_cost=xp.empty((batch, n, m), dtype=saved.assignment.dtype))
        self.launch(xp, self.kernels.transport_backward, batch, saved, upstream, gradient,
                    scratch_columns=3 * n)
        _wt.check_gradient(xp, gradient.d_cost, result.inverse_temperature)
        return gradient.d_cost.transpose(0, 2, 1)


#: The compiled path on the CPU twins and on the CUDA kernels.
CPU = Compiled(launch_cpu)
CUDA = Compiled(launch_cuda)
