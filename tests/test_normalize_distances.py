import numpy as np
import pytest
from hypothesis import given, assume

from refdml import distances, normalize
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


def test_l2_normalize_zero_vector_is_an_error():
    with pytest.raises(ValueError, match="zero vector at index \\(1,\\)"):
        normalize.l2_normalize(np.array([[1.0, 0.0], [0.0, 0.0]]))


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
    monkeypatch.setattr(distances, "_CHUNK_BYTES", 64)  # refine in many small chunks
    monkeypatch.setattr(distances, "_REFINE", 10.0)  # ... and refine every pair
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
