"""What the fast path shares with :mod:`refdml.kcenter` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.kcenter`'s array path is the reference's readable traversal run on the
input's array module and dtype: the distances are the reference's Gram-identity arithmetic,
operation for operation (exact products and one fixed-order row sum each, no BLAS), so
that on NumPy float64 the picks and radii are the reference's bit for bit and identical
points tie exactly on every path. Its compiled CPU twin and CUDA kernels are the fast
path's own (:mod:`refdml.gpu.kcenter._compiled` / :mod:`refdml.gpu.kcenter._cuda`).

- ``row_dots(rows, vector, *, xp)``: ``<x_i, v>`` for every row, exact products and one
  row sum each (the dot product behind every distance that decides a pick).
- ``sq_norms(points, chunk_size, *, xp)``: ``|x_i|^2`` by ``row_dots`` in blocks of rows,
  so that a point equal to a centre is at distance 0 exactly.
- ``sq_to_set(points, centers, chunk_size, *, xp)``: ``min_c |x_i - c|^2`` over a set of
  initial centres, the traversal's starting distances.
"""

from __future__ import annotations

from refdml.kcenter import (
    _row_dots as row_dots,
    _sq_norms as sq_norms,
    _sq_to_set as sq_to_set,
)

__all__ = ["row_dots", "sq_norms", "sq_to_set"]
