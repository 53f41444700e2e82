"""The ``refdml`` command line: ``--version``, ``gradcheck``, ``gpu-check``, ``verify``, ``train``,
``reproduce``, ``conform``.

Each subcommand is one module with the same interface: ``HELP`` (its line in ``refdml
--help``), ``DESCRIPTION`` and ``EPILOG`` (its ``--help``; an epilog is printed as written),
``add_arguments(parser)`` and ``run(args) -> int``. This module only wires them, from the
table :data:`COMMANDS`.

Exit statuses: 0 success, 1 a failure of refdml's own code (a gradient check, a crashed
claim check), 2 bad arguments (argparse's convention, in one line:
:class:`refdml._cli_support.OneLineParser`) or a missing optional extra: a
:class:`refdml.exceptions.MissingExtraError` is one line, ``refdml COMMAND: error: needs the
"EXTRA" extra (...): pip install "refdml[EXTRA]"``, never a traceback. The extras a command
needs for the flags it was given are checked before it starts (:func:`_check_extras`).
"""

from __future__ import annotations

import argparse
import sys

import refdml
from refdml._cli_support import OneLineParser
from refdml.checks import _gpu_check_cli, _gradcheck_cli
from refdml.conformance import _cli as _conform_cli
from refdml.exceptions import MissingExtraError
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
    parser = OneLineParser(
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


def _check_extras(args: argparse.Namespace) -> None:
    """Raise :class:`MissingExtraError` if the command in ``args`` needs an extra that is not
    installed (looked up, not imported): before the command does any work."""
    if args.command == "verify" and getattr(args, "report", None):
        MissingExtraError.require("plot", "matplotlib")          # the report's figures
    elif args.command == "reproduce" and not getattr(args, "list", False):
        # dask.distributed runs the grid (not needed in this process or from the cache);
        # the studies need the "train" extra's scikit-learn (digits) and matplotlib (glyph
        # fonts, figures). The "reproduce" extra brings all three.
        if not (getattr(args, "in_process", False) or getattr(args, "cached_only", False)):
            MissingExtraError.require("reproduce", "distributed")
        if not getattr(args, "cached_only", False):
            MissingExtraError.require("reproduce", "sklearn", "matplotlib")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``refdml`` and its subcommands."""
    return _build()[0]


def main(argv: list[str] | None = None) -> int:
    parser, subparsers = _build()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse reports a subcommand's unknown flag as the top-level parser's; name the
        # subcommand the user was typing instead (one line, exit status 2).
        target = subparsers.get(getattr(args, "command", None), parser)
        target.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        _check_extras(args)
        return args.run(args)
    except MissingExtraError as exc:
        print(f"refdml {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
