"""Make Numba's CUDA simulator several times faster, without changing what it computes.

Used by tests/conftest.py and by ``scripts/bench_gpu.py --dry-run`` / ``scripts/gpu_run.sh
--dry-run``; call :func:`tune` after ``NUMBA_ENABLE_CUDASIM=1`` is set, before kernels run.

The simulator runs every CUDA thread as a Python thread, polled by a busy loop that holds
the GIL: each ``syncthreads()`` costs a few GIL switch intervals (5 ms by default), which
made a 30-iteration simulated Sinkhorn solve take 7 s. A 0.1 ms interval makes it 5-10x
faster. Shorter switches expose a check-then-act race in the simulator's shared-array
registry (two threads of a block can each create "the" shared array of a line); a lock
makes it atomic.
"""

from __future__ import annotations

import sys
import threading

_shared_lock = threading.Lock()


def tune() -> bool:
    """Shorten the GIL switch interval and make the simulator's shared arrays atomic.

    Returns False (and changes nothing) where the simulator's internals differ from those
    this patch knows (numba 0.59-0.68, numba-cuda 0.30): slower there, not wrong more often
    than the simulator itself.
    """
    from numba.cuda.simulator import kernelapi

    if not all(hasattr(kernelapi, name) for name in ("FakeCUDAShared", "types",
                                                     "numpy_support", "np")):
        return False
    original = kernelapi.FakeCUDAShared.array
    if getattr(original, "_refdml_tuned", False):
        return True

    def locked_shared_array(self, shape, dtype):
        """The simulator's FakeCUDAShared.array (one array per source line), made atomic."""
        if shape == 0:
            return original(self, shape, dtype)
        if isinstance(dtype, kernelapi.types.Type):
            dtype = kernelapi.numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _shared_lock:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = kernelapi.np.empty(shape, dtype)
        return array

    locked_shared_array._refdml_tuned = True
    sys.setswitchinterval(1e-4)
    kernelapi.FakeCUDAShared.array = locked_shared_array
    return True
