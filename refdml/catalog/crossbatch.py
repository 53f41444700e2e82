"""Catalogue entries of :mod:`refdml.crossbatch`: the cross fit and the three losses as pairs.

Hard cases (``reference_inputs``): near-singular halves, ridges far below and far above
the Gram matrix's scale, samples that share a histogram, extreme softmax scales; bad
inputs (``error_inputs``): bad labels, splits and hyperparameters.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from refdml.catalog._cases import (
    bad_scalar,
    bad_type,
    non_integer_labels,
    replaced,
    scaled,
    truncated,
    with_nan,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
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
from refdml.gpu import losses as fast_losses


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



# ------------------------------------------------------------- hard and bad inputs
#
# Each half holds 4 samples and Z has 5 prototypes, so each half's fit is solved in the
# kernel form (4 x 4); with two samples of one half on the same histogram it is singular
# but for the ridge.
_F64 = ("float64",)


def _same_histogram(inputs: dict, within_half: bool) -> np.ndarray:
    """``Z`` with one sample's histogram copied onto another of the same (other) half.

    Within a half, the other sample is of another class where there are labels, so that
    the two targets differ (with equal targets the singular direction carries nothing).
    """
    Z = np.array(inputs["Z"], copy=True)
    first, second = np.flatnonzero(inputs["split"]), np.flatnonzero(~inputs["split"])
    if not within_half:
        Z[second[0]] = Z[first[0]]
        return Z
    labels = inputs.get("labels")
    other = first[1] if labels is None else first[labels[first] != labels[first[0]]][0]
    Z[other] = Z[first[0]]
    return Z


def _fit_cases(inputs: dict) -> tuple[Case, ...]:
    """The ridge-fit cases every cross-batch entry shares (the fit of each half)."""
    return (
        Case("near-singular half, tiny ridge",
             replaced(inputs, Z=_same_histogram(inputs, within_half=True), ridge=1e-8),
             "two samples of one half on the same histogram (with different targets): that "
             "half's kernel matrix Z_k Z_k^T is singular but for ridge 1e-8 (condition ~1e8, "
             "beyond float32); the fit must average the two targets, not blow up or drop "
             "the ridge", dtypes=_F64),
        Case("duplicate sample across halves",
             replaced(inputs, Z=_same_histogram(inputs, within_half=False)),
             "one histogram in both halves: each half predicts the other's sample from the "
             "same row of Z (a mix-up of V_1 and V_2 shows here)"),
        Case("ridge 1e-12", replaced(inputs, ridge=1e-12),
             "ridge far below the rounding level of the Gram matrix: each half's 4 x 4 "
             "kernel system is well conditioned, the 5 x 5 primal one singular (rank 4), so "
             "solving the primal form returns rounding noise"),
        Case("ridge 1e8", replaced(inputs, ridge=1e8),
             "the ridge dominates: V_k ~ Z_k^T T_k / ridge and the predictions ~1e-8 of the "
             "targets; a ridge scaled differently (ridge^2, ridge / b) is off by orders of "
             "magnitude here, not by a few percent"),
    )


def _cross_fit_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _cross_fit_inputs(rng)
    single = np.zeros(inputs["split"].size, dtype=bool)
    single[0] = True
    return (
        *_fit_cases(inputs),
        Case("one-sample half", replaced(inputs, split=single),
             "half 1 holds one sample: its fit is a rank-1 system, and the other half's "
             "predictions all come from it"),
        Case("huge scale", scaled(inputs, 1e170, "Z", "targets"),
             "Z and targets of 1e170: the Gram matrices overflow float64 in a naive solve; "
             "the predictions are exact after a power-of-two rescaling", dtypes=_F64),
    )


def _cross_fit_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _cross_fit_inputs(rng)
    return (
        with_nan(inputs, "Z"),
        truncated(inputs, "targets"),
        bad_scalar(inputs, "ridge", 0.0, label="ridge exactly 0"),
        bad_type(inputs, "split", inputs["split"].astype(int), label="split of integers"),
        ErrorCase("split with an empty half",
                  replaced(inputs, split=np.ones(inputs["split"].size, dtype=bool)),
                  ValueError, r"split leaves one half empty"),
        ErrorCase("split of the wrong length", replaced(inputs, split=inputs["split"][:-1]),
                  ValueError, r"split has shape"),
    )


def _label_errors(inputs: dict) -> tuple[ErrorCase, ...]:
    """Bad labels of the losses that draw their split from the labels."""
    n = inputs["labels"].size
    return (
        non_integer_labels(inputs),
        truncated(inputs, "labels"),
        # An odd number of samples in half 1 cannot be a union of two-sample classes.
        ErrorCase("split not class-disjoint",
                  replaced(inputs, split=np.arange(n) < n // 2 + 1), ValueError,
                  r"split is not class-disjoint"),
        ErrorCase("one class only", replaced(inputs, labels=np.zeros(n, dtype=np.int64),
                                             split=None, rng=0),
                  ValueError, r"labels contain 1 class"),
    )


def _zero_shot_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _zero_shot_inputs(rng)
    return (
        *_fit_cases(inputs),
        Case("large scale", replaced(inputs, scale=1e4),
             "softmax scale 1e4: scores reach ~1e3, a naive exp overflows float64 (and "
             "float32 from ~90); the cross-entropy needs a log-sum-exp"),
    )


def _zero_shot_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _zero_shot_inputs(rng)
    return (
        with_nan(inputs, "Z"),
        *_label_errors(inputs),
        ErrorCase("label without class embedding",
                  replaced(inputs, class_embeddings=inputs["class_embeddings"][:3]),
                  ValueError, r"labels contain 3, but class_embeddings has rows"),
        bad_scalar(inputs, "scale", 0.0, label="scale exactly 0"),
        bad_scalar(inputs, "ridge", -1.0),
    )


def _zero_shot_printed_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _zero_shot_inputs(rng)
    return (
        *_fit_cases(inputs),
        Case("large class embeddings", scaled(inputs, 100.0, "class_embeddings"),
             "class embeddings x100: the scores (Upsilon_hat Upsilon^T, quadratic in them) "
             "reach ~1e3, a naive exp overflows; the printed log(1 + sum exp) needs a "
             "log-sum-exp"),
    )


def _zero_shot_printed_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _zero_shot_inputs(rng)
    return (
        with_nan(inputs, "class_embeddings"),
        *_label_errors(inputs),
        bad_scalar(inputs, "ridge", 0.0, label="ridge exactly 0"),
    )


def _xml_cases(rng: np.random.Generator) -> tuple[Case, ...]:
    inputs = _xml_inputs(rng)
    labels, split = inputs["labels"], inputs["split"]
    # Two samples of one class in half 1 (class-disjoint halves keep a class together).
    first = np.flatnonzero(split)
    pair = first[labels[first] == labels[first[0]]]
    Y = np.array(inputs["Y"], copy=True)
    Z = np.array(inputs["Z"], copy=True)
    Y[pair[1]], Z[pair[1]] = Y[pair[0]], Z[pair[0]]
    return (
        Case("lambda 0", replaced(inputs, lambda_=0.0),
             "L_DML alone: Z's gradient is exactly 0 and the fit plays no part (a 0 * inf "
             "or an unneeded singular fit must not leak into it)"),
        Case("lambda 1", replaced(inputs, lambda_=1.0),
             "L_XML alone: Y enters only as the regression targets of the cross fit"),
        Case("duplicate positive pair", replaced(inputs, Y=Y, Z=Z),
             "two samples of one class identical in Z and Y: zero distance between their "
             "embeddings and between their predictions, where the base contrastive loss "
             "(pos_margin 0) has the norm's kink; the reference uses the subgradient 0 at "
             "coincident points (refdml.distances.euclidean_backward), naive autodiff of "
             "sqrt gives NaN"),
        Case("ridge 1e-12", replaced(inputs, ridge=1e-12),
             "ridge far below the Gram matrix's rounding level: each half's 4 x 4 kernel "
             "system is well conditioned, the 5 x 5 primal one singular"),
        Case("ridge 1e8", replaced(inputs, ridge=1e8),
             "predictions ~1e-8 of the embeddings: the cross terms see near-coincident "
             "(not coincident) points, distances ~1e-8, a well-defined gradient"),
        Case("huge scale", scaled(inputs, 1e170, "Z", "Y"),
             "Z and Y of 1e170: the fits' Gram matrices and the distances' squares overflow "
             "float64 in a naive implementation", dtypes=_F64),
    )


def _xml_errors(rng: np.random.Generator) -> tuple[ErrorCase, ...]:
    inputs = _xml_inputs(rng)
    return (
        with_nan(inputs, "Y"),
        *_label_errors(inputs),
        bad_scalar(inputs, "lambda_", 1.5),
        bad_scalar(inputs, "ridge", 0.0, label="ridge exactly 0"),
        ErrorCase("base_loss not callable", replaced(inputs, base_loss="contrastive"),
                  TypeError, r"base_loss must be callable"),
        ErrorCase("unknown base_loss keyword",
                  replaced(inputs, base_loss_kwargs={"margin": 0.5}),
                  TypeError, r"base_loss_kwargs \['margin'\] do not fit base_loss"),
    )


def _roundoff(inputs) -> float:
    """The largest condition number of the halves' regularised kernel matrices
    ``Z_k Z_k^T + ridge I``: every entry here fits a ridge on each half, which amplifies
    roundoff by about that much. The near-singular case (condition ~1e8 against ~10 at
    make_inputs) leaves a correct float64 implementation ~1e-9 from the reference, beyond
    what perturbing the inputs measures (the singular direction is barely excited); NaN
    where the inputs give no such matrix (the check then keeps its base tolerance)."""
    Z, split = np.asarray(inputs["Z"], dtype=np.float64), inputs.get("split")
    ridge = float(inputs.get("ridge", 0.05))   # zero_shot_loss's default ridge
    if split is None:
        return float("nan")
    largest = 0.0
    for half in (np.asarray(split), ~np.asarray(split)):
        kernel = Z[half] @ Z[half].T + ridge * np.eye(int(half.sum()))
        if kernel.size == 0 or not np.all(np.isfinite(kernel)):
            return float("nan")
        largest = max(largest, float(np.linalg.cond(kernel)))
    return largest


OPERATORS = (
    OperatorSpec(
        name="crossbatch.cross_fit",
        reference_inputs=_cross_fit_cases,
        error_inputs=_cross_fit_errors,
        forward=cross_fit_forward,
        mirror=fast.cross_fit_forward,
        mirror_backward=fast.cross_fit_backward,
        backward=cross_fit_backward,
        make_inputs=_cross_fit_inputs,
        paper="XML Eq. (2.10) predictions Y_hat_1 = V_2 Z_1, Y_hat_2 = V_1 Z_2; GSP Alg. 4",
    ),
    OperatorSpec(
        name="crossbatch.zero_shot_loss",
        reference_inputs=_zero_shot_cases,
        error_inputs=_zero_shot_errors,
        forward=zero_shot_loss_forward,
        mirror=fast.zero_shot_loss_forward,
        mirror_backward=fast.zero_shot_loss_backward,
        backward=zero_shot_loss_backward,
        make_inputs=_zero_shot_inputs,
        paper="GSP Sec. 4.3, (P3) and Algorithm 4 (softmax cross-entropy, scale 9.5)",
        tags=("loss",),
        # Its softmax is the losses family's masked log-sum-exp (Numba kernels).
        kernel_family=fast_losses.IMPLEMENTATIONS,   # the masked log-sum-exp
    ),
    OperatorSpec(
        name="crossbatch.zero_shot_loss_printed",
        reference_inputs=_zero_shot_printed_cases,
        error_inputs=_zero_shot_printed_errors,
        forward=zero_shot_loss_printed_forward,
        backward=zero_shot_loss_printed_backward,
        make_inputs=_zero_shot_inputs,
        paper="GSP Eq. (4.4) as printed",
        no_mirror="validation only",
        tags=("loss",),
    ),
    OperatorSpec(
        name="crossbatch.xml_loss",
        reference_inputs=_xml_cases,
        error_inputs=_xml_errors,
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

# Every entry fits a ridge per half: a conformance check scales its tolerance, stated at
# make_inputs (condition <= ~20), with this ratio at a harder case.
OPERATORS = tuple(dataclasses.replace(spec, roundoff=_roundoff) for spec in OPERATORS)
