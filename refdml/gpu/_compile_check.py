r"""Every CUDA kernel of refdml.gpu compiled for real GPUs, without one.

Numba's CUDA simulator, where CI runs the ``@cuda.jit`` kernels, executes their Python
source: it never types a kernel for the CUDA target, so a kernel the simulator runs may
still fail to compile on a GPU, or spill. Here each kernel is compiled as numba-cuda
compiles it at its first launch on a GPU, once per signature it is launched with and per
architecture asked for, and the machine code's resources are read back:

1. numba-cuda types and lowers the kernel (and the device functions it calls) for the
   signature, with the kernel's own options (``fastmath``, ``opt``, ``max_registers``, ...),
   and NVVM compiles it to LTO-IR for ``sm_NN``: numba-cuda's default path where nvJitLink
   is installed (a kernel's ``lto`` option), which the ``gpu`` extra guarantees;
2. nvJitLink links it to SASS for ``sm_NN`` with ``-verbose``; the lines ptxas writes into
   its log give the registers per thread, the stack frame (local memory per thread), the
   spill stores and loads, and the static shared memory per block.

A row fails on a compile or link error (its text is kept, the other rows still run), on
any spill, and on static shared memory above :data:`STATIC_SHARED_LIMIT` (48 KiB, the most
a block may declare statically; more takes dynamic shared memory and an opt-in at launch).
ptxas refuses a larger static declaration itself, so such a kernel fails at the link too.

No GPU is needed. numba-cuda asks the current device for its compute capability when it
compiles a device function called from a kernel (``numba.cuda.dispatcher.
get_current_device``, which needs a driver); during each compilation a stand-in device of
the target's capability answers instead (:func:`_stand_in_device`), with or without a GPU.
A device function is compiled once per argument types (numba-cuda caches it by them, not
by capability) and its LLVM IR goes into each kernel; NVVM then compiles the whole kernel
for the requested architecture.

The registry of launches. Every kernel is declared where it is defined, in
``refdml/gpu/<family>/_cuda.py``, with the argument types of its launches for float32
and float64 inputs (:data:`ANY_DTYPE` where they do not depend on the input dtype):
:func:`refdml.gpu._support.cuda.cuda_kernel`. :func:`registry` reads those of the families
registered in :data:`refdml.gpu.families.KERNEL_FAMILIES`, :func:`signatures_of`
answers for one kernel, :func:`launches` pairs each signature with its ``@cuda.jit``
dispatcher (built per dtype where a family builds one kernel per dtype).
tests/gpu/test_gpu_compile.py checks that every ``@cuda.jit`` kernel is declared.

Requirements: ``NUMBA_ENABLE_CUDASIM`` unset or ``0`` when numba.cuda is first imported
(numba reads it then), and the ``gpu`` extra (numba-cuda[cu12]: NVVM and nvJitLink come as
wheels); otherwise :class:`ToolchainError` says which is missing.

>>> parse_arch("sm_90")
(9, 0)
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from refdml.gpu.families import KERNEL_FAMILIES
from refdml.gpu._support.notice import compile_notice

__all__ = [
    "ANY_DTYPE",
    "DEFAULT_ARCHS",
    "STATIC_SHARED_LIMIT",
    "SUPPORTED_ARCHS",
    "CompileRow",
    "Launch",
    "ToolchainError",
    "check_kernel",
    "compile_check",
    "launches",
    "parse_arch",
    "registry",
    "require_toolchain",
    "rows_to_json",
    "signatures_of",
]

#: Architectures compiled by default: A100 (sm_80) and H100 (sm_90).
DEFAULT_ARCHS = ("sm_80", "sm_90")
#: Architectures :func:`parse_arch` accepts: Volta to Blackwell, as CUDA 12.9's NVVM and
#: nvJitLink (the ``gpu`` extra's wheels) compile them.
SUPPORTED_ARCHS = ("sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90",
                   "sm_100", "sm_120")
#: Largest static shared memory of one block (bytes): 48 KiB on every architecture.
STATIC_SHARED_LIMIT = 48 * 1024
#: The dtype key of a launch whose types do not depend on the input dtype.
ANY_DTYPE = "any"

_INSTALL = "install refdml[gpu] (numba-cuda[cu12])"


class ToolchainError(RuntimeError):
    """The compile check cannot run here: the simulator is on, or numba-cuda, NVVM or
    nvJitLink is missing (the message says which and what to do)."""


# --------------------------------------------------------------------------- registry
def registry() -> dict[str, dict[str, str]]:
    """Every declared launch: kernel name -> {dtype: Numba signature}, family by family
    (:data:`refdml.gpu._support.cuda.KERNELS`; a name declared twice is refused there)."""
    return {name: dict(kernel.signatures)
            for name, kernel in KERNEL_FAMILIES.cuda_kernels().items()}


def signatures_of(name: str) -> list[str]:
    """The Numba signatures kernel ``name`` (its Python function's ``__name__``) is
    launched with, one per dtype; a ``KeyError`` naming the known kernels otherwise."""
    table = registry()
    if name not in table:
        raise KeyError(f"{name!r} is not a registered CUDA kernel of refdml.gpu; the "
                       f"registered ones: {', '.join(sorted(table))}")
    return list(table[name].values())


@dataclass(frozen=True)
class Launch:
    """One registered launch: ``kernel`` (name), ``signature`` (its dtype key: ``"float32"``,
    ``"float64"`` or :data:`ANY_DTYPE`), ``numba_signature`` and the ``@cuda.jit``
    ``dispatcher`` (None only where a caller builds a Launch by hand)."""

    kernel: str
    signature: str
    numba_signature: str
    dispatcher: Any


def _dispatchers(dtype: str) -> dict[str, Any]:
    """The ``@cuda.jit`` kernels by name, as built for inputs of ``dtype``."""
    return {name: kernel.build(dtype) for name, kernel in KERNEL_FAMILIES.cuda_kernels().items()}


def launches() -> list[Launch]:
    """Every registered launch with its dispatcher (needs the toolchain: a
    :class:`ToolchainError` where :func:`require_toolchain` says it is missing)."""
    require_toolchain()
    found: dict[str, dict[str, Any]] = {}
    result = []
    for name, by_dtype in registry().items():
        for dtype, numba_signature in by_dtype.items():
            if dtype not in found:
                found[dtype] = _dispatchers(dtype)
            result.append(Launch(name, dtype, numba_signature, found[dtype].get(name)))
    return result


# --------------------------------------------------------------------------- toolchain
def parse_arch(text: str) -> tuple[int, int]:
    """``"sm_90"`` -> ``(9, 0)``; a ``ValueError`` naming the value unless it is one of
    :data:`SUPPORTED_ARCHS`."""
    if text not in SUPPORTED_ARCHS:
        raise ValueError(f"arch == {text!r}, must be one of {', '.join(SUPPORTED_ARCHS)}")
    digits = text[3:]
    return int(digits[:-1]), int(digits[-1])


def require_toolchain() -> None:
    """Raise :class:`ToolchainError` unless numba-cuda (with the simulator off), NVVM and
    nvJitLink are all here."""
    if importlib.util.find_spec("numba_cuda") is None:
        raise ToolchainError(f"numba-cuda is not installed: {_INSTALL}")
    from refdml.gpu._support.cuda import cuda

    if getattr(cuda, "implementation", None) != "NVIDIA":
        raise ToolchainError(f"numba.cuda is not numba-cuda's: {_INSTALL}")
    from numba.cuda.core import config

    if config.ENABLE_CUDASIM:
        raise ToolchainError(
            "Numba's CUDA simulator is on in this process (NUMBA_ENABLE_CUDASIM=1), and "
            "numba reads the variable when numba.cuda is first imported: run the compile "
            "check with NUMBA_ENABLE_CUDASIM=0 (or unset)")
    from numba.cuda.cudadrv import nvvm

    if not nvvm.is_available():
        raise ToolchainError(f"NVVM (libnvvm) is not found: {_INSTALL}")
    try:
        from cuda.bindings import nvjitlink

        nvjitlink.version()
    except Exception as exc:                  # ImportError, or the library does not load
        raise ToolchainError(f"nvJitLink does not load ({type(exc).__name__}: {exc}): "
                             f"{_INSTALL}") from None


class _StandInDevice:
    """What numba-cuda reads of the current device while it compiles: its capability."""

    def __init__(self, cc: tuple[int, int]):
        self.compute_capability = cc


@contextlib.contextmanager
def _stand_in_device(cc: tuple[int, int]):
    """Answer numba-cuda's ``get_current_device()`` with a device of capability ``cc``
    for the duration (module docstring: device functions ask it, and there is no GPU)."""
    from numba.cuda import dispatcher

    if not callable(getattr(dispatcher, "get_current_device", None)):
        raise ToolchainError(
            "this numba-cuda has no numba.cuda.dispatcher.get_current_device, which the "
            "compile check stands in for while it compiles device functions (written "
            "against numba-cuda 0.30)")
    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _StandInDevice(cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


# --------------------------------------------------------------------------- one kernel
@dataclass(frozen=True)
class CompileRow:
    """One kernel x signature x architecture; resources per thread / per block.

    ``local_bytes``: local memory per thread (ptxas's cumulative stack size: local arrays
    and spills); ``shared_bytes``: static shared memory per block. A resource is None where
    the compilation failed. ``problems``: why the row fails, empty when it passes.

    ``occupancy``: theoretical occupancy (resident warps over the SM's most, in [0, 1]) at
    ``block_threads`` threads per block, from ``registers`` and ``shared_bytes``
    (:func:`refdml.gpu._support.occupancy.theoretical_occupancy`); ``occupancy_limit``: the
    resource that limits it (``"threads/warps"``, ``"blocks"``, ``"registers"`` or
    ``"shared memory"``). Both None where the registers are not known. ``block_threads``
    is refdml's one launch size, ``BLOCK`` (128), unless :func:`check_kernel` is told
    otherwise: every kernel launches BLOCK threads a block except the small-problem
    Sinkhorn, which launches ``threads_per_problem(n, m)`` <= BLOCK (fewer warps a block:
    its occupancy is then the figure at its own block size, not this one). No kernel
    launches with dynamic shared memory, so the static figure is the block's whole.
    """

    kernel: str
    signature: str
    numba_signature: str
    arch: str
    registers: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    local_bytes: int | None = None
    shared_bytes: int | None = None
    block_threads: int | None = None
    occupancy: float | None = None
    occupancy_limit: str | None = None
    seconds: float = 0.0
    problems: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        return "ok" if self.passed else "FAIL"


class _LogFormatError(ValueError):
    """nvJitLink's log does not read as expected (another ptxas wording?)."""


_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for '(?P<arch>[^']+)'")
_PROPERTIES = re.compile(r"Function properties for (?P<name>\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"ptxas info\s*: Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")
_STACK = re.compile(r"(\d+) bytes cumulative stack size")


def _read_log(log: str, arch: str) -> dict[str, int]:
    """Resources of the one entry function in nvJitLink's ``-verbose`` log of an LTO link
    (ptxas's ``Function properties`` and ``Used ...`` lines); spills summed over every
    function ptxas lists (a device function it did not inline spills on the kernel's
    behalf). A :class:`_LogFormatError` where the lines are not there as expected."""
    lines = [line.strip() for line in log.replace("\x00", "").splitlines()]
    entries = [m for m in map(_ENTRY.search, lines) if m]
    if len(entries) != 1:
        raise _LogFormatError(f"{len(entries)} 'Compiling entry function' lines, expected 1")
    entry = entries[0]
    if entry["arch"] != arch:
        raise _LogFormatError(f"compiled for {entry['arch']!r}, asked for {arch!r}")
    frames: dict[str, tuple[int, int, int]] = {}
    used: list[str] = []
    function = None
    for line in lines:
        if m := _PROPERTIES.search(line):
            function = m["name"]
        elif m := _FRAME.search(line):
            if function is None or function in frames:
                raise _LogFormatError(f"a stack-frame line without its function: {line!r}")
            frames[function] = tuple(int(g) for g in m.groups())
            function = None
        elif _USED.search(line):
            used.append(line)
    if entry["name"] not in frames:
        raise _LogFormatError("no stack frame / spill line for the entry function")
    if len(used) != 1:
        raise _LogFormatError(f"{len(used)} 'Used N registers' lines, expected 1")
    shared, stack = _SHARED.search(used[0]), _STACK.search(used[0])
    return {
        "registers": int(_USED.search(used[0])[1]),
        "spill_store_bytes": sum(f[1] for f in frames.values()),
        "spill_load_bytes": sum(f[2] for f in frames.values()),
        # ptxas omits the cumulative stack and the shared memory where they are 0
        "local_bytes": int(stack[1]) if stack else frames[entry["name"]][0],
        "shared_bytes": int(shared[1]) if shared else 0,
    }


def _link(ltoir: bytes, arch: str, max_registers: int | None) -> str:
    """LTO-link ``ltoir`` to SASS for ``arch`` with nvJitLink; its info log (a
    ``RuntimeError`` carrying the error log where the link fails)."""
    from cuda.bindings import nvjitlink

    options = [f"-arch={arch}", "-lto", "-verbose"]
    if max_registers:
        options.append(f"-maxrregcount={int(max_registers)}")
    handle = nvjitlink.create(len(options), options)
    try:
        try:
            nvjitlink.add_data(handle, nvjitlink.InputType.LTOIR, ltoir, len(ltoir), "kernel")
            nvjitlink.complete(handle)
        except nvjitlink.nvJitLinkError as exc:
            log = _nvjitlink_log(nvjitlink.get_error_log_size, nvjitlink.get_error_log, handle)
            raise RuntimeError(f"nvJitLink: {exc}: {log.strip()}") from None
        return _nvjitlink_log(nvjitlink.get_info_log_size, nvjitlink.get_info_log, handle)
    finally:
        nvjitlink.destroy(handle)


def _nvjitlink_log(size_of, read, handle) -> str:
    buffer = bytearray(size_of(handle))
    read(handle, buffer)
    return buffer.decode(errors="replace").replace("\x00", "")


@dataclass(frozen=True)
class _Compiled:
    """A kernel compiled to LTO-IR, waiting for its link (:func:`_link_stage`)."""

    row: dict[str, Any]
    ltoir: bytes
    max_registers: int | None
    shared_limit: int
    seconds: float


def _compile_stage(dispatcher: Any, numba_signature: str, arch: str, kernel: str | None,
                   signature: str, shared_limit: int) -> CompileRow | _Compiled:
    """Lower and NVVM-compile (holds the GIL and numba's compiler lock); a failed row where
    that fails or the kernel takes a path this check does not follow."""
    from refdml.gpu._support.cuda import cuda

    name = kernel or getattr(getattr(dispatcher, "py_func", None), "__name__", repr(dispatcher))
    row = dict(kernel=name, signature=signature, numba_signature=numba_signature, arch=arch)
    if dispatcher is None:
        return CompileRow(**row, problems=(f"gpu/ defines no @cuda.jit kernel named {name!r} "
                                           "(the registry is stale)",))
    cc = parse_arch(arch)
    options = dispatcher.targetoptions
    if options.get("link") or not options.get("lto"):
        return CompileRow(**row, problems=(
            "the check follows numba-cuda's LTO path only: this kernel has "
            f"lto={options.get('lto')!r}, link={options.get('link')!r}",))
    start = time.perf_counter()
    try:
        with _stand_in_device(cc):
            ltoir, _ = cuda.compile(
                dispatcher.py_func, numba_signature, device=False, abi="numba", cc=cc,
                output="ltoir", debug=options.get("debug"), lineinfo=options.get("lineinfo"),
                fastmath=options.get("fastmath", False), opt=options.get("opt"),
                launch_bounds=options.get("launch_bounds"))
    except ToolchainError:
        raise
    except Exception as exc:        # typing, lowering or NVVM: the row fails, the run goes on
        return CompileRow(**row, seconds=time.perf_counter() - start,
                          problems=(f"compile error: {type(exc).__name__}: {exc}",))
    return _Compiled(row, bytes(ltoir), options.get("max_registers"), shared_limit,
                     time.perf_counter() - start)


def _link_stage(compiled: _Compiled) -> CompileRow:
    """Link, read the log, judge (nvJitLink releases the GIL: this may run in a thread)."""
    row, arch = compiled.row, compiled.row["arch"]
    start = time.perf_counter()

    def failed(problem: str) -> CompileRow:
        seconds = compiled.seconds + time.perf_counter() - start
        return CompileRow(**row, seconds=seconds, problems=(problem,))

    try:
        log = _link(compiled.ltoir, arch, compiled.max_registers)
    except Exception as exc:
        return failed(f"link error: {exc}")
    try:
        resources = _read_log(log, arch)
    except _LogFormatError as exc:
        return failed(f"nvJitLink's log is not understood ({exc}); the log:\n{log}")
    problems = []
    if resources["spill_store_bytes"] or resources["spill_load_bytes"]:
        problems.append(f"spills: {resources['spill_store_bytes']} B stored, "
                        f"{resources['spill_load_bytes']} B loaded per thread")
    if resources["shared_bytes"] > compiled.shared_limit:
        problems.append(f"static shared memory {resources['shared_bytes']} B > "
                        f"{compiled.shared_limit} B")
    if not 0 < resources["registers"] <= 255:
        problems.append(f"{resources['registers']} registers per thread is not in [1, 255]: "
                        "the log was misread")
    return CompileRow(**row, **resources, seconds=compiled.seconds + time.perf_counter() - start,
                      problems=tuple(problems))


# --------------------------------------------------------------------------- occupancy
def _launch_block(block_threads: int | None) -> int:
    """Threads per block of the occupancy figure: refdml's launch size ``BLOCK`` unless
    given (a ``ValueError`` naming the value outside [1, 1024])."""
    if block_threads is None:
        from refdml.gpu._support.launch import BLOCK

        return BLOCK
    if isinstance(block_threads, bool) or not isinstance(block_threads, int):
        raise TypeError(f"block_threads must be an int, got {type(block_threads).__name__}")
    if not 1 <= block_threads <= 1024:
        raise ValueError(f"block_threads == {block_threads!r}, must be in [1, 1024]")
    return block_threads


def _with_occupancy(row: CompileRow, block_threads: int) -> CompileRow:
    """``row`` with ``block_threads`` and, where its registers are known, its theoretical
    occupancy and limiting resource (:mod:`refdml.gpu._support.occupancy`)."""
    from dataclasses import replace

    from refdml.gpu._support.occupancy import MAX_REGISTERS_PER_THREAD, theoretical_occupancy

    if row.registers is None or not 0 < row.registers <= MAX_REGISTERS_PER_THREAD:
        return replace(row, block_threads=block_threads)
    occupancy = theoretical_occupancy(row.arch, row.registers, row.shared_bytes or 0,
                                      block_threads)
    return replace(row, block_threads=block_threads, occupancy=occupancy.fraction,
                   occupancy_limit=occupancy.limited_by)


def check_kernel(dispatcher: Any, numba_signature: str, arch: str, *, kernel: str | None = None,
                 signature: str = "", shared_limit: int = STATIC_SHARED_LIMIT,
                 block_threads: int | None = None) -> CompileRow:
    """Compile ``dispatcher`` (a ``@cuda.jit`` kernel) for ``numba_signature`` and ``arch``
    as numba-cuda does on a GPU (module docstring) and read its resources, with its
    theoretical occupancy at ``block_threads`` threads per block (default ``BLOCK``).

    Returns the row: failed (``problems``) on a compile or link error, a spill, static
    shared memory above ``shared_limit`` bytes, or a kernel option this check does not
    follow (extra ``link`` files, ``lto=False``). Raises :class:`ToolchainError` only
    where the check cannot run at all.
    """
    block_threads = _launch_block(block_threads)
    require_toolchain()
    stage = _compile_stage(dispatcher, numba_signature, arch, kernel, signature, shared_limit)
    row = stage if isinstance(stage, CompileRow) else _link_stage(stage)
    return _with_occupancy(row, block_threads)


# --------------------------------------------------------------------------- all kernels
def compile_check(archs=DEFAULT_ARCHS, launch_list: list[Launch] | None = None) -> list[CompileRow]:
    """One :class:`CompileRow` per launch (default: every registered one, :func:`launches`)
    and architecture, in registry order; a failing row never stops the others. Occupancy
    at ``BLOCK`` threads per block (every kernel's launch size; :class:`CompileRow`).

    The links run in worker threads while the next kernels compile: ptxas (inside
    nvJitLink, which releases the GIL) takes about as long as numba-cuda's lowering. Past
    a few seconds a line on stderr says what compiles (:mod:`refdml.gpu._support.notice`).
    """
    for arch in archs:
        parse_arch(arch)
    require_toolchain()
    block_threads = _launch_block(None)
    if launch_list is None:
        launch_list = launches()
    workers = max(1, min(4, (os.cpu_count() or 2) - 1))
    kernels = len({launch.kernel for launch in launch_list})
    # The whole check is one long compilation, announced as one (refdml.gpu._support.notice).
    with compile_notice(
            f"{kernels} CUDA kernel(s), {len(launch_list)} launch signature(s)",
            f"for {', '.join(archs)} (the compile check: NVVM and nvJitLink, no GPU; not "
            "cached, each run compiles again)"), \
            ThreadPoolExecutor(max_workers=workers) as pool:
        pending = []
        for launch in launch_list:
            for arch in archs:
                stage = _compile_stage(launch.dispatcher, launch.numba_signature, arch,
                                       launch.kernel, launch.signature, STATIC_SHARED_LIMIT)
                pending.append(stage if isinstance(stage, CompileRow)
                               else pool.submit(_link_stage, stage))
        return [_with_occupancy(p if isinstance(p, CompileRow) else p.result(), block_threads)
                for p in pending]


def rows_to_json(rows: list[CompileRow]) -> list[dict[str, Any]]:
    """The rows as JSON-ready dicts (``refdml gpu-check --compile-only --json``).

    Keys, the same in every row: ``kernel``, ``signature`` (the dtype key), ``numba_signature``,
    ``arch`` (``"sm_90"``), ``registers`` (per thread), ``spill_store_bytes``,
    ``spill_load_bytes``, ``local_bytes`` (per thread), ``shared_bytes`` (static, per block;
    these five null where the compilation failed), ``block_threads`` (threads per block
    the occupancy is computed at: ``BLOCK``, 128), ``occupancy`` (theoretical occupancy,
    resident warps over the SM's most, in [0, 1]) and ``occupancy_limit`` (the resource
    that limits it: ``"threads/warps"``, ``"blocks"``, ``"registers"`` or
    ``"shared memory"``; these two null where the registers are not known), ``status``
    (``"ok"`` / ``"FAIL"``), ``passed`` (bool), ``problems`` (list of str, empty when
    passed; a compile or link error's full text), ``seconds`` (compile + link).
    """
    return [dict(kernel=r.kernel, signature=r.signature, numba_signature=r.numba_signature,
                 arch=r.arch, registers=r.registers, spill_store_bytes=r.spill_store_bytes,
                 spill_load_bytes=r.spill_load_bytes, local_bytes=r.local_bytes,
                 shared_bytes=r.shared_bytes, block_threads=r.block_threads,
                 occupancy=r.occupancy, occupancy_limit=r.occupancy_limit,
                 status=r.status, passed=r.passed,
                 problems=list(r.problems), seconds=round(r.seconds, 3))
            for r in rows]
