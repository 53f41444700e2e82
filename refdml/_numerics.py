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
``masked_logsumexp``
    ``log sum_{mask} exp(z)`` along an axis with its softmax, ``-inf`` and zero weights
    on a row with no masked entry (never NaN).
``check_nonzero_rows``
    The one place that refuses zero vectors, under the caller's parameter name.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "check_nonzero_rows",
    "common_scale",
    "masked_logsumexp",
    "pairwise_norm",
    "pairwise_sq_distances",
    "row_norm",
]

# Squared distances below this fraction of |x|^2 + |y|^2 are recomputed exactly.
_REFINE = 1e-3
# Bytes of explicit differences materialised at once when refining.
_CHUNK_BYTES = 64 * 2**20


def common_scale(*arrays: np.ndarray) -> float:
    """A power of two ``s`` with ``max|a| / s`` in [0.5, 1) over all arrays (1.0 for zeros;
    [1, 2) for ``max|a| >= 2^1023``, where ``2^1024`` would overflow).

    Dividing by a power of two is exact, so scaled computations lose nothing, and
    squares of the scaled values can neither overflow nor (for the largest) underflow.
    """
    largest = max((float(np.max(np.abs(a), initial=0.0)) for a in arrays), default=0.0)
    if largest == 0.0 or not np.isfinite(largest):
        return 1.0
    # 2^1024 is not a float64: above 2^1023 the scaled maximum is in [1, 2) instead.
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
    with np.errstate(over="ignore"):
        return (scale * scale) * _scaled_sq_distances(x / scale, y / scale)


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
    """Raise ``ValueError`` naming ``name`` and the first row (last axis) that is all zeros."""
    zero = ~np.any(x != 0.0, axis=-1)
    if np.any(zero):
        index = tuple(int(i) for i in np.argwhere(zero)[0])
        where = index[0] if len(index) == 1 else index
        raise ValueError(f"{name} has a zero vector at row {where}; {why}")
