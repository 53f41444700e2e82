"""Hypothesis strategies for well-conditioned operator inputs.

Every strategy draws bounded floats (so hypothesis can shrink a failure to a small,
readable example) and maps them to the set in question, staying a fixed distance away
from the boundaries where the operators are not differentiable or badly conditioned.
All arrays are float64. ``hypothesis`` is a core dependency of refdml.

The arguments are checked when the strategy is built, not when it is drawn from:
``TypeError`` for a size that is not an integer (NumPy integers such as ``np.int64(3)``
are accepted), ``ValueError`` naming the parameter for a size below 1, a radius or
entry bound that is negative, NaN or infinite, or a condition number below 1.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml._validation import check_scalar

__all__ = [
    "labels",
    "points_in_unit_ball",
    "points_on_sphere",
    "simplex_vectors",
    "spd_matrices",
]


def _size(value: Any, name: str) -> int:
    return int(check_scalar(value, name, low=1, integer=True))


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, width=64)


def points_in_unit_ball(
    n: int, d: int, *, min_radius: float = 0.05, max_radius: float = 0.95
) -> st.SearchStrategy[np.ndarray]:
    """``n`` points of R^d with norms in ``[min_radius, max_radius]``, shape (n, d).

    Needs ``n, d >= 1`` and ``0 <= min_radius <= max_radius <= 1``.
    """
    n, d = _size(n, "n"), _size(d, "d")
    min_radius = float(check_scalar(min_radius, "min_radius", low=0.0, high=1.0))
    max_radius = float(check_scalar(max_radius, "max_radius", low=0.0, high=1.0))
    if min_radius > max_radius:
        raise ValueError(
            f"min_radius == {min_radius!r} exceeds max_radius == {max_radius!r}"
        )
    return _points_in_unit_ball(n, d, min_radius, max_radius)


@st.composite
def _points_in_unit_ball(draw, n, d, min_radius, max_radius):
    raw = draw(hnp.arrays(np.float64, (n, d), elements=_floats(-1.0, 1.0)))
    radii = draw(hnp.arrays(np.float64, (n,), elements=_floats(min_radius, max_radius)))
    norms = np.linalg.norm(raw, axis=1)
    assume(np.all(norms > 1e-3))
    return raw / norms[:, None] * radii[:, None]


def points_on_sphere(n: int, d: int, *, radius: float = 1.0) -> st.SearchStrategy[np.ndarray]:
    """``n`` points on the sphere of the given radius (finite, > 0) in R^d, shape (n, d)."""
    n, d = _size(n, "n"), _size(d, "d")
    radius = float(check_scalar(radius, "radius", low=0.0, low_inclusive=False))
    return _points_on_sphere(n, d, radius)


@st.composite
def _points_on_sphere(draw, n, d, radius):
    raw = draw(hnp.arrays(np.float64, (n, d), elements=_floats(-1.0, 1.0)))
    norms = np.linalg.norm(raw, axis=1)
    assume(np.all(norms > 1e-2))
    return radius * raw / norms[:, None]


def simplex_vectors(
    n: int, *, min_entry: float = 0.01, batch: int | None = None
) -> st.SearchStrategy[np.ndarray]:
    """Probability vectors of length ``n`` with every entry at least ``min_entry / n``.

    ``min_entry`` must be in ``(0, 1]``. With ``batch`` (>= 1) given, returns ``batch``
    such vectors as the rows of a 2-d array.
    """
    n = _size(n, "n")
    min_entry = float(
        check_scalar(min_entry, "min_entry", low=0.0, high=1.0, low_inclusive=False)
    )
    shape = (n,) if batch is None else (_size(batch, "batch"), n)
    return _simplex_vectors(shape, min_entry)


@st.composite
def _simplex_vectors(draw, shape, min_entry):
    raw = draw(hnp.arrays(np.float64, shape, elements=_floats(min_entry, 1.0)))
    return raw / raw.sum(axis=-1, keepdims=True)


def spd_matrices(d: int, *, max_condition: float = 1e3) -> st.SearchStrategy[np.ndarray]:
    """Symmetric positive definite ``d x d`` matrices with condition number <= ``max_condition``.

    Built as ``Q diag(lam) Q^T`` with ``Q`` orthogonal (from a QR factorisation of a
    drawn matrix) and eigenvalues drawn on a log scale in ``[1, max_condition]``;
    ``max_condition`` must be finite and >= 1.
    """
    d = _size(d, "d")
    max_condition = float(check_scalar(max_condition, "max_condition", low=1.0))
    return _spd_matrices(d, max_condition)


@st.composite
def _spd_matrices(draw, d, max_condition):
    raw = draw(hnp.arrays(np.float64, (d, d), elements=_floats(-1.0, 1.0)))
    raw = raw + 2.0 * np.eye(d)  # keeps the QR well defined for every draw
    q, _ = np.linalg.qr(raw)
    log_eigs = draw(
        hnp.arrays(np.float64, (d,), elements=_floats(0.0, float(np.log10(max_condition))))
    )
    matrix = (q * 10.0**log_eigs) @ q.T
    return 0.5 * (matrix + matrix.T)


def labels(
    n_classes: int, samples_per_class: int | tuple[int, int]
) -> st.SearchStrategy[np.ndarray]:
    """A shuffled label vector with ``n_classes`` (>= 1) classes, labels ``0 .. n_classes-1``.

    ``samples_per_class`` is either a fixed count (>= 1) or a ``(low, high)`` range,
    ``1 <= low <= high``, drawn per class.
    """
    n_classes = _size(n_classes, "n_classes")
    if isinstance(samples_per_class, tuple):
        if len(samples_per_class) != 2:
            raise ValueError(
                f"samples_per_class == {samples_per_class!r}, must be a count or a "
                "(low, high) pair"
            )
        low = _size(samples_per_class[0], "samples_per_class[0]")
        high = _size(samples_per_class[1], "samples_per_class[1]")
        if low > high:
            raise ValueError(f"samples_per_class == {samples_per_class!r}: low exceeds high")
        counts = (low, high)
    elif isinstance(samples_per_class, numbers.Integral) and not isinstance(
        samples_per_class, bool
    ):
        count = _size(samples_per_class, "samples_per_class")
        counts = (count, count)
    else:
        raise TypeError(
            "samples_per_class must be an integer or a (low, high) tuple of integers, "
            f"got {samples_per_class!r}"
        )
    return _labels(n_classes, counts)


@st.composite
def _labels(draw, n_classes, counts):
    low, high = counts
    per_class = [draw(st.integers(low, high)) for _ in range(n_classes)]
    ordered = np.repeat(np.arange(n_classes), per_class)
    order = draw(st.permutations(range(ordered.size)))
    return ordered[np.asarray(order, dtype=np.int64)]
