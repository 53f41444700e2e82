"""Retrieval and clustering metrics of deep metric learning.

Retrieval (:func:`retrieval_metrics`), with the definitions of Musgrave et al. 2020
("A metric learning reality check") and GSP supp. 1.6.3. For a query ``i`` let ``R_i``
be its number of true references (references of its class, itself excluded in
same-set mode) and ``c_i(j) = 1`` when its ``j``-th nearest reference is of its class:

``precision_at_1``               ``c_i(1)``
``r_precision``                  ``(1 / R_i) sum_{j <= R_i} c_i(j)``
``mean_average_precision_at_r``  ``(1 / R_i) sum_{j <= R_i} c_i(j) P_i(j)``, with
                                 ``P_i(j) = (1 / j) sum_{l <= j} c_i(l)`` the precision at ``j``
``recall_at_k``                  ``max_{j <= k} c_i(j)`` (at least one true reference among
                                 the ``k`` nearest: the "Recall@K" of Song et al. 2016)

each averaged over the queries with ``R_i >= 1``; queries with ``R_i = 0`` (a class of
size 1 in same-set mode, or a class absent from the reference set) are excluded and
counted. GSP supp. 1.6.3 prints ``P(i) = P@R_i`` inside MAP@R, which would make MAP@R
the square of the R-precision for every query with all hits in a block; the precision
at ``i`` of Musgrave et al. is what is meant and what is implemented.

Ranking is by Euclidean distance (or cosine similarity), ties broken by the lower
reference index. Distances are computed in chunks of queries with the Gram identity
``||r||^2 - 2 <q, r>`` (the query's own ``||q||^2`` does not change its ranking), and only
the ``K = max(max_i R_i, max k)`` nearest references of each query are kept, so memory
is ``O(chunk_size * n_references + n_queries * K)``, never ``n_queries * n_references``.
The Gram identity's rounding (about ``eps * ||q|| ||r||``) can swap two references whose
distances agree to that precision; exact ties (e.g. duplicated references) stay ties.

Clustering (:func:`clustering_metrics`, :func:`nmi`, :func:`f1`): k-means with as many
clusters as classes (``scipy.cluster.vq.kmeans2``, k-means++ seeding), then the
normalised mutual information ``NMI = 2 I(Y; C) / (H(Y) + H(C))`` and the pairwise F1 of
Song et al. 2016 (precision and recall of the "same cluster" decision over all pairs of
samples against "same class").
"""

from __future__ import annotations

import inspect

import numpy as np
from scipy.cluster.vq import kmeans2

from refdml._validation import (
    as_float_array,
    as_label_array,
    check_choice,
    check_rng,
    check_scalar,
)

__all__ = [
    "clustering_metrics",
    "f1",
    "nmi",
    "normalized_mutual_information",
    "pairwise_f1",
    "retrieval_metrics",
]

_METRICS = ("euclidean", "cosine")
# Bytes of the (chunk, n_references) score block; it and argpartition's int64 index array
# of the same shape are alive at once, so the peak is about twice this, plus the inputs.
_CHUNK_BYTES = 128 * 2**20


# --------------------------------------------------------------------------- retrieval


def _nearest(
    query: np.ndarray, rows: np.ndarray, reference: np.ndarray, n_keep: int, same_set: bool,
    metric: str, chunk_size: int,
) -> np.ndarray:
    """Indices of the ``n_keep`` nearest references of the queries ``query[rows]``.

    Nearest first, in lexicographic order of (score, reference index), with score the
    distance (or the negated cosine similarity). In same-set mode query ``rows[i]`` is
    reference ``rows[i]`` and is never returned. Rows are gathered per chunk, so no copy
    of the whole query set is made.
    """
    n_query = rows.size
    if metric == "euclidean":
        ref_sq = np.einsum("ij,ij->i", reference, reference)
    else:
        reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    out = np.empty((n_query, n_keep), dtype=np.int64)
    for start in range(0, n_query, chunk_size):
        stop = min(start + chunk_size, n_query)
        chunk_rows = rows[start:stop]
        block = query[chunk_rows]
        if metric == "euclidean":
            score = block @ reference.T
            score *= -2.0
            score += ref_sq
        else:
            score = block @ reference.T
            score /= -np.linalg.norm(block, axis=1, keepdims=True)
        if same_set:
            score[np.arange(stop - start), chunk_rows] = np.inf
        cols = _smallest(score, n_keep)
        kept = np.take_along_axis(score, cols, axis=1)
        order = np.lexsort((cols, kept), axis=1)
        out[start:stop] = np.take_along_axis(cols, order, axis=1)
        # Free this block before the next one is allocated: two alive would double the peak.
        del score, cols, kept, order
    return out


def _smallest(score: np.ndarray, n_keep: int) -> np.ndarray:
    """Column indices of the ``n_keep`` smallest scores per row, lowest index first on ties.

    The set does not depend on how ``argpartition`` orders equal values: where the
    ``n_keep``-th and the next smallest score are equal (a tie across the cut), the row
    keeps every score strictly below the cut value and fills the remaining places with
    the entries equal to it in index order.
    """
    if n_keep == score.shape[1]:
        return np.broadcast_to(np.arange(n_keep), score.shape).copy()
    part = np.argpartition(score, (n_keep - 1, n_keep), axis=1)
    cols = part[:, :n_keep].copy()
    last_kept = np.take_along_axis(score, part[:, n_keep - 1 : n_keep], axis=1)
    first_dropped = np.take_along_axis(score, part[:, n_keep : n_keep + 1], axis=1)
    del part
    tied = np.nonzero(last_kept[:, 0] == first_dropped[:, 0])[0]
    if tied.size:
        rows = score[tied]
        below = rows < last_kept[tied]
        equal = rows == last_kept[tied]
        room = n_keep - below.sum(axis=1, keepdims=True)
        keep = below | (equal & (np.cumsum(equal, axis=1) <= room))
        cols[tied] = np.nonzero(keep)[1].reshape(tied.size, n_keep)  # row-major: n_keep per row
    return cols


def _check_k(k) -> tuple[int, ...]:
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        k = (k,)
    try:
        values = tuple(k)
    except TypeError:
        raise TypeError(f"k must be an integer or a sequence of integers, got {k!r}") from None
    if not values:
        raise ValueError("k must not be empty")
    return tuple(sorted({check_scalar(v, "k", low=1, integer=True) for v in values}))


def retrieval_metrics(
    query, query_labels, reference=None, reference_labels=None, *,
    k=(1, 2, 4, 8), metric="euclidean", chunk_size=None,
) -> dict:
    """P@1, R-precision, MAP@R and Recall@k of a retrieval (see the module docstring).

    Parameters
    ----------
    query : array of shape (n_queries, d)
    query_labels : int array of shape (n_queries,)
    reference, reference_labels : arrays of shape (n_references, d), (n_references,), optional
        The searchable set (InShop gallery). Omitted: same-set mode, the queries are
        also the references and each query is removed from its own neighbours.
    k : int or sequence of int
        The ``recall_at_k`` to report (default 1, 2, 4, 8).
    metric : {"euclidean", "cosine"}
        Ranking by Euclidean distance or by cosine similarity.
    chunk_size : int, optional
        Queries per distance block; default: a block of about 32 MiB.

    Returns
    -------
    dict
        ``precision_at_1``, ``r_precision``, ``mean_average_precision_at_r``,
        ``recall_at_<k>`` for each ``k`` (floats), ``n_queries`` (queries scored) and
        ``n_excluded_queries`` (queries without any true reference; ints).

    Raises
    ------
    ValueError
        Mismatched lengths or dimensions, only one of ``reference`` and
        ``reference_labels``, or no query with a true reference.
    """
    query = as_float_array(query, "query", ndim=2)
    query_labels = as_label_array(query_labels, "query_labels", length=query.shape[0])
    if (reference is None) != (reference_labels is None):
        raise ValueError("reference and reference_labels must be given together (or neither)")
    same_set = reference is None
    if same_set:
        reference, reference_labels = query, query_labels
    else:
        reference = as_float_array(reference, "reference", ndim=2)
        reference_labels = as_label_array(
            reference_labels, "reference_labels", length=reference.shape[0]
        )
        if reference.shape[1] != query.shape[1]:
            raise ValueError(
                f"query has dimension {query.shape[1]} but reference has {reference.shape[1]}"
            )
    ks = _check_k(k)
    metric = check_choice(metric, "metric", _METRICS)
    if metric == "cosine":
        for array, name in ((query, "query"), (reference, "reference")):
            zero = ~np.any(array != 0.0, axis=1)
            if np.any(zero):
                raise ValueError(f"{name} has a zero vector at row {int(np.argmax(zero))}")
    n_ref = reference.shape[0]
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_BYTES // (8 * n_ref))
    else:
        chunk_size = check_scalar(chunk_size, "chunk_size", low=1, integer=True)

    classes, ref_counts = np.unique(reference_labels, return_counts=True)
    position = np.minimum(np.searchsorted(classes, query_labels), classes.size - 1)
    n_true = np.where(classes[position] == query_labels, ref_counts[position], 0)
    if same_set:
        n_true = n_true - 1
    scored = n_true > 0
    if not np.any(scored):
        raise ValueError(
            "no query has a true reference (every query's class is absent from the "
            "references, or of size 1 in same-set mode)"
        )
    available = n_ref - 1 if same_set else n_ref
    n_keep = min(max(int(n_true.max()), ks[-1]), available)

    # Only the scored queries are ranked.
    scored_index = np.nonzero(scored)[0]
    neighbours = _nearest(query, scored_index, reference, n_keep, same_set, metric, chunk_size)
    hits = reference_labels[neighbours] == query_labels[scored][:, None]   # (n_scored, K)
    r = n_true[scored]
    within_r = np.arange(1, n_keep + 1)[None, :] <= r[:, None]
    hits_r = hits & within_r
    precision_at_j = np.cumsum(hits_r, axis=1) / np.arange(1, n_keep + 1)
    result = {
        "precision_at_1": float(np.mean(hits[:, 0])),
        "r_precision": float(np.mean(hits_r.sum(axis=1) / r)),
        "mean_average_precision_at_r": float(
            np.mean(np.sum(precision_at_j * hits_r, axis=1) / r)
        ),
    }
    for kk in ks:
        result[f"recall_at_{kk}"] = float(np.mean(hits[:, : min(kk, n_keep)].any(axis=1)))
    result["n_queries"] = int(scored.sum())
    result["n_excluded_queries"] = int((~scored).sum())
    return result


# -------------------------------------------------------------------------- clustering


def _contingency(labels_true: np.ndarray, labels_pred: np.ndarray) -> np.ndarray:
    _, true_index = np.unique(labels_true, return_inverse=True)
    _, pred_index = np.unique(labels_pred, return_inverse=True)
    table = np.zeros((true_index.max() + 1, pred_index.max() + 1), dtype=np.int64)
    np.add.at(table, (true_index, pred_index), 1)
    return table


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-np.sum(p * np.log(p)))


def _check_partitions(labels_true, labels_pred) -> tuple[np.ndarray, np.ndarray]:
    labels_true = as_label_array(labels_true, "labels_true")
    labels_pred = as_label_array(labels_pred, "labels_pred", length=labels_true.shape[0])
    if labels_true.size == 0:
        raise ValueError("labels_true must not be empty")
    return labels_true, labels_pred


def normalized_mutual_information(labels_true, labels_pred) -> float:
    """``NMI = 2 I(Y; C) / (H(Y) + H(C))`` between two partitions (natural log).

    The arithmetic-mean normalisation of Manning et al. 2008, used by Song et al. 2016.
    When both partitions are a single block (``H(Y) = H(C) = 0``) they agree: NMI = 1.
    """
    labels_true, labels_pred = _check_partitions(labels_true, labels_pred)
    table = _contingency(labels_true, labels_pred)
    n = table.sum()
    h_true = _entropy(table.sum(axis=1))
    h_pred = _entropy(table.sum(axis=0))
    if h_true + h_pred == 0.0:
        return 1.0
    joint = table[table > 0] / n
    outer = np.outer(table.sum(axis=1), table.sum(axis=0))[table > 0] / n**2
    mutual = float(np.sum(joint * np.log(joint / outer)))
    return float(np.clip(2.0 * mutual / (h_true + h_pred), 0.0, 1.0))


def pairwise_f1(labels_true, labels_pred) -> float:
    """F1 of the "same cluster" decision over all unordered pairs (Song et al. 2016).

    ``TP`` = pairs in the same class and the same cluster; precision ``TP / (pairs in the
    same cluster)``, recall ``TP / (pairs in the same class)``. With no pair in the same
    cluster (or class) the precision (recall) is 0, and so is F1 when ``TP = 0``.
    """
    labels_true, labels_pred = _check_partitions(labels_true, labels_pred)
    table = _contingency(labels_true, labels_pred)

    def pairs(counts):
        return float(np.sum(counts * (counts - 1)) / 2)

    true_positive = pairs(table)
    if true_positive == 0.0:
        return 0.0
    precision = true_positive / pairs(table.sum(axis=0))
    recall = true_positive / pairs(table.sum(axis=1))
    return 2.0 * precision * recall / (precision + recall)


# SciPy >= 1.15 takes `rng`; older versions take the same Generator as `seed`.
_KMEANS_RNG = "rng" if "rng" in inspect.signature(kmeans2).parameters else "seed"


def clustering_metrics(embeddings, labels, *, rng=None, kmeans_iter=20) -> dict:
    """NMI and pairwise F1 of a k-means clustering with as many clusters as classes.

    ``scipy.cluster.vq.kmeans2`` with k-means++ seeding from ``rng`` runs exactly
    ``kmeans_iter`` Lloyd iterations (it has no convergence test of its own); SciPy warns
    (``UserWarning``) if a cluster ends up empty. Returns ``{"nmi", "f1", "n_clusters"}``.
    """
    x = as_float_array(embeddings, "embeddings", ndim=2)
    y = as_label_array(labels, "labels", length=x.shape[0])
    kmeans_iter = check_scalar(kmeans_iter, "kmeans_iter", low=1, integer=True)
    rng = check_rng(rng)
    n_clusters = int(np.unique(y).size)
    if n_clusters == 1:
        clusters = np.zeros(x.shape[0], dtype=np.int64)
    else:
        _, clusters = kmeans2(x, n_clusters, iter=kmeans_iter, minit="++", **{_KMEANS_RNG: rng})
    return {
        "nmi": normalized_mutual_information(y, clusters),
        "f1": pairwise_f1(y, clusters),
        "n_clusters": n_clusters,
    }


def nmi(embeddings, labels, *, rng=None, kmeans_iter=20) -> float:
    """NMI of a k-means clustering of ``embeddings``; see :func:`clustering_metrics`."""
    return clustering_metrics(embeddings, labels, rng=rng, kmeans_iter=kmeans_iter)["nmi"]


def f1(embeddings, labels, *, rng=None, kmeans_iter=20) -> float:
    """Pairwise F1 of a k-means clustering of ``embeddings``; see :func:`clustering_metrics`."""
    return clustering_metrics(embeddings, labels, rng=rng, kmeans_iter=kmeans_iter)["f1"]
