"""A float64 that rounds as a GPU's FMA contraction does: the tests' model of ptxas.

On NVIDIA GPUs a product followed by an addition or a subtraction is usually executed as
one fused multiply-add: ptxas contracts PTX ``mul``/``add``/``sub`` that carry no rounding
suffix (what NVVM emits for Numba's ``a * b - c`` without fastmath) into ``fma``, which
rounds once. The CPU (LLVM without fast-math flags) rounds the product and the sum apart.
Seen on refdml's kernels (docs/gpu/hardware-failures.md, "The six hardware-only failures"):
a kernel's ``d_z_i / mu - d_z_top / mu`` became ``fma(d_z_i, 1/mu, -round(d_z_top / mu))``,
which at ``i = top`` is the product's rounding error instead of 0, and ε = 1e300 multiplied
it.

:class:`Contracting` carries a product unrounded until its next use: if that use adds or
subtracts it, the result is rounded once from the exact value (``Fraction`` arithmetic,
correctly rounded back to float); any other use (a store into a float array, a comparison,
``math.exp``, a further product) rounds it first. Hand object arrays of them to the Python
source of a kernel (a Numba function's ``.py_func``) to see whether its results depend on
contraction. Where both operands of a sum are products, the left one is fused (ptxas may
pick either; the tests below need only that one is).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

__all__ = ["Contracting", "contracting", "rounded"]


def _finite(*values: float) -> bool:
    return all(math.isfinite(v) for v in values)


def _round(exact: Fraction) -> float:
    """``exact`` rounded to float64 (to nearest, ties to even; beyond the range: inf)."""
    try:
        return float(exact)
    except OverflowError:
        return math.inf if exact > 0 else -math.inf


class Contracting:
    """A float64 ``value``; ``factors = (a, b)`` when it is the product ``a * b`` not yet
    rounded (``value`` is then ``a * b`` rounded, what every non-fusing use sees)."""

    __slots__ = ("factors", "value")

    def __init__(self, value: float, factors: tuple[float, float] | None = None) -> None:
        self.value = float(value)
        self.factors = factors

    # -- uses that round --------------------------------------------------------------
    def __float__(self) -> float:
        return self.value

    def __index__(self):                      # never an index: keeps misuse loud
        raise TypeError("a Contracting float is not an index")

    def __repr__(self) -> str:
        return f"Contracting({self.value!r}{', product' if self.factors else ''})"

    def __neg__(self) -> Contracting:
        if self.factors is None:
            return Contracting(-self.value)
        a, b = self.factors
        return Contracting(-self.value, (-a, b))

    def __abs__(self) -> Contracting:
        return Contracting(abs(self.value))

    def __mul__(self, other) -> Contracting:
        a, b = self.value, float(other)
        return Contracting(a * b, (a, b))

    __rmul__ = __mul__

    def __truediv__(self, other) -> Contracting:
        return Contracting(self.value / float(other))

    def __rtruediv__(self, other) -> Contracting:
        return Contracting(float(other) / self.value)

    # comparisons see the rounded value
    def __lt__(self, other) -> bool:
        return self.value < float(other)

    def __le__(self, other) -> bool:
        return self.value <= float(other)

    def __gt__(self, other) -> bool:
        return self.value > float(other)

    def __ge__(self, other) -> bool:
        return self.value >= float(other)

    def __eq__(self, other) -> bool:
        return self.value == float(other)

    def __ne__(self, other) -> bool:
        return self.value != float(other)

    __hash__ = None

    # -- uses that fuse ---------------------------------------------------------------
    def _sum(self, other, sign: int) -> Contracting:
        """``self + sign * other`` (``sign`` is 1 or -1, an int: a float times a
        ``Fraction`` is a float, which would round), fusing whichever operand is an
        unrounded product."""
        other_factors = getattr(other, "factors", None)
        other_value = float(other)
        if self.factors is not None and _finite(*self.factors, other_value):
            a, b = self.factors
            return Contracting(_round(Fraction(a) * Fraction(b) + sign * Fraction(other_value)))
        if other_factors is not None and _finite(*other_factors, self.value):
            a, b = other_factors
            return Contracting(_round(Fraction(self.value) + sign * Fraction(a) * Fraction(b)))
        return Contracting(self.value + sign * other_value)

    def __add__(self, other) -> Contracting:
        return self._sum(other, 1)

    def __radd__(self, other) -> Contracting:
        return Contracting(other)._sum(self, 1)

    def __sub__(self, other) -> Contracting:
        return self._sum(other, -1)

    def __rsub__(self, other) -> Contracting:
        return Contracting(other)._sum(self, -1)


def contracting(array) -> np.ndarray:
    """An object array of :class:`Contracting` with ``array``'s values and shape."""
    values = np.asarray(array, dtype=np.float64)
    out = np.empty(values.shape, dtype=object)
    for index in np.ndindex(values.shape):
        out[index] = Contracting(values[index])
    return out


def rounded(array) -> np.ndarray:
    """A float64 array from an object array of :class:`Contracting` (or floats)."""
    return np.vectorize(float, otypes=[np.float64])(array)
