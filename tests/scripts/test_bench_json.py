"""scripts/_bench.py's ``--json`` writer (schema ``refdml-bench/1``) and the benchmark scripts
that use it.

The writer's document is what the documentation's benchmarks page is generated from: these
tests pin its keys and types, its atomic write, and that a cheap run of a real script
writes a valid document. Nothing here asserts a timing.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
TOP_KEYS = {"schema", "script", "command", "date", "machine", "git_commit", "tables", "notes"}
MACHINE_KEYS = {"cpu", "cores", "python", "numpy", "blas", "device"}
TABLE_KEYS = {"title", "columns", "rows", "notes"}


def _load(name: str):
    """scripts/ is no package: a script is loaded from its file (scripts/ on sys.path for
    the ``from _bench import ...`` of the benchmark scripts)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load("_bench")


def check_document(doc: dict, *, script: str | None = None) -> None:
    """Every key and type of a ``refdml-bench/1`` document (extra top-level keys allowed)."""
    assert TOP_KEYS <= set(doc), sorted(TOP_KEYS - set(doc))
    assert doc["schema"] == "refdml-bench/1"
    assert isinstance(doc["script"], str) and doc["script"]
    if script is not None:
        assert doc["script"] == script
    assert isinstance(doc["command"], str) and doc["command"].startswith("python ")
    datetime.date.fromisoformat(doc["date"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"])
    machine = doc["machine"]
    assert set(machine) == MACHINE_KEYS
    assert isinstance(machine["cores"], int) and machine["cores"] >= 1
    for key in MACHINE_KEYS - {"cores"}:
        assert isinstance(machine[key], str) and machine[key], key
    assert doc["git_commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}", doc["git_commit"])
    assert isinstance(doc["tables"], list)
    for table in doc["tables"]:
        assert set(table) == TABLE_KEYS
        assert isinstance(table["title"], str) and table["title"]
        assert all(isinstance(c, str) for c in table["columns"]) and table["columns"]
        for row in table["rows"]:
            assert len(row) == len(table["columns"])
            for cell in row:
                assert isinstance(cell, (str, int, float)) and not isinstance(cell, bool)
        assert all(isinstance(n, str) for n in table["notes"])
    assert all(isinstance(n, str) for n in doc["notes"])


def _table():
    table = bench.Table("time of x vs y (n=10); ratios against y", ["path", "n", "ms", "/ y"])
    table.add("x", 10, "1.25", "0.50x")
    table.add("y", 10, "2.50", "1.00x")
    table.note("load 0.5")
    return table


def _write(path, **kwargs):
    return bench.write_json(path, script=str(SCRIPTS / "bench_example.py"),
                            argv=["--quick", "--json", str(path)], tables=[_table()],
                            notes=["a note"], **kwargs)


# --------------------------------------------------------------------------- the document
def test_document_has_the_schema_keys_and_types(tmp_path):
    path = tmp_path / "out.json"
    returned = _write(path)
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc == returned
    assert set(doc) == TOP_KEYS                      # nothing beyond the schema by default
    check_document(doc, script="scripts/bench_example.py")
    assert doc["command"] == f"python scripts/bench_example.py --quick --json {path}"
    assert doc["machine"]["device"] == "cpu"
    assert doc["machine"]["cores"] == os.cpu_count()
    assert doc["tables"] == [{"title": "time of x vs y (n=10); ratios against y",
                              "columns": ["path", "n", "ms", "/ y"],
                              "rows": [["x", 10, "1.25", "0.50x"], ["y", 10, "2.50", "1.00x"]],
                              "notes": ["load 0.5"]}]
    assert doc["notes"] == ["a note"]


def test_command_quotes_arguments_and_device_is_recorded(tmp_path):
    doc = bench.document(script=str(SCRIPTS / "bench_example.py"), argv=["--title", "a b"],
                         tables=[], device="FAKE GPU")
    assert doc["command"] == "python scripts/bench_example.py --title 'a b'"
    assert doc["machine"]["device"] == "FAKE GPU"
    # A script outside the repository keeps the path it was given.
    outside = bench.document(script="/elsewhere/bench_x.py", argv=[], tables=[])
    assert outside["script"] == "/elsewhere/bench_x.py"


def test_table_rejects_bad_rows_and_cells():
    table = bench.Table("t", ["a", "b"])
    with pytest.raises(ValueError, match="2 columns"):
        table.add("only one")
    for bad in (None, True, object(), [1]):
        with pytest.raises(TypeError):
            table.add("x", bad)
    assert table.rows == []
    # NumPy scalars become plain numbers; JSON has no inf / nan: they are kept as text.
    import numpy as np

    row = table.add(np.int64(3), np.float32(0.5))
    assert row == [3, 0.5] and type(row[0]) is int and type(row[1]) is float
    assert table.add(float("inf"), float("nan")) == ["inf", "nan"]


def test_a_table_dict_of_the_wrong_shape_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keys"):
        bench.document(script="x.py", argv=[], tables=[{"title": "t", "columns": []}])
    with pytest.raises(ValueError, match="cells"):
        bench.document(script="x.py", argv=[], tables=[
            {"title": "t", "columns": ["a"], "rows": [["1", "2"]], "notes": []}])


def test_extra_keys_go_beside_the_schema_never_over_it(tmp_path):
    path = tmp_path / "out.json"
    doc = _write(path, extra={"rows": [1, 2], "complete": True})
    assert doc["rows"] == [1, 2] and doc["complete"] is True
    check_document(json.loads(path.read_text(encoding="utf-8")))
    with pytest.raises(ValueError, match="replace"):
        _write(tmp_path / "other.json", extra={"tables": []})
    assert not (tmp_path / "other.json").exists()


def test_machine_without_threadpoolctl_or_git(monkeypatch):
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)     # import fails
    assert bench.machine()["blas"] == "unknown"

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(bench.subprocess, "run", no_git)
    assert bench.git_commit() is None


def test_blas_is_numpys_when_threadpoolctl_answers():
    pytest.importorskip("threadpoolctl")
    blas = bench.machine()["blas"]
    assert blas != "" and isinstance(blas, str)


# --------------------------------------------------------------------------- atomic write
def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


@pytest.mark.parametrize("failing", ["os.replace", "json.dumps"])
def test_a_write_killed_part_way_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch,
                                                                      failing):
    path = tmp_path / "bench.json"
    _write(path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError(f"killed in {failing}")
    module, name = failing.split(".")
    monkeypatch.setattr({"os": os, "json": json}[module], name, boom)
    with pytest.raises(OSError, match="killed"):
        _write(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, {"bench.json"}) == []
    json.loads(before)                                    # and it is still a whole document


def test_a_failed_first_write_leaves_no_file(tmp_path, monkeypatch):
    path = tmp_path / "new" / "bench.json"                # the folder is created

    def boom(*args, **kwargs):
        raise OSError("killed")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        _write(path)
    monkeypatch.undo()
    assert not path.exists()
    assert _leftovers(path.parent, set()) == []


# --------------------------------------------------------------------------- the scripts
def _bench_scripts() -> list[Path]:
    return sorted(SCRIPTS.glob("bench_*.py"))


@pytest.mark.parametrize("script", _bench_scripts(), ids=lambda p: p.name)
def test_every_benchmark_script_has_a_json_flag_using_the_shared_writer(script):
    text = script.read_text(encoding="utf-8")
    assert '"--json"' in text, f"{script.name} has no --json flag"
    assert re.search(r"from _bench import [^\n]*\b(write_json|document)\b", text), (
        f"{script.name} does not write its JSON with scripts/_bench.py")


def _run(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    check_document(doc, script=args[0])
    assert doc["command"] == f"python {' '.join(args)} --json {out}"
    assert _leftovers(tmp_path, {"out.json"}) == []
    return doc


def test_bench_prototypes_writes_its_printed_tables(tmp_path):
    doc = _run(["scripts/bench_prototypes.py", "--repeat", "1"], tmp_path)
    ridge, rls = doc["tables"]
    assert ridge["columns"] == ["b", "m", "primal [ms]", "kernel [ms]", "primal/kernel"]
    assert [row[:2] for row in ridge["rows"]] == [[32, 512], [64, 256], [128, 128], [256, 64],
                                                  [512, 32]]
    assert [row[0] for row in rls["rows"]] == [64, 256, 512]
    for row in ridge["rows"] + rls["rows"]:
        for cell in row[-3:]:
            assert re.fullmatch(r"\d+\.\d+", cell), cell     # as printed: fixed decimals


def test_bench_gpu_cpu_section_writes_json(tmp_path):
    pytest.importorskip("numba")
    doc = _run(["scripts/bench_gpu.py", "--only", "lse", "--repeats", "1"], tmp_path)
    (table,) = doc["tables"]
    assert table["columns"] == ["shape", "dtype", "array path ms", "CPU twin ms", "array / twin"]
    assert [row[:2] for row in table["rows"]] == [["(256, 256)", "float32"],
                                                  ["(256, 256)", "float64"],
                                                  ["(1024, 1024)", "float32"],
                                                  ["(1024, 1024)", "float64"]]


def test_bench_gpu_cuda_rows_become_one_table_per_section(tmp_path):
    """--device cuda: each section's rows as a table whose cells are what the printed line
    shows (the document also keeps ``rows`` for scripts/gpu_ledger.py)."""
    gpu = _load("bench_gpu")
    run = gpu._Run(xp=None, dry_run=True, repeats=1, max_seconds=1.0, sync=None)
    rows = [
        gpu.Row("gsp", "cuda kernel float32", "cuda", dtype="float32", size="B=3",
                median_s=0.0123, repeats=3, first_call_s=1.5, rate=244.0, rate_unit="images/s",
                ratios={"cupy array path": 2.5}, goal="< 0.5 ms", goal_met=False,
                parity_error=1e-6, parity_tolerance=1e-4, parity_against="cpu"),
        gpu.Row("gsp", "cpu fast path", "cpu", median_s=0.02, repeats=3),
        gpu.Row("kcenter", "bound", "cuda", median_s=0.001, note="computed"),
        gpu.Row("sinkhorn", "section failed", "cuda", error="OutOfMemoryError: x"),
    ]
    run.rows.extend(rows)
    tables = [t.as_dict() for t in run.tables()]
    assert [t["title"].split(";")[0] for t in tables] == [
        gpu._SECTION_TITLES["gsp"], gpu._SECTION_TITLES["kcenter"],
        gpu._SECTION_TITLES["sinkhorn"]]
    assert [len(t["rows"]) for t in tables] == [2, 1, 1]
    for table, row in zip([tables[0], tables[0], tables[1], tables[2]],
                          [tables[0]["rows"][0], tables[0]["rows"][1], tables[1]["rows"][0],
                           tables[2]["rows"][0]]):
        assert table["columns"] == gpu._ROW_COLUMNS and len(row) == len(gpu._ROW_COLUMNS)
    for row, cells in zip(rows, [tables[0]["rows"][0], tables[0]["rows"][1],
                                 tables[1]["rows"][0], tables[2]["rows"][0]]):
        printed = gpu._format_row(row)
        for cell in cells[4:]:                # every measured cell appears as printed
            assert cell in printed, (cell, printed)
    first = tables[0]["rows"][0]
    assert first[4:] == ["12.300 ms", "x3", "1.500 s", "244 images/s", "2.5x cupy array path",
                         "< 0.5 ms: NOT met", "1.00e-06 (tol 1e-04 vs cpu)", ""]
    assert tables[1]["rows"][0][5] == "(computed)"
    assert tables[2]["rows"][0][-1] == "ERROR OutOfMemoryError: x"
    # The document keeps the ledger's layout (rows, header, complete) beside the schema's keys.
    run.json_path = str(tmp_path / "bench_gpu.json")
    run.argv = ["--device", "cuda", "--dry-run"]
    run.write_json(complete=True)
    doc = json.loads((tmp_path / "bench_gpu.json").read_text(encoding="utf-8"))
    check_document(doc, script="scripts/bench_gpu.py")
    assert doc["command"] == "python scripts/bench_gpu.py --device cuda --dry-run"
    assert doc["machine"]["device"] == run.device
    assert doc["rows_schema"] == gpu.JSON_SCHEMA and doc["complete"] is True
    assert doc["rows"] == [dataclasses.asdict(row) for row in rows]
    ledger = _load("gpu_ledger")
    assert ledger._bench(doc)["rows"] == doc["rows"]
    assert len(ledger._bench_table(doc["rows"])) > len(rows)
