"""scripts/bench_torch_gsp.py (refdml.torch.GSPPool against the authors' GSP layer): a
``--quick`` run's tables have their structure, and refdml's rows are right and finite
where the float64 reference is. Nothing here asserts a timing."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_torch_gsp.py"
LAYERS = ["GSPPool", "authors closed form", "authors unrolled"]


def _script():
    spec = importlib.util.spec_from_file_location("bench_torch_gsp_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench_torch_gsp.json"
    assert _script().main(["--quick", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert document["schema"] == "refdml-bench/1"
    assert document["script"] == "scripts/bench_torch_gsp.py"
    return document["tables"]


def test_three_tables(tables):
    assert [t["title"].split()[0] for t in tables] == ["Values:", "Stability", "Speed:"]


def test_values_rows(tables):
    values = tables[0]
    assert values["columns"] == ["layer", "dtype", "pooled", "z", "d_features",
                                 "d_prototypes"]
    assert [(row[0], row[1]) for row in values["rows"]] == [
        (layer, dtype) for dtype in ("float64", "float32") for layer in LAYERS]
    for layer, dtype, *errors in values["rows"]:
        # On ordinary inputs all three layers solve the same (P2): float64 to rounding
        # (100 fixed-point iterations converge here), float32 to its own precision.
        bound = 1e-10 if dtype == "float64" else 1e-4
        assert all(float(e) <= bound for e in errors), (layer, dtype, errors)


def test_refdml_is_finite_and_right_wherever_the_reference_is(tables):
    stability = tables[1]
    assert stability["columns"] == ["case", "reference", *LAYERS]
    cases = [row[0] for row in stability["rows"]]
    assert cases == [case[0] for case in _script().EXTREMES]
    for case, reference, ours, *_ in stability["rows"]:
        if reference == "finite":
            assert ours.startswith("finite, "), (case, ours)
            error = float(ours.split(", ")[1].split()[0])
            assert error <= 1e-10, (case, ours)


def test_speed_rows(tables):
    speed = tables[2]
    assert speed["columns"][:3] == ["dtype", "B", "threads"]
    assert {(row[0], row[1]) for row in speed["rows"]} == {("float32", 16), ("float64", 16)}
    for row in speed["rows"]:
        times = [float(cell) for cell in row[3:6]]
        assert all(t > 0 for t in times)
        # the ratio columns are the times' own ratios
        assert float(row[6]) == pytest.approx(times[1] / times[0], rel=0.02, abs=0.01)
        assert float(row[7]) == pytest.approx(times[2] / times[0], rel=0.02, abs=0.01)


def test_cuda_without_a_device_is_a_skip_with_its_reason(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the skip is not what runs")
    path = tmp_path / "out.json"
    assert _script().main(["--device", "cuda", "--json", str(path)]) == 0
    assert "skipped: torch sees no CUDA device" in capsys.readouterr().out
    document = json.loads(path.read_text())
    assert document["tables"] == [] and document["notes"][0].startswith("skipped")
