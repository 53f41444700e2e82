"""The one import point of Numba's CPU compiler for refdml's kernels: ``njit`` and ``prange``.

Every ``_compiled`` module of a family (and :mod:`refdml.gpu._support.scalar`) takes them
from here, so the compile notice (:mod:`refdml.gpu._support.notice`: a line on stderr while
one of refdml's kernels compiles for long) listens before the first of them compiles,
however the module was reached. Importing this module imports Numba.
"""

from __future__ import annotations

from numba import njit, prange

from refdml.gpu._support import notice

__all__ = ["njit", "prange"]

notice.install()
