"""The greedy k-center kernels (refdml.gpu.kcenter._compiled, refdml.gpu.kcenter._cuda) against the
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
from refdml._backend import get_backend
from refdml.gpu import kcenter as fast
from refdml.gpu import use_kernels
from refdml.gpu.kcenter import _kernels as fast_kernels
from refdml.gpu.kcenter._array import ArrayPath

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


def twin(points, k, **kwargs):
    """The fast path's greedy k-center on its compiled CPU twin (the reference's traversal,
    compiled)."""
    with use_kernels("cpu"):
        return fast.greedy_k_center(points, k, **kwargs)


@pytest.mark.parametrize("threads", ["serial", "parallel"])
@pytest.mark.parametrize("mode", ["rng", "index", "centers"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compiled_matches_readable(seed, mode, threads, monkeypatch):
    # Both traversals of the twin: one thread below SERIAL_BELOW entries, Numba's threads
    # (one parallel region per pick) above; the threshold is moved to run each here.
    from refdml.gpu.kcenter import _compiled as compiled

    monkeypatch.setattr(compiled, "SERIAL_BELOW", 2**62 if threads == "serial" else 0)
    points = _points(seed, 300, 7)   # not a multiple of BLOCK
    kwargs = _kwargs(mode, seed, points)
    _assert_equal(twin(points, 40, **kwargs), ref.greedy_k_center(points, 40, **kwargs),
                  points, kwargs)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 200), d=st.integers(1, 9),
       mode=st.sampled_from(["rng", "index", "centers"]), scale_exp=st.sampled_from([-300, 0, 300]))
def test_compiled_matches_readable_hypothesis(seed, n, d, mode, scale_exp):
    points = _points(seed, n, d) * 10.0**scale_exp
    kwargs = _kwargs(mode, seed, points) if n > 4 else {"rng": seed}
    if mode == "centers" and n > 4:
        kwargs["initial"] = kwargs["initial"] * 10.0**scale_exp
    k = max(1, min(n - 3, 12)) if "initial" in kwargs and kwargs["initial"].ndim == 1 else min(n, 12)
    _assert_equal(twin(points, k, **kwargs), ref.greedy_k_center(points, k, **kwargs),
                  points, kwargs)


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
        a = twin(points, k, rng=0)
        b = ref.greedy_k_center(points, k, rng=0)
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
    for traversal in (twin, ref.greedy_k_center):
        np.testing.assert_array_equal(traversal(same, 4, initial=np.array([2])).indices,
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
    from refdml._backend import to_numpy

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
    for traversal in (twin, ref.greedy_k_center):
        with pytest.raises(ValueError, match="k == 5"):
            traversal(np.ones((4, 2)), 5)
        with pytest.raises(ValueError, match="points"):
            traversal(np.array([[np.nan, 1.0]]), 1)


# ------------------------------------------------------------------ the seam and the kernels
def test_one_implementations_object_chooses_the_traversal_once_per_call(monkeypatch):
    from refdml.gpu._support.modes import Implementations, cuda_simulator

    traversal = fast.IMPLEMENTATIONS
    assert isinstance(traversal, Implementations) and traversal.family == "kcenter"
    # "auto": the paths measured faster (the CPU twin on NumPy, the CUDA kernels on CuPy)
    assert (traversal.auto_numpy, traversal.auto_cupy) == ("cpu", "cuda")
    points = _points(0, 20, 3)
    expected = {"auto": fast_kernels.CpuPath, "array": ArrayPath, "cpu": fast_kernels.CpuPath}
    if cuda_simulator():
        expected["cuda"] = fast_kernels.CudaPath
    for mode, kind in expected.items():
        with use_kernels(mode):
            assert type(traversal.choose(points)) is kind, mode
    # greedy_k_center asks the object once per call, whatever it then runs
    asked = []

    class Counting:
        def choose(self, x):
            asked.append(x.shape)
            return ArrayPath()

    from refdml.gpu.kcenter import _mirrors

    monkeypatch.setattr(_mirrors, "IMPLEMENTATIONS", Counting())
    fast.greedy_k_center(points, 5, initial=np.array([1, 2]))
    assert asked == [(20, 3)]


def test_measured_names_where_the_choice_is_recorded():
    # Where the measurement behind "auto" is recorded and how to rerun it; no numbers, no
    # machine's paths.
    measured = fast.IMPLEMENTATIONS.measured
    assert "docs/gpu/kernels.md" in measured
    assert "bench_gpu.py --device cuda --only kcenter" in measured
    assert "bench_gpu.py --only kcenter" in measured
    assert not any(ch.isdigit() for ch in measured) and "/work" not in measured


def test_step_buffers_are_the_step_kernel_parameters():
    from dataclasses import fields

    from refdml.gpu._support.cuda import KERNELS
    from refdml.gpu.kcenter import _compiled, _cuda  # noqa: F401  (_cuda declares the kernels)

    names = tuple(field.name for field in fields(_compiled.StepBuffers))
    assert names == KERNELS["refdml_kcenter_step"].parameters
    assert KERNELS["refdml_kcenter_prepare"].parameters == ("points", "points_t", "sq_norms")
    values = {name: object() for name in names}
    assert _compiled.StepBuffers(**values).arguments() == tuple(values[n] for n in names)


def _simulated_only():
    from refdml.gpu._support.modes import cuda_simulator

    if not cuda_simulator():
        pytest.skip("bit for bit needs the simulator's arithmetic (a GPU may contract to FMA)")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("n, d, k", [(260, 5, 4), (40, 300, 3)])
def test_cuda_kernels_are_the_sequential_arithmetic_bit_for_bit(n, d, k, dtype):
    # (260, 5): three blocks of BLOCK = 128 threads, so the last-block-done reduction merges
    # several blocks' pairs; (40, 300): d > CENTRE_CHUNK, the centre's row in two chunks.
    # Under the simulator the kernels' float64 arithmetic has no FMA: every pick and radius
    # must be the NumPy oracle's (tests/_kcenter_checks.py) exactly.
    from _kcenter_checks import sequential_traversal
    from refdml.gpu.kcenter import _cuda as kcenter_cuda
    from refdml.gpu._support.launch import BLOCK

    _simulated_only()
    assert n > 2 * BLOCK or d > kcenter_cuda.CENTRE_CHUNK
    points = _points(n + d, n, d, dtype)
    for first, min_sq in ((3, np.full(n, np.inf, dtype=dtype)),
                          (None, np.linspace(0.0, 2.0, n).astype(dtype)[::-1].copy())):
        want = sequential_traversal(points, k, min_sq, first)
        got = fast_kernels.CudaPath().farthest_first(
            get_backend(points), points, k, min_sq.copy(),
            None if first is None else np.array([first]))
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[1].dtype == dtype


@pytest.mark.requires_cuda
def test_cuda_ties_across_blocks_go_to_the_lowest_index(cuda_device_array):
    # Integer coordinates: every product and sum is exact in any order and with FMA, so
    # equal distances are exactly equal. Copies of the farthest points sit in different
    # blocks (indices 5, 133, 257 share a row; so do 6, 134, 258): the blocks' (max, arg-max)
    # pairs tie and the merge must keep the lowest index, as np.argmax does.
    from refdml._backend import to_numpy

    rng = np.random.default_rng(4)
    points = rng.integers(-2, 3, (260, 3)).astype(np.float64)
    points[[5, 133, 257]] = [9.0, 9.0, 9.0]
    points[[6, 134, 258]] = [-9.0, -9.0, -9.0]
    points[0] = 0.0                        # the initial centre: 5 and 6 tie, 5 goes first
    with use_kernels("array"):
        want = fast.greedy_k_center(points, 8, initial=np.array([0]))
    with use_kernels("cuda"):
        got = fast.greedy_k_center(cuda_device_array(points), 8,
                                   initial=cuda_device_array(np.array([0])))
    assert to_numpy(got.indices)[:2].tolist() == [5, 6]
    np.testing.assert_array_equal(to_numpy(got.indices), want.indices)
    np.testing.assert_array_equal(to_numpy(got.radii), want.radii)
    picked = to_numpy(got.indices).tolist()
    assert len(set(picked)) == len(picked)        # a copy of a centre is at 0, never re-picked


@pytest.mark.requires_cuda
def test_cuda_launches_per_call(monkeypatch, cuda_device_array):
    # One launch to lay out the points, then one per pick (update, block arg-max and pick
    # fused): 1 + k, against 1 + 2 k for the first version's separate pick kernel.
    from refdml.gpu._support.profile import launch_profile

    monkeypatch.setenv("REFDML_CUDA_PROFILE", "1")
    points = cuda_device_array(_points(2, 200, 4))
    with use_kernels("cuda"), launch_profile(timing=False) as record:
        fast.greedy_k_center(points, 7, rng=0)
    assert dict(record.launches) == {"refdml_kcenter_prepare": 1, "refdml_kcenter_step": 7}
