"""The OT fast path over many pairs: all-pairs Sinkhorn divergences and the Wasserstein losses.

Re-exported by :mod:`refdml.gpu.ot`; see its docstring for what differs from the reference
and where the fast path synchronises."""

from __future__ import annotations


import numpy as np

from refdml.gpu.ot._compiled import MAX_POINTS
from refdml._shared.ot import (
    COST_NAME,
    VALUES,
    PairsContext,
    check_output,
    check_p,
    check_solver_args,
    ground_cost,
)
from refdml._validation import (
    as_fast_array, check_choice, check_context, check_fast_upstream, check_scalar, data_checks,
    fast_labels,
)
from refdml._backend import get_backend, is_device_array
from refdml.gpu.ot import _sinkhorn as _solver
from refdml.gpu.losses import terms_dtype
from refdml.ot import PairwiseSinkhornDivergenceContext, PairwiseSinkhornDivergenceGrads, WassersteinLossGrads, WContrastiveContext, WTripletContext

from refdml.gpu.ot._common import (
    _ot_vjp,
    _cloud_sq,
    _ground_cost_backward,
    _scalar_upstream,
    _scaled_points,
    _sq_and_unit,
    _term,
    _to_points,
)

# --------------------------------------------------------------------------- many pairs
def _index_add(xp, target, index, values) -> None:
    """``target[index] += values`` with repeated indices summed (NumPy or CuPy)."""
    if xp is np:
        np.add.at(target, index, values)
    else:
        import cupyx

        cupyx.scatter_add(target, index, values)


def _upper_pairs(xp, n: int):
    """The pairs ``i < j`` of ``n`` items, ``(n (n - 1) / 2, 2)`` int64 of ``xp``, built on the
    host and copied over: CuPy's ``triu_indices`` masks on the device and reads the count
    back (two synchronisations)."""
    return xp.asarray(np.stack(np.triu_indices(n, k=1), axis=1).astype(np.int64))


# Largest Gram matrix of all points (entries) that _cross_sq builds instead of K small ones.
_GRAM_ENTRIES = 1 << 24


def _compiled_costs(impl, clouds) -> bool:
    """Whether the pair costs of ``clouds`` come from ``impl.pair_sq`` (the CPU twins'
    :func:`refdml.gpu.ot._compiled.compiled_pair_sq`, on NumPy: the implementation has
    one, and the clouds have at most ``MAX_POINTS`` points, the small-problem solver's
    route)."""
    return impl.pair_sq is not None and clouds.shape[1] <= MAX_POINTS


def _cross_sq(xp, impl, clouds, first, second, p):
    """``||x_i - y_j||^2`` (K, n, n) for the clouds of every pair (``first[k]``, ``second[k]``).

    Where ``impl`` computes them (:func:`_compiled_costs`), ``impl.pair_sq``. Otherwise (the
    array path, the CUDA kernels' route), when the pairs cover at least a quarter of all
    ``B^2`` and the ``(B n, B n)`` Gram matrix is small, one product of all points (the
    Gram identity as :func:`_cloud_sq`, the blocks gathered) instead of ``K`` small
    products of gathered ``(n, d)`` clouds: one large GEMM and no (K, n, d) copies.
    """
    n_clouds, n, d = clouds.shape
    if _compiled_costs(impl, clouds):
        return impl.pair_sq(clouds, first, second)
    if 4 * first.shape[0] < n_clouds * n_clouds or (n_clouds * n) ** 2 > _GRAM_ENTRIES:
        return _cloud_sq(xp, clouds[first], clouds[second], p, False)
    flat = clouds.reshape(n_clouds * n, d)
    norms = xp.sum(flat * flat, axis=1).reshape(n_clouds, n)
    gram = (flat @ flat.T).reshape(n_clouds, n, n_clouds, n)
    sq = gram[first, :, second, :]                   # (K, n, n): the advanced axis first
    sq *= -2.0
    sq += norms[first][:, :, None]
    sq += norms[second][:, None, :]
    return xp.maximum(sq, sq.dtype.type(0), out=sq)


def _pair_divergences(xp, clouds, unique_pairs, selves, *, eps, p, value, max_iter, tol,
                      eps_scaling, name="clouds"):
    """SD for every row (i, j), i < j, of ``unique_pairs`` (K, 2); ``(values (K,), ctx)``.

    All K cross problems are one batch, the S self problems (``selves``) another. Every
    public function of the pairs comes through here once: the implementation of the
    family is chosen here (:data:`refdml.gpu.ot._sinkhorn.SINKHORN`), for the costs and
    both solves.
    """
    n, dtype = clouds.shape[1], clouds.dtype
    scale, scaled = _scaled_points(xp, clouds)
    impl = _solver.SINKHORN.choose(clouds)
    first, second = unique_pairs[:, 0], unique_pairs[:, 1]
    sq_cross = _cross_sq(xp, impl, scaled, first, second, p)
    if _compiled_costs(impl, scaled):
        sq_self = impl.pair_sq(scaled, selves, selves)
    else:
        sq_self = _cloud_sq(xp, scaled[selves], scaled[selves], p, True)
    unit, sq_unit, sq_cross, sq_self = _sq_and_unit(p, scale, name, sq_cross, sq_self)
    cost_cross, cost_self = ground_cost(sq_cross, p), ground_cost(sq_self, p)
    # One transfer: the largest costs and the smallest of the problems' largest costs
    # (the latter spare the solver's large-eps finish its work where no problem needs it).
    largest_cross, largest_self, smallest_cross, smallest_self = xp.stack([
        xp.max(cost_cross), xp.max(cost_self), xp.min(xp.max(cost_cross, axis=(1, 2))),
        xp.min(xp.max(cost_self, axis=(1, 2)))]).tolist()
    _solver.check_relative_eps(eps / unit, max(largest_cross, largest_self), dtype, user_eps=eps,
                               cost_name=COST_NAME, data_name=name, unit=unit, p=p)
    solve = dict(eps=eps / unit, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit,
                 small_kernels=True, impl=impl)
    weights = xp.full((1, n), 1.0 / n, dtype=dtype)
    k, s = sq_cross.shape[0], sq_self.shape[0]
    cross = _solver.solve_batch(xp, xp.repeat(weights, k, 0), xp.repeat(weights, k, 0),
                                cost_cross, largest=largest_cross, smallest=smallest_cross,
                                **solve)
    self_ = _solver.solve_batch(xp, xp.repeat(weights, s, 0), xp.repeat(weights, s, 0),
                                cost_self, symmetric=True, largest=largest_self,
                                smallest=smallest_self, **solve)
    term = _term(xp, value)
    self_value = xp.zeros(clouds.shape[0], dtype=dtype)
    self_value[selves] = term(self_)
    values = term(cross) - 0.5 * (self_value[first] + self_value[second])
    check_output(values, "the Sinkhorn divergence", xp=xp)
    ctx = PairsContext(scaled, scale, unit, unique_pairs, selves, sq_cross, sq_self, cross,
                        self_, p, value, sq_unit)
    return values, ctx


def _pair_divergences_backward(ns, ctx: PairsContext, d_unique, name: str = "clouds"):
    """Gradient w.r.t. the (unscaled) clouds of ``sum_k d_unique[k] SD(pairs[k])``
    (``name``: the argument the clouds were, for the error where it overflows)."""
    xp = ns.xp
    clouds, pairs = ctx.clouds, ctx.pairs
    first, second = pairs[:, 0], pairs[:, 1]
    grad = xp.zeros_like(clouds)
    d_cost, _, _ = _ot_vjp(xp, ctx.cross, ctx.value, d_unique)
    d_x, d_y = _ground_cost_backward(xp, clouds[first], clouds[second], ctx.sq_cross, ctx.p,
                                     d_cost)
    with np.errstate(over="ignore", invalid="ignore"):  # named by _to_points
        _index_add(xp, grad, first, d_x)
        _index_add(xp, grad, second, d_y)
    d_self = xp.zeros(clouds.shape[0], dtype=clouds.dtype)
    _index_add(xp, d_self, first, -0.5 * d_unique)
    _index_add(xp, d_self, second, -0.5 * d_unique)
    d_cost, _, _ = _ot_vjp(xp, ctx.self_, ctx.value, d_self[ctx.selves])
    x = clouds[ctx.selves]
    d_x1, d_x2 = _ground_cost_backward(xp, x, x, ctx.sq_self, ctx.p, d_cost)
    with np.errstate(over="ignore", invalid="ignore"):
        grad[ctx.selves] += d_x1 + d_x2                    # selves are unique
    return _to_points(ns, grad, ctx.unit, ctx.scale, ctx.sq_unit, name, ctx.p)


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
        return out, PairwiseSinkhornDivergenceContext(tuple(clouds.shape), None)
    pairs = _upper_pairs(xp, n_clouds)
    first, second = pairs[:, 0], pairs[:, 1]
    values, ctx = _pair_divergences(
        xp, clouds, pairs, xp.arange(n_clouds), eps=eps, p=p,
        value=value, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    out[first, second] = values
    out[second, first] = values
    return out, PairwiseSinkhornDivergenceContext(tuple(clouds.shape), ctx)


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
    array = rows if is_device_array(rows) else np.asarray(rows)
    kind = np.dtype(array.dtype)
    if kind == bool or not np.issubdtype(kind, np.integer):
        if array.size == 0 and array.ndim == 2 and array.shape[1] == width:
            return xp.zeros((0, width), dtype=xp.int64)
        raise TypeError(f"{name} must be an integer array of shape (K, {width}), got dtype {kind}")
    if array.ndim != 2 or array.shape[1] != width:
        raise ValueError(f"{name} must have shape (K, {width}), got {tuple(array.shape)}")
    array = xp.asarray(array, dtype=xp.int64)
    if array.size and data_checks(ns):
        low, high = xp.stack([array.min(), array.max()]).tolist()   # one transfer on CuPy
        if low < 0 or high >= n_items:
            raise ValueError(f"{name} holds indices outside [0, {n_items}), got {low}..{high}")
    return array


def _unique_pairs(xp, pairs, n_images: int):
    """Distinct unordered pairs (lexicographic, i < j) and the map from the rows to them."""
    ordered = xp.sort(pairs, axis=1)
    code = ordered[:, 0] * n_images + ordered[:, 1]
    unique, inverse = xp.unique(code, return_inverse=True)
    unique_pairs = xp.stack([unique // n_images, unique % n_images], axis=1)
    return unique_pairs, inverse.reshape(-1), xp.unique(unique_pairs)


def _losses_divergences(ns, features, pairs, eps, p, value, max_iter, tol, eps_scaling):
    xp = ns.xp
    unique_pairs, inverse, selves = _unique_pairs(xp, pairs, features.shape[0])
    values, ctx = _pair_divergences(
        xp, features, unique_pairs, selves, eps=eps, p=p, value=value, max_iter=max_iter,
        tol=tol, eps_scaling=eps_scaling, name="features",
    )
    return values[inverse], inverse, ctx


def _accumulate(xp, d_rows, inverse, n_unique: int, dtype):
    # A scatter-add in float64 (bincount's sums), not bincount: CuPy's bincount reads
    # max(inverse) and tests for a negative entry on the host (two synchronisations).
    out = xp.zeros(n_unique, dtype=xp.float64)
    _index_add(xp, out, inverse, d_rows.astype(xp.float64, copy=False))
    return out.astype(dtype)


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
        return 0.0, WContrastiveContext(tuple(features.shape), None, xp.zeros(0, dtype=dtype))
    if data_checks(ns) and bool(xp.any(pairs[:, 0] == pairs[:, 1])):
        row = int(xp.flatnonzero(pairs[:, 0] == pairs[:, 1])[0])
        raise ValueError(
            f"pairs must join two different images, got {pairs[row].tolist()} at row {row}"
        )
    d_w, inverse, divergences = _losses_divergences(ns, features, pairs, eps, p, value,
                                                    max_iter, tol, eps_scaling)
    same = labels[pairs[:, 0]] == labels[pairs[:, 1]]
    # The (K,) terms in float64 where the margin is no float32 (refdml/gpu/losses/__init__.py's rule); the
    # loss is summed in float64 as the reference's (K float32 terms near 1e38 overflowed).
    d_w = d_w.astype(terms_dtype(dtype, margin), copy=False)
    hinge = margin - d_w
    terms = xp.where(same, d_w, xp.maximum(hinge, 0))
    count = pairs.shape[0]
    d_rows = xp.where(same, 1.0, xp.where(hinge > 0, -1.0, 0.0)) / count
    d_unique = _accumulate(xp, d_rows, inverse, divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(terms, dtype=xp.float64)) / count     # the Python float: one sync
    return loss, WContrastiveContext(tuple(features.shape), divergences, d_unique)


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


def _all_triplets(xp, labels):
    """Every (a, p, n) with y_a = y_p != y_n, a != p, in the reference's order."""
    same = labels[:, None] == labels[None, :]
    positive = same & ~xp.eye(labels.shape[0], dtype=bool)
    mask = positive[:, :, None] & ~same[:, None, :]
    return xp.stack(xp.nonzero(mask), axis=1).astype(xp.int64)


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
        return 0.0, WTripletContext(tuple(features.shape), None, xp.zeros(0, dtype=dtype))
    bad = (triplets[:, 0] == triplets[:, 1]) | (triplets[:, 0] == triplets[:, 2])
    if data_checks(ns) and bool(xp.any(bad)):
        row = int(xp.flatnonzero(bad)[0])
        raise ValueError(
            "triplets must have anchor != positive and anchor != negative, got "
            f"{triplets[row].tolist()} at row {row}"
        )
    pairs = xp.concatenate([triplets[:, [0, 1]], triplets[:, [0, 2]]])
    d_w, inverse, divergences = _losses_divergences(ns, features, pairs, eps, p, value,
                                                    max_iter, tol, eps_scaling)
    count = triplets.shape[0]
    # As wcontrastive: the terms in float64 where the margin is no float32, the sum in float64.
    d_w = d_w.astype(terms_dtype(dtype, margin), copy=False)
    hinge = d_w[:count] - d_w[count:] + margin
    active = (hinge > 0).astype(dtype) / count
    d_unique = _accumulate(xp, xp.concatenate([active, -active]), inverse,
                           divergences.pairs.shape[0], dtype)
    loss = float(xp.sum(xp.maximum(hinge, 0), dtype=xp.float64)) / count  # one sync
    return loss, WTripletContext(tuple(features.shape), divergences, d_unique)


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
