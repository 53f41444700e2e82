"""The pairwise matrices the losses see their embeddings through, and their backwards
(part of the losses family's array path, written once against the backend).

Scale: the Euclidean losses divide the embeddings by one common power of two ``s``
(exact), as the reference does, and keep ``x / s`` and the distances ``D / s`` in their
context: the gradient of ``D`` with respect to ``x`` is that of ``D / s`` with respect to
``x / s`` (degree 0), so the backward divides by numbers near 1 and is right at any scale,
subnormal embeddings included (a float32 subnormal, below 1.2e-38, holds fewer than 24
bits: the result is that of the rounded input); the cosine losses use
:func:`refdml.gpu.normalize._l2_forward` (a power of two per row, exact), or for the proxy
losses :func:`cross_cosine`'s one pass over embeddings and proxies by their plain norms
where that is as accurate, so the gradient with respect to the raw rows needs no further
factor and ``row_scale`` / ``embedding_scale`` / ``proxy_scale`` in the reference's contexts
are ones here (kept read-only by the backend and recognised by the backward:
:func:`refdml.gpu.normalize.ones_column`).

A set compared with itself is normalised once, and its backward adds the two arguments'
gradients in one matrix product.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._backend import Backend
from refdml._shared.losses import COSINE_WHY
from refdml._validation import data_checks
from refdml.distances import CosineContext, EuclideanContext
from refdml.gpu.distances import common_scale, scaled_sq
from refdml.gpu.linalg import matmul
from refdml.gpu.normalize import _l2_backward, _l2_forward, is_ones_column, ones_column
from refdml.normalize import L2NormalizeContext

__all__ = ["cosine_backward_sum", "cross_cosine", "self_cosine", "self_euclidean",
           "self_pairwise_backward"]


def self_euclidean(ns: Backend, x: Any) -> tuple[Any, EuclideanContext, Any]:
    """``D_ij = ||x_i - x_j||`` (exact 0 diagonal); ``(D, ctx, ones((n, 1)))``.

    ``ctx`` holds ``x / s`` and ``D / s`` (module docstring), like the reference's. Nearby
    pairs are recomputed from explicit differences where the backend refines (NumPy:
    coincident rows exactly 0); on CuPy only the diagonal is exact, the other near pairs
    within the tolerance stated in :mod:`refdml.gpu.distances`.
    """
    xp = ns.xp
    scale = common_scale(xp, x)
    scaled = x / scale
    with ns.errstate(over="ignore", divide="ignore"):
        scaled_distance = xp.sqrt(scaled_sq(ns, scaled, scaled, True))
        distance = scaled_distance * scale
    if data_checks(ns) and not bool(xp.all(xp.isfinite(distance))):
        raise ValueError(
            "embeddings has pairwise distances beyond the "
            f"{np.dtype(x.dtype).name} range (max |entry| == {float(xp.max(xp.abs(x))):.3g})"
        )
    return (distance, EuclideanContext(x=scaled, y=scaled, distance=scaled_distance),
            ones_column(ns, x.shape[0], x.dtype))


def self_cosine(ns: Backend, x: Any) -> tuple[Any, CosineContext, Any]:
    """``S_ij = cos(x_i, x_j)``, one normalisation; ``(S, ctx, ones((n, 1)))``."""
    unit, norm_ctx = _l2_forward(ns, x, "embeddings", COSINE_WHY)
    similarity = matmul(ns, unit, unit.T)
    ctx = CosineContext(x_unit=unit, y_unit=unit, x_norm_ctx=norm_ctx, y_norm_ctx=norm_ctx,
                        shape=tuple(similarity.shape))
    return similarity, ctx, ones_column(ns, x.shape[0], x.dtype)


def self_pairwise_backward(ns: Backend, metric_ctx: Any, g: Any) -> Any:
    """Gradient with respect to ``x`` of ``<g, M(x, x)>`` (both arguments), one matmul."""
    sym = g + g.T
    if isinstance(metric_ctx, CosineContext):
        return _l2_backward(ns, metric_ctx.x_norm_ctx, matmul(ns, sym, metric_ctx.x_unit))
    distance = metric_ctx.distance
    # Subgradient 0 at coincident points: w = sym / D where D > 0, else 0. Arithmetic masks
    # (``sym`` is finite, the denominator never 0) instead of ``where`` (several times slower
    # on NumPy).
    coincident = distance == 0
    if ns.launch_bound:
        # one where instead of the mask's three operations (the same weights; a launch each)
        with ns.errstate(divide="ignore", invalid="ignore"):
            w = ns.xp.where(coincident, 0, sym / distance)
    else:
        w = sym / (distance + coincident)
        w *= ~coincident
    grad = matmul(ns, w, metric_ctx.x)
    return ns.xp.subtract(w.sum(axis=1)[:, None] * metric_ctx.x, grad, out=grad)


def cosine_backward_sum(ns: Backend, ctx: CosineContext, g: Any) -> tuple[Any, Any]:
    """``(d_x, d_y)`` of ``<g, cos(x, y)>`` for 2-d ``x``, ``y`` (the proxy losses' kernel).

    Per set one matrix product ``d_u`` and the tangent projection
    ``(d_u - u (u . d_u)) / ||row||`` in place (the row dot :meth:`Backend.row_dot`,
    capture-safe); the division by the power-of-two ``scale`` is skipped where it is the
    fast path's kept ones.
    """
    grads = []
    for norm_ctx, other, upstream in ((ctx.x_norm_ctx, ctx.y_unit, g),
                                      (ctx.y_norm_ctx, ctx.x_unit, g.T)):
        unit = norm_ctx.y
        grad = matmul(ns, upstream, other)
        grad -= unit * ns.row_dot(unit, grad)
        grad /= norm_ctx.scaled_norm
        if not is_ones_column(ns, norm_ctx.scale):
            grad /= norm_ctx.scale
        grads.append(grad)
    return grads[0], grads[1]


# Row sums of squares inside which the plain ``x / sqrt(sum x^2)`` is as accurate as the
# scaled normalisation: no square overflows, and squares lost to underflow (each below the
# subnormal spacing) are negligible against the sum.
_PLAIN_NORM_RANGE = {
    np.dtype(np.float32): (1e-30, 1e36),
    np.dtype(np.float64): (1e-280, 1e300),
}


def cross_cosine(ns: Backend, x: Any, p: Any) -> tuple[Any, CosineContext]:
    """``cos(x_i, p_k)``; the names ``embeddings`` / ``proxies`` in zero-row errors.

    Both sets are normalised in one pass over ``[x; p]``: where every row's sum of squares
    lies in :data:`_PLAIN_NORM_RANGE` (one reduction and one synchronisation, which also
    stands for the zero-row check) the rows are divided by their plain norm and the
    contexts' ``scale`` are ones; otherwise (a zero row, entries near the ends of the
    range, or the data checks turned off on CuPy) each set goes through the scaled
    :func:`refdml.gpu.normalize._l2_forward`, which names the zero row.
    """
    xp = ns.xp
    n = x.shape[0]
    if data_checks(ns):
        joint = xp.concatenate([x, p])
        with ns.errstate(over="ignore"):    # beyond the range: the scaled path below
            sumsq = ns.row_dot(joint, joint)
        low, high = _PLAIN_NORM_RANGE[np.dtype(x.dtype)]
        if bool(xp.all((sumsq >= low) & (sumsq <= high))):
            norm = xp.sqrt(sumsq)
            unit = joint / norm
            x_unit, p_unit = unit[:n], unit[n:]
            x_ctx = L2NormalizeContext(y=x_unit, scale=ones_column(ns, n, x.dtype),
                                       scaled_norm=norm[:n])
            p_ctx = L2NormalizeContext(y=p_unit, scale=ones_column(ns, p.shape[0], x.dtype),
                                       scaled_norm=norm[n:])
            similarity = matmul(ns, x_unit, p_unit.T)
            return similarity, CosineContext(x_unit=x_unit, y_unit=p_unit, x_norm_ctx=x_ctx,
                                             y_norm_ctx=p_ctx, shape=tuple(similarity.shape))
    x_unit, x_ctx = _l2_forward(ns, x, "embeddings", COSINE_WHY)
    p_unit, p_ctx = _l2_forward(ns, p, "proxies", COSINE_WHY)
    similarity = matmul(ns, x_unit, p_unit.T)
    return similarity, CosineContext(x_unit=x_unit, y_unit=p_unit, x_norm_ctx=x_ctx,
                                     y_norm_ctx=p_ctx, shape=tuple(similarity.shape))
