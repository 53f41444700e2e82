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
image took (the array path counts its vectorised steps). The layer's forward is two launches:
:func:`~refdml.gpu.gsp._compiled.normalise_cpu` / ``refdml_gsp_normalise`` (the clipped
points, their norms and each block's largest norm, NaN where a norm is not finite) and the
forward kernel (the common power of two ``s`` from those norms, then the cost map, (P2),
weights, pooled, z, and the points' check in the summary's fourth column); its backward
three: the backward kernel (``W = d_cost / c'``, the features' gradient, each image's column
sums of ``W`` and its status), the prototypes' sum over the batch ``W^T fbar`` as one GEMM,
and ``refdml_gsp_prototypes_backward`` (the rest of the prototypes' gradient and its clip,
and each row's status).

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
copied between host and device. What reaches Python: ``n_iter``, "max_iter hit?",
``converged`` and the points' check, read together in one transfer through
:func:`refdml._deferred.read_later` (:func:`_result`; later, inside a training step), and,
from :meth:`KernelPath.pool_backward_status`, the backward's status (read by the caller,
:func:`refdml.gpu.gsp._mirrors.gsp_pool_backward`, once). Where a check failed the host
names it with the array path's checks (:func:`_name_bad_points`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from refdml._backend import Backend
from refdml._deferred import read_later
from refdml._validation import as_fast_array
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.gsp import _array
from refdml.gpu.gsp import _transport as _wt
from refdml.gpu.gsp._array import ArrayPath, PoolForward
from refdml.gpu.gsp._transport import TransportArgs
from refdml.gpu.linalg import matmul
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

    normalise: GspKernel
    transport: GspKernel
    pool_forward: GspKernel
    pool_backward: GspKernel
    prototypes_backward: GspKernel
    transport_backward: GspKernel


def kernel_table(compiled: ModuleType, *, normalise: Callable, transport: Callable,
                 pool_forward: Callable, pool_backward: Callable,
                 prototypes_backward: Callable, transport_backward: Callable,
                 scratch: bool) -> GspKernelTable:
    """The table of the four kernels of one target, with their layouts (stated here once
    for the CPU twins and the CUDA kernels): the parameter groups of ``compiled``
    (:mod:`refdml.gpu.gsp._compiled`); ``scratch``: the backward kernels take one."""
    c = compiled
    return GspKernelTable(
        normalise=GspKernel(normalise, (c.NormaliseInputs, c.NormaliseOutputs)),
        transport=GspKernel(transport, (c.TransportInput, c.SolverConstants, c.ImageOutputs)),
        pool_forward=GspKernel(pool_forward, (c.PoolInputs, c.SolverConstants, c.ImageOutputs,
                                              c.PoolOutputs)),
        pool_backward=GspKernel(pool_backward, (c.PoolSaved, c.PoolUpstream, c.PoolGradients),
                                scratch=scratch),
        prototypes_backward=GspKernel(prototypes_backward, (c.PrototypesSaved,
                                                            c.PrototypesUpstream,
                                                            c.PrototypesGradient)),
        transport_backward=GspKernel(transport_backward, (c.TransportSaved, c.TransportUpstream,
                                                          c.TransportGradient),
                                     scratch=scratch),
    )


# --------------------------------------------------------------------------- helpers
def applied_tol(tol: float, dtype, m: int, n: int) -> float:
    """The tolerance a solve applies: a positive ``tol`` raised to the dtype's
    :func:`~refdml.gpu.gsp._transport.residual_floor` (the array path's rule)."""
    return max(tol, _wt.residual_floor(dtype, m, n)) if tol > 0.0 else tol


def _result(xp, cost_t, out: ImageOutputs, constants: SolverConstants, tol,
            name_bad_points: Callable[[], None] | None = None):
    """The reference's result from the kernel's outputs; its summary read without a wait.

    What must reach the host (``n_iter``, the most evaluations of ``g``; whether an image hit
    ``max_iter``; ``converged``, every residual within ``tol``; the pooling layer's check of
    its points) is the kernel's ``counts`` (B, 4), read in one transfer by
    :func:`refdml._deferred.read_later`: at once outside a training step (``n_iter`` an int
    and ``converged`` a bool, as the reference's, and the ``ConvergenceWarning`` now), or
    with the scope's other deferred reads inside one. Until then the result holds the
    per-image device columns instead (``n_iter``: each image's evaluations, ``converged``: 1
    where its residual is within ``tol``), and the warning comes at the read.
    ``name_bad_points``: where the points' check (column 3) failed, called at the read,
    before the convergence report, to raise the array path's error that names the input
    (None: not checked, the data checks off).
    """
    batch, n, m = cost_t.shape
    max_iter = constants.max_iter
    summary = {}

    def on_read(values, where):
        counts = np.reshape(values, (-1, 4))    # read_later hands them raveled, as float64
        if name_bad_points is not None and counts[:, 3].any():
            name_bad_points()
        if counts.shape[0]:
            sweeps, exhausted = int(counts[:, 0].max()), bool(counts[:, 1].any())
            converged = bool(counts[:, 2].all())
        else:  # nothing to reduce (max of an empty array): as the array path, vacuously
            sweeps, exhausted, converged = 0, False, True
        summary["n_iter"] = sweeps
        summary["converged"] = _wt.report_convergence(xp, out.residual, tol, max_iter, sweeps,
                                                      exhausted, converged=converged,
                                                      where=where)

    if batch:
        read_later(out.counts, on_read)
    else:
        on_read(np.zeros(0), "")
    return WeightTransportResult(
        rho=out.rho, pi=out.pi.transpose(0, 2, 1), t=out.t, log_t=out.log_t,
        n_iter=summary.get("n_iter", out.counts[:, 0]), residual=out.residual,
        converged=summary.get("converged", out.counts[:, 2]), method="exact",
        mu=constants.mu, inverse_temperature=constants.inverse_temperature, tol=tol,
        transported=out.transported, log_s=out.log_s,
        assignment=out.assignment.transpose(0, 2, 1), tau_history=None,
    )


def _scale_1(xp, scale, dtype):
    """The 0-d power of two ``s`` as the (1,) array the kernels read (a view, no copy, where
    it has the dtype already, as the cost map makes it)."""
    return xp.reshape(scale, (1,)).astype(dtype, copy=False)


def _name_bad_points(backend: Backend, features, prototypes) -> None:
    """Raise the error of the array path's checks of the points, where the kernels' check
    (``counts[:, 3]``) failed: first the inputs' finiteness, as the public function words
    it (:func:`refdml._validation.as_fast_array`), then a norm beyond the dtype or a largest
    norm below its normal range (:func:`~refdml.gpu.gsp._array.normalised`). Reads freely:
    it runs only where a check failed."""
    dtype = features.dtype
    as_fast_array(features, "features", ndim=3, dtype=dtype, ns=backend)
    as_fast_array(prototypes, "prototypes", ndim=2, dtype=dtype, ns=backend)
    _array.normalised(backend, features, prototypes)


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

    def _constants(self, dtype, args: TransportArgs, tol: float) -> SolverConstants:
        return self.compiled.SolverConstants.of(dtype, args.mu, args.inverse_temperature,
                                                args.max_iter, tol)

    def transport(self, backend: Backend, cost_t, args: TransportArgs) -> WeightTransportResult:
        xp, c = backend.xp, self.compiled
        cost_t = xp.ascontiguousarray(cost_t)  # the user's (B, m, n) cost: one copy
        batch, n, m = cost_t.shape
        out = c.ImageOutputs.empty(xp, batch, n, m, cost_t.dtype)
        tol = applied_tol(args.tol, cost_t.dtype, m, n)
        constants = self._constants(cost_t.dtype, args, tol)
        self.launch(xp, self.table.transport, batch, c.TransportInput(cost_t), constants, out)
        return _result(xp, cost_t, out, constants, tol)

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
        # Two launches: the clipped points with their norms (and each block's largest norm),
        # then the rest; the second finishes the largest norm into the power of two s.
        xp, c = backend.xp, self.compiled
        features = xp.ascontiguousarray(features)
        batch, n, d = features.shape
        m = prototypes.shape[0]
        dtype = features.dtype
        points = c.NormaliseOutputs.empty(xp, batch, n, m, d, dtype)
        self.launch(xp, self.table.normalise, batch + 1,
                    c.NormaliseInputs(features=features,
                                      prototypes=xp.ascontiguousarray(prototypes)[None]),
                    points)
        prototypes_bar = points.prototypes_bar[0]
        inputs = c.PoolInputs(features=features, features_bar=points.features_bar,
                              prototypes_bar=prototypes_bar, peaks=points.peaks,
                              p_one=bool(p_one), tiny=float(np.finfo(dtype).tiny))
        tol = applied_tol(args.tol, dtype, m, n)
        constants = self._constants(dtype, args, tol)
        out = c.ImageOutputs.empty(xp, batch, n, m, dtype)
        pool = c.PoolOutputs(scale=xp.empty(1, dtype=dtype),
                             cost_t=xp.empty((batch, n, m), dtype=dtype),
                             weights=xp.empty((batch, n), dtype=dtype),
                             pooled=xp.empty((batch, d), dtype=dtype),
                             z=xp.empty((batch, m), dtype=dtype))
        self.launch(xp, self.table.pool_forward, batch, inputs, constants, out, pool)
        cost_ctx = CostMapContext(
            features_bar=points.features_bar, features_norm=points.features_norm[:, :, None],
            prototypes_bar=prototypes_bar, prototypes_norm=points.prototypes_norm[0][:, None],
            cost=pool.cost_t.transpose(0, 2, 1), scale=pool.scale.reshape(()),
        )
        # The points' checks ride on the summary's read (counts[:, 3]): no read of their own.
        name_bad_points = (functools.partial(_name_bad_points, backend, features, prototypes)
                           if backend.data_checks else None)
        return PoolForward(cost=cost_ctx, transport=_result(xp, pool.cost_t, out, constants,
                                                            tol, name_bad_points),
                           weights=pool.weights, pooled=pool.pooled if p_one else None, z=pool.z)

    def pool_backward(self, backend: Backend, ctx: PoolContext, d_pooled, d_z, d_y, *,
                      check: bool) -> PoolGrads:
        return self.pool_backward_status(backend, ctx, d_pooled, d_z, d_y, check=check)[0]

    def pool_backward_status(self, backend: Backend, ctx: PoolContext, d_pooled, d_z, d_y, *,
                             check: bool):
        """:meth:`pool_backward` and its ``status`` (B + m,) int64 on the device: each image's
        and each prototype's bits :data:`~refdml.gpu.gsp._compiled.UPSTREAM_NOT_FINITE` and
        :data:`~refdml.gpu.gsp._compiled.GRADIENT_NOT_FINITE`, written by the two kernels (no
        launch of its own): the checks of the upstream gradients and of the result, for one
        read by the caller."""
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
        status = xp.empty(batch + m, dtype=np.int64)   # two views: no concatenate to read it
        grads = c.PoolGradients(distance_weights=xp.empty((batch, n, m), dtype=dtype),
                                d_features=xp.empty((batch, n, d), dtype=dtype),
                                column_sums=xp.empty((batch, m), dtype=np.float64),
                                status=status[:batch])
        self.launch(xp, self.table.pool_backward, batch, saved, upstream, grads,
                    scratch_columns=3 * n)
        if check:
            _wt.check_gradient(xp, grads.distance_weights, result.inverse_temperature)
        # The sum over the whole batch, W^T fbar: one GEMM (cuBLAS / BLAS); the rest of the
        # prototypes' gradient, with its clip, one more launch.
        product = matmul(backend, grads.distance_weights.reshape(batch * n, m).T,
                         saved.features_bar.reshape(batch * n, d))
        gradient = c.PrototypesGradient(d_prototypes=xp.empty((m, d), dtype=dtype),
                                        status=status[batch:])
        self.launch(xp, self.table.prototypes_backward, -(-m // BLOCK),
                    c.PrototypesSaved(
                        prototypes_bar=saved.prototypes_bar,
                        prototypes_norm=xp.ascontiguousarray(cost_ctx.prototypes_norm[:, 0]),
                        scale=saved.scale),
                    c.PrototypesUpstream(column_sums=grads.column_sums,
                                         product=xp.ascontiguousarray(product)),
                    gradient)
        return PoolGrads(features=grads.d_features, prototypes=gradient.d_prototypes), status


class CpuPath(KernelPath):
    """The compiled path on the CPU twins: ``prange`` over the images, behind the launch
    lock of :func:`~refdml.gpu._support.threading_layer.parallel_launch`. ``table``: the
    twins unless a test passes another."""

    def __init__(self, table: GspKernelTable | None = None) -> None:
        if table is None:
            from refdml.gpu.gsp import _compiled

            table = kernel_table(_compiled, normalise=_compiled.normalise_cpu,
                                 transport=_compiled.transport_cpu,
                                 pool_forward=_compiled.pool_forward_cpu,
                                 pool_backward=_compiled.pool_backward_cpu,
                                 prototypes_backward=_compiled.prototypes_backward_cpu,
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

            table = kernel_table(_compiled, normalise=_cuda.refdml_gsp_normalise,
                                 transport=_cuda.refdml_gsp_transport,
                                 pool_forward=_cuda.refdml_gsp_pool_forward,
                                 pool_backward=_cuda.refdml_gsp_pool_backward,
                                 prototypes_backward=_cuda.refdml_gsp_prototypes_backward,
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
