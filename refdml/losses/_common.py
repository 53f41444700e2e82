"""Pieces shared by every loss: gradients, contexts, reductions, input checks, and the
scale-safe pairwise kernels the losses see the embeddings (and proxies) through.

Private: the public losses validate their input with the ``_check_*`` helpers here, then
call kernels that assume valid input.

Extreme input (entries of magnitude 1e-300 .. 1e300)
----------------------------------------------------
* Euclidean losses see ``D_ij = ||x_i - x_j||``, homogeneous of degree 1. The embeddings
  are divided by one power of two ``s`` (as :func:`refdml._numerics.common_scale`, exact),
  the distances ``D'`` of ``x / s`` are computed in range and ``D = s D'``. Its gradient
  with respect to ``x`` is that of ``D'`` with respect to ``x / s`` (degree 0): no factor.
  A distance beyond the float64 range is a ``ValueError`` naming ``embeddings``.
* Cosine losses see ``cos(x_i, x_j)`` (or ``cos(x_i, p_k)``), invariant to the scale of
  each row. Each row is divided by its own power of two ``s_i`` (exact), so the value is
  the same at any scale; the gradient with respect to row ``i`` is the one of the scaled
  row divided by ``s_i`` (degree -1), kept in the context as ``row_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import check_nonzero_rows, masked_logsumexp
from refdml._validation import (
    as_float_array,
    as_label_array,
    check_choice,
    check_context,
    check_scalar,
    check_upstream,
)
from refdml.distances import (
    CosineContext,
    EuclideanContext,
    _cosine_backward,
    _cosine_forward,
    _euclidean_backward,
    _euclidean_forward,
)
from refdml.losses._hyperparameters import CONTRASTIVE_DEFAULTS

__all__ = ["LossGrads", "PairwiseLossContext", "ProxyLossContext", "ProxyLossGrads", "REDUCTIONS"]

REDUCTIONS = ("mean", "mean_nonzero", "sum")

_COSINE_WHY = "cosine similarity needs non-zero vectors"
_MAX_EXPONENT = 1023
_TWO_64 = 2.0**64


@dataclass(frozen=True)
class LossGrads:
    """Gradient of a loss with respect to the embeddings, shape (n, d)."""

    embeddings: np.ndarray


@dataclass(frozen=True)
class ProxyLossGrads:
    """Gradients of a proxy loss: embeddings (n, d) and proxies (n_proxies, d)."""

    embeddings: np.ndarray
    proxies: np.ndarray


@dataclass(frozen=True)
class PairwiseLossContext:
    """Context of a loss that sees the embeddings only through one (n, n) pairwise matrix.

    ``metric_ctx`` is the context of the Euclidean distances (``EuclideanContext``) or the
    cosine similarities (``CosineContext``) of the rescaled embeddings; ``d_matrix`` is
    d value / d matrix for an upstream gradient of 1; the gradient of row ``i`` is divided
    by ``row_scale[i]`` (the power of two row ``i`` was divided by; ones for Euclidean).
    ``loss`` names the forward that made the context, so that a backward refuses another
    loss's context.
    """

    loss: str
    metric_ctx: EuclideanContext | CosineContext
    d_matrix: np.ndarray
    row_scale: np.ndarray


@dataclass(frozen=True)
class ProxyLossContext:
    """Context of a proxy loss: the cosine matrix of embeddings and proxies, d value / d it.

    ``d_similarity`` (n, n_proxies) is for an upstream gradient of 1. SoftTriple adds the
    context of ``cos(proxies, proxies)`` and d value / d it (``None`` for the others).
    Rows of embeddings and proxies were divided by the powers of two ``embedding_scale``
    (n, 1) and ``proxy_scale`` (n_proxies, 1).
    """

    loss: str
    cosine_ctx: CosineContext
    d_similarity: np.ndarray
    embedding_scale: np.ndarray
    proxy_scale: np.ndarray
    regularizer_ctx: CosineContext | None = None
    d_regularizer: np.ndarray | None = None


# ----------------------------------------------------------------------- input checks


def check_reduction(reduction) -> str:
    return check_choice(reduction, "reduction", REDUCTIONS)


def check_embeddings_labels(embeddings, labels) -> tuple[np.ndarray, np.ndarray]:
    x = as_float_array(embeddings, "embeddings", ndim=2)
    y = as_label_array(labels, "labels", length=x.shape[0])
    return x, y


def check_contrastive_margins(form: str, pos_margin, neg_margin) -> tuple[float, float]:
    """The contrastive loss's margins: the form's defaults for None, then range checks.

    Euclidean: ``pos_margin >= 0``, ``neg_margin > 0``; cosine: both in (-1, 1) (open at the
    end where the hinge could never be active). Shared by the reference and the fast path.
    """
    default_pos, default_neg = CONTRASTIVE_DEFAULTS[form]
    pos_margin = default_pos if pos_margin is None else pos_margin
    neg_margin = default_neg if neg_margin is None else neg_margin
    if form == "euclidean":
        pos_margin = check_scalar(pos_margin, "pos_margin", low=0.0)
        neg_margin = check_scalar(neg_margin, "neg_margin", low=0.0, low_inclusive=False)
    else:
        pos_margin = check_scalar(pos_margin, "pos_margin", low=-1.0, high=1.0, low_inclusive=False)
        neg_margin = check_scalar(neg_margin, "neg_margin", low=-1.0, high=1.0, high_inclusive=False)
    return pos_margin, neg_margin


# ---------------------------------------------------------- hyperparameter ranges
#
# The cosine losses are invariant to the scale of the embeddings, so only their
# hyperparameters can push the logits, values or gradients beyond float64. The bounds
# below use |s| <= 1 and are checked before any arithmetic, with the reference's and the
# fast path's one message; what they leave (sums of many terms) is caught by the final
# checks of the value (``reduce_terms``) and of :func:`check_finite_loss`.


def _overflows(value_fn, dtype=np.float64) -> bool:
    """Whether the float64 ``value_fn()`` lies beyond ``dtype``'s range."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        value = value_fn()
    return not abs(value) <= float(np.finfo(dtype).max)  # float32's max would cast value


def check_generalized_margins(alpha, beta) -> tuple[float, float]:
    """ASAP Eq. (4.2): ``beta >= alpha > 0``, and the margins ``beta -+ alpha`` finite."""
    alpha = check_scalar(alpha, "alpha", low=0.0, low_inclusive=False)
    beta = check_scalar(beta, "beta", low=0.0, low_inclusive=False)
    if beta < alpha:
        raise ValueError(
            f"beta == {beta!r}, must be >= alpha == {alpha!r} (ASAP Eq. (4.2): "
            "beta >= alpha > 0)"
        )
    if _overflows(lambda: beta + alpha):
        raise ValueError(
            f"alpha + beta overflows float64 (alpha == {alpha!r}, beta == {beta!r}): it is the "
            "negative margin of ASAP Eq. (4.2)"
        )
    return alpha, beta


def check_multi_similarity_scales(alpha: float, beta: float, n: int, dtype=np.float64) -> None:
    """``log(1 + sum exp(.)) / alpha`` is about ``log(1 + n) / alpha`` for small alpha."""
    for name, value in (("alpha", alpha), ("beta", beta)):
        if _overflows(lambda: np.log1p(n) / value, dtype):
            raise ValueError(
                f"{name} == {value!r} is too small: the multi-similarity term "
                f"log(1 + sum exp(...)) / {name}, about log(1 + n) / {name} with n == {n}, "
                f"overflows {np.dtype(dtype).name}"
            )


def check_proxy_anchor_scales(alpha: float, delta: float, n: int, dtype=np.float64) -> None:
    """The logits ``+-alpha (s +- delta)`` reach ``alpha (1 + delta)``."""
    if _overflows(lambda: alpha * (1.0 + delta) + np.log1p(n), dtype):
        raise ValueError(
            f"alpha == {alpha!r} with delta == {delta!r}: the Proxy-Anchor logits "
            "alpha (s +- delta) reach alpha (1 + delta) (cosine s in [-1, 1]), beyond "
            f"{np.dtype(dtype).name}"
        )


def check_proxy_nca_temperature(temperature: float, dtype=np.float64) -> None:
    """The logits ``-||x^ - p^||^2 / T`` reach ``-4 / T`` (unit vectors)."""
    if _overflows(lambda: 4.0 / temperature, dtype):
        raise ValueError(
            f"temperature == {temperature!r} is too small: the ProxyNCA++ logits "
            "-||x^ - p^||^2 / temperature reach -4 / temperature, beyond "
            f"{np.dtype(dtype).name} (temperature must be at least "
            f"{4.0 / float(np.finfo(dtype).max):.3g})"
        )


def check_soft_triple_scales(lambda_: float, gamma: float, delta: float,
                             dtype=np.float64) -> None:
    """The softmax logits ``s / gamma`` and ``(s - S') / gamma`` reach ``2 / gamma``; the
    class logits ``lambda_ (S' - delta)`` reach ``lambda_ (1 + delta)``."""
    name = np.dtype(dtype).name
    if _overflows(lambda: 2.0 / gamma, dtype):
        raise ValueError(
            f"gamma == {gamma!r} is too small: the SoftTriple terms s / gamma and their "
            f"gradient (s - S') / gamma reach 2 / gamma, beyond {name} (gamma must be at "
            f"least {2.0 / float(np.finfo(dtype).max):.3g})"
        )
    if _overflows(lambda: 2.0 * lambda_ * (1.0 + delta), dtype):
        raise ValueError(
            f"lambda_ == {lambda_!r} with delta == {delta!r}: the SoftTriple logits "
            "lambda_ (S' - delta) and their differences reach 2 lambda_ (1 + delta), "
            f"beyond {name}"
        )


def check_finite_loss(value: float, arrays, loss: str, hyperparameters: dict,
                      dtype=np.float64) -> None:
    """A loss value and its saved derivatives finite, else a ValueError naming the
    hyperparameters (what the range checks above do not bound: sums over many terms)."""
    if np.isfinite(value) and all(bool(np.all(np.isfinite(a))) for a in arrays):
        return
    raise ValueError(finite_loss_message(loss, hyperparameters, dtype))


def hyperparameter_cause(loss: str, **hyperparameters):
    """The ``cause`` of :func:`reduce_terms` for a cosine loss: its hyperparameters."""
    shown = ", ".join(f"{k} == {v!r}" for k, v in hyperparameters.items())
    return lambda: f"the {loss} terms are too large with {shown}"


def finite_loss_message(loss: str, hyperparameters: dict, dtype=np.float64) -> str:
    shown = ", ".join(f"{k} == {v!r}" for k, v in hyperparameters.items())
    return (
        f"the {loss} loss or its gradient overflows {np.dtype(dtype).name} with {shown} (its "
        "cosine similarities are in [-1, 1], so the hyperparameters set its scale): use "
        "smaller ones"
    )


def check_cosine_embeddings(x: np.ndarray) -> None:
    check_nonzero_rows(x, "embeddings", why=_COSINE_WHY)


def _check_proxies(proxies, proxy_labels, labels, d: int) -> tuple[np.ndarray, np.ndarray]:
    p = as_float_array(proxies, "proxies", ndim=2)
    if p.shape[1] != d:
        raise ValueError(
            f"proxies have dimension {p.shape[1]} but embeddings have dimension {d} "
            f"(proxies.shape={p.shape})"
        )
    if proxy_labels is None:
        p_labels = np.arange(p.shape[0], dtype=np.int64)
    else:
        p_labels = as_label_array(proxy_labels, "proxy_labels")
        if p_labels.size != p.shape[0]:
            raise ValueError(
                f"proxy_labels has length {p_labels.size}, but there are {p.shape[0]} proxies "
                "(one label per proxy)"
            )
    missing = np.setdiff1d(labels, p_labels)
    if missing.size:
        raise ValueError(
            f"labels has class {int(missing[0])}, which no proxy represents "
            f"(proxy_labels covers {np.unique(p_labels).size} classes)"
        )
    return p, p_labels


def check_proxy_inputs(embeddings, labels, proxies, proxy_labels):
    x, y = check_embeddings_labels(embeddings, labels)
    p, p_labels = _check_proxies(proxies, proxy_labels, y, x.shape[1])
    check_cosine_embeddings(x)
    check_nonzero_rows(p, "proxies", why=_COSINE_WHY)
    return x, y, p, p_labels


def check_loss_context(ctx, cls: type, loss: str):
    """``TypeError`` unless ``ctx`` is a ``cls`` made by ``<loss>_forward``."""
    check_context(ctx, "ctx", cls)
    if ctx.loss != loss:
        raise TypeError(
            f"ctx must be the {cls.__name__} returned by {loss}_forward, "
            f"got the one returned by {ctx.loss}_forward"
        )
    return ctx


def check_d_value(d_value) -> float:
    """The scalar upstream gradient of a loss value (shape ``()``, real, finite)."""
    return float(check_upstream(d_value, "d_value", ()))


# ------------------------------------------------------------------------- reductions


def reduce_terms(terms: np.ndarray, reduction: str,
                 cause=lambda: "the embeddings are too far apart") -> tuple[float, np.ndarray]:
    """Reduce non-negative ``terms``; return the value and d value / d terms.

    An empty set of terms (or no non-zero term for ``mean_nonzero``) reduces to 0. A sum
    that overflows is formed on ``terms / 2^k``; a value beyond float64 is a ValueError
    (``cause()`` says why, naming the parameters; called only then).
    """
    if reduction == "mean_nonzero":
        weight = (terms > 0.0).astype(np.float64)
        count = int(np.count_nonzero(weight))
    else:
        weight = np.ones_like(terms)
        count = 1 if reduction == "sum" else terms.size
    if count == 0:
        return 0.0, np.zeros_like(terms)
    with np.errstate(over="ignore"):
        value = float(np.sum(terms)) / count
        if not np.isfinite(value):
            # Exact powers of two; the terms too small to survive 2^-64 are negligible
            # next to a sum beyond 1e308.
            value = _TWO_64 * (float(np.sum(terms / _TWO_64)) / count)
    if not np.isfinite(value):
        raise ValueError(
            f"the loss value (reduction={reduction!r}) exceeds the float64 range: {cause()}"
        )
    return value, weight / count


# ----------------------------------------------------------------- pairwise kernels


def row_scale(x: np.ndarray) -> np.ndarray:
    """Per row, the power of two ``s_i`` with ``max_j |x_ij| / s_i`` in [0.5, 1); (n, 1).

    In the top binade (``|x| >= 2^1023``) ``s_i = 2^1023`` (``2^1024`` is not a float64),
    and the ratio is in [1, 2): still safe to square.
    """
    peak = np.max(np.abs(x), axis=1, keepdims=True)
    exponent = np.frexp(np.where(peak > 0.0, peak, 1.0))[1]
    return np.ldexp(1.0, np.minimum(exponent, _MAX_EXPONENT))


def _common_scale(x: np.ndarray) -> float:
    """:func:`refdml._numerics.common_scale` of one array, capped at ``2^1023``.

    ``common_scale`` overflows (``2^1024``) for ``|x| >= 2^1023``; see :func:`row_scale`.
    """
    peak = float(np.max(np.abs(x), initial=0.0))
    if peak == 0.0:
        return 1.0
    return float(np.ldexp(1.0, min(int(np.frexp(peak)[1]), _MAX_EXPONENT)))


def self_euclidean(x: np.ndarray) -> tuple[np.ndarray, EuclideanContext, np.ndarray]:
    """``D_ij = ||x_i - x_j||`` at any scale; returns ``(D, ctx, ones((n, 1)))``."""
    scale = _common_scale(x)
    scaled = x / scale
    distance, ctx = _euclidean_forward(scaled, scaled)
    with np.errstate(over="ignore"):
        distance = scale * distance
    if not np.all(np.isfinite(distance)):
        raise ValueError(
            "embeddings has pairwise distances beyond the float64 range "
            f"(max |entry| == {float(np.max(np.abs(x))):.3g})"
        )
    return distance, ctx, np.ones((x.shape[0], 1))


def self_cosine(x: np.ndarray) -> tuple[np.ndarray, CosineContext, np.ndarray]:
    """``S_ij = cos(x_i, x_j)`` at any scale; returns ``(S, ctx, row_scale)``."""
    scale = row_scale(x)
    scaled = x / scale
    similarity, ctx = _cosine_forward(scaled, scaled)
    return similarity, ctx, scale


def cross_cosine(x: np.ndarray, p: np.ndarray):
    """``cos(x_i, p_k)`` at any scale; returns ``(S, ctx, x_scale, p_scale)``."""
    x_scale, p_scale = row_scale(x), row_scale(p)
    similarity, ctx = _cosine_forward(x / x_scale, p / p_scale)
    return similarity, ctx, x_scale, p_scale


def pairwise_backward(ctx: PairwiseLossContext, d_value: float) -> LossGrads:
    """Gradient of ``d_value * value`` through the pairwise matrix (both of its arguments)."""
    upstream = d_value * ctx.d_matrix
    if isinstance(ctx.metric_ctx, CosineContext):
        grads = _cosine_backward(ctx.metric_ctx, upstream)
    else:
        grads = _euclidean_backward(ctx.metric_ctx, upstream)
    # The matrix is a function of two copies of x; the total derivative adds both.
    return LossGrads(embeddings=_unscaled_gradient(grads.x + grads.y, ctx.row_scale, "embeddings"))


def proxy_backward(ctx: ProxyLossContext, d_value: float) -> ProxyLossGrads:
    grads = _cosine_backward(ctx.cosine_ctx, d_value * ctx.d_similarity)
    d_proxies = grads.y
    if ctx.regularizer_ctx is not None:
        reg = _cosine_backward(ctx.regularizer_ctx, d_value * ctx.d_regularizer)
        d_proxies = d_proxies + reg.x + reg.y
    return ProxyLossGrads(
        embeddings=_unscaled_gradient(grads.x, ctx.embedding_scale, "embeddings"),
        proxies=_unscaled_gradient(d_proxies, ctx.proxy_scale, "proxies"),
    )


def _unscaled_gradient(gradient: np.ndarray, scale, name: str) -> np.ndarray:
    """``gradient / scale``: back from rows divided by powers of two to the user's rows.

    A cosine's gradient scales as ``1 / ||row||``, so it exceeds float64 for rows of
    norm below about ``1 / 1.8e308`` (subnormal entries): a ValueError naming ``name``.
    """
    with np.errstate(over="ignore"):
        out = gradient / scale
    if not np.all(np.isfinite(out)):
        raise ValueError(cosine_gradient_overflow(out, name, "float64"))
    return out


_COSINE_OVERFLOW = (
    "a cosine's gradient scales as 1 / ||row||, and that row is too short (entries near the "
    "subnormal range)"
)


def cosine_gradient_overflow(gradient, name: str, dtype_name: str,
                             why: str = _COSINE_OVERFLOW) -> str:
    """The message of a loss's gradient beyond the dtype (reference and fast path)."""
    row = int(np.flatnonzero(~np.all(np.isfinite(gradient), axis=-1))[0])
    return (
        f"the gradient with respect to {name} overflows {dtype_name} at row {row}: {why}; "
        f"rescale {name}"
    )


def log1p_sum_exp(z: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise ``log(1 + sum_{mask} exp(z))`` and its gradient ``exp(z - lse)`` on the mask.

    The masked log-sum-exp with an extra zero logit (the ``exp(0) = 1``) in front; a row
    with an empty mask gives ``log 1 = 0`` and zero weights.
    """
    zero = np.zeros(z.shape[:-1] + (1,))
    lse, softmax = masked_logsumexp(
        np.concatenate([zero, z], axis=-1),
        np.concatenate([np.ones(zero.shape, dtype=bool), mask], axis=-1),
        axis=-1,
    )
    return lse, softmax[..., 1:]
