"""Every compiled kernel of refdml, and the Numba support they share (base layer).

One pair of modules per family, side by side: ``<family>.py`` holds the scalar ``@njit``
maths and the CPU twins, ``<family>_cuda.py`` the ``@cuda.jit`` kernels, which call the same
scalar functions, so a CUDA kernel and its CPU twin state the maths once
(:mod:`refdml._compiled._scalar` holds what several families share). Families: ``gsp``
(the GSP layer), ``losses`` (the masked log-sum-exp), ``sinkhorn`` (small problems, the
log-sum-exp half step, the pair costs), ``retrieval`` (top-K), ``kcenter`` (greedy k-center).

Three reference operators run a compiled CPU twin of their readable form by default (each
checked against it by the tests): :func:`refdml.metrics.retrieval_metrics`
(:mod:`refdml._compiled.retrieval`), :func:`refdml.kcenter.greedy_k_center`
(:mod:`refdml._compiled.kcenter`) and :func:`refdml.ot.pairwise_sinkhorn_divergence_forward`
(:mod:`refdml._compiled.sinkhorn`). That is why the kernels sit here, below the operators,
and not in refdml.gpu: the reference must not import the fast path (docs/architecture.md),
and these are the reference's own algorithms compiled. The other families sit beside them
so that every family is laid out alike.

Only the ``*_cuda`` modules import ``numba.cuda`` (through :mod:`refdml._compiled._cuda`,
its one import point and the registry where each kernel is declared with its launch
types), and only the fast path imports them: the reference runs without numba-cuda.
:mod:`refdml._compiled.cuda_families` imports every family for the compile check.
:mod:`refdml._compiled._support` holds the kernel modes (``refdml.gpu.use_kernels``), the
:class:`~refdml._compiled._support.Implementations` chooser, the CUDA launch and the
threading-layer guard; :mod:`refdml._compiled._notice` the line on stderr while a kernel
compiles for longer than a few seconds (installed here, on import).
"""

from refdml._compiled import _notice

# A line on stderr while one of refdml's kernels compiles for more than a few seconds
# (refdml._compiled._notice); nothing where Numba is not installed.
_notice.install()
