"""refdml's operators as PyTorch custom ops (``torch.library``), one per row of
:data:`refdml._interop.BRIDGED`.

For the operator ``gsp.pool`` two ops are registered:

* ``refdml::gsp_pool(Tensor features, Tensor prototypes, str options)`` returns the
  operator's outputs and a *handle*: a 0-d int64 CPU tensor naming the forward's context
  (refdml's own context object: the solve, the saved arrays) in a table of this module.
  ``options`` are the hyperparameters as JSON (:func:`refdml._interop.encode_options`),
  a constant of a compiled graph.
* ``refdml::gsp_pool_backward(Tensor handle, <the inputs>, <the outputs>, <their upstream
  gradients>)`` runs refdml's hand-derived backward on that context and returns one
  gradient per differentiable input.

``register_autograd`` joins the two; ``register_fake`` gives both their output shapes, so
``torch.compile(..., fullgraph=True)`` traces through them without running refdml. The
backward never re-runs the forward: the context lives exactly as long as its handle, which
autograd keeps among the saved tensors of the graph (a ``weakref.finalize`` on the handle
drops the context when the graph is freed). Inputs and outputs are saved beside it, so an
in-place change to either between forward and backward is the error PyTorch gives for its
own ops, not a silently wrong gradient. refdml's backwards are first order: a second
derivative (``create_graph=True``, ``gradgradcheck``) raises a ``RuntimeError`` that says so.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from refdml._interop import (
    BRIDGED,
    BridgedOp,
    bridged,
    catalogue_names,
    decode_options,
    encode_options,
    flat_outputs,
    named_gradients,
    split_arguments,
)
from refdml.torch._convert import FLOATING, on_device, to_array, to_tensor

__all__ = ["TorchOp", "live_contexts", "names", "op"]

_NAMESPACE = "refdml"
_CONTEXTS: dict[int, Any] = {}
_TICKETS = itertools.count(1)


def _keep(context: Any) -> torch.Tensor:
    """A handle on ``context``: the context is dropped when the handle tensor dies."""
    ticket = next(_TICKETS)
    _CONTEXTS[ticket] = context
    handle = torch.tensor(ticket, dtype=torch.int64)
    weakref.finalize(handle, _CONTEXTS.pop, ticket, None)
    return handle


def live_contexts() -> int:
    """How many forward contexts are alive (their graphs not yet freed)."""
    return len(_CONTEXTS)


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors
            if isinstance(t, torch.Tensor) and t.numel()}


def _unaliased(tensor: torch.Tensor, taken: set[int]) -> torch.Tensor:
    """A custom op's output must not share memory with its inputs (refdml may return an
    input unchanged, the clip of points inside the ball): such an output is cloned."""
    if tensor.numel() and tensor.untyped_storage().data_ptr() in taken:
        return tensor.clone()
    return tensor


@torch.compiler.assume_constant_result
def _options_text(options: Mapping[str, Any]) -> str:
    # Hyperparameters are Python constants: torch.compile runs this once while tracing and
    # keeps the string, rather than tracing into the json module.
    return encode_options(options)


def _second_order(name: str):
    def backward(ctx, *grads):
        raise RuntimeError(
            f"refdml's backward of {name} is first order: second derivatives (create_graph="
            "True, torch.autograd.gradgradcheck, a Hessian) are not derived. Differentiate "
            "refdml's gradient by finite differences, or use a PyTorch implementation"
        )
    return backward


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor on {value.device}"
    return f"a {type(value).__name__}"


class TorchOp:
    """One refdml operator as a PyTorch op; call it with the catalogue's keywords.

    ``op(**arrays_and_hyperparameters)`` (the arrays also positionally, in the order of
    :attr:`arrays`) returns a tensor, or a tuple of tensors where the operator has several
    outputs. The arrays are tensors on one device, the differentiated ones of one floating
    dtype; the hyperparameters are Python values. The underlying ops are
    ``torch.ops.refdml.<symbol>`` and ``torch.ops.refdml.<symbol>_backward``.
    """

    def __init__(self, spec: BridgedOp) -> None:
        self.spec = spec
        self.name = spec.name
        self.arrays = spec.arrays
        self._forward_op = self._register_forward()
        self._backward_op = self._register_backward()
        self._forward_op.register_autograd(self._autograd_backward,
                                           setup_context=self._setup_context)
        self._backward_op.register_autograd(_second_order(spec.name))

    def __repr__(self) -> str:
        return f"refdml.torch.op({self.name!r})"

    # --- the two custom ops ----------------------------------------------------------
    def _schema_arrays(self) -> str:
        optional = set(self.spec.optional)
        return ", ".join(f"Tensor{'?' if name in optional else ''} {name}"
                         for name in self.spec.arrays)

    def _register_forward(self):
        spec = self.spec
        n_outputs = len(spec.output_shapes(_example_shapes(spec)))
        returns = ", ".join(["Tensor"] * (n_outputs + 1))
        schema = f"({self._schema_arrays()}, str options) -> ({returns})"

        def forward(*args):
            spec = self.spec  # read at call time: a test may stand a spy in for the pair
            tensors, options = args[:-1], decode_options(args[-1])
            like = _floating_input(spec, tensors)
            taken = _storages(tensors)
            # Inside on_device, so that DLPack's exchange is between one stream and itself
            # (no event between PyTorch's stream and CuPy's).
            with on_device(like.device):
                arrays = {name: to_array(t, name, spec.low_precision)
                          for name, t in zip(spec.arrays, tensors) if t is not None}
                outputs, context = spec.forward(**arrays, **options)
                out = tuple(_unaliased(to_tensor(o, dtype=like.dtype, device=like.device), taken)
                            for o in flat_outputs(outputs))
            return (*out, _keep(context))

        op = torch.library.custom_op(f"{_NAMESPACE}::{spec.symbol}", forward,
                                     mutates_args=(), schema=schema)

        def fake(*args):
            tensors, options = args[:-1], args[-1]
            like = _floating_input(spec, tensors)
            shapes = {name: None if t is None else tuple(t.shape)
                      for name, t in zip(spec.arrays, tensors)}
            shapes["options"] = decode_options(options)
            out = tuple(like.new_empty(shape) for shape in spec.output_shapes(shapes))
            return (*out, torch.empty((), dtype=torch.int64))

        op.register_fake(fake)
        return op

    def _register_backward(self):
        spec = self.spec
        n_arrays = len(spec.arrays)
        n_outputs = len(spec.output_shapes(_example_shapes(spec)))
        outs = ", ".join(f"Tensor output{k}" for k in range(n_outputs))
        upstream = ", ".join(f"Tensor d_output{k}" for k in range(n_outputs))
        returns = ", ".join(["Tensor"] * len(spec.differentiable))
        schema = (f"(Tensor handle, {self._schema_arrays()}, {outs}, {upstream}) -> "
                  f"({returns})")
        index = {name: k for k, name in enumerate(spec.arrays)}

        def backward(handle, *rest):
            spec = self.spec
            inputs = rest[:n_arrays]
            upstream_grads = rest[n_arrays + n_outputs:]
            context = _CONTEXTS.get(int(handle))
            if context is None:
                raise RuntimeError(f"the forward context of {spec.name} is gone: its handle "
                                   "was not kept by autograd (call the op through "
                                   f"refdml.torch.op({spec.name!r}))")
            like = _floating_input(spec, inputs)
            taken = _storages(rest)
            with on_device(like.device):
                d = [to_array(g, f"the upstream gradient of output {k} of {spec.name}",
                              spec.low_precision)
                     for k, g in enumerate(upstream_grads)]
                grads = named_gradients(spec.backward(context, *d), spec.differentiable)
                result = []
                for name, grad in zip(spec.differentiable, grads):
                    given = inputs[index[name]]
                    if given is None:
                        result.append(torch.empty(0, dtype=like.dtype))
                    elif grad is None:
                        result.append(torch.zeros_like(given))
                    else:
                        result.append(_unaliased(
                            to_tensor(grad, dtype=given.dtype, device=given.device), taken))
            return tuple(result) if len(result) > 1 else result[0]

        op = torch.library.custom_op(f"{_NAMESPACE}::{spec.symbol}_backward", backward,
                                     mutates_args=(), schema=schema)

        def fake(handle, *rest):
            inputs = rest[:n_arrays]
            like = _floating_input(spec, inputs)
            result = tuple(torch.empty(0, dtype=like.dtype) if inputs[index[name]] is None
                           else torch.empty_like(inputs[index[name]])
                           for name in spec.differentiable)
            return result if len(result) > 1 else result[0]

        op.register_fake(fake)
        return op

    # --- autograd ----------------------------------------------------------------------
    def _setup_context(self, ctx, inputs, output) -> None:
        tensors = inputs[:-1]
        ctx.output_meta = [(o.shape, o.dtype, o.device) for o in output[:-1]]
        ctx.save_for_backward(output[-1], *tensors, *output[:-1])

    def _autograd_backward(self, ctx, *grads):
        spec = self.spec
        handle, *saved = ctx.saved_tensors
        inputs, outputs = saved[:len(spec.arrays)], saved[len(spec.arrays):]
        upstream = [torch.zeros(shape, dtype=dtype, device=device) if g is None else g
                    for g, (shape, dtype, device) in zip(grads, ctx.output_meta)]
        result = self._backward_op(handle, *inputs, *outputs, *upstream)
        if isinstance(result, torch.Tensor):
            result = (result,)
        by_name = dict(zip(spec.differentiable, result))
        return (*(by_name[name] if name in by_name and inputs[k] is not None else None
                  for k, name in enumerate(spec.arrays)), None)

    # --- the call ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any):
        spec = self.spec
        tensors, options = split_arguments(spec, args, kwargs, "tensors")
        _check_tensors(spec, tensors)
        result = self._forward_op(*tensors, _options_text(options))[:-1]
        return result[0] if len(result) == 1 else tuple(result)


def _example_shapes(spec: BridgedOp) -> dict[str, Any]:
    """Shapes of a small call, to count the outputs when the op is registered."""
    shapes = {"features": (2, 4, 3), "prototypes": (3, 3), "x": (4, 3), "y": (5, 3),
              "a": (4,), "b": (5,), "cost": (4, 5), "clouds": (3, 4, 3), "z": (2, 3),
              "Z": (6, 4), "Y": (6, 3), "targets": (6, 3)}
    out: dict[str, Any] = {name: shapes.get(name) for name in spec.arrays}
    out["options"] = {}
    return out


def _floating_input(spec: BridgedOp, tensors) -> torch.Tensor:
    for name, t in zip(spec.arrays, tensors):
        if name in spec.differentiable and t is not None:
            return t
    raise ValueError(f"{spec.name} got none of its floating inputs ({', '.join(spec.differentiable)})")


def _check_tensors(spec: BridgedOp, tensors) -> None:
    """The refusals of :meth:`TorchOp.__call__`: one line naming the argument."""
    device = dtype = first = None
    for name, t in zip(spec.arrays, tensors):
        if t is None:
            if name not in spec.optional:
                raise TypeError(f"{spec.name} needs the tensor {name}")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} is {_describe(t)}; refdml.torch ops take torch.Tensor "
                            f"arrays: pass torch.as_tensor({name})")
        if device is None:
            device, first = t.device, name
        elif t.device != device:
            raise ValueError(f"{name} is on {t.device} and {first} on {device}; "
                             f"{spec.name} takes its tensors on one device")
        if name in spec.differentiable:
            if t.dtype not in FLOATING:
                raise TypeError(
                    f"{name} is {_describe(t)}; {spec.name} needs floating point (float64, "
                    f"float32, float16 or bfloat16): pass {name}.double() or {name}.float()")
            if dtype is None:
                dtype, dtype_name = t.dtype, name
            elif t.dtype != dtype:
                raise TypeError(f"{name} is {t.dtype} and {dtype_name} {dtype}; give "
                                f"{spec.name} one floating dtype")


_OPS: dict[str, TorchOp] = {name: TorchOp(spec) for name, spec in BRIDGED.items()}


def op(name: str) -> TorchOp:
    """The PyTorch op of refdml's operator ``name``, a catalogue name (``"gsp.pool"``;
    ``"losses.contrastive_cosine"`` is ``"losses.contrastive"`` with its inputs)."""
    return _OPS[bridged(name).name]


def names() -> tuple[str, ...]:
    """Every catalogue name :func:`op` takes, sorted."""
    return catalogue_names()
