"""The Dask path of refdml reproduce: a grid split over a LocalCluster gives the numbers of
one process, a killed worker's task is re-run, a failing task is reported with its
traceback while the others finish, and the cache resumes a run."""

import importlib.util
import json
import subprocess
import sys

import pytest
from numpy.testing import assert_allclose, assert_array_equal

from refdml.reproduce import EXPERIMENTS, Comparison, Experiment, Task, run_tasks
from refdml.reproduce._report import evaluate_experiment, summary_lines

pytest.importorskip("distributed")


def _toy(seeds=4, **settings):
    return [Task.make("toy", method, s, settings) for method in ("a", "b") for s in range(seeds)]


def test_cluster_gives_the_numbers_of_one_process_and_reruns_a_killed_workers_task(tmp_path):
    marker = tmp_path / "killed"
    tasks = _toy(kill_marker=str(marker), kill_seed=1)
    # a real training task too: bit-identical numbers in a worker process and here
    tasks.append(Task.make("tokens", "gsp", 0, {
        "n_train_per_class": 8, "n_val_per_class": 4, "n_test_per_class": 4, "dim": 8,
        "embedding_dim": 8,
        "n_prototypes": 4, "mu": 0.3, "inverse_temperature": 5.0, "loss": "contrastive",
        "lr": 1e-3, "epochs": 1}))
    probe = Task.make("toy", "a", 0, {"probe_environ": ["MALLOC_TRIM_THRESHOLD_",
                                                        "OPENBLAS_NUM_THREADS",
                                                        "NUMBA_NUM_THREADS"]})
    distributed = run_tasks(tasks + [probe], workers=2, progress=False)
    assert marker.exists(), "the toy task should have killed its worker once"
    assert not distributed.failures
    # the workers' environment: BLAS and Numba at one thread, glibc's own malloc thresholds
    # (Dask's MALLOC_TRIM_THRESHOLD_ made training tasks 1.6x slower: page faults)
    assert distributed.results[probe]["metrics"] == {
        "value": run_tasks([probe], in_process=True, progress=False).results[probe]
        ["metrics"]["value"], "environ:MALLOC_TRIM_THRESHOLD_": 0.0,
        "environ:OPENBLAS_NUM_THREADS": 1.0, "environ:NUMBA_NUM_THREADS": 1.0}
    local = run_tasks(tasks, in_process=True, progress=False)
    assert not local.failures
    assert set(distributed.results) - {probe} == set(local.results) == set(tasks)
    for task in tasks:
        assert distributed.results[task]["metrics"] == local.results[task]["metrics"], task
        for key, curve in local.results[task]["curves"].items():   # NaN == NaN here
            assert_array_equal(distributed.results[task]["curves"][key], curve)


def test_an_existing_scheduler_runs_the_grid(tmp_path):
    """``--scheduler ADDRESS``: the tasks go to a cluster started elsewhere (here a
    LocalCluster on loopback, its scheduler's tcp:// address) and give the numbers of one
    process; the cluster is left running (it is not ours to close)."""
    from distributed import Client, LocalCluster

    tasks = _toy(seeds=3)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster:
        address = cluster.scheduler_address
        assert address.startswith("tcp://127.0.0.1:")
        remote = run_tasks(tasks, scheduler=address, progress=False, cache_dir=tmp_path)
        with Client(address) as client:                  # still up after the run
            assert len(client.scheduler_info()["workers"]) == 1
    local = run_tasks(tasks, in_process=True, progress=False)
    assert not remote.failures and remote.computed == set(tasks)
    for t in tasks:
        assert remote.results[t]["metrics"] == local.results[t]["metrics"]


def test_failed_task_is_reported_with_its_traceback_and_the_others_finish(tmp_path):
    tasks = _toy(fail_seed=2)
    out = run_tasks(tasks, workers=2, progress=False, cache_dir=tmp_path / "cache")
    failed = [t for t in tasks if t.seed == 2]
    assert set(out.failures) == set(failed)
    for t in failed:
        assert "toy task failed on purpose (seed 2)" in out.failures[t]
        assert "Traceback" in out.failures[t] and "_toy" in out.failures[t]
    assert set(out.results) == set(tasks) - set(failed)
    # failures are not cached: a second run retries exactly them
    again = run_tasks(tasks, in_process=True, progress=False, cache_dir=tmp_path / "cache")
    assert again.cached == set(out.results) and set(again.failures) == set(failed)


def test_cache_resumes_and_a_second_run_computes_nothing(tmp_path):
    tasks = _toy(seeds=3)
    first = run_tasks(tasks[:4], in_process=True, progress=False, cache_dir=tmp_path)  # "interrupted"
    assert first.computed == set(tasks[:4])
    second = run_tasks(tasks, in_process=True, progress=False, cache_dir=tmp_path)
    assert second.cached == set(tasks[:4]) and second.computed == set(tasks[4:])
    third = run_tasks(tasks + tasks, in_process=True, progress=False, cache_dir=tmp_path)
    assert third.computed == set() and third.cached == set(tasks)
    for t in tasks:
        assert third.results[t]["metrics"] == second.results[t]["metrics"]
    assert len(list(tmp_path.glob("*.json"))) == len(tasks)


def test_workers_must_be_positive():
    with pytest.raises(ValueError, match="workers == 0"):
        run_tasks(_toy(seeds=1), workers=0, progress=False)


def test_experiment_verdict_from_toy_runs():
    experiment = Experiment(
        "toy.shift", "none", "b is higher than a", "toy",
        {"a": ("a", {}), "b": ("a", {"shift": 5.0}), "c": ("a", {"shift": -5.0})},
        (Comparison("b", "a", "value", +1), Comparison("c", "a", "value", +1)),
        metrics=("value",))
    tasks = [t for ts in experiment.tasks("full", seeds=4).values() for t in ts]
    out = run_tasks(tasks, in_process=True, progress=False)
    # the default mode judges (a quick run is a smoke run: test_reproduce_gate.py)
    result = evaluate_experiment(experiment, "full", out, seeds=4)
    b, c = result["comparisons"]
    assert_allclose([b["effect"], c["effect"]], [5.0, -5.0], rtol=1e-12)   # same draws, shifted
    assert (b["verdict"], c["verdict"], result["verdict"]) == (
        "reproduced", "not-reproduced", "not-reproduced")
    # each comparison's line is followed by one saying why (its interval and p-value)
    head, first, why, second, _ = summary_lines(result)
    assert "p = 0 (Holm 0)" in why
    # The experiment's verdict has a line of its own; each comparison line carries its own
    # verdict (the first comparison reproduces although the experiment does not).
    assert head.split()[:2] == ["toy.shift", "not-reproduced"]
    assert first.split()[0] == "reproduced" and "b > a" in first and "+5.0000" in first
    assert second.split()[0] == "not-reproduced" and "-5.0000" in second


def test_a_setting_chosen_on_the_selection_metric_decides_the_comparison():
    from refdml.reproduce import Selection

    # toy: value = a draw fixed by (seed, method) + shift; every candidate sees the same draws
    experiment = Experiment(
        "toy.select", "none", "b is higher than a", "toy",
        {"a": ("a", {}), "b": ("a", {})}, (Comparison("b", "a", "value", +1),),
        metrics=("value",), select={"b": Selection("shift", (-1.0, 3.0, 1.0, 3), "value")})
    grid = experiment.tasks("full", seeds=3)
    assert list(grid) == ["a", "b [shift=-1.0]", "b [shift=3.0]", "b [shift=1.0]", "b [shift=3]"]
    out = run_tasks([t for ts in grid.values() for t in ts], in_process=True, progress=False)
    result = evaluate_experiment(experiment, "full", out, seeds=3)
    b = result["runs"]["b"]
    # the best mean wins; of the tied 3.0 and 3 the earlier; the run carries its settings
    assert b["selection"]["chosen"] == 3.0 and isinstance(b["selection"]["chosen"], float)
    assert b["settings"]["shift"] == 3.0
    assert [c["setting"] for c in b["selection"]["candidates"]] == [-1.0, 3.0, 1.0, 3]
    means = [c["validation"] - result["runs"]["a"]["summary"]["value"]["mean"]
             for c in b["selection"]["candidates"]]
    assert_allclose(means, [-1.0, 3.0, 1.0, 3.0], rtol=1e-12)
    assert_allclose(result["comparisons"][0]["effect"], 3.0, rtol=1e-12)
    assert result["comparisons"][0]["verdict"] == "reproduced"
    # a candidate's failed seeds leave its mean to the others; no finished seed: never chosen
    failing = Experiment(
        "toy.select2", "none", "-", "toy", {"a": ("a", {}), "b": ("a", {})},
        (Comparison("b", "a", "value", +1),), metrics=("value",),
        select={"b": Selection("shift", (1.0, 2.0), "value")})
    grid = failing.tasks("quick", seeds=2)
    tasks = [t for ts in grid.values() for t in ts]
    out = run_tasks(tasks, in_process=True, progress=False)
    for t in grid["b [shift=2.0]"]:
        out.results.pop(t)
        out.failures[t] = "Traceback: on purpose"
    result = evaluate_experiment(failing, "quick", out, seeds=2)
    assert result["runs"]["b"]["selection"]["chosen"] == 1.0
    assert [f["run"] for f in result["failures"]] == ["b [shift=2.0]"] * 2


def test_every_experiment_names_known_runs_and_studies():
    from refdml.reproduce._studies import STUDIES

    for e in EXPERIMENTS.values():
        assert e.study in STUDIES
        for c in e.comparisons:
            assert c.run in e.runs and c.baseline in e.runs and c.direction in (1, -1)
        assert set(e.select) <= set(e.runs)
        # the glyph experiments' runs cost 15-85 s of CPU: 3 / 4 seeds (docs/reproduce.md)
        assert e.seeds["quick"] >= 3 and e.seeds["full"] > e.seeds["quick"]
        assert set(e.scales) <= {"small", "large"} and e.scales


def _cli(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "refdml.cli", "reproduce", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


def test_cli_rejects_bad_flags_with_named_errors(tmp_path):
    from refdml.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--workers", "0"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["reproduce", "--seeds", "1"])
    assert exc.value.code == 2
    r = _cli(tmp_path, "--only", "gsp.synthetic", "nosuch")
    assert r.returncode == 2 and "--only nosuch matches no experiment" in r.stderr
    assert "wdml.losses" in r.stderr
    r = _cli(tmp_path, "--workers", "0")
    assert r.returncode == 2 and "--workers == 0, must be an integer >= 1" in r.stderr


def test_cli_scale_and_device_flags(tmp_path):
    """An experiment of another scale is refused by name (exit 2); --scale large runs it
    (here from an empty cache: nothing computed); a bad --scale is argparse's exit 2;
    --device cuda without CuPy says so and exits 2 before any work."""
    r = _cli(tmp_path, "--only", "gsp.glyph_collage")
    assert r.returncode == 2 and "--only gsp.glyph_collage: not run at --scale small" in r.stderr
    r = _cli(tmp_path, "--quick", "--scale", "large", "--only", "gsp.glyph_collage",
             "--cached-only", "--cache", "cache")
    assert r.returncode == 0, r.stderr
    # 6 runs (gap, gsp, gsp_zsr x 2 losses) x 2 candidates of their grids x 3 seeds
    assert "(quick mode, large scale, cpu): 1 experiment(s), 36 task(s)" in r.stdout
    r = _cli(tmp_path, "--scale", "huge")
    assert r.returncode == 2 and "--scale" in r.stderr
    if importlib.util.find_spec("cupy") is None:
        r = _cli(tmp_path, "--device", "cuda", "--only", "gsp.synthetic")
        assert r.returncode == 2 and "--device cuda needs CuPy" in r.stderr
    # the large scale changes the glyph settings and nothing else
    from refdml.reproduce._experiments import settings_for

    for study in ("tokens", "collage", "wdml"):
        assert settings_for(study, "full", "large") == settings_for(study, "full")
    assert settings_for("glyph", "quick", "large")["max_classes"] is None
    assert settings_for("glyph", "full", "large")["glyph_size"] == 28
    with pytest.raises(ValueError, match="scale == 'huge'"):
        settings_for("glyph", "full", "huge")
    grid = EXPERIMENTS["gsp.glyphs"].tasks("quick", 2, device="cuda")
    assert all(t.config["device"] == "cuda" for ts in grid.values() for t in ts)
    assert all("device" not in t.config
               for ts in EXPERIMENTS["gsp.glyphs"].tasks("quick", 2).values() for t in ts)


def test_cli_list(tmp_path):
    r = _cli(tmp_path, "--list")
    assert r.returncode == 0
    assert [line.split()[0] for line in r.stdout.splitlines()] == list(EXPERIMENTS)


def test_cli_json_and_report_from_the_cache(tmp_path):
    # Fill the cache with the experiment's tasks at 2 seeds computed here, then the CLI
    # (in a subprocess, cwd tmp_path) reads them: no training in the test's time budget.
    from refdml.reproduce._cache import TaskCache

    experiment = EXPERIMENTS["gsp.synthetic"]
    cache = TaskCache(tmp_path / "cache")
    grid = experiment.tasks("quick", seeds=2)
    for label, tasks in grid.items():
        for t in tasks:
            # a run chosen on validation has a grid label per candidate: "gsp [mu=0.3]"
            shift = 0.1 if label.split(" [")[0] == "gsp" else 0.0
            # untrained_test_map_at_r: the competence gate's reference (both runs learned)
            cache.store(t, {"metrics": {"test_map_at_r": 0.5 + shift + 0.01 * t.seed,
                                        "untrained_test_map_at_r": 0.1,
                                        "background_mass": 0.5 - 2 * shift},
                            "curves": {"train_loss": [float("nan"), 1.0],
                                       "test_map_at_r": [0.4, 0.5]},
                            "artefacts": {}, "seconds": 1.0})
    r = _cli(tmp_path, "--quick", "--only", "gsp.synthetic", "--seeds", "2", "--cache", "cache",
             "--json", "out/r.json", "--report", "out/report")
    assert r.returncode == 0, r.stderr
    stored = sum(map(len, grid.values()))
    # a quick run is a smoke run: its numbers, never a verdict
    assert "gsp.synthetic           smoke" in r.stdout
    assert f"0 task(s) computed, {stored} from the cache" in r.stdout
    payload = json.loads((tmp_path / "out/r.json").read_text())
    (result,) = payload["experiments"]
    assert result["verdict"] == "smoke"
    assert result["comparisons"][0]["interval_verdict"] == "reproduced"
    assert_allclose(result["comparisons"][0]["effect"], 0.1, rtol=1e-12)
    text = (tmp_path / "out/report/README.md").read_text()
    assert "| `gsp.synthetic` | test_map_at_r: gsp > gap | +0.1000" in text
    assert "| seeds / needed | baseline learned? | method learned? | plateau |" in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out/report/gsp_synthetic_bars.png").stat().st_size > 0
    else:  # the test extra has no matplotlib: the report says how to get the figures
        assert not (tmp_path / "out/report/gsp_synthetic_bars.png").exists()
        assert 'figures need matplotlib, pip install "refdml[plot]"' in text


def test_cached_only_computes_nothing(tmp_path):
    tasks = _toy(seeds=2)
    run_tasks(tasks[:1], in_process=True, progress=False, cache_dir=tmp_path)
    out = run_tasks(tasks, progress=False, cache_dir=tmp_path, compute=False)
    assert out.cached == {tasks[0]} and out.missing == set(tasks[1:]) and not out.computed


def test_curve_means_run_over_the_seeds_that_trained_each_epoch():
    """A run stopped early (``patience``) has a shorter curve; ``train_loss`` is NaN at 0;
    an epoch fewer than half the seeds trained is left out."""
    import numpy as np

    from refdml.reproduce._report import _mean_over_seeds

    mean = _mean_over_seeds([[np.nan, 4.0, 2.0, 1.0], [np.nan, 2.0], [np.nan, 3.0, 3.0]])
    # epoch 1: all three seeds; 2: two of three; 3: one of three, under half: not shown
    np.testing.assert_array_equal(mean[1:3], [3.0, 2.5])
    assert np.isnan(mean[0]) and np.isnan(mean[3])
