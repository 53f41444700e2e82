"""The operators that :mod:`refdml.torch` and :mod:`refdml.jax` put in other frameworks' models.

One table, :data:`BRIDGED`, shared by both bridges: for each operator, the fast-path pair
that runs it (the mirror of :mod:`refdml.gpu`, on NumPy or CuPy arrays, in float32 or
float64), which of its keyword arguments are arrays (everything else is a hyperparameter),
which arrays are differentiated, and the shapes of its outputs given the shapes of its
inputs (what ``torch.compile``'s fake tensors and ``jax.pure_callback`` need to know
before anything runs). The table knows nothing of torch or JAX: each bridge turns a row
into its framework's custom operation, so the two cannot disagree on what an operator
takes or returns.

Each row also names the catalogue entries it serves (``"losses.contrastive"`` and
``"losses.contrastive_cosine"`` are one operator with two sets of inputs), so that
``refdml.torch.op(name)`` takes a catalogue name; tests/interop holds the table to the
catalogue (every name exists and its mirror is the row's pair), which sits above this
module and is not imported here.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.gpu import crossbatch as fast_crossbatch
from refdml.gpu import distances as fast_distances
from refdml.gpu import gsp as fast_gsp
from refdml.gpu import histogram as fast_histogram
from refdml.gpu import losses as fast_losses
from refdml.gpu import normalize as fast_normalize
from refdml.gpu import ot as fast_ot
from refdml.gpu import prototypes as fast_prototypes

__all__ = ["BRIDGED", "BridgedOp", "bridged", "broadcast", "catalogue_names", "decode_options",
           "encode_options", "flat_outputs", "named_gradients", "split_arguments"]

Shapes = Mapping[str, "tuple[int, ...] | None"]


@dataclass(frozen=True)
class BridgedOp:
    """One operator as the bridges see it.

    Attributes
    ----------
    name : str
        The operator's catalogue name (``"gsp.pool"``); the framework op is named after it
        (``torch.ops.refdml.gsp_pool``).
    forward, backward : callable
        The fast-path pair: ``forward(**arrays, **options) -> (outputs, ctx)`` with
        ``outputs`` an array, a float or a tuple of arrays; ``backward(ctx, *d_outputs)``
        returns gradients named by input (attributes).
    arrays : tuple of str
        The keyword arguments that are arrays, in the order of the framework op's
        signature; the others are hyperparameters.
    optional : tuple of str
        The arrays that may be omitted (None).
    differentiable : tuple of str
        The arrays the backward returns gradients for (floating point).
    output_shapes : callable
        ``output_shapes(shapes) -> tuple of shapes``, ``shapes`` mapping each array
        argument to its shape (None when omitted) and ``"options"`` to the
        hyperparameters.
    aliases : tuple of str
        Catalogue entries that are this operator with other inputs.
    low_precision : str
        The dtype float32, float16 and bfloat16 inputs are computed in: ``"float32"``, or
        ``"float64"`` for the entropic OT operators, whose float32 fast path refuses an
        ``eps`` above 1e3 times the largest cost (the regularised value has no correct
        digit left in float32) and cannot form ``value="transport_cost"`` gradients at
        small ``eps`` (docs/gpu/numerics.md). Results are rounded to the inputs' dtype, so
        a float32 model gets float32 tensors either way, and refdml's own conformance holds
        in every dtype.
    """

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    arrays: tuple[str, ...]
    differentiable: tuple[str, ...]
    output_shapes: Callable[[Mapping[str, Any]], tuple[tuple[int, ...], ...]]
    optional: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    low_precision: str = "float32"

    @property
    def symbol(self) -> str:
        """The framework op's name: the catalogue name with ``_`` for ``.``."""
        return self.name.replace(".", "_")

    @property
    def catalogue_names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


def _scalar(_shapes) -> tuple[tuple[int, ...], ...]:
    return ((),)


def _like(name: str):
    def shapes(s):
        return (tuple(s[name]),)
    return shapes


def _pool_shapes(s):
    batch, _, dim = s["features"]
    return ((batch, dim), (batch, s["prototypes"][0]))


def _cost_map_shapes(s):
    batch, n, _ = s["features"]
    return ((batch, s["prototypes"][0], n),)


def broadcast(*shapes) -> tuple:
    """NumPy's broadcast of ``shapes``, in plain Python: the sizes may be symbolic
    (``torch.compile``'s dynamic shapes), which ``numpy.broadcast_shapes`` refuses. The
    operators themselves refuse shapes that do not broadcast; here a size of 1 gives way."""
    ndim = max((len(shape) for shape in shapes), default=0)
    out = []
    for axis in range(-ndim, 0):
        sizes = [shape[axis] for shape in shapes if len(shape) >= -axis]
        wider = [size for size in sizes if not (isinstance(size, int) and size == 1)]
        out.append(wider[0] if wider else 1)
    return tuple(out)


def _distance_shapes(s):
    x, y = s["x"], s["y"]
    return ((*broadcast(tuple(x[:-2]), tuple(y[:-2])), x[-2], y[-2]),)


def _entropic_ot_shapes(s):
    return (broadcast(tuple(s["a"][:-1]), tuple(s["b"][:-1]), tuple(s["cost"][:-2])),)


def _pairwise_shapes(s):
    n = s["clouds"][0]
    return ((n, n),)


def _ridge_shapes(s):
    return ((s["Z"][1], s["Y"][1]),)


def _convex_shapes(s):
    return ((s["z"][0], s["prototypes"][1]),)


def _histogram_shapes(s):
    return ((s["features"][0], s["prototypes"][0]),)


_PROXY_ARRAYS = ("embeddings", "labels", "proxies", "proxy_labels")
_PROXY_GRADS = ("embeddings", "proxies")


def _proxy_loss(name: str, forward, backward) -> BridgedOp:
    return BridgedOp(name, forward, backward, _PROXY_ARRAYS, _PROXY_GRADS, _scalar,
                     optional=("proxy_labels",))


def _pair_loss(name: str, forward, backward, aliases=()) -> BridgedOp:
    return BridgedOp(name, forward, backward, ("embeddings", "labels"), ("embeddings",),
                     _scalar, aliases=aliases)


_L = fast_losses
_OT = fast_ot

#: Every bridged operator, by catalogue name.
BRIDGED: dict[str, BridgedOp] = {op.name: op for op in (
    BridgedOp("gsp.pool", fast_gsp.gsp_pool_forward, fast_gsp.gsp_pool_backward,
              ("features", "prototypes"), ("features", "prototypes"), _pool_shapes,
              aliases=("gsp.pool_gemean",)),
    BridgedOp("gsp.cost_map", fast_gsp.cost_map_forward, fast_gsp.cost_map_backward,
              ("features", "prototypes"), ("features", "prototypes"), _cost_map_shapes),
    BridgedOp("normalize.l2_normalize", fast_normalize.l2_normalize_forward,
              fast_normalize.l2_normalize_backward, ("x",), ("x",), _like("x")),
    BridgedOp("normalize.clip_normalize", fast_normalize.clip_normalize_forward,
              fast_normalize.clip_normalize_backward, ("x",), ("x",), _like("x")),
    BridgedOp("distances.euclidean", fast_distances.euclidean_forward,
              fast_distances.euclidean_backward, ("x", "y"), ("x", "y"), _distance_shapes),
    BridgedOp("distances.sq_euclidean", fast_distances.sq_euclidean_forward,
              fast_distances.sq_euclidean_backward, ("x", "y"), ("x", "y"), _distance_shapes),
    BridgedOp("distances.cosine", fast_distances.cosine_forward,
              fast_distances.cosine_backward, ("x", "y"), ("x", "y"), _distance_shapes),
    BridgedOp("histogram.entropic", fast_histogram.histogram_entropic_forward,
              fast_histogram.histogram_entropic_backward, ("features", "prototypes"),
              ("features", "prototypes"), _histogram_shapes),
    BridgedOp("histogram.convex_combination", fast_histogram.convex_combination_forward,
              fast_histogram.convex_combination_backward, ("z", "prototypes"),
              ("z", "prototypes"), _convex_shapes),
    BridgedOp("ot.sinkhorn_divergence", _OT.sinkhorn_divergence_forward,
              _OT.sinkhorn_divergence_backward, ("x", "y", "a", "b"), ("x", "y", "a", "b"),
              _scalar, optional=("a", "b"), aliases=("ot.sinkhorn_divergence_transport_cost",),
              low_precision="float64"),
    BridgedOp("ot.pairwise_sinkhorn_divergence", _OT.pairwise_sinkhorn_divergence_forward,
              _OT.pairwise_sinkhorn_divergence_backward, ("clouds",), ("clouds",),
              _pairwise_shapes, low_precision="float64"),
    BridgedOp("ot.entropic_ot", _OT.entropic_ot_forward, _OT.entropic_ot_backward,
              ("a", "b", "cost"), ("a", "b", "cost"), _entropic_ot_shapes,
              aliases=("ot.entropic_ot_batched", "ot.entropic_ot_transport_cost"),
              low_precision="float64"),
    BridgedOp("ot.wcontrastive", _OT.wcontrastive_forward, _OT.wcontrastive_backward,
              ("features", "labels", "pairs"), ("features",), _scalar, optional=("pairs",),
              aliases=("ot.wcontrastive_p1",), low_precision="float64"),
    BridgedOp("ot.wtriplet", _OT.wtriplet_forward, _OT.wtriplet_backward,
              ("features", "labels", "triplets"), ("features",), _scalar,
              optional=("triplets",), low_precision="float64"),
    _pair_loss("losses.contrastive", _L.contrastive_forward, _L.contrastive_backward,
               aliases=("losses.contrastive_cosine", "losses.contrastive_no_positive")),
    _pair_loss("losses.triplet", _L.triplet_forward, _L.triplet_backward,
               aliases=("losses.triplet_batch_hard",)),
    _pair_loss("losses.multi_similarity", _L.multi_similarity_forward,
               _L.multi_similarity_backward),
    _pair_loss("losses.generalized_contrastive", _L.generalized_contrastive_forward,
               _L.generalized_contrastive_backward),
    _proxy_loss("losses.proxy_nca", _L.proxy_nca_forward, _L.proxy_nca_backward),
    _proxy_loss("losses.proxy_anchor", _L.proxy_anchor_forward, _L.proxy_anchor_backward),
    _proxy_loss("losses.soft_triple", _L.soft_triple_forward, _L.soft_triple_backward),
    BridgedOp("losses.proxy_contrastive", _L.proxy_contrastive_forward,
              _L.proxy_contrastive_backward, _PROXY_ARRAYS, _PROXY_GRADS, _scalar,
              optional=("proxy_labels",), aliases=("losses.proxy_contrastive_cosine",)),
    _proxy_loss("losses.proxy_multi_similarity", _L.proxy_multi_similarity_forward,
                _L.proxy_multi_similarity_backward),
    BridgedOp("crossbatch.xml_loss", fast_crossbatch.xml_loss_forward,
              fast_crossbatch.xml_loss_backward, ("Z", "Y", "labels", "split"), ("Z", "Y"),
              _scalar, optional=("split",)),
    BridgedOp("crossbatch.zero_shot_loss", fast_crossbatch.zero_shot_loss_forward,
              fast_crossbatch.zero_shot_loss_backward,
              ("Z", "labels", "class_embeddings", "split"), ("Z", "class_embeddings"), _scalar,
              optional=("split",)),
    BridgedOp("crossbatch.cross_fit", fast_crossbatch.cross_fit_forward,
              fast_crossbatch.cross_fit_backward, ("Z", "targets", "split"), ("Z", "targets"),
              _like("targets")),
    BridgedOp("prototypes.ridge_fit_primal", fast_prototypes.ridge_fit_forward,
              fast_prototypes.ridge_fit_backward, ("Z", "Y"), ("Z", "Y"), _ridge_shapes,
              aliases=("prototypes.ridge_fit_kernel",)),
)}

_BY_CATALOGUE_NAME = {alias: op for op in BRIDGED.values() for alias in op.catalogue_names}


def bridged(name: Any) -> BridgedOp:
    """The bridged operator of catalogue name ``name`` (a ``ValueError`` with the closest
    names when there is none)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a catalogue name (str), got {type(name).__name__}")
    try:
        return _BY_CATALOGUE_NAME[name]
    except KeyError:
        close = difflib.get_close_matches(name, _BY_CATALOGUE_NAME, n=3, cutoff=0.5)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"name == {name!r} is not an operator of refdml's bridges{hint}; "
                         f"known: {', '.join(sorted(_BY_CATALOGUE_NAME))}") from None


def catalogue_names() -> tuple[str, ...]:
    """Every catalogue name the bridges serve, sorted."""
    return tuple(sorted(_BY_CATALOGUE_NAME))


def split_arguments(spec: BridgedOp, args: tuple, kwargs: dict[str, Any], noun: str
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """One call's arrays (in ``spec.arrays`` order, None where not given; ``args`` bound to
    them positionally) and its hyperparameters (the other keywords). ``noun`` names the
    framework's arrays in the refusals (``"tensors"``, ``"arrays"``)."""
    if len(args) > len(spec.arrays):
        raise TypeError(f"{spec.name} takes at most {len(spec.arrays)} positional "
                        f"{noun} ({', '.join(spec.arrays)}), got {len(args)}")
    options = dict(kwargs)
    for name, value in zip(spec.arrays, args):
        if name in options:
            raise TypeError(f"{spec.name} got {name} both positionally and by keyword")
        options[name] = value
    return tuple(options.pop(name, None) for name in spec.arrays), options


def _json_value(value: Any, where: str) -> Any:
    """``value`` as JSON data (floats kept exactly: JSON writes ``repr``), or a TypeError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where} is a {type(value).__name__}; the framework ops take numbers, "
                    "strings, booleans, None and lists or dicts of them as hyperparameters "
                    "(a callable or a random generator cannot cross into a compiled graph)")


def encode_options(options: Mapping[str, Any]) -> str:
    """The hyperparameters as one JSON string, the form every framework op takes them in
    (a constant of ``torch.compile``'s graph; a static argument of JAX's)."""
    return json.dumps({name: _json_value(value, name) for name, value in sorted(options.items())},
                      allow_nan=True)


def decode_options(text: str) -> dict[str, Any]:
    return json.loads(text)


def flat_outputs(outputs: Any) -> tuple[Any, ...]:
    """A forward's outputs as a tuple (a single array or number becomes a 1-tuple)."""
    return tuple(outputs) if isinstance(outputs, tuple) else (outputs,)


def named_gradients(grads: Any, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The gradients of ``names`` from a backward's result (attributes or a mapping)."""
    if isinstance(grads, Mapping):
        return tuple(grads.get(name) for name in names)
    return tuple(getattr(grads, name, None) for name in names)
