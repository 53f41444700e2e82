"""Timing helpers shared by the benchmark scripts (not a test).

:func:`interleaved` for host code; :func:`clocked` and :func:`timed_rounds` take a ``sync``
(a device synchronisation) for work that a call only queues, as on a GPU.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def interleaved(functions: dict, repeats: int, *, warmups: int = 1) -> dict:
    """Median seconds of each function, the functions run in turn ``repeats`` times.

    Interleaving puts every function under the same machine load, so their ratios are
    comparable on a busy machine even when the absolute times are not. ``warmups`` calls of
    each come first (imports, caches, CuPy kernel compilation).
    """
    times = {name: [] for name in functions}
    for fn in functions.values():
        for _ in range(warmups):
            fn()
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def clocked(fn: Callable[[], Any], sync: Callable[[], None] | None = None) -> tuple[float, Any]:
    """``(seconds, result)`` of one call of ``fn``, the clock read between two calls of ``sync``.

    ``sync`` waits for the device (``cupy.cuda.Device().synchronize``): before the call so
    that earlier work is not billed to it, after it so that the work it queued is.
    """
    if sync is not None:
        sync()
    start = time.perf_counter()
    result = fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start, result


def timed_rounds(functions: dict, repeats: int, *, sync: Callable[[], None] | None = None,
                 max_s: float | None = None) -> dict[str, list[float]]:
    """Seconds of every call, the functions run in turn for up to ``repeats`` rounds.

    No warm-up: call each function once first (see :func:`clocked`). Rounds stop early once
    the timed calls have taken ``max_s`` seconds in all (at least one round), as
    ``cupyx.profiler.benchmark``'s ``max_duration`` does, so that a slow path cannot eat a
    GPU session; every function gets the same number of rounds, which keeps the
    interleaving (and the ratios) fair.
    """
    times: dict[str, list[float]] = {name: [] for name in functions}
    spent = 0.0
    for _ in range(repeats):
        for name, fn in functions.items():
            seconds, _ = clocked(fn, sync)
            times[name].append(seconds)
            spent += seconds
        if max_s is not None and spent >= max_s:
            break
    return times
