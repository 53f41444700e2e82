"""Catalogue entries of ``refdml.ot``: entropic OT, Sinkhorn divergences, Wasserstein losses.

Inputs are small and well-conditioned by construction:

* costs of the order of ``eps`` (points in a ball of radius ~1, ``eps = 0.5``), so every
  Sinkhorn problem converges to ``tol = 1e-12`` in a few hundred iterations;
* for ``p < 2``, points on a jittered grid, so no two points meet (the kink of
  ``||x - y||^p``);
* for the losses, a margin that keeps every hinge a fixed distance from its kink: the
  divergences of points in the unit ball are below 4 (p = 2), far from ``margin``.
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.gpu import ot as fast
from refdml.ot import (
    entropic_ot_backward,
    entropic_ot_forward,
    pairwise_sinkhorn_divergence_backward,
    sinkhorn_divergence_backward,
    sinkhorn_divergence_forward,
    wcontrastive_backward,
    wcontrastive_forward,
    wtriplet_backward,
    wtriplet_forward,
)
from refdml.ot._divergence import _pairwise_sinkhorn_divergence_forward_readable

_TIGHT = dict(tol=1e-12, max_iter=5000)


def _ball(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Points uniform in the unit ball (last axis), so every cost is at most 4 (p = 2)."""
    direction = rng.standard_normal(shape)
    direction /= np.linalg.norm(direction, axis=-1, keepdims=True)
    radius = rng.uniform(0.0, 1.0, shape[:-1] + (1,)) ** (1.0 / shape[-1])
    return radius * direction


def _grid(rng: np.random.Generator, n_points: int) -> np.ndarray:
    """``n_points`` 2-d points of a grid of spacing 0.4, jittered by at most 0.1 each way,
    in random order: every pairwise gap is at least 0.2 (away from the kink of |x - y|^p)."""
    side = int(np.ceil(np.sqrt(n_points)))
    cells = np.stack(np.meshgrid(np.arange(side), np.arange(side)), -1).reshape(-1, 2)
    chosen = cells[rng.permutation(cells.shape[0])[:n_points]]
    return 0.4 * (chosen - (side - 1) / 2.0) + rng.uniform(-0.1, 0.1, (n_points, 2))


def _ot_inputs(rng: np.random.Generator) -> dict:
    x, y = _ball(rng, (4, 2)), _ball(rng, (3, 2))
    cost = np.sum((x[:, None] - y[None]) ** 2, axis=-1)
    return {"a": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(0.5, 1.5, 3), "cost": cost,
            "eps": 0.5, **_TIGHT}


def _ot_batch_inputs(rng: np.random.Generator) -> dict:
    # A batch of two problems with broadcast weights: d_value has shape (2,).
    x, y = _ball(rng, (2, 4, 2)), _ball(rng, (2, 3, 2))
    cost = np.sum((x[:, :, None] - y[:, None]) ** 2, axis=-1)
    return {"a": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(0.5, 1.5, (2, 3)), "cost": cost,
            "eps": 0.5, **_TIGHT}


def _ot_transport_inputs(rng: np.random.Generator) -> dict:
    return {**_ot_inputs(rng), "value": "transport_cost"}


def _divergence_inputs(rng: np.random.Generator) -> dict:
    return {"x": _ball(rng, (4, 2)), "y": _ball(rng, (3, 2)) + 0.5,
            "a": rng.uniform(0.5, 1.5, 4), "b": rng.uniform(0.5, 1.5, 3),
            "eps": 0.5, "p": 2, **_TIGHT}


def _divergence_transport_inputs(rng: np.random.Generator) -> dict:
    points = _grid(rng, 7)
    return {"x": points[:4], "y": points[4:], "a": rng.uniform(0.5, 1.5, 4),
            "b": rng.uniform(0.5, 1.5, 3), "eps": 0.5, "p": 1.5, "value": "transport_cost",
            **_TIGHT}


def _pairwise_inputs(rng: np.random.Generator) -> dict:
    return {"clouds": _grid(rng, 9).reshape(3, 3, 2), "eps": 0.5, "p": 1, **_TIGHT}


def _loss_inputs(rng: np.random.Generator) -> dict:
    # Points in the unit ball: every d_w (p = 2) is below 4, the margin 20 keeps every
    # hinge at least 16 from its kink, whatever the draw.
    return {"features": _ball(rng, (4, 3, 2)), "labels": np.array([0, 0, 1, 1]),
            "margin": 20.0, "eps": 0.5, "p": 2, **_TIGHT}


def _loss_p1_inputs(rng: np.random.Generator) -> dict:
    # p = 1 with the transport-cost convention on a jittered grid (no coincident points);
    # d_w <= 2 * 1.2 here, the margin 10 keeps the hinges off their kinks.
    return {"features": _grid(rng, 12).reshape(4, 3, 2), "labels": np.array([0, 1, 0, 1]),
            "margin": 10.0, "eps": 0.5, "p": 1, "value": "transport_cost", **_TIGHT}


OPERATORS = (
    OperatorSpec(
        name="ot.entropic_ot",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        mirror_kernels=("cpu", "cuda"),   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_inputs,
        paper="Wasserstein DML Eq. (3): W_{p,eta}^p, regularised value",
    ),
    OperatorSpec(
        name="ot.entropic_ot_batched",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        mirror_kernels=("cpu", "cuda"),   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_batch_inputs,
        paper="Wasserstein DML Eq. (3), a batch of problems with broadcast weights",
    ),
    OperatorSpec(
        name="ot.entropic_ot_transport_cost",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        mirror_kernels=("cpu", "cuda"),   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_transport_inputs,
        paper="Wasserstein DML Eq. (3): <pi, C> of the entropic plan (implicit gradient)",
    ),
    OperatorSpec(
        name="ot.sinkhorn_divergence",
        forward=sinkhorn_divergence_forward,
        mirror=fast.sinkhorn_divergence_forward,
        mirror_backward=fast.sinkhorn_divergence_backward,
        mirror_kernels=("cpu", "cuda"),   # the log-sum-exp half-step kernels
        backward=sinkhorn_divergence_backward,
        make_inputs=_divergence_inputs,
        paper="Wasserstein DML Eq. (4): SD_{p,eta}",
    ),
    OperatorSpec(
        name="ot.sinkhorn_divergence_transport_cost",
        forward=sinkhorn_divergence_forward,
        mirror=fast.sinkhorn_divergence_forward,
        mirror_backward=fast.sinkhorn_divergence_backward,
        mirror_kernels=("cpu", "cuda"),   # the log-sum-exp half-step kernels
        backward=sinkhorn_divergence_backward,
        make_inputs=_divergence_transport_inputs,
        paper="Wasserstein DML Eq. (4) with <pi, C> in place of W_{p,eta}",
    ),
    OperatorSpec(
        name="ot.pairwise_sinkhorn_divergence",
        # The readable form: the public forward runs the compiled CPU twin (its docstring), so
        # the parity suite holds every route, that one included, to this.
        forward=_pairwise_sinkhorn_divergence_forward_readable,
        mirror=fast.pairwise_sinkhorn_divergence_forward,
        mirror_backward=fast.pairwise_sinkhorn_divergence_backward,
        mirror_kernels=("cpu", "cuda"),   # the small-problem Sinkhorn kernels
        backward=pairwise_sinkhorn_divergence_backward,
        make_inputs=_pairwise_inputs,
        paper="Wasserstein DML Eq. (4), all pairs of images (the divergences of Eq. (6))",
    ),
    OperatorSpec(
        name="ot.wcontrastive",
        forward=wcontrastive_forward,
        mirror=fast.wcontrastive_forward,
        mirror_backward=fast.wcontrastive_backward,
        mirror_kernels=("cpu", "cuda"),   # the small-problem Sinkhorn kernels
        backward=wcontrastive_backward,
        make_inputs=_loss_inputs,
        paper="Wasserstein DML Eq. (1)",
        wrt=("features",),
        tags=("loss",),
    ),
    OperatorSpec(
        name="ot.wcontrastive_p1",
        forward=wcontrastive_forward,
        mirror=fast.wcontrastive_forward,
        mirror_backward=fast.wcontrastive_backward,
        mirror_kernels=("cpu", "cuda"),   # the small-problem Sinkhorn kernels
        backward=wcontrastive_backward,
        make_inputs=_loss_p1_inputs,
        paper="Wasserstein DML Eq. (1), p = 1 (d_w ~ W_1), transport-cost convention",
        wrt=("features",),
        tags=("loss",),
    ),
    OperatorSpec(
        name="ot.wtriplet",
        forward=wtriplet_forward,
        mirror=fast.wtriplet_forward,
        mirror_backward=fast.wtriplet_backward,
        mirror_kernels=("cpu", "cuda"),   # the small-problem Sinkhorn kernels
        backward=wtriplet_backward,
        make_inputs=_loss_inputs,
        paper="Wasserstein DML Eq. (2)",
        wrt=("features",),
        tags=("loss",),
    ),
)
