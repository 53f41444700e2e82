"""The losses family's array path: the masked log-sum-exp written once against the backend
(:class:`ArrayPath`), and the pieces every loss forward shares (the reductions, the bounds
of the where-free log-sum-exp, the dtype of the terms, the masks of pairs).

:class:`ArrayPath` is the family's interface: the compiled members
(:class:`refdml.gpu.losses._kernels.CpuPath`, :class:`~refdml.gpu.losses._kernels.CudaPath`)
have the same method, and a forward chooses one of the three once
(``IMPLEMENTATIONS.choose(x)``) and runs all its log-sum-exps on it. The array path is the
fallback and the twin the kernels are tested against.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from refdml._backend import Backend, get_backend
from refdml._shared.losses import TWO_64

__all__ = ["ArrayPath", "cosine_bound", "exclusion", "exp_fits", "exp_limit", "mean_terms",
           "reduce_terms", "terms_dtype", "upper_pairs", "upper_weights"]


class ArrayPath:
    """The masked log-sum-exp on NumPy or CuPy arrays: the losses family's interface.

    ``masked_logsumexp(z, mask=None, *, axis=-1, extra_zero=False) -> (lse, softmax)``
        ``log(sum_{mask} exp(z))`` along ``axis`` and the softmax of the masked entries.
        ``mask`` (bool, broadcast against ``z``; None: every entry) selects the entries;
        ``extra_zero=True`` adds one more logit 0 to every row (``log(1 + sum exp z)``; its
        own weight is not returned). A row with nothing in it gives ``-inf`` (``0`` with
        ``extra_zero``) and zero weights, never NaN; entries of ``z`` outside ``mask`` are
        never read into the result. ``lse`` drops ``axis``; ``softmax`` has ``z``'s shape;
        both in ``z``'s dtype. Here: shifted by the row's masked maximum, in ``z``'s dtype.
    """

    def masked_logsumexp(self, z: Any, mask: Any = None, *, axis: int = -1,
                         extra_zero: bool = False) -> tuple[Any, Any]:
        ns = get_backend(z, mask)
        xp = ns.xp
        masked = z if mask is None else xp.where(mask, z, -xp.inf).astype(z.dtype, copy=False)
        shift = xp.max(masked, axis=axis, keepdims=True)
        if extra_zero:
            shift = xp.maximum(shift, 0)
        else:
            shift = xp.where(xp.isfinite(shift), shift, 0).astype(z.dtype, copy=False)
        with ns.errstate(over="ignore", divide="ignore"):
            weights = xp.exp(masked - shift)
            total = xp.sum(weights, axis=axis, keepdims=True)
            if extra_zero:
                total = total + xp.exp(-shift)
            lse = xp.log(total) + shift
        softmax = weights / xp.where(total > 0, total, xp.ones_like(total))
        return xp.squeeze(lse, axis=axis), softmax


# ----------------------------------------------------------- bounds of the where-free path
# Largest |t| for which exp(t) is a normal number with room to spare: float32 normals span
# exp(-87.3) .. exp(88.7), float64 exp(-708) .. exp(709).
_EXP_LIMIT = {np.dtype(np.float32): 80.0, np.dtype(np.float64): 700.0}


def exp_limit(dtype: Any) -> float:
    """The largest ``|t|`` for which the arithmetic paths take ``exp(t)`` in ``dtype``."""
    return _EXP_LIMIT[np.dtype(dtype)]


def exp_fits(dtype: Any, bound: float, count: int) -> bool:
    """True when ``exp(t)`` for every ``|t| <= bound`` is a normal number of ``dtype`` and
    a sum of ``count`` of them (plus one more term of at most 1) stays finite.

    This is the condition of the arithmetic (``where``-free) log-sum-exp of the proxy
    losses: with logits known to lie in ``[c - bound, c + bound]`` a constant shift ``c``
    replaces the per-row maximum, and masks become 0/1 factors (every ``exp`` is finite,
    none underflows, so no row sum is 0 and ``0 * exp`` is an exact 0). Pure Python on
    the hyperparameters: no synchronisation.
    """
    return bool(np.isfinite(bound)) and bound + math.log(count + 1) <= exp_limit(dtype)


def cosine_bound(dtype: Any, dim: int) -> float:
    """An upper bound of ``|cos|`` as computed in ``dtype`` from unit rows of length ``dim``:
    1 plus the rounding of the row norms and of the dot product (``(dim + 4) u``)."""
    return 1.0 + (dim + 4) * float(np.finfo(dtype).eps)


def terms_dtype(dtype: Any, *bounds: float) -> np.dtype:
    """The dtype of a loss's terms: ``dtype``, or float64 where a bound on them set by the
    hyperparameters (a margin; a multi-similarity logit bound ``2 alpha``) lies beyond
    ``dtype``'s range (float32: 3.4e38).

    Such a hyperparameter enters the terms (``[m- - d]_+``, ``d_ap - d_an + m``, the
    logits ``alpha (s - base)``), which the value sums in float64 anyway, but not the
    gradient (+-1 / count per active hinge term, softmax weights: O(1)): so a float32
    batch with a margin of 1e300 is computed as the reference computes it, with the
    (n, n) terms in float64 and the gradient cast back to float32. Pure Python on the
    hyperparameters: no synchronisation.
    """
    limit = float(np.finfo(dtype).max)
    if all(abs(m) <= limit for m in bounds):
        return np.dtype(dtype)
    return np.dtype(np.float64)


# --------------------------------------------------------------------------------- masks
def upper_pairs(ns: Backend, n: int) -> Any:
    """Boolean ``(n, n)`` mask of the pairs ``i < j``, read-only; built on the host and
    kept per ``n`` (:meth:`refdml._backend.Backend.kept`: uploaded once on CuPy, where
    building it would cost two launches a call)."""
    def build() -> np.ndarray:
        index = np.arange(n)
        return index[:, None] < index[None, :]

    return ns.kept(("refdml.gpu.losses.upper_pairs", n), build)


def upper_weights(ns: Backend, n: int, dtype: Any) -> Any:
    """``upper_pairs / count`` in ``dtype`` (``count`` the number of pairs ``i < j``, at
    least 1): d mean / d terms over the pairs, kept like :func:`upper_pairs`. The quotient
    is rounded once on the host, as a device division ``1 / count`` in ``dtype`` is."""
    count = max(n * (n - 1) // 2, 1)

    def build() -> np.ndarray:
        index = np.arange(n)
        upper = index[:, None] < index[None, :]
        return upper.astype(dtype) / np.dtype(dtype).type(count)

    return ns.kept(("refdml.gpu.losses.upper_weights", n, np.dtype(dtype).str), build)


def exclusion(ns: Backend, keep: Any, dtype: Any) -> Any:
    """``0`` where ``keep``, ``+inf`` elsewhere (``1 / keep - 1``): added to finite data it
    masks a max / min like ``where(keep, data, -+inf)``, without ``where`` (slower than
    arithmetic on NumPy)."""
    with ns.errstate(over="ignore", divide="ignore"):
        return 1 / keep.astype(dtype) - 1


# ---------------------------------------------------------------------------- reductions
def reduce_terms(ns: Backend, terms: Any, reduction: str, exists: Any = None) -> tuple[Any, Any]:
    """Reduce the non-negative ``terms`` that ``exists`` (bool, default all); return the
    value (0-d float64 array, not yet synchronised) and d value / d terms (dtype of terms).

    ``"mean"`` divides by the number of existing terms, ``"mean_nonzero"`` by the number
    of strictly positive ones, ``"sum"`` by 1; no term at all gives 0 and zero weights.
    The sum is accumulated in float64 (float32 terms cannot overflow it); float64 terms
    whose sum overflows while their mean does not are reduced as the reference reduces
    them (:func:`mean_terms`).
    """
    xp = ns.xp
    if exists is None and reduction != "mean_nonzero":
        # Every term counts: a constant weight, no mask to build or count.
        count = 1 if reduction == "sum" else max(terms.size, 1)
        value = mean_terms(ns, terms, count)
        return value, xp.full(terms.shape, 1 / count, dtype=terms.dtype)
    weight = terms > 0 if reduction == "mean_nonzero" else exists
    if reduction == "sum":
        count = xp.ones((), dtype=terms.dtype)
    else:
        count = xp.maximum(xp.count_nonzero(weight), 1).astype(terms.dtype)
    weight = weight.astype(terms.dtype)
    value = mean_terms(ns, terms, count.astype(xp.float64))
    return value, weight / count


def mean_terms(ns: Backend, terms: Any, count: Any) -> Any:
    """``sum(terms) / count`` (0-d float64, not synchronised) without overflow of the sum.

    Where the float64 sum overflows, the reference takes ``2^64 (sum(terms / 2^64) /
    count)`` (exact powers of two; terms too small to survive ``2^-64`` are negligible next
    to a sum beyond 1e308): the same here. Whether the sum is finite is read where that is
    free (NumPy: the rescaled sum only when needed); elsewhere both sums are formed and the
    finite one kept (no synchronisation). float32 terms need neither.
    """
    xp = ns.xp
    with ns.errstate(over="ignore", divide="ignore"):
        total = xp.sum(terms, dtype=xp.float64)
        if terms.dtype == np.float32:
            return total / count
        finite = xp.isfinite(total)
        if ns.known_true(finite):
            return total / count
        scaled = TWO_64 * (xp.sum(terms / TWO_64) / count)
        return xp.where(finite, total / count, scaled)
