"""Catalogue entries of :mod:`refdml.train.layers`: the training layers' pure pairs.

The pairs are written once against the input's array module and dtype, so each entry's
mirror is the pair itself: the parity suite runs it on float32 (and on CuPy where there
is a GPU) against its own float64 NumPy run. The heads that wrap an operator (GSP, XML
histogram, L2 normalisation) are checked through that operator's own entry.
Inputs are small (each check well under a second) and drawn away from the kinks
(ReLU at 0, ties of the max).
"""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
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


def _entry(name, forward, backward, make_inputs, paper, wrt=None):
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
    )


OPERATORS = (
    _entry("linear", linear_forward, linear_backward, _linear_inputs,
           "fully connected layer y = x W^T + b (embedding head of all four papers)"),
    _entry("relu", relu_forward, relu_backward, _relu_inputs, "ReLU activation"),
    _entry("conv2d", conv2d_forward, conv2d_backward, _conv_inputs,
           "3x3 convolution by im2col, stride 1, padding 1 (backbone of GSP supp. 2.2's "
           "collage model)"),
    _entry("conv2d_strided", conv2d_forward, conv2d_backward, _strided_conv_inputs,
           "3x3 convolution by im2col, stride 2, padding 2 (col2im with uneven coverage)"),
    _entry("local_linear", local_linear_forward, local_linear_backward, _local_linear_inputs,
           "per-location linear map (1x1 conv): feature map -> local features (GSP Sec. 4)"),
    _entry("embedding", embedding_forward, embedding_backward, _embedding_inputs,
           "token embedding table (GSP supp. 2.1 synthetic study)", wrt=("table",)),
    _entry("gap", gap_forward, gap_backward, _features,
           "global average pooling (GSP Thm 4.1: GSP at mu = 1)"),
    _entry("gmp", gmp_forward, gmp_backward, _separated_features,
           "global max pooling (GSP Sec. 5 baseline)"),
    _entry("gemean", gemean_forward, gemean_backward, _positive_features,
           "generalised-mean pooling, p > 1 (GSP Sec. 5 baseline, GeMean)"),
)
