"""Output paths are checked before any work (issue 38, item 3).

Every command that writes (``verify``, ``reproduce``, ``conform``, ``gpu-check``) x each of
its output flags (``--json``, ``--report``) x a bad path (its parent is a file, the path is
a folder / a file / a folder refdml did not write, ``/proc/x``): exit status 2, one line
naming the flag and no traceback, and nothing ran: the command's work function is replaced
by one that raises, so a check made after the work would fail the test. A path whose
missing parents can be created passes the check, which the same stand-in proves by being
reached.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import refdml.checks._gpu_check_cli as gpu_check_cli
import refdml.conformance._cli as conform_cli
import refdml.reproduce._runner as reproduce_runner
import refdml.validation._cli as verify_cli
from refdml._cli_support import write_outputs
from refdml._io import FOLDER_MARKER
from refdml.cli import main


class _WorkStarted(Exception):
    """Raised by the stand-in of a command's work: the output checks let it start."""


def _started(*args, **kwargs):
    raise _WorkStarted


# command -> (argv before the output flag, where its work starts, the output flags it has);
# conform's work starts by importing the implementation, which may run the user's code
_COMMANDS = {
    "verify": (["verify", "--only", "gsp.appA3.hinv"], (verify_cli, "run_checks"),
               ("--json", "--report")),
    "reproduce": (["reproduce", "--quick", "--only", "gsp.synthetic", "--in-process", "--no-cache"],
                  (reproduce_runner, "run_tasks"), ("--json", "--report")),
    "conform": (["conform", "nosuchmodule:nosuchfn", "--op", "distances.euclidean",
                 "--framework", "torch"], (conform_cli, "load_callable"), ("--json",)),
    "gpu-check": (["gpu-check", "--only", "distances.euclidean"],
                  (gpu_check_cli.parity, "available_backends"), ("--json",)),
    "gpu-check --compile-only": (["gpu-check", "--compile-only"],
                                 (gpu_check_cli._compile_check, "compile_check"), ("--json",)),
}
_CASES = [(command, flag) for command, (_, _, flags) in _COMMANDS.items() for flag in flags]


def _run(monkeypatch, capsys, command: str, flag: str, value) -> tuple[int | str, str]:
    argv, (module, name), _ = _COMMANDS[command]
    monkeypatch.setattr(module, name, _started)
    try:
        status = main([*argv, flag, str(value)])
    except _WorkStarted:
        status = "started"
    return status, capsys.readouterr().err


def _refused(status, err: str, flag: str) -> str:
    """Exit 2, one error line naming the flag, no traceback; the line."""
    assert status == 2, f"not refused before the work (status {status!r}): {err}"
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("refdml ") and ": error: " in lines[0] and flag in lines[0], lines[0]
    return lines[0]


def _name(flag: str) -> str:
    return "x.json" if flag == "--json" else "report"


@pytest.mark.parametrize(("command", "flag"), _CASES)
def test_a_parent_that_is_a_file_is_refused_before_the_work(tmp_path, monkeypatch, capsys,
                                                             command, flag):
    (tmp_path / "a_file").write_text("x")
    status, err = _run(monkeypatch, capsys, command, flag, tmp_path / "a_file" / _name(flag))
    assert "a_file is a file, not a folder" in _refused(status, err, flag)


@pytest.mark.parametrize(("command", "flag"), _CASES)
def test_a_path_of_the_wrong_kind_is_refused_before_the_work(tmp_path, monkeypatch, capsys,
                                                             command, flag):
    if flag == "--json":            # a folder where the file goes
        target, expected = tmp_path, "is a folder, not a file"
    else:                           # a file where the folder goes
        target, expected = tmp_path / "a_file", "is a file, not a folder"
        target.write_text("x")
    status, err = _run(monkeypatch, capsys, command, flag, target)
    assert expected in _refused(status, err, flag)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize(("command", "flag"), _CASES)
def test_an_unwritable_place_is_refused_before_the_work(monkeypatch, capsys, command, flag):
    # /proc/x: os.access says root may write there; only creating a file tells the truth
    status, err = _run(monkeypatch, capsys, command, flag, f"/proc/{_name(flag)}")
    assert "cannot write in /proc" in _refused(status, err, flag)


@pytest.mark.parametrize(("command", "flag"), _CASES)
def test_missing_parents_that_can_be_created_pass_and_nothing_is_created(
        tmp_path, monkeypatch, capsys, command, flag):
    status, err = _run(monkeypatch, capsys, command, flag, tmp_path / "a" / "b" / _name(flag))
    assert status == "started", err
    assert list(tmp_path.iterdir()) == []    # the check creates nothing


@pytest.mark.parametrize("command", [c for c, f in _CASES if f == "--report"])
def test_a_folder_refdml_did_not_write_is_refused_and_kept(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "notes.txt").write_text("mine")
    status, err = _run(monkeypatch, capsys, command, "--report", tmp_path)
    assert "is not a refdml report folder" in _refused(status, err, "--report")
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("command", [c for c, f in _CASES if f == "--report"])
def test_a_report_folder_refdml_wrote_may_be_replaced(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "old.png").write_text("old figure")
    (tmp_path / FOLDER_MARKER).write_text("")
    status, err = _run(monkeypatch, capsys, command, "--report", tmp_path)
    assert status == "started", err


@pytest.mark.parametrize("where", ["working folder", "its parent", "home"])
def test_the_working_folder_and_home_are_never_replaced(tmp_path, monkeypatch, capsys, where):
    # even marked as a refdml report folder
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    work.mkdir(parents=True)
    for folder in (home, work):
        (folder / FOLDER_MARKER).write_text("")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    value = {"working folder": ".", "its parent": "..", "home": str(home)}[where]
    status, err = _run(monkeypatch, capsys, "verify", "--report", value)
    assert "never replaces" in _refused(status, err, "--report")
    assert sorted(p.name for p in work.iterdir()) == [FOLDER_MARKER]


def test_json_and_report_on_one_path_are_refused(tmp_path, monkeypatch, capsys):
    argv, (module, name), _ = _COMMANDS["verify"]
    monkeypatch.setattr(module, name, _started)
    status = main([*argv, "--json", str(tmp_path / "out"), "--report", str(tmp_path / "out")])
    _refused(status, capsys.readouterr().err, "--json")


def test_reproduce_refuses_a_cache_inside_the_report(tmp_path, monkeypatch, capsys):
    argv, (module, name), _ = _COMMANDS["reproduce"]
    monkeypatch.setattr(module, name, _started)
    argv = [a for a in argv if a != "--no-cache"]
    status = main([*argv, "--report", str(tmp_path / "r"), "--cache", str(tmp_path / "r" / "c")])
    assert "--cache" in _refused(status, capsys.readouterr().err, "--report")


def test_a_write_that_fails_is_one_line_and_false(tmp_path, capsys):
    def full_disk(path):
        raise OSError(28, "No space left on device", str(path))

    assert write_outputs("verify", json_path=str(tmp_path / "x.json"), write_json=full_disk) is False
    err = capsys.readouterr().err
    assert err == (f"refdml verify: error: --json {tmp_path / 'x.json'}: cannot be written "
                   "(No space left on device)\n")


def test_a_json_inside_the_report_folder_survives_the_swap(tmp_path, capsys):
    report = tmp_path / "out"

    def write_report(folder: Path) -> Path:
        (folder / "README.md").write_text("# a report\n")
        return folder / "README.md"

    for text in ("first", "second"):
        assert write_outputs("reproduce", json_path=str(report / "results.json"),
                             write_json=lambda path, text=text: path.write_text(text),
                             report=str(report), write_report=write_report)
    assert (report / "results.json").read_text() == "second"
    assert sorted(os.listdir(report)) == [FOLDER_MARKER, "README.md", "results.json"]
    assert f"JSON written to {report / 'results.json'}" in capsys.readouterr().out


# ``refdml train --out DIR``: a run folder, never replaced (a resume reads it back), so only
# "can files be created there?" is asked; its work starts with build_run.
@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("out", ["/proc/refdml-run", "/proc/refdml-run/nested"])
def test_train_refuses_an_unwritable_run_folder_before_the_work(monkeypatch, capsys, out):
    import refdml.train.runs as train_runs

    monkeypatch.setattr(train_runs, "build_run", _started)
    try:
        status = main(["train", "--study", "tokens", "--epochs", "1", "--out", out])
    except _WorkStarted:
        status = "started"
    line = _refused(status, capsys.readouterr().err, "--out")
    assert "cannot write in /proc" in line


def test_train_accepts_missing_parents_and_creates_nothing(tmp_path, monkeypatch, capsys):
    import refdml.train.runs as train_runs

    monkeypatch.setattr(train_runs, "build_run", _started)
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(_WorkStarted):
        main(["train", "--study", "tokens", "--epochs", "1", "--out", str(out)])
    assert not (tmp_path / "a").exists()
