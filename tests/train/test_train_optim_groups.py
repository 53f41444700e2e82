"""refdml.train.optim: parameter groups (a learning-rate multiplier per group) and freezing.

The papers' protocol (GSP supp., ASAP): Adam with moments (0.9, 0.99), weight decay 1e-4,
the proxies at 100 times the network's learning rate, and a warm-up that trains some
parameters only. The expected values are a scalar loop per entry written here from the
papers' equations (Kingma & Ba 2015 Alg. 1 with PyTorch's coupled L2 term; Loshchilov &
Hutter 2019; PyTorch's SGD), with the effective learning rate ``lr * multiplier``, and the
first step of a fresh Adam written out by hand (``m_hat = g``, ``v_hat = g**2``).
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from refdml.train import SGD, Adam, AdamW, Parameter

LR = 1e-3
BETAS = (0.9, 0.99)
EPS = 1e-8
WD = 1e-4

# Two small parameters and three steps of fixed gradients (no model: the optimiser alone).
NET0 = [0.5, -1.0, 2.0]
PROXY0 = [0.3, -0.2]
NET_GRADS = [[0.2, -0.05, 1.5], [0.1, 0.3, -0.7], [-0.4, 0.02, 0.9]]
PROXY_GRADS = [[-0.6, 0.25], [0.05, -0.3], [0.8, 0.1]]


# --- the oracles: one scalar weight at a time, Python floats --------------------------------
def adam_scalar(w, grads, *, lr, betas, eps, weight_decay, decoupled=False):
    beta1, beta2 = betas
    m = v = 0.0
    for t, g in enumerate(grads, start=1):
        if decoupled:
            w = w - lr * weight_decay * w
        else:
            g = g + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        w = w - lr * m_hat / (math.sqrt(v_hat) + eps)
    return w


def sgd_scalar(w, grads, *, lr, momentum, weight_decay):
    v = 0.0
    for g in grads:
        g = g + weight_decay * w
        v = momentum * v + g
        w = w - lr * v
    return w


def expected(oracle, start, grads, **kwargs):
    """The oracle on every entry, each with its own column of the gradient table."""
    return np.array([oracle(start[i], [step[i] for step in grads], **kwargs)
                     for i in range(len(start))])


# --- helpers -----------------------------------------------------------------------------
def two_groups(dtype=np.float64, multiplier=100.0):
    net = Parameter(np.array(NET0, dtype), "net.weight")
    proxy = Parameter(np.array(PROXY0, dtype), "loss.proxies")
    groups = [{"params": [net], "name": "model"},
              {"params": [proxy], "lr_multiplier": multiplier, "name": "proxies"}]
    return net, proxy, groups


def set_grads(pairs):
    for param, grad in pairs:
        param.zero_grad()
        param.accumulate(np.asarray(grad, dtype=param.dtype))


# --- one and two steps against the scalar loops --------------------------------------------
@pytest.mark.parametrize("n_steps", [1, 2])
def test_adam_two_groups_matches_hand_arithmetic(n_steps):
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    for step in range(n_steps):
        set_grads([(net, NET_GRADS[step]), (proxy, PROXY_GRADS[step])])
        optimizer.step()
    settings = dict(betas=BETAS, eps=EPS, weight_decay=WD)
    assert_allclose(net.value, expected(adam_scalar, NET0, NET_GRADS[:n_steps], lr=LR,
                                        **settings), rtol=1e-12)
    assert_allclose(proxy.value, expected(adam_scalar, PROXY0, PROXY_GRADS[:n_steps],
                                          lr=100 * LR, **settings), rtol=1e-12)
    if n_steps == 1:
        # Step 1 by hand: m_hat = g', v_hat = g'^2, so w1 = w0 - lr c g' / (|g'| + eps).
        g = 0.2 + WD * 0.5
        assert_allclose(net.value[0], 0.5 - LR * g / (abs(g) + EPS), rtol=1e-12)
        g = -0.6 + WD * 0.3
        assert_allclose(proxy.value[0], 0.3 - 100 * LR * g / (abs(g) + EPS), rtol=1e-12)


def test_adamw_two_groups_matches_hand_arithmetic():
    net, proxy, groups = two_groups()
    optimizer = AdamW(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=1e-2)
    for step in range(2):
        set_grads([(net, NET_GRADS[step]), (proxy, PROXY_GRADS[step])])
        optimizer.step()
    settings = dict(betas=BETAS, eps=EPS, weight_decay=1e-2, decoupled=True)
    assert_allclose(net.value, expected(adam_scalar, NET0, NET_GRADS[:2], lr=LR,
                                        **settings), rtol=1e-12)
    # The decoupled decay uses the effective rate too: factor 1 - 100 lr wd.
    assert_allclose(proxy.value, expected(adam_scalar, PROXY0, PROXY_GRADS[:2], lr=100 * LR,
                                          **settings), rtol=1e-12)


def test_sgd_two_groups_matches_hand_arithmetic():
    net, proxy, groups = two_groups(multiplier=10.0)
    optimizer = SGD(groups, lr=0.01, momentum=0.9, weight_decay=WD)
    for step in range(2):
        set_grads([(net, NET_GRADS[step]), (proxy, PROXY_GRADS[step])])
        optimizer.step()
    assert_allclose(net.value, expected(sgd_scalar, NET0, NET_GRADS[:2], lr=0.01,
                                        momentum=0.9, weight_decay=WD), rtol=1e-12)
    assert_allclose(proxy.value, expected(sgd_scalar, PROXY0, PROXY_GRADS[:2], lr=0.1,
                                          momentum=0.9, weight_decay=WD), rtol=1e-12)
    # One plain step by hand: w1 = w0 - lr c (g + wd w0).
    net, proxy, groups = two_groups(multiplier=10.0)
    optimizer = SGD(groups, lr=0.01)
    set_grads([(net, NET_GRADS[0]), (proxy, PROXY_GRADS[0])])
    optimizer.step()
    assert_allclose(proxy.value, [0.3 - 0.1 * -0.6, -0.2 - 0.1 * 0.25], rtol=1e-12)


def test_a_schedule_moves_every_group():
    net, proxy, groups = two_groups()
    optimizer = SGD(groups, lr=0.01)
    optimizer.lr = 0.002                      # what a schedule does
    set_grads([(net, NET_GRADS[0]), (proxy, PROXY_GRADS[0])])
    optimizer.step()
    assert optimizer.lr == 0.002
    assert_allclose(net.value, np.array(NET0) - 0.002 * np.array(NET_GRADS[0]), rtol=1e-12)
    assert_allclose(proxy.value, np.array(PROXY0) - 0.2 * np.array(PROXY_GRADS[0]),
                    rtol=1e-12)


def test_one_group_of_multiplier_one_is_the_plain_optimiser():
    # Equal, not close: lr * 1.0 == lr exactly, so the same float operations run.
    plain = Parameter(np.array(NET0), "w")
    grouped = Parameter(np.array(NET0), "w")
    a = Adam([plain], lr=LR, betas=BETAS, weight_decay=WD)
    b = Adam([{"params": [grouped]}], lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(3):
        set_grads([(plain, NET_GRADS[step]), (grouped, NET_GRADS[step])])
        a.step(), b.step()
    assert_array_equal(plain.value, grouped.value)


def test_groups_are_described_and_read_only():
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR)
    assert optimizer.params == [net, proxy]
    assert optimizer.lr_multipliers == {"net.weight": 1.0, "loss.proxies": 100.0}
    optimizer.lr_multipliers["net.weight"] = 5.0        # a copy: nothing changes
    assert optimizer.lr_multipliers["net.weight"] == 1.0
    assert [(g.name, g.lr_multiplier, g.params) for g in optimizer.param_groups] == [
        ("model", 1.0, ("net.weight",)), ("proxies", 100.0, ("loss.proxies",))]
    with pytest.raises(dataclasses.FrozenInstanceError):
        optimizer.param_groups[1].lr_multiplier = 1.0
    assert "proxies x100" in repr(optimizer)
    plain = Adam([Parameter(np.ones(2), "w")])
    assert [(g.name, g.lr_multiplier) for g in plain.param_groups] == [("group0", 1.0)]


# --- freezing ---------------------------------------------------------------------------------
def test_frozen_parameter_is_skipped_then_starts_at_adam_step_one():
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    alone = Parameter(np.array(PROXY0), "loss.proxies")     # the proxy in an Adam of its own
    reference = Adam([{"params": [alone], "lr_multiplier": 100.0}], lr=LR, betas=BETAS,
                     eps=EPS, weight_decay=WD)
    optimizer.freeze([net])
    assert optimizer.frozen == ("net.weight",)
    for step in range(2):
        set_grads([(proxy, PROXY_GRADS[step]), (alone, PROXY_GRADS[step])])
        net.grad[...] = np.nan          # a frozen parameter's gradient is not read
        optimizer.step()
        reference.step()
        assert_array_equal(net.value, NET0)
    state = optimizer.state_dict()["params"]["net.weight"]
    assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    assert state["frozen"] is True and state["step_offset"] == 2 and optimizer.n_steps == 2
    optimizer.unfreeze()
    assert optimizer.frozen == ()
    set_grads([(net, NET_GRADS[2]), (proxy, PROXY_GRADS[2]), (alone, PROXY_GRADS[2])])
    optimizer.step()
    reference.step()
    # The net's first step (t = 1 although n_steps == 3): a fresh Adam's, by hand.
    g = np.array(NET_GRADS[2]) + WD * np.array(NET0)
    assert_allclose(net.value, np.array(NET0) - LR * g / (np.abs(g) + EPS), rtol=1e-12)
    fresh = Parameter(np.array(NET0), "fresh")
    first = Adam([fresh], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    set_grads([(fresh, NET_GRADS[2])])
    first.step()
    # Equal, not close: element-wise operations only, in the same order.
    assert_array_equal(net.value, fresh.value)
    # The proxy never noticed: three steps of its own, as alone and as the scalar loop.
    assert_array_equal(proxy.value, alone.value)
    assert_allclose(proxy.value, expected(adam_scalar, PROXY0, PROXY_GRADS, lr=100 * LR,
                                          betas=BETAS, eps=EPS, weight_decay=WD), rtol=1e-12)


def test_frozen_sgd_parameter_keeps_value_and_velocity():
    net, proxy, groups = two_groups(multiplier=10.0)
    optimizer = SGD(groups, lr=0.01, momentum=0.9, weight_decay=WD)
    set_grads([(net, NET_GRADS[0]), (proxy, PROXY_GRADS[0])])
    optimizer.step()
    velocity = optimizer.state_dict()["params"]["net.weight"]["velocity"]
    value = net.value.copy()
    optimizer.freeze([net])
    set_grads([(net, NET_GRADS[1]), (proxy, PROXY_GRADS[1])])
    optimizer.step()
    assert_array_equal(net.value, value)          # no decay either
    assert_array_equal(optimizer.state_dict()["params"]["net.weight"]["velocity"], velocity)
    optimizer.unfreeze([net])
    set_grads([(net, NET_GRADS[2]), (proxy, PROXY_GRADS[2])])
    optimizer.step()
    # Its second step of its own: v = 0.9 v1 + g', the scalar loop over steps 1 and 3.
    assert_allclose(net.value, expected(sgd_scalar, NET0, [NET_GRADS[0], NET_GRADS[2]],
                                        lr=0.01, momentum=0.9, weight_decay=WD), rtol=1e-12)
    assert_allclose(proxy.value, expected(sgd_scalar, PROXY0, PROXY_GRADS, lr=0.1,
                                          momentum=0.9, weight_decay=WD), rtol=1e-12)


def test_reset_state_while_frozen_restarts_the_count_at_unfreeze():
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR, betas=BETAS, eps=EPS)
    set_grads([(net, NET_GRADS[0]), (proxy, PROXY_GRADS[0])])
    optimizer.step()
    optimizer.freeze([proxy])
    optimizer.reset_state([proxy])
    set_grads([(net, NET_GRADS[1])])
    optimizer.step()
    optimizer.unfreeze()
    start = proxy.value.copy()
    set_grads([(net, NET_GRADS[2]), (proxy, PROXY_GRADS[2])])
    optimizer.step()
    g = np.array(PROXY_GRADS[2])
    assert_allclose(proxy.value, start - 100 * LR * g / (np.abs(g) + EPS), rtol=1e-12)


# --- resume --------------------------------------------------------------------------------
def _grads_of_step(params, step):
    rng = np.random.default_rng(1000 + step)
    set_grads([(p, rng.normal(size=p.shape)) for p in params])


def _run(cls, kwargs, dtype, steps, *, state=None, stop=None):
    """Steps ``steps``; the net is frozen at steps 1-3 (unfrozen from step 4 on). With
    ``stop``, return the state after that many steps instead."""
    net, proxy, groups = two_groups(dtype)
    optimizer = cls(groups, **kwargs)
    if state is not None:
        optimizer.load_state_dict(state[0])
        net.value[...], proxy.value[...] = state[1]
    for step in steps:
        if step == 0:
            optimizer.freeze([net])
        if step == 3:
            optimizer.unfreeze()
        if stop is not None and step == stop:
            return optimizer.state_dict(), (net.value.copy(), proxy.value.copy())
        _grads_of_step([net, proxy], step)
        optimizer.step()
    return net, proxy, optimizer


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cls,kwargs", [
    (SGD, dict(lr=0.01, momentum=0.9, weight_decay=WD)),
    (Adam, dict(lr=LR, betas=BETAS, weight_decay=WD)),
    (AdamW, dict(lr=LR, betas=BETAS, weight_decay=1e-2)),
])
@pytest.mark.parametrize("stop", [2, 6])      # inside the frozen steps, and after them
def test_resume_with_groups_and_freezing_is_bit_for_bit(cls, kwargs, dtype, stop):
    net, proxy, straight = _run(cls, kwargs, dtype, range(10))
    state = _run(cls, kwargs, dtype, range(10), stop=stop)
    state = copy.deepcopy(state)
    resumed_net, resumed_proxy, resumed = _run(cls, kwargs, dtype, range(stop, 10),
                                               state=state)
    assert resumed.n_steps == straight.n_steps == 10
    # Equal, not close: guaranteed by construction. The state holds every buffer, the step
    # count, each parameter's step offset and the frozen set, so the resumed optimiser runs
    # the same float operations in the same order on the same operands.
    assert_array_equal(resumed_net.value, net.value)
    assert_array_equal(resumed_proxy.value, proxy.value)
    if stop == 2:
        assert _run(cls, kwargs, dtype, [], state=state)[2].frozen == ("net.weight",)


def test_state_records_multipliers_and_refuses_others():
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR)
    set_grads([(net, NET_GRADS[0]), (proxy, PROXY_GRADS[0])])
    optimizer.step()
    state = optimizer.state_dict()
    assert state["params"]["loss.proxies"]["lr_multiplier"] == 100.0
    assert state["params"]["net.weight"]["lr_multiplier"] == 1.0
    assert state["params"]["net.weight"]["frozen"] is False
    other = Adam(two_groups(multiplier=10.0)[2], lr=LR)
    with pytest.raises(ValueError, match=r"\['loss.proxies'\] has lr_multiplier == 100\.0, "
                                         r"parameter loss.proxies has lr_multiplier == 10\.0"):
        other.load_state_dict(state)
    assert other.n_steps == 0
    # A state from before parameter groups (no lr_multiplier, no frozen) reads as 1.
    old = copy.deepcopy(state)
    for entry in old["params"].values():
        entry.pop("lr_multiplier"), entry.pop("frozen")
    plain = Adam([Parameter(np.array(NET0), "net.weight"),
                  Parameter(np.array(PROXY0), "loss.proxies")], lr=LR)
    plain.load_state_dict(old)
    assert plain.n_steps == 1 and plain.frozen == ()
    with pytest.raises(ValueError, match=r"lr_multiplier == 1\.0, parameter loss.proxies has "
                                         r"lr_multiplier == 100\.0"):
        Adam(two_groups()[2], lr=LR).load_state_dict(old)


def _state_with(edit):
    net, proxy, groups = two_groups()
    state = Adam(groups, lr=LR).state_dict()
    edit(state["params"])
    return state


@pytest.mark.parametrize("edit,error,match", [
    (lambda p: p["net.weight"].update(frozen="yes"), TypeError,
     r"\['frozen'\] must be a bool, got 'yes'"),
    (lambda p: [e.update(frozen=True) for e in p.values()], ValueError,
     "state freezes every parameter"),
    (lambda p: p["loss.proxies"].update(lr_multiplier=float("nan")), ValueError,
     r"\['lr_multiplier'\] == nan, must be finite"),
    (lambda p: p["loss.proxies"].update(lr_multiplier=0.0), ValueError,
     r"\['lr_multiplier'\] == 0\.0, must be in \(0"),
])
def test_bad_states_are_named_and_change_nothing(edit, error, match):
    target = Adam(two_groups()[2], lr=LR)
    with pytest.raises(error, match=match):
        target.load_state_dict(_state_with(edit))
    assert target.frozen == () and target.n_steps == 0


# --- bad input -------------------------------------------------------------------------------
def _p(name="a"):
    return Parameter(np.ones(2), name)


@pytest.mark.parametrize("make,error,match", [
    (lambda: [_p("a"), {"params": [_p("b")]}], TypeError,
     r"params mixes Parameter objects and group dicts: params\[0\] must be a parameter-group"),
    (lambda: [{"params": [_p()]}, [_p("b")]], TypeError, r"params\[1\] must be a parameter-"),
    (lambda: [{"lr_multiplier": 2.0}], ValueError, r"params\[0\] lacks the key 'params'"),
    (lambda: [{"params": [_p()], "lr": 0.1}], ValueError,
     r"params\[0\] has the unknown key\(s\) \['lr'\]"),
    (lambda: [{"params": []}], ValueError, r"params\[0\]\['params'\] is empty"),
    (lambda: [{"params": _p()}], TypeError,
     r"params\[0\]\['params'\] must be an iterable of Parameter objects"),
    (lambda: [{"params": [_p(), 3]}], TypeError, r"params\[0\]\['params'\]\[1\] must be a "
                                                  r"Parameter, got 3"),
    (lambda: [{"params": [_p()], "name": 7}], TypeError, r"params\[0\]\['name'\] must be a "
                                                          r"non-empty str"),
    (lambda: [{"params": [_p("a")], "name": "x"}, {"params": [_p("b")], "name": "x"}],
     ValueError, "two groups named 'x'"),
    (lambda: [{"params": [_p("a")]}, {"params": [_p("a")]}], ValueError,
     "two parameters named 'a'"),
    ({"params": [_p()]}, TypeError, "params must be an iterable of Parameter objects or of "
                                    "parameter-group dicts"),
    (lambda: [{"params": [_p()], "lr_multiplier": 0}], ValueError,
     r"params\[0\]\['lr_multiplier'\] == 0\.0, must be in \(0"),
    (lambda: [{"params": [_p()], "lr_multiplier": -100.0}], ValueError,
     r"\['lr_multiplier'\] == -100\.0"),
    (lambda: [{"params": [_p()], "lr_multiplier": float("nan")}], ValueError,
     r"\['lr_multiplier'\] == nan, must be finite"),
    (lambda: [{"params": [_p()], "lr_multiplier": float("inf")}], ValueError,
     r"\['lr_multiplier'\] == inf, must be finite"),
    (lambda: [{"params": [_p()], "lr_multiplier": True}], TypeError,
     r"\['lr_multiplier'\] must be a real number, got True"),
    (lambda: [{"params": [_p()], "lr_multiplier": "100"}], TypeError,
     r"\['lr_multiplier'\] must be a real number, got '100'"),
])
def test_bad_groups_are_named(make, error, match):
    params = make() if callable(make) else make
    with pytest.raises(error, match=match):
        Adam(params)


def test_one_parameter_in_two_groups_is_refused():
    shared = _p("shared")
    with pytest.raises(ValueError, match=r"parameter shared is in the groups 'a' and 'b'"):
        SGD([{"params": [shared], "name": "a"}, {"params": [_p("c"), shared], "name": "b"}],
            lr=0.1)


def test_adamw_bounds_the_largest_effective_rate():
    net, proxy, groups = two_groups()
    # 1e-3 * 5 == 5e-3 alone, but 1e-3 * 100 * 5 == 0.5: allowed; at 20, 2.0: refused.
    AdamW(groups, lr=LR, weight_decay=5.0)
    with pytest.raises(ValueError, match=r"lr \* lr_multiplier \* weight_decay == 2 .*the "
                                         r"largest lr_multiplier == 100\.0"):
        AdamW(two_groups()[2], lr=LR, weight_decay=20.0)
    optimizer = AdamW(two_groups()[2], lr=LR, weight_decay=1.0)
    optimizer.lr = 0.01                        # 0.01 * 100 * 1 == 1: the factor reaches 0
    with pytest.raises(ValueError, match="lr_multiplier"):
        optimizer.lr = 0.02                    # what a schedule might try
    assert optimizer.lr == 0.01


def test_bad_freeze_calls_are_named():
    net, proxy, groups = two_groups()
    optimizer = Adam(groups, lr=LR)
    with pytest.raises(TypeError, match="params must be an iterable of Parameter objects"):
        optimizer.freeze(net)
    with pytest.raises(TypeError, match=r"params\[0\] must be a Parameter, got 'net.weight'"):
        optimizer.freeze(["net.weight"])
    with pytest.raises(ValueError, match=r"params\[0\] \(v\) is not a parameter of this"):
        optimizer.freeze([_p("v")])
    with pytest.raises(ValueError, match=r"params\[0\] \(v\) is not a parameter of this"):
        optimizer.unfreeze([_p("v")])
    with pytest.raises(ValueError, match="would leave no parameter of this optimiser to train"):
        optimizer.freeze([net, proxy])
    optimizer.freeze([net])
    with pytest.raises(ValueError, match="would leave no parameter"):
        optimizer.freeze([proxy])
    assert optimizer.frozen == ("net.weight",)
    optimizer.freeze([])                       # nothing to add: allowed
    optimizer.unfreeze([proxy])                # not frozen: nothing to do
    assert optimizer.frozen == ("net.weight",)


@pytest.mark.requires_cupy          # tests/conftest.py: skipped, with the reason, without a GPU
def test_cupy_groups_and_freezing_match_numpy():
    import cupy

    for cls, kwargs in ((SGD, dict(lr=0.01, momentum=0.9, weight_decay=WD)),
                        (Adam, dict(lr=LR, betas=BETAS, weight_decay=WD))):
        on_cpu, on_gpu = two_groups()[:2], two_groups()[:2]
        on_gpu = [Parameter(cupy.asarray(p.value), p.name) for p in on_gpu]
        optimizers = []
        for net, proxy in (on_cpu, on_gpu):
            optimizers.append(cls([{"params": [net]},
                                   {"params": [proxy], "lr_multiplier": 100.0}], **kwargs))
            optimizers[-1].freeze([net])
        for step in range(3):
            if step == 2:
                for optimizer in optimizers:
                    optimizer.unfreeze()
            for p, grads in zip(on_cpu, (NET_GRADS, PROXY_GRADS)):
                set_grads([(p, grads[step])])
            for p, q in zip(on_gpu, on_cpu):
                p.zero_grad()
                p.accumulate(cupy.asarray(q.grad))
            for optimizer in optimizers:
                optimizer.step()
        for p, q in zip(on_cpu, on_gpu):
            # element-wise operations only on both; 1e-14 allows for a fused kernel's rounding
            assert_allclose(cupy.asnumpy(q.value), p.value, rtol=1e-14)
