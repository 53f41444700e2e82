"""refdml's own conformance check on refdml.jax's ops: the wrapped operators, differentiated
by JAX's autodiff (``jax.vjp`` through their ``custom_vjp``), must pass the check every other
implementation is held to, in float64, float32 and bfloat16, on every catalogue name.

The check runs the catalogue's drawn cases and its hard reference cases. ``search=False``:
the hypothesis search of a disagreement is for an implementation under development, and
these cases already include the extremes. ``error_cases=False``: a report lists how the
error cases were met and never fails on them, they took a third of this file's time, and
tests/jax/test_jax_ops.py asserts the refusals themselves.
"""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")

import refdml.jax  # noqa: E402
from refdml.conformance import check_implementation  # noqa: E402


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", refdml.jax.names())
def test_refdml_jax_passes_refdmls_conformance(name, dtype):
    report = check_implementation(refdml.jax.op(name), name, framework="jax", dtype=dtype,
                                  search=False, error_cases=False)
    assert report.passed, report.summary()
