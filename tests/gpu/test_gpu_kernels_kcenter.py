"""The greedy k-center kernels (refdml._compiled.kcenter, refdml._compiled.kcenter_cuda) against the
readable traversal.

The implementations differ only in the order the dot products are summed (the readable
reference: NumPy's pairwise row sums; the compiled twin: a loop vectorised for the CPU
target; the mirror's array path: a BLAS mat-vec), so the picks are compared by
tests/_kcenter_checks.py: equal until a pick that the rounding bound of the Gram identity
does not certify (then both picks must be near-optimal within it), radii within that bound.
float32 (the mirror's CPU twin and CUDA kernel): against the mirror's own array path on the
same float32 input, with the float32 bound. The CUDA kernels run under Numba's CUDA
simulator where there is no GPU (tiny inputs: every thread is a Python thread), on CuPy
arrays on a GPU; the bound covers their FMA contraction and summation order too.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _kcenter_checks import assert_same_traversal
from refdml import kcenter as ref
from refdml.gpu import kcenter as fast
from refdml.gpu import use_kernels

pytestmark = pytest.mark.cpu_exact


def _points(seed, n, d, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, d)) * rng.uniform(0.5, 3.0, size=d)).astype(dtype)


def _kwargs(mode, seed, points):
    rng = np.random.default_rng(seed + 100)
    if mode == "index":
        return {"initial": rng.choice(points.shape[0], size=3, replace=False)}
    if mode == "centers":
        return {"initial": rng.standard_normal((4, points.shape[1])).astype(points.dtype)}
    return {"rng": seed}


def _assert_equal(a, b, points, kwargs, dtype=np.float64):
    assert_same_traversal(a, b, points, initial=kwargs.get("initial"), dtype=dtype)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("mode", ["rng", "index", "centers"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_matches_readable(seed, mode, threads, monkeypatch):
    # Both traversals of the twin: one thread below SERIAL_BELOW entries, Numba's threads
    # (one parallel region per pick) above; the threshold is moved to run each here.
    from refdml._compiled import kcenter as twin

    monkeypatch.setattr(twin, "SERIAL_BELOW", 2**62 if threads == "serial" else 0)
    points = _points(seed, 300, 7)   # not a multiple of BLOCK
    kwargs = _kwargs(mode, seed, points)
    _assert_equal(ref.greedy_k_center(points, 40, **kwargs),
                  ref._greedy_k_center_readable(points, 40, **kwargs), points, kwargs)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), d=st.integers(1, 9),
       mode=st.sampled_from(["rng", "index", "centers"]), scale_exp=st.sampled_from([-300, 0, 300]))
def test_compiled_matches_readable_hypothesis(seed, n, d, mode, scale_exp):
    points = _points(seed, n, d) * 10.0**scale_exp
    kwargs = _kwargs(mode, seed, points) if n > 4 else {"rng": seed}
    if mode == "centers" and n > 4:
        kwargs["initial"] = kwargs["initial"] * 10.0**scale_exp
    k = max(1, min(n - 3, 12)) if "initial" in kwargs and kwargs["initial"].ndim == 1 else min(n, 12)
    _assert_equal(ref.greedy_k_center(points, k, **kwargs),
                  ref._greedy_k_center_readable(points, k, **kwargs), points, kwargs)


def test_ties_duplicates_and_every_point():
    # Duplicated rows and a picking of every point: -1 marks centres, ties go to the lowest
    # index. Once every distinct point is a centre the remaining distances are 0 in exact
    # arithmetic. The readable traversal gets exactly 0 (for x = c, |x|^2 and <x, c> are the
    # same exact products summed in the same order), so it picks the rest in index order on
    # every CPU. The compiled twin sums |x|^2 and <x, c> in two loops that LLVM may vectorise
    # differently: a few ulps of |x|^2 either side of 0, so the order of its zero-distance
    # picks between copies of different points is rounding (assert_same_traversal allows
    # exactly that: a near-tie between distinct points).
    base = _points(3, 5, 3)
    points = np.concatenate([base, base, base[:2]])
    for k in (4, points.shape[0]):
        a = ref.greedy_k_center(points, k, rng=0)
        b = ref._greedy_k_center_readable(points, k, rng=0)
        assert_same_traversal(a, b, points)
        assert sorted(a.indices.tolist()) == sorted(b.indices.tolist())
    assert sorted(a.indices.tolist()) == list(range(points.shape[0]))
    # 5 distinct points: the first 5 picks are one copy of each (a point at distance 0 is
    # never the farthest while another is not), then the exact zeros in index order.
    np.testing.assert_array_equal(b.radii[4:], 0.0)
    rest = sorted(set(range(points.shape[0])) - set(b.indices[:5].tolist()))
    np.testing.assert_array_equal(b.indices[5:], rest)
    sq_bound = 4 * (3 + 3) * np.finfo(np.float64).eps * np.max(np.sum(points**2, axis=1))
    assert np.all(a.radii[4:] ** 2 <= sq_bound)
    # All-ones rows: every product and sum is an exact small integer, on any CPU.
    same = np.ones((7, 2))
    np.testing.assert_array_equal(ref.greedy_k_center(same, 4, initial=np.array([2])).indices,
                                  [0, 1, 3, 4])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", ["rng", "index", "centers"])
def test_mirror_cpu_kernel_matches_array_path(mode, dtype):
    points = _points(5, 257, 6, dtype)
    kwargs = _kwargs(mode, 5, points)
    with use_kernels("array"):
        want = fast.greedy_k_center(points, 30, **kwargs)
    with use_kernels("cpu"):
        got = fast.greedy_k_center(points, 30, **kwargs)
    assert got.radii.dtype == dtype and got.indices.dtype == np.int64
    _assert_equal(got, want, points, kwargs, dtype)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mode", ["rng", "centers"])
def test_mirror_cuda_kernel_matches_array_path(mode, dtype, cuda_device_array):
    from refdml._xp import to_numpy

    points = _points(7, 30, 3, dtype)
    kwargs = _kwargs(mode, 7, points)
    with use_kernels("array"):
        want = fast.greedy_k_center(points, 3, **kwargs)
    host_kwargs = dict(kwargs)
    if "initial" in kwargs:
        kwargs["initial"] = cuda_device_array(kwargs["initial"])
    with use_kernels("cuda"):
        got = fast.greedy_k_center(cuda_device_array(points), 3, **kwargs)
    got = fast.KCenterResult(to_numpy(got.indices), to_numpy(got.radii), got.initial_radius)
    _assert_equal(got, want, points, host_kwargs, dtype)


def test_bad_input_named_on_the_fast_path():
    with pytest.raises(ValueError, match="k == 5"):
        ref.greedy_k_center(np.ones((4, 2)), 5)
    with pytest.raises(ValueError, match="points"):
        ref.greedy_k_center(np.array([[np.nan, 1.0]]), 1)
