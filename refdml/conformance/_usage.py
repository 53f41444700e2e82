"""The wording of a wrong setting of a conformance check, shared by ``refdml conform``
(:mod:`refdml.conformance._cli`) and the pytest plugin (:mod:`refdml.pytest_plugin`), so
that a typo gets the same "did you mean" and a missing framework the same reason from both.
Each function returns the message without its flag or argument, which the caller names.
"""

from __future__ import annotations

import difflib
import traceback
from collections.abc import Iterable

from refdml.catalog import all_operators

__all__ = ["did_you_mean", "framework_unavailable", "last_line", "unknown_operator"]


def did_you_mean(name: str, choices: Iterable[str], *, cutoff: float = 0.6,
                 quoted: bool = True) -> str:
    """`` (did you mean 'a', 'b'?)`` for the (at most three) choices close to ``name``;
    empty when none is."""
    close = difflib.get_close_matches(name, list(choices), n=3, cutoff=cutoff)
    if not close:
        return ""
    return f" (did you mean {', '.join(map(repr, close) if quoted else close)}?)"


def unknown_operator(name: str, *, list_if_none_close: bool = False) -> str | None:
    """None when ``name`` is a catalogued operator; else ``'NAME' is not a catalogued
    operator``, with the close names, or (``list_if_none_close``) all of them on the same
    line when none is close. Operator names share their family prefix, so a looser cutoff
    than difflib's default still suggests only the intended ones."""
    names = [spec.name for spec in all_operators()]
    if name in names:
        return None
    hint = did_you_mean(name, names, cutoff=0.5, quoted=False)
    if not hint and list_if_none_close:
        hint = f"; the operators are: {', '.join(names)}"
    return f"{name!r} is not a catalogued operator{hint}"


def last_line(error: BaseException) -> str:
    """``ExceptionType: message``, the last line of the exception's traceback."""
    return traceback.format_exception_only(type(error), error)[-1].strip()


def framework_unavailable(name: str, error: ImportError) -> str:
    """Why a check of a ``name`` implementation cannot run here: importing the framework
    (or a module it needs) raised ``error``."""
    return (f"{error.name or name} cannot be imported ({last_line(error)}); install it to "
            f"check a {name} implementation")
