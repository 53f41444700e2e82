"""The backend object: NumPy or CuPy, and everything that differs between them (base layer).

The fast path (:mod:`refdml.gpu`) and the training layers are written once against the array
library of their inputs, as POT's solvers are written against its backend ``nx``: a
function asks :func:`get_backend` once for the backend of its arrays and calls it. Every
difference between NumPy and CuPy is a method or an attribute of :class:`Backend`, so the
maths never asks which library it runs on (``tests/test_backend_branches.py`` counts the
branches on the library outside this module: none). CuPy is never imported unless an input
already is a CuPy array, so ``import refdml`` works without it.

What differs, and where it lives here:

* the array module ``xp`` and its companions: ``special`` (``scipy.special`` or
  ``cupyx.scipy.special``) and ``linalg`` (``scipy.linalg`` or ``cupyx.scipy.linalg``);
* scatter-add with repeated indices (:meth:`Backend.scatter_add`: ``np.add.at`` or
  ``cupyx.scatter_add``);
* host transfers (:meth:`Backend.to_numpy`; :func:`to_numpy` for any array);
* floating-point warnings (:meth:`Backend.errstate`: NumPy warns and is silenced where an
  overflow is checked afterwards; CuPy never warns);
* what counts as the backend's own array (:meth:`Backend.is_own_array`: NumPy's reductions
  return NumPy scalars, CuPy's 0-d arrays) and what a float32 matrix product rounds its
  inputs to (:meth:`Backend.matmul_input_roundoff`: TF32 on CuPy under ``CUPY_TF32``);
* what a host read costs (:meth:`Backend.check_every`, :meth:`Backend.known_equal`,
  :attr:`Backend.data_checks`): free on NumPy, a synchronisation of the device on CuPy, so
  a loop tests its convergence every few iterations there and a check of the data runs
  only while :func:`set_finite_checks` allows it;
* constants worth caching (:meth:`Backend.cached`: read-only NumPy arrays kept per key;
  CuPy builds them anew, on the current device; :meth:`Backend.is_cached` recognises one;
  :meth:`Backend.kept`: built once on the host and, on CuPy, uploaded once per device);
* optional refinements whose size depends on the data (:meth:`Backend.refine`: run on
  NumPy, skipped on CuPy, where the size would be a synchronisation), work on a
  data-dependent subset of rows (:attr:`Backend.gathers_rows`: gathered on NumPy, all rows
  and ``where`` on CuPy), and results known for free (:meth:`Backend.known_true`: a host
  read on NumPy only);
* a wait for the device (:meth:`Backend.synchronize`, for timing only);
* work that may run beside the caller's (:meth:`Backend.alongside`): on NumPy, inside
  :func:`side_thread`, on one worker thread of this module while the caller goes on (a
  matrix product releases the GIL, so the two use two cores); on CuPy always at once, in
  order, on the caller's stream (CuPy's current stream is per thread, and a captured step
  must record every launch on its own); and work split between the two
  (:meth:`Backend.halves`: two halves of a batch on NumPy, the whole at once on CuPy).

>>> import numpy as np
>>> backend = get_backend(np.zeros(3))
>>> backend.name, backend.xp is np, backend.special.__name__
('numpy', True, 'scipy.special')
>>> target = np.zeros(3)
>>> backend.scatter_add(target, np.array([0, 0, 2]), np.ones(3))
>>> target.tolist()
[2.0, 0.0, 1.0]
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import scipy.linalg
import scipy.special

__all__ = [
    "Backend",
    "device_memory_on_host",
    "get_backend",
    "hand_operator_checks_to_step",
    "is_array",
    "is_device_array",
    "as_input_array",
    "set_finite_checks",
    "side_thread",
    "to_numpy",
]

#: Whether data-dependent checks (finiteness, zero rows, ...) run on CuPy inputs, where
#: each costs one device-to-host synchronisation (:func:`set_finite_checks`). On NumPy they
#: always run: a host read there is free.
_CHECKS_ON_DEVICE = True

#: Device constants :meth:`Backend.kept` keeps at most, per backend.
MAX_KEPT = 128
_KEPT_LOCK = threading.Lock()

#: Inside a training step on a device, the step checks its inputs, loss and gradients on
#: the device and the operators leave theirs to it (:func:`hand_operator_checks_to_step`).
_CHECKS_HANDED_TO_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "refdml_checks_handed_to_step", default=False)


def set_finite_checks(enabled: bool) -> None:
    """Turn the data checks of CuPy inputs on or off (each synchronises the device).

    ``refdml.gpu.set_finite_checks`` is this function. NumPy inputs are always checked.
    """
    global _CHECKS_ON_DEVICE
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    _CHECKS_ON_DEVICE = enabled


@contextlib.contextmanager
def hand_operator_checks_to_step() -> Iterator[None]:
    """Within the block, :attr:`Backend.data_checks` is False on CuPy: the enclosing
    training step checks on the device, without a host read, what the operators would
    have checked with one (:mod:`refdml._deferred`). NumPy inputs are still checked."""
    token = _CHECKS_HANDED_TO_STEP.set(True)
    try:
        yield
    finally:
        _CHECKS_HANDED_TO_STEP.reset(token)


#: Whether :meth:`Backend.alongside` hands NumPy work to the side thread (:func:`side_thread`).
_SIDE_THREAD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "refdml_side_thread", default=False)
_SIDE_LOCK = threading.Lock()
_SIDE_EXECUTOR: ThreadPoolExecutor | None = None


@contextlib.contextmanager
def side_thread(enabled: bool = True) -> Iterator[None]:
    """Within the block (in this thread), :meth:`Backend.alongside` runs NumPy work on one
    worker thread beside the caller (``enabled=False``: at once, in the caller's thread,
    which is also what happens outside every block).

    ``refdml.train.side_thread`` is this function; :meth:`refdml.train.Trainer.fit` enters
    it on the CPU (``Trainer(side_thread=True)``, the default, where the process may run on
    two CPUs or more). What runs beside is chosen where the maths has two independent parts
    that release the GIL (a layer's weight gradient and its input's; the two halves of a
    batch, :meth:`Backend.halves`), each computed exactly as it is computed at once (the
    same single-threaded calls), so the numbers do not depend on the setting; only when
    they are ready does.
    """
    if not isinstance(enabled, (bool, np.bool_)):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    token = _SIDE_THREAD.set(bool(enabled))
    try:
        yield
    finally:
        _SIDE_THREAD.reset(token)


def _side_executor() -> ThreadPoolExecutor:
    global _SIDE_EXECUTOR
    with _SIDE_LOCK:
        if _SIDE_EXECUTOR is None:
            _SIDE_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="refdml-side")
        return _SIDE_EXECUTOR


def _forget_side_executor() -> None:
    """In a forked child: the worker thread was not copied (only the forking thread is), so
    a fresh executor and lock are made on first use instead of queueing to a dead one."""
    global _SIDE_EXECUTOR, _SIDE_LOCK
    _SIDE_EXECUTOR = None
    _SIDE_LOCK = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_side_executor)


def _run_alone(function: Callable[..., Any], args: tuple) -> Any:
    """``function(*args)`` with the side thread off: work it hands on runs at once (the one
    worker waiting on a job queued behind itself would wait for ever)."""
    _SIDE_THREAD.set(False)
    return function(*args)


@dataclass(frozen=True, eq=False)
class Backend:
    """One array library as the fast path uses it (module docstring).

    ``name``: ``"numpy"`` or ``"cupy"``; ``xp``, ``special``, ``linalg``: its array module,
    special functions and linear algebra. ``free_host_reads``: whether reading a value to
    the host costs nothing (NumPy) or synchronises the device (CuPy); the methods below are
    the only places that read it, and the maths calls the methods. ``kernel_target``: which
    compiled kernels take its arrays, ``"cpu"`` (Numba's ``@njit`` twins) or ``"cuda"``
    (``@cuda.jit`` kernels); only the fast path's chooser
    (:class:`refdml.gpu._support.modes.Implementations`) reads it.
    """

    name: str
    xp: ModuleType
    special: ModuleType
    linalg: ModuleType
    free_host_reads: bool
    kernel_target: str
    _scatter_add: Callable[[Any, Any, Any], None] = field(repr=False)
    _cache: dict = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"

    def scatter_add(self, target: Any, index: Any, values: Any) -> None:
        """``target[index] += values`` in place, repeated indices summed."""
        self._scatter_add(target, index, values)

    def to_numpy(self, value: Any) -> np.ndarray:
        """A NumPy array of ``value`` (a copy from the device on CuPy)."""
        return to_numpy(value)

    def errstate(self, **kwargs: str) -> contextlib.AbstractContextManager:
        """``numpy.errstate(**kwargs)`` on NumPy; nothing on CuPy, which never warns."""
        if self.free_host_reads:
            return np.errstate(**kwargs)
        return contextlib.nullcontext()

    def capturing(self) -> bool:
        """Whether CuPy's current stream is capturing a CUDA graph (always False on NumPy):
        work queued now is recorded, not run, and CuPy refuses to call cuBLAS, cuSOLVER or
        cuRAND (:mod:`refdml.gpu.linalg` runs its kernels instead). A query of the stream's
        state (``cudaStreamIsCapturing``): no synchronisation. The legacy default stream
        (``ptr`` 0) never captures, and is not asked: CUDA refuses that query while another
        stream captures."""
        if self.free_host_reads:
            return False
        stream = self.xp.cuda.get_current_stream()
        return stream.ptr != 0 and stream.is_capturing()

    def row_dot(self, a: Any, b: Any) -> Any:
        """``<a, b>`` over the last axis, keepdims (``sum(a * b, axis=-1, keepdims=True)``):
        one batched matrix product of (1, d) by (d, 1), one kernel on a device; while CuPy
        captures (:meth:`capturing`), where CuPy refuses cuBLAS, the product and a sum (two
        kernels). The same sum either way, in another order of its terms."""
        if self.capturing():
            return self.xp.sum(a * b, axis=-1, keepdims=True)
        return (a[..., None, :] @ b[..., :, None])[..., 0]

    def alongside(self, function: Callable[..., Any], *args: Any) -> Future:
        """``function(*args)`` as a :class:`concurrent.futures.Future`: on NumPy inside
        :func:`side_thread`, queued to the side thread, and the caller goes on until it
        asks for ``.result()`` (which re-raises what ``function`` raised); otherwise run at
        once (CuPy always: module docstring). ``function`` must not write into an array the
        caller reads or writes before that ``.result()``, nor read one the caller writes;
        it runs in a copy of the caller's context (its settings), with the side thread off.
        """
        if self.free_host_reads and _SIDE_THREAD.get():
            context = contextvars.copy_context()
            return _side_executor().submit(context.run, _run_alone, function, args)
        done: Future = Future()
        try:
            done.set_result(function(*args))
        except Exception as error:  # raised at .result(), as from the side thread
            done.set_exception(error)
        return done

    def halves(self, function: Callable[[slice], Any], size: int) -> list[Any]:
        """``[function(part), ...]`` for the two halves ``part`` of ``range(size)`` (slices
        of a leading axis), in order: the second :meth:`alongside`, the first here, then
        both done. On NumPy always in two halves, with the side thread or without (so the
        numbers do not depend on it); on CuPy once, for the whole (two halves would double
        its launches), and for ``size < 2``. ``function`` writes its part of a large
        result into an array the caller made (or returns small ones, which
        :meth:`joined` puts together), and neither half reads what the other writes.
        An error is raised after both halves ran."""
        if not self.free_host_reads or size < 2:
            return [function(slice(0, size))]
        middle = (size + 1) // 2
        second = self.alongside(function, slice(middle, size))
        try:
            first = function(slice(0, middle))
        finally:
            second.exception()      # wait: the second half writes into the caller's arrays
        return [first, second.result()]

    def joined(self, parts: list[Any]) -> Any:
        """The arrays ``parts`` (from :meth:`halves`) as one, along the leading axis: the
        one part itself where there is one (no copy)."""
        return parts[0] if len(parts) == 1 else self.xp.concatenate(parts)

    def synchronize(self) -> None:
        """Wait until the device has done its queued work (timing only; no-op on NumPy)."""
        if not self.free_host_reads:
            self.xp.cuda.Device().synchronize()

    def is_own_array(self, value: Any) -> bool:
        """True for an array of this backend: a ``cupy.ndarray`` on CuPy; on NumPy a
        ``numpy.ndarray`` or a NumPy scalar, which NumPy's reductions return where CuPy's
        return 0-d arrays (``x.sum()``). A list, or an array of the other backend, is not."""
        if self.free_host_reads:
            return isinstance(value, (np.ndarray, np.generic))
        return is_device_array(value)

    def matmul_input_roundoff(self) -> float:
        """Unit roundoff of the inputs of a float32 matrix product (``xp.matmul``) on this
        backend: ``2^-24`` (IEEE float32: the product multiplies the float32 values as they
        are), or ``2^-10`` on CuPy while the environment variable ``CUPY_TF32`` is set (to
        anything but ``""`` or ``"0"``), where cuBLAS runs float32 products on tensor cores
        and first rounds each input to TF32's 10-bit mantissa. A rounding-error bound of the
        product takes it (:func:`refdml.gpu.metrics._certificate.gemm_score_bound`)."""
        if self.name == "cupy" and os.environ.get("CUPY_TF32", "0") not in ("", "0"):
            return 2.0**-10
        return 2.0**-24

    # ------------------------------------------ host reads: free on NumPy, a sync on CuPy
    @property
    def data_checks(self) -> bool:
        """Whether data-dependent checks run: always on NumPy, on CuPy while
        :func:`set_finite_checks` allows them (each synchronises once) and no training step
        has taken them over (:func:`hand_operator_checks_to_step`)."""
        return self.free_host_reads or (_CHECKS_ON_DEVICE and not _CHECKS_HANDED_TO_STEP.get())

    def check_every(self, iterations: int) -> int:
        """Iterations between two host reads of a loop's convergence test: every one on
        NumPy (free), ``iterations`` on CuPy (each read synchronises the device)."""
        return 1 if self.free_host_reads else iterations

    def known_equal(self, value: Any, constant: float) -> bool:
        """True where the backend can tell for free that the 0-d ``value`` equals
        ``constant`` (NumPy); CuPy never reads it (False), so the caller does the work that
        equality would have spared."""
        return self.free_host_reads and float(value) == constant

    def known_true(self, flag: Any) -> bool:
        """True where the backend can tell for free that the 0-d boolean ``flag`` holds
        (NumPy); CuPy never reads it (False), so the caller takes the route that is right
        whatever ``flag`` is (``where`` over both branches) instead of a host read."""
        return self.free_host_reads and bool(flag)

    def refine(self, step: Callable[..., None], *args: Any) -> None:
        """Run ``step(*args)``: an optional refinement, in place, of a result that is already
        right to a stated tolerance, whose work depends on the data (it selects entries by
        value, so their count is read on the host). NumPy runs it (the read is free); CuPy
        skips it (the read would synchronise the device on every call), so the result there
        is the unrefined one, and the caller's docstring states that tolerance."""
        if self.free_host_reads:
            step(*args)

    @property
    def launch_bound(self) -> bool:
        """Whether every array operation costs a kernel launch (CuPy: False on NumPy). A
        speed choice for code with two equal forms: one gather or scatter by a kept index
        (few launches) where True, a loop of cheap host copies where False (the
        convolution's im2col and col2im, :mod:`refdml.train._conv`)."""
        return not self.free_host_reads

    @property
    def gathers_rows(self) -> bool:
        """Whether work that concerns a data-dependent subset of rows (a mask, the rows
        whose values left a range) runs on those rows alone, gathered by index: True on
        NumPy, where the subset is read for free; False on CuPy, where reading it (its
        count) synchronises the device, so the work runs on every row and is kept by
        ``where``, or a step that is safe for every row replaces a cheaper one that needs a
        repair of a few.

        A speed choice: both choices compute the same quantity, to rounding (or, for an
        iteration, to its stopping tolerance). refdml.gpu.ot takes it three times: the
        log-sum-exp half step (NumPy: stabilised by the potential it replaces, the rows
        that leave the normal range recomputed; CuPy: every row's maximum subtracted), the
        Sinkhorn loop (NumPy: kernel scalings, the problems whose scalings leave range
        re-absorbed each iteration; CuPy: log-domain half steps, no read per iteration) and
        the large-eps finish (NumPy: the problems that need it gathered; CuPy: every
        problem's half steps computed and kept where needed).
        """
        return self.free_host_reads

    # ---------------------------------------------------------------- constants
    def cached(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """``build()``, kept read-only per ``key`` on NumPy (at most 64 keys); built anew on
        CuPy, where an array belongs to the current device and is cheap to make."""
        if not self.free_host_reads:
            return build()
        array = self._cache.get(key)
        if array is None:
            array = build()
            array.flags.writeable = False
            if len(self._cache) < 64:
                self._cache[key] = array
        return array

    def kept(self, key: Hashable, build: Callable[[], np.ndarray], device: Hashable = None) -> Any:
        """A constant built once on the host by ``build()`` (a NumPy array, the same for the
        same ``key``) and kept: read-only on NumPy (as :meth:`cached`); on CuPy uploaded
        once per ``(device, key)`` and kept (at most :data:`MAX_KEPT`, the oldest dropped),
        so that a later call neither builds nor copies it: a captured step (a CUDA graph)
        cannot replay a copy from host memory that has since changed. Callers read a kept
        array and never write into it."""
        if self.free_host_reads:
            return self.cached(("kept", key), build)
        key = (device, key)
        with _KEPT_LOCK:
            value = self._cache.get(key)
            if value is None:
                value = self.xp.asarray(build())
                if len(self._cache) >= MAX_KEPT:
                    del self._cache[next(iter(self._cache))]
                self._cache[key] = value
        return value

    def kept_arrays(self) -> list[Any]:
        """The arrays :meth:`kept` (and :meth:`cached`) hold now, a snapshot: what a
        captured step keeps alive beside its graph, whose kernels read them by address
        (the backend may drop its oldest later)."""
        with _KEPT_LOCK:
            return list(self._cache.values())

    def is_cached(self, key: Hashable, value: Any) -> bool:
        """True when ``value`` is the very array :meth:`cached` keeps under ``key`` (an
        identity test: no data read); always False on CuPy, which keeps none. A caller that
        recognises its own constant (the fast path's unit scales) skips arithmetic by it."""
        return value is not None and self._cache.get(key) is value


def _numpy_backend() -> Backend:
    return Backend(name="numpy", xp=np, special=scipy.special, linalg=scipy.linalg,
                   free_host_reads=True, kernel_target="cpu", _scatter_add=np.add.at)


_NUMPY = _numpy_backend()
_CUPY: Backend | None = None


def _cupy_backend() -> Backend:
    global _CUPY
    if _CUPY is None:
        import cupy
        import cupyx
        import cupyx.scipy.linalg
        import cupyx.scipy.special

        _CUPY = Backend(name="cupy", xp=cupy, special=cupyx.scipy.special,
                        linalg=cupyx.scipy.linalg, free_host_reads=False,
                        kernel_target="cuda", _scatter_add=cupyx.scatter_add)
    return _CUPY


def is_device_array(value: Any) -> bool:
    """True for a ``cupy.ndarray`` (checked without importing CuPy)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def device_memory_on_host() -> bool:
    """Whether the ``cupy`` module is refdml's CuPy stand-in (tests/cupy_standin, a module
    with ``__refdml_standin__``), whose arrays live in host memory: Numba's CUDA simulator
    can then run the CUDA kernels on them (a real CuPy array's memory it cannot read)."""
    return bool(getattr(sys.modules.get("cupy"), "__refdml_standin__", False))


def is_array(value: Any) -> bool:
    """True for a NumPy or a CuPy array."""
    return isinstance(value, np.ndarray) or is_device_array(value)


def as_input_array(value: Any) -> Any:
    """``value`` itself when it is a CuPy array, else ``numpy.asarray(value)``: an input
    whose dtype and shape can be checked before it is converted."""
    return value if is_device_array(value) else np.asarray(value)


def get_backend(*arrays: Any) -> Backend:
    """The backend of the inputs (``None`` and scalars ignored); NumPy when none is an
    array. Mixing NumPy and CuPy arrays is a ``TypeError``."""
    kinds = {is_device_array(a) for a in arrays if a is not None and not np.isscalar(a)}
    if kinds == {True, False}:
        raise TypeError(
            "inputs mix NumPy and CuPy arrays; move them to one device first "
            "(cupy.asarray(x) or cupy.asnumpy(x))"
        )
    if kinds == {True}:
        return _cupy_backend()
    return _NUMPY


def to_numpy(value: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array (for comparisons with the reference)."""
    if is_device_array(value):
        return value.get()
    return np.asarray(value)
