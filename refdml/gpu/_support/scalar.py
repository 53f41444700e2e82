"""Scalar maths shared by every Numba kernel of refdml: one source of truth.

These are plain ``numba.njit`` functions. The ``@cuda.jit`` kernels call them as device
functions and the ``@njit(parallel=True)`` CPU twins call them as ordinary compiled
functions, so a CUDA kernel and its CPU twin cannot disagree on the maths. Keep each one
scalar (no arrays), branch-light and free of allocation, so that it compiles for both
targets.

Online log-sum-exp. A running state ``(m, s)`` stands for ``m + log(s)``: ``m`` is the
largest term seen so far and ``s = sum_j exp(x_j - m)``, so ``1 <= s <= count`` and
nothing overflows. The empty state is ``(-inf, 0)`` and its value is ``-inf``.

>>> m, s = LSE_EMPTY
>>> for x in (1000.0, 1000.0):
...     m, s = lse_push(m, s, x)
>>> round(lse_value(m, s) - 1000.0, 12) == round(math.log(2.0), 12)
True
"""

from __future__ import annotations

import math

from refdml.gpu._support.jit import njit

__all__ = [
    "LSE_EMPTY",
    "log_sigmoid",
    "lse_merge",
    "lse_push",
    "lse_push_weighted",
    "lse_value",
    "softplus",
]

#: The state of an empty online log-sum-exp: ``(m, s) = (-inf, 0)``.
LSE_EMPTY = (-math.inf, 0.0)


@njit(cache=True, inline="always")
def lse_push(m, s, x):
    """Add the term ``exp(x)`` to the state ``(m, s)``; ``x = -inf`` adds nothing."""
    if x == -math.inf:
        return m, s
    if x <= m:
        return m, s + math.exp(x - m)
    return x, s * math.exp(m - x) + 1.0


@njit(cache=True, inline="always")
def lse_push_weighted(m, s, x, w):
    """Add ``w * exp(x)`` (``w >= 0``) to the state ``(m, s)``; ``w = 0`` adds nothing."""
    if w <= 0.0 or x == -math.inf:
        return m, s
    if x <= m:
        return m, s + w * math.exp(x - m)
    return x, s * math.exp(m - x) + w


@njit(cache=True, inline="always")
def lse_merge(m1, s1, m2, s2):
    """The state of the union of two states (for tree reductions across threads)."""
    if s2 == 0.0:
        return m1, s1
    if s1 == 0.0:
        return m2, s2
    if m1 >= m2:
        return m1, s1 + s2 * math.exp(m2 - m1)
    return m2, s2 + s1 * math.exp(m1 - m2)


@njit(cache=True, inline="always")
def lse_value(m, s):
    """``log(sum exp)`` of a state: ``m + log(s)``, ``-inf`` when empty."""
    if s <= 0.0:
        return -math.inf
    return m + math.log(s)


@njit(cache=True, inline="always")
def softplus(x):
    """``log(1 + exp(x))`` without overflow for large ``x`` or loss of digits for small."""
    if x > 0.0:
        return x + math.log1p(math.exp(-x))
    return math.log1p(math.exp(x))


@njit(cache=True, inline="always")
def log_sigmoid(x):
    """``log(1 / (1 + exp(-x))) = -softplus(-x)``."""
    return -softplus(-x)
