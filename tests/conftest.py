import contextlib
import functools
import os
import sys
import warnings

# Tiny matrices on a 2-core machine: threaded BLAS only adds contention. Must be set
# before numpy is first imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# The Numba CUDA kernels of refdml.gpu run under Numba's CUDA simulator unless this machine
# has an NVIDIA driver (a lent GPU): there they run for real, on CuPy arrays. Must be set
# before numba.cuda is first imported. Set NUMBA_ENABLE_CUDASIM yourself to override.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# REFDML_CUPY_STANDIN=1 (scripts/ci_cupy_standin.sh): `import cupy` gives the strict
# NumPy-backed stand-in of tests/cupy_standin, so the CuPy rows run without a GPU. Must
# happen before anything imports refdml or cupy.
if os.environ.get("REFDML_CUPY_STANDIN") == "1":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cupy_standin

    cupy_standin.install()

import pytest

from hypothesis import HealthCheck, settings

# CI machines are small (2 cores); keep hypothesis budgets modest and deadline-free.
# "ci" is derandomised (the same examples on every run, no example database) so a submission
# never lands or fails by the luck of the draw. It is also the default of a plain `pytest`
# (README's test command): a user's run checks the examples CI checked, and a rare draw
# cannot turn their suite red while a rerun is green. "dev" and "thorough" draw afresh each
# run, for whoever is hunting new counterexamples (HYPOTHESIS_PROFILE=dev pytest ...).
settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# scripts/ci_cpu_matrix.sh: the cpu_exact tests once per CPU code path; CI's fixed examples,
# fewer of them (a test's own @settings(max_examples=...) still wins).
settings.register_profile(
    "cpu_matrix",
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


# ------------------------------------------------------------------ GPU tests (issue 21)
# Two markers say what a test (or a parametrised row) needs; where it is missing the test
# skips with the reason, never fails. ``requires_cuda``: the Numba ``@cuda.jit`` kernels,
# which run under the simulator (on NumPy arrays) or on a GPU (on CuPy arrays, so CuPy must
# see the device too). ``requires_cupy``: CuPy arrays, which need a GPU with the simulator
# off (the simulator cannot read device memory, and CuPy inputs dispatch to the kernels),
# or refdml's CuPy stand-in (a module ``cupy`` with ``__refdml_standin__``) under the
# simulator. The checks run once, after every block of this file has run.
def _simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@functools.cache
def cupy_skip_reason() -> str | None:
    """Why CuPy arrays cannot be used in this session (None: they can)."""
    if getattr(sys.modules.get("cupy"), "__refdml_standin__", False):
        return None if _simulated() else (
            "the CuPy stand-in runs the CUDA kernels under the simulator only "
            "(NUMBA_ENABLE_CUDASIM=1)")
    if _simulated():
        return ("the CUDA simulator is on and cannot read device memory: CuPy rows run on a "
                "GPU with NUMBA_ENABLE_CUDASIM=0, or on the CuPy stand-in "
                "(REFDML_CUPY_STANDIN=1)")
    return _on_gpu_skip_reason()


def _on_gpu_skip_reason() -> str | None:
    # CuPy inputs dispatch to the kernels, so a GPU run needs both CuPy and numba.cuda
    from refdml.gpu._support.modes import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    return None if reason is None else f"{reason}; the simulator is off (NUMBA_ENABLE_CUDASIM=0)"


@functools.cache
def cuda_skip_reason() -> str | None:
    """Why the ``@cuda.jit`` kernels cannot run in this session (None: they can)."""
    if _simulated():
        return None
    return cupy_skip_reason()     # on a GPU the kernels run on CuPy arrays: both needed


_REQUIREMENTS = {"requires_cuda": cuda_skip_reason, "requires_cupy": cupy_skip_reason}


# pytester: the conformance plugin is tested on a small user package of its own.
pytest_plugins = ["pytester"]


def pytest_configure(config):
    config.addinivalue_line("markers", "requires_cuda: runs the Numba CUDA kernels (the "
                            "simulator, or a GPU with CuPy); skipped with the reason elsewhere")
    config.addinivalue_line("markers", "requires_cupy: needs CuPy arrays (a GPU, or the CuPy "
                            "stand-in under the simulator); skipped with the reason elsewhere")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, reason in _REQUIREMENTS.items():
            if item.get_closest_marker(name) is not None and reason() is not None:
                item.add_marker(pytest.mark.skip(reason=f"{name}: {reason()}"))


@pytest.fixture(scope="session")
def cuda_device_array():
    """Move a NumPy array to where the Numba CUDA kernels run in this session.

    Under the simulator (no GPU: CI) the kernels take NumPy arrays and the array is returned
    as it is; on a lent GPU it becomes a CuPy array. Tests of a ``@cuda.jit`` kernel call
    ``cuda_device_array(x)`` on their inputs and ``refdml._backend.to_numpy`` on the outputs, and
    carry the ``requires_cuda`` marker (a call where the kernels cannot run skips the test).
    Session-scoped (it holds no state) so that hypothesis tests may take it. With the CuPy
    stand-in (REFDML_CUPY_STANDIN=1) the arrays become stand-in CuPy arrays, as on a GPU.
    """
    if _simulated() and not getattr(sys.modules.get("cupy"), "__refdml_standin__", False):
        return lambda x: x

    def to_device(x):
        if cuda_skip_reason() is not None:
            pytest.skip(f"requires_cuda: {cuda_skip_reason()}")
        import cupy

        return cupy.asarray(x)

    return to_device


# numba-cuda warns "Grid size N will likely result in GPU under-utilization due to low
# occupancy." at every launch of fewer than 128 blocks: the tests' tiny grids, on a GPU only
# (the simulator never does). numba-cuda 0.30 raises it as numba.cuda.core.errors'
# NumbaPerformanceWarning, not numba.core.errors' (older releases): both classes are named,
# and only that message, so a host-array copy warning still fails a test.
_LOW_OCCUPANCY = r".*Grid size \d+ will likely result in GPU under-utilization"


def _performance_warnings() -> list[type[Warning]]:
    from numba.core.errors import NumbaPerformanceWarning

    categories = [NumbaPerformanceWarning]
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning as CudaPerformanceWarning
    except ImportError:                             # no numba-cuda: nothing launches
        return categories
    return [*categories, CudaPerformanceWarning]


@contextlib.contextmanager
def _warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for category in _performance_warnings():
            warnings.filterwarnings("ignore", _LOW_OCCUPANCY, category)
        yield


@pytest.fixture(scope="session")
def warnings_as_errors():
    """``with warnings_as_errors():`` makes every warning an error (``simplefilter("error")``
    in a ``catch_warnings``) except numba-cuda's low-occupancy note on small launches; add
    more filters inside the block as usual."""
    return _warnings_as_errors


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # (tests/cuda_simulator_tuning.py: a shorter GIL switch interval, atomic shared arrays)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import cuda_simulator_tuning

    cuda_simulator_tuning.tune()

    # Every simulated launch must match a signature of the registry that
    # `refdml gpu-check --compile-only` compiles for real GPUs (refdml/gpu/_compile_check.py): on a
    # GPU, numba-cuda compiles one specialisation per argument types, so a launch the
    # registry lacks (a strided view, an int32 index array) would be a kernel that nobody
    # compiled in CI. Arrays are compared by dtype, ndim and layout (not numba's readonly
    # flag: device arrays are never typed readonly).
    from numba import typeof as _typeof
    from numba.core import types as _types
    from numba.core.sigutils import normalize_signature as _normalize_signature

    from refdml.gpu._support import launch as _launch
    from refdml.gpu import _compile_check

    def _launch_type(value):
        kind = _typeof(value)
        if isinstance(kind, _types.Array):
            return (str(kind.dtype), kind.ndim, kind.layout)
        return str(kind)

    @functools.cache
    def _registered_types(name):
        return {tuple(_launch_type_of_numba(t) for t in _normalize_signature(sig)[0])
                for sig in _compile_check.signatures_of(name)}

    def _launch_type_of_numba(kind):
        if isinstance(kind, _types.Array):
            return (str(kind.dtype), kind.ndim, kind.layout)
        return str(kind)

    def _check_registered_launch(kernel, args):
        name = kernel.fn.__name__
        launched = tuple(_launch_type(a) for a in args)
        registered = _registered_types(name)
        if launched not in registered:
            raise AssertionError(
                f"CUDA kernel {name} launched with argument types {launched}, which the "
                f"registry of refdml/gpu/_compile_check.py (compiled by `refdml gpu-check "
                f"--compile-only`) does not list: {sorted(registered)}")

    _launch.SIMULATED_LAUNCH_OBSERVERS.append(_check_registered_launch)
