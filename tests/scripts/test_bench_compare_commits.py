"""scripts/bench_compare_commits.py: its spec, how it reads cells, orders runs and summarises.

The driver times nothing itself: these tests feed it documents and fake benchmark scripts
whose numbers are chosen here, and check what it reads and computes from them. Nothing
here asserts a timing.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _load():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_compare_commits_under_test",
                                                  SCRIPTS / "bench_compare_commits.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


compare = _load()

SPEC = {
    "benches": [
        {"name": "fast", "command": ["scripts/bench_fake.py", "--size", "3"],
         "env": {"FAKE_MODE": "1", "GONE": None},
         "before": {"command": ["scripts/bench_fake.py", "--old"]}},
        {"name": "anchor", "command": ["scripts/bench_fake.py"], "script_tree": "after"},
    ],
    "measures": [
        {"label": "twin", "unit": "ms",
         "value": {"bench": "fast", "table": "^layer, B=", "row": {"path": "twin", "B": 256},
                   "column": "ms"},
         "anchor": {"bench": "anchor", "row": {"path": "torch", "B": 256}},
         "before": {"value": {"row": {"path": "old twin", "B": 256}}}},
        {"label": "bare", "value": {"bench": "fast", "table": "^layer, B=",
                                    "row": {"path": "twin", "B": 256}, "column": "ms"},
         "before": {"value": {"row": {"path": "old twin", "B": 256}}}},
    ],
}


def _doc(rows, title="layer, B=256 (median of 3)", columns=("path", "B", "ms")):
    return {"tables": [{"title": title, "columns": list(columns), "rows": rows, "notes": []},
                       {"title": "other table", "columns": ["path"], "rows": [["x"]],
                        "notes": []}]}


# --------------------------------------------------------------------------- the spec
def test_spec_sides_inherit_and_override():
    spec = compare.parse_spec(SPEC)
    fast, anchor = spec.benches["fast"], spec.benches["anchor"]
    assert fast.command == {"before": ("scripts/bench_fake.py", "--old"),
                            "after": ("scripts/bench_fake.py", "--size", "3")}
    assert fast.env["before"] == fast.env["after"] == {"FAKE_MODE": "1", "GONE": None}
    assert fast.script_tree == {"before": "before", "after": "after"}   # each side's own
    assert anchor.script_tree == {"before": "after", "after": "after"}
    twin, bare = spec.measures
    # The before side reads another row; the anchor takes every field it does not give
    # from the value, the side's override included.
    assert twin.value["before"].row == (("path", "old twin"), ("B", "256"))
    assert twin.value["after"].row == (("path", "twin"), ("B", "256"))
    assert twin.anchor["before"] == compare.Selector("anchor", "^layer, B=",
                                                     (("path", "torch"), ("B", "256")), "ms")
    assert twin.anchor["after"] == twin.anchor["before"]
    assert twin.unit == "ms" and bare.unit == "ms" and bare.anchor is None


@pytest.mark.parametrize("change, message", [
    (lambda s: s["benches"].append(dict(s["benches"][0])), "two benches are named 'fast'"),
    (lambda s: s["measures"][0]["value"].update(bench="nope"), "no bench named 'nope'"),
    (lambda s: s["measures"][0]["value"].update(table="(unclosed"), "no regular expression"),
    (lambda s: s["measures"][0]["value"].pop("column"), "missing ['column']"),
    (lambda s: s["measures"][0]["value"].update(row={}), "row must map"),
    (lambda s: s["benches"][0].update(command=[]), "non-empty list of strings"),
    (lambda s: s["benches"][0].update(script_tree="middle"), "script_tree == 'middle'"),
    (lambda s: s["benches"][0].update(env={"A": 1}), "strings or null"),
    (lambda s: s["benches"][0].update(colour="red"), "unknown keys ['colour']"),
    (lambda s: s["measures"][0]["before"].update(unit="s"), "overrides value and anchor only"),
    (lambda s: s["measures"].append(dict(s["measures"][1])), "labels repeat"),
    (lambda s: s.pop("measures"), "'benches' and 'measures'"),
])
def test_a_bad_spec_is_refused_by_name(change, message):
    spec = copy.deepcopy(SPEC)
    change(spec)
    with pytest.raises(compare.SpecError, match=message.replace("[", r"\[").replace("(", r"\(")):
        compare.parse_spec(spec)


def test_only_keeps_the_measures_of_a_bench_and_the_benches_they_read():
    spec = compare.parse_spec(SPEC)
    cut = compare.only(spec, ["fast"])
    assert set(cut.benches) == {"fast", "anchor"}           # the anchor's bench comes along
    assert [m.label for m in cut.measures] == ["twin", "bare"]
    assert compare.only(spec, ["anchor"]).measures == []    # it gives no measure's value
    with pytest.raises(compare.SpecError, match="no bench named"):
        compare.only(spec, ["missing"])


# --------------------------------------------------------------------------- reading cells
@pytest.mark.parametrize("cell, want", [("1.25", 1.25), ("0.97x", 0.97), ("12.3 ms", 12.3),
                                        ("1e-05", 1e-05), (3, 3.0), (2.5, 2.5), ("-4", -4.0),
                                        (".5 s", 0.5)])
def test_number_reads_the_first_number_of_a_cell(cell, want):
    assert compare.number(cell) == want


@pytest.mark.parametrize("cell", ["", "n/a", True])
def test_a_cell_without_a_number_is_an_error(cell):
    with pytest.raises(compare.SpecError, match="holds no number"):
        compare.number(cell)


def test_read_finds_one_table_one_row_one_column():
    doc = _doc([["twin", 256, "12.50"], ["twin", 4096, "190.0"], ["torch", 256, "30.00"]])
    selector = compare.Selector("fast", "^layer, B=", (("path", "twin"), ("B", "256")), "ms")
    assert compare.read(doc, selector) == 12.5
    torch = compare.Selector("fast", "B=256", (("path", "torch"),), "ms")   # searched
    assert compare.read(doc, torch) == 30.0
    for bad, message in [
        (compare.Selector("fast", "^nothing", (("path", "twin"),), "ms"), "0 tables match"),
        (compare.Selector("fast", "e", (("path", "twin"),), "ms"), "2 tables match"),
        (compare.Selector("fast", "^layer", (("path", "twin"),), "ms"), "2 rows match"),
        (compare.Selector("fast", "^layer", (("path", "cpu"),), "ms"), "0 rows match"),
        (compare.Selector("fast", "^layer", (("path", "twin"),), "s"), "columns are"),
        (compare.Selector("fast", "^layer", (("kind", "twin"),), "ms"), "no column 'kind'"),
    ]:
        with pytest.raises(compare.SpecError, match=message):
            compare.read(doc, bad)


# --------------------------------------------------------------------------- the schedule
def test_schedule_alternates_the_sides_and_swaps_their_order_every_round():
    order = compare.schedule(["a", "b"], 3)
    assert order == [(0, "a", "before"), (0, "a", "after"), (0, "b", "before"),
                     (0, "b", "after"),
                     (1, "a", "after"), (1, "a", "before"), (1, "b", "after"),
                     (1, "b", "before"),
                     (2, "a", "before"), (2, "a", "after"), (2, "b", "before"),
                     (2, "b", "after")]
    # Over an even number of rounds each side goes first equally often.
    firsts = [side for i, (_, _, side) in enumerate(compare.schedule(["a"], 4)) if i % 2 == 0]
    assert firsts.count("before") == firsts.count("after") == 2


def test_command_line_and_environment_of_a_side(tmp_path):
    spec = compare.parse_spec(SPEC)
    checkouts = {"before": compare.Checkout(tmp_path / "old", "/old/python", "aaaa"),
                 "after": compare.Checkout(tmp_path / "new", "/new/python", "bbbb")}
    fast, anchor = spec.benches["fast"], spec.benches["anchor"]
    assert compare.command_line(fast, "before", checkouts, "out.json") == [
        "/old/python", str(tmp_path / "old" / "scripts/bench_fake.py"), "--old",
        "--json", "out.json"]
    # script_tree "after": the before side runs the after checkout's script, with its own
    # Python (so its own refdml).
    assert compare.command_line(anchor, "before", checkouts, "x")[:2] == [
        "/old/python", str(tmp_path / "new" / "scripts/bench_fake.py")]
    env = compare.environment(fast, "after", base={"GONE": "1", "KEEP": "2"})
    assert env == {"KEEP": "2", "FAKE_MODE": "1"}


def test_bench_notes_say_how_each_side_ran_a_bench():
    spec = copy.deepcopy(SPEC)
    spec["benches"].append({"name": "same", "command": ["scripts/bench_fake.py", "--x"],
                            "env": {"A": "1"}})
    assert compare.bench_notes(compare.parse_spec(spec)) == [
        "fast, before: FAKE_MODE=1 GONE=(unset) python scripts/bench_fake.py --old",
        "fast, after: FAKE_MODE=1 GONE=(unset) python scripts/bench_fake.py --size 3",
        "anchor, before: python scripts/bench_fake.py (the after checkout's script)",
        "anchor, after: python scripts/bench_fake.py",
        "same, both sides: A=1 python scripts/bench_fake.py --x"]


# --------------------------------------------------------------------------- the summary
def _cells(values: dict) -> dict:
    """``values[(round, side)] = (twin, anchor)`` -> the driver's cells."""
    return {key: {("twin", "value"): twin, ("twin", "anchor"): anchor,
                  ("bare", "value"): twin}
            for key, (twin, anchor) in values.items()}


def test_summary_pairs_the_rounds_and_takes_medians():
    spec = compare.parse_spec(SPEC)
    cells = _cells({(0, "before"): (10.0, 20.0), (0, "after"): (9.0, 20.0),
                    (1, "before"): (12.0, 24.0), (1, "after"): (12.0, 30.0),
                    (2, "before"): (11.0, 22.0), (2, "after"): (12.1, 22.0)})
    twin, bare = compare.summarise(spec, cells, 3)
    assert twin["rounds"] == 3
    assert twin["before"] == 11.0 and twin["after"] == 12.0
    # rounds' after / before: 0.9, 1.0, 1.1
    assert twin["ratio"] == pytest.approx(1.0)
    assert twin["ratio_range"] == pytest.approx((0.9, 1.1))
    # value / anchor per round: before 0.5, 0.5, 0.5; after 0.45, 0.4, 0.55
    assert twin["before_anchor"] == pytest.approx(0.5)
    assert twin["after_anchor"] == pytest.approx(0.45)
    # the anchor's after / before: 1.0, 1.25, 1.0
    assert twin["anchor_ratio"] == pytest.approx(1.0)
    assert bare["before_anchor"] is bare["after_anchor"] is bare["anchor_ratio"] is None
    assert bare["ratio"] == pytest.approx(1.0)


def test_a_failed_run_leaves_its_round_out_of_the_measure():
    spec = compare.parse_spec(SPEC)
    cells = _cells({(0, "before"): (10.0, 20.0), (0, "after"): (20.0, 20.0),
                    (1, "before"): (10.0, 20.0), (1, "after"): (30.0, 20.0)})
    del cells[(1, "after")][("twin", "anchor")]           # the anchor's run failed
    twin, bare = compare.summarise(spec, cells, 2)
    assert twin["rounds"] == 1 and twin["ratio"] == pytest.approx(2.0)
    assert bare["rounds"] == 2 and bare["ratio"] == pytest.approx(2.5)
    empty = compare.summarise(spec, {}, 2)[0]
    assert empty["rounds"] == 0 and empty["before"] is None and empty["ratio_range"] is None
    assert compare.table_rows([empty])[0][3:] == ["", "", "", "", "", "", ""]


def test_table_rows_are_the_printed_cells():
    spec = compare.parse_spec(SPEC)
    cells = _cells({(0, "before"): (10.0, 20.0), (0, "after"): (9.0, 18.0)})
    rows = compare.table_rows(compare.summarise(spec, cells, 1))
    assert rows[0] == ["twin", "ms", 1, "10", "9", "0.900", "0.900-0.900", "0.5", "0.5",
                       "0.900"]
    assert rows[1][-3:] == ["", "", ""]
    text = compare.render(rows)
    assert text.splitlines()[0].split()[:2] == ["measure", "unit"]
    assert len(text.splitlines()) == 2 + len(rows)


# --------------------------------------------------------------------------- end to end
_FAKE = '''
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
out = args[args.index("--json") + 1]
value = float((Path(__file__).parents[1] / "VALUE").read_text())
if os.environ.get("FAKE_FAIL") == Path(__file__).parents[1].name:
    sys.exit(3)
rows = [["twin" if "--old" not in args else "old twin", 256, f"{value:.2f}"],
        ["torch", 256, "20.00"]]
doc = {"tables": [{"title": "layer, B=256 mode " + os.environ.get("FAKE_MODE", "-"),
                   "columns": ["path", "B", "ms"], "rows": rows, "notes": []}]}
Path(out).write_text(json.dumps(doc))
'''


def _checkouts(tmp_path):
    for name, value in (("old", "10"), ("new", "8")):
        (tmp_path / name / "scripts").mkdir(parents=True)
        (tmp_path / name / "scripts" / "bench_fake.py").write_text(_FAKE)
        (tmp_path / name / "VALUE").write_text(value)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(SPEC))
    return ["--spec", str(spec), "--before", str(tmp_path / "old"), "--before-python",
            sys.executable, "--after", str(tmp_path / "new"), "--after-python",
            sys.executable]


def test_end_to_end_each_side_runs_its_own_script_and_the_table_is_written(tmp_path):
    out = tmp_path / "compare.json"
    done = subprocess.run([sys.executable, str(SCRIPTS / "bench_compare_commits.py"),
                           *_checkouts(tmp_path), "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["schema"] == "refdml-bench/1"
    assert doc["script"] == "scripts/bench_compare_commits.py"
    (table,) = doc["tables"]
    assert table["columns"] == compare.COLUMNS
    twin, bare = table["rows"]
    # before: its own script (VALUE 10, the --old row); after: 8; the anchor reads 20 in
    # both (the after checkout's script, the row it always writes).
    assert twin[:10] == ["twin", "ms", 2, "10", "8", "0.800", "0.800-0.800", "0.5",
                         "0.4", "1.000"]
    assert bare[5] == "0.800"
    assert str(tmp_path) not in json.dumps(doc)             # no checkout paths written
    runs = doc["comparison"]["runs"]
    assert [(r["round"], r["bench"], r["side"]) for r in runs] == compare.schedule(
        ["fast", "anchor"], 2)
    assert all(r["error"] is None for r in runs)
    assert doc["comparison"]["values"][0]["before"]["value"] == [10.0, 10.0]
    assert doc["notes"][1:] == compare.bench_notes(compare.parse_spec(SPEC))


def test_end_to_end_a_failed_run_is_reported_and_a_missing_cell_stops(tmp_path):
    args = _checkouts(tmp_path)
    script = str(SCRIPTS / "bench_compare_commits.py")
    failed = subprocess.run([sys.executable, script, *args, "--rounds", "1"],
                            env={**os.environ, "FAKE_FAIL": "old"}, capture_output=True,
                            text=True, timeout=120)
    assert failed.returncode == 1
    assert "FAILED: exit status 3" in failed.stdout
    spec = json.loads((tmp_path / "spec.json").read_text())
    spec["measures"][0]["value"]["column"] = "seconds"
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    missing = subprocess.run([sys.executable, script, *args, "--rounds", "1"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "columns are ['path', 'B', 'ms']" in missing.stderr
