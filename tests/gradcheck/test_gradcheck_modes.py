"""Fast mode, localisation, dtype-aware defaults, kinks and non-deterministic backwards."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml.gradcheck import (
    GradcheckError,
    InputCheck,
    NonDifferentiablePoint,
    assert_gradients,
    check_gradients,
    check_loss,
    default_tolerances,
)
from refdml.gradcheck import strategies as rst
from refdml.train.layers import conv2d_backward, conv2d_forward, relu_backward, relu_forward

DRAWN = settings(max_examples=10, deadline=None, derandomize=True)


class Counting:
    """A forward that counts its calls."""

    def __init__(self, forward):
        self.forward, self.calls = forward, 0

    def __call__(self, **inputs):
        self.calls += 1
        return self.forward(**inputs)


def _sin(x):
    return np.sin(x), x


def _sin_backward(x, g):
    return {"x": np.cos(x) * g}


def _pair(x, w):
    return (np.tanh(x @ w), np.outer(x, x) * 0.5), (x, w)


def _pair_backward(ctx, d_a, d_b):
    x, w = ctx
    d_pre = d_a * (1 - np.tanh(x @ w) ** 2)
    return {"x": w @ d_pre + 0.5 * (d_b + d_b.T) @ x, "w": np.outer(x, d_pre)}


# --- fast mode and localisation ------------------------------------------------------------


def test_fast_mode_costs_two_forward_calls_per_input_whatever_its_size():
    for n in (10, 100_000):
        forward = Counting(_sin)
        x = np.random.default_rng(0).uniform(-1, 1, n)
        result = check_gradients(forward, _sin_backward, {"x": x}, mode="fast", rng=0)
        assert_gradients(result)
        assert result["x"].mode == "fast" and result["x"].n_forward_calls == 2
        assert forward.calls == 3  # the check point and one pair


@pytest.mark.parametrize("mode", ["fast", "directions"])
def test_a_sparse_bug_in_a_large_input_is_localised_by_bisection(mode):
    wrong = (12, 345)

    def backward(x, g):
        grad = np.cos(x) * g
        grad[wrong] += 5.0
        return {"x": grad}

    forward = Counting(_sin)
    x = np.random.default_rng(0).uniform(-1, 1, (100, 1000))
    result = check_gradients(forward, backward, {"x": x}, mode=mode, rng=0)
    check = result["x"]
    assert not check.passed() and check.localization == "bisection"
    assert check.worst_index == wrong
    # The values there: the backward's (read back from it) and the true derivative,
    # cos(x) times the upstream gradient, to the accuracy of a central difference.
    np.testing.assert_allclose(check.numerical_value, check.backward_value - 5.0, rtol=1e-6)
    assert check.backward_value - check.numerical_value > check.tolerance
    # A pair per half, two halves per level, log2(1e5) ~ 17 levels, plus the screen and
    # the kink probe: O(log n), where an element-by-element check would take 2e5.
    levels = math.ceil(math.log2(x.size))
    screen = 2 if mode == "fast" else 16
    assert forward.calls - 1 == check.n_forward_calls <= screen + 4 * levels + 4
    assert "x[12, 345]: backward 5.4" in result.summary()
    with pytest.raises(GradcheckError, match=r"x\[12, 345\]: backward .* > tolerance"):
        assert_gradients(result)


def test_a_dense_bug_is_caught_by_fast_mode_with_constant_calls():
    def backward(x, g):
        return {"x": -np.cos(x) * g}

    for n in (1000, 100_000):
        forward = Counting(_sin)
        x = np.random.default_rng(1).uniform(-1, 1, n)
        result = check_gradients(forward, backward, {"x": x}, mode="fast", rng=0,
                                 localize=False)
        assert result.status() == "failed" and forward.calls == 3
        assert result["x"].worst_index is None
        assert "along a random direction" in result.summary()
        # Localised, it still fails, at an element.
        localised = check_gradients(Counting(_sin), backward, {"x": x}, mode="fast", rng=0)
        assert localised.status() == "failed" and localised["x"].worst_index is not None


def test_a_failing_fast_check_of_a_small_input_is_localised_element_by_element():
    def backward(ctx, d_a, d_b):
        grads = _pair_backward(ctx, d_a, d_b)
        grads["w"][2, 1] *= 3.0
        return grads

    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal(4), "w": rng.standard_normal((4, 3))}
    result = check_gradients(_pair, backward, inputs, mode="fast", rng=1)
    assert result["x"].passed() and result["x"].localization is None
    check = result["w"]
    assert check.status() == "failed" and check.localization == "vjp"
    # The screen, a pair per element of w, and one kink probe (two pairs) of the failing one.
    assert check.worst_index == (2, 1) and check.n_forward_calls == 2 + 2 * 12 + 4
    assert check.kinks == ()


@DRAWN
@given(
    x=rst.points_on_sphere(1, 4),
    w=hnp.arrays(np.float64, (4, 3), elements=st.floats(-1, 1, width=64)),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_correct_backward_passes_fast_mode_on_drawn_inputs(x, w, seed):
    result = check_gradients(_pair, _pair_backward, {"x": x[0], "w": w}, mode="fast", rng=seed)
    assert_gradients(result)
    assert all(c.n_forward_calls == 2 for c in result.checks)


@DRAWN
@given(
    x=rst.points_on_sphere(1, 4),
    w=hnp.arrays(np.float64, (4, 3), elements=st.floats(-1, 1, width=64)),
    seed=st.integers(0, 2**32 - 1),
    factor=st.sampled_from([-1.0, 0.0, 2.0]),
)
def test_a_dense_bug_is_caught_by_fast_mode_on_drawn_inputs(x, w, seed, factor):
    def backward(ctx, d_a, d_b):
        grads = _pair_backward(ctx, d_a, d_b)
        grads["x"] = factor * grads["x"]
        return grads

    result = check_gradients(_pair, backward, {"x": x[0], "w": w}, mode="fast", rng=seed)
    assert result["x"].status() == "failed", result.summary()
    assert result["w"].passed(), result.summary()


@pytest.mark.parametrize("mode, where", [("vjp", "x[3, 1]: "),
                                         ("full", "x[3, 1] (output 0[3, 1]): ")])
def test_the_worst_element_is_named_with_both_values_and_the_tolerance(mode, where):
    # f(x) = x^2 / 2: the Jacobian is diag(x), derived by hand; the backward is wrong at
    # (3, 1) only, where it returns 0.41 for a derivative of 0.13 (full mode: unit upstream).
    x = np.linspace(-0.5, 0.6, 8).reshape(4, 2)
    x[3, 1] = 0.13

    def backward(x, g):
        grad = x * g
        grad[3, 1] = (x[3, 1] + 0.28) * g[3, 1]
        return {"x": grad}

    result = check_gradients(lambda x: (0.5 * x * x, x), backward, {"x": x}, mode=mode, rng=0)
    check = result["x"]
    assert check.worst_index == (3, 1)
    if mode == "full":
        assert check.worst_output == (0, 3, 1)
        np.testing.assert_allclose(check.backward_value, 0.41, rtol=1e-12)
        np.testing.assert_allclose(check.numerical_value, 0.13, rtol=1e-9)
    else:
        assert check.worst_output is None
        ratio = check.backward_value / check.numerical_value
        np.testing.assert_allclose(ratio, 0.41 / 0.13, rtol=1e-8)
    rtol, atol = default_tolerances("float64")
    np.testing.assert_allclose(check.tolerance,
                               max(atol, check.worst_noise) + rtol * check.scale, rtol=1e-15)
    line = (f"{where}backward {check.backward_value:.3g}, finite differences "
            f"{check.numerical_value:.3g}, error "
            f"{abs(check.backward_value - check.numerical_value):.3g} > tolerance "
            f"{check.tolerance:.2g}")
    assert line in result.summary()
    if mode == "full":
        assert "x[3, 1] (output 0[3, 1]): backward 0.41, finite differences 0.13, error 0.28" \
            in line
    with pytest.raises(GradcheckError) as caught:
        assert_gradients(result)
    assert line in str(caught.value) and "[[" not in str(caught.value)  # no Jacobian dump


def test_input_check_built_the_old_way_still_works():
    check = InputCheck("x", (2,), "vjp", 1e-9, 1e-9, 1.0, 1e-5, 4)
    assert check.passed(1e-8) and not check.passed(1e-10)
    assert check.worst_index is None and check.kinks == () and check.dtype == "float64"
    assert check.passed() == (1e-9 <= default_tolerances("float64")[0])


# --- dtypes ---------------------------------------------------------------------------------


def _tanh(x):
    y = np.tanh(x)
    return y, y


def _tanh_backward(y, g):
    return {"x": (1 - y * y) * g}


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    return p, p


def _softmax_backward(p, g):
    return {"x": p * (g - (g * p).sum(axis=-1, keepdims=True))}


def _matmul_norm(x, w):
    y = x @ w
    n = np.sqrt((y * y).sum(axis=-1, keepdims=True))
    return y / n, (x, w, y / n, n)


def _matmul_norm_backward(ctx, g):
    x, w, u, n = ctx
    d_y = (g - u * (g * u).sum(axis=-1, keepdims=True)) / n
    return {"x": d_y @ w.T, "w": x.T @ d_y}


def _dtype_cases(dtype, x, w):
    """The three smooth operators at ``dtype``; each forward asserts that it runs there."""

    def at(dtype, forward):
        def checked(**inputs):
            assert all(v.dtype == dtype for v in inputs.values())
            return forward(**inputs)

        return checked

    x, w = x.astype(dtype), w.astype(dtype)
    return [
        (at(dtype, _tanh), _tanh_backward, {"x": x}),
        (at(dtype, _softmax), _softmax_backward, {"x": x}),
        (at(dtype, _matmul_norm), _matmul_norm_backward, {"x": x, "w": w}),
    ]


def _near_identity(u):
    # |u| <= 1 entrywise, so ||0.15 u||_2 <= 0.45 and every singular value of w is in
    # [0.55, 1.45]: |x w| >= 0.55 |x|, and the norm's curvature is on the scale of the
    # input, which the default step assumes.
    return np.eye(3) + 0.15 * u


def _well_conditioned(rng):
    # Rows of x in the unit ball away from 0.
    x = rng.uniform(-1, 1, (3, 3))
    x /= np.linalg.norm(x, axis=1, keepdims=True) / rng.uniform(0.6, 1.0, (3, 1))
    return x, _near_identity(rng.uniform(-1, 1, (3, 3)))


def test_default_tolerances_follow_eps_to_the_two_thirds():
    tolerances = {d: default_tolerances(d) for d in ("float16", "float32", "float64")}
    assert all(atol == 0.0 for _, atol in tolerances.values())
    for dtype, (rtol, _) in tolerances.items():
        np.testing.assert_allclose(rtol, 5 * float(np.finfo(dtype).eps) ** (2 / 3), rtol=1e-12)
    # Coarse enough for the central difference, fine enough to catch 10% (float16) and
    # 1% (float32) errors.
    assert tolerances["float16"][0] < 0.1 and tolerances["float32"][0] < 0.01
    assert default_tolerances(np.float32) == default_tolerances(np.dtype("float32"))


@pytest.mark.parametrize("bad", [None, "int64", np.int32, "float128", "complex128", "x", 3])
def test_default_tolerances_refuse_other_dtypes(bad):
    if bad == "float128" and not hasattr(np, "float128"):
        pytest.skip("no float128 here")
    with pytest.raises(TypeError, match="dtype must be float16, float32 or float64"):
        default_tolerances(bad)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_inputs_keep_their_dtype_and_the_step_follows_it(dtype):
    seen = {}

    def forward(x):
        seen["x"] = x.dtype
        return np.sin(x), x

    def backward(x, g):
        seen["g"] = g.dtype
        return {"x": np.cos(x) * g}

    x = np.array([0.5, -2.0, 1.5], dtype=dtype)
    result = check_gradients(forward, backward, {"x": x}, mode="vjp", rng=0)
    assert seen == {"x": np.dtype(dtype), "g": np.dtype(dtype)}
    assert result.dtype == result["x"].dtype == np.dtype(dtype).name
    np.testing.assert_allclose(result["x"].step, np.cbrt(float(np.finfo(dtype).eps)) * 2.0,
                               rtol=1e-12)
    assert_gradients(result)


def test_the_coarsest_dtype_sets_the_result_dtype():
    def forward(x, w):
        return (x.astype(np.float64) * w).astype(np.float32), (x, w)

    def backward(ctx, g):
        x, w = ctx
        return {"x": g * w, "w": g * x}

    inputs = {"x": np.array([0.3, -0.6]), "w": np.array([1.5, 0.25], dtype=np.float16)}
    result = check_gradients(forward, backward, inputs, rng=0)
    assert result.dtype == "float16"
    assert (result["x"].dtype, result["w"].dtype) == ("float32", "float16")
    assert_gradients(result)


def test_the_step_taken_is_measured_from_the_rounded_points():
    # f(x) = 3 x, evaluated in float64 from a float16 x: its derivative is 3 exactly. At
    # x = 1.1 (float16) the points x +/- h round, so (x+h) - (x-h) is not 2h; dividing by
    # 2h would be off by ~1e-3, dividing by the step taken is exact.
    def forward(x):
        return 3.0 * x.astype(np.float64), x

    def backward(x, g):
        return {"x": 3.0 * g}

    x = np.array([1.1, -0.7, 0.3], dtype=np.float16)
    h = np.cbrt(np.finfo(np.float16).eps) * 1.1
    assert (np.float16(1.1 + h) - np.float16(1.1 - h)) != np.float64(2 * h)
    for mode in ("full", "vjp", "directions"):
        result = check_gradients(forward, backward, {"x": x}, mode=mode, rng=0)
        assert result["x"].max_rel_error < 1e-12, result.summary()


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smooth_operators_pass_with_the_defaults_in_low_precision(dtype, seed):
    rng = np.random.default_rng(seed)
    for forward, backward, inputs in _dtype_cases(dtype, *_well_conditioned(rng)):
        for mode in ("auto", "vjp"):
            result = check_gradients(forward, backward, inputs, mode=mode, rng=seed)
            assert result.dtype == np.dtype(dtype).name
            assert_gradients(result)


@DRAWN
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32]))
def test_smooth_operators_pass_with_the_defaults_on_drawn_inputs(data, dtype):
    seed = data.draw(st.integers(0, 2**32 - 1))
    x = data.draw(rst.points_in_unit_ball(3, 3, min_radius=0.6, max_radius=1.0))
    w = _near_identity(data.draw(hnp.arrays(np.float64, (3, 3),
                                            elements=st.floats(-1, 1, width=64))))
    for forward, backward, inputs in _dtype_cases(dtype, x, w):
        assert_gradients(check_gradients(forward, backward, inputs, rng=seed))


@pytest.mark.parametrize("dtype, factor, operators", [
    (np.float32, 1.01, (0, 1, 2)),
    (np.float16, 1.1, (0, 2)),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_gradient_wrong_by_a_few_percent_fails_in_low_precision(dtype, factor, operators,
                                                                   seed):
    rng = np.random.default_rng(seed)
    cases = _dtype_cases(dtype, *_well_conditioned(rng))
    for k in operators:
        forward, backward, inputs = cases[k]

        def wrong(ctx, g, backward=backward):
            return {name: factor * grad for name, grad in backward(ctx, g).items()}

        result = check_gradients(forward, wrong, inputs, rng=seed)
        assert result.status() == "failed", result.summary()
        with pytest.raises(GradcheckError, match="failed"):
            assert_gradients(result)


# --- kinks ----------------------------------------------------------------------------------


def _relu(x):
    return np.maximum(x, 0.0), x


def _relu_backward(x, g):
    return {"x": g * (x > 0)}


@pytest.mark.parametrize("mode", ["full", "vjp", "fast"])
def test_relu_at_zero_is_a_kink_at_its_index(mode):
    x = np.array([[0.5, -0.3, 0.7], [0.2, -0.8, 0.0]])
    result = check_gradients(_relu, _relu_backward, {"x": x}, mode=mode, rng=0)
    check = result["x"]
    assert check.status() == "kink" and not check.passed() and result.status() == "kink"
    assert [k.index for k in check.kinks] == [(1, 2)]
    kink = check.kinks[0]
    assert kink.left == 0.0 and kink.right != 0.0
    if mode == "full":  # one-sided derivatives of relu itself: 0 and 1
        np.testing.assert_allclose(kink.right, 1.0, rtol=1e-12)
        assert ("input x[1, 2] sits on a kink: one-sided derivatives 0 and 1 (ReLU, max, |.|)"
                in result.summary())
    with pytest.raises(NonDifferentiablePoint, match=r"input x\[1, 2\] sits on a kink"):
        assert_gradients(result)
    # Off the kink, the same pair passes.
    x[1, 2] = 0.1
    assert_gradients(check_gradients(_relu, _relu_backward, {"x": x}, mode=mode, rng=0))


def test_max_with_a_tie_is_a_kink_at_both_tied_elements():
    def forward(x):
        return np.max(x), x

    def backward(x, g):
        grad = np.zeros_like(x)
        grad[np.argmax(x)] = g
        return {"x": grad}

    x = np.array([0.1, 0.9, -0.4, 0.9, 0.3])
    result = check_gradients(forward, backward, {"x": x}, rng=0)
    assert result.status() == "kink"
    assert sorted(k.index for k in result["x"].kinks) == [(1,), (3,)]
    for kink in result["x"].kinks:
        np.testing.assert_allclose([kink.left, kink.right], [0.0, 1.0], atol=1e-9)


def test_abs_at_zero_is_a_kink():
    def forward(x):
        return np.abs(x), x

    def backward(x, g):
        # sign(0) = 0 would be the mean of the one-sided derivatives and agree with the
        # central difference; this backward picks +1 there.
        return {"x": np.where(x >= 0, 1.0, -1.0) * g}

    x = np.array([-0.4, 0.0, 0.8, 0.25])
    result = check_gradients(forward, backward, {"x": x}, mode="full", rng=0)
    (kink,) = result["x"].kinks
    assert kink.index == (1,)
    np.testing.assert_allclose([kink.left, kink.right], [-1.0, 1.0], rtol=1e-12)
    assert "one-sided derivatives -1 and 1" in result.summary()


@pytest.mark.parametrize("mode", ["full", "vjp"])
def test_a_wrong_gradient_beside_a_kink_is_still_a_failure(mode):
    def backward(x, g):
        grad = _relu_backward(x, g)["x"]
        grad[0, 2] *= 2.0
        return {"x": grad}

    x = np.array([[0.5, -0.3, 0.7], [0.2, -0.8, 0.0]])
    result = check_gradients(_relu, backward, {"x": x}, mode=mode, rng=0)
    check = result["x"]
    assert check.status() == "failed" and [k.index for k in check.kinks] == [(1, 2)]
    assert check.worst_index == (0, 2)
    with pytest.raises(GradcheckError) as caught:
        assert_gradients(result)
    assert type(caught.value) is GradcheckError and "x[0, 2]" in str(caught.value)


def test_a_kink_in_a_large_input_is_found_by_bisection():
    rng = np.random.default_rng(0)
    x = rng.uniform(0.1, 1.0, (50, 100)) * rng.choice([-1.0, 1.0], (50, 100))
    x[31, 7] = 0.0
    result = check_gradients(_relu, _relu_backward, {"x": x}, mode="fast", rng=0)
    check = result["x"]
    assert check.status() == "kink" and check.localization == "bisection"
    assert [k.index for k in check.kinks] == [(31, 7)]
    assert check.n_forward_calls <= 2 + 4 * math.ceil(math.log2(x.size)) + 6

    def wrong(x, g):  # and a wrong element elsewhere: not excused by the kink
        grad = _relu_backward(x, g)["x"]
        grad[2, 3] += 3.0
        return {"x": grad}

    assert check_gradients(_relu, wrong, {"x": x}, mode="fast", rng=0).status() == "failed"


def test_a_gradient_outside_the_one_sided_derivatives_at_a_kink_is_a_failure():
    # relu's one-sided derivatives at 0 are 0 and 1: a backward of 5 there is wrong on
    # either side, whatever the kink.
    def backward(x, g):
        return {"x": g * np.where(x == 0, 5.0, x > 0)}

    x = np.array([0.5, -0.3, 0.0])
    result = check_gradients(_relu, backward, {"x": x}, mode="full", rng=0)
    assert result.status() == "failed" and result["x"].kinks == ()
    assert result["x"].worst_index == (2,)


def test_a_smooth_wrong_gradient_is_not_called_a_kink():
    x = np.linspace(-1, 1, 6)
    result = check_gradients(_sin, lambda x, g: {"x": 1.1 * np.cos(x) * g}, {"x": x}, rng=0)
    assert result.status() == "failed" and result["x"].kinks == ()


def _conv_relu(x, weight, bias):
    pre, conv_ctx = conv2d_forward(x, weight, bias, padding=1)
    y, relu_ctx = relu_forward(pre)
    return y, (conv_ctx, relu_ctx)


def _conv_relu_backward(ctx, d_y):
    conv_ctx, relu_ctx = ctx
    grads = conv2d_backward(conv_ctx, relu_backward(relu_ctx, d_y).x, input_grad=False)
    return {"weight": grads.weight, "bias": grads.bias}


def test_a_conv_relu_model_with_zero_biases_sits_on_kinks_not_on_a_bug():
    # An image with a black left half, as digits-collage's: every pre-activation whose patch
    # lies in it equals the bias, 0 at initialisation, ReLU's kink. Moving a bias moves
    # them all across it; moving a weight does not (their patch is zero).
    rng = np.random.default_rng(0)
    x = np.zeros((1, 1, 4, 4))
    x[0, 0, :, 2:] = rng.uniform(0.5, 1.0, (4, 2))
    inputs = {"x": x, "weight": rng.standard_normal((2, 1, 3, 3)), "bias": np.zeros(2)}
    result = check_gradients(_conv_relu, _conv_relu_backward, inputs, wrt=["weight", "bias"],
                             rng=0)
    assert result["weight"].passed()
    assert result["bias"].status() == "kink" and result.status() == "kink"
    assert sorted(k.index for k in result["bias"].kinks) == [(0,), (1,)]
    with pytest.raises(NonDifferentiablePoint, match=r"input bias\[0\] sits on a kink"):
        assert_gradients(result)
    # Off the kink (biases 0.1, larger than the step) the model's pair passes.
    inputs["bias"] = np.full(2, 0.1)
    assert_gradients(check_gradients(_conv_relu, _conv_relu_backward, inputs,
                                     wrt=["weight", "bias"], rng=0))


# --- non-deterministic backwards ------------------------------------------------------------


def test_nondet_tol_bounds_two_calls_of_the_backward():
    noise = np.random.default_rng(0)
    calls = []

    def jittery(x, g):
        calls.append(1)
        return {"x": np.cos(x) * g + 1e-9 * noise.standard_normal(x.shape)}

    x = np.linspace(-1, 1, 5)
    with pytest.raises(GradcheckError, match=r"^backward is not deterministic for x\[\d\]: two "
                                             r"calls with the same upstream gradient gave .* "
                                             r"and .* > nondet_tol 1e-12\)"):
        check_gradients(_sin, jittery, {"x": x}, mode="vjp", rng=0, nondet_tol=1e-12)
    calls.clear()
    result = check_gradients(_sin, jittery, {"x": x}, mode="vjp", rng=0, nondet_tol=1e-7)
    assert len(calls) == 2
    assert_gradients(result, rtol=1e-6)
    calls.clear()
    check_gradients(_sin, jittery, {"x": x}, mode="vjp", rng=0)
    assert len(calls) == 1  # None: the backward is called once


def test_a_deterministic_backward_passes_nondet_tol_zero_in_every_mode():
    for mode in ("full", "vjp", "directions", "fast"):
        result = check_gradients(_sin, _sin_backward, {"x": np.linspace(-1, 1, 5)}, mode=mode,
                                 rng=0, nondet_tol=0.0)
        assert_gradients(result)


# --- arguments ------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    ({"nondet_tol": -1.0}, ValueError, "nondet_tol == -1.0"),
    ({"nondet_tol": float("nan")}, ValueError, "nondet_tol == nan"),
    ({"nondet_tol": "0"}, TypeError, "nondet_tol"),
    ({"localize": 1}, TypeError, "localize must be True or False, got 1"),
    ({"localize": "no"}, TypeError, "localize"),
    ({"rtol": -1e-6}, ValueError, "rtol == -1e-06"),
    ({"atol": float("inf")}, ValueError, "atol == inf"),
    ({"rtol": "1e-6"}, TypeError, "rtol"),
    ({"mode": "quick"}, ValueError, "mode == 'quick'"),
])
def test_new_arguments_are_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_gradients(_sin, _sin_backward, {"x": np.ones(3)}, **kwargs)


def test_check_loss_has_fast_mode_and_default_tolerances():
    def loss(x):
        return float(np.sum(np.sin(x))), {"x": np.cos(x)}

    def wrong(x):
        grad = np.cos(x)
        grad[3] += 1.0
        return float(np.sum(np.sin(x))), {"x": grad}

    x = np.linspace(-1, 1, 8)
    assert_gradients(check_loss(loss, {"x": x}, mode="fast", rng=0))
    result = check_loss(wrong, {"x": x}, mode="fast", rng=0)
    assert result["x"].worst_index == (3,) and result["x"].localization == "vjp"
    with pytest.raises(TypeError, match="localize"):
        check_loss(loss, {"x": x}, localize=None)
