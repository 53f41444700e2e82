"""``refdml gpu-check``: the parity of every mirrored catalogue entry, or every CUDA kernel
compiled for real GPUs (``--compile-only``)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import version

from refdml._cli_support import check_output_paths, seed, text_table, write_outputs
from refdml._io import write_json_atomic
from refdml.checks._gradcheck_cli import select_operators
from refdml.gpu import _compile_check
from refdml.gpu._support.modes import numba_installed
from refdml.gradcheck import parity

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run"]

HELP = "check the fast path (refdml.gpu) against the reference on this machine"
DESCRIPTION = ("Run the parity of every mirrored catalogue entry (refdml.gradcheck.parity) on "
               "NumPy, and on CuPy where it sees a CUDA device: outputs and gradients "
               "against the float64 reference, max relative error, tolerance and time of "
               "the mirror's forward + backward (catalogue-sized inputs). With "
               "--compile-only: compile every CUDA kernel for real GPUs instead, no GPU "
               "needed (registers, spills, local and shared memory and theoretical "
               "occupancy per kernel, signature and architecture). Exit status 0 all "
               "pass, 1 a failure or a crash, 2 bad arguments (or, --compile-only, no CUDA "
               "toolchain).")
EPILOG = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``refdml gpu-check``."""
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="check only these operators (full names or prefixes, e.g. 'losses' 'gsp.pool')")
    parser.add_argument("--dtype", nargs="+", choices=("float32", "float64"),
                        help="dtypes of the fast path (default both)")
    parser.add_argument("--backend", nargs="+", choices=("numpy", "cupy"),
                        help="array modules to check on (default every one here): 'cupy' alone "
                             "is the GPU's rows (CuPy array path, CUDA kernels), without the "
                             "NumPy paths and CPU twins that CI checks")
    parser.add_argument("--seed", type=seed,
                        help="seed of the inputs and upstream gradients (>= 0; default 0)")
    parser.add_argument("--compile-only", action="store_true",
                        help="instead of the parity: compile every CUDA kernel, for every dtype "
                             "signature it is launched with, for real GPUs (NVVM + nvJitLink, no "
                             "GPU needed; needs refdml[gpu] and NUMBA_ENABLE_CUDASIM unset or 0); "
                             "fails on a compile error, a spill or static shared memory > 48 KiB")
    parser.add_argument("--arch", nargs="+", type=_arch, metavar="sm_NN",
                        help="with --compile-only: the architectures (default sm_80 sm_90)")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the rows as JSON (a list of dicts; docs/gpu.md, 'Reading "
                             "refdml gpu-check', lists the keys); "
                             "checked before the run (exit 2), a failed write exits 1")
    parser.add_argument("--no-progress", action="store_true",
                        help="no line on stderr as each check ends (the table comes at the end; "
                             "a first CUDA call compiles its kernels, seconds each)")


def run(args: argparse.Namespace) -> int:
    """``refdml gpu-check``: the parity of every mirrored catalogue entry, or with
    ``--compile-only`` every CUDA kernel compiled for real GPUs (:func:`_compile_only`).

    ``--json PATH`` also writes the parity rows, atomically, as a JSON list of dicts with
    these keys (the same in every row; read by the GPU run's ledger):

    ``operator``  catalogue entry (``"gsp.pool"``)
    ``backend``   ``"numpy"`` or ``"cupy"``: the arrays' module
    ``path``      ``"array"`` (the array code), ``"cpu"`` (the compiled CPU twin) or
                  ``"cuda"`` (the ``@cuda.jit`` kernel; on NumPy arrays: under the simulator)
    ``device``    the table's device column (``"cupy/cuda"``, ``"cuda-simulator"``, ...)
    ``dtype``     ``"float32"`` or ``"float64"``
    ``output_error``, ``gradient_error``, ``max_error``  largest relative error against the
                  float64 reference over the outputs, the gradients, both; null where
                  not finite (a shape mismatch) or not measured (a crash)
    ``tolerance`` the entry's tolerance for the dtype
    ``passed``    bool
    ``seconds``   the mirror's forward + backward (null after a crash)
    ``problems``  list of str: why it failed (``"CRASH ..."`` for an exception); empty if passed
    """
    if args.compile_only:
        return _compile_only(args)
    if args.arch is not None:
        print("refdml gpu-check: error: --arch needs --compile-only", file=sys.stderr)
        return 2
    specs = select_operators("gpu-check", args.only)
    if specs is None:
        return 2
    if not _json_path_ok(args.json):
        return 2
    backends = parity.available_backends()
    if args.backend is not None:
        missing = [b for b in args.backend if b not in backends]
        if missing:
            print(f"refdml gpu-check: error: --backend {missing[0]}: CuPy is not installed or "
                  "sees no CUDA device here", file=sys.stderr)
            return 2
        backends = tuple(dict.fromkeys(args.backend))
    dtypes = list(dict.fromkeys(args.dtype or ("float32", "float64")))
    seed = 0 if args.seed is None else args.seed
    mirrored = [s for s in specs if s.mirror is not None]
    if "cupy" in parity.available_backends():
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"devices: NumPy (CPU) and CuPy {cupy.__version__} on {name}")
    else:
        print("devices: NumPy (CPU) only -- CuPy is not installed or sees no CUDA device, "
              "so no CuPy rows ran")
    rows, records, failures = [], [], 0
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    compiled = numba_installed()
    if not compiled:
        print('compiled kernels: not checked -- Numba is not installed (the "fast" extra: '
              'pip install "refdml[fast]"), so only the array paths ran')
    plan = [(spec, _runs(spec, backends, simulated, compiled)) for spec in mirrored]
    total, done = sum(len(runs) for _, runs in plan) * len(dtypes), 0

    def progress(spec_name: str, device: str, dtype: str, verdict: str, seconds: float) -> None:
        # One line per check as it ends, on stderr (the table is stdout's): a GPU's first
        # call of a kernel compiles it, and the whole run printed nothing for minutes.
        nonlocal done
        done += 1
        if not args.no_progress:
            print(f"gpu-check [{done}/{total}] {spec_name} {device} {dtype}: {verdict} "
                  f"({seconds:.1f} s)", file=sys.stderr, flush=True)

    for spec, runs in plan:
        for backend, kernels in runs:
            device = backend if kernels == "array" else f"{backend}/{kernels}"
            if kernels == "cuda" and backend == "numpy":
                device = "cuda-simulator"
            record = dict(operator=spec.name, backend=backend, path=kernels, device=device)
            for dtype in dtypes:
                start = time.perf_counter()
                try:
                    r = parity.check_parity(spec, backend=backend, dtype=dtype, seed=seed,
                                            kernels=kernels)
                except Exception as exc:  # a crash is a failure of our own code; report it
                    progress(spec.name, device, dtype, f"CRASH {type(exc).__name__}",
                             time.perf_counter() - start)
                    failures += 1
                    rows.append((spec.name, device, dtype, "-", "-",
                                 f"{spec.mirror_tolerance(dtype):.0e}", "-", f"CRASH {exc!r}"))
                    records.append(dict(record, dtype=dtype, output_error=None,
                                        gradient_error=None, max_error=None,
                                        tolerance=spec.mirror_tolerance(dtype), passed=False,
                                        seconds=None, problems=[f"CRASH {exc!r}"]))
                    continue
                failures += not r.passed
                verdict = "pass" if r.passed else "FAIL " + "; ".join(r.problems)
                progress(spec.name, device, dtype, "pass" if r.passed else "FAIL",
                         time.perf_counter() - start)
                rows.append((spec.name, device, dtype, f"{r.output_error:.2e}",
                             f"{r.gradient_error:.2e}", f"{r.tolerance:.0e}",
                             f"{1e3 * r.seconds:.2f}", verdict))
                errors = (_finite(r.output_error), _finite(r.gradient_error))
                records.append(dict(
                    record, dtype=dtype, output_error=errors[0], gradient_error=errors[1],
                    max_error=None if None in errors else max(errors),
                    tolerance=r.tolerance, passed=bool(r.passed), seconds=r.seconds,
                    problems=list(r.problems)))
    header = ("operator", "device", "dtype", "max rel err outputs", "max rel err gradients",
              "tolerance", "time ms", "result")
    if rows:
        print("\n".join(text_table(rows, header, right={3, 4, 5, 6})))
    print(f"\n{len(mirrored)} mirrored operators (array path on {len(backends)} device(s), plus "
          f"their compiled kernels) x {len(dtypes)} dtype(s): {len(rows)} checks, "
          f"{failures} failure(s)")
    unmirrored = [s for s in specs if s.mirror is None]
    if unmirrored:
        print(f"\n{len(unmirrored)} operators without a mirror (not checked):")
        width = max(len(s.name) for s in unmirrored)
        for s in unmirrored:
            print(f"  {s.name:<{width}}  {s.no_mirror or '(no reason recorded)'}")
    written = _write_json(args.json, records)
    return 1 if failures or not written else 0


def _runs(spec, backends: list[str], simulated: bool,
          compiled: bool = True) -> list[tuple[str, str]]:
    """``(backend, kernels)`` pairs a mirrored entry is checked on: the array path on each
    backend, then each of its compiled kernels where it can run here (``compiled``: Numba
    is installed)."""
    runs = [(backend, "array") for backend in backends]
    for kernels in spec.mirror_kernels if compiled else ():
        # The CPU twin takes NumPy arrays; the CUDA kernel CuPy ones (NumPy ones under
        # Numba's simulator). A CUDA kernel with neither a GPU nor the simulator is skipped.
        if kernels == "cpu":
            if "numpy" in backends:
                runs.append(("numpy", "cpu"))
        elif "cupy" in backends:
            runs.append(("cupy", "cuda"))
        elif simulated and "numpy" in backends:
            runs.append(("numpy", "cuda"))
    return runs


def _finite(value: float) -> float | None:
    """A float for JSON: None where it is not finite (JSON has no inf or NaN)."""
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def _json_path_ok(path: str | None) -> bool:
    """``--json``: can the file be written? (checked before the run; a message if not)."""
    problem = check_output_paths(None, path)
    if problem is not None:
        print(f"refdml gpu-check: error: {problem}", file=sys.stderr)
    return problem is None


def _write_json(path: str | None, records: list) -> bool:
    """``--json``: the records, or one line and False when the write fails (exit status 1)."""
    return write_outputs("gpu-check", json_path=path,
                         write_json=lambda target: write_json_atomic(target, records, indent=1))


def _compile_only(args: argparse.Namespace) -> int:
    """``refdml gpu-check --compile-only``: every CUDA kernel x launch signature x ``--arch``
    compiled for real GPUs, no GPU needed (:mod:`refdml.gpu._compile_check`).

    Exit status 0 every row passes, 1 a compile or link error, a spill or static shared
    memory over 48 KiB, 2 bad arguments or no toolchain (the simulator on, numba-cuda,
    NVVM or nvJitLink missing). ``--json PATH``: the rows as
    :func:`refdml.gpu._compile_check.rows_to_json` documents them. The occupancy column is
    the theoretical occupancy at the block size in its header (``BLOCK``, 128: every
    kernel's launch size; the small-problem Sinkhorn launches at most that many) and the
    resource that limits it (:mod:`refdml.gpu._support.occupancy`).
    """
    for flag, value in (("--only", args.only), ("--dtype", args.dtype), ("--seed", args.seed),
                        ("--backend", args.backend)):
        if value is not None:
            print(f"refdml gpu-check: error: {flag} belongs to the parity check, not to "
                  "--compile-only (which compiles every kernel for both dtypes)", file=sys.stderr)
            return 2
    if not _json_path_ok(args.json):
        return 2
    archs = list(dict.fromkeys(args.arch or _compile_check.DEFAULT_ARCHS))
    start = time.perf_counter()
    try:
        rows = _compile_check.compile_check(archs)
    except _compile_check.ToolchainError as exc:
        print(f"refdml gpu-check --compile-only: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    from refdml.gpu._support import cuda as _cuda     # loaded by the compile check already

    print(f"CUDA kernels compiled for {', '.join(archs)} with numba-cuda "
          f"{version('numba-cuda')} (NVVM to LTO-IR, nvJitLink to SASS; no GPU used)")
    print(f"NumPy {version('numpy')}, numba {version('numba')}; compatibility steps taken at "
          f"refdml's import of numba.cuda: {'; '.join(_cuda.COMPAT_STEPS) or 'none needed'}")
    table = [(r.kernel, r.signature, r.arch, _cell(r.registers),
              "-" if r.spill_store_bytes is None else f"{r.spill_store_bytes}/{r.spill_load_bytes}",
              _cell(r.local_bytes), _cell(r.shared_bytes),
              "-" if r.occupancy is None else f"{100 * r.occupancy:.2f}%",
              r.occupancy_limit or "-",
              r.status if r.passed else f"FAIL {r.problems[0].splitlines()[0][:100]}")
             for r in rows]
    blocks = sorted({r.block_threads for r in rows if r.block_threads is not None})
    at = f" at {blocks[0]} thr/block" if len(blocks) == 1 else ""
    header = ("kernel", "signature", "arch", "registers", "spills st/ld B", "local B",
              "shared B", f"occupancy{at}", "limited by", "status")
    print("\n".join(text_table(table, header, right={3, 4, 5, 6, 7})))
    failed = [r for r in rows if not r.passed]
    for r in failed:
        print(f"\n{r.kernel} [{r.signature}] {r.arch}:\n  " + "\n  ".join(
            line for problem in r.problems for line in problem.splitlines()))
    kernels = len({r.kernel for r in rows})
    print(f"\n{len(rows)} rows ({kernels} kernels, {len(rows) // max(len(archs), 1)} launch "
          f"signatures x {len(archs)} architecture(s)): {len(failed)} failure(s); "
          f"{elapsed:.1f} s")
    written = _write_json(args.json, _compile_check.rows_to_json(rows))
    return 1 if failed or not written else 0


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _arch(text: str) -> str:
    """``--arch``: ``sm_NN`` for a supported ``NN``."""
    try:
        _compile_check.parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
