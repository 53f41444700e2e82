"""The XML loss, XML Eqs. (2.10)-(2.11), as a forward/backward pair."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    as_float_array,
    as_label_array,
    check_context,
    check_same_length,
    check_scalar,
    check_upstream,
)
from refdml.crossbatch._cross_fit import (
    CrossFitContext,
    cross_fit_backward_kernel,
    cross_fit_kernel,
)
from refdml.crossbatch._split import check_split

__all__ = ["XMLContext", "XMLGrads", "xml_loss", "xml_loss_backward", "xml_loss_forward"]


@dataclass(frozen=True)
class XMLGrads:
    Z: np.ndarray
    Y: np.ndarray


@dataclass(frozen=True)
class XMLContext:
    """The cross fit and the base loss's gradients, taken in the forward.

    ``d_predictions`` is ``lambda_ * d(l(Y_hat_1) + l(Y_hat_2)) / dY_hat`` (zeros when
    ``lambda_ == 0``, then ``cross`` is None), ``d_Y_dml`` is ``(1 - lambda_) dl(Y)/dY``.
    The base loss is a one-call ``value, grads`` function, so its gradient is kept here
    rather than recomputed (it costs one (b, d) array).
    """

    cross: CrossFitContext | None
    d_predictions: np.ndarray
    d_Y_dml: np.ndarray
    Z_shape: tuple[int, int]


def _default_base_loss() -> Callable[..., Any]:
    from refdml.losses import contrastive

    return contrastive


def _check_base_loss_kwargs(base_loss, kwargs: dict) -> None:
    """``TypeError`` naming ``base_loss_kwargs`` when ``base_loss`` cannot take them (an
    unknown keyword, say), rather than Python's error from inside the call."""
    try:
        signature = inspect.signature(base_loss)
    except (TypeError, ValueError):   # no signature to read (a builtin): left to the call
        return
    try:
        signature.bind(None, None, **kwargs)
    except TypeError as error:
        name = getattr(base_loss, "__name__", type(base_loss).__name__)
        raise TypeError(
            f"base_loss_kwargs {sorted(kwargs)} do not fit base_loss {name}: {error}"
        ) from None


def _apply_base_loss(base_loss, embeddings, labels, kwargs, where: str) -> tuple[float, np.ndarray]:
    returned = base_loss(embeddings, labels, **kwargs)
    if not (isinstance(returned, tuple) and len(returned) == 2
            and hasattr(returned[1], "embeddings")):
        raise TypeError(
            "base_loss must return (value, grads) with grads.embeddings, as the one-call "
            f"losses of refdml.losses do; got {type(returned).__name__}"
        )
    value, grads = returned
    d_embeddings = np.asarray(grads.embeddings, dtype=np.float64)
    if d_embeddings.shape != embeddings.shape:
        raise ValueError(
            f"base_loss returned a gradient of shape {d_embeddings.shape} for embeddings of "
            f"shape {embeddings.shape}"
        )
    value = float(value)
    if not (np.isfinite(value) and np.all(np.isfinite(d_embeddings))):
        peak = float(np.max(np.abs(embeddings), initial=0.0))
        raise ValueError(
            f"base_loss returned a non-finite value or gradient on {where} (max |entry| == "
            f"{peak:.3g}); the base loss cannot represent its result at this scale"
        )
    return value, d_embeddings


def xml_loss_forward(
    Z,
    Y,
    labels,
    *,
    ridge,
    base_loss: Callable[..., Any] | None = None,
    base_loss_kwargs: Mapping[str, Any] | None = None,
    split=None,
    rng=None,
    lambda_: float = 1.0,
) -> tuple[float, XMLContext]:
    r"""Cross-batch metric learning loss, XML Eqs. (2.10)-(2.11); returns ``(value, ctx)``.

    .. math::

        V_k = \arg\min_V \|Z_k V - Y_k\|_F^2 + \epsilon \|V\|_F^2, \quad
        \hat Y_1 = Z_1 V_2, \quad \hat Y_2 = Z_2 V_1,

        \mathcal{L} = (1 - \lambda)\, \ell(Y, L)
                      + \lambda \big(\ell(\hat Y_1, L_1) + \ell(\hat Y_2, L_2)\big),

    where ``(Z_k, Y_k, L_k)`` are the two class-disjoint halves and ``ell`` the base loss.
    With the default ``lambda_ = 1`` the value is ``L_XML`` alone (and the base loss is
    not evaluated on ``Y``); ``lambda_ = 0`` gives ``L_DML`` alone.

    Parameters
    ----------
    Z : array (b, m)
        Histograms (XML Eq. 2.4), one row per sample.
    Y : array (b, d)
        Embeddings (GAP representations).
    labels : int array (b,)
        Class labels; at least two classes.
    ridge : float > 0
        Ridge weight of each half's fit: the paper's ϵ (epsilon) of XML Eq. (2.8).
    base_loss : callable, optional
        ``value, grads = base_loss(embeddings, labels, **base_loss_kwargs)`` with
        ``grads.embeddings``; any one-call loss of :mod:`refdml.losses`. Default
        :func:`refdml.losses.contrastive`.
    base_loss_kwargs : mapping, optional
        Keyword arguments of the base loss.
    split : bool array (b,), optional
        Fixes the halves (``True`` = half 1); must be class-disjoint. Default: drawn by
        :func:`class_disjoint_split` from ``rng``.
    rng : None, int or numpy.random.Generator
        Draws the split when ``split`` is None.
    lambda_ : float in [0, 1]
        The ``lambda`` of Eq. (2.11).

    Notes
    -----
    Extreme input: the cross fit is exact at any finite scale of ``Z`` and ``Y``
    (:func:`refdml.prototypes.ridge_fit`); a base loss that cannot represent its value
    or gradient there gives a ``ValueError`` saying so, never a NaN.
    """
    Z = as_float_array(Z, "Z", ndim=2)
    Y = as_float_array(Y, "Y", ndim=2)
    check_same_length(Z, "Z", Y, "Y")
    labels = as_label_array(labels, "labels", length=Z.shape[0])
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    lambda_ = check_scalar(lambda_, "lambda_", low=0.0, high=1.0)
    if base_loss is None:
        base_loss = _default_base_loss()
    elif not callable(base_loss):
        raise TypeError(f"base_loss must be callable, got {base_loss!r}")
    if base_loss_kwargs is not None and not isinstance(base_loss_kwargs, Mapping):
        raise TypeError(f"base_loss_kwargs must be a mapping, got {type(base_loss_kwargs).__name__}")
    kwargs = dict(base_loss_kwargs or {})
    _check_base_loss_kwargs(base_loss, kwargs)
    mask = check_split(split, labels, rng)

    value = 0.0
    cross = None
    d_predictions = np.zeros_like(Y)
    d_Y_dml = np.zeros_like(Y)
    if lambda_ > 0.0:
        predictions, cross = cross_fit_kernel(Z, Y, mask, ridge)
        for half, where in ((mask, "the predictions of half 1"), (~mask, "the predictions of half 2")):
            half_value, half_grad = _apply_base_loss(
                base_loss, predictions[half], labels[half], kwargs, where
            )
            value += lambda_ * half_value
            d_predictions[half] = lambda_ * half_grad
    if lambda_ < 1.0:
        dml_value, dml_grad = _apply_base_loss(base_loss, Y, labels, kwargs, "Y")
        value += (1.0 - lambda_) * dml_value
        d_Y_dml = (1.0 - lambda_) * dml_grad
    if not np.isfinite(value):
        raise ValueError("the XML loss overflows float64")
    return value, XMLContext(cross, d_predictions, d_Y_dml, Z.shape)


def xml_loss_backward(ctx: XMLContext, d_value=1.0) -> XMLGrads:
    """Gradients ``.Z`` (b, m) and ``.Y`` (b, d) of ``d_value * L``, through the closed-form fits.

    ``d_value`` is the scalar upstream gradient (default 1.0, a convenience).
    """
    check_context(ctx, "ctx", XMLContext)
    d_value = float(check_upstream(d_value, "d_value", ()))
    d_Y = d_value * ctx.d_Y_dml
    if ctx.cross is None:
        return XMLGrads(Z=np.zeros(ctx.Z_shape), Y=d_Y)
    cross = cross_fit_backward_kernel(ctx.cross, d_value * ctx.d_predictions)
    return XMLGrads(Z=cross.Z, Y=d_Y + cross.targets)


def xml_loss(Z, Y, labels, *, ridge, base_loss=None, base_loss_kwargs=None, split=None, rng=None,
             lambda_: float = 1.0) -> tuple[float, XMLGrads]:
    """One call: ``(value, grads)`` of :func:`xml_loss_forward` / :func:`xml_loss_backward`."""
    value, ctx = xml_loss_forward(Z, Y, labels, ridge=ridge, base_loss=base_loss,
                                  base_loss_kwargs=base_loss_kwargs, split=split, rng=rng,
                                  lambda_=lambda_)
    return value, xml_loss_backward(ctx)
