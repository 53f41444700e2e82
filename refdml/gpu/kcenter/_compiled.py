"""Greedy k-center, compiled CPU twin: each pick's distance update fused with the arg-max.

The traversal (:func:`refdml.kcenter.greedy_k_center`): with ``m`` the squared distance of
every point to the current centres and ``q`` the current pick,

.. math::
    m(i) \\leftarrow \\min\\big(m(i),\\ \\max(|x_i|^2 - 2 \\langle x_i, x_q \\rangle + |x_q|^2,\\ 0)\\big),
    \\qquad m(q) \\leftarrow -1,
    \\qquad r_t = \\sqrt{\\max(\\max_i m(i), 0)}, \\qquad q_{t+1} = \\arg\\max_i m(i),

ties of the arg-max broken by the lowest index (NumPy's ``argmax``), ``-1`` marking a centre
(never picked twice, even among duplicate points). The array code makes three passes over
memory per pick (a mat-vec, an update, an arg-max); a kernel makes one: every point's
distance update, its store and the running (max, arg-max) in the same loop, so a pick reads
``n d`` values of ``points`` plus ``m`` and ``|x|^2`` once (the bandwidth bound).

Scalar maths (one source for both targets): :func:`sq_to_center` (the Gram-identity
distance, clamped at 0, as the reference writes it) and :func:`better` (the arg-max order:
larger value, or equal value and lower index).

CPU twin (:func:`farthest_first_cpu`, ``@njit(parallel=True)``): per pick a ``prange`` over
``n_chunks`` contiguous chunks (``n_chunks`` = Numba's thread count, at most one per
``BLOCK`` points); each chunk updates its points and keeps its own (max, arg-max), then the
chunks' pairs are merged in chunk order with :func:`better`, so the lowest index wins a tie
exactly as ``np.argmax`` does. No BLAS: a compiled loop reads the points once per pick and
cannot oversubscribe the cores the way a threaded BLAS mat-vec does beside another busy
process (docs/gpu/kernels.md, "Numba kernels: greedy k-center and retrieval top-K", has
the measurement).

dtype: ``points``, ``m`` and the radii stay in the input dtype; the dot product accumulates
in float64 in the CPU twin and in the CUDA kernels (the CPU twin with ``fastmath={"reassoc",
"contract"}`` so that LLVM vectorises the sum: a different, deterministic summation order;
no finite-math flags).
In float64 the picks are the reference's and the radii agree to rounding (the readable
reference sums the dot products in NumPy's pairwise order: ~1e-16 relative of ``|x|^2``;
the parity tests hold the bound of tests/_kcenter_checks.py). A pick could differ only
where two distinct points' distances agree to that rounding. The vectorised order depends
on ``d`` and on the CPU target (vector width, FMA), never on a row's position: identical
points get identical distances, so ties among duplicates go to the lowest index on every
CPU.
:func:`sq_to_set_cpu` gives the distances to initial centres with the same loop.

The CUDA kernels of the same traversal (one launch per pick: the update, the blocks'
arg-max and, in the last block to finish, the pick; they call :func:`sq_to_center` and
:func:`better`) are in :mod:`refdml.gpu.kcenter._cuda`, launched by
:class:`refdml.gpu.kcenter._kernels.CudaPath` with the buffers of :class:`StepBuffers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from numba import get_num_threads

from refdml.gpu._support.jit import njit, prange
from refdml.gpu._support.launch import BLOCK
from refdml.gpu._support.threading_layer import parallel_launch

__all__ = ["ARRIVED", "PICK", "Q", "SERIAL_BELOW", "StepBuffers", "better", "farthest_first_cpu",
           "sq_to_center", "sq_to_set_cpu"]


@njit(cache=True, inline="always")
def sq_to_center(sq_norm, dot, c_sq):
    """``max(|x_i|^2 - 2 <x_i, x_q> + |x_q|^2, 0)`` from ``|x_i|^2``, the dot and ``|x_q|^2``.

    Scalars only (the CUDA simulator passes arrays no ``njit`` function can take); the dot
    product itself is a loop in each kernel, accumulated in float64.
    """
    value = sq_norm - 2.0 * dot + c_sq
    return value if value > 0.0 else 0.0


@njit(cache=True, inline="always")
def better(value, index, best_value, best_index):
    """True when ``(value, index)`` beats ``(best_value, best_index)`` in ``argmax`` order."""
    return value > best_value or (value == best_value and index < best_index)


# ------------------------------------------------------------------- the CUDA step's buffers

#: The slots of the int64 ``state`` vector of :class:`StepBuffers`: the current pick's row,
#: the blocks that have finished this pass, the number of the current pick.
Q, ARRIVED, PICK = 0, 1, 2


@dataclass(frozen=True)
class StepBuffers:
    """The arrays of one call's ``refdml_kcenter_step`` launches
    (:mod:`refdml.gpu.kcenter._cuda`), named as its parameters (in order; tests hold the
    two to each other). Made once per call: every pick launches the kernel with the same
    arguments.

    points : (n, d) the scaled points, C-contiguous (the centre's row is read here).
    points_t : (d, n) their transposed copy (every point's coordinates, read coalesced).
    sq_norms : (n,) ``|x_i|^2``, the points' dtype.
    min_sq : (n,) squared distance to the centres (``-1`` at a centre), updated in place.
    state : (3,) int64, slots :data:`Q` (the current pick), :data:`ARRIVED` (blocks done
        in this pass, 0 between launches), :data:`PICK` (the pick's number).
    block_max, block_arg : (n_blocks,) float64 / int64, each block's (max, arg-max).
    indices : (k,) int64, the picks (``indices[0]`` set before the first launch).
    radii_sq : (k,) float64, the squared covering radius after each pick.
    """

    points: Any
    points_t: Any
    sq_norms: Any
    min_sq: Any
    state: Any
    block_max: Any
    block_arg: Any
    indices: Any
    radii_sq: Any

    def arguments(self) -> tuple:
        """The arrays in the kernel's parameter order (not ``dataclasses.astuple``, which
        would deep-copy them)."""
        return tuple(getattr(self, field.name) for field in fields(self))


# ------------------------------------------------------------------------------ CPU twin


@njit(cache=True)
def _argmax(values):
    best, arg = values[0], 0
    for i in range(1, values.shape[0]):
        if values[i] > best:
            best, arg = values[i], i
    return arg


# Reassociation lets LLVM vectorise the float64 dot product (a serial add chain otherwise:
# ~1.5x slower per pick, measured); no finite-math flags (m starts at +inf).
_FAST = {"reassoc", "contract"}


@njit(cache=True, parallel=True, fastmath=_FAST)
def _traverse_cpu(points, sq_norms, min_sq, first, k, n_chunks, indices, radii_sq):
    n, d = points.shape
    step = (n + n_chunks - 1) // n_chunks
    chunk_max = np.empty(n_chunks, dtype=np.float64)
    chunk_arg = np.empty(n_chunks, dtype=np.int64)
    q = first if first >= 0 else _argmax(min_sq)
    for pick in range(k):
        indices[pick] = q
        c_sq = np.float64(sq_norms[q])
        for c in prange(n_chunks):
            start = c * step
            stop = min(start + step, n)
            best, arg = -math.inf, n
            for i in range(start, stop):
                m = np.float64(min_sq[i])
                dot = 0.0
                for j in range(d):
                    dot += np.float64(points[i, j]) * np.float64(points[q, j])
                dist = sq_to_center(np.float64(sq_norms[i]), dot, c_sq)
                if dist < m:
                    m = dist
                if i == q:
                    m = -1.0
                min_sq[i] = m                    # rounds to the array's dtype
                v = np.float64(min_sq[i])
                if better(v, i, best, arg):
                    best, arg = v, i
            chunk_max[c] = best
            chunk_arg[c] = arg
        best, arg = chunk_max[0], chunk_arg[0]
        for c in range(1, n_chunks):
            if better(chunk_max[c], chunk_arg[c], best, arg):
                best, arg = chunk_max[c], chunk_arg[c]
        radii_sq[pick] = best
        q = arg


# The same traversal in one thread, for small inputs: each pick is one parallel region, and a
# region's launch (a few microseconds under OpenMP, tens under the fork-safe workqueue layer,
# docs/gpu/threading.md) outweighs a pick's work below ~1e5 multiply-adds. prange runs as
# range here.
_traverse_serial = njit(cache=True, fastmath=_FAST)(_traverse_cpu.py_func)
#: Below this many entries (n * d) the traversal runs in one thread (:data:`_traverse_serial`).
SERIAL_BELOW = 2**17


@njit(cache=True, parallel=True, fastmath=_FAST)
def _sq_norms_cpu(points, out):
    for i in prange(points.shape[0]):
        acc = 0.0
        for k in range(points.shape[1]):
            acc += np.float64(points[i, k]) * np.float64(points[i, k])
        out[i] = acc


def _sq_norms(points: np.ndarray) -> np.ndarray:
    out = np.empty(points.shape[0], dtype=points.dtype)
    with parallel_launch():
        _sq_norms_cpu(points, out)
    return out


@njit(cache=True, parallel=True, fastmath=_FAST)
def _sq_to_set_cpu(points, sq_norms, centers, c_sq, out):
    for i in prange(points.shape[0]):
        best = math.inf
        for c in range(centers.shape[0]):
            dot = 0.0
            for j in range(points.shape[1]):
                dot += np.float64(points[i, j]) * np.float64(centers[c, j])
            dist = sq_to_center(np.float64(sq_norms[i]), dot, np.float64(c_sq[c]))
            if dist < best:
                best = dist
        out[i] = best


def sq_to_set_cpu(points, centers):
    """``min_c max(|x_i|^2 - 2 <x_i, c> + |c|^2, 0)`` (n,) over the centres (m, d): the
    squared distances to a set of initial centres, in the points' dtype.

    The traversal's arithmetic (the same dot-product loop, accumulated in float64), no BLAS:
    a GEMM rounds identical rows differently by their position in the matrix, which would
    make the picks among duplicate points depend on the CPU. Here every row runs the same
    loop, so identical rows get identical values. One pass over the points; ``n m d``
    multiply-adds spread over Numba's threads.
    """
    points = np.ascontiguousarray(points)
    centers = np.ascontiguousarray(centers, dtype=points.dtype)
    out = np.empty(points.shape[0], dtype=points.dtype)
    sq_norms, c_sq = _sq_norms(points), _sq_norms(centers)
    with parallel_launch():
        _sq_to_set_cpu(points, sq_norms, centers, c_sq, out)
    return out


def farthest_first_cpu(points, k, min_sq, first, sq_norms=None):
    """``k`` picks of the traversal on the CPU (the compiled twin).

    points : (n, d) C-contiguous float32/float64 NumPy array (already scaled).
    min_sq : (n,) squared distances to the current centres, same dtype (modified in place;
        ``inf`` without centres, ``-1`` at centres).
    first : the first pick (an int), or None to start from ``argmax(min_sq)``.
    sq_norms : (n,) ``|x_i|^2`` (computed here if None).
    Returns ``(indices (k,) int64, radii (k,) in the points' dtype)``.
    """
    points = np.ascontiguousarray(points)
    n = points.shape[0]
    indices = np.empty(k, dtype=np.int64)
    radii_sq = np.empty(k, dtype=np.float64)
    first = -1 if first is None else int(first)
    if sq_norms is None:
        sq_norms = _sq_norms(points)
    if points.size < SERIAL_BELOW:
        _traverse_serial(points, sq_norms, min_sq, first, k, 1, indices, radii_sq)
    else:
        with parallel_launch():   # get_num_threads starts Numba's threads: layer first
            n_chunks = max(1, min(get_num_threads(), -(-n // BLOCK)))
            _traverse_cpu(points, sq_norms, min_sq, first, k, n_chunks, indices, radii_sq)
    return indices, np.sqrt(np.maximum(radii_sq, 0.0)).astype(points.dtype)
