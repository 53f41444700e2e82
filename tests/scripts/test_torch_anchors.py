"""The PyTorch anchors of scripts/bench_gpu.py (scripts/_torch_anchors.py) against refdml.

The torch maths (skipped where torch is not installed; it is no dependency of refdml): the
GSP layer's forward against refdml's float64 reference, its closed-form backward (Prop.
4.3) against refdml's hand-derived backward and against autograd through the unrolled
fixed-point iterations, the retrieval metrics on a case counted by hand and against
refdml.metrics, and the all-PyTorch digits-collage model against refdml's gradients.
Without torch: a cheap dry run of the benchmark reports the anchor rows as skipped, with
the reason. Nothing here asserts a timing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
GSP_ARGS = {"mu": 0.3, "inverse_temperature": 5.0}


def _anchors():
    """scripts/_torch_anchors.py, loaded from its file (scripts/ is no package)."""
    pytest.importorskip("torch")
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("torch_anchors_under_test",
                                                  SCRIPTS / "_torch_anchors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gsp_data(seed=0, batch=3, m=4, n=6, d=5):
    """Features and prototypes of norms on both sides of 1 (the clip to the unit ball acts
    on some rows and not on others), and upstream gradients."""
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((batch, n, d)) * rng.uniform(0.2, 0.8, (batch, n, 1))
    prototypes = rng.standard_normal((m, d)) * rng.uniform(0.2, 0.8, (m, 1))
    return features, prototypes, rng.standard_normal((batch, d)), rng.standard_normal((batch, m))


def _torch_gsp(anchors, features, prototypes, d_pooled, d_z, backward="closed_form"):
    torch = pytest.importorskip("torch")

    f = torch.tensor(features, requires_grad=True)
    w = torch.tensor(prototypes, requires_grad=True)
    pooled, z = anchors.gsp_pool(f, w, backward=backward, **GSP_ARGS)
    d_f, d_w = torch.autograd.grad((pooled, z), (f, w),
                                   (torch.tensor(d_pooled), torch.tensor(d_z)))
    return [t.detach().numpy() for t in (pooled, z, d_f, d_w)]


# --------------------------------------------------------------------------- GSP layer
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gsp_layer_forward_and_backward_match_refdml(seed):
    """float64: 100 fixed-point iterations reach (P2)'s solution on these inputs (refdml
    solves it exactly), and Prop. 4.3 there is refdml's independent backward."""
    from refdml import gsp

    anchors = _anchors()
    features, prototypes, d_pooled, d_z = _gsp_data(seed)
    (pooled, z), ctx = gsp.gsp_pool_forward(features, prototypes, **GSP_ARGS)
    grads = gsp.gsp_pool_backward(ctx, d_pooled, d_z)
    got = _torch_gsp(anchors, features, prototypes, d_pooled, d_z)
    for g, w in zip(got, (pooled, z, grads.features, grads.prototypes)):
        assert_allclose(g, w, rtol=0, atol=1e-12 * np.abs(w).max())


def test_gsp_layer_closed_form_backward_matches_autograd_through_the_iterations():
    anchors = _anchors()
    data = _gsp_data(3, batch=4, m=5, n=7, d=6)
    closed = _torch_gsp(anchors, *data)
    unrolled = _torch_gsp(anchors, *data, backward="unrolled")
    for c, u in zip(closed, unrolled):
        assert_allclose(c, u, rtol=0, atol=1e-12 * np.abs(u).max())


def test_weight_transport_backward_is_sensitive():
    """The closed form against autograd on the unrolled iterations, with only the upstream
    gradient of rho and then only that of pi: a wrong sign or a dropped term would show."""
    torch = pytest.importorskip("torch")

    anchors = _anchors()
    rng = np.random.default_rng(4)
    cost = torch.tensor(rng.uniform(0.0, 2.0, (2, 3, 5)), requires_grad=True)
    for which in ("rho", "pi"):
        d_rho = torch.tensor(rng.standard_normal((2, 5))) * (which == "rho")
        d_pi = torch.tensor(rng.standard_normal((2, 3, 5))) * (which == "pi")
        closed = torch.autograd.grad(anchors.WeightTransport.apply(cost, 0.3, 5.0, 100),
                                     cost, (d_rho, d_pi))[0]
        unrolled = torch.autograd.grad(anchors.weight_transport_iterations(cost, 0.3, 5.0, 100),
                                       cost, (d_rho, d_pi))[0]
        assert float(unrolled.abs().max()) > 1e-3
        assert_allclose(closed.numpy(), unrolled.numpy(), rtol=0,
                        atol=1e-12 * float(unrolled.abs().max()))


def test_gsp_layer_float32_is_within_the_benchmarks_tolerance():
    """bench_gpu's parity of the float32 anchor against the float64 reference (1e-4)."""
    torch = pytest.importorskip("torch")

    from refdml import gsp

    anchors = _anchors()
    features, prototypes, d_pooled, d_z = _gsp_data(5, batch=8, m=16, n=20, d=12)
    (pooled, _), ctx = gsp.gsp_pool_forward(features, prototypes, **GSP_ARGS)
    grads = gsp.gsp_pool_backward(ctx, d_pooled, d_z)
    f = torch.tensor(features, dtype=torch.float32, requires_grad=True)
    w = torch.tensor(prototypes, dtype=torch.float32, requires_grad=True)
    out, z = anchors.gsp_pool(f, w, **GSP_ARGS)
    d_f, d_w = torch.autograd.grad((out, z), (f, w), (
        torch.tensor(d_pooled, dtype=torch.float32), torch.tensor(d_z, dtype=torch.float32)))
    for g, want in ((out, pooled), (d_f, grads.features), (d_w, grads.prototypes)):
        got = g.detach().double().numpy()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


# --------------------------------------------------------------------------- retrieval
def test_retrieval_metrics_on_a_case_counted_by_hand():
    """References on a line (second coordinate 0): r0 = 0 (class 0), r1 = 1 (1), r2 = 2
    (0), r3 = 3 (1), r4 = 10 (2). Queries and their ranked hits within R:

    ====  =====  =====  =  =================  ===  ===========================
    x     class  order  R  hits within R      P@1  AP@R
    ====  =====  =====  =  =================  ===  ===========================
    0.4   0      r0 r1  2  1 0                1    (1/2)(1/1) = 0.5
    1.4   0      r1 r2  2  0 1                0    (1/2)(1/2) = 0.25
    2.9   1      r3 r2  2  1 0                1    0.5
    9.0   2      r4     1  1                  1    1
    5.0   3      -      0  excluded
    ====  =====  =====  =  =================  ===  ===========================

    P@1 = 3/4, MAP@R = 2.25/4, R-precision = (0.5 + 0.5 + 0.5 + 1)/4 = 0.625.
    """
    torch = pytest.importorskip("torch")

    from refdml import metrics

    anchors = _anchors()
    reference = np.array([[0.0, 0], [1, 0], [2, 0], [3, 0], [10, 0]])
    ref_labels = np.array([0, 1, 0, 1, 2])
    query = np.array([[0.4, 0], [1.4, 0], [2.9, 0], [9.0, 0], [5.0, 0]])
    query_labels = np.array([0, 0, 1, 2, 3])
    want = {"precision_at_1": 0.75, "mean_average_precision_at_r": 0.5625,
            "r_precision": 0.625, "n_queries": 4}
    for block in (2, 16384):                      # merged across blocks, and in one
        got = anchors.retrieval_metrics(
            torch.tensor(query), torch.tensor(query_labels), torch.tensor(reference),
            torch.tensor(ref_labels), block=block)
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-15), (block, key)
        assert got["near_ties_at_1"] == 0
    ours = metrics.retrieval_metrics(query, query_labels, reference, ref_labels)
    for key, value in want.items():
        assert ours[key] == pytest.approx(value, abs=1e-15), key


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_retrieval_metrics_match_refdml(dtype):
    """Random clusters: P@1 exactly (no near-tie here: asserted), R-precision and MAP@R to
    rounding of the float64 averages."""
    torch = pytest.importorskip("torch")

    from refdml import metrics

    anchors = _anchors()
    rng = np.random.default_rng(0)
    n_ref, n_query, dim, n_classes = 1500, 200, 16, 15
    centres = rng.standard_normal((n_classes, dim))
    ref_labels = rng.permutation(np.arange(n_ref) % n_classes)
    reference = (centres[ref_labels] + 1.5 * rng.standard_normal((n_ref, dim))).astype(dtype)
    query_labels = rng.integers(0, n_classes, n_query)
    query = (centres[query_labels] + 1.5 * rng.standard_normal((n_query, dim))).astype(dtype)
    want = metrics.retrieval_metrics(query, query_labels, reference, ref_labels)
    got = anchors.retrieval_metrics(torch.tensor(query), torch.tensor(query_labels),
                                    torch.tensor(reference), torch.tensor(ref_labels),
                                    block=256)
    assert got["near_ties_at_1"] == 0
    assert got["n_queries"] == want["n_queries"] == n_query
    assert got["precision_at_1"] == want["precision_at_1"]
    for key in ("r_precision", "mean_average_precision_at_r"):
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


# --------------------------------------------------------------------------- training
def test_collage_twin_in_torch_has_refdml_gradients():
    """The digits-collage model with every piece in PyTorch (GSP head by the anchor layer,
    contrastive + ZSR in torch), float64, from refdml's parameters, batch and ZSR split:
    the loss and every parameter's gradient as refdml's (100 fixed-point iterations reach
    the study's (P2) solution to ~1e-14; measured 9e-15 of each largest gradient)."""
    torch = pytest.importorskip("torch")

    from refdml.crossbatch import class_disjoint_split
    from refdml.train.runs import build_run

    anchors = _anchors()
    with tempfile.TemporaryDirectory() as out_dir:
        run = build_run("digits-collage", dict(dtype="float64", device="cpu", epochs=0,
                                               progress=False, n_classes_per_batch=4,
                                               n_samples_per_class=4), out_dir=out_dir)
    trainer = run.trainer
    batch = next(iter(trainer.train_sampler))
    x, labels = trainer.train_x[batch], trainer.train_y[batch]
    split = class_disjoint_split(labels, rng=0)
    trainer.optimizer.zero_grad()
    outputs, ctx = run.model.forward(x)
    value, objective_ctx = run.objective.forward(outputs, labels, split=split)
    run.model.backward(ctx, run.objective.backward(objective_ctx, 1.0))
    twin = anchors.collage_twin(run.model, run.objective, trainer.optimizer, x, labels,
                                split=split)
    loss = twin.loss()
    loss.backward()
    assert float(loss.detach()) == pytest.approx(value, rel=1e-12)
    assert loss.dtype == torch.float64
    for param in trainer.optimizer.params:
        got = twin.named_parameters[param.name].grad.numpy()
        assert_allclose(got, param.grad, rtol=0, atol=1e-10 * np.abs(param.grad).max(),
                        err_msg=param.name)
    # A step moves every parameter (the step runs, with its own split draw).
    before = {name: p.detach().clone() for name, p in twin.named_parameters.items()}
    twin.split = None
    twin.step()
    for name, p in twin.named_parameters.items():
        assert not torch.equal(p.detach(), before[name]), name


# --------------------------------------------------------------------------- no torch
def test_dry_run_reports_the_anchor_rows_as_skipped_without_torch(tmp_path):
    """A cheap real dry run (the retrieval and train sections) with torch made unimportable:
    each anchor row is there, measures nothing, has no error and says why; the run passes.
    (The GSP section's anchor rows take the same path, ``_torch_setup``; its simulated
    kernels make that section too slow for here.)"""
    pytest.importorskip("numba")
    hide = tmp_path / "hide" / "torch"
    hide.mkdir(parents=True)
    (hide / "__init__.py").write_text('raise ImportError("torch hidden by the test")\n')
    out = tmp_path / "bench_gpu.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(hide.parent), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--device", "cuda",
                           "--dry-run", "--only", "retrieval", "--only", "train",
                           "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    assert doc["complete"] is True
    rows = {(row["section"], row["name"]): row for row in doc["rows"]}
    anchors = [("retrieval", "torch matmul + topk"),
               ("train", "digits-collage step, torch float32 (autograd)")]
    for key in anchors:
        row = rows[key]
        assert row["error"] is None and row["median_s"] is None and not row["measurement"]
        assert "skipped: torch cannot be imported (torch hidden by the test)" in row["note"]
    # refdml's rows ran beside them.
    assert rows["retrieval", "cupy array path"]["median_s"] is not None
    assert rows["train", "digits-collage step, cuda float32"]["median_s"] is not None
    # And the tables of the document show the reason in the anchor rows' note cell.
    notes = [row[-1] for table in doc["tables"] for row in table["rows"]
             if row[0] in {name for _, name in anchors}]
    assert len(notes) == 2 and all("skipped: torch" in note for note in notes)
