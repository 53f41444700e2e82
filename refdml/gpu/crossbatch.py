"""Fast-path mirror of :mod:`refdml.crossbatch`: ``cross_fit``, ``xml_loss`` and
``zero_shot_loss`` (XML Eqs. 2.10-2.11, GSP Sec. 4.3 / Algorithm 4), NumPy or CuPy,
float32 or float64. ``zero_shot_loss_printed`` is validation only (no mirror).

Same maths, names, defaults and context classes as the reference (``CrossFitContext``,
``XMLContext``, ``ZeroShotContext``), holding arrays of the input's module; the two ridge
fits are :mod:`refdml.gpu.prototypes`'s normalised fit, on the one exact rescaling of the
whole batch. The class embeddings' gradient as regression targets is gathered with a
one-hot matrix product (no ``add.at``).

The halves are taken from the split on the host (drawn there from the labels, as the
reference's ``draw_split``, or given), their rows gathered once in one order (half 1,
then half 2) so that each half is a slice; the contexts are the reference's classes
extended with that order (and the zero-shot loss's one-hot labels).

Synchronisations: none for labels and split given on the host (a split drawn from
``rng`` reads host labels); device labels or a device split are read once each. The
zero-shot value is a 0-d float64 device array on CuPy (a float on NumPy); the XML value is
read (a Python float, like its base loss's). With data checks on: the labels' range, the
class-disjointness of a given split (on the host), the definiteness of each system and
the finiteness of the scores.
``xml_loss``'s default base loss is :func:`refdml.gpu.losses.contrastive`; any one-call
loss returning ``(value, grads)`` with ``grads.embeddings`` on the same device works.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    _describe, as_fast_array, check_context, check_fast_upstream, check_rng, check_scalar,
    data_checks, fast_labels, result_dtype,
)
from refdml._backend import Backend, as_input_array, get_backend, to_numpy
from refdml._deferred import staged_upload
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
from refdml.gpu import losses as _losses
from refdml.gpu.linalg import matmul
from refdml.gpu.prototypes import (
    _fit_backward,
    _fit_kernel_pair,
    _fit_normalised,
    _kernel_pair_backward,
    _neg_log2_scale,
    _peak,
    _scaled64,
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


def _check_mask(split, n_samples: int) -> np.ndarray:
    """The split as a host boolean mask (a copy; one transfer when it is on the device)."""
    mask = as_input_array(split)
    if mask.dtype != bool:
        raise TypeError(f"split must be a boolean mask over the batch, got dtype {mask.dtype}")
    if tuple(mask.shape) != (n_samples,):
        raise ValueError(
            f"split has shape {tuple(mask.shape)}, expected ({n_samples},) (one per sample)")
    return np.array(to_numpy(mask), dtype=bool)


def _host_labels(given, labels) -> np.ndarray:
    """``labels`` on the host: ``given`` itself when it came from the host (free), else one
    transfer (``given`` passed the checks that made ``labels``: the same values)."""
    del labels
    return to_numpy(given).astype(np.int64, copy=False)


def _check_split(ns: Backend, split, host_labels: np.ndarray, rng) -> np.ndarray:
    """The host mask of the halves: drawn from ``rng`` on the host labels (the reference's
    ``draw_split``), or the given ``split``, checked class-disjoint on the host."""
    if split is None:
        return draw_split(host_labels, check_rng(rng))
    mask = _check_mask(split, host_labels.shape[0])
    if data_checks(ns):
        shared = np.intersect1d(host_labels[mask], host_labels[~mask])
        if shared.size:
            raise ValueError(
                f"split is not class-disjoint: classes {shared.tolist()} are in both halves")
    return mask


@dataclass(frozen=True)
class _CrossFit(CrossFitContext):
    """The reference's ``CrossFitContext`` (``first``, ``second``: device indices of the
    halves) with the permutation the fast path works in: ``order`` lists half 1's rows then
    half 2's (``first`` and ``second`` are its two slices), ``inverse`` undoes it."""

    order: Any = None
    inverse: Any = None
    joint: Any = None       # both halves' kernel systems' one factor (None: two systems)


#: :func:`refdml._deferred.staged_upload`'s key of the split's index (:func:`split_index`).
SPLIT_INDEX_KEY = "refdml.gpu.crossbatch.split_index"


def split_index(mask: np.ndarray, target_rows: np.ndarray | None = None) -> np.ndarray:
    """The host index the cross fit uploads for a split ``mask`` (bool (b,)): ``order``
    (half 1's rows, then half 2's), its inverse and, with ``target_rows``, the target rows
    in that order, concatenated: what a step stages before a captured region
    (:func:`zero_shot_staged_uploads`)."""
    order = np.concatenate([np.flatnonzero(mask), np.flatnonzero(~mask)])
    parts = [order, np.argsort(order)]
    if target_rows is not None:
        parts.append(np.asarray(target_rows, dtype=order.dtype)[order])
    return np.concatenate(parts)


def zero_shot_staged_uploads(labels: np.ndarray, split: np.ndarray) -> dict[str, np.ndarray]:
    """``{key: host array}`` of what :func:`zero_shot_loss_forward` uploads for host
    ``labels`` and a given ``split``: the labels (int64) and the split's index. A captured
    training step puts these into its staged buffers before the captured region."""
    labels = np.asarray(labels).astype(np.int64, copy=False)
    return {"labels": labels, SPLIT_INDEX_KEY: split_index(np.asarray(split, dtype=bool),
                                                           labels)}


def _cross_fit_kernel(ns: Backend, Z, targets, mask: np.ndarray, ridge: float,
                      Z_name: str = "Z", target_rows: np.ndarray | None = None):
    """Both halves' fits on the rows gathered once in ``order`` (each half a slice), from
    the host ``mask``: no size is read back from the device. ``target_rows`` (host
    integers, one per sample): the targets are those rows of ``targets``, gathered once
    in that order (their index travels with the order's)."""
    xp = ns.xp
    first, second = np.flatnonzero(mask), np.flatnonzero(~mask)
    if first.size == 0 or second.size == 0:
        raise ValueError("split leaves one half empty; both halves need samples")
    b, n1 = mask.shape[0], first.size
    # One upload (or none: a captured step staged it before the step, staged_upload)
    index = staged_upload(xp, split_index(mask, target_rows), SPLIT_INDEX_KEY)
    order, inverse = index[:b], index[b:2 * b]
    ordered_targets = targets[order] if target_rows is None else targets[index[2 * b:]]
    # max|targets| is that of their rows in any order
    sc = _scaling(ns, Z, ordered_targets, ridge)
    Zs = _scaled64(ns, Z[order], sc.neg_log2_t)
    Ts = _scaled64(ns, ordered_targets, sc.neg_log2_s)

    def peak():
        return _peak(ns, Z)

    names = (f"{Z_name}[split]", f"{Z_name}[~split]")
    joint = None
    if Z.shape[1] > max(n1, b - n1):        # both halves in the kernel form ("auto")
        (fit_first, fit_second), joint = _fit_kernel_pair(ns, Zs, Ts, n1, sc, names, ridge,
                                                          peak, Z.dtype)
    else:
        fit_first = _fit_normalised(ns, Zs[:n1], Ts[:n1], sc, "auto", names[0], ridge, peak,
                                    dtype=Z.dtype)
        fit_second = _fit_normalised(ns, Zs[n1:], Ts[n1:], sc, "auto", names[1], ridge, peak,
                                     dtype=Z.dtype)
    scaled = xp.empty((b, targets.shape[1]), dtype=np.float64)
    matmul(ns, fit_first.Zs, fit_second.W, out=scaled[:n1])
    matmul(ns, fit_second.Zs, fit_first.W, out=scaled[n1:])
    predictions = _times_pow2(ns, scaled[inverse], sc.omega_mantissa,
                              sc.omega_exponent - sc.neg_log2_s, "the cross predictions",
                              dtype=Z.dtype)
    ctx = _CrossFit(first=order[:n1], second=order[n1:], fit_first=fit_first,
                    fit_second=fit_second, scaling=sc, shape=tuple(predictions.shape),
                    order=order, inverse=inverse, joint=joint)
    return predictions, ctx


def _check_fast_cross(cross) -> None:
    if not isinstance(cross, _CrossFit):
        raise TypeError("ctx must come from refdml.gpu.crossbatch's forward (its cross fit "
                        f"keeps the halves' order), got a {type(cross).__name__} of another")


def _cross_fit_backward(ns: Backend, ctx: _CrossFit, d_pred) -> CrossFitGrads:
    xp = ns.xp
    sc, n1 = ctx.scaling, ctx.fit_first.Zs.shape[0]
    # omega_mantissa d_pred / g, g = common_scale(d_pred) (a power of two: exact), in
    # float64 and in the halves' order: the gradients are linear in d_pred, so the
    # mantissa is applied once here and g goes back in through the final exponents.
    neg_log2_g = _neg_log2_scale(ns, d_pred)
    D = xp.ldexp(xp.multiply(d_pred[ctx.order], sc.omega_mantissa, dtype=np.float64),
                 neg_log2_g)
    D1, D2 = D[:n1], D[n1:]
    f1, f2 = ctx.fit_first, ctx.fit_second
    d_W1, d_W2 = matmul(ns, f2.Zs.T, D2), matmul(ns, f1.Zs.T, D1)
    if ctx.joint is not None:
        ((d_Zs1, _), (d_Zs2, _)), d_Ts = _kernel_pair_backward(ns, (f1, f2), ctx.joint,
                                                              (d_W1, d_W2))
    else:
        d_Zs1, d_Ts1 = _fit_backward(ns, f1, d_W1)
        d_Zs2, d_Ts2 = _fit_backward(ns, f2, d_W2)
        d_Ts = xp.concatenate([d_Ts1, d_Ts2])
    d_Zs = xp.empty((D.shape[0], f1.Zs.shape[1]), dtype=np.float64)
    matmul(ns, D1, f2.W.T, out=d_Zs[:n1])
    matmul(ns, D2, f1.W.T, out=d_Zs[n1:])
    # in place through out=: no copy back through __setitem__
    xp.add(d_Zs[:n1], d_Zs1, out=d_Zs[:n1])
    xp.add(d_Zs[n1:], d_Zs2, out=d_Zs[n1:])
    d_Ts = d_Ts[ctx.inverse]
    exponent_T = sc.omega_exponent - neg_log2_g
    d_Z = _times_pow2(ns, d_Zs[ctx.inverse], None,
                      exponent_T + sc.neg_log2_t - sc.neg_log2_s, "the gradient of Z",
                      dtype=f1.dtype)
    d_T = _times_pow2(ns, d_Ts, None, exponent_T, "the gradient of targets", dtype=f1.dtype)
    return CrossFitGrads(Z=d_Z, targets=d_T)


def cross_fit_forward(Z, targets, split, *, ridge):
    """Cross predictions ``P`` (b, d): ``Z_1 V_2`` on half 1, ``Z_2 V_1`` on half 2;
    ``(P, ctx)``. See :func:`refdml.crossbatch.cross_fit_forward`."""
    ns, Z, targets = _pair(Z, targets, "Z", "targets")
    if Z.shape[0] != targets.shape[0]:
        raise ValueError(
            f"Z has {Z.shape[0]} rows but targets has {targets.shape[0]}; they must match")
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    mask = _check_mask(split, Z.shape[0])
    return _cross_fit_kernel(ns, Z, targets, mask, ridge)


def cross_fit_backward(ctx: CrossFitContext, d_predictions) -> CrossFitGrads:
    """Gradients ``.Z`` (b, m) and ``.targets`` (b, d) of ``<d_predictions, P>``."""
    check_context(ctx, "ctx", CrossFitContext)
    _check_fast_cross(ctx)
    ns = get_backend(ctx.fit_first.W)
    d = check_fast_upstream(d_predictions, "d_predictions", ctx.shape, ns, ctx.fit_first.dtype)
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
    given = labels
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
    mask = _check_split(ns, split, _host_labels(given, labels), rng)

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


def _value(value: Any) -> Any:
    """A 0-d float64 result as the losses return it: a Python float on NumPy (free), the
    0-d array itself on CuPy (not read: no synchronisation)."""
    value = value[()]
    return float(value) if isinstance(value, np.generic) else value


@dataclass(frozen=True)
class _ZeroShot(ZeroShotContext):
    """The reference's ``ZeroShotContext`` with the one-hot labels (b, c) of the forward,
    which the backward gathers the class embeddings' gradient with."""

    onehot: Any = None


def zero_shot_loss_forward(Z, labels, class_embeddings, *, ridge: float = 0.05,
                           scale: float = DEFAULT_ZERO_SHOT_SCALE, split=None, rng=None):
    """Zero-shot regulariser, GSP Sec. 4.3 / Algorithm 4: softmax cross-entropy of
    ``scale * Upsilon_hat Upsilon^T``; ``(value, ctx)``. See
    :func:`refdml.crossbatch.zero_shot_loss_forward`.

    ``labels`` may be a host (NumPy) array with ``Z`` on the device: the split and the label
    checks then read them for free; device labels are read once."""
    ns, Z, class_embeddings = _pair(Z, class_embeddings, "Z", "class_embeddings")
    xp = ns.xp
    given = labels
    if isinstance(given, np.ndarray) and not ns.free_host_reads:
        # host labels: checked on the host (free), then uploaded, or found where a captured
        # step staged them (no copy inside the step)
        labels = fast_labels(given, "labels", get_backend(given), length=Z.shape[0])
        labels = staged_upload(xp, labels, "labels")
    else:
        labels = fast_labels(labels, "labels", ns, length=Z.shape[0])
    host_labels = _host_labels(given, labels)
    n_classes = class_embeddings.shape[0]
    if data_checks(ns):
        outside = (host_labels < 0) | (host_labels >= n_classes)
        if outside.any():
            raise ValueError(f"labels contain {int(host_labels[np.argmax(outside)])}, but "
                             f"class_embeddings has rows for classes 0..{n_classes - 1}")
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
    mask = _check_split(ns, split, host_labels, rng)
    b = Z.shape[0]
    predictions, cross = _cross_fit_kernel(ns, Z, class_embeddings, mask, ridge,
                                           target_rows=host_labels)
    with ns.errstate(over="ignore", divide="ignore"):
        scores = matmul(ns, predictions, class_embeddings.T) * Z.dtype.type(scale)
    if data_checks(ns) and not bool(xp.all(xp.isfinite(scores))):
        raise ValueError(
            "the scores scale * Upsilon_hat Upsilon^T overflow "
            f"{np.dtype(scores.dtype).name} (max |class_embeddings| == "
            f"{float(xp.max(xp.abs(class_embeddings))):.3g})")
    lse, softmax = _losses.IMPLEMENTATIONS.choose(scores).masked_logsumexp(scores, axis=1)
    # one gather of a kept identity (its rows are the one-hot vectors)
    onehot = ns.kept(("refdml.gpu.crossbatch.identity", n_classes, np.dtype(scores.dtype).str),
                     lambda: np.eye(n_classes, dtype=scores.dtype))[labels]
    picked = xp.take_along_axis(scores, labels[:, None], axis=1)[:, 0]
    # float64 mean of the terms; on CuPy a 0-d array (no synchronisation), on NumPy a float
    value = _value(xp.mean(lse - picked, dtype=np.float64))
    d_scores = (softmax - onehot) / scores.dtype.type(b)
    return value, _ZeroShot(cross=cross, d_scores=d_scores, scale=scale,
                            predictions=predictions, class_embeddings=class_embeddings,
                            labels=labels, onehot=onehot)


def zero_shot_loss_backward(ctx: ZeroShotContext, d_value=1.0) -> ZeroShotGrads:
    """Gradients ``.Z`` (b, m) and ``.class_embeddings`` (c, d) of ``d_value * L``."""
    check_context(ctx, "ctx", ZeroShotContext)
    _check_fast_cross(ctx.cross)
    ns = get_backend(ctx.d_scores)
    d_value = check_fast_upstream(d_value, "d_value", (), ns, ctx.d_scores.dtype)
    # scale and d_value in one factor (a Python float, or a 0-d array for a device d_value)
    factor = ctx.scale * d_value
    d_scores = ctx.d_scores * (ctx.d_scores.dtype.type(factor) if isinstance(factor, float)
                               else factor)
    d_pred = matmul(ns, d_scores, ctx.class_embeddings)
    d_classes = matmul(ns, d_scores.T, ctx.predictions)
    cross = _cross_fit_backward(ns, ctx.cross, d_pred)
    onehot = getattr(ctx, "onehot", None)
    if onehot is None:
        onehot = (ctx.labels[:, None] == ns.xp.arange(d_classes.shape[0])[None, :]).astype(
            d_classes.dtype)
    return ZeroShotGrads(Z=cross.Z, class_embeddings=d_classes + matmul(ns, onehot.T,
                                                                        cross.targets))


def zero_shot_loss(Z, labels, class_embeddings, *, ridge: float = 0.05,
                   scale: float = DEFAULT_ZERO_SHOT_SCALE, split=None, rng=None):
    """One call: ``(value, grads)`` of :func:`zero_shot_loss_forward` / ``_backward``."""
    value, ctx = zero_shot_loss_forward(Z, labels, class_embeddings, ridge=ridge, scale=scale,
                                        split=split, rng=rng)
    return value, zero_shot_loss_backward(ctx)
