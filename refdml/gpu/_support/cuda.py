"""The one import point of ``numba.cuda`` in refdml, with its compatibility step (base layer).

Every module of refdml that uses Numba's CUDA target (the ``@cuda.jit`` kernels of
refdml.gpu, the launcher in :mod:`refdml.gpu._support.modes`, the compile check) takes
``cuda`` from here: ``from refdml.gpu._support.cuda import cuda``. A change of CUDA compiler,
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
simulator (which never types a kernel) nothing is done. docs/gpu/compiler.md ("The CUDA compiler on
today's stack") records the options measured and why this one was chosen.

:data:`COMPAT_STEPS` names the steps taken in this process (empty where none was needed),
for ``refdml gpu-check`` and ``scripts/gpu_run.sh``'s ledger.

The registry. Every ``@cuda.jit`` kernel of refdml is declared with :func:`cuda_kernel`
(or, where one kernel is built per dtype, :func:`register`) where it is defined, with the
argument types of its launches; :data:`KERNELS` then lists them all once their modules
are imported (:mod:`refdml.gpu.families` imports every family). The compile
check (``refdml gpu-check --compile-only``), the simulator's launch check
(tests/conftest.py) and the profile read it; nothing else keeps a list of kernels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["COMPAT_STEPS", "CudaKernel", "DTYPE_KEYS", "KERNELS", "cuda", "cuda_kernel",
           "register"]

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


# --------------------------------------------------------------------------- the registry
#: The keys of a kernel's signatures: the input dtype a launch is made for, or ``"any"``
#: where the argument types do not depend on it.
DTYPE_KEYS = ("float32", "float64", "any")


@dataclass(frozen=True)
class CudaKernel:
    """One ``@cuda.jit`` kernel of refdml, as declared where it is defined.

    ``name``: its Python function's name (``refdml_<family>_<what>``, what a profiler
    shows); ``module``: where it is defined; ``signatures``: dtype key (:data:`DTYPE_KEYS`)
    -> the Numba signature of its launches for inputs of that dtype (arrays C-contiguous,
    Python ints int64, floats float64); ``parameters``: its parameter names, in order;
    ``build``: dtype key -> the dispatcher launched for that dtype (the same one for every
    dtype, except where a factory builds one kernel per dtype); ``family``: the kernel
    family it belongs to, by default the package of its module (``refdml.gpu.<family>``):
    the compile check compiles the kernels of the families registered in
    :data:`refdml.gpu.families.KERNEL_FAMILIES`.
    """

    name: str
    module: str
    signatures: Mapping[str, str]
    parameters: tuple[str, ...]
    build: Callable[[str], Any]
    family: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.signatures) - set(DTYPE_KEYS)
        if not self.signatures or unknown:
            raise ValueError(f"signatures of {self.name} == {dict(self.signatures)!r}: keys "
                             f"must be among {DTYPE_KEYS}")
        if not self.family:
            parts = self.module.split(".")
            if parts[:2] != ["refdml", "gpu"] or len(parts) < 4:
                raise ValueError(f"CUDA kernel {self.name} is declared in {self.module}, "
                                 "outside a family package refdml.gpu.<family>: give its "
                                 "family")
            object.__setattr__(self, "family", parts[2])


#: Every declared kernel by name (names are global: a profiler knows a kernel by name).
KERNELS: dict[str, CudaKernel] = {}


def register(kernel: CudaKernel) -> CudaKernel:
    """Add ``kernel`` to :data:`KERNELS`; a second kernel of the same name from another
    module is a ``RuntimeError`` (a module imported again replaces its own entry)."""
    known = KERNELS.get(kernel.name)
    if known is not None and known.module != kernel.module:
        raise RuntimeError(f"CUDA kernel {kernel.name!r} is declared twice: in "
                           f"{known.module} and in {kernel.module}")
    KERNELS[kernel.name] = kernel
    return kernel


def cuda_kernel(*, signatures: Mapping[str, str], family: str = "",
                **options: Any) -> Callable[[Callable], Any]:
    """``@cuda_kernel(signatures={...}, cache=True)``: ``numba.cuda.jit(**options)`` on the
    function, registered in :data:`KERNELS` with the argument types of its launches
    (``family``: see :class:`CudaKernel`)."""
    def declare(function: Callable) -> Any:
        dispatcher = cuda.jit(**options)(function)
        register(CudaKernel(
            name=function.__name__, module=function.__module__, signatures=dict(signatures),
            parameters=tuple(inspect.signature(function).parameters),
            build=lambda dtype: dispatcher, family=family))
        return dispatcher
    return declare
