"""Griffe extension of the documentation build: refdml's docstrings, in Markdown.

refdml's docstrings follow the NumPy convention, whose inline markup is reStructuredText:
cross-reference roles (``:func:`refdml.ot.sinkhorn```), inline maths (``:math:`x```) and
``.. math::`` blocks. mkdocstrings renders docstrings as Markdown, where these would show as
raw text. Before a docstring is parsed, this extension rewrites them:

- ``:func:`name```, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``,
  ``:obj:`` -> the code span ``name`` (a leading ``~`` is dropped);
- ``:math:`x``` -> ``$x$``, and a ``.. math::`` directive with its indented block -> a
  ``$$ ... $$`` block, both rendered by KaTeX (``pymdownx.arithmatex``).

Only the text handed to the renderer changes; the source files are not touched.
"""

from __future__ import annotations

import re

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
DIRECTIVE = re.compile(r"^(\s*)\.\. math::\s*(.*)$")


def to_markdown(text: str) -> str:
    """``text`` with the reStructuredText markup above rewritten as Markdown."""
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = MATH_ROLE.sub(lambda m: f"${m.group(1)}$", text)
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = DIRECTIVE.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent, inline = match.group(1), match.group(2).strip()
        body = [inline] if inline else []
        i += 1
        # The block: blank lines and lines indented deeper than the directive.
        while i < len(lines) and (not lines[i].strip()
                                  or len(lines[i]) - len(lines[i].lstrip()) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        while body and not body[0]:
            body.pop(0)
        out += [f"{indent}$$"] + [f"{indent}{line}" for line in body] + [f"{indent}$$", ""]
    return "\n".join(out)


class RestructuredTextToMarkdown(griffe.Extension):
    """Rewrite every docstring (see the module docstring) as it is loaded."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
