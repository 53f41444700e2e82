"""The captured training step (issue 46, lever 5: refdml.train._capture) on the CuPy stand-in.

A CUDA graph replays device work and runs no Python, so a captured step must not read the
device, upload or allocate outside CuPy's pool inside its captured region. The stand-in's
capture mode (``Stream.begin_capture``/``end_capture``) refuses each of these with
:class:`cupy_standin.CaptureError`; these tests check that it does (so that the step's
passing is not vacuous), that the loop's captured step passes it, that its trajectory is
the uncaptured loop's, and that a NaN at step k is still named at step k. The stand-in
cannot replay a graph: each "replay" runs the step again inside a capture
(refdml.train._capture's module docstring). On a GPU, tests/gpu/test_gpu_capture.py
replays real graphs.
"""

from __future__ import annotations

import math
import sys
import tempfile

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from refdml.exceptions import NonFiniteGradient
from refdml.train.trainer import TrainingDiverged
from test_train_loop import _PoisonedGradient, _device_pieces, _loop

pytestmark = [
    pytest.mark.requires_cupy,
    pytest.mark.skipif(not getattr(sys.modules.get("cupy"), "__refdml_standin__", False),
                       reason="the capture checks are the CuPy stand-in's "
                              "(REFDML_CUPY_STANDIN=1); a GPU runs tests/gpu/test_gpu_capture.py"),
]


def _host(loop):
    from refdml._backend import to_numpy

    return {name: np.array(to_numpy(p.value)) for name, p in loop.parameters.items()}


# ------------------------------------------------------------------ the stand-in's capture
def _unsafe_operations():
    import cupy

    from refdml.gpu._support.cuda import cuda

    x = cupy.arange(4.0)
    other = cupy.cuda.Stream(non_blocking=True)

    def on_other_stream():
        with other:
            x + 1

    return {
        "float": (lambda: float(x.sum()), r"host read or synchronisation \(float\)"),
        "get": (lambda: x.get(), r"host read or synchronisation \(get\)"),
        "nonzero": (lambda: cupy.nonzero(x), r"host read or synchronisation \(shape\)"),
        "synchronize": (lambda: cupy.cuda.get_current_stream().synchronize(),
                        r"\(synchronize\)"),
        "upload": (lambda: cupy.asarray(np.ones(3)), r"host-to-device copy"),
        "set": (lambda: x.set(np.ones(4)), r"host-to-device copy"),
        "numba device_array": (lambda: cuda.device_array(3), r"numba.cuda.device_array"),
        "numba to_device": (lambda: cuda.to_device(np.ones(3)), r"numba.cuda.to_device"),
        "another stream": (on_other_stream, r"a launch \(add\) on <Stream"),
    }


UNSAFE = ("float", "get", "nonzero", "synchronize", "upload", "set", "numba device_array",
          "numba to_device", "another stream")


def test_every_unsafe_operation_is_tried():
    pytest.importorskip("cupy")
    assert set(_unsafe_operations()) == set(UNSAFE)


@pytest.mark.parametrize("name", UNSAFE)
def test_the_standin_refuses_inside_a_capture_what_a_graph_cannot_hold(name):
    import cupy
    from cupy_standin import CaptureError

    operation, message = _unsafe_operations()[name]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        assert stream.is_capturing()
        try:
            with pytest.raises(CaptureError, match=message):
                operation()
        finally:
            graph = stream.end_capture()
        assert not stream.is_capturing()
        operation()                                   # allowed again once the capture ends
    with pytest.raises(NotImplementedError, match="cannot be replayed"):
        graph.launch(stream)


def test_the_standin_captures_device_work_on_its_stream_and_counts_it():
    import cupy

    x = cupy.arange(4.0)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        y = cupy.exp(x) + 1.0                         # two launches, nothing read
        graph = stream.end_capture()
    assert graph.launches.total == 2, graph.launches
    assert_allclose(y.get(), np.exp(np.arange(4.0)) + 1.0, rtol=1e-15)


def test_the_standin_captures_only_on_a_non_blocking_stream():
    import cupy

    with pytest.raises(RuntimeError, match="default \\(legacy\\) stream"):
        cupy.cuda.Stream.null.begin_capture()
    with pytest.raises(RuntimeError, match="non-blocking stream only"):
        cupy.cuda.Stream().begin_capture()


# ------------------------------------------------------------------ the loop's captured step
@pytest.mark.parametrize("log_every", [2, 5])
def test_the_captured_loop_follows_the_uncaptured_trajectory(log_every):
    # Two warm-up steps, a capture, then replays: 4 steps an epoch, 3 epochs. The step is
    # the same code either way (staged buffers instead of fresh uploads), so the values
    # agree to float32 roundoff at most (they came out equal here; not asserted bitwise).
    results = {}
    for capture in (False, True):
        loop = _loop(None, epochs=3, log_every=log_every, capture=capture, **_device_pieces())
        rows = loop.fit()
        results[capture] = (_host(loop), [row["train_loss"] for row in rows],
                            loop.optimizer.n_steps, loop)
    plain, captured = results[False], results[True]
    counts = captured[3]._step_capture.counts
    assert counts == {"uncaptured": 2, "captured": 1, "replayed": 9}, counts
    assert captured[2] == plain[2] == 12
    assert_allclose(captured[1][1:], plain[1][1:], rtol=1e-6)
    for name, value in plain[0].items():
        assert_allclose(captured[0][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_an_objective_that_reads_its_loss_back_is_refused_before_its_first_update():
    # The triplet loss reads its value to the host inside the step (a Python float): a
    # captured step cannot, and the loop says so at the first (uncaptured) step, before
    # the optimiser has moved anything, instead of failing later on the float.
    from refdml._deferred import CaptureUnsafe
    from refdml.train.objectives import LossObjective

    loop = _loop(None, epochs=1, capture=True,
                 **dict(_device_pieces(), objective=LossObjective("triplet")))
    before = _host(loop)
    with pytest.raises(CaptureUnsafe, match=r"objective 'triplet' returned its loss as a host "
                                            r"number \(float\).*capture=False"):
        loop.fit()
    for name, value in before.items():
        assert_array_equal(_host(loop)[name], value, err_msg=name)
    assert loop.optimizer.n_steps == 0


# The losses whose cosine normalisation and backward take row dots (Backend.row_dot): a
# batched product outside a capture, a product and a sum inside one (CuPy refuses cuBLAS;
# the batched product stopped each of them at the capture before); and soft_triple, whose
# classes of centres (unique) and value were read back. On the array path, and one on the
# CUDA kernels ("auto", simulated: slow, so one loss).
_COSINE_LOSSES = [(loss, "array") for loss in ("multi_similarity", "proxy_nca", "proxy_anchor",
                                               "proxy_contrastive", "proxy_multi_similarity",
                                               "soft_triple")]


@pytest.mark.parametrize("loss, mode", _COSINE_LOSSES + [("proxy_nca", "auto")])
def test_a_loss_that_normalises_its_embeddings_is_captured(loss, mode):
    from refdml.gpu import use_kernels
    from refdml.train.objectives import LossObjective
    from _token_loop import DIM

    results = {}
    for capture in (False, True):
        extra = (dict(n_classes=4, dim=DIM, rng=np.random.default_rng(0))
                 if loss.startswith("proxy") else {})
        if loss == "soft_triple":   # two centres a class: its classes are groups of centres
            extra = dict(n_classes=4, dim=DIM, proxies_per_class=2, rng=np.random.default_rng(0))
        objective = LossObjective(loss, dtype=np.float32, device="cuda", **extra)
        loop = _loop(None, epochs=1, log_every=2, capture=capture,
                     **dict(_device_pieces(), objective=objective))
        with use_kernels(mode):
            rows = loop.fit()
        results[capture] = (_host(loop), [row["train_loss"] for row in rows], loop)
    plain, captured = results[False], results[True]
    counts = captured[2]._step_capture.counts
    assert counts == {"uncaptured": 2, "captured": 1, "replayed": 1}, counts
    assert_allclose(captured[1][1:], plain[1][1:], rtol=1e-6)
    for name, value in plain[0].items():
        assert_allclose(captured[0][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_capture_needs_a_device():
    pieces = _device_pieces()
    pieces.update(device="cpu", dtype="float32")
    with pytest.raises(ValueError, match="capture == True .* needs device == 'cuda', got 'cpu'"):
        _loop(None, capture=True, **pieces)


@pytest.mark.parametrize("log_every", [1, 50])
def test_under_capture_a_nan_at_step_k_is_named_at_step_k(log_every):
    # Step 6 (epoch 2, step 2) is a replayed step: its checks come back through its ring row,
    # labelled with its step; the optimiser's step number comes from the device's count.
    pieces = _device_pieces()
    pieces["objective"] = _PoisonedGradient(pieces["objective"], at=6)
    kept = {}

    def keep():
        kept[loop.optimizer.n_steps] = _host(loop)

    loop = _loop(None, epochs=3, log_every=log_every, after_step=keep, capture=True, **pieces)
    with pytest.raises(TrainingDiverged,
                       match=r"diverged at epoch 2, step 2 \(the objective's gradient of the "
                             r"outputs is not finite \(NaN or inf\) at index \(1, 2\) at epoch "
                             r"2, step 2\); stopped without updating") as info:
        loop.fit()
    assert isinstance(info.value.__cause__, NonFiniteGradient)
    assert loop._step_capture.counts["replayed"] >= 3          # steps 4, 5, 6 at least
    assert loop.optimizer.n_steps == 5                           # put back to the last good step
    for name, value in _host(loop).items():
        assert_array_equal(value, kept[5][name])


class _Unsafe:
    """The objective, with something a graph cannot hold added to its forward."""

    def __init__(self, objective, what):
        self.objective, self.what = objective, what

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def forward(self, outputs, labels, **kwargs):
        import cupy

        value, ctx = self.objective.forward(outputs, labels, **kwargs)
        if self.what == "read":
            float(value)                               # the loss read back on the host
        elif self.what == "upload":
            value = value + cupy.asarray(np.float32(0.0))   # a constant copied up per step
        elif self.what == "draw":
            self.objective.rng.random()                # host randomness inside the step
        elif self.what == "library":
            value = value + cupy.linalg.cholesky(cupy.eye(2, dtype=value.dtype))[0, 0] - 1
        return value, ctx


@pytest.mark.parametrize(("what", "error", "message"), [
    ("read", "CaptureError", r"host read or synchronisation \(float\)"),
    ("upload", "CaptureError", "host-to-device copy"),
    ("draw", "CaptureUnsafe", "drew from its generator inside the captured step"),
    ("library", "CaptureUnsafe", r"calls a CUDA library that CuPy cannot capture \(calling "
                                 r"cuSOLVER API during stream capture"),
])
def test_a_step_made_unsafe_on_purpose_is_refused_at_its_capture(what, error, message):
    import cupy_standin

    from refdml import _deferred

    errors = {"CaptureError": cupy_standin.CaptureError, "CaptureUnsafe": _deferred.CaptureUnsafe}
    pieces = _device_pieces()
    objective = pieces["objective"]
    if what == "draw":
        objective.rng = np.random.default_rng(0)
        objective.state_dict = lambda: {"state": objective.rng.bit_generator.state}
    pieces["objective"] = _Unsafe(objective, what)
    loop = _loop(None, epochs=1, log_every=50, capture=True, select=None,
                 evaluate=lambda: {"v": 0.0}, **pieces)
    with pytest.raises(errors[error], match=message):
        loop.fit()
    # refused at the capture (the third step), after two uncaptured warm-up steps
    assert loop._step_capture.counts == {"uncaptured": 2}


def test_an_upload_the_step_did_not_stage_is_refused_while_capturing():
    import cupy

    from refdml._deferred import CaptureUnsafe, StagedUploads, staged_upload, staging

    stage = StagedUploads(cupy)
    staged = stage.put("labels", np.arange(4))
    with staging(stage):
        assert staged_upload(cupy, np.arange(4), "labels") is staged      # found: no copy
        other = staged_upload(cupy, np.arange(4) + 1, "labels")          # another value
        assert other is not staged
        stage.capturing = True
        assert staged_upload(cupy, np.arange(4), "labels") is staged
        with pytest.raises(CaptureUnsafe, match="uploads 'labels' \\(shape \\(4,\\)\\)"):
            staged_upload(cupy, np.arange(4) + 1, "labels")
        with pytest.raises(CaptureUnsafe, match="allocated while capturing"):
            stage.put("other", np.zeros(2))


# ------------------------------------------------------------------ the digits-collage step
#: The narrow model of tests/gpu/test_gpu_launch_counts.py's small rows.
SMALL_STEP = dict(n_classes_per_batch=2, n_samples_per_class=2, conv_channels=[4, 4, 4],
                  local_dim=8, n_prototypes=8, embedding_dim=8)


def _collage(out_dir):
    from refdml.train.runs import build_run

    run = build_run("digits-collage", dict(dtype="float32", device="cuda", epochs=0,
                                           progress=False, **SMALL_STEP), out_dir=out_dir)
    return run.trainer


@pytest.mark.requires_cuda
def test_the_digits_collage_step_runs_inside_a_capture_under_auto():
    # GSP's head and objective, the zero-shot split drawn before the step and its index
    # staged, under "auto" (the CUDA kernels, simulated): captured, then replayed, with no
    # host read in the whole step (staging included) and nothing copied up inside the
    # captured region (the stand-in refuses it), and the trajectory of the uncaptured loop.
    from cupy_standin import count_transfers

    from refdml.gpu import use_kernels
    from refdml.train._capture import StepCapture

    n_steps = 4
    results = {}
    for capture in (False, True):
        with tempfile.TemporaryDirectory() as out_dir:
            loop = _collage(out_dir)
        loop.log_every = n_steps
        if capture:
            loop._step_capture = StepCapture(loop)
        with use_kernels("auto"):
            hows, transfers = _run_steps(loop, n_steps, capture, count_transfers)
        results[capture] = (_host(loop), hows, transfers, loop)
    _, hows, transfers, loop = results[True]
    assert hows == ["uncaptured", "uncaptured", "captured", "replayed"], hows
    assert all(t.total == 0 for t in transfers), transfers
    graph = next(iter(loop._step_capture.graphs.values()))
    assert graph.captures == 2 and graph.launches > 0, (graph.captures, graph.launches)
    for name, value in results[False][0].items():
        assert_allclose(results[True][0][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _run_steps(loop, n_steps, capture, count_transfers):
    """``n_steps`` steps of the loop's epoch (captured or not), then its read."""
    from refdml._deferred import DeferredReads, deferring

    reads, values, hows, transfers = DeferredReads(), [], [], []
    batches = iter(loop.train_sampler)
    with deferring(reads):
        steps = loop._step_capture if capture else None
        outer = steps.enter() if capture else None
        try:
            for step in range(1, n_steps + 1):
                batch = next(batches)
                reads.where = f"epoch 1, step {step}"
                inputs, labels = loop.train_x[batch].astype(np.float32), loop.train_y[batch]
                with count_transfers() as counted:
                    if capture:
                        hows.append(steps.step(inputs, labels, reads, values.append))
                    else:
                        import cupy

                        loop.optimizer.zero_grad()
                        outputs, ctx = loop.model.forward(cupy.asarray(inputs))
                        value, objective_ctx = loop.objective.forward(outputs, labels)
                        loop._device_step(value, objective_ctx, ctx)
                        reads.add(value, lambda v, where: values.append(float(v[0])))
                transfers.append(counted)
            reads.read()
        finally:
            if capture:
                steps.after_read()
                steps.leave(outer)
    assert len(values) == n_steps and all(math.isfinite(v) for v in values), values
    return hows, transfers


@pytest.mark.requires_cuda
def test_the_array_path_is_not_capture_safe():
    # The array path (use_kernels("array")) calls cuBLAS in GSP's normalisation (the rows'
    # norms by einsum), then reads sizes back (nonzero): the stand-in refuses the first at
    # the capture, as CuPy does, and the capture names it (CaptureUnsafe), so only "auto"
    # (the CUDA kernels) is captured. (What the capture opt-in needs on CuPy:
    # docs/gpu/cost-model.md.)
    from cupy_standin import count_transfers

    from refdml._deferred import CaptureUnsafe
    from refdml.gpu import use_kernels
    from refdml.train._capture import StepCapture

    with tempfile.TemporaryDirectory() as out_dir:
        loop = _collage(out_dir)
    loop.log_every = 4
    loop._step_capture = StepCapture(loop)
    with use_kernels("array"), pytest.raises(CaptureUnsafe,
                                             match=r"cuBLAS API during stream capture"):
        _run_steps(loop, 3, True, count_transfers)
    assert loop._step_capture.counts == {"uncaptured": 2}
