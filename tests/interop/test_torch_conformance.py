"""refdml's layers pass refdml's own conformance: ``check_implementation`` run on the
wrapped ops (``refdml.torch.op(name)``, differentiated by torch.autograd) against the
float64 reference, for every bridged catalogue name in float64, float32 and bfloat16, on
the catalogue's seeds, hard cases and bad inputs (the property search on a few in float64).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import refdml.torch as rt  # noqa: E402
from refdml.conformance import check_implementation  # noqa: E402


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", rt.names())
def test_the_wrapped_op_passes_refdmls_conformance(name, dtype):
    report = check_implementation(rt.op(name), name, framework="torch", dtype=dtype,
                                  search=False)
    assert report.passed, report.summary()


@pytest.mark.parametrize("name", ["gsp.pool", "losses.proxy_nca", "normalize.l2_normalize"])
def test_the_wrapped_op_passes_the_property_search(name):
    report = check_implementation(rt.op(name), name, framework="torch", dtype="float64",
                                  search=True, max_examples=10)
    assert report.passed, report.summary()
