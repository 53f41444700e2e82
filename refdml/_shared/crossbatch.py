"""What the fast path shares with :mod:`refdml.crossbatch` (internal; see :mod:`refdml._shared`).

- ``draw_split(labels, rng)``: the reference's draw of two class-disjoint halves of a
  batch from ``rng`` (NumPy labels, on the host), so that one seed gives one split on
  either path.

(``DEFAULT_ZERO_SHOT_SCALE`` is public: :mod:`refdml.gpu.crossbatch` imports it from
:mod:`refdml.crossbatch`.)
"""

from __future__ import annotations

from refdml.crossbatch._split import draw_split

__all__ = ["draw_split"]
