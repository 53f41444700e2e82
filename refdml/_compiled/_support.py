"""Which implementation an operator runs (the array path or a Numba kernel), and how
compiled kernels are launched: the Numba support that the reference's compiled CPU twins
(:mod:`refdml._compiled`) and the fast path's kernels (refdml.gpu) share.

Every Numba kernel sits beside its array-path twin (the code written once against
NumPy/CuPy, or the readable reference). Each family of the fast path lists its
implementations in one :class:`Implementations` object, which chooses one per call; the
user steers the choice with :func:`use_kernels` (public as ``refdml.gpu.use_kernels``):

``"auto"`` (default)
    The fastest correct path as measured, per family and per input module
    (:attr:`Implementations.auto_numpy`, :attr:`Implementations.auto_cupy`): on CuPy the
    ``@cuda.jit`` kernels where they measured faster than the array path, on NumPy the
    compiled CPU twin where it measured faster.
``"array"``
    The array path only (what the kernels are checked against).
``"cpu"``
    The ``@njit`` CPU twin; a CuPy input is a ``ValueError`` (it would copy to the host).
``"cuda"``
    The ``@cuda.jit`` kernel; a NumPy input is accepted only under Numba's CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1``, how CI runs the CUDA kernels), else a ``ValueError``.

The mode is a context variable (thread- and task-safe); its default is the environment
variable ``REFDML_GPU_KERNELS`` or ``"auto"``.

>>> with use_kernels("array"):
...     kernel_mode()
'array'

Threading layer (docs/gpu.md, "Threading layer: fork safety"). Every call of an
``@njit(parallel=True)`` kernel runs inside :func:`parallel_launch`. Before the first
parallel region of the process it asks Numba for its ``"forksafe"`` layer
(:data:`THREADING_LAYER`: TBB where a compatible libtbb loads, else OpenMP off Linux, else
``workqueue``; on Linux without TBB, ``workqueue``) unless the user chose one
(``NUMBA_THREADING_LAYER`` or ``NUMBA_THREADING_LAYER_PRIORITY`` in the environment, a
``.numba_config.yaml``, ``numba.config.THREADING_LAYER`` set in code). Numba's default on
Linux, GNU OpenMP, kills a child forked after a parallel region at the child's first one
(``multiprocessing``'s fork start method, PyTorch DataLoader workers). ``workqueue`` aborts
the process when two threads launch parallel regions at once, so while it runs (or before
any layer runs) :func:`parallel_launch` also holds one process-wide lock: refdml's kernels
launched from several threads take turns. A process that ran a parallel region before its
first refdml launch keeps the layer it has (a running layer cannot change).

Launch profile (docs/gpu.md, "Profiling a GPU run"). With ``REFDML_CUDA_PROFILE=1``,
:func:`launch_profile` opens a :class:`LaunchProfile` into which :func:`cuda_launch`
records every launch while the block runs: the count per kernel name (``refdml_gsp_...``)
and, on a GPU, its device time by a pair of CUDA events on the launch stream, read after
the block with one synchronisation. Under the simulator it records counts only.

>>> with launch_profile() as record:
...     pass
>>> record.total_launches
0
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from refdml._compiled._notice import watch_cuda_dispatcher
from refdml._xp import is_cupy_array

Impl = TypeVar("Impl")

__all__ = [
    "BLOCK",
    "Implementations",
    "KERNEL_MODES",
    "LaunchProfile",
    "THREADING_LAYER",
    "cuda_launch",
    "cuda_simulator",
    "cuda_unavailable_reason",
    "kernel_mode",
    "launch_profile",
    "parallel_launch",
    "running_threading_layer",
    "select_threading_layer",
    "use_kernels",
]

#: Threads per block of every 1-D launch of refdml's CUDA kernels (the one launch-size
#: constant; also the largest problem of the small-problem Sinkhorn, one thread per point).
BLOCK = 128

KERNEL_MODES = ("auto", "array", "cpu", "cuda")

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("refdml_gpu_kernels", default=None)


def _check_mode(mode: object, name: str) -> str:
    if not isinstance(mode, str) or mode not in KERNEL_MODES:
        raise ValueError(f"{name} == {mode!r}, must be one of {KERNEL_MODES}")
    return mode


def kernel_mode() -> str:
    """The current mode: the innermost :func:`use_kernels`, else ``$REFDML_GPU_KERNELS``, else auto."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    return _check_mode(os.environ.get("REFDML_GPU_KERNELS", "auto"), "REFDML_GPU_KERNELS")


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Run the enclosed fast-path calls with ``mode`` (see the module docstring)."""
    token = _MODE.set(_check_mode(mode, "mode"))
    try:
        yield
    finally:
        _MODE.reset(token)


def cuda_simulator() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def cuda_unavailable_reason() -> str | None:
    """Why CuPy arrays cannot run refdml's CUDA kernels on this machine, or None if they can:
    CuPy must import and see a device, and numba.cuda must load and find a usable GPU (the
    simulator, which runs on host arrays, is not asked about: see :func:`cuda_simulator`).
    Used by the GPU tests to skip with the reason and by ``scripts/bench_gpu.py``."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:                        # CUDARuntimeError without a driver
        return f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if devices < 1:
        return "CuPy sees no CUDA device"
    try:
        from refdml._compiled._cuda import cuda

        if cuda.is_available():
            return None
    except Exception as exc:
        return f"numba.cuda does not load ({type(exc).__name__}: {exc})"
    return "numba.cuda finds no usable CUDA GPU (numba.cuda.is_available() is False)"


# ------------------------------------------------------------------------ the seam
@dataclass(frozen=True)
class Implementations(Generic[Impl]):
    """The implementations of one family of fast-path operators, and the one object that
    chooses among them: ``impl = GSP.choose(x)`` once per call, then ``impl.transport(...)``
    with no branch on the kind in the maths (as POT's backend ``nx``).

    ``array``: the code written once against NumPy/CuPy (always there, and what the
    kernels are checked against); ``cpu``: the compiled ``@njit`` CPU twin, or None;
    ``cuda``: the ``@cuda.jit`` kernels, or None. The three are objects of one interface
    that the family defines. ``auto_numpy`` / ``auto_cupy``: what ``use_kernels("auto")``
    runs on NumPy ("array" or "cpu") and on CuPy input ("array" or "cuda"): the fastest
    correct path as measured, ``measured`` saying where (docs/gpu.md keeps the numbers).

    The modes (module docstring): ``"array"`` runs ``array``; ``"cpu"`` / ``"cuda"`` run
    that kernel where the family has one, else ``array``; a host kernel asked for on a CuPy
    array, or a CUDA kernel that the family has on a NumPy array outside the simulator, is
    a ``ValueError`` (a family without CUDA kernels, such as the reference's own compiled
    twins, runs its array path under ``"cuda"`` whatever the input).
    """

    family: str
    array: Impl
    cpu: Impl | None = None
    cuda: Impl | None = None
    auto_numpy: str = "cpu"
    auto_cupy: str = "cuda"
    measured: str = ""

    def __post_init__(self) -> None:
        for name, value, allowed in (("auto_numpy", self.auto_numpy, ("array", "cpu")),
                                     ("auto_cupy", self.auto_cupy, ("array", "cuda"))):
            if value not in allowed:
                raise ValueError(f"{self.family}: {name} == {value!r}, must be one of {allowed}")
        if (self.auto_numpy == "cpu" and self.cpu is None) or (
                self.auto_cupy == "cuda" and self.cuda is None):
            raise ValueError(f"{self.family}: 'auto' names a kernel the family does not have")

    def kind(self, x: Any) -> str:
        """``"array"``, ``"cpu"`` or ``"cuda"``: what runs now for input array ``x``."""
        mode = kernel_mode()
        on_gpu = is_cupy_array(x)
        if mode == "auto":
            return self.auto_cupy if on_gpu else self.auto_numpy
        if mode == "array":
            return "array"
        if mode == "cpu":
            if on_gpu:
                raise ValueError("kernel mode 'cpu' cannot take a CuPy array (it would copy "
                                 "to the host)")
            return "cpu" if self.cpu is not None else "array"
        if self.cuda is None:           # nothing to run on the device: the array path
            return "array"
        if not on_gpu and not cuda_simulator():
            raise ValueError(
                "kernel mode 'cuda' needs CuPy arrays, or NumPy arrays under Numba's CUDA "
                "simulator (NUMBA_ENABLE_CUDASIM=1)")
        return "cuda"

    def choose(self, x: Any) -> Impl:
        """The implementation that runs now for input array ``x`` (:meth:`kind`'s)."""
        return {"array": self.array, "cpu": self.cpu, "cuda": self.cuda}[self.kind(x)]


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
#: each launch's argument types against the registry of :mod:`refdml.gpu._cuda_compile`,
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
    cupy = sys.modules.get("cupy")
    if not getattr(cupy, "__refdml_standin__", False):
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
    line on stderr if it is slow (:func:`refdml._compiled._notice.watch_cuda_dispatcher`).
    """
    records = tuple(_RECORDS) if _RECORDS else ()     # open launch_profile records
    if cuda_simulator():
        args = _simulator_args(args)
        for observe in SIMULATED_LAUNCH_OBSERVERS:
            observe(kernel, args)
        kernel[grid, block](*args)
        for record in records:
            record._count(_kernel_name(kernel))
        return
    watch_cuda_dispatcher(kernel)     # a line on stderr while it compiles, if that is slow
    indices = _device_arrays(args)
    if not indices or _launch_sync():
        if not records:
            kernel[grid, block](*args)
            return
        from refdml._compiled._cuda import cuda

        stream = cuda.default_stream()    # where numba-cuda launches without a stream
        launch = kernel[grid, block]
    else:
        from refdml._compiled._cuda import cuda

        stream = _launch_stream(cuda, args[indices[0]].__cuda_array_interface__)
        args = list(args)
        for i in indices:
            args[i] = cuda.as_cuda_array(args[i], sync=False)
        launch = kernel[grid, block, stream]
    if not records:
        launch(*args)
        return
    timed = any(record.timed for record in records)
    start = _recorded_event(cuda, stream) if timed else None
    launch(*args)
    end = _recorded_event(cuda, stream) if timed else None
    for record in records:
        record._count(_kernel_name(kernel), start, end)


# ------------------------------------------------------------------------ launch profile
#: Open :class:`LaunchProfile` records (process-wide: a launch on any thread counts, as in
#: the CuPy stand-in's transfer counters). Empty, :func:`cuda_launch` pays one truth test.
_RECORDS: list[LaunchProfile] = []
_RECORDS_LOCK = threading.Lock()


def _profile_switch() -> bool:
    """``$REFDML_CUDA_PROFILE == "1"``: :func:`launch_profile` records launches."""
    return os.environ.get("REFDML_CUDA_PROFILE", "0") == "1"


def _kernel_name(kernel: Any) -> str:
    """The Python name of a ``@cuda.jit`` kernel (``py_func`` on a GPU, ``fn`` under the
    simulator): ``refdml_gsp_pool_forward``, the name a profiler's demangled symbol holds."""
    for attribute in ("py_func", "fn"):
        function = getattr(kernel, attribute, None)
        if function is not None:
            return getattr(function, "__name__", repr(function))
    return getattr(kernel, "__name__", type(kernel).__name__)


def _recorded_event(cuda: Any, stream: Any) -> Any:
    event = cuda.event(timing=True)
    event.record(stream)
    return event


class LaunchProfile:
    """What :func:`cuda_launch` recorded while a :func:`launch_profile` block ran.

    ``launches``: launches per kernel name. ``device_seconds``: device time per kernel name,
    summed over its launches (each launch between two CUDA events on its stream), or None
    where not timed (the simulator, ``timing=False``, the switch off). Numba queues a
    launch from Python, so where the stream was idle the span also holds the host's launch
    time: an upper bound on the kernel's time, to read beside a CUPTI trace, not instead.
    ``enabled``: False when ``REFDML_CUDA_PROFILE`` was not ``"1"`` (nothing recorded).
    """

    def __init__(self, *, enabled: bool, timed: bool) -> None:
        self.enabled = enabled
        self.timed = timed
        self.launches: collections.Counter[str] = collections.Counter()
        self.device_seconds: dict[str, float] | None = None
        self._events: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()

    @property
    def total_launches(self) -> int:
        return sum(self.launches.values())

    def _count(self, name: str, start: Any = None, end: Any = None) -> None:
        with self._lock:
            self.launches[name] += 1
            if self.timed and start is not None:
                self._events.append((name, start, end))

    def read(self) -> None:
        """Fill :attr:`device_seconds` from the recorded events: one device synchronisation
        (``cuda.synchronize()``), then the events' elapsed times. Done on leaving the block."""
        if not self.timed:
            return
        seconds: dict[str, float] = dict.fromkeys(self.launches, 0.0)
        if self._events:
            from refdml._compiled._cuda import cuda

            cuda.synchronize()
            for name, start, end in self._events:
                seconds[name] += cuda.event_elapsed_time(start, end) * 1e-3
        self._events.clear()
        self.device_seconds = seconds

    def as_dict(self) -> dict:
        """Plain types, for a JSON document."""
        return {"enabled": self.enabled, "timed": self.timed,
                "launches": dict(sorted(self.launches.items())),
                "device_seconds": (None if self.device_seconds is None
                                   else dict(sorted(self.device_seconds.items())))}

    def __repr__(self) -> str:
        state = "" if self.enabled else ", disabled (REFDML_CUDA_PROFILE is not 1)"
        return f"LaunchProfile({dict(self.launches)}{state})"


@contextlib.contextmanager
def launch_profile(*, timing: bool | None = None) -> Iterator[LaunchProfile]:
    """Record the launches of :func:`cuda_launch` inside the block (module docstring).

    ``timing``: device time by CUDA events (default True; never under the simulator,
    which has no device clock). The switch ``REFDML_CUDA_PROFILE`` is read here, once per
    block, so that a launch with no record open costs one truth test; with the switch off
    the record is disabled and stays empty. Records nest and overlap: each sees every
    launch of its block.
    """
    enabled = _profile_switch()
    timed = enabled and (timing is None or bool(timing)) and not cuda_simulator()
    record = LaunchProfile(enabled=enabled, timed=timed)
    if not enabled:
        yield record
        return
    with _RECORDS_LOCK:
        _RECORDS.append(record)
    try:
        yield record
    finally:
        with _RECORDS_LOCK:
            _RECORDS.remove(record)
    record.read()


# ------------------------------------------------------------------------ threading layer

#: The Numba threading layer refdml asks for when the user chose none (module docstring).
THREADING_LAYER = "forksafe"

# Numba's own defaults: a config equal to them (and no variable in the environment) means
# that nobody chose, so refdml may.
_NUMBA_DEFAULT_LAYER = "default"
_NUMBA_DEFAULT_PRIORITY = ("tbb", "omp", "workqueue")

# Serialises refdml's parallel launches while the layer is (or may become) workqueue. An
# RLock so that a wrapper may hold it around several launches.
_LAUNCH_LOCK = threading.RLock()


def _new_lock_in_child() -> None:
    # A fork from another thread while one thread holds the lock would leave the child's
    # copy held by a thread that does not exist there: its first launch would wait forever.
    global _LAUNCH_LOCK
    _LAUNCH_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def running_threading_layer() -> str | None:
    """The threading layer Numba's parallel regions run on in this process (``"tbb"``,
    ``"omp"`` or ``"workqueue"``), or ``None`` before the first one."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:                      # Numba's answer before its threads start
        return None


def _layer_chosen(config) -> bool:
    return ("NUMBA_THREADING_LAYER" in os.environ
            or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ
            or str(config.THREADING_LAYER).lower() != _NUMBA_DEFAULT_LAYER
            or tuple(config.THREADING_LAYER_PRIORITY) != _NUMBA_DEFAULT_PRIORITY)


def select_threading_layer() -> None:
    """Ask Numba for :data:`THREADING_LAYER` unless the user chose a layer (module docstring).

    No effect once a layer runs. :func:`parallel_launch` calls it; call it yourself only
    to launch your own ``parallel=True`` code on the same layer before refdml's first.
    """
    if running_threading_layer() is not None:
        return
    from numba.core import config

    # Numba re-reads NUMBA_* variables when they change (at every compilation) and would
    # put back "default": read them now, so the compiler's re-read finds nothing new.
    config.reload_config()
    if not _layer_chosen(config):
        config.THREADING_LAYER = THREADING_LAYER


@contextlib.contextmanager
def parallel_launch() -> Iterator[None]:
    """Hold around every call of an ``@njit(parallel=True)`` kernel (module docstring):
    picks the threading layer before the first one and takes turns under ``workqueue``."""
    layer = running_threading_layer()
    if layer in (None, "workqueue"):
        with _LAUNCH_LOCK:
            if layer is None:
                select_threading_layer()
            yield
    else:
        yield
