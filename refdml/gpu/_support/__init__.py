"""Every compiled kernel of refdml, and the Numba support they share (base layer).

One pair of modules per family, side by side: ``<family>.py`` holds the scalar ``@njit``
maths and the CPU twins, ``<family>_cuda.py`` the ``@cuda.jit`` kernels, which call the same
scalar functions, so a CUDA kernel and its CPU twin state the maths once
(:mod:`refdml.gpu._support.scalar` holds what several families share). Families: ``gsp``
(the GSP layer), ``losses`` (the masked log-sum-exp), ``sinkhorn`` (small problems, the
log-sum-exp half step, the pair costs), ``retrieval`` (top-K), ``kcenter`` (greedy k-center).

Three reference operators run a compiled CPU twin of their readable form by default (each
checked against it by the tests): :func:`refdml.metrics.retrieval_metrics`
(:mod:`refdml.gpu.metrics._compiled`), :func:`refdml.kcenter.greedy_k_center`
(:mod:`refdml.gpu.kcenter._compiled`) and :func:`refdml.ot.pairwise_sinkhorn_divergence_forward`
(:mod:`refdml.gpu.ot._compiled`). That is why the kernels sit here, below the operators,
and not in refdml.gpu: the reference must not import the fast path (docs/architecture.md),
and these are the reference's own algorithms compiled. The other families sit beside them
so that every family is laid out alike.

Only the ``*_cuda`` modules import ``numba.cuda`` (through :mod:`refdml.gpu._support.cuda`,
its one import point and the registry where each kernel is declared with its launch
types), and only the fast path imports them: the reference runs without numba-cuda.
:mod:`refdml.gpu.families` imports every family for the compile check.
:mod:`refdml.gpu._support.modes` holds the kernel modes (``refdml.gpu.use_kernels``), the
:class:`~refdml.gpu._support.modes.Implementations` chooser, the CUDA launch and the
threading-layer guard; :mod:`refdml.gpu._support.notice` the line on stderr while a kernel
compiles for longer than a few seconds (installed here, on import).
"""

from refdml.gpu._support import notice as _notice

# A line on stderr while one of refdml's kernels compiles for more than a few seconds
# (refdml.gpu._support.notice); nothing where Numba is not installed.
_notice.install()
