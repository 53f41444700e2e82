"""Greedy k-center (farthest-first traversal, Gonzalez 1985) and ASAP proxy selection.

``greedy_k_center``
    Picks, ``k`` times, the point farthest from the current centres; the covering radius
    ``max_i min_{s in S} ||x_i - s||`` is within twice the optimal k-center radius. With
    ``initial`` centres, distances start from that set and only the new picks are returned
    (ASAP Algorithm 2's ``argmax_{u} min_{v in rho_c u r_c} ||u - v||``; XML Sec. 3.2 uses
    the same traversal to pick prototypes among local features).
    Memory: one distance vector of length n plus one block of ``chunk_size`` rows, never
    an n x n matrix. Squared distances to a new centre come from
    ``|x|^2 - 2 <x, c> + |c|^2`` (one pass over the points per pick); their absolute error
    is about machine eps times ``|x|^2``, which only blurs distances far below the covering
    radius.
    Ties: the arg-max takes the lowest index among equal distances, and identical points
    get identical distances on every CPU, so duplicates are picked in index order
    everywhere. No BLAS computes a distance that decides a pick (a BLAS mat-vec or GEMM
    rounds two identical rows differently by their position in the matrix, and how
    depends on the CPU's kernel). Two distinct points whose distances agree to rounding
    can still be picked in either order on different CPUs or by the two implementations
    below.
    Scale: points (and initial centres) are divided by one power of two (exact) so that
    ``|x|^2`` neither overflows nor underflows, and the radii are scaled back: any finite
    input gives the radii and the picks of the unscaled arithmetic.
``select_proxies``
    ASAP Algorithm 2 (Greedy K-Center Proxy): for each class ``c`` sample a pool of
    ``budget`` instances, then pick ``|rho_c|`` of them farthest-first from the current
    proxies ``rho_c``. The algorithm as printed seeds the distances with ``rho_c`` and
    grows ``r_c`` until ``|r_c| = |rho_c|``, so ``budget >= |rho_c|`` is required.

The traversal (``_farthest_first``) is the readable statement of the algorithm: per pick,
exact products and row sums in NumPy's fixed order, an update and an arg-max, the same bits
on every CPU. Its compiled twins (a Numba CPU twin and a CUDA kernel, one fused pass over
the points per pick, no BLAS) are the fast path's, :func:`refdml.gpu.kcenter.greedy_k_center`,
held to this module by tests/gpu/test_gpu_kernels_kcenter.py (fixed seeds and hypothesis
inputs: the same picks up to a near-tie within rounding, radii within the Gram identity's
rounding bound; tests/_kcenter_checks.py states it). Both use the same Gram-identity
arithmetic; only the order in which the dot products are summed differs (rounding, ~1e-16
of ``|x|^2``), so a pick could differ only between two distinct points whose distances
agree to that rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale
from refdml._validation import (
    as_float_array,
    as_label_array,
    check_rng,
    check_same_length,
    check_scalar,
)

__all__ = ["KCenterResult", "ProxySelection", "greedy_k_center", "select_proxies"]


@dataclass(frozen=True)
class KCenterResult:
    """Farthest-first traversal.

    indices : (k,) selected rows of ``points``, in pick order (initial centres excluded).
    radii : (k,) covering radius after each pick (w.r.t. initial centres plus picks).
    initial_radius : covering radius of the initial centres alone (inf without them).
    """

    indices: np.ndarray
    radii: np.ndarray
    initial_radius: float


@dataclass(frozen=True)
class ProxySelection:
    """New proxies, aligned with the current ones (same rows, same labels).

    indices : (n_proxies,) rows of ``embeddings`` chosen for each proxy slot.
    proxies : (n_proxies, d) ``embeddings[indices]``.
    """

    indices: np.ndarray
    proxies: np.ndarray


def _row_dots(rows, vector, *, xp=np):
    """``<x_i, v>`` for every row ``x_i`` of ``rows``: exact products, then one row sum each.

    No BLAS: OpenBLAS's mat-vec and GEMM round two identical rows differently by their
    position in the matrix (every kernel from Prescott to SkylakeX: rows are blocked and a
    remainder is finished another way), so duplicate points would get distances a few ulps
    apart and the arg-max among them would depend on the CPU. Here each product is one
    correctly rounded multiplication and each row is summed by NumPy's add-reduction in the
    same fixed (pairwise) order, with no FMA: identical rows give identical values, and
    every CPU gives the same values (that reduction is plain C on every NumPy SIMD target).
    ``xp``: the array module; the fast path's array route calls these helpers with CuPy
    (whose reduction sums in its own fixed order) and in float32, the dtype kept throughout.
    """
    return xp.sum(xp.multiply(rows, vector), axis=1)


def _sq_norms(points, chunk_size, *, xp=np):
    """``|x_i|^2`` by :func:`_row_dots` in blocks of rows: for ``x_i`` equal to a centre
    ``c`` the Gram identity then gives ``|x_i|^2 - 2 <x_i, c> + |c|^2 = 0`` exactly."""
    out = xp.empty(points.shape[0], dtype=points.dtype)
    for start in range(0, points.shape[0], chunk_size):
        block = points[start:start + chunk_size]
        out[start:start + chunk_size] = _row_dots(block, block, xp=xp)
    return out


def _sq_to_center(points, sq_norms, center, c_sq, chunk_size, *, xp=np):
    out = xp.empty(points.shape[0], dtype=points.dtype)
    for start in range(0, points.shape[0], chunk_size):
        stop = start + chunk_size
        block = _row_dots(points[start:stop], center, xp=xp)
        out[start:stop] = sq_norms[start:stop] - 2.0 * block + c_sq
    xp.maximum(out, 0.0, out=out)
    return out


def _sq_to_set(points, centers, chunk_size, *, xp=np):
    """min_c ||x - c||^2 over a set of centres: one :func:`_sq_to_center` per centre."""
    sq_norms = _sq_norms(points, chunk_size, xp=xp)
    c_sq = _sq_norms(centers, chunk_size, xp=xp)
    out = xp.full(points.shape[0], np.inf, dtype=points.dtype)
    for c in range(centers.shape[0]):
        xp.minimum(out, _sq_to_center(points, sq_norms, centers[c], c_sq[c], chunk_size, xp=xp),
                   out=out)
    return out


def _farthest_first(points, k, min_sq, first, chunk_size):
    """k picks; ``min_sq`` (n,) squared distance to the current set (modified in place)."""
    sq_norms = _sq_norms(points, chunk_size)
    indices = np.empty(k, dtype=np.int64)
    radii = np.empty(k)
    for pick in range(k):
        q = first if pick == 0 and first is not None else int(np.argmax(min_sq))
        indices[pick] = q
        np.minimum(min_sq, _sq_to_center(points, sq_norms, points[q], sq_norms[q], chunk_size),
                   out=min_sq)
        # -1 marks a centre: never picked twice, even among duplicate points.
        min_sq[q] = -1.0
        radii[pick] = np.sqrt(max(float(min_sq.max()), 0.0))
    return indices, radii


def greedy_k_center(points, k, *, initial=None, rng=None, chunk_size=8192) -> KCenterResult:
    """Greedy k-center by farthest-first traversal.

    The readable NumPy traversal (module docstring); :func:`refdml.gpu.kcenter.greedy_k_center`
    runs its compiled twins.

    Parameters
    ----------
    points : (n, d) array.
    k : number of new centres, ``1 <= k <= n - len(initial)``.
    initial : None, a 1-d integer array of row indices of ``points``, or an (m, d) float
        array of centre coordinates. Without it the first centre is drawn uniformly at
        random with ``rng``.
    rng : None, int or Generator (used only without ``initial``).
    chunk_size : rows per block in the distance computations (bounds the memory).

    Returns
    -------
    KCenterResult
    """
    return _greedy_k_center(points, k, initial, rng, chunk_size)


def _greedy_k_center(points, k, initial, rng, chunk_size) -> KCenterResult:
    points = as_float_array(points, "points", ndim=2, copy=False)  # read only
    n = points.shape[0]
    k = check_scalar(k, "k", low=1, integer=True)
    chunk_size = check_scalar(chunk_size, "chunk_size", low=1, integer=True)
    rng = check_rng(rng)
    initial_array = None if initial is None else np.asarray(initial)
    by_index = initial_array is not None and initial_array.ndim == 1 and (
        np.issubdtype(initial_array.dtype, np.integer) or initial_array.size == 0
    )
    centers = None
    if initial_array is not None and not by_index:
        centers = as_float_array(initial, "initial", ndim=2)
        if centers.shape[1] != points.shape[1]:
            raise ValueError(
                f"initial centres have dimension {centers.shape[1]}, points {points.shape[1]}"
            )
    # Exact rescaling (a power of two): |x|^2 stays in range at any finite scale.
    scale = common_scale(points) if centers is None else common_scale(points, centers)
    if scale != 1.0:
        points = points / scale
        centers = None if centers is None else centers / scale
    # Row-major rows: every row (and centre) is summed by the same reduction loop.
    points = np.ascontiguousarray(points)
    centers = None if centers is None else np.ascontiguousarray(centers)
    first = None
    if initial is None:
        if k > n:
            raise ValueError(f"k == {k}, must be in [1, {n}] (the number of points)")
        min_sq = np.full(n, np.inf)
        first = int(rng.integers(n))
        initial_radius = float("inf")
    else:
        if by_index:
            idx = initial_array.astype(np.int64)
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise ValueError(f"initial holds indices outside [0, {n})")
            idx = np.unique(idx % n)
            if k > n - idx.size:
                raise ValueError(
                    f"k == {k}, must be in [1, {n - idx.size}] (points not already centres)"
                )
            if idx.size == 0:
                min_sq = np.full(n, np.inf)
                first = int(rng.integers(n))
            else:
                min_sq = _sq_to_set(points, points[idx], chunk_size)
                min_sq[idx] = -1.0
        else:
            if k > n:
                raise ValueError(f"k == {k}, must be in [1, {n}] (the number of points)")
            min_sq = _sq_to_set(points, centers, chunk_size)
        initial_radius = (
            scale * float(np.sqrt(max(float(min_sq.max()), 0.0))) if first is None
            else float("inf")
        )
    indices, radii = _farthest_first(points, k, min_sq, first, chunk_size)
    return KCenterResult(indices=indices, radii=scale * radii, initial_radius=initial_radius)


def select_proxies(embeddings, labels, current_proxies, proxy_labels, *, budget, rng=None,
                   chunk_size=8192) -> ProxySelection:
    """ASAP Algorithm 2 (Greedy K-Center Proxy) with a sampling budget ``b`` per class.

    For each class ``c`` of ``proxy_labels``: draw ``budget`` instances of class ``c``
    (all of them if fewer) without replacement, then pick ``|rho_c|`` of them, each the
    farthest from ``rho_c`` and the ones already picked. The picks replace the class's
    proxy rows in order. ``budget = 1`` with one proxy per class is random sampling.

    embeddings : (n, d); labels : (n,); current_proxies : (n_proxies, d);
    proxy_labels : (n_proxies,).
    """
    embeddings = as_float_array(embeddings, "embeddings", ndim=2)
    labels = as_label_array(labels, "labels", length=embeddings.shape[0])
    current = as_float_array(current_proxies, "current_proxies", ndim=2)
    proxy_labels = as_label_array(proxy_labels, "proxy_labels", length=current.shape[0])
    check_same_length(current, "current_proxies", proxy_labels, "proxy_labels")
    if current.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"current_proxies have dimension {current.shape[1]}, embeddings {embeddings.shape[1]}"
        )
    budget = check_scalar(budget, "budget", low=1, integer=True)
    rng = check_rng(rng)
    indices = np.empty(current.shape[0], dtype=np.int64)
    for c in np.unique(proxy_labels):
        slots = np.flatnonzero(proxy_labels == c)
        members = np.flatnonzero(labels == c)
        pool_size = min(budget, members.size)
        if pool_size < slots.size:
            raise ValueError(
                f"class {c} has {slots.size} proxies but only {pool_size} candidates "
                f"(budget == {budget}, {members.size} instances); need at least one per proxy"
            )
        pool = rng.choice(members, size=pool_size, replace=False)
        picked = greedy_k_center(
            embeddings[pool], slots.size, initial=current[slots], chunk_size=chunk_size
        )
        indices[slots] = pool[picked.indices]
    return ProxySelection(indices=indices, proxies=embeddings[indices].copy())
