"""Pairwise distances and similarities between two sets of vectors, forward and backward.

All functions take ``x`` of shape ``(..., n, d)`` and ``y`` of shape ``(..., m, d)`` with
matching (broadcastable) leading dimensions and return ``(..., n, m)``; each backward
takes an upstream gradient of exactly that shape and returns gradients shaped like
``x`` and ``y`` (summed over broadcast leading dimensions).

``euclidean``: ``D_ij = ||x_i - y_j||``
    :func:`refdml._numerics.pairwise_norm`: the Gram identity, with nearby pairs (where
    its cancellation would lose digits) recomputed from explicit differences, after both
    sets are divided by one power of two; ~1e-12 relative everywhere, right for any
    finite input (1e-300 .. 1e300), and no ``(n, m, d)`` array. Gradient
    ``dD_ij/dx_i = (x_i - y_j) / D_ij``; at ``D_ij = 0`` the norm is not differentiable
    and the backward uses the subgradient 0 (the centre of the subdifferential, the unit
    ball), never NaN.
``sq_euclidean``: ``D_ij = ||x_i - y_j||^2``, smooth, gradient ``2 (x_i - y_j)``.
    Where a true squared distance exceeds the float64 range (``|x| ~ 1e155`` and
    beyond) the forward raises ``ValueError`` (use ``euclidean``) instead of returning
    ``inf``; squares below the range round to 0 or a subnormal, which is their correctly
    rounded float64 value (the gradient ``2 (x_i - y_j)`` stays exact there).
``cosine``: ``S_ij = <x_i, y_j> / (||x_i|| ||y_j||)``; zero vectors raise ValueError.
    Each row is normalised by :func:`refdml.normalize.l2_normalize`'s kernel, which
    rescales it by a power of two first: the same similarities at any scale.

The shape checks, the backwards and the cosine forward are written once against the array
module ``xp`` (keyword ``xp=np`` / ``ns``, the dtype of the input kept):
:mod:`refdml.gpu.distances` calls them on float32/float64 NumPy or CuPy arrays. The
forwards of ``euclidean`` and ``sq_euclidean`` are the fast path's own there (the Gram
identity without the recomputation of nearby pairs: a different algorithm).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._numerics import pairwise_norm, pairwise_sq_distances
from refdml._validation import as_float_array, check_context, check_upstream
from refdml._backend import Backend
from refdml.normalize import L2NormalizeContext, _l2_backward, _l2_forward

__all__ = [
    "CosineContext",
    "DistanceGrads",
    "EuclideanContext",
    "SqEuclideanContext",
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

# Other families import this name; the kernel is shared (refdml._numerics).
_pairwise_norm = pairwise_norm


@dataclass(frozen=True)
class DistanceGrads:
    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True)
class EuclideanContext:
    x: np.ndarray         # (..., n, d)
    y: np.ndarray         # (..., m, d)
    distance: np.ndarray  # the output, (..., n, m)


@dataclass(frozen=True)
class SqEuclideanContext:
    x: np.ndarray                # (..., n, d)
    y: np.ndarray                # (..., m, d)
    shape: tuple[int, ...]       # shape of the output, (..., n, m)


@dataclass(frozen=True)
class CosineContext:
    x_unit: np.ndarray           # x / ||x||, (..., n, d)
    y_unit: np.ndarray           # y / ||y||, (..., m, d)
    x_norm_ctx: L2NormalizeContext
    y_norm_ctx: L2NormalizeContext
    shape: tuple[int, ...]       # shape of the output, (..., n, m)


def _check_pair_shapes(x: Any, y: Any) -> None:
    """``x (..., n, d)`` and ``y (..., m, d)`` of one ``d`` and broadcastable leading axes."""
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"x and y must have the same last dimension, got x.shape={tuple(x.shape)}, "
            f"y.shape={tuple(y.shape)}"
        )
    try:
        np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    except ValueError:
        raise ValueError(
            f"leading dimensions of x {tuple(x.shape[:-2])} and y {tuple(y.shape[:-2])} "
            "do not broadcast"
        ) from None


def _check_pair(x, y) -> tuple[np.ndarray, np.ndarray]:
    x = as_float_array(x, "x", min_ndim=2)
    y = as_float_array(y, "y", min_ndim=2)
    _check_pair_shapes(x, y)
    return x, y


def _sum_to_shape(grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum a broadcast gradient back to the shape of the input it came from."""
    extra = grad.ndim - len(shape)
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad


def _euclidean_forward(x, y) -> tuple[np.ndarray, EuclideanContext]:
    distance = pairwise_norm(x, y)
    return distance, EuclideanContext(x=x, y=y, distance=distance)


def _euclidean_backward(ctx: EuclideanContext, d_distance: Any, *, xp: Any = np) -> DistanceGrads:
    # d_x_i = sum_j w_ij (x_i - y_j), w_ij = g_ij / D_ij (subgradient 0 where D_ij = 0).
    # Within 1e-300 .. 1e300 neither factor over- nor underflows: w scales as 1 / |x|.
    positive = ctx.distance > 0
    w = xp.where(positive, d_distance / xp.where(positive, ctx.distance, xp.ones_like(d_distance)),
                 0)
    w = w.astype(ctx.distance.dtype, copy=False)   # CuPy's where may promote the 0
    d_x = w.sum(axis=-1)[..., None] * ctx.x - w @ ctx.y
    d_y = w.sum(axis=-2)[..., None] * ctx.y - xp.swapaxes(w, -1, -2) @ ctx.x
    return DistanceGrads(x=_sum_to_shape(d_x, ctx.x.shape), y=_sum_to_shape(d_y, ctx.y.shape))


def euclidean_forward(x, y) -> tuple[np.ndarray, EuclideanContext]:
    """Pairwise Euclidean distances; returns ``(D, ctx)``.

    .. math:: D_{\\dots ij} = \\lVert x_{\\dots i} - y_{\\dots j} \\rVert_2

    ``x (..., n, d)``, ``y (..., m, d)`` -> ``D (..., n, m)``. GSP Alg. 2 cost map,
    ASAP Sec. 3 ``d_f``. Right for any finite input (no overflow at 1e300).

    Parameters
    ----------
    x : float array (..., n, d)
        The first points, one per row.
    y : float array (..., m, d)
        The second points, one per row: the same ``d`` and leading dimensions as ``x``.
    """
    x, y = _check_pair(x, y)
    return _euclidean_forward(x, y)


def euclidean_backward(ctx: EuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_distance, D>``; subgradient 0 at coincident points.

    .. math:: \\partial_{x_i} = \\sum_j g_{ij} (x_i - y_j) / D_{ij}, \\quad
              \\partial_{y_j} = \\sum_i g_{ij} (y_j - x_i) / D_{ij}

    ``d_distance`` must have exactly the shape of ``D`` (no broadcasting).
    """
    check_context(ctx, "ctx", EuclideanContext)
    d_distance = check_upstream(d_distance, "d_distance", ctx.distance.shape)
    return _euclidean_backward(ctx, d_distance)


def euclidean(x, y) -> np.ndarray:
    """Pairwise Euclidean distances (no context kept)."""
    return euclidean_forward(x, y)[0]


def _check_sq_range(distance: Any, x: Any, y: Any, *, xp: Any = np) -> None:
    if bool(xp.any(xp.isinf(distance))):
        largest = max(float(xp.max(xp.abs(x))), float(xp.max(xp.abs(y))))
        raise ValueError(
            f"x and y: squared distances overflow {np.dtype(distance.dtype).name} "
            f"(max |x|, |y| == {largest:.3g}); use euclidean"
        )


def _sq_euclidean_forward(x, y) -> tuple[np.ndarray, SqEuclideanContext]:
    distance = pairwise_sq_distances(x, y)
    _check_sq_range(distance, x, y)
    return distance, SqEuclideanContext(x=x, y=y, shape=distance.shape)


def _sq_euclidean_backward(ctx: SqEuclideanContext, g: Any, *, xp: Any = np) -> DistanceGrads:
    d_x = 2 * (g.sum(axis=-1)[..., None] * ctx.x - g @ ctx.y)
    d_y = 2 * (g.sum(axis=-2)[..., None] * ctx.y - xp.swapaxes(g, -1, -2) @ ctx.x)
    return DistanceGrads(x=_sum_to_shape(d_x, ctx.x.shape), y=_sum_to_shape(d_y, ctx.y.shape))


def sq_euclidean_forward(x, y) -> tuple[np.ndarray, SqEuclideanContext]:
    """Pairwise squared Euclidean distances; returns ``(D, ctx)``.

    .. math:: D_{\\dots ij} = \\lVert x_{\\dots i} - y_{\\dots j} \\rVert_2^2

    ``x (..., n, d)``, ``y (..., m, d)`` -> ``D (..., n, m)``. ``ValueError`` where a
    squared distance exceeds float64 (use :func:`euclidean` there).

    Parameters
    ----------
    x : float array (..., n, d)
        The first points, one per row.
    y : float array (..., m, d)
        The second points, one per row: the same ``d`` and leading dimensions as ``x``.
    """
    x, y = _check_pair(x, y)
    return _sq_euclidean_forward(x, y)


def sq_euclidean_backward(ctx: SqEuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_distance, D>``: ``2 sum_j g_ij (x_i - y_j)`` and the
    symmetric sum. ``d_distance`` must have exactly the shape of ``D``."""
    check_context(ctx, "ctx", SqEuclideanContext)
    d_distance = check_upstream(d_distance, "d_distance", ctx.shape)
    return _sq_euclidean_backward(ctx, d_distance)


def sq_euclidean(x, y) -> np.ndarray:
    """Pairwise squared Euclidean distances (no context kept)."""
    return sq_euclidean_forward(x, y)[0]


def _cosine_forward(x, y, *, ns: Backend | None = None) -> tuple[Any, CosineContext]:
    x_unit, x_ctx = _l2_forward(x, "x", ns=ns)
    y_unit, y_ctx = _l2_forward(y, "y", ns=ns)
    xp = np if ns is None else ns.xp
    similarity = x_unit @ xp.swapaxes(y_unit, -1, -2)
    return similarity, CosineContext(x_unit, y_unit, x_ctx, y_ctx, tuple(similarity.shape))


def _cosine_backward(ctx: CosineContext, g: Any, *, xp: Any = np,
                     check: bool = True) -> DistanceGrads:
    """``check=False``: a gradient beyond the dtype is not looked for (CuPy, data checks off)."""
    d_x_unit = g @ ctx.y_unit
    d_y_unit = xp.swapaxes(g, -1, -2) @ ctx.x_unit
    d_x = _l2_backward(xp, ctx.x_norm_ctx, _sum_to_shape(d_x_unit, ctx.x_unit.shape),
                       "x" if check else None)
    d_y = _l2_backward(xp, ctx.y_norm_ctx, _sum_to_shape(d_y_unit, ctx.y_unit.shape),
                       "y" if check else None)
    return DistanceGrads(x=d_x, y=d_y)


def cosine_forward(x, y) -> tuple[np.ndarray, CosineContext]:
    """Pairwise cosine similarities; returns ``(S, ctx)``.

    .. math:: S_{\\dots ij} = \\frac{\\langle x_{\\dots i}, y_{\\dots j} \\rangle}
              {\\lVert x_{\\dots i} \\rVert \\, \\lVert y_{\\dots j} \\rVert}

    ``x (..., n, d)``, ``y (..., m, d)`` -> ``S (..., n, m)``; the same at any scale of
    ``x`` or ``y``. ``ValueError`` naming ``x`` or ``y`` and the row of a zero vector.

    Parameters
    ----------
    x : float array (..., n, d)
        The first points, one per row.
    y : float array (..., m, d)
        The second points, one per row: the same ``d`` and leading dimensions as ``x``.
    """
    x, y = _check_pair(x, y)
    return _cosine_forward(x, y)


def cosine_backward(ctx: CosineContext, d_similarity) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_similarity, S>``, through ``l2_normalize``'s backward:
    ``d_x_i = (I - u_i u_i^T) sum_j g_ij v_j / ||x_i||`` with ``u, v`` the unit rows.
    ``d_similarity`` must have exactly the shape of ``S``."""
    check_context(ctx, "ctx", CosineContext)
    d_similarity = check_upstream(d_similarity, "d_similarity", ctx.shape)
    return _cosine_backward(ctx, d_similarity)


def cosine(x, y) -> np.ndarray:
    """Pairwise cosine similarities (no context kept)."""
    return cosine_forward(x, y)[0]
