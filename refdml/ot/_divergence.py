"""Sinkhorn divergences between point clouds, Wasserstein DML Eq. (4): forward/backward pairs.

.. math::

    \\mathrm{SD}(\\mu, \\nu) = \\mathrm{OT}(\\mu, \\nu)
        - \\tfrac12 \\big(\\mathrm{OT}(\\mu, \\mu) + \\mathrm{OT}(\\nu, \\nu)\\big),
    \\qquad C_{ij} = \\|x_i - y_j\\|^p

with ``OT`` either the regularised value of Eq. (3) (``value="regularized"``, the paper's;
>= 0 and 0 iff mu == nu for p in {1, 2}, Feydy et al. 2019) or the transport cost ``<pi, C>``
alone (``value="transport_cost"``; what POT's ``empirical_sinkhorn_divergence`` computes
before it clips at 0: it is *not* >= 0 in general, see docs/ot.md).

Printed vs implemented: Eq. (3) defines the p-th power ``W^p`` (cost ``||x - y||^p``) while
Eq. (4) subtracts ``W_{p,eta}`` without the power; taking a p-th root of each term would
break the positivity of the divergence, so Eq. (4) is implemented with the value of Eq. (3)
itself, cost ``||x - y||^p`` (docs/corrections.md).

Scale. The clouds are divided by one power of two ``s`` (exact) before the costs are
formed, and ``eps`` by ``s^p``: ``SD_eps(x, y) = s^p SD_{eps / s^p}(x / s, y / s)``. So any
finite clouds work as long as the costs ``||x - y||^p`` and ``eps`` relative to them are
representable; otherwise a ``ValueError`` says which (never a NaN or a silent 0).

Any ``p >= 1``. For ``p`` other than 1 and 2 the squared distances of the
scaled clouds are further divided by the largest of them, ``T`` (over every problem of the
call), so the costs are ``(D / D_max)^p`` in ``[0, 1]`` with the largest exactly 1, in the
unit ``D_max^p``: scaled distances reach 2, and ``2^p`` overflows float64 from ``p =
1024``, while ``(D / D_max)^p`` neither overflows nor underflows to all zeros at any
``p`` (at ``p = 1e300`` every cost but the largest is 0: the limit). The valid range of
``p`` is where that unit, the largest cost ``D_max^p``, is a float64 in ``[2^-1000,
2^1000]`` (``p |log2 D_max| <= 1000``); beyond it a ``ValueError`` names ``p``, the
largest distance and the ``p`` that would fit. The gradient ``p ||x - y||^(p-2) (x - y)``
is formed as ``p ((D / D_max)^(p-2) d_cost)`` (``p`` last); one beyond float64 is named.

The ratio ``r = eps / max C`` is invariant under that rescaling, so no rescaling helps
where float64 cannot resolve it (``r`` outside ``[1e-13, 1e12]``). For features of
magnitude 1e-200 (p = 1) and ``eps = 0.1``, ``r ~ 1e199``: there ``SD_eps`` equals the
closed form ``<a x b, C_xy> - (<a x a, C_xx> + <b x b, C_yy>) / 2`` up to ``O(C^2 / eps)``,
but the Sinkhorn potentials carry a rounding error ``~ eps 2^-52``, far above ``C``. At
1e200, ``r ~ 1e-201``: ``SD_eps`` is the unregularised ``W_p^p`` up to ``O(eps log n)``,
but the kernel ``exp(-C / eps)`` cannot tell the costs apart. Computing either limit needs
another algorithm (that closed form, or an exact OT solver); the divergences and the
Wasserstein losses refuse instead, with a message that leads with the data (``features``,
``clouds``, ``x and y``) or with ``eps``, whichever lies further from 1, and gives the
range of the largest cost that this ``eps`` allows and the range of ``eps`` that these
data allow (:func:`refdml.ot._sinkhorn._relative_eps_message`).

Gradients: ``dOT/dC`` from :mod:`refdml.ot._entropic` and
``dC_ij/dx_i = p ||x_i - y_j||^(p-2) (x_i - y_j)`` (0 at coincident points for p < 2, the
centre of the subdifferential); the symmetric terms move through both slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale, pairwise_norm, pairwise_sq_distances
from refdml._validation import (
    as_float_array,
    check_choice,
    check_context,
    check_scalar,
    check_upstream,
)
from refdml.ot._entropic import _ot_vjp
from refdml.ot._pot import _solve_batch_pot
from refdml.ot._sinkhorn import (
    VALUES,
    _check_relative_eps,
    _check_solver_args,
    _check_weights,
    _OTBatch,
    _solve_batch,
    _weight_gradient,
)

__all__ = [
    "PairwiseSinkhornDivergenceContext",
    "PairwiseSinkhornDivergenceGrads",
    "SinkhornDivergenceContext",
    "SinkhornDivergenceGrads",
    "pairwise_sinkhorn_divergence",
    "pairwise_sinkhorn_divergence_backward",
    "pairwise_sinkhorn_divergence_forward",
    "sinkhorn_divergence",
    "sinkhorn_divergence_backward",
    "sinkhorn_divergence_forward",
]

_COST_NAME = "the largest cost ||x - y||^p"
#: The solvers of :func:`sinkhorn_divergence_forward`: refdml's own log-domain Sinkhorn
#: (:func:`refdml.ot._sinkhorn._solve_batch`) or POT's (:mod:`refdml.ot._pot`).
SOLVERS = ("refdml", "pot")


# ----------------------------------------------------------------------------------------
# Ground cost ||x - y||^p between point clouds, batched, in rescaled units


def _sq_dist(x: np.ndarray, y: np.ndarray, p: float) -> np.ndarray:
    """``||x_i - y_j||^2`` for x (P, n, d), y (P, m, d), refined (refdml._numerics).

    For p != 2 through the norm, whose small values are accurate to full relative
    precision: the cost ``D^p`` and its gradient ``p D^(p-2) (x_i - y_j)`` need them.
    """
    return pairwise_sq_distances(x, y) if p == 2.0 else pairwise_norm(x, y) ** 2


def _self_sq_dist(x: np.ndarray, p: float) -> np.ndarray:
    sq = _sq_dist(x, x, p)
    # A point's distance to itself is 0 and the matrix is symmetric, exactly.
    diag = np.arange(x.shape[1])
    sq[:, diag, diag] = 0.0
    return 0.5 * (sq + np.swapaxes(sq, 1, 2))


def _ground_cost(sq, p: float):
    """``sq^(p/2)``, NumPy or CuPy. For ``p`` other than 1 and 2, ``sq <= 1`` (divided by its
    largest), so capping the power at the dtype's largest number (float32, ``p = 1e300``)
    gives the same limit; in float64 the cap never binds. Shared with refdml.gpu."""
    return sq if p == 2.0 else sq ** min(0.5 * p, float(np.finfo(sq.dtype).max))


def _ground_cost_backward(x, y, sq, p, d_cost, *, xp=np):
    """Gradients of ``<d_cost, ||x_i - y_j||^p>`` w.r.t. x and y (subgradient 0 at x_i = y_j).

    ``sq`` as the context holds it (divided by ``sq_unit``; the caller divides the result
    by it). ``p`` multiplies last, so that only a gradient beyond the dtype overflows
    (checked by the caller). ``xp``: NumPy or CuPy, in the dtype of the inputs (refdml.gpu
    calls this with its arrays).
    """
    if p == 2.0:
        w = 2.0 * d_cost
    else:
        positive = sq > 0.0
        with np.errstate(over="ignore", invalid="ignore"):  # checked by the caller
            w = xp.where(positive, (xp.where(positive, sq, 1.0) ** (0.5 * p - 1.0) * d_cost) * p,
                         0.0)
        w = w.astype(sq.dtype, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        d_x = xp.sum(w, axis=2)[:, :, None] * x - w @ y
        d_y = xp.sum(w, axis=1)[:, :, None] * y - xp.swapaxes(w, 1, 2) @ x
    return d_x, d_y


def _distance_unit(p: float, largest_sq: float) -> float:
    """``T``, the unit of the squared distances before the power ``p / 2``: 1 for ``p`` in
    {1, 2} (the scaled costs are at most 4), else ``largest_sq``, the largest squared
    distance of the scaled clouds (1 if every distance is 0); see the module docstring."""
    if p in (1.0, 2.0) or not largest_sq > 0.0:
        return 1.0
    return float(largest_sq)


def _cost_unit(scale: float, p: float, names: str, sq_unit: float = 1.0) -> float:
    """``(scale sqrt(sq_unit))^p``: the unit of the costs of clouds divided by ``scale`` (a
    power of two) whose squared distances are divided by ``sq_unit`` (:func:`_distance_unit`).

    ``ValueError`` where it lies outside ``[2^-1000, 2^1000]``: with ``sq_unit = 1`` the
    data's magnitude is named, otherwise the largest cost ``D_max^p`` with the range of
    ``p`` (``p |log2 D_max| <= 1000``) that these data allow.
    """
    log_distance = float(np.log2(scale)) + 0.5 * float(np.log2(sq_unit))
    exponent = log_distance * p
    if abs(exponent) <= 1000.0:
        return float(np.exp2(exponent))
    flows = "overflows" if exponent > 0.0 else "underflows"
    if sq_unit == 1.0:
        raise ValueError(
            f"the cost ||x - y||^p of {names} (magnitude ~{scale:.3g}, p == {p:g}) {flows} "
            "float64; rescale the data"
        )
    largest = scale * float(np.sqrt(sq_unit))
    fits = 1000.0 / abs(log_distance)
    hint = (f"p <= {fits:.4g} keeps it in range for these data, or rescale the data"
            if fits >= 1.0 else "rescale the data")
    raise ValueError(
        f"p == {p:g}: the largest cost ||x - y||^p of {names} (largest distance {largest:.6g}) "
        f"is 2^{exponent:.4g}, it {flows} float64 (2^-1000 .. 2^1000); {hint}"
    )


def _normalised_sq(p: float, *sqs):
    """``(sq_unit, sq / sq_unit ...)`` of squared distance arrays (NumPy or CuPy) for the
    power ``p`` (:func:`_distance_unit`; the largest, exactly 1, is one synchronisation on
    CuPy for ``p`` other than 1 and 2)."""
    if p in (1.0, 2.0):
        return (1.0, *sqs)
    largest = max(float(sq.max()) if sq.size else 0.0 for sq in sqs)
    sq_unit = _distance_unit(p, largest)
    if sq_unit == 1.0:
        return (1.0, *sqs)
    return (sq_unit, *(sq / sq.dtype.type(sq_unit) for sq in sqs))


def _points_factor(unit: float, scale: float, sq_unit: float) -> float:
    """``unit / (scale sq_unit)``: the chain-rule factor from scaled to given points (costs
    ``unit c(x / scale)``, squared distances divided by ``sq_unit``). Python floats: an
    ``inf`` here (a gradient beyond float64) is named by :func:`_check_gradient`."""
    return unit / scale / sq_unit


def _check_gradient(xp, gradient, name: str, p: float) -> None:
    """``ValueError`` where the gradient with respect to ``name`` is not finite (it
    overflowed: ``p ||x - y||^(p-1)`` or the upstream gradient beyond the dtype)."""
    if not bool(xp.all(xp.isfinite(gradient))):
        raise ValueError(
            f"the gradient with respect to {name} overflows {np.dtype(gradient.dtype).name} "
            f"(p == {p:g}: it holds p ||x - y||^(p-1), beyond the dtype here); use a smaller "
            "p, a smaller upstream gradient or rescale the data"
        )


def _check_p(p) -> float:
    return check_scalar(p, "p", low=1.0)


def _check_output(value, what: str, *, xp=np) -> None:
    """``ValueError`` naming ``what`` and the dtype where ``value`` is not finite (NumPy or
    CuPy; one host synchronisation on CuPy)."""
    if not bool(xp.all(xp.isfinite(value))):
        dtype = np.dtype(getattr(value, "dtype", np.float64)).name
        raise ValueError(f"{what} overflows {dtype}; rescale the data (or eps)")


# ----------------------------------------------------------------------------------------
# Sinkhorn divergence of one pair of weighted point clouds


@dataclass(frozen=True)
class SinkhornDivergenceGrads:
    """Gradients of the divergence; ``a``, ``b`` are None when no weights were given."""

    x: np.ndarray
    y: np.ndarray
    a: np.ndarray | None
    b: np.ndarray | None


@dataclass(frozen=True)
class SinkhornDivergenceContext:
    """The three solved problems of Eq. (4) and what the backward needs to use them."""

    x: np.ndarray            # (n, d) the clouds divided by `scale`
    y: np.ndarray            # (m, d)
    scale: float             # power of two the clouds were divided by
    unit: float              # scale ** p, the unit of the costs below
    a: np.ndarray            # (n,) normalised weights
    b: np.ndarray            # (m,)
    a_mass: float            # sums of the weights as given
    b_mass: float
    weights_given: bool
    p: float
    value: str               # the convention, "regularized" or "transport_cost"
    sq_xy: np.ndarray        # (1, n, m) squared distances of the scaled clouds
    sq_xx: np.ndarray        # (1, n, n)
    sq_yy: np.ndarray        # (1, m, m)
    xy: _OTBatch             # the three problems of Eq. (4)
    xx: _OTBatch
    yy: _OTBatch
    sq_unit: float = 1.0     # the sq_* above are divided by it (_distance_unit; p not 1, 2)
    solver: str = "refdml"   # which solver produced xy, xx, yy (SOLVERS)


def _check_clouds(x, y):
    x = as_float_array(x, "x", ndim=2)
    y = as_float_array(y, "y", ndim=2)
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    return x, y


def _check_weight_vector(w, name: str, size: int):
    w_norm, mass = _check_weights(w, name, size)
    if w_norm.ndim != 1:
        raise ValueError(f"{name} must be 1-d, got shape {w_norm.shape}")
    return w_norm, float(mass)


def sinkhorn_divergence_forward(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                                max_iter=1000, tol=1e-9, eps_scaling=None, solver="refdml"):
    """Sinkhorn divergence of Eq. (4) between two weighted point clouds; ``(sd, ctx)``.

    .. math::

        \\mathrm{SD} = \\mathrm{OT}(a, b) - \\tfrac12 (\\mathrm{OT}(a, a) + \\mathrm{OT}(b, b)),
        \\qquad C_{ij} = \\|x_i - y_j\\|^p

    Parameters
    ----------
    x, y : float arrays (n, d) and (m, d)
        Point clouds (any finite scale, see the module docstring).
    a, b : float arrays (n,) and (m,), optional
        Positive weights, normalised to sum 1 inside; uniform when None.
    eps : float > 0, the entropic regularisation, in the units of the cost ``||x - y||^p``
        (scaling the clouds by ``s`` and ``eps`` by ``s^p`` scales ``sd`` by ``s^p``).
    p : float >= 1, exponent of the ground cost.
    value : ``"regularized"`` (Eq. (3)'s value, the paper's) or ``"transport_cost"``.
    max_iter, tol, eps_scaling : as in :func:`refdml.ot.sinkhorn`.
    solver : ``"refdml"`` (refdml's own log-domain Sinkhorn, the default) or ``"pot"``
        (the potentials of the three problems from POT's ``ot.bregman.sinkhorn_log``,
        :mod:`refdml.ot._pot`; the scaling, the refusals, the value and the backward are
        the same). docs/ot.md, "Which solver", compares them.

    Returns
    -------
    sd : float
    ctx : SinkhornDivergenceContext
        The context of :func:`sinkhorn_divergence_backward`.
    """
    check_choice(value, "value", VALUES)
    check_choice(solver, "solver", SOLVERS)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    x, y = _check_clouds(x, y)
    n, m = x.shape[0], y.shape[0]
    weights_given = a is not None or b is not None
    a, a_mass = _check_weight_vector(np.full(n, 1.0 / n) if a is None else a, "a", n)
    b, b_mass = _check_weight_vector(np.full(m, 1.0 / m) if b is None else b, "b", m)

    scale = common_scale(x, y)
    xs, ys = x / scale, y / scale
    sq_unit, sq_xy, sq_xx, sq_yy = _normalised_sq(
        p, _sq_dist(xs[None], ys[None], p), _self_sq_dist(xs[None], p), _self_sq_dist(ys[None], p)
    )
    unit = _cost_unit(scale, p, "x and y", sq_unit)
    costs = [_ground_cost(sq, p) for sq in (sq_xy, sq_xx, sq_yy)]
    scaled_eps = eps / unit
    _check_relative_eps(scaled_eps, max(float(c.max()) for c in costs), user_eps=eps,
                        cost_name=_COST_NAME, data_name="x and y", unit=unit, p=p)
    solve = dict(eps=scaled_eps, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit)
    solve_batch = _solve_batch if solver == "refdml" else _solve_batch_pot
    xy = solve_batch(a[None], b[None], costs[0], **solve)
    xx = solve_batch(a[None], a[None], costs[1], symmetric=True, **solve)
    yy = solve_batch(b[None], b[None], costs[2], symmetric=True, **solve)
    terms = [t.value if value == "regularized" else t.transport_cost for t in (xy, xx, yy)]
    divergence = float(terms[0][0] - 0.5 * (terms[1][0] + terms[2][0]))
    _check_output(divergence, "the Sinkhorn divergence")
    ctx = SinkhornDivergenceContext(
        x=xs, y=ys, scale=scale, unit=unit, a=a, b=b, a_mass=a_mass, b_mass=b_mass,
        weights_given=weights_given, p=p, value=value, sq_xy=sq_xy, sq_xx=sq_xx,
        sq_yy=sq_yy, xy=xy, xx=xx, yy=yy, sq_unit=sq_unit, solver=solver,
    )
    return divergence, ctx


def sinkhorn_divergence_backward(ctx: SinkhornDivergenceContext, d_value) -> SinkhornDivergenceGrads:
    """Gradients of ``d_value * sd`` w.r.t. x, y (and a, b when weights were given).

    ``d_value``: a real number (the upstream gradient of the scalar ``sd``). The context
    of either solver: the gradients are formed from its plans and potentials alike.
    """
    check_context(ctx, "ctx", SinkhornDivergenceContext)
    d_value = float(check_upstream(d_value, "d_value", ()))
    one = np.array([d_value])
    half = np.array([-0.5 * d_value])
    x, y, p = ctx.x[None], ctx.y[None], ctx.p

    d_cost, da_xy, db_xy = _ot_vjp(ctx.xy, ctx.value, one)
    dx_xy, dy_xy = _ground_cost_backward(x, y, ctx.sq_xy, p, d_cost)
    # The symmetric terms move through both slots of the cost and of the weights.
    d_cost, da1, da2 = _ot_vjp(ctx.xx, ctx.value, half)
    dx1, dx2 = _ground_cost_backward(x, x, ctx.sq_xx, p, d_cost)
    d_cost, db1, db2 = _ot_vjp(ctx.yy, ctx.value, half)
    dy1, dy2 = _ground_cost_backward(y, y, ctx.sq_yy, p, d_cost)

    # Costs are unit * C'(x / scale) (squared distances in units of sq_unit): the chain
    # rule gives unit / (scale sq_unit), scale^(p-1) for p in {1, 2}.
    to_points = _points_factor(ctx.unit, ctx.scale, ctx.sq_unit)
    grad_a = grad_b = None
    if ctx.weights_given:
        grad_a = _weight_gradient((da_xy + da1 + da2)[0], ctx.a_mass, "a")
        grad_b = _weight_gradient((db_xy + db1 + db2)[0], ctx.b_mass, "b")
    with np.errstate(over="ignore", invalid="ignore"):
        grad_x, grad_y = to_points * (dx_xy + dx1 + dx2)[0], to_points * (dy_xy + dy1 + dy2)[0]
    _check_gradient(np, grad_x, "x", p)
    _check_gradient(np, grad_y, "y", p)
    return SinkhornDivergenceGrads(x=grad_x, y=grad_y, a=grad_a, b=grad_b)


def sinkhorn_divergence(x, y, a=None, b=None, *, eps, p=2, value="regularized",
                        max_iter=1000, tol=1e-9, eps_scaling=None, solver="refdml"):
    """``sd, grads`` of the Sinkhorn divergence, Eq. (4): one call of the pair.

    See :func:`sinkhorn_divergence_forward`. ``grads.x``, ``grads.y``; ``grads.a``,
    ``grads.b`` when weights were given (else None).
    """
    divergence, ctx = sinkhorn_divergence_forward(
        x, y, a, b, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol,
        eps_scaling=eps_scaling, solver=solver,
    )
    return divergence, sinkhorn_divergence_backward(ctx, 1.0)


# ----------------------------------------------------------------------------------------
# Divergences between many uniform clouds of equal size, all problems in one batch


@dataclass(frozen=True)
class _PairsContext:
    """SD of K pairs of clouds: the cross and self problems, solved in one batch each."""

    clouds: np.ndarray       # (B, n, d) divided by `scale`
    scale: float
    unit: float              # scale ** p
    pairs: np.ndarray        # (K, 2) unique cloud index pairs, first <= second
    selves: np.ndarray       # (S,) clouds whose OT(mu, mu) enters
    sq_cross: np.ndarray     # (K, n, n) squared distances of the scaled clouds
    sq_self: np.ndarray      # (S, n, n)
    cross: _OTBatch
    self_: _OTBatch
    p: float
    value: str
    sq_unit: float = 1.0     # sq_cross, sq_self are divided by it (_distance_unit)


def _uniform(n_problems: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    weights = np.full((n_problems, n), 1.0 / n)
    return weights, weights.copy()


def _pair_divergences(clouds, pairs, *, eps, p, value, max_iter, tol, eps_scaling,
                      name="clouds"):
    """SD between ``clouds[i]`` and ``clouds[j]`` for every row (i, j) of ``pairs``.

    Returns the divergences (K,) in the user's units, the map ``inverse`` from the rows
    of ``pairs`` to the unique pairs solved, and the context of the backward.
    """
    n = clouds.shape[1]
    unique_pairs, inverse = np.unique(np.sort(pairs, axis=1), axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    selves = np.unique(unique_pairs)
    scale = common_scale(clouds)
    scaled = clouds / scale
    sq_cross = _sq_dist(scaled[unique_pairs[:, 0]], scaled[unique_pairs[:, 1]], p)
    sq_self = _self_sq_dist(scaled[selves], p)
    sq_unit, sq_cross, sq_self = _normalised_sq(p, sq_cross, sq_self)
    unit = _cost_unit(scale, p, name, sq_unit)
    cost_cross, cost_self = _ground_cost(sq_cross, p), _ground_cost(sq_self, p)
    scaled_eps = eps / unit
    _check_relative_eps(scaled_eps, max(float(cost_cross.max()), float(cost_self.max())),
                        user_eps=eps, cost_name=_COST_NAME, data_name=name, unit=unit, p=p)
    solve = dict(eps=scaled_eps, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, unit=unit)
    cross = _solve_batch(*_uniform(sq_cross.shape[0], n), cost_cross, **solve)
    self_ = _solve_batch(*_uniform(sq_self.shape[0], n), cost_self, symmetric=True, **solve)
    term = (lambda t: t.value) if value == "regularized" else (lambda t: t.transport_cost)
    self_value = np.zeros(clouds.shape[0])
    self_value[selves] = term(self_)
    values = term(cross) - 0.5 * (self_value[unique_pairs[:, 0]] + self_value[unique_pairs[:, 1]])
    _check_output(values, "the Sinkhorn divergence")
    ctx = _PairsContext(scaled, scale, unit, unique_pairs, selves, sq_cross, sq_self, cross,
                        self_, p, value, sq_unit)
    return values[inverse], inverse, ctx


def _pair_divergences_backward(ctx: _PairsContext, d_unique: np.ndarray,
                               name: str = "clouds") -> np.ndarray:
    """Gradient w.r.t. the (unscaled) clouds of ``sum_k d_unique[k] * SD(pairs[k])``
    (``name``: the argument the clouds were, for the error where it overflows)."""
    clouds, pairs = ctx.clouds, ctx.pairs
    grad = np.zeros_like(clouds)
    first, second = pairs[:, 0], pairs[:, 1]
    d_cost, _, _ = _ot_vjp(ctx.cross, ctx.value, d_unique)
    d_x, d_y = _ground_cost_backward(clouds[first], clouds[second], ctx.sq_cross, ctx.p, d_cost)
    with np.errstate(over="ignore", invalid="ignore"):  # named by _check_gradient below
        np.add.at(grad, first, d_x)
        np.add.at(grad, second, d_y)
    d_self = np.zeros(clouds.shape[0])
    np.add.at(d_self, first, -0.5 * d_unique)
    np.add.at(d_self, second, -0.5 * d_unique)
    d_cost, _, _ = _ot_vjp(ctx.self_, ctx.value, d_self[ctx.selves])
    x = clouds[ctx.selves]
    d_x1, d_x2 = _ground_cost_backward(x, x, ctx.sq_self, ctx.p, d_cost)
    with np.errstate(over="ignore", invalid="ignore"):
        np.add.at(grad, ctx.selves, d_x1 + d_x2)
        grad *= _points_factor(ctx.unit, ctx.scale, ctx.sq_unit)
    _check_gradient(np, grad, name, ctx.p)
    return grad


def _check_cloud_batch(clouds, name: str) -> np.ndarray:
    clouds = as_float_array(clouds, name, ndim=3)
    if clouds.shape[1] < 1 or clouds.shape[2] < 1:
        raise ValueError(f"{name} must have shape (B, n, d) with n, d >= 1, got {clouds.shape}")
    return clouds


@dataclass(frozen=True)
class PairwiseSinkhornDivergenceGrads:
    clouds: np.ndarray       # (B, n, d)


@dataclass(frozen=True)
class PairwiseSinkhornDivergenceContext:
    """``pairs`` is None when there is no pair (B < 2: the matrix is 0, so is the gradient)."""

    shape: tuple[int, int, int]      # (B, n, d) of the clouds
    pairs: _PairsContext | None      # the B (B - 1) / 2 pairs i < j, in triu order


def pairwise_sinkhorn_divergence_forward(clouds, *, eps, p=2, value="regularized",
                                         max_iter=1000, tol=1e-9, eps_scaling=None):
    """(B, B) Sinkhorn divergences (Eq. (4)) between all pairs of uniform clouds; ``(sd, ctx)``.

    .. math::

        \\mathrm{SD}_{kl} = \\mathrm{SD}(\\mu_k, \\mu_l), \\qquad
        \\mu_k = \\tfrac1n \\sum_i \\delta_{\\text{clouds}[k, i]}

    ``clouds`` (B, n, d). All ``B (B - 1) / 2`` cross problems and ``B`` self problems are
    solved in one batch each. The matrix is symmetric with a diagonal of 0 exactly. Other
    parameters as in :func:`sinkhorn_divergence_forward`.

    The readable batched NumPy solver of :mod:`refdml.ot._sinkhorn`. For many clouds
    :func:`refdml.gpu.ot.pairwise_sinkhorn_divergence` computes the same matrix with the
    compiled small-problem Sinkhorn (its CPU twin on NumPy, its CUDA kernel on CuPy), held
    to this function by tests/gpu/test_gpu_kernels_ot.py and the parity suite.

    Parameters
    ----------
    clouds : float array (B, n, d)
        ``B`` point clouds of ``n`` points each, uniform weights.
    eps, p, value, max_iter, tol, eps_scaling
        As in :func:`sinkhorn_divergence_forward`.
    """
    check_choice(value, "value", VALUES)
    eps, max_iter, tol, eps_scaling = _check_solver_args(eps, max_iter, tol, eps_scaling)
    p = _check_p(p)
    clouds = _check_cloud_batch(clouds, "clouds")
    n_clouds = clouds.shape[0]
    out = np.zeros((n_clouds, n_clouds))
    if n_clouds < 2:
        return out, PairwiseSinkhornDivergenceContext(clouds.shape, None)
    first, second = np.triu_indices(n_clouds, k=1)
    values, _, pairs_ctx = _pair_divergences(
        clouds, np.stack([first, second], axis=1), eps=eps, p=p, value=value,
        max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    out[first, second] = values
    out[second, first] = values
    return out, PairwiseSinkhornDivergenceContext(clouds.shape, pairs_ctx)


def pairwise_sinkhorn_divergence_backward(
    ctx: PairwiseSinkhornDivergenceContext, d_divergence
) -> PairwiseSinkhornDivergenceGrads:
    """Gradient of ``<d_divergence, sd>`` w.r.t. the clouds; ``d_divergence`` (B, B).

    Both ``sd[k, l]`` and ``sd[l, k]`` are the one divergence of the pair, so their
    upstream gradients add; the diagonal is constant (0).
    """
    check_context(ctx, "ctx", PairwiseSinkhornDivergenceContext)
    n_clouds = ctx.shape[0]
    d_divergence = check_upstream(d_divergence, "d_divergence", (n_clouds, n_clouds))
    if ctx.pairs is None:
        return PairwiseSinkhornDivergenceGrads(np.zeros(ctx.shape))
    # Unique pairs come sorted lexicographically, which is triu order.
    first, second = ctx.pairs.pairs[:, 0], ctx.pairs.pairs[:, 1]
    d_unique = d_divergence[first, second] + d_divergence[second, first]
    return PairwiseSinkhornDivergenceGrads(_pair_divergences_backward(ctx.pairs, d_unique))


def pairwise_sinkhorn_divergence(clouds, *, eps, p=2, value="regularized", max_iter=1000,
                                 tol=1e-9, eps_scaling=None) -> np.ndarray:
    """(B, B) matrix of Sinkhorn divergences between uniform clouds (B, n, d).

    The forward alone (see :func:`pairwise_sinkhorn_divergence_forward` for the pair).
    """
    out, _ = pairwise_sinkhorn_divergence_forward(
        clouds, eps=eps, p=p, value=value, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling,
    )
    return out
