"""Every Python block of docs/conformance.md runs as written (the PyTorch ones only where PyTorch is installed: CI has JAX, not PyTorch)."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "conformance.md"


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


BLOCKS = [(f"docs/conformance.md block {k}", b)
          for k, b in enumerate(_blocks(PAGE.read_text(encoding="utf-8")))]


def test_the_examples_are_there():
    names = [name for name, _ in BLOCKS]
    assert len(names) == 3, names
    assert any("import torch" in b for _, b in BLOCKS)
    assert any("import jax" in b for _, b in BLOCKS)


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs(name, block, capsys):
    for framework in ("torch", "jax"):
        if f"import {framework}" in block and importlib.util.find_spec(framework) is None:
            pytest.skip(f"{framework} is not installed")
    exec(compile(block, name, "exec"), {"__name__": "doc"})
    assert capsys.readouterr().out.strip()
