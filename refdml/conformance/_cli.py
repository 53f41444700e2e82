"""``refdml conform``: check an implementation of a catalogued operator against refdml.

The implementation (and, for NumPy and CuPy pairs, its backward and an optional adapter)
is named ``PACKAGE.MODULE:CALLABLE`` on the command line, the convention of pytest,
uvicorn and gunicorn. This is the only module of refdml that imports a module by a string
(``importlib.import_module``): the user's module is imported lazily, when the command
runs, because refdml cannot know its name before. The current folder is searched after
the installed packages (the ``refdml`` script does not put it on ``sys.path``, and a
folder named like an installed package must not shadow it), for the time of the command.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from refdml._cli_support import at_least, check_output_paths, write_outputs
from refdml._io import write_json_atomic
from refdml._validation import _describe
from refdml.catalog import all_operators
from refdml.conformance import check_implementation, describe
from refdml.conformance._check import MAX_EXAMPLES, MAX_SEEDS, check_output_dtype
from refdml.conformance._formats import DTYPES, unsupported
from refdml.conformance._frameworks import FRAMEWORKS, get_framework
from refdml.conformance._usage import (
    did_you_mean,
    framework_unavailable,
    last_line,
    unknown_operator,
)

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "load_callable", "run"]

HELP = "check your implementation of an operator (torch, JAX, NumPy, CuPy) against refdml"
DESCRIPTION = (
    "Check an implementation of a catalogued operator against refdml's reference: outputs "
    "and vector-Jacobian products on the catalogue's inputs over several seeds, on its hard "
    "reference inputs, and (unless --no-search) on a hypothesis search that shrinks a "
    "disagreement; its error inputs are reported. Each failure names the input case, the "
    "output or gradient, the worst element and the tolerance. Exit status 0 pass, "
    "1 a failure (or a --json that could not be written), 2 bad arguments (a --json "
    "path that cannot be written among them, found before the check). "
    "--describe OP lists an operator's keyword arguments, outputs, cases and tolerances."
)
EPILOG = """\
examples:
  refdml conform --describe gsp.pool
  refdml conform mylib.layers:gsp_pool --op gsp.pool --framework torch --dtype float32
  refdml conform mylosses:contrastive --op losses.contrastive --framework jax --json report.json
  refdml conform mypairs:forward --backward mypairs:backward --op losses.triplet --framework numpy

IMPLEMENTATION is PACKAGE.MODULE:CALLABLE, importable from the current folder or an
installed package. It is called with the operator's forward keyword arguments (arrays as
the framework's arrays, hyperparameters as Python values); --adapter names a callable
adapter(impl, inputs) -> outputs that maps refdml's signature to yours. torch and jax take
their products from autodiff; numpy and cupy pairs return (outputs, ctx) and need
--backward, called as backward(ctx, *cotangents) -> gradients.
"""

# The defaults of check_implementation, shown in --help and stated only in its signature.
_DEFAULTS = {name: parameter.default
             for name, parameter in inspect.signature(check_implementation).parameters.items()}

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_SPEC = re.compile(rf"(?P<module>{_DOTTED}):(?P<attr>{_DOTTED})")


class UsageError(Exception):
    """A bad argument of ``refdml conform``; the message names the flag and the value."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``refdml conform``."""
    # IMPLEMENTATION, --op and --framework are required unless --describe is given, and
    # the choices are checked by run(): one line naming the flag and the value, with
    # "did you mean", instead of argparse's usage block.
    parser.add_argument("implementation", metavar="IMPLEMENTATION", nargs="?",
                        help="your implementation, PACKAGE.MODULE:CALLABLE")
    parser.add_argument("--op", metavar="NAME",
                        help="the catalogued operator it implements, e.g. 'gsp.pool', "
                             "'losses.contrastive' (`refdml conform --describe NAME` shows "
                             "its keyword arguments, cases and tolerances)")
    parser.add_argument("--framework", metavar="{" + ",".join(FRAMEWORKS) + "}",
                        help="the framework it is written in")
    parser.add_argument("--dtype", metavar="{" + ",".join(DTYPES) + "}", default=None,
                        help="the floating dtype of its inputs; bfloat16 with torch and jax "
                             f"only (default: {_DEFAULTS['dtype']})")
    parser.add_argument("--describe", metavar="OP",
                        help="print what a check of the operator OP calls, compares and "
                             "allows (keyword arguments and their meaning, outputs, every "
                             "case with its reason, tolerances per dtype), and exit")
    parser.add_argument("--output-dtype", choices=DTYPES, default=None,
                        help="declare that the outputs come back in this wider dtype (a "
                             "bfloat16 implementation that returns float32); without it an "
                             "output not in --dtype fails, and the report notes the "
                             "declaration")
    parser.add_argument("--backward", metavar="PACKAGE.MODULE:CALLABLE",
                        help="the backward of a numpy or cupy pair, backward(ctx, *cotangents)")
    parser.add_argument("--adapter", metavar="PACKAGE.MODULE:CALLABLE",
                        help="adapter(impl, inputs) -> outputs, from refdml's signature to yours")
    parser.add_argument("--device", default=None,
                        help="the framework's device, e.g. 'cuda' (default: its default)")
    parser.add_argument("--seeds", type=at_least("--seeds", high=MAX_SEEDS), metavar="N",
                        help="seeds of the catalogue's input maker (default: "
                             f"{_DEFAULTS['seeds']})")
    parser.add_argument("--no-search", action="store_true",
                        help="skip the hypothesis search for a minimal disagreement")
    parser.add_argument("--max-examples", type=at_least("--max-examples", high=MAX_EXAMPLES),
                        metavar="N",
                        help="examples of the hypothesis search (default: "
                             f"{_DEFAULTS['max_examples']})")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the report as JSON to PATH (atomically)")


def load_callable(spec: str, flag: str) -> Callable[..., Any]:
    """The callable named ``spec`` (``PACKAGE.MODULE:CALLABLE``, the attribute part
    possibly dotted: ``module:Class.method``); ``UsageError`` naming ``flag`` else.

    The current folder is on ``sys.path`` while :func:`run` runs (see the module docstring).
    """
    match = _SPEC.fullmatch(spec)
    if match is None:
        raise UsageError(f"{flag} {spec!r} is not PACKAGE.MODULE:CALLABLE (a dotted module "
                         "name, a colon, and the name of a callable in it, e.g. "
                         "'mylib.losses:contrastive')")
    module_name, attr_path = match.group("module"), match.group("attr")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        missing = error.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise UsageError(f"{flag} {spec!r}: no module named {missing!r} (looked in the "
                             f"current folder {os.getcwd()} and on sys.path)") from None
        raise UsageError(f"{flag} {spec!r}: importing {module_name!r} failed: "
                         f"{last_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - the user's module failed to import; say how
        raise UsageError(f"{flag} {spec!r}: importing {module_name!r} raised "
                         f"{last_line(error)}") from None
    value: Any = module
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(value, part):
            raise UsageError(f"{flag} {spec!r}: {walked!r} has no attribute {part!r}"
                             + _suggestion(part, dir(value)))
        value = getattr(value, part)
        walked = f"{walked}:{part}" if walked == module_name else f"{walked}.{part}"
    if not callable(value):
        raise UsageError(f"{flag} {spec!r} is not callable: it is {_describe(value)} "
                         f"({type(value).__name__})")
    return value


def _suggestion(name: str, choices: list[str]) -> str:
    return did_you_mean(name, [c for c in choices if not c.startswith("__")])


def _check_operator(name: str, flag: str = "--op", listing: bool = True) -> None:
    problem = unknown_operator(name)
    if problem is None:
        return
    if not listing:
        raise UsageError(f"{flag} {problem}")
    raise UsageError(f"{flag} {problem}; the operators are:\n"
                     + "\n".join(f"  {spec.name}" for spec in all_operators()))


def _check_choice(flag: str, value: str | None, choices: tuple[str, ...]) -> None:
    if value is None or value in choices:
        return
    close = difflib.get_close_matches(value, choices, n=2, cutoff=0.5)
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise UsageError(f"{flag} {value!r} is not one of {', '.join(choices)}{hint}")


#: The flags --describe does not take, with the attribute argparse stores them in.
_CHECK_FLAGS = {"IMPLEMENTATION": "implementation", "--op": "op", "--framework": "framework",
                "--dtype": "dtype", "--backward": "backward", "--adapter": "adapter",
                "--device": "device", "--seeds": "seeds", "--max-examples": "max_examples",
                "--json": "json", "--no-search": "no_search", "--output-dtype": "output_dtype"}


def _describe_text(args: argparse.Namespace) -> str:
    """``--describe OP``'s text, or ``UsageError`` (an unknown OP, a flag of a check)."""
    given = [flag for flag, attr in _CHECK_FLAGS.items() if getattr(args, attr, None)]
    if given:
        raise UsageError(f"--describe {args.describe} takes no other argument; drop "
                         f"{', '.join(given)} (they are for a check)")
    _check_operator(args.describe, "--describe", listing=False)
    return str(describe(args.describe))


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of check_implementation that the user gave (the others keep
    its defaults, stated once, in its signature)."""
    given = {"dtype": args.dtype, "device": args.device, "seeds": args.seeds,
             "max_examples": args.max_examples, "output_dtype": args.output_dtype}
    options = {key: value for key, value in given.items() if value is not None}
    if args.no_search:
        options["search"] = False
    return options


def _prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Everything :func:`check_implementation` takes, or ``UsageError``."""
    # A value given wrong first: it is what the user typed last and wants to hear about.
    _check_choice("--framework", args.framework, FRAMEWORKS)
    _check_choice("--dtype", args.dtype, DTYPES)
    if args.implementation is None:
        raise UsageError("IMPLEMENTATION is missing: give your implementation as "
                         "PACKAGE.MODULE:CALLABLE (or --describe OP to read about an operator)")
    for flag, value in (("--op", args.op), ("--framework", args.framework)):
        if value is None:
            raise UsageError(f"{flag} is missing: refdml conform IMPLEMENTATION --op NAME "
                             "--framework {" + ",".join(FRAMEWORKS) + "}")
    _check_operator(args.op)
    refused = unsupported(args.framework, args.dtype or _DEFAULTS["dtype"])
    if refused is not None:
        raise UsageError(f"--dtype {args.dtype}: {refused}")
    try:
        check_output_dtype(args.output_dtype, args.dtype or _DEFAULTS["dtype"])
    except ValueError as error:
        raise UsageError(f"--output-dtype {args.output_dtype}: {error}") from None
    if args.framework in ("numpy", "cupy") and args.backward is None:
        raise UsageError(f"--framework {args.framework} needs --backward "
                         "PACKAGE.MODULE:CALLABLE, the pair's backward(ctx, *cotangents)")
    if args.framework in ("torch", "jax") and args.backward is not None:
        raise UsageError(f"--backward {args.backward!r} is for --framework numpy or cupy; "
                         f"{args.framework} takes its products from autodiff")
    problem = check_output_paths(None, args.json)
    if problem is not None:
        raise UsageError(problem)
    kwargs = {"impl": load_callable(args.implementation, "IMPLEMENTATION"),
              "framework": args.framework, **_options(args)}
    if args.backward is not None:
        kwargs["backward"] = load_callable(args.backward, "--backward")
    if args.adapter is not None:
        kwargs["adapter"] = load_callable(args.adapter, "--adapter")
    _check_framework(args.framework, kwargs.get("backward"), args.device)
    return kwargs


def _check_framework(name: str, backward: Any, device: str | None) -> None:
    """Import the framework and check the device before any work (``UsageError``)."""
    try:
        get_framework(name, backward=backward, device=device)
    except ImportError as error:
        raise UsageError(f"--framework {name}: {framework_unavailable(name, error)}") from None
    except (TypeError, ValueError) as error:
        flag = f"--device {device}" if device is not None else f"--framework {name}"
        raise UsageError(f"{flag}: {error}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``refdml conform``; exit status 0 pass, 1 a failure or a failed write, 2 bad
    arguments (found before any work)."""
    if args.describe is not None:
        try:
            text = _describe_text(args)
        except UsageError as error:
            print(f"refdml conform: error: {error}", file=sys.stderr)
            return 2
        print(text)
        return 0
    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)
    try:
        try:
            kwargs = _prepare(args)
        except UsageError as error:
            print(f"refdml conform: error: {error}", file=sys.stderr)
            return 2
        report = check_implementation(kwargs.pop("impl"), args.op, **kwargs)
    finally:
        if added:
            sys.path.remove(here)
    print(report.summary())
    if not write_outputs("conform", json_path=args.json,
                         write_json=lambda path: write_json_atomic(path, report.to_dict(), indent=2)):
        return 1
    return 0 if report.passed else 1
