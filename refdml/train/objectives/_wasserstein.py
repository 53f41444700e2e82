r"""``WassersteinObjective``: the Wasserstein DML losses (WDML Eqs. 1-2) on local features.

Its outputs are the LOCAL features ``(B, n, d)`` (image ``i`` is the uniform measure on
``features[i]``): the model for it ends before pooling (e.g. ``Conv2d ... LocalLinear``,
no GAP/GSP head), since ``d_w`` compares whole sets of features. ``kind="contrastive"``
is :func:`refdml.ot.wcontrastive_forward` (Eq. 1), ``kind="triplet"``
:func:`refdml.ot.wtriplet_forward` (Eq. 2), both on every pair / triplet of the batch;
``reference=False`` runs their mirrors in :mod:`refdml.gpu.ot`. ``margin`` is the paper's
``gamma`` in the units of ``d_w`` (ground cost ``||x - y||^p``); ``eps`` the entropic
regularisation (a temperature, in cost units); the solver's ``max_iter``, ``tol``,
``eps_scaling`` and ``value`` are passed through. No parameters of its own.
"""

from __future__ import annotations

from refdml._validation import _describe, check_choice, check_scalar
from refdml.ot._sinkhorn import VALUES, _check_solver_args
from refdml.train._operators import check_reference, operators
from refdml.train.objectives._base import Objective, check_d_value, labels_on_device

__all__ = ["WassersteinObjective"]

KINDS = ("contrastive", "triplet")


class WassersteinObjective(Objective):
    """Wasserstein contrastive or triplet loss on local features ``(B, n, d)``.

    Parameters
    ----------
    kind : ``"contrastive"`` (Eq. 1) or ``"triplet"`` (Eq. 2)
    margin : float >= 0
        The paper's ``gamma``.
    eps : float > 0
        Entropic regularisation of ``d_w`` (cost units).
    p : float >= 1
        Ground-cost exponent (1: ``d_w`` approximates ``W_1``).
    value : ``"regularized"`` or ``"transport_cost"``
        Which Sinkhorn value ``d_w`` is (see :mod:`refdml.ot`).
    max_iter, tol, eps_scaling
        Sinkhorn solver settings.
    reference : bool
        Run :mod:`refdml.ot` instead of :mod:`refdml.gpu.ot`.
    """

    def __init__(self, kind: str = "contrastive", *, margin: float, eps: float, p: float = 1,
                 value: str = "regularized", max_iter: int = 1000, tol: float = 1e-9,
                 eps_scaling=None, reference: bool = False, name: str = "wasserstein") -> None:
        super().__init__(name)
        self.kind = check_choice(kind, "kind", KINDS)
        self.reference = check_reference(reference)
        # The loss checks these again with the same names; early checks fail at build time.
        check_scalar(margin, "margin", low=0.0)
        check_scalar(p, "p", low=1.0)
        check_choice(value, "value", VALUES)
        _check_solver_args(eps, max_iter, tol, eps_scaling)
        self.settings = dict(margin=margin, eps=eps, p=p, value=value, max_iter=max_iter,
                             tol=tol, eps_scaling=eps_scaling)

    def forward(self, outputs, labels):
        """``(value, ctx)``; ``outputs`` the local features (B, n, d)."""
        if isinstance(outputs, (tuple, list)) or getattr(outputs, "ndim", None) != 3:
            shape = tuple(outputs.shape) if hasattr(outputs, "shape") else _describe(outputs)
            raise ValueError(
                f"{self.name}: outputs must be local features (B, n, d), got {shape}; the "
                "model for a Wasserstein objective ends before pooling")
        ops = operators(self.reference)
        forward = (ops.wcontrastive if self.kind == "contrastive" else ops.wtriplet).forward
        value, inner = forward(outputs, labels_on_device(labels, outputs), **self.settings)
        return value, self._context(inner, self.reference, (tuple(outputs.shape),))

    def backward(self, ctx, d_value=1.0):
        """``d_features`` (B, n, d) of ``d_value * value``."""
        ctx = self._unwrap(ctx)
        ops = operators(ctx.reference)
        backward = (ops.wcontrastive if self.kind == "contrastive" else ops.wtriplet).backward
        return backward(ctx.inner, check_d_value(d_value)).features
