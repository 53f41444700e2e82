"""The Markdown report of ``refdml verify --report DIR`` (figures need matplotlib)."""

from __future__ import annotations

import json
from pathlib import Path

from ._framework import ClaimResult, Figure, to_jsonable

__all__ = ["write_report"]


def _pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _draw(plt, figure: Figure, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    for s in figure.series:
        ax.plot(s.x, s.y, marker="o", markersize=3, label=s.label)
    ax.set_xscale(figure.xscale)
    ax.set_yscale(figure.yscale)
    ax.set_xlabel(figure.xlabel)
    ax.set_ylabel(figure.ylabel)
    ax.set_title(figure.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _json_block(value) -> str:
    """A dict as one bullet per key with compact JSON values; anything else as one JSON line."""
    value = to_jsonable(value)
    if isinstance(value, dict):
        return "\n".join(f"- `{k}`: `{_compact(v)}`" for k, v in value.items())
    return f"`{_compact(value)}`"


def _compact(value, limit: int = 1500) -> str:
    text = json.dumps(value, separators=(", ", ": "))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell(text) -> str:
    return str(text).replace("|", "\\|")


def _figure_table(figure: Figure) -> list[str]:
    xs = sorted({x for s in figure.series for x in s.x})
    lines = [
        f"| {figure.xlabel} | " + " | ".join(s.label for s in figure.series) + " |",
        "|---" * (len(figure.series) + 1) + "|",
    ]
    for x in xs:
        cells = []
        for s in figure.series:
            ys = [y for xx, y in zip(s.x, s.y) if xx == x]
            cells.append(f"{ys[0]:.4g}" if ys else "")
        lines.append(f"| {x:.4g} | " + " | ".join(cells) + " |")
    return lines


def _claim_section(result: ClaimResult, figdir: Path, plt) -> list[str]:
    out = [f"## `{result.id}`: {result.verdict}", ""]
    out += [f"**Paper:** {result.paper}  ", f"**Statement (as printed):** {result.statement}  ",
            f"**Hypotheses:** {result.hypotheses}  ", f"**Key number:** {result.key_number}", ""]
    if result.crashed:
        out += ["The check crashed:", "", "```", result.crash or "", "```", ""]
        return out
    if result.correction:
        out += [f"**Correction (holds):** {result.correction}", ""]
    if result.extra_hypothesis:
        out += [f"**Extra hypothesis needed:** {result.extra_hypothesis}", ""]
    if result.inconclusive_reason:
        out += [f"**Why inconclusive:** {result.inconclusive_reason}", ""]
    out += [
        "| error (deciding reading) | tolerance | error as printed | sizes | seeds | runtime |",
        "|---|---|---|---|---|---|",
        f"| {_fmt(result.error)} | {_fmt(result.tolerance)} | {_fmt(result.printed_error)} | "
        f"`{_compact(list(result.sizes), 300)}` | {_fmt(list(result.seeds))} | {result.runtime_s:.2f} s |",
        "",
        "| reading | statement | error | tolerance | passes | trials |",
        "|---|---|---|---|---|---|",
    ]
    for r in result.readings:
        out.append(f"| {r['kind']} | {_cell(r['statement'])} | {_fmt(r['error'])} | "
                   f"{_fmt(r['tolerance'])} | {r['passed']} | {r['trials']} |")
    out.append("")
    if result.counterexample is not None:
        out += ["Counterexample to the printed claim (smallest found):", "",
                _json_block(result.counterexample), ""]
    if result.probe_counterexample is not None:
        out += ["Probe just outside the hypotheses (smallest example found):", "",
                _json_block(result.probe_counterexample), ""]
    if result.details:
        out += ["Evidence:", "", _json_block(result.details), ""]
    if result.self_checks:
        out += ["Self-checks (gradient checks of refdml operators this claim uses):", "",
                "| operator | seed | max rel error | rtol | passed |", "|---|---|---|---|---|"]
        for row in result.self_checks:
            out.append(f"| {row['name']} | {row.get('seed', '-')} | {_fmt(row.get('max_rel_error'))} | "
                       f"{_fmt(row.get('rtol'))} | {row['passed']} {row.get('error', row.get('note', ''))} |")
        out.append("")
    for figure in result.figures:
        out += [f"### Figure: {figure.title}", ""]
        if plt is not None:
            path = figdir / f"{figure.name}.png"
            _draw(plt, figure, path)
            out += [f"![{figure.title}](figures/{path.name})", ""]
        out += _figure_table(figure) + [""]
    return out


def write_report(results: list[ClaimResult], directory, *, quick: bool, seed: int, runtime_s: float) -> Path:
    """Write ``DIR/report.md`` (and ``DIR/figures/*.png`` when matplotlib is installed)."""
    directory = Path(directory)
    figdir = directory / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    lines = [
        "# refdml verify: numerical checks of the claims of the four papers",
        "",
        f"Mode: {'quick' if quick else 'default'}; base seed {seed}; {len(results)} claims; "
        f"total runtime {runtime_s:.1f} s.",
        "",
    ]
    if plt is None:
        lines += ["> matplotlib is not installed (`pip install refdml[plot]`): figures are not drawn; "
                  "every number behind them is in the tables below.", ""]
    lines += ["| claim | verdict | key number |", "|---|---|---|"]
    for r in results:
        flag = " (self-check FAILED)" if r.self_check_failed else ""
        lines.append(f"| `{r.id}` | {r.verdict}{flag} | {_cell(r.key_number)} |")
    lines.append("")
    for r in results:
        lines += _claim_section(r, figdir, plt)
    path = directory / "report.md"
    path.write_text("\n".join(lines))
    return path
