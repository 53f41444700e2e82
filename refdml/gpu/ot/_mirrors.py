"""The public functions of :mod:`refdml.gpu.ot`: each validates its input once, chooses the
implementation once (``impl = IMPLEMENTATIONS.choose(x)``) and hands it down to the array
path (:mod:`refdml.gpu.ot._common`, :mod:`~refdml.gpu.ot._sinkhorn`,
:mod:`~refdml.gpu.ot._pairs`). Backwards solve nothing and choose nothing: they are array
code on the forward's context.

What differs from the reference and where a call synchronises on CuPy: the family
docstring (:mod:`refdml.gpu.ot`)."""

from __future__ import annotations

import numpy as np

from refdml._backend import as_input_array, get_backend
from refdml._shared.distances import sum_to_shape
from refdml._shared.ot import (
    VALUES,
    check_output,
    check_p,
    check_solver_args,
    ground_cost,
    COST_NAME,
    weight_gradient_message,
)
from refdml._validation import (
    as_fast_array, check_choice, check_context, check_fast_upstream, check_scalar, data_checks,
    fast_labels, result_dtype,
)
from refdml.gpu.losses import terms_dtype
from refdml.gpu.ot import _sinkhorn as _solver
from refdml.gpu.ot._common import (
    _as_batch,
    _cloud_sq,
    _cost_and_weights,
    _ground_cost_backward,
    _ot_vjp,
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
from refdml.gpu.ot._kernels import IMPLEMENTATIONS
from refdml.gpu.ot._pairs import (
    _accumulate,
    _all_triplets,
    _losses_divergences,
    _pair_divergences,
    _pair_divergences_backward,
    _upper_pairs,
)
from refdml.ot import (
    EntropicOTContext,
    OTGrads,
    PairwiseSinkhornDivergenceContext,
    PairwiseSinkhornDivergenceGrads,
    SinkhornDivergenceContext,
    SinkhornDivergenceGrads,
    SinkhornResult,
    WassersteinLossGrads,
    WContrastiveContext,
    WTripletContext,
)

__all__ = [
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
    problem did not reach ``tol`` (raised to the dtype's floor, see the family docstring).
    """
    eps, max_iter, tol, eps_scaling = check_solver_args(eps, max_iter, tol, eps_scaling)
    xp, a, _, b, _, cost = _cost_and_weights(a, b, cost)
    a_b, b_b, cost_b, batch_shape = _as_batch(xp, a, b, cost)
    batch = _solve_scaled(xp, a_b, b_b, cost_b, eps=eps, max_iter=max_iter, tol=tol,
                          eps_scaling=eps_scaling, impl=IMPLEMENTATIONS.choose(cost_b))
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
                          eps_scaling=eps_scaling, impl=IMPLEMENTATIONS.choose(cost_b))
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
        p, scale, "x and y", _cloud_sq(xp, xs[None], ys[None], False),
        _cloud_sq(xp, xs[None], xs[None], True), _cloud_sq(xp, ys[None], ys[None], True),
    )
    costs = [ground_cost(sq, p) for sq in (sq_xy, sq_xx, sq_yy)]
    largests = xp.stack([xp.max(c) for c in costs]).tolist()   # one transfer on CuPy
    _solver.check_relative_eps(eps / unit, max(largests), dtype, user_eps=eps,
                               cost_name=COST_NAME, data_name="x and y", unit=unit, p=p)
    solve = dict(eps=eps / unit, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit,
                 impl=IMPLEMENTATIONS.choose(x))
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
    p = ctx.p
    (da_xy, da1, da2), (db_xy, db1, db2) = da, db
    (dx_xy, dx1, dx2), (dy_xy, dy1, dy2) = dx, dy
    grad_a = grad_b = None
    if ctx.weights_given:
        grad_a = _weight_gradient(ns, (da_xy + da1 + da2)[0], ctx.a_mass, "a")
        grad_b = _weight_gradient(ns, (db_xy + db1 + db2)[0], ctx.b_mass, "b")
    with ns.errstate(over="ignore", invalid="ignore"):
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
    with ns.errstate(over="ignore", divide="ignore", invalid="ignore"):
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


# --------------------------------------------------------------------------- many pairs
def _cloud_batch(clouds, name: str):
    ns = get_backend(clouds)
    clouds = as_fast_array(clouds, name, ndim=3, ns=ns)
    if clouds.shape[1] < 1 or clouds.shape[2] < 1:
        raise ValueError(f"{name} must have shape (B, n, d) with n, d >= 1, got {clouds.shape}")
    return ns, clouds


def pairwise_sinkhorn_divergence_forward(clouds, *, eps, p=2, value="regularized",
                                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """(B, B) Sinkhorn divergences between all pairs of uniform clouds; ``(sd, ctx)``.

    As :func:`refdml.ot.pairwise_sinkhorn_divergence_forward`: the ``B (B - 1) / 2`` cross
    problems are one batch, the ``B`` self problems another.
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = check_solver_args(eps, max_iter, tol, eps_scaling)
    p = check_p(p)
    ns, clouds = _cloud_batch(clouds, "clouds")
    xp = ns.xp
    n_clouds = clouds.shape[0]
    out = xp.zeros((n_clouds, n_clouds), dtype=clouds.dtype)
    if n_clouds < 2:
        return out, PairwiseSinkhornDivergenceContext(shape=tuple(clouds.shape), pairs=None)
    pairs = _upper_pairs(xp, n_clouds)
    first, second = pairs[:, 0], pairs[:, 1]
    values, ctx = _pair_divergences(
        xp, clouds, pairs, xp.arange(n_clouds), eps=eps, p=p, value=value, max_iter=max_iter,
        tol=tol, eps_scaling=eps_scaling, impl=IMPLEMENTATIONS.choose(clouds),
    )
    out[first, second] = values
    out[second, first] = values
    return out, PairwiseSinkhornDivergenceContext(shape=tuple(clouds.shape), pairs=ctx)


def pairwise_sinkhorn_divergence_backward(ctx: PairwiseSinkhornDivergenceContext, d_divergence):
    """Gradient of ``<d_divergence, sd>`` w.r.t. the clouds; ``d_divergence`` (B, B)."""
    check_context(ctx, "ctx", PairwiseSinkhornDivergenceContext)
    n_clouds = ctx.shape[0]
    if ctx.pairs is None:
        ns = get_backend(d_divergence) if hasattr(d_divergence, "shape") else get_backend()
        check_fast_upstream(d_divergence, "d_divergence", (n_clouds, n_clouds), ns, np.float64)
        return PairwiseSinkhornDivergenceGrads(ns.xp.zeros(ctx.shape))
    ns = get_backend(ctx.pairs.clouds)
    d = check_fast_upstream(d_divergence, "d_divergence", (n_clouds, n_clouds), ns,
                            ctx.pairs.clouds.dtype)
    first, second = ctx.pairs.pairs[:, 0], ctx.pairs.pairs[:, 1]
    d_unique = d[first, second] + d[second, first]
    return PairwiseSinkhornDivergenceGrads(_pair_divergences_backward(ns, ctx.pairs, d_unique))


def pairwise_sinkhorn_divergence(clouds, *, eps, p=2, value="regularized", max_iter=1000,
                                 tol=1e-9, eps_scaling=None):
    """(B, B) matrix of Sinkhorn divergences (the forward alone)."""
    return pairwise_sinkhorn_divergence_forward(
        clouds, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )[0]


# --------------------------------------------------------------------------- losses
def _loss_args(features, labels, margin, eps, p, value, max_iter, tol, eps_scaling):
    ns, features = _cloud_batch(features, "features")
    labels = fast_labels(labels, "labels", ns, length=features.shape[0])
    margin = check_scalar(margin, "margin", low=0.0)
    check_choice(value, "value", VALUES)
    solver = check_solver_args(eps, max_iter, tol, eps_scaling)
    return ns, features, labels, margin, check_p(p), solver


def _index_rows(rows, name: str, width: int, n_items: int, ns):
    """Integer index rows (K, width) in ``[0, n_items)``, as int64 of ``ns`` (reference wording)."""
    xp = ns.xp
    array = as_input_array(rows)
    dtype = np.dtype(array.dtype)
    if dtype == bool or not np.issubdtype(dtype, np.integer):
        if array.size == 0 and array.ndim == 2 and array.shape[1] == width:
            return xp.zeros((0, width), dtype=xp.int64)
        raise TypeError(f"{name} must be an integer array of shape (K, {width}), got dtype {dtype}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (K, {width}), got {tuple(array.shape)}")
    array = xp.asarray(array, dtype=xp.int64)
    if array.size and data_checks(ns):
        low, high = xp.stack([array.min(), array.max()]).tolist()   # one transfer on CuPy
        if low < 0 or high >= n_items:
            raise ValueError(f"{name} holds indices outside [0, {n_items}), got {low}..{high}")
    return array


def wcontrastive_forward(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein contrastive loss, Eq. (1); ``(loss, ctx)`` as the reference (loss: a float)."""
    ns, features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    xp, dtype = ns.xp, features.dtype
    n_images = features.shape[0]
    if pairs is None:
        pairs = _upper_pairs(xp, n_images)
    pairs = _index_rows(pairs, "pairs", 2, n_images, ns)
    if pairs.shape[0] == 0:
        return 0.0, WContrastiveContext(shape=tuple(features.shape), divergences=None,
                                        d_unique=xp.zeros(0, dtype=dtype))
    if data_checks(ns) and bool(xp.any(pairs[:, 0] == pairs[:, 1])):
        row = int(xp.flatnonzero(pairs[:, 0] == pairs[:, 1])[0])
        raise ValueError(
            f"pairs must join two different images, got {pairs[row].tolist()} at row {row}"
        )
    d_w, inverse, divergences = _losses_divergences(
        ns, features, pairs, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling, impl=IMPLEMENTATIONS.choose(features))
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    # The (K,) terms in float64 where the margin is no float32 (refdml/gpu/losses/__init__.py's rule); the
    # loss is summed in float64 as the reference's (K float32 terms near 1e38 overflowed).
    d_w = d_w.astype(terms_dtype(dtype, margin), copy=False)
    hinge = margin - d_w
    terms = xp.where(same, d_w, xp.maximum(hinge, 0))
    count = pairs.shape[0]
    d_rows = xp.where(same, 1.0, xp.where(hinge > 0, -1.0, 0.0)) / count
    d_unique = _accumulate(ns, d_rows, inverse, divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(terms, dtype=xp.float64)) / count     # the Python float: one sync
    return loss, WContrastiveContext(shape=tuple(features.shape), divergences=divergences,
                                     d_unique=d_unique)


def _loss_backward(ctx, d_value):
    if ctx.divergences is None:
        ns = get_backend(ctx.d_unique)
        check_fast_upstream(d_value, "d_value", (), ns, ctx.d_unique.dtype)
        return WassersteinLossGrads(ns.xp.zeros(ctx.shape, dtype=ctx.d_unique.dtype))
    ns = get_backend(ctx.divergences.clouds)
    d = _scalar_upstream(d_value, ns, ctx.d_unique.dtype)
    return WassersteinLossGrads(
        _pair_divergences_backward(ns, ctx.divergences, d * ctx.d_unique, "features"))


def wcontrastive_backward(ctx: WContrastiveContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (no re-solve)."""
    check_context(ctx, "ctx", WContrastiveContext)
    return _loss_backward(ctx, d_value)


def wcontrastive(features, labels, *, margin, eps, p=1, value="regularized", pairs=None,
                 max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein contrastive loss (one call of the pair)."""
    loss, ctx = wcontrastive_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, pairs=pairs,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wcontrastive_backward(ctx, 1.0)


def wtriplet_forward(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
                     max_iter=1000, tol=1e-9, eps_scaling=None):
    """Wasserstein triplet loss, Eq. (2); ``(loss, ctx)`` as the reference (loss: a float)."""
    ns, features, labels, margin, p, (eps, max_iter, tol, eps_scaling) = _loss_args(
        features, labels, margin, eps, p, value, max_iter, tol, eps_scaling
    )
    xp, dtype = ns.xp, features.dtype
    n_images = features.shape[0]
    triplets = (_all_triplets(xp, labels) if triplets is None
                else _index_rows(triplets, "triplets", 3, n_images, ns))
    if triplets.shape[0] == 0:
        return 0.0, WTripletContext(shape=tuple(features.shape), divergences=None,
                                    d_unique=xp.zeros(0, dtype=dtype))
    bad = (triplets[:, 0] == triplets[:, 1]) | (triplets[:, 0] == triplets[:, 2])
    if data_checks(ns) and bool(xp.any(bad)):
        row = int(xp.flatnonzero(bad)[0])
        raise ValueError(
            "triplets must have anchor != positive and anchor != negative, got "
            f"{triplets[row].tolist()} at row {row}"
        )
    pairs = xp.concatenate([triplets[:, [0, 1]], triplets[:, [0, 2]]])
    d_w, inverse, divergences = _losses_divergences(
        ns, features, pairs, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling, impl=IMPLEMENTATIONS.choose(features))
    count = triplets.shape[0]
    # As wcontrastive: the terms in float64 where the margin is no float32, the sum in float64.
    d_w = d_w.astype(terms_dtype(dtype, margin), copy=False)
    hinge = d_w[:count] - d_w[count:] + margin
    active = (hinge > 0).astype(dtype) / count
    d_unique = _accumulate(ns, xp.concatenate([active, -active]), inverse,
                           divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(xp.maximum(hinge, 0), dtype=xp.float64)) / count  # one sync
    return loss, WTripletContext(shape=tuple(features.shape), divergences=divergences,
                                 d_unique=d_unique)


def wtriplet_backward(ctx: WTripletContext, d_value=1.0) -> WassersteinLossGrads:
    """Gradient of ``d_value * loss`` w.r.t. the features (no re-solve)."""
    check_context(ctx, "ctx", WTripletContext)
    return _loss_backward(ctx, d_value)


def wtriplet(features, labels, *, margin, eps, p=1, value="regularized", triplets=None,
             max_iter=1000, tol=1e-9, eps_scaling=None):
    """``loss, grads`` of the Wasserstein triplet loss (one call of the pair)."""
    loss, ctx = wtriplet_forward(
        features, labels, margin=margin, eps=eps, p=p, value=value, triplets=triplets,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return loss, wtriplet_backward(ctx, 1.0)
