"""The OT fast path over many pairs: the Sinkhorn divergences of many pairs of clouds, shared
by the all-pairs mirror and the Wasserstein losses (array path; the pair costs and the
solves are the chosen implementation's).

The public functions are :mod:`refdml.gpu.ot._mirrors`'; see :mod:`refdml.gpu.ot` for what
differs from the reference and where the fast path synchronises."""

from __future__ import annotations

import numpy as np

from refdml._shared.ot import COST_NAME, PairsContext, check_output, ground_cost
from refdml.gpu.ot import _sinkhorn as _solver
from refdml.gpu.ot._common import (
    _ot_vjp,
    _ground_cost_backward,
    _scaled_points,
    _sq_and_unit,
    _term,
    _to_points,
)


def _upper_pairs(xp, n: int):
    """The pairs ``i < j`` of ``n`` items, ``(n (n - 1) / 2, 2)`` int64 of ``xp``, built on the
    host and copied over: CuPy's ``triu_indices`` masks on the device and reads the count
    back (two synchronisations)."""
    return xp.asarray(np.stack(np.triu_indices(n, k=1), axis=1).astype(np.int64))


def _pair_divergences(xp, clouds, unique_pairs, selves, *, eps, p, value, max_iter, tol,
                      eps_scaling, impl, name="clouds"):
    """SD for every row (i, j), i < j, of ``unique_pairs`` (K, 2); ``(values (K,), ctx)``.

    All K cross problems are one batch, the S self problems (``selves``) another. ``impl``:
    the implementation the public function chose (a member of
    :data:`refdml.gpu.ot.IMPLEMENTATIONS`), for the pair costs and both solves.
    """
    n, dtype = clouds.shape[1], clouds.dtype
    scale, scaled = _scaled_points(xp, clouds)
    first, second = unique_pairs[:, 0], unique_pairs[:, 1]
    sq_cross = impl.cross_sq(xp, scaled, first, second)
    sq_self = impl.self_sq(xp, scaled, selves)
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
    ctx = PairsContext(clouds=scaled, scale=scale, unit=unit, pairs=unique_pairs, selves=selves,
                       sq_cross=sq_cross, sq_self=sq_self, cross=cross, self_=self_, p=p,
                       value=value, sq_unit=sq_unit)
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
    with ns.errstate(over="ignore", invalid="ignore"):  # named by _to_points
        ns.scatter_add(grad, first, d_x)
        ns.scatter_add(grad, second, d_y)
    d_self = xp.zeros(clouds.shape[0], dtype=clouds.dtype)
    ns.scatter_add(d_self, first, -0.5 * d_unique)
    ns.scatter_add(d_self, second, -0.5 * d_unique)
    d_cost, _, _ = _ot_vjp(xp, ctx.self_, ctx.value, d_self[ctx.selves])
    x = clouds[ctx.selves]
    d_x1, d_x2 = _ground_cost_backward(xp, x, x, ctx.sq_self, ctx.p, d_cost)
    with ns.errstate(over="ignore", invalid="ignore"):
        grad[ctx.selves] += d_x1 + d_x2                    # selves are unique
    return _to_points(ns, grad, ctx.unit, ctx.scale, ctx.sq_unit, name, ctx.p)


# --------------------------------------------------------------------------- losses
def _unique_pairs(xp, pairs, n_images: int):
    """Distinct unordered pairs (lexicographic, i < j) and the map from the rows to them."""
    ordered = xp.sort(pairs, axis=1)
    code = ordered[:, 0] * n_images + ordered[:, 1]
    unique, inverse = xp.unique(code, return_inverse=True)
    unique_pairs = xp.stack([unique // n_images, unique % n_images], axis=1)
    return unique_pairs, inverse.reshape(-1), xp.unique(unique_pairs)


def _losses_divergences(ns, features, pairs, *, eps, p, value, max_iter, tol, eps_scaling,
                        impl):
    """The divergence of every row of ``pairs`` (each distinct pair solved once):
    ``(divergences (K,), inverse, ctx)``, ``inverse`` mapping the rows to the distinct pairs."""
    xp = ns.xp
    unique_pairs, inverse, selves = _unique_pairs(xp, pairs, features.shape[0])
    values, ctx = _pair_divergences(
        xp, features, unique_pairs, selves, eps=eps, p=p, value=value, max_iter=max_iter,
        tol=tol, eps_scaling=eps_scaling, impl=impl, name="features",
    )
    return values[inverse], inverse, ctx


def _accumulate(ns, d_rows, inverse, n_unique: int, dtype):
    # A scatter-add in float64 (bincount's sums), not bincount: CuPy's bincount reads
    # max(inverse) and tests for a negative entry on the host (two synchronisations).
    xp = ns.xp
    out = xp.zeros(n_unique, dtype=xp.float64)
    ns.scatter_add(out, inverse, d_rows.astype(xp.float64, copy=False))
    return out.astype(dtype)


def _all_triplets(xp, labels):
    """Every (a, p, n) with y_a = y_p != y_n, a != p, in the reference's order."""
    same = labels[:, None] == labels[None, :]
    positive = same & ~xp.eye(labels.shape[0], dtype=bool)
    mask = positive[:, :, None] & ~same[:, None, :]
    return xp.stack(xp.nonzero(mask), axis=1).astype(xp.int64)
