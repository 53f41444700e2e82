r"""Device reads put off until the caller reads the device anyway.

On CuPy every host read of a device value (a finiteness check, a solver's convergence
report, a loss turned into a Python float) stops the host until the device has done all
its queued work. A training step that reads a dozen such values runs the device in
bursts, idle between them. :class:`DeferredReads` collects those values on the device
instead and reads them all in **one** transfer when :meth:`DeferredReads.read` is called:
the training loop calls it every ``log_every`` steps and at the end of an epoch, where it
reads the loss anyway.

What is deferred is not dropped. Each value is registered with a callback,
``on_read(values, where)``, that receives the host copy (a 1-d NumPy array) and the label
of the moment it was recorded (``where``: the loop sets :attr:`DeferredReads.where` to
``"epoch 3, step 17"`` before each step), and may raise (a failed check) or warn (a solver
that did not converge). :meth:`DeferredReads.read` calls the callbacks in the order the
values were recorded, so the first failure raised is the earliest one.

Two entry points for code below the loop:

- :func:`read_later` (values, on_read): inside a :func:`deferring` scope on a device
  backend, record; anywhere else (NumPy, or no scope), read now and call ``on_read`` at
  once: a standalone call behaves as it did before deferral existed.
- :func:`read_now` (values, on_read): for a value the caller must decide on before it
  returns (the GSP layer's backward: whether to redo float32 in float64); inside a scope on a
  device it reads the scope's pending values with it, in the same transfer.
- :func:`step_checks_deferred`: whether the operators' own data checks are handed to the
  enclosing step (:attr:`refdml._backend.Backend.data_checks` is False then, on CuPy).
  Inside a training step the values the operators would check are the step's own
  intermediates: the loop checks, on the device, the step's inputs, the loss, the
  objective's gradient of the outputs and every parameter gradient (the optimiser folds
  that check into its update), and a non-finite intermediate reaches the loss or a
  gradient. Outside a step, or with ``operator_checks=True``, the operators check as
  before.

>>> import numpy as np
>>> reads = DeferredReads()
>>> seen = []
>>> reads.add(np.array([1.0, 2.0]), lambda values, where: seen.append((values.tolist(), where)))
>>> reads.read()        # NumPy: one "transfer" of both values, then the callback
>>> seen
[([1.0, 2.0], '')]
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from refdml._backend import get_backend, hand_operator_checks_to_step, to_numpy
from refdml.exceptions import NonFiniteGradient

__all__ = ["CaptureUnsafe", "DeferredReads", "StagedUploads", "check_finite_later", "current",
           "deferring", "read_later", "read_now", "staged_upload", "staging"]

#: ``on_read(values, where)``: the host copy (1-d NumPy) and the label of when it was recorded.
OnRead = Callable[[np.ndarray, str], None]

_CURRENT: contextvars.ContextVar[DeferredReads | None] = contextvars.ContextVar(
    "refdml_deferred_reads", default=None)
_STAGE: contextvars.ContextVar[Any] = contextvars.ContextVar("refdml_staged_uploads",
                                                              default=None)


class CaptureUnsafe(RuntimeError):
    """Something a captured step (a CUDA graph) cannot replay: an upload inside the captured
    region of a host value that was not staged before it (:func:`staged_upload`)."""


class DeferredReads:
    """Device values waiting for one host read, each with what to do once read.

    Attributes
    ----------
    where : str
        Label recorded with each value added from now on (the loop's ``"epoch e, step s"``).
    reads : int
        How many host reads (transfers) :meth:`read` has made: one per call with values
        pending, none for an empty one.
    failed_where : str or None
        The ``where`` of the first callback that raised in the last :meth:`read`.
    """

    def __init__(self) -> None:
        self.where = ""
        self.reads = 0
        self.failed_where: str | None = None
        self._pending: list[tuple[Any, OnRead, str]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, values: Any, on_read: OnRead) -> None:
        """Record ``values`` (an array of any shape and real or bool dtype, NumPy or CuPy,
        or a tuple of such arrays, handed to ``on_read`` raveled one after the other) and
        ``on_read``; nothing is read until :meth:`read`."""
        if not callable(on_read):
            raise TypeError(f"on_read must be callable, got {type(on_read).__name__}")
        arrays = values if isinstance(values, tuple) else (values,)
        for array in arrays:
            if not (hasattr(array, "shape") and hasattr(array, "dtype")):
                raise TypeError(f"values must be an array or a tuple of arrays, got "
                                f"{type(array).__name__}")
        self._pending.append((arrays, on_read, self.where))

    def take(self) -> list[tuple[tuple[Any, ...], OnRead, str]]:
        """The pending records ``(arrays, on_read, where)``, in order, removed unread: a
        captured step keeps them as the templates of what each replay writes into its ring
        of device rows (:mod:`refdml.train._capture`)."""
        pending, self._pending = self._pending, []
        return pending

    def read(self) -> None:
        """Read every pending value in one transfer and call the callbacks in order.

        Every callback runs, even after one has raised (each may have state to put right:
        an optimiser rolls back the steps it counted past a failure); the first exception
        is raised once all have run. The pending list is emptied first, so nothing is
        raised again by the next :meth:`read`.
        """
        pending, self._pending = self._pending, []
        self.failed_where = None
        if not pending:
            return
        arrays = [array for values, _, _ in pending for array in values]
        xp = get_backend(*arrays).xp
        # One transfer, whatever the count, after one launch (a concatenate, which casts)
        # where there are several arrays; float64 holds every bool, every index below
        # 2**53 and every float exactly.
        if len(arrays) == 1:
            host = np.asarray(to_numpy(arrays[0]), dtype=np.float64).reshape(-1)
        else:
            host = to_numpy(xp.concatenate([xp.reshape(a, (-1,)) for a in arrays],
                                           dtype=np.float64))
        self.reads += 1
        start = 0
        first_error: BaseException | None = None
        for values, on_read, where in pending:
            size = sum(int(np.prod(a.shape, dtype=np.int64)) for a in values)
            try:
                on_read(host[start:start + size], where)
            except Exception as error:      # noqa: BLE001 - re-raised below, the first one
                if first_error is None:
                    first_error, self.failed_where = error, where
            start += size
        if first_error is not None:
            raise first_error


def current() -> DeferredReads | None:
    """The :class:`DeferredReads` of the enclosing :func:`deferring` scope, or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def deferring(reads: DeferredReads, *, operator_checks: bool = False) -> Iterator[DeferredReads]:
    """Within the block, :func:`read_later` on device values records them in ``reads``; with
    ``operator_checks=False`` (a training step) the operators' data checks of CuPy inputs
    are handed to the step (module docstring)."""
    if not isinstance(reads, DeferredReads):
        raise TypeError(f"reads must be a DeferredReads, got {type(reads).__name__}")
    token = _CURRENT.set(reads)
    try:
        if operator_checks:
            yield reads
        else:
            with hand_operator_checks_to_step():
                yield reads
    finally:
        _CURRENT.reset(token)


def read_later(values: Any, on_read: OnRead) -> None:
    """Hand ``values`` (an array or a tuple of arrays, as :meth:`DeferredReads.add`) to the
    enclosing scope's :class:`DeferredReads` when they are on a device; else (NumPy, or no
    scope) read them now, as one transfer, and call ``on_read(values, "")``."""
    reads = _CURRENT.get()
    arrays = values if isinstance(values, tuple) else (values,)
    if reads is None or get_backend(*arrays).free_host_reads:
        now = DeferredReads()
        now.add(values, on_read)
        now.read()
        return
    reads.add(values, on_read)


def read_now(values: Any, on_read: OnRead) -> None:
    """Read ``values`` (as :func:`read_later`) now, for a caller that decides on them before
    it returns, and call ``on_read(values, where)``. Inside a :func:`deferring` scope on a
    device the scope's pending values come along in the same transfer (their callbacks run
    first, in the order recorded; the first failure is raised once all have run, as
    :meth:`DeferredReads.read`): the read the caller must pay anyway settles what waits.
    Anywhere else (NumPy, or no scope) it reads ``values`` alone, at once."""
    reads = _CURRENT.get()
    arrays = values if isinstance(values, tuple) else (values,)
    if reads is None or get_backend(*arrays).free_host_reads:
        read_later(values, on_read)
        return
    reads.add(values, on_read)
    reads.read()


def check_finite_later(array: Any, name: str) -> Any:
    """Record whether ``array`` is finite and where its first non-finite entry is (on a
    device: three launches, no read) and return the 0-d boolean "all finite" on the array's
    device (a step folds it into its gate). When read, a non-finite ``array`` raises
    :class:`~refdml.exceptions.NonFiniteGradient` naming ``name``, its first non-finite
    entry's index and where it was recorded. Outside a scope or on NumPy the check runs
    at once. A Python or NumPy scalar (already on the host) is checked at once and gives
    ``True``."""
    if isinstance(array, (float, int, np.generic)):
        value = float(array)
        if not np.isfinite(value):
            raise NonFiniteGradient(f"{name} == {value}, must be finite")
        return True
    xp = get_backend(array).xp
    mask = xp.isfinite(array)
    finite = mask.all()
    first = xp.argmin(mask)        # the first False in C order (0 when there is none)
    shape = tuple(array.shape)

    def on_read(values: np.ndarray, where: str) -> None:
        if bool(values[0]):
            return
        index = tuple(int(i) for i in np.unravel_index(int(values[1]), shape)) if shape else ()
        at = f" at {where}" if where else ""
        raise NonFiniteGradient(f"{name} is not finite (NaN or inf) at index {index}{at}")

    read_later((finite, first), on_read)
    return finite


# ------------------------------------------------------------------ staged uploads
class StagedUploads:
    """Fixed device buffers for what the host draws anew for each step (the batch, its
    labels, a random split's order), filled *before* the step so that the step itself
    copies nothing from the host.

    Why: a CUDA graph replays the device work of one recorded step, with the addresses it
    was recorded with, and runs no Python. A copy from host memory inside the step would be
    replayed from the same host address (or refused while capturing), so every step would
    see the recorded step's labels. Instead the loop :meth:`put` s each step's host data
    into the same device buffers (one per ``key``, shape and dtype: the same pointer every
    step) before the captured region, and the step's own uploads, made through
    :func:`staged_upload`, find their values there. Nothing is allocated per step.

    ``capturing``: while True (the captured region), an upload that finds no staged buffer
    holding its value raises :class:`CaptureUnsafe` instead of copying; while False it
    copies as before (an uncaptured step behaves as without staging).
    """

    def __init__(self, xp: Any) -> None:
        self.xp = xp
        self.capturing = False
        self._buffers: dict[tuple[str, tuple[int, ...], str], list[Any]] = {}

    def put(self, key: str, host: np.ndarray) -> Any:
        """Copy ``host`` (a NumPy array) into the device buffer kept for ``key`` and its
        shape and dtype (allocated at its first use: a warm-up step, never while
        capturing) and return that buffer."""
        host = np.ascontiguousarray(host)
        slot = (key, tuple(host.shape), host.dtype.str)
        entry = self._buffers.get(slot)
        if entry is None:
            if self.capturing:
                raise CaptureUnsafe(f"staged buffer {key!r} {host.shape} {host.dtype} is "
                                    "allocated while capturing; stage it in a warm-up step")
            entry = self._buffers[slot] = [None, self.xp.empty(host.shape, dtype=host.dtype)]
        entry[1].set(host)                       # an upload, before the captured region
        entry[0] = host.copy()
        return entry[1]

    def find(self, key: str, host: np.ndarray) -> Any:
        """The buffer staged under ``key`` holding exactly ``host`` (None if there is none):
        compared on the host, so that a step whose own upload differs from what was staged
        (another split, another dtype) never reads a stale buffer."""
        host = np.asarray(host)
        entry = self._buffers.get((key, tuple(host.shape), host.dtype.str))
        if entry is None or entry[0] is None or not np.array_equal(entry[0], host):
            return None
        return entry[1]

    def buffers(self) -> list[Any]:
        """Every device buffer (a captured graph keeps them alive: it reads their pointers)."""
        return [entry[1] for entry in self._buffers.values()]


@contextlib.contextmanager
def staging(stage: StagedUploads | None) -> Iterator[StagedUploads | None]:
    """Within the block, :func:`staged_upload` looks in ``stage`` first (None: no staging)."""
    if stage is not None and not isinstance(stage, StagedUploads):
        raise TypeError(f"stage must be a StagedUploads or None, got {type(stage).__name__}")
    token = _STAGE.set(stage)
    try:
        yield stage
    finally:
        _STAGE.reset(token)


def staged_upload(xp: Any, host: np.ndarray, key: str) -> Any:
    """``xp.asarray(host)``, unless an enclosing :func:`staging` scope staged ``host``
    under ``key`` before the step: then that fixed device buffer, with no copy. While the
    stage is capturing, an unstaged value is :class:`CaptureUnsafe` (a graph cannot replay
    a copy from the host: it would replay the recorded step's values). Callers never write
    into the returned array."""
    stage = _STAGE.get()
    if stage is not None and stage.xp is xp:
        found = stage.find(key, host)
        if found is not None:
            return found
        if stage.capturing:
            shape = tuple(np.shape(host))
            raise CaptureUnsafe(
                f"the step uploads {key!r} (shape {shape}) inside the captured region, but no "
                "staged buffer holds that value: a replay would reuse the recorded step's "
                "copy. Stage it before the step (the objective's staged_uploads)")
    return xp.asarray(host)
