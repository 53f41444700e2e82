r"""The studies a task can run: ``tokens``, ``collage``, ``wdml``, the glyph studies
``glyph``, ``glyph_collage`` and ``glyph_wdml`` (and the runner's ``toy``).

Every study builds its data, model and objective from ``task.seed`` (data: ``seed``; model
and objective initialisation: ``seed + 1``; batches: ``seed + 2``; ASAP's pools:
``seed + 3``) and the task's settings, trains with :func:`refdml.reproduce._train.fit` in
float32 on the fast path, and returns metrics on the **test** split (classes never seen in
training for the collages), curves per epoch and, for seed 0, small artefacts for figures.
Every metric is of the model of the epoch with the best validation MAP@R
(``val_map_at_r``, on a validation split of its own: ``selected_epoch``), as the papers
recover the parameters with the best validation performance; the curves show every epoch
trained. Every study reads the settings that train to a plateau
(:func:`~refdml.reproduce._train.fit`): ``patience`` stops a run after that many epochs
without a new best validation MAP@R, ``plateau_factor`` and ``plateau_patience`` reduce the
learning rate on a plateau, and ASAP starts its next problem instance every
``instance_every`` epochs or, with ``instance_patience`` instead, on a validation plateau
(ASAP Sec. 4.4); without them every run trains all ``epochs`` at one rate. The metrics say
how each run ended (``epochs_trained``, ``stopped_early``, ``still_rising``; ASAP:
``instances``).
The models and objectives come from :mod:`refdml.train.models`, the builders of
:func:`refdml.train.runs.build_run`; :data:`STUDIES` maps each study's name to its function.

``tokens`` (GSP supp. 2.1): ``Embedding -> GAP | GSP -> Linear -> L2Normalize``, token
table clipped to [-0.3, 0.3] after each step, contrastive loss. Metrics: ``test_map_at_r``
and ``background_mass``, the share of the pooling weight on background tokens,
:math:`\frac1N\sum_i \frac1n \sum_{j \in bg(i)} w_{ij}` (GSP's ``w = (1 - n\rho)/\mu``, mean
1; GAP's uniform ``w = 1`` gives the background share of the tokens).

``collage`` (GSP supp. 2.2, XML, ASAP): ``Conv2d -> ReLU -> Conv2d -> ReLU -> LocalLinear``
(``-> ReLU`` for GeMean, which needs non-negative features) then a head and
``Linear -> L2Normalize``. Methods: ``gap``, ``gmp``, ``gemean``, ``gsp``
(the loss alone), ``gsp_zsr`` (GSP + zero-shot regulariser, GSP Alg. 1), ``xml`` (GAP plus
an XML histogram branch, XML Eqs. 2.10-2.11; contrastive only), ``asap`` (GAP, ASAP Alg.
1-2 around the proxy loss). Metrics: ``test_map_at_r``; GSP models: ``class_cell_weight``
(share of the pooling weight in the class image's cell; 1/4 is uniform) and
``zsr_transfer_map`` (below); proxy losses: ``covering_radius`` (train embeddings).

``zsr_transfer_map`` (GSP Sec. 5.1, Fig. 5): on the 8 unseen classes (validation + test),
the class means of the histograms ``z`` and of the embeddings ``y``; for each of
``transfer_repeats`` random halves ``S`` (4 classes), the ridge map
``A = argmin ||Z_S A - Y_S||^2 + ridge ||A||^2`` (the zero-shot regulariser's own fit),
predicted class embeddings ``Z_c A`` for the other half, and the MAP@R of retrieving that
half's samples with the predicted embeddings as queries; the mean over halves.

``wdml`` (WDML): the token study with ``tokens_per_sample`` local features per sample (the
token vectors themselves, the "local features"), ``contrastive`` / ``triplet`` on their
L2-normalised mean, ``wcontrastive`` / ``wtriplet`` (WDML Eqs. 1-2) on the sets, each at
its ``<method>_margin`` (``contrastive_neg_margin`` for the contrastive loss). Retrieval on
the validation split (``val_map_at_r``, which chooses the margins) and the test split ranks
by the distance each method trains: Euclidean between normalised means, or the Sinkhorn
divergence between the token sets (fixed iterations).

``glyph`` (:func:`refdml.train.data.make_glyphs`): ``collage``'s methods and metrics on
single glyphs, plus ``test_recall_at_1``; the transfer MAP@R runs on all the validation and
test classes (about 270, halves of about 135). ``glyph_collage``
(:func:`~refdml.train.data.make_glyph_collages`): the same on glyph collages, with GSP's
``class_cell_weight`` and ``class_cell_ratio`` (the class cell's mean pooling weight over a
distractor cell's; 1 is uniform). ``glyph_wdml``: ``wdml``'s four losses on single glyphs,
the conv trunk's local features being the sets (:func:`glyph_wdml_task`).

``device`` (a setting, ``refdml reproduce --device cuda``): the model and the loop on the
GPU (CuPy); data stay on the host and move per batch; every metric is computed on the host.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from refdml._io import write_text_atomic
from refdml._backend import get_backend, to_numpy
from refdml.reproduce._spec import Task
from refdml.reproduce._train import (
    covering_radius,
    embed,
    fit,
    map_at_r,
    map_at_r_from_distances,
)
from refdml.train.data import (
    clip_token_table,
    make_digits_collage,
    make_glyph_collages,
    make_glyphs,
    make_token_splits,
)
from refdml.train.layers import L2Normalize, Sequential
from refdml.train.models import (
    HeadConfig,
    ObjectiveConfig,
    Placement,
    build_head,
    build_objective,
    build_tail,
    conv_trunk,
    token_embedding,
)
from refdml.train.plots import feature_grid, gsp_weights, upsample_weights

DTYPE = np.float32


@dataclass(frozen=True)
class _On:
    """Where a task's model lives: float32 on the fast path, on the CPU (NumPy) or, with the
    setting ``device == "cuda"`` (``refdml reproduce --device cuda``), on the GPU (CuPy).
    The data stay on the host; :meth:`to` moves an input over, :meth:`host` brings a result
    back as NumPy."""

    device: str = "cpu"

    @classmethod
    def of(cls, task: Task) -> "_On":
        return cls(task.config.get("device", "cpu"))

    @property
    def placement(self) -> Placement:
        return Placement(dtype=np.dtype(DTYPE), device=self.device)

    def to(self, x):
        if self.device == "cpu":
            return x
        import cupy

        return cupy.asarray(x)

    def host(self, x) -> np.ndarray:
        return np.asarray(to_numpy(x), dtype=np.float64)

    def forward(self, model, x):
        """``model.forward`` of host ``x`` (cast to float32 if it is real) on the device."""
        return model.forward(self.to(x.astype(DTYPE) if x.dtype.kind == "f" else x))

    def embed(self, model, x) -> np.ndarray:
        return embed(model, x, DTYPE, device=self.device)


#: The training protocol's settings, passed to :func:`~refdml.reproduce._train.fit` as
#: they are (docs/reproduce.md, "Training protocols").
_PROTOCOL_KEYS = ("betas", "weight_decay", "proxy_lr_multiplier", "warmup_epochs")


def _protocol(c: dict) -> dict:
    """The protocol settings ``c`` gives, as fit's keywords; one it does not give keeps
    fit's default (Adam's (0.9, 0.999), no decay, one learning rate, no warm-up)."""
    return {k: c[k] for k in _PROTOCOL_KEYS if k in c}


def _plateau(c: dict) -> dict:
    """The settings that train to a plateau, as fit's keywords (None where ``c`` does not
    give one: all epochs, one learning rate, as before): ``patience`` (the early stop),
    ``plateau_factor`` and ``plateau_patience`` (reduce the rate on a plateau)."""
    return {"patience": c.get("patience"), "plateau_factor": c.get("plateau_factor"),
            "plateau_patience": c.get("plateau_patience")}


# --------------------------------------------------------------------------- tokens
def tokens_task(task: Task) -> dict:
    c, seed, on = task.config, task.seed, _On.of(task)
    splits = make_token_splits(rng=seed, n_train_per_class=c["n_train_per_class"],
                               n_val_per_class=c["n_val_per_class"],
                               n_test_per_class=c["n_test_per_class"])
    if task.method not in ("gap", "gsp"):
        raise ValueError(f"tokens: method == {task.method!r}, must be 'gap' or 'gsp'")
    init = np.random.default_rng(seed + 1)
    emb = token_embedding(splits.train.n_tokens, c["dim"], rng=init, placement=on.placement)
    head = HeadConfig(kind=task.method, n_prototypes=c["n_prototypes"], mu=c["mu"],
                      inverse_temperature=c["inverse_temperature"])
    model = Sequential([emb, *build_head(head, c["dim"], rng=init, placement=on.placement),
                        *build_tail(c["dim"], embedding_dim=c["embedding_dim"], rng=init,
                                    placement=on.placement)])
    objective = build_objective(
        ObjectiveConfig(kind="loss", loss=c["loss"], embedding_dim=c["embedding_dim"]),
        np.unique(splits.train.labels).size, rng=init, placement=on.placement)
    test = splits.test

    def evaluate():
        return {split: map_at_r(on.embed(model, data.token_ids), data.labels)
                for split, data in (("val_map_at_r", splits.val), ("test_map_at_r", test))}

    fitted = fit(model, objective, splits.train.token_ids, splits.train.labels,
                 epochs=c["epochs"], lr=c["lr"],
                 n_classes_per_batch=c.get("n_classes_per_batch", 16),
                 n_samples_per_class=c.get("n_samples_per_class", 4), seed=seed,
                 dtype=DTYPE, evaluate=evaluate,
                 after_step=lambda: clip_token_table(emb.table.value),
                 select="val_map_at_r", device=on.device, **_plateau(c), **_protocol(c))
    background = ~test.foreground
    if task.method == "gsp":
        _, ctx = on.forward(model, test.token_ids)
        w = on.host(gsp_weights(model, ctx))
    else:
        w = np.ones(background.shape)
    mass = float(((w * background).sum(axis=1) / w.shape[1]).mean())
    return {"metrics": {**fitted.metrics(), "background_mass": mass}, "curves": fitted.curves}


# --------------------------------------------------------------------------- collage
#: A collage method's head and objective kinds. ``asap``: ASAP around the setting ``loss``
#: (a pair loss, ``contrastive`` or ``multi_similarity``, between samples and several
#: proxies per class, as the paper runs it; or a proxy loss); ``proxy``: its counterpart with
#: one proxy per class, no alternation and no regulariser (the same loss between samples
#: and proxies); ``gap``: the loss on the batch's own pairs.
_COLLAGE_METHODS = {"gap": ("gap", "loss"), "gmp": ("gmp", "loss"),
                    "gemean": ("gemean", "loss"), "gsp": ("gsp", "loss"),
                    "gsp_zsr": ("gsp", "zero_shot"), "xml": ("xml", "xml"),
                    "asap": ("gap", "asap"), "proxy": ("gap", "proxy")}


def _collage_configs(method: str, c: dict) -> tuple[HeadConfig, ObjectiveConfig]:
    """The head and the objective of a collage ``method`` with the task's settings ``c``."""
    if method not in _COLLAGE_METHODS:
        raise ValueError(f"collage: method == {method!r}, must be one of "
                         f"{tuple(_COLLAGE_METHODS)}")
    head_kind, objective_kind = _COLLAGE_METHODS[method]
    # .get: a setting the method does not read may be absent (a missing one it reads is
    # None, which the layer or objective refuses, naming it)
    head = HeadConfig(
        kind=head_kind, n_prototypes=c.get("n_prototypes"), mu=c.get("mu"),
        gemean_p=c.get("gemean_p"),
        inverse_temperature=c.get("xml_inverse_temperature" if head_kind == "xml"
                                  else "inverse_temperature"))
    lambda_ = {"zero_shot": c.get("zsr_lambda"), "xml": c.get("xml_lambda")}.get(objective_kind)
    objective = ObjectiveConfig(
        kind=objective_kind, loss=c["loss"], embedding_dim=c["embedding_dim"], lambda_=lambda_,
        ridge=c.get("ridge"), proxies_per_class=c.get("proxies_per_class"),
        budget=c.get("budget"), asap_lambda=c.get("asap_lambda"),
        pos_margin=c.get("pos_margin"), neg_margin=c.get("neg_margin"),
        reduction=c.get("reduction"))
    return head, objective


def _collage_model(head: HeadConfig, c: dict, init, placement: Placement) -> Sequential:
    d = c["local_dim"]
    strides = c.get("conv_strides") or [1] * len(c["conv_channels"])
    return Sequential([
        *conv_trunk(c["conv_channels"], strides, d, rng=init, placement=placement),
        *build_head(head, d, rng=init, placement=placement),
        *build_tail(d, embedding_dim=c["embedding_dim"], rng=init, placement=placement)])


def _transfer_map(model, data, c: dict, seed: int, on: _On) -> float:
    """``zsr_transfer_map`` (module docstring) on the validation + test classes."""
    x = np.concatenate([data.val.images, data.test.images])
    labels = np.concatenate([data.val.labels, data.test.labels])
    ys, zs = [], []
    for start in range(0, x.shape[0], 512):
        (y, z), _ = on.forward(model, x[start:start + 512])
        ys.append(on.host(y))
        zs.append(on.host(z))
    y, z = np.concatenate(ys), np.concatenate(zs)
    classes = np.unique(labels)
    z_mean = np.stack([z[labels == k].mean(axis=0) for k in classes])
    y_mean = np.stack([y[labels == k].mean(axis=0) for k in classes])
    rng = np.random.default_rng([seed, 7])
    scores = []
    m = z.shape[1]
    for _ in range(c["transfer_repeats"]):
        perm = rng.permutation(classes.shape[0])
        fit_idx, held = perm[: classes.shape[0] // 2], perm[classes.shape[0] // 2:]
        zs_, ys_ = z_mean[fit_idx], y_mean[fit_idx]
        a = np.linalg.solve(zs_.T @ zs_ + c["ridge"] * np.eye(m), zs_.T @ ys_)
        predicted = z_mean[held] @ a
        keep = np.isin(labels, classes[held])
        from refdml.gpu.metrics import retrieval_metrics
        r = retrieval_metrics(predicted, classes[held], y[keep], labels[keep], k=(1,))
        scores.append(r["mean_average_precision_at_r"])
    return float(np.mean(scores))


def _pca(x: np.ndarray, *others: np.ndarray):
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    return [((a - mean) @ vt[:2].T).round(4).tolist() for a in (x, *others)]


def _retrieval(model, part, prefix: str, on: _On, *, recall: bool = False) -> dict[str, float]:
    """``<prefix>map_at_r`` (and ``<prefix>recall_at_1``) of same-split retrieval."""
    from refdml.gpu.metrics import retrieval_metrics

    r = retrieval_metrics(on.embed(model, part.images), part.labels, k=(1,))
    row = {f"{prefix}map_at_r": float(r["mean_average_precision_at_r"])}
    if recall:
        row[f"{prefix}recall_at_1"] = float(r["recall_at_1"])
    return row


def collage_task(task: Task) -> dict:
    c = task.config
    data = make_digits_collage(rng=task.seed, collages_per_image=c["collages_per_image"],
                               eval_collages_per_image=1)
    return _collage_study(task, data)


def glyph_collage_task(task: Task) -> dict:
    """``collage`` on glyph collages (:func:`refdml.train.data.make_glyph_collages`)."""
    c = task.config
    data = make_glyph_collages(rng=task.seed, collages_per_image=c["collages_per_image"],
                               n_background=tuple(c["n_background"]),
                               families=tuple(c.get("families", ())), **_glyph_options(c))
    return _collage_study(task, data, recall=True)


def _glyph_options(c: dict) -> dict:
    return {"size": c["glyph_size"], "max_classes": c["max_classes"],
            "instances_per_font": c["instances_per_font"],
            "eval_instances_per_font": c["eval_instances_per_font"]}


def glyph_task(task: Task) -> dict:
    """``collage``'s methods on single glyphs (:func:`refdml.train.data.make_glyphs`)."""
    return _collage_study(task, make_glyphs(rng=task.seed, **_glyph_options(task.config)),
                          recall=True)


def _collage_study(task: Task, data, *, recall: bool = False) -> dict:
    c, seed, method, on = task.config, task.seed, task.method, _On.of(task)
    train_classes = np.unique(data.train.labels)
    train_y = np.searchsorted(train_classes, data.train.labels).astype(np.int64)
    head, objective_config = _collage_configs(method, c)
    init = np.random.default_rng(seed + 1)
    model = _collage_model(head, c, init, on.placement)
    objective = build_objective(objective_config, train_classes.shape[0], rng=init,
                                placement=on.placement, model_parameters=model.parameters())
    owner = objective.base if method == "gsp_zsr" else objective
    proxies = getattr(owner, "proxies", None)
    test = data.test

    def train_embeddings():
        return on.embed(model, data.train.images)

    def evaluate():
        row = {**_retrieval(model, data.val, "val_", on),
               **_retrieval(model, test, "test_", on, recall=recall)}
        if proxies is not None:
            row["covering_radius"] = covering_radius(train_embeddings(), train_y,
                                                     on.host(proxies.value),
                                                     to_numpy(owner.proxy_labels))
        return row

    asap = method == "asap"
    if asap and (c.get("instance_every") is None) == (c.get("instance_patience") is None):
        raise ValueError(f"asap needs exactly one of the settings instance_every == "
                         f"{c.get('instance_every')!r} and instance_patience == "
                         f"{c.get('instance_patience')!r} (when a new problem instance starts)")
    fitted = fit(model, objective, data.train.images, train_y, epochs=c["epochs"],
                 lr=c["lr"], n_classes_per_batch=c.get("n_classes_per_batch", 8),
                 n_samples_per_class=c.get("n_samples_per_class", 8), seed=seed,
                 dtype=DTYPE, evaluate=evaluate,
                 instance_every=c.get("instance_every") if asap else None,
                 instance_patience=c.get("instance_patience") if asap else None,
                 # on the GPU the loop's own embeddings (on the device)
                 instance_embed=train_embeddings if on.device == "cpu" else None,
                 select="val_map_at_r", device=on.device, **_plateau(c), **_protocol(c))
    curves = fitted.curves
    metrics = fitted.metrics()           # the model holds the selected epoch's weights
    artefacts = {}
    if method in ("gsp", "gsp_zsr"):
        if hasattr(test, "foreground"):      # collages: where the pooling weight goes
            metrics.update(_cell_weights(model, test, on, artefacts if seed == 0 else None))
        metrics["zsr_transfer_map"] = _transfer_map(model, data, c, seed, on)
    if proxies is not None and seed == 0:
        e = train_embeddings()
        p = on.host(proxies.value)
        p = p / np.linalg.norm(p, axis=1, keepdims=True)
        e2, p2 = _pca(e, p)
        artefacts["embedding_2d"] = {"points": e2, "labels": train_y.tolist(), "proxies": p2,
                                     "proxy_labels": to_numpy(owner.proxy_labels).tolist()}
    return {"metrics": metrics, "curves": curves, "artefacts": artefacts}


def _cell_weights(model, test, on: _On, artefacts: dict | None) -> dict[str, float]:
    """GSP's pooling weight on the class cell against the distractor cells, on the test
    collages: ``class_cell_weight`` (the class cell's share of the weight mass; uniform:
    1 / cells) and ``class_cell_ratio`` (the class cell's mean weight over a distractor
    cell's; uniform: 1). With ``artefacts``, six attention maps go in it."""
    parts = []
    for start in range(0, test.images.shape[0], 512):
        (_, _), ctx = on.forward(model, test.images[start:start + 512])
        parts.append(upsample_weights(on.host(gsp_weights(model, ctx)),
                                      feature_grid(model, ctx), test.images.shape[2:]))
    w = np.concatenate(parts)
    side = test.images.shape[2:]
    w = w.reshape(w.shape[0], -1)
    cell = test.foreground.reshape(test.foreground.shape[0], -1)
    share = (w * cell).sum(axis=1) / w.sum(axis=1)
    n_cells = round(1.0 / cell.mean())
    ratio = share / np.maximum((1.0 - share) / (n_cells - 1), 1e-300)
    if artefacts is not None:
        pick = np.arange(0, test.images.shape[0], max(1, test.images.shape[0] // 6))[:6]
        artefacts["attention"] = {"images": test.images[pick, 0].round(3).tolist(),
                                  "weights": w[pick].reshape(-1, *side).round(4).tolist(),
                                  "foreground": test.foreground[pick].tolist(),
                                  "labels": test.labels[pick].tolist()}
    return {"class_cell_weight": float(share.mean()), "class_cell_ratio": float(ratio.mean())}


# --------------------------------------------------------------------------- wdml
def wdml_task(task: Task) -> dict:
    c, seed, method, on = task.config, task.seed, task.method, _On.of(task)
    splits = make_token_splits(rng=seed, n_train_per_class=c["n_train_per_class"],
                               n_val_per_class=c["n_val_per_class"],
                               n_test_per_class=c["n_test_per_class"],
                               tokens_per_sample=c["tokens_per_sample"])
    solver = {"eps": c["eps"], "p": 2, "max_iter": c["sinkhorn_iter"], "tol": 0.0}
    if method == "contrastive":
        spec = ObjectiveConfig(kind="loss", loss=method, neg_margin=c["contrastive_neg_margin"])
    elif method == "triplet":
        spec = ObjectiveConfig(kind="loss", loss=method, margin=c["triplet_margin"])
    elif method in ("wcontrastive", "wtriplet"):
        spec = ObjectiveConfig(kind="wasserstein", loss=method[1:],
                               margin=c[f"{method}_margin"], **solver)
    else:
        raise ValueError(f"wdml: method == {method!r}, must be one of contrastive, triplet, "
                         "wcontrastive, wtriplet")
    wasserstein = method.startswith("w")
    init = np.random.default_rng(seed + 1)
    emb = token_embedding(splits.train.n_tokens, c["dim"], rng=init, placement=on.placement)
    # the Wasserstein losses compare the token sets themselves: no pooling
    model = Sequential([emb] if wasserstein else [
        emb, *build_head(HeadConfig(kind="gap"), c["dim"], rng=init, placement=on.placement),
        *build_tail(c["dim"], embedding_dim=None, rng=init, placement=on.placement)])
    objective = build_objective(spec, np.unique(splits.train.labels).size, rng=init,
                                placement=on.placement)

    def score(split) -> float:
        if not wasserstein:
            return map_at_r(on.embed(model, split.token_ids), split.labels)
        from refdml.gpu.ot import pairwise_sinkhorn_divergence

        clouds, _ = on.forward(model, split.token_ids)
        d = on.host(pairwise_sinkhorn_divergence(clouds, **solver))
        return map_at_r_from_distances(d, split.labels)

    def evaluate():
        return {"val_map_at_r": score(splits.val), "test_map_at_r": score(splits.test)}

    fitted = fit(model, objective, splits.train.token_ids, splits.train.labels,
                 epochs=c["epochs"], lr=c["lr"],
                 n_classes_per_batch=c["n_classes_per_batch"], n_samples_per_class=4,
                 seed=seed, dtype=DTYPE, evaluate=evaluate,
                 after_step=lambda: clip_token_table(emb.table.value),
                 select="val_map_at_r", device=on.device, **_plateau(c), **_protocol(c))
    return {"metrics": fitted.metrics(), "curves": fitted.curves}


def _wdml_objective(method: str, c: dict) -> ObjectiveConfig:
    solver = {"eps": c["eps"], "p": 2, "max_iter": c["sinkhorn_iter"], "tol": 0.0}
    if method == "contrastive":
        return ObjectiveConfig(kind="loss", loss=method, neg_margin=c["contrastive_neg_margin"])
    if method == "triplet":
        return ObjectiveConfig(kind="loss", loss=method, margin=c["triplet_margin"])
    if method in ("wcontrastive", "wtriplet"):
        return ObjectiveConfig(kind="wasserstein", loss=method[1:],
                               margin=c[f"{method}_margin"], **solver)
    raise ValueError(f"wdml: method == {method!r}, must be one of contrastive, triplet, "
                     "wcontrastive, wtriplet")


def _eval_subset(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """At most ``per_class`` samples of every class (seeded), sorted: the Sinkhorn
    retrieval costs (samples)^2 divergences."""
    rng = np.random.default_rng([seed, 11])
    keep = [rng.permutation(np.flatnonzero(labels == k))[:per_class] for k in np.unique(labels)]
    return np.sort(np.concatenate(keep))


def glyph_wdml_task(task: Task) -> dict:
    """``wdml`` on single glyphs: the conv trunk's local features (B, n, d) are the sets;
    the Wasserstein losses take them L2-normalised per feature (so that the squared costs
    lie in [0, 4] and ``eps`` has one meaning for every model), the contrastive and
    triplet losses their mean through ``L2Normalize``. Retrieval on at most
    ``eval_per_class`` samples per class (the same subset for every method); the test
    split is scored once, at the selected epoch."""
    c, seed, method, on = task.config, task.seed, task.method, _On.of(task)
    data = make_glyphs(rng=seed, **_glyph_options(c))
    spec = _wdml_objective(method, c)
    wasserstein = method.startswith("w")
    train_classes = np.unique(data.train.labels)
    train_y = np.searchsorted(train_classes, data.train.labels).astype(np.int64)
    init = np.random.default_rng(seed + 1)
    d = c["local_dim"]
    trunk = conv_trunk(c["conv_channels"], c["conv_strides"], d, rng=init,
                       placement=on.placement)
    # A local feature is exactly zero where its receptive field gives ReLU(.) = 0 and the
    # bias is 0 (its initial value): L2Normalize refuses it. A nonzero initial bias (the
    # same in every method of a seed) makes an exact zero a coincidence of measure zero.
    bias = trunk[-1].bias.value
    bias[...] = on.to(np.random.default_rng([seed, 5]).normal(0.0, 0.1, size=d).astype(DTYPE))
    model = Sequential([*trunk, L2Normalize()] if wasserstein else [
        *trunk, *build_head(HeadConfig(kind="gap"), d, rng=init, placement=on.placement),
        *build_tail(d, embedding_dim=None, rng=init, placement=on.placement)])
    objective = build_objective(spec, train_classes.size, rng=init, placement=on.placement)
    solver = {"eps": c["eps"], "p": 2, "max_iter": c["sinkhorn_iter"], "tol": 0.0}
    subsets = {name: _eval_subset(part.labels, c["eval_per_class"], seed)
               for name, part in (("val", data.val), ("test", data.test))}

    def score(name: str, part) -> float:
        keep = subsets[name]
        x, labels = part.images[keep], part.labels[keep]
        if not wasserstein:
            return map_at_r(on.embed(model, x), labels)
        from refdml.gpu.ot import pairwise_sinkhorn_divergence

        clouds = [on.forward(model, x[i:i + 512])[0] for i in range(0, x.shape[0], 512)]
        xp = get_backend(clouds[0]).xp
        distances = on.host(pairwise_sinkhorn_divergence(xp.concatenate(clouds), **solver))
        return map_at_r_from_distances(distances, labels)

    # The untrained model's test MAP@R: the competence gate's level for the baselines, and
    # for every run the level its learning curve is drawn against.
    untrained = score("test", data.test)
    fitted = fit(model, objective, data.train.images, train_y, epochs=c["epochs"],
                 lr=c["lr"], n_classes_per_batch=c["n_classes_per_batch"],
                 n_samples_per_class=c["n_samples_per_class"], seed=seed, dtype=DTYPE,
                 evaluate=lambda: {"val_map_at_r": score("val", data.val)},
                 select="val_map_at_r", device=on.device, **_plateau(c), **_protocol(c))
    curves = fitted.curves
    metrics = fitted.metrics()
    metrics["test_map_at_r"] = score("test", data.test)
    metrics["untrained_test_map_at_r"] = untrained
    return {"metrics": metrics, "curves": curves}


# --------------------------------------------------------------------------- toy
def _toy(task: Task) -> dict:
    """Deterministic numbers from the seed (no training): the runner's test double.

    settings: ``shift`` (added to the metric), ``fail_seed`` (this seed raises
    RuntimeError), ``kill_marker`` (a path: if it does not exist, create it and kill this
    process, once), ``sleep`` (seconds), ``probe_environ`` (a list of environment variable
    names: metric ``environ:NAME`` is 1.0 where NAME is set in this process, else 0.0).
    """
    c = task.config
    if c.get("sleep"):
        time.sleep(float(c["sleep"]))
    marker = c.get("kill_marker")
    if marker and task.seed == c.get("kill_seed", task.seed) and not os.path.exists(marker):
        write_text_atomic(marker, str(os.getpid()))
        os._exit(1)  # the worker process dies: the scheduler must run the task elsewhere
    if c.get("fail_seed") == task.seed:
        raise RuntimeError(f"toy task failed on purpose (seed {task.seed})")
    rng = np.random.default_rng([task.seed, sum(map(ord, task.method))])
    value = float(rng.normal()) + float(c.get("shift", 0.0))
    metrics = {"value": value}
    for name in c.get("probe_environ", ()):
        metrics[f"environ:{name}"] = float(name in os.environ)
    return {"metrics": metrics, "curves": {"value": list(np.cumsum(rng.normal(size=3)))}}


#: study name -> function(task) -> dict (metrics, curves, artefacts): what a task's
#: ``study`` names (:func:`refdml.reproduce._tasks.execute` looks it up here).
STUDIES: dict[str, Callable[[Task], dict]] = {
    "tokens": tokens_task,
    "collage": collage_task,
    "glyph_collage": glyph_collage_task,
    "glyph": glyph_task,
    "glyph_wdml": glyph_wdml_task,
    "wdml": wdml_task,
    "toy": _toy,
}
