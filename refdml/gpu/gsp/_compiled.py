r"""The GSP layer compiled: (P2) per image, the pooling layer, its closed-form backward.

The scalar and per-column maths and the CPU twins; the CUDA kernels, which call the same
maths, are their twins in :mod:`refdml.gpu.gsp._cuda`. refdml.gpu's GSP mirror
(:data:`refdml.gpu.gsp.IMPLEMENTATIONS`) runs either (:mod:`refdml.gpu.gsp._kernels`), or its
array path (:mod:`refdml.gpu.gsp._array`, :mod:`refdml.gpu.gsp._transport`), which stays the
fallback and the twin these kernels are tested against. The maths is the
reference's (docs/gsp.md Secs. 2-3, :mod:`refdml.gsp`); every kernel does, per image ``b``:

* clip (pool forward only, its own launch): each row's norm ``||u||`` and ``ubar = u /
  max(||u||, 1)`` (:func:`clip_row`), and the largest ``||ubar||`` of each image and of the
  prototypes (``peaks``);
* cost map (pool forward only): ``c_ji = s ||fs_j - ws_i||`` from the clipped points divided
  by the common power of two ``s`` of the largest of ``peaks`` (:func:`power_of_two_scale`;
  ``fs = fbar / s``, ``ws = wbar / s``, both divisions exact), by explicit differences
  (no Gram identity, so no refinement step is needed);
* log kernel: ``cmin_j = min_i c_ji``, ``A_ji = softmax_i(-ε (c_ji - cmin_j))``,
  ``lam_j = log sum_i exp(-ε (c_ji - cmin_j))`` (so ``l_j = lam_j - ε cmin_j``; ``ε`` times a
  cost gap that overflows is a weight of exactly 0);
* the reference's solve in pivot coordinates (docs/gsp.md Sec. 2): the columns in the stable
  order of ``cmin`` (:func:`column_rank` on CUDA, a stable ``argsort`` on the CPU), a
  bisection over them for the pivot ``p`` whose logit is nearest 0 at the root, the window
  ``[-1024, 1024]`` (:func:`window`, :func:`bracket`; the decisions of this search are one
  state machine, :func:`search_start`, :func:`search_query`, :func:`search_advance`, that
  the CPU twin drives with a loop over columns and the CUDA kernel with block reductions),
  then safeguarded Newton on
  ``phi(y) = logit g(y) - logit mu``, ``g(y) = (1/n) sum_j sigma(y + l_j - l_p)``, with
  ``l_j - l_p`` formed from cost differences (:func:`relative_log_s`). The scalar maths
  (``phi`` and its slope from online log-sum-exps, the safeguarded step) is
  :func:`newton_start`, :func:`column_terms`, :func:`newton_phi`, :func:`newton_step`,
  called by both the CUDA kernels and the CPU twins (so is each column's work below:
  :func:`column_softmax`, :func:`column_plan`, :func:`pool_backward_column`,
  :func:`transport_backward_column`, :func:`cost_gradient`);
* ``sigma(x_j)``, ``rho_j = sigma(-x_j)/n``, ``pi_ji = A_ji sigma(x_j)/n``, the residual of
  the arrays as stored; pool: ``w_j = sigma(x_j)/mu``, ``pooled = sum_j (w_j / n) f_j``
  (``p = 1``; products and sum in float64), ``z_i = (1/mu) sum_j pi_ji``;
* backward: Prop. 4.3 as the reference evaluates it, ``d_cost_ji = -ε A_ji (P_j ((d_pi_ji -
  r_j) + offset_j) + w_j (b_j - bbar))`` (docs/gsp.md Sec. 3: both differences against the
  dominant term, so the gradient tends to 0 with the softmax's and sigmoids' saturation
  instead of to ε times rounding); pool: ``W_ji = d_cost_ji / c'_ji`` (0 where ``c = 0``),
  and the features' gradient through the cost map and the clip (fused). The prototypes'
  gradient is a sum over the whole batch: the caller forms it from ``W`` with one matrix
  product (``W^T fbar``, BLAS / cuBLAS), which is what a GEMM does best.

Layout: (B, m, n) arrays live as (B, n, m) in memory, as on the array path.

Launch shape (CUDA): one block of :data:`BLOCK` threads per image; threads stride over the
``n`` columns, the ``n m`` cost entries or the ``n d`` feature entries; the reductions over
columns (the log-sum-exps of ``phi``, max/min of ``l - l_p``, the residual, the backward's
``sum w`` and largest ``w``) are tree reductions in shared memory; every thread then takes the
same scalar decision (bisection, window, Newton step: identical inputs, so the block stays in
lock-step without a broadcast). CPU twins: ``prange`` over images, each image sequential.

dtype: arrays in the input's dtype (float32 or float64); every reduction (the norms' and the
cost's sums of ``d`` squares among them) and the scalar Newton in float64. The stopping
rules use the input dtype's ulp (the array path's), so float32 stops where the array path
stops; the parity held is 1e-10 (float64) and 1e-4 (float32) relative to the reference.

Each CPU twin and its CUDA kernel are the same computation laid out for two machines: read
this module beside :mod:`refdml.gpu.gsp._cuda`.

Names. ``inverse_temperature`` is the paper's ε (varepsilon) as in the reference
(:mod:`refdml.gsp`): it multiplies the cost, ``exp(-ε c)``, so the entropy's weight in (P2)
is ``1/ε``. (In :mod:`refdml.ot`, ``eps`` is a temperature; here no parameter is called
``eps``.) ``ε`` in the formulas of these docstrings is that ``inverse_temperature``.

Parameters. Every kernel's parameters are the fields, in order, of the small frozen
dataclasses at the end of this module (:class:`SolverConstants`, :class:`ImageOutputs`,
:class:`PoolInputs`, ...), which the caller fills and flattens once at the launch
(:meth:`Buffers.args`); tests/gpu/test_gpu_kernels_gsp.py holds the names to the kernels'.

Where results must reach Python: nothing here synchronises; the caller reads
``n_iter`` / ``converged`` from the per-image ``counts`` (evaluations, ``max_iter`` hit,
residual within ``tol``, and the pooling layer's check of its points: one (B, 4) array) and
the pooling backward's ``status`` (its upstream gradients and its result not finite), and
checks the transport backward's ``d_cost`` for overflow. The data checks are written by the
kernels that read the data anyway (:func:`points_status`, :func:`nonfinite`), so that the
host reads each call's once, with what it reads regardless.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from refdml.gpu._support.jit import njit, prange
from refdml.gpu._support.scalar import lse_push, lse_value
from refdml.gpu.gsp._transport import stopping_rules

__all__ = [
    "Buffers",
    "ImageOutputs",
    "NormaliseInputs",
    "NormaliseOutputs",
    "PoolGradients",
    "PoolInputs",
    "PoolOutputs",
    "PoolSaved",
    "PoolUpstream",
    "PrototypesGradient",
    "PrototypesSaved",
    "PrototypesUpstream",
    "GRADIENT_NOT_FINITE",
    "SATURATION",
    "Scratch",
    "SolverConstants",
    "TransportGradient",
    "TransportInput",
    "TransportSaved",
    "TransportUpstream",
    "UPSTREAM_NOT_FINITE",
    "bracket",
    "clip_coefficient",
    "clip_row",
    "column_plan",
    "column_rank",
    "column_softmax",
    "column_terms",
    "cost_gradient",
    "distance_weight",
    "exp_or_inf",
    "given_log_s",
    "image_report",
    "log_expit",
    "newton_phi",
    "newton_start",
    "newton_step",
    "nonfinite",
    "normalise_cpu",
    "pool_backward_column",
    "pool_backward_cpu",
    "points_status",
    "pool_forward_cpu",
    "power_of_two_scale",
    "prototype_backward_row",
    "prototypes_backward_cpu",
    "relative_log_s",
    "scaled_gap",
    "search_advance",
    "search_query",
    "search_start",
    "transport_backward_column",
    "transport_backward_cpu",
    "transport_cpu",
    "window",
]

# |x| beyond which sigma(x) is exactly 0 or 1: the pivot search's window (the reference's).
SATURATION = 1024.0


# --------------------------------------------------------------------------- scalar maths
@njit(cache=True, inline="always")
def log_expit(x):
    """``log sigma(x) = min(x, 0) - log1p(exp(-|x|))`` (finite for every finite x)."""
    return min(x, 0.0) - math.log1p(math.exp(-abs(x)))


@njit(cache=True, inline="always")
def exp_or_inf(x):
    """``exp(x)`` in ``x``'s dtype, ``inf`` where it overflows (compiled, so that the CUDA
    simulator overflows silently here as the device does): ``t = exp(tau)``."""
    return math.exp(x)


@njit(cache=True, inline="always")
def power_of_two_scale(peak):
    """The cost map's common power of two ``s``: ``peak / s`` in ``(0.5, 1]`` (the array
    path's ``frexp`` rule, :func:`refdml.gpu.gsp._array.normalised`), 1 where ``peak`` is 0
    (or not finite: no scaling is then right). Exact: only doublings and halvings."""
    s = 1.0
    if not (peak > 0.0 and peak < math.inf):
        return s
    while s < peak:
        s *= 2.0
    while 0.5 * s >= peak:
        s *= 0.5
    return s


@njit(cache=True, inline="always")
def column_terms(x):
    """``log sigma(x)``, ``log sigma(-x)`` and their sum: one column's Newton terms.

    Both from the shared ``log1p(exp(-|x|))``, so ``x = ±inf`` (an overflowing ``ε`` times a
    cost gap) gives ``(0, -inf)`` or ``(-inf, 0)``, not ``inf - inf``.
    """
    tail = math.log1p(math.exp(-abs(x)))
    log_sig = min(x, 0.0) - tail
    log_one_minus = -max(x, 0.0) - tail
    return log_sig, log_one_minus, log_sig + log_one_minus


@njit(cache=True, inline="always")
def scaled_gap(inverse_temperature, a, b):
    """``ε (a - b)`` with no overflow of ``a - b`` (the reference's ``_scaled_gap``)."""
    return (inverse_temperature * (0.5 * a - 0.5 * b)) * 2.0


@njit(cache=True, inline="always")
def given_log_s(inverse_temperature, column_min, lam):
    """``l_j = lam_j - ε cmin_j`` for the cost as given (``±inf`` where ``ε cmin`` overflows).

    A compiled scalar function, so that the CUDA simulator (which runs kernel bodies as
    Python) overflows silently here as the device does.
    """
    return lam - inverse_temperature * column_min


@njit(cache=True, inline="always")
def relative_log_s(inverse_temperature, column_min, lam, pivot_min, pivot_lam):
    """``l_j - l_p`` from cost differences: ``(lam_j - lam_p) - ε (cmin_j - cmin_p)``."""
    return (lam - pivot_lam) - scaled_gap(inverse_temperature, column_min, pivot_min)


@njit(cache=True, inline="always")
def newton_start(lo, hi, y0, ulp):
    """The start clipped into ``[lo, hi]`` and whether to iterate (``lo`` if not)."""
    y = min(max(y0, lo), hi)
    active = (hi - lo) > 4.0 * ulp * max(1.0, abs(y))
    if not active:
        y = lo
    return y, active


@njit(cache=True, inline="always")
def newton_phi(m1, s1, m2, s2, m3, s3, logit_mu, log_n):
    """``phi = log sum sigma - log sum (1 - sigma) - logit mu`` and ``log phi'``."""
    log_g = lse_value(m1, s1)
    log_one_minus_g = lse_value(m2, s2)
    phi = log_g - log_one_minus_g - logit_mu
    log_slope = log_n + lse_value(m3, s3) - log_g - log_one_minus_g
    return phi, log_slope


@njit(cache=True, inline="always")
def newton_step(tau, lo, hi, phi, log_slope, ulp, phi_floor, cap):
    """One safeguarded Newton step (the reference's ``_newton`` body): ``tau, lo, hi, done``."""
    if phi < 0.0:
        lo = tau
    if phi > 0.0:
        hi = tau
    step = -phi * math.exp(min(-log_slope, cap))
    newton = tau + step
    scale = 4.0 * ulp * max(1.0, abs(tau))
    small = abs(step) <= scale
    inside = newton > lo and newton < hi
    level = abs(phi) <= phi_floor
    done = level or small or (hi - lo) <= scale
    if not level:
        tau = newton if (small or inside) else 0.5 * (lo + hi)
    return tau, lo, hi, done


@njit(cache=True, inline="always")
def window(below, above, n, gap):
    """After the bisection: ``interior``, ``half = min(G/2, 1024)`` (``G = l_plus - l_minus``)."""
    interior = below >= 0 and above < n
    return interior, min(0.5 * max(gap, 0.0), SATURATION)


@njit(cache=True, inline="always")
def bracket(use_plus, interior, gap, half):
    """The window's bracket of ``y`` in the chosen pivot's coordinates (docs/gsp.md Sec. 2)."""
    if use_plus:
        return 0.0, (gap - half) if interior else math.inf
    return (-half) if interior else -math.inf, 0.0


# --------------------------------------------------------------------------- per-column maths
# One source for the CPU twins and the CUDA kernels: each takes the (B, n[, m]) arrays and the
# image ``b`` / column ``j`` it works on. The CPU twins call them as ``@njit`` functions; the
# CUDA kernels call device functions compiled from the same Python source (``.py_func``, see
# :func:`cuda_kernels`: the simulator cannot pass its arrays to an ``@njit`` function).
@njit(cache=True, inline="always")
def column_softmax(cost_t, inverse_temperature, assignment, column_min, lam, b, j):
    """``A_ji = softmax_i(-ε (c_ji - cmin_j))`` into ``assignment``, ``cmin_j`` into
    ``column_min`` and ``lam_j = log sum_i exp(-ε (c_ji - cmin_j))`` into ``lam``."""
    m = cost_t.shape[2]
    low = math.inf
    for i in range(m):
        low = min(low, cost_t[b, j, i])
    total = 0.0
    for i in range(m):
        a = math.exp(-scaled_gap(inverse_temperature, cost_t[b, j, i], low))
        assignment[b, j, i] = a
        total += a
    inverse = 1.0 / total
    for i in range(m):
        assignment[b, j, i] *= inverse
    column_min[b, j] = low
    lam[b, j] = math.log(total)


@njit(cache=True, inline="always")
def clip_row(points, points_bar, points_norm, b, j):
    """Row ``j`` of image ``b``: ``||u||`` into ``points_norm`` (float64 sums, rounded once to
    the dtype; rows whose sum of squares leaves float64's plain range divided by their
    largest magnitude first), ``u / max(||u||, 1)`` into ``points_bar`` (divided by the
    stored norm: the array path's quotient). Returns ``||ubar|| = min(||u||, 1)`` as stored.
    A norm beyond the dtype is stored as ``inf`` (its caller names it)."""
    d = points.shape[2]
    peak, total = 0.0, 0.0
    for k in range(d):
        value = abs(float(points[b, j, k]))
        peak = max(peak, value)
        total += value * value
    if (total >= 2.0**-900 and total <= 2.0**1000) or peak == 0.0:
        norm = math.sqrt(total)
    else:  # float64 rows of tiny or huge entries: divided by the largest magnitude first
        scaled = 0.0
        for k in range(d):
            ratio = float(points[b, j, k]) / peak
            scaled += ratio * ratio
        norm = math.sqrt(scaled) * peak
    points_norm[b, j] = norm
    stored = points_norm[b, j]
    divisor = max(stored, 1.0)
    for k in range(d):
        points_bar[b, j, k] = points[b, j, k] / divisor
    return min(stored, 1.0)


@njit(cache=True, inline="always")
def prototype_backward_row(prototypes_bar, prototypes_norm, scale, column_sums, product,
                           d_prototypes, i):
    """Row ``i`` of the prototypes' gradient: ``d wbar_i = ((sum_bj W_bji) wbar_i - (W^T
    fbar)_i) / s`` (``column_sums`` (B, m): each image's ``sum_j W_ji``; ``product`` (m, d):
    ``W^T fbar`` over the batch), then the clip's backward, ``(I - wbar wbar^T) d wbar /
    ||w||`` where ``||w|| > 1`` (:func:`refdml.normalize._clip_backward`). Returns the row's
    status: :data:`GRADIENT_NOT_FINITE` where an entry is not finite, else 0."""
    d = prototypes_bar.shape[1]
    s = float(scale[0])
    column = 0.0
    for b in range(column_sums.shape[0]):
        column += column_sums[b, i]
    norm = prototypes_norm[i]
    radial = 0.0
    if norm > 1.0:
        for k in range(d):
            radial += prototypes_bar[i, k] * ((prototypes_bar[i, k] * column - product[i, k])
                                              / s)
    bad = 0.0
    for k in range(d):
        gradient = (prototypes_bar[i, k] * column - product[i, k]) / s
        if norm > 1.0:
            gradient = (gradient - prototypes_bar[i, k] * radial) / norm
        d_prototypes[i, k] = gradient
        bad += nonfinite(d_prototypes[i, k])
    return GRADIENT_NOT_FINITE if bad > 0.0 else 0


#: The pooling backward's status of image ``b`` (``PoolGradients.status``) and of prototype
#: ``i`` (``PrototypesGradient.status``), bits the host ORs after its one read: an upstream
#: gradient not finite (``d_pooled[b]`` or ``d_z[b]``: refused, named by the host's checks),
#: and a gradient entry not finite (the float32 / float64 retries).
UPSTREAM_NOT_FINITE = 1
GRADIENT_NOT_FINITE = 2


@njit(cache=True, inline="always")
def nonfinite(x):
    """1.0 where ``x`` is NaN or inf, else 0.0 (a count the block reductions can sum)."""
    return 0.0 if math.isfinite(x) else 1.0


@njit(cache=True, inline="always")
def points_status(peaks, tiny):
    """``(peak, status)``: the largest of ``peaks`` that is not NaN, and 1 where a peak is
    NaN (a norm of its block is not finite: a non-finite input, or a norm beyond the dtype)
    or ``peak`` is below the dtype's normal range ``tiny`` (``1 / s`` would overflow), else
    0. The array path's checks of the points (:func:`refdml.gpu.gsp._array.normalised` and
    the inputs' finiteness), as one flag per image that the host reads with the solve
    summary (``counts[:, 3]``) and, where it is 1, names by running those checks."""
    peak, status = 0.0, 0
    for k in range(peaks.shape[0]):
        value = float(peaks[k])
        if value != value:
            status = 1
        else:
            peak = max(peak, value)
    if peak < tiny:
        status = 1
    return peak, status


@njit(cache=True, inline="always")
def image_report(b, tau, column_residual, mass, mu, tol, evaluations, steps, exhausted,
                 log_t, t, residual, counts):
    """Image ``b``'s solve summary: ``tau`` (``log_t``), ``t = exp(tau)``, the residual as
    stored, and ``counts[b] = (evaluations of g, max_iter hit, residual <= tol)`` (the stored
    residual against ``tol`` as the dtype holds it: the array path's comparison, then 0:
    the points' check, which the pooling layer's forward kernel writes over after the
    solve)."""
    log_t[b] = tau
    t[b] = exp_or_inf(log_t[b])
    residual[b] = max(column_residual, abs(mass - mu))
    counts[b, 0] = evaluations + steps
    counts[b, 1] = 1 if exhausted else 0
    counts[b, 2] = 1 if residual[b] <= tol else 0
    counts[b, 3] = 0


@njit(cache=True, inline="always")
def column_rank(column_min, b, j):
    """Position of column ``j`` in the stable sort of the image's column minima, NaN last
    (NumPy's ``argsort(kind="mergesort")``, the CPU twin's): a permutation whatever the
    data, so that the search never reads ``order`` where no column was written. A NaN
    minimum comes from a non-finite input, which the kernels meet before the host has read
    their data checks (the layer's checks ride on its one read: :mod:`refdml.gpu.gsp`)."""
    n = column_min.shape[1]
    value = column_min[b, j]
    value_nan = value != value
    rank = 0
    for k in range(n):
        other = column_min[b, k]
        if other != other:
            before = value_nan and k < j
        else:
            before = value_nan or other < value or (other == value and k < j)
        if before:
            rank += 1
    return rank


@njit(cache=True, inline="always")
def column_plan(y, inverse_temperature, pivot_min, pivot_lam, inv_n, column_min, lam,
                assignment, transported, rho, pi, b, j):
    """``sigma(x_j)``, ``rho_j``, ``pi_ji`` of column ``j`` (``x_j = y + l_j - l_p``); then
    ``l_j`` for the cost as given into ``column_min``. Returns (its residual, its mass)."""
    m = assignment.shape[2]
    x = y + relative_log_s(inverse_temperature, column_min[b, j], lam[b, j], pivot_min,
                           pivot_lam)
    transported[b, j] = math.exp(log_expit(x))
    rho[b, j] = math.exp(log_expit(-x)) * inv_n
    column_mass_factor = transported[b, j] * inv_n
    column_mass = 0.0
    for i in range(m):
        pi[b, j, i] = assignment[b, j, i] * column_mass_factor
        column_mass += pi[b, j, i]
    column_min[b, j] = given_log_s(inverse_temperature, column_min[b, j], lam[b, j])  # now log s_j
    return abs(rho[b, j] + column_mass - inv_n), column_mass


@njit(cache=True, inline="always")
def pool_backward_column(features, d_pooled, d_weights_in, assignment, d_z, rho, transported,
                         p_one, inv_n, inv_mu, b, j):
    """Pool backward, column ``j`` (``d_pi_ji = d_z_i / mu``): ``(mu r_j, offset_j, b_j, w_j)``.

    ``r_j = d_pi`` at the dominant row, returned unscaled as ``mu r_j = d_z_top``;
    ``offset_j = sum_i A_ji (r_j - d_pi_ji)``, ``b_j = a_j - d_rho_j`` with
    ``a_j = sum_i A_ji d_pi_ji``, ``w_j = rho_j sigma_j`` (docs/gsp.md Sec. 3).

    Every difference against the dominant row is taken between the upstream values
    ``d_z`` themselves and scaled by ``1 / mu`` after: ``(d_z_top - d_z_i) / mu``, never
    ``d_z_top / mu - d_z_i / mu``. The latter is exactly 0 at ``i = top`` only where both
    products are rounded; ptxas fuses a product and the subtraction after it into one FMA
    (PTX ``mul``/``sub`` without a rounding suffix may be contracted), which leaves the
    product's rounding error, ~1e-16, where 0 belongs; ``d_cost = -ε A (...)`` multiplied
    it by ε (the GPU's d features off by ~4e-18 ε: docs/gpu/hardware-failures.md, "The six
    hardware-only failures"). A difference of two equal values is 0 under any contraction.
    """
    n, d = features.shape[1], features.shape[2]
    m = assignment.shape[2]
    if p_one:
        dw = 0.0
        for k in range(d):
            dw += features[b, j, k] * d_pooled[b, k]
        dw *= inv_n
    else:
        dw = d_weights_in[b, j]
    d_rho = dw * (-n * inv_mu)
    top, best = 0, assignment[b, j, 0]  # the dominant row (the first, on a tie)
    for i in range(1, m):
        if assignment[b, j, i] > best:
            top, best = i, assignment[b, j, i]
    reference = d_z[b, top]
    offset, column = 0.0, 0.0
    for i in range(m):
        a = assignment[b, j, i]
        offset += a * (reference - d_z[b, i])
        column += a * d_z[b, i]
    return reference, offset * inv_mu, column * inv_mu - d_rho, rho[b, j] * transported[b, j]


@njit(cache=True, inline="always")
def transport_backward_column(assignment, d_pi, rho, d_rho, transported, b, j):
    """Transport backward, column ``j``: ``(r_j, offset_j, b_j, w_j)`` as in
    :func:`pool_backward_column`, ``d_pi`` (B, n, m) in memory order."""
    m = assignment.shape[2]
    top, best = 0, assignment[b, j, 0]  # the dominant row (the first, on a tie)
    for i in range(1, m):
        if assignment[b, j, i] > best:
            top, best = i, assignment[b, j, i]
    reference = d_pi[b, j, top]
    offset, column = 0.0, 0.0
    for i in range(m):
        a = assignment[b, j, i]
        offset += a * (reference - d_pi[b, j, i])
        column += a * d_pi[b, j, i]
    return reference, offset, column - d_rho[b, j], rho[b, j] * transported[b, j]


@njit(cache=True, inline="always")
def cost_gradient(factor, a, p, difference, offset, marginal):
    """``factor A_ji (P_j ((d_pi_ji - r_j) + offset_j) + w_j (b_j - bbar))`` from
    ``difference = d_pi_ji - r_j`` (formed by the caller as a difference of stored values:
    :func:`pool_backward_column`); ``d_cost`` for ``factor = -ε`` (compiled, so an overflow
    to ``inf`` is silent in the simulator too)."""
    return factor * (a * (p * (difference + offset) + marginal))


# --------------------------------------------------------------------------- the pivot search
# The decisions of the search for the pivot (docs/gsp.md Sec. 2) as one state machine that
# both machines drive: the CPU twin evaluates phi by a loop over the image's columns, the
# CUDA kernel by a block reduction (that part cannot be shared: one is a sequential loop,
# the other a tree in shared memory), and both hand each answer to :func:`search_advance`,
# which takes every decision (the bisection, the window, the plateau, the final bracket)
# and names the next evaluation (:func:`search_query`). On CUDA every thread of the block
# runs it on the same reduced values, so the block stays in lock-step.
#
# The state is a tuple (stage, below, above, lo, hi, use_plus, interior, gap, half, minus,
# plus): the bisection's bounds over the columns sorted by cmin, then the window's bracket
# [lo, hi] in the coordinates of the pivot (``plus`` if ``use_plus`` else ``minus``).
SEARCH_BISECT, SEARCH_WINDOW, SEARCH_PLATEAU, SEARCH_BOUNDS, SEARCH_DONE = 0, 1, 2, 3, 4


@njit(cache=True, inline="always")
def search_start(n):
    """The search's state before its first evaluation: the bisection over all ``n`` columns
    (``n >= 1``, so at least one step)."""
    return (SEARCH_BISECT, -1, n, 0.0, 0.0, False, False, 0.0, 0.0, 0, 0)


@njit(cache=True, inline="always")
def search_query(state, order, b):
    """``(pivot column, y)``: where the search evaluates ``phi`` next (``order[b]``: the image's
    columns in the stable order of cmin)."""
    stage, below, above, _, _, use_plus, _, _, half, minus, plus = state
    if stage == SEARCH_BISECT:
        return order[b, (below + above) // 2], 0.0
    if stage == SEARCH_WINDOW:
        return minus, -half
    if stage == SEARCH_PLATEAU:
        return plus, SATURATION
    return (plus if use_plus else minus), 0.0   # SEARCH_BOUNDS: max / min of l - l_p


@njit(cache=True, inline="always")
def _after_window(below, above, use_plus, interior, gap, half, minus, plus):
    lo, hi = bracket(use_plus, interior, gap, half)
    if use_plus and interior and hi > SATURATION:
        return (SEARCH_PLATEAU, below, above, lo, hi, use_plus, interior, gap, half, minus, plus)
    return (SEARCH_BOUNDS, below, above, lo, hi, use_plus, interior, gap, half, minus, plus)


@njit(cache=True, inline="always")
def search_advance(state, phi, top, bottom, order, inverse_temperature, column_min, lam,
                   logit_mu, b):
    """The state after the answer ``(phi, top, bottom)`` to :func:`search_query`'s evaluation
    (``top`` / ``bottom``: max / min of ``l_j - l_p`` over the image's columns, read only in
    the last stage). ``SEARCH_DONE``: ``state[3:5]`` is Newton's bracket ``[lo, hi]``."""
    stage, below, above, lo, hi, use_plus, interior, gap, half, minus, plus = state
    n = column_min.shape[1]
    if stage == SEARCH_BISECT:
        middle = (below + above) // 2
        if phi >= 0.0:
            above = middle
        else:
            below = middle
        if above - below > 1:
            return (SEARCH_BISECT, below, above, lo, hi, use_plus, interior, gap, half, minus,
                    plus)
        minus, plus = order[b, min(above, n - 1)], order[b, max(below, 0)]
        gap = relative_log_s(inverse_temperature, column_min[b, plus], lam[b, plus],
                             column_min[b, minus], lam[b, minus])
        interior, half = window(below, above, n, gap)
        use_plus = below >= 0 and above == n
        if interior:
            return (SEARCH_WINDOW, below, above, lo, hi, use_plus, interior, gap, half, minus,
                    plus)
        return _after_window(below, above, use_plus, interior, gap, half, minus, plus)
    if stage == SEARCH_WINDOW:
        return _after_window(below, above, phi >= 0.0, interior, gap, half, minus, plus)
    if stage == SEARCH_PLATEAU:
        hi = SATURATION
        if phi < 0.0:
            lo = SATURATION
        return (SEARCH_BOUNDS, below, above, lo, hi, use_plus, interior, gap, half, minus, plus)
    lo = max(lo, logit_mu - top)
    hi = max(min(hi, logit_mu - bottom), lo)
    return (SEARCH_DONE, below, above, lo, hi, use_plus, interior, gap, half, minus, plus)


# --------------------------------------------------------------------------- CPU twins
@njit(cache=True)
def _phi_image(y, inverse_temperature, column_min, lam, b, pivot, logit_mu):
    """``phi(y)`` in the coordinates of column ``pivot`` of image ``b``; max/min of ``l - l_p``."""
    n = column_min.shape[1]
    pivot_min, pivot_lam = column_min[b, pivot], lam[b, pivot]
    m1, s1, m2, s2 = -math.inf, 0.0, -math.inf, 0.0
    top, bottom = -math.inf, math.inf
    for j in range(n):
        relative = relative_log_s(inverse_temperature, column_min[b, j], lam[b, j], pivot_min,
                                  pivot_lam)
        top, bottom = max(top, relative), min(bottom, relative)
        log_sig, log_one_minus, _ = column_terms(y + relative)
        m1, s1 = lse_push(m1, s1, log_sig)
        m2, s2 = lse_push(m2, s2, log_one_minus)
    return lse_value(m1, s1) - lse_value(m2, s2) - logit_mu, top, bottom


@njit(cache=True)
def _newton_image(inverse_temperature, column_min, lam, b, pivot, lo, hi, logit_mu, log_n,
                  max_iter, ulp, cap, phi_floor):
    """Newton in pivot coordinates in ``[lo, hi]`` from ``y = 0``: ``(y, steps, exhausted)``."""
    n = column_min.shape[1]
    pivot_min, pivot_lam = column_min[b, pivot], lam[b, pivot]
    y, active = newton_start(lo, hi, 0.0, ulp)
    count = 0
    while active and count < max_iter:
        count += 1
        m1, s1, m2, s2, m3, s3 = -math.inf, 0.0, -math.inf, 0.0, -math.inf, 0.0
        for j in range(n):
            a, c, e = column_terms(y + relative_log_s(inverse_temperature, column_min[b, j],
                                                      lam[b, j], pivot_min, pivot_lam))
            m1, s1 = lse_push(m1, s1, a)
            m2, s2 = lse_push(m2, s2, c)
            m3, s3 = lse_push(m3, s3, e)
        phi, log_slope = newton_phi(m1, s1, m2, s2, m3, s3, logit_mu, log_n)
        y, lo, hi, done = newton_step(y, lo, hi, phi, log_slope, ulp, phi_floor, cap)
        active = not done
    return y, count, active


@njit(cache=True)
def _transport_image(b, cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                     phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order, log_t,
                     t, residual, counts):
    """(P2) of image ``b`` from its cost (n, m); fills its per-image outputs (module docstring).

    ``log_s`` holds the column minima until the plan turns them into ``l_j``; ``lam`` keeps
    ``lam_j``; ``order`` gets the stable sort of the column minima.
    """
    n = cost_t.shape[1]
    log_n = math.log(n)
    for j in range(n):
        column_softmax(cost_t, inverse_temperature, assignment, log_s, lam, b, j)
    order[b] = np.argsort(log_s[b], kind="mergesort")  # stable: column_rank's order
    state = search_start(n)
    evaluations = 0
    while state[0] != SEARCH_DONE:
        pivot, y = search_query(state, order, b)
        phi, top, bottom = _phi_image(y, inverse_temperature, log_s, lam, b, pivot, logit_mu)
        if state[0] != SEARCH_BOUNDS:   # the reference counts the search's evaluations of g
            evaluations += 1
        state = search_advance(state, phi, top, bottom, order, inverse_temperature, log_s,
                               lam, logit_mu, b)
    lo, hi = state[3], state[4]
    pivot = state[10] if state[5] else state[9]
    y, steps, exhausted = _newton_image(inverse_temperature, log_s, lam, b, pivot, lo, hi,
                                        logit_mu, log_n, max_iter, ulp, cap, phi_floor)
    pivot_min, pivot_lam = log_s[b, pivot], lam[b, pivot]
    inv_n = 1.0 / n
    column_residual, mass = 0.0, 0.0
    for j in range(n):
        column, column_mass = column_plan(y, inverse_temperature, pivot_min, pivot_lam, inv_n,
                                          log_s, lam, assignment, transported, rho, pi, b, j)
        column_residual = max(column_residual, column)
        mass += column_mass
    image_report(b, y - given_log_s(inverse_temperature, pivot_min, pivot_lam),
                 column_residual, mass, mu, tol, evaluations, steps, exhausted, log_t, t,
                 residual, counts)


@njit(parallel=True, cache=True)
def transport_cpu(cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                  tol, assignment, lam, log_s, rho, transported, pi, order, log_t, t, residual,
                  counts):
    """``refdml_gsp_transport`` CPU twin: (P2) for every image of ``cost_t`` (B, n, m)."""
    for b in prange(cost_t.shape[0]):
        _transport_image(b, cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                         phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order,
                         log_t, t, residual, counts)


@njit(parallel=True, cache=True)
def normalise_cpu(features, prototypes, features_bar, features_norm, prototypes_bar,
                  prototypes_norm, peaks):
    """``refdml_gsp_normalise`` CPU twin: the clipped points and their norms
    (:func:`clip_row`), and ``peaks`` (B + 1,): each image's largest ``||fbar||``, then the
    prototypes' largest ``||wbar||`` (``prototypes`` and theirs as (1, m, ·) views); NaN
    where a norm of the block is not finite (:func:`points_status`)."""
    batch = features.shape[0]
    for b in prange(batch + 1):
        peak, bad = 0.0, 0.0
        if b < batch:
            for j in range(features.shape[1]):
                peak = max(peak, clip_row(features, features_bar, features_norm, b, j))
                bad += nonfinite(features_norm[b, j])
        else:
            for j in range(prototypes.shape[1]):
                peak = max(peak, clip_row(prototypes, prototypes_bar, prototypes_norm, 0, j))
                bad += nonfinite(prototypes_norm[0, j])
        peaks[b] = peak if bad == 0.0 else math.nan


@njit(parallel=True, cache=True)
def pool_forward_cpu(features, features_bar, prototypes_bar, peaks, p_one, tiny,
                     inverse_temperature, mu, logit_mu, max_iter, ulp, cap, phi_floor, tol,
                     assignment, lam, log_s, rho, transported, pi, order, log_t, t, residual,
                     counts, scale, cost_t, weights, pooled, z):
    """``refdml_gsp_pool_forward`` CPU twin: the scale, cost map, (P2), weights, pooled
    (p = 1) and z.

    ``s`` is the power of two of the largest of ``peaks`` (:func:`power_of_two_scale`),
    written to ``scale`` (1,); each image's ``counts[b, 3]`` is the points' check
    (:func:`points_status`). The cost's inner loop runs over the prototypes, contiguous in
    ``wbar / s`` transposed (d, m), formed here once (vectorised, no reduction in the inner
    loop); the squares are summed in float64 (the CUDA kernel's sums).
    """
    batch, n, d = features_bar.shape
    m = prototypes_bar.shape[0]
    peak, status = points_status(peaks, tiny)
    s = power_of_two_scale(peak)
    scale[0] = s
    prototypes_scaled_t = np.empty((d, m))
    for i in range(m):
        for k in range(d):
            prototypes_scaled_t[k, i] = prototypes_bar[i, k] / s
    for b in prange(batch):
        acc = np.zeros(m)
        for j in range(n):
            acc[:] = 0.0
            for k in range(d):
                f = features_bar[b, j, k] / s
                for i in range(m):
                    diff = f - prototypes_scaled_t[k, i]
                    acc[i] += diff * diff
            for i in range(m):
                cost_t[b, j, i] = math.sqrt(acc[i]) * s
        _transport_image(b, cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                         phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order,
                         log_t, t, residual, counts)
        counts[b, 3] = status
        inv_mu = 1.0 / mu
        for j in range(n):
            weights[b, j] = transported[b, j] * inv_mu
        if p_one:
            # (w_j / n) f_j in float64: a convex combination, never beyond the largest
            # feature (w f of float32 features near 3.4e38 overflowed float32).
            total = np.zeros(d)
            for j in range(n):
                w = weights[b, j] * (1.0 / n)
                for k in range(d):
                    total[k] += w * features[b, j, k]
            for k in range(d):
                pooled[b, k] = total[k]
        for i in range(m):
            column = 0.0
            for j in range(n):
                column += pi[b, j, i]
            z[b, i] = column * inv_mu


@njit(cache=True, inline="always")
def distance_weight(gradient, c):
    """``W = d_cost s / c`` from ``gradient = d_cost s``; 0 where ``c = 0`` (the subgradient)."""
    if c > 0.0:
        return gradient / c
    return 0.0


@njit(cache=True, inline="always")
def clip_coefficient(row, norm, radial):
    """``(1 / max(|f|, 1), coefficient of fbar)`` of the features' clip backward."""
    inverse = 1.0 / max(norm, 1.0)
    if norm > 1.0:
        return inverse, inverse * (row - radial)
    return inverse, inverse * row


@njit(cache=True, inline="always")
def _marginal_centre(rho, transported, b_values, b):
    """``(b_top, bbar offset)``: ``b`` at the image's largest ``w = rho sigma`` (the first) and
    ``sum_j w_j (b_top - b_j) / sum_j w_j`` (0 where the sum is 0, i.e. mu = 1)."""
    n = rho.shape[1]
    best, b_top, kappa = -1.0, 0.0, 0.0
    for j in range(n):
        w = rho[b, j] * transported[b, j]
        kappa += w
        if w > best:
            best, b_top = w, b_values[j]
    total = 0.0
    for j in range(n):
        total += rho[b, j] * transported[b, j] * (b_top - b_values[j])
    return b_top, (total / kappa if kappa > 0.0 else 0.0)


@njit(parallel=True, cache=True)
def pool_backward_cpu(features, features_bar, features_norm, prototypes_bar, scale, assignment,
                      cost_t, rho, transported, weights, inverse_temperature, mu, d_pooled, d_z,
                      d_weights, direct, p_one, distance_weights, d_features, column_sums,
                      status):
    """``refdml_gsp_pool_backward`` CPU twin: ``W = d_cost / c'`` (B, n, m), d features,
    each image's ``sum_j W_ji`` (B, m; float64) for the prototypes' gradient
    (:func:`prototypes_backward_cpu`) and its ``status`` (B,) (:data:`UPSTREAM_NOT_FINITE`,
    :data:`GRADIENT_NOT_FINITE`).

    ``p_one``: the direct path is ``w_j d_pooled / n`` (computed here); otherwise
    ``d_weights`` (B, n) and ``direct`` (B, n, d) come from the caller (GeMean).
    """
    batch, n, d = features.shape
    m = prototypes_bar.shape[0]
    s = scale[0]
    # wbar / s (exact: a power of two), once for the whole batch.
    ws = np.empty_like(prototypes_bar)
    for i in range(m):
        for k in range(d):
            ws[i, k] = prototypes_bar[i, k] / s
    factor = -inverse_temperature * s
    inv_n, inv_mu = 1.0 / n, 1.0 / mu
    for b in prange(batch):
        reference, offset, b_values = np.empty(n), np.empty(n), np.empty(n)
        for j in range(n):
            reference[j], offset[j], b_values[j], _ = pool_backward_column(
                features, d_pooled, d_weights, assignment, d_z, rho, transported, p_one,
                inv_n, inv_mu, b, j)
        b_top, mean_offset = _marginal_centre(rho, transported, b_values, b)
        acc = np.zeros(d)
        column_sums[b, :] = 0.0
        bad_gradient = 0.0
        for j in range(n):
            marginal = rho[b, j] * transported[b, j] * ((b_values[j] - b_top) + mean_offset)
            p = transported[b, j] * inv_n
            row = 0.0
            acc[:] = 0.0
            for i in range(m):
                gradient = cost_gradient(factor, assignment[b, j, i], p,
                                         (d_z[b, i] - reference[j]) * inv_mu, offset[j],
                                         marginal)
                distance_weights[b, j, i] = distance_weight(gradient, cost_t[b, j, i])
                w = distance_weights[b, j, i]  # as stored
                row += w
                column_sums[b, i] += w
                for k in range(d):
                    acc[k] -= w * ws[i, k]
            row /= s
            norm = features_norm[b, j]
            bar = min(norm, 1.0)
            radial = row * bar * bar
            for k in range(d):
                radial += features_bar[b, j, k] * acc[k]
            inverse, coefficient = clip_coefficient(row, norm, radial)
            w_dir = weights[b, j] * inv_n
            for k in range(d):
                if p_one:
                    along = w_dir * d_pooled[b, k]
                else:
                    along = direct[b, j, k]
                d_features[b, j, k] = (acc[k] * inverse + features_bar[b, j, k] * coefficient
                                       + along)
                bad_gradient += nonfinite(d_features[b, j, k])
        bad_upstream = 0.0
        for k in range(d):
            bad_upstream += nonfinite(d_pooled[b, k])
        for i in range(m):
            bad_upstream += nonfinite(d_z[b, i])
        status[b] = ((UPSTREAM_NOT_FINITE if bad_upstream > 0.0 else 0)
                     | (GRADIENT_NOT_FINITE if bad_gradient > 0.0 else 0))


@njit(parallel=True, cache=True)
def prototypes_backward_cpu(prototypes_bar, prototypes_norm, scale, column_sums, product,
                            d_prototypes, status):
    """``refdml_gsp_prototypes_backward`` CPU twin: the prototypes' gradient, row by row
    (:func:`prototype_backward_row`), from the batch's ``W^T fbar`` (``product``, one GEMM
    by the caller) and the images' column sums of ``W``; ``status`` (m,)
    :data:`GRADIENT_NOT_FINITE` where a row is not finite."""
    for i in prange(prototypes_bar.shape[0]):
        status[i] = prototype_backward_row(prototypes_bar, prototypes_norm, scale, column_sums,
                                           product, d_prototypes, i)


@njit(parallel=True, cache=True)
def transport_backward_cpu(assignment, rho, transported, inverse_temperature, d_rho, d_pi,
                           d_cost):
    """``refdml_gsp_transport_backward`` CPU twin: Prop. 4.3 from ``(d_rho, d_pi)``.

    ``d_cost_ji = -ε A_ji (P_j ((d_pi_ji - r_j) + offset_j) + w_j (b_j - bbar))`` (all (B, n, m)
    arrays in memory order; docs/gsp.md Sec. 3).
    """
    batch, n, m = assignment.shape
    for b in prange(batch):
        reference, offset, b_values = np.empty(n), np.empty(n), np.empty(n)
        for j in range(n):
            reference[j], offset[j], b_values[j], _ = transport_backward_column(
                assignment, d_pi, rho, d_rho, transported, b, j)
        b_top, mean_offset = _marginal_centre(rho, transported, b_values, b)
        for j in range(n):
            marginal = rho[b, j] * transported[b, j] * ((b_values[j] - b_top) + mean_offset)
            p = transported[b, j] / n
            for i in range(m):
                d_cost[b, j, i] = cost_gradient(-inverse_temperature, assignment[b, j, i], p,
                                                d_pi[b, j, i] - reference[j], offset[j],
                                                marginal)


# --------------------------------------------------------------------------- named parameters
# What each kernel takes, as small frozen dataclasses whose fields, in order, are the
# kernel's parameters (its CPU twin's; the CUDA kernel's, plus a trailing ``scratch`` for
# the backward kernels): a launch flattens them once (:meth:`Buffers.args`), and the kernel
# table (refdml.gpu.gsp._kernels.kernel_table) lists which a kernel takes, so that the names
# are a checked contract (tests/gpu/test_gpu_kernels_gsp.py holds them to the kernels'
# signatures).
class Buffers:
    """Base of the kernels' parameter groups (frozen dataclasses)."""

    def args(self) -> tuple:
        """The fields' values in order: the kernel's arguments for this group."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))


@dataclasses.dataclass(frozen=True)
class TransportInput(Buffers):
    """``cost_t`` (B, n, m): the cost in memory order."""

    cost_t: Any


@dataclasses.dataclass(frozen=True)
class SolverConstants(Buffers):
    """The scalars of the solve: ``inverse_temperature`` (the paper's ε), ``mu``, ``logit_mu
    = log(mu / (1 - mu))``, ``max_iter`` (Newton steps), and the stopping rules in the input
    dtype's terms: ``ulp`` (its machine epsilon), ``cap`` (below ``log`` of its largest
    number: the cap of a Newton step's ``exp``), ``phi_floor = 16 ulp (1 + |logit mu|)``;
    ``tol`` the residual's tolerance as applied, rounded to the dtype (the array path's
    ``residual <= tol`` compares in the dtype)."""

    inverse_temperature: float
    mu: float
    logit_mu: float
    max_iter: int
    ulp: float
    cap: float
    phi_floor: float
    tol: float

    @classmethod
    def of(cls, dtype, mu: float, inverse_temperature: float, max_iter: int,
           tol: float) -> SolverConstants:
        """The constants of a solve in ``dtype`` (the array path's stopping rules,
        :func:`refdml.gpu.gsp._transport.stopping_rules`); ``tol`` as applied."""
        logit_mu = math.log(mu) - math.log1p(-mu)
        ulp, cap, phi_floor = stopping_rules(dtype, logit_mu)
        return cls(inverse_temperature=float(inverse_temperature), mu=float(mu),
                   logit_mu=logit_mu, max_iter=int(max_iter), ulp=ulp, cap=cap,
                   phi_floor=phi_floor, tol=float(np.dtype(dtype).type(tol)))


@dataclasses.dataclass(frozen=True)
class ImageOutputs(Buffers):
    """What the solve writes per image: ``assignment`` (B, n, m) the softmax ``A``, ``lam``
    (B, n), ``log_s`` (B, n) ``l_j`` for the cost as given, ``rho`` (B, n), ``transported``
    (B, n) ``sigma(x_j)``, ``pi`` (B, n, m), ``order`` (B, n) int64 the stable order of the
    column minima, ``log_t`` (B,) ``tau`` for the cost as given, ``t`` (B,) ``exp(tau)``,
    ``residual`` (B,) of the arrays as stored (all those in the input's dtype) and
    ``counts`` (B, 4) int64: the evaluations of ``g`` (pivot search and Newton steps), 1
    where ``max_iter`` was hit, 1 where the residual is within ``tol``, and the points'
    check (:func:`points_status`; 0 from the solve alone): what the host reads of the
    solve, in one transfer (:func:`refdml.gpu.gsp._kernels._result`)."""

    assignment: Any
    lam: Any
    log_s: Any
    rho: Any
    transported: Any
    pi: Any
    order: Any
    log_t: Any
    t: Any
    residual: Any
    counts: Any

    @classmethod
    def empty(cls, xp, batch: int, n: int, m: int, dtype) -> ImageOutputs:
        """Uninitialised outputs (``xp.empty``: no fill, no launch on CuPy)."""
        return cls(
            assignment=xp.empty((batch, n, m), dtype=dtype), lam=xp.empty((batch, n), dtype=dtype),
            log_s=xp.empty((batch, n), dtype=dtype), rho=xp.empty((batch, n), dtype=dtype),
            transported=xp.empty((batch, n), dtype=dtype), pi=xp.empty((batch, n, m), dtype=dtype),
            order=xp.empty((batch, n), dtype=np.int64), log_t=xp.empty(batch, dtype=dtype),
            t=xp.empty(batch, dtype=dtype), residual=xp.empty(batch, dtype=dtype),
            counts=xp.empty((batch, 4), dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class NormaliseInputs(Buffers):
    """The points as given: ``features`` (B, n, d) and ``prototypes`` as a (1, m, d) view."""

    features: Any
    prototypes: Any


@dataclasses.dataclass(frozen=True)
class NormaliseOutputs(Buffers):
    """The clipped points and their norms: ``features_bar`` (B, n, d), ``features_norm``
    (B, n), ``prototypes_bar`` (1, m, d), ``prototypes_norm`` (1, m), and ``peaks`` (B + 1,)
    the largest ``||fbar||`` of each image and, last, the largest ``||wbar||`` (NaN where a
    norm of that block is not finite): the reduction the forward kernel finishes into the
    common power of two ``s`` and the points' check (:func:`points_status`)."""

    features_bar: Any
    features_norm: Any
    prototypes_bar: Any
    prototypes_norm: Any
    peaks: Any

    @classmethod
    def empty(cls, xp, batch: int, n: int, m: int, d: int, dtype) -> NormaliseOutputs:
        return cls(features_bar=xp.empty((batch, n, d), dtype=dtype),
                   features_norm=xp.empty((batch, n), dtype=dtype),
                   prototypes_bar=xp.empty((1, m, d), dtype=dtype),
                   prototypes_norm=xp.empty((1, m), dtype=dtype),
                   peaks=xp.empty(batch + 1, dtype=dtype))


@dataclasses.dataclass(frozen=True)
class PoolInputs(Buffers):
    """The pooling layer's forward: ``features`` (B, n, d) as given, ``features_bar`` (B, n, d)
    and ``prototypes_bar`` (m, d) the clipped points, ``peaks`` (B + 1,) their largest
    norms (:class:`NormaliseOutputs`), ``p_one`` (pooled formed here: p = 1), ``tiny`` the
    dtype's smallest normal number (:func:`points_status`)."""

    features: Any
    features_bar: Any
    prototypes_bar: Any
    peaks: Any
    p_one: bool
    tiny: float


@dataclasses.dataclass(frozen=True)
class PoolOutputs(Buffers):
    """The pooling layer's own outputs: ``scale`` (1,) the common power of two ``s``,
    ``cost_t`` (B, n, m), ``weights`` (B, n), ``pooled`` (B, d; written only when
    ``p_one``), ``z`` (B, m)."""

    scale: Any
    cost_t: Any
    weights: Any
    pooled: Any
    z: Any


@dataclasses.dataclass(frozen=True)
class PoolSaved(Buffers):
    """The pooling backward's context: the forward's points (``features``, ``features_bar``,
    ``features_norm`` (B, n), ``prototypes_bar`` (m, d), ``scale`` (1,)), its solve
    (``assignment``, ``cost_t``, ``rho``, ``transported``, ``weights``) and scalars."""

    features: Any
    features_bar: Any
    features_norm: Any
    prototypes_bar: Any
    scale: Any
    assignment: Any
    cost_t: Any
    rho: Any
    transported: Any
    weights: Any
    inverse_temperature: float
    mu: float


@dataclasses.dataclass(frozen=True)
class PoolUpstream(Buffers):
    """``d_pooled`` (B, d), ``d_z`` (B, m); GeMean's ``d_weights`` (B, n) and ``direct``
    (B, n, d) where not ``p_one`` (placeholders otherwise: the kernel forms them)."""

    d_pooled: Any
    d_z: Any
    d_weights: Any
    direct: Any
    p_one: bool


@dataclasses.dataclass(frozen=True)
class PoolGradients(Buffers):
    """``distance_weights`` (B, n, m) ``W = d_cost / c'``, ``d_features`` (B, n, d),
    ``column_sums`` (B, m) float64, each image's ``sum_j W_ji``, and ``status`` (B,) int64,
    each image's :data:`UPSTREAM_NOT_FINITE` | :data:`GRADIENT_NOT_FINITE`."""

    distance_weights: Any
    d_features: Any
    column_sums: Any
    status: Any


@dataclasses.dataclass(frozen=True)
class PrototypesSaved(Buffers):
    """The prototypes' side of the cost map's context: ``prototypes_bar`` (m, d),
    ``prototypes_norm`` (m,), ``scale`` (1,)."""

    prototypes_bar: Any
    prototypes_norm: Any
    scale: Any


@dataclasses.dataclass(frozen=True)
class PrototypesUpstream(Buffers):
    """``column_sums`` (B, m) (:class:`PoolGradients`) and ``product`` (m, d) ``W^T fbar``."""

    column_sums: Any
    product: Any


@dataclasses.dataclass(frozen=True)
class PrototypesGradient(Buffers):
    """``d_prototypes`` (m, d) and ``status`` (m,) int64, :data:`GRADIENT_NOT_FINITE` where
    a row is not finite."""

    d_prototypes: Any
    status: Any


@dataclasses.dataclass(frozen=True)
class TransportSaved(Buffers):
    """(P2)'s backward context: ``assignment`` (B, n, m), ``rho``, ``transported`` (B, n)."""

    assignment: Any
    rho: Any
    transported: Any
    inverse_temperature: float


@dataclasses.dataclass(frozen=True)
class TransportUpstream(Buffers):
    """``d_rho`` (B, n) and ``d_pi`` (B, n, m), in memory order."""

    d_rho: Any
    d_pi: Any


@dataclasses.dataclass(frozen=True)
class TransportGradient(Buffers):
    """``d_cost`` (B, n, m)."""

    d_cost: Any


@dataclasses.dataclass(frozen=True)
class Scratch(Buffers):
    """The CUDA backward kernels' (B, 3n) float64 scratch (per-column values of Prop. 4.3
    that the block's threads share); the CPU twins keep them in local arrays."""

    scratch: Any

