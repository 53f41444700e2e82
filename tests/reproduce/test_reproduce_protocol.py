"""The papers' training protocol and the grids, as the experiments define them.

What the papers state (docs/reproduce.md, "Training protocols"; GSP supp. 1.6.4 and 1.6.7,
ASAP App. A.2): Adam with moments (0.9, 0.99) and weight decay 1e-4; ProxyNCA++ and
Proxy-Anchor with 32 classes x 1 sample per batch, the proxies' learning rate 100 times the
network's and one epoch of warm-up of the embedding layer; the pair losses (and ASAP, and
the pair losses against one proxy per class) with 4 samples per class in batches of 32.
Digits-collage trains as GSP supp. 2.2 says for Cifar-Collage: default Adam (0.9, 0.999,
no weight decay), reduce on plateau (factor 0.5, patience 5). Every run chooses its
defining setting on the validation split from a grid, and a comparison's baseline gets a
grid of the same size. Every default run stops on a validation plateau within a budget.
"""

import numpy as np
import pytest

from refdml.reproduce import EXPERIMENTS
from refdml.reproduce._experiments import (
    BATCHES,
    PAIR_LOSSES,
    PROXY_LOSSES,
    PROXY_PROTOCOL,
    settings_for,
)
from refdml.reproduce._train import fit

_REAL = [e for e in EXPERIMENTS.values() if e.study != "toy"]


@pytest.mark.parametrize("experiment", _REAL, ids=lambda e: e.id)
def test_every_comparison_is_gated_and_every_run_has_a_grid_of_the_baselines_size(experiment):
    for c in experiment.comparisons:
        assert c.gate == "test_map_at_r"
        run, baseline = experiment.select[c.run], experiment.select[c.baseline]
        assert len(run.values) == len(baseline.values) >= 2
        assert len(set(run.values)) == len(run.values)
    assert set(experiment.select) == set(experiment.runs)


@pytest.mark.parametrize("experiment", _REAL, ids=lambda e: e.id)
def test_every_run_trains_with_its_papers_protocol(experiment):
    for label, (method, _) in experiment.runs.items():
        scale = experiment.scales[0]
        c = experiment.run_settings(label, "full", scale)
        loss = c.get("loss", method)
        if experiment.study == "collage":           # GSP supp. 2.2 (Cifar-Collage)
            assert c["betas"] == [0.9, 0.999] and c["weight_decay"] == 0.0
            assert (c["plateau_factor"], c["plateau_patience"]) == (0.5, 5)
        elif experiment.study in BATCHES:           # the papers' CUB protocol
            assert c["betas"] == [0.9, 0.99] and c["weight_decay"] == 1e-4
        if experiment.study in BATCHES:
            batch = c["n_classes_per_batch"] * c["n_samples_per_class"]
            if loss in PROXY_LOSSES and method not in ("asap", "proxy"):
                assert {k: c[k] for k in PROXY_PROTOCOL} == {"proxy_lr_multiplier": 100.0,
                                                            "warmup_epochs": 1}
                expected = BATCHES[experiment.study]["proxy"]
            else:
                assert loss in PAIR_LOSSES or method in ("asap", "proxy")
                assert "proxy_lr_multiplier" not in c and "warmup_epochs" not in c
                expected = BATCHES[experiment.study]["pair"]
                assert c["n_samples_per_class"] == 4
            assert (c["n_classes_per_batch"], c["n_samples_per_class"]) == expected
            assert batch == 32          # the papers' batch of 32, for every loss
        else:                                      # tokens and wdml: no proxies, no decay
            assert "proxy_lr_multiplier" not in c and "weight_decay" not in c
        # to a plateau: early stopping within a budget; ASAP's next instance on a plateau
        assert 1 <= c["patience"] < c["epochs"]
        if method == "asap":
            assert c["instance_patience"] == 3 and c["patience"] == 2 * 3
            assert "instance_every" not in c


def test_proxy_batches_are_32_classes_of_one_sample_where_there_are_enough_classes():
    assert BATCHES["glyph"]["proxy"] == (32, 1)
    assert BATCHES["glyph_collage"]["proxy"] == (32, 1)
    # digits-collage has 8 training classes: batches of 32 need 4 per class
    assert BATCHES["collage"]["proxy"] == (8, 4)
    assert settings_for("glyph", "quick")["max_classes"] * 0.55 > 32


def _tiny_model_and_objective(seed):
    from refdml.train.models import (
        HeadConfig,
        ObjectiveConfig,
        Placement,
        build_head,
        build_objective,
        build_tail,
        conv_trunk,
    )
    from refdml.train.layers import Sequential

    placement = Placement(dtype=np.dtype(np.float64), device="cpu")
    init = np.random.default_rng(seed)
    model = Sequential([*conv_trunk([2], [2], 4, rng=init, placement=placement),
                        *build_head(HeadConfig(kind="gap"), 4, rng=init, placement=placement),
                        *build_tail(4, embedding_dim=3, rng=init, placement=placement)])
    objective = build_objective(ObjectiveConfig(kind="loss", loss="proxy_nca", embedding_dim=3),
                                4, rng=init, placement=placement)
    return model, objective


def test_fit_warms_up_only_the_embedding_layer_and_the_proxies():
    from refdml.train.models import embedding_layer_parameters

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 1, 6, 6))
    y = np.repeat(np.arange(4), 8)
    model, objective = _tiny_model_and_objective(1)
    warm = {id(p) for p in [*embedding_layer_parameters(model), *objective.parameters()]}
    before = {p.name: p.value.copy() for p in [*model.parameters(), *objective.parameters()]}
    fit(model, objective, x, y, epochs=1, lr=1e-2, n_classes_per_batch=4,
        n_samples_per_class=1, seed=0, dtype=np.float64, evaluate=lambda: {},
        betas=(0.9, 0.99), weight_decay=1e-4, proxy_lr_multiplier=100.0, warmup_epochs=1)
    for p in [*model.parameters(), *objective.parameters()]:
        moved = not np.array_equal(p.value, before[p.name])
        assert moved == (id(p) in warm), p.name
    assert warm and len(warm) < len(before)


def test_fit_gives_the_proxies_their_multiplier():
    """One step, epochs=1 without warm-up, on one batch: Adam's first step moves every
    coordinate by lr * multiplier * g / (|g| + eps') (bias-corrected m / sqrt(v) = sign(g)
    up to eps), so the proxies' largest move is 100 times the network's largest move, up to
    the coordinates whose gradient is below Adam's eps."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(4, 1, 6, 6))
    y = np.arange(4)
    model, objective = _tiny_model_and_objective(3)
    before = {p.name: p.value.copy() for p in [*model.parameters(), *objective.parameters()]}
    fit(model, objective, x, y, epochs=1, lr=1e-4, n_classes_per_batch=4,
        n_samples_per_class=1, seed=0, dtype=np.float64, evaluate=lambda: {},
        betas=(0.9, 0.99), weight_decay=0.0, proxy_lr_multiplier=100.0)
    network = max(np.abs(p.value - before[p.name]).max() for p in model.parameters())
    proxies = max(np.abs(p.value - before[p.name]).max() for p in objective.parameters())
    np.testing.assert_allclose(network, 1e-4, rtol=1e-6)
    np.testing.assert_allclose(proxies, 1e-2, rtol=1e-6)
