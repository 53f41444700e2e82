"""Fast-path mirror of :mod:`refdml.normalize` (NumPy or CuPy, float32 or float64).

No second implementation: the maths is the reference's xp-generic kernels, shared through
:mod:`refdml._shared.normalize` (``l2_forward_xp``, ``clip_forward_xp``, their backwards),
called here on the input's array module and dtype. Each row ``u`` is divided by a power of two
``s`` with ``max|u| / s`` in ``[1, 2)`` (exact in either dtype), so ``||u / s||`` neither
overflows nor underflows, in float32 too (whose range ends at ~3.4e38). Everything is
elementwise or a reduction along the last axis: no loop, no host copy; the zero-row check
of ``l2_normalize`` is the only synchronisation (see :mod:`refdml._validation`).
What is the fast path's own: the checks keep the dtype and the device, the data checks
can be turned off on CuPy, and the losses' unit scales (:func:`ones_column`) are not
divided by.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import as_fast_array, check_context, check_fast_upstream, data_checks
from refdml._backend import Backend, get_backend
from refdml._shared.normalize import (
    ZERO_WHY,
    clip_backward_xp,
    clip_forward_xp,
    l2_backward_xp,
    l2_forward_xp,
)
from refdml.normalize import ClipNormalizeContext, L2NormalizeContext, NormalizeGrads

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


def _l2_forward(
    ns: Backend, x: Any, name: str = "x", why: str = ZERO_WHY
) -> tuple[Any, L2NormalizeContext]:
    """Kernel of ``l2_normalize_forward`` on a checked array (used by distances, losses)."""
    return l2_forward_xp(x, name, why=why, ns=ns)


def _l2_backward(xp: Any, ctx: L2NormalizeContext, d_y: Any, name: str | None = None) -> Any:
    """``(I - y y^T) d_y / ||x||``. With ``name``: a gradient beyond the dtype is the
    reference's ValueError (checked on NumPy, and on CuPy while data checks are on);
    callers without ``name`` check."""
    if name is not None and xp is not np and not data_checks(get_backend(ctx.y)):
        name = None
    return l2_backward_xp(xp, ctx, d_y, name, unit_scale=is_ones_column(ctx.scale))


def l2_normalize_forward(x) -> tuple[Any, L2NormalizeContext]:
    """``y = x / ||x||`` along the last axis; ``(y, ctx)`` like the reference.

    ``ValueError`` naming the first zero row of ``x`` (one synchronisation on CuPy).
    """
    ns = get_backend(x)
    x = as_fast_array(x, "x", min_ndim=1, ns=ns)
    return _l2_forward(ns, x)


def l2_normalize_backward(ctx: L2NormalizeContext, d_y) -> NormalizeGrads:
    """Gradient ``(I - y y^T) d_y / ||x||``; ``d_y`` of the shape of ``y``."""
    check_context(ctx, "ctx", L2NormalizeContext)
    ns = get_backend(ctx.y)
    d_y = check_fast_upstream(d_y, "d_y", ctx.y.shape, ns, ctx.y.dtype)
    return NormalizeGrads(x=_l2_backward(ns.xp, ctx, d_y, "x"))


def l2_normalize(x) -> Any:
    """``x / ||x||`` along the last axis (no context kept)."""
    return l2_normalize_forward(x)[0]


def clip_normalize_forward(x) -> tuple[Any, ClipNormalizeContext]:
    """``y = x / max(1, ||x||)`` along the last axis; ``(y, ctx)`` like the reference."""
    ns = get_backend(x)
    x = as_fast_array(x, "x", min_ndim=1, ns=ns)
    return clip_forward_xp(ns.xp, x)


def clip_normalize_backward(ctx: ClipNormalizeContext, d_y) -> NormalizeGrads:
    """``(I - y y^T) d_y / ||x||`` outside the unit ball, ``d_y`` inside and on the sphere."""
    check_context(ctx, "ctx", ClipNormalizeContext)
    ns = get_backend(ctx.y)
    d_y = check_fast_upstream(d_y, "d_y", ctx.y.shape, ns, ctx.y.dtype)
    return NormalizeGrads(x=clip_backward_xp(ns.xp, ctx, d_y))


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
