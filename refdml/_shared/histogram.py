"""What the fast path shares with :mod:`refdml.histogram` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.histogram` runs the convex combination (XML Eq. 2.3) and the softmax
backward of the entropic histogram (Eq. 2.4) with the reference's own maths, written
against an array namespace; only the entropic forward is its own.

- ``convex_forward_xp(xp, z, prototypes, *, check)``: ``y_hat = z @ prototypes`` of
  checked 2-d arrays, with the reference's shape and overflow errors.
- ``convex_backward_xp(xp, ctx, d_y, *, check)``: its backward, same errors.
- ``entropic_d_scores_xp(xp, ctx, d_z)``: the gradient of the scores ``nu_i^T x_j`` from
  that of the histogram, through the softmax over the prototypes.

The ``_xp`` suffix keeps these apart from the public, validating ``refdml.histogram``
functions, which run on NumPy only.
"""

from __future__ import annotations

from refdml.histogram import (
    _convex_backward as convex_backward_xp,
    _convex_forward as convex_forward_xp,
    _entropic_d_scores as entropic_d_scores_xp,
)

__all__ = ["convex_backward_xp", "convex_forward_xp", "entropic_d_scores_xp"]
