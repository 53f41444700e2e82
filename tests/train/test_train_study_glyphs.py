"""``refdml train --study glyphs`` and ``--study glyph-collage``: the glyph benchmark
(:func:`refdml.train.data.make_glyphs`, :func:`~refdml.train.data.make_glyph_collages`)
trained by :func:`refdml.train.runs.build_run`.

At tiny sizes set by config keys (20 classes, a two-layer conv net): the CLI writes its
four files with finite metrics, the splits are class-disjoint, a resumed run reproduces the
uninterrupted one, bad keys and values are one line with exit status 2, the defaults are the
papers' protocol and refdml reproduce's glyph settings, and the model is the one reproduce
builds from the same settings.
"""

from __future__ import annotations

import json
import re
import math

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.cli import main
from refdml.train.config import GLYPH_STUDIES, STUDIES, effective_config
from refdml.train.runs import build_run

TINY = {"max_classes": 20, "conv_channels": [4, 8], "local_dim": 8, "embedding_dim": 8,
        "n_prototypes": 8}
#: glyph-collage's tiny run: 8 x 8 glyphs in a 2 x 2 grid (16 x 16 collages)
TINY_COLLAGE = {**TINY, "glyph_size": 8}
CONFIGS = {"glyphs": TINY, "glyph-collage": TINY_COLLAGE}


def _toml(path, config):
    path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in config.items()))
    return str(path)


def _rows(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def _train(tmp_path, study, name, *extra, config=None):
    cfg = _toml(tmp_path / f"{name}.toml", CONFIGS[study] if config is None else config)
    out = tmp_path / name
    return main(["train", "--study", study, "--config", cfg, "--out", str(out),
                 "--no-progress", *extra]), out


def test_the_glyph_studies_are_studies(capsys):
    assert set(GLYPH_STUDIES) <= set(STUDIES)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "glyphs" in text and "glyph-collage" in text


@pytest.mark.parametrize("study", GLYPH_STUDIES)
def test_cli_trains_one_epoch_and_writes_the_run(tmp_path, capsys, study):
    code, out = _train(tmp_path, study, "run", "--epochs", "1", "--seed", "2")
    assert code == 0, capsys.readouterr().err
    for name in ("config.json", "log.jsonl", "checkpoint.npz", "best.npz"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "config.json").read_text())["run"]
    assert run["study"] == study and run["epochs"] == 1 and run["seed"] == 2
    assert run["max_classes"] == 20 and run["conv_channels"] == [4, 8]      # from the TOML
    assert run["conv_strides"] == [1, 2] and run["n_classes_per_batch"] == 8  # resolved
    rows = _rows(out)
    assert [r["epoch"] for r in rows] == [0, 1]
    assert rows[1]["train_loss"] > 0 and rows[1]["n_steps"] > 0
    for row in rows:
        for key in ("val_map_at_r", "test_map_at_r", "test_precision_at_1"):
            assert math.isfinite(row[key]) and 0.0 <= row[key] <= 1.0, (key, row)
    assert f"{study}: 1 epoch(s)" in capsys.readouterr().out


@pytest.mark.parametrize("study", GLYPH_STUDIES)
def test_the_split_is_class_disjoint(tmp_path, study):
    run = build_run(study, {**CONFIGS[study], "progress": False}, out_dir=tmp_path)
    data = run.data
    labels = [set(np.unique(part.labels).tolist()) for part in (data.train, data.val,
                                                                 data.test)]
    assert all(labels) and sum(len(s) for s in labels) == 20     # max_classes, all used
    assert not (labels[0] & labels[1] or labels[0] & labels[2] or labels[1] & labels[2])
    # what the trainer evaluates on: the same classes (training labels re-indexed 0..C-1)
    assert set(np.unique(run.trainer.val_y).tolist()) == labels[1]
    assert set(np.unique(run.trainer.test_y).tolist()) == labels[2]
    assert np.unique(run.trainer.train_y).tolist() == list(range(len(labels[0])))
    if study == "glyph-collage":
        # the distractors: their own classes per split, never a label anywhere
        shared = [set(part.shared_classes) for part in (data.train, data.val, data.test)]
        assert all(shared)
        assert not any(s & t for s in shared for t in labels)
        assert not (shared[0] & shared[1] or shared[0] & shared[2] or shared[1] & shared[2])


@pytest.mark.parametrize("study", GLYPH_STUDIES)
def test_resume_reproduces_the_uninterrupted_run(tmp_path, capsys, study):
    assert _train(tmp_path, study, "whole", "--epochs", "2")[0] == 0
    assert _train(tmp_path, study, "parts", "--epochs", "1")[0] == 0
    code, parts = _train(tmp_path, study, "parts", "--epochs", "2", "--resume")
    assert code == 0, capsys.readouterr().err
    whole, resumed = _rows(tmp_path / "whole"), _rows(parts)
    assert [r["epoch"] for r in resumed] == [r["epoch"] for r in whole] == [0, 1, 2]
    for a, b in zip(resumed, whole):
        assert set(a) == set(b)
        for key in a:
            if key != "seconds" and isinstance(b[key], float):
                assert_allclose(a[key], b[key], rtol=1e-12, atol=0, err_msg=key)
    with np.load(parts / "checkpoint.npz") as a, np.load(tmp_path / "whole" /
                                                         "checkpoint.npz") as b:
        assert a.files == b.files
        compared = 0
        for key in a.files:
            if np.issubdtype(a[key].dtype, np.floating):
                assert_allclose(a[key], b[key], rtol=1e-12, atol=0, err_msg=key)
                compared += 1
        assert compared > 4


@pytest.mark.parametrize("study,config,match", [
    ("glyphs", {"bogus": 1}, r"unknown config key\(s\) \['bogus'\]"),
    ("glyphs", {"grid": 3}, r"unknown config key\(s\) \['grid'\]"),        # collage only
    ("glyphs", {"glyph_size": 4}, r"glyph_size == 4, must be >= 8"),
    ("glyphs", {"max_classes": 2}, r"max_classes == 2, must be >= 3"),
    ("glyphs", {"instances_per_font": 0}, r"instances_per_font == 0, must be >= 1"),
    ("glyphs", {"lr": "fast"}, r"lr must be a number"),
    ("glyphs", {"max_classes": 6}, r"n_classes_per_batch == 8, but the training split has "
                                   r"only \d classes"),
    ("glyph-collage", {"grid": 1}, r"grid == 1, must be >= 2"),
    ("glyph-collage", {"families": ["letters"]}, r"families == \['letters'\]: 'letters' "
                                                  r"is not one of"),
    ("glyph-collage", {"families": "digits"}, r"families must be a list of names"),
    ("glyph-collage", {"n_background": [1, 2]}, r"n_background must be a list of 3 integers"),
    ("glyph-collage", {"n_background": [1, -1, 1]}, r"n_background == \[1, -1, 1\], each "
                                                     r"entry must be an integer >= 0"),
    ("glyph-collage", {"families": [], "n_background": [2, 0, 2]},
     r"n_background == \[2, 0, 2\] with families == \[\]: every split needs a distractor"),
])
def test_bad_keys_and_values_exit_2_naming_the_key(tmp_path, capsys, study, config, match):
    code, out = _train(tmp_path, study, "bad", "--epochs", "1",
                       config={**CONFIGS[study], **config})
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(match, err), err
    assert not (out / "log.jsonl").exists()


def test_features_flag_is_refused_for_glyphs(tmp_path, capsys):
    (tmp_path / "f.npz").write_bytes(b"")
    assert main(["train", "--study", "glyphs", "--out", str(tmp_path / "o"),
                 "--features", str(tmp_path / "f.npz")]) == 2
    assert "--features applies to --study features, not to 'glyphs'" in capsys.readouterr().err


@pytest.mark.parametrize("study", GLYPH_STUDIES)
def test_defaults_are_the_papers_protocol(study):
    pair = effective_config(study)
    assert (pair["loss"], pair["head"], pair["zero_shot"]) == ("contrastive", "gsp", True)
    assert pair["betas"] == [0.9, 0.99] and pair["weight_decay"] == 1e-4
    assert (pair["n_classes_per_batch"], pair["n_samples_per_class"]) == (8, 4)
    assert (pair["proxy_lr_multiplier"], pair["warmup_epochs"]) == (1.0, 0)
    assert (pair["n_prototypes"], pair["mu"], pair["inverse_temperature"],
            pair["lambda_"]) == (64, 0.3, 5.0, 0.1)
    proxy = effective_config(study, {"loss": "proxy_nca"})
    assert (proxy["n_classes_per_batch"], proxy["n_samples_per_class"]) == (32, 1)
    assert (proxy["proxy_lr_multiplier"], proxy["warmup_epochs"]) == (100.0, 1)
    assert proxy["inverse_temperature"] == 0.5
    # ASAP trains as the pair losses do: no multiplier, no warm-up (ASAP App. A.2)
    asap = effective_config(study, {"objective": "asap"})
    assert asap["loss"] == "proxy_nca" and asap["n_samples_per_class"] == 4
    assert (asap["proxy_lr_multiplier"], asap["warmup_epochs"]) == (1.0, 0)
    # given values win over the resolved ones; the warm-up fits in 0 epochs
    given = effective_config(study, {"loss": "proxy_nca", "n_classes_per_batch": 16,
                                     "warmup_epochs": 0, "epochs": 0})
    assert (given["n_classes_per_batch"], given["warmup_epochs"]) == (16, 0)
    assert effective_config(study, {"loss": "proxy_nca", "epochs": 0})["warmup_epochs"] == 0


def test_defaults_match_reproduces_glyph_settings():
    """The model, data and optimiser keys of ``glyphs`` are reproduce's ``glyph`` settings
    (its full mode, every class), and the batches and protocol its loss_settings."""
    from refdml.reproduce._experiments import loss_settings, settings_for

    settings = settings_for("glyph", "full")
    config = effective_config("glyphs")
    for key in ("conv_channels", "conv_strides", "local_dim", "embedding_dim", "n_prototypes",
                "mu", "inverse_temperature", "gemean_p", "lr", "betas", "weight_decay",
                "max_classes", "instances_per_font", "eval_instances_per_font"):
        assert config[key] == settings[key], key
    assert config["glyph_size"] == settings["glyph_size"]
    assert config["lambda_"] == settings["zsr_lambda"]
    for loss in ("contrastive", "proxy_nca"):
        expected = loss_settings("glyph", loss, "gsp")
        got = effective_config("glyphs", {"loss": loss})
        for key, value in expected.items():
            assert got[key] == value, (loss, key)


def test_the_model_is_reproduces_glyph_model(tmp_path):
    """Same settings, same seed: reproduce's GSP glyph model starts where build_run's
    glyphs model does (one builder, the same draws in the same order)."""
    from refdml.reproduce._experiments import settings_for
    from refdml.reproduce._studies import _collage_configs, _collage_model
    from refdml.train.models import Placement

    settings = settings_for("glyph", "full", loss="contrastive")
    head, _ = _collage_configs("gsp", settings)
    reproduce = _collage_model(head, settings, np.random.default_rng(5 + 1),
                               Placement(dtype=np.dtype(np.float32)))
    run = build_run("glyphs", {"seed": 5, "progress": False, "zero_shot": False,
                               "max_classes": 20}, out_dir=tmp_path)
    a = [(p.name, p.value) for p in reproduce.parameters()]
    b = [(p.name, p.value) for p in run.model.parameters()]
    assert [n for n, _ in a] == [n for n, _ in b] and len(a) > 4
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype == np.float32
        assert_allclose(x, y, rtol=1e-12, atol=0, err_msg=name)


@pytest.mark.parametrize("study", GLYPH_STUDIES)
def test_docs_table_has_the_studys_column(study):
    """docs/train.md's key table has a column for the study, with a value in exactly the
    rows of the keys the study reads ("-" elsewhere) and the plain defaults as written."""
    from pathlib import Path

    from refdml.train.config import default_config

    text = (Path(__file__).resolve().parents[2] / "docs" / "train.md").read_text()
    header = next(line for line in text.splitlines() if line.startswith("| key |"))
    column = [c.strip() for c in header.split("|")].index(study)
    cells = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            parts = [c.strip() for c in line.split("|")]
            cells[parts[1].strip("`")] = parts[column]
    defaults = default_config(study)
    assert {k for k, v in cells.items() if v != "-"} == set(defaults)
    for key, value in defaults.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            assert float(cells[key]) == value, key
        elif isinstance(value, list):
            assert json.loads(cells[key]) == value, key
