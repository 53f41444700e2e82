"""What the fast path shares with :mod:`refdml.distances` (internal; see :mod:`refdml._shared`).

The pairwise distances of refdml.gpu (:mod:`refdml.gpu.distances`) check their inputs and
run the backward with the reference's own code, written against an array namespace; the
optimal-transport mirror sums its broadcast gradients back with :func:`sum_to_shape`.

- ``check_pair_shapes(x, y)``: the reference's shape check of a pair (one last axis,
  broadcastable leading axes), so that both paths refuse the same pairs with one message.
- ``check_sq_range(distance, x, y, *, xp)``: the reference's overflow check of squared
  distances, with its message.
- ``sum_to_shape(grad, shape)``: sums a broadcast gradient back to its input's shape
  (refdml.gpu.distances through the backwards below, refdml.gpu.ot directly).
- ``cosine_forward_xp(x, y, *, ns)``: the reference's cosine forward on namespace ``ns``
  (its scaled normalisation and context), the maths written once.
- ``cosine_backward_xp(ctx, g, *, xp, check)``: its backward; ``check=False`` skips the
  search for a gradient beyond the dtype (CuPy with the data checks off).
- ``euclidean_backward_xp(ctx, g, *, xp)``, ``sq_euclidean_backward_xp(ctx, g, *, xp)``:
  the Euclidean and squared Euclidean backwards on namespace ``xp``.

The ``_xp`` suffix keeps these apart from the public, validating ``refdml.distances``
functions of the same stem, which run on NumPy only.
"""

from __future__ import annotations

from refdml.distances import (
    _check_pair_shapes as check_pair_shapes,
    _check_sq_range as check_sq_range,
    _cosine_backward as cosine_backward_xp,
    _cosine_forward as cosine_forward_xp,
    _euclidean_backward as euclidean_backward_xp,
    _sq_euclidean_backward as sq_euclidean_backward_xp,
    _sum_to_shape as sum_to_shape,
)

__all__ = [
    "check_pair_shapes",
    "check_sq_range",
    "cosine_backward_xp",
    "cosine_forward_xp",
    "euclidean_backward_xp",
    "sq_euclidean_backward_xp",
    "sum_to_shape",
]
