"""Numerical kernels shared by several operator families, written once.

Private: the public functions validate their input; these assume valid float64 arrays.

``row_norm``
    Euclidean norm along the last axis that neither overflows (``|x| ~ 1e200``) nor
    underflows (``|x| ~ 1e-300``): each row is divided by its largest magnitude first,
    the LAPACK ``dnrm2`` idea. ``np.linalg.norm`` squares first and returns ``inf``
    above ~1e154 and ``0`` below ~1e-162.
``pairwise_sq_distances`` / ``pairwise_norm``
    ``||x_i - y_j||^2`` / ``||x_i - y_j||`` for ``x (..., n, d)``, ``y (..., m, d)``:
    the Gram identity (one matrix product), with pairs whose squared distance is below
    ``_REFINE`` of ``|x_i|^2 + |y_j|^2`` recomputed from explicit differences, where the
    identity's cancellation would lose digits; ~1e-12 relative everywhere. Both sets are
    divided by one common power of two (exact) so that the squares stay in range; the
    norm is scaled back, so it is right for any finite input. The squared distance is
    scaled back too and is ``inf`` only where the true value exceeds float64.
``ordered_sq_distances`` / ``ordered_unit_rows``
    Squared distances and unit rows by a fixed sequence of IEEE-754 operations (the
    coordinates summed left to right, one rounding per subtraction, product and sum, no
    BLAS, no fused multiply-add), so the value depends on the inputs alone, never on the
    CPU, the BLAS kernel, the thread count or a row's position: the scores that decide a
    ranking (``refdml.metrics``), where two identical rows must tie on every machine.
``masked_logsumexp``
    ``log sum_{mask} exp(z)`` along an axis with its softmax, ``-inf`` and zero weights
    on a row with no masked entry (never NaN).
``check_nonzero_rows``
    The one place that refuses zero vectors, under the caller's parameter name.
"""

from __future__ import annotations

import numpy as np

from refdml import _validation
from refdml._backend import get_backend

__all__ = [
    "check_nonzero_rows",
    "common_scale",
    "masked_logsumexp",
    "ordered_sq_distances",
    "ordered_unit_rows",
    "pairwise_norm",
    "pairwise_sq_distances",
    "row_norm",
]

# Squared distances below this fraction of |x|^2 + |y|^2 are recomputed exactly.
_REFINE = 1e-3
# Bytes of explicit differences materialised at once when refining.
_CHUNK_BYTES = 64 * 2**20


def common_scale(*arrays: np.ndarray) -> float:
    """A power of two ``s`` with ``max|a| / s`` in [0.5, 1) over all arrays (1.0 for zeros).

    Dividing by a power of two is exact, so scaled computations lose nothing, and
    squares of the scaled values can neither overflow nor (for the largest) underflow.
    Above ``2**1023`` (the top binade of float64) ``s`` is capped at ``2**1023``, so
    ``max|a| / s`` is then in [1, 2): still safe to square.
    """
    largest = max((float(np.max(np.abs(a), initial=0.0)) for a in arrays), default=0.0)
    if largest == 0.0 or not np.isfinite(largest):
        return 1.0
    return float(np.ldexp(1.0, min(int(np.frexp(largest)[1]), 1023)))


def row_norm(x: np.ndarray, *, keepdims: bool = False) -> np.ndarray:
    """``||x||`` along the last axis, without overflow or underflow of the squares."""
    peak = np.max(np.abs(x), axis=-1, keepdims=True)
    safe = np.where(peak > 0.0, peak, 1.0)
    norm = peak * np.sqrt(np.sum((x / safe) ** 2, axis=-1, keepdims=True))
    return norm if keepdims else norm[..., 0]


def _scaled_sq_distances(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Refined squared distances of inputs whose entries are at most 1 in magnitude."""
    lead = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    xb = np.broadcast_to(x, lead + x.shape[-2:])
    yb = np.broadcast_to(y, lead + y.shape[-2:])
    x_sq = np.einsum("...nd,...nd->...n", xb, xb)
    y_sq = np.einsum("...md,...md->...m", yb, yb)
    magnitude = x_sq[..., :, None] + y_sq[..., None, :]
    sq = magnitude - 2.0 * (xb @ np.swapaxes(yb, -1, -2))
    refine = sq <= _REFINE * magnitude
    if np.any(refine):
        idx = np.nonzero(refine)
        lead_idx = idx[:-2]
        diff = xb[lead_idx + (idx[-2],)] - yb[lead_idx + (idx[-1],)]
        # Bounded memory: at most one (d,)-vector per refined pair, in chunks.
        values = np.empty(diff.shape[0])
        step = max(1, _CHUNK_BYTES // max(1, 8 * diff.shape[-1]))
        for start in range(0, diff.shape[0], step):
            block = diff[start : start + step]
            values[start : start + step] = np.einsum("kd,kd->k", block, block)
        sq[refine] = values
    return np.maximum(sq, 0.0)


def pairwise_norm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``||x_i - y_j||`` for ``x (..., n, d)``, ``y (..., m, d)``; right for any finite input."""
    scale = common_scale(x, y)
    if scale == 1.0:
        return np.sqrt(_scaled_sq_distances(x, y))
    return scale * np.sqrt(_scaled_sq_distances(x / scale, y / scale))


def pairwise_sq_distances(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``||x_i - y_j||^2``; ``inf`` only where the true value exceeds the float64 range."""
    scale = common_scale(x, y)
    if scale == 1.0:
        return _scaled_sq_distances(x, y)
    # ldexp, not (scale * scale) *: that square overflows to inf (inf * 0 = NaN at
    # coincident points) or underflows to 0 where the squared distance is representable.
    exponent = int(np.frexp(scale)[1]) - 1                # scale == 2 ** exponent
    with np.errstate(over="ignore"):
        return np.ldexp(_scaled_sq_distances(x / scale, y / scale), 2 * exponent)


def ordered_sq_distances(x, y_t, *, out=None, work=None, xp=np):
    """``sum_k (x_ik - y_jk)^2`` for ``x (m, d)`` and ``y_t = y.T (d, n)``, summed in order.

    The accumulator starts at ``0`` and takes ``k = 0, 1, ..., d - 1`` in turn; every
    difference, square and sum is one ufunc call, i.e. one correctly rounded IEEE
    operation per element (NumPy fuses none into an FMA, and an elementwise ufunc gives
    the same bits whatever SIMD width it runs at). The result is therefore a function of
    the two rows alone: identical rows give identical values wherever they sit in ``x``
    or ``y``, on every CPU. A compiled twin gets the same bits with the loop
    ``acc = 0.0; for k: t = x[k] - y[k]; acc += t * t`` compiled without fast-math (no
    reassociation, no contraction), which ``refdml.gpu.metrics._compiled`` does.
    The caller keeps the entries small enough that the squares cannot overflow (a common
    power-of-two scaling, or unit rows). ``y_t`` is the transposed reference set so that
    each step reads a contiguous row. ``out`` and ``work``: optional (m, n) buffers.
    ``xp``: the array module (NumPy, or CuPy for the fast path's device arrays).
    """
    shape = (x.shape[0], y_t.shape[1])
    if out is None:
        acc = xp.zeros(shape, dtype=xp.result_type(x, y_t))
    else:
        acc = out
        acc[...] = 0.0
    step = xp.empty_like(acc) if work is None else work
    for k in range(x.shape[1]):
        xp.subtract(x[:, k, None], y_t[None, k, :], out=step)
        xp.multiply(step, step, out=step)
        xp.add(acc, step, out=acc)
    return acc


def ordered_unit_rows(x, *, xp=np):
    """Each row divided by its Euclidean norm, by a fixed sequence of IEEE operations.

    Per row: division by the power of two ``2^e`` with ``max_k |x_k| / 2^e`` in [0.5, 1)
    (``ldexp``: exact, except that entries more than ~2^1074 below the row's largest
    underflow, the same way on every machine), the squares summed left to right as in
    :func:`ordered_sq_distances`, one correctly rounded square root, one division per
    entry. A row's result depends on that row alone (not on the CPU, SIMD width or its
    position). Rows must be nonzero and finite. ``xp``: the array module (NumPy, or CuPy
    for the fast path's device arrays).
    """
    exponent = xp.frexp(xp.max(xp.abs(x), axis=1))[1]
    scaled = xp.ldexp(x, -exponent[:, None])
    total = xp.zeros(x.shape[0], dtype=x.dtype)
    for k in range(x.shape[1]):
        total += scaled[:, k] * scaled[:, k]
    return scaled / xp.sqrt(total)[:, None]


def masked_logsumexp(
    z: np.ndarray, mask: np.ndarray | None = None, *, axis: int = -1
) -> tuple[np.ndarray, np.ndarray]:
    """``log sum_{mask} exp(z)`` along ``axis`` and the softmax over the masked entries.

    A row with no masked entry gets ``-inf`` and all-zero weights. ``z`` must be finite
    where ``mask`` is true. Returns ``(lse, softmax)``; ``lse`` drops ``axis``.
    """
    if mask is None:
        masked = z
    else:
        masked = np.where(mask, z, -np.inf)
    shift = np.max(masked, axis=axis, keepdims=True)
    empty = ~np.isfinite(shift)
    shift = np.where(empty, 0.0, shift)
    with np.errstate(divide="ignore"):
        weights = np.exp(masked - shift)
        total = np.sum(weights, axis=axis, keepdims=True)
        lse = np.log(total) + shift
    softmax = weights / np.where(total > 0.0, total, 1.0)
    return np.squeeze(lse, axis=axis), softmax


def check_nonzero_rows(x: np.ndarray, name: str, *, why: str = "its direction is needed") -> None:
    """Raise ``ValueError`` naming ``name`` and the first row (last axis) that is all zeros
    (the check is :func:`refdml._validation.check_nonzero_rows`, on ``x``'s module)."""
    ns = get_backend(x)
    _validation.check_nonzero_rows(ns.xp, x, name, why=why, ns=ns)
