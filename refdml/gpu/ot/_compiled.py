r"""Small-problem Sinkhorn, compiled CPU twin: one OT problem of at most 128 x 128 points.

The compiled CPU twin (:func:`refdml_ot_sinkhorn_small_cpu`, ``prange`` over problems) of
refdml.gpu's ``@cuda.jit`` kernel ``refdml_ot_sinkhorn_small`` (:mod:`refdml.gpu.ot._cuda`, one
block per problem) runs the solver of :func:`refdml.ot._sinkhorn._stage` (the reference's
kernel-scaling iteration, also refdml.gpu's array path ``_stage_scaling``) for every problem
of a batch, every eps-scaling stage and every iteration without leaving the kernel. Both
call the scalar functions below (one source of truth), so they take the same steps in the
same order. refdml.gpu's all-pairs divergence and Wasserstein losses run it (the family's
:class:`refdml.gpu.ot._kernels.CpuPath`, through
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

Also here: the named buffers of a launch (:class:`SmallLaunch`: four small frozen
dataclasses whose fields, in order, are the kernels' parameters), the pair-cost pass of the
CPU route (:func:`refdml_ot_pair_sq_cpu`) and the CPU twin of the log-sum-exp half step
(:func:`refdml_ot_lse_half_step_cpu`). Their launches, the driver of a batch and the
family's compiled members are :mod:`refdml.gpu.ot._kernels`'.

Words: ``kernel`` is the Gibbs kernel ``K`` (as in :mod:`refdml.ot`); a schedule's
``level`` is an ``eps`` (a temperature, in the units of the cost).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from refdml.gpu._support.jit import njit, prange

from refdml.gpu._support.scalar import lse_push, lse_value
from refdml.gpu.ot._small import MAX_POINTS

__all__ = ["MAX_POINTS", "SmallLaunch", "SmallPotentials", "SmallProblems", "SmallResults",
           "SmallSettings", "refdml_ot_lse_half_step_cpu", "refdml_ot_pair_sq_cpu",
           "refdml_ot_sinkhorn_small_cpu"]

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


# --------------------------------------------------------------------------- buffers
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
