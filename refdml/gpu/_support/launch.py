"""How refdml's CUDA kernels are launched: one launcher for every family.

:func:`cuda_launch` hands device arrays to Numba without a synchronisation and launches on
the stream the arrays were exported on; under Numba's CUDA simulator it turns the arrays of
refdml's CuPy stand-in into host views. :data:`BLOCK` is the one launch-size constant.
Inside a :func:`refdml.gpu._support.profile.launch_profile` block each launch is recorded.
"""

from __future__ import annotations

import os
from typing import Any

from refdml._backend import device_memory_on_host
from refdml.gpu._support import profile
from refdml.gpu._support.modes import cuda_simulator
from refdml.gpu._support.notice import watch_cuda_dispatcher

__all__ = ["BLOCK", "SIMULATED_LAUNCH_OBSERVERS", "cuda_launch"]

#: Threads per block of every 1-D launch of refdml's CUDA kernels (the one launch-size
#: constant; also the largest problem of the small-problem Sinkhorn, one thread per point).
BLOCK = 128


# ------------------------------------------------------------------------ CUDA launches
def _launch_sync() -> bool:
    """``$REFDML_CUDA_LAUNCH_SYNC == "1"``: numba-cuda's default per-array synchronisation."""
    return os.environ.get("REFDML_CUDA_LAUNCH_SYNC", "0") == "1"


def _device_arrays(args: tuple) -> list[int]:
    return [i for i, a in enumerate(args) if hasattr(a, "__cuda_array_interface__")]


def _launch_stream(cuda: Any, interface: dict) -> Any:
    """The Numba stream of a ``__cuda_array_interface__`` (version 3) ``stream`` entry: 1 the
    legacy default stream, 2 the per-thread default stream, another integer a producer's
    stream (CuPy's current stream when it exported the array), absent/None: the legacy one."""
    ptr = interface.get("stream")
    if ptr in (None, 0, 1):
        return cuda.legacy_default_stream()
    if ptr == 2:
        return cuda.per_thread_default_stream()
    return cuda.external_stream(ptr)


#: Callables ``observe(kernel, args)`` run before every simulated launch, ``args`` as the
#: simulated kernel gets them (host arrays). tests/conftest.py registers one that checks
#: each launch's argument types against the registry of :mod:`refdml.gpu._compile_check`,
#: so that the compile check compiles what the kernels are launched with.
SIMULATED_LAUNCH_OBSERVERS: list = []


class _HostInterface:
    """A ``__cuda_array_interface__`` read as ``__array_interface__`` (simulator only)."""

    def __init__(self, interface: dict):
        self.__array_interface__ = {key: interface[key] for key in ("shape", "typestr", "data")}
        self.__array_interface__.update(strides=interface.get("strides"), version=3)


def _simulator_args(args: tuple) -> tuple:
    """Under Numba's CUDA simulator the kernels run on host memory: NumPy arrays as they
    are, and the arrays of refdml's CuPy stand-in (tests/cupy_standin, a module ``cupy``
    with ``__refdml_standin__``, whose interface points at host memory) as NumPy views."""
    indices = _device_arrays(args)
    if not indices:
        return args
    if not device_memory_on_host():
        raise ValueError(
            "Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) cannot read device memory: "
            "unset NUMBA_ENABLE_CUDASIM to run the CUDA kernels on CuPy arrays"
        )
    import numpy as np

    args = list(args)
    for i in indices:
        args[i] = np.asarray(_HostInterface(args[i].__cuda_array_interface__))
    return tuple(args)


def cuda_launch(kernel: Any, grid: Any, block: Any, *args: Any) -> None:
    """Launch the ``@cuda.jit`` ``kernel`` on ``grid`` blocks of ``block`` threads.

    Every CUDA launch of refdml.gpu goes through here. Device arrays (CuPy's, or any object
    with ``__cuda_array_interface__``) are handed to Numba as views that do not synchronise
    (``numba.cuda.as_cuda_array(..., sync=False)``) and the kernel runs on the stream the
    arrays were exported on (CuPy's current stream): stream order alone keeps the launch
    after the work that produced its inputs and before the work that reads its outputs.
    numba-cuda's default instead synchronises that stream once per array argument (a GSP
    launch has about 20), which costs more than the kernel at small sizes;
    ``REFDML_CUDA_LAUNCH_SYNC=1`` restores it, for comparison. Under the simulator the
    arguments become host arrays (:func:`_simulator_args`). Returns nothing: outputs are
    written into their arrays; nothing waits for the kernel. Inside a
    :func:`launch_profile` block the launch is also recorded (and, on a GPU, bracketed by
    two CUDA events on its stream). A kernel's compilation at its first launch prints a
    line on stderr if it is slow (:func:`refdml.gpu._support.notice.watch_cuda_dispatcher`).
    """
    records = tuple(profile._RECORDS) if profile._RECORDS else ()     # open launch_profile records
    if cuda_simulator():
        args = _simulator_args(args)
        for observe in SIMULATED_LAUNCH_OBSERVERS:
            observe(kernel, args)
        kernel[grid, block](*args)
        for record in records:
            record._count(profile._kernel_name(kernel))
        return
    watch_cuda_dispatcher(kernel)     # a line on stderr while it compiles, if that is slow
    indices = _device_arrays(args)
    if not indices or _launch_sync():
        if not records:
            kernel[grid, block](*args)
            return
        from refdml.gpu._support.cuda import cuda

        stream = cuda.default_stream()    # where numba-cuda launches without a stream
        launch = kernel[grid, block]
    else:
        from refdml.gpu._support.cuda import cuda

        stream = _launch_stream(cuda, args[indices[0]].__cuda_array_interface__)
        args = list(args)
        for i in indices:
            args[i] = cuda.as_cuda_array(args[i], sync=False)
        launch = kernel[grid, block, stream]
    if not records:
        launch(*args)
        return
    timed = any(record.timed for record in records)
    start = profile._recorded_event(cuda, stream) if timed else None
    launch(*args)
    end = profile._recorded_event(cuda, stream) if timed else None
    for record in records:
        record._count(profile._kernel_name(kernel), start, end)
