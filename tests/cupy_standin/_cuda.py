"""``cupy.cuda`` of the stand-in: one device, streams and events that wait for nothing
(NumPy has finished when a call returns), each ``synchronize`` counted as a host wait."""

from __future__ import annotations

import contextvars
import itertools
import time
from types import SimpleNamespace

from cupy_standin._array import record_transfer

__all__ = ["Device", "Event", "MemoryPool", "Stream", "get_current_stream", "get_elapsed_time",
           "runtime"]

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
        self._tokens: list = []

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


class MemoryPool:
    """``cupy.get_default_memory_pool()``: NumPy owns the memory; nothing is pooled."""

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
