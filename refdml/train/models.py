r"""The models and objectives of refdml.train's runs and of ``refdml reproduce``, built in one place.

A model is a trunk (a token table, a conv trunk, or nothing for given local features), a
pooling head and a tail (``Linear -> L2Normalize``). The head and the objective are
described by two small frozen dataclasses, :class:`HeadConfig` and :class:`ObjectiveConfig`,
and the arrays' dtype, device and implementation by :class:`Placement`;
:func:`run_head_config`, :func:`run_objective_config` and :func:`run_placement` read them
off a :class:`~refdml.train.config.RunConfig`, and :mod:`refdml.reproduce` writes its own
from a task's method and settings.

Every builder draws its initial values from the ``rng`` it is given, in the order the
layers appear (trunk, head, tail, then the objective), so a model is a function of the
config and the generator's state.

Heads (``HeadConfig.kind``): ``gap``, ``gmp``, ``gemean`` (after a ReLU: GeM takes
non-negative features, as in the CNNs it comes from, and every trunk's local features can be
negative), ``gsp`` (GSP Alg. 2), ``xml`` (GAP for the embedding beside XML's histogram
branch, Eq. 2.4, for the cross-batch term: :class:`TwoBranches`).

Objectives (``ObjectiveConfig.kind``): ``loss`` (:class:`LossObjective`), ``proxy`` (the
loss against one proxy per class: a proxy loss, or a pair loss's form between samples and
proxies, ``contrastive`` -> :func:`refdml.losses.proxy_contrastive`; no alternation, no
regulariser: ASAP's one-proxy-per-class counterpart), ``zero_shot``
(GSP Alg. 1: :class:`GSPObjective`), ``asap`` (ASAP Alg. 1-2: :class:`ASAPObjective`),
``xml`` (XML Eqs. 2.10-2.11: :class:`XMLObjective`), ``wasserstein`` (WDML Eqs. 1-2 on local
features: :class:`WassersteinObjective`, ``loss`` ``contrastive`` or ``triplet``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import _describe, check_choice
from refdml.train._parameter import Parameter
from refdml.train._conv import Conv2d, LocalLinear
from refdml.train._dense import Embedding, Linear, ReLU
from refdml.train._heads import GAP, GMP, GeMean, GSPHead, L2Normalize, XMLHistogramHead
from refdml.train._layer import Layer, Sequential
from refdml.train.config import RunConfig
from refdml.train.data import init_token_table
from refdml.train.objectives import (
    PROXY_LOSSES,
    ASAPObjective,
    GSPObjective,
    LossObjective,
    Objective,
    WassersteinObjective,
    XMLObjective,
    proxy_loss_name,
)

__all__ = ["HEAD_KINDS", "OBJECTIVE_KINDS", "HeadConfig", "ObjectiveConfig", "Placement",
           "RunModel", "TwoBranches", "build_head", "build_objective", "build_run_model",
           "build_tail", "conv_trunk", "embedding_layer_parameters", "run_head_config",
           "run_objective_config", "run_placement", "token_embedding"]

HEAD_KINDS = ("gap", "gmp", "gemean", "gsp", "xml")
OBJECTIVE_KINDS = ("loss", "proxy", "zero_shot", "asap", "xml", "wasserstein")


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a model's arrays live and which operators run: ``dtype`` (float32 or float64),
    ``device`` (``"cpu"`` or ``"cuda"``) and ``reference`` (the float64 NumPy reference
    operators instead of the :mod:`refdml.gpu` mirrors)."""

    dtype: Any
    device: str = "cpu"
    reference: bool = False


@dataclass(frozen=True, kw_only=True)
class HeadConfig:
    """A pooling head: ``kind`` (:data:`HEAD_KINDS`) and the settings that kind reads.

    ``n_prototypes``, ``inverse_temperature``: ``gsp`` and ``xml`` (the histogram's);
    ``mu``: ``gsp``; ``gemean_p``: ``gemean``.
    """

    kind: str
    n_prototypes: int | None = None
    mu: float | None = None
    inverse_temperature: float | None = None
    gemean_p: float | None = None


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """An objective: ``kind`` (:data:`OBJECTIVE_KINDS`) around the loss ``loss``.

    ``embedding_dim``: the proxies' and class embeddings' width. ``pos_margin``,
    ``neg_margin``, ``margin``, ``reduction``: the loss's own hyperparameters, passed when
    not ``None`` (``margin``: the triplet's, or the Wasserstein losses' ``gamma``; ``asap``
    and ``proxy`` pass them to their loss too). ``lambda_``,
    ``ridge``: ``zero_shot`` and ``xml``; ``zero_shot_scale``: ``zero_shot``;
    ``proxies_per_class``, ``budget``, ``asap_lambda``: ``asap``; ``eps``, ``p``,
    ``max_iter``, ``tol``: ``wasserstein``'s Sinkhorn solver.
    """

    kind: str
    loss: str
    embedding_dim: int | None = None
    pos_margin: float | None = None
    neg_margin: float | None = None
    margin: float | None = None
    reduction: str | None = None
    lambda_: float | None = None
    ridge: float | None = None
    zero_shot_scale: float = 9.5
    proxies_per_class: int | None = None
    budget: int | None = None
    asap_lambda: float | None = None
    eps: float | None = None
    p: float = 1.0
    max_iter: int = 1000
    tol: float = 1e-9


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


# --------------------------------------------------------------------------- trunks
def _xp(device: str):
    if device == "cpu":
        return np
    import cupy  # only a device == "cuda" run gets here (checked by the caller)

    return cupy


def token_embedding(n_tokens: int, dim: int, *, rng, placement: Placement) -> Embedding:
    """The trainable token table (``"tokens"``), drawn uniformly in [-0.3, 0.3]
    (:func:`~refdml.train.data.init_token_table`) after the Embedding's own draw."""
    embedding = Embedding(n_tokens, dim, rng=rng, dtype=placement.dtype,
                          device=placement.device, name="tokens")
    embedding.table.value[...] = init_token_table(n_tokens, dim, rng=rng, dtype=placement.dtype,
                                                  xp=_xp(placement.device))
    return embedding


def conv_trunk(channels: Sequence[int], strides: Sequence[int], local_dim: int, *, rng,
               placement: Placement) -> list[Layer]:
    """``Conv2d -> ReLU`` per entry of ``channels`` (one input channel), then
    ``LocalLinear(channels[-1], local_dim)``: local features ``(B, H' W', local_dim)``."""
    if len(strides) != len(channels):
        raise ValueError(f"conv_strides == {list(strides)} needs one stride per entry of "
                         f"conv_channels == {list(channels)}")
    layers: list[Layer] = []
    c_in = 1
    for i, (c_out, stride) in enumerate(zip(channels, strides), start=1):
        # The first convolution's input is the data: no gradient of it is needed.
        layers += [Conv2d(c_in, c_out, stride=stride, rng=rng, dtype=placement.dtype,
                          device=placement.device, name=f"conv{i}", input_grad=i > 1),
                   ReLU() if i == 1 else ReLU(name=f"relu{i}")]
        c_in = c_out
    layers.append(LocalLinear(c_in, local_dim, rng=rng, dtype=placement.dtype,
                              device=placement.device))
    return layers


# --------------------------------------------------------------------------- head, tail
def build_head(head: HeadConfig, d: int, *, rng, placement: Placement) -> list[Layer]:
    """The pooling head's layers on local features of width ``d``."""
    kind = check_choice(head.kind, "head", HEAD_KINDS)
    if kind == "gap":
        return [GAP()]
    if kind == "gmp":
        return [GMP()]
    if kind == "gemean":
        return [ReLU(name="relu_gemean"), GeMean(p=head.gemean_p)]
    if kind == "gsp":
        return [GSPHead(head.n_prototypes, d, mu=head.mu,
                        inverse_temperature=head.inverse_temperature,
                        reference=placement.reference, rng=rng, dtype=placement.dtype,
                        device=placement.device)]
    return [TwoBranches(GAP(), XMLHistogramHead(
        head.n_prototypes, d, inverse_temperature=head.inverse_temperature,
        reference=placement.reference, rng=rng, dtype=placement.dtype,
        device=placement.device))]


def build_tail(d: int, *, embedding_dim: int | None, l2_normalize: bool = True, rng,
               placement: Placement) -> list[Layer]:
    """``Linear(d, embedding_dim)`` (none where ``embedding_dim`` is None), then
    ``L2Normalize`` where ``l2_normalize``."""
    layers: list[Layer] = []
    if embedding_dim is not None:
        layers.append(Linear(d, embedding_dim, rng=rng, dtype=placement.dtype,
                             device=placement.device))
    if l2_normalize:
        layers.append(L2Normalize(reference=placement.reference))
    return layers


def _leaf_layers(layer: Layer) -> Iterator[Layer]:
    """The layers inside ``layer`` in forward order (a Sequential's and both branches of
    a :class:`TwoBranches` walked into), ``layer`` itself when it holds none."""
    if isinstance(layer, Sequential):
        for inner in layer.layers:
            yield from _leaf_layers(inner)
    elif isinstance(layer, TwoBranches):
        yield from _leaf_layers(layer.main)
        yield from _leaf_layers(layer.side)
    else:
        yield layer


def embedding_layer_parameters(model: Layer) -> list[Parameter]:
    """The parameters of ``model``'s embedding layer: its last :class:`~refdml.train.Linear`
    in forward order (the ``Linear`` that :func:`build_tail` puts before ``L2Normalize``).

    The papers' warm-up trains this layer (with the proxies) before the rest of the model
    (GSP supp. and ASAP: "1 epoch warm-up training of the embedding layer";
    ``TrainingLoop(warmup_epochs=..., warmup_params=...)``). Raises ``TypeError`` for a
    ``model`` that is not a Layer, ``ValueError`` naming the model when it has no Linear.
    """
    if not isinstance(model, Layer):
        raise TypeError(f"model must be a Layer (e.g. a Sequential), got {_describe(model)}")
    linears = [layer for layer in _leaf_layers(model) if isinstance(layer, Linear)]
    if not linears:
        raise ValueError(f"model {model.name!r} ({type(model).__name__}) has no Linear layer, "
                         "so no embedding layer (build_tail adds one when embedding_dim is set)")
    return list(linears[-1].parameters())


# --------------------------------------------------------------------------- objective
def build_objective(spec: ObjectiveConfig, n_classes: int, *, rng, placement: Placement,
                    model_parameters: Iterable = ()) -> Objective:
    """The objective of ``spec``; ``n_classes`` training classes (labels ``0 .. C - 1``),
    ``model_parameters`` the model's (ASAP regularises them)."""
    kind = check_choice(spec.kind, "objective", OBJECTIVE_KINDS)
    loss, dim = spec.loss, spec.embedding_dim
    on = dict(reference=placement.reference, rng=rng)
    arrays = dict(dtype=placement.dtype, device=placement.device)
    # The loss's own hyperparameters, where set.
    kwargs: dict[str, Any] = {name: getattr(spec, name)
                              for name in ("pos_margin", "neg_margin", "margin", "reduction")
                              if getattr(spec, name) is not None}
    if kind == "asap":
        return ASAPObjective(loss, n_classes=n_classes, dim=dim,
                             proxies_per_class=spec.proxies_per_class, budget=spec.budget,
                             lambda_=spec.asap_lambda, model_parameters=list(model_parameters),
                             **on, **arrays, **kwargs)
    if kind == "xml":
        return XMLObjective(loss, lambda_=spec.lambda_, ridge=spec.ridge, **on)
    if kind == "wasserstein":
        return WassersteinObjective(loss, margin=spec.margin, eps=spec.eps, p=spec.p,
                                    max_iter=spec.max_iter, tol=spec.tol,
                                    reference=placement.reference)
    if kind == "proxy":
        return LossObjective(proxy_loss_name(loss), n_classes=n_classes, dim=dim, **on,
                             **arrays, **kwargs)
    if loss in PROXY_LOSSES:
        kwargs["dim"] = dim
    if kind == "zero_shot":
        return GSPObjective(loss, lambda_=spec.lambda_, ridge=spec.ridge,
                            scale=spec.zero_shot_scale, n_classes=n_classes,
                            attribute_dim=dim, base_kwargs=kwargs, **on, **arrays)
    if loss in PROXY_LOSSES:
        kwargs["n_classes"] = n_classes
    return LossObjective(loss, **on, **arrays, **kwargs)


# --------------------------------------------------------------------------- from a run
def run_placement(c: RunConfig) -> Placement:
    return Placement(dtype=np.dtype(c.dtype), device=c.device, reference=c.reference)


def run_head_config(c: RunConfig) -> HeadConfig:
    return HeadConfig(kind=c.head, n_prototypes=c.n_prototypes, mu=c.mu,
                      inverse_temperature=c.inverse_temperature, gemean_p=c.gemean_p)


def run_objective_config(c: RunConfig) -> ObjectiveConfig:
    kind = "asap" if c.asap else "zero_shot" if c.zero_shot else "loss"
    return ObjectiveConfig(kind=kind, loss=c.loss, embedding_dim=c.embedding_dim,
                           pos_margin=c.pos_margin, neg_margin=c.neg_margin, lambda_=c.lambda_,
                           ridge=c.ridge, zero_shot_scale=c.zero_shot_scale,
                           proxies_per_class=c.proxies_per_class, budget=c.budget,
                           asap_lambda=c.asap_lambda)


@dataclass(frozen=True)
class RunModel:
    """The model and objective of a run; ``token_table``: the tokens study's
    :class:`~refdml.train.Embedding` (clipped after every optimiser step), else None."""

    model: Sequential
    objective: Objective
    token_table: Embedding | None = None


def build_run_model(c: RunConfig, *, n_classes: int, rng, n_tokens: int | None = None,
                    feature_dim: int | None = None) -> RunModel:
    """The model and objective of the run config ``c``: trunk, head, tail, then objective,
    drawn from ``rng`` in that order.

    ``n_classes``: training classes (labels ``0 .. C - 1``); ``n_tokens``: the token
    vocabulary (``tokens``); ``feature_dim``: the width of the user's local features
    (``features``). The image studies (``digits-collage``, ``glyphs``, ``glyph-collage``)
    start with :func:`conv_trunk`.
    """
    placement = run_placement(c)
    token_table = None
    if c.study == "tokens":
        token_table = token_embedding(n_tokens, c.dim, rng=rng, placement=placement)
        trunk, d = [token_table], c.dim
    elif c.conv_channels is not None:     # digits-collage, glyphs, glyph-collage
        trunk = conv_trunk(c.conv_channels, c.conv_strides, c.local_dim, rng=rng,
                           placement=placement)
        d = c.local_dim
    else:
        trunk, d = [], feature_dim
    model = Sequential([*trunk, *build_head(run_head_config(c), d, rng=rng, placement=placement),
                        *build_tail(d, embedding_dim=c.embedding_dim,
                                    l2_normalize=c.l2_normalize, rng=rng,
                                    placement=placement)])
    objective = build_objective(run_objective_config(c), n_classes, rng=rng,
                                placement=placement, model_parameters=model.parameters())
    return RunModel(model=model, objective=objective, token_table=token_table)
