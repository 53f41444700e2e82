"""The NumPy side of :mod:`refdml.jax`: what runs inside ``jax.pure_callback``.

Nothing here imports JAX. A :class:`HostOp` is one row of :data:`refdml._interop.BRIDGED`
with its hyperparameters and the names of the arrays given; its :meth:`~HostOp.forward`
and :meth:`~HostOp.backward` take and return NumPy arrays, as ``pure_callback`` hands them.

Precision. A float64 input is computed in float64; float32, float16 and bfloat16 inputs in
the row's ``low_precision`` (float32, or float64 for the entropic OT operators), after a
cast here, on the host: JAX's float64 needs its x64 mode, which a float32 model may not
have on, while NumPy always has it. Outputs come back in the dtype of the differentiated
inputs and each gradient in its input's dtype (one rounding, NumPy's cast; bfloat16 is
the ``ml_dtypes`` type JAX itself hands a callback).

Subnormals. XLA's CPU runtime runs a callback on its own thread with denormals flushed to
zero (the FTZ/DAZ bits of the floating-point control register are per thread), so NumPy
inside a callback reads 1e-310 as 0: an L2 normalisation of a tiny row would find a zero
vector, and a gradient of 1e-155 squared would vanish. refdml runs on one worker thread of
its own instead (:func:`start_worker`, started from the user's thread, whose floating-point
environment a new thread inherits), where IEEE arithmetic holds as it does in refdml
everywhere else; the callback waits for it.

Errors. refdml's input errors (a NaN, ``mu`` out of range) are raised inside the callback,
where JAX turns them into a ``JaxRuntimeError`` carrying the traceback as text. The last
one raised is kept (one slot, replaced by the next) so that the JAX side can raise the
original exception where the callback ran eagerly (:func:`take_error`).
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from refdml._interop import BridgedOp, flat_outputs, named_gradients

__all__ = ["HostOp", "compute_dtype", "start_worker", "take_error"]

_LOCK = threading.Lock()
_LAST_ERROR: list[BaseException] = []
_WORKER: list[ThreadPoolExecutor] = []


if hasattr(os, "register_at_fork"):
    # A forked child has no copy of the worker's thread: it starts its own at its first call.
    os.register_at_fork(after_in_child=_WORKER.clear)


def start_worker() -> None:
    """Start refdml's worker thread, once, from the calling thread (not a callback's)."""
    with _LOCK:
        if not _WORKER:
            worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refdml-jax")
            # Its one thread is spawned by the first task: spawn it here, so that it inherits
            # this thread's floating-point environment, not that of an XLA thread.
            worker.submit(int).result()
            _WORKER.append(worker)


def _on_worker(method: Callable[..., Any], *args: Any) -> Any:
    if not _WORKER:   # a compiled callback run before any op was called in this process
        return method(*args)
    return _WORKER[0].submit(method, *args).result()


def _keep_error(error: BaseException) -> None:
    # One slot: at most the last failed call's exception (and the frames of its traceback,
    # which show where refdml refused the input) is held, until the next call of an op.
    error.refdml_callback_error = True   # refdml.jax's log filter drops JAX's log of it
    with _LOCK:
        _LAST_ERROR[:] = [error]


def take_error() -> BaseException | None:
    """The last exception a callback raised (then forgotten), or None."""
    with _LOCK:
        return _LAST_ERROR.pop() if _LAST_ERROR else None


def _callback(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` run on refdml's worker thread, its exception kept for :func:`take_error`."""
    @functools.wraps(method)
    def run(*args: Any) -> Any:
        try:
            return _on_worker(method, *args)
        except Exception as error:
            _keep_error(error)
            raise
    return run


def compute_dtype(dtype: np.dtype, low_precision: str) -> np.dtype:
    """The dtype refdml computes an input of ``dtype`` in."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(low_precision)


class HostOp:
    """One bridged operator with fixed hyperparameters, on the host.

    ``names`` are the array arguments given, in the row's order: the arrays each callback
    receives, in that order.
    """

    def __init__(self, spec: BridgedOp, options: Mapping[str, Any], names: tuple[str, ...]):
        self.spec = spec
        self.options = dict(options)
        self.names = names
        self.floating = tuple(k for k, name in enumerate(names) if name in spec.differentiable)

    def _inputs(self, arrays: tuple[Any, ...]) -> tuple[dict[str, np.ndarray], np.dtype, np.dtype]:
        """refdml's keyword arrays, the inputs' floating dtype and the compute dtype."""
        arrays = tuple(np.asarray(array) for array in arrays)
        like = arrays[self.floating[0]].dtype
        compute = compute_dtype(like, self.spec.low_precision)
        inputs = {name: array.astype(compute, copy=False) if k in self.floating else array
                  for k, (name, array) in enumerate(zip(self.names, arrays))}
        return inputs, like, compute

    @_callback
    def forward(self, *arrays: Any) -> tuple[np.ndarray, ...]:
        """The outputs of the operator on ``arrays``, in the inputs' floating dtype."""
        inputs, like, _ = self._inputs(arrays)
        outputs, _ = self.spec.forward(**inputs, **self.options)
        return tuple(np.asarray(output).astype(like, copy=False)
                     for output in flat_outputs(outputs))

    @_callback
    def backward(self, *arrays_and_cotangents: Any) -> tuple[np.ndarray, ...]:
        """The gradients of the given differentiable arrays, each in its dtype.

        Takes the inputs followed by one cotangent per output. JAX keeps arrays, not
        refdml's context object, between forward and backward, so the forward is run again
        here on the same inputs to rebuild the context, then refdml's hand-derived backward
        runs on it.
        """
        n = len(self.names)
        given = tuple(np.asarray(array) for array in arrays_and_cotangents[:n])
        inputs, _, compute = self._inputs(given)
        _, context = self.spec.forward(**inputs, **self.options)
        cotangents = [np.asarray(c).astype(compute, copy=False)
                      for c in arrays_and_cotangents[n:]]
        grads = named_gradients(self.spec.backward(context, *cotangents),
                                self.spec.differentiable)
        by_name = dict(zip(self.spec.differentiable, grads))
        result = []
        for k in self.floating:
            array, grad = given[k], by_name[self.names[k]]
            result.append(np.zeros(array.shape, array.dtype) if grad is None
                          else np.asarray(grad).astype(array.dtype, copy=False)
                          .reshape(array.shape))
        return tuple(result)
