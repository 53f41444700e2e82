"""The fast-path losses beyond the parity suite: bad input named, float32 finite at
extreme hyperparameters, the small-gamma path of SoftTriple, degenerate batches."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

from refdml import losses as ref
from refdml.gpu import losses as fast
from refdml._backend import get_backend
from refdml.gpu.losses._array import cosine_bound, exp_fits, exp_limit, reduce_terms
from refdml.gpu.losses._kernels import masked_logsumexp
from refdml.losses._common import reduce_terms as ref_reduce_terms
from refdml._numerics import masked_logsumexp as ref_masked_logsumexp

LABELS = np.array([0, 0, 1, 1, 2, 2])


def _x(dtype=np.float64, seed=0, n=6, d=4):
    return np.random.default_rng(seed).standard_normal((n, d)).astype(dtype)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="labels has length 5"):
        fast.contrastive_forward(_x(), LABELS[:5])
    with pytest.raises(TypeError, match="labels must hold integer labels"):
        fast.triplet_forward(_x(), LABELS + 0.5)
    with pytest.raises(ValueError, match="embeddings must be finite"):
        fast.triplet_forward(np.full((6, 4), np.nan), LABELS)
    with pytest.raises(ValueError, match="embeddings has a zero vector at row 0"):
        fast.multi_similarity_forward(np.zeros((6, 4)), LABELS)
    with pytest.raises(ValueError, match="labels has class 2, which no proxy represents"):
        fast.proxy_nca_forward(_x(), LABELS, proxies=_x(n=2))
    with pytest.raises(ValueError, match="reduction == 'avg'"):
        fast.contrastive_forward(_x(), LABELS, reduction="avg")
    _, ctx = fast.contrastive_forward(_x(), LABELS)
    with pytest.raises(TypeError, match="returned by contrastive_forward"):
        fast.triplet_backward(ctx)
    with pytest.raises(ValueError, match="d_value == nan, must be finite"):
        fast.contrastive_backward(ctx, float("nan"))
    with pytest.raises(ValueError, match="d_value has shape"):
        fast.contrastive_backward(ctx, np.ones(2))


@pytest.mark.parametrize("name, hyper", [
    ("proxy_anchor", {"alpha": 64.0}),
    ("proxy_nca", {"temperature": 0.01}),
    ("soft_triple", {"lambda_": 100.0, "gamma": 0.01}),   # the (n, C, m) block path
    ("soft_triple", {"lambda_": 100.0, "gamma": 0.05}),   # the shared-shift path
])
def test_float32_finite_at_extreme_hyperparameters(name, hyper):
    x, p = _x(np.float32, 1), _x(np.float32, 2, n=3)
    value, ctx = getattr(fast, f"{name}_forward")(x, LABELS, proxies=p, **hyper)
    grads = getattr(fast, f"{name}_backward")(ctx)
    expected, ref_ctx = getattr(ref, f"{name}_forward")(
        x.astype(np.float64), LABELS, proxies=p.astype(np.float64), **hyper)
    ref_grads = getattr(ref, f"{name}_backward")(ref_ctx)
    assert grads.embeddings.dtype == np.float32 and grads.proxies.dtype == np.float32
    assert np.isfinite(value)
    assert_allclose(value, expected, rtol=1e-4)
    for got, want in ((grads.embeddings, ref_grads.embeddings), (grads.proxies, ref_grads.proxies)):
        assert np.all(np.isfinite(got))
        assert_allclose(got, want, rtol=0, atol=1e-3 * np.max(np.abs(want)))


@pytest.mark.parametrize("gamma", [0.01, 0.1])     # the (n, m, m) block; the shared shift
@pytest.mark.parametrize("tau", [0.0, 0.2])
def test_soft_triple_with_the_centres_of_a_class_apart_matches_the_reference(gamma, tau):
    # The fast path groups the centres by the first centre of each class (no unique), in
    # the order of those first centres: here 2, 0, 1, unsorted and interleaved, with a
    # class of three centres and one of one; the reference by its sorted unique classes.
    rng = np.random.default_rng(11)
    x = rng.standard_normal((9, 5))
    y = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2])
    centres, centre_labels = rng.standard_normal((6, 5)), np.array([2, 0, 2, 1, 0, 2])
    hyper = dict(proxy_labels=centre_labels, lambda_=20.0, gamma=gamma, tau=tau)
    value, ctx = fast.soft_triple_forward(x, y, proxies=centres, **hyper)
    expected, ref_ctx = ref.soft_triple_forward(x, y, proxies=centres, **hyper)
    assert isinstance(value, float)
    assert_allclose(value, expected, rtol=1e-12)
    grads, ref_grads = fast.soft_triple_backward(ctx, 0.7), ref.soft_triple_backward(ref_ctx, 0.7)
    for got, want in ((grads.embeddings, ref_grads.embeddings),
                      (grads.proxies, ref_grads.proxies)):
        assert_allclose(got, want, rtol=1e-10, atol=1e-13 * np.max(np.abs(want)))


def test_multi_similarity_float32_at_large_beta():
    x = _x(np.float32, 3)
    value, ctx = fast.multi_similarity_forward(x, LABELS, alpha=50.0, beta=200.0)
    expected, _ = ref.multi_similarity_forward(x.astype(np.float64), LABELS, alpha=50.0, beta=200.0)
    assert np.isfinite(value) and np.all(np.isfinite(fast.multi_similarity_backward(ctx).embeddings))
    assert_allclose(value, expected, rtol=1e-4)


@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
@pytest.mark.parametrize("mining", ["all", "batch_hard"])
def test_triplet_reductions_and_no_triplet(reduction, mining):
    x = _x()
    for labels in (LABELS, np.arange(6), np.zeros(6, dtype=int)):
        value, ctx = fast.triplet_forward(x, labels, margin=0.5, mining=mining, reduction=reduction)
        expected, ref_ctx = ref.triplet_forward(x, labels, margin=0.5, mining=mining,
                                                reduction=reduction)
        assert_allclose(value, expected, rtol=1e-12)
        assert_allclose(fast.triplet_backward(ctx).embeddings,
                        ref.triplet_backward(ref_ctx).embeddings, rtol=1e-10, atol=1e-14)


def test_masked_logsumexp_matches_reference_and_empty_rows():
    rng = np.random.default_rng(4)
    z = 50 * rng.standard_normal((5, 7))
    mask = rng.random((5, 7)) < 0.5
    mask[2] = False
    lse, soft = masked_logsumexp(z, mask)
    ref_lse, ref_soft = ref_masked_logsumexp(z, mask)
    assert_allclose(lse, ref_lse, rtol=1e-14)
    assert_allclose(soft, ref_soft, rtol=1e-14, atol=1e-300)
    lse1, _ = masked_logsumexp(z, mask, extra_zero=True)
    assert lse1[2] == 0.0
    assert_allclose(lse1, np.logaddexp(0.0, ref_lse), rtol=1e-14)


def _proxy_case(dtype, seed, n=24, k=6, d=8):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(dtype)
    p = rng.standard_normal((k, d)).astype(dtype)
    labels = rng.integers(0, k, size=n)
    labels[:k] = np.arange(k)             # every proxy has a positive, bar the case below
    return x, labels, p


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name, hyper", [
    ("proxy_anchor", {}),
    ("proxy_anchor", {"alpha": 70.0, "delta": 0.5}),       # near the float32 bound
    ("proxy_anchor", {"alpha": 1e-3, "delta": 3.0}),
    ("proxy_nca", {}),
    ("proxy_nca", {"temperature": 0.03}),                 # near the float32 bound
    ("proxy_nca", {"temperature": 50.0}),
])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_proxy_arithmetic_lse_equals_where_lse(monkeypatch, dtype, name, hyper, reduction):
    """The where-free path (constant shift from the hyperparameters, 0/1 masks) gives the
    masked_logsumexp path's value and gradients, on random inputs and near its bound."""
    import refdml.gpu.losses._mirrors as module

    x, labels, p = _proxy_case(dtype, 5)
    labels[labels == 2] = 3                # proxy 2 without positives (Proxy-Anchor)
    forward, backward = getattr(fast, f"{name}_forward"), getattr(fast, f"{name}_backward")
    d_value = 0.7
    taken = []

    def recording_exp_fits(*args):
        taken.append(exp_fits(*args))
        return taken[-1]

    with monkeypatch.context() as patch:
        patch.setattr(module, "exp_fits", recording_exp_fits)
        value, ctx = forward(x, labels, proxies=p, reduction=reduction, **hyper)
        grads = backward(ctx, d_value)
    assert taken == [True]                 # the arithmetic path ran
    monkeypatch.setattr(module, "exp_fits", lambda *a: False)
    expected, where_ctx = forward(x, labels, proxies=p, reduction=reduction, **hyper)
    where_grads = backward(where_ctx, d_value)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert_allclose(value, expected, rtol=tol)
    for got, want in ((grads.embeddings, where_grads.embeddings),
                      (grads.proxies, where_grads.proxies)):
        assert got.dtype == dtype
        assert_allclose(got, want, rtol=0, atol=tol * np.max(np.abs(want)))


def test_exp_fits_bound_is_safe_for_float32_and_float64():
    for dtype in (np.float32, np.float64):
        limit = exp_limit(dtype)
        with np.errstate(over="raise", under="raise"):
            top = np.exp(np.asarray(limit, dtype=dtype))
            low = np.exp(np.asarray(-limit, dtype=dtype))
        assert np.isfinite(top * 2) and low >= np.finfo(dtype).tiny
        assert exp_fits(dtype, limit - np.log(11), 10) and not exp_fits(dtype, limit, 10)
        assert not exp_fits(dtype, np.inf, 1)
        assert 1 < cosine_bound(dtype, 128) < 1.001
    # Past the bound the where path runs: float32 stays finite at temperature 0.01, alpha 100.
    x, labels, p = _proxy_case(np.float32, 6)
    for name, hyper in (("proxy_nca", {"temperature": 0.01}), ("proxy_anchor", {"alpha": 100.0})):
        assert not exp_fits(np.float32, 2 / 0.01, p.shape[0])
        value, ctx = getattr(fast, f"{name}_forward")(x, labels, proxies=p, **hyper)
        grads = getattr(fast, f"{name}_backward")(ctx)
        expected, _ = getattr(ref, f"{name}_forward")(
            x.astype(np.float64), labels, proxies=p.astype(np.float64), **hyper)
        assert_allclose(value, expected, rtol=1e-4)
        assert np.all(np.isfinite(grads.embeddings)) and np.all(np.isfinite(grads.proxies))


@pytest.mark.parametrize("dtype, scales", [
    (np.float32, (1e-30, 1e-15, 1e15, 1e30)),
    (np.float64, (1e-300, 1e-150, 1e150, 1e300)),
])
def test_proxy_losses_scale_invariant_on_both_normalisation_paths(dtype, scales):
    """Inside the plain-norm range and beyond it (the scaled fallback) the same value."""
    x, labels, p = _proxy_case(dtype, 7)
    for name in ("proxy_anchor", "proxy_nca"):
        forward = getattr(fast, f"{name}_forward")
        base, _ = forward(x, labels, proxies=p)
        for scale in scales:
            value, ctx = forward(x * dtype(scale), labels, proxies=p / dtype(scale))
            assert_allclose(value, base, rtol=1e-5 if dtype == np.float32 else 1e-12)
            grads = getattr(fast, f"{name}_backward")(ctx)
            assert np.all(np.isfinite(grads.embeddings)) and np.all(np.isfinite(grads.proxies))
    with pytest.raises(ValueError, match="proxies has a zero vector at row 1"):
        fast.proxy_nca_forward(x, labels, proxies=np.where(np.arange(6)[:, None] == 1, 0, p))


# ---------------------------------------------- issue 20: the reference's messages


def _message(call):
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


_P = _x(seed=7, n=3)
_C, _CL = _x(seed=8, n=6), np.repeat(np.arange(3), 2)


@pytest.mark.parametrize("call", [
    lambda m: m.multi_similarity(_x(), LABELS, alpha=1e-310),
    lambda m: m.multi_similarity(_x(), LABELS, beta=5e-324),
    lambda m: m.proxy_nca(_x(), LABELS, proxies=_P, temperature=1e-310),
    lambda m: m.proxy_anchor(_x(), LABELS, proxies=_P, delta=1e308),
    lambda m: m.soft_triple(_x(), LABELS, proxies=_C, proxy_labels=_CL, gamma=1e-310),
    lambda m: m.soft_triple(_x(), LABELS, proxies=_C, proxy_labels=_CL, lambda_=1e308),
    lambda m: m.soft_triple(_x(), LABELS, proxies=_C, proxy_labels=_CL, tau=1e308),
    lambda m: m.generalized_contrastive(_x(), LABELS, alpha=1e308, beta=1.7e308),
    lambda m: m.generalized_contrastive(_x(), LABELS, alpha=1.0, beta=0.5),
    lambda m: m.triplet(1e307 * _x(), LABELS, margin=1.7e308),
    lambda m: m.contrastive(_x(), LABELS, neg_margin=1.7e308, reduction="sum"),
])
def test_extreme_hyperparameters_give_the_references_messages(call):
    assert _message(lambda: call(fast)) == _message(lambda: call(ref))


@pytest.mark.parametrize("loss, kwargs", [
    ("multi_similarity", {}),
    ("contrastive", {"form": "cosine"}),
    ("proxy_nca", {"proxies": _x(seed=3, n=3)}),
    ("soft_triple", {"proxies": _x(seed=4, n=3)}),
])
def test_cosine_gradients_of_subnormal_rows_give_the_references_message(loss, kwargs):
    x = _x(seed=5)
    x[1] *= 1e-310
    messages = []
    for module in (ref, fast):
        _, ctx = getattr(module, f"{loss}_forward")(x, LABELS, **kwargs)
        messages.append(_message(lambda: getattr(module, f"{loss}_backward")(ctx)))
    assert messages[0] == messages[1]
    assert messages[0].startswith("the gradient with respect to embeddings overflows float64 at row 1")


_EUCLIDEAN = [
    ("contrastive", {"neg_margin": 1.5}),
    ("generalized_contrastive", {"alpha": 0.3, "beta": 1.2}),
    ("triplet", {"margin": 0.4, "mining": "all"}),
    ("triplet", {"margin": 0.4, "mining": "batch_hard"}),
]


def _against_reference(loss, x, kwargs, rtol, d_value=1.7):
    """The fast loss on ``x`` against the reference on ``x`` as float64 (the rounded input)."""
    value, ctx = getattr(fast, f"{loss}_forward")(x, LABELS, **kwargs)
    grads = getattr(fast, f"{loss}_backward")(ctx, d_value)
    ref_value, ref_ctx = getattr(ref, f"{loss}_forward")(x.astype(np.float64), LABELS, **kwargs)
    want = getattr(ref, f"{loss}_backward")(ref_ctx, d_value).embeddings
    assert grads.embeddings.dtype == x.dtype
    assert_allclose(value, ref_value, rtol=rtol)
    assert_allclose(grads.embeddings, want, rtol=0, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("loss, kwargs", _EUCLIDEAN)
@pytest.mark.parametrize("dtype, scale", [(np.float64, 1e-310), (np.float64, 1e-300),
                                          (np.float32, 1e-40), (np.float64, 1e300),
                                          (np.float32, 1e37)])
def test_euclidean_losses_at_extreme_scales_match_the_reference(loss, kwargs, dtype, scale):
    # The context holds x / s and D / s (s a power of two), as the reference's: the
    # gradient, a sum of unit vectors, is computed at any scale. It once divided by the
    # subnormal distances and refused (issue 20). A float32 subnormal (1e-40) holds ~17
    # bits: the reference runs on that rounded input. The margins scale with x.
    kwargs = {k: v * scale if k != "mining" else v for k, v in kwargs.items()}
    with np.errstate(under="ignore"):
        x = (scale * _x(seed=6)).astype(dtype)
    _against_reference(loss, x, kwargs, rtol=1e-5 if dtype == np.float32 else 1e-10)


@settings(max_examples=25, deadline=None)
@given(exponent=st.integers(-320, 300), seed=st.integers(0, 2**16),
       loss=st.sampled_from(range(len(_EUCLIDEAN))))
def test_euclidean_losses_at_any_scale_hypothesis(exponent, seed, loss):
    name, kwargs = _EUCLIDEAN[loss]
    scale = 10.0**exponent
    kwargs = {k: v * scale if k != "mining" else v for k, v in kwargs.items()}
    kwargs = {k: v for k, v in kwargs.items() if k == "mining" or v > 0}  # 1e-320 * 0.3 is 0
    if name == "generalized_contrastive" and len(kwargs) < 2:
        return
    _against_reference(name, scale * _x(seed=seed), kwargs, rtol=1e-9)


def test_xml_loss_at_subnormal_y_matches_the_reference():
    from refdml import crossbatch as ref_crossbatch
    from refdml.gpu import crossbatch as fast_crossbatch
    from refdml.catalog import get

    args = dict(get("crossbatch.xml_loss").make_inputs(np.random.default_rng(7)))
    z, y, labels = args.pop("Z"), 1e-310 * args.pop("Y"), args.pop("labels")
    args["base_loss_kwargs"] = {k: 1e-310 * v for k, v in args["base_loss_kwargs"].items()}
    value, ctx = fast_crossbatch.xml_loss_forward(z, y, labels, **args)
    grads = fast_crossbatch.xml_loss_backward(ctx, 1.3)
    ref_value, ref_ctx = ref_crossbatch.xml_loss_forward(z, y, labels, **args)
    want = ref_crossbatch.xml_loss_backward(ref_ctx, 1.3)
    assert_allclose(value, ref_value, rtol=1e-10)
    for name in ("Z", "Y"):
        expected = getattr(want, name)
        assert_allclose(getattr(grads, name), expected, rtol=0, atol=1e-10 * np.abs(expected).max())


@pytest.mark.parametrize("loss, kwargs", [
    ("contrastive", {"pos_margin": 1e300, "neg_margin": 1e300}),
    ("contrastive", {"neg_margin": 1e39}),
    ("generalized_contrastive", {"alpha": 1.0, "beta": 1e300}),
    ("triplet", {"margin": 1e300, "mining": "all"}),
    ("triplet", {"margin": 1e300, "mining": "batch_hard"}),
    ("multi_similarity", {"alpha": 1e300, "beta": 1e300}),
    ("multi_similarity", {"alpha": 1e-300, "beta": 1e-40}),
    ("multi_similarity", {"mining_margin": 1e300}),
])
def test_float32_hyperparameters_beyond_float32_are_computed(loss, kwargs):
    # A margin of 1e300 is no float32 (its cast overflowed); it enters the terms, whose
    # value is a float64, not the O(1) gradient: the terms are formed in float64.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _against_reference(loss, _x(np.float32, seed=8), kwargs, rtol=1e-5)


def test_float32_triplet_term_beyond_float32_is_computed():
    # Distances and margin both float32 numbers, d_ap - d_an + margin not: float64 terms.
    x = 1e38 * _x(np.float32, seed=9) / 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _against_reference("triplet", x, {"margin": 3e38}, rtol=1e-5)


@pytest.mark.parametrize("exists", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero"])
def test_mean_of_terms_whose_sum_overflows(exists, reduction):
    # As the reference (refdml.losses._common.reduce_terms): the mean of terms whose float64
    # sum overflows is taken on terms / 2^64, not refused.
    terms = np.array([1.5e308, 1.7e308, 0.0, 1e308, 5.0])
    value, weights = reduce_terms(get_backend(terms), terms, reduction,
                                  np.ones(5, bool) if exists else None)
    expected, ref_weights = ref_reduce_terms(terms, reduction)
    assert np.isfinite(float(value))
    assert_allclose(float(value), expected, rtol=1e-15)
    assert_allclose(weights, ref_weights, rtol=1e-15)


def test_contrastive_whose_sum_overflows_returns_the_mean():
    points = 0.8e308 * np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    labels = np.array([0, 1, 0, 1])
    value, _ = fast.contrastive_forward(points, labels, neg_margin=1.0)
    expected, _ = ref.contrastive_forward(points, labels, neg_margin=1.0)
    assert_allclose(value, expected, rtol=1e-14)


def test_upstream_beyond_float32_is_named():
    _, ctx = fast.contrastive_forward(_x(np.float32), LABELS)
    with pytest.raises(ValueError, match=r"^d_value == 1e\+300 is beyond the float32 range"):
        fast.contrastive_backward(ctx, np.array(1e300))
    with pytest.raises(ValueError, match=r"d_value == 1e\+300 times a sum of unit vectors, "
                                         r"beyond float32; use a smaller d_value"):
        fast.contrastive_backward(ctx, 1e300)
