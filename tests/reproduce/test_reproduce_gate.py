"""The competence gate in refdml reproduce's results: a comparison whose baseline did not
learn gets the verdict ``baseline-did-not-learn`` (its effect still shown), the experiment's
verdict counts only the judged comparisons, a missing untrained value is an error, and the
lines, the JSON, the report and the curves show the gate.

The per-seed metrics are written by hand into an :class:`Outcome` (no training): with 3
seeds the bootstrap interval of a mean is [smallest, largest] value (1/27 > 2.5 %, see
tests/reproduce/test_reproduce_stats.py), so every interval below is read off the numbers."""

import json
import math

import pytest
from numpy.testing import assert_allclose

from refdml.reproduce import Comparison, Experiment, Outcome, Selection
from refdml.reproduce._report import (
    _curves,
    _untrained_level,
    evaluate_experiment,
    summary_header,
    summary_lines,
    write_json,
    write_report,
)
from refdml.reproduce._stats import BASELINE_DID_NOT_LEARN, NOT_REPRODUCED, REPRODUCED

GATE = "test_map_at_r"
SEEDS = 3
UNTRAINED = [0.015, 0.016, 0.017]          # the untrained model's test MAP@R, per seed
#: each run's gain over the untrained model, per seed
GAINS = {
    "good": [0.03, 0.04, 0.05],            # learned: every seed gained (low end 0.03)
    "flat": [0.002, -0.001, 0.002],        # did not learn: low end -0.001
    "method": [0.06, 0.07, 0.09],
    "worse": [0.01, 0.02, 0.02],           # learned, below "good" on every seed
}


def _experiment(comparisons, runs=("good", "flat", "method", "worse"), **kwargs):
    return Experiment("toy.gate", "none", "method beats its baselines", "toy",
                      {r: ("a", {"tag": r}) for r in runs}, tuple(comparisons),
                      metrics=(GATE,), **kwargs)


def _metrics(gains, seed, *, untrained=True):
    m = {GATE: UNTRAINED[seed] + gains[seed], "val_map_at_r": UNTRAINED[seed] + gains[seed]}
    if untrained:
        m[f"untrained_{GATE}"] = UNTRAINED[seed]
    return m


def _outcome(experiment, metrics_of, seeds=SEEDS):
    """``metrics_of(grid label, seed)`` -> the metrics dict of that task."""
    out = Outcome()
    for name, tasks in experiment.tasks("quick", seeds).items():
        for t in tasks:
            m = metrics_of(name, t.seed)
            out.results[t] = {"metrics": m, "seconds": 1.0,
                              "curves": {GATE: [UNTRAINED[t.seed], m[GATE]]}}
    return out


def _evaluate(experiment, **kwargs):
    out = _outcome(experiment, lambda name, s: _metrics(GAINS[name], s, **kwargs))
    return evaluate_experiment(experiment, "quick", out, seeds=SEEDS)


def test_a_baseline_that_did_not_learn_is_not_judged():
    experiment = _experiment([Comparison("method", "good", GATE, +1, gate=GATE),
                              Comparison("method", "flat", GATE, +1, gate=GATE)])
    result = _evaluate(experiment)
    judged, gated = result["comparisons"]
    # method - good = (0.03, 0.03, 0.04): interval [0.03, 0.04], reproduced
    assert judged["verdict"] == REPRODUCED and judged["gate"]["learned"]
    assert_allclose([judged["gate"]["gain"], judged["gate"]["low"], judged["gate"]["high"]],
                    [0.04, 0.03, 0.05], rtol=0, atol=1e-12)
    # method - flat = (0.058, 0.071, 0.088): it would read reproduced; the gate says no
    assert gated["verdict"] == BASELINE_DID_NOT_LEARN
    assert_allclose([gated["effect"], gated["low"], gated["high"]],
                    [0.217 / 3, 0.058, 0.088], rtol=0, atol=1e-12)
    g = gated["gate"]
    assert g["run"] == "flat" and g["metric"] == GATE and not g["learned"] and g["n"] == 3
    assert_allclose([g["trained"], g["untrained"], g["gain"], g["low"], g["high"]],
                    [0.016 + 0.001, 0.016, 0.001, -0.001, 0.002], rtol=0, atol=1e-12)
    # the method's own gate is reported beside it (it does not gate)
    m = gated["method_gate"]
    assert m["run"] == "method" and m["learned"]
    assert_allclose(m["gain"], 0.22 / 3, rtol=0, atol=1e-12)
    # the experiment's verdict counts only the judged comparison
    assert result["verdict"] == REPRODUCED


@pytest.mark.parametrize("pairs, expected", [
    ((("method", "flat"),), BASELINE_DID_NOT_LEARN),                  # nothing judged
    ((("worse", "good"), ("method", "flat")), NOT_REPRODUCED),        # judged: contradicted
    ((("method", "good"), ("method", "worse")), REPRODUCED),
])
def test_the_experiment_verdict_counts_only_judged_comparisons(pairs, expected):
    experiment = _experiment([Comparison(a, b, GATE, +1, gate=GATE) for a, b in pairs])
    assert _evaluate(experiment)["verdict"] == expected


def test_no_gate_keeps_the_old_verdict_and_adds_no_gate_record():
    experiment = _experiment([Comparison("method", "flat", GATE, +1)])
    result = _evaluate(experiment, untrained=False)
    (c,) = result["comparisons"]
    assert c["verdict"] == REPRODUCED and "gate" not in c and result["verdict"] == REPRODUCED


def test_missing_untrained_values_are_an_error_naming_run_and_metric():
    experiment = _experiment([Comparison("method", "flat", GATE, +1, gate=GATE)])
    with pytest.raises(ValueError, match=r"run 'flat': metric 'untrained_test_map_at_r' "
                                         r"missing for seed\(s\) \[0, 1, 2\]"):
        _evaluate(experiment, untrained=False)
    # one seed without it is enough to refuse
    out = _outcome(experiment, lambda name, s: _metrics(GAINS[name], s, untrained=s != 1))
    with pytest.raises(ValueError, match=r"seed\(s\) \[1\]"):
        evaluate_experiment(experiment, "quick", out, seeds=SEEDS)


def test_a_baseline_with_no_finished_seed_did_not_learn():
    experiment = _experiment([Comparison("method", "flat", GATE, +1, gate=GATE)])
    out = _outcome(experiment, lambda name, s: _metrics(GAINS[name], s))
    for t in experiment.tasks("quick", SEEDS)["flat"]:
        out.results.pop(t)
        out.failures[t] = "Traceback: on purpose"
    result = evaluate_experiment(experiment, "quick", out, seeds=SEEDS)
    (c,) = result["comparisons"]
    assert c["verdict"] == BASELINE_DID_NOT_LEARN and c["gate"]["n"] == 0
    assert len(result["failures"]) == SEEDS


def test_the_gate_is_on_the_selected_candidate_and_the_paper_setting_is_reported(tmp_path):
    """The baseline chooses ``lr`` on validation: 2 has the better validation MAP@R and did
    not learn against its untrained model (1 did): the gate is the chosen one's."""
    experiment = _experiment([Comparison("method", "base", GATE, +1, gate=GATE)],
                             runs=("method", "base"),
                             select={"base": Selection("lr", (1, 2), paper=0.5),
                                     "method": Selection("mu", (0.1, 0.2))})
    candidate = {"base [lr=1]": "worse", "base [lr=2]": "flat",
                 "method [mu=0.1]": "method", "method [mu=0.2]": "good"}

    def metrics(name, s):
        m = _metrics(GAINS[candidate[name]], s)
        if name == "base [lr=2]":   # the best validation score, a test score that did not learn
            m["val_map_at_r"] = 1.0
        return m

    result = evaluate_experiment(experiment, "quick", _outcome(experiment, metrics),
                                 seeds=SEEDS)
    base = result["runs"]["base"]
    assert base["selection"]["chosen"] == 2 and base["selection"]["paper"] == 0.5
    assert result["runs"]["method"]["selection"]["paper"] is None
    (c,) = result["comparisons"]
    assert c["verdict"] == BASELINE_DID_NOT_LEARN and not c["gate"]["learned"]
    assert_allclose(c["gate"]["gain"], 0.001, rtol=0, atol=1e-12)
    lines = summary_lines(result)
    assert "chosen on validation: method mu=0.1 (paper: not stated), base lr=2 (paper: 0.5)" \
        in lines[-1]
    payload = {"mode": "quick", "wall_seconds": 1.0, "workers": "in this process",
               "code_version": "x", "tasks": {"computed": 12, "cached": 0},
               "experiments": [result]}
    text = write_report(tmp_path, payload).read_text()
    assert "- `base`: `lr` = 2 (the paper's: 0.5), the best mean val_map_at_r of 1: " in text
    assert "- `method`: `mu` = 0.1 (the paper's: not stated)" in text


def test_lines_json_and_report_show_the_gate(tmp_path):
    experiment = _experiment([Comparison("method", "good", GATE, +1, gate=GATE),
                              Comparison("method", "flat", GATE, +1, gate=GATE)])
    result = _evaluate(experiment)
    lines = summary_lines(result)
    assert lines[0].split()[:2] == ["toy.gate", REPRODUCED]
    assert lines[2].split()[0] == BASELINE_DID_NOT_LEARN
    assert lines[3].strip() == ("baseline flat did not learn: test_map_at_r gain +0.0010 "
                                "[-0.0010, +0.0020] (0.0170 vs untrained 0.0160, 3 seeds)")
    # the header's columns line up with the comparisons' lines
    head = summary_header()
    assert head[1].index("comparison") == lines[1].index("test_map_at_r: method > good")
    assert head[0].index("verdict") == lines[0].index(REPRODUCED)
    # JSON: the gate survives the round trip, and the lines read the same from it
    payload = {"mode": "quick", "wall_seconds": 1.0, "workers": "in this process",
               "code_version": "x", "tasks": {"computed": 12, "cached": 0},
               "experiments": [result]}
    write_json(tmp_path / "r.json", payload)
    loaded = json.loads((tmp_path / "r.json").read_text())["experiments"][0]
    assert loaded["comparisons"][1]["gate"]["seeds"] == [0, 1, 2]
    assert loaded["comparisons"][1]["method_gate"]["learned"] is True
    assert summary_lines(loaded) == lines
    text = write_report(tmp_path / "report", payload).read_text()
    assert "| seeds to decide | baseline learned? |" in text
    assert ("| `toy.gate` | baseline-did-not-learn | test_map_at_r: method > flat | +0.0723 "
            "| [+0.0580, +0.0880] | 3 | - | - | no: gain +0.0010 [-0.0010, +0.0020] |") in text
    assert ": method > good | +0.0333 | [+0.0300, +0.0400] | 3 | - | - | gain +0.0400 " \
           "[+0.0300, +0.0500] |" in text
    assert f"- `{BASELINE_DID_NOT_LEARN}`: not judged" in text
    # the gate table: both baselines and the method, once each
    assert "| `flat` | baseline | test_map_at_r | 0.0170 | 0.0160 | +0.0010 [-0.0010, " \
           "+0.0020] | 3 | no |" in text
    assert text.count("| `method` | method | test_map_at_r |") == 1


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

    experiment = _experiment([Comparison("method", "flat", GATE, +1, gate=GATE)])
    result = _evaluate(experiment)
    drawn = {}
    monkeypatch.setattr(report, "save_figure", lambda fig, path, **kw: drawn.update(fig=fig))
    assert _curves(result, tmp_path / "curves.png")
    ax = drawn["fig"].axes[0]
    solid = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() == "-"}
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert set(solid) == set(experiment.runs) and len(dashed) == len(experiment.runs)
    # every run's untrained level is the same here (the mean of UNTRAINED), in its colour
    assert sorted(line.get_color() for line in dashed) == sorted(
        line.get_color() for line in solid.values())
    for line in dashed:
        assert_allclose(line.get_ydata(), [0.016, 0.016], rtol=1e-12)
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


def test_the_results_table_shows_the_gate_and_a_dash_for_json_without_one(tmp_path):
    """scripts/docs_pages.py: a gated-out verdict carries the baseline's gain; the column
    "baseline learned?" appears once a run's JSON has gates, with "—" for a run without."""
    pages = _docs_pages()
    experiment = _experiment([Comparison("method", "good", GATE, +1, gate=GATE),
                              Comparison("method", "flat", GATE, +1, gate=GATE)])
    payload = {"mode": "quick", "wall_seconds": 1.0, "workers": "in this process",
               "code_version": "x", "tasks": {"computed": 12, "cached": 0},
               "experiments": [_evaluate(experiment)]}
    write_json(tmp_path / "r.json", payload)
    new = json.loads((tmp_path / "r.json").read_text())
    old = json.loads(json.dumps(new))                   # the same run before the gate
    for c in old["experiments"][0]["comparisons"]:
        del c["gate"], c["method_gate"]
        c["verdict"] = REPRODUCED
    assert pages.reproduce_header(old, old) == pages.REPRODUCE_HEADER
    assert [len(row) for row in pages.reproduce_rows(old, old)] == [6, 6]
    assert pages.reproduce_header(new, old) == pages.REPRODUCE_HEADER + [pages.GATE_HEADER]
    good, flat = pages.reproduce_rows(new, old)
    assert good[3] == REPRODUCED and good[6] == "yes +0.040 [+0.030, +0.050] / —"
    assert flat[2:6] == ["+0.072 [+0.058, +0.088]",
                         "baseline-did-not-learn: baseline gain +0.001 [-0.001, +0.002]",
                         "+0.072 [+0.058, +0.088]", REPRODUCED]
    assert flat[6] == "no: +0.001 [-0.001, +0.002] / —"
    table = pages.reproduce_table({**new, "scale": "small", "device": "cpu",
                                   "task_cpu_seconds": 1.0},
                                  {**old, "scale": "small", "device": "cpu",
                                   "task_cpu_seconds": 1.0})
    assert f"| {pages.GATE_HEADER} |" in table


def test_a_method_without_untrained_values_is_reported_as_not_measured():
    """The method's gate only informs: a method run without ``untrained_<gate>`` gets
    ``method_gate`` None (the report leaves its row out) instead of an error at the end of
    a long run; the baseline's decides and stays strict (the test above)."""
    experiment = _experiment([Comparison("method", "good", GATE, +1, gate=GATE)])
    out = _outcome(experiment, lambda name, s: _metrics(GAINS[name], s,
                                                        untrained=name != "method"))
    result = evaluate_experiment(experiment, "quick", out, seeds=SEEDS)
    (c,) = result["comparisons"]
    assert c["method_gate"] is None and c["gate"]["learned"] and c["verdict"] == REPRODUCED
    assert "| `method` | method |" not in "\n".join(_report_lines(result))
    assert "| `good` | baseline |" in "\n".join(_report_lines(result))


def _report_lines(result):
    from refdml.reproduce._report import _gate_lines

    return _gate_lines(result)
