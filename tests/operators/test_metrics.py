"""Retrieval and clustering metrics: small cases worked out by hand, a brute-force oracle
(full distance matrix, stable sort, loops over the definitions), memory bound, input checks."""

import itertools
import math
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml import metrics
from refdml._numerics import common_scale

pytestmark = pytest.mark.cpu_exact


def _line(*positions):
    return np.array(positions, dtype=np.float64)[:, None]


# ------------------------------------------------------------- worked by hand


def test_same_set_by_hand_with_tie_and_singleton_class():
    # Points on a line: 0 (class 0), 1 (class 1), 2 (class 0), 3 (class 0).
    # q0 @0: neighbours 1 (d1, c1), 2 (d2, c0), 3 (d3, c0); R = 2; hits 0 1 1
    #        P@1 0, RP = 1/2, MAP@R = (0 + 1/2) / 2 = 1/4.
    # q1 @1: class 1 has no other member -> excluded.
    # q2 @2: 1 and 3 tie at d1 -> lower index first: 1 (c1), 3 (c0), then 0 (d2, c0);
    #        R = 2; hits 0 1 1: P@1 0, RP 1/2, MAP@R 1/4 (the other tie order would give
    #        P@1 1, MAP@R 1/2).
    # q3 @3: 2 (d1, c0), 1 (d2, c1), 0 (d3, c0); R = 2; hits 1 0 1: P@1 1, RP 1/2, MAP@R 1/2.
    # Over the 3 scored queries: P@1 1/3, RP 1/2, MAP@R (1/4 + 1/4 + 1/2) / 3 = 1/3.
    # Recall@1: 1/3; recall@2: every scored query has a hit among its first two: 1.
    result = metrics.retrieval_metrics(_line(0, 1, 2, 3), [0, 1, 0, 0], k=(1, 2))
    expected = {
        "precision_at_1": 1 / 3, "r_precision": 1 / 2, "mean_average_precision_at_r": 1 / 3,
        "recall_at_1": 1 / 3, "recall_at_2": 1.0, "n_queries": 3, "n_excluded_queries": 1,
    }
    assert result.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(result[key], value, rtol=1e-15, err_msg=key)
    assert isinstance(result["n_queries"], int)


def test_query_reference_mode_by_hand():
    # References on a line: 0 (c0), 1 (c1), 2 (c0), 3 (c0). Queries:
    # @0.4 c0: 0 (0.4), 1 (0.6), 2 (1.6), 3 (2.6) -> hits 1 0 1 1, R = 3:
    #          P@1 1, RP 2/3, MAP@R (1 + 0 + 2/3) / 3 = 5/9.
    # @2.9 c1: 3 (0.1), 2 (0.9), 1 (1.9), 0 (2.9) -> hits 0 0 1 0, R = 1:
    #          P@1 0, RP 0, MAP@R 0; recall@2 0, recall@4 1.
    # @1.0 c1: reference 1 at distance 0 is not excluded (different sets): hits 1 ..., R = 1:
    #          P@1 1, RP 1, MAP@R 1.
    # @5.0 c2: no reference of class 2 -> excluded.
    # Means over 3: P@1 2/3, RP (2/3 + 0 + 1) / 3 = 5/9, MAP@R (5/9 + 0 + 1) / 3 = 14/27,
    # recall@1 2/3, recall@2 2/3, recall@4 1, recall@8 (only 4 references) 1.
    result = metrics.retrieval_metrics(
        _line(0.4, 2.9, 1.0, 5.0), [0, 1, 1, 2], _line(0, 1, 2, 3), [0, 1, 0, 0]
    )
    expected = {
        "precision_at_1": 2 / 3, "r_precision": 5 / 9, "mean_average_precision_at_r": 14 / 27,
        "recall_at_1": 2 / 3, "recall_at_2": 2 / 3, "recall_at_4": 1.0, "recall_at_8": 1.0,
        "n_queries": 3, "n_excluded_queries": 1,
    }
    assert result.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(result[key], value, rtol=1e-15, err_msg=key)


def test_duplicated_references_tie_broken_by_index():
    # Two references at the same point, the first of the wrong class: P@1 = 0 for the
    # query at 0, whatever the chunking; swapping their order gives P@1 = 1.
    reference = _line(1.0, 1.0, 5.0)
    for chunk_size in (1, 2, None):
        wrong_first = metrics.retrieval_metrics(
            _line(0.0), [0], reference, [1, 0, 1], k=1, chunk_size=chunk_size
        )
        right_first = metrics.retrieval_metrics(
            _line(0.0), [0], reference, [0, 1, 1], k=1, chunk_size=chunk_size
        )
        assert wrong_first["precision_at_1"] == 0.0
        assert right_first["precision_at_1"] == 1.0


def test_perfect_and_worst_retrieval():
    # Two tight, far-apart clusters: every metric is 1; then swap the labels inside each
    # point pair so that every nearest neighbour is of the other class.
    x = _line(0.0, 0.1, 0.2, 10.0, 10.1, 10.2)
    perfect = metrics.retrieval_metrics(x, [0, 0, 0, 1, 1, 1])
    for key in ("precision_at_1", "r_precision", "mean_average_precision_at_r", "recall_at_1"):
        assert perfect[key] == 1.0
    # Pairs (0, 0.1), (10, 10.1) with classes split; 0.2 and 10.2 singletons of classes 2, 3.
    worst = metrics.retrieval_metrics(x, [0, 1, 2, 0, 1, 3])
    # q@0 (c0): nearest 0.1 (c1), 0.2 (c2), then 10.x; R = 1, its match @10 is 4th -> 0.
    assert worst["precision_at_1"] == 0.0 and worst["mean_average_precision_at_r"] == 0.0
    assert worst["n_queries"] == 4 and worst["n_excluded_queries"] == 2


def test_cosine_metric_ranks_by_angle():
    # Under cosine, (10, 0) and (1, 0.05) are close to the query (1, 0); Euclidean prefers (0.9, 0.5).
    query = np.array([[1.0, 0.0]])
    reference = np.array([[10.0, 0.0], [0.9, 0.5]])
    cos = metrics.retrieval_metrics(query, [0], reference, [0, 1], k=1, metric="cosine")
    euc = metrics.retrieval_metrics(query, [0], reference, [0, 1], k=1, metric="euclidean")
    assert cos["precision_at_1"] == 1.0 and euc["precision_at_1"] == 0.0


# --------------------------------------------------------- brute-force oracle


def _oracle(query, query_labels, reference, reference_labels, same_set, ks):
    """Full distance matrix from explicit differences, stable argsort (ties by index),
    then each metric from its definition in a loop."""
    dist = np.sqrt(((query[:, None, :] - reference[None, :, :]) ** 2).sum(-1))
    out = {"p1": [], "rp": [], "map": [], **{kk: [] for kk in ks}}
    excluded = 0
    for i in range(len(query)):
        order = [j for j in np.argsort(dist[i], kind="stable") if not (same_set and j == i)]
        r = sum(1 for j in range(len(reference)) if reference_labels[j] == query_labels[i] and not (same_set and j == i))
        if r == 0:
            excluded += 1
            continue
        correct = [reference_labels[j] == query_labels[i] for j in order]
        out["p1"].append(float(correct[0]))
        out["rp"].append(sum(correct[:r]) / r)
        out["map"].append(sum(sum(correct[: j + 1]) / (j + 1) for j in range(r) if correct[j]) / r)
        for kk in ks:
            out[kk].append(float(any(correct[:kk])))
    if not out["p1"]:
        return None
    result = {
        "precision_at_1": np.mean(out["p1"]), "r_precision": np.mean(out["rp"]),
        "mean_average_precision_at_r": np.mean(out["map"]),
        **{f"recall_at_{kk}": np.mean(out[kk]) for kk in ks},
        "n_queries": len(out["p1"]), "n_excluded_queries": excluded,
    }
    return result


def _assert_same(result, expected):
    assert result.keys() == expected.keys()
    for key in expected:
        np.testing.assert_allclose(result[key], expected[key], rtol=1e-13, err_msg=key)


@given(
    hnp.arrays(np.int64, st.tuples(st.integers(4, 30), st.just(2)), elements=st.integers(-3, 3)),
    st.data(),
    st.sampled_from([1, 3, None]),
)
def test_same_set_matches_oracle_on_integer_grid(points, data, chunk_size):
    # Small integer coordinates: both the Gram identity and explicit differences are exact,
    # so the many exact ties must be broken identically (by reference index).
    labels = np.asarray(data.draw(hnp.arrays(np.int64, len(points), elements=st.integers(0, 4))))
    x = points.astype(np.float64)
    expected = _oracle(x, labels, x, labels, True, (1, 2, 4, 8))
    if expected is None:
        with pytest.raises(ValueError, match="no query has a true reference"):
            metrics.retrieval_metrics(x, labels, chunk_size=chunk_size)
        return
    _assert_same(metrics.retrieval_metrics(x, labels, chunk_size=chunk_size), expected)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_query_reference_matches_oracle_random(seed):
    rng = np.random.default_rng(seed)
    reference = rng.standard_normal((120, 6))
    reference = np.vstack([reference, reference[:10]])   # exact duplicates: exact ties
    reference_labels = rng.integers(0, 15, reference.shape[0])
    query = rng.standard_normal((40, 6))
    query_labels = rng.integers(0, 17, 40)               # classes 15, 16 have no reference
    expected = _oracle(query, query_labels, reference, reference_labels, False, (1, 2, 4, 8, 16))
    for chunk_size in (1, 7, None):
        result = metrics.retrieval_metrics(
            query, query_labels, reference, reference_labels, k=(16, 1, 2, 4, 8), chunk_size=chunk_size
        )
        _assert_same(result, expected)


def _exact_sq_distances(query, reference):
    """Squared distances in exact rational arithmetic (every float64 is a fraction)."""
    from fractions import Fraction

    q = [[Fraction(float(v)) for v in row] for row in query]
    r = [[Fraction(float(v)) for v in row] for row in reference]
    return [[sum((a - b) ** 2 for a, b in zip(qi, rj)) for rj in r] for qi in q]


@pytest.mark.parametrize("seed", [0, 1])
def test_ranking_agrees_with_exact_arithmetic_up_to_its_rounding(seed):
    # An independent check of the ordered score: the readable ranking against exact
    # rational distances. Pairs in each other's rounding (|S64 - S| <= eta, module docstring
    # of refdml.gpu.metrics._certificate) may come in either order; any two further apart must be
    # in the exact order, and nothing left out may be nearer than the last kept by more
    # than 2 eta. Near-ties (relative 1e-15) and exact duplicates make the rule bite.
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((30, 5))
    reference = np.vstack([base, base[:10] * (1 + 1e-15), base[10:13]])
    reference /= common_scale(reference)
    query = rng.standard_normal((12, 5)) / 4
    exact = _exact_sq_distances(query, reference)
    d = reference.shape[1]
    big_r = float(np.max(np.linalg.norm(reference, axis=1)))
    got = metrics._nearest(query, np.arange(12), reference, 10, False, "euclidean", 5)
    for i, row in enumerate(got):
        eta = 2 * (d + 2) * 2.0**-53 * (np.linalg.norm(query[i]) + big_r) ** 2
        values = [float(exact[i][j]) for j in row]
        assert all(a <= b + 2 * eta for a, b in zip(values, values[1:])), (i, values)
        left_out = [float(exact[i][j]) for j in range(len(reference)) if j not in set(row)]
        assert min(left_out) >= values[-1] - 2 * eta
        for a, b in zip(row, row[1:]):                     # equal rows: lower index first
            if np.array_equal(reference[a], reference[b]):
                assert a < b


def test_distance_matrix_is_never_materialised():
    # 3000 x 3000 distances would be 72 MB; with 50-query chunks the blocks are 1.2 MB.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3000, 16))
    labels = rng.integers(0, 300, 3000)
    tracemalloc.start()
    try:
        metrics.retrieval_metrics(x, labels, chunk_size=50)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * 2**20, f"peak {peak / 2**20:.1f} MiB"


# ------------------------------------------------------------------- input checks


@pytest.mark.parametrize("call, error, match", [
    (lambda x: metrics.retrieval_metrics(x, [0, 1]), ValueError, "query_labels has length 2"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], x), ValueError, "given together"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], x[:, :1], [0, 0, 1, 1]), ValueError, "dimension"),
    (lambda x: metrics.retrieval_metrics(x, [0, 1, 2, 3]), ValueError, "no query has a true reference"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], k=0), ValueError, "k == 0"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], chunk_size=0), ValueError, "chunk_size == 0"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], metric="l1"), ValueError, "metric == 'l1'"),
    (lambda x: metrics.retrieval_metrics(np.vstack([x[:3], [0, 0]]), [0, 0, 1, 1], metric="cosine"),
     ValueError, "query has a zero vector at row 3"),
    (lambda x: metrics.retrieval_metrics(x * np.nan, [0, 0, 1, 1]), ValueError, "query must be finite"),
    (lambda x: metrics.retrieval_metrics(x, [0, 0, 1, 1], k=1.5), TypeError, "k must be an integer"),
])
def test_retrieval_metrics_input_checks(call, error, match):
    x = np.arange(8.0).reshape(4, 2)
    with pytest.raises(error, match=match):
        call(x)


# ---------------------------------------------------------------------- clustering


def test_nmi_by_hand():
    # Y = [0 0 1 1], C = [0 0 0 1]. H(Y) = ln 2; H(C) = 3/4 ln(4/3) + 1/4 ln 4.
    # I = 1/2 ln((1/2)/(1/2 * 3/4)) + 1/4 ln((1/4)/(1/2 * 3/4)) + 1/4 ln((1/4)/(1/2 * 1/4))
    #   = 1/2 ln(4/3) + 1/4 ln(2/3) + 1/4 ln 2 = 3/2 ln 2 - 3/4 ln 3.
    h_y = math.log(2)
    h_c = 0.75 * math.log(4 / 3) + 0.25 * math.log(4)
    mutual = 1.5 * math.log(2) - 0.75 * math.log(3)
    np.testing.assert_allclose(
        metrics.normalized_mutual_information([0, 0, 1, 1], [0, 0, 0, 1]),
        2 * mutual / (h_y + h_c), rtol=1e-14,
    )


def test_nmi_extremes():
    # A relabelled copy of the partition: I = H(Y) = H(C), NMI 1; an independent one: I = 0.
    assert metrics.normalized_mutual_information([0, 0, 1, 1, 2], [7, 7, 3, 3, 5]) == pytest.approx(1.0, abs=1e-15)
    assert metrics.normalized_mutual_information([0, 0, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.0, abs=1e-15)
    assert metrics.normalized_mutual_information([4, 4, 4], [1, 1, 1]) == 1.0


def test_pairwise_f1_by_hand():
    # Y = [0 0 1 1], C = [0 0 0 1]: same-class pairs (0,1), (2,3); same-cluster pairs
    # (0,1), (0,2), (1,2); TP = 1 -> precision 1/3, recall 1/2, F1 = 2 (1/6) / (5/6) = 0.4.
    np.testing.assert_allclose(metrics.pairwise_f1([0, 0, 1, 1], [0, 0, 0, 1]), 0.4, rtol=1e-15)
    # Every point its own cluster: no same-cluster pair, TP = 0 -> F1 = 0.
    assert metrics.pairwise_f1([0, 0, 1, 1], [0, 1, 2, 3]) == 0.0
    # One cluster: precision 2/6, recall 1 -> F1 = 2 (1/3) / (4/3) = 1/2.
    np.testing.assert_allclose(metrics.pairwise_f1([0, 0, 1, 1], [0, 0, 0, 0]), 0.5, rtol=1e-15)


def test_clustering_metrics_separated_blobs_and_seeding():
    rng = np.random.default_rng(0)
    centers = np.array([[0.0, 0.0], [50.0, 0.0], [0.0, 50.0]])
    labels = np.repeat([0, 1, 2], 10)
    x = centers[labels] + 0.01 * rng.standard_normal((30, 2))
    result = metrics.clustering_metrics(x, labels, rng=0)
    assert result.keys() == {"nmi", "ami", "f1", "n_clusters"}
    assert result["n_clusters"] == 3
    np.testing.assert_allclose([result["nmi"], result["ami"], result["f1"]], 1.0, rtol=1e-12)
    noisy = rng.standard_normal((30, 2))
    assert metrics.clustering_metrics(noisy, labels, rng=3) == metrics.clustering_metrics(noisy, labels, rng=3)


def test_the_embedding_level_shortcuts_are_gone():
    # One name, one meaning: nmi / f1 of embeddings are keys of clustering_metrics.
    assert not hasattr(metrics, "nmi") and not hasattr(metrics, "f1")
    assert {"adjusted_mutual_information", "clustering_metrics"} <= set(metrics.__all__)


def test_clustering_metrics_refuses_a_negative_seed():
    with pytest.raises(ValueError, match="rng == -1"):
        metrics.clustering_metrics(np.eye(4), [0, 0, 1, 1], rng=-1)


# --------------------------------------------------------- adjusted mutual information


def _mutual_information_loop(labels_true, labels_pred):
    n = len(labels_true)
    mi = 0.0
    for u in set(labels_true):
        for v in set(labels_pred):
            nij = sum(1 for a, b in zip(labels_true, labels_pred) if a == u and b == v)
            if nij:
                ai, bj = list(labels_true).count(u), list(labels_pred).count(v)
                mi += nij / n * math.log(n * nij / (ai * bj))
    return mi


def _expected_mi_loop(a, b):
    """Vinh et al. 2010 Eq. 24a as written: each cell, each count, the hypergeometric
    probability C(b_j, k) C(n - b_j, a_i - k) / C(n, a_i) in exact integers."""
    n = sum(a)
    total = 0.0
    for ai in a:
        for bj in b:
            for k in range(max(1, ai + bj - n), min(ai, bj) + 1):
                p = math.comb(bj, k) * math.comb(n - bj, ai - k) / math.comb(n, ai)
                total += p * k / n * math.log(n * k / (ai * bj))
    return total


@pytest.mark.parametrize("a, b", [
    ([2, 2], [3, 1]),
    ([1, 1, 1, 1], [2, 2]),
    ([5, 3, 3, 1], [4, 4, 4]),
    ([10], [3, 3, 4]),
    ([7, 1, 1, 6, 2, 2, 1], [5, 5, 5, 4, 1]),
])
def test_expected_mutual_information_matches_the_loop(a, b):
    got = metrics._expected_mutual_information(np.array(a), np.array(b))
    np.testing.assert_allclose(got, _expected_mi_loop(a, b), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("labels_true, labels_pred", [
    ([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1]),
    ([0, 0, 0, 1, 1, 2], [1, 0, 0, 2, 2, 2]),
    ([0, 1, 0, 1, 0, 1, 2], [0, 0, 0, 1, 1, 2, 2]),
])
def test_ami_matches_an_average_over_every_permutation(labels_true, labels_pred):
    # E[I] by brute force: the mean of I over all n! relabellings of the samples of one
    # partition (which is what the hypergeometric model averages), independent of Eq. 24a.
    n = len(labels_true)
    mis = [_mutual_information_loop(labels_true, [labels_pred[i] for i in perm])
           for perm in itertools.permutations(range(n))]
    expected = float(np.mean(mis))
    entropy = lambda lab: -sum(c / n * math.log(c / n) for c in (list(lab).count(v) for v in set(lab)))  # noqa: E731
    mean_h = 0.5 * (entropy(labels_true) + entropy(labels_pred))
    oracle = (_mutual_information_loop(labels_true, labels_pred) - expected) / (mean_h - expected)
    np.testing.assert_allclose(
        metrics.adjusted_mutual_information(labels_true, labels_pred), oracle, rtol=1e-11
    )


def test_ami_properties():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 6, 300)
    c = np.where(rng.random(300) < 0.7, y, rng.integers(0, 6, 300))
    # Identical up to relabelling -> 1; symmetric; below NMI for a partial agreement.
    np.testing.assert_allclose(metrics.adjusted_mutual_information(y, (y + 3) * 7), 1.0, rtol=1e-12)
    np.testing.assert_allclose(
        metrics.adjusted_mutual_information(y, c), metrics.adjusted_mutual_information(c, y), rtol=1e-12
    )
    assert 0.0 < metrics.adjusted_mutual_information(y, c) < metrics.normalized_mutual_information(y, c)
    # Independent random partitions: AMI ~ 0 (of either sign), while NMI stays positive.
    amis = [metrics.adjusted_mutual_information(rng.integers(0, 10, 1000), rng.integers(0, 10, 1000))
            for _ in range(20)]
    assert abs(np.mean(amis)) < 2e-3 and max(abs(v) for v in amis) < 1e-2
    # Degenerate marginals: nothing to correct for.
    assert metrics.adjusted_mutual_information([3, 3, 3], [1, 1, 1]) == 1.0
    assert metrics.adjusted_mutual_information([0, 1, 2, 3], [5, 6, 7, 8]) == 1.0
    assert metrics.adjusted_mutual_information([0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(0.0, abs=1e-15)
    assert metrics.adjusted_mutual_information([0, 1, 2, 3], [0, 0, 1, 1]) == pytest.approx(0.0, abs=1e-15)


def test_ami_input_checks():
    with pytest.raises(ValueError, match="labels_pred has length 2"):
        metrics.adjusted_mutual_information([0, 1, 1], [0, 1])
    with pytest.raises(TypeError, match="labels_true must hold integer labels"):
        metrics.adjusted_mutual_information([0.5, 1.0], [0, 1])


# ------------------------------------------------------- extreme but finite embeddings


def _clusters(seed, n_per=15, spread=0.6):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((4, 5)) * 3
    labels = np.repeat(np.arange(4), n_per)
    return centers[labels] + spread * rng.standard_normal((labels.size, 5)), labels


@pytest.mark.parametrize("exponent", [-997, -500, 500, 997])
def test_clustering_metrics_is_exactly_scale_invariant_for_powers_of_two(exponent):
    x, labels = _clusters(0, spread=2.0)   # overlapping: an imperfect clustering
    expected = metrics.clustering_metrics(x, labels, rng=5)
    assert expected["nmi"] < 0.95
    assert metrics.clustering_metrics(np.ldexp(x, exponent), labels, rng=5) == expected


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_clustering_metrics_at_extreme_scales(scale):
    x, labels = _clusters(1)
    expected = metrics.clustering_metrics(x, labels, rng=3)
    assert metrics.clustering_metrics(x * scale, labels, rng=3) == expected


def test_clustering_metrics_at_1e154_does_not_crash_the_interpreter(tmp_path):
    # SciPy's k-means++ on squares that overflow divided inf by inf and died with SIGSEGV;
    # a subprocess turns such a crash into a failed test instead of a dead pytest.
    code = (
        "import numpy as np\n"
        "from refdml import metrics\n"
        "x = np.random.default_rng(0).standard_normal((40, 4))\n"
        "labels = np.repeat(np.arange(4), 10)\n"
        "a = metrics.clustering_metrics(x * 1e154, labels, rng=0)\n"
        "b = metrics.clustering_metrics(x, labels, rng=0)\n"
        "print(a == b, a['n_clusters'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split() == ["True", "4"]


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_retrieval_metrics_at_extreme_scales(scale, metric):
    x, labels = _clusters(2, spread=2.5)
    reference, reference_labels = _clusters(3, spread=2.5)
    same = metrics.retrieval_metrics(x, labels, metric=metric)
    assert metrics.retrieval_metrics(x * scale, labels, metric=metric) == same
    split = metrics.retrieval_metrics(x, labels, reference, reference_labels, metric=metric)
    assert metrics.retrieval_metrics(
        x * scale, labels, reference * scale, reference_labels, metric=metric
    ) == split
    assert same["precision_at_1"] < 1.0   # not a trivially perfect retrieval


# ------------------------------------------- k-means: degenerate inputs, stopping


@pytest.mark.parametrize("x", [np.ones((6, 3)), np.zeros((6, 3)),
                               np.r_[np.zeros((5, 3)), [[1e300, 0.0, 0.0]]]],
                         ids=["constant", "zeros", "one-far-point"])
def test_clustering_metrics_with_fewer_distinct_points_than_classes(x):
    # k-means++ would divide 0 by 0 (a RuntimeWarning, an error under this suite). With no
    # more distinct points than classes the optimum is one cluster per distinct point.
    labels = np.array([0, 0, 1, 1, 2, 2])
    got = metrics.clustering_metrics(x, labels, rng=0)
    clusters = np.unique(x, axis=0, return_inverse=True)[1].reshape(-1)
    assert got["nmi"] == metrics.normalized_mutual_information(labels, clusters)
    assert got["f1"] == metrics.pairwise_f1(labels, clusters)
    if np.all(x == x[0]):
        # one cluster: I(Y; C) = 0, so NMI = 0; 3 same-class pairs of 15, all predicted
        # together: precision 1/5, recall 1, F1 = 1/3
        assert got["nmi"] == 0.0
        np.testing.assert_allclose(got["f1"], 1 / 3, rtol=1e-15)


@pytest.mark.parametrize("n_iter", [1, 2, 7, 50])
def test_lloyd_stops_at_a_fixed_point_with_kmeans2s_answer(n_iter):
    # SciPy's own loop of exactly n_iter iterations is the oracle.
    from scipy.cluster.vq import kmeans2

    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 5))
    want = kmeans2(x, 6, iter=n_iter, minit="++",
                   **{metrics._KMEANS_RNG: np.random.default_rng(5)})[1]
    got = metrics._lloyd(x.copy(), 6, n_iter, np.random.default_rng(5))
    np.testing.assert_array_equal(got, want)


def test_clustering_metrics_with_a_huge_kmeans_iter_ends():
    rng = np.random.default_rng(1)
    x, labels = rng.standard_normal((200, 4)), rng.integers(5, size=200)
    assert (metrics.clustering_metrics(x, labels, rng=2, kmeans_iter=2**62)
            == metrics.clustering_metrics(x, labels, rng=2, kmeans_iter=10_000))
