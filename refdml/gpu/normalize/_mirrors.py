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
divided by. The same results on NumPy and on CuPy: nothing here asks which it runs on
(the unit scales are recognised by the backend, :meth:`refdml._backend.Backend.is_cached`,
which on CuPy recognises none, and the division by 1 is then exact).

The public L2 normalisation (:func:`l2_normalize_forward`, ``_backward``: the training
layer's) runs the kernel family's chosen member (:mod:`refdml.gpu.normalize`): one launch
each way on CuPy under ``"auto"``. The distances' and losses' normalisations
(:func:`_l2_forward`, :func:`_l2_backward`) stay on the array code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import (
    as_fast_array, check_context, check_fast_upstream, check_nonzero_rows, data_checks,
)
from refdml._backend import Backend, get_backend
from refdml._shared.normalize import (
    ZERO_WHY,
    check_l2_gradient_xp,
    clip_backward_xp,
    clip_forward_xp,
    l2_backward_xp,
    l2_forward_xp,
)
from refdml.gpu.normalize._kernels import IMPLEMENTATIONS
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


def _l2_backward(ns: Backend, ctx: L2NormalizeContext, d_y: Any, name: str | None = None) -> Any:
    """``(I - y y^T) d_y / ||x||``. With ``name``: a gradient beyond the dtype is the
    reference's ValueError (checked while data checks run: always on NumPy, on CuPy while
    enabled); callers without ``name`` check."""
    if name is not None and not data_checks(ns):
        name = None
    return l2_backward_xp(ns.xp, ctx, d_y, name, unit_scale=is_ones_column(ns, ctx.scale))


def l2_normalize_forward(x) -> tuple[Any, L2NormalizeContext]:
    """``y = x / ||x||`` along the last axis; ``(y, ctx)`` like the reference.

    ``ValueError`` naming the first zero row of ``x`` (one synchronisation on CuPy).
    """
    ns = get_backend(x)
    x = as_fast_array(x, "x", min_ndim=1, ns=ns)
    check_nonzero_rows(ns.xp, x, "x", why=ZERO_WHY, ns=ns)
    y, scale, scaled_norm = IMPLEMENTATIONS.choose(x).l2_forward(ns, x)
    return y, L2NormalizeContext(y=y, scale=scale, scaled_norm=scaled_norm)


def l2_normalize_backward(ctx: L2NormalizeContext, d_y) -> NormalizeGrads:
    """Gradient ``(I - y y^T) d_y / ||x||``; ``d_y`` of the shape of ``y``."""
    check_context(ctx, "ctx", L2NormalizeContext)
    ns = get_backend(ctx.y)
    d_y = check_fast_upstream(d_y, "d_y", ctx.y.shape, ns, ctx.y.dtype)
    unit_scale = is_ones_column(ns, ctx.scale)
    grad = IMPLEMENTATIONS.choose(ctx.y).l2_backward(ns, ctx, d_y, unit_scale)
    if data_checks(ns):
        check_l2_gradient_xp(ns.xp, grad, ctx, "x", unit_scale=unit_scale)
    return NormalizeGrads(x=grad)


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
    return NormalizeGrads(x=clip_backward_xp(ns.xp, ctx.y, d_y, ctx.outside, ctx.scaled_norm,
                                             ctx.scale))


def clip_normalize(x) -> Any:
    """``x / max(1, ||x||)`` along the last axis (no context kept)."""
    return clip_normalize_forward(x)[0]


def _ones_key(shape: tuple, dtype: Any) -> tuple:
    return ("refdml.gpu.normalize.ones_column", tuple(shape), np.dtype(dtype))


def ones_column(ns: Backend, n: int, dtype: Any) -> Any:
    """``ones((n, 1), dtype)``: the unit scales of the mirror's contexts, built on the host
    and kept per ``(n, dtype)`` (:meth:`Backend.kept`: read-only on NumPy, uploaded once on
    CuPy), so that a backward recognises them (:func:`is_ones_column`) and skips dividing
    by 1, and a forward on CuPy launches nothing for them."""
    dtype = np.dtype(dtype)
    return ns.kept(_ones_key((n, 1), dtype), lambda: np.ones((n, 1), dtype=dtype))


def is_ones_column(ns: Backend, a: Any) -> bool:
    """True for an array :func:`ones_column` returned (an identity test with the kept
    constant, no data read; dividing by those ones is exact, so a miss costs a launch)."""
    return a.ndim == 2 and a.shape[1] == 1 and a is ones_column(ns, a.shape[0], a.dtype)
