r"""Theoretical occupancy of a CUDA kernel from its compile-time resources, no GPU needed.

Occupancy is the share of an SM's warp slots that resident warps fill: the blocks of one
kernel that fit on an SM at once, times the warps of a block, over the SM's most resident
warps. Four limits each allow a number of blocks per SM; the smallest wins:

- **threads/warps**: ``floor(W_sm / w)`` with ``w = ceil(T / 32)`` the warps of a block of
  ``T`` threads and ``W_sm`` the SM's most resident warps;
- **blocks**: the SM's most resident blocks;
- **registers**: registers are allocated per warp, ``r`` per thread rounded up to a unit of
  256 per warp, ``R_w = ceil(32 r / 256) * 256``. The register file (65,536) is split over
  the SM's four sub-partitions (16,384 each) and a warp lives in one of them, so
  ``4 * floor(16384 / R_w)`` warps fit: the warp count rounded down to the warp allocation
  granularity of 4. Blocks: that over ``w``; none where a block would need more than the
  65,536 registers a block may hold (``R_w`` times ``w`` rounded up to 4 warps);
- **shared memory**: per block the kernel's shared memory plus the driver's reservation
  (1 KiB from compute capability 8.0 on, none on 7.x), rounded up to the allocation unit
  (256 B on 7.x, 128 B from 8.0 on); blocks: the SM's shared memory over that. The SM's
  shared memory is its largest carveout (what the calculator assumes by default): a kernel
  run with a smaller preferred carveout may fit fewer blocks. The most shared memory one
  block may opt in to is the SM's less the reservation, so a block over it gets 0 blocks
  here too.

The fraction is ``active_blocks * w / W_sm``. Where limits tie, :attr:`Occupancy.limited_by`
names the first of threads/warps, blocks, registers, shared memory (the architecture's caps
before the kernel's resources): at 100% the warp slots are what bind, whatever else is also
exactly full. The per-limit block counts are kept, so a tie is visible.

Sources (facts, per architecture, in :data:`ARCH_LIMITS`):

- NVIDIA, *CUDA C++ Programming Guide*, appendix "Compute Capabilities", tables of technical
  specifications per compute capability
  (https://docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/compute-capabilities.html):
  resident threads, warps and blocks per SM, shared memory per SM and per block, 64 K
  registers per SM and per block, 255 registers per thread.
- NVIDIA's occupancy calculator as the CUDA 12.9 runtime ships it (``cuda_occupancy.h``, in
  the ``nvidia-cuda-runtime-cu12`` wheel; the same in CUDA 13.0): register allocation unit
  256 and per-warp granularity, 4 sub-partitions, shared allocation unit 256 B (7.x) / 128 B
  (8.0+), the shared carveouts (largest: 96 KiB on 7.0/7.2, 64 KiB on 7.5, 164 KiB on
  8.0/8.7, 100 KiB on 8.6/8.9/12.0, 228 KiB on 9.0/10.0), resident blocks per SM (32 on
  7.0/7.2/8.0/9.0/10.0, 16 on 7.5/8.6/8.7, 24 on 8.9 and 12.x), the reservation counted
  from 8.0 on.
- NVIDIA CCCL, ``cuda::arch::traits`` (libcudacxx ``cuda/__device/arch_traits.h``): agrees
  for sm_70, 75, 80, 86, 89, 90, 100 (threads, blocks, shared memory per SM, 1 KiB reserved
  from 8.0). It gives sm_120 32 resident blocks where the occupancy calculator gives 24; 24
  is used here (the calculator is what this module reproduces; at 128 threads a block the
  warp limit, 12 blocks on 12.0, binds first either way). sm_72 and sm_87 are not in it:
  their threads per SM (2048 and 1536) are the programming guide's.

>>> occ = theoretical_occupancy("sm_80", registers=64, shared_bytes=0, block_threads=128)
>>> occ.active_blocks, occ.active_warps, occ.max_warps, occ.fraction, occ.limited_by
(8, 32, 64, 0.5, 'registers')
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCH_LIMITS", "LIMITS", "ArchLimits", "Occupancy", "theoretical_occupancy"]

WARP_SIZE = 32
#: Registers are allocated to a warp in units of this many (every architecture here).
REGISTER_ALLOCATION_UNIT = 256
#: A warp's registers come from one of this many sub-partitions of the register file.
SUB_PARTITIONS = 4
REGISTERS_PER_SM = 64 * 1024
REGISTERS_PER_BLOCK = 64 * 1024
MAX_REGISTERS_PER_THREAD = 255
MAX_THREADS_PER_BLOCK = 1024
#: The resources that can limit occupancy, in the order a tie is named.
LIMITS = ("threads/warps", "blocks", "registers", "shared memory")

_KIB = 1024


@dataclass(frozen=True)
class ArchLimits:
    """Per-SM limits of one architecture: ``max_threads`` resident threads, ``max_blocks``
    resident blocks, ``shared_bytes`` shared memory (largest carveout),
    ``reserved_shared_bytes`` reserved by the driver per block, ``shared_unit`` the
    allocation unit of shared memory (bytes)."""

    max_threads: int
    max_blocks: int
    shared_bytes: int
    reserved_shared_bytes: int
    shared_unit: int

    @property
    def max_warps(self) -> int:
        return self.max_threads // WARP_SIZE


#: One row per architecture of :data:`refdml.gpu._compile_check.SUPPORTED_ARCHS` (sources:
#: the module docstring).
ARCH_LIMITS: dict[str, ArchLimits] = {
    "sm_70": ArchLimits(2048, 32, 96 * _KIB, 0, 256),
    "sm_72": ArchLimits(2048, 32, 96 * _KIB, 0, 256),
    "sm_75": ArchLimits(1024, 16, 64 * _KIB, 0, 256),
    "sm_80": ArchLimits(2048, 32, 164 * _KIB, _KIB, 128),
    "sm_86": ArchLimits(1536, 16, 100 * _KIB, _KIB, 128),
    "sm_87": ArchLimits(1536, 16, 164 * _KIB, _KIB, 128),
    "sm_89": ArchLimits(1536, 24, 100 * _KIB, _KIB, 128),
    "sm_90": ArchLimits(2048, 32, 228 * _KIB, _KIB, 128),
    "sm_100": ArchLimits(2048, 32, 228 * _KIB, _KIB, 128),
    "sm_120": ArchLimits(1536, 24, 100 * _KIB, _KIB, 128),
}


@dataclass(frozen=True)
class Occupancy:
    """Theoretical occupancy of one kernel on one architecture at ``block_threads``.

    Per SM: ``active_blocks`` and ``active_warps`` resident, ``max_warps`` the
    architecture's most; ``blocks_by_warps``, ``blocks_by_blocks``, ``blocks_by_registers``
    and ``blocks_by_shared`` the blocks each limit allows (``blocks_by_shared`` None where a
    block takes no shared memory at all: no limit); ``limited_by`` one of :data:`LIMITS`.
    """

    arch: str
    block_threads: int
    active_blocks: int
    active_warps: int
    max_warps: int
    blocks_by_warps: int
    blocks_by_blocks: int
    blocks_by_registers: int
    blocks_by_shared: int | None
    limited_by: str

    @property
    def fraction(self) -> float:
        """``active_warps / max_warps``, in [0, 1]."""
        return self.active_warps / self.max_warps


def _ceil_to(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} == {value!r}, must be {'in ' if high is not None else ''}"
                         f"{bounds}")


def theoretical_occupancy(arch: str, registers: int, shared_bytes: int,
                          block_threads: int) -> Occupancy:
    """Theoretical occupancy of a kernel using ``registers`` per thread and
    ``shared_bytes`` of shared memory per block (static plus dynamic), launched with
    ``block_threads`` threads per block, on ``arch`` (a key of :data:`ARCH_LIMITS`), by the
    CUDA occupancy calculator's rules (module docstring).

    ``ValueError`` naming the parameter and its value: ``arch`` unknown, ``registers`` not
    in [1, 255], ``shared_bytes`` negative, ``block_threads`` not in [1, 1024];
    ``TypeError`` for a non-int count.
    """
    if not isinstance(arch, str) or arch not in ARCH_LIMITS:
        raise ValueError(f"arch == {arch!r}, must be one of {', '.join(ARCH_LIMITS)}")
    _check_int("registers", registers, 1, MAX_REGISTERS_PER_THREAD)
    _check_int("shared_bytes", shared_bytes, 0, None)
    _check_int("block_threads", block_threads, 1, MAX_THREADS_PER_BLOCK)
    limits = ARCH_LIMITS[arch]
    warps = -(-block_threads // WARP_SIZE)

    by_warps = limits.max_warps // warps
    by_blocks = limits.max_blocks

    per_warp = _ceil_to(registers * WARP_SIZE, REGISTER_ALLOCATION_UNIT)
    if per_warp * _ceil_to(warps, SUB_PARTITIONS) > REGISTERS_PER_BLOCK:
        by_registers = 0
    else:
        warps_by_registers = SUB_PARTITIONS * (REGISTERS_PER_SM // SUB_PARTITIONS // per_warp)
        by_registers = warps_by_registers // warps

    per_block = shared_bytes + limits.reserved_shared_bytes
    by_shared = (limits.shared_bytes // _ceil_to(per_block, limits.shared_unit)
                 if per_block else None)

    counts = (by_warps, by_blocks, by_registers, by_shared)
    active = min(c for c in counts if c is not None)
    limited_by = LIMITS[counts.index(active)]
    return Occupancy(arch=arch, block_threads=block_threads, active_blocks=active,
                     active_warps=active * warps, max_warps=limits.max_warps,
                     blocks_by_warps=by_warps, blocks_by_blocks=by_blocks,
                     blocks_by_registers=by_registers, blocks_by_shared=by_shared,
                     limited_by=limited_by)
