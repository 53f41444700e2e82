"""Entropic optimal transport, Sinkhorn divergences and the Wasserstein DML losses.

Wasserstein DML (Dou, Luo & Yang, AAAI 2022 student abstract), Eqs. (1)-(4).

Entropic OT, Eq. (3)
--------------------
For weights ``a`` (n,), ``b`` (m,) on the simplex and a cost ``C`` (n, m)::

    OT_eps(a, b) = min_{pi in Pi(a, b)}  <pi, C> + eps KL(pi | a (x) b)

with ``KL(pi | a (x) b) = sum_ij pi_ij log(pi_ij / (a_i b_j))``. The optimal plan is
``pi_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` for dual potentials ``f``, ``g``, and
``OT_eps = <a, f> + <b, g>``. The potentials are unique only up to ``(f + t, g - t)``.

Printed vs implemented: the paper writes ``W^p_{p,eta} = arg min ...``; the ``arg min`` is
the plan, the quantity used is the *minimum*, which is what :func:`entropic_ot_forward`
returns (``value="regularized"``). Eq. (3) defines the p-th power ``W^p`` (cost
``||x - y||^p``) while Eq. (4) subtracts ``W_{p,eta}`` without the power; taking a p-th
root of each term would break the positivity of the divergence (Feydy et al., 2019), so
Eq. (4) is implemented with the value of Eq. (3) itself, cost ``||x - y||^p``.
POT's ``ot.sinkhorn`` penalises ``reg * sum pi (log pi - 1)`` instead of the KL to
``a (x) b``: the difference is constant on ``Pi(a, b)``, so the plans agree and the values
differ; ``ot.sinkhorn2`` returns ``<pi, C>`` alone (our ``transport_cost``).

Sinkhorn divergence, Eq. (4)
----------------------------
``SD(mu, nu) = OT(mu, nu) - (OT(mu, mu) + OT(nu, nu)) / 2`` with ``OT`` either the
regularised value (the paper's; >= 0 and 0 iff mu == nu for the costs ``||x - y||^p``,
p in {1, 2}, Feydy et al. 2019) or the transport cost ``<pi, C>`` alone
(``value="transport"``; what POT's ``empirical_sinkhorn_divergence`` computes, before it
clips at 0: it is *not* >= 0 in general, see docs/ot.md).

Gradients (no autodiff; derivations in docs/ot.md)
---------------------------------------------------
* regularised value: envelope theorem, ``dOT/dC = pi`` and ``dOT/da = f`` on the simplex.
* transport cost: implicit differentiation of the Sinkhorn fixed point. With
  ``u = rowsum(pi * C)``, ``v = colsum(pi * C)`` and ``[w; z]`` a solution of
  ``[[diag a, pi], [pi^T, diag b]] [w; z] = [u; v]`` (singular along ``(1, -1)``; solved
  by a pseudo-inverse of its Schur complement), ``d<pi,C>/dC_ij = pi_ij (1 + (w_i + z_j - C_ij)/eps)``
  and ``d<pi,C>/da = w``.
* weights: ``a`` and ``b`` are normalised to sum 1 inside (any positive weights are
  accepted), so the value is a function of ``a / sum(a)`` and its gradient is unique:
  ``(f - <f, a/|a|>) / |a|``. Off the simplex the transport problem is infeasible, which is
  why ``f`` itself cannot be the finite-difference gradient of anything.

The gradients are exact at the fixed point; with the L1 marginal error below ``tol`` they
are accurate to about ``tol`` relative.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from refdml._validation import (
    as_float_array,
    as_label_array,
    check_choice,
    check_scalar,
)
from refdml.distances import _pairwise_norm, _sum_to_shape
from refdml.exceptions import ConvergenceWarning
from refdml.gradcheck.registry import OperatorSpec, register

__all__ = [
    "EntropicOTContext",
    "OTGrads",
    "SinkhornDivergenceContext",
    "SinkhornDivergenceGrads",
    "SinkhornResult",
    "WassersteinLossGrads",
    "entropic_ot_backward",
    "entropic_ot_forward",
    "pairwise_sinkhorn_divergence",
    "sinkhorn",
    "sinkhorn_divergence",
    "sinkhorn_divergence_backward",
    "sinkhorn_divergence_forward",
    "wcontrastive",
    "wtriplet",
]

_VALUES = ("regularized", "transport")
# Scalings outside [exp(-_ABSORB), exp(_ABSORB)] are folded into the potentials and the
# kernel is rebuilt in the log domain; inside that range the kernel iteration is exact
# in float64 and costs one batched mat-vec per half step instead of an exp per entry.
_ABSORB = 30.0
_ABSORB_HIGH = float(np.exp(_ABSORB))
_ABSORB_LOW = float(np.exp(-_ABSORB))
# A row or column mass below this cannot be rescaled without losing digits: rebuild.
_TINY = 1e-250
# Relative eigenvalue cut-off of the pseudo-inverse in the implicit (transport-cost) gradient.
_PINV_RCOND = 1e-12
# Intermediate eps-scaling stages only warm-start the next one.
_STAGE_TOL = 1e-3


# ----------------------------------------------------------------------------------------
# Result objects, contexts, gradients


@dataclass(frozen=True)
class SinkhornResult:
    """Solution of one (or a batch of) entropic OT problems.

    Leading batch dimensions ``...`` are those of the inputs; for a single problem the
    scalar fields are Python scalars.

    Attributes
    ----------
    plan : (..., n, m) optimal coupling ``pi``.
    f, g : (..., n), (..., m) dual potentials, ``pi = a b^T exp((f + g^T - C) / eps)``.
    value : regularised value of Eq. (3), ``<pi, C> + eps KL(pi | a (x) b) = <a,f> + <b,g>``.
    transport_cost : ``<pi, C>``.
    n_iter : Sinkhorn iterations (over all eps-scaling stages; each stage starts with one
        extra log-domain half step that is not counted).
    marginal_error : L1 violation of the row marginal (columns are exact on return).
    converged : ``marginal_error <= tol``. The plan itself can be further off than ``tol``
        where it nearly decouples into blocks (eps small against the gaps between
        clusters): the flows between blocks barely move the marginals.
    eps : the regularisation.
    """

    plan: np.ndarray
    f: np.ndarray
    g: np.ndarray
    value: np.ndarray | float
    transport_cost: np.ndarray | float
    n_iter: np.ndarray | int
    marginal_error: np.ndarray | float
    converged: np.ndarray | bool
    eps: float

    @property
    def residual(self):
        """Alias of ``marginal_error`` (the residual every refdml solver reports)."""
        return self.marginal_error


@dataclass(frozen=True)
class _OTBatch:
    """P independent problems of equal size, weights normalised, solved."""

    a: np.ndarray        # (P, n) on the simplex
    b: np.ndarray        # (P, m)
    cost: np.ndarray     # (P, n, m)
    eps: float
    f: np.ndarray
    g: np.ndarray
    plan: np.ndarray
    n_iter: np.ndarray
    marginal_error: np.ndarray
    converged: np.ndarray

    @property
    def value(self) -> np.ndarray:
        # The dual objective; its last term vanishes when the plan has unit mass (exactly
        # so after a column update, to O(tol) after a symmetric one).
        mass = self.plan.sum(axis=(1, 2))
        return (np.einsum("pi,pi->p", self.a, self.f) + np.einsum("pj,pj->p", self.b, self.g)
                - self.eps * (mass - 1.0))

    @property
    def transport_cost(self) -> np.ndarray:
        return np.einsum("pij,pij->p", self.plan, self.cost)


@dataclass(frozen=True)
class OTGrads:
    a: np.ndarray
    b: np.ndarray
    cost: np.ndarray


@dataclass(frozen=True)
class EntropicOTContext:
    batch: _OTBatch
    kind: str                # "regularized" or "transport"
    a_mass: np.ndarray       # (P,) sum of the weights as given
    b_mass: np.ndarray
    batch_shape: tuple[int, ...]
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass(frozen=True)
class SinkhornDivergenceGrads:
    x: np.ndarray
    y: np.ndarray
    a: np.ndarray | None
    b: np.ndarray | None


@dataclass(frozen=True)
class SinkhornDivergenceContext:
    x: np.ndarray
    y: np.ndarray
    a: np.ndarray            # normalised weights
    b: np.ndarray
    a_mass: float
    b_mass: float
    weights_given: bool
    p: float
    kind: str
    xy: _OTBatch             # the three problems of Eq. (4)
    xx: _OTBatch
    yy: _OTBatch


@dataclass(frozen=True)
class WassersteinLossGrads:
    features: np.ndarray     # (B, n, d)


# ----------------------------------------------------------------------------------------
# The batched solver


def _log_g_update(log_a, b, cost, f, eps):
    """Exact g-update in the log domain; returns g and the plan for unit scalings.

    ``g_j = -eps log sum_i a_i exp((f_i - C_ij) / eps)``. The returned kernel
    ``K_ij = a_i b_j exp((f_i + g_j - C_ij) / eps)`` has columns summing to ``b`` exactly,
    so every entry is at most 1: nothing can overflow, small entries may underflow.
    """
    exponent = (f[:, :, None] - cost) / eps
    exponent += log_a[:, :, None]
    peak = exponent.max(axis=1, keepdims=True)
    exponent -= peak
    np.exp(exponent, out=exponent)
    mass = exponent.sum(axis=1, keepdims=True)          # >= 1: the peak contributes 1
    g = -eps * (peak[:, 0, :] + np.log(mass[:, 0, :]))
    exponent *= b[:, None, :] / mass
    return g, exponent


def _log_symmetric_update(log_a, cost, f, eps):
    """Averaged symmetric update ``f <- (f + T(f)) / 2`` in the log domain (Feydy et al.).

    ``T(f)_i = -eps log sum_j a_j exp((f_j - C_ij) / eps)``. Returns the new ``f`` and
    ``K_ij = a_i a_j exp((f_i + f_j - C_ij) / eps)``, the geometric mean of a kernel with
    rows summing to ``a`` and its transpose, hence ``K_ij <= sqrt(a_i a_j) <= 1``.
    """
    exponent = (f[:, None, :] - cost) / eps
    exponent += log_a[:, None, :]
    peak = exponent.max(axis=2, keepdims=True)
    lse = peak[:, :, 0] + np.log(np.exp(exponent - peak).sum(axis=2))
    f_new = 0.5 * (f - eps * lse)
    exponent += log_a[:, :, None] + (f_new[:, :, None] + f_new[:, None, :] - f[:, None, :]) / eps
    return f_new, np.exp(exponent, out=exponent)


def _stage(log_a, a, b, cost, eps, f, g, *, tol, max_iter, want_plan, symmetric):
    """Sinkhorn at one eps for P problems, freezing each problem once it converges.

    Iterations run on scalings ``u``, ``v`` of a kernel with the potentials absorbed
    (``pi = u K v``); the kernel is rebuilt in the log domain when a scaling leaves
    ``exp(+-_ABSORB)``. Symmetric problems (``b = a``, ``C = C^T``) use one scaling and
    the averaged update ``u <- sqrt(u a / (K u))``: alternating updates converge very
    slowly there when the plan is nearly diagonal. Returns potentials, plans (if
    asked), iterations and errors.
    """
    n_problems = cost.shape[0]
    out_f, out_g = f.copy(), g.copy()
    out_plan = np.empty_like(cost) if want_plan else None
    out_iter = np.zeros(n_problems, dtype=np.int64)
    out_err = np.full(n_problems, np.inf)

    active = np.arange(n_problems)
    la, aa, bb, cc = log_a, a, b, cost
    ff = f.copy()
    if symmetric:
        ff, kernel = _log_symmetric_update(la, cc, ff, eps)
        gg = ff
    else:
        gg, kernel = _log_g_update(la, bb, cc, ff, eps)
    u = np.ones_like(aa)
    v = u if symmetric else np.ones_like(bb)
    for it in range(max_iter + 1):
        row = np.einsum("pij,pj->pi", kernel, v)
        err = np.abs(u * row - aa).sum(axis=1)
        done = err <= tol
        if it == max_iter:
            done[:] = True
        if done.any():
            idx = active[done]
            out_f[idx] = ff[done] + eps * np.log(u[done])
            out_g[idx] = gg[done] + eps * np.log(v[done])
            if want_plan:
                out_plan[idx] = u[done, :, None] * kernel[done] * v[done, None, :]
            out_iter[idx] = it
            out_err[idx] = err[done]
            keep = ~done
            if not keep.any():
                break
            active = active[keep]
            la, aa, bb, cc = la[keep], aa[keep], bb[keep], cc[keep]
            ff, u, row, kernel = ff[keep], u[keep], row[keep], kernel[keep]
            gg = ff if symmetric else gg[keep]
            v = u if symmetric else v[keep]
        if symmetric:
            u = np.sqrt(u * aa / np.maximum(row, _TINY))
            v = u
            col = row
        else:
            u = aa / np.maximum(row, _TINY)
            col = np.einsum("pij,pi->pj", kernel, u)
            v = bb / np.maximum(col, _TINY)
        rebuild = (
            (u.max(axis=1) > _ABSORB_HIGH) | (u.min(axis=1) < _ABSORB_LOW)
            | (v.max(axis=1) > _ABSORB_HIGH) | (v.min(axis=1) < _ABSORB_LOW)
            | (row.min(axis=1) < _TINY) | (col.min(axis=1) < _TINY)
        )
        if rebuild.any():
            ff[rebuild] += eps * np.log(u[rebuild])
            if symmetric:
                f_new, k_new = _log_symmetric_update(la[rebuild], cc[rebuild], ff[rebuild], eps)
                ff[rebuild] = f_new
                gg = ff
            else:
                f_new, k_new = _log_g_update(la[rebuild], bb[rebuild], cc[rebuild], ff[rebuild], eps)
                gg[rebuild] = f_new
            kernel[rebuild] = k_new
            u[rebuild] = 1.0
            if not symmetric:
                v[rebuild] = 1.0
    return out_f, out_g, out_plan, out_iter, out_err


def _eps_schedule(cost: np.ndarray, eps: float, eps_scaling: float | None) -> list[float]:
    if eps_scaling is None:
        return [eps]
    start = float(np.max(cost))
    schedule = []
    level = start
    while level > eps:
        schedule.append(level)
        level *= eps_scaling
    return schedule + [eps]


def _solve_batch(a, b, cost, *, eps, max_iter, tol, eps_scaling, symmetric=False) -> _OTBatch:
    """Solve P problems (a (P,n), b (P,m) on the simplex, cost (P,n,m)) together.

    ``symmetric=True`` promises ``b = a`` and ``C = C^T`` (the terms OT(mu, mu) of Eq. (4)).
    """
    log_a = np.log(a)
    n_problems, n, m = cost.shape
    f = np.zeros((n_problems, n))
    g = np.zeros((n_problems, m))
    n_iter = np.zeros(n_problems, dtype=np.int64)
    schedule = _eps_schedule(cost, eps, eps_scaling)
    for level in schedule[:-1]:
        f, g, _, it, _ = _stage(
            log_a, a, b, cost, level, f, g,
            tol=max(tol, _STAGE_TOL), max_iter=max_iter, want_plan=False, symmetric=symmetric,
        )
        n_iter += it
    f, g, plan, it, err = _stage(
        log_a, a, b, cost, eps, f, g, tol=tol, max_iter=max_iter, want_plan=True,
        symmetric=symmetric,
    )
    n_iter += it
    converged = err <= tol
    if not converged.all():
        warnings.warn(
            f"Sinkhorn did not reach tol={tol:g} in max_iter={max_iter} iterations for "
            f"{int((~converged).sum())} of {n_problems} problem(s) (largest marginal error "
            f"{float(err.max()):.3g}); increase max_iter, eps, or use eps_scaling",
            ConvergenceWarning,
            stacklevel=3,
        )
    return _OTBatch(a, b, cost, eps, f, g, plan, n_iter, err, converged)


def _ot_vjp(batch: _OTBatch, kind: str, d_value: np.ndarray):
    """Gradients of ``sum_p d_value[p] * OT_p`` w.r.t. the cost and the (simplex) weights.

    The weight gradients are returned in the gauge ``<grad_a, a> = 0`` (the gradient of
    the value as a function of ``a / sum(a)``, at ``sum(a) = 1``).
    """
    plan, a, b = batch.plan, batch.a, batch.b
    if kind == "regularized":
        d_cost = plan
        da, db = batch.f, batch.g
    else:
        d_cost, da, db = _transport_cost_vjp(batch)
    da = da - np.einsum("pi,pi->p", da, a)[:, None]
    db = db - np.einsum("pj,pj->p", db, b)[:, None]
    scale = d_value[:, None]
    return d_cost * d_value[:, None, None], da * scale, db * scale


def _transport_cost_vjp(batch: _OTBatch):
    """Implicit derivative of ``<pi*(C, a, b), C>`` (see the module docstring)."""
    plan, cost, a, b, eps = batch.plan, batch.cost, batch.a, batch.b, batch.eps
    weighted = plan * cost
    u = weighted.sum(axis=2)
    v = weighted.sum(axis=1)
    # Schur complement on z: (diag b - pi^T diag(1/a) pi) z = v - pi^T (u / a). It is
    # symmetric PSD with the constant vector in its kernel (the (t, -t) gauge), and nearly
    # singular when the plan nearly decouples into blocks (small eps): solve by a
    # pseudo-inverse that drops eigenvalues below _PINV_RCOND * max. Where the plan is a
    # numerical permutation every solution gives the same d_cost = pi.
    scaled = plan / a[:, :, None]
    schur = -np.einsum("pij,pik->pjk", plan, scaled)
    m = b.shape[1]
    diag = np.arange(m)
    schur[:, diag, diag] += b
    schur = 0.5 * (schur + np.swapaxes(schur, 1, 2))
    rhs = v - np.einsum("pij,pi->pj", plan, u / a)
    eigval, eigvec = np.linalg.eigh(schur)
    keep = eigval > _PINV_RCOND * eigval[:, -1:]
    inv = np.where(keep, 1.0 / np.where(keep, eigval, 1.0), 0.0)
    z = np.einsum("pjk,pk->pj", eigvec, inv * np.einsum("pjk,pj->pk", eigvec, rhs))
    w = (u - np.einsum("pij,pj->pi", plan, z)) / a
    d_cost = plan * (1.0 + (w[:, :, None] + z[:, None, :] - cost) / eps)
    return d_cost, w, z


# ----------------------------------------------------------------------------------------
# Input checks shared by the public functions


def _check_solver_args(eps, max_iter, tol, eps_scaling):
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    max_iter = check_scalar(max_iter, "max_iter", low=1, integer=True)
    tol = check_scalar(tol, "tol", low=0.0, low_inclusive=False)
    if eps_scaling is not None:
        eps_scaling = check_scalar(
            eps_scaling, "eps_scaling", low=0.0, high=1.0, low_inclusive=False,
            high_inclusive=False,
        )
    return eps, max_iter, tol, eps_scaling


def _check_weights(w, name: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positive weights of length ``size`` (leading batch dims allowed); returns (w/|w|, |w|)."""
    w = as_float_array(w, name, min_ndim=1)
    if w.shape[-1] != size:
        raise ValueError(f"{name} has {w.shape[-1]} entries along its last axis, expected {size}")
    if np.any(w <= 0.0):
        bad = tuple(int(i) for i in np.argwhere(w <= 0.0)[0])
        raise ValueError(
            f"{name} must be positive, got {w[bad]} at index {bad} "
            "(drop zero-weight points instead)"
        )
    mass = w.sum(axis=-1)
    return w / mass[..., None], mass


def _as_batch(a, b, cost):
    """Broadcast weights and cost to (P, n), (P, m), (P, n, m); return the batch shape too."""
    n, m = cost.shape[-2:]
    batch_shape = np.broadcast_shapes(cost.shape[:-2], a.shape[:-1], b.shape[:-1])
    cost_b = np.broadcast_to(cost, batch_shape + (n, m)).reshape(-1, n, m)
    a_b = np.broadcast_to(a, batch_shape + (n,)).reshape(-1, n)
    b_b = np.broadcast_to(b, batch_shape + (m,)).reshape(-1, m)
    return np.ascontiguousarray(a_b), np.ascontiguousarray(b_b), np.array(cost_b), batch_shape


def _unbatch(array: np.ndarray, batch_shape: tuple[int, ...]):
    out = array.reshape(batch_shape + array.shape[1:])
    return out.item() if out.ndim == 0 else out


# ----------------------------------------------------------------------------------------
# Public entropic OT


def sinkhorn(a, b, cost, *, eps, max_iter=1000, tol=1e-9, eps_scaling=None) -> SinkhornResult:
    """Entropic OT of Eq. (3) by log-stabilised Sinkhorn, for one problem or a batch.

    .. math::

        \\min_{\\pi \\in \\Pi(a, b)} \\langle \\pi, C \\rangle
        + \\varepsilon\\, \\mathrm{KL}(\\pi \\,\\|\\, a \\otimes b)

    Parameters
    ----------
    a : (..., n) positive weights (normalised to sum 1).
    b : (..., m) positive weights (normalised to sum 1).
    cost : (..., n, m) cost matrix; leading dimensions of ``a``, ``b`` and ``cost``
        broadcast, and every problem of the batch is solved in one vectorised loop.
    eps : float > 0, regularisation, in the units of ``cost``. Down to ``1e-3`` of the
        cost scale the iteration stays finite; use ``eps_scaling`` there for speed.
    max_iter : iterations per eps stage.
    tol : L1 marginal error at which a problem is converged (and frozen).
    eps_scaling : None or a factor in (0, 1): solve at ``max(C), max(C) q, ...`` down to
        ``eps``, each stage warm-starting the next (only loosely converged).

    Returns
    -------
    SinkhornResult
        Warns :class:`refdml.ConvergenceWarning` if a problem did not reach ``tol``.
    """
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    cost = as_float_array(cost, "cost", min_ndim=2)
    a, _ = _check_weights(a, "a", cost.shape[-2])
    b, _ = _check_weights(b, "b", cost.shape[-1])
    a_b, b_b, cost_b, batch_shape = _as_batch(a, b, cost)
    batch = _solve_batch(a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                         eps_scaling=eps_scaling)
    return SinkhornResult(
        plan=_unbatch(batch.plan, batch_shape),
        f=_unbatch(batch.f, batch_shape),
        g=_unbatch(batch.g, batch_shape),
        value=_unbatch(batch.value, batch_shape),
        transport_cost=_unbatch(batch.transport_cost, batch_shape),
        n_iter=_unbatch(batch.n_iter, batch_shape),
        marginal_error=_unbatch(batch.marginal_error, batch_shape),
        converged=_unbatch(batch.converged, batch_shape),
        eps=eps,
    )


def entropic_ot_forward(a, b, cost, *, eps, value="regularized", max_iter=1000, tol=1e-9,
                        eps_scaling=None) -> tuple[np.ndarray | float, EntropicOTContext]:
    """Differentiable entropic OT: the value of Eq. (3) or ``<pi, C>``; returns ``(value, ctx)``.

    Shapes as in :func:`sinkhorn`; ``value`` has the batch shape (a float for one problem).
    """
    check_choice(value, "value", _VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    cost = as_float_array(cost, "cost", min_ndim=2)
    a_in_shape, b_in_shape = np.shape(a), np.shape(b)
    a, a_mass = _check_weights(a, "a", cost.shape[-2])
    b, b_mass = _check_weights(b, "b", cost.shape[-1])
    a_b, b_b, cost_b, batch_shape = _as_batch(a, b, cost)
    batch = _solve_batch(a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                         eps_scaling=eps_scaling)
    out = batch.value if value == "regularized" else batch.transport_cost
    ctx = EntropicOTContext(
        batch=batch,
        kind=value,
        a_mass=np.broadcast_to(a_mass, batch_shape).reshape(-1),
        b_mass=np.broadcast_to(b_mass, batch_shape).reshape(-1),
        batch_shape=batch_shape,
        a_shape=a_in_shape,
        b_shape=b_in_shape,
    )
    return _unbatch(out, batch_shape), ctx


def entropic_ot_backward(ctx: EntropicOTContext, d_value) -> OTGrads:
    """Gradients of ``<d_value, value>`` w.r.t. ``a``, ``b`` and ``cost``.

    ``a`` and ``b`` enter through ``a / sum(a)``; gradients of broadcast inputs are summed
    back to their shapes.
    """
    d_value = np.broadcast_to(np.asarray(d_value, dtype=np.float64), ctx.batch_shape).reshape(-1)
    d_cost, da, db = _ot_vjp(ctx.batch, ctx.kind, d_value)
    da = da / ctx.a_mass[:, None]
    db = db / ctx.b_mass[:, None]
    n, m = d_cost.shape[1:]
    d_cost = d_cost.reshape(ctx.batch_shape + (n, m))
    da = da.reshape(ctx.batch_shape + (n,))
    db = db.reshape(ctx.batch_shape + (m,))
    return OTGrads(
        a=_sum_to_shape(da, ctx.a_shape),
        b=_sum_to_shape(db, ctx.b_shape),
        cost=d_cost,
    )


# ----------------------------------------------------------------------------------------
# Ground cost ||x - y||^p between point clouds, batched


def _sq_dist(x: np.ndarray, y: np.ndarray, p: float) -> np.ndarray:
    """||x_i - y_j||^2 for x (P, n, d), y (P, m, d).

    For p = 2 by the Gram identity (one batched matmul), clipped at 0: its absolute error
    ~ machine eps * (|x|^2 + |y|^2) is far below eps (>= 1e-3 of the cost scale), and
    the gradient 2 (x_i - y_j) does not depend on it. For p != 2 the cost and its
    gradient ``p D^(p-2) (x_i - y_j)`` need small distances to full relative accuracy
    (a sqrt turns a 1e-16 rounding error into 1e-8), so they come from
    ``refdml.distances._pairwise_norm``, which recomputes nearby pairs from explicit
    differences.
    """
    if p != 2.0:
        return _pairwise_norm(x, y) ** 2
    sq = np.einsum("pnd,pnd->pn", x, x)[:, :, None] + np.einsum("pmd,pmd->pm", y, y)[:, None, :]
    sq -= 2.0 * (x @ np.swapaxes(y, 1, 2))
    np.maximum(sq, 0.0, out=sq)
    return sq


def _ground_cost(sq: np.ndarray, p: float) -> np.ndarray:
    return sq if p == 2.0 else sq ** (0.5 * p)


def _ground_cost_backward(x, y, sq, p, d_cost):
    """Gradients of ``<d_cost, ||x_i - y_j||^p>`` w.r.t. x and y (subgradient 0 at x_i = y_j)."""
    if p == 2.0:
        w = 2.0 * d_cost
    else:
        positive = sq > 0.0
        w = np.where(positive, p * d_cost * np.where(positive, sq, 1.0) ** (0.5 * p - 1.0), 0.0)
    d_x = w.sum(axis=2)[:, :, None] * x - w @ y
    d_y = w.sum(axis=1)[:, :, None] * y - np.swapaxes(w, 1, 2) @ x
    return d_x, d_y


def _self_sq_dist(x: np.ndarray, p: float) -> np.ndarray:
    sq = _sq_dist(x, x, p)
    # A point's distance to itself is 0, not the Gram identity's rounding error.
    diag = np.arange(x.shape[1])
    sq[:, diag, diag] = 0.0
    return 0.5 * (sq + np.swapaxes(sq, 1, 2))


# ----------------------------------------------------------------------------------------
# Sinkhorn divergence of one pair of weighted point clouds


def _check_clouds(x, y):
    x = as_float_array(x, "x", ndim=2)
    y = as_float_array(y, "y", ndim=2)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    return x, y


def _check_p(p) -> float:
    return check_scalar(p, "p", low=1.0)


def sinkhorn_divergence_forward(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                max_iter=1000, tol=1e-9, eps_scaling=None):
    """Sinkhorn divergence of Eq. (4) between two weighted point clouds; ``(value, ctx)``.

    ``SD = OT(a, b) - (OT(a, a) + OT(b, b)) / 2`` with cost ``||x_i - y_j||^p`` and ``OT``
    the regularised value of Eq. (3) (``value="regularized"``, the paper's) or the
    transport cost ``<pi, C>`` (``value="transport"``).

    x : (n, d), y : (m, d); a : (n,), b : (m,) positive weights, uniform when None.
    """
    check_choice(value, "value", _VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    x, y = _check_clouds(x, y)
    n, m = x.shape[0], y.shape[0]
    weights_given = a is not None or b is not None
    a, a_mass = _check_weights(np.full(n, 1.0 / n) if a is None else a, "a", n)
    b, b_mass = _check_weights(np.full(m, 1.0 / m) if b is None else b, "b", m)
    if a.ndim != 1 or b.ndim != 1:
        raise ValueError(f"a and b must be 1-d, got shapes {a.shape} and {b.shape}")
    solve = dict(eps=eps, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling)
    xy = _solve_batch(a[None], b[None], _ground_cost(_sq_dist(x[None], y[None], p), p), **solve)
    xx = _solve_batch(a[None], a[None], _ground_cost(_self_sq_dist(x[None], p), p),
                      symmetric=True, **solve)
    yy = _solve_batch(b[None], b[None], _ground_cost(_self_sq_dist(y[None], p), p),
                      symmetric=True, **solve)
    terms = [t.value if value == "regularized" else t.transport_cost for t in (xy, xx, yy)]
    divergence = float(terms[0][0] - 0.5 * (terms[1][0] + terms[2][0]))
    ctx = SinkhornDivergenceContext(
        x=x, y=y, a=a, b=b, a_mass=float(a_mass), b_mass=float(b_mass),
        weights_given=weights_given, p=p, kind=value, xy=xy, xx=xx, yy=yy,
    )
    return divergence, ctx


def sinkhorn_divergence_backward(ctx: SinkhornDivergenceContext, d_value) -> SinkhornDivergenceGrads:
    """Gradients of ``d_value * SD`` w.r.t. x, y (and a, b when weights were given)."""
    d_value = float(np.asarray(d_value))
    one = np.array([d_value])
    half = np.array([-0.5 * d_value])
    x, y, p = ctx.x[None], ctx.y[None], ctx.p

    d_cost, da_xy, db_xy = _ot_vjp(ctx.xy, ctx.kind, one)
    dx_xy, dy_xy = _ground_cost_backward(x, y, _sq_dist(x, y, p), p, d_cost)
    # The symmetric terms move through both slots of the cost and of the weights.
    d_cost, da1, da2 = _ot_vjp(ctx.xx, ctx.kind, half)
    dx1, dx2 = _ground_cost_backward(x, x, _self_sq_dist(x, p), p, d_cost)
    d_cost, db1, db2 = _ot_vjp(ctx.yy, ctx.kind, half)
    dy1, dy2 = _ground_cost_backward(y, y, _self_sq_dist(y, p), p, d_cost)

    grad_a = grad_b = None
    if ctx.weights_given:
        grad_a = (da_xy + da1 + da2)[0] / ctx.a_mass
        grad_b = (db_xy + db1 + db2)[0] / ctx.b_mass
    return SinkhornDivergenceGrads(
        x=(dx_xy + dx1 + dx2)[0], y=(dy_xy + dy1 + dy2)[0], a=grad_a, b=grad_b
    )


def sinkhorn_divergence(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                        max_iter=1000, tol=1e-9, eps_scaling=None):
    """``value, grads`` of the Sinkhorn divergence, Eq. (4) (see :func:`sinkhorn_divergence_forward`).

    ``grads.x``, ``grads.y``; ``grads.a``, ``grads.b`` when weights were given (else None).
    """
    divergence, ctx = sinkhorn_divergence_forward(
        x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling,
    )
    return divergence, sinkhorn_divergence_backward(ctx, 1.0)


# ----------------------------------------------------------------------------------------
# Divergences between many clouds of equal size, all problems in one batch


@dataclass(frozen=True)
class _PairsContext:
    clouds: np.ndarray       # (B, n, d)
    pairs: np.ndarray        # (K, 2) cloud indices, first < second or equal
    selves: np.ndarray       # (S,) clouds whose OT(mu, mu) enters
    cross: _OTBatch
    self_: _OTBatch
    p: float
    kind: str


def _pair_divergences(clouds, pairs, *, eps, p, kind, max_iter, tol, eps_scaling):
    """SD between ``clouds[i]`` and ``clouds[j]`` for every row (i, j) of ``pairs``.

    All ``K`` cross problems and the needed self problems are solved in one batch each;
    the squared distances come from one Gram matrix of all points.
    """
    n_clouds, n, d = clouds.shape
    unique_pairs, inverse = np.unique(np.sort(pairs, axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    selves = np.unique(unique_pairs)
    if p == 2.0:
        # One Gram matrix of all points serves every block (see _sq_dist on accuracy).
        flat = clouds.reshape(-1, d)
        norms = np.einsum("nd,nd->n", flat, flat)
        sq_all = norms[:, None] + norms[None, :] - 2.0 * (flat @ flat.T)
        np.maximum(sq_all, 0.0, out=sq_all)
        blocks = sq_all.reshape(n_clouds, n, n_clouds, n).transpose(0, 2, 1, 3)
        sq_cross = blocks[unique_pairs[:, 0], unique_pairs[:, 1]]
        sq_self = blocks[selves, selves]
        del sq_all, blocks
        diag = np.arange(n)
        sq_self[:, diag, diag] = 0.0
        sq_self = 0.5 * (sq_self + np.swapaxes(sq_self, 1, 2))
    else:
        sq_cross = _sq_dist(clouds[unique_pairs[:, 0]], clouds[unique_pairs[:, 1]], p)
        sq_self = _self_sq_dist(clouds[selves], p)

    solve = dict(eps=eps, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling)
    cross = _solve_batch(*_uniform(sq_cross.shape[0], n), _ground_cost(sq_cross, p), **solve)
    self_ = _solve_batch(*_uniform(sq_self.shape[0], n), _ground_cost(sq_self, p),
                         symmetric=True, **solve)
    term = (lambda t: t.value) if kind == "regularized" else (lambda t: t.transport_cost)
    self_value = np.zeros(n_clouds)
    self_value[selves] = term(self_)
    values = term(cross) - 0.5 * (self_value[unique_pairs[:, 0]] + self_value[unique_pairs[:, 1]])
    ctx = _PairsContext(clouds, unique_pairs, selves, cross, self_, p, kind)
    return values[inverse], inverse, ctx


def _uniform(n_problems: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    weights = np.full((n_problems, n), 1.0 / n)
    return weights, weights.copy()


def _pair_divergences_backward(ctx: _PairsContext, d_unique: np.ndarray) -> np.ndarray:
    """Gradient w.r.t. the clouds of ``sum_k d_unique[k] * SD(pairs[k])``."""
    clouds, pairs = ctx.clouds, ctx.pairs
    grad = np.zeros_like(clouds)
    first, second = pairs[:, 0], pairs[:, 1]
    d_cost, _, _ = _ot_vjp(ctx.cross, ctx.kind, d_unique)
    x, y = clouds[first], clouds[second]
    d_x, d_y = _ground_cost_backward(x, y, _sq_dist(x, y, ctx.p), ctx.p, d_cost)
    np.add.at(grad, first, d_x)
    np.add.at(grad, second, d_y)
    d_self = np.zeros(clouds.shape[0])
    np.add.at(d_self, first, -0.5 * d_unique)
    np.add.at(d_self, second, -0.5 * d_unique)
    d_cost, _, _ = _ot_vjp(ctx.self_, ctx.kind, d_self[ctx.selves])
    x = clouds[ctx.selves]
    d_x1, d_x2 = _ground_cost_backward(x, x, _self_sq_dist(x, ctx.p), ctx.p, d_cost)
    np.add.at(grad, ctx.selves, d_x1 + d_x2)
    return grad


def _check_features(features) -> np.ndarray:
    features = as_float_array(features, "features", ndim=3)
    if features.shape[1] < 1 or features.shape[2] < 1:
        raise ValueError(f"features must have shape (B, n, d) with n, d >= 1, got {features.shape}")
    return features


def pairwise_sinkhorn_divergence(clouds, *, eps, p=2, value="regularized", max_iter=1000,
                                 tol=1e-9, eps_scaling=None) -> np.ndarray:
    """(B, B) matrix of Sinkhorn divergences between all pairs of uniform clouds (B, n, d).

    All ``B (B - 1) / 2`` cross problems and ``B`` self problems are solved in one
    vectorised Sinkhorn loop. The diagonal is 0 exactly.
    """
    check_choice(value, "value", _VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    clouds = as_float_array(clouds, "clouds", ndim=3)
    n_clouds = clouds.shape[0]
    out = np.zeros((n_clouds, n_clouds))
    if n_clouds < 2:
        return out
    first, second = np.triu_indices(n_clouds, k=1)
    values, _, _ = _pair_divergences(
        clouds, np.stack([first, second], axis=1), eps=eps, p=p, kind=value,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    out[first, second] = values
    out[second, first] = values
    return out


# ----------------------------------------------------------------------------------------
# Wasserstein DML losses, Eqs. (1)-(2)


def _check_loss_args(features, labels, margin, eps, p, value, max_iter, tol, eps_scaling):
    features = _check_features(features)
    labels = as_label_array(labels, "labels", length=features.shape[0])
    margin = check_scalar(margin, "margin", low=0.0)
    check_choice(value, "value", _VALUES)
    solver = _check_solver_args(eps, max_iter, tol, eps_scaling)
    return features, labels, margin, _check_p(p), solver


def _check_index_rows(rows, name: str, width: int, n_items: int) -> np.ndarray:
    array = np.asarray(rows)
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"{name} must be an integer array of shape (K, {width}), got dtype {array.dtype}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (K, {width}), got {array.shape}")
    if array.size and (array.min() < 0 or array.max() >= n_items):
        raise ValueError(f"{name} holds indices outside [0, {n_items}), got {array.min()}..{array.max()}")
    return array.astype(np.int64)


def wcontrastive(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                 max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein contrastive loss, Eq. (1); returns ``value, grads`` (``grads.features``).

    .. math::

        L = \\frac{1}{|P|} \\sum_{(i,j) \\in P} [y_i = y_j]\\, d_w(i, j)
            + [y_i \\ne y_j]\\, [\\gamma - d_w(i, j)]_+

    ``features`` (B, n, d): image ``i`` is the uniform measure on its ``n`` local features;
    ``d_w`` is the Sinkhorn divergence of Eq. (4) with cost ``||x - y||^p`` (default p = 1,
    the paper's ``d_w = W_1``). ``pairs`` (K, 2): the pair set ``P``; default every
    unordered pair ``i < j``. Eq. (1)'s ``1/b`` is implemented as ``1/|P|``, the mean over
    pairs. The hinge uses the subgradient 0 at ``d_w = margin``.
    """
    features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _check_loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    n_images = features.shape[0]
    if pairs is None:
        first, second = np.triu_indices(n_images, k=1)
        pairs = np.stack([first, second], axis=1)
    pairs = _check_index_rows(pairs, "pairs", 2, n_images)
    if pairs.shape[0] == 0:
        return 0.0, WassersteinLossGrads(np.zeros_like(features))
    if np.any(pairs[:, 0] == pairs[:, 1]):
        raise ValueError("pairs must join two different images")
    d_w, inverse, ctx = _pair_divergences(
        features, pairs, eps=eps, p=p, kind=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling,
    )
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    hinge = margin - d_w
    terms = np.where(same, d_w, np.maximum(hinge, 0.0))
    count = pairs.shape[0]
    d_d = np.where(same, 1.0, np.where(hinge > 0.0, -1.0, 0.0)) / count
    d_unique = np.zeros(ctx.pairs.shape[0])
    np.add.at(d_unique, inverse, d_d)
    grad = _pair_divergences_backward(ctx, d_unique)
    return float(terms.sum() / count), WassersteinLossGrads(grad)


def _all_triplets(labels: np.ndarray) -> np.ndarray:
    same = labels[:, None] == labels[None, :]
    anchor, positive = np.nonzero(same & ~np.eye(labels.size, dtype=bool))
    rows = []
    for a_idx, p_idx in zip(anchor, positive):
        negatives = np.flatnonzero(~same[a_idx])
        rows.append(np.stack([np.full(negatives.size, a_idx), np.full(negatives.size, p_idx),
                              negatives], axis=1))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(rows).astype(np.int64)


def wtriplet(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
             max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein triplet loss, Eq. (2); returns ``value, grads`` (``grads.features``).

    .. math::

        L = \\frac{1}{|T|} \\sum_{(a,p,n) \\in T} [d_w(a, p) - d_w(a, n) + \\gamma]_+

    ``triplets`` (K, 3): default every ``(a, p, n)`` with ``y_a = y_p != y_n``, ``a != p``.
    Eq. (2)'s ``1/b`` is implemented as ``1/|T|``. Without any triplet the loss is 0.
    Other conventions as in :func:`wcontrastive`.
    """
    features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _check_loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    n_images = features.shape[0]
    triplets = _all_triplets(labels) if triplets is None else _check_index_rows(
        triplets, "triplets", 3, n_images
    )
    if triplets.shape[0] == 0:
        return 0.0, WassersteinLossGrads(np.zeros_like(features))
    if np.any(triplets[:, 0] == triplets[:, 1]) or np.any(triplets[:, 0] == triplets[:, 2]):
        raise ValueError("a triplet must use three images with anchor != positive, negative")
    pairs = np.concatenate([triplets[:, [0, 1]], triplets[:, [0, 2]]])
    d_w, inverse, ctx = _pair_divergences(
        features, pairs, eps=eps, p=p, kind=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling,
    )
    count = triplets.shape[0]
    d_pos, d_neg = d_w[:count], d_w[count:]
    hinge = d_pos - d_neg + margin
    active = (hinge > 0.0).astype(np.float64) / count
    d_d = np.concatenate([active, -active])
    d_unique = np.zeros(ctx.pairs.shape[0])
    np.add.at(d_unique, inverse, d_d)
    grad = _pair_divergences_backward(ctx, d_unique)
    return float(np.maximum(hinge, 0.0).sum() / count), WassersteinLossGrads(grad)


# ----------------------------------------------------------------------------------------
# Registry: every operator above is gradient-checked by tests/test_registry.py

_TIGHT = dict(tol=1e-12, max_iter=5000)


def _ot_inputs(rng: np.random.Generator) -> dict:
    x, y = rng.standard_normal((4, 2)), rng.standard_normal((3, 2))
    cost = np.sum((x[:, None] - y[None]) ** 2, axis=-1)
    return {"a": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(0.5, 1.5, 3), "cost": cost,
            "eps": 0.5, **_TIGHT}


def _ot_transport_inputs(rng: np.random.Generator) -> dict:
    return {**_ot_inputs(rng), "value": "transport"}


def _divergence_inputs(rng: np.random.Generator) -> dict:
    return {"x": rng.standard_normal((4, 2)), "y": rng.standard_normal((3, 2)) + 0.5,
            "a": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(0.5, 1.5, 3),
            "eps": 0.5, "p": 2, **_TIGHT}


def _divergence_transport_inputs(rng: np.random.Generator) -> dict:
    return {**_divergence_inputs(rng), "value": "transport", "p": 1.5}


def _loss_inputs(rng: np.random.Generator) -> dict:
    # Margin far from every d_w (about 0.5-3 here) keeps the hinges off their kinks.
    return {"features": rng.standard_normal((4, 3, 2)), "labels": np.array([0, 0, 1, 1]),
            "margin": 20.0, "eps": 0.5, "p": 2, **_TIGHT}


register(OperatorSpec(
    name="ot.entropic_ot",
    forward=entropic_ot_forward,
    backward=entropic_ot_backward,
    make_inputs=_ot_inputs,
    paper="Wasserstein DML Eq. (3): W_{p,eta}^p, regularised value",
))
register(OperatorSpec(
    name="ot.entropic_ot_transport_cost",
    forward=entropic_ot_forward,
    backward=entropic_ot_backward,
    make_inputs=_ot_transport_inputs,
    paper="Wasserstein DML Eq. (3): <pi, C> of the entropic plan (implicit gradient)",
))
register(OperatorSpec(
    name="ot.sinkhorn_divergence",
    forward=sinkhorn_divergence,
    backward=None,
    make_inputs=_divergence_inputs,
    paper="Wasserstein DML Eq. (4): SD_{p,eta}",
    is_loss=True,
))
register(OperatorSpec(
    name="ot.sinkhorn_divergence_transport_cost",
    forward=sinkhorn_divergence,
    backward=None,
    make_inputs=_divergence_transport_inputs,
    paper="Wasserstein DML Eq. (4) with <pi, C> in place of W_{p,eta}",
    is_loss=True,
))
register(OperatorSpec(
    name="ot.wcontrastive",
    forward=wcontrastive,
    backward=None,
    make_inputs=_loss_inputs,
    paper="Wasserstein DML Eq. (1)",
    wrt=("features",),
    is_loss=True,
))
register(OperatorSpec(
    name="ot.wtriplet",
    forward=wtriplet,
    backward=None,
    make_inputs=_loss_inputs,
    paper="Wasserstein DML Eq. (2)",
    wrt=("features",),
    is_loss=True,
))
