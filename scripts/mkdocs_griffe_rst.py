"""Griffe extension of the documentation build: refdml's docstrings, in Markdown.

refdml's docstrings follow the NumPy convention, whose inline markup is reStructuredText:
cross-reference roles (``:func:`refdml.ot.sinkhorn```), inline maths (``:math:`x```),
``.. math::`` blocks, definition lists (a term line, its definition indented below it) and
lists whose continued paragraphs are indented to the item's text. mkdocstrings renders
docstrings as Markdown, where these would show as raw text, as code blocks or as one run-on
paragraph. Before a docstring is parsed, this extension rewrites them:

- ``:func:`name```, ``:class:``, ``:meth:``, ``:mod:``, ``:attr:``, ``:data:``, ``:exc:``,
  ``:obj:`` -> the code span ``name`` (a leading ``~`` is dropped);
- ``:math:`x``` -> ``$x$``, and a ``.. math::`` directive with its indented block -> a
  ``$$ ... $$`` block, both rendered to MathML at build time (``pymdownx.arithmatex``, then
  the hook ``scripts/mkdocs_math.py``);
- a definition list outside the NumPy sections that griffe reads item by item (Parameters,
  Returns, ...) -> Markdown's (``term`` / ``:   definition``, extension ``def_list``);
- a simple table (columns under ``=====  =====`` borders) -> a Markdown table;
- a list of aligned columns (``name``, two spaces or more, its text; continued lines
  indented), or of fields (``name : text``) outside a NumPy section -> a definition list;
- a list item's continued paragraphs -> indented by four, as Markdown needs.

Only the text handed to the renderer changes; the source files are not touched. The
functions are plain text transformations (no griffe needed), also used by
``scripts/docs_pages.py`` for the module summaries of the API index.
"""

from __future__ import annotations

import re

try:  # the docs build has griffe; the test suite imports the functions without it
    import griffe
except ImportError:  # pragma: no cover - depends on the environment
    griffe = None

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj):`~?([^`]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
DIRECTIVE = re.compile(r"^(\s*)\.\. math::\s*(.*)$")
BORDER = re.compile(r"^(\s*)=+(?: +=+)+\s*$")
ROW = re.compile(r"^(\s*)(\S(?:.*?\S)?) {2,}(\S.*)$")
FIELD = re.compile(r"^(\s*)(\S[^:]*?) : (\S.*)$")  # "name : text", as NumPy's fields
LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+[.)])(\s+)\S")
# NumPy sections whose items griffe parses itself ("name : type" and its indented text).
STRUCTURED = {"parameters", "other parameters", "type parameters", "returns", "yields",
              "receives", "raises", "warns", "attributes", "functions", "methods", "classes",
              "type aliases", "modules", "examples", "deprecated"}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _is_dash_line(line: str) -> bool:
    return bool(line.strip()) and not line.strip().strip("-")


def roles_to_markdown(text: str) -> str:
    """``text`` with its cross-reference roles as code spans and ``:math:`` as ``$...$``."""
    text = ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return MATH_ROLE.sub(lambda m: f"${m.group(1)}$", text)


def math_blocks(lines: list[str]) -> list[str]:
    """Each ``.. math::`` directive and its indented block as a ``$$`` block, at the
    directive's indentation."""
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
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > len(indent)):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        while body and not body[0]:
            body.pop(0)
        # A blank line would end the Markdown block: TeX does not allow one in display maths.
        out += ([f"{indent}$$"] + [f"{indent}{line}" for line in body if line]
                + [f"{indent}$$", ""])
    return out


def _is_term(lines: list[str], i: int) -> bool:
    """Whether ``lines[i]`` starts a definition-list item: a line that is no list item,
    directive, doctest or literal-block lead, after a blank line (or the previous item's
    indented definition, or a section's underline), with a more indented line right below it."""
    line = lines[i]
    if not line.strip() or i + 1 >= len(lines) or not lines[i + 1].strip():
        return False
    if _indent(lines[i + 1]) <= _indent(line):
        return False
    text = line.strip()
    if (LIST_ITEM.match(line) or text.startswith((">>>", "..", "$$", "|"))
            or text.endswith("::")):
        return False
    before = lines[i - 1] if i else ""
    return not before.strip() or _is_dash_line(before) or _indent(before) > _indent(line)


def definition_lists(lines: list[str]) -> list[str]:
    """reStructuredText definition lists, outside the sections in ``STRUCTURED``, as
    Markdown definition lists: the definition's first line after ``:   ``, the rest indented
    four under the term; a blank line between items, so no term runs into a definition."""
    out: list[str] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and _is_dash_line(lines[i + 1]):
            section = line.strip().lower()
            out += [line, lines[i + 1]]
            i += 2
            continue
        if section in STRUCTURED or not _is_term(lines, i):
            out.append(line)
            i += 1
            continue
        term_indent, body_indent = _indent(line), _indent(lines[i + 1])
        j = i + 1
        while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > term_indent):
            j += 1
        while j > i + 1 and not lines[j - 1].strip():
            j -= 1
        if out and out[-1].strip():
            out.append("")
        out.append(line)
        pad = " " * (term_indent + 4)
        for k, body_line in enumerate(lines[i + 1:j]):
            text = body_line[min(body_indent, _indent(body_line)):] if body_line.strip() else ""
            if k == 0:
                out.append(" " * term_indent + ":   " + text)
            else:
                out.append(pad + text if text else "")
        i = j
    return out


def _cells(line: str, starts: list[int]) -> list[str]:
    bounds = starts[1:] + [max(len(line), starts[-1])]
    return [line[a:b].strip() for a, b in zip(starts, bounds)]


def simple_tables(lines: list[str]) -> list[str]:
    """reStructuredText simple tables as Markdown tables: the columns are the runs of ``=``
    of the top border; a row whose first cell is empty continues the row above; rows
    between the first two of three borders are the header (none: an empty header row)."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        top = BORDER.match(lines[i])
        if not top:
            out.append(lines[i])
            i += 1
            continue
        starts = [m.start() for m in re.finditer(r"=+", lines[i])]
        borders = [i]
        j = i + 1
        while j < len(lines) and lines[j].strip() and len(borders) < 3:
            if BORDER.match(lines[j]):
                borders.append(j)
            j += 1
        if len(borders) < 2:
            out.append(lines[i])
            i += 1
            continue
        groups = [lines[a + 1:b] for a, b in zip(borders, borders[1:])]
        header, body = (groups[0], groups[1]) if len(groups) == 2 else ([], groups[0])
        rows: list[list[str]] = []
        for kind, group in (("header", header), ("body", body)):
            for line in group:
                cells = _cells(line, starts)
                if rows and not cells[0] and rows[-1][0] == kind:
                    rows[-1][1] = [f"{a} {b}".strip() for a, b in zip(rows[-1][1], cells)]
                else:
                    rows.append([kind, cells])
        pad = top.group(1)
        heads = [cells for kind, cells in rows if kind == "header"] or [[""] * len(starts)]
        if out and out[-1].strip():
            out.append("")
        for cells in heads:
            out.append(pad + "| " + " | ".join(cells) + " |")
        out.append(pad + "|" + "---|" * len(starts))
        out += [pad + "| " + " | ".join(cells) + " |" for kind, cells in rows if kind == "body"]
        out.append("")
        i = borders[-1] + 1
        while i < len(lines) and not lines[i].strip():
            i += 1
    return out


def _aligned_rows(lines: list[str], i: int) -> tuple[list[tuple[str, list[str]]], int] | None:
    """The rows ``(name, [text, continued lines...])`` of an aligned-columns (or fields)
    list that starts at ``lines[i]`` and the index after it, or None when the paragraph
    there is not one (every line a row or a continued line, two rows at least)."""
    first = ROW.match(lines[i]) or FIELD.match(lines[i])
    if not first or LIST_ITEM.match(lines[i]):
        return None
    indent = len(first.group(1))
    rows: list[tuple[str, list[str]]] = []
    j = i
    while j < len(lines) and lines[j].strip():
        row = ROW.match(lines[j]) or FIELD.match(lines[j])
        if _indent(lines[j]) == indent and row:
            rows.append((row.group(2), [row.group(3)]))
        elif _indent(lines[j]) > indent and rows:
            rows[-1][1].append(lines[j].strip())
        else:
            return None
        j += 1
    return (rows, j) if len(rows) >= 2 else None


def aligned_lists(lines: list[str]) -> list[str]:
    """Lists of aligned columns, outside the sections in ``STRUCTURED``, as Markdown
    definition lists (one item per row)."""
    out: list[str] = []
    section = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if i + 1 < len(lines) and line.strip() and _is_dash_line(lines[i + 1]):
            section = line.strip().lower()
        before = lines[i - 1] if i else ""
        found = None
        if section not in STRUCTURED and (not before.strip() or _is_dash_line(before)):
            found = _aligned_rows(lines, i)
        if found is None:
            out.append(line)
            i += 1
            continue
        rows, i = found
        pad = " " * _indent(line)
        for name, text in rows:
            out += [pad + name, pad + ":   " + text[0]] + [pad + "    " + t for t in text[1:]]
            out.append("")
    return out


def list_indentation(lines: list[str]) -> list[str]:
    """The lines of a list item's continued paragraphs (indented to the item's text, as
    reStructuredText has them) indented by four from the item's marker, as Markdown needs."""
    out: list[str] = []
    item: tuple[int, int] | None = None  # (marker indent, text indent) of the open item
    for line in lines:
        match = LIST_ITEM.match(line)
        if match:
            item = (len(match.group(1)), match.end() - 1)
            out.append(line)
            continue
        if item is not None and line.strip():
            if _indent(line) <= item[0]:
                item = None
            elif _indent(line) >= item[1] and item[1] - item[0] < 4:
                line = " " * (4 - (item[1] - item[0])) + line
        out.append(line)
    return out


def to_markdown(text: str) -> str:
    """``text`` with the reStructuredText markup above rewritten as Markdown."""
    # Tables first: their columns are where the border says, before roles shorten the text.
    lines = simple_tables(text.splitlines())
    lines = math_blocks(roles_to_markdown("\n".join(lines)).splitlines())
    return "\n".join(list_indentation(definition_lists(aligned_lists(lines))))


if griffe is not None:
    class RestructuredTextToMarkdown(griffe.Extension):
        """Rewrite every docstring (see the module docstring) as it is loaded."""

        def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
            if obj.docstring is not None:
                obj.docstring.value = to_markdown(obj.docstring.value)
