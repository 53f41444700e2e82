"""Fused optimiser updates, CUDA kernels: the three passes of a step, one launch each.

The rules, their scalar maths (:func:`refdml.gpu.optim._compiled.propose`, one source for
both targets) and the meaning of every argument: :mod:`refdml.gpu.optim._compiled`. One
thread per element of the flat buffers (``BLOCK`` a block).

``refdml_first_nonfinite``
    One block: the first non-finite entry of a small array into a slot of ``checks`` (the
    step's own checks, which gate its update; :func:`refdml.gpu.optim.first_nonfinite`).
``refdml_optim_prepare``
    Thread 0 closes the gate when a slot of ``checks`` holds an index; thread ``s`` writes row ``s`` of ``coef`` (:func:`~refdml.gpu.optim._compiled.bias_corrections`:
    libdevice's ``pow`` and ``sqrt`` in float64, within an ulp of the host's).
``refdml_optim_check``
    Thread ``i`` of an active segment records ``i`` into ``status[BAD_GRAD]`` when its
    gradient is not finite, else into ``status[BAD_UPDATE]`` when its proposed value or a
    buffer is not finite (``cuda.atomic.min``: the smallest such index wins, whatever the
    order the threads run in, so the result is the CPU twin's).
``refdml_optim_commit``
    Thread 0 counts the step on ``clock`` (no thread of this launch reads it; the next
    step's preparation, a later launch on the stream, does). Every thread reads the finished ``status`` (the launch after the check's, on the same
    stream) and, when it is clean and the gate is open, writes its element's proposal: the
    same call of :func:`propose` on the same inputs as in the check. The compiler may
    contract a product and a sum into an FMA in both launches alike, so the value written
    is the value checked (and may differ from the CPU twin's in the last bit).
"""

from __future__ import annotations

import math

import numpy as np

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu.optim._compiled import bias_corrections, propose
from refdml.gpu.optim._layout import (ACTIVE, BAD_GRAD, BAD_UPDATE, BETA1, BETA2, DECAY, GATE,
                                      LR, OFFSET, SQRT_BC2, STEP)

__all__ = ["CHECK_BLOCK", "refdml_first_nonfinite", "refdml_optim_check", "refdml_optim_commit",
           "refdml_optim_prepare"]

#: Threads of the one block of :func:`refdml_first_nonfinite`.
CHECK_BLOCK = 256

_SIGNATURE = ("void(int64, {dt}[::1], {dt}[::1], {dt}[::1], {dt}[::1], int32[::1], "
              "{dt}[:, ::1], {dt}[::1], int64[::1])")
_SIGNATURES = {dt: _SIGNATURE.format(dt=dt) for dt in ("float32", "float64")}
_COMMIT_SIGNATURES = {dt: _SIGNATURE.format(dt=dt).replace(")", ", int64[::1])")
                      for dt in ("float32", "float64")}


@cuda_kernel(cache=True, family="optim", signatures={
    dt: f"void(float64[:, ::1], int64[::1], {dt}[:, ::1], int64[::1], int64[::1])"
    for dt in ("float32", "float64")})
def refdml_optim_prepare(plan, clock, coef, checks, status):
    """The preparation pass: row ``s`` of ``coef``, one thread per segment; thread 0 closes
    the gate (``status[GATE] = 1``, sticky) when a check of the step failed."""
    s = cuda.grid(1)
    if s == 0:
        for j in range(checks.shape[0]):
            if checks[j] >= 0:
                status[GATE] = 1
    if s < plan.shape[0]:                     # a frozen row too: its ACTIVE becomes 0
        sqrt_bc2, bc1 = bias_corrections(plan[s, OFFSET], plan[s, BETA1], plan[s, BETA2],
                                         clock[0])
        coef[s, ACTIVE] = plan[s, ACTIVE]
        coef[s, LR] = plan[s, LR]
        coef[s, DECAY] = plan[s, DECAY]
        coef[s, SQRT_BC2] = sqrt_bc2
        coef[s, STEP] = plan[s, LR] / bc1


@cuda_kernel(cache=True, family="optim", signatures=_SIGNATURES)
def refdml_optim_check(rule, values, grads, b1, b2, segment, coef, scalars, status):
    """The first pass: non-finite gradients and proposals into ``status`` (module docstring)."""
    i = cuda.grid(1)
    n = values.shape[0]
    if i >= n:
        return
    seg = segment[i]
    if coef[seg, ACTIVE] == 0:
        return
    g = grads[i]
    if not math.isfinite(g):
        cuda.atomic.min(status, BAD_GRAD, i)
        return
    has1 = b1.shape[0] == n
    has2 = b2.shape[0] == n
    w, m, v = propose(rule, values[i], g, b1[i if has1 else 0], b2[i if has2 else 0],
                      coef[seg, LR], coef[seg, DECAY], coef[seg, SQRT_BC2], coef[seg, STEP],
                      scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5])
    if not (math.isfinite(w) and (not has1 or math.isfinite(m))
            and (not has2 or math.isfinite(v))):
        cuda.atomic.min(status, BAD_UPDATE, i)


@cuda_kernel(cache=True, family="optim", signatures=_COMMIT_SIGNATURES)
def refdml_optim_commit(rule, values, grads, b1, b2, segment, coef, scalars, status, clock):
    """The last pass: the step counted; every active element's proposal, written when
    ``status`` is clean."""
    i = cuda.grid(1)
    if i == 0:
        clock[0] += 1
    n = values.shape[0]
    if i >= n or status[BAD_GRAD] < n or status[BAD_UPDATE] < n or status[GATE] != 0:
        return
    seg = segment[i]
    if coef[seg, ACTIVE] == 0:
        return
    has1 = b1.shape[0] == n
    has2 = b2.shape[0] == n
    w, m, v = propose(rule, values[i], grads[i], b1[i if has1 else 0], b2[i if has2 else 0],
                      coef[seg, LR], coef[seg, DECAY], coef[seg, SQRT_BC2], coef[seg, STEP],
                      scalars[0], scalars[1], scalars[2], scalars[3], scalars[4], scalars[5])
    values[i] = w
    if has1:
        b1[i] = m
    if has2:
        b2[i] = v


@cuda_kernel(cache=True, family="optim", signatures={
    dt: f"void({dt}[::1], int64[::1], int64)" for dt in ("float32", "float64")})
def refdml_first_nonfinite(flat, checks, slot):
    """``checks[slot]``: the first non-finite entry's flat index, or -1: ONE block of
    ``CHECK_BLOCK`` threads, each scanning a stride of the array, then a tree minimum in
    shared memory; thread 0 writes the slot (no other launch sets it first). Meant for the
    step's small arrays (the loss, the objective's gradient of the outputs)."""
    s_first = cuda.shared.array(CHECK_BLOCK, dtype=np.int64)
    t = cuda.threadIdx.x
    n = flat.shape[0]
    first = n
    i = t
    while i < n:
        if not math.isfinite(flat[i]):
            first = i                  # the first of this thread's stride
            break
        i += CHECK_BLOCK
    s_first[t] = first
    cuda.syncthreads()
    width = CHECK_BLOCK // 2
    while width > 0:
        if t < width and s_first[t + width] < s_first[t]:
            s_first[t] = s_first[t + width]
        cuda.syncthreads()
        width //= 2
    if t == 0:
        checks[slot] = -1 if s_first[0] == n else s_first[0]
