"""The public mirror of greedy k-center: validate once, choose the implementation once, read
straight through (the family's docstring: :mod:`refdml.gpu.kcenter`)."""

from __future__ import annotations

import numpy as np

from refdml._backend import as_input_array, get_backend
from refdml._shared.kcenter import sq_to_set
from refdml._validation import as_fast_array, check_rng, check_scalar, result_dtype
from refdml.gpu.distances import common_scale
from refdml.gpu.kcenter._kernels import IMPLEMENTATIONS
from refdml.kcenter import KCenterResult

__all__ = ["greedy_k_center"]


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
        given; see :mod:`refdml.gpu.kcenter`).
    """
    backend = get_backend(points, initial)
    xp = backend.xp
    points = as_fast_array(points, "points", ndim=2, ns=backend)
    path = IMPLEMENTATIONS.choose(points)
    n = points.shape[0]
    k = check_scalar(k, "k", low=1, integer=True)
    chunk_size = check_scalar(chunk_size, "chunk_size", low=1, integer=True)
    rng = check_rng(rng)
    initial_array = None if initial is None else as_input_array(initial)
    by_index = initial_array is not None and initial_array.ndim == 1 and (
        np.issubdtype(initial_array.dtype, np.integer) or initial_array.size == 0
    )
    centers = None
    if initial_array is not None and not by_index:
        dtype = result_dtype(points, initial_array)
        centers = as_fast_array(initial_array, "initial", ndim=2, dtype=dtype, ns=backend)
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
    indices, radii = path.farthest_first(backend, points, k, min_sq, first)
    return KCenterResult(indices=indices, radii=scale * radii, initial_radius=initial_radius)
