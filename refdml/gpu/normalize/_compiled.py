"""L2 normalisation by rows, compiled: the row maths shared by the CPU twins and the CUDA
kernels, and the twins.

The reference's maths (:mod:`refdml.normalize`): each row ``u`` is divided by the power of
two ``s = 2^(e - 1)``, where ``max|u| = m 2^e`` with ``m`` in ``[1/2, 1)`` (``1/2`` for a
zero row), then

.. math::
    y = \\frac{u / s}{\\max(\\lVert u / s \\rVert, 1)}, \\qquad
    \\bar u = \\frac{\\bar y - y \\langle y, \\bar y \\rangle}{\\lVert u / s \\rVert \\, s}.

The array code makes that nine passes forward and five backward (absolute value, maximum,
``frexp``, ``ldexp``, two divisions, a batched product, a square root, a maximum); one row's
loop here makes it in one pass over the launch: the maximum, then the scaled entries and
their sum of squares, then the division (forward), the dot product then the update
(backward).

Rounding, and why it matches the reference: every quantity the reference rounds to the
array's dtype is rounded to it here too, by storing it in an array of that dtype and reading
it back: the scaled entries ``u / s`` (exact, unless they underflow, as in the reference),
``s`` (a power of two of the dtype's range: ``s <= max|u|``) and ``||u / s||``; the
divisions are made in float64 and rounded once, which gives the correctly rounded quotient of
the dtype (float64 carries more than twice float32's digits). What differs from the array
code: the sums (of squares, and ``<y, d_y>``) accumulate in float64 in row order (the
reference's batched product sums in the dtype in BLAS's order), and in float32 the backward's
``d_y - y <y, d_y>`` is rounded once instead of twice. Zero rows: ``s = 1/2``, the scaled
row and its norm are 0, the divisor ``max(0, 1) = 1`` and ``y = 0`` exactly, as in the
reference; their gradient divides by the zero norm (``inf``/``nan``, the reference's too: the
forward's data check refuses a zero row).

The twins run with NumPy's error model (a division by zero is ``inf``/``nan``, as in the
array code and on a GPU, not Python's ``ZeroDivisionError``).
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.jit import njit, prange

__all__ = ["l2_backward_cpu", "l2_forward_cpu", "l2_row_backward", "l2_row_forward",
           "row_scale"]


@njit(cache=True, inline="always", error_model="numpy")
def row_scale(peak):
    """``s = 2^(e - 1)`` for ``peak = m 2^e``, ``m`` in ``[1/2, 1)``: ``peak / s`` in
    ``[1, 2)``, and ``1/2`` for ``peak = 0`` (``frexp(0) = (0, 0)``). Formed as
    ``ldexp(1/2, e)``: ``2^e`` itself overflows for ``peak`` near the dtype's maximum."""
    e = math.frexp(peak)[1]
    return math.ldexp(0.5, e)


@njit(cache=True, inline="always", error_model="numpy")
def l2_row_forward(x, i, y, scale, scaled_norm):
    """Row ``i`` of ``y = x / ||x||``: writes ``y[i]``, ``scale[i]`` (``s``) and
    ``scaled_norm[i]`` (``||x_i / s||``), each rounded to its array's dtype."""
    d = x.shape[1]
    peak = 0.0
    for j in range(d):
        a = abs(np.float64(x[i, j]))
        if a > peak:
            peak = a
    s = row_scale(peak)
    scale[i] = s                                  # exact in the dtype (s <= max|u|)
    acc = 0.0
    for j in range(d):
        y[i, j] = np.float64(x[i, j]) / s         # rounds to the dtype, as the reference's u / s
        v = np.float64(y[i, j])
        acc += v * v
    scaled_norm[i] = math.sqrt(acc)               # rounds to the dtype
    denom = np.float64(scaled_norm[i])
    if denom < 1.0:                               # a zero row (a nonzero one has ||u/s|| >= 1)
        denom = 1.0
    for j in range(d):
        y[i, j] = np.float64(y[i, j]) / denom


@njit(cache=True, inline="always", error_model="numpy")
def l2_row_backward(y, d_y, i, scale, scaled_norm, grad):
    """Row ``i`` of ``(d_y - y <y, d_y>) / ||x / s|| / s`` into ``grad[i]``."""
    d = y.shape[1]
    dot = 0.0
    for j in range(d):
        dot += np.float64(y[i, j]) * np.float64(d_y[i, j])
    norm = np.float64(scaled_norm[i])
    s = np.float64(scale[i])
    for j in range(d):
        tangent = np.float64(d_y[i, j]) - np.float64(y[i, j]) * dot
        grad[i, j] = tangent / norm / s


@njit(cache=True, parallel=True, error_model="numpy")
def l2_forward_cpu(x, y, scale, scaled_norm):
    """The forward twin: :func:`l2_row_forward` on every row of ``x`` (rows, d), in parallel."""
    for i in prange(x.shape[0]):
        l2_row_forward(x, i, y, scale, scaled_norm)


@njit(cache=True, parallel=True, error_model="numpy")
def l2_backward_cpu(y, d_y, scale, scaled_norm, grad):
    """The backward twin: :func:`l2_row_backward` on every row, in parallel."""
    for i in prange(y.shape[0]):
        l2_row_backward(y, d_y, i, scale, scaled_norm, grad)
