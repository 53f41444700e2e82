"""refdml.train.optim: SGD, Adam, AdamW against scalar loops written from the papers.

The oracle of each update rule is a readable loop over one scalar weight (Python floats,
the equations of Kingma & Ba 2015 Alg. 1, Loshchilov & Hutter 2019, PyTorch's SGD),
run on every entry of the vectorised optimiser's parameter with the same gradient
sequence; float64 agrees to 1e-15. Then closed forms (first Adam step), convergence on a
convex quadratic with a known minimiser, bit-for-bit resume, and the named errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.train import SGD, Adam, AdamW, Parameter

N_ENTRIES = 5
N_STEPS = 8


def _problem(seed: int = 0):
    """Per entry: w0, curvature a, centre c, and a fixed noise table; g = a (w - c) + noise."""
    rng = np.random.default_rng(seed)
    w0 = rng.uniform(0.5, 2.0, N_ENTRIES) * rng.choice([-1, 1], N_ENTRIES)
    a = rng.uniform(0.5, 3.0, N_ENTRIES)
    c = rng.uniform(-1.0, 1.0, N_ENTRIES)
    noise = rng.normal(0.0, 0.3, (N_STEPS, N_ENTRIES))
    return w0, a, c, noise


# --- the oracles: one scalar weight, the papers' equations, no arrays --------------------
def sgd_loop(w, a, c, noise, *, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    v = 0.0
    for t in range(len(noise)):
        g = a * (w - c) + noise[t]
        g = g + weight_decay * w
        v = momentum * v + g
        d = g + momentum * v if nesterov else v
        w = w - lr * d
    return w


def adam_loop(w, a, c, noise, *, lr, betas, eps, weight_decay=0.0, decoupled=False):
    beta1, beta2 = betas
    m = v = 0.0
    for t in range(1, len(noise) + 1):
        g = a * (w - c) + noise[t - 1]
        if decoupled:
            w = w - lr * weight_decay * w  # Loshchilov & Hutter: decay applied to w directly
        else:
            g = g + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        w = w - lr * m_hat / (math.sqrt(v_hat) + eps)
    return w


def _run(optimizer_cls, w0, a, c, noise, dtype=np.float64, n_steps=None, **kwargs):
    param = Parameter(w0.astype(dtype), "w")
    optimizer = optimizer_cls([param], **kwargs)
    a_, c_ = a.astype(dtype), c.astype(dtype)
    for t in range(len(noise) if n_steps is None else n_steps):
        optimizer.zero_grad()
        param.accumulate(a_ * (param.value - c_) + noise[t].astype(dtype))
        optimizer.step()
    return param, optimizer


def _loop_each(loop, w0, a, c, noise, **kwargs):
    return np.array([loop(float(w0[i]), float(a[i]), float(c[i]), [float(x) for x in noise[:, i]],
                          **kwargs) for i in range(len(w0))])


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.5, weight_decay=0.1),
    dict(lr=0.05, momentum=0.9, nesterov=True),
    dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
]


@pytest.mark.parametrize("kwargs", SGD_CASES)
def test_sgd_matches_scalar_loop(kwargs):
    w0, a, c, noise = _problem(1)
    param, _ = _run(SGD, w0, a, c, noise, **kwargs)
    assert_allclose(param.value, _loop_each(sgd_loop, w0, a, c, noise, **kwargs),
                    rtol=1e-15, atol=0)


ADAM_CASES = [
    dict(lr=0.1, betas=(0.9, 0.999), eps=1e-8),
    dict(lr=0.01, betas=(0.0, 0.5), eps=1e-3),
    dict(lr=0.05, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1),
]


@pytest.mark.parametrize("kwargs", ADAM_CASES)
def test_adam_matches_scalar_loop(kwargs):
    w0, a, c, noise = _problem(2)
    param, _ = _run(Adam, w0, a, c, noise, **kwargs)
    assert_allclose(param.value, _loop_each(adam_loop, w0, a, c, noise, **kwargs),
                    rtol=1e-15, atol=0)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01, 0.5])
def test_adamw_matches_scalar_loop(weight_decay):
    w0, a, c, noise = _problem(3)
    kwargs = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    param, _ = _run(AdamW, w0, a, c, noise, **kwargs)
    expected = _loop_each(adam_loop, w0, a, c, noise, decoupled=True, **kwargs)
    assert_allclose(param.value, expected, rtol=1e-15, atol=0)


def test_adamw_differs_from_adam_with_l2():
    # Decoupled decay is not the L2 term: the two trajectories must differ.
    w0, a, c, noise = _problem(3)
    kwargs = dict(lr=0.05, weight_decay=0.5)
    adamw, _ = _run(AdamW, w0, a, c, noise, **kwargs)
    adam, _ = _run(Adam, w0, a, c, noise, **kwargs)
    assert np.max(np.abs(adamw.value - adam.value)) > 1e-3


@given(
    lr=st.floats(1e-4, 1.0),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.0, 0.9999),
    eps=st.floats(1e-10, 1e-1),
    weight_decay=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_adam_and_adamw_match_loop_for_drawn_hyperparameters(lr, beta1, beta2, eps,
                                                              weight_decay, seed):
    # The code evaluates lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps) (PyTorch's order), the loop
    # the paper's m_hat / (sqrt(v_hat) + eps): they differ by an ulp of the step. With the
    # gradient fed back through a (w - c) at lr ~ 1 that ulp grows (1e-13 seen), so here
    # the gradient is the noise table alone (a = 0): the ulps only add up. Adam's coupled
    # L2 term would feed w back into g (amplified up to lr * weight_decay / eps per step
    # when beta2 ~ 0), so the drawn weight decay goes to AdamW only; Adam's L2 term is
    # checked at 1e-15 by the fixed case above.
    w0, a, c, noise = _problem(seed)
    a = np.zeros_like(a)
    for cls, decoupled in ((Adam, False), (AdamW, True)):
        kwargs = dict(lr=lr, betas=(beta1, beta2), eps=eps,
                      weight_decay=weight_decay if decoupled else 0.0)
        param, _ = _run(cls, w0, a, c, noise, **kwargs)
        expected = _loop_each(adam_loop, w0, a, c, noise, decoupled=decoupled, **kwargs)
        # Each step may round w differently by an ulp of the numbers it adds: of |w_t| and
        # of the step |w_t - w_(t-1)| along the way (not of the final |w|: a weight ending
        # near 0 passed through larger values; nor of lr: with beta2 ~ 0, m_hat/sqrt(v_hat)
        # exceeds 1). So N_STEPS ulps (+1 for the division) of the path's largest of both.
        # The fixed cases above, at moderate lr, agree to 1e-15.
        path = np.array([w0] + [_run(cls, w0, a, c, noise, n_steps=t, **kwargs)[0].value
                                for t in range(1, N_STEPS + 1)])
        scale = np.abs(path).max(axis=0) + np.abs(np.diff(path, axis=0)).max(axis=0)
        assert_allclose(param.value / scale, expected / scale, rtol=0,
                        atol=(N_STEPS + 1) * 2.3e-16)


def test_first_adam_step_is_lr_times_sign():
    # Bias correction makes the first step lr * g / (|g| + eps), whatever the betas.
    g = np.array([3.0, -1e-3, 0.5])
    param = Parameter(np.zeros(3), "w")
    optimizer = Adam([param], lr=0.1, betas=(0.7, 0.95), eps=1e-8)
    param.accumulate(g)
    optimizer.step()
    assert_allclose(param.value, -0.1 * g / (np.abs(g) + 1e-8), rtol=1e-15)


def test_plain_sgd_step_is_exact():
    param = Parameter(np.array([1.0, -2.0]), "w")
    SGD([param], lr=0.25).step()  # zero gradient: nothing moves
    assert_array_equal(param.value, [1.0, -2.0])
    optimizer = SGD([param], lr=0.25)
    param.accumulate(np.array([4.0, 8.0]))
    optimizer.step()
    assert_array_equal(param.value, [0.0, -4.0])


@pytest.mark.parametrize("cls,kwargs", [
    (SGD, dict(lr=0.1, momentum=0.9)),
    (Adam, dict(lr=0.05)),
    (AdamW, dict(lr=0.05, weight_decay=0.01)),
])
def test_float32_stays_float32_and_tracks_float64(cls, kwargs):
    w0, a, c, noise = _problem(4)
    p32, o32 = _run(cls, w0, a, c, noise, dtype=np.float32, **kwargs)
    p64, _ = _run(cls, w0, a, c, noise, dtype=np.float64, **kwargs)
    assert p32.value.dtype == np.float32 and p32.grad.dtype == np.float32
    for buffer in o32.state_dict()["params"]["w"].values():
        if isinstance(buffer, np.ndarray):
            assert buffer.dtype == np.float32
    assert_allclose(p32.value, p64.value, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("cls,kwargs,n_steps", [
    (SGD, dict(lr=0.1), 400),
    (SGD, dict(lr=0.05, momentum=0.9, nesterov=True), 400),
    (Adam, dict(lr=0.02), 3000),
    (AdamW, dict(lr=0.02, weight_decay=0.0), 3000),
])
def test_convergence_to_known_minimiser(cls, kwargs, n_steps):
    # f = 1/2 (w - c)^T A (w - c) + (b - 3)^2 over two parameters; minimiser (c, 3).
    A = np.array([[3.0, 1.0, 0.0], [1.0, 2.0, 0.5], [0.0, 0.5, 1.0]])
    c = np.array([1.0, -2.0, 0.5])
    w = Parameter(np.zeros(3), "w")
    b = Parameter(np.array([[4.0]]), "b")  # f_b = (b - 3)^2
    optimizer = cls([w, b], **kwargs)
    for _ in range(n_steps):
        optimizer.zero_grad()
        w.accumulate(A @ (w.value - c))
        b.accumulate(2 * (b.value - 3.0))
        optimizer.step()
    assert_allclose(w.value, c, atol=1e-6)
    assert_allclose(b.value, [[3.0]], atol=1e-6)


def test_sgd_weight_decay_reaches_ridge_minimiser():
    A = np.array([[2.0, 0.5], [0.5, 1.0]])
    c = np.array([1.0, -1.0])
    weight_decay = 0.3
    w = Parameter(np.zeros(2), "w")
    optimizer = SGD([w], lr=0.1, momentum=0.5, weight_decay=weight_decay)
    for _ in range(500):
        optimizer.zero_grad()
        w.accumulate(A @ (w.value - c))
        optimizer.step()
    expected = np.linalg.solve(A + weight_decay * np.eye(2), A @ c)
    assert_allclose(w.value, expected, rtol=1e-10)


def _two_params(dtype):
    rng = np.random.default_rng(7)
    return [Parameter(rng.normal(size=(3, 2)).astype(dtype), "layer.weight"),
            Parameter(rng.normal(size=4).astype(dtype), "layer.bias")]


def _grads(params, step):
    rng = np.random.default_rng(100 + step)
    for p in params:
        p.zero_grad()
        p.accumulate((p.value * 0.5 + rng.normal(size=p.shape)).astype(p.dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls,kwargs", [
    (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (Adam, dict(lr=0.01, weight_decay=0.1)),
    (AdamW, dict(lr=0.01)),
])
def test_resume_is_bit_for_bit(cls, kwargs, dtype):
    straight = _two_params(dtype)
    optimizer = cls(straight, **kwargs)
    for step in range(10):
        _grads(straight, step)
        optimizer.step()

    first = _two_params(dtype)
    optimizer = cls(first, **kwargs)
    for step in range(5):
        _grads(first, step)
        optimizer.step()
    state = optimizer.state_dict()
    saved_values = [p.value.copy() for p in first]
    del optimizer, first

    resumed = [Parameter(v, p.name) for v, p in zip(saved_values, _two_params(dtype))]
    optimizer = cls(resumed, **kwargs)
    optimizer.load_state_dict(state)
    assert optimizer.n_steps == 5
    for step in range(5, 10):
        _grads(resumed, step)
        optimizer.step()
    for a, b in zip(straight, resumed):
        assert_array_equal(a.value, b.value)
        assert a.value.dtype == dtype


def test_state_dict_is_a_host_copy_with_hyperparameters():
    params = _two_params(np.float64)
    optimizer = Adam(params, lr=0.01, betas=(0.8, 0.9))
    _grads(params, 0)
    optimizer.step()
    state = optimizer.state_dict()
    before = state["params"]["layer.bias"]["exp_avg"].copy()
    _grads(params, 1)
    optimizer.step()
    assert_array_equal(state["params"]["layer.bias"]["exp_avg"], before)
    assert state["n_steps"] == 1 and state["optimizer"] == "Adam"
    assert state["hyperparameters"] == {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-8,
                                        "weight_decay": 0.0}
    assert state["params"]["layer.weight"]["shape"] == (3, 2)


def test_load_restores_hyperparameters_and_scheduled_zero_lr():
    params = _two_params(np.float64)
    source = SGD(params, lr=0.5, momentum=0.9)
    source.lr = 0.0  # a schedule's end
    target = SGD(_two_params(np.float64), lr=0.1, momentum=0.3)
    target.load_state_dict(source.state_dict())
    assert (target.lr, target.momentum) == (0.0, 0.9)


def test_nonfinite_gradient_names_parameter_and_updates_nothing():
    params = _two_params(np.float64)
    optimizer = Adam(params, lr=0.1)
    _grads(params, 0)
    optimizer.step()
    values = [p.value.copy() for p in params]
    state = optimizer.state_dict()
    _grads(params, 1)
    params[1].grad[2] = np.inf
    with pytest.raises(ValueError, match=r"gradient of layer\.bias is not finite.*step 2"):
        optimizer.step()
    for p, v in zip(params, values):
        assert_array_equal(p.value, v)
    assert optimizer.n_steps == 1
    assert_array_equal(optimizer.state_dict()["params"]["layer.weight"]["exp_avg"],
                       state["params"]["layer.weight"]["exp_avg"])
    params[0].grad[0, 0] = np.nan
    with pytest.raises(ValueError, match=r"gradient of layer\.weight"):
        optimizer.step()


def test_gradient_of_wrong_dtype_or_shape_is_named():
    params = _two_params(np.float32)
    optimizer = SGD(params, lr=0.1)
    params[0].grad = np.zeros((3, 2))
    with pytest.raises(TypeError, match=r"gradient of layer\.weight has dtype float64"):
        optimizer.step()
    params[0].grad = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"gradient of layer\.weight has shape"):
        optimizer.step()


@pytest.mark.parametrize("cls,kwargs,error,match", [
    (SGD, dict(lr=0.0), ValueError, r"lr == 0\.0, must be in \(0"),
    (SGD, dict(lr=-1.0), ValueError, r"lr == -1\.0"),
    (SGD, dict(lr=float("inf")), ValueError, r"lr == inf, must be finite"),
    (SGD, dict(lr=float("nan")), ValueError, r"lr == nan, must be finite"),
    (SGD, dict(lr="0.1"), TypeError, r"lr must be a real number"),
    (SGD, dict(lr=0.1, momentum=1.0), ValueError, r"momentum == 1\.0, must be in \[0, 1\)"),
    (SGD, dict(lr=0.1, momentum=-0.1), ValueError, r"momentum == -0\.1"),
    (SGD, dict(lr=0.1, weight_decay=-1e-3), ValueError, r"weight_decay == -0\.001"),
    (SGD, dict(lr=0.1, nesterov=True), ValueError, r"nesterov == True needs momentum > 0"),
    (SGD, dict(lr=0.1, momentum=0.5, nesterov=1), TypeError, r"nesterov must be a bool"),
    (Adam, dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] == 1\.0, must be in \[0, 1\)"),
    (Adam, dict(betas=(-0.1, 0.9)), ValueError, r"betas\[0\] == -0\.1"),
    (Adam, dict(betas=0.9), TypeError, r"betas must be a pair"),
    (Adam, dict(eps=0.0), ValueError, r"eps == 0\.0, must be in \(0"),
    (Adam, dict(weight_decay=float("nan")), ValueError, r"weight_decay == nan"),
    (AdamW, dict(lr=0.0), ValueError, r"lr == 0\.0"),
    (AdamW, dict(weight_decay=-0.01), ValueError, r"weight_decay == -0\.01"),
])
def test_bad_hyperparameters_are_named(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(_two_params(np.float64), **kwargs)


def test_hyperparameters_are_keyword_only():
    with pytest.raises(TypeError):
        SGD(_two_params(np.float64), 0.1)  # type: ignore[misc]


def test_bad_parameter_lists_are_named():
    with pytest.raises(ValueError, match="params is empty"):
        Adam([])
    with pytest.raises(TypeError, match=r"params\[1\] must be a Parameter"):
        Adam([Parameter(np.ones(2), "a"), np.ones(2)])
    with pytest.raises(TypeError, match="params must be an iterable"):
        Adam(Parameter(np.ones(2), "a"))
    with pytest.raises(ValueError, match="two parameters named 'a'"):
        Adam([Parameter(np.ones(2), "a"), Parameter(np.ones(3), "a")])
    optimizer = Adam([Parameter(np.ones(2), "a")])
    with pytest.raises(ValueError, match=r"lr == -0\.5"):
        optimizer.lr = -0.5


def test_load_state_dict_rejects_mismatches_and_changes_nothing():
    params = _two_params(np.float64)
    optimizer = Adam(params, lr=0.01)
    _grads(params, 0)
    optimizer.step()
    good = optimizer.state_dict()
    target = Adam(_two_params(np.float64), lr=0.02)

    def broken(edit):
        state = optimizer.state_dict()
        edit(state)
        return state

    cases = [
        (SGD(_two_params(np.float64), lr=0.1).state_dict(), ValueError,
         r"state\['optimizer'\] == 'SGD', this optimiser is 'Adam'"),
        (AdamW(_two_params(np.float64)).state_dict(), ValueError, "'AdamW'"),
        (Adam([Parameter(np.ones(2), "other")]).state_dict(), ValueError,
         r"missing \['layer.bias', 'layer.weight'\], unexpected \['other'\]"),
        (Adam(_two_params(np.float32)).state_dict(), ValueError,
         r"has dtype 'float32', parameter layer.weight has dtype 'float64'"),
        (broken(lambda s: s["params"]["layer.bias"].update(shape=(5,))), ValueError,
         r"has shape \(5,\), parameter layer.bias has shape \(4,\)"),
        (broken(lambda s: s["params"]["layer.bias"].pop("exp_avg_sq")), ValueError,
         "lacks the buffer 'exp_avg_sq'"),
        (broken(lambda s: s["params"]["layer.bias"]["exp_avg"].__setitem__(0, np.nan)),
         ValueError, r"\['exp_avg'\] is not finite"),
        (broken(lambda s: s["hyperparameters"].update(eps=-1.0)), ValueError, r"eps == -1\.0"),
        (broken(lambda s: s["hyperparameters"].pop("eps")), ValueError, "hyperparameters"),
        (broken(lambda s: s.pop("n_steps")), ValueError, r"lacks the keys \['n_steps'\]"),
        (broken(lambda s: s.update(n_steps=-1)), ValueError, r"n_steps'\] == -1"),
        ([1, 2], TypeError, "state must be a dict"),
    ]
    for state, error, match in cases:
        with pytest.raises(error, match=match):
            target.load_state_dict(state)
        assert target.n_steps == 0 and target.lr == 0.02
        assert not np.any(target.state_dict()["params"]["layer.bias"]["exp_avg"])
    target.load_state_dict(good)
    assert target.n_steps == 1 and target.lr == 0.01


def test_momentum_buffer_mismatch_on_load_is_named():
    with_velocity = SGD(_two_params(np.float64), lr=0.1, momentum=0.9).state_dict()
    target = SGD(_two_params(np.float64), lr=0.1)
    with pytest.raises(ValueError, match="keep the buffers"):
        target.load_state_dict(with_velocity)


@pytest.mark.requires_cupy          # tests/conftest.py: skipped, with the reason, without a GPU
def test_cupy_matches_numpy_when_available():
    import cupy

    for cls, kwargs in ((SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
                        (AdamW, dict(lr=0.01))):
        on_cpu, on_gpu = _two_params(np.float64), _two_params(np.float64)
        on_gpu = [Parameter(cupy.asarray(p.value), p.name) for p in on_gpu]
        cpu_opt, gpu_opt = cls(on_cpu, **kwargs), cls(on_gpu, **kwargs)
        for step in range(5):
            _grads(on_cpu, step)
            for p, q in zip(on_gpu, on_cpu):
                p.zero_grad()
                p.accumulate(cupy.asarray(q.grad))
            cpu_opt.step()
            gpu_opt.step()
        for p, q in zip(on_cpu, on_gpu):
            assert_allclose(cupy.asnumpy(q.value), p.value, rtol=1e-14)
        assert isinstance(gpu_opt.state_dict()["params"]["layer.bias"]["velocity" if cls is SGD
                                                                      else "exp_avg"], np.ndarray)
