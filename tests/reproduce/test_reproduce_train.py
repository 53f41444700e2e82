"""refdml.reproduce._train.fit trains to a plateau: how a run ended (``epochs_trained``,
``stopped_early``, ``still_rising``, ASAP's ``instances``) on scripted validation curves,
reduce-on-plateau through fit, and the studies passing the settings through.

The expected values are worked out by hand from the rules: the selected epoch is the first
of the highest validation values among epochs 1..; a run stops after ``patience`` epochs
in a row without beating every earlier value (epoch 0 included); it is still rising when
it selected its last epoch and did not stop early.
"""

import math

import numpy as np
import pytest
from _token_loop import InstanceRecorder

from refdml.reproduce._train import Fitted, at_epoch, fit
from refdml.train import L2Normalize, Linear, Sequential
from refdml.train.objectives import LossObjective

_Instances = InstanceRecorder


def _fit(script, *, epochs=None, objective=None, lrs=None, **kwargs):
    """fit on a tiny linear model whose ``val`` of epoch ``e`` is ``script[e]``; ``lrs``
    collects the optimiser's rate at each evaluation."""
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((32, 6)), np.repeat(np.arange(4), 8)
    model = Sequential([Linear(6, 3, rng=rng), L2Normalize()])
    seen = []

    def evaluate():
        seen.append(None)
        return {"val": script[len(seen) - 1]}

    return fit(model, LossObjective("contrastive") if objective is None else objective, x, y,
               epochs=len(script) - 1 if epochs is None else epochs, lr=0.1,
               n_classes_per_batch=4, n_samples_per_class=4, seed=0, dtype=np.float64,
               evaluate=evaluate, select="val", **kwargs)


# (script of epochs 0.., patience, epochs_trained, stopped_early, selected, still_rising)
@pytest.mark.parametrize("script, patience, trained, stopped, selected, rising", [
    ([0.1, 0.2, 0.3, 0.4], None, 3, 0.0, 3, 1.0),          # the budget ended a rising run
    ([0.1, 0.4, 0.3, 0.2], None, 3, 0.0, 1, 0.0),          # the best is behind: a plateau
    ([0.1, 0.4, 0.3, 0.2, 0.5, 0.6], 2, 3, 1.0, 1, 0.0),   # 2, 3 miss 0.4: stop at 3
    ([0.1, 0.2, 0.3, 0.4, 0.5], 2, 4, 0.0, 4, 1.0),        # patience never ran out
    ([0.1, 0.4, 0.4, 0.3], None, 3, 0.0, 1, 0.0),          # a tie is not a new best
    ([0.1, 0.4, 0.3, 0.5], 2, 3, 0.0, 3, 1.0),             # 3 beats 0.4 before the stop
])
def test_how_a_run_ended(script, patience, trained, stopped, selected, rising):
    fitted = _fit(script, patience=patience)
    assert isinstance(fitted, Fitted)
    assert (fitted.epochs_trained, fitted.selected_epoch) == (trained, selected)
    assert fitted.curves["val"] == script[:trained + 1]
    row = fitted.metrics()
    assert row["epochs_trained"] == float(trained) and row["stopped_early"] == stopped
    assert row["still_rising"] == rising and fitted.still_rising is bool(rising)
    assert "instances" not in row                  # no problem instances
    # every entry at_epoch gave before is still there, with its value
    before = at_epoch(fitted.curves, selected)
    assert {k: row[k] for k in before} == before and row["val"] == script[selected]
    assert math.isnan(fitted.curves["train_loss"][0])


def test_asap_instances_are_counted():
    # instance_patience 1: epoch 2 misses epoch 1's 0.3 (instance at 3), 3 misses epoch 2's
    # 0.2 (instance at 4), 4 beats 0.2: 3 instances, at 1, 3, 4
    objective = _Instances()
    fitted = _fit([0.1, 0.3, 0.2, 0.2, 0.25], objective=objective, instance_patience=1)
    assert fitted.instance_starts == (1, 3, 4) and len(objective.calls) == 3
    assert fitted.metrics()["instances"] == 3.0
    objective = _Instances()
    fitted = _fit([0.1] * 6, objective=objective, instance_every=2)
    assert fitted.instance_starts == (1, 3, 5) and fitted.metrics()["instances"] == 3.0
    with pytest.raises(ValueError, match="instance_every == 2 and instance_patience == 1"):
        _fit([0.1] * 3, objective=_Instances(), instance_every=2, instance_patience=1)


def _rates(monkeypatch, script, **kwargs):
    """The ``lr`` entry of each epoch's row of a fit (the rate that epoch trained with; fit's
    curves hold the evaluation only), read as the loop hands the rows to its sink."""
    from refdml.train.trainer import MemorySink

    rates = []
    original = MemorySink.end_epoch

    def spy(self, loop, row):
        rates.append(row["lr"])
        original(self, loop, row)

    with monkeypatch.context() as patched:
        patched.setattr(MemorySink, "end_epoch", spy)
        _fit(script, **kwargs)
    return rates


def test_reduce_on_plateau_lowers_the_rate_when_the_metric_stalls(monkeypatch):
    """factor 0.5, patience 1, mode "max" (a rise beyond 1e-4 relative improves): epoch 1
    is the schedule's first best; 2 ties (1 bad epoch, not more than the patience), 3 falls
    (2 > 1): the rate halves from epoch 4 on; 4 improves; 5, 6 tie: halved again for 7."""
    script = [0.1, 0.5, 0.5, 0.4, 0.6, 0.6, 0.6, 0.6]
    rates = _rates(monkeypatch, script, plateau_factor=0.5, plateau_patience=1)
    np.testing.assert_allclose(rates, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025],
                               rtol=1e-12)
    # without the schedule (the settings absent) the rate stays
    np.testing.assert_allclose(_rates(monkeypatch, script), [0.1] * len(script), rtol=0)


def test_plateau_settings_are_both_or_neither():
    for factor, patience in ((0.5, None), (None, 2)):
        with pytest.raises(ValueError, match="plateau_factor .* plateau_patience"):
            _fit([0.1, 0.2], plateau_factor=factor, plateau_patience=patience)
    with pytest.raises(ValueError, match="factor"):
        _fit([0.1, 0.2], plateau_factor=1.5, plateau_patience=2)


# Small data per study (fit is replaced below: nothing trains, only the data are built).
_SMALL = {
    "tokens": ("gap", {"n_train_per_class": 4, "n_val_per_class": 2, "n_test_per_class": 2}),
    "wdml": ("contrastive", {"n_train_per_class": 4, "n_val_per_class": 2,
                             "n_test_per_class": 2, "tokens_per_sample": 4,
                             "contrastive_neg_margin": 0.5}),
    "collage": ("asap", {"collages_per_image": 1, "conv_channels": [2, 2],
                         "conv_strides": [1, 2], "local_dim": 4, "embedding_dim": 4,
                         "proxies_per_class": 2, "budget": 3, "loss": "proxy_nca"}),
    "glyph": ("asap", {"glyph_size": 8, "max_classes": 30, "conv_channels": [2, 2],
                       "conv_strides": [1, 2], "local_dim": 4, "embedding_dim": 4,
                       "proxies_per_class": 2, "budget": 3, "loss": "proxy_nca"}),
    "glyph_collage": ("asap", {"glyph_size": 8, "max_classes": 34, "instances_per_font": 1,
                               "collages_per_image": 1, "families": ["digits"],
                               "conv_channels": [2, 2], "conv_strides": [2, 1],
                               "local_dim": 4, "embedding_dim": 4, "proxies_per_class": 2,
                               "budget": 3, "loss": "proxy_nca"}),
    "glyph_wdml": ("contrastive", {"glyph_size": 8, "max_classes": 30, "conv_channels": [2],
                                   "conv_strides": [2], "local_dim": 4,
                                   "contrastive_neg_margin": 0.5}),
}
_PLATEAU = {"patience": 6, "plateau_factor": 0.5, "plateau_patience": 2}


class _Stop(Exception):
    pass


def _fit_keywords(monkeypatch, study, method=None, **settings):
    """The keywords the study hands to fit (which stops the task there)."""
    from refdml.reproduce import Task, _studies
    from refdml.reproduce._experiments import settings_for

    seen = {}

    def recording_fit(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(_studies, "fit", recording_fit)
    default, small = _SMALL[study]
    method = default if method is None else method
    task = Task.make(study, method, 0, settings_for(study, "quick", **{**small, **settings}))
    with pytest.raises(_Stop):
        _studies.STUDIES[study](task)
    return seen


@pytest.mark.parametrize("study", sorted(_SMALL))
def test_every_study_passes_the_plateau_settings(monkeypatch, study):
    asap = _SMALL[study][0] == "asap"
    instances = {"instance_every": None, "instance_patience": 3} if asap else {}
    seen = _fit_keywords(monkeypatch, study, **_PLATEAU, **instances)
    assert {k: seen[k] for k in _PLATEAU} == _PLATEAU
    if asap:
        assert (seen["instance_patience"], seen["instance_every"]) == (3, None)
    # settings set to None (or absent): fit's defaults (all epochs, one rate), as before;
    # ASAP then with an instance every given number of epochs
    unset = {k: None for k in _PLATEAU}
    every = {"instance_every": 2, "instance_patience": None} if asap else {}
    seen = _fit_keywords(monkeypatch, study, **unset, **every)
    assert all(seen[k] is None for k in _PLATEAU)
    if asap:
        assert seen["instance_patience"] is None and seen["instance_every"] == 2


def test_asap_needs_exactly_one_instance_rule(monkeypatch):
    for both_or_neither in ({"instance_every": 2, "instance_patience": 3},
                            {"instance_every": None, "instance_patience": None}):
        with pytest.raises(ValueError, match="exactly one of the settings instance_every"):
            _fit_keywords(monkeypatch, "collage", **both_or_neither)
    # a method other than asap ignores both (the settings are the study's, shared)
    seen = _fit_keywords(monkeypatch, "collage", method="gap", instance_patience=3)
    assert seen["instance_patience"] is None and seen["instance_every"] is None


def test_an_asap_task_reports_its_instances():
    """One real task end to end: ASAP on tiny collages with instance_patience."""
    from refdml.reproduce import Task, execute
    from refdml.reproduce._experiments import settings_for

    settings = settings_for("collage", "quick", **{**_SMALL["collage"][1], "epochs": 3,
                                                    "instance_every": None,
                                                    "instance_patience": 1,
                                                    "n_prototypes": 4, "transfer_repeats": 2})
    metrics = execute(Task.make("collage", "asap", 0, settings))["metrics"]
    assert metrics["epochs_trained"] == 3.0 and metrics["stopped_early"] == 0.0
    # the first instance at epoch 1, at most one more per later epoch
    assert 1.0 <= metrics["instances"] <= 3.0
    assert metrics["still_rising"] == float(metrics["selected_epoch"] == 3.0)
