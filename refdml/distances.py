"""Pairwise distances and similarities between two sets of vectors, forward and backward.

All functions take ``x`` of shape ``(..., n, d)`` and ``y`` of shape ``(..., m, d)`` with
matching (broadcastable) leading dimensions and return ``(..., n, m)``.

``euclidean``: ``D_ij = ||x_i - y_j||``
    Computed with the Gram identity, then nearby pairs (where its cancellation would
    lose digits) are recomputed from explicit differences; the result is accurate to
    ~1e-12 relative everywhere and needs no (n, m, d) array. Gradient ``dD_ij/dx_i = (x_i - y_j) / D_ij``; at ``D_ij = 0``
    the norm is not differentiable and the backward uses the subgradient 0 (the
    centre of the subdifferential, the unit ball), never NaN.
``sq_euclidean``: ``D_ij = ||x_i - y_j||^2``, smooth, gradient ``2 (x_i - y_j)``.
``cosine``: ``S_ij = <x_i, y_j> / (||x_i|| ||y_j||)``; zero vectors raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._validation import as_float_array
from refdml.gradcheck.registry import OperatorSpec, register
from refdml.normalize import _l2_backward, _l2_forward

__all__ = [
    "CosineContext",
    "DistanceGrads",
    "EuclideanContext",
    "cosine",
    "cosine_backward",
    "cosine_forward",
    "euclidean",
    "euclidean_backward",
    "euclidean_forward",
    "sq_euclidean",
    "sq_euclidean_backward",
    "sq_euclidean_forward",
]

# Squared distances below this fraction of |x|^2 + |y|^2 are recomputed exactly.
_REFINE = 1e-3
# Bytes of explicit differences materialised at once when refining.
_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class DistanceGrads:
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class EuclideanContext:
    x: np.ndarray
    y: np.ndarray
    distance: np.ndarray


@dataclass(frozen=True)
class SqEuclideanContext:
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class CosineContext:
    x_unit: np.ndarray
    y_unit: np.ndarray
    x_norm_ctx: object
    y_norm_ctx: object


def _check_pair(x, y) -> tuple[np.ndarray, np.ndarray]:
    x = as_float_array(x, "x", min_ndim=2)
    y = as_float_array(y, "y", min_ndim=2)
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"x and y must have the same last dimension, got x.shape={x.shape}, y.shape={y.shape}"
        )
    try:
        np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading dimensions of x {x.shape[:-2]} and y {y.shape[:-2]} do not broadcast"
        ) from None
    return x, y


def _pairwise_norm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """||x_i - y_j|| for x (..., n, d), y (..., m, d), accurate to a few ulps of the norm.

    The Gram identity ``|x|^2 + |y|^2 - 2 <x, y>`` is fast (one matrix product) but its
    absolute error is about ``eps (|x|^2 + |y|^2)``, which destroys the distance of nearby
    points. Pairs whose squared distance is below ``_REFINE * (|x|^2 + |y|^2)`` are
    therefore recomputed from explicit differences; elsewhere the relative error of the
    squared distance is at most ``~4 eps / _REFINE``, i.e. ~1e-12.
    """
    lead = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    xb = np.broadcast_to(x, lead + x.shape[-2:])
    yb = np.broadcast_to(y, lead + y.shape[-2:])
    x_sq = np.einsum("...nd,...nd->...n", xb, xb)
    y_sq = np.einsum("...md,...md->...m", yb, yb)
    magnitude = x_sq[..., :, None] + y_sq[..., None, :]
    sq = magnitude - 2.0 * (xb @ np.swapaxes(yb, -1, -2))
    refine = sq <= _REFINE * magnitude
    if np.any(refine):
        idx = np.nonzero(refine)
        lead_idx = idx[:-2]
        diff = xb[lead_idx + (idx[-2],)] - yb[lead_idx + (idx[-1],)]
        # Bounded memory: at most one (d,)-vector per refined pair, in chunks.
        values = np.empty(diff.shape[0])
        step = max(1, _CHUNK_BYTES // max(1, 8 * diff.shape[-1]))
        for start in range(0, diff.shape[0], step):
            block = diff[start : start + step]
            values[start : start + step] = np.einsum("kd,kd->k", block, block)
        sq[refine] = values
    return np.sqrt(np.maximum(sq, 0.0))


def _sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a broadcast gradient back to the shape of the input it came from."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


def _euclidean_forward(x, y) -> tuple[np.ndarray, EuclideanContext]:
    distance = _pairwise_norm(x, y)
    return distance, EuclideanContext(x=x, y=y, distance=distance)


def _euclidean_backward(ctx: EuclideanContext, d_distance: np.ndarray) -> DistanceGrads:
    # w_ij = g_ij / D_ij, with the subgradient 0 where D_ij = 0.
    positive = ctx.distance > 0.0
    w = np.where(positive, d_distance / np.where(positive, ctx.distance, 1.0), 0.0)
    d_x = w.sum(axis=-1)[..., None] * ctx.x - w @ ctx.y
    d_y = w.sum(axis=-2)[..., None] * ctx.y - np.swapaxes(w, -1, -2) @ ctx.x
    return DistanceGrads(x=_sum_to_shape(d_x, ctx.x.shape), y=_sum_to_shape(d_y, ctx.y.shape))


def euclidean_forward(x, y) -> tuple[np.ndarray, EuclideanContext]:
    """Pairwise Euclidean distances ``D[..., i, j] = ||x_i - y_j||``; returns ``(D, ctx)``."""
    x, y = _check_pair(x, y)
    return _euclidean_forward(x, y)


def euclidean_backward(ctx: EuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_distance, D>``; subgradient 0 at coincident points."""
    return _euclidean_backward(ctx, np.asarray(d_distance, dtype=np.float64))


def euclidean(x, y) -> np.ndarray:
    """Pairwise Euclidean distances (no context kept)."""
    return euclidean_forward(x, y)[0]


def _sq_euclidean_forward(x, y) -> tuple[np.ndarray, SqEuclideanContext]:
    distance = _pairwise_norm(x, y) ** 2
    return distance, SqEuclideanContext(x=x, y=y)


def _sq_euclidean_backward(ctx: SqEuclideanContext, g: np.ndarray) -> DistanceGrads:
    d_x = 2.0 * (g.sum(axis=-1)[..., None] * ctx.x - g @ ctx.y)
    d_y = 2.0 * (g.sum(axis=-2)[..., None] * ctx.y - np.swapaxes(g, -1, -2) @ ctx.x)
    return DistanceGrads(x=_sum_to_shape(d_x, ctx.x.shape), y=_sum_to_shape(d_y, ctx.y.shape))


def sq_euclidean_forward(x, y) -> tuple[np.ndarray, SqEuclideanContext]:
    """Pairwise squared Euclidean distances ``||x_i - y_j||^2``; returns ``(D, ctx)``."""
    x, y = _check_pair(x, y)
    return _sq_euclidean_forward(x, y)


def sq_euclidean_backward(ctx: SqEuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_distance, D>``."""
    return _sq_euclidean_backward(ctx, np.asarray(d_distance, dtype=np.float64))


def sq_euclidean(x, y) -> np.ndarray:
    """Pairwise squared Euclidean distances (no context kept)."""
    return sq_euclidean_forward(x, y)[0]


def _cosine_forward(x, y) -> tuple[np.ndarray, CosineContext]:
    x_unit, x_ctx = _l2_forward(x, "x")
    y_unit, y_ctx = _l2_forward(y, "y")
    similarity = x_unit @ np.swapaxes(y_unit, -1, -2)
    return similarity, CosineContext(x_unit, y_unit, x_ctx, y_ctx)


def _cosine_backward(ctx: CosineContext, g: np.ndarray) -> DistanceGrads:
    d_x_unit = g @ ctx.y_unit
    d_y_unit = np.swapaxes(g, -1, -2) @ ctx.x_unit
    d_x = _l2_backward(ctx.x_norm_ctx, _sum_to_shape(d_x_unit, ctx.x_unit.shape))
    d_y = _l2_backward(ctx.y_norm_ctx, _sum_to_shape(d_y_unit, ctx.y_unit.shape))
    return DistanceGrads(x=d_x, y=d_y)


def cosine_forward(x, y) -> tuple[np.ndarray, CosineContext]:
    """Pairwise cosine similarities; returns ``(S, ctx)``. Zero vectors raise ValueError."""
    x, y = _check_pair(x, y)
    return _cosine_forward(x, y)


def cosine_backward(ctx: CosineContext, d_similarity) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_similarity, S>``."""
    return _cosine_backward(ctx, np.asarray(d_similarity, dtype=np.float64))


def cosine(x, y) -> np.ndarray:
    """Pairwise cosine similarities (no context kept)."""
    return cosine_forward(x, y)[0]


def _two_sets(rng: np.random.Generator) -> dict:
    return {"x": rng.standard_normal((2, 4, 3)), "y": rng.standard_normal((2, 5, 3))}


for _name, _fwd, _bwd, _paper in (
    ("distances.euclidean", euclidean_forward, euclidean_backward, "GSP Alg. 2 cost map; d_f of ASAP Sec. 3"),
    ("distances.sq_euclidean", sq_euclidean_forward, sq_euclidean_backward, "squared Euclidean distance"),
    ("distances.cosine", cosine_forward, cosine_backward, "cosine similarity (XBM C1, proxy losses)"),
):
    register(OperatorSpec(name=_name, forward=_fwd, backward=_bwd, make_inputs=_two_sets, paper=_paper))
