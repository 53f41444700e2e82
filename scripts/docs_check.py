"""Check the built documentation site: every public name has its rendered API entry, the
maths is rendered (MathML, no TeX left), no reStructuredText is left raw, and the site works
offline and from disk.

    mkdocs build --strict && python scripts/docs_check.py site

`mkdocs build --strict` already fails on a broken link, a missing reference or a docstring
that griffe cannot parse; this script checks what a strict build lets through:

- an API entry that rendered nothing (a name that mkdocstrings silently skipped);
- maths left as TeX source (``\\(``, ``\\[``, ``$$``, ``\\frac`` ... outside code), or a maths
  page with no ``<math>`` element;
- reStructuredText left raw: a role (``:mod:``, ``:func:``, ``:math:`` ...), a directive
  (``.. math::``), a simple table's ``=====  =====`` border, or a definition list run into
  one paragraph (an indented line inside a paragraph);
- a script, stylesheet, font or image loaded from the network (``http(s)://``);
- an internal link or resource that is not an existing file (a folder URL gives a directory
  listing when the site is opened from disk);
- no offline search index (``search/search_index.js`` of Material's ``offline`` plugin).

Standard library only (no refdml import: it reads the ``__all__`` lists from the generated
pages' sources, docs/api/*.md). Every check is a function of a page's HTML (or the site
folder) returning a list of problems, each naming the page; tests/docs/test_docs_check.py
runs them on small snippets.

Exit statuses: 0 all present, 1 something is missing (each one named), 2 bad arguments.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
# Pages that must hold rendered maths: the papers, and API pages whose docstrings have
# ``.. math::`` blocks.
MATH_PAGES = ("papers/gsp.html", "papers/xml.html", "papers/asap.html", "papers/wdml.html",
              "api/refdml.gsp.html", "api/refdml.train.plots.html")
SEARCH_SCRIPT = "search/search_index.js"

_HIDDEN = re.compile(r"<(script|style|pre|math|textarea)\b.*?</\1>", flags=re.S | re.I)
_CODE = re.compile(r"<code\b.*?</code>", flags=re.S | re.I)
_TAG = re.compile(r"<[^>]+>")
# A display-maths block shown as code (a ``$$`` line inside <pre>).
MATH_AS_CODE = re.compile(r"<pre\b(?:(?!</pre>).)*?(?:>|\n)\$\$[ \t]*(?:\n|<)", flags=re.S)
TEX = re.compile(r"\\[()\[\]]|\$\$|\\[A-Za-z]{2,}")
ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj|math|ref|doc|term):(?=\S)")
DIRECTIVE = re.compile(r"\.\. [a-z][\w-]*::")
TABLE_BORDER = re.compile(r"={3,} +={3,}")
# An indented line, then a line back at the margin, in one paragraph: "term / indented
# definition / next term" read as text. (A list item's continued lines are all indented.)
RUN_ON = re.compile(r"<p>(?:(?!</p>).)*?\n {4,}\S(?:(?!</p>).)*?\n\S", flags=re.S)
_RESOURCE = re.compile(r"<(script|link|img|iframe|source)\b[^>]*?\b(?:src|href)=\"([^\"]*)\"",
                       flags=re.I)
_LINK = re.compile(r"\b(?:href|src)=\"([^\"]*)\"", flags=re.I)
_REMOTE = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", flags=re.I)
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", flags=re.I)


def visible_text(html: str, *, keep_code: bool = False) -> str:
    """The text a reader sees outside ``<pre>``, ``<math>``, scripts and styles (and outside
    ``<code>``, unless ``keep_code``; a code element leaves a backtick in its place)."""
    text = _HIDDEN.sub(" ", html)
    if not keep_code:
        text = _CODE.sub("`", text)
    return _TAG.sub("", text)


def _excerpt(text: str, match: re.Match) -> str:
    return " ".join(text[max(0, match.start() - 30):match.end() + 30].split())


def maths_problems(html: str, where: str, *, needs_math: bool = False) -> list[str]:
    """TeX source where rendered maths should be (outside code, pre and math elements);
    with ``needs_math``, also a page without any ``<math>`` element."""
    found = []
    text = visible_text(html)
    for match in list(TEX.finditer(text))[:3]:
        found.append(f"{where}: TeX source left unrendered: {_excerpt(text, match)!r}")
    if MATH_AS_CODE.search(html):
        found.append(f"{where}: a display formula shown as a code block ($$ inside <pre>)")
    if 'class="arithmatex"' in html:
        found.append(f"{where}: maths left for a script to render (class=\"arithmatex\")")
    if needs_math and "<math" not in html:
        found.append(f"{where}: no rendered maths (no <math> element)")
    return found


def rst_problems(html: str, where: str) -> list[str]:
    """reStructuredText left raw: roles, directives, simple-table borders, and a definition
    list run into a paragraph (inside a <p>, a line indented by four or more and a line at
    the margin after it)."""
    found = []
    text = visible_text(html)
    for pattern, what in ((ROLE, "role"), (DIRECTIVE, "directive"),
                          (TABLE_BORDER, "simple-table border")):
        for match in list(pattern.finditer(text))[:3]:
            found.append(f"{where}: raw reStructuredText {what}: {_excerpt(text, match)!r}")
    for match in list(RUN_ON.finditer(_HIDDEN.sub(" ", html)))[:3]:
        tail = " ".join(_TAG.sub("", match.group(0))[-80:].split())
        found.append(f"{where}: an indented line run into a paragraph (a definition list "
                     f"or table read as text?): {tail!r}")
    return found


def offline_problems(html: str, where: str) -> list[str]:
    """Scripts, stylesheets, fonts, images or frames loaded from the network."""
    return [f"{where}: <{tag}> loads {url} (the site must work offline)"
            for tag, url in _RESOURCE.findall(html)
            if _REMOTE.match(url) and not (tag.lower() == "link" and _is_plain_link(html, url))]


def _is_plain_link(html: str, url: str) -> bool:
    """Whether every <link> to ``url`` is a plain reference (canonical, alternate), not a
    resource the browser fetches."""
    rels = re.findall(r"<link\b[^>]*?rel=\"([^\"]*)\"[^>]*?href=\"" + re.escape(url) + "\"", html)
    return bool(rels) and all(rel in ("canonical", "alternate", "author", "license")
                              for rel in rels)


def link_problems(html: str, page: Path, site: Path) -> list[str]:
    """Internal links and resources of ``page`` (a file under ``site``) that are not an
    existing file: opened from disk, a folder URL shows a directory listing."""
    found = []
    where = page.relative_to(site).as_posix()
    for url in sorted(set(_LINK.findall(html))):
        if not url or url.startswith("#") or _REMOTE.match(url) or _SCHEME.match(url):
            continue
        path = unquote(re.split(r"[#?]", url, maxsplit=1)[0])
        if not path:
            continue
        if path.startswith("/"):
            found.append(f"{where}: link {url} is absolute (on file:// it leaves the site)")
            continue
        target = (page.parent / path).resolve()
        if not target.is_file():
            kind = "a folder" if target.is_dir() else "missing"
            found.append(f"{where}: link {url} is not a file ({kind})")
    return found


def search_problems(site: Path) -> list[str]:
    """The offline search index: the search index inlined into a script (Material's offline
    plugin), which a page opened from disk can load, where it cannot fetch the JSON."""
    script = site / SEARCH_SCRIPT
    if not script.is_file():
        return [f"{SEARCH_SCRIPT}: missing (search needs http without it: enable the "
                "'offline' plugin)"]
    with script.open(encoding="utf-8") as handle:
        head = handle.read(64)
    if not head.startswith("var __index ="):
        return [f"{SEARCH_SCRIPT}: not the offline plugin's index ({head[:30]!r})"]
    return []


def api_entries(docs: Path) -> dict[str, tuple[list[str], list[str]]]:
    """Module -> the names its API page asks mkdocstrings to render, and the submodules it
    links to (names of ``__all__`` that are modules get their own page)."""
    entries = {}
    for page in sorted((docs / "api").glob("refdml*.md")):
        text = page.read_text(encoding="utf-8")
        module = re.search(r"^::: (\S+)$", text, flags=re.M).group(1)
        entries[module] = (re.findall(r"^        - (\S+)$", text, flags=re.M),
                           re.findall(r"^- \[`([^`]+)`\]\(\1\.md\)", text, flags=re.M))
    return entries


def api_problems(site: Path, docs: Path) -> list[str]:
    found = []
    entries = api_entries(docs)
    if not entries:
        return [f"{docs / 'api'}: no API pages"]
    for module, (names, submodules) in entries.items():
        html = site / "api" / f"{module}.html"
        if not html.exists():
            found.append(f"{module}: no page {html}")
            continue
        ids = set(re.findall(r'id="([^"]+)"', html.read_text(encoding="utf-8")))
        found += [f"{module}.{name}: no rendered entry in {html}"
                  for name in names if f"{module}.{name}" not in ids]
        found += [f"{sub}: linked from {module} but has no page"
                  for sub in submodules if not (site / "api" / f"{sub}.html").exists()]
    return found


def problems(site: Path, docs: Path = ROOT / "docs") -> list[str]:
    found = api_problems(site, docs)
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return found + [f"{site}: no HTML pages"]
    for page in MATH_PAGES:
        if not (site / page).is_file():
            found.append(f"{page}: not built")
    for page in pages:
        where = page.relative_to(site).as_posix()
        html = page.read_text(encoding="utf-8")
        found += maths_problems(html, where, needs_math=where in MATH_PAGES)
        found += rst_problems(html, where)
        found += offline_problems(html, where)
        if where != "404.html":  # a web server's error page: its links are from the root
            found += link_problems(html, page, site)
    for css in sorted(site.rglob("*.css")):
        for url in re.findall(r"(?:@import\s+|url\()\s*[\"']?((?:https?:)?//[^\"')\s]+)",
                              css.read_text(encoding="utf-8")):
            found.append(f"{css.relative_to(site).as_posix()}: loads {url} (the site must "
                         "work offline)")
    return found + search_problems(site)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/docs_check.py SITE_DIR (the folder mkdocs built)",
              file=sys.stderr)
        return 2
    site = Path(argv[0])
    found = problems(site)
    for problem in found:
        print(f"docs_check: {problem}")
    n = sum(len(names) + len(subs) for names, subs in api_entries(ROOT / "docs").values())
    print(f"docs_check: {n} API entries and {len(list(site.rglob('*.html')))} pages checked "
          f"(maths, reStructuredText, offline resources, links, search), "
          f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
