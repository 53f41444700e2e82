"""Cross predictions of the two halves, XML Eq. (2.10) / GSP Algorithm 4, as a pair.

Scale: ``Z`` and ``targets`` are divided by powers of two ``t``, ``s`` once for the whole
batch (exact) and both halves are fitted on the rescaled data with the normalised ridge
of :mod:`refdml.prototypes._ridge`: ``V_k = (s / t) omega W_k`` and
``P_1 = Z_1 V_2 = s omega Zs_1 W_2``, applied with ``numpy.ldexp`` at the end, so the
predictions are right at any finite scale (or a named error says they overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale
from refdml._validation import (
    as_float_array,
    check_context,
    check_same_length,
    check_scalar,
    check_upstream,
)
from refdml.crossbatch._split import check_mask
from refdml.prototypes._ridge import (
    NormalisedFit,
    Scaling,
    fit_normalised,
    fit_normalised_backward,
    scaling_for,
    times_pow2,
)

__all__ = ["CrossFitContext", "CrossFitGrads", "cross_fit", "cross_fit_backward", "cross_fit_forward"]


@dataclass(frozen=True)
class CrossFitGrads:
    Z: np.ndarray
    targets: np.ndarray


@dataclass(frozen=True)
class CrossFitContext:
    """Both halves' normalised fits (``fit_first`` = ``V_1``, fitted on half 1)."""

    first: np.ndarray            # indices of half 1
    second: np.ndarray           # indices of half 2
    fit_first: NormalisedFit
    fit_second: NormalisedFit
    scaling: Scaling
    shape: tuple[int, int]       # shape of the predictions, (b, d)


def cross_fit_kernel(Z: np.ndarray, targets: np.ndarray, mask: np.ndarray, ridge: float,
                     Z_name: str = "Z"):
    """Forward kernel (valid input assumed); returns ``(P, ctx)``."""
    first, second = np.flatnonzero(mask), np.flatnonzero(~mask)
    sc = scaling_for(Z, targets, ridge)
    Zs = np.ldexp(Z, -sc.log2_t)
    Ts = np.ldexp(targets, -sc.log2_s)
    fit_first = fit_normalised(Zs[first], Ts[first], sc, "auto", f"{Z_name}[split]", ridge)
    fit_second = fit_normalised(Zs[second], Ts[second], sc, "auto", f"{Z_name}[~split]", ridge)
    scaled = np.empty((Z.shape[0], targets.shape[1]))
    scaled[first] = Zs[first] @ fit_second.W
    scaled[second] = Zs[second] @ fit_first.W
    predictions = times_pow2(scaled, sc.omega_mantissa, sc.log2_s + sc.omega_exponent,
                             "the cross predictions")
    ctx = CrossFitContext(first, second, fit_first, fit_second, sc, predictions.shape)
    return predictions, ctx


def cross_fit_backward_kernel(ctx: CrossFitContext, d_pred: np.ndarray) -> CrossFitGrads:
    """Backward kernel: ``P_1 = s omega Zs_1 W_2(Zs_2, Ts_2)`` and the mirror image."""
    first, second, sc = ctx.first, ctx.second, ctx.scaling
    log2_g = int(np.log2(common_scale(d_pred)))
    D = np.ldexp(d_pred, -log2_g)
    D1, D2 = D[first], D[second]
    f1, f2 = ctx.fit_first, ctx.fit_second
    # Half 1 enters through its prediction Zs_1 W_2 and through the fit W_1 that half 2 uses.
    from_W1 = fit_normalised_backward(f1, f2.Zs.T @ D2)
    from_W2 = fit_normalised_backward(f2, f1.Zs.T @ D1)
    d_Zs = np.empty((D.shape[0], f1.Zs.shape[1]))
    d_Ts = np.empty_like(D)
    d_Zs[first] = D1 @ f2.W.T + from_W1[0]
    d_Zs[second] = D2 @ f1.W.T + from_W2[0]
    d_Ts[first] = from_W1[1]
    d_Ts[second] = from_W2[1]
    # P = s omega P~(Z / t, T / s): dZ = (s omega / t) dZs, dT = omega dTs.
    d_Z = times_pow2(d_Zs, sc.omega_mantissa, log2_g + sc.log2_s + sc.omega_exponent - sc.log2_t,
                     "the gradient of Z")
    d_T = times_pow2(d_Ts, sc.omega_mantissa, log2_g + sc.omega_exponent, "the gradient of targets")
    return CrossFitGrads(Z=d_Z, targets=d_T)


def cross_fit_forward(Z, targets, split, *, ridge) -> tuple[np.ndarray, CrossFitContext]:
    r"""Cross predictions ``P`` (b, d); returns ``(P, ctx)``.

    .. math::

        P_i = Z_i V_2 \ (i \in \text{half 1}), \qquad P_i = Z_i V_1 \ (i \in \text{half 2}),
        \qquad V_k = \arg\min_V \|Z_k V - T_k\|_F^2 + \epsilon \|V\|_F^2,

    i.e. ``V_k = ridge_fit(Z[half k], targets[half k], ridge=ridge)``; half 1 is
    ``split`` (a boolean mask, both halves non-empty; class-disjointness is the caller's
    business). ``ridge`` is the paper's ϵ (epsilon) of XML Eq. (2.8) / GSP (P3).

    Parameters
    ----------
    Z : float array (b, m)
        The batch's features (histograms), one row per sample.
    targets : float array (b, d)
        What each half's ridge fit predicts from ``Z``, one row per sample.
    split : bool array (b,)
        ``True`` for half 1; both halves non-empty.
    ridge : float > 0
        Ridge weight of each half's fit, the paper's ϵ (epsilon).
    """
    Z = as_float_array(Z, "Z", ndim=2)
    targets = as_float_array(targets, "targets", ndim=2)
    check_same_length(Z, "Z", targets, "targets")
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    mask = check_mask(split, Z.shape[0])
    return cross_fit_kernel(Z, targets, mask, ridge)


def cross_fit_backward(ctx: CrossFitContext, d_predictions) -> CrossFitGrads:
    """Gradients ``.Z`` (b, m) and ``.targets`` (b, d) of ``<d_predictions, P>``.

    ``d_predictions`` has the shape of ``P`` exactly, (b, d).
    """
    check_context(ctx, "ctx", CrossFitContext)
    d_predictions = check_upstream(d_predictions, "d_predictions", ctx.shape)
    return cross_fit_backward_kernel(ctx, d_predictions)


def cross_fit(Z, targets, split, *, ridge) -> np.ndarray:
    """Cross predictions (no context kept); see :func:`cross_fit_forward`."""
    return cross_fit_forward(Z, targets, split, ridge=ridge)[0]
