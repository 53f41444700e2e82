"""Turn task results into experiment outcomes, text lines, JSON and a Markdown report.

:func:`evaluate_experiment` collects, for each run of an experiment, its metrics per seed
(a selected run keeps every candidate's), the per-run summaries (mean, std) and each
comparison's :class:`~.stats.Effect`, gates (:func:`~.stats.competence` of the baseline
and of the method on their per-seed ``gate`` and ``untrained_<gate>``) and plateau record,
then judges the experiment's comparisons together (:func:`_judge`: gates, plateau, power,
Holm; :mod:`refdml.reproduce.stats` gives the rules) and gives the experiment's verdict
(:func:`_overall`). Failed tasks simply leave their seed out (the comparison pairs the
seeds both runs have) and are listed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from refdml._io import save_figure, write_json_atomic, write_text_atomic
from refdml.reproduce._experiments import Experiment
from refdml.reproduce.stats import (
    ALPHA,
    BASELINE_DID_NOT_LEARN,
    INCONCLUSIVE,
    JUDGED,
    METHOD_DID_NOT_LEARN,
    NOT_JUDGED,
    NOT_REPRODUCED,
    REPRODUCED,
    SMOKE,
    STILL_RISING,
    UNDERPOWERED,
    VERDICT_MEANINGS,
    VERDICTS,
    bound_text,
    compare,
    competence,
    gate_text,
    holm,
    pooled_sd,
    seeds_needed,
    summarise,
)

__all__ = ["evaluate_experiment", "is_report_folder", "summary_header", "summary_lines",
           "trust_table", "write_json", "write_report"]

_TITLE = "# refdml reproduce"

#: Width of the verdict column of the printed lines (the longest verdict and two spaces).
_VERDICT_WIDTH = max(map(len, VERDICTS)) + 2


def _overall(verdicts: list[str], smoke: bool = False) -> str:
    """The experiment's verdict over its comparisons' verdicts: ``smoke`` for a quick run;
    ``not-reproduced`` when a judged comparison contradicts the claim; ``reproduced`` only
    when every comparison was judged and reproduced (a claim is not reproduced by the part
    of it that could be judged); when none was judged, their common reason or
    ``not-judged``; else ``inconclusive``."""
    if smoke:
        return SMOKE
    judged = [v for v in verdicts if v in JUDGED]
    if not judged:
        return verdicts[0] if verdicts and len(set(verdicts)) == 1 else NOT_JUDGED
    if any(v == NOT_REPRODUCED for v in judged):
        return NOT_REPRODUCED
    if len(judged) == len(verdicts) and all(v == REPRODUCED for v in judged):
        return REPRODUCED
    return INCONCLUSIVE


def _untrained_metric(gate: str) -> str:
    """The per-seed metric of the untrained model that gate ``gate`` compares against."""
    return f"untrained_{gate}"


def _gate(run: dict, label: str, gate: str) -> dict:
    """The competence gate of ``run`` (label ``label``) on metric ``gate``, as a JSON dict.

    Raises ValueError when a seed has ``gate`` but not ``untrained_<gate>``: a gate that
    paired fewer seeds than finished would pass or fail on what it was not shown."""
    untrained_key = _untrained_metric(gate)
    trained = run["values"].get(gate, {})
    untrained = run["values"].get(untrained_key, {})
    missing = sorted(set(trained) - set(untrained))
    if missing:
        raise ValueError(
            f"run {label!r}: metric {untrained_key!r} missing for seed(s) {missing} that have "
            f"{gate!r}; the competence gate needs the untrained model's {gate} of every seed")
    g = competence(trained, untrained, metric=gate)
    return {"run": label, **g.__dict__}


def _rising(run: dict) -> list[int]:
    """``[seeds still rising, seeds]`` of a run: a seed is still rising when its epoch
    budget, not a plateau, ended it (its ``still_rising`` metric); a run without that
    record (a result from before it existed) counts 0 of its seeds."""
    values = run["values"].get("still_rising", {})
    n = max((len(v) for v in run["values"].values()), default=0)
    return [int(sum(1 for v in values.values() if v)), int(n)]


def _is_rising(counts: list[int]) -> bool:
    """A run counts as still rising when more than half of its seeds are."""
    k, n = counts
    return n > 0 and 2 * k > n


def _run(run_tasks, outcome, failures: list, label: str) -> dict:
    """One grid entry's metrics per seed, summaries, curves, artefacts and time."""
    per_seed, curves, artefacts = {}, {}, {}
    for task in run_tasks:
        result = outcome.results.get(task)
        if result is None:
            if task in outcome.failures:
                failures.append({"run": label, "seed": task.seed,
                                 "traceback": outcome.failures[task]})
            continue
        per_seed[task.seed] = result["metrics"]
        curves[task.seed] = result["curves"]
        if result.get("artefacts"):
            artefacts[task.seed] = result["artefacts"]
    metrics = sorted({k for m in per_seed.values() for k in m})
    return {
        "method": run_tasks[0].method,
        "settings": run_tasks[0].config,
        "values": {k: {s: m[k] for s, m in per_seed.items() if k in m} for k in metrics},
        "summary": {k: summarise(m[k] for m in per_seed.values() if k in m).__dict__
                    for k in metrics},
        "curves": curves, "artefacts": artefacts,
        "seconds": float(sum(outcome.results[t]["seconds"] for t in run_tasks
                             if t in outcome.results)),
    }


def _select(selection, candidates: list) -> dict:
    """Of ``candidates`` (``(value, run)`` pairs in the selection's order), the run with the
    best mean ``selection.metric`` (ties: the earlier value), with a ``selection`` record of
    every candidate: its setting, mean ``selection.metric`` (``validation``), mean test
    MAP@R (shown, never used to choose) and every per-seed value it measured (validation,
    test, untrained); the seconds of all candidates (the selection's cost) are the run's."""
    means = []
    for _, run in candidates:
        s = run["summary"].get(selection.metric)
        means.append(s["mean"] if s and s["n"] and math.isfinite(s["mean"]) else -math.inf)
    best = max(range(len(candidates)), key=means.__getitem__)   # max keeps the first of ties
    run = dict(candidates[best][1])
    run["seconds"] = float(sum(r["seconds"] for _, r in candidates))
    run["selection"] = {
        "key": selection.key, "metric": selection.metric, "chosen": candidates[best][0],
        "paper": selection.paper,
        "candidates": [{"setting": v, "validation": m if math.isfinite(m) else None,
                        "test_map_at_r": r["summary"].get("test_map_at_r", {}).get("mean"),
                        "values": r["values"]}
                       for (v, r), m in zip(candidates, means)]}
    return run


def _comparison(c, runs: dict) -> dict:
    """A comparison's entry before judgement: its effect, gates and plateau record."""
    a = runs[c.run]["values"].get(c.metric, {})
    b = runs[c.baseline]["values"].get(c.metric, {})
    effect = compare(a, b, direction=c.direction, resolution=c.resolution)
    entry = {"name": c.name, "run": c.run, "baseline": c.baseline, "metric": c.metric,
             "direction": c.direction, **effect.__dict__}
    entry["interval_verdict"] = entry.pop("verdict")
    entry["rising"] = {"run": _rising(runs[c.run]), "baseline": _rising(runs[c.baseline])}
    if c.gate is not None:
        entry["gate"] = _gate(runs[c.baseline], c.baseline, c.gate)
        # a method run without untrained values is "not measured" (None) rather than an
        # error at the end of a long run; it then gates nothing
        method = runs[c.run]
        measured = set(method["values"].get(_untrained_metric(c.gate), {}))
        entry["method_gate"] = (_gate(method, c.run, c.gate)
                                if measured >= set(method["values"].get(c.gate, {})) else None)
    return entry


def _judge(entries: list[dict], smoke: bool) -> None:
    """Set each entry's ``verdict`` (:mod:`refdml.reproduce.stats`, "The verdict"): the
    gates, the plateau, the power at the experiment's pooled spread, then Holm over the
    comparisons that reach the test. Adds ``pooled_sd``, ``power_alpha``, ``seeds_needed``
    and ``seeds_for_observed`` (at the pooled spread and ``power_alpha``), ``p_adjusted``
    and ``family`` (the names Holm adjusted over)."""
    power_alpha = ALPHA / max(1, len(entries))
    by_metric: dict[str, list[dict]] = {}
    for e in entries:
        by_metric.setdefault(e["metric"], []).append(e)
    pooled = {m: pooled_sd([e["sd"] for e in es], [e["n"] for e in es])
              for m, es in by_metric.items()}
    tested = []
    for e in entries:
        sd = pooled[e["metric"]]
        e["pooled_sd"], e["power_alpha"] = sd, power_alpha
        e["seeds_needed"] = seeds_needed(sd, e["resolution"], alpha=power_alpha)
        e["seeds_for_observed"] = (seeds_needed(sd, e["effect"], alpha=power_alpha)
                                   if math.isfinite(e["effect"]) else math.nan)
        e["p_adjusted"], e["family"] = math.nan, []
        gate, method_gate = e.get("gate"), e.get("method_gate")
        if gate is not None and not gate["learned"]:
            e["verdict"] = BASELINE_DID_NOT_LEARN
        elif method_gate is not None and not method_gate["learned"]:
            e["verdict"] = METHOD_DID_NOT_LEARN
        elif _is_rising(e["rising"]["run"]) or _is_rising(e["rising"]["baseline"]):
            e["verdict"] = STILL_RISING
        elif e["n"] < 2 or not e["n"] >= e["seeds_needed"]:
            e["verdict"] = UNDERPOWERED
        else:
            tested.append(e)
    family = [e["name"] for e in tested]
    for e, p in zip(tested, holm([e["p_value"] for e in tested])):
        e["p_adjusted"], e["family"] = p, family
        claimed = e["direction"] * e["effect"] > 0
        e["verdict"] = (INCONCLUSIVE if not p < ALPHA else
                        REPRODUCED if claimed else NOT_REPRODUCED)
    if smoke:
        for e in entries:
            e["verdict"] = SMOKE


def evaluate_experiment(experiment: Experiment, mode: str, outcome, *, seeds: int | None = None,
                        scale: str = "small", device: str = "cpu") -> dict:
    """An experiment's result: its runs (a selection's with every candidate's values), its
    comparisons judged (:func:`_judge`) and its verdict (:func:`_overall`). A ``quick`` run
    is a smoke run: every verdict is ``smoke`` (the numbers are computed and shown)."""
    grid = experiment.tasks(mode, seeds, scale=scale, device=device)
    failures: list = []
    entries = {name: _run(run_tasks, outcome, failures, name) for name, run_tasks in grid.items()}
    runs = {}
    for label in experiment.runs:
        selection = experiment.select.get(label)
        if selection is None:
            runs[label] = entries[label]
        else:
            runs[label] = _select(selection, [(v, entries[selection.label(label, v)])
                                              for v in selection.values])
    comparisons = [_comparison(c, runs) for c in experiment.comparisons]
    smoke = mode == "quick"
    _judge(comparisons, smoke)
    return {"id": experiment.id, "paper": experiment.paper, "claim": experiment.claim,
            "notes": experiment.notes, "mode": mode, "figures": list(experiment.figures),
            "seeds": experiment.seeds[mode] if seeds is None else seeds,
            "own_question": experiment.own_question,
            "deviations": list(experiment.deviations),
            "verdict": _overall([c["verdict"] for c in comparisons], smoke),
            "comparisons": comparisons, "runs": runs, "failures": failures}


def _fmt(x: float | None) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:+.4f}"


def _seeds_cell(c: dict) -> str:
    """``run / needed`` seeds: the seeds the comparison paired and those that detect its
    resolution with 80 % power at the experiment's pooled spread."""
    return f"{c['n']} / {_number(c.get('seeds_needed'), '{:.0f}')}"


def _gate_cell(gate: dict | None) -> str:
    """A gate's table cell: ``yes +0.050`` / ``no +0.011 (< 0.02)`` / ``no +0.030 (n.s.)``."""
    if not gate:
        return "-"
    gain = _fmt(gate["gain"])
    if gate["learned"]:
        return f"yes {gain}"
    why = [] if gate.get("significant", False) else ["n.s."]
    if not gate.get("large_enough", False):
        why.append(f"< {gate.get('min_gain', 0.02):g}")
    return f"no {gain} ({', '.join(why)})"


def _plateau_cell(c: dict) -> str:
    """How many seeds of each run ended at the budget still rising, ``run / baseline``."""
    rising = c.get("rising")
    if not rising:
        return "-"
    (k, n), (kb, nb) = rising["run"], rising["baseline"]
    if k == 0 and kb == 0:
        return "plateau"
    return f"rising {k}/{n}, {kb}/{nb}"


def _p_cell(c: dict) -> str:
    p, q = c.get("p_value"), c.get("p_adjusted")
    if p is None or not math.isfinite(p):
        return "-"
    adjusted = "" if q is None or not math.isfinite(q) else f" (Holm {q:.3g})"
    return f"{p:.3g}{adjusted}"


def _reason(c: dict) -> str | None:
    """Why a comparison has its verdict, in words (None when the line says it)."""
    v = c["verdict"]
    if v == BASELINE_DID_NOT_LEARN:
        return f"baseline {c['baseline']} {gate_text(c['gate'])}"
    if v == METHOD_DID_NOT_LEARN:
        return f"method {c['run']} {gate_text(c['method_gate'])}"
    if v == STILL_RISING:
        (k, n), (kb, nb) = c["rising"]["run"], c["rising"]["baseline"]
        return (f"ended at the epoch budget still rising: {c['run']} {k} of {n} seeds, "
                f"{c['baseline']} {kb} of {nb}")
    if v == UNDERPOWERED:
        return (f"{c['n']} seeds, ~{_number(c.get('seeds_needed'), '{:.0f}', '?')} needed to detect "
                f"{c['resolution']:g} at the pooled spread {_number(c.get('pooled_sd'), missing='nan')} "
                f"(80% power, level {c.get('power_alpha', 0.05):.3g}); the interval alone "
                f"would read {c.get('interval_verdict', '-')}")
    if v in JUDGED and c["n"] >= 2:
        return f"{bound_text(c)}; p = {_p_cell(c)}"
    return None


def _number(x, fmt: str = "{:.4f}", missing: str = "-") -> str:
    """``x`` formatted with ``fmt``; ``missing`` for None (NaN in the JSON) or a non-finite
    value."""
    return missing if x is None or not math.isfinite(x) else fmt.format(x)


def summary_header() -> list[str]:
    """The column heads of :func:`summary_lines`."""
    return [f"{'experiment':<24}verdict",
            f"{'':<2}{'verdict':<{_VERDICT_WIDTH}}comparison: effect [95% CI]"]


def summary_lines(result: dict) -> list[str]:
    """The experiment's line (its overall verdict) and one indented line per comparison, each
    with that comparison's own verdict, effect and interval, and a line saying why
    (the gate that failed, the seeds still rising, the seeds power needs, or the bound and
    the Holm-adjusted p-value).

    The overall verdict (:func:`_overall`) gets a line of its own: printed beside the
    first comparison it would read as that comparison's verdict.
    """
    n = len(result["comparisons"])
    lines = [f"{result['id']:<24}{result['verdict']:<{_VERDICT_WIDTH}}"
             f"({n} comparison{'s' if n != 1 else ''}, {result['seeds']} seeds each)"]
    for c in result["comparisons"]:
        lines.append(f"{'':<2}{c['verdict']:<{_VERDICT_WIDTH}}{c['name']}: "
                     f"{_fmt(c['effect'])} [{_fmt(c['low'])}, {_fmt(c['high'])}] over "
                     f"{c['n']} seeds")
        reason = _reason(c)
        if reason:
            lines.append(f"{'':<{2 + _VERDICT_WIDTH}}{reason}")
    chosen = [f"{label} {run['selection']['key']}={run['selection']['chosen']} (paper: "
              f"{_paper_setting(run['selection'])})"
              for label, run in result["runs"].items() if run.get("selection")]
    if chosen:
        lines.append(f"{'':<{2 + _VERDICT_WIDTH}}chosen on validation: " + ", ".join(chosen))
    if result["failures"]:
        lines.append(f"{'':<2}{len(result['failures'])} task(s) failed (see above / JSON)")
    return lines


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _jsonable(value.item())
    return value


def write_json(path, payload: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = _jsonable(payload)
    for r in slim["experiments"]:
        for run in r["runs"].values():
            run.pop("artefacts", None)
    write_json_atomic(path, slim, indent=1)


# --------------------------------------------------------------------------- figures
def _figure():
    from matplotlib.figure import Figure

    return Figure


def _bars(result: dict, path: Path) -> None:
    Figure = _figure()
    metrics = sorted({c["metric"] for c in result["comparisons"]})
    fig = Figure(figsize=(max(4.0, 1.0 + 0.9 * len(result["runs"])) * len(metrics) / 1.3, 3.6))
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        labels = [k for k, r in result["runs"].items() if metric in r["summary"]]
        means = [result["runs"][k]["summary"][metric]["mean"] for k in labels]
        stds = [result["runs"][k]["summary"][metric]["std"] for k in labels]
        ax.bar(range(len(labels)), means, yerr=stds, capsize=3, color="#4c72b0")
        for j, k in enumerate(labels):
            vals = list(result["runs"][k]["values"][metric].values())
            ax.plot([j] * len(vals), vals, "k.", ms=3)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{metric} (mean ± std, dots: seeds)", fontsize=9)
    fig.suptitle(result["id"], fontsize=10)
    save_figure(fig, path, dpi=110, bbox_inches="tight")


def _mean_over_seeds(series: list[list[float]]) -> np.ndarray:
    """Per epoch, the mean of the finite values of the seeds' curves that reach it: a run
    stopped early (``patience``) has a shorter curve, and ``train_loss`` is NaN at epoch 0.
    NaN where fewer than half of the seeds have a finite value: the few runs that train
    longest are not the typical run, and one seed's curve is noise."""
    n = max(len(s) for s in series)
    arr = np.full((len(series), n), np.nan)
    for row, s in zip(arr, series):
        row[:len(s)] = np.asarray(s, dtype=np.float64)
    counts = np.isfinite(arr).sum(axis=0)
    total = np.where(np.isfinite(arr), arr, 0.0).sum(axis=0)
    enough = (counts > 0) & (2 * counts >= len(series))
    return np.where(enough, total / np.maximum(counts, 1), np.nan)


def _untrained_level(run: dict, key: str) -> float:
    """The mean over seeds of ``run``'s untrained ``key``: the per-seed ``untrained_<key>``
    where the run has it (what the gate compares against), else the curves' entry 0 (the
    model before any training); NaN when neither is finite."""
    values = [v for v in run["values"].get(_untrained_metric(key), {}).values()
              if v is not None and math.isfinite(v)]
    if not values:
        values = [c[key][0] for c in run["curves"].values()
                  if c.get(key) and c[key][0] is not None and math.isfinite(c[key][0])]
    return float(np.mean(values)) if values else math.nan


#: Above this many runs the curves' legend goes beside the figure instead of on an axis.
_LEGEND_INSIDE_MAX = 4


def _curves(result: dict, path: Path) -> bool:
    """Each run's curves (mean over seeds, per epoch; epoch 0 the untrained model); on the
    retrieval panel each run's untrained level as a dashed line in its colour. A run chosen
    on validation shows its chosen candidate's curves (the run is that candidate)."""
    Figure = _figure()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    def present(key):
        return any(key in c for r in result["runs"].values() for c in r["curves"].values())

    # a study that scores its test split once (the glyph wdml losses) has validation curves
    first = "test_map_at_r" if present("test_map_at_r") else "val_map_at_r"
    keys = [k for k in (first, "covering_radius", "train_loss") if present(k)]
    if not keys:   # a figure 0 inches wide: matplotlib divides by its width
        return False
    fig = Figure(figsize=(4.2 * len(keys), 3.4))
    handles, untrained_drawn = [], False
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for label, run in result["runs"].items():
            series = [c[key] for c in run["curves"].values() if key in c]
            if not series:
                continue
            mean = _mean_over_seeds(series)
            (line,) = ax.plot(range(mean.shape[0]), mean, label=label)
            if i == 0:
                handles.append(line)
                level = _untrained_level(run, key) if key == first else math.nan
                if math.isfinite(level):
                    ax.axhline(level, color=line.get_color(), linestyle="--", linewidth=0.8)
                    untrained_drawn = True
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch (0: untrained)")
        ax.set_ylabel(key, fontsize=8)
        ax.set_title(f"{key} (mean over seeds)", fontsize=9)
    runs_shown = len(handles)
    if untrained_drawn:
        handles.append(Line2D([], [], color="0.4", linestyle="--", linewidth=0.8,
                              label="untrained (each run's colour)"))
    if runs_shown > _LEGEND_INSIDE_MAX:
        fig.legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    else:
        fig.axes[0].legend(handles=handles, fontsize=6)
    lengths = {len(c[keys[0]]) for r in result["runs"].values() for c in r["curves"].values()
               if keys[0] in c}
    stopped = len(lengths) > 1
    fig.suptitle(result["id"] + (" (runs stop early: each epoch averages the seeds that "
                                 "trained it, shown while at least half did)"
                                 if stopped else ""), fontsize=10)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    return True


def _attention(result: dict, path: Path) -> bool:
    items = [(label, run["artefacts"][0]["attention"]) for label, run in result["runs"].items()
             if 0 in run["artefacts"] and "attention" in run["artefacts"][0]]
    if not items:
        return False
    Figure = _figure()
    n = len(items[0][1]["images"])
    fig = Figure(figsize=(1.3 * n, 1.4 * (1 + len(items))))
    for j in range(n):
        ax = fig.add_subplot(1 + len(items), n, j + 1)
        ax.imshow(np.array(items[0][1]["images"][j]), cmap="gray")
        ax.set_axis_off()
        ax.set_title(f"class {items[0][1]['labels'][j]}", fontsize=7)
    for i, (label, att) in enumerate(items):
        for j in range(n):
            ax = fig.add_subplot(1 + len(items), n, (i + 1) * n + j + 1)
            ax.imshow(np.array(att["weights"][j]), cmap="magma")
            ax.contour(np.array(att["foreground"][j], dtype=float), levels=[0.5], colors="c",
                       linewidths=0.8)
            ax.set_axis_off()
            if j == 0:
                ax.set_title(label, fontsize=7, loc="left")
    fig.suptitle(f"{result['id']}: GSP pooling weights, seed 0 (cyan: the class cell)",
                 fontsize=9)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    return True


def _embedding_2d(result: dict, path: Path) -> bool:
    items = [(label, run["artefacts"][0]["embedding_2d"]) for label, run in
             result["runs"].items() if 0 in run["artefacts"]
             and "embedding_2d" in run["artefacts"][0]]
    if not items:
        return False
    Figure = _figure()
    fig = Figure(figsize=(3.6 * len(items), 3.5))
    for i, (label, e) in enumerate(items):
        ax = fig.add_subplot(1, len(items), i + 1)
        pts, lab = np.array(e["points"]), np.array(e["labels"])
        prox, plab = np.array(e["proxies"]), np.array(e["proxy_labels"])
        for k in np.unique(lab):
            colour = f"C{int(k) % 10}"
            ax.scatter(*pts[lab == k].T, s=3, alpha=0.4, color=colour)
            ax.scatter(*prox[plab == k].T, s=40, marker="*", edgecolor="k", linewidth=0.4,
                       color=colour)
        ax.set_title(f"{label} (train, PCA; stars: proxies)", fontsize=8)
    fig.suptitle(f"{result['id']}: embeddings and proxies, seed 0", fontsize=9)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    return True


def _cell_weights(result: dict, path: Path) -> bool:
    """GSP's pooling weight on the class cell against a distractor cell, per run and seed."""
    runs = [(label, run) for label, run in result["runs"].items()
            if "class_cell_ratio" in run["summary"]]
    if not runs:
        return False
    Figure = _figure()
    fig = Figure(figsize=(4.0 + 0.5 * len(runs), 3.4))
    for i, (metric, uniform, title) in enumerate((
            ("class_cell_weight", 0.25, "class cell's share of the weight (uniform 1/4)"),
            ("class_cell_ratio", 1.0, "class cell / distractor cell (uniform 1)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        means = [run["summary"][metric]["mean"] for _, run in runs]
        ax.bar(range(len(runs)), means, color="#dd8452")
        for j, (_, run) in enumerate(runs):
            values = list(run["values"][metric].values())
            ax.plot([j] * len(values), values, "k.", ms=3)
        ax.axhline(uniform, color="k", linestyle="--", linewidth=0.8)
        ax.set_xticks(range(len(runs)), [label for label, _ in runs], rotation=45, ha="right",
                      fontsize=8)
        ax.set_title(title, fontsize=8)
    fig.suptitle(f"{result['id']}: where GSP puts its pooling weight (test collages)",
                 fontsize=9)
    save_figure(fig, path, dpi=110, bbox_inches="tight")
    return True


def _glyphs(result: dict, path: Path) -> bool:
    """The benchmark's classes in their fonts (and, for collages, a few test collages) of
    the run's data settings at seed 0."""
    from refdml.train.data import glyph_classes, make_glyph_collages
    from refdml.train.plots import plot_glyphs

    settings = next(iter(result["runs"].values()))["settings"]
    classes = glyph_classes()
    collages = None
    if "n_background" in settings:
        collages = make_glyph_collages(
            rng=0, classes=classes, size=settings["glyph_size"], max_classes=60,
            n_background=tuple(settings["n_background"]),
            families=tuple(settings.get("families", ()))).test
    plot_glyphs(classes, path, n_classes=10, collages=collages,
                title=f"{result['id']}: {len(classes)} glyph classes (10 shown) in the fonts "
                      "that draw them, clean and distorted")
    return True


def _paper_setting(selection: dict) -> str:
    paper = selection.get("paper")
    return "not stated" if paper is None else str(paper)


def _selection_lines(result: dict) -> list[str]:
    """A line per run whose setting was chosen on validation: the chosen value beside the
    paper's, and every candidate's means."""
    lines = []
    for label, run in result["runs"].items():
        sel = run.get("selection")
        if not sel:
            continue
        parts = ", ".join(
            f"{c['setting']}: {_mean(c['validation'])} (test {_mean(c['test_map_at_r'])})"
            for c in sel["candidates"])
        lines.append(f"- `{label}`: `{sel['key']}` = {sel['chosen']} (the paper's: "
                     f"{_paper_setting(sel)}), the best mean {sel['metric']} of {parts}")
    if lines:
        lines = ["", "Chosen on the validation split (mean over seeds; the test split shown, "
                 "not used):", ""] + lines
    return lines


def trust_table(payload: dict) -> list[str]:
    """The trust table of a run's verdicts, as Markdown lines: per comparison its effect and
    interval, the seeds it paired against those power needs, both gates, the plateau, the
    p-value (Holm-adjusted), how many deviations from its paper the experiment has, and the
    verdict; then the deviations, listed per experiment."""
    lines = ["| experiment | comparison (claimed) | effect [95% CI] | seeds / needed | "
             "baseline learned? | method learned? | plateau | p (Holm) | deviations | "
             "verdict |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    listed = []
    for r in payload["experiments"]:
        head = f"`{r['id']}`" + (" (the project's own question)"
                                 if r.get("own_question") else "")
        deviations = r.get("deviations") or []
        if deviations:
            listed.append(f"- `{r['id']}`: " + "; ".join(deviations) + ".")
        for k, c in enumerate(r["comparisons"]):
            lines.append(
                f"| {head if k == 0 else ''} | {c['name']} | {_fmt(c['effect'])} "
                f"[{_fmt(c['low'])}, {_fmt(c['high'])}] | {_seeds_cell(c)} | "
                f"{_gate_cell(c.get('gate'))} | {_gate_cell(c.get('method_gate'))} | "
                f"{_plateau_cell(c)} | {_p_cell(c)} | "
                f"{(str(len(deviations)) if deviations else '-') if k == 0 else ''} | "
                f"{c['verdict']} |")
    if listed:
        lines += ["", "Deviations from the papers, per experiment:", ""] + listed
    return lines


def _gate_lines(result: dict) -> list[str]:
    """The competence gate of every run a gated comparison names: trained and untrained
    means, the gain with its interval, and whether it learned (the baseline's decides the
    comparison; the method's is shown for the reader)."""
    rows = {}
    for c in result["comparisons"]:
        for key, role in (("gate", "baseline"), ("method_gate", "method")):
            g = c.get(key)
            if g and (g["run"], g["metric"]) not in rows:
                rows[(g["run"], g["metric"])] = (role, g)
    if not rows:
        return []
    lines = ["", "Gates: each run's test MAP@R against the same network untrained (paired by "
             "seed; learned when the 95% interval of the gain lies above 0 and the mean gain "
             "is at least the minimum):", "",
             "| run | role | metric | trained | untrained | gain [95% CI] | seeds | learned |",
             "|---|---|---|---|---|---|---|---|"]
    for (label, metric), (role, g) in rows.items():
        lines.append(f"| `{label}` | {role} | {metric} | {_mean(g['trained'])} | "
                     f"{_mean(g['untrained'])} | {_fmt(g['gain'])} "
                     f"[{_fmt(g['low'])}, {_fmt(g['high'])}] | {g['n']} | "
                     f"{_gate_cell(g).split(' ')[0]} |")
    return lines


_mean = _number     # a mean in a table cell: 4 decimals, "-" where there is none


def is_report_folder(path) -> bool:
    """Is ``path`` a report that ``refdml reproduce`` wrote before it marked its folders
    (:data:`refdml._io.FOLDER_MARKER`)? Its ``README.md`` begins with the report's title
    and nothing else is there but PNG and JSON files (``--json`` may point inside it) and a
    killed write's temporary files. Such a folder may be replaced by the next ``--report``."""
    path = Path(path)
    try:
        with open(path / "README.md", encoding="utf-8") as handle:
            if handle.readline().rstrip("\n") != _TITLE:
                return False
    except (OSError, UnicodeDecodeError):
        return False
    return all(_in_a_report(entry) for entry in path.iterdir())


def _in_a_report(entry: Path) -> bool:
    if entry.is_symlink() or not entry.is_file():
        return False
    name = entry.name
    if name.startswith("."):
        return name.endswith(".tmp")
    return name == "README.md" or entry.suffix in (".png", ".json")


def write_report(directory, payload: dict) -> Path:
    """``<directory>/README.md`` with a table of verdicts, per-experiment tables, figures."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = [_TITLE, "",
             f"Mode `{payload['mode']}`, scale `{payload.get('scale', 'small')}`, device "
             f"`{payload.get('device', 'cpu')}`, {payload['wall_seconds']:.0f} s wall, "
             f"{payload['workers']}, code version `{payload['code_version']}`; CPU time of the "
             f"tasks computed in this run: {payload.get('task_cpu_seconds', 0.0):.0f} s "
             f"({payload['tasks']['computed']} computed, {payload['tasks']['cached']} from the "
             "cache).", "",
             "Verdicts (computed, never written by hand):", ""]
    lines += [f"- `{k}`: {v}" for k, v in VERDICT_MEANINGS.items()]
    lines += ["", "Columns: the paired effect (method minus baseline, same seed) with its 95% "
              "Student-t interval; the seeds paired and those that detect the comparison's "
              "resolution with 80% power at the experiment's pooled spread; each run's gain "
              "over the same network untrained (learned: significant and at least the "
              "minimum gain); whether each run reached a plateau (seeds still rising at the "
              "epoch budget, method / baseline); the t-test p-value and its Holm adjustment "
              "over the experiment's judged comparisons (docs/reproduce.md, Statistics).", ""]
    lines += trust_table(payload)
    for r in payload["experiments"]:
        lines += ["", f"## `{r['id']}`: {r['verdict']}", "", f"*{r['paper']}.* {r['claim']}"]
        if r["notes"]:
            lines += ["", r["notes"]]
        metrics = sorted({k for run in r["runs"].values() for k in run["summary"]})
        lines += ["", "| run | " + " | ".join(metrics) + " | seconds |",
                  "|---|" + "---|" * (len(metrics) + 1)]
        for label, run in r["runs"].items():
            cells = []
            for m in metrics:
                s = run["summary"].get(m)
                cells.append("-" if s is None or not s["n"] else
                             f"{s['mean']:.4f} ± {s['std']:.4f} (n={s['n']})")
            lines.append(f"| `{label}` | " + " | ".join(cells) + f" | {run['seconds']:.0f} |")
        lines += _gate_lines(r)
        lines += _selection_lines(r)
        for kind, draw in (("glyphs", _glyphs), ("bars", _bars), ("curves", _curves),
                           ("attention", _attention), ("cell_weights", _cell_weights),
                           ("embedding_2d", _embedding_2d)):
            # the cell-weight figure wherever GSP ran on collages (the digits too)
            automatic = kind == "cell_weights" and any(
                "class_cell_ratio" in run["summary"] for run in r["runs"].values())
            if kind not in r["figures"] and not automatic:
                continue
            name = f"{r['id'].replace('.', '_')}_{kind}.png"
            try:
                drawn = draw(r, directory / name)
            except ImportError:
                lines += ["", f"(figure {kind} not drawn: figures need matplotlib, "
                          "pip install \"refdml[plot]\")"]
                continue
            except Exception as exc:  # a figure must not lose the report
                lines += ["", f"(figure {kind} failed: {exc!r})"]
                continue
            if drawn is not False:
                lines += ["", f"![{r['id']} {kind}]({name})"]
        settings = {label: run["settings"] for label, run in r["runs"].items()}
        common = {k: v for k, v in next(iter(settings.values())).items()
                  if all(s.get(k) == v for s in settings.values())}
        lines += ["", "Settings of every run: `" + json.dumps(common, sort_keys=True) + "`"]
        extras = [(label, {k: v for k, v in s.items() if k not in common})
                  for label, s in settings.items()]
        if any(extra for _, extra in extras):
            lines += [""] + [f"- `{label}`: `{json.dumps(extra, sort_keys=True)}`"
                             for label, extra in extras if extra]
        for f in r["failures"]:
            lines += ["", f"Failed: `{f['run']}` seed {f['seed']}", "", "```",
                      f["traceback"].rstrip(), "```"]
    return write_text_atomic(directory / "README.md", "\n".join(lines) + "\n")
