r"""Fast-path mirror of :func:`refdml.prototypes.ridge_fit` (XML Eq. 2.8 / GSP (P3)),
NumPy or CuPy, float32 or float64.

The same exact power-of-two rescaling as the reference (``refdml/prototypes/_ridge.py``:
``Z = 2^a Zs``, ``Y = 2^b Ys``, ``M_n = omega Zs^T Zs + rho I``), the same primal /
kernel forms and backward formulas, and the reference's context classes
(``RidgeContext``, ``NormalisedFit``, ``Scaling``; the private ones shared through
:mod:`refdml._shared.prototypes`), holding arrays of the input's module.
The systems are solved by Cholesky through :func:`_cho_solve`, with the backend's
``solve_triangular`` (:attr:`refdml._backend.Backend.linalg`: SciPy's or
``cupyx.scipy.linalg``'s); the same computation on NumPy and on CuPy.

Synchronisations: the forward reads ``max|Z|`` and ``max|Y|`` on the host (the scaling's
exponents are Python ints, as in the reference's ``Scaling``); with data checks on
(:mod:`refdml._validation`) it also checks that the system is numerically definite
(the reference's test, eigenvalues when the cheap bound fails) and that ``V`` does not
overflow. The backward's scaling of ``d_V`` stays on the device.

float32: the system ``M_n`` (b x b or m x m, small) is assembled from the float32 data in
float64, checked for definiteness at float64's epsilon (the reference's test) and factored
and solved in float64; ``W`` is rounded to float32, and the backward solves with the float64
factor and rounds the gradients to float32. (The first version did all of it in float32 with
the threshold ``1e3 n eps`` at float32's epsilon, which refused systems of condition number
~360 at n = 32, where float32 would still give ~4e-5 relative error: a zero-shot loss with
ridge 0.05 on concentrated histograms stopped a training run of `refdml reproduce`.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._validation import (
    as_fast_array, check_choice, check_context, check_fast_upstream, check_scalar, data_checks,
    result_dtype,
)
from refdml._backend import Backend, get_backend
from refdml.gpu.distances import common_scale
from refdml.prototypes import RidgeContext, RidgeGrads
from refdml._shared.prototypes import DEFINITE, NormalisedFit, scaling_for

__all__ = ["RidgeContext", "RidgeGrads", "ridge_fit", "ridge_fit_backward", "ridge_fit_forward"]

_FORMS = ("auto", "primal", "kernel")


def _cho_solve(ns: Backend, lower: Any, rhs: Any) -> Any:
    """``(L L^T)^{-1} rhs`` from the lower Cholesky factor ``L`` (NumPy or CuPy)."""
    solve = ns.linalg.solve_triangular
    half = solve(lower, rhs, lower=True)
    return solve(lower, half, lower=True, trans="T")


def _definite(ns: Backend, matrix: Any, floor: float) -> bool:
    """The reference's ``numerically_definite`` at the dtype's machine epsilon."""
    xp = ns.xp
    n = matrix.shape[0]
    limit = DEFINITE * n * np.finfo(matrix.dtype).eps
    if floor > 0.0 and float(xp.trace(matrix)) * limit < floor:
        return True
    eigenvalues = xp.linalg.eigvalsh(matrix)
    top, bottom = float(eigenvalues[-1]), float(eigenvalues[0])
    return top > 0.0 and bottom > limit * top


def _times_pow2(ns: Backend, x: Any, mantissa: float, exponent: int, what: str) -> Any:
    xp = ns.xp
    with ns.errstate(over="ignore", divide="ignore"):
        out = xp.ldexp(x * x.dtype.type(mantissa), exponent).astype(x.dtype, copy=False)
    if data_checks(ns) and not bool(xp.all(xp.isfinite(out))):
        raise ValueError(
            f"{what} overflows {np.dtype(x.dtype).name} (its entries exceed the dtype's range)"
        )
    return out


def _check_fit_inputs(Z, Y, ridge, Z_name="Z", Y_name="Y"):
    ns = get_backend(Z, Y)
    dtype = result_dtype(Z, Y) if hasattr(Z, "dtype") and hasattr(Y, "dtype") else None
    Z = as_fast_array(Z, Z_name, ndim=2, dtype=dtype, ns=ns)
    Y = as_fast_array(Y, Y_name, ndim=2, dtype=Z.dtype, ns=ns)
    if Z.shape[0] != Y.shape[0]:
        raise ValueError(
            f"{Z_name} has {Z.shape[0]} rows but {Y_name} has {Y.shape[0]}; they must match"
        )
    ridge = check_scalar(ridge, "ridge", low=0.0, low_inclusive=False)
    return ns, Z, Y, ridge


def _scaling(ns: Backend, Z: Any, Y: Any, ridge: float):
    """The reference's ``Scaling`` of ``(Z, Y, ridge)``: ``max|Z|``, ``max|Y|`` on the host
    (one synchronisation), then exact powers of two; and ``max|Z|`` for error messages."""
    xp = ns.xp
    peaks = xp.stack([xp.max(xp.abs(Z)), xp.max(xp.abs(Y))]).tolist()   # one transfer
    return scaling_for(np.asarray(peaks[0]), np.asarray(peaks[1]), ridge), peaks[0]


def _fit_normalised(ns: Backend, Zs, Ys, scaling, form: str, name: str, ridge: float,
                    peak: float) -> NormalisedFit:
    """Solve ``M_n W_n = Zs^T Ys`` in the requested form (named ValueError if singular).

    The system is assembled, checked and solved in float64 whatever the data's dtype (module
    docstring); ``W`` has the data's dtype, the Cholesky factor and the kernel form's
    solution stay float64 for the backward."""
    xp = ns.xp
    b, m = Zs.shape
    if form == "auto":
        form = "primal" if m <= b else "kernel"
    omega, rho = scaling.omega, scaling.rho
    Zw, Yw = Zs.astype(xp.float64, copy=False), Ys.astype(xp.float64, copy=False)
    gram = Zw.T @ Zw if form == "primal" else Zw @ Zw.T
    matrix = omega * gram + rho * xp.eye(gram.shape[0], dtype=xp.float64)
    what = f"{name}^T {name} + ridge I" if form == "primal" else f"{name} {name}^T + ridge I"
    singular = data_checks(ns) and not _definite(ns, matrix, rho)
    if not singular:
        try:
            factor = xp.linalg.cholesky(matrix)
        except np.linalg.LinAlgError:       # NumPy only: CuPy returns NaN and does not raise,
            singular = True                 # so there only _definite (data checks) refuses;
                                            # with checks off a singular system gives NaN W
    if singular:
        raise ValueError(
            f"{what} ({form} form) is numerically singular: ridge == {ridge!r} is below the "
            f"rounding level of the Gram matrix of {name} (max |{name}| == {peak:.3g}) "
            f"and {name} is (numerically) rank deficient, so the ridge fit is not determined "
            f"in float64; use a larger ridge"
        )
    if form == "primal":
        W = _cho_solve(ns, factor, Zw.T @ Yw)
        kernel_solution = None
    else:
        kernel_solution = _cho_solve(ns, factor, Yw)
        W = Zw.T @ kernel_solution
    return NormalisedFit(Zs=Zs, Ys=Ys, W=W.astype(Zs.dtype, copy=False), form=form,
                         cholesky=factor, kernel_solution=kernel_solution, omega=omega)


def _pow2_scaled(xp: Any, x: Any, log2: int) -> Any:
    return xp.ldexp(x, -log2).astype(x.dtype, copy=False)


def _ridge_forward(ns: Backend, Z, Y, ridge: float, form: str, name: str = "Z"):
    """Kernel of :func:`ridge_fit_forward` on checked input."""
    xp = ns.xp
    scaling, peak = _scaling(ns, Z, Y, ridge)
    Zs, Ys = _pow2_scaled(xp, Z, scaling.log2_t), _pow2_scaled(xp, Y, scaling.log2_s)
    fit = _fit_normalised(ns, Zs, Ys, scaling, form, name, ridge, peak)
    V = _times_pow2(ns, fit.W, scaling.omega_mantissa,
                    scaling.log2_s - scaling.log2_t + scaling.omega_exponent, "V")
    return V, RidgeContext(fit=fit, scaling=scaling, form=fit.form, shape=tuple(V.shape))


def _fit_backward(ns: Backend, fit: NormalisedFit, d_W: Any) -> tuple[Any, Any]:
    """The reference's ``fit_normalised_backward`` (formulas in its docstring), in float64
    with the forward's float64 factor; the gradients in the data's dtype."""
    xp = ns.xp
    dtype = fit.Zs.dtype
    Zs, Ys, W, d_W = (v.astype(xp.float64, copy=False) for v in (fit.Zs, fit.Ys, fit.W, d_W))
    omega = fit.omega
    if fit.form == "primal":
        S = _cho_solve(ns, fit.cholesky, d_W)
        d_Zs, d_Ys = (Ys - omega * (Zs @ W)) @ S.T - omega * (Zs @ (S @ W.T)), Zs @ S
    else:
        U = fit.kernel_solution
        T = _cho_solve(ns, fit.cholesky, Zs @ d_W)
        d_Zs, d_Ys = U @ d_W.T - omega * (T @ (U.T @ Zs) + U @ (T.T @ Zs)), T
    return d_Zs.astype(dtype, copy=False), d_Ys.astype(dtype, copy=False)


def _ridge_backward(ns: Backend, ctx: RidgeContext, d_V: Any) -> RidgeGrads:
    sc = ctx.scaling
    g_scale = common_scale(ns.xp, d_V)        # a 0-d power of two, on the device
    d_Zs, d_Ys = _fit_backward(ns, ctx.fit, d_V / g_scale)
    d_Z = _times_pow2(ns, d_Zs * g_scale, sc.omega_mantissa,
                      sc.log2_s + sc.omega_exponent - 2 * sc.log2_t, "the gradient of Z")
    d_Y = _times_pow2(ns, d_Ys * g_scale, sc.omega_mantissa,
                      sc.omega_exponent - sc.log2_t, "the gradient of Y")
    return RidgeGrads(Z=d_Z, Y=d_Y)


def ridge_fit_forward(Z, Y, *, ridge, form: str = "auto") -> tuple[Any, RidgeContext]:
    """Ridge prototypes ``V = argmin ||Z V - Y||_F^2 + ridge ||V||_F^2``; ``(V, ctx)``.

    See :func:`refdml.prototypes.ridge_fit` (``Z (b, m)``, ``Y (b, d)``, ``V (m, d)``).
    """
    ns, Z, Y, ridge = _check_fit_inputs(Z, Y, ridge)
    check_choice(form, "form", _FORMS)
    return _ridge_forward(ns, Z, Y, ridge, form)


def ridge_fit_backward(ctx: RidgeContext, d_V) -> RidgeGrads:
    """Gradients ``.Z`` (b, m) and ``.Y`` (b, d) of ``<d_V, V>``; ``d_V`` of shape (m, d)."""
    check_context(ctx, "ctx", RidgeContext)
    ns = get_backend(ctx.fit.W)
    d_V = check_fast_upstream(d_V, "d_V", ctx.shape, ns, ctx.fit.W.dtype)
    return _ridge_backward(ns, ctx, d_V)


def ridge_fit(Z, Y, *, ridge, form: str = "auto") -> Any:
    """Ridge prototypes ``V`` (m, d) (no context kept); see :func:`ridge_fit_forward`."""
    return ridge_fit_forward(Z, Y, ridge=ridge, form=form)[0]
