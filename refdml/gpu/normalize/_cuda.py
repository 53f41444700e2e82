"""The CUDA kernels of the L2 normalisation: one launch forward, one backward.

One thread per row runs the row maths of :mod:`refdml.gpu.normalize._compiled`
(:func:`~refdml.gpu.normalize._compiled.l2_row_forward`, ``_backward``), the CPU twins'
very functions, so both targets round alike (that module's docstring). A thread reads its
row two or three times (the maximum, the scaled sum of squares, the division), from L1/L2
for the rows of a training batch (a few hundred values each). The rows of the layers and
losses that call it are the batch's (tens to thousands): a block of threads per row would
fill more of a large GPU but needs a block reduction per pass, and the step's cost at these
sizes is the launches, not the arithmetic.
"""

from __future__ import annotations

from refdml.gpu._support.cuda import cuda, cuda_kernel
from refdml.gpu.normalize._compiled import l2_row_backward, l2_row_forward

__all__ = ["refdml_normalize_l2_backward", "refdml_normalize_l2_forward"]

# The row functions take arrays: device functions built from their Python source (an
# ``@njit`` dispatcher cannot take the simulator's arrays, nor run as a device function
# with array arguments).
_row_forward = cuda.jit(device=True)(l2_row_forward.py_func)
_row_backward = cuda.jit(device=True)(l2_row_backward.py_func)


# Launch types (:class:`refdml.gpu.normalize._kernels.CudaPath`; every array C-contiguous,
# of one dtype): rows of (rows, d), per-row values of (rows,).
@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[:, ::1], {dt}[::1], {dt}[::1])"
    for dt in ("float32", "float64")})
def refdml_normalize_l2_forward(x, y, scale, scaled_norm):
    """``y = x / ||x||`` by rows, with the per-row ``s`` and ``||x / s||``; a thread a row."""
    i = cuda.grid(1)
    if i < x.shape[0]:
        _row_forward(x, i, y, scale, scaled_norm)


@cuda_kernel(cache=True, signatures={
    dt: f"void({dt}[:, ::1], {dt}[:, ::1], {dt}[::1], {dt}[::1], {dt}[:, ::1])"
    for dt in ("float32", "float64")})
def refdml_normalize_l2_backward(y, d_y, scale, scaled_norm, grad):
    """``grad = (d_y - y <y, d_y>) / ||x / s|| / s`` by rows; a thread a row."""
    i = cuda.grid(1)
    if i < y.shape[0]:
        _row_backward(y, d_y, i, scale, scaled_norm, grad)
