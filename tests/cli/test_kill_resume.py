"""Nothing is lost when a run is killed: real ``refdml train``, ``refdml reproduce`` and
``refdml verify`` processes are SIGKILLed at random moments and inside their writes, then
resumed to the end.

Each run is a child process running ``refdml.cli.main`` through :data:`_CHILD`, a wrapper
that can stop the child at a chosen instant: just before (or after) the ``os.replace`` of a
chosen file (its temporary file is then written in full and fsynced), or in the middle of a
``log.jsonl`` append (half the line written). The child writes a marker file and sleeps;
the test SIGKILLs it. The hook lives in this file only; refdml has none. Random kills
wait a seeded random time, from the launch or from a point of progress (a finished epoch,
a cached task).

After every kill the files left are checked whole (JSON parses, checkpoints load, PNGs end
with their IEND chunk, log lines parse and number the epochs 0, 1, 2, ... once each with
at most one line cut by the kill at the end), and every temporary file the kill left is
overwritten with garbage, so a resume that read one would fail. The resumed run must equal
an uninterrupted one (see the tolerances at the comparisons).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml._io import FOLDER_MARKER, read_lines
from refdml.train._checkpoint import load_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="SIGKILL is POSIX")

_CHILD = r"""
import json, os, sys, time
from fnmatch import fnmatch

spec = json.loads(sys.argv[1])
argv = sys.argv[2:]


def stop_here():
    # the test SIGKILLs this process once the marker exists
    with open(spec["marker"], "w") as handle:
        handle.write(str(os.getpid()))
    time.sleep(600)
    os._exit(3)


hook = spec.get("hook")
if hook and hook["kind"] == "replace":
    real_replace, calls, previous = os.replace, [0], [None]

    def replace(src, dst, **kwargs):
        dst_name = os.fspath(dst)
        hit = fnmatch(dst_name, hook["pattern"]) and (
            hook.get("after_name") is None or previous[0] == hook["after_name"])
        previous[0] = os.path.basename(dst_name)
        if hit:
            calls[0] += 1
            if calls[0] == hook["nth"]:
                if hook["when"] == "after":
                    real_replace(src, dst, **kwargs)
                stop_here()
        return real_replace(src, dst, **kwargs)

    os.replace = replace
elif hook and hook["kind"] == "append":
    import refdml.train.trainer as trainer

    real_append, calls = trainer.append_line, [0]

    def append_line(path, line, **kwargs):
        calls[0] += 1
        if calls[0] == hook["nth"]:
            data = (line + "\n").encode()
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            os.write(fd, data[: len(data) // 2])
            os.close(fd)
            stop_here()
        return real_append(path, line, **kwargs)

    trainer.append_line = append_line

toy = spec.get("toy")
if toy:
    # a tiny grid for `refdml reproduce`: the runner's toy study (numbers from the seed),
    # each execution recorded in a ledger
    from refdml.reproduce import EXPERIMENTS, Comparison, Experiment
    from refdml.reproduce import _studies, _tasks

    settings = {"sleep": toy["sleep"]}
    EXPERIMENTS["toy.kill"] = Experiment(
        "toy.kill", "none", "b is higher than a", "toy",
        {"a": ("a", settings), "b": ("a", {**settings, "shift": 1.0})},
        (Comparison("b", "a", "value", +1),), metrics=("value",), figures=("bars",))
    study = _studies.STUDIES["toy"]

    def ledgered(task):
        with open(toy["ledger"], "a") as handle:
            handle.write(json.dumps({"task": task.to_json(), "code": _tasks.code_version()},
                                    sort_keys=True) + "\n")
        return study(task)

    _studies.STUDIES["toy"] = ledgered

from refdml.cli import main

sys.exit(main(argv))
"""

_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"
# The figures need matplotlib (the test extra installs it; without it the runs write none
# and the figure parts below are left out).
_FIGURES = importlib.util.find_spec("matplotlib") is not None
_LAUNCH_TIMEOUT = 180.0


class _Child:
    """One run of ``refdml <argv>`` in a child process (cwd ``cwd``), optionally hooked."""

    def __init__(self, cwd: Path, argv: list[str], hook: dict | None = None,
                 toy: dict | None = None) -> None:
        self.marker = cwd / f"stopped-{time.monotonic_ns()}"
        spec = {"marker": str(self.marker), "hook": hook, "toy": toy}
        self.log = open(cwd / "child-output.txt", "a")
        self.started = time.monotonic()
        self.process = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec), *argv],
                                        cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT)

    def kill(self) -> bool:
        """SIGKILL the child; whether it was still running."""
        running = self.process.poll() is None
        if running:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=60)
        self.log.close()
        return running

    def kill_when(self, ready, what: str) -> None:
        """Poll ``ready()``; SIGKILL the child as soon as it is true (it must come)."""
        while not ready():
            if self.process.poll() is not None:
                self.log.close()
                raise AssertionError(f"the child ended (status {self.process.returncode}) "
                                     f"before {what}; its output: {self._output()}")
            if time.monotonic() - self.started > _LAUNCH_TIMEOUT:
                self.kill()
                raise AssertionError(f"no {what} within {_LAUNCH_TIMEOUT} s")
            time.sleep(0.005)
        assert self.kill(), f"the child ended by itself at {what}"

    def kill_in_hook(self) -> None:
        self.kill_when(self.marker.exists, "the hooked write")

    def finish(self) -> None:
        try:
            self.process.wait(timeout=_LAUNCH_TIMEOUT)
        finally:
            self.log.close()
        assert self.process.returncode == 0, self._output()

    def _output(self) -> str:
        return Path(self.log.name).read_text()[-3000:]


def _temporaries(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*.tmp") if p.is_file()]


def _poison_temporaries(folder: Path) -> None:
    """Overwrite what a kill left in temporary files: a run that loads one breaks."""
    for p in _temporaries(folder):
        p.write_bytes(b"not a refdml file")


def _assert_png_whole(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data.endswith(_PNG_END), f"{path} is torn"


# --------------------------------------------------------------------------- refdml train
# tokens, float64, 64 training samples in 4 steps per epoch: an epoch is a fraction of a
# second, and the lr keeps the validation MAP@R below 1 (no early stop) for the 8 epochs
_TOKENS = {"n_classes": 4, "n_classes_per_batch": 4, "n_train_per_class": 16,
           "n_val_per_class": 8, "n_test_per_class": 8, "lr": 3e-3, "head": "gsp",
           "n_prototypes": 4, "dim": 8, "embedding_dim": 8}
_EPOCHS = 8


def _train_argv(tmp_path: Path, out: str, resume: bool) -> list[str]:
    config = tmp_path / "run.toml"
    if not config.exists():
        config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in _TOKENS.items()))
    return ["train", "--study", "tokens", "--config", str(config), "--out", out,
            "--epochs", str(_EPOCHS), "--dtype", "float64", "--seed", "5", "--no-progress",
            *(["--resume"] if resume else [])]


def _log_epochs(out: Path) -> list[int]:
    """The epochs of the complete log lines; asserts 0, 1, 2, ... each once."""
    if not (out / "log.jsonl").exists():
        return []
    epochs = [json.loads(line)["epoch"] for line in read_lines(out / "log.jsonl")]
    assert epochs == list(range(len(epochs))), f"log epochs {epochs}"
    return epochs


def _check_train_folder(out: Path, *, best_current: bool = False) -> int | None:
    """Every file whole; the checkpoint's epoch (None: none yet).

    ``best_current``: the kill did not come between checkpoint.npz and best.npz, so
    best.npz must hold the checkpoint's best epoch.
    """
    if (out / "config.json").exists():
        assert json.loads((out / "config.json").read_text())["epochs"] == _EPOCHS
    epochs = _log_epochs(out)
    epoch = None
    if (out / "checkpoint.npz").exists():
        _, _, meta = load_checkpoint(out / "checkpoint.npz")
        epoch = meta["epoch"]
        # the row goes before the checkpoint: at most one row past it
        assert epoch in epochs and len(epochs) - 1 - epoch in (0, 1), (epoch, epochs)
    if (out / "best.npz").exists():
        _, _, best = load_checkpoint(out / "best.npz")
        assert epoch is not None and best["epoch"] <= epoch
        if best_current:
            assert best["epoch"] == meta["best_epoch"], (best["epoch"], meta["best_epoch"])
    else:
        assert not best_current or epoch is None, "checkpoint.npz without best.npz"
    for png in (out / "figures").glob("*.png") if (out / "figures").exists() else ():
        _assert_png_whole(png)
    return epoch


def _numbers_equal(a, b, what: str) -> None:
    """Integers, strings, None exactly; floats to rtol 1e-9 (see test_train_killed...)."""
    if isinstance(a, float) or isinstance(b, float):
        assert_allclose(a, b, rtol=1e-9, atol=1e-300, err_msg=what)
    else:
        assert a == b, f"{what}: {a!r} != {b!r}"


def _assert_checkpoints_equal(path: Path, reference: Path) -> None:
    params, optim, meta = load_checkpoint(path)
    ref_params, ref_optim, ref_meta = load_checkpoint(reference)
    assert sorted(params) == sorted(ref_params)
    for name in params:
        assert_allclose(params[name], ref_params[name], rtol=1e-9, atol=1e-15, err_msg=name)
    for name, entry in optim["params"].items():
        for key, value in entry.items():
            if isinstance(value, np.ndarray):
                assert_allclose(value, ref_optim["params"][name][key], rtol=1e-9, atol=1e-15,
                                err_msg=f"{name}/{key}")
    assert optim["n_steps"] == ref_optim["n_steps"]
    # integers by construction (the epoch counters, the PCG64 states of the sampler and
    # the trainer's Generator: they advance by a count of draws that no float decides)
    for key in ("epoch", "best_epoch", "improved_epoch", "stopped_early", "sampler", "rng"):
        assert meta[key] == ref_meta[key], key
    _numbers_equal(meta["best_val_map_at_r"], ref_meta["best_val_map_at_r"], "best MAP@R")


def test_train_killed_at_random_moments_and_inside_its_writes_resumes_to_the_same_run(
        tmp_path):
    rng = np.random.default_rng(20)
    reference = _Child(tmp_path, _train_argv(tmp_path, "reference", resume=False))
    reference.finish()
    out = tmp_path / "killed"

    def launch(hook=None):
        return _Child(tmp_path, _train_argv(tmp_path, "killed",
                                            resume=(out / "config.json").exists()), hook)

    def rows():
        return len(_log_epochs(out))

    def in_hook(hook):
        return lambda: launch(hook).kill_in_hook()

    def after_launch():
        child = launch()
        time.sleep(rng.uniform(0.2, 2.0))
        child.kill()

    def after_next_epoch():
        n = rows()
        _kill_after(launch(), lambda: rows() > n, rng.uniform(0.0, 0.3))

    kills = [   # (kill, whether best.npz must then hold the checkpoint's best epoch)
        # epoch 0's checkpoint written, best.npz not yet: resume must write it
        (in_hook({"kind": "replace", "pattern": "*/best.npz", "nth": 1, "when": "before",
                  "after_name": "checkpoint.npz"}), False),
        # a row appended, its checkpoint in a whole temporary file, not renamed: resume
        # drops the row, the epoch runs again
        (in_hook({"kind": "replace", "pattern": "*/checkpoint.npz", "nth": 1,
                  "when": "before"}), True),
        # half of the second row of this launch written: resume must drop it
        (in_hook({"kind": "append", "nth": 2}), True),
        # random: a moment after the launch (imports, data, an epoch, a write, ...)
        (after_launch, False),
        # random: a moment after the next finished epoch
        (after_next_epoch, False),
    ]
    if _FIGURES:   # training done, a figure in its temporary file: curves.png stays as it was
        kills.append((in_hook({"kind": "replace", "pattern": "*/figures/curves.png", "nth": 1,
                               "when": "before"}), True))
    curves = out / "figures" / "curves.png"
    for kill, best_current in kills:
        old_curves = curves.read_bytes() if curves.exists() else None
        kill()
        _check_train_folder(out, best_current=best_current)
        _poison_temporaries(out)
    assert old_curves == (curves.read_bytes() if curves.exists() else None)
    launch().finish()

    assert _check_train_folder(out) == _EPOCHS
    assert (out / "config.json").read_text() == (tmp_path / "reference" / "config.json"
                                                 ).read_text()
    got = [json.loads(line) for line in read_lines(out / "log.jsonl")]
    want = [json.loads(line) for line in read_lines(tmp_path / "reference" / "log.jsonl")]
    # every finished epoch exactly once, in order
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want] == list(range(_EPOCHS + 1))
    # Same code, same machine, same environment, one BLAS thread, the state restored from
    # the checkpoint to the bit: the resumed run repeats the uninterrupted one's operations
    # on the same values. Bit equality is not asserted (Numba's vectorised loops may sum in
    # an order that depends on array alignment); 1e-9 is far below what one lost or
    # repeated optimiser step changes (the parameters move ~1e-3 per step at lr 3e-3).
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in g.keys() - {"seconds"}:
            _numbers_equal(g[key], w[key], f"epoch {g['epoch']} {key}")
    _assert_checkpoints_equal(out / "checkpoint.npz", tmp_path / "reference" / "checkpoint.npz")
    _assert_checkpoints_equal(out / "best.npz", tmp_path / "reference" / "best.npz")
    figures = ["figures", "figures/curves.png", "figures/embeddings_2d.png"] if _FIGURES else []
    for name in figures[1:]:
        _assert_png_whole(out / name)
    visible = sorted(str(p.relative_to(out)) for p in out.rglob("*") if not p.name.startswith("."))
    assert visible == sorted(["best.npz", "checkpoint.npz", "config.json", "log.jsonl", *figures])


def _kill_after(child: _Child, ready, delay: float) -> None:
    """SIGKILL ``child`` ``delay`` seconds after ``ready()`` (or when it ends, if sooner)."""
    while not ready() and child.process.poll() is None:
        time.sleep(0.005)
    time.sleep(delay)
    child.kill()


# --------------------------------------------------------------------------- refdml reproduce
_SEEDS = 4


def _reproduce_argv(cache: str, json_path: str, report: str) -> list[str]:
    return ["reproduce", "--only", "toy.kill", "--seeds", str(_SEEDS), "--in-process",
            "--cache", cache, "--json", json_path, "--report", report]


def _cache_entries(cache: Path) -> dict[str, str]:
    """file name -> ``{"task": spec, "code": version}`` (sorted JSON, as the child's ledger
    writes it) of every entry; each must be whole JSON. The code version is part of a
    task's identity: a checkout edited during the test gives new cache keys."""
    if not cache.exists():
        return {}
    entries = {}
    for p in cache.iterdir():
        if not p.name.startswith("."):
            entry = json.loads(p.read_text())
            entries[p.name] = json.dumps({"task": entry["task"], "code": entry["code"]},
                                         sort_keys=True)
    return entries


def _without_run_details(value):
    """The payload less what depends on the clock, on how the run was split, and on the
    checkout's version (other people may edit a shared checkout during the test)."""
    if isinstance(value, dict):
        return {k: _without_run_details(v) for k, v in value.items()
                if k not in ("seconds", "wall_seconds", "task_cpu_seconds", "tasks",
                             "code_version")}
    if isinstance(value, list):
        return [_without_run_details(v) for v in value]
    return value


def _assert_same_payload(got, want, path="") -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for k in want:
            _assert_same_payload(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_payload(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        # the statistics (means, bootstrap intervals) are NumPy reductions, whose SIMD
        # paths may sum in an alignment-dependent order
        assert_allclose(got, want, rtol=1e-12, err_msg=path)
    else:
        assert got == want, path


def _report_lines(path: Path) -> list[str]:
    """README.md less the lines that hold times (the header and each run's seconds)."""
    lines = path.read_text().splitlines()
    return [line.rsplit("|", 2)[0] if line.startswith("| `") else line
            for line in lines if not line.startswith("Mode `")]


def test_reproduce_killed_at_random_moments_and_inside_its_writes_resumes_to_the_same_result(
        tmp_path):
    rng = np.random.default_rng(13)
    ledger = tmp_path / "ledger.txt"
    toy = {"sleep": 0.1, "ledger": str(ledger)}
    n_tasks = 2 * _SEEDS
    reference = _Child(tmp_path, [*_reproduce_argv("ref-cache", "ref.json", "ref-report"),
                                  "--no-cache"], toy=toy)
    reference.finish()
    assert len(read_lines(ledger)) == n_tasks
    ledger.unlink()
    cache, payload, report = tmp_path / "cache", tmp_path / "out.json", tmp_path / "report"
    argv = _reproduce_argv("cache", "out.json", "report")

    def launch(hook=None):
        return _Child(tmp_path, argv, hook, toy)

    def check_whole():
        entries = _cache_entries(cache)
        if payload.exists():
            assert json.loads(payload.read_text())["experiments"][0]["id"] == "toy.kill"
        if (report / "README.md").exists():
            text = (report / "README.md").read_text()
            assert text.endswith("\n") and "Settings of every run" in text
        for png in report.glob("*.png") if report.exists() else ():
            _assert_png_whole(png)
        return entries

    def in_hook(pattern, nth=1):
        return lambda: launch({"kind": "replace", "pattern": pattern, "nth": nth,
                               "when": "before"}).kill_in_hook()

    def after_next_task():
        n = len(_cache_entries(cache))
        _kill_after(launch(), lambda: len(_cache_entries(cache)) > n, rng.uniform(0.0, 0.15))

    def after_launch():
        child = launch()
        time.sleep(rng.uniform(0.2, 1.5))
        child.kill()

    def snapshot(path):
        return path.read_bytes() if path.exists() else None

    kills = [
        in_hook("*cache/*.json", nth=3),   # the third entry in its temporary file
        after_next_task,                   # random: a moment after the next cached task
        after_launch,                      # random: a moment after the launch
        in_hook("*out.json"),              # every task cached; the JSON in its temporary file
        in_hook("*report.*.staging/README.md"),  # the JSON written; the README in its staging folder
        in_hook("*out.json"),              # the JSON once more: the first must stay whole
    ]
    seen = []
    for i, kill in enumerate(kills):
        cached_before = set(check_whole().values())
        json_before, readme_before = snapshot(payload), snapshot(report / "README.md")
        start = len(read_lines(ledger)) if ledger.exists() else 0
        kill()
        ran = read_lines(ledger)[start:] if ledger.exists() else []
        # a task whose entry was in the cache is never run again
        assert not cached_before & set(ran), (i, cached_before & set(ran))
        seen.append(len(check_whole()))
        assert seen[-1] >= len(cached_before)
        # a write killed before its rename leaves the old file, or none
        if i in (3, 5):
            assert snapshot(payload) == json_before
        if i == 4:
            assert payload.exists() and snapshot(report / "README.md") == readme_before
        _poison_temporaries(tmp_path)
    assert seen[0] == 2, seen
    assert payload.exists() and json_before is not None     # the last kill had an old JSON
    start = len(read_lines(ledger))
    launch().finish()
    assert read_lines(ledger)[start:] == [], "the final run recomputed a cached task"

    got, want = (json.loads(p.read_text()) for p in (payload, tmp_path / "ref.json"))
    tasks = got["tasks"]
    assert tasks["computed"] + tasks["cached"] == n_tasks and tasks["failed"] == 0
    # every task of this code version cached exactly once
    entries = [json.loads(e) for e in _cache_entries(cache).values()]
    specs = sorted((e["task"]["seed"], e["task"]["settings"].get("shift", 0.0))
                   for e in entries if e["code"] == got["code_version"])
    assert specs == sorted((s, shift) for s in range(_SEEDS) for shift in (0.0, 1.0))
    runs = got["experiments"][0]["runs"]
    for label in ("a", "b"):
        # every task once; its value is a seeded NumPy draw (integer arithmetic and a table
        # of doubles) stored as JSON (repr round-trips a double): equal by construction
        values = runs[label]["values"]["value"]
        assert sorted(values) == [str(s) for s in range(_SEEDS)]
        assert values == want["experiments"][0]["runs"][label]["values"]["value"]
    _assert_same_payload(_without_run_details(got), _without_run_details(want))
    assert _report_lines(report / "README.md") == _report_lines(tmp_path / "ref-report" /
                                                                "README.md")
    if _FIGURES:
        _assert_png_whole(report / "toy_kill_bars.png")


# --------------------------------------------------------------------------- refdml verify
_CLAIM = "gsp.appA3.hinv"     # a check of well under a second


def _old_report(report: Path, text: str) -> None:
    """A previous report refdml wrote (its folder marker), with a figure of its own."""
    (report / "figures").mkdir(parents=True)
    (report / "report.md").write_text(text)
    (report / "figures" / "old.png").write_bytes(b"an old figure")
    (report / FOLDER_MARKER).write_text("")


def test_verify_killed_inside_its_report_write_keeps_the_old_report(tmp_path):
    report = tmp_path / "report"
    _old_report(report, "the previous report\n")
    (tmp_path / "v.json").write_text("[]")
    argv = ["verify", "--quick", "--only", _CLAIM, "--json", "v.json", "--report", "report"]
    child = _Child(tmp_path, argv, {"kind": "replace", "pattern": "*report.*.staging/report.md",
                                    "nth": 1, "when": "before"})
    child.kill_in_hook()
    # the report is written in a staging folder beside it: the previous one is untouched
    assert (report / "report.md").read_text() == "the previous report\n"
    assert (report / "figures" / "old.png").exists()
    (result,) = json.loads((tmp_path / "v.json").read_text())     # written before: whole
    assert result["id"] == _CLAIM
    (leftover,) = _temporaries(tmp_path)
    assert leftover.name.startswith(".report.md.") and leftover.parent.name.endswith(".staging")
    _Child(tmp_path, argv).finish()   # the next run replaces it and removes the leftover
    assert (report / "report.md").read_text().startswith("# refdml verify")
    assert not (report / "figures" / "old.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".report")) == []


def test_verify_an_exception_inside_its_writes_leaves_the_old_files(tmp_path, monkeypatch,
                                                                    capsys):
    from refdml.cli import main

    report = tmp_path / "report"
    _old_report(report, "old report")
    (tmp_path / "v.json").write_text("old json")
    real_replace = os.replace

    def refuse(src, dst):
        if Path(dst).name in ("report.md", "v.json"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse)
    argv = ["verify", "--quick", "--only", _CLAIM, "--report", str(report)]
    # a failed write is one line and exit status 1, not a traceback
    assert main([*argv, "--json", str(tmp_path / "v.json")]) == 1
    assert "--json" in capsys.readouterr().err
    assert (tmp_path / "v.json").read_text() == "old json"
    assert main(argv) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert "--report" in line and "No space left" in line and "Traceback" not in err
    assert (report / "report.md").read_text() == "old report"
    assert _temporaries(tmp_path) == []
    monkeypatch.setattr(os, "replace", real_replace)
    assert main([*argv, "--json", str(tmp_path / "v.json")]) == 0
    assert json.loads((tmp_path / "v.json").read_text())[0]["id"] == _CLAIM
    assert (report / "report.md").read_text().startswith("# refdml verify")
    assert _temporaries(tmp_path) == []
