"""A strict NumPy-backed stand-in for CuPy, so that CI without a GPU runs refdml's CuPy
paths under CuPy's rules (issue 21; docs/gpu/without-a-gpu.md, "The CuPy stand-in").

``REFDML_CUPY_STANDIN=1`` makes tests/conftest.py call :func:`install` before anything
imports refdml: ``import cupy`` (and ``cupy.cuda``, ``cupyx``, ``cupyx.scipy.special``)
then gives the stand-in, which has ``cupy.__refdml_standin__ = True`` and one device
(``cupy.cuda.runtime.getDeviceCount() == 1``), so every test that looks for CuPy runs its
CuPy rows. Its arrays hold NumPy arrays and follow what CuPy does where it matters:

- ``np.asarray(x)``, ``np.array(x)``, ``np.ascontiguousarray(x)``: CuPy's ``TypeError``
  ("Implicit conversion to a NumPy array is not allowed ...").
- ``np.<function>(x)`` through ``__array_function__``: ``TypeError``. CuPy runs
  ``cupy.<function>`` where it has one; the stand-in is stricter so that refdml says
  ``xp.<function>`` and never relies on NumPy's dispatch.
- ufuncs (``np.exp(x)``, ``np.float32(2) * x``, ``x + 1``) run as CuPy's
  ``__array_ufunc__`` runs them and return stand-in arrays; a NumPy array operand (of any
  shape but 0-d in a comparison) is CuPy's ``TypeError: Unsupported type``; so is a NumPy
  array handed to ``cupy.<function>`` (only ``cupy.array``/``asarray`` take host data).
- reductions and indexing to one element give 0-d arrays, never Python or NumPy scalars.
- ``x[...] = <NumPy array>`` is CuPy's ``ValueError`` (it refuses host arrays there).
- no ``__index__`` and no ``__round__`` (CuPy has neither): ``range(x)`` is a TypeError.
- floating-point warnings are silenced (CuPy's kernels never warn); ``cupy.linalg.cholesky``
  of an indefinite matrix gives NaN, no ``LinAlgError`` (CuPy's default).
- ``__cuda_array_interface__`` v3 whose ``data`` pointer is the host address of the
  backing buffer (device memory is host memory under Numba's CUDA simulator).

Host transfers are counted by kind (:data:`DEVICE_TO_HOST`: ``float()``, ``int()``,
``bool()``, ``complex()``, ``.item()``, ``.get()``, ``.tolist()``, ``.tobytes()``,
``cupy.asnumpy``, ``repr``/``str``/``format``, pickling, ``synchronize()`` of a device,
stream or event, and ``"shape"``: boolean-mask indexing, ``nonzero``, ``unique``, ... whose
output size CuPy reads back from the device)::

    set_finite_checks(False)      # refdml.gpu.set_finite_checks: leave out the data checks' reads
    with count_transfers() as c:
        value, ctx = fast.contrastive_forward(x, labels)
    assert c.total == 1, c        # the loss value, a Python float

and refused at the first one inside ``with strict_transfers():``.

Kernel launches are counted by name: one per operation a real CuPy would run on the device
(a ufunc, a reduction, a ``cupy.<function>`` that writes a new array, a gather, an
assignment, a fill) and one per Numba CUDA kernel that refdml's ``cuda_launch`` runs under
the simulator; views, metadata and ``empty`` count nothing (:func:`count_launches` states
the model and where it departs from CuPy)::

    with count_launches() as launches:
        grads = fast.gsp_pool_backward(ctx, d_pooled, d_z)
    print(launches.total, launches.top(5))

Stream capture: ``Stream(non_blocking=True).begin_capture()`` ... ``end_capture()`` as in
CuPy; in between the stand-in refuses (:class:`CaptureError`, naming what happened) what a
CUDA graph cannot hold: a host read or synchronisation, an upload, an allocation outside
CuPy's pool (Numba's ``device_array``, ``to_device``) and work on another stream. It runs
the work at once and records none of it, so its ``Graph.launch`` raises: a caller replays
by running the work again inside a capture.
"""

from __future__ import annotations

from cupy_standin._array import (
    DEVICE_TO_HOST,
    CaptureError,
    IMPLICIT_CONVERSION,
    HostTransferError,
    LaunchCounter,
    TransferCounter,
    allow_transfers,
    count_launches,
    count_transfers,
    ndarray,
    strict_transfers,
)
from cupy_standin._modules import build_modules, install

__all__ = [
    "CaptureError",
    "DEVICE_TO_HOST",
    "IMPLICIT_CONVERSION",
    "HostTransferError",
    "LaunchCounter",
    "TransferCounter",
    "allow_transfers",
    "build_modules",
    "count_launches",
    "count_transfers",
    "install",
    "installed",
    "ndarray",
    "strict_transfers",
]


def installed() -> bool:
    """True when ``sys.modules["cupy"]`` is this stand-in."""
    import sys

    return bool(getattr(sys.modules.get("cupy"), "__refdml_standin__", False))
