"""Catalogue entries of ``refdml.gsp``: the cost map, (P2) and the pooling layer.

The LP solvers ``solve_p1_linprog`` / ``solve_p1_pot`` are validation only and have no
backward (the LP solution is piecewise constant in the cost), so they have no entry.
"""

from __future__ import annotations

import functools

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    bad_type,
    replaced,
    scaled,
    with_extra_axis,
    with_inf,
    with_nan,
    without_axis,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
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
# The mirrors run GSP's kernels (CPU twin; CUDA, under the simulator in CI). The inputs
# below (B = 2 images, n = 4, m = 3, d = 3) are small enough for the simulator.


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


# --- hard and bad inputs ------------------------------------------------------------------

_F64 = ("float64",)
# Hyperparameters beyond float32's range (1e300, 1e-300) are a float64 matter: a float32
# framework casts them to inf or 0.


def _coincident(inputs: dict) -> dict:
    """A prototype on a feature of image 0 (a zero cost) and a duplicate feature in image 1
    (two equal cost columns: a tie)."""
    features, prototypes = inputs["features"].copy(), inputs["prototypes"].copy()
    prototypes[0] = features[0, 1]
    features[1, 3] = features[1, 0]
    return replaced(inputs, features=features, prototypes=prototypes)


def _unit_sphere(inputs: dict) -> dict:
    """Features and prototypes of norm exactly 1 (signed axis vectors): the clip's kink."""
    batch, n, d = inputs["features"].shape
    axes = np.concatenate([np.eye(d), -np.eye(d)])
    features = np.stack([axes[(np.arange(n) + b) % (2 * d)] for b in range(batch)])
    prototypes = axes[[1, 3, 5][: inputs["prototypes"].shape[0]]]
    return replaced(inputs, features=features, prototypes=prototypes)


def _float32_features(inputs: dict) -> dict:
    """Features of ~1e30 (squared norms overflow float32) and one of ~1e-30 (they
    underflow), every output representable in float32."""
    features = inputs["features"] * 1e30
    features[:, 0] *= 1e-60
    return replaced(inputs, features=features)


def _cost_map_reference_inputs(rng: np.random.Generator) -> tuple[Case, ...]:
    base = _cost_map_inputs(rng)
    return (
        Case("a prototype on a feature, duplicate features", _coincident(base),
             "c_ij = 0 exactly: the gradient (w_i - f_j) / c_ij is 0 / 0, NaN in a naive "
             "implementation; the reference takes the subgradient 0. Duplicate features "
             "give equal cost columns and must get equal gradients"),
        Case("points on the unit sphere", _unit_sphere(base),
             "||u|| == 1 exactly, the kink of u / max(1, ||u||): the reference takes the "
             "identity branch; mixing the branches changes the gradient"),
        Case("tiny scale (1e-200)", scaled(base, 1e-200, "features", "prototypes"),
             "squared norms underflow to 0 below ~1e-162: a naive distance is 0 (a false "
             "coincidence) and its gradient NaN; the costs are ~1e-200", dtypes=_F64),
        Case("huge scale (1e200)", scaled(base, 1e200, "features", "prototypes"),
             "squared norms overflow above ~1e154: a naive clip divides by inf and maps "
             "every point to 0; the clipped points are unit vectors, the costs O(1)",
             dtypes=_F64),
        Case("float32 edge", _float32_features(base),
             "float32 squared norms of 1e30 overflow and of 1e-30 underflow: the clip "
             "returns 0 (or NaN) where the costs are in [0, 2]", dtypes=("float32",)),
    )


def _cost_map_error_inputs(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    base = _cost_map_inputs(rng)
    return (
        with_nan(base, "features"),
        with_inf(base, "prototypes"),
        without_axis(base, "features"),
        with_extra_axis(base, "prototypes"),
        ErrorCase("last dimensions differ", replaced(base, prototypes=np.ones((3, 4))),
                  ValueError, r"^features and prototypes must have the same last dimension"),
        bad_type(base, "features", np.ones((2, 4, 3), dtype=bool), "features boolean"),
    )


def _cost_map_invariants(inputs, outputs) -> dict:
    """The clipped points lie in the unit ball: ``0 <= c <= 2`` (relative to 2)."""
    cost = np.asarray(outputs[0], dtype=np.float64)
    return {"in [0, 2]": float(max(0.0, -np.min(cost), np.max(cost) - 2.0) / 2.0)}


def _tied_cost(inputs: dict) -> dict:
    """Zeros on a diagonal of image 0 (prototype i on feature i) and, in image 1, two equal
    columns and a column of equal entries."""
    cost = inputs["cost"].copy()
    m = cost.shape[1]
    cost[0, np.arange(m), np.arange(m)] = 0.0
    cost[1, :, 3] = cost[1, :, 2]
    cost[1, :, 1] = 0.75
    return replaced(inputs, cost=cost)


def _transport_reference_inputs(rng: np.random.Generator) -> tuple[Case, ...]:
    base = _cost_inputs(rng)
    return (
        Case("huge inverse temperature (1e300)", replaced(base, inverse_temperature=1e300),
             "ε c overflows float64 and exp(-ε c) is 0 for every entry: a naive Sinkhorn-"
             "type update divides 0 by 0 (NaN); the solution is the LP (P1)'s and the "
             "gradient 0 away from ties", dtypes=_F64),
        Case("tiny inverse temperature (1e-300)", replaced(base, inverse_temperature=1e-300),
             "the weights are uniform to 1e-300 and the gradient ~1e-300: an implementation "
             "that clamps ε, or forms c / (1/ε), returns wrong or non-finite values",
             dtypes=_F64),
        Case("mu near 0 (1e-300)", replaced(base, mu=1e-300),
             "pi ~ 1e-300 / (m n) and 1 - n rho_j ~ 1e-300: forming 1 - n rho loses every "
             "digit (pi == 0, or negative), and t = exp(tau) underflows", dtypes=_F64),
        Case("mu near 1 (1 - 1e-12)", replaced(base, mu=1.0 - 1e-12),
             "kappa = 1 - mu - n rho^T rho and eta both go to 0: Prop. 4.3's eta / kappa is "
             "0 / 0 in a naive backward, and t = exp(tau) ~ 1e12 grows without bound"),
        Case("mu == 1 (Thm 4.1)", replaced(base, mu=1.0),
             "tau = +inf, rho = 0: the fixed point of Prop. 4.2 only approaches it and a "
             "naive backward divides 0 by 0; pi = softmax_i(-ε c) / n exactly"),
        Case("zero costs on a diagonal, tied columns", _tied_cost(base),
             "exact zeros and exact ties of the cost: the logits of tied features are "
             "equal (so must be their rho and gradients), and log(0)-style kernels fail"),
        Case("tiny costs (1e-150) at a huge inverse temperature (3e150)",
             replaced(scaled(base, 1e-150, "cost"), inverse_temperature=3e150),
             "ε c is the same as at scale 1, so the solution is; the gradient scales as ε "
             "(~1e150): an implementation that forms ε and c separately in a kernel "
             "exp(-c)^ε, or clamps the cost, differs", dtypes=_F64),
        Case("float32 edge: ε c ~ 200", replaced(base, inverse_temperature=100.0),
             "exp(-ε c) underflows float32 below ~exp(-103) (not float64): a kernel-domain "
             "float32 implementation loses whole columns; the log domain does not",
             dtypes=("float32",)),
    )


def _transport_error_inputs(rng: np.random.Generator, *, solver_args: bool = True
                            ) -> tuple[ErrorCase, ...]:
    base = _cost_inputs(rng)
    cases = (
        with_nan(base, "cost"),
        with_inf(base, "cost"),
        without_axis(base, "cost"),
        bad_scalar(base, "mu", 0.0),
        bad_scalar(base, "mu", 1.5),
        bad_scalar(base, "inverse_temperature", 0.0),
        bad_scalar(base, "inverse_temperature", float("nan")),
    )
    if solver_args:  # the unrolled entry binds its own method, max_iter and tol
        cases += (ErrorCase("unknown method", replaced(base, method="sinkhorn"), ValueError,
                            r"^method == 'sinkhorn', must be one of"),)
    return cases


def _transport_residuals(inputs, outputs, *, columns: bool) -> dict:
    """(P2)'s constraints on ``rho`` (B, n), ``pi`` (B, m, n): ``rho, pi >= 0``,
    ``rho_j + sum_i pi_ij = 1/n`` (relative to 1/n), ``sum_ij pi_ij = mu`` (relative to mu)."""
    rho = np.asarray(outputs[0], dtype=np.float64)
    pi = np.asarray(outputs[1], dtype=np.float64)
    n, mu = rho.shape[-1], float(inputs["mu"])
    residuals = {
        "non-negative": float(max(0.0, -np.min(rho), -np.min(pi)) * n),
        "mass": float(np.max(np.abs(pi.sum(axis=(-2, -1)) - mu)) / mu),
    }
    if columns:
        residuals["columns"] = float(np.max(np.abs(rho + pi.sum(axis=-2) - 1.0 / n)) * n)
    return residuals


def _pool_reference_inputs(rng: np.random.Generator, *, make_inputs, gemean: bool = False
                           ) -> tuple[Case, ...]:
    base = make_inputs(rng)
    cases = [
        Case("huge inverse temperature (1e300)", replaced(base, inverse_temperature=1e300),
             "exp(-ε c) is 0 for every entry: a naive (P2) solver divides 0 by 0; the "
             "weights are the LP's and the cost gradient 0", dtypes=_F64),
        Case("tiny inverse temperature (1e-300)", replaced(base, inverse_temperature=1e-300),
             "the weights are uniform to 1e-300 (GAP-like): ε must not be clamped",
             dtypes=_F64),
        Case("mu near 0 (1e-300)", replaced(base, mu=1e-300),
             "the weights (1 - n rho_j) / mu are O(1) although 1 - n rho_j ~ 1e-300: forming "
             "1 - n rho gives 0 (pooled == 0) and 1 / mu overflows the backward",
             dtypes=_F64),
        Case("mu == 1 (GAP, Thm 4.1)", replaced(base, mu=1.0),
             "pooled is the mean of the features exactly; tau = inf and a naive backward's "
             "eta / kappa is 0 / 0"),
        Case("a prototype on a feature, duplicate features, ε = 1e6",
             replaced(_coincident(base), inverse_temperature=1e6),
             "a zero cost (NaN gradient of the distance in a naive cost map) and tied "
             "features at a sharp ε: tied features share their weight exactly"),
        Case("tiny scale (1e-200)", scaled(base, 1e-200, "features", "prototypes"),
             "squared norms underflow: a naive cost map is 0 everywhere (all ties) and its "
             "gradient NaN", dtypes=_F64),
        Case("huge scale (1e200)", scaled(base, 1e200, "features", "prototypes"),
             "squared norms overflow: a naive clip maps every point to 0; pooled ~1e200 is "
             "representable", dtypes=_F64),
        Case("float32 edge", _float32_features(base),
             "float32 squared norms of 1e30 overflow (the naive cost map is NaN) while "
             "pooled ~1e30 is representable", dtypes=("float32",)),
    ]
    if gemean:
        zeros = base["features"].copy()
        zeros[:, :, 1] = 0.0
        cases += [
            Case("large p (1000)", replaced(base, p=1000.0),
                 "(w f)^1000 underflows to 0 for f < 0.5: a naive power mean is 0 and its "
                 "gradient 0 * inf; GeMean tends to max pooling"),
            Case("an all-zero feature dimension", replaced(base, features=zeros),
                 "pooled_c = 0 where every feature is 0 in dimension c: the derivative of "
                 "s^(1/p) at s = 0 is inf, times (w f)^(p-1) = 0: NaN in a naive backward"),
        ]
    return tuple(cases)


def _pool_error_inputs(rng: np.random.Generator, *, make_inputs, gemean: bool = False
                       ) -> tuple[ErrorCase, ...]:
    base = make_inputs(rng)
    cases = [
        with_nan(base, "features"),
        with_inf(base, "prototypes"),
        without_axis(base, "features"),
        bad_scalar(base, "mu", 0.0),
        ErrorCase("mu subnormal", replaced(base, mu=1e-310), ValueError,
                  r"^mu == 1e-310 is subnormal"),
        bad_scalar(base, "inverse_temperature", -3.0),
        bad_scalar(base, "p", 0.5),
    ]
    if gemean:
        negative = base["features"].copy()
        negative[1, 2, 0] = -0.25
        cases.append(ErrorCase("a negative feature with p > 1",
                               replaced(base, features=negative), ValueError,
                               r"^features\[\(1, 2, 0\)\] == .* is negative"))
    return tuple(cases)


def _pool_residuals(inputs, outputs, *, convex: bool) -> dict:
    """``z`` (B, m) in the simplex (Eq. 4.3: ``z = pi^T 1 / mu``); for ``p = 1``, pooled
    (B, d) is a convex combination of the image's features (weights ``w_j / n >= 0`` summing
    to 1), so it lies in their bounding box (relative to the features' scale)."""
    pooled = np.asarray(outputs[0], dtype=np.float64)
    z = np.asarray(outputs[1], dtype=np.float64)
    residuals = {"z sums to 1": float(np.max(np.abs(z.sum(axis=-1) - 1.0))),
                 "z non-negative": float(max(0.0, -np.min(z)))}
    if convex:
        features = np.asarray(inputs["features"], dtype=np.float64)
        low, high = features.min(axis=1), features.max(axis=1)
        scale = np.maximum(np.max(np.abs(features), axis=1), np.finfo(np.float64).tiny)
        outside = np.maximum(low - pooled, 0.0) + np.maximum(pooled - high, 0.0)
        residuals["pooled in the features' box"] = float(np.max(outside / scale))
    return residuals


def _wt_forward(cost, **hyperparameters):
    """:func:`weight_transport` as a forward, ``((rho, pi), result)``; parameters as in
    :func:`weight_transport`."""
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
        reference_inputs=_cost_map_reference_inputs,
        error_inputs=_cost_map_error_inputs,
        invariants=_cost_map_invariants,
        mirror=fast.cost_map_forward,
        mirror_backward=fast.cost_map_backward,
    ),
    OperatorSpec(
        name="gsp.weight_transport",
        forward=_wt_forward,
        backward=weight_transport_backward,
        make_inputs=_cost_inputs,
        paper="GSP (P2), Prop. 4.2 (exact root of the marginal equation), Prop. 4.3 closed form",
        reference_inputs=_transport_reference_inputs,
        error_inputs=_transport_error_inputs,
        invariants=functools.partial(_transport_residuals, columns=True),
        mirror=_wt_mirror_forward,
        mirror_backward=fast.weight_transport_backward,
        kernel_family=fast.IMPLEMENTATIONS,
    ),
    OperatorSpec(
        name="gsp.weight_transport_unrolled",
        # tol = 0: a fixed count of 7 iterations (no ConvergenceWarning by the tol = 0 rule).
        forward=functools.partial(_wt_forward, method="fixed_point", max_iter=7, tol=0.0),
        backward=weight_transport_backward_unrolled,
        make_inputs=_cost_inputs,
        paper="GSP Prop. 4.2 / Alg. 3 forward, k = 7 iterations, differentiated by unrolling",
        reference_inputs=_transport_reference_inputs,
        error_inputs=functools.partial(_transport_error_inputs, solver_args=False),
        # Every fixed-point iterate holds the mass constraint to rounding; the column
        # constraints only at convergence, which 7 iterations do not reach.
        invariants=functools.partial(_transport_residuals, columns=False),
        no_mirror=VALIDATION_ONLY,
    ),
    OperatorSpec(
        name="gsp.pool",
        forward=gsp_pool_forward,
        backward=gsp_pool_backward,
        make_inputs=_pool_inputs,
        paper="GSP Alg. 2, Eqs. (4.1) and (4.3) with (P2) and Prop. 4.3",
        reference_inputs=functools.partial(_pool_reference_inputs, make_inputs=_pool_inputs),
        error_inputs=functools.partial(_pool_error_inputs, make_inputs=_pool_inputs),
        invariants=functools.partial(_pool_residuals, convex=True),
        mirror=fast.gsp_pool_forward,
        mirror_backward=fast.gsp_pool_backward,
        kernel_family=fast.IMPLEMENTATIONS,
    ),
    OperatorSpec(
        name="gsp.pool_gemean",
        forward=gsp_pool_forward,
        backward=gsp_pool_backward,
        make_inputs=_positive_pool_inputs,
        paper="GSP Alg. 2, GeMean + GSP (p > 1) and Eq. (4.3)",
        reference_inputs=functools.partial(
            _pool_reference_inputs, make_inputs=_positive_pool_inputs, gemean=True),
        error_inputs=functools.partial(
            _pool_error_inputs, make_inputs=_positive_pool_inputs, gemean=True),
        invariants=functools.partial(_pool_residuals, convex=False),
        mirror=fast.gsp_pool_forward,
        mirror_backward=fast.gsp_pool_backward,
        kernel_family=fast.IMPLEMENTATIONS,
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
        reference_inputs=functools.partial(_pool_reference_inputs, make_inputs=_pool_inputs),
        error_inputs=functools.partial(_pool_error_inputs, make_inputs=_pool_inputs),
        # 6 fixed-point iterations hold the mass (so z's sum) but not the columns, so the
        # pooling weights need not sum to n: pooled may leave the features' box.
        invariants=functools.partial(_pool_residuals, convex=False),
        no_mirror=VALIDATION_ONLY,
    ),
)
