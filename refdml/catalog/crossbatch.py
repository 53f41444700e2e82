"""Catalogue entries of :mod:`refdml.crossbatch`: the cross fit and the three losses as pairs."""

from __future__ import annotations

import numpy as np

from refdml.catalog._spec import OperatorSpec
from refdml.crossbatch import (
    cross_fit_backward,
    cross_fit_forward,
    xml_loss_backward,
    xml_loss_forward,
    zero_shot_loss_backward,
    zero_shot_loss_forward,
    zero_shot_loss_printed_backward,
    zero_shot_loss_printed_forward,
)
from refdml.gpu import crossbatch as fast


def _labels_two_per_class(n_classes: int, rng: np.random.Generator) -> np.ndarray:
    return rng.permutation(np.repeat(np.arange(n_classes), 2))


def _cross_fit_inputs(rng: np.random.Generator) -> dict:
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "targets": rng.standard_normal((labels.size, 3)),
        "split": labels < 2,
        "ridge": 0.2,
    }


def _zero_shot_inputs(rng: np.random.Generator) -> dict:
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "labels": labels,
        # One class (4) absent from the batch: it still receives softmax gradient.
        "class_embeddings": 0.5 * rng.standard_normal((5, 3)),
        "split": labels < 2,
    }


def _xml_inputs(rng: np.random.Generator) -> dict:
    # Contrastive (pos_margin 0, neg_margin 100) is smooth where every negative pair
    # is inside the margin and no two points coincide, which holds here.
    labels = _labels_two_per_class(4, rng)
    return {
        "Z": rng.dirichlet(np.ones(5), size=labels.size),
        "Y": rng.standard_normal((labels.size, 3)),
        "labels": labels,
        "ridge": 0.2,
        "split": labels < 2,
        "lambda_": 0.7,
        "base_loss_kwargs": {"pos_margin": 0.0, "neg_margin": 100.0},
    }


OPERATORS = (
    OperatorSpec(
        name="crossbatch.cross_fit",
        forward=cross_fit_forward,
        mirror=fast.cross_fit_forward,
        mirror_backward=fast.cross_fit_backward,
        backward=cross_fit_backward,
        make_inputs=_cross_fit_inputs,
        paper="XML Eq. (2.10) predictions Y_hat_1 = V_2 Z_1, Y_hat_2 = V_1 Z_2; GSP Alg. 4",
    ),
    OperatorSpec(
        name="crossbatch.zero_shot_loss",
        forward=zero_shot_loss_forward,
        mirror=fast.zero_shot_loss_forward,
        mirror_backward=fast.zero_shot_loss_backward,
        backward=zero_shot_loss_backward,
        make_inputs=_zero_shot_inputs,
        paper="GSP Sec. 4.3, (P3) and Algorithm 4 (softmax cross-entropy, scale 9.5)",
        tags=("loss",),
        # Its softmax runs refdml.gpu._loss_kernels.masked_logsumexp (Numba kernels).
        mirror_kernels=("cpu", "cuda"),
    ),
    OperatorSpec(
        name="crossbatch.zero_shot_loss_printed",
        forward=zero_shot_loss_printed_forward,
        backward=zero_shot_loss_printed_backward,
        make_inputs=_zero_shot_inputs,
        paper="GSP Eq. (4.4) as printed",
        no_mirror="validation only",
        tags=("loss",),
    ),
    OperatorSpec(
        name="crossbatch.xml_loss",
        forward=xml_loss_forward,
        mirror=fast.xml_loss_forward,
        mirror_backward=fast.xml_loss_backward,
        backward=xml_loss_backward,
        make_inputs=_xml_inputs,
        paper="XML Eqs. (2.10)-(2.11) with the contrastive base loss",
        wrt=("Z", "Y"),
        tags=("loss",),
    ),
)
