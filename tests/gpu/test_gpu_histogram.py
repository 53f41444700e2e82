"""refdml.gpu.histogram beyond the parity suite: products beyond the dtype are named."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml import histogram as reference
from refdml.gpu import histogram as fast


@pytest.mark.parametrize("dtype, scale", [(np.float32, 1e38), (np.float64, 1e300)])
def test_convex_combination_beyond_the_dtype_is_named(dtype, scale):
    # Finite z and prototypes whose product is not: once a RuntimeWarning and inf.
    rng = np.random.default_rng(0)
    z, prototypes = rng.uniform(1, 2, (2, 3)), rng.uniform(1, 2, (3, 4))
    name = np.dtype(dtype).name
    with pytest.raises(ValueError, match=rf"^y_hat = z @ prototypes overflows {name}"
                                         r" \(max \|z\| == .*, max \|prototypes\| == "):
        fast.convex_combination_forward((scale * z).astype(dtype),
                                        (scale * prototypes).astype(dtype))
    prototypes = scale / 100 * prototypes
    y_hat, ctx = fast.convex_combination_forward(z.astype(dtype), prototypes.astype(dtype))
    assert_allclose(y_hat, z @ prototypes, rtol=1e-6)
    d_y = np.full(y_hat.shape, scale, dtype=dtype)
    with pytest.raises(ValueError, match=r"^the gradient of z, d_y @ prototypes.T, overflows"):
        fast.convex_combination_backward(ctx, d_y)


def test_convex_combination_matches_the_reference_at_large_scale():
    rng = np.random.default_rng(1)
    z, prototypes = rng.uniform(0, 1, (2, 3)), 1e37 * rng.standard_normal((3, 4))
    d_y = rng.standard_normal((2, 4))
    y_hat, ctx = fast.convex_combination_forward(z.astype(np.float32),
                                                 prototypes.astype(np.float32))
    grads = fast.convex_combination_backward(ctx, d_y.astype(np.float32))
    expected, ref_ctx = reference.convex_combination_forward(z, prototypes)
    ref_grads = reference.convex_combination_backward(ref_ctx, d_y)
    assert_allclose(y_hat, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    for name in ("z", "prototypes"):
        want = getattr(ref_grads, name)
        assert_allclose(getattr(grads, name), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype, exponent", [(np.float32, 110), (np.float64, 1006)])
def test_convex_combination_where_only_partial_sums_overflow_is_the_references(dtype, exponent):
    # z = (2^e, -2^e), nu rows 2^20 and 2^20 - 1: each product is beyond the dtype, the
    # value 2^e is not (once a ValueError on the fast path, inf in the reference). Powers
    # of two and 20-bit integers: every step is exact in both dtypes.
    big = 2.0**exponent
    z = np.array([[big, -big], [0.25, 0.75]])
    prototypes = np.array([[2.0**20, 3.0], [2.0**20 - 1.0, 1.0]])
    expected, ref_ctx = reference.convex_combination_forward(z, prototypes)
    y_hat, ctx = fast.convex_combination_forward(z.astype(dtype), prototypes.astype(dtype))
    assert y_hat.dtype == dtype
    assert_allclose(y_hat, expected, rtol=1e-7)
    assert_allclose(expected, [[big, 2 * big], [2.0**20 - 0.75, 1.5]], rtol=1e-15)
    d_y = np.array([[1.0, -1.0], [0.5, 2.0]])
    grads = fast.convex_combination_backward(ctx, d_y.astype(dtype))
    ref_grads = reference.convex_combination_backward(ref_ctx, d_y)
    for name in ("z", "prototypes"):
        want = getattr(ref_grads, name)
        assert_allclose(getattr(grads, name), want, rtol=0, atol=1e-6 * np.abs(want).max())
