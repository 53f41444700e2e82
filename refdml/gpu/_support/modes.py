"""Which implementation a fast-path operator runs: the kernel modes and the chooser.

Every Numba kernel of the fast path sits beside its array-path twin (the code written once
against the backend, :mod:`refdml._backend`). Each family lists its implementations in one
:class:`Implementations` object (registered in :mod:`refdml.gpu.families`), which chooses
one per call; the user steers the choice with :func:`use_kernels` (public as
``refdml.gpu.use_kernels``):

``"auto"`` (default)
    The fastest correct path as measured, per family and per input module
    (:attr:`Implementations.auto_numpy`, :attr:`Implementations.auto_cupy`): on CuPy the
    ``@cuda.jit`` kernels where they measured faster than the array path, on NumPy the
    compiled CPU twin where it measured faster.
``"array"``
    The array path only (what the kernels are checked against).
``"cpu"``
    The ``@njit`` CPU twin; a CuPy input is a ``ValueError`` (it would copy to the host).
``"cuda"``
    The ``@cuda.jit`` kernel; a NumPy input is accepted only under Numba's CUDA simulator
    (``NUMBA_ENABLE_CUDASIM=1``, how CI runs the CUDA kernels), else a ``ValueError``.

The mode is a context variable (thread- and task-safe); its default is the environment
variable ``REFDML_GPU_KERNELS`` or ``"auto"``.

Numba is the ``fast`` extra (``pip install "refdml[fast]"``; ``train``, ``reproduce`` and
``gpu`` bring it too). Without it ``"auto"`` runs the array path of every family, and a
kernel asked for by name (``"cpu"``, ``"cuda"``) is a
:class:`~refdml.exceptions.MissingExtraError` naming the extra.

>>> with use_kernels("array"):
...     kernel_mode()
'array'
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from refdml._backend import get_backend
from refdml.exceptions import MissingExtraError

Impl = TypeVar("Impl")

__all__ = ["Implementations", "KERNEL_MODES", "cuda_simulator", "cuda_unavailable_reason",
           "kernel_mode", "numba_installed", "use_kernels"]

KERNEL_MODES = ("auto", "array", "cpu", "cuda")

_MODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("refdml_gpu_kernels", default=None)


def _check_mode(mode: object, name: str) -> str:
    if not isinstance(mode, str) or mode not in KERNEL_MODES:
        raise ValueError(f"{name} == {mode!r}, must be one of {KERNEL_MODES}")
    return mode


def kernel_mode() -> str:
    """The current mode: the innermost :func:`use_kernels`, else ``$REFDML_GPU_KERNELS``, else auto."""
    mode = _MODE.get()
    if mode is not None:
        return mode
    return _check_mode(os.environ.get("REFDML_GPU_KERNELS", "auto"), "REFDML_GPU_KERNELS")


@contextlib.contextmanager
def use_kernels(mode: str) -> Iterator[None]:
    """Run the enclosed fast-path calls with ``mode`` (see the module docstring)."""
    token = _MODE.set(_check_mode(mode, "mode"))
    try:
        yield
    finally:
        _MODE.reset(token)


@functools.cache
def numba_installed() -> bool:
    """Whether Numba can be imported (looked up once, not imported): the ``fast`` extra."""
    try:
        MissingExtraError.require("fast", "numba")
    except MissingExtraError:
        return False
    return True


def cuda_simulator() -> bool:
    """True when Numba's CUDA simulator is on (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def cuda_unavailable_reason() -> str | None:
    """Why CuPy arrays cannot run refdml's CUDA kernels on this machine, or None if they can:
    CuPy must import and see a device, and numba.cuda must load and find a usable GPU (the
    simulator, which runs on host arrays, is not asked about: see :func:`cuda_simulator`).
    Used by the GPU tests to skip with the reason and by ``scripts/bench_gpu.py``."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy is not installed ({exc})"
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:                        # CUDARuntimeError without a driver
        return f"CuPy sees no CUDA device ({type(exc).__name__}: {exc})"
    if devices < 1:
        return "CuPy sees no CUDA device"
    try:
        from refdml.gpu._support.cuda import cuda

        if cuda.is_available():
            return None
    except Exception as exc:
        return f"numba.cuda does not load ({type(exc).__name__}: {exc})"
    return "numba.cuda finds no usable CUDA GPU (numba.cuda.is_available() is False)"


# ------------------------------------------------------------------------ the seam
@dataclass(frozen=True)
class Implementations(Generic[Impl]):
    """The implementations of one family of fast-path operators, and the one object that
    chooses among them: ``impl = IMPLEMENTATIONS.choose(x)`` once per call, then
    ``impl.transport(...)`` with no branch on the kind in the maths (as POT's backend ``nx``).
    Registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`, it is also the family's record: the
    catalogue derives its kernel variants from it (:attr:`kernel_modes`) and the compile
    check finds its CUDA kernels through it.

    ``family``: the family's name, as the reference names it (``"gsp"``, ``"ot"``);
    ``array``: the code written once against the backend (always there, and what the
    kernels are checked against); ``load_cpu`` / ``load_cuda``: build the ``@njit`` CPU twin
    and the ``@cuda.jit`` member (or None where the family has none) on first use of
    :attr:`cpu` / :attr:`cuda`: their modules import Numba and ``numba.cuda``, so nothing
    loads them until a compiled kernel runs (the reference, the catalogue and the array paths
    never do). The members are objects of one interface that the family defines. ``auto_numpy`` /
    ``auto_cupy``: what ``use_kernels("auto")`` runs on NumPy ("array" or "cpu") and on CuPy
    input ("array" or "cuda"): the fastest correct path as measured, ``measured`` naming
    where the measurement is recorded (the page of the docs and the benchmark's command).

    The modes (module docstring): ``"array"`` runs ``array``; ``"cpu"`` / ``"cuda"`` run
    that kernel where the family has one, else ``array``; a host kernel asked for on a CuPy
    array, or a CUDA kernel that the family has on a NumPy array outside the simulator, is
    a ``ValueError`` (a family without CUDA kernels runs its array path under ``"cuda"``
    whatever the input).
    """

    family: str
    array: Impl
    load_cpu: Callable[[], Impl] | None = field(default=None, repr=False)
    load_cuda: Callable[[], Impl] | None = field(default=None, repr=False)
    auto_numpy: str = "cpu"
    auto_cupy: str = "cuda"
    measured: str = ""

    def __post_init__(self) -> None:
        for name, value, allowed in (("auto_numpy", self.auto_numpy, ("array", "cpu")),
                                     ("auto_cupy", self.auto_cupy, ("array", "cuda"))):
            if value not in allowed:
                raise ValueError(f"{self.family}: {name} == {value!r}, must be one of {allowed}")
        if (self.auto_numpy == "cpu" and self.load_cpu is None) or (
                self.auto_cupy == "cuda" and self.load_cuda is None):
            raise ValueError(f"{self.family}: 'auto' names a kernel the family does not have")

    @functools.cached_property
    def cpu(self) -> Impl | None:
        """The CPU twin, built by ``load_cpu`` on first use (None without one)."""
        return _loaded(self.load_cpu)

    @functools.cached_property
    def cuda(self) -> Impl | None:
        """The CUDA member, built by ``load_cuda`` on first use (None without one)."""
        return _loaded(self.load_cuda)

    @property
    def kernel_modes(self) -> tuple[str, ...]:
        """The compiled kernels the family has beside its array path (``"cpu"``,
        ``"cuda"``): the kernel variants the catalogue and the parity suite run. Known
        without loading the CUDA member."""
        return tuple(kind for kind, present in (("cpu", self.load_cpu is not None),
                                                ("cuda", self.load_cuda is not None))
                     if present)

    def kind(self, x: Any) -> str:
        """``"array"``, ``"cpu"`` or ``"cuda"``: what runs now for input array ``x``."""
        mode = kernel_mode()
        on_device = get_backend(x).kernel_target == "cuda"
        if mode == "auto":
            kind = self.auto_cupy if on_device else self.auto_numpy
            return kind if kind == "array" or numba_installed() else "array"
        if mode == "array":
            return "array"
        if mode == "cpu":
            if on_device:
                raise ValueError("kernel mode 'cpu' cannot take a CuPy array (it would copy "
                                 "to the host)")
            if self.load_cpu is None:
                return "array"
            if not numba_installed():
                raise MissingExtraError("fast", "numba")
            return "cpu"
        if self.load_cuda is None:      # nothing to run on the device: the array path
            return "array"
        if not on_device and not cuda_simulator():
            raise ValueError(
                "kernel mode 'cuda' needs CuPy arrays, or NumPy arrays under Numba's CUDA "
                "simulator (NUMBA_ENABLE_CUDASIM=1)")
        if not numba_installed():
            raise MissingExtraError("gpu", "numba")
        return "cuda"

    def choose(self, x: Any) -> Impl:
        """The implementation that runs now for input array ``x`` (:meth:`kind`'s); a
        compiled member is built only where it is the one chosen."""
        return getattr(self, self.kind(x))


def _loaded(load: Callable[[], Any] | None) -> Any:
    """``load()`` (None for no loader), with the compile notice listening first: the member's
    modules compile their kernels (:mod:`refdml.gpu._support.notice`)."""
    if load is None:
        return None
    from refdml.gpu._support import notice

    notice.install()
    return load()
