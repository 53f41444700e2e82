r"""Small-problem Sinkhorn, compiled CPU twin: one OT problem of at most 128 x 128 points.

The compiled CPU twin (:func:`refdml_ot_sinkhorn_small_cpu`, ``prange`` over problems) of
refdml.gpu's ``@cuda.jit`` kernel ``refdml_ot_sinkhorn_small`` (:mod:`refdml.gpu.ot._cuda`, one
block per problem) runs the solver of :func:`refdml.ot._sinkhorn._stage` (the reference's
kernel-scaling iteration, also refdml.gpu's array path ``_stage_scaling``) for every problem
of a batch, every eps-scaling stage and every iteration without leaving the kernel. Both
call the scalar functions below (one source of truth), so they take the same steps in the
same order. The reference's all-pairs divergence runs it by default
(:func:`refdml.ot.pairwise_sinkhorn_divergence_forward`, through
:func:`refdml.gpu.ot._small.solve_small_batch`).

The iteration (docs/ot.md Sec. 2). Potentials ``phi``, ``psi`` in units of the current
``eps`` level, ``S = C / level``. An *absorption* folds the scalings into the potentials
and rebuilds the kernel with the columns exact::

    psi_j = -LSE_i(log a_i + phi_i - S_ij)                        (non-symmetric)
    K_ij  = a_i b_j exp(phi_i + psi_j - S_ij) = E_ij b_j / s_j    (E_ij = exp(z_ij - max_i z_ij))
    phi_i <- (phi_i + T(phi)_i) / 2,  T(phi)_i = -LSE_j(log a_j + phi_j - S_ij),
    K_ij  = a_i a_j exp(phi_i + phi_j - S_ij)                      (symmetric, OT(mu, mu))

(one exponential per entry for the non-symmetric rebuild: the column log-sum-exp keeps
its terms ``E_ij`` and scales them). Between absorptions the iterations run on scalings
``u``, ``v`` (plan ``u_i K_ij v_j``), two multiply-adds per entry::

    row = K v;  residual = sum_i |u_i row_i - a_i|;  stop if residual <= tol (or max_iter)
    u = a / max(row, tiny);  col = K^T u;  v = b / max(col, tiny)
    symmetric: u = sqrt(u a / max(row, tiny)), v = u

and a problem whose scaling leaves ``[e^-B, e^B]`` (or whose row / column mass falls
below ``tiny``) is absorbed again. The stopping rule, the residual and the iteration count
are those of the array path (so ``n_iter``, ``marginal_error`` and ``converged`` agree with
it, except where a residual lies within rounding of its threshold), the eps-scaling stages
too (intermediate stages stop at ``max(tol, 1e-3)``).
The kernel writes the plan ``u_i K_ij v_j`` (no further exponential) and the potentials
``phi + log u``, ``psi + log v``.

dtype: potentials, scalings, sums and the residual are float64 in both twins (float32
inputs accumulate in float64); the CUDA kernel stores ``K`` (and the plan) in the input's
dtype, the CPU twin in float64 (float32 problems are widened on the host: one compiled
signature, half the cold compile time) and rounds the plan back. ``B`` and ``tiny`` are
the array path's for the input dtype, so the float32
kernel flushes and absorbs where the float32 array path does.

The CPU twin uses ``fastmath`` reassociation/contraction (vectorised sums; no
``nnan``/``ninf``: the log-sum-exp handles ``-inf``): its sums differ from the CUDA
kernel's in the last bits only, and so do its sums on two CPU targets (vector width, FMA).
So do the residuals, and an iteration count (a test ``residual <= tol``) can differ
between two of them only where a residual lies within that rounding of its threshold:
tests/gpu/test_gpu_kernels_ot.py compares counts where a margin certifies them.

Also here: the driver of a batch (:func:`solve_small`: the arrays of the state, a launch,
the results; the CUDA kernel plugs in its own launch), the named buffers of a launch
(:class:`SmallLaunch`: four small frozen dataclasses whose fields, in order, are the
kernels' parameters), the interface of a compiled implementation of the family
(:class:`CompiledSinkhorn`, and :data:`CPU`, this module's instance; refdml.gpu's
``Implementations`` object chooses between it, the CUDA one and the array path) and the
pair-cost assembly of the CPU route (:func:`refdml_ot_pair_sq_cpu`, :func:`compiled_pair_sq`).

Words: ``kernel`` is the Gibbs kernel ``K`` (as in :mod:`refdml.ot`); a schedule's
``level`` is an ``eps`` (a temperature, in the units of the cost); the kind of
implementation (``"cpu"`` / ``"cuda"``) is a ``kind``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numba import njit, prange

from refdml.gpu._support.scalar import lse_push, lse_value
from refdml.gpu._support.launch import BLOCK
from refdml.gpu._support.threading_layer import parallel_launch
from refdml._numerics import _REFINE

__all__ = ["CPU", "MAX_POINTS", "CompiledSinkhorn", "SmallLaunch", "SmallPotentials",
           "SmallProblems", "SmallResults", "SmallSettings", "compiled_pair_sq",
           "launch_cpu", "launch_half_step_cpu", "refdml_ot_lse_half_step_cpu",
           "refdml_ot_pair_sq_cpu", "refdml_ot_sinkhorn_small_cpu", "solve_small",
           "solve_small_cpu"]

#: Largest problem (points per side) of the small-problem kernel: one CUDA thread per point.
MAX_POINTS = BLOCK
_FASTMATH = {"reassoc", "contract"}


# --------------------------------------------------------------------------- scalar maths
@njit(cache=True, inline="always")
def log_kernel_exponent(log_weight, potential, cost, inv_level):
    """``log w + potential - C / level``: one term of a half step's log-sum-exp."""
    return log_weight + potential - cost * inv_level


@njit(cache=True, inline="always")
def potential_from_lse(peak, total):
    """The potential ``-LSE = -(peak + log total)`` of a two-pass log-sum-exp."""
    return -(peak + math.log(total))


@njit(cache=True, inline="always")
def flush(value, tiny):
    """Kernel entries below the dtype's ``tiny`` are 0 (as the array path)."""
    return value if value >= tiny else 0.0


@njit(cache=True, inline="always")
def scaling_update(weight, mass, tiny):
    """``u = a / max(K v, tiny)``: the non-symmetric potential (scaling) update."""
    return weight / max(mass, tiny)


@njit(cache=True, inline="always")
def symmetric_scaling_update(scaling, weight, mass, tiny):
    """``u <- sqrt(u a / max(K u, tiny))``: the averaged update of OT(mu, mu)."""
    return math.sqrt(scaling * weight / max(mass, tiny))


@njit(cache=True, inline="always")
def residual_term(scaling, mass, weight):
    """``|u_i (K v)_i - a_i|``: one row's share of the L1 marginal error."""
    return abs(scaling * mass - weight)


@njit(cache=True, inline="always")
def needs_absorb(scaling, mass, tiny, high, low):
    """A scaling outside ``[low, high]`` or a mass below ``tiny``: rebuild the kernel."""
    return scaling > high or scaling < low or mass < tiny


@njit(cache=True, inline="always")
def symmetric_average(potential, lse):
    """``(phi + T(phi)) / 2`` with ``T(phi) = -lse``."""
    return 0.5 * (potential - lse)


# --------------------------------------------------------------------------- CPU twin
@njit(cache=True, fastmath=_FASTMATH)
def _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak, total):
    n, m = cost.shape
    for i in range(n):
        phi[i] += math.log(u[i])
    if symmetric:
        for i in range(n):
            mx, s = -math.inf, 0.0
            for j in range(n):
                mx, s = lse_push(mx, s, log_kernel_exponent(la[j], phi[j], cost[i, j], inv))
            total[i] = lse_value(mx, s)
        for i in range(n):
            phi[i] = symmetric_average(phi[i], total[i])
        for i in range(n):
            base = la[i] + phi[i]
            for j in range(n):
                kernel[i, j] = flush(math.exp(base + la[j] + phi[j] - cost[i, j] * inv), tiny)
            u[i] = 1.0
        return
    for j in range(m):
        peak[j] = -math.inf
        total[j] = 0.0
    for i in range(n):
        for j in range(m):
            peak[j] = max(peak[j], log_kernel_exponent(la[i], phi[i], cost[i, j], inv))
    for i in range(n):
        for j in range(m):
            e = math.exp(log_kernel_exponent(la[i], phi[i], cost[i, j], inv) - peak[j])
            kernel[i, j] = e
            total[j] += e
    for j in range(m):
        psi[j] = potential_from_lse(peak[j], total[j])
        total[j] = math.exp(lb[j]) / total[j]
        v[j] = 1.0
    for i in range(n):
        for j in range(m):
            kernel[i, j] = flush(kernel[i, j] * total[j], tiny)
        u[i] = 1.0


@njit(cache=True, fastmath=_FASTMATH)
def _cpu_problem(cost, a, b, phi, psi, schedule, stage_tol, max_iter, symmetric, tiny, high,
                 low, kernel):
    """One problem, every stage; returns ``(iterations, residual)``; ``kernel`` -> plan."""
    n, m = cost.shape
    la, lb = np.log(a), np.log(b)
    u, row = np.ones(n), np.empty(n)
    v, col = (u, row) if symmetric else (np.ones(m), np.empty(m))
    peak, total = np.empty(max(n, m)), np.empty(max(n, m))
    if symmetric:
        psi = phi
    n_iter, err = 0, math.inf
    previous = schedule[0]
    for k in range(schedule.shape[0]):
        level = schedule[k]
        inv = 1.0 / level
        for i in range(n):
            phi[i] *= previous / level
        if not symmetric:
            for j in range(m):
                psi[j] *= previous / level
        for i in range(n):
            u[i] = 1.0
        _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak, total)
        tol = stage_tol[k]
        for it in range(max_iter + 1):
            err = 0.0
            for i in range(n):
                r = 0.0
                for j in range(m):
                    r += kernel[i, j] * v[j]
                row[i] = r
            for i in range(n):                      # in row order, as the CUDA kernel
                err += residual_term(u[i], row[i], a[i])
            if err <= tol or it == max_iter:
                n_iter += it
                break
            bad = False
            if symmetric:
                for i in range(n):
                    u[i] = symmetric_scaling_update(u[i], a[i], row[i], tiny)
                    bad |= needs_absorb(u[i], row[i], tiny, high, low)
            else:
                for i in range(n):
                    u[i] = scaling_update(a[i], row[i], tiny)
                    bad |= needs_absorb(u[i], row[i], tiny, high, low)
                for j in range(m):
                    col[j] = 0.0
                for i in range(n):
                    for j in range(m):
                        col[j] += kernel[i, j] * u[i]
                for j in range(m):
                    v[j] = scaling_update(b[j], col[j], tiny)
                    bad |= needs_absorb(v[j], col[j], tiny, high, low)
            if bad:
                _cpu_absorb(cost, la, lb, phi, psi, u, v, kernel, inv, tiny, symmetric, peak,
                            total)
        # fold the scalings in: the stage's potentials, and (last stage) the plan
        for i in range(n):
            for j in range(m):
                kernel[i, j] *= u[i] * v[j]
        for i in range(n):
            phi[i] += math.log(u[i])
        if not symmetric:
            for j in range(m):
                psi[j] += math.log(v[j])
        previous = level
    return n_iter, err


@njit(parallel=True, cache=True)
def refdml_ot_sinkhorn_small_cpu(cost, a, b, phi_out, psi_out, schedule, stage_tol, max_iter,
                                 symmetric, tiny, high, low, plan, n_iter, err):
    """CPU twin: every problem of ``cost`` (P, n, m) in a ``prange`` (see the module doc).

    The parameters are the CUDA kernel's, in its order (:class:`SmallLaunch`). In/out:
    ``phi_out`` (P, n), ``psi_out`` (P, m) float64 (start -> solution, units of the last
    ``eps``); out: ``plan`` (P, n, m) (float64 here), ``n_iter`` (P,) int64, ``err`` (P,).
    """
    for p in prange(cost.shape[0]):
        it, e = _cpu_problem(cost[p], a[p], b[p], phi_out[p], psi_out[p], schedule, stage_tol,
                             max_iter, symmetric, tiny, high, low, plan[p])
        n_iter[p] = it
        err[p] = e
        if symmetric:
            psi_out[p, :] = phi_out[p, :]


# --------------------------------------------------------------------------- driver
# The named buffers of one launch of the small-problem solver. The kernels take their
# arguments flat (Numba types each array once, and the compile check and the simulator's
# launch check read the flat signature); these four parts, concatenated field by field, are
# that list in its order, so a launch states what each buffer is.
@dataclass(frozen=True)
class SmallProblems:
    """The problems: ``cost`` (P, n, m) C-contiguous, in the input's dtype; ``a`` (P, n) and
    ``b`` (P, m) float64 on the simplex."""

    cost: Any
    a: Any
    b: Any


@dataclass(frozen=True)
class SmallPotentials:
    """In: the start (zeros); out: the solution. ``phi_out`` (P, n), ``psi_out`` (P, m)
    float64, in units of the last eps level."""

    phi_out: Any
    psi_out: Any


@dataclass(frozen=True)
class SmallSettings:
    """``schedule`` (S,) float64: the eps levels (temperatures, the last one ``eps``);
    ``stage_tol`` (S,) float64: each level's tolerance; ``max_iter`` per level;
    ``symmetric``: OT(mu, mu) (``a == b``, the averaged update); ``tiny``: the dtype's
    smallest normal (kernel entries below it are 0, masses below it absorb); ``high``,
    ``low``: the absorption bounds ``e^B``, ``e^-B`` of the scalings."""

    schedule: Any
    stage_tol: Any
    max_iter: int
    symmetric: bool
    tiny: float
    high: float
    low: float


@dataclass(frozen=True)
class SmallResults:
    """Out: ``plan`` (P, n, m) in the input's dtype (the CUDA launch passes it flat,
    (P, n m)); ``n_iter`` (P,) int64, iterations summed over the levels; ``err`` (P,)
    float64, the last L1 marginal error."""

    plan: Any
    n_iter: Any
    err: Any


_PARTS = (SmallProblems, SmallPotentials, SmallSettings, SmallResults)


@dataclass(frozen=True)
class SmallLaunch:
    """Every buffer and setting of one launch of the small-problem solver, by name."""

    problems: SmallProblems
    potentials: SmallPotentials
    settings: SmallSettings
    results: SmallResults

    @staticmethod
    def parameters() -> tuple[str, ...]:
        """The kernels' parameter names, in order: the parts' fields concatenated."""
        return tuple(field.name for part in _PARTS for field in fields(part))

    def arguments(self, **replaced: Any) -> tuple:
        """The kernels' arguments in :meth:`parameters` order; ``replaced``: buffers that
        the launch passes in another form (``plan=`` flat, or widened)."""
        unknown = set(replaced) - set(self.parameters())
        if unknown:
            raise ValueError(f"replaced == {sorted(unknown)!r}, must be among the parameters "
                             f"{self.parameters()}")
        values = {field.name: getattr(part, field.name)
                  for part in (self.problems, self.potentials, self.settings, self.results)
                  for field in fields(part)}
        values.update(replaced)
        return tuple(values[name] for name in self.parameters())


def launch_cpu(launch: SmallLaunch) -> None:
    """Run :func:`refdml_ot_sinkhorn_small_cpu` on the NumPy buffers of ``launch`` (allocated
    by :func:`solve_small`)."""
    cost, plan = launch.problems.cost, launch.results.plan
    if cost.dtype != np.float64:
        # One compiled signature (float64; halves the cold compile time): float32
        # problems are widened on the host and the plan rounded back.
        wide = np.empty(plan.shape)
        with parallel_launch():
            refdml_ot_sinkhorn_small_cpu(*launch.arguments(cost=cost.astype(np.float64),
                                                           plan=wide))
        plan[...] = wide
    else:
        with parallel_launch():
            refdml_ot_sinkhorn_small_cpu(*launch.arguments())


def solve_small(xp, launch, a, b, cost, *, schedule, stage_tol, max_iter, symmetric, tiny,
                high, low):
    """Solve P problems of at most :data:`MAX_POINTS` points per side with ``launch``.

    ``a`` (P, n), ``b`` (P, m) on the simplex, ``cost`` (P, n, m) (arrays of ``xp``);
    ``schedule`` / ``stage_tol`` the eps levels and their tolerances. ``launch`` (a
    :class:`SmallLaunch` -> None) runs the problems on the buffers allocated here (float64
    state, ``plan`` (P, n, m) in the cost's dtype): :func:`launch_cpu`, or the CUDA launch
    of :mod:`refdml.gpu.ot._cuda`. Returns ``phi``, ``psi`` (input dtype, units
    of the last level), ``n_iter`` (int64), ``err`` and the plan, all arrays of ``xp``
    (nothing reaches the host).
    """
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
        launch(SmallLaunch(problems, potentials, settings, results))
    return (potentials.phi_out.astype(dtype, copy=False),
            potentials.psi_out.astype(dtype, copy=False), results.n_iter,
            results.err.astype(dtype, copy=False), results.plan)


def solve_small_cpu(a, b, cost, **settings):
    """:func:`solve_small` on NumPy arrays with the CPU twin (keywords as there); the
    reference's compiled route runs this."""
    return solve_small(np, launch_cpu, a, b, cost, **settings)


# --------------------------------------------------------------------------- the interface
@dataclass(frozen=True)
class CompiledSinkhorn:
    """One compiled implementation of the Sinkhorn family (the CPU twins, :data:`CPU`, or
    the CUDA kernels, ``refdml.gpu.ot._cuda.CUDA``): the interface that
    refdml.gpu's batched solver calls on whichever implementation its ``Implementations``
    object chose, the array path included (``refdml.gpu.ot._sinkhorn``).

    ``kind``: ``"cpu"`` or ``"cuda"``. ``launch_small``: runs a :class:`SmallLaunch`.
    ``launch_half_step(scaled_cost, weighted_potential, out)``: fills ``out`` (P, n) with
    ``-LSE_j(w_j - S_ij)``. ``pair_sq(clouds, first, second)``: the pair costs of the
    all-pairs route where this implementation computes them (:func:`compiled_pair_sq` on
    the CPU), else None (the array path's).
    """

    kind: str
    launch_small: Callable[[SmallLaunch], None]
    launch_half_step: Callable[[Any, Any, Any], None]
    pair_sq: Callable[..., Any] | None = None

    def solve_small(self, xp, a, b, cost, **settings):
        """:func:`solve_small` (same arguments after ``xp``, same results) with this
        implementation's launch."""
        return solve_small(xp, self.launch_small, a, b, cost, **settings)

    def lse_half_step(self, xp, scaled_cost, potential, log_weight, previous=None, out=None):
        r"""``f_i = -LSE_j(log_weight_j + potential_j - S_ij)`` (P, n) for ``S`` (P, n, m):
        the log-sum-exp half step of refdml.gpu's batched Sinkhorn, by this
        implementation's kernel. ``previous`` and ``out`` are the array path's stabiliser
        and work buffer (same interface); a one-pass kernel needs neither.

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


def launch_half_step_cpu(scaled_cost, weighted_potential, out) -> None:
    """The half step's CPU launch: :func:`refdml_ot_lse_half_step_cpu`, rows in a prange."""
    with parallel_launch():
        refdml_ot_lse_half_step_cpu(scaled_cost, weighted_potential, out)


# --------------------------------------------------------------------------- pair costs
@njit(parallel=True, cache=True)
def refdml_ot_pair_sq_cpu(points, norms, first, second, refine, out):
    """``out[k, i, j] = max(|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>, 0)``, x = cloud ``first[k]``,
    y = cloud ``second[k]`` of ``points`` (B, n, d), ``norms`` (B, n) their squared norms.

    One ``prange`` over pairs; each pair's (n, n) Gram block is one ``np.dot`` (a
    single-threaded BLAS GEMM: the caller holds BLAS at one thread, so Numba's threads are
    the only ones) and is turned into costs while it is in cache: no Gram matrix of all
    points, no gathered copies, and no BLAS thread pool left spinning against the solver's
    threads. Entries ``<= refine (|x_i|^2 + |y_j|^2)`` are recomputed from the explicit
    difference (the reference's refinement, refdml._numerics; ``refine < 0``: never). A
    pair ``first[k] == second[k]`` is a cloud with itself: 0 on the diagonal and the mean of
    the two triangles, as the reference's ``_self_sq_dist`` (exactly symmetric).
    """
    n, d = points.shape[1], points.shape[2]
    for k in prange(first.shape[0]):
        f, s = first[k], second[k]
        gram = np.dot(points[f], points[s].T)
        for i in range(n):
            for j in range(n):
                magnitude = norms[f, i] + norms[s, j]
                value = magnitude - 2.0 * gram[i, j]
                if value <= refine * magnitude:
                    value = 0.0
                    for c in range(d):
                        diff = points[f, i, c] - points[s, j, c]
                        value += diff * diff
                out[k, i, j] = max(value, 0.0)
        if f == s:
            for i in range(n):
                out[k, i, i] = 0.0
                for j in range(i + 1, n):
                    mean = 0.5 * (out[k, i, j] + out[k, j, i])
                    out[k, i, j] = mean
                    out[k, j, i] = mean


def compiled_pair_sq(clouds, first, second, refine=_REFINE):
    """``||x_i - y_j||^2`` (K, n, n) of the clouds of pairs (``first[k]``, ``second[k]``) on
    the CPU: one compiled pass, a BLAS GEMM per pair inside it
    (:func:`refdml_ot_pair_sq_cpu`; refdml.gpu's array path gathers, then makes four
    passes). A pair of a cloud with itself gets the symmetric self costs (0 diagonal).
    ``refine``: the near-pair refinement threshold, by default the reference's
    (``refdml._numerics._REFINE``: at p = 1 the gradient ``(x - y) / |x - y|`` of two points
    2e-4 apart carries the squared distance's relative rounding, 1e-8 unrefined;
    tests/gpu/test_gpu_ot_pairwise_route.py), negative for none. Clouds scaled to ``|x| < 1``.

    Threads: BLAS is held at one thread for the call; the pairs are spread over Numba's
    threads. A multi-threaded BLAS call here (one syrk of all points) is faster by itself
    but leaves OpenBLAS's threads spinning while the solver's ``prange`` runs, which slows
    the solve down badly on a machine with few cores (docs/gpu.md)."""
    from threadpoolctl import threadpool_limits

    points = np.ascontiguousarray(clouds)
    n = points.shape[1]
    norms = np.einsum("bnd,bnd->bn", points, points)
    out = np.empty((first.shape[0], n, n), dtype=points.dtype)
    with parallel_launch(), threadpool_limits(limits=1, user_api="blas"):
        refdml_ot_pair_sq_cpu(points, norms, np.asarray(first, dtype=np.int64),
                              np.asarray(second, dtype=np.int64), float(refine), out)
    return out


# --------------------------------------------------------------------------- LSE half step
@njit(parallel=True, cache=True)
def refdml_ot_lse_half_step_cpu(scaled_cost, weighted_potential, out):
    """CPU twin of the half step: ``out[p, i] = -LSE_j(w[p, j] - S[p, i, j])``, rows in a prange."""
    n_problems, n, m = scaled_cost.shape
    for r in prange(n_problems * n):
        p, i = r // n, r % n
        mx, s = -math.inf, 0.0
        for j in range(m):
            mx, s = lse_push(mx, s, weighted_potential[p, j] - scaled_cost[p, i, j])
        out[p, i] = -lse_value(mx, s)


#: The CPU twins of the family, as one implementation (:class:`CompiledSinkhorn`).
CPU = CompiledSinkhorn(kind="cpu", launch_small=launch_cpu, launch_half_step=launch_half_step_cpu,
                       pair_sq=compiled_pair_sq)
