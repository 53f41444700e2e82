"""Fast-path mirror of :func:`refdml.metrics.retrieval_metrics` (NumPy or CuPy, float32/64).

Same definitions, signature and result as the reference (read its module docstring:
P@1, R-precision, MAP@R, Recall@k over the queries with at least one true reference;
ranking by Euclidean distance or cosine similarity; ties broken by the lower reference
index; both sets divided by one power of two, or each row normalised, first).

**Implementations** (:data:`RETRIEVAL`, chosen once per call by :func:`refdml.gpu.use_kernels`;
each takes a :class:`TopK` request and returns the ``(n_rows, K)`` neighbours in the
reference's order):

``array``
    The array path below, NumPy or CuPy; ``"auto"`` on CuPy (on a GPU the old array path
    measured faster than the CUDA kernel; see :data:`RETRIEVAL`'s ``measured``).
``cpu``
    The compiled CPU twin :func:`refdml.gpu.metrics._compiled.nearest_cpu`, the reference's own
    path; ``"auto"`` on NumPy. It takes ``K <= MAX_KEEP`` (256) only: its sorted lists cost
    ``O(K)`` per insertion; beyond, :func:`_nearest` runs the array path instead (the one
    place where a chosen implementation declines: :meth:`_CpuTwin.takes`).
``cuda``
    The CUDA kernel :func:`refdml.gpu.metrics._cuda.nearest_cuda` (an ordered float64
    scan per query); only under ``use_kernels("cuda")``.

**The array path, stage 1: float32 candidates from one GEMM per block.** The scored
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
certificate of :mod:`refdml.gpu.metrics._compiled` shows: ``v_K' > t + 2 (delta_i + eta_i)``,
``t`` and ``v_K'`` the list's ``K``-th and last float32 scores, ``delta_i`` the bound
:func:`refdml.gpu.metrics._compiled.gemm_score_bound` derives for this GEMM's scores
(``|fl(q.r) - q.r| <= gamma_{d+1} sum_k |q_k r_k|`` for the float32 dot product, plus the
inputs' rounding to float32; under CuPy's TF32 mode, ``CUPY_TF32=1``, the bound takes the
inputs' 10-bit rounding) and ``eta_i`` the ordered sum's
(:func:`refdml.gpu.metrics._compiled.rerank_bound`). Candidates with
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

Precision: the neighbours are those of the float64 reference on the same values (for
float32 data: on the float32 inputs, taken exactly into float64), in either dtype, on every
CPU and every GEMM kernel: the certificate makes the product's rounding irrelevant, and the
re-rank's float64 operations are the reference's (CuPy's elementwise kernels round each
operation like NumPy's). The CUDA kernel may contract to FMA: see
:mod:`refdml.gpu.metrics._cuda`.

Synchronisations on CuPy (array path): the size of the top-K (``K = max(max_i R_i, max k)``,
needed for the shapes) and the check that some query has a true reference (one transfer for
both), the indices of the scored queries (one ``nonzero``), the queries whose certificate
failed (one ``nonzero`` per call, none when the list holds every reference), the returned
Python floats and ints (one transfer of the summed metrics at the end), and the data checks
of :mod:`refdml._validation`. None per block or per chunk.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.gpu._support.modes import Implementations
from refdml.gpu.metrics._compiled import (
    EXTRA, MAX_KEEP, gemm_score_bound, nearest_cpu, rerank_bound,
)
from refdml.gpu.metrics._cuda import nearest_cuda
from refdml._numerics import ordered_sq_distances, ordered_unit_rows
from refdml._shared.metrics import check_k
from refdml._validation import (
    as_fast_array, check_choice, check_nonzero_rows, check_scalar, fast_labels, result_dtype,
)
from refdml._backend import get_backend
from refdml.gpu.distances import common_scale

__all__ = ["retrieval_metrics"]

_METRICS = ("euclidean", "cosine")
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
#: Unit roundoff of the GEMM's inputs: IEEE float32, or TF32's 10 bits (with float32's
#: own rounding before it) when CuPy runs float32 products on tensor cores.
_F32_INPUT = 2.0**-24
_TF32_INPUT = 2.0**-10


# ------------------------------------------------------------------------ the seam


@dataclass(frozen=True)
class TopK:
    """One request to the family's implementations: the ``n_keep`` nearest references of
    each query ``query[rows[a]]``, in the reference's order (``refdml.metrics._nearest``'s
    contract).

    ``query``, ``reference``: ``(n, d)`` arrays of one module and dtype, already divided by
    the common power of two (Euclidean) or not yet normalised (cosine: each implementation
    makes its unit rows); in same-set mode ``reference is query`` and query ``rows[a]`` is
    never its own neighbour. ``rows``: int64 indices of the ranked queries. ``chunk_size``:
    queries per chunk (array path only), or None for the memory budget.
    """

    xp: Any
    query: Any
    rows: Any
    reference: Any
    n_keep: int
    same_set: bool
    metric: str
    chunk_size: int | None = None


class _ArrayPath:
    """The array path of this module (NumPy or CuPy)."""

    def takes(self, request: TopK) -> bool:
        return True

    def nearest(self, request: TopK) -> Any:
        return _nearest_array(request)


class _CpuTwin:
    """The compiled CPU twin (:func:`refdml.gpu.metrics._compiled.nearest_cpu`), NumPy only."""

    def takes(self, request: TopK) -> bool:
        # Its sorted lists cost O(K) per insertion and its re-rank O(K^2) per query.
        return request.n_keep <= MAX_KEEP

    def nearest(self, request: TopK) -> Any:
        return nearest_cpu(request.query, request.rows, request.reference, request.n_keep,
                           request.same_set, request.metric)


class _CudaKernel:
    """The CUDA kernel (:func:`refdml.gpu.metrics._cuda.nearest_cuda`)."""

    def takes(self, request: TopK) -> bool:
        return True

    def nearest(self, request: TopK) -> Any:
        return nearest_cuda(request.xp, request.query, request.rows, request.reference,
                            request.n_keep, request.same_set, request.metric)


#: The retrieval family's implementations, and the one chooser among them.
RETRIEVAL = Implementations(
    "metrics", array=_ArrayPath(), load_cpu=_CpuTwin, load_cuda=_CudaKernel,
    auto_numpy="cpu", auto_cupy="array",
    measured=("CuPy: H200, 2026-11-28 (/work/shared/gpu-runs/2026-11-28-h200), 10,000 queries "
              "x 1,000,000 references x 128, float32: array path 3.23 s, CUDA kernel 11.97 s. "
              "NumPy: the CPU twin is the reference's own path (docs/gpu.md, 'Numba kernels: "
              "greedy k-center and retrieval top-K', CPU numbers)."),
)


def _nearest(request: TopK) -> Any:
    """The neighbours by the implementation :data:`RETRIEVAL` chooses for this call."""
    implementation = RETRIEVAL.choose(request.query)
    if not implementation.takes(request):
        implementation = RETRIEVAL.array
    return implementation.nearest(request)


# ------------------------------------------------------------------------ the array path


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
        return cls(n_list, n_kept, n_blocks, width, levels, group, queries, rerank)


def _input_roundoff(xp) -> float:
    """Unit roundoff of the GEMM's inputs: CuPy with ``CUPY_TF32`` set (tensor-core float32
    products) rounds them to 10 bits; otherwise IEEE float32."""
    if xp is not np and os.environ.get("CUPY_TF32", "0") not in ("", "0"):
        return _TF32_INPUT
    return _F32_INPUT


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


def _nearest_array(request: TopK):
    """The array path (module docstring): float32 GEMM candidates, the certified float64
    re-rank, the exact rescan of the queries whose certificate fails."""
    xp = request.xp
    n_ref, d = request.reference.shape
    plan = _Plan.of(n_ref, d, request.n_keep, request.same_set,
                    request.query.dtype.itemsize, request.chunk_size)
    references, big_r = _gemm_references(xp, request.reference, request.metric, plan)
    queries = _gemm_queries(xp, request, references)
    top_s, top_j = _candidates(xp, queries, references, plan)
    del queries, references
    return _certified_rerank(request, plan, top_s, top_j, big_r)


def _certified_rerank(request: TopK, plan: _Plan, top_s, top_j, big_r):
    """Stage 2 (module docstring): the ``K`` nearest of each query by ``(S64, j)``, certified,
    and the failed queries rescanned."""
    xp = request.xp
    n_rows, d = request.rows.shape[0], request.query.shape[1]
    n_keep, n_kept = request.n_keep, plan.n_kept
    available = request.reference.shape[0] - (1 if request.same_set else 0)
    complete = n_kept >= available
    roundoff = _input_roundoff(xp)
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


# ------------------------------------------------------------------------ the public call


def retrieval_metrics(
    query, query_labels, reference=None, reference_labels=None, *,
    k=(1, 2, 4, 8), metric="euclidean", chunk_size=None,
) -> dict:
    """P@1, R-precision, MAP@R and Recall@k (see :func:`refdml.metrics.retrieval_metrics`).

    Parameters
    ----------
    query : (n_queries, d) NumPy or CuPy array (float32 stays float32)
    query_labels : (n_queries,) integer labels (same module)
    reference, reference_labels : (n_references, d), (n_references,), optional
        Omitted: same-set mode (each query removed from its own neighbours).
    k : int or sequence of int
    metric : {"euclidean", "cosine"}
    chunk_size : int, optional
        Queries per chunk of the array path (both stages); default: chunks whose
        temporaries fit ``_BLOCK_BYTES`` (512 MiB). The compiled twins choose their own.

    Returns
    -------
    dict
        The reference's keys and Python types (floats, and ints for the counts); see the
        module docstring for the synchronisations on CuPy.
    """
    ns = get_backend(query, query_labels, reference, reference_labels)
    xp = ns.xp
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or neither)")
    same_set = reference is None
    if same_set:
        query = as_fast_array(query, "query", ndim=2, ns=ns)
    else:
        dtype = result_dtype(query, reference)
        query = as_fast_array(query, "query", ndim=2, dtype=dtype, ns=ns)
    query_labels = fast_labels(query_labels, "query_labels", ns, length=query.shape[0])
    if same_set:
        reference, reference_labels = query, query_labels
    else:
        reference = as_fast_array(reference, "reference", ndim=2, dtype=query.dtype, ns=ns)
        reference_labels = fast_labels(reference_labels, "reference_labels", ns,
                                       length=reference.shape[0])
        if reference.shape[1] != query.shape[1]:
            raise ValueError(
                f"query has dimension {query.shape[1]} but reference has {reference.shape[1]}"
            )
    ks = check_k(k)
    metric = check_choice(metric, "metric", _METRICS)
    if metric == "cosine":
        why = "cosine similarity needs its direction"
        check_nonzero_rows(xp, query, "query", why=why, ns=ns)
        check_nonzero_rows(xp, reference, "reference", why=why, ns=ns)
    else:
        scale = common_scale(xp, query, reference)
        query = query / scale                       # exact; new arrays, inputs untouched
        reference = query if same_set else reference / scale
    n_ref = reference.shape[0]
    if chunk_size is not None:
        chunk_size = check_scalar(chunk_size, "chunk_size", low=1, integer=True)

    # References of each query's class, counted in the sorted labels (no unique: on CuPy
    # its size is data-dependent, a synchronisation).
    ordered = xp.sort(reference_labels)
    n_true = (xp.searchsorted(ordered, query_labels, side="right")
              - xp.searchsorted(ordered, query_labels, side="left"))
    if same_set:
        n_true = n_true - 1
    scored = n_true > 0
    # One transfer on CuPy: the check, and K (it sets the shapes).
    n_scored, largest_r = xp.stack([xp.count_nonzero(scored), xp.max(n_true)]).tolist()
    if n_scored == 0:
        raise ValueError(
            "no query has a true reference (every query's class is absent from the "
            "references, or of size 1 in same-set mode)"
        )
    available = n_ref - 1 if same_set else n_ref
    n_keep = min(max(int(largest_r), ks[-1]), available)

    scored_index = xp.nonzero(scored)[0]
    neighbours = _nearest(TopK(xp, query, scored_index, reference, n_keep, same_set, metric,
                               chunk_size))
    hits = reference_labels[neighbours] == query_labels[scored_index][:, None]
    r = n_true[scored_index]
    positions = xp.arange(1, n_keep + 1)
    hits_r = hits & (positions[None, :] <= r[:, None])
    precision_at_j = xp.cumsum(hits_r, axis=1) / positions
    sums = [
        xp.mean(hits[:, 0]),
        xp.mean(hits_r.sum(axis=1) / r),
        xp.mean(xp.sum(precision_at_j * hits_r, axis=1) / r),
    ]
    sums += [xp.mean(hits[:, : min(kk, n_keep)].any(axis=1)) for kk in ks]
    sums += [scored_index.size]
    values = xp.stack([xp.asarray(v, dtype=xp.float64) for v in sums]).tolist()  # one transfer
    result = {
        "precision_at_1": values[0],
        "r_precision": values[1],
        "mean_average_precision_at_r": values[2],
    }
    for i, kk in enumerate(ks):
        result[f"recall_at_{kk}"] = values[3 + i]
    n_scored = int(values[-1])
    result["n_queries"] = n_scored
    result["n_excluded_queries"] = int(query.shape[0] - n_scored)
    return result

#: The family's implementations (registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`).
IMPLEMENTATIONS = RETRIEVAL
