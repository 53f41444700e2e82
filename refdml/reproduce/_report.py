"""Turn task results into experiment outcomes, text lines, JSON and a Markdown report.

:func:`evaluate_experiment` collects, for each run of an experiment, its metric per seed,
the per-run summaries (mean, std) and each comparison's :class:`~._stats.Effect`, and the
experiment's verdict (every comparison ``reproduced`` -> ``reproduced``; any
``not-reproduced`` -> ``not-reproduced``; else ``inconclusive``). Failed tasks simply
leave their seed out (the comparison pairs the seeds both runs have) and are listed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from refdml._io import save_figure, write_json_atomic, write_text_atomic
from refdml.reproduce._experiments import Experiment
from refdml.reproduce._stats import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    VERDICT_MEANINGS,
    bound_text,
    compare,
    summarise,
)

__all__ = ["evaluate_experiment", "summary_lines", "write_json", "write_report"]


def _overall(verdicts: list[str]) -> str:
    if verdicts and all(v == REPRODUCED for v in verdicts):
        return REPRODUCED
    if any(v == NOT_REPRODUCED for v in verdicts):
        return NOT_REPRODUCED
    return INCONCLUSIVE


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
        comparisons.append({"name": c.name, "run": c.run, "baseline": c.baseline,
                            "metric": c.metric, "direction": c.direction, **effect.__dict__})
    return {"id": experiment.id, "paper": experiment.paper, "claim": experiment.claim,
            "notes": experiment.notes, "mode": mode, "figures": list(experiment.figures),
            "seeds": experiment.seeds[mode] if seeds is None else seeds,
            "verdict": _overall([c["verdict"] for c in comparisons]),
            "comparisons": comparisons, "runs": runs, "failures": failures}


def _fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:+.4f}"


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


def summary_lines(result: dict) -> list[str]:
    """The experiment's line (its overall verdict) and one indented line per comparison, each
    with that comparison's own verdict, effect and interval.

    The overall verdict is `reproduced` when every comparison is, `not-reproduced` when any
    comparison contradicts the claim, and `inconclusive` otherwise; printing it beside the first
    comparison would read as that comparison's verdict, so it gets a line of its own.
    """
    n = len(result["comparisons"])
    lines = [f"{result['id']:<24}{result['verdict']:<16}"
             f"({n} comparison{'s' if n != 1 else ''}, {result['seeds']} seeds each)"]
    for c in result["comparisons"]:
        lines.append(f"{'':<2}{c['verdict']:<16}{c['name']}: {_fmt(c['effect'])} "
                     f"[{_fmt(c['low'])}, {_fmt(c['high'])}] over {c['n']} seeds")
        if c["verdict"] == INCONCLUSIVE and c["n"] >= 2:
            lines.append(f"{'':<24}{bound_text(c)}")
    chosen = [f"{label} {run['selection']['key']}={run['selection']['chosen']}"
              for label, run in result["runs"].items() if run.get("selection")]
    if chosen:
        lines.append(f"{'':<24}chosen on validation: " + ", ".join(chosen))
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


def _curves(result: dict, path: Path) -> bool:
    Figure = _figure()

    def present(key):
        return any(key in c for r in result["runs"].values() for c in r["curves"].values())

    # a study that scores its test split once (the glyph wdml losses) has validation curves
    first = "test_map_at_r" if present("test_map_at_r") else "val_map_at_r"
    keys = [k for k in (first, "covering_radius", "train_loss") if present(k)]
    if not keys:   # a figure 0 inches wide: matplotlib divides by its width
        return False
    fig = Figure(figsize=(4.2 * len(keys), 3.4))
    for i, key in enumerate(keys):
        ax = fig.add_subplot(1, len(keys), i + 1)
        for label, run in result["runs"].items():
            series = [c[key] for c in run["curves"].values() if key in c]
            if not series:
                continue
            mean = _mean_over_seeds(series)
            ax.plot(range(mean.shape[0]), mean, label=label)
        ax.set_xlabel("epoch")
        ax.set_title(f"{key} (mean over seeds)", fontsize=9)
        if i == 0:
            ax.legend(fontsize=6)
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


def _selection_lines(result: dict) -> list[str]:
    """A line per run whose setting was chosen on validation: every candidate's means."""
    lines = []
    for label, run in result["runs"].items():
        sel = run.get("selection")
        if not sel:
            continue
        parts = ", ".join(
            f"{c['setting']}: {_mean(c['validation'])} (test {_mean(c['test_map_at_r'])})"
            for c in sel["candidates"])
        lines.append(f"- `{label}`: `{sel['key']}` = {sel['chosen']}, the best mean "
                     f"{sel['metric']} of {parts}")
    if lines:
        lines = ["", "Chosen on the validation split (mean over seeds; the test split shown, "
                 "not used):", ""] + lines
    return lines


def _mean(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def write_report(directory, payload: dict) -> Path:
    """``<directory>/README.md`` with a table of verdicts, per-experiment tables, figures."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    lines = ["# refdml reproduce", "",
             f"Mode `{payload['mode']}`, scale `{payload.get('scale', 'small')}`, device "
             f"`{payload.get('device', 'cpu')}`, {payload['wall_seconds']:.0f} s wall, "
             f"{payload['workers']}, code version `{payload['code_version']}`; CPU time of the "
             f"tasks computed in this run: {payload.get('task_cpu_seconds', 0.0):.0f} s "
             f"({payload['tasks']['computed']} computed, {payload['tasks']['cached']} from the "
             "cache).", "",
             "Verdicts (computed, never written by hand):", ""]
    lines += [f"- `{k}`: {v}" for k, v in VERDICT_MEANINGS.items()]
    lines += ["", "An inconclusive comparison is bounded: with 95% confidence the effect is smaller "
              "in size than the larger end of its interval (\"rules out\"), and the last "
              "column estimates the seeds that would decide an effect of the comparison's "
              "resolution (docs/reproduce.md, Statistics).", "",
              "| experiment | verdict | comparison | effect | 95% CI | seeds | rules out "
              "| seeds to decide |", "|---|---|---|---|---|---|---|---|"]
    for r in payload["experiments"]:
        for c in r["comparisons"]:
            lines.append(f"| `{r['id']}` | {c['verdict']} | {c['name']} | {_fmt(c['effect'])} "
                         f"| [{_fmt(c['low'])}, {_fmt(c['high'])}] | {c['n']} | "
                         f"{_rules_out(c)} | {_seeds_to_decide(c)} |")
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
