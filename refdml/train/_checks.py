"""Input and upstream checks shared by the training pairs (NumPy or CuPy, float32/float64).

Thin wrappers over the fast path's checks (:mod:`refdml.gpu._validation`,
:mod:`refdml.gpu._fast_checks`), so the wording is the reference's: the pairs keep the
input's array module and dtype (several inputs: float32 only when all are float32).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from refdml._xp import ArrayNamespace, array_namespace
from refdml.gpu._fast_checks import check_fast_upstream
from refdml.gpu._validation import as_fast_array, result_dtype

__all__ = ["as_inputs", "check_upstream_like"]


def as_inputs(
    spec: dict[str, tuple[Any, int | tuple[int, ...] | None]],
) -> tuple[ArrayNamespace, np.dtype, dict[str, Any]]:
    """Check named inputs ``{name: (value, ndim)}``; return namespace, common dtype, arrays."""
    values = [v for v, _ in spec.values()]
    ns = array_namespace(*values)
    dtype = result_dtype(*[v for v in values if hasattr(v, "dtype")])
    arrays = {
        name: as_fast_array(value, name, ndim=ndim, dtype=dtype, ns=ns)
        for name, (value, ndim) in spec.items()
    }
    return ns, dtype, arrays


def check_upstream_like(d_y: Any, name: str, shape: tuple[int, ...], like: Any) -> Any:
    """``d_y`` real, finite, exactly ``shape``; returned in the dtype and module of ``like``.

    ``like`` is any array of the context (it tells the device and the dtype).
    """
    ns = array_namespace(like)
    return check_fast_upstream(d_y, name, tuple(shape), ns, like.dtype)
