r"""The GSP cost map (Alg. 2): ``c[b, i, j] = || wbar_i - fbar_{b,j} ||``, ``ubar = u / max(1, ||u||)``.

Shapes: features ``(B, n, d)``, prototypes ``(m, d)``, cost ``(B, m, n)``.

.. math::
    c_{bij} = \big\| \bar w_i - \bar f_{bj} \big\|, \qquad
    \bar u = \frac{u}{\max(1, \|u\|)}

Both sets are first mapped into the unit ball, so ``0 <= c <= 2`` for any finite input:
the cost itself cannot overflow. The norms (``refdml._numerics.row_norm``) and the
pairwise distances (``refdml._numerics.pairwise_norm``: scaled, refined Gram identity)
are computed without overflow at 1e300 or underflow at 1e-300, and the backward works
on the same exactly rescaled (power-of-two) points, so its weights ``g_ij / c_ij`` stay
finite when the points are tiny.

Backward. With ``x_i = wbar_i``, ``y_j = fbar_j`` and ``g = d_cost``, the distance gives
``d x_i = sum_j g_ij (x_i - y_j) / c_ij`` and ``d y_j = -sum_i g_ij (x_i - y_j) / c_ij``
(subgradient 0 where ``c_ij = 0``); the clip gives ``d u = d ubar`` inside the ball and
``d u = (d ubar - ubar (ubar . d ubar)) / ||u||`` outside it (the identity branch at
``||u|| = 1`` exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale, pairwise_norm, row_norm
from refdml._validation import check_context, check_features_prototypes, check_upstream
from refdml.normalize import _clip_backward

__all__ = ["CostMapContext", "CostMapGrads", "cost_map", "cost_map_backward", "cost_map_forward"]


@dataclass(frozen=True)
class CostMapGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d), summed over the batch


@dataclass(frozen=True, kw_only=True)
class CostMapContext:
    """What :func:`cost_map_backward` needs, nothing recomputed.

    ``features_bar`` (B, n, d) / ``prototypes_bar`` (m, d): the clipped points;
    ``features_norm`` (B, n, 1) / ``prototypes_norm`` (m, 1): their original norms;
    ``cost`` (B, m, n); ``scale``: the power of two the points were divided by for the
    distances (exact), reused by the backward.
    """

    features_bar: np.ndarray
    features_norm: np.ndarray
    prototypes_bar: np.ndarray
    prototypes_norm: np.ndarray
    cost: np.ndarray
    scale: float


def _clip(u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    norm = row_norm(u, keepdims=True)
    return u / np.maximum(norm, 1.0), norm


def _cost_map_forward(features, prototypes) -> tuple[np.ndarray, CostMapContext]:
    features_bar, features_norm = _clip(features)
    prototypes_bar, prototypes_norm = _clip(prototypes)
    # (m, d) against (B, n, d) broadcasts to (B, m, n).
    cost = pairwise_norm(prototypes_bar, features_bar)
    scale = common_scale(prototypes_bar, features_bar)
    ctx = CostMapContext(features_bar=features_bar, features_norm=features_norm,
                         prototypes_bar=prototypes_bar, prototypes_norm=prototypes_norm,
                         cost=cost, scale=scale)
    return cost, ctx


def _cost_map_backward(ctx: CostMapContext, d_cost: np.ndarray) -> CostMapGrads:
    # Gradient of ||x - y|| is (x - y) / ||x - y|| = (x' - y') / ||x' - y'|| for the
    # rescaled x' = x / scale: the weights g / c' stay finite for tiny points.
    x = ctx.prototypes_bar / ctx.scale
    y = ctx.features_bar / ctx.scale
    distance = ctx.cost / ctx.scale
    positive = distance > 0.0
    w = np.where(positive, d_cost / np.where(positive, distance, 1.0), 0.0)  # (B, m, n)
    # Matrix products, not einsum: einsum's contraction over (b, j) runs without BLAS and
    # took 3x the rest of the pooling backward (B = 256, m = 64, n = 49, d = 128).
    batch, m, n = w.shape
    w_flat = w.transpose(1, 0, 2).reshape(m, batch * n)  # (m, B n)
    d_x = w_flat.sum(axis=1)[:, None] * x - w_flat @ y.reshape(batch * n, -1)
    d_y = w.sum(axis=1)[:, :, None] * y - np.swapaxes(w, 1, 2) @ x
    # The clip's backward is refdml.normalize's: one for the package, so that the cost map
    # of the reference and of the fast path and the normalisation cannot drift apart.
    return CostMapGrads(
        features=_clip_backward(np, ctx.features_bar, d_y, ctx.features_norm > 1.0,
                                ctx.features_norm),
        prototypes=_clip_backward(np, ctx.prototypes_bar, d_x, ctx.prototypes_norm > 1.0,
                                  ctx.prototypes_norm),
    )


def cost_map_forward(features, prototypes) -> tuple[np.ndarray, CostMapContext]:
    """GSP cost map ``c[b, i, j] = || wbar_i - fbar_{b,j} ||`` (Alg. 2); returns ``(cost, ctx)``.

    Parameters
    ----------
    features : array (B, n, d)
    prototypes : array (m, d)

    Returns
    -------
    cost : ndarray (B, m, n), entries in [0, 2]
    ctx : CostMapContext

    Notes
    -----
    Both sets are first mapped into the unit ball, ``u -> u / max(1, ||u||)``; right
    for any finite input (1e-300 .. 1e300). Two kinks, with the subgradients the
    backward uses (never NaN): ``c_ij = 0`` (a prototype on a feature): the subgradient
    0 of the norm; ``||u|| = 1`` exactly: the identity branch of the normalisation.
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    return _cost_map_forward(features, prototypes)


def cost_map_backward(ctx: CostMapContext, d_cost) -> CostMapGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d, summed over the batch).

    ``d_cost`` must have the shape (B, m, n) of the cost (no broadcasting).
    """
    check_context(ctx, "ctx", CostMapContext)
    d_cost = check_upstream(d_cost, "d_cost", ctx.cost.shape)
    return _cost_map_backward(ctx, d_cost)


def cost_map(features, prototypes) -> np.ndarray:
    """The GSP cost map (no context kept)."""
    return cost_map_forward(features, prototypes)[0]
