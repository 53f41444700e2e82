"""Check the built documentation site: every public name has its rendered API entry, and the
maths is marked up for KaTeX.

    mkdocs build --strict && python scripts/docs_check.py site

`mkdocs build --strict` already fails on a broken link, a missing reference or a docstring
that griffe cannot parse; this script checks what a strict build lets through: an entry
that rendered nothing (a name that mkdocstrings silently skipped), and a maths page whose
formulas were left as plain text. Standard library only (no refdml import: it reads the
``__all__`` lists from the generated pages' sources, docs/api/*.md).

Exit statuses: 0 all present, 1 something is missing (each one named), 2 bad arguments.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH_PAGES = ("papers/gsp", "papers/xml", "papers/asap", "papers/wdml")


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


def problems(site: Path, docs: Path = ROOT / "docs") -> list[str]:
    found = []
    entries = api_entries(docs)
    if not entries:
        return [f"{docs / 'api'}: no API pages"]
    for module, (names, submodules) in entries.items():
        html = site / "api" / module / "index.html"
        if not html.exists():
            found.append(f"{module}: no page {html}")
            continue
        ids = set(re.findall(r'id="([^"]+)"', html.read_text(encoding="utf-8")))
        found += [f"{module}.{name}: no rendered entry in {html}"
                  for name in names if f"{module}.{name}" not in ids]
        found += [f"{sub}: linked from {module} but has no page"
                  for sub in submodules if not (site / "api" / sub / "index.html").exists()]
    for page in MATH_PAGES:
        html = site / page / "index.html"
        if not html.exists():
            found.append(f"{page}: not built")
        elif 'class="arithmatex"' not in html.read_text(encoding="utf-8"):
            found.append(f"{page}: no maths marked up for KaTeX (class=\"arithmatex\")")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python scripts/docs_check.py SITE_DIR (the folder mkdocs built)",
              file=sys.stderr)
        return 2
    found = problems(Path(argv[0]))
    for problem in found:
        print(f"docs_check: {problem}")
    n = sum(len(names) + len(subs) for names, subs in api_entries(ROOT / "docs").values())
    print(f"docs_check: {n} API entries and {len(MATH_PAGES)} maths pages checked, "
          f"{len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
