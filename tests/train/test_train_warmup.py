"""The warm-up of refdml.train's loop: epochs 1..W train only the warm-up parameters.

The papers (GSP supp., ASAP) warm the embedding layer up for one epoch with the proxy
losses. The tiny token model of tests/train/test_train_loop.py (Embedding -> GAP -> Linear ->
L2Normalize on 4 classes, 4 steps per epoch); the warm-up trains the Linear, the embedding
layer that :func:`refdml.train.models.embedding_layer_parameters` finds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from _token_loop import token_loop_pieces

from refdml.train import Adam, Parameter
from refdml.train.layers import GAP, L2Normalize, Linear, ReLU, Sequential
from refdml.train.models import TwoBranches, embedding_layer_parameters
from refdml.train.trainer import Trainer, TrainingLoop, TrainingSink

STEPS_PER_EPOCH = 4        # 64 training samples in 4 x 4 batches
_pieces = token_loop_pieces

class Snapshots(TrainingSink):
    """Every parameter's value after every epoch (0: the untrained model)."""

    def __init__(self):
        self.values = []

    def end_epoch(self, loop, row):
        self.values.append({name: p.value.copy() for name, p in loop.parameters.items()})


def test_embedding_layer_parameters_is_the_last_linear():
    rng = np.random.default_rng(0)
    first, last = Linear(3, 4, rng=rng, name="first"), Linear(4, 2, rng=rng, name="tail")
    model = Sequential([first, ReLU(), GAP(), last, L2Normalize()])
    assert embedding_layer_parameters(model) == [last.weight, last.bias]
    nested = Sequential([Sequential([first], name="inner"), GAP(),
                         Sequential([last, L2Normalize()], name="outer")])
    assert embedding_layer_parameters(nested) == [last.weight, last.bias]
    # XML's model: the histogram branch has no Linear; the tail's Linear follows the branches.
    pieces = _pieces()
    assert [p.name for p in embedding_layer_parameters(pieces["model"])] == [
        "linear.weight", "linear.bias"]
    branches = TwoBranches(GAP(), Sequential([Linear(4, 4, rng=rng, name="side")]))
    assert [p.name for p in embedding_layer_parameters(Sequential([branches]))] == [
        "side.weight", "side.bias"]
    with pytest.raises(ValueError, match=r"model 'headless' \(Sequential\) has no Linear"):
        embedding_layer_parameters(Sequential([GAP(), L2Normalize()], name="headless"))
    with pytest.raises(TypeError, match="model must be a Layer"):
        embedding_layer_parameters([first])


def test_warmup_epoch_trains_only_the_warmup_parameters():
    pieces = _pieces()
    model, optimizer = pieces["model"], pieces["optimizer"]
    sink = Snapshots()
    loop = TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                        epochs=3, sink=sink, warmup_epochs=1,
                        warmup_params=embedding_layer_parameters(model), **pieces)
    loop.fit()
    before, warm, after, last = sink.values
    assert_array_equal(warm["embedding.table"], before["embedding.table"])
    for name in ("linear.weight", "linear.bias"):
        assert not np.array_equal(warm[name], before[name])
    assert not np.array_equal(after["embedding.table"], warm["embedding.table"])
    assert not np.array_equal(last["embedding.table"], after["embedding.table"])
    assert optimizer.frozen == ()
    # The table's own Adam step count skipped epoch 1: its first step was t = 1.
    state = optimizer.state_dict()["params"]
    assert state["embedding.table"]["step_offset"] == STEPS_PER_EPOCH
    assert "step_offset" not in state["linear.weight"]
    assert optimizer.n_steps == 3 * STEPS_PER_EPOCH
    assert loop.config()["warmup"] == {"epochs": 1, "params": ["linear.weight",
                                                               "linear.bias"]}


def test_without_warmup_the_config_and_training_are_as_before():
    pieces = _pieces()
    loop = TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                        epochs=1, **pieces)
    assert "warmup" not in loop.config()
    assert "param_groups" not in loop.config()["optimizer"]
    loop.fit()
    assert loop.optimizer.frozen == ()


def test_param_groups_reach_the_config():
    pieces = _pieces()
    model = pieces.pop("model")
    head = embedding_layer_parameters(model)
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    optimizer = Adam([{"params": rest, "name": "trunk"},
                      {"params": head, "lr_multiplier": 10.0, "name": "head"}], lr=1e-2)
    pieces["optimizer"] = optimizer
    loop = TrainingLoop(model, pieces.pop("objective"), pieces.pop("optimizer"), epochs=1,
                        **pieces)
    assert loop.config()["optimizer"]["param_groups"] == [
        {"name": "trunk", "lr_multiplier": 1.0, "params": ["embedding.table"]},
        {"name": "head", "lr_multiplier": 10.0, "params": ["linear.weight", "linear.bias"]}]


class _Killed(Exception):
    pass


def _killer(at_step):
    """An ``after_step`` that raises at its ``at_step``-th call (None: never), as a kill.
    One function name for both runs: the trainer's config.json records it."""
    calls = [0]

    def after_step():
        calls[0] += 1
        if calls[0] == at_step:
            raise _Killed

    return after_step


def _trainer(out_dir, *, kill_at=None):
    pieces = _pieces()
    model = pieces.pop("model")
    return Trainer(model, pieces.pop("objective"), pieces.pop("optimizer"), out_dir=out_dir,
                   epochs=3, warmup_epochs=2, warmup_params=embedding_layer_parameters(model),
                   after_step=_killer(kill_at), **pieces)


def test_trainer_resumed_mid_warmup_freezes_as_the_uninterrupted_run(tmp_path):
    straight = _trainer(tmp_path / "straight")
    straight.fit()
    # Killed at the 2nd step of epoch 2 (a warm-up epoch); the last checkpoint is epoch 1's.
    killed = _trainer(tmp_path / "split", kill_at=STEPS_PER_EPOCH + 2)
    with pytest.raises(_Killed):
        killed.fit()
    resumed = _trainer(tmp_path / "split")
    resumed.resume()
    assert resumed.epoch == 1 and resumed.optimizer.frozen == ("embedding.table",)
    resumed.fit()
    # Equal, not close: the same float operations in the same order (the resume restores
    # every buffer, step offset and the frozen set; the loop re-freezes at each epoch).
    for name, p in straight.parameters.items():
        assert_array_equal(resumed.parameters[name].value, p.value)
    for trainer in (straight, resumed):
        state = trainer.optimizer.state_dict()["params"]["embedding.table"]
        assert state["step_offset"] == 2 * STEPS_PER_EPOCH      # frozen in epochs 1 and 2
    rows = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
             for line in (tmp_path / run / "log.jsonl").read_text().splitlines()]
            for run in ("straight", "split")]
    assert rows[0] == rows[1] and len(rows[0]) == 4
    config = json.loads((tmp_path / "straight" / "config.json").read_text())
    assert config["warmup"] == {"epochs": 2, "params": ["linear.weight", "linear.bias"]}


def test_resume_refuses_another_warmup(tmp_path):
    _trainer(tmp_path).fit()
    pieces = _pieces()
    model = pieces.pop("model")
    other = Trainer(model, pieces.pop("objective"), pieces.pop("optimizer"), out_dir=tmp_path,
                    epochs=3, warmup_epochs=1, warmup_params=embedding_layer_parameters(model),
                    after_step=_killer(None), **pieces)
    with pytest.raises(ValueError, match=r"differs in \['warmup'\]"):
        other.resume()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(warmup_epochs=-1), ValueError, r"warmup_epochs == -1"),
    (dict(warmup_epochs=1.5), TypeError, r"warmup_epochs must be an integer"),
    (dict(warmup_epochs=True), TypeError, r"warmup_epochs must be an integer"),
    (dict(warmup_epochs=4, warmup_params="head"), ValueError,
     r"warmup_epochs == 4, must be <= epochs == 3"),
    (dict(warmup_epochs=1), ValueError, r"warmup_epochs == 1 needs warmup_params"),
    (dict(warmup_params="head"), ValueError, r"warmup_params is given, but warmup_epochs == 0"),
    (dict(warmup_epochs=1, warmup_params=[]), ValueError, r"warmup_params is empty"),
    (dict(warmup_epochs=1, warmup_params=7), TypeError,
     r"warmup_params must be an iterable of Parameter objects, got 7"),
    (dict(warmup_epochs=1, warmup_params="tail"), TypeError,
     r"warmup_params must be an iterable of Parameter objects"),
    (dict(warmup_epochs=1, warmup_params=["linear.weight"]), TypeError,
     r"warmup_params\[0\] must be a Parameter"),
    (dict(warmup_epochs=1, warmup_params=[Parameter(np.ones(2), "stranger")]), ValueError,
     r"warmup_params\[0\] \(stranger\) is not a parameter of the optimiser"),
])
def test_bad_warmup_arguments_are_named(kwargs, error, match):
    pieces = _pieces()
    if kwargs.get("warmup_params") == "head":
        kwargs = {**kwargs, "warmup_params": embedding_layer_parameters(pieces["model"])}
    with pytest.raises(error, match=match):
        TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                     epochs=3, **kwargs, **pieces)
