"""Closed-form prototype fits of XML Sec. 2.2-2.3: ridge, the RLS recursion, Eq. (2.9).

Arrays are batch-first: histograms ``Z`` of shape ``(b, m)`` (one row per sample, ``m``
prototypes), embeddings ``Y`` of shape ``(b, d)``, prototypes ``V`` of shape ``(m, d)``
and predictions ``Z V``. The paper writes the transposes (its ``Z`` is ``m x b``, its
``Y`` is ``d x b`` and its objective ``||A Z - Y||`` has ``A`` of shape ``d x m``), but
its solutions (2.6), ``V = R^{-1} Q``, are already ``m x d``; the mapping is
``Z_paper = Z.T``, ``Y_paper = Y.T``, ``A = V.T``.

The keyword ``ridge`` is the ridge weight everywhere: the paper's ϵ (epsilon) of
XML Eq. (2.8) / GSP (P3) (``+ ϵ ||A||^2``), and the beta of the RLS objective (2.5).

``ridge_fit`` (``_ridge.py``): ``V = argmin_V ||Z V - Y||_F^2 + ridge ||V||_F^2``
    Primal form: ``(Z^T Z + ridge I_m) V = Z^T Y`` (an ``m x m`` system). Kernel form
    (push-through identity): ``V = Z^T (Z Z^T + ridge I_b)^{-1} Y`` (a ``b x b`` system).
    ``form="auto"`` solves the smaller system; both by Cholesky, after an exact
    power-of-two rescaling that makes any finite scale of ``Z`` and ``Y`` safe.
    ``ridge_fit_forward`` / ``ridge_fit_backward`` are the pair.

``RecursivePrototypes`` (``_rls.py``): the RLS estimator of XML Eqs. (2.5)-(2.7).

``recursion_weights`` (``_rls.py``): the ``W_K`` of Eq. (2.7), derived and as printed.

``two_batch_decomposition`` (``_two_batch.py``): Eq. (2.9), derived and as printed.

Derivations are in ``docs/prototypes.md``.
"""

from refdml.prototypes._ridge import (
    RidgeContext,
    RidgeGrads,
    ridge_fit,
    ridge_fit_backward,
    ridge_fit_forward,
)
from refdml.prototypes._rls import RecursivePrototypes, recursion_weights
from refdml.prototypes._two_batch import TwoBatchDecomposition, two_batch_decomposition

__all__ = [
    "RecursivePrototypes",
    "RidgeContext",
    "RidgeGrads",
    "TwoBatchDecomposition",
    "recursion_weights",
    "ridge_fit",
    "ridge_fit_backward",
    "ridge_fit_forward",
    "two_batch_decomposition",
]
