"""The GSP Numba kernels (refdml.gpu.gsp._compiled, _cuda) against their array-path twin.

CPU twin (``use_kernels("cpu")``) and CUDA kernel (``use_kernels("cuda")``: under Numba's
CUDA simulator on this machine, on CuPy arrays on a GPU) against ``use_kernels("array")``:
forward outputs, every field of the (P2) result, gradients; float64 to 1e-10 and float32
to 2e-5 relative (max abs error / max |array path|). Simulated inputs are tiny (each
simulated launch runs BLOCK Python threads per image). Where a test makes warnings errors
around a launch it uses the ``warnings_as_errors`` fixture (tests/conftest.py), which lets
numba-cuda's low-occupancy note on these small grids pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

from refdml import gsp as reference
from refdml._backend import to_numpy
from refdml.exceptions import ConvergenceWarning
from refdml.gpu import gsp as fast
from refdml.gpu import use_kernels
from refdml.gpu._support.launch import BLOCK

pytestmark = pytest.mark.cpu_exact

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
TOL = {np.float64: 1e-10, np.float32: 2e-5}


def _inputs(rng, batch=2, n=5, m=3, d=4, dtype=np.float64, scale=1.0):
    features = rng.standard_normal((batch, n, d)) * rng.uniform(0.3, 2.0, (batch, n, 1))
    prototypes = rng.standard_normal((m, d)) * rng.uniform(0.5, 1.5, (m, 1))
    return (features * scale).astype(dtype), (prototypes * scale).astype(dtype)


def _device(x, kind, cuda_device_array):
    return cuda_device_array(x) if kind == "cuda" else x


def _close(actual, expected, tol, what, floor=0.0):
    """Max abs error relative to ``max(max |expected|, floor)`` (``floor``: the scale of a
    gradient that is exactly 0 and computed as rounding noise, e.g. n = m = 1). Equal
    infinities agree (``log_s = -inf`` where ε c overflows on both paths); the scale is
    taken over the finite entries."""
    actual, expected = to_numpy(actual), to_numpy(expected)
    assert actual.dtype == expected.dtype, what
    finite = np.isfinite(expected)
    peak = max(float(np.max(np.abs(expected[finite]), initial=0.0)), floor,
               np.finfo(expected.dtype).tiny)
    with np.errstate(invalid="ignore"):
        difference = np.where(actual == expected, 0.0, np.abs(actual - expected))
    error = float(np.max(difference)) / peak if expected.size else 0.0
    assert error <= tol, f"{what}: relative error {error:.3e} > {tol:g}"


def _run(kind, features, prototypes, d_pooled, d_z, **args):
    with use_kernels(kind):
        (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, **args)
        grads = fast.gsp_pool_backward(ctx, d_pooled, d_z)
    return pooled, z, ctx, grads


def _compare_pool(kind, features, prototypes, tol, cuda_device_array=None, **args):
    rng = np.random.default_rng(7)
    batch, dim, m = features.shape[0], features.shape[2], prototypes.shape[0]
    d_pooled = rng.standard_normal((batch, dim)).astype(features.dtype)
    d_z = rng.standard_normal((batch, m)).astype(features.dtype)
    move = (lambda x: _device(x, kind, cuda_device_array)) if cuda_device_array else (lambda x: x)
    got = _run(kind, *(move(a) for a in (features, prototypes, d_pooled, d_z)), **args)
    want = _run("array", features, prototypes, d_pooled, d_z, **args)
    floor = max(float(np.max(np.abs(to_numpy(g)))) for g in vars(want[3]).values())
    for name, a, b in (("pooled", got[0], want[0]), ("z", got[1], want[1]),
                       ("d features", got[3].features, want[3].features),
                       ("d prototypes", got[3].prototypes, want[3].prototypes),
                       ("cost", got[2].cost.cost, want[2].cost.cost)):
        _close(a, b, tol, name, floor if name.startswith("d ") else 0.0)
    _compare_result(got[2].transport, want[2].transport, tol)
    return got, want


def _transport_on_kernel_and_array(kind, cuda_device_array, cost, args, d_rho, d_pi, *,
                                   kernel_warnings=contextlib.nullcontext):
    """``(result, gradients)`` of :func:`fast.weight_transport` and its backward on the
    ``kind`` kernel, then on the array path; the kernel run is inside ``kernel_warnings()``
    (the ``warnings_as_errors`` fixture: any warning of it an error; default: the suite's
    own filters)."""
    with use_kernels(kind), kernel_warnings():
        got = fast.weight_transport(_device(cost, kind, cuda_device_array), **args)
        got_grad = fast.weight_transport_backward(
            got, _device(d_rho, kind, cuda_device_array), _device(d_pi, kind, cuda_device_array))
    with use_kernels("array"):
        want = fast.weight_transport(cost, **args)
        want_grad = fast.weight_transport_backward(want, d_rho, d_pi)
    return (got, got_grad), (want, want_grad)


def _compare_result(got, want, tol):
    for name in ("rho", "pi", "transported", "assignment", "log_s"):
        _close(getattr(got, name), getattr(want, name), tol, name)
    assert got.converged == want.converged
    assert got.tol == want.tol
    assert float(np.max(to_numpy(got.residual))) <= got.tol
    assert (got.method, got.mu, got.inverse_temperature) == (
        want.method, want.mu, want.inverse_temperature)


KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [1.0, 3.0])
def test_pool_kernel_matches_array_path(kind, dtype, p, cuda_device_array):
    if kind == "cuda" and p > 1.0 and dtype == np.float32 and SIMULATED:
        pytest.skip("simulator time: GeMean float32 on CUDA runs in the parity suite")
    features, prototypes = _inputs(np.random.default_rng(0), dtype=dtype)
    if p > 1.0:
        features = np.abs(features)
    got, want = _compare_pool(kind, features, prototypes, TOL[dtype], cuda_device_array,
                              mu=0.3, inverse_temperature=5.0, p=p)
    assert got[0].dtype == dtype and got[3].features.dtype == dtype


@pytest.mark.parametrize("kind", KINDS)
def test_n_iter_is_the_references_count(kind, cuda_device_array):
    features, prototypes = _inputs(np.random.default_rng(3))
    _, ref_ctx = reference.gsp_pool_forward(features, prototypes, mu=0.4, inverse_temperature=3.0)
    # A count is a discrete outcome of a threshold test: two implementations that round
    # differently could stop one step apart if a residual landed within rounding of tol.
    # Certify this input first: the reference's count is the same at tol / 4 and 4 tol, so
    # every residual is far (a factor 4) from the threshold and rounding cannot flip a stop.
    for tol in (2.5e-13, 4e-12):
        _, ctx_tol = reference.gsp_pool_forward(features, prototypes, mu=0.4,
                                                inverse_temperature=3.0, tol=tol)
        assert ctx_tol.transport.n_iter == ref_ctx.transport.n_iter
    with use_kernels(kind):
        _, ctx = fast.gsp_pool_forward(_device(features, kind, cuda_device_array),
                                       _device(prototypes, kind, cuda_device_array),
                                       mu=0.4, inverse_temperature=3.0)
    assert ctx.transport.n_iter == ref_ctx.transport.n_iter
    assert_allclose(to_numpy(ctx.transport.log_t), ref_ctx.transport.log_t, rtol=1e-10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", KINDS)
def test_weight_transport_kernel_matches_array_path(kind, dtype, cuda_device_array):
    rng = np.random.default_rng(2)
    cost = rng.uniform(0.0, 2.0, (2, 3, 5)).astype(dtype)
    args = dict(mu=0.4, inverse_temperature=3.0)
    d_rho = rng.standard_normal((2, 5)).astype(dtype)
    d_pi = rng.standard_normal((2, 3, 5)).astype(dtype)
    (got, got_grad), (want, want_grad) = _transport_on_kernel_and_array(
        kind, cuda_device_array, cost, args, d_rho, d_pi)
    _compare_result(got, want, TOL[dtype])
    _close(got.log_t, want.log_t, TOL[dtype], "log_t")
    _close(got_grad.cost, want_grad.cost, TOL[dtype], "d cost")


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 3), n=st.integers(1, 9),
    # d >= 2: at d = 1 a feature and a prototype outside the ball clip to the same pole, the
    # array path's fbar = f * (1 / |f|) rounds to 1 - ulp, c = 1e-16 instead of 0, and the
    # gradient there is rounding noise on every path (the array path is 8e-3 off the
    # reference there too; docs/gpu/kernels.md, "Numba kernels: GSP per image, masked
    # log-sum-exp").
    m=st.integers(1, 6), d=st.integers(2, 5), mu=st.floats(0.05, 0.95),
    inverse_temperature=st.floats(0.1, 20.0), p=st.sampled_from([1.0, 2.0]),
)
def test_cpu_twin_matches_array_path_hypothesis(seed, batch, n, m, d, mu, inverse_temperature, p):
    features, prototypes = _inputs(np.random.default_rng(seed), batch, n, m, d)
    if p > 1.0:
        features = np.abs(features)
    _compare_pool("cpu", features, prototypes, 1e-9, mu=mu,
                  inverse_temperature=inverse_temperature, p=p)


@pytest.mark.requires_cuda
@settings(max_examples=2)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), m=st.integers(1, 4),
       mu=st.floats(0.05, 0.95))
def test_cuda_kernel_matches_array_path_hypothesis(seed, n, m, mu, cuda_device_array):
    features, prototypes = _inputs(np.random.default_rng(seed), 1, n, m, 3)
    _compare_pool("cuda", features, prototypes, 1e-9, cuda_device_array, mu=mu,
                  inverse_temperature=4.0)


HUGE = (1e16, 1e100, 1e300, float(np.finfo(np.float64).max))


@pytest.mark.parametrize("inverse_temperature", HUGE)
@pytest.mark.parametrize("kind", KINDS)
def test_kernels_match_array_path_and_reference_at_huge_inverse_temperature(
    kind, inverse_temperature, cuda_device_array, warnings_as_errors
):
    # Half the costs within 4 / ε of 0 (moderate logits among them), the rest O(1) away
    # (saturated): the pivot search, the window and the plateau all run. The constraints
    # hold to rounding, and the three paths agree with the reference.
    rng = np.random.default_rng(21)
    shape = (2, 3, 5)
    near = rng.uniform(0.0, 4.0, shape) / inverse_temperature
    cost = np.where(rng.random(shape) < 0.5, near, rng.uniform(0.5, 2.0, shape))
    args = dict(mu=0.45, inverse_temperature=inverse_temperature)
    d_rho, d_pi = rng.standard_normal((2, 5)), rng.standard_normal(shape)
    (got, got_grad), (want, want_grad) = _transport_on_kernel_and_array(
        kind, cuda_device_array, cost, args, d_rho, d_pi, kernel_warnings=warnings_as_errors)
    _compare_result(got, want, 1e-10)
    _close(got_grad.cost, want_grad.cost, 1e-10, "d cost")
    ref = reference.weight_transport(cost, **args)
    assert float(np.max(to_numpy(got.residual))) <= 1e-14
    for name in ("rho", "pi"):
        _close(getattr(got, name), getattr(ref, name), 1e-13, name)
    _close(got_grad.cost, reference.weight_transport_backward(ref, d_rho, d_pi).cost, 1e-9,
           "d cost vs reference")
    features, prototypes = _inputs(np.random.default_rng(22))
    _compare_pool(kind, features, prototypes, 1e-10, cuda_device_array, mu=0.3,
                  inverse_temperature=inverse_temperature)


# The column maths the pool backward's CPU twin calls (compiled functions): their Python
# source runs instead where the twin runs on Contracting floats.
_POOL_BACKWARD_HELPERS = ("pool_backward_column", "_marginal_centre", "cost_gradient",
                          "distance_weight", "clip_coefficient", "nonfinite")


def _with_cpu_twin(monkeypatch, **twins):
    """Make ``use_kernels("cpu")`` run the given CPU twins (``pool_backward=...``) in place
    of the kernel table's: a CPU path built on the swapped table, installed as the CPU
    member of :data:`refdml.gpu.gsp.IMPLEMENTATIONS` (the object every public call chooses
    from)."""
    from refdml.gpu.gsp import _kernels as _gsp_kernels

    twins_table = fast.IMPLEMENTATIONS.cpu.table
    table = dataclasses.replace(twins_table, **{
        name: dataclasses.replace(getattr(twins_table, name), function=twin)
        for name, twin in twins.items()})
    _install_cpu(monkeypatch, _gsp_kernels.CpuPath(table))


def _install_cpu(monkeypatch, path):
    """Make ``path`` the CPU member of the implementations object the public calls choose
    from."""
    from refdml.gpu.gsp import _mirrors

    monkeypatch.setattr(_mirrors, "IMPLEMENTATIONS",
                        dataclasses.replace(_mirrors.IMPLEMENTATIONS, load_cpu=lambda: path))


def _contracting_pool_backward(monkeypatch):
    """Make ``use_kernels("cpu")``'s pool backward run the twin's Python source on
    :class:`Contracting` floats (every product fused into the sum or difference that uses
    it, as ptxas does on a GPU), its outputs rounded into the arrays the caller reads.
    Returns the list of its calls (one entry per launch), so that a test can see it ran."""
    from _contraction import contracting, rounded

    from refdml.gpu.gsp import _compiled as _nb_gsp

    for name in _POOL_BACKWARD_HELPERS:
        monkeypatch.setattr(_nb_gsp, name, getattr(_nb_gsp, name).py_func)
    source = _nb_gsp.pool_backward_cpu.py_func
    calls = []

    def twin(*args):
        *inputs, distance_weights, d_features, column_sums, status = args
        inputs = [contracting(a) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a
                  for a in inputs]
        outputs = (distance_weights, d_features, column_sums)
        written = [np.empty(a.shape, dtype=object) for a in outputs]
        source(*inputs, *written, status)         # status: the twin's int64 checks, as given
        for output, values in zip(outputs, written):
            output[...] = rounded(values)
        calls.append(len(args))

    _with_cpu_twin(monkeypatch, pool_backward=twin)
    return calls


@pytest.mark.parametrize("inverse_temperature", HUGE)
def test_pool_backward_does_not_depend_on_fma_contraction(inverse_temperature, monkeypatch):
    # The CUDA kernel's d features were 4e-18 ε off on an H200 (docs/gpu/hardware-failures.md,
    # "The six hardware-only failures"): d_z_i / mu - d_z_top / mu, contracted into one FMA, is the
    # product's rounding error at i = top instead of 0, and d_cost = -ε A (...) scales it.
    # The kernel and its CPU twin share this source; run on floats that contract as ptxas
    # does, the twin must give what it gives compiled (no contraction) and the array path.
    features, prototypes = _inputs(np.random.default_rng(22), batch=1)
    args = dict(mu=0.3, inverse_temperature=inverse_temperature)
    rng = np.random.default_rng(7)
    d_pooled, d_z = rng.standard_normal((1, 4)), rng.standard_normal((1, 3))
    _, _, _, compiled = _run("cpu", features, prototypes, d_pooled, d_z, **args)
    _, _, _, array = _run("array", features, prototypes, d_pooled, d_z, **args)
    calls = _contracting_pool_backward(monkeypatch)
    _, _, _, fused = _run("cpu", features, prototypes, d_pooled, d_z, **args)
    assert calls, "the contracting twin did not run"
    floor = max(float(np.max(np.abs(g))) for g in vars(array).values())
    for name in ("features", "prototypes"):
        _close(getattr(fused, name), getattr(compiled, name), 1e-12, f"d {name}", floor)
        _close(getattr(fused, name), getattr(array, name), 1e-10, f"d {name}", floor)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_overflow_is_named_as_on_the_array_path(kind, cuda_device_array):
    # An exact tie of the cost at ε = 1e38 on float32: d pi / d c ~ ε / 4 overflows float32.
    cost = np.array([[[0.5, 1.0], [0.5, 2.0]]], np.float32)
    d_pi = np.array([[[1e3, 0.0], [-1e3, 0.0]]], np.float32)
    with use_kernels(kind), warnings.catch_warnings():
        if kind == "cuda" and SIMULATED:
            # The simulator stores a float64 into a float32 array by a NumPy cast, which
            # warns where the device silently stores inf.
            warnings.filterwarnings("ignore", "overflow encountered in cast", RuntimeWarning)
        result = fast.weight_transport(_device(cost, kind, cuda_device_array), mu=0.5,
                                       inverse_temperature=1e38)
        with pytest.raises(ValueError, match="d_cost overflows float32: inverse_temperature"):
            fast.weight_transport_backward(result, None, _device(d_pi, kind, cuda_device_array))


@settings(max_examples=15)
@given(
    seed=st.integers(0, 2**32 - 1), batch=st.integers(1, 3), n=st.integers(1, 9),
    m=st.integers(1, 6), d=st.integers(2, 5), mu=st.floats(0.05, 0.95),
    log10_inverse_temperature=st.floats(0.0, 308.0),
)
def test_cpu_twin_matches_array_path_at_any_inverse_temperature_hypothesis(
    seed, batch, n, m, d, mu, log10_inverse_temperature
):
    features, prototypes = _inputs(np.random.default_rng(seed), batch, n, m, d)
    _compare_pool("cpu", features, prototypes, 1e-9, mu=mu,
                  inverse_temperature=10.0 ** log10_inverse_temperature)


@pytest.mark.parametrize("kind", KINDS)
def test_more_columns_than_threads_in_a_block(kind, cuda_device_array):
    # n = BLOCK + 3: threads stride over columns, every reduction slot holds data.
    features, prototypes = _inputs(np.random.default_rng(4), batch=1, n=BLOCK + 3, m=2, d=2)
    _compare_pool(kind, features, prototypes, 1e-10, cuda_device_array, mu=0.5,
                  inverse_temperature=2.0)


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_cpu_twin_at_extreme_scales(scale):
    features, prototypes = _inputs(np.random.default_rng(5), scale=scale)
    _compare_pool("cpu", features, prototypes, 1e-10, mu=0.3, inverse_temperature=5.0)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("scale", [1e-300, 1e300])
def test_cuda_kernel_at_extreme_scales(scale, cuda_device_array):
    # Squares below and beyond float64's range: the clip kernel's rows divided by their
    # largest entry first (clip_row), the scale s a power of two far from 1.
    features, prototypes = _inputs(np.random.default_rng(5), scale=scale)
    _compare_pool("cuda", features, prototypes, 1e-10, cuda_device_array, mu=0.3,
                  inverse_temperature=5.0)


@pytest.mark.parametrize("kind", KINDS)
def test_points_the_kernels_cannot_clip_are_named_as_on_the_array_path(kind, cuda_device_array):
    # The clip kernel stores a norm beyond float32 as inf and the largest norm as a peak; the
    # data check of both (one read) names them with the array path's messages.
    features, prototypes = _inputs(np.random.default_rng(16), dtype=np.float32)
    huge = features.copy()
    huge[1, 2, :2] = 3e38
    with warnings.catch_warnings():
        if kind == "cuda" and SIMULATED:
            # the device stores the norm beyond float32 as inf silently; the simulator's
            # NumPy casts warn
            warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        with use_kernels(kind), pytest.raises(ValueError, match=r"^features\[\(1, 2\)\] has "
                                                                r"norm 4.24e\+38, beyond "
                                                                r"float32's range"):
            fast.gsp_pool_forward(_device(huge, kind, cuda_device_array),
                                  _device(prototypes, kind, cuda_device_array), mu=0.3,
                                  inverse_temperature=5.0)
    with np.errstate(under="ignore"):
        tiny_features, tiny_prototypes = (1e-40 * features).astype(np.float32), (
            1e-40 * prototypes).astype(np.float32)
    with use_kernels(kind), pytest.raises(ValueError, match=r"^features and prototypes: their "
                                                            r"largest norm is .*, below float32"):
        fast.gsp_pool_forward(_device(tiny_features, kind, cuda_device_array),
                              _device(tiny_prototypes, kind, cuda_device_array), mu=0.3,
                              inverse_temperature=5.0)


@pytest.mark.parametrize("kind", KINDS)
def test_feature_on_a_prototype_takes_the_zero_subgradient(kind, cuda_device_array):
    features, prototypes = _inputs(np.random.default_rng(6))
    features[0, 1] = prototypes[2] / max(1.0, float(np.linalg.norm(prototypes[2])))
    got, _ = _compare_pool(kind, features, prototypes, 1e-10, cuda_device_array, mu=0.3,
                           inverse_temperature=5.0)
    assert np.all(np.isfinite(to_numpy(got[3].features)))
    assert np.all(np.isfinite(to_numpy(got[3].prototypes)))


@pytest.mark.parametrize("kind, inverse_temperature",
                         [("cpu", 50.0), ("cpu", 200.0),
                          pytest.param("cuda", 200.0, marks=pytest.mark.requires_cuda)])
def test_float32_finite_and_converged_at_large_inverse_temperature(
    kind, inverse_temperature, cuda_device_array, warnings_as_errors
):
    features, prototypes = _inputs(np.random.default_rng(8), dtype=np.float32)
    args = dict(mu=0.3, inverse_temperature=inverse_temperature)
    with warnings_as_errors():
        pooled, z, ctx, grads = _run(
            kind, *(_device(a, kind, cuda_device_array) for a in (
                features, prototypes, np.ones((2, 4), np.float32), np.ones((2, 3), np.float32))),
            **args)
    assert ctx.transport.converged
    for a in (pooled, z, grads.features, grads.prototypes, ctx.transport.pi):
        assert np.all(np.isfinite(to_numpy(a)))
    (ref_pooled, ref_z), _ = reference.gsp_pool_forward(
        features.astype(np.float64), prototypes.astype(np.float64), **args)
    _close(to_numpy(pooled).astype(np.float64), ref_pooled, 1e-4, "pooled")
    _close(to_numpy(z).astype(np.float64), ref_z, 1e-4, "z")


def test_overflowing_inverse_temperature_times_cost_is_solved_as_the_array_path():
    # Column minima 0 and 2: ε (2 - 0) = 6e38 overflows float32 (and 1e300 is not a float32
    # at all): the weight it governs is exactly 0. n mu = 0.6 of feature 0 (cost 0) is
    # transported, none of feature 1: w = (2, 0), pooled = (2 f_0 + 0) / 2 = f_0, z = 1.
    features = np.array([[[1.0, 0.0], [-1.0, 0.0]]], np.float32)
    prototypes = np.array([[1.0, 0.0]], np.float32)
    for inverse_temperature in (3e38, 1e300):
        for kind in ("cpu", "array"):
            with use_kernels(kind), warnings.catch_warnings():
                warnings.simplefilter("error")
                (pooled, z), ctx = fast.gsp_pool_forward(
                    features, prototypes, mu=0.3, inverse_temperature=inverse_temperature)
                grads = fast.gsp_pool_backward(ctx, np.ones((1, 2), np.float32), None)
            assert ctx.transport.converged
            assert_allclose(pooled, [[1.0, 0.0]], rtol=1e-6)
            assert_allclose(z, [[1.0]], rtol=1e-6)
            assert_allclose(grads.features, [[[1.0, 1.0], [0.0, 0.0]]], rtol=1e-6)


def test_convergence_warning_and_tol_zero_as_the_array_path():
    features, prototypes = _inputs(np.random.default_rng(10))
    with use_kernels("cpu"), pytest.warns(ConvergenceWarning, match="reached max_iter == 1"):
        _, ctx = fast.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=5.0,
                                       max_iter=1)
    assert not ctx.transport.converged
    with use_kernels("cpu"), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ctx = fast.gsp_pool_forward(features, prototypes, mu=0.3, inverse_temperature=5.0,
                                       tol=0.0)
    assert ctx.transport.tol == 0.0


@pytest.mark.parametrize("max_iter", [1, 100])
def test_the_solve_summary_is_read_when_the_deferral_hook_reads_it(max_iter, monkeypatch):
    # The kernels hand their (B, 4) counts to read_later (refdml._deferred): inside a training
    # step the read comes later, and until then the result holds the per-image columns; the
    # read then gives what an immediate one gives (the n_iter, converged and warning of a
    # call outside a step), and nothing warns before it.
    from refdml.gpu.gsp import _kernels

    features, prototypes = _inputs(np.random.default_rng(10))
    args = dict(mu=0.3, inverse_temperature=5.0, max_iter=max_iter)
    with use_kernels("cpu"), warnings.catch_warnings(record=True) as now:
        warnings.simplefilter("always")
        _, at_once = fast.gsp_pool_forward(features, prototypes, **args)
    pending = []
    monkeypatch.setattr(_kernels, "read_later", lambda values, on_read: pending.append(
        (values, on_read)))
    with use_kernels("cpu"), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, deferred = fast.gsp_pool_forward(features, prototypes, **args)
    (values, on_read), = pending
    result = deferred.transport
    assert values.shape == (features.shape[0], 4) and values.dtype == np.int64
    assert not np.any(values[:, 3])             # the points' check: these points are fine
    host = to_numpy(values).astype(np.float64).ravel()   # as refdml._deferred hands them
    assert_allclose(result.n_iter, values[:, 0])
    assert_allclose(result.converged, values[:, 2])
    assert np.max(result.n_iter) == at_once.transport.n_iter
    assert bool(np.all(result.converged)) == at_once.transport.converged
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        on_read(host, "epoch 0, step 3")

    def messages(caught):
        return [str(w.message) for w in caught if w.category is ConvergenceWarning]

    assert messages(later) == [f"{text} (at epoch 0, step 3)" for text in messages(now)]
    assert bool(messages(now)) == (max_iter == 1)


def test_mu_one_runs_the_array_path():
    features, prototypes = _inputs(np.random.default_rng(11))
    with use_kernels("cpu"):
        (pooled, _), ctx = fast.gsp_pool_forward(features, prototypes, mu=1.0,
                                                 inverse_temperature=5.0)
    assert_allclose(pooled, features.mean(axis=1), rtol=1e-12)
    assert ctx.transport.n_iter == 0


def test_bad_upstream_is_named_on_the_kernel_path():
    features, prototypes = _inputs(np.random.default_rng(12))
    with use_kernels("cpu"):
        (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, mu=0.3,
                                                 inverse_temperature=5.0)
        with pytest.raises(ValueError, match="d_z has shape"):
            fast.gsp_pool_backward(ctx, pooled, z[:, :1])


class _RefusingPath:
    """A GSP implementation whose every operation fails: where it is chosen, a call says so."""

    def __getattr__(self, name):
        def refuse(*args, **kwargs):
            raise AssertionError(f"the CPU twins' {name} ran")
        return refuse


def _layer_and_transport(features, prototypes):
    (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, mu=0.3,
                                             inverse_temperature=5.0)
    fast.gsp_pool_backward(ctx, pooled, z)
    result = fast.weight_transport(ctx.cost.cost, mu=0.3, inverse_temperature=5.0)
    fast.weight_transport_backward(result, result.rho, result.pi)


def test_auto_keeps_the_array_path_on_numpy(monkeypatch):
    # IMPLEMENTATIONS.auto_numpy == "array" (the CPU twins measured no faster): "auto" never
    # asks the CPU member on NumPy input, while "cpu" does (so the swap below is what calls
    # read).
    _install_cpu(monkeypatch, _RefusingPath())
    features, prototypes = _inputs(np.random.default_rng(13))
    with use_kernels("auto"):
        _layer_and_transport(features, prototypes)
    with use_kernels("cpu"), pytest.raises(AssertionError, match="CPU twins' pool_forward ran"):
        _layer_and_transport(features, prototypes)
    assert fast.IMPLEMENTATIONS.auto_numpy == "array"
    assert fast.IMPLEMENTATIONS.auto_cupy == "cuda"


@pytest.mark.parametrize("mu", [1.0, 2.0**-101])
def test_mu_outside_the_kernels_range_takes_the_array_path(mu, monkeypatch):
    # mu = 1 (no solve) and float32 below _SMALL_MU (solved in float64) have the array path
    # only, whatever the mode.
    _install_cpu(monkeypatch, _RefusingPath())
    features, prototypes = _inputs(np.random.default_rng(13), dtype=np.float32)
    with use_kernels("cpu"):
        (pooled, z), ctx = fast.gsp_pool_forward(features, prototypes, mu=mu,
                                                 inverse_temperature=5.0)
        fast.gsp_pool_backward(ctx, pooled, z)


# --------------------------------------------------------------------------- named parameters
def test_kernel_parameters_are_the_launch_dataclasses_fields():
    # Each GSP kernel's launch passes dataclasses whose fields, in order, are the kernel's
    # parameters: the CUDA kernel's as registered, and the CPU twin's (the same without the
    # CUDA kernel's scratch).
    import inspect

    from refdml.gpu._support.cuda import KERNELS as REGISTERED

    cpu_table = fast.IMPLEMENTATIONS.cpu.table
    cuda_table = fast.IMPLEMENTATIONS.cuda.table          # builds the CUDA member: registers
    names = [field.name for field in dataclasses.fields(cpu_table)]
    registered = {name: k for name, k in REGISTERED.items() if name.startswith("refdml_gsp_")}
    assert sorted(registered) == sorted(f"refdml_gsp_{name}" for name in names)
    for name in names:
        cpu_kernel, cuda_kernel = getattr(cpu_table, name), getattr(cuda_table, name)
        cuda_parameters = registered[f"refdml_gsp_{name}"].parameters
        assert cuda_kernel.parameters() == cuda_parameters, name
        cpu_parameters = tuple(inspect.signature(cpu_kernel.function.py_func).parameters)
        assert cpu_kernel.parameters() == cpu_parameters, name
        assert cpu_parameters == tuple(p for p in cuda_parameters if p != "scratch"), name
        assert ("scratch" in cuda_parameters) == cuda_kernel.scratch, name
        assert not any("eps" in p.split("_") for p in cuda_parameters), name


def test_a_launch_refuses_groups_out_of_its_layout():
    from refdml.gpu.gsp._compiled import TransportInput

    kernel = fast.IMPLEMENTATIONS.cpu.table.transport
    with pytest.raises(TypeError, match=r"takes \['TransportInput', 'SolverConstants', "
                                        r"'ImageOutputs'\], got \['TransportInput'\]"):
        kernel.args((TransportInput(np.zeros((1, 1, 1))),))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [1.0, 1.5])
def test_float32_features_near_its_largest_number(kind, p, cuda_device_array,
                                                  warnings_as_errors):
    # Weights up to ~4 (mu = 0.05) times features near 3.3e38: the CPU twin's float32
    # products w_j f_j gave inf (pooled inf); the backward's d_weights ~ |f| |d_pooled| and
    # W = d_cost / c' left float32 (warnings, or a false "d_cost overflows" error) where
    # the gradients do not. Kernel and array path agree, and both with the reference.
    rng = np.random.default_rng(30)
    # Norms 1.5e38; feature 0 points near prototype 0 (cost ~0.1, off the kink at 0): at
    # mu = 0.05 and ε = 10 it takes most of the weight: w_0 f_0 is beyond float32 (asserted),
    # the outputs and gradients are not (below 0.5 of its largest number here).
    features = np.abs(rng.standard_normal((2, 5, 3))) + 0.1
    prototypes = np.abs(rng.standard_normal((3, 3))) + 0.1
    prototypes /= np.linalg.norm(prototypes, axis=-1, keepdims=True)
    features[:, 0] = prototypes[0] + 0.1 * np.array([1.0, -1.0, 0.5])
    features *= 1.5e38 / np.linalg.norm(features, axis=-1, keepdims=True)
    d_pooled, d_z = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    args = dict(mu=0.05, inverse_temperature=10.0, p=p)
    (ref_pooled, ref_z), ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    ref = reference.gsp_pool_backward(ref_ctx, d_pooled, d_z)
    assert np.max(ref_ctx.weights[:, :, None] * features) > np.finfo(np.float32).max
    move = lambda x: _device(x.astype(np.float32), kind, cuda_device_array)  # noqa: E731
    with warnings_as_errors():
        if kind == "cuda" and SIMULATED:
            # The float32 backward overflows by design and is redone in float64; the device
            # carries that inf (and inf - inf) silently, the simulator's NumPy scalars warn.
            warnings.filterwarnings("ignore", "(overflow|invalid value) encountered",
                                    RuntimeWarning)
        pooled, z, _, grads = _run(kind, *(move(a) for a in (features, prototypes, d_pooled,
                                                             d_z)), **args)
    for got, want, what in ((pooled, ref_pooled, "pooled"), (z, ref_z, "z"),
                            (grads.features, ref.features, "d features"),
                            (grads.prototypes, ref.prototypes, "d prototypes")):
        _close(to_numpy(got).astype(np.float64), want, 2e-5, what)


def test_float32_gradient_beyond_float32_is_named_on_both_paths():
    # The reference's prototype gradient is ~4e38 here: beyond float32, named (once an
    # error that blamed inverse_temperature, or a RuntimeWarning).
    rng = np.random.default_rng(31)
    features = np.abs(rng.standard_normal((2, 6, 3)))
    features *= 1e38 / np.linalg.norm(features, axis=-1, keepdims=True)
    prototypes = rng.standard_normal((4, 3))
    d_pooled, d_z = 30 * rng.standard_normal((2, 3)), rng.standard_normal((2, 4))
    args = dict(mu=0.1, inverse_temperature=5.0)
    _, ref_ctx = reference.gsp_pool_forward(features, prototypes, **args)
    largest = np.abs(reference.gsp_pool_backward(ref_ctx, d_pooled, d_z).prototypes).max()
    assert largest > np.finfo(np.float32).max
    for kind in ("array", "cpu"):
        with use_kernels(kind):
            _, ctx = fast.gsp_pool_forward(features.astype(np.float32),
                                           prototypes.astype(np.float32), **args)
            with pytest.raises(ValueError, match=r"^the gradient of prototypes\[.*\] == .* is "
                                                 r"beyond the float32 range"):
                fast.gsp_pool_backward(ctx, d_pooled.astype(np.float32), d_z.astype(np.float32))


def test_warnings_as_errors_passes_the_low_occupancy_note_only(tmp_path):
    # numba-cuda (simulator off) warns when a small launch is configured, before any device
    # is touched, so a GPU-less machine can check the filter against the real warning.
    code = textwrap.dedent("""
        import warnings
        import pytest
        from conftest import _performance_warnings, _warnings_as_errors
        from numba import cuda
        from refdml.exceptions import ConvergenceWarning

        @cuda.jit
        def kernel(x):
            x[0] = 1.0

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            kernel[2, 32]
        notes = [w for w in seen if "under-utilization" in str(w.message)]
        assert notes and issubclass(notes[0].category, tuple(_performance_warnings())), seen
        with _warnings_as_errors():
            kernel[2, 32]                                  # the note: no error
            for category in _performance_warnings():
                with pytest.raises(category):              # another performance warning
                    warnings.warn("Host array used in CUDA kernel", category)
            for category in (RuntimeWarning, ConvergenceWarning):
                with pytest.raises(category):
                    warnings.warn("Grid size 2 will likely result in GPU under-utilization",
                                  category)
        print("ok")
    """)
    # The note on, whatever the caller chose: scripts/gpu_run.sh silences it for the suite
    # (NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0), and this test checks the filter against it.
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                          os.environ.get("PYTHONPATH", "")])}
    # cwd outside the checkout: the process imports refdml as installed.
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    if "No module named 'numba.cuda" in out.stderr:
        pytest.skip("numba-cuda is not installed")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
