r"""Dense layers: Linear, ReLU and the token embedding, as pure pairs and as layers.

Each pair is written once against the input's array module (NumPy or CuPy) and dtype.

``linear_forward(x, weight, bias)``
    .. math:: y = x W^\top + b

    with ``x`` (..., d_in), ``W`` (d_out, d_in), ``b`` (d_out).

    Backward: ``d_x = d_y W``, ``d_W = sum over leading axes of d_y^T x``,
    ``d_b = sum over leading axes of d_y``. Any number of leading axes (a batch ``(B, d)``
    or local features ``(B, n, d)``).
``relu_forward(x)``
    ``y = max(x, 0)``; ``d_x = d_y * [x > 0]`` (the subgradient 0 at ``x = 0``).
``embedding_forward(tokens, table)``
    ``y[..., :] = table[tokens[...]]`` (a learned table indexed by integer tokens; the GSP
    synthetic study trains its tokens directly). Backward: ``d_table[v] = sum over the
    positions holding token v of d_y`` (a scatter-add: repeated tokens sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    _describe, as_inputs, check_context, check_rng, check_scalar, check_upstream_like, data_checks,
)
from refdml._backend import as_input_array, get_backend
from refdml.gpu.linalg import matmul
from refdml.train._layer import Layer, init_array

__all__ = [
    "Embedding",
    "EmbeddingContext",
    "EmbeddingGrads",
    "Linear",
    "LinearContext",
    "LinearGrads",
    "ReLU",
    "ReluContext",
    "ReluGrads",
    "embedding_backward",
    "embedding_forward",
    "linear_backward",
    "linear_forward",
    "relu_backward",
    "relu_forward",
]


# --------------------------------------------------------------------------- linear
@dataclass(frozen=True)
class LinearContext:
    """``x`` (..., d_in) and ``weight`` (d_out, d_in) of the forward; ``y_shape``."""

    x: Any
    weight: Any
    y_shape: tuple[int, ...]


@dataclass(frozen=True)
class LinearGrads:
    x: Any
    weight: Any
    bias: Any


def linear_forward(x, weight, bias) -> tuple[Any, LinearContext]:
    """``y = x W^T + b`` over the last axis of ``x``; returns ``(y, ctx)`` (see module doc).

    Parameters
    ----------
    x : float array (..., d_in)
        Inputs along the last axis.
    weight : float array (d_out, d_in)
        The weight ``W``.
    bias : float array (d_out,)
        The bias ``b``.
    """
    _, _, a = as_inputs({"x": (x, None), "weight": (weight, 2), "bias": (bias, 1)})
    x, weight, bias = a["x"], a["weight"], a["bias"]
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"x has shape {tuple(x.shape)}, its last axis must be weight's d_in = "
            f"{weight.shape[1]}"
        )
    if bias.shape[0] != weight.shape[0]:
        raise ValueError(f"bias has shape {tuple(bias.shape)}, must be ({weight.shape[0]},)")
    y = matmul(get_backend(x), x, weight.T) + bias
    return y, LinearContext(x=x, weight=weight, y_shape=tuple(y.shape))


def linear_backward(ctx: LinearContext, d_y) -> LinearGrads:
    """Gradients ``.x``, ``.weight``, ``.bias`` of :func:`linear_forward`."""
    check_context(ctx, "ctx", LinearContext)
    d_y = check_upstream_like(d_y, "d_y", ctx.y_shape, ctx.x)
    d_out, d_in = ctx.weight.shape
    flat_d_y = d_y.reshape(-1, d_out)
    ns = get_backend(d_y)
    return LinearGrads(
        x=matmul(ns, d_y, ctx.weight),
        weight=matmul(ns, flat_d_y.T, ctx.x.reshape(-1, d_in)),
        bias=flat_d_y.sum(axis=0),
    )


# --------------------------------------------------------------------------- relu
@dataclass(frozen=True)
class ReluContext:
    """``active = x > 0`` (boolean, the shape of ``x``) and a dtype/device witness ``y``."""

    active: Any
    y: Any


@dataclass(frozen=True)
class ReluGrads:
    x: Any


def relu_forward(x) -> tuple[Any, ReluContext]:
    """``y = max(x, 0)``; returns ``(y, ctx)``.

    Parameters
    ----------
    x : float array (any shape)
        The pre-activations.
    """
    _, _, a = as_inputs({"x": (x, None)})
    x = a["x"]
    active = x > 0
    y = x * active
    return y, ReluContext(active=active, y=y)


def relu_backward(ctx: ReluContext, d_y) -> ReluGrads:
    """Gradient ``.x = d_y * [x > 0]`` of :func:`relu_forward` (0 at ``x = 0``)."""
    check_context(ctx, "ctx", ReluContext)
    d_y = check_upstream_like(d_y, "d_y", tuple(ctx.y.shape), ctx.y)
    return ReluGrads(x=d_y * ctx.active)


# --------------------------------------------------------------------------- embedding
@dataclass(frozen=True)
class EmbeddingContext:
    """The ``tokens`` (int64) of the forward, the table's row count, and ``y_shape``."""

    tokens: Any
    n_rows: int
    y_shape: tuple[int, ...]
    table: Any


@dataclass(frozen=True)
class EmbeddingGrads:
    table: Any


def _as_tokens(tokens, n_rows: int, ns) -> Any:
    xp = ns.xp
    if isinstance(tokens, (str, bytes)) or tokens is None:
        raise TypeError(f"tokens must be an array of integers, got {_describe(tokens)}")
    array = as_input_array(tokens)
    if np.dtype(array.dtype) == bool or not np.issubdtype(np.dtype(array.dtype), np.integer):
        raise TypeError(f"tokens must be an array of integers, got dtype {array.dtype}")
    array = xp.asarray(array, dtype=xp.int64)
    if array.size and data_checks(ns):
        low, high = xp.stack([array.min(), array.max()]).tolist()   # one transfer on CuPy
        if low < 0 or high >= n_rows:
            bad = low if low < 0 else high
            raise ValueError(f"tokens holds {bad}, must be in [0, {n_rows}) (the table's rows)")
    return array


def embedding_forward(tokens, table) -> tuple[Any, EmbeddingContext]:
    """``y = table[tokens]``: shape ``tokens.shape + (d,)``; returns ``(y, ctx)``.

    ``tokens`` holds integers in ``[0, V)``; ``table`` is ``(V, d)``. Checking the range
    reads the tokens (one device synchronisation on CuPy while data checks are on).

    Parameters
    ----------
    tokens : int array (any shape)
        Indices into ``table``, in ``[0, V)``.
    table : float array (V, d)
        One embedding per token.
    """
    ns, _, a = as_inputs({"table": (table, 2)})
    table = a["table"]
    tokens = _as_tokens(tokens, table.shape[0], ns)
    y = table[tokens]
    return y, EmbeddingContext(
        tokens=tokens, n_rows=int(table.shape[0]), y_shape=tuple(y.shape), table=table
    )


def embedding_backward(ctx: EmbeddingContext, d_y) -> EmbeddingGrads:
    """Gradient ``.table`` of :func:`embedding_forward`: a scatter-add of ``d_y`` by token."""
    check_context(ctx, "ctx", EmbeddingContext)
    d_y = check_upstream_like(d_y, "d_y", ctx.y_shape, ctx.table)
    ns = get_backend(d_y)
    d = ctx.y_shape[-1]
    d_table = ns.xp.zeros((ctx.n_rows, d), dtype=d_y.dtype)
    ns.scatter_add(d_table, ctx.tokens.reshape(-1), d_y.reshape(-1, d))
    return EmbeddingGrads(table=d_table)


# --------------------------------------------------------------------------- layers
def _glorot(rng, fan_in: int, fan_out: int, shape) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, shape)


def _he(rng, fan_in: int, shape) -> np.ndarray:
    return rng.standard_normal(shape) * np.sqrt(2.0 / fan_in)


def dense_init(rng, d_in: int, d_out: int, init: str) -> np.ndarray:
    """A ``(d_out, d_in)`` weight: ``"glorot"`` (uniform) or ``"he"`` (normal, for ReLU)."""
    if init == "glorot":
        return _glorot(rng, d_in, d_out, (d_out, d_in))
    if init == "he":
        return _he(rng, d_in, (d_out, d_in))
    raise ValueError(f"init == {init!r}, must be 'glorot' or 'he'")


def _bounded_int(value, name: str, *, low: int) -> int:
    """An int (Python or NumPy, not bool) in ``[low, int64 max]`` (a size NumPy can hold)."""
    return check_scalar(value, name, low=low, integer=True, one_sided=True)


def _positive_int(value, name: str) -> int:
    return _bounded_int(value, name, low=1)


class Linear(Layer):
    """``y = x W^T + b`` on the last axis (:func:`linear_forward`).

    ``weight`` (d_out, d_in) is Glorot-uniform (``init="glorot"``, default) or He-normal
    (``init="he"``, before a ReLU); ``bias`` starts at zero. ``rng`` seeds it.
    """

    def __init__(self, d_in: int, d_out: int, *, rng=None, init: str = "glorot",
                 dtype=np.float64, device: str = "cpu", name: str = "linear") -> None:
        super().__init__(name)
        d_in, d_out = _positive_int(d_in, "d_in"), _positive_int(d_out, "d_out")
        rng = check_rng(rng)
        self.weight = self.add_parameter(
            "weight", init_array(dense_init(rng, d_in, d_out, init), dtype, device))
        self.bias = self.add_parameter("bias", init_array(np.zeros(d_out), dtype, device))

    def forward(self, x):
        return linear_forward(x, self.weight.value, self.bias.value)

    def backward(self, ctx, d_y):
        grads = linear_backward(ctx, d_y)
        self.weight.accumulate(grads.weight)
        self.bias.accumulate(grads.bias)
        return grads.x


class ReLU(Layer):
    """``y = max(x, 0)`` (:func:`relu_forward`); no parameters."""

    def __init__(self, *, name: str = "relu") -> None:
        super().__init__(name)

    def forward(self, x):
        return relu_forward(x)

    def backward(self, ctx, d_y):
        return relu_backward(ctx, d_y).x


class Embedding(Layer):
    """A learned ``(n_tokens, d)`` table indexed by integer tokens (:func:`embedding_forward`).

    Initialised ``N(0, 1/d)`` (rows of norm about 1). ``backward`` returns ``None``: the
    integer tokens have no gradient.
    """

    def __init__(self, n_tokens: int, d: int, *, rng=None, dtype=np.float64,
                 device: str = "cpu", name: str = "embedding") -> None:
        super().__init__(name)
        n_tokens, d = _positive_int(n_tokens, "n_tokens"), _positive_int(d, "d")
        rng = check_rng(rng)
        values = rng.standard_normal((n_tokens, d)) / np.sqrt(d)
        self.table = self.add_parameter("table", init_array(values, dtype, device))

    def forward(self, x):
        return embedding_forward(x, self.table.value)

    def backward(self, ctx, d_y):
        self.table.accumulate(embedding_backward(ctx, d_y).table)
        return None
