r"""GSP on the fast path: cost map, (P2) weight transport and the pooling layer (GeMean too).

The mirror of :mod:`refdml.gsp` (same names, signatures, result and context types,
which are the reference's dataclasses holding arrays of the input's module), written
once against the input's array module (NumPy or CuPy), in the input's dtype (float32
or float64), batched over images with no Python loop over them. The maths, with its
derivations, is the reference's (docs/gsp.md); read that first.

Shapes: features ``(B, n, d)``, prototypes ``(m, d)``, cost / pi ``(B, m, n)``, rho
``(B, n)``, pooled ``(B, d)``, z ``(B, m)``. ``inverse_temperature`` is the paper's ε
(varepsilon), multiplying the cost (``exp(-ε c)``; GSP's defaults 0.5 with proxy
losses, 5.0 with pair losses).

What differs from the reference (and why)
------------------------------------------
* ``(B, m, n)`` arrays live as ``(B, n, m)`` in memory and are returned as transposed
  views: the cost map is one ``(B n, d) x (d, m)`` product, the backward two more, and
  every reduction over prototypes runs along the contiguous axis.
* Only ``method="exact"`` (the batched solver of :mod:`refdml.gpu.gsp._transport`) and
  ``backward="closed_form"`` (Prop. 4.3). ``method="fixed_point"`` and
  ``backward="unrolled"`` check the paper's Alg. 3 and are validation only: a
  ``ValueError`` says so (use :mod:`refdml.gsp`). So is (P1).
* float32: a positive ``tol`` below the dtype's residual floor is raised to it (see
  :func:`refdml.gpu.gsp._transport.residual_floor`, ~7.5e-6 for float32 at m n = 3136).
* Small ``mu``: the pooling layer's ``w = sigma / mu`` and ``z`` are O(1) at any mu, but
  ``sigma ~ mu`` is not a float32 below ~1e-38. Below ``SMALL_MU`` (float32 2^-100, in
  :mod:`~refdml.gpu.gsp._array`) the layer takes the array path and float32 solves (P2) in
  float64, ``z`` is formed from ``w`` and the backward never forms ``1 / mu``; so every mu
  in ``[2.2e-308, 1]`` (a normal float64) is computed in both dtypes, and a subnormal mu
  is a ``ValueError``.
* float32 features near its largest number (1e37-1e38): the pooling backward's
  ``d_w ~ |f| |d_pooled|`` and ``W = d_cost / c'`` can leave float32 where the gradients do
  not; such a backward is redone in float64 on the widened context and cast back
  (:func:`refdml._validation.cast_checked` names a gradient truly beyond float32).
  GeMean is the reference's own ``power_mean`` and its backward (:mod:`refdml._shared.gsp`).
* Cost map: the Gram identity is refined from explicit differences where the squared
  distance is below ``_REFINE[dtype]`` of ``|x|^2 + |y|^2`` (so a float32 cost keeps
  ~1e-6 relative accuracy next to a prototype; the kernels sum the explicit differences'
  squares in float64 instead); ``CostMapContext.scale`` is a 0-d array
  of the input's module (the common power of two of the clipped points), not a float,
  so that it never leaves the device.
* The array path's solver tests "every image converged?" after every Newton sweep on
  NumPy and after every ``_SWEEPS`` (3) on CuPy, where each test synchronises
  (:meth:`refdml._backend.Backend.check_every`). An image that has converged is frozen by
  its mask, so ``rho``, ``pi`` and every array of the result are the same on both; only
  ``WeightTransportResult.n_iter`` (the sweeps run) may be larger on CuPy, by at most 2.
  (The kernels count each image's own evaluations on both.)

The package (the same layout in every kernel family of :mod:`refdml.gpu`):
:mod:`~refdml.gpu.gsp._mirrors` the public functions (validate once, choose once, read
straight through); :mod:`~refdml.gpu.gsp._array` the array path, :class:`ArrayPath` (the
family's interface: ``transport``, ``transport_backward``, ``pool_forward``,
``pool_backward``), with the batched (P2) solve in :mod:`~refdml.gpu.gsp._transport`;
:mod:`~refdml.gpu.gsp._compiled` the scalar ``@njit`` maths, the launch buffers and the CPU
twins; :mod:`~refdml.gpu.gsp._cuda` the ``@cuda.jit`` kernels; :mod:`~refdml.gpu.gsp._kernels`
the members ``CpuPath`` and ``CudaPath`` (same interface), the kernel table and
:data:`IMPLEMENTATIONS` (an :class:`~refdml.gpu._support.modes.Implementations`, registered
in :data:`refdml.gpu.families.KERNEL_FAMILIES`), which picks one member per call. Under
:func:`refdml.gpu.use_kernels`'s ``"auto"`` NumPy input keeps the array path (the CPU twins
measured no faster: ``IMPLEMENTATIONS.measured`` says where) and CuPy input runs the CUDA
kernels; ``mu = 1`` and small ``mu`` have the array path only. The array path stays the
kernels' parity twin. Importing the package loads no compiled code: the CPU member (and
Numba) and the CUDA member (and ``numba.cuda``) are built on their first use, so the array
path runs where Numba is not installed.

Synchronisation on CuPy (the results that must reach Python, and the checks): the
input checks (finiteness, GeMean's sign, the points' largest norm against the dtype's
normal range, GeMean's result within the dtype, the pooling backward's finiteness (the
float32 / float64 retries); switched off by
:func:`refdml.gpu.set_finite_checks`). The array path also reads: the rows whose squared
norm leaves the plain range (one ``nonzero`` for the features, one for the prototypes),
the refinement of the cost map (one ``nonzero``, two when a pair is refined), the
solver's "every image converged?" test once per few sweeps and
``WeightTransportResult.converged`` (a Python bool, like the reference's), and each data
check is a read of its own. The layer on the kernels (``p = 1``) is five launches, forward
and backward: the clip and norms, the forward (scale, cost map, (P2), weights, pooled, z),
the backward, one GEMM and the prototypes' gradient; and its checks ride on what it reads
anyway, so it reads once per call, data checks on or off:

* forward: the solve summary (``n_iter``, ``converged``, whether ``max_iter`` was hit) and
  the points' check, one (B, 4) array (:func:`refdml.gpu.gsp._kernels._result`): the
  normalise kernel marks a block with a norm that is not finite (a non-finite input, or a
  norm beyond the dtype), the forward kernel adds a largest norm below the dtype's normal
  range. Handed to :func:`refdml._deferred.read_later`: read at once outside a training
  step, with the scope's other reads inside one (until then the result holds the
  per-image columns).
* backward: one (B + m,) status array the two backward kernels write (an upstream gradient
  not finite; a gradient entry not finite, which decides the retries), read by
  :func:`refdml._deferred.read_now`.

Where a flag is set, the host runs the array path's checks (reading as it likes: only a
refused or retried call pays), so a refusal names the parameter and the entry in the same
words; a bad scalar argument given with non-finite data still gets the data's error, as
before. With the data checks on, a standalone forward + backward is 5 launches and 2 reads
(26 and 7 when each check read on its own); checks off, 5 and 1 (the backward reads
nothing). Two reads is the least for two standalone calls: the forward returns ``n_iter``
as an int and ``converged`` as a bool, and refuses bad points or warns of a solve that did
not converge, before it returns, so it must read; the backward must refuse a non-finite
upstream gradient before it returns, and whether to redo a float32 backward in float64 is
known only from the device's values, so it must read too, after the forward has returned.
One read for the pair: run both inside ``refdml._deferred.deferring(reads,
operator_checks=True)``; the forward records its read, and the backward's read takes it
along in the same transfer (6 launches, one a concatenate; a forward's refusal or warning
then comes at that read). Inside a training step (the data checks handed to the step) the
layer reads nothing: its summary waits for the step's read. The counts are asserted on the
CuPy stand-in (tests/gpu/test_gpu_launch_counts.py, ``CEILINGS`` and
``CHECKS_ON_CEILINGS``). The kernels meet non-finite data before the host has read their
checks: every index they compute from the data stays in range
(:func:`~refdml.gpu.gsp._compiled.column_rank` orders NaN last, a permutation), so a bad
input costs a wasted solve, never a bad access.
"""

from refdml.gpu.gsp._kernels import IMPLEMENTATIONS
from refdml.gpu.gsp._mirrors import (
    cost_map,
    cost_map_backward,
    cost_map_forward,
    gsp_pool,
    gsp_pool_backward,
    gsp_pool_forward,
    weight_transport,
    weight_transport_backward,
)
from refdml.gpu.gsp._transport import residual_floor
from refdml.gsp import (
    CostMapContext,
    CostMapGrads,
    PoolContext,
    PoolGrads,
    WeightTransportGrads,
    WeightTransportResult,
)

__all__ = [
    "CostMapContext",
    "CostMapGrads",
    "PoolContext",
    "PoolGrads",
    "WeightTransportGrads",
    "WeightTransportResult",
    "cost_map",
    "cost_map_backward",
    "cost_map_forward",
    "gsp_pool",
    "gsp_pool_backward",
    "gsp_pool_forward",
    "residual_floor",
    "weight_transport",
    "weight_transport_backward",
]

# Not in __all__ (not the reference's names): IMPLEMENTATIONS, the family's record
# (refdml.gpu.families registers it; the catalogue derives its kernel variants from it).
