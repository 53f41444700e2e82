"""XML Eq. (2.9): the ridge fit of a batch from the fits of its two halves."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import LinAlgError, cho_factor, cho_solve

from refdml._validation import as_float_array, check_same_length
from refdml.prototypes._ridge import (
    check_fit_inputs,
    numerically_definite,
    ridge_forward,
    scaling_for,
)

__all__ = ["TwoBatchDecomposition", "two_batch_decomposition"]


@dataclass(frozen=True)
class TwoBatchDecomposition:
    """Eq. (2.9): ``V = W V1 + (I - W) V2``.

    ``V1``, ``V2`` (m, d) are the halves' ridge fits with ``ridge / 2``; ``W`` (m, m) is
    the derived or printed weight; ``V`` the combination under that ``W``.
    """

    W: np.ndarray
    V1: np.ndarray
    V2: np.ndarray
    V: np.ndarray


def _singular(what: str, ridge: float, names: str) -> ValueError:
    return ValueError(
        f"{what} is numerically singular: ridge == {ridge!r} is below the rounding level of "
        f"the Gram matrices of {names}, whose rows do not span all prototypes, so W (m x m) "
        "is not determined in float64; use a larger ridge (the whole-batch fit itself is "
        "ridge_fit on the stacked halves)"
    )


def two_batch_decomposition(Z1, Y1, Z2, Y2, *, ridge, printed: bool = False) -> TwoBatchDecomposition:
    r"""XML Eq. (2.9): the ridge fit of a whole batch from the fits of two halves.

    With ``R_k = Z_k^T Z_k + (ridge/2) I`` and ``V_k = R_k^{-1} Z_k^T Y_k`` (ridge with
    ``ridge / 2``), the ridge fit of the stacked batch with ``ridge`` is

    .. math::

        V = W V_1 + (I - W) V_2, \qquad W = (R_1 + R_2)^{-1} R_1
          = R_2^{-1} (R_1^{-1} + R_2^{-1})^{-1}.

    The paper prints ``W = R_2^{-1} (R_1^{-1} + R_1^{-2})^{-1}`` (``R_1^{-2}`` for
    ``R_2^{-1}``); ``printed=True`` returns that matrix, evaluated as
    ``R_2^{-1} (R_1 + I)^{-1} R_1^2``, and the ``V`` it gives (not the ridge fit).

    Scale. ``V_1``, ``V_2`` are :func:`ridge_fit` (exact rescaling, any finite scale).
    The derived ``W`` is invariant under ``Z_k -> t Z_k``, ``ridge -> t^2 ridge``, so it is
    computed from ``Z_k / t`` (``t`` a power of two) with the normalised ridge; the
    printed ``W`` is not (its ``+ I`` breaks the scaling) and is evaluated as printed,
    raising a ``ValueError`` where ``R_k`` overflows.

    Singular systems. ``W`` is an ``m x m`` matrix of ratios of the ridge terms on the
    directions that no row spans. When ``ridge`` is below the rounding level of
    ``||Z_k||^2`` and the rows do not span all prototypes, ``R_1 + R_2`` is numerically
    singular and those ratios are lost to rounding: no algorithm (``lstsq``, ``pinv``)
    recovers them from float64, so a ``ValueError`` says so instead of SciPy's
    ``LinAlgError``. (``V_1``, ``V_2`` alone stay defined through the kernel form.)

    Parameters
    ----------
    Z1, Z2 : arrays (b1, m), (b2, m)
    Y1, Y2 : arrays (b1, d), (b2, d)
    ridge : float > 0
        Ridge weight of the whole batch, the paper's ϵ (epsilon) of XML Eq. (2.8);
        each half uses ``ridge / 2``.
    printed : bool
        Use the printed ``W`` instead of the derived one.
    """
    Z1, Y1, ridge = check_fit_inputs(Z1, Y1, ridge, "Z1", "Y1")
    Z2 = as_float_array(Z2, "Z2", ndim=2)
    Y2 = as_float_array(Y2, "Y2", ndim=2)
    check_same_length(Z2, "Z2", Y2, "Y2")
    if Z2.shape[1] != Z1.shape[1] or Y2.shape[1] != Y1.shape[1]:
        raise ValueError(
            f"the halves must have the same columns, got Z1 {Z1.shape}, Y1 {Y1.shape}, "
            f"Z2 {Z2.shape}, Y2 {Y2.shape}"
        )
    m = Z1.shape[1]
    half = 0.5 * ridge
    V1 = ridge_forward(Z1, Y1, half, "auto", "Z1")[0]
    V2 = ridge_forward(Z2, Y2, half, "auto", "Z2")[0]
    if printed:
        with np.errstate(over="ignore", invalid="ignore"):
            R1 = Z1.T @ Z1 + half * np.eye(m)
            R2 = Z2.T @ Z2 + half * np.eye(m)
            R1_squared = R1 @ R1
        if not (np.all(np.isfinite(R1_squared)) and np.all(np.isfinite(R2))):
            raise ValueError("the printed W needs R_1^2 and R_2, which overflow float64 here")
        if not numerically_definite(R2, half):
            raise _singular("R_2 = Z2^T Z2 + (ridge/2) I", ridge, "Z2")
        try:
            W = cho_solve(cho_factor(R2, lower=True),
                          cho_solve(cho_factor(R1 + np.eye(m), lower=True), R1_squared))
        except LinAlgError:
            raise _singular("R_2 = Z2^T Z2 + (ridge/2) I", ridge, "Z2") from None
    else:
        # W = (G1 + G2 + r' I)^{-1} (G1 + r'/2 I) on Z_k / t, normalised as in ridge_fit.
        scaling = scaling_for(np.vstack([Z1, Z2]), Y1, ridge)
        omega, rho = scaling.omega, scaling.rho
        R1n = omega * (np.ldexp(Z1, -scaling.log2_t).T @ np.ldexp(Z1, -scaling.log2_t))
        R2n = omega * (np.ldexp(Z2, -scaling.log2_t).T @ np.ldexp(Z2, -scaling.log2_t))
        R1n[np.diag_indices(m)] += 0.5 * rho
        R2n[np.diag_indices(m)] += 0.5 * rho
        total = R1n + R2n
        if not numerically_definite(total, rho):
            raise _singular("R_1 + R_2 = Z1^T Z1 + Z2^T Z2 + ridge I", ridge, "Z1 and Z2")
        W = cho_solve(cho_factor(total, lower=True), R1n)
    V = W @ V1 + (V2 - W @ V2)
    return TwoBatchDecomposition(W=W, V1=V1, V2=V2, V=V)
