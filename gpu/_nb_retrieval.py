"""Retrieval top-K kernels: blocked distances with a running top-K per query.

What is computed: for each ranked query ``i`` the ``K`` nearest references in the
reference's order (:func:`refdml.metrics.retrieval_metrics`): lexicographic in
``(s_ij, j)`` with

.. math::
    s_{ij} = |r_j|^2 - 2 \\langle q_i, r_j \\rangle \\quad\\text{(Euclidean)}, \\qquad
    s_{ij} = -2 \\langle \\hat q_i, \\hat r_j \\rangle \\quad\\text{(cosine, unit rows)},

(``|q_i|^2`` does not change a query's ranking; the cosine score is the reference's
``-<q^, r^>`` times 2, exact in binary, so the ranking is the same), the query itself
excluded in same-set mode. No ``n_queries x n_references`` matrix, no sort or
``argpartition`` of a full row.

CPU twin (:func:`nearest_cpu`), two stages:

1. **float32 candidates.** Queries and references in tiles of ``TILE`` rows; a
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
   threads touch one query. Half the matrix-product work of the bare product.
2. **float64 verification and re-rank** (:func:`_rerank`, ``prange`` over queries; the
   float64 dot is vectorised, ``fastmath`` reassoc + contract only: a deterministic order,
   the same for equal rows, so exact duplicates stay exact ties): the
   ``K'`` candidates' scores are recomputed in float64 from the float64 rows and sorted by
   ``(s64, j)``; the first ``K`` are the answer, when the certificate below holds. A query
   whose certificate fails is redone by an exact float64 scan of every reference (correct,
   slower; it happens only when more than ``EXTRA`` references crowd within ``2 delta_i`` of
   the ``K``-th score: many exact duplicates, or a common offset much larger than the spread).

**Why the float32 stage cannot lose a true neighbour (the certificate).** Let
``delta_i >= |s32_ij - s_ij|`` for every ``j`` (a bound, below) and ``t32`` the ``K``-th
smallest float32 score of query ``i``. The ``K`` references with the smallest ``s32`` have
``s <= s32 + delta <= t32 + delta``, so the ``K``-th smallest exact score is
``t <= t32 + delta``; every true neighbour ``j`` (``s_ij <= t``) therefore has
``s32_ij <= s_ij + delta <= t32 + 2 delta``. The list holds the ``K'`` smallest ``s32``
(under some order of float32 ties); every reference outside it has ``s32`` at least the
list's last value ``v_K'``. So if ``v_K' > t32 + 2 delta`` (or the list holds every
reference) all true neighbours are in the list, and re-ranking the list by the float64
score in ``(s64, j)`` order returns the reference's ``K`` nearest in the reference's order.

The bound ``delta_i``: rows are the reference's scaled float64 rows (max entry < 1, or
unit rows for cosine), ``u = 2^-24``, ``R = max_j |r_j|``. Rounding the inputs to float32
moves ``<q, r>`` by at most ``(2u + u^2) |q||r|``; the float32 dot product of length ``d``,
in any summation order, with or without FMA, by ``gamma_d |q||r|`` (``gamma_d = d u / (1 - d
u)``, Cauchy-Schwarz on ``sum |q_k r_k|``); ``|r|^2`` rounded to float32 by ``u R^2``; the
final subtraction by ``u (R^2 + 2 |q| R)``; products below float32's normal range add at most
``d 2^-149`` per dot. Hence ``|s32 - s| <= 2 (d + 4) u' |q| R + 2 u R^2 + 2 d 2^-149`` with
``u' = u (1 + 2 d u)``, and ``delta_i = 2 [(2 d + 12) u |q_i| R + 3 u R^2 + (4 d + 8) 2^-126]``
bounds it with a factor of 2 to spare (which also covers the float64 re-rank's own rounding,
``2^-29`` times smaller). Relative to the float64 reference the only difference is then that
reference's own rounding: its BLAS sums ``<q, r>`` in another order (~1e-16 of ``|q||r|``), so
two references whose float64 distances agree to that precision may come out in the other
order; exact ties (duplicated references) are ties in both and go to the lower index.

CUDA (:func:`nearest_cuda`): ``refdml_retrieval_topk``, one thread per query (``BLOCK`` per
block), scanning the references in float64 (float64 accumulation of float32 or float64
data) and keeping its ``K`` best ``(s, j)`` in lexicographic order in global memory: exact
like the re-rank, no certificate needed. A first version (no shared-memory tiling of the
references; a thread reads its query row with a stride of ``d``), checked only under Numba's
CUDA simulator this session: never run on a GPU.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda, njit, prange

from refdml._numerics import row_norm
from refdml.gpu._numba_support import BLOCK

__all__ = ["EXTRA", "MAX_KEEP", "TILE", "nearest_cpu", "nearest_cuda", "score_before"]

#: Rows per query tile and per reference tile of the float32 stage (a 4 MiB tile per thread).
TILE = 1024
#: Candidates kept beyond ``K`` for the float64 verification.
EXTRA = 32
#: Largest ``K`` the CPU twin takes: its sorted lists cost ``O(K)`` per insertion and its
#: re-rank ``O(K^2)`` per query, right for DML's class sizes (SOP: ``K`` = 11; CUB/Cars test
#: classes ~60) but not for a class of thousands; callers use the readable / array path above.
MAX_KEEP = 256
_U32 = 2.0**-24
_TINY32 = 2.0**-126


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
def _score64(q64, qi, r64, rsq64, j, factor):
    acc = 0.0
    for k in range(r64.shape[1]):
        acc += q64[qi, k] * r64[j, k]
    return rsq64[j] + factor * acc


@njit(cache=True, parallel=True, fastmath={"reassoc", "contract"})
def _rerank(q64, rows, r64, rsq64, factor, same_set, top_v, top_i, delta, n_keep, complete,
            out, redone):
    """Stage 2: certificate, float64 re-rank of the candidates, exact scan where it fails."""
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
            for c in range(n_kept):
                j = top_i[a, c]
                s = _score64(q64, qi, r64, rsq64, j, factor)
                offer(best_s, best_j, s, j)
        else:
            redone[a] = True
            for j in range(n_r):
                if j == own:
                    continue
                s = _score64(q64, qi, r64, rsq64, j, factor)
                offer(best_s, best_j, s, j)
        out[a, :] = best_j


def _prepare(query, reference, same_set, metric):
    """float64 rows of the scores, ``|r|^2`` (zeros for cosine) and the dot's factor."""
    r64 = np.ascontiguousarray(reference, dtype=np.float64)
    q64 = None if same_set else np.ascontiguousarray(query, dtype=np.float64)
    if metric == "cosine":
        r64 = r64 / row_norm(r64, keepdims=True)
        q64 = r64 if same_set else q64 / row_norm(q64, keepdims=True)
        return (r64 if same_set else q64), r64, np.zeros(r64.shape[0]), -2.0
    rsq = np.einsum("ij,ij->i", r64, r64)
    return (r64 if same_set else q64), r64, rsq, -2.0


def nearest_cpu(query, rows, reference, n_keep, same_set, metric, *, tile=TILE, extra=EXTRA,
                return_redone=False):
    """(n_rows, n_keep) int64 indices of the nearest references of ``query[rows]``, in order.

    The contract of ``refdml.metrics._nearest`` (same-set: ``query`` is ``reference``, query
    ``rows[a]`` is reference ``rows[a]`` and never returned). ``query`` and ``reference``
    are NumPy float32 or float64, already scaled like the reference does (Euclidean) or not
    yet normalised (cosine: normalised here in float64). The work is in the module
    docstring; BLAS threads are held at one inside (Numba's threads do the parallel work).
    ``return_redone``: also return the (n_rows,) mask of queries that needed the exact scan.
    """
    from threadpoolctl import threadpool_limits

    rows = np.ascontiguousarray(rows, dtype=np.int64)
    q64, r64, rsq64, factor = _prepare(query, reference, same_set, metric)
    n_r, d = r64.shape
    available = n_r - 1 if same_set else n_r
    n_kept = min(n_keep + extra, available)
    complete = n_kept >= available
    r32 = r64.astype(np.float32)
    q32 = r32 if same_set else q64.astype(np.float32)
    rsq32 = rsq64.astype(np.float32)
    q_norm = _row_norms_of(q64, rows)
    big_r = float(np.sqrt(rsq64.max())) if metric == "euclidean" else float(row_norm(r64).max())
    delta = 2.0 * ((2 * d + 12) * _U32 * q_norm * big_r + 3 * _U32 * big_r**2
                   + (4 * d + 8) * _TINY32)
    top_v = np.full((rows.size, n_kept), np.inf, dtype=np.float32)
    top_i = np.full((rows.size, n_kept), -1, dtype=np.int64)
    out = np.empty((rows.size, n_keep), dtype=np.int64)
    redone = np.zeros(rows.size, dtype=np.bool_)
    with threadpool_limits(limits=1, user_api="blas"):
        if same_set:
            slot = np.full(n_r, -1, dtype=np.int64)
            slot[rows] = np.arange(rows.size)
            pair_i, pair_j, starts = _round_robin(-(-n_r // tile))
            _candidates32_same_set(r32, slot, rsq32, top_v, top_i, tile, pair_i, pair_j, starts)
        else:
            _candidates32(q32, rows, r32, rsq32, same_set, top_v, top_i, tile)
    _rerank(q64, rows, r64, rsq64, factor, same_set, top_v, top_i, delta, n_keep, complete,
            out, redone)
    return (out, redone) if return_redone else out


def _row_norms_of(x, rows):
    out = np.empty(rows.size)
    for start in range(0, rows.size, 4096):
        block = x[rows[start:start + 4096]]
        out[start:start + 4096] = np.sqrt(np.einsum("ij,ij->i", block, block))
    return out


# ---------------------------------------------------------------------------------- CUDA


# :func:`offer` for the device, from the same source (the CUDA simulator cannot pass its
# arrays to an ``@njit`` function)
_offer_device = cuda.jit(device=True)(offer.py_func)


@cuda.jit(cache=True)
def refdml_retrieval_topk(q, rows, r, rsq, factor, same_set, best_s, best_j):
    """One thread per query: an exact float64 scan keeping the ``K`` best ``(s, j)``."""
    a = cuda.grid(1)
    if a >= rows.shape[0]:
        return
    qi = rows[a]
    n_r, d = r.shape
    n_keep = best_s.shape[1]
    for c in range(n_keep):
        best_s[a, c] = math.inf
        best_j[a, c] = n_r
    for j in range(n_r):
        if same_set and j == qi:
            continue
        acc = 0.0
        for k in range(d):
            acc += np.float64(q[qi, k]) * np.float64(r[j, k])
        s = np.float64(rsq[j]) + factor * acc
        _offer_device(best_s[a], best_j[a], s, j)


def nearest_cuda(xp, query, rows, reference, n_keep, same_set, metric):
    """:func:`nearest_cpu`'s contract with the CUDA kernel (CuPy arrays on a GPU, NumPy under
    the simulator); the result stays on the device (no synchronisation)."""
    if metric == "cosine":
        reference = reference / _xp_row_norm(xp, reference)
        query = reference if same_set else query / _xp_row_norm(xp, query)
        rsq = xp.zeros(reference.shape[0], dtype=xp.float64)
    else:
        rsq = xp.einsum("ij,ij->i", reference.astype(xp.float64), reference.astype(xp.float64))
    if same_set:
        query = reference
    rows = xp.ascontiguousarray(rows.astype(xp.int64))
    best_s = xp.empty((rows.shape[0], n_keep), dtype=xp.float64)
    best_j = xp.empty((rows.shape[0], n_keep), dtype=xp.int64)
    grid = max(1, -(-rows.shape[0] // BLOCK))
    refdml_retrieval_topk[grid, BLOCK](xp.ascontiguousarray(query), rows,
                                       xp.ascontiguousarray(reference), rsq, -2.0,
                                       bool(same_set), best_s, best_j)
    return best_j


def _xp_row_norm(xp, x):
    peak = xp.max(xp.abs(x), axis=-1, keepdims=True)
    safe = xp.where(peak > 0.0, peak, xp.ones_like(peak))
    return peak * xp.sqrt(xp.sum((x / safe) ** 2, axis=-1, keepdims=True))
