"""scripts/mkdocs_math.py, the hook that writes the site's formulas as MathML at build time:
a formula becomes <math>, and one that latex2mathml cannot render fails with the page and the
formula named. Needs latex2mathml (the docs extra); skipped without it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("latex2mathml")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mkdocs_math", ROOT / "scripts" / "mkdocs_math.py")
math = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(math)


def test_arithmatex_markup_becomes_mathml():
    page = ('<p>clip <span class="arithmatex">\\(\\bar u = u / \\max(1, \\lVert u\\rVert)\\)'
            '</span></p><div class="arithmatex">\\[\\min_{\\rho} \\sum_{ij} c_{ij} &lt; 1\\]</div>')
    html = math.render(page, "papers/gsp.md")
    assert "arithmatex" not in html and "\\(" not in html and "\\[" not in html
    assert html.count("<math") == 2 and 'display="block"' in html
    assert "<munder><mi>min</mi>" in html  # display limits under \min, as TeX sets them
    assert "&#x0003C;" in html or "&lt;" in html  # the escaped < is maths, not markup


def test_arg_and_double_struck_one():
    mathml = math.to_mathml("\\mathbb{1}(i = \\arg\\max_k x_k)", display=False)
    assert "\\arg" not in mathml and "<mi>arg</mi>" in mathml and "&#x1D7D9;" in mathml


@pytest.mark.parametrize("tex", ["\\foo{x}", "\\begin{aligned}a &= b\\end{aligned}"])
def test_unconvertible_formula_names_page_and_formula(tex):
    page = f'<span class="arithmatex">\\({tex}\\)</span>'
    with pytest.raises(math.MathError, match=r"api/refdml\.gsp\.md: formula"):
        math.render(page, "api/refdml.gsp.md")
