"""``refdml gradcheck``: every catalogued backward against central finite differences."""

from __future__ import annotations

import argparse
import sys

from refdml._cli_support import seed, select, text_table
from refdml.catalog import OperatorSpec, all_operators
from refdml.gradcheck import MODES

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run", "select_operators"]

HELP = "check every catalogued backward against finite differences"
DESCRIPTION = ("Check every backward of the operator catalogue against central "
               "finite differences. Exit status 0 all pass, 1 a failure, 2 bad arguments.")
EPILOG = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``refdml gradcheck``."""
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="check only these operators (full names or prefixes, e.g. 'losses' 'gsp.pool')")
    parser.add_argument("--seed", type=seed, default=0,
                        help="seed of the inputs and upstream gradients (>= 0)")
    parser.add_argument("--mode", choices=MODES, default=None,
                        help="comparison mode (default: each operator's own; 'fast': one "
                             "random direction per input, localised when it fails)")


def select_operators(command: str, only: list[str] | None) -> list[OperatorSpec] | None:
    """The catalogue narrowed by ``--only`` (names or prefixes); None after an error message."""
    specs = all_operators()
    if not only:
        return specs
    names, unmatched = select([s.name for s in specs], only)
    if unmatched:
        print(f"refdml {command}: error: --only {' '.join(unmatched)} matches no operator "
              "(a full name or a prefix such as 'losses'); the operators are:", file=sys.stderr)
        print("\n".join(f"  {s.name}" for s in specs), file=sys.stderr)
        return None
    return [s for s in specs if s.name in names]


def run(args: argparse.Namespace) -> int:
    """Run ``refdml gradcheck``; exit status 0 all pass, 1 a failure or a crash, 2 bad arguments."""
    specs = select_operators("gradcheck", args.only)
    if specs is None:
        return 2
    rows, failures = [], 0
    for spec in specs:
        try:
            result = spec.check(args.seed, mode=args.mode)
        except Exception as exc:  # a crash is a failure of our own code; report it
            failures += 1
            rows.append((spec.name, "-", "-", "-", f"{spec.rtol:.0e}", f"CRASH {exc!r}"))
            continue
        for check in result.checks:
            status = check.status(spec.rtol, spec.atol)
            failures += status != "passed"
            shown = {"passed": "pass", "kink": "KINK"}.get(status, "FAIL")
            rows.append((spec.name, check.name, check.mode, f"{check.max_rel_error:.2e}",
                         f"{spec.rtol:.0e}", shown))
    header = ("operator", "input", "mode", "max rel err", "rtol", "result")
    print("\n".join(text_table(rows, header, right={3, 4})))
    print(f"\n{len(specs)} operators checked, {failures} failure(s)")
    return 1 if failures else 0
