"""The public mirror of the retrieval metrics: validate once, choose the implementation
once, read straight through (the family's docstring: :mod:`refdml.gpu.metrics`)."""

from __future__ import annotations

from refdml._backend import get_backend
from refdml._shared.metrics import check_k
from refdml._validation import (
    as_fast_array, check_choice, check_nonzero_rows, check_scalar, fast_labels, result_dtype,
)
from refdml.gpu.distances import common_scale
from refdml.gpu.metrics._array import TopK
from refdml.gpu.metrics._kernels import IMPLEMENTATIONS

__all__ = ["retrieval_metrics"]

_METRICS = ("euclidean", "cosine")


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
        temporaries fit 512 MiB (:mod:`refdml.gpu.metrics._array`). The compiled twins
        choose their own.

    Returns
    -------
    dict
        The reference's keys and Python types (floats, and ints for the counts); see the
        docstring of :mod:`refdml.gpu.metrics` for the synchronisations on CuPy.
    """
    backend = get_backend(query, query_labels, reference, reference_labels)
    xp = backend.xp
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or neither)")
    same_set = reference is None
    if same_set:
        query = as_fast_array(query, "query", ndim=2, ns=backend)
    else:
        dtype = result_dtype(query, reference)
        query = as_fast_array(query, "query", ndim=2, dtype=dtype, ns=backend)
    query_labels = fast_labels(query_labels, "query_labels", backend, length=query.shape[0])
    if same_set:
        reference, reference_labels = query, query_labels
    else:
        reference = as_fast_array(reference, "reference", ndim=2, dtype=query.dtype, ns=backend)
        reference_labels = fast_labels(reference_labels, "reference_labels", backend,
                                       length=reference.shape[0])
        if reference.shape[1] != query.shape[1]:
            raise ValueError(
                f"query has dimension {query.shape[1]} but reference has {reference.shape[1]}"
            )
    ks = check_k(k)
    metric = check_choice(metric, "metric", _METRICS)
    if metric == "cosine":
        why = "cosine similarity needs its direction"
        check_nonzero_rows(xp, query, "query", why=why, ns=backend)
        check_nonzero_rows(xp, reference, "reference", why=why, ns=backend)
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
    request = TopK(backend=backend, query=query, rows=scored_index, reference=reference,
                   n_keep=n_keep, same_set=same_set, metric=metric, chunk_size=chunk_size)
    implementation = IMPLEMENTATIONS.choose(query)
    if not implementation.takes(request):     # the CPU twin's K <= MAX_KEEP
        implementation = IMPLEMENTATIONS.array
    neighbours = implementation.nearest(request)
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
