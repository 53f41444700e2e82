r"""Complete training runs from a config: the five studies.

:func:`build_run(study, config, out_dir=...) <build_run>` returns a ready
:class:`~refdml.train.Run` (the :class:`~refdml.train.Trainer` plus the effective config);
``refdml train`` and ``scripts/train_*.py`` are thin wrappers over it.

``tokens`` (GSP supp. Sec. 2.1)
    ``Embedding(68, dim)`` (the trainable token table, drawn uniformly in [-0.3, 0.3]) ->
    pooling head (``gap`` or ``gsp``) -> ``Linear(dim, embedding_dim)`` ->
    ``L2Normalize``; after every optimiser step the token table is clipped back to
    [-0.3, 0.3] (``after_step``); Adam.
``digits-collage`` (GSP supp. Sec. 2.2, rebuilt from 8x8 digits)
    ``Conv2d -> ReLU`` per entry of ``conv_channels`` (default three: 16, 32, 32 channels,
    strides 1, 2, 1) -> ``LocalLinear(c, local_dim)`` (``local_dim`` 64; 64 local features, one
    per cell of the 8 x 8 grid left of a 16 x 16 collage) -> head (``gap | gmp | gemean | gsp``) ->
    ``Linear(local_dim, embedding_dim) -> L2Normalize``; objective ``contrastive`` or
    ``proxy_nca``, with GSP's zero-shot regulariser (GSP Alg. 1) when ``zero_shot``;
    Adam with reduce-on-plateau.
``glyphs`` (:func:`~refdml.train.data.make_glyphs`: about 600 character classes from
matplotlib's fonts, split class-disjointly 0.55 / 0.15 / 0.30)
    ``Conv2d -> ReLU`` per entry of ``conv_channels`` (strides 1, then 2: 16 local features
    of a 16 x 16 glyph) -> ``LocalLinear`` -> head -> ``Linear -> L2Normalize``; the
    papers' protocol by default (Adam (0.9, 0.99), weight decay 1e-4; with a proxy loss
    batches of 32 classes x 1, the proxies at 100 x ``lr`` and one warm-up epoch; GSP at
    its CUB settings m = 64, mu = 0.3), no schedule.
``glyph-collage`` (:func:`~refdml.train.data.make_glyph_collages`)
    the same model on ``grid`` x ``grid`` collages of glyphs (the class glyph in one cell,
    distractors of the split's ``families`` in the others: 64 local features at grid 2).
``features`` (a user's ``.npz`` of local features ``(N, n, d)``)
    head -> ``Linear(d, embedding_dim) -> L2Normalize``; class-disjoint split of the
    user's classes.

``objective = "asap"`` (digits-collage, glyphs, glyph-collage, features): ASAP Alg. 1-2
(:class:`~refdml.train.objectives.ASAPObjective`) around ``loss`` (default ``proxy_nca``):
``proxies_per_class`` proxies per class, ``asap_lambda/2 ||theta - theta*||^2`` on the
model's parameters, and every ``instance_every`` epochs (or, with ``instance_patience``,
on a validation plateau: ASAP Sec. 4.4) a new problem instance (proxies by greedy k-center
on per-class pools of ``budget`` training samples, ``theta* <- theta``, the proxies' Adam
state reset); the log gains ``proxy_covering_radius`` and ``instance``.

The optimiser (every study): Adam with ``lr``, ``betas`` and (coupled) ``weight_decay``;
the objective's parameters (proxies, class embeddings), when it has any, form a parameter
group trained at ``proxy_lr_multiplier`` times ``lr`` (the papers' 100); with
``warmup_epochs > 0`` the first epochs train only the embedding layer (the tail's
``Linear``) and the objective's parameters. The defaults (multiplier 1, no warm-up,
betas (0.9, 0.999)) give the runs made before these keys existed.

The config (its keys, defaults, checks and the typed :class:`~refdml.train.config.RunConfig`)
is :mod:`refdml.train.config`; the model and the objective are built by
:mod:`refdml.train.models`, the same builders ``refdml reproduce`` uses.

Training labels are re-indexed to ``0 .. C - 1`` (sorted class ids) for the objectives
with per-class parameters (proxies, class embeddings); validation and test keep their ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import check_choice
from refdml.train._layer import Sequential
from refdml.train.config import (  # noqa: F401  (_check_value: refdml train's flag checks)
    KEYS,
    STUDIES,
    RunConfig,
    _check_value,
    default_config,
    effective_config,
    resolve_config,
)
from refdml.train.data import (
    PKBatchSampler,
    class_disjoint_split,
    clip_token_table,
    load_features,
    make_digits_collage,
    make_glyph_collages,
    make_glyphs,
    make_token_splits,
)
from refdml.train.models import build_run_model, embedding_layer_parameters
from refdml.train.objectives import Objective
from refdml.train.optim import Adam
from refdml.train.schedules import ReduceOnPlateau
from refdml.train.trainer import Trainer

__all__ = ["STUDIES", "KEYS", "Run", "DeviceUnavailable", "build_optimizer", "build_run",
           "default_config",
           "effective_config", "check_device"]


def build_optimizer(model, objective, *, lr: float, betas=(0.9, 0.999),
                    weight_decay: float = 0.0, proxy_lr_multiplier: float = 1.0,
                    warmup_epochs: int = 0) -> tuple[Adam, list | None]:
    """The papers' optimiser (GSP supp., ASAP App. A.2) and the parameters of its warm-up.

    Adam with ``betas`` and coupled ``weight_decay``; the objective's parameters (proxies,
    class embeddings), when it has any, in a group of their own at ``proxy_lr_multiplier``
    times ``lr``. Returns ``(optimizer, warmup_params)``: with ``warmup_epochs > 0`` the
    embedding layer (:func:`~refdml.train.models.embedding_layer_parameters`) and the
    objective's parameters, the ones a warm-up trains (``TrainingLoop(warmup_params=...)``);
    None without a warm-up."""
    objective_params = list(objective.parameters())
    groups = [{"params": list(model.parameters()), "name": "model"}]
    if objective_params:
        groups.append({"params": objective_params, "lr_multiplier": proxy_lr_multiplier,
                       "name": "objective"})
    optimizer = Adam(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    warmup_params = ([*embedding_layer_parameters(model), *objective_params]
                     if warmup_epochs else None)
    return optimizer, warmup_params


class DeviceUnavailable(RuntimeError):
    """``device = "cuda"`` without CuPy or without a CUDA device."""


def check_device(device: str) -> None:
    """Raise :class:`DeviceUnavailable` unless ``device`` can run here."""
    check_choice(device, "device", ("cpu", "cuda"))
    if device != "cuda":
        return
    try:
        import cupy
    except ImportError:
        raise DeviceUnavailable(
            "device == 'cuda' needs CuPy (install the wheel matching your CUDA, e.g. "
            "cupy-cuda12x); it is not installed. Use device = 'cpu'.") from None
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy raises its own CUDARuntimeError without a driver
        raise DeviceUnavailable(f"device == 'cuda': CuPy sees no CUDA device ({exc})") from None
    if n < 1:
        raise DeviceUnavailable("device == 'cuda': CuPy sees no CUDA device")


@dataclass
class Run:
    """A ready run: ``trainer.fit()`` trains; ``config`` is the effective config (typed:
    ``config.as_dict()`` is what ``config.json`` records under ``"run"``, less the study)."""

    study: str
    config: RunConfig
    trainer: Trainer
    model: Sequential
    objective: Objective
    collage: Any = None          # DigitsCollage / GlyphCollages (class-cell masks for attention)
    data: Any = None             # the study's data: TokenSplits, DigitsCollage, Glyphs,
                                 # GlyphCollages (None for features)


def _reindex(labels: np.ndarray) -> tuple[np.ndarray, int]:
    classes = np.unique(labels)
    return np.searchsorted(classes, labels).astype(np.int64), int(classes.shape[0])


def _load_features(c: RunConfig, dtype) -> Any:
    """:func:`load_features` of the config's ``features``, its errors naming that key."""
    path = c.features
    try:
        return load_features(path, features_key=c.features_key, labels_key=c.labels_key,
                             dtype=dtype)
    except FileNotFoundError:
        raise FileNotFoundError(f"features == {path!r}: no such file") from None
    except KeyError as error:   # an array key the archive lacks: a bad value, not a lookup
        raise ValueError(f"features: {error.args[0]}") from None
    except (TypeError, ValueError) as error:
        kind = TypeError if isinstance(error, TypeError) else ValueError
        raise kind(f"features: {error}") from None


def _glyph_options(c: RunConfig) -> dict[str, Any]:
    """The keywords of :func:`~refdml.train.data.make_glyphs` a glyph study's config gives."""
    return {"size": c.glyph_size, "max_classes": c.max_classes,
            "instances_per_font": c.instances_per_font,
            "eval_instances_per_font": c.eval_instances_per_font}


def build_run(study: str, config: dict[str, Any] | RunConfig | None = None, *,
              out_dir: Any) -> Run:
    """Assemble the data, model, objective, optimiser, schedule and trainer of a run.

    ``config``: a dict of config keys (:func:`~refdml.train.config.effective_config` fills
    and checks it) or a :class:`~refdml.train.config.RunConfig` of ``study``.
    Everything random is seeded from ``config["seed"]``: the data (``seed``), the model
    and objective initialisation (``seed + 1``) and the batch sampler (``seed + 2``).
    """
    c = resolve_config(study, config)
    check_device(c.device)
    seed, dtype = c.seed, np.dtype(c.dtype)
    n_tokens = feature_dim = collage = data = None
    if study == "tokens":
        splits = make_token_splits(
            rng=seed, n_train_per_class=c.n_train_per_class, n_val_per_class=c.n_val_per_class,
            n_test_per_class=c.n_test_per_class, n_classes=c.n_classes,
            tokens_per_class=c.tokens_per_class, n_background_tokens=c.n_background_tokens,
            tokens_per_sample=c.tokens_per_sample, mixing_mean=c.mixing_mean,
            mixing_std=c.mixing_std)
        train, val, test = ((s.token_ids, s.labels) for s in (splits.train, splits.val,
                                                               splits.test))
        n_tokens, data = splits.train.n_tokens, splits
    elif study == "digits-collage":
        collage = make_digits_collage(rng=seed, collages_per_image=c.collages_per_image,
                                      eval_collages_per_image=c.eval_collages_per_image)
        train, val, test = ((s.images, s.labels) for s in (collage.train, collage.val,
                                                            collage.test))
    elif study == "glyphs":
        data = make_glyphs(rng=seed, **_glyph_options(c))
        train, val, test = ((s.images, s.labels) for s in (data.train, data.val, data.test))
    elif study == "glyph-collage":
        collage = make_glyph_collages(
            rng=seed, grid=c.grid, collages_per_image=c.collages_per_image,
            eval_collages_per_image=c.eval_collages_per_image,
            n_background=tuple(c.n_background), families=tuple(c.families),
            **_glyph_options(c))
        train, val, test = ((s.images, s.labels) for s in (collage.train, collage.val,
                                                            collage.test))
    else:
        fs = _load_features(c, dtype)
        split = class_disjoint_split(fs.labels, rng=seed, fractions=c.split_fractions)
        train, val, test = ((fs.features[i], fs.labels[i]) for i in (split.train, split.val,
                                                                      split.test))
        feature_dim = fs.features.shape[2]
    train_labels, n_classes = _reindex(train[1])
    train = (train[0], train_labels)
    built = build_run_model(c, n_classes=n_classes, rng=np.random.default_rng(seed + 1),
                            n_tokens=n_tokens, feature_dim=feature_dim)
    model, objective, after_step = built.model, built.objective, None
    if built.token_table is not None:
        table = built.token_table.table

        def clip_token_table_after_step() -> None:
            clip_token_table(table.value)

        after_step = clip_token_table_after_step
    optimizer, warmup_params = build_optimizer(
        model, objective, lr=c.lr, betas=c.betas, weight_decay=c.weight_decay,
        proxy_lr_multiplier=c.proxy_lr_multiplier, warmup_epochs=c.warmup_epochs)
    schedule = None
    if c.plateau_factor is not None:
        schedule = ReduceOnPlateau(optimizer, mode="max", factor=c.plateau_factor,
                                   patience=c.plateau_patience)
    if c.n_classes_per_batch > n_classes:
        raise ValueError(f"n_classes_per_batch == {c.n_classes_per_batch}, but the training "
                         f"split has only {n_classes} classes")
    sampler = PKBatchSampler(train[1], n_classes_per_batch=c.n_classes_per_batch,
                             n_samples_per_class=c.n_samples_per_class, rng=seed + 2)
    trainer = Trainer(
        model, objective, optimizer, schedule=schedule, train_sampler=sampler,
        train_data=train, val_data=val, test_data=test, out_dir=out_dir, epochs=c.epochs,
        early_stopping_patience=c.early_stopping_patience,
        early_stopping_min_delta=c.early_stopping_min_delta,
        early_stopping_target=c.early_stopping_target, blas_threads=c.blas_threads,
        side_thread=c.side_thread,
        seed=seed, dtype=dtype, device=c.device, progress=c.progress, after_step=after_step,
        eval_batch_size=c.eval_batch_size, log_every=c.log_every, capture=c.capture,
        run_config={"study": study, **c.as_dict()},
        instance_every=c.instance_every if c.asap else None,
        instance_patience=c.instance_patience if c.asap else None, warmup_epochs=c.warmup_epochs,
        warmup_params=warmup_params)
    return Run(study=study, config=c, trainer=trainer, model=model, objective=objective,
               collage=collage, data=collage if data is None else data)
