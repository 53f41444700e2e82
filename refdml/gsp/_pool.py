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
"""

from __future__ import annotations

from dataclasses import dataclass

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

__all__ = ["PoolContext", "PoolGrads", "gsp_pool", "gsp_pool_backward", "gsp_pool_forward"]

BACKWARDS = ("closed_form", "unrolled")


@dataclass(frozen=True)
class PoolGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d)


@dataclass(frozen=True)
class PoolContext:
    """What :func:`gsp_pool_backward` needs.

    ``features`` (B, n, d) raw; ``weights`` (B, n) ``(1 - n rho) / mu``; ``pooled``
    (B, d); ``p``; ``backward`` ("closed_form" or "unrolled", chosen in the forward);
    ``cost`` the cost map's context; ``transport`` the (P2) result.
    """

    features: np.ndarray
    weights: np.ndarray
    pooled: np.ndarray
    p: float
    backward: str
    cost: CostMapContext
    transport: WeightTransportResult


def _power_mean(weighted: np.ndarray, p: float) -> np.ndarray:
    """``((1/n) sum_j y_j^p)^(1/p)`` over axis 1 of non-negative ``y`` (B, n, d).

    Each (image, channel) is divided by a power of two near its largest entry (exact),
    so ``y^p`` neither overflows at 1e300 nor underflows at 1e-300.
    """
    peak = np.max(weighted, axis=1, keepdims=True)
    scale = np.where(peak > 0.0, np.ldexp(1.0, np.frexp(peak)[1]), 1.0)
    return scale[:, 0, :] * np.mean((weighted / scale) ** p, axis=1) ** (1.0 / p)


def _gsp_pool_forward(features, prototypes, mu, inverse_temperature, p, method, max_iter, tol, backward):
    cost, cost_ctx = _cost_map_forward(features, prototypes)
    result = _weight_transport(cost, mu, inverse_temperature, method, max_iter, tol)
    weights = result.transported / mu
    weighted = weights[:, :, None] * features
    pooled = weighted.mean(axis=1) if p == 1.0 else _power_mean(weighted, p)
    z = result.pi.sum(axis=2) / mu
    ctx = PoolContext(features, weights, pooled, p, backward, cost_ctx, result)
    return (pooled, z), ctx


def _gsp_pool_backward(ctx: PoolContext, d_pooled, d_z) -> PoolGrads:
    features, weights, result = ctx.features, ctx.weights, ctx.transport
    n = features.shape[1]
    mu = result.mu
    if ctx.p == 1.0:
        d_weighted = np.broadcast_to(d_pooled[:, None, :] / n, features.shape)
    else:
        # d pooled_c / d x_jc = (1/n) (x_jc / pooled_c)^(p-1); bounded since
        # x_jc <= n^(1/p) pooled_c. Where pooled_c = 0 the 1/p power is not
        # differentiable; the subgradient 0 is used.
        x = weights[:, :, None] * features
        pooled = ctx.pooled[:, None, :]
        positive = pooled > 0.0
        ratio = np.where(positive, x / np.where(positive, pooled, 1.0), 0.0)
        d_weighted = ratio ** (ctx.p - 1.0) * d_pooled[:, None, :] / n
    d_features = d_weighted * weights[:, :, None]
    d_weights = np.sum(d_weighted * features, axis=2)
    d_rho = -(n / mu) * d_weights
    d_pi = np.broadcast_to(d_z[:, :, None] / mu, result.pi.shape)
    if ctx.backward == "closed_form":
        d_cost = closed_form_backward(result, d_rho, d_pi)
    else:
        d_cost = unrolled_backward(result, d_rho, d_pi)
    through_cost = _cost_map_backward(ctx.cost, d_cost)
    return PoolGrads(features=through_cost.features + d_features, prototypes=through_cost.prototypes)


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
    p : float >= 1
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
