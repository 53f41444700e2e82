r"""The GSP pooling layer (Alg. 2, Eqs. 4.1 and 4.3), with GeMean for ``p > 1``.

Shapes: features ``(B, n, d)``, prototypes ``(m, d)``, pooled ``(B, d)``, z ``(B, m)``.

With ``(rho, pi)`` the solution of (P2) on the cost map and ``w_j = (1 - n rho_j) / mu``:

.. math::
    \text{pooled} = \Big(\frac1n\sum_j (w_j f_j)^p\Big)^{1/p},\qquad
    z_i = \frac1\mu \sum_j \pi_{ij}

The backward chains ``(pooled, z) -> (rho, pi) -> cost -> normalisation -> (features,
prototypes)`` plus the direct path from ``pooled`` to the raw features. Which backward
of (P2) is used (Prop. 4.3's closed form or the unrolled fixed point) is chosen in the
forward and kept in the context.

Extreme magnitudes (docs/gsp.md Sec. 5)
---------------------------------------
* GeMean at any ``p >= 1``: the power mean is taken of ``y / max_j y_j`` (largest term
  exactly 1, so the mean lies in ``[1/n, 1]`` and never underflows), and the backward
  uses ``(y_j / pooled)^(p-1) = t_j^(p-1) M^(1/p - 1)`` with ``t = y / max y`` and the
  forward's mean ``M`` (kept in :class:`PowerMeanContext`): raising the rounded ratio
  ``y / pooled`` to the power ``p - 1`` multiplied its rounding by ``p`` (wrong from
  ``p ~ 1e12``; at ``p ~ 1e17`` it gave ``1/n`` for the largest entry, whose true
  derivative is 1). As ``p`` grows this is max pooling, ties sharing the derivative.
* Small ``mu``: ``w = sigma / mu`` and ``z`` are O(1) at any ``mu``; ``sigma_j <= n mu``
  carries an absolute rounding of at most ``2^-1075`` (a subnormal), so ``w`` is accurate
  to ``2^-1075 / mu <= 2^-53`` for every normal ``mu`` and a subnormal ``mu`` is refused
  (at ``mu = 2^-1074`` the error would be a whole unit). The backward never forms ``1 /
  mu``: Prop. 4.3 is linear in ``(d_rho, d_pi)`` and in ``(pi, sigma)``, so it is
  evaluated on ``pi / mu`` and ``w`` with ``(-n d_w, d_z)`` (docs/gsp.md Sec. 5).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    check_choice,
    check_context,
    check_features_prototypes,
    check_scalar,
    check_upstream,
)
from refdml.gsp._cost import CostMapContext, _cost_map_backward, _cost_map_forward
from refdml.gsp._transport import (
    WeightTransportResult,
    _weight_transport,
    check_transport_args,
    closed_form_backward,
    unrolled_backward,
)

__all__ = [
    "PoolContext",
    "PoolGrads",
    "PowerMeanContext",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
]

BACKWARDS = ("closed_form", "unrolled")
# The least mu of the pooling layer (float64's least normal number): see check_pool_mu.
LEAST_MU = float(np.finfo(np.float64).tiny)


@dataclass(frozen=True)
class PoolGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d)


@dataclass(frozen=True)
class PowerMeanContext:
    """GeMean's forward quantities (:func:`power_mean`), arrays of the input's module.

    ``scale`` (B, d) the power of two of each channel's largest feature; ``peak`` (B, d)
    ``max_j y_jc`` of ``y = w f / scale``; ``mean`` (B, d) ``M_c = (1/n) sum_j (y_jc /
    peak_c)^p`` in ``[1/n, 1]`` (0 on an all-zero channel).
    """

    scale: Any
    peak: Any
    mean: Any


@dataclass(frozen=True, kw_only=True)
class PoolContext:
    """What :func:`gsp_pool_backward` needs.

    ``features`` (B, n, d) raw; ``weights`` (B, n) ``(1 - n rho) / mu``; ``pooled``
    (B, d); ``p``; ``backward`` ("closed_form" or "unrolled", chosen in the forward);
    ``cost`` the cost map's context; ``transport`` the (P2) result; ``power_mean`` GeMean's
    :class:`PowerMeanContext` (None at ``p = 1``).
    """

    features: np.ndarray
    weights: np.ndarray
    pooled: np.ndarray
    p: float
    backward: str
    cost: CostMapContext
    transport: WeightTransportResult
    power_mean: PowerMeanContext | None = None


def check_pool_mu(mu: float) -> None:
    """``ValueError`` for a subnormal ``mu`` (module docstring: ``w = sigma / mu`` carries an
    absolute error ``2^-1075 / mu``, a whole unit at the least subnormal)."""
    if mu < LEAST_MU:
        raise ValueError(
            f"mu == {mu!r} is subnormal; the pooling layer needs mu >= {LEAST_MU!r} (float64's "
            "least normal number): its weights (1 - n rho_j) / mu = sigma_j / mu need "
            "sigma_j ~ mu to carry its digits"
        )


def _gemean_power(p: float, dtype) -> float:
    """``p`` as the power mean applies it: capped at the dtype's largest number (float32:
    ``p = 1e300``), which gives the same limit, ``max_j y_j`` (every ``t < 1`` to the power
    3.4e38 is 0 in float32, as to ``p``)."""
    return min(p, float(np.finfo(dtype).max))


def _scaled_terms(xp, weights, features, scale):
    """``y = w f / scale`` (B, n, d): ``f / scale`` in ``[0, 2)`` (exact) and ``w <= n``
    (the weights sum to ``n``), so ``y`` neither overflows (``w f`` does for ``f`` near the
    dtype's largest number) nor loses the largest entry to subnormals (``f`` near its least
    normal number)."""
    return weights[:, :, None] * (features / scale[:, None, :])


def power_mean(xp, weights, features, p: float, check: bool = True):
    """GeMean ``((1/n) sum_j (w_j f_jc)^p)^(1/p)`` (B, d) and its :class:`PowerMeanContext`.

    Written once against the array module ``xp`` (the fast path calls it too). With
    ``scale_c`` the power of two of ``max_j f_jc`` (``f`` is non-negative), ``y = w f /
    scale``, ``peak = max_j y_j`` and ``t = y / peak`` (largest term exactly 1):
    ``pooled = scale peak M^(1/p)``, ``M = mean_j t_j^p`` in ``[1/n, 1]``, so no ``p`` in
    ``[1, 1e300]`` underflows the mean (a power-of-two scale of ``y`` left every ``t^p`` to
    underflow for ``p`` in the thousands: pooled was 0). The rounding of ``t`` is
    multiplied by ``p`` in ``t^p`` and divided by it again in the root: the result keeps a
    few ulps. ``ValueError`` where ``pooled`` itself is beyond the dtype (``check``: one
    synchronisation on CuPy, which the fast path skips while its data checks are off).
    """
    dtype = features.dtype
    power = _gemean_power(p, dtype)
    largest = xp.max(features, axis=1)                          # (B, d)
    # Capped at the top binade (2^128 is no float32): f / scale is then below 2.
    exponent = xp.minimum(xp.frexp(largest)[1], np.finfo(dtype).maxexp - 1)
    scale = xp.where(largest > 0, xp.ldexp(xp.ones_like(largest), exponent), 1)
    y = _scaled_terms(xp, weights, features, scale)
    peak = xp.max(y, axis=1)                                    # (B, d)
    y /= xp.where(peak > 0, peak, 1)[:, None, :]
    with np.errstate(under="ignore"):  # t^p of t < 1 is 0 at large p, as it should be
        y **= power
        mean = xp.mean(y, axis=1)
        root = mean ** (1.0 / power)
    with np.errstate(over="ignore"):
        pooled = (peak * root) * scale
    if check and not bool(xp.all(xp.isfinite(pooled))):
        raise ValueError(
            f"GeMean (p == {p!r}) of these weighted features exceeds {np.dtype(dtype).name}'s "
            f"range ({float(np.finfo(dtype).max):.3g}): rescale the features"
        )
    return pooled, PowerMeanContext(scale=scale, peak=peak, mean=mean)


def power_mean_backward(xp, weights, features, p: float, ctx: PowerMeanContext, d_pooled):
    """``d y`` (B, n, d): the gradient with respect to ``y_jc = w_j f_jc`` of :func:`power_mean`.

    ``d pooled_c / d y_jc = (1/n) (y_jc / pooled_c)^(p-1) = (1/n) t_jc^(p-1) M_c^(1/p - 1)``
    (``y = w f`` unscaled), each factor in ``[0, 1]`` and ``[1, n]``: bounded at any scale
    and any ``p`` (the forward's ``M``, not ``pooled / peak`` raised to ``p``, whose
    rounding would be multiplied by ``p``). As ``p -> inf`` it is ``1 / (number of ties)``
    at the largest entry and 0 elsewhere: max pooling. 0 on an all-zero channel (the
    subgradient where the ``1/p`` power is not differentiable). ``|d y| <= |d_pooled|``.
    """
    n = features.shape[1]
    power = _gemean_power(p, features.dtype)
    positive = ctx.peak > 0
    ratio = _scaled_terms(xp, weights, features, ctx.scale)
    ratio /= xp.where(positive, ctx.peak, 1)[:, None, :]
    with np.errstate(under="ignore"):
        ratio **= power - 1.0
        factor = xp.where(positive, ctx.mean, 1) ** (1.0 / power - 1.0)
    ratio *= xp.where(positive, d_pooled * factor * (1.0 / n), 0)[:, None, :]
    return ratio


def _gsp_pool_forward(features, prototypes, mu, inverse_temperature, p, method, max_iter, tol, backward):
    cost, cost_ctx = _cost_map_forward(features, prototypes)
    result = _weight_transport(cost, mu, inverse_temperature, method, max_iter, tol)
    weights = result.transported / mu
    n = features.shape[1]
    power_ctx = None
    if p == 1.0:
        # (w / n) sums to 1: a convex combination, never beyond the largest feature.
        pooled = np.sum((weights / n)[:, :, None] * features, axis=1)
    else:
        pooled, power_ctx = power_mean(np, weights, features, p)
    z = result.pi.sum(axis=2) / mu
    ctx = PoolContext(features=features, weights=weights, pooled=pooled, p=p, backward=backward,
                      cost=cost_ctx, transport=result, power_mean=power_ctx)
    return (pooled, z), ctx


def exponent_of(values) -> int:
    """The ``e`` with ``max |values| < 2^e`` (0 for all zeros); NumPy or CuPy (one
    synchronisation)."""
    largest = float(abs(values).max()) if values.size else 0.0
    return int(np.frexp(largest)[1]) if largest > 0.0 else 0


def weight_gradient_shift(features) -> int:
    """``s >= 0`` with ``|features| / 2^s < 2^500``: the backward of the weights runs on
    ``sum_c d_y f / 2^s`` where ``sum_c d_y f`` itself overflows (``|f| ~ 1e308``)."""
    return max(0, exponent_of(features) - 500)


def upstream_exponent(d_weights, d_z, n: int, extra: int = 0) -> int:
    """``k >= 0`` with ``n |d_weights| 2^extra / 2^k`` and ``|d_z| / 2^k`` below ``2^500``:
    the (linear) backward of (P2) then has headroom for ε and the sums (``extra``: the
    unrolled backward's ``1 / mu``, as a power of two)."""
    bound = max(exponent_of(d_weights) + n.bit_length() + extra, exponent_of(d_z))
    return max(0, bound - 500)


def pool_gradient_overflow(name: str, exponent: int, inverse_temperature: float) -> str:
    """The ValueError text where a gradient of the pooling layer is beyond float64."""
    return (
        f"the gradient with respect to {name} overflows float64 (largest upstream gradient "
        f"of the weights ~2^{exponent}, inverse_temperature == {inverse_temperature!r}); "
        "rescale the features or the upstream"
    )


def _transport_backward(ctx: PoolContext, d_weights, d_z) -> tuple[np.ndarray, int]:
    """``(d_cost / 2^k, k)``: ``d_cost`` (B, m, n) of (P2) for ``d_rho = -(n / mu) d_weights``,
    ``d_pi_ij = d_z_i / mu``, divided by a power of two ``2^k`` (``k = 0`` but for huge
    upstream gradients).

    ``1 / mu`` overflows for ``mu`` near float64's least normal number and the upstream it
    scales is O(1) only once it meets ``pi`` and ``sigma`` (both ``~ mu``). Closed form
    (Prop. 4.3, docs/gsp.md Sec. 3): ``-ε (pi (d_pi - a) + A rho sigma (b - bbar))`` is
    linear in ``(d_pi, d_rho)`` and in ``(pi, sigma)`` (``bbar`` is a mean under weights
    ``rho sigma``, invariant to their scale), so it is evaluated on ``pi / mu`` and
    ``w = sigma / mu`` with ``(d_z, -n d_weights)``: no ``1 / mu`` is formed. Unrolled:
    ``sigma`` enters its ``d_rho`` term recomputed from the stored logits, so only
    ``pi / mu`` is used, with ``(d_z, -(n / mu) d_weights)``. ``d_weights ~ |f| |d_pooled|``
    reaches 1e308 for features that large, where ``n d_weights`` and ``b - bbar`` overflow
    though the gradients through the normalised cost map (``d_cost / |f|``) do not: the
    upstream is divided by ``2^k`` so that its largest entry is below ``2^500`` (the
    backward is linear in it), and the caller multiplies the cost map's gradients back.
    """
    result = ctx.transport
    mu, n = result.mu, ctx.features.shape[1]
    closed = ctx.backward == "closed_form"
    # pi / mu sums to 1 per image; entries carry at most 2^-1075 / mu <= 2^-53 (mu normal).
    per_mass = dataclasses.replace(result, pi=result.pi / mu)
    k = upstream_exponent(d_weights, d_z, n, 0 if closed else 1 - int(np.frexp(mu)[1]))
    d_rho = np.ldexp(d_weights, -k) * (-n)
    d_pi = np.broadcast_to(np.ldexp(d_z, -k)[:, :, None], result.pi.shape)
    if closed:
        per_weight = dataclasses.replace(per_mass, transported=ctx.weights)
        return closed_form_backward(per_weight, d_rho, d_pi), k
    return unrolled_backward(per_mass, d_rho / mu, d_pi), k


def _gsp_pool_backward(ctx: PoolContext, d_pooled, d_z) -> PoolGrads:
    features, weights = ctx.features, ctx.weights
    n = features.shape[1]
    if ctx.p == 1.0:
        d_weighted = np.broadcast_to(d_pooled[:, None, :] / n, features.shape)
    else:
        d_weighted = power_mean_backward(np, weights, features, ctx.p, ctx.power_mean, d_pooled)
    d_features = d_weighted * weights[:, :, None]
    with np.errstate(over="ignore", invalid="ignore"):  # features near 1e308: redone below
        d_weights = np.sum(d_weighted * features, axis=2)
    shift = 0
    if not np.all(np.isfinite(d_weights)):
        # sum_c d_y f beyond float64 (|f| ~ 1e308): the (linear) backward of the weights
        # runs on (d_weights, d_z) / 2^shift, |f| / 2^shift < 2^500, multiplied back.
        shift = weight_gradient_shift(features)
        d_weights = np.sum(d_weighted * np.ldexp(features, -shift), axis=2)
        d_z = np.ldexp(d_z, -shift)
    d_cost, k = _transport_backward(ctx, d_weights, d_z)
    through_cost = _cost_map_backward(ctx.cost, d_cost)
    with np.errstate(over="ignore", invalid="ignore"):
        grads = PoolGrads(features=np.ldexp(through_cost.features, k + shift) + d_features,
                          prototypes=np.ldexp(through_cost.prototypes, k + shift))
    for name in ("features", "prototypes"):
        if not np.all(np.isfinite(getattr(grads, name))):
            raise ValueError(pool_gradient_overflow(
                name, exponent_of(d_weights) + shift, ctx.transport.inverse_temperature))
    return grads


def gsp_pool_forward(
    features, prototypes, *, mu, inverse_temperature, p=1.0, method="exact", max_iter=100,
    tol=1e-12, backward="closed_form",
) -> tuple[tuple[np.ndarray, np.ndarray], PoolContext]:
    r"""GSP pooling layer (Alg. 2): ``((pooled, z), ctx)``.

    With ``(rho, pi)`` the solution of (P2) on the cost map of ``features`` and
    ``prototypes`` (see :func:`cost_map_forward`, :func:`weight_transport`) and the
    pooling weights ``w_j = (1 - n rho_j) / mu``:

    .. math::
        \text{pooled} = \Big(\frac1n\sum_j (w_j f_j)^p\Big)^{1/p},\qquad
        z_i = \frac1\mu \sum_j \pi_{ij}

    ``p = 1`` is Eq. 4.1, ``pooled = sum_j (1/n - rho_j)/mu f_j``; ``p > 1`` is
    GeMean + GSP (element-wise power, needs non-negative features). ``z`` is Eq. 4.3.
    The weights apply to the raw features; only the cost map sees the normalised ones.
    At ``mu = 1``, ``pooled`` is the mean of the features (Thm 4.1, GAP).

    Parameters
    ----------
    features : array (B, n, d)
    prototypes : array (m, d)
    mu, inverse_temperature, method, max_iter, tol
        As in :func:`weight_transport`; ``inverse_temperature`` is the paper's ε
        (varepsilon), GSP's defaults 0.5 (proxy losses) and 5.0 (pair losses).
        ``mu`` must be a normal float64 (``>= 2.2250738585072014e-308``): the weights
        ``sigma / mu`` of a subnormal ``mu`` have too few digits (``ValueError``).
    p : float >= 1
        Any finite ``p``: as ``p`` grows GeMean tends to max pooling (module docstring).
    backward : {"closed_form", "unrolled"}
        The backward :func:`gsp_pool_backward` will use: Prop. 4.3 (default), or the
        exact gradient of the k fixed-point iterations (needs ``method="fixed_point"``;
        validation only).

    Returns
    -------
    (pooled (B, d), z (B, m)), PoolContext
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    mu, inverse_temperature, method, max_iter, tol = check_transport_args(
        mu, inverse_temperature, method, max_iter, tol
    )
    check_pool_mu(mu)
    p = check_scalar(p, "p", low=1.0)
    backward = check_choice(backward, "backward", BACKWARDS)
    if backward == "unrolled" and method != "fixed_point":
        raise ValueError(
            f"backward == 'unrolled' needs method='fixed_point', got method == {method!r}"
        )
    if p > 1.0 and np.any(features < 0.0):
        bad = tuple(int(i) for i in np.argwhere(features < 0.0)[0])
        raise ValueError(
            f"features[{bad}] == {features[bad]!r} is negative; p == {p!r} > 1 "
            "(GeMean) needs non-negative features"
        )
    return _gsp_pool_forward(
        features, prototypes, mu, inverse_temperature, p, method, max_iter, tol, backward
    )


def gsp_pool_backward(ctx: PoolContext, d_pooled, d_z) -> PoolGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d) of the pooling layer.

    ``d_pooled`` (B, d) and ``d_z`` (B, m), exactly the shapes of the outputs; either
    may be ``None``, meaning zero (an output the loss does not use). The backward of
    (P2) is the one chosen in :func:`gsp_pool_forward` (``ctx.backward``).
    """
    check_context(ctx, "ctx", PoolContext)
    d_pooled = check_upstream(d_pooled, "d_pooled", ctx.pooled.shape, allow_none=True)
    d_z = check_upstream(d_z, "d_z", ctx.transport.pi.shape[:2], allow_none=True)
    d_pooled = np.zeros(ctx.pooled.shape) if d_pooled is None else d_pooled
    d_z = np.zeros(ctx.transport.pi.shape[:2]) if d_z is None else d_z
    return _gsp_pool_backward(ctx, d_pooled, d_z)


def gsp_pool(
    features, prototypes, *, mu, inverse_temperature, p=1.0, method="exact", max_iter=100,
    tol=1e-12,
):
    """``(pooled, z)`` of the GSP layer (no context kept)."""
    return gsp_pool_forward(
        features, prototypes, mu=mu, inverse_temperature=inverse_temperature, p=p,
        method=method, max_iter=max_iter, tol=tol,
    )[0]
