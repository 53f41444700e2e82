"""The stand-in modules ``cupy``, ``cupy.cuda``, ``cupy.linalg``, ``cupy.fft``, ``cupyx``,
``cupyx.scipy``, ``cupyx.scipy.special`` and ``cupyx.scipy.linalg``, and :func:`install`.

The array modules delegate to NumPy (SciPy for ``cupyx.scipy.*``) name by name:
functions and ufuncs take stand-in arrays, Python and NumPy scalars, refuse NumPy arrays
(as CuPy's kernels do) and return stand-in arrays (0-d where NumPy returns a scalar);
types and constants pass through. Only ``array``, ``asarray`` and ``asanyarray`` take host
data (an upload, counted apart).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import numpy as np
import scipy.linalg
import scipy.special

from cupy_standin import _array, _cuda
from cupy_standin._array import (
    call_function,
    call_ufunc,
    count_shape_syncs,
    ndarray,
    record_launch,
    record_transfer,
    record_upload,
    unwrap,
)

__all__ = ["build_modules", "install"]

VERSION = "14.0.0+refdml.standin"

# NumPy functions that return a Python scalar where CuPy returns a 0-d array.
_ARRAY_RESULT = frozenset(("count_nonzero", "allclose", "array_equal", "array_equiv"))
# CuPy refuses these dtypes on the device.
_HOST_ONLY_KINDS = frozenset("OUSVMm")


class Ufunc:
    """A NumPy (or SciPy) ufunc as the stand-in's ``cupy.<name>``: stand-in arrays in and
    out, NumPy arrays refused, even when every input is a scalar (``cupy.exp(2.0)`` is a
    0-d device array)."""

    def __init__(self, ufunc: np.ufunc, where: str) -> None:
        self._ufunc = ufunc
        self._where = where
        self.__name__ = ufunc.__name__
        self.__doc__ = ufunc.__doc__

    def _run(self, method: str, args: tuple, kwargs: dict) -> Any:
        result = call_ufunc(self._ufunc, method, args, kwargs, self._where)
        if result is NotImplemented:
            raise TypeError(f"{self._where}: unsupported operand types "
                            + ", ".join(type(a).__name__ for a in args))
        return result

    def __call__(self, *args, **kwargs):
        return self._run("__call__", args, kwargs)

    def reduce(self, *args, **kwargs):
        return self._run("reduce", args, kwargs)

    def accumulate(self, *args, **kwargs):
        return self._run("accumulate", args, kwargs)

    def reduceat(self, *args, **kwargs):
        return self._run("reduceat", args, kwargs)

    def outer(self, *args, **kwargs):
        return self._run("outer", args, kwargs)

    def at(self, *args, **kwargs):
        return self._run("at", args, kwargs)

    def __getattr__(self, name: str):
        return getattr(self._ufunc, name)   # nin, nout, identity, types, ...

    def __repr__(self) -> str:
        return f"<ufunc {self._where} (CuPy stand-in)>"


def _function(function: Any, where: str, name: str) -> Any:
    def device_function(*args, **kwargs):
        result = call_function(function, args, kwargs, where)
        count_shape_syncs(name, args, kwargs)
        if name in _ARRAY_RESULT and isinstance(result, (bool, int, float, np.generic)):
            if not isinstance(result, np.generic):   # (call_function counted a NumPy scalar)
                record_launch(name)                   # a reduction on the device in CuPy
            return ndarray._wrap(np.asarray(result))
        return result

    device_function.__name__ = name
    device_function.__qualname__ = where
    device_function.__doc__ = f"{where}: numpy's {name} on the CuPy stand-in's arrays."
    return device_function


def _delegate(module: types.ModuleType, source: types.ModuleType) -> None:
    """Give ``module`` a PEP 562 ``__getattr__`` that wraps ``source``'s names on first use."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            attr = getattr(source, name)
        except AttributeError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} "
                                 f"(the CuPy stand-in delegates to {source.__name__})") from None
        where = f"{module.__name__}.{name}"
        if isinstance(attr, np.ufunc):
            value = Ufunc(attr, where)
        elif isinstance(attr, types.ModuleType):
            raise AttributeError(f"module {module.__name__!r} has no submodule {name!r} in the "
                                 "CuPy stand-in (add it to tests/cupy_standin/_modules.py)")
        elif isinstance(attr, type) or not callable(attr):
            value = attr      # dtypes and scalar types, finfo, constants
        else:
            value = _function(attr, where, name)
        module.__dict__[name] = value
        return value

    module.__getattr__ = __getattr__


def _upload(obj: Any, where: str, **kwargs) -> ndarray:
    record_upload()
    host = np.array(unwrap(obj, where, host_ok=True), copy=True, **kwargs)
    if host.dtype.kind in _HOST_ONLY_KINDS:
        raise ValueError(f"Unsupported dtype {host.dtype}")
    return ndarray._wrap(host)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *,
          blocking=False) -> ndarray:
    if isinstance(obj, ndarray):
        return call_function(np.array, (obj,),
                             dict(dtype=dtype, copy=copy, order=order, ndmin=ndmin), "cupy.array")
    return _upload(obj, "cupy.array", dtype=dtype, order=order, ndmin=ndmin)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False) -> ndarray:
    if isinstance(a, ndarray):
        return call_function(np.asarray, (a,), dict(dtype=dtype, order=order, copy=copy),
                             "cupy.asarray")
    return _upload(a, "cupy.asarray", dtype=dtype, order=order or "K")


def from_dlpack(obj) -> ndarray:
    """CuPy's zero-copy import of another library's device array (a DLPack producer: a
    torch CUDA tensor there, any host producer here): shared memory, no transfer counted."""
    return ndarray._wrap(np.from_dlpack(obj))


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    if isinstance(a, ndarray):
        record_transfer("asnumpy")
        return a._copy_to_host(order, out)
    host = np.asarray(a, order=order)
    if out is not None:
        out[...] = host
        return out
    return host


def get_array_module(*args) -> types.ModuleType:
    return sys.modules["cupy"] if any(isinstance(a, ndarray) for a in args) else np


def scatter_add(a: ndarray, slices, value) -> None:
    record_launch("cupyx.scatter_add")
    np.add.at(unwrap(a, "cupyx.scatter_add"), unwrap(slices, "cupyx.scatter_add", host_ok=True),
              unwrap(value, "cupyx.scatter_add"))


def scatter_max(a: ndarray, slices, value) -> None:
    record_launch("cupyx.scatter_max")
    np.maximum.at(unwrap(a, "cupyx.scatter_max"), unwrap(slices, "cupyx.scatter_max", host_ok=True),
                  unwrap(value, "cupyx.scatter_max"))


def scatter_min(a: ndarray, slices, value) -> None:
    record_launch("cupyx.scatter_min")
    np.minimum.at(unwrap(a, "cupyx.scatter_min"), unwrap(slices, "cupyx.scatter_min", host_ok=True),
                  unwrap(value, "cupyx.scatter_min"))


def cholesky(a: ndarray) -> ndarray:
    """``cupy.linalg.cholesky``. cuSOLVER reports a matrix that is not positive definite in
    ``devInfo``, which CuPy reads (a sync) only under ``cupyx.errstate(linalg="raise")``;
    by default ("ignore") there is no ``LinAlgError`` and the factor means nothing. The
    stand-in returns NaN there, so that code relying on NumPy's exception shows."""
    host = unwrap(a, "cupy.linalg.cholesky")
    record_launch("linalg.cholesky")
    try:
        with np.errstate(all="ignore"):
            factor = np.linalg.cholesky(host)
    except np.linalg.LinAlgError:
        dtype = host.dtype if host.dtype.kind in "fc" else np.dtype(np.float64)
        factor = np.full(host.shape, np.nan, dtype=dtype)
    return ndarray._wrap(factor)


_POOL = _cuda.MemoryPool()


def _module(name: str, doc: str, attrs: dict, *, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    if package:
        module.__path__ = []
    module.__dict__.update(attrs)
    return module


def build_modules() -> dict[str, types.ModuleType]:
    """The stand-in modules by import name (fresh objects; nothing is installed)."""
    cuda = _module("cupy.cuda", "cupy.cuda of the CuPy stand-in (tests/cupy_standin).", {
        name: getattr(_cuda, name) for name in (
            "Device", "Event", "Graph", "MemoryPool", "Stream", "get_current_stream",
            "get_elapsed_time", "runtime", "is_available", "get_device_id", "using_allocator")
    } | {"MemoryPointer": _array._MemoryPointer})
    cupy = _module("cupy", "The CuPy stand-in (tests/cupy_standin): NumPy arrays behind CuPy's "
                   "rules; see tests/cupy_standin/__init__.py.", {
                       "__refdml_standin__": True,
                       "__version__": VERSION,
                       "ndarray": ndarray,
                       "array": array,
                       "asarray": asarray,
                       "asanyarray": asarray,
                       "asnumpy": asnumpy,
                       "from_dlpack": from_dlpack,
                       "get_array_module": get_array_module,
                       "get_default_memory_pool": lambda: _POOL,
                       "get_default_pinned_memory_pool": lambda: _POOL,
                       "cuda": cuda,
                   }, package=True)
    linalg = _module("cupy.linalg", "cupy.linalg of the CuPy stand-in.", {"cholesky": cholesky})
    fft = _module("cupy.fft", "cupy.fft of the CuPy stand-in.", {})
    special = _module("cupyx.scipy.special", "cupyx.scipy.special of the CuPy stand-in.", {})
    sp_linalg = _module("cupyx.scipy.linalg", "cupyx.scipy.linalg of the CuPy stand-in.", {})
    scipy_ = _module("cupyx.scipy", "cupyx.scipy of the CuPy stand-in.",
                     {"special": special, "linalg": sp_linalg}, package=True)
    cupyx = _module("cupyx", "cupyx of the CuPy stand-in.", {
        "__refdml_standin__": True, "scipy": scipy_, "scatter_add": scatter_add,
        "scatter_max": scatter_max, "scatter_min": scatter_min,
    }, package=True)
    _delegate(cupy, np)
    _delegate(linalg, np.linalg)
    _delegate(fft, np.fft)
    _delegate(special, scipy.special)
    _delegate(sp_linalg, scipy.linalg)
    cupy.linalg, cupy.fft = linalg, fft
    return {m.__name__: m for m in (cupy, cuda, linalg, fft, cupyx, scipy_, special, sp_linalg)}


def install() -> None:
    """Put the stand-in modules into ``sys.modules`` (once; before anything imports cupy).

    A real CuPy already imported is an error: the two must never mix in one process.
    """
    present = sys.modules.get("cupy")
    if present is not None:
        if getattr(present, "__refdml_standin__", False):
            return
        raise RuntimeError("the real CuPy is already imported; the stand-in cannot replace it")
    sys.modules.update(build_modules())
