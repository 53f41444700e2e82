"""refdml._io.replaced_folder: a folder written as a whole (a report) in a staging folder
beside it and swapped in, so no file of the previous one survives, a killed writer leaves
the previous one, and no folder refdml did not write is ever deleted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from refdml._io import FOLDER_MARKER, is_replaceable_folder, replaced_folder


def _names(folder):
    return sorted(p.name for p in folder.iterdir())


def _report(folder, text: str) -> None:
    """A folder as refdml writes it: the marker, a page, a figure."""
    with replaced_folder(folder) as staging:
        (staging / "figures").mkdir()
        (staging / "figures" / f"{text}.png").write_text(text)
        (staging / "report.md").write_text(text)


def test_the_new_folder_replaces_the_old_and_no_stale_file_survives(tmp_path):
    target = tmp_path / "report"
    _report(target, "first")
    assert _names(target) == [FOLDER_MARKER, "figures", "report.md"]
    _report(target, "second")
    assert (target / "report.md").read_text() == "second"
    assert _names(target / "figures") == ["second.png"]        # first.png is gone
    assert _names(tmp_path) == ["report"]                       # no staging, no old copy


def test_parents_are_created_and_an_empty_folder_is_replaced(tmp_path):
    _report(tmp_path / "a" / "b", "x")
    assert (tmp_path / "a" / "b" / "report.md").read_text() == "x"
    (tmp_path / "empty").mkdir()
    assert is_replaceable_folder(tmp_path / "empty")
    _report(tmp_path / "empty", "y")
    assert (tmp_path / "empty" / FOLDER_MARKER).is_file()


def test_an_exception_leaves_the_old_folder_and_no_staging(tmp_path):
    target = tmp_path / "report"
    _report(target, "old")
    with pytest.raises(RuntimeError, match="drawing failed"):
        with replaced_folder(target) as staging:
            (staging / "report.md").write_text("half")
            raise RuntimeError("drawing failed")
    assert (target / "report.md").read_text() == "old"
    assert _names(tmp_path) == ["report"]


_KILLED_WRITER = r"""
import os, signal, sys
from pathlib import Path
from refdml._io import replaced_folder

with replaced_folder(sys.argv[1]) as staging:
    (staging / "report.md").write_text("new, never finished")
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")
def test_a_killed_writer_leaves_the_old_folder_and_the_next_run_clears_its_staging(tmp_path):
    target = tmp_path / "report"
    _report(target, "old")
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(target)])
    assert done.returncode == -signal.SIGKILL
    assert (target / "report.md").read_text() == "old"
    assert _names(target / "figures") == ["old.png"]
    (staging,) = [p for p in tmp_path.iterdir() if p.name != "report"]
    assert staging.name.startswith(".report.") and staging.name.endswith(".staging")
    _report(target, "new")                  # the dead writer's staging folder is removed
    assert _names(tmp_path) == ["report"]
    assert (target / "report.md").read_text() == "new"


def test_a_folder_refdml_did_not_write_is_refused_and_kept(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert not is_replaceable_folder(mine)
    with pytest.raises(FileExistsError, match="not a folder refdml wrote"):
        with replaced_folder(mine):
            pytest.fail("the block ran")
    assert _names(mine) == ["notes.txt"]
    assert _names(tmp_path) == ["mine"]
    (tmp_path / "a_file").write_text("x")
    assert not is_replaceable_folder(tmp_path / "a_file")
    # a caller may recognise its own folders written before the marker existed
    assert is_replaceable_folder(mine, recognise=lambda p: (p / "notes.txt").exists())


def test_the_working_folder_its_parents_and_home_are_never_replaced(tmp_path, monkeypatch):
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    for folder in (home, work):
        (folder / FOLDER_MARKER).write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    for folder in (".", "..", str(home), str(tmp_path)):
        assert not is_replaceable_folder(folder), folder
        with pytest.raises(FileExistsError):
            with replaced_folder(folder):
                pytest.fail("the block ran")
    assert _names(work) == [FOLDER_MARKER]


def test_a_symbolic_link_keeps_pointing_at_the_replaced_folder(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    _report(real, "old")
    os.symlink(real, link)
    _report(link, "new")
    assert link.is_symlink() and (link / "report.md").read_text() == "new"
    assert (real / "report.md").read_text() == "new"
