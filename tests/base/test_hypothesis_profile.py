"""README's plain ``pytest`` draws the examples CI draws (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings


def test_a_plain_pytest_checks_the_examples_ci_checks():
    # Before, a run without CI=true drew fresh examples: a rare draw could fail one test
    # on a user's machine while every rerun passed.
    if os.environ.get("HYPOTHESIS_PROFILE"):
        pytest.skip(f"HYPOTHESIS_PROFILE={os.environ['HYPOTHESIS_PROFILE']} chose the profile")
    assert settings.default.derandomize is True
    assert settings.default.database is None
    assert settings.default.deadline is None
