"""One line on stderr while refdml's kernels compile for longer than a few seconds (base layer).

Numba compiles a kernel at its first call in a process unless its disk cache holds it, and
a cold compilation of refdml's kernels is silent and long (``refdml gpu-check`` on a cold
cache, the first epoch on a GPU). When one compilation of a refdml kernel passes
:data:`DEFAULT_THRESHOLD_S` seconds, one line says what compiles and whether it is cached
for next time, and a second line closes it when it ends::

    refdml: compiling refdml.gpu.gsp._compiled.pool_forward_cpu for the CPU (Numba, first use; cached in .../refdml/gpu/gsp/__pycache__ for next time)...
    refdml: ... done in <seconds> s (refdml.gpu.gsp._compiled.pool_forward_cpu)

A compilation that ends sooner prints nothing, and a kernel loaded from the cache is not
compiled at all. ``REFDML_QUIET=1`` silences both lines; ``REFDML_COMPILE_NOTICE_AFTER``
(seconds, >= 0) moves the threshold (``0``: every compilation, as the tests use it).

Where the notices come from:

- **CPU kernels** (``@njit``): Numba's event API. :func:`install` registers one listener
  for the ``"numba:compile"`` event, which Numba's CPU dispatcher broadcasts around each
  compilation that its cache did not answer; ``refdml.gpu._support`` calls it on import. It
  reports only dispatchers whose Python function is defined in a ``refdml.`` module, and
  only the outermost one (a kernel's callees compile inside it).
- **CUDA kernels** (``@cuda.jit``): numba-cuda 0.30 keeps its own event module
  (``numba.cuda.core.event``) and its kernel dispatcher broadcasts no ``"numba:compile"``
  event there either (only its lifted loops do), so :func:`watch_cuda_dispatcher` wraps
  the ``compile`` method of each refdml kernel once, at its first launch through
  :func:`refdml.gpu._support.launch.cuda_launch`; the dispatcher calls it only where its
  in-memory table has no entry for the argument types, so a warm launch does not pass
  through it.
- Whole compilations that refdml runs itself (``refdml gpu-check --compile-only``) use
  :func:`compile_notice` directly.

A notice is a timer thread that fires once: it prints the opening line unless the
compilation ended first, and the compiling thread cancels and joins it when the
compilation ends, so no thread outlives its compilation and no line comes after the
closing one.

>>> with compile_notice("nothing", "for the CPU", threshold=60.0):
...     pass
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["DEFAULT_THRESHOLD_S", "QUIET_ENV", "THRESHOLD_ENV", "compile_notice",
           "describe_cache", "install", "silenced", "watch_cuda_dispatcher"]

#: Seconds a compilation runs before its notice prints.
DEFAULT_THRESHOLD_S = 2.0
#: ``REFDML_QUIET=1``: no notice at all.
QUIET_ENV = "REFDML_QUIET"
#: The threshold in seconds, where set (``0``: every compilation).
THRESHOLD_ENV = "REFDML_COMPILE_NOTICE_AFTER"

# The notices open on each thread, innermost last: a compilation inside another (a
# kernel's callees, a CUDA kernel's device functions) gets none of its own.
_ACTIVE = threading.local()


def silenced() -> bool:
    """True under ``REFDML_QUIET=1`` (any value but ``0`` or empty): no notice prints."""
    return os.environ.get(QUIET_ENV, "0") not in ("", "0")


def _threshold() -> float:
    text = os.environ.get(THRESHOLD_ENV)
    if text is None:
        return DEFAULT_THRESHOLD_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"{THRESHOLD_ENV} == {text!r}, must be a number of seconds >= 0")
    return value


def _write(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Notice:
    """One compilation's notice: the opening line after ``threshold`` seconds (a timer
    thread), the closing line from :meth:`close` if the opening one was printed."""

    def __init__(self, what: str, detail: str, threshold: float) -> None:
        self.what, self.detail = what, detail
        self._lock = threading.Lock()
        self._opened = False
        self._closed = False
        self._start = time.perf_counter()
        self._timer = threading.Timer(threshold, self._open)
        self._timer.daemon = True
        self._timer.name = "refdml-compile-notice"
        self._timer.start()

    def _open(self) -> None:
        # Printed under the lock: close() waits for it, so nothing prints after close().
        with self._lock:
            if self._closed:
                return
            self._opened = True
            _write(f"refdml: compiling {self.what} {self.detail}...")

    def close(self, failed: bool = False) -> None:
        with self._lock:
            self._closed = True
            opened = self._opened
        self._timer.cancel()
        self._timer.join()
        if opened:
            outcome = "failed after" if failed else "done in"
            _write(f"refdml: ... {outcome} {time.perf_counter() - self._start:.1f} s "
                   f"({self.what})")


def _stack() -> list:
    stack = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


def _begin(what: str, detail: str, threshold: float | None) -> _Notice | None:
    """Open a notice unless one is open on this thread or notices are off; the stack gets
    an entry either way (None where no notice opened), for :func:`_end` to take."""
    stack = _stack()
    stack.append(None)
    if silenced() or any(stack[:-1]):
        return None
    notice = _Notice(what, detail, _threshold() if threshold is None else threshold)
    stack[-1] = notice
    return notice


def _end(failed: bool = False) -> None:
    stack = _stack()
    if stack:
        notice = stack.pop()
        if notice is not None:
            notice.close(failed)


@contextlib.contextmanager
def compile_notice(what: str, detail: str, *, threshold: float | None = None) -> Iterator[None]:
    """Print ``refdml: compiling <what> <detail>...`` if the block runs longer than
    ``threshold`` seconds (default: ``$REFDML_COMPILE_NOTICE_AFTER``, else
    :data:`DEFAULT_THRESHOLD_S`), and the time it took when it ends; nothing under
    ``REFDML_QUIET=1`` or inside another notice of this thread."""
    if threshold is not None and not 0.0 <= threshold < float("inf"):
        raise ValueError(f"threshold == {threshold!r}, must be a number of seconds >= 0")
    _begin(what, detail, threshold)
    failed = True
    try:
        yield
        failed = False
    finally:
        _end(failed)


# --------------------------------------------------------------------------- what to say
def describe_cache(dispatcher: Any, target: str) -> str:
    """``"for the CPU (Numba, first use; cached in DIR for next time)"`` and the like:
    ``target`` (``"CPU"`` or ``"GPU"``) and where ``dispatcher``'s disk cache keeps the
    result (numba-cuda: the linked kernel, per signature and compute capability), or that
    it has none (``cache=False``: compiled again in every process)."""
    path = getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
    if target == "CPU":
        head, what = "for the CPU (Numba, first use", ""
    else:
        # numba-cuda's cache keeps the linked kernel per signature and compute capability
        head, what = "for the GPU (numba-cuda, first launch", " the kernel for this GPU"
    if path:
        return f"{head};{what} cached in {path} for next time)"
    return f"{head}; not cached: each new process compiles it again)"


def _refdml_function(dispatcher: Any) -> str | None:
    """``module.qualname`` of the dispatcher's Python function where it is refdml's."""
    function = getattr(dispatcher, "py_func", None)
    module = getattr(function, "__module__", None) or ""
    if not module.startswith("refdml."):
        return None
    return f"{module}.{getattr(function, '__qualname__', '?')}"


# --------------------------------------------------------------------------- CPU: events
_INSTALLED: list = []
_INSTALL_LOCK = threading.Lock()


def install() -> bool:
    """Register the ``"numba:compile"`` listener with Numba, once per process; False where
    Numba is not installed (nothing compiles then)."""
    with _INSTALL_LOCK:
        if _INSTALLED:
            return True
        try:
            from numba.core import event
        except ImportError:
            return False

        class _CompileListener(event.Listener):
            """Opens a notice for the outermost compilation of a refdml dispatcher."""

            def on_start(self, ev: Any) -> None:
                dispatcher = (ev.data or {}).get("dispatcher")
                name = _refdml_function(dispatcher)
                if name is None:
                    _stack().append(None)      # not refdml's: its end pops this entry
                    return
                _begin(name, describe_cache(dispatcher, "CPU"), None)

            def on_end(self, ev: Any) -> None:
                # Event.is_failed of numba 0.68 is True exactly when no exception was
                # passed: read the exception itself.
                details = getattr(ev, "_exc_details", None)
                _end(failed=bool(details) and details[0] is not None)

        listener = _CompileListener()
        event.register("numba:compile", listener)
        _INSTALLED.append(listener)
        return True


# --------------------------------------------------------------------------- CUDA kernels
_WATCHED_ATTRIBUTE = "_refdml_compile_notice"


def watch_cuda_dispatcher(dispatcher: Any) -> None:
    """Announce the slow compilations of a ``@cuda.jit`` kernel of refdml (module
    docstring): its ``compile`` method, wrapped once, opens a notice; a kernel defined
    outside ``refdml.`` is left as it is."""
    if getattr(dispatcher, _WATCHED_ATTRIBUTE, False):
        return
    name = _refdml_function(dispatcher)
    compile_ = getattr(dispatcher, "compile", None)
    if name is not None and compile_ is not None:
        def compile_announced(sig: Any) -> Any:
            overloads = getattr(dispatcher, "overloads", None)
            if isinstance(sig, tuple) and overloads is not None and sig in overloads:
                return compile_(sig)
            with compile_notice(name, describe_cache(dispatcher, "GPU")):
                return compile_(sig)

        dispatcher.compile = compile_announced
    setattr(dispatcher, _WATCHED_ATTRIBUTE, True)
