"""Fast-path mirror of :mod:`refdml.distances` (NumPy or CuPy, float32 or float64).

Same names, shapes, broadcasting and contexts as the reference. The shape checks, the
three backwards, the cosine forward and the overflow check of ``sq_euclidean`` are the
reference's xp-generic kernels, called on the input's module and dtype. What is this
module's own is the forward of ``euclidean`` and ``sq_euclidean``, a different algorithm
from the reference's (below), and its helpers shared by the other mirrors
(:func:`common_scale`, :func:`scaled_sq`). The squared distances come from the Gram
identity ``|x|^2 + |y|^2 - 2 x y^T`` (one matrix product: the fast part) after both sets
are divided by one power of two ``s`` held as a 0-d array of the input's module (exact, no
synchronisation), so the squares stay in range in float32 too. The absolute error of
``D_ij^2`` is then at most ``(2 d + 4) u (|x_i|^2 + |y_j|^2)`` (``d`` the dimension, ``u``
the dtype's machine epsilon; the rounding bound of the identity): relative to the largest
distance it is at the dtype's precision, but a pair closer than ~ ``sqrt(u) |x|`` is not
resolved (coincident rows get ~``sqrt(u) |x|``, and the gradient ``(x_i - y_j) / D_ij``
there is O(1) wrong).

**Where NumPy and CuPy differ.** The near pairs (``D_ij^2`` below ``1e-3 (|x_i|^2 +
|y_j|^2)``) are recomputed from explicit differences, as the reference does, where the
backend refines (:meth:`refdml._backend.Backend.refine`): on NumPy, where coincident rows
give exactly 0 and nearby ones their digits (relative error ~ ``u``, as the reference).
On CuPy they are not: which pairs are near is data-dependent, and reading it back costs
synchronisations (counted on the CuPy stand-in: two per Euclidean loss forward, one per
``euclidean`` / ``sq_euclidean`` call, and ~20 launches; the losses' one synchronisation
per forward would become three). There a near pair keeps the identity's value:

* ``|D~_ij^2 - D_ij^2| <= (2 d + 4) u (|x_i|^2 + |y_j|^2)`` for ``sq_euclidean``, and so
  ``|D~_ij - D_ij| <= sqrt((2 d + 4) u (|x_i|^2 + |y_j|^2))`` for ``euclidean``: for
  coincident float32 rows of norm ``r`` at ``d = 128``, ``D~`` is up to ``8e-3 r``
  instead of 0 (typically ~``1e-3 r``); in float64 up to ``3.4e-7 r``;
* the gradient with respect to such a pair is O(1) wrong in magnitude (``|x_i - y_j| /
  D~_ij`` in place of 1);
* only the diagonal of a set with itself (``self_pairs=True`` in the private kernels,
  used by the losses) is exactly 0.

Everything else is the same computation on both. ``tests/gpu/test_gpu_normalize_distances.py``
holds the NumPy route to the reference at near pairs and the unrefined route to the bound.

``sq_euclidean`` raises ``ValueError`` where a squared distance exceeds the dtype's range
(one synchronisation on CuPy, see :mod:`refdml._validation`); ``cosine`` refuses zero
rows like :func:`refdml.gpu.normalize.l2_normalize`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import (
    as_fast_array, check_context, check_fast_upstream, data_checks, result_dtype,
)
from refdml._backend import Backend, get_backend
from refdml._shared.distances import (
    check_pair_shapes,
    check_sq_range,
    cosine_backward_xp,
    cosine_forward_xp,
    euclidean_backward_xp,
    sq_euclidean_backward_xp,
)
from refdml.distances import CosineContext, DistanceGrads, EuclideanContext, SqEuclideanContext
from refdml.gpu.linalg import matmul

__all__ = [
    "CosineContext",
    "DistanceGrads",
    "EuclideanContext",
    "SqEuclideanContext",
    "cosine",
    "cosine_backward",
    "cosine_forward",
    "euclidean",
    "euclidean_backward",
    "euclidean_forward",
    "sq_euclidean",
    "sq_euclidean_backward",
    "sq_euclidean_forward",
]


def _check_pair(x, y) -> tuple[Backend, Any, Any]:
    ns = get_backend(x, y)
    dtype = result_dtype(x, y) if hasattr(x, "dtype") and hasattr(y, "dtype") else None
    x = as_fast_array(x, "x", min_ndim=2, dtype=dtype, ns=ns)
    y = as_fast_array(y, "y", min_ndim=2, dtype=x.dtype, ns=ns)
    check_pair_shapes(x, y)
    return ns, x, y


def _scales(dtype: Any) -> np.ndarray:
    """``2**min(e, top)`` in ``dtype`` (1 for e = 0) in row ``e`` for every exponent ``e``
    that ``frexp`` gives an entry of ``dtype`` (``|a| = f 2**e``, f in [0.5, 1); 0 for 0, inf
    and NaN): rows 0 up to the largest, then the negative ones, so that row ``e`` holds
    ``e`` (a negative ``e`` counted from the end, as integer-array indexing reads it)."""
    info = np.finfo(dtype)
    exponents = np.concatenate([np.arange(0, info.maxexp + 1),
                                np.arange(info.minexp - info.nmant + 1, 0)])
    return np.ldexp(np.ones((), dtype=dtype), np.minimum(exponents, info.maxexp - 1))


def common_scale(xp: Any, *arrays: Any) -> Any:
    """0-d power of two ``s`` (dtype of the arrays) with ``max|a| / s`` in [0.5, 1), 1 for
    zeros; capped at the top binade like :func:`refdml._numerics.common_scale`.

    The power is gathered from a kept table by ``frexp``'s exponent of the peak
    (:func:`_scales`; uploaded once per dtype): one launch instead of the exponent
    arithmetic on 0-d arrays (their backend keeps the table)."""
    peak = xp.max(xp.abs(arrays[0]))
    for a in arrays[1:]:
        peak = xp.maximum(peak, xp.max(xp.abs(a)))
    dtype = np.dtype(arrays[0].dtype)
    table = get_backend(*arrays).kept(("refdml.gpu.distances.scales", dtype.str),
                                      lambda: _scales(dtype))
    return table[xp.frexp(peak)[1]]


# Squared distances below this fraction of |x_i|^2 + |y_j|^2 are recomputed from explicit
# differences where the backend refines (the reference's threshold, refdml._numerics._REFINE).
_REFINE = 1e-3
# Most explicit differences (entries) gathered at once while refining.
_REFINE_CHUNK = 1 << 22


def scaled_sq(ns: Backend, x: Any, y: Any, self_pairs: bool) -> Any:
    """Gram-identity squared distances of inputs of magnitude at most 1, clipped at 0; the
    nearby pairs refined where the backend refines (:func:`_refine_nearby`, module
    docstring); with ``self_pairs`` (``y`` is ``x``) an exact 0 diagonal."""
    xp = ns.xp
    x_sq = xp.sum(x * x, axis=-1)
    # ``x is y`` (a set with itself): one norm pass, and ``x @ x.T`` lets BLAS use syrk.
    y_sq = x_sq if y is x else xp.sum(y * y, axis=-1)
    sq = matmul(ns, x, xp.swapaxes(y, -1, -2))
    sq *= sq.dtype.type(-2)
    sq += x_sq[..., :, None]
    sq += y_sq[..., None, :]
    ns.refine(_refine_nearby, xp, x, y, sq, x_sq, y_sq)
    sq = xp.maximum(sq, sq.dtype.type(0), out=sq)
    if self_pairs and sq.ndim == 2 and sq.flags.c_contiguous:
        n = sq.shape[-1]
        sq.reshape(-1)[::n + 1] = 0            # the diagonal as a strided view: no index
    elif self_pairs:
        diagonal = xp.arange(sq.shape[-1])
        sq[..., diagonal, diagonal] = 0
    return sq


def _refine_nearby(xp: Any, x: Any, y: Any, sq: Any, x_sq: Any, y_sq: Any) -> None:
    """Recompute in place, from explicit differences, the Gram-identity squared distances
    ``sq`` below ``_REFINE (|x_i|^2 + |y_j|^2)``.

    Why: the identity's absolute error is ~ ``u (|x_i|^2 + |y_j|^2)``, so a pair closer
    than ~ ``sqrt(u) |x|`` has no correct digit (coincident rows get ~``sqrt(u) |x|``, not
    0), and a distance's gradient ``(x_i - y_j) / D_ij`` is then wrong by O(1). The
    reference refines the same pairs (:func:`refdml._numerics.pairwise_norm`). Which pairs
    those are is read on the host (two ``nonzero``): free on NumPy, a synchronisation each
    on CuPy, which is why it runs through :meth:`refdml._backend.Backend.refine`.
    """
    if not sq.size:
        return
    lead = sq.shape[:-2]
    x_sq = xp.broadcast_to(x_sq, sq.shape[:-1])
    y_sq = xp.broadcast_to(y_sq, lead + sq.shape[-1:])
    # Rows that may hold such a pair (a superset: |y_j|^2 <= max |y|^2), by one reduction
    # pass and no (n, m) temporary; the exact test then on those rows only.
    rows = xp.nonzero(sq.min(axis=-1) <= _REFINE * (x_sq + y_sq.max(axis=-1)[..., None]))
    if not rows[0].shape[0]:
        return
    candidates = sq[rows] <= _REFINE * (x_sq[rows][:, None] + y_sq[rows[:-1]])
    k, column = xp.nonzero(candidates)
    index = tuple(r[k] for r in rows) + (column,)
    count = column.shape[0]
    if not count:
        return
    xb = xp.broadcast_to(x, lead + x.shape[-2:])
    yb = xp.broadcast_to(y, lead + y.shape[-2:])
    values = xp.empty(count, dtype=sq.dtype)
    step = max(1, _REFINE_CHUNK // max(1, x.shape[-1]))
    for start in range(0, count, step):
        part = tuple(i[start:start + step] for i in index)
        diff = xb[part[:-2] + (part[-2],)] - yb[part[:-2] + (part[-1],)]
        values[start:start + step] = xp.einsum("kd,kd->k", diff, diff)
    sq[index] = values


def _pairwise_norm(ns: Backend, x: Any, y: Any, self_pairs: bool = False) -> Any:
    xp = ns.xp
    scale = common_scale(xp, x) if y is x else common_scale(xp, x, y)
    x_scaled = x / scale
    y_scaled = x_scaled if y is x else y / scale
    with ns.errstate(over="ignore", divide="ignore"):
        distance = xp.sqrt(scaled_sq(ns, x_scaled, y_scaled, self_pairs))
        distance *= scale
        return distance


def _pairwise_sq(ns: Backend, x: Any, y: Any) -> Any:
    xp = ns.xp
    scale = common_scale(xp, x, y)
    with ns.errstate(over="ignore", divide="ignore"):
        # (sq * s) * s: inf only where the true value exceeds the range (sq <= ~4).
        return scaled_sq(ns, x / scale, y / scale, False) * scale * scale


def _euclidean_forward(
    ns: Backend, x: Any, y: Any, self_pairs: bool = False
) -> tuple[Any, EuclideanContext]:
    distance = _pairwise_norm(ns, x, y, self_pairs)
    return distance, EuclideanContext(x=x, y=y, distance=distance)


def euclidean_forward(x, y) -> tuple[Any, EuclideanContext]:
    """Pairwise Euclidean distances ``D (..., n, m)``; ``(D, ctx)`` like the reference."""
    ns, x, y = _check_pair(x, y)
    return _euclidean_forward(ns, x, y)


def euclidean_backward(ctx: EuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_distance, D>``; subgradient 0 at coincident points."""
    check_context(ctx, "ctx", EuclideanContext)
    ns = get_backend(ctx.distance)
    g = check_fast_upstream(d_distance, "d_distance", ctx.distance.shape, ns, ctx.distance.dtype)
    return euclidean_backward_xp(ctx, g, xp=ns.xp)


def euclidean(x, y) -> Any:
    """Pairwise Euclidean distances (no context kept)."""
    return euclidean_forward(x, y)[0]


def _sq_euclidean_forward(ns: Backend, x: Any, y: Any) -> tuple[Any, SqEuclideanContext]:
    xp = ns.xp
    distance = _pairwise_sq(ns, x, y)
    if data_checks(ns):
        check_sq_range(distance, x, y, xp=xp)
    return distance, SqEuclideanContext(x=x, y=y, shape=tuple(distance.shape))


def sq_euclidean_forward(x, y) -> tuple[Any, SqEuclideanContext]:
    """Pairwise squared Euclidean distances; ``(D, ctx)`` like the reference."""
    ns, x, y = _check_pair(x, y)
    return _sq_euclidean_forward(ns, x, y)


def sq_euclidean_backward(ctx: SqEuclideanContext, d_distance) -> DistanceGrads:
    """Gradients ``(x, y)``: ``2 sum_j g_ij (x_i - y_j)`` and the symmetric sum."""
    check_context(ctx, "ctx", SqEuclideanContext)
    ns = get_backend(ctx.x)
    g = check_fast_upstream(d_distance, "d_distance", ctx.shape, ns, ctx.x.dtype)
    return sq_euclidean_backward_xp(ctx, g, xp=ns.xp)


def sq_euclidean(x, y) -> Any:
    """Pairwise squared Euclidean distances (no context kept)."""
    return sq_euclidean_forward(x, y)[0]


def cosine_forward(x, y) -> tuple[Any, CosineContext]:
    """Pairwise cosine similarities ``S (..., n, m)``; ``(S, ctx)`` like the reference."""
    ns, x, y = _check_pair(x, y)
    return cosine_forward_xp(x, y, ns=ns)


def cosine_backward(ctx: CosineContext, d_similarity) -> DistanceGrads:
    """Gradients ``(x, y)`` of ``<d_similarity, S>`` through the L2 normalisations."""
    check_context(ctx, "ctx", CosineContext)
    ns = get_backend(ctx.x_unit)
    g = check_fast_upstream(d_similarity, "d_similarity", ctx.shape, ns, ctx.x_unit.dtype)
    return cosine_backward_xp(ctx, g, xp=ns.xp, check=data_checks(ns))


def cosine(x, y) -> Any:
    """Pairwise cosine similarities (no context kept)."""
    return cosine_forward(x, y)[0]
