"""What the subcommand modules of ``refdml`` share: argument types, ``--only``, output paths.

Each subcommand lives in its own module (``refdml.checks._gradcheck_cli``,
``refdml.checks._gpu_check_cli``, ``refdml.validation._cli``, ``refdml.train._cli``,
``refdml.reproduce._cli``, ``refdml.conformance._cli``) with ``add_arguments(parser)`` and
``run(args) -> int``; :mod:`refdml.cli` wires them. The pieces that subcommands of different
layers need (``train`` of the training layer, the others of the apps) sit here, at the
bottom of the layers, where each can import them. Nothing here imports any other part of refdml but :mod:`refdml._io` (the same layer).

Every path a command takes (``--json``, ``--report``, ``--out``, ``--cache``, ``--config``,
``--features``) first passes :func:`path_problem`, the one check of a path as such: a
component longer than the file system allows, or a ``stat`` that fails for another reason
than a missing name (a loop of links, no permission), is refused in one line naming the
flag and the value (shortened by :func:`shown` when long), where pathlib's own
``exists()`` would raise on Python 3.11. Output paths (``--json PATH``, ``--report DIR``)
are checked by :func:`check_output_paths` before any work, so a path that cannot be
written costs no run: the command prints ``refdml CMD: error: <the problem>`` and exits 2.
The writes then go through :func:`write_outputs`, which turns an ``OSError`` at write time
(a full disk, a folder removed meanwhile) into one line and ``False`` (exit status 1), and
writes a report folder as a whole (:func:`refdml._io.replaced_folder`).
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from refdml._io import (
    is_protected_folder,
    is_replaceable_folder,
    replaced_folder,
    special_file_kind,
)

__all__ = ["OneLineParser", "at_least", "check_output_paths", "input_file_problem",
           "output_file_problem", "output_folder_problem", "path_problem",
           "report_folder_problem", "seed", "select", "shown", "text_table",
           "writable_folder_problem", "write_outputs"]

#: A value longer than this is shortened in messages (a 4,000-character path in one line
#: of an error hides the error).
_SHOWN_CHARS = 80
#: The longest file name when the file system does not say (``NAME_MAX`` of Linux,
#: macOS, Windows).
_NAME_MAX = 255


class OneLineParser(argparse.ArgumentParser):
    """An :class:`argparse.ArgumentParser` whose errors are one line on stderr, exit status 2.

    argparse prints its usage block above every error, which buries the one thing the user
    needs (which flag, which value) under a dozen lines. Here the error reads
    ``refdml verify: error: unrecognized arguments: --quik (did you mean --quick?); see
    refdml verify --help``. Subparsers made by :meth:`add_subparsers` are of the same class.
    """

    def error(self, message: str) -> None:  # argparse's hook; it must not return
        self.exit(2, f"{self.prog}: error: {self._suggest(message)}; see {self.prog} --help\n")

    def _suggest(self, message: str) -> str:
        """``message`` with "did you mean" for each unrecognised flag close to a real one."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        flags = [flag for action in self._actions for flag in action.option_strings]
        guesses = {}
        for word in message[len(prefix):].split():
            if word.startswith("-"):
                close = difflib.get_close_matches(word.split("=", 1)[0], flags, n=1, cutoff=0.6)
                if close:
                    guesses[word] = close[0]
        if not guesses:
            return message
        return message + " (did you mean " + ", ".join(
            f"{guess} for {word}" if len(guesses) > 1 else guess
            for word, guess in guesses.items()) + "?)"


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


def shown(value: object) -> str:
    """``value`` as text for a message: whole up to 80 characters, else its start and end
    around ``...`` and its length."""
    text = str(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:48]}...{text[-20:]} ({len(text)} characters)"


def _name_max(folder: Path) -> int:
    try:
        return int(os.pathconf(folder, "PC_NAME_MAX"))
    except (AttributeError, ValueError, OSError):  # Windows has no pathconf
        return _NAME_MAX


def path_problem(flag: str, value: object) -> str | None:
    """Why ``value`` of ``flag`` cannot name a path here, or None.

    Refused: an empty value; a NUL character; an existing part of the path whose ``stat``
    fails other than by not existing (too long, a loop of symbolic links, a folder that
    may not be searched); a part that does not exist yet and is longer than the file
    system's longest name (``NAME_MAX``, usually 255 bytes; the kernel reports only the
    missing parent for it, and the write would fail after the work). After this check,
    pathlib's ``exists``/``is_dir``/``is_file`` on the path do not raise. Creates nothing.
    """
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        return f"{flag} {shown(value)!r}: must be a path"
    if not text:
        return f"{flag} '': is empty, must name a path"
    if "\0" in text:
        return f"{flag} {shown(text)!r}: holds a NUL character, which no path may hold"
    path = Path(text).absolute()
    existing = Path(path.anchor)
    missing: tuple[str, ...] = ()
    for i, part in enumerate(path.parts[1:], start=1):
        candidate = existing / part
        try:
            os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            missing = path.parts[i:]   # the rest is created by the command, or refused later
            break
        except OSError as exc:
            return f"{flag} {shown(text)}: cannot be used ({exc.strerror or exc})"
        existing = candidate
    limit = _name_max(existing)
    for part in missing:
        size = len(os.fsencode(part))
        if size > limit:
            return (f"{flag} {shown(text)}: a name in it is {size} bytes long, longer than "
                    f"the {limit} the file system allows (File name too long)")
    return None


def input_file_problem(flag: str, value: object) -> str | None:
    """Why the file ``value`` of ``flag`` (``--config``, ``--features``) cannot be read,
    or None: :func:`path_problem`, then it must exist and be a regular file."""
    problem = path_problem(flag, value)
    if problem is not None:
        return problem
    path = Path(value)
    if path.is_dir():
        return f"{flag} {shown(value)!r}: is a folder, not a file"
    if not path.exists():
        return f"{flag} {shown(value)!r}: no such file"
    kind = special_file_kind(path)
    if kind is not None:
        return f"{flag} {shown(value)!r}: is {kind}, not a regular file"
    return None


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (the folder a mkdir -p would start in)."""
    return next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())


def _cannot_write_in(folder: Path) -> str | None:
    """Why no file can be created in ``folder``, or None: probed by creating and removing
    a file, which also catches what ``os.access`` does not (``/proc``, a read-only mount
    seen by root)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".refdml-probe-", dir=folder)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    os.unlink(name)
    return None


def _folder_problem(flag: str, value: str, folder: Path, what: str) -> str | None:
    """Can ``folder`` be created (if missing) and written? (``what`` names it in the message.)"""
    start = _nearest_existing(folder)
    if not start.is_dir():
        return (f"{flag} {shown(value)}: cannot create {what}: {shown(start)} is a file, "
                "not a folder")
    reason = _cannot_write_in(start)
    if reason is not None:
        return f"{flag} {shown(value)}: cannot write in {shown(start)} ({reason})"
    return None


def output_file_problem(flag: str, value: str) -> str | None:
    """Why the file ``value`` of ``flag`` (``--json``) cannot be written, or None.

    Checks the path as such (:func:`path_problem`), that it is not a folder nor any other
    file that is not a regular one (a device such as ``/dev/null``, a FIFO, a socket: the
    atomic write would replace it by a plain file), that its folder exists or can be
    created (no file on the way), and that a file can be created there. Creates nothing.
    """
    problem = path_problem(flag, value)
    if problem is not None:
        return problem
    path = Path(value).absolute()
    if path.is_dir():
        return f"{flag} {shown(value)}: is a folder, not a file"
    kind = special_file_kind(path)
    if kind is not None:
        return (f"{flag} {shown(value)}: is {kind}, not a regular file; refdml replaces only "
                "a regular file or a new name")
    return _folder_problem(flag, value, path.parent, "its folder")


def output_folder_problem(flag: str, value: str) -> str | None:
    """Why files cannot be written in the folder ``value`` of ``flag`` (``refdml train
    --out``, a run folder that a resume reads back and that is therefore never replaced),
    or None.

    Checks that the path is not a file, and that the folder, or the nearest of its
    ancestors that exists, is a folder in which a file can be created. Creates nothing.
    """
    problem = path_problem(flag, value)
    if problem is not None:
        return problem
    path = Path(value).absolute()
    if path.exists() and not path.is_dir():
        return f"{flag} {shown(value)}: is a file, not a folder"
    return _folder_problem(flag, value, path, "the folder")


def report_folder_problem(flag: str, value: str, *, recognise: Callable | None = None) -> str | None:
    """Why the folder ``value`` of ``flag`` (``--report``) cannot be written as a whole, or None.

    The folder is replaced as a whole (:func:`refdml._io.replaced_folder`), so besides
    being creatable and writable (its parent is probed) it must be missing, empty, or a
    folder refdml wrote (its marker file, or ``recognise(path)`` for a report written
    before the marker existed); the working folder, its parents and the home folder are
    never replaced. Creates nothing.
    """
    problem = path_problem(flag, value)
    if problem is not None:
        return problem
    path = Path(value).resolve()
    if path.exists() and not path.is_dir():
        return f"{flag} {shown(value)}: is a file, not a folder"
    if is_protected_folder(path):
        return (f"{flag} {shown(value)}: is the working folder, one of its parents or the "
                "home folder, which refdml never replaces; choose a new or empty folder")
    if not is_replaceable_folder(path, recognise=recognise):
        return (f"{flag} {shown(value)} exists and is not a refdml report folder; "
                "choose a new or empty folder")
    return _folder_problem(flag, value, path.parent, "the folder")


def check_output_paths(report: str | None, json_path: str | None, *,
                       recognise: Callable | None = None) -> str | None:
    """The problem with ``--report DIR`` / ``--json PATH`` (either may be None), or None.

    Run before any work, so a bad path is reported before any work is done; see
    :func:`report_folder_problem` and :func:`output_file_problem`. Creates nothing.
    """
    if report is not None:
        problem = report_folder_problem("--report", report, recognise=recognise)
        if problem is not None:
            return problem
    if json_path is not None:
        problem = output_file_problem("--json", json_path)
        if problem is not None:
            return problem
        if report is not None and Path(json_path).resolve() == Path(report).resolve():
            return f"--json {shown(json_path)} and --report {shown(report)} name the same path"
    return None


def writable_folder_problem(flag: str, value: object) -> str | None:
    """Why files cannot be kept in the folder ``value`` of ``flag`` (``reproduce
    --cache``), or None. Unlike the other checks this one creates the folder (the command
    would, at its first write) and writes and removes a probe file in it, so a folder that
    a ``mkdir`` cannot make or a file system that refuses a file (``/proc``, a read-only
    mount) is found before any work."""
    problem = output_folder_problem(flag, value)
    if problem is not None:
        return problem
    try:
        Path(value).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{flag} {shown(value)}: cannot be created ({exc.strerror or exc})"
    reason = _cannot_write_in(Path(value))
    if reason is not None:
        return f"{flag} {shown(value)}: cannot write in it ({reason})"
    return None


def _within(path: Path, folder: Path) -> Path | None:
    """``path`` relative to ``folder`` when it lies inside it, else None."""
    try:
        return path.resolve().relative_to(folder.resolve())
    except ValueError:
        return None


def write_outputs(command: str, *, json_path: str | None = None,
                  write_json: Callable[[Path], object] | None = None,
                  report: str | None = None,
                  write_report: Callable[[Path], Path] | None = None,
                  recognise: Callable | None = None) -> bool:
    """Write ``--json`` (``write_json(path)``) and then ``--report`` (``write_report(folder)``,
    returning the main file written), each when given; print where they went.

    The report folder is written as a whole (:func:`refdml._io.replaced_folder`): no file
    of a previous report survives, and a killed run leaves the previous one. A ``--json``
    path inside the report folder is written into it, so the swap keeps it. An
    ``OSError`` (a full disk, a folder removed meanwhile) prints one line,
    ``refdml CMD: error: FLAG VALUE: cannot be written (...)``, and returns False (exit
    status 1: refdml failed to write); True when everything was written.
    """
    flag, value = "--json", json_path
    done: list[str] = []
    try:
        json_inside = (None if report is None or json_path is None
                       else _within(Path(json_path), Path(report)))
        if json_path is not None and json_inside is None:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            write_json(Path(json_path))
            done.append(f"JSON written to {json_path}")
        if report is not None:
            flag, value = "--report", report
            with replaced_folder(report, recognise=recognise) as staging:
                if json_inside is not None:
                    flag, value = "--json", json_path
                    target = staging / json_inside
                    target.parent.mkdir(parents=True, exist_ok=True)
                    write_json(target)
                    flag, value = "--report", report
                main_file = Path(write_report(staging)).relative_to(staging)
            if json_inside is not None:
                done.append(f"JSON written to {json_path}")
            done.append(f"report written to {Path(report) / main_file}")
    except (OSError, ValueError) as exc:   # ValueError: a special file appeared meanwhile
        if done:
            print("\n".join(done), flush=True)
        reason = (exc.strerror if isinstance(exc, OSError) else None) or exc
        print(f"refdml {command}: error: {flag} {shown(value)}: cannot be written "
              f"({reason})", file=sys.stderr)
        return False
    if done:
        print("\n".join(done))
    return True
