"""Closed-form prototype fits of XML Sec. 2.2-2.3: ridge, the RLS recursion, Eq. (2.9).

Arrays are batch-first: histograms ``Z`` of shape ``(b, m)`` (one row per sample, ``m``
prototypes), embeddings ``Y`` of shape ``(b, d)``, prototypes ``V`` of shape ``(m, d)``
and predictions ``Z V``. The paper writes the transposes (its ``Z`` is ``m x b``, its
``Y`` is ``d x b`` and its objective ``||A Z - Y||`` has ``A`` of shape ``d x m``), but
its solutions (2.6), ``V = R^{-1} Q``, are already ``m x d``; the mapping is
``Z_paper = Z.T``, ``Y_paper = Y.T``, ``A = V.T``.

``ridge_fit``: ``V = argmin_V ||Z V - Y||_F^2 + eps ||V||_F^2`` (XML Eq. 2.8)
    Primal form: ``(Z^T Z + eps I_m) V = Z^T Y`` (an ``m x m`` system). Kernel form
    (push-through identity): ``V = Z^T (Z Z^T + eps I_b)^{-1} Y`` (a ``b x b`` system).
    ``form="auto"`` solves the smaller system. Both use a Cholesky factorisation.

``RecursivePrototypes``: the RLS estimator of XML Eqs. (2.5)-(2.7).

``recursion_weights``: the ``W_K`` of Eq. (2.7), derived and as printed.

``two_batch_decomposition``: Eq. (2.9), derived and as printed.

Derivations are in ``docs/prototypes.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import LinAlgError, cho_factor, cho_solve, cholesky, solve_triangular

from refdml._validation import (
    as_float_array,
    check_choice,
    check_same_length,
    check_scalar,
)
from refdml.gradcheck.registry import OperatorSpec, register

__all__ = [
    "RecursivePrototypes",
    "RidgeContext",
    "RidgeGrads",
    "TwoBatchDecomposition",
    "recursion_weights",
    "ridge_fit",
    "ridge_fit_backward",
    "ridge_fit_forward",
    "two_batch_decomposition",
]

_FORMS = ("auto", "primal", "kernel")


@dataclass(frozen=True)
class RidgeGrads:
    Z: np.ndarray
    Y: np.ndarray


@dataclass(frozen=True)
class RidgeContext:
    Z: np.ndarray
    Y: np.ndarray
    V: np.ndarray
    form: str                # "primal" or "kernel", never "auto"
    factor: tuple            # cho_factor of Z^T Z + eps I (primal) or Z Z^T + eps I (kernel)
    kernel_solution: np.ndarray | None  # (Z Z^T + eps I)^{-1} Y, kernel form only


def _check_fit_inputs(Z, Y, eps) -> tuple[np.ndarray, np.ndarray, float]:
    Z = as_float_array(Z, "Z", ndim=2)
    Y = as_float_array(Y, "Y", ndim=2)
    check_same_length(Z, "Z", Y, "Y")
    eps = check_scalar(eps, "eps", low=0.0, low_inclusive=False)
    return Z, Y, eps


def _resolve_form(form: str, n_samples: int, n_prototypes: int) -> str:
    if form == "auto":
        # Both systems cost a Cholesky of their size; the Gram products cost b m min(b, m).
        return "primal" if n_prototypes <= n_samples else "kernel"
    return form


def _ridge_forward(Z: np.ndarray, Y: np.ndarray, eps: float, form: str):
    b, m = Z.shape
    form = _resolve_form(form, b, m)
    if form == "primal":
        factor = cho_factor(Z.T @ Z + eps * np.eye(m), lower=True)
        V = cho_solve(factor, Z.T @ Y)
        kernel_solution = None
    else:
        factor = cho_factor(Z @ Z.T + eps * np.eye(b), lower=True)
        kernel_solution = cho_solve(factor, Y)
        V = Z.T @ kernel_solution
    return V, RidgeContext(Z=Z, Y=Y, V=V, form=form, factor=factor,
                           kernel_solution=kernel_solution)


def _ridge_backward(ctx: RidgeContext, d_V: np.ndarray) -> RidgeGrads:
    Z, Y, V = ctx.Z, ctx.Y, ctx.V
    if ctx.form == "primal":
        # S = M^{-1} G with M = Z^T Z + eps I: dY = Z S, dZ = (Y - Z V) S^T - Z S V^T.
        S = cho_solve(ctx.factor, d_V)
        return RidgeGrads(Z=(Y - Z @ V) @ S.T - Z @ (S @ V.T), Y=Z @ S)
    # Kernel form, V = Z^T U with U = K^{-1} Y, K = Z Z^T + eps I; T = K^{-1} Z G (= Z S
    # by push-through): dY = T, dZ = U G^T - (T U^T + U T^T) Z. No cancellation for
    # small eps, unlike rewriting M^{-1} through Woodbury.
    U = ctx.kernel_solution
    T = cho_solve(ctx.factor, Z @ d_V)
    d_Z = U @ d_V.T - T @ (U.T @ Z) - U @ (T.T @ Z)
    return RidgeGrads(Z=d_Z, Y=T)


def ridge_fit_forward(Z, Y, *, eps, form: str = "auto") -> tuple[np.ndarray, RidgeContext]:
    """Ridge prototypes ``V = argmin ||Z V - Y||_F^2 + eps ||V||_F^2``; returns ``(V, ctx)``.

    See :func:`ridge_fit` for the parameters.
    """
    Z, Y, eps = _check_fit_inputs(Z, Y, eps)
    check_choice(form, "form", _FORMS)
    return _ridge_forward(Z, Y, eps, form)


def ridge_fit_backward(ctx: RidgeContext, d_V) -> RidgeGrads:
    """Gradients ``.Z`` (b, m) and ``.Y`` (b, d) of ``<d_V, V>``.

    With ``M = Z^T Z + eps I`` and ``S = M^{-1} d_V``:
    ``dL/dY = Z S`` and ``dL/dZ = (Y - Z V) S^T - Z S V^T`` (``docs/prototypes.md``).
    """
    return _ridge_backward(ctx, np.asarray(d_V, dtype=np.float64))


def ridge_fit(Z, Y, *, eps, form: str = "auto") -> np.ndarray:
    r"""Ridge regression of embeddings on histograms (XML Eq. 2.8, GSP (P3)).

    .. math::

        V = \arg\min_V \|Z V - Y\|_F^2 + \varepsilon \|V\|_F^2
          = (Z^\top Z + \varepsilon I_m)^{-1} Z^\top Y
          = Z^\top (Z Z^\top + \varepsilon I_b)^{-1} Y

    Parameters
    ----------
    Z : array (b, m)
        Histograms, one row per sample (the paper's ``Z`` transposed).
    Y : array (b, d)
        Targets (embeddings), one row per sample.
    eps : float > 0
        Ridge weight.
    form : {"auto", "primal", "kernel"}
        ``"primal"`` factors the ``m x m`` matrix, ``"kernel"`` the ``b x b`` one
        (the paper's "if the batch size is less than the number of prototypes");
        ``"auto"`` picks the smaller. Same answer up to rounding.

    Returns
    -------
    V : array (m, d)
        Prototypes (the transpose of the paper's ``A``).
    """
    return ridge_fit_forward(Z, Y, eps=eps, form=form)[0]


# --------------------------------------------------------------------------- RLS (2.5)-(2.7)


def _cholesky_or_none(matrix: np.ndarray):
    try:
        return cho_factor(matrix, lower=True)
    except LinAlgError:
        return None


def _numerically_definite(matrix: np.ndarray) -> bool:
    # A Cholesky factorisation succeeds on many matrices that are singular in exact
    # arithmetic (rounding makes the last pivot a tiny positive number), so the
    # warm-up with beta = 0 tests the spectrum instead.
    eigenvalues = np.linalg.eigvalsh(matrix)
    return bool(eigenvalues[0] > 1e3 * matrix.shape[0] * np.finfo(np.float64).eps * eigenvalues[-1])


class RecursivePrototypes:
    r"""Recursive least squares for the prototypes of XML Eqs. (2.5)-(2.7).

    After ``K`` calls of :meth:`update`, :attr:`prototypes` equals the batch solution

    .. math::

        V^{(K)} = \arg\min_V \sum_{i=1}^K \alpha^{K-i} \|Z_i V - Y_i\|_F^2 + \beta \|V\|_F^2
                = R_K^{-1} Q_K,

    ``R_K = sum_i alpha^{K-i} Z_i^T Z_i + beta I``, ``Q_K = sum_i alpha^{K-i} Z_i^T Y_i``.

    The recursion. ``R_{K+1} = alpha R_K + R`` with ``R = Z^T Z + (1 - alpha) beta I``
    (the paper prints "``R^{-1} = Z Z^T + (1-alpha) beta I``", a typo for ``R``), and

    ``V^{(K+1)} = V^{(K)} + R_{K+1}^{-1} (Z^T (Y - Z V^{(K)}) - (1 - alpha) beta V^{(K)})``,

    which is Eq. (2.7) rewritten: ``W_K V^{(K)} + (I - W_K) V_batch`` with the derived
    ``W_K = R_{K+1}^{-1} alpha R_K`` (see :func:`recursion_weights`) and
    ``V_batch = R^{-1} Z^T Y``; unlike (2.7) it does not need ``R`` to be invertible.

    What is rank-b and what is not. Because the regulariser ``beta`` of (2.5) does not
    decay, ``R_{K+1} - alpha R_K = Z^T Z + (1 - alpha) beta I`` is full rank whenever
    ``alpha < 1`` and ``beta > 0``; only for ``alpha = 1`` (or ``beta = 0``) is it the
    rank-``b`` term ``Z^T Z``. Hence:

    * ``alpha = 1`` or ``beta = 0`` (rank-b): the inverse ``P_K = R_K^{-1}`` is kept and
      updated by the Woodbury identity, with ``P' = P_K / alpha``,
      ``P_{K+1} = P' - P' Z^T (I_b + Z P' Z^T)^{-1} Z P'``: one ``b x b`` Cholesky and
      ``O(b m^2 + b^2 m)`` flops per batch (the RLS filter the paper cites).
    * ``alpha < 1`` and ``beta > 0`` (full rank): the information matrix ``R_{K+1}`` is
      factored afresh (Cholesky, ``O(m^3 / 3)`` per batch). Woodbury would need the
      inverse of ``alpha R_K + (1 - alpha) beta I``, itself an ``O(m^3)`` problem.

    ``P_K`` is an explicit inverse by design: it is the state of covariance-form RLS.
    ``R_K`` itself is accumulated in both cases (``O(b m^2)``), for :attr:`information`
    and :func:`recursion_weights`. With ``beta = 0`` the solution does not exist until
    ``R_K`` is positive definite; until then ``Q_K`` is accumulated and
    :attr:`prototypes` raises ``ValueError``.

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
    beta : float >= 0
        Ridge weight (not decayed).
    """

    def __init__(self, n_prototypes: int, dim: int, *, alpha: float, beta: float):
        self.n_prototypes = check_scalar(n_prototypes, "n_prototypes", low=1, integer=True)
        self.dim = check_scalar(dim, "dim", low=1, integer=True)
        self.alpha = check_scalar(alpha, "alpha", low=0.0, high=1.0, low_inclusive=False)
        self.beta = check_scalar(beta, "beta", low=0.0)
        m = self.n_prototypes
        self.n_updates = 0
        # R_{K+1} - alpha R_K = Z^T Z + (1 - alpha) beta I is rank-b only when this holds.
        self._rank_b = (1.0 - self.alpha) * self.beta == 0.0
        self._information = self.beta * np.eye(m)
        if self.beta > 0:
            self._inverse = np.eye(m) / self.beta if self._rank_b else None
            self._V = np.zeros((m, self.dim))
            self._moment = None
        else:
            self._inverse = None
            self._V = None
            self._moment = np.zeros((m, self.dim))  # Q_K, needed only until R_K is invertible

    @property
    def prototypes(self) -> np.ndarray:
        """``V^{(K)}``, shape ``(n_prototypes, dim)`` (a copy)."""
        if self._V is None:
            raise ValueError(
                f"R_K is singular after {self.n_updates} updates (beta == 0 and the rows seen "
                "so far do not span all prototypes): Eq. (2.6) has no unique solution yet"
            )
        return self._V.copy()

    @property
    def information(self) -> np.ndarray:
        """``R_K = sum_i alpha^{K-i} Z_i^T Z_i + beta I``, shape ``(m, m)`` (a copy)."""
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

    def _update(self, Z: np.ndarray, Y: np.ndarray) -> None:
        alpha, m = self.alpha, self.n_prototypes
        shrink = (1.0 - alpha) * self.beta
        # numpy evaluates Z.T @ Z as a symmetric rank-k product, so R_K stays exactly
        # symmetric without a symmetrisation pass.
        self._information *= alpha
        self._information += Z.T @ Z
        self._information[np.diag_indices(m)] += shrink
        self.n_updates += 1

        if self._V is None:
            self._moment = alpha * self._moment + Z.T @ Y
            if _numerically_definite(self._information):
                factor = cho_factor(self._information, lower=True)
                self._V = cho_solve(factor, self._moment)
                self._moment = None
                if self._rank_b:
                    inverse = cho_solve(factor, np.eye(m))
                    self._inverse = 0.5 * (inverse + inverse.T)
            return

        innovation = Z.T @ (Y - Z @ self._V)
        if self._rank_b:
            # P_{K+1} = P' - X^T X with P' = P_K / alpha, X = L^{-1} Z P' and
            # L L^T = I_b + Z P' Z^T: the subtracted term is a Gram matrix, so P stays
            # symmetric without a separate symmetrisation pass.
            if alpha != 1.0:
                self._inverse /= alpha
            ZP = Z @ self._inverse
            L = cholesky(np.eye(Z.shape[0]) + ZP @ Z.T, lower=True)
            X = solve_triangular(L, ZP, lower=True)
            self._inverse -= X.T @ X
            self._V += self._inverse @ innovation
        else:
            factor = cho_factor(self._information, lower=True)
            self._V += cho_solve(factor, innovation - shrink * self._V)


def recursion_weights(R_K, Z, *, alpha, beta, printed: bool = False) -> np.ndarray:
    r"""The weight matrix ``W_K`` of XML Eq. (2.7), shape ``(m, m)``.

    ``V^{(K+1)} = W_K V^{(K)} + (I - W_K) V_batch`` with ``V_batch = R^{-1} Z^T Y`` and
    ``R = Z^T Z + (1 - alpha) beta I``.

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
    alpha, beta : float
        As in :class:`RecursivePrototypes`.
    printed : bool
        Return the paper's printed ``W_K`` instead of the derived one.
    """
    R_K = as_float_array(R_K, "R_K", ndim=2)
    Z = as_float_array(Z, "Z", ndim=2)
    m = Z.shape[1]
    if R_K.shape != (m, m):
        raise ValueError(f"R_K has shape {R_K.shape}, expected ({m}, {m}) for Z of shape {Z.shape}")
    alpha = check_scalar(alpha, "alpha", low=0.0, high=1.0, low_inclusive=False)
    beta = check_scalar(beta, "beta", low=0.0)
    next_information = alpha * R_K + Z.T @ Z + (1.0 - alpha) * beta * np.eye(m)
    factor = _cholesky_or_none(next_information)
    if factor is None:
        raise ValueError("alpha R_K + Z^T Z + (1 - alpha) beta I is not positive definite")
    return cho_solve(factor, R_K if printed else alpha * R_K)


# --------------------------------------------------------------------------- Eq. (2.9)


@dataclass(frozen=True)
class TwoBatchDecomposition:
    """Eq. (2.9): ``V = W V1 + (I - W) V2``.

    ``V1``, ``V2`` (m, d) are the halves' ridge fits with ``eps / 2``; ``W`` (m, m) is
    the derived or printed weight; ``V`` the combination under that ``W``.
    """

    W: np.ndarray
    V1: np.ndarray
    V2: np.ndarray
    V: np.ndarray


def two_batch_decomposition(Z1, Y1, Z2, Y2, *, eps, printed: bool = False) -> TwoBatchDecomposition:
    r"""XML Eq. (2.9): the ridge fit of a whole batch from the fits of two halves.

    With ``R_k = Z_k^T Z_k + (eps/2) I`` and ``V_k = R_k^{-1} Z_k^T Y_k`` (ridge with
    ``eps / 2``), the ridge fit of the stacked batch with ``eps`` is

    .. math::

        V = W V_1 + (I - W) V_2, \qquad W = (R_1 + R_2)^{-1} R_1
          = R_2^{-1} (R_1^{-1} + R_2^{-1})^{-1}.

    The paper prints ``W = R_2^{-1} (R_1^{-1} + R_1^{-2})^{-1}`` (``R_1^{-2}`` for
    ``R_2^{-1}``); ``printed=True`` returns that matrix, evaluated as
    ``R_2^{-1} (R_1 + I)^{-1} R_1^2``, and the ``V`` it gives (not the ridge fit).

    Parameters
    ----------
    Z1, Z2 : arrays (b1, m), (b2, m)
    Y1, Y2 : arrays (b1, d), (b2, d)
    eps : float > 0
        Ridge weight of the whole batch; each half uses ``eps / 2``.
    printed : bool
        Use the printed ``W`` instead of the derived one.
    """
    Z1, Y1, eps = _check_fit_inputs(Z1, Y1, eps)
    Z2 = as_float_array(Z2, "Z2", ndim=2)
    Y2 = as_float_array(Y2, "Y2", ndim=2)
    check_same_length(Z2, "Z2", Y2, "Y2")
    if Z2.shape[1] != Z1.shape[1] or Y2.shape[1] != Y1.shape[1]:
        raise ValueError(
            f"the halves must have the same columns, got Z1 {Z1.shape}, Y1 {Y1.shape}, "
            f"Z2 {Z2.shape}, Y2 {Y2.shape}"
        )
    m = Z1.shape[1]
    half = 0.5 * eps
    R1 = Z1.T @ Z1 + half * np.eye(m)
    R2 = Z2.T @ Z2 + half * np.eye(m)
    f1 = cho_factor(R1, lower=True)
    f2 = cho_factor(R2, lower=True)
    V1 = cho_solve(f1, Z1.T @ Y1)
    V2 = cho_solve(f2, Z2.T @ Y2)
    if printed:
        shifted = cho_factor(R1 + np.eye(m), lower=True)
        W = cho_solve(f2, cho_solve(shifted, R1 @ R1))
    else:
        W = cho_solve(cho_factor(R1 + R2, lower=True), R1)
    V = W @ V1 + (V2 - W @ V2)
    return TwoBatchDecomposition(W=W, V1=V1, V2=V2, V=V)


# --------------------------------------------------------------------------- registry


def _ridge_inputs(n_samples: int, n_prototypes: int):
    def make(rng: np.random.Generator) -> dict:
        Z = rng.dirichlet(np.ones(n_prototypes), size=n_samples)
        Y = rng.standard_normal((n_samples, 3))
        return {"Z": Z, "Y": Y, "eps": 0.3}
    return make


def _ridge_pair(form: str):
    def forward(Z, Y, eps):
        return ridge_fit_forward(Z, Y, eps=eps, form=form)
    return forward


register(OperatorSpec(
    name="prototypes.ridge_fit_primal",
    forward=_ridge_pair("primal"),
    backward=ridge_fit_backward,
    make_inputs=_ridge_inputs(7, 4),
    paper="XML Eq. (2.8), primal form V = (Z^T Z + eps I)^{-1} Z^T Y",
))
register(OperatorSpec(
    name="prototypes.ridge_fit_kernel",
    forward=_ridge_pair("kernel"),
    backward=ridge_fit_backward,
    make_inputs=_ridge_inputs(4, 7),
    paper="XML Eq. (2.8) / GSP (P3), kernel form V = Z^T (Z Z^T + eps I)^{-1} Y",
))
