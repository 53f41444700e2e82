"""Fused optimiser updates, array path: the two passes of :mod:`refdml.gpu.optim._compiled`
written once against the backend (NumPy or CuPy), what the kernels are checked against.

The interface of every member (:class:`ArrayPath`, and the compiled ones of
:mod:`refdml.gpu.optim._kernels`): ``step(backend, rule, hyper, values, grads, b1, b2,
segment, plan, coef, scalars, status, clock, checks)`` runs the preparation, check and
commit passes on the flat buffers in place (nothing is read on the host); and
``first_nonfinite(backend, flat, checks, slot)`` writes one of the step's own checks. ``hyper`` holds the
rule's constants as host numbers already cast to the buffers' dtype (the array path
branches on them on the host), ``scalars`` the same constants on the device (the kernels
read them there).
"""

from __future__ import annotations

from typing import Any

from refdml._backend import Backend
from refdml.gpu.optim._layout import (ACTIVE, BAD_GRAD, BAD_UPDATE, BETA1, BETA2, DECAY, GATE,
                                      LR, OFFSET, SQRT_BC2, STEP)

__all__ = ["ArrayPath"]


class ArrayPath:
    """The array path (module docstring)."""

    def first_nonfinite(self, backend: Backend, flat: Any, checks: Any, slot: int) -> None:
        xp = backend.xp
        finite = xp.isfinite(flat)
        checks[slot:slot + 1] = xp.where(finite.all(), -1, xp.argmin(finite))

    def step(self, backend: Backend, rule: int, hyper: dict[str, Any], values: Any, grads: Any,
             b1: Any, b2: Any, segment: Any, plan: Any, coef: Any, scalars: Any, status: Any,
             clock: Any, checks: Any) -> None:
        xp = backend.xp
        n = values.shape[0]
        if checks.shape[0]:
            status[GATE:GATE + 1] += (checks >= 0).any()
        # the preparation: each segment's own step t and its bias corrections, in float64
        t = (clock + 1).astype(xp.float64) - plan[:, OFFSET]
        with backend.errstate(over="ignore", invalid="ignore", divide="ignore"):
            prepared = (plan[:, ACTIVE], plan[:, LR], plan[:, DECAY],
                        xp.sqrt(1.0 - plan[:, BETA2] ** t), plan[:, LR] / (1.0 - plan[:, BETA1] ** t))
        for column, value in zip((ACTIVE, LR, DECAY, SQRT_BC2, STEP), prepared):
            coef[:, column] = value           # rounded to the buffers' dtype by the store
        clock += 1
        per = coef[segment]                       # (n, N_COEF): each element's segment row
        active = per[:, ACTIVE] != 0
        with backend.errstate(over="ignore", invalid="ignore", divide="ignore"):
            bad_grad = active & ~xp.isfinite(grads)
            w, m, v = self._propose(xp, rule, hyper, values, grads, b1, b2, per)
            finite = xp.isfinite(w)
            if m is not None:
                finite &= xp.isfinite(m)
            if v is not None:
                finite &= xp.isfinite(v)
            bad_update = active & ~bad_grad & ~finite
        for slot, bad in ((BAD_GRAD, bad_grad), (BAD_UPDATE, bad_update)):
            first = xp.where(bad.any(), xp.argmax(bad), n)
            status[slot:slot + 1] = xp.minimum(status[slot], first)
        clean = (status[BAD_GRAD] == n) & (status[BAD_UPDATE] == n) & (status[GATE] == 0)
        write = active & clean
        xp.copyto(values, w, where=write)
        if m is not None:
            xp.copyto(b1, m, where=write)
        if v is not None:
            xp.copyto(b2, v, where=write)

    @staticmethod
    def _propose(xp: Any, rule: int, hyper: dict[str, Any], w: Any, g: Any, b1: Any, b2: Any,
                 per: Any) -> tuple[Any, Any, Any]:
        """Every element's ``(w, b1, b2)`` proposal (None for a buffer the rule lacks), the
        operations of :func:`refdml.gpu.optim._compiled.propose` in its order."""
        if rule == 0:
            if hyper["weight_decay"] != 0:
                g = g + hyper["weight_decay"] * w
            m = None
            if hyper["has_momentum"]:
                m = b1 * hyper["momentum"]
                m = m + g
                g = g + hyper["momentum"] * m if hyper["nesterov"] else m
            return w - per[:, LR] * g, m, None
        if hyper["weight_decay"] != 0:
            if rule == 2:
                w = w * per[:, DECAY]
            else:
                g = g + hyper["weight_decay"] * w
        m = b1 * hyper["beta1"]
        m = m + hyper["one_minus_beta1"] * g
        q = g * g
        q = q * hyper["one_minus_beta2"]
        v = b2 * hyper["beta2"]
        v = v + q
        u = xp.sqrt(v)
        u = u / per[:, SQRT_BC2]
        u = u + hyper["eps"]
        u = m / u
        u = u * per[:, STEP]
        return w - u, m, v
