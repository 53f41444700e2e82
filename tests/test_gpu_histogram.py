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
