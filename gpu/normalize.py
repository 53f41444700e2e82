"""Fast-path mirror of :mod:`refdml.normalize` (NumPy or CuPy, float32 or float64).

Same maths, names and contexts as the reference (see its docstring): each row ``u`` is
divided by a power of two ``s`` with ``max|u| / s`` in ``[1, 2)`` (exact in either
dtype), so ``||u / s||`` neither overflows nor underflows, in float32 too (whose range
ends at ~3.4e38). Everything is elementwise or a reduction along the last axis: no
loop, no host copy; the zero-row check of ``l2_normalize`` is the only synchronisation
(see :mod:`refdml.gpu._fast_checks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._xp import ArrayNamespace, array_namespace, to_numpy
from refdml._validation import check_context
from refdml.gpu import _validation
from refdml.gpu._fast_checks import check_fast_upstream, check_nonzero_rows
from refdml.gpu._validation import as_fast_array
from refdml.normalize import (
    ClipNormalizeContext,
    L2NormalizeContext,
    NormalizeGrads,
    _l2_overflow_message,
)

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

_ZERO_WHY = "L2 normalisation of a zero vector is undefined"


def _row_scale(xp: Any, x: Any) -> Any:
    """Per-row power of two ``s`` (keepdims, dtype of ``x``) with ``max|u| / s`` in [1, 2)."""
    peak = xp.max(xp.abs(x), axis=-1, keepdims=True)
    exponent = xp.frexp(peak)[1]
    one = xp.ones_like(peak)
    return xp.where(peak > 0, xp.ldexp(one, exponent - 1), one)


def _scaled_direction(xp: Any, x: Any) -> tuple[Any, Any, Any]:
    scale = _row_scale(xp, x)
    scaled = x / scale
    scaled_norm = xp.sqrt(xp.sum(scaled * scaled, axis=-1, keepdims=True))
    direction = scaled / xp.where(scaled_norm > 0, scaled_norm, xp.ones_like(scaled_norm))
    return direction, scale, scaled_norm


def _tangent(xp: Any, y: Any, d_y: Any) -> Any:
    return d_y - y * xp.sum(y * d_y, axis=-1, keepdims=True)


def _l2_forward(
    ns: ArrayNamespace, x: Any, name: str = "x", why: str = _ZERO_WHY
) -> tuple[Any, L2NormalizeContext]:
    """Kernel of ``l2_normalize_forward`` on a checked array (used by distances, losses)."""
    check_nonzero_rows(ns.xp, x, name, why=why, ns=ns)
    y, scale, scaled_norm = _scaled_direction(ns.xp, x)
    return y, L2NormalizeContext(y=y, scale=scale, scaled_norm=scaled_norm)


def _l2_backward(xp: Any, ctx: L2NormalizeContext, d_y: Any, name: str | None = None) -> Any:
    """``(I - y y^T) d_y / ||x||``. With ``name``: a gradient beyond the dtype (rows of
    subnormal entries: it scales as ``1 / ||x||``) is the reference's ValueError (checked
    on NumPy, and on CuPy while data checks are on); callers without ``name`` check."""
    grad = _tangent(xp, ctx.y, d_y)
    with _quiet(xp):
        grad /= ctx.scaled_norm
        if not is_ones_column(ctx.scale):   # the fast path's unit scales: nothing to divide
            grad /= ctx.scale
    if name is not None and (xp is np or _validation.CHECK_FINITE_ON_GPU) and not bool(
        xp.all(xp.isfinite(grad))
    ):
        norm = ctx.scaled_norm if is_ones_column(ctx.scale) else ctx.scaled_norm * ctx.scale
        raise ValueError(_l2_overflow_message(to_numpy(grad), to_numpy(norm), name,
                                              np.dtype(grad.dtype).name))
    return grad


def l2_normalize_forward(x) -> tuple[Any, L2NormalizeContext]:
    """``y = x / ||x||`` along the last axis; ``(y, ctx)`` like the reference.

    ``ValueError`` naming the first zero row of ``x`` (one synchronisation on CuPy).
    """
    ns = array_namespace(x)
    x = as_fast_array(x, "x", min_ndim=1, ns=ns)
    return _l2_forward(ns, x)


def l2_normalize_backward(ctx: L2NormalizeContext, d_y) -> NormalizeGrads:
    """Gradient ``(I - y y^T) d_y / ||x||``; ``d_y`` of the shape of ``y``."""
    check_context(ctx, "ctx", L2NormalizeContext)
    ns = array_namespace(ctx.y)
    d_y = check_fast_upstream(d_y, "d_y", ctx.y.shape, ns, ctx.y.dtype)
    return NormalizeGrads(x=_l2_backward(ns.xp, ctx, d_y, "x"))


def l2_normalize(x) -> Any:
    """``x / ||x||`` along the last axis (no context kept)."""
    return l2_normalize_forward(x)[0]


def clip_normalize_forward(x) -> tuple[Any, ClipNormalizeContext]:
    """``y = x / max(1, ||x||)`` along the last axis; ``(y, ctx)`` like the reference."""
    ns = array_namespace(x)
    xp = ns.xp
    x = as_fast_array(x, "x", min_ndim=1, ns=ns)
    direction, scale, scaled_norm = _scaled_direction(xp, x)
    # ||u|| > 1 as ||u/s|| > 1/s; 1/s is exact, or inf for the tiniest rows (inside).
    with _quiet(xp):
        outside = scaled_norm > 1 / scale
    y = xp.where(outside, direction, x)
    return y, ClipNormalizeContext(y=y, scale=scale, scaled_norm=scaled_norm, outside=outside)


def clip_normalize_backward(ctx: ClipNormalizeContext, d_y) -> NormalizeGrads:
    """``(I - y y^T) d_y / ||x||`` outside the unit ball, ``d_y`` inside and on the sphere."""
    check_context(ctx, "ctx", ClipNormalizeContext)
    ns = array_namespace(ctx.y)
    xp = ns.xp
    d_y = check_fast_upstream(d_y, "d_y", ctx.y.shape, ns, ctx.y.dtype)
    one = xp.ones_like(ctx.scale)
    scale = xp.where(ctx.outside, ctx.scale, one)
    scaled_norm = xp.where(ctx.outside, ctx.scaled_norm, one)
    projected = _tangent(xp, ctx.y, d_y) / scaled_norm / scale
    return NormalizeGrads(x=xp.where(ctx.outside, projected, d_y))


def clip_normalize(x) -> Any:
    """``x / max(1, ||x||)`` along the last axis (no context kept)."""
    return clip_normalize_forward(x)[0]


def ones_column(xp: Any, n: int, dtype: Any) -> Any:
    """``ones((n, 1), dtype)``: the unit scales of the mirror's contexts; cached read-only
    per ``(n, dtype)`` on NumPy (a backward recognises them and skips dividing by 1)."""
    if xp is not np:
        return xp.ones((n, 1), dtype=dtype)
    key = (n, np.dtype(dtype))
    ones = _ONES_CACHE.get(key)
    if ones is None:
        ones = np.ones((n, 1), dtype=dtype)
        ones.flags.writeable = False
        if len(_ONES_CACHE) < 32:
            _ONES_CACHE[key] = ones
    return ones


def is_ones_column(a: Any) -> bool:
    """True for an array returned by :func:`ones_column` on NumPy (identity, no data read)."""
    return any(a is ones for ones in _ONES_CACHE.values())


_ONES_CACHE: dict[tuple[int, Any], Any] = {}

def _quiet(xp: Any):
    """``errstate(over="ignore")`` on NumPy; CuPy does not warn."""
    import contextlib

    import numpy as np

    return np.errstate(over="ignore", divide="ignore") if xp is np else contextlib.nullcontext()
