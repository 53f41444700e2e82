"""The verdicts in refdml reproduce's results: gates on both sides (significant and large
enough), the plateau, power, Holm's adjustment over an experiment's comparisons, the smoke
run, every candidate kept, and the lines, JSON, report, trust table and curves that show
them.

The per-seed metrics are written by hand into an :class:`Outcome` (no training). The
differences are built so that each verdict is clear-cut; where a number is asserted it is
recomputed here with SciPy (t interval, t-test) or by hand (Holm)."""

import json
import math

import numpy as np
import pytest
from numpy.testing import assert_allclose
from scipy import stats as sps

from refdml.reproduce import Comparison, Experiment, Outcome, Selection
from refdml.reproduce._report import (
    _curves,
    _overall,
    _untrained_level,
    evaluate_experiment,
    summary_header,
    summary_lines,
    trust_table,
    write_json,
    write_report,
)
from refdml.reproduce.stats import (
    BASELINE_DID_NOT_LEARN,
    INCONCLUSIVE,
    METHOD_DID_NOT_LEARN,
    NOT_JUDGED,
    NOT_REPRODUCED,
    REPRODUCED,
    SMOKE,
    STILL_RISING,
    UNDERPOWERED,
)

GATE = "test_map_at_r"
SEEDS = 4
UNTRAINED = np.array([0.015, 0.016, 0.017, 0.018])    # the untrained model's test MAP@R
E = np.array([0.0, 0.001, -0.001, 0.0005])            # a small per-seed wobble
#: each run's gain over the untrained model, per seed
GAINS = {
    "good": 0.06 + E,                                 # learned
    "flat": np.array([0.002, -0.001, 0.002, 0.001]),  # did not learn: not significant, tiny
    "method": 0.10 + 2 * E,                           # learned; method - good = 0.04 + E
    "tiny": 0.006 + E,                                # significant, below the minimum gain
    "worse": 0.03 + E,                                # learned, below "good" on every seed
    "noisy": 0.08 + np.array([0.05, -0.03, 0.04, -0.01]),   # learned; noisy against good
    "nudge1": 0.06 + E + np.array([0.001, 0.005, 0.002, 0.004]),
    "nudge2": 0.06 + E + np.array([0.004, 0.002, 0.005, 0.001]),
}


def _experiment(comparisons, runs=tuple(GAINS), **kwargs):
    return Experiment("toy.gate", "none", "method beats its baselines", "toy",
                      {r: ("a", {"tag": r}) for r in runs}, tuple(comparisons),
                      metrics=(GATE,), **kwargs)


def _gated(a, b, metric=GATE, direction=+1):
    return Comparison(a, b, metric, direction, gate=GATE)


def _metrics(name, seed, *, untrained=True, rising=()):
    m = {GATE: UNTRAINED[seed] + GAINS[name][seed],
         "val_map_at_r": UNTRAINED[seed] + GAINS[name][seed],
         "still_rising": 1.0 if seed in rising else 0.0}
    if untrained:
        m[f"untrained_{GATE}"] = UNTRAINED[seed]
    return m


def _outcome(experiment, metrics_of, seeds=SEEDS, mode="full"):
    """``metrics_of(grid label, seed)`` -> the metrics dict of that task."""
    out = Outcome()
    for name, tasks in experiment.tasks(mode, seeds).items():
        for t in tasks:
            m = metrics_of(name, t.seed)
            out.results[t] = {"metrics": m, "seconds": 1.0,
                              "curves": {GATE: [UNTRAINED[t.seed], m[GATE]]}}
    return out


def _evaluate(experiment, mode="full", **kwargs):
    out = _outcome(experiment, lambda name, s: _metrics(name, s, **kwargs), mode=mode)
    return evaluate_experiment(experiment, mode, out, seeds=SEEDS)


def _payload(result, mode="full"):
    return {"mode": mode, "wall_seconds": 1.0, "workers": "in this process",
            "code_version": "x", "tasks": {"computed": 12, "cached": 0},
            "experiments": [result]}


# --------------------------------------------------------------------------- gates
def test_both_runs_are_gated_on_significance_and_size():
    experiment = _experiment([_gated("method", "good"), _gated("method", "flat"),
                              _gated("tiny", "good")])
    judged, no_baseline, no_method = _evaluate(experiment)["comparisons"]
    # method - good = 0.04 + E: the t interval, recomputed with SciPy
    d = 0.04 + E
    assert_allclose([judged["effect"], judged["low"], judged["high"]],
                    [d.mean(), *sps.t.interval(0.95, 3, loc=d.mean(), scale=sps.sem(d))],
                    rtol=1e-9)
    assert judged["verdict"] == REPRODUCED and judged["gate"]["learned"]
    assert judged["method_gate"]["learned"]
    # flat: gains +0.002 -0.001 +0.002 +0.001, neither significant nor 0.02
    g = no_baseline["gate"]
    assert no_baseline["verdict"] == BASELINE_DID_NOT_LEARN and not g["learned"]
    assert not g["significant"] and not g["large_enough"]
    assert_allclose(g["gain"], 0.001, rtol=1e-9)
    # tiny: consistent, significant, but 0.006 < the minimum gain 0.02
    m = no_method["method_gate"]
    assert no_method["verdict"] == METHOD_DID_NOT_LEARN
    assert m["significant"] and not m["large_enough"] and m["run"] == "tiny"
    # a gated-out comparison is left out of the Holm family
    assert judged["family"] == [judged["name"]] and no_baseline["family"] == []


def test_missing_untrained_values_are_an_error_naming_run_and_metric():
    experiment = _experiment([_gated("method", "flat")])
    with pytest.raises(ValueError, match=r"run 'flat': metric 'untrained_test_map_at_r' "
                                         r"missing for seed\(s\) \[0, 1, 2, 3\]"):
        _evaluate(experiment, untrained=False)
    out = _outcome(experiment, lambda name, s: _metrics(name, s, untrained=s != 1))
    with pytest.raises(ValueError, match=r"seed\(s\) \[1\]"):
        evaluate_experiment(experiment, "full", out, seeds=SEEDS)


def test_a_baseline_with_no_finished_seed_did_not_learn():
    experiment = _experiment([_gated("method", "flat")])
    out = _outcome(experiment, lambda name, s: _metrics(name, s))
    for t in experiment.tasks("full", SEEDS)["flat"]:
        out.results.pop(t)
        out.failures[t] = "Traceback: on purpose"
    result = evaluate_experiment(experiment, "full", out, seeds=SEEDS)
    (c,) = result["comparisons"]
    assert c["verdict"] == BASELINE_DID_NOT_LEARN and c["gate"]["n"] == 0
    assert len(result["failures"]) == SEEDS


def test_a_method_without_untrained_values_gates_nothing():
    experiment = _experiment([_gated("method", "good")])
    out = _outcome(experiment, lambda name, s: _metrics(name, s, untrained=name != "method"))
    (c,) = evaluate_experiment(experiment, "full", out, seeds=SEEDS)["comparisons"]
    assert c["method_gate"] is None and c["verdict"] == REPRODUCED


# --------------------------------------------------------------------------- plateau
@pytest.mark.parametrize("rising, expected", [((0, 1, 2), STILL_RISING), ((0, 1), REPRODUCED),
                                              ((), REPRODUCED)])
def test_runs_still_rising_in_most_seeds_are_not_judged(rising, expected):
    experiment = _experiment([_gated("method", "good")])
    (c,) = _evaluate(experiment, rising=rising)["comparisons"]
    assert c["verdict"] == expected
    assert c["rising"] == {"run": [len(rising), SEEDS], "baseline": [len(rising), SEEDS]}


# --------------------------------------------------------------------------- power
def test_a_comparison_with_too_few_seeds_for_its_spread_is_underpowered():
    experiment = _experiment([_gated("noisy", "good")])
    (c,) = _evaluate(experiment)["comparisons"]
    d = GAINS["noisy"] - GAINS["good"]
    # one comparison: the pooled spread is its own, the power level 0.05
    assert_allclose(c["pooled_sd"], d.std(ddof=1), rtol=1e-9)
    assert c["power_alpha"] == 0.05 and c["seeds_needed"] > SEEDS
    assert c["verdict"] == UNDERPOWERED
    # what the interval alone says is kept beside it
    low, _ = sps.t.interval(0.95, 3, loc=d.mean(), scale=sps.sem(d))
    assert c["interval_verdict"] == (REPRODUCED if low > 0 else INCONCLUSIVE)
    assert "needed to detect 0.02" in "\n".join(summary_lines(_evaluate(experiment)))


def test_power_uses_the_pooled_spread_of_the_experiments_comparisons():
    """The quiet comparison alone would have the power; pooled with a noisy one on the same
    metric it does not."""
    alone = _evaluate(_experiment([_gated("method", "good")]))["comparisons"][0]
    both = _evaluate(_experiment([_gated("method", "good"), _gated("noisy", "good")]))
    quiet = both["comparisons"][0]
    sds = [np.std(0.04 + E, ddof=1), np.std(GAINS["noisy"] - GAINS["good"], ddof=1)]
    assert_allclose(quiet["pooled_sd"], math.sqrt((sds[0] ** 2 + sds[1] ** 2) / 2), rtol=1e-9)
    assert quiet["power_alpha"] == 0.025
    assert alone["verdict"] == REPRODUCED and quiet["verdict"] == UNDERPOWERED


# --------------------------------------------------------------------------- Holm
def test_holm_adjusts_over_the_judged_comparisons():
    """Each nudge alone is significant at 5 % (its interval excludes 0), together Holm's
    adjusted p-values are 2 x the smaller and then the running maximum: neither is."""
    experiment = _experiment([_gated("nudge1", "good"), _gated("nudge2", "good")])
    c1, c2 = _evaluate(experiment)["comparisons"]
    p1 = sps.ttest_1samp(GAINS["nudge1"] - GAINS["good"], 0.0).pvalue
    p2 = sps.ttest_1samp(GAINS["nudge2"] - GAINS["good"], 0.0).pvalue
    assert p1 < 0.05 and p2 < 0.05
    assert_allclose([c1["p_value"], c2["p_value"]], [p1, p2], rtol=1e-9)
    small, large = sorted([p1, p2])
    expected = {small: min(1, 2 * small), large: max(min(1, 2 * small), large)}
    assert_allclose([c1["p_adjusted"], c2["p_adjusted"]], [expected[p1], expected[p2]],
                    rtol=1e-9)
    assert c1["interval_verdict"] == c2["interval_verdict"] == REPRODUCED
    assert c1["verdict"] == c2["verdict"] == INCONCLUSIVE
    assert c1["family"] == c2["family"] == [c1["name"], c2["name"]]
    # alone, the same comparison is reproduced
    (alone,) = _evaluate(_experiment([_gated("nudge1", "good")]))["comparisons"]
    assert alone["verdict"] == REPRODUCED and alone["p_adjusted"] == pytest.approx(p1)


def test_the_sign_decides_between_reproduced_and_not():
    experiment = _experiment([_gated("worse", "good"), _gated("worse", "good", direction=-1)])
    claimed_up, claimed_down = _evaluate(experiment)["comparisons"]
    assert claimed_up["verdict"] == NOT_REPRODUCED and claimed_down["verdict"] == REPRODUCED


# --------------------------------------------------------------------------- smoke, overall
def test_a_quick_run_is_a_smoke_run():
    experiment = _experiment([_gated("method", "good"), _gated("method", "flat")])
    result = _evaluate(experiment, mode="quick")
    assert result["verdict"] == SMOKE
    assert [c["verdict"] for c in result["comparisons"]] == [SMOKE, SMOKE]
    # the numbers are still computed and shown
    assert result["comparisons"][0]["interval_verdict"] == REPRODUCED


@pytest.mark.parametrize("verdicts, expected", [
    ([REPRODUCED, REPRODUCED], REPRODUCED),
    ([REPRODUCED, UNDERPOWERED], INCONCLUSIVE),       # half a claim is not a claim
    ([REPRODUCED, NOT_REPRODUCED], NOT_REPRODUCED),
    ([NOT_REPRODUCED, BASELINE_DID_NOT_LEARN], NOT_REPRODUCED),
    ([INCONCLUSIVE, REPRODUCED], INCONCLUSIVE),
    ([BASELINE_DID_NOT_LEARN, BASELINE_DID_NOT_LEARN], BASELINE_DID_NOT_LEARN),
    ([UNDERPOWERED, STILL_RISING], NOT_JUDGED),
    ([], NOT_JUDGED),
])
def test_the_experiment_verdict(verdicts, expected):
    assert _overall(verdicts) == expected
    assert _overall(verdicts, smoke=True) == SMOKE


# --------------------------------------------------------------------------- every candidate
def test_every_candidate_is_kept_and_the_gate_is_the_chosen_ones(tmp_path):
    experiment = _experiment([_gated("method", "base")], runs=("method", "base"),
                             select={"base": Selection("lr", (1, 2), paper=0.5),
                                     "method": Selection("mu", (0.1, 0.2))})
    candidate = {"base [lr=1]": "worse", "base [lr=2]": "flat",
                 "method [mu=0.1]": "method", "method [mu=0.2]": "good"}

    def metrics(name, s):
        m = _metrics(candidate[name], s)
        if name == "base [lr=2]":   # the best validation score, a test score that did not learn
            m["val_map_at_r"] = 1.0
        return m

    result = evaluate_experiment(experiment, "full", _outcome(experiment, metrics),
                                 seeds=SEEDS)
    base = result["runs"]["base"]
    assert base["selection"]["chosen"] == 2 and base["selection"]["paper"] == 0.5
    (c,) = result["comparisons"]
    assert c["verdict"] == BASELINE_DID_NOT_LEARN
    # every candidate keeps its per-seed values: validation, test and untrained
    first, second = base["selection"]["candidates"]
    assert first["setting"] == 1 and set(first["values"]) >= {
        GATE, "val_map_at_r", f"untrained_{GATE}"}
    assert_allclose([first["values"][GATE][s] for s in range(SEEDS)],
                    UNTRAINED + GAINS["worse"], rtol=1e-12)
    assert second["values"]["val_map_at_r"] == {s: 1.0 for s in range(SEEDS)}
    write_json(tmp_path / "r.json", _payload(result))
    loaded = json.loads((tmp_path / "r.json").read_text())["experiments"][0]
    kept = loaded["runs"]["base"]["selection"]["candidates"][0]["values"][GATE]
    assert_allclose([kept[str(s)] for s in range(SEEDS)], UNTRAINED + GAINS["worse"],
                    rtol=1e-12)
    text = write_report(tmp_path / "report", _payload(result)).read_text()
    assert "- `base`: `lr` = 2 (the paper's: 0.5), the best mean val_map_at_r of 1: " in text


# --------------------------------------------------------------------------- what shows it
def test_lines_json_report_and_trust_table(tmp_path):
    experiment = _experiment([_gated("method", "good"), _gated("method", "flat"),
                              _gated("noisy", "good")],
                             deviations=("toy data",))
    result = _evaluate(experiment, rising=(0,))
    lines = summary_lines(result)
    # the noisy comparison's spread, pooled, leaves the quiet one underpowered too
    assert lines[0].split()[:2] == ["toy.gate", NOT_JUDGED]
    assert lines[1].split()[0] == UNDERPOWERED
    text = "\n".join(lines)
    assert ("baseline flat did not learn (not significant, below the minimum gain 0.02): "
            "test_map_at_r gain +0.0010") in text
    head = summary_header()
    assert head[1].index("comparison") == lines[1].index("test_map_at_r: method > good")
    # JSON round trip: the lines read the same from it
    write_json(tmp_path / "r.json", _payload(result))
    loaded = json.loads((tmp_path / "r.json").read_text())["experiments"][0]
    assert summary_lines(loaded) == lines
    assert loaded["deviations"] == ["toy data"]
    table = trust_table({"experiments": [loaded]})
    assert table[0].startswith("| experiment | comparison (claimed) | effect [95% CI] | "
                               "seeds / needed |")
    assert len(table) == 2 + 3 + 4          # header, 3 comparisons, the deviations list
    flat_row = table[3]
    assert "no +0.0010 (n.s., < 0.02)" in flat_row and flat_row.endswith(
        f"| {BASELINE_DID_NOT_LEARN} |")
    assert "rising 1/4, 1/4" in table[2] and table[2].endswith(f"| 1 | {UNDERPOWERED} |")
    assert table[-1] == "- `toy.gate`: toy data."
    report = write_report(tmp_path / "report", _payload(result)).read_text()
    assert table[2] in report
    assert "| `flat` | baseline | test_map_at_r | 0.0175 | 0.0165 | +0.0010" in report
    assert report.count("| `method` | method | test_map_at_r |") == 1


def test_untrained_level_prefers_the_untrained_metric_then_epoch_zero():
    run = {"values": {f"untrained_{GATE}": {0: 0.01, 1: 0.03}},
           "curves": {0: {GATE: [0.5, 0.6]}, 1: {GATE: [0.7, 0.8]}}}
    assert_allclose(_untrained_level(run, GATE), 0.02, rtol=1e-15)
    run["values"] = {}
    assert_allclose(_untrained_level(run, GATE), 0.6, rtol=1e-15)
    run["curves"] = {0: {GATE: [math.nan, 0.6]}}
    assert math.isnan(_untrained_level(run, GATE))


def test_curves_draw_each_runs_untrained_level_in_its_colour(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import refdml.reproduce._report as report

    experiment = _experiment([_gated("method", "flat")], runs=("method", "flat"))
    result = _evaluate(experiment)
    drawn = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path, **kw: drawn.update(fig=fig))
    assert _curves(result, tmp_path / "curves.png")
    ax = drawn["fig"].axes[0]
    solid = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() == "-"}
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert set(solid) == set(experiment.runs) and len(dashed) == len(experiment.runs)
    assert sorted(line.get_color() for line in dashed) == sorted(
        line.get_color() for line in solid.values())
    for line in dashed:
        assert_allclose(line.get_ydata(), [UNTRAINED.mean()] * 2, rtol=1e-12)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend.count("untrained (each run's colour)") == 1
    assert ax.get_xlabel() == "epoch (0: untrained)" and ax.get_ylabel() == GATE


def _docs_pages():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "docs_pages.py"
    spec = importlib.util.spec_from_file_location("docs_pages_for_gate_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_results_page_shows_the_default_runs_trust_table_and_the_quick_smoke(tmp_path):
    pages = _docs_pages()
    experiment = _experiment([_gated("method", "good"), _gated("method", "flat")])
    full = {**_payload(_evaluate(experiment)), "scale": "small", "device": "cpu",
            "task_cpu_seconds": 1.0}
    quick = {**_payload(_evaluate(experiment, mode="quick"), "quick"), "scale": "small",
             "device": "cpu", "task_cpu_seconds": 1.0}
    write_json(tmp_path / "f.json", full)
    full = {**json.loads((tmp_path / "f.json").read_text()), "scale": "small",
            "device": "cpu", "task_cpu_seconds": 1.0}
    page = pages.reproduce_table(quick, full)
    assert "\n".join(trust_table(full)) in page
    assert "The quick run is a smoke run, not evidence: 1 experiments (2 comparisons)" in page
    assert pages.reproduce_rows(full, "toy") == trust_table(full)
    assert pages.reproduce_rows(full, "gsp") == []
