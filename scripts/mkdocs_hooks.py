"""MkDocs hook of the documentation build (``mkdocs.yml``: ``hooks``).

refdml installs ``gpu/`` as ``refdml.gpu`` and ``validation/`` as ``refdml.validation``
(``pyproject.toml``, ``package-dir``), a layout that griffe, which reads the sources for
mkdocstrings, cannot follow. Before the build starts, this hook copies the three source
trees into ``build/api-src/refdml`` laid out as they install; ``mkdocs.yml`` points
mkdocstrings there. The copy is made anew on every build, so the API reference is always
rendered from the working tree's sources, whether or not (and however) refdml is installed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGE = REPO / "build" / "api-src"


def stage_sources(stage: Path = STAGE) -> Path:
    """Copy ``refdml/``, ``gpu/`` and ``validation/`` into ``stage/refdml`` as installed."""
    if stage.exists():
        shutil.rmtree(stage)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "refdml", stage / "refdml", ignore=ignore)
    shutil.copytree(REPO / "gpu", stage / "refdml" / "gpu", ignore=ignore)
    shutil.copytree(REPO / "validation", stage / "refdml" / "validation", ignore=ignore)
    return stage


def on_startup(command: str, dirty: bool) -> None:
    # on_startup runs before the plugins read their configuration, so mkdocstrings finds
    # build/api-src in place (on_config would run after it: hooks come after plugins).
    stage_sources()
