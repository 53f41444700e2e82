"""What the fast path shares with :mod:`refdml.gsp` (internal; see :mod:`refdml._shared`).

:mod:`refdml.gpu.gsp` returns the reference's own context and result dataclasses (public in
:mod:`refdml.gsp`), validates with the reference's checks, and runs GeMean (the power mean
and its backward, written once against the array namespace) and the float64 overflow rule
of the pooling backward with the reference's helpers, so that both paths refuse the same
inputs with the same messages and rescale by the same powers of two:

- ``check_transport_args(mu, inverse_temperature, method, max_iter, tol)``: (P2)'s
  arguments checked and normalised, one rule for both paths.
- ``check_pool_mu(mu)``: the pooling layer's ``mu`` (a subnormal ``mu`` refused, why in
  :mod:`refdml.gsp`).
- ``power_mean(xp, weights, features, p, check)``, ``power_mean_backward(xp, weights,
  features, p, ctx, d_pooled)``: GeMean forward and backward on any array namespace (the
  reference's code is the fast path's: the maths is the same).
- ``weight_gradient_shift(features)``, ``upstream_exponent(d_weights, d_z, n)``,
  ``exponent_of(values)``: the powers of two by which the pooling backward rescales its
  upstream where float64 intermediates would overflow (features beyond ~1e300).
- ``pool_gradient_overflow(name, exponent, inverse_temperature)``: the message of a
  pooling gradient truly beyond float64.
"""

from __future__ import annotations

from refdml.gsp._pool import (
    check_pool_mu,
    exponent_of,
    pool_gradient_overflow,
    power_mean,
    power_mean_backward,
    upstream_exponent,
    weight_gradient_shift,
)
from refdml.gsp._transport import check_transport_args

__all__ = [
    "check_pool_mu",
    "check_transport_args",
    "exponent_of",
    "pool_gradient_overflow",
    "power_mean",
    "power_mean_backward",
    "upstream_exponent",
    "weight_gradient_shift",
]
