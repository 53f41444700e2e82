"""The CuPy framework of :mod:`refdml.conformance` (refdml/conformance/_cupy.py).

Without a GPU the tests run on the strict CuPy stand-in of tests/cupy_standin (NumPy
arrays behind CuPy's rules: no implicit conversion to NumPy, every host transfer counted),
put in ``sys.modules`` for the time of one test when no ``cupy`` is imported yet; under
``REFDML_CUPY_STANDIN=1`` the installed stand-in is used, and on a machine with a GPU and
CuPy the real one. The implementations are small CuPy pairs of ``normalize.l2_normalize``
written against the ``cupy`` namespace, one correct and one with a planted defect, and
refdml's own fast-path mirror (a real CuPy implementation).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import cupy_standin
import refdml.conformance as conformance
from refdml.conformance import check_implementation, get_framework

_MODULE = "refdml.conformance._cupy"


def _real_cupy_on_a_gpu() -> bool:
    return importlib.util.find_spec("cupy") is not None and os.path.exists("/dev/nvidiactl")


@pytest.fixture
def cp(monkeypatch):
    """The ``cupy`` module the framework runs on in this test (see the module docstring),
    with :mod:`refdml.conformance._cupy` imported against it."""
    present = sys.modules.get("cupy")
    if present is None and _real_cupy_on_a_gpu():
        import cupy as present
    if present is not None:
        if not getattr(present, "__refdml_standin__", False):
            try:
                count = present.cuda.runtime.getDeviceCount()
            except Exception as error:  # noqa: BLE001 - CuPy without a driver
                pytest.skip(f"CuPy is imported but cannot reach a GPU ({error})")
            if count < 1:
                pytest.skip("CuPy is imported but sees no GPU")
        yield present
        return
    # A stand-in of this test's own, and a _cupy module imported against it; both are
    # forgotten afterwards, so no other test sees a `cupy` it did not ask for.
    for name, module in cupy_standin.build_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    had_module = _MODULE in sys.modules
    if had_module:
        monkeypatch.delitem(sys.modules, _MODULE)
        monkeypatch.delattr(conformance, "_cupy")
    yield sys.modules["cupy"]
    if not had_module:
        sys.modules.pop(_MODULE, None)
        conformance.__dict__.pop("_cupy", None)


def _standin(cp) -> bool:
    return bool(getattr(cp, "__refdml_standin__", False))


def pair(cp, *, projection=True):
    """A CuPy pair of ``y = x / ||x||`` per row (scale-safe: the largest entry divided out
    first); without ``projection`` its backward drops the ``- y <y, d_y>`` term."""

    def forward(x):
        peak = cp.max(cp.abs(x), axis=-1, keepdims=True)
        scaled = x / peak
        norm = cp.sqrt(cp.sum(scaled * scaled, axis=-1, keepdims=True))
        y = scaled / norm
        return y, (y, peak * norm)

    def backward(ctx, d_y):
        y, norm = ctx
        if not projection:
            return {"x": d_y / norm}
        return {"x": (d_y - y * cp.sum(y * d_y, axis=-1, keepdims=True)) / norm}

    return forward, backward


def check(cp, forward, backward, dtype, **options):
    options = {"seeds": 1, "search": False, **options}
    return check_implementation(forward, "normalize.l2_normalize", framework="cupy",
                                backward=backward, dtype=dtype, **options)


# ------------------------------------------------------------------- the framework


def test_get_framework_dispatches_to_the_cupy_module(cp):
    from refdml.conformance import _cupy

    assert _cupy.cupy is cp
    framework = get_framework("cupy", backward=pair(cp)[1])
    assert isinstance(framework, _cupy.CupyFramework) and framework.name == "cupy"


@pytest.mark.parametrize("dtype", ["float32", "float64", None])
def test_asarray_copies_to_the_device_in_the_dtype(cp, dtype):
    framework = get_framework("cupy", backward=pair(cp)[1])
    host = np.random.default_rng(0).standard_normal((3, 4))
    labels = np.array([0, 1, 1])
    x, y = framework.asarray(host, dtype), framework.asarray(labels, dtype)
    assert type(x) is cp.ndarray and type(y) is cp.ndarray
    assert x.dtype == np.dtype(dtype or "float64") and y.dtype == labels.dtype
    # A float32 cast rounds each entry once, as NumPy's own cast does.
    assert_array_equal(cp.asnumpy(x), host.astype(dtype or "float64"))
    host[0, 0] = 123.0
    assert cp.asnumpy(x)[0, 0] != 123.0, "the device array shares the host buffer"


def test_run_hands_cupy_to_the_pair_and_numpy_back(cp):
    seen = {}
    forward, backward = pair(cp)

    def watched_backward(ctx, d_y):
        seen["cotangent"] = d_y
        return backward(ctx, d_y)

    framework = get_framework("cupy", backward=watched_backward)
    host = np.random.default_rng(1).standard_normal((5, 3))
    cotangent = np.random.default_rng(2).standard_normal((5, 3))
    evaluation = framework.run(lambda inputs: forward(**inputs),
                               {"x": framework.asarray(host, "float32")}, ("x",), (cotangent,))
    assert type(seen["cotangent"]) is cp.ndarray and seen["cotangent"].dtype == np.float32
    (y,) = evaluation.outputs
    grad = evaluation.grads["x"]
    assert type(y) is np.ndarray and type(grad) is np.ndarray
    assert y.dtype == np.float32 and grad.dtype == np.float32 and grad.shape == host.shape
    unit = host / np.linalg.norm(host, axis=1, keepdims=True)
    np.testing.assert_allclose(y, unit, rtol=1e-6, atol=0)
    assert framework.run(lambda inputs: forward(**inputs),
                         {"x": framework.asarray(host, None)}, ("x",), None).grads is None


def test_run_copies_back_only_the_outputs_and_gradients(cp):
    """On the stand-in every device-to-host copy is counted: one per output and per
    gradient (``cupy.asnumpy``), no hidden conversion or synchronisation."""
    if not _standin(cp):
        pytest.skip("transfers are counted by the CuPy stand-in only")
    forward, backward = pair(cp)
    framework = get_framework("cupy", backward=backward)
    inputs = {"x": framework.asarray(np.random.default_rng(3).standard_normal((4, 3)), None)}
    with cupy_standin.count_transfers() as transfers:
        framework.run(lambda kwargs: forward(**kwargs), inputs, ("x",), (np.ones((4, 3)),))
    assert transfers.total == transfers["asnumpy"] == 2, transfers


@pytest.mark.parametrize("device, message", [
    ("cpu", r"device == 'cpu', must be None, 'cuda' or 'cuda:N' for framework 'cupy'"),
    ("cuda:7", r"device == 'cuda:7', but CuPy sees \d+ device"),
])
def test_bad_devices_are_refused_by_name(cp, device, message):
    with pytest.raises(ValueError, match=message):
        get_framework("cupy", backward=pair(cp)[1], device=device)


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_first_device_is_accepted(cp, device):
    assert get_framework("cupy", backward=pair(cp)[1], device=device).device_id == 0


# --------------------------------------------------------------- check_implementation


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_correct_cupy_pair_passes(cp, dtype):
    report = check(cp, *pair(cp), dtype)
    assert report.passed, report.summary()
    assert report.framework == "cupy" and "seed 0" in report.cases


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_backward_without_its_projection_fails_in_the_gradient(cp, dtype):
    report = check(cp, *pair(cp, projection=False), dtype)
    assert not report.passed
    assert {f.quantity for f in report.failures} == {"grad x"}
    first = report.failures[0]
    assert (first.case, first.cause) == ("seed 0", "gradient")
    assert first.error > first.tolerance and len(first.index) == 2


def test_a_forward_that_is_not_a_pair_is_a_structure_failure(cp):
    forward, backward = pair(cp)
    report = check(cp, lambda x: forward(x)[0], backward, "float64")
    assert not report.passed
    assert {f.cause for f in report.failures} == {"structure"}
    assert "pair (outputs, ctx)" in report.failures[0].message


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_refdml_fast_path_mirror_passes_as_a_cupy_implementation(cp, dtype):
    # The mirror dispatches to the Numba CUDA kernels on CuPy arrays: on the stand-in they
    # run under Numba's simulator only (tests/conftest.py: cupy_skip_reason).
    if _standin(cp) and os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        pytest.skip("the CuPy stand-in runs refdml.gpu only under NUMBA_ENABLE_CUDASIM=1")
    from refdml.gpu import normalize as fast

    report = check(cp, fast.l2_normalize_forward, fast.l2_normalize_backward, dtype)
    assert report.passed, report.summary()
