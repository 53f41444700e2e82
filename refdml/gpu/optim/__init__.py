"""Fused optimiser updates over flat parameter buffers: every parameter of an
optimiser at once, in three passes (prepare, check, commit).

:class:`refdml.train.optim.Optimizer` keeps its parameters, their gradients and its buffers
in flat arrays (one per dtype) and calls :func:`fused_step` once per step instead of
updating parameter after parameter: on CuPy three kernel launches replace the per-parameter
code's dozens of launches per parameter and its host read, and nothing is copied to
the device in a step (the per-parameter numbers wait there, :mod:`._layout`'s ``plan``). The rules (SGD, Adam, AdamW),
the arguments' layout and the all-or-nothing status: :mod:`refdml.gpu.optim._compiled` and
:mod:`refdml.gpu.optim._layout`.

The implementations (:data:`IMPLEMENTATIONS`, registered in :mod:`refdml.gpu.families`):

``array`` (:class:`~refdml.gpu.optim._array.ArrayPath`)
    The three passes as array code (NumPy or CuPy), the kernels' reference.
``cpu`` (:class:`~refdml.gpu.optim._kernels.CpuPath`)
    The compiled CPU twins, ``"auto"`` on NumPy.
``cuda`` (:class:`~refdml.gpu.optim._kernels.CudaPath`)
    Two CUDA kernels, ``"auto"`` on CuPy.

Precision: every path makes the per-parameter code's operations in its order, in the
buffers' dtype (no fast-math flags). It is not bit for bit the per-parameter step on
every machine: the bias corrections ``beta**t`` come from the platform's ``pow`` (NumPy's
may be SVML's on AVX-512, the kernels' libdevice's), within an ulp of Python's, and CUDA
contracts a product and a sum into an FMA; tests/train/test_optim_fused.py holds each
path to the per-parameter step within 4 units of roundoff of the dtype.
"""

from __future__ import annotations

from typing import Any

from refdml._backend import get_backend
from refdml.gpu.optim._kernels import IMPLEMENTATIONS
from refdml.gpu.optim._layout import (  # noqa: F401 - the layout, for refdml.train.optim
    ACTIVE, BAD_GRAD, BAD_UPDATE, BETA1, BETA2, DECAY, GATE, LR, N_COEF, N_PLAN, N_SCALARS,
    OFFSET, RULES, SCALARS, SQRT_BC2, STEP)

#: The public names; the layout's constants (``ACTIVE``, ``GATE``, ...) are importable from
#: here too, for the optimiser that fills the arrays (:mod:`refdml.gpu.optim._layout`).
__all__ = ["IMPLEMENTATIONS", "RULES", "first_nonfinite", "fused_step"]


def first_nonfinite(array: Any, checks: Any, slot: int) -> None:
    """``checks[slot]`` (an int64 array of the array's module): the flat index (C order) of
    ``array``'s first NaN or inf entry, or -1 when all are finite; nothing read on the host
    (one launch on CuPy under "auto"). A step's own checks, which :func:`fused_step`'s
    ``checks`` then read to gate the update."""
    flat = array.reshape(-1)
    if not flat.flags.c_contiguous:
        flat = get_backend(array).xp.ascontiguousarray(flat)
    IMPLEMENTATIONS.choose(flat).first_nonfinite(get_backend(flat, checks), flat, checks,
                                                 int(slot))


def fused_step(rule: str, hyper: dict[str, Any], values: Any, grads: Any, b1: Any, b2: Any,
               segment: Any, plan: Any, coef: Any, scalars: Any, status: Any,
               clock: Any, checks: Any) -> None:
    """One step of ``rule`` (``"sgd"``, ``"adam"``, ``"adamw"``) on the flat buffers, in place.

    ``values``, ``grads``: the flat parameters and gradients (n,), one float dtype;
    ``b1``, ``b2``: the rule's flat buffers (n,), or arrays of one element where the rule
    keeps none (SGD: ``b2``, and ``b1`` without momentum); ``segment`` (n,) int32: each
    element's parameter; ``plan`` (P, N_PLAN) float64: per parameter (:mod:`._layout`);
    ``coef`` (P, N_COEF): a workspace of the dtype, written from ``plan``; ``scalars``
    (N_SCALARS,) and ``hyper`` (a dict of the same constants as host numbers of the
    dtype): the rule's constants; ``status`` (3,) int64: read and updated (its ``GATE``
    slot closed here when ``checks``, (k,) int64 (:func:`first_nonfinite`'s slots, k may
    be 0), holds an index); ``clock`` (1,) int64: the steps counted on the device (one
    more after the call). All of one module (NumPy or CuPy). Nothing is read on the host:
    the caller reads ``status``.
    """
    if rule not in RULES:
        raise ValueError(f"rule == {rule!r}, must be one of {tuple(RULES)}")
    backend = get_backend(values, grads, b1, b2, segment, plan, coef, scalars, status, clock,
                          checks)
    IMPLEMENTATIONS.choose(values).step(backend, RULES[rule], hyper, values, grads, b1, b2,
                                        segment, plan, coef, scalars, status, clock, checks)
