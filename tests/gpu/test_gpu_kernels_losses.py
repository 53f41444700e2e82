"""The masked log-sum-exp Numba kernels (refdml.gpu.losses._compiled, _cuda) against the array path.

``masked_logsumexp`` under ``use_kernels("cpu")`` (CPU twin) and ``use_kernels("cuda")``
(CUDA under the simulator on NumPy arrays, or on a GPU on CuPy arrays: the
``cuda_device_array`` fixture) against ``use_kernels("array")`` and a float64 oracle:
empty rows (-inf, zero weights), ``extra_zero``, all masked, ties, broadcast masks, other
axes, float32 at large magnitudes, entries outside the mask never read (NaN there).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml._backend import to_numpy
from refdml.gpu import use_kernels
from refdml.gpu.losses._kernels import masked_logsumexp
from refdml.gpu._support.launch import BLOCK

pytestmark = pytest.mark.cpu_exact

KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


def _oracle(z, mask, axis, extra_zero):
    """float64 loop-free oracle: ``log(sum_mask exp z [+ 1])`` and the masked softmax."""
    z = np.asarray(z, np.float64)
    mask = np.ones(z.shape, bool) if mask is None else mask
    z, mask = np.broadcast_arrays(z, mask)
    safe = np.where(mask, z, -np.inf)
    peak = np.max(safe, axis=axis, keepdims=True)
    if extra_zero:
        peak = np.maximum(peak, 0.0)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    terms = np.exp(np.where(mask, z - peak, -np.inf))
    total = terms.sum(axis=axis, keepdims=True) + (np.exp(-peak) if extra_zero else 0.0)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + peak
    weights = terms / np.where(total > 0, total, 1.0)
    return np.squeeze(lse, axis=axis), weights


def _run(kind, z, mask, axis=-1, extra_zero=False, cuda_device_array=lambda x: x):
    move = cuda_device_array if kind == "cuda" else (lambda x: x)
    z = move(z)
    with use_kernels(kind):
        lse, weights = masked_logsumexp(z, None if mask is None else move(mask),
                                        axis=axis, extra_zero=extra_zero)
    return to_numpy(lse), to_numpy(weights)


def _check(kind, z, mask, axis=-1, extra_zero=False, cuda_device_array=lambda x: x):
    lse, weights = _run(kind, z, mask, axis, extra_zero, cuda_device_array)
    array_lse, array_weights = _run("array", z, mask, axis, extra_zero)
    want_lse, want_weights = _oracle(z, mask, axis, extra_zero)
    assert lse.dtype == z.dtype and weights.dtype == z.dtype
    assert lse.shape == array_lse.shape and weights.shape == array_weights.shape
    assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    tol = 1e-12 if z.dtype == np.float64 else 1e-6
    # lse relative to its magnitude plus 1 (log(1 + tiny) near 0 is absolute).
    assert_allclose(lse[finite], want_lse[finite], rtol=tol, atol=tol)
    assert_allclose(weights, want_weights, rtol=tol, atol=tol)
    assert_allclose(weights, array_weights, rtol=10 * tol, atol=10 * tol)
    return lse, weights


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extra_zero", [False, True])
def test_masked_rows_empty_rows_and_extra_zero(kind, dtype, extra_zero, cuda_device_array):
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((4, 6)) * 3).astype(dtype)
    mask = rng.random((4, 6)) < 0.5
    mask[1] = False           # an empty row
    mask[2] = True
    z[3, :] = 1.5             # ties
    z[0, ~mask[0]] = np.nan   # never read
    lse, weights = _check(kind, z, mask, extra_zero=extra_zero,
                          cuda_device_array=cuda_device_array)
    # Exact by construction on every device: an empty row's state stays (-inf, 0) and the
    # extra zero makes it (0, 1), whose log is 0 exactly; the weights are written as 0.
    assert lse[1] == (0.0 if extra_zero else -np.inf)
    assert np.all(weights[1] == 0.0) and np.all(weights[~mask] == 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_all_masked_and_no_mask(kind, cuda_device_array):
    z = np.arange(12.0).reshape(3, 4)
    lse, weights = _check(kind, z, np.zeros((3, 4), bool), cuda_device_array=cuda_device_array)
    assert np.all(np.isneginf(lse)) and np.all(weights == 0.0)
    _check(kind, z, None, cuda_device_array=cuda_device_array)


@pytest.mark.parametrize("kind", KINDS)
def test_broadcast_mask_and_other_axis(kind, cuda_device_array):
    rng = np.random.default_rng(1)
    z = rng.standard_normal((3, 1, 5))
    mask = rng.random((1, 2, 5)) < 0.6
    _check(kind, z, mask, axis=-1, cuda_device_array=cuda_device_array)
    _check(kind, rng.standard_normal((5, 3)), rng.random((5, 3)) < 0.5, axis=0,
           cuda_device_array=cuda_device_array)


@pytest.mark.parametrize("kind", KINDS)
def test_float32_at_large_magnitudes(kind, cuda_device_array):
    # exp(z) overflows float32 (and float64) long before |z| = 1e30; the shift keeps it finite.
    z = np.array([[1e30, 1e30 - 1e24, -1e30], [-3e4, -3e4, -1e38], [80.0, 100.0, 120.0]],
                 np.float32)
    lse, weights = _check(kind, z, None, cuda_device_array=cuda_device_array)
    assert np.all(np.isfinite(lse)) and np.all(np.isfinite(weights))
    assert_allclose(weights.sum(axis=1), 1.0, rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_longer_than_a_block(kind, cuda_device_array):
    rng = np.random.default_rng(2)
    z = rng.standard_normal((1, BLOCK + 5)) * 10
    _check(kind, z, rng.random(z.shape) < 0.7, extra_zero=True,
           cuda_device_array=cuda_device_array)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6), k=st.integers(1, 9),
       scale=st.sampled_from([1e-3, 1.0, 50.0, 700.0]), extra_zero=st.booleans(),
       dtype=st.sampled_from([np.float64, np.float32]))
def test_cpu_twin_hypothesis(seed, rows, k, scale, extra_zero, dtype):
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((rows, k)) * scale).astype(dtype)
    if dtype == np.float32 and scale > 80:
        z *= 0.1  # stay where the float32 array path itself is finite
    _check("cpu", z, rng.random((rows, k)) < 0.6, extra_zero=extra_zero)


def test_auto_keeps_the_array_path_on_numpy(monkeypatch):
    """"auto" on NumPy runs the array path (the CPU twin measured slower); the same patch
    fires under "cpu", so it is read by the call and the first half can fail."""
    from refdml.gpu.losses._kernels import KernelPath

    def fail(self, *args, **kwargs):
        raise AssertionError("a compiled kernel ran")

    monkeypatch.setattr(KernelPath, "masked_logsumexp", fail)
    z = np.array([[0.0, np.log(3.0)], [1.0, 1.0]])
    with use_kernels("auto"):
        lse, weights = masked_logsumexp(z, None)
    assert_allclose(lse, [np.log(4.0), 1.0 + np.log(2.0)], rtol=1e-15)
    assert_allclose(weights, [[0.25, 0.75], [0.5, 0.5]], rtol=1e-15)
    with use_kernels("cpu"), pytest.raises(AssertionError, match="a compiled kernel ran"):
        masked_logsumexp(z, None)


def test_one_implementations_object_chooses_by_mode_and_module():
    """IMPLEMENTATIONS: the array path, the CPU twin and the CUDA kernel behind one
    interface; "auto" takes the array path on NumPy and the CUDA kernel on CuPy (the choice
    by module itself: tests/gpu/test_cuda_launch.py)."""
    from refdml.gpu._support.modes import Implementations
    from refdml.gpu.losses import IMPLEMENTATIONS as MASKED_LSE
    from refdml.gpu.losses._array import ArrayPath
    from refdml.gpu.losses._kernels import CpuPath, CudaPath

    assert isinstance(MASKED_LSE, Implementations) and MASKED_LSE.family == "losses"
    assert (MASKED_LSE.auto_numpy, MASKED_LSE.auto_cupy) == ("array", "cuda")
    assert "bench_gpu.py --only lse" in MASKED_LSE.measured
    assert isinstance(MASKED_LSE.array, ArrayPath)
    assert isinstance(MASKED_LSE.cpu, CpuPath) and isinstance(MASKED_LSE.cuda, CudaPath)
    z = np.zeros((2, 3))
    for mode, member in (("auto", MASKED_LSE.array), ("array", MASKED_LSE.array),
                         ("cpu", MASKED_LSE.cpu)):
        with use_kernels(mode):
            assert MASKED_LSE.choose(z) is member


def test_buffers_are_the_cuda_kernels_parameters():
    """The launch's dataclass names the kernel's six parameters, in the kernel's order."""
    from dataclasses import fields

    from refdml.gpu.losses import _cuda as losses_cuda  # noqa: F401  (registers the kernel)
    from refdml.gpu._support.cuda import KERNELS
    from refdml.gpu.losses._compiled import MaskedLseBuffers

    names = tuple(field.name for field in fields(MaskedLseBuffers))
    assert names == tuple(KERNELS["refdml_loss_masked_lse"].parameters)
    assert names == ("z", "mask", "has_mask", "extra_zero", "lse", "weights")
    z, lse = np.zeros((2, 3)), np.zeros(2)
    buffers = MaskedLseBuffers(z=z, mask=None, has_mask=False, extra_zero=True, lse=lse,
                               weights=z)
    args = buffers.args()
    assert args[0] is z and args[4] is lse and args[1:4] == (None, False, True)


def test_kernel_launch_receives_named_buffers():
    """A kernel member hands its launch one MaskedLseBuffers of contiguous rows along
    ``axis`` (a moved axis and a broadcast mask made rows), and reads its results back in
    place."""
    from refdml.gpu.losses._compiled import MaskedLseBuffers
    from refdml.gpu.losses._kernels import KernelPath

    seen = []

    class Recording(KernelPath):
        def launch(self, buffers):
            seen.append(buffers)
            buffers.lse[...] = 7.0
            buffers.weights[...] = np.arange(buffers.weights.size).reshape(
                buffers.weights.shape)

    z = np.arange(6.0).reshape(3, 2)               # rows along axis 0: two rows of three
    mask = np.array([[True], [False], [True]])     # broadcast over the last axis
    lse, weights = Recording().masked_logsumexp(z, mask, axis=0, extra_zero=True)
    (buffers,) = seen
    assert isinstance(buffers, MaskedLseBuffers)
    assert buffers.z.flags.c_contiguous and buffers.mask.flags.c_contiguous
    assert_array_equal(buffers.z, z.T)
    assert_array_equal(buffers.mask, np.array([[True, False, True]] * 2))
    assert (buffers.has_mask, buffers.extra_zero) == (True, True)
    assert_array_equal(lse, [7.0, 7.0])
    assert_array_equal(weights, np.arange(6.0).reshape(2, 3).T)
    # No row to launch over: the array path's answer, no launch.
    empty_lse, empty_w = Recording().masked_logsumexp(np.zeros((0, 3)), None)
    assert len(seen) == 1 and empty_lse.shape == (0,) and empty_w.shape == (0, 3)
