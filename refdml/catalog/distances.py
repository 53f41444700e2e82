"""Catalogue entries of :mod:`refdml.distances`."""

from __future__ import annotations

import functools

import numpy as np

from refdml.catalog._cases import bad_type, replaced, scaled, with_inf, with_nan
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.distances import (
    cosine_backward,
    cosine_forward,
    euclidean_backward,
    euclidean_forward,
    sq_euclidean_backward,
    sq_euclidean_forward,
)
from refdml.gpu import distances as fast


def _two_sets(rng: np.random.Generator) -> dict:
    # A broadcast leading dimension, so the backward's sum over it is checked too.
    return {"x": rng.standard_normal((2, 4, 3)), "y": rng.standard_normal((1, 5, 3))}


def _self_inputs(rng: np.random.Generator) -> dict:
    x = rng.standard_normal((4, 3))
    return {"x": x, "y": x.copy()}


def _duplicates(rng: np.random.Generator) -> dict:
    # x repeats a point; y holds copies of two points of x and one new point.
    x = rng.standard_normal((4, 3))
    x[3] = x[1]
    return {"x": x, "y": np.stack([x[2], rng.standard_normal(3), x[1]])}


def _nearby(rng: np.random.Generator) -> dict:
    x = 10.0 * rng.standard_normal((4, 3))
    return {"x": x, "y": x[:3] + 1e-9 * rng.standard_normal((3, 3))}


def _float32_offset(rng: np.random.Generator) -> dict:
    # Points 1.5e19 from the origin, 1e18 apart: ||x||^2 ~ 7e38 overflows float32 (max
    # 3.4e38) while every ||x - y||^2 (~1e37) and ||x - y|| are representable.
    centre = np.full(3, 1.5e19)
    return {"x": centre + 1e18 * rng.standard_normal((4, 3)),
            "y": centre + 1e18 * rng.standard_normal((3, 3))}


def _float32_norms(rng: np.random.Generator) -> dict:
    # Rows of 1e30 and 1e-30 whose squared norms overflow and underflow float32.
    scales = np.array([1e30, 1e-30, 2e25, 1e-25])[:, None]
    return {"x": scales * rng.standard_normal((4, 3)),
            "y": scales[:3] * rng.standard_normal((3, 3))}


_COINCIDENT_WHY = {
    "euclidean": "D_ii = 0 exactly: the gradient (x_i - y_j) / D_ij is 0 / 0, NaN in a naive "
                 "implementation; the reference takes the subgradient 0 (the centre of the "
                 "unit ball), and a Gram-identity forward gives sqrt of a tiny negative, NaN",
    "sq_euclidean": "D_ii = 0 exactly: the Gram identity ||x||^2 + ||y||^2 - 2 x.y leaves a "
                    "rounding residue (even negative) instead of 0",
    "cosine": "S_ii = 1 exactly: a Gram-based similarity rounds above 1 (acos gives NaN "
              "downstream), and ties between equal rows must give equal gradients",
}


def _reference_inputs(rng: np.random.Generator, *, metric: str) -> tuple[Case, ...]:
    base = _two_sets(rng)
    cases = [
        Case("a cloud against itself (x == y)", _self_inputs(rng), _COINCIDENT_WHY[metric]),
        Case("duplicate and coincident points", _duplicates(rng),
             "repeated rows of x and rows of y equal to rows of x off the diagonal: the "
             "same 0 / 0 as x == y, where only some pairs coincide"),
    ]
    if metric == "sq_euclidean":
        cases += [
            Case("tiny scale (1e-150)", scaled(base, 1e-150, "x", "y"),
                 "squared distances ~1e-300 are still normal: a forward that rescales "
                 "carelessly (or clamps at 1e-12) returns 0 or the clamp",
                 dtypes=("float64",)),
            Case("huge scale (1e150)", scaled(base, 1e150, "x", "y"),
                 "squared distances ~1e301 are representable but the intermediate "
                 "||x||^2 + ||y||^2 of a Gram identity comes within a factor of overflow",
                 dtypes=("float64",)),
        ]
    else:
        cases += [
            Case("tiny scale (1e-200)", scaled(base, 1e-200, "x", "y"),
                 "squares underflow float64 below ~1e-162: a naive norm is 0 (a false "
                 "coincidence: a zero gradient, or NaN from 0 / 0)", dtypes=("float64",)),
            Case("huge scale (1e200)", scaled(base, 1e200, "x", "y"),
                 "squares overflow float64 above ~1e154: a naive norm is inf (and inf - inf "
                 "= NaN in a Gram identity)", dtypes=("float64",)),
        ]
    if metric != "cosine":
        cases += [
            Case("nearby points (1e-9 apart)", _nearby(rng),
                 "points 1e-9 apart at magnitude 10: the Gram identity cancels ~1e2 to "
                 "~1e-18 and returns noise (or 0) where the distance is ~1e-9"),
            Case("float32 edge: large offset", _float32_offset(rng),
                 "||x||^2 overflows float32 at 1.5e19 while ||x - y|| ~1e18 does not: a "
                 "float32 Gram identity is inf - inf = NaN", dtypes=("float32",)),
        ]
    else:
        cases.append(Case("float32 edge: huge and tiny rows", _float32_norms(rng),
                          "in float32 the squared norms of 1e30 overflow and of 1e-30 "
                          "underflow: the naive norms are inf or 0, the similarities are "
                          "in [-1, 1]", dtypes=("float32",)))
    return tuple(cases)


def _error_inputs(rng: np.random.Generator, *, metric: str) -> tuple[ErrorCase, ...]:
    base = _two_sets(rng)
    cases = [
        with_nan(base, "x"),
        with_inf(base, "y"),
        ErrorCase("x flattened to 1-d", replaced(base, x=base["x"].ravel()), ValueError,
                  r"^x must have at least 2 dimensions"),
        ErrorCase("last dimensions differ", replaced(base, y=np.ones((1, 5, 4))), ValueError,
                  r"^x and y must have the same last dimension"),
        ErrorCase("leading dimensions do not broadcast", replaced(base, y=np.ones((3, 5, 3))),
                  ValueError, r"^leading dimensions of x .* and y .* do not broadcast"),
        bad_type(base, "y", np.ones((5, 3), dtype=complex), "y complex"),
    ]
    if metric == "sq_euclidean":
        cases.append(ErrorCase("squared distances beyond float64",
                               scaled(base, 1e200, "x", "y"), ValueError,
                               r"^x and y: squared distances overflow float64"))
    if metric == "cosine":
        x = base["x"].copy()
        x[1, 2] = 0.0
        cases.append(ErrorCase("a zero row of x", replaced(base, x=x), ValueError,
                               r"^x has a zero vector at row \(1, 2\)"))
    return tuple(cases)


def _coincident(x, y) -> np.ndarray:
    """(..., n, m) mask of the pairs with x_i == y_j exactly."""
    return np.all(x[..., :, None, :] == y[..., None, :, :], axis=-1)


def _distance_invariants(inputs, outputs, *, metric: str) -> dict:
    """Non-negative (similarities in [-1, 1]); 0 (similarity 1) at coincident points,
    relative to the largest distance."""
    x = np.asarray(inputs["x"], dtype=np.float64)
    y = np.asarray(inputs["y"], dtype=np.float64)
    out = np.asarray(outputs[0], dtype=np.float64)
    same = np.broadcast_to(_coincident(x, y), out.shape)
    if metric == "cosine":
        return {"in [-1, 1]": float(max(0.0, np.max(np.abs(out)) - 1.0)),
                "1 at coincident points": float(np.max(np.abs(out - 1.0), where=same,
                                                       initial=0.0))}
    scale = max(float(np.max(np.abs(out))), np.finfo(np.float64).tiny)
    return {"non-negative": float(max(0.0, -np.min(out)) / scale),
            "0 at coincident points": float(np.max(np.abs(out), where=same, initial=0.0) / scale)}


OPERATORS = tuple(
    OperatorSpec(
        name=name, forward=forward, backward=backward, make_inputs=_two_sets, paper=paper,
        mirror=mirror, mirror_backward=mirror_backward,
        reference_inputs=functools.partial(_reference_inputs, metric=metric),
        error_inputs=functools.partial(_error_inputs, metric=metric),
        invariants=functools.partial(_distance_invariants, metric=metric),
    )
    for name, metric, forward, backward, mirror, mirror_backward, paper in (
        ("distances.euclidean", "euclidean", euclidean_forward, euclidean_backward,
         fast.euclidean_forward, fast.euclidean_backward,
         "GSP Alg. 2 cost map; d_f of ASAP Sec. 3"),
        ("distances.sq_euclidean", "sq_euclidean", sq_euclidean_forward, sq_euclidean_backward,
         fast.sq_euclidean_forward, fast.sq_euclidean_backward,
         "squared Euclidean distance"),
        ("distances.cosine", "cosine", cosine_forward, cosine_backward,
         fast.cosine_forward, fast.cosine_backward,
         "cosine similarity (XBM C1, proxy losses)"),
    )
)
