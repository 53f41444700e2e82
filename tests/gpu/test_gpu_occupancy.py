"""Theoretical occupancy (``refdml/gpu/_support/occupancy.py``) against cases worked out by hand.

Each case's comment derives it from the per-SM limits (docs: the module docstring): ``w``
warps a block, blocks allowed by threads/warps ``floor(W_sm / w)``, by the SM's block cap,
by registers ``4 * floor(16384 / R_w) / w`` with ``R_w`` the registers of a warp rounded up
to 256, by shared memory ``floor(S_sm / ceil_unit(shared + reserved))``. The occupancy is
a ratio of small integers: compared exactly.
"""

from __future__ import annotations

import pytest

from refdml.gpu._support.launch import BLOCK
from refdml.gpu import _compile_check
from refdml.gpu._compile_check import CompileRow, rows_to_json
from refdml.gpu._support.occupancy import ARCH_LIMITS, LIMITS, theoretical_occupancy

# (arch, registers, shared_bytes, block_threads) -> (active blocks, active warps, max warps,
# limited by)
CASES = [
    # sm_80, 128 threads = 4 warps, 32 registers, no shared memory. Threads: 64 / 4 = 16
    # blocks. Registers: 32 * 32 = 1024 a warp (a multiple of 256), 16384 / 1024 = 16 warps
    # per sub-partition, 64 an SM, 16 blocks. Shared: 0 + 1 KiB reserved = 1024 B a block,
    # 167936 / 1024 = 164 blocks. Cap 32. Min 16 (threads and registers tie: threads named)
    # -> 64 of 64 warps, 100%.
    (("sm_80", 32, 0, 128), (16, 64, 64, "threads/warps")),
    # 64 registers: 2048 a warp, 16384 / 2048 = 8 per sub-partition, 32 warps, 8 blocks
    # -> 8 x 4 = 32 of 64 warps, 50%, registers.
    (("sm_80", 64, 0, 128), (8, 32, 64, "registers")),
    # 40 registers: 1280 a warp (5 x 256), 16384 / 1280 = 12.8 -> 12, 48 warps, 12 blocks
    # -> 48 of 64, 75%.
    (("sm_80", 40, 0, 128), (12, 48, 64, "registers")),
    # 33 registers: 1056 rounds up to 1280, the same allocation as 40: 75%.
    (("sm_80", 33, 0, 128), (12, 48, 64, "registers")),
    # 41 registers: 1312 -> 1536, 16384 / 1536 = 10.7 -> 10, 40 warps, 10 blocks: 62.5%.
    (("sm_80", 41, 0, 128), (10, 40, 64, "registers")),
    # Shared memory: 46,092 B (the small-problem Sinkhorn's) + 1024 = 47,116 -> 369 x 128 =
    # 47,232 B; sm_80 167,936 / 47,232 = 3.6 -> 3 blocks (registers allow 16) -> 12 of 64
    # warps, 18.75%.
    (("sm_80", 32, 46092, 128), (3, 12, 64, "shared memory")),
    # The same on sm_90: 233,472 / 47,232 = 4.9 -> 4 blocks -> 16 of 64 warps, 25%.
    (("sm_90", 32, 46092, 128), (4, 16, 64, "shared memory")),
    # sm_90 with 133 registers (that kernel's count there): 4256 -> 4352 (17 x 256),
    # 16384 / 4352 = 3.8 -> 3 per sub-partition, 12 warps, 3 blocks (shared allows 4)
    # -> 12 of 64, 18.75%, registers.
    (("sm_90", 133, 46092, 128), (3, 12, 64, "registers")),
    # Blocks: 32 threads = 1 warp, 16 registers (512 a warp: 32 per sub-partition, 128
    # blocks), shared 1024 B (164 blocks), threads 64 blocks; the cap, 32 blocks, binds
    # -> 32 of 64 warps, 50%.
    (("sm_80", 16, 0, 32), (32, 32, 64, "blocks")),
    # sm_89: 48 warps, cap 24 blocks: 24 one-warp blocks -> 24 of 48, 50%.
    (("sm_89", 16, 0, 32), (24, 24, 48, "blocks")),
    # sm_86: 1536 threads = 48 warps: 48 / 4 = 12 blocks (registers allow 16, cap 16)
    # -> 48 of 48, 100%.
    (("sm_86", 32, 0, 128), (12, 48, 48, "threads/warps")),
    # sm_86, 64 registers: 8 blocks -> 32 of 48 warps.
    (("sm_86", 64, 0, 128), (8, 32, 48, "registers")),
    # sm_75: 1024 threads = 32 warps: 8 blocks of 4 warps, 100%.
    (("sm_75", 32, 0, 128), (8, 32, 32, "threads/warps")),
    # A block of 100 threads takes 4 whole warps: as 128.
    (("sm_80", 64, 0, 100), (8, 32, 64, "registers")),
    # sm_70 allocates shared memory in 256 B units and reserves none: 6,145 B -> 6,400 B,
    # 98,304 / 6,400 = 15.4 -> 15 blocks < 16 by threads -> 60 of 64 warps, 93.75%.
    (("sm_70", 32, 6145, 128), (15, 60, 64, "shared memory")),
    # 6,144 B exactly: 98,304 / 6,144 = 16, a tie with threads -> 100%, threads named.
    (("sm_70", 32, 6144, 128), (16, 64, 64, "threads/warps")),
    # Registers per block: 1024 threads = 32 warps at 64 registers, 2048 x 32 = 65,536 (the
    # most a block may hold): 4 x 8 = 32 warps fit, 1 block -> 32 of 64, 50%.
    (("sm_80", 64, 0, 1024), (1, 32, 64, "registers")),
    # 65 registers: 2080 -> 2304 a warp, x 32 warps = 73,728 > 65,536: the block does not
    # fit at all -> 0 blocks, 0%.
    (("sm_80", 65, 0, 1024), (0, 0, 64, "registers")),
]


@pytest.mark.parametrize(("args", "expected"), CASES, ids=[str(c[0]) for c in CASES])
def test_occupancy_matches_the_hand_derivation(args, expected):
    occ = theoretical_occupancy(*args)
    blocks, warps, max_warps, limit = expected
    assert (occ.active_blocks, occ.active_warps, occ.max_warps, occ.limited_by) == expected
    assert occ.fraction == warps / max_warps
    assert occ.arch == args[0] and occ.block_threads == args[3]
    counts = {"threads/warps": occ.blocks_by_warps, "blocks": occ.blocks_by_blocks,
              "registers": occ.blocks_by_registers, "shared memory": occ.blocks_by_shared}
    assert counts[limit] == blocks
    assert all(c is None or c >= blocks for c in counts.values())


def test_the_tie_and_the_per_limit_counts_are_kept():
    occ = theoretical_occupancy("sm_80", registers=32, shared_bytes=0, block_threads=128)
    # worked out in CASES[0]: threads 16, cap 32, registers 16, shared 164
    assert (occ.blocks_by_warps, occ.blocks_by_blocks, occ.blocks_by_registers,
            occ.blocks_by_shared) == (16, 32, 16, 164)


def test_no_shared_memory_and_no_reservation_is_no_shared_limit():
    # 7.x reserves nothing per block: a block without shared memory is not limited by it
    occ = theoretical_occupancy("sm_70", registers=32, shared_bytes=0, block_threads=128)
    assert occ.blocks_by_shared is None and occ.fraction == 1.0


def test_one_row_of_limits_per_supported_architecture():
    assert tuple(ARCH_LIMITS) == _compile_check.SUPPORTED_ARCHS
    # spot checks of the table against the sources in the module docstring
    facts = {"sm_75": (1024, 16, 64), "sm_80": (2048, 32, 164), "sm_86": (1536, 16, 100),
             "sm_89": (1536, 24, 100), "sm_90": (2048, 32, 228), "sm_120": (1536, 24, 100)}
    for arch, (threads, blocks, shared_kib) in facts.items():
        limits = ARCH_LIMITS[arch]
        assert (limits.max_threads, limits.max_blocks, limits.shared_bytes) == (
            threads, blocks, shared_kib * 1024), arch
    for arch, limits in ARCH_LIMITS.items():
        major = int(arch[3:-1])
        assert limits.reserved_shared_bytes == (1024 if major >= 8 else 0), arch
        assert limits.shared_unit == (128 if major >= 8 else 256), arch
        assert limits.max_warps * 32 == limits.max_threads, arch


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(arch="sm_91"), "arch == 'sm_91', must be one of sm_70"),
    (dict(arch="80"), "arch == '80'"),
    (dict(registers=0), r"registers == 0, must be in \[1, 255\]"),
    (dict(registers=256), r"registers == 256, must be in \[1, 255\]"),
    (dict(block_threads=0), r"block_threads == 0, must be in \[1, 1024\]"),
    (dict(block_threads=1025), r"block_threads == 1025, must be in \[1, 1024\]"),
    (dict(shared_bytes=-1), "shared_bytes == -1, must be >= 0"),
])
def test_bad_input_is_a_value_error_naming_it(kwargs, message):
    args = dict(arch="sm_80", registers=32, shared_bytes=0, block_threads=128) | kwargs
    with pytest.raises(ValueError, match=message):
        theoretical_occupancy(**args)


@pytest.mark.parametrize("kwargs", [dict(registers=32.0), dict(block_threads=True),
                                    dict(shared_bytes="0")])
def test_a_non_int_count_is_a_type_error(kwargs):
    args = dict(arch="sm_80", registers=32, shared_bytes=0, block_threads=128) | kwargs
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=f"{name} must be an int"):
        theoretical_occupancy(**args)


# --------------------------------------------------------------------------- compile rows
def test_compile_rows_carry_occupancy_at_block_threads():
    row = CompileRow("k", "float64", "void(float64[::1])", "sm_80", registers=64,
                     spill_store_bytes=0, spill_load_bytes=0, local_bytes=0, shared_bytes=0)
    filled = _compile_check._with_occupancy(row, _compile_check._launch_block(None))
    # 64 registers at BLOCK = 128 threads on sm_80: CASES[1], 50%, registers
    assert BLOCK == 128
    assert (filled.block_threads, filled.occupancy, filled.occupancy_limit) == (
        128, 0.5, "registers")
    failed = CompileRow("k", "float64", "void(float64[::1])", "sm_80",
                        problems=("compile error: ...",))
    failed = _compile_check._with_occupancy(failed, 128)
    assert (failed.block_threads, failed.occupancy, failed.occupancy_limit) == (128, None, None)
    rows = rows_to_json([filled, failed])
    assert list(rows[0]) == [
        "kernel", "signature", "numba_signature", "arch", "registers", "spill_store_bytes",
        "spill_load_bytes", "local_bytes", "shared_bytes", "block_threads", "occupancy",
        "occupancy_limit", "status", "passed", "problems", "seconds"]
    assert (rows[0]["occupancy"], rows[0]["occupancy_limit"]) == (0.5, "registers")
    assert (rows[1]["occupancy"], rows[1]["occupancy_limit"]) == (None, None)
    assert rows[0]["occupancy_limit"] in LIMITS


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2048, ValueError),
                                              (128.0, TypeError)])
def test_the_block_size_of_check_kernel_is_checked(value, error):
    with pytest.raises(error, match="block_threads"):
        _compile_check._launch_block(value)
