"""The harness itself: it must pass correct backward passes and catch wrong ones."""

import numpy as np
import pytest
from hypothesis import given

from refdml.gradcheck import (
    GradcheckError,
    assert_gradients,
    check_gradients,
    check_loss,
)
from refdml.gradcheck import strategies as rst


def _forward(x, w):
    # Two outputs: a vector and a matrix, so multi-output handling is exercised.
    return (np.tanh(x @ w), np.outer(x, x) * 0.5), (x, w)


def _backward(ctx, d_a, d_b):
    x, w = ctx
    pre = x @ w
    d_pre = d_a * (1 - np.tanh(pre) ** 2)
    return {"x": w @ d_pre + 0.5 * (d_b + d_b.T) @ x, "w": np.outer(x, d_pre)}


def _wrong_backward(ctx, d_a, d_b):
    grads = _backward(ctx, d_a, d_b)
    grads["w"] = grads["w"] * 1.001  # a 0.1% error must be caught
    return grads


@pytest.mark.parametrize("mode", ["full", "vjp", "directions"])
def test_correct_backward_passes_in_every_mode(mode):
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(4), "w": rng.standard_normal((4, 3))}
    result = check_gradients(_forward, _backward, inputs, mode=mode, rng=1)
    assert {c.mode for c in result.checks} == {mode}
    assert_gradients(result, rtol=1e-7)


@pytest.mark.parametrize("mode", ["full", "vjp", "directions"])
def test_wrong_backward_is_caught_in_every_mode(mode):
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(4), "w": rng.standard_normal((4, 3))}
    result = check_gradients(_forward, _wrong_backward, inputs, mode=mode, rng=1)
    assert result["x"].passed(1e-7)
    assert not result["w"].passed(1e-6)
    with pytest.raises(GradcheckError, match="w"):
        assert_gradients(result, rtol=1e-6)


def test_auto_mode_picks_by_size():
    small = {"x": np.ones(3), "w": np.ones((3, 2))}
    assert check_gradients(_forward, _backward, small, rng=0).checks[0].mode == "full"

    def fwd(x):
        return x**3, x

    def bwd(x, g):
        return {"x": 3 * x**2 * g}

    big = {"x": np.linspace(-1, 1, 2500)}
    assert check_gradients(fwd, bwd, big, rng=0).checks[0].mode == "directions"
    mid = {"x": np.linspace(-1, 1, 1500)}
    assert check_gradients(fwd, bwd, mid, rng=0).checks[0].mode == "vjp"


def test_check_loss_convention_and_wrong_gradient():
    def loss(x, labels):
        return float(np.sum(np.sin(x) * labels)), {"x": np.cos(x) * labels}

    def bad_loss(x, labels):
        return float(np.sum(np.sin(x) * labels)), {"x": np.cos(x)}

    inputs = {"x": np.linspace(0.1, 1.0, 6), "labels": np.array([1, 2, 1, 0, 3, 1])}
    assert_gradients(check_loss(loss, inputs, rng=0), rtol=1e-8)
    assert not check_loss(bad_loss, inputs, rng=0).passed(1e-3)


def test_result_reports_step_and_scale():
    inputs = {"x": np.array([10.0, -20.0]), "w": np.ones((2, 2))}
    result = check_gradients(_forward, _backward, inputs, mode="vjp", rng=0)
    np.testing.assert_allclose(result["x"].step, np.cbrt(np.finfo(float).eps) * 20.0)
    assert result["x"].scale > 0
    assert "max rel err" in result.summary()


def test_bad_arguments():
    inputs = {"x": np.ones(2), "w": np.ones((2, 2))}
    with pytest.raises(ValueError, match="mode"):
        check_gradients(_forward, _backward, inputs, mode="exact")
    with pytest.raises(ValueError, match="'z'"):
        check_gradients(_forward, _backward, inputs, wrt=["z"])


@given(rst.points_in_unit_ball(5, 3, min_radius=0.1, max_radius=0.9))
def test_unit_ball_strategy(points):
    norms = np.linalg.norm(points, axis=1)
    assert points.shape == (5, 3) and points.dtype == np.float64
    assert np.all(norms >= 0.1 - 1e-12) and np.all(norms <= 0.9 + 1e-12)


@given(rst.points_on_sphere(4, 3, radius=2.0))
def test_sphere_strategy(points):
    np.testing.assert_allclose(np.linalg.norm(points, axis=1), 2.0, rtol=1e-12)


@given(rst.simplex_vectors(6, batch=3))
def test_simplex_strategy(p):
    assert p.shape == (3, 6)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-12)
    assert np.all(p > 0)


@given(rst.spd_matrices(4, max_condition=100.0))
def test_spd_strategy(a):
    np.testing.assert_allclose(a, a.T, atol=0)
    eig = np.linalg.eigvalsh(a)
    assert eig.min() > 0
    assert eig.max() / eig.min() <= 100.0 * (1 + 1e-8)


@given(rst.labels(3, (2, 4)))
def test_label_strategy(labels):
    values, counts = np.unique(labels, return_counts=True)
    np.testing.assert_array_equal(values, [0, 1, 2])
    assert np.all((counts >= 2) & (counts <= 4))


def test_zero_gradient_passes_through_noise_floor_but_wrong_gradient_does_not():
    # f(x) = cos(x) at x = 0: the true gradient is 0 and finite differences give noise.
    def fwd(x):
        return np.cos(x) * 1e3, x

    def bwd(x, g):
        return {"x": -np.sin(x) * 1e3 * g}

    def bad(x, g):
        return {"x": -np.sin(x) * 1e3 * g + 1e-3}

    inputs = {"x": np.zeros(3)}
    result = check_gradients(fwd, bwd, inputs, mode="vjp", rng=0)
    assert result["x"].noise_floor > 0 and result["x"].scale < result["x"].noise_floor
    assert_gradients(result, rtol=1e-6)
    assert not check_gradients(fwd, bad, inputs, mode="vjp", rng=0).passed(1e-6)
