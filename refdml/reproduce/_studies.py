r"""The studies a task can run: ``tokens``, ``collage``, ``wdml`` (and the runner's ``toy``).

Every study builds its data, model and objective from ``task.seed`` (data: ``seed``; model
and objective initialisation: ``seed + 1``; batches: ``seed + 2``; ASAP's pools:
``seed + 3``) and the task's settings, trains with :func:`refdml.reproduce._train.fit` in
float32 on the fast path, and returns metrics on the **test** split (classes never seen in
training for the collages), curves per epoch and, for seed 0, small artefacts for figures.
Every metric is of the model of the epoch with the best validation MAP@R
(``val_map_at_r``, on a validation split of its own: ``selected_epoch``), as the papers
recover the parameters with the best validation performance; the curves show every epoch.

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
"""

from __future__ import annotations

import numpy as np

from refdml.reproduce._tasks import Task, study
from refdml.reproduce._train import (
    at_epoch,
    covering_radius,
    embed,
    fit,
    map_at_r,
    map_at_r_from_distances,
)
from refdml.train import (
    GAP,
    GMP,
    Conv2d,
    Embedding,
    GeMean,
    GSPHead,
    L2Normalize,
    Layer,
    Linear,
    LocalLinear,
    ReLU,
    Sequential,
    XMLHistogramHead,
)
from refdml.train.data import (
    clip_token_table,
    init_token_table,
    make_digits_collage,
    make_token_splits,
)
from refdml.train.objectives import (
    ASAPObjective,
    GSPObjective,
    LossObjective,
    WassersteinObjective,
    XMLObjective,
)
from refdml.train.plots import feature_grid, gsp_weights, upsample_weights

DTYPE = np.float32


class TwoBranches(Layer):
    """``x -> ((main(x), side(x)), ctx)``: a two-output layer from two single-output layers.

    XML's model: the GAP branch feeds the embedding, the histogram branch gives ``z``.
    ``backward(ctx, (d_main, d_side))`` adds the two input gradients.
    """

    n_outputs = 2

    def __init__(self, main: Layer, side: Layer, *, name: str = "branches") -> None:
        super().__init__(name)
        self.main, self.side = main, side

    def parameters(self):
        yield from self.main.parameters()
        yield from self.side.parameters()

    def named_parameters(self):
        yield from self.main.named_parameters()
        yield from self.side.named_parameters()

    def forward(self, x):
        a, ca = self.main.forward(x)
        b, cb = self.side.forward(x)
        return (a, b), (ca, cb)

    def backward(self, ctx, d_y):
        d_main, d_side = d_y
        d_x = self.main.backward(ctx[0], d_main)
        if d_side is not None:
            d_x = d_x + self.side.backward(ctx[1], d_side)
        return d_x


# --------------------------------------------------------------------------- tokens
@study("tokens")
def tokens_task(task: Task) -> dict:
    c, seed = task.config, task.seed
    splits = make_token_splits(rng=seed, n_train_per_class=c["n_train_per_class"],
                               n_val_per_class=c["n_val_per_class"],
                               n_test_per_class=c["n_test_per_class"])
    init = np.random.default_rng(seed + 1)
    emb = Embedding(splits.train.n_tokens, c["dim"], rng=init, dtype=DTYPE, name="tokens")
    emb.table.value[...] = init_token_table(splits.train.n_tokens, c["dim"], rng=init,
                                            dtype=DTYPE)
    if task.method == "gap":
        head = GAP()
    elif task.method == "gsp":
        head = GSPHead(c["n_prototypes"], c["dim"], mu=c["mu"],
                       inverse_temperature=c["inverse_temperature"], rng=init, dtype=DTYPE)
    else:
        raise ValueError(f"tokens: method == {task.method!r}, must be 'gap' or 'gsp'")
    model = Sequential([emb, head, Linear(c["dim"], c["embedding_dim"], rng=init, dtype=DTYPE),
                        L2Normalize()])
    objective = LossObjective(c["loss"], dtype=DTYPE)
    test = splits.test

    def evaluate():
        return {split: map_at_r(embed(model, data.token_ids, DTYPE), data.labels)
                for split, data in (("val_map_at_r", splits.val), ("test_map_at_r", test))}

    curves, best = fit(model, objective, splits.train.token_ids, splits.train.labels,
                       epochs=c["epochs"], lr=c["lr"], n_classes_per_batch=16,
                       n_samples_per_class=4, seed=seed, dtype=DTYPE, evaluate=evaluate,
                       after_step=lambda: clip_token_table(emb.table.value),
                       select="val_map_at_r")
    background = ~test.foreground
    if task.method == "gsp":
        _, ctx = model.forward(test.token_ids)
        w = np.asarray(gsp_weights(model, ctx), dtype=np.float64)
    else:
        w = np.ones(background.shape)
    mass = float(((w * background).sum(axis=1) / w.shape[1]).mean())
    return {"metrics": {**at_epoch(curves, best), "background_mass": mass}, "curves": curves}


# --------------------------------------------------------------------------- collage
_HEADS = ("gap", "gmp", "gemean", "gsp")


def _collage_model(method: str, c: dict, init):
    d = c["local_dim"]
    strides = c.get("conv_strides") or [1] * len(c["conv_channels"])
    if len(strides) != len(c["conv_channels"]):
        raise ValueError(f"collage: conv_strides == {strides} needs one stride per entry of "
                         f"conv_channels == {c['conv_channels']}")
    trunk, c_in = [], 1
    for i, (c_out, stride) in enumerate(zip(c["conv_channels"], strides), start=1):
        trunk += [Conv2d(c_in, c_out, stride=stride, rng=init, dtype=DTYPE, name=f"conv{i}"),
                  ReLU(name=f"relu{i}")]
        c_in = c_out
    trunk.append(LocalLinear(c_in, d, rng=init, dtype=DTYPE))
    if method == "gemean":
        # GeM needs non-negative features (refdml.train's GeMean refuses negative ones, and
        # LocalLinear's outputs are signed): GeM pools post-ReLU CNN features.
        trunk.append(ReLU(name="relu3"))
    if method in ("gap", "asap"):
        head = GAP()
    elif method == "gmp":
        head = GMP()
    elif method == "gemean":
        head = GeMean(p=c["gemean_p"])
    elif method in ("gsp", "gsp_zsr"):
        head = GSPHead(c["n_prototypes"], d, mu=c["mu"],
                       inverse_temperature=c["inverse_temperature"], rng=init, dtype=DTYPE)
    elif method == "xml":
        head = TwoBranches(GAP(), XMLHistogramHead(
            c["n_prototypes"], d, inverse_temperature=c["xml_inverse_temperature"], rng=init,
            dtype=DTYPE))
    else:
        raise ValueError(f"collage: method == {method!r}, must be one of "
                         f"{_HEADS + ('gsp_zsr', 'xml', 'asap')}")
    return Sequential([*trunk, head, Linear(d, c["embedding_dim"], rng=init, dtype=DTYPE),
                       L2Normalize()])


def _collage_objective(method: str, c: dict, n_classes: int, init, model):
    loss, dim = c["loss"], c["embedding_dim"]
    proxy = loss in ("proxy_nca", "proxy_anchor")
    if method == "asap":
        return ASAPObjective(loss, n_classes=n_classes, dim=dim,
                             proxies_per_class=c["proxies_per_class"], budget=c["budget"],
                             lambda_=c["asap_lambda"], model_parameters=list(model.parameters()),
                             rng=init, dtype=DTYPE)
    if method == "gsp_zsr":
        return GSPObjective(loss, lambda_=c["zsr_lambda"], ridge=c["ridge"],
                            n_classes=n_classes, attribute_dim=dim, rng=init,
                            base_kwargs={"dim": dim} if proxy else None, dtype=DTYPE)
    if method == "xml":
        if proxy:
            raise ValueError("xml: the XML regulariser needs a loss without proxies")
        return XMLObjective(loss, lambda_=c["xml_lambda"], ridge=c["ridge"], rng=init)
    kwargs = {"n_classes": n_classes, "dim": dim} if proxy else {}
    return LossObjective(loss, rng=init, dtype=DTYPE, **kwargs)


def _transfer_map(model, data, c: dict, seed: int) -> float:
    """``zsr_transfer_map`` (module docstring) on the validation + test classes."""
    x = np.concatenate([data.val.images, data.test.images])
    labels = np.concatenate([data.val.labels, data.test.labels])
    ys, zs = [], []
    for start in range(0, x.shape[0], 512):
        (y, z), _ = model.forward(x[start:start + 512].astype(DTYPE))
        ys.append(np.asarray(y, np.float64))
        zs.append(np.asarray(z, np.float64))
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
        from refdml.metrics import retrieval_metrics
        r = retrieval_metrics(predicted, classes[held], y[keep], labels[keep], k=(1,))
        scores.append(r["mean_average_precision_at_r"])
    return float(np.mean(scores))


def _pca(x: np.ndarray, *others: np.ndarray):
    mean = x.mean(axis=0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    return [((a - mean) @ vt[:2].T).round(4).tolist() for a in (x, *others)]


@study("collage")
def collage_task(task: Task) -> dict:
    c, seed, method = task.config, task.seed, task.method
    data = make_digits_collage(rng=seed, collages_per_image=c["collages_per_image"],
                               eval_collages_per_image=1)
    train_classes = np.unique(data.train.labels)
    train_y = np.searchsorted(train_classes, data.train.labels).astype(np.int64)
    init = np.random.default_rng(seed + 1)
    model = _collage_model(method, c, init)
    objective = _collage_objective(method, c, train_classes.shape[0], init, model)
    owner = objective.base if method == "gsp_zsr" else objective
    proxies = getattr(owner, "proxies", None)
    test = data.test

    def train_embeddings():
        return embed(model, data.train.images, DTYPE)

    def evaluate():
        row = {split: map_at_r(embed(model, part.images, DTYPE), part.labels)
               for split, part in (("val_map_at_r", data.val), ("test_map_at_r", test))}
        if proxies is not None:
            row["covering_radius"] = covering_radius(train_embeddings(), train_y,
                                                     np.asarray(proxies.value),
                                                     owner.proxy_labels)
        return row

    curves, best = fit(model, objective, data.train.images, train_y, epochs=c["epochs"],
                       lr=c["lr"], n_classes_per_batch=8, n_samples_per_class=8, seed=seed,
                       dtype=DTYPE, evaluate=evaluate,
                       instance_every=c["instance_every"] if method == "asap" else None,
                       instance_embed=train_embeddings, select="val_map_at_r")
    metrics = at_epoch(curves, best)           # the model holds the selected epoch's weights
    artefacts = {}
    if method in ("gsp", "gsp_zsr"):
        (_, _), ctx = model.forward(test.images.astype(DTYPE))
        # (N, H' W') weights of mean 1 on the feature grid, as (N, 16, 16) pixel maps
        w = upsample_weights(np.asarray(gsp_weights(model, ctx), dtype=np.float64),
                             feature_grid(model, ctx), test.images.shape[2:])
        w = w.reshape(w.shape[0], -1)
        cell = test.foreground.reshape(test.foreground.shape[0], -1)
        metrics["class_cell_weight"] = float(((w * cell).sum(axis=1) / w.sum(axis=1)).mean())
        metrics["zsr_transfer_map"] = _transfer_map(model, data, c, seed)
        if seed == 0:
            pick = np.arange(0, test.images.shape[0], max(1, test.images.shape[0] // 6))[:6]
            artefacts["attention"] = {"images": test.images[pick, 0].round(3).tolist(),
                                      "weights": w[pick].reshape(-1, 16, 16).round(4).tolist(),
                                      "foreground": test.foreground[pick].tolist(),
                                      "labels": test.labels[pick].tolist()}
    if proxies is not None and seed == 0:
        e = train_embeddings()
        p = np.asarray(proxies.value, dtype=np.float64)
        p = p / np.linalg.norm(p, axis=1, keepdims=True)
        e2, p2 = _pca(e, p)
        artefacts["embedding_2d"] = {"points": e2, "labels": train_y.tolist(), "proxies": p2,
                                     "proxy_labels": np.asarray(owner.proxy_labels).tolist()}
    return {"metrics": metrics, "curves": curves, "artefacts": artefacts}


# --------------------------------------------------------------------------- wdml
@study("wdml")
def wdml_task(task: Task) -> dict:
    c, seed, method = task.config, task.seed, task.method
    splits = make_token_splits(rng=seed, n_train_per_class=c["n_train_per_class"],
                               n_val_per_class=c["n_val_per_class"],
                               n_test_per_class=c["n_test_per_class"],
                               tokens_per_sample=c["tokens_per_sample"])
    init = np.random.default_rng(seed + 1)
    emb = Embedding(splits.train.n_tokens, c["dim"], rng=init, dtype=DTYPE, name="tokens")
    emb.table.value[...] = init_token_table(splits.train.n_tokens, c["dim"], rng=init,
                                            dtype=DTYPE)
    solver = {"eps": c["eps"], "p": 2, "max_iter": c["sinkhorn_iter"], "tol": 0.0}
    if method == "contrastive":
        model = Sequential([emb, GAP(), L2Normalize()])
        objective = LossObjective(method, dtype=DTYPE, neg_margin=c["contrastive_neg_margin"])
    elif method == "triplet":
        model = Sequential([emb, GAP(), L2Normalize()])
        objective = LossObjective(method, dtype=DTYPE, margin=c["triplet_margin"])
    elif method in ("wcontrastive", "wtriplet"):
        model = Sequential([emb])
        objective = WassersteinObjective(method[1:], margin=c[f"{method}_margin"], **solver)
    else:
        raise ValueError(f"wdml: method == {method!r}, must be one of contrastive, triplet, "
                         "wcontrastive, wtriplet")
    wasserstein = method.startswith("w")

    def score(split) -> float:
        if not wasserstein:
            return map_at_r(embed(model, split.token_ids, DTYPE), split.labels)
        from refdml.gpu.ot import pairwise_sinkhorn_divergence

        clouds, _ = model.forward(split.token_ids)
        d = np.asarray(pairwise_sinkhorn_divergence(np.asarray(clouds), **solver))
        return map_at_r_from_distances(d, split.labels)

    def evaluate():
        return {"val_map_at_r": score(splits.val), "test_map_at_r": score(splits.test)}

    curves, best = fit(model, objective, splits.train.token_ids, splits.train.labels,
                       epochs=c["epochs"], lr=c["lr"],
                       n_classes_per_batch=c["n_classes_per_batch"], n_samples_per_class=4,
                       seed=seed, dtype=DTYPE, evaluate=evaluate,
                       after_step=lambda: clip_token_table(emb.table.value),
                       select="val_map_at_r")
    return {"metrics": at_epoch(curves, best), "curves": curves}
