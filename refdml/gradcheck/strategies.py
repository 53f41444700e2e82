"""Hypothesis strategies for well-conditioned operator inputs.

Every strategy draws bounded floats (so hypothesis can shrink a failure to a small,
readable example) and maps them to the set in question, staying a fixed distance away
from the boundaries where the operators are not differentiable or badly conditioned.
All arrays are float64. Importing this module needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

import numpy as np
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = [
    "labels",
    "points_in_unit_ball",
    "points_on_sphere",
    "simplex_vectors",
    "spd_matrices",
]


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, width=64)


@st.composite
def points_in_unit_ball(
    draw, n: int, d: int, *, min_radius: float = 0.05, max_radius: float = 0.95
) -> np.ndarray:
    """``n`` points of R^d with norms in ``[min_radius, max_radius]``, shape (n, d)."""
    raw = draw(hnp.arrays(np.float64, (n, d), elements=_floats(-1.0, 1.0)))
    radii = draw(hnp.arrays(np.float64, (n,), elements=_floats(min_radius, max_radius)))
    norms = np.linalg.norm(raw, axis=1)
    assume(np.all(norms > 1e-3))
    return raw / norms[:, None] * radii[:, None]


@st.composite
def points_on_sphere(draw, n: int, d: int, *, radius: float = 1.0) -> np.ndarray:
    """``n`` points on the sphere of the given radius in R^d, shape (n, d)."""
    raw = draw(hnp.arrays(np.float64, (n, d), elements=_floats(-1.0, 1.0)))
    norms = np.linalg.norm(raw, axis=1)
    assume(np.all(norms > 1e-2))
    return radius * raw / norms[:, None]


@st.composite
def simplex_vectors(draw, n: int, *, min_entry: float = 0.01, batch: int | None = None) -> np.ndarray:
    """Probability vectors of length ``n`` with every entry at least ``min_entry / n``.

    With ``batch`` given, returns ``batch`` such vectors as the rows of a 2-d array.
    """
    shape = (n,) if batch is None else (batch, n)
    raw = draw(hnp.arrays(np.float64, shape, elements=_floats(min_entry, 1.0)))
    return raw / raw.sum(axis=-1, keepdims=True)


@st.composite
def spd_matrices(draw, d: int, *, max_condition: float = 1e3) -> np.ndarray:
    """Symmetric positive definite ``d x d`` matrices with condition number <= ``max_condition``.

    Built as ``Q diag(lam) Q^T`` with ``Q`` orthogonal (from a QR factorisation of a
    drawn matrix) and eigenvalues drawn on a log scale in ``[1, max_condition]``.
    """
    raw = draw(hnp.arrays(np.float64, (d, d), elements=_floats(-1.0, 1.0)))
    raw = raw + 2.0 * np.eye(d)  # keeps the QR well defined for every draw
    q, _ = np.linalg.qr(raw)
    log_eigs = draw(
        hnp.arrays(np.float64, (d,), elements=_floats(0.0, float(np.log10(max_condition))))
    )
    matrix = (q * 10.0**log_eigs) @ q.T
    return 0.5 * (matrix + matrix.T)


@st.composite
def labels(draw, n_classes: int, samples_per_class: int | tuple[int, int]) -> np.ndarray:
    """A shuffled label vector with ``n_classes`` classes.

    ``samples_per_class`` is either a fixed count or a ``(low, high)`` range drawn per
    class. Labels are ``0 .. n_classes-1``.
    """
    if isinstance(samples_per_class, tuple):
        counts = [draw(st.integers(*samples_per_class)) for _ in range(n_classes)]
    else:
        counts = [samples_per_class] * n_classes
    ordered = np.repeat(np.arange(n_classes), counts)
    order = draw(st.permutations(range(ordered.size)))
    return ordered[np.asarray(order, dtype=np.int64)]
