import numpy as np
import pytest
from hypothesis import given, assume

from refdml import _numerics, distances, normalize
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst


def test_clip_normalize_values():
    x = np.array([[0.3, 0.4], [3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(normalize.clip_normalize(x), [[0.3, 0.4], [0.6, 0.8], [0.0, 0.0]])


def test_clip_normalize_on_sphere_uses_identity_branch():
    x = np.array([[0.6, 0.8]])
    y, ctx = normalize.clip_normalize_forward(x)
    g = np.array([[1.0, -2.0]])
    np.testing.assert_array_equal(normalize.clip_normalize_backward(ctx, g).x, g)


@given(rst.points_in_unit_ball(5, 3, min_radius=0.05, max_radius=0.95))
def test_clip_normalize_gradients_inside_and_outside(points):
    scale = np.array([1.0, 1.0, 3.0, 3.0, 0.5])[:, None]
    x = points * scale
    assume(np.all(np.abs(np.linalg.norm(x, axis=1) - 1.0) > 1e-3))
    result = check_gradients(normalize.clip_normalize_forward, normalize.clip_normalize_backward, {"x": x}, rng=0)
    assert_gradients(result, rtol=1e-6)


def test_zero_vectors_are_named_with_their_parameter_and_row():
    with pytest.raises(ValueError, match="x has a zero vector at row 1"):
        normalize.l2_normalize(np.array([[1.0, 0.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match=r"x has a zero vector at row \(1, 0\)"):
        normalize.l2_normalize(np.array([[[1.0, 0.0]], [[0.0, 0.0]]]))
    with pytest.raises(ValueError, match="y has a zero vector at row 2"):
        distances.cosine(np.ones((2, 3)), np.array([[1.0, 0, 0], [0, 1, 0], [0, 0, 0]]))


def _loop_distances(x, y):
    return np.array([[np.sqrt(sum((a - b) ** 2 for a, b in zip(xi, yj))) for yj in y] for xi in x])


def test_euclidean_matches_a_loop_and_sq_and_cosine():
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((5, 3))
    loop = _loop_distances(x, y)
    np.testing.assert_allclose(distances.euclidean(x, y), loop, rtol=1e-14)
    np.testing.assert_allclose(distances.sq_euclidean(x, y), loop**2, rtol=1e-13)
    cos = np.array([[xi @ yj / np.linalg.norm(xi) / np.linalg.norm(yj) for yj in y] for xi in x])
    np.testing.assert_allclose(distances.cosine(x, y), cos, rtol=1e-13)


def test_euclidean_is_accurate_for_nearby_points():
    # The Gram identity would return ~1e-8 here; explicit differences return 1e-12.
    x = np.array([[1e3, 1e3, 1e3]])
    y = x + np.array([[1e-12 * 2**10, 0.0, 0.0]])
    np.testing.assert_allclose(distances.euclidean(x, y)[0, 0], np.abs(y - x)[0, 0], rtol=1e-3)


def test_euclidean_zero_distance_gradient_is_zero_not_nan():
    x = np.array([[1.0, 2.0], [0.0, 0.0]])
    y = np.array([[1.0, 2.0]])
    d, ctx = distances.euclidean_forward(x, y)
    grads = distances.euclidean_backward(ctx, np.ones_like(d))
    assert np.all(np.isfinite(grads.x)) and np.all(np.isfinite(grads.y))
    np.testing.assert_array_equal(grads.x[0], [0.0, 0.0])
    np.testing.assert_allclose(grads.x[1], (x[1] - y[0]) / np.linalg.norm(x[1] - y[0]))


def test_euclidean_refinement_matches_explicit_differences(monkeypatch):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((3, 7, 4)), rng.standard_normal((3, 6, 4))
    y[:, 0] = x[:, 0] + 1e-9  # nearby pairs take the refinement path
    explicit = np.sqrt(((x[:, :, None, :] - y[:, None, :, :]) ** 2).sum(-1))
    np.testing.assert_allclose(distances.euclidean(x, y), explicit, rtol=1e-12)
    monkeypatch.setattr(_numerics, "_CHUNK_BYTES", 64)  # refine in many small chunks
    monkeypatch.setattr(_numerics, "_REFINE", 10.0)  # ... and refine every pair
    np.testing.assert_allclose(distances.euclidean(x, y), explicit, rtol=1e-14)


def test_broadcast_leading_dimension_gradient():
    rng = np.random.default_rng(1)
    inputs = {"x": rng.standard_normal((3, 4, 2)), "y": rng.standard_normal((1, 5, 2))}
    for fwd, bwd in (
        (distances.euclidean_forward, distances.euclidean_backward),
        (distances.sq_euclidean_forward, distances.sq_euclidean_backward),
        (distances.cosine_forward, distances.cosine_backward),
    ):
        assert_gradients(check_gradients(fwd, bwd, inputs, rng=0), rtol=1e-6)


@given(rst.points_in_unit_ball(4, 3, min_radius=0.2), rst.points_on_sphere(3, 3))
def test_distance_gradients_hypothesis(x, y):
    assume(np.min(distances.euclidean(x, y)) > 1e-3)
    # Exactly parallel pairs make the cosine gradient vanish while its third derivative
    # (~1/|x|^3) does not: central differences then measure only their own truncation.
    assume(np.max(np.abs(distances.cosine(x, y))) < 1 - 1e-6)
    for fwd, bwd in (
        (distances.euclidean_forward, distances.euclidean_backward),
        (distances.sq_euclidean_forward, distances.sq_euclidean_backward),
        (distances.cosine_forward, distances.cosine_backward),
    ):
        assert_gradients(check_gradients(fwd, bwd, {"x": x, "y": y}, rng=0), rtol=1e-6)


@pytest.mark.parametrize(
    "x, y, match",
    [
        (np.ones((2, 3)), np.ones((2, 4)), "same last dimension"),
        (np.ones(3), np.ones((2, 3)), "x must have at least 2"),
        (np.array([[np.nan, 1.0]]), np.ones((1, 2)), "x must be finite"),
        (np.ones((2, 0, 3)), np.ones((2, 1, 3)), "x must not be empty"),
    ],
)
def test_distance_bad_input(x, y, match):
    with pytest.raises(ValueError, match=match):
        distances.euclidean(x, y)


def test_distance_type_errors():
    with pytest.raises(TypeError, match="x must be an array of real numbers"):
        distances.euclidean("abc", np.ones((1, 2)))
    with pytest.raises(TypeError, match="dtype complex"):
        distances.euclidean(np.ones((1, 2), dtype=complex), np.ones((1, 2)))


# ------------------------------------------------------- extreme but finite input

SCALES = [1e-300, 1e-150, 1e150, 1e300]


def _rows(seed, shape=(5, 4)):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("scale", SCALES)
def test_l2_normalize_is_scale_invariant_and_its_gradient_scales_as_one_over_s(scale):
    # Independent oracle: the unscaled computation. y(s x) = y(x), grad(s x) = grad(x) / s.
    x, g = _rows(0), _rows(1)
    y, ctx = normalize.l2_normalize_forward(x)
    ys, ctx_s = normalize.l2_normalize_forward(x * scale)
    np.testing.assert_allclose(ys, y, rtol=1e-14, atol=0)
    np.testing.assert_allclose(
        normalize.l2_normalize_backward(ctx_s, g).x * scale,
        normalize.l2_normalize_backward(ctx, g).x, rtol=1e-13, atol=1e-15,
    )
    np.testing.assert_allclose(y, x / np.linalg.norm(x, axis=1, keepdims=True), rtol=1e-15)


@pytest.mark.parametrize("scale", SCALES)
def test_clip_normalize_at_extreme_scales(scale):
    x, g = _rows(2), _rows(3)
    y, ctx = normalize.clip_normalize_forward(x * scale)
    grad = normalize.clip_normalize_backward(ctx, g).x
    if scale > 1.0:   # every row far outside the ball: the l2 normalisation
        unit, unit_ctx = normalize.l2_normalize_forward(x)
        np.testing.assert_allclose(y, unit, rtol=1e-14)
        np.testing.assert_allclose(
            grad * scale, normalize.l2_normalize_backward(unit_ctx, g).x, rtol=1e-13, atol=1e-15
        )
    else:             # inside: the identity, exactly
        np.testing.assert_array_equal(y, x * scale)
        np.testing.assert_array_equal(grad, g)


def test_normalize_rows_of_very_different_scales_in_one_array():
    x = np.array([[3e-300, 4e-300], [3e300, 4e300], [0.3, 0.4], [5e-320, 0.0]])
    np.testing.assert_allclose(
        normalize.l2_normalize(x), [[0.6, 0.8], [0.6, 0.8], [0.6, 0.8], [1.0, 0.0]], rtol=1e-15
    )
    np.testing.assert_allclose(
        normalize.clip_normalize(x), [[3e-300, 4e-300], [0.6, 0.8], [0.3, 0.4], [5e-320, 0.0]],
        rtol=1e-15,
    )


@pytest.mark.parametrize("scale", SCALES)
def test_euclidean_at_extreme_scales(scale):
    # D(s x, s y) = s D(x, y); the gradient is homogeneous of degree 0.
    x, y, g = _rows(4, (2, 4, 3)), _rows(5, (1, 5, 3)), _rows(6, (2, 4, 5))
    d, ctx = distances.euclidean_forward(x, y)
    ds, ctx_s = distances.euclidean_forward(x * scale, y * scale)
    np.testing.assert_allclose(ds / scale, d, rtol=1e-13)
    grads, grads_s = distances.euclidean_backward(ctx, g), distances.euclidean_backward(ctx_s, g)
    np.testing.assert_allclose(grads_s.x, grads.x, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grads_s.y, grads.y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale_x", SCALES + [1.0])
@pytest.mark.parametrize("scale_y", [1e-300, 1.0, 1e300])
def test_cosine_is_scale_invariant_in_each_argument(scale_x, scale_y):
    x, y, g = _rows(7, (4, 3)), _rows(8, (5, 3)), _rows(9, (4, 5))
    s, ctx = distances.cosine_forward(x, y)
    ss, ctx_s = distances.cosine_forward(x * scale_x, y * scale_y)
    np.testing.assert_allclose(ss, s, rtol=1e-14, atol=1e-15)
    grads, grads_s = distances.cosine_backward(ctx, g), distances.cosine_backward(ctx_s, g)
    np.testing.assert_allclose(grads_s.x * scale_x, grads.x, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(grads_s.y * scale_y, grads.y, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale", [1e-150, 1e-100, 1e100, 1e150])
def test_sq_euclidean_where_the_squares_are_representable(scale):
    x, y, g = _rows(10, (4, 3)), _rows(11, (5, 3)), _rows(12, (4, 5))
    d, ctx = distances.sq_euclidean_forward(x, y)
    ds, ctx_s = distances.sq_euclidean_forward(x * scale, y * scale)
    np.testing.assert_allclose(ds / scale**2, d, rtol=1e-13)
    grads, grads_s = distances.sq_euclidean_backward(ctx, g), distances.sq_euclidean_backward(ctx_s, g)
    np.testing.assert_allclose(grads_s.x / scale, grads.x, rtol=1e-12, atol=1e-14)


def test_sq_euclidean_overflow_is_a_named_error_and_underflow_rounds():
    x, y = _rows(13, (4, 3)), _rows(14, (5, 3))
    for scale in (1e160, 1e300):
        with pytest.raises(ValueError, match="squared distances overflow float64.*use euclidean"):
            distances.sq_euclidean(x * scale, y * scale)
    # 1e-300: the squares (~1e-600) round to 0, their nearest float64; the gradient
    # 2 (x_i - y_j) is representable and right.
    d, ctx = distances.sq_euclidean_forward(x * 1e-300, y * 1e-300)
    np.testing.assert_array_equal(d, np.zeros((4, 5)))
    g = _rows(15, (4, 5))
    expected = distances.sq_euclidean_backward(distances.sq_euclidean_forward(x, y)[1], g).x
    np.testing.assert_allclose(distances.sq_euclidean_backward(ctx, g).x / 1e-300, expected, rtol=1e-12)


# ------------------------------------------------------------ what a backward is handed

_PAIRS = [
    (normalize.l2_normalize_forward, normalize.l2_normalize_backward, "d_y", (np.ones((3, 2)),)),
    (normalize.clip_normalize_forward, normalize.clip_normalize_backward, "d_y", (np.ones((3, 2)),)),
    (distances.euclidean_forward, distances.euclidean_backward, "d_distance", (np.ones((3, 2)), np.ones((4, 2)))),
    (distances.sq_euclidean_forward, distances.sq_euclidean_backward, "d_distance", (np.ones((3, 2)), np.ones((4, 2)))),
    (distances.cosine_forward, distances.cosine_backward, "d_similarity", (np.ones((3, 2)), np.ones((4, 2)))),
]


@pytest.mark.parametrize("forward, backward, upstream, args", _PAIRS, ids=lambda v: getattr(v, "__name__", None))
def test_backward_names_a_foreign_context_and_a_bad_upstream(forward, backward, upstream, args):
    out, ctx = forward(*args)
    foreign = distances.euclidean_forward(np.ones((1, 2)), np.ones((1, 2)))[1]
    if backward is distances.euclidean_backward:
        foreign = normalize.l2_normalize_forward(np.ones((1, 2)))[1]
    with pytest.raises(TypeError, match="ctx must be the .*Context returned by the matching forward"):
        backward(foreign, np.ones(out.shape))
    # A row of the upstream would broadcast; it must not.
    with pytest.raises(ValueError, match=f"{upstream} has shape \\(1, {out.shape[1]}\\), must be"):
        backward(ctx, np.ones((1, out.shape[1])))
    bad = np.ones(out.shape)
    bad[0, 1] = np.nan
    with pytest.raises(ValueError, match=f"{upstream} must be finite, got nan at index \\(0, 1\\)"):
        backward(ctx, bad)
    with pytest.raises(TypeError, match=f"{upstream} must be an array of real numbers"):
        backward(ctx, np.ones(out.shape, dtype=complex))


# ------------------------------------------------------ issue 20: beyond float64 by name


def test_l2_and_cosine_gradients_of_subnormal_rows_are_named():
    # d(x / ||x||)/dx scales as 1 / ||x||: beyond float64 at a row of norm ~1e-310.
    x = _rows(20, (4, 3))
    x[2] *= 1e-310
    y, ctx = normalize.l2_normalize_forward(x)
    assert np.all(np.isfinite(y))
    with pytest.raises(ValueError, match=r"^the gradient with respect to x overflows float64 at "
                                         r"row 2: .* that row's norm is 1\.\d+e-310"):
        normalize.l2_normalize_backward(ctx, np.ones((4, 3)))
    _, ctx = distances.cosine_forward(np.ones((2, 3)), x)
    with pytest.raises(ValueError, match=r"^the gradient with respect to y overflows float64 at row 2"):
        distances.cosine_backward(ctx, np.ones((2, 4)))


def test_sq_euclidean_of_coincident_points_beyond_the_square_range():
    # The squares of 1e300 overflow, the squared distance of coincident points does not: 0
    # exactly (was NaN from inf * 0, with a RuntimeWarning); a square beyond float64 next
    # to it is still the named error.
    d = distances.sq_euclidean(np.array([[1e300, 1.0]]), np.array([[1e300, 1.0]]))
    np.testing.assert_array_equal(d, [[0.0]])
    with pytest.raises(ValueError, match="squared distances overflow float64"):
        distances.sq_euclidean(np.array([[1e300], [0.0]]), np.array([[1e300]]))
