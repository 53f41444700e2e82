"""A config key the run would not read is refused, not recorded in config.json and ignored
(issue 48, item 6), the way the ASAP keys outside ``objective = "asap"`` already were.

Each case: the key at a value other than its default, in a run where nothing reads it, is a
ValueError naming the key; the same key where it is read, or at its default (a config.json
written by a run gives back every resolved default), is accepted.
"""

from __future__ import annotations

import pytest

from refdml.train.config import effective_config

_IGNORED = [
    # (study, config, the key named): the objective has no parameters of its own
    ("tokens", {"head": "gap", "proxy_lr_multiplier": 100.0}, "proxy_lr_multiplier"),
    ("glyphs", {"head": "gap", "loss": "contrastive", "proxy_lr_multiplier": 10.0},
     "proxy_lr_multiplier"),
    ("digits-collage", {"head": "gemean", "proxy_lr_multiplier": 2.0}, "proxy_lr_multiplier"),
    # GSP's zero-shot regulariser is off
    ("tokens", {"head": "gap", "lambda_": 0.3}, "lambda_"),
    ("digits-collage", {"zero_shot": False, "ridge": 0.5}, "ridge"),
    ("glyphs", {"head": "gap", "zero_shot_scale": 3.0}, "zero_shot_scale"),
    # no reduce-on-plateau schedule
    ("glyphs", {"plateau_patience": 2}, "plateau_patience"),
    ("digits-collage", {"plateau_factor": None, "plateau_patience": 9}, "plateau_patience"),
    # read only on a GPU: the steps' deferred checks and the captured step
    ("digits-collage", {"log_every": 5}, "log_every"),
    ("tokens", {"device": "cpu", "capture": True}, "capture"),
]

_READ = [
    ("tokens", {"head": "gsp", "proxy_lr_multiplier": 100.0}),   # GSP's class embeddings
    ("glyphs", {"loss": "proxy_nca", "proxy_lr_multiplier": 10.0}),
    ("digits-collage", {"objective": "asap", "proxy_lr_multiplier": 10.0}),
    ("tokens", {"head": "gsp", "lambda_": 0.3, "ridge": 0.5, "zero_shot_scale": 3.0}),
    ("glyphs", {"plateau_factor": 0.5, "plateau_patience": 2}),
    # one config over several heads: a head's sizes under another head are kept
    ("digits-collage", {"head": "gap", "n_prototypes": 8, "gemean_p": 5.0}),
    # at their defaults: harmless, and what config.json gives back
    ("tokens", {"head": "gap", "proxy_lr_multiplier": 1.0, "lambda_": 0.1, "mu": 0.3,
                "inverse_temperature": 5.0}),
    ("glyphs", {"head": "gap", "plateau_patience": 5}),
    ("digits-collage", {"device": "cuda", "log_every": 5, "capture": True}),
    ("tokens", {"log_every": 20, "capture": False}),
]


@pytest.mark.parametrize(("study", "config", "key"), _IGNORED,
                         ids=[f"{s}-{k}" for s, _, k in _IGNORED])
def test_a_key_the_run_would_ignore_is_refused_naming_it(study, config, key):
    with pytest.raises(ValueError, match=f"{key}.*would be ignored"):
        effective_config(study, config)


@pytest.mark.parametrize(("study", "config"), _READ)
def test_the_same_keys_where_they_are_read_or_at_their_default_pass(study, config):
    out = effective_config(study, {**config, **({"features": "f.npz"}
                                                if study == "features" else {})})
    for key, value in config.items():
        assert out[key] == value


@pytest.mark.parametrize("study", ["tokens", "digits-collage", "glyphs", "glyph-collage"])
@pytest.mark.parametrize("head", ["gap", "gmp", "gemean", "gsp"])
def test_a_resolved_config_passes_again(study, head):
    if study == "tokens" and head not in ("gap", "gsp"):
        pytest.skip("the tokens study compares gap and gsp")
    once = effective_config(study, {"head": head})
    assert effective_config(study, once) == once
