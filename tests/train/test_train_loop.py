"""refdml.train._loop: one loop, many sinks; divergence told apart by exception type.

The same tiny token model as tests/train/test_train_trainer.py (Embedding -> GAP -> Linear ->
L2Normalize on 4 classes, 4 steps per epoch), trained once through :class:`Trainer` (the
on-disk sink) and once through :class:`TrainingLoop` with :class:`MemorySink`.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from refdml.exceptions import NonFiniteGradient
from refdml.train import Adam, NonFiniteStepError, Parameter
from refdml.train._checkpoint import load_checkpoint
from refdml.train.data import PKBatchSampler, make_token_splits
from refdml.train.layers import GAP, Embedding, L2Normalize, Linear, Sequential
from refdml.train.objectives import LossObjective
from refdml.train.trainer import (DiskSink, MemorySink, Trainer, TrainingDiverged,
                                  TrainingLoop, TrainingSink)
from _token_loop import DIM, token_loop_pieces

_pieces = token_loop_pieces


def _loop(sink, *, epochs=3, evaluate=None, select="val_map_at_r", select_from=0, **kwargs):
    pieces = _pieces()
    pieces.update(kwargs)
    if evaluate is not None:
        pieces["val_data"] = pieces["test_data"] = None
    return TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                        epochs=epochs, evaluate=evaluate, select=select,
                        select_from=select_from, sink=sink, **pieces)


@pytest.mark.parametrize("seed", [0, 3])
def test_memory_sink_records_what_the_disk_sink_writes(tmp_path, seed):
    pieces = _pieces(seed)
    trainer = Trainer(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                      out_dir=tmp_path, epochs=3, **pieces)
    trainer.fit()
    sink = MemorySink()
    pieces = _pieces(seed)
    loop = TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                        epochs=3, sink=sink, **pieces)
    loop.fit()
    # Equal, not close: the same code on the same seeded inputs in one process (one BLAS
    # thread each), and JSON keeps a Python float exactly (repr round-trips).
    logged = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in logged] == [0, 1, 2, 3]
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in sink.rows]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in logged]
    parameters, _, meta = load_checkpoint(tmp_path / "best.npz")
    assert sink.best_epoch == meta["epoch"] == trainer.best_epoch == loop.best_epoch
    assert set(sink.best_parameters) == set(parameters)
    for name, value in parameters.items():
        assert_array_equal(sink.best_parameters[name], value)
    last, _, _ = load_checkpoint(tmp_path / "checkpoint.npz")
    for name, p in loop.parameters.items():
        assert_array_equal(p.value, last[name])
    assert sink.curves(["epoch"]) == {"epoch": [0, 1, 2, 3]}


def test_memory_sink_restores_the_best_parameters():
    script = [0.2, 0.9, 0.5, 0.4]     # epoch 1 is the best, 3 the last
    seen = []

    def evaluate():
        seen.append({name: p.value.copy() for name, p in loop.parameters.items()})
        return {"val": script[len(seen) - 1]}

    sink = MemorySink(restore_best=True)
    loop = _loop(sink, evaluate=evaluate, select="val", select_from=1)
    loop.fit()
    assert sink.best_epoch == 1 and loop.epoch == 3
    for name, p in loop.parameters.items():
        assert_array_equal(p.value, seen[1][name])
        assert not np.array_equal(seen[1][name], seen[3][name])   # it trained after epoch 1
    with pytest.raises(TypeError, match="restore_best"):
        MemorySink(restore_best=1)


class Recorder(TrainingSink):
    def __init__(self):
        self.calls = []

    def start(self, loop):
        self.calls.append(("start", loop.epoch, loop.started))

    def end_epoch(self, loop, row):
        assert loop.epoch == row["epoch"]
        self.calls.append(("end_epoch", row["epoch"], row.get(loop.select)))

    def new_best(self, loop, row):
        assert loop.best_epoch == row["epoch"] and loop.best_metric == row[loop.select]
        self.calls.append(("new_best", row["epoch"], row[loop.select]))

    def end(self, loop):
        self.calls.append(("end", loop.epoch, loop.best_epoch))

    def diverged_note(self, loop):
        return f"; recorder saw epoch {loop.epoch}"


@pytest.mark.parametrize("select_from", [0, 1])
def test_custom_sink_receives_the_calls_in_order(select_from):
    script = iter([0.5, 0.7, 0.7, 0.9])     # a tie at epoch 2: not a new best
    sink = Recorder()
    loop = _loop(sink, evaluate=lambda: {"val": next(script)}, select="val",
                 select_from=select_from)
    rows = loop.fit()
    expected = [("start", 0, False), ("end_epoch", 0, 0.5), ("new_best", 0, 0.5),
                ("end_epoch", 1, 0.7), ("new_best", 1, 0.7), ("end_epoch", 2, 0.7),
                ("end_epoch", 3, 0.9), ("new_best", 3, 0.9), ("end", 3, 3)]
    if select_from == 1:
        expected.remove(("new_best", 0, 0.5))
    assert sink.calls == expected
    assert [r["best_val"] for r in rows] == [0.5 if select_from == 0 else -math.inf,
                                             0.7, 0.7, 0.9]
    # a second fit() with nothing left to train: no start, no epoch, only the end
    sink.calls.clear()
    assert loop.fit() == [] and sink.calls == [("end", 3, 3)]


def test_no_select_never_calls_new_best():
    sink = Recorder()
    loop = _loop(sink, epochs=1, evaluate=lambda: {"val": 1.0}, select=None)
    rows = loop.fit()
    assert [c[0] for c in sink.calls] == ["start", "end_epoch", "end_epoch", "end"]
    assert "best_val" not in rows[-1]


def test_loop_refuses_bad_sinks_and_evaluations():
    with pytest.raises(TypeError, match="sink must be a TrainingSink"):
        _loop(object())
    with pytest.raises(TypeError, match="val_data is required"):
        pieces = _pieces()
        pieces["val_data"] = None
        TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                     epochs=1, **pieces)
    with pytest.raises(ValueError, match=r"select == 'val' is not an entry"):
        _loop(None, evaluate=lambda: {"other": 1.0}, select="val").fit()
    with pytest.raises(ValueError, match=r"\['lr'\], names the loop's row uses"):
        _loop(None, evaluate=lambda: {"lr": 1.0}, select="lr").fit()
    with pytest.raises(ValueError, match="select == None"):
        _loop(None, evaluate=lambda: {"v": 1.0}, select=None, early_stopping_patience=2)


def test_disk_sink_note_names_the_last_good_checkpoint(tmp_path):
    sink = DiskSink(tmp_path / "run")
    assert sink.diverged_note(_loop(sink)) == (
        f"; the last good checkpoint (epoch 0) is {tmp_path / 'run' / 'checkpoint.npz'}")
    with pytest.raises(ValueError, match="out_dir == ''"):
        DiskSink("")


# -- exception types -------------------------------------------------------------------
def test_exception_classes():
    # what callers caught before keeps catching: an optimiser's ValueError, reproduce's
    # FloatingPointError, the trainer's RuntimeError
    assert issubclass(NonFiniteGradient, ValueError)
    assert issubclass(NonFiniteGradient, FloatingPointError)
    assert issubclass(NonFiniteStepError, NonFiniteGradient)
    assert issubclass(TrainingDiverged, RuntimeError)
    assert issubclass(TrainingDiverged, FloatingPointError)
    p = Parameter(np.ones(3), name="w")
    optimizer = Adam([p], lr=0.1)
    p.grad[...] = [0.0, np.nan, 1.0]
    with pytest.raises(NonFiniteGradient, match="gradient of w is not finite"):
        optimizer.step()
    assert_array_equal(p.value, np.ones(3))


class _Raising:
    """Wraps a model; its backward raises ``error`` at the ``at``-th call."""

    def __init__(self, model, error, at):
        self.model, self.error, self.at, self.calls = model, error, at, 0

    def parameters(self):
        return self.model.parameters()

    def forward(self, x):
        return self.model.forward(x)

    def backward(self, ctx, d_y):
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return self.model.backward(ctx, d_y)


def test_divergence_is_told_by_type_not_by_message():
    pieces = _pieces()
    # a NonFiniteGradient whose text says nothing of finiteness: still a divergence
    error = NonFiniteGradient("layer 2 blew up")
    pieces["model"] = _Raising(pieces["model"], error, at=6)
    sink = Recorder()
    loop = _loop(sink, **pieces)
    with pytest.raises(TrainingDiverged, match=r"epoch 2, step 2 \(layer 2 blew up\); "
                                               r"stopped .*; recorder saw epoch 1") as info:
        loop.fit()
    assert info.value.__cause__ is error
    # end() is not called after a divergence; epoch 1 was the last one reported
    assert "end" not in [c[0] for c in sink.calls] and sink.calls[-1][1] == 1
    # a plain ValueError that mentions "not finite" is not a divergence: it propagates
    pieces = _pieces()
    error = ValueError("x is not finite")
    pieces["model"] = _Raising(pieces["model"], error, at=2)
    with pytest.raises(ValueError, match="x is not finite") as info:
        _loop(None, **pieces).fit()
    assert info.type is ValueError


def test_reproduce_fit_diverges_with_a_floating_point_error():
    from refdml.reproduce._train import fit

    class NanLoss(LossObjective):
        def forward(self, outputs, labels):
            value, ctx = super().forward(outputs, labels)
            return math.nan, ctx

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((32, 6)), np.repeat(np.arange(4), 8)
    model = Sequential([Linear(6, 3, rng=rng), L2Normalize()])
    before = [p.value.copy() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match=r"epoch 1, step 1 \(the loss is nan\)") as info:
        fit(model, NanLoss("contrastive"), x, y, epochs=2, lr=0.1, n_classes_per_batch=4,
            n_samples_per_class=4, seed=0, dtype=np.float64, evaluate=lambda: {"v": 0.0})
    assert isinstance(info.value, TrainingDiverged)
    for p, value in zip(model.parameters(), before):
        assert_array_equal(p.value, value)


# ------------------------------------------------------------------ checks on a GPU: deferred
def _device_pieces(seed=0):
    """_pieces on the device (CuPy: the stand-in in CI), float32."""
    splits = make_token_splits(rng=seed, n_classes=4, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    rng = np.random.default_rng(seed)
    opts = dict(dtype=np.float32, device="cuda")
    model = Sequential([Embedding(splits.train.n_tokens, DIM, rng=rng, **opts), GAP(),
                        Linear(DIM, DIM, rng=rng, **opts), L2Normalize()])
    optimizer = Adam(model.parameters(), lr=1e-2)
    sampler = PKBatchSampler(splits.train.labels, n_classes_per_batch=4,
                             n_samples_per_class=4, rng=seed)
    return dict(model=model, objective=LossObjective("contrastive"), optimizer=optimizer,
                train_sampler=sampler, train_data=splits.train, val_data=splits.val,
                test_data=None, seed=seed, dtype="float32", device="cuda", progress=False)


class _PoisonedGradient:
    """The objective, whose gradient of the outputs is NaN at entry (1, 2) on call ``at``."""

    def __init__(self, objective, at):
        self.objective, self.at, self.calls = objective, at, 0

    def __getattr__(self, name):
        return getattr(self.objective, name)

    def backward(self, ctx, d_value):
        self.calls += 1
        d = self.objective.backward(ctx, d_value)
        if self.calls == self.at:
            d = d.copy()
            d[1, 2] = math.nan
        return d


@pytest.mark.requires_cupy
@pytest.mark.parametrize("log_every", [1, 3, 50])
def test_on_the_device_a_nan_at_step_k_is_named_at_the_next_read(log_every):
    from cupy_standin import count_transfers

    from refdml._backend import to_numpy

    pieces = _device_pieces()
    pieces["objective"] = _PoisonedGradient(pieces["objective"], at=6)   # epoch 2, step 2
    kept = {}

    def keep():
        # the parameters after each step (the hook's host reads are the test's, not the loop's)
        kept[loop.optimizer.n_steps] = {n: np.array(to_numpy(p.value))
                                        for n, p in loop.parameters.items()}

    loop = _loop(None, epochs=3, log_every=log_every, after_step=keep, **pieces)
    with pytest.raises(TrainingDiverged,
                       match=r"diverged at epoch 2, step 2 \(the objective's gradient of the "
                             r"outputs is not finite \(NaN or inf\) at index \(1, 2\) at epoch "
                             r"2, step 2\); stopped without updating") as info:
        loop.fit()
    assert isinstance(info.value.__cause__, NonFiniteGradient)
    assert loop.optimizer.n_steps == 5       # put back to the last good step
    for name, p in loop.parameters.items():  # and the device updated nothing from step 6 on
        assert_array_equal(to_numpy(p.value), kept[5][name])


@pytest.mark.requires_cupy
def test_on_the_device_a_step_reads_the_host_once_every_log_every_steps():
    from cupy_standin import count_transfers

    pieces = _device_pieces()
    loop = _loop(None, epochs=1, log_every=2, select=None, evaluate=lambda: {"v": 0.0}, **pieces)
    loop.fit()                               # epoch 0's evaluation and a first epoch
    with count_transfers() as reads:
        loss = loop._train_epoch(2)          # 4 steps: reads after steps 2 and 4
    assert reads.total == 2, reads
    assert math.isfinite(loss)


def test_non_finite_training_inputs_are_named_with_their_step_and_index():
    pieces = _pieces()
    loop = _loop(None, epochs=1, evaluate=lambda: {"v": 0.0}, select=None, **pieces)
    loop.train_x = loop.train_x.astype(np.float64)
    batch = next(iter(PKBatchSampler(loop.train_y, n_classes_per_batch=4, n_samples_per_class=4,
                                     rng=0)))
    loop.train_x[batch[3], 1] = np.inf
    with pytest.raises(ValueError, match=r"training inputs of epoch 1, step 1 are not finite: "
                                         r"inf at index \(3, 1\)"):
        loop.fit()
