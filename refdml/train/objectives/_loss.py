"""``LossObjective``: any loss of :mod:`refdml.losses` (or its mirror) as an objective.

With ``reference=False`` (the default) the loss is the fast-path mirror
:mod:`refdml.gpu.losses` (NumPy or CuPy, the embeddings' dtype); ``reference=True`` runs
the float64 NumPy reference :mod:`refdml.losses`. Both give the same value and gradients
(1e-10 relative in float64, ``tests/train/test_train_objectives.py``).

Proxy losses (``proxy_anchor``, ``proxy_nca``, ``soft_triple``, and the pair losses between
samples and proxies ``proxy_contrastive``, ``proxy_multi_similarity``) own their proxies as a
:class:`~refdml.train.Parameter` ``"<name>.proxies"`` of shape
``(n_classes * proxies_per_class, dim)``, drawn N(0, 1/dim) from ``rng`` (rows of norm
about 1; the proxy losses are cosine losses, so only directions matter); proxy ``k``
belongs to class ``k // proxies_per_class`` (``proxy_labels``). The labels of a batch
must lie in ``0 .. n_classes - 1``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from refdml._validation import _describe, check_choice, check_rng
from refdml._backend import get_backend, is_array
from refdml.train._layer import init_array
from refdml.train._operators import check_reference, operators
from refdml.train.objectives._base import (
    Objective,
    check_d_value,
    check_positive_int,
    labels_on_device,
    output_value,
)

__all__ = ["LOSSES", "PROXY_LOSSES", "SAMPLE_PROXY_LOSSES", "LossObjective", "proxy_loss_name"]

PROXY_LOSSES = ("proxy_anchor", "proxy_nca", "soft_triple", "proxy_contrastive",
                "proxy_multi_similarity")
LOSSES = ("contrastive", "generalized_contrastive", "multi_similarity", "triplet") + PROXY_LOSSES
#: The pair losses that have a form between samples and proxies (:mod:`refdml.losses`'s
#: ``proxy_<name>``), and that form's name.
SAMPLE_PROXY_LOSSES = {"contrastive": "proxy_contrastive",
                       "multi_similarity": "proxy_multi_similarity"}


def proxy_loss_name(loss) -> str:
    """The loss with proxies that ``loss`` names: a proxy loss itself, or the
    sample-proxy form of a pair loss (``"contrastive"`` -> ``"proxy_contrastive"``)."""
    loss = SAMPLE_PROXY_LOSSES.get(loss, loss) if isinstance(loss, str) else loss
    return check_choice(loss, "loss", PROXY_LOSSES)

# Keywords of a loss's forward that the objective supplies itself.
_SUPPLIED = ("embeddings", "labels", "proxies", "proxy_labels")


def resolve_loss(loss, reference: bool, *, name: str = "loss") -> tuple[Callable, Callable, str]:
    """``(forward, backward, name)`` of a loss name or of a ``(forward, backward)`` pair.

    ``name`` is the parameter that holds ``loss`` (``"base"`` for a wrapping objective),
    named by the errors.
    """
    if isinstance(loss, str):
        pair = operators(reference).loss(check_choice(loss, name, LOSSES), parameter=name)
        return pair.forward, pair.backward, loss
    if (isinstance(loss, tuple) and len(loss) == 2 and callable(loss[0]) and callable(loss[1])):
        forward, backward = loss
        return forward, backward, getattr(forward, "__name__", "loss").removesuffix("_forward")
    raise TypeError(
        f"{name} must be a loss name {LOSSES} or a (forward, backward) pair, got {_describe(loss)}")


def check_hyperparameters(forward: Callable, hyperparameters: dict, loss_name: str) -> None:
    """Every hyperparameter is a keyword of the loss's forward (the values are the loss's
    to check, with its own messages, at the first forward)."""
    signature = inspect.signature(forward)
    accepts_any = any(p.kind is inspect.Parameter.VAR_KEYWORD
                      for p in signature.parameters.values())
    for key in hyperparameters:
        if key in _SUPPLIED:
            raise TypeError(f"{key} is supplied by the objective, not a hyperparameter of "
                            f"{loss_name}")
        if not accepts_any and key not in signature.parameters:
            allowed = [k for k in signature.parameters if k not in _SUPPLIED]
            raise TypeError(f"{key!r} is not a hyperparameter of {loss_name}; it takes {allowed}")


def _check_output_array(value, name: str, objective: str) -> None:
    if not is_array(value):
        raise TypeError(f"{objective}: outputs' {name} must be a NumPy or CuPy array (what the "
                        f"model returned), got {_describe(value)}")


def split_outputs(outputs, objective: str, *, pair: bool = False):
    """``(y, z)`` for a pair ``(y, z)``, ``(y, None)`` for one array (not allowed with ``pair``).

    Checks the structure only (arrays; ``y`` and ``z`` with one row per sample each); the
    operators check dtypes, ranks and values.
    """
    if isinstance(outputs, tuple):
        if len(outputs) != 2:
            raise TypeError(f"{objective}: outputs must be y or the pair (y, z), got a tuple of "
                            f"{len(outputs)}")
        y, z = outputs
        _check_output_array(y, "y", objective)
        _check_output_array(z, "z", objective)
        if y.ndim < 1 or z.ndim < 1 or y.shape[0] != z.shape[0]:
            raise ValueError(f"{objective}: outputs (y, z) must have one row per sample each, got "
                             f"y of shape {tuple(y.shape)} and z of shape {tuple(z.shape)}")
        return y, z
    if pair:
        raise TypeError(f"{objective}: outputs must be the pair (y, z) of a model with a "
                        f"histogram head, got {_describe(outputs)}")
    if isinstance(outputs, list):
        raise TypeError(f"{objective}: outputs must be an array y or a tuple (y, z), got a list")
    _check_output_array(outputs, "y", objective)
    return outputs, None


class LossObjective(Objective):
    """Any DML loss of :mod:`refdml.losses` as an objective on the embeddings ``y`` (B, d).

    Parameters
    ----------
    loss : str or (forward, backward)
        A name of :data:`LOSSES` (``"contrastive"``, ``"proxy_nca"``, ...) or a pair of
        callables with the losses' signature (a proxy loss when its forward takes
        ``proxies``).
    reference : bool
        Run :mod:`refdml.losses` (float64 NumPy) instead of :mod:`refdml.gpu.losses`.
    n_classes, dim : int
        Proxy losses only: number of classes and embedding dimension of the proxies.
    proxies_per_class : int
        Proxy losses only (default 1): proxies ``k * ppc .. (k + 1) * ppc - 1`` are class
        ``k``'s (SoftTriple's centres; ASAP's several proxies per class).
    rng : None, int or numpy Generator
        Draws the initial proxies.
    dtype, device : float32/float64, ``"cpu"`` (NumPy) or ``"cuda"`` (CuPy)
        Of the proxies; match the model's.
    **hyperparameters
        Keywords of the loss (``margin``, ``temperature``, ``reduction``, ...).

    Notes
    -----
    ``outputs`` may be ``y`` or ``(y, z)`` (a GSP model whose ``z`` this loss ignores: its
    gradient is ``None``, meaning zero, which :class:`~refdml.train.Sequential` accepts).
    """

    def __init__(self, loss, *, reference: bool = False, n_classes=None, dim=None,
                 proxies_per_class: int = 1, rng=None, dtype=np.float64, device: str = "cpu",
                 name: str | None = None, **hyperparameters) -> None:
        self.reference = check_reference(reference)
        self._forward, self._backward, self.loss_name = resolve_loss(loss, self.reference)
        super().__init__(name if name is not None else self.loss_name)
        check_hyperparameters(self._forward, hyperparameters, self.loss_name)
        self.hyperparameters = dict(hyperparameters)
        self.is_proxy_loss = "proxies" in inspect.signature(self._forward).parameters
        self.proxies = None
        self.proxy_labels = None
        if not self.is_proxy_loss:
            for key, value in (("n_classes", n_classes), ("dim", dim)):
                if value is not None:
                    raise ValueError(f"{key} is for proxy losses; {self.loss_name} has no proxies")
            if proxies_per_class != 1:
                raise ValueError(f"proxies_per_class == {proxies_per_class!r} is for proxy "
                                 f"losses; {self.loss_name} has no proxies")
            return
        for key, value in (("n_classes", n_classes), ("dim", dim)):
            if value is None:
                raise ValueError(f"{key} is required by the proxy loss {self.loss_name}")
        n_classes = check_positive_int(n_classes, "n_classes")
        dim = check_positive_int(dim, "dim")
        self.proxies_per_class = check_positive_int(proxies_per_class, "proxies_per_class")
        n_proxies = n_classes * self.proxies_per_class
        values = check_rng(rng).standard_normal((n_proxies, dim)) / np.sqrt(dim)
        self.proxies = self.add_parameter("proxies", init_array(values, dtype, device))
        self.n_classes = n_classes
        host_labels = np.repeat(np.arange(n_classes), self.proxies_per_class)
        self.proxy_labels = get_backend(self.proxies.value).xp.asarray(host_labels)

    def loss_forward(self, y, labels):
        """``(value, inner ctx)`` of the wrapped loss on ``y`` (no own context)."""
        if self.is_proxy_loss:
            return self._forward(y, labels, proxies=self.proxies.value,
                                 proxy_labels=self.proxy_labels, **self.hyperparameters)
        return self._forward(y, labels, **self.hyperparameters)

    def loss_backward(self, inner, d_value: float):
        """``d_y`` of ``d_value * value``; accumulates the proxies' gradient."""
        grads = self._backward(inner, d_value)
        if self.is_proxy_loss:
            self.proxies.accumulate(grads.proxies)
        return grads.embeddings

    def forward(self, outputs, labels):
        """``(value, ctx)`` of the loss on ``y`` (``outputs`` is ``y`` or ``(y, z)``)."""
        y, z = split_outputs(outputs, self.name)
        value, inner = self.loss_forward(y, labels_on_device(labels, y))
        value = output_value(value, y)
        shapes = (tuple(y.shape),) if z is None else (tuple(y.shape), tuple(z.shape))
        return value, self._context(inner, self.reference, shapes)

    def backward(self, ctx, d_value=1.0):
        """``d_y`` (or ``(d_y, None)`` for outputs ``(y, z)``); adds into the proxies' grad."""
        ctx = self._unwrap(ctx)
        d_y = self.loss_backward(ctx.inner, check_d_value(d_value))
        return d_y if len(ctx.output_shapes) == 1 else (d_y, None)
