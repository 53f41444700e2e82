"""Turn task results into experiment outcomes, text lines, JSON and a Markdown report.

:func:`evaluate_experiment` collects, for each run of an experiment, its metric per seed,
the per-run summaries (mean, std) and each comparison's :class:`~._stats.Effect`, and the
experiment's verdict. A comparison with a ``gate`` is judged only when its baseline learned
(:func:`~._stats.competence` on the baseline's per-seed ``gate`` and ``untrained_<gate>``);
otherwise its verdict is ``baseline-did-not-learn``, its effect still shown. The experiment's
verdict is over the judged comparisons (every one ``reproduced`` -> ``reproduced``; any
``not-reproduced`` -> ``not-reproduced``; else ``inconclusive``), and
``baseline-did-not-learn`` when none was judged. Failed tasks simply leave their seed out
(the comparison pairs the seeds both runs have) and are listed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from refdml._io import save_figure, write_json_atomic, write_text_atomic
from refdml.reproduce._experiments import Experiment
from refdml.reproduce._stats import (
    BASELINE_DID_NOT_LEARN,
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    VERDICT_MEANINGS,
    VERDICTS,
    bound_text,
    compare,
    competence,
    gate_text,
    summarise,
)

__all__ = ["evaluate_experiment", "is_report_folder", "summary_header", "summary_lines",
           "write_json", "write_report"]

_TITLE = "# refdml reproduce"

#: Width of the verdict column of the printed lines (the longest verdict and two spaces).
_VERDICT_WIDTH = max(map(len, VERDICTS)) + 2


def _overall(verdicts: list[str]) -> str:
    """The experiment's verdict over its comparisons' verdicts; the gated-out ones do not
    count, and when every comparison was gated out that is the verdict."""
    judged = [v for v in verdicts if v != BASELINE_DID_NOT_LEARN]
    if verdicts and not judged:
        return BASELINE_DID_NOT_LEARN
    if judged and all(v == REPRODUCED for v in judged):
        return REPRODUCED
    if any(v == NOT_REPRODUCED for v in judged):
        return NOT_REPRODUCED
    return INCONCLUSIVE


def _untrained_metric(gate: str) -> str:
    """The per-seed metric of the untrained model that gate ``gate`` compares against."""
    return f"untrained_{gate}"


def _gate(run: dict, label: str, gate: str, seed: int) -> dict:
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
    g = competence(trained, untrained, metric=gate, seed=seed)
    return {"run": label, **g.__dict__}


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
    every candidate's setting, mean ``selection.metric`` (``validation``) and mean test
    MAP@R (shown, never used to choose); the seconds of all candidates (the selection's
    cost) are the run's."""
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
                        "test_map_at_r": r["summary"].get("test_map_at_r", {}).get("mean")}
                       for (v, r), m in zip(candidates, means)]}
    return run


def evaluate_experiment(experiment: Experiment, mode: str, outcome, *, seeds: int | None = None,
                        bootstrap_seed: int = 0, scale: str = "small",
                        device: str = "cpu") -> dict:
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
    comparisons = []
    for c in experiment.comparisons:
        a = runs[c.run]["values"].get(c.metric, {})
        b = runs[c.baseline]["values"].get(c.metric, {})
        effect = compare(a, b, direction=c.direction, seed=bootstrap_seed,
                         resolution=c.resolution)
        entry = {"name": c.name, "run": c.run, "baseline": c.baseline, "metric": c.metric,
                 "direction": c.direction, **effect.__dict__}
        if c.gate is not None:
            # the baseline's gate decides; the method's is reported beside it
            entry["gate"] = _gate(runs[c.baseline], c.baseline, c.gate, bootstrap_seed)
            # reported only: a method run without untrained values is "not measured" (None)
            # rather than an error at the end of a long run
            method = runs[c.run]
            measured = set(method["values"].get(_untrained_metric(c.gate), {}))
            entry["method_gate"] = (
                _gate(method, c.run, c.gate, bootstrap_seed)
                if measured >= set(method["values"].get(c.gate, {})) else None)
            if not entry["gate"]["learned"]:
                entry["verdict"] = BASELINE_DID_NOT_LEARN
        comparisons.append(entry)
    return {"id": experiment.id, "paper": experiment.paper, "claim": experiment.claim,
            "notes": experiment.notes, "mode": mode, "figures": list(experiment.figures),
            "seeds": experiment.seeds[mode] if seeds is None else seeds,
            "verdict": _overall([c["verdict"] for c in comparisons]),
            "comparisons": comparisons, "runs": runs, "failures": failures}


def _fmt(x: float | None) -> str:
    return "nan" if x is None or not math.isfinite(x) else f"{x:+.4f}"


def _rules_out(c: dict) -> str:
    """``|d| > bound`` for an inconclusive comparison, else a dash (the interval says it)."""
    bound = c.get("bound")
    if c["verdict"] != INCONCLUSIVE or bound is None or not math.isfinite(bound):
        return "-"
    return f"\\|effect\\| > {bound:.4f}"


def _seeds_to_decide(c: dict) -> str:
    need = c.get("seeds_needed")
    if c["verdict"] != INCONCLUSIVE or need is None or not math.isfinite(need):
        return "-"
    return f"~{need:.0f} (for {c.get('resolution', 0.02):g})"


def summary_header() -> list[str]:
    """The column heads of :func:`summary_lines`."""
    return [f"{'experiment':<24}verdict",
            f"{'':<2}{'verdict':<{_VERDICT_WIDTH}}comparison: effect [95% CI]"]


def summary_lines(result: dict) -> list[str]:
    """The experiment's line (its overall verdict) and one indented line per comparison, each
    with that comparison's own verdict, effect and interval; a comparison whose baseline did
    not learn gets a line with the baseline's gate (trained and untrained means, the gain).

    The overall verdict, over the judged comparisons, is `reproduced` when every one is,
    `not-reproduced` when any contradicts the claim, and `inconclusive` otherwise
    (`baseline-did-not-learn` when none was judged); printing it beside the first comparison
    would read as that comparison's verdict, so it gets a line of its own.
    """
    n = len(result["comparisons"])
    lines = [f"{result['id']:<24}{result['verdict']:<{_VERDICT_WIDTH}}"
             f"({n} comparison{'s' if n != 1 else ''}, {result['seeds']} seeds each)"]
    for c in result["comparisons"]:
        lines.append(f"{'':<2}{c['verdict']:<{_VERDICT_WIDTH}}{c['name']}: "
                     f"{_fmt(c['effect'])} [{_fmt(c['low'])}, {_fmt(c['high'])}] over "
                     f"{c['n']} seeds")
        if c["verdict"] == INCONCLUSIVE and c["n"] >= 2:
            lines.append(f"{'':<{2 + _VERDICT_WIDTH}}{bound_text(c)}")
        if c["verdict"] == BASELINE_DID_NOT_LEARN:
            lines.append(f"{'':<{2 + _VERDICT_WIDTH}}baseline {c['baseline']} "
                         f"{gate_text(c['gate'])}")
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


def _learned_cell(c: dict) -> str:
    """The verdict table's "baseline learned?" cell: the baseline's gain over the untrained
    model with its interval, prefixed "no: " when it did not learn; "-" without a gate."""
    gate = c.get("gate")
    if not gate:
        return "-"
    text = f"gain {_fmt(gate['gain'])} [{_fmt(gate['low'])}, {_fmt(gate['high'])}]"
    return text if gate["learned"] else f"no: {text}"


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
    lines = ["", "Competence gate: each run's metric against the same network untrained "
             "(paired by seed; learned when the 95% interval of the gain lies above 0):", "",
             "| run | role | metric | trained | untrained | gain [95% CI] | seeds | learned |",
             "|---|---|---|---|---|---|---|---|"]
    for (label, metric), (role, g) in rows.items():
        lines.append(f"| `{label}` | {role} | {metric} | {_mean(g['trained'])} | "
                     f"{_mean(g['untrained'])} | {_fmt(g['gain'])} "
                     f"[{_fmt(g['low'])}, {_fmt(g['high'])}] | {g['n']} | "
                     f"{'yes' if g['learned'] else 'no'} |")
    return lines


def _mean(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.4f}"


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
    lines += ["", "An inconclusive comparison is bounded: with 95% confidence the effect is smaller "
              "in size than the larger end of its interval (\"rules out\"), and the "
              "\"seeds to decide\" column estimates the seeds that would decide an effect of "
              "the comparison's resolution (docs/reproduce.md, Statistics). \"Baseline "
              "learned?\": the competence gate, the baseline's mean gain over the same network "
              "untrained with its 95% interval (paired by seed); a comparison is judged only "
              "when that interval lies above 0, and \"no\" makes its verdict "
              f"`{BASELINE_DID_NOT_LEARN}` (\"-\": no gate).", "",
              "| experiment | verdict | comparison | effect | 95% CI | seeds | rules out "
              "| seeds to decide | baseline learned? |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in payload["experiments"]:
        for c in r["comparisons"]:
            lines.append(f"| `{r['id']}` | {c['verdict']} | {c['name']} | {_fmt(c['effect'])} "
                         f"| [{_fmt(c['low'])}, {_fmt(c['high'])}] | {c['n']} | "
                         f"{_rules_out(c)} | {_seeds_to_decide(c)} | {_learned_cell(c)} |")
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
