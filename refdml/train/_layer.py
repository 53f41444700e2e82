"""The layer protocol and :class:`Sequential`: a model walks its layers in reverse, by hand.

A layer is a thin object around a pure forward/backward pair (catalogued in
``refdml.catalog.train``, checked there by finite differences):

* ``y, ctx = layer.forward(x)``: ``ctx`` is the pair's frozen context, nothing is kept on
  the layer itself (two forwards before one backward are fine);
* ``d_x = layer.backward(ctx, d_y)``: ADDS each parameter's gradient into
  ``Parameter.grad`` (a layer used twice receives both contributions; call
  ``zero_grad`` between steps) and returns the gradient of the input (``None`` where the
  input is not differentiable, e.g. integer tokens).

A layer with two outputs (the GSP head: the pooled vector and the attribute histogram
``z``) returns ``y = (main, side)`` and takes ``d_y = (d_main, d_side)``; ``d_side`` may
be ``None`` (meaning zero: an output the loss does not use). :class:`Sequential` feeds
``main`` to the next layer and appends ``side`` to its own output.

No tape, no autodiff: the contexts ARE the record of the forward pass.

A backward refuses the context of another layer (or objective, or model) by the
:class:`OwnerToken` its forward put in the context (:func:`check_owner`), never by ``id``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import _describe, check_context, check_float_dtype
from refdml.train._parameter import Parameter

__all__ = ["Layer", "OwnerToken", "ParameterOwner", "Sequential", "SequentialContext",
           "check_owner"]


class OwnerToken:
    """Which object's forward made a context: a token created with the object, compared by ``is``.

    ``id(owner)`` cannot serve: once the owner is garbage-collected another object may be
    given its address, and the dead owner's contexts would pass for the new one's (a
    proxy loss would add their gradients to the new proxies). The token is held by its
    owner and by every context the owner's forward returns, so while a context exists its
    token cannot belong to any other object. ``copy.deepcopy`` and pickling give a copy a
    token of its own (a copy's contexts are not the original's).
    """

    __slots__ = ("owner",)

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def __repr__(self) -> str:
        return f"OwnerToken({self.owner})"


def check_owner(token: Any, owner_token: OwnerToken) -> None:
    """``ValueError`` naming ``ctx`` unless a context's ``token`` is ``owner_token`` itself."""
    if token is not owner_token:
        made_by = token.owner if isinstance(token, OwnerToken) else "no known owner"
        raise ValueError(
            f"ctx was returned by the forward of another object ({made_by}), not by this "
            f"{owner_token.owner}; pass the context that its own forward returned"
        )


class ParameterOwner:
    """What a layer and an objective share: a name, named trainable parameters, an owner token.

    :class:`Layer` and :class:`refdml.train.objectives.Objective` both derive from it, so
    a parameter is registered, listed and cleared one way. ``_owner_token`` is the
    :class:`OwnerToken` the owner's forward puts in its contexts (:func:`check_owner`).

    Parameters
    ----------
    name : str
        Prefix of the parameters' names (``"<name>.weight"``).
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {_describe(name)}")
        self.name = name
        self._parameters: dict[str, Parameter] = {}
        self._owner_token = OwnerToken(f"{type(self).__name__} {name!r}")

    def add_parameter(self, key: str, value: Any) -> Parameter:
        """Create, register and return the parameter ``<name>.<key>`` holding ``value``."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"key must be a non-empty str, got {_describe(key)}")
        if key in self._parameters:
            raise ValueError(f"{self.name} already has a parameter named {key!r}")
        parameter = Parameter(value, f"{self.name}.{key}")
        self._parameters[key] = parameter
        return parameter

    def parameters(self) -> Iterator[Parameter]:
        """The trainable parameters, in registration order (an owner that holds others, a
        model its layers or an objective the one it wraps, yields theirs too)."""
        yield from self._parameters.values()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        """``(parameter.name, parameter)`` pairs of :meth:`parameters`, in its order."""
        for parameter in self.parameters():
            yield parameter.name, parameter

    def zero_grad(self) -> None:
        """Clear the accumulated gradient of every parameter."""
        for parameter in self.parameters():
            parameter.zero_grad()


class Layer(ParameterOwner):
    """Base class: named parameters, ``forward(x) -> (y, ctx)``, ``backward(ctx, d_y) -> d_x``.

    Subclasses register their trainable arrays with :meth:`add_parameter` and implement
    :meth:`forward` and :meth:`backward`. ``n_outputs`` is 1, or 2 for a layer returning
    ``(main, side)`` (see the module docstring). The parameters' methods
    (:meth:`add_parameter`, :meth:`parameters`, :meth:`named_parameters`,
    :meth:`zero_grad`) are :class:`ParameterOwner`'s, shared with the objectives.

    Parameters
    ----------
    name : str
        Prefix of the parameters' names (``"<name>.weight"``).
    """

    n_outputs: int = 1

    def forward(self, x: Any) -> tuple[Any, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, ctx: Any, d_y: Any) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def __call__(self, x: Any) -> tuple[Any, Any]:
        return self.forward(x)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k}={p.shape}" for k, p in self._parameters.items())
        return f"{type(self).__name__}({self.name!r}{', ' if shapes else ''}{shapes})"


@dataclass(frozen=True)
class SequentialContext:
    """The per-layer contexts of one :meth:`Sequential.forward`, in layer order.

    ``model`` is the :class:`OwnerToken` of the Sequential that made it (a context of
    another model is refused); ``n_side`` is the number of side outputs appended to the
    model's output.
    """

    contexts: tuple[Any, ...]
    model: OwnerToken
    n_side: int


class Sequential(Layer):
    """A chain of layers; ``backward`` walks them in reverse.

    ``forward(x)`` returns ``(y, ctx)``: ``y`` is the last layer's output when no layer
    has a side output, else the tuple ``(y, side_1, ..., side_k)`` with the side outputs
    of the two-output layers (e.g. the GSP histogram ``z``) in layer order.
    ``backward(ctx, d_y)`` takes the matching upstream (``(d_y, d_side_1, ...)``, a
    ``None`` side gradient meaning zero), accumulates every parameter's gradient and
    returns the gradient of the model's input.

    Parameters
    ----------
    layers : sequence of Layer
        At least one. Parameter names (``"<layer name>.<key>"``) must be unique across
        the model: they key checkpoints and optimiser state.
    name : str
    """

    def __init__(self, layers: Sequence[Layer], *, name: str = "model") -> None:
        super().__init__(name)
        if isinstance(layers, (Layer, str, bytes)) or not isinstance(layers, Iterable):
            raise TypeError(f"layers must be a sequence of Layer objects, got {_describe(layers)}")
        layers = tuple(layers)
        if not layers:
            raise ValueError("layers must contain at least one Layer, got none")
        for k, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layers[{k}] must be a Layer, got {_describe(layer)}")
            if layer.n_outputs not in (1, 2):
                raise ValueError(f"layers[{k}].n_outputs == {layer.n_outputs}, must be 1 or 2")
        seen: dict[str, int] = {}
        for k, layer in enumerate(layers):
            for pname, _ in layer.named_parameters():
                if pname in seen:
                    raise ValueError(
                        f"parameter name {pname!r} of layers[{k}] is already used by "
                        f"layers[{seen[pname]}]; give the layers distinct names"
                    )
                seen[pname] = k
        self.layers = layers
        self.n_side = sum(layer.n_outputs - 1 for layer in layers)
        # A nested Sequential with one side output behaves as a two-output layer.
        self.n_outputs = 1 + self.n_side

    def parameters(self) -> Iterator[Parameter]:
        for layer in self.layers:
            yield from layer.parameters()

    def named_parameters(self) -> Iterator[tuple[str, Parameter]]:
        for layer in self.layers:
            yield from layer.named_parameters()

    def forward(self, x: Any) -> tuple[Any, SequentialContext]:
        contexts = []
        sides = []
        for layer in self.layers:
            x, ctx = layer.forward(x)
            if layer.n_outputs == 2:
                x, side = x
                sides.append(side)
            contexts.append(ctx)
        out = (x, *sides) if sides else x
        return out, SequentialContext(contexts=tuple(contexts), model=self._owner_token,
                                      n_side=len(sides))

    def check_own_context(self, ctx: Any) -> SequentialContext:
        """``ctx``, checked to be the SequentialContext of this model's forward.

        TypeError for another kind of context, ValueError for another model's.
        """
        check_context(ctx, "ctx", SequentialContext)
        check_owner(ctx.model, self._owner_token)
        if len(ctx.contexts) != len(self.layers):
            raise ValueError(
                f"ctx holds {len(ctx.contexts)} layer contexts, this model has "
                f"{len(self.layers)} layers (were its layers replaced after the forward?)"
            )
        return ctx

    def backward(self, ctx: SequentialContext, d_y: Any) -> Any:
        ctx = self.check_own_context(ctx)
        if self.n_side:
            if not isinstance(d_y, tuple) or len(d_y) != 1 + self.n_side:
                raise TypeError(
                    f"d_y must be a tuple of {1 + self.n_side} upstream gradients (the output "
                    f"and {self.n_side} side output(s); None for an unused side output), "
                    f"got {_describe(d_y)}"
                )
            grad, d_sides = d_y[0], list(d_y[1:])
        else:
            grad, d_sides = d_y, []
        for layer, layer_ctx in zip(reversed(self.layers), reversed(ctx.contexts)):
            if layer.n_outputs == 2:
                grad = layer.backward(layer_ctx, (grad, d_sides.pop()))
            else:
                grad = layer.backward(layer_ctx, grad)
        return grad

    def __repr__(self) -> str:
        inner = ",\n  ".join(repr(layer) for layer in self.layers)
        return f"Sequential(\n  {inner}\n)"


def init_array(values: np.ndarray, dtype: Any, device: str) -> Any:
    """``values`` (drawn on the host by the seeded ``rng``) in ``dtype`` on ``device``.

    ``device`` is ``"cpu"`` (NumPy) or ``"cuda"`` (CuPy, imported only then), so the same
    seed gives the same initial parameters on either device.
    """
    dtype = check_float_dtype(dtype, "dtype")
    array = np.asarray(values, dtype=dtype)
    if device == "cpu":
        return array
    if device == "cuda":
        import cupy

        return cupy.asarray(array)
    if not isinstance(device, str):
        raise TypeError(f"device must be 'cpu' or 'cuda', got {_describe(device)}")
    raise ValueError(f"device == {device!r}, must be 'cpu' or 'cuda'")
