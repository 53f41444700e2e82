"""Parity of the non-differentiable mirrors (greedy k-center, retrieval metrics) with the
reference, on fixed and hypothesis-drawn seeds, NumPy float64 and float32.

They are not catalogue entries (no backward), so they get their own parity tests here,
for the array path and for the compiled CPU twin (the ``kernels`` fixture).
float64: the same metrics as the reference; k-center picks the same up to a near-tie
within the rounding bound of the Gram identity (tests/_kcenter_checks.py: the summation
orders differ), radii within it. float32: compared with the reference run on the
float32-rounded inputs upcast to float64, so only the float32 arithmetic differs; the same
rule with the float32 bound. After a pick that differs the traversals part ways and are no
longer compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _kcenter_checks import assert_same_traversal
from refdml import kcenter as ref_kcenter
from refdml import metrics as ref_metrics
from refdml.gpu import kcenter as fast_kcenter
from refdml.gpu import metrics as fast_metrics
from refdml.gpu import use_kernels

pytestmark = pytest.mark.cpu_exact


@pytest.fixture(autouse=True, params=["array", "cpu"])
def kernels(request):
    """Every parity test of this file runs twice: the array path and the compiled CPU twin
    (refdml.gpu.kcenter._compiled / refdml.gpu.metrics._compiled). The CUDA kernels are held
    to the array path on tiny inputs under the simulator in
    tests/gpu/test_gpu_kernels_{kcenter,retrieval}.py."""
    with use_kernels(request.param):
        yield request.param

# --------------------------------------------------------------------------- k-center


def _assert_same_traversal(fast, ref, points64, *, dtype, initial=None):
    """Same picks until one the rounding bound does not certify, radii within that bound
    (tests/_kcenter_checks.py): float32 squared distances by the Gram identity carry an
    absolute error of a few ulps of ``|x|^2 + |c|^2``, not of the distance (seen: 1.2e-5
    relative at radius 0.16 among points of norm ~8), and float64 ones a few float64 ulps
    (the reference's compiled loop and the mirror's BLAS mat-vec sum in different orders)."""
    assert fast.indices.dtype == np.int64 and fast.radii.dtype == dtype
    assert fast.indices.shape == ref.indices.shape == fast.radii.shape
    assert_same_traversal(fast, ref, points64, initial=initial, dtype=dtype)


def _kcenter_case(seed, dtype, n=240, d=6, k=25, mode="rng"):
    rng = np.random.default_rng(seed)
    points = rng.standard_normal((n, d)) * rng.uniform(0.5, 3.0, size=d)
    points = points.astype(dtype).astype(np.float64)   # the inputs the fast path sees
    kwargs = {"rng": seed}
    if mode == "index":
        kwargs = {"initial": rng.choice(n, size=3, replace=False)}
    elif mode == "centers":
        kwargs = {"initial": rng.standard_normal((4, d)).astype(dtype).astype(np.float64)}
    ref = ref_kcenter.greedy_k_center(points, k, **kwargs)
    fast_kwargs = dict(kwargs)
    if mode == "centers":
        fast_kwargs["initial"] = kwargs["initial"].astype(dtype)
    fast = fast_kcenter.greedy_k_center(points.astype(dtype), k, **fast_kwargs)
    _assert_same_traversal(fast, ref, points, dtype=np.dtype(dtype),
                           initial=kwargs.get("initial"))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", ["rng", "index", "centers"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kcenter_matches_reference(seed, mode, dtype):
    _kcenter_case(seed, dtype, mode=mode)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(3, 2**32 - 1), mode=st.sampled_from(["rng", "index", "centers"]),
       n=st.integers(2, 120), k_fraction=st.floats(0.01, 1.0))
def test_kcenter_matches_reference_hypothesis_seeds(seed, mode, n, k_fraction):
    taken = {"rng": 0, "index": 3, "centers": 0}[mode]
    if n <= taken:
        n = taken + 1
    k = max(1, int(k_fraction * (n - taken)))
    for dtype in (np.float64, np.float32):
        _kcenter_case(seed, dtype, n=n, d=3, k=k, mode=mode)


def test_kcenter_chunk_size_and_large_n_blocks():
    # More points than one block of the initial-centre distances (chunk_size=64).
    rng = np.random.default_rng(5)
    points = rng.standard_normal((300, 5))
    centers = rng.standard_normal((100, 5))
    ref = ref_kcenter.greedy_k_center(points, 12, initial=centers, chunk_size=64)
    fast = fast_kcenter.greedy_k_center(points, 12, initial=centers, chunk_size=64)
    _assert_same_traversal(fast, ref, points, dtype=np.float64, initial=centers)


def test_kcenter_duplicates_are_never_picked_twice():
    # Coordinates 0 and 1: every product and sum is an exact small integer in any order and
    # dtype, so the zeros are exact and the ties go to the lowest index on every path.
    points = np.repeat(np.eye(2), 3, axis=0)
    for dtype in (np.float64, np.float32):
        result = fast_kcenter.greedy_k_center(points.astype(dtype), 6, rng=0)
        assert sorted(result.indices.tolist()) == list(range(6))
        np.testing.assert_array_equal(result.radii[1:], 0.0)
        np.testing.assert_array_equal(
            result.indices, ref_kcenter.greedy_k_center(points, 6, rng=0).indices)


@pytest.mark.parametrize("initial", ["indices", "coordinates", None])
def test_kcenter_array_path_is_the_reference_bit_for_bit_with_duplicates(initial):
    # Equal by construction in float64 on NumPy: the array path does the readable
    # traversal's operations (products, NumPy's fixed-order row sums, no BLAS), so even
    # among many duplicate points (exact ties, lowest index first) picks and radii agree
    # exactly on every CPU; a mat-vec would round the copies by their position.
    rng = np.random.default_rng(11)
    points = rng.standard_normal((300, 7))[rng.integers(40, size=300)]
    kwargs = {"rng": 3}
    if initial == "indices":
        kwargs["initial"] = np.array([5, 17, 200])
    elif initial == "coordinates":
        kwargs["initial"] = points[[5, 17]] + 0.0
    want = ref_kcenter.greedy_k_center(points, 25, **kwargs)
    with use_kernels("array"):
        got = fast_kcenter.greedy_k_center(points, 25, **kwargs)
    np.testing.assert_array_equal(got.indices, want.indices)
    np.testing.assert_array_equal(got.radii, want.radii)
    assert got.initial_radius == want.initial_radius

@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_kcenter_any_scale_float64(scale):
    rng = np.random.default_rng(6)
    points = rng.standard_normal((60, 4))
    unit = fast_kcenter.greedy_k_center(points, 8, rng=2)
    scaled = fast_kcenter.greedy_k_center(points * scale, 8, rng=2)
    # points * scale is rounded (scale is no power of two): the same picks up to a near-tie
    # and the radii of the unit run, scaled, within the rounding bound.
    unit_scaled = fast_kcenter.KCenterResult(unit.indices, unit.radii * scale, unit.initial_radius)
    assert_same_traversal(scaled, unit_scaled, points * scale)


@pytest.mark.parametrize("scale", [1e-30, 1e30])
def test_kcenter_float32_extreme_scale_is_finite(scale):
    rng = np.random.default_rng(7)
    points = (rng.standard_normal((60, 4)) * scale).astype(np.float32)
    result = fast_kcenter.greedy_k_center(points, 8, rng=2)
    ref = ref_kcenter.greedy_k_center(points.astype(np.float64), 8, rng=2)
    _assert_same_traversal(result, ref, points.astype(np.float64), dtype=np.float32)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"points": np.zeros((10, 2)), "k": 0}, ValueError, "k == 0"),
    ({"points": np.zeros((10, 2)), "k": 11}, ValueError, "k == 11"),
    ({"points": np.zeros((10, 2)), "k": 9, "initial": np.arange(2)}, ValueError, "k == 9"),
    ({"points": np.zeros((10, 2)), "k": 2, "initial": np.array([12])}, ValueError, "outside"),
    ({"points": np.zeros((10, 2)), "k": 2, "initial": np.zeros((2, 3))}, ValueError, "dimension"),
    ({"points": np.array([[0.0, np.nan]]), "k": 1}, ValueError, "points must be finite"),
    ({"points": np.zeros(4), "k": 1}, ValueError, "points must have 2"),
    ({"points": "abc", "k": 1}, TypeError, "points"),
    ({"points": np.zeros((4, 2)), "k": 1, "chunk_size": 0}, ValueError, "chunk_size"),
])
def test_kcenter_bad_input_is_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        fast_kcenter.greedy_k_center(**kwargs)


# --------------------------------------------------------------------------- retrieval


def _metrics_case(seed, dtype, *, n=200, d=8, n_classes=30, metric="euclidean", cross=False,
                  duplicates=False, **kwargs):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    if duplicates:
        # Exact ties: every point three times; for Euclidean on a coarse integer grid too
        # (distances exact in either dtype). Not for cosine: directions on a grid tie in
        # exact arithmetic but not after rounding, a near-tie each dtype rounds its own way.
        base = rng.integers(-2, 3, (n // 3, d)).astype(float) if metric == "euclidean" else x[: n // 3]
        x = np.repeat(base, 3, axis=0)
    y = rng.integers(0, n_classes, x.shape[0])
    x = x.astype(dtype)   # the fast path's input; the reference gets it upcast
    args = (x, y)
    if cross:
        r = rng.standard_normal((n // 2, d)).astype(dtype)
        args = (x, y, r, rng.integers(0, n_classes, n // 2))
    ref = ref_metrics.retrieval_metrics(
        *[a.astype(np.float64) if a.dtype.kind == "f" else a for a in args], metric=metric, **kwargs)
    fast = fast_metrics.retrieval_metrics(*args, metric=metric, **kwargs)
    assert fast.keys() == ref.keys()
    for key, value in ref.items():
        assert type(fast[key]) is type(value), key
    # Exact by construction, on NumPy only: the array path and the CPU twin return the
    # readable ranking (certified float64 re-rank), then the reference's NumPy sums. CuPy
    # rows would need tolerances (tests/gpu/test_gpu_kernels_retrieval.py, METRIC_RTOL).
    assert fast == ref


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_match_reference(seed, cross, metric, dtype):
    _metrics_case(seed, dtype, metric=metric, cross=cross)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("metric", ["euclidean", "cosine"])
def test_metrics_exact_ties_lower_index_first(dtype, metric):
    _metrics_case(3, dtype, n=150, d=3, n_classes=6, metric=metric, duplicates=True, k=(1, 2, 5))


@pytest.mark.parametrize("block", [1, 7, 64])
@pytest.mark.parametrize("cross", [False, True])
def test_metrics_running_top_k_over_reference_blocks(monkeypatch, block, cross):
    from refdml.gpu.metrics import _array

    monkeypatch.setattr(_array, "_REFERENCE_BLOCK", block)
    for dtype in (np.float64, np.float32):
        _metrics_case(4, dtype, n=120, d=4, n_classes=8, cross=cross, chunk_size=13)
        _metrics_case(5, dtype, n=120, d=3, n_classes=5, duplicates=True, cross=cross)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(6, 2**32 - 1), metric=st.sampled_from(["euclidean", "cosine"]),
       cross=st.booleans(), n_classes=st.integers(2, 40), chunk=st.integers(1, 300))
def test_metrics_match_reference_hypothesis_seeds(seed, metric, cross, n_classes, chunk):
    for dtype in (np.float64, np.float32):
        _metrics_case(seed, dtype, n=90, d=5, n_classes=n_classes, metric=metric, cross=cross,
                      chunk_size=chunk, k=(1, 3, 10))


@pytest.mark.parametrize("scale", [1e-300, 1e300])
def test_metrics_any_scale_float64(scale):
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((80, 5)), rng.integers(0, 6, 80)
    assert fast_metrics.retrieval_metrics(x * scale, y) == ref_metrics.retrieval_metrics(x, y)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, y: fast_metrics.retrieval_metrics(x, y[:-1]), ValueError, "query_labels"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, y, x), ValueError, "together"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, y, x[:, :2], y), ValueError, "dimension"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, y, metric="l1"), ValueError, "metric"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, y, k=0), ValueError, "k"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, np.arange(10)), ValueError, "no query"),
    (lambda x, y: fast_metrics.retrieval_metrics(x * 0, y, metric="cosine"), ValueError,
     "query has a zero vector"),
    (lambda x, y: fast_metrics.retrieval_metrics(x, y.astype(float) + 0.5), TypeError,
     "query_labels"),
    (lambda x, y: fast_metrics.retrieval_metrics(np.where(x > 1, np.nan, x), y), ValueError,
     "query must be finite"),
])
def test_metrics_bad_input_is_named(call, error, match):
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((10, 3)), rng.integers(0, 3, 10)
    with pytest.raises(error, match=match):
        call(x, y)
