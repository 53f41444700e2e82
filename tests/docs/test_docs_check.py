"""scripts/docs_check.py, the checks of the built site, on small pages: each check passes a
page as the build now writes it and fails a page with the defect it guards against (the
defects of the site before issue 38: TeX left for a CDN script, ``$$`` blocks shown as code,
raw roles, run-on definition lists, CDN scripts, folder links, no offline search index)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_check", ROOT / "scripts" / "docs_check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

MATHML = ('<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline"><mrow><mi>u</mi>'
          "</mrow></math>")


# --- maths ----------------------------------------------------------------------------------

def test_rendered_maths_passes():
    html = f"<p>The clip {MATHML} and <code>\\frac</code> in code.</p><pre>\\[x\\]</pre>"
    assert check.maths_problems(html, "p.html", needs_math=True) == []


def test_tex_left_for_a_script_fails():
    # Today's paper pages: arithmatex's markup, which only a CDN script would render.
    html = ('<p>with <span class="arithmatex">\\(\\bar u = u / \\max(1, \\lVert u\\rVert)\\)'
            "</span></p>")
    found = check.maths_problems(html, "papers/gsp.html", needs_math=True)
    assert any("TeX source" in p and "papers/gsp.html" in p for p in found)
    assert any("arithmatex" in p for p in found)
    assert any("no <math>" in p for p in found)


def test_display_maths_as_a_code_block_fails():
    # Today's API pages: a `.. math::` block became a literal code block holding $$ ... $$.
    html = ('<div class="highlight"><pre><span></span><code>$$\n\\min_{\\rho} c\n$$\n'
            "</code></pre></div>")
    found = check.maths_problems(html, "api/refdml.gsp.html")
    assert any("code block" in p for p in found)


def test_bare_tex_commands_fail():
    for text in ("$$ x $$", "a \\frac{1}{2} b", "\\[ y \\]"):
        assert check.maths_problems(f"<p>{text}</p>", "p.html"), text


# --- reStructuredText -----------------------------------------------------------------------

def test_rendered_docstring_passes():
    html = ("<p>Fast-path mirror of <code>refdml.crossbatch</code>.</p>"
            "<dl><dt><code>cost_map_forward</code></dt>\n<dd>the cost</dd></dl>"
            "<ul><li><p>an item\n    continued</p></li></ul>"
            "<pre><code>:func:`x` and .. math:: in a code block\n</code></pre>")
    assert check.rst_problems(html, "api/index.html") == []


def test_raw_role_fails():
    # Today's API index.
    html = "<td>Fast-path mirror of :mod:<code>refdml.crossbatch</code> (NumPy)</td>"
    found = check.rst_problems(html, "api/index.html")
    assert found and "role" in found[0] and "api/index.html" in found[0]


def test_raw_directive_and_table_border_fail():
    assert check.rst_problems("<p>.. math:: x = 1</p>", "p.html")
    assert check.rst_problems("<p>=====  =====\n<code>a</code>  b\n=====  =====</p>", "p.html")


def test_definition_list_run_into_a_paragraph_fails():
    # Today's "Operators" list of refdml.gsp: terms and indented definitions in one <p>.
    html = ("<p><code>cost_map_forward</code> (GSP Alg. 2)\n    <code>c_ij</code> the cost.\n"
            "<code>solve_p1_linprog</code> (GSP (P1))\n    The LP.</p>")
    found = check.rst_problems(html, "api/refdml.gsp.html")
    assert found and "paragraph" in found[0]


# --- offline --------------------------------------------------------------------------------

def test_local_resources_pass():
    html = ('<link rel="stylesheet" href="assets/main.css"><script src="assets/bundle.js">'
            '</script><a href="https://github.com/x">repo</a>'
            '<link rel="canonical" href="https://example.org/x.html">')
    assert check.offline_problems(html, "index.html") == []


def test_cdn_scripts_and_fonts_fail():
    # Today's site: KaTeX from jsDelivr, Roboto from Google Fonts, the offline plugin's shim
    # from unpkg.
    for html in ('<script src="https://cdn.jsdelivr.net/npm/katex@0.16.22/dist/katex.min.js">',
                 '<link rel="stylesheet" href="https://fonts.googleapis.com/css?family=Roboto">',
                 '<link rel="preconnect" href="https://fonts.gstatic.com" crossorigin>',
                 '<script src="https://unpkg.com/iframe-worker/shim"></script>',
                 '<script src="//cdn.example.org/x.js"></script>'):
        found = check.offline_problems(html, "index.html")
        assert found and "offline" in found[0], html


# --- links and search -----------------------------------------------------------------------

def _site(tmp_path: Path) -> Path:
    (tmp_path / "papers").mkdir()
    (tmp_path / "papers" / "gsp.html").write_text("x", encoding="utf-8")
    (tmp_path / "index.html").write_text("x", encoding="utf-8")
    return tmp_path


def test_links_to_files_pass(tmp_path):
    site = _site(tmp_path)
    html = ('<a href="papers/gsp.html#eq-1">GSP</a><a href="#top">top</a>'
            '<a href="mailto:a@b.c">m</a><img src="papers/gsp.html?v=1">')
    assert check.link_problems(html, site / "index.html", site) == []


def test_folder_missing_and_absolute_links_fail(tmp_path):
    # Today's nav links end in a folder ("papers/"): from disk, a directory listing.
    site = _site(tmp_path)
    found = check.link_problems('<a href="papers/">GSP</a><a href="nope.html">x</a>'
                                '<a href="/papers/gsp.html">y</a>', site / "index.html", site)
    assert len(found) == 3
    assert any("papers/ is not a file (a folder)" in p for p in found)
    assert any("missing" in p for p in found) and any("absolute" in p for p in found)


def test_search_index_for_file_urls(tmp_path):
    assert check.search_problems(tmp_path)  # today: only search_index.json, no script
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "search_index.js").write_text('var __index = {"docs": []}',
                                                          encoding="utf-8")
    assert check.search_problems(tmp_path) == []
