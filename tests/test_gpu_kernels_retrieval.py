"""The retrieval top-K kernels (refdml.gpu._nb_retrieval) against the readable ranking.

The compiled CPU twin must return the readable path's neighbours (same indices, same order)
and therefore equal metrics, asserted with ``==``: its float32 stage is certified by a
rounding bound and re-ranked in float64 (module docstring of refdml.gpu._nb_retrieval).
Inputs are generic (Gaussian), so no two float64 distances agree to rounding, plus exact
duplicates (exact ties, lower index first). The CUDA kernel runs under Numba's CUDA
simulator here on a few points (every thread is a Python thread).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml import metrics as ref
from refdml._numerics import common_scale
from refdml.gpu import metrics as fast
from refdml.gpu import use_kernels
from refdml.gpu._nb_retrieval import nearest_cpu


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
        want = ref._retrieval_metrics_readable(x, labels, **kwargs)
    except ValueError as err:
        with pytest.raises(ValueError, match=str(err)[:30]):
            ref.retrieval_metrics(x, labels, **kwargs)
        return
    assert ref.retrieval_metrics(x, labels, **kwargs) == want


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
    assert got == want
    if dtype == np.float32:   # the float64 reference on the float32-rounded input
        ref_kwargs = {key: (v.astype(np.float64) if key == "reference" else v)
                      for key, v in kwargs.items()}
        assert got == ref._retrieval_metrics_readable(x.astype(np.float64), labels, **ref_kwargs)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("same_set", [True, False])
def test_mirror_cuda_kernel_matches_array_path(same_set, metric, dtype, cuda_device_array):
    x, labels = _data(5, 14, 3, 4, dtype, duplicates=1)
    kwargs = {"metric": metric, "k": (1, 2)}
    if not same_set:
        y, y_labels = _data(6, 11, 3, 4, dtype, duplicates=1)
        kwargs.update(reference=y, reference_labels=y_labels)
    with use_kernels("array"):
        want = fast.retrieval_metrics(x, labels, **kwargs)
    dev = {key: (cuda_device_array(v) if key.startswith("reference") else v)
           for key, v in kwargs.items()}
    with use_kernels("cuda"):
        got = fast.retrieval_metrics(cuda_device_array(x), cuda_device_array(labels), **dev)
    assert got == want


def test_bad_input_named_on_the_fast_path():
    with pytest.raises(ValueError, match="query has dimension"):
        ref.retrieval_metrics(np.ones((4, 2)), [0, 0, 1, 1], np.ones((3, 3)), [0, 1, 1])
    with pytest.raises(ValueError, match="no query has a true reference"):
        ref.retrieval_metrics(np.eye(3), [0, 1, 2])


def test_large_k_uses_the_readable_ranking(monkeypatch):
    # K above MAX_KEEP (one class of 300 in same-set mode) runs the readable ranking.
    from refdml.gpu import _nb_retrieval

    monkeypatch.setattr(_nb_retrieval, "MAX_KEEP", 20)
    x, _ = _data(9, 60, 4, 1)
    labels = np.zeros(60, dtype=int)
    called = []
    monkeypatch.setattr(_nb_retrieval, "nearest_cpu", lambda *a, **k: called.append(1))
    want = ref._retrieval_metrics_readable(x, labels)
    assert ref.retrieval_metrics(x, labels) == want and not called
