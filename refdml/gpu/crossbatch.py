"""Fast-path mirror of :mod:`refdml.crossbatch`: ``cross_fit``, ``xml_loss`` and
``zero_shot_loss`` (XML Eqs. 2.10-2.11, GSP Sec. 4.3 / Algorithm 4), NumPy or CuPy,
float32 or float64. ``zero_shot_loss_printed`` is validation only (no mirror).

Same maths, names, defaults and context classes as the reference (``CrossFitContext``,
``XMLContext``, ``ZeroShotContext``), holding arrays of the input's module; the two ridge
fits are :mod:`refdml.gpu.prototypes`'s normalised fit, on the one exact rescaling of the
whole batch. The class embeddings' gradient as regression targets is gathered with a
one-hot matrix product (no ``add.at``).

Synchronisations: the halves' sizes (``flatnonzero`` of the split: two systems of
data-dependent size), the scaling of the fit (``max|Z|``, ``max|targets|``), the loss
value (a Python float, like the reference); with data checks on, the class-disjointness
of a given split and the definiteness of each system. A split drawn from ``rng`` is
drawn on the host from a copy of ``labels`` (the reference's ``draw_split``).
``xml_loss``'s default base loss is :func:`refdml.gpu.losses.contrastive`; any one-call
loss returning ``(value, grads)`` with ``grads.embeddings`` on the same device works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from refdml._validation import (
    _describe, as_fast_array, check_context, check_fast_upstream, check_rng, check_scalar,
    data_checks, fast_labels, result_dtype,
)
from refdml._backend import Backend, as_input_array, get_backend, to_numpy
from refdml._shared.crossbatch import draw_split
from refdml.crossbatch import (
    DEFAULT_ZERO_SHOT_SCALE,
    CrossFitContext,
    CrossFitGrads,
    XMLContext,
    XMLGrads,
    ZeroShotContext,
    ZeroShotGrads,
)
from refdml.gpu.distances import common_scale
from refdml.gpu import losses as _losses
from refdml.gpu.prototypes import (
    _fit_backward,
    _fit_normalised,
    _pow2_scaled,
    _scaling,
    _times_pow2,
)

__all__ = [
    "CrossFitContext",
    "CrossFitGrads",
    "XMLContext",
    "XMLGrads",
    "ZeroShotContext",
    "ZeroShotGrads",
    "cross_fit",
    "cross_fit_backward",
    "cross_fit_forward",
    "xml_loss",
    "xml_loss_backward",
    "xml_loss_forward",
    "zero_shot_loss",
    "zero_shot_loss_backward",
    "zero_shot_loss_forward",
]


def _pair(first, second, first_name, second_name):
    ns = get_backend(first, second)
    dtype = result_dtype(first, second) if hasattr(first, "dtype") and hasattr(
        second, "dtype") else None
    a = as_fast_array(first, first_name, ndim=2, dtype=dtype, ns=ns)
    b = as_fast_array(second, second_name, ndim=2, dtype=a.dtype, ns=ns)
    return ns, a, b


def _check_mask(ns: Backend, split, n_samples: int) -> Any:
    xp = ns.xp
    mask = as_input_array(split)
    if mask.dtype != bool:
        raise TypeError(f"split must be a boolean mask over the batch, got dtype {mask.dtype}")
    if tuple(mask.shape) != (n_samples,):
        raise ValueError(
            f"split has shape {tuple(mask.shape)}, expected ({n_samples},) (one per sample)")
    mask = xp.asarray(mask).copy()
    return mask


def _check_split(ns: Backend, split, labels, rng) -> Any:
    xp = ns.xp
    if split is None:
        return xp.asarray(draw_split(to_numpy(labels), check_rng(rng)))
    mask = _check_mask(ns, split, labels.shape[0])
    if data_checks(ns):
        crossing = (labels[:, None] == labels[None, :]) & (mask[:, None] != mask[None, :])
        if bool(xp.any(crossing)):
            shared = sorted({int(v) for v in to_numpy(labels[xp.any(crossing, axis=1)])})
            raise ValueError(
                f"split is not class-disjoint: classes {shared} are in both halves")
    return mask


def _cross_fit_kernel(ns: Backend, Z, targets, mask, ridge: float, Z_name: str = "Z"):
    xp = ns.xp
    first, second = xp.flatnonzero(mask), xp.flatnonzero(~mask)   # the halves' sizes: a sync each
    if first.size == 0 or second.size == 0:
        raise ValueError("split leaves one half empty; both halves need samples")
    sc, peak = _scaling(ns, Z, targets, ridge)
    Zs, Ts = _pow2_scaled(xp, Z, sc.log2_t), _pow2_scaled(xp, targets, sc.log2_s)
    fit_first = _fit_normalised(ns, Zs[first], Ts[first], sc, "auto", f"{Z_name}[split]",
                                ridge, peak)
    fit_second = _fit_normalised(ns, Zs[second], Ts[second], sc, "auto", f"{Z_name}[~split]",
                                 ridge, peak)
    scaled = xp.empty((Z.shape[0], targets.shape[1]), dtype=Z.dtype)
    scaled[first] = Zs[first] @ fit_second.W
    scaled[second] = Zs[second] @ fit_first.W
    predictions = _times_pow2(ns, scaled, sc.omega_mantissa, sc.log2_s + sc.omega_exponent,
                              "the cross predictions")
    ctx = CrossFitContext(first=first, second=second, fit_first=fit_first, fit_second=fit_second,
                          scaling=sc, shape=tuple(predictions.shape))
    return predictions, ctx


def _cross_fit_backward(ns: Backend, ctx: CrossFitContext, d_pred) -> CrossFitGrads:
    xp = ns.xp
    first, second, sc = ctx.first, ctx.second, ctx.scaling
    g_scale = common_scale(xp, d_pred)
    D = d_pred / g_scale
    D1, D2 = D[first], D[second]
    f1, f2 = ctx.fit_first, ctx.fit_second
    from_W1 = _fit_backward(ns, f1, f2.Zs.T @ D2)
    from_W2 = _fit_backward(ns, f2, f1.Zs.T @ D1)
    d_Zs = xp.empty((D.shape[0], f1.Zs.shape[1]), dtype=D.dtype)
    d_Ts = xp.empty_like(D)
    d_Zs[first] = D1 @ f2.W.T + from_W1[0]
    d_Zs[second] = D2 @ f1.W.T + from_W2[0]
    d_Ts[first] = from_W1[1]
    d_Ts[second] = from_W2[1]
    d_Z = _times_pow2(ns, d_Zs * g_scale, sc.omega_mantissa,
                      sc.log2_s + sc.omega_exponent - sc.log2_t, "the gradient of Z")
    d_T = _times_pow2(ns, d_Ts * g_scale, sc.omega_mantissa, sc.omega_exponent,
                      "the gradient of targets")
    return CrossFitGrads(Z=d_Z, targets=d_T)


def cross_fit_forward(Z, targets, split, *, ridge):
    """Cross predictions ``P`` (b, d): ``Z_1 V_2`` on half 1, ``Z_2 V_1`` on half 2;
    ``(P, ctx)``. See :func:`refdml.crossbatch.cross_fit_forward`."""
    ns, Z, targets = _pair(Z, targets, "Z", "targets")
    if Z.shape[0] != targets.shape[0]:
        raise ValueError(
            f"Z has {Z.shape[0]} rows but targets has {targets.shape[0]}; they must match")
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    mask = _check_mask(ns, split, Z.shape[0])
    return _cross_fit_kernel(ns, Z, targets, mask, ridge)


def cross_fit_backward(ctx: CrossFitContext, d_predictions) -> CrossFitGrads:
    """Gradients ``.Z`` (b, m) and ``.targets`` (b, d) of ``<d_predictions, P>``."""
    check_context(ctx, "ctx", CrossFitContext)
    ns = get_backend(ctx.fit_first.W)
    d = check_fast_upstream(d_predictions, "d_predictions", ctx.shape, ns, ctx.fit_first.W.dtype)
    return _cross_fit_backward(ns, ctx, d)


def cross_fit(Z, targets, split, *, ridge) -> Any:
    """Cross predictions (no context kept); see :func:`cross_fit_forward`."""
    return cross_fit_forward(Z, targets, split, ridge=ridge)[0]


# ----------------------------------------------------------------------------- XML loss


def _default_base_loss() -> Callable[..., Any]:
    from refdml.gpu.losses import contrastive

    return contrastive


def _apply_base_loss(ns, base_loss, embeddings, labels, kwargs, where: str):
    xp = ns.xp
    value, grads = base_loss(embeddings, labels, **kwargs)
    d_embeddings = grads.embeddings
    if tuple(d_embeddings.shape) != tuple(embeddings.shape):
        raise ValueError(
            f"base_loss returned a gradient of shape {tuple(d_embeddings.shape)} for embeddings "
            f"of shape {tuple(embeddings.shape)}"
        )
    value = float(value)
    if not np.isfinite(value) or (data_checks(ns) and not bool(xp.all(xp.isfinite(d_embeddings)))):
        peak = float(xp.max(xp.abs(embeddings)))
        raise ValueError(
            f"base_loss returned a non-finite value or gradient on {where} (max |entry| == "
            f"{peak:.3g}); the base loss cannot represent its result at this scale"
        )
    return value, xp.asarray(d_embeddings, dtype=embeddings.dtype)


def xml_loss_forward(Z, Y, labels, *, ridge, base_loss=None, base_loss_kwargs=None, split=None,
                     rng=None, lambda_: float = 1.0) -> tuple[float, XMLContext]:
    """XML loss, Eqs. (2.10)-(2.11): ``(1 - lambda_) l(Y) + lambda_ (l(Y_hat_1) + l(Y_hat_2))``;
    ``(value, ctx)``. See :func:`refdml.crossbatch.xml_loss_forward`."""
    ns, Z, Y = _pair(Z, Y, "Z", "Y")
    xp = ns.xp
    if Z.shape[0] != Y.shape[0]:
        raise ValueError(f"Z has {Z.shape[0]} rows but Y has {Y.shape[0]}; they must match")
    labels = fast_labels(labels, "labels", ns, length=Z.shape[0])
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    lambda_ = check_scalar(lambda_, "lambda_", low=0.0, high=1.0)
    if base_loss is None:
        base_loss = _default_base_loss()
    elif not callable(base_loss):
        raise TypeError(f"base_loss must be callable, got {_describe(base_loss)}")
    if base_loss_kwargs is not None and not isinstance(base_loss_kwargs, Mapping):
        raise TypeError(
            f"base_loss_kwargs must be a mapping, got {type(base_loss_kwargs).__name__}")
    kwargs = dict(base_loss_kwargs or {})
    mask = _check_split(ns, split, labels, rng)

    value = 0.0
    cross = None
    d_predictions = xp.zeros_like(Y)
    d_Y_dml = xp.zeros_like(Y)
    if lambda_ > 0.0:
        predictions, cross = _cross_fit_kernel(ns, Z, Y, mask, ridge)
        for half, where in ((cross.first, "the predictions of half 1"),
                            (cross.second, "the predictions of half 2")):
            half_value, half_grad = _apply_base_loss(
                ns, base_loss, predictions[half], labels[half], kwargs, where)
            value += lambda_ * half_value
            d_predictions[half] = lambda_ * half_grad
    if lambda_ < 1.0:
        dml_value, dml_grad = _apply_base_loss(ns, base_loss, Y, labels, kwargs, "Y")
        value += (1.0 - lambda_) * dml_value
        d_Y_dml = (1.0 - lambda_) * dml_grad
    if not np.isfinite(value):
        raise ValueError("the XML loss overflows float64")
    return value, XMLContext(cross=cross, d_predictions=d_predictions, d_Y_dml=d_Y_dml,
                             Z_shape=tuple(Z.shape))


def xml_loss_backward(ctx: XMLContext, d_value=1.0) -> XMLGrads:
    """Gradients ``.Z`` (b, m) and ``.Y`` (b, d) of ``d_value * L``."""
    check_context(ctx, "ctx", XMLContext)
    ns = get_backend(ctx.d_Y_dml)
    d_value = check_fast_upstream(d_value, "d_value", (), ns, ctx.d_Y_dml.dtype)
    d_Y = d_value * ctx.d_Y_dml
    if ctx.cross is None:
        return XMLGrads(Z=ns.xp.zeros(ctx.Z_shape, dtype=d_Y.dtype), Y=d_Y)
    cross = _cross_fit_backward(ns, ctx.cross, d_value * ctx.d_predictions)
    return XMLGrads(Z=cross.Z, Y=d_Y + cross.targets)


def xml_loss(Z, Y, labels, *, ridge, base_loss=None, base_loss_kwargs=None, split=None,
             rng=None, lambda_: float = 1.0):
    """One call: ``(value, grads)`` of :func:`xml_loss_forward` / :func:`xml_loss_backward`."""
    value, ctx = xml_loss_forward(Z, Y, labels, ridge=ridge, base_loss=base_loss,
                                  base_loss_kwargs=base_loss_kwargs, split=split, rng=rng,
                                  lambda_=lambda_)
    return value, xml_loss_backward(ctx)


# ------------------------------------------------------------------------ zero-shot loss


def zero_shot_loss_forward(Z, labels, class_embeddings, *, ridge: float = 0.05,
                           scale: float = DEFAULT_ZERO_SHOT_SCALE, split=None, rng=None):
    """Zero-shot regulariser, GSP Sec. 4.3 / Algorithm 4: softmax cross-entropy of
    ``scale * Upsilon_hat Upsilon^T``; ``(value, ctx)``. See
    :func:`refdml.crossbatch.zero_shot_loss_forward`."""
    ns, Z, class_embeddings = _pair(Z, class_embeddings, "Z", "class_embeddings")
    xp = ns.xp
    labels = fast_labels(labels, "labels", ns, length=Z.shape[0])
    n_classes = class_embeddings.shape[0]
    if data_checks(ns):
        outside = (labels < 0) | (labels >= n_classes)
        if bool(xp.any(outside)):
            bad = int(labels[xp.argmax(outside)])
            raise ValueError(f"labels contain {bad}, but class_embeddings has rows for "
                             f"classes 0..{n_classes - 1}")
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
    mask = _check_split(ns, split, labels, rng)
    b = Z.shape[0]
    predictions, cross = _cross_fit_kernel(ns, Z, class_embeddings[labels], mask, ridge)
    with ns.errstate(over="ignore", divide="ignore"):
        scores = scale * (predictions @ class_embeddings.T)
    if data_checks(ns) and not bool(xp.all(xp.isfinite(scores))):
        raise ValueError(
            "the scores scale * Upsilon_hat Upsilon^T overflow "
            f"{np.dtype(scores.dtype).name} (max |class_embeddings| == "
            f"{float(xp.max(xp.abs(class_embeddings))):.3g})")
    lse, softmax = _losses.IMPLEMENTATIONS.choose(scores).masked_logsumexp(scores, axis=1)
    onehot = (labels[:, None] == xp.arange(n_classes)[None, :]).astype(scores.dtype)
    value = float(xp.mean((lse - xp.sum(scores * onehot, axis=1)).astype(xp.float64)))
    d_scores = (softmax - onehot) / b
    return value, ZeroShotContext(cross=cross, d_scores=d_scores, scale=scale,
                                  predictions=predictions, class_embeddings=class_embeddings,
                                  labels=labels)


def zero_shot_loss_backward(ctx: ZeroShotContext, d_value=1.0) -> ZeroShotGrads:
    """Gradients ``.Z`` (b, m) and ``.class_embeddings`` (c, d) of ``d_value * L``."""
    check_context(ctx, "ctx", ZeroShotContext)
    ns = get_backend(ctx.d_scores)
    xp = ns.xp
    d_value = check_fast_upstream(d_value, "d_value", (), ns, ctx.d_scores.dtype)
    d_scores = d_value * ctx.d_scores
    d_pred = ctx.scale * d_scores @ ctx.class_embeddings
    d_classes = ctx.scale * d_scores.T @ ctx.predictions
    cross = _cross_fit_backward(ns, ctx.cross, d_pred)
    n_classes = ctx.class_embeddings.shape[0]
    onehot = (ctx.labels[:, None] == xp.arange(n_classes)[None, :]).astype(d_classes.dtype)
    return ZeroShotGrads(Z=cross.Z, class_embeddings=d_classes + onehot.T @ cross.targets)


def zero_shot_loss(Z, labels, class_embeddings, *, ridge: float = 0.05,
                   scale: float = DEFAULT_ZERO_SHOT_SCALE, split=None, rng=None):
    """One call: ``(value, grads)`` of :func:`zero_shot_loss_forward` / ``_backward``."""
    value, ctx = zero_shot_loss_forward(Z, labels, class_embeddings, ridge=ridge, scale=scale,
                                        split=split, rng=rng)
    return value, zero_shot_loss_backward(ctx)
