"""Timing helpers shared by the benchmark scripts (not a test), and their ``--json`` writer.

:func:`interleaved` for host code; :func:`clocked` and :func:`timed_rounds` take a ``sync``
(a device synchronisation) for work that a call only queues, as on a GPU.

:class:`Table` holds one printed table; :func:`write_json` writes a run's tables, with the
command, date, machine and commit, as one JSON document of schema :data:`SCHEMA`
(``refdml-bench/1``; layout in :func:`document`), atomically.
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
import platform
import shlex
import statistics
import subprocess
import sys
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


# ---------------------------------------------------------------------- --json documents
#: Layout of the documents :func:`write_json` writes (the docs' benchmarks page reads them).
SCHEMA = "refdml-bench/1"

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Table:
    """One table of a benchmark's output, as printed and as written to its ``--json``.

    ``title`` says what is measured, at which sizes, and what the ratios are against;
    ``columns`` name the cells of every row. A cell is a string or a number exactly as the
    printed table shows it: integers as numbers, measured floats as the text the script
    prints (``f"{seconds:.2f}"``), so that a table rendered from the JSON reads as the
    printed one. :meth:`add` returns the row, for the script to print it from the same
    cells.
    """

    def __init__(self, title: str, columns, *, notes=()) -> None:
        self.title = str(title)
        self.columns = [str(column) for column in columns]
        self.rows: list[list] = []
        self.notes = [str(note) for note in notes]

    def add(self, *cells) -> list:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title!r}: {len(cells)} cells for {len(self.columns)} "
                             f"columns {self.columns}")
        row = [_cell(cell) for cell in cells]
        self.rows.append(row)
        return row

    def note(self, text: str) -> str:
        self.notes.append(str(text))
        return text

    def as_dict(self) -> dict:
        return {"title": self.title, "columns": list(self.columns),
                "rows": [list(row) for row in self.rows], "notes": list(self.notes)}


def _cell(value):
    """A cell as JSON writes it: str, int or finite float (NumPy scalars converted)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        raise TypeError(f"a table cell is a string or a number, got {value!r}")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            return str(value)              # JSON has no inf / nan: as printed
        return value
    raise TypeError(f"a table cell is a string or a number, got {type(value).__name__}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _blas() -> str:
    """``internal_api version architecture`` of the BLAS NumPy uses (threadpoolctl)."""
    try:
        import numpy  # noqa: F401  (loads NumPy's BLAS, so that threadpoolctl sees it)
        from threadpoolctl import threadpool_info

        libraries = [info for info in threadpool_info() if info.get("user_api") == "blas"]
    except Exception:                       # threadpoolctl missing or failing: say so
        return "unknown"
    if not libraries:
        return "unknown"
    # NumPy's own BLAS before another one (SciPy's, say) loaded in the same process.
    libraries.sort(key=lambda info: "numpy" not in str(info.get("filepath", "")))
    info = libraries[0]
    return " ".join(str(info[key]) for key in ("internal_api", "version", "architecture")
                    if info.get(key)) or "unknown"


def machine(device: str = "cpu") -> dict:
    """The ``machine`` of a document: CPU model, cores, Python, NumPy, BLAS, device."""
    import numpy

    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
            "numpy": numpy.__version__, "blas": _blas(), "device": str(device)}


def git_commit() -> str | None:
    """Short SHA of the repository's HEAD, or None (no git, not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", _REPOSITORY, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = done.stdout.strip()
    return sha if done.returncode == 0 and sha else None


def _script_path(script: str) -> str:
    """``script`` relative to the repository (``scripts/bench_gsp.py``), else as given."""
    path = os.path.abspath(script)
    if path.startswith(_REPOSITORY + os.sep):
        return os.path.relpath(path, _REPOSITORY).replace(os.sep, "/")
    return str(script)


def document(*, script: str, argv, tables, notes=(), device: str = "cpu") -> dict:
    """The ``--json`` document of one run (schema :data:`SCHEMA`)::

        {"schema": "refdml-bench/1", "script": "scripts/bench_gsp.py",
         "command": "python scripts/bench_gsp.py --quick", "date": "2026-11-28",
         "machine": {"cpu", "cores", "python", "numpy", "blas", "device"},
         "git_commit": "9a3caef" or None,
         "tables": [{"title", "columns", "rows", "notes"}, ...], "notes": [...]}

    ``script``: the script's file (``__file__``); ``argv``: the arguments it parsed (None:
    ``sys.argv[1:]``); ``tables``: :class:`Table` objects or their dicts; ``date``: today
    in UTC.
    """
    if argv is None:
        argv = sys.argv[1:]
    script = _script_path(script)
    tables = [table.as_dict() if isinstance(table, Table) else table for table in tables]
    for table in tables:
        _check_table(table)
    return {
        "schema": SCHEMA,
        "script": script,
        "command": shlex.join(["python", script, *map(str, argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "machine": machine(device),
        "git_commit": git_commit(),
        "tables": tables,
        "notes": [str(note) for note in notes],
    }


def _check_table(table: dict) -> None:
    if set(table) != {"title", "columns", "rows", "notes"}:
        raise ValueError(f"a table has the keys title, columns, rows, notes; got {sorted(table)}")
    width = len(table["columns"])
    for row in table["rows"]:
        if len(row) != width:
            raise ValueError(f"{table['title']!r}: a row of {len(row)} cells, {width} columns")
        for cell in row:
            _cell(cell)


def write_json(path, *, script: str, argv, tables, notes=(), device: str = "cpu",
               extra: dict | None = None) -> dict:
    """Write :func:`document` to ``path`` atomically and return it.

    The text goes to a temporary file in ``path``'s folder, which then replaces ``path``
    (``os.replace``; :func:`refdml._io.write_json_atomic`): a run killed part-way leaves
    the previous file, or none, never a part of one. ``extra``: top-level keys added
    beside the schema's (bench_gpu.py's and bench_train.py's own layouts, which other
    readers use); they may not replace one of the schema's keys.
    """
    from refdml._io import write_json_atomic

    doc = document(script=script, argv=argv, tables=tables, notes=notes, device=device)
    for key, value in (extra or {}).items():
        if key in doc:
            raise ValueError(f"extra key {key!r} would replace the schema's")
        doc[key] = value
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    write_json_atomic(path, doc, indent=1)
    return doc
