"""tests/_contraction.py's model of ptxas's FMA contraction, checked against values
derived by hand (its use: tests/gpu/test_gpu_kernels_gsp.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from _contraction import Contracting, contracting, rounded


def test_a_product_minus_its_rounded_self_is_its_rounding_error():
    # 0.1 = 3602879701896397 * 2^-55; times 3: 10808639105689191 * 2^-55, 54 bits, a tie
    # between ...190 and ...192 that rounds to the even ...192. Fused, x * 3 - round(x * 3)
    # is the exact product minus that: -1 * 2^-55; rounded apart, 0.
    product = Contracting(0.1) * 3.0
    assert float(product) == 0.1 * 3.0 == 10808639105689192 * 2.0**-55
    assert float(product - 0.1 * 3.0) == -(2.0**-55)
    assert float((0.1 * 3.0) - product) == 2.0**-55          # fused on the right as well
    assert float(-product + 0.1 * 3.0) == 2.0**-55


def test_uses_that_do_not_add_round_the_product_first():
    product = Contracting(0.1) * 3.0
    assert float(product * 1.0 - 0.1 * 3.0) == 0.0          # a further product rounds it
    assert float(product / 1.0 - 0.1 * 3.0) == 0.0
    assert product == 0.1 * 3.0 and product < 0.31 and not product > 0.31
    assert math.exp(Contracting(0.0) * 1.0) == 1.0
    stored = np.empty(1)
    stored[0] = product                                      # a store rounds
    assert stored[0] - 0.1 * 3.0 == 0.0


def test_plain_sums_round_as_floats_and_infinities_pass():
    a, b = Contracting(1.0), Contracting(2.0**-53)
    assert float(a + b) == 1.0 + 2.0**-53 == 1.0             # ties to even, no product
    big = Contracting(1e308) * 10.0                          # overflows: rounded path
    assert float(big - 1.0) == math.inf
    assert math.isnan(float(big - big))


def test_object_arrays_round_trip():
    values = np.array([[0.5, -1.25], [3.0, 0.0]])
    array = contracting(values)
    assert array.dtype == object and isinstance(array[1, 0], Contracting)
    np.testing.assert_array_equal(rounded(array), values)
    with pytest.raises(TypeError, match="not an index"):
        range(array[0, 0])
