r"""Ridge fit of XML Eq. (2.8) / GSP (P3), scale-safe, with its backward pass.

Exact rescaling. With ``t``, ``s`` powers of two (:func:`refdml._numerics.common_scale`)
and ``Z = t Zs``, ``Y = s Ys`` (exact), substituting ``V = (s / t) W`` gives

.. math::

    V(Z, Y; r) = \frac{s}{t}\, W(Zs, Ys; r / t^2), \qquad
    W = (Zs^\top Zs + r' I)^{-1} Zs^\top Ys, \quad r' = r / t^2 .

``Zs``, ``Ys`` have entries below 1, so their Gram matrices cannot overflow. ``r'`` may
itself leave the float64 range, so the system is normalised as ``M_n = omega Zs^T Zs +
rho I`` with ``(omega, rho) = (1 / r', 1)`` when ``r' >= 1`` (the ridge dominates;
``omega`` may underflow harmlessly) and ``(1, r')`` otherwise; then
``W = omega M_n^{-1} Zs^T Ys`` and every power of two is applied once at the end with
``numpy.ldexp`` (``V = ldexp(omega_m W_n, ...)``), so ``V`` is right at any scale of
``Z`` and ``Y`` for a fixed ridge, or a named ``ValueError`` says it overflows.

Singular systems. ``lambda_min(M_n) >= rho``; when ``rho`` is so small next to the Gram
matrix (``r = ridge`` below the rounding level of ``||Z||^2``) that ``M_n`` is
numerically singular, ``V`` is not determined by float64 arithmetic (the ridge term
that makes it unique has been rounded away), and the fit raises a ``ValueError`` naming
the parameter instead of SciPy's ``LinAlgError``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.linalg import LinAlgError, cho_solve, cholesky

from refdml._numerics import common_scale
from refdml._validation import (
    as_float_array,
    check_choice,
    check_context,
    check_same_length,
    check_scalar,
    check_upstream,
)

__all__ = ["RidgeContext", "RidgeGrads", "ridge_fit", "ridge_fit_backward", "ridge_fit_forward"]

_FORMS = ("auto", "primal", "kernel")
# A matrix whose condition number exceeds 1 / (_DEFINITE * n * machine eps) is treated
# as numerically singular (its smallest eigenvalue is lost to rounding).
_DEFINITE = 1e3


@dataclass(frozen=True)
class RidgeGrads:
    Z: np.ndarray
    Y: np.ndarray


@dataclass(frozen=True)
class Scaling:
    """Powers of two of a rescaled ridge system (see the module docstring).

    ``Z = 2**log2_t Zs``, ``Y = 2**log2_s Ys``, ``omega = omega_mantissa * 2**omega_exponent``
    (exact), ``rho`` the normalised ridge: ``M_n = omega Zs^T Zs + rho I``.
    """

    log2_t: int
    log2_s: int
    omega_mantissa: float
    omega_exponent: int
    rho: float

    @property
    def omega(self) -> float:
        return float(np.ldexp(self.omega_mantissa, self.omega_exponent))


@dataclass(frozen=True)
class NormalisedFit:
    """The fit ``W_n = M_n^{-1} Zs^T Ys`` of rescaled inputs (private to the package)."""

    Zs: np.ndarray
    Ys: np.ndarray
    W: np.ndarray            # W_n, (m, d)
    form: str                # "primal" or "kernel"
    cholesky: np.ndarray     # lower Cholesky factor of M_n (m x m) or K_n (b x b)
    kernel_solution: np.ndarray | None  # K_n^{-1} Ys, kernel form only
    omega: float


@dataclass(frozen=True)
class RidgeContext:
    """What :func:`ridge_fit_backward` needs: the normalised fit and its scaling."""

    fit: NormalisedFit
    scaling: Scaling
    form: str                # "primal" or "kernel", never "auto"
    shape: tuple[int, int]   # shape of V, (m, d)


def scaling_for(Z: np.ndarray, Y: np.ndarray, ridge: float) -> Scaling:
    """The exact rescaling of ``(Z, Y, ridge)`` described in the module docstring."""
    log2_t = int(np.log2(common_scale(Z)))
    log2_s = int(np.log2(common_scale(Y)))
    fraction, exponent = np.frexp(ridge)          # ridge = fraction 2**exponent
    shift = int(exponent) - 2 * log2_t            # r' = fraction 2**shift
    if shift >= 1:                                # r' >= 1: the ridge dominates
        return Scaling(log2_t, log2_s, 1.0 / float(fraction), -shift, 1.0)
    return Scaling(log2_t, log2_s, 1.0, 0, float(np.ldexp(fraction, shift)))


def times_pow2(x: np.ndarray, mantissa: float, exponent: int, what: str) -> np.ndarray:
    """``mantissa * 2**exponent * x`` without intermediate overflow; ValueError if it overflows."""
    with np.errstate(over="ignore"):
        result = np.ldexp(mantissa * x, exponent)
    if not np.all(np.isfinite(result)):
        raise ValueError(f"{what} overflows float64 (its entries exceed 1.8e308)")
    return result


def numerically_definite(matrix: np.ndarray, floor: float) -> bool:
    """Is the symmetric ``matrix`` (smallest eigenvalue at least ``floor``) numerically definite?

    Cheap when ``floor`` is not tiny next to the trace (which bounds the largest
    eigenvalue); otherwise decided from the spectrum, since a Cholesky factorisation
    succeeds on many matrices that are singular in exact arithmetic.
    """
    n = matrix.shape[0]
    limit = _DEFINITE * n * np.finfo(np.float64).eps
    with np.errstate(over="ignore"):   # a trace beyond float64 only skips the shortcut
        trace = np.trace(matrix)
    if floor > 0.0 and trace * limit < floor:
        return True
    eigenvalues = np.linalg.eigvalsh(matrix)
    return bool(eigenvalues[-1] > 0.0 and eigenvalues[0] > limit * eigenvalues[-1])


def _resolve_form(form: str, n_samples: int, n_prototypes: int) -> str:
    if form == "auto":
        # Both systems cost a Cholesky of their size; the Gram products cost b m min(b, m).
        return "primal" if n_prototypes <= n_samples else "kernel"
    return form


def fit_normalised(Zs, Ys, scaling: Scaling, form: str, name: str, ridge: float) -> NormalisedFit:
    """Solve ``M_n W_n = Zs^T Ys`` in the requested form (named ValueError if singular)."""
    b, m = Zs.shape
    form = _resolve_form(form, b, m)
    omega, rho = scaling.omega, scaling.rho
    gram = Zs.T @ Zs if form == "primal" else Zs @ Zs.T
    matrix = omega * gram
    matrix[np.diag_indices_from(matrix)] += rho
    what = f"{name}^T {name} + ridge I" if form == "primal" else f"{name} {name}^T + ridge I"
    try:
        if not numerically_definite(matrix, rho):
            raise LinAlgError
        factor = cholesky(matrix, lower=True)
    except LinAlgError:
        raise ValueError(
            f"{what} ({form} form) is numerically singular: ridge == {ridge!r} is below the "
            f"rounding level of the Gram matrix of {name} (max |{name}| == "
            f"{np.ldexp(np.abs(Zs).max(), scaling.log2_t):.3g}) and {name} is (numerically) rank "
            "deficient, so the ridge fit is not determined in float64; use a larger ridge"
        ) from None
    if form == "primal":
        W = cho_solve((factor, True), Zs.T @ Ys)
        kernel_solution = None
    else:
        kernel_solution = cho_solve((factor, True), Ys)
        W = Zs.T @ kernel_solution
    return NormalisedFit(Zs, Ys, W, form, factor, kernel_solution, omega)


def fit_normalised_backward(fit: NormalisedFit, d_W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gradients of ``<d_W, W_n>`` with respect to ``Zs`` and ``Ys`` (``omega``, ``rho`` fixed).

    Primal, ``S = M_n^{-1} d_W``: ``dYs = Zs S``, ``dZs = (Ys - omega Zs W_n) S^T -
    omega Zs S W_n^T``. Kernel, ``U = K_n^{-1} Ys``, ``T = K_n^{-1} Zs d_W`` (``= Zs S``
    by push-through): ``dYs = T``, ``dZs = U d_W^T - omega (T U^T + U T^T) Zs``; no
    cancellation for a small ridge, unlike rewriting ``M_n^{-1}`` through Woodbury.
    """
    Zs, Ys, W, omega = fit.Zs, fit.Ys, fit.W, fit.omega
    if fit.form == "primal":
        S = cho_solve((fit.cholesky, True), d_W)
        return (Ys - omega * (Zs @ W)) @ S.T - omega * (Zs @ (S @ W.T)), Zs @ S
    U = fit.kernel_solution
    T = cho_solve((fit.cholesky, True), Zs @ d_W)
    d_Zs = U @ d_W.T - omega * (T @ (U.T @ Zs) + U @ (T.T @ Zs))
    return d_Zs, T


def check_fit_inputs(Z, Y, ridge, Z_name="Z", Y_name="Y"):
    Z = as_float_array(Z, Z_name, ndim=2)
    Y = as_float_array(Y, Y_name, ndim=2)
    check_same_length(Z, Z_name, Y, Y_name)
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    return Z, Y, ridge


def ridge_forward(Z, Y, ridge: float, form: str, name: str = "Z"):
    """The kernel of :func:`ridge_fit_forward` (valid input assumed)."""
    scaling = scaling_for(Z, Y, ridge)
    Zs = np.ldexp(Z, -scaling.log2_t)
    Ys = np.ldexp(Y, -scaling.log2_s)
    fit = fit_normalised(Zs, Ys, scaling, form, name, ridge)
    # V = (s / t) omega W_n
    V = times_pow2(fit.W, scaling.omega_mantissa,
                   scaling.log2_s - scaling.log2_t + scaling.omega_exponent, "V")
    return V, RidgeContext(fit=fit, scaling=scaling, form=fit.form, shape=V.shape)


def ridge_backward(ctx: RidgeContext, d_V: np.ndarray) -> RidgeGrads:
    """The kernel of :func:`ridge_fit_backward`: scaled chain rule, then exact powers of two."""
    sc = ctx.scaling
    log2_g = int(np.log2(common_scale(d_V)))
    d_Zs, d_Ys = fit_normalised_backward(ctx.fit, np.ldexp(d_V, -log2_g))
    # V = (s omega / t) W_n(Z / t, Y / s): dZ = (s omega / t^2) dZs, dY = (omega / t) dYs.
    d_Z = times_pow2(d_Zs, sc.omega_mantissa,
                     log2_g + sc.log2_s + sc.omega_exponent - 2 * sc.log2_t, "the gradient of Z")
    d_Y = times_pow2(d_Ys, sc.omega_mantissa,
                     log2_g + sc.omega_exponent - sc.log2_t, "the gradient of Y")
    return RidgeGrads(Z=d_Z, Y=d_Y)


def ridge_fit_forward(Z, Y, *, ridge, form: str = "auto") -> tuple[np.ndarray, RidgeContext]:
    """Ridge prototypes ``V = argmin ||Z V - Y||_F^2 + ridge ||V||_F^2``; returns ``(V, ctx)``.

    See :func:`ridge_fit` for the parameters.
    """
    Z, Y, ridge = check_fit_inputs(Z, Y, ridge)
    check_choice(form, "form", _FORMS)
    return ridge_forward(Z, Y, ridge, form)


def ridge_fit_backward(ctx: RidgeContext, d_V) -> RidgeGrads:
    """Gradients ``.Z`` (b, m) and ``.Y`` (b, d) of ``<d_V, V>``; ``d_V`` has V's shape (m, d).

    With ``M = Z^T Z + ridge I`` and ``S = M^{-1} d_V``:
    ``dL/dY = Z S`` and ``dL/dZ = (Y - Z V) S^T - Z S V^T`` (``docs/prototypes.md``),
    evaluated on the rescaled system of the forward (module docstring).
    """
    check_context(ctx, "ctx", RidgeContext)
    d_V = check_upstream(d_V, "d_V", ctx.shape)
    return ridge_backward(ctx, d_V)


def ridge_fit(Z, Y, *, ridge, form: str = "auto") -> np.ndarray:
    r"""Ridge regression of embeddings on histograms (XML Eq. 2.8, GSP (P3)).

    .. math::

        V = \arg\min_V \|Z V - Y\|_F^2 + \epsilon \|V\|_F^2
          = (Z^\top Z + \epsilon I_m)^{-1} Z^\top Y
          = Z^\top (Z Z^\top + \epsilon I_b)^{-1} Y

    Parameters
    ----------
    Z : array (b, m)
        Histograms, one row per sample (the paper's ``Z`` transposed).
    Y : array (b, d)
        Targets (embeddings), one row per sample.
    ridge : float > 0
        The ridge weight: the paper's ϵ (epsilon) of XML Eq. (2.8) / GSP (P3).
    form : {"auto", "primal", "kernel"}
        ``"primal"`` factors the ``m x m`` matrix, ``"kernel"`` the ``b x b`` one
        (the paper's "if the batch size is less than the number of prototypes");
        ``"auto"`` picks the smaller. Same answer up to rounding.

    Returns
    -------
    V : array (m, d)
        Prototypes (the transpose of the paper's ``A``).

    Raises
    ------
    ValueError
        If the system is numerically singular (``ridge`` rounded away next to
        ``||Z||^2`` and ``Z`` rank deficient in the chosen form) or ``V`` overflows.
        Any finite scale of ``Z`` and ``Y`` is otherwise handled exactly (module docstring).
    """
    return ridge_fit_forward(Z, Y, ridge=ridge, form=form)[0]
