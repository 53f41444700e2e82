"""The one import point of ``numba.cuda`` in refdml, with its compatibility step (base layer).

Every module of refdml that uses Numba's CUDA target (the ``@cuda.jit`` kernels of
refdml.gpu, the launcher in :mod:`refdml._compiled._support`, the compile check) takes
``cuda`` from here: ``from refdml._compiled._cuda import cuda``. A change of CUDA compiler,
or a workaround for one, is then a change to this module alone;
tests/test_architecture.py holds every other module to it.

The compatibility step. numba-cuda 0.30.x, in maintenance since 2026-06, registers an
overload of ``np.row_stack`` when its CUDA typing context first loads
(``numba.cuda.np.arrayobj``, at the first compilation: ``overload(np.row_stack)`` for any
NumPy >= 2.0). NumPy 2.5 removed that alias of ``np.vstack``, so on NumPy 2.5 (what pip
gives Python 3.12 and later) every ``@cuda.jit`` kernel fails to compile with
``AttributeError: module 'numpy' has no attribute 'row_stack'``, GPU or not. Its
maintainers declined NumPy 2.5 support (NVIDIA/numba-cuda#907). Where NumPy lacks the
alias and the simulator is off, :func:`_load` imports that module once, here, with a
private placeholder bound to ``numpy.row_stack`` for the duration of the import only:
numba-cuda registers its overload for the placeholder (a function no program can reach),
and the attribute is deleted again, so NumPy's namespace is as NumPy 2.5 made it and no
user code sees an alias appear. Under NumPy < 2.5 (the alias exists) and under the CUDA
simulator (which never types a kernel) nothing is done. docs/gpu.md ("The CUDA compiler on
today's stack") records the options measured and why this one was chosen.

:data:`COMPAT_STEPS` names the steps taken in this process (empty where none was needed),
for ``refdml gpu-check`` and ``scripts/gpu_run.sh``'s ledger.
"""

from __future__ import annotations

import numpy as np

__all__ = ["COMPAT_STEPS", "cuda"]

#: Names of the compatibility steps this process took at import (module docstring).
COMPAT_STEPS: tuple[str, ...] = ()


def _removed_row_stack(*args, **kwargs):
    """Stands in for ``numpy.row_stack`` (removed in NumPy 2.5) while numba-cuda registers
    its overload of it; never bound to NumPy after that, so never called."""
    raise AttributeError("numpy.row_stack was removed in NumPy 2.5: use numpy.vstack")


def _simulated() -> bool:
    """Whether numba.cuda is Numba's CUDA simulator (numba reads ``NUMBA_ENABLE_CUDASIM``
    when numba.cuda is first imported)."""
    try:
        from numba.cuda.core import config      # numba-cuda
    except ImportError:
        from numba.core import config           # the numba.cuda of numba itself
    return bool(getattr(config, "ENABLE_CUDASIM", False))


def _load():
    from numba import cuda

    steps = []
    if not _simulated() and not hasattr(np, "row_stack"):
        np.row_stack = _removed_row_stack
        try:
            import numba.cuda.np.arrayobj  # noqa: F401  (registers the CUDA overloads)
        except ModuleNotFoundError:
            # A numba-cuda without this module has no such overload to register.
            pass
        else:
            steps.append("numpy.row_stack placeholder while numba.cuda.np.arrayobj loads")
        finally:
            del np.row_stack
    return cuda, tuple(steps)


cuda, COMPAT_STEPS = _load()
