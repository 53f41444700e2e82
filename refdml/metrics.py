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
reference index. Both sets are first divided by one power of two (exact); for cosine each
row is made a unit vector, and the unit rows are ranked by their Euclidean distance, which
orders the pairs exactly as the cosine similarity does (``|q^ - r^|^2 = 2 - 2 cos``) and
resolves near neighbours better than ``1 - cos`` would. So the metrics are the same for
embeddings of any magnitude (1e-300 .. 1e300).

**The same ranking on every machine.** The score of a pair is
:func:`refdml._numerics.ordered_sq_distances`: ``sum_k (q_k - r_k)^2`` summed in the
order ``k = 0, 1, ..., d - 1``, one correctly rounded IEEE operation per step, no BLAS and
no fused multiply-add (cosine's unit rows likewise by
:func:`refdml._numerics.ordered_unit_rows`). Its value is a function of the two rows
alone, not of the CPU, the BLAS kernel, the thread count or where the rows sit in their
arrays, so identical rows give identical scores (exact ties, resolved by the lower index)
and two references whose distances agree to rounding are ordered the same way
everywhere. A matrix product would not do: BLAS kernels sum the dot products in an order
that depends on the CPU (OpenBLAS picks its kernel at run time) and on a row's position
in the blocked product, so two identical references could come out with different last
bits (seen with OpenBLAS's SkylakeX kernels) and swap. Only the
``K = max(max_i R_i, max k)`` nearest references of each query are kept, in chunks of
queries, so memory is ``O(chunk_size * n_references + n_queries * K)``, never
``n_queries * n_references``.

The ranking (``_nearest``: the ordered score block per chunk of queries, ``argpartition``,
a lexicographic sort of the kept columns) is the readable statement. Its compiled twins are
the fast path's, :func:`refdml.gpu.metrics.retrieval_metrics` (a Numba CPU twin: float32
tiles merged into a running top-``(K + 32)`` per query, re-ranked by the same ordered
float64 score and certified by a rounding bound; and a CUDA kernel), held to this module by
tests/gpu/test_gpu_kernels_retrieval.py (fixed seeds and hypothesis inputs: equal
neighbours and equal metrics, by construction on every CPU). Use that one for large sets.

Clustering of embeddings (:func:`clustering_metrics`): k-means with as many clusters as
classes (``scipy.cluster.vq.kmeans2``, k-means++ seeding), then three scores of the
classes ``Y`` against the clusters ``C``, each also a function of two partitions:

``normalized_mutual_information``  ``NMI = 2 I(Y; C) / (H(Y) + H(C))`` (Manning et al. 2008)
``adjusted_mutual_information``    ``AMI = (I - E[I]) / ((H(Y) + H(C)) / 2 - E[I])``, chance
                                   corrected under the hypergeometric model (Vinh et al.
                                   2010), as scikit-learn and pytorch-metric-learning report it
``pairwise_f1``                    F1 of the "same cluster" decision over all pairs of
                                   samples against "same class" (Song et al. 2016)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
from scipy.cluster.vq import kmeans2
from scipy.special import gammaln

from refdml._numerics import (
    check_nonzero_rows,
    common_scale,
    ordered_sq_distances,
    ordered_unit_rows,
)
from refdml._validation import (
    as_float_array,
    as_label_array,
    check_choice,
    check_rng,
    check_scalar,
)

__all__ = [
    "adjusted_mutual_information",
    "clustering_metrics",
    "normalized_mutual_information",
    "pairwise_f1",
    "retrieval_metrics",
]

_METRICS = ("euclidean", "cosine")
# Bytes of the (chunk, n_references) score block; its work buffer and argpartition's int64
# index array have the same shape, so the peak is about three times this, plus the inputs.
_CHUNK_BYTES = 128 * 2**20


# --------------------------------------------------------------------------- retrieval


def _nearest(
    query: np.ndarray, rows: np.ndarray, reference: np.ndarray, n_keep: int, same_set: bool,
    metric: str, chunk_size: int,
) -> np.ndarray:
    """Indices of the ``n_keep`` nearest references of the queries ``query[rows]``.

    Nearest first, in lexicographic order of (score, reference index), the score being
    :func:`refdml._numerics.ordered_sq_distances` of the rows (for cosine, of the rows
    made unit by :func:`refdml._numerics.ordered_unit_rows`): a fixed sequence of IEEE
    operations, so every machine ranks alike (module docstring, "Ranking"). In same-set
    mode query ``rows[i]`` is reference ``rows[i]`` and is never returned. Rows are
    gathered per chunk, so no copy of the whole query set is made.
    """
    n_query = rows.size
    if metric == "cosine":
        reference = ordered_unit_rows(reference)
    reference_t = np.ascontiguousarray(reference.T)
    out = np.empty((n_query, n_keep), dtype=np.int64)
    for start in range(0, n_query, chunk_size):
        stop = min(start + chunk_size, n_query)
        chunk_rows = rows[start:stop]
        block = query[chunk_rows]
        if metric == "cosine":
            block = ordered_unit_rows(block)   # row by row: same bits as in ``reference``
        score = ordered_sq_distances(block, reference_t)
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

    The readable NumPy ranking (module docstring); for large sets
    :func:`refdml.gpu.metrics.retrieval_metrics` computes the same metrics with compiled
    twins.

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
        Queries per score block; default: a block of about 128 MiB (the readable ranking's
        peak is about three times that).

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
    return _retrieval_metrics(query, query_labels, reference, reference_labels, k, metric,
                              chunk_size)


def _retrieval_metrics(query, query_labels, reference, reference_labels, k, metric,
                       chunk_size) -> dict:
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
        check_nonzero_rows(query, "query", why="cosine similarity needs its direction")
        check_nonzero_rows(reference, "reference", why="cosine similarity needs its direction")
    else:
        # Ranking by distance is invariant to a common scaling; a power of two brings the
        # largest entry to [0.5, 1) exactly, so the squares neither overflow (1e200) nor
        # underflow (1e-300). Both arrays are our own copies (as_float_array).
        scale = common_scale(query, reference)
        query /= scale
        if not same_set:
            reference /= scale
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


@dataclass(frozen=True)
class _Contingency:
    """The contingency table of two partitions, kept sparse: ``O(n)`` memory, where the
    dense ``(n_classes, n_clusters)`` table would be 1 GiB at the SOP test split."""

    cells: np.ndarray   # the nonzero counts n_ij
    rows: np.ndarray    # a_i = sum_j n_ij (class sizes)
    cols: np.ndarray    # b_j = sum_i n_ij (cluster sizes)
    rows_of_cells: np.ndarray  # a_i of each cell
    cols_of_cells: np.ndarray  # b_j of each cell


def _contingency(labels_true: np.ndarray, labels_pred: np.ndarray) -> _Contingency:
    _, true_index, rows = np.unique(labels_true, return_inverse=True, return_counts=True)
    _, pred_index, cols = np.unique(labels_pred, return_inverse=True, return_counts=True)
    pair, cells = np.unique(true_index * cols.size + pred_index, return_counts=True)
    return _Contingency(cells, rows, cols, rows[pair // cols.size], cols[pair % cols.size])


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-np.sum(p * np.log(p)))


def _mutual_information(table: _Contingency) -> float:
    """``I(Y; C) = sum_ij (n_ij / n) log(n n_ij / (a_i b_j))`` (natural log)."""
    n = float(table.rows.sum())
    joint = table.cells / n
    outer = (table.rows_of_cells / n) * (table.cols_of_cells / n)
    return float(np.sum(joint * np.log(joint / outer)))


def _expected_mutual_information(a: np.ndarray, b: np.ndarray) -> float:
    """``E[I(Y; C)]`` over random partitions with the row sums ``a`` and column sums ``b``.

    Under the hypergeometric model (Vinh, Epps & Bailey 2010, Eq. 24a) cell ``(i, j)``
    holds ``n_ij`` with probability ``C(b_j, n_ij) C(n - b_j, a_i - n_ij) / C(n, a_i)``:

    .. math::
        E[I] = \\sum_{i,j} \\sum_{n_{ij} = \\max(1, a_i + b_j - n)}^{\\min(a_i, b_j)}
               \\frac{n_{ij}}{n} \\log\\frac{n\\, n_{ij}}{a_i b_j}
               \\frac{a_i!\\, b_j!\\, (n - a_i)!\\, (n - b_j)!}
                    {n!\\, n_{ij}!\\, (a_i - n_{ij})!\\, (b_j - n_{ij})!\\,
                     (n - a_i - b_j + n_{ij})!}

    with the factorials as ``exp(sum of gammaln)``. The summand depends on ``(a_i, b_j)``
    only, so the sum runs over the distinct sizes, each weighted by how often it occurs.
    """
    n = int(a.sum())
    sizes_a, count_a = np.unique(a, return_counts=True)
    sizes_b, count_b = np.unique(b, return_counts=True)
    bj = sizes_b[None, :].astype(np.float64)
    total = 0.0
    for ai, weight in zip(sizes_a.astype(np.float64), count_a):
        nij = np.arange(1.0, min(ai, sizes_b.max()) + 1.0)[:, None]
        valid = (nij <= bj) & (nij >= ai + bj - n)
        # Invalid cells get harmless arguments; they are masked out below.
        nij_v = np.where(valid, nij, 1.0)
        bj_v = np.where(valid, bj, ai)
        log_p = (
            gammaln(ai + 1) + gammaln(bj_v + 1) + gammaln(n - ai + 1) + gammaln(n - bj_v + 1)
            - gammaln(n + 1) - gammaln(nij_v + 1) - gammaln(ai - nij_v + 1)
            - gammaln(bj_v - nij_v + 1) - gammaln(n - ai - bj_v + nij_v + 1)
        )
        term = nij_v / n * np.log(n * nij_v / (ai * bj_v)) * np.exp(log_p)
        total += weight * float(np.sum(np.where(valid, term, 0.0).sum(axis=0) * count_b))
    return total


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
    h_true = _entropy(table.rows)
    h_pred = _entropy(table.cols)
    if h_true + h_pred == 0.0:
        return 1.0
    mutual = _mutual_information(table)
    return float(np.clip(2.0 * mutual / (h_true + h_pred), 0.0, 1.0))


def adjusted_mutual_information(labels_true, labels_pred) -> float:
    """Mutual information adjusted for chance (Vinh, Epps & Bailey 2010), natural log.

    .. math::
        \\mathrm{AMI} = \\frac{I(Y; C) - E[I]}{\\tfrac12 (H(Y) + H(C)) - E[I]}

    with ``E[I]`` the expected mutual information of two random partitions with the
    same cluster sizes (the hypergeometric model; see :func:`_expected_mutual_information`).
    The arithmetic mean in the denominator is the default of scikit-learn's
    ``adjusted_mutual_info_score``, which pytorch-metric-learning reports as "AMI".
    AMI is 1 for identical partitions (up to relabelling), about 0 (either sign) for
    independent ones, and symmetric in its arguments.

    Where the denominator vanishes the marginals admit only one value of ``I``, so
    there is no chance to correct for: this happens only when both partitions are one
    block, or both put every sample in its own block; the partitions then coincide and
    AMI is 1 (scikit-learn returns 1 for the first case).
    """
    labels_true, labels_pred = _check_partitions(labels_true, labels_pred)
    table = _contingency(labels_true, labels_pred)
    n = labels_true.size
    if table.rows.size == table.cols.size and table.rows.size in (1, n):
        return 1.0
    a, b = table.rows, table.cols
    mutual = _mutual_information(table)
    expected = _expected_mutual_information(a, b)
    denominator = 0.5 * (_entropy(a) + _entropy(b)) - expected
    # E[I] <= mean entropy; rounding can make the difference a tiny number of either sign.
    eps = np.finfo(np.float64).eps
    denominator = min(denominator, -eps) if denominator < 0 else max(denominator, eps)
    return float((mutual - expected) / denominator)


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

    true_positive = pairs(table.cells)
    if true_positive == 0.0:
        return 0.0
    precision = true_positive / pairs(table.cols)
    recall = true_positive / pairs(table.rows)
    return 2.0 * precision * recall / (precision + recall)


# SciPy >= 1.15 takes `rng`; older versions take the same Generator as `seed`.
_KMEANS_RNG = "rng" if "rng" in inspect.signature(kmeans2).parameters else "seed"


def clustering_metrics(embeddings, labels, *, rng=None, kmeans_iter=20) -> dict:
    """NMI, AMI and pairwise F1 of a k-means clustering with as many clusters as classes.

    Parameters
    ----------
    embeddings : array of shape (n, d)
    labels : int array of shape (n,)
    rng : None, int or numpy Generator
        Seeds the k-means++ initialisation.
    kmeans_iter : int
        Lloyd iterations of ``scipy.cluster.vq.kmeans2`` at most: refdml stops early at a
        fixed point (centroids unchanged, bit for bit), where every further iteration would
        change nothing, so the result is that of exactly ``kmeans_iter`` iterations and a
        huge value cannot run forever (SciPy's own loop has no convergence test). SciPy
        warns (``UserWarning``) if a cluster ends up empty.

    Returns
    -------
    dict
        ``nmi`` (:func:`normalized_mutual_information`), ``ami``
        (:func:`adjusted_mutual_information`), ``f1`` (:func:`pairwise_f1`), all of the
        classes against the clusters, and ``n_clusters``.

    K-means is invariant to a common scaling of the embeddings, so they are first
    divided by a power of two that brings the largest entry to [0.5, 1) (exact): the
    clusters are the same at any scale, and SciPy's k-means++ never sees squared
    distances that overflow (at |x| ~ 1e154 it would otherwise divide inf by inf and
    crash the interpreter) or underflow to 0.

    With no more distinct embeddings than classes, the optimal k-means clustering is known
    (each distinct point its own cluster, zero inertia) and is returned without k-means
    (whose ++ seeding would divide zero by zero). If distinct points are so close that
    their squared distances underflow even after the scaling, the seeding cannot proceed
    and a ValueError names ``embeddings``.
    """
    x = as_float_array(embeddings, "embeddings", ndim=2)
    y = as_label_array(labels, "labels", length=x.shape[0])
    kmeans_iter = check_scalar(kmeans_iter, "kmeans_iter", low=1, integer=True)
    rng = check_rng(rng)
    n_clusters = int(np.unique(y).size)
    distinct, inverse = np.unique(x, axis=0, return_inverse=True)
    if distinct.shape[0] <= n_clusters:
        clusters = inverse.reshape(-1).astype(np.int64)
    else:
        x /= common_scale(x)   # x is our own copy (as_float_array)
        clusters = _lloyd(x, n_clusters, kmeans_iter, rng)
    return {
        "nmi": normalized_mutual_information(y, clusters),
        "ami": adjusted_mutual_information(y, clusters),
        "f1": pairwise_f1(y, clusters),
        "n_clusters": n_clusters,
    }


def _lloyd(x: np.ndarray, n_clusters: int, max_iter: int, rng) -> np.ndarray:
    """``kmeans2(x, n_clusters, iter=max_iter, minit="++")``'s labels, one iteration a call.

    ``kmeans2(iter=j)`` returns the centroids after ``j`` updates and the labels of the
    ``j``-th; calling it with ``iter=1`` from the previous centroids takes the same steps
    (the seeding alone draws from ``rng``). Once an update leaves the centroids unchanged
    (exactly), every later one does too and the labels stay, so stopping there returns what
    ``max_iter`` iterations would.
    """
    with np.errstate(divide="raise", invalid="raise"):
        try:
            centroids, labels = kmeans2(x, n_clusters, iter=1, minit="++",
                                        **{_KMEANS_RNG: rng})
        except FloatingPointError:
            raise ValueError(
                f"embeddings: k-means++ cannot seed {n_clusters} clusters: the squared "
                "distances between the distinct embeddings underflow to 0 (points closer "
                "than ~1e-154 times the largest entry)") from None
    for _ in range(max_iter - 1):
        updated, labels = kmeans2(x, centroids, iter=1, minit="matrix")
        if np.array_equal(updated, centroids):
            break
        centroids = updated
    return labels.astype(np.int64)
