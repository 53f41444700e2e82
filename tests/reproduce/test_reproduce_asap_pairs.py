"""ASAP as its paper runs it, on glyphs: the pair losses (C2, MS) between samples and
several proxies per class (method ``asap``), their one-proxy-per-class counterparts
(method ``proxy``) and the batch pair loss (method ``gap``) all run end to end from a Task,
with finite metrics, and the proxy methods report their covering radius."""

import math

import pytest

from refdml.reproduce import Task, execute
from refdml.reproduce._experiments import settings_for

# The quick glyph settings, shrunk (one epoch, 30 classes of 8 x 8 glyphs, a tiny trunk).
_TINY = {"epochs": 1, "glyph_size": 8, "max_classes": 30, "conv_channels": [2, 2],
         "conv_strides": [1, 2], "local_dim": 4, "embedding_dim": 4, "proxies_per_class": 2,
         "budget": 3, "transfer_repeats": 2, "instance_patience": 1, "n_classes_per_batch": 4}


@pytest.mark.parametrize("loss", ["contrastive", "multi_similarity"])
@pytest.mark.parametrize("method", ["asap", "proxy"])
def test_pair_loss_proxy_methods_run_and_report_a_covering_radius(method, loss):
    task = Task.make("glyph", method, 0, settings_for("glyph", "quick", loss=loss, **_TINY))
    metrics = execute(task)["metrics"]
    assert metrics and all(math.isfinite(v) for v in metrics.values()), metrics
    for name in ("test_map_at_r", "val_map_at_r", "untrained_test_map_at_r"):
        assert name in metrics
    # a distance between unit rows: in [0, 2]
    assert 0.0 <= metrics["covering_radius"] <= 2.0 + 1e-6


@pytest.mark.parametrize("loss", ["contrastive", "multi_similarity"])
def test_gap_runs_the_same_loss_on_the_batch_without_proxies(loss):
    task = Task.make("glyph", "gap", 0, settings_for("glyph", "quick", loss=loss, **_TINY))
    metrics = execute(task)["metrics"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert "covering_radius" not in metrics
