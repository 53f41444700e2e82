"""What the subcommand modules of ``refdml`` share: argument types, ``--only``, output paths.

Each subcommand lives in its own module (``refdml.catalog._gradcheck_cli``,
``refdml.catalog._gpu_check_cli``, ``refdml.validation._cli``, ``refdml.train._cli``,
``refdml.reproduce._cli``) with ``add_arguments(parser)`` and ``run(args) -> int``;
:mod:`refdml.cli` wires them. The pieces that subcommands of different layers need (the
catalogue's and ``verify``) sit here, at the bottom of the layers, where each can import
them. Nothing here imports any other part of refdml.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["at_least", "check_output_paths", "seed", "select", "text_table"]


def at_least(name: str, low: int = 1, high: int | None = None):
    """An argparse ``type`` for the flag ``name``: an integer ``>= low`` (and ``<= high``
    when given), refused with the flag and the value (``--seeds == 0, must be an integer
    >= 1``)."""
    wanted = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} == {text!r}, must be {wanted}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{name} == {value}, must be {wanted}")
        return value
    return parse


def seed(text: str) -> int:
    """``--seed``: a non-negative integer (NumPy refuses negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed == {text!r}, must be a non-negative integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seed == {value}, must be a non-negative integer")
    return value


def text_table(rows: list[tuple[str, ...]], header: tuple[str, ...], right: set[int]) -> list[str]:
    """Rows as text columns two spaces apart, each as wide as its longest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [line(header), "-" * len(line(header)), *map(line, rows)]


def select(names: Iterable[str], patterns: Iterable[str]) -> tuple[list[str], list[str]]:
    """The names matched by ``patterns``, in the order of ``names``, and the patterns matching none.

    A pattern that is a name selects that name only; otherwise it is a prefix
    (``gsp`` or ``gsp.fig9`` for claims, ``losses`` for operators).
    """
    names = list(names)
    chosen: set[str] = set()
    unmatched = []
    for pattern in patterns:
        hits = [pattern] if pattern in names else [n for n in names if n.startswith(pattern)]
        if not hits:
            unmatched.append(pattern)
        chosen.update(hits)
    return [n for n in names if n in chosen], unmatched


def check_output_paths(report: str | None, json_path: str | None) -> str | None:
    """Make the report folder and check both outputs can be written; the problem, or None.

    Run before any check, so a bad path is reported before any work is done.
    """
    if report is not None:
        directory = Path(report)
        if directory.exists() and not directory.is_dir():
            return f"--report {report}: is a file, not a folder"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--report {report}: cannot create the folder ({exc.strerror or exc})"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"--report {report}: the folder is not writable"
    if json_path is not None:
        path = Path(json_path)
        if path.is_dir():
            return f"--json {json_path}: is a folder, not a file"
        parent = path.parent
        existing = next((p for p in (parent, *parent.parents) if p.exists()), Path("."))
        if not existing.is_dir():
            return f"--json {json_path}: {existing} is a file, not a folder"
        if not os.access(existing, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"--json {json_path}: not writable"
    return None
