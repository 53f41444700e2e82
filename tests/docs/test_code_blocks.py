"""Every Python example of README.md and of the guides runs as written, so that an example
cannot drift from the API.

A page's ```python blocks run in order in one namespace (as a reader runs them), in a
temporary working directory. A block that imports an optional framework (torch, jax, cupy)
is skipped, with the reason, where that framework is not installed. Generated pages (the API
reference, results, benchmarks, runs' reports) hold no examples and are left out.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
OPTIONAL = ("torch", "jax", "cupy")
GENERATED = ("api", "results", "reproduce_full", "reproduce_quick")
# Pages whose blocks have tests of their own, which also compare the output a block prints
# with the output the page shows (running them twice would only cost time).
OWN_TESTS = {
    "docs/gradcheck.md": "tests/gradcheck/test_gradcheck_docs.py",
    "docs/conformance.md": "tests/conformance/test_conformance_docs.py",
}


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        if page.relative_to(ROOT / "docs").parts[0] not in GENERATED:
            found.append(page)
    return found


def blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


PAGES_WITH_BLOCKS = [p for p in pages() if blocks(p) and _name(p) not in OWN_TESTS]


def test_the_examples_are_found():
    # The extractor finds the examples this suite relies on; a change of fence style (or a
    # page moved) that hid them would otherwise pass silently.
    names = {_name(p) for p in PAGES_WITH_BLOCKS}
    assert {"README.md", "docs/getting-started.md"} <= names, names
    assert len(blocks(ROOT / "README.md")) >= 2
    for page, test in OWN_TESTS.items():
        assert blocks(ROOT / page), page
        assert (ROOT / test).exists(), test


def test_every_fenced_block_is_closed():
    # An unclosed fence would swallow the rest of a page into one block.
    for page in pages():
        fences = [line for line in page.read_text(encoding="utf-8").splitlines()
                  if line.startswith("```")]
        assert len(fences) % 2 == 0, f"{_name(page)}: an unclosed ``` fence"


@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=_name)
def test_page_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    for k, block in enumerate(blocks(page)):
        for framework in OPTIONAL:
            if (re.search(rf"^\s*(import|from) {framework}\b", block, flags=re.M)
                    and importlib.util.find_spec(framework) is None):
                pytest.skip(f"{_name(page)} block {k} needs {framework}, which is not installed")
        exec(compile(block, f"{_name(page)} block {k}", "exec"), namespace)
    # Every example shows the reader something: a block that prints nothing is not one.
    assert capsys.readouterr().out.strip()


def test_readme_links_point_at_files_that_exist():
    # README is not part of the site, so the strict build does not check its links.
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "README links to the documentation"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, missing
