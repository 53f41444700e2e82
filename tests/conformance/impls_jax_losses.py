"""Independent JAX implementations of three DML losses, for the conformance tests.

Written from the papers and from refdml's docstrings (the conventions of
:mod:`refdml.losses`: unordered pairs, ``"mean"`` over every existing term, subgradient 0
at a hinge's kink and at coincident points), without calling refdml: each is what a JAX
user would write, and :func:`refdml.conformance.check_implementation` holds it to the
reference through ``jax.vjp``. Every correct one has deliberately broken twins, each with
one defect of a kind that is easy to write and hard to see (a NaN gradient at a zero
distance, terms silently dropped, a softmax that underflows):

=============================  ============================================================
``contrastive``                C2 contrastive on Euclidean distances (Hadsell et al. 2006)
``contrastive_nan_at_ties``    distance as ``sqrt(sum(diff ** 2))``: gradient NaN at
                               duplicate points (d/du sqrt(u) is infinite at u = 0)
``contrastive_skips_batch``    returns 0 for a batch without a positive pair, dropping its
                               negative terms
``contrastive_in_float16``     computes in float16 whatever its inputs' dtype (mixed
                               precision with the wrong half type): right to bfloat16's
                               precision, but float16's range ends at 65504
``triplet``                    triplet loss, all triplets or batch-hard (Schroff et al. 2015)
``triplet_mean_of_active``     averages over the active triplets only (drops the zero terms
                               from the count)
``proxy_nca``                  ProxyNCA++ (Teh et al. 2020, Eq. 5 with temperature)
``proxy_nca_naive_softmax``    ``exp(logits) / sum(exp(logits))`` without the max shift: at
                               a small temperature every exponential underflows to 0
=============================  ============================================================

Labels (and ``proxy_labels``) are read as NumPy arrays: they are never differentiated, so
the masks built from them are constants of the vector-Jacobian product.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "contrastive",
    "contrastive_nan_at_ties",
    "contrastive_in_float16",
    "contrastive_skips_batch",
    "proxy_nca",
    "proxy_nca_naive_softmax",
    "triplet",
    "triplet_mean_of_active",
]

# Defaults of refdml's losses (CUB-200 values of GSP supp. 1.6.7).
_NEG_MARGIN = 0.3841
_TRIPLET_MARGIN = 0.0961
_TEMPERATURE = 0.11


def _peak(x):
    """``max |x|`` (1 for an all-zero array) as a constant of the differentiation.

    Dividing by it keeps squares in range at any scale (1e-300 .. 1e300); the distance is
    homogeneous of degree 1 and the cosine of degree 0, so a constant factor changes the
    value by the factor and the gradient not at all.
    """
    peak = jax.lax.stop_gradient(jnp.max(jnp.abs(x)))
    return jnp.where(peak > 0, peak, jnp.ones_like(peak))


def _safe_norm(diff):
    """Row norms of ``diff`` with gradient 0 (not NaN) at a zero row, as refdml uses.

    Both branches of the ``where`` are differentiated, so the square root must never see
    the zero (the double-``where`` idiom of JAX's FAQ).
    """
    squared = jnp.sum(diff * diff, axis=-1)
    positive = squared > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, squared, 1.0)), 0.0)


def _naive_norm(diff):
    return jnp.sqrt(jnp.sum(diff * diff, axis=-1))


def _hinge(pre):
    """``[pre]_+`` with slope 0 at ``pre == 0`` (``jnp.maximum`` would split it 1/2, 1/2)."""
    return jnp.where(pre > 0, pre, 0.0)


def _mean(terms, count):
    # No term at all: 0 with a zero gradient (refdml's rule), not 0 / 0.
    return jnp.sum(terms) / jnp.maximum(count, 1)


def _reduce(terms, exists, reduction):
    """``terms`` (zero where not ``exists``) reduced over the existing ones."""
    if reduction == "sum":
        return jnp.sum(terms)
    if reduction == "mean":
        return _mean(terms, jnp.sum(exists))
    if reduction == "mean_nonzero":
        return _mean(terms, jnp.sum(jax.lax.stop_gradient(terms) > 0))
    raise ValueError(f"reduction == {reduction!r}, must be 'mean', 'mean_nonzero' or 'sum'")


# ------------------------------------------------------------------------ contrastive
#
# The numerical cores are jitted on fixed shapes (labels enter as masks, the pairs as index
# arrays), as a JAX user would write them; it also keeps the tests fast, since eager JAX
# compiles every primitive anew for each new shape.


@functools.partial(jax.jit, static_argnames=("reduction", "naive"))
def _contrastive_core(x, rows, cols, same, pos_margin, neg_margin, *, reduction, naive):
    peak = _peak(x)
    scaled = x / peak
    distance = peak * (_naive_norm if naive else _safe_norm)(scaled[rows] - scaled[cols])
    terms = _hinge(jnp.where(same, distance - pos_margin, neg_margin - distance))
    return _reduce(terms, jnp.ones_like(same), reduction)


def _contrastive(embeddings, labels, pos_margin, neg_margin, form, reduction, naive):
    if form != "euclidean":
        raise ValueError(f"form == {form!r}: only the Euclidean form is implemented")
    pos_margin = 0.0 if pos_margin is None else pos_margin
    neg_margin = _NEG_MARGIN if neg_margin is None else neg_margin
    labels = np.asarray(labels)
    rows, cols = np.triu_indices(labels.size, k=1)
    return _contrastive_core(embeddings, rows, cols, labels[rows] == labels[cols], pos_margin,
                             neg_margin, reduction=reduction, naive=naive)


def contrastive(embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean",
                reduction="mean"):
    """C2 contrastive loss: ``[d - m+]_+`` on positive pairs, ``[m- - d]_+`` on negative
    ones, over every unordered pair ``i < j``, with or without a positive pair."""
    return _contrastive(embeddings, labels, pos_margin, neg_margin, form, reduction,
                        naive=False)


def contrastive_nan_at_ties(embeddings, labels, *, pos_margin=None, neg_margin=None,
                            form="euclidean", reduction="mean"):
    """DEFECT: the plain ``sqrt`` norm. Right values everywhere; at two coincident
    embeddings ``d sqrt(u) / du = inf`` meets ``d u / dx = 0`` and the gradient is NaN."""
    return _contrastive(embeddings, labels, pos_margin, neg_margin, form, reduction,
                        naive=True)


def contrastive_skips_batch(embeddings, labels, *, pos_margin=None, neg_margin=None,
                            form="euclidean", reduction="mean"):
    """DEFECT: a batch without any positive pair gives 0 (a guard against 'nothing to pull
    together'), silently dropping the negative terms that still exist."""
    labels_np = np.asarray(labels)
    rows, cols = np.triu_indices(labels_np.size, k=1)
    if not np.any(labels_np[rows] == labels_np[cols]):
        return jnp.zeros((), dtype=embeddings.dtype)
    return contrastive(embeddings, labels, pos_margin=pos_margin, neg_margin=neg_margin,
                       form=form, reduction=reduction)


def contrastive_in_float16(embeddings, labels, *, pos_margin=None, neg_margin=None,
                           form="euclidean", reduction="mean"):
    """DEFECT: the loss computed in float16 and cast back to the inputs' dtype, as mixed
    precision set to the wrong half type (float16 for a bfloat16 model) does. float16
    has three more significand bits than bfloat16, so every ordinary batch agrees; its
    range ends at 65504, bfloat16's (float32's) at 3.4e38, so large embeddings become inf."""
    value = contrastive(embeddings.astype(jnp.float16), labels, pos_margin=pos_margin,
                        neg_margin=neg_margin, form=form, reduction=reduction)
    return value.astype(embeddings.dtype)


# ---------------------------------------------------------------------------- triplet


@functools.partial(jax.jit, static_argnames=("mining", "reduction", "active_only"))
def _triplet_core(x, same, margin, *, mining, reduction, active_only):
    n = x.shape[0]
    peak = _peak(x)
    scaled = x / peak
    distance = peak * _safe_norm(scaled[:, None, :] - scaled[None, :, :])
    positive = same & ~jnp.eye(n, dtype=bool)
    negative = ~same
    if mining == "all":
        exists = positive[:, :, None] & negative[:, None, :]
        pre = distance[:, :, None] - distance[:, None, :] + margin
    else:
        exists = positive.any(axis=1) & negative.any(axis=1)
        # The hardest pair is chosen on values only; ties go to the lowest index (argmax).
        d = jax.lax.stop_gradient(distance)
        hardest_pos = jnp.argmax(jnp.where(positive, d, -jnp.inf), axis=1)
        hardest_neg = jnp.argmin(jnp.where(negative, d, jnp.inf), axis=1)
        pre = (jnp.take_along_axis(distance, hardest_pos[:, None], axis=1)[:, 0]
               - jnp.take_along_axis(distance, hardest_neg[:, None], axis=1)[:, 0] + margin)
    terms = jnp.where(exists, _hinge(pre), 0.0)
    if active_only:
        return _mean(terms, jnp.sum(jax.lax.stop_gradient(terms) > 0))
    return _reduce(terms, exists, reduction)


def _triplet(embeddings, labels, margin, mining, reduction, active_only):
    if mining not in ("all", "batch_hard"):
        raise ValueError(f"mining == {mining!r}, must be 'all' or 'batch_hard'")
    labels = np.asarray(labels)
    return _triplet_core(embeddings, labels[:, None] == labels[None, :], margin, mining=mining,
                         reduction=reduction, active_only=active_only)


def triplet(embeddings, labels, *, margin=_TRIPLET_MARGIN, mining="all", reduction="mean"):
    """Triplet loss ``[d_ap - d_an + margin]_+`` over every valid triplet (``"all"``) or
    over each anchor's farthest positive and nearest negative (``"batch_hard"``)."""
    return _triplet(embeddings, labels, margin, mining, reduction, active_only=False)


def triplet_mean_of_active(embeddings, labels, *, margin=_TRIPLET_MARGIN, mining="all",
                           reduction="mean"):
    """DEFECT: ``"mean"`` divides by the number of active (non-zero) triplets, not by the
    number of triplets, so the satisfied triplets drop out of the average."""
    return _triplet(embeddings, labels, margin, mining, reduction, active_only=True)


# ------------------------------------------------------------------------- ProxyNCA++


def _unit_rows(x):
    # Each row divided by its own peak first: its square stays in range at any scale.
    peak = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=1, keepdims=True))
    scaled = x / jnp.where(peak > 0, peak, 1.0)
    return scaled / jnp.sqrt(jnp.sum(scaled * scaled, axis=1, keepdims=True))


@functools.partial(jax.jit, static_argnames=("naive",))
def _proxy_nca_core(x, proxies, same, temperature, *, naive):
    similarity = _unit_rows(x) @ _unit_rows(proxies).T
    # ||x^ - p^||^2 = 2 - 2 cos for unit vectors.
    logits = -(2.0 - 2.0 * similarity) / temperature
    if naive:
        weights = jnp.exp(logits)
        probability = jnp.sum(jnp.where(same, weights, 0.0), axis=1) / jnp.sum(weights, axis=1)
        return jnp.mean(-jnp.log(probability))
    everything = jax.nn.logsumexp(logits, axis=1)
    own_class = jax.nn.logsumexp(jnp.where(same, logits, -jnp.inf), axis=1)
    return jnp.mean(everything - own_class)


def _proxy_nca(embeddings, labels, proxies, proxy_labels, temperature, reduction, naive):
    if reduction != "mean":
        raise ValueError(f"reduction == {reduction!r}: only 'mean' is implemented")
    labels = np.asarray(labels)
    proxy_labels = (np.arange(proxies.shape[0]) if proxy_labels is None
                    else np.asarray(proxy_labels))
    return _proxy_nca_core(embeddings, proxies, labels[:, None] == proxy_labels[None, :],
                           temperature, naive=naive)


def proxy_nca(embeddings, labels, *, proxies, proxy_labels=None, temperature=_TEMPERATURE,
              reduction="mean"):
    """ProxyNCA++: ``-log(sum_{p of y_i} exp(z_ip) / sum_p exp(z_ip))`` with
    ``z_ip = -||x^_i - p^||^2 / T``, averaged over the embeddings, as a difference of two
    log-sum-exps (each shifted by its maximum, so no exponential overflows or vanishes)."""
    return _proxy_nca(embeddings, labels, proxies, proxy_labels, temperature, reduction,
                      naive=False)


def proxy_nca_naive_softmax(embeddings, labels, *, proxies, proxy_labels=None,
                            temperature=_TEMPERATURE, reduction="mean"):
    """DEFECT: the softmax as written in the paper, ``exp(z) / sum exp(z)``. The logits
    lie in ``[-4 / T, 0]``; at a small temperature the exponentials underflow to 0, and
    the ratio is ``0 / 0`` or ``log 0``."""
    return _proxy_nca(embeddings, labels, proxies, proxy_labels, temperature, reduction,
                      naive=True)
