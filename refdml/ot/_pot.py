"""Entropic OT potentials from POT's log-domain Sinkhorn (``solver="pot"``).

:func:`_solve_batch_pot` is a drop-in for :func:`refdml.ot._sinkhorn._solve_batch`: the
same arguments (weights on the simplex, the cost and ``eps`` in units of ``unit``) and the
same :class:`~refdml.ot._sinkhorn._OTBatch`, so that the value, the transport cost and the
hand-derived backward (:func:`refdml.ot._entropic._ot_vjp`) are formed from POT's
potentials exactly as from refdml's own.

POT's conventions (``ot.bregman.sinkhorn_log``, POT 0.9): ``reg`` is refdml's ``eps``; it
iterates on ``log_u``, ``log_v`` with the plan ``exp(-C / reg + log_u_i + log_v_j)``, so
refdml's potentials are ``f = eps (log_u - log a)``, ``g = eps (log_v - log b)`` (plan
``a_i b_j exp((f_i + g_j - C_ij) / eps)``). One iteration is a ``log_v`` then a ``log_u``
update, both exact log-sum-exps, so the rows of the returned plan are exact and its
columns carry the error. Every 10th iteration (0, 10, 20, ...) it compares the L2 norm of
the column marginal's error with ``stopThr`` and stops strictly below it; at
``numItermax`` it stops where it is (and warns with a ``UserWarning`` unless
``warn=False``). Its ``log["niter"]`` is the index of the last iteration, one less than
the count. ``warmstart=(log_u, log_v)`` starts it elsewhere (only ``log_u`` matters: the
first update overwrites ``log_v``).

What refdml adds around it: the stopping threshold ``tol / sqrt(m)`` on POT's L2 norm,
which implies refdml's rule (L1 marginal error ``<= tol``, since ``L1 <= sqrt(m) L2``);
the residual, ``converged`` and the :class:`refdml.ConvergenceWarning` of the own solver
(POT's own warning is switched off); the start ``f = 0`` of the own solver; and
``eps_scaling`` as a schedule of calls, each warm-started at the previous stage's
potentials; and, POT having no symmetric update, the symmetrisation of the result of an
``OT(mu, mu)`` (:func:`_symmetrised`). docs/ot.md, "Which solver", measures what the
alternating iteration costs on those self terms.
"""

from __future__ import annotations

import numpy as np

from refdml.ot._sinkhorn import _STAGE_TOL, _eps_schedule, _OTBatch, _warn_unconverged


def _pot_stage(sinkhorn_log, a, b, log_a, log_b, cost, eps, f, *, tol, max_iter):
    """One call of POT's ``sinkhorn_log`` at ``eps`` for one problem, started at ``f``.

    Returns ``(f, g, plan, n_iter, residual)``: the potentials in refdml's convention,
    POT's plan, the iterations run and the L1 error of the column marginal.
    """
    m = cost.shape[1]
    # POT also returns exp(log_u) and exp(log_v), which overflow at small eps; we use
    # neither (the plan's rows sum to a after the last update: it cannot overflow).
    with np.errstate(over="ignore"):
        plan, log = sinkhorn_log(
            a, b, cost, eps, numItermax=max_iter, stopThr=tol / np.sqrt(m), log=True,
            warn=False, warmstart=(f / eps + log_a, np.zeros(m)),
        )
    f = eps * (log["log_u"] - log_a)
    g = eps * (log["log_v"] - log_b)
    residual = float(np.abs(plan.sum(axis=0) - b).sum())
    return f, g, plan, int(log["niter"]) + 1, residual


def _symmetrised(log_a, a, cost, eps, f, g):
    """The pair ``(h, h)``, ``h = (f + g) / 2``, of a symmetric problem (``b = a``,
    ``C = C^T``), its plan and the L1 error of its row marginal (= the column's).

    Why: swapping ``f`` and ``g`` maps a dual solution of a symmetric problem to one, and
    the dual is concave, so ``(h, h)`` is a solution too and never a worse iterate
    (``D(h, h) >= D(f, g)``): where POT's alternating iteration stalls on a nearly
    diagonal self plan, ``h`` halves its marginal error (it does not remove the stall,
    docs/ot.md). The reason it is done: the plan ``a_i a_j exp((h_i + h_j - C_ij) / eps)``
    is symmetric to the last bit, which the transport cost's implicit gradient needs where
    the plan decouples. The Schur complement of
    :func:`refdml.ot._entropic._transport_cost_vjp` is then ~0, and POT's asymmetry of
    ~1e-38 gave per-slot weight gradients of ~1e19 (refdml's symmetric update has none).
    """
    h = 0.5 * (f + g)
    plan = np.exp(log_a[:, None] + log_a[None, :] + (h[:, None] + h[None, :] - cost) / eps)
    return h, h.copy(), plan, float(np.abs(plan.sum(axis=1) - a).sum())


def _solve_batch_pot(a, b, cost, *, eps, max_iter, tol, eps_scaling, symmetric=False,
                     unit=1.0) -> _OTBatch:
    """:func:`refdml.ot._sinkhorn._solve_batch` by POT's ``ot.bregman.sinkhorn_log``.

    ``a`` (P, n), ``b`` (P, m) on the simplex, ``cost`` (P, n, m) and ``eps`` in units of
    ``unit``. ``symmetric=True`` promises ``b = a`` and ``C = C^T``: POT has no symmetric
    update, so the problem is solved by its alternating iteration and the result
    symmetrised (:func:`_symmetrised`).
    ``n_iter`` counts POT's iterations over all stages; ``marginal_error`` is the L1 error
    of the column marginal at the end (the rows are exact), of either marginal of the
    symmetrised plan for a symmetric problem.
    """
    # POT takes ~2 s to import: only a call that asks for it pays.
    from ot.bregman import sinkhorn_log

    n_problems, n, m = cost.shape
    f_out = np.empty((n_problems, n))
    g_out = np.empty((n_problems, m))
    plan_out = np.empty_like(cost)
    n_iter = np.zeros(n_problems, dtype=np.int64)
    err = np.empty(n_problems)
    with np.errstate(divide="ignore"):  # a weight below 2^-1074 after normalising
        log_a, log_b = np.log(a), np.log(b)
    schedule = _eps_schedule(cost, eps, eps_scaling)
    for k in range(n_problems):
        f = np.zeros(n)
        for level in schedule[:-1]:
            f, _, _, it, _ = _pot_stage(sinkhorn_log, a[k], b[k], log_a[k], log_b[k], cost[k],
                                        level, f, tol=max(tol, _STAGE_TOL), max_iter=max_iter)
            n_iter[k] += it
        f_out[k], g_out[k], plan_out[k], it, err[k] = _pot_stage(
            sinkhorn_log, a[k], b[k], log_a[k], log_b[k], cost[k], eps, f, tol=tol,
            max_iter=max_iter)
        n_iter[k] += it
        if symmetric:
            f_out[k], g_out[k], plan_out[k], err[k] = _symmetrised(log_a[k], a[k], cost[k],
                                                                   eps, f_out[k], g_out[k])
    converged = err <= tol
    _warn_unconverged(err, converged, max_iter=max_iter, tol=tol, stacklevel=4)
    return _OTBatch(a, b, cost, eps, f_out, g_out, plan_out, n_iter, err, converged, unit)
