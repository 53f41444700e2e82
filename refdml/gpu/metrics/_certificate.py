"""Retrieval top-K: the certificate that lets a float32 stage choose the candidates.

The fast path ranks by the reference's ordered float64 score ``S`` (lexicographic in
``(S_ij, j)``, :func:`refdml.metrics.retrieval_metrics`) but finds the candidates in
float32: the CPU twin (:func:`refdml.gpu.metrics._compiled.nearest_cpu`) by tiles of a
float32 Gram form, the array path (:mod:`refdml.gpu.metrics._array`) by one float32 GEMM
per block. Each keeps a list of the ``K' = K + EXTRA`` smallest float32 scores
``s32_ij ~ s_ij = |r_j|^2 - 2 <q_i, r_j> = |q_i - r_j|^2 - |q_i|^2`` per query, re-ranks
it by ``S64`` and accepts the answer when the certificate below holds. The bounds are plain
arithmetic on NumPy or CuPy arrays (or floats), shared by both paths; the array path keeps
them on the device. No compiled code here.

**Why the float32 stage cannot lose a true neighbour (the certificate).** Let
``c_i = |q_i|^2`` (exact), ``delta_i >= |s32_ij - s_ij|`` and ``eta_i >= |S64_ij - S_ij|``
for every ``j`` (bounds, below; ``S = s + c`` is the exact squared distance), and ``t32``
the ``K``-th smallest float32 score of query ``i``. The ``K`` references with the smallest
``s32`` have ``S64 <= s32 + c + delta + eta <= t32 + c + delta + eta``, so the ``K``-th
smallest ``S64`` is ``t64 <= t32 + c + delta + eta``; every reference ``j`` of the answer
(``S64_ij <= t64``) therefore has ``s32_ij <= S64_ij - c + delta + eta <= t32 + 2 (delta +
eta)``. The list holds the ``K'`` smallest ``s32`` (under some order of float32 ties); every
reference outside it has ``s32`` at least the list's last value ``v_K'``. So if ``v_K' >
t32 + 2 (delta + eta)`` (or the list holds every reference) the whole answer is in the list,
and re-ranking the list by ``(S64, j)`` returns the readable ranking exactly: the same
float64 values in the same lexicographic order, on every CPU.

The bounds: rows are the reference's scaled float64 rows (max entry < 1, or unit rows for
cosine), ``u = 2^-24``, ``R = max_j |r_j|``. Rounding the inputs to float32 moves ``<q, r>``
by at most ``(2u + u^2) |q||r|``; the float32 dot product of length ``d``, in any summation
order, with or without FMA, by ``gamma_d |q||r|`` (``gamma_d = d u / (1 - d u)``,
Cauchy-Schwarz on ``sum |q_k r_k|``); ``|r|^2`` rounded to float32 by ``u R^2``; the final
subtraction by ``u (R^2 + 2 |q| R)``; products below float32's normal range add at most ``d
2^-149`` per dot. Hence ``|s32 - s| <= 2 (d + 4) u' |q| R + 2 u R^2 + 2 d 2^-149`` with
``u' = u (1 + 2 d u)``, and ``delta_i = 2 [(2 d + 12) u |q_i| R + 3 u R^2 + (4 d + 8)
2^-126]`` bounds it with a factor of 2 to spare. The ordered float64 sum of ``d``
nonnegative terms, each a rounded square of a rounded difference, errs by at most
``gamma_{d+2} S`` (unit roundoff ``2^-53``) plus ``d 2^-1074`` from underflow, and ``S <=
(|q| + R)^2``: ``eta_i = 2 (d + 2) 2^-53 (|q_i| + R)^2 + d 2^-1070``. (``|q_i|`` and ``R``
are themselves computed in float64; their relative error, ~``d 2^-53``, is covered by the
factors of 2.)

The bounds are :func:`twin_score_bound` (``delta_i``, the twin's float32 form) and
:func:`rerank_bound` (``eta_i``) of the CPU twin (:mod:`refdml.gpu.metrics._compiled`); the
array path (:mod:`refdml.gpu.metrics._array`) computes its candidates by another float32 form
(one augmented matrix product) and certifies them with :func:`gemm_score_bound` and the same
``eta_i``: the argument above holds for any ``delta_i`` that bounds the candidate scores'
error.
"""

from __future__ import annotations

import math

__all__ = ["EXTRA", "gemm_score_bound", "rerank_bound", "twin_score_bound"]

#: Candidates kept beyond ``K`` for the float64 verification.
EXTRA = 32
_U32 = 2.0**-24
_U64 = 2.0**-53
_TINY32 = 2.0**-126


def twin_score_bound(q_norm, big_r, d):
    """``delta_i >= |s32_ij - s_ij|`` for the CPU twin's float32 score ``fl(fl(|r|^2) - 2
    fl(<q, r>))``: ``2 [(2 d + 12) u |q_i| R + 3 u R^2 + (4 d + 8) 2^-126]``, ``u = 2^-24``
    (derivation in the module docstring). ``q_norm``: the queries' ``|q_i|``; ``big_r``:
    ``R = max_j |r_j|``; ``d``: the dimension."""
    return 2.0 * ((2 * d + 12) * _U32 * q_norm * big_r + 3 * _U32 * big_r**2
                  + (4 * d + 8) * _TINY32)


def gemm_score_bound(q_norm, big_r, d, *, input_roundoff=_U32):
    """``delta_i >= |s32_ij - s_ij|`` for the score of one augmented float32 matrix product,

    .. math::
        s32_{ij} = \\mathrm{fl}\\Big(\\sum_{k<d} (-2 \\tilde q_{ik}) \\tilde r_{jk}
                   + 1 \\cdot \\tilde\\rho_j\\Big),

    ``q~ = fl(q)``, ``r~ = fl(r)`` the float64 rows rounded to the product's inputs,
    ``rho~`` the float64 ``|r_j|^2`` rounded likewise (the array path: the query
    row ``[-2 q~, 1]`` times the reference row ``[r~, rho~]``, one GEMM per block, in any
    summation order, with or without FMA). ``s = |r|^2 - 2 <q, r>`` exact, as in the module
    docstring. With ``v = input_roundoff`` (``2^-24`` for IEEE float32 inputs; cuBLAS's TF32
    mode rounds them to 10 bits: pass ``2^-10``), ``u = 2^-24`` (the products' float32
    accumulation), ``gamma = (d + 1) u / (1 - (d + 1) u)``, ``R = max_j |r_j|``:

    1. inputs: ``|q~_k r~_k - q_k r_k| <= (2 v + v^2) |q_k r_k|`` (plus ``2^-149`` where a
       conversion underflows; entries are below 1), so by Cauchy-Schwarz
       ``|2 <q~, r~> - 2 <q, r>| <= 2 (2 v + v^2) |q| R + 4 d 2^-149``; the factor ``-2``
       is exact (a power of two);
    2. ``rho~``: ``|rho~ - |r|^2| <= (v + (1 + v) d 2^-52) R^2`` (a float64 sum of ``d``
       squares, then one rounding to the input format);
    3. the product, ``d + 1`` terms summed in float32 in any order:
       ``|fl(sum) - sum| <= gamma sum_k |a_k b_k| <= gamma (2 (1 + v)^2 |q| R + (1 + v)^2
       R^2)`` plus ``(d + 1) 2^-149`` for products below float32's normal range.

    Summed: ``(4 v + 2 gamma) |q| R + (gamma + v) R^2`` to first order, the rest of higher
    order or below ``8 (d + 2) 2^-149``; hence

    ``delta_i = 2 [(4 v + 2 gamma) |q_i| R + (gamma + 2 v) R^2 + 4 (d + 2) 2^-126]``

    with a factor of 2 to spare for the second-order terms (they are below the first-order
    ones while ``(d + 1) u <= 1/4``) and for ``|q_i|`` and ``R`` being computed in float64.
    Beyond ``(d + 1) u > 1/4`` (``d`` above four million) the bound is ``inf``: every
    query's certificate fails and it is rescanned exactly.
    """
    u, v = _U32, float(input_roundoff)
    if (d + 1) * u > 0.25:
        return 0.0 * q_norm + math.inf
    gamma = (d + 1) * u / (1.0 - (d + 1) * u)
    return 2.0 * ((4 * v + 2 * gamma) * q_norm * big_r + (gamma + 2 * v) * big_r**2
                  + 4 * (d + 2) * _TINY32)


def rerank_bound(q_norm, big_r, d):
    """``eta_i >= |S64_ij - S_ij|``, the ordered float64 score's error: ``2 (d + 2) 2^-53
    (|q_i| + R)^2 + d 2^-1070`` (module docstring)."""
    return 2.0 * (d + 2) * _U64 * (q_norm + big_r) ** 2 + d * 2.0**-1070
