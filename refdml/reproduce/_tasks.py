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

The ``toy`` study is the runner's own test double (no training): deterministic numbers
from the seed, and on request a failure or a worker that kills itself once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from refdml._io import write_text_atomic

__all__ = ["Task", "STUDIES", "execute", "task_key", "code_version", "study"]

#: study name -> function(task) -> dict (metrics, curves, artefacts).
STUDIES: dict[str, Callable[["Task"], dict]] = {}


def study(name: str):
    """Register ``function(task) -> dict`` as the study ``name``."""
    def register(function):
        if name in STUDIES:
            raise ValueError(f"study {name!r} is already registered")
        STUDIES[name] = function
        return function
    return register


@dataclass(frozen=True)
class Task:
    """One run: ``study`` (a registered function), ``method``, ``seed``, ``settings``.

    ``settings`` is a tuple of ``(key, value)`` pairs sorted by key (values JSON scalars
    or lists); :meth:`make` builds it from a dict.
    """

    study: str
    method: str
    seed: int
    settings: tuple = ()

    @classmethod
    def make(cls, study: str, method: str, seed: int, settings: dict | None = None) -> "Task":
        items = tuple(sorted((k, _freeze(v)) for k, v in (settings or {}).items()))
        return cls(study, method, int(seed), items)

    @property
    def config(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.settings}

    def to_json(self) -> dict[str, Any]:
        return {"study": self.study, "method": self.method, "seed": self.seed,
                "settings": self.config}

    def label(self) -> str:
        return f"{self.study}/{self.method}/seed {self.seed}"


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def _thaw(value):
    return [_thaw(v) for v in value] if isinstance(value, tuple) else value


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
    from refdml.reproduce import _studies  # noqa: F401  (registers the studies)

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


@study("toy")
def _toy(task: Task) -> dict:
    """Deterministic numbers from the seed (no training): the runner's test double.

    settings: ``shift`` (added to the metric), ``fail_seed`` (this seed raises
    RuntimeError), ``kill_marker`` (a path: if it does not exist, create it and kill this
    process, once), ``sleep`` (seconds), ``probe_environ`` (a list of environment variable
    names: metric ``environ:NAME`` is 1.0 where NAME is set in this process, else 0.0).
    """
    c = task.config
    if c.get("sleep"):
        time.sleep(float(c["sleep"]))
    marker = c.get("kill_marker")
    if marker and task.seed == c.get("kill_seed", task.seed) and not os.path.exists(marker):
        write_text_atomic(marker, str(os.getpid()))
        os._exit(1)  # the worker process dies: the scheduler must run the task elsewhere
    if c.get("fail_seed") == task.seed:
        raise RuntimeError(f"toy task failed on purpose (seed {task.seed})")
    rng = np.random.default_rng([task.seed, sum(map(ord, task.method))])
    value = float(rng.normal()) + float(c.get("shift", 0.0))
    metrics = {"value": value}
    for name in c.get("probe_environ", ()):
        metrics[f"environ:{name}"] = float(name in os.environ)
    return {"metrics": metrics, "curves": {"value": list(np.cumsum(rng.normal(size=3)))}}
