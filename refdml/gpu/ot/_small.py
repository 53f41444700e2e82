"""Many small OT problems through the compiled small-problem Sinkhorn: the one driver.

Problems of at most :data:`MAX_POINTS` (128) points per side can
run the small-problem kernel, which takes the reference's kernel-scaling iteration
(:func:`refdml.ot._sinkhorn._stage`) with every eps-scaling stage inside the kernel.
refdml.gpu's batched solver (``solve_batch(..., small_kernels=True)``, the CPU twin or the
``@cuda.jit`` kernel, NumPy or CuPy) calls :func:`solve_small_batch`, which turns the
solver's arguments into the kernel's (stage tolerances, absorption bounds, the dtype's
``tiny``) and its results into the reference's batch type
(:class:`refdml._shared.ot.OTBatch`, by :func:`finish_batch`, with the reference's
ConvergenceWarning); the kernel is passed in.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._shared.ot import STAGE_TOL, OTBatch
from refdml.exceptions import ConvergenceWarning
from refdml.gpu._support.launch import BLOCK

__all__ = ["MAX_POINTS", "SmallSolution", "finish_batch", "solve_small_batch"]

#: Largest problem (points per side) of the small-problem kernel: one CUDA thread per point.
MAX_POINTS = BLOCK


@dataclass(frozen=True)
class SmallSolution:
    """What the small-problem kernel returns for P problems, arrays of the input's module:
    ``phi`` (P, n), ``psi`` (P, m) the potentials in units of the last eps level, in the
    input's dtype; ``n_iter`` (P,) int64, iterations summed over the levels; ``err`` (P,)
    the last L1 marginal error; ``plan`` (P, n, m)."""

    phi: Any
    psi: Any
    n_iter: Any
    err: Any
    plan: Any


def solve_small_batch(xp, a, b, cost, *, schedule, eps, max_iter, tol, symmetric, unit,
                      absorb, warn_stacklevel, solve_small) -> OTBatch:
    """P problems (``a`` (P, n), ``b`` (P, m) on the simplex, ``cost`` (P, n, m) in units of
    ``unit``, arrays of ``xp``) by the small-problem kernel, at the eps levels ``schedule``
    (the last is ``eps``); intermediate stages stop at ``max(tol, 1e-3)`` (the reference's
    ``_STAGE_TOL``).

    ``absorb``: scalings leaving ``[e^-absorb, e^absorb]`` are folded into the potentials
    (the reference: 30 in float64). ``solve_small(a, b, cost, *, schedule, stage_tol,
    max_iter, symmetric, tiny, high, low)`` runs the problems and returns their
    :class:`SmallSolution` (as :func:`refdml.gpu.ot._kernels.solve_small`).
    ``warn_stacklevel``: the ConvergenceWarning's stack level as seen from this function.
    """
    dtype = cost.dtype
    # Every comparison err <= tol casts tol to the dtype (1e300 overflows float32); a finite
    # err (the L1 marginal error, at most 2) is <= either bound.
    tol = min(tol, float(np.finfo(dtype).max))
    stage_tol = [max(tol, STAGE_TOL)] * (len(schedule) - 1) + [tol]
    high = float(np.exp(absorb))
    solution = solve_small(
        a, b, cost, schedule=schedule, stage_tol=stage_tol, max_iter=max_iter,
        symmetric=symmetric, tiny=float(np.finfo(dtype).tiny), high=high, low=1.0 / high,
    )
    return finish_batch(xp, a, b, cost, eps, solution.phi, solution.psi, solution.plan,
                        solution.n_iter, solution.err, tol, max_iter, unit, warn_stacklevel + 1)


def finish_batch(xp, a, b, cost, eps, phi, psi, plan, n_iter, err, tol, max_iter, unit,
                 warn_stacklevel) -> OTBatch:
    """The batch of a solve from potentials ``phi``, ``psi`` in units of ``eps``: ``converged``,
    the ConvergenceWarning (none when ``tol = 0``, as the reference), ``f = eps phi``,
    ``g = eps psi``. ``warn_stacklevel``: the warning's stack level as seen from here."""
    n_problems = cost.shape[0]
    converged = err <= tol
    # tol = 0: a fixed number of iterations, no warning (as the reference).
    if tol > 0.0:
        n_bad = int(xp.count_nonzero(~converged))       # one synchronisation on CuPy
        if n_bad:
            warnings.warn(
                f"Sinkhorn stopped at max_iter={max_iter} iterations above tol={tol:g} for "
                f"{n_bad} of {n_problems} problem(s) (largest marginal error "
                f"{float(xp.max(err)):.3g}); increase max_iter, eps, or use eps_scaling",
                ConvergenceWarning,
                stacklevel=warn_stacklevel,
            )
    return OTBatch(a=a, b=b, cost=cost, eps=eps, f=eps * phi, g=eps * psi, plan=plan,
                   n_iter=n_iter, marginal_error=err, converged=converged, unit=unit)
