"""``refdml verify``: the flags, the table of verdicts, the JSON and the report."""

from __future__ import annotations

import argparse
import sys
import time
from refdml._cli_support import check_output_paths, seed, select, write_outputs
from refdml._io import write_json_atomic

from ._claims import load_claims
from ._framework import CHECKS, VERDICT_MEANINGS
from ._runner import _VERDICT_WIDTH, exit_status, list_claims, run_checks

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run"]

HELP = "check every claim of the papers numerically"
DESCRIPTION = ("Check the claims of GSP, XML, ASAP and Wasserstein DML numerically; "
               "one line per claim with its verdict and key number.")


def _epilog() -> str:
    width = max(len(v.value) for v in VERDICT_MEANINGS)
    verdicts = "\n".join(f"  {v.value:<{width}}  {text}" for v, text in VERDICT_MEANINGS.items())
    return (
        "verdicts (computed from the numbers, never written by hand):\n" + verdicts + "\n"
        f"  {'crashed':<{width}}  the check itself raised (a defect of refdml or of the check)\n\n"
        "exit status:\n"
        "  0  every check ran and every self-check (gradient check of the refdml operators a\n"
        "     claim uses) passed, whatever the verdicts\n"
        "  1  a check crashed or a self-check failed, or an output could not be written\n"
        "  2  bad arguments (an --only pattern matching no claim, an output path that cannot be\n"
        "     written, a --report folder that is not empty and not a refdml report), found\n"
        "     before any claim runs\n\n"
        "--report DIR is written as a whole: the previous report there is replaced (no stale\n"
        "figure survives), and a run stopped before the end leaves it as it was.\n\n"
        "examples:\n"
        "  refdml verify --quick\n"
        "  refdml verify --only gsp.fig9 xml --report out/\n"
        "  refdml verify --list"
    )


#: The verdicts, the exit statuses and examples (``refdml verify --help``).
EPILOG = _epilog()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``refdml verify``."""
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and searches (about half the time)")
    parser.add_argument("--only", nargs="+", metavar="ID",
                        help="run only these claims (full ids or prefixes, e.g. 'gsp' 'gsp.fig9')")
    parser.add_argument("--list", action="store_true",
                        help="print the claim ids with one-line descriptions and exit")
    parser.add_argument("--json", metavar="PATH", help="write the verdicts as JSON")
    parser.add_argument("--report", metavar="DIR",
                        help="write a Markdown report (and figures) here, replacing the report "
                             "there as a whole; checked before the run")
    parser.add_argument("--seed", type=seed, default=0, help="base seed of every check (>= 0)")


class _Progress:
    """Which claim is running and for how long: a tqdm bar on a terminal, else one line per claim.

    Both go to stderr, so stdout keeps only the table (and can be piped).
    """

    def __init__(self, total: int):
        self.start = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="claim", leave=False,
                            bar_format="{n_fmt}/{total_fmt} claims [{elapsed}] {desc}")

    def before(self, i: int, total: int, claim_id: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"running {claim_id}")
        else:
            elapsed = time.perf_counter() - self.start
            print(f"[{i + 1:>2}/{total}] {elapsed:6.1f} s  running {claim_id}", file=sys.stderr, flush=True)

    def echo(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args: argparse.Namespace) -> int:
    """Run ``refdml verify`` with the flags of :func:`add_arguments`.

    Returns the exit status: 0, 1 (a check crashed, a self-check failed, or an output
    could not be written) or 2 (bad arguments, found before any claim runs: an ``--only``
    pattern matching no claim, an output path that cannot be written, a ``--report``
    folder that is neither empty nor a refdml report).
    """
    if getattr(args, "list", False):
        print("\n".join(list_claims()))
        return 0
    load_claims()
    ids = None
    if args.only:
        ids, unmatched = select(CHECKS, args.only)
        if unmatched:
            print(f"refdml verify: error: --only {' '.join(unmatched)} matches no claim id "
                  f"(a full id or a prefix such as 'gsp' or 'gsp.fig9'); the ids are:", file=sys.stderr)
            print("\n".join(f"  {i}" for i in CHECKS), file=sys.stderr)
            return 2
    from ._report import is_report_folder, write_report

    problem = check_output_paths(args.report, args.json, recognise=is_report_folder)
    if problem is not None:
        print(f"refdml verify: error: {problem}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    mode = "quick" if args.quick else "default"
    print(f"refdml verify ({mode} mode, seed {args.seed})")
    print(f"{'claim':<28}{'verdict':<{_VERDICT_WIDTH}}{'time':>9}  key number")
    print("-" * 100)
    progress = _Progress(len(ids) if ids is not None else len(CHECKS))
    try:
        results = run_checks(ids, quick=args.quick, seed=args.seed, echo=progress.echo,
                             progress=progress.before)
    finally:
        progress.close()
    elapsed = time.perf_counter() - start
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    print("-" * 100)
    print(f"{len(results)} claims in {elapsed:.1f} s: "
          + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    bad_self = [r.id for r in results if r.self_check_failed]
    crashed = [r.id for r in results if r.crashed]
    if crashed:
        print(f"CRASHED: {', '.join(crashed)}")
    if bad_self:
        print(f"SELF-CHECK FAILED (a gradient check of refdml's own code): {', '.join(bad_self)}")
    written = write_outputs(
        "verify", json_path=args.json,
        write_json=lambda path: write_json_atomic(path, [r.as_json() for r in results], indent=2),
        report=args.report,
        write_report=lambda folder: write_report(results, folder, quick=args.quick,
                                                 seed=args.seed, runtime_s=elapsed),
        recognise=is_report_folder)
    if not written:
        return 1
    return exit_status(results)
