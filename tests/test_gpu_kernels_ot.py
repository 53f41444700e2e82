"""The small-problem Sinkhorn kernels (gpu/_nb_sinkhorn.py) against their array-path twin.

The CPU twin (compiled) and the ``@cuda.jit`` kernel (under Numba's CUDA simulator here:
no GPU) must take the array path's steps: the same iteration counts where the stopping
margin certifies them (:func:`_certified`), the same residuals, potentials and plans to
rounding (float64: 1e-12 relative; float32: 1e-5, the kernel accumulating in float64
against the array path's float32). Simulated inputs stay tiny (3 problems of at most 7
points, tens of iterations): each simulated test takes ~1 s.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.exceptions import ConvergenceWarning
from refdml.gpu import _nb_sinkhorn, use_kernels
from refdml.gpu import _ot_sinkhorn as solver
from refdml.gpu.ot import pairwise_sinkhorn_divergence_forward, wtriplet_forward

pytestmark = pytest.mark.cpu_exact

KERNELS = ("cpu", "cuda")
RTOL = {np.float64: 1e-12, np.float32: 1e-5}
# Stopping margin, in units of n eps of the dtype (n rows; the rule of
# tests/test_ot_pairwise_route.py). The kernel's and the array path's L1 marginal errors at
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


def _solve(kernel, a, b, cost, **kw):
    with use_kernels(kernel), warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        return solver.solve_batch(np, a, b, cost, small_kernels=True, **kw)


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


def _assert_kernel_matches(kernel, a, b, cost, dtype=np.float64, **kw):
    assert _certified(a, b, cost, **kw), "a residual at a stopping threshold: pick another input"
    _assert_same(_solve(kernel, a, b, cost, **kw), _solve("array", a, b, cost, **kw), dtype)


def _assert_same(ours, ref, dtype):
    rtol = RTOL[dtype]
    assert_array_equal(ours.n_iter, ref.n_iter)
    assert_array_equal(ours.converged, ref.converged)
    for name in ("f", "g", "plan"):
        got, want = getattr(ours, name), getattr(ref, name)
        assert got.dtype == want.dtype == dtype
        assert_allclose(got, want, rtol=0, atol=rtol * np.abs(want).max(), err_msg=name)
    # float32: the array path sums the residual in float32, the kernel in float64.
    atol = 1e-6 if dtype == np.float32 else max(1e-15, 10 * rtol * float(ref.marginal_error.max()))
    assert_allclose(ours.marginal_error, ref.marginal_error, rtol=0, atol=atol)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("eps_scaling", [None, 0.5])
def test_kernel_matches_array_path(kernel, dtype, symmetric, eps_scaling):
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
    _assert_kernel_matches(kernel, a, b, cost, dtype, **kw)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_absorbs_like_the_array_path(kernel):
    # eps = 0.002 of the cost: scalings leave [e^-30, e^30] and the kernel is rebuilt.
    a, b, cost = _problems(np.random.default_rng(2), 2, 4, 6)
    kw = dict(eps=0.002, max_iter=30, tol=1e-9, eps_scaling=None)
    _assert_kernel_matches(kernel, a, b, cost, **kw)


@pytest.mark.parametrize("kernel", KERNELS)
def test_fixed_iterations_and_warning(kernel):
    a, b, cost = _problems(np.random.default_rng(3), 2, 4, 3)
    with use_kernels(kernel), warnings.catch_warnings():
        warnings.simplefilter("error")                   # tol = 0: no warning
        fixed = solver.solve_batch(np, a, b, cost, eps=0.05, max_iter=7, tol=0.0,
                                   eps_scaling=None, small_kernels=True)
    assert_array_equal(fixed.n_iter, [7, 7])   # tol = 0 stops only at an exact 0 residual
    assert not fixed.converged.any()
    with use_kernels(kernel), pytest.warns(ConvergenceWarning, match="max_iter=3"):
        solver.solve_batch(np, a, b, cost, eps=0.05, max_iter=3, tol=1e-9, eps_scaling=None,
                           small_kernels=True)


def test_cuda_kernel_global_tile(monkeypatch):
    # A kernel too large for the shared tile runs from the plan in global memory.
    a, b, cost = _problems(np.random.default_rng(4), 2, 5, 6)
    monkeypatch.setattr(_nb_sinkhorn, "TILE_BYTES", 64)
    _nb_sinkhorn.cuda_kernel.cache_clear()
    try:
        kw = dict(eps=0.1, max_iter=30, tol=1e-8, eps_scaling=None)
        _assert_kernel_matches("cuda", a, b, cost, **kw)
    finally:
        _nb_sinkhorn.cuda_kernel.cache_clear()


@pytest.mark.parametrize("n, m", [(1, 1), (1, 4), (6, 1)])
def test_cpu_twin_edge_sizes(n, m):
    a, b, cost = _problems(np.random.default_rng(5), 1, n, m)
    kw = dict(eps=0.1, max_iter=50, tol=1e-10, eps_scaling=None)
    _assert_kernel_matches("cpu", a, b, cost, **kw)


def test_larger_problems_fall_back_to_the_array_path(monkeypatch):
    calls = []
    monkeypatch.setattr(_nb_sinkhorn, "solve_small", lambda *a, **k: calls.append(1))
    a, b, cost = _problems(np.random.default_rng(6), 1, 3, _nb_sinkhorn.MAX_POINTS + 1)
    out = _solve("cpu", a, b, cost, eps=0.1, max_iter=5, tol=1e-6, eps_scaling=None)
    assert not calls and out.plan.shape == (1, 3, _nb_sinkhorn.MAX_POINTS + 1)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="at most 128 points"):
        _nb_sinkhorn.solve_small(np, "cpu", a, b, cost, schedule=[0.1], stage_tol=[1e-6],
                                 max_iter=5, symmetric=False, tiny=1e-300, high=1e13, low=1e-13)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), m=st.integers(1, 9),
       eps=st.sampled_from([0.5, 0.1, 0.02]), symmetric=st.booleans())
def test_cpu_twin_hypothesis(seed, n, m, eps, symmetric):
    m = n if symmetric else m
    a, b, cost = _problems(np.random.default_rng(seed), 2, n, m, symmetric)
    kw = dict(eps=eps, max_iter=200, tol=1e-9, eps_scaling=None, symmetric=symmetric)
    assume(_certified(a, b, cost, **kw))        # a draw at a stopping boundary is discarded
    _assert_same(_solve("cpu", a, b, cost, **kw), _solve("array", a, b, cost, **kw), np.float64)


@settings(max_examples=3)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 5), m=st.integers(1, 5))
def test_cuda_kernel_hypothesis(seed, n, m):
    a, b, cost = _problems(np.random.default_rng(seed), 2, n, m)
    kw = dict(eps=0.2, max_iter=10, tol=1e-9, eps_scaling=None)
    assume(_certified(a, b, cost, **kw))        # a draw at a stopping boundary is discarded
    _assert_same(_solve("cuda", a, b, cost, **kw), _solve("array", a, b, cost, **kw), np.float64)


@pytest.mark.parametrize("kernel", KERNELS)
def test_pairwise_divergence_and_losses_use_the_kernel(kernel, monkeypatch):
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
    real = _nb_sinkhorn.solve_small
    monkeypatch.setattr(_nb_sinkhorn, "solve_small",
                        lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    with use_kernels(kernel):
        ours, _ = pairwise_sinkhorn_divergence_forward(clouds, **kw)
        loss, _ = wtriplet_forward(clouds, np.array([0, 0, 1]), margin=1.0, **kw)
    assert calls == [kernel] * 4                         # cross and self, twice
    assert_allclose(ours, ref, rtol=0, atol=1e-12 * np.abs(ref).max())
    assert_allclose(loss, ref_loss, rtol=1e-12)


# --------------------------------------------------------------------------- LSE half step
def _half_step(kernel, scaled, potential, log_weight):
    with use_kernels(kernel):
        return solver._lse_half_step(np, scaled, potential, log_weight)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_lse_half_step_matches_array_path(kernel, dtype):
    rng = np.random.default_rng(8)
    # S up to 1e4 (eps = 1e-4 of the cost): the exponents span 1e4, nothing may overflow.
    scaled = (rng.uniform(0, 1, (3, 5, 7)) * np.array([1.0, 100.0, 1e4])[:, None, None])
    potential = rng.normal(0, 5, (3, 7))
    log_weight = np.log(rng.dirichlet(np.ones(7), 3))
    args = [v.astype(dtype) for v in (scaled, potential, log_weight)]
    got, want = _half_step(kernel, *args), _half_step("array", *args)
    assert got.dtype == want.dtype == dtype and got.shape == (3, 5)
    # float32: the array path rounds every exponent to float32; the kernel sums in float64.
    atol = (1e-12 if dtype == np.float64 else 1e-6) * np.abs(scaled).max()
    assert_allclose(got, want, rtol=0, atol=atol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_lse_half_step_edge_shapes(kernel):
    rng = np.random.default_rng(9)
    for shape in [(1, 1, 1), (1, 1, 6), (2, 3, 1)]:
        scaled = rng.uniform(0, 3, shape)
        potential = rng.normal(size=(shape[0], shape[2]))
        log_weight = np.zeros((shape[0], shape[2]))
        assert_allclose(_half_step(kernel, scaled, potential, log_weight),
                        _half_step("array", scaled, potential, log_weight), rtol=1e-14, atol=1e-14)
    empty = np.zeros((0, 3, 4))
    assert _half_step(kernel, empty, np.zeros((0, 4)), np.zeros((0, 4))).shape == (0, 3)
    with pytest.raises(ValueError, match="kernel == 'array'"):
        _nb_sinkhorn.lse_half_step(np, "array", np.zeros((1, 1, 1)), np.zeros((1, 1)))


@settings(max_examples=20)
@given(seed=st.integers(0, 2**32 - 1), shape=st.tuples(st.integers(1, 4), st.integers(1, 6),
                                                        st.integers(1, 6)),
       spread=st.sampled_from([1.0, 1e2, 1e6]))
def test_lse_half_step_hypothesis(seed, shape, spread):
    rng = np.random.default_rng(seed)
    scaled = spread * rng.uniform(0, 1, shape)
    potential = spread * rng.normal(size=(shape[0], shape[2]))
    log_weight = np.log(rng.dirichlet(np.ones(shape[2]), shape[0]))
    want = _half_step("array", scaled, potential, log_weight)
    for kernel in KERNELS if seed % 4 == 0 else ("cpu",):      # simulated CUDA on a quarter
        assert_allclose(_half_step(kernel, scaled, potential, log_weight), want, rtol=0,
                        atol=1e-12 * max(spread, np.abs(want).max()))


# --------------------------------------------------------------------------- pair costs
def _explicit_sq(clouds, first, second):
    """The oracle: ``||x_i - y_j||^2`` from explicit differences (no Gram identity)."""
    diff = clouds[first][:, :, None, :] - clouds[second][:, None, :, :]
    return np.einsum("kijd,kijd->kij", diff, diff)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("refine", [-1.0, 1e-3])
def test_compiled_pair_costs_match_explicit_differences(dtype, refine):
    from refdml.gpu._ot_pairs import compiled_pair_sq

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
    from refdml.gpu._ot_pairs import compiled_pair_sq

    clouds = np.random.default_rng(4).uniform(-0.5, 0.5, (3, 7, 130))
    selves = np.array([2, 0])
    got = compiled_pair_sq(clouds, selves, selves, refine=1e-3)
    # Exact by construction: the kernel writes one mean to both triangles and 0 on the diagonal.
    assert_array_equal(got, np.swapaxes(got, 1, 2))
    assert_array_equal(got[:, np.arange(7), np.arange(7)], 0.0)
    assert_allclose(got, _explicit_sq(clouds, selves, selves), rtol=1e-12, atol=1e-15)
