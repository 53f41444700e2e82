"""The CuPy stand-in of tests/cupy_standin holds to CuPy's rules, and counts every host
transfer (so that it cannot quietly become lenient). These tests build the stand-in's
modules without installing them: they run in every session, with or without
REFDML_CUPY_STANDIN.
"""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import cupy_standin
from cupy_standin import (
    DEVICE_TO_HOST,
    IMPLICIT_CONVERSION,
    HostTransferError,
    allow_transfers,
    count_transfers,
    strict_transfers,
)

MODULES = cupy_standin.build_modules()
cp = MODULES["cupy"]


def _host(seed=0, shape=(3, 4), dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _device(seed=0, shape=(3, 4), dtype=np.float64):
    return cp.asarray(_host(seed, shape, dtype))


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize("convert", [np.asarray, np.array, np.ascontiguousarray, np.asanyarray],
                         ids=["asarray", "array", "ascontiguousarray", "asanyarray"])
def test_implicit_conversion_is_cupys_type_error(convert):
    with count_transfers() as c:
        with pytest.raises(TypeError, match=IMPLICIT_CONVERSION.split(".")[0]):
            convert(_device())
    assert c.total == 0


@pytest.mark.parametrize("function", [np.sum, np.mean, np.max, np.concatenate, np.where,
                                      np.shape])
def test_numpy_functions_are_refused_with_the_xp_name(function):
    x = _device()
    args = {np.concatenate: ([x, x],), np.where: (x > 0, x, 0.0)}.get(function, (x,))
    with pytest.raises(TypeError, match=rf"xp\.{function.__name__}"):
        function(*args)


@pytest.mark.parametrize("combine", [
    lambda x, h: x + h, lambda x, h: h + x, lambda x, h: x * h[0], lambda x, h: x == h,
    lambda x, h: np.add(x, h), lambda x, h: cp.add(x, h), lambda x, h: cp.exp(h),
    lambda x, h: cp.stack([x, h]), lambda x, h: cp.sum(h), lambda x, h: x.dot(h.T),
], ids=["x+h", "h+x", "x*h[0]", "x==h", "np.add", "cp.add", "cp.exp", "cp.stack", "cp.sum", "dot"])
def test_a_numpy_array_operand_is_unsupported(combine):
    # CuPy's kernels take device arrays and scalars only: a NumPy array is
    # "TypeError: Unsupported type <class 'numpy.ndarray'>" (cupy/_core/_scalar.pyx).
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        combine(_device(), _host(1))


def test_assignment_from_a_host_array_is_refused_and_scalars_are_not():
    x = _device()
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray"):
        x[0] = _host(1, shape=(4,))
    x[0] = np.float32(2.0)                  # NumPy and Python scalars are kernel arguments
    x[1] = 3
    x[2] = cp.asarray(_host(2, shape=(4,)))
    assert_array_equal(x.get()[:2], [[2.0] * 4, [3.0] * 4])
    assert_array_equal(x.get()[2], _host(2, shape=(4,)))


def test_no_index_and_no_round_as_cupy():
    n = cp.asarray(3)
    with pytest.raises(TypeError):
        range(n)
    with pytest.raises(TypeError):
        round(cp.asarray(2.5))
    with pytest.raises(TypeError, match="unhashable"):
        hash(n)


def test_host_only_dtypes_are_refused():
    with pytest.raises(ValueError, match="Unsupported dtype"):
        cp.asarray(["a", "b"])


# ------------------------------------------------------------------ what works
def test_ufuncs_and_operators_return_standin_arrays():
    host = _host(dtype=np.float32)
    x = cp.asarray(host)
    with count_transfers() as c:
        results = {
            "np.exp": (np.exp(x), np.exp(host)),
            "cp.exp": (cp.exp(x), np.exp(host)),
            "np.float32(2) * x": (np.float32(2) * x, np.float32(2) * host),
            "2.0 * x": (2.0 * x, 2.0 * host),
            "x @ x.T": (x @ x.T, host @ host.T),
            "-abs(x)": (-abs(x), -abs(host)),
            "x ** 2 - x / 3": (x ** 2 - x / 3, host ** 2 - host / 3),
            "x > 0": (x > 0, host > 0),
        }
    assert c.total == 0, c
    for name, (got, want) in results.items():
        assert type(got) is cp.ndarray, name
        assert got.dtype == want.dtype and got.shape == want.shape, name
        # The stand-in runs the same NumPy routine on the same values, so its result is the
        # NumPy result bit for bit (same process, same library, same inputs).
        assert_array_equal(cp.asnumpy(got), want, err_msg=name)


def test_reductions_and_indexing_give_0d_arrays_not_scalars():
    host = _host()
    x = cp.asarray(host)
    with count_transfers() as c:
        zero_d = [x.sum(), cp.sum(x), x.max(), x[0, 0], cp.count_nonzero(x > 0), cp.exp(2.0),
                  cp.allclose(x, x), np.add.reduce(x, axis=None), x.all()]
    assert c.total == 0
    for value in zero_d:
        assert type(value) is cp.ndarray and value.shape == ()
    assert float(zero_d[0]) == pytest.approx(host.sum(), rel=1e-15, abs=0)
    assert int(zero_d[4]) == np.count_nonzero(host > 0)


def test_in_place_and_out_keep_the_array():
    host = _host()
    x = cp.asarray(host)
    y = x
    y += 1.0
    assert y is x
    out = cp.empty_like(x)
    assert cp.multiply(x, 2.0, out=out) is out
    assert np.multiply(x, 2.0, out=out) is out
    assert cp.asarray(x) is x
    assert_array_equal(out.get(), (host + 1.0) * 2.0)


def test_uploads_copy_and_are_counted_apart():
    host = _host()
    with count_transfers() as c:
        x = cp.asarray(host)
        y = cp.array([x[0], x[1]])           # device arrays in a list: no host data
    host[0, 0] = 123.0                       # the device copy does not see the host's change
    assert c.total == 0 and c.uploads == 2
    assert x.get()[0, 0] != 123.0
    assert y.shape == (2, 4)


def test_comparisons_are_elementwise_and_none_is_no_error():
    x = cp.asarray([1.0, 2.0, 3.0])
    assert_array_equal((x == cp.asarray([1.0, 0.0, 3.0])).get(), [True, False, True])
    assert_array_equal((x != None).get(), [True, True, True])  # noqa: E711  (CuPy: all True)
    assert_array_equal((x == None).get(), [False, False, False])  # noqa: E711
    # A 0-d NumPy array in a comparison is taken as its scalar (CuPy's numpy#12142 workaround).
    assert_array_equal((x > np.array(1.5)).get(), [False, True, True])


def test_truth_values_follow_cupy():
    with pytest.raises(ValueError, match="more than one element"):
        bool(cp.asarray([1.0, 2.0]))
    with count_transfers() as c, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(DeprecationWarning):
            bool(cp.asarray([]))
    assert c.total == 0


def test_floating_point_warnings_are_silent_as_on_a_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        value = cp.log(cp.asarray([0.0, -1.0]))
    got = value.get()
    assert got[0] == -np.inf and np.isnan(got[1])


def test_float32_subnormals_are_flushed_as_cupys_ftz_kernels_do():
    # CuPy compiles every kernel with -ftz=true: a float32 subnormal result is stored as 0
    # (of its sign) and a subnormal operand is read as 0; float64 keeps its subnormals.
    # 2^-130 is a float32 subnormal (the smallest normal is 2^-126), 2^-1030 a float64 one.
    big = cp.asarray(np.array([2.0**127, -2.0**127, 2.0**120], np.float32))
    quotient = 1.0 / big                               # 2^-127, -2^-127: subnormal
    assert quotient.dtype == np.float32
    assert_array_equal(cp.asnumpy(quotient), np.array([0.0, -0.0, 2.0**-120], np.float32))
    assert np.signbit(cp.asnumpy(quotient)[1])
    assert_array_equal(cp.asnumpy(big / big), np.ones(3, np.float32))  # no subnormal step
    operand = cp.asarray(np.array([2.0**-130, 1.0], np.float32))
    assert_array_equal(cp.asnumpy(operand * np.float32(2.0**10)),
                       np.array([0.0, 2.0**10], np.float32))  # 2^-120 were it not flushed
    assert_array_equal(cp.asnumpy(cp.sum(operand)), np.float32(1.0))
    wide = cp.asarray(np.array([2.0**1000], np.float64))
    assert_array_equal(cp.asnumpy(1.0 / wide / 2.0**30), np.array([2.0**-1030]))
    # in place (out=) the array itself is flushed; at() still updates its operand
    out = cp.asarray(np.array([4.0, 4.0], np.float32))
    cp.multiply(out, np.float32(2.0**-128), out=out)
    assert_array_equal(cp.asnumpy(out), np.zeros(2, np.float32))
    target = cp.asarray(np.zeros(3, np.float32))
    cp.add.at(target, np.array([0, 0, 2]), np.float32(1.5))
    assert_array_equal(cp.asnumpy(target), np.array([3.0, 0.0, 1.5], np.float32))


def test_cholesky_of_an_indefinite_matrix_raises_nothing_as_cupy():
    # cuSOLVER's devInfo is read only under cupyx.errstate(linalg="raise"); the stand-in
    # returns NaN where NumPy raises LinAlgError.
    factor = cp.linalg.cholesky(cp.asarray([[1.0, 2.0], [2.0, 1.0]]))
    assert np.isnan(factor.get()).all()
    good = cp.linalg.cholesky(cp.asarray([[4.0, 2.0], [2.0, 5.0]])).get()
    assert_array_equal(good, [[2.0, 0.0], [1.0, 2.0]])  # small integers: exact in float64


def test_cuda_array_interface_points_at_the_backing_host_buffer():
    x = _device(shape=(4, 6))
    for view in (x, x.T, x[:, ::2]):
        interface = view.__cuda_array_interface__
        assert interface["version"] == 3 and interface["stream"] == 1
        assert interface["shape"] == view.shape and interface["typestr"] == "<f8"
        assert interface["strides"] == view.strides
        holder = type("Host", (), {"__array_interface__": {
            "shape": interface["shape"], "typestr": interface["typestr"],
            "data": interface["data"], "strides": interface["strides"], "version": 3}})()
        host_view = np.asarray(holder)
        host_view[0, 0] = 7.5                 # writes through to the stand-in's memory
        assert float(view[0, 0]) == 7.5
    assert cp.__refdml_standin__ is True


def test_cuda_namespace():
    cuda = cp.cuda
    assert cuda.runtime.getDeviceCount() == 1
    assert cuda.Device().id == 0 and cuda.get_current_stream().ptr == 0
    with cuda.Stream() as stream:
        assert cuda.get_current_stream() is stream and stream.ptr != 0
        assert _device().__cuda_array_interface__["stream"] == stream.ptr
    assert cuda.get_current_stream() is cuda.Stream.null
    start, end = cuda.Event(), cuda.Event()
    start.record()
    end.record()
    assert cuda.get_elapsed_time(start, end) >= 0.0
    with pytest.raises(cuda.runtime.CUDARuntimeError):
        cuda.Device(1)


# ------------------------------------------------------------------ counting
TRANSFERS = {
    "float": lambda x: float(x[0, 0]),
    "int": lambda x: int(x[0, 0]),
    "bool": lambda x: bool(x[0, 0] > 0),
    "complex": lambda x: complex(x[0, 0]),
    "item": lambda x: x[0, 0].item(),
    "get": lambda x: x.get(),
    "tolist": lambda x: x.tolist(),
    "tobytes": lambda x: x.tobytes(),
    "asnumpy": lambda x: cp.asnumpy(x),
    "format": lambda x: f"{x[0, 0]:.3f}",
    "pickle": lambda x: pickle.dumps(x),
    "synchronize": lambda x: cp.cuda.Device().synchronize(),
    "shape": lambda x: x[x > 0],
}


def test_every_kind_is_covered():
    assert set(TRANSFERS) == set(DEVICE_TO_HOST)


@pytest.mark.parametrize("kind", sorted(TRANSFERS))
def test_each_transfer_is_counted_once_under_its_kind(kind):
    x = _device()
    with count_transfers() as c:
        TRANSFERS[kind](x)
    assert c.total == 1 and c[kind] == 1, c


@pytest.mark.parametrize("kind", sorted(TRANSFERS))
def test_strict_mode_refuses_each_transfer(kind):
    x = _device()
    with strict_transfers(), pytest.raises(HostTransferError, match=kind):
        TRANSFERS[kind](x)
    with strict_transfers(), allow_transfers():
        TRANSFERS[kind](x)


def test_numpy_scalar_of_a_0d_array_is_a_float_transfer():
    # np.float64(x) takes __float__ (a get() on CuPy), not __array__.
    x = _device()
    with count_transfers() as c:
        value = np.float64(x[0, 0])
    assert c["float"] == 1 and c.total == 1
    assert value == _host()[0, 0]


def test_repr_and_str_are_transfers():
    x = _device()
    with count_transfers() as c:
        repr(x), str(x)
    assert c["format"] == 2


@pytest.mark.parametrize("call, n", [
    (lambda x: cp.nonzero(x > 0), 1), (lambda x: cp.flatnonzero(x), 1),
    (lambda x: cp.argwhere(x), 1), (lambda x: cp.unique(x), 1),
    (lambda x: cp.unique(x, return_counts=True), 2), (lambda x: cp.where(x > 0), 1),
    (lambda x: cp.bincount(cp.asarray([0, 2, 2])), 2), (lambda x: cp.triu_indices(4, 1), 2),
    (lambda x: x.nonzero(), 1), (lambda x: x.ravel()[x.ravel() > 0], 1),
    (lambda x: x.__setitem__(x > 0, 0.0), 1),
    (lambda x: cp.where(x > 0, x, 0.0), 0), (lambda x: x[cp.asarray([0, 2])], 0),
    (lambda x: cp.searchsorted(cp.sort(x.ravel()), x.ravel()), 0),
], ids=["nonzero", "flatnonzero", "argwhere", "unique", "unique-counts", "where1", "bincount",
        "triu_indices", "x.nonzero", "mask-get", "mask-set", "where3", "int-index",
        "searchsorted"])
def test_data_dependent_shapes_are_counted_as_cupy_syncs(call, n):
    x = _device()
    with count_transfers() as c:
        call(x)
    assert c.total == n and c["shape"] == n, c


def test_free_operations_count_nothing():
    x = _device()
    with count_transfers() as c:
        x.shape, x.dtype, x.ndim, x.size, x.strides, len(x), x.T, x.data.ptr
        list(iter(x))
        cp.asarray(x)
        copy.deepcopy(x)
        x.astype(np.float32).reshape(-1)[2:]
        x.__cuda_array_interface__
    assert c.total == 0 and c.uploads == 0, c


def test_counters_nest_and_stop_counting_on_exit():
    x = _device()
    with count_transfers() as outer:
        float(x[0, 0])
        with count_transfers() as inner:
            float(x[0, 1])
    float(x[0, 2])
    assert (outer.total, inner.total) == (2, 1)
    with pytest.raises(KeyError, match="kind == 'nope'"):
        outer["nope"]


def test_pickle_round_trip_is_a_transfer_and_an_upload():
    x = _device()
    with count_transfers() as c:
        y = pickle.loads(pickle.dumps(x))
    assert (c.total, c.uploads) == (1, 1)
    assert type(y) is cp.ndarray
    assert_array_equal(y.get(), x.get())


# ------------------------------------------------------------------ installed
def test_installed_stand_in_is_what_refdml_picks(tmp_path):
    """In a fresh process: install() makes ``import cupy`` the stand-in, refdml's array
    namespace picks it for stand-in arrays, and a second install is a no-op."""
    tests = Path(__file__).resolve().parents[1]
    code = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "import cupy_standin; cupy_standin.install(); cupy_standin.install()\n"
        "import cupy, cupyx.scipy.special, cupyx.scipy.linalg\n"
        "from refdml._backend import get_backend, is_device_array\n"
        "from refdml.gpu import cupy_available\n"
        "x = cupy.zeros(3)\n"
        "ns = get_backend(x)\n"
        "assert cupy_standin.installed() and cupy_available()\n"
        "assert ns.xp is cupy and ns.special is cupyx.scipy.special and is_device_array(x)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tests)], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
