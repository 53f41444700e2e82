"""Fast-path mirror of :mod:`refdml.losses`: the nine DML losses (NumPy or CuPy,
float32 or float64), batched, no loop over the batch.

Same names, signatures, defaults, contexts (``PairwiseLossContext``, ``ProxyLossContext``)
and gradients (``LossGrads``, ``ProxyLossGrads``) as the reference; the maths and the
rules for degenerate batches are the reference's (see :mod:`refdml.losses`), and so are
the checks and error messages (through :mod:`refdml._shared.losses`).

The family's kernels are those of the masked log-sum-exp, the reduction of the
softmax-type losses (multi-similarity, within a batch or between samples and proxies,
SoftTriple; Proxy-Anchor and ProxyNCA++ past their bound; and of :mod:`refdml.gpu.histogram`'s entropic histogram and
:mod:`refdml.gpu.crossbatch`'s zero-shot loss). :data:`IMPLEMENTATIONS` holds its array
path, its ``@njit`` CPU twin and its ``@cuda.jit`` kernel behind one interface; a forward
that takes log-sum-exps chooses one once (``IMPLEMENTATIONS.choose(x)``, steered by
:func:`refdml.gpu.use_kernels`) and runs them all on it. The package:

- ``_mirrors.py``: the public functions, each loss's terms beside it;
- ``_array.py``: ``ArrayPath`` (the masked log-sum-exp written once against the backend),
  the reductions and the bounds the forwards share; ``_pairwise.py``: the distance and
  cosine matrices the losses see the embeddings through, and their backwards;
- ``_compiled.py``: the scalar maths, the launch's buffers and the CPU twin;
  ``_cuda.py``: the CUDA kernel (imported only when the CUDA member is built);
- ``_kernels.py``: ``CpuPath``, ``CudaPath`` and ``IMPLEMENTATIONS``.

Differences of implementation, not of result:

* Pairs ``i < j`` are an upper-triangular mask on the ``(n, n)`` matrix, not an index
  list; triplets (``mining="all"``) are an ``(n, P, n)`` block with ``P`` the largest
  number of positives of an anchor (from the labels).
* Proxy-Anchor and ProxyNCA++ take a where-free log-sum-exp with a constant shift where
  the hyperparameters bound the logits tightly enough (``_array.exp_fits``), the masked
  log-sum-exp otherwise; SoftTriple one shift for every class where ``2 / gamma`` allows.
* The context keeps ``d value / d matrix`` for an upstream of 1 (as the reference); the
  backward is matrix products only, no recomputation. The cosine losses' scales in the
  context are ones, not divided by (``_pairwise``'s docstring).
* The Euclidean losses' distances of a set with itself are the Gram identity's
  (:mod:`refdml.gpu.distances`): on NumPy their near pairs are recomputed from explicit
  differences as the reference's are; on CuPy they are not, and a near pair carries the
  tolerance stated there (the diagonal is exactly 0 on both). Every other result is the
  same computation on NumPy and on CuPy.

Synchronisation on CuPy: the value is accumulated in float64 and returned as a 0-d
float64 device array, not read (on NumPy a Python float, like the reference); triplet's
forward reads its value (one synchronisation: it retries a float32 term beyond range in
float64), and its label bookkeeping (``P`` of ``triplet(mining="all")``) costs one more;
soft_triple reads its value only with the data checks (one transfer for both of its
checks); the data checks (zero rows, classes without a proxy, distances beyond the range,
a value beyond float64) one each while enabled (:mod:`refdml._validation`). The backwards
none.
The CUDA kernel adds none.
"""

from refdml.gpu.losses._array import terms_dtype
from refdml.gpu.losses._kernels import IMPLEMENTATIONS
from refdml.gpu.losses._mirrors import (
    contrastive,
    contrastive_backward,
    contrastive_forward,
    generalized_contrastive,
    generalized_contrastive_backward,
    generalized_contrastive_forward,
    multi_similarity,
    multi_similarity_backward,
    multi_similarity_forward,
    proxy_anchor,
    proxy_anchor_backward,
    proxy_anchor_forward,
    proxy_contrastive,
    proxy_contrastive_backward,
    proxy_contrastive_forward,
    proxy_multi_similarity,
    proxy_multi_similarity_backward,
    proxy_multi_similarity_forward,
    proxy_nca,
    proxy_nca_backward,
    proxy_nca_forward,
    soft_triple,
    soft_triple_backward,
    soft_triple_forward,
    triplet,
    triplet_backward,
    triplet_forward,
)
from refdml.losses import LossGrads, PairwiseLossContext, ProxyLossContext, ProxyLossGrads

__all__ = [
    "LossGrads",
    "PairwiseLossContext",
    "ProxyLossContext",
    "ProxyLossGrads",
    "contrastive",
    "contrastive_backward",
    "contrastive_forward",
    "generalized_contrastive",
    "generalized_contrastive_backward",
    "generalized_contrastive_forward",
    "multi_similarity",
    "multi_similarity_backward",
    "multi_similarity_forward",
    "proxy_anchor",
    "proxy_anchor_backward",
    "proxy_anchor_forward",
    "proxy_contrastive",
    "proxy_contrastive_backward",
    "proxy_contrastive_forward",
    "proxy_multi_similarity",
    "proxy_multi_similarity_backward",
    "proxy_multi_similarity_forward",
    "proxy_nca",
    "proxy_nca_backward",
    "proxy_nca_forward",
    "soft_triple",
    "soft_triple_backward",
    "soft_triple_forward",
    "triplet",
    "triplet_backward",
    "triplet_forward",
]

# Not in __all__ (not the reference's names): IMPLEMENTATIONS, the family's record
# (refdml.gpu.families, the catalogue, refdml.gpu.histogram and refdml.gpu.crossbatch
# choose their masked log-sum-exp through it), and terms_dtype, the rule for the dtype of
# loss terms that refdml.gpu.ot's Wasserstein losses share.
