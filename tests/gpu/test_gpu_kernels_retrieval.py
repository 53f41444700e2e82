"""The retrieval top-K kernels (refdml.gpu.metrics._compiled, refdml.gpu.metrics._cuda) against
the readable ranking.

The compiled CPU twin must return the readable path's neighbours (same indices, same order)
and therefore equal metrics, asserted with ``==``: its float32 stage is certified by a
rounding bound and re-ranked in float64 (module docstring of refdml.gpu.metrics._certificate).
Inputs are generic (Gaussian), so no two float64 distances agree to rounding, plus exact
duplicates (exact ties, lower index first). The CUDA kernel runs under Numba's CUDA
simulator on a few points where there is no GPU (every thread is a Python thread), on CuPy
arrays on a GPU; there the compiler may contract its score into FMAs and CuPy sums the
metrics in its own order, so it is held to a certificate, not to equality by construction:
the same neighbours where every gap of the ranking exceeds the rounding bound (exact ties
of identical rows excepted, which round alike everywhere), metrics to :data:`METRIC_RTOL`.
The array path of refdml.gpu.metrics (its group minima, blocks and padding, its certificate
holding and failing on crowds of near-duplicates, the chooser IMPLEMENTATIONS and its
synchronisations) is held to the readable ranking with ``==`` on NumPy and on CuPy arrays.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml import metrics as ref
from refdml.gpu.metrics._compiled import nearest_cpu
from refdml._numerics import common_scale, ordered_sq_distances, ordered_unit_rows
from refdml._backend import get_backend, to_numpy
from refdml.gpu import metrics as fast
from refdml.gpu import use_kernels
from refdml.gpu.metrics import _array as fast_array
from refdml.gpu.metrics import _compiled as fast_compiled
from refdml.gpu.metrics import _kernels as fast_kernels
from refdml.gpu.metrics._array import ArrayPath, TopK

pytestmark = pytest.mark.cpu_exact

# The metrics are means over the queries of terms in [0, 1]; from the same neighbours two
# devices differ only in the order of those sums (NumPy's pairwise sums, CuPy's reduction
# tree): a relative error of at most n_queries 2^-53 each, 1e-12 up to ~10^4 queries.
METRIC_RTOL = 1e-12


def _request(query, rows, reference, n_keep, same_set, metric, chunk_size=None):
    """The family's request for the ``n_keep`` nearest references of ``query[rows]``."""
    return TopK(backend=get_backend(query), query=query, rows=rows, reference=reference,
                n_keep=n_keep, same_set=same_set, metric=metric, chunk_size=chunk_size)


def _array_nearest(*args, **kwargs):
    """The array path's answer to :func:`_request`'s request."""
    return ArrayPath().nearest(_request(*args, **kwargs))


def _data(seed, n, d, n_classes, dtype=np.float64, duplicates=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(dtype)
    labels = rng.integers(n_classes, size=n)
    for _ in range(duplicates if n > 4 else 0):   # exact ties
        a, b = rng.choice(n, size=2, replace=False)
        x[b] = x[a]
    return x, labels


def _both(x, rows, y, n_keep, same_set, metric, **kw):
    if metric == "euclidean":
        scale = common_scale(x, y)
        x, y = x / scale, y / scale
        if same_set:
            y = x
    want = ref._nearest(x, rows, y, n_keep, same_set, metric, 64)
    got, redone = nearest_cpu(x, rows, y, n_keep, same_set, metric, return_redone=True, **kw)
    return got, want, redone


@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_neighbours_equal_readable(seed, same_set, metric):
    x, _ = _data(seed, 700, 9, 20)
    y = x if same_set else _data(seed + 7, 530, 9, 20)[0]
    rows = np.arange(0, 700, 3)
    got, want, _ = _both(x, rows, y, 13, same_set, metric, tile=64)   # tiles not dividing n
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("extra", [0, 1])
def test_failed_certificate_is_redone_exactly(extra):
    # Many exact duplicates crowd the K-th score: with no spare candidates the certificate
    # fails and those queries are rescanned in float64, still giving the readable answer.
    rng = np.random.default_rng(4)
    base = rng.standard_normal((6, 4))
    x = base[rng.integers(6, size=90)]
    rows = np.arange(90)
    got, want, redone = _both(x, rows, x, 5, True, "euclidean", extra=extra, tile=16)
    np.testing.assert_array_equal(got, want)
    assert redone.any()


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(3, 120), d=st.integers(1, 12),
       n_classes=st.integers(1, 15), same_set=st.booleans(),
       metric=st.sampled_from(["euclidean", "cosine"]),
       scale_exp=st.sampled_from([-300, -150, 0, 150, 300]),
       k=st.lists(st.integers(1, 10), min_size=1, max_size=3))
def test_metrics_equal_readable_hypothesis(seed, n, d, n_classes, same_set, metric, scale_exp,
                                           k):
    x, labels = _data(seed, n, d, n_classes)
    x *= 10.0**scale_exp
    kwargs = {"k": k, "metric": metric}
    if not same_set:
        y, y_labels = _data(seed + 1, n + 5, d, n_classes)
        kwargs.update(reference=y * 10.0**scale_exp, reference_labels=y_labels)
    try:
        want = ref.retrieval_metrics(x, labels, **kwargs)
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err)[:30]), use_kernels("cpu"):
            fast.retrieval_metrics(x, labels, **kwargs)
        return
    with use_kernels("cpu"):
        assert fast.retrieval_metrics(x, labels, **kwargs) == want


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
def test_mirror_cpu_kernel_matches_array_path(same_set, metric, dtype):
    x, labels = _data(2, 400, 8, 25, dtype)
    kwargs = {"metric": metric}
    if not same_set:
        y, y_labels = _data(3, 300, 8, 25, dtype)
        kwargs.update(reference=y, reference_labels=y_labels)
    with use_kernels("array"):
        want = fast.retrieval_metrics(x, labels, **kwargs)
    with use_kernels("cpu"):
        got = fast.retrieval_metrics(x, labels, **kwargs)
    # Exact by construction on the host: both return the readable ranking (certified
    # re-rank by the ordered float64 score, the same bits), then the same NumPy sums.
    assert got == want
    if dtype == np.float32:   # the float64 reference on the float32-rounded input
        ref_kwargs = {key: (v.astype(np.float64) if key == "reference" else v)
                      for key, v in kwargs.items()}
        assert got == ref.retrieval_metrics(x.astype(np.float64), labels, **ref_kwargs)


def _rounding_bound(q, r):
    """``eta_i`` of refdml.gpu.metrics._certificate: the error bound of one ordered float64 score
    ``S_ij`` of query ``q_i``, for every reference row of ``r``, in any summation order, with
    or without FMA."""
    d = q.shape[1]
    q_norm = np.sqrt(np.einsum("ij,ij->i", q, q))
    big_r = np.sqrt(np.max(np.einsum("ij,ij->i", r, r)))
    return 2 * (d + 2) * 2.0**-53 * (q_norm + big_r) ** 2 + d * 2.0**-1070


def _assert_ranking_certified(q, r, same_set):
    """Every query's whole ranking of the rows of ``r`` (the values both paths rank) is the
    same on every device. Each device's score is within ``eta`` of the exact one, so two
    references keep their order where their readable scores (also within ``eta``) differ
    by more than ``4 eta``; identical rows tie exactly everywhere (the same operations on
    the same bits) and go to the lower index."""
    scores = ordered_sq_distances(q, np.ascontiguousarray(r.T))
    eta = _rounding_bound(q, r)
    for i in range(q.shape[0]):
        order = np.lexsort((np.arange(r.shape[0]), scores[i]))
        if same_set:
            order = order[order != i]
        gaps = np.diff(scores[i, order])
        identical = np.all(r[order[1:]] == r[order[:-1]], axis=1)
        assert np.all((gaps > 4 * eta[i]) | identical), (
            f"query {i}: a near-tie within the rounding bound: pick another input")


def test_ranking_certificate_refuses_near_ties():
    # References a relative 1e-15 apart (not identical rows): no device-independent order.
    x = _near_ties(3, 40, 6)
    x /= common_scale(x)
    with pytest.raises(AssertionError, match="near-tie within the rounding bound"):
        _assert_ranking_certified(x, x, True)
    generic = _data(5, 14, 3, 4)[0]                     # exact duplicates: certified
    _assert_ranking_certified(generic / common_scale(generic), generic / common_scale(generic),
                              True)


def _assert_metrics_close(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, int):                     # query counts
            assert got[key] == value, key
        else:
            assert_allclose(got[key], value, rtol=METRIC_RTOL, atol=0, err_msg=key)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
def test_mirror_cuda_kernel_matches_array_path(same_set, metric, dtype, cuda_device_array):
    x, labels = _data(5, 14, 3, 4, dtype, duplicates=1)
    y, y_labels = (x, labels) if same_set else _data(6, 11, 3, 4, dtype, duplicates=1)
    # The values both paths rank: the rows over one power of two (exact), or unit rows.
    q, r = x, y
    if metric == "euclidean":
        scale = common_scale(x.astype(np.float64), y.astype(np.float64))
        q, r = x / scale, y / scale
    q64, r64 = q.astype(np.float64), r.astype(np.float64)
    if metric == "cosine":
        _assert_ranking_certified(ordered_unit_rows(q64), ordered_unit_rows(r64), same_set)
    else:
        _assert_ranking_certified(q64, r64, same_set)
    # Certified: the kernel's whole ranking of every query is the readable one.
    rows = np.arange(x.shape[0])
    n_keep = y.shape[0] - 1 if same_set else y.shape[0]
    want = ref._nearest(q64, rows, r64, n_keep, same_set, metric, 64)
    query, reference = cuda_device_array(q), cuda_device_array(r)
    got = fast_kernels.CudaPath().nearest(_request(query, cuda_device_array(rows), reference,
                                                   n_keep, same_set, metric))
    assert_array_equal(to_numpy(got), want)
    # The public function on both paths (the same neighbours; means to METRIC_RTOL).
    kwargs = {"metric": metric, "k": (1, 2)}
    if not same_set:
        kwargs.update(reference=y, reference_labels=y_labels)
    with use_kernels("array"):
        want_metrics = fast.retrieval_metrics(x, labels, **kwargs)
    dev = {key: (cuda_device_array(v) if key.startswith("reference") else v)
           for key, v in kwargs.items()}
    with use_kernels("cuda"):
        got_metrics = fast.retrieval_metrics(cuda_device_array(x), cuda_device_array(labels),
                                             **dev)
    _assert_metrics_close(got_metrics, want_metrics)


def test_bad_input_named_on_the_fast_path():
    with pytest.raises(ValueError, match="query has dimension"):
        ref.retrieval_metrics(np.ones((4, 2)), [0, 0, 1, 1], np.ones((3, 3)), [0, 1, 1])
    with pytest.raises(ValueError, match="no query has a true reference"):
        ref.retrieval_metrics(np.eye(3), [0, 1, 2])


# ------------------------------------------------- the ordered score, on every machine


def _wide_rows(seed, n, d):
    """Rows whose coordinates span many binades, so that any change of summation order or
    an FMA changes some last bits."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)) * np.exp2(rng.integers(-12, 1, size=(n, d)))


@pytest.mark.parametrize("d", [1, 3, 8, 33, 130])
def test_compiled_score_has_the_bits_of_the_ordered_array_score(d):
    # Equal by construction: the same IEEE operations in the same order, the compiled loop
    # built without fast-math (no reassociation, no FMA). Under NUMBA_CPU_NAME=generic and
    # every OPENBLAS_CORETYPE (scripts/ci_cpu_matrix.sh) it must stay bit-equal.
    from refdml._numerics import ordered_sq_distances
    from refdml.gpu.metrics._compiled import _score64, _score64_four

    x, y = _wide_rows(1, 40, d), _wide_rows(2, 50, d)
    want = ordered_sq_distances(x, np.ascontiguousarray(y.T))
    got = np.array([[_score64(x, i, y, j) for j in range(50)] for i in range(40)])
    np.testing.assert_array_equal(got, want)
    four = np.array([[s for j in range(0, 48, 4) for s in _score64_four(x, i, y, j, j + 1, j + 2,
                                                                       j + 3)]
                     for i in range(40)])     # the re-rank's four interleaved chains
    np.testing.assert_array_equal(four, want[:, :48])
    if d >= 8:   # the data can tell orders apart, so the equality above is not vacuous
        assert np.any(np.sum((x[:, None, :] - y[None]) ** 2, axis=-1) != want)


def test_duplicate_rows_score_alike_wherever_they_sit():
    # The failure on Intel (OpenBLAS SkylakeX kernels): two identical references at rows
    # 276 and 528 got different last bits from one matrix product. The ordered score is a
    # function of the two rows alone: equal columns for equal rows, and a permutation of
    # the references permutes the scores bit for bit.
    from refdml._numerics import ordered_sq_distances, ordered_unit_rows

    x, _ = _data(1, 700, 9, 20)
    y = _data(8, 530, 9, 20, duplicates=0)[0]
    y[528] = y[276]
    score = ordered_sq_distances(x, np.ascontiguousarray(y.T))
    np.testing.assert_array_equal(score[:, 276], score[:, 528])
    perm = np.random.default_rng(0).permutation(530)
    np.testing.assert_array_equal(
        ordered_sq_distances(x[::-1], np.ascontiguousarray(y[perm].T)), score[::-1][:, perm])
    unit = ordered_unit_rows(y)
    np.testing.assert_array_equal(unit[276], unit[528])
    np.testing.assert_array_equal(ordered_unit_rows(y[perm]), unit[perm])
    scale = common_scale(x, y)
    got = ref._nearest(x / scale, np.arange(700), y / scale, 13, False, "euclidean", 64)
    both = (got == 276) | (got == 528)
    rows = np.nonzero(both.sum(axis=1) == 2)[0]
    assert rows.size          # queries whose list holds both copies: 276 right before 528
    for i in rows:
        at = np.nonzero(both[i])[0]
        assert at[1] == at[0] + 1 and got[i, at[0]] == 276


def _near_ties(seed, n, d):
    """References in pairs a hair apart (a relative 1e-15), and duplicates: the matrix
    product's rounding orders such pairs at random, the ordered score decides them."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n // 2, d))
    twin = base * (1.0 + 1e-15 * rng.standard_normal((n // 2, 1)))
    x = np.concatenate([base, twin])[rng.permutation(2 * (n // 2))]
    x[rng.integers(len(x), size=5)] = x[rng.integers(len(x), size=5)]
    return x


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
def test_array_path_certified_rerank_equals_readable(same_set, metric, dtype):
    # The array path (a matrix product in the data's dtype, then the certified ordered
    # re-rank) returns the readable ranking of the same values exactly: for float32 data,
    # of the float32 values taken into float64.
    x = _near_ties(3, 300, 6).astype(dtype)
    y = x if same_set else _near_ties(4, 260, 6).astype(dtype)
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    if metric == "euclidean":
        scale = common_scale(x64, y64)
        x, y, x64, y64 = x / scale, y / scale, x64 / scale, y64 / scale
        if same_set:
            y, y64 = x, x64
    rows = np.arange(0, 300, 2)
    want = ref._nearest(x64, rows, y64, 9, same_set, metric, 32)
    got = _array_nearest(x, rows, y, 9, same_set, metric, 32)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(nearest_cpu(x, rows, y, 9, same_set, metric), want)


def test_array_path_redoes_the_queries_whose_certificate_fails(monkeypatch):
    # Many exact duplicates crowd the K-th score and no spare candidates (EXTRA = 0) can
    # certify it, so the array path scans those queries in full: still the readable answer.
    monkeypatch.setattr(fast_array, "EXTRA", 0)

    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4))[rng.integers(6, size=90)]
    x /= common_scale(x)
    scans = []
    real = fast_array.ordered_sq_distances
    monkeypatch.setattr(fast_array, "ordered_sq_distances",
                        lambda *a, **k: scans.append(1) or real(*a, **k))
    rows = np.arange(90)
    got = _array_nearest(x, rows, x, 5, True, "euclidean", 16)
    np.testing.assert_array_equal(got, ref._nearest(x, rows, x, 5, True, "euclidean", 16))
    assert scans


# ------------------------------------------- the array path's selection and certificate
# Run on NumPy and on CuPy arrays (a GPU, or the CuPy stand-in under the simulator): the
# array path is written once against ``xp``, and its answer is the readable ranking exactly
# on both (the certified float64 re-rank; CuPy's elementwise float64 operations round as
# NumPy's do).

BACKENDS = ["numpy", pytest.param("cupy", marks=pytest.mark.requires_cupy)]


def _module(backend):
    if backend == "numpy":
        return np
    import cupy

    return cupy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width, group, levels, n", [
    (64, 4, 1, 5), (512, 4, 2, 7), (256, 2, 3, 9), (37, 32, 0, 6), (4, 32, 0, 6)])
def test_group_minima_keep_the_smallest_entries(backend, width, group, levels, n):
    # Integer scores in a small range: many ties, also across the cut. Whatever ties the
    # levels of group minima choose, the kept values are the n smallest of the row.
    xp = _module(backend)
    score = np.random.default_rng(width + n).integers(0, 40, (9, width)).astype(np.float32)
    values, columns = fast_array._smallest_entries(xp, xp.asarray(score), n, levels, group,
                                                   xp.arange(group, dtype=xp.int64))
    values, columns = to_numpy(values), to_numpy(columns)
    assert values.shape == columns.shape == (9, min(n, width))
    assert_array_equal(np.sort(values, axis=1), np.sort(score, axis=1)[:, :n])
    assert_array_equal(np.take_along_axis(score, columns, axis=1), values)
    assert all(np.unique(row).size == row.size for row in columns)


def _readable_on(x, y, rows, n_keep, same_set, metric):
    """The readable ranking of the values the fast path ranks (float32 taken into float64,
    both sets over the common power of two)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    if metric == "euclidean":
        scale = common_scale(x64, y64)
        x, y, x64, y64 = x / scale, y / scale, x64 / scale, y64 / scale
    if same_set:
        y, y64 = x, x64
    return x, y, ref._nearest(x64, rows, y64, n_keep, same_set, metric, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
def test_array_path_blocks_levels_and_padding(monkeypatch, backend, dtype, metric, same_set):
    # Small groups and blocks, so that 1,000 references take two blocks, three levels of
    # group minima and padding rows: the neighbours are still the readable ones.
    monkeypatch.setattr(fast_array, "_GROUP", 2)
    monkeypatch.setattr(fast_array, "_REFERENCE_BLOCK", 512)
    xp = _module(backend)
    x = _near_ties(5, 1000, 6).astype(dtype)
    y = x if same_set else _near_ties(6, 1000, 6).astype(dtype)
    rows = np.arange(0, 1000, 3)
    x, y, want = _readable_on(x, y, rows, 9, same_set, metric)
    plan = fast_array._Plan.of(1000, 6, 9, same_set, x.dtype.itemsize, 100)
    assert (plan.n_blocks, plan.levels, plan.padded) == (2, 3, 1008), plan  # what is tested
    query = xp.asarray(x)
    reference = query if same_set else xp.asarray(y)
    got = _array_nearest(query, xp.asarray(rows), reference, 9, same_set, metric, 100)
    assert_array_equal(to_numpy(got), want)


def _crowds(seed, n_crowds, size, d, spread):
    """``n_crowds`` generic points, each copied ``size`` times and every copy moved by about
    ``spread`` (relative): below float32's resolution for ``spread`` 1e-10, so the copies'
    float32 scores tie while their float64 distances differ."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n_crowds, d))
    x = np.repeat(base, size, axis=0) * (1.0 + spread * rng.standard_normal((n_crowds * size, d)))
    return x[rng.permutation(x.shape[0])]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_certified_rerank_orders_what_float32_cannot(monkeypatch, backend, metric):
    # Crowds of 6 copies a relative 1e-10 apart: the float32 scores of a crowd are equal, the
    # float64 ones are not. The certificate holds (fewer than EXTRA copies crowd the K-th
    # score) and the float64 re-rank alone puts the copies in the readable order; no query
    # is rescanned.
    xp = _module(backend)
    rescans = []
    real = fast_array._rescan
    monkeypatch.setattr(fast_array, "_rescan", lambda *a: rescans.append(a) or real(*a))
    x = _crowds(7, 60, 6, 5, 1e-10)
    rows = np.arange(x.shape[0])
    x, _, want = _readable_on(x, x, rows, 9, True, metric)
    got = _array_nearest(xp.asarray(x), xp.asarray(rows), xp.asarray(x), 9, True, metric)
    assert_array_equal(to_numpy(got), want)
    assert not rescans
    # Not vacuous: ranked by float32 scores (ties by index) the copies come in another order.
    x32 = (ordered_unit_rows(x) if metric == "cosine" else x).astype(np.float32)
    s32 = np.sum(x32 * x32, axis=1)[None, :] - 2 * x32 @ x32.T
    np.fill_diagonal(s32, np.inf)
    assert np.any(np.argsort(s32, axis=1, kind="stable")[:, :9] != want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_failed_certificates_are_rescanned_exactly(monkeypatch, backend, dtype):
    # Crowds of 50 copies (more than EXTRA) around every query: its K'-th float32 score is
    # within the bound of its K-th, the certificate fails for every query and the ordered
    # rescan gives the readable ranking, ties by index for float32 (the copies round alike).
    xp = _module(backend)
    rescanned = []
    real = fast_array._rescan

    def rescan(request, redo):
        rescanned.append(to_numpy(redo))
        return real(request, redo)

    monkeypatch.setattr(fast_array, "_rescan", rescan)
    x = _crowds(8, 4, 50, 3, 1e-10).astype(dtype)
    labels = np.repeat(np.arange(4), 50)
    rows = np.arange(0, 200, 7)
    x, _, want = _readable_on(x, x, rows, 11, True, "euclidean")
    got = _array_nearest(xp.asarray(x), xp.asarray(rows), xp.asarray(x), 11, True, "euclidean",
                         8)
    assert_array_equal(to_numpy(got), want)
    assert_array_equal(np.concatenate(rescanned), np.arange(rows.size))
    with use_kernels("array"):
        metrics = fast.retrieval_metrics(xp.asarray(x), xp.asarray(labels), k=(1, 11))
    _assert_metrics_close(metrics, ref.retrieval_metrics(x.astype(np.float64), labels,
                                                                   k=(1, 11)))


def test_large_k_runs_the_array_path_in_cpu_mode(monkeypatch):
    # K above MAX_KEEP: the CPU twin declines (IMPLEMENTATIONS' one fallback) and the array path
    # answers, the reference's metrics.
    monkeypatch.setattr(fast_compiled, "nearest_cpu", lambda *a: pytest.fail("CPU twin ran"))
    x, _ = _data(10, 300, 3, 1)
    labels = np.zeros(300, dtype=int)
    with use_kernels("cpu"):
        got = fast.retrieval_metrics(x, labels, k=(1, 5))
    assert got == ref.retrieval_metrics(x, labels, k=(1, 5))


def test_auto_runs_the_cpu_twin_on_numpy(monkeypatch):
    calls = []
    real = fast_compiled.nearest_cpu
    monkeypatch.setattr(fast_compiled, "nearest_cpu", lambda *a: calls.append(1) or real(*a))
    x, labels = _data(11, 60, 4, 5)
    with use_kernels("auto"):
        got = fast.retrieval_metrics(x, labels)
    assert calls and got == ref.retrieval_metrics(x, labels)


def test_measured_names_where_the_choice_is_recorded():
    # Where the measurement behind "auto" is recorded and how to rerun it; no numbers, no
    # machine's paths (they go stale in a docstring-like string nobody reruns).
    measured = fast.IMPLEMENTATIONS.measured
    assert "docs/gpu/kernels.md" in measured
    assert "bench_gpu.py --device cuda --only retrieval" in measured
    assert "bench_gpu.py --only metrics" in measured
    assert not any(ch.isdigit() for ch in measured) and "/work" not in measured


@pytest.mark.requires_cupy
def test_auto_runs_the_array_path_on_cupy(monkeypatch):
    # On the H200 the array path beat the CUDA kernel 3.7x (docs/gpu/kernels.md, which
    # IMPLEMENTATIONS.measured names).
    import cupy

    monkeypatch.setattr(fast_kernels.CudaPath, "nearest",
                        lambda *a: pytest.fail("CUDA kernel ran"))
    x, labels = _data(12, 60, 4, 5)
    with use_kernels("auto"):
        got = fast.retrieval_metrics(cupy.asarray(x), cupy.asarray(labels))
    _assert_metrics_close(got, ref.retrieval_metrics(x, labels))


@pytest.mark.skipif(not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
                    reason="counts host transfers on the CuPy stand-in (REFDML_CUPY_STANDIN=1)")
@pytest.mark.parametrize("chunk_size, block", [(None, 2**20), (25, 64)])
def test_array_path_synchronises_a_fixed_number_of_times(monkeypatch, chunk_size, block):
    # The module docstring's list: K and the check (one transfer), the scored queries (one
    # nonzero), the failed certificates (one nonzero), the metrics (one transfer); the same
    # with 8 query chunks x 4 reference blocks as with one of each: nothing per block.
    import cupy
    import cupy_standin

    from refdml import _backend

    monkeypatch.setattr(_backend, "_CHECKS_ON_DEVICE", False)   # the data checks' reads
    monkeypatch.setattr(fast_array, "_REFERENCE_BLOCK", block)
    x, labels = _data(13, 200, 4, 20, np.float32)
    query, query_labels = cupy.asarray(x), cupy.asarray(labels)
    with use_kernels("array"), cupy_standin.count_transfers() as counter:
        result = fast.retrieval_metrics(query, query_labels, chunk_size=chunk_size)
    assert (counter["tolist"], counter["shape"], counter.total) == (2, 2, 4), counter
    _assert_metrics_close(result, ref.retrieval_metrics(x.astype(np.float64), labels))
