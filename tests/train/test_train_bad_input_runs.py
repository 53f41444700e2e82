"""Bad and extreme input to the rest of refdml.train (issue 20, part 5 follow-up): the
trainer and its run folder, the schedules' step protocol, the plots, the study runners'
configs, and ``refdml train``'s flags. Named errors (the parameter, key or flag, and the
value), never a raw Python / NumPy error, a silent NaN, silently accepted nonsense or a
crash; the command line answers with one line on stderr, never a traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.cli import main
from refdml.losses import contrastive_backward, contrastive_forward
from refdml.train import (
    GAP,
    Adam,
    CosineAnnealing,
    Embedding,
    L2Normalize,
    Linear,
    NonFiniteStepError,
    Parameter,
    ReduceOnPlateau,
    Schedule,
    Sequential,
    StepDecay,
    Trainer,
)
from refdml.train.data import PKBatchSampler, make_token_splits
from refdml.train.plots import pca_2d, upsample_weights, write_run_figures
from refdml.train.runs import build_run, check_device, effective_config


class Contrastive:
    """The objective interface over refdml.losses' contrastive loss (test only)."""

    def parameters(self):
        return []

    def forward(self, outputs, labels):
        return contrastive_forward(outputs, labels)

    def backward(self, ctx, d_value=1.0):
        return contrastive_backward(ctx, d_value).embeddings

    def config(self):
        return {"loss": "contrastive"}


SPLITS = make_token_splits(rng=0, n_classes=4, n_train_per_class=8, n_val_per_class=4,
                           n_test_per_class=4)


def _parts(seed=0):
    rng = np.random.default_rng(seed)
    model = Sequential([Embedding(SPLITS.train.n_tokens, 4, rng=rng), GAP(),
                        Linear(4, 4, rng=rng), L2Normalize()])
    optimizer = Adam(model.parameters(), lr=1e-2)
    sampler = PKBatchSampler(SPLITS.train.labels, n_classes_per_batch=4, n_samples_per_class=4,
                             rng=seed)
    return model, optimizer, sampler


def _trainer(out_dir, *, epochs=1, **over):
    model, optimizer, sampler = _parts()
    kwargs = dict(train_sampler=sampler, train_data=SPLITS.train, val_data=SPLITS.val,
                  test_data=SPLITS.test, out_dir=out_dir, epochs=epochs, seed=0,
                  dtype="float64", progress=False)
    kwargs.update(over)
    return Trainer(kwargs.pop("model", model), kwargs.pop("objective", Contrastive()),
                   kwargs.pop("optimizer", optimizer), **kwargs)


# --------------------------------------------------------------------------- Trainer
@pytest.mark.parametrize("name,value,error,match", [
    ("dtype", "bogus", TypeError, r"^dtype must be float32 or float64, got 'bogus'"),
    ("dtype", None, TypeError, r"^dtype must be float32 or float64, got None"),
    ("dtype", 3, TypeError, r"^dtype must be float32 or float64, got 3"),
    ("out_dir", None, TypeError, r"^out_dir must be a path \(str or os.PathLike\), got None"),
    ("out_dir", 3, TypeError, r"^out_dir must be a path"),
    ("out_dir", b"run", TypeError, r"^out_dir must be a path"),
    ("out_dir", "", ValueError, r"^out_dir == '', must name a folder"),
    ("model", None, TypeError, r"^model has no method forward\(\), got None"),
    ("model", object(), TypeError, r"^model has no method forward\(\)"),
    ("progress", "no", TypeError, r"^progress must be True or False, got 'no'"),
    ("progress", None, TypeError, r"^progress must be True or False, got None"),
    ("progress", 2, TypeError, r"^progress must be True or False, got 2"),
    ("progress", np.array([1, 0]), TypeError, r"^progress must be True or False"),
    ("run_config", {"a": object()}, TypeError, r"^run_config must hold JSON types only"),
    ("val_data", (np.zeros((3, 5), np.int64), np.array([0, 1, 2])), ValueError,
     r"^val_data has no class with two or more samples"),
    ("test_data", (np.zeros((1, 5), np.int64), np.array([0])), ValueError,
     r"^test_data has no class with two or more samples"),
    ("val_data", (np.zeros((3, 5), complex), np.array([0, 0, 1])), TypeError,
     r"^val_data inputs must hold real numbers"),
    ("val_data", (np.zeros((3, 5), "U2"), np.array([0, 0, 1])), TypeError,
     r"^val_data inputs must hold real numbers"),
])
def test_trainer_names_bad_arguments(tmp_path, name, value, error, match):
    arguments = {"out_dir": tmp_path / "run", name: value}
    with pytest.raises(error, match=match):
        _trainer(**arguments)
    assert not (tmp_path / "run").exists()   # refused before any file was written


def test_trainer_refuses_an_out_dir_it_could_not_create(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"^out_dir == '.*a_file' is an existing file"):
        _trainer(tmp_path / "a_file")
    with pytest.raises(ValueError, match=r"^out_dir == '.*a_file/run' lies under '.*a_file', "
                                         r"which is a file"):
        _trainer(tmp_path / "a_file" / "run")
    # numpy.bool_ is a bool; dtype objects and names are both accepted.
    trainer = _trainer(tmp_path / "ok", progress=np.False_, dtype=np.float64)
    assert trainer.progress is False and trainer.dtype == np.float64


def test_evaluate_embed_and_new_problem_instance_name_their_arguments(tmp_path):
    trainer = _trainer(tmp_path)
    x, y = SPLITS.val.token_ids, SPLITS.val.labels
    with pytest.raises(TypeError, match=r"^inputs must be an array of N >= 1 samples"):
        trainer.evaluate(None, None)
    with pytest.raises(TypeError, match=r"^inputs must be an array of N >= 1 samples"):
        trainer.embed("tokens")
    with pytest.raises(ValueError, match=r"^inputs must be an array .* got shape \(0, 50\)"):
        trainer.evaluate(x[:0], y[:0])
    with pytest.raises(ValueError, match=r"^labels has no class with two or more samples"):
        trainer.evaluate(x[:1], y[:1])
    with pytest.raises(ValueError, match=r"^labels has length 3"):
        trainer.evaluate(x, y[:3])
    with pytest.raises(TypeError, match=r"^inputs must hold real numbers"):
        trainer.embed(x.astype(complex))
    with pytest.raises(TypeError, match=r"^objective has no method new_problem_instance"):
        trainer.new_problem_instance(1)
    with pytest.raises(TypeError, match=r"^epoch must be an integer"):
        trainer.instance_due("1")
    metrics = trainer.evaluate(x, y)
    assert set(metrics) == {"map_at_r", "precision_at_1", "recall_at_1"}
    assert all(0.0 <= v <= 1.0 for v in metrics.values())


def _finished(out_dir):
    _trainer(out_dir).fit()
    return out_dir


def _damage_checkpoint_garbage(run):
    (run / "checkpoint.npz").write_bytes(b"not a zip archive")


def _damage_checkpoint_empty(run):
    (run / "checkpoint.npz").write_bytes(b"")


def _damage_config_missing(run):
    (run / "config.json").unlink()


def _damage_config_not_json(run):
    (run / "config.json").write_text("{not json")


def _damage_config_a_list(run):
    (run / "config.json").write_text("[1, 2]")


def _damage_log_missing(run):
    (run / "log.jsonl").unlink()


def _damage_log_not_utf8(run):
    with open(run / "log.jsonl", "ab") as handle:
        handle.write(b"\xff\xfe\n")


def _damage_log_epoch_text(run):
    with open(run / "log.jsonl", "a") as handle:
        handle.write('{"epoch": "x"}\n')


@pytest.mark.parametrize("damage,error,match", [
    (_damage_checkpoint_garbage, ValueError, r"checkpoint.npz is not a readable checkpoint"),
    (_damage_checkpoint_empty, ValueError, r"checkpoint.npz is not a readable checkpoint"),
    (_damage_config_missing, FileNotFoundError, r"it has no config.json"),
    (_damage_config_not_json, ValueError, r"config.json is not valid JSON"),
    (_damage_config_a_list, ValueError, r"config.json holds list"),
    (_damage_log_missing, FileNotFoundError,
     r"it has no log.jsonl \(the checkpoint is at epoch 1\)"),
    (_damage_log_not_utf8, ValueError, r"log.jsonl is not UTF-8 text"),
    (_damage_log_epoch_text, ValueError, r"log.jsonl line 3 has epoch == 'x', not an integer"),
])
def test_resume_names_a_damaged_run_folder_and_changes_nothing(tmp_path, damage, error, match):
    run = _finished(tmp_path / "run")
    damage(run)
    trainer = _trainer(run)
    before = {name: p.value.copy() for name, p in trainer.parameters.items()}
    optimizer_state = trainer.optimizer.state_dict()
    with pytest.raises(error, match=match):
        trainer.resume()
    assert trainer.epoch == 0 and not trainer.started
    assert trainer.optimizer.state_dict()["n_steps"] == optimizer_state["n_steps"]
    for name, value in before.items():
        assert_array_equal(trainer.parameters[name].value, value)


def test_resume_names_a_bad_source_folder(tmp_path):
    trainer = _trainer(tmp_path / "run")
    with pytest.raises(TypeError, match=r"^out_dir must be a path"):
        trainer.resume(3)
    with pytest.raises(FileNotFoundError, match=r"cannot resume from .*nowhere: it has no "
                                                r"config.json"):
        trainer.resume(tmp_path / "nowhere")


# --------------------------------------------------------------------------- schedules
def _optimizer(lr=0.1):
    return Adam([Parameter(np.zeros(3), "w")], lr=lr)


@pytest.mark.parametrize("make", [lambda o: StepDecay(o, step_size=1),
                                  lambda o: CosineAnnealing(o, t_max=4)])
def test_closed_form_schedules_refuse_a_metric_by_name(make):
    schedule = make(_optimizer())
    assert schedule.uses_metric is False
    kind = type(schedule).__name__
    with pytest.raises(TypeError, match=rf"^metric == 0.5: {kind} is a closed-form schedule"):
        schedule.step(0.5)
    assert schedule.epoch == 0                       # the refused call changed nothing
    lr = schedule.step()
    assert schedule.epoch == 1 and lr == schedule.lr_at(1)
    assert schedule.step(None) == schedule.lr_at(2)  # None: the uniform signature's default


def test_plateau_needs_its_metric_by_name():
    schedule = ReduceOnPlateau(_optimizer(), mode="max")
    assert schedule.uses_metric is True
    for call in (lambda: schedule.step(), lambda: schedule.step(None)):
        with pytest.raises(TypeError, match=r"^metric is None: ReduceOnPlateau.step\(metric\) "
                                            r"needs the epoch's metric"):
            call()
    assert schedule.epoch == 0 and schedule.best is None
    assert schedule.step(0.5) == 0.1 and schedule.epoch == 1 and schedule.best == 0.5
    with pytest.raises(TypeError, match=r"^Schedule is the base class"):
        Schedule(_optimizer(), {})


def test_plateau_min_lr_cannot_exceed_the_optimisers_lr():
    with pytest.raises(ValueError, match=r"^min_lr == 1e\+300, must be <= the optimiser's "
                                         r"lr == 0.1"):
        ReduceOnPlateau(_optimizer(0.1), min_lr=1e300)
    with pytest.raises(ValueError, match=r"^min_lr == 0.5, must be <= the optimiser's lr"):
        ReduceOnPlateau(_optimizer(0.1), min_lr=0.5)
    # min_lr == lr is a floor the rate already sits on: it is never reduced.
    optimizer = _optimizer(0.1)
    schedule = ReduceOnPlateau(optimizer, min_lr=0.1, patience=0, factor=0.5)
    for metric in (1.0, 2.0, 3.0):
        schedule.step(metric)
    assert optimizer.lr == 0.1
    # The saved base_lr is the bound on load; a refused load changes nothing.
    state = schedule.state_dict()
    bad = {**state, "arguments": {**state["arguments"], "min_lr": 1.0}}
    with pytest.raises(ValueError, match=r"^min_lr == 1.0, must be <="):
        schedule.load_state_dict(bad)
    assert schedule.state_dict() == state


def test_non_finite_step_error_is_exported_from_refdml_train():
    import refdml.train
    from refdml.train import optim

    assert refdml.train.NonFiniteStepError is optim.NonFiniteStepError is NonFiniteStepError
    assert "NonFiniteStepError" in refdml.train.__all__
    assert issubclass(NonFiniteStepError, ValueError)


# --------------------------------------------------------------------------- plots
def _well_conditioned(seed=2):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((30, 5)) @ np.diag([5.0, 3.0, 1.0, 0.5, 0.1]) + 7.0


@settings(max_examples=40, deadline=None)
@given(exponent=st.integers(min_value=-300, max_value=300), seed=st.integers(0, 2**16))
def test_pca_2d_at_any_finite_scale(exponent, seed):
    """Scaling the data by 10**k scales the coordinates by 10**k and leaves the ratio.

    Well-conditioned data (distinct leading singular values 5 and 3), so the components
    are stable: the scaled data's rounding (1 ulp per entry) moves the coordinates by
    ~1e-15 relative. Before the power-of-two rescaling, 1e160 overflowed the squared
    singular values and 1e-160 underflowed them (the ratio came back all zero).
    """
    x = _well_conditioned(seed)
    scale = 10.0 ** exponent
    coords, ratio = pca_2d(x)
    scaled_coords, scaled_ratio = pca_2d(x * scale)
    assert np.all(np.isfinite(scaled_coords)) and np.all(np.isfinite(scaled_ratio))
    assert_allclose(scaled_ratio, ratio, rtol=1e-10)
    assert_allclose(scaled_coords / scale, coords, rtol=1e-9,
                    atol=1e-9 * np.abs(coords).max())


def test_pca_2d_refuses_what_it_cannot_project():
    x = _well_conditioned()
    for value, error, match in [
        (None, TypeError, r"^embeddings must be an array of real numbers, got None"),
        ("x", TypeError, r"^embeddings must be an array of real numbers"),
        (x.astype(complex), TypeError, r"got dtype complex128"),
        (x.astype(object), TypeError, r"got dtype object"),
        (np.zeros((3, 0)), ValueError, r"^embeddings must be \(N, d\) with N >= 2 and d >= 1"),
        (x[:1], ValueError, r"^embeddings must be \(N, d\) with N >= 2"),
        (np.full((4, 2), np.nan), ValueError, r"^embeddings must be finite"),
        # finite, but (X - mean) V is beyond float64: refused by name, not inf
        (np.array([[1.7e308, -1.7e308], [-1.7e308, 1.7e308]]), ValueError,
         r"^embeddings: the principal coordinates exceed the float64 range"),
    ]:
        with pytest.raises(error, match=match):
            pca_2d(value)


@pytest.mark.parametrize("weights,grid,image_shape,error,match", [
    (np.full((1, 4), np.nan), (2, 2), (4, 4), ValueError, r"^weights must be finite"),
    (np.full((1, 4), np.inf), (2, 2), (4, 4), ValueError, r"^weights must be finite"),
    (np.ones((1, 4)) + 1j, (2, 2), (4, 4), TypeError, r"^weights must be an array of real"),
    (np.ones((1, 4)).astype(str), (2, 2), (4, 4), TypeError, r"^weights must be an array"),
    (None, (2, 2), (4, 4), TypeError, r"^weights must be an array of real numbers, got None"),
    (np.ones((1, 4)), 2, (4, 4), TypeError, r"^grid must be a pair of integers"),
    (np.ones((1, 4)), None, (4, 4), TypeError, r"^grid must be a pair of integers"),
    (np.ones((1, 4)), (2, 2, 1), (4, 4), TypeError, r"^grid must be a pair of integers"),
    (np.ones((1, 4)), ("a", "b"), (4, 4), TypeError, r"^grid\[0\] must be an integer"),
    (np.ones((1, 4)), (2.5, 1.6), (4, 4), TypeError, r"^grid\[0\] must be an integer"),
    (np.ones((1, 4)), (-2, -2), (4, 4), ValueError, r"^grid\[0\] == -2"),
    (np.ones((1, 4)), (2, 2), 4, TypeError, r"^image_shape must be a pair of integers"),
    (np.ones((1, 4)), (2, 2), (0, 0), ValueError, r"^image_shape\[0\] == 0"),
    (np.ones((1, 4)), (2, 2), (-4, 4), ValueError, r"^image_shape\[0\] == -4"),
    (np.ones((1, 4)), (2, 2), (2**40, 2**40), ValueError, r"exceed 2\*\*63 entries"),
])
def test_upsample_weights_names_bad_arguments(weights, grid, image_shape, error, match):
    with pytest.raises(error, match=match):
        upsample_weights(weights, grid, image_shape)


def test_upsample_weights_accepts_integer_pairs_of_any_kind():
    w = np.arange(4.0)
    expected = upsample_weights(w, (2, 2), (4, 4))
    assert expected.shape == (1, 4, 4)
    assert_array_equal(upsample_weights(w, [np.int64(2), 2], np.array([4, 4])), expected)
    assert upsample_weights(np.zeros((0, 4)), (2, 2), (4, 4)).shape == (0, 4, 4)


@pytest.fixture
def plots():
    """The drawing functions (they need matplotlib, the ``plot`` extra)."""
    pytest.importorskip("matplotlib", reason='plots need matplotlib: pip install "refdml[plot]"')
    from refdml.train import plots

    return plots


def _log_rows():
    return [{"epoch": 0, "train_loss": None, "val_map_at_r": 0.5},
            {"epoch": 1, "train_loss": 0.3, "val_map_at_r": 0.6}]


def test_plot_curves_drops_a_log_line_cut_by_a_kill(plots, tmp_path):
    log = tmp_path / "run" / "log.jsonl"
    log.parent.mkdir()
    log.write_text("".join(json.dumps(r) + "\n" for r in _log_rows()) + '{"epoch": 2, "tra')
    fig = plots.plot_curves(log, tmp_path / "curves.png")
    map_ax = fig.axes[1]
    assert_array_equal(map_ax.lines[0].get_xdata(), [0, 1])
    assert_allclose(map_ax.lines[0].get_ydata(), [0.5, 0.6], rtol=0)


@pytest.mark.parametrize("rows,error,match", [
    ([{}], ValueError, r"^log_path_or_rows\[0\] has no 'epoch'"),
    ([{"epoch": "a"}], TypeError, r"^log_path_or_rows\[0\]\['epoch'\] must be an integer"),
    ([{"epoch": -5}], ValueError, r"^log_path_or_rows\[0\]\['epoch'\] == -5"),
    ([{"epoch": 0, "val_map_at_r": "x"}], TypeError, r"\['val_map_at_r'\] must be a real"),
    ([{"epoch": 0, "val_map_at_r": float("nan")}], ValueError, r"\['val_map_at_r'\] == nan"),
    ([{"epoch": 0, "val_map_at_r": 1.5}], ValueError, r"\['val_map_at_r'\] == 1.5, must be in"),
    ([{"epoch": 1, "train_loss": float("inf")}], ValueError, r"\['train_loss'\] == inf"),
    ([{"epoch": 0}, {"epoch": 0}], ValueError, r"^log_path_or_rows\[1\] has epoch 0 after "
                                               r"epoch 0"),
    ([[1, 2]], TypeError, r"^log_path_or_rows\[0\] must be a log row \(a dict\)"),
])
def test_plot_curves_names_bad_rows(plots, tmp_path, rows, error, match):
    with pytest.raises(error, match=match):
        plots.plot_curves(rows, tmp_path / "c.png")
    assert not (tmp_path / "c.png").exists()


def test_plot_curves_names_bad_files_and_arguments(plots, tmp_path):
    log = tmp_path / "log.jsonl"
    with pytest.raises(FileNotFoundError, match=r"^log_path_or_rows: no training log at"):
        plots.plot_curves(log, tmp_path / "c.png")
    log.write_text("garbage\n")
    with pytest.raises(ValueError, match=r"log.jsonl line 1 is not a log row \(JSON\)"):
        plots.plot_curves(log, tmp_path / "c.png")
    log.write_bytes(b"\xff\xfe\n")
    with pytest.raises(ValueError, match=r"log.jsonl is not UTF-8 text"):
        plots.plot_curves(log, tmp_path / "c.png")
    rows = _log_rows()
    with pytest.raises(TypeError, match=r"^out_path must be a path"):
        plots.plot_curves(rows, None)
    with pytest.raises(ValueError, match=r"^out_path == .*: matplotlib writes no 'bogus' files"):
        plots.plot_curves(rows, tmp_path / "c.bogus")
    with pytest.raises(ValueError, match=r"^out_path == .* is a folder, not a file"):
        plots.plot_curves(rows, tmp_path)
    with pytest.raises(TypeError, match=r"^title must be a str or None, got 3"):
        plots.plot_curves(rows, tmp_path / "c.png", title=3)
    # rows without any MAP@R: a note on the panel, no matplotlib legend warning (an error here)
    fig = plots.plot_curves([{"epoch": 0}, {"epoch": 1, "train_loss": 0.5}], tmp_path / "c.png")
    assert fig.axes[1].get_legend() is None
    assert "no MAP@R" in fig.axes[1].texts[0].get_text()


def test_plot_attention_and_embeddings_name_bad_arguments(plots, tmp_path):
    rng = np.random.default_rng(0)
    images, weights = rng.random((2, 4, 4)), rng.random((2, 4))
    out = tmp_path / "a.png"
    for kwargs, error, match in [
        ({"mu": 0}, ValueError, r"^mu == 0.0, must be in \(0, 1\]"),
        ({"mu": "x"}, TypeError, r"^mu must be a real number"),
        ({"max_images": 0}, ValueError, r"^max_images == 0, must be in \[1"),
        ({"max_images": "x"}, TypeError, r"^max_images must be an integer"),
        ({"grid": "x"}, TypeError, r"^grid must be a pair of integers"),
        ({"labels": [0]}, ValueError, r"^labels has length 1, but 2"),
        ({"labels": ["a", "b"]}, TypeError, r"^labels must hold integer labels"),
        ({"labels": [0, 1], "class_names": 3}, TypeError, r"^class_names must be a callable"),
        ({"labels": [0, 1], "class_names": {0: "a"}}, ValueError,
         r"^class_names has no name for class 1"),
        ({"title": None}, TypeError, r"^title must be a str, got None"),
    ]:
        with pytest.raises(error, match=match):
            plots.plot_attention(images, weights, out, **kwargs)
    for bad_images, bad_weights, error, match in [
        (images * np.nan, weights, ValueError, r"^images must be finite"),
        (images, weights + 1j, TypeError, r"^weights must be an array of real numbers"),
        (images.astype(str), weights, TypeError, r"^images must be an array of real numbers"),
        (images[:, :, :0], weights, ValueError, r"^images must be \(N, H, W\)"),
        (images, np.zeros((2, 0)), ValueError, r"^weights must be \(N, n\) with N = 2 images "
                                               r"and n >= 1"),
    ]:
        with pytest.raises(error, match=match):
            plots.plot_attention(bad_images, bad_weights, out)
    assert not out.exists()
    y = rng.standard_normal((10, 3))
    labels = np.repeat(np.arange(5), 2)
    with pytest.raises(TypeError, match=r"^labels must hold integer labels, got dtype float64"):
        plots.plot_embeddings_2d(y, labels + 0.5, out)
    with pytest.raises(ValueError, match=r"^class_names has no name for class 1"):
        plots.plot_embeddings_2d(y, labels, out, class_names={0: "a"})
    with pytest.raises(TypeError, match=r"^run must be a Run"):
        write_run_figures(None, tmp_path)


# --------------------------------------------------------------------------- runs
@pytest.mark.parametrize("value,error,match", [
    (float("nan"), ValueError, r"^epochs == nan, must be a finite integer"),
    (float("inf"), ValueError, r"^epochs == inf, must be a finite integer"),
    (1e300, ValueError, r"^epochs == 1e\+300, must fit in int64"),
    (10**30, ValueError, r"^epochs == 10{30}, must fit in int64"),
    (1.5, TypeError, r"^epochs must be an integer, got 1.5"),
])
def test_integer_keys_refuse_nan_inf_and_values_beyond_int64(value, error, match):
    with pytest.raises(error, match=match):
        effective_config("tokens", {"epochs": value})
    assert effective_config("tokens", {"epochs": 4.0})["epochs"] == 4   # TOML's 4.0


@pytest.mark.parametrize("study,config,error,match", [
    ("digits-collage", {"plateau_factor": 1.0}, ValueError,
     r"^plateau_factor == 1.0, must be < 1.0"),
    ("tokens", {"n_train_per_class": 1}, ValueError, r"^n_train_per_class == 1, must be >= 2"),
    ("tokens", {"n_val_per_class": 1}, ValueError, r"^n_val_per_class == 1, must be >= 2"),
    ("tokens", {"n_test_per_class": 1}, ValueError, r"^n_test_per_class == 1, must be >= 2"),
    ("tokens", {"n_classes_per_batch": 1}, ValueError,
     r"^n_classes_per_batch == 1: zero_shot .* needs n_classes_per_batch >= 2"),
])
def test_config_keys_are_checked_where_the_run_would_fail_later(study, config, error, match):
    with pytest.raises(error, match=match):
        effective_config(study, config)


def test_check_device_names_its_argument():
    with pytest.raises(TypeError, match=r"^device must be one of \('cpu', 'cuda'\), got 3"):
        check_device(3)
    with pytest.raises(ValueError, match=r"^device == 'gpu'"):
        check_device("gpu")
    check_device("cpu")


def test_features_errors_name_the_features_key(tmp_path):
    np.savez(tmp_path / "no_labels.npz", features=np.zeros((8, 2, 3)))
    config = {"n_classes_per_batch": 2, "progress": False}
    with pytest.raises(FileNotFoundError, match=r"^features == '.*missing.npz': no such file"):
        build_run("features", {**config, "features": str(tmp_path / "missing.npz")},
                  out_dir=tmp_path / "a")
    with pytest.raises(ValueError, match=r"^features: .* has no array 'labels' \(labels_key\)"):
        build_run("features", {**config, "features": str(tmp_path / "no_labels.npz")},
                  out_dir=tmp_path / "b")


def test_sizes_beyond_int64_are_named_not_a_crash(tmp_path):
    """np.repeat crashes the process (SIGSEGV, NumPy 2.4) when its size wraps past int64:
    run in a child process, so that a regression fails this test instead of pytest."""
    code = """
from refdml.train.data import make_digits_collage, make_token_splits
for call in (lambda: make_token_splits(rng=0, n_classes=4, n_train_per_class=2**62),
             lambda: make_token_splits(rng=0, n_classes=4, tokens_per_class=2**62),
             lambda: make_digits_collage(rng=0, eval_collages_per_image=2**62)):
    try:
        call()
    except ValueError as error:
        print("ValueError:", error)
"""
    # cwd: a folder of its own, so that the installed package is what `python -c` runs.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 3, done.stdout
    assert "token slots, must be < 2**63" in lines[0]
    assert lines[1].startswith("ValueError: tokens_per_class == 4611686018427387904")
    assert lines[2].startswith("ValueError: eval_collages_per_image == 4611686018427387904")


# --------------------------------------------------------------------------- refdml train
SMALL_TOML = ("n_classes = 4\nn_classes_per_batch = 4\nn_train_per_class = 8\n"
              "n_val_per_class = 4\nn_test_per_class = 4\ndim = 4\nembedding_dim = 4\n"
              "n_prototypes = 3\n")


def _assert_one_line_error(capsys, code, status, *needles):
    err = capsys.readouterr().err
    assert code == status, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refdml train: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def _cli(tmp_path, *extra, toml=SMALL_TOML, study="tokens"):
    config = tmp_path / "run.toml"
    config.write_text(toml)
    return main(["train", "--study", study, "--config", str(config), "--no-progress", *extra])


def test_cli_train_names_a_bad_out_config_or_features_flag(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for extra, needles in [
        (["--out", ""], ["--out == '', must name a folder"]),
        (["--out", str(tmp_path / "a_file")], ["--out == ", "is an existing file"]),
        (["--out", str(tmp_path / "a_file" / "run")], ["--out == ", "which is a file"]),
        (["--out", str(tmp_path / "o"), "--features", str(tmp_path / "f.npz")],
         ["--features applies to --study features"]),
    ]:
        _assert_one_line_error(capsys, _cli(tmp_path, *extra), 2, *needles)
    code = main(["train", "--study", "tokens", "--config", str(tmp_path), "--out",
                 str(tmp_path / "o")])
    _assert_one_line_error(capsys, code, 2, "--config", "is a folder")
    code = main(["train", "--study", "features", "--features", str(tmp_path / "f.npz"),
                 "--out", str(tmp_path / "o")])
    _assert_one_line_error(capsys, code, 2, "--features", "no such file")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--study", "tokens", "--out", str(tmp_path / "o"), "--epochs",
              str(2**63)])
    assert exc.value.code == 2
    assert "argument --epochs: 9223372036854775808 must be < 2**63" in capsys.readouterr().err


def test_cli_train_refuses_a_bad_toml_value_that_a_flag_overrides(tmp_path, capsys):
    for line, needle in [("epochs = 1.5", "epochs must be an integer, got 1.5"),
                         ("progress = 1", "progress must be true or false, got 1"),
                         ("seed = -1", "seed == -1, must be >= 0")]:
        code = _cli(tmp_path, "--epochs", "0", "--seed", "0", "--out", str(tmp_path / "o"),
                    toml=SMALL_TOML + line + "\n")
        _assert_one_line_error(capsys, code, 2, "bad config (in ", needle)
        assert not (tmp_path / "o").exists()


def test_cli_train_resume_of_a_damaged_run_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert _cli(tmp_path, "--epochs", "0", "--out", str(out)) == 0
    capsys.readouterr()
    (out / "config.json").unlink()     # the checkpoint is left: --resume gets past its check
    code = _cli(tmp_path, "--epochs", "1", "--resume", "--out", str(out))
    _assert_one_line_error(capsys, code, 2, "--resume: cannot resume from", "no config.json")
    out = tmp_path / "run2"
    assert _cli(tmp_path, "--epochs", "0", "--out", str(out)) == 0
    capsys.readouterr()
    (out / "checkpoint.npz").write_bytes(b"")
    code = _cli(tmp_path, "--epochs", "1", "--resume", "--out", str(out))
    _assert_one_line_error(capsys, code, 2, "--resume:", "not a readable checkpoint")


def test_cli_train_failure_while_training_is_one_line_and_status_1(tmp_path, capsys):
    # float32 scores scale * <Upsilon_hat, Upsilon> overflow at the first training batch:
    # GSP's objective refuses them (a ValueError raised inside fit, after epoch 0)
    code = _cli(tmp_path, "--epochs", "1", "--out", str(tmp_path / "o"),
                toml=SMALL_TOML + "zero_shot_scale = 1e300\n")
    _assert_one_line_error(capsys, code, 1, "training stopped in epoch 1", "overflow float32")
    assert (tmp_path / "o" / "checkpoint.npz").is_file()   # epoch 0's checkpoint is kept
