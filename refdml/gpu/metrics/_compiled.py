"""Retrieval top-K, compiled CPU twin: blocked distances with a running top-K per query.

What is computed: for each ranked query ``i`` the ``K`` nearest references in the
reference's order (:func:`refdml.metrics.retrieval_metrics`): lexicographic in
``(S_ij, j)``, with ``S_ij`` the ordered squared distance of
:func:`refdml._numerics.ordered_sq_distances` (``sum_k (q_ik - r_jk)^2`` summed in the
order of ``k``, one IEEE rounding per operation; for cosine, of the unit rows of
:func:`refdml._numerics.ordered_unit_rows`), the query itself excluded in same-set mode.
No ``n_queries x n_references`` matrix, no sort or ``argpartition`` of a full row.

CPU twin (:func:`nearest_cpu`), two stages:

1. **float32 candidates.** The Gram form

   .. math::
       s_{ij} = |r_j|^2 - 2 \\langle q_i, r_j \\rangle = |q_i - r_j|^2 - |q_i|^2

   (a shift per query, so the same order as the distance) in float32. Queries and
   references in tiles of ``TILE`` rows; a
   ``prange`` over query tiles (each Numba thread owns its queries: no races), and per
   reference tile one float32 matrix product ``G = Q_tile R_tile^T`` (``np.dot`` inside
   the compiled loop: single-threaded sgemm, BLAS threads held at 1 by ``threadpool_limits``
   so Numba's threads are the only ones) followed, while ``G`` is in cache, by the merge of
   every ``s32 = rsq32_j - 2 G_ij`` below the query's current ``K'``-th best into its sorted
   list of ``K' = K + EXTRA`` (score, index) pairs (an insertion; rare once the list fills).
   Same-set mode uses the symmetry ``<x_a, x_b> = <x_b, x_a>``: only the tiles ``I <= J``
   are multiplied, each product merged along its rows (queries of ``I``) and its columns
   (queries of ``J``, 64 columns at a time so the reads stay contiguous); the tile pairs
   run in rounds of disjoint pairs (the circle method), a ``prange`` per round, so no two
   threads touch one query. Half the matrix-product work of the bare product. Which
   candidates a query gets may depend on the BLAS kernel; the answer does not (below).
2. **float64 verification and re-rank** (:func:`_rerank`, ``prange`` over queries): the
   ``K'`` candidates' ordered scores ``S64`` are computed from the float64 rows by the loop
   ``acc = 0.0; for k: t = q_k - r_k; acc += t * t``, compiled **without** fast-math (no
   reassociation, no contraction into an FMA, whatever the CPU target), which performs the
   very operations of ``ordered_sq_distances`` and so gives its bits; they are sorted by
   ``(S64, j)`` and the first ``K`` are the answer, when the certificate holds (below). A
   query whose certificate fails is redone by an ordered scan of every reference (correct,
   slower; it happens only when more than ``EXTRA`` references crowd within
   ``2 delta_i`` of the ``K``-th score: many exact duplicates, or a common offset much
   larger than the spread).

The float32 stage cannot lose a true neighbour while its list passes the certificate of
:mod:`refdml.gpu.metrics._certificate` (the proof, and the bounds:
:func:`~refdml.gpu.metrics._certificate.twin_score_bound` for this twin's float32 score,
:func:`~refdml.gpu.metrics._certificate.rerank_bound` for the ordered float64 one), which the
array path (:mod:`refdml.gpu.metrics._array`) shares.

The CUDA kernel of the same ranking (``refdml_retrieval_topk``, an ordered float64 scan per
query keeping its ``K`` best with :func:`offer`) is in :mod:`refdml.gpu.metrics._cuda`.
"""

from __future__ import annotations

import math

import numpy as np
from refdml.gpu._support.jit import njit, prange

from refdml._numerics import ordered_unit_rows
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.metrics._certificate import EXTRA, rerank_bound, twin_score_bound

__all__ = ["MAX_KEEP", "TILE", "nearest_cpu", "offer", "score_before"]

#: Rows per query tile and per reference tile of the float32 stage (a 4 MiB tile per thread).
TILE = 1024
#: Largest ``K`` the CPU twin takes: its sorted lists cost ``O(K)`` per insertion and its
#: re-rank ``O(K^2)`` per query, right for DML's class sizes (SOP: ``K`` = 11; CUB/Cars test
#: classes ~60) but not for a class of thousands: the array path answers beyond
#: (:class:`refdml.gpu.metrics._kernels.CpuPath` declines).
MAX_KEEP = 256


@njit(cache=True, inline="always")
def score_before(s, j, best_s, best_j):
    """True when ``(s, j)`` comes before ``(best_s, best_j)``: smaller score, then lower index."""
    return s < best_s or (s == best_s and j < best_j)


@njit(cache=True, inline="always")
def offer(best_s, best_j, s, j):
    """Offer ``(s, j)`` to the ``K`` best so far (``best_s`` / ``best_j``, length ``K``, in
    :func:`score_before` order): inserted in its place, the last dropped, when it comes before
    the last. The stage-2 re-rank and the CUDA scan both keep their lists with it."""
    last = best_s.shape[0] - 1
    if score_before(s, j, best_s[last], best_j[last]):
        p = last
        while p > 0 and score_before(s, j, best_s[p - 1], best_j[p - 1]):
            best_s[p] = best_s[p - 1]
            best_j[p] = best_j[p - 1]
            p -= 1
        best_s[p] = s
        best_j[p] = j


# ------------------------------------------------------------------------------ CPU twin


@njit(cache=True, inline="always")
def _insert(values, index, s, j):
    """Insert ``(s, j)`` into the ascending ``values`` (dropping the last); equal scores keep
    the earlier arrival first."""
    p = values.shape[0] - 1
    while p > 0 and values[p - 1] > s:
        values[p] = values[p - 1]
        index[p] = index[p - 1]
        p -= 1
    values[p] = s
    index[p] = j


@njit(cache=True, parallel=True)
def _candidates32(q32, rows, r32, rsq32, same_set, top_v, top_i, tile):
    """Stage 1: the ``K'`` smallest float32 scores of every query ``q32[rows[a]]``."""
    n_q = rows.shape[0]
    n_r, d = r32.shape
    n_kept = top_v.shape[1]
    n_tiles = (n_q + tile - 1) // tile
    for t in prange(n_tiles):
        q0 = t * tile
        q1 = min(q0 + tile, n_q)
        block = np.empty((q1 - q0, d), dtype=np.float32)
        for a in range(q1 - q0):
            block[a, :] = q32[rows[q0 + a]]
        for r0 in range(0, n_r, tile):
            r1 = min(r0 + tile, n_r)
            gram = np.dot(block, r32[r0:r1].T)
            for a in range(q1 - q0):
                qa = q0 + a
                own = rows[qa] if same_set else -1
                values = top_v[qa]
                index = top_i[qa]
                last = values[n_kept - 1]
                for b in range(r1 - r0):
                    s = rsq32[r0 + b] - np.float32(2.0) * gram[a, b]
                    if s < last and r0 + b != own:
                        _insert(values, index, s, r0 + b)
                        last = values[n_kept - 1]


@njit(cache=True, parallel=True)
def _candidates32_same_set(x32, slot, rsq32, top_v, top_i, tile, pair_i, pair_j, round_start):
    """Stage 1 in same-set mode: each tile product ``G = X_I X_J^T`` (``I <= J``) serves
    both the queries of ``I`` (rows of ``G``) and, for ``I != J``, those of ``J`` (its
    columns): half the products. The pairs of one round share no tile, so the ``prange``
    over a round's pairs writes disjoint queries. ``slot[i]``: row of query ``i`` in
    ``top_v`` / ``top_i``, ``-1`` for a query that is not ranked."""
    n, d = x32.shape
    n_kept = top_v.shape[1]
    two = np.float32(2.0)
    for r in range(round_start.shape[0] - 1):
        for p in prange(round_start[r], round_start[r + 1]):
            a0 = pair_i[p] * tile
            a1 = min(a0 + tile, n)
            b0 = pair_j[p] * tile
            b1 = min(b0 + tile, n)
            gram = np.dot(x32[a0:a1], x32[b0:b1].T)
            for a in range(a1 - a0):                      # queries of I, references of J
                qa = slot[a0 + a]
                if qa < 0:
                    continue
                values = top_v[qa]
                index = top_i[qa]
                last = values[n_kept - 1]
                for b in range(b1 - b0):
                    s = rsq32[b0 + b] - two * gram[a, b]
                    if s < last and b0 + b != a0 + a:
                        _insert(values, index, s, b0 + b)
                        last = values[n_kept - 1]
            if a0 == b0:
                continue
            lasts = np.empty(64, dtype=np.float32)
            for c0 in range(0, b1 - b0, 64):              # queries of J, references of I
                c1 = min(c0 + 64, b1 - b0)
                for b in range(c0, c1):
                    qb = slot[b0 + b]
                    lasts[b - c0] = top_v[qb, n_kept - 1] if qb >= 0 else -np.inf
                for a in range(a1 - a0):
                    ra = rsq32[a0 + a]
                    for b in range(c0, c1):
                        s = ra - two * gram[a, b]
                        if s < lasts[b - c0]:
                            qb = slot[b0 + b]
                            _insert(top_v[qb], top_i[qb], s, a0 + a)
                            lasts[b - c0] = top_v[qb, n_kept - 1]


def _round_robin(n_tiles):
    """Pairs ``(I, J)``, ``I <= J``, of ``n_tiles`` tiles in rounds of disjoint pairs (the
    circle method), the diagonal ``(I, I)`` as one more round."""
    m = n_tiles + (n_tiles % 2)
    ring = list(range(m))
    pairs, starts = [], [0]
    for _ in range(m - 1):
        for k in range(m // 2):
            i, j = ring[k], ring[m - 1 - k]
            if i < n_tiles and j < n_tiles:
                pairs.append((min(i, j), max(i, j)))
        starts.append(len(pairs))
        ring = [ring[0]] + [ring[-1]] + ring[1:-1]
    pairs += [(i, i) for i in range(n_tiles)]
    starts.append(len(pairs))
    pair = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    return pair[:, 0].copy(), pair[:, 1].copy(), np.array(starts, dtype=np.int64)


@njit(cache=True, inline="always")
def _score64(q64, qi, r64, j):
    """``refdml._numerics.ordered_sq_distances`` of rows ``q64[qi]`` and ``r64[j]``: the same
    operations in the same order (the callers are compiled without fast-math)."""
    acc = 0.0
    for k in range(r64.shape[1]):
        t = q64[qi, k] - r64[j, k]
        acc += t * t
    return acc


@njit(cache=True, inline="always")
def _score64_four(q64, qi, r64, j0, j1, j2, j3):
    """:func:`_score64` of four references at once: four independent add chains, each in
    the order of ``k`` (the same bits as four calls), which the CPU overlaps instead of
    waiting on one chain's latency."""
    a0 = 0.0
    a1 = 0.0
    a2 = 0.0
    a3 = 0.0
    for k in range(r64.shape[1]):
        x = q64[qi, k]
        t0 = x - r64[j0, k]
        t1 = x - r64[j1, k]
        t2 = x - r64[j2, k]
        t3 = x - r64[j3, k]
        a0 += t0 * t0
        a1 += t1 * t1
        a2 += t2 * t2
        a3 += t3 * t3
    return a0, a1, a2, a3


# No fast-math here: reassociation would vectorise the sum in a CPU-dependent order, and
# contraction would fuse ``acc + t * t`` into an FMA on CPUs that have one.
@njit(cache=True, parallel=True)
def _rerank(q64, rows, r64, same_set, top_v, top_i, delta, n_keep, complete, out, redone):
    """Stage 2: certificate, ordered float64 re-rank of the candidates, ordered scan where it
    fails."""
    n_q = rows.shape[0]
    n_r = r64.shape[0]
    n_kept = top_v.shape[1]
    for a in prange(n_q):
        qi = rows[a]
        own = qi if same_set else -1
        best_s = np.empty(n_keep, dtype=np.float64)
        best_j = np.empty(n_keep, dtype=np.int64)
        best_s[:] = math.inf
        best_j[:] = n_r
        ok = complete or np.float64(top_v[a, n_kept - 1]) > (
            np.float64(top_v[a, n_keep - 1]) + 2.0 * delta[a])
        if ok:
            c = 0
            while c + 4 <= n_kept:
                j0, j1, j2, j3 = top_i[a, c], top_i[a, c + 1], top_i[a, c + 2], top_i[a, c + 3]
                s0, s1, s2, s3 = _score64_four(q64, qi, r64, j0, j1, j2, j3)
                offer(best_s, best_j, s0, j0)
                offer(best_s, best_j, s1, j1)
                offer(best_s, best_j, s2, j2)
                offer(best_s, best_j, s3, j3)
                c += 4
            for c in range(c, n_kept):
                j = top_i[a, c]
                offer(best_s, best_j, _score64(q64, qi, r64, j), j)
        else:
            redone[a] = True
            for j in range(n_r):
                if j != own:
                    offer(best_s, best_j, _score64(q64, qi, r64, j), j)
        out[a, :] = best_j


def _prepare(query, reference, same_set, metric):
    """float64 rows of the scores (unit rows for cosine) and their ``|r|^2``."""
    r64 = np.ascontiguousarray(reference, dtype=np.float64)
    q64 = None if same_set else np.ascontiguousarray(query, dtype=np.float64)
    if metric == "cosine":
        r64 = ordered_unit_rows(r64)
        q64 = None if same_set else ordered_unit_rows(q64)
    rsq = np.einsum("ij,ij->i", r64, r64)   # float32 stage and bounds only: any order will do
    return (r64 if same_set else q64), r64, rsq


def nearest_cpu(query, rows, reference, n_keep, same_set, metric, *, tile=TILE, extra=EXTRA,
                return_redone=False):
    """(n_rows, n_keep) int64 indices of the nearest references of ``query[rows]``, in order.

    The contract of ``refdml.metrics._nearest`` (same-set: ``query`` is ``reference``, query
    ``rows[a]`` is reference ``rows[a]`` and never returned). ``query`` and ``reference``
    are NumPy float32 or float64, already scaled like the reference does (Euclidean) or not
    yet normalised (cosine: made unit here in float64 by ``ordered_unit_rows``). The work is in the module
    docstring; BLAS threads are held at one inside (Numba's threads do the parallel work).
    ``return_redone``: also return the (n_rows,) mask of queries that needed the exact scan.
    """
    from threadpoolctl import threadpool_limits

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    q64, r64, rsq64 = _prepare(query, reference, same_set, metric)
    n_r, d = r64.shape
    available = n_r - 1 if same_set else n_r
    n_kept = min(n_keep + extra, available)
    complete = n_kept >= available
    r32 = r64.astype(np.float32)
    q32 = r32 if same_set else q64.astype(np.float32)
    rsq32 = rsq64.astype(np.float32)
    q_norm = _row_norms_of(q64, rows)
    big_r = float(np.sqrt(rsq64.max()))
    # the certificate's ``delta + eta`` (module docstring)
    delta = twin_score_bound(q_norm, big_r, d) + rerank_bound(q_norm, big_r, d)
    top_v = np.full((rows.size, n_kept), np.inf, dtype=np.float32)
    top_i = np.full((rows.size, n_kept), -1, dtype=np.int64)
    out = np.empty((rows.size, n_keep), dtype=np.int64)
    redone = np.zeros(rows.size, dtype=np.bool_)
    with parallel_launch(), threadpool_limits(limits=1, user_api="blas"):
        if same_set:
            slot = np.full(n_r, -1, dtype=np.int64)
            slot[rows] = np.arange(rows.size)
            pair_i, pair_j, starts = _round_robin(-(-n_r // tile))
            _candidates32_same_set(r32, slot, rsq32, top_v, top_i, tile, pair_i, pair_j, starts)
        else:
            _candidates32(q32, rows, r32, rsq32, same_set, top_v, top_i, tile)
    with parallel_launch():
        _rerank(q64, rows, r64, same_set, top_v, top_i, delta, n_keep, complete, out, redone)
    return (out, redone) if return_redone else out


def _row_norms_of(x, rows):
    out = np.empty(rows.size)
    for start in range(0, rows.size, 4096):
        block = x[rows[start:start + 4096]]
        out[start:start + 4096] = np.sqrt(np.einsum("ij,ij->i", block, block))
    return out
