"""refdml.train.config's typed RunConfig and refdml.train.models, the one model builder.

The RunConfig holds exactly the effective config's keys and values (round trip through its
dict and through TOML), refuses bad values with the messages of the dict form, and builds
the same run as the dict; reproduce's collage model and build_run's come from the same
builders, so with the same settings and seed they start from the same parameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refdml.train.config import (
    KEYS,
    STUDIES,
    RunConfig,
    default_config,
    effective_config,
    resolve_config,
)
from refdml.train.runs import build_run


def test_every_key_is_a_field():
    assert {f.name for f in dataclasses.fields(RunConfig)} == {"study", *KEYS}


@pytest.mark.parametrize("study", ["tokens", "digits-collage"])
def test_round_trip_through_the_dict_and_toml(tmp_path, study):
    from refdml.train._cli import load_toml

    typed = resolve_config(study, {"head": "gap", "lr": 3e-3, "seed": 4})
    plain = typed.as_dict()
    assert plain == effective_config(study, {"head": "gap", "lr": 3e-3, "seed": 4})
    assert list(plain) == list(default_config(study))          # the study's keys, in order
    assert resolve_config(study, plain) == typed
    lines = [f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}"
             for k, v in plain.items() if v is not None]
    (tmp_path / "run.toml").write_text("\n".join(lines) + "\n")
    assert resolve_config(study, load_toml(str(tmp_path / "run.toml"))) == typed
    # typed values: resolved defaults filled, the TOML's lists as tuples, other studies' None
    assert typed.zero_shot is False and typed.lr == 3e-3 and typed.seed == 4
    if study == "digits-collage":
        assert typed.conv_strides == (1, 2, 1) and typed.dim is None
    else:
        assert typed.conv_channels is None and typed.dim == 16


def test_frozen_and_study_checked():
    typed = resolve_config("tokens")
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.lr = 1.0
    assert resolve_config("tokens", typed) is typed
    with pytest.raises(ValueError, match="RunConfig of study 'tokens', not of 'features'"):
        resolve_config("features", typed)
    with pytest.raises(ValueError, match="study == 'images', must be one of"):
        resolve_config("images")


@pytest.mark.parametrize("config,error,match", [
    ({"lr": 0.0}, ValueError, r"lr == 0.0, must be > 0.0"),
    ({"conv_channels": [16, 0]}, ValueError, r"conv_channels == \[16, 0\], each entry"),
    ({"conv_strides": [1, 2]}, ValueError, r"conv_strides == \[1, 2\] needs one stride"),
    ({"mu": "high"}, TypeError, "mu must be a number"),
    ({"objective": "asap", "loss": "contrastive"}, ValueError, "needs a proxy loss"),
])
def test_bad_values_keep_their_messages(config, error, match):
    for resolve in (resolve_config, effective_config):
        with pytest.raises(error, match=match):
            resolve("digits-collage", config)


def _initial(parameters):
    return [(p.name, np.array(p.value, copy=True)) for p in parameters]


def test_build_run_takes_a_run_config(tmp_path):
    """A RunConfig and its dict build the same run. Bitwise equal: the same code draws the
    same numbers from the same seeded generator in the same order."""
    config = {"n_classes": 4, "n_classes_per_batch": 4, "n_prototypes": 3, "progress": False}
    runs = [build_run("tokens", c, out_dir=tmp_path / str(i))
            for i, c in enumerate((config, resolve_config("tokens", config)))]
    assert runs[0].config == runs[1].config
    for (name_a, a), (name_b, b) in zip(_initial(runs[0].trainer.optimizer.params),
                                        _initial(runs[1].trainer.optimizer.params)):
        assert name_a == name_b
        np.testing.assert_array_equal(a, b, err_msg=name_a)


def test_reproduce_and_build_run_build_the_same_collage_model(tmp_path):
    """Same settings, same seed: reproduce's GSP collage model starts where build_run's
    digits-collage model does (one builder; bitwise, as above: the same draws in order)."""
    from refdml.reproduce._experiments import settings_for
    from refdml.reproduce._studies import _collage_configs, _collage_model

    settings = settings_for("collage", "quick", loss="contrastive")
    head, _ = _collage_configs("gsp", settings)
    from refdml.train.models import Placement

    reproduce = _collage_model(head, settings, np.random.default_rng(5 + 1),
                               Placement(dtype=np.dtype(np.float32)))
    run = build_run("digits-collage", {"seed": 5, "progress": False, "zero_shot": False},
                    out_dir=tmp_path)
    a, b = _initial(reproduce.parameters()), _initial(run.model.parameters())
    assert [n for n, _ in a] == [n for n, _ in b] and len(a) > 4
    for (name, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype == np.float32
        np.testing.assert_array_equal(x, y, err_msg=name)
    assert [type(layer) for layer in reproduce.layers] == [type(layer) for layer in
                                                           run.model.layers]


def test_every_study_resolves():
    for study in STUDIES:
        config = {"features": "x.npz"} if study == "features" else {}
        typed = resolve_config(study, config)
        assert typed.study == study
        assert set(typed.as_dict()) == set(default_config(study))
