"""Wasserstein measure coresets (Proposition 1) and WCRAIG facility location (Eq. 6, Alg. 1).

Wasserstein DML (Dou, Luo & Yang, 2022), after Claici et al. (2020) and CRAIG
(Mirzasoleiman et al., 2020).

``wasserstein1``
    Exact ``W_1`` between two discrete measures, Euclidean ground cost, by the network
    simplex of POT (``ot.emd2``). Proposition 1: ``nu`` is an eps-coreset of ``mu`` for
    the 1-Lipschitz functions whenever ``W_1(mu, nu) <= eps``.
``kantorovich_rubinstein_gaps``
    ``|E_mu phi - E_nu phi|`` for a family of 1-Lipschitz ``phi``; by Kantorovich-
    Rubinstein duality every gap is at most ``W_1(mu, nu)``, with equality for the
    optimal potential. Random families: ``x -> <u, x>`` with ``|u| = 1`` and
    ``x -> min_k (c_k + |x - z_k|)`` (a min of 1-Lipschitz cones is 1-Lipschitz).
``facility_location_greedy`` / ``wcraig``
    Greedy maximisation of ``F(S) = sum_i max_{j in S} sim(i, j)`` (monotone submodular
    for ``sim >= 0``, ``F(empty) = 0``; greedy is within ``1 - 1/e`` of the optimum),
    lazily with a priority queue of stale marginal gains (Minoux 1978).

Printed vs implemented (Eq. 6): ``sim(i, j) = 1 / SD(i, j)`` is infinite on the diagonal
(``SD(i, i) = 0``), so every singleton already has ``F = inf``. Implemented:
``sim = 1 / (SD + delta)`` with ``delta > 0`` (default: 1e-2 times the mean off-diagonal
divergence), or CRAIG's own ``sim = max(SD) - SD`` (``similarity="max_minus"``).
Negative divergences (rounding, or the transport-cost variant) are clipped at 0.
Algorithm 1's loop condition ``F_w(S) < L({s_0}) - eps`` is garbled in print; we stop
after ``k`` picks, as CRAIG does for a budget ``k``.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from refdml._numerics import common_scale, pairwise_norm
from refdml._validation import (
    _describe,
    as_float_array,
    check_choice,
    check_rng,
    check_scalar,
)

__all__ = [
    "FacilityLocationResult",
    "kantorovich_rubinstein_gaps",
    "facility_location_greedy",
    "random_lipschitz_functions",
    "wasserstein1",
    "wcraig",
]


@dataclass(frozen=True)
class FacilityLocationResult:
    """Greedy facility location.

    indices : (k,) selected elements, in pick order.
    weights : (k,) number of elements each selected one serves (its most similar
        selected element; ties go to the earlier pick); sums to n. CRAIG's step sizes.
    objective : (k,) ``F(S)`` after each pick.
    assignment : (n,) position in ``indices`` of the element serving each element.
    n_evaluations : marginal-gain evaluations (lazy greedy needs far fewer than n k).
    """

    indices: np.ndarray
    weights: np.ndarray
    objective: np.ndarray
    assignment: np.ndarray
    n_evaluations: int


def _check_measure(x, a, name_x, name_a):
    x = as_float_array(x, name_x, ndim=(1, 2))
    if x.ndim == 1:
        x = x[:, None]
    if a is None:
        a = np.full(x.shape[0], 1.0 / x.shape[0])
    else:
        a = as_float_array(a, name_a, ndim=1)
        if a.shape[0] != x.shape[0]:
            raise ValueError(f"{name_a} has {a.shape[0]} entries but {name_x} has {x.shape[0]} points")
        if np.any(a < 0.0) or not np.any(a > 0.0):
            raise ValueError(
                f"{name_a} must be non-negative with a positive sum, got {name_a} with min "
                f"{a.min():.3g} and max {a.max():.3g}"
            )
        a = a / a.max()          # first: a sum of weights near 1e308 must not overflow
        a = a / a.sum()
    return x, a


def _euclidean_cost(x, y) -> np.ndarray:
    return pairwise_norm(x, y)


def wasserstein1(x, y, a=None, b=None) -> float:
    """Exact ``W_1(mu, nu)`` for ``mu = sum a_i delta_{x_i}``, ``nu = sum b_j delta_{y_j}``.

    x : (n, d) or (n,); y : (m, d) or (m,); a, b : non-negative weights (normalised),
    uniform when None. Euclidean ground cost; solved exactly by ``ot.emd2``.

    ``W_1`` is 1-homogeneous (``W_1(s mu, s nu) = s W_1(mu, nu)``): the points are divided
    by one power of two ``s`` (exact) before the cost is formed, and the result is
    multiplied back, so any finite input gives the right value (``ValueError`` if it
    exceeds the float64 range).
    """
    import ot

    x, a = _check_measure(x, a, "x", "a")
    y, b = _check_measure(y, b, "y", "b")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    scale = common_scale(x, y)
    scaled = float(ot.emd2(a, b, pairwise_norm(x / scale, y / scale), numItermax=1_000_000))
    with np.errstate(over="ignore"):
        value = scale * scaled
    if not np.isfinite(value):
        raise ValueError(
            f"W_1 of x and y (about {scaled:.3g} * {scale:.3g}) overflows float64; rescale the data"
        )
    return value


# The most entries of one array, and of one Python list (8-byte pointers).
_MAX_ENTRIES = sys.maxsize // 8


def random_lipschitz_functions(d: int, n_functions: int, *, rng=None, n_cones: int = 4,
                               scale: float = 1.0) -> list[Callable[[np.ndarray], np.ndarray]]:
    """Random 1-Lipschitz functions on R^d: half linear ``<u, x>`` (``|u| = 1``), half
    ``min_k (c_k + |x - z_k|)`` with ``z_k ~ N(0, scale^2 I)``, ``c_k ~ U(0, scale)``."""
    # Sizes beyond what an array (or a list of callables) can hold are refused here rather
    # than failing inside NumPy or running until memory is exhausted.
    d = check_scalar(d, "d", low=1, high=_MAX_ENTRIES, integer=True)
    n_functions = check_scalar(n_functions, "n_functions", low=1, high=_MAX_ENTRIES,
                               integer=True)
    n_cones = check_scalar(n_cones, "n_cones", low=1, high=_MAX_ENTRIES // d, integer=True)
    scale = check_scalar(scale, "scale", low=0.0, low_inclusive=False)
    rng = check_rng(rng)
    functions = []
    for k in range(n_functions):
        if k % 2 == 0:
            u = rng.standard_normal(d)
            u /= np.linalg.norm(u)
            functions.append(lambda x, u=u: x @ u)
        else:
            centres = scale * rng.standard_normal((n_cones, d))
            offsets = scale * rng.uniform(size=n_cones)
            functions.append(
                lambda x, z=centres, c=offsets: np.min(c[None, :] + _euclidean_cost(x, z), axis=1)
            )
    return functions


def kantorovich_rubinstein_gaps(x, y, a=None, b=None, *, functions: Sequence[Callable] | None = None,
                                n_functions: int = 64, rng=None) -> np.ndarray:
    """``|E_mu phi - E_nu phi|`` for each 1-Lipschitz ``phi``; each is ``<= W_1(mu, nu)``.

    ``functions``: a non-empty sequence of callables mapping (N, d) points to (N,) finite
    real values, promised 1-Lipschitz (a non-callable, or values of another shape, type or
    non-finite, is an error naming ``functions[i]``); default
    :func:`random_lipschitz_functions` (``n_functions`` of them, scaled to the data).
    The default family is drawn and evaluated on the points divided by one power of two
    ``s`` (exact), and the gaps multiplied back: ``s phi(x / s)`` is 1-Lipschitz whenever
    ``phi`` is, so the gaps are right at any finite scale (1e-300 .. 1e300).
    """
    x, a = _check_measure(x, a, "x", "a")
    y, b = _check_measure(y, b, "y", "b")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y must have the same dimension, got {x.shape} and {y.shape}")
    scale = 1.0
    if functions is None:
        scale = common_scale(x, y)
        x, y = x / scale, y / scale
        spread = float(np.std(np.concatenate([x, y]))) or 1.0
        functions = random_lipschitz_functions(x.shape[1], n_functions, rng=rng, scale=spread)
    else:
        functions = _check_functions(functions)
    gaps = []
    for index, phi in enumerate(functions):
        on_x = _function_values(phi, index, x, "x")
        on_y = _function_values(phi, index, y, "y")
        with np.errstate(over="ignore", invalid="ignore"):
            gaps.append(abs(float(a @ on_x - b @ on_y)))
    with np.errstate(over="ignore"):
        gaps = scale * np.array(gaps)
    if not np.all(np.isfinite(gaps)):
        raise ValueError(
            "a gap |E_mu phi - E_nu phi| is not finite: the functions overflow float64 on "
            "these points (or return NaN); rescale the data or the functions"
        )
    return gaps


def _check_functions(functions) -> list:
    """A non-empty sequence of callables (a single callable or a string is refused)."""
    if isinstance(functions, (str, bytes)) or callable(functions) or not isinstance(
        functions, Iterable
    ):
        raise TypeError(
            f"functions must be a sequence of callables (or None), got {_describe(functions)}"
        )
    functions = list(functions)
    if not functions:
        raise ValueError("functions must hold at least one callable, got an empty sequence")
    for index, phi in enumerate(functions):
        if not callable(phi):
            raise TypeError(
                f"functions[{index}] must be a callable mapping (N, d) points to (N,) values, "
                f"got {_describe(phi)}"
            )
    return functions


def _function_values(phi, index: int, points: np.ndarray, name: str) -> np.ndarray:
    """``phi(points)`` checked to be (N,) real values; non-finite values are named."""
    what = f"functions[{index}]({name})"
    values = as_float_array(phi(points), what, allow_empty=True, finite=False)
    if values.shape != (points.shape[0],):
        raise ValueError(
            f"{what} has shape {values.shape}, must be ({points.shape[0]},): one value per "
            f"point of {name} (shape {points.shape})"
        )
    if not np.all(np.isfinite(values)):
        bad = int(np.flatnonzero(~np.isfinite(values))[0])
        raise ValueError(
            f"{what} is {values[bad]} at point {bad}: a gap |E_mu phi - E_nu phi| needs finite "
            "values (the functions overflow float64 on these points, or return NaN; rescale "
            "the data or the functions)"
        )
    return values


def _gain(similarity: np.ndarray, best: np.ndarray, j: int) -> float:
    return float(np.maximum(similarity[:, j] - best, 0.0).sum())


def facility_location_greedy(similarity, k, *, lazy=True) -> FacilityLocationResult:
    """Greedy maximisation of ``F(S) = sum_i max_{j in S} similarity[i, j]`` over ``|S| = k``.

    ``similarity`` (n, n) non-negative (``F(empty) = 0``). Ties go to the smaller index;
    ``lazy=True`` (priority queue of upper bounds) returns exactly the plain greedy picks.
    """
    similarity = as_float_array(similarity, "similarity", ndim=2)
    n = similarity.shape[0]
    if similarity.shape[1] != n:
        raise ValueError(f"similarity must be square, got shape {similarity.shape}")
    if np.any(similarity < 0.0):
        raise ValueError("similarity must be non-negative (facility location needs F(empty) = 0)")
    k = check_scalar(k, "k", low=1, high=n, integer=True)
    _check_lazy(lazy)
    return _greedy_in_range(
        similarity, k, lazy,
        f"the objective F(S) = sum_i max_(j in S) similarity[i, j] overflows float64 "
        f"(similarity up to {similarity.max():.3g} over n == {n} elements); rescale "
        "similarity (the picks do not depend on its scale)",
    )


def _check_lazy(lazy) -> None:
    if not isinstance(lazy, (bool, np.bool_)):
        raise TypeError(f"lazy must be True or False, got {lazy!r}")


def _greedy_in_range(similarity: np.ndarray, k: int, lazy: bool,
                     overflow: str) -> FacilityLocationResult:
    """:func:`_greedy`, or ``ValueError(overflow)`` where the objective exceeds float64.

    Every gain is at most an objective ``F(S + j)``, so while the objective is finite no
    gain or sum overflows and the picks are exact; where it is not, the run is refused
    (its infinite gains would tie).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        result = _greedy(similarity, k, lazy)
    if not np.all(np.isfinite(result.objective)):
        raise ValueError(overflow)
    return result


def _greedy(similarity: np.ndarray, k: int, lazy: bool) -> FacilityLocationResult:
    """The greedy of :func:`facility_location_greedy` on valid (finite, non-negative) input."""
    n = similarity.shape[0]
    best = np.zeros(n)
    chosen: list[int] = []
    objective = np.empty(k)
    evaluations = 0
    if lazy:
        heap = [(-_gain(similarity, best, j), j) for j in range(n)]
        evaluations += n
        heapq.heapify(heap)
        for pick in range(k):
            while True:
                _, j = heapq.heappop(heap)
                gain = _gain(similarity, best, j)
                evaluations += 1
                # Stale bounds only shrink (submodularity): a fresh gain that still beats
                # the best remaining bound (ties by index) is the true argmax.
                if not heap or (-gain, j) <= heap[0]:
                    break
                heapq.heappush(heap, (-gain, j))
            chosen.append(j)
            np.maximum(best, similarity[:, j], out=best)
            objective[pick] = best.sum()
    else:
        available = np.ones(n, dtype=bool)
        for pick in range(k):
            # The same per-column sum as the lazy branch, so both see identical gains.
            gains = np.array([
                _gain(similarity, best, j) if available[j] else -np.inf for j in range(n)
            ])
            evaluations += int(available.sum())
            j = int(np.argmax(gains))
            available[j] = False
            chosen.append(j)
            np.maximum(best, similarity[:, j], out=best)
            objective[pick] = best.sum()
    indices = np.array(chosen, dtype=np.int64)
    assignment = np.argmax(similarity[:, indices], axis=1)
    weights = np.bincount(assignment, minlength=k).astype(np.int64)
    return FacilityLocationResult(indices, weights, objective, assignment, evaluations)


def wcraig(divergence, k, *, delta=None, similarity="reciprocal", lazy=True) -> FacilityLocationResult:
    """WCRAIG selection (Alg. 1 / Eq. 6) from a (B, B) Sinkhorn divergence matrix.

    ``divergence``: e.g. :func:`refdml.ot.pairwise_sinkhorn_divergence` of the images'
    feature clouds. ``similarity="reciprocal"``: ``1 / (max(SD, 0) + delta)``, ``delta``
    default 1e-2 times the mean off-diagonal divergence; ``"max_minus"``:
    ``max(SD) - SD`` (CRAIG). Returns indices, CRAIG weights and ``F`` after each pick.
    An objective ``F`` beyond float64 (``F >= 1 / delta`` with a zero diagonal, so a
    subnormal ``delta``, or divergences near 1e-310 with the default one) is a
    ``ValueError`` naming ``delta`` (or ``divergence`` when no delta was given).
    """
    divergence = as_float_array(divergence, "divergence", ndim=2)
    n = divergence.shape[0]
    if divergence.shape[1] != n:
        raise ValueError(f"divergence must be square, got shape {divergence.shape}")
    check_choice(similarity, "similarity", ("reciprocal", "max_minus"))
    k = check_scalar(k, "k", low=1, high=n, integer=True)
    _check_lazy(lazy)
    clipped = np.maximum(divergence, 0.0)
    if similarity == "max_minus":
        if delta is not None:
            raise ValueError("delta is only used with similarity='reciprocal'")
        return _greedy_in_range(
            clipped.max() - clipped, k, lazy,
            "the objective F(S) of the similarities max(SD) - SD (up to n max(SD), "
            f"n == {n}, max(SD) == {clipped.max():.3g}) overflows float64; rescale divergence "
            "(the picks do not depend on its scale)",
        )
    if delta is None:
        delta = _default_delta(clipped)
        overflow = (
            f"divergence is too small for similarity='reciprocal' with the default delta == "
            f"{delta!r} (1e-2 times the mean off-diagonal divergence): the objective F(S) of "
            "the similarities 1 / (max(SD, 0) + delta), up to n / delta, overflows float64; "
            "rescale divergence (the picks do not depend on its scale) or pass a larger delta"
        )
    else:
        delta = check_scalar(delta, "delta", low=0.0, low_inclusive=False)
        overflow = (
            f"delta == {delta!r} is too small: the objective F(S) of the similarities "
            "1 / (max(SD, 0) + delta), up to n / delta, overflows float64; delta must be at "
            f"least about {n / np.finfo(np.float64).max:.3g} (n / the largest float64)"
        )
    # SD + delta beyond float64 gives a similarity of 0 (it is below 1 / 1.8e308); one
    # beyond float64 (SD + delta below that) makes the objective infinite: refused.
    with np.errstate(over="ignore", divide="ignore"):
        sim = 1.0 / (clipped + delta)
    if not np.all(np.isfinite(sim)):
        raise ValueError(overflow)
    return _greedy_in_range(sim, k, lazy, overflow)


def _default_delta(clipped: np.ndarray) -> float:
    """1e-2 times the mean off-diagonal divergence (1.0 where that mean is 0)."""
    off = clipped[~np.eye(clipped.shape[0], dtype=bool)]
    if not off.size or not off.max() > 0.0:
        return 1.0
    with np.errstate(over="ignore"):
        mean = float(off.mean())
    if not np.isfinite(mean):
        # The sum of divergences near 1e308 overflows: average them relative to the largest.
        peak = float(off.max())
        mean = peak * float(np.mean(off / peak))
    delta = 1e-2 * mean
    if delta == 0.0:
        raise ValueError(
            f"divergence is too small for similarity='reciprocal': the default delta, 1e-2 "
            f"times its mean off-diagonal entry ({mean:.3g}), underflows float64; rescale "
            "divergence (the picks do not depend on its scale) or pass delta"
        )
    return delta
