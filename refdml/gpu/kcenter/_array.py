"""The array path of greedy k-center, written once against the backend (NumPy or CuPy).

Per pick (no loop over points, no host round trip): the row dots ``<x_i, x_q>`` (exact
products and one row sum each, no BLAS: a mat-vec rounds identical rows differently by
their position, and the arg-max among duplicates would then depend on the CPU), one
fused elementwise update of ``m``, one arg-max; the arg-max that chooses the next pick
also gives the radius of the current set (``m`` at the arg-max is its maximum), so the
radius costs a gather, not a second reduction. The pick index stays a 1-element device
array used to gather ``x_q`` and to mark ``m(q) = -1``: no synchronisation inside the
loop. The loop over the ``k`` picks is sequential by nature (each pick depends on the
previous one). The arithmetic is the reference's readable traversal, operation for
operation (:mod:`refdml._shared.kcenter`).
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml._shared.kcenter import row_dots, sq_norms

__all__ = ["ArrayPath"]


class ArrayPath:
    """The array path (module docstring), the family's interface; the compiled members of
    :mod:`refdml.gpu.kcenter._kernels` have the same method.

    ``farthest_first(backend, points, k, min_sq, first) -> (indices, radii)``
        ``k`` picks of the traversal. ``backend``: the backend of the arrays
        (:func:`refdml._backend.get_backend`); ``points`` ``(n, d)``, already scaled;
        ``min_sq`` ``(n,)`` the squared distances to the current centres in the points'
        dtype (``inf`` without centres, ``-1`` at a centre), updated in place; ``first`` a
        ``(1,)`` int64 index array of the points' module, or None to start from the
        arg-max of ``min_sq``. Returns ``indices`` ``(k,)`` int64 and ``radii`` ``(k,)``
        (the covering radius after each pick) in the points' dtype, arrays of their module.
    """

    def farthest_first(self, backend: Backend, points: Any, k: int, min_sq: Any, first: Any):
        xp = backend.xp
        norms = sq_norms(points, 8192, xp=xp)
        indices = xp.empty(k, dtype=xp.int64)
        radii_sq = xp.empty(k, dtype=points.dtype)
        q = first if first is not None else xp.argmax(min_sq, keepdims=True)
        zero = points.dtype.type(0)
        for pick in range(k):
            indices[pick:pick + 1] = q
            center = points[q[0]]                     # gather on the device (q is an array)
            to_center = norms - 2.0 * row_dots(points, center, xp=xp)
            to_center += norms[q[0]]
            xp.minimum(min_sq, xp.maximum(to_center, zero), out=min_sq)
            min_sq[q] = -1.0
            q = xp.argmax(min_sq, keepdims=True)      # the next pick ...
            radii_sq[pick:pick + 1] = min_sq[q]       # ... and the current radius (its value)
        return indices, xp.sqrt(xp.maximum(radii_sq, zero))
