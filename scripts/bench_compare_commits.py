"""Two checkouts of refdml timed side by side: benchmark commands alternated, before and after.

Not a test. A change that must leave a speed "unchanged or better" is measured here: the
same benchmark commands run in a checkout of the commit before the change and in one
after it, each checkout with its own Python (a virtual environment where refdml is
installed from that checkout), alternating in one session so that whatever the machine
does meanwhile (other jobs, thermal drift) falls on both alike.

    python scripts/bench_compare_commits.py --spec SPEC.json \\
        --before ../before --before-python ../venv-before/bin/python \\
        [--after .] [--after-python PY] [--rounds 5] [--only BENCH] [--list] [--json PATH]

**The spec** (JSON) names the benchmark commands and what to read from their ``--json``
documents (schema ``refdml-bench/1``, scripts/_bench.py)::

    {"benches": [
       {"name": "gsp", "command": ["scripts/bench_gpu.py", "--only", "gsp"],
        "env": {"OPENBLAS_NUM_THREADS": "1"},          # null removes a variable
        "script_tree": "after",                        # optional, see below
        "before": {"command": [...], "env": {...}, "script_tree": ...}},   # optional
       ...],
     "measures": [
       {"label": "GSP layer B=256 float32, CPU twin", "unit": "ms",
        "value": {"bench": "gsp", "table": "^GSP pooling forward \\\\+ backward, B=256",
                  "row": {"path": "cpu twin float32"}, "column": "ms"},
        "anchor": {"bench": "torch_gsp", "table": "...", "row": {...}},
        "before": {"value": {"row": {...}}}},        # optional, see below
       ...]}

A bench's ``command`` starts with a script's path relative to a checkout; it runs with the
side's Python, in the side's checkout, with ``--json FILE`` appended, in the driver's
environment updated by ``env``. The script is the side's own (its own bench code times
its own refdml) unless ``script_tree`` names the checkout whose script both sides run
(a section the older checkout lacks); refdml itself is always the side's. A measure reads
one cell: the only table whose title matches ``table`` (a regular expression, searched),
the only row whose cells equal ``row`` (column -> value, compared as text), the cell in
``column``, read as the first number in it. Its ``anchor`` (optional) is read the same
way, each field defaulting to the value's: a named alternative (PyTorch, POT, a matrix
product bound) timed by the same run or by another bench of the same round and side.
Under a side's key (``before`` / ``after``) a bench or a measure overrides fields for that
side only: where the older code names a row or a table differently.

**Rounds.** Every round runs every bench on both sides; the order of the sides swaps from
round to round (before-after, then after-before, ...), so that a steady drift of the
machine weighs on both equally. A run that fails is reported and leaves a gap: a measure
uses the rounds where both of its runs (value and anchor) succeeded.

**The table.** Per measure: the medians over the rounds of each side's value; after /
before, the median over the rounds of the round's ratio (the two runs of a round are
neighbours in time), and its range over the rounds; each side's ratio to its anchor
(median over the rounds of value / anchor, the two read from the same side and round);
and the anchor's own after / before, which says how much the machine moved between the
sides (the anchor's code is the same on both). Above 1, after / before is slower.

``--json PATH``: the table as a ``refdml-bench/1`` document (the docs' benchmarks page is
generated from such files), with every round's values under ``comparison``; checkout
paths are not written, only the commits. ``--list`` prints the runs in their order and
exits. Exit status: 0; 1 when some run failed; 2 for a bad spec or a cell not found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402

SIDES = ("before", "after")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_SELECTOR_KEYS = {"bench", "table", "row", "column"}


class SpecError(ValueError):
    """A spec that cannot be run, or a cell its selectors do not find."""


# --------------------------------------------------------------------------- the spec
@dataclasses.dataclass(frozen=True)
class Bench:
    """One benchmark command, as each side runs it."""

    name: str
    command: dict[str, tuple[str, ...]]        # side -> script path + arguments
    env: dict[str, dict[str, str | None]]      # side -> variables (None: removed)
    script_tree: dict[str, str]                # side -> the checkout whose script runs


@dataclasses.dataclass(frozen=True)
class Selector:
    """Where a number sits in a bench's document (see the module docstring)."""

    bench: str
    table: str
    row: tuple[tuple[str, str], ...]
    column: str

    def describe(self) -> str:
        row = ", ".join(f"{k}={v}" for k, v in self.row)
        return f"{self.bench}: table /{self.table}/, row [{row}], column {self.column!r}"


@dataclasses.dataclass(frozen=True)
class Measure:
    label: str
    unit: str
    value: dict[str, Selector]                 # side -> selector
    anchor: dict[str, Selector] | None         # side -> selector, or no anchor


@dataclasses.dataclass(frozen=True)
class Spec:
    benches: dict[str, Bench]
    measures: list[Measure]


def _strings(value, what: str) -> tuple[str, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(item, str) and item for item in value)):
        raise SpecError(f"{what} must be a non-empty list of strings, got {value!r}")
    return tuple(value)


def _env(value, what: str) -> dict[str, str | None]:
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in value.items()):
        raise SpecError(f"{what} must map names to strings or null, got {value!r}")
    return dict(value)


def _tree(value, what: str, side: str) -> str:
    if value is None:
        return side
    if value not in SIDES:
        raise SpecError(f"{what} == {value!r}, must be 'before' or 'after'")
    return value


def _side_keys(entry: dict, allowed: set[str], what: str) -> None:
    unknown = set(entry) - allowed - set(SIDES)
    if unknown:
        raise SpecError(f"{what}: unknown keys {sorted(unknown)}")
    for side in SIDES:
        extra = entry.get(side, {})
        if not isinstance(extra, dict) or set(extra) - allowed:
            raise SpecError(f"{what}[{side!r}] must be an object with keys among "
                            f"{sorted(allowed)}, got {extra!r}")


def _bench(entry) -> Bench:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"]:
        raise SpecError(f"a bench is an object with a non-empty 'name', got {entry!r}")
    name = entry["name"]
    _side_keys(entry, {"name", "command", "env", "script_tree"}, f"bench {name!r}")
    command, env, tree = {}, {}, {}
    for side in SIDES:
        own = {**{k: v for k, v in entry.items() if k not in SIDES}, **entry.get(side, {})}
        command[side] = _strings(own.get("command"), f"bench {name!r} command ({side})")
        env[side] = {**_env(entry.get("env", {}), f"bench {name!r} env"),
                     **_env(entry.get(side, {}).get("env", {}), f"bench {name!r} env ({side})")}
        tree[side] = _tree(own.get("script_tree"), f"bench {name!r} script_tree", side)
    return Bench(name, command, env, tree)


def _selector(fields: dict, what: str, benches: dict) -> Selector:
    missing = _SELECTOR_KEYS - set(fields)
    if missing:
        raise SpecError(f"{what}: missing {sorted(missing)}")
    if set(fields) - _SELECTOR_KEYS:
        raise SpecError(f"{what}: unknown keys {sorted(set(fields) - _SELECTOR_KEYS)}")
    if fields["bench"] not in benches:
        raise SpecError(f"{what}: no bench named {fields['bench']!r}")
    for key in ("table", "column"):
        if not isinstance(fields[key], str) or not fields[key]:
            raise SpecError(f"{what}: {key} must be a non-empty string, got {fields[key]!r}")
    try:
        re.compile(fields["table"])
    except re.error as exc:
        raise SpecError(f"{what}: table {fields['table']!r} is no regular expression "
                        f"({exc})") from None
    row = fields["row"]
    if not isinstance(row, dict) or not row or not all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in row.values()):
        raise SpecError(f"{what}: row must map columns to strings or numbers, got {row!r}")
    return Selector(fields["bench"], fields["table"],
                    tuple((str(k), str(v)) for k, v in row.items()), fields["column"])


def _measure(entry, benches: dict) -> Measure:
    if not isinstance(entry, dict) or not isinstance(entry.get("label"), str) \
            or not entry["label"]:
        raise SpecError(f"a measure is an object with a non-empty 'label', got {entry!r}")
    label = entry["label"]
    _side_keys(entry, {"label", "unit", "value", "anchor"}, f"measure {label!r}")
    for side in SIDES:
        if set(entry.get(side, {})) - {"value", "anchor"}:
            raise SpecError(f"measure {label!r}[{side!r}] overrides value and anchor only")
    if not isinstance(entry.get("value"), dict):
        raise SpecError(f"measure {label!r}: 'value' must be an object")
    has_anchor = "anchor" in entry
    if has_anchor and not isinstance(entry["anchor"], dict):
        raise SpecError(f"measure {label!r}: 'anchor' must be an object")
    value, anchor = {}, {}
    for side in SIDES:
        extra = entry.get(side, {})
        own = {**entry["value"], **extra.get("value", {})}
        value[side] = _selector(own, f"measure {label!r} value ({side})", benches)
        if has_anchor:
            fields = {**own, **entry["anchor"], **extra.get("anchor", {})}
            anchor[side] = _selector(fields, f"measure {label!r} anchor ({side})", benches)
    unit = entry.get("unit", value["after"].column)
    if not isinstance(unit, str):
        raise SpecError(f"measure {label!r}: unit must be a string, got {unit!r}")
    return Measure(label, unit, value, anchor if has_anchor else None)


def parse_spec(data) -> Spec:
    """The spec from its JSON value; :class:`SpecError` names what is wrong."""
    if not isinstance(data, dict) or set(data) != {"benches", "measures"}:
        raise SpecError("a spec is an object with the keys 'benches' and 'measures'")
    if not isinstance(data["benches"], list) or not data["benches"]:
        raise SpecError("'benches' must be a non-empty list")
    benches: dict[str, Bench] = {}
    for entry in data["benches"]:
        bench = _bench(entry)
        if bench.name in benches:
            raise SpecError(f"two benches are named {bench.name!r}")
        benches[bench.name] = bench
    if not isinstance(data["measures"], list) or not data["measures"]:
        raise SpecError("'measures' must be a non-empty list")
    measures = [_measure(entry, benches) for entry in data["measures"]]
    labels = [m.label for m in measures]
    if len(set(labels)) != len(labels):
        raise SpecError(f"measure labels repeat: {labels}")
    return Spec(benches, measures)


def only(spec: Spec, names) -> Spec:
    """``spec`` cut down to the measures whose value one of the benches ``names`` gives,
    and the benches those measures read (their anchors' too)."""
    unknown = set(names) - set(spec.benches)
    if unknown:
        raise SpecError(f"--only: no bench named {sorted(unknown)}")
    measures = [m for m in spec.measures if {s.bench for s in m.value.values()} & set(names)]
    needed = set(names) | {s.bench for m in measures
                           for chosen in (m.value, m.anchor or {}) for s in chosen.values()}
    return Spec({n: b for n, b in spec.benches.items() if n in needed}, measures)


# --------------------------------------------------------------------------- reading cells
def number(cell) -> float:
    """A table cell as a number: a JSON number, or the first number in its text
    (``"1.25"``, ``"0.97x"``, ``"12.3 ms"``, ``"1e-05"``)."""
    if isinstance(cell, bool):
        raise SpecError(f"cell {cell!r} holds no number")
    if isinstance(cell, (int, float)):
        return float(cell)
    match = _NUMBER.search(str(cell))
    if match is None:
        raise SpecError(f"cell {cell!r} holds no number")
    return float(match.group())


def read(doc: dict, selector: Selector) -> float:
    """The number ``selector`` points at in ``doc``; :class:`SpecError` when the table, the
    row or the column is missing or not unique (the message lists what there is)."""
    tables = [t for t in doc.get("tables", []) if re.search(selector.table, t["title"])]
    if len(tables) != 1:
        titles = "; ".join(t["title"][:70] for t in doc.get("tables", []))
        raise SpecError(f"{selector.describe()}: {len(tables)} tables match (titles: {titles})")
    table = tables[0]
    if selector.column not in table["columns"]:
        raise SpecError(f"{selector.describe()}: columns are {table['columns']}")
    positions = {}
    for key, _ in selector.row:
        if key not in table["columns"]:
            raise SpecError(f"{selector.describe()}: no column {key!r} ({table['columns']})")
        positions[key] = table["columns"].index(key)
    rows = [r for r in table["rows"]
            if all(str(r[positions[k]]) == want for k, want in selector.row)]
    if len(rows) != 1:
        raise SpecError(f"{selector.describe()}: {len(rows)} rows match (first cells: "
                        f"{[r[0] for r in table['rows']]})")
    return number(rows[0][table["columns"].index(selector.column)])


# --------------------------------------------------------------------------- the schedule
def schedule(bench_names, rounds: int) -> list[tuple[int, str, str]]:
    """``(round, bench, side)`` in running order: each round every bench on both sides,
    the sides' order swapped every round (before first in round 0)."""
    order = []
    for index in range(rounds):
        sides = SIDES if index % 2 == 0 else SIDES[::-1]
        order += [(index, name, side) for name in bench_names for side in sides]
    return order


@dataclasses.dataclass(frozen=True)
class Checkout:
    """One side: a checkout and the Python whose refdml is installed from it."""

    root: Path
    python: str
    commit: str


def command_line(bench: Bench, side: str, checkouts: dict[str, Checkout],
                 json_path: str) -> list[str]:
    script, *arguments = bench.command[side]
    tree = checkouts[bench.script_tree[side]].root
    return [checkouts[side].python, str(tree / script), *arguments, "--json", json_path]


def environment(bench: Bench, side: str, base=None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    for name, value in bench.env[side].items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def git_commit(root: Path) -> str:
    """Short SHA of ``root``'s HEAD, ``+dirty`` when its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=False)
    try:
        head = git("rev-parse", "--short", "HEAD")
    except OSError:                          # no git
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+dirty" if dirty else "")


# --------------------------------------------------------------------------- the summary
def _selectors_of(spec: Spec, bench: str, side: str) -> list[tuple[str, str, Selector]]:
    """(measure label, "value" | "anchor", selector) read from ``bench``'s run on ``side``."""
    out = []
    for measure in spec.measures:
        for role, chosen in (("value", measure.value), ("anchor", measure.anchor)):
            if chosen is not None and chosen[side].bench == bench:
                out.append((measure.label, role, chosen[side]))
    return out


def extract(spec: Spec, bench: str, side: str, doc: dict) -> dict[tuple[str, str], float]:
    """Every number the measures read from one run: ``(label, role) -> value``."""
    return {(label, role): read(doc, selector)
            for label, role, selector in _selectors_of(spec, bench, side)}


def _median(values):
    return statistics.median(values) if values else None


def summarise(spec: Spec, cells: dict, rounds: int) -> list[dict]:
    """One dict per measure from ``cells[(round, side)][(label, role)]`` (the numbers
    :func:`extract` read; a failed run's are absent). Keys: ``label``, ``unit``,
    ``rounds`` (rounds with all of the measure's numbers on both sides), ``before`` and
    ``after`` (medians of the values), ``ratio`` (median of the rounds' after / before),
    ``ratio_range`` ((min, max) of those), ``before_anchor`` and ``after_anchor``
    (medians of value / anchor per round), ``anchor_ratio`` (median of the anchor's after /
    before); None where nothing was measured or there is no anchor."""
    out = []
    for measure in spec.measures:
        roles = ("value", "anchor") if measure.anchor is not None else ("value",)
        per_side = {side: {} for side in SIDES}
        for index in range(rounds):
            for side in SIDES:
                got = cells.get((index, side), {})
                if all((measure.label, role) in got for role in roles):
                    per_side[side][index] = {role: got[measure.label, role] for role in roles}
        paired = sorted(set(per_side["before"]) & set(per_side["after"]))
        ratios = [per_side["after"][i]["value"] / per_side["before"][i]["value"]
                  for i in paired]
        entry = {
            "label": measure.label, "unit": measure.unit, "rounds": len(paired),
            "before": _median([per_side["before"][i]["value"] for i in paired]),
            "after": _median([per_side["after"][i]["value"] for i in paired]),
            "ratio": _median(ratios),
            "ratio_range": (min(ratios), max(ratios)) if ratios else None,
            "before_anchor": None, "after_anchor": None, "anchor_ratio": None,
        }
        if measure.anchor is not None:
            for side in SIDES:
                entry[f"{side}_anchor"] = _median(
                    [per_side[side][i]["value"] / per_side[side][i]["anchor"] for i in paired])
            entry["anchor_ratio"] = _median(
                [per_side["after"][i]["anchor"] / per_side["before"][i]["anchor"]
                 for i in paired])
        out.append(entry)
    return out


COLUMNS = ["measure", "unit", "rounds", "before", "after", "after / before",
           "after / before range", "before / anchor", "after / anchor",
           "anchor after / before"]


def _fmt(value, digits: str) -> str:
    return "" if value is None else format(value, digits)


def table_rows(summary: list[dict]) -> list[list]:
    """The cells of :data:`COLUMNS` for each measure, as printed."""
    rows = []
    for entry in summary:
        low_high = entry["ratio_range"]
        rows.append([
            entry["label"], entry["unit"], entry["rounds"], _fmt(entry["before"], ".4g"),
            _fmt(entry["after"], ".4g"), _fmt(entry["ratio"], ".3f"),
            "" if low_high is None else f"{low_high[0]:.3f}-{low_high[1]:.3f}",
            _fmt(entry["before_anchor"], ".4g"), _fmt(entry["after_anchor"], ".4g"),
            _fmt(entry["anchor_ratio"], ".3f")])
    return rows


def render(rows: list[list]) -> str:
    """``rows`` under :data:`COLUMNS` as aligned text."""
    text = [[str(c) for c in COLUMNS]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in text) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(r, widths))) for r in text]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# --------------------------------------------------------------------------- running
def _load() -> str:
    return "%.2f %.2f %.2f" % os.getloadavg()


def run_all(spec: Spec, checkouts: dict[str, Checkout], order, *, timeout: float,
            log=print) -> tuple[dict, list[dict]]:
    """Run ``order`` (:func:`schedule`); ``(cells, runs)``: the numbers read per
    ``(round, side)``, and one record per run (bench, side, round, seconds, load average
    before it, error or None). A cell the selectors cannot find raises :class:`SpecError`
    at once (a spec error, not a failed run)."""
    cells: dict = {}
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        for count, (index, name, side) in enumerate(order, 1):
            bench = spec.benches[name]
            path = os.path.join(folder, f"{index}-{name}-{side}.json")
            argv = command_line(bench, side, checkouts, path)
            load = _load()
            start = time.perf_counter()
            try:
                done = subprocess.run(argv, cwd=checkouts[side].root,
                                      env=environment(bench, side), capture_output=True,
                                      text=True, timeout=timeout, check=False)
                error = (None if done.returncode == 0 else
                         f"exit status {done.returncode}: {done.stderr.strip()[-2000:]}")
            except subprocess.TimeoutExpired:
                error = f"timed out after {timeout:g} s"
            seconds = time.perf_counter() - start
            if error is None:
                with open(path, encoding="utf-8") as handle:
                    doc = json.load(handle)
                cells.setdefault((index, side), {}).update(extract(spec, name, side, doc))
            runs.append({"round": index, "bench": name, "side": side,
                         "seconds": round(seconds, 2), "load_before": load, "error": error})
            log(f"[{count}/{len(order)}] round {index + 1}, {name}, {side}: {seconds:.1f} s "
                f"(load before {load})" + (f"\n  FAILED: {error}" if error else ""))
    return cells, runs


def _values(spec: Spec, cells: dict, rounds: int) -> list[dict]:
    """Every number read, per measure, side and round (None where a run failed)."""
    out = []
    for measure in spec.measures:
        entry = {"label": measure.label}
        for side in SIDES:
            entry[side] = {role: [cells.get((i, side), {}).get((measure.label, role))
                                  for i in range(rounds)]
                           for role in (("value", "anchor") if measure.anchor else ("value",))}
        out.append(entry)
    return out


def _bench_line(bench: Bench, side: str) -> str:
    """How ``side`` runs ``bench``, for the document's notes: variables, command, and whose
    script."""
    env = " ".join(f"{k}={'(unset)' if v is None else v}" for k, v in bench.env[side].items())
    script_of = bench.script_tree[side]
    return ((f"{env} " if env else "") + "python " + " ".join(bench.command[side])
            + ("" if script_of == side else f" (the {script_of} checkout's script)"))


def bench_notes(spec: Spec) -> list[str]:
    """One line per bench saying how it ran: one for both sides where they ran it alike,
    else one per side."""
    notes = []
    for name, bench in spec.benches.items():
        lines = {side: _bench_line(bench, side) for side in SIDES}
        if lines["before"] == lines["after"]:
            notes.append(f"{name}, both sides: {lines['after']}")
        else:
            notes += [f"{name}, {side}: {lines[side]}" for side in SIDES]
    return notes


def _shown(path: str, root: Path) -> str:
    """``path`` as the document shows it: relative to the after checkout when inside it,
    else its file name (no machine's paths in the docs)."""
    full = Path(path).resolve()
    return str(full.relative_to(root)) if full.is_relative_to(root) else full.name


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the benches and measures (JSON)")
    parser.add_argument("--before", required=True, help="checkout of the earlier commit")
    parser.add_argument("--before-python", required=True,
                        help="Python whose refdml is installed from --before")
    parser.add_argument("--after", default=str(Path(__file__).resolve().parents[1]),
                        help="checkout of the later commit (default: this one)")
    parser.add_argument("--after-python", default=sys.executable,
                        help="Python whose refdml is installed from --after (default: this)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", action="append", help="run only these benches (repeatable)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--list", action="store_true", help="print the runs and exit")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the table to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds == {args.rounds}, must be at least 1")
    try:
        with open(args.spec, encoding="utf-8") as handle:
            spec = parse_spec(json.load(handle))
        if args.only:
            spec = only(spec, args.only)
    except (OSError, json.JSONDecodeError, SpecError) as exc:
        print(f"bench_compare_commits.py: error: {exc}", file=sys.stderr)
        return 2
    checkouts = {side: Checkout(Path(getattr(args, side)).resolve(),
                                getattr(args, f"{side}_python"),
                                git_commit(Path(getattr(args, side)).resolve()))
                 for side in SIDES}
    order = schedule(list(spec.benches), args.rounds)
    if args.list:
        for index, name, side in order:
            bench = spec.benches[name]
            print(f"round {index + 1} {side:6s} {name}: "
                  + " ".join(command_line(bench, side, checkouts, "FILE")))
        return 0
    start_load = _load()
    print(f"before {checkouts['before'].commit}, after {checkouts['after'].commit}; "
          f"{args.rounds} rounds; {os.cpu_count()} cores; load average {start_load}")
    try:
        cells, runs = run_all(spec, checkouts, order, timeout=args.timeout)
    except SpecError as exc:
        print(f"bench_compare_commits.py: error: {exc}", file=sys.stderr)
        return 2
    summary = summarise(spec, cells, args.rounds)
    rows = table_rows(summary)
    end_load = _load()
    failed = [r for r in runs if r["error"]]
    print()
    print(render(rows))
    print(f"\nload average at the start {start_load}, at the end {end_load}; "
          f"{len(failed)} of {len(runs)} runs failed")
    if args.json:
        table = Table(
            f"before (commit {checkouts['before'].commit}) and after (commit "
            f"{checkouts['after'].commit}), each bench run {args.rounds} times per side, "
            "alternating (the sides' order swapped every round): medians over the rounds; "
            "after / before: median of the rounds' ratios (above 1: slower after) and their "
            "range; x / anchor: median of value / anchor within a side's runs; anchor "
            "after / before: how far the machine moved between the sides", COLUMNS)
        for row in rows:
            table.add(*row)
        notes = [f"{os.cpu_count()} cores; load average at the start {start_load}, at the "
                 f"end {end_load}; {len(failed)} of {len(runs)} runs failed"]
        notes += bench_notes(spec)
        root = checkouts["after"].root
        shown_argv = ["--spec", _shown(args.spec, root),
                      "--before", f"<checkout of {checkouts['before'].commit}>",
                      "--before-python", "<its python>", "--rounds", str(args.rounds)]
        for name in args.only or ():
            shown_argv += ["--only", name]
        write_json(args.json, script=__file__,
                   argv=shown_argv + ["--json", _shown(args.json, root)],
                   tables=[table], notes=notes,
                   extra={"comparison": {
                       "commits": {side: checkouts[side].commit for side in SIDES},
                       "rounds": args.rounds, "runs": runs,
                       "values": _values(spec, cells, args.rounds)}})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
