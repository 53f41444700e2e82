r"""XML histogram operator (Sec. 2.1, Eqs. 2.1-2.4), forward and hand-derived backward.

Shapes: features ``(B, n, d)``, prototypes ``nu`` ``(m, d)``, histograms ``z`` ``(B, m)``,
plans ``pi`` ``(B, m, n)``, scores ``s_ij = nu_i^T x_j`` ``(B, m, n)``.

``histogram_lp`` (2.1), solved with HiGHS, and ``histogram_closed_form`` (Claim 2.1)
    .. math::
        \max_{z\in\mathcal S^m,\ \pi\ge 0} \sum_{ij} \nu_i^\top x_j\,\pi_{ij}
        \quad\text{s.t.}\quad \sum_i\pi_{ij} = 1/n,\ \sum_j \pi_{ij} = z_i

    Each feature sends its ``1/n`` to ``argmax_i nu_i^T x_j``: the largest inner
    product. The paper's prose says "nearest prototype"; that is the same only when
    the prototypes have equal norms (``||x - nu||^2 = ||x||^2 - 2 nu^T x + ||nu||^2``).

``histogram_entropic_forward`` / ``histogram_entropic_backward`` (2.4)
    The entropic version ``+ (1/ε) * entropy(pi)``, solved in closed form:
    ``pi_ij = (1/n) softmax_i(ε s_.j)``, ``z_i = sum_j pi_ij``. The keyword is
    ``inverse_temperature``: the paper's ε (varepsilon), multiplying the scores. The printed
    constraint ``sum_ij pi_ij = 1/n`` is a typo for ``sum_i pi_ij = 1/n`` (as in 2.1):
    as printed, ``sum_i z_i = 1/n``, infeasible with ``z`` in the simplex for n > 1.

``convex_combination_forward`` / ``convex_combination_backward`` (2.3)
    ``y_hat = sum_k z_k nu_k``.

Extreme scale. The scores are computed from the features and the prototypes divided by
powers of two (exact), ``s = s_f s_p (nu' ^T x')``: the LP and the closed form (whose
argmax is invariant under positive scaling) see well-scaled scores at any magnitude, and
their objective is ``s_f s_p`` times the scaled one. ``ε s`` is formed as
``((ε s') s_f) s_p``; a ValueError names it where it, or an objective, overflows float64.

The convex combination ``y_hat = z @ nu`` and its gradients ``d_y @ nu^T``, ``z^T @ d_y``
are plain products; an entry that overflows there is recomputed with the rows of the left
factor and the columns of the right one divided by powers of two (:func:`rescaled_product`):
an intermediate sum beyond float64 whose value is not (terms of opposite signs, weights
that are not a histogram) is computed, a value beyond float64 is a ValueError naming it.

The convex combination's kernels (forward and backward, with :func:`rescaled_product`) and
the entropic histogram's softmax backward are written once against the array module
``xp``: :mod:`refdml.gpu.histogram` calls them on float32/float64 NumPy or CuPy arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import softmax

from refdml._numerics import common_scale
from refdml._validation import (
    as_float_array,
    check_context,
    check_features_prototypes,
    check_scalar,
    check_upstream,
)

__all__ = [
    "ConvexCombinationContext",
    "ConvexCombinationGrads",
    "HistogramEntropicContext",
    "HistogramGrads",
    "HistogramResult",
    "convex_combination",
    "convex_combination_backward",
    "convex_combination_forward",
    "histogram_closed_form",
    "histogram_entropic",
    "histogram_entropic_backward",
    "histogram_entropic_forward",
    "histogram_lp",
]


@dataclass(frozen=True)
class HistogramResult:
    z: np.ndarray          # (B, m) histogram, in the simplex
    pi: np.ndarray         # (B, m, n) plan
    objective: np.ndarray  # (B,) sum_ij nu_i^T x_j pi_ij


@dataclass(frozen=True)
class HistogramGrads:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d), summed over the batch


@dataclass(frozen=True)
class HistogramEntropicContext:
    features: np.ndarray    # (B, n, d)
    prototypes: np.ndarray  # (m, d)
    assignment: np.ndarray  # (B, m, n), softmax_i(inverse_temperature s_ij)
    inverse_temperature: float


@dataclass(frozen=True)
class ConvexCombinationGrads:
    z: np.ndarray           # (B, m)
    prototypes: np.ndarray  # (m, d)


@dataclass(frozen=True)
class ConvexCombinationContext:
    z: np.ndarray           # (B, m)
    prototypes: np.ndarray  # (m, d)


def _scaled_scores(features: np.ndarray, prototypes: np.ndarray) -> tuple[np.ndarray, float, float]:
    """``(s', s_f, s_p)`` with ``nu_i^T x_j = s_f s_p s'_ij``, ``s'`` computed without overflow."""
    scale_f, scale_p = common_scale(features), common_scale(prototypes)
    scaled = np.einsum("id,bjd->bij", prototypes / scale_p, features / scale_f)
    return scaled, scale_f, scale_p


def _unscale(values: np.ndarray, scale_f: float, scale_p: float, what: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        out = values * scale_f * scale_p
    if not np.all(np.isfinite(out)):
        raise ValueError(
            f"{what} overflows float64 (|features| ~ {scale_f:.1e}, |prototypes| ~ {scale_p:.1e})"
        )
    return out


def rescaled_product(xp, left, right, plain):
    """``left @ right`` (2-d) with the entries where ``plain`` (that product, computed) is not
    finite recomputed without overflow; written against ``xp`` (the fast path calls it).

    ``(L R)_bd = r_b c_d sum_k (L_bk / r_b)(R_kd / c_d)`` with ``r_b``, ``c_d`` the powers of
    two just above the row's and the column's largest magnitude (division exact): every
    term is below 1, the sum below the inner dimension, and ``ldexp`` puts ``r_b c_d``
    back exactly, overflowing only where the value itself lies beyond the dtype. Terms
    that underflow in the scaled sum are below ``2^-1074 r_b c_d``, far below the rounding
    of a sum whose plain form overflowed (a term of ``|L_bk R_kd| ~ max / k`` entered it).
    Finite entries of ``plain`` are kept as they are. One synchronisation on CuPy.
    """
    bad = ~xp.isfinite(plain)
    if not bool(xp.any(bad)):
        return plain
    rows = xp.frexp(xp.max(xp.abs(left), axis=1, keepdims=True))[1]     # (B, 1)
    columns = xp.frexp(xp.max(xp.abs(right), axis=0, keepdims=True))[1]  # (1, d)
    scaled = xp.ldexp(left, -rows) @ xp.ldexp(right, -columns)
    with np.errstate(over="ignore"):
        redone = xp.ldexp(scaled, rows + columns)
    return xp.where(bad, redone, plain)


def overflow_message(what: str, dtype_name: str, maxima: dict) -> str:
    """The ValueError text for a product ``what`` beyond ``dtype_name`` (the factors' maxima)."""
    shown = ", ".join(f"max |{name}| == {value:.3g}" for name, value in maxima.items())
    return f"{what} overflows {dtype_name} ({shown})"


def _product(xp, left, right, what: str, *, check: bool = True, **factors) -> Any:
    """``left @ right``: computed where only its intermediate sums overflow, a ValueError
    naming ``what`` (and the largest entry of each of ``factors``) where its value does.

    ``check=False`` (the fast path on CuPy with its data checks off) returns the plain
    product: both steps read the data (one synchronisation each).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        out = left @ right
        if not check:
            return out
        out = rescaled_product(xp, left, right, out)
    if not bool(xp.all(xp.isfinite(out))):
        maxima = {name: float(xp.max(xp.abs(value))) for name, value in factors.items()}
        raise ValueError(overflow_message(what, np.dtype(out.dtype).name, maxima))
    return out


def _lp_one(scores: np.ndarray) -> np.ndarray:
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix, hstack, identity, kron, vstack

    m, n = scores.shape
    # Variables: pi row-major (pi_ij at i * n + j), then z. Maximise <s, pi>.
    columns = hstack([coo_matrix(np.tile(np.eye(n), (1, m))), coo_matrix((n, m))])
    rows = hstack([kron(identity(m), np.ones((1, n))), -identity(m)])
    simplex = coo_matrix(np.concatenate([np.zeros(m * n), np.ones(m)])[None, :])
    a_eq = vstack([columns, rows, simplex]).tocsr()
    b_eq = np.concatenate([np.full(n, 1.0 / n), np.zeros(m), [1.0]])
    objective = np.concatenate([-scores.ravel(), np.zeros(m)])
    solution = linprog(objective, A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    if solution.status != 0:
        raise RuntimeError(f"linprog failed on (2.1): {solution.message}")
    return np.maximum(solution.x[: m * n], 0.0).reshape(m, n)


def histogram_lp(features, prototypes) -> HistogramResult:
    """Solve the histogram LP (2.1) per image with ``scipy.optimize.linprog`` (HiGHS).

    Returns a :class:`HistogramResult` with ``z`` (B, m), ``pi`` (B, m, n) and the
    optimal value. An oracle for :func:`histogram_closed_form`; ties between prototypes
    make the optimum non-unique (the objective is still unique).
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    # The argmax is invariant under positive scaling: HiGHS sees well-scaled scores.
    scaled, scale_f, scale_p = _scaled_scores(features, prototypes)
    pi = np.stack([_lp_one(s / common_scale(s)) for s in scaled])
    objective = _unscale(np.sum(scaled * pi, axis=(1, 2)), scale_f, scale_p, "the optimal value")
    return HistogramResult(z=pi.sum(axis=2), pi=pi, objective=objective)


def histogram_closed_form(features, prototypes) -> HistogramResult:
    """Claim 2.1: ``pi_ij = (1/n) 1[i = argmax_k nu_k^T x_j]``, ``z_i = sum_j pi_ij``.

    Ties go to the lowest prototype index (``numpy.argmax``), one optimal vertex.
    Piecewise constant, so it has no useful gradient; see :func:`histogram_entropic_forward`.
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    scaled, scale_f, scale_p = _scaled_scores(features, prototypes)
    batch, m, n = scaled.shape
    winner = np.argmax(scaled, axis=1)  # (B, n)
    pi = np.zeros((batch, m, n))
    np.put_along_axis(pi, winner[:, None, :], 1.0 / n, axis=1)
    objective = _unscale(np.sum(scaled * pi, axis=(1, 2)), scale_f, scale_p, "the optimal value")
    return HistogramResult(z=pi.sum(axis=2), pi=pi, objective=objective)


def _entropic_forward(features, prototypes, inverse_temperature):
    scaled, scale_f, scale_p = _scaled_scores(features, prototypes)
    logits = _unscale(inverse_temperature * scaled, scale_f, scale_p, "inverse_temperature * nu^T x")
    assignment = softmax(logits, axis=1)
    z = assignment.mean(axis=2)
    return z, HistogramEntropicContext(features, prototypes, assignment, inverse_temperature)


def _entropic_d_scores(xp, ctx: HistogramEntropicContext, d_z: Any) -> Any:
    """The gradient (B, m, n) of the scores ``s_ij = nu_i^T x_j`` from that of ``z``."""
    n = ctx.features.shape[1]
    a = ctx.assignment
    d_a = d_z[:, :, None] / n
    # softmax over i of ε s: d s_ij = ε a_ij (d a_ij - sum_k a_kj d a_kj)
    return ctx.inverse_temperature * a * (d_a - xp.sum(a * d_a, axis=1, keepdims=True))


def _entropic_backward(ctx: HistogramEntropicContext, d_z: np.ndarray) -> HistogramGrads:
    d_scores = _entropic_d_scores(np, ctx, d_z)
    d_features = np.einsum("bij,id->bjd", d_scores, ctx.prototypes)
    d_prototypes = np.einsum("bij,bjd->id", d_scores, ctx.features)
    return HistogramGrads(features=d_features, prototypes=d_prototypes)


def histogram_entropic_forward(
    features, prototypes, *, inverse_temperature
) -> tuple[np.ndarray, HistogramEntropicContext]:
    r"""Entropic histogram (2.4): ``z_i = (1/n) sum_j softmax_i(ε nu_i^T x_j)``; ``(z, ctx)``.

    .. math::
        \max_{z\in\mathcal S^m,\ \pi>0} \sum_{ij}\nu_i^\top x_j\pi_{ij}
            - \tfrac1\epsilon\sum_{ij}\pi_{ij}\log\pi_{ij}
        \quad\text{s.t.}\quad \sum_i\pi_{ij} = 1/n,\ \sum_j\pi_{ij} = z_i

    (constraint corrected from the printed ``sum_ij pi_ij = 1/n``, see the module
    docstring). Stationarity gives ``pi_ij = (1/n) softmax_i(ε s_.j)``.

    Parameters
    ----------
    features : array (B, n, d)
    prototypes : array (m, d)
    inverse_temperature : float > 0
        The paper's ε (varepsilon), multiplying the scores: larger is closer to the
        LP (2.1), towards 0 the histogram becomes uniform.

    Raises
    ------
    ValueError
        Also where ``inverse_temperature * nu_i^T x_j`` overflows float64.
    """
    features, prototypes = check_features_prototypes(features, prototypes)
    inverse_temperature = check_scalar(
        inverse_temperature, "inverse_temperature", low=0.0, low_inclusive=False
    )
    return _entropic_forward(features, prototypes, inverse_temperature)


def histogram_entropic_backward(ctx: HistogramEntropicContext, d_z) -> HistogramGrads:
    """Gradients ``.features`` (B, n, d) and ``.prototypes`` (m, d, summed over the batch).

    ``d_z`` must have the shape (B, m) of ``z``.
    """
    check_context(ctx, "ctx", HistogramEntropicContext)
    d_z = check_upstream(d_z, "d_z", ctx.assignment.shape[:2])
    return _entropic_backward(ctx, d_z)


def histogram_entropic(features, prototypes, *, inverse_temperature) -> np.ndarray:
    """The entropic histogram ``z`` (B, m) (no context kept)."""
    return histogram_entropic_forward(
        features, prototypes, inverse_temperature=inverse_temperature
    )[0]


def convex_combination_forward(z, prototypes) -> tuple[np.ndarray, ConvexCombinationContext]:
    """Eq. (2.3): ``y_hat[b] = sum_k z[b, k] nu_k``, shape (B, d); returns ``(y_hat, ctx)``.

    ``z`` is (B, m), usually a histogram; any real weights are accepted. A ``y_hat`` beyond
    float64 is a ValueError naming it (for a histogram ``z`` it never is: ``|y_hat| <= max
    |nu|``); one whose intermediate sums alone overflow is computed (module docstring).

    Parameters
    ----------
    z : float array (B, m)
        Weights of the prototypes for each sample, usually a histogram (any real weights).
    prototypes : float array (m, d)
        The prototypes ``nu_k``, one per row.
    """
    z = as_float_array(z, "z", ndim=2)
    prototypes = as_float_array(prototypes, "prototypes", ndim=2)
    return _convex_forward(np, z, prototypes)


def _convex_forward(
    xp, z, prototypes, *, check: bool = True
) -> tuple[Any, ConvexCombinationContext]:
    """The forward on checked 2-d arrays (any ``xp``, their dtype); ``check``: :func:`_product`."""
    if z.shape[1] != prototypes.shape[0]:
        raise ValueError(
            f"z has {z.shape[1]} weights per row but there are {prototypes.shape[0]} prototypes"
        )
    y_hat = _product(xp, z, prototypes, "y_hat = z @ prototypes", check=check, z=z,
                     prototypes=prototypes)
    return y_hat, ConvexCombinationContext(z, prototypes)


def _convex_backward(xp, ctx: ConvexCombinationContext, d_y, *,
                     check: bool = True) -> ConvexCombinationGrads:
    d_z = _product(xp, d_y, ctx.prototypes.T, "the gradient of z, d_y @ prototypes.T,",
                   check=check, d_y=d_y, prototypes=ctx.prototypes)
    d_prototypes = _product(xp, ctx.z.T, d_y, "the gradient of prototypes, z.T @ d_y,",
                            check=check, z=ctx.z, d_y=d_y)
    return ConvexCombinationGrads(z=d_z, prototypes=d_prototypes)


def convex_combination_backward(ctx: ConvexCombinationContext, d_y) -> ConvexCombinationGrads:
    """Gradients ``.z`` (B, m) and ``.prototypes`` (m, d); ``d_y`` has the shape (B, d) of ``y_hat``.

    A gradient beyond float64 is a ValueError naming it (as the forward's ``y_hat``).
    """
    check_context(ctx, "ctx", ConvexCombinationContext)
    d_y = check_upstream(d_y, "d_y", (ctx.z.shape[0], ctx.prototypes.shape[1]))
    return _convex_backward(np, ctx, d_y)


def convex_combination(z, prototypes) -> np.ndarray:
    """``sum_k z_k nu_k`` per row of ``z`` (no context kept)."""
    return convex_combination_forward(z, prototypes)[0]

