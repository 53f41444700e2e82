"""The harness itself: it must pass correct backward passes and catch wrong ones."""

import pathlib
import re
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from refdml.gradcheck import (
    GradcheckError,
    assert_gradients,
    check_gradients,
    check_loss,
)
from refdml.gradcheck import strategies as rst

MODES = ["full", "vjp", "directions"]
NAN, INF = float("nan"), float("inf")


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


# --- the harness refuses what it cannot check ---------------------------------------------

_INPUTS = {"x": np.array([0.3, -0.7]), "w": np.array([[0.5, -0.2], [0.1, 0.4]])}


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"n_directions": 0}, ValueError, "n_directions == 0"),
        ({"n_directions": -3}, ValueError, "n_directions == -3"),
        ({"n_directions": 2.5}, TypeError, "n_directions"),
        ({"n_directions": True}, TypeError, "n_directions"),
        ({"step": 0.0}, ValueError, "step == 0.0"),
        ({"step": -1e-6}, ValueError, "step == -1e-06"),
        ({"step": float("nan")}, ValueError, "step == nan"),
        ({"step": float("inf")}, ValueError, "step == inf"),
        ({"mode": "exact"}, ValueError, "mode"),
        ({"wrt": ["z"]}, ValueError, "'z'"),
        ({"wrt": []}, ValueError, "wrt is empty"),
        ({"wrt": ["x", "x"]}, ValueError, "twice"),
        ({"rng": -1}, ValueError, "rng == -1"),
    ],
)
def test_check_gradients_refuses_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        check_gradients(_forward, _backward, _INPUTS, **kwargs)
    with pytest.raises(error, match=match):
        check_loss(lambda x, w: (float(np.sum(x @ w)), {"x": w.sum(1), "w": np.outer(x, [1, 1])}),
                   _INPUTS, **kwargs)


def test_numpy_integer_n_directions_is_accepted():
    result = check_gradients(_forward, _backward, _INPUTS, mode="directions",
                             n_directions=np.int64(3), rng=0)
    assert result["x"].n_forward_calls == 6


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-9, -1.0])
@pytest.mark.parametrize("which", ["rtol", "atol"])
def test_tolerances_must_be_finite_and_non_negative(bad, which):
    result = check_gradients(_forward, _backward, _INPUTS, rng=0)
    tol = {"rtol": 1e-6, "atol": 0.0, which: bad}
    with pytest.raises(ValueError, match=which):
        assert_gradients(result, **tol)
    with pytest.raises(ValueError, match=which):
        result.passed(tol["rtol"], tol["atol"])
    with pytest.raises(ValueError, match=which):
        result["x"].passed(tol["rtol"], tol["atol"])
    with pytest.raises(TypeError, match=which):
        result["x"].passed(**{"rtol": 1e-6, "atol": 0.0, which: "1e-6"})


def test_wrt_must_name_a_floating_point_input():
    def fwd(x, labels):
        return x * labels, (x, labels)

    def bwd(ctx, d):
        return {"x": ctx[1] * d}

    inputs = {"x": np.ones(3), "labels": np.array([1, 2, 3])}
    with pytest.raises(TypeError, match="'labels'.*int64"):
        check_gradients(fwd, bwd, inputs, wrt=["labels"])
    with pytest.raises(ValueError, match="x must be finite"):
        check_gradients(fwd, bwd, {**inputs, "x": np.array([1.0, np.nan, 0.0])})
    with pytest.raises(ValueError, match="x is empty"):
        check_gradients(fwd, bwd, {"x": np.ones(0), "labels": np.ones(0, int)})
    assert_gradients(check_gradients(fwd, bwd, inputs, wrt=("x",), rng=0), rtol=1e-8)
    assert_gradients(check_gradients(fwd, bwd, inputs, wrt=["x"], rng=0), rtol=1e-8)


@pytest.mark.parametrize("wrt", ["x", b"x", 3, {"x"}, iter(["x"])])
def test_wrt_must_be_a_tuple_or_list_of_names(wrt):
    # A bare string used to be read as one name; "xy" would then have been ("xy",) for one
    # call and ("x", "y") for a caller who wrote tuple(wrt): the documented type only.
    def fwd(x):
        return np.sin(x), x

    def bwd(x, d):
        return {"x": np.cos(x) * d}

    with pytest.raises(TypeError, match=r"^wrt must be a tuple or list of input names"):
        check_gradients(fwd, bwd, {"x": np.ones(3)}, wrt=wrt, rng=0)
    with pytest.raises(TypeError, match=r"^wrt must be a tuple or list of input names"):
        check_loss(lambda x: (float(np.sum(x)), {"x": np.ones(3)}), {"x": np.ones(3)}, wrt=wrt)


def test_check_loss_names_the_loss_not_a_forward():
    inputs = {"x": np.array([0.5, 2.0])}
    with pytest.raises(ValueError, match=r"^loss returned a non-finite output 0 \(nan at index "
                                         r"\(\)\) at the check point; .* where the loss is"):
        check_loss(lambda x: (float("nan"), {"x": np.ones(2)}), inputs, rng=0)
    with pytest.raises(TypeError, match=r"^loss must return a pair \(value, grads\), got 3.0"):
        check_loss(lambda x: 3.0, inputs, rng=0)
    with pytest.raises(ValueError, match=r"^loss must return a scalar value, got one of shape "
                                         r"\(2,\)"):
        check_loss(lambda x: (x, {"x": np.ones(2)}), inputs, rng=0)
    with pytest.raises(TypeError, match=r"^loss returned a non-real output 0: 'a'"):
        check_loss(lambda x: ("a", {"x": np.ones(2)}), inputs, rng=0)
    with pytest.raises(GradcheckError, match=r"^loss returned None; it must return the "
                                             r"gradients"):
        check_loss(lambda x: (float(np.sum(x)), None), inputs, rng=0)


def test_forward_must_return_real_outputs_and_a_context():
    inputs = {"x": np.array([0.5, 2.0])}

    def bwd(x, d):
        return {"x": d}

    with pytest.raises(TypeError, match=r"^forward must return a pair \(outputs, ctx\), got "):
        check_gradients(lambda x: x, bwd, inputs, rng=0)
    with pytest.raises(TypeError, match=r"^forward must return a pair \(outputs, ctx\)"):
        check_gradients(lambda x: (x, x, x), bwd, inputs, rng=0)
    with pytest.raises(TypeError, match=r"^forward returned a non-real output 0: array\(\[0.5"):
        check_gradients(lambda x: (x.astype(complex), x), bwd, inputs, rng=0)
    with pytest.raises(TypeError, match=r"^forward returned a non-real output 1"):
        check_gradients(lambda x: ((x, np.array([True])), x), bwd, inputs, rng=0)


@pytest.mark.parametrize("mode", MODES)
def test_missing_gradient_is_named(mode):
    def no_w(ctx, d_a, d_b):
        return {"x": _backward(ctx, d_a, d_b)["x"]}

    @dataclass(frozen=True)
    class Grads:
        x: np.ndarray

    def dataclass_no_w(ctx, d_a, d_b):
        return Grads(_backward(ctx, d_a, d_b)["x"])

    missing = r"no gradient for 'w' \(it returned dict with fields: \['x'\]\)"
    with pytest.raises(GradcheckError, match=missing):
        check_gradients(_forward, no_w, _INPUTS, mode=mode, rng=0)
    with pytest.raises(GradcheckError, match=r"no gradient for 'w' .*fields: \['x'\]"):
        check_gradients(_forward, dataclass_no_w, _INPUTS, mode=mode, rng=0)
    with pytest.raises(GradcheckError, match="backward returned None"):
        check_gradients(_forward, lambda ctx, a, b: None, _INPUTS, mode=mode, rng=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda g: g[:1], r"shape \(1, 2\) for 'w' of shape \(2, 2\)"),
        (lambda g: g.ravel(), r"shape \(4,\) for 'w'"),
        (lambda g: np.where(g == g.flat[0], np.nan, g), "non-finite gradient for 'w'"),
        (lambda g: g + np.inf, "non-finite gradient for 'w'"),
        (lambda g: None, "None as the gradient of 'w'"),
        (lambda g: g.astype(complex), "dtype complex128 for 'w'"),
    ],
)
def test_misshapen_or_non_finite_gradient_is_named(mode, corrupt, match):
    def bad(ctx, d_a, d_b):
        grads = _backward(ctx, d_a, d_b)
        grads["w"] = corrupt(grads["w"])
        return grads

    with pytest.raises(GradcheckError, match=match):
        check_gradients(_forward, bad, _INPUTS, mode=mode, rng=0)


@pytest.mark.parametrize("mode", MODES)
def test_non_finite_forward_is_an_error_not_a_pass(mode):
    def fwd(x):
        return np.log(x), x

    def bwd(x, g):
        return {"x": g / x}

    at_point = r"non-finite output 0 \(nan at index \(1,\)\) at the check point"
    with pytest.raises(ValueError, match=at_point):
        with np.errstate(invalid="ignore"):
            check_gradients(fwd, bwd, {"x": np.array([1.0, -1.0])}, mode=mode, rng=0)
    # Finite at the check point, not at x[0] - h.
    with pytest.raises(ValueError, match=r"non-finite output 0 .* at x\[0\] \+/- h|along a random"):
        with np.errstate(invalid="ignore", divide="ignore"):
            check_gradients(fwd, bwd, {"x": np.array([1e-9, 1.0])}, mode=mode, step=1e-6, rng=0)


# --- the harness catches every wrong backward ----------------------------------------------

WRONG = {"twice": 2.0, "zero": 0.0, "sign": -1.0}


def _scaled_pair(scale):
    """A two-output pair, all outputs multiplied by ``scale``, and a huge output of w alone."""

    def forward(x, w):
        return (scale * np.tanh(x @ w), scale * 0.5 * np.outer(x, x), 1e12 * (1.0 + w**2)), (x, w)

    def backward(ctx, d_a, d_b, d_c, factor=1.0, wrong="x"):
        x, w = ctx
        d_pre = scale * d_a * (1 - np.tanh(x @ w) ** 2)
        grads = {"x": w @ d_pre + scale * 0.5 * (d_b + d_b.T) @ x,
                 "w": np.outer(x, d_pre) + 2e12 * w * d_c}
        grads[wrong] = factor * grads[wrong]
        return grads

    return forward, backward


def _assert_wrong_is_caught(x, w, scale, mode, wrong, rng):
    forward, backward = _scaled_pair(scale)
    inputs = {"x": x, "w": w}
    good = check_gradients(forward, backward, inputs, mode=mode, rng=rng)
    assert_gradients(good, rtol=1e-6)
    for target in ("x", "w"):
        def bad(ctx, *d, target=target):
            return backward(ctx, *d, factor=WRONG[wrong], wrong=target)

        result = check_gradients(forward, bad, inputs, mode=mode, rng=rng)
        assert not result[target].passed(1e-6), (target, result.summary())
        # Not even a loose tolerance lets it through.
        assert not result[target].passed(0.1), (target, result.summary())
        with pytest.raises(GradcheckError, match=target):
            assert_gradients(result, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES + ["auto"])
@pytest.mark.parametrize("wrong", sorted(WRONG))
@pytest.mark.parametrize("scale", [1.0, 1e-150, 1e150])
@pytest.mark.parametrize("seed", [0, 1])
def test_wrong_gradient_is_caught_on_fixed_seeds(mode, wrong, scale, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(4)
    x /= np.linalg.norm(x)
    w = rng.uniform(-1, 1, (4, 3))
    _assert_wrong_is_caught(x, w, scale, mode, wrong, seed)


@settings(max_examples=10)
@given(
    x=rst.points_on_sphere(1, 4),
    w=hnp.arrays(np.float64, (4, 3), elements=st.floats(-1, 1, width=64)),
    scale=st.sampled_from([1.0, 1e-150, 1e150]),
    mode=st.sampled_from(MODES + ["auto"]),
    wrong=st.sampled_from(sorted(WRONG)),
    seed=st.integers(0, 2**32 - 1),
)
def test_wrong_gradient_is_caught_on_drawn_inputs(x, w, scale, mode, wrong, seed):
    _assert_wrong_is_caught(x[0], w, scale, mode, wrong, seed)


def test_a_huge_output_of_another_input_hides_nothing():
    # The old floor, 100 eps sum|g f| / h over every output, was ~4e3 here: it passed a
    # backward that returned 0 for x. Outputs the step leaves unchanged now excuse nothing.
    forward, backward = _scaled_pair(1.0)
    inputs = {"x": np.array([0.6, -0.8, 0.0, 0.0]), "w": np.full((4, 3), 0.5)}
    result = check_gradients(forward, lambda c, *d: backward(c, *d, factor=0.0), inputs,
                             mode="vjp", rng=0)
    assert result["x"].noise_floor < 1e-6 and result["x"].scale > 0.1
    assert not result["x"].passed(1e-6)
    assert result["w"].passed(1e-6)
    # On w the 1e12 output does move: its rounding is the floor, and it is reported.
    assert result["w"].noise_floor > 1e-3


def test_the_noise_floor_excuses_rounding_but_not_a_wrong_gradient():
    # f(x) = 1e3 cos(x) near 0: the true gradient (~1e-6) is of the order of the rounding
    # error of the central difference of 1e3, which only the noise floor explains.
    def fwd(x):
        return np.cos(x) * 1e3, x

    def bwd(x, g):
        return {"x": -np.sin(x) * 1e3 * g}

    def bad(x, g):
        return {"x": -np.sin(x) * 1e3 * g + 1e-3}

    inputs = {"x": np.array([1e-9, 2e-9, -3e-9])}
    result = check_gradients(fwd, bwd, inputs, mode="vjp", rng=0)
    check = result["x"]
    assert check.max_abs_error > 1e-6 * check.scale  # rtol alone would fail it ...
    assert check.max_abs_error <= check.noise_floor  # ... the rounding error explains it
    assert_gradients(result, rtol=1e-6)
    assert not check_gradients(fwd, bad, inputs, mode="vjp", rng=0).passed(1e-6)
    assert not check_gradients(fwd, bad, inputs, mode="full", rng=0).passed(1e-6)


# --- strategies validate their arguments ---------------------------------------------------


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: rst.points_in_unit_ball(0, 3), ValueError, "n == 0"),
        (lambda: rst.points_in_unit_ball(3, -1), ValueError, "d == -1"),
        (lambda: rst.points_in_unit_ball(2.0, 3), TypeError, "n must be an integer"),
        (lambda: rst.points_in_unit_ball(2, 3, min_radius=-0.1), ValueError, "min_radius"),
        (lambda: rst.points_in_unit_ball(2, 3, max_radius=NAN), ValueError, "max_radius == nan"),
        (lambda: rst.points_in_unit_ball(2, 3, max_radius=1.5), ValueError, "max_radius == 1.5"),
        (lambda: rst.points_in_unit_ball(2, 3, min_radius=0.8, max_radius=0.5), ValueError,
         "min_radius == 0.8"),
        (lambda: rst.points_on_sphere(2, 0), ValueError, "d == 0"),
        (lambda: rst.points_on_sphere(2, 3, radius=0.0), ValueError, "radius == 0.0"),
        (lambda: rst.points_on_sphere(2, 3, radius=-1.0), ValueError, "radius == -1.0"),
        (lambda: rst.points_on_sphere(2, 3, radius=float("inf")), ValueError, "radius == inf"),
        (lambda: rst.points_on_sphere(2, 3, radius=float("nan")), ValueError, "radius == nan"),
        (lambda: rst.simplex_vectors(0), ValueError, "n == 0"),
        (lambda: rst.simplex_vectors(3, batch=0), ValueError, "batch == 0"),
        (lambda: rst.simplex_vectors(3, min_entry=0.0), ValueError, "min_entry == 0.0"),
        (lambda: rst.simplex_vectors(3, min_entry=float("nan")), ValueError, "min_entry == nan"),
        (lambda: rst.spd_matrices(0), ValueError, "d == 0"),
        (lambda: rst.spd_matrices(3, max_condition=0.5), ValueError, "max_condition == 0.5"),
        (lambda: rst.spd_matrices(3, max_condition=INF), ValueError, "max_condition == inf"),
        (lambda: rst.spd_matrices(3, max_condition=NAN), ValueError, "max_condition == nan"),
        (lambda: rst.labels(0, 2), ValueError, "n_classes == 0"),
        (lambda: rst.labels(3, 0), ValueError, "samples_per_class == 0"),
        (lambda: rst.labels(3, -2), ValueError, "samples_per_class == -2"),
        (lambda: rst.labels(3, (0, 2)), ValueError, r"samples_per_class\[0\] == 0"),
        (lambda: rst.labels(3, (3, 2)), ValueError, "low exceeds high"),
        (lambda: rst.labels(3, (1, 2, 3)), ValueError, "samples_per_class"),
        (lambda: rst.labels(3, 2.0), TypeError, "samples_per_class"),
    ],
)
def test_strategies_refuse_bad_arguments(build, error, match):
    with pytest.raises(error, match=match):
        build()


@settings(max_examples=5)
@given(
    rst.points_in_unit_ball(np.int64(3), np.int32(2)),
    rst.spd_matrices(np.int64(2), max_condition=np.float64(10.0)),
    rst.labels(np.int64(2), (np.int64(1), np.int64(2))),
    rst.simplex_vectors(np.int64(3), batch=np.int64(2)),
)
def test_strategies_accept_numpy_integers(points, spd, labels, simplex):
    assert points.shape == (3, 2) and spd.shape == (2, 2) and simplex.shape == (2, 3)
    assert set(np.unique(labels)) == {0, 1}


# --- the guide's own-operator example runs as written ---------------------------------------


def _guide_example() -> str:
    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "gradcheck.md"
    text = page.read_text(encoding="utf-8")
    section = text.split("## Writing and checking your own operator", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the guide's section should hold exactly one python block"
    return blocks[0]


def test_guide_example_runs_and_its_backward_validates(capsys):
    namespace: dict = {"__name__": "guide_example"}
    exec(compile(_guide_example(), "docs/gradcheck.md", "exec"), namespace)
    assert "max rel err" in capsys.readouterr().out
    forward, backward = namespace["dense_tanh_forward"], namespace["dense_tanh_backward"]
    out, ctx = forward(np.ones((2, 3)), np.ones((3, 4)))
    with pytest.raises(TypeError, match="ctx"):
        backward(object(), np.ones(out.shape))
    with pytest.raises(ValueError, match="d_out"):
        backward(ctx, np.ones((4, 2)))
    with pytest.raises(ValueError, match="d_out"):
        backward(ctx, np.full(out.shape, np.nan))
    # A wrong backward in the same example is caught.
    def wrong(ctx, d_out):
        grads = backward(ctx, d_out)
        return {"x": grads.x, "w": -grads.w}

    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((3, 4)), "w": rng.standard_normal((4, 2))}
    with pytest.raises(GradcheckError, match="w"):
        assert_gradients(check_gradients(forward, wrong, inputs, rng=1), rtol=1e-6)


def test_a_forward_flat_along_the_step_excuses_only_rounding():
    # The constraints pin the outputs (as GSP's (P2) with m = n = 1): no output moves, the
    # difference is exactly 0, and the backward's own rounding (1e-18) must pass; a gradient
    # above what the difference resolves must not.
    def fwd(x):
        return np.array([0.95, 0.05]) + 0.0 * x[0], x

    def rounding(x, g):
        return {"x": np.full(x.shape, 2e-18)}

    def wrong(x, g):
        return {"x": np.full(x.shape, 1e-3)}

    inputs = {"x": np.zeros(1)}
    for mode in MODES:
        result = check_gradients(fwd, rounding, inputs, mode=mode, rng=0)
        assert result["x"].max_abs_error > 0 and result["x"].noise_floor < 1e-8
        assert_gradients(result, rtol=1e-6)
        assert not check_gradients(fwd, wrong, inputs, mode=mode, rng=0).passed(1e-6)
