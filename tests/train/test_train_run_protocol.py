"""The papers' training protocol as config keys of ``refdml train``: ``betas``,
``proxy_lr_multiplier`` and ``warmup_epochs`` (GSP supp., ASAP: Adam (0.9, 0.99), the
proxies at 100 times the rate, one warm-up epoch of the embedding layer).

Their defaults keep the runs made before them; set, :func:`refdml.train.runs.build_run`
puts the objective's parameters in a group of their own and warms the tail's Linear and
the proxies up. A tiny tokens run (4 classes, proxy NCA on a GAP head).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from refdml.train.config import KEYS, GLYPH_STUDIES, STUDIES, effective_config, resolve_config
from refdml.train.runs import build_run

TINY = dict(n_classes=4, n_classes_per_batch=4, n_train_per_class=8, n_val_per_class=4,
            n_test_per_class=4, head="gap", loss="proxy_nca", epochs=2, progress=False,
            dtype="float64")


# the glyph studies are new: their defaults are the papers' (test_train_study_glyphs.py)
@pytest.mark.parametrize("study", [s for s in STUDIES if s not in GLYPH_STUDIES])
def test_defaults_keep_the_earlier_runs(study):
    config = effective_config(study, {"features": "x.npz"} if study == "features" else {})
    assert config["betas"] == [0.9, 0.999]
    assert config["proxy_lr_multiplier"] == 1.0 and config["warmup_epochs"] == 0
    for name in ("betas", "proxy_lr_multiplier", "warmup_epochs"):
        assert "GSP and ASAP papers" in KEYS[name].source


def test_default_run_has_one_rate_and_no_warmup(tmp_path):
    run = build_run("tokens", TINY, out_dir=tmp_path)
    optimizer = run.trainer.optimizer
    assert set(optimizer.lr_multipliers.values()) == {1.0}
    assert optimizer.betas == (0.9, 0.999) and run.trainer.warmup_epochs == 0
    config = run.trainer.config()
    assert "warmup" not in config and "param_groups" not in config["optimizer"]


def test_the_papers_protocol_reaches_the_optimiser_and_the_loop(tmp_path):
    run = build_run("tokens", {**TINY, "betas": [0.9, 0.99], "weight_decay": 1e-4,
                               "proxy_lr_multiplier": 100.0, "warmup_epochs": 1,
                               "epochs": 1},
                    out_dir=tmp_path)
    trainer, optimizer = run.trainer, run.trainer.optimizer
    assert run.config.betas == (0.9, 0.99)
    assert optimizer.betas == (0.9, 0.99) and optimizer.weight_decay == 1e-4
    proxies = [p.name for p in run.objective.parameters()]
    assert proxies and [(g.name, g.lr_multiplier, list(g.params))
                        for g in optimizer.param_groups] == [
        ("model", 1.0, [p.name for p in run.model.parameters()]),
        ("objective", 100.0, proxies)]
    assert [p.name for p in trainer.warmup_params] == ["linear.weight", "linear.bias",
                                                        *proxies]
    table = run.model.layers[0].table
    proxy = list(run.objective.parameters())[0]
    table_before, proxy_before = table.value.copy(), proxy.value.copy()
    rows = trainer.fit()                     # epochs == 1: the warm-up epoch only
    assert [r["epoch"] for r in rows] == [0, 1]
    assert_array_equal(table.value, table_before)            # frozen in the warm-up
    assert not np.array_equal(proxy.value, proxy_before)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["run"]["proxy_lr_multiplier"] == 100.0
    assert written["run"]["betas"] == [0.9, 0.99] and written["warmup"]["epochs"] == 1


@pytest.mark.parametrize("config,error,match", [
    ({"betas": [0.9, 1.0]}, ValueError, r"betas == \[0.9, 1.0\], each entry must be a number "
                                        r"in \[0, 1\)"),
    ({"betas": [0.9]}, TypeError, r"betas must be a list of 2 numbers"),
    ({"betas": 0.9}, TypeError, r"betas must be a list of 2 numbers"),
    ({"betas": [True, 0.9]}, ValueError, r"betas == \[True, 0.9\]"),
    ({"betas": ["0.9", 0.99]}, ValueError, r"betas == \['0.9', 0.99\]"),
    ({"betas": [float("nan"), 0.99]}, ValueError, r"betas == \[nan, 0.99\]"),
    ({"proxy_lr_multiplier": 0.0}, ValueError, r"proxy_lr_multiplier == 0.0, must be > 0.0"),
    ({"proxy_lr_multiplier": -100}, ValueError, r"proxy_lr_multiplier == -100.0"),
    ({"proxy_lr_multiplier": float("inf")}, ValueError, r"proxy_lr_multiplier == inf, must be "
                                                        r"finite"),
    ({"proxy_lr_multiplier": "100"}, TypeError, r"proxy_lr_multiplier must be a number"),
    ({"proxy_lr_multiplier": True}, TypeError, r"proxy_lr_multiplier must be a number"),
    ({"warmup_epochs": -1}, ValueError, r"warmup_epochs == -1, must be >= 0"),
    ({"warmup_epochs": 1.5}, TypeError, r"warmup_epochs must be an integer"),
    ({"warmup_epochs": 3, "epochs": 2}, ValueError, r"warmup_epochs == 3, must be <= epochs "
                                                    r"== 2"),
])
def test_bad_protocol_values_are_named(config, error, match):
    for resolve in (resolve_config, effective_config):
        with pytest.raises(error, match=match):
            resolve("digits-collage", config)
