r"""Numba kernels of the GSP layer: (P2) per image, the pooling layer, its closed-form backward.

Private module of :mod:`refdml.gpu.gsp`, which dispatches to it with
:func:`refdml.gpu._numba_support.select_kernel` (the array path of
:mod:`refdml.gpu._gsp_transport` stays the fallback and the twin these kernels are tested
against). The maths is the reference's (docs/gsp.md Secs. 2-3, :mod:`refdml.gsp._transport`);
every kernel does, per image ``b``:

* cost map (pool forward only): ``c_ji = s ||fs_j - ws_i||`` from the clipped points divided
  by the common power of two ``s`` (``fs = fbar / s``, ``ws = wbar / s``, made by the caller),
  by explicit differences (no Gram identity, so no refinement step is needed);
* log kernel: ``cmin_j = min_i c_ji``, ``A_ji = softmax_i(-ε (c_ji - cmin_j))``,
  ``l_j = log sum_i exp(-ε (c_ji - cmin_j)) - ε (cmin_j - min_j cmin_j)`` (the cost shifted
  by its image minimum; ``shift = ε min c`` restores ``log t`` and ``l``);
* the reference's two-phase safeguarded Newton on ``phi(tau) = logit g(tau) - logit mu``,
  ``g(tau) = (1/n) sum_j sigma(tau + l_j)`` (phase 2 re-centred at ``a_j = tau + l_j``);
  the scalar maths (bracket, ``phi`` and its slope from three online log-sum-exps, the
  safeguarded step) is :func:`newton_start`, :func:`column_terms`, :func:`newton_phi`,
  :func:`newton_step`, called by both the CUDA kernels and the CPU twins (so is each column's
  work below: :func:`column_softmax`, :func:`column_shift`, :func:`column_plan`,
  :func:`pool_backward_column`, :func:`transport_backward_column`);
* ``sigma(x_j)``, ``rho_j = sigma(-x_j)/n``, ``pi_ji = A_ji sigma(x_j)/n``, the residual of
  the arrays as stored; pool: ``w_j = sigma(x_j)/mu``, ``pooled = (1/n) sum_j w_j f_j``
  (``p = 1``), ``z_i = (1/mu) sum_j pi_ji``;
* backward (pool): Prop. 4.3's ``inner_j = q_j - (eta/kappa) rho_j`` and
  ``W_ji = d_cost_ji / c'_ji = -ε s pi_ji (d_z_i/mu - n inner_j) / c_ji`` (0 where ``c = 0``),
  and the features' gradient through the cost map and the clip (fused). The prototypes'
  gradient is a sum over the whole batch: the caller forms it from ``W`` with one matrix
  product (``W^T fbar``, BLAS / cuBLAS), which is what a GEMM does best.

Layout: (B, m, n) arrays live as (B, n, m) in memory, as on the array path.

Launch shape (CUDA): one block of :data:`BLOCK` threads per image; threads stride over the
``n`` columns, the ``n m`` cost entries or the ``n d`` feature entries; the reductions over
columns (Newton's three log-sum-exps, min/max/sum of ``l``, the residual, kappa and eta) are
tree reductions in shared memory; every thread then takes the same scalar Newton step
(identical inputs, so the block stays in lock-step without a broadcast). CPU twins:
``prange`` over images, each image sequential.

dtype: arrays in the input's dtype (float32 or float64); the cost's sum of ``d`` squares is
accumulated in that dtype (relative error <= ~d u), every other reduction and the scalar
Newton in float64. The stopping rules use the input dtype's ulp (the array path's), so
float32 stops where the array path stops; the parity held is 1e-10 (float64) and 1e-4
(float32) relative to the reference.

Length (~700 lines, over the house ~450 on purpose): each CPU twin and its CUDA kernel are
the same computation laid out for two machines, and are meant to be read side by side.

Where results must reach Python: nothing here synchronises; the caller reads
``n_iter`` / ``converged`` / the overflow check from the per-image outputs.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float64, njit, prange

from refdml.gpu._numba_scalar import lse_merge, lse_push, lse_value
from refdml.gpu._numba_support import BLOCK

__all__ = [
    "column_plan",
    "column_shift",
    "column_softmax",
    "column_terms",
    "cuda_kernels",
    "log_expit",
    "newton_phi",
    "newton_start",
    "newton_step",
    "pool_backward_cpu",
    "pool_backward_column",
    "pool_forward_cpu",
    "transport_backward_column",
    "transport_backward_cpu",
    "transport_cpu",
]

# image_real columns: tau (= log t - shift), shift (= ε min c), residual
# image_int columns: Newton steps of phase 1, of phase 2, exhausted (1 if max_iter was hit)
N_REAL, N_INT = 3, 3


# --------------------------------------------------------------------------- scalar maths
@njit(cache=True, inline="always")
def log_expit(x):
    """``log sigma(x) = min(x, 0) - log1p(exp(-|x|))`` (finite for every finite x)."""
    return min(x, 0.0) - math.log1p(math.exp(-abs(x)))


@njit(cache=True, inline="always")
def column_terms(x):
    """``log sigma(x)``, ``log sigma(-x)`` and their sum: one column's Newton terms."""
    log_sig = log_expit(x)
    log_one_minus = log_sig - x
    return log_sig, log_one_minus, log_sig + log_one_minus


@njit(cache=True, inline="always")
def newton_start(logit_mu, value_max, value_min, tau0, ulp):
    """Bracket ``[logit mu - max a, logit mu - min a]``, clipped start, and whether to iterate."""
    lo = logit_mu - value_max
    hi = logit_mu - value_min
    tau = min(max(tau0, lo), hi)
    active = (hi - lo) > 4.0 * ulp * max(1.0, abs(tau))
    if not active:
        tau = lo
    return tau, lo, hi, active


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


# --------------------------------------------------------------------------- per-column maths
# One source for the CPU twins and the CUDA kernels: each takes the (B, n[, m]) arrays and the
# image ``b`` / column ``j`` it works on. The CPU twins call them as ``@njit`` functions; the
# CUDA kernels call device functions compiled from the same Python source (``.py_func``, see
# :func:`cuda_kernels`: the simulator cannot pass its arrays to an ``@njit`` function).
@njit(cache=True, inline="always")
def column_softmax(cost_t, eps, assignment, log_s_shifted, b, j):
    """``A_ji = softmax_i(-ε (c_ji - cmin_j))`` into ``assignment``, ``log sum_i exp(...)``
    into ``log_s_shifted``; returns ``cmin_j``."""
    m = cost_t.shape[2]
    column_min = math.inf
    for i in range(m):
        column_min = min(column_min, cost_t[b, j, i])
    total = 0.0
    for i in range(m):
        a = math.exp(-eps * (cost_t[b, j, i] - column_min))
        assignment[b, j, i] = a
        total += a
    inverse = 1.0 / total
    for i in range(m):
        assignment[b, j, i] *= inverse
    log_s_shifted[b, j] = math.log(total)
    return column_min


@njit(cache=True, inline="always")
def column_shift(eps, image_min, shift, log_s_shifted, log_s, b, j):
    """``l_j`` (``log_s_shifted``, the column minimum held in ``log_s`` until now) and
    ``log s_j = l_j - shift``; returns ``l_j`` as stored (rounded to the dtype)."""
    log_s_shifted[b, j] = log_s_shifted[b, j] - eps * (log_s[b, j] - image_min)
    value = log_s_shifted[b, j]
    log_s[b, j] = value - shift
    return value


@njit(cache=True, inline="always")
def column_plan(tau, delta, inv_n, log_s_shifted, assignment, transported, rho, pi, b, j):
    """``sigma(x_j)``, ``rho_j``, ``pi_ji`` of column ``j``; returns (its residual, its mass)."""
    m = assignment.shape[2]
    x = (tau + log_s_shifted[b, j]) + delta
    transported[b, j] = math.exp(log_expit(x))
    rho[b, j] = math.exp(log_expit(-x)) * inv_n
    column_mass_factor = transported[b, j] * inv_n
    column_mass = 0.0
    for i in range(m):
        pi[b, j, i] = assignment[b, j, i] * column_mass_factor
        column_mass += pi[b, j, i]
    return abs(rho[b, j] + column_mass - inv_n), column_mass


@njit(cache=True, inline="always")
def pool_backward_column(features, d_pooled, d_weights_in, pi, d_z, rho, transported, p_one,
                         inv_n, inv_mu, b, j):
    """Pool backward, column ``j``: ``(q_j, kappa_j, eta_j)`` (their sums are kappa, eta)."""
    n, d = features.shape[1], features.shape[2]
    m = pi.shape[2]
    if p_one:
        dw = 0.0
        for k in range(d):
            dw += features[b, j, k] * d_pooled[b, k]
        dw *= inv_n
    else:
        dw = d_weights_in[b, j]
    d_rho = dw * (-n * inv_mu)
    weighted = 0.0
    for i in range(m):
        weighted += pi[b, j, i] * (d_z[b, i] * inv_mu)
    return (rho[b, j] * d_rho + weighted, rho[b, j] * transported[b, j],
            rho[b, j] * (transported[b, j] * d_rho - n * weighted))


@njit(cache=True, inline="always")
def transport_backward_column(pi, d_pi, rho, d_rho, transported, b, j):
    """Transport backward, column ``j``: ``(q_j, kappa_j, eta_j)`` (their sums are kappa, eta)."""
    n, m = pi.shape[1], pi.shape[2]
    weighted = 0.0
    for i in range(m):
        weighted += pi[b, j, i] * d_pi[b, j, i]
    return (rho[b, j] * d_rho[b, j] + weighted, rho[b, j] * transported[b, j],
            rho[b, j] * (transported[b, j] * d_rho[b, j] - n * weighted))


# --------------------------------------------------------------------------- CPU twins
@njit(cache=True)
def _newton_image(l, base, value_max, value_min, tau0, logit_mu, log_n, max_iter, ulp, cap,
                  phi_floor):
    """Newton on the values ``base + l_j`` of one image: ``(tau, steps, exhausted)``."""
    n = l.shape[0]
    tau, lo, hi, active = newton_start(logit_mu, value_max, value_min, tau0, ulp)
    count = 0
    while active and count < max_iter:
        count += 1
        m1, s1, m2, s2, m3, s3 = -math.inf, 0.0, -math.inf, 0.0, -math.inf, 0.0
        for j in range(n):
            a, c, e = column_terms(tau + (base + l[j]))
            m1, s1 = lse_push(m1, s1, a)
            m2, s2 = lse_push(m2, s2, c)
            m3, s3 = lse_push(m3, s3, e)
        phi, log_slope = newton_phi(m1, s1, m2, s2, m3, s3, logit_mu, log_n)
        tau, lo, hi, done = newton_step(tau, lo, hi, phi, log_slope, ulp, phi_floor, cap)
        active = not done
    return tau, count, active


@njit(cache=True)
def _transport_image(b, cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                     assignment, log_s_shifted, log_s, rho, transported, pi, image_real,
                     image_int):
    """(P2) of image ``b`` from its cost (n, m); fills its per-image outputs (module docstring)."""
    n = cost_t.shape[1]
    log_n = math.log(n)
    image_min = math.inf
    for j in range(n):
        column_min = column_softmax(cost_t, eps, assignment, log_s_shifted, b, j)
        log_s[b, j] = column_min  # scratch until the image minimum is known
        image_min = min(image_min, column_min)
    shift = eps * image_min
    value_max, value_min, value_sum = -math.inf, math.inf, 0.0
    for j in range(n):
        value = column_shift(eps, image_min, shift, log_s_shifted, log_s, b, j)
        value_max = max(value_max, value)
        value_min = min(value_min, value)
        value_sum += value
    tau, first, exhausted_first = _newton_image(
        log_s_shifted[b], 0.0, value_max, value_min, logit_mu - value_sum / n, logit_mu, log_n,
        max_iter, ulp, cap, phi_floor,
    )
    delta, second, exhausted_second = _newton_image(
        log_s_shifted[b], tau, tau + value_max, tau + value_min, 0.0, logit_mu, log_n, max_iter,
        ulp, cap, phi_floor,
    )
    inv_n = 1.0 / n
    column_residual, mass = 0.0, 0.0
    for j in range(n):
        residual, column_mass = column_plan(tau, delta, inv_n, log_s_shifted, assignment,
                                            transported, rho, pi, b, j)
        column_residual = max(column_residual, residual)
        mass += column_mass
    image_real[b, 0] = tau + delta
    image_real[b, 1] = shift
    image_real[b, 2] = max(column_residual, abs(mass - mu))
    image_int[b, 0] = first
    image_int[b, 1] = second
    image_int[b, 2] = 1 if (exhausted_first or exhausted_second) else 0


@njit(parallel=True, cache=True)
def transport_cpu(cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor, assignment,
                  log_s_shifted, log_s, rho, transported, pi, image_real, image_int):
    """``refdml_gsp_transport`` CPU twin: (P2) for every image of ``cost_t`` (B, n, m)."""
    for b in prange(cost_t.shape[0]):
        _transport_image(b, cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                         assignment, log_s_shifted, log_s, rho, transported, pi, image_real,
                         image_int)


@njit(parallel=True, cache=True)
def pool_forward_cpu(features, fs, ws_t, scale, eps, mu, logit_mu, max_iter, ulp, cap,
                     phi_floor, p_one, cost_t, assignment, log_s_shifted, log_s, rho,
                     transported, pi, weights, pooled, z, image_real, image_int):
    """``refdml_gsp_pool_forward`` CPU twin: cost map, (P2), weights, pooled (p = 1) and z.

    ``ws_t`` is ``wbar / s`` transposed (d, m), so the cost's inner loop runs over the
    prototypes, contiguous (vectorised, no reduction in the inner loop).
    """
    batch, n, d = fs.shape
    m = ws_t.shape[1]
    s = scale[0]
    for b in prange(batch):
        acc = np.zeros(m, dtype=fs.dtype)
        for j in range(n):
            acc[:] = 0.0
            for k in range(d):
                f = fs[b, j, k]
                for i in range(m):
                    diff = f - ws_t[k, i]
                    acc[i] += diff * diff
            for i in range(m):
                cost_t[b, j, i] = math.sqrt(acc[i]) * s
        _transport_image(b, cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                         assignment, log_s_shifted, log_s, rho, transported, pi, image_real,
                         image_int)
        inv_mu = 1.0 / mu
        for j in range(n):
            weights[b, j] = transported[b, j] * inv_mu
        if p_one:
            total = np.zeros(d)
            for j in range(n):
                w = weights[b, j]
                for k in range(d):
                    total[k] += w * features[b, j, k]
            for k in range(d):
                pooled[b, k] = total[k] * (1.0 / n)
        for i in range(m):
            column = 0.0
            for j in range(n):
                column += pi[b, j, i]
            z[b, i] = column * inv_mu


@njit(cache=True, inline="always")
def _distance_weight(factor, d_column, n_inner, p, c):
    """``W = factor (d_column - n inner) pi / c``; 0 where ``c = 0`` (the subgradient)."""
    if c > 0.0:
        return factor * (d_column - n_inner) * p / c
    return 0.0


@njit(cache=True, inline="always")
def _clip_coefficient(row, norm, radial):
    """``(1 / max(|f|, 1), coefficient of fbar)`` of the features' clip backward."""
    inverse = 1.0 / max(norm, 1.0)
    if norm > 1.0:
        return inverse, inverse * (row - radial)
    return inverse, inverse * row


@njit(parallel=True, cache=True)
def pool_backward_cpu(features, features_bar, features_norm, ws, scale, pi, cost_t, rho,
                      transported, weights, d_pooled, d_z, d_weights_in, direct_in, p_one,
                      eps, mu, distance_weights, d_features):
    """``refdml_gsp_pool_backward`` CPU twin: ``W = d_cost / c'`` (B, n, m) and d features.

    ``p_one``: the direct path is ``w_j d_pooled / n`` (computed here); otherwise
    ``d_weights_in`` (B, n) and ``direct_in`` (B, n, d) come from the caller (GeMean).
    """
    batch, n, d = features.shape
    m = ws.shape[0]
    s = scale[0]
    factor = -eps * s
    inv_n, inv_mu = 1.0 / n, 1.0 / mu
    for b in prange(batch):
        q = np.empty(n)
        kappa, eta = 0.0, 0.0
        for j in range(n):
            q[j], kappa_j, eta_j = pool_backward_column(
                features, d_pooled, d_weights_in, pi, d_z, rho, transported, p_one, inv_n,
                inv_mu, b, j)
            kappa += kappa_j
            eta += eta_j
        ratio = eta / kappa if kappa > 0.0 else 0.0
        acc = np.zeros(d)
        for j in range(n):
            n_inner = n * (q[j] - ratio * rho[b, j])
            row = 0.0
            acc[:] = 0.0
            for i in range(m):
                w = _distance_weight(factor, d_z[b, i] * inv_mu, n_inner, pi[b, j, i],
                                     cost_t[b, j, i])
                distance_weights[b, j, i] = w
                w = distance_weights[b, j, i]  # as stored
                row += w
                for k in range(d):
                    acc[k] -= w * ws[i, k]
            row /= s
            norm = features_norm[b, j]
            bar = min(norm, 1.0)
            radial = row * bar * bar
            for k in range(d):
                radial += features_bar[b, j, k] * acc[k]
            inverse, coefficient = _clip_coefficient(row, norm, radial)
            w_dir = weights[b, j] * inv_n
            for k in range(d):
                if p_one:
                    direct = w_dir * d_pooled[b, k]
                else:
                    direct = direct_in[b, j, k]
                d_features[b, j, k] = (acc[k] * inverse + features_bar[b, j, k] * coefficient
                                       + direct)


@njit(parallel=True, cache=True)
def transport_backward_cpu(pi, rho, transported, d_rho, d_pi, eps, d_cost):
    """``refdml_gsp_transport_backward`` CPU twin: Prop. 4.3 from ``(d_rho, d_pi)``.

    ``d_cost_ji = -ε pi_ji (d_pi_ji - n inner_j)`` with ``inner = q - (eta / kappa) rho``,
    ``q_j = rho_j d_rho_j + sum_i pi_ji d_pi_ji`` (all (B, n, m) arrays in memory order).
    """
    batch, n, m = pi.shape
    for b in prange(batch):
        q = np.empty(n)
        kappa, eta = 0.0, 0.0
        for j in range(n):
            q[j], kappa_j, eta_j = transport_backward_column(pi, d_pi, rho, d_rho, transported,
                                                             b, j)
            kappa += kappa_j
            eta += eta_j
        ratio = eta / kappa if kappa > 0.0 else 0.0
        for j in range(n):
            n_inner = n * (q[j] - ratio * rho[b, j])
            for i in range(m):
                d_cost[b, j, i] = -eps * (pi[b, j, i] * (d_pi[b, j, i] - n_inner))


# --------------------------------------------------------------------------- CUDA kernels
@functools.cache
def cuda_kernels():
    """The ``@cuda.jit`` kernels, built on first use (importing refdml.gpu needs no CUDA).

    Returns ``(refdml_gsp_transport, refdml_gsp_pool_forward, refdml_gsp_pool_backward,
    refdml_gsp_transport_backward)``;
    launch each as ``kernel[B, BLOCK](...)`` with the CPU twin's arguments.
    """
    # the per-column maths, compiled for the device from the CPU twins' source
    softmax_dev = cuda.jit(device=True)(column_softmax.py_func)
    shift_dev = cuda.jit(device=True)(column_shift.py_func)
    plan_dev = cuda.jit(device=True)(column_plan.py_func)
    pool_backward_dev = cuda.jit(device=True)(pool_backward_column.py_func)
    transport_backward_dev = cuda.jit(device=True)(transport_backward_column.py_func)

    @cuda.jit(device=True)
    def tree_width(n):
        """Slots a block reduction over ``n`` columns reads: the power of two >= min(n, BLOCK)."""
        width = 1
        while width < min(n, BLOCK):
            width *= 2
        return width

    @cuda.jit(device=True)
    def block_lse3(sm, m1, s1, m2, s2, m3, s3, tid, width):
        """Three online log-sum-exp states merged over the block (a tree in shared memory)."""
        sm[0, tid], sm[1, tid], sm[2, tid] = m1, s1, m2
        sm[3, tid], sm[4, tid], sm[5, tid] = s2, m3, s3
        cuda.syncthreads()
        stride = width // 2
        while stride > 0:
            if tid < stride:
                o = tid + stride
                sm[0, tid], sm[1, tid] = lse_merge(sm[0, tid], sm[1, tid], sm[0, o], sm[1, o])
                sm[2, tid], sm[3, tid] = lse_merge(sm[2, tid], sm[3, tid], sm[2, o], sm[3, o])
                sm[4, tid], sm[5, tid] = lse_merge(sm[4, tid], sm[5, tid], sm[4, o], sm[5, o])
            cuda.syncthreads()
            stride //= 2
        r0, r1, r2, r3, r4, r5 = sm[0, 0], sm[1, 0], sm[2, 0], sm[3, 0], sm[4, 0], sm[5, 0]
        cuda.syncthreads()  # every thread has read the root before the next reduction
        return r0, r1, r2, r3, r4, r5

    @cuda.jit(device=True)
    def block_reduce4(sm, a, b, c, e, tid, width):
        """Block-wide ``(max a, min b, sum c, sum e)``; unused slots take neutral values."""
        sm[0, tid], sm[1, tid], sm[2, tid], sm[3, tid] = a, b, c, e
        cuda.syncthreads()
        stride = width // 2
        while stride > 0:
            if tid < stride:
                o = tid + stride
                sm[0, tid] = max(sm[0, tid], sm[0, o])
                sm[1, tid] = min(sm[1, tid], sm[1, o])
                sm[2, tid] = sm[2, tid] + sm[2, o]
                sm[3, tid] = sm[3, tid] + sm[3, o]
            cuda.syncthreads()
            stride //= 2
        r0, r1, r2, r3 = sm[0, 0], sm[1, 0], sm[2, 0], sm[3, 0]
        cuda.syncthreads()
        return r0, r1, r2, r3

    @cuda.jit(device=True)
    def n_inner_block(sm, b, tid, kappa, eta, rho, scratch):
        """Backward (Prop. 4.3): sums the threads' ``kappa`` and ``eta`` over the block, then
        ``scratch[b, j] = n inner_j = n (q_j - (eta / kappa) rho_j)`` from ``q_j`` there."""
        n = rho.shape[1]
        _, _, kappa, eta = block_reduce4(sm, 0.0, 0.0, kappa, eta, tid, tree_width(n))
        ratio = eta / kappa if kappa > 0.0 else 0.0
        j = tid
        while j < n:
            scratch[b, j] = n * (scratch[b, j] - ratio * rho[b, j])
            j += BLOCK
        cuda.syncthreads()

    @cuda.jit(device=True)
    def newton_block(sm, l, b, tid, base, value_max, value_min, tau0, logit_mu, log_n,
                     max_iter, ulp, cap, phi_floor):
        n = l.shape[1]
        width = tree_width(n)
        tau, lo, hi, active = newton_start(logit_mu, value_max, value_min, tau0, ulp)
        count = 0
        while active and count < max_iter:
            count += 1
            m1, s1, m2, s2, m3, s3 = -math.inf, 0.0, -math.inf, 0.0, -math.inf, 0.0
            j = tid
            while j < n:
                a, c, e = column_terms(tau + (base + l[b, j]))
                m1, s1 = lse_push(m1, s1, a)
                m2, s2 = lse_push(m2, s2, c)
                m3, s3 = lse_push(m3, s3, e)
                j += BLOCK
            m1, s1, m2, s2, m3, s3 = block_lse3(sm, m1, s1, m2, s2, m3, s3, tid, width)
            phi, log_slope = newton_phi(m1, s1, m2, s2, m3, s3, logit_mu, log_n)
            tau, lo, hi, done = newton_step(tau, lo, hi, phi, log_slope, ulp, phi_floor, cap)
            active = not done
        return tau, count, active

    @cuda.jit(device=True)
    def transport_block(sm, b, tid, cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                        assignment, log_s_shifted, log_s, rho, transported, pi, image_real,
                        image_int):
        n = cost_t.shape[1]
        width = tree_width(n)
        log_n = math.log(n)
        image_min = math.inf
        j = tid
        while j < n:
            column_min = softmax_dev(cost_t, eps, assignment, log_s_shifted, b, j)
            log_s[b, j] = column_min
            image_min = min(image_min, column_min)
            j += BLOCK
        _, image_min, _, _ = block_reduce4(sm, 0.0, image_min, 0.0, 0.0, tid, width)
        shift = eps * image_min
        value_max, value_min, value_sum = -math.inf, math.inf, 0.0
        j = tid
        while j < n:
            value = shift_dev(eps, image_min, shift, log_s_shifted, log_s, b, j)
            value_max = max(value_max, value)
            value_min = min(value_min, value)
            value_sum += value
            j += BLOCK
        value_max, value_min, value_sum, _ = block_reduce4(sm, value_max, value_min,
                                                           value_sum, 0.0, tid, width)
        tau, first, exhausted_first = newton_block(
            sm, log_s_shifted, b, tid, 0.0, value_max, value_min, logit_mu - value_sum / n,
            logit_mu, log_n, max_iter, ulp, cap, phi_floor,
        )
        delta, second, exhausted_second = newton_block(
            sm, log_s_shifted, b, tid, tau, tau + value_max, tau + value_min, 0.0, logit_mu,
            log_n, max_iter, ulp, cap, phi_floor,
        )
        inv_n = 1.0 / n
        column_residual, mass = 0.0, 0.0
        j = tid
        while j < n:
            residual, column_mass = plan_dev(tau, delta, inv_n, log_s_shifted, assignment,
                                             transported, rho, pi, b, j)
            column_residual = max(column_residual, residual)
            mass += column_mass
            j += BLOCK
        column_residual, _, mass, _ = block_reduce4(sm, column_residual, 0.0, mass, 0.0, tid,
                                                    width)
        if tid == 0:
            image_real[b, 0] = tau + delta
            image_real[b, 1] = shift
            image_real[b, 2] = max(column_residual, abs(mass - mu))
            image_int[b, 0] = first
            image_int[b, 1] = second
            image_int[b, 2] = 1 if (exhausted_first or exhausted_second) else 0

    @cuda.jit
    def refdml_gsp_transport(cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                             assignment, log_s_shifted, log_s, rho, transported, pi,
                             image_real, image_int):
        b = cuda.blockIdx.x
        if b >= cost_t.shape[0]:
            return
        sm = cuda.shared.array((6, BLOCK), float64)
        transport_block(sm, b, cuda.threadIdx.x, cost_t, eps, mu, logit_mu, max_iter, ulp, cap,
                        phi_floor, assignment, log_s_shifted, log_s, rho, transported, pi,
                        image_real, image_int)

    @cuda.jit
    def refdml_gsp_pool_forward(features, fs, ws_t, scale, eps, mu, logit_mu, max_iter, ulp,
                                cap, phi_floor, p_one, cost_t, assignment, log_s_shifted,
                                log_s, rho, transported, pi, weights, pooled, z, image_real,
                                image_int):
        b = cuda.blockIdx.x
        if b >= fs.shape[0]:
            return
        tid = cuda.threadIdx.x
        n, d = fs.shape[1], fs.shape[2]
        m = ws_t.shape[1]
        s = scale[0]
        sm = cuda.shared.array((6, BLOCK), float64)
        pair = tid
        while pair < n * m:
            j, i = pair // m, pair % m
            diff = fs[b, j, 0] - ws_t[0, i]
            acc = diff * diff  # accumulated in the input's dtype
            for k in range(1, d):
                diff = fs[b, j, k] - ws_t[k, i]
                acc += diff * diff
            cost_t[b, j, i] = math.sqrt(acc) * s
            pair += BLOCK
        cuda.syncthreads()
        transport_block(sm, b, tid, cost_t, eps, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                        assignment, log_s_shifted, log_s, rho, transported, pi, image_real,
                        image_int)
        inv_mu = 1.0 / mu
        j = tid
        while j < n:
            weights[b, j] = transported[b, j] * inv_mu
            j += BLOCK
        cuda.syncthreads()
        if p_one:
            k = tid
            while k < d:
                total = 0.0
                for j in range(n):
                    total += weights[b, j] * features[b, j, k]
                pooled[b, k] = total * (1.0 / n)
                k += BLOCK
        i = tid
        while i < m:
            column = 0.0
            for j in range(n):
                column += pi[b, j, i]
            z[b, i] = column * inv_mu
            i += BLOCK

    @cuda.jit
    def refdml_gsp_pool_backward(features, features_bar, features_norm, ws, scale, pi, cost_t,
                                 rho, transported, weights, d_pooled, d_z, d_weights_in,
                                 direct_in, p_one, eps, mu, distance_weights, d_features,
                                 scratch):
        """``scratch`` (B, n) float64: ``q_j``, then ``n inner_j``, then the clip coefficient."""
        b = cuda.blockIdx.x
        if b >= features.shape[0]:
            return
        tid = cuda.threadIdx.x
        n, d = features.shape[1], features.shape[2]
        m = ws.shape[0]
        s = scale[0]
        factor = -eps * s
        inv_n, inv_mu = 1.0 / n, 1.0 / mu
        sm = cuda.shared.array((6, BLOCK), float64)
        kappa, eta = 0.0, 0.0
        j = tid
        while j < n:
            scratch[b, j], kappa_j, eta_j = pool_backward_dev(
                features, d_pooled, d_weights_in, pi, d_z, rho, transported, p_one, inv_n,
                inv_mu, b, j)
            kappa += kappa_j
            eta += eta_j
            j += BLOCK
        n_inner_block(sm, b, tid, kappa, eta, rho, scratch)
        pair = tid
        while pair < n * m:
            j, i = pair // m, pair % m
            distance_weights[b, j, i] = _distance_weight(
                factor, d_z[b, i] * inv_mu, scratch[b, j], pi[b, j, i], cost_t[b, j, i]
            )
            pair += BLOCK
        cuda.syncthreads()
        pair = tid
        while pair < n * d:
            j, k = pair // d, pair % d
            acc = 0.0
            for i in range(m):
                acc -= distance_weights[b, j, i] * ws[i, k]
            d_features[b, j, k] = acc
            pair += BLOCK
        cuda.syncthreads()
        j = tid
        while j < n:
            row = 0.0
            for i in range(m):
                row += distance_weights[b, j, i]
            row /= s
            norm = features_norm[b, j]
            bar = min(norm, 1.0)
            radial = row * bar * bar
            for k in range(d):
                radial += features_bar[b, j, k] * d_features[b, j, k]
            _, scratch[b, j] = _clip_coefficient(row, norm, radial)
            j += BLOCK
        cuda.syncthreads()
        pair = tid
        while pair < n * d:
            j, k = pair // d, pair % d
            inverse = 1.0 / max(features_norm[b, j], 1.0)
            if p_one:
                direct = weights[b, j] * inv_n * d_pooled[b, k]
            else:
                direct = direct_in[b, j, k]
            d_features[b, j, k] = (d_features[b, j, k] * inverse
                                   + features_bar[b, j, k] * scratch[b, j] + direct)
            pair += BLOCK

    @cuda.jit
    def refdml_gsp_transport_backward(pi, rho, transported, d_rho, d_pi, eps, d_cost,
                                      scratch):
        """``scratch`` (B, n) float64: ``q_j``, then ``n inner_j``."""
        b = cuda.blockIdx.x
        if b >= pi.shape[0]:
            return
        tid = cuda.threadIdx.x
        n, m = pi.shape[1], pi.shape[2]
        sm = cuda.shared.array((6, BLOCK), float64)
        kappa, eta = 0.0, 0.0
        j = tid
        while j < n:
            scratch[b, j], kappa_j, eta_j = transport_backward_dev(pi, d_pi, rho, d_rho,
                                                                   transported, b, j)
            kappa += kappa_j
            eta += eta_j
            j += BLOCK
        n_inner_block(sm, b, tid, kappa, eta, rho, scratch)
        pair = tid
        while pair < n * m:
            j, i = pair // m, pair % m
            d_cost[b, j, i] = -eps * (pi[b, j, i] * (d_pi[b, j, i] - scratch[b, j]))
            pair += BLOCK

    return (refdml_gsp_transport, refdml_gsp_pool_forward, refdml_gsp_pool_backward,
            refdml_gsp_transport_backward)
