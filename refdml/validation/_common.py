"""Small helpers shared by the claim modules."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

__all__ = ["arrays", "floats", "rel_err", "ridge_lstsq", "jsonable_arrays"]


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, width=64)


def arrays(shape, low: float = -1.0, high: float = 1.0) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.float64, shape, elements=floats(low, high))


def rel_err(a, b, floor: float = 1e-6) -> float:
    """``||a - b|| / max(||b||, floor)`` in the Frobenius norm.

    The floor keeps a reference that is zero up to rounding (a shrunk counterexample
    with entries like 1e-17, which lstsq may return as 0) from turning rounding noise
    into a huge relative error; the data of every check are of order 1.
    """
    a, b = np.asarray(a, float), np.asarray(b, float)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor))


def ridge_lstsq(blocks, ridge: float) -> np.ndarray:
    """``argmin_V sum_k w_k ||Z_k V - Y_k||^2 + ridge ||V||^2`` by ``numpy.linalg.lstsq``.

    ``blocks`` is a list of ``(w_k, Z_k (b_k, m), Y_k (b_k, d))``; the stacked system is
    ``[sqrt(w_k) Z_k; sqrt(ridge) I] V = [sqrt(w_k) Y_k; 0]``. Independent of the normal
    equations the papers print. ``ridge`` is XML's beta of (2.5) and its ε of (2.8)-(2.9),
    named as in ``refdml.prototypes``.
    """
    m = blocks[0][1].shape[1]
    d = blocks[0][2].shape[1]
    lhs = [np.sqrt(w) * Z for w, Z, _ in blocks] + [np.sqrt(ridge) * np.eye(m)]
    rhs = [np.sqrt(w) * Y for w, _, Y in blocks] + [np.zeros((m, d))]
    return np.linalg.lstsq(np.vstack(lhs), np.vstack(rhs), rcond=None)[0]


def jsonable_arrays(**values) -> dict:
    """Arrays to nested lists (for counterexamples in the JSON)."""
    return {k: (np.asarray(v).tolist() if isinstance(v, np.ndarray) else v) for k, v in values.items()}
