"""Normalisations of vectors along the last axis, forward and hand-derived backward.

``clip_normalize``: ``u -> u / max(1, ||u||)`` (GSP Alg. 2, ASAP Sec. 4.4)
    Projects onto the closed unit ball. For ``||u|| > 1`` the Jacobian is
    ``(I - y y^T) / ||u||`` with ``y = u / ||u||``; inside the ball it is the identity.
    On the sphere ``||u|| = 1`` the map is not differentiable; the backward uses the
    inside branch (identity), an element of the Clarke generalised Jacobian. The map is
    1-Lipschitz (a projection onto a convex set); ASAP's proof states 2.

``l2_normalize``: ``u -> u / ||u||``
    Jacobian ``(I - y y^T) / ||u||``. A zero vector has no direction: ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._validation import as_float_array
from refdml.gradcheck.registry import OperatorSpec, register

__all__ = [
    "ClipNormalizeContext",
    "L2NormalizeContext",
    "NormalizeGrads",
    "clip_normalize",
    "clip_normalize_backward",
    "clip_normalize_forward",
    "l2_normalize",
    "l2_normalize_backward",
    "l2_normalize_forward",
]


@dataclass(frozen=True)
class NormalizeGrads:
    x: np.ndarray


@dataclass(frozen=True)
class ClipNormalizeContext:
    y: np.ndarray      # the output, shape of x
    norm: np.ndarray   # ||x|| along the last axis, keepdims
    outside: np.ndarray  # ||x|| > 1, keepdims


@dataclass(frozen=True)
class L2NormalizeContext:
    y: np.ndarray
    norm: np.ndarray


def _clip_forward(x: np.ndarray) -> tuple[np.ndarray, ClipNormalizeContext]:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    outside = norm > 1.0
    y = x / np.maximum(norm, 1.0)
    return y, ClipNormalizeContext(y=y, norm=norm, outside=outside)


def _clip_backward(ctx: ClipNormalizeContext, d_y: np.ndarray) -> np.ndarray:
    radial = np.sum(ctx.y * d_y, axis=-1, keepdims=True)
    projected = (d_y - ctx.y * radial) / np.maximum(ctx.norm, 1.0)
    return np.where(ctx.outside, projected, d_y)


def clip_normalize_forward(x) -> tuple[np.ndarray, ClipNormalizeContext]:
    """``y = x / max(1, ||x||)`` along the last axis; returns ``(y, ctx)``."""
    x = as_float_array(x, "x", min_ndim=1)
    return _clip_forward(x)


def clip_normalize_backward(ctx: ClipNormalizeContext, d_y) -> NormalizeGrads:
    """Gradient with respect to ``x`` given the upstream gradient ``d_y``."""
    return NormalizeGrads(x=_clip_backward(ctx, np.asarray(d_y, dtype=np.float64)))


def clip_normalize(x) -> np.ndarray:
    """``x / max(1, ||x||)`` along the last axis (no context kept)."""
    return clip_normalize_forward(x)[0]


def _l2_forward(x: np.ndarray, name: str = "x") -> tuple[np.ndarray, L2NormalizeContext]:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    if np.any(norm == 0.0):
        index = tuple(int(i) for i in np.argwhere(norm[..., 0] == 0.0)[0])
        raise ValueError(
            f"{name} has a zero vector at index {index}; L2 normalisation of zero is undefined"
        )
    y = x / norm
    return y, L2NormalizeContext(y=y, norm=norm)


def _l2_backward(ctx: L2NormalizeContext, d_y: np.ndarray) -> np.ndarray:
    radial = np.sum(ctx.y * d_y, axis=-1, keepdims=True)
    return (d_y - ctx.y * radial) / ctx.norm


def l2_normalize_forward(x) -> tuple[np.ndarray, L2NormalizeContext]:
    """``y = x / ||x||`` along the last axis; returns ``(y, ctx)``."""
    x = as_float_array(x, "x", min_ndim=1)
    return _l2_forward(x)


def l2_normalize_backward(ctx: L2NormalizeContext, d_y) -> NormalizeGrads:
    """Gradient with respect to ``x`` given the upstream gradient ``d_y``."""
    return NormalizeGrads(x=_l2_backward(ctx, np.asarray(d_y, dtype=np.float64)))


def l2_normalize(x) -> np.ndarray:
    """``x / ||x||`` along the last axis (no context kept)."""
    return l2_normalize_forward(x)[0]


def _mixed_norm_vectors(rng: np.random.Generator) -> dict:
    # Rows both inside and outside the unit ball, none near the sphere (the kink).
    x = rng.standard_normal((6, 4))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x *= np.array([0.3, 0.7, 0.9, 1.2, 2.0, 3.5])[:, None]
    return {"x": x}


register(OperatorSpec(
    name="normalize.clip_normalize",
    forward=clip_normalize_forward,
    backward=clip_normalize_backward,
    make_inputs=_mixed_norm_vectors,
    paper="GSP Alg. 2 normalisation; ASAP Sec. 4.4",
))
register(OperatorSpec(
    name="normalize.l2_normalize",
    forward=l2_normalize_forward,
    backward=l2_normalize_backward,
    make_inputs=_mixed_norm_vectors,
    paper="L2 normalisation of embeddings",
))
