"""The ``refdml`` command line: ``--version``, ``gradcheck``, ``gpu-check``, ``verify``, ``train``,
``reproduce``.

Exit statuses: 0 success, 1 a failure of refdml's own code (a gradient check, a crashed
claim check), 2 bad arguments (argparse's convention).
"""

from __future__ import annotations

import argparse
import os
import sys

import refdml


def _seed(text: str) -> int:
    """``--seed``: a non-negative integer (NumPy refuses negative seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"seed == {text!r}, must be a non-negative integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"seed == {value}, must be a non-negative integer")
    return value


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...], right: set[int]) -> list[str]:
    """Rows as text columns two spaces apart, each as wide as its longest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [line(header), "-" * len(line(header)), *map(line, rows)]


def _gradcheck(args: argparse.Namespace) -> int:
    from refdml.gradcheck.catalog import all_operators

    specs = _select_specs("gradcheck", all_operators(), args.only)
    if specs is None:
        return 2
    rows, failures = [], 0
    for spec in specs:
        try:
            result = spec.check(args.seed)
        except Exception as exc:  # a crash is a failure of our own code; report it
            failures += 1
            rows.append((spec.name, "-", "-", "-", f"{spec.rtol:.0e}", f"CRASH {exc!r}"))
            continue
        for check in result.checks:
            ok = check.passed(spec.rtol, spec.atol)
            failures += not ok
            rows.append((spec.name, check.name, check.mode, f"{check.max_rel_error:.2e}",
                         f"{spec.rtol:.0e}", "pass" if ok else "FAIL"))
    header = ("operator", "input", "mode", "max rel err", "rtol", "result")
    print("\n".join(_table(rows, header, right={3, 4})))
    print(f"\n{len(specs)} operators checked, {failures} failure(s)")
    return 1 if failures else 0


def _select_specs(command: str, specs: list, only: list[str] | None) -> list | None:
    """``specs`` narrowed by ``--only`` (names or prefixes); None after an error message."""
    from refdml.validation import select

    if not only:
        return specs
    names, unmatched = select([s.name for s in specs], only)
    if unmatched:
        print(f"refdml {command}: error: --only {' '.join(unmatched)} matches no operator "
              "(a full name or a prefix such as 'losses'); the operators are:", file=sys.stderr)
        print("\n".join(f"  {s.name}" for s in specs), file=sys.stderr)
        return None
    return [s for s in specs if s.name in names]


def _gpu_check(args: argparse.Namespace) -> int:
    """``refdml gpu-check``: the parity of every mirrored catalogue entry, or with
    ``--compile-only`` every CUDA kernel compiled for real GPUs (:func:`_gpu_check_compile`).

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
        return _gpu_check_compile(args)
    if args.arch is not None:
        print("refdml gpu-check: error: --arch needs --compile-only", file=sys.stderr)
        return 2
    from refdml.gpu.parity import available_backends, check_parity
    from refdml.gradcheck.catalog import all_operators

    specs = _select_specs("gpu-check", all_operators(), args.only)
    if specs is None:
        return 2
    if not _json_path_ok(args.json):
        return 2
    backends = available_backends()
    dtypes = list(dict.fromkeys(args.dtype or ("float32", "float64")))
    seed = 0 if args.seed is None else args.seed
    mirrored = [s for s in specs if s.mirror is not None]
    if "cupy" in backends:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        print(f"devices: NumPy (CPU) and CuPy {cupy.__version__} on {name}")
    else:
        print("devices: NumPy (CPU) only -- CuPy is not installed or sees no CUDA device, "
              "so no CuPy rows ran")
    rows, records, failures = [], [], 0
    simulated = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
    for spec in mirrored:
        runs = [(backend, "array") for backend in backends]
        for kernels in spec.mirror_kernels:
            # The CPU twin takes NumPy arrays; the CUDA kernel CuPy ones (NumPy ones under
            # Numba's simulator). A CUDA kernel with neither a GPU nor the simulator is skipped.
            if kernels == "cpu":
                runs.append(("numpy", "cpu"))
            elif "cupy" in backends:
                runs.append(("cupy", "cuda"))
            elif simulated:
                runs.append(("numpy", "cuda"))
        for backend, kernels in runs:
            device = backend if kernels == "array" else f"{backend}/{kernels}"
            if kernels == "cuda" and backend == "numpy":
                device = "cuda-simulator"
            record = dict(operator=spec.name, backend=backend, path=kernels, device=device)
            for dtype in dtypes:
                try:
                    r = check_parity(spec, backend=backend, dtype=dtype, seed=seed,
                                     kernels=kernels)
                except Exception as exc:  # a crash is a failure of our own code; report it
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
        print("\n".join(_table(rows, header, right={3, 4, 5, 6})))
    print(f"\n{len(mirrored)} mirrored operators (array path on {len(backends)} device(s), plus "
          f"their compiled kernels) x {len(dtypes)} dtype(s): {len(rows)} checks, "
          f"{failures} failure(s)")
    unmirrored = [s for s in specs if s.mirror is None]
    if unmirrored:
        print(f"\n{len(unmirrored)} operators without a mirror (not checked):")
        width = max(len(s.name) for s in unmirrored)
        for s in unmirrored:
            print(f"  {s.name:<{width}}  {s.no_mirror or '(no reason recorded)'}")
    _write_json(args.json, records)
    return 1 if failures else 0


def _finite(value: float) -> float | None:
    """A float for JSON: None where it is not finite (JSON has no inf or NaN)."""
    value = float(value)
    return value if value == value and abs(value) != float("inf") else None


def _json_path_ok(path: str | None) -> bool:
    """``--json``: can the file be written? (checked before the run; a message if not)."""
    from refdml.validation import check_output_paths

    problem = check_output_paths(None, path)
    if problem is not None:
        print(f"refdml gpu-check: error: {problem}", file=sys.stderr)
    return problem is None


def _write_json(path: str | None, records: list) -> None:
    if path:
        from pathlib import Path

        from refdml._io import write_json_atomic

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, records, indent=1)
        print(f"JSON written to {path}")


def _gpu_check_compile(args: argparse.Namespace) -> int:
    """``refdml gpu-check --compile-only``: every CUDA kernel x launch signature x ``--arch``
    compiled for real GPUs, no GPU needed (:mod:`refdml.gpu._cuda_compile`).

    Exit status 0 every row passes, 1 a compile or link error, a spill or static shared
    memory over 48 KiB, 2 bad arguments or no toolchain (the simulator on, numba-cuda,
    NVVM or nvJitLink missing). ``--json PATH``: the rows as
    :func:`refdml.gpu._cuda_compile.rows_to_json` documents them.
    """
    import time

    from refdml.gpu import _cuda_compile

    for flag, value in (("--only", args.only), ("--dtype", args.dtype), ("--seed", args.seed)):
        if value is not None:
            print(f"refdml gpu-check: error: {flag} belongs to the parity check, not to "
                  "--compile-only (which compiles every kernel for both dtypes)", file=sys.stderr)
            return 2
    if not _json_path_ok(args.json):
        return 2
    archs = list(dict.fromkeys(args.arch or _cuda_compile.DEFAULT_ARCHS))
    start = time.perf_counter()
    try:
        rows = _cuda_compile.compile_check(archs)
    except _cuda_compile.ToolchainError as exc:
        print(f"refdml gpu-check --compile-only: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    from importlib.metadata import version

    print(f"CUDA kernels compiled for {', '.join(archs)} with numba-cuda "
          f"{version('numba-cuda')} (NVVM to LTO-IR, nvJitLink to SASS; no GPU used)")
    table = [(r.kernel, r.signature, r.arch, _cell(r.registers),
              "-" if r.spill_store_bytes is None else f"{r.spill_store_bytes}/{r.spill_load_bytes}",
              _cell(r.local_bytes), _cell(r.shared_bytes),
              r.status if r.passed else f"FAIL {r.problems[0].splitlines()[0][:100]}")
             for r in rows]
    header = ("kernel", "signature", "arch", "registers", "spills st/ld B", "local B",
              "shared B", "status")
    print("\n".join(_table(table, header, right={3, 4, 5, 6})))
    failed = [r for r in rows if not r.passed]
    for r in failed:
        print(f"\n{r.kernel} [{r.signature}] {r.arch}:\n  " + "\n  ".join(
            line for problem in r.problems for line in problem.splitlines()))
    kernels = len({r.kernel for r in rows})
    print(f"\n{len(rows)} rows ({kernels} kernels, {len(rows) // max(len(archs), 1)} launch "
          f"signatures x {len(archs)} architecture(s)): {len(failed)} failure(s); "
          f"{elapsed:.1f} s")
    _write_json(args.json, _cuda_compile.rows_to_json(rows))
    return 1 if failed else 0


def _cell(value: int | None) -> str:
    return "-" if value is None else str(value)


def _arch(text: str) -> str:
    """``--arch``: ``sm_NN`` for a supported ``NN``."""
    from refdml.gpu._cuda_compile import parse_arch

    try:
        parse_arch(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _verify(args: argparse.Namespace) -> int:
    from refdml.validation import run_cli

    return run_cli(args)


def _train(args: argparse.Namespace) -> int:
    from refdml.train._cli import run_from_args

    return run_from_args(args)


def _reproduce(args: argparse.Namespace) -> int:
    from refdml.reproduce._cli import run_from_args

    return run_from_args(args)


def _verify_epilog() -> str:
    from refdml.validation._framework import VERDICT_MEANINGS

    width = max(len(v.value) for v in VERDICT_MEANINGS)
    verdicts = "\n".join(f"  {v.value:<{width}}  {text}" for v, text in VERDICT_MEANINGS.items())
    return (
        "verdicts (computed from the numbers, never written by hand):\n" + verdicts + "\n"
        f"  {'crashed':<{width}}  the check itself raised (a defect of refdml or of the check)\n\n"
        "exit status:\n"
        "  0  every check ran and every self-check (gradient check of the refdml operators a\n"
        "     claim uses) passed, whatever the verdicts\n"
        "  1  a check crashed or a self-check failed\n"
        "  2  bad arguments (an --only pattern matching no claim, an output path that cannot be written)\n\n"
        "examples:\n"
        "  refdml verify --quick\n"
        "  refdml verify --only gsp.fig9 xml --report out/\n"
        "  refdml verify --list"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refdml",
        description="Reference operators of four DML papers, and numerical checks of their claims.",
    )
    parser.add_argument("--version", action="version", version=f"refdml {refdml.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{gradcheck,gpu-check,verify,train,reproduce}")

    grad = sub.add_parser("gradcheck", help="check every catalogued backward against finite differences",
                          description="Check every backward of the operator catalogue against central "
                                      "finite differences. Exit status 0 all pass, 1 a failure, 2 bad arguments.")
    grad.add_argument("--only", nargs="+", metavar="NAME",
                      help="check only these operators (full names or prefixes, e.g. 'losses' 'gsp.pool')")
    grad.add_argument("--seed", type=_seed, default=0, help="seed of the inputs and upstream gradients (>= 0)")
    grad.set_defaults(func=_gradcheck)

    gpu = sub.add_parser(
        "gpu-check", help="check the fast path (refdml.gpu) against the reference on this machine",
        description="Run the parity of every mirrored catalogue entry (refdml.gpu.parity) on "
                    "NumPy, and on CuPy where it sees a CUDA device: outputs and gradients "
                    "against the float64 reference, max relative error, tolerance and time of "
                    "the mirror's forward + backward (catalogue-sized inputs). With "
                    "--compile-only: compile every CUDA kernel for real GPUs instead, no GPU "
                    "needed (registers, spills, local and shared memory per kernel, signature "
                    "and architecture). Exit status 0 all pass, 1 a failure or a crash, 2 bad "
                    "arguments (or, --compile-only, no CUDA toolchain).")
    gpu.add_argument("--only", nargs="+", metavar="NAME",
                     help="check only these operators (full names or prefixes, e.g. 'losses' 'gsp.pool')")
    gpu.add_argument("--dtype", nargs="+", choices=("float32", "float64"),
                     help="dtypes of the fast path (default both)")
    gpu.add_argument("--seed", type=_seed, help="seed of the inputs and upstream gradients (>= 0; default 0)")
    gpu.add_argument("--compile-only", action="store_true",
                     help="instead of the parity: compile every CUDA kernel, for every dtype "
                          "signature it is launched with, for real GPUs (NVVM + nvJitLink, no "
                          "GPU needed; needs refdml[gpu] and NUMBA_ENABLE_CUDASIM unset or 0); "
                          "fails on a compile error, a spill or static shared memory > 48 KiB")
    gpu.add_argument("--arch", nargs="+", type=_arch, metavar="sm_NN",
                     help="with --compile-only: the architectures (default sm_80 sm_90)")
    gpu.add_argument("--json", metavar="PATH",
                     help="also write the rows as JSON (a list of dicts; keys in docs/gpu.md)")
    gpu.set_defaults(func=_gpu_check)

    verify = sub.add_parser("verify", help="check every claim of the papers numerically",
                            description="Check the claims of GSP, XML, ASAP and Wasserstein DML numerically; "
                                        "one line per claim with its verdict and key number.",
                            epilog=_verify_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("--quick", action="store_true", help="smaller sizes and searches (about half the time)")
    verify.add_argument("--only", nargs="+", metavar="ID",
                        help="run only these claims (full ids or prefixes, e.g. 'gsp' 'gsp.fig9')")
    verify.add_argument("--list", action="store_true", help="print the claim ids with one-line descriptions and exit")
    verify.add_argument("--json", metavar="PATH", help="write the verdicts as JSON")
    verify.add_argument("--report", metavar="DIR",
                        help="write a Markdown report (and figures) here; checked before the run")
    verify.add_argument("--seed", type=_seed, default=0, help="base seed of every check (>= 0)")
    verify.set_defaults(func=_verify)
    train = sub.add_parser(
        "train", help="train a study (tokens, digits-collage, features) with refdml.train",
        description="Train one of the studies of refdml.train with hand-written backward "
                    "passes: flags override the --config TOML, which overrides the study's "
                    "defaults (docs/train.md, 'Running a training'). Writes config.json (the "
                    "effective config), log.jsonl, checkpoint.npz and best.npz to --out. Exit "
                    "status 0 done, 1 the run diverged, 2 bad arguments, config or device.")
    from refdml.train._cli import add_train_arguments

    add_train_arguments(train, study=None)
    train.set_defaults(func=_train)
    from refdml.reproduce._cli import _epilog, add_arguments

    reproduce = sub.add_parser(
        "reproduce", help="run the papers' experiments over seeds on Dask, with computed verdicts",
        description="Train the papers' experiments at small scale (refdml.train) over seeds, "
                    "on a Dask LocalCluster (or --scheduler), with a disk cache; one line per "
                    "experiment: verdict and the paired effect with its bootstrap interval "
                    "(docs/reproduce.md).",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(reproduce)
    reproduce.set_defaults(func=_reproduce)
    parser._refdml_subparsers = {"gradcheck": grad, "gpu-check": gpu, "verify": verify,
                                 "train": train, "reproduce": reproduce}
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown flag with the top-level usage; show the
        # usage of the subcommand the user was typing instead (exits with status 2).
        target = parser._refdml_subparsers.get(getattr(args, "command", None), parser)
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
