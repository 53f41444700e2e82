"""The host synchronisations of the fast path on CuPy, counted on the CuPy stand-in
(tests/cupy_standin), against what each operator's docstring lists.

Run with ``REFDML_CUPY_STANDIN=1`` (scripts/ci_cupy_standin.sh); the counts skip otherwise. Counts
are taken with the data checks off (:func:`refdml.gpu.set_finite_checks`), so
that what remains is what the docstrings call the results that must reach Python; with
the checks on, the checks add booleans only. A "shape" transfer is an operation whose
output size depends on the data (boolean-mask indexing, ``nonzero``, ``unique`` ...),
for which CuPy reads a count back.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdml.gpu import set_finite_checks, use_kernels
from refdml.catalog import get

standin = pytest.mark.skipif(
    not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
    reason="counts host transfers on the CuPy stand-in: REFDML_CUPY_STANDIN=1 "
           "(scripts/ci_cupy_standin.sh)")


@pytest.fixture(autouse=True)
def data_checks_off():
    """Data checks off for the test (restored after); ``True`` turns them back on."""
    set_finite_checks(False)
    yield lambda on: set_finite_checks(on)
    set_finite_checks(True)


def _cupy():
    import cupy

    return cupy


def _counted(call):
    import cupy_standin

    with cupy_standin.count_transfers() as counter:
        result = call()
    return result, counter


def _catalogue_call(name, kernels="array", dtype=np.float32, seed=0):
    """Forward and backward counts of catalogue entry ``name``'s mirror on the stand-in."""
    cupy = _cupy()
    spec = get(name)
    forward, backward = spec.mirror_pair()
    rng = np.random.default_rng(seed)
    inputs = {k: (cupy.asarray(v.astype(dtype) if v.dtype.kind == "f" else v)
                  if isinstance(v, np.ndarray) else v)
              for k, v in spec.make_inputs(rng).items()}
    with use_kernels(kernels):
        (out, ctx), fwd = _counted(lambda: forward(**inputs))
        outs = out if isinstance(out, tuple) else (out,)
        upstream = [cupy.asarray(rng.standard_normal(o.shape).astype(dtype))
                    if getattr(o, "ndim", 0) else 0.5 for o in outs]
        _, bwd = _counted(lambda: backward(ctx, *upstream))
    return outs, ctx, fwd, bwd


LOSSES = ["contrastive", "contrastive_cosine", "contrastive_no_positive",
          "generalized_contrastive", "multi_similarity", "proxy_anchor", "proxy_contrastive",
          "proxy_contrastive_cosine", "proxy_multi_similarity", "proxy_nca",
          "soft_triple", "triplet", "triplet_batch_hard"]
# refdml/gpu/losses/__init__.py: the value stays on the device (a 0-d float64 array, no
# synchronisation), except triplet's, read in the forward (one); "its label bookkeeping
# (P of triplet(mining="all")) costs one more". soft_triple read its value and took its
# classes by unique (two) until its classes became the centres that come first in them.
READ = {"triplet": 2, "triplet_batch_hard": 1}


@standin
@pytest.mark.parametrize("loss", LOSSES)
def test_a_loss_forward_synchronises_as_its_docstring_says(loss):
    outs, _, fwd, bwd = _catalogue_call(f"losses.{loss}")
    if loss in READ:
        assert isinstance(outs[0], float)
        assert fwd["float"] + fwd["tolist"] == 1 and fwd.total == READ[loss], fwd
    else:
        assert getattr(outs[0], "shape", None) == () and outs[0].dtype == np.float64, outs[0]
        assert fwd.total == 0, fwd
    assert bwd.total == 0, bwd


@standin
@pytest.mark.parametrize("loss", ["multi_similarity", "proxy_multi_similarity", "soft_triple"])
def test_a_loss_kernel_forward_synchronises_as_its_array_path(loss):
    # The CUDA kernels (under the simulator, on the stand-in's arrays via cuda_launch) add none.
    _, _, fwd, bwd = _catalogue_call(f"losses.{loss}", kernels="cuda")
    assert fwd.total == READ.get(loss, 0) and bwd.total == 0, (fwd, bwd)


ELEMENTWISE = ["normalize.l2_normalize", "normalize.clip_normalize", "distances.euclidean",
               "distances.sq_euclidean", "distances.cosine", "histogram.entropic",
               "histogram.convex_combination", "train.linear", "train.local_linear",
               "train.conv2d", "train.gap", "train.gmp", "train.gemean", "train.relu",
               "train.embedding"]


@standin
@pytest.mark.parametrize("name", ELEMENTWISE)
def test_no_synchronisation_without_data_checks(name, data_checks_off):
    # normalize: "the zero-row check of l2_normalize is the only synchronisation";
    # distances, histogram: one each for the range checks "while data checks are on";
    # the layers: none.
    _, _, fwd, bwd = _catalogue_call(name)
    assert fwd.total == 0 and bwd.total == 0, (fwd, bwd)
    data_checks_off(True)
    _, _, fwd, bwd = _catalogue_call(name)
    checks = {**fwd.by_kind, **{f"backward {k}": n for k, n in bwd.by_kind.items()}}
    allowed = {"bool", "backward bool"} | ({"tolist"} if name == "train.embedding" else set())
    assert set(checks) <= allowed and fwd.total + bwd.total > 0, checks


@standin
def test_the_token_range_is_one_transfer(data_checks_off):
    # refdml/train/_dense.py: "Checking the range reads the tokens (one device
    # synchronisation on CuPy while data checks are on)".
    from refdml.train import _dense

    cupy = _cupy()
    tokens = cupy.asarray(np.arange(12).reshape(3, 4) % 5)
    table = cupy.asarray(np.ones((5, 2)))
    _, off = _counted(lambda: _dense.embedding_forward(tokens, table))
    data_checks_off(True)
    _, on = _counted(lambda: _dense.embedding_forward(tokens, table))
    assert off.total == 0 and on["tolist"] == 1, (off, on)


@standin
@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_an_optimiser_step_is_one_copy(optimizer):
    # refdml/train/optim.py: "step makes one device-to-host copy ... nothing else syncs".
    import refdml.train as train
    from refdml.train._parameter import Parameter

    cupy = _cupy()
    rng = np.random.default_rng(0)
    params = [Parameter(cupy.asarray(rng.standard_normal(s)), f"p{i}")
              for i, s in enumerate([(3, 4), (4,), (2, 2, 2)])]
    opt = getattr(train, optimizer)(params, lr=1e-2)
    for step in range(2):
        for p in params:
            p.accumulate(cupy.asarray(rng.standard_normal(p.shape)))
        _, counter = _counted(opt.step)
        assert counter.total == 1 and counter["get"] == 1, (step, counter)
        opt.zero_grad()


@standin
def test_the_sinkhorn_loop_synchronises_once_per_check():
    # refdml/gpu/ot/_sinkhorn.py: "Convergence check (the one synchronisation of the loop on
    # CuPy): ... every CHECK_EVERY_GPU iterations"; converged problems leave the batch
    # (compaction) without further synchronisation.
    from refdml.gpu.ot import IMPLEMENTATIONS
    from refdml.gpu.ot import _sinkhorn as solver

    cupy = _cupy()
    rng = np.random.default_rng(1)
    n_problems, n, m = 12, 7, 5
    cost = rng.random((n_problems, n, m)) * rng.uniform(0.2, 1.0, (n_problems, 1, 1))
    cost /= 1.25 * cost.max()                     # largest entry in [0.5, 1) as required
    a = np.full((n_problems, n), 1.0 / n)
    b = np.full((n_problems, m), 1.0 / m)
    batch, counter = _counted(lambda: solver.solve_batch(
        cupy, cupy.asarray(a), cupy.asarray(b), cupy.asarray(cost), eps=0.05, max_iter=400,
        tol=1e-9, eps_scaling=None, impl=IMPLEMENTATIONS.choose(cupy.asarray(cost))))
    n_iter = batch.n_iter.get()
    assert len(set(n_iter.tolist())) > 1, "every problem stopped together: no compaction ran"
    checks = int(n_iter.max()) // solver.CHECK_EVERY_GPU + 1
    # The largest cost (one float), one int per check, the warning's count (one int).
    assert counter["shape"] == 0, counter
    assert counter["float"] == 1 and counter["int"] <= checks + 1, (counter, checks)
    assert counter.total == counter["float"] + counter["int"], counter


@standin
@pytest.mark.parametrize("small_kernels", [False, True])
def test_the_large_eps_finish_adds_no_synchronisation(small_kernels):
    # refdml/gpu/ot/_sinkhorn._finish_large_eps: on CuPy the problems whose eps exceeds their
    # largest cost are not gathered (a mask index reads its count back): every problem's
    # half steps are computed and kept by where. A batch with and without such problems
    # synchronises alike, and agrees with NumPy's solve, which gathers them.
    from refdml.gpu.ot import IMPLEMENTATIONS
    from refdml.gpu.ot import _sinkhorn as solver

    cupy = _cupy()
    rng = np.random.default_rng(4)
    n_problems, n, m, eps = 6, 5, 4, 0.05
    a = np.full((n_problems, n), 1.0 / n)
    b = np.full((n_problems, m), 1.0 / m)
    args = dict(eps=eps, max_iter=2000, tol=1e-12, eps_scaling=None, small_kernels=small_kernels)
    counts = []
    # Problems' largest costs all above eps, then from 0.8 down to 8e-9 (eps exceeds 4 of them).
    for scales in (np.ones(n_problems), np.logspace(0, -8, n_problems)):
        cost = rng.random((n_problems, n, m)) * scales[:, None, None]
        cost /= 1.25 * cost.max()
        want = solver.solve_batch(np, a, b, cost, impl=IMPLEMENTATIONS.choose(cost), **args)
        with use_kernels("cuda" if small_kernels else "array"):
            device_cost = cupy.asarray(cost)
            impl = IMPLEMENTATIONS.choose(device_cost)
            got, counter = _counted(lambda: solver.solve_batch(
                cupy, cupy.asarray(a), cupy.asarray(b), device_cost, impl=impl, **args))
        counts.append((counter["float"], counter["shape"], counter.total - counter["int"]))
        # The plan and the value: the potentials' gauge constant differs between the two
        # loops (log domain here, kernel scalings on NumPy) by rounding. Per problem (scales
        # 1 .. 1e-8); 1e-10: both loops stop at tol 1e-12, the finish is exact to ~1e-15.
        got_value = solver.batch_value(cupy, got).get()
        np.testing.assert_allclose(got_value, solver.batch_value(np, want), rtol=1e-10)
        for p in range(n_problems):
            np.testing.assert_allclose(got.plan[p].get(), want.plan[p], rtol=1e-10,
                                       atol=1e-10 * want.plan[p].max())
    # The largest cost (one float) and the loop's checks (ints), no mask read, either way.
    assert counts == [(1, 0, 1), (1, 0, 1)], counts


@standin
def test_pair_losses_synchronise_for_their_pairs_only():
    # refdml/gpu/ot/__init__.py: "the sizes of the unique pairs (two unique) and the list of triplets (one
    # nonzero) of the losses"; the pairs i < j are built on the host, the gradient of the
    # unique pairs is a scatter-add (CuPy's triu_indices and bincount would read counts).
    for name, shape in (("ot.wcontrastive", 2), ("ot.wtriplet", 3),
                        ("ot.pairwise_sinkhorn_divergence", 0)):
        _, _, fwd, bwd = _catalogue_call(name)
        assert fwd["shape"] == shape and bwd.total == 0, (name, fwd, bwd)


@standin
def test_retrieval_metrics_synchronisations():
    # refdml/gpu/metrics/__init__.py: K and the check (one transfer), the scored queries (one nonzero), the
    # failed certificates (one nonzero; none here: 30 points, the list holds every reference),
    # the results (one transfer); nothing per block (tests/gpu/test_gpu_kernels_retrieval.py).
    from refdml.gpu import metrics

    cupy = _cupy()
    rng = np.random.default_rng(2)
    x = cupy.asarray(rng.standard_normal((30, 4)))
    labels = cupy.asarray(rng.integers(0, 3, 30))
    for kernels in ("array", "cuda"):
        with use_kernels(kernels):
            result, counter = _counted(lambda: metrics.retrieval_metrics(x, labels))
        assert isinstance(result["precision_at_1"], float)
        assert counter["tolist"] == 2 and counter["shape"] == 1, (kernels, counter)
        assert counter.total == 3 and counter["bool"] == 0, (kernels, counter)


@standin
def test_k_center_synchronisations():
    # refdml/gpu/kcenter/__init__.py: "initial_radius (a Python float; one sync when initial is given), the
    # range and count checks of an index initial (two syncs)"; none inside the loop.
    from refdml.gpu import kcenter

    cupy = _cupy()
    points = cupy.asarray(np.random.default_rng(3).standard_normal((25, 3)))
    for kernels in ("array", "cuda"):
        with use_kernels(kernels):
            _, plain = _counted(lambda: kcenter.greedy_k_center(points, 6, rng=0))
            _, indexed = _counted(lambda: kcenter.greedy_k_center(
                points, 6, initial=cupy.asarray([0, 7, 7]), rng=0))
        assert plain.total == 0, (kernels, plain)
        assert indexed.total == 3 and indexed["float"] == 1, (kernels, indexed)


@standin
def test_ridge_and_cross_fit_synchronisations():
    # refdml/gpu/prototypes.py: the scaling is computed on the device (none);
    # refdml/gpu/crossbatch.py: the halves come from the split on the host, which the
    # catalogue gives on the device here (one transfer), and none from a host split.
    _, _, fwd, bwd = _catalogue_call("prototypes.ridge_fit_primal")
    assert fwd.total == 0 and bwd.total == 0, (fwd, bwd)
    _, _, fwd, bwd = _catalogue_call("crossbatch.cross_fit")
    assert fwd.total == fwd["get"] == 1 and bwd.total == 0, (fwd, bwd)


@standin
def test_zero_shot_loss_on_host_labels_and_split_does_not_synchronise():
    # The training objective's call: labels and split from the host, Z and the class
    # embeddings on the device; the value stays a 0-d device array.
    from refdml.gpu import crossbatch

    cupy = _cupy()
    spec = get("crossbatch.zero_shot_loss")
    inputs = spec.make_inputs(np.random.default_rng(0))
    Z = cupy.asarray(inputs["Z"].astype(np.float32))
    classes = cupy.asarray(inputs["class_embeddings"].astype(np.float32))
    (value, ctx), fwd = _counted(lambda: crossbatch.zero_shot_loss_forward(
        Z, inputs["labels"], classes, split=inputs["split"]))
    _, bwd = _counted(lambda: crossbatch.zero_shot_loss_backward(ctx, 0.5))
    assert fwd.total == 0 and bwd.total == 0, (fwd, bwd)
    assert value.shape == () and value.dtype == np.float64
    (drawn, _), fwd = _counted(lambda: crossbatch.zero_shot_loss_forward(
        Z, inputs["labels"], classes, rng=0))
    assert fwd.total == 0, fwd
    from refdml import crossbatch as reference

    expected, _ = reference.zero_shot_loss_forward(inputs["Z"], inputs["labels"],
                                                   inputs["class_embeddings"], rng=0)
    assert abs(float(drawn) - expected) <= 1e-5 * abs(expected)


@standin
@pytest.mark.parametrize("kernels", ["array", "cuda"])
def test_gsp_synchronisations(kernels):
    # refdml/gpu/gsp/_array.py: the rows outside the plain norm range (one nonzero per input), the cost
    # map's refinement (one nonzero, two when a pair is refined: array path), the solver's
    # convergence test once per _SWEEPS sweeps (array path) and ``converged``. The kernels
    # (refdml/gpu/gsp/_kernels.py): their (B, 4) counts alone, in one transfer handed to
    # refdml._deferred.read_later (read at once outside a training step), with the data
    # checks off; with them on, the same one read (the points' checks are its fourth column)
    # and one in the backward (tests/gpu/test_gpu_launch_counts.py, CHECKS_ON_CEILINGS).
    from refdml.gpu.gsp import _transport as _gsp_transport

    _, ctx, fwd, bwd = _catalogue_call("gsp.pool", kernels=kernels)
    sweeps = ctx.transport.n_iter                  # a Python int, like the reference's
    assert isinstance(sweeps, int) and isinstance(ctx.transport.converged, bool), ctx.transport
    assert bwd.total == 0, bwd
    assert set(fwd.by_kind) <= {"shape", "bool", "get"}, fwd
    assert fwd["shape"] <= 4 and fwd["get"] <= 1, fwd
    assert fwd["bool"] <= sweeps // _gsp_transport._SWEEPS + 2, (fwd, sweeps)
    if kernels == "cuda":
        assert fwd["get"] == 1 and fwd["shape"] == 0 and fwd["bool"] <= 1, fwd
        set_finite_checks(False)
        try:
            _, ctx, fwd, bwd = _catalogue_call("gsp.pool", kernels=kernels)
        finally:
            set_finite_checks(True)
        assert (fwd.total, fwd["get"], bwd.total) == (1, 1, 0), (fwd, bwd)


@standin
def test_gsp_kernels_read_nothing_inside_a_deferring_step():
    # Inside a training step's scope (refdml._deferred.deferring) the layer on the kernels
    # reads nothing: its solve summary waits for the step's read, its data checks are the
    # step's. The read then settles it (one transfer for the scope, no warning: converged).
    import warnings

    from refdml._deferred import DeferredReads, deferring

    reads = DeferredReads()
    with deferring(reads), warnings.catch_warnings():
        warnings.simplefilter("error")
        _, ctx, fwd, bwd = _catalogue_call("gsp.pool", kernels="cuda")
    assert (fwd.total, bwd.total) == (0, 0), (fwd, bwd)
    assert len(reads) == 1 and not isinstance(ctx.transport.n_iter, int), ctx.transport.n_iter
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, read = _counted(reads.read)
    assert read.total == 1 and reads.reads == 1, read


@given(st.lists(st.booleans(), min_size=1, max_size=40))
def test_true_rows_are_flatnonzero_without_a_count_read(mask):
    # The Sinkhorn loop's gather by index (refdml/gpu/ot/_sinkhorn._true_rows) is flatnonzero
    # given the count, which the loop already has.
    from refdml.gpu.ot._sinkhorn import _true_rows

    mask = np.array(mask)
    got = _true_rows(np, mask, int(np.count_nonzero(mask)))
    np.testing.assert_array_equal(got, np.flatnonzero(mask))


@standin
@pytest.mark.parametrize("checks", [False, True])
def test_gsp_objective_step_reads_nothing_back_on_host_labels(checks, data_checks_off):
    # refdml/train/objectives/_base.py: the value stays on the device (a 0-d array of the
    # outputs' dtype), host labels are uploaded and the split drawn from them on the host;
    # with data checks on, only the checks read.
    from refdml.train.objectives import GSPObjective

    cupy = _cupy()
    data_checks_off(checks)
    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(6), 4)
    y = rng.standard_normal((24, 5)).astype(np.float32)
    z = rng.dirichlet(np.ones(7), size=24).astype(np.float32)

    def objective(device):
        return GSPObjective("contrastive", lambda_=0.3, n_classes=6, attribute_dim=5,
                            rng=1, dtype=np.float32, device=device)

    on_device = objective("cuda")
    outputs = (cupy.asarray(y), cupy.asarray(z))
    (value, ctx), fwd = _counted(lambda: on_device.forward(outputs, labels))
    (d_y, d_z), bwd = _counted(lambda: on_device.backward(ctx, 1.0))
    if checks:
        # booleans, and each ridge system's definiteness (trace and ridge: one tolist)
        assert set(fwd.by_kind) | set(bwd.by_kind) <= {"bool", "tolist"}, (fwd, bwd)
        assert fwd["tolist"] <= 2, fwd
    else:
        assert fwd.total == 0 and bwd.total == 0, (fwd, bwd)
    assert value.shape == () and value.dtype == np.float32
    on_host = objective("cpu")
    expected, host_ctx = on_host.forward((y, z), labels)
    want_y, want_z = on_host.backward(host_ctx, 1.0)
    assert isinstance(expected, float)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    np.testing.assert_allclose(d_y.get(), want_y, rtol=0, atol=1e-5 * np.abs(want_y).max())
    np.testing.assert_allclose(d_z.get(), want_z, rtol=0, atol=1e-5 * np.abs(want_z).max())
    np.testing.assert_allclose(on_device.class_embeddings.grad.get(),
                               on_host.class_embeddings.grad, rtol=0,
                               atol=1e-5 * np.abs(on_host.class_embeddings.grad).max())
