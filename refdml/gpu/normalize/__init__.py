"""Fast-path mirror of :mod:`refdml.normalize` (NumPy or CuPy, float32 or float64), and the
``normalize`` kernel family.

The mirror (:mod:`refdml.gpu.normalize._mirrors`, re-exported here) calls the reference's
xp-generic maths on the input's module and dtype: read its docstring for the scaling that
keeps ``||u / s||`` finite and the checks. The L2 normalisation of the public pair
(:func:`l2_normalize_forward`, :func:`l2_normalize_backward`) runs one of the family's
members (:data:`IMPLEMENTATIONS`, chosen once per call under
:func:`refdml.gpu.use_kernels`), each of the interface of
:class:`~refdml.gpu.normalize._array.ArrayPath`:

``array`` (:class:`~refdml.gpu.normalize._array.ArrayPath`)
    The reference's array code: nine passes forward (absolute value, maximum, ``frexp``,
    ``ldexp``, division, batched product, square root, maximum, division), five backward.
    ``"auto"`` on NumPy: the reference's arithmetic, bit for bit.
``cpu`` (:class:`~refdml.gpu.normalize._kernels.CpuPath`)
    The compiled CPU twins of :mod:`refdml.gpu.normalize._compiled`, a ``prange`` over rows.
``cuda`` (:class:`~refdml.gpu.normalize._kernels.CudaPath`)
    One CUDA kernel forward and one backward (:mod:`refdml.gpu.normalize._cuda`), a thread
    per row, no synchronisation. ``"auto"`` on CuPy.

The compiled members keep the power-of-two scaling (overflow-safe at any finite scale) and
give a zero row ``y = 0`` exactly, as the array code; they round every stored quantity to the
dtype as it does, and differ only in summing in float64 (:mod:`refdml.gpu.normalize._compiled`
states it). The data checks (a zero row forward, an overflowing gradient backward) stay the
mirror's, through :mod:`refdml._validation` and the reference's messages, on every member.
"""

from refdml.gpu.normalize._kernels import IMPLEMENTATIONS
from refdml.gpu.normalize._mirrors import (
    ClipNormalizeContext,
    L2NormalizeContext,
    NormalizeGrads,
    _l2_backward,
    _l2_forward,
    clip_normalize,
    clip_normalize_backward,
    clip_normalize_forward,
    is_ones_column,
    l2_normalize,
    l2_normalize_backward,
    l2_normalize_forward,
    ones_column,
)

__all__ = [
    "ClipNormalizeContext",
    "L2NormalizeContext",
    "NormalizeGrads",
    "clip_normalize",
    "clip_normalize_backward",
    "clip_normalize_forward",
    "l2_normalize",
    "l2_normalize_backward",
    "l2_normalize_forward",
]
