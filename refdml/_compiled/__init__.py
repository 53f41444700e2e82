"""Compiled CPU kernels that the reference runs, and the Numba support they share (base layer).

Three reference operators run a compiled twin of their readable form by default (each
checked against it by the tests): :func:`refdml.metrics.retrieval_metrics`
(:mod:`refdml._compiled.retrieval`), :func:`refdml.kcenter.greedy_k_center`
(:mod:`refdml._compiled.kcenter`) and :func:`refdml.ot.pairwise_sinkhorn_divergence_forward`
(:mod:`refdml._compiled.sinkhorn`). Their ``@cuda.jit`` counterparts stay in refdml.gpu
(``refdml/gpu/_nb_*.py``, beside their CUDA drivers and launch registries) and call the same
scalar ``@njit`` functions from here, so a CUDA kernel and its CPU twin state the maths
once (:mod:`refdml._compiled._scalar`). :mod:`refdml._compiled._support` holds the kernel
modes (``refdml.gpu.use_kernels``), the CUDA launch and the threading-layer guard.

Why a package of its own, below the operators: the twins used to live in refdml.gpu, so the
reference imported the fast path (inside functions, to hide the import circle: refdml.gpu
imports the reference it mirrors). Dependencies must run one way (docs/architecture.md):
base, operators, fast path. These kernels are the reference's own algorithms compiled, not
mirrors, and they import nothing from refdml but the base modules (:mod:`refdml._xp`,
:mod:`refdml._numerics`), so they sit in the base layer: the reference and refdml.gpu both
import them, and neither imports upward. Nothing here imports ``numba.cuda`` at import time.
"""
