"""refdml.train.runs, ``refdml train`` and the scripts: the reference path against the fast
path, float32 against float64, the CLI's outputs and resume, the TOML round trip, named errors.

The cross-checks train for 20 optimiser steps at a learning rate (1e-2) high enough for the
parameters to move far from their initial values (asserted), so that agreement to 1e-8 is
agreement of the trajectories, not of the initialisation.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.cli import main
from refdml.train.runs import KEYS, STUDIES, build_run, default_config, effective_config

TOKENS = dict(n_classes=4, n_classes_per_batch=4, n_train_per_class=80, n_val_per_class=8,
              n_test_per_class=8, lr=1e-2, progress=False, head="gsp", n_prototypes=4,
              dim=8, embedding_dim=8)
DIGITS = dict(conv_channels=[2, 3], local_dim=4, n_prototypes=3, embedding_dim=4,
              n_samples_per_class=4, lr=1e-2, progress=False, head="gsp")


def _values(run):
    return {p.name: np.array(p.value, copy=True) for p in run.trainer.optimizer.params}


def _steps(run, n):
    """``n`` optimiser steps in the trainer's order (forward, objective, backward, step)."""
    t = run.trainer
    for step, batch in enumerate(t.train_sampler, start=1):
        x, labels = t._to_device(t.train_x[batch], t.train_y[batch])
        outputs, ctx = run.model.forward(x)
        _, octx = run.objective.forward(outputs, labels)
        run.model.backward(ctx, run.objective.backward(octx, 1.0))
        t.optimizer.step()
        t.optimizer.zero_grad()
        if step == n:
            return
    raise AssertionError("the sampler gave fewer than n batches")


def _assert_same(a, b, rtol, start):
    moved = 0.0
    for name in a:
        scale = np.abs(b[name]).max()
        assert_allclose(a[name], b[name], rtol=0, atol=rtol * scale, err_msg=name)
        moved = max(moved, np.abs(b[name] - start[name]).max() / max(scale, 1e-300))
    assert moved > 1e-3, "the parameters barely moved: the comparison would be vacuous"


def test_tokens_reference_equals_fast_path_after_20_steps(tmp_path):
    runs = {ref: build_run("tokens", dict(TOKENS, epochs=1, dtype="float64", reference=ref),
                           out_dir=tmp_path / str(ref)) for ref in (False, True)}
    start = _values(runs[True])
    assert len(runs[True].trainer.train_sampler) == 20      # one epoch = 20 steps
    assert runs[True].objective.reference and not runs[False].objective.reference
    for run in runs.values():
        run.trainer.fit()
        assert run.trainer.optimizer.n_steps == 20
    _assert_same(_values(runs[False]), _values(runs[True]), 1e-8, start)
    table = runs[False].model.layers[0].table.value
    assert np.abs(table).max() <= 0.3                        # the clip after each step ran


def test_digits_collage_reference_equals_fast_path_after_20_steps(tmp_path):
    runs = {ref: build_run("digits-collage", dict(DIGITS, dtype="float64", reference=ref),
                           out_dir=tmp_path / str(ref)) for ref in (False, True)}
    start = _values(runs[True])
    for run in runs.values():
        _steps(run, 20)
    _assert_same(_values(runs[False]), _values(runs[True]), 1e-8, start)


# Measured after 5 steps (Adam, lr 1e-2), max |float32 - float64| over each parameter's
# largest entry: 6e-7 (tokens), 1.1e-4 (digits-collage: Adam's normalised step turns float32
# rounding of a near-zero gradient entry into an O(lr) difference). Stated tolerance: 1e-3.
FLOAT32_TOLERANCE = 1e-3


@pytest.mark.parametrize("study,config", [("tokens", TOKENS), ("digits-collage", DIGITS)])
def test_float32_tracks_float64(tmp_path, study, config):
    runs = {dt: build_run(study, dict(config, dtype=dt), out_dir=tmp_path / dt)
            for dt in ("float32", "float64")}
    start = _values(runs["float64"])
    for run in runs.values():
        _steps(run, 5)
    a, b = _values(runs["float32"]), _values(runs["float64"])
    assert all(v.dtype == np.float32 for v in a.values())
    _assert_same({k: v.astype(np.float64) for k, v in a.items()}, b, FLOAT32_TOLERANCE, start)


def _rows(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _toml(path, config):
    lines = []
    for key, value in config.items():
        lines.append(f"{key} = {json.dumps(value)}" if not isinstance(value, bool)
                     else f"{key} = {str(value).lower()}")
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL_TOKENS = {k: v for k, v in TOKENS.items() if k not in ("progress",)}


def test_cli_train_writes_log_and_checkpoints_and_resumes(tmp_path, capsys):
    cfg = _toml(tmp_path / "run.toml", dict(SMALL_TOKENS, n_train_per_class=16))
    out = tmp_path / "out"
    args = ["train", "--study", "tokens", "--config", str(cfg), "--out", str(out),
            "--no-progress", "--seed", "3"]
    assert main([*args, "--epochs", "2"]) == 0
    assert sorted(p.name for p in out.iterdir() if p.name != "figures") == [
        "best.npz", "checkpoint.npz", "config.json", "log.jsonl"]
    assert [r["epoch"] for r in _rows(out)] == [0, 1, 2]
    run = json.loads((out / "config.json").read_text())["run"]
    assert run["study"] == "tokens" and run["seed"] == 3 and run["epochs"] == 2
    assert run["lr"] == 1e-2 and run["n_train_per_class"] == 16      # from the TOML
    assert run["mu"] == 0.3 and run["inverse_temperature"] == 5.0    # defaults, resolved
    assert run["zero_shot"] is True and run["dtype"] == "float32"
    # Resume to 4 epochs = 4 epochs in one go (bit-for-bit parameters, same log rows).
    assert main([*args, "--epochs", "4", "--resume"]) == 0
    whole = tmp_path / "whole"
    assert main(["train", "--study", "tokens", "--config", str(cfg), "--out", str(whole),
                 "--no-progress", "--seed", "3", "--epochs", "4"]) == 0
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in _rows(out)]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in _rows(whole)]
    a, b = np.load(out / "checkpoint.npz"), np.load(whole / "checkpoint.npz")
    for key in a.files:
        if a[key].dtype != object and np.issubdtype(a[key].dtype, np.number):
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    # A changed hyperparameter refuses to resume, naming the difference.
    assert main([*args, "--epochs", "5", "--resume", "--dtype", "float64"]) == 2
    assert "differs" in capsys.readouterr().err


def test_toml_round_trip(tmp_path):
    """The effective config written as TOML and read back builds the same effective config."""
    from refdml.train._cli import load_toml

    for study in ("tokens", "digits-collage"):
        config = effective_config(study, {"head": "gap", "lr": 3e-3})
        toml = {k: v for k, v in config.items() if v is not None}
        path = _toml(tmp_path / f"{study}.toml", toml)
        assert effective_config(study, load_toml(str(path))) == config
        assert config["zero_shot"] is False          # resolved from head = "gap"


def test_defaults_have_sources_and_check():
    for study in STUDIES:
        for key in default_config(study):
            assert KEYS[key].source
    c = effective_config("digits-collage")
    # GSP supp. 2.2's values.
    assert (c["lr"], c["n_prototypes"], c["mu"], c["inverse_temperature"], c["lambda_"],
            c["plateau_factor"], c["plateau_patience"]) == (1e-3, 128, 0.2, 10.0, 0.5, 0.5, 5)
    t = effective_config("tokens")
    assert (t["lr"], t["early_stopping_patience"], t["n_classes_per_batch"],
            t["n_samples_per_class"], t["tokens_per_sample"]) == (1e-4, 30, 16, 4, 50)
    assert effective_config("tokens", {"loss": "proxy_nca"})["inverse_temperature"] == 0.5


@pytest.mark.parametrize("config,error,match", [
    ({"bogus": 1}, ValueError, "unknown config key"),
    ({"n_collages": 1}, ValueError, "unknown config key"),
    ({"lr": -1.0}, ValueError, "lr == -1.0"),
    ({"lr": "fast"}, TypeError, "lr must be a number"),
    ({"epochs": 1.5}, TypeError, "epochs must be an integer"),
    ({"head": "gmp"}, ValueError, "compares 'gap' and 'gsp'"),
    ({"head": "mean"}, ValueError, "head == 'mean'"),
    ({"head": "gap", "zero_shot": True}, ValueError, "zero_shot == true needs head"),
    ({"reference": True}, ValueError, "reference == true .* float64"),
    ({"dtype": "float16"}, ValueError, "dtype == 'float16'"),
    ({"reference": 1}, TypeError, "reference must be true or false"),
    ({"loss": "proxy_nca", "neg_margin": 0.5}, ValueError, "neg_margin is a hyperparameter"),
])
def test_named_errors(config, error, match):
    with pytest.raises(error, match=match):
        effective_config("tokens", config)


def test_features_study(tmp_path):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(8), 6)
    features = rng.standard_normal((48, 5, 4)) + labels[:, None, None] * 0.1
    np.savez(tmp_path / "f.npz", features=features, labels=labels)
    with pytest.raises(ValueError, match="features == None"):
        effective_config("features", {})
    run = build_run("features", {"features": str(tmp_path / "f.npz"), "epochs": 1,
                                 "n_classes_per_batch": 4, "progress": False,
                                 "embedding_dim": 6, "n_prototypes": 3},
                    out_dir=tmp_path / "out")
    rows = run.trainer.fit()
    assert [r["epoch"] for r in rows] == [0, 1] and rows[1]["train_loss"] > 0
    with pytest.raises(ValueError, match="only 4 classes"):
        build_run("features", {"features": str(tmp_path / "f.npz")}, out_dir=tmp_path / "x")


def test_cli_named_errors(tmp_path, capsys):
    out = str(tmp_path / "o")
    bad = tmp_path / "bad.toml"
    bad.write_text("lr = 1e-3\nbogus = 1\n")
    assert main(["train", "--study", "tokens", "--out", out, "--config", str(bad)]) == 2
    assert "unknown config key(s) ['bogus']" in capsys.readouterr().err
    bad.write_text("lr = = 1\n")
    assert main(["train", "--study", "tokens", "--out", out, "--config", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err
    assert main(["train", "--study", "tokens", "--out", out, "--resume"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["train", "--study", "nope", "--out", out])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["train", "--study", "tokens", "--out", out, "--epochs", "-1"])
    assert exc.value.code == 2
    # --capture records a CUDA graph: on the CPU it would do nothing, so it is refused
    assert main(["train", "--study", "tokens", "--out", out, "--capture"]) == 2
    assert "['capture'] would be ignored" in capsys.readouterr().err


def test_cuda_without_cupy_is_a_clear_message(tmp_path, capsys):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    assert main(["train", "--study", "tokens", "--out", str(tmp_path), "--device", "cuda"]) == 2
    assert "needs CuPy" in capsys.readouterr().err


def test_scripts_take_the_same_flags(tmp_path):
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "train_tokens.py"
    cfg = _toml(tmp_path / "run.toml", dict(SMALL_TOKENS, n_train_per_class=8))
    argv = sys.argv
    sys.argv = [str(script), "--config", str(cfg), "--out", str(tmp_path / "o"), "--epochs",
                "1", "--no-progress"]
    try:
        with pytest.raises(SystemExit) as exc:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    assert exc.value.code == 0
    assert [r["epoch"] for r in _rows(tmp_path / "o")] == [0, 1]


def test_cli_train_writes_the_run_figures(tmp_path, capsys):
    cfg = _toml(tmp_path / "run.toml", dict(SMALL_TOKENS, n_train_per_class=8))
    out = tmp_path / "run"
    assert main(["train", "--study", "tokens", "--config", str(cfg), "--out", str(out),
                 "--epochs", "1"]) == 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert 'pip install "refdml[plot]"' in capsys.readouterr().err
        return
    for name in ("curves.png", "embeddings_2d.png"):
        assert (out / "figures" / name).stat().st_size > 1000


def test_docs_table_lists_every_key():
    """docs/train.md's key table has a row for every config key (and no stale one)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
            if line.startswith("| `")}
    assert rows == set(KEYS)


def test_every_head_trains_on_digits_collage(tmp_path):
    """Each head builds and takes finite steps. GeMean needs non-negative features and
    LocalLinear's local features can be negative, so build_run puts a ReLU before it (a
    GeMean head used to raise on the first batch). (The tokens study takes gap and gsp.)"""
    study, config = "digits-collage", DIGITS
    for head in ("gap", "gmp", "gemean", "gsp"):
        run = build_run(study, dict(config, head=head, dtype="float64"), out_dir=tmp_path / head)
        start = _values(run)
        _steps(run, 2)
        moved = {k: np.abs(v - start[k]).max() for k, v in _values(run).items()}
        assert all(np.isfinite(v).all() for v in _values(run).values()), head
        assert max(moved.values()) > 0, head
