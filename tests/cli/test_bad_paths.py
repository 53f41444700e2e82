"""No command crashes on a path, and no output replaces a special file (issue 48, item 6).

Every flag of every command that names a path (``verify --json/--report``, ``reproduce
--json/--report/--cache``, ``conform --json``, ``gpu-check --json``, ``train
--out/--config/--features``) x a path whose last name is longer than the file system
allows: exit status 2, one line naming the flag, the value shortened, no traceback, and
nothing ran (the command's work is replaced by a stand-in that raises). On Python 3.11,
pathlib's ``exists``/``is_dir`` raise ``OSError: [Errno 36]`` for such a path, which is how
the checks themselves used to crash.

Outputs: a FIFO or a character device (``/dev/null``) named as an output file is refused
at the command line before any work, and by the atomic writer itself before it creates
anything (a ValueError naming the path); the device stays a device.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from test_output_paths import _refused  # one wording of "refused before the work"

import refdml.checks._gpu_check_cli as gpu_check_cli
import refdml.conformance._cli as conform_cli
import refdml.reproduce._runner as reproduce_runner
import refdml.train.runs as train_runs
import refdml.validation._cli as verify_cli
from refdml import _io
from refdml._cli_support import path_problem, shown
from refdml.cli import main
from refdml.train.trainer import _check_out_dir


class _WorkStarted(Exception):
    """Raised by the stand-in of a command's work: the checks let it start."""


def _started(*args, **kwargs):
    raise _WorkStarted


_TRAIN = ["train", "--study", "tokens", "--epochs", "1"]
_FEATURES = ["train", "--study", "features", "--epochs", "1"]
_REPRODUCE = ["reproduce", "--quick", "--only", "gsp.synthetic", "--in-process"]
# (command, flag) -> (argv before the flag, where the work starts, argv after the flag,
# whether the path is an output file (False: a folder, or a file that is read))
_FLAGS = {
    ("verify", "--json"): (["verify", "--only", "gsp.appA3.hinv"], (verify_cli, "run_checks")),
    ("verify", "--report"): (["verify", "--only", "gsp.appA3.hinv"], (verify_cli, "run_checks")),
    ("reproduce", "--json"): ([*_REPRODUCE, "--no-cache"], (reproduce_runner, "run_tasks")),
    ("reproduce", "--report"): ([*_REPRODUCE, "--no-cache"], (reproduce_runner, "run_tasks")),
    ("reproduce", "--cache"): (_REPRODUCE, (reproduce_runner, "run_tasks")),
    ("conform", "--json"): (["conform", "nosuchmodule:nosuchfn", "--op", "distances.euclidean",
                             "--framework", "torch"], (conform_cli, "load_callable")),
    ("gpu-check", "--json"): (["gpu-check", "--only", "distances.euclidean"],
                              (gpu_check_cli.parity, "available_backends")),
    ("gpu-check --compile-only", "--json"): (["gpu-check", "--compile-only"],
                                             (gpu_check_cli._compile_check, "compile_check")),
    ("train", "--out"): (_TRAIN, (train_runs, "build_run")),
    ("train", "--config"): (_TRAIN, (train_runs, "build_run")),
    ("train", "--features"): (_FEATURES, (train_runs, "build_run")),
}
#: The flags that write a file (the atomic writer's targets).
_FILE_OUTPUTS = [key for key in _FLAGS if key[1] == "--json"]


def _run(monkeypatch, capsys, tmp_path, key, value) -> tuple[int | str, str]:
    argv, (module, name) = _FLAGS[key]
    monkeypatch.setattr(module, name, _started)
    monkeypatch.chdir(tmp_path)   # the default --out and --cache land here
    extra = [] if key[0] != "train" or key[1] == "--out" else ["--out", str(tmp_path / "o")]
    try:
        status = main([*argv, key[1], str(value), *extra])
    except _WorkStarted:
        status = "started"
    return status, capsys.readouterr().err


@pytest.mark.parametrize("key", list(_FLAGS), ids=" ".join)
@pytest.mark.parametrize("where", ["last name", "a missing folder", "an existing folder"])
def test_a_name_longer_than_the_file_system_allows_is_one_line(tmp_path, monkeypatch, capsys,
                                                               key, where):
    long = "x" * 300   # NAME_MAX is 255 bytes on every file system refdml runs on
    value = {"last name": tmp_path / long,
             "a missing folder": tmp_path / long / "out",
             "an existing folder": tmp_path / long}[where]
    status, err = _run(monkeypatch, capsys, tmp_path, key, value)
    line = _refused(status, err, key[1])
    assert "too long" in line
    assert long not in line and "(" in line   # the value is shortened, with its length
    assert not any(p.name.startswith("x") for p in tmp_path.iterdir())


@pytest.mark.skipif(os.name != "posix", reason="needs a POSIX symbolic link loop")
@pytest.mark.parametrize("key", list(_FLAGS), ids=" ".join)
def test_a_loop_of_symbolic_links_is_one_line(tmp_path, monkeypatch, capsys, key):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    status, err = _run(monkeypatch, capsys, tmp_path, key, tmp_path / "a" / "out")
    assert "symbolic links" in _refused(status, err, key[1]).lower()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("key", _FILE_OUTPUTS, ids=" ".join)
def test_a_fifo_as_an_output_file_is_refused_and_stays_a_fifo(tmp_path, monkeypatch, capsys, key):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    status, err = _run(monkeypatch, capsys, tmp_path, key, fifo)
    assert "FIFO" in _refused(status, err, key[1])
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
@pytest.mark.parametrize("key", _FILE_OUTPUTS, ids=" ".join)
def test_dev_null_as_an_output_file_is_refused_before_any_write(tmp_path, monkeypatch, capsys,
                                                                key):
    # any write would fail the test (and the check must come before it, not after)
    def no_write(*args, **kwargs):
        raise AssertionError("an output was written")

    monkeypatch.setattr(_io, "_create_temp", no_write)
    monkeypatch.setattr(os, "replace", no_write)
    status, err = _run(monkeypatch, capsys, tmp_path, key, "/dev/null")
    assert "character device" in _refused(status, err, key[1])
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not Path("/dev/null").exists(), reason="needs /dev/null")
@pytest.mark.parametrize("write", [
    lambda path: _io.write_json_atomic(path, {"a": 1}),
    lambda path: _io.write_text_atomic(path, "x"),
    lambda path: _io.write_bytes_atomic(path, b"x"),
    lambda path: _io.append_line(path, "x"),
], ids=["json", "text", "bytes", "append_line"])
def test_the_atomic_writer_refuses_a_device_before_it_creates_anything(monkeypatch, write):
    def no_write(*args, **kwargs):
        raise AssertionError("the writer went on to write")

    monkeypatch.setattr(_io, "_create_temp", no_write)
    monkeypatch.setattr(os, "replace", no_write)
    monkeypatch.setattr(os, "open", no_write)
    with pytest.raises(ValueError, match=r"^path == '/dev/null' is a character device"):
        write("/dev/null")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_the_atomic_writer_refuses_a_fifo_a_folder_and_a_link_to_a_fifo(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to(fifo)
    for target, kind in [(fifo, r"a FIFO \(named pipe\)"), (tmp_path / "link", "a FIFO"),
                         (tmp_path, "a folder")]:
        with pytest.raises(ValueError, match=f"is {kind}.*not a regular file"):
            _io.write_text_atomic(target, "x")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "pipe"]   # no temporary file


def test_the_atomic_writer_refuses_a_special_file_that_appears_while_writing(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(ValueError, match="is a FIFO"):
        with _io.atomic_path(target) as temp:
            temp.write_text("x")
            os.mkfifo(target)
    assert stat.S_ISFIFO(os.stat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]   # the temporary file is gone


def test_the_atomic_writer_still_replaces_a_regular_file_and_makes_a_new_one(tmp_path):
    _io.write_text_atomic(tmp_path / "a", "old")
    _io.write_text_atomic(tmp_path / "a", "new")
    assert (tmp_path / "a").read_text() == "new"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_reproduce_refuses_a_cache_it_cannot_write_before_any_task(tmp_path, monkeypatch, capsys):
    status, err = _run(monkeypatch, capsys, tmp_path, ("reproduce", "--cache"), "/proc/x")
    assert "/proc" in _refused(status, err, "--cache")


def test_reproduce_refuses_a_cache_that_is_a_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "f").write_text("x")
    status, err = _run(monkeypatch, capsys, tmp_path, ("reproduce", "--cache"), tmp_path / "f")
    assert "is a file, not a folder" in _refused(status, err, "--cache")


def test_reproduce_makes_a_cache_it_can_write_and_starts(tmp_path, monkeypatch, capsys):
    status, err = _run(monkeypatch, capsys, tmp_path, ("reproduce", "--cache"),
                       tmp_path / "c" / "d")
    assert status == "started", err
    assert (tmp_path / "c" / "d").is_dir() and list((tmp_path / "c" / "d").iterdir()) == []


def test_train_config_and_features_must_be_regular_files(tmp_path, monkeypatch, capsys):
    os.mkfifo(tmp_path / "pipe")   # reading a FIFO would block
    for key in [("train", "--config"), ("train", "--features")]:
        status, err = _run(monkeypatch, capsys, tmp_path, key, tmp_path / "pipe")
        assert "FIFO" in _refused(status, err, key[1])


def test_path_problem_names_the_flag_and_shortens_the_value(tmp_path):
    long = str(tmp_path / ("y" * 400))
    problem = path_problem("--json", long)   # the kernel says so (stat: ENAMETOOLONG)
    assert problem == f"--json {shown(long)}: cannot be used (File name too long)"
    assert len(shown(long)) < 100 and "(463 characters)" not in shown("x" * 80)
    # under a missing folder the kernel reports only the missing folder: counted here
    long = str(tmp_path / "missing" / ("y" * 400))
    assert "a name in it is 400 bytes long" in path_problem("--json", long)
    assert path_problem("--json", str(tmp_path / "fine.json")) is None
    assert path_problem("--json", "") == "--json '': is empty, must name a path"
    assert "NUL" in path_problem("--json", "a\0b")


def test_the_trainer_refuses_a_run_folder_name_too_long(tmp_path):
    with pytest.raises(ValueError, match=r"^out_dir .*too long"):
        _check_out_dir(tmp_path / ("z" * 300))
    with pytest.raises(ValueError, match=r"^out_dir .*too long"):
        _check_out_dir(tmp_path / ("z" * 300) / "run")


# ``refdml train`` without ``--out`` (issue 48, item 4): runs/<study>-<UTC time>.
def test_train_without_out_writes_to_a_new_folder_under_runs(tmp_path, monkeypatch, capsys):
    import time

    from refdml.train._cli import default_out

    seen = {}

    def record(study, config, *, out_dir):
        seen["out_dir"] = out_dir
        raise _WorkStarted

    monkeypatch.setattr(train_runs, "build_run", record)
    monkeypatch.chdir(tmp_path)
    before = time.time()
    with pytest.raises(_WorkStarted):
        main(["train", "--study", "tokens", "--epochs", "1"])
    after = time.time()
    out = Path(seen["out_dir"])
    assert out.parent == Path("runs") and out.name.startswith("tokens-")
    # the name is the UTC time of the start, to the second
    assert out.name in {f"tokens-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(t))}"
                        for t in (before, after)}
    assert f"writing the run to {out}" in capsys.readouterr().out
    assert default_out("glyphs", now=0.0) == str(Path("runs") / "glyphs-19700101-000000")


def test_train_resume_without_out_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_runs, "build_run", _started)
    monkeypatch.chdir(tmp_path)
    status = main(["train", "--study", "tokens", "--resume"])
    assert "--resume needs --out" in _refused(status, capsys.readouterr().err, "--out")
    assert list(tmp_path.iterdir()) == []
