"""Fast-path mirror of :func:`refdml.kcenter.greedy_k_center` (NumPy or CuPy, float32/64).

Same maths, signature and result type as the reference (read its module docstring):
farthest-first traversal, ``k`` picks, each the point farthest from the current centres,

.. math::
    q_{t+1} = \\arg\\max_i \\; m_t(i), \\qquad
    m_{t+1}(i) = \\min\\big(m_t(i),\\; \\max(|x_i|^2 - 2 \\langle x_i, x_{q}\\rangle + |x_q|^2, 0)\\big),

with ``m(q) = -1`` marking a centre (never picked twice, even among duplicates), ties
of the arg-max broken by the lowest index (NumPy's and CuPy's ``argmax``), and the
covering radius after each pick ``sqrt(max(max_i m(i), 0))``. The arithmetic is the
reference's, operation for operation, so in float64 on NumPy the picks and radii are the
reference's bit for bit; float32 keeps the input dtype throughout (radii to about 1e-6
relative; a pick can differ from the float64 one only where two candidates' distances
agree to float32 rounding).

Per pick (no loop over points, no host round trip): the row dots ``<x_i, x_q>`` (exact
products and one row sum each, no BLAS: a mat-vec rounds identical rows differently by
their position, and the arg-max among duplicates would then depend on the CPU), one
fused elementwise update of ``m``, one arg-max; the arg-max that chooses the next pick
also gives the radius of the current set (``m`` at the arg-max is its maximum), so the
radius costs a gather, not a second reduction. The pick index stays a 1-element device
array used to gather ``x_q`` and to mark ``m(q) = -1``: no synchronisation inside the
loop. The loop over the ``k`` picks is sequential by nature (each pick depends on the
previous one).

Implementations (:data:`TRAVERSAL`, chosen once per call by
:meth:`~refdml.gpu._support.modes.Implementations.choose`): the traversal, given the scaled
points, the starting distances and the first pick, is one of three objects with one method,
``farthest_first(xp, points, k, min_sq, first) -> (indices, radii)``:

``array`` (:class:`ArrayTraversal`)
    The array code described here, on NumPy or CuPy.
``cpu`` (:class:`CpuTraversal`)
    The compiled CPU twin :func:`refdml.gpu.kcenter._compiled.farthest_first_cpu` (the
    reference's own traversal): one fused pass over the points per pick.
``cuda`` (:class:`CudaTraversal`)
    The CUDA kernels of :mod:`refdml.gpu.kcenter._cuda`: a transposed copy of the
    points made once per call, then one launch per pick (update, block arg-max and, in the
    last block to finish, the pick), reading the points coalesced.

With ``use_kernels("auto")`` a NumPy input runs the CPU twin and a CuPy input the CUDA
kernels, the faster paths as measured (``TRAVERSAL.measured``). The starting distances to
``initial`` centres are the array code's on every path.

Synchronisations on CuPy (results that must reach Python, or checks of the data):
``initial_radius`` (a Python float, like the reference; one sync when ``initial`` is
given), the range and count checks of an index ``initial`` (two syncs), and the
finiteness check of ``points`` / ``initial`` (see :mod:`refdml._validation`).
``indices`` (int64) and ``radii`` (input dtype) are arrays of the input's module.
Scale: points (and centres) are divided by one power of two (exact) as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.gpu._support.modes import Implementations
from refdml.gpu.kcenter._compiled import farthest_first_cpu
from refdml.gpu.kcenter._cuda import farthest_first_cuda
from refdml._shared.kcenter import row_dots, sq_norms, sq_to_set
from refdml._validation import as_fast_array, check_rng, check_scalar, result_dtype
from refdml._backend import get_backend, is_device_array
from refdml.gpu.distances import common_scale
from refdml.kcenter import KCenterResult

__all__ = ["KCenterResult", "greedy_k_center"]


# --------------------------------------------------------------- the three traversals
# One interface: farthest_first(xp, points, k, min_sq, first) -> (indices, radii), with
# points (n, d) scaled, min_sq (n,) the squared distances to the current centres (modified
# in place; -1 at a centre), first a (1,) int64 index array of xp or None (start from the
# arg-max of min_sq); indices (k,) int64 and radii (k,) in the points' dtype, arrays of xp.


@dataclass(frozen=True)
class ArrayTraversal:
    """The array path: the reference's row dots (:func:`refdml._shared.kcenter.row_dots`:
    exact products, one row sum each, no BLAS), an update and an arg-max per pick."""

    def farthest_first(self, xp: Any, points: Any, k: int, min_sq: Any, first: Any):
        norms = sq_norms(points, 8192, xp=xp)
        indices = xp.empty(k, dtype=xp.int64)
        radii_sq = xp.empty(k, dtype=points.dtype)
        q = first if first is not None else xp.argmax(min_sq, keepdims=True)
        zero = points.dtype.type(0)
        for pick in range(k):
            indices[pick:pick + 1] = q
            center = points[q[0]]                     # gather on the device (q is an array)
            to_center = norms - 2.0 * row_dots(points, center, xp=xp)
            to_center += norms[q[0]]
            xp.minimum(min_sq, xp.maximum(to_center, zero), out=min_sq)
            min_sq[q] = -1.0
            q = xp.argmax(min_sq, keepdims=True)      # the next pick ...
            radii_sq[pick:pick + 1] = min_sq[q]       # ... and the current radius (its value)
        return indices, xp.sqrt(xp.maximum(radii_sq, zero))


@dataclass(frozen=True)
class CpuTraversal:
    """The compiled CPU twin (:func:`refdml.gpu.kcenter._compiled.farthest_first_cpu`), NumPy
    arrays only: one fused update + arg-max pass over the points per pick."""

    def farthest_first(self, xp: Any, points: Any, k: int, min_sq: Any, first: Any):
        return farthest_first_cpu(points, k, min_sq, None if first is None else int(first[0]))


@dataclass(frozen=True)
class CudaTraversal:
    """The CUDA kernels (:func:`refdml.gpu.kcenter._cuda.farthest_first_cuda`): one
    launch per pick on a transposed copy of the points; CuPy arrays on a GPU, NumPy arrays
    under Numba's simulator."""

    def farthest_first(self, xp: Any, points: Any, k: int, min_sq: Any, first: Any):
        return farthest_first_cuda(xp, points, k, min_sq, first)


#: The traversals of the fast path, chosen once per call (module docstring).
TRAVERSAL: Implementations = Implementations(
    "kcenter", array=ArrayTraversal(), load_cpu=CpuTraversal, load_cuda=CudaTraversal,
    auto_numpy="cpu", auto_cupy="cuda",
    measured=("CuPy: H200, 2026-11-28 (gpu-runs/2026-11-28-h200), 1,000,000 x 128 float32, "
              "k = 1,000: CUDA kernels 739 ms (their first version, two launches per pick), "
              "array path 896 ms. NumPy: scripts/bench_kcenter.py (docs/gpu.md), 100,000 x "
              "128 float64, k = 100: the compiled twin 0.233 s, the readable traversal (the "
              "array path's operations) 0.244-0.383 s"))


def greedy_k_center(points, k, *, initial=None, rng=None, chunk_size=8192) -> KCenterResult:
    """Greedy k-center by farthest-first traversal (see :func:`refdml.kcenter.greedy_k_center`).

    Parameters
    ----------
    points : (n, d) NumPy or CuPy array (float32 stays float32; integers become float64).
    k : number of new centres, ``1 <= k <= n - len(initial)``.
    initial : None, a 1-d integer array of row indices of ``points``, or an (m, d) float
        array of centre coordinates (same module as ``points``). Without it the first
        centre is drawn uniformly at random with ``rng`` (the reference's draw).
    rng : None, int or Generator (used only without ``initial``).
    chunk_size : rows (and centres) per block of the initial-centre distances.

    Returns
    -------
    KCenterResult
        ``indices`` (k,) int64 and ``radii`` (k,) in the input dtype, arrays of the input's
        module; ``initial_radius`` a Python float (one sync on CuPy when ``initial`` is
        given; see the module docstring).
    """
    ns = get_backend(points, initial)
    xp = ns.xp
    points = as_fast_array(points, "points", ndim=2, ns=ns)
    traversal = TRAVERSAL.choose(points)
    n = points.shape[0]
    k = check_scalar(k, "k", low=1, integer=True)
    chunk_size = check_scalar(chunk_size, "chunk_size", low=1, integer=True)
    rng = check_rng(rng)
    initial_array = None
    if initial is not None:
        initial_array = initial if is_device_array(initial) else np.asarray(initial)
    kind = None if initial_array is None else np.dtype(initial_array.dtype)
    by_index = initial_array is not None and initial_array.ndim == 1 and (
        np.issubdtype(kind, np.integer) or initial_array.size == 0
    )
    centers = None
    if initial_array is not None and not by_index:
        dtype = result_dtype(points, initial_array)
        centers = as_fast_array(initial_array, "initial", ndim=2, dtype=dtype, ns=ns)
        points = points.astype(dtype, copy=False)
        if centers.shape[1] != points.shape[1]:
            raise ValueError(
                f"initial centres have dimension {centers.shape[1]}, points {points.shape[1]}"
            )
    scale = common_scale(xp, points) if centers is None else common_scale(xp, points, centers)
    points = points / scale                         # exact (a power of two); a new array
    centers = None if centers is None else centers / scale
    first = None
    if initial is None:
        if k > n:
            raise ValueError(f"k == {k}, must be in [1, {n}] (the number of points)")
        min_sq = xp.full(n, np.inf, dtype=points.dtype)
        first = xp.asarray([int(rng.integers(n))], dtype=xp.int64)
    else:
        if by_index:
            idx = xp.asarray(initial_array).astype(xp.int64)
            low, high = xp.stack([idx.min(), idx.max()]).tolist() if idx.size else (0, 0)
            if low < -n or high >= n:                       # one transfer on CuPy
                raise ValueError(f"initial holds indices outside [0, {n})")
            idx = xp.unique(idx % n)
            if k > n - idx.size:                                            # size: a sync
                raise ValueError(
                    f"k == {k}, must be in [1, {n - idx.size}] (points not already centres)"
                )
            if idx.size == 0:
                min_sq = xp.full(n, np.inf, dtype=points.dtype)
                first = xp.asarray([int(rng.integers(n))], dtype=xp.int64)
            else:
                min_sq = sq_to_set(points, points[idx], chunk_size, xp=xp)
                min_sq[idx] = -1.0
        else:
            if k > n:
                raise ValueError(f"k == {k}, must be in [1, {n}] (the number of points)")
            min_sq = sq_to_set(points, centers, chunk_size, xp=xp)
    if first is None:
        # A Python float like the reference: one synchronisation on CuPy.
        initial_radius = float(scale * xp.sqrt(xp.maximum(xp.max(min_sq), 0.0)))
    else:
        initial_radius = float("inf")
    indices, radii = traversal.farthest_first(xp, points, k, min_sq, first)
    return KCenterResult(indices=indices, radii=scale * radii, initial_radius=initial_radius)

#: The family's implementations (registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`).
IMPLEMENTATIONS = TRAVERSAL
