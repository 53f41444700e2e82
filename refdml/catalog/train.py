"""Catalogue entries of :mod:`refdml.train.layers`: the training layers' pure pairs.

The pairs are written once against the input's array module and dtype, so each entry's
mirror is the pair itself: the parity suite runs it on float32 (and on CuPy where there
is a GPU) against its own float64 NumPy run. The heads that wrap an operator (GSP, XML
histogram, L2 normalisation) are checked through that operator's own entry.
Inputs are small (each check is quick) and drawn away from the kinks
(ReLU at 0, ties of the max); so are the hard cases (``reference_inputs``: zero inputs,
extreme magnitudes, degenerate shapes), and ``error_inputs`` lists the bad inputs each
pair refuses.
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    bad_type,
    flat,
    replaced,
    scaled,
    truncated,
    with_inf,
    with_nan,
    without_axis,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.train.layers import (
    conv2d_backward,
    conv2d_forward,
    embedding_backward,
    embedding_forward,
    gap_backward,
    gap_forward,
    gemean_backward,
    gemean_forward,
    gmp_backward,
    gmp_forward,
    linear_backward,
    linear_forward,
    local_linear_backward,
    local_linear_forward,
    relu_backward,
    relu_forward,
)

def _linear_inputs(rng: np.random.Generator) -> dict:
    # Leading axes (B, n) = (2, 3): the same pair maps a batch and local features.
    return {
        "x": rng.standard_normal((2, 3, 4)),
        "weight": rng.standard_normal((2, 4)),
        "bias": rng.standard_normal(2),
    }


def _relu_inputs(rng: np.random.Generator) -> dict:
    # |x| >= 0.2: no entry near the kink at 0.
    sign = rng.choice([-1.0, 1.0], size=(3, 5))
    return {"x": sign * rng.uniform(0.2, 1.5, (3, 5))}


def _conv_inputs(rng: np.random.Generator) -> dict:
    return {
        "x": rng.standard_normal((2, 2, 5, 4)),
        "weight": rng.standard_normal((3, 2, 3, 3)),
        "bias": rng.standard_normal(3),
        "stride": 1,
        "padding": 1,
    }


def _strided_conv_inputs(rng: np.random.Generator) -> dict:
    return {
        "x": rng.standard_normal((2, 2, 6, 5)),
        "weight": rng.standard_normal((2, 2, 3, 3)),
        "bias": rng.standard_normal(2),
        "stride": 2,
        "padding": 2,
    }


def _local_linear_inputs(rng: np.random.Generator) -> dict:
    return {
        "x": rng.standard_normal((2, 3, 2, 3)),
        "weight": rng.standard_normal((4, 3)),
        "bias": rng.standard_normal(4),
    }


def _embedding_inputs(rng: np.random.Generator) -> dict:
    # 12 tokens from 5 rows: repeated indices guaranteed (their gradients must sum).
    return {"tokens": rng.integers(0, 5, size=(2, 6)), "table": rng.standard_normal((5, 3))}


def _features(rng: np.random.Generator) -> dict:
    return {"features": rng.standard_normal((2, 4, 3))}


def _separated_features(rng: np.random.Generator) -> dict:
    # Along the locations, each column is a permutation of well-separated levels: the
    # maximum is unique with a margin far above the finite-difference step.
    levels = np.linspace(-1.0, 1.0, 4)
    features = np.stack([
        np.stack([rng.permutation(levels) for _ in range(3)], axis=1) for _ in range(2)
    ])
    return {"features": features + rng.uniform(-0.05, 0.05, features.shape)}


def _positive_features(rng: np.random.Generator) -> dict:
    return {"features": rng.uniform(0.1, 1.0, (2, 4, 3)), "p": 3.0}


# ------------------------------------------------------------- hard and bad inputs
#
# No case puts an input on a kink (ReLU at exactly 0, a tie of the maximum, an all-zero
# GeMean column): there the pairs' subgradient is one valid choice among several, and
# another implementation may make another one. Magnitudes of 1e150 against 1e-150 keep
# every product in range while the factors are far outside any usual scale.
_F64 = ("float64",)
_F32 = ("float32",)


def _product_cases(make, factor_names) -> tuple[Case, ...]:
    """Linear maps ``x W^T + b``: zero input, and factors scaled apart or to float32's edge."""
    x_name, w_name = factor_names

    def cases(rng: np.random.Generator) -> tuple[Case, ...]:
        inputs = make(rng)
        return (
            Case("zero input", replaced(inputs, **{x_name: np.zeros_like(inputs[x_name])}),
                 "x == 0: y is the bias, the weight's gradient exactly 0 and x's d_y W (a "
                 "layer that skips or normalises a zero input gets these wrong)"),
            Case("factors 1e150 and 1e-150",
                 scaled(scaled(inputs, 1e150, x_name), 1e-150, w_name),
                 "x of 1e150, W of 1e-150: y ~ 1, d_W = d_y^T x ~ 1e150, d_x = d_y W ~ "
                 "1e-150, every product in range, so exact to rounding; an implementation "
                 "that clips, normalises or goes through float32 is not",
                 dtypes=_F64),
            Case("float32 range edge",
                 scaled(scaled(inputs, 1e18, x_name, w_name), 1e36, "bias"),
                 "x and W of 1e18: products and y ~1e37, near float32's 3.4e38 (a sum in "
                 "another order, or a float16 step, overflows)", dtypes=_F32),
        )

    return cases


def _product_errors(make, x_ndim_error, mismatch):
    """NaN, inf, a wrong rank (``x_ndim_error``), a short bias, a string, and a shape
    ``mismatch`` between x and the weight (both callables of the inputs)."""

    def errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
        inputs = make(rng)
        return (
            with_nan(inputs, "x"),
            with_inf(inputs, "weight"),
            x_ndim_error(inputs),
            truncated(inputs, "bias"),
            bad_type(inputs, "x", "x"),
            mismatch(inputs),
        )
    return errors


def _linear_mismatch(inputs) -> ErrorCase:
    return ErrorCase("x of the wrong width", replaced(inputs, x=inputs["x"][..., :-1]),
                     ValueError, r"x has shape .*, its last axis must be weight's d_in")


def _channel_mismatch(inputs) -> ErrorCase:
    return ErrorCase("x with the wrong channels", replaced(inputs, x=inputs["x"][:, :-1]),
                     ValueError, r"x has \d+ channels")


def _conv_cases(make):
    return lambda rng: _conv_cases_of(make, rng)


def _conv_cases_of(make, rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = make(rng)
    return (
        *_product_cases(make, ("x", "weight"))(rng),
        Case("kernel covers the input", replaced(inputs, x=inputs["x"][:, :, :3, :3],
                                                 padding=0),
             "a 3 x 3 input without padding: one output location, whose patch is the "
             "whole input"),
        Case("padding wider than the kernel", replaced(inputs, padding=3),
             "padding 3 > kernel 3: the border outputs see only zeros (y == bias there), "
             "and the input gradient must crop the whole padding"),
    )


def _conv_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _conv_inputs(rng)
    return (
        with_nan(inputs, "x"),
        _channel_mismatch(inputs),
        bad_scalar(inputs, "stride", 0, label="stride 0"),
        bad_scalar(inputs, "padding", -1, label="padding -1"),
        bad_type(inputs, "stride", 1.5, label="stride not an integer"),
        ErrorCase("kernel not square", replaced(inputs, weight=inputs["weight"][..., :2]),
                  ValueError, r"weight has shape .*, the kernel must be square"),
        ErrorCase("input smaller than the kernel",
                  replaced(inputs, x=inputs["x"][:, :, :2, :2], padding=0), ValueError,
                  r"input size 2 with padding 0 is smaller than the kernel"),
    )


def _local_linear_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _local_linear_inputs(rng)
    return (
        *_product_cases(_local_linear_inputs, ("x", "weight"))(rng),
        Case("one location", replaced(inputs, x=inputs["x"][:, :, :1, :1]),
             "a 1 x 1 feature map: n = 1 local feature per image (the reshape to (B, n, d) "
             "must not drop or transpose an axis)"),
    )


def _relu_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _relu_inputs(rng)
    sign = np.sign(inputs["x"])
    return (
        Case("near float64's maximum", replaced(inputs, x=sign * 1.7e308),
             "entries of +-1.7e308 (never 0): (x + |x|) / 2 overflows to inf; ReLU is "
             "linear on each side, its gradient exactly 0 or 1", dtypes=_F64),
        Case("smallest subnormals", replaced(inputs, x=sign * 5e-324),
             "entries of +-5e-324, the smallest float64 subnormals (not 0, so no kink): "
             "gradient exactly 1 on the positive ones; a flush-to-zero mode gives 0",
             dtypes=_F64),
        Case("float32 range edge", replaced(inputs, x=np.where(sign > 0, 3e38, -1e-37)),
             "entries of 3e38 and -1e-37: float32's largest and nearly its smallest normal "
             "magnitudes; gradient exactly 1 and 0", dtypes=_F32),
        Case("all negative", replaced(inputs, x=-np.abs(inputs["x"])),
             "every entry negative: y == 0 and a zero gradient everywhere (a dead layer)"),
    )


def _relu_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _relu_inputs(rng)
    return (
        with_nan(inputs, "x"),
        with_inf(inputs, "x"),
        bad_type(inputs, "x", "x"),
        ErrorCase("boolean x", replaced(inputs, x=inputs["x"] > 0), TypeError,
                  r"x must be an array of real numbers, got dtype bool"),
    )


def _embedding_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _embedding_inputs(rng)
    tokens = inputs["tokens"]
    return (
        Case("one token everywhere", replaced(inputs, tokens=np.full_like(tokens, 2)),
             "every position holds token 2: its row's gradient is the sum of all 12 upstream "
             "rows (a scatter that assigns instead of adding keeps one)"),
        Case("unused rows", replaced(inputs, tokens=tokens % 2),
             "only tokens 0 and 1: rows 2-4 get a gradient of exactly 0"),
        Case("extreme table", scaled(inputs, 1e300, "table"),
             "table entries of 1e300: a lookup copies them exactly; the gradient does not "
             "depend on the table", dtypes=_F64),
        Case("float32 range edge", replaced(inputs, table=3e38 * np.tanh(inputs["table"])),
             "table entries up to 3e38 (float32's largest finite is 3.4e38): copied exactly "
             "in float32", dtypes=_F32),
    )


def _embedding_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _embedding_inputs(rng)
    tokens = inputs["tokens"]
    return (
        with_nan(inputs, "table"),
        flat(inputs, "table"),
        ErrorCase("float tokens", replaced(inputs, tokens=tokens.astype(np.float64)),
                  TypeError, r"tokens must be an array of integers"),
        ErrorCase("token past the table", replaced(inputs, tokens=np.where(tokens == 0, 5, tokens)),
                  ValueError, r"tokens holds 5, must be in \[0, 5\)"),
        ErrorCase("negative token", replaced(inputs, tokens=tokens - 1), ValueError,
                  r"tokens holds -1"),
    )


def _pooling_errors(make, extra=()):
    def errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
        inputs = make(rng)
        return (
            with_nan(inputs, "features"),
            with_inf(inputs, "features"),
            without_axis(inputs, "features"),
            bad_type(inputs, "features", None),
            *(error(inputs) for error in extra),
        )
    return errors


def _gap_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _features(rng)
    f = inputs["features"]
    return (
        Case("one location", replaced(inputs, features=f[:, :1]),
             "n == 1: y is the single local feature, its gradient d_y itself"),
        Case("zero features", replaced(inputs, features=np.zeros_like(f)),
             "y == 0 with gradient d_y / n everywhere (GAP is linear: no special case at 0)"),
        Case("float32 mean in range, sum not",
             replaced(inputs, features=1e38 * (1.0 + 0.9 * np.abs(np.tanh(f)))),
             "entries of 1e38-2e38: their mean is a float32, their sum over 4 locations is "
             "not (a float32 sum-then-divide gives inf)", dtypes=_F32),
    )


def _gmp_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _separated_features(rng)
    f = inputs["features"]
    tied = np.array(f, copy=True)
    # Each column's two smallest entries made equal: a tie below the (unique) maximum.
    order = np.argsort(tied, axis=1)
    lowest = np.take_along_axis(tied, order[:, :1], axis=1)
    np.put_along_axis(tied, order[:, 1:2], lowest, axis=1)
    return (
        Case("ties below the maximum", replaced(inputs, features=tied),
             "two equal entries in each column, below its unique maximum: they get exactly "
             "0 gradient (ties AT the maximum are left out: lowest-index and shared "
             "subgradients are both valid there)"),
        Case("all negative", replaced(inputs, features=f - 2.0),
             "every entry negative: the maximum is the least negative (an implementation "
             "that starts its running max at 0 returns 0)"),
        Case("one location", replaced(inputs, features=f[:, :1]),
             "n == 1: y is the single local feature, its gradient d_y itself"),
        Case("extreme magnitudes", scaled(inputs, 1e300, "features"),
             "entries of +-1e300: the max is exact at any scale", dtypes=_F64),
    )


def _gemean_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _positive_features(rng)
    f = np.array(inputs["features"], copy=True)
    f[:, 0] = 0.0
    return (
        Case("zeros in a live column", replaced(inputs, features=f),
             "one location exactly 0 in every column, the others positive: the gradient "
             "(1/n)(f/y)^(p-1) is 0 there, continuous for p > 1 (a one-sided derivative: "
             "f >= 0 is the domain); exp(p log f) gives log(0) = -inf and a NaN gradient"),
        Case("large p, values above 1", replaced(inputs, features=10.0 * inputs["features"],
                                                 p=400.0),
             "p == 400 on entries up to 10: f^p reaches 1e400 and overflows; y tends to the "
             "column maximum and must be computed relative to it"),
        Case("huge scale", scaled(inputs, 1e300, "features"),
             "entries of 1e300: f^3 overflows float64 unless scaled by the column maximum",
             dtypes=_F64),
        Case("float32 range edge", scaled(inputs, 1e30, "features"),
             "entries of 1e30: f^3 overflows float32 unless scaled by the column maximum",
             dtypes=_F32),
    )


def _gemean_negative(inputs) -> ErrorCase:
    return ErrorCase("negative feature", replaced(inputs, features=-inputs["features"]),
                     ValueError, r"features must be non-negative")


def _entry(name, forward, backward, make_inputs, paper, wrt=None, *, cases, errors):
    # The pair is its own mirror (module docstring).
    return OperatorSpec(
        name=f"train.{name}",
        forward=forward,
        backward=backward,
        make_inputs=make_inputs,
        paper=paper,
        wrt=wrt,
        mirror=forward,
        mirror_backward=backward,
        reference_inputs=cases,
        error_inputs=errors,
    )


OPERATORS = (
    _entry("linear", linear_forward, linear_backward, _linear_inputs,
           "fully connected layer y = x W^T + b (embedding head of all four papers)",
           cases=_product_cases(_linear_inputs, ("x", "weight")),
           errors=_product_errors(_linear_inputs, lambda i: flat(i, "weight"), _linear_mismatch)),
    _entry("relu", relu_forward, relu_backward, _relu_inputs, "ReLU activation",
           cases=_relu_cases, errors=_relu_errors),
    _entry("conv2d", conv2d_forward, conv2d_backward, _conv_inputs,
           "3x3 convolution by im2col, stride 1, padding 1 (backbone of GSP supp. 2.2's "
           "collage model)", cases=_conv_cases(_conv_inputs), errors=_conv_errors),
    _entry("conv2d_strided", conv2d_forward, conv2d_backward, _strided_conv_inputs,
           "3x3 convolution by im2col, stride 2, padding 2 (col2im with uneven coverage)",
           cases=_conv_cases(_strided_conv_inputs), errors=_conv_errors),
    _entry("local_linear", local_linear_forward, local_linear_backward, _local_linear_inputs,
           "per-location linear map (1x1 conv): feature map -> local features (GSP Sec. 4)",
           cases=_local_linear_cases,
           errors=_product_errors(_local_linear_inputs, lambda i: without_axis(i, "x"),
                                  _channel_mismatch)),
    _entry("embedding", embedding_forward, embedding_backward, _embedding_inputs,
           "token embedding table (GSP supp. 2.1 synthetic study)", wrt=("table",),
           cases=_embedding_cases, errors=_embedding_errors),
    _entry("gap", gap_forward, gap_backward, _features,
           "global average pooling (GSP Thm 4.1: GSP at mu = 1)",
           cases=_gap_cases, errors=_pooling_errors(_features)),
    _entry("gmp", gmp_forward, gmp_backward, _separated_features,
           "global max pooling (GSP Sec. 5 baseline)",
           cases=_gmp_cases, errors=_pooling_errors(_separated_features)),
    _entry("gemean", gemean_forward, gemean_backward, _positive_features,
           "generalised-mean pooling, p > 1 (GSP Sec. 5 baseline, GeMean)",
           cases=_gemean_cases,
           errors=_pooling_errors(_positive_features, (
               _gemean_negative,
               lambda i: bad_scalar(i, "p", 1.0, label="p exactly 1"),
               lambda i: bad_scalar(i, "p", float("inf"), label="p infinite")))),
)
