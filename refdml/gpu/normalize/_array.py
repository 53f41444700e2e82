"""The array path of the L2 normalisation: the reference's xp-generic maths
(:mod:`refdml._shared.normalize`) on the input's module and dtype, nine element-wise passes
and reductions forward, five backward."""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml._shared.normalize import l2_backward_xp, l2_direction_xp
from refdml.normalize import L2NormalizeContext

__all__ = ["ArrayPath"]


class ArrayPath:
    """The array path, the family's interface; the compiled members of
    :mod:`refdml.gpu.normalize._kernels` have the same methods. Neither checks the data
    (the mirror does, :mod:`refdml.gpu.normalize._mirrors`).

    ``l2_forward(backend, x) -> (y, scale, scaled_norm)``
        ``x`` ``(..., d)``, checked, of the backend's module: ``y = x / ||x||`` (0 on a zero
        row), the per-row power of two ``s`` and ``||x / s||``, both keepdims
        (``x.shape[:-1] + (1,)``), all in ``x``'s dtype.
    ``l2_backward(backend, ctx, d_y, unit_scale) -> grad``
        ``(d_y - y <y, d_y>) / ||x / s|| / s`` from an
        :class:`~refdml.normalize.L2NormalizeContext` and ``d_y`` of ``ctx.y``'s shape and
        dtype; ``unit_scale``: ``ctx.scale`` is all ones (the division by it may be left out).
    """

    def l2_forward(self, backend: Backend, x: Any) -> tuple[Any, Any, Any]:
        return l2_direction_xp(backend.xp, x)

    def l2_backward(self, backend: Backend, ctx: L2NormalizeContext, d_y: Any,
                    unit_scale: bool) -> Any:
        return l2_backward_xp(backend.xp, ctx, d_y, None, unit_scale=unit_scale)
