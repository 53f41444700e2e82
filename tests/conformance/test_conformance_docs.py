"""Every Python block of docs/conformance.md runs as written (the PyTorch ones only where
PyTorch is installed: CI has JAX, not PyTorch), the output the page shows is the output it
prints, and the pytest example runs under pytest's own ``pytester`` with the outcome the
page states."""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "conformance.md"


TEXT = PAGE.read_text(encoding="utf-8")


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


BLOCKS = [(f"docs/conformance.md block {k}", b) for k, b in enumerate(_blocks(TEXT))]
BFLOAT16 = next(b for _, b in BLOCKS if 'dtype="bfloat16"' in b)
PYTEST_EXAMPLE = re.search(r'```python title="test_mylosses.py"\n(.*?)```', TEXT, re.S).group(1)


def test_the_examples_are_there():
    names = [name for name, _ in BLOCKS]
    assert len(names) == 4, names
    assert any("import torch" in b for _, b in BLOCKS)
    assert any("import jax" in b for _, b in BLOCKS)
    assert "@pytest.mark.refdml_conform(" in PYTEST_EXAMPLE


def test_the_bfloat16_verdict_shown_is_the_one_printed(capsys):
    pytest.importorskip("jax")
    exec(compile(BFLOAT16, "docs/conformance.md bfloat16 block", "exec"), {"__name__": "doc"})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    shown = re.search(r"```\n(FAIL losses\.contrastive \(jax, bfloat16\).*?)\n```", TEXT).group(1)
    assert printed.startswith(shown), (printed, shown)


def test_the_pytest_example_runs_with_the_outcome_shown(jax_first, pytester):
    # The user's package: the loss of the bfloat16 section (its definitions, not its checks).
    module = BFLOAT16.split("\ngood = ")[0]
    pytester.makepyfile(mylosses=module, test_mylosses=PYTEST_EXAMPLE)
    result = pytester.runpytest("-v", "-rs", "-p", "no:cacheprovider")
    shown = re.search(r"=+ (\d+) passed, (\d+) skipped =+", TEXT)
    result.assert_outcomes(passed=int(shown.group(1)), skipped=int(shown.group(2)))
    out = result.stdout.str()
    for line in re.findall(r"^(test_mylosses\.py::\S+ PASSED)$", TEXT, re.M):
        assert line in out, line
    for skipped in re.findall(r"^(SKIPPED \[\d+\] .*)$", TEXT, re.M):
        assert skipped in out, skipped


@pytest.mark.parametrize("name, block", BLOCKS, ids=[name for name, _ in BLOCKS])
def test_block_runs(name, block, capsys):
    for framework in ("torch", "jax"):
        if f"import {framework}" in block and importlib.util.find_spec(framework) is None:
            pytest.skip(f"{framework} is not installed")
    exec(compile(block, name, "exec"), {"__name__": "doc"})
    assert capsys.readouterr().out.strip()
