"""Launch profile (docs/gpu/cost-model.md, "Profiling a GPU run"). With ``REFDML_CUDA_PROFILE=1``,
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
import os
import threading
from collections.abc import Iterator
from typing import Any

from refdml.gpu._support.modes import cuda_simulator

__all__ = ["LaunchProfile", "launch_profile"]

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
            from refdml.gpu._support.cuda import cuda

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
