"""The compiled members of the OT family and their launches: :class:`CpuPath` (the
``@njit`` CPU twins of :mod:`refdml.gpu.ot._compiled`) and :class:`CudaPath` (the
``@cuda.jit`` kernels of :mod:`refdml.gpu.ot._cuda`), the driver of a small-problem batch
(:func:`solve_small`), and the family's :data:`IMPLEMENTATIONS`. Building a member imports
its kernels' modules (Numba; ``numba.cuda`` for the CUDA member): nothing else here does.

Both members have the interface of the array path (:class:`refdml.gpu.ot._array.ArrayPath`,
whose class docstring lists it) through their base :class:`KernelPath`, and replace the
steps they have kernels for: the log-sum-exp half step, the small-problem solver and, on
the CPU, the pair costs. ``import refdml.gpu.ot`` builds no compiled member: each loads on
first use (``IMPLEMENTATIONS.cpu`` / ``.cuda``; ``load_cpu=CpuPath``, ``load_cuda=CudaPath``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._numerics import _REFINE
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations, cuda_simulator
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.ot._array import ArrayPath
from refdml.gpu.ot._small import MAX_POINTS, SmallSolution

__all__ = ["IMPLEMENTATIONS", "CpuPath", "CudaPath", "KernelPath", "SinkhornKernels",
           "compiled_pair_sq", "solve_small", "threads_per_problem"]


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class SinkhornKernels:
    """The kernels a compiled member launches, by operation.

    ``small_problem``: the small-problem solver, parameters :meth:`SmallLaunch.parameters`
    (the CPU twin itself; on CUDA the builder of the kernel for a plan dtype, one kernel per
    dtype since its shared tile is typed by it). ``half_step``: the log-sum-exp half step
    ``(scaled_cost, weighted_potential, out)``. ``pair_sq``: the pair costs ``(points,
    norms, first, second, refine, out)``, or None where the array path's run instead (CUDA).
    """

    small_problem: Any
    half_step: Any
    pair_sq: Any = None


# --------------------------------------------------------------------------- driver
def solve_small(xp, launch, a, b, cost, *, schedule, stage_tol, max_iter, symmetric, tiny,
                high, low):
    """Solve P problems of at most :data:`MAX_POINTS` points per side with ``launch``.

    ``a`` (P, n), ``b`` (P, m) on the simplex, ``cost`` (P, n, m) (arrays of ``xp``);
    ``schedule`` / ``stage_tol`` the eps levels and their tolerances. ``launch`` (a
    :class:`SmallLaunch` -> None) runs the problems on the buffers allocated here (float64
    state, ``plan`` (P, n, m) in the cost's dtype): a member's
    :meth:`KernelPath.launch_small`. Returns the :class:`refdml.gpu.ot._small.SmallSolution`
    (arrays of ``xp``, ``phi``, ``psi`` and ``err`` in the input's dtype: nothing reaches
    the host).
    """
    from refdml.gpu.ot._compiled import (SmallLaunch, SmallPotentials, SmallProblems,
                                         SmallResults, SmallSettings)

    n_problems, n, m = cost.shape
    if max(n, m) > MAX_POINTS:
        raise ValueError(f"the small-problem kernel takes at most {MAX_POINTS} points, "
                         f"got {n} x {m}")
    dtype = cost.dtype
    problems = SmallProblems(
        cost=xp.ascontiguousarray(cost), a=xp.ascontiguousarray(a, dtype=xp.float64),
        b=xp.ascontiguousarray(b, dtype=xp.float64))
    potentials = SmallPotentials(phi_out=xp.zeros((n_problems, n), dtype=xp.float64),
                                 psi_out=xp.zeros((n_problems, m), dtype=xp.float64))
    results = SmallResults(plan=xp.empty((n_problems, n, m), dtype=dtype),
                           n_iter=xp.zeros(n_problems, dtype=xp.int64),
                           err=xp.full(n_problems, np.inf, dtype=xp.float64))
    settings = SmallSettings(
        schedule=xp.asarray(np.asarray(schedule, dtype=np.float64)),
        stage_tol=xp.asarray(np.asarray(stage_tol, dtype=np.float64)),
        max_iter=int(max_iter), symmetric=bool(symmetric), tiny=float(tiny), high=float(high),
        low=float(low))
    if n_problems:
        launch(SmallLaunch(problems=problems, potentials=potentials, settings=settings,
                           results=results))
    return SmallSolution(phi=potentials.phi_out.astype(dtype, copy=False),
                         psi=potentials.psi_out.astype(dtype, copy=False),
                         n_iter=results.n_iter, err=results.err.astype(dtype, copy=False),
                         plan=results.plan)


# --------------------------------------------------------------------------- the members
class KernelPath(ArrayPath):
    """What the compiled members share: the array path's interface (:class:`ArrayPath`)
    with the half step and the small-problem solver on this member's kernels.

    A member defines ``kind``, ``kernels`` (its :class:`SinkhornKernels`),
    :meth:`launch_small` and :meth:`launch_half_step`.
    """

    kernels: SinkhornKernels

    def lse_half_step(self, xp, scaled_cost, potential, log_weight, previous=None, out=None):
        r"""``f_i = -LSE_j(log_weight_j + potential_j - S_ij)`` (P, n) for ``S`` (P, n, m) by
        this member's kernel. ``previous`` and ``out`` are the array path's stabiliser and
        work buffer (same interface); a one-pass kernel needs neither.

        One pass over ``S`` with the online log-sum-exp
        (:func:`refdml.gpu._support.scalar.lse_push`: the running maximum is the stabiliser,
        so nothing overflows whatever ``S`` is), no (P, n, m) temporary. Accumulates in
        float64; the result has the input's dtype and module.
        """
        n_problems, n, _ = scaled_cost.shape
        result = xp.empty((n_problems, n), dtype=scaled_cost.dtype)
        if n_problems * n:
            weighted = (log_weight + potential).astype(scaled_cost.dtype, copy=False)
            self.launch_half_step(scaled_cost, weighted, result)
        return result

    def takes_small(self, n: int, m: int) -> bool:
        """Problems of at most :data:`MAX_POINTS` points per side (one CUDA thread per point)."""
        return max(n, m) <= MAX_POINTS

    def solve_small(self, xp, a, b, cost, **settings):
        """:func:`solve_small` (same arguments after ``xp``, same results) with this
        member's :meth:`launch_small`."""
        return solve_small(xp, self.launch_small, a, b, cost, **settings)

    def launch_small(self, launch: Any) -> None:
        """Run the small-problem kernel on the buffers of ``launch`` (a
        :class:`refdml.gpu.ot._compiled.SmallLaunch`)."""
        raise NotImplementedError

    def launch_half_step(self, scaled_cost, weighted_potential, out) -> None:
        """Fill ``out`` (P, n) with ``-LSE_j(w_j - S_ij)``."""
        raise NotImplementedError


class CpuPath(KernelPath):
    """The CPU twins (NumPy input): the small-problem solver, the half step and, for clouds
    the small-problem solver takes, the pair costs (:func:`compiled_pair_sq`)."""

    kind = "cpu"

    def __init__(self) -> None:
        from refdml.gpu.ot import _compiled

        self.kernels = SinkhornKernels(small_problem=_compiled.refdml_ot_sinkhorn_small_cpu,
                                       half_step=_compiled.refdml_ot_lse_half_step_cpu,
                                       pair_sq=_compiled.refdml_ot_pair_sq_cpu)

    def launch_small(self, launch: Any) -> None:
        """The CPU twin on the NumPy buffers of ``launch`` (allocated by :func:`solve_small`)."""
        cost, plan = launch.problems.cost, launch.results.plan
        if cost.dtype != np.float64:
            # One compiled signature (float64; halves the cold compile time): float32
            # problems are widened on the host and the plan rounded back.
            wide = np.empty(plan.shape)
            with parallel_launch():
                self.kernels.small_problem(*launch.arguments(cost=cost.astype(np.float64),
                                                             plan=wide))
            plan[...] = wide
        else:
            with parallel_launch():
                self.kernels.small_problem(*launch.arguments())

    def launch_half_step(self, scaled_cost, weighted_potential, out) -> None:
        """The half step's CPU twin, rows in a ``prange``."""
        with parallel_launch():
            self.kernels.half_step(scaled_cost, weighted_potential, out)

    def cross_sq(self, xp, clouds, first, second):
        """The pair costs by :func:`compiled_pair_sq` where the small-problem solver takes
        the clouds, else the array path's (:class:`ArrayPath`)."""
        n = clouds.shape[1]
        if not self.takes_small(n, n):
            return super().cross_sq(xp, clouds, first, second)
        return compiled_pair_sq(clouds, first, second, kernel=self.kernels.pair_sq)

    def self_sq(self, xp, clouds, selves):
        """As :meth:`cross_sq`, each cloud ``selves[s]`` with itself."""
        n = clouds.shape[1]
        if not self.takes_small(n, n):
            return super().self_sq(xp, clouds, selves)
        return compiled_pair_sq(clouds, selves, selves, kernel=self.kernels.pair_sq)


class CudaPath(KernelPath):
    """The CUDA kernels (CuPy input; NumPy under Numba's simulator): the small-problem
    solver and the half step; the pair costs are the array path's, on the device.

    Building it imports :mod:`refdml.gpu.ot._cuda` (and ``numba.cuda``):
    ``IMPLEMENTATIONS`` builds it on first use (``load_cuda``).
    """

    kind = "cuda"

    def __init__(self) -> None:
        from refdml.gpu.ot import _cuda

        self.kernels = SinkhornKernels(small_problem=_cuda.small_problem_kernel,
                                       half_step=_cuda.refdml_ot_lse_half_step)

    def launch_small(self, launch: Any) -> None:
        """One block per problem (:func:`threads_per_problem` threads), the plan flat
        (P, n m)."""
        n_problems, n, m = launch.problems.cost.shape
        kernel = self.kernels.small_problem(np.dtype(launch.problems.cost.dtype))
        cuda_launch(kernel, n_problems, threads_per_problem(n, m),
                    *launch.arguments(plan=launch.results.plan.reshape(n_problems, n * m)))

    def launch_half_step(self, scaled_cost, weighted_potential, out) -> None:
        """One thread per row, ``ceil(P n / BLOCK)`` blocks of BLOCK threads (under the
        simulator at most ``P n`` threads)."""
        rows = out.shape[0] * out.shape[1]
        threads = min(BLOCK, rows) if cuda_simulator() else BLOCK
        cuda_launch(self.kernels.half_step, -(-rows // threads), threads, scaled_cost,
                    weighted_potential, out)


# --------------------------------------------------------------------------- launches
def threads_per_problem(n: int, m: int) -> int:
    """Threads of one block of the small-problem kernel: a warp multiple covering every
    point, at most ``BLOCK``.

    Under Numba's CUDA simulator (every thread a Python thread, warps meaningless) exactly
    ``max(n, m)`` threads, which keeps CI's simulated runs short.
    """
    if cuda_simulator():
        return max(n, m)
    return min(BLOCK, 32 * -(-max(n, m) // 32))


def compiled_pair_sq(clouds, first, second, refine=_REFINE, *, kernel=None):
    """``||x_i - y_j||^2`` (K, n, n) of the clouds of pairs (``first[k]``, ``second[k]``) on
    the CPU: one compiled pass, a BLAS GEMM per pair inside it
    (:func:`refdml.gpu.ot._compiled.refdml_ot_pair_sq_cpu`; the array path gathers, then
    makes several passes). A pair of a cloud with itself gets the symmetric self costs (0
    diagonal). ``refine``: the near-pair refinement threshold, by default the reference's
    (``refdml._numerics._REFINE``: at p = 1 the gradient ``(x - y) / |x - y|`` of two points
    2e-4 apart carries the squared distance's relative rounding, 1e-8 unrefined;
    tests/gpu/test_gpu_ot_pairwise_route.py), negative for none. Clouds scaled to ``|x| < 1``.

    Threads: BLAS is held at one thread for the call; the pairs are spread over Numba's
    threads. A multi-threaded BLAS call here (one syrk of all points) is faster by itself
    but leaves OpenBLAS's threads spinning while the solver's ``prange`` runs, which slows
    the solve down badly on a machine with few cores (docs/gpu/kernels.md). ``kernel``: the
    compiled pass, by default :func:`~refdml.gpu.ot._compiled.refdml_ot_pair_sq_cpu`."""
    from threadpoolctl import threadpool_limits

    if kernel is None:
        from refdml.gpu.ot import _compiled

        kernel = _compiled.refdml_ot_pair_sq_cpu

    points = np.ascontiguousarray(clouds)
    n = points.shape[1]
    norms = np.einsum("bnd,bnd->bn", points, points)
    out = np.empty((first.shape[0], n, n), dtype=points.dtype)
    with parallel_launch(), threadpool_limits(limits=1, user_api="blas"):
        kernel(points, norms, np.asarray(first, dtype=np.int64),
               np.asarray(second, dtype=np.int64), float(refine), out)
    return out


# --------------------------------------------------------------------------- the family
#: The OT family's implementations and the one object that chooses among them
#: (``impl = IMPLEMENTATIONS.choose(x)`` once per public call of refdml.gpu.ot); registered
#: in :data:`refdml.gpu.families.KERNEL_FAMILIES`.
IMPLEMENTATIONS = Implementations(
    family="ot", array=ArrayPath(), load_cpu=CpuPath, load_cuda=CudaPath,
    auto_numpy="cpu", auto_cupy="cuda",
    measured=("NumPy: docs/gpu/kernels.md, 'Numba kernels: small-problem Sinkhorn and the "
              "log-sum-exp half step' (python scripts/bench_ot_pairs.py: the CPU twins' "
              "all-pairs route against the array path); CuPy: docs/results/gpu.md, the "
              "'sinkhorn' row (python scripts/bench_gpu.py --device cuda --only sinkhorn: the "
              "CUDA kernels against POT; the CuPy array path is not timed there, so 'auto' "
              "keeps the kernels until a GPU run times it)"),
)
