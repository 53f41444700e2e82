"""Catalogue entries of ``refdml.gsp``: the cost map, (P2) and the pooling layer.

The LP solvers ``solve_p1_linprog`` / ``solve_p1_pot`` are validation only and have no
backward (the LP solution is piecewise constant in the cost), so they have no entry.
"""

from __future__ import annotations

import functools

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.gpu import gsp as fast
from refdml.gsp import (
    cost_map_backward,
    cost_map_forward,
    gsp_pool_backward,
    gsp_pool_forward,
    weight_transport,
    weight_transport_backward,
    weight_transport_backward_unrolled,
)

VALIDATION_ONLY = "validation only"
# The Numba kernels of refdml.gpu._nb_gsp (CPU twin; CUDA, under the simulator in CI). The
# inputs below (B = 2 images, n = 4, m = 3, d = 3) are small enough for the simulator.
KERNELS = ("cpu", "cuda")


def _mixed_norms(rng: np.random.Generator, shape: tuple[int, ...], radii) -> np.ndarray:
    # Rows inside and outside the unit ball, none near the sphere (the kink of the clip).
    x = rng.standard_normal(shape)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    return x * np.resize(np.asarray(radii), shape[:-1])[..., None]


def _cost_map_inputs(rng: np.random.Generator) -> dict:
    return {
        "features": _mixed_norms(rng, (2, 4, 3), [0.4, 0.8, 1.5, 2.5]),
        "prototypes": _mixed_norms(rng, (3, 3), [0.6, 1.3, 2.0]),
    }


def _pool_inputs(rng: np.random.Generator) -> dict:
    return {**_cost_map_inputs(rng), "mu": 0.4, "inverse_temperature": 3.0}


def _positive_pool_inputs(rng: np.random.Generator) -> dict:
    return {
        "features": rng.uniform(0.1, 0.6, (2, 4, 3)),
        "prototypes": _mixed_norms(rng, (3, 3), [0.6, 1.3, 2.0]),
        "mu": 0.4,
        "inverse_temperature": 3.0,
        "p": 3.0,
    }


def _cost_inputs(rng: np.random.Generator) -> dict:
    return {"cost": rng.uniform(0.0, 2.0, (2, 3, 4)), "mu": 0.4, "inverse_temperature": 3.0}


def _wt_forward(cost, **hyperparameters):
    result = weight_transport(cost, **hyperparameters)
    return (result.rho, result.pi), result


def _wt_mirror_forward(cost, **hyperparameters):
    result = fast.weight_transport(cost, **hyperparameters)
    return (result.rho, result.pi), result


OPERATORS = (
    OperatorSpec(
        name="gsp.cost_map",
        forward=cost_map_forward,
        backward=cost_map_backward,
        make_inputs=_cost_map_inputs,
        paper="GSP Alg. 2: c_ij = ||wbar_i - fbar_j||, ubar = u / max(1, ||u||)",
        mirror=fast.cost_map_forward,
        mirror_backward=fast.cost_map_backward,
    ),
    OperatorSpec(
        name="gsp.weight_transport",
        forward=_wt_forward,
        backward=weight_transport_backward,
        make_inputs=_cost_inputs,
        paper="GSP (P2), Prop. 4.2 (exact root of the marginal equation), Prop. 4.3 closed form",
        mirror=_wt_mirror_forward,
        mirror_backward=fast.weight_transport_backward,
        mirror_kernels=KERNELS,
    ),
    OperatorSpec(
        name="gsp.weight_transport_unrolled",
        # tol = 0: a fixed count of 7 iterations (no ConvergenceWarning by the tol = 0 rule).
        forward=functools.partial(_wt_forward, method="fixed_point", max_iter=7, tol=0.0),
        backward=weight_transport_backward_unrolled,
        make_inputs=_cost_inputs,
        paper="GSP Prop. 4.2 / Alg. 3 forward, k = 7 iterations, differentiated by unrolling",
        no_mirror=VALIDATION_ONLY,
    ),
    OperatorSpec(
        name="gsp.pool",
        forward=gsp_pool_forward,
        backward=gsp_pool_backward,
        make_inputs=_pool_inputs,
        paper="GSP Alg. 2, Eqs. (4.1) and (4.3) with (P2) and Prop. 4.3",
        mirror=fast.gsp_pool_forward,
        mirror_backward=fast.gsp_pool_backward,
        mirror_kernels=KERNELS,
    ),
    OperatorSpec(
        name="gsp.pool_gemean",
        forward=gsp_pool_forward,
        backward=gsp_pool_backward,
        make_inputs=_positive_pool_inputs,
        paper="GSP Alg. 2, GeMean + GSP (p > 1) and Eq. (4.3)",
        mirror=fast.gsp_pool_forward,
        mirror_backward=fast.gsp_pool_backward,
        mirror_kernels=KERNELS,
    ),
    OperatorSpec(
        name="gsp.pool_unrolled",
        forward=functools.partial(
            gsp_pool_forward, method="fixed_point", max_iter=6,
            tol=0.0, backward="unrolled",
        ),
        backward=gsp_pool_backward,
        make_inputs=_pool_inputs,
        paper="GSP Alg. 2 with Alg. 3 (k = 6 iterations), unrolled backward",
        no_mirror=VALIDATION_ONLY,
    ),
)
