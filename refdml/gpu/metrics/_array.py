"""The array path of the retrieval top-K, written once against the backend (NumPy or CuPy).

:class:`ArrayPath` is the family's interface (:class:`TopK` in, the ``(n_rows, K)``
neighbours in the reference's order out); the compiled CPU twin and the CUDA kernel
(:mod:`refdml.gpu.metrics._kernels`) answer the same request.

**Stage 1: float32 candidates from one GEMM per block.** The scored
queries in chunks of ``b`` rows, the references in blocks of ``w`` rows (at most
``_REFERENCE_BLOCK``, 2^20: one block up to a million references). Each query row becomes
``[-2 q~, 1]`` and each reference row ``[r~, rho~]`` (``~``: rounded to float32; ``rho`` the
float64 ``|r|^2``), so that one float32 matrix product (cuBLAS through ``xp.matmul``) gives
the scores

.. math::
    s_{ij} = |r_j|^2 - 2 \\langle q_i, r_j \\rangle = |q_i - r_j|^2 - |q_i|^2

with no pass of its own for the ``|r|^2`` term (for cosine the rows are first made unit in
float64 by :func:`refdml._numerics.ordered_unit_rows`). Every row of the ``(b, w)`` score
block then gives its ``L`` smallest entries (``L = K' = K + EXTRA``, plus one in same-set
mode, where the query itself is among the references until stage 2), in any order and any
choice among ties, without sorting the block (CuPy's ``argpartition`` sorts the whole row):

- **group minima** (:func:`_smallest_entries`): the minima of groups of ``_GROUP`` (32)
  consecutive columns, ``levels`` times over, until at most ``L * _GROUP`` remain; the ``L``
  smallest minima of the top level by ``argpartition``; then, level by level down, the
  members of those ``L`` groups (``L * _GROUP`` entries) are gathered and their ``L``
  smallest kept. Why that loses nothing: if a group outside the ``L`` chosen ones held one
  of the row's ``L`` smallest entries ``e``, each chosen group's minimum would be at most
  that group's minimum, itself at most ``e``: ``L`` entries besides ``e`` at or below it. So
  every entry left out is at least the kept list's largest value, which is all the
  certificate needs (below).
- blocks merged into the running list of ``L`` by one ``argpartition`` of ``2 L`` columns.

Per (query chunk, reference block): one GEMM, one pass reading the score block for the
first minima, and sorts of about ``w / 32^levels + 2 L 32`` entries per row (3.8 thousand
at ``w = 2^20``, ``L = 44``) instead of ``w``; about 20 launches; no synchronisation.
Padding rows ``[0, ..., 0, 2^100]`` make ``w`` a multiple of ``32^levels``: they score above
every real reference and never reach the list (it holds at most the number of real
references).

**Stage 2: certified float64 re-rank** (:func:`_certified_rerank`, in chunks of queries of
its own, larger than stage 1's). The query itself is removed (same-set), the list sorted,
its first ``K'`` kept; their ordered float64 scores ``S64`` are computed from the gathered
rows with the operations of :func:`refdml._numerics.ordered_sq_distances` (one subtraction
and one product per coordinate over the whole ``(b, K', d)`` block, then the sum in the
order of ``k``), and ranked by ``(S64, j)``: the reference's ranking of those candidates.
It is the reference's answer when the list holds every true neighbour, which the
certificate of :mod:`refdml.gpu.metrics._certificate` shows: ``v_K' > t + 2 (delta_i + eta_i)``,
``t`` and ``v_K'`` the list's ``K``-th and last float32 scores, ``delta_i`` the bound
:func:`refdml.gpu.metrics._certificate.gemm_score_bound` derives for this GEMM's scores
(``|fl(q.r) - q.r| <= gamma_{d+1} sum_k |q_k r_k|`` for the float32 dot product, plus the
inputs' rounding, which the backend states:
:meth:`refdml._backend.Backend.matmul_input_roundoff`, float32's, or the 10 bits of TF32
under CuPy's ``CUPY_TF32=1``) and ``eta_i`` the ordered sum's
(:func:`refdml.gpu.metrics._certificate.rerank_bound`). Candidates with
``s32 > t + 2 (delta + eta)`` could be dropped before the re-rank, as they cannot be in the
answer; fixed shapes make keeping them cheaper than a compaction. Queries whose certificate
fails (many exact duplicates at the ``K``-th distance, more than ``EXTRA``; or ``K' = K``
because few references remain) are collected over all chunks and redone at the end by an
ordered float64 scan of every reference and a stable sort, whose order is the reference's
exactly, ties included. No Python loop over queries or references, no host round trip per
query or per block.

Memory: stage 1 sizes ``b`` so that its temporaries (the score block, the minima, the
gathered candidates and their indices) stay within ``_BLOCK_BYTES`` (512 MiB), stage 2 so
that the gathered ``(b, K', d)`` float64 rows do; plus the float32 copy of the references
with their ``|r|^2`` column (``n_references (d + 1) 4`` bytes), built in row blocks of the
same budget. The rescan of failed queries makes a float64 copy of the (unit) references.
``chunk_size``, when given, is the queries per chunk of both stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._backend import Backend
from refdml._numerics import ordered_sq_distances, ordered_unit_rows
from refdml.gpu.metrics._certificate import EXTRA, gemm_score_bound, rerank_bound

__all__ = ["ArrayPath", "TopK"]

#: Memory budget of one chunk's temporaries, in bytes (stage 1 and stage 2 alike).
_BLOCK_BYTES = 512 * 2**20
#: References per block of stage 1 at most (one block up to a million references: the
#: selection's sorts cost per block, not per reference).
_REFERENCE_BLOCK = 2**20
#: Columns per group of the selection's group minima.
_GROUP = 32
#: The score of a padding reference row ``[0, ..., 0, 2^100]``: above every real score
#: (``|r|^2 + 2 |q| |r| <= 3 d``, entries below 1), and finite, as BLAS kernels may multiply
#: a padding 0 by an infinity.
_PAD_SCORE = 2.0**100


@dataclass(frozen=True)
class TopK:
    """One request to the family's implementations: the ``n_keep`` nearest references of
    each query ``query[rows[a]]``, in the reference's order (``refdml.metrics._nearest``'s
    contract).

    ``query``, ``reference``: ``(n, d)`` arrays of one module and dtype, already divided by
    the common power of two (Euclidean) or not yet normalised (cosine: each implementation
    makes its unit rows); in same-set mode ``reference is query`` and query ``rows[a]`` is
    never its own neighbour. ``rows``: int64 indices of the ranked queries. ``chunk_size``:
    queries per chunk (array path only), or None for the memory budget. ``backend``: the
    backend of the arrays (:func:`refdml._backend.get_backend`).
    """

    backend: Backend
    query: Any
    rows: Any
    reference: Any
    n_keep: int
    same_set: bool
    metric: str
    chunk_size: int | None = None

    @property
    def xp(self) -> Any:
        """The array module of the request's arrays."""
        return self.backend.xp


class ArrayPath:
    """The array path (module docstring), the family's interface; the compiled members of
    :mod:`refdml.gpu.metrics._kernels` have the same two methods.

    ``takes(request) -> bool``
        Whether this implementation answers ``request`` (a :class:`TopK`); the array path
        takes every request, and :func:`refdml.gpu.metrics.retrieval_metrics` runs it
        where the chosen one declines.
    ``nearest(request) -> (n_rows, n_keep) int64 array``
        The ``n_keep`` nearest references of each query ``request.query[request.rows[a]]``,
        in the reference's order ``(S, j)``, an array of the request's module: the float32
        GEMM's candidates, the certified float64 re-rank, the exact rescan of the queries
        whose certificate fails.
    """

    def takes(self, request: TopK) -> bool:
        return True

    def nearest(self, request: TopK) -> Any:
        xp = request.xp
        n_ref, d = request.reference.shape
        plan = _Plan.of(n_ref, d, request.n_keep, request.same_set,
                        request.query.dtype.itemsize, request.chunk_size)
        references, big_r = _gemm_references(xp, request.reference, request.metric, plan)
        queries = _gemm_queries(xp, request, references)
        top_s, top_j = _candidates(xp, queries, references, plan)
        del queries, references
        return _certified_rerank(request, plan, top_s, top_j, big_r)


@dataclass(frozen=True)
class _Plan:
    """Sizes of the array path for one call (module docstring, "Memory")."""

    n_list: int         # L: stage 1's list per query (K', plus the query itself in same-set)
    n_kept: int         # K': the candidates re-ranked
    n_blocks: int       # reference blocks
    width: int          # references per block, padding included (a multiple of group^levels)
    levels: int         # levels of group minima
    group: int          # columns per group
    queries: int        # queries per chunk of stage 1
    rerank_queries: int  # queries per chunk of stage 2

    @property
    def padded(self) -> int:
        return self.n_blocks * self.width

    @classmethod
    def of(cls, n_ref: int, d: int, n_keep: int, same_set: bool, itemsize: int,
           chunk_size: int | None) -> _Plan:
        available = n_ref - 1 if same_set else n_ref
        n_kept = min(n_keep + EXTRA, available)
        n_list = n_kept + (1 if same_set else 0)
        group = _GROUP
        n_blocks = -(-n_ref // _REFERENCE_BLOCK)
        width = -(-n_ref // n_blocks)
        levels = 0
        while width // group**levels > n_list * group:   # the top level's sort is the widest
            levels += 1
        step = group**levels
        width = -(-width // step) * step
        top = width // step
        # One query's share of stage 1: the float32 score row, the first minima, the widest
        # sort (its int64 order and a gathered copy) and one level's gathered candidates.
        stage1 = 4 * width + (4 * width // group if levels else 0) + 24 * max(
            top, n_list * group) + 48 * n_list
        # Of stage 2: the gathered rows in the data's dtype and in float64, the scores.
        stage2 = n_kept * d * (8 + itemsize) + 64 * n_list
        queries = chunk_size or max(1, _BLOCK_BYTES // stage1)
        rerank = chunk_size or max(1, _BLOCK_BYTES // stage2)
        return cls(n_list=n_list, n_kept=n_kept, n_blocks=n_blocks, width=width,
                   levels=levels, group=group, queries=queries, rerank_queries=rerank)


def _rows64(xp, rows, metric):
    """float64 rows of the ranking: the rows themselves, or their unit rows (cosine), row by
    row, so the bits do not depend on which rows are converted together."""
    rows = rows.astype(xp.float64, copy=False)
    return ordered_unit_rows(rows, xp=xp) if metric == "cosine" else rows


def _gemm_references(xp, reference, metric, plan: _Plan):
    """``(padded, d + 1)`` float32 rows ``[r~, rho~]`` and ``R = max_j |r_j|`` (a device
    scalar). Built in row blocks within the memory budget (no float64 copy of the whole set);
    padding rows score ``_PAD_SCORE``."""
    n_ref, d = reference.shape
    out = xp.zeros((plan.padded, d + 1), dtype=xp.float32)
    if plan.padded > n_ref:
        out[n_ref:, d] = _PAD_SCORE
    step = max(1, _BLOCK_BYTES // (3 * 8 * d))
    largest = []
    for r0 in range(0, n_ref, step):
        r1 = min(r0 + step, n_ref)
        r64 = _rows64(xp, reference[r0:r1], metric)
        sq = xp.einsum("ij,ij->i", r64, r64)        # bounds and scores only: any order will do
        out[r0:r1, :d] = r64.astype(xp.float32)
        out[r0:r1, d] = sq.astype(xp.float32)
        largest.append(xp.max(sq))
    big_sq = largest[0] if len(largest) == 1 else xp.max(xp.stack(largest))
    return out, xp.sqrt(big_sq)


def _gemm_queries(xp, request: TopK, references):
    """``(n_rows, d + 1)`` float32 rows ``[-2 q~, 1]`` of the ranked queries (the factor
    ``-2`` is exact)."""
    d = request.query.shape[1]
    if request.same_set:
        out = references[request.rows]                  # the same rounded rows
    else:
        out = xp.empty((request.rows.shape[0], d + 1), dtype=xp.float32)
        out[:, :d] = _rows64(xp, request.query[request.rows], request.metric).astype(xp.float32)
    out[:, :d] *= -2.0
    out[:, d] = 1.0
    return out


def _smallest_entries(xp, score, n, levels, group, offsets):
    """``(values, columns)``, each ``(b, min(n, w))``: the ``n`` smallest entries of each row
    of ``score`` ``(b, w)``, in any order, ties chosen any way, through ``levels`` levels of
    minima of ``group`` consecutive columns (module docstring; ``w`` a multiple of
    ``group**levels``; ``offsets``: ``arange(group)``)."""
    b, w = score.shape
    if levels:
        minima = xp.min(score.reshape(b, w // group, group), axis=2)
        groups = _smallest_entries(xp, minima, n, levels - 1, group, offsets)[1]
        columns = (groups[:, :, None] * group + offsets).reshape(b, -1)
        values = xp.take_along_axis(score, columns, axis=1)
    else:
        columns, values = None, score
    if values.shape[1] > n:
        pick = xp.argpartition(values, n - 1, axis=1)[:, :n]
        values = xp.take_along_axis(values, pick, axis=1)
        columns = pick if columns is None else xp.take_along_axis(columns, pick, axis=1)
    elif columns is None:
        columns = xp.broadcast_to(xp.arange(w, dtype=xp.int64), (b, w))
    return values, columns


def _keep_smallest(xp, values, index, n):
    """The ``n`` smallest ``values`` of each row and their ``index``, any order."""
    if values.shape[1] <= n:
        return values, index
    pick = xp.argpartition(values, n - 1, axis=1)[:, :n]
    return xp.take_along_axis(values, pick, axis=1), xp.take_along_axis(index, pick, axis=1)


def _candidates(xp, queries, references, plan: _Plan):
    """Stage 1: ``(n_rows, L)`` float32 scores and their reference indices, the ``L``
    smallest of each query's row (any order): every reference left out scores at least the
    list's largest value."""
    n_rows = queries.shape[0]
    top_s = xp.empty((n_rows, plan.n_list), dtype=xp.float32)
    top_j = xp.empty((n_rows, plan.n_list), dtype=xp.int64)
    offsets = xp.arange(plan.group, dtype=xp.int64)
    for q0 in range(0, n_rows, plan.queries):
        block = queries[q0:q0 + plan.queries]
        best_s = best_j = None
        for r0 in range(0, plan.padded, plan.width):
            score = xp.matmul(block, references[r0:r0 + plan.width].T)
            s, j = _smallest_entries(xp, score, plan.n_list, plan.levels, plan.group, offsets)
            if r0:
                j = j + r0
            if best_s is not None:
                s, j = xp.concatenate([best_s, s], axis=1), xp.concatenate([best_j, j], axis=1)
            best_s, best_j = _keep_smallest(xp, s, j, plan.n_list)
        top_s[q0:q0 + block.shape[0]] = best_s
        top_j[q0:q0 + block.shape[0]] = best_j
    return top_s, top_j


def _ordered_scores(xp, q64, cand64):
    """``S64`` of each query row ``q64`` ``(b, d)`` against its candidate rows ``cand64``
    ``(b, n, d)`` (overwritten): the operations of
    :func:`refdml._numerics.ordered_sq_distances` (``t = q_k - r_k``, ``t * t``, the sum in
    the order of ``k`` from 0), so the same bits."""
    xp.subtract(q64[:, None, :], cand64, out=cand64)
    xp.multiply(cand64, cand64, out=cand64)
    acc = cand64[:, :, 0].copy()              # 0 + t_0^2 is t_0^2 exactly
    for k in range(1, cand64.shape[2]):
        xp.add(acc, cand64[:, :, k], out=acc)
    return acc


def _certified_rerank(request: TopK, plan: _Plan, top_s, top_j, big_r):
    """Stage 2 (module docstring): the ``K`` nearest of each query by ``(S64, j)``, certified,
    and the failed queries rescanned."""
    xp = request.xp
    n_rows, d = request.rows.shape[0], request.query.shape[1]
    n_keep, n_kept = request.n_keep, plan.n_kept
    available = request.reference.shape[0] - (1 if request.same_set else 0)
    complete = n_kept >= available
    roundoff = request.backend.matmul_input_roundoff()
    out = xp.empty((n_rows, n_keep), dtype=xp.int64)
    failed = None if complete else xp.empty(n_rows, dtype=xp.bool_)
    for a0 in range(0, n_rows, plan.rerank_queries):
        rows = request.rows[a0:a0 + plan.rerank_queries]
        b = rows.shape[0]
        s, j = top_s[a0:a0 + b], top_j[a0:a0 + b]
        if request.same_set:
            s = xp.where(j == rows[:, None], np.inf, s)   # the query itself: last
        order = xp.argsort(s, axis=1)[:, :n_kept]
        s, j = xp.take_along_axis(s, order, axis=1), xp.take_along_axis(j, order, axis=1)
        q64 = _rows64(xp, request.query[rows], request.metric)
        cand64 = _rows64(xp, request.reference[j.reshape(-1)], request.metric)
        score = _ordered_scores(xp, q64, cand64.reshape(b, n_kept, d))
        by_index = xp.argsort(j, axis=1)                # (S64, j) order: j first, then stable
        j = xp.take_along_axis(j, by_index, axis=1)
        score = xp.take_along_axis(score, by_index, axis=1)
        order = xp.argsort(score, axis=1, kind="stable")[:, :n_keep]
        out[a0:a0 + b] = xp.take_along_axis(j, order, axis=1)
        if failed is not None:
            q_norm = xp.sqrt(xp.einsum("ij,ij->i", q64, q64))   # bounds only: any order
            margin = 2.0 * (gemm_score_bound(q_norm, big_r, d, input_roundoff=roundoff)
                            + rerank_bound(q_norm, big_r, d))
            last = s[:, n_kept - 1].astype(xp.float64)
            kth = s[:, n_keep - 1].astype(xp.float64)
            failed[a0:a0 + b] = ~(last > kth + margin)
    if failed is not None:
        redo = xp.nonzero(failed)[0]      # the certificate's one synchronisation on CuPy
        if redo.shape[0]:
            out[redo] = _rescan(request, redo)
    return out


def _rescan(request: TopK, redo):
    """The ``K`` nearest of the queries ``request.rows[redo]`` by an ordered float64 scan of
    every reference, in the reference's order exactly (a stable sort: ties by index)."""
    xp = request.xp
    n_ref = request.reference.shape[0]
    r64_t = xp.ascontiguousarray(_rows64(xp, request.reference, request.metric).T)
    step = request.chunk_size or max(1, _BLOCK_BYTES // (3 * 8 * n_ref))
    out = xp.empty((redo.shape[0], request.n_keep), dtype=xp.int64)
    for f0 in range(0, redo.shape[0], step):
        rows = request.rows[redo[f0:f0 + step]]
        score = ordered_sq_distances(_rows64(xp, request.query[rows], request.metric), r64_t,
                                     xp=xp)
        if request.same_set:
            score[xp.arange(rows.shape[0]), rows] = np.inf
        out[f0:f0 + rows.shape[0]] = xp.argsort(score, axis=1, kind="stable")[:, :request.n_keep]
    return out

