"""The disk cache of finished tasks: one JSON file per task, named by :func:`task_key`.

``<dir>/<key>.json`` holds ``{"task": spec, "code": version, "result": {...}}``, written
atomically (:func:`refdml._io.write_json_atomic`: a temporary file, fsync, renamed), so an
interrupted run leaves only whole entries and a re-run loads them instead of computing; a
temporary file a kill leaves behind (``.<key>.json.<pid>.<random>.tmp``) is never read.
Failures are not cached (a re-run retries them).
"""

from __future__ import annotations

import json
from pathlib import Path

from refdml._io import write_json_atomic
from refdml.reproduce._tasks import Task, code_version, task_key

__all__ = ["TaskCache"]


class TaskCache:
    """Finished task results under ``directory`` (created on first write); ``None``: no cache."""

    def __init__(self, directory) -> None:
        self.directory = None if directory is None else Path(directory)

    def path(self, task: Task) -> Path | None:
        return None if self.directory is None else self.directory / f"{task_key(task)}.json"

    def load(self, task: Task) -> dict | None:
        path = self.path(task)
        if path is None or not path.is_file():
            return None
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None   # a damaged entry is recomputed
        if entry.get("task") != json.loads(json.dumps(task.to_json())):
            return None
        return entry.get("result")

    def store(self, task: Task, result: dict) -> None:
        path = self.path(task)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"task": task.to_json(), "code": code_version(), "result": result}
        write_json_atomic(path, entry)
