r"""The GSP layer's CUDA kernels: one block of ``BLOCK`` threads per image.

The maths, the layout, the dtype rules and the CPU twins: :mod:`refdml.gpu.gsp._compiled`,
whose scalar and per-column functions these kernels call (compiled for the device from the
same source). Launch each kernel with ``cuda_launch(kernel, B, BLOCK, ...)`` and the
arguments of its CPU twin, the fields of its parameter groups flattened in order (the
dataclasses of :mod:`refdml.gpu.gsp._compiled`); the backward kernels take a (B, 3n) float64
:class:`~refdml.gpu.gsp._compiled.Scratch` last. Compiled at their first launch, or loaded from
numba-cuda's cache: importing this module needs no GPU.

What is not shared with the CPU twins, and why: the evaluations of ``phi`` (and of the
residual, ``sum w``, the largest ``w``), which here are tree reductions over the block's
threads in shared memory (:func:`phi_block`, :func:`block_lse3`, ...) and there loops over
one image's columns. Every decision taken on their results (the pivot search's, Newton's
step, the marginal centre) is the CPU twin's own ``@njit`` function.
"""

from __future__ import annotations

import math

from numba import float64

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu._support.scalar import lse_merge, lse_push, lse_value
from refdml.gpu._support.launch import BLOCK
from refdml.gpu.gsp._compiled import (
    SEARCH_BOUNDS,
    SEARCH_DONE,
    clip_coefficient,
    GRADIENT_NOT_FINITE,
    UPSTREAM_NOT_FINITE,
    clip_row,
    column_plan,
    column_rank,
    column_softmax,
    column_terms,
    cost_gradient,
    distance_weight,
    given_log_s,
    image_report,
    newton_phi,
    newton_start,
    newton_step,
    nonfinite,
    points_status,
    pool_backward_column,
    power_of_two_scale,
    prototype_backward_row,
    relative_log_s,
    search_advance,
    search_query,
    search_start,
    transport_backward_column,
)

__all__ = ["refdml_gsp_normalise", "refdml_gsp_pool_backward", "refdml_gsp_pool_forward",
           "refdml_gsp_prototypes_backward", "refdml_gsp_transport",
           "refdml_gsp_transport_backward"]


def _launch_signatures(dt):
    """The Numba signature of each kernel's launch (:mod:`refdml.gpu.gsp._kernels`) for
    inputs of dtype ``dt``, in the order of its parameter groups (the dataclasses of
    :mod:`refdml.gpu.gsp._compiled`): arrays C-contiguous, ``order`` / ``counts`` int64, the
    scratch float64, Python floats float64, ``max_iter`` int64, ``p_one`` a bool
    (tests/conftest.py checks every simulated launch against these)."""
    a1, a2, a3 = f"{dt}[::1]", f"{dt}[:, ::1]", f"{dt}[:, :, ::1]"
    count = "int64[:, ::1]"
    status = "int64[::1]"
    scratch = "float64[:, ::1]"
    # SolverConstants: inverse_temperature, mu, logit_mu, max_iter, ulp, cap, phi_floor, tol
    solver = "float64, float64, float64, int64, float64, float64, float64, float64"
    # ImageOutputs: assignment, lam, log_s, rho, transported, pi, order, log_t, t, residual,
    # counts
    outputs = f"{a3}, {a2}, {a2}, {a2}, {a2}, {a3}, {count}, {a1}, {a1}, {a1}, {count}"
    # PoolSaved: features, features_bar, features_norm, prototypes_bar, scale, assignment,
    # cost_t, rho, transported, weights, inverse_temperature, mu
    saved = f"{a3}, {a3}, {a2}, {a2}, {a1}, {a3}, {a3}, {a2}, {a2}, {a2}, float64, float64"
    return {
        # NormaliseInputs, NormaliseOutputs
        "refdml_gsp_normalise": f"void({a3}, {a3}, {a3}, {a2}, {a3}, {a2}, {a1})",
        "refdml_gsp_transport": f"void({a3}, {solver}, {outputs})",
        # PoolInputs (features, features_bar, prototypes_bar, peaks, p_one, tiny),
    # SolverConstants, ImageOutputs, PoolOutputs (scale, cost_t, weights,
        # pooled, z)
        "refdml_gsp_pool_forward": (f"void({a3}, {a3}, {a2}, {a1}, boolean, float64, "
                                    f"{solver}, {outputs}, {a1}, {a3}, {a2}, {a2}, {a2})"),
        # PoolSaved, PoolUpstream (d_pooled, d_z, d_weights, direct, p_one), PoolGradients
        # (distance_weights, d_features, column_sums, status), the scratch
        "refdml_gsp_pool_backward": (f"void({saved}, {a2}, {a2}, {a2}, {a3}, boolean, "
                                     f"{a3}, {a3}, {scratch}, {status}, {scratch})"),
        # PrototypesSaved, PrototypesUpstream, PrototypesGradient (d_prototypes, status)
        "refdml_gsp_prototypes_backward": (f"void({a2}, {a1}, {a1}, {scratch}, {a2}, {a2}, "
                                           f"{status})"),
        # TransportSaved, TransportUpstream, TransportGradient
        "refdml_gsp_transport_backward": (f"void({a3}, {a2}, {a2}, float64, {a2}, {a3}, "
                                          f"{a3}, {scratch})"),
    }


def _signatures(name):
    """Kernel ``name``'s launch types for float32 and float64 inputs."""
    return {dt: _launch_signatures(dt)[name] for dt in ("float32", "float64")}


# --------------------------------------------------------------------------- CUDA kernels
# The per-column maths, compiled for the device from the CPU twins' source; then the block
# reductions and the kernels. All at module level, so that numba-cuda's on-disk cache
# (``cache=True``, NUMBA_CACHE_DIR) keys each kernel by its code alone: a kernel built in a
# factory is keyed by its closure too, and these closures pickle differently in every
# process (they reach Numba CPU dispatchers, each pickled with a fresh uuid), so the cache
# never hit and every process compiled the four kernels again (docs/gpu.md, "First use
# compiles", says where the cache is; docs/results/gpu.md has its effect on the H200).
softmax_dev = cuda.jit(device=True)(column_softmax.py_func)
search_query_dev = cuda.jit(device=True)(search_query.py_func)
search_advance_dev = cuda.jit(device=True)(search_advance.py_func)
rank_dev = cuda.jit(device=True)(column_rank.py_func)
plan_dev = cuda.jit(device=True)(column_plan.py_func)
pool_backward_dev = cuda.jit(device=True)(pool_backward_column.py_func)
transport_backward_dev = cuda.jit(device=True)(transport_backward_column.py_func)
clip_row_dev = cuda.jit(device=True)(clip_row.py_func)
prototype_backward_dev = cuda.jit(device=True)(prototype_backward_row.py_func)
image_report_dev = cuda.jit(device=True)(image_report.py_func)
nonfinite_dev = cuda.jit(device=True)(nonfinite.py_func)
points_status_dev = cuda.jit(device=True)(points_status.py_func)


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
def block_argmax_sum(sm, w, value, index, total, tid, width):
    """Block-wide ``value`` at the largest ``w`` (least ``index`` on a tie), ``sum total``."""
    sm[0, tid], sm[1, tid], sm[2, tid], sm[3, tid] = w, value, index, total
    cuda.syncthreads()
    stride = width // 2
    while stride > 0:
        if tid < stride:
            o = tid + stride
            if sm[0, o] > sm[0, tid] or (sm[0, o] == sm[0, tid] and sm[2, o] < sm[2, tid]):
                sm[0, tid], sm[1, tid], sm[2, tid] = sm[0, o], sm[1, o], sm[2, o]
            sm[3, tid] = sm[3, tid] + sm[3, o]
        cuda.syncthreads()
        stride //= 2
    r1, r3 = sm[1, 0], sm[3, 0]
    cuda.syncthreads()
    return r1, r3


@cuda.jit(device=True)
def marginal_block(sm, b, tid, rho, transported, scratch):
    """Backward (Prop. 4.3): ``scratch[b, 2n + j]`` from ``b_j`` to ``w_j (b_j - bbar)``
    (``w = rho sigma``; the difference against the block's largest ``w``)."""
    n = rho.shape[1]
    width = tree_width(n)
    best, b_best, index, kappa = -1.0, 0.0, 0.0, 0.0
    j = tid
    while j < n:
        w = rho[b, j] * transported[b, j]
        kappa += w
        if w > best:  # threads visit their columns in increasing j: the first max
            best, b_best, index = w, scratch[b, 2 * n + j], float(j)
        j += BLOCK
    b_top, kappa = block_argmax_sum(sm, best, b_best, index if best >= 0.0 else 1e300,
                                    kappa, tid, width)
    total = 0.0
    j = tid
    while j < n:
        total += rho[b, j] * transported[b, j] * (b_top - scratch[b, 2 * n + j])
        j += BLOCK
    _, _, total, _ = block_reduce4(sm, 0.0, 0.0, total, 0.0, tid, width)
    mean_offset = total / kappa if kappa > 0.0 else 0.0
    j = tid
    while j < n:
        scratch[b, 2 * n + j] = rho[b, j] * transported[b, j] * (
            (scratch[b, 2 * n + j] - b_top) + mean_offset)
        j += BLOCK
    cuda.syncthreads()


@cuda.jit(device=True)
def phi_block(sm, b, tid, y, inverse_temperature, column_min, lam, pivot, logit_mu):
    """``phi(y)`` in the coordinates of column ``pivot``, and max/min of ``l - l_p``."""
    n = column_min.shape[1]
    width = tree_width(n)
    pivot_min, pivot_lam = column_min[b, pivot], lam[b, pivot]
    m1, s1, m2, s2 = -math.inf, 0.0, -math.inf, 0.0
    top, bottom = -math.inf, math.inf
    j = tid
    while j < n:
        relative = relative_log_s(inverse_temperature, column_min[b, j], lam[b, j], pivot_min,
                                  pivot_lam)
        top, bottom = max(top, relative), min(bottom, relative)
        log_sig, log_one_minus, _ = column_terms(y + relative)
        m1, s1 = lse_push(m1, s1, log_sig)
        m2, s2 = lse_push(m2, s2, log_one_minus)
        j += BLOCK
    m1, s1, m2, s2, _, _ = block_lse3(sm, m1, s1, m2, s2, -math.inf, 0.0, tid, width)
    top, bottom, _, _ = block_reduce4(sm, top, bottom, 0.0, 0.0, tid, width)
    return lse_value(m1, s1) - lse_value(m2, s2) - logit_mu, top, bottom


@cuda.jit(device=True)
def newton_block(sm, b, tid, inverse_temperature, column_min, lam, pivot, lo, hi, logit_mu,
                 log_n, max_iter, ulp, cap, phi_floor):
    """The CPU twin's ``_newton_image``, each ``phi`` and its slope a block reduction."""
    n = column_min.shape[1]
    width = tree_width(n)
    pivot_min, pivot_lam = column_min[b, pivot], lam[b, pivot]
    y, active = newton_start(lo, hi, 0.0, ulp)
    count = 0
    while active and count < max_iter:
        count += 1
        m1, s1, m2, s2, m3, s3 = -math.inf, 0.0, -math.inf, 0.0, -math.inf, 0.0
        j = tid
        while j < n:
            a, c, e = column_terms(y + relative_log_s(inverse_temperature, column_min[b, j],
                                                      lam[b, j], pivot_min, pivot_lam))
            m1, s1 = lse_push(m1, s1, a)
            m2, s2 = lse_push(m2, s2, c)
            m3, s3 = lse_push(m3, s3, e)
            j += BLOCK
        m1, s1, m2, s2, m3, s3 = block_lse3(sm, m1, s1, m2, s2, m3, s3, tid, width)
        phi, log_slope = newton_phi(m1, s1, m2, s2, m3, s3, logit_mu, log_n)
        y, lo, hi, done = newton_step(y, lo, hi, phi, log_slope, ulp, phi_floor, cap)
        active = not done
    return y, count, active


@cuda.jit(device=True)
def transport_block(sm, b, tid, cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                    phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order, log_t,
                    t, residual, counts):
    """The CPU twin's ``_transport_image``, one column per thread (strided): the same pivot
    search (:func:`refdml.gpu.gsp._compiled.search_advance`), each ``phi`` a block reduction;
    every thread takes the same decisions from the block's reductions (lock-step)."""
    n = cost_t.shape[1]
    log_n = math.log(n)
    j = tid
    while j < n:
        softmax_dev(cost_t, inverse_temperature, assignment, log_s, lam, b, j)
        j += BLOCK
    cuda.syncthreads()
    j = tid
    while j < n:
        order[b, rank_dev(log_s, b, j)] = j
        j += BLOCK
    cuda.syncthreads()
    state = search_start(n)
    evaluations = 0
    while state[0] != SEARCH_DONE:
        pivot, y = search_query_dev(state, order, b)
        phi, top, bottom = phi_block(sm, b, tid, y, inverse_temperature, log_s, lam, pivot,
                                     logit_mu)
        if state[0] != SEARCH_BOUNDS:   # the reference counts the search's evaluations of g
            evaluations += 1
        state = search_advance_dev(state, phi, top, bottom, order, inverse_temperature, log_s,
                                   lam, logit_mu, b)
    lo, hi = state[3], state[4]
    pivot = state[10] if state[5] else state[9]
    y, steps, exhausted = newton_block(sm, b, tid, inverse_temperature, log_s, lam, pivot, lo,
                                       hi, logit_mu, log_n, max_iter, ulp, cap, phi_floor)
    pivot_min, pivot_lam = log_s[b, pivot], lam[b, pivot]
    cuda.syncthreads()  # every thread holds the pivot's values before the plan rewrites log_s
    inv_n = 1.0 / n
    column_residual, mass = 0.0, 0.0
    j = tid
    while j < n:
        column, column_mass = plan_dev(y, inverse_temperature, pivot_min, pivot_lam, inv_n,
                                       log_s, lam, assignment, transported, rho, pi, b, j)
        column_residual = max(column_residual, column)
        mass += column_mass
        j += BLOCK
    column_residual, _, mass, _ = block_reduce4(sm, column_residual, 0.0, mass, 0.0, tid,
                                                tree_width(n))
    if tid == 0:
        image_report_dev(b, y - given_log_s(inverse_temperature, pivot_min, pivot_lam),
                         column_residual, mass, mu, tol, evaluations, steps, exhausted, log_t,
                         t, residual, counts)


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_transport"))
def refdml_gsp_transport(cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                         phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order,
                         log_t, t, residual, counts):
    b = cuda.blockIdx.x
    if b >= cost_t.shape[0]:
        return
    sm = cuda.shared.array((6, BLOCK), float64)
    transport_block(sm, b, cuda.threadIdx.x, cost_t, inverse_temperature, mu, logit_mu,
                    max_iter, ulp, cap, phi_floor, tol, assignment, lam, log_s, rho, transported,
                    pi, order, log_t, t, residual, counts)


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_normalise"))
def refdml_gsp_normalise(features, prototypes, features_bar, features_norm, prototypes_bar,
                         prototypes_norm, peaks):
    """Blocks ``0..B-1`` clip image ``b``'s features, block ``B`` the prototypes ((1, m, ·)
    views), one row per thread (:func:`clip_row`); each block's largest ``||bar||`` goes to
    ``peaks[block]`` (NaN where a norm of the block is not finite: the count of those rides
    in the reduction's free slot), which the forward kernel reduces into ``s`` and the
    points' check."""
    block = cuda.blockIdx.x
    batch = features.shape[0]
    if block > batch:
        return
    tid = cuda.threadIdx.x
    sm = cuda.shared.array((6, BLOCK), float64)
    peak, bad = 0.0, 0.0
    if block < batch:
        rows = features.shape[1]
        j = tid
        while j < rows:
            peak = max(peak, clip_row_dev(features, features_bar, features_norm, block, j))
            bad += nonfinite_dev(features_norm[block, j])
            j += BLOCK
    else:
        rows = prototypes.shape[1]
        j = tid
        while j < rows:
            peak = max(peak, clip_row_dev(prototypes, prototypes_bar, prototypes_norm, 0, j))
            bad += nonfinite_dev(prototypes_norm[0, j])
            j += BLOCK
    peak, _, bad, _ = block_reduce4(sm, peak, 0.0, bad, 0.0, tid, tree_width(rows))
    if tid == 0:
        peaks[block] = peak if bad == 0.0 else math.nan


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_pool_forward"))
def refdml_gsp_pool_forward(features, features_bar, prototypes_bar, peaks, p_one, tiny,
                            inverse_temperature, mu, logit_mu, max_iter, ulp, cap, phi_floor,
                            tol, assignment, lam, log_s, rho, transported, pi, order, log_t, t,
                            residual, counts, scale, cost_t, weights, pooled, z):
    b = cuda.blockIdx.x
    if b >= features_bar.shape[0]:
        return
    tid = cuda.threadIdx.x
    n, d = features_bar.shape[1], features_bar.shape[2]
    m = prototypes_bar.shape[0]
    # Every block reduces the B + 1 peaks itself (a few hundred reads): no launch between.
    peak, status = points_status_dev(peaks, tiny)
    s = power_of_two_scale(peak)
    if b == 0 and tid == 0:
        scale[0] = s
    sm = cuda.shared.array((6, BLOCK), float64)
    pair = tid
    while pair < n * m:
        j, i = pair // m, pair % m
        # fbar / s and wbar / s are exact (s a power of two); the squares summed in float64,
        # as the CPU twin
        diff = float(features_bar[b, j, 0]) / s - float(prototypes_bar[i, 0]) / s
        acc = diff * diff
        for k in range(1, d):
            diff = float(features_bar[b, j, k]) / s - float(prototypes_bar[i, k]) / s
            acc += diff * diff
        cost_t[b, j, i] = math.sqrt(acc) * s
        pair += BLOCK
    cuda.syncthreads()
    transport_block(sm, b, tid, cost_t, inverse_temperature, mu, logit_mu, max_iter, ulp, cap,
                    phi_floor, tol, assignment, lam, log_s, rho, transported, pi, order, log_t,
                    t, residual, counts)
    if tid == 0:  # the thread that wrote the summary (program order: no barrier needed)
        counts[b, 3] = status
    inv_mu = 1.0 / mu
    j = tid
    while j < n:
        weights[b, j] = transported[b, j] * inv_mu
        j += BLOCK
    cuda.syncthreads()
    if p_one:
        inv_n = 1.0 / n
        k = tid
        while k < d:
            total = 0.0
            for j in range(n):  # float64, as the CPU twin: (w_j / n) f_j, never beyond max f
                total += (weights[b, j] * inv_n) * features[b, j, k]
            pooled[b, k] = total
            k += BLOCK
    i = tid
    while i < m:
        column = 0.0
        for j in range(n):
            column += pi[b, j, i]
        z[b, i] = column * inv_mu
        i += BLOCK


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_pool_backward"))
def refdml_gsp_pool_backward(features, features_bar, features_norm, prototypes_bar, scale,
                             assignment, cost_t, rho, transported, weights, inverse_temperature,
                             mu, d_pooled, d_z, d_weights, direct, p_one, distance_weights,
                             d_features, column_sums, status, scratch):
    """``scratch`` (B, 3n) float64: ``mu r_j`` (:func:`pool_backward_column`),
    ``offset_j``, ``b_j`` then ``w_j (b_j - bbar)`` (docs/gsp.md Sec. 3); the first n
    slots then hold the clip coefficient. ``column_sums`` (B, m) float64: ``sum_j W_ji``
    (for :func:`refdml_gsp_prototypes_backward`); ``status`` (B,): the image's upstream
    and gradient checks (the CPU twin's), two counts summed over the block."""
    b = cuda.blockIdx.x
    if b >= features.shape[0]:
        return
    tid = cuda.threadIdx.x
    n, d = features.shape[1], features.shape[2]
    m = prototypes_bar.shape[0]
    s = scale[0]
    factor = -inverse_temperature * s
    inv_n, inv_mu = 1.0 / n, 1.0 / mu
    sm = cuda.shared.array((6, BLOCK), float64)
    j = tid
    while j < n:
        scratch[b, j], scratch[b, n + j], scratch[b, 2 * n + j], _ = pool_backward_dev(
            features, d_pooled, d_weights, assignment, d_z, rho, transported, p_one,
            inv_n, inv_mu, b, j)
        j += BLOCK
    cuda.syncthreads()
    marginal_block(sm, b, tid, rho, transported, scratch)
    pair = tid
    while pair < n * m:
        j, i = pair // m, pair % m
        gradient = cost_gradient(factor, assignment[b, j, i], transported[b, j] * inv_n,
                                 (d_z[b, i] - scratch[b, j]) * inv_mu, scratch[b, n + j],
                                 scratch[b, 2 * n + j])
        distance_weights[b, j, i] = distance_weight(gradient, cost_t[b, j, i])
        pair += BLOCK
    cuda.syncthreads()
    i = tid
    while i < m:
        column = 0.0
        for j in range(n):
            column += distance_weights[b, j, i]
        column_sums[b, i] = column
        i += BLOCK
    pair = tid
    while pair < n * d:
        j, k = pair // d, pair % d
        acc = 0.0
        for i in range(m):
            # wbar / s in the input's dtype (exact: a power of two), as the CPU twin
            acc -= distance_weights[b, j, i] * (prototypes_bar[i, k] / s)
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
        _, scratch[b, j] = clip_coefficient(row, norm, radial)
        j += BLOCK
    cuda.syncthreads()
    bad_gradient = 0.0
    pair = tid
    while pair < n * d:
        j, k = pair // d, pair % d
        inverse = 1.0 / max(features_norm[b, j], 1.0)
        if p_one:
            along = weights[b, j] * inv_n * d_pooled[b, k]
        else:
            along = direct[b, j, k]
        d_features[b, j, k] = (d_features[b, j, k] * inverse
                               + features_bar[b, j, k] * scratch[b, j] + along)
        bad_gradient += nonfinite_dev(d_features[b, j, k])
        pair += BLOCK
    bad_upstream = 0.0
    k = tid
    while k < d:
        bad_upstream += nonfinite_dev(d_pooled[b, k])
        k += BLOCK
    i = tid
    while i < m:
        bad_upstream += nonfinite_dev(d_z[b, i])
        i += BLOCK
    # every thread holding a count is below BLOCK: the tree over the whole block
    _, _, bad_upstream, bad_gradient = block_reduce4(sm, 0.0, 0.0, bad_upstream, bad_gradient,
                                                     tid, BLOCK)
    if tid == 0:
        status[b] = ((UPSTREAM_NOT_FINITE if bad_upstream > 0.0 else 0)
                     | (GRADIENT_NOT_FINITE if bad_gradient > 0.0 else 0))


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_prototypes_backward"))
def refdml_gsp_prototypes_backward(prototypes_bar, prototypes_norm, scale, column_sums, product,
                                   d_prototypes, status):
    """One prototype per thread (:func:`prototype_backward_row`): ``ceil(m / BLOCK)`` blocks;
    ``status[i]`` the row's check."""
    i = cuda.blockIdx.x * BLOCK + cuda.threadIdx.x
    if i < prototypes_bar.shape[0]:
        status[i] = prototype_backward_dev(prototypes_bar, prototypes_norm, scale, column_sums,
                                           product, d_prototypes, i)


@cuda_kernel(cache=True, signatures=_signatures("refdml_gsp_transport_backward"))
def refdml_gsp_transport_backward(assignment, rho, transported, inverse_temperature, d_rho,
                                  d_pi, d_cost, scratch):
    """``scratch`` (B, 3n) float64: ``r_j``, ``offset_j``, ``b_j`` then ``w_j (b_j - bbar)``."""
    b = cuda.blockIdx.x
    if b >= assignment.shape[0]:
        return
    tid = cuda.threadIdx.x
    n, m = assignment.shape[1], assignment.shape[2]
    sm = cuda.shared.array((6, BLOCK), float64)
    j = tid
    while j < n:
        scratch[b, j], scratch[b, n + j], scratch[b, 2 * n + j], _ = transport_backward_dev(
            assignment, d_pi, rho, d_rho, transported, b, j)
        j += BLOCK
    cuda.syncthreads()
    marginal_block(sm, b, tid, rho, transported, scratch)
    pair = tid
    while pair < n * m:
        j, i = pair // m, pair % m
        d_cost[b, j, i] = cost_gradient(
            -inverse_temperature, assignment[b, j, i], transported[b, j] / n,
            d_pi[b, j, i] - scratch[b, j], scratch[b, n + j], scratch[b, 2 * n + j])
        pair += BLOCK
