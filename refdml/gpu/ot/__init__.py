r"""Entropic OT on the fast path: Sinkhorn, OT value, Sinkhorn divergences, Wasserstein losses.

The mirror of :mod:`refdml.ot` (same names, signatures, result and context types, which
are the reference's dataclasses holding arrays of the input's module), written once
against the input's array module (NumPy or CuPy), in the input's dtype (float32 or
float64), every problem of a call in one batch (no Python loop over problems or pairs).
The maths and the gradients are the reference's (docs/ot.md); read that first.

What differs from the reference (and why)
------------------------------------------
* The solver (:mod:`refdml.gpu.ot._sinkhorn`) is log-domain at every half step on CuPy; on
  NumPy it iterates on kernel scalings with that log-domain step as absorption and
  fallback whenever a scaling leaves ``e^±B``, so in both cases float32 stays finite down
  to ``eps = 1e-4`` of the largest cost; below that (float32) or ``1e-13`` (float64) a
  ``ValueError`` says the dtype cannot resolve the costs. Problems of at most 128 points
  per side (the all-pairs divergence, the losses) run the small-problem kernel instead.
  Each public function chooses the implementation of these steps once
  (:data:`IMPLEMENTATIONS`: the array path, the CPU twins or the CUDA kernels;
  :func:`refdml.gpu.use_kernels`). The two loops (and the array path's half step and
  large-eps finish, below) are the same maths in the order that is cheaper on each
  backend (:attr:`refdml._backend.Backend.gathers_rows`): their results agree to the
  solver's tolerance, and ``n_iter`` counts to the first convergence check that passed
  (every iteration on NumPy, every :data:`refdml.gpu.ot._sinkhorn.CHECK_EVERY_GPU` on
  CuPy).
* float32: a positive ``tol`` below the dtype's residual floor (``u (1 + max C /
  eps)``, :func:`refdml.gpu.ot._sinkhorn.residual_floor`) is raised to it; ``converged``
  and the warning refer to the raised tol.
* The implicit (``value="transport_cost"``) gradient's pseudo-inverse cuts eigenvalues
  below ``_PINV_RCOND[dtype]`` of the largest (1e-12 float64, 1e-6 float32).
* Divergences between point clouds use the Gram identity for the squared distances
  (points scaled by a power of two first): the array path's
  (:func:`refdml.gpu.ot._common._cross_sq`, for the CUDA kernels too) or, on the CPU
  twins, one compiled pass (:func:`refdml.gpu.ot._kernels.compiled_pair_sq`). Near pairs
  (``D_ij^2 <= 1e-3 (|x_i|^2 + |y_j|^2)``) are recomputed from explicit differences, as
  the reference's, where the backend refines them
  (:meth:`refdml._backend.Backend.refine`): on NumPy, by every
  implementation; not on CuPy (their count would be a synchronisation). The difference
  and its tolerance: the identity's ``D_ij^2`` carries an absolute error of a few
  ``u (|x_i|^2 + |y_j|^2)`` (``u`` the dtype's unit roundoff; measured up to ``10 u`` for
  ``d <= 128``), so on CuPy a pair
  nearer than ``~ sqrt(u) |x|`` is not resolved: its cost ``D^p`` is off by up to
  ``(10 u (|x_i|^2 + |y_j|^2))^(p / 2)`` for ``p <= 2`` (``p = 1``: ~``5e-8 |x|`` in
  float64, ~``1e-3 |x|`` in float32; ``p >= 2``: nothing beyond rounding), the
  regularised divergence by at most twice the largest such error (each OT term moves by
  its plan-weighted cost error, the plan's mass is 1), and for ``p < 2`` the gradient
  ``p D^(p-1) (x - y) / D`` of such a pair points in an O(1)-wrong direction, weighted by
  its plan entry. The diagonal of a cloud with itself is 0 on either backend; two
  coincident points of different clouds are 0 apart on NumPy, up to ``~ sqrt(10 u) |x|``
  on CuPy.
* Where ``eps`` exceeds a problem's largest cost the solve ends, as the reference's, with
  three exact log-domain half steps (:func:`refdml.gpu.ot._sinkhorn._finish_large_eps`),
  and the value's mass term is summed through ``expm1``. On CuPy, where the host cannot
  tell that no problem of a batch needs them, every problem's half steps are computed and
  kept where they apply (no synchronisation).
* float32 and ``p`` beyond its largest number: the forward is the reference's limit (the
  power capped there), the backward a ``ValueError`` (the gradient is ``p`` times a cost).
  A ``tol`` beyond the dtype is applied as its largest number; loss terms whose margin is
  no float32 are float64 (:func:`refdml.gpu.losses.terms_dtype`).

Synchronisation on CuPy (results that reach Python, and checks): the input checks
(finiteness, positive weights; :func:`refdml.gpu.set_finite_checks`) and,
under the same switch, the finiteness of the gradients w.r.t. given weights and w.r.t.
the points, the largest cost (for the exact power-of-two rescaling, the eps check and the
eps-scaling schedule; read in one transfer with the smallest of the problems' largest
costs, which tells the large-eps finish whether any problem needs it), the largest squared
distance (``p`` other than 1 and 2), the
solver's convergence test every
:data:`refdml.gpu.ot._sinkhorn.CHECK_EVERY_GPU` iterations, the warning, the Python
floats the reference returns (one problem's scalars, divergence, loss values, masses),
the finiteness of the divergences (whatever the switch: an overflow is named), and the
sizes of the unique pairs (two ``unique``) and the list of triplets (one ``nonzero``) of
the losses. The solver gathers converged problems by index, not by mask (a CuPy mask index
reads its count back: one more synchronisation per array).
"""

from __future__ import annotations

from refdml.gpu.ot._kernels import IMPLEMENTATIONS
from refdml.gpu.ot._mirrors import (
    entropic_ot_backward,
    entropic_ot_forward,
    pairwise_sinkhorn_divergence,
    pairwise_sinkhorn_divergence_backward,
    pairwise_sinkhorn_divergence_forward,
    sinkhorn,
    sinkhorn_divergence,
    sinkhorn_divergence_backward,
    sinkhorn_divergence_forward,
    wcontrastive,
    wcontrastive_backward,
    wcontrastive_forward,
    wtriplet,
    wtriplet_backward,
    wtriplet_forward,
)
from refdml.ot import (
    EntropicOTContext,
    OTGrads,
    PairwiseSinkhornDivergenceContext,
    PairwiseSinkhornDivergenceGrads,
    SinkhornDivergenceContext,
    SinkhornDivergenceGrads,
    SinkhornResult,
    WassersteinLossGrads,
    WContrastiveContext,
    WTripletContext,
)

__all__ = [
    "EntropicOTContext",
    "OTGrads",
    "PairwiseSinkhornDivergenceContext",
    "PairwiseSinkhornDivergenceGrads",
    "SinkhornDivergenceContext",
    "SinkhornDivergenceGrads",
    "SinkhornResult",
    "WContrastiveContext",
    "WTripletContext",
    "WassersteinLossGrads",
    "entropic_ot_backward",
    "entropic_ot_forward",
    "pairwise_sinkhorn_divergence",
    "pairwise_sinkhorn_divergence_backward",
    "pairwise_sinkhorn_divergence_forward",
    "sinkhorn",
    "sinkhorn_divergence",
    "sinkhorn_divergence_backward",
    "sinkhorn_divergence_forward",
    "wcontrastive",
    "wcontrastive_backward",
    "wcontrastive_forward",
    "wtriplet",
    "wtriplet_backward",
    "wtriplet_forward",
]
