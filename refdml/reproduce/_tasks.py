"""A task: one training run of the grid, ``(study, method, seed, settings) -> small dict``.

A :class:`Task` is a frozen, hashable, JSON-able spec; :func:`execute` runs it in whatever
process it lands in (a Dask worker or this one) and returns a plain dict::

    {"metrics": {name: float}, "curves": {name: [float, ...]}, "artefacts": {...},
     "seconds": float, "cpu_seconds": float}

(``seconds`` wall time in the worker, ``cpu_seconds`` the worker process's CPU time: on a
shared machine the second says what the task costs.)

The result depends only on the spec (every random draw is seeded from ``task.seed``), so a
task gives the same numbers on any worker; artefacts (attention maps, 2-D embeddings) are
small arrays stored inline as lists, not files, so they come back from a remote worker too.

:func:`task_key` hashes the spec with :func:`code_version` (the source of the modules that
compute results), so the disk cache is invalidated when the code changes.

The studies (the functions a task's ``study`` names, the runner's ``toy`` test double
among them) are the table :data:`refdml.reproduce._studies.STUDIES`; the spec is
:mod:`._spec`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path

from refdml.reproduce._spec import Task

__all__ = ["Task", "execute", "task_key", "code_version"]

#: Modules whose source does not change any number (drawing, printing, scheduling, the
#: other commands), relative to the refdml package: edits there keep the cache valid.
_NOT_NUMERIC = {"cli.py", "_io.py", "reproduce/__init__.py", "reproduce/_cli.py",
                "reproduce/_report.py", "reproduce/_runner.py", "reproduce/_cache.py"}
_NOT_NUMERIC_DIRS = ("gradcheck",)


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """SHA-256 (16 hex digits) of refdml's version and the source of every module a task
    may run: the ``refdml`` package and ``refdml.gpu`` (less the command line, the gradient
    checker and the reporting / scheduling modules of this package, which change no number)."""
    import refdml
    import refdml.gpu

    digest = hashlib.sha256(refdml.__version__.encode())
    roots = sorted({Path(refdml.__file__).parent, Path(refdml.gpu.__file__).parent})
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if root == Path(refdml.__file__).parent and (
                    relative in _NOT_NUMERIC or relative.startswith(_NOT_NUMERIC_DIRS)):
                continue
            digest.update(relative.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def task_key(task: Task, version: str | None = None) -> str:
    """Hex digest of the task spec and the code version: the cache file's name."""
    payload = json.dumps({"task": task.to_json(), "code": version or code_version()},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def execute(task: Task) -> dict:
    """Run ``task`` here and return its result dict (see the module docstring)."""
    # Imported here, not at the top: the training modules take seconds to import, which
    # the command line (``refdml reproduce --help``, a report from the cache) never needs.
    from refdml.reproduce._studies import STUDIES

    if task.study not in STUDIES:
        raise ValueError(f"study == {task.study!r}, must be one of {sorted(STUDIES)}")
    start, cpu = time.perf_counter(), time.process_time()
    result = STUDIES[task.study](task)
    result = {"metrics": {k: float(v) for k, v in result.get("metrics", {}).items()},
              "curves": {k: [float(x) for x in v] for k, v in result.get("curves", {}).items()},
              "artefacts": result.get("artefacts", {})}
    result["seconds"] = time.perf_counter() - start
    result["cpu_seconds"] = time.process_time() - cpu
    return result
