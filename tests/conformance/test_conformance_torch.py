"""The PyTorch side of refdml.conformance (skipped without torch): the adapter alone, then
``check_implementation`` against an independent torch contrastive loss, correct and with
terms dropped from its mean.

The loss below is written from the docstring of :func:`refdml.losses.contrastive_forward`
(unordered pairs, ``[d - m+]_+`` for a positive pair and ``[m- - d]_+`` for a negative
one, the mean over all ``n (n - 1) / 2`` terms, subgradient 0 at coincident points),
without calling refdml. The adapter tests check against NumPy's own functions.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

torch = pytest.importorskip("torch")

from refdml.conformance import check_implementation, get_framework  # noqa: E402
from refdml.conformance._frameworks import StructureError  # noqa: E402

EUCLIDEAN_MARGINS = (0.0, 0.3841)   # m+, m- of the euclidean form (refdml's defaults)
COSINE_MARGINS = (1.0, 0.5)         # m+, m- of the cosine form


def _distances(pairs_difference):
    """``||v||`` per row, on ``v / max |v|`` (held fixed: the norm is homogeneous), so the
    squares of entries of 1e-170 or 1e170 neither underflow nor overflow; gradient 0 at
    ``v = 0`` (a NaN from ``sqrt`` is kept out of both branches)."""
    scale = pairs_difference.detach().abs().amax(dim=1, keepdim=True)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    squared = ((pairs_difference / scale) ** 2).sum(dim=1)
    positive = squared > 0
    safe = torch.where(positive, squared, torch.ones_like(squared))
    return torch.where(positive, scale[:, 0] * safe.sqrt(), torch.zeros_like(squared))


def _terms(embeddings, labels, pos_margin, neg_margin, form):
    n = embeddings.shape[0]
    first, second = torch.triu_indices(n, n, offset=1)
    same = labels[first] == labels[second]
    if form == "euclidean":
        pos_margin = EUCLIDEAN_MARGINS[0] if pos_margin is None else pos_margin
        neg_margin = EUCLIDEAN_MARGINS[1] if neg_margin is None else neg_margin
        d = _distances(embeddings[first] - embeddings[second])
        return torch.where(same, torch.relu(d - pos_margin), torch.relu(neg_margin - d))
    pos_margin = COSINE_MARGINS[0] if pos_margin is None else pos_margin
    neg_margin = COSINE_MARGINS[1] if neg_margin is None else neg_margin
    rows = embeddings / _distances(embeddings)[:, None]
    s = (rows[first] * rows[second]).sum(dim=1)
    return torch.where(same, torch.relu(pos_margin - s), torch.relu(s - neg_margin))


def contrastive(embeddings, labels, *, pos_margin=None, neg_margin=None, form="euclidean",
                reduction="mean"):
    terms = _terms(embeddings, labels, pos_margin, neg_margin, form)
    return terms.mean() if reduction == "mean" else terms.sum()


def contrastive_mean_of_active(embeddings, labels, *, pos_margin=None, neg_margin=None,
                               form="euclidean", reduction="mean"):
    """Broken: the mean over the non-zero terms only (the zero ones dropped from the count)."""
    terms = _terms(embeddings, labels, pos_margin, neg_margin, form)
    if reduction != "mean":
        return terms.sum()
    return terms.sum() / (terms > 0).sum().clamp(min=1)


def check(impl, op, dtype="float64", **options):
    options = {"seeds": 1, "search": False, "error_cases": False, **options}
    return check_implementation(impl, op, framework="torch", dtype=dtype, **options)


# ------------------------------------------------------------------------------ adapter


@pytest.fixture(scope="module")
def fw():
    return get_framework("torch")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_asarray_round_trip_keeps_values_and_dtypes(fw, dtype):
    x = np.random.default_rng(0).standard_normal((3, 4))
    tensor = fw.asarray(x, dtype)
    assert tensor.dtype == getattr(torch, dtype)
    assert tensor.device.type == "cpu"
    evaluation = fw.run(lambda inputs: inputs["x"], {"x": tensor}, ("x",), None)
    # A cast and a copy, no arithmetic: NumPy's own cast is the exact expectation.
    assert_array_equal(evaluation.outputs[0], x.astype(dtype))
    assert evaluation.outputs[0].dtype == np.dtype(dtype)


def test_asarray_keeps_integers_and_copes_with_read_only_arrays(fw):
    labels = fw.asarray(np.array([0, 2, 1]), "float32")
    assert labels.dtype == torch.int64
    x = np.arange(6.0)
    x.flags.writeable = False
    assert_array_equal(fw.asarray(x, "float64").numpy(), x)


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-15), ("float32", 1e-6)])
def test_vjp_of_sin_is_cos_times_the_cotangent(fw, dtype, rtol):
    rng = np.random.default_rng(1)
    x, cotangent = rng.uniform(-3.0, 3.0, 7), rng.standard_normal(7)
    tensor = fw.asarray(x, dtype)
    evaluation = fw.run(lambda i: 2.0 * torch.sin(i["x"]), {"x": tensor}, ("x",),
                        (cotangent,))
    rounded = x.astype(dtype).astype(np.float64)
    assert evaluation.grads["x"].dtype == np.dtype(dtype)
    assert_allclose(evaluation.grads["x"], 2.0 * np.cos(rounded) * cotangent, rtol=rtol,
                    atol=rtol)
    # The input itself was not made a leaf of the implementation's graph.
    assert not tensor.requires_grad and tensor.grad is None


def test_unused_inputs_and_detached_outputs_have_no_gradient(fw):
    x = fw.asarray(np.array([0.5, -1.0]), "float64")
    y = fw.asarray(np.array([3.0]), "float64")
    cotangents = (np.array([2.0, -1.0]), np.array(4.0), np.array(1.0))
    evaluation = fw.run(lambda i: (i["x"] ** 2, i["y"].detach().sum(), 1.5),
                        {"x": x, "y": y}, ("x", "y"), cotangents)
    assert_allclose(evaluation.grads["x"], 2 * np.array([2.0, -1.0]) * [0.5, -1.0],
                    rtol=1e-15)
    assert evaluation.grads["y"] is None
    # Nothing requires a gradient at all: every product is "no dependence", not a crash.
    evaluation = fw.run(lambda i: i["x"].detach() * 2, {"x": x}, ("x",), (np.ones(2),))
    assert evaluation.grads == {"x": None}
    assert_array_equal(evaluation.outputs[0], [1.0, -2.0])


@pytest.mark.parametrize("returned, match", [
    (lambda x: x.detach().numpy(), "numpy.ndarray"),
    (lambda x: {"value": x}, "dict"),
    (lambda x: (x, x * 1j), "complex"),
])
def test_outputs_of_the_wrong_kind_are_structure_errors(fw, returned, match):
    x = fw.asarray(np.ones(2), "float64")
    with pytest.raises(StructureError, match=match):
        fw.run(lambda i: returned(i["x"]), {"x": x}, ("x",), (np.ones(2),))


# ------------------------------------------------------------------ contrastive loss


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_torch_contrastive_passes(dtype):
    report = check(contrastive, "losses.contrastive", dtype)
    assert report.passed, report.summary()
    assert {"duplicate points", "one class"} <= set(report.cases), report.cases


def test_torch_contrastive_dropping_zero_terms_fails_its_value():
    report = check(contrastive_mean_of_active, "losses.contrastive", reference_cases=False)
    value = {(f.case, f.quantity): f for f in report.failures}["seed 0", "output 0"]
    assert value.cause == "value"
    # Fewer terms in the count, the same sum: the value can only grow.
    assert value.impl_value > value.ref_value


# ---------------------------------------------------------------------------- bfloat16


def contrastive_in_float16(embeddings, labels, **options):
    """Broken: computed in float16 whatever the inputs' dtype (autocast to the wrong half
    type), cast back: bfloat16's precision, but float16's range (65504)."""
    return contrastive(embeddings.half(), labels, **options).to(embeddings.dtype)


def test_asarray_in_bfloat16_holds_the_rounded_values(fw):
    from refdml.conformance._formats import FORMATS

    x = np.array([1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, np.pi, -1e-40, 3e38])
    tensor = fw.asarray(x, "bfloat16")
    assert tensor.dtype == torch.bfloat16
    evaluation = fw.run(lambda inputs: inputs["x"], {"x": tensor}, ("x",), None)
    assert_array_equal(evaluation.outputs[0], FORMATS["bfloat16"].round(x))
    assert_array_equal(evaluation.outputs[0][:2], [1.0, 1.0 + 2.0 ** -6])  # ties to even


def test_torch_contrastive_passes_in_bfloat16_on_float32s_cases():
    report = check(contrastive, "losses.contrastive", "bfloat16", seeds=2)
    assert report.passed, report.summary()
    assert {"duplicate points", "float32 range edge"} <= set(report.cases), report.cases


def test_torch_contrastive_in_float16_fails_in_bfloat16_at_the_float32_range_edge():
    report = check(contrastive_in_float16, "losses.contrastive", "bfloat16", seeds=2)
    assert {f.case for f in report.failures} == {"float32 range edge"}, report.summary()
