"""Catalogue entries of :mod:`refdml.normalize`."""

from __future__ import annotations

import functools

import numpy as np

from refdml.catalog._cases import (
    bad_type,
    replaced,
    scaled,
    with_inf,
    with_nan,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu import normalize as fast
from refdml.normalize import (
    clip_normalize_backward,
    clip_normalize_forward,
    l2_normalize_backward,
    l2_normalize_forward,
)


def _mixed_norm_vectors(rng: np.random.Generator) -> dict:
    # Rows both inside and outside the unit ball, none near the sphere (the kink).
    x = rng.standard_normal((6, 4))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    x *= np.array([0.3, 0.7, 0.9, 1.2, 2.0, 3.5])[:, None]
    return {"x": x}


def _unit_rows(rng: np.random.Generator) -> np.ndarray:
    # Axis vectors and their negatives: norms of exactly 1 (the sphere, clip's kink).
    rows = np.concatenate([np.eye(4), -np.eye(4)[:2]])
    return rows[rng.permutation(rows.shape[0])]


def _float32_edge(rng: np.random.Generator) -> np.ndarray:
    # Rows of ~1e30 (their squares, 1e60, overflow float32) and ~1e-30 (squares underflow
    # to 0 below float32's least subnormal), both representable in float32.
    x = _mixed_norm_vectors(rng)["x"]
    return x * np.array([1e30, 1e30, 3e-31, 1e-30, 2e30, 1e-29])[:, None]


def _reference_inputs(rng: np.random.Generator, *, clip: bool) -> tuple[Case, ...]:
    base = _mixed_norm_vectors(rng)
    norm_why = ("np.linalg.norm squares first: 0 below ~1e-162, so a naive implementation "
                "divides by 0 (NaN/inf) or, for the clip, takes the row for inside")
    cases = [
        Case("tiny scale (1e-200)", scaled(base, 1e-200, "x"), norm_why
             + "; the output is the same direction as at scale 1, the gradient ~1e200",
             dtypes=("float64",)),
        Case("huge scale (1e200)", scaled(base, 1e200, "x"),
             "squares overflow float64 above ~1e154: a naive norm is inf and the output 0 "
             "(and the gradient 0 or NaN); the output is the unit direction",
             dtypes=("float64",)),
        Case("float32 edge", {"x": _float32_edge(rng)},
             "in float32 the squares of 1e30 overflow and those of 1e-30 underflow: a naive "
             "float32 norm gives 0 or inf rows where the output is representable",
             dtypes=("float32",)),
        Case("sparse rows with exact zeros", {"x": _unit_rows(rng) * 2.5},
             "entries exactly 0: the Jacobian (I - y y^T) / ||x|| must be formed without "
             "dividing by an entry (a log/abs-based norm gives NaN there)"),
        Case("mixed magnitudes in a row",
             {"x": np.array([[1e150, 1e-150, 0.0, -3.0], [-2.0, 1e-300, 5.0, 0.5],
                             [7e-310, 0.0, 0.0, 1e-308]])},
             "one entry dominates by 1e300 (and one row is subnormal and tiny): rescaling by "
             "the largest entry must not turn the others into NaN, and a subnormal row "
             "is a direction, not a zero vector", dtypes=("float64",)),
    ]
    if clip:
        cases.insert(3, Case(
            "rows on the unit sphere", {"x": _unit_rows(rng)},
            "||x|| == 1 exactly, the kink of x / max(1, ||x||): the reference takes the "
            "inside branch (identity), an element of the Clarke Jacobian; an implementation "
            "that mixes the branches returns (I - y y^T) d_y, half of one or NaN"))
    return tuple(cases)


def _error_inputs(rng: np.random.Generator, *, clip: bool) -> tuple[ErrorCase, ...]:
    base = _mixed_norm_vectors(rng)
    cases = [
        with_nan(base, "x"),
        with_inf(base, "x"),
        ErrorCase("x a 0-d scalar", replaced(base, x=np.array(3.0)), ValueError,
                  r"^x must have at least 1 dimensions"),
        ErrorCase("x empty", replaced(base, x=np.zeros((0, 4))), ValueError,
                  r"^x must not be empty"),
        bad_type(base, "x", np.ones((2, 3), dtype=bool), "x boolean"),
        ErrorCase("x of strings", replaced(base, x=[["1", "2"]]), TypeError,
                  r"^x must be an array of real numbers"),
    ]
    if not clip:
        cases[4] = ErrorCase("a zero row", replaced(base, x=np.vstack([base["x"], np.zeros(4)])),
                             ValueError, r"^x has a zero vector at row 6")
    return tuple(cases)


def _norm_invariants(inputs, outputs, *, clip: bool) -> dict:
    """``||y|| = min(1, ||x||)`` (clip) or ``1`` (l2) per row, relative to the target norm;
    norms taken after scaling each row by its largest entry (no overflow at 1e300)."""
    x, y = np.asarray(inputs["x"], dtype=np.float64), np.asarray(outputs[0], dtype=np.float64)
    peak = np.max(np.abs(x), axis=-1, keepdims=True)
    peak = np.where(peak > 0, peak, 1.0)
    with np.errstate(over="ignore"):
        x_norm = np.linalg.norm(x / peak, axis=-1) * peak[..., 0]
    target = np.minimum(1.0, x_norm) if clip else np.ones_like(x_norm)
    y_peak = np.max(np.abs(y), axis=-1, keepdims=True)
    y_peak = np.where(y_peak > 0, y_peak, 1.0)
    y_norm = np.linalg.norm(y / y_peak, axis=-1) * y_peak[..., 0]
    residuals = {"norm": float(np.max(np.abs(y_norm - target) / target))}
    # Same direction as x: y_i x_j - y_j x_i = 0, compared on the scaled rows.
    unit_x = x / peak
    unit_y = y / y_peak
    cross = (unit_y[..., :, None] * unit_x[..., None, :]
             - unit_y[..., None, :] * unit_x[..., :, None])
    residuals["direction"] = float(np.max(np.abs(cross)))
    residuals["orientation"] = float(max(0.0, -np.min(np.sum(unit_x * unit_y, axis=-1))))
    return residuals


OPERATORS = (
    OperatorSpec(
        name="normalize.clip_normalize",
        forward=clip_normalize_forward,
        backward=clip_normalize_backward,
        mirror=fast.clip_normalize_forward,
        mirror_backward=fast.clip_normalize_backward,
        make_inputs=_mixed_norm_vectors,
        paper="GSP Alg. 2 normalisation; ASAP Sec. 4.4",
        reference_inputs=functools.partial(_reference_inputs, clip=True),
        error_inputs=functools.partial(_error_inputs, clip=True),
        invariants=functools.partial(_norm_invariants, clip=True),
    ),
    OperatorSpec(
        name="normalize.l2_normalize",
        forward=l2_normalize_forward,
        backward=l2_normalize_backward,
        mirror=fast.l2_normalize_forward,
        mirror_backward=fast.l2_normalize_backward,
        kernel_family=fast.IMPLEMENTATIONS,
        make_inputs=_mixed_norm_vectors,
        paper="L2 normalisation of embeddings",
        reference_inputs=functools.partial(_reference_inputs, clip=False),
        error_inputs=functools.partial(_error_inputs, clip=False),
        invariants=functools.partial(_norm_invariants, clip=False),
    ),
)
