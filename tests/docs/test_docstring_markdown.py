"""scripts/mkdocs_griffe_rst.py: the reStructuredText of the docstrings, as the Markdown the
site renders. Each case is a defect of the site before issue 38 (a definition list run into
one paragraph, a ``.. math::`` block shown as code, a simple table read as a heading, raw
roles in the API index)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rst = _load("mkdocs_griffe_rst", ROOT / "scripts" / "mkdocs_griffe_rst.py")

OPERATORS = inspect.cleandoc(r"""
    Pooling.

    Operators (one private module each)
    -----------------------------------
    ``cost_map_forward`` / ``cost_map_backward`` (GSP Alg. 2)
        ``c_ij = || wbar_i - fbar_j ||``.
    ``weight_transport`` / ``weight_transport_backward``
        (GSP (P2)) The entropic problem

        .. math::
            \min_{\rho} \sum_{ij} c_{ij}

            + \rho

        solved in the log domain.
    ``gsp_pool_forward`` (GSP Alg. 2)
        pooled feature.

    Parameters
    ----------
    x : ndarray
        The input.
        More about it.
    """)


def test_definition_list_becomes_markdown_definitions():
    lines = rst.to_markdown(OPERATORS).splitlines()
    # Each term is its own item: a blank line before it, its definition after ":   ".
    for term in ("``cost_map_forward``", "``weight_transport``", "``gsp_pool_forward``"):
        i = next(k for k, line in enumerate(lines) if line.startswith(term))
        assert lines[i + 1].startswith(":   "), lines[i:i + 2]
        assert i < 2 or not lines[i - 1].strip() or set(lines[i - 1]) == {"-"}
    # The maths of a definition stays inside it (indented four, not a code block of its own)
    # and has no blank line, which would end the Markdown block.
    start = lines.index("    $$")
    end = lines.index("    $$", start + 1)
    assert all(line.startswith("    ") and line.strip() for line in lines[start:end + 1])
    assert "    solved in the log domain." in lines


def test_numpy_sections_are_left_to_griffe():
    text = rst.to_markdown(OPERATORS)
    assert "x : ndarray\n    The input.\n    More about it." in text


def test_math_directive_outside_a_list():
    text = rst.to_markdown("Text.\n\n.. math:: y = \\frac{x}{2}\n\nMore.")
    assert "$$\ny = \\frac{x}{2}\n$$" in text and ".. math::" not in text


def test_simple_table_becomes_a_markdown_table():
    doc = inspect.cleandoc("""
        Losses.

        ========  ==============  =====
        loss      term            on
        ========  ==============  =====
        ``a``     :func:`f` and   ``d``
                  more
        ``b``     x               ``s``
        ========  ==============  =====
        """)
    lines = rst.to_markdown(doc).splitlines()
    assert "| loss | term | on |" in lines
    assert "|---|---|---|" in lines
    assert "| ``a`` | `f` and more | ``d`` |" in lines
    assert not any("====" in line for line in lines)


def test_aligned_columns_and_fields_become_definitions():
    doc = inspect.cleandoc("""
        Metrics:

        ``precision_at_1``   ``c_i(1)``
        ``recall_at_k``      ``max c_i(j)`` (at least one
                             true reference)

        indices : (k,) selected elements.
        weights : (k,) how many each serves
            (ties go to the earlier pick).
        """)
    lines = rst.to_markdown(doc).splitlines()
    assert lines[lines.index("``recall_at_k``") + 1] == ":   ``max c_i(j)`` (at least one"
    assert "    true reference)" in lines
    assert lines[lines.index("weights") + 1] == ":   (k,) how many each serves"


def test_list_continuation_is_indented_four():
    doc = "1. first\n\n   .. math::\n       x\n\n   after\n2. second"
    lines = rst.to_markdown(doc).splitlines()
    assert "    $$" in lines and "    after" in lines


def test_roles_in_the_api_index():
    pages = _load("docs_pages_for_roles", ROOT / "scripts" / "docs_pages.py")
    module = types.ModuleType("fake")
    module.__doc__ = "Fast-path mirror of :mod:`refdml.crossbatch` and :func:`~x.y`.\n\nMore."
    assert pages.summary(module) == "Fast-path mirror of `refdml.crossbatch` and `x.y`."
    assert sys.modules.get("fake") is None
