"""What the fast path shares with :mod:`refdml.normalize` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.normalize` has no second implementation of the normalisations: it calls
the reference's maths, written against an array namespace, on the input's module and dtype
(and the distances, losses and GSP mirrors reach it through refdml.gpu.normalize).

- ``ZERO_WHY``: the reference's reason in the zero-row error of an L2 normalisation, so
  that both paths word it alike.
- ``clip_forward_xp(xp, x)``: ``x / max(1, ||x||)`` by the power-of-two row scaling.
- ``clip_backward_xp(xp, y, d_y, outside, norm, scale=None)``: the one clip-to-ball
  backward (the normalisation's and GSP's cost map's, reference and fast path), from the
  clipped ``y``, the rows outside the ball and the norm (as one factor, or as
  ``norm * scale``).
- ``l2_forward_xp(x, name, *, why, ns)``: ``x / ||x||`` of a checked array, with the
  reference's zero-row check naming ``name``.
- ``l2_backward_xp(xp, ctx, d_y, name, *, unit_scale)``: its backward, with the
  reference's overflow check where ``name`` is given; ``unit_scale`` skips dividing by
  the fast path's unit scales.
- ``l2_direction_xp(xp, x)``: the forward's maths alone, ``(y, s, ||x / s||)`` (no check):
  the fast path's array member of its ``normalize`` kernel family.
- ``check_l2_gradient_xp(xp, grad, ctx, name, *, unit_scale)``: the backward's overflow
  check alone, which the fast path runs on its kernels' gradients too.

The ``_xp`` suffix keeps these apart from the public, validating ``refdml.normalize``
functions, which run on NumPy only.
"""

from __future__ import annotations

from refdml.normalize import (
    _ZERO_WHY as ZERO_WHY,
    _check_l2_gradient as check_l2_gradient_xp,
    _clip_backward as clip_backward_xp,
    _clip_forward as clip_forward_xp,
    _l2_backward as l2_backward_xp,
    _l2_forward as l2_forward_xp,
    _scaled_direction as l2_direction_xp,
)

__all__ = ["ZERO_WHY", "check_l2_gradient_xp", "clip_backward_xp", "clip_forward_xp",
           "l2_backward_xp", "l2_direction_xp", "l2_forward_xp"]
