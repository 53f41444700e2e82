r"""The masked row-wise log-sum-exp and its softmax, compiled: the scalar maths, the CPU twin
and the launch's buffers.

The CUDA kernel is its twin in :mod:`refdml.gpu.losses._cuda`; the family's one
``Implementations`` object (:data:`refdml.gpu.losses.IMPLEMENTATIONS`: ``CpuPath`` and
``CudaPath`` in ``_kernels.py``) runs either, or the array path (``ArrayPath`` in
``_array.py``), which stays the fallback and the twin these kernels are tested against.
Both kernels take the six buffers of :class:`MaskedLseBuffers`, in its field order. For each row ``r`` of ``z`` (rows, k) with mask ``M`` (rows, k)
(``has_mask`` false: every entry):

.. math::
    \mathrm{lse}_r = \log\Big([\text{extra\_zero}] + \sum_{j: M_{rj}} e^{z_{rj}}\Big),\qquad
    w_{rj} = [M_{rj}]\, e^{z_{rj} - \mathrm{lse}_r}

in two passes over the row: the online log-sum-exp of :mod:`refdml.gpu._support.scalar`
(``lse_push``; ``extra_zero`` pushes one more term 0), then the weights
``exp(z - m) / s`` from its state ``(m, s)``. An empty row gives ``-inf`` (``0`` with
``extra_zero``) and zero weights; entries outside the mask are never read into the result
(NaN there is harmless).

Launch shape (CUDA): one block of :data:`BLOCK` threads per row; threads stride over the
row, their states merged by a tree in shared memory (``lse_merge``). CPU twin: ``prange``
over rows.

dtype: ``z`` float32 or float64 in, the same out; the state and the exponentials in float64
(the sum of a float32 row cannot lose its small terms), results rounded once to the dtype.
Parity with the array path: 1e-12 (float64), 1e-6 (float32), relative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from refdml.gpu._support.jit import njit, prange

from refdml.gpu._support.scalar import lse_push, lse_value

__all__ = ["MaskedLseBuffers", "masked_lse_cpu", "softmax_weight"]


@dataclass(frozen=True)
class MaskedLseBuffers:
    """The arguments of one launch of ``masked_lse_cpu`` / ``refdml_loss_masked_lse``, by name
    (the field order is the kernels' parameter order; a test holds it to the CUDA registry's
    ``parameters``). Arrays of one module (NumPy, or CuPy for the CUDA kernel), C-contiguous."""

    z: Any             # (rows, k) float32 or float64: the logits, one row per reduction
    mask: Any          # (rows, k) bool; a (1, 1) placeholder, never read, without a mask
    has_mask: bool     # False: every entry of z counts
    extra_zero: bool   # one more logit 0 per row (its weight is not written)
    lse: Any           # (rows,) of z's dtype, written: the log-sum-exp of each row
    weights: Any       # (rows, k) of z's dtype, written: the masked softmax

    def args(self) -> tuple:
        """The buffers in the kernels' parameter order (no copy, unlike ``astuple``)."""
        return tuple(getattr(self, field.name) for field in fields(self))


@njit(cache=True, inline="always")
def softmax_weight(x, m, s):
    """The softmax weight ``exp(x - m) / s`` of a term in the state ``(m, s)``."""
    return math.exp(x - m) / s


@njit(parallel=True, cache=True)
def masked_lse_cpu(z, mask, has_mask, extra_zero, lse, weights):
    """``refdml_loss_masked_lse`` CPU twin: ``lse`` (rows,) and ``weights`` (rows, k)."""
    rows, k = z.shape
    for r in prange(rows):
        m, s = -math.inf, 0.0
        for j in range(k):
            if not has_mask or mask[r, j]:
                m, s = lse_push(m, s, z[r, j])
        if extra_zero:
            m, s = lse_push(m, s, 0.0)
        lse[r] = lse_value(m, s)
        for j in range(k):
            if s > 0.0 and (not has_mask or mask[r, j]):
                weights[r, j] = softmax_weight(z[r, j], m, s)
            else:
                weights[r, j] = 0.0
