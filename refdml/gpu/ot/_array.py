"""The array path of the OT family: :class:`ArrayPath`, written once against the backend.

The family's interface (the methods of :class:`ArrayPath`) is what the solver
(:mod:`refdml.gpu.ot._sinkhorn`) and the pairs (:mod:`refdml.gpu.ot._pairs`) call on the
implementation that the public function chose; the compiled implementations
(:class:`refdml.gpu.ot._kernels.CpuPath`, :class:`~refdml.gpu.ot._kernels.CudaPath`) have
the same methods and replace the steps they have kernels for. The array code itself lives
in the topical modules beside this one: :mod:`~refdml.gpu.ot._sinkhorn` (the batched
solver), :mod:`~refdml.gpu.ot._common` (checks, the scaled solve, the ground and pair
costs), :mod:`~refdml.gpu.ot._pairs` (many pairs) and :mod:`~refdml.gpu.ot._small` (the
driver of the small-problem kernels).
"""

from __future__ import annotations

from refdml.gpu.ot._common import _cloud_sq, _cross_sq
from refdml.gpu.ot._sinkhorn import lse_half_step

__all__ = ["ArrayPath"]


class ArrayPath:
    """The array path of the OT family (NumPy or CuPy), and the family's interface.

    ``kind``: ``"array"`` (``"cpu"``, ``"cuda"`` for the compiled members).

    ``lse_half_step(xp, scaled_cost, potential, log_weight, previous=None, out=None)``:
    ``f_i = -LSE_j(log_weight_j + potential_j - S_ij)`` (P, n) for ``S`` (P, n, m), the half
    step of the batched solver; ``previous`` (the potential this step replaces) and ``out``
    (a work buffer) are hints an implementation may use
    (:func:`refdml.gpu.ot._sinkhorn.lse_half_step`).

    ``takes_small(n, m)``: whether :meth:`solve_small` solves problems of ``n`` x ``m``
    points (the small-problem kernel; the array path has none: False, and the batched loop
    solves every problem).

    ``solve_small(xp, a, b, cost, *, schedule, stage_tol, max_iter, symmetric, tiny, high,
    low)``: P problems by the small-problem kernel, every eps-scaling stage inside it: a
    :class:`refdml.gpu.ot._small.SmallSolution` of arrays of ``xp`` (the driver
    :func:`refdml.gpu.ot._kernels.solve_small`). Called only where :meth:`takes_small`.

    ``cross_sq(xp, clouds, first, second)``: ``||x_i - y_j||^2`` (K, n, n) for the pairs of
    two different clouds (``first[k]``, ``second[k]``) of ``clouds`` (B, n, d) in the unit
    ball. ``self_sq(xp, clouds, selves)``: the same (S, n, n) for each cloud ``selves[s]``
    with itself, exactly symmetric with a 0 diagonal. Pairs nearer than ``1e-3`` of
    ``|x_i|^2 + |y_j|^2`` are recomputed from explicit differences where the backend
    refines them (the family docstring).
    """

    kind = "array"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def lse_half_step(self, xp, scaled_cost, potential, log_weight, previous=None, out=None):
        """:func:`refdml.gpu.ot._sinkhorn.lse_half_step` (class docstring)."""
        return lse_half_step(xp, scaled_cost, potential, log_weight, previous, out)

    def takes_small(self, n: int, m: int) -> bool:
        """False: the array path has no small-problem kernel (class docstring)."""
        return False

    def solve_small(self, xp, a, b, cost, **settings):
        """Not on the array path (:meth:`takes_small` is False; class docstring)."""
        raise NotImplementedError("the array path has no small-problem kernel "
                                  "(takes_small is False): the batched loop solves every problem")

    def cross_sq(self, xp, clouds, first, second):
        """:func:`refdml.gpu.ot._common._cross_sq` (class docstring)."""
        return _cross_sq(xp, clouds, first, second)

    def self_sq(self, xp, clouds, selves):
        """:func:`refdml.gpu.ot._common._cloud_sq` of each cloud with itself (class docstring)."""
        own = clouds[selves]
        return _cloud_sq(xp, own, own, True)
