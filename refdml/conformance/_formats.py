"""The floating-point formats a conformance check runs in, and rounding to them in NumPy.

A check runs the implementation in one of :data:`DTYPES` and the float64 reference on the
same numbers: the inputs (and the cotangents) rounded to the format first. NumPy has
float16, float32 and float64 but no bfloat16, so this module describes each format by its
significand and exponent range (IEEE 754 binary16/32/64 and Google's brain float, which is
binary32 with its significand cut to 8 bits) and rounds float64 to any of them itself:
round to nearest, ties to even, with gradual underflow and overflow to infinity, as a
hardware cast does. The rounded values are float64 numbers that the format holds exactly,
so a framework receives them without a second rounding (float32 carries every bfloat16
value exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DTYPES", "FORMATS", "FloatFormat", "NUMPY_DTYPES", "unsupported"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: ``precision`` significand bits (the implicit one
    included) and normal numbers from ``2**min_exponent`` to just under
    ``2**(max_exponent + 1)``."""

    name: str
    precision: int
    min_exponent: int
    max_exponent: int

    @property
    def eps(self) -> float:
        """The spacing of the format's numbers at 1 (``np.finfo(dtype).eps``): twice the
        unit roundoff of round-to-nearest."""
        return 2.0 ** (1 - self.precision)

    @property
    def max(self) -> float:
        """The largest finite number, ``(2 - eps) * 2**max_exponent``."""
        return (2.0 - self.eps) * 2.0 ** self.max_exponent

    @property
    def tiny(self) -> float:
        """The smallest positive normal number."""
        return 2.0 ** self.min_exponent

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (self.min_exponent + 1 - self.precision)

    def round(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float64) rounded to the nearest number of this format, ties to
        even; beyond :attr:`max` (by at least half a unit in the last place) to a signed
        infinity, below the subnormals to a signed zero. NaN and infinities pass through.
        Returned as float64."""
        values = np.asarray(values, dtype=np.float64)
        _, exponent = np.frexp(values)  # values = m * 2**exponent, 1/2 <= |m| < 1
        # The unit in the last place is 2**(exponent - precision) for normal numbers and
        # that of the smallest normal (2**min_exponent = 2**-1 * 2**(min_exponent + 1))
        # below them: gradual underflow.
        exponent = np.maximum(exponent, self.min_exponent + 1)
        with np.errstate(over="ignore", invalid="ignore"):
            # Scaling by a power of two is exact; np.rint rounds half to even.
            units = np.rint(np.ldexp(values, self.precision - exponent))
            rounded = np.ldexp(units, exponent - self.precision)
            return np.where(np.abs(rounded) > self.max, np.copysign(np.inf, values), rounded)


FORMATS = {
    "float64": FloatFormat("float64", 53, -1022, 1023),
    "float32": FloatFormat("float32", 24, -126, 127),
    "float16": FloatFormat("float16", 11, -14, 15),
    # The exponent range of float32 with 8 significand bits.
    "bfloat16": FloatFormat("bfloat16", 8, -126, 127),
}

#: The dtypes a conformance check runs an implementation in.
DTYPES = ("float64", "float32", "float16", "bfloat16")

#: The dtypes NumPy (and CuPy, which follows it) have.
NUMPY_DTYPES = ("float64", "float32", "float16")

#: The frameworks that have each dtype; a dtype not listed is in every framework.
_ONLY_IN = {"bfloat16": ("torch", "jax")}


def unsupported(framework: str, dtype: str) -> str | None:
    """Why ``framework`` cannot run an implementation in ``dtype`` (None if it can)."""
    frameworks = _ONLY_IN.get(dtype)
    if frameworks is None or framework in frameworks:
        return None
    library = {"numpy": "NumPy", "cupy": "CuPy"}.get(framework, framework)
    return (f"dtype == {dtype!r} needs framework 'torch' or 'jax': {library} has no "
            f"{dtype} (check a torch or JAX implementation in {dtype}, or this one in "
            "float16, float32 or float64)")
