"""Fast-path mirror of :func:`refdml.kcenter.greedy_k_center` (NumPy or CuPy, float32/64).

Same maths, signature and result type as the reference (read its module docstring):
farthest-first traversal, ``k`` picks, each the point farthest from the current centres,

.. math::
    q_{t+1} = \\arg\\max_i \\; m_t(i), \\qquad
    m_{t+1}(i) = \\min\\big(m_t(i),\\; \\max(|x_i|^2 - 2 \\langle x_i, x_{q}\\rangle + |x_q|^2, 0)\\big),

with ``m(q) = -1`` marking a centre (never picked twice, even among duplicates), ties
of the arg-max broken by the lowest index (NumPy's and CuPy's ``argmax``), and the
covering radius after each pick ``sqrt(max(max_i m(i), 0))``.

**What differs from the reference, and why.** The reference runs its readable traversal
only (three passes over the points per pick; it imports no compiled code). The fast path
runs the same traversal on CuPy arrays and in float32 too, and compiled: one fused pass
per pick on the CPU, one launch per pick on a GPU. float32 keeps the input dtype
throughout (radii to about 1e-6 relative; a pick can differ from the float64 one only
where two candidates' distances agree to float32 rounding).

**Implementations** (:data:`IMPLEMENTATIONS`, chosen once per call under
:func:`refdml.gpu.use_kernels`): given the scaled points, the starting distances and the
first pick, each runs the traversal by one method,
``farthest_first(backend, points, k, min_sq, first) -> (indices, radii)``
(:class:`~refdml.gpu.kcenter._array.ArrayPath` states the interface):

``array`` (:class:`~refdml.gpu.kcenter._array.ArrayPath`)
    Written once against the backend, NumPy or CuPy: the reference's arithmetic,
    operation for operation, three array passes per pick and no synchronisation inside the
    loop (:mod:`refdml.gpu.kcenter._array`).
``cpu`` (:class:`~refdml.gpu.kcenter._kernels.CpuPath`)
    The compiled CPU twin :func:`refdml.gpu.kcenter._compiled.farthest_first_cpu`: the
    fast path's compiled form of the reference's traversal (the reference itself no longer
    runs it), one fused pass over the points per pick. ``"auto"`` on NumPy.
``cuda`` (:class:`~refdml.gpu.kcenter._kernels.CudaPath`)
    The CUDA kernels of :mod:`refdml.gpu.kcenter._cuda`: a transposed copy of the points
    made once per call, then one launch per pick (update, block arg-max and, in the last
    block to finish, the pick), reading the points coalesced. ``"auto"`` on CuPy. Their
    module, and ``numba.cuda``, load on first use.

``"auto"`` runs the paths measured faster (see ``IMPLEMENTATIONS.measured``). The starting
distances to ``initial`` centres are the array code's on every path.

Precision, and where the paths differ: the array path on NumPy float64 makes the
reference's picks and radii bit for bit (the same operations in the same order). The CPU
twin and the CUDA kernels accumulate the dot products in float64 in another order (the
twin vectorised, the kernels with FMA where a GPU contracts), and the array path on CuPy
sums its rows by CuPy's reductions: their float64 picks are the reference's while the
farthest point leads by more than the rounding bound of the Gram identity, radii within
it (tests/_kcenter_checks.py states the bound; identical points still tie exactly, lowest
index first).

Synchronisations on CuPy (results that must reach Python, or checks of the data):
``initial_radius`` (a Python float, like the reference; one sync when ``initial`` is
given), the range and count checks of an index ``initial`` (two syncs), and the
finiteness check of ``points`` / ``initial`` (see :mod:`refdml._validation`).
``indices`` (int64) and ``radii`` (input dtype) are arrays of the input's module.
Scale: points (and centres) are divided by one power of two (exact) as in the reference.
"""

from refdml.gpu.kcenter._kernels import IMPLEMENTATIONS
from refdml.gpu.kcenter._mirrors import greedy_k_center
from refdml.kcenter import KCenterResult

__all__ = ["KCenterResult", "greedy_k_center"]
