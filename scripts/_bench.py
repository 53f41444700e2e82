"""Timing helper shared by the benchmark scripts (not a test)."""

from __future__ import annotations

import statistics
import time


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
