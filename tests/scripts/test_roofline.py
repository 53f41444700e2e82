"""scripts/_roofline.py: the roofline estimates that ``bench_gpu.py --device cuda`` prints beside
each goal, checked against counts made another way (loops over tiny problems, the arrays'
sizes, the shapes of the real digits-collage model, hand arithmetic), and
the dry run printing them and writing them into its rows. Nothing here is a timing.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module           # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


roofline = _load("_roofline")


# ------------------------------------------------------------------ GSP
def test_gsp_flops_are_the_layers_multiply_adds_counted_by_a_loop():
    batch, m, n, d = 2, 3, 4, 5
    macs = 0
    for _ in range(batch):
        for _ in range(m):
            for _ in range(n):
                macs += d             # cost map: <w_i, f_j> over the channels
                macs += d             # backward: d features_j += d_cost_ij w_i
                macs += d             # backward: d prototypes_i += d_cost_ij f_j
        for _ in range(n):
            macs += d                 # pooled += w_j f_j / n
            macs += d                 # d features_j += (w_j / n) d_pooled
    assert roofline.gsp_layer(batch, m, n, d).flops == 2 * macs == 2 * (3 * 120 + 2 * 40) == 880


def test_gsp_bytes_are_the_arrays_each_pass_must_read_and_write():
    batch, m, n, d = 2, 3, 4, 5
    f32 = np.float32
    features, prototypes = np.empty((batch, n, d), f32), np.empty((m, d), f32)
    pooled, z = np.empty((batch, d), f32), np.empty((batch, m), f32)
    forward = features.nbytes + prototypes.nbytes + pooled.nbytes + z.nbytes
    backward = (pooled.nbytes + z.nbytes                  # upstream gradients, same shapes
                + features.nbytes + prototypes.nbytes     # read again
                + features.nbytes + prototypes.nbytes)    # their gradients written
    assert (forward, backward) == (284, 504)                  # 160 + 60 + 40 + 24; ...
    assert roofline.gsp_layer(batch, m, n, d).bytes == forward + backward


def test_gsp_goals_and_sizes_of_the_gpu_run():
    small, big = roofline.section_works("gsp")
    assert (small.items, big.items) == (256, 4096)
    assert small.goal == "< 0.5 ms per call" and big.goal == ">= 2,000,000 images/s"
    # B = 256, m = 64, n = 49, d = 128 written out: B m n d = 102,760,448.
    assert small.flops == 2 * (3 * 102_760_448 + 2 * 3_211_264 // 2) == 622_985_216
    # B n d = 1,605,632; m d = 8,192; B d = 32,768; B m = 16,384
    assert small.bytes == 4 * (3 * 1_605_632 + 3 * 8192 + 2 * 32_768 + 2 * 16_384) == 19_759_104


# ------------------------------------------------------------------ retrieval, k-center, OT
def test_retrieval_is_the_query_by_reference_product():
    work = roofline.retrieval(7, 11, 3)
    pairs = sum(1 for _ in range(7) for _ in range(11))
    assert work.flops == pairs * 3 * 2 == 462           # a multiply and an add per coordinate
    assert work.bytes == np.empty((11, 3), np.float32).nbytes + np.empty((7, 3), np.float32).nbytes
    gpu = roofline.retrieval()
    assert gpu.flops == 2.56e12 and gpu.items == 10_000       # 2 x 1e4 x 1e6 x 128


def test_kcenter_reads_every_point_once_per_pick():
    n, d, k = 5, 3, 4
    reads = ops = 0
    for _ in range(k):                     # each pick updates every point's distance
        for _ in range(n):
            for _ in range(d):
                reads += 4                 # one float32 coordinate
                ops += 3                   # difference, square, sum
    work = roofline.kcenter(n, d, k)
    assert (work.bytes, work.flops) == (reads, ops) == (240, 180)
    gpu = roofline.kcenter()
    assert gpu.bytes == 512e9 and gpu.bound(roofline.H200_MEASURED).limited_by == "memory"
    # bench_gpu.py's own bandwidth-bound row (k n (d + 2) 4) is the points plus 2/128 more
    assert math.isclose(1000 * 1_000_000 * 130 * 4 / gpu.bytes, 130 / 128, rel_tol=1e-12)


def test_sinkhorn_pairs_by_hand():
    # 3 clouds of 2 points in R^2: 3 pairs + 3 selves = 6 problems; per problem the cost
    # matrix 2 x 2 x 2 x 2 = 16 flops and per iteration 8 x 4 = 32; two iterations.
    work = roofline.sinkhorn_pairs(3, 2, 2, iterations=2)
    assert work.items == 6 and work.flops == 6 * (16 + 2 * 32) == 480
    assert work.bytes == 4 * (3 * 2 * 2 + 3 * 3) == 84
    gpu = roofline.sinkhorn_pairs()
    assert gpu.items == 523_776 + 1024


# ------------------------------------------------------------------ the training step
def test_train_step_counts_the_real_models_layers():
    """The digits-collage model of refdml.train, built and run on the CPU at batch 64: its
    layers' output and parameter shapes give the multiply-adds and bytes independently of
    the formulas in _roofline (which hold the study's config as constants)."""
    from refdml.train.runs import build_run

    with tempfile.TemporaryDirectory() as out:
        run = build_run("digits-collage", dict(dtype="float32", device="cpu", epochs=0,
                                               progress=False), out_dir=out)
        x = run.trainer.train_x[:64].astype(np.float32)
        params = sum(int(np.prod(p.shape)) for p in run.trainer.optimizer.params)
        macs, activations, first_conv = 0, 0, True
        batch = x.shape[0]
        inputs = x.size
        for layer in run.model.layers:
            out_, _ = layer.forward(x)
            kind = type(layer).__name__
            if kind == "Conv2d":
                per_output = int(np.prod(layer.weight.shape[1:]))      # C_in k k
                macs += out_.size * per_output * (2 if first_conv else 3)
                first_conv = False
            elif kind == "LocalLinear":
                macs += 3 * out_.size * x.shape[1]                      # B P L, C_in = 32
            elif kind == "GSPHead":
                (_, n, dim), m = x.shape, out_[1].shape[1]
                macs += 3 * batch * m * n * dim + 2 * batch * n * dim
                activations += batch * m * n                            # the transport plan
            elif kind == "Linear":
                macs += 3 * out_.size * x.shape[1]
            activations += sum(o.size for o in (out_ if isinstance(out_, tuple) else (out_,)))
            x = out_[0] if isinstance(out_, tuple) else out_
        macs += 3 * batch * batch * x.shape[1]                          # pairwise distances
    work = roofline.train_step(64)
    assert work.flops == 2 * macs
    assert work.bytes == 4 * (inputs + 2 * activations + 9 * params)


# ------------------------------------------------------------------ bounds and bad input
def test_the_bound_is_the_larger_term_and_says_which():
    device = roofline.Device("test", bandwidth=2.0, flop_rate=10.0, source="hand")
    work = roofline.Work("s", "w", "size", "goal", bytes=8.0, flops=30.0, bytes_formula="",
                         flops_formula="")
    bound = work.bound(device)
    assert (bound.memory_s, bound.compute_s, bound.seconds, bound.limited_by) == (
        4.0, 3.0, 4.0, "memory")
    faster_memory = roofline.Device("t", bandwidth=8.0, flop_rate=10.0, source="hand")
    assert work.bound(faster_memory).limited_by == "compute"
    assert work.bound(faster_memory).seconds == 3.0
    spec_only = roofline.Device("t", bandwidth=2.0, flop_rate=None, source="hand")
    assert work.bound(spec_only) == roofline.Bound(4.0, 4.0, None, "memory term only")
    assert "no flop rate" in work.describe(spec_only)
    assert work.describe(device).startswith("roofline estimate (not a measurement)")


def test_device_figures_and_their_sources():
    assert (roofline.H200_MEASURED.bandwidth, roofline.H200_MEASURED.flop_rate) == (3.45e12, 36e12)
    assert "2026-11-28" in roofline.H200_MEASURED.source
    assert roofline.H200_SPEC.bandwidth == 4.8e12 and roofline.H200_SPEC.flop_rate is None
    assert roofline.H100_SXM_SPEC.bandwidth == 3.35e12
    assert "datasheet" in roofline.H100_SXM_SPEC.source


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: roofline.gsp_layer(0), ValueError, "batch == 0, must be at least 1"),
    (lambda: roofline.gsp_layer(2.0), TypeError, "batch must be an int, got float"),
    (lambda: roofline.kcenter(k=True), TypeError, "k must be an int, got bool"),
    (lambda: roofline.sinkhorn_pairs(iterations=-1), ValueError, "iterations == -1"),
    (lambda: roofline.Device("x", -1.0, None, ""), ValueError, "bandwidth == -1.0"),
    (lambda: roofline.Device("x", 1.0, float("nan"), ""), ValueError, "flop_rate == nan"),
    (lambda: roofline.Device("x", "fast", None, ""), TypeError, "bandwidth must be a number"),
    (lambda: roofline.retrieval().bound("H200"), TypeError, "device must be a Device, got str"),
    (lambda: roofline.section_works(3), TypeError, "section must be a str, got int"),
])
def test_bad_input_names_the_parameter_and_value(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_every_section_with_a_goal_has_works():
    assert [w.section for s in ("gsp", "train", "retrieval", "kcenter", "sinkhorn")
            for w in roofline.section_works(s)] == ["gsp", "gsp", "train", "retrieval",
                                                   "kcenter", "sinkhorn"]
    assert roofline.section_works("launch_sync") == []


# ------------------------------------------------------------------ the dry run prints them
def test_bench_gpu_dry_run_prints_the_roofline_beside_each_goal_and_in_the_rows(tmp_path):
    pytest.importorskip("numba")
    out = tmp_path / "bench_gpu.json"
    done = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--device", "cuda",
                           "--dry-run", "--only", "retrieval", "--only", "train",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    device = roofline.H200_MEASURED
    for work in roofline.section_works("retrieval") + roofline.section_works("train"):
        line = f"{work.section:11s} {work.describe(device)} (the dry run's sizes are smaller)"
        assert line in done.stdout.splitlines(), (line, done.stdout[-3000:])
    doc = json.loads(out.read_text(encoding="utf-8"))
    rows = {(row["section"], row["name"]): row for row in doc["rows"]}
    (retrieval,), (train,) = roofline.section_works("retrieval"), roofline.section_works("train")
    for key, work in ((("retrieval", "cupy array path"), retrieval),
                      (("retrieval", "cuda kernel"), retrieval),
                      (("train", "digits-collage step, cuda float32"), train)):
        assert rows[key]["roofline"] == work.as_dict(device), key
        assert rows[key]["roofline"]["estimate"] is True and rows[key]["measurement"] is False
    assert rows["retrieval", "float32 matmul bound"]["roofline"] is None
    printed = [line for line in done.stdout.splitlines()
               if line.startswith("retrieval") and "cupy array path" in line.split("|")[0]]
    assert len(printed) == 1 and "roofline >= 71.111 ms (estimate at 10000 queries" in printed[0]
    # The ledger renders the estimate in its own column, marked as one.
    ledger = _load("gpu_ledger")
    table = "\n".join(ledger._bench_table(doc["rows"]))
    assert "roofline ms (estimate)" in table and ">= 71.11 (estimate at 10000 queries" in table
