r"""Fast-path mirror of :func:`refdml.prototypes.ridge_fit` (XML Eq. 2.8 / GSP (P3)),
NumPy or CuPy, float32 or float64.

The same exact power-of-two rescaling as the reference (``refdml/prototypes/_ridge.py``:
``Z = 2^a Zs``, ``Y = 2^b Ys``, ``M_n = omega Zs^T Zs + rho I``), the same primal /
kernel forms and backward formulas, and the reference's ``RidgeContext``, holding the
fast path's own :class:`Fit` (the reference's ``NormalisedFit`` kept in float64, with the
data's dtype) and :class:`DeviceScaling` (the reference's ``Scaling`` with its powers of
two as 0-d device arrays). The systems are solved by Cholesky through
:func:`refdml.gpu.linalg.cho_solve`, with the backend's ``solve_triangular``
(:attr:`refdml._backend.Backend.linalg`: SciPy's or ``cupyx.scipy.linalg``'s; its own
kernel inside a captured graph); the same computation on NumPy and on CuPy.

Synchronisations: none. The scaling's exponents come from ``max|Z|`` and ``max|Y|`` on
the device (``frexp``), and index a table of the scalings of the ridge for every exponent,
kept on the device (the reference's branch on the ridge's shift is taken when the table
is built, once per ridge): one gather instead of arithmetic on 0-d arrays. With data checks on
(:mod:`refdml._validation`) the forward also checks that the system is numerically
definite (the reference's test, eigenvalues when the cheap bound fails; it reads the
trace and ``rho``) and that ``V`` does not overflow.

float32: the system ``M_n`` (b x b or m x m, small) is assembled from the float32 data in
float64, checked for definiteness at float64's epsilon (the reference's test) and factored
and solved in float64; the scaled inputs, ``W`` and the factor stay float64 in the context,
``V`` and the gradients are rounded to float32 once, at the end. (The first version did all of it in float32 with
the threshold ``1e3 n eps`` at float32's epsilon, which refused systems of condition number
~360 at n = 32, where float32 would still give ~4e-5 relative error: a zero-shot loss with
ridge 0.05 on concentrated histograms stopped a training run of `refdml reproduce`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    as_fast_array, check_choice, check_context, check_fast_upstream, check_scalar, data_checks,
    result_dtype,
)
from refdml._backend import Backend, get_backend
from refdml.gpu import linalg
from refdml.gpu.linalg import matmul
from refdml.prototypes import RidgeContext, RidgeGrads
from refdml._shared.prototypes import DEFINITE

__all__ = ["RidgeContext", "RidgeGrads", "ridge_fit", "ridge_fit_backward", "ridge_fit_forward"]

_FORMS = ("auto", "primal", "kernel")


@dataclass(frozen=True)
class DeviceScaling:
    """The reference's ``Scaling`` (``refdml/prototypes/_ridge.py``) with its powers of two
    as 0-d arrays on the data's device, so that no exponent is read back to the host.

    ``neg_log2_t``, ``neg_log2_s``: ``-log2(t)``, ``-log2(s)`` (int32, what ``ldexp`` of the
    data takes); ``omega_mantissa``: float64 (the factor the results are scaled
    by, as before); ``omega_exponent`` (int32); ``omega`` and ``rho`` in float64 (the
    system's normalisation ``M_n = omega Zs^T Zs + rho I``).
    """

    neg_log2_t: Any
    neg_log2_s: Any
    omega_mantissa: Any
    omega_exponent: Any
    omega: Any
    rho: Any

    @property
    def log2_t(self) -> Any:
        return -self.neg_log2_t

    @property
    def log2_s(self) -> Any:
        return -self.neg_log2_s


@dataclass(frozen=True)
class Fit:
    """A normalised fit ``W_n = M_n^{-1} Zs^T Ys`` (the reference's ``NormalisedFit``),
    kept in float64 whatever the data's dtype (the module docstring), with that dtype.

    ``Zs``, ``Ys``, ``W`` and the factors are float64, so the backward casts nothing but
    its results; ``dtype`` is the data's (of the results and of the upstream gradients).
    """

    Zs: Any
    Ys: Any
    W: Any                   # W_n, (m, d), float64
    form: str                # "primal" or "kernel"
    cholesky: Any            # lower Cholesky factor of M_n (m x m) or K_n (b x b)
    kernel_solution: Any     # K_n^{-1} Ys, kernel form only
    omega: Any               # 0-d float64
    dtype: Any


def _definite(ns: Backend, matrix: Any, floor: Any) -> bool:
    """The reference's ``numerically_definite`` at float64's machine epsilon (a data check:
    it reads the trace, and the spectrum when the cheap bound fails)."""
    xp = ns.xp
    n = matrix.shape[0]
    limit = DEFINITE * n * np.finfo(matrix.dtype).eps
    trace, floor = xp.stack([xp.trace(matrix), floor]).tolist()   # one transfer
    if floor > 0.0 and trace * limit < floor:
        return True
    eigenvalues = xp.linalg.eigvalsh(matrix)
    top, bottom = float(eigenvalues[-1]), float(eigenvalues[0])
    return top > 0.0 and bottom > limit * top


def _times_pow2(ns: Backend, x: Any, mantissa: Any, exponent: Any, what: str,
                dtype: Any = None) -> Any:
    """``mantissa 2**exponent x`` without intermediate overflow, scaled in ``x``'s dtype
    (float64 here) and rounded once to ``dtype`` (default ``x``'s); ``mantissa`` a 0-d
    float64 (None: already applied), ``exponent`` a 0-d int32 array."""
    xp = ns.xp
    with ns.errstate(over="ignore", divide="ignore"):
        out = xp.ldexp(x if mantissa is None else x * mantissa, exponent)
        if dtype is not None:
            out = out.astype(dtype, copy=False)
    if data_checks(ns) and not bool(xp.all(xp.isfinite(out))):
        raise ValueError(
            f"{what} overflows {np.dtype(out.dtype).name} (its entries exceed the dtype's range)"
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


#: The exponent of each row of :func:`_scaling_tables`: every exponent ``frexp`` gives a
#: float64 (``max|x| = f 2**e``, f in [0.5, 1); 0 for 0, inf and NaN), from 0 up to 1024 (the
#: largest finite), then -1073 (2**-1074) up to -1, so that row ``e`` holds ``e`` (a negative
#: ``e`` counted from the end, as integer-array indexing reads it on NumPy and CuPy).
_EXPONENTS = np.concatenate([np.arange(0, 1025), np.arange(-1073, 0)])


def _scaling_tables(ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """The scaling of ``ridge`` for every exponent ``e`` of a peak, in row ``e``
    (:data:`_EXPONENTS`):
    int32 ``(-log2 t, omega_exponent)`` and float64 ``(omega_mantissa, omega, rho)`` per
    row. The reference's ``scaling_for`` depends on the data only through these exponents
    (``common_scale`` is ``2**min(e, 1023)``, 1 for e = 0), so one gather of a kept table
    replaces its arithmetic on 0-d device arrays; the rows are computed here with the same
    NumPy operations the device ran."""
    e = _EXPONENTS
    neg_log2 = -np.minimum(e, 1023).astype(np.int32)
    fraction, exponent = np.frexp(ridge)          # ridge = fraction 2**exponent
    neg_shift = -2 * neg_log2 - int(exponent)     # r' = fraction 2**-neg_shift
    dominant = neg_shift <= -1                    # r' >= 1: the ridge dominates
    with np.errstate(over="ignore", divide="ignore", under="ignore"):
        # -shift when the ridge dominates, else 0
        omega_exponent = np.minimum(neg_shift, 0).astype(np.int32)
        mantissa = np.where(dominant, 1.0 / float(fraction), 1.0)
        omega = np.ldexp(mantissa, omega_exponent)
        rho = np.where(dominant, 1.0, np.ldexp(float(fraction), -neg_shift))
    return (np.stack([neg_log2, omega_exponent], axis=1),
            np.stack([mantissa, omega, rho], axis=1))


def _scaling(ns: Backend, Z: Any, Y: Any, ridge: float) -> DeviceScaling:
    """The reference's ``scaling_for(Z, Y, ridge)``, on the device from ``max|Z|`` and
    ``max|Y|`` (no synchronisation): their exponents index a kept table of the scalings
    of ``ridge`` (:func:`_scaling_tables`, uploaded once per ridge), so the fields are
    views of two gathered rows."""
    xp = ns.xp
    peaks = xp.stack([xp.max(xp.abs(Z)), xp.max(xp.abs(Y))])
    exponents = xp.frexp(peaks)[1]
    ridge = float(ridge)
    ints_table = ns.kept(("refdml.gpu.prototypes.scaling_ints", ridge),
                         lambda: _scaling_tables(ridge)[0])
    floats_table = ns.kept(("refdml.gpu.prototypes.scaling_floats", ridge),
                           lambda: _scaling_tables(ridge)[1])
    ints = ints_table[exponents]                  # (2, 2): Z's row, Y's row
    floats = floats_table[exponents[0]]           # (3,): Z's
    return DeviceScaling(neg_log2_t=ints[0, 0], neg_log2_s=ints[1, 0],
                         omega_mantissa=floats[0], omega_exponent=ints[0, 1],
                         omega=floats[1], rho=floats[2])


def _neg_log2_scale(ns: Backend, x: Any) -> Any:
    """``-log2`` of the reference's ``common_scale(x)`` as a 0-d int32 on the device (the
    exponent of ``max|x|``, capped at 1023; 0 for zeros, inf and NaN, where frexp gives 0)."""
    xp = ns.xp
    # row e of the kept table holds -min(e, 1023) (:data:`_EXPONENTS`): one gather
    table = ns.kept("refdml.gpu.prototypes.neg_log2",
                    lambda: -np.minimum(_EXPONENTS, 1023).astype(np.int32))
    return table[xp.frexp(xp.max(xp.abs(x)))[1]]


def _peak(ns: Backend, Z: Any) -> float:
    """``max|Z|`` for an error message (read only when raising)."""
    return float(ns.xp.max(ns.xp.abs(Z)))


def _scaled64(ns: Backend, x: Any, neg_log2: Any) -> Any:
    """``x / 2**log2`` (exact) in float64, the dtype every fit is solved in."""
    # ldexp's float64 loop casts x (exactly): one launch, no separate astype
    return ns.xp.ldexp(x, neg_log2, dtype=np.float64)


def _system(ns: Backend, gram: Any, omega: Any, rho: Any) -> Any:
    """``omega gram + rho I``: the diagonal is a strided view, added in place."""
    matrix = gram * omega
    n = matrix.shape[0]
    diagonal = matrix.reshape(-1)[::n + 1]
    ns.xp.add(diagonal, rho, out=diagonal)      # in place: no copy back through __setitem__
    return matrix


def _refuse_singular(form: str, name: str, ridge: float, peak) -> None:
    """The reference's ValueError for a numerically singular system of ``name``."""
    what = f"{name}^T {name} + ridge I" if form == "primal" else f"{name} {name}^T + ridge I"
    shown = peak() if callable(peak) else peak
    raise ValueError(
        f"{what} ({form} form) is numerically singular: ridge == {ridge!r} is below the "
        f"rounding level of the Gram matrix of {name} (max |{name}| == {shown:.3g}) "
        f"and {name} is (numerically) rank deficient, so the ridge fit is not determined "
        f"in float64; use a larger ridge"
    )


def _fit_normalised(ns: Backend, Zs, Ys, scaling, form: str, name: str, ridge: float,
                    peak=None, dtype: Any = None) -> Fit:
    """Solve ``M_n W_n = Zs^T Ys`` in the requested form (named ValueError if singular).

    ``Zs``, ``Ys`` float64 (:func:`_scaled64`): the system is assembled, checked and solved
    in float64 whatever the data's dtype (module docstring), and the fit stays float64 for
    the backward; ``dtype`` is the data's. ``peak`` (``max|Z|``, or a callable giving it)
    only names the scale in the error."""
    b, m = Zs.shape
    if form == "auto":
        form = "primal" if m <= b else "kernel"
    gram = matmul(ns, Zs.T, Zs) if form == "primal" else matmul(ns, Zs, Zs.T)
    matrix = _system(ns, gram, scaling.omega, scaling.rho)
    singular = data_checks(ns) and not _definite(ns, matrix, scaling.rho)
    if not singular:
        try:
            factor = linalg.cholesky(ns, matrix)
        except np.linalg.LinAlgError:       # NumPy only: CuPy returns NaN and does not raise,
            singular = True                 # so there only _definite (data checks) refuses;
                                            # with checks off a singular system gives NaN W
    if singular:
        _refuse_singular(form, name, ridge, peak)
    if form == "primal":
        W = linalg.cho_solve(ns, factor, matmul(ns, Zs.T, Ys))
        kernel_solution = None
    else:
        kernel_solution = linalg.cho_solve(ns, factor, Ys)
        W = matmul(ns, Zs.T, kernel_solution)
    return Fit(Zs=Zs, Ys=Ys, W=W, form=form, cholesky=factor,
               kernel_solution=kernel_solution, omega=scaling.omega,
               dtype=np.dtype(dtype if dtype is not None else Zs.dtype))


def _fit_kernel_pair(ns: Backend, Zs, Ys, n1: int, scaling, names: tuple[str, str],
                     ridge: float, peak, dtype: Any) -> tuple[tuple[Fit, Fit], Any]:
    """The kernel-form fits of rows ``:n1`` and ``n1:`` (two halves) as one block-diagonal
    system: one Gram product, one Cholesky, one solve instead of two each.

    The off-diagonal blocks are exact zeros, so the factor is the two halves' factors side
    by side (each entry of a cross block is a sum of products with a zero factor) and the
    solution each half's own: the same arithmetic as two systems. Returns the two fits
    (their factors and solutions are views of the joint ones) and the joint factor."""
    xp = ns.xp
    b = Zs.shape[0]

    def block_diagonal() -> np.ndarray:
        half = np.arange(b) < n1
        return half[:, None] == half[None, :]

    # The cross blocks zeroed in one where by a kept mask (a constant per (b, n1)).
    gram = xp.where(ns.kept(("refdml.gpu.prototypes.block_diagonal", b, n1), block_diagonal),
                    matmul(ns, Zs, Zs.T), 0.0)
    matrix = _system(ns, gram, scaling.omega, scaling.rho)
    blocks = (slice(0, n1), slice(n1, None))
    if data_checks(ns):
        for block, name in zip(blocks, names):
            if not _definite(ns, matrix[block, block], scaling.rho):
                _refuse_singular("kernel", name, ridge, peak)
    try:
        factor = linalg.cholesky(ns, matrix)
    except np.linalg.LinAlgError:           # NumPy only (see _fit_normalised): name the half
        for block, name in zip(blocks, names):
            try:
                xp.linalg.cholesky(matrix[block, block])
            except np.linalg.LinAlgError:
                _refuse_singular("kernel", name, ridge, peak)
        raise
    solution = linalg.cho_solve(ns, factor, Ys)
    fits = tuple(Fit(Zs=Zs[block], Ys=Ys[block], W=matmul(ns, Zs[block].T, solution[block]),
                     form="kernel", cholesky=factor[block, block],
                     kernel_solution=solution[block], omega=scaling.omega,
                     dtype=np.dtype(dtype)) for block in blocks)
    return fits, factor


def _kernel_grads(ns: Backend, fit: Fit, d_W: Any, T: Any) -> tuple[Any, Any]:
    """The kernel form's gradients given ``T = K_n^{-1} Zs d_W`` (reference formulas)."""
    U, Zs = fit.kernel_solution, fit.Zs
    return (matmul(ns, U, d_W.T) - fit.omega * (matmul(ns, T, matmul(ns, U.T, Zs))
                                               + matmul(ns, U, matmul(ns, T.T, Zs))), T)


def _kernel_pair_backward(ns: Backend, fits: tuple[Fit, Fit], factor: Any,
                          d_Ws: tuple[Any, Any]) -> tuple[tuple[tuple[Any, Any], tuple[Any, Any]], Any]:
    """:func:`_fit_backward` of the two fits of :func:`_fit_kernel_pair` (float64
    ``d_Ws``), with one solve by the joint factor; also that solve's result, the two
    gradients of ``Ys`` one above the other (the halves' order)."""
    xp = ns.xp
    n1 = fits[0].Zs.shape[0]
    rhs = xp.empty((n1 + fits[1].Zs.shape[0], d_Ws[0].shape[1]), dtype=np.float64)
    matmul(ns, fits[0].Zs, d_Ws[0], out=rhs[:n1])
    matmul(ns, fits[1].Zs, d_Ws[1], out=rhs[n1:])
    T = linalg.cho_solve(ns, factor, rhs)
    return (_kernel_grads(ns, fits[0], d_Ws[0], T[:n1]),
            _kernel_grads(ns, fits[1], d_Ws[1], T[n1:])), T


def _ridge_forward(ns: Backend, Z, Y, ridge: float, form: str, name: str = "Z"):
    """Kernel of :func:`ridge_fit_forward` on checked input."""
    scaling = _scaling(ns, Z, Y, ridge)
    Zs, Ys = _scaled64(ns, Z, scaling.neg_log2_t), _scaled64(ns, Y, scaling.neg_log2_s)
    fit = _fit_normalised(ns, Zs, Ys, scaling, form, name, ridge, lambda: _peak(ns, Z),
                          dtype=Z.dtype)
    V = _times_pow2(ns, fit.W, scaling.omega_mantissa,
                    scaling.omega_exponent + scaling.neg_log2_t - scaling.neg_log2_s, "V",
                    dtype=Z.dtype)
    return V, RidgeContext(fit=fit, scaling=scaling, form=fit.form, shape=tuple(V.shape))


def _fit_backward(ns: Backend, fit: Fit, d_W: Any) -> tuple[Any, Any]:
    """The reference's ``fit_normalised_backward`` (formulas in its docstring), in float64
    with the forward's float64 factor and arrays; ``d_W`` any float dtype, the gradients
    float64 (the caller scales and rounds them once)."""
    Zs, Ys, W = fit.Zs, fit.Ys, fit.W
    d_W = d_W.astype(np.float64, copy=False)
    omega = fit.omega
    if fit.form == "primal":
        S = linalg.cho_solve(ns, fit.cholesky, d_W)
        return (matmul(ns, Ys - omega * matmul(ns, Zs, W), S.T)
                - omega * matmul(ns, Zs, matmul(ns, S, W.T)), matmul(ns, Zs, S))
    return _kernel_grads(ns, fit, d_W, linalg.cho_solve(ns, fit.cholesky, matmul(ns, Zs, d_W)))


def _ridge_backward(ns: Backend, ctx: RidgeContext, d_V: Any) -> RidgeGrads:
    sc = ctx.scaling
    # omega_mantissa d_V / g with g = common_scale(d_V) (exact): the gradients are linear
    # in d_V, so the mantissa is applied once here and g goes back in through the exponents.
    neg_log2_g = _neg_log2_scale(ns, d_V)
    d_Zs, d_Ys = _fit_backward(ns, ctx.fit, ns.xp.ldexp(
        ns.xp.multiply(d_V, sc.omega_mantissa, dtype=np.float64), neg_log2_g))
    exponent_Y = sc.omega_exponent + sc.neg_log2_t - neg_log2_g
    d_Z = _times_pow2(ns, d_Zs, None, exponent_Y + sc.neg_log2_t - sc.neg_log2_s,
                      "the gradient of Z", dtype=ctx.fit.dtype)
    d_Y = _times_pow2(ns, d_Ys, None, exponent_Y, "the gradient of Y", dtype=ctx.fit.dtype)
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
    d_V = check_fast_upstream(d_V, "d_V", ctx.shape, ns, ctx.fit.dtype)
    return _ridge_backward(ns, ctx, d_V)


def ridge_fit(Z, Y, *, ridge, form: str = "auto") -> Any:
    """Ridge prototypes ``V`` (m, d) (no context kept); see :func:`ridge_fit_forward`."""
    return ridge_fit_forward(Z, Y, ridge=ridge, form=form)[0]
