"""Pieces of :mod:`refdml.gpu.losses`: the masked log-sum-exp, the reductions, the
pairwise matrices the losses see the embeddings through, and their backward.

The masked log-sum-exp (the reduction of the softmax-type losses: multi-similarity,
SoftTriple; Proxy-Anchor and ProxyNCA++ past their bound; and of the entropic histogram and
the zero-shot loss) is this family's fast-path seam. Its three implementations sit side by
side behind one interface, ``impl.masked_logsumexp(xp, z, mask, axis=, extra_zero=)``:
:class:`ArrayLse` (the array code, NumPy or CuPy: the fallback and the twin the kernels are
tested against) and :class:`CompiledLse` with a launcher of the CPU twin
(``refdml.gpu.losses._compiled.masked_lse_cpu``) or of the CUDA kernel
(``refdml.gpu.losses._cuda.refdml_loss_masked_lse``), both fed one
:class:`refdml.gpu.losses._compiled.MaskedLseBuffers`. :data:`MASKED_LSE` lists them and chooses
one per call (``MASKED_LSE.choose(z)``, steered by :func:`refdml.gpu.use_kernels`); a
forward that takes several log-sum-exps chooses once and runs them all on that one, and
:func:`masked_logsumexp` is the one-call form.

Scale: the Euclidean losses divide the embeddings by one common power of two ``s``
(exact), as the reference does, and keep ``x / s`` and the distances ``D / s`` in their
context: the gradient of ``D`` with respect to ``x`` is that of ``D / s`` with respect to
``x / s`` (degree 0), so the backward divides by numbers near 1 and is right at any scale,
subnormal embeddings included (a float32 subnormal, below 1.2e-38, holds fewer than 24
bits: the result is that of the rounded input); the cosine losses use
:func:`refdml.gpu.normalize._l2_forward`
(a power of two per row, exact), or for the proxy losses :func:`cross_cosine`'s one pass
over embeddings and proxies by their plain norms where that is as accurate, so the
gradient with respect to the raw rows needs no further factor and ``row_scale`` /
``embedding_scale`` / ``proxy_scale`` in the reference's contexts are ones here (cached,
read-only, recognised by the backward: :func:`refdml.gpu.normalize.ones_column`).

Proxy-Anchor and ProxyNCA++ take a where-free log-sum-exp with a constant shift where
:func:`exp_fits` says the hyperparameters bound the logits tightly enough
(:func:`cosine_bound`), and the masked log-sum-exp otherwise.

A set compared with itself is normalised once, and its backward adds the two
arguments' gradients in one matrix product.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from refdml._shared.losses import COSINE_WHY, TWO_64
from refdml._backend import Backend
from refdml.distances import CosineContext, EuclideanContext
from refdml.normalize import L2NormalizeContext
from refdml.gpu.losses._compiled import MaskedLseBuffers, masked_lse_cpu
from refdml.gpu.losses._cuda import refdml_loss_masked_lse
from refdml._validation import data_checks
from refdml.gpu._support.launch import BLOCK, cuda_launch
from refdml.gpu._support.modes import Implementations
from refdml.gpu._support.threading_layer import parallel_launch
from refdml.gpu.distances import _scaled_sq, common_scale
from refdml.gpu.normalize import _l2_backward, _l2_forward, _quiet, is_ones_column, ones_column

__all__ = ["COSINE_WHY", "MASKED_LSE", "ArrayLse", "CompiledLse", "LseImplementation",
           "cosine_backward_sum", "cosine_bound", "cross_cosine", "exp_fits", "exp_limit",
           "is_ones_column", "masked_logsumexp", "ones_column", "reduce_terms",
           "scalar_value", "self_cosine", "self_euclidean", "self_pairwise_backward"]

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


# ------------------------------------------------------------------ the masked log-sum-exp
class LseImplementation(Protocol):
    """The interface of the masked log-sum-exp's implementations (:data:`MASKED_LSE`)."""

    def masked_logsumexp(self, xp: Any, z: Any, mask: Any = None, *, axis: int = -1,
                         extra_zero: bool = False) -> tuple[Any, Any]:
        """See :func:`masked_logsumexp`."""


class ArrayLse:
    """The masked log-sum-exp written once against ``xp`` (NumPy or CuPy): the array path."""

    def masked_logsumexp(self, xp: Any, z: Any, mask: Any = None, *, axis: int = -1,
                         extra_zero: bool = False) -> tuple[Any, Any]:
        masked = z if mask is None else xp.where(mask, z, -xp.inf).astype(z.dtype, copy=False)
        shift = xp.max(masked, axis=axis, keepdims=True)
        if extra_zero:
            shift = xp.maximum(shift, 0)
        else:
            shift = xp.where(xp.isfinite(shift), shift, 0).astype(z.dtype, copy=False)
        with _quiet(xp):
            weights = xp.exp(masked - shift)
            total = xp.sum(weights, axis=axis, keepdims=True)
            if extra_zero:
                total = total + xp.exp(-shift)
            lse = xp.log(total) + shift
        softmax = weights / xp.where(total > 0, total, xp.ones_like(total))
        return xp.squeeze(lse, axis=axis), softmax


class CompiledLse:
    """The masked log-sum-exp by a compiled kernel: the rows of the broadcast ``z`` / ``mask``
    along ``axis``, made contiguous (one copy where they are not), as one
    :class:`MaskedLseBuffers` that ``launch`` fills (the CPU twin or the CUDA kernel)."""

    def __init__(self, launch: Callable[[MaskedLseBuffers], None]):
        self.launch = launch

    def masked_logsumexp(self, xp: Any, z: Any, mask: Any = None, *, axis: int = -1,
                         extra_zero: bool = False) -> tuple[Any, Any]:
        if not (z.ndim and z.shape[axis] and z.size):
            # No row to launch over (a 0-d z, empty rows, or none): the array path's answer.
            return _ARRAY_LSE.masked_logsumexp(xp, z, mask, axis=axis, extra_zero=extra_zero)
        if mask is not None:
            z, mask = xp.broadcast_arrays(z, mask)
        moved = xp.moveaxis(z, axis, -1)
        shape = moved.shape
        z2 = xp.ascontiguousarray(moved).reshape(-1, shape[-1])
        if mask is None:
            mask2 = xp.ones((1, 1), dtype=bool)
        else:
            mask2 = xp.ascontiguousarray(xp.moveaxis(mask, axis, -1), dtype=bool).reshape(
                z2.shape)
        buffers = MaskedLseBuffers(
            z=z2, mask=mask2, has_mask=mask is not None, extra_zero=bool(extra_zero),
            lse=xp.empty(z2.shape[0], dtype=z.dtype), weights=xp.empty(z2.shape, dtype=z.dtype))
        self.launch(buffers)
        return (buffers.lse.reshape(shape[:-1]),
                xp.moveaxis(buffers.weights.reshape(shape), -1, axis))


def _launch_cpu_twin(buffers: MaskedLseBuffers) -> None:
    with parallel_launch():
        masked_lse_cpu(*buffers.args())


def _launch_cuda(buffers: MaskedLseBuffers) -> None:
    cuda_launch(refdml_loss_masked_lse, buffers.z.shape[0], BLOCK, *buffers.args())


_ARRAY_LSE = ArrayLse()

#: The masked log-sum-exp's implementations, and the one object that chooses among them.
MASKED_LSE: Implementations[LseImplementation] = Implementations(
    "losses",
    array=_ARRAY_LSE,
    load_cpu=lambda: CompiledLse(_launch_cpu_twin),
    load_cuda=lambda: CompiledLse(_launch_cuda),
    auto_numpy="array",
    auto_cupy="cuda",
    measured=(
        "NumPy: scripts/bench_gpu.py --only lse on the 2-core machine (docs/gpu.md, "
        "'Numbers'): extra_zero, half masked, (256, 256) array path 1.1 ms vs CPU twin 22 ms "
        "(float32), 2.0 vs 18 ms (float64); (1024, 1024) 40 vs 63 ms (float32), 100 vs 63 ms "
        "(float64): the twin pays only for large float64 rows, the losses' rows are small. "
        "CuPy: the kernel is one launch per call where the array path takes 13 (15 with "
        "extra_zero), counted on the CuPy stand-in; the H200 run (2026-11-28) checked its "
        "parity but did not time it alone."
    ),
)


def masked_logsumexp(
    xp: Any, z: Any, mask: Any = None, *, axis: int = -1, extra_zero: bool = False
) -> tuple[Any, Any]:
    """``log(sum_{mask} exp(z))`` along ``axis`` and the softmax of the masked entries.

    ``extra_zero=True`` adds one more logit 0 to every row (``log(1 + sum exp z)``; its own
    weight is not returned). A row with nothing in it gives ``-inf`` (``0`` with
    ``extra_zero``) and zero weights, never NaN. Returns ``(lse, softmax)``; ``lse`` drops
    ``axis``. Entries of ``z`` outside ``mask`` are never read into the result. Runs the
    implementation :data:`MASKED_LSE` chooses for ``z``.
    """
    return MASKED_LSE.choose(z).masked_logsumexp(xp, z, mask, axis=axis, extra_zero=extra_zero)


# ------------------------------------------------------------------------ the reductions
def reduce_terms(xp: Any, terms: Any, reduction: str, exists: Any = None) -> tuple[Any, Any]:
    """Reduce the non-negative ``terms`` that ``exists`` (bool, default all); return the
    value (0-d float64 array, not yet synchronised) and d value / d terms (dtype of terms).

    ``"mean"`` divides by the number of existing terms, ``"mean_nonzero"`` by the number
    of strictly positive ones, ``"sum"`` by 1; no term at all gives 0 and zero weights.
    The sum is accumulated in float64 (float32 terms cannot overflow it); float64 terms
    whose sum overflows while their mean does not are reduced as the reference reduces
    them (:func:`_mean`).
    """
    if exists is None and reduction != "mean_nonzero":
        # Every term counts: a constant weight, no mask to build or count.
        count = 1 if reduction == "sum" else max(terms.size, 1)
        value = _mean(xp, terms, count)
        return value, xp.full(terms.shape, 1 / count, dtype=terms.dtype)
    weight = terms > 0 if reduction == "mean_nonzero" else exists
    if reduction == "sum":
        count = xp.ones((), dtype=terms.dtype)
    else:
        count = xp.maximum(xp.count_nonzero(weight), 1).astype(terms.dtype)
    weight = weight.astype(terms.dtype)
    value = _mean(xp, terms, count.astype(xp.float64))
    return value, weight / count


def _mean(xp: Any, terms: Any, count: Any) -> Any:
    """``sum(terms) / count`` (0-d float64, not synchronised) without overflow of the sum.

    Where the float64 sum overflows, the reference takes ``2^64 (sum(terms / 2^64) /
    count)`` (exact powers of two; terms too small to survive ``2^-64`` are negligible next
    to a sum beyond 1e308): the same here, on NumPy only then; on CuPy float64 both sums
    are formed and the finite one kept (no synchronisation). float32 terms need neither.
    """
    with _quiet(xp):
        total = xp.sum(terms, dtype=xp.float64)
        if terms.dtype == np.float32:
            return total / count
        if xp is np:
            if np.isfinite(total):
                return total / count
            return TWO_64 * (xp.sum(terms / TWO_64) / count)
        scaled = TWO_64 * (xp.sum(terms / TWO_64) / count)
        return xp.where(xp.isfinite(total), total / count, scaled)


def scalar_value(value: Any, reduction: str) -> float:
    """The loss value as a Python float: the one synchronisation of a loss forward."""
    out = float(value)
    if not np.isfinite(out):
        raise ValueError(
            f"the loss value (reduction={reduction!r}) exceeds the float64 range: the "
            "embeddings are too far apart"
        )
    return out


def self_euclidean(ns: Backend, x: Any) -> tuple[Any, EuclideanContext, Any]:
    """``D_ij = ||x_i - x_j||`` (exact 0 diagonal); ``(D, ctx, ones((n, 1)))``.

    ``ctx`` holds ``x / s`` and ``D / s`` (module docstring), like the reference's. On
    NumPy nearby pairs are recomputed from explicit differences (coincident rows: exactly
    0); on CuPy only the diagonal is exact (:mod:`refdml.gpu.distances`).
    """
    xp = ns.xp
    scale = common_scale(xp, x)
    scaled = x / scale
    with _quiet(xp):
        scaled_distance = xp.sqrt(_scaled_sq(xp, scaled, scaled, True))
        distance = scaled_distance * scale
    if data_checks(ns) and not bool(xp.all(xp.isfinite(distance))):
        raise ValueError(
            "embeddings has pairwise distances beyond the "
            f"{np.dtype(x.dtype).name} range (max |entry| == {float(xp.max(xp.abs(x))):.3g})"
        )
    ones = xp.ones((x.shape[0], 1), dtype=x.dtype)
    return distance, EuclideanContext(x=scaled, y=scaled, distance=scaled_distance), ones


def self_cosine(ns: Backend, x: Any) -> tuple[Any, CosineContext, Any]:
    """``S_ij = cos(x_i, x_j)``, one normalisation; ``(S, ctx, ones((n, 1)))``."""
    xp = ns.xp
    unit, norm_ctx = _l2_forward(ns, x, "embeddings", COSINE_WHY)
    similarity = unit @ unit.T
    ctx = CosineContext(unit, unit, norm_ctx, norm_ctx, tuple(similarity.shape))
    return similarity, ctx, xp.ones((x.shape[0], 1), dtype=x.dtype)


def self_pairwise_backward(xp: Any, metric_ctx: Any, g: Any) -> Any:
    """Gradient with respect to ``x`` of ``<g, M(x, x)>`` (both arguments), one matmul."""
    sym = g + g.T
    if isinstance(metric_ctx, CosineContext):
        return _l2_backward(xp, metric_ctx.x_norm_ctx, sym @ metric_ctx.x_unit)
    distance = metric_ctx.distance
    # Subgradient 0 at coincident points: w = sym / D where D > 0, else 0. Arithmetic masks
    # (``sym`` is finite, the denominator never 0) instead of ``where`` (several times slower
    # on NumPy).
    coincident = distance == 0
    w = sym / (distance + coincident)
    w *= ~coincident
    grad = w @ metric_ctx.x
    return xp.subtract(w.sum(axis=1)[:, None] * metric_ctx.x, grad, out=grad)


def cosine_backward_sum(xp: Any, ctx: CosineContext, g: Any):
    """``(d_x, d_y)`` of ``<g, cos(x, y)>`` for 2-d ``x``, ``y`` (the proxy losses' kernel).

    Per set one matrix product ``d_u`` and the tangent projection
    ``(d_u - u (u . d_u)) / ||row||`` in place, the row dot an ``einsum``; the division by
    the power-of-two ``scale`` is skipped where it is the fast path's cached ones.
    """
    grads = []
    for norm_ctx, other, upstream in ((ctx.x_norm_ctx, ctx.y_unit, g),
                                      (ctx.y_norm_ctx, ctx.x_unit, g.T)):
        unit = norm_ctx.y
        grad = upstream @ other
        grad -= unit * xp.einsum("ij,ij->i", unit, grad)[:, None]
        grad /= norm_ctx.scaled_norm
        if not is_ones_column(norm_ctx.scale):
            grad /= norm_ctx.scale
        grads.append(grad)
    return grads[0], grads[1]


# Row sums of squares inside which the plain ``x / sqrt(sum x^2)`` is as accurate as the
# scaled normalisation: no square overflows, and squares lost to underflow (each below the
# subnormal spacing) are negligible against the sum.
_PLAIN_NORM_RANGE = {
    np.dtype(np.float32): (1e-30, 1e36),
    np.dtype(np.float64): (1e-280, 1e300),
}


def cross_cosine(ns: Backend, x: Any, p: Any) -> tuple[Any, CosineContext]:
    """``cos(x_i, p_k)``; the names ``embeddings`` / ``proxies`` in zero-row errors.

    Both sets are normalised in one pass over ``[x; p]``: where every row's sum of squares
    lies in :data:`_PLAIN_NORM_RANGE` (one reduction and one synchronisation, which also
    stands for the zero-row check) the rows are divided by their plain norm and the
    contexts' ``scale`` are ones; otherwise (a zero row, entries near the ends of the
    range, or the data checks turned off on CuPy) each set goes through the scaled
    :func:`refdml.gpu.normalize._l2_forward`, which names the zero row.
    """
    xp = ns.xp
    n = x.shape[0]
    if data_checks(ns):
        joint = xp.concatenate([x, p])
        sumsq = xp.einsum("ij,ij->i", joint, joint)[:, None]
        low, high = _PLAIN_NORM_RANGE[np.dtype(x.dtype)]
        if bool(xp.all((sumsq >= low) & (sumsq <= high))):
            norm = xp.sqrt(sumsq)
            unit = joint / norm
            x_unit, p_unit = unit[:n], unit[n:]
            x_ctx = L2NormalizeContext(y=x_unit, scale=ones_column(xp, n, x.dtype),
                                       scaled_norm=norm[:n])
            p_ctx = L2NormalizeContext(y=p_unit, scale=ones_column(xp, p.shape[0], x.dtype),
                                       scaled_norm=norm[n:])
            similarity = x_unit @ p_unit.T
            return similarity, CosineContext(x_unit, p_unit, x_ctx, p_ctx,
                                             tuple(similarity.shape))
    x_unit, x_ctx = _l2_forward(ns, x, "embeddings", COSINE_WHY)
    p_unit, p_ctx = _l2_forward(ns, p, "proxies", COSINE_WHY)
    similarity = x_unit @ p_unit.T
    return similarity, CosineContext(x_unit, p_unit, x_ctx, p_ctx, tuple(similarity.shape))
