"""Bad and extreme input to refdml.train (issue 20): named errors, never raw ones or NaN.

Optimiser steps are all or nothing (a step that would make a value or a buffer non-finite
raises NonFiniteStepError and changes nothing); then one test per cause found by the fuzz:
validation of the token table's clip, ASAP's problem instance, the messages that named
the wrong parameter, the public im2col helpers, Parameter.accumulate, integers beyond
int64, and the objectives' and samplers' state.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml._validation import as_label_array, check_float_dtype, check_scalar
from refdml.train import (
    GSPHead,
    SGD,
    Adam,
    AdamW,
    Conv2d,
    Embedding,
    Linear,
    LocalLinear,
    Parameter,
    Sequential,
    XMLHistogramHead,
)
from refdml.train.data import (
    PKBatchSampler,
    class_disjoint_split,
    clip_token_table,
    init_token_table,
    load_features,
    make_token_splits,
    make_tokens,
)
from refdml.train.layers import col2im, conv2d_forward, conv_output_size, im2col
from refdml.train.objectives import (
    ASAPObjective,
    GSPObjective,
    LossObjective,
    WassersteinObjective,
    XMLObjective,
)
from refdml.train.optim import NonFiniteStepError


# --------------------------------------------------------------------------- optimisers
def _snapshot(optimizer):
    state = optimizer.state_dict()
    return [p.value.copy() for p in optimizer.params], state


def _assert_unchanged(optimizer, snapshot):
    # Exact by construction: a refused step writes nothing, so every array is the very
    # bit pattern it was.
    values, state = snapshot
    for param, value in zip(optimizer.params, values):
        assert_array_equal(param.value, value)
    after = optimizer.state_dict()
    assert after["n_steps"] == state["n_steps"]
    for name, entry in state["params"].items():
        for key, array in entry.items():
            if isinstance(array, np.ndarray):
                assert_array_equal(after["params"][name][key], array)


@pytest.mark.parametrize("cls,kwargs,overflowing", [
    (SGD, dict(lr=1e300), "new value"),
    (SGD, dict(lr=0.1, momentum=0.5, weight_decay=1e300), "velocity buffer"),
    (Adam, dict(lr=1e300), "exp_avg_sq buffer"),
    (AdamW, dict(lr=1e300, weight_decay=0.0), "exp_avg_sq buffer"),
])
def test_a_step_that_would_overflow_raises_and_changes_nothing(cls, kwargs, overflowing):
    """The issue's case: g = w (the gradient of |w|^2 / 2) and a huge lr or weight_decay
    give finite parameters after one step and inf after the second; that second step is
    refused, naming the optimiser, the step and the parameter, and leaves everything as the
    first step left it."""
    params = [Parameter(np.array([1.0, -2.0, 0.5]), "embed.weight")]
    optimizer = cls(params, **kwargs)
    with pytest.raises(NonFiniteStepError) as caught:
        for _ in range(3):
            snapshot = _snapshot(optimizer)
            optimizer.zero_grad()
            params[0].accumulate(params[0].value.copy())
            optimizer.step()
    message = str(caught.value)
    assert f"{cls.__name__} step {snapshot[1]['n_steps'] + 1}" in message
    assert "embed.weight" in message and overflowing in message
    assert snapshot[1]["n_steps"] >= 1  # the first step went through
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, FloatingPointError)
    _assert_unchanged(optimizer, snapshot)
    assert np.all(np.isfinite(params[0].value))


@pytest.mark.parametrize("cls,kwargs", [
    (SGD, dict(lr=0.1, momentum=0.9)), (Adam, dict(lr=0.1)), (AdamW, dict(lr=0.1)),
])
def test_no_half_applied_update_when_a_later_parameter_overflows(cls, kwargs):
    params = [Parameter(np.array([1.0, 2.0]), "a"), Parameter(np.array([1.0, 2.0]), "b")]
    optimizer = cls(params, **kwargs)
    params[0].grad[...] = 1.0
    params[1].grad[...] = 1.0
    optimizer.step()
    params[0].grad[...] = 1.0            # a fine update ...
    params[1].grad[...] = [1.0, 1e200]   # ... and one whose square (Adam) or step overflows
    if cls is SGD:
        params[1].grad[...] = [1.0, 1.7e308]
        params[1].value[...] = [1.0, -1.7e308]
    snapshot = _snapshot(optimizer)
    with pytest.raises(NonFiniteStepError, match=r"would make b not finite"):
        optimizer.step()
    _assert_unchanged(optimizer, snapshot)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["sgd", "adam", "adamw"]),
    log_lr=st.floats(-3, 300),
    log_grad=st.floats(-3, 300),
    n_steps=st.integers(1, 4),
)
def test_a_step_either_succeeds_finite_or_raises_and_changes_nothing(kind, log_lr, log_grad,
                                                                    n_steps):
    lr = 10.0**log_lr
    build = {"sgd": lambda p: SGD(p, lr=lr, momentum=0.9),
             "adam": lambda p: Adam(p, lr=lr),
             "adamw": lambda p: AdamW(p, lr=lr, weight_decay=min(1e-2, 1.0 / lr))}[kind]
    params = [Parameter(np.array([0.3, -1.0]), "w"), Parameter(np.array([2.0]), "b")]
    optimizer = build(params)
    for _ in range(n_steps):
        snapshot = _snapshot(optimizer)
        for p in params:
            p.zero_grad()
            p.accumulate(10.0**log_grad * np.sign(p.value + 0.5))
        try:
            optimizer.step()
        except NonFiniteStepError:
            _assert_unchanged(optimizer, snapshot)
            return
        for p in params:
            assert np.all(np.isfinite(p.value))
        for entry in optimizer.state_dict()["params"].values():
            for array in entry.values():
                if isinstance(array, np.ndarray):
                    assert np.all(np.isfinite(array))


def test_adamw_bounds_lr_times_weight_decay_also_when_a_schedule_sets_lr():
    params = [Parameter(np.ones(2), "w")]
    with pytest.raises(ValueError, match=r"lr \* weight_decay == 1e\+297 .*must be <= 1"):
        AdamW(params, lr=1e-3, weight_decay=1e300)
    optimizer = AdamW(params, lr=1e-3, weight_decay=100.0)
    with pytest.raises(ValueError, match=r"lr \* weight_decay == 2"):
        optimizer.lr = 0.02
    assert optimizer.lr == 1e-3
    optimizer.lr = 0.01  # the factor 1 - lr * weight_decay reaches 0: allowed
    # Adam's coupled L2 term has no such bound (Adam normalises it).
    Adam(params, lr=1e-3, weight_decay=1e300)


def test_step_names_a_gradient_that_is_not_an_array():
    params = [Parameter(np.ones(2), "w")]
    optimizer = SGD(params, lr=0.1)
    params[0].grad = None
    with pytest.raises(TypeError, match=r"gradient of w must be a ndarray like its value"):
        optimizer.step()
    params[0].grad = [1.0, 1.0]
    with pytest.raises(TypeError, match=r"gradient of w"):
        optimizer.step()


def test_reset_state_names_params():
    params = [Parameter(np.ones(2), "w")]
    optimizer = Adam(params)
    with pytest.raises(TypeError, match=r"params\[0\] must be a Parameter, got 'x'"):
        optimizer.reset_state("x")
    with pytest.raises(ValueError, match=r"params\[0\] \(v\) is not a parameter of this"):
        optimizer.reset_state([Parameter(np.ones(2), "v")])


# --------------------------------------------------------------------------- Parameter
@pytest.mark.parametrize("grad,error,match", [
    (None, TypeError, r"gradient for w must be a ndarray"),
    ([[1.0, 1.0]], TypeError, r"gradient for w must be a ndarray"),
    (np.ones((1, 2), dtype=complex), TypeError, r"gradient for w must be real, got dtype complex"),
    (np.ones((1, 2), dtype=bool), TypeError, r"gradient for w must be real, got dtype bool"),
    (np.array([[object(), object()]]), TypeError, r"must be real, got dtype object"),
    (np.ones(2), ValueError, r"gradient for w has shape \(2,\), must be \(1, 2\)"),
])
def test_parameter_accumulate_names_bad_gradients(grad, error, match):
    parameter = Parameter(np.zeros((1, 2)), "w")
    with pytest.raises(error, match=match):
        parameter.accumulate(grad)
    assert_array_equal(parameter.grad, np.zeros((1, 2)))


def test_add_parameter_names_a_bad_key():
    layer = Linear(2, 2, rng=0)
    with pytest.raises(TypeError, match=r"key must be a non-empty str, got None"):
        layer.add_parameter(None, np.ones(2))
    objective = LossObjective("proxy_nca", n_classes=2, dim=2, rng=0)
    with pytest.raises(ValueError, match=r"already has a parameter named 'proxies'"):
        objective.add_parameter("proxies", np.ones(2))


# --------------------------------------------------------------------------- data
@pytest.mark.parametrize("table,error,match", [
    (np.array([[0.1, np.nan]]), ValueError, r"table must be finite, got nan at index \(0, 1\)"),
    (np.array([[0.1, np.inf]]), ValueError, r"table must be finite, got inf"),
    (np.array([[1, 2]]), TypeError, r"table must be float32 or float64 .*int64"),
    (np.array([[True, False]]), TypeError, r"table must be float32 or float64 .*bool"),
    (np.array([[1 + 1j, 0]]), TypeError, r"table must be float32 or float64 .*complex"),
    (np.array([[0.1, None]], dtype=object), TypeError, r"table must be float32 .*object"),
    ([[0.1, 0.5]], TypeError, r"table must be the token table, a NumPy or CuPy array"),
    (None, TypeError, r"table must be the token table"),
    ("abc", TypeError, r"table must be the token table"),
    (np.ones(3), ValueError, r"table must have 2 dimensions"),
    (np.ones((0, 3)), ValueError, r"table must not be empty"),
])
def test_clip_token_table_refuses_what_it_cannot_clip_in_place(table, error, match):
    with pytest.raises(error, match=match):
        clip_token_table(table)


def test_clip_token_table_clips_float32_in_place_and_refuses_read_only():
    table = np.array([[0.5, -0.1], [-1e30, 0.2]], dtype=np.float32)
    out = clip_token_table(table)
    assert out is table and table.dtype == np.float32
    assert_array_equal(table, np.array([[0.3, -0.1], [-0.3, 0.2]], dtype=np.float32))
    table.flags.writeable = False
    with pytest.raises(ValueError, match="table is read-only"):
        clip_token_table(table)


def test_make_token_splits_names_its_own_parameters():
    for name in ("n_train_per_class", "n_val_per_class", "n_test_per_class"):
        with pytest.raises(ValueError, match=rf"^{name} == 0, must be in \[1"):
            make_token_splits(rng=0, **{name: 0})
    with pytest.raises(TypeError, match=r"keyword 'n_per_class'.*study's keywords"):
        make_token_splits(rng=0, n_per_class=3)
    with pytest.raises(TypeError, match=r"keyword 'colour'"):
        make_token_splits(rng=0, colour=3)


def test_counts_beyond_int64_are_named_not_overflow():
    with pytest.raises(ValueError, match=r"n_per_class == 10{30}, must fit in int64"):
        make_tokens(10**30, rng=0)
    with pytest.raises(ValueError, match=r"n_tokens == 10{30}, must fit in int64"):
        init_token_table(10**30, 3, rng=0)
    with pytest.raises(ValueError, match=r"d_in == 10{30}, must be at most"):
        Linear(10**30, 2)
    with pytest.raises(ValueError, match=r"n_classes == 10{30}, must be at most"):
        LossObjective("proxy_nca", n_classes=10**30, dim=2)
    assert check_scalar(2**63 - 1, "n", integer=True) == 2**63 - 1
    with pytest.raises(ValueError, match=r"n == -9223372036854775809, must fit in int64"):
        check_scalar(-(2**63) - 1, "n", integer=True)


def test_integral_float_labels_beyond_int64_are_refused():
    with pytest.raises(TypeError, match=r"labels must hold integer labels, got dtype float64"):
        as_label_array(np.array([1e300, 1e300, 0.0]), "labels")
    assert_array_equal(as_label_array(np.array([3.0, -2.0]), "labels"), [3, -2])
    with pytest.raises(TypeError, match=r"labels must hold integer labels"):
        class_disjoint_split(np.repeat([0.0, 1.0, 2e300], 2), rng=0)


@pytest.mark.parametrize("fractions,error,match", [
    ((1, 1, "x"), TypeError, r"fractions\[2\] must be a real number"),
    ((True, 1, 1), TypeError, r"fractions\[0\] must be a real number"),
    ((1, 0, 1), ValueError, r"fractions\[1\] == 0.0, must be in \(0"),
    ((1, 1, np.nan), ValueError, r"fractions\[2\] == nan, must be finite"),
])
def test_class_disjoint_split_names_the_bad_fraction(fractions, error, match):
    with pytest.raises(error, match=match):
        class_disjoint_split(np.repeat(np.arange(6), 2), rng=0, fractions=fractions)


def test_sampler_refuses_a_position_beyond_its_epoch():
    labels = np.repeat(np.arange(4), 4)
    sampler = PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=2, rng=0)
    first = next(iter(sampler))
    state = sampler.state_dict()
    with pytest.raises(ValueError, match=r"state\['position'\] == 1000, but epoch 0 of this "
                                         r"sampler has 4 batches"):
        sampler.load_state_dict({**state, "position": 1000})
    # Nothing was changed by the refused load.
    sampler.load_state_dict({**state, "position": 0})
    assert_array_equal(next(iter(sampler)), first)


@pytest.mark.parametrize("dtype", ["bogus", None, np.int32, "float16", 3])
def test_dtype_is_named_everywhere(dtype):
    match = r"dtype must be float32 or float64"
    builders = [
        lambda: Linear(2, 2, dtype=dtype), lambda: Embedding(3, 2, dtype=dtype),
        lambda: Conv2d(1, 2, dtype=dtype), lambda: LocalLinear(2, 2, dtype=dtype),
        lambda: GSPHead(2, 2, mu=0.5, inverse_temperature=1.0, dtype=dtype),
        lambda: XMLHistogramHead(2, 2, inverse_temperature=1.0, dtype=dtype),
        lambda: LossObjective("proxy_nca", n_classes=2, dim=2, dtype=dtype),
        lambda: GSPObjective("contrastive", n_classes=2, attribute_dim=2, dtype=dtype),
        lambda: init_token_table(3, 2, rng=0, dtype=dtype),
        lambda: load_features("no-such-file.npz", dtype=dtype),
    ]
    for build in builders:
        with pytest.raises(TypeError, match=match):
            build()
    assert check_float_dtype("float32") == np.float32


def test_sequential_names_layers():
    for layers in (None, 3, "relu", Linear(2, 2, rng=0)):
        with pytest.raises(TypeError, match=r"layers must be a sequence of Layer objects"):
            Sequential(layers)


# --------------------------------------------------------------------------- conv helpers
def test_public_im2col_helpers_validate_their_arguments():
    x = np.random.default_rng(0).standard_normal((1, 2, 4, 4))
    with pytest.raises(ValueError, match=r"stride == 0, must be >= 1"):
        im2col(x, 3, stride=0)
    with pytest.raises(TypeError, match=r"kernel_size must be an int"):
        im2col(x, None)
    with pytest.raises(ValueError, match=r"x must have 4 dimensions"):
        im2col(x[0], 3)
    with pytest.raises(ValueError, match=r"x must be finite"):
        im2col(np.full_like(x, np.nan), 3)
    with pytest.raises(TypeError, match=r"x must be an array of real numbers"):
        im2col(None, 3)
    with pytest.raises(TypeError, match=r"padding must be an int"):
        conv_output_size(4, 3, 1, 0.5)
    with pytest.raises(ValueError, match=r"size == 0, must be >= 1"):
        conv_output_size(0, 3, 1, 0)
    cols = im2col(x, 3, padding=1)
    with pytest.raises(ValueError, match=r"cols has shape \(15, 18\), im2col gives \(16, 18\)"):
        col2im(cols[:-1], x.shape, 3, padding=1)
    with pytest.raises(TypeError, match=r"x_shape must be a tuple \(B, C, H, W\)"):
        col2im(cols, None, 3, padding=1)
    with pytest.raises(ValueError, match=r"x_shape\[3\] == -4, must be >= 1"):
        col2im(cols, (1, 2, 4, -4), 3, padding=1)
    # Valid calls are unchanged: the pair is still each other's adjoint.
    c = np.random.default_rng(1).standard_normal(cols.shape)
    assert_allclose(np.sum(cols * c), np.sum(x * col2im(c, x.shape, 3, padding=1)), rtol=1e-12)
    y, _ = conv2d_forward(x, np.ones((1, 2, 3, 3)), np.zeros(1), stride=1, padding=1)
    assert y.shape == (1, 1, 4, 4)


# --------------------------------------------------------------------------- objectives
_RNG = np.random.default_rng(3)
POOL = _RNG.standard_normal((12, 4))
POOL_LABELS = np.repeat(np.arange(3), 4)


def _asap(**kwargs):
    return ASAPObjective("proxy_nca", n_classes=3, dim=4, proxies_per_class=2, budget=3,
                         lambda_=0.1, rng=0, **kwargs)


@pytest.mark.parametrize("embeddings,error,match", [
    (POOL.astype(complex), TypeError, r"embeddings must be an array of real numbers, got dtype "
                                      r"complex128"),
    (POOL > 0, TypeError, r"embeddings must be an array of real numbers, got dtype bool"),
    (POOL.astype(object), TypeError, r"embeddings .*dtype object"),
    (POOL.astype(str), TypeError, r"embeddings .*dtype <U"),
    (None, TypeError, r"embeddings must be an array of real numbers, got None"),
    (np.where(POOL > 1, np.nan, POOL), ValueError, r"embeddings must be finite"),
    (POOL[:, :3], ValueError, r"embeddings has shape \(12, 3\), its rows must have the "
                              r"proxies' dimension 4"),
    (POOL[0], ValueError, r"embeddings must have 2 dimensions"),
])
def test_new_problem_instance_refuses_non_real_embeddings_without_casting(embeddings, error,
                                                                         match):
    objective = _asap()
    proxies = objective.proxies.value.copy()
    with pytest.raises(error, match=match):
        objective.new_problem_instance(embeddings, POOL_LABELS, rng=0)
    assert_array_equal(objective.proxies.value, proxies)
    with pytest.raises(error, match=match):
        objective.covering_radius(embeddings, POOL_LABELS)


def test_new_problem_instance_accepts_float32_and_integer_embeddings():
    a, b = _asap(), _asap()
    a.new_problem_instance(POOL.astype(np.float32), POOL_LABELS, rng=0)
    b.new_problem_instance(POOL.astype(np.float32).astype(np.float64), POOL_LABELS, rng=0)
    assert_allclose(a.proxies.value, b.proxies.value, rtol=0, atol=0)
    _asap().new_problem_instance(np.rint(POOL * 10).astype(np.int64), POOL_LABELS, rng=0)
    with pytest.raises(ValueError, match=r"labels has length 11, but 12"):
        _asap().new_problem_instance(POOL, POOL_LABELS[:-1], rng=0)


@pytest.mark.parametrize("scale", [1e-150, 1.0, 1e150, 1e300])
def test_covering_radius_at_any_scale(scale):
    objective = _asap()
    radius = objective.covering_radius(POOL * scale, POOL_LABELS)
    # Independent oracle: per sample, the distance to each own-class unit proxy, computed
    # coordinate by coordinate with math.hypot (which never overflows).
    p = objective.proxies.value / np.linalg.norm(objective.proxies.value, axis=1, keepdims=True)
    labels = np.asarray(objective.proxy_labels)
    expected = max(
        min(math.hypot(*(POOL[i] * scale - q)) for q in p[labels == POOL_LABELS[i]])
        for i in range(POOL.shape[0]))
    assert math.isfinite(radius)
    assert_allclose(radius, expected, rtol=1e-12)


def test_asap_model_parameters_and_theta_star_are_checked():
    with pytest.raises(TypeError, match=r"model_parameters must be an iterable of Parameter"):
        _asap(model_parameters=None)
    with pytest.raises(TypeError, match=r"model_parameters must be an iterable of Parameter"):
        _asap(model_parameters=Parameter(np.ones(2), "w"))
    objective = _asap(model_parameters=[Parameter(np.ones(2), "w")])
    with pytest.raises(TypeError, match=r"state\['theta_star'\] must be a list of arrays"):
        objective.load_state_dict({"theta_star": None})
    with pytest.raises(TypeError, match=r"theta\* for w must be an array of real numbers"):
        objective.load_state_dict({"theta_star": [np.array(["a", "b"])]})
    with pytest.raises(ValueError, match=r"theta\* for w must be finite"):
        objective.load_state_dict({"theta_star": [np.array([1.0, np.nan])]})
    objective.load_state_dict({"theta_star": [np.array([3, 4])]})
    assert_allclose(objective.state_dict()["theta_star"][0], [3.0, 4.0], rtol=0)


def test_objectives_without_state_refuse_a_non_empty_state():
    for objective in (LossObjective("contrastive"), WassersteinObjective(margin=1.0, eps=0.5)):
        objective.load_state_dict({})
        with pytest.raises(ValueError, match=r"must be empty .*got the keys \['rng'\]"):
            objective.load_state_dict({"rng": None})


@pytest.mark.parametrize("build,error,match", [
    (lambda: GSPObjective("bogus", n_classes=2, attribute_dim=2), ValueError,
     r"^base == 'bogus', must be one of"),
    (lambda: XMLObjective("bogus", lambda_=0.5, ridge=0.1), ValueError,
     r"^base == 'bogus', must be one of"),
    (lambda: XMLObjective(3, lambda_=0.5, ridge=0.1), TypeError, r"^base must be"),
    (lambda: XMLObjective(np.int32, lambda_=0.5, ridge=0.1), TypeError, r"^base must be"),
    (lambda: XMLObjective("contrastive", lambda_=0.5, ridge=0.1, base_kwargs={"colour": 1}),
     TypeError, r"'colour' is not a hyperparameter of contrastive"),
    (lambda: LossObjective("bogus"), ValueError, r"^loss == 'bogus', must be one of"),
    (lambda: WassersteinObjective(margin=1.0, eps=0.5, value="bogus"), ValueError,
     r"^value == 'bogus'"),
    (lambda: WassersteinObjective(margin=1.0, eps=0.5, max_iter=0), ValueError,
     r"^max_iter == 0"),
    (lambda: WassersteinObjective(margin=1.0, eps=0.5, tol=-1.0), ValueError, r"^tol == -1.0"),
    (lambda: WassersteinObjective(margin=1.0, eps=0.5, eps_scaling=2.0), ValueError,
     r"^eps_scaling == 2.0"),
])
def test_objective_arguments_are_named(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_gsp_objective_blames_the_outputs_for_a_z_of_the_wrong_length():
    y = _RNG.standard_normal((4, 3))
    z = np.abs(_RNG.standard_normal((4, 2)))
    labels = np.array([0, 0, 1, 1])
    objective = GSPObjective("contrastive", n_classes=2, attribute_dim=2, rng=0)
    with pytest.raises(ValueError, match=r"outputs \(y, z\) must have one row per sample each, "
                                         r"got y of shape \(4, 3\) and z of shape \(3, 2\)"):
        objective.forward((y, z[:3]), labels)
    for bad in ((y, None), (None, z), (y.tolist(), z)):
        with pytest.raises(TypeError, match=r"outputs' [yz] must be a NumPy or CuPy array"):
            objective.forward(bad, labels)
    with pytest.raises(TypeError, match=r"outputs' z must be a NumPy or CuPy array"):
        LossObjective("contrastive").forward((y, None), labels)
    value, _ = objective.forward((y, z), labels)
    assert math.isfinite(value)
