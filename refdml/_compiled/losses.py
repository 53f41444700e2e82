r"""The masked row-wise log-sum-exp and its softmax, compiled: the scalar maths and the CPU twin.

The CUDA kernel is its twin in :mod:`refdml._compiled.losses_cuda`; refdml.gpu's masked
log-sum-exp (``refdml/gpu/_loss_kernels.py``) runs either, or its array code, which stays
the fallback and the twin these kernels are tested against. For each row ``r`` of ``z`` (rows, k) with
mask ``M`` (rows, k) (``None``: every entry):

.. math::
    \mathrm{lse}_r = \log\Big([\text{extra\_zero}] + \sum_{j: M_{rj}} e^{z_{rj}}\Big),\qquad
    w_{rj} = [M_{rj}]\, e^{z_{rj} - \mathrm{lse}_r}

in two passes over the row: the online log-sum-exp of :mod:`refdml._compiled._scalar`
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

from numba import njit, prange

from refdml._compiled._scalar import lse_push, lse_value

__all__ = ["masked_lse_cpu", "softmax_weight"]


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
