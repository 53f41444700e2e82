"""The RLS recursion of XML Eqs. (2.5)-(2.7) and its weights ``W_K``."""

from __future__ import annotations

import math
import sys

import numpy as np
from scipy.linalg import (LinAlgError, cho_factor, cho_solve, cholesky, eigvalsh,
                          solve_triangular)

from refdml._validation import as_float_array, check_same_length, check_scalar
from refdml.prototypes._ridge import _DEFINITE, numerically_definite

__all__ = ["RecursivePrototypes", "recursion_weights"]

# The most entries of one float64 array (its bytes must fit in a signed 64-bit size).
_MAX_ENTRIES = sys.maxsize // 8
# A Woodbury step that shrinks P_K by more than this factor in some direction has
# cancelled that many digits there (about 4); P_{K+1} is then refactored from R_{K+1}.
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
      ``P_{K+1} = P' - P' Z^T (I_b + Z P' Z^T)^{-1} Z P'``: one ``b x b`` Cholesky, the
      largest eigenvalue of that ``b x b`` matrix and ``O(b m^2 + b^2 m)`` flops per batch
      (the RLS filter the paper cites), except where a step below refactors ``R_{K+1}``.
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
    is solved and the recursion resumes. A Cholesky factorisation that fails in float64
    although ``R_K`` passed that test is treated the same way (never SciPy's
    ``LinAlgError``). A batch whose ``Z^T Z`` overflows, whose ``R_{K+1}`` would lie
    entirely below float64's normal range (largest entry under ``2.2e-308``, e.g. ``Z``
    near ``1e-160`` with a subnormal ridge: rounding would swamp it), or whose
    prototypes overflow, raises a ``ValueError`` and leaves the estimator unchanged.

    Accuracy: the V update is in innovation form, whose error propagates through
    ``R_{K+1}^{-1} alpha R_K`` (a contraction), so rounding errors do not accumulate;
    the Woodbury step subtracts a Gram matrix ``X^T X`` (``X = L^{-1} Z P'``, ``L`` the
    Cholesky factor of ``I_b + Z P' Z^T``), which keeps ``P_K`` exactly symmetric.
    ``tests/operators/test_prototypes.py`` reports the drift against the batch solution after
    2000 updates (about 1e-15 relative, both branches). Three cases leave this path:

    * The Woodbury step is skipped for a refactorisation of ``R_{K+1}`` where it cannot be
      trusted: ``P'`` not finite (``P_0 = I / ridge`` for a subnormal ridge),
      ``I_b + Z P' Z^T`` not finite or not definite in float64 (``b > m`` rows after a tiny
      ridge: the ``I_b`` is rounded away next to ``Z P' Z^T``), or more than 4 digits of
      ``P_{K+1}`` cancelled in some direction (below). ``P_{K+1}`` itself is dropped where
      it exceeds float64; the update then solves with the factor of ``R_{K+1}``.

      The digits that the subtraction ``P' - X^T X`` cancels: its rounding error is about
      ``eps ||P'||`` in every entry, while in a direction ``u`` the result is only
      ``u^T P_{K+1} u``. The loss is ``max_u (u^T P' u) / (u^T P_{K+1} u)``, the largest
      eigenvalue of ``R_{K+1} P' = I_m + Z^T Z P'`` (``R_{K+1} = alpha R_K + Z^T Z`` on this
      branch), which is that of the ``b x b`` matrix ``I_b + Z P' Z^T`` already formed.
      It is not the shrinkage of ``P``'s largest entry: from ``P_0 = I / ridge`` a batch
      that determines all prototypes cancels about ``log10(||R_1|| / ridge)`` digits in the
      direction where ``P_1`` is smallest, and ``V_1 = P_1 Z^T Y`` inherits them. The
      Woodbury step is used while that eigenvalue is at most ``1e4``; in steady state it
      stays near ``1`` (``Z P_K Z^T`` is the leverage of a new batch next to ``K`` old ones),
      so the rank-b branch refactors only on the first batches or on a change of scale.
    * The innovation step adds ``R_{K+1}^{-1}(...)`` to ``V_K`` with an error of about
      ``eps |V_K|``: where the prototypes shrink by more than 4 orders of magnitude in one
      step (a batch of a far larger scale than those before), or the step overflows,
      ``V_{K+1}`` is solved from ``R_{K+1} V = alpha R_K V_K + Z^T Y`` instead, whose
      error is that of a batch solve.
    * Which of those two forms: the innovation form subtracts ``(Z^T Z + (1 - alpha) ridge
      I) V_K``, the batch form adds ``alpha R_K V_K``; the rounding error of that product,
      times ``R_{K+1}^{-1}``, is the error of ``V_{K+1}`` (about ``eps ||R_{K+1}^{-1}||
      ||M|| |V_K|`` for the matrix ``M`` applied). The innovation form is taken while the
      past outweighs the batch, ``trace(Z^T Z + (1 - alpha) ridge I) <= alpha trace R_K``,
      which holds in steady state unless ``alpha`` is near or below ``1/2`` (the past
      weighs about ``alpha / (1 - alpha)`` batches), and there the innovation form's
      tolerance of errors in ``P_K`` matters; a batch that outweighs the past takes the
      batch form, solved with the factor of ``R_{K+1}``. On the rank-b branch that costs
      a Cholesky of ``R_{K+1}`` on such batches: the first ones, a change of scale, and
      every batch where ``alpha < 1/2`` with ``ridge = 0``. With a batch of ``2^7`` to
      ``2^13`` times the scale of those before, the innovation form lost 3 to 4 digits
      more than a solve.

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
        # R_K is (m, m) and V (m, d): sizes beyond what one array can hold are refused.
        self.n_prototypes = check_scalar(n_prototypes, "n_prototypes", low=1,
                                         high=math.isqrt(_MAX_ENTRIES), integer=True)
        self.dim = check_scalar(dim, "dim", low=1, high=_MAX_ENTRIES // self.n_prototypes,
                                integer=True)
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
            self._V, self._inverse = self._solve(self._information, self._moment)
            if self._V is not None:
                self._moment = None

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

    def _solve(self, information: np.ndarray, moment: np.ndarray):
        """``(V, P)`` with ``V = R^{-1} Q`` and ``P = R^{-1}`` (rank-b branch only; None where
        ``R^{-1}`` exceeds float64), or ``(None, None)`` while ``R`` is not numerically definite."""
        if not numerically_definite(information, self.ridge):
            return None, None
        factor = _factor(information)
        if factor is None:
            return None, None
        V = _checked(lambda: cho_solve(factor, moment))
        return V, (_inverse(factor) if self._rank_b else None)

    def _update(self, Z: np.ndarray, Y: np.ndarray) -> None:
        """One batch; the state changes only once everything is computed (a ValueError
        leaves the estimator as it was)."""
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
        largest = float(np.abs(information).max())
        if 0.0 < largest < _TINY:
            raise ValueError(
                f"R_K = sum_i alpha^(K-i) Z_i^T Z_i + ridge I would lie below float64's normal "
                f"range (largest entry {largest:.3g} < {_TINY:.3g}), where rounding swamps it "
                f"(max |Z| == {np.abs(Z).max():.3g}, ridge == {self.ridge!r}): rescale the "
                "histograms (Z -> t Z with ridge -> t^2 ridge gives V / t)"
            )
        previous = self._information
        V, inverse, moment = self._V, self._inverse, self._moment

        if V is None:
            moment = _checked(lambda: alpha * moment + cross)
            V, inverse = self._solve(information, moment)
            if V is not None:
                moment = None
        else:
            factor = None
            definite = numerically_definite(information, self.ridge)
            if definite and self._rank_b:
                scaled = inverse if alpha == 1.0 or inverse is None else _checked_or_none(
                    lambda: inverse / alpha)
                inverse = _woodbury(scaled, Z)
            if definite and inverse is None:
                factor = _factor(information)
                if factor is not None and self._rank_b:
                    # Woodbury cancelled or could not run: P_{K+1} from the factor of
                    # R_{K+1} (numerically definite here), if float64 holds it.
                    inverse = _inverse(factor)
            V_next = None
            if definite and (inverse is not None or factor is not None):
                if _past_outweighs(previous, alpha, gram, shrink):
                    V_next = _innovation_step(V, gram, cross, shrink, inverse, factor)
                if V_next is None:
                    # The batch outweighs the past, or the step overflowed, or cancelled the
                    # digits of V_{K+1} (V shrinks by orders of magnitude when a batch of
                    # another scale arrives): solve R_{K+1} V = alpha R_K V_K + Z^T Y
                    # instead, as accurate as a batch solve.
                    factor = factor if factor is not None else _factor(information)
                    if factor is not None:
                        moment_next = _checked(lambda: alpha * (previous @ V) + cross)
                        V_next = _checked(lambda: cho_solve(factor, moment_next))
            if V_next is None:
                # R_{K+1} lost its ridge to rounding: keep Q_{K+1} = alpha R_K V_K + Z^T Y.
                moment = _checked(lambda: alpha * (previous @ V) + cross)
                inverse = None
            V = V_next

        self._information = information
        self.n_updates += 1
        self._V, self._inverse, self._moment = V, inverse, moment


# The smallest normal float64: an information matrix below it is all rounding.
_TINY = float(np.finfo(np.float64).tiny)


_UPDATE_OVERFLOW = (
    "the RLS update overflows float64 (the prototypes R_K^{-1} Q_K, or a term of their "
    "update, exceed 1.8e308): rescale the histograms Z or the embeddings Y"
)


def _checked(compute, message: str = _UPDATE_OVERFLOW):
    """``compute()`` without floating-point warnings; ``ValueError(message)`` if not finite."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = compute()
    if not np.all(np.isfinite(result)):
        raise ValueError(message)
    return result


def _innovation_step(V, gram, cross, shrink, inverse, factor):
    """``V + R_{K+1}^{-1} (Z^T (Y - Z V) - shrink V)`` (by ``P_{K+1}`` when known, else by
    the factor of ``R_{K+1}``), or None where it overflows or loses more than
    ``_WOODBURY_LOSS`` of the digits of a column of ``V_{K+1}`` (the step nearly cancels
    ``V_K``: its rounding error, ``eps |V_K|``, would dominate the result)."""
    innovation = _checked_or_none(lambda: cross - gram @ V - shrink * V)
    if innovation is None:
        return None
    if inverse is not None:
        step = _checked_or_none(lambda: inverse @ innovation)
    else:
        step = _checked_or_none(lambda: cho_solve(factor, innovation))
    V_next = None if step is None else _checked_or_none(lambda: V + step)
    if V_next is None:
        return None
    before, after = np.abs(V).max(axis=0), np.abs(V_next).max(axis=0)
    if np.any(before > _WOODBURY_LOSS * after):
        return None
    return V_next


def _past_outweighs(previous, alpha, gram, shrink) -> bool:
    """Whether ``trace(Z^T Z + shrink I) <= trace(alpha R_K)``: the innovation form, whose
    error is that of ``(Z^T Z + shrink I) V_K``, is then the more accurate of the two."""
    with np.errstate(over="ignore", invalid="ignore"):
        new = float(np.trace(gram)) + gram.shape[0] * shrink
        past = alpha * float(np.trace(previous))
    return bool(new <= past)  # an overflow (inf or nan) takes the batch form


def _checked_or_none(compute):
    """``compute()``, or None where it is not finite."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        result = compute()
    return result if np.all(np.isfinite(result)) else None


def _factor(matrix: np.ndarray):
    """Cholesky factor of a symmetric matrix, or None where it fails in float64."""
    try:
        return cho_factor(matrix, lower=True)
    except LinAlgError:
        return None


def _inverse(factor) -> np.ndarray | None:
    """The symmetric ``R^{-1}`` from the factor of ``R``, or None where it exceeds float64."""
    inverse = _checked_or_none(lambda: cho_solve(factor, np.eye(factor[0].shape[0])))
    return None if inverse is None else 0.5 * (inverse + inverse.T)


def _woodbury(inverse: np.ndarray | None, Z: np.ndarray) -> np.ndarray | None:
    """``P_{K+1} = P' - X^T X`` from ``P' = P_K / alpha``, or None where it cannot be trusted.

    ``X = L^{-1} Z P'`` and ``L L^T = I_b + Z P' Z^T``: the subtracted term is a Gram
    matrix, so P stays symmetric without a separate symmetrisation pass. None (the
    caller refactors ``R_{K+1}``) where ``P'`` is unknown or not finite, where
    ``I_b + Z P' Z^T`` overflows or is not definite in float64 (``Z P' Z^T`` of rank
    ``m < b`` with entries so large that the ``I_b`` is rounded away, e.g. after a tiny
    ridge: ``P_0 = I / ridge``), and where the subtraction cancels more than
    ``_WOODBURY_LOSS`` of the digits of ``P_{K+1}`` in some direction: the largest
    eigenvalue of ``I_b + Z P' Z^T`` (that of ``R_{K+1} P'``, the largest ratio
    ``u^T P' u / u^T P_{K+1} u``) exceeds it.
    """
    if inverse is None:
        return None
    ZP = _checked_or_none(lambda: Z @ inverse)
    inner = None if ZP is None else _checked_or_none(lambda: np.eye(Z.shape[0]) + ZP @ Z.T)
    if inner is None:
        return None
    try:
        L = cholesky(inner, lower=True)
        # Not the diagonal of P' over that of P_{K+1}: from P_0 = 1e6 I, V_1 lost 6 digits
        # where the largest diagonal entry shrank only 5e3-fold.
        cancelled = float(eigvalsh(inner, subset_by_index=[inner.shape[0] - 1] * 2)[0])
    except LinAlgError:
        return None
    if not cancelled <= _WOODBURY_LOSS:
        return None
    X = solve_triangular(L, ZP, lower=True)
    fresh = _checked_or_none(lambda: inverse - X.T @ X)
    if fresh is None or not np.all(np.diag(fresh) > 0.0):
        return None
    return fresh


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
    # Only the lower triangle would be read below: a non-symmetric R_K would give a W_K
    # of some other matrix. Symmetric to rounding (the level numerically_definite uses).
    with np.errstate(over="ignore", invalid="ignore"):
        asymmetry = float(np.abs(R_K - R_K.T).max())
    if not asymmetry <= _DEFINITE * m * np.finfo(np.float64).eps * float(np.abs(R_K).max()):
        raise ValueError(
            f"R_K must be symmetric (an information matrix), got |R_K - R_K^T| up to "
            f"{asymmetry:.3g} with max |R_K| == {np.abs(R_K).max():.3g}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        next_information = alpha * R_K + Z.T @ Z + (1.0 - alpha) * ridge * np.eye(m)
    if not np.all(np.isfinite(next_information)):
        raise ValueError("alpha R_K + Z^T Z + (1 - alpha) ridge I overflows float64")
    if not numerically_definite(next_information, 0.0):
        raise ValueError(
            "alpha R_K + Z^T Z + (1 - alpha) ridge I is not (numerically) positive definite, "
            "so W_K is not determined in float64"
        )
    factor = _factor(next_information)
    if factor is None:
        raise ValueError(
            "alpha R_K + Z^T Z + (1 - alpha) ridge I is not (numerically) positive definite "
            "(its Cholesky factorisation fails in float64), so W_K is not determined in float64"
        )
    return _checked(lambda: cho_solve(factor, R_K if printed else alpha * R_K),
                    "W_K overflows float64 (R_K too large next to alpha R_K + Z^T Z + "
                    "(1 - alpha) ridge I): rescale R_K and Z")
