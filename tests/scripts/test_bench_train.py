"""scripts/bench_train.py's comparison with PyTorch: the split of a step into the pieces the
twin shares with refdml and each side's own layers (the arithmetic, on made-up times worked
out by hand), and the sides themselves (one step each, with torch; skipped without)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("bench_train_under_test",
                                                  SCRIPTS / "bench_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_split_table_by_hand():
    bench = _load()
    # refdml R = 22 = S 12 + C_r 10; twin T = 20 = S 11 + C_t 9 (per thread count).
    table = {"1": {"wall": {"refdml_ms": 22.0, "torch_ms": 20.0},
                   "shared": {"refdml": 12.0, "torch": 11.0}},
             "1/2": {"wall": {"refdml_ms": 22.0, "torch_ms": 30.0}}}   # no split: skipped
    split = bench._split_table("collage", table)
    assert len(split.rows) == 1
    threads, shared, own_refdml, own_torch, own_ratio, needed = split.rows[0]
    assert threads == "1" and shared == "12.00 / 11.00"
    assert (own_refdml, own_torch, own_ratio) == ("10.00", "9.00", "1.11x")
    assert needed == "0.00"        # 0.6 * 20 - 12: no time left for refdml's own layers


def test_the_ratio_to_the_twin_lies_between_the_own_ratio_and_one():
    # The claim of _split_table's docstring, on a grid: (S + C_r) / (S + C_t) is a mediant.
    for c_r, c_t in ((10.0, 9.0), (5.0, 9.0)):
        low, high = sorted((c_r / c_t, 1.0))
        for shared in (0.0, 1.0, 12.0, 1e3):
            ratio = (shared + c_r) / (shared + c_t)
            assert low - 1e-12 <= ratio <= high + 1e-12


@pytest.mark.parametrize("side", ["refdml", "torch", "torch-full"])
def test_each_side_times_a_step(side, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    bench = _load()
    times = bench._time_alone(side, "collage", 1)
    assert times["wall"] > 0 and times["cpu"] > 0
    if side == "torch-full":
        assert "shared" not in times      # it shares nothing with refdml
    else:
        assert 0 < times["shared"] < 10 * times["wall"]


def test_the_refdml_side_times_its_step_inside_the_side_thread(monkeypatch):
    # The defaults row's refdml side (no torch needed): its steps run inside side_thread,
    # seen by the thread that runs the convolutions' halves.
    import threading

    from refdml.train import _conv

    bench = _load()
    seen = set()
    original = _conv._conv_parameter_grads

    def recording(*args):
        seen.add(threading.current_thread().name)
        return original(*args)

    monkeypatch.setattr(_conv, "_conv_parameter_grads", recording)
    times = bench._time_alone("refdml", "collage", 1, side_thread=True)
    assert times["wall"] > 0 and 0 < times["shared"] < 10 * times["wall"]
    assert any(name.startswith("refdml-side") for name in seen), seen
    seen.clear()
    bench._time_alone("refdml", "collage", 1)
    assert seen and not any(name.startswith("refdml-side") for name in seen), seen


def test_only_the_collage_model_has_a_whole_pytorch_form():
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="digits-collage model only"):
        _load()._full_torch_of("tokens")


def test_the_thread_pools_rows_widen_one_pool_at_a_time_and_restore_them(monkeypatch):
    bench = _load()
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 2)
    before = {label: get() for label, get, _ in bench._thread_pools()}
    tables = []
    times = bench.bench_thread_pools("collage", 1, 1, tables)
    pools = [label for label, _, _ in bench._thread_pools()]
    assert any(label.startswith("openblas") for label in pools), pools
    names = list(times)
    assert names[0] == "all at 1" and names[-1] == "all at 2"
    assert {f"{label} at 2" for label in pools} <= set(names)
    assert all(ms > 0 for ms in times.values())
    [table] = tables
    assert [row[0] for row in table.rows] == names and table.rows[0][2] == "1.00x"
    # every pool is back at the thread count it had
    assert {label: get() for label, get, _ in bench._thread_pools()
            if label in before} == before


def test_the_products_of_the_collage_step_worked_out_by_hand():
    # docs/train.md's digits-collage model at batch 64: 16 x 16 collages of 1 channel ->
    # Conv 3x3 (16, stride 1) -> Conv 3x3 (32, stride 2) -> Conv 3x3 (32, stride 1), all
    # padding 1 -> LocalLinear 32 -> 64 on the 8 x 8 grid -> GSP (n = 64, d = 64, m = 128)
    # -> Linear 64 -> 64. (M, K, N) per product; the first convolution has no input gradient.
    bench = _load()
    step = bench.Step("collage", "fast", "float32", "cpu")
    rows1, rows2 = 64 * 16 * 16, 64 * 8 * 8
    expected = [(rows1, 9, 16), (16, rows1, 9),                                   # conv1
                (rows2, 144, 32), (32, rows2, 144), (rows2, 32, 144),             # conv2
                (rows2, 288, 32), (32, rows2, 288), (rows2, 32, 288),             # conv3
                (rows2, 32, 64), (64, rows2, 32), (rows2, 64, 32),                # local
                (rows2, 64, 128), (rows2, 128, 64), (128, rows2, 64),             # gsp
                (64, 64, 64), (64, 64, 64), (64, 64, 64)]                         # linear
    assert bench.model_products(step) == expected


def test_a_layer_without_a_product_count_is_refused():
    bench = _load()
    step = bench.Step("collage", "fast", "float32", "cpu")

    class Unknown:
        n_outputs = 1

        def forward(self, x):
            return x, None

    step.model.layers = [Unknown()]
    with pytest.raises(TypeError, match="no product count for Unknown"):
        bench.model_products(step)


def test_products_ms_times_each_product():
    bench = _load()
    one = bench.products_ms([(64, 32, 16)], bench.np.float32, 3)
    two = bench.products_ms([(64, 32, 16), (256, 256, 256)], bench.np.float32, 3)
    assert 0 < one < two
    assert bench.products_ms([], bench.np.float32, 3) == 0.0


def test_the_products_table_by_hand():
    bench = _load()
    # refdml 22 ms, of which the products 7; PyTorch-only 20: 7 / 20 = 0.35x, 15 ms of the
    # rest; at 0.6x the step has 12 ms, 5 after the products.
    table = {"1": {"wall": {"refdml_ms": 22.0, "torch-full_ms": 20.0},
                   "products": {"products": 7.0, "products_gflop": 0.7}},
             "2": {"wall": {"refdml_ms": 15.0, "torch-full_ms": 18.0}}}   # none: skipped
    [row] = bench._products_table("collage", table).rows
    assert row == ["1", "22.00", "7.00", "0.700", "100", "0.35x", "15.00", "5.00"]


def test_the_refdml_side_without_the_side_thread_times_its_products():
    bench = _load()
    times = bench._time_alone("refdml", "collage", 1)
    assert 0 < times["products"] and abs(times["products_gflop"] - 0.6024) < 1e-4
    assert "products" not in bench._time_alone("refdml", "collage", 1, side_thread=True)
