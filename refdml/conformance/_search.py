"""A hypothesis search for inputs where an implementation and the reference disagree.

A draw is a seed of the entry's ``make_inputs`` and the number of significant decimal
digits (2 to 8) its floating inputs keep. Rounding gives the search ties, duplicate
points and exact zeros that well-conditioned random inputs never hold, and when a draw
disagrees, hypothesis shrinks it towards seed 0 and 2 digits: the smallest seed, with the
fewest digits, that still shows the disagreement, whose inputs a person can read.
Draws where the reference itself refuses the inputs are assumed away.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from refdml.conformance._report import SearchOutcome, search_reason, with_reason
from refdml.conformance._tolerance import is_floating_array, round_digits
from refdml.validation._framework import find_counterexample

__all__ = ["draw_inputs", "run_search"]

MIN_DIGITS, MAX_DIGITS = 2, 8


def draw_inputs(make_inputs: Callable[[np.random.Generator], Mapping[str, Any]],
                seed: int, digits: int) -> dict[str, Any]:
    """``make_inputs(default_rng(seed))`` with its floating arrays rounded to ``digits``
    significant digits."""
    inputs = dict(make_inputs(np.random.default_rng(seed)))
    return {name: round_digits(value, digits) if is_floating_array(value) else value
            for name, value in inputs.items()}


def _case_name(seed: int, digits: int) -> str:
    return f"search seed={seed} digits={digits}"


def run_search(checker, make_inputs, max_examples: int):
    """Search with ``checker.check`` (see :mod:`refdml.conformance._check`); return the
    :class:`SearchOutcome` and the minimal disagreeing case's result (None if none)."""
    from hypothesis import assume
    from hypothesis import strategies as st

    compared = 0

    def check(seed: int, digits: int):
        inputs = draw_inputs(make_inputs, seed, digits)
        return checker.check(_case_name(seed, digits), inputs, np.random.default_rng(seed))

    def violates(draw: tuple[int, int]) -> bool:
        nonlocal compared
        result = check(*draw)
        assume(result.skipped is None)
        compared += 1
        return bool(result.failures)

    strategy = st.tuples(st.integers(0, 2**32 - 1), st.integers(MIN_DIGITS, MAX_DIGITS))
    found = find_counterexample(strategy, violates, max_examples=max_examples)
    if found is None:
        note = "" if compared else "the reference refused every draw"
        return SearchOutcome(examples=compared, note=note), None
    seed, digits = found
    result = check(seed, digits)
    result.failures[:] = with_reason(result.failures, search_reason(seed, digits))
    return SearchOutcome(examples=compared, seed=seed, digits=digits,
                         inputs=dict(result.inputs), failures=tuple(result.failures)), result
