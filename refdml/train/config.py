r"""The config of a :mod:`refdml.train` run: its keys, defaults, checks, and :class:`RunConfig`.

The config is flat: every key of :data:`KEYS` that applies to the study (unknown keys are
a ValueError naming them). :func:`effective_config` fills the defaults; the defaults that
depend on other keys (``inverse_temperature`` on the loss, ``zero_shot`` on the head,
``conv_strides`` on ``conv_channels``, ``loss`` and ``zero_shot`` on ``objective``; for
the glyph studies the batches, ``proxy_lr_multiplier`` and ``warmup_epochs`` on the loss)
are resolved there, so ``config.json`` records the values the run used. Each default's source
("paper: GSP supp. 2.1", "ours", ...) is in :data:`KEYS` and docs/train.md.

:func:`resolve_config` returns the same values as a :class:`RunConfig`, a frozen
dataclass with one typed field per key (``None`` for the keys of another study), which
is what :mod:`refdml.train.models` and :func:`refdml.train.runs.build_run` read;
:meth:`RunConfig.as_dict` gives back the plain dict of the TOML / ``config.json`` keys.

``reference = true`` runs the float64 NumPy reference operators (:mod:`refdml.gsp`,
:mod:`refdml.normalize`, :mod:`refdml.losses`, :mod:`refdml.crossbatch`) in the head, the
normalisation and the objective instead of the :mod:`refdml.gpu` mirrors; the dense, conv
and plain pooling layers are written once and are the same code on both paths. It needs
``dtype = "float64"`` and ``device = "cpu"``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from refdml._validation import _describe, check_scalar
from refdml.train.data import GLYPH_FAMILIES
from refdml.train.objectives import PROXY_LOSSES

__all__ = ["ASAP_KEYS", "GLYPH_STUDIES", "HEADS", "KEYS", "STUDIES", "Key", "RunConfig",
           "default_config", "effective_config", "resolve_config"]

STUDIES = ("tokens", "digits-collage", "glyphs", "glyph-collage", "features")
#: The studies on the glyph benchmark (:func:`refdml.train.data.make_glyphs`), whose
#: defaults follow the papers' protocol (the batches, the proxies' rate and the warm-up
#: resolved from the loss: :func:`effective_config`).
GLYPH_STUDIES = ("glyphs", "glyph-collage")
HEADS = ("gap", "gmp", "gemean", "gsp")
_LOSSES = ("contrastive", "proxy_nca")
#: The keys that only objective == "asap" reads.
ASAP_KEYS = ("proxies_per_class", "budget", "asap_lambda", "instance_every",
             "instance_patience")


@dataclass(frozen=True)
class Key:
    """One config key: per-study defaults, where each comes from, and its check."""

    defaults: dict[str, Any]     # study -> default (``None``: resolved from other keys)
    source: str
    kind: str                    # "int", "float", "bool", "str", "path", "betas", ...
    low: float | None = None
    high: float | None = None
    low_inclusive: bool = True
    high_inclusive: bool = True
    choices: tuple[str, ...] | None = None
    optional: bool = False       # may be None (TOML: leave the key out)


def _same(value, studies=STUDIES) -> dict[str, Any]:
    return {s: value for s in studies}


def _glyphs(glyphs, collage=None) -> dict[str, Any]:
    """The two glyph studies' defaults (``collage``: glyph-collage's, if it differs)."""
    return {"glyphs": glyphs, "glyph-collage": glyphs if collage is None else collage}


#: The papers' optimiser (GSP supp., ASAP App. A.2): the glyph studies' default.
_PAPER_BETAS = [0.9, 0.99]


#: Every key, its default per study and its source. ``None`` as a default means "resolved
#: from other keys" (see :func:`effective_config`) or "none" where ``optional``.
KEYS: dict[str, Key] = {
    # -- the run
    "seed": Key(_same(0), "ours", "int", low=0),
    "epochs": Key({"tokens": 400, "digits-collage": 30, "features": 30,
                   **_glyphs(30, 10)},
                  "ours (tokens: a cap above the early stop, measured at epochs 164-261 on "
                  "seeds 0-2; "
                  "digits-collage: the training goal's 30; glyphs, glyph-collage: a few "
                  "minutes on a 2-core CPU, measured in docs/train.md)", "int", low=0),
    "dtype": Key(_same("float32"), "ours (the fast path)", "str",
                 choices=("float32", "float64")),
    "device": Key(_same("cpu"), "ours", "str", choices=("cpu", "cuda")),
    "reference": Key(_same(False), "ours", "bool"),
    "early_stopping_patience": Key({"tokens": 30, "digits-collage": 10, "features": 10,
                                    **_glyphs(10)},
                                   "tokens: paper (GSP supp. 2.1, 30 epochs on MAP@R); "
                                   "others: ours",
                                   "int", low=1, optional=True),
    "early_stopping_min_delta": Key(_same(0.0), "ours (0: any increase improves, as the "
                                    "paper's rule reads)", "float", low=0.0),
    "early_stopping_target": Key(_same(1.0), "ours (1.0, MAP@R's maximum: no later epoch "
                                 "can beat it, so the patience would only wait)", "float",
                                 low=0.0, high=1.0, low_inclusive=False, optional=True),
    "blas_threads": Key(_same(1), "ours (measured: NumPy's and SciPy's OpenBLAS spin against "
                        "each other with 2 threads each; docs/train.md)", "int", low=1,
                        optional=True),
    "side_thread": Key(_same(True), "ours (measured: the weight gradients' products on the "
                       "second core, beside the input gradients'; docs/train.md)", "bool"),
    "eval_batch_size": Key(_same(1024), "ours", "int", low=1),
    "progress": Key(_same(True), "ours", "bool"),
    "log_every": Key(_same(20), "ours (device \"cuda\" only: steps between two host reads "
                     "of the steps' deferred checks and losses)", "int", low=1),
    "capture": Key(_same(False), "ours (device \"cuda\" only: record the step once per shape "
                   "as a CUDA graph and replay it; opt-in until measured on a GPU)", "bool"),
    # -- optimiser and schedule
    "lr": Key({"tokens": 1e-4, "digits-collage": 1e-3, "features": 1e-3, **_glyphs(3e-3)},
              "tokens: paper (GSP supp. 2.1, Adam 1e-4); digits-collage: paper (supp. 2.2, "
              "Adam 1e-3); features: ours; glyphs, glyph-collage: ours (refdml reproduce's "
              "glyph setting: a small net trained from scratch, where the papers fine-tune "
              "a pretrained one at 1e-5)", "float", low=0.0, low_inclusive=False),
    "weight_decay": Key({**_same(0.0), **_glyphs(1e-4)},
                        "paper (default Adam); glyphs, glyph-collage: paper (GSP supp., ASAP "
                        "App. A.2: 1e-4)", "float", low=0.0),
    "betas": Key({**_same([0.9, 0.999]), **_glyphs(_PAPER_BETAS)},
                 "Adam's defaults (Kingma & Ba 2015), as before; the GSP and ASAP papers "
                 "train with (0.9, 0.99), the glyph studies' default", "betas"),
    "proxy_lr_multiplier": Key({**_same(1.0), **_glyphs(None)},
                               "ours (1: one rate for the proxies and the network, as "
                               "before); the GSP and ASAP papers train the proxies of "
                               "ProxyNCA++ and Proxy-Anchor at 100 (glyphs, glyph-collage: "
                               "resolved, 100 with a proxy loss outside ASAP, else 1)",
                               "float", low=0.0, low_inclusive=False),
    "warmup_epochs": Key({**_same(0), **_glyphs(None)},
                         "ours (0: no warm-up, as before); the GSP and ASAP papers warm up "
                         "the embedding layer for 1 epoch with the proxy losses (glyphs, "
                         "glyph-collage: resolved, 1 with a proxy loss outside ASAP, else 0)",
                         "int", low=0),
    "plateau_factor": Key({"digits-collage": 0.5, "features": 0.5, **_glyphs(None)},
                          "paper (GSP supp. 2.2: reduce on plateau, factor 0.5); glyphs, "
                          "glyph-collage: none (the papers' CUB protocol has no schedule)",
                          "float", low=0.0, high=1.0, low_inclusive=False,
                          high_inclusive=False, optional=True),
    "plateau_patience": Key({"digits-collage": 5, "features": 5, **_glyphs(5)},
                            "paper (GSP supp. 2.2: 5 epochs patience)", "int", low=0),
    # -- batches
    "n_classes_per_batch": Key({"tokens": 16, "digits-collage": 8, "features": 16,
                                **_glyphs(None)},
                               "tokens: paper (16 classes); digits-collage: ours (all 8 "
                               "training classes; the paper's 16 exceed them); features: "
                               "ours; glyphs, glyph-collage: resolved, the papers' 32 with a "
                               "proxy loss outside ASAP, else 8 (batches of 32)",
                               "int", low=1),
    "n_samples_per_class": Key({"tokens": 4, "digits-collage": 8, "features": 4,
                                **_glyphs(None)},
                               "tokens: paper (4 samples); digits-collage: ours (batch 64, "
                               "the training benchmark's size); features: ours; glyphs, "
                               "glyph-collage: resolved, the papers' 1 with a proxy loss "
                               "outside ASAP, else 4", "int", low=1),
    # -- data
    # >= 2: a positive pair to train on, a class mate for each retrieval query
    "n_train_per_class": Key({"tokens": 64}, "ours (the paper gives no counts)", "int", low=2),
    "n_val_per_class": Key({"tokens": 16}, "ours", "int", low=2),
    "n_test_per_class": Key({"tokens": 16}, "ours", "int", low=2),
    "n_classes": Key({"tokens": 16}, "paper (GSP supp. 2.1)", "int", low=2),
    "tokens_per_class": Key({"tokens": 4}, "paper", "int", low=1),
    "n_background_tokens": Key({"tokens": 4}, "paper", "int", low=1),
    "tokens_per_sample": Key({"tokens": 50}, "paper", "int", low=1),
    "mixing_mean": Key({"tokens": 0.5}, "paper", "float", low=0.0, high=1.0),
    "mixing_std": Key({"tokens": 0.1}, "paper (read as a standard deviation)", "float",
                      low=0.0),
    "collages_per_image": Key({"digits-collage": 4, "glyph-collage": 1},
                              "ours (digits-collage, measured: at 1, an epoch is 11 steps and "
                              "30 epochs barely move the test MAP@R; glyph-collage: about "
                              "4700 training collages at 1)", "int", low=1, high=1000),
    "eval_collages_per_image": Key({"digits-collage": 1, "glyph-collage": 1},
                                   "ours (more would put copies of one image, "
                                   "near-duplicates, in the evaluation splits)", "int", low=1,
                                   high=1000),
    "glyph_size": Key(_glyphs(16), "ours (refdml reproduce's CPU scale: 16 x 16 pixels per "
                      "glyph; its GPU scale draws 28)", "int", low=8, high=256),
    "max_classes": Key(_glyphs(None), "ours (none: all of the about 600 classes, split "
                       "0.55 / 0.15 / 0.30 into about 330 / 90 / 180 disjoint classes)",
                       "int", low=3, optional=True),
    "instances_per_font": Key(_glyphs(1), "ours (refdml reproduce's CPU scale: about 4800 "
                              "training glyphs)", "int", low=1, high=1000),
    "eval_instances_per_font": Key(_glyphs(1), "ours (one instance per font in validation "
                                   "and test)", "int", low=1, high=1000),
    "grid": Key({"glyph-collage": 2}, "paper (GSP supp. 2.2: a 2 x 2 collage, Fig. 11)",
                "int", low=2, high=8),
    "n_background": Key({"glyph-collage": [0, 0, 0]}, "ours (random distractor classes per "
                        "split, train / val / test, besides the families)", "counts"),
    "families": Key({"glyph-collage": list(GLYPH_FAMILIES)},
                    "ours (refdml reproduce's: the distractors' kinds, shared by the splits "
                    "as Cifar Collage's super-classes are, their characters split)", "names",
                    choices=tuple(GLYPH_FAMILIES)),
    "features": Key({"features": None}, "required (--features PATH)", "path"),
    "features_key": Key({"features": "features"}, "ours", "str"),
    "labels_key": Key({"features": "labels"}, "ours", "str"),
    "split_fractions": Key({"features": [0.5, 0.25, 0.25]}, "ours (train, val, test classes)",
                           "fractions"),
    # -- model
    "dim": Key({"tokens": 16}, "ours (the paper gives no width)", "int", low=1),
    "conv_channels": Key({"digits-collage": [16, 32, 32], **_glyphs([16, 32, 32])},
                         "ours (measured, docs/train.md; glyphs: refdml reproduce's)", "ints"),
    "conv_strides": Key({"digits-collage": None, **_glyphs(None)},
                        "ours: 1, 2, then 1 (resolved to conv_channels' length); glyphs, "
                        "glyph-collage: 1, then 2 (refdml reproduce's [1, 2, 2])", "ints"),
    "local_dim": Key({"digits-collage": 64, **_glyphs(64)}, "ours", "int", low=1),
    "embedding_dim": Key({"tokens": 16, "digits-collage": 64, "features": 128,
                          **_glyphs(64)},
                         "ours (features: GSP's 128-d embeddings)", "int", low=1),
    "l2_normalize": Key(_same(True), "ours (GSP supp. 2.2 normalises; supp. 2.1 says the "
                        "token study does not: set false to follow it)", "bool"),
    "head": Key({"tokens": "gsp", "digits-collage": "gsp", "features": "gsp",
                 **_glyphs("gsp")}, "ours", "str", choices=HEADS),
    "n_prototypes": Key({"tokens": 16, "digits-collage": 128, "features": 64,
                         **_glyphs(64)},
                        "digits-collage: paper (supp. 2.2, m = 128); features, glyphs, "
                        "glyph-collage: paper (GSP CUB/Cars, 64); tokens: ours", "int", low=1),
    "mu": Key({"tokens": 0.3, "digits-collage": 0.2, "features": 0.3, **_glyphs(0.3)},
              "digits-collage: paper (supp. 2.2); others: paper (GSP Sec. 1.5 default 0.3)",
              "float", low=0.0, high=1.0, low_inclusive=False),
    "inverse_temperature": Key(_same(None),
                               "paper: GSP's 0.5 (proxy losses) / 5.0 (pair losses); "
                               "digits-collage: supp. 2.2's 10", "float", low=0.0),
    "gemean_p": Key({"digits-collage": 3.0, "features": 3.0, **_glyphs(3.0)},
                    "ours (GeM's usual 3)", "float", low=1.0, low_inclusive=False),
    # -- objective
    "objective": Key({"digits-collage": "loss", "features": "loss", **_glyphs("loss")},
                     "ours: 'loss' (the loss below, with GSP's zero-shot regulariser when "
                     "zero_shot) or 'asap' (ASAP Alg. 1-2 around a proxy loss)", "str",
                     choices=("loss", "asap")),
    "proxies_per_class": Key({"digits-collage": 8, "features": 8, **_glyphs(8)},
                             "paper (ASAP App. A.2: 8 for CUB and Cars, 4 for SOP/In-shop)",
                             "int", low=1),
    "budget": Key({"digits-collage": 12, "features": 12, **_glyphs(12)},
                  "paper (ASAP App. A.2: pool size b = 12 for CUB and Cars, 7 for "
                  "SOP/In-shop)", "int", low=1),
    "asap_lambda": Key({"digits-collage": 2e-4, "features": 2e-4, **_glyphs(2e-4)},
                       "paper (ASAP App. A.2: lambda = 2e-4 for all data sets)", "float",
                       low=0.0),
    "instance_every": Key({"digits-collage": 5, "features": 5, **_glyphs(3)},
                          "ours, measured (ASAP Alg. 1 runs each instance 'until "
                          "convergence', App. A.2 gives no length; one instance's loss "
                          "flattens after 4-6 epochs; a sweep of 1, 2, 5, 10 differs by "
                          "less than the epoch-to-epoch noise: docs/train.md); glyphs, "
                          "glyph-collage: 3, refdml reproduce's for its 6-epoch runs; "
                          "none when instance_patience is given",
                          "int", low=1, optional=True),
    "instance_patience": Key({"digits-collage": None, "features": None, **_glyphs(None)},
                             "paper (ASAP Sec. 4.4: 'early stopping patience of 3 to pass "
                             "the next projection'); none by default: instances every "
                             "instance_every epochs, as before",
                             "int", low=1, optional=True),
    "loss": Key({"tokens": "contrastive", "digits-collage": "contrastive",
                 "features": "contrastive", **_glyphs("contrastive")}, "ours", "str",
                choices=_LOSSES),
    "pos_margin": Key(_same(None), "the contrastive loss's own default (refdml.losses: 0)",
                      "float", low=0.0, optional=True),
    "neg_margin": Key(_same(None), "the contrastive loss's own default (refdml.losses: "
                      "0.3841, GSP supp. 1.6.7)", "float", low=0.0, optional=True),
    "zero_shot": Key(_same(None), "on with a GSP head (GSP Alg. 1), else off", "bool"),
    "lambda_": Key({"tokens": 0.1, "digits-collage": 0.5, "features": 0.1, **_glyphs(0.1)},
                   "paper: GSP Sec. 1.5 (0.1); digits-collage: supp. 2.2 (0.5)", "float",
                   low=0.0, high=1.0),
    "ridge": Key(_same(0.05), "paper (GSP's epsilon of (P3), 0.05)", "float", low=0.0,
                 low_inclusive=False),
    "zero_shot_scale": Key(_same(9.5), "the authors' code (Alg. 4 prints none)", "float",
                           low=0.0, low_inclusive=False),
}


def default_config(study: str) -> dict[str, Any]:
    """The study's keys with their defaults (``None`` where resolved from other keys)."""
    _check_study(study)
    return {k: copy.deepcopy(key.defaults[study]) for k, key in KEYS.items()
            if study in key.defaults}


def _check_study(study) -> str:
    if not isinstance(study, str) or study not in STUDIES:
        raise ValueError(f"study == {study!r}, must be one of {STUDIES}")
    return study


def _check_value(name: str, key: Key, value: Any) -> Any:
    if value is None:
        if key.optional:
            return None
        raise ValueError(f"{name} == None; it needs a value")
    kind = key.kind
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be true or false, got {_describe(value)}")
        return bool(value)
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number, got {_describe(value)}")
        if kind == "int":
            if isinstance(value, (float, np.floating)):
                # an integral float (TOML 4.0) is read as the integer; nan, inf, 1.5 are not
                if not np.isfinite(value):
                    raise ValueError(f"{name} == {value}, must be a finite integer")
                if not float(value).is_integer():
                    raise TypeError(f"{name} must be an integer, got {value!r}")
                if abs(value) >= 2.0**63:
                    raise ValueError(f"{name} == {value!r}, must fit in int64 "
                                     f"(|{name}| < 2**63)")
                value = int(value)
            value = check_scalar(value, name, integer=True)
        else:
            value = float(value)
            if not np.isfinite(value):
                raise ValueError(f"{name} == {value}, must be finite")
        below = key.low is not None and (
            value < key.low or (value == key.low and not key.low_inclusive))
        if below:
            relation = ">=" if key.low_inclusive else ">"
            raise ValueError(f"{name} == {value}, must be {relation} {key.low}")
        above = key.high is not None and (
            value > key.high or (value == key.high and not key.high_inclusive))
        if above:
            relation = "<=" if key.high_inclusive else "<"
            raise ValueError(f"{name} == {value}, must be {relation} {key.high}")
        return value
    if kind in ("str", "path"):
        if isinstance(value, Path):
            value = str(value)
        if not isinstance(value, str) or not value:
            raise TypeError(f"{name} must be a non-empty string, got {_describe(value)}")
        if key.choices is not None and value not in key.choices:
            raise ValueError(f"{name} == {value!r}, must be one of {key.choices}")
        return value
    if kind == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise TypeError(f"{name} must be a list of 2 numbers (beta1, beta2), got "
                            f"{_describe(value)}")
        for v in value:
            if (isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating))
                    or not 0.0 <= v < 1.0):
                raise ValueError(f"{name} == {list(value)}, each entry must be a number in "
                                 "[0, 1)")
        return [float(v) for v in value]
    if kind == "ints":
        if not isinstance(value, (list, tuple)) or len(value) == 0:
            raise TypeError(f"{name} must be a non-empty list of integers, got "
                            f"{_describe(value)}")
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
               for v in value):
            raise ValueError(f"{name} == {list(value)}, each entry must be an integer >= 1")
        return [int(v) for v in value]
    if kind == "counts":
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise TypeError(f"{name} must be a list of 3 integers (train, val, test), got "
                            f"{_describe(value)}")
        if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0
               for v in value):
            raise ValueError(f"{name} == {list(value)}, each entry must be an integer >= 0")
        return [int(v) for v in value]
    if kind == "names":
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{name} must be a list of names (any of {key.choices}), got "
                            f"{_describe(value)}")
        for v in value:
            if not isinstance(v, str) or v not in key.choices:
                raise ValueError(f"{name} == {list(value)}: {v!r} is not one of "
                                 f"{key.choices}")
        if len(set(value)) != len(value):
            raise ValueError(f"{name} == {list(value)} names an entry twice")
        return list(value)
    length = 3 if kind == "fractions" else 2
    if not isinstance(value, (list, tuple)) or len(value) != length:
        raise TypeError(f"{name} must be a list of {length} numbers, got {_describe(value)}")
    out = []
    for v in value:
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                or not np.isfinite(v)):
            raise ValueError(f"{name} == {list(value)}, each entry must be a positive number")
        if kind == "pair" and float(v) != int(v):
            raise ValueError(f"{name} == {list(value)}, each entry must be an integer")
        out.append(int(v) if kind == "pair" else float(v))
    return out


def effective_config(study: str, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config`` over the study's defaults, checked, with the dependent defaults resolved.

    Unknown keys (or keys of another study) are a ValueError naming them; bad values a
    TypeError / ValueError naming the key. The result is what ``config.json`` records.
    """
    _check_study(study)
    config = {} if config is None else config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict, got {_describe(config)}")
    allowed = default_config(study)
    unknown = sorted(k for k in config if k not in allowed)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} for study {study!r}; the keys are "
                         f"{sorted(allowed)}")
    given = set(k for k, v in config.items() if v is not None)
    merged = {**allowed, **config}
    head = _check_value("head", KEYS["head"], merged["head"])
    asap = "objective" in merged and _check_value(
        "objective", KEYS["objective"], merged["objective"]) == "asap"
    if asap:
        if "loss" not in given:
            merged["loss"] = "proxy_nca"
        if "instance_patience" in given:
            if "instance_every" in given:
                raise ValueError(
                    f"instance_every == {config['instance_every']!r} and instance_patience "
                    f"== {config['instance_patience']!r}: ASAP starts its problem instances "
                    "by one rule; give one of them")
            merged["instance_every"] = None
        elif merged["instance_every"] is None:
            raise ValueError("objective == 'asap' needs instance_every or instance_patience "
                             "(when to start a new problem instance); both are None")
        if merged["zero_shot"]:
            raise ValueError("objective == 'asap' has no zero-shot regulariser: leave "
                             "zero_shot out or set it false")
        merged["zero_shot"] = False
    elif "objective" in merged:
        # a value other than the default would be silently ignored: refuse it
        extra = sorted(k for k in ASAP_KEYS if k in given and config[k] != allowed[k])
        if extra:
            raise ValueError(f"{extra} apply to objective == 'asap', not to objective == "
                             f"{merged['objective']!r}")
    loss = _check_value("loss", KEYS["loss"], merged["loss"])
    if asap and loss not in PROXY_LOSSES:
        raise ValueError(f"objective == 'asap' needs a proxy loss (loss one of "
                         f"{sorted(set(PROXY_LOSSES) & set(_LOSSES))}), got loss == {loss!r}")
    if merged["zero_shot"] is None:
        merged["zero_shot"] = head == "gsp"
    if "conv_strides" in merged and merged["conv_strides"] is None:
        channels = _check_value("conv_channels", KEYS["conv_channels"], merged["conv_channels"])
        merged["conv_strides"] = ([1 if i == 0 else 2 for i in range(len(channels))]
                                  if study in GLYPH_STUDIES else
                                  [2 if i == 1 else 1 for i in range(len(channels))])
    if study in GLYPH_STUDIES:
        # the papers' protocol (GSP supp., ASAP App. A.2) for the proxy losses: batches of
        # 32 classes x 1 sample, the proxies at 100 x lr, one warm-up epoch; the pair
        # losses (and ASAP, which uses neither) batches of 8 classes x 4 samples
        proxy = loss in PROXY_LOSSES and not asap
        epochs = _check_value("epochs", KEYS["epochs"], merged["epochs"])
        for name, value in (("n_classes_per_batch", 32 if proxy else 8),
                            ("n_samples_per_class", 1 if proxy else 4),
                            ("proxy_lr_multiplier", 100.0 if proxy else 1.0),
                            ("warmup_epochs", min(1, epochs) if proxy else 0)):
            if merged[name] is None:
                merged[name] = value
    if merged["inverse_temperature"] is None:
        merged["inverse_temperature"] = (10.0 if study == "digits-collage"
                                         else 0.5 if loss in PROXY_LOSSES else 5.0)
    out = {}
    for name, value in merged.items():
        key = KEYS[name]
        if name == "features" and value is None:
            raise ValueError("features == None: the features study needs the path of a .npz "
                             "(--features PATH or features = \"PATH\" in the TOML)")
        out[name] = _check_value(name, key, value)
    if out["zero_shot"] and head != "gsp":
        raise ValueError(f"zero_shot == true needs head == 'gsp' (the regulariser reads the "
                         f"GSP histogram z), got head == {head!r}")
    if study == "tokens" and head not in ("gap", "gsp"):
        raise ValueError(f"head == {head!r}: the tokens study compares 'gap' and 'gsp'")
    if out["reference"] and (out["dtype"] != "float64" or out["device"] != "cpu"):
        raise ValueError(
            f"reference == true runs the float64 NumPy reference operators: it needs dtype == "
            f"'float64' and device == 'cpu', got dtype == {out['dtype']!r}, device == "
            f"{out['device']!r}")
    if out["zero_shot"] and out["n_classes_per_batch"] < 2:
        raise ValueError(f"n_classes_per_batch == {out['n_classes_per_batch']}: zero_shot "
                         "(GSP's regulariser) splits each batch into two class-disjoint "
                         "halves, which needs n_classes_per_batch >= 2")
    if out["warmup_epochs"] > out["epochs"]:
        raise ValueError(f"warmup_epochs == {out['warmup_epochs']}, must be <= epochs == "
                         f"{out['epochs']}")
    if study == "glyph-collage" and not out["families"] and min(out["n_background"]) < 1:
        raise ValueError(f"n_background == {out['n_background']} with families == []: every "
                         "split needs a distractor class (a family, or n_background >= 1 "
                         "for each split)")
    if asap and out["budget"] < out["proxies_per_class"]:
        raise ValueError(f"budget == {out['budget']} must be >= proxies_per_class == "
                         f"{out['proxies_per_class']} (ASAP Alg. 2 picks that many per pool)")
    if "conv_strides" in out and len(out["conv_strides"]) != len(out["conv_channels"]):
        raise ValueError(f"conv_strides == {out['conv_strides']} needs one stride per entry of "
                         f"conv_channels == {out['conv_channels']}")
    for name in ("pos_margin", "neg_margin"):
        if name in given and loss != "contrastive":
            raise ValueError(f"{name} is a hyperparameter of the contrastive loss, not of "
                             f"{loss!r}")
    _refuse_ignored(study, config, given, out, asap=asap, loss=loss)
    return out


def _refuse_ignored(study: str, config: dict[str, Any], given: set[str], out: dict[str, Any],
                    *, asap: bool, loss: str) -> None:
    """Refuse a key given a value other than its default where the run would not read it
    (as the ASAP keys outside ASAP are): config.json would record a setting that did
    nothing. A key given at its default is accepted (it changes nothing).

    The head's own sizes (``n_prototypes``, ``mu``, ...) under another head are not
    refused: one config compared over several heads is the studies' way of working."""
    allowed = default_config(study)

    def changed(name: str, default: Any) -> bool:
        return name in given and config[name] != default

    # the objective's parameters (proxies, GSP's class embeddings) have their own group
    has_parameters = asap or out["zero_shot"] or loss in PROXY_LOSSES
    if not has_parameters and changed("proxy_lr_multiplier", 1.0):
        raise ValueError(
            f"proxy_lr_multiplier == {config['proxy_lr_multiplier']!r} would be ignored: the "
            f"objective (loss {loss!r}, zero_shot false) has no parameters of its own; it "
            "applies to a proxy loss, zero_shot or objective == 'asap'")
    if not out["zero_shot"]:
        extra = sorted(k for k in ("lambda_", "ridge", "zero_shot_scale")
                       if changed(k, allowed[k]))
        if extra:
            raise ValueError(f"{extra} would be ignored: they apply to zero_shot == true "
                             "(GSP's zero-shot regulariser), which this run does not use")
    if out["device"] != "cuda":
        extra = sorted(k for k in ("log_every", "capture") if changed(k, allowed[k]))
        if extra:
            raise ValueError(f"{extra} would be ignored: they apply to device == 'cuda' "
                             f"(where the steps' checks are read later), not to device == "
                             f"{out['device']!r}")
    if out.get("plateau_factor", 0) is None and changed("plateau_patience",
                                                        allowed["plateau_patience"]):
        raise ValueError(f"plateau_patience == {config['plateau_patience']!r} would be "
                         "ignored: plateau_factor is None (no reduce-on-plateau schedule); "
                         "set plateau_factor too")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A run's effective config, checked and resolved (build it with :func:`resolve_config`).

    One field per key of :data:`KEYS` (docs/train.md gives each one's meaning and source);
    a key that does not apply to ``study`` is ``None``. Lists of the TOML are tuples here.
    """

    study: str
    # -- the run
    seed: int
    epochs: int
    dtype: str
    device: str
    reference: bool
    early_stopping_patience: int | None
    early_stopping_min_delta: float
    early_stopping_target: float | None
    blas_threads: int | None
    side_thread: bool
    eval_batch_size: int
    progress: bool
    log_every: int
    capture: bool
    # -- optimiser and schedule
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    proxy_lr_multiplier: float
    warmup_epochs: int
    plateau_factor: float | None = None
    plateau_patience: int | None = None
    # -- batches
    n_classes_per_batch: int
    n_samples_per_class: int
    # -- data: tokens
    n_train_per_class: int | None = None
    n_val_per_class: int | None = None
    n_test_per_class: int | None = None
    n_classes: int | None = None
    tokens_per_class: int | None = None
    n_background_tokens: int | None = None
    tokens_per_sample: int | None = None
    mixing_mean: float | None = None
    mixing_std: float | None = None
    # -- data: digits-collage, glyph-collage
    collages_per_image: int | None = None
    eval_collages_per_image: int | None = None
    # -- data: glyphs, glyph-collage
    glyph_size: int | None = None
    max_classes: int | None = None
    instances_per_font: int | None = None
    eval_instances_per_font: int | None = None
    grid: int | None = None
    n_background: tuple[int, int, int] | None = None
    families: tuple[str, ...] | None = None
    # -- data: features
    features: str | None = None
    features_key: str | None = None
    labels_key: str | None = None
    split_fractions: tuple[float, float, float] | None = None
    # -- model
    dim: int | None = None
    conv_channels: tuple[int, ...] | None = None
    conv_strides: tuple[int, ...] | None = None
    local_dim: int | None = None
    embedding_dim: int
    l2_normalize: bool
    head: str
    n_prototypes: int
    mu: float
    inverse_temperature: float
    gemean_p: float | None = None
    # -- objective
    objective: str | None = None
    proxies_per_class: int | None = None
    budget: int | None = None
    asap_lambda: float | None = None
    instance_every: int | None = None
    instance_patience: int | None = None
    loss: str
    pos_margin: float | None
    neg_margin: float | None
    zero_shot: bool
    lambda_: float
    ridge: float
    zero_shot_scale: float

    @property
    def asap(self) -> bool:
        """Whether the objective is ASAP's (``objective == "asap"``)."""
        return self.objective == "asap"

    def as_dict(self) -> dict[str, Any]:
        """The study's keys (in :data:`KEYS`' order) as plain TOML / JSON values."""
        return {name: list(value) if isinstance(value, tuple) else value
                for name, value in ((name, getattr(self, name)) for name in KEYS
                                    if self.study in KEYS[name].defaults)}



def resolve_config(study: str, config: dict[str, Any] | RunConfig | None = None) -> RunConfig:
    """:func:`effective_config` as a :class:`RunConfig` (a RunConfig of ``study`` passes)."""
    if isinstance(config, RunConfig):
        if config.study != _check_study(study):
            raise ValueError(f"config is a RunConfig of study {config.study!r}, not of "
                             f"{study!r}")
        return config
    values = effective_config(study, config)
    return RunConfig(study=study, **{name: tuple(value) if isinstance(value, list) else value
                                     for name, value in values.items()})
