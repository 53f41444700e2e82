"""refdml's operators as ``jax.custom_vjp`` functions, one per row of
:data:`refdml._interop.BRIDGED`.

``refdml.jax.op("gsp.pool")(features=..., prototypes=..., mu=..., inverse_temperature=...)``
builds (once per operator, hyperparameters and set of given arrays) a ``custom_vjp``
function of the given arrays:

* the forward is ``jax.pure_callback`` to refdml's fast path on NumPy (the row's
  ``forward``), with the result shapes from the row's ``output_shapes``, the function
  ``torch.compile``'s fake tensors use too;
* the backward is a second ``pure_callback``, to refdml's hand-derived backward (the row's
  ``backward``): no autodiff through refdml's maths.

Design.

* JAX residuals must be arrays, so the forward saves its input arrays and the backward
  callback runs the forward again on them to rebuild refdml's context before the
  hand-derived backward. There is no table of contexts kept between the two callbacks:
  JAX may run a callback twice or not at all (under ``jit`` a forward whose outputs are
  unused is dropped, and a rematerialised one repeated), so a context kept under a handle
  would be orphaned or read after its release.
* Hyperparameters are Python values, closed over: static for JAX, as a ``static_argnames``
  argument of ``jax.jit`` is. They are encoded as refdml's other bridge encodes them
  (:func:`refdml._interop.encode_options`: numbers, strings, booleans and lists or dicts of
  them), and the function built for one set is cached, so that eager calls reuse JAX's
  compiled callback rather than compiling one per call.
* The arrays that are not differentiated (labels, proxy labels, a split, pair indices) are
  ordinary primal arguments, so they may be traced and batched under ``jit`` and ``vmap``;
  the backward gives them no cotangent (``None``, JAX's zero).
* ``vmap`` runs the callbacks once per batch element (``vmap_method="sequential"``). No
  broadcasting rule is right for every row: a loss over a batch is not a batch of losses,
  and refdml's operators fix the rank of their inputs.
* float16 and bfloat16 (and float32 for the entropic OT operators) are computed in a wider
  dtype on the host and rounded back (:mod:`refdml.jax._host`), so outputs and gradients
  come back in the inputs' dtype.
* refdml runs on a worker thread of its own, not on the thread XLA runs the callback on,
  where denormals are flushed to zero (:mod:`refdml.jax._host` says why that matters).

refdml runs on the CPU: arrays on another device are copied to the host and back by
``pure_callback``, and the first such call of each operator warns once
(:class:`HostRoundTripWarning`). refdml's input errors (a NaN, ``mu`` out of range) are
raised as refdml raises them where the callback runs eagerly; under ``jax.jit`` they
surface when the compiled function runs, as JAX's ``JaxRuntimeError`` whose message ends
with refdml's error. refdml's backwards are first order: differentiating a backward
(``grad`` of ``grad``) raises a ``RuntimeError`` that says so, and forward mode (``jvp``,
``jax.hessian``) is JAX's refusal of any ``custom_vjp`` function.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from refdml._interop import (
    BRIDGED,
    BridgedOp,
    bridged,
    catalogue_names,
    decode_options,
    encode_options,
    split_arguments,
)
from refdml.exceptions import RefdmlWarning
from refdml.jax._host import HostOp, start_worker, take_error

__all__ = ["HostRoundTripWarning", "JaxOp", "names", "op"]

#: The floating dtypes the ops take.
FLOATING = tuple(np.dtype(d) for d in ("float64", "float32", "float16", jax.numpy.bfloat16))


def _not_refdml_error(record: logging.LogRecord) -> bool:
    """False for JAX's log of an exception refdml raised in a callback: that exception is
    raised to the caller, or is the end of JAX's error, already; the log would repeat its
    traceback on stderr."""
    error = record.exc_info[1] if record.exc_info else None
    return not getattr(error, "refdml_callback_error", False)


# The logger of jax.pure_callback, which logs every exception of a callback.
logging.getLogger("jax._src.callback").addFilter(_not_refdml_error)


class HostRoundTripWarning(RefdmlWarning):
    """refdml.jax ran an operator on arrays of a non-CPU device: they crossed to the host
    and back through ``jax.pure_callback``."""


def device_platform(array: jax.Array) -> str:
    """The platform ``array`` lives on (``"cpu"``, ``"gpu"``, ``"tpu"``); for a traced array,
    which has no device yet, JAX's default backend, where the computation will run unless
    placed elsewhere. A seam: the tests stand a CPU array in for a GPU one."""
    if isinstance(array, jax.core.Tracer):
        return jax.default_backend()
    return next(iter(array.devices())).platform


def _describe(value: Any) -> str:
    if isinstance(value, jax.Array):
        return f"a {value.dtype} jax array"
    if isinstance(value, np.ndarray):
        return f"a {value.dtype} numpy.ndarray"
    return f"a {type(value).__name__}"


@contextlib.contextmanager
def _refdml_errors() -> Iterator[None]:
    """refdml's own exception, where a callback that ran inside the block raised it.

    JAX reports an exception of a callback as an error of its own with the traceback in
    its text; when the callback ran eagerly (inside this block) the exception it raised is
    the one kept by :func:`refdml.jax._host.take_error`, and is raised instead, from JAX's
    error. Under ``jit`` the callback runs later, outside any block, and JAX's error stands.
    """
    take_error()   # a stale one, from a callback that ran under someone's jit
    try:
        yield
    except Exception as error:
        # A JaxRuntimeError the first time; a ValueError with the same text once the
        # dispatch is cached (JAX's C++ fast path): recognised by refdml's message.
        raised = take_error()
        if raised is not None and raised is not error and str(raised) in str(error):
            raise raised from error
        raise


@functools.lru_cache(maxsize=256)
def _function(name: str, options_text: str, given: tuple[str, ...]):
    """The ``custom_vjp`` function of operator ``name`` with the hyperparameters
    ``options_text`` (JSON) over the arrays ``given``, positional in that order."""
    spec = BRIDGED[name]
    options = decode_options(options_text)
    host = HostOp(spec, options, given)
    floating = host.floating

    def output_types(arrays):
        shapes: dict[str, Any] = dict.fromkeys(spec.arrays)
        shapes.update((n, tuple(a.shape)) for n, a in zip(given, arrays))
        shapes["options"] = options
        dtype = arrays[floating[0]].dtype
        return tuple(jax.ShapeDtypeStruct(shape, dtype) for shape in spec.output_shapes(shapes))

    @jax.custom_vjp
    def function(*arrays):
        return jax.pure_callback(host.forward, output_types(arrays), *arrays,
                                 vmap_method="sequential")

    def forward(*arrays):
        return function(*arrays), arrays

    @jax.custom_vjp
    def gradients(arrays, cotangents):
        types = tuple(jax.ShapeDtypeStruct(arrays[k].shape, arrays[k].dtype) for k in floating)
        return jax.pure_callback(host.backward, types, *arrays, *cotangents,
                                 vmap_method="sequential")

    def gradients_forward(arrays, cotangents):
        return gradients(arrays, cotangents), None

    def second_order(_residuals, _cotangents):
        raise RuntimeError(
            f"refdml's backward of {name} is first order: second derivatives (grad of grad, "
            "a Hessian) are not derived. Differentiate refdml's gradient by finite "
            "differences, or use a JAX implementation")

    gradients.defvjp(gradients_forward, second_order)

    def backward(arrays, cotangents):
        with _refdml_errors():
            grads = gradients(arrays, tuple(cotangents))
        by_position = dict(zip(floating, grads))
        return tuple(by_position.get(k) for k in range(len(arrays)))

    function.defvjp(forward, backward)
    return function


class JaxOp:
    """One refdml operator as a JAX function; call it with the catalogue's keywords.

    ``op(**arrays_and_hyperparameters)`` (the arrays also positionally, in the order of
    :attr:`arrays`) returns a JAX array, or a tuple of them where the operator has several
    outputs. The arrays are ``jax.Array`` (traced or not; a NumPy array is converted as
    ``jax.numpy`` converts it), the differentiated ones of one floating dtype; the
    hyperparameters are Python values.
    """

    def __init__(self, spec: BridgedOp) -> None:
        self.spec = spec
        self.name = spec.name
        self.arrays = spec.arrays
        self._warned = False

    def __repr__(self) -> str:
        return f"refdml.jax.op({self.name!r})"

    def __call__(self, *args: Any, **kwargs: Any):
        spec = self.spec
        arrays, kwargs = split_arguments(spec, args, kwargs, "arrays")
        arrays = _check_arrays(spec, arrays)
        for key, value in kwargs.items():
            if isinstance(value, jax.Array):
                raise TypeError(f"{key} is {_describe(value)}; refdml.jax takes hyperparameters "
                                f"as Python values (under jax.jit, mark {key} static: "
                                f"static_argnames=({key!r},))")
        given = tuple(name for name, a in zip(spec.arrays, arrays) if a is not None)
        present = tuple(a for a in arrays if a is not None)
        self._warn_off_cpu(present)
        start_worker()
        function = _function(spec.name, encode_options(kwargs), given)
        with _refdml_errors():
            result = function(*present)
        return result[0] if len(result) == 1 else tuple(result)

    def _warn_off_cpu(self, arrays) -> None:
        if self._warned:
            return
        platform = device_platform(arrays[0])
        if platform != "cpu":
            self._warned = True
            warnings.warn(
                f"refdml.jax runs {self.name} on the CPU through jax.pure_callback: its "
                f"{platform} arrays are copied to the host and back (no {platform} route is "
                "built for JAX; refdml.torch runs CUDA tensors in place)",
                HostRoundTripWarning, stacklevel=3)


def _check_arrays(spec: BridgedOp, arrays) -> tuple[jax.Array | None, ...]:
    """The arrays as JAX arrays (a NumPy array is taken as ``jax.numpy`` takes it: with
    ``jax.numpy.asarray``, so float64 becomes float32 unless x64 is on), or the refusals of
    :meth:`JaxOp.__call__`: one line naming the argument."""
    dtype = dtype_name = None
    checked = []
    for name, a in zip(spec.arrays, arrays):
        if a is None:
            if name not in spec.optional:
                raise TypeError(f"{spec.name} needs the array {name}")
            checked.append(None)
            continue
        if isinstance(a, np.ndarray):
            a = jax.numpy.asarray(a)
        if not isinstance(a, jax.Array):
            raise TypeError(f"{name} is {_describe(a)}; refdml.jax ops take jax arrays: pass "
                            f"jax.numpy.asarray({name})")
        checked.append(a)
        if name in spec.differentiable:
            if np.dtype(a.dtype) not in FLOATING:
                raise TypeError(
                    f"{name} is {_describe(a)}; {spec.name} needs floating point (float64, "
                    f"float32, float16 or bfloat16): pass {name}.astype(jax.numpy.float32)")
            if dtype is None:
                dtype, dtype_name = a.dtype, name
            elif a.dtype != dtype:
                raise TypeError(f"{name} is {a.dtype} and {dtype_name} {dtype}; give "
                                f"{spec.name} one floating dtype")
    return tuple(checked)


_OPS: dict[str, JaxOp] = {name: JaxOp(spec) for name, spec in BRIDGED.items()}


def op(name: str) -> JaxOp:
    """The JAX function of refdml's operator ``name``, a catalogue name (``"gsp.pool"``;
    ``"losses.contrastive_cosine"`` is ``"losses.contrastive"`` with its inputs)."""
    return _OPS[bridged(name).name]


def names() -> tuple[str, ...]:
    """Every catalogue name :func:`op` takes, sorted."""
    return catalogue_names()
