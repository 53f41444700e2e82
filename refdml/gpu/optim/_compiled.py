r"""Fused optimiser updates, scalar maths and compiled CPU twin (one source for both targets).

:func:`propose` is one element's update, the rules of :mod:`refdml.train.optim` written
for one value ``w``, its gradient ``g`` and its two buffers, in the order of operations of
the per-parameter code there (each product and sum rounded where that code rounds it, in
the parameters' dtype: the hyperparameters arrive already cast to it, as NumPy casts a
Python float beside a float32 array):

``SGD`` (rule 0)
    ``g <- g + wd w`` (when ``wd != 0``); with momentum ``v <- mu v; v <- v + g`` and
    ``g <- g + mu v`` (Nesterov) or ``g <- v``; ``w <- w - lr g``.
``Adam`` (rule 1, coupled decay ``g <- g + wd w``) and ``AdamW`` (rule 2, ``w <- w decay``)
    ``m <- beta1 m; m <- m + (1 - beta1) g``; ``q <- g g; q <- q (1 - beta2)``;
    ``v <- beta2 v; v <- v + q``; ``u <- sqrt(v); u <- u / sqrt(bc2); u <- u + eps;
    u <- m / u; u <- u step``; ``w <- w - u`` with ``step = lr / bc1``.

The per-parameter numbers (effective learning rate, AdamW's decay factor, the bias
corrections) come per segment (one segment per parameter) in ``coef``; the rule's
constants in ``scalars`` (the layout: :mod:`refdml.gpu.optim._layout`). An element of a frozen segment
(``coef[s, ACTIVE] == 0``) is neither read nor written.

A step makes three passes (the CUDA kernels of :mod:`refdml.gpu.optim._cuda` one launch
each; nothing crosses to or from the host, so a step can be captured and replayed):
:func:`prepare_cpu` writes ``coef`` from ``plan`` (float64, changed on the host only when a
learning rate, the frozen set or a step offset changes) and the device's step count
``clock``: a segment's own step is ``t = clock + 1 - offset``, its bias corrections
``1 - beta**t`` computed in float64 as the per-parameter code computes them, then
rounded to the buffers' dtype by the store. :func:`check_cpu` and :func:`commit_cpu` are
the other two: the first finds the
first active element whose gradient is not finite (``status[BAD_GRAD]``) and the first
whose proposed value or buffer is not finite (``status[BAD_UPDATE]``), as flat indices
(``n`` when there is none; a smaller index found earlier stays: the status is sticky until
the caller resets it); the second counts the step on ``clock`` and writes every active
element's proposal only when the status is clean and ``status[GATE] == 0`` (the caller's
other checks of the step passed). All or nothing, as the per-parameter step.
"""

from __future__ import annotations

import math

from refdml.gpu._support.jit import njit
from refdml.gpu.optim._layout import (ACTIVE, BAD_GRAD, BAD_UPDATE, BETA1, BETA2, DECAY, GATE,
                                      LR, OFFSET, SQRT_BC2, STEP)

__all__ = ["bias_corrections", "check_cpu", "commit_cpu", "first_nonfinite_cpu", "prepare_cpu",
           "propose"]

@njit(cache=True, inline="always")
def propose(rule, w, g, b1, b2, lr, decay, sqrt_bc2, step, s0, s1, s2, s3, s4, s5):
    """One element's new ``(w, b1, b2)`` under ``rule`` (module docstring)."""
    if rule == 0:
        momentum, wd, nesterov, has_momentum = s0, s1, s2, s3
        if wd != 0:
            g = g + wd * w
        if has_momentum != 0:
            b1 = b1 * momentum
            b1 = b1 + g
            if nesterov != 0:
                g = g + momentum * b1
            else:
                g = b1
        return w - lr * g, b1, b2
    beta1, omb1, beta2, omb2, eps, wd = s0, s1, s2, s3, s4, s5
    if wd != 0:
        if rule == 2:
            w = w * decay
        else:
            g = g + wd * w
    b1 = b1 * beta1
    b1 = b1 + omb1 * g
    q = g * g
    q = q * omb2
    b2 = b2 * beta2
    b2 = b2 + q
    u = math.sqrt(b2)
    u = u / sqrt_bc2
    u = u + eps
    u = b1 / u
    u = u * step
    return w - u, b1, b2


@njit(cache=True, inline="always")
def bias_corrections(offset, beta1, beta2, clock):
    """``(sqrt(1 - beta2**t), 1 - beta1**t)`` of a segment at step ``clock + 1``, in float64."""
    t = float(clock + 1) - offset
    return math.sqrt(1.0 - math.pow(beta2, t)), 1.0 - math.pow(beta1, t)


@njit(cache=True)
def prepare_cpu(plan, clock, coef, checks, status):
    """The preparation pass, every segment; a failed check of the step (``checks[j] >= 0``)
    closes the gate (``status[GATE]``, sticky)."""
    for j in range(checks.shape[0]):
        if checks[j] >= 0:
            status[GATE] = 1
    for s in range(plan.shape[0]):            # a frozen row too: its ACTIVE becomes 0
        sqrt_bc2, bc1 = bias_corrections(plan[s, OFFSET], plan[s, BETA1], plan[s, BETA2],
                                         clock[0])
        coef[s, ACTIVE] = plan[s, ACTIVE]
        coef[s, LR] = plan[s, LR]
        coef[s, DECAY] = plan[s, DECAY]
        coef[s, SQRT_BC2] = sqrt_bc2
        coef[s, STEP] = plan[s, LR] / bc1


@njit(cache=True)
def check_cpu(rule, values, grads, b1, b2, segment, coef, scalars, status):
    """The first pass (module docstring): non-finite gradients and proposals into ``status``."""
    n = values.shape[0]
    has1 = b1.shape[0] == n
    has2 = b2.shape[0] == n
    s0, s1, s2, s3, s4, s5 = (scalars[0], scalars[1], scalars[2], scalars[3], scalars[4],
                              scalars[5])
    for i in range(n):
        seg = segment[i]
        if coef[seg, ACTIVE] == 0:
            continue
        g = grads[i]
        if not math.isfinite(g):
            if i < status[BAD_GRAD]:
                status[BAD_GRAD] = i
            continue
        w, m, v = propose(rule, values[i], g, b1[i if has1 else 0], b2[i if has2 else 0],
                          coef[seg, LR], coef[seg, DECAY], coef[seg, SQRT_BC2], coef[seg, STEP],
                          s0, s1, s2, s3, s4, s5)
        if not (math.isfinite(w) and (not has1 or math.isfinite(m))
                and (not has2 or math.isfinite(v))):
            if i < status[BAD_UPDATE]:
                status[BAD_UPDATE] = i


@njit(cache=True)
def commit_cpu(rule, values, grads, b1, b2, segment, coef, scalars, status, clock):
    """The last pass: count the step on ``clock``; write every active element's proposal
    when ``status`` is clean."""
    clock[0] += 1
    n = values.shape[0]
    if status[BAD_GRAD] < n or status[BAD_UPDATE] < n or status[GATE] != 0:
        return
    has1 = b1.shape[0] == n
    has2 = b2.shape[0] == n
    s0, s1, s2, s3, s4, s5 = (scalars[0], scalars[1], scalars[2], scalars[3], scalars[4],
                              scalars[5])
    for i in range(n):
        seg = segment[i]
        if coef[seg, ACTIVE] == 0:
            continue
        w, m, v = propose(rule, values[i], grads[i], b1[i if has1 else 0], b2[i if has2 else 0],
                          coef[seg, LR], coef[seg, DECAY], coef[seg, SQRT_BC2], coef[seg, STEP],
                          s0, s1, s2, s3, s4, s5)
        values[i] = w
        if has1:
            b1[i] = m
        if has2:
            b2[i] = v


@njit(cache=True)
def first_nonfinite_cpu(flat, checks, slot):
    """``checks[slot]``: the flat index of the first entry of ``flat`` that is NaN or inf,
    or -1 when every entry is finite (the step's gate: :func:`refdml.gpu.optim.gate_on_finite`)."""
    checks[slot] = -1
    for i in range(flat.shape[0]):
        if not math.isfinite(flat[i]):
            checks[slot] = i
            return
