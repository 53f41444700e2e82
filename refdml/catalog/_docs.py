"""What each keyword argument of an operator's forward means, read from its docstring.

The reference states its parameters once, in the forward's docstring (numpydoc's
``Parameters`` section: ``name : type`` and an indented description, several names
sharing one entry as ``a, b``). A forward that shares its parameters with another says so
(``As in :func:`weight_transport```, ``Parameters as in :func:`sinkhorn```, ``See
:func:`ridge_fit` for the parameters``), and the reference is followed, so the meaning is
written in one place and shown wherever it is needed: ``refdml conform --describe``, the
catalogue entry's ``str``, and a test that every keyword a conformance check passes has one.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["parameter_docs"]

_SECTION = re.compile(r"^Parameters\n-{3,}\n(?P<body>.*?)(?=^\w[\w ]*\n-{3,}\n|\Z)",
                      re.MULTILINE | re.DOTALL)
_FUNC = r":(?:func|meth|class):`~?(?P<target>[\w.]+)`"
# An entry that defers to another function: "As in :func:`x`" (and what follows).
_AS_IN = re.compile(rf"^(?:[Aa]s\s+in|[Ss]ee)\s+{_FUNC}[;,.]?\s*(?P<rest>.*)$", re.DOTALL)
# A docstring that defers all (or the other) parameters to another function.
_REF = r":(?:func|meth|class):`~?([\w.]+)`"
_DEFERS = re.compile(rf"[Pp]arameters\s+(?:are\s+)?as\s+in\s+{_REF}|[Ss]ee\s+{_REF}\s+for\s+"
                     r"the\s+parameters")

#: How many "as in" references are followed before giving up (they never loop in refdml).
_DEPTH = 4


def _function(obj: Any) -> Any:
    while isinstance(obj, functools.partial):
        obj = obj.func
    return inspect.unwrap(obj)


def _resolve(target: str, owner: Any) -> Any:
    """The object ``target`` names, as seen from ``owner``'s module (its globals, then the
    already imported modules for a dotted path): None if it cannot be found."""
    head, *rest = target.split(".")
    found = getattr(owner, "__globals__", {}).get(head)
    # Then the packages above the owner's module: a private module's docstring names the
    # public function (``weight_transport`` of refdml.gsp, written in refdml.gsp._pool).
    module_name = getattr(owner, "__module__", "") or ""
    while found is None and module_name:
        module = sys.modules.get(module_name)
        found = getattr(module, head, None) if module is not None else None
        module_name = module_name.rpartition(".")[0]
    if found is None:
        # A dotted path from the package root, refdml.ot.sinkhorn: its longest imported prefix.
        parts = target.split(".")
        for end in range(len(parts) - 1, 0, -1):
            module = sys.modules.get(".".join(parts[:end]))
            if module is not None:
                found, rest = module, parts[end:]
                break
    for part in rest:
        found = getattr(found, part, None)
    return found


def _entries(doc: str) -> dict[str, tuple[str, str]]:
    """The ``Parameters`` section of ``doc``: name -> (type, description)."""
    match = _SECTION.search(doc)
    if match is None:
        return {}
    entries: dict[str, tuple[str, str]] = {}
    names: list[str] = []
    kind, text = "", []

    def close() -> None:
        for name in names:
            entries[name] = (kind, " ".join(" ".join(text).split()))

    for line in match.group("body").splitlines():
        if not line.strip():
            continue
        if line[:1].isspace():
            text.append(line.strip())
            continue
        close()
        head, _, kind = line.partition(" : ")
        names = [n.strip() for n in head.split(",") if n.strip().isidentifier()]
        kind, text = kind.strip(), []
    close()
    return entries


def parameter_docs(forward: Callable[..., Any], _depth: int = 0) -> dict[str, str]:
    """The meaning of each parameter of ``forward`` (a function or a ``functools.partial``
    of one) from its docstring, ``{name: "type: description"}``, references to another
    function's parameters followed; a parameter left undocumented is absent."""
    function = _function(forward)
    doc = inspect.getdoc(function) or ""
    docs: dict[str, str] = {}
    for name, (kind, text) in _entries(doc).items():
        deferred = _AS_IN.match(text) if _depth < _DEPTH else None
        other = None if deferred is None else _resolve(deferred.group("target"), function)
        inherited = None if other is None else parameter_docs(other, _depth + 1).get(name)
        if inherited:
            rest = deferred.group("rest").strip()
            joint = " " if inherited.endswith((".", ";", ":")) else "; "
            docs[name] = inherited + (joint + rest if rest else "")
        else:
            docs[name] = f"{kind}: {text}" if kind and text else kind or text
    if _depth >= _DEPTH:
        return docs
    for found in _DEFERS.finditer(doc):
        other = _resolve(found.group(1) or found.group(2), function)
        if other is None or _function(other) is function:
            continue
        for name, meaning in parameter_docs(other, _depth + 1).items():
            docs.setdefault(name, meaning)
    if _depth:
        return {name: meaning for name, meaning in docs.items() if meaning}
    return {name: _plain(meaning) for name, meaning in docs.items() if meaning}


def _plain(text: str) -> str:
    """reStructuredText's markup taken out: ````x```` -> ``x``, ``:func:`~a.b``` -> ``a.b``."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)
