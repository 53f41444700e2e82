r"""Entropic OT on the fast path: Sinkhorn, OT value, Sinkhorn divergences, Wasserstein losses.

The mirror of :mod:`refdml.ot` (same names, signatures, result and context types, which
are the reference's dataclasses holding arrays of the input's module), written once
against the input's array module (NumPy or CuPy), in the input's dtype (float32 or
float64), every problem of a call in one batch (no Python loop over problems or pairs).
The maths and the gradients are the reference's (docs/ot.md); read that first.

What differs from the reference (and why)
------------------------------------------
* The solver (:mod:`refdml.gpu.ot._sinkhorn`) is log-domain at every half step on CuPy; on
  NumPy it iterates on kernel scalings with that log-domain step as absorption and
  fallback whenever a scaling leaves ``e^±B``, so in both cases float32 stays finite down
  to ``eps = 1e-4`` of the largest cost; below that (float32) or ``1e-13`` (float64) a
  ``ValueError`` says the dtype cannot resolve the costs. Problems of at most 128 points
  per side (the all-pairs divergence, the losses) run the small-problem kernel instead.
  Each public function chooses the implementation of these steps once
  (:data:`refdml.gpu.ot._sinkhorn.SINKHORN`: the array path, the CPU twins or the CUDA
  kernels; :func:`refdml.gpu.use_kernels`).
* float32: a positive ``tol`` below the dtype's residual floor (``u (1 + max C /
  eps)``, :func:`refdml.gpu.ot._sinkhorn.residual_floor`) is raised to it; ``converged``
  and the warning refer to the raised tol.
* The implicit (``value="transport_cost"``) gradient's pseudo-inverse cuts eigenvalues
  below ``_PINV_RCOND[dtype]`` of the largest (1e-12 float64, 1e-6 float32).
* Divergences between point clouds use the Gram identity for the squared distances
  (:func:`refdml.gpu.distances._scaled_sq`, points scaled into the unit ball first; on
  NumPy its nearby pairs are recomputed from explicit differences as the reference's, on
  CuPy they are not).
* Where ``eps`` exceeds a problem's largest cost the solve ends, as the reference's, with
  three exact log-domain half steps (:func:`refdml.gpu.ot._sinkhorn._finish_large_eps`),
  and the value's mass term is summed through ``expm1``. On CuPy, where the host cannot
  tell that no problem of a batch needs them, every problem's half steps are computed and
  kept where they apply (no synchronisation).
* float32 and ``p`` beyond its largest number: the forward is the reference's limit (the
  power capped there), the backward a ``ValueError`` (the gradient is ``p`` times a cost).
  A ``tol`` beyond the dtype is applied as its largest number; loss terms whose margin is
  no float32 are float64 (:func:`refdml.gpu.losses.terms_dtype`).

Synchronisation on CuPy (results that reach Python, and checks): the input checks
(finiteness, positive weights; :func:`refdml.gpu.set_finite_checks`) and,
under the same switch, the finiteness of the gradients w.r.t. given weights and w.r.t.
the points, the largest cost (for the exact power-of-two rescaling, the eps check and the
eps-scaling schedule; read in one transfer with the smallest of the problems' largest
costs, which tells the large-eps finish whether any problem needs it), the largest squared
distance (``p`` other than 1 and 2), the
solver's convergence test every
:data:`refdml.gpu.ot._sinkhorn.CHECK_EVERY_GPU` iterations, the warning, the Python
floats the reference returns (one problem's scalars, divergence, loss values, masses),
the finiteness of the divergences (whatever the switch: an overflow is named), and the
sizes of the unique pairs (two ``unique``) and the list of triplets (one ``nonzero``) of
the losses. The solver gathers converged problems by index, not by mask (a CuPy mask index
reads its count back: one more synchronisation per array).
"""

from __future__ import annotations


import numpy as np

from refdml._validation import (
    as_fast_array, check_choice, check_context, check_fast_upstream, data_checks, result_dtype,
)
from refdml._backend import get_backend
from refdml._shared.distances import sum_to_shape
from refdml._shared.ot import (
    COST_NAME,
    VALUES,
    check_output,
    check_p,
    check_solver_args,
    ground_cost,
    weight_gradient_message,
)
from refdml.gpu.ot import _sinkhorn as _solver
from refdml.ot import EntropicOTContext, OTGrads, PairwiseSinkhornDivergenceContext, PairwiseSinkhornDivergenceGrads, SinkhornDivergenceContext, SinkhornDivergenceGrads, SinkhornResult, WassersteinLossGrads, WContrastiveContext, WTripletContext

from refdml.gpu.ot._common import (
    _ot_vjp,
    _as_batch,
    _cloud_sq,
    _cost_and_weights,
    _ground_cost_backward,
    _scalar_upstream,
    _scaled_points,
    _solve_scaled,
    _sq_and_unit,
    _term,
    _to_points,
    _unbatch,
    _weight_vector,
    left_range_message,
)
from refdml.gpu.ot._pairs import (
    pairwise_sinkhorn_divergence,
    pairwise_sinkhorn_divergence_backward,
    pairwise_sinkhorn_divergence_forward,
    wcontrastive,
    wcontrastive_backward,
    wcontrastive_forward,
    wtriplet,
    wtriplet_backward,
    wtriplet_forward,
)

__all__ = [
    "EntropicOTContext",
    "OTGrads",
    "PairwiseSinkhornDivergenceContext",
    "PairwiseSinkhornDivergenceGrads",
    "SinkhornDivergenceContext",
    "SinkhornDivergenceGrads",
    "SinkhornResult",
    "WContrastiveContext",
    "WTripletContext",
    "WassersteinLossGrads",
    "entropic_ot_backward",
    "entropic_ot_forward",
    "pairwise_sinkhorn_divergence",
    "pairwise_sinkhorn_divergence_backward",
    "pairwise_sinkhorn_divergence_forward",
    "sinkhorn",
    "sinkhorn_divergence",
    "sinkhorn_divergence_backward",
    "sinkhorn_divergence_forward",
    "wcontrastive",
    "wcontrastive_backward",
    "wcontrastive_forward",
    "wtriplet",
    "wtriplet_backward",
    "wtriplet_forward",
]

# --------------------------------------------------------------------------- Sinkhorn
def sinkhorn(a, b, cost, *, eps, max_iter=1000, tol=1e-9, eps_scaling=None) -> SinkhornResult:
    """Entropic OT of Eq. (3), batched, log domain; as :func:`refdml.ot.sinkhorn`.

    Arrays of the result are of the input's module and dtype; ``n_iter`` counts
    iterations to the first convergence check that passed (every iteration on NumPy,
    every ``CHECK_EVERY_GPU`` on CuPy). Warns :class:`refdml.ConvergenceWarning` if a
    problem did not reach ``tol`` (raised to the dtype's floor, see the module docstring).
    """
    eps, max_iter, tol, eps_scaling = check_solver_args(eps, max_iter, tol, eps_scaling)
    xp, a, _, b, _, cost = _cost_and_weights(a, b, cost)
    a_b, b_b, cost_b, batch_shape = _as_batch(xp, a, b, cost)
    batch = _solve_scaled(xp, a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling, impl=_solver.SINKHORN.choose(cost_b))
    return SinkhornResult(
        plan=_unbatch(batch.plan, batch_shape),
        f=_unbatch(batch.unit * batch.f, batch_shape),
        g=_unbatch(batch.unit * batch.g, batch_shape),
        value=_unbatch(_solver.batch_value(xp, batch), batch_shape),
        transport_cost=_unbatch(_solver.batch_transport_cost(xp, batch), batch_shape),
        n_iter=_unbatch(batch.n_iter, batch_shape),
        marginal_error=_unbatch(batch.marginal_error, batch_shape),
        converged=_unbatch(batch.converged, batch_shape),
        eps=eps,
    )


# --------------------------------------------------------------------------- OT value
def entropic_ot_forward(a, b, cost, *, eps, value="regularized", max_iter=1000, tol=1e-9,
                        eps_scaling=None):
    """Differentiable entropic OT, Eq. (3); ``(out, ctx)`` as :func:`refdml.ot.entropic_ot_forward`."""
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = check_solver_args(eps, max_iter, tol, eps_scaling)
    xp, a, a_mass, b, b_mass, cost = _cost_and_weights(a, b, cost)
    a_b, b_b, cost_b, batch_shape = _as_batch(xp, a, b, cost)
    batch = _solve_scaled(xp, a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling, impl=_solver.SINKHORN.choose(cost_b))
    out = (_solver.batch_value(xp, batch) if value == "regularized"
           else _solver.batch_transport_cost(xp, batch))
    ctx = EntropicOTContext(
        batch=batch, value=value,
        a_mass=xp.broadcast_to(a_mass, batch_shape).reshape(-1),
        b_mass=xp.broadcast_to(b_mass, batch_shape).reshape(-1),
        batch_shape=tuple(batch_shape), a_shape=tuple(a.shape), b_shape=tuple(b.shape),
    )
    return _unbatch(out, batch_shape), ctx


def entropic_ot_backward(ctx: EntropicOTContext, d_value) -> OTGrads:
    """Gradients of ``<d_value, out>`` w.r.t. ``a``, ``b``, ``cost``; no re-solve."""
    check_context(ctx, "ctx", EntropicOTContext)
    batch = ctx.batch
    ns = get_backend(batch.plan)
    xp = ns.xp
    d_value = check_fast_upstream(d_value, "d_value", ctx.batch_shape, ns, batch.plan.dtype)
    d_value = xp.reshape(xp.asarray(d_value, dtype=batch.plan.dtype), (-1,))
    d_cost, da, db = _ot_vjp(xp, batch, ctx.value, d_value)
    da = _weight_gradient(ns, da, ctx.a_mass[:, None], "a")
    db = _weight_gradient(ns, db, ctx.b_mass[:, None], "b")
    n, m = d_cost.shape[1:]
    return OTGrads(
        a=sum_to_shape(da.reshape(ctx.batch_shape + (n,)), ctx.a_shape),
        b=sum_to_shape(db.reshape(ctx.batch_shape + (m,)), ctx.b_shape),
        cost=d_cost.reshape(ctx.batch_shape + (n, m)),
    )


# --------------------------------------------------------------------------- divergence
def sinkhorn_divergence_forward(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                max_iter=1000, tol=1e-9, eps_scaling=None):
    """Sinkhorn divergence of Eq. (4) between two weighted clouds; ``(sd, ctx)``.

    As :func:`refdml.ot.sinkhorn_divergence_forward`; ``sd`` is a Python float (one sync).
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = check_solver_args(eps, max_iter, tol, eps_scaling)
    p = check_p(p)
    ns = get_backend(x, y, a, b)
    xp = ns.xp
    given = [v for v in (a, b) if v is not None]
    dtype = result_dtype(as_fast_array(x, "x", ndim=2, ns=ns), as_fast_array(y, "y", ndim=2, ns=ns),
                         *(as_fast_array(v, "a", ns=ns) for v in given))
    x = as_fast_array(x, "x", ndim=2, dtype=dtype, ns=ns)
    y = as_fast_array(y, "y", ndim=2, dtype=dtype, ns=ns)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    n, m = x.shape[0], y.shape[0]
    weights_given = bool(given)
    a, a_mass = _weight_vector(xp.full(n, 1.0 / n, dtype=dtype) if a is None else a, "a", n, ns, dtype)
    b, b_mass = _weight_vector(xp.full(m, 1.0 / m, dtype=dtype) if b is None else b, "b", m, ns, dtype)
    scale, xs, ys = _scaled_points(xp, x, y)
    unit, sq_unit, sq_xy, sq_xx, sq_yy = _sq_and_unit(
        p, scale, "x and y", _cloud_sq(xp, xs[None], ys[None], p, False),
        _cloud_sq(xp, xs[None], xs[None], p, True), _cloud_sq(xp, ys[None], ys[None], p, True),
    )
    costs = [ground_cost(sq, p) for sq in (sq_xy, sq_xx, sq_yy)]
    largests = xp.stack([xp.max(c) for c in costs]).tolist()   # one transfer on CuPy
    _solver.check_relative_eps(eps / unit, max(largests), dtype, user_eps=eps,
                               cost_name=COST_NAME, data_name="x and y", unit=unit, p=p)
    solve = dict(eps=eps / unit, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit,
                 impl=_solver.SINKHORN.choose(x))
    xy = _solver.solve_batch(xp, a[None], b[None], costs[0], largest=largests[0], **solve)
    xx = _solver.solve_batch(xp, a[None], a[None], costs[1], symmetric=True, largest=largests[1],
                             **solve)
    yy = _solver.solve_batch(xp, b[None], b[None], costs[2], symmetric=True, largest=largests[2],
                             **solve)
    term = _term(xp, value)
    divergence = term(xy) - 0.5 * (term(xx) + term(yy))
    check_output(divergence, "the Sinkhorn divergence", xp=xp)
    ctx = SinkhornDivergenceContext(
        x=xs, y=ys, scale=scale, unit=unit, a=a, b=b, a_mass=a_mass, b_mass=b_mass,
        weights_given=weights_given, p=p, value=value, sq_xy=sq_xy, sq_xx=sq_xx,
        sq_yy=sq_yy, xy=xy, xx=xx, yy=yy, sq_unit=sq_unit,
    )
    return float(divergence[0]), ctx


def sinkhorn_divergence_backward(ctx: SinkhornDivergenceContext, d_value) -> SinkhornDivergenceGrads:
    """Gradients of ``d_value * sd`` w.r.t. x, y (and a, b when weights were given)."""
    check_context(ctx, "ctx", SinkhornDivergenceContext)
    ns = get_backend(ctx.x)
    xp = ns.xp
    one = _scalar_upstream(d_value, ns, ctx.x.dtype)
    half = -0.5 * one
    x, y, p = ctx.x[None], ctx.y[None], ctx.p
    d_cost, da_xy, db_xy = _ot_vjp(xp, ctx.xy, ctx.value, one)
    dx_xy, dy_xy = _ground_cost_backward(xp, x, y, ctx.sq_xy, p, d_cost)
    d_cost, da1, da2 = _ot_vjp(xp, ctx.xx, ctx.value, half)
    dx1, dx2 = _ground_cost_backward(xp, x, x, ctx.sq_xx, p, d_cost)
    d_cost, db1, db2 = _ot_vjp(xp, ctx.yy, ctx.value, half)
    dy1, dy2 = _ground_cost_backward(xp, y, y, ctx.sq_yy, p, d_cost)
    try:
        return _divergence_grads(ns, ctx, (da_xy, da1, da2), (db_xy, db1, db2),
                                 (dx_xy, dx1, dx2), (dy_xy, dy1, dy2))
    except ValueError:
        # Named after its cause where the transport cost's implicit solve came out NaN
        # (an overflow of the gradient gives inf; this check runs only on the error path).
        if ctx.value == "transport_cost" and any(
                bool(xp.any(xp.isnan(v))) for v in (da_xy, da1, da2, db_xy, db1, db2)):
            raise ValueError(left_range_message(np.dtype(ctx.x.dtype).name)) from None
        raise


def _divergence_grads(ns, ctx, da, db, dx, dy) -> SinkhornDivergenceGrads:
    xp, p = ns.xp, ctx.p
    (da_xy, da1, da2), (db_xy, db1, db2) = da, db
    (dx_xy, dx1, dx2), (dy_xy, dy1, dy2) = dx, dy
    grad_a = grad_b = None
    if ctx.weights_given:
        grad_a = _weight_gradient(ns, (da_xy + da1 + da2)[0], ctx.a_mass, "a")
        grad_b = _weight_gradient(ns, (db_xy + db1 + db2)[0], ctx.b_mass, "b")
    with np.errstate(over="ignore", invalid="ignore"):
        d_x, d_y = (dx_xy + dx1 + dx2)[0], (dy_xy + dy1 + dy2)[0]
    factors = (ctx.unit, ctx.scale, ctx.sq_unit)
    return SinkhornDivergenceGrads(
        x=_to_points(ns, d_x, *factors, "x", p), y=_to_points(ns, d_y, *factors, "y", p),
        a=grad_a, b=grad_b,
    )


def _weight_gradient(ns, gradient, mass, name: str):
    """``gradient / mass`` as the reference's ``_weight_gradient``: its ValueError
    where that exceeds the dtype (checked on NumPy, on CuPy while data checks are on)."""
    xp = ns.xp
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        out = gradient / mass
    if data_checks(ns) and not bool(xp.all(xp.isfinite(out))):
        raise ValueError(weight_gradient_message(name, float(xp.min(xp.asarray(mass))),
                                                  np.dtype(out.dtype).name))
    return out


def sinkhorn_divergence(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                        max_iter=1000, tol=1e-9, eps_scaling=None):
    """``sd, grads`` of the Sinkhorn divergence: one call of the pair."""
    divergence, ctx = sinkhorn_divergence_forward(
        x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling,
    )
    return divergence, sinkhorn_divergence_backward(ctx, 1.0)

#: The family's implementations: the Sinkhorn solver's (registered in
#: :data:`refdml.gpu.families.KERNEL_FAMILIES`).
IMPLEMENTATIONS = _solver.SINKHORN
