import os

# Tiny matrices on a 2-core machine: threaded BLAS only adds contention. Must be set
# before numpy is first imported.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# The Numba CUDA kernels of refdml.gpu run under Numba's CUDA simulator unless this machine
# has an NVIDIA driver (a lent GPU): there they run for real, on CuPy arrays. Must be set
# before numba.cuda is first imported. Set NUMBA_ENABLE_CUDASIM yourself to override.
if "NUMBA_ENABLE_CUDASIM" not in os.environ and not os.path.exists("/dev/nvidiactl"):
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import pytest

from hypothesis import HealthCheck, settings

# CI machines are small (2 cores); keep hypothesis budgets modest and deadline-free.
# CI is derandomised (the same examples on every run, no example database) so a submission
# never lands or fails by the luck of the draw; "dev" and "thorough" draw afresh each run.
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
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture
def cuda_device_array():
    """Move a NumPy array to where the Numba CUDA kernels run in this session.

    Under the simulator (no GPU: CI) the kernels take NumPy arrays and the array is returned
    as it is; on a lent GPU it becomes a CuPy array. Tests of a ``@cuda.jit`` kernel call
    ``cuda_device_array(x)`` on their inputs and ``refdml._xp.to_numpy`` on the outputs.
    """
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return lambda x: x
    cupy = pytest.importorskip("cupy", reason="a real CUDA run needs CuPy arrays")
    return cupy.asarray


if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # The simulator runs every CUDA thread as a Python thread, polled by a busy loop that
    # holds the GIL: each syncthreads() costs a few GIL switch intervals (5 ms by default),
    # which made a 30-iteration simulated Sinkhorn solve take 7 s. A 0.1 ms interval makes
    # it 5-10x faster. Shorter switches expose a check-then-act race in the simulator's
    # shared-array registry (two threads of a block can each create "the" shared array of
    # a line); a lock makes it atomic.
    import sys
    import threading

    from numba.cuda.simulator import kernelapi as _kernelapi

    # The patch below reaches into the simulator's internals (numba 0.59-0.68); where they
    # differ, leave the simulator and the switch interval as they are (slower, not wrong
    # more often than the simulator itself).
    _PATCHABLE = all(hasattr(_kernelapi, name) for name in ("FakeCUDAShared", "types",
                                                             "numpy_support", "np"))
    if _PATCHABLE:
        sys.setswitchinterval(1e-4)
    _shared_lock = threading.Lock()
    _dynamic_shared_array = getattr(getattr(_kernelapi, "FakeCUDAShared", None), "array", None)

    def _locked_shared_array(self, shape, dtype):
        """The simulator's FakeCUDAShared.array (one array per source line), made atomic."""
        if shape == 0:
            return _dynamic_shared_array(self, shape, dtype)
        if isinstance(dtype, _kernelapi.types.Type):
            dtype = _kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _shared_lock:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = _kernelapi.np.empty(shape, dtype)
        return array

    if _PATCHABLE:
        _kernelapi.FakeCUDAShared.array = _locked_shared_array
