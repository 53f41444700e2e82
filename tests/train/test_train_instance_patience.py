"""``TrainingLoop(instance_patience=k)``: ASAP's next problem instance on a validation
plateau (ASAP Sec. 4.4), on scripted validation values.

The rule, as the expected epochs below are worked out by hand: the first instance starts
at epoch 1; an instance's best starts at the value evaluated just before its first epoch
(epoch 0's for the first); an epoch whose value is strictly above the instance's best
moves it; ``k`` epochs after the instance's best without such an epoch, the next epoch
starts a new instance. The model is the tiny token model of test_train_loop.py; the
objective is its contrastive loss with a ``new_problem_instance`` that records when the
loop calls it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from _token_loop import InstanceRecorder, token_loop_pieces

from refdml.train.trainer import MemorySink, TrainingLoop

_pieces = token_loop_pieces
Instances = InstanceRecorder


def _scripted(script, *, epochs=None, sink=None, **kwargs):
    """A loop whose ``val`` entry of epoch ``e`` is ``script[e]``."""
    pieces = _pieces()
    objective = Instances()
    pieces.pop("objective")
    pieces["val_data"] = pieces["test_data"] = None
    # the epoch being evaluated: 0 before the loop started, else the last finished one + 1
    loop = TrainingLoop(pieces.pop("model"), objective, pieces.pop("optimizer"),
                        epochs=len(script) - 1 if epochs is None else epochs,
                        evaluate=lambda: {"val": script[loop.epoch + int(loop.started)]},
                        select="val", select_from=1, sink=sink, **pieces, **kwargs)
    objective.loop = loop
    return loop, objective


# (k, the validation values of epochs 0.., the epochs that start an instance), by hand.
@pytest.mark.parametrize("k, script, starts", [
    # k = 2: epoch 0's 0.50 is the first instance's best; 1, 2 stay below: epoch 3 starts
    # one, whose best is epoch 2's 0.45; 0.47 beats it (though not the run's 0.50); 4, 5
    # do not (5 ties 0.47: not strict): epoch 6 starts one; 6, 7 improve, 8, 9 do not:
    # epoch 10 would start one, but the budget ends at 9.
    (2, [0.50, 0.40, 0.45, 0.47, 0.46, 0.47, 0.60, 0.70, 0.65, 0.66], [1, 3, 6]),
    # k = 1: every epoch without a strict improvement starts one at the next.
    (1, [0.10, 0.20, 0.15, 0.30, 0.30, 0.10, 0.20], [1, 3, 5, 6]),
    # k = 3, always improving: the first instance runs to the end.
    (3, [0.10, 0.20, 0.30, 0.40, 0.50], [1]),
    # k = 3: a stall of exactly 3 epochs (2, 3, 4 below epoch 1's 0.30) starts one at 5;
    # its best is epoch 4's 0.10, which 5's 0.20 beats.
    (3, [0.10, 0.30, 0.20, 0.25, 0.10, 0.20, 0.15, 0.12], [1, 5]),
])
def test_instances_start_where_the_rule_says(k, script, starts):
    loop, objective = _scripted(script, sink=MemorySink(), instance_patience=k)
    rows = loop.fit()
    assert objective.calls == starts and loop.instance_starts == starts
    # each row counts the instances started up to its epoch (0 before the first)
    assert [r["instance"] for r in rows] == [sum(s <= e for s in starts)
                                            for e in range(len(script))]
    assert [r["val"] for r in rows] == script
    assert all(loop.instance_due(e) == (e in starts) for e in range(len(script)))


def test_instance_due_knows_only_up_to_the_next_epoch():
    script = [0.50, 0.40, 0.45, 0.47, 0.46, 0.47, 0.60, 0.70, 0.65, 0.66]
    loop, _ = _scripted(script, instance_patience=2)
    assert loop.instance_due(1) is True          # the first instance, before fit()
    with pytest.raises(ValueError, match="only up to the next epoch"):
        loop.instance_due(2)
    loop.fit()
    # epochs 8, 9 did not beat 0.70 (epoch 7): epoch 10 would start one
    assert loop.instance_due(10) is True and loop.next_instance_epoch == 10
    with pytest.raises(ValueError, match=r"epoch == 11"):
        loop.instance_due(11)


def test_run_patience_2k_stops_when_a_new_instance_does_not_beat_the_runs_best():
    """k = 2, run patience 4: the run's best is epoch 1's 0.30; epochs 2, 3 miss it, so
    epoch 4 starts an instance (its best epoch 3's 0.20). 4 and 5 beat the instance's best
    but not the run's: the run stops at 5 (4 epochs after its best), the second epoch of
    that instance."""
    script = [0.10, 0.30, 0.20, 0.20, 0.25, 0.28, 0.90, 0.90]
    loop, objective = _scripted(script, instance_patience=2, early_stopping_patience=4)
    rows = loop.fit()
    assert [r["epoch"] for r in rows] == [0, 1, 2, 3, 4, 5] and loop.stopped_early
    assert objective.calls == [1, 4]
    # the same run where the new instance beats the run's best at its second epoch
    script = [0.10, 0.30, 0.20, 0.20, 0.25, 0.35, 0.30, 0.30, 0.30, 0.30]
    loop, objective = _scripted(script, instance_patience=2, early_stopping_patience=4)
    rows = loop.fit()
    # 5 improves the run: 6, 7 miss it (instance at 8), 8, 9 too: the stop at 9
    assert [r["epoch"] for r in rows] == list(range(10)) and loop.stopped_early
    assert objective.calls == [1, 4, 8]


def test_instance_every_records_its_starts_too():
    loop, objective = _scripted([0.1] * 6, sink=MemorySink(), instance_every=2)
    rows = loop.fit()
    assert objective.calls == loop.instance_starts == [1, 3, 5]
    assert [r["instance"] for r in rows] == [0, 1, 1, 2, 2, 3]


def test_no_instance_entry_without_instances():
    loop, _ = _scripted([0.1, 0.2])
    rows = loop.fit()
    assert all("instance" not in r for r in rows) and loop.instance_starts == []


def test_instance_patience_errors():
    with pytest.raises(ValueError, match=r"instance_every == 2 and instance_patience == 3"):
        _scripted([0.1, 0.2], instance_every=2, instance_patience=3)
    for bad in (0, -1):
        with pytest.raises(ValueError, match="instance_patience"):
            _scripted([0.1, 0.2], instance_patience=bad)
    with pytest.raises(TypeError, match="instance_patience"):
        _scripted([0.1, 0.2], instance_patience=1.5)
    pieces = _pieces()
    with pytest.raises(TypeError, match=r"^instance_patience needs an objective with "
                                        r"new_problem_instance"):
        TrainingLoop(pieces.pop("model"), pieces.pop("objective"), pieces.pop("optimizer"),
                     epochs=2, instance_patience=2, **pieces)
    pieces = _pieces()
    pieces.pop("objective")
    with pytest.raises(ValueError, match=r"select == None, but instance_patience == 2"):
        TrainingLoop(pieces.pop("model"), Instances(), pieces.pop("optimizer"), epochs=2,
                     instance_patience=2, select=None, **pieces)


def test_evaluate_may_not_return_the_instance_entry():
    pieces = _pieces()
    pieces.pop("objective")
    pieces["val_data"] = pieces["test_data"] = None
    loop = TrainingLoop(pieces.pop("model"), Instances(), pieces.pop("optimizer"), epochs=1,
                        evaluate=lambda: {"val": 0.1, "instance": 3.0}, select="val",
                        instance_patience=1, **pieces)
    with pytest.raises(ValueError, match="instance"):
        loop.fit()


def test_config_records_instance_patience_only_when_set():
    loop, _ = _scripted([0.1, 0.2], instance_patience=3)
    assert loop.config()["instance_patience"] == 3 and loop.config()["instance_every"] is None
    json.dumps(loop.config())
    loop, _ = _scripted([0.1, 0.2], instance_every=3)
    assert "instance_patience" not in loop.config()


def test_scripted_values_reach_the_loop():
    """The scaffold itself: the ``val`` of each row is the script's entry of its epoch."""
    script = list(np.linspace(0.1, 0.5, 5))
    loop, _ = _scripted(script)
    assert [r["val"] for r in loop.fit()] == script
