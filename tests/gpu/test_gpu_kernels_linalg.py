"""The products and Cholesky solves of refdml.gpu.linalg: the kernels a captured step runs
where CuPy refuses cuBLAS and cuSOLVER.

The compiled members (the CPU twins at full size; the CUDA kernels under the simulator, or
on a GPU through the ``cuda_device_array`` fixture) against independent float64 oracles:
``numpy.matmul`` of the operands in float64 (BLAS), ``numpy.linalg.cholesky`` (LAPACK) and
``scipy.linalg.solve`` (LU, not Cholesky). Tolerances follow the rounding the members
state (refdml.gpu.linalg._compiled): each entry is a float64 sum of exact products rounded
once to the output's dtype, so a float32 entry is within half an ulp of the float64 value
plus the float64 sum's error, ``k 2^-53 sum_k |a_ik| |b_kj|``.

Then the choice (:func:`refdml.gpu.linalg.member`): the array path outside a capture, the
kernels inside one (the CuPy stand-in's capture, which refuses cuBLAS and cuSOLVER as CuPy
14 does), and the errors.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml._backend import get_backend, to_numpy
from refdml.gpu import linalg
from refdml.gpu.linalg._kernels import IMPLEMENTATIONS

pytestmark = pytest.mark.cpu_exact

KINDS = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]

#: Shapes of matmul's cases: 1-D to 3-D, a broadcast stack of one, 0-size dimensions.
SHAPES = [((5, 7), (7, 3)), ((7,), (7, 3)), ((5, 7), (7,)), ((7,), (7,)),
          ((4, 5, 7), (7, 3)), ((5, 7), (4, 7, 3)), ((4, 5, 7), (4, 7, 3)),
          ((1, 5, 7), (4, 7, 3)), ((33, 40), (40, 65)), ((0, 3), (3, 2)), ((3, 0), (0, 2))]


def _member(kind):
    return IMPLEMENTATIONS.cpu if kind == "cpu" else IMPLEMENTATIONS.cuda


def _move(kind, cuda_device_array):
    return cuda_device_array if kind == "cuda" else (lambda x: x)


def _assert_product(got, a, b):
    """``got`` against ``a @ b`` in float64, within the members' rounding (module doc)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    want = np.matmul(a64, b64)
    magnitude = np.matmul(np.abs(a64), np.abs(b64))
    k = a64.shape[-1]
    unit = 2.0**-24 if got.dtype == np.float32 else 2.0**-53
    bound = unit * np.abs(want) + (k + 2) * 2.0**-53 * magnitude + 1e-300
    assert got.shape == want.shape and got.dtype == np.result_type(a, b)
    excess = np.abs(got.astype(np.float64) - want) - bound
    assert np.all(excess <= 0), float(np.max(excess))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("shape_a", "shape_b"), SHAPES)
def test_the_product_is_the_float64_product_rounded_once(kind, dtype, shape_a, shape_b,
                                                         cuda_device_array):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(shape_a).astype(dtype)
    b = rng.standard_normal(shape_b).astype(dtype)
    move = _move(kind, cuda_device_array)
    da, db = move(a), move(b)
    got = to_numpy(_member(kind).matmul(get_backend(da), da, db))
    _assert_product(got, a, b)


@pytest.mark.parametrize("kind", KINDS)
def test_the_product_takes_transposed_views_and_writes_through_out(kind, cuda_device_array):
    rng = np.random.default_rng(3)
    move = _move(kind, cuda_device_array)
    a, b = rng.standard_normal((6, 9)), rng.standard_normal((4, 9))
    out = np.full((8, 4), np.nan)
    da, db, dout = move(a), move(b), move(out)
    ns = get_backend(da)
    result = _member(kind).matmul(ns, da, db.T, out=dout[2:])     # a row block of out
    assert result is dout[2:] or to_numpy(result).shape == (6, 4)
    host = to_numpy(dout)
    assert np.all(np.isnan(host[:2]))                             # untouched
    _assert_product(host[2:], a, b.T)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 70), n=st.integers(1, 40),
       z=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-150, 1e-3, 1.0, 1e3, 1e150]),
       dtype=st.sampled_from([np.float32, np.float64]))
def test_the_twin_product_on_drawn_shapes_and_scales(m, k, n, z, seed, scale, dtype):
    if dtype == np.float32:
        scale = min(max(scale, 1e-15), 1e15)     # products stay inside float32's range
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((z, m, k)) * scale).astype(dtype)
    b = (rng.standard_normal((k, n)) / scale).astype(dtype)
    _assert_product(IMPLEMENTATIONS.cpu.matmul(get_backend(a), a, b), a, b)


def _spd(rng, n):
    a = rng.standard_normal((n, n + 3))
    return a @ a.T / n + 0.1 * np.eye(n)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2, 7, 40, 300])
def test_the_factor_and_solve_match_lapack_and_an_lu_solve(kind, n, cuda_device_array):
    rng = np.random.default_rng(n)
    matrix, rhs = _spd(rng, n), rng.standard_normal((n, 5))
    move = _move(kind, cuda_device_array)
    dm, dr = move(matrix), move(rhs)
    ns = get_backend(dm)
    member = _member(kind)
    lower = member.cholesky(ns, dm)
    factor = to_numpy(lower)
    want = np.linalg.cholesky(matrix)
    # column-by-column Cholesky is backward stable: |L - L_lapack| ~ n u cond(L) |L|
    assert np.max(np.abs(factor - want)) <= 1e-12 * np.max(np.abs(want)) * n
    assert np.all(np.triu(factor, 1) == 0.0)
    solution = to_numpy(member.cho_solve(ns, lower, dr))
    lu = scipy.linalg.solve(matrix, rhs)
    cond = np.linalg.cond(matrix)
    assert np.max(np.abs(solution - lu)) <= 1e-14 * n * cond * np.max(np.abs(lu))


@pytest.mark.parametrize("kind", KINDS)
def test_a_matrix_that_is_not_positive_definite_gives_a_nan_factor(kind, cuda_device_array):
    matrix = np.array([[4.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # pivot 2 is 0
    move = _move(kind, cuda_device_array)
    dm = move(matrix)
    factor = to_numpy(_member(kind).cholesky(get_backend(dm), dm))
    assert factor[0, 0] == 2.0 and factor[1, 0] == 1.0
    assert np.isnan(factor[1, 1]) and np.isnan(factor[2, 1])


@pytest.mark.parametrize("call, message", [
    (lambda m, ns: m.matmul(ns, np.ones((2, 3)), np.ones((4, 2))), r"shapes \(2, 3\) and \(4, 2\)"),
    (lambda m, ns: m.matmul(ns, np.ones((2, 2, 3)), np.ones((3, 3, 2))), "do not match"),
    (lambda m, ns: m.matmul(ns, np.ones((1, 1, 2, 3)), np.ones((3, 2))), "1-D to 3-D"),
    (lambda m, ns: m.matmul(ns, np.ones((2, 3)), np.ones((3, 2)), out=np.ones((2, 3))),
     r"out has shape \(2, 3\)"),
    (lambda m, ns: m.cholesky(ns, np.ones((2, 3))), r"square matrix, got shape \(2, 3\)"),
    (lambda m, ns: m.cho_solve(ns, np.eye(3), np.ones((2, 1))), r"shapes \(3, 3\) and \(2, 1\)"),
])
def test_bad_shapes_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call(IMPLEMENTATIONS.cpu, get_backend(np.ones(1)))


def test_integer_operands_are_refused():
    with pytest.raises(TypeError, match="float32 or float64 arrays, got int64"):
        IMPLEMENTATIONS.cpu.matmul(get_backend(np.ones(1)), np.ones((2, 2), np.int64),
                                   np.ones((2, 2), np.int64))


def test_outside_a_capture_the_array_path_runs_whatever_the_kernel_mode():
    from refdml.gpu import use_kernels

    ns = get_backend(np.ones(1))
    assert not ns.capturing()
    for mode in ("auto", "array", "cpu"):
        with use_kernels(mode):
            assert linalg.member(ns) is IMPLEMENTATIONS.array
    a = np.arange(6.0).reshape(2, 3)
    assert np.array_equal(linalg.matmul(ns, a, a.T), a @ a.T)      # the same BLAS call


@pytest.mark.requires_cuda
def test_inside_a_standin_capture_the_kernels_run_and_cublas_is_refused():
    # The stand-in refuses a cuBLAS or cuSOLVER call while it captures, as CuPy 14 does
    # (seen on an H200, 2026-11-30); refdml.gpu.linalg's calls go to the kernels there.
    cupy = sys.modules.get("cupy")
    if not getattr(cupy, "__refdml_standin__", False):
        pytest.skip("the capture checks are the CuPy stand-in's (REFDML_CUPY_STANDIN=1); a "
                    "GPU runs tests/gpu/test_gpu_capture.py")
    rng = np.random.default_rng(0)
    matrix, rhs = _spd(rng, 6), rng.standard_normal((6, 3))
    dm, dr = cupy.asarray(matrix), cupy.asarray(rhs)
    ns = get_backend(dm)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            assert ns.capturing() and linalg.member(ns) is IMPLEMENTATIONS.cuda
            for refused in (lambda: dm @ dr, lambda: cupy.linalg.cholesky(dm),
                            lambda: cupy.einsum("ij,jk->ik", dm, dr)):
                with pytest.raises(NotImplementedError, match="during stream capture"):
                    refused()
            product = linalg.matmul(ns, dm, dr)
            solution = linalg.cho_solve(ns, linalg.cholesky(ns, dm), dr)
        finally:
            stream.end_capture()
    assert not ns.capturing()
    _assert_product(to_numpy(product), matrix, rhs)
    lu = scipy.linalg.solve(matrix, rhs)
    assert np.max(np.abs(to_numpy(solution) - lu)) <= 1e-12 * np.max(np.abs(lu))


def test_warm_up_launches_each_kernel_once_per_dtype_outside_a_capture_and_nothing_on_numpy():
    linalg.warm_up(get_backend(np.ones(1)))                  # NumPy: nothing to compile
    cupy = sys.modules.get("cupy")
    if not getattr(cupy, "__refdml_standin__", False):
        pytest.skip("counts launches on the CuPy stand-in (REFDML_CUPY_STANDIN=1)")
    from cupy_standin import count_launches

    with count_launches() as counted:
        linalg.warm_up(get_backend(cupy.ones(1)))
    assert dict(counted.kernels) == {"refdml_linalg_matmul": 2, "refdml_linalg_cholesky": 2,
                                     "refdml_linalg_cho_solve": 2}, counted.kernels
