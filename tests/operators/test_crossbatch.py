"""XML loss (XML Eqs. 2.10-2.11) and zero-shot loss (GSP Eq. 4.4, Alg. 4): refdml.crossbatch.

Oracles: slow loops written in the papers' column convention, with ridge fits by
``numpy.linalg.lstsq`` or by the printed closed form with an explicit inverse, and
scalar ``math.exp``/``math.log`` for the softmax terms; finite differences for every
gradient.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdml import crossbatch, losses
from refdml.gradcheck import assert_gradients, check_gradients, check_loss
from refdml.gradcheck import strategies as rst


def smooth_pair_loss(embeddings, labels, *, temperature=1.0):
    """A smooth stand-in base loss with the refdml.losses API: over unordered pairs,
    ``||y_i - y_j||^2`` for positives and ``exp(-||y_i - y_j||^2 / t)`` for negatives."""
    y = np.asarray(embeddings, dtype=float)
    diff = y[:, None, :] - y[None, :, :]
    sq = np.sum(diff**2, axis=-1)
    same = labels[:, None] == labels[None, :]
    off = ~np.eye(len(labels), dtype=bool)
    weight = np.where(same, 1.0, -np.exp(-sq / temperature) / temperature) * off
    value = 0.5 * float(np.sum(np.where(same, sq, np.exp(-sq / temperature)) * off))
    grad = 2.0 * np.einsum("ij,ijd->id", weight, diff)
    return value, SimpleNamespace(embeddings=grad)


def test_the_stand_in_base_loss_has_the_right_gradient():
    rng = np.random.default_rng(0)
    labels = np.array([0, 0, 1, 1, 2])
    result = check_loss(lambda embeddings: smooth_pair_loss(embeddings, labels),
                        {"embeddings": rng.standard_normal((5, 3))}, rng=0)
    assert_gradients(result, rtol=1e-7)


def _loop_ridge(Z, Y, eps):
    """Ridge by least squares on the augmented system [Z; sqrt(eps) I] V = [Y; 0]."""
    m = Z.shape[1]
    A = np.vstack([Z, np.sqrt(eps) * np.eye(m)])
    B = np.vstack([Y, np.zeros((m, Y.shape[1]))])
    return np.linalg.lstsq(A, B, rcond=None)[0]


def _labels_and_split(rng, n_classes, per_class):
    labels = rng.permutation(np.repeat(np.arange(n_classes), per_class))
    return labels, labels < n_classes // 2


# --------------------------------------------------------------------------- split


@given(st.integers(2, 6), st.data(), st.integers(0, 2**32 - 1))
def test_split_is_class_disjoint_covers_the_batch_and_is_deterministic(n_classes, data, seed):
    labels = data.draw(rst.labels(n_classes, (1, 4)))
    mask = crossbatch.class_disjoint_split(labels, rng=seed)
    assert mask.dtype == bool and mask.shape == labels.shape
    first, second = set(labels[mask].tolist()), set(labels[~mask].tolist())
    assert first and second
    assert first.isdisjoint(second)
    assert first | second == set(labels.tolist())
    _, counts = np.unique(labels, return_counts=True)
    assert abs(np.count_nonzero(mask) - np.count_nonzero(~mask)) <= counts.max()
    np.testing.assert_array_equal(crossbatch.class_disjoint_split(labels, rng=seed), mask)


def test_split_depends_on_rng_and_losses_use_it():
    labels = np.repeat(np.arange(8), 2)
    masks = {tuple(crossbatch.class_disjoint_split(labels, rng=s)) for s in range(10)}
    assert len(masks) > 1
    rng = np.random.default_rng(0)
    Z, Y = rng.dirichlet(np.ones(4), size=16), rng.standard_normal((16, 3))
    drawn = crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss, rng=7)[0]
    fixed = crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss,
                                split=crossbatch.class_disjoint_split(labels, rng=7))[0]
    assert drawn == fixed


def test_fewer_than_two_classes_cannot_be_split():
    rng = np.random.default_rng(0)
    Z, Y = rng.dirichlet(np.ones(3), size=4), rng.standard_normal((4, 2))
    with pytest.raises(ValueError, match="fewer than two classes cannot be split"):
        crossbatch.class_disjoint_split([3, 3, 3, 3])
    with pytest.raises(ValueError, match="fewer than two classes cannot be split"):
        crossbatch.xml_loss(Z, Y, [1, 1, 1, 1], ridge=0.1, base_loss=smooth_pair_loss)
    with pytest.raises(ValueError, match="fewer than two classes cannot be split"):
        crossbatch.zero_shot_loss(Z, [0, 0, 0, 0], rng.standard_normal((2, 2)))


def test_a_given_split_is_validated():
    rng = np.random.default_rng(0)
    Z, Y = rng.dirichlet(np.ones(3), size=4), rng.standard_normal((4, 2))
    labels = np.array([0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"not class-disjoint: classes \[1\]"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss,
                            split=np.array([True, True, True, False]))
    with pytest.raises(ValueError, match="one half empty"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss, split=np.ones(4, bool))
    with pytest.raises(TypeError, match="boolean mask"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss, split=[1, 1, 0, 0])
    with pytest.raises(ValueError, match="split has shape"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss, split=np.ones(3, bool))


# --------------------------------------------------------------------------- cross fit


def test_cross_fit_matches_a_loop_and_its_gradient_is_right():
    rng = np.random.default_rng(1)
    labels, split = _labels_and_split(rng, 4, 3)
    Z, T = rng.dirichlet(np.ones(5), size=12), rng.standard_normal((12, 3))
    P = crossbatch.cross_fit(Z, T, split, ridge=0.2)
    V1 = _loop_ridge(Z[split], T[split], 0.2)
    V2 = _loop_ridge(Z[~split], T[~split], 0.2)
    for i in range(12):
        expected = Z[i] @ (V2 if split[i] else V1)
        np.testing.assert_allclose(P[i], expected, rtol=1e-10, atol=1e-12)

    def forward(Z, targets):
        return crossbatch.cross_fit_forward(Z, targets, split, ridge=0.2)

    result = check_gradients(forward, crossbatch.cross_fit_backward, {"Z": Z, "targets": T}, rng=1)
    assert_gradients(result, rtol=1e-6)
    with pytest.raises(TypeError, match="boolean mask"):
        crossbatch.cross_fit(Z, T, split.astype(int), ridge=0.2)
    with pytest.raises(ValueError, match="one half empty"):
        crossbatch.cross_fit(Z, T, np.zeros(12, bool), ridge=0.2)


# --------------------------------------------------------------------------- XML loss


def _loop_xml(Z, Y, labels, split, eps, base_loss, lambda_, kwargs=None):
    """Eqs. (2.10)-(2.11) in the paper's columns: V_k = Y_k (Z_k^T Z_k + eps I)^{-1} Z_k^T
    (d x m), Y_hat_1 = V_2 Z_1, Y_hat_2 = V_1 Z_2."""
    kwargs = kwargs or {}
    halves = [np.flatnonzero(split), np.flatnonzero(~split)]
    fits = []
    for idx in halves:
        Zk, Yk = Z[idx].T, Y[idx].T
        fits.append(Yk @ np.linalg.inv(Zk.T @ Zk + eps * np.eye(len(idx))) @ Zk.T)
    total = 0.0
    for k, idx in enumerate(halves):
        other = fits[1 - k]
        predictions = np.array([other @ Z[i] for i in idx])
        total += base_loss(predictions, labels[idx], **kwargs)[0]
    dml = base_loss(Y, labels, **kwargs)[0]
    return (1 - lambda_) * dml + lambda_ * total


@pytest.mark.parametrize("lambda_", [1.0, 0.6, 0.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_xml_loss_matches_a_loop_and_its_gradient_is_right(lambda_, seed):
    rng = np.random.default_rng(seed)
    labels, split = _labels_and_split(rng, 4, 3)
    Z, Y = rng.dirichlet(np.ones(5), size=12), rng.standard_normal((12, 3))
    value, grads = crossbatch.xml_loss(Z, Y, labels, ridge=0.2, base_loss=smooth_pair_loss,
                                       split=split, lambda_=lambda_)
    expected = _loop_xml(Z, Y, labels, split, 0.2, smooth_pair_loss, lambda_)
    np.testing.assert_allclose(value, expected, rtol=1e-10)
    inputs = {"Z": Z, "Y": Y, "labels": labels, "ridge": 0.2, "base_loss": smooth_pair_loss,
              "split": split, "lambda_": lambda_}
    assert_gradients(check_loss(crossbatch.xml_loss, inputs, wrt=("Z", "Y"), rng=seed), rtol=1e-6)
    if lambda_ == 0.0:
        np.testing.assert_allclose(value, smooth_pair_loss(Y, labels)[0], rtol=1e-13)
        np.testing.assert_array_equal(grads.Z, 0.0)


@st.composite
def _batches(draw, with_targets=True):
    n_classes = draw(st.integers(2, 4))
    labels = draw(rst.labels(n_classes, (1, 3)))
    b = labels.size
    m = draw(st.integers(2, 5))
    Z = draw(rst.simplex_vectors(m, batch=b))
    Y = draw(rst.points_in_unit_ball(b, 2)) if with_targets else None
    eps = draw(st.floats(0.05, 1.0))
    seed = draw(st.integers(0, 2**16))
    return Z, Y, labels, eps, crossbatch.class_disjoint_split(labels, rng=seed)


@given(_batches(), st.floats(0.0, 1.0))
def test_xml_loss_gradients_hypothesis(batch, lambda_):
    Z, Y, labels, eps, split = batch
    inputs = {"Z": Z, "Y": 2.0 * Y, "labels": labels, "ridge": eps, "base_loss": smooth_pair_loss,
              "split": split, "lambda_": lambda_}
    value = crossbatch.xml_loss(**inputs)[0]
    np.testing.assert_allclose(value, _loop_xml(Z, 2.0 * Y, labels, split, eps, smooth_pair_loss, lambda_),
                               rtol=1e-8, atol=1e-10)
    # atol: where every histogram is the same (hypothesis drew Z = 1/2 everywhere) the
    # gradient in Z is 0 and the loss is a small difference of O(1) terms; the central
    # difference then carries their rounding (up to eps * 1 / h ~ 1e-10), which the
    # harness's floor, scaled by the small output, cannot see. Wrong gradients are O(1e-2).
    assert_gradients(check_loss(crossbatch.xml_loss, inputs, wrt=("Z", "Y"), rng=0),
                     rtol=1e-6, atol=1e-10)


def test_xml_loss_default_base_loss_is_contrastive():
    rng = np.random.default_rng(3)
    labels, split = _labels_and_split(rng, 4, 3)
    Z, Y = rng.dirichlet(np.ones(5), size=12), rng.standard_normal((12, 3))
    value, grads = crossbatch.xml_loss(Z, Y, labels, ridge=0.2, split=split, lambda_=0.5)
    expected = _loop_xml(Z, Y, labels, split, 0.2, losses.contrastive, 0.5)
    np.testing.assert_allclose(value, expected, rtol=1e-10)
    # Away from the hinge m- = 0.3841 (the default margin) and from coincident points,
    # the default path is smooth: check its gradient with the default margins.
    predictions = crossbatch.cross_fit(Z, Y, split, ridge=0.2)
    for points in (predictions[split], predictions[~split], Y):
        distances = np.linalg.norm(points[:, None] - points[None], axis=-1)
        assert np.min(np.abs(distances - 0.3841)) > 1e-3
        assert np.min(distances + np.eye(len(points))) > 1e-3
    inputs = {"Z": Z, "Y": Y, "labels": labels, "ridge": 0.2, "split": split, "lambda_": 0.5}
    assert_gradients(check_loss(crossbatch.xml_loss, inputs, wrt=("Z", "Y"), rng=3), rtol=1e-6)
    kwargs = {"pos_margin": 0.0, "neg_margin": 100.0, "reduction": "sum"}
    value = crossbatch.xml_loss(Z, Y, labels, ridge=0.2, split=split, base_loss_kwargs=kwargs)[0]
    expected = _loop_xml(Z, Y, labels, split, 0.2, losses.contrastive, 1.0, kwargs)
    np.testing.assert_allclose(value, expected, rtol=1e-10)


def test_xml_loss_bad_input():
    rng = np.random.default_rng(0)
    Z, Y = rng.dirichlet(np.ones(3), size=4), rng.standard_normal((4, 2))
    labels = np.array([0, 0, 1, 1])
    with pytest.raises(ValueError, match="ridge == 0.0"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.0)
    with pytest.raises(ValueError, match="lambda_ == 1.5"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, lambda_=1.5)
    with pytest.raises(ValueError, match="Z has 4 rows but Y has 3"):
        crossbatch.xml_loss(Z, Y[:3], labels, ridge=0.1)
    with pytest.raises(ValueError, match="labels has length 3"):
        crossbatch.xml_loss(Z, Y, labels[:3], ridge=0.1)
    with pytest.raises(ValueError, match="Y must be finite"):
        crossbatch.xml_loss(Z, Y * np.inf, labels, ridge=0.1)
    with pytest.raises(TypeError, match="base_loss must be callable"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss="contrastive")
    # A keyword the base loss does not take is named as base_loss_kwargs, not as
    # Python's "unexpected keyword" from inside the call.
    with pytest.raises(TypeError, match=r"base_loss_kwargs \['margin'\] do not fit base_loss "
                                        r"contrastive"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss_kwargs={"margin": 0.5})
    with pytest.raises(TypeError, match=r"base_loss_kwargs \['scale'\] do not fit base_loss "
                                        r"smooth_pair_loss"):
        crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=smooth_pair_loss,
                            base_loss_kwargs={"scale": 2.0})
    # A base loss that returns no grads.embeddings: a TypeError saying what it must return.
    for junk in (lambda y, l: (1.0, None), lambda y, l: 1.0):
        with pytest.raises(TypeError, match=r"base_loss must return \(value, grads\) with "
                                            r"grads.embeddings"):
            crossbatch.xml_loss(Z, Y, labels, ridge=0.1, base_loss=junk)


# --------------------------------------------------------------------------- zero-shot loss


def _paper_predictors(Z, labels, upsilon, split, eps):
    """A_k = Upsilon_k (Z_k^T Z_k + eps I)^{-1} Z_k^T in GSP's columns, k = 1, 2."""
    predictors = []
    for idx in (np.flatnonzero(split), np.flatnonzero(~split)):
        Ups_k, Z_k = upsilon[labels[idx]].T, Z[idx].T
        predictors.append(Ups_k @ np.linalg.inv(Z_k.T @ Z_k + eps * np.eye(len(idx))) @ Z_k.T)
    return predictors


def _loop_zero_shot(Z, labels, upsilon, split, eps, scale):
    """Algorithm 4: softmax cross-entropy over the concatenated predictions."""
    A1, A2 = _paper_predictors(Z, labels, upsilon, split, eps)
    total = 0.0
    for i in range(len(labels)):
        prediction = (A2 if split[i] else A1) @ Z[i]
        logits = [scale * float(upsilon[j] @ prediction) for j in range(len(upsilon))]
        top = max(logits)
        normaliser = sum(math.exp(v - top) for v in logits)
        total += -(logits[labels[i]] - top - math.log(normaliser))
    return total / len(labels)


def _loop_zero_shot_printed(Z, labels, upsilon, split, eps):
    """Eq. (4.4) as printed, term by term (j runs over all classes, y_i included)."""
    A1, A2 = _paper_predictors(Z, labels, upsilon, split, eps)
    total = 0.0
    for half, predictor in ((~split, A1), (split, A2)):
        idx = np.flatnonzero(half)
        for i in idx:
            prediction = predictor @ Z[i]
            inner = sum(math.exp(float((upsilon[j] - upsilon[labels[i]]) @ prediction))
                        for j in range(len(upsilon)))
            total += math.log(1.0 + inner) / len(idx)
    return total


def _zero_shot_example(seed, n_classes=5, per_class=2):
    rng = np.random.default_rng(seed)
    labels = rng.permutation(np.repeat(np.arange(n_classes - 1), per_class))  # last class unseen
    split = labels < (n_classes - 1) // 2
    Z = rng.dirichlet(np.ones(6), size=labels.size)
    upsilon = 0.5 * rng.standard_normal((n_classes, 3))
    return Z, labels, upsilon, split


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zero_shot_loss_matches_algorithm_4_loop_and_gradients(seed):
    Z, labels, upsilon, split = _zero_shot_example(seed)
    for scale in (1.0, 9.5):
        value, grads = crossbatch.zero_shot_loss(Z, labels, upsilon, scale=scale, split=split)
        np.testing.assert_allclose(value, _loop_zero_shot(Z, labels, upsilon, split, 0.05, scale), rtol=1e-10)
        inputs = {"Z": Z, "labels": labels, "class_embeddings": upsilon, "scale": scale, "split": split}
        assert_gradients(check_loss(crossbatch.zero_shot_loss, inputs, rng=seed), rtol=1e-6)
    # The class absent from the batch still gets gradient, through the softmax only.
    assert np.abs(grads.class_embeddings[-1]).max() > 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_zero_shot_printed_matches_eq_4_4_loop_and_gradients(seed):
    Z, labels, upsilon, split = _zero_shot_example(seed)
    value, _ = crossbatch.zero_shot_loss_printed(Z, labels, upsilon, split=split)
    np.testing.assert_allclose(value, _loop_zero_shot_printed(Z, labels, upsilon, split, 0.05), rtol=1e-10)
    inputs = {"Z": Z, "labels": labels, "class_embeddings": upsilon, "split": split}
    assert_gradients(check_loss(crossbatch.zero_shot_loss_printed, inputs, rng=seed), rtol=1e-6)


def test_printed_eq_4_4_is_not_algorithm_4():
    Z, labels, upsilon, split = _zero_shot_example(0)
    ce = crossbatch.zero_shot_loss(Z, labels, upsilon, scale=1.0, split=split)[0]
    printed = crossbatch.zero_shot_loss_printed(Z, labels, upsilon, split=split)[0]
    # Each term of (4.4) is softplus(ce_i) = log(1 + e^{ce_i}) with ce_i >= 0 the
    # per-sample cross-entropy, so softplus(ce_i) > max(ce_i, log 2); with halves of
    # equal size, (4.4) = (2 / b) sum_i softplus(ce_i) > 2 max(CE, log 2).
    assert np.count_nonzero(split) == np.count_nonzero(~split)
    assert printed > 2.0 * ce
    assert printed > 2.0 * np.log(2.0)


@given(_batches(with_targets=False), st.floats(0.5, 10.0), st.data())
def test_zero_shot_losses_hypothesis(batch, scale, data):
    Z, _, labels, eps, split = batch
    n_classes = int(labels.max()) + 1 + data.draw(st.integers(0, 2))
    upsilon = data.draw(rst.points_in_unit_ball(n_classes, 3))
    np.testing.assert_allclose(
        crossbatch.zero_shot_loss(Z, labels, upsilon, ridge=eps, scale=scale, split=split)[0],
        _loop_zero_shot(Z, labels, upsilon, split, eps, scale), rtol=1e-8,
    )
    np.testing.assert_allclose(
        crossbatch.zero_shot_loss_printed(Z, labels, upsilon, ridge=eps, split=split)[0],
        _loop_zero_shot_printed(Z, labels, upsilon, split, eps), rtol=1e-8,
    )
    inputs = {"Z": Z, "labels": labels, "class_embeddings": upsilon, "ridge": eps, "split": split}
    assert_gradients(check_loss(crossbatch.zero_shot_loss_printed, inputs, rng=0), rtol=1e-6)
    inputs["scale"] = scale
    assert_gradients(check_loss(crossbatch.zero_shot_loss, inputs, rng=0), rtol=1e-6)


def test_zero_shot_bad_input():
    Z, labels, upsilon, split = _zero_shot_example(0)
    with pytest.raises(ValueError, match=r"labels contain 7, but class_embeddings has rows for classes 0..4"):
        crossbatch.zero_shot_loss(Z, np.where(labels == 0, 7, labels), upsilon)
    with pytest.raises(ValueError, match="labels contain -1"):
        crossbatch.zero_shot_loss_printed(Z, np.where(labels == 0, -1, labels), upsilon)
    with pytest.raises(ValueError, match="scale == 0.0"):
        crossbatch.zero_shot_loss(Z, labels, upsilon, scale=0.0)
    with pytest.raises(ValueError, match="ridge == -0.05"):
        crossbatch.zero_shot_loss(Z, labels, upsilon, ridge=-0.05)
    with pytest.raises(ValueError, match="class_embeddings must be finite"):
        crossbatch.zero_shot_loss(Z, labels, upsilon * np.nan)
    with pytest.raises(ValueError, match="class_embeddings must have 2 dimensions"):
        crossbatch.zero_shot_loss(Z, labels, upsilon[0])


# --------------------------------------------------------------------------- pairs, bad and extreme input


def _pairs():
    Z, labels, upsilon, split = _zero_shot_example(0)
    Y = np.random.default_rng(0).standard_normal((labels.size, 3))
    yield "xml", crossbatch.xml_loss_forward(Z, Y, labels, ridge=0.2, base_loss=smooth_pair_loss,
                                             split=split, lambda_=0.5), crossbatch.xml_loss_backward
    yield "zs", crossbatch.zero_shot_loss_forward(Z, labels, upsilon, split=split), \
        crossbatch.zero_shot_loss_backward
    yield "zsp", crossbatch.zero_shot_loss_printed_forward(Z, labels, upsilon, split=split), \
        crossbatch.zero_shot_loss_printed_backward


def test_loss_pairs_scale_with_d_value_and_check_what_they_are_handed():
    contexts = []
    for name, (value, ctx), backward in _pairs():
        unit, twice = backward(ctx), backward(ctx, 2.5)
        for field in vars(unit):
            np.testing.assert_allclose(getattr(twice, field), 2.5 * getattr(unit, field), rtol=1e-12,
                                       atol=1e-14 * np.abs(getattr(twice, field)).max())
        with pytest.raises(TypeError, match="ctx must be"):
            backward(object())
        with pytest.raises(ValueError, match="d_value == nan"):
            backward(ctx, np.nan)
        with pytest.raises(ValueError, match=r"d_value has shape \(1,\)"):
            backward(ctx, np.ones(1))
        contexts.append(ctx)
    # A context of the sibling loss is foreign too.
    with pytest.raises(TypeError, match="ZeroShotPrintedContext"):
        crossbatch.zero_shot_loss_printed_backward(contexts[1])
    with pytest.raises(TypeError, match="ZeroShotContext"):
        crossbatch.zero_shot_loss_backward(contexts[2])


def test_one_call_forms_equal_the_pairs():
    Z, labels, upsilon, split = _zero_shot_example(1)
    value, grads = crossbatch.zero_shot_loss(Z, labels, upsilon, split=split)
    value2, ctx = crossbatch.zero_shot_loss_forward(Z, labels, upsilon, split=split)
    assert value == value2
    np.testing.assert_array_equal(grads.Z, crossbatch.zero_shot_loss_backward(ctx).Z)


def test_cross_fit_backward_checks_its_upstream():
    rng = np.random.default_rng(0)
    Z, T = rng.dirichlet(np.ones(4), size=6), rng.standard_normal((6, 2))
    split = np.array([True, True, True, False, False, False])
    P, ctx = crossbatch.cross_fit_forward(Z, T, split, ridge=0.1)
    with pytest.raises(TypeError, match="CrossFitContext"):
        crossbatch.cross_fit_backward(object(), P)
    with pytest.raises(ValueError, match=r"d_predictions has shape \(2, 6\)"):
        crossbatch.cross_fit_backward(ctx, P.T)
    with pytest.raises(ValueError, match="d_predictions must be finite"):
        crossbatch.cross_fit_backward(ctx, P * np.nan)
    with pytest.raises(ValueError, match="split has shape"):
        crossbatch.cross_fit(Z, T, split[:5], ridge=0.1)
    with pytest.raises(ValueError, match="ridge == -1.0"):
        crossbatch.cross_fit(Z, T, split, ridge=-1.0)
    with pytest.raises(ValueError, match="lambda_ == -0.5"):
        crossbatch.xml_loss(Z, T, [0, 0, 0, 1, 1, 1], ridge=0.1, lambda_=-0.5)
    with pytest.raises(ValueError, match="labels has length 5"):
        crossbatch.zero_shot_loss(Z, [0, 0, 1, 1, 1], rng.standard_normal((2, 2)))


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_cross_fit_and_xml_loss_at_extreme_scales(scale):
    # P(tZ, sY; r) = s P(Z, Y; r / t^2): compare with the readable loop on rescaled data.
    rng = np.random.default_rng(4)
    labels, split = _labels_and_split(rng, 4, 3)
    Z, Y = rng.dirichlet(np.ones(8), size=12), rng.standard_normal((12, 3))  # halves: 6 rows < 8
    t = float(np.ldexp(1.0, int(np.round(np.log2(scale)))))
    ridge = 0.2
    P = crossbatch.cross_fit(t * Z, Y, split, ridge=ridge)
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        reduced = np.float64(ridge) / np.float64(t) ** 2
    if 1e-280 < reduced < 1e280:
        expected = crossbatch.cross_fit(Z, Y, split, ridge=float(reduced))
    elif reduced <= 1e-280:  # ridge negligible: minimum-norm fits of the halves
        expected = np.empty_like(Y)
        for half, other in ((split, ~split), (~split, split)):
            expected[half] = Z[half] @ np.linalg.lstsq(Z[other], Y[other], rcond=None)[0]
    else:  # ridge dominant: V_k = (G_k / r' + I)^{-1} Z_k^T Y_k / r', 1 / r' = t^2 / ridge
        expected = np.empty_like(Y)
        for half, other in ((split, ~split), (~split, split)):
            Zo = Z[other]
            with np.errstate(under="ignore"):
                inverse_reduced = t * (t / ridge)
            fit = np.linalg.solve(Zo.T @ Zo * inverse_reduced + np.eye(8), Zo.T @ Y[other])
            expected[half] = (Z[half] @ fit) * t * (t / ridge)
    np.testing.assert_allclose(P, expected, rtol=1e-8, atol=0)
    # Y scaled: the predictions are linear in Y; the stand-in base loss overflows at 1e300
    # and must say so rather than return a NaN.
    s = float(np.ldexp(1.0, int(np.round(np.log2(scale)))))
    np.testing.assert_allclose(crossbatch.cross_fit(Z, s * Y, split, ridge=ridge),
                               s * crossbatch.cross_fit(Z, Y, split, ridge=ridge), rtol=1e-12, atol=0)
    if scale > 1e200:
        with np.errstate(over="ignore", invalid="ignore"), \
                pytest.raises(ValueError, match="base_loss returned a non-finite value"):
            crossbatch.xml_loss(Z, s * Y, labels, ridge=ridge, base_loss=smooth_pair_loss, split=split)
    elif scale < 1:
        value = crossbatch.xml_loss(t * Z, Y, labels, ridge=ridge, base_loss=smooth_pair_loss,
                                    split=split)[0]
        np.testing.assert_allclose(value, sum(smooth_pair_loss(P[h], labels[h])[0]
                                              for h in (split, ~split)), rtol=1e-10)
