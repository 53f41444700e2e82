"""The small-problem Sinkhorn kernels (refdml/gpu/ot/_compiled.py: the CPU twin;
refdml/gpu/ot/_cuda.py: the CUDA kernel; launched by refdml/gpu/ot/_kernels.py) against
their array-path twin, and the seam that chooses among them
(refdml.gpu.ot.IMPLEMENTATIONS).

The CPU twin (compiled) and the ``@cuda.jit`` kernel (under Numba's CUDA simulator on NumPy
arrays where there is no GPU, on CuPy arrays on a GPU: the ``cuda_device_array`` fixture)
must take the NumPy array path's steps: the same iteration counts where the stopping margin
certifies them (:func:`_certified`), the same residuals, potentials and plans to the
tolerances of :data:`RTOL`. Simulated inputs stay tiny (3 problems of at most 7 points, tens
of iterations): each simulated test takes ~1 s.
"""

from __future__ import annotations

import inspect
import sys
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.gpu.ot import _compiled as twin
from refdml.gpu.ot import _cuda as cuda_twin
from refdml.gpu.ot import _kernels, _mirrors
from refdml.gpu._support.cuda import KERNELS
from refdml.gpu.ot._array import ArrayPath
from refdml.gpu.ot._compiled import (
    MAX_POINTS,
    SmallLaunch,
    SmallPotentials,
    SmallProblems,
    SmallResults,
    SmallSettings,
)
from refdml.gpu.ot._kernels import IMPLEMENTATIONS, CpuPath, CudaPath, compiled_pair_sq
from refdml._backend import get_backend, to_numpy
from refdml.exceptions import ConvergenceWarning
from refdml.gpu import use_kernels
from refdml.gpu.ot import _sinkhorn as solver
from refdml.gpu import ot as gpu_ot
from refdml.gpu.ot import pairwise_sinkhorn_divergence_forward, wtriplet_forward

pytestmark = pytest.mark.cpu_exact

KINDS = ("cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda))
# The compiled implementation of each kind (what IMPLEMENTATIONS.choose must return).
COMPILED = {"cpu": IMPLEMENTATIONS.cpu, "cuda": IMPLEMENTATIONS.cuda}
# Relative tolerance (max error / max |array path|) of potentials and plans. The kernels and
# the array path run the same iterations with roundings in other places (summation order;
# on a GPU, FMA contraction): a few ulps per step, which the contracting iteration does not
# amplify; float64: tens of steps of ~10 eps (~1e-13) with a factor 10 to spare. float32:
# the array path rounds every step to float32 (u = 6e-8) where the kernel keeps float64, so
# the arrays differ by the array path's own error, ~100 u.
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
# Stopping margin, in units of n eps of the dtype (n rows; the rule of
# tests/operators/test_ot_pairwise_route.py). The kernel's and the array path's L1 marginal errors at
# one iteration differ by rounding, a few n eps (float32: the array path sums in float32,
# the kernel in float64), so a test ``error <= threshold`` can go the other way only where an
# error lies that close to its threshold. Counts are compared exactly where every count of
# the array path stays when each threshold (tol, the eps-scaling stages' 1e-3) moves by
# 64 n eps either way.
MARGIN_ULPS = 64


def _problems(rng, n_problems, n, m, symmetric=False, dtype=np.float64):
    x = rng.uniform(-1, 1, (n_problems, n, 2))
    y = x if symmetric else rng.uniform(-1, 1, (n_problems, m, 2))
    cost = np.sum((x[:, :, None] - y[:, None]) ** 2, axis=-1)
    cost = 0.5 * (cost + np.swapaxes(cost, 1, 2)) if symmetric else cost
    cost = cost / (2.0 * max(cost.max(), 0.5))           # largest entry below 1
    a = rng.uniform(0.5, 1.5, (n_problems, n))
    b = a if symmetric else rng.uniform(0.5, 1.5, (n_problems, m))
    a, b = a / a.sum(1, keepdims=True), b / b.sum(1, keepdims=True)
    return a.astype(dtype), b.astype(dtype), cost.astype(dtype)


def _on_host(x):
    return x


def _mover(kind, cuda_device_array):
    """Where the ``kind`` of implementation takes its inputs: the CUDA kernel's device (CuPy
    on a GPU, NumPy under the simulator), NumPy for the others."""
    return cuda_device_array if kind == "cuda" else _on_host


def _solve(kind, a, b, cost, **kw):
    with use_kernels(kind), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return solver.solve_batch(get_backend(cost).xp, a, b, cost, small_kernels=True,
                                  impl=IMPLEMENTATIONS.choose(cost), **kw)


def _certified(a, b, cost, **kw):
    """Whether no stopping test of the array path lies within the margin of its threshold."""
    tol = kw["tol"]
    margin = MARGIN_ULPS * cost.shape[1] * float(np.finfo(cost.dtype).eps)
    runs = []
    for shift in (-margin, margin):
        stage_tol = solver._STAGE_TOL
        solver._STAGE_TOL = stage_tol + shift
        try:
            # residuals are >= 0: tol = 0 stops only at an exact 0, compared with tol = margin
            out = _solve("array", a, b, cost, **{**kw, "tol": max(tol + shift, 0.0)})
        finally:
            solver._STAGE_TOL = stage_tol
        runs.append((out.n_iter.tolist(), out.converged.tolist()))
    return runs[0] == runs[1]


def _assert_kernel_matches(kind, a, b, cost, dtype=np.float64, *, move=_on_host, **kw):
    """The ``kind`` of kernel on ``move``d inputs against the NumPy array path, on a
    certified input."""
    assert _certified(a, b, cost, **kw), "a residual at a stopping threshold: pick another input"
    ours = _solve(kind, move(a), move(b), move(cost), **kw)
    _assert_same(ours, _solve("array", a, b, cost, **kw), dtype)


def _assert_same(ours, ref, dtype):
    """``ours`` (NumPy or CuPy) against the NumPy array path's ``ref``. Counts and flags are
    compared exactly: callers pass only inputs that :func:`_certified` certifies (no stopping
    test within the margin that rounding, FMA included, could cross)."""
    rtol = RTOL[dtype]
    assert_array_equal(to_numpy(ours.n_iter), ref.n_iter)
    assert_array_equal(to_numpy(ours.converged), ref.converged)
    for name in ("f", "g", "plan"):
        got, want = to_numpy(getattr(ours, name)), getattr(ref, name)
        assert got.dtype == want.dtype == dtype
        assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max(), err_msg=name)
    # float32: the array path sums the residual in float32, the kernel in float64. float64:
    # a residual near 0 is rounding noise, each of its n + m marginal entries a few eps of
    # its value (<= 1) on either path, hence the floor 8 (n + m) eps.
    floor = 8 * sum(ref.plan.shape[1:]) * float(np.finfo(np.float64).eps)
    atol = 1e-6 if dtype == np.float32 else max(floor, 10 * rtol * float(ref.marginal_error.max()))
    assert_allclose(to_numpy(ours.marginal_error), ref.marginal_error, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("eps_scaling", [None, 0.5])
def test_kernel_matches_array_path(kind, dtype, symmetric, eps_scaling, cuda_device_array):
    # float32: the two residuals differ by ~1e-6 (the array path sums in float32), within
    # the margin of any useful tol, and the float32 array path's residual can reach exactly
    # 0: no stopping step near convergence can be certified. So float32 compares the
    # arithmetic at a fixed count, 3 iterations per stage (tol = 0), where every residual is
    # still far above 0 and from the stages' 1e-3 (seed 2: certified; seed 1 is not).
    seed = 1 if dtype == np.float64 else 2
    a, b, cost = _problems(np.random.default_rng(seed), 3, 5, 5 if symmetric else 7, symmetric,
                           dtype)
    tol, max_iter = (1e-7, 40) if dtype == np.float64 else (0.0, 3)
    kw = dict(eps=0.05, max_iter=max_iter, tol=tol, eps_scaling=eps_scaling, symmetric=symmetric)
    _assert_kernel_matches(kind, a, b, cost, dtype, move=_mover(kind, cuda_device_array),
                           **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_absorbs_like_the_array_path(kind, cuda_device_array):
    # eps = 0.002 of the cost: scalings leave [e^-30, e^30] and the kernel is rebuilt.
    a, b, cost = _problems(np.random.default_rng(2), 2, 4, 6)
    kw = dict(eps=0.002, max_iter=30, tol=1e-9, eps_scaling=None)
    _assert_kernel_matches(kind, a, b, cost, move=_mover(kind, cuda_device_array), **kw)


@pytest.mark.parametrize("kind", KINDS)
def test_fixed_iterations_and_warning(kind, cuda_device_array, warnings_as_errors):
    move = _mover(kind, cuda_device_array)
    a, b, cost = (move(v) for v in _problems(np.random.default_rng(3), 2, 4, 3))
    xp = get_backend(cost).xp
    with use_kernels(kind), warnings_as_errors():     # tol = 0: no warning
        fixed = solver.solve_batch(xp, a, b, cost, eps=0.05, max_iter=7, tol=0.0,
                                   eps_scaling=None, small_kernels=True,
                                   impl=IMPLEMENTATIONS.choose(cost))
    # Exact by construction: tol = 0 stops only at an exact 0 residual, so the count is
    # max_iter on any device.
    assert_array_equal(to_numpy(fixed.n_iter), [7, 7])
    assert not to_numpy(fixed.converged).any()
    with use_kernels(kind), pytest.warns(ConvergenceWarning, match="max_iter=3"):
        solver.solve_batch(xp, a, b, cost, eps=0.05, max_iter=3, tol=1e-9, eps_scaling=None,
                           small_kernels=True, impl=IMPLEMENTATIONS.choose(cost))


@pytest.mark.requires_cuda
def test_cuda_kernel_global_tile(monkeypatch, cuda_device_array):
    # A kernel too large for the shared tile runs from the plan in global memory.
    a, b, cost = _problems(np.random.default_rng(4), 2, 5, 6)
    monkeypatch.setattr(cuda_twin, "TILE_BYTES", 64)
    cuda_twin.small_problem_kernel.cache_clear()
    try:
        kw = dict(eps=0.1, max_iter=30, tol=1e-8, eps_scaling=None)
        _assert_kernel_matches("cuda", a, b, cost, move=cuda_device_array, **kw)
    finally:
        cuda_twin.small_problem_kernel.cache_clear()


@pytest.mark.parametrize("n, m", [(1, 1), (1, 4), (6, 1)])
def test_cpu_twin_edge_sizes(n, m):
    a, b, cost = _problems(np.random.default_rng(5), 1, n, m)
    kw = dict(eps=0.1, max_iter=50, tol=1e-10, eps_scaling=None)
    _assert_kernel_matches("cpu", a, b, cost, **kw)


def test_larger_problems_fall_back_to_the_array_path(monkeypatch):
    # The spy sits where every compiled implementation's solve_small goes (the driver of
    # refdml.gpu.ot._kernels); the small problem shows that it is reached.
    calls = []
    real = _kernels.solve_small
    monkeypatch.setattr(_kernels, "solve_small",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    kw = dict(eps=0.1, max_iter=5, tol=1e-6, eps_scaling=None)
    _solve("cpu", *_problems(np.random.default_rng(6), 1, 3, MAX_POINTS), **kw)
    assert calls == [IMPLEMENTATIONS.cpu.launch_small]
    a, b, cost = _problems(np.random.default_rng(6), 1, 3, MAX_POINTS + 1)
    out = _solve("cpu", a, b, cost, **kw)
    assert calls == [IMPLEMENTATIONS.cpu.launch_small]
    assert out.plan.shape == (1, 3, MAX_POINTS + 1)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="at most 128 points, got 3 x 129"):
        IMPLEMENTATIONS.cpu.solve_small(np, a, b, cost, schedule=[0.1], stage_tol=[1e-6], max_iter=5,
                             symmetric=False, tiny=1e-300, high=1e13, low=1e-13)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), m=st.integers(1, 9),
       eps=st.sampled_from([0.5, 0.1, 0.02]), symmetric=st.booleans())
def test_cpu_twin_hypothesis(seed, n, m, eps, symmetric):
    m = n if symmetric else m
    a, b, cost = _problems(np.random.default_rng(seed), 2, n, m, symmetric)
    kw = dict(eps=eps, max_iter=200, tol=1e-9, eps_scaling=None, symmetric=symmetric)
    assume(_certified(a, b, cost, **kw))        # a draw at a stopping boundary is discarded
    _assert_same(_solve("cpu", a, b, cost, **kw), _solve("array", a, b, cost, **kw), np.float64)


@pytest.mark.requires_cuda
@settings(max_examples=3)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), m=st.integers(1, 5))
def test_cuda_kernel_hypothesis(seed, n, m, cuda_device_array):
    a, b, cost = _problems(np.random.default_rng(seed), 2, n, m)
    kw = dict(eps=0.2, max_iter=10, tol=1e-9, eps_scaling=None)
    assume(_certified(a, b, cost, **kw))        # a draw at a stopping boundary is discarded
    ours = _solve("cuda", *(cuda_device_array(v) for v in (a, b, cost)), **kw)
    _assert_same(ours, _solve("array", a, b, cost, **kw), np.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_pairwise_divergence_and_losses_use_the_kernel(kind, monkeypatch, cuda_device_array):
    rng = np.random.default_rng(7)
    clouds = rng.uniform(-1, 1, (3, 4, 2))
    kw = dict(eps=0.5, p=2, tol=1e-9)
    # Values to 1e-12 need the same counts: no residual of these pair problems (the loss
    # solves a subset of them) lies within the stopping margin of tol.
    margin = MARGIN_ULPS * clouds.shape[1] * np.finfo(np.float64).eps
    counts = []
    with use_kernels("array"), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        for shift in (-margin, margin):
            _, ctx = pairwise_sinkhorn_divergence_forward(clouds, **{**kw, "tol": 1e-9 + shift})
            pairs = ctx.pairs
            counts.append([batch.n_iter.tolist() for batch in (pairs.cross, pairs.self_)])
    assert counts[0] == counts[1], "a residual at the stopping threshold: pick another input"
    with use_kernels("array"):
        ref, _ = pairwise_sinkhorn_divergence_forward(clouds, **kw)
        ref_loss, _ = wtriplet_forward(clouds, np.array([0, 0, 1]), margin=1.0, **kw)
    calls = []
    real = _kernels.solve_small
    # the driver every compiled implementation calls, with the launch of its kind
    monkeypatch.setattr(_kernels, "solve_small",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    move = _mover(kind, cuda_device_array)
    with use_kernels(kind):
        ours, _ = pairwise_sinkhorn_divergence_forward(move(clouds), **kw)
        loss, _ = wtriplet_forward(move(clouds), move(np.array([0, 0, 1])), margin=1.0, **kw)
    assert calls == [COMPILED[kind].launch_small] * 4      # cross and self, twice
    assert_allclose(to_numpy(ours), ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    assert_allclose(loss, ref_loss, rtol=1e-12)


# --------------------------------------------------------------------------- LSE half step
def _half_step(kind, scaled, potential, log_weight, move=_on_host):
    """The half step by the implementation of ``kind`` that the seam chooses, on ``move``d
    inputs, as a NumPy array."""
    scaled, potential, log_weight = move(scaled), move(potential), move(log_weight)
    with use_kernels(kind):
        impl = IMPLEMENTATIONS.choose(scaled)
    assert impl.kind == kind
    return to_numpy(impl.lse_half_step(get_backend(scaled).xp, scaled, potential,
                                       log_weight))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lse_half_step_matches_array_path(kind, dtype, cuda_device_array):
    rng = np.random.default_rng(8)
    # S up to 1e4 (eps = 1e-4 of the cost): the exponents span 1e4, nothing may overflow.
    scaled = (rng.uniform(0, 1, (3, 5, 7)) * np.array([1.0, 100.0, 1e4])[:, None, None])
    potential = rng.normal(0, 5, (3, 7))
    log_weight = np.log(rng.dirichlet(np.ones(7), 3))
    args = [v.astype(dtype) for v in (scaled, potential, log_weight)]
    got = _half_step(kind, *args, move=_mover(kind, cuda_device_array))
    want = _half_step("array", *args)
    assert got.dtype == want.dtype == dtype and got.shape == (3, 5)
    # float32: the array path rounds every exponent to float32; the kernel sums in float64.
    atol = (1e-12 if dtype == np.float64 else 1e-6) * np.abs(scaled).max()
    assert_allclose(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("kind", KINDS)
def test_lse_half_step_edge_shapes(kind, cuda_device_array):
    move = _mover(kind, cuda_device_array)
    rng = np.random.default_rng(9)
    for shape in [(1, 1, 1), (1, 1, 6), (2, 3, 1)]:
        scaled = rng.uniform(0, 3, shape)
        potential = rng.normal(size=(shape[0], shape[2]))
        log_weight = np.zeros((shape[0], shape[2]))
        assert_allclose(_half_step(kind, scaled, potential, log_weight, move),
                        _half_step("array", scaled, potential, log_weight), rtol=1e-14, atol=1e-14)
    empty = np.zeros((0, 3, 4))
    assert _half_step(kind, empty, np.zeros((0, 4)), np.zeros((0, 4)), move).shape == (0, 3)


HALF_STEP_CASES = dict(
    seed=st.integers(0, 2**32 - 1),
    shape=st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 6)),
    spread=st.sampled_from([1.0, 1e2, 1e6]),
)


def _assert_half_step_matches(kind, seed, shape, spread, move=_on_host):
    rng = np.random.default_rng(seed)
    scaled = spread * rng.uniform(0, 1, shape)
    potential = spread * rng.normal(size=(shape[0], shape[2]))
    log_weight = np.log(rng.dirichlet(np.ones(shape[2]), shape[0]))
    want = _half_step("array", scaled, potential, log_weight)
    assert_allclose(_half_step(kind, scaled, potential, log_weight, move), want, rtol=0,
                    atol=1e-12 * max(spread, np.abs(want).max()))


@settings(max_examples=20)
@given(**HALF_STEP_CASES)
def test_lse_half_step_hypothesis(seed, shape, spread):
    _assert_half_step_matches("cpu", seed, shape, spread)


@pytest.mark.requires_cuda
@settings(max_examples=5)                # a quarter of the CPU twin's draws (simulator time)
@given(**HALF_STEP_CASES)
def test_cuda_lse_half_step_hypothesis(seed, shape, spread, cuda_device_array):
    _assert_half_step_matches("cuda", seed, shape, spread, cuda_device_array)


# --------------------------------------------------------------------------- pair costs
def _explicit_sq(clouds, first, second):
    """The oracle: ``||x_i - y_j||^2`` from explicit differences (no Gram identity)."""
    diff = clouds[first][:, :, None, :] - clouds[second][:, None, :, :]
    return np.einsum("kijd,kijd->kij", diff, diff)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("refine", [-1.0, 1e-3])
def test_compiled_pair_costs_match_explicit_differences(dtype, refine):
    rng = np.random.default_rng(3)
    clouds = rng.uniform(-0.5, 0.5, (5, 6, 9))
    clouds[2, 1] = clouds[4, 3] + 1e-9                  # a near pair (refined when asked)
    clouds = clouds.astype(dtype)
    # any pairs, not only i < j (the losses' subsets); a repeated pair
    first = np.array([0, 3, 1, 2, 0, 4])
    second = np.array([1, 0, 4, 4, 1, 2])
    got = compiled_pair_sq(clouds, first, second, refine=refine)
    want = _explicit_sq(clouds.astype(np.float64), first, second)
    assert got.dtype == dtype and got.shape == (6, 6, 6)
    scale = np.abs(want).max()
    assert_allclose(got, want, rtol=0, atol=(1e-5 if dtype == np.float32 else 1e-14) * scale)
    assert np.all(got >= 0)
    if refine > 0 and dtype == np.float64:
        # refined from the explicit difference: right to full relative precision
        assert_allclose(got[3, 1, 3], want[3, 1, 3], rtol=1e-12)


def test_compiled_self_costs_are_symmetric_with_zero_diagonal():
    clouds = np.random.default_rng(4).uniform(-0.5, 0.5, (3, 7, 130))
    selves = np.array([2, 0])
    got = compiled_pair_sq(clouds, selves, selves, refine=1e-3)
    # Exact by construction: the kernel writes one mean to both triangles and 0 on the diagonal.
    assert_array_equal(got, np.swapaxes(got, 1, 2))
    assert_array_equal(got[:, np.arange(7), np.arange(7)], 0.0)
    assert_allclose(got, _explicit_sq(clouds, selves, selves), rtol=1e-12, atol=1e-15)


def _near_pair_clouds(dtype=np.float64):
    """Clouds in the unit ball with a pair 1e-9 apart across two clouds (unresolved by the
    Gram identity: its error is ~1e-16 |x|^2) and a coincident pair across two others."""
    clouds = np.random.default_rng(12).uniform(-0.5, 0.5, (4, 6, 3))
    clouds[1, 0] = clouds[0, 2] + 1e-9
    clouds[3, 4] = clouds[2, 5]
    return clouds.astype(dtype)


@pytest.mark.parametrize("mode", ["array", "cpu"])
def test_pair_costs_on_numpy_refine_near_pairs_in_every_implementation(mode):
    # On NumPy every implementation recomputes near pairs from explicit differences, as the
    # reference (the family docstring): the CPU twins' pass, and the array path's both
    # routes (the Gram matrix of all points when the pairs cover at least a quarter of all
    # B^2, as the all-pairs divergence; gathered clouds for a few pairs, as the losses).
    clouds = _near_pair_clouds()
    impl = getattr(IMPLEMENTATIONS, mode)
    pairs = np.stack(np.triu_indices(4, k=1), axis=1)
    for first, second in ((pairs[:, 0], pairs[:, 1]), (np.array([0, 2]), np.array([1, 3]))):
        got = impl.cross_sq(np, clouds, first, second)
        want = _explicit_sq(clouds, first, second)
        assert_allclose(got, want, rtol=0, atol=1e-14 * want.max())
        for k in range(first.shape[0]):
            near = {(0, 1): (2, 0), (2, 3): (5, 4)}.get((first[k], second[k]))
            if near is not None:       # to full relative precision, and 0 where they coincide
                assert_allclose(got[k][near], want[k][near], rtol=1e-12, atol=0)
    selves = np.arange(4)
    own = impl.self_sq(np, clouds, selves)
    assert_array_equal(own, np.swapaxes(own, 1, 2))
    assert_array_equal(own[:, np.arange(6), np.arange(6)], 0.0)
    assert_allclose(own, _explicit_sq(clouds, selves, selves), rtol=1e-12, atol=1e-15)


@pytest.mark.skipif(not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
                    reason="CuPy arrays: the CuPy stand-in (REFDML_CUPY_STANDIN=1)")
@pytest.mark.parametrize("p", [1, 2])
def test_near_pairs_on_cupy_within_the_stated_tolerance_standin(p):
    # The family docstring's tolerance for CuPy, where near pairs are not refined: the
    # regularised divergence within twice the largest cost error (10 u (|x|^2 + |y|^2))^(p/2)
    # of NumPy's (which refines), beyond the solvers' own agreement (both at tol 1e-13; CuPy
    # tests convergence every CHECK_EVERY_GPU iterations).
    import cupy

    clouds = _near_pair_clouds()
    kw = dict(eps=0.5, p=p, tol=1e-13, max_iter=5000)
    with use_kernels("array"):
        want, _ = pairwise_sinkhorn_divergence_forward(clouds, **kw)
        got, _ = pairwise_sinkhorn_divergence_forward(cupy.asarray(clouds), **kw)
    norms = np.sum(clouds * clouds, axis=-1).max()
    u = np.finfo(np.float64).eps / 2
    cost_error = (10 * u * 2 * norms) ** (p / 2)
    assert_allclose(to_numpy(got), want, rtol=0, atol=2 * cost_error + 1e-11)


# --------------------------------------------------------------------------- the seam
def test_small_launch_fields_are_the_kernel_parameters():
    # The named buffers of a launch, concatenated field by field, are the parameter list of
    # the registered CUDA kernel, of the function it compiles and of the CPU twin alike.
    names = tuple(f for part in (SmallProblems, SmallPotentials, SmallSettings, SmallResults)
                  for f in part.__dataclass_fields__)
    assert SmallLaunch.parameters() == names
    assert names == KERNELS["refdml_ot_sinkhorn_small"].parameters
    for dtype in (np.float32, np.float64):
        kernel = cuda_twin.small_problem_kernel(np.dtype(dtype))
        assert tuple(inspect.signature(kernel.py_func).parameters) == names
    assert tuple(inspect.signature(twin.refdml_ot_sinkhorn_small_cpu.py_func).parameters) == names
    assert len(names) == 15


def test_small_launch_arguments_keep_the_kernel_order():
    # Distinct sentinels: each must land at its parameter's position, replaced ones too.
    launch = SmallLaunch(SmallProblems("cost", "a", "b"), SmallPotentials("phi", "psi"),
                         SmallSettings("schedule", "stage_tol", 7, True, 1e-300, 5.0, 0.2),
                         SmallResults("plan", "n_iter", "err"))
    assert launch.arguments() == ("cost", "a", "b", "phi", "psi", "schedule", "stage_tol", 7,
                                  True, 1e-300, 5.0, 0.2, "plan", "n_iter", "err")
    assert launch.arguments(plan="flat")[12] == "flat"
    with pytest.raises(ValueError, match=r"replaced == \['plans'\], must be among"):
        launch.arguments(plans="flat")


def test_sinkhorn_implementations_by_mode():
    x = np.zeros((1, 2, 2))
    assert [type(impl) for impl in (IMPLEMENTATIONS.array, IMPLEMENTATIONS.cpu,
                                    IMPLEMENTATIONS.cuda)] == [ArrayPath, CpuPath, CudaPath]
    assert IMPLEMENTATIONS.family == "ot"
    expected = {"auto": IMPLEMENTATIONS.cpu, "array": IMPLEMENTATIONS.array,
                "cpu": IMPLEMENTATIONS.cpu}
    for mode, impl in expected.items():
        with use_kernels(mode):
            assert IMPLEMENTATIONS.choose(x) is impl, mode
    # The array path has no small-problem solver of its own; the CUDA kernels compute no
    # pair costs (the array path's run on the device); the CPU twins' pass does.
    assert not IMPLEMENTATIONS.array.takes_small(1, 1)
    assert IMPLEMENTATIONS.cpu.takes_small(MAX_POINTS, 1) and IMPLEMENTATIONS.cuda.takes_small(1, 1)
    assert IMPLEMENTATIONS.cuda.kernels.pair_sq is None
    assert CudaPath.cross_sq is ArrayPath.cross_sq and CudaPath.self_sq is ArrayPath.self_sq
    assert IMPLEMENTATIONS.cpu.kernels.pair_sq is twin.refdml_ot_pair_sq_cpu


@pytest.mark.requires_cuda
def test_sinkhorn_cuda_mode_chooses_the_cuda_kernels(cuda_device_array):
    x = cuda_device_array(np.zeros((1, 2, 2)))
    with use_kernels("cuda"):
        assert IMPLEMENTATIONS.choose(x) is IMPLEMENTATIONS.cuda


@pytest.mark.skipif(not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
                    reason="CuPy arrays: the CuPy stand-in (REFDML_CUPY_STANDIN=1)")
def test_sinkhorn_on_cupy_auto_is_cuda_and_cpu_is_refused():
    import cupy

    x = cupy.zeros((1, 2, 2))
    with use_kernels("auto"):
        assert IMPLEMENTATIONS.choose(x) is IMPLEMENTATIONS.cuda
    with use_kernels("cpu"), pytest.raises(ValueError, match="cannot take a CuPy array"):
        gpu_ot.sinkhorn(cupy.full(2, 0.5), cupy.full(2, 0.5), x[0] + 1.0, eps=0.1)


class _CountingChoice:
    """Stands in for ``IMPLEMENTATIONS``: counts the choices, then chooses as it does."""

    def __init__(self, family):
        self.family, self.calls = family, 0

    def choose(self, x):
        self.calls += 1
        return self.family.choose(x)


@pytest.mark.parametrize("call", [
    lambda x: gpu_ot.sinkhorn(np.full(4, 0.25), np.full(4, 0.25), x[0] @ x[1].T, eps=0.5),
    lambda x: gpu_ot.entropic_ot_forward(np.full(4, 0.25), np.full(4, 0.25), x[0] @ x[1].T,
                                         eps=0.5),
    lambda x: gpu_ot.sinkhorn_divergence_forward(x[0], x[1], eps=0.5),
    lambda x: gpu_ot.pairwise_sinkhorn_divergence_forward(x, eps=0.5),
    lambda x: gpu_ot.wcontrastive_forward(x, np.array([0, 0, 1]), margin=1.0, eps=0.5),
    lambda x: gpu_ot.wtriplet_forward(x, np.array([0, 0, 1]), margin=1.0, eps=0.5),
], ids=["sinkhorn", "entropic_ot", "divergence", "pairwise", "wcontrastive", "wtriplet"])
def test_one_choice_per_public_call(call, monkeypatch):
    # The divergence solves three batches and the pairs two (and their costs): one choice.
    counting = _CountingChoice(IMPLEMENTATIONS)
    monkeypatch.setattr(_mirrors, "IMPLEMENTATIONS", counting)
    x = np.random.default_rng(10).uniform(-1, 1, (3, 4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        call(x)
    assert counting.calls == 1


def test_pair_costs_come_from_the_chosen_implementation(monkeypatch):
    # The CPU twins' pair costs (one compiled pass) on the all-pairs route; none elsewhere.
    calls = []
    monkeypatch.setattr(_kernels, "compiled_pair_sq",
                        lambda *a, **k: calls.append(len(a[1])) or compiled_pair_sq(*a, **k))
    clouds = np.random.default_rng(11).uniform(-1, 1, (3, 4, 2))
    with use_kernels("cpu"):
        pairwise_sinkhorn_divergence_forward(clouds, eps=0.5)
    assert calls == [3, 3]                     # the 3 cross pairs, then the 3 selves
    with use_kernels("array"):
        pairwise_sinkhorn_divergence_forward(clouds, eps=0.5)
    assert calls == [3, 3]



def test_small_problem_kernel_is_capped_at_its_register_budget():
    # The cap that gives four blocks per SM (refdml/gpu/ot/_cuda.py, "Occupancy"),
    # read from the dispatchers numba-cuda builds off the simulator (nothing is compiled;
    # no GPU needed); the compile check (tests/gpu/test_gpu_compile.py) holds it free of
    # spills.
    import json
    import os
    import subprocess

    code = ("import json; from refdml.gpu._support.cuda import KERNELS; "
            "import refdml.gpu.ot._cuda; "
            "print(json.dumps([KERNELS['refdml_ot_sinkhorn_small'].build(d).targetoptions"
            ".get('max_registers') for d in ('float32', 'float64')]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [cuda_twin.MAX_REGISTERS] * 2 == [128, 128]
