"""What refdml.gpu.metrics shares with the reference :mod:`refdml.metrics`.

- ``check_k``: the validation of ``k`` (an int or a sequence of ints, each >= 1; sorted,
  duplicates dropped), so that the mirror accepts and refuses exactly what the reference
  does, with the reference's messages (``refdml.metrics._check_k``).

The ranking itself is not shared from here: both sides rank by the ordered score of the base
layer (:mod:`refdml._numerics`); the reference by its readable route only, the fast path
also by its compiled twins (:mod:`refdml.gpu.metrics._compiled`, ``_cuda``).
"""

from __future__ import annotations

from refdml.metrics import _check_k as check_k

__all__ = ["check_k"]
