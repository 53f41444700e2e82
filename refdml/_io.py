"""Files that survive a kill: every file refdml writes appears whole or not at all.

A whole-file write goes to a temporary file in the target's folder, is flushed to disk
(``os.fsync``), and is moved over the target with :func:`os.replace`, which is atomic on
POSIX and Windows when both paths are on one file system (hence the same folder). A reader,
or a run killed at any instant (``kill -9``, a crash, an exception), finds the previous
file or the new one, never a part of one. The folder is fsynced after the rename, so the
new name also survives a power cut.

Only a regular file, or a name that does not exist yet, is replaced: a target that exists
and is anything else (a character device such as ``/dev/null``, a FIFO, a socket, a
folder), directly or through a symbolic link, is refused with a ValueError before any
temporary file is created, and checked again just before the rename. Replacing such a
file would turn a device or a pipe into a plain file (run as root, ``/dev/null``).

The temporary file is named ``.<name>.<pid>.<random>.tmp`` and created exclusively
(``O_EXCL``): two processes, or two threads, writing one target never share it, and the
last ``os.replace`` wins with a whole file. It is removed when the write raises; a
SIGKILL can leave one behind. Nothing in refdml reads such a file (every reader opens the
target by its name), so a leftover is garbage, never input, and may be deleted.

An append of a line is not atomic: :func:`append_line` writes the line and its newline
with one ``os.write`` on an ``O_APPEND`` descriptor, and :func:`read_lines` returns the
complete lines only, dropping a last line that has no newline (an append cut by a kill).

Functions
---------
``atomic_path(path)``
    A context manager yielding the temporary path to write (``numpy.savez`` on an open
    handle, anything that takes a file name); the rename happens on a normal exit.
``write_bytes_atomic``, ``write_text_atomic``, ``write_json_atomic``
    Whole-file writes of bytes, text, a JSON document.
``save_figure(fig, path, **savefig_kwargs)``
    A matplotlib figure, the format taken from ``path``'s suffix.
``append_line(path, line)`` / ``read_lines(path)``
    The JSON-lines log of a training run.
``replaced_folder(path)`` / ``is_replaceable_folder(path)``
    A folder written as a whole (a report): written in a staging folder beside it, then
    swapped in, so no file of the previous one survives and a kill leaves the previous one.

Nothing here imports matplotlib or any other part of refdml.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import re
import shutil
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "FOLDER_MARKER",
    "append_line",
    "atomic_path",
    "is_protected_folder",
    "is_replaceable_folder",
    "read_lines",
    "replaced_folder",
    "save_figure",
    "special_file_kind",
    "to_jsonable",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]

def to_jsonable(value: Any) -> Any:
    """NumPy scalars and arrays, tuples, mappings and enums as plain JSON types; inf and
    NaN as strings (JSON has neither); anything else as its ``repr``."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, str):
        return value
    return repr(value)


_TEMP_SUFFIX = ".tmp"
_O_BINARY = getattr(os, "O_BINARY", 0)   # Windows: no newline translation by os.write


def _file_kind(mode: int) -> str:
    """What a ``st_mode`` that is not a regular file's describes, in words."""
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"  # pragma: no cover (door, whiteout, ...)


def special_file_kind(path: Any) -> str | None:
    """What ``path`` is when it exists and is not a regular file (``"a character
    device"``, ``"a FIFO (named pipe)"``, ``"a folder"``, ...), following symbolic links;
    None for a regular file or a name that does not exist. Reads no data (``os.stat``):
    opening a FIFO would block. Other errors of ``os.stat`` (a name too long, a loop of
    links, no permission) propagate as ``OSError``."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    return None if stat.S_ISREG(mode) else _file_kind(mode)


def _refuse_special(path: Path) -> None:
    kind = special_file_kind(path)
    if kind is not None:
        raise ValueError(f"path == {str(path)!r} is {kind}, not a regular file: refdml "
                         "replaces only a regular file or a new name")


def _create_temp(path: Path) -> Path:
    """A new, empty file beside ``path`` that no other writer can have opened."""
    for _ in range(100):
        temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}{_TEMP_SUFFIX}")
        try:
            # 0o666 less the umask: the target gets the permissions a plain open() gives
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        os.close(fd)
        return temp
    raise FileExistsError(f"no free temporary name beside {path}")  # pragma: no cover


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; the rename still happened
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: Any, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on a normal exit move it over ``path``.

    Write the whole content to the yielded path (it exists, empty) inside the ``with``
    block. Raises ValueError, before anything is created, when ``path`` exists and is not
    a regular file (a device, a FIFO, a socket, a folder; module docstring). An exception
    inside the block removes the temporary file and leaves ``path`` as it was.
    ``durable``: fsync the file before the rename and the folder after it.
    """
    path = Path(path)
    _refuse_special(path)   # before the temporary file: nothing is created beside a device
    temp = _create_temp(path)
    try:
        yield temp
        if durable:
            _fsync_file(temp)
        _refuse_special(path)   # it may have appeared while the content was written
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    if durable:
        _fsync_dir(path.parent)


def write_bytes_atomic(path: Any, data: bytes, *, durable: bool = True) -> Path:
    """Replace ``path`` by ``data`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    with atomic_path(path, durable=durable) as temp:
        with open(temp, "wb") as handle:
            handle.write(data)
    return path


def write_text_atomic(path: Any, text: str, *, encoding: str = "utf-8",
                      durable: bool = True) -> Path:
    """Replace ``path`` by ``text`` (encoded with ``encoding``) atomically."""
    return write_bytes_atomic(path, text.encode(encoding), durable=durable)


def write_json_atomic(path: Any, document: Any, *, indent: int | None = None,
                      sort_keys: bool = False, durable: bool = True) -> Path:
    """Replace ``path`` by ``json.dumps(document, indent=..., sort_keys=...)`` and a newline.

    The document is serialised before the file is touched, so a document that cannot be
    serialised (a TypeError from ``json``) leaves ``path`` as it was.
    """
    text = json.dumps(document, indent=indent, sort_keys=sort_keys) + "\n"
    return write_text_atomic(path, text, durable=durable)


def save_figure(fig: Any, path: Any, *, durable: bool = True, **savefig_kwargs: Any) -> Path:
    """``fig.savefig`` to ``path`` atomically; the format is ``path``'s suffix.

    The temporary file's name ends in ``.tmp``, from which matplotlib cannot tell a format,
    so the format is passed explicitly: ``savefig_kwargs["format"]`` if given, else the
    suffix of ``path``, else the figure's default file type (``savefig.format``). The file
    is written at ``path`` exactly (matplotlib adds no suffix here).
    """
    path = Path(path)
    fmt = savefig_kwargs.pop("format", None) or path.suffix[1:].lower() or None
    if fmt is None:
        fmt = fig.canvas.get_default_filetype()
    with atomic_path(path, durable=durable) as temp:
        fig.savefig(temp, format=fmt, **savefig_kwargs)
    return path


def append_line(path: Any, line: str, *, durable: bool = True) -> None:
    """Append ``line`` and a newline to ``path`` (created if missing) in one ``os.write``.

    ``line`` must not contain a newline. A kill can still cut the write (the kernel may
    write part of it); :func:`read_lines` drops such a tail, and a caller that appends
    again after a kill must first rewrite the file from :func:`read_lines` (as
    :meth:`refdml.train.Trainer.resume` does). ``durable``: fsync after the write.
    """
    if "\n" in line or "\r" in line:
        raise ValueError(f"line must be one line without a newline, got {line[:80]!r}")
    data = (line + "\n").encode("utf-8")
    _refuse_special(Path(path))   # opening a FIFO to write would block until a reader comes
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_BINARY, 0o666)
    try:
        written = os.write(fd, data)
        while written < len(data):  # a short write (a full disk, a signal): finish the line
            written += os.write(fd, data[written:])
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_lines(path: Any) -> list[str]:
    """The complete lines of ``path`` (UTF-8, without their newlines), in order.

    A last line without a newline is an append cut by a kill (:func:`append_line` writes
    the newline with the line) and is dropped. Empty lines are kept (as ``""``).
    """
    data = Path(path).read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    return complete.decode("utf-8").split("\n")[:-1]


# --------------------------------------------------------------------------- whole folders

#: The file :func:`replaced_folder` leaves in every folder it writes: the mark of a folder
#: refdml may replace (it deletes no folder without it, unless the caller recognises it).
FOLDER_MARKER = ".refdml-folder"
_MARKER_TEXT = ("This folder was written by refdml as a whole; the next run writing here "
                "replaces all of it.\n")
_STAGING = re.compile(r"^\.(?P<name>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.(?:staging|old)$")


def is_protected_folder(path: Any) -> bool:
    """Is ``path`` the working folder, one of its ancestors, or the home folder? Such a
    folder is never replaced, whatever it holds (``--report .``, ``--report ~``)."""
    path = Path(path).resolve()
    here = Path.cwd().resolve()
    return path == here or path in here.parents or path == Path.home().resolve()


def is_replaceable_folder(path: Any, *, recognise=None) -> bool:
    """May :func:`replaced_folder` replace ``path``? True when it does not exist, is an
    empty folder, holds :data:`FOLDER_MARKER`, or ``recognise(path)`` says it is a folder
    refdml wrote (the reports written before the marker existed). False for a file, and
    for the working folder, its ancestors and the home folder (:func:`is_protected_folder`)."""
    path = Path(path)
    if is_protected_folder(path):
        return False
    if not path.exists():
        return True
    if not path.is_dir():
        return False
    if (path / FOLDER_MARKER).is_file() or not any(path.iterdir()):
        return True
    return bool(recognise is not None and recognise(path))


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, owned by someone else
        return True
    return True


def _remove_leftovers(path: Path) -> None:
    """Staging and set-aside folders of ``path`` left by runs that were killed."""
    for entry in path.parent.iterdir():
        match = _STAGING.match(entry.name)
        if (match and match["name"] == path.name and entry.is_dir() and not entry.is_symlink()
                and not _pid_alive(int(match["pid"]))):
            shutil.rmtree(entry, ignore_errors=True)


def _beside(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.{kind}")


@contextlib.contextmanager
def replaced_folder(path: Any, *, recognise=None, durable: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder beside ``path``; on a normal exit it becomes ``path``.

    Write the whole folder into the yielded one inside the ``with`` block. On a normal exit
    :data:`FOLDER_MARKER` is added, the previous ``path`` (if any) is renamed aside, the
    staging folder renamed to ``path``, and the previous one deleted: no file of the
    previous folder survives. An exception inside the block deletes the staging folder and
    leaves ``path`` as it was; a kill leaves ``path`` as it was and a staging folder
    (``.<name>.<pid>.<random>.staging``), which the next call for ``path`` deletes. Between
    the two renames ``path`` is briefly missing (a kill there leaves the previous folder as
    ``.<name>.<pid>.<random>.old``).

    Raises ``FileExistsError`` (before the block) when ``path`` is not
    :func:`is_replaceable_folder` (a file, or a folder refdml did not write): refdml
    deletes no folder it did not write. ``path``'s parent folders are created.
    """
    path = Path(path).resolve()   # a symbolic link: the folder it names is replaced
    if not is_replaceable_folder(path, recognise=recognise):
        raise FileExistsError(f"{path} exists and is not a folder refdml wrote; "
                              "it is not replaced")
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(path)
    staging = _beside(path, "staging")
    staging.mkdir()
    try:
        yield staging
        write_text_atomic(staging / FOLDER_MARKER, _MARKER_TEXT, durable=durable)
        if not is_replaceable_folder(path, recognise=recognise):  # appeared meanwhile
            raise FileExistsError(f"{path} exists and is not a folder refdml wrote; "
                                  "it is not replaced")
        old = None
        if path.exists():
            old = _beside(path, "old")
            os.rename(path, old)
        try:
            os.rename(staging, path)
        except BaseException:
            if old is not None:
                os.rename(old, path)
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if durable:
        _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
