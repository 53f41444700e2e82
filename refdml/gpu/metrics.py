"""Fast-path mirror of :func:`refdml.metrics.retrieval_metrics` (NumPy or CuPy, float32/64).

Same definitions, signature and result as the reference (read its module docstring:
P@1, R-precision, MAP@R, Recall@k over the queries with at least one true reference;
ranking by Euclidean distance or cosine similarity; ties broken by the lower reference
index; both sets divided by one power of two, or each row normalised, first).

Blocked, with a running top-K, then certified and re-ranked: queries in blocks of
``chunk_size``, references in blocks of ``_REFERENCE_BLOCK``; for each (query block,
reference block) the scores

.. math::
    s_{ij} = |r_j|^2 - 2 \\langle q_i, r_j \\rangle

(one matrix product in the data's dtype; for cosine the rows are first made unit by
:func:`refdml._numerics.ordered_unit_rows`) give the block's own ``K' = K + EXTRA``
smallest by ``argpartition`` (rows where the cut value has equal scores left out are
redone exactly, as ``refdml.metrics._smallest`` does), merged with the running ``K'`` best
``(score, index)`` pairs by a stable sort of ``[running K' | block's K' in index order]``.
A matrix product's last bits depend on the BLAS (or cuBLAS) kernel and on where a row
sits in the product, so these scores only choose candidates: the answer is the
reference's ranking by the ordered float64 score, computed for the ``K'`` candidates
with the operations of :func:`refdml._numerics.ordered_sq_distances`, after the
certificate of :mod:`refdml._compiled.retrieval` (with the data dtype's rounding) has shown
that the candidates hold every true neighbour; a query whose certificate fails is redone
by an ordered scan of all references. No Python loop over queries or references.
Memory: ``O(chunk_size * _REFERENCE_BLOCK)`` plus the inputs.

Kernels (:func:`refdml.gpu.use_kernels`): with ``"auto"`` a NumPy input runs the compiled CPU
twin (the same two stages compiled; see :mod:`refdml._compiled.retrieval`), a CuPy input
the CUDA kernel (an ordered float64 scan per query); ``"array"`` runs the array code
described here, and so does the CPU mode where ``K`` exceeds ``MAX_KEEP`` (256).

Precision: the neighbours are those of the float64 reference on the same values (for
float32 data: on the float32 inputs, taken exactly into float64), in either dtype and on
every CPU: the certificate makes the matrix product's rounding irrelevant, and the
re-rank's float64 operations are the reference's. (On a GPU, CuPy's elementwise kernels
round each operation like NumPy's; the CUDA kernel may contract to FMA: see
:mod:`refdml._compiled.retrieval`.)

Synchronisations on CuPy: the size of the top-K (``K = max(max_i R_i, max k)``, needed
for the shapes) and the check that some query has a true reference (one transfer for
both), the indices of the scored queries (one ``nonzero``), one
per (query block, reference block) to learn whether any row has a tie across the cut
(``bool(any(tied))``; the redo of those rows needs their count), the
returned Python floats and ints (one transfer of the summed metrics at the end), and the
data checks of :mod:`refdml._validation`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._compiled._support import select_kernel
from refdml._compiled.retrieval import EXTRA, MAX_KEEP, nearest_cpu
from refdml._numerics import ordered_sq_distances, ordered_unit_rows
from refdml._validation import (
    as_fast_array, check_choice, check_nonzero_rows, check_scalar, fast_labels, result_dtype,
)
from refdml._xp import array_namespace
from refdml._compiled.retrieval_cuda import nearest_cuda
from refdml.gpu.distances import common_scale
from refdml.metrics import _check_k

__all__ = ["retrieval_metrics"]

_METRICS = ("euclidean", "cosine")
_CHUNK_BYTES = 128 * 2**20     # bytes of one (query block, K + reference block) score array
_REFERENCE_BLOCK = 16384       # references per block of the running top-K


def _smallest(xp: Any, score: Any, n_keep: int) -> Any:
    """Columns of the ``n_keep`` smallest scores per row, lowest index first on ties, sorted
    by column (``refdml.metrics._smallest``: ``argpartition``, then the rows whose cut
    value ``t`` has equal scores left out are redone: keep every score below ``t``, then
    the equal ones in index order)."""
    b, width = score.shape
    if width <= n_keep:
        return xp.broadcast_to(xp.arange(width, dtype=xp.int64), (b, width))
    part = xp.argpartition(score, n_keep - 1, axis=1)[:, :n_keep]
    kept = xp.take_along_axis(score, part, axis=1)
    t = xp.max(kept, axis=1, keepdims=True)              # the n_keep-th smallest score
    tied = xp.sum(score == t, axis=1) > xp.sum(kept == t, axis=1)
    if bool(xp.any(tied)):   # a sync per block on CuPy: rare rows, redone exactly
        rows = xp.nonzero(tied)[0]
        sub, cut = score[rows], t[rows]
        below, equal = sub < cut, sub == cut
        room = n_keep - xp.sum(below, axis=1, keepdims=True)
        keep = below | (equal & (xp.cumsum(equal, axis=1) <= room))
        part[rows] = xp.nonzero(keep)[1].reshape(rows.shape[0], n_keep)
    return xp.sort(part, axis=1)


def _merge(xp: Any, top: Any, top_idx: Any, score: Any, r0: int, n_keep: int):
    """The running top-K merged with a block's own top-K, in (score, index) order.

    The candidates are ``[running K | block's K in index order]``: among equal scores
    column order is index order, so a stable sort by score is the lexicographic order.
    """
    cols = _smallest(xp, score, n_keep)
    cand = xp.concatenate([top, xp.take_along_axis(score, cols, axis=1)], axis=1)
    cand_idx = xp.concatenate([top_idx, cols + r0], axis=1)
    order = xp.argsort(cand, axis=1, kind="stable")[:, :n_keep]
    return xp.take_along_axis(cand, order, axis=1), xp.take_along_axis(cand_idx, order, axis=1)


def _nearest(xp, query, rows, reference, n_keep, same_set, metric, chunk_size):
    """(n_rows, n_keep) indices of the nearest references of ``query[rows]``, in order.

    Dispatch (:func:`refdml.gpu.use_kernels`): the compiled CPU twin or the CUDA kernel of
    :mod:`refdml._compiled.retrieval`, else the array path below.
    """
    kernel = select_kernel(query, has_cpu=n_keep <= MAX_KEEP)
    if kernel == "cpu":
        return nearest_cpu(query, rows, reference, n_keep, same_set, metric)
    if kernel == "cuda":
        return nearest_cuda(xp, query, rows, reference, n_keep, same_set, metric)
    return _nearest_array(xp, query, rows, reference, n_keep, same_set, metric, chunk_size)


def _nearest_array(xp, query, rows, reference, n_keep, same_set, metric, chunk_size):
    """The array path: matrix-product candidates, certified and re-ranked by the ordered score.

    Stage 1: blocks of queries and references, ``s = |r|^2 - 2 <q, r>`` by one matrix
    product in the data's dtype, argpartition and a stable merge into the running
    ``K' = K + EXTRA`` best. Stage 2 (:func:`_certified_rerank`): the certificate and the
    ordered float64 re-rank of :mod:`refdml._compiled.retrieval`, in array code.
    """
    dtype = query.dtype
    r64 = reference.astype(xp.float64)
    if metric == "cosine":
        r64 = ordered_unit_rows(r64, xp=xp)
    r_data = r64 if dtype == xp.float64 else r64.astype(dtype)
    ref_sq = xp.einsum("ij,ij->i", r_data, r_data)
    r64_t = xp.ascontiguousarray(r64.T)
    n_ref = r64.shape[0]
    available = n_ref - 1 if same_set else n_ref
    n_kept = min(n_keep + EXTRA, available)
    big_r = xp.sqrt(xp.max(ref_sq.astype(xp.float64)))
    out = xp.empty((rows.shape[0], n_keep), dtype=xp.int64)
    for start in range(0, rows.shape[0], chunk_size):
        chunk_rows = rows[start:start + chunk_size]
        block64 = query[chunk_rows].astype(xp.float64)
        if metric == "cosine":
            block64 = ordered_unit_rows(block64, xp=xp)   # row by row: the reference's bits
        block = block64 if dtype == xp.float64 else block64.astype(dtype)
        b = block.shape[0]
        top = xp.full((b, n_kept), np.inf, dtype=dtype)   # placeholders lose to all
        top_idx = xp.full((b, n_kept), -1, dtype=xp.int64)
        for r0 in range(0, n_ref, _REFERENCE_BLOCK):
            r1 = min(r0 + _REFERENCE_BLOCK, n_ref)
            score = block @ r_data[r0:r1].T
            score *= -2.0
            score += ref_sq[r0:r1]
            if same_set:
                own = chunk_rows - r0
                inside = (own >= 0) & (own < r1 - r0)
                # The query itself: +inf (a no-op write to column 0 for queries outside).
                score[xp.arange(b), xp.where(inside, own, 0)] = xp.where(
                    inside, np.inf, score[xp.arange(b), 0])
            top, top_idx = _merge(xp, top, top_idx, score, r0, n_kept)
        out[start:start + b] = _certified_rerank(
            xp, block64, chunk_rows if same_set else None, r64_t, top, top_idx, n_keep,
            n_kept >= available, big_r)
    return out


def _certified_rerank(xp, q64, own, r64_t, top, top_idx, n_keep, complete, big_r):
    """The ``n_keep`` nearest of each query by ``(S64, j)``, ``S64`` the ordered score.

    ``top`` / ``top_idx``: the ``K'`` smallest matrix-product scores (ascending) and their
    references. Where the certificate of :mod:`refdml._compiled.retrieval` holds (``v_K' >
    t + 2 (delta + eta)``, with ``delta`` the bound of the data's dtype: its unit roundoff
    and smallest normal in place of float32's; or the list holds every reference) the
    candidates are re-ranked by the ordered float64 score, the operations of
    :func:`refdml._numerics.ordered_sq_distances` on gathered columns; the other queries
    are redone by an ordered scan of every reference. ``own``: the queries' own reference
    indices in same-set mode (never returned), else None.
    """
    info = np.finfo(top.dtype)
    u, tiny = float(info.eps) / 2, float(info.tiny)
    d = q64.shape[1]
    q_norm = xp.sqrt(xp.einsum("ij,ij->i", q64, q64))   # bounds only: any order will do
    delta = 2.0 * ((2 * d + 12) * u * q_norm * big_r + 3 * u * big_r**2 + (4 * d + 8) * tiny)
    delta += 2.0 * (d + 2) * 2.0**-53 * (q_norm + big_r) ** 2 + d * 2.0**-1070
    acc = xp.zeros(top_idx.shape, dtype=xp.float64)
    step = xp.empty_like(acc)
    for k in range(d):
        xp.subtract(q64[:, k, None], r64_t[k][top_idx], out=step)
        xp.multiply(step, step, out=step)
        xp.add(acc, step, out=acc)
    by_index = xp.argsort(top_idx, axis=1)            # (S64, j) order: j first, then stable
    idx = xp.take_along_axis(top_idx, by_index, axis=1)
    acc = xp.take_along_axis(acc, by_index, axis=1)
    order = xp.argsort(acc, axis=1, kind="stable")[:, :n_keep]
    result = xp.take_along_axis(idx, order, axis=1)
    if complete:
        return result
    last = top[:, -1].astype(xp.float64)
    kth = top[:, n_keep - 1].astype(xp.float64)
    failed = xp.nonzero(~(last > kth + 2.0 * delta))[0]
    if failed.shape[0]:   # a sync on CuPy; rare queries, redone in row chunks
        n_ref = r64_t.shape[1]
        step_rows = max(1, _CHUNK_BYTES // (3 * 8 * n_ref))
        for f0 in range(0, failed.shape[0], step_rows):
            sub = failed[f0:f0 + step_rows]
            score = ordered_sq_distances(q64[sub], r64_t, xp=xp)
            if own is not None:
                score[xp.arange(sub.shape[0]), own[sub]] = np.inf
            cols = _smallest(xp, score, n_keep)        # sorted by index
            kept = xp.take_along_axis(score, cols, axis=1)
            pick = xp.argsort(kept, axis=1, kind="stable")
            result[sub] = xp.take_along_axis(cols, pick, axis=1)
    return result


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
        Queries per block; default: a score block of about 128 MiB.

    Returns
    -------
    dict
        The reference's keys and Python types (floats, and ints for the counts); see the
        module docstring for the synchronisations on CuPy.
    """
    ns = array_namespace(query, query_labels, reference, reference_labels)
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
    ks = _check_k(k)
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
    if chunk_size is None:
        width = min(n_ref, _REFERENCE_BLOCK)
        chunk_size = max(1, _CHUNK_BYTES // (query.dtype.itemsize * 3 * width))
    else:
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
    neighbours = _nearest(xp, query, scored_index, reference, n_keep, same_set, metric,
                          chunk_size)
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
