"""Threading layer (docs/gpu/threading.md, "Threading layer: fork safety"). Every call of an
``@njit(parallel=True)`` kernel runs inside :func:`parallel_launch`. Before the first
parallel region of the process it asks Numba for its ``"forksafe"`` layer
(:data:`THREADING_LAYER`: TBB where a compatible libtbb loads, else OpenMP off Linux, else
``workqueue``; on Linux without TBB, ``workqueue``) unless the user chose one
(``NUMBA_THREADING_LAYER`` or ``NUMBA_THREADING_LAYER_PRIORITY`` in the environment, a
``.numba_config.yaml``, ``numba.config.THREADING_LAYER`` set in code). Numba's default on
Linux, GNU OpenMP, kills a child forked after a parallel region at the child's first one
(``multiprocessing``'s fork start method, PyTorch DataLoader workers). ``workqueue`` aborts
the process when two threads launch parallel regions at once, so while it runs (or before
any layer runs) :func:`parallel_launch` also holds one process-wide lock: refdml's kernels
launched from several threads take turns. A process that ran a parallel region before its
first refdml launch keeps the layer it has (a running layer cannot change).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["THREADING_LAYER", "parallel_launch", "running_threading_layer",
           "select_threading_layer"]

# ------------------------------------------------------------------------ threading layer

#: The Numba threading layer refdml asks for when the user chose none (module docstring).
THREADING_LAYER = "forksafe"

# Numba's own defaults: a config equal to them (and no variable in the environment) means
# that nobody chose, so refdml may.
_NUMBA_DEFAULT_LAYER = "default"
_NUMBA_DEFAULT_PRIORITY = ("tbb", "omp", "workqueue")

# Serialises refdml's parallel launches while the layer is (or may become) workqueue. An
# RLock so that a wrapper may hold it around several launches.
_LAUNCH_LOCK = threading.RLock()


def _new_lock_in_child() -> None:
    # A fork from another thread while one thread holds the lock would leave the child's
    # copy held by a thread that does not exist there: its first launch would wait forever.
    global _LAUNCH_LOCK
    _LAUNCH_LOCK = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def running_threading_layer() -> str | None:
    """The threading layer Numba's parallel regions run on in this process (``"tbb"``,
    ``"omp"`` or ``"workqueue"``), or ``None`` before the first one."""
    import numba

    try:
        return numba.threading_layer()
    except ValueError:                      # Numba's answer before its threads start
        return None


def _layer_chosen(config) -> bool:
    return ("NUMBA_THREADING_LAYER" in os.environ
            or "NUMBA_THREADING_LAYER_PRIORITY" in os.environ
            or str(config.THREADING_LAYER).lower() != _NUMBA_DEFAULT_LAYER
            or tuple(config.THREADING_LAYER_PRIORITY) != _NUMBA_DEFAULT_PRIORITY)


def select_threading_layer() -> None:
    """Ask Numba for :data:`THREADING_LAYER` unless the user chose a layer (module docstring).

    No effect once a layer runs. :func:`parallel_launch` calls it; call it yourself only
    to launch your own ``parallel=True`` code on the same layer before refdml's first.
    """
    if running_threading_layer() is not None:
        return
    from numba.core import config

    # Numba re-reads NUMBA_* variables when they change (at every compilation) and would
    # put back "default": read them now, so the compiler's re-read finds nothing new.
    config.reload_config()
    if not _layer_chosen(config):
        config.THREADING_LAYER = THREADING_LAYER


@contextlib.contextmanager
def parallel_launch() -> Iterator[None]:
    """Hold around every call of an ``@njit(parallel=True)`` kernel (module docstring):
    picks the threading layer before the first one and takes turns under ``workqueue``."""
    layer = running_threading_layer()
    if layer in (None, "workqueue"):
        with _LAUNCH_LOCK:
            if layer is None:
                select_threading_layer()
            yield
    else:
        yield
