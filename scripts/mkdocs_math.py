"""MkDocs hook of the documentation build: every formula rendered to MathML at build time.

``pymdownx.arithmatex`` (generic mode) marks the maths of the pages and of the docstrings
(which go through the same Markdown) as ``<span class="arithmatex">\\(...\\)</span>`` and
``<div class="arithmatex">\\[...\\]</div>``. This hook replaces each with the MathML that
``latex2mathml`` writes, so a browser shows the formulas with no script and no network: the
site works offline, from disk (``file://``), and behind a firewall.

latex2mathml passes a command it does not know through as text (``\\foo`` -> ``<mi>\\foo</mi>``)
and an alignment ``&`` outside a matrix as a letter; such output, or an exception, fails the
build with the page and the formula named, so a formula never reaches the site half-rendered.
Rewrite such a formula with the commands latex2mathml knows, or teach this hook the command in
``TEX_REWRITES`` (``scripts/docs_check.py`` checks the built site again).

Enabled in mkdocs.yml (``hooks: [scripts/mkdocs_math.py]``).
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

ARITHMATEX = re.compile(
    r'<span class="arithmatex">\\\((?P<inline>.*?)\\\)</span>'
    r'|<div class="arithmatex">\\\[(?P<block>.*?)\\\]</div>',
    flags=re.S)
# TeX that latex2mathml (3.81) does not know, as TeX that it does: (pattern, replacement).
TEX_REWRITES = ((re.compile(r"\\arg(?![A-Za-z])"), r"\\operatorname{arg}"),)
# In a display formula TeX sets the limits of \min, \max, \sup, \inf, \lim under them;
# latex2mathml writes a subscript unless told \limits.
DISPLAY_LIMITS = re.compile(r"(\\(?:min|max|sup|inf|lim))(?![A-Za-z])(?=\s*_)")
# MathML that browsers do not draw as TeX would: MathML Core ignores ``mathvariant`` but
# ``normal``, so the double-struck one is written as its Unicode letter.
MATHML_REWRITES = (('<mn mathvariant="double-struck">1</mn>', "<mn>&#x1D7D9;</mn>"),)
# A function name (\log, \max, \operatorname{softmax}): latex2mathml writes <mo> (which
# browsers space as an unknown operator, "max (1, x)") or <mi>. As TeX sets it: upright,
# a thin space before what follows unless that is a bracket; none inside a sub/superscript
# base (which must keep exactly two children).
FUNCTION = re.compile(r"(?P<base><m(?:sub|sup|subsup|under|over|underover)>)?"
                      r"<(?P<tag>mo|mi)>(?P<name>[A-Za-z]{2,})</(?P=tag)>"
                      r"(?P<bracket>(?=<mo[^>]*>(?:[(\[{|]|&#x0002[89];|&#x0005B;|&#x0007B;)))?")
# What latex2mathml writes for TeX it did not understand.
UNCONVERTED = re.compile(r"<m(?:i|o|n|text)>(?:\\|&amp;</|&</)")


class MathError(ValueError):
    """A formula that latex2mathml cannot render faithfully."""


def to_mathml(tex: str, *, display: bool) -> str:
    """The MathML of the TeX ``tex`` (``display``: a block formula); MathError when
    latex2mathml fails or leaves part of it unconverted."""
    for pattern, replacement in TEX_REWRITES:
        tex = pattern.sub(replacement, tex)
    if display:
        tex = DISPLAY_LIMITS.sub(r"\1\\limits", tex)
    try:
        mathml = convert(tex, display="block" if display else "inline")
    except Exception as error:  # latex2mathml raises many kinds: report them all alike
        raise MathError(f"{type(error).__name__}: {error}") from error
    bad = UNCONVERTED.search(mathml)
    if bad:
        context = mathml[bad.start():bad.start() + 40]
        raise MathError(f"left unconverted: {context!r} (a command or '&' latex2mathml "
                        "does not know)")
    for before, after in MATHML_REWRITES:
        mathml = mathml.replace(before, after)
    return FUNCTION.sub(_function, mathml)


def _function(match: re.Match) -> str:
    token = f"<mi>{match.group('name')}</mi>"
    if match.group("base"):
        return match.group("base") + token
    return token if match.group("bracket") is not None else token + '<mspace width="0.1667em" />'


def render(page_html: str, where: str) -> str:
    """``page_html`` with every arithmatex formula replaced by MathML; MathError naming
    ``where`` and the formula on the first one that does not convert."""
    def replace(match: re.Match) -> str:
        display = match.group("block") is not None
        tex = html.unescape(match.group("block") if display else match.group("inline")).strip()
        try:
            mathml = to_mathml(tex, display=display)
        except MathError as error:
            raise MathError(f"{where}: formula {tex!r}: {error}") from None
        return f'<div class="refdml-math">{mathml}</div>' if display else mathml

    return ARITHMATEX.sub(replace, page_html)


def on_page_content(html_text: str, page, **kwargs) -> str:
    from mkdocs.exceptions import PluginError  # the build's; the functions above need none

    try:
        return render(html_text, page.file.src_uri)
    except MathError as error:
        raise PluginError(f"mkdocs_math: {error}") from None
