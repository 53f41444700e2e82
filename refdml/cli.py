"""The ``refdml`` command line: ``--version``, ``gradcheck``, ``gpu-check``, ``verify``, ``train``,
``reproduce``, ``conform``.

Each subcommand is one module with the same interface: ``HELP`` (its line in ``refdml
--help``), ``DESCRIPTION`` and ``EPILOG`` (its ``--help``; an epilog is printed as written),
``add_arguments(parser)`` and ``run(args) -> int``. This module only wires them, from the
table :data:`COMMANDS`.

Exit statuses: 0 success, 1 a failure of refdml's own code (a gradient check, a crashed
claim check), 2 bad arguments (argparse's convention).
"""

from __future__ import annotations

import argparse
import sys

import refdml
from refdml.catalog import _gpu_check_cli, _gradcheck_cli
from refdml.conformance import _cli as _conform_cli
from refdml.reproduce import _cli as _reproduce_cli
from refdml.train import _cli as _train_cli
from refdml.validation import _cli as _verify_cli

__all__ = ["COMMANDS", "build_parser", "main"]

#: Subcommand name -> its module, in the order of ``refdml --help``.
COMMANDS = {
    "gradcheck": _gradcheck_cli,
    "gpu-check": _gpu_check_cli,
    "verify": _verify_cli,
    "train": _train_cli,
    "reproduce": _reproduce_cli,
    "conform": _conform_cli,
}


def _build() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and the parser of each subcommand."""
    parser = argparse.ArgumentParser(
        prog="refdml",
        description="Reference operators of four DML papers, and numerical checks of their claims.",
    )
    parser.add_argument("--version", action="version", version=f"refdml {refdml.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    subparsers = {}
    for name, command in COMMANDS.items():
        extra = {}
        if command.EPILOG is not None:
            extra = dict(epilog=command.EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        subparsers[name] = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION,
                                          **extra)
        command.add_arguments(subparsers[name])
        subparsers[name].set_defaults(run=command.run)
    return parser, subparsers


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``refdml`` and its subcommands."""
    return _build()[0]


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = _build()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown flag with the top-level usage; show the
        # usage of the subcommand the user was typing instead (exits with status 2).
        target = subparsers.get(getattr(args, "command", None), parser)
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
