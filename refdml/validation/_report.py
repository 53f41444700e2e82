"""The Markdown report of ``refdml verify --report DIR`` (figures need matplotlib).

A person reads ``DIR/report.md`` top to bottom: what was run and where (refdml's version,
the date, the machine and the versions of the numerical libraries), what the verdicts mean,
a summary table, and for every claim a short section: the statement, the readings the
verdict is computed from (error against tolerance), the counterexample if one was found,
and the figures. It stays short whatever the sizes of a run (under 500 lines for the 27
claims of the default run); the rest goes beside it:

``DIR/claims/<claim id>.md``
    Everything else about one claim: sizes, counterexamples and probes in full, the
    evidence tables, the self-checks, the figures again.
``DIR/data/<figure name>.csv``
    The numbers behind each figure (so nothing depends on matplotlib being there), and
    ``DIR/data/<claim id>-<name>.csv`` every table of more than :data:`MAX_TABLE_ROWS`
    rows (its first rows are shown where the table would be). A header row, then one row
    per point; numbers as ``repr`` of their float64 (they read back exactly), an empty
    cell where a series has no point at that x, lists as JSON.
``DIR/figures/<figure name>.png``
    The figures, when matplotlib is installed.

Every file is written atomically (:mod:`refdml._io`).
"""

from __future__ import annotations

import csv
import datetime
import importlib.metadata
import io
import json
import math
import re
import os
import platform
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from refdml._io import save_figure, write_text_atomic

from ._framework import VERDICT_MEANINGS, ClaimResult, Figure, to_jsonable

__all__ = ["MAX_TABLE_ROWS", "is_report_folder", "machine_lines", "write_report"]

_TITLE = "# refdml verify: numerical checks of the claims of the four papers"

_CELL = 160  # longest cell of an evidence table, in characters
_ITEMS = 12  # numbers of a list shown before "... (N values)"
_DPI = 110   # of the PNGs: 6.4 x 4.4 inches, 704 x 484 pixels

#: A table of more rows goes to a CSV file in ``data/``; the report shows its first
#: :data:`_HEAD_ROWS` rows and links the file.
MAX_TABLE_ROWS = 20
_HEAD_ROWS = 5


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


def _records_table(rows: list[dict], columns: list[str] | None = None) -> list[str]:
    columns = columns or list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |")
    return lines


# --------------------------------------------------------------------------- CSV files


def _csv_cell(value) -> str:
    """A number as the ``repr`` of its float64 (it reads back exactly); None as an empty
    cell; a list or dict as JSON (whose floats are ``repr`` too)."""
    if value is None:
        return ""
    if isinstance(value, (bool, str)):
        return str(value)
    if isinstance(value, (int, float)):
        return repr(float(value)) if isinstance(value, float) else str(value)
    return json.dumps(to_jsonable(value), ensure_ascii=False)


def _csv_text(header: list[str], rows: list[list]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    writer.writerows([_csv_cell(v) for v in row] for row in rows)
    return buffer.getvalue()


def figure_rows(figure: Figure) -> tuple[list[str], list[list]]:
    """The table behind ``figure``: a header (its x label, then one column per series) and
    one row per x of any series, in increasing x, None where a series has no point there.
    A series with several points at one x takes as many rows (its k-th point at x in the
    k-th), so every point of every series is in the table exactly once."""
    columns = []
    for s in figure.series:
        at: dict[float, list[float]] = {}
        for x, y in zip(s.x, s.y):
            at.setdefault(x, []).append(y)
        columns.append(at)
    xs = sorted({x for s in figure.series for x in s.x}, key=lambda v: (math.isnan(v), v))
    rows = []
    for x in xs:
        for k in range(max(len(at.get(x, ())) for at in columns)):
            rows.append([x] + [at[x][k] if k < len(at.get(x, ())) else None for at in columns])
    return [figure.xlabel] + [s.label for s in figure.series], rows


class _DataFiles:
    """The CSV files of one report, in ``DIR/data``, each under a name of its own."""

    def __init__(self, directory: Path):
        self.directory = directory / "data"
        self.used: set[str] = set()

    def write(self, stem: str, header: list[str], rows: list[list]) -> str:
        """Write ``data/<stem>.csv`` (the stem made safe and unique); returns that path."""
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", stem).strip("._") or "table"
        unique, k = name, 1
        while unique in self.used:
            k += 1
            unique = f"{name}-{k}"
        self.used.add(unique)
        self.directory.mkdir(exist_ok=True)
        write_text_atomic(self.directory / f"{unique}.csv", _csv_text(header, rows))
        return f"data/{unique}.csv"


def _table(rows: list[dict], stem: str, data: _DataFiles, up: str) -> list[str]:
    """``rows`` as a Markdown table; beyond :data:`MAX_TABLE_ROWS` rows, the whole table as
    a CSV file and its first rows here. ``up`` leads from the page to the report folder."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    if len(rows) <= MAX_TABLE_ROWS:
        return _records_table(rows, columns)
    path = data.write(stem, columns, [[row.get(c) for c in columns] for row in rows])
    return _records_table(rows[:_HEAD_ROWS], columns) + [
        "", f"The first {_HEAD_ROWS} of {len(rows)} rows; all of them: [{path}]({up}{path})."]


def _evidence(values: dict, stem: str, data: _DataFiles, up: str) -> list[str]:
    """A dict as tables: scalars in one key/value table, each list of records or dict of
    records in a table of its own, short lists and small dicts as one readable cell."""
    values = to_jsonable(values)
    plain, tables = [], []
    for key, value in values.items():
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) \
                and all(_is_scalar(x) or isinstance(x, list) for v in value for x in v.values()):
            tables += [f"*{key}*", ""] + _table(value, f"{stem}-{key}", data, up) + [""]
        elif isinstance(value, dict) and len(value) > 1 and all(isinstance(v, dict) for v in value.values()):
            rows = [{"": k, **v} for k, v in value.items()]
            tables += [f"*{key}*", ""] + _table(rows, f"{stem}-{key}", data, up) + [""]
        else:
            plain.append((key, value))
    lines = []
    if plain:
        lines += ["| evidence | value |", "|---|---|"]
        lines += [f"| {_cell(key)} | {_cell(value)} |" for key, value in plain]
        lines.append("")
    return lines + tables


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


@dataclass(frozen=True)
class _Drawn:
    """Where one figure went: its PNG (None without matplotlib) and its CSV, relative to
    the report folder."""

    figure: Figure
    png: str | None
    csv: str
    rows: int


def _figures(result: ClaimResult, directory: Path, plt, data: _DataFiles) -> list[_Drawn]:
    drawn = []
    for figure in result.figures:
        header, rows = figure_rows(figure)
        path = data.write(figure.name, header, rows)
        png = None
        if plt is not None:
            png = f"figures/{figure.name}.png"
            _draw(plt, figure, result, directory / png)
        drawn.append(_Drawn(figure, png, path, len(rows)))
    return drawn


def _figure_lines(drawn: list[_Drawn], up: str) -> list[str]:
    out = []
    for d in drawn:
        lines = "" if not d.figure.thresholds else "; reference lines " + ", ".join(
            f"{label} = {y:.4g}" for label, y in d.figure.thresholds)
        numbers = f"[{d.csv}]({up}{d.csv}) ({d.rows} rows{lines})"
        if d.png is not None:   # the title is drawn on the figure
            out += [f"![{d.figure.title}]({up}{d.png})  ", f"The numbers behind it: {numbers}.", ""]
        else:
            out += [f"*Figure (not drawn): {d.figure.title}.* The numbers behind it: {numbers}.", ""]
    return out


def _deciding(result: ClaimResult) -> int | None:
    """The index of the reading that carries the verdict (:func:`refdml.validation.decide`)."""
    kind = {"holds-with-correction": "correction",
            "holds-under-extra-hypothesis": "extra-hypothesis"}.get(result.verdict, "printed")
    for i, r in enumerate(result.readings):
        if r["kind"] == kind and (kind == "printed" or r["passed"]):
            return i
    return None


def _readings(result: ClaimResult) -> list[str]:
    if len(result.readings) == 1:
        r = result.readings[0]
        found = "a counterexample found" if r["counterexample"] is not None else "no counterexample"
        return [f"**Reading** ({r['kind']}: {_cell(r['statement'])}): error {_fmt(r['error'])} against "
                f"tolerance {_fmt(r['tolerance'])}, {found} in {r['trials']} trials: "
                f"{'passes' if r['passed'] else 'does not pass'}.", ""]
    deciding = _deciding(result)
    out = ["| reading | statement | error | tolerance | counterexample | passes | trials |",
           "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(result.readings):
        kind = f"**{r['kind']}** (decides)" if i == deciding else r["kind"]
        out.append(f"| {kind} | {_cell(r['statement'])} | {_fmt(r['error'])} | {_fmt(r['tolerance'])} | "
                   f"{'none' if r['counterexample'] is None else 'found'} | {r['passed']} | {r['trials']} |")
    return out + [""]


def _head(result: ClaimResult, page: str | None = None) -> list[str]:
    out = [f"**Paper:** {result.paper}  ", f"**Statement (as printed):** {result.statement}  ",
           f"**Hypotheses:** {result.hypotheses}  ", f"**Key number:** {result.key_number}"]
    if page is not None:
        out[-1] += "  "
        out.append(f"**In full:** [{page}]({page}): sizes, evidence, {_self_check_summary(result)}; "
                   f"seeds {_cell(list(result.seeds))}; {result.runtime_s:.2f} s")
    out.append("")
    repairs = [f"**{title}:** {text}  " for title, text in (
        ("Correction (holds)", result.correction),
        ("Extra hypothesis needed", result.extra_hypothesis),
        ("Why inconclusive", result.inconclusive_reason)) if text]
    if repairs:
        out += repairs + [""]
    return out


def _self_check_summary(result: ClaimResult) -> str:
    if not result.self_checks:
        return "no self-checks"
    passed = sum(bool(row["passed"]) for row in result.self_checks)
    return f"self-checks: {passed} of {len(result.self_checks)} passed"


_EXAMPLES = (("Counterexample to the printed claim (smallest found)", "counterexample"),
             ("Probe just outside the hypotheses", "probe_counterexample"))


def _report_section(result: ClaimResult, drawn: list[_Drawn], page: str) -> list[str]:
    """The claim's section of report.md: a fixed handful of lines whatever the sizes of the
    run (the evidence in full is on ``page``)."""
    out = [f"## `{result.id}`: {result.verdict}", ""] + _head(result, page)
    if result.crashed:
        last = (result.crash or "").strip().splitlines()[-1:] or [""]
        return out + [f"The check crashed: `{_cell(last[0])}` (the traceback is on its page).", ""]
    out += _readings(result)
    examples = [f"**{title}:** `{_fmt(getattr(result, name), 2 * _CELL)}`  "
                for title, name in _EXAMPLES if getattr(result, name) is not None]
    if examples:
        out += examples + [""]
    return out + _figure_lines(drawn, "")


def _claim_page(result: ClaimResult, drawn: list[_Drawn], data: _DataFiles) -> list[str]:
    """``claims/<id>.md``: everything the report holds about one claim."""
    up = "../"
    stem = result.id
    out = [f"# `{result.id}`: {result.verdict}", "", f"[Back to the report]({up}report.md)", ""]
    out += _head(result)
    if result.crashed:
        return out + ["The check crashed:", "", "```", result.crash or "", "```", ""]
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
        out += ["Sizes:", ""] + (_table(list(to_jsonable(result.sizes)), f"{stem}-sizes", data, up)
                                 if all(isinstance(s, dict) for s in result.sizes)
                                 else [_cell(list(result.sizes))]) + [""]
    for title, name in _EXAMPLES:
        example = getattr(result, name)
        if example is not None:
            out += [f"{title}:", ""]
            out += (_evidence(example, f"{stem}-{name}", data, up) if isinstance(example, dict)
                    else [f"`{_fmt(example)}`", ""])
    if result.details:
        out += ["Evidence:", ""] + _evidence(result.details, stem, data, up)
    if result.self_checks:
        rows = [{"operator": row["name"], "seed": row.get("seed", "-"),
                 "max rel error": row.get("max_rel_error"), "rtol": row.get("rtol"),
                 "passed": f"{row['passed']} {row.get('error', row.get('note', ''))}".strip()}
                for row in result.self_checks]
        out += ["Self-checks (gradient checks of refdml operators this claim uses):", ""]
        out += _table(rows, f"{stem}-self_checks", data, up) + [""]
    return out + _figure_lines(drawn, up)


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


def _page_name(claim_id: str) -> str:
    return "claims/" + (re.sub(r"[^A-Za-z0-9._-]+", "_", claim_id).strip("._") or "claim") + ".md"


def write_report(results: list[ClaimResult], directory, *, quick: bool, seed: int, runtime_s: float) -> Path:
    """Write ``DIR/report.md``, ``DIR/claims/<id>.md``, ``DIR/data/*.csv`` and (when
    matplotlib is installed) ``DIR/figures/*.png``; returns the path of report.md."""
    directory = Path(directory)
    (directory / "figures").mkdir(parents=True, exist_ok=True)
    (directory / "claims").mkdir(exist_ok=True)
    plt = _pyplot()
    data = _DataFiles(directory)
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
        "Each claim below has its statement, its readings, any counterexample and its figures; "
        "its sizes, evidence tables and self-checks are on a page of its own in `claims/`, and the "
        "numbers behind every figure (and every table of more than "
        f"{MAX_TABLE_ROWS} rows) in a CSV file in `data/`.",
        "",
    ]
    if plt is None:
        lines += ["> matplotlib is not installed (`pip install refdml[plot]`): figures are not drawn; "
                  "the numbers behind each are in the CSV file linked in its place.", ""]
    lines += ["## Summary", "", "| claim | verdict | key number |", "|---|---|---|"]
    for r in results:
        flag = " (self-check FAILED)" if r.self_check_failed else ""
        lines.append(f"| `{r.id}` | {r.verdict}{flag} | {_cell(r.key_number)} |")
    lines.append("")
    pages = set()
    for r in results:
        page = _page_name(r.id)
        if page in pages:   # ids that differ only in unsafe characters
            page = page[:-3] + f"-{len(pages)}.md"
        pages.add(page)
        drawn = [] if r.crashed else _figures(r, directory, plt, data)
        write_text_atomic(directory / page, "\n".join(_claim_page(r, drawn, data)))
        lines += _report_section(r, drawn, page)
    return write_text_atomic(directory / "report.md", "\n".join(lines))
