r"""The compiled members of :mod:`refdml.gpu.gsp`: the kernel table, the launches, the chooser.

Private module. :class:`CpuPath` runs the ``@njit(parallel=True)`` twins of
:mod:`refdml.gpu.gsp._compiled`, :class:`CudaPath` the ``@cuda.jit`` kernels of
:mod:`refdml.gpu.gsp._cuda` (one block of ``BLOCK`` threads per image); both are
:class:`KernelPath`, which implements :class:`~refdml.gpu.gsp._array.ArrayPath`'s interface
and differs between the two only in how a kernel launches and in its table of kernels.
:data:`IMPLEMENTATIONS` holds the three members and picks one per call.

The results are the reference's dataclasses, exactly as the array path builds them: same
tolerance rule (:func:`~refdml.gpu.gsp._transport.residual_floor`), same
``ConvergenceWarning``, same ``ValueError`` where a gradient overflows the dtype. ``n_iter``
is the reference's count: the most evaluations of ``g`` (pivot search and Newton steps) any
image took (the array path counts its vectorised steps). The clipped points and their scale
come from the array path's cost map code (:func:`~refdml.gpu.gsp._array.normalised`); the
kernels do the rest but the prototypes' gradient, a sum over the batch (one GEMM,
:func:`~refdml.gpu.gsp._array.prototypes_backward`).

Each kernel is one :class:`GspKernel` (its function and the parameter groups it takes:
frozen dataclasses of :mod:`refdml.gpu.gsp._compiled` whose fields, in order, are its
parameters); a launch passes the groups, checked against the kernel's layout and flattened
once. A :class:`GspKernelTable` holds one per operation; :func:`kernel_table` states the
layouts once for both targets, and each member builds its table when it is made
(``CpuPath().table``, ``CudaPath().table``).

Building a member imports its kernels' modules: :class:`CpuPath` the CPU twins'
(:mod:`refdml.gpu.gsp._compiled`, and Numba), :class:`CudaPath` the CUDA kernels' as well
(:mod:`refdml.gpu.gsp._cuda`, and ``numba.cuda``); nothing else here does, so importing the
package loads no compiled code until :data:`IMPLEMENTATIONS` builds a member on its first
use (``.cpu`` / ``.cuda``).

``mu = 1`` (Thm 4.1's boundary, no solve) is left to the array path by the caller.

Outputs are allocated with the input's module (NumPy or CuPy) with ``empty``; nothing is
copied between host and device. What reaches Python: ``n_iter``, "max_iter hit?" and
``converged``, read together in one transfer (:func:`_result`), and the backward's overflow
check, as on the array path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from refdml._backend import Backend, to_numpy
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.gsp import _array
from refdml.gpu.gsp import _transport as _wt
from refdml.gpu.gsp._array import ArrayPath, PoolForward
from refdml.gpu.gsp._transport import TransportArgs
from refdml.gsp import CostMapContext, PoolContext, PoolGrads, WeightTransportResult

if TYPE_CHECKING:  # the compiled module imports Numba: the members import it when built
    from refdml.gpu.gsp._compiled import Buffers, ImageOutputs, SolverConstants

__all__ = ["CpuPath", "CudaPath", "GspKernel", "GspKernelTable", "IMPLEMENTATIONS", "KernelPath",
           "kernel_table"]


# --------------------------------------------------------------------------- the kernels
@dataclass(frozen=True)
class GspKernel:
    """One GSP kernel: ``function`` (an ``@njit`` twin or a ``@cuda.jit`` kernel), ``layout``
    the parameter groups a launch passes, in order (their fields are its parameters),
    ``scratch``: it takes a trailing :class:`~refdml.gpu.gsp._compiled.Scratch` too (the
    CUDA backward kernels; the CPU twins keep those values in local arrays)."""

    function: Callable
    layout: tuple[type[Buffers], ...]
    scratch: bool = False

    def parameters(self) -> tuple[str, ...]:
        """The parameter names the launch passes: the layout's fields (and the scratch)."""
        names = tuple(name for group in self.layout for name in group.names())
        return names + (("scratch",) if self.scratch else ())

    def args(self, groups: tuple[Buffers, ...]) -> tuple:
        """``groups`` flattened into the kernel's arguments (a ``TypeError`` if they are not
        its layout: a wrong group is a bug of the caller, not of the data)."""
        if tuple(type(group) for group in groups) != self.layout:
            raise TypeError(f"{self.function.__name__} takes "
                            f"{[group.__name__ for group in self.layout]}, got "
                            f"{[type(group).__name__ for group in groups]}")
        return tuple(value for group in groups for value in group.args())


@dataclass(frozen=True)
class GspKernelTable:
    """The family's kernels for one target, one per operation of :class:`KernelPath`."""

    transport: GspKernel
    pool_forward: GspKernel
    pool_backward: GspKernel
    transport_backward: GspKernel


def kernel_table(compiled: ModuleType, *, transport: Callable, pool_forward: Callable,
                 pool_backward: Callable, transport_backward: Callable,
                 scratch: bool) -> GspKernelTable:
    """The table of the four kernels of one target, with their layouts (stated here once
    for the CPU twins and the CUDA kernels): the parameter groups of ``compiled``
    (:mod:`refdml.gpu.gsp._compiled`); ``scratch``: the backward kernels take one."""
    c = compiled
    return GspKernelTable(
        transport=GspKernel(transport, (c.TransportInput, c.SolverConstants, c.ImageOutputs)),
        pool_forward=GspKernel(pool_forward, (c.PoolInputs, c.SolverConstants, c.ImageOutputs,
                                              c.PoolOutputs)),
        pool_backward=GspKernel(pool_backward, (c.PoolSaved, c.PoolUpstream, c.PoolGradients),
                                scratch=scratch),
        transport_backward=GspKernel(transport_backward, (c.TransportSaved, c.TransportUpstream,
                                                          c.TransportGradient),
                                     scratch=scratch),
    )


# --------------------------------------------------------------------------- helpers
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


# --------------------------------------------------------------------------- the members
class KernelPath:
    """The compiled path behind :class:`~refdml.gpu.gsp._array.ArrayPath`'s interface (see
    there), on the kernels of ``table``; a subclass says how a kernel launches
    (:meth:`launch`). Building one imports the compiled module (Numba): its parameter
    groups are ``self.compiled``'s."""

    def __init__(self, table: GspKernelTable) -> None:
        from refdml.gpu.gsp import _compiled

        self.compiled = _compiled
        self.table = table

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def launch(self, xp, kernel: GspKernel, batch: int, *groups: Buffers,
               scratch_columns: int = 0) -> None:
        """Run ``kernel`` on ``batch`` images with the parameter ``groups`` (``scratch_columns``:
        the width of the (B, ·) scratch of a kernel that takes one)."""
        raise NotImplementedError

    def _constants(self, dtype, args: TransportArgs) -> SolverConstants:
        return self.compiled.SolverConstants.of(dtype, args.mu, args.inverse_temperature,
                                                args.max_iter)

    def transport(self, backend: Backend, cost_t, args: TransportArgs) -> WeightTransportResult:
        xp, c = backend.xp, self.compiled
        cost_t = xp.ascontiguousarray(cost_t)  # the user's (B, m, n) cost: one copy
        batch, n, m = cost_t.shape
        out = c.ImageOutputs.empty(xp, batch, n, m, cost_t.dtype)
        constants = self._constants(cost_t.dtype, args)
        self.launch(xp, self.table.transport, batch, c.TransportInput(cost_t), constants, out)
        return _result(xp, cost_t, out, constants, args.tol)

    def transport_backward(self, backend: Backend, result: WeightTransportResult, d_rho, d_pi):
        xp, c = backend.xp, self.compiled
        saved = c.TransportSaved(
            assignment=xp.ascontiguousarray(result.assignment.transpose(0, 2, 1)),
            rho=xp.ascontiguousarray(result.rho),
            transported=xp.ascontiguousarray(result.transported),
            inverse_temperature=float(result.inverse_temperature))
        batch, n, m = saved.assignment.shape
        upstream = c.TransportUpstream(d_rho=xp.ascontiguousarray(d_rho),
                                       d_pi=xp.ascontiguousarray(d_pi.transpose(0, 2, 1)))
        gradient = c.TransportGradient(d_cost=xp.empty((batch, n, m),
                                                       dtype=saved.assignment.dtype))
        self.launch(xp, self.table.transport_backward, batch, saved, upstream, gradient,
                    scratch_columns=3 * n)
        _wt.check_gradient(xp, gradient.d_cost, result.inverse_temperature)
        return gradient.d_cost.transpose(0, 2, 1)

    def pool_forward(self, backend: Backend, features, prototypes, args: TransportArgs, *,
                     p_one: bool) -> PoolForward:
        # The kernel divides the features by the scale ``s`` itself (exact: a power of two);
        # the prototypes are divided in the pass that transposes them.
        xp, c = backend.xp, self.compiled
        features_bar, features_norm, prototypes_bar, prototypes_norm, scale = _array.normalised(
            backend, features, prototypes)
        batch, n, d = features.shape
        m = prototypes_bar.shape[0]
        dtype = features.dtype
        prototypes_scaled_t = xp.empty((d, m), dtype=dtype)
        xp.divide(prototypes_bar.T, scale, out=prototypes_scaled_t)
        inputs = c.PoolInputs(features=xp.ascontiguousarray(features),
                              features_bar=xp.ascontiguousarray(features_bar),
                              prototypes_scaled_t=prototypes_scaled_t,
                              scale=_scale_1(xp, scale, dtype), p_one=bool(p_one))
        constants = self._constants(dtype, args)
        out = c.ImageOutputs.empty(xp, batch, n, m, dtype)
        pool = c.PoolOutputs(cost_t=xp.empty((batch, n, m), dtype=dtype),
                             weights=xp.empty((batch, n), dtype=dtype),
                             pooled=xp.empty((batch, d), dtype=dtype),
                             z=xp.empty((batch, m), dtype=dtype))
        self.launch(xp, self.table.pool_forward, batch, inputs, constants, out, pool)
        cost_ctx = CostMapContext(
            features_bar=features_bar, features_norm=features_norm,
            prototypes_bar=prototypes_bar, prototypes_norm=prototypes_norm,
            cost=pool.cost_t.transpose(0, 2, 1), scale=scale,
        )
        return PoolForward(cost=cost_ctx, transport=_result(xp, pool.cost_t, out, constants,
                                                            args.tol),
                           weights=pool.weights, pooled=pool.pooled if p_one else None, z=pool.z)

    def pool_backward(self, backend: Backend, ctx: PoolContext, d_pooled, d_z, d_y, *,
                      check: bool) -> PoolGrads:
        # The kernel writes W = d_cost / c' (B, n, m) and the features' gradient through the
        # cost map and the clip plus the direct path; at p = 1 it forms d_weights and the
        # direct path itself (placeholders of the right types are passed).
        xp, c = backend.xp, self.compiled
        cost_ctx, result = ctx.cost, ctx.transport
        features = xp.ascontiguousarray(ctx.features)
        batch, n, d = features.shape
        m = cost_ctx.prototypes_bar.shape[0]
        dtype = features.dtype
        p_one = d_y is None
        if p_one:
            d_weights = xp.empty((1, 1), dtype=dtype)
            direct = xp.empty((1, 1, 1), dtype=dtype)
        else:
            d_weights, direct = _array.gemean_upstream(xp, ctx, d_pooled, d_y)
        # Every array below is C-contiguous as the forward (either path) made it: the
        # ascontiguousarray calls are views, and copies only for a context built otherwise.
        saved = c.PoolSaved(
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
        upstream = c.PoolUpstream(d_pooled=xp.ascontiguousarray(d_pooled),
                                  d_z=xp.ascontiguousarray(d_z),
                                  d_weights=xp.ascontiguousarray(d_weights),
                                  direct=xp.ascontiguousarray(direct), p_one=p_one)
        grads = c.PoolGradients(distance_weights=xp.empty((batch, n, m), dtype=dtype),
                                d_features=xp.empty((batch, n, d), dtype=dtype))
        self.launch(xp, self.table.pool_backward, batch, saved, upstream, grads,
                    scratch_columns=3 * n)
        if check:
            _wt.check_gradient(xp, grads.distance_weights, result.inverse_temperature)
        flat = grads.distance_weights.reshape(batch * n, m)
        return PoolGrads(features=grads.d_features,
                         prototypes=_array.prototypes_backward(xp, cost_ctx, flat))


class CpuPath(KernelPath):
    """The compiled path on the CPU twins: ``prange`` over the images, behind the launch
    lock of :func:`~refdml.gpu._support.threading_layer.parallel_launch`. ``table``: the
    twins unless a test passes another."""

    def __init__(self, table: GspKernelTable | None = None) -> None:
        if table is None:
            from refdml.gpu.gsp import _compiled

            table = kernel_table(_compiled, transport=_compiled.transport_cpu,
                                 pool_forward=_compiled.pool_forward_cpu,
                                 pool_backward=_compiled.pool_backward_cpu,
                                 transport_backward=_compiled.transport_backward_cpu,
                                 scratch=False)
        super().__init__(table)

    def launch(self, xp, kernel: GspKernel, batch: int, *groups: Buffers,
               scratch_columns: int = 0) -> None:
        with np.errstate(all="ignore"), parallel_launch():
            kernel.function(*kernel.args(groups))


class CudaPath(KernelPath):
    """The compiled path on the CUDA kernels: one block of ``BLOCK`` threads per image
    (none for an empty batch), with a (B, ``scratch_columns``) float64 scratch where a
    kernel takes one. Making one imports :mod:`refdml.gpu.gsp._cuda` (and ``numba.cuda``);
    ``table``: the CUDA kernels unless a test passes another."""

    def __init__(self, table: GspKernelTable | None = None) -> None:
        if table is None:
            from refdml.gpu.gsp import _compiled, _cuda

            table = kernel_table(_compiled, transport=_cuda.refdml_gsp_transport,
                                 pool_forward=_cuda.refdml_gsp_pool_forward,
                                 pool_backward=_cuda.refdml_gsp_pool_backward,
                                 transport_backward=_cuda.refdml_gsp_transport_backward,
                                 scratch=True)
        super().__init__(table)

    def launch(self, xp, kernel: GspKernel, batch: int, *groups: Buffers,
               scratch_columns: int = 0) -> None:
        if not batch:
            return
        args = kernel.args(groups)
        if kernel.scratch:
            args += self.compiled.Scratch(xp.empty((batch, scratch_columns),
                                                   dtype=np.float64)).args()
        cuda_launch(kernel.function, batch, BLOCK, *args)


#: GSP's implementations, and the one object that picks one per public call (through
#: :func:`refdml.gpu.gsp._mirrors._path`, which keeps ``mu = 1`` and small ``mu`` on the
#: array path). On NumPy "auto" keeps the array path (the CPU twins measured no faster);
#: on CuPy it runs the CUDA kernels.
IMPLEMENTATIONS: Implementations[ArrayPath] = Implementations(
    family="gsp", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="array", auto_cupy="cuda",
    measured=("docs/gpu/kernels.md, 'Numba kernels: GSP per image, masked log-sum-exp' "
              "(its 'Numbers' and 'On a GPU'); python scripts/bench_gpu.py --only gsp"),
)
