"""What the fast path shares with :mod:`refdml.prototypes` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.prototypes` fits the ridge prototypes (XML Eq. 2.8 / GSP (P3)) on the
same exact power-of-two rescaling as the reference, keeps the fit in the reference's
context class and refuses the same systems:

- ``DEFINITE``: the factor of the reference's definiteness test (a system whose condition
  number exceeds ``1 / (DEFINITE * n * eps)`` is numerically singular).
- ``NormalisedFit``: the fit of the rescaled inputs, the context both paths keep.
- ``scaling_for(Z, Y, ridge)``: the exact rescaling of ``(Z, Y, ridge)`` (the reference's
  ``Scaling``: powers of two of ``Z`` and ``Y``, the scaled ridge), from ``max|Z|`` and
  ``max|Y|``.
"""

from __future__ import annotations

from refdml.prototypes._ridge import (
    _DEFINITE as DEFINITE,
    NormalisedFit,
    scaling_for,
)

__all__ = ["DEFINITE", "NormalisedFit", "scaling_for"]
