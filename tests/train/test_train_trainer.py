"""refdml.train.trainer: the log, checkpoints, bit-for-bit resume, NaN stop, early stop, learning.

A tiny token model (Embedding -> GAP -> Linear -> L2Normalize) on 4 classes of the GSP token
study (16 training samples per class: 4 P x K batches of 4 x 4 per epoch), a contrastive
objective written here as a minimal adapter (the package's objectives live in
``refdml.train.objectives``). Everything runs in well under a second per run.

Learning rate: Adam at the paper's 1e-4 moves each weight by about 1e-4 per step; the token
vectors start at ~N(0, 1/16) (entries ~0.25), so a visible change needs ~1e3 steps, while
3 epochs here are 12 steps. At 1e-2 (100x the paper's) the validation MAP@R goes from about
0.8-0.95 untrained to >= 0.99 within 3 epochs on the seeds below.
"""

from __future__ import annotations

import copy
import json
import math
import re

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from refdml.losses import contrastive_backward, contrastive_forward
from refdml.train import Adam, ReduceOnPlateau
from refdml.train.data import PKBatchSampler, clip_token_table, make_token_splits
from refdml.train.layers import GAP, Embedding, L2Normalize, Linear, Sequential
from refdml.train._checkpoint import load_checkpoint, save_checkpoint
from refdml.train.trainer import Trainer, TrainingDiverged

LR = 1e-2
N_CLASSES = 4
DIM = 16


class Contrastive:
    """The objective interface over refdml.losses.contrastive_forward/backward (test only)."""

    def __init__(self, *, nan_at_step=None, nan_in="loss"):
        self.n_calls = 0
        self.nan_at_step, self.nan_in = nan_at_step, nan_in

    def parameters(self):
        return []

    def forward(self, outputs, labels):
        self.n_calls += 1
        value, ctx = contrastive_forward(outputs, labels)
        if self.n_calls == self.nan_at_step and self.nan_in == "loss":
            value = math.nan
        return value, ctx

    def backward(self, ctx, d_value=1.0):
        d_y = contrastive_backward(ctx, d_value).embeddings
        if self.n_calls == self.nan_at_step and self.nan_in == "gradient":
            d_y = d_y.copy()
            d_y[0, 0] = np.inf
        return d_y

    def config(self):
        return {"loss": "contrastive"}


class Frozen(Contrastive):
    """Zero gradient: the parameters never move, so the validation MAP@R never improves."""

    def backward(self, ctx, d_value=1.0):
        return np.zeros_like(super().backward(ctx, d_value))


def _trainer(out_dir, *, seed=0, epochs=3, objective=None, schedule=False, lr=LR,
             n_classes=N_CLASSES, **kwargs):
    splits = make_token_splits(rng=seed, n_classes=n_classes, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    rng = np.random.default_rng(seed)
    embedding = Embedding(splits.train.n_tokens, DIM, rng=rng)
    model = Sequential([embedding, GAP(), Linear(DIM, DIM, rng=rng), L2Normalize()])
    optimizer = Adam(model.parameters(), lr=lr)
    # mode="min" on a rising MAP@R: every epoch is a bad one, so the rate halves each epoch
    # (a schedule that acts, whose state the resume test must carry).
    plateau = ReduceOnPlateau(optimizer, mode="min", factor=0.5, patience=0) if schedule else None
    sampler = PKBatchSampler(splits.train.labels, n_classes_per_batch=4, n_samples_per_class=4,
                             rng=seed)
    trainer = Trainer(
        model, objective or Contrastive(), optimizer, schedule=plateau, train_sampler=sampler,
        train_data=splits.train, val_data=splits.val, test_data=splits.test, out_dir=out_dir,
        epochs=epochs, seed=seed, dtype="float64", progress=False, **kwargs)
    return trainer


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "log.jsonl").read_text().splitlines()]


def _values(trainer):
    return {name: p.value.copy() for name, p in trainer.parameters.items()}


def test_log_rows_and_config(tmp_path):
    trainer = _trainer(tmp_path, epochs=2)
    returned = trainer.fit()
    rows = _rows(tmp_path)
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert returned == rows
    assert rows[0]["train_loss"] is None and rows[0]["n_steps"] == 0
    keys = {"epoch", "train_loss", "lr", "n_steps", "seconds", "best_val_map_at_r"} | {
        f"{s}_{m}" for s in ("val", "test") for m in ("map_at_r", "precision_at_1", "recall_at_1")}
    for row in rows:
        assert set(row) == keys
        assert row["lr"] == LR and row["seconds"] >= 0
        for key in keys - {"epoch", "train_loss", "lr", "n_steps", "seconds"}:
            assert 0.0 <= row[key] <= 1.0
    # 64 training samples in 4 x 4 batches: 4 steps per epoch.
    assert [r["n_steps"] for r in rows] == [0, 4, 8]
    assert all(r["train_loss"] > 0 for r in rows[1:])
    # The epoch-0 metrics are those of the untrained model, computed independently here.
    from refdml.metrics import retrieval_metrics
    from refdml.normalize import l2_normalize

    fresh = _trainer(tmp_path / "fresh")
    splits = make_token_splits(rng=0, n_classes=N_CLASSES, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    y, _ = fresh.model.forward(splits.val.token_ids)
    expected = retrieval_metrics(l2_normalize(y), splits.val.labels, k=(1,))
    np.testing.assert_allclose(rows[0]["val_map_at_r"],
                               expected["mean_average_precision_at_r"], rtol=1e-12)
    np.testing.assert_allclose(rows[0]["val_recall_at_1"], expected["recall_at_1"], rtol=1e-12)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["epochs"] == 2 and config["seed"] == 0 and config["dtype"] == "float64"
    assert config["optimizer"] == {"name": "Adam", "lr": LR, "betas": [0.9, 0.999],
                                   "eps": 1e-8, "weight_decay": 0.0}
    assert config["sampler"]["n_classes_per_batch"] == 4
    assert config["objective"] == {"loss": "contrastive"}
    assert config["data"]["train"]["n_samples"] == 64
    assert set(config["model"]["parameters"]) == {"embedding.table", "linear.weight",
                                                   "linear.bias"}


def test_checkpoints_hold_the_state(tmp_path):
    trainer = _trainer(tmp_path, epochs=2, schedule=True)
    trainer.fit()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.npz", "checkpoint.npz", "config.json", "log.jsonl"]  # no .tmp left behind
    parameters, optimizer_state, meta = load_checkpoint(tmp_path / "checkpoint.npz")
    for name, value in _values(trainer).items():
        assert_array_equal(parameters[name], value)
        assert parameters[name].dtype == np.float64
    reference = trainer.optimizer.state_dict()
    assert optimizer_state["n_steps"] == reference["n_steps"] == 8
    for name, entry in reference["params"].items():
        for buffer in ("exp_avg", "exp_avg_sq"):
            assert_array_equal(optimizer_state["params"][name][buffer], entry[buffer])
    assert meta["epoch"] == 2
    assert meta["rng"] == trainer.rng.bit_generator.state
    assert meta["sampler"] == trainer.train_sampler.state_dict()
    assert meta["schedule"] == json.loads(json.dumps(trainer.schedule.state_dict()))
    rows = _rows(tmp_path)
    best = max(rows, key=lambda r: r["val_map_at_r"])
    assert meta["best_val_map_at_r"] == best["val_map_at_r"]
    _, _, best_meta = load_checkpoint(tmp_path / "best.npz")
    assert best_meta["epoch"] == best["epoch"] == meta["best_epoch"]


def test_resume_is_bit_for_bit(tmp_path):
    def draw(trainer):
        # A hook drawing from the trainer's Generator: its state must survive the resume.
        trainer.after_step = lambda: trainer.rng.random()
        return trainer

    straight = draw(_trainer(tmp_path / "straight", epochs=4, schedule=True))
    straight.fit()
    first = draw(_trainer(tmp_path / "split", epochs=2, schedule=True))
    first.fit()
    second = draw(_trainer(tmp_path / "split", epochs=4, schedule=True))
    second.resume()
    assert second.epoch == 2
    second.fit()
    for name, value in _values(straight).items():
        assert_array_equal(second.parameters[name].value, value)
    assert second.rng.bit_generator.state == straight.rng.bit_generator.state
    assert second.optimizer.lr == straight.optimizer.lr
    a, b = _rows(tmp_path / "straight"), _rows(tmp_path / "split")
    assert len(a) == len(b) == 5
    for row_a, row_b in zip(a, b):
        row_a.pop("seconds"), row_b.pop("seconds")
        assert row_a == row_b
    # The schedule acted (patience 0): otherwise this test would not cover its state.
    # A row's lr is the rate its epoch trained with (the schedule steps after the row);
    # epoch 1's metric improves on the initial best (+inf in mode "min"), later ones do not.
    assert [r["lr"] for r in a] == [LR, LR, LR, LR / 2, LR / 4]


class Counting(Contrastive):
    """An objective with a state (its call count), checked on load (test only)."""

    def state_dict(self):
        return {"n_calls": self.n_calls}

    def load_state_dict(self, state):
        if not isinstance(state, dict) or not isinstance(state.get("n_calls"), int):
            raise ValueError(f"state must be {{'n_calls': int}}, got {state!r}")
        self.n_calls = state["n_calls"]


def _state(trainer):
    """Everything resume() may set, copied (arrays as arrays)."""
    return {
        "parameters": _values(trainer),
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "sampler": trainer.train_sampler.state_dict(),
        "schedule": trainer.schedule.state_dict(),
        "objective": trainer.objective.state_dict(),
        "rng": trainer.rng.bit_generator.state,
        "lr": trainer.optimizer.lr,
        "attributes": [trainer.epoch, trainer.best_epoch, trainer.best_metric,
                       trainer.improved_metric, trainer.improved_epoch, trainer.stopped_early,
                       trainer.started],
    }


def _assert_same(a, b, where="state"):
    # Restored copies of the same values: equal bit for bit by construction.
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b or (a != a and b != b), (where, a, b)


@pytest.mark.parametrize("damage, words", [
    # the objective's state: loaded after the optimiser, sampler and schedule
    (lambda meta: meta.update(objective={"n_calls": "many"}), "must be {'n_calls': int}"),
    # the Generator's state: the last part set, after the parameters
    (lambda meta: meta.update(rng={"bit_generator": "PCG64", "state": "x"}),
     "holds an rng state that the trainer's PCG64 refuses"),
])
def test_refused_resume_leaves_the_trainer_unchanged(tmp_path, damage, words):
    # Issue 20: resume loaded its parts one after another, so a damaged last part left
    # the optimiser, sampler, schedule (and parameters) of the checkpoint applied.
    _trainer(tmp_path, epochs=2, schedule=True, objective=Counting()).fit()
    path = tmp_path / "checkpoint.npz"
    parameters, optimizer_state, meta = load_checkpoint(path)
    damage(meta)
    save_checkpoint(path, parameters=parameters, optimizer_state=optimizer_state, meta=meta)
    fresh = _trainer(tmp_path, epochs=3, schedule=True, objective=Counting())
    before = _state(fresh)
    # the checkpoint differs from the fresh trainer in every part (else this proves nothing)
    assert not all(np.array_equal(v, before["parameters"][k]) for k, v in parameters.items())
    assert optimizer_state["n_steps"] != before["optimizer"]["n_steps"]
    assert meta["sampler"]["epoch"] != before["sampler"]["epoch"]
    assert meta["schedule"] != before["schedule"]
    with pytest.raises(ValueError, match=re.escape(words)):
        fresh.resume()
    _assert_same(before, _state(fresh))


def test_resume_refuses_another_configuration(tmp_path):
    _trainer(tmp_path, epochs=1).fit()
    other = _trainer(tmp_path, epochs=2, lr=2 * LR)
    with pytest.raises(ValueError, match=r"config.json differs in \['optimizer'\]"):
        other.resume()


@pytest.mark.parametrize("nan_in", ["loss", "gradient"])
def test_non_finite_stops_and_keeps_the_last_good_checkpoint(tmp_path, nan_in):
    # 4 steps per epoch: global call 7 is epoch 2, step 3.
    trainer = _trainer(tmp_path, epochs=1, objective=Contrastive(nan_at_step=7, nan_in=nan_in))
    trainer.fit()
    after_epoch_1 = _values(trainer)
    trainer.epochs = 3
    with pytest.raises(TrainingDiverged, match=r"epoch 2, step 3 .*last good checkpoint "
                                               r"\(epoch 1\)") as info:
        trainer.fit()
    expected = "the loss is nan" if nan_in == "loss" else "gradient of the outputs is not finite"
    assert expected in str(info.value)
    parameters, _, meta = load_checkpoint(tmp_path / "checkpoint.npz")
    assert meta["epoch"] == 1
    for name, value in after_epoch_1.items():
        assert_array_equal(parameters[name], value)
        assert np.all(np.isfinite(trainer.parameters[name].value))
    assert [r["epoch"] for r in _rows(tmp_path)] == [0, 1]


def test_early_stopping_on_validation_map_at_r(tmp_path):
    trainer = _trainer(tmp_path, epochs=10, objective=Frozen(), early_stopping_patience=2)
    trainer.fit()
    rows = _rows(tmp_path)
    # Frozen parameters: every epoch ties epoch 0, none improves; stop after 2 such epochs.
    assert [r["epoch"] for r in rows] == [0, 1, 2]
    assert len({r["val_map_at_r"] for r in rows}) == 1
    assert trainer.stopped_early and trainer.best_epoch == 0


def test_early_stopping_min_delta_and_target(tmp_path):
    # min_delta 1: no epoch can improve by that much, so patience 2 stops at epoch 2, while
    # best.npz still follows every strict increase.
    trainer = _trainer(tmp_path / "a", epochs=10, early_stopping_patience=2,
                       early_stopping_min_delta=1.0)
    rows = trainer.fit()
    assert [r["epoch"] for r in rows] == [0, 1, 2] and trainer.stopped_early
    assert trainer.best_metric == max(r["val_map_at_r"] for r in rows) > rows[0]["val_map_at_r"]
    # A target the first trained epoch reaches stops there (epoch 0 never stops the run).
    trainer = _trainer(tmp_path / "b", epochs=10, early_stopping_target=0.01)
    rows = trainer.fit()
    assert [r["epoch"] for r in rows] == [0, 1] and trainer.stopped_early
    with pytest.raises(ValueError, match="early_stopping_target"):
        _trainer(tmp_path / "c", early_stopping_target=1.5)
    with pytest.raises(ValueError, match="early_stopping_min_delta"):
        _trainer(tmp_path / "c", early_stopping_min_delta=-0.1)


def test_fit_pins_blas_threads(tmp_path):
    from threadpoolctl import threadpool_info

    seen = []
    trainer = _trainer(tmp_path, epochs=1, blas_threads=1)
    trainer.after_step = lambda: seen.append(
        {lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"})
    before = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    trainer.fit()
    assert seen and all(threads <= {1} for threads in seen)
    assert [lib["num_threads"] for lib in threadpool_info()
            if lib["user_api"] == "blas"] == before        # restored after fit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_study_beats_the_untrained_model(tmp_path, seed):
    """The issue's CI test: a few epochs of the token study improve MAP@R (lr in the module doc)."""
    trainer = _trainer(tmp_path, seed=seed, epochs=3, n_classes=8)
    table = trainer.model.layers[0].table
    trainer.after_step = lambda: clip_token_table(table.value)  # GSP supp. 2.1: [-0.3, 0.3]
    rows = trainer.fit()
    assert np.all(np.abs(table.value) <= 0.3)
    for split in ("val", "test"):
        untrained, trained = rows[0][f"{split}_map_at_r"], rows[-1][f"{split}_map_at_r"]
        assert trained > untrained + 0.03, (split, untrained, trained)
    assert rows[-1]["train_loss"] < rows[1]["train_loss"]


def test_named_errors(tmp_path):
    trainer = _trainer(tmp_path)
    splits = make_token_splits(rng=5, n_classes=N_CLASSES, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    other = PKBatchSampler(splits.train.labels[::-1].copy(), n_classes_per_batch=4,
                           n_samples_per_class=4, rng=0)
    base = dict(train_data=splits.train, val_data=splits.val, out_dir=tmp_path, epochs=1,
                seed=0)
    with pytest.raises(ValueError, match="train_sampler was built over other labels"):
        Trainer(trainer.model, Contrastive(), trainer.optimizer, train_sampler=other,
                dtype="float64", **base)
    with pytest.raises(TypeError, match="parameter embedding.table is float64, dtype is float32"):
        Trainer(trainer.model, Contrastive(), trainer.optimizer,
                train_sampler=trainer.train_sampler, dtype="float32", **base)
    with pytest.raises(TypeError, match="objective has no method parameters"):
        Trainer(trainer.model, object(), trainer.optimizer,
                train_sampler=trainer.train_sampler, dtype="float64", **base)
    with pytest.raises(TypeError, match="val_data must be an"):
        Trainer(trainer.model, Contrastive(), trainer.optimizer,
                train_sampler=trainer.train_sampler, dtype="float64",
                **{**base, "val_data": [1, 2]})
    with pytest.raises(FileNotFoundError):
        _trainer(tmp_path / "empty").resume()


# --------------------------------------------------------------- with the package's objectives


def _objective_trainer(out_dir, objective_name, *, epochs):
    from refdml.train import GSPHead
    from refdml.train.objectives import GSPObjective, LossObjective

    splits = make_token_splits(rng=0, n_classes=N_CLASSES, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    rng = np.random.default_rng(0)
    embedding = Embedding(splits.train.n_tokens, DIM, rng=rng)
    if objective_name == "gsp":
        head = GSPHead(8, DIM, mu=0.3, inverse_temperature=5.0, rng=rng)
        objective = GSPObjective("contrastive", n_classes=N_CLASSES, attribute_dim=8, rng=1)
    else:
        head = GAP()
        objective = LossObjective("proxy_nca", n_classes=N_CLASSES, dim=DIM, rng=1)
    model = Sequential([embedding, head, Linear(DIM, DIM, rng=rng), L2Normalize()])
    optimizer = Adam(list(model.parameters()) + list(objective.parameters()), lr=LR)
    sampler = PKBatchSampler(splits.train.labels, n_classes_per_batch=4, n_samples_per_class=4,
                             rng=0)
    return Trainer(model, objective, optimizer, train_sampler=sampler, train_data=splits.train,
                   val_data=splits.val, test_data=splits.test, out_dir=out_dir, epochs=epochs,
                   seed=0, dtype="float64", progress=False)


@pytest.mark.parametrize("objective_name", ["gsp", "proxy_nca"])
def test_trainer_runs_the_package_objectives_and_resumes_them(tmp_path, objective_name):
    # A GSP model (outputs (y, z)) with GSP Alg. 1's objective, and a proxy loss whose
    # proxies are trained too: both train, and 1 + resume + 1 epochs equal 2 straight.
    straight = _objective_trainer(tmp_path / "straight", objective_name, epochs=2)
    rows = straight.fit()
    assert all(math.isfinite(r["train_loss"]) for r in rows[1:])
    first = _objective_trainer(tmp_path / "split", objective_name, epochs=1)
    first.fit()
    again = _objective_trainer(tmp_path / "split", objective_name, epochs=2)
    again.resume()
    again.fit()
    for name, value in _values(straight).items():
        assert_array_equal(_values(again)[name], value)
    for p, q in zip(straight.objective.parameters(), again.objective.parameters()):
        assert_array_equal(p.value, q.value)


def test_log_every_and_capture_reach_the_loop(tmp_path):
    trainer = _trainer(tmp_path, epochs=1, log_every=7)
    assert (trainer.log_every, trainer.capture) == (7, False)
    with pytest.raises(ValueError, match=r"capture == True .*device == 'cuda', got 'cpu'"):
        _trainer(tmp_path / "b", capture=True)


def test_a_resume_may_change_how_steps_are_read_and_launched():
    # log_every and capture leave the trajectory as it is: a resumed run may change them,
    # and a run folder written before they existed (no such keys) still resumes.
    from refdml.train.trainer import _without_run_epochs

    before = {"study": "tokens", "lr": 1e-3, "epochs": 3}
    after = {**before, "epochs": 9, "log_every": 5, "capture": True}
    assert _without_run_epochs(after, "run") == _without_run_epochs(before, "run")
    assert _without_run_epochs({**before, "lr": 2e-3}, "run") != _without_run_epochs(before, "run")
