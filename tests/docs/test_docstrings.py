"""Docstrings are the API reference's source: they keep the maths, shapes and paper
references, and carry no measured timings, load averages, issue numbers or notes about the
file itself (those belong to the benchmarks page, the changelog, or nowhere)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = re.compile(
    r"\b[Ii]ssues? \d"                                 # issue numbers
    r"|\bLength:"                                      # notes about the file's length
    r"|\bload average"                                 # the machine's load at a measurement
    r"|\d(?:\.\d+)? ?(?:ms|µs|us|ns)\b"                # timings
    r"|\d(?:\.\d+)? s\b(?! *[=<>(])"                   # seconds (not an `s` variable)
    r"|\d(?:\.\d+)?x (?:faster|slower)\b"              # speed-ups
    r"|\bmeasured on\b")


def _docstrings():
    for folder in ("refdml",):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node, clean=False)
                    if text:
                        yield f"{path.relative_to(ROOT)}:{getattr(node, 'name', '<module>')}", text


def test_docstrings_carry_no_timings_or_issue_numbers():
    found = [f"{where}: {line.strip()}" for where, text in _docstrings()
             for line in text.splitlines() if FORBIDDEN.search(line)]
    assert not found, "\n".join(found)


def test_the_pattern_catches_what_it_forbids():
    for bad in ("as issue 11 found", "Length: ~880 lines", "took 46 ms", "in 3.2 s on",
                "4.2x faster than", "(load average 11-15)", "measured on 2026-11-25"):
        assert FORBIDDEN.search(bad), bad
    for fine in ("costs O(m n) per pass", "rtol 1e-10", "eps 0.1", "scale s = 2",
                 "with 2 s (x, y) pairs", "float32 floor 7.5e-6"):
        assert not FORBIDDEN.search(fine), fine
