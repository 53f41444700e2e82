"""``cupy.cuda`` of the stand-in: one device, streams and events that wait for nothing
(NumPy has finished when a call returns), each ``synchronize`` counted as a host wait."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import time
from types import SimpleNamespace

import sys

from cupy_standin import _array
from cupy_standin._array import CaptureError, record_transfer

__all__ = ["Device", "Event", "Graph", "MemoryPool", "Stream", "get_current_stream",
           "get_elapsed_time", "runtime", "using_allocator"]

#: What ``runtime.getDeviceProperties`` reports (an H100-like part; only the fields a
#: caller may read, none of them measured).
_PROPERTIES = {
    "name": b"CuPy stand-in (NumPy on the host)",
    "totalGlobalMem": 80 * 2**30,
    "sharedMemPerBlock": 48 * 2**10,
    "sharedMemPerBlockOptin": 227 * 2**10,
    "regsPerBlock": 65536,
    "warpSize": 32,
    "maxThreadsPerBlock": 1024,
    "multiProcessorCount": 132,
    "major": 9,
    "minor": 0,
}


class CUDARuntimeError(RuntimeError):
    """As ``cupy.cuda.runtime.CUDARuntimeError``."""


def _check_device(device: int) -> int:
    if int(device) != 0:
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return 0


runtime = SimpleNamespace(
    CUDARuntimeError=CUDARuntimeError,
    is_hip=False,
    getDeviceCount=lambda: 1,
    getDevice=lambda: 0,
    setDevice=_check_device,
    getDeviceProperties=lambda device: (_check_device(device), dict(_PROPERTIES))[1],
    runtimeGetVersion=lambda: 12080,
    driverGetVersion=lambda: 12080,
    deviceSynchronize=lambda: record_transfer("synchronize"),
    memGetInfo=lambda: (_PROPERTIES["totalGlobalMem"], _PROPERTIES["totalGlobalMem"]),
)


class Device:
    """``cupy.cuda.Device``: device 0 only."""

    def __init__(self, device=None) -> None:
        self.id = 0 if device is None else _check_device(device)

    compute_capability = "90"

    def synchronize(self) -> None:
        record_transfer("synchronize")

    def use(self) -> None:
        pass

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __int__(self) -> int:
        return self.id

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("cupy_standin.Device", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"

    @property
    def mem_info(self) -> tuple[int, int]:
        return runtime.memGetInfo()


_POINTERS = itertools.count(0x1000, 0x10)
_CURRENT: contextvars.ContextVar[Stream | None] = contextvars.ContextVar(
    "cupy_standin_stream", default=None)


class Stream:
    """``cupy.cuda.Stream``: ``Stream.null`` has ``ptr`` 0, each new stream its own."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False,
                 ptr: int | None = None) -> None:
        self.ptr = 0 if null else (next(_POINTERS) if ptr is None else int(ptr))
        self.non_blocking = bool(non_blocking) and not null
        self._tokens: list = []

    # -- stream capture (CuPy's Stream.begin_capture / end_capture / is_capturing) --------
    def begin_capture(self, mode=None) -> None:
        """Start capturing, as CuPy's (relaxed mode by default) on a stream that is neither
        the legacy default one nor blocking. The stand-in records no kernels (it runs them
        at once, on NumPy): it enforces what a graph needs instead. Until
        :meth:`end_capture`, a host read or synchronisation, an upload, an allocation by
        Numba (``cuda.device_array``, ``to_device``, ... : outside CuPy's pool) or work
        queued on another stream raises :class:`CaptureError` naming it; every launch is
        counted in the returned graph's ``launches``."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if not self.non_blocking:
            raise RuntimeError("the CuPy stand-in captures on a non-blocking stream only "
                               "(Stream(non_blocking=True)): a blocking one would order "
                               "itself after work on the legacy stream")
        if _array._CAPTURE[0] is not None:
            raise RuntimeError(f"{_array._CAPTURE[0][0]!r} is capturing already (the "
                               "stand-in captures one stream at a time)")
        counting = _array.count_launches()
        launches = counting.__enter__()
        _array._CAPTURE[0] = (self, counting, launches, _refuse_numba_allocations())

    def end_capture(self) -> Graph:
        """End the capture; a :class:`Graph` with the capture's launch count."""
        state = _array._CAPTURE[0]
        if state is None or state[0] is not self:
            raise RuntimeError(f"{self!r} is not capturing")
        _array._CAPTURE[0] = None
        _, counting, launches, restore = state
        restore()
        counting.__exit__(None, None, None)
        return Graph(launches)

    def is_capturing(self) -> bool:
        state = _array._CAPTURE[0]
        return state is not None and state[0] is self

    done = property(lambda self: True)
    device_id = 0

    def synchronize(self) -> None:
        record_transfer("synchronize")

    def use(self) -> Stream:
        _CURRENT.set(self)
        return self

    def record(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        pass

    def __enter__(self) -> Stream:
        self._tokens.append(_CURRENT.set(self))
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.reset(self._tokens.pop())

    def __repr__(self) -> str:
        return f"<Stream {self.ptr:#x} (CuPy stand-in)>"


Stream.null = Stream(null=True)


#: Numba's allocators of device (and pinned or mapped host) memory: outside CuPy's pool,
#: so a graph cannot hold them (and a replay would not allocate).
_NUMBA_ALLOCATORS = ("device_array", "device_array_like", "to_device", "pinned_array",
                     "pinned_array_like", "mapped_array", "mapped_array_like",
                     "managed_array")


def _refuse_numba_allocations():
    """Make Numba's allocators raise :class:`CaptureError` (where ``numba.cuda`` is
    imported); returns what puts them back."""
    module = sys.modules.get("numba.cuda")
    saved = {}
    if module is not None:
        for name in _NUMBA_ALLOCATORS:
            if hasattr(module, name):
                saved[name] = getattr(module, name)

                def refuse(*args, _name=name, **kwargs):
                    raise CaptureError(
                        f"numba.cuda.{_name} while a stream is capturing: an allocation "
                        "outside CuPy's memory pool, which a CUDA graph cannot hold")

                setattr(module, name, refuse)

    def restore() -> None:
        for name, value in saved.items():
            setattr(module, name, value)

    return restore


class Graph:
    """What ``Stream.end_capture`` returns. The stand-in ran the captured work at once and
    recorded none of it, so there is nothing to replay: :meth:`launch` raises. A caller
    that cannot replay here runs its step again inside a capture instead (refdml's
    captured training step does, so that every "replay" is checked as the capture was).
    ``launches``: the launches counted while capturing (a ``LaunchCounter``)."""

    def __init__(self, launches) -> None:
        self.launches = launches

    def launch(self, stream: Stream | None = None) -> None:
        raise NotImplementedError("the CuPy stand-in records no kernels: a captured graph "
                                  "cannot be replayed; run the captured work again instead")

    def upload(self, stream: Stream | None = None) -> None:
        pass


def get_current_stream(device_id: int | None = None) -> Stream:
    stream = _CURRENT.get()
    return Stream.null if stream is None else stream


class Event:
    """``cupy.cuda.Event``: ``record`` notes the host clock (work is done by then)."""

    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False) -> None:
        self.ptr = next(_POINTERS)
        self._time: float | None = None

    done = property(lambda self: True)

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def synchronize(self) -> None:
        record_transfer("synchronize")


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two recorded events."""
    if start_event._time is None or end_event._time is None:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle: an event was not recorded")
    return (end_event._time - start_event._time) * 1e3


def is_available() -> bool:
    return True


def get_device_id() -> int:
    return 0


@contextlib.contextmanager
def using_allocator(allocator=None):
    """``cupy.cuda.using_allocator``: NumPy allocates the stand-in's arrays whatever the
    allocator (a captured step's private pool is accepted and never called)."""
    yield


class MemoryPool:
    """``cupy.get_default_memory_pool()`` and ``cupy.cuda.MemoryPool()``: NumPy owns the
    memory; nothing is pooled."""

    def malloc(self, size: int):
        raise NotImplementedError("the CuPy stand-in's arrays are NumPy's: its pools "
                                  "allocate nothing")

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0

    def free_all_blocks(self, stream=None) -> None:
        pass

    def set_limit(self, size=None, fraction=None) -> None:
        pass

    def get_limit(self) -> int:
        return 0
