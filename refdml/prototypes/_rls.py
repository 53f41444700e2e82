"""The RLS recursion of XML Eqs. (2.5)-(2.7) and its weights ``W_K``."""

from __future__ import annotations

import numpy as np
from scipy.linalg import cho_factor, cho_solve, cholesky, solve_triangular

from refdml._validation import as_float_array, check_same_length, check_scalar
from refdml.prototypes._ridge import numerically_definite

__all__ = ["RecursivePrototypes", "recursion_weights"]

# A Woodbury step that shrinks P_K by more than this factor has cancelled that many
# digits (about 4); P_{K+1} is then refactored from R_{K+1}.
_WOODBURY_LOSS = 1e4


def _overflow_message(name: str, Z: np.ndarray) -> str:
    return (
        f"{name}^T {name} overflows float64 (max |{name}| == {np.abs(Z).max():.3g}); "
        "the information matrix R_K cannot be represented: rescale the histograms"
    )


class RecursivePrototypes:
    r"""Recursive least squares for the prototypes of XML Eqs. (2.5)-(2.7).

    After ``K`` calls of :meth:`update`, :attr:`prototypes` equals the batch solution

    .. math::

        V^{(K)} = \arg\min_V \sum_{i=1}^K \alpha^{K-i} \|Z_i V - Y_i\|_F^2 + \beta \|V\|_F^2
                = R_K^{-1} Q_K,

    ``R_K = sum_i alpha^{K-i} Z_i^T Z_i + ridge I``, ``Q_K = sum_i alpha^{K-i} Z_i^T Y_i``.

    The recursion. ``R_{K+1} = alpha R_K + R`` with ``R = Z^T Z + (1 - alpha) ridge I``
    (the paper prints "``R^{-1} = Z Z^T + (1-alpha) beta I``", a typo for ``R``), and

    ``V^{(K+1)} = V^{(K)} + R_{K+1}^{-1} (Z^T (Y - Z V^{(K)}) - (1 - alpha) ridge V^{(K)})``,

    which is Eq. (2.7) rewritten: ``W_K V^{(K)} + (I - W_K) V_batch`` with the derived
    ``W_K = R_{K+1}^{-1} alpha R_K`` (see :func:`recursion_weights`) and
    ``V_batch = R^{-1} Z^T Y``; unlike (2.7) it does not need ``R`` to be invertible.

    What is rank-b and what is not. Because the regulariser of (2.5) does not decay,
    ``R_{K+1} - alpha R_K = Z^T Z + (1 - alpha) ridge I`` is full rank whenever
    ``alpha < 1`` and ``ridge > 0``; only for ``alpha = 1`` (or ``ridge = 0``) is it the
    rank-``b`` term ``Z^T Z``. Hence:

    * ``alpha = 1`` or ``ridge = 0`` (rank-b): the inverse ``P_K = R_K^{-1}`` is kept and
      updated by the Woodbury identity, with ``P' = P_K / alpha``,
      ``P_{K+1} = P' - P' Z^T (I_b + Z P' Z^T)^{-1} Z P'``: one ``b x b`` Cholesky and
      ``O(b m^2 + b^2 m)`` flops per batch (the RLS filter the paper cites).
    * ``alpha < 1`` and ``ridge > 0`` (full rank): the information matrix ``R_{K+1}`` is
      factored afresh (Cholesky, ``O(m^3 / 3)`` per batch). Woodbury would need the
      inverse of ``alpha R_K + (1 - alpha) ridge I``, itself an ``O(m^3)`` problem.

    ``P_K`` is an explicit inverse by design: it is the state of covariance-form RLS.
    ``R_K`` itself is accumulated in both cases (``O(b m^2)``), for :attr:`information`
    and :func:`recursion_weights`.

    Singular and near-singular ``R_K``. ``R_K >= ridge I``, so ``R_K`` is numerically
    definite when ``ridge`` is not tiny next to ``trace R_K``. With ``ridge = 0``, or a
    ridge below the rounding level of ``sum_i alpha^{K-i} Z_i^T Z_i`` (e.g. ``1e-300``),
    ``R_K`` is (numerically) singular until the rows seen span all prototypes: the
    solution is then not determined in float64 (the ridge term that makes it unique is
    rounded away, and a Cholesky factor or the Woodbury inverse ``1 / ridge`` would be
    garbage). The estimator then keeps ``Q_K`` and :attr:`prototypes` raises a
    ``ValueError`` saying so; once ``R_K`` is numerically definite, ``V = R_K^{-1} Q_K``
    is solved and the recursion resumes. A batch whose ``Z^T Z`` overflows raises a
    ``ValueError`` and leaves the estimator unchanged.

    Accuracy: the V update is in innovation form, whose error propagates through
    ``R_{K+1}^{-1} alpha R_K`` (a contraction), so rounding errors do not accumulate;
    the Woodbury step subtracts a Gram matrix ``X^T X`` (``X = L^{-1} Z P'``, ``L`` the
    Cholesky factor of ``I_b + Z P' Z^T``), which keeps ``P_K`` exactly symmetric.
    ``tests/test_prototypes.py`` reports the drift against the batch solution after
    2000 updates (about 1e-15 relative, both branches).

    Parameters
    ----------
    n_prototypes : int
        ``m``.
    dim : int
        ``d``, the embedding dimension.
    alpha : float in (0, 1]
        Forgetting factor.
    ridge : float >= 0
        Ridge weight, not decayed: the paper's beta of XML Eq. (2.5) (the ϵ of Eq. 2.8).
    """

    def __init__(self, n_prototypes: int, dim: int, *, alpha: float, ridge: float):
        self.n_prototypes = check_scalar(n_prototypes, "n_prototypes", low=1, integer=True)
        self.dim = check_scalar(dim, "dim", low=1, integer=True)
        self.alpha = check_scalar(alpha, "alpha", low=0.0, high=1.0, low_inclusive=False)
        self.ridge = check_scalar(ridge, "ridge", low=0.0)
        m = self.n_prototypes
        self.n_updates = 0
        # R_{K+1} - alpha R_K = Z^T Z + (1 - alpha) ridge I is rank-b only when this holds.
        self._rank_b = (1.0 - self.alpha) * self.ridge == 0.0
        self._information = self.ridge * np.eye(m)
        self._inverse = None
        self._V = None
        self._moment = np.zeros((m, self.dim))  # Q_K, kept while R_K is not definite
        if self.ridge > 0:
            self._start()

    @property
    def prototypes(self) -> np.ndarray:
        """``V^{(K)}``, shape ``(n_prototypes, dim)`` (a copy)."""
        if self._V is None:
            raise ValueError(
                f"R_K is singular after {self.n_updates} updates (ridge == {self.ridge!r} and "
                "the rows seen so far do not span all prototypes, numerically): Eq. (2.6) has "
                "no unique solution in float64 yet"
            )
        return self._V.copy()

    @property
    def information(self) -> np.ndarray:
        """``R_K = sum_i alpha^{K-i} Z_i^T Z_i + ridge I``, shape ``(m, m)`` (a copy)."""
        return self._information.copy()

    def update(self, Z, Y) -> RecursivePrototypes:
        """Absorb one batch: ``Z`` (b, n_prototypes), ``Y`` (b, dim). Returns ``self``."""
        Z = as_float_array(Z, "Z", ndim=2)
        Y = as_float_array(Y, "Y", ndim=2)
        check_same_length(Z, "Z", Y, "Y")
        if Z.shape[1] != self.n_prototypes:
            raise ValueError(f"Z has {Z.shape[1]} columns, expected n_prototypes={self.n_prototypes}")
        if Y.shape[1] != self.dim:
            raise ValueError(f"Y has {Y.shape[1]} columns, expected dim={self.dim}")
        self._update(Z, Y)
        return self

    def _start(self) -> None:
        """Solve ``V = R_K^{-1} Q_K`` if ``R_K`` is numerically definite, else defer."""
        if not numerically_definite(self._information, self.ridge):
            return
        factor = cho_factor(self._information, lower=True)
        self._V = cho_solve(factor, self._moment)
        self._moment = None
        if self._rank_b:
            inverse = cho_solve(factor, np.eye(self.n_prototypes))
            self._inverse = 0.5 * (inverse + inverse.T)

    def _update(self, Z: np.ndarray, Y: np.ndarray) -> None:
        alpha, m = self.alpha, self.n_prototypes
        shrink = (1.0 - alpha) * self.ridge
        # numpy evaluates Z.T @ Z as a symmetric rank-k product, so R_K stays exactly
        # symmetric without a symmetrisation pass.
        with np.errstate(over="ignore", invalid="ignore"):
            gram = Z.T @ Z
            cross = Z.T @ Y
        if not (np.all(np.isfinite(gram)) and np.all(np.isfinite(cross))):
            raise ValueError(_overflow_message("Z", Z))
        information = alpha * self._information + gram
        information[np.diag_indices(m)] += shrink
        if not np.all(np.isfinite(information)):
            raise ValueError(_overflow_message("Z", Z))
        previous = self._information
        self._information = information
        self.n_updates += 1

        if self._V is not None and not numerically_definite(information, self.ridge):
            # R_{K+1} lost its ridge to rounding: keep Q_{K+1} = alpha R_K V_K + Z^T Y.
            self._moment = alpha * (previous @ self._V) + cross
            self._V = self._inverse = None
            return
        if self._V is None:
            self._moment = alpha * self._moment + cross
            self._start()
            return

        innovation = cross - gram @ self._V
        if self._rank_b:
            # P_{K+1} = P' - X^T X with P' = P_K / alpha, X = L^{-1} Z P' and
            # L L^T = I_b + Z P' Z^T: the subtracted term is a Gram matrix, so P stays
            # symmetric without a separate symmetrisation pass.
            # When P' is far larger than P_{K+1} (a tiny ridge: P_0 = I / ridge), the
            # subtraction cancels the digits of P_{K+1}; then P_{K+1} is refactored from
            # R_{K+1} (which is numerically definite here) instead.
            inverse = self._inverse / alpha if alpha != 1.0 else self._inverse
            fresh = None
            if np.all(np.isfinite(inverse)):
                ZP = Z @ inverse
                L = cholesky(np.eye(Z.shape[0]) + ZP @ Z.T, lower=True)
                X = solve_triangular(L, ZP, lower=True)
                fresh = inverse - X.T @ X
                lost = np.max(np.diag(inverse)) / np.max(np.diag(fresh))
                if not np.isfinite(lost) or lost > _WOODBURY_LOSS:
                    fresh = None
            if fresh is None:
                fresh = cho_solve(cho_factor(information, lower=True), np.eye(m))
                fresh = 0.5 * (fresh + fresh.T)
            self._inverse = fresh
            self._V += self._inverse @ innovation
        else:
            factor = cho_factor(information, lower=True)
            self._V += cho_solve(factor, innovation - shrink * self._V)


def recursion_weights(R_K, Z, *, alpha, ridge, printed: bool = False) -> np.ndarray:
    r"""The weight matrix ``W_K`` of XML Eq. (2.7), shape ``(m, m)``.

    ``V^{(K+1)} = W_K V^{(K)} + (I - W_K) V_batch`` with ``V_batch = R^{-1} Z^T Y`` and
    ``R = Z^T Z + (1 - alpha) ridge I``.

    Derived (``printed=False``): ``W_K = (alpha R_K + R)^{-1} alpha R_K
    = alpha R^{-1} (R_K^{-1} + alpha R^{-1})^{-1}``.

    Printed (``printed=True``): ``W_K = R^{-1} (R_K^{-1} + alpha R^{-1})^{-1}``, which
    equals ``(alpha R_K + R)^{-1} R_K`` (``docs/prototypes.md``) and is computed in
    that form (so it is defined even where ``R`` is singular). It lacks the factor
    ``alpha`` and is right only for ``alpha = 1``.

    Parameters
    ----------
    R_K : array (m, m)
        Symmetric positive definite information matrix after ``K`` batches
        (:attr:`RecursivePrototypes.information`).
    Z : array (b, m)
        The new batch of histograms.
    alpha, ridge : float
        As in :class:`RecursivePrototypes` (``ridge`` is the paper's beta of Eq. 2.5).
    printed : bool
        Return the paper's printed ``W_K`` instead of the derived one.
    """
    R_K = as_float_array(R_K, "R_K", ndim=2)
    Z = as_float_array(Z, "Z", ndim=2)
    m = Z.shape[1]
    if R_K.shape != (m, m):
        raise ValueError(f"R_K has shape {R_K.shape}, expected ({m}, {m}) for Z of shape {Z.shape}")
    alpha = check_scalar(alpha, "alpha", low=0.0, high=1.0, low_inclusive=False)
    ridge = check_scalar(ridge, "ridge", low=0.0)
    with np.errstate(over="ignore", invalid="ignore"):
        next_information = alpha * R_K + Z.T @ Z + (1.0 - alpha) * ridge * np.eye(m)
    if not np.all(np.isfinite(next_information)):
        raise ValueError("alpha R_K + Z^T Z + (1 - alpha) ridge I overflows float64")
    if not numerically_definite(next_information, 0.0):
        raise ValueError(
            "alpha R_K + Z^T Z + (1 - alpha) ridge I is not (numerically) positive definite, "
            "so W_K is not determined in float64"
        )
    factor = cho_factor(next_information, lower=True)
    return cho_solve(factor, R_K if printed else alpha * R_K)
