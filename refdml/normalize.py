"""Normalisations of vectors along the last axis, forward and hand-derived backward.

``clip_normalize``: ``u -> u / max(1, ||u||)`` (GSP Alg. 2, ASAP Sec. 4.4)
    Projects onto the closed unit ball. For ``||u|| > 1`` the Jacobian is
    ``(I - y y^T) / ||u||`` with ``y = u / ||u||``; inside the ball it is the identity.
    On the sphere ``||u|| = 1`` the map is not differentiable; the backward uses the
    inside branch (identity), an element of the Clarke generalised Jacobian. The map is
    1-Lipschitz (a projection onto a convex set); ASAP's proof states 2.

``l2_normalize``: ``u -> u / ||u||``
    Jacobian ``(I - y y^T) / ||u||``. A zero vector has no direction: ValueError.

Extreme but finite input (entries of magnitude 1e-300 .. 1e300, and beyond): each row
``u`` is first divided by a power of two ``s`` with ``max|u| / s`` in ``[1, 2)`` (exact),
so ``||u / s||`` in ``[1, 2 sqrt(d))`` neither overflows nor underflows. The direction
``y = (u / s) / ||u / s||`` is then the same at every scale, and the gradient
``(I - y y^T) / ||u||`` is applied as ``(...) / ||u / s|| / s``, so it scales as ``1 / s``
without an intermediate ``||u||`` that could overflow. ``np.linalg.norm`` would square
first: ``inf`` above ~1e154 (zeros out) and ``0`` below ~1e-162 (a false zero vector).

Shapes: ``x`` is ``(..., d)``; the output and every gradient have the shape of ``x``.

The private kernels are written once against the array module ``xp`` (NumPy or CuPy) and
keep the input's dtype: the public functions here validate and call them on float64 NumPy
arrays; :mod:`refdml.gpu.normalize` calls the same kernels on float32/float64 NumPy or CuPy
arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from typing import Any

from refdml._validation import (
    as_float_array, check_context, check_nonzero_rows, check_upstream,
)
from refdml._backend import Backend, get_backend, to_numpy

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
class L2NormalizeContext:
    """What the backward of ``u -> u / ||u||`` needs (all keepdims except ``y``).

    ``||u|| = scale * scaled_norm`` is kept as two factors: their product can overflow
    (or underflow) where the gradient ``1 / ||u||`` itself is representable.
    """

    y: np.ndarray            # the output u / ||u||, shape of x
    scale: np.ndarray        # per-row power of two s, shape x.shape[:-1] + (1,)
    scaled_norm: np.ndarray  # ||u / s|| in [1, 2 sqrt(d)), same shape as scale


@dataclass(frozen=True)
class ClipNormalizeContext:
    """What the backward of ``u -> u / max(1, ||u||)`` needs (see L2NormalizeContext)."""

    y: np.ndarray            # the output, shape of x
    scale: np.ndarray        # per-row power of two s (keepdims)
    scaled_norm: np.ndarray  # ||u / s|| (keepdims)
    outside: np.ndarray      # ||u|| > 1 (keepdims, bool)


def _row_scale(xp: Any, x: Any) -> Any:
    """Per-row power of two ``s`` (keepdims, dtype of ``x``) with ``max|u| / s`` in ``[1, 2)``
    (1/2 for a zero row, which any power of two divides exactly).

    ``frexp`` writes ``max|u| = m 2^e`` with ``m`` in ``[1/2, 1)``, so ``s = 2^(e - 1)``,
    formed as ``(1/2) 2^e`` (``2 ** e`` would be ``inf`` for entries near the dtype's
    maximum). Four element-wise passes on any array module, no branch on the zero rows.
    """
    peak = xp.max(xp.abs(x), axis=-1, keepdims=True)
    exponent = xp.frexp(peak)[1]
    return xp.ldexp(x.dtype.type(0.5), exponent)


def _scaled_direction(xp: Any, x: Any) -> tuple[Any, Any, Any]:
    """``(u / s) / ||u / s||`` (0 for a zero row), ``s`` and ``||u / s||``, per row."""
    scale = _row_scale(xp, x)
    scaled = x / scale
    scaled_norm = xp.sqrt(_row_dot(scaled, scaled))
    # A nonzero row's ||u / s|| is at least its largest entry, in [1, 2): the maximum with 1
    # is the norm itself there, and 1 for a zero row (whose direction is then 0, not 0/0).
    direction = scaled / xp.maximum(scaled_norm, 1)
    return direction, scale, scaled_norm


def _row_dot(a: Any, b: Any) -> Any:
    """``<a, b>`` per row (keepdims): ``sum(a * b, axis=-1, keepdims=True)``, as one batched
    matrix product of (1, d) by (d, 1) (one kernel on a device, not a product and a sum;
    :meth:`refdml._backend.Backend.row_dot`, which takes the product and the sum while CuPy
    captures a CUDA graph)."""
    return get_backend(a).row_dot(a, b)


def _tangent(xp: Any, y: Any, d_y: Any) -> Any:
    """``(I - y y^T) d_y`` per row: the part of ``d_y`` orthogonal to the unit vector ``y``."""
    return d_y - y * _row_dot(y, d_y)


def _clip_forward(xp: Any, x: Any) -> tuple[Any, ClipNormalizeContext]:
    direction, scale, scaled_norm = _scaled_direction(xp, x)
    # ||u|| > 1 without forming ||u|| (it can overflow): ||u/s|| > 1/s, with 1/s exact
    # or, for the tiniest rows (s below the dtype's smallest normal), inf: "inside".
    with np.errstate(over="ignore", divide="ignore"):
        outside = scaled_norm > 1 / scale
    y = xp.where(outside, direction, x)
    return y, ClipNormalizeContext(y=y, scale=scale, scaled_norm=scaled_norm, outside=outside)


def _clip_backward(xp: Any, y: Any, d_y: Any, outside: Any, norm: Any, scale: Any = None) -> Any:
    """``d u`` from ``d y`` of ``y = u / max(1, ||u||)``, per row: ``(I - y y^T) d_y / ||u||``
    where ``outside`` (``||u|| > 1``), ``d_y`` inside the ball and on the sphere.

    The one clip-to-ball backward of refdml: :func:`clip_normalize_backward`, the GSP cost
    map's (:mod:`refdml.gsp`) and the fast path's (through
    :mod:`refdml._shared.normalize`) call it, on any array module ``xp``. ``y`` is the
    clipped vector (the forward's output), ``outside``, ``norm`` (and ``scale``) keepdims.
    ``||u||`` is ``norm``, or ``norm * scale`` where ``scale`` is given: two factors (the
    normalisation's ``||u / s||`` and ``s``), whose product can overflow or underflow where
    the gradient itself is representable.
    """
    # Inside rows take the identity; their (unused) denominators are set to 1.
    one = xp.ones_like(norm)
    projected = _tangent(xp, y, d_y) / xp.where(outside, norm, one)
    if scale is not None:
        projected /= xp.where(outside, scale, one)
    return xp.where(outside, projected, d_y)


def clip_normalize_forward(x) -> tuple[np.ndarray, ClipNormalizeContext]:
    """``y = x / max(1, ||x||)`` along the last axis; returns ``(y, ctx)``.

    .. math:: y = \\frac{x}{\\max(1, \\lVert x \\rVert_2)}

    ``x`` of shape ``(..., d)``; ``y`` has the same shape. GSP Alg. 2, ASAP Sec. 4.4.

    Parameters
    ----------
    x : float array (..., d)
        Vectors along the last axis (any leading dimensions); those of norm above 1 are
        scaled onto the unit sphere, the others kept.
    """
    x = as_float_array(x, "x", min_ndim=1)
    return _clip_forward(np, x)


def clip_normalize_backward(ctx: ClipNormalizeContext, d_y) -> NormalizeGrads:
    """Gradient with respect to ``x`` of ``<d_y, y>``: ``(I - y y^T) d_y / ||x||`` outside
    the unit ball, ``d_y`` inside and on the sphere. ``d_y`` must have the shape of ``y``."""
    check_context(ctx, "ctx", ClipNormalizeContext)
    d_y = check_upstream(d_y, "d_y", ctx.y.shape)
    return NormalizeGrads(x=_clip_backward(np, ctx.y, d_y, ctx.outside, ctx.scaled_norm, ctx.scale))


def clip_normalize(x) -> np.ndarray:
    """``x / max(1, ||x||)`` along the last axis (no context kept)."""
    return clip_normalize_forward(x)[0]


_ZERO_WHY = "L2 normalisation of a zero vector is undefined"


def _l2_forward(
    x: Any, name: str = "x", *, why: str = _ZERO_WHY, ns: Backend | None = None
) -> tuple[Any, L2NormalizeContext]:
    """``x / ||x||`` of a checked array; ``ValueError`` naming ``name``'s first zero row (on
    CuPy only while data checks are on: :func:`refdml._validation.data_checks`)."""
    ns = ns if ns is not None else get_backend(x)
    check_nonzero_rows(ns.xp, x, name, why=why, ns=ns)
    y, scale, scaled_norm = _scaled_direction(ns.xp, x)
    return y, L2NormalizeContext(y=y, scale=scale, scaled_norm=scaled_norm)


def _l2_backward(
    xp: Any, ctx: L2NormalizeContext, d_y: Any, name: str | None = None, *,
    unit_scale: bool = False,
) -> Any:
    """``(I - y y^T) d_y / ||x||``, as ``(...) / ||x / s|| / s``.

    With ``name``, a gradient beyond the dtype (it scales as ``1 / ||x||``: rows of
    subnormal entries) is a ``ValueError`` naming it; without, the caller checks (or has
    turned the data checks off). ``unit_scale``: ``ctx.scale`` is all ones (the fast
    path's losses), and the division by it is left out.
    """
    grad = _tangent(xp, ctx.y, d_y)
    with np.errstate(over="ignore", divide="ignore"):
        grad /= ctx.scaled_norm
        if not unit_scale:
            grad /= ctx.scale
    if name is not None:
        _check_l2_gradient(xp, grad, ctx, name, unit_scale=unit_scale)
    return grad


def _check_l2_gradient(xp: Any, grad: Any, ctx: L2NormalizeContext, name: str, *,
                       unit_scale: bool = False) -> None:
    """``ValueError`` naming ``name`` where the gradient of ``x / ||x||`` is beyond the
    dtype (one read of the device on CuPy; the fast path's kernels check theirs here too)."""
    if not bool(xp.all(xp.isfinite(grad))):
        norm = ctx.scaled_norm if unit_scale else ctx.scaled_norm * ctx.scale
        raise ValueError(_l2_overflow_message(to_numpy(grad), to_numpy(norm), name,
                                              np.dtype(grad.dtype).name))


def _l2_overflow_message(grad, norm, name: str, dtype_name: str) -> str:
    """The message of a gradient of ``x / ||x||`` beyond the dtype (reference and fast path)."""
    index = tuple(int(i) for i in np.argwhere(~np.isfinite(grad))[0][:-1])
    row = index[0] if len(index) == 1 else index
    return (
        f"the gradient with respect to {name} overflows {dtype_name} at row {row}: the "
        f"gradient of x / ||x|| scales as 1 / ||x||, and that row's norm is "
        f"{float(np.broadcast_to(norm, grad.shape[:-1] + (1,))[index + (0,)]):.3g}; rescale {name}"
    )


def l2_normalize_forward(x) -> tuple[np.ndarray, L2NormalizeContext]:
    """``y = x / ||x||`` along the last axis; returns ``(y, ctx)``.

    .. math:: y = \\frac{x}{\\lVert x \\rVert_2}

    ``x`` of shape ``(..., d)``; ``y`` has the same shape. ``ValueError`` naming the
    first zero row of ``x`` (a row of tiny but nonzero entries, e.g. 1e-300, is fine).

    Parameters
    ----------
    x : float array (..., d)
        Vectors along the last axis (any leading dimensions), none of them zero.
    """
    x = as_float_array(x, "x", min_ndim=1)
    return _l2_forward(x)


def l2_normalize_backward(ctx: L2NormalizeContext, d_y) -> NormalizeGrads:
    """Gradient with respect to ``x`` of ``<d_y, y>``: ``(I - y y^T) d_y / ||x||``.

    ``d_y`` must have the shape of ``y`` (no broadcasting). The gradient scales as
    ``1 / ||x||``: ~1e300 for rows of norm ~1e-300, ~1e-300 for rows of norm ~1e300.
    """
    check_context(ctx, "ctx", L2NormalizeContext)
    d_y = check_upstream(d_y, "d_y", ctx.y.shape)
    return NormalizeGrads(x=_l2_backward(np, ctx, d_y, "x"))


def l2_normalize(x) -> np.ndarray:
    """``x / ||x||`` along the last axis (no context kept)."""
    return l2_normalize_forward(x)[0]
