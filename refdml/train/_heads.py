r"""Pooling heads on local features ``(B, n, d)``, and the L2 normalisation layer.

Pure pairs written here (array-module-agnostic, the input's dtype):

``gap_forward(features)``
    Global average pooling ``y_b = (1/n) sum_j f_bj``; ``d_f_bj = d_y_b / n``.
``gmp_forward(features)``
    Global max pooling ``y_bk = max_j f_bjk``. Backward: the subgradient that sends
    ``d_y_bk`` to the arg-max location ``j*(b, k)`` alone; ties go to the LOWEST index
    ``j`` (``argmax``'s first occurrence, NumPy and CuPy alike). Exact wherever the
    maximum is unique.
``gemean_forward(features, *, p)``
    Generalised mean (GeM), ``p > 1``, on non-negative features (e.g. after a ReLU):

    .. math::
        y_{bk} = \Big(\frac1n \sum_j f_{bjk}^p\Big)^{1/p},\qquad
        \frac{\partial y_{bk}}{\partial f_{bjk}} = \frac1n \Big(\frac{f_{bjk}}{y_{bk}}\Big)^{p-1}.

    Computed as ``s (mean((f/s)^p))^(1/p)`` with ``s = max_j f_bjk``, so ``f^p`` never
    overflows or underflows (any scale). Where a whole column is zero, ``y = 0`` and
    the gradient is taken as 0 (the one-sided derivatives there are ``n^(-1/p)`` along
    each axis: not differentiable; 0 is a valid choice of the Clarke subgradient's
    corner and keeps dead columns dead, like a ReLU).

Layers wrapping catalogued operators (their pairs are the operators' own entries:
``gsp.pool``, ``histogram.entropic``, ``normalize.l2_normalize``): :class:`GSPHead`,
:class:`XMLHistogramHead`, :class:`L2Normalize`. Each runs the fast path
(:mod:`refdml.gpu`, NumPy or CuPy, float32/float64) by default, or the float64 NumPy
reference operator with ``reference=True`` (the cross-check of ``--reference``); the
choice is recorded in the context so the matching backward runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import (
    _describe, as_inputs, check_context, check_rng, check_scalar, check_upstream_like, data_checks,
)
from refdml._backend import get_backend
from refdml.train._constants import constant, filled
from refdml.train._dense import _positive_int
from refdml.train._layer import Layer, OwnerToken, check_owner, init_array
from refdml.train._operators import check_reference, operators

__all__ = [
    "GAP",
    "GMP",
    "GSPHead",
    "GeMean",
    "HeadContext",
    "L2Normalize",
    "PoolingContext",
    "PoolingGrads",
    "XMLHistogramHead",
    "gap_backward",
    "gap_forward",
    "gemean_backward",
    "gemean_forward",
    "gmp_backward",
    "gmp_forward",
]


@dataclass(frozen=True)
class PoolingContext:
    """Context of GAP / GMP / GeMean: ``weights`` with ``d_f = d_y[:, None, :] * weights``.

    ``weights`` (B, n, d) is the diagonal Jacobian ``dy_bk / df_bjk`` (GAP ``1/n``, GMP
    the one-hot arg-max, GeMean ``(1/n)(f/y)^(p-1)``; GAP's is a read-only broadcast of
    one kept column); ``kind`` names the pooling, and a context of another kind is refused.
    """

    weights: Any
    kind: str
    y_shape: tuple[int, int]


@dataclass(frozen=True)
class PoolingGrads:
    features: Any


def _features(features):
    _, _, a = as_inputs({"features": (features, 3)})
    return a["features"]


def _pool_backward(ctx: PoolingContext, d_y, kind: str) -> PoolingGrads:
    check_context(ctx, "ctx", PoolingContext)
    if ctx.kind != kind:
        raise TypeError(
            f"ctx must be the PoolingContext of {kind}_forward, got one of {ctx.kind}_forward"
        )
    d_y = check_upstream_like(d_y, "d_y", ctx.y_shape, ctx.weights)
    return PoolingGrads(features=d_y[:, None, :] * ctx.weights)


def gap_forward(features):
    """Global average pooling (B, n, d) -> (B, d); returns ``(y, ctx)``.

    Parameters
    ----------
    features : float array (B, n, d)
        ``n`` local features of dimension ``d`` per sample.
    """
    f = _features(features)
    xp = get_backend(f).xp
    y = f.mean(axis=1)
    # The same 1/n everywhere: a read-only broadcast of one kept column, made once per n.
    weights = xp.broadcast_to(filled(f, 1.0 / f.shape[1], (1, f.shape[1], 1)), f.shape)
    return y, PoolingContext(weights=weights, kind="gap", y_shape=tuple(y.shape))


def gap_backward(ctx: PoolingContext, d_y) -> PoolingGrads:
    """Gradient ``.features = d_y / n`` at every location."""
    return _pool_backward(ctx, d_y, "gap")


def gmp_forward(features):
    """Global max pooling (B, n, d) -> (B, d); returns ``(y, ctx)`` (ties: lowest index).

    Parameters
    ----------
    features : float array (B, n, d)
        ``n`` local features of dimension ``d`` per sample.
    """
    f = _features(features)
    xp = get_backend(f).xp
    n = f.shape[1]
    index = xp.argmax(f, axis=1)  # (B, d), first occurrence of the maximum
    y = f.max(axis=1)             # the value at that index
    # One-hot at the arg-max: the locations 0..n-1 (kept, made once per n) against it.
    locations = constant(f, ("refdml.train.gmp.locations", n),
                         lambda: _host_locations(n))
    weights = (locations == index[:, None, :]).astype(f.dtype)
    return y, PoolingContext(weights=weights, kind="gmp", y_shape=tuple(y.shape))


@functools.lru_cache(maxsize=64)
def _host_locations(n: int) -> np.ndarray:
    locations = np.arange(n).reshape(1, n, 1)
    locations.flags.writeable = False
    return locations


def gmp_backward(ctx: PoolingContext, d_y) -> PoolingGrads:
    """Gradient ``.features``: ``d_y`` at the arg-max location (lowest index on ties), else 0."""
    return _pool_backward(ctx, d_y, "gmp")


def gemean_forward(features, *, p: float = 3.0):
    """Generalised mean pooling, ``p > 1``, non-negative features; returns ``(y, ctx)``.

    Parameters
    ----------
    features : float array (B, n, d)
        ``n`` local features of dimension ``d`` per sample, non-negative.
    p : float > 1
        The exponent of the generalised mean (default 3).
    """
    p = check_scalar(p, "p", low=1.0, low_inclusive=False)
    f = _features(features)
    ns = get_backend(f)
    xp = ns.xp
    if data_checks(ns) and bool(xp.any(f < 0)):
        index = tuple(int(i) for i in xp.argwhere(f < 0)[0])
        raise ValueError(
            f"features must be non-negative for GeMean (p = {p}), got {f[index]} at index {index}"
        )
    scale = f.max(axis=1)  # (B, d)
    alive = scale > 0
    safe_scale = xp.where(alive, scale, 1)
    t = f / safe_scale[:, None, :]           # in [0, 1], the largest exactly 1; 0 if dead
    with np.errstate(under="ignore"):        # t^p of t < 1 is 0 at large p, as it should be
        total = (t ** p).sum(axis=1)         # n M: in [1, n] on live columns, 0 on dead ones
        root = (total / f.shape[1]) ** (1.0 / p)   # M^(1/p); 0 on a dead column, as is y
        y = safe_scale * root
        # dy/df_j = (1/n) (f_j / y)^(p-1) = t_j^(p-1) M^(1/p) / (n M): t_j^(p-1) in [0, 1],
        # M^(1/p) in [n^(-1/p), 1], n M in [1, n] (taken as 1 on a dead column, where t = 0
        # and so the weight is 0). Not (f / y)^(p-1): the rounding of y would be multiplied
        # by p - 1 (wrong in the first digit from p ~ 1e15).
        weights = t ** (p - 1) * (root / xp.maximum(total, 1))[:, None, :]
    return y, PoolingContext(weights=weights.astype(f.dtype, copy=False), kind="gemean",
                             y_shape=tuple(y.shape))


def gemean_backward(ctx: PoolingContext, d_y) -> PoolingGrads:
    """Gradient ``.features = d_y (1/n)(f/y)^(p-1)`` (0 on an all-zero column)."""
    return _pool_backward(ctx, d_y, "gemean")


# --------------------------------------------------------------------------- layers
class GAP(Layer):
    """Global average pooling of local features (:func:`gap_forward`)."""

    def __init__(self, *, name: str = "gap") -> None:
        super().__init__(name)

    def forward(self, x):
        return gap_forward(x)

    def backward(self, ctx, d_y):
        return gap_backward(ctx, d_y).features


class GMP(Layer):
    """Global max pooling of local features (:func:`gmp_forward`; ties to the lowest index)."""

    def __init__(self, *, name: str = "gmp") -> None:
        super().__init__(name)

    def forward(self, x):
        return gmp_forward(x)

    def backward(self, ctx, d_y):
        return gmp_backward(ctx, d_y).features


class GeMean(Layer):
    """Generalised-mean pooling, fixed ``p > 1`` (:func:`gemean_forward`)."""

    def __init__(self, *, p: float = 3.0, name: str = "gemean") -> None:
        super().__init__(name)
        self.p = check_scalar(p, "p", low=1.0, low_inclusive=False)

    def forward(self, x):
        return gemean_forward(x, p=self.p)

    def backward(self, ctx, d_y):
        return gemean_backward(ctx, d_y).features


@dataclass(frozen=True)
class HeadContext:
    """The wrapped operator's own context ``inner``, which implementation made it, and the
    :class:`~refdml.train._layer.OwnerToken` of the layer whose forward made it."""

    inner: Any
    reference: bool
    layer: OwnerToken


class _WrappingLayer(Layer):
    """A layer around a catalogued operator, whose pair it takes from the table
    :data:`~refdml.train._operators.REFERENCE` or :data:`~refdml.train._operators.FAST`."""

    def _wrap(self, inner, reference: bool) -> HeadContext:
        return HeadContext(inner=inner, reference=reference, layer=self._owner_token)

    def check_own_context(self, ctx) -> HeadContext:
        """``ctx``, checked to be the HeadContext of this layer's forward.

        TypeError for another kind of context, ValueError for another layer's.
        """
        check_context(ctx, "ctx", HeadContext)
        check_owner(ctx.layer, self._owner_token)
        return ctx


def _prototype_values(rng, m: int, d: int) -> np.ndarray:
    # Rows of norm about 1 (N(0, 1/d)): the cost map clips at the unit sphere.
    return rng.standard_normal((m, d)) / np.sqrt(d)


class GSPHead(_WrappingLayer):
    """GSP pooling (GSP Alg. 2) with learned prototypes: ``x (B, n, d) -> (pooled, z)``.

    Wraps ``gsp_pool_forward`` / ``gsp_pool_backward`` (catalogue entry ``gsp.pool``):
    ``pooled`` (B, d) (Eq. 4.1; GeMean + GSP for ``p > 1``) and the attribute histogram
    ``z`` (B, m) (Eq. 4.3). Two outputs: ``backward(ctx, (d_pooled, d_z))``, either may
    be ``None`` (zero: e.g. no zero-shot regulariser uses ``z``). In a
    :class:`~refdml.train.Sequential`, ``pooled`` feeds the next layer and ``z`` is a
    side output.

    Parameters
    ----------
    n_prototypes, d : int
        ``m`` prototypes (a :class:`~refdml.train.Parameter` ``(m, d)``, drawn N(0, 1/d)).
    mu, inverse_temperature, p : float
        As in :func:`refdml.gsp.gsp_pool_forward`; ``inverse_temperature`` is the paper's
        ε (varepsilon), GSP's defaults 0.5 (proxy losses) and 5.0 (pair losses).
    reference : bool
        Run :mod:`refdml.gsp` (NumPy, float64) instead of :mod:`refdml.gpu.gsp`.
    """

    n_outputs = 2

    def __init__(self, n_prototypes: int, d: int, *, mu: float, inverse_temperature: float,
                 p: float = 1.0, reference: bool = False, rng=None, dtype=np.float64,
                 device: str = "cpu", name: str = "gsp") -> None:
        super().__init__(name)
        m, d = _positive_int(n_prototypes, "n_prototypes"), _positive_int(d, "d")
        self.mu = check_scalar(mu, "mu", low=0.0, high=1.0, low_inclusive=False)
        self.inverse_temperature = check_scalar(inverse_temperature, "inverse_temperature",
                                                low=0.0)
        self.p = check_scalar(p, "p", low=1.0)
        self.reference = check_reference(reference)
        rng = check_rng(rng)
        self.prototypes = self.add_parameter(
            "prototypes", init_array(_prototype_values(rng, m, d), dtype, device))

    def forward(self, x):
        (pooled, z), ctx = operators(self.reference).gsp_pool.forward(
            x, self.prototypes.value, mu=self.mu,
            inverse_temperature=self.inverse_temperature, p=self.p,
        )
        return (pooled, z), self._wrap(ctx, self.reference)

    def backward(self, ctx, d_y):
        ctx = self.check_own_context(ctx)
        if not isinstance(d_y, tuple) or len(d_y) != 2:
            raise TypeError(
                f"d_y must be the pair (d_pooled, d_z) (None for an unused output), "
                f"got {_describe(d_y)}"
            )
        grads = operators(ctx.reference).gsp_pool.backward(ctx.inner, *d_y)
        self.prototypes.accumulate(grads.prototypes)
        return grads.features


class XMLHistogramHead(_WrappingLayer):
    """XML's entropic attribute histogram (XML Eq. 2.4): ``x (B, n, d) -> z (B, m)``.

    Wraps ``histogram_entropic_forward`` / ``_backward`` (catalogue entry
    ``histogram.entropic``) with learned prototypes ``nu`` (m, d), drawn N(0, 1/d).
    ``inverse_temperature`` is the paper's ε (varepsilon). One output.
    ``reference=True`` runs :mod:`refdml.histogram` instead of :mod:`refdml.gpu.histogram`.
    """

    def __init__(self, n_prototypes: int, d: int, *, inverse_temperature: float,
                 reference: bool = False, rng=None, dtype=np.float64, device: str = "cpu",
                 name: str = "xml") -> None:
        super().__init__(name)
        m, d = _positive_int(n_prototypes, "n_prototypes"), _positive_int(d, "d")
        self.inverse_temperature = check_scalar(inverse_temperature, "inverse_temperature",
                                                low=0.0)
        self.reference = check_reference(reference)
        rng = check_rng(rng)
        self.prototypes = self.add_parameter(
            "prototypes", init_array(_prototype_values(rng, m, d), dtype, device))

    def forward(self, x):
        z, ctx = operators(self.reference).histogram_entropic.forward(
            x, self.prototypes.value, inverse_temperature=self.inverse_temperature)
        return z, self._wrap(ctx, self.reference)

    def backward(self, ctx, d_y):
        ctx = self.check_own_context(ctx)
        grads = operators(ctx.reference).histogram_entropic.backward(ctx.inner, d_y)
        self.prototypes.accumulate(grads.prototypes)
        return grads.features


class L2Normalize(_WrappingLayer):
    """Row-wise L2 normalisation ``y = x / ||x||`` (catalogue entry ``normalize.l2_normalize``).

    ``reference=True`` runs :mod:`refdml.normalize` instead of :mod:`refdml.gpu.normalize`.
    """

    def __init__(self, *, reference: bool = False, name: str = "l2") -> None:
        super().__init__(name)
        self.reference = check_reference(reference)

    def forward(self, x):
        y, ctx = operators(self.reference).l2_normalize.forward(x)
        return y, self._wrap(ctx, self.reference)

    def backward(self, ctx, d_y):
        ctx = self.check_own_context(ctx)
        return operators(ctx.reference).l2_normalize.backward(ctx.inner, d_y).x
