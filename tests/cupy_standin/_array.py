"""The stand-in's ``cupy.ndarray`` and its count of host transfers.

A stand-in array holds a NumPy array (its "device memory") and lets nothing reach NumPy by
accident: ``__array__`` raises CuPy's ``TypeError``, every ``np.*`` function reached through
``__array_function__`` raises (stricter than CuPy, which runs ``cupy.<name>`` where one
exists: refdml must say ``xp.<name>``), ufuncs run as CuPy's ``__array_ufunc__`` runs them,
and every way of reading values on the host is counted (:func:`count_transfers`) or refused
(:func:`strict_transfers`); the device operations a real CuPy would launch as kernels are
counted by :func:`count_launches` (its docstring states the model).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "CaptureError",
    "DEVICE_TO_HOST",
    "IMPLICIT_CONVERSION",
    "HostTransferError",
    "LaunchCounter",
    "TransferCounter",
    "allow_transfers",
    "count_launches",
    "count_transfers",
    "ndarray",
    "strict_transfers",
]

#: CuPy's message when NumPy asks one of its arrays for ``__array__``.
IMPLICIT_CONVERSION = ("Implicit conversion to a NumPy array is not allowed. "
                       "Please use `.get()` to construct a NumPy array explicitly.")

#: The kinds of host wait a counter tells apart. Each is a device-to-host copy (CuPy's
#: ``get()`` behind ``float()``, ``int()``, ``bool()``, ``complex()``, ``.item()``,
#: ``.tolist()``, ``.tobytes()``, ``cupy.asnumpy``, ``repr``/``str``/``format``, pickling) or
#: an explicit synchronisation (``Device``/``Stream``/``Event.synchronize``), or
#: ``"shape"``: an operation whose output shape depends on the data, for which CuPy reads a
#: count on the host (boolean-mask indexing, ``nonzero``, ``flatnonzero``, ``argwhere``,
#: ``unique``, ``bincount``, ``triu_indices``, ...; cupy/_core/_routines_indexing.pyx,
#: "synchronize!"). On a GPU each one stops the host until the device has finished its queue.
DEVICE_TO_HOST = ("bool", "int", "float", "complex", "item", "tolist", "tobytes", "get",
                  "asnumpy", "format", "pickle", "synchronize", "shape")


class HostTransferError(RuntimeError):
    """A host transfer inside :func:`strict_transfers`."""


class TransferCounter:
    """Host transfers counted while a :func:`count_transfers` block runs.

    ``total`` counts the device-to-host transfers and synchronisations (the kinds of
    :data:`DEVICE_TO_HOST`; ``counter["float"]`` one kind); ``uploads`` counts host-to-device
    copies (``cupy.asarray`` of host data), which do not stop the host on their own and are
    not in ``total``.
    """

    def __init__(self) -> None:
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.uploads = 0

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def __getitem__(self, kind: str) -> int:
        if kind not in DEVICE_TO_HOST:
            raise KeyError(f"kind == {kind!r}, must be one of {DEVICE_TO_HOST}")
        return self.by_kind[kind]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={n}" for k, n in sorted(self.by_kind.items()))
        sep = ", " if kinds else ""
        return f"TransferCounter(total={self.total}{sep}{kinds}, uploads={self.uploads})"


# Counters are process-wide (a transfer on any thread counts); strictness follows the
# context, so a strict block on one thread does not fail another thread's test code.
_COUNTERS: list[TransferCounter] = []
_COUNTERS_LOCK = threading.Lock()
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("cupy_standin_strict", default=False)


# ------------------------------------------------------------------ stream capture
class CaptureError(RuntimeError):
    """Something a CUDA graph cannot hold, done while a stand-in stream captures
    (``Stream.begin_capture``): a host read or synchronisation, a host-to-device copy, an
    allocation outside CuPy's memory pool (Numba's ``device_array``, ``to_device``, ...), or
    work on a stream other than the capturing one (it would run at once, outside the graph:
    a Numba kernel whose arguments were exported on another stream, say)."""


#: The capturing stand-in stream and its launch counter, or None (one capture at a time).
_CAPTURE: list = [None]


def capturing_stream() -> Any:
    """The stand-in stream that is capturing, or None."""
    state = _CAPTURE[0]
    return None if state is None else state[0]


def _refuse_while_capturing(what: str) -> None:
    stream = capturing_stream()
    if stream is not None:
        raise CaptureError(f"{what} while {stream!r} is capturing a CUDA graph: a graph "
                           "cannot hold it (a replay would not repeat it, or the capture "
                           "fails on a GPU)")


def check_capture_stream(what: str) -> None:
    """While a stream captures, ``what`` must be queued on that stream (CuPy's current one):
    work on another stream runs at once, outside the graph."""
    stream = capturing_stream()
    if stream is None:
        return
    from cupy_standin import _cuda

    current = _cuda.get_current_stream()
    if current is not stream:
        raise CaptureError(f"{what} on {current!r} while {stream!r} is capturing: it would "
                           "run at once, outside the graph (make the capturing stream current)")


def record_transfer(kind: str) -> None:
    """Count one host transfer of ``kind`` (raises inside :func:`strict_transfers`, and
    while a stream captures: :class:`CaptureError`)."""
    with _COUNTERS_LOCK:
        for counter in _COUNTERS:
            counter.by_kind[kind] += 1
    _refuse_while_capturing(f"a host read or synchronisation ({kind})")
    if _STRICT.get():
        raise HostTransferError(
            f"host transfer ({kind}) inside strict_transfers(): on a GPU this copies to the "
            "host and waits for the device")


def record_upload() -> None:
    with _COUNTERS_LOCK:
        for counter in _COUNTERS:
            counter.uploads += 1
    _refuse_while_capturing("a host-to-device copy (an upload)")


@contextlib.contextmanager
def count_transfers() -> Iterator[TransferCounter]:
    """Count the host transfers of the enclosed block: ``with count_transfers() as c: ...``."""
    counter = TransferCounter()
    with _COUNTERS_LOCK:
        _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        with _COUNTERS_LOCK:
            _COUNTERS.remove(counter)


@contextlib.contextmanager
def strict_transfers() -> Iterator[None]:
    """Raise :class:`HostTransferError` at the first host transfer of the enclosed block."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


@contextlib.contextmanager
def allow_transfers() -> Iterator[None]:
    """Lift :func:`strict_transfers` inside the block (a test reading its results)."""
    token = _STRICT.set(False)
    try:
        yield
    finally:
        _STRICT.reset(token)


# ------------------------------------------------------------------------------ launches

class LaunchCounter:
    """Device operations counted while a :func:`count_launches` block runs.

    ``by_name`` counts them per name: a ufunc's (``"multiply"``; ``"add.reduce"``,
    ``"add.at"`` for its methods), a ``cupy.<function>``'s (``"matmul"``, ``"where"``,
    ``"linalg.cholesky"``), an array method's (``"ndarray.sum"``), indexing
    (``"ndarray.__getitem__"``, ``"ndarray.__setitem__"``, ``"ndarray.fill"``), or a Numba
    CUDA kernel's Python name (``"refdml_gsp_..."``), which ``kernels`` also counts on its
    own. ``total`` is the sum over names.
    """

    def __init__(self) -> None:
        self.by_name: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def __getitem__(self, name: str) -> int:
        return self.by_name[name]

    def top(self, n: int = 8) -> list[tuple[str, int]]:
        """The ``n`` most frequent names with their counts (ties by name)."""
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n == {n}, must be at least 1")
        return sorted(self.by_name.items(), key=lambda item: (-item[1], item[0]))[:n]

    def __repr__(self) -> str:
        names = ", ".join(f"{name}={count}" for name, count in self.top(8)) if self.by_name else ""
        more = ", ..." if len(self.by_name) > 8 else ""
        return f"LaunchCounter(total={self.total}{', ' if names else ''}{names}{more})"


_LAUNCH_COUNTERS: list[LaunchCounter] = []


#: Names (as :func:`record_launch` gets them) of the operations that CuPy runs through a
#: CUDA library it refuses to call while a stream captures: cuBLAS (products), cuSOLVER
#: (``linalg``) and cuRAND (``random``). CuPy 14 raises ``NotImplementedError`` ("calling
#: cuBLAS API during stream capture is currently unsupported", cupy_backends/cuda/libs/
#: cublas.pyx's ``setStream``; cusolver.pyx and curand.pyx likewise) at the call, before
#: anything is queued; only cuFFT, cuTENSOR, cuSPARSELt and NCCL calls may be captured
#: (cupy/cupy#6290). Seen on an H200 with CuPy 14.2 (2026-11-30), where the stand-in had
#: let a captured step's products through.
_LIBRARY_PREFIXES = {"matmul": "cuBLAS", "dot": "cuBLAS", "ndarray.dot": "cuBLAS",
                     "tensordot": "cuBLAS", "inner": "cuBLAS", "vdot": "cuBLAS",
                     "einsum": "cuBLAS", "linalg.": "cuSOLVER",
                     "cupyx.scipy.linalg.": "cuSOLVER", "random.": "cuRAND"}


def library_of(name: str) -> str | None:
    """The CUDA library CuPy calls for the operation ``name`` (a :func:`record_launch`
    name), where it is one CuPy refuses to call during stream capture; else None."""
    for prefix, library in _LIBRARY_PREFIXES.items():
        if name == prefix or (prefix.endswith(".") and name.startswith(prefix)):
            return library
    return None


def record_launch(name: str, *, kernel: bool = False) -> None:
    """Count one device operation under ``name`` (``kernel``: a Numba CUDA kernel); while
    a stream captures (which keeps a counter open), it must be the current stream, and it
    must not be a call of a CUDA library CuPy refuses to capture (:func:`library_of`)."""
    if not _LAUNCH_COUNTERS:
        return
    check_capture_stream(f"a launch ({name})")
    library = library_of(name) if not kernel and capturing_stream() is not None else None
    if library is not None:
        raise NotImplementedError(f"calling {library} API during stream capture is currently "
                                  f"unsupported (CuPy, at {name})")
    with _COUNTERS_LOCK:
        for counter in _LAUNCH_COUNTERS:
            counter.by_name[name] += 1
            if kernel:
                counter.kernels[name] += 1


def _observe_simulated_launch(kernel: Any, args: tuple) -> None:
    """refdml's ``SIMULATED_LAUNCH_OBSERVERS`` entry: one launch per ``cuda_launch``, under
    the kernel's name as refdml's own launch profile names it (registered only where refdml
    is installed: :func:`_launch_observers`)."""
    from refdml.gpu._support.profile import _kernel_name

    record_launch(_kernel_name(kernel), kernel=True)


def _launch_observers() -> list | None:
    """refdml's list of simulated-launch observers, or None where refdml is not installed
    (the stand-in alone). A refdml without the list is an error, not a silent zero."""
    try:
        from refdml.gpu._support import launch as _launch
    except ModuleNotFoundError as exc:
        if exc.name in ("refdml", "refdml.gpu", "refdml.gpu._support"):
            return None
        raise
    observers = getattr(_launch, "SIMULATED_LAUNCH_OBSERVERS", None)
    if not isinstance(observers, list):
        raise RuntimeError("refdml.gpu._support.launch.SIMULATED_LAUNCH_OBSERVERS is not a list: "
                           "count_launches cannot see refdml's CUDA kernel launches")
    return observers


@contextlib.contextmanager
def count_launches() -> Iterator[LaunchCounter]:
    """Count the device operations of the enclosed block: ``with count_launches() as c: ...``.

    The model: one launch for each operation that a real CuPy runs on the device as a
    kernel (or a memset), counted where the stand-in runs it:

    - a ufunc call on device arrays or scalars (``x + 1``, ``cupy.exp(x)``, ``x @ y``,
      in-place ``x += 1``): one; its ``reduce``, ``accumulate``, ``outer``, ``at``: one;
    - a reduction (``x.sum()``, ``cupy.max(x, axis=0)``, ``cupy.count_nonzero``): one;
    - a ``cupy.<function>`` or array method whose result is a new device array (``where``,
      ``concatenate``, ``matmul``, ``einsum``, ``copy``, ``take``, ``astype`` that copies,
      ``zeros``, ``ones``, ``full``, ``arange``, ``linalg.*``), that writes through ``out=``,
      or that changes an array in place (``copyto``, ``put``, ``ndarray.sort``): one per call,
      however many arrays it returns;
    - indexing: ``__getitem__`` with an integer or boolean array or a list in the key (a
      gather): one; ``__setitem__`` and ``fill``: one; ``cupyx.scatter_add`` (and
      ``_max``, ``_min``): one;
    - a Numba CUDA kernel launched through refdml's ``cuda_launch`` under the simulator: one,
      under the kernel's Python name (an observer in
      ``refdml.gpu._support.launch.SIMULATED_LAUNCH_OBSERVERS``, registered while a counter
      is open).

    Zero for what computes nothing: metadata and views (``reshape``, ``transpose``, ``.T``,
    basic slicing, ``broadcast_to``, ``expand_dims``, ``squeeze``: any result that is a view
    of an input), ``empty``/``empty_like``, ``ascontiguousarray`` of a C-contiguous array,
    ``asarray``/``astype(copy=False)`` of a device array already of the dtype, host-side
    queries (``result_type``, ``shape``), an operation whose every result is empty (CuPy
    returns before launching), and host-to-device copies (``cupy.asarray`` of host data:
    a copy-engine transfer, counted as an upload by :func:`count_transfers`).

    Known deviations from real CuPy, so that a count is a floor for some names: CuPy fuses
    nothing by default (each ufunc is its own kernel, as here; ``cupy.fuse`` is unused by
    refdml); cuBLAS may run more than one kernel for a product (split-K, a reduction), and
    CuPy copies a non-contiguous operand of ``matmul``/``dot``/``einsum`` first; ``einsum``
    may add transposes and copies; a reduction may run in two passes; ``mean``/``var``/
    ``std`` run several kernels; ``nonzero``, ``cumsum``, boolean-mask indexing and sorting
    run scans (CUB, several kernels); ``concatenate`` of arrays CuPy cannot handle in one
    kernel copies each; cuSOLVER (``linalg``) runs several; ``eye`` is a memset and a fill;
    ``cupyx.scipy.special`` functions that are compositions in CuPy (``logsumexp``,
    ``softmax``) run several kernels; ``zeros`` is a memset, not a kernel. Each of these counts
    one. Numba's own launch overhead and CuPy's kernel compilation are not launches.
    """
    counter = LaunchCounter()
    observers = _launch_observers()
    with _COUNTERS_LOCK:
        _LAUNCH_COUNTERS.append(counter)
        if observers is not None and _observe_simulated_launch not in observers:
            observers.append(_observe_simulated_launch)
    try:
        yield counter
    finally:
        with _COUNTERS_LOCK:
            _LAUNCH_COUNTERS.remove(counter)
            if (observers is not None and not _LAUNCH_COUNTERS
                    and _observe_simulated_launch in observers):
                observers.remove(_observe_simulated_launch)


def _root(array: Any) -> Any:
    """The object whose memory ``array`` views (itself when it owns its data)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def _computes(result: Any, input_roots: set[int]) -> bool:
    """Whether ``result`` (NumPy's, before wrapping) holds a non-empty array that is not a
    view of an input: something a kernel wrote."""
    if isinstance(result, np.ndarray):
        return result.size > 0 and id(_root(result)) not in input_roots
    if isinstance(result, np.generic):
        return True
    if isinstance(result, (tuple, list)):
        return any(_computes(item, input_roots) for item in result)
    return False


def _launch_name(where: str) -> str:
    """``"cupy.linalg.cholesky"`` -> ``"linalg.cholesky"``, ``"cupy.ndarray.sum"`` ->
    ``"ndarray.sum"``; ``"cupyx.scipy.special.logsumexp"`` stays."""
    return where[len("cupy."):] if where.startswith("cupy.") else where


#: Names that allocate without writing (no kernel, whatever the result looks like).
ALLOCATE_ONLY = frozenset(("empty", "empty_like"))


def _is_gather(key: Any) -> bool:
    """An index with an array or a list in it: CuPy gathers (``take``) with a kernel."""
    parts = key if isinstance(key, tuple) else (key,)
    return any(isinstance(part, (np.ndarray, list)) for part in parts)


# ------------------------------------------------------------------------------ wrapping

_PYTHON_SCALARS = (bool, int, float, complex)
_COMPARISONS = frozenset(("greater", "greater_equal", "less", "less_equal", "equal", "not_equal"))
_UFUNC_METHODS = frozenset(("__call__", "outer", "at", "reduce", "accumulate", "reduceat"))


def unsupported(value: Any, where: str) -> TypeError:
    """CuPy's error for a host array where a device array is needed, with the place."""
    return TypeError(f"Unsupported type {type(value)} ({where}: the CuPy stand-in refuses a "
                     "NumPy array where CuPy needs a device array; move it with cupy.asarray)")


def unwrap(value: Any, where: str, seen: dict | None = None, *, host_ok: bool = False) -> Any:
    """The NumPy arrays behind stand-in arrays in ``value`` (through lists and tuples).

    A NumPy array is a ``TypeError`` unless ``host_ok`` (CuPy's constructors). ``seen``
    maps ``id`` of each backing array to its stand-in, so a result that is one of them
    (``out=``, ``asarray`` of a device array) comes back as the same object.
    """
    if isinstance(value, ndarray):
        if seen is not None:
            seen[id(value._a)] = value
        return value._a
    if isinstance(value, np.ndarray):
        if host_ok:
            return value
        raise unsupported(value, where)
    if type(value) in (list, tuple):
        return type(value)(unwrap(v, where, seen, host_ok=host_ok) for v in value)
    return value


def wrap(value: Any, seen: dict | None = None) -> Any:
    """Stand-in arrays for the NumPy arrays and NumPy scalars in a result (CuPy returns 0-d
    arrays where NumPy returns scalars: reductions, indexing to one element)."""
    if isinstance(value, np.ndarray):
        if seen is not None:
            known = seen.get(id(value))
            if known is not None and known._a is value:
                return known
        return ndarray._wrap(value)
    if isinstance(value, np.generic):
        return ndarray._wrap(np.asarray(value))
    if isinstance(value, tuple):
        items = [wrap(v, seen) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [wrap(v, seen) for v in value]
    return value


def call_ufunc(ufunc: np.ufunc, method: str, inputs: tuple, kwargs: dict, where: str) -> Any:
    """A NumPy ufunc on stand-in arrays, Python and NumPy scalars, as CuPy's ufuncs take them."""
    seen: dict = {}
    args = []
    for k, x in enumerate(inputs):
        if method == "at" and k == 1:
            args.append(unwrap(x, where, seen, host_ok=True))   # the indices, as in indexing
        elif isinstance(x, ndarray):
            args.append(unwrap(x, where, seen))
        elif type(x) in _PYTHON_SCALARS or isinstance(x, np.generic):
            args.append(x)
        elif isinstance(x, np.ndarray):
            if ufunc.__name__ in _COMPARISONS and x.ndim == 0 and method == "__call__":
                args.append(x.item())     # CuPy's workaround for numpy/numpy#12142
            else:
                raise unsupported(x, where)
        else:
            return NotImplemented
    kwargs = dict(kwargs)
    out = kwargs.get("out")
    if out is not None:
        out = out if isinstance(out, tuple) else (out,)
        if len(out) != 1:
            raise ValueError("The 'out' parameter must have exactly one array value")
        if not isinstance(out[0], ndarray):
            raise unsupported(out[0], where) if isinstance(out[0], np.ndarray) else TypeError(
                f"{where}: out must be a cupy.ndarray, got {type(out[0])}")
    kwargs = {k: unwrap(v, where, seen) for k, v in kwargs.items() if k != "out"}
    if out is not None:
        kwargs["out"] = unwrap(out[0], where, seen)
    # CuPy's kernels never warn about overflow or invalid values; NumPy's would (and pytest
    # turns RuntimeWarning into an error), so the stand-in computes as quietly as a GPU.
    if method != "at":                    # at() updates its first operand in place
        args = [flush_float32_subnormals(a) for a in args]
    with np.errstate(all="ignore"):
        result = (ufunc if method == "__call__" else getattr(ufunc, method))(*args, **kwargs)
    if isinstance(result, tuple):
        result = tuple(flush_float32_subnormals(r, in_place=True) for r in result)
    else:
        result = flush_float32_subnormals(result, in_place=True)
    if _LAUNCH_COUNTERS and (method == "at" or _computes(result if out is None
                                                         else kwargs["out"], set())):
        record_launch(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}")
    return wrap(result, seen)


_FLOAT32_TINY = np.finfo(np.float32).tiny


def flush_float32_subnormals(value: Any, *, in_place: bool = False) -> Any:
    """``value`` with its float32 subnormals replaced by zeros of their sign, as CuPy's
    kernels see and store them: CuPy compiles every elementwise and reduction kernel with
    ``-ftz=true`` (``cupy/cuda/compiler.py``, appended to every NVRTC option list), so a
    float32 instruction on the GPU reads a subnormal operand as 0 and flushes a subnormal
    result to 0 (float64 is never flushed). ``in_place``: a result array is flushed where it
    is (it may be a ufunc's ``out``); an operand is copied first. Anything else is returned
    as it is."""
    if isinstance(value, (np.ndarray, np.float32)) and value.dtype == np.float32:
        magnitude = np.abs(value)
        subnormal = (magnitude < _FLOAT32_TINY) & (magnitude > 0)
        if np.any(subnormal):
            if isinstance(value, np.float32):
                return np.float32(np.copysign(0.0, value))
            if not in_place or not value.flags.writeable:
                value = value.copy()
            value[subnormal] = np.copysign(np.float32(0.0), value[subnormal])
    return value


def call_function(function: Any, args: tuple, kwargs: dict, where: str, *,
                  host_ok: bool = False, owner: np.ndarray | None = None) -> Any:
    """A NumPy function on stand-in arrays: unwrapped in, wrapped out, NumPy arrays refused.

    Counted as one launch (:func:`count_launches`) under ``where`` when it computes: its
    result holds a new non-empty array (not a view of an input, nor of ``owner``, the array
    of a method), or it writes through ``out=``, or it returns None (an in-place change).
    """
    seen: dict = {}
    args = unwrap(tuple(args), where, seen, host_ok=host_ok)
    kwargs = {k: unwrap(v, where, seen, host_ok=host_ok) for k, v in kwargs.items()}
    with np.errstate(all="ignore"):
        result = function(*args, **kwargs)
    if _LAUNCH_COUNTERS:
        name = _launch_name(where)
        roots = {id(_root(device._a)) for device in seen.values()}
        if owner is not None:
            roots.add(id(_root(owner)))
        written = kwargs.get("out") is not None or result is None
        if name not in ALLOCATE_ONLY and (written or _computes(result, roots)):
            record_launch(name)
    return wrap(result, seen)


def _count_masks(key: Any) -> None:
    """One ``"shape"`` sync per boolean array in an index (CuPy counts its true entries on
    the host to size the result: ``_prepare_mask_indexing_single``)."""
    for part in key if isinstance(key, tuple) else (key,):
        if isinstance(part, np.ndarray) and part.dtype == bool and part.ndim > 0:
            record_transfer("shape")
        elif isinstance(part, list) and part and all(isinstance(v, (bool, np.bool_)) for v in part):
            record_transfer("shape")


#: Host reads of a data-dependent output size, per call (cupy/_sorting/search.py,
#: cupy/_manipulation/add_remove.py, cupy/_statistics/histogram.py, cupy/_indexing/generate.py).
SHAPE_SYNCS = {"nonzero": 1, "flatnonzero": 1, "argwhere": 1, "compress": 1, "extract": 1,
               "unique": 1, "bincount": 2, "triu_indices": 2, "tril_indices": 2,
               "triu_indices_from": 2, "tril_indices_from": 2}


def count_shape_syncs(name: str, args: tuple, kwargs: dict) -> None:
    """Record the ``"shape"`` syncs CuPy makes in ``cupy.<name>(*args, **kwargs)``."""
    n = SHAPE_SYNCS.get(name, 0)
    if name == "where" and len(args) + len(kwargs) == 1:
        n = 1                                        # where(condition) is nonzero
    elif name == "unique" and kwargs.get("return_counts"):
        n += 1
    elif name == "repeat":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        n = int(isinstance(repeats, ndarray)
                or (isinstance(repeats, (list, tuple)) and len(repeats) > 1))
    for _ in range(n):
        record_transfer("shape")


def _binary(name: str, reflected: bool = False):
    ufunc = getattr(np, name)

    def method(self, other):
        pair = (other, self) if reflected else (self, other)
        return call_ufunc(ufunc, "__call__", pair, {}, f"cupy.ndarray operator ({name})")

    method.__name__ = name
    return method


def _inplace(name: str):
    ufunc = getattr(np, name)

    def method(self, other):
        call_ufunc(ufunc, "__call__", (self, other), {"out": (self,)},
                   f"cupy.ndarray operator ({name}=)")
        return self

    return method


def _unary(name: str):
    ufunc = getattr(np, name)

    def method(self):
        return call_ufunc(ufunc, "__call__", (self,), {}, f"cupy.ndarray operator ({name})")

    return method


def _comparison(name: str, fill: bool | None):
    ufunc = getattr(np, name)

    def method(self, other):
        # CuPy: == and != with an object of no __eq__ of its own (None, ...) is all False /
        # all True, not an error.
        if fill is not None and (other is None or type(other).__eq__ is object.__eq__):
            record_launch(name)
            return ndarray._wrap(np.full(self._a.shape, fill, dtype=bool))
        return call_ufunc(ufunc, "__call__", (self, other), {}, f"cupy.ndarray comparison ({name})")

    return method


# CuPy's ndarray methods (cupy/_core/core.pyx) that compute on the device; each runs the
# NumPy method of the backing array, stand-ins unwrapped in and wrapped out.
_DEVICE_METHODS = frozenset((
    "all", "any", "argmax", "argmin", "argpartition", "argsort", "astype", "byteswap",
    "choose", "clip", "compress", "conj", "conjugate", "copy", "cumprod", "cumsum",
    "diagonal", "dot", "flatten", "max", "mean", "min", "nonzero", "partition", "prod", "put",
    "ravel", "repeat", "reshape", "round", "searchsorted", "sort", "squeeze", "std", "sum",
    "swapaxes", "take", "trace", "transpose", "var",
))


class _MemoryPointer:
    """``ndarray.data``: where the array's memory starts (here: a host address)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr
        self.device_id = 0

    def __int__(self) -> int:
        return self.ptr


class ndarray:
    """A CuPy array stood in for by a NumPy array (see the module docstring).

    ``ndarray(shape, dtype=float)`` allocates as CuPy's does; operators and the stand-in
    ``cupy`` module make the others.
    """

    __module__ = "cupy"
    __slots__ = ("_a", "__weakref__")
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]  # unhashable, as NumPy's and CuPy's arrays

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C") -> None:
        if memptr is not None or strides is not None:
            raise NotImplementedError(
                "the CuPy stand-in allocates its own memory (no memptr, strides)")
        self._a = np.empty(shape, dtype=dtype, order=order)

    @classmethod
    def _wrap(cls, array: np.ndarray) -> ndarray:
        obj = object.__new__(cls)
        obj._a = array
        return obj

    # ------------------------------------------------------------------ metadata (free)
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: self._a.nbytes)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    T = property(lambda self: ndarray._wrap(self._a.T))
    mT = property(lambda self: ndarray._wrap(self._a.mT))
    real = property(lambda self: ndarray._wrap(self._a.real))
    imag = property(lambda self: ndarray._wrap(self._a.imag))

    @property
    def data(self) -> _MemoryPointer:
        return _MemoryPointer(self._a.__array_interface__["data"][0])

    @property
    def device(self):
        from cupy_standin import _cuda

        return _cuda.Device(0)

    # DLPack (cupy.from_dlpack, torch.from_dlpack): the device memory shared, no transfer. The
    # stand-in's device memory is host memory, so the capsule says kDLCPU where a real
    # CuPy's says kDLCUDA; refdml.torch's tests of the CUDA route run on it.
    def __dlpack__(self, *args, **kwargs):
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3. Under Numba's simulator device memory is host memory,
        so ``data`` is the host address of the backing buffer (also for an empty array,
        where CuPy would give 0) and ``strides`` are always given."""
        from cupy_standin import _cuda

        a = self._a
        # refdml's cuda_launch launches on the stream an argument was exported on
        check_capture_stream("a CUDA kernel argument exported")
        stream = _cuda.get_current_stream().ptr
        return {
            "version": 3,
            "shape": a.shape,
            "typestr": a.dtype.str,
            "descr": a.dtype.descr,
            "strides": a.strides,
            "data": (a.__array_interface__["data"][0], not a.flags.writeable),
            "stream": stream if stream != 0 else 1,  # CAI v3 forbids 0: the legacy default
        }

    # --------------------------------------------------------- refusals (as CuPy, or more)
    def __array__(self, dtype=None, copy=None):
        raise TypeError(IMPLICIT_CONVERSION)

    def __array_function__(self, func, types, args, kwargs):
        name = f"{func.__module__}.{func.__name__}"
        raise TypeError(
            f"{name} on a CuPy array: the CuPy stand-in refuses NumPy functions (CuPy runs "
            f"cupy.{func.__name__} where it has one, or raises); call it through the array "
            f"module of the input (xp.{func.__name__}).")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method not in _UFUNC_METHODS:
            return NotImplemented
        return call_ufunc(ufunc, method, inputs, kwargs, f"numpy.{ufunc.__name__}")

    # ------------------------------------------------------------------ host transfers
    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        record_transfer("get")
        return self._copy_to_host(order, out)

    def _copy_to_host(self, order="C", out=None) -> np.ndarray:
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError(f"out must be a numpy.ndarray, got {type(out)}")
            if out.shape != self._a.shape or out.dtype != self._a.dtype:
                raise ValueError("Shape or dtype mismatch between the array and out")
            out[...] = self._a
            return out
        if order == "A":
            order = "F" if self._a.flags.f_contiguous and not self._a.flags.c_contiguous else "C"
        return np.array(self._a, order=order, copy=True)

    def set(self, arr: np.ndarray, stream=None) -> None:
        """Copy host array ``arr`` into this array (an upload, as CuPy's ``set``)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("Shape or dtype mismatch")
        record_upload()
        self._a[...] = arr

    def item(self):
        if self._a.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        record_transfer("item")
        return self._a.item()

    def tolist(self):
        record_transfer("tolist")
        return self._a.tolist()

    def tobytes(self, order="C") -> bytes:
        record_transfer("tobytes")
        return self._a.tobytes(order)

    def __bool__(self) -> bool:
        if self._a.size == 0:
            import warnings

            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but "
                          "in future this will result in an error. Use `array.size > 0` to "
                          "check that an array is not empty.", DeprecationWarning, stacklevel=2)
            return False
        if self._a.size > 1:
            raise ValueError("The truth value of an array with more than one element is "
                             "ambiguous. Use a.any() or a.all()")
        record_transfer("bool")
        return bool(self._a.reshape(()))

    def __int__(self) -> int:
        record_transfer("int")
        return int(self._a.copy())

    def __float__(self) -> float:
        record_transfer("float")
        return float(self._a.copy())

    def __complex__(self) -> complex:
        record_transfer("complex")
        return complex(self._a.copy())

    def __repr__(self) -> str:
        record_transfer("format")
        return repr(self._a.copy())

    def __str__(self) -> str:
        record_transfer("format")
        return str(self._a.copy())

    def __format__(self, format_spec: str) -> str:
        record_transfer("format")
        return format(self._a.copy(), format_spec)

    def __reduce__(self):
        record_transfer("pickle")
        return _rebuild, (self._copy_to_host("A"),)

    def __copy__(self) -> ndarray:
        record_launch("ndarray.copy")
        return ndarray._wrap(self._a.copy())

    def __deepcopy__(self, memo) -> ndarray:
        record_launch("ndarray.copy")
        return ndarray._wrap(self._a.copy())

    # ------------------------------------------------------------------ containers
    def __len__(self) -> int:
        if self._a.ndim == 0:
            raise TypeError("len() of unsized object")
        return len(self._a)

    def __iter__(self):
        if self._a.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self._a.shape[0]))

    def __getitem__(self, index):
        # CuPy takes NumPy arrays and lists as indices (copied to the device).
        key = unwrap(index, "cupy.ndarray indexing", host_ok=True)
        _count_masks(key)
        result = self._a[key]
        if _is_gather(key) and np.size(result) > 0:
            record_launch("ndarray.__getitem__")
        return wrap(result)

    def __setitem__(self, index, value) -> None:
        key = unwrap(index, "cupy.ndarray assignment", host_ok=True)
        _count_masks(key)
        if isinstance(value, ndarray):
            value = value._a
        elif isinstance(value, (np.ndarray, list, tuple)) and np.ndim(value) != 0:
            # CuPy refuses assignment from host arrays (cupy/cupy gh-2079): it takes a
            # NumPy array as a scalar to fill with.
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        self._a[key] = value
        record_launch("ndarray.__setitem__")

    def fill(self, value) -> None:
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value._a
        elif np.ndim(value) != 0:
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        self._a.fill(value)
        if self._a.size:
            record_launch("ndarray.fill")

    def view(self, dtype=None, type=None) -> ndarray:
        if type is not None and type is not ndarray:
            raise TypeError(f"the CuPy stand-in makes no {type} view of a device array")
        return ndarray._wrap(self._a.view() if dtype is None else self._a.view(dtype))

    def __getattr__(self, name: str):
        if name in _DEVICE_METHODS:
            method = getattr(self._a, name)

            def device_method(*args, **kwargs):
                count_shape_syncs(name, (self, *args), kwargs)
                return call_function(method, args, kwargs, f"cupy.ndarray.{name}",
                                     owner=self._a)

            device_method.__name__ = name
            return device_method
        raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r} (the CuPy "
                             "stand-in has CuPy's ndarray methods only)")

    # ------------------------------------------------------------------ operators
    # (the arithmetic ones are set below the class, from _OPERATORS)
    __lt__, __le__ = _comparison("less", None), _comparison("less_equal", None)
    __gt__, __ge__ = _comparison("greater", None), _comparison("greater_equal", None)
    __eq__, __ne__ = _comparison("equal", False), _comparison("not_equal", True)

    def __divmod__(self, other):
        return call_ufunc(np.divmod, "__call__", (self, other), {}, "cupy.ndarray divmod")

    def __rdivmod__(self, other):
        return call_ufunc(np.divmod, "__call__", (other, self), {}, "cupy.ndarray divmod")


# Python operator -> NumPy ufunc: each gets __op__, __rop__ and __iop__ (not matmul's).
_OPERATORS = {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
              "floordiv": "floor_divide", "mod": "remainder", "pow": "power",
              "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
              "lshift": "left_shift", "rshift": "right_shift", "matmul": "matmul"}
for _op, _name in _OPERATORS.items():
    setattr(ndarray, f"__{_op}__", _binary(_name))
    setattr(ndarray, f"__r{_op}__", _binary(_name, True))
    if _op != "matmul":
        setattr(ndarray, f"__i{_op}__", _inplace(_name))
for _op, _name in {"neg": "negative", "pos": "positive", "abs": "absolute",
                   "invert": "invert"}.items():
    setattr(ndarray, f"__{_op}__", _unary(_name))


def _rebuild(host: np.ndarray) -> ndarray:
    record_upload()
    return ndarray._wrap(np.array(host, copy=True))
