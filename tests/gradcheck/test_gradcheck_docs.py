"""Every Python block of docs/gradcheck.md runs as written, and the output it shows is the
output it prints (so the page cannot drift from the harness)."""

import pathlib
import re

import numpy as np
import pytest

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[+-]\d+)?")


def same_text(printed: str, shown: str) -> bool:
    """The same words, and numbers within 2% of each other: the printed digits of a float
    may differ in the last place between CPUs (summation order), the words may not."""
    numbers = [NUMBER.findall(t) for t in (printed, shown)]
    words = [NUMBER.sub("#", t).split() for t in (printed, shown)]
    if words[0] != words[1] or len(numbers[0]) != len(numbers[1]):
        return False
    return bool(np.allclose(np.array(numbers[0], float), np.array(numbers[1], float),
                            rtol=2e-2, atol=0.0))

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "gradcheck.md"
TEXT = PAGE.read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)


def test_the_page_has_its_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, capsys):
    exec(compile(BLOCKS[index], f"{PAGE.name} block {index}", "exec"), {"__name__": "doc"})
    printed = capsys.readouterr().out
    assert printed.strip()
    if index == 1:
        # The output shown under the second block (## Modes) is what it prints.
        shown = re.search(r"prints\n\n```\n(.*?)```", TEXT, flags=re.S).group(1)
        assert same_text(printed, shown), printed
    elif index == 2:
        assert "input x[1] sits on a kink" in printed
    else:
        assert "max rel err" in printed
