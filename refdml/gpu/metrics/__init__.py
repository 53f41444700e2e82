"""Fast-path mirror of :func:`refdml.metrics.retrieval_metrics` (NumPy or CuPy, float32/64).

Same definitions, signature and result as the reference (read its module docstring:
P@1, R-precision, MAP@R, Recall@k over the queries with at least one true reference;
ranking by Euclidean distance or cosine similarity; ties broken by the lower reference
index; both sets divided by one power of two, or each row normalised, first).

**What differs from the reference, and why.** The reference ranks every reference of a
query by its readable route only (the ordered float64 score block per chunk of queries,
``argpartition``; it imports no compiled code). The fast path reaches the same ranking
faster: float32 candidates from a matrix product (or a compiled float32 scan), certified by
a rounding bound and re-ranked by the reference's own ordered float64 score, so the
neighbours are the reference's, not an approximation of them. float32 input stays float32.

**Implementations** (:data:`IMPLEMENTATIONS`, chosen once per call under
:func:`refdml.gpu.use_kernels`; each takes a :class:`~refdml.gpu.metrics._array.TopK`
request and returns the ``(n_rows, K)`` neighbours in the reference's order):

``array`` (:class:`~refdml.gpu.metrics._array.ArrayPath`)
    Written once against the backend, NumPy or CuPy: one float32 GEMM per block of
    references for the candidates, the certified float64 re-rank, the exact rescan of the
    queries whose certificate fails (:mod:`refdml.gpu.metrics._array`). ``"auto"`` on CuPy
    (on a GPU the array path measured faster than the CUDA kernel; see
    ``IMPLEMENTATIONS.measured``).
``cpu`` (:class:`~refdml.gpu.metrics._kernels.CpuPath`)
    The compiled CPU twin :func:`refdml.gpu.metrics._compiled.nearest_cpu`: float32 tiles
    merged into a running top-``(K + EXTRA)`` per query, the same certificate and ordered
    float64 re-rank. It is the fast path's compiled form of the reference's ranking; the
    reference itself no longer runs it. ``"auto"`` on NumPy. It takes ``K <= MAX_KEEP``
    (256) only: its sorted lists cost ``O(K)`` per insertion; beyond,
    :func:`retrieval_metrics` runs the array path instead (the one place where a chosen
    implementation declines: ``CpuPath.takes``).
``cuda`` (:class:`~refdml.gpu.metrics._kernels.CudaPath`)
    The CUDA kernel ``refdml_retrieval_topk`` (:mod:`refdml.gpu.metrics._cuda`, an ordered
    float64 scan per query); only under ``use_kernels("cuda")``. Its module, and
    ``numba.cuda``, load on its first use.

Precision: the neighbours are those of the float64 reference on the same values (for
float32 data: on the float32 inputs, taken exactly into float64), in either dtype, on every
CPU and every GEMM kernel: the certificate makes the product's rounding irrelevant, and the
re-rank's float64 operations are the reference's (CuPy's elementwise kernels round each
operation like NumPy's). Where the backends differ, and by how much:

- the certificate's bound takes the GEMM's input rounding from the backend
  (:meth:`refdml._backend.Backend.matmul_input_roundoff`): under CuPy's ``CUPY_TF32=1``
  it is wider, so more queries may be rescanned; the neighbours are the same;
- the CUDA kernel may contract to FMA on a GPU (:mod:`refdml.gpu.metrics._cuda`): its
  neighbours may differ from the reference's only between references whose distances agree
  to ~1e-16 relative;
- the metrics are means over the queries, summed in CuPy's reduction order on CuPy: from
  the same neighbours they differ from NumPy's by at most ``n_queries 2^-53`` relative
  (tests/gpu/test_gpu_kernels_retrieval.py holds them to 1e-12).

Synchronisations on CuPy (array path): the size of the top-K (``K = max(max_i R_i, max k)``,
needed for the shapes) and the check that some query has a true reference (one transfer for
both), the indices of the scored queries (one ``nonzero``), the queries whose certificate
failed (one ``nonzero`` per call, none when the list holds every reference), the returned
Python floats and ints (one transfer of the summed metrics at the end), and the data checks
of :mod:`refdml._validation`. None per block or per chunk.
"""

from refdml.gpu.metrics._kernels import IMPLEMENTATIONS
from refdml.gpu.metrics._mirrors import retrieval_metrics

__all__ = ["retrieval_metrics"]
