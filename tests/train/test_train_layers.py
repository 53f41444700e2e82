"""refdml.train layers: loop oracles, the layer protocol, and whole-model gradients.

The pairs' own finite-difference checks run through the catalogue (test_catalog -k train);
here: im2col convolution against a readable loop, col2im as the adjoint of im2col, the
scatter-add of the embedding, GMP's tie rule, GeMean at extreme scales, GSP at mu = 1 is
GAP (GSP Thm 4.1), Sequential's bookkeeping, and a float64 finite-difference check of
EVERY parameter of small models with a loss on top.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml.gradcheck import assert_gradients, check_gradients
from refdml.losses import contrastive_backward, contrastive_forward
from refdml.train import (
    GAP,
    GMP,
    Conv2d,
    Embedding,
    GeMean,
    GSPHead,
    L2Normalize,
    Linear,
    LocalLinear,
    Parameter,
    ReLU,
    Sequential,
    XMLHistogramHead,
)
from refdml.train.layers import (
    col2im,
    conv2d_backward,
    conv2d_forward,
    embedding_backward,
    embedding_forward,
    gemean_backward,
    gemean_forward,
    gmp_backward,
    gmp_forward,
    im2col,
    linear_backward,
    linear_forward,
    local_linear_forward,
)


def loop_conv2d(x, weight, bias, stride, padding):
    """The convolution as written in a textbook: one output entry at a time."""
    batch, channels, height, width = x.shape
    c_out, _, k, _ = weight.shape
    padded = np.zeros((batch, channels, height + 2 * padding, width + 2 * padding))
    padded[:, :, padding:padding + height, padding:padding + width] = x
    h_out = (height + 2 * padding - k) // stride + 1
    w_out = (width + 2 * padding - k) // stride + 1
    y = np.zeros((batch, c_out, h_out, w_out))
    for b in range(batch):
        for o in range(c_out):
            for u in range(h_out):
                for v in range(w_out):
                    total = bias[o]
                    for c in range(channels):
                        for i in range(k):
                            for j in range(k):
                                total += weight[o, c, i, j] * padded[b, c, stride * u + i,
                                                                     stride * v + j]
                    y[b, o, u, v] = total
    return y


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    height=st.integers(3, 7),
    width=st.integers(3, 7),
    stride=st.integers(1, 3),
    padding=st.integers(0, 2),
)
def test_conv2d_matches_the_loop_convolution(seed, height, width, stride, padding):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, height, width))
    weight = rng.standard_normal((2, 3, 3, 3))
    bias = rng.standard_normal(2)
    y, _ = conv2d_forward(x, weight, bias, stride=stride, padding=padding)
    np.testing.assert_allclose(y, loop_conv2d(x, weight, bias, stride, padding),
                               rtol=1e-12, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 3), padding=st.integers(0, 2),
       kernel_size=st.sampled_from([1, 2, 3]))
def test_col2im_is_the_adjoint_of_im2col(seed, stride, padding, kernel_size):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3, 5, 6))
    cols = im2col(x, kernel_size, stride=stride, padding=padding)
    c = rng.standard_normal(cols.shape)
    back = col2im(c, x.shape, kernel_size, stride=stride, padding=padding)
    np.testing.assert_allclose(np.sum(cols * c), np.sum(x * back), rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 3), padding=st.integers(0, 2),
       kernel_size=st.sampled_from([1, 2, 3]), height=st.integers(3, 7), width=st.integers(3, 7))
def test_the_input_gradient_of_conv2d_is_the_adjoint_of_the_convolution(
        seed, stride, padding, kernel_size, height, width):
    # <conv(x) - b, g> = <x, d_x> for every x and g (the backward's d_x is col2im(g W),
    # formed one kernel offset at a time: refdml/train/_conv.py), and three entries of d_x
    # against the loop convolution's response to a unit input there.
    rng = np.random.default_rng(seed)
    if (height + 2 * padding - kernel_size) < 0 or (width + 2 * padding - kernel_size) < 0:
        return
    x = rng.standard_normal((2, 3, height, width))
    weight = rng.standard_normal((4, 3, kernel_size, kernel_size))
    bias = np.zeros(4)
    y, ctx = conv2d_forward(x, weight, bias, stride=stride, padding=padding)
    g = rng.standard_normal(y.shape)
    d_x = conv2d_backward(ctx, g).x
    assert d_x.shape == x.shape
    np.testing.assert_allclose(np.sum(x * d_x), np.sum(y * g), rtol=1e-12)
    # and entry by entry against the loop convolution's gradient, column by column
    eye = np.zeros_like(x)
    for index in [(0, 0, 0, 0), (1, 2, height - 1, width - 1), (0, 1, height // 2, width // 2)]:
        eye[...] = 0
        eye[index] = 1.0
        expected = np.sum(loop_conv2d(eye, weight, bias, stride, padding) * g)
        np.testing.assert_allclose(d_x[index], expected, rtol=1e-12, atol=1e-12)


def test_col2im_counts_the_patches_covering_each_pixel():
    # col2im of all-ones = how many patches contain each pixel (a closed form per axis).
    x_shape = (1, 1, 5, 5)
    cols = im2col(np.zeros(x_shape), 3, stride=1, padding=0)
    counts = col2im(np.ones_like(cols), x_shape, 3, stride=1, padding=0)[0, 0]
    per_axis = np.array([1, 2, 3, 2, 1])
    np.testing.assert_allclose(counts, np.outer(per_axis, per_axis), rtol=0, atol=0)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 3), padding=st.integers(0, 2),
       kernel_size=st.sampled_from([1, 2, 3]), channels=st.integers(1, 4))
def test_im2col_gather_by_index_gathers_what_the_window_copy_gathers(seed, stride, padding,
                                                                      kernel_size, channels):
    # CuPy arrays take the gather by index (columns (c, i, j)), NumPy arrays the window
    # copy (columns (i, j, c)): the same patches. Both only copy numbers (no arithmetic),
    # so they are equal exactly; the padding's entries are zeros.
    from refdml.train._conv import _gather_by_index, _im2col

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, channels, 5, 6))
    cols, channels_last = _im2col(x, kernel_size, stride, padding)
    assert channels_last
    k = kernel_size
    gathered = _gather_by_index(x, kernel_size, stride, padding)
    as_cij = cols.reshape(-1, k, k, channels).transpose(0, 3, 1, 2).reshape(cols.shape)
    np.testing.assert_array_equal(gathered, as_cij)
    # ... and what a direct loop over the zero-padded input gathers
    padded = np.pad(x, ((0, 0), (0, 0), (padding, padding), (padding, padding)))
    h_out = (5 + 2 * padding - k) // stride + 1
    w_out = (6 + 2 * padding - k) // stride + 1
    looped = np.array([padded[b, :, stride * u:stride * u + k, stride * v:stride * v + k]
                       for b in range(2) for u in range(h_out) for v in range(w_out)])
    np.testing.assert_array_equal(gathered, looped.reshape(gathered.shape))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), stride=st.integers(1, 3), padding=st.integers(0, 2),
       kernel_size=st.sampled_from([1, 2, 3]), channels=st.integers(1, 4))
def test_col2im_scatter_by_index_sums_what_the_offset_loop_sums(seed, stride, padding,
                                                                 kernel_size, channels):
    # The device's col2im (one scatter-add by the gather's index) against NumPy's loop over
    # the kernel offsets, and the conv's input gradient on both routes.
    from refdml.train._conv import _col2im, _conv_input_grad, _scatter_by_index

    rng = np.random.default_rng(seed)
    x_shape, k = (2, channels, 5, 6), kernel_size
    h_out = (5 + 2 * padding - k) // stride + 1
    w_out = (6 + 2 * padding - k) // stride + 1
    cols = rng.standard_normal((2 * h_out * w_out, channels * k * k))   # columns (c, i, j)
    channels_last = cols.reshape(-1, channels, k, k).transpose(0, 2, 3, 1).reshape(cols.shape)
    np.testing.assert_allclose(_scatter_by_index(cols, x_shape, k, stride, padding),
                               _col2im(channels_last, x_shape, k, stride, padding),
                               rtol=1e-13, atol=1e-13)
    g = rng.standard_normal((cols.shape[0], 3))
    weight = rng.standard_normal((3, channels, k, k))
    by_index = _conv_input_grad(g, weight.reshape(3, -1), x_shape, k, stride, padding, False)
    by_offset = _conv_input_grad(g, weight.transpose(0, 2, 3, 1).reshape(3, -1), x_shape, k,
                                 stride, padding, True)
    np.testing.assert_allclose(by_index, by_offset, rtol=1e-12, atol=1e-12)


def test_conv2d_names_bad_shapes():
    x = np.ones((1, 2, 4, 4))
    with pytest.raises(ValueError, match="channels"):
        conv2d_forward(x, np.ones((3, 1, 3, 3)), np.zeros(3))
    with pytest.raises(ValueError, match="square"):
        conv2d_forward(x, np.ones((3, 2, 3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="no output location"):
        conv2d_forward(np.ones((1, 2, 2, 2)), np.ones((3, 2, 3, 3)), np.zeros(3), padding=0)
    with pytest.raises(ValueError, match="stride == 0"):
        conv2d_forward(x, np.ones((3, 2, 3, 3)), np.zeros(3), stride=0)


def test_local_linear_is_a_linear_map_at_every_location():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4, 5))
    weight, bias = rng.standard_normal((6, 3)), rng.standard_normal(6)
    f, _ = local_linear_forward(x, weight, bias)
    assert f.shape == (2, 20, 6)
    for b in range(2):
        for h in range(4):
            for w in range(5):
                np.testing.assert_allclose(f[b, h * 5 + w], weight @ x[b, :, h, w] + bias,
                                           rtol=1e-12)
    # ... and the 1x1 convolution, laid out as (B, n, d).
    y, _ = conv2d_forward(x, weight[:, :, None, None], bias, padding=0)
    np.testing.assert_allclose(f, y.reshape(2, 6, 20).transpose(0, 2, 1), rtol=1e-12)


def test_embedding_backward_sums_repeated_tokens():
    rng = np.random.default_rng(1)
    tokens = np.array([[0, 2, 2, 4], [2, 0, 3, 2]])
    table = rng.standard_normal((5, 3))
    y, ctx = embedding_forward(tokens, table)
    np.testing.assert_allclose(y, table[tokens], rtol=0, atol=0)
    d_y = rng.standard_normal(y.shape)
    expected = np.zeros_like(table)
    for b in range(2):
        for j in range(4):
            expected[tokens[b, j]] += d_y[b, j]
    np.testing.assert_allclose(embedding_backward(ctx, d_y).table, expected, rtol=1e-12)
    np.testing.assert_allclose(expected[1], 0.0, atol=0)  # an unused row gets nothing


def test_embedding_names_out_of_range_and_non_integer_tokens():
    table = np.ones((4, 2))
    with pytest.raises(ValueError, match=r"tokens holds 4, must be in \[0, 4\)"):
        embedding_forward(np.array([0, 4]), table)
    with pytest.raises(ValueError, match="tokens holds -1"):
        embedding_forward(np.array([-1, 2]), table)
    with pytest.raises(TypeError, match="tokens must be an array of integers"):
        embedding_forward(np.array([0.0, 1.0]), table)


def test_gmp_sends_the_gradient_to_the_lowest_index_on_ties():
    features = np.array([[[1.0, 0.0], [3.0, 2.0], [3.0, 2.0], [0.0, 2.0]]])  # (1, 4, 2)
    y, ctx = gmp_forward(features)
    np.testing.assert_allclose(y, [[3.0, 2.0]], rtol=0, atol=0)
    d_f = gmp_backward(ctx, np.array([[5.0, 7.0]])).features
    expected = np.zeros((1, 4, 2))
    expected[0, 1, 0] = 5.0
    expected[0, 1, 1] = 7.0
    np.testing.assert_allclose(d_f, expected, rtol=0, atol=0)


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1.0, 1e150, 1e300])
def test_gemean_is_homogeneous_at_any_scale(scale):
    rng = np.random.default_rng(2)
    features = rng.uniform(0.1, 1.0, (2, 5, 3))
    p = 3.0
    expected = np.mean(features**p, axis=1) ** (1 / p)  # well-scaled: direct formula
    y, ctx = gemean_forward(features * scale, p=p)
    np.testing.assert_allclose(y, expected * scale, rtol=1e-13)
    d_y = rng.standard_normal(y.shape)
    d_f_ref = d_y[:, None, :] * (features / expected[:, None, :]) ** (p - 1) / 5
    # dy/df is homogeneous of degree 0: the same gradient at every scale.
    np.testing.assert_allclose(gemean_backward(ctx, d_y).features, d_f_ref, rtol=1e-12)


def test_gemean_dead_column_and_negative_features():
    features = np.zeros((1, 3, 2))
    features[0, :, 1] = [0.5, 0.0, 1.0]
    y, ctx = gemean_forward(features, p=2.0)
    np.testing.assert_allclose(y, [[0.0, np.sqrt(1.25 / 3)]], rtol=1e-14)
    d_f = gemean_backward(ctx, np.ones((1, 2))).features
    np.testing.assert_allclose(d_f[0, :, 0], 0.0, atol=0)
    with pytest.raises(ValueError, match="non-negative"):
        gemean_forward(-features, p=2.0)
    with pytest.raises(ValueError, match="p == 1.0"):
        gemean_forward(features, p=1.0)


def test_gsp_head_at_mu_one_is_gap():
    """GSP Thm 4.1: at mu = 1 the pooled vector is the mean of the features."""
    rng = np.random.default_rng(3)
    features = rng.standard_normal((3, 6, 4))
    head = GSPHead(5, 4, mu=1.0, inverse_temperature=5.0, rng=0)
    (pooled, z), _ = head.forward(features)
    gap, _ = GAP().forward(features)
    np.testing.assert_allclose(pooled, gap, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(z.sum(axis=1), 1.0, rtol=1e-10)


def test_layers_accumulate_and_sequential_walks_back():
    rng = np.random.default_rng(4)
    model = Sequential([Linear(3, 4, rng=0, name="a"), ReLU(), Linear(4, 2, rng=1, name="b")])
    assert [p.name for p in model.parameters()] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    x = rng.standard_normal((5, 3))
    y, ctx = model.forward(x)
    d_y = rng.standard_normal(y.shape)
    d_x = model.backward(ctx, d_y)
    first = {p.name: p.grad.copy() for p in model.parameters()}
    model.backward(ctx, d_y)
    for p in model.parameters():
        np.testing.assert_allclose(p.grad, 2 * first[p.name], rtol=1e-14)
    model.zero_grad()
    assert all(not np.any(p.grad) for p in model.parameters())
    # By hand through the pure pairs: the same d_x.
    a, relu, b = model.layers
    h, ca = linear_forward(x, a.weight.value, a.bias.value)
    r = np.maximum(h, 0)
    _, cb = linear_forward(r, b.weight.value, b.bias.value)
    d_r = linear_backward(cb, d_y).x
    np.testing.assert_allclose(d_x, linear_backward(ca, d_r * (h > 0)).x, rtol=1e-13)


def test_sequential_refuses_foreign_contexts_and_duplicate_names():
    model = Sequential([Linear(3, 2, rng=0)])
    other = Sequential([Linear(3, 2, rng=0)])
    _, ctx = other.forward(np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"ctx was returned by the forward of another object"):
        model.backward(ctx, np.ones((1, 2)))
    with pytest.raises(TypeError, match="SequentialContext"):
        model.backward(object(), np.ones((1, 2)))
    with pytest.raises(ValueError, match="already used"):
        Sequential([Linear(3, 3, rng=0), Linear(3, 3, rng=1)])
    with pytest.raises(ValueError, match="at least one"):
        Sequential([])
    with pytest.raises(TypeError, match=r"layers\[1\] must be a Layer"):
        Sequential([ReLU(), "relu"])


def test_seeded_initialisation_and_dtype():
    a = Conv2d(2, 3, rng=7, dtype=np.float32)
    b = Conv2d(2, 3, rng=7, dtype=np.float32)
    assert a.weight.dtype == np.float32
    np.testing.assert_allclose(a.weight.value, b.weight.value, rtol=0, atol=0)
    assert not np.allclose(a.weight.value, Conv2d(2, 3, rng=8).weight.value)
    # He normal: std sqrt(2 / fan_in) (fan_in = 64 * 9), within sampling error.
    big = Conv2d(64, 64, rng=0)
    np.testing.assert_allclose(big.weight.value.std(), np.sqrt(2 / (64 * 9)), rtol=0.03)
    y, _ = a.forward(np.ones((1, 2, 4, 4), dtype=np.float32))
    assert y.dtype == np.float32


# ---------------------------------------------------------------- whole-model gradients
def _model_check(model, x, labels, *, side_weights=None, seed=0):
    """FD-check every parameter of ``model`` under contrastive (+ <c, side output>)."""
    params = dict(model.named_parameters())

    def forward(**values):
        for name, value in values.items():
            params[name].value = value
        out, ctx = model.forward(x)
        embeddings, side = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        value, loss_ctx = contrastive_forward(embeddings, labels, neg_margin=2.5)
        if side_weights is not None:
            value = value + float(np.sum(side_weights * side))
        return value, (ctx, loss_ctx)

    def backward(ctx, d_value):
        model_ctx, loss_ctx = ctx
        model.zero_grad()
        d_emb = contrastive_backward(loss_ctx, d_value).embeddings
        if model.n_side:
            # An unused side output gets None (documented as zero).
            d_out = (d_emb, None if side_weights is None else d_value * side_weights)
        else:
            d_out = d_emb
        model.backward(model_ctx, d_out)
        return {name: p.grad.copy() for name, p in params.items()}

    inputs = {name: p.value.copy() for name, p in params.items()}
    # mode="vjp": every component of every parameter's gradient against its own FD.
    result = check_gradients(forward, backward, inputs, mode="vjp", rng=seed)
    assert {c.name for c in result.checks} == set(params)
    return result


def _gsp_model(reference=False):
    return Sequential([
        Conv2d(2, 3, rng=0),
        ReLU(),
        LocalLinear(3, 4, rng=1),
        GSPHead(3, 4, mu=0.4, inverse_temperature=3.0, rng=2, reference=reference),
        Linear(4, 3, rng=3),
        L2Normalize(reference=reference),
    ])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("use_z", [False, True])
def test_whole_gsp_model_gradient_every_parameter(seed, use_z):
    """Conv2d -> ReLU -> 1x1 -> GSP head -> Linear -> L2 with a contrastive loss (and <c, z>)."""
    rng = np.random.default_rng(seed)
    model = _gsp_model()
    # Biases start at zero; give them values so their gradients are tested off the origin.
    for p in model.parameters():
        if p.name.endswith("bias"):
            p.value = 0.1 * rng.standard_normal(p.shape)
    x = rng.standard_normal((4, 2, 5, 5))
    labels = np.array([0, 0, 1, 1])
    side = rng.standard_normal((4, 3)) if use_z else None
    result = _model_check(model, x, labels, side_weights=side, seed=seed)
    assert_gradients(result, rtol=1e-6)


def test_whole_model_reference_and_fast_path_agree():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 2, 5, 5))
    labels = np.array([0, 1, 0, 1])
    grads = []
    for reference in (False, True):
        model = _gsp_model(reference=reference)
        (emb, z), ctx = model.forward(x)
        value, loss_ctx = contrastive_forward(emb, labels, neg_margin=2.5)
        model.backward(ctx, (contrastive_backward(loss_ctx).embeddings, np.ones_like(z)))
        grads.append({p.name: p.grad.copy() for p in model.parameters()})
    for name in grads[0]:
        np.testing.assert_allclose(grads[0][name], grads[1][name], rtol=1e-9, atol=1e-12,
                                   err_msg=name)


@pytest.mark.parametrize("head", ["gap", "gmp", "gemean", "xml"])
def test_token_models_gradient_every_parameter(head):
    """Embedding tokens -> ReLU -> pooling head -> Linear -> L2 (the synthetic study's shape)."""
    rng = np.random.default_rng(6)
    tokens = rng.integers(0, 6, size=(4, 5))
    pooling = {
        "gap": GAP(), "gmp": GMP(), "gemean": GeMean(p=3.0),
        "xml": XMLHistogramHead(3, 4, inverse_temperature=2.0, rng=1),
    }[head]
    d_pooled = 3 if head == "xml" else 4
    layers = [Embedding(6, 4, rng=0)]
    if head == "gemean":
        layers.append(ReLU())
    layers += [pooling, Linear(d_pooled, 3, rng=2), L2Normalize()]
    model = Sequential(layers)
    if head == "gemean":
        # Non-negative after the ReLU, and away from the ReLU's kink.
        table = model.layers[0].table
        table.value = np.abs(table.value) + 0.1
    result = _model_check(model, tokens, np.array([0, 0, 1, 1]))
    assert_gradients(result, rtol=1e-6)


def test_parameter_is_the_train_parameter():
    model = Sequential([Linear(2, 2, rng=0)])
    assert all(isinstance(p, Parameter) for p in model.parameters())


def test_whole_model_check_catches_a_wrong_parameter_gradient():
    """The adapter is not vacuous: a 0.1% error in one conv weight's gradient fails."""
    from refdml.train import _conv

    rng = np.random.default_rng(0)
    model = _gsp_model()
    x = rng.standard_normal((4, 2, 5, 5))
    original = _conv.conv2d_backward

    def skewed(ctx, d_y, **options):
        grads = original(ctx, d_y, **options)
        weight = grads.weight.copy()
        weight[0, 0, 1, 1] *= 1.001
        return _conv.Conv2dGrads(x=grads.x, weight=weight, bias=grads.bias)

    _conv.conv2d_backward = skewed
    try:
        result = _model_check(model, x, np.array([0, 0, 1, 1]))
    finally:
        _conv.conv2d_backward = original
    assert not result["conv.weight"].passed(1e-6)
    assert result["local.weight"].passed(1e-6)


@pytest.mark.parametrize("p", [50.0, 2000.0, 1e5, 1e15, 1e17, 1e300])
def test_gemean_at_large_p_against_a_log_domain_oracle(p):
    # An independent evaluation in the log domain: log y = (logsumexp(p log f) - log n) / p
    # and dy/df_j = (1/n) exp((p - 1)(log f_j - log y)). The old weights (f / y)^(p - 1)
    # multiplied y's rounding by p - 1: wrong in the first digit from p ~ 1e15.
    from scipy.special import logsumexp

    from refdml.train._heads import gemean_backward, gemean_forward

    rng = np.random.default_rng(1)
    f = rng.uniform(0.1, 1.0, (2, 6, 3))     # distinct values: one arg-max per channel
    y, ctx = gemean_forward(f, p=p)
    d_y = rng.standard_normal(y.shape)
    got = gemean_backward(ctx, d_y).features
    # The oracle's own rounding grows with p (p times log's): it is used up to p = 1e5;
    # beyond, the map is max pooling to float64's precision and is compared with it.
    if p <= 1e5:
        log_y = (logsumexp(p * np.log(f), axis=1) - np.log(f.shape[1])) / p
        want = d_y[:, None, :] / f.shape[1] * np.exp((p - 1) * (np.log(f) - log_y[:, None, :]))
        np.testing.assert_allclose(y, np.exp(log_y), rtol=1e-12)
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-300)
    else:
        one_hot = f == f.max(axis=1, keepdims=True)
        np.testing.assert_allclose(y, f.max(axis=1), rtol=1e-14)
        np.testing.assert_allclose(got, d_y[:, None, :] * one_hot, atol=1e-12)


def test_conv_without_input_gradient_gives_the_same_parameter_gradients():
    """``input_grad=False`` (a model's first layer, on data) skips only the input's gradient:
    the weight and bias gradients are the same computation as with it (same operands, same
    order), so they agree exactly; the layer returns None for the input."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 6, 6))
    with_grad = Conv2d(3, 4, stride=2, rng=5)
    without = Conv2d(3, 4, stride=2, rng=5, input_grad=False)
    y, ctx = with_grad.forward(x)
    y2, ctx2 = without.forward(x)
    d_y = rng.standard_normal(y.shape)
    assert with_grad.backward(ctx, d_y).shape == x.shape
    assert without.backward(ctx2, d_y) is None
    np.testing.assert_array_equal(without.weight.grad, with_grad.weight.grad)
    np.testing.assert_array_equal(without.bias.grad, with_grad.bias.grad)
    with pytest.raises(TypeError, match="input_grad must be True or False, got"):
        Conv2d(3, 4, rng=0, input_grad=1)
    with pytest.raises(TypeError, match="input_grad must be True or False, got"):
        conv2d_backward(ctx, d_y, input_grad="no")
    assert conv2d_backward(ctx, d_y, input_grad=False).x is None
