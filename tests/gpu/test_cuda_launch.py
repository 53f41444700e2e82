"""``refdml.gpu._support.launch.cuda_launch``: the one place every CUDA kernel is launched.

Under the simulator (CI) the launch hands host arrays to the simulated kernel; on hardware
it hands device arrays to Numba as non-synchronising views on the arrays' own stream. The
hardware branch cannot run here; its choices (stream, views, the opt-out) are checked with
stand-ins for Numba's functions, which is what they are: calls with the right arguments.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from numba import cuda

from refdml.gpu._support import launch as _launch
from refdml.gpu._support.launch import cuda_launch


class _DeviceLike:
    """An object that exports ``__cuda_array_interface__`` over a NumPy array's memory."""

    def __init__(self, array: np.ndarray, stream=1):
        self.array = array
        interface = dict(array.__array_interface__)
        self.__cuda_array_interface__ = {
            "shape": interface["shape"], "typestr": interface["typestr"],
            "data": interface["data"], "strides": interface["strides"], "version": 3,
            "stream": stream,
        }


class _RecordingKernel:
    """``kernel[grid, block(, stream)](*args)`` that records the launch and runs ``body``."""

    def __init__(self, body=None):
        self.launches = []
        self.body = body

    def __getitem__(self, config):
        def launch(*args):
            self.launches.append((config, args))
            if self.body is not None:
                self.body(*args)
        return launch


def _add_one(x, out):
    i = cuda.grid(1)
    if i < x.shape[0]:
        out[i] = x[i] + 1.0


@pytest.mark.skipif(not _launch.cuda_simulator(), reason="needs Numba's CUDA simulator")
def test_simulator_runs_kernel_on_standin_host_views(monkeypatch):
    # (the simulator swaps the module-level name ``cuda`` inside the kernel: not a local)
    add_one = cuda.jit(_add_one)
    # a throwaway kernel: not in the registry that tests/conftest.py checks launches against
    monkeypatch.setattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", [])
    monkeypatch.setitem(__import__("sys").modules, "cupy",
                        types.SimpleNamespace(__refdml_standin__=True))
    x = np.arange(5.0)
    out = np.full(5, np.nan)
    cuda_launch(add_one, 1, 8, _DeviceLike(x), _DeviceLike(out))
    # the kernel wrote through the view into the exporter's memory
    np.testing.assert_array_equal(out, x + 1.0)


@pytest.mark.skipif(not _launch.cuda_simulator(), reason="needs Numba's CUDA simulator")
def test_simulator_refuses_real_device_memory(monkeypatch):
    # A CuPy array under the simulator would be a device pointer read as host memory.
    monkeypatch.setitem(__import__("sys").modules, "cupy", types.SimpleNamespace())
    monkeypatch.setattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", [])
    kernel = _RecordingKernel()
    with pytest.raises(ValueError, match="simulator .* cannot read device memory"):
        cuda_launch(kernel, 1, 32, _DeviceLike(np.zeros(3)))
    assert kernel.launches == []


@pytest.mark.skipif(not _launch.cuda_simulator(), reason="needs Numba's CUDA simulator")
def test_simulator_passes_numpy_and_scalars_unchanged(monkeypatch):
    monkeypatch.setattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", [])
    kernel = _RecordingKernel()
    x = np.zeros(3)
    cuda_launch(kernel, 2, 32, x, 1.5, 7, True)
    (config, args), = kernel.launches
    assert config == (2, 32)
    assert args[0] is x and args[1:] == (1.5, 7, True)


@pytest.mark.skipif(not _launch.cuda_simulator(), reason="needs Numba's CUDA simulator")
def test_simulated_launches_are_checked_against_the_compile_registry():
    # tests/conftest.py's observer: a launch with argument types that
    # `refdml gpu-check --compile-only` does not compile (here a strided view where the
    # kernel is registered for C-contiguous rows) fails the test that made it.
    from refdml.gpu.kcenter import _cuda as _nb_kcenter

    assert _launch.SIMULATED_LAUNCH_OBSERVERS, "tests/conftest.py registers the check"
    points = np.ones((4, 6))
    with pytest.raises(AssertionError, match="refdml_kcenter_prepare launched with"):
        cuda_launch(_nb_kcenter.refdml_kcenter_prepare, 1, 32, points[:, ::2], np.empty((3, 4)),
                    np.empty(4))
    out = np.empty(4)
    cuda_launch(_nb_kcenter.refdml_kcenter_prepare, 1, 32, points, np.empty((6, 4)), out)
    np.testing.assert_array_equal(out, 6.0)  # sums of six ones: exact


class _FakeCuda:
    """The four numba.cuda functions the hardware branch calls, recorded."""

    def __init__(self):
        self.views = []

    def as_cuda_array(self, obj, sync=True):
        self.views.append((obj, sync))
        return ("view", obj)

    def legacy_default_stream(self):
        return "legacy"

    def per_thread_default_stream(self):
        return "per-thread"

    def external_stream(self, ptr):
        return ("external", ptr)


@pytest.fixture
def hardware(monkeypatch):
    """The hardware branch of cuda_launch, with Numba's functions recorded."""
    from refdml.gpu._support import cuda as _cuda

    fake = _FakeCuda()
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    monkeypatch.delenv("REFDML_CUDA_LAUNCH_SYNC", raising=False)
    # refdml takes numba.cuda from its one import point only (tests/test_architecture.py)
    monkeypatch.setattr(_cuda, "cuda", fake)
    return fake


@pytest.mark.parametrize("exported, expected", [
    (None, "legacy"), (0, "legacy"), (1, "legacy"), (2, "per-thread"),
    (0x7F00DEAD, ("external", 0x7F00DEAD)),
])
def test_hardware_launch_uses_exported_stream_without_sync(hardware, exported, expected):
    kernel = _RecordingKernel()
    a, b = _DeviceLike(np.zeros(2), stream=exported), _DeviceLike(np.zeros(2), stream=exported)
    cuda_launch(kernel, 4, 128, a, 2.0, b)
    (config, args), = kernel.launches
    assert config == (4, 128, expected)
    assert args == (("view", a), 2.0, ("view", b))
    assert hardware.views == [(a, False), (b, False)]


def test_hardware_launch_sync_opt_out(hardware, monkeypatch):
    # REFDML_CUDA_LAUNCH_SYNC=1: the arrays go to Numba as they are (its default: one
    # synchronisation of the exported stream per array) on Numba's default stream.
    monkeypatch.setenv("REFDML_CUDA_LAUNCH_SYNC", "1")
    kernel = _RecordingKernel()
    a = _DeviceLike(np.zeros(2), stream=0x1234)
    cuda_launch(kernel, 1, 32, a)
    (config, args), = kernel.launches
    assert config == (1, 32) and args == (a,)
    assert hardware.views == []


# --------------------------------------------------------------------------- the seam's chooser
def test_implementations_choose_by_mode_and_input(monkeypatch):
    """:class:`Implementations` picks one object per call: "auto" by the measured table,
    forced modes the kernel where the family has one (else the array path), and refuses a
    host kernel on a device array and a CUDA kernel on host memory outside the simulator."""
    from refdml.gpu._support.modes import Implementations
    from refdml.gpu import use_kernels

    class Device:                     # an array whose backend's kernels are CUDA's
        pass

    targets = {True: types.SimpleNamespace(kernel_target="cuda"),
               False: types.SimpleNamespace(kernel_target="cpu")}
    monkeypatch.setattr("refdml.gpu._support.modes.get_backend",
                        lambda x: targets[isinstance(x, Device)])
    full = Implementations("full", array="A", load_cpu=lambda: "C", load_cuda=lambda: "K", auto_numpy="array",
                           auto_cupy="cuda")
    bare = Implementations("bare", array="A", auto_numpy="array", auto_cupy="array")
    host, device = np.zeros(1), Device()
    with use_kernels("auto"):
        assert (full.choose(host), full.choose(device)) == ("A", "K")
        assert (bare.choose(host), bare.choose(device)) == ("A", "A")
    with use_kernels("array"):
        assert (full.choose(host), full.choose(device)) == ("A", "A")
    with use_kernels("cpu"):
        assert (full.choose(host), bare.choose(host)) == ("C", "A")
        with pytest.raises(ValueError, match="'cpu' cannot take a CuPy array"):
            full.choose(device)
    with use_kernels("cuda"):
        assert (full.choose(device), bare.choose(device)) == ("K", "A")
        monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
        with pytest.raises(ValueError, match="'cuda' needs CuPy arrays"):
            full.choose(host)
        assert bare.choose(host) == "A"       # no CUDA kernel: nothing to refuse
        monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")
        assert full.choose(host) == "K"


def test_implementations_refuse_an_auto_choice_they_cannot_run():
    from refdml.gpu._support.modes import Implementations

    with pytest.raises(ValueError, match="auto_cupy == 'cpu'"):
        Implementations("x", array="A", load_cpu=lambda: "C", auto_cupy="cpu")
    with pytest.raises(ValueError, match="'auto' names a kernel the family does not have"):
        Implementations("x", array="A", auto_numpy="cpu")
