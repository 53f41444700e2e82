"""The objective protocol shared by every objective of :mod:`refdml.train.objectives`.

An objective turns what the model returned into a scalar loss, by hand:

* ``parameters()``: its own trainable :class:`~refdml.train.Parameter` (proxies, class
  embeddings; possibly none);
* ``value, ctx = objective.forward(outputs, labels)``: ``outputs`` is the model's output,
  ``y`` (B, d), a pair ``(y, z)`` (a GSP model: the pooled vector and the attribute
  histogram), or local features (B, n, d) for the Wasserstein losses; ``value`` is a
  Python float on NumPy and a 0-d array of the outputs' dtype on CuPy (never read there:
  the caller reads it when it logs, one synchronisation then); ``labels`` a NumPy or
  CuPy array (host labels with device outputs are uploaded here, and spare the objectives
  that need them on the host, for a split, one transfer); ``ctx`` a frozen
  :class:`ObjectiveContext`;
* ``d_outputs = objective.backward(ctx, d_value=1.0)``: the gradient of
  ``d_value * value`` w.r.t. ``outputs``, with the same structure (``d_y`` or
  ``(d_y, d_z)``); it ADDS the gradient of its own parameters into their ``.grad``
  (call :meth:`Objective.zero_grad` between steps, like a layer).

No state is kept between a forward and its backward on the objective itself: the
context is the record (two forwards before one backward are fine).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._deferred import staged_upload
from refdml._validation import _describe, check_context
from refdml._backend import get_backend, is_array, to_numpy
from refdml.train._dense import _positive_int
from refdml.train._layer import OwnerToken, ParameterOwner, check_owner

__all__ = ["Objective", "ObjectiveContext"]


@dataclass(frozen=True)
class ObjectiveContext:
    """The wrapped operators' contexts and which objective made them.

    ``inner``: the loss's own context (or a tuple of contexts, one per term, ``None`` for a
    term with weight 0); ``reference``: which implementation made them; ``objective``: the
    :class:`~refdml.train._layer.OwnerToken` of the objective whose forward returned it
    (never its ``id``, which a later object may reuse); ``output_shapes``: shape of each
    output (for the zeros of an unused one); ``extra``: per-objective arrays (ASAP's
    ``theta - theta*``).
    """

    inner: Any
    reference: bool
    objective: OwnerToken
    output_shapes: tuple
    extra: tuple = ()


def check_positive_int(value, name: str) -> int:
    """An int >= 1 that NumPy can hold (the layers' check: one wording for both)."""
    return _positive_int(value, name)


def check_d_value(d_value) -> float:
    """A real, finite scalar (a Python/NumPy number or a 0-d NumPy/CuPy array) as a float."""
    if is_array(d_value):
        if d_value.shape != ():
            raise ValueError(f"d_value must be a scalar, got shape {tuple(d_value.shape)}")
        if not np.issubdtype(np.dtype(d_value.dtype), np.floating) and not np.issubdtype(
                np.dtype(d_value.dtype), np.integer):
            raise TypeError(f"d_value must be real, got dtype {d_value.dtype}")
        d_value = float(d_value)
    if isinstance(d_value, bool) or not isinstance(d_value, numbers.Real):
        raise TypeError(f"d_value must be a real number, got {_describe(d_value)}")
    d_value = float(d_value)
    if not np.isfinite(d_value):
        raise ValueError(f"d_value == {d_value}, must be finite")
    return d_value


def labels_on_device(labels, like):
    """``labels`` on the module of ``like`` (the outputs): host labels with device outputs
    are uploaded (no synchronisation), or taken from the buffer a captured step staged them
    in before the step (:func:`refdml._deferred.staged_upload`, key ``"labels"``); anything
    else is left to the operators' checks."""
    if isinstance(labels, np.ndarray):      # an upload on CuPy, itself on NumPy
        return staged_upload(get_backend(like).xp, labels, "labels")
    return labels


def host_labels(labels) -> np.ndarray:
    """``labels`` on the host: free for host labels, one transfer for device ones."""
    return to_numpy(labels)


def output_value(value, like):
    """A loss value as the objectives return it: a 0-d array of ``like``'s dtype where the
    operators left it on the device (not read), else as it is (a Python float)."""
    if isinstance(value, numbers.Real):     # read already (NumPy, or a host float)
        return value
    return value.astype(like.dtype, copy=False)


_SKIP = object()  # marks an attribute that config() does not record (arrays, generators)


class Objective(ParameterOwner):
    """Base class: named parameters and the context bookkeeping (see the module doc).

    The parameters' methods (``add_parameter``, ``parameters``, ``named_parameters``,
    ``zero_grad``) are :class:`~refdml.train._layer.ParameterOwner`'s, shared with the
    layers; a wrapping objective's :meth:`parameters` yields its base's too.
    """

    def config(self) -> dict:
        """Its hyperparameters as plain JSON values (what ``Trainer`` records and compares).

        The class, the name, every public attribute that is a number, string, bool or a
        tuple/list/dict of them, a wrapped objective's own ``config()``, and the shapes and
        dtypes of its parameters; never a ``repr`` with an object address, so a resumed run
        can check it is the same objective.
        """
        def plain(value):
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            if isinstance(value, np.generic):
                return value.item()
            if isinstance(value, (tuple, list)):
                items = [plain(v) for v in value]
                return items if all(i is not _SKIP for i in items) else _SKIP
            if isinstance(value, dict):
                items = {str(k): plain(v) for k, v in value.items()}
                return items if all(i is not _SKIP for i in items.values()) else _SKIP
            if isinstance(value, Objective):
                return value.config()
            if isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic)):
                return np.dtype(value).name
            return _SKIP

        config = {"class": type(self).__name__}
        for key, value in sorted(vars(self).items()):
            if key.startswith("_"):
                continue
            converted = plain(value)
            if converted is not _SKIP:
                config[key] = converted
        config["parameters"] = {
            name: {"shape": list(p.shape), "dtype": p.dtype.name} for name, p in self.named_parameters()
        }
        return config

    def state_dict(self) -> dict:
        """State that is not a parameter (a split generator, ASAP's ``theta*``)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; an objective without such state takes ``{}`` only."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict, got {_describe(state)}")
        if state:
            raise ValueError(f"state for {self.name} must be empty ({type(self).__name__} keeps "
                             "no state but its parameters), got the keys "
                             f"{sorted(map(str, state))}")

    def _context(self, inner, reference, output_shapes, extra=()) -> ObjectiveContext:
        return ObjectiveContext(inner, reference, self._owner_token, tuple(output_shapes),
                                tuple(extra))

    def _unwrap(self, ctx) -> ObjectiveContext:
        check_context(ctx, "ctx", ObjectiveContext)
        check_owner(ctx.objective, self._owner_token)
        return ctx

    def __call__(self, outputs, labels):
        return self.forward(outputs, labels)

    def forward(self, outputs, labels):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, ctx, d_value=1.0):  # pragma: no cover - abstract
        raise NotImplementedError


def rng_state(rng: np.random.Generator) -> dict:
    return {"rng": rng.bit_generator.state}


def load_rng_state(rng: np.random.Generator, state: dict, name: str) -> None:
    if not isinstance(state, dict) or "rng" not in state:
        raise ValueError(f"state for {name} must be a dict with the key 'rng'")
    rng.bit_generator.state = state["rng"]
