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

import dataclasses
import functools

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    replaced,
    scaled,
    with_entry,
    with_inf,
    with_nan,
    without_axis,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu import ot as fast
from refdml.ot import entropic_ot_backward, entropic_ot_forward, pairwise_sinkhorn_divergence_backward, pairwise_sinkhorn_divergence_forward, sinkhorn_divergence_backward, sinkhorn_divergence_forward, wcontrastive_backward, wcontrastive_forward, wtriplet_backward, wtriplet_forward

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


def _divergence_pot_inputs(rng: np.random.Generator) -> dict:
    return {**_divergence_inputs(rng), "solver": "pot"}


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


# --- hard and bad inputs ------------------------------------------------------------------
# Every case keeps make_inputs' tol = 1e-12 and max_iter = 5000 and converges within them
# (the CI test turns a ConvergenceWarning into a failure): small eps is taken on geometries
# whose transport problems have a unique, well-separated optimum, where Sinkhorn converges
# at any eps; near-degenerate ones (ties of the LP) would need ~1/eps iterations.

_F64 = ("float64",)


def _largest_cost(inputs: dict) -> float:
    """The largest ground cost ``||x - y||^p`` among all the points of the inputs."""
    names = [k for k in ("x", "y", "clouds", "features") if k in inputs]
    points = np.concatenate([np.reshape(inputs[k], (-1, np.shape(inputs[k])[-1]))
                             for k in names])
    peak = max(float(np.max(np.abs(points))), np.finfo(np.float64).tiny)
    unit = points / peak
    distance = np.max(np.linalg.norm(unit[:, None] - unit[None], axis=-1))
    with np.errstate(over="ignore", under="ignore"):
        return float((distance * peak) ** float(inputs["p"]))


def _relative_eps(inputs: dict, ratio: float) -> dict:
    largest = float(np.max(np.abs(inputs["cost"]))) if "cost" in inputs else _largest_cost(inputs)
    return replaced(inputs, eps=ratio * largest)


def _rescaled(inputs: dict, factor: float) -> dict:
    """Points (or the cost) times ``factor``, and ``eps`` (and a margin) with the cost:
    the same problem in other units."""
    if "cost" in inputs:
        return replaced(scaled(inputs, factor, "cost"), eps=inputs["eps"] * factor)
    names = [k for k in ("x", "y", "clouds", "features") if k in inputs]
    cost_factor = factor ** float(inputs["p"])
    out = replaced(scaled(inputs, factor, *names), eps=inputs["eps"] * cost_factor)
    if "margin" in inputs:
        out["margin"] = inputs["margin"] * cost_factor
    return out


def _separated(rng: np.random.Generator, n_images: int, n_points: int = 3) -> np.ndarray:
    """Images whose points sit near the vertices of one regular polygon (radius 0.5), each
    image jittered by at most 0.04: the matching of vertex to vertex is the unique optimum
    of every transport problem, with a gap far above eps, and no two points coincide."""
    angles = 2.0 * np.pi * np.arange(n_points) / n_points
    vertices = 0.5 * np.stack([np.cos(angles), np.sin(angles)], axis=-1)
    return vertices + rng.uniform(-0.04, 0.04, (n_images, n_points, 2))


_TINY_WHY = ("scaled by 1e-150 with eps (and any margin) scaled alike: the same problem in "
             "other units, its value and the weights' gradients scaled exactly; an "
             "implementation with absolute floors (an eps clamp, 1e-8 added to the kernel or "
             "the distances, an absolute tol on the potentials) returns another problem's "
             "answer")
_HUGE_WHY = ("scaled by 1e150 with eps (and any margin) scaled alike: exp(-C / eps) stays "
             "the same while C and the potentials are ~1e150 (their squares would overflow)")
_LARGE_EPS_WHY = ("eps = 1e6 times the largest cost (of 1e12 allowed): the plan is the "
                  "independent coupling to ~1e-6, and <a, f> + <b, g> cancels potentials "
                  "~1e6 times the value: a naive dual value keeps ~10 digits, a non-log "
                  "kernel is all ones")


def _ot_reference_inputs(rng: np.random.Generator, *, make_inputs) -> tuple[Case, ...]:
    base = make_inputs(rng)
    cost = base["cost"]
    diagonal = cost.copy()
    k = np.arange(min(cost.shape[-2:]))
    diagonal[..., k, k] = 0.0
    return (
        Case("small eps (1e-3 of the largest cost)", _relative_eps(base, 1e-3),
             "exp(-C / eps) underflows float64 (exp(-1000)): a kernel-domain Sinkhorn has "
             "rows of zeros and returns NaN; the log domain converges to the near-LP plan"),
        Case("large eps (1e6 of the largest cost)", _relative_eps(base, 1e6), _LARGE_EPS_WHY),
        Case("zero costs on the diagonal", replaced(base, cost=diagonal),
             "C_ii = 0 (a point transported to itself): log(C) or C^(p-1)-style terms are "
             "-inf or NaN there; the plan and its gradient are smooth"),
        Case("all costs zero", replaced(base, cost=np.zeros_like(cost)),
             "C == 0: every plan is optimal for the cost, the entropic one is a b^T, the value "
             "0 at any eps; a relative-eps check or a normalisation by max C divides by 0"),
        Case("tiny scale (1e-150)", _rescaled(base, 1e-150), _TINY_WHY, dtypes=_F64),
        Case("huge scale (1e150)", _rescaled(base, 1e150), _HUGE_WHY, dtypes=_F64),
        Case("float32 edge: eps = 1/150 of the largest cost", _relative_eps(base, 1.0 / 150),
             "exp(-C / eps) ~ exp(-150) underflows float32 (below ~exp(-103)) but not "
             "float64: a float32 kernel-domain Sinkhorn loses rows; the value is "
             "representable", dtypes=("float32",)),
    )


def _ot_error_inputs(rng: np.random.Generator, *, make_inputs, batched: bool = False
                     ) -> tuple[ErrorCase, ...]:
    base = make_inputs(rng)
    cases = (
        with_nan(base, "cost"),
        with_inf(base, "cost"),
        ErrorCase("a negative weight", with_entry(base, "a", -0.5), ValueError,
                  r"^a must be positive"),
        ErrorCase("a zero weight", with_entry(base, "b", 0.0), ValueError,
                  r"^b must be positive"),
        ErrorCase("cost flattened to 1-d", replaced(base, cost=base["cost"].ravel()),
                  ValueError, r"^cost must have at least 2 dimensions"),
        ErrorCase("a of the wrong length", replaced(base, a=np.ones(5)), ValueError,
                  r"^a has 5 entries along its last axis, expected 4"),
        bad_scalar(base, "eps", 0.0),
        ErrorCase("eps too small for float64", _relative_eps(base, 1e-20), ValueError,
                  r"^eps == .* times the largest cost, below 1e-13"),
        ErrorCase("an unknown value", replaced(base, value="sinkhorn2"), ValueError,
                  r"^value == 'sinkhorn2', must be one of"),
    )
    if batched:
        cases += (ErrorCase("batch shapes that do not broadcast",
                            replaced(base, b=np.ones((3, 3))), ValueError,
                            r"^b has batch shape \(3,\)"),)
    return cases


def _ot_invariants(inputs, outputs, *, transport_cost: bool) -> dict:
    """Per problem, ``min C <= <pi, C> <= max C``; the regularised value also
    ``<= <a, C b>`` (the independent coupling, KL 0), and ``>= <pi, C> >= min C``.
    Relative to the largest ``|C|`` or ``eps`` (the dual value ``<a, f> + <b, g>`` carries
    a rounding of ~``eps`` ulps: at C == 0 it is a few 1e-17 eps, not 0)."""
    cost = np.asarray(inputs["cost"], dtype=np.float64)
    a = np.asarray(inputs["a"], dtype=np.float64)
    b = np.asarray(inputs["b"], dtype=np.float64)
    a, b = a / a.sum(axis=-1, keepdims=True), b / b.sum(axis=-1, keepdims=True)
    value = np.asarray(outputs[0], dtype=np.float64)
    low = cost.min(axis=(-2, -1))
    high = cost.max(axis=(-2, -1)) if transport_cost else np.einsum(
        "...i,...ij,...j->...", a, cost, b)
    scale = max(float(np.max(np.abs(cost))), float(inputs["eps"]))
    return {"above min C": float(np.max(np.maximum(low - value, 0.0)) / scale),
            "below its upper bound": float(np.max(np.maximum(value - high, 0.0)) / scale)}


def _pairs_reference_inputs(rng: np.random.Generator, *, make_inputs) -> tuple[Case, ...]:
    """Cases of the divergences (x, y) and of the all-pairs divergence (clouds)."""
    base = make_inputs(rng)
    separated = _separated(rng, 3)
    if "clouds" in base:
        same = base["clouds"].copy()
        same[2] = same[0]
        duplicate = base["clouds"].copy()
        duplicate[1, 2] = duplicate[1, 0]
        duplicate[2, 1] = duplicate[0, 1]
        identical, coincident = replaced(base, clouds=same), replaced(base, clouds=duplicate)
        small = replaced(base, clouds=separated)
    else:
        identical = replaced(base, y=base["x"].copy(), b=base["a"].copy())
        x = base["x"].copy()
        x[3] = x[0]
        y = base["y"].copy()
        y[1] = x[2]
        coincident = replaced(base, x=x, y=y)
        small = replaced(base, x=separated[0], y=separated[1], a=base["a"][:3])
    return (
        Case("identical clouds (SD == 0)", identical,
             "SD(mu, mu) = 0 exactly: without the debiasing terms OT_eps(mu, mu) > 0 is "
             "returned; every cost ||x_i - x_j||^p of the cross problem has zeros, where "
             "(p < 2) the gradient p D^(p-2) (x - y) is 0 * inf in a naive backward",
             scale_inputs=base),
        Case("duplicate and coincident points", coincident,
             "repeated points within a cloud and points shared across clouds: zero costs "
             "off the diagonal, the subgradient 0 of ||x - y||^p there (p < 2)"),
        Case("small eps (1/100 of the largest cost)", _relative_eps(small, 0.01),
             "exp(-C / eps) ~ exp(-100) underflows float32 and is ~1e-44 in float64: a "
             "kernel-domain Sinkhorn in float32 loses its rows, a solver stopped early "
             "returns a visibly different divergence"),
        Case("large eps (1e6 of the largest cost)", _relative_eps(base, 1e6), _LARGE_EPS_WHY),
        Case("tiny scale (1e-150)", _rescaled(base, 1e-150), _TINY_WHY, dtypes=_F64),
        Case("huge scale (1e150)", _rescaled(base, 1e150), _HUGE_WHY, dtypes=_F64),
    )


def _divergence_error_inputs(rng: np.random.Generator, *, make_inputs) -> tuple[ErrorCase, ...]:
    base = make_inputs(rng)
    return (
        with_nan(base, "x"),
        with_inf(base, "y"),
        ErrorCase("x flattened to 1-d", replaced(base, x=base["x"].ravel()), ValueError,
                  r"^x must have 2 dimensions"),
        ErrorCase("x and y of different dimensions", replaced(base, y=np.ones((3, 3))),
                  ValueError, r"^x and y must have the same dimension"),
        ErrorCase("a negative weight", with_entry(base, "a", -1.0), ValueError,
                  r"^a must be positive"),
        bad_scalar(base, "p", 0.5),
        bad_scalar(base, "eps", -0.5),
        ErrorCase("eps too large for float64", _relative_eps(base, 1e20), ValueError,
                  r"^eps == .* above 1e\+12"),
    )


def _divergence_pot_error_inputs(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    base = _divergence_pot_inputs(rng)
    return _divergence_error_inputs(rng, make_inputs=_divergence_pot_inputs) + (
        ErrorCase("an unknown solver", replaced(base, solver="sinkhorn_log"), ValueError,
                  r"^solver == 'sinkhorn_log', must be one of \('refdml', 'pot'\)"),
    )


def _pairwise_error_inputs(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    base = _pairwise_inputs(rng)
    return (
        with_nan(base, "clouds"),
        with_inf(base, "clouds"),
        without_axis(base, "clouds"),
        bad_scalar(base, "p", 0.5),
        bad_scalar(base, "eps", 0.0),
        ErrorCase("an unknown value", replaced(base, value="debiased"), ValueError,
                  r"^value == 'debiased', must be one of"),
    )


def _divergence_invariants(inputs, outputs, *, nonnegative: bool) -> dict:
    """|SD| <= the largest cost (each term lies in [0, max C]); the regularised divergence
    with p <= 2 is also >= 0 (Feydy et al. 2019). Relative to the largest cost."""
    value = np.asarray(outputs[0], dtype=np.float64)
    scale = max(_largest_cost(inputs), np.finfo(np.float64).tiny)
    residuals = {"|SD| <= max C": float(max(0.0, np.max(np.abs(value)) - scale) / scale)}
    if nonnegative and inputs.get("value", "regularized") == "regularized" and inputs["p"] <= 2:
        residuals["SD >= 0"] = float(max(0.0, -np.min(value)) / scale)
    return residuals


def _pairwise_invariants(inputs, outputs) -> dict:
    """Symmetric, 0 on the diagonal, and the divergence's own bounds."""
    value = np.asarray(outputs[0], dtype=np.float64)
    scale = max(_largest_cost(inputs), np.finfo(np.float64).tiny)
    return {"symmetric": float(np.max(np.abs(value - value.T)) / scale),
            "0 on the diagonal": float(np.max(np.abs(np.diag(value))) / scale),
            **_divergence_invariants(inputs, outputs, nonnegative=True)}


def _loss_reference_inputs(rng: np.random.Generator, *, make_inputs) -> tuple[Case, ...]:
    base = make_inputs(rng)
    same = base["features"].copy()
    # Image 0 copied onto image 1 and, where 1 is of another class, onto image 2 (of
    # image 0's class in the p = 1 entry): an identical positive pair in both entries.
    same[1] = same[0]
    if base["labels"][1] != base["labels"][0]:
        same[2] = same[0]
    return (
        Case("identical images (d_w == 0)", replaced(base, features=same),
             "two images with the same features: d_w = 0 exactly, zero costs between "
             "coincident points (p = 1: the gradient is 0 * inf in a naive backward) and, "
             "without debiasing, a positive d_w"),
        Case("no positive pair", replaced(base, labels=np.arange(4)),
             "every label distinct: no positive pair (contrastive: negatives only) and no "
             "triplet (loss 0, gradient 0): a mean over an empty set is 0 / 0"),
        Case("a single class (no negative)", replaced(base, labels=np.zeros(4, dtype=np.int64)),
             "no negative pair or triplet: the hinges are absent, not [gamma - 0]_+"),
        Case("small eps (1/100 of the largest cost)",
             _relative_eps(replaced(base, features=_separated(rng, 4)), 0.01),
             "exp(-C / eps) ~ exp(-100) underflows float32: a kernel-domain Sinkhorn in "
             "float32 loses its rows, a solver stopped early changes d_w"),
        Case("large eps (1e6 of the largest cost)", _relative_eps(base, 1e6), _LARGE_EPS_WHY),
        Case("tiny scale (1e-150)", _rescaled(base, 1e-150), _TINY_WHY, dtypes=_F64),
        Case("huge scale (1e150)", _rescaled(base, 1e150), _HUGE_WHY, dtypes=_F64),
    )


def _loss_error_inputs(rng: np.random.Generator, *, make_inputs) -> tuple[ErrorCase, ...]:
    base = make_inputs(rng)
    return (
        with_nan(base, "features"),
        without_axis(base, "features"),
        ErrorCase("labels of the wrong length", replaced(base, labels=np.array([0, 1, 0])),
                  ValueError, r"^labels has length 3, but 4 labels are needed"),
        ErrorCase("labels not integers", replaced(base, labels=np.array([0.5, 0.0, 1.0, 1.0])),
                  TypeError, r"^labels must hold integer labels"),
        bad_scalar(base, "margin", -1.0),
        bad_scalar(base, "eps", 0.0),
        bad_scalar(base, "p", 0.5),
    )


def _loss_invariants(inputs, outputs) -> dict:
    """The loss is a mean of hinges (triplet) or of ``d_w >= 0`` and hinges (contrastive,
    regularised divergences, p <= 2): ``>= 0``, relative to margin + the largest cost."""
    value = float(np.asarray(outputs[0], dtype=np.float64))
    scale = max(float(inputs["margin"]) + _largest_cost(inputs), np.finfo(np.float64).tiny)
    return {"loss >= 0": max(0.0, -value) / scale}


OPERATORS = (
    OperatorSpec(
        name="ot.entropic_ot",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_inputs,
        paper="Wasserstein DML Eq. (3): W_{p,eta}^p, regularised value",
        reference_inputs=functools.partial(_ot_reference_inputs, make_inputs=_ot_inputs),
        error_inputs=functools.partial(_ot_error_inputs, make_inputs=_ot_inputs),
        invariants=functools.partial(_ot_invariants, transport_cost=False),
    ),
    OperatorSpec(
        name="ot.entropic_ot_batched",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_batch_inputs,
        paper="Wasserstein DML Eq. (3), a batch of problems with broadcast weights",
        reference_inputs=functools.partial(_ot_reference_inputs, make_inputs=_ot_batch_inputs),
        error_inputs=functools.partial(_ot_error_inputs, make_inputs=_ot_batch_inputs,
                                       batched=True),
        invariants=functools.partial(_ot_invariants, transport_cost=False),
    ),
    OperatorSpec(
        name="ot.entropic_ot_transport_cost",
        forward=entropic_ot_forward,
        mirror=fast.entropic_ot_forward,
        mirror_backward=fast.entropic_ot_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the log-sum-exp half-step kernels
        backward=entropic_ot_backward,
        make_inputs=_ot_transport_inputs,
        paper="Wasserstein DML Eq. (3): <pi, C> of the entropic plan (implicit gradient)",
        reference_inputs=functools.partial(_ot_reference_inputs,
                                           make_inputs=_ot_transport_inputs),
        error_inputs=functools.partial(_ot_error_inputs, make_inputs=_ot_transport_inputs),
        invariants=functools.partial(_ot_invariants, transport_cost=True),
    ),
    OperatorSpec(
        name="ot.sinkhorn_divergence",
        forward=sinkhorn_divergence_forward,
        mirror=fast.sinkhorn_divergence_forward,
        mirror_backward=fast.sinkhorn_divergence_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the log-sum-exp half-step kernels
        backward=sinkhorn_divergence_backward,
        make_inputs=_divergence_inputs,
        paper="Wasserstein DML Eq. (4): SD_{p,eta}",
        reference_inputs=functools.partial(_pairs_reference_inputs,
                                           make_inputs=_divergence_inputs),
        error_inputs=functools.partial(_divergence_error_inputs, make_inputs=_divergence_inputs),
        invariants=functools.partial(_divergence_invariants, nonnegative=True),
    ),
    OperatorSpec(
        name="ot.sinkhorn_divergence_pot",
        forward=sinkhorn_divergence_forward,
        backward=sinkhorn_divergence_backward,
        make_inputs=_divergence_pot_inputs,
        paper="Wasserstein DML Eq. (4): SD_{p,eta}, the potentials from POT's log-domain "
              "Sinkhorn (solver='pot')",
        no_mirror="the reference's second solver; refdml.gpu.ot mirrors the divergence "
                  "with refdml's own (entry ot.sinkhorn_divergence)",
        reference_inputs=functools.partial(_pairs_reference_inputs,
                                           make_inputs=_divergence_pot_inputs),
        error_inputs=_divergence_pot_error_inputs,
        invariants=functools.partial(_divergence_invariants, nonnegative=True),
    ),
    OperatorSpec(
        name="ot.sinkhorn_divergence_transport_cost",
        forward=sinkhorn_divergence_forward,
        mirror=fast.sinkhorn_divergence_forward,
        mirror_backward=fast.sinkhorn_divergence_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the log-sum-exp half-step kernels
        backward=sinkhorn_divergence_backward,
        make_inputs=_divergence_transport_inputs,
        paper="Wasserstein DML Eq. (4) with <pi, C> in place of W_{p,eta}",
        reference_inputs=functools.partial(_pairs_reference_inputs,
                                           make_inputs=_divergence_transport_inputs),
        error_inputs=functools.partial(_divergence_error_inputs,
                                       make_inputs=_divergence_transport_inputs),
        invariants=functools.partial(_divergence_invariants, nonnegative=False),
    ),
    OperatorSpec(
        name="ot.pairwise_sinkhorn_divergence",
        forward=pairwise_sinkhorn_divergence_forward,
        mirror=fast.pairwise_sinkhorn_divergence_forward,
        mirror_backward=fast.pairwise_sinkhorn_divergence_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the small-problem Sinkhorn kernels
        backward=pairwise_sinkhorn_divergence_backward,
        make_inputs=_pairwise_inputs,
        paper="Wasserstein DML Eq. (4), all pairs of images (the divergences of Eq. (6))",
        reference_inputs=functools.partial(_pairs_reference_inputs,
                                           make_inputs=_pairwise_inputs),
        error_inputs=_pairwise_error_inputs,
        invariants=_pairwise_invariants,
    ),
    OperatorSpec(
        name="ot.wcontrastive",
        forward=wcontrastive_forward,
        mirror=fast.wcontrastive_forward,
        mirror_backward=fast.wcontrastive_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the small-problem Sinkhorn kernels
        backward=wcontrastive_backward,
        make_inputs=_loss_inputs,
        paper="Wasserstein DML Eq. (1)",
        reference_inputs=functools.partial(_loss_reference_inputs, make_inputs=_loss_inputs),
        error_inputs=functools.partial(_loss_error_inputs, make_inputs=_loss_inputs),
        invariants=_loss_invariants,
        wrt=("features",),
        tags=("loss",),
    ),
    OperatorSpec(
        name="ot.wcontrastive_p1",
        forward=wcontrastive_forward,
        mirror=fast.wcontrastive_forward,
        mirror_backward=fast.wcontrastive_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the small-problem Sinkhorn kernels
        backward=wcontrastive_backward,
        make_inputs=_loss_p1_inputs,
        paper="Wasserstein DML Eq. (1), p = 1 (d_w ~ W_1), transport-cost convention",
        reference_inputs=functools.partial(_loss_reference_inputs,
                                           make_inputs=_loss_p1_inputs),
        error_inputs=functools.partial(_loss_error_inputs, make_inputs=_loss_p1_inputs),
        # No sign constraint: with <pi, C> in place of the regularised value, d_w of a
        # positive pair may be negative.
        wrt=("features",),
        tags=("loss",),
    ),
    OperatorSpec(
        name="ot.wtriplet",
        forward=wtriplet_forward,
        mirror=fast.wtriplet_forward,
        mirror_backward=fast.wtriplet_backward,
        kernel_family=fast.IMPLEMENTATIONS,   # the small-problem Sinkhorn kernels
        backward=wtriplet_backward,
        make_inputs=_loss_inputs,
        paper="Wasserstein DML Eq. (2)",
        reference_inputs=functools.partial(_loss_reference_inputs, make_inputs=_loss_inputs),
        error_inputs=functools.partial(_loss_error_inputs, make_inputs=_loss_inputs),
        invariants=_loss_invariants,
        wrt=("features",),
        tags=("loss",),
    ),
)


def _roundoff(inputs) -> float:
    """The largest cost over ``eps``: every entry here solves entropic OT by Sinkhorn, whose
    fixed point amplifies the roundoff of its iterates by about that much (the dual is
    ``1/eps``-strongly curved along the cost's directions); at the tiny- and huge-scale
    cases ``eps`` scales with the cost and the ratio stays."""
    largest = float(np.max(np.abs(inputs["cost"]))) if "cost" in inputs else _largest_cost(inputs)
    return largest / float(inputs["eps"])


# Every entry solves Sinkhorn: a conformance check scales its float32 tolerance, stated at
# make_inputs (largest cost / eps <= 8), with this ratio at a harder case.
OPERATORS = tuple(dataclasses.replace(spec, roundoff=_roundoff) for spec in OPERATORS)
