"""The backend object (refdml._backend): what differs between NumPy and CuPy, one method each.

A backend whose host reads are not free (CuPy's) is built here over NumPy modules, so that
its side of each method runs in every session; the real CuPy side runs on the CuPy stand-in
and on a GPU through the operators that call these methods.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np
import pytest
import scipy.linalg
import scipy.special

import cupy_standin
from refdml import _backend
from refdml._backend import Backend, get_backend


def _device_like() -> Backend:
    """CuPy's side of every method (host reads cost a synchronisation), over NumPy modules."""
    return Backend(name="device-like", xp=np, special=scipy.special, linalg=scipy.linalg,
                   free_host_reads=False, kernel_target="cuda", _scatter_add=np.add.at)


class _Unreadable:
    """A 0-d flag whose host read fails: a method that must not read it can be held to it."""

    def __bool__(self):
        raise AssertionError("the flag was read on the host")


# ---- for refdml.gpu.losses (and normalize, distances, histogram, prototypes, crossbatch)
def test_is_cached_recognises_only_the_kept_array():
    numpy_backend = get_backend(np.zeros(1))
    key = ("tests.base.test_backend.ones", 3)
    kept = numpy_backend.cached(key, lambda: np.ones(3))
    assert numpy_backend.is_cached(key, kept)
    assert not numpy_backend.is_cached(key, np.ones(3))               # equal, not the one kept
    assert not numpy_backend.is_cached(("tests.base.test_backend.absent",), None)
    assert not kept.flags.writeable
    device = _device_like()
    built = device.cached(key, lambda: np.ones(3))
    assert built is not device.cached(key, lambda: np.ones(3))        # built anew each time
    assert not device.is_cached(key, built)


def test_known_true_reads_the_flag_on_numpy_only():
    numpy_backend = get_backend(np.zeros(1))
    assert numpy_backend.known_true(np.isfinite(np.float64(1.0)))
    assert not numpy_backend.known_true(np.isfinite(np.float64(np.inf)))
    with pytest.raises(AssertionError, match="read on the host"):
        numpy_backend.known_true(_Unreadable())
    assert not _device_like().known_true(_Unreadable())


def test_refine_runs_on_numpy_and_is_skipped_where_host_reads_cost():
    calls = []

    def step(target, value):
        calls.append(value)
        target[...] = value

    target = np.zeros(2)
    get_backend(target).refine(step, target, 5.0)
    assert calls == [5.0] and np.all(target == 5.0)
    _device_like().refine(step, target, 7.0)
    assert calls == [5.0] and np.all(target == 5.0)


def test_gathers_rows_where_host_reads_are_free():
    # NumPy reads a mask's count for free, so a data-dependent subset of rows is gathered;
    # a backend whose host reads synchronise the device (CuPy) works on every row instead.
    assert get_backend(np.zeros(3)).gathers_rows is True
    assert _device_like().gathers_rows is False


# ------------------------------------------------------------------ the core methods
def test_numpy_is_the_backend_of_host_arrays_and_of_no_array():
    backend = get_backend(np.zeros(2), None, 3.0)
    assert backend is get_backend() and backend.name == "numpy" and backend.xp is np
    assert backend.special is scipy.special and backend.linalg is scipy.linalg
    assert backend.kernel_target == "cpu"


def test_scatter_add_sums_repeated_indices_on_both_sides():
    for backend in (get_backend(np.zeros(1)), _device_like()):
        target = np.zeros(4)
        backend.scatter_add(target, np.array([3, 0, 3, 3]), np.array([1.0, 2.0, 4.0, 8.0]))
        np.testing.assert_array_equal(target, [2.0, 0.0, 0.0, 13.0])


def test_errstate_silences_numpy_and_is_nothing_where_the_library_never_warns():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with get_backend(np.zeros(1)).errstate(over="ignore"):
            assert np.isinf(np.float64(1e300) * np.float64(1e300))
    with np.errstate(over="raise"):            # the device side leaves NumPy's state alone
        with _device_like().errstate(over="ignore"):
            with pytest.raises(FloatingPointError):
                np.float64(1e300) * np.float64(1e300)


def test_host_reads_are_made_only_where_free():
    host, device = get_backend(np.zeros(1)), _device_like()
    assert host.check_every(7) == 1 and device.check_every(7) == 7
    assert host.known_equal(np.float64(1.0), 1.0) and not host.known_equal(np.float64(2.0), 1.0)
    assert device.known_equal(_Unreadable(), 1.0) is False     # never read
    host.synchronize()                                          # nothing to wait for


def test_cached_keeps_read_only_arrays_on_numpy_and_builds_anew_on_the_device():
    host, device = get_backend(np.zeros(1)), _device_like()
    built = []

    def build():
        built.append(1)
        return np.arange(3.0)

    first = host.cached(("test_backend", 3), build)
    assert host.cached(("test_backend", 3), build) is first and len(built) == 1
    assert not first.flags.writeable
    assert device.cached(("test_backend", 3), build) is not device.cached(("test_backend", 3), build)


def test_data_checks_follow_the_switch_on_the_device_only():
    host, device = get_backend(np.zeros(1)), _device_like()
    try:
        _backend.set_finite_checks(False)
        assert host.data_checks and not device.data_checks
    finally:
        _backend.set_finite_checks(True)
    assert device.data_checks
    with pytest.raises(TypeError, match="enabled must be a bool, got 1"):
        _backend.set_finite_checks(1)


def test_module_functions_without_cupy():
    from refdml._backend import as_input_array, is_array, is_device_array, to_numpy

    assert is_array(np.zeros(1)) and not is_array([1.0]) and not is_device_array(np.zeros(1))
    assert isinstance(as_input_array([1, 2]), np.ndarray)
    values = np.arange(3.0)
    np.testing.assert_array_equal(to_numpy(values), values)


# ------------------------------------------------------------------ on CuPy (the stand-in)
@pytest.fixture
def cupy_module(monkeypatch):
    """A CuPy module that :func:`refdml._backend.get_backend` recognises, for one test.

    The backend object it builds is not kept past the test (``_CUPY`` is restored), so a
    later test of the session that installs another CuPy module meets a fresh one.
    """
    present = sys.modules.get("cupy")
    if present is not None:
        return present
    for name, module in cupy_standin.build_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(_backend, "_CUPY", None)
    return sys.modules["cupy"]


# ------------------------------------------------------------------ for refdml.train
def test_is_own_array_on_numpy_takes_arrays_and_numpy_scalars_only(cupy_module):
    backend = get_backend(np.zeros(2))
    assert backend.is_own_array(np.zeros((2, 3)))
    assert backend.is_own_array(np.zeros(3).sum())           # a NumPy scalar, from a reduction
    assert backend.is_own_array(np.float32(1.5))
    assert not backend.is_own_array([0.0, 1.0])
    assert not backend.is_own_array(1.5)
    assert not backend.is_own_array(None)
    assert not backend.is_own_array(cupy_module.zeros(3))


def test_is_own_array_on_cupy_takes_its_arrays_only(cupy_module):
    backend = get_backend(cupy_module.zeros(2))
    assert backend.name == "cupy"
    assert backend.is_own_array(cupy_module.zeros((2, 3)))
    assert backend.is_own_array(cupy_module.zeros(3).sum())  # CuPy's reductions give 0-d arrays
    assert not backend.is_own_array(np.zeros(3))
    assert not backend.is_own_array(np.float64(1.0))
    assert not backend.is_own_array([0.0])


def test_device_memory_is_on_the_host_for_the_stand_in_only(cupy_module, monkeypatch):
    from refdml._backend import device_memory_on_host

    assert device_memory_on_host() == bool(getattr(cupy_module, "__refdml_standin__", False))
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert device_memory_on_host() is False


# ------------------------------------------------------------------ for refdml.gpu.metrics
#: float32's unit roundoff (half its machine epsilon: 24 significant bits, rounded to nearest).
_FLOAT32_ROUNDOFF = float(np.finfo(np.float32).eps) / 2
#: TF32 keeps 10 of float32's 23 explicit mantissa bits: one unit in its last place is
#: 2^13 float32 units, the most by which its rounding (or truncation) moves a value, relatively.
_TF32_ROUNDOFF = float(np.finfo(np.float32).eps) * 2**13


@pytest.mark.parametrize("setting", [None, "", "0", "1"])
def test_numpy_matmul_inputs_are_float32_whatever_cupy_tf32_says(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("CUPY_TF32", raising=False)
    else:
        monkeypatch.setenv("CUPY_TF32", setting)
    assert get_backend(np.zeros(2, dtype=np.float32)).matmul_input_roundoff() == _FLOAT32_ROUNDOFF


@pytest.mark.parametrize("setting, expected", [
    (None, _FLOAT32_ROUNDOFF), ("", _FLOAT32_ROUNDOFF), ("0", _FLOAT32_ROUNDOFF),
    ("1", _TF32_ROUNDOFF)])
def test_cupy_matmul_inputs_round_to_tf32_under_cupy_tf32(monkeypatch, setting, expected):
    # The rule on a backend named "cupy" (its array module does not enter it), so that it is
    # tested where CuPy is absent; the real CuPy backend below.
    if setting is None:
        monkeypatch.delenv("CUPY_TF32", raising=False)
    else:
        monkeypatch.setenv("CUPY_TF32", setting)
    cupy_like = dataclasses.replace(get_backend(np.zeros(1)), name="cupy")
    assert cupy_like.matmul_input_roundoff() == expected


@pytest.mark.requires_cupy
def test_the_cupy_backend_reads_cupy_tf32(monkeypatch):
    import cupy

    backend = get_backend(cupy.zeros(2, dtype=cupy.float32))
    monkeypatch.setenv("CUPY_TF32", "1")
    assert backend.matmul_input_roundoff() == _TF32_ROUNDOFF
    monkeypatch.setenv("CUPY_TF32", "0")
    assert backend.matmul_input_roundoff() == _FLOAT32_ROUNDOFF


# ------------------------------------------------------------------ row_dot
def _row_dots_by_loop(a, b):
    """``<a_i, b_i>`` row by row with math.fsum (correctly rounded), keepdims."""
    import math

    flat_a, flat_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    dots = [math.fsum(float(x) * float(y) for x, y in zip(ra, rb))
            for ra, rb in zip(flat_a, flat_b)]
    return np.array(dots).reshape(a.shape[:-1] + (1,))


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 6), (1, 1)])
def test_row_dot_is_the_dot_of_each_row_keepdims(shape):
    rng = np.random.default_rng(len(shape))
    a, b = rng.standard_normal(shape), rng.standard_normal(shape)
    got = get_backend(a).row_dot(a, b)
    assert got.shape == shape[:-1] + (1,)
    np.testing.assert_allclose(got, _row_dots_by_loop(a, b), rtol=1e-13, atol=1e-15)


@pytest.mark.requires_cupy
def test_row_dot_takes_no_library_call_while_the_standin_captures():
    # CuPy refuses cuBLAS inside a capture (as the stand-in does): the batched product of
    # row_dot outside one is refused there, and row_dot takes the product and a sum instead.
    import cupy

    if not getattr(cupy, "__refdml_standin__", False):
        pytest.skip("the capture checks are the CuPy stand-in's (REFDML_CUPY_STANDIN=1)")
    rng = np.random.default_rng(0)
    host_a = rng.standard_normal((6, 5)).astype(np.float32)
    host_b = rng.standard_normal((6, 5)).astype(np.float32)
    a, b = cupy.asarray(host_a), cupy.asarray(host_b)
    ns = get_backend(a)
    outside = ns.row_dot(a, b)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            assert ns.capturing()
            with pytest.raises(NotImplementedError, match="during stream capture"):
                a[..., None, :] @ b[..., :, None]
            inside = ns.row_dot(a, b)
        finally:
            stream.end_capture()
    expected = _row_dots_by_loop(host_a, host_b)
    for got in (outside, inside):
        assert got.shape == (6, 1)
        np.testing.assert_allclose(ns.to_numpy(got), expected, rtol=1e-5, atol=1e-6)
