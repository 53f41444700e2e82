"""The Markdown report of ``refdml verify --report DIR`` (figures need matplotlib).

The report says what was run and where (refdml's version, the date, the machine and the
versions of the numerical libraries), what the five verdicts mean, and for every claim its
readings, counterexamples and evidence as tables, and its figures (PNG, with the table of
every plotted number underneath, so nothing depends on matplotlib being there).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import sys
import textwrap
from pathlib import Path

from refdml._io import save_figure, write_text_atomic

from ._framework import VERDICT_MEANINGS, ClaimResult, Figure, to_jsonable

__all__ = ["is_report_folder", "machine_lines", "write_report"]

_TITLE = "# refdml verify: numerical checks of the claims of the four papers"

_CELL = 160  # longest cell of an evidence table, in characters
_ITEMS = 12  # numbers of a list shown before "... (N values)"
_DPI = 110   # of the PNGs: 6.4 x 4.4 inches, 704 x 484 pixels


def _pyplot():
    """matplotlib.pyplot with a file-only backend, or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _readable_log_ticks(axis, values, *, at_values: bool) -> None:
    """Ticks of a log axis spanning under two decades, as plain numbers.

    There matplotlib labels its minor ticks too (``2x10^1 3x10^1 4x10^1 ...``), and the
    labels run into each other. Instead: the plotted values themselves when
    ``at_values`` and there are at most 8 of them, else 1, 2 and 5 of each decade;
    labelled ``20``, ``50``, ``100``; minor ticks unlabelled.
    """
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    values = sorted({v for v in values if v > 0 and math.isfinite(v)})
    if len(values) < 2 or values[-1] / values[0] >= 100:
        return      # decades only: matplotlib's labels do not overlap
    if at_values and len(values) <= 8:
        axis.set_major_locator(FixedLocator(values))
    else:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _draw(plt, figure: Figure, result: ClaimResult, path: Path) -> None:
    fig = _figure(plt, figure, result)
    try:
        save_figure(fig, path, dpi=_DPI)
    finally:
        plt.close(fig)


def _figure(plt, figure: Figure, result: ClaimResult):
    """The matplotlib figure of ``figure`` (the caller closes it)."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for s in figure.series:
        if s.style == "points":
            ax.plot(s.x, s.y, linestyle="none", marker="*", markersize=12, color="crimson",
                    label=s.label, zorder=5)
        else:
            ax.plot(s.x, s.y, marker="o", markersize=3, label=s.label)
    for (label, y), style in zip(figure.thresholds, ("--", ":", "-.", (0, (5, 1, 1, 1)))):
        ax.axhline(y, color="black", linestyle=style, linewidth=1.0, label=label)
    ax.set_xscale(figure.xscale)
    ax.set_yscale(figure.yscale)
    xs = [x for s in figure.series for x in s.x]
    if figure.xscale == "log":
        _readable_log_ticks(ax.xaxis, xs, at_values=True)
    elif xs and all(float(x).is_integer() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # k = 1, 2, 3: no 1.5
    if figure.yscale == "log":
        _readable_log_ticks(ax.yaxis, [y for s in figure.series for y in s.y]
                            + [y for _, y in figure.thresholds], at_values=False)
    ax.set_xlabel(figure.xlabel)
    ax.set_ylabel(figure.ylabel)
    ax.set_title(textwrap.fill(f"{result.paper} [{result.id}]", 80) + "\n" + textwrap.fill(figure.title, 80),
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- formatting


def _num(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}" if math.isfinite(value) else str(value)
    return str(value)


def _fmt(value, limit: int = _CELL) -> str:
    """A JSON-able value as short readable text: numbers to 3 digits, long lists cut."""
    value = to_jsonable(value)
    if isinstance(value, list):
        items = [_fmt(v, limit) for v in value[:_ITEMS]]
        more = f", ... ({len(value)} values)" if len(value) > _ITEMS else ""
        text = "[" + ", ".join(items) + more + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_fmt(v, limit)}" for k, v in value.items()) + "}"
    else:
        text = _num(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell(value) -> str:
    text = value if isinstance(value, str) else _fmt(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _records_table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return lines


def _evidence(values: dict) -> list[str]:
    """A dict as tables: scalars in one key/value table, each list of records or dict of
    records in a table of its own, short lists and small dicts as one readable cell."""
    values = to_jsonable(values)
    plain, tables = [], []
    for key, value in values.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) \
                and all(_is_scalar(x) or isinstance(x, list) for v in value for x in v.values()):
            tables += [f"*{key}*", ""] + _records_table(value) + [""]
        elif isinstance(value, dict) and len(value) > 1 and all(isinstance(v, dict) for v in value.values()):
            rows = [{"": k, **v} for k, v in value.items()]
            tables += [f"*{key}*", ""] + _records_table(rows) + [""]
        else:
            plain.append((key, value))
    lines = []
    if plain:
        lines += ["| evidence | value |", "|---|---|"]
        lines += [f"| {_cell(key)} | {_cell(value)} |" for key, value in plain]
        lines.append("")
    return lines + tables


def _figure_table(figure: Figure) -> list[str]:
    xs = sorted({x for s in figure.series for x in s.x})
    lines = [
        f"| {figure.xlabel} | " + " | ".join(_cell(s.label) for s in figure.series) + " |",
        "|---" * (len(figure.series) + 1) + "|",
    ]
    for x in xs:
        cells = []
        for s in figure.series:
            ys = [y for xx, y in zip(s.x, s.y) if xx == x]
            cells.append(f"{ys[0]:.4g}" if ys else "")
        lines.append(f"| {x:.4g} | " + " | ".join(cells) + " |")
    if figure.thresholds:
        lines += ["", "Reference lines: " + "; ".join(f"{label} = {y:.4g}" for label, y in figure.thresholds)]
    return lines


# --------------------------------------------------------------------------- sections


def machine_lines() -> list[str]:
    """refdml's version, the date and the machine, one Markdown bullet each."""
    import refdml

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    libraries = ", ".join(f"{name} {version(name)}" for name in ("numpy", "scipy", "POT", "hypothesis", "matplotlib"))
    return [
        f"- refdml {refdml.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: {platform.platform()} ({platform.machine() or 'unknown'}), "
        f"{os.cpu_count()} CPUs, {platform.processor() or 'processor not reported'}",
        f"- Python {platform.python_version()} ({sys.implementation.name}); {libraries}",
    ]


def _verdict_lines() -> list[str]:
    lines = ["| verdict | meaning |", "|---|---|"]
    lines += [f"| `{v.value}` | {meaning} |" for v, meaning in VERDICT_MEANINGS.items()]
    lines += ["| `crashed` | the check itself raised: a defect of refdml or of the check (exit status 1) |", "",
              "A verdict is computed from the readings below (`refdml.validation.decide`), never written by "
              "hand: a reading passes when no counterexample was found and its error is at most its tolerance. "
              "*Self-checks* are the finite-difference gradient checks of the refdml operators a claim uses; "
              "one that fails makes the exit status 1 whatever the verdict.", ""]
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
        "| error (deciding reading) | tolerance | error as printed | seeds | runtime |",
        "|---|---|---|---|---|",
        f"| {_fmt(result.error)} | {_fmt(result.tolerance)} | {_fmt(result.printed_error)} | "
        f"{_cell(list(result.seeds))} | {result.runtime_s:.2f} s |",
        "",
        "| reading | statement | error | tolerance | counterexample | passes | trials |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.readings:
        out.append(f"| {r['kind']} | {_cell(r['statement'])} | {_fmt(r['error'])} | {_fmt(r['tolerance'])} | "
                   f"{'none' if r['counterexample'] is None else 'found'} | {r['passed']} | {r['trials']} |")
    out.append("")
    if result.sizes:
        out += ["Sizes:", ""] + (_records_table(list(to_jsonable(result.sizes)))
                                 if all(isinstance(s, dict) for s in result.sizes)
                                 else [_cell(list(result.sizes))]) + [""]
    for title, example in (("Counterexample to the printed claim (smallest found)", result.counterexample),
                           ("Probe just outside the hypotheses", result.probe_counterexample)):
        if example is not None:
            out += [f"{title}:", ""]
            out += _evidence(example) if isinstance(example, dict) else [f"`{_fmt(example)}`", ""]
    if result.details:
        out += ["Evidence:", ""] + _evidence(result.details)
    if result.self_checks:
        out += ["Self-checks (gradient checks of refdml operators this claim uses):", "",
                "| operator | seed | max rel error | rtol | passed |", "|---|---|---|---|---|"]
        for row in result.self_checks:
            out.append(f"| {row['name']} | {row.get('seed', '-')} | {_fmt(row.get('max_rel_error'))} | "
                       f"{_fmt(row.get('rtol'))} | {row['passed']} {_cell(row.get('error', row.get('note', '')))} |")
        out.append("")
    for figure in result.figures:
        out += [f"### Figure: {figure.title}", ""]
        if plt is not None:
            path = figdir / f"{figure.name}.png"
            _draw(plt, figure, result, path)
            out += [f"![{figure.title}](figures/{path.name})", ""]
        out += _figure_table(figure) + [""]
    return out


def _first_line(path: Path) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.readline().rstrip("\n")
    except (OSError, UnicodeDecodeError):
        return ""


def is_report_folder(path) -> bool:
    """Is ``path`` a report that ``refdml verify`` wrote before it marked its folders
    (:data:`refdml._io.FOLDER_MARKER`)? Its ``report.md`` begins with the report's title
    and nothing else is there but ``figures/`` holding PNGs (and a killed write's
    temporary files). Such a folder may be replaced by the next ``--report``."""
    path = Path(path)
    if _first_line(path / "report.md") != _TITLE:
        return False
    for entry in path.iterdir():
        if entry.name == "report.md" or (entry.name.startswith(".") and entry.name.endswith(".tmp")):
            continue
        if entry.name != "figures" or not entry.is_dir() or entry.is_symlink():
            return False
        if any(not f.is_file() or not (f.suffix == ".png" or f.name.endswith(".tmp"))
               for f in entry.iterdir()):
            return False
    return True


def write_report(results: list[ClaimResult], directory, *, quick: bool, seed: int, runtime_s: float) -> Path:
    """Write ``DIR/report.md`` (and ``DIR/figures/*.png`` when matplotlib is installed)."""
    directory = Path(directory)
    figdir = directory / "figures"
    figdir.mkdir(parents=True, exist_ok=True)
    plt = _pyplot()
    lines = [
        _TITLE,
        "",
        f"Mode: {'quick' if quick else 'default'}; base seed {seed}; {len(results)} claims; "
        f"total runtime {runtime_s:.1f} s.",
        "",
        *machine_lines(),
        "",
        "## What the verdicts mean",
        "",
        *_verdict_lines(),
    ]
    if plt is None:
        lines += ["> matplotlib is not installed (`pip install refdml[plot]`): figures are not drawn; "
                  "every number behind them is in the tables below.", ""]
    lines += ["## Summary", "", "| claim | verdict | key number |", "|---|---|---|"]
    for r in results:
        flag = " (self-check FAILED)" if r.self_check_failed else ""
        lines.append(f"| `{r.id}` | {r.verdict}{flag} | {_cell(r.key_number)} |")
    lines.append("")
    for r in results:
        lines += _claim_section(r, figdir, plt)
    return write_text_atomic(directory / "report.md", "\n".join(lines))
