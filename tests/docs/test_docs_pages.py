"""The generated pages of the site (scripts/docs_pages.py): up to date with the code and with
the JSON of the runs, an API entry for every public name, and refusals that name the file."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "docs_pages.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pages = _load("docs_pages", SCRIPT)


def test_generated_pages_are_up_to_date():
    # A changed __all__, a new run's JSON or a hand edit of a generated page, without
    # `python scripts/docs_pages.py` run again, fails here.
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# --- every public name has its API entry ----------------------------------------------------


def _public_modules_from_the_files() -> dict[str, list[str]]:
    """Public modules with an ``__all__``, found by reading the source files (not by
    importing them, as the generator does): module name -> the names of its ``__all__``."""
    roots = {"refdml": ROOT / "refdml"}
    found = {}
    for prefix, folder in roots.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([prefix] + parts)
            if any(p.startswith("_") for p in name.split(".")):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in tree.body:
                targets = (node.targets if isinstance(node, ast.Assign)
                           else [node.target] if isinstance(node, ast.AnnAssign) else [])
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    try:
                        found[name] = list(ast.literal_eval(node.value))
                    except ValueError:  # built from other lists (``[*a.__all__, ...]``)
                        found[name] = list(importlib.import_module(name).__all__)
    return found


def _entries(page: Path) -> tuple[str, list[str]]:
    """The module of an API page, and the names it renders or links to (its submodules)."""
    text = page.read_text(encoding="utf-8")
    module = re.search(r"^::: (\S+)$", text, flags=re.M).group(1)
    members = re.findall(r"^        - (\S+)$", text, flags=re.M)
    linked = re.findall(rf"^- \[`{re.escape(module)}\.([^`]+)`\]", text, flags=re.M)
    return module, members + linked


def test_every_public_name_has_an_api_entry():
    expected = _public_modules_from_the_files()
    assert {"refdml", "refdml.losses", "refdml.gpu.ot", "refdml.validation"} <= set(expected)
    rendered = dict(_entries(p) for p in (ROOT / "docs" / "api").glob("refdml*.md"))
    missing = {m: sorted(set(names) - set(rendered.get(m, [])))
               for m, names in expected.items() if set(names) - set(rendered.get(m, []))}
    assert not missing, missing
    assert set(rendered) == set(expected)
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for module in expected:
        assert f"api/{module}.md" in nav, module


# --- the results come from the JSON ---------------------------------------------------------


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split(" | ")]
            for line in text.splitlines() if line.startswith("| `")]


def test_verify_page_holds_every_verdict_of_the_json():
    run = json.loads((ROOT / "docs" / "results" / "verify.json").read_text(encoding="utf-8"))
    # The verdict table is the page's only table of four columns.
    rows = {r[0].strip("`"): r for r in
            _table_rows((ROOT / "docs" / "results" / "verify.md").read_text(encoding="utf-8"))
            if len(r) == 4}
    assert len(run["claims"]) >= 20
    for claim in run["claims"]:
        assert rows[claim["id"]][2] == claim["verdict"], claim["id"]


def test_paper_pages_hold_their_papers_verdicts_only():
    run = json.loads((ROOT / "docs" / "results" / "verify.json").read_text(encoding="utf-8"))
    for paper in ("gsp", "xml", "asap", "wdml"):
        text = (ROOT / "docs" / "papers" / f"{paper}.md").read_text(encoding="utf-8")
        region = text.split("<!-- generated:verdicts:start -->")[1].split(
            "<!-- generated:verdicts:end -->")[0]
        ids = set(re.findall(r"^\| `([a-z]+\.[^`]+)`", region, flags=re.M))
        claims = {c["id"] for c in run["claims"] if c["id"].startswith(paper + ".")}
        assert claims and claims <= ids, paper
        assert all(i.startswith(paper + ".") for i in ids), paper


def test_reproduce_table_cells_come_from_the_json():
    full = json.loads((ROOT / "docs" / "reproduce_full" / "results.json").read_text("utf-8"))
    text = (ROOT / "docs" / "results" / "reproduce.md").read_text(encoding="utf-8")
    rows = text.splitlines()
    for experiment in full["experiments"]:
        for c in experiment["comparisons"]:
            if c["low"] is None:
                continue
            # the trust table: the comparison, its effect and interval ... its verdict
            cell = f"| {c['name']} | {c['effect']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] |"
            matching = [r for r in rows if cell in r]
            assert matching, (experiment["id"], c["name"])
            assert all(r.endswith(f"| {c['verdict']} |") for r in matching), c["name"]


# --- refusals ------------------------------------------------------------------------------


def test_a_region_without_its_markers_is_refused_naming_the_file():
    with pytest.raises(pages.PagesError, match="docs/x.md: needs one line"):
        pages.replace_region("no markers here\n", "verdicts", "body", "docs/x.md")
    twice = "<!-- generated:v:start -->\n<!-- generated:v:end -->\n" * 2
    with pytest.raises(pages.PagesError, match="needs one line"):
        pages.replace_region(twice, "v", "body", "docs/x.md")
    text = "a\n<!-- generated:v:start -->\nold\n<!-- generated:v:end -->\nb\n"
    assert pages.replace_region(text, "v", "new\n", "p") == (
        "a\n<!-- generated:v:start -->\nnew\n<!-- generated:v:end -->\nb\n")


def test_a_benchmark_file_of_another_schema_is_refused(tmp_path):
    bad = tmp_path / "bench_x.json"
    bad.write_text(json.dumps({"tables": []}), encoding="utf-8")
    with pytest.raises(pages.PagesError, match="not a refdml-bench/1 document"):
        pages.benchmarks_region([bad])


def test_a_killed_write_leaves_the_old_page(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("old\n", encoding="utf-8")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pages.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        pages.write_atomic(page, "new\n")
    assert page.read_text(encoding="utf-8") == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["page.md"]
