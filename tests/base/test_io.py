"""refdml._io: whole-file writes that a kill or an exception cannot leave half done, and the
append / read of a JSON-lines log that drops a line cut by a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from refdml._io import (
    append_line,
    atomic_path,
    read_lines,
    save_figure,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)


def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_whole_file_writes_replace_the_target_and_leave_no_temporary(tmp_path):
    target = tmp_path / "out.txt"
    assert write_text_atomic(target, "first\n") == target
    assert target.read_text() == "first\n"
    write_text_atomic(target, "second, longer than the first\n")
    assert target.read_text() == "second, longer than the first\n"
    write_bytes_atomic(tmp_path / "b.bin", b"\x00\xff" * 10)
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff" * 10
    write_json_atomic(tmp_path / "d.json", {"b": [1, 2.5], "a": None}, indent=1, sort_keys=True)
    text = (tmp_path / "d.json").read_text()
    assert json.loads(text) == {"a": None, "b": [1, 2.5]}
    assert text == json.dumps({"b": [1, 2.5], "a": None}, indent=1, sort_keys=True) + "\n"
    assert _names(tmp_path) == ["b.bin", "d.json", "out.txt"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_the_target_gets_the_permissions_of_a_plain_open(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("x")
    write_text_atomic(tmp_path / "atomic", "x")
    assert (tmp_path / "atomic").stat().st_mode == plain.stat().st_mode


@pytest.mark.parametrize("old", [None, "old content\n"])
def test_an_exception_inside_the_write_leaves_the_old_file_or_none(tmp_path, old):
    target = tmp_path / "report.md"
    if old is not None:
        target.write_text(old)
    with pytest.raises(RuntimeError, match="on purpose"):
        with atomic_path(target) as temp:
            assert temp.parent == tmp_path and temp.exists() and temp != target
            temp.write_text("half of the new ")
            raise RuntimeError("on purpose")
    assert _names(tmp_path) == ([] if old is None else ["report.md"])
    if old is not None:
        assert target.read_text() == old


def test_a_failing_rename_leaves_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    target.write_text("old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomic(target, {"new": 1})
    assert _names(tmp_path) == ["results.json"] and target.read_text() == "old"


def test_a_document_json_cannot_encode_touches_nothing(tmp_path):
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "x.json", {"a": object()})
    assert _names(tmp_path) == []


def test_two_writers_never_share_a_temporary_and_the_last_rename_wins_whole(tmp_path):
    target = tmp_path / "shared.txt"
    with atomic_path(target) as first:
        first.write_text("A" * 1000)
        with atomic_path(target) as second:
            assert second != first and first.exists() and second.exists()
            second.write_text("B" * 10)
        assert target.read_text() == "B" * 10
    assert target.read_text() == "A" * 1000
    # threads writing one target: every state seen is one writer's whole content
    target.unlink()
    contents = [chr(ord("a") + i) * (1000 * (i + 1)) for i in range(8)]
    seen, stop = [], threading.Event()

    def watch():
        while True:
            done = stop.is_set()
            if target.exists():
                seen.append(target.read_text())
            if done:            # one read after the last write at least
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    writers = [threading.Thread(target=lambda c=c: [write_text_atomic(target, c, durable=False)
                                                    for _ in range(20)]) for c in contents]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    watcher.join()
    assert target.read_text() in contents
    assert seen and set(seen) <= set(contents)
    assert _names(tmp_path) == ["shared.txt"]


def test_save_figure_writes_the_format_of_the_suffix_at_that_exact_path(tmp_path):
    pytest.importorskip("matplotlib", reason="figures need the plot extra")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 2))
    fig.add_subplot(1, 1, 1).plot([0, 1], [1, 0])
    assert save_figure(fig, tmp_path / "a.png", dpi=50) == tmp_path / "a.png"
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    save_figure(fig, tmp_path / "b.SVG")
    assert b"<svg" in (tmp_path / "b.SVG").read_bytes()[:1000]
    save_figure(fig, tmp_path / "c.png", format="pdf")            # an explicit format wins
    assert (tmp_path / "c.png").read_bytes()[:5] == b"%PDF-"
    save_figure(fig, tmp_path / "noext")                           # matplotlib's default type
    assert (tmp_path / "noext").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _names(tmp_path) == ["a.png", "b.SVG", "c.png", "noext"]


def test_append_and_read_lines_round_trip_and_drop_a_cut_last_line(tmp_path):
    log = tmp_path / "log.jsonl"
    assert not log.exists()
    rows = [{"epoch": i, "loss": 1.0 / (i + 1)} for i in range(3)]
    for row in rows:
        append_line(log, json.dumps(row))
    assert [json.loads(line) for line in read_lines(log)] == rows
    with open(log, "ab") as handle:       # what a kill inside an append can leave
        handle.write(b'{"epoch": 3, "lo')
    assert [json.loads(line) for line in read_lines(log)] == rows
    log.write_bytes(b'{"epoch": 0}')      # a single line without its newline: nothing complete
    assert read_lines(log) == []
    log.write_bytes(b"")
    assert read_lines(log) == []
    log.write_bytes(b"a\n\nb\n")
    assert read_lines(log) == ["a", "", "b"]
    for bad in ("two\nlines", "carriage\rreturn"):
        with pytest.raises(ValueError, match="without a newline"):
            append_line(log, bad)
    assert read_lines(log) == ["a", "", "b"]


_CHILD = r"""
import os, sys, time
from refdml._io import atomic_path
target, mode = sys.argv[1], sys.argv[2]
if mode == "whole":
    with atomic_path(target) as temp, open(temp, "wb") as handle:
        handle.write(b"new " * 1000)
        handle.flush()
        print("inside", flush=True)
        time.sleep(60)
else:
    fd = os.open(target, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b'{"epoch": 2, "tr')
    print("inside", flush=True)
    time.sleep(60)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
@pytest.mark.parametrize("mode", ["whole", "append"])
def test_sigkill_inside_a_write(tmp_path, mode):
    """A process killed (SIGKILL) in the middle of a write: the whole-file target keeps its
    old content (the leftover temporary is a hidden ``.tmp`` that no reader opens); the cut
    append is dropped by read_lines."""
    target = tmp_path / ("report.md" if mode == "whole" else "log.jsonl")
    old = "old report\n" if mode == "whole" else '{"epoch": 0}\n{"epoch": 1}\n'
    target.write_text(old)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(target), mode],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "inside"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    if mode == "whole":
        assert target.read_text() == old
        (leftover,) = [p for p in tmp_path.iterdir() if p != target]
        assert leftover.name.startswith(".report.md.") and leftover.name.endswith(".tmp")
        assert leftover.stat().st_size == 4000      # the kill came with the write done
    else:
        assert target.read_text().endswith('{"epoch": 2, "tr')
        assert [json.loads(line)["epoch"] for line in read_lines(target)] == [0, 1]
