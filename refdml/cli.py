"""The ``refdml`` command line: ``--version``, ``gradcheck`` and ``verify``."""

from __future__ import annotations

import argparse
import sys

import refdml


def _gradcheck(args: argparse.Namespace) -> int:
    from refdml.gradcheck.registry import all_operators

    specs = all_operators()
    if args.only:
        wanted = set(args.only)
        unknown = wanted - {s.name for s in specs}
        if unknown:
            print(f"unknown operator(s): {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        specs = [s for s in specs if s.name in wanted]
    header = f"{'operator':<40}{'input':<14}{'mode':<12}{'max rel err':>12}{'tol':>9}  result"
    print(header)
    print("-" * len(header))
    failures = 0
    for spec in specs:
        try:
            result = spec.check(args.seed)
        except Exception as exc:  # a crash is a failure of our own code; report it
            failures += 1
            print(f"{spec.name:<40}{'-':<14}{'-':<12}{'-':>12}{spec.rtol:>9.0e}  CRASH {exc!r}")
            continue
        for check in result.checks:
            ok = check.passed(spec.rtol, spec.atol)
            failures += not ok
            print(
                f"{spec.name:<40}{check.name:<14}{check.mode:<12}"
                f"{check.max_rel_error:>12.2e}{spec.rtol:>9.0e}  {'pass' if ok else 'FAIL'}"
            )
    print(f"\n{len(specs)} operators checked, {failures} failure(s)")
    return 1 if failures else 0


def _verify(args: argparse.Namespace) -> int:
    from refdml.validation import run_cli

    return run_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="refdml",
        description="Reference operators of four DML papers, and numerical checks of their claims.",
    )
    parser.add_argument("--version", action="version", version=f"refdml {refdml.__version__}")
    sub = parser.add_subparsers(dest="command")

    grad = sub.add_parser("gradcheck", help="check every registered backward against finite differences")
    grad.add_argument("--only", nargs="+", metavar="NAME", help="check only these operators")
    grad.add_argument("--seed", type=int, default=0, help="seed of the inputs and upstream gradients")
    grad.set_defaults(func=_gradcheck)

    verify = sub.add_parser("verify", help="check every claim of the papers numerically")
    verify.add_argument("--quick", action="store_true", help="smaller sizes, under 30 s")
    verify.add_argument("--only", nargs="+", metavar="ID", help="run only these claim ids")
    verify.add_argument("--json", metavar="PATH", help="write the verdicts as JSON")
    verify.add_argument("--report", metavar="DIR", help="write a Markdown report (and figures) here")
    verify.add_argument("--seed", type=int, default=0, help="base seed of every check")
    verify.set_defaults(func=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
