"""A task's spec: ``(study, method, seed, settings)``, frozen, hashable and JSON-able.

Its own module so that :mod:`._studies` (the functions that run a task) and :mod:`._tasks`
(:func:`~refdml.reproduce._tasks.execute`, the cache key) both read it, and neither imports
the other back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Task"]


@dataclass(frozen=True)
class Task:
    """One run: ``study`` (a key of :data:`refdml.reproduce._studies.STUDIES`), ``method``,
    ``seed``, ``settings``.

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
