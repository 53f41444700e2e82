"""The fused optimiser step (refdml.gpu.optim, flat buffers in refdml.train.optim) against the
per-parameter rule written readably (each optimiser's ``_proposal``, itself held to scalar
loops from the papers by tests/train/test_train_optim.py).

Every path of the family ("array", the CPU twin, the CUDA kernels under the simulator) on
SGD (momentum, Nesterov, decay), Adam (coupled decay) and AdamW, with parameter groups,
multipliers, a frozen parameter, a reset (its own step count) and both float dtypes; then
the all-or-nothing refusals and, on the CuPy stand-in, the deferred ones.

Tolerance: every path makes the per-parameter code's operations in its order, in the
dtype, but not bit for bit on every machine: the bias corrections ``beta**t`` come from
the platform's ``pow`` (NumPy's may be SVML's on an AVX-512 host, the kernels' libdevice's),
within an ulp of Python's, and a compiler may contract a product and a sum into an FMA (CUDA
does). So each is held to 4 units of roundoff of the dtype, relative to the value's
magnitude, after 4 steps.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from refdml import _deferred
from refdml.gpu import use_kernels
from refdml.train import SGD, Adam, AdamW, NonFiniteStepError, Parameter

MODES = ("array", "cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda))
SHAPES = {"w": (3, 4), "b": (4,), "s": (), "p": (2, 5)}


def _xp():
    cupy = sys.modules.get("cupy")
    return cupy if getattr(cupy, "__refdml_standin__", False) else np


def _params(xp, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return {name: Parameter(xp.asarray(rng.normal(size=shape).astype(dtype)), name)
            for name, shape in SHAPES.items()}


def _grads(xp, dtype, step, seed=1):
    rng = np.random.default_rng([seed, step])
    return {name: xp.asarray(rng.normal(size=shape).astype(dtype)) for name, shape in SHAPES.items()}


OPTIMISERS = {
    "sgd": lambda groups: SGD(groups, lr=0.05),
    "sgd-momentum-decay": lambda groups: SGD(groups, lr=0.05, momentum=0.9, weight_decay=1e-2),
    "sgd-nesterov": lambda groups: SGD(groups, lr=0.05, momentum=0.8, nesterov=True),
    "adam": lambda groups: Adam(groups, lr=1e-2, weight_decay=1e-3),
    "adamw": lambda groups: AdamW(groups, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
}


def _build(kind, params):
    groups = [{"params": [params["w"], params["b"], params["s"]]},
              {"params": [params["p"]], "lr_multiplier": 10.0, "name": "proxies"}]
    return OPTIMISERS[kind](groups)


def _reference_run(kind, dtype, n_steps):
    """The per-parameter rule, step by step, on NumPy: the expected values and buffers."""
    params = _params(np, dtype)
    opt = _build(kind, params)
    values = {n: p.value.copy() for n, p in params.items()}
    buffers = {n: {b: np.zeros(SHAPES[n], dtype) for b in opt._buffers[n]} for n in params}
    offsets = {n: 0 for n in params}
    for step in range(1, n_steps + 1):
        grads = _grads(np, dtype, step)
        frozen = {"b"} if step == 2 else set()
        if step == 3:
            buffers["p"] = {b: np.zeros_like(a) for b, a in buffers["p"].items()}
            offsets["p"] = step - 1
        for name in params:
            if name in frozen:
                offsets[name] += 1
                continue
            shadow = Parameter(values[name], name)
            shadow.grad = grads[name]
            opt._step_offsets = dict(offsets)
            with np.errstate(all="ignore"):
                proposal = opt._proposal(shadow, buffers[name], step)
            values[name] = proposal.pop("value")
            buffers[name].update(proposal)
    return values, buffers


def _fused_run(kind, dtype, n_steps, mode, xp):
    params = _params(xp, dtype)
    opt = _build(kind, params)
    with use_kernels(mode):
        for step in range(1, n_steps + 1):
            opt.zero_grad()
            for name, grad in _grads(xp, dtype, step).items():
                params[name].accumulate(grad)
            if step == 2:
                opt.freeze([params["b"]])
            if step == 3:
                opt.unfreeze()
                opt.reset_state([params["p"]])
            opt.step()
    return ({n: xp.asnumpy(p.value) if xp is not np else p.value for n, p in params.items()},
            {n: {b: (xp.asnumpy(a) if xp is not np else a) for b, a in bufs.items()}
             for n, bufs in opt._buffers.items()}, opt)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", sorted(OPTIMISERS))
@pytest.mark.parametrize("mode", MODES)
def test_the_fused_step_makes_the_per_parameter_rule(mode, kind, dtype):
    xp = _xp()
    if mode == "cpu" and xp is not np:
        pytest.skip("the CPU twin takes NumPy arrays (the NumPy session runs it)")
    expected_values, expected_buffers = _reference_run(kind, dtype, 4)
    values, buffers, opt = _fused_run(kind, dtype, 4, mode, xp)
    assert opt.n_steps == 4
    tol = 4 * np.finfo(dtype).eps
    for name in SHAPES:
        pairs = [(values[name], expected_values[name])]
        pairs += [(buffers[name][b], expected_buffers[name][b]) for b in expected_buffers[name]]
        for got, want in pairs:
            assert got.dtype == dtype
            assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max(), err_msg=name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", ["grad", "update"])
def test_a_refused_step_changes_nothing_and_names_the_entry(mode, bad):
    xp = _xp()
    if mode == "cpu" and xp is not np:
        pytest.skip("the CPU twin takes NumPy arrays (the NumPy session runs it)")
    params = _params(xp, np.float64)
    opt = Adam(list(params.values()), lr=1e-2) if bad == "grad" else SGD(list(params.values()), lr=1e300)
    with use_kernels(mode):
        opt.zero_grad()
        for name, grad in _grads(xp, np.float64, 1).items():
            params[name].accumulate(grad)
        opt.step()
        before = {n: np.array(xp.asnumpy(p.value) if xp is not np else p.value) for n, p in params.items()}
        state = opt.state_dict()
        opt.zero_grad()
        grads = _grads(xp, np.float64, 2)
        if bad == "grad":
            grads["p"][1, 3] = np.nan
            grads["p"][1, 4] = np.inf
            match = r"gradient of p is not finite \(NaN or inf\) at index \(1, 3\), step 2"
        else:
            grads = {n: g * 1e300 for n, g in grads.items()}
            match = r"SGD step 2 would make w not finite at index \(0, 0\)"
        for name, grad in grads.items():
            params[name].accumulate(grad)
        with pytest.raises(NonFiniteStepError, match=match):
            opt.step()
    assert opt.n_steps == 1
    for name, p in params.items():
        assert_array_equal(xp.asnumpy(p.value) if xp is not np else p.value, before[name])
    after = opt.state_dict()
    for name in params:
        for key, value in state["params"][name].items():
            if isinstance(value, np.ndarray):
                assert_array_equal(after["params"][name][key], value)
    # the refusal left the optimiser usable: a finite step goes through
    opt.zero_grad()
    with use_kernels(mode):
        opt.step()
    assert opt.n_steps == 2


def test_a_frozen_parameter_is_not_read_and_a_rebound_value_is_taken_in():
    params = _params(np, np.float64)
    opt = SGD(list(params.values()), lr=0.5)
    opt.freeze([params["s"]])
    params["s"].grad[...] = np.nan           # never read: frozen
    params["w"].value = np.full(SHAPES["w"], 2.0)   # rebound by a user: copied in at the step
    params["w"].grad[...] = 1.0
    opt.step()
    assert_array_equal(params["w"].value, np.full(SHAPES["w"], 1.5))
    assert np.isnan(params["s"].grad).all()
    params["w"].grad[...] = 1.0              # the value is the flat buffer's view again
    opt.step()
    assert_array_equal(params["w"].value, np.full(SHAPES["w"], 1.0))


def test_a_closed_gate_refuses_the_step():
    xp = _xp()
    params = _params(xp, np.float64)
    opt = SGD(list(params.values()), lr=0.5)
    before = xp.asnumpy(params["w"].value) if xp is not np else params["w"].value.copy()
    params["w"].grad[...] = 1.0
    with pytest.raises(NonFiniteStepError, match="refused by the caller's checks"):
        opt.step(gate=xp.asarray(False))
    assert opt.n_steps == 0
    assert_array_equal(xp.asnumpy(params["w"].value) if xp is not np else params["w"].value, before)
    opt.step(gate=xp.asarray(True))
    assert opt.n_steps == 1


def test_inside_a_scope_on_the_device_a_refusal_waits_and_names_its_step():
    xp = _xp()
    if xp is np:
        pytest.skip("the deferral needs device arrays: the CuPy stand-in (REFDML_CUPY_STANDIN=1)")
    from cupy_standin import count_transfers

    params = _params(xp, np.float32)
    opt = Adam(list(params.values()), lr=1e-2)
    reads = _deferred.DeferredReads()
    kept = None
    with _deferred.deferring(reads), count_transfers() as syncs:
        for step in range(1, 5):
            reads.where = f"step {step}"
            opt.zero_grad()
            grads = _grads(xp, np.float32, step)
            if step == 3:
                grads["b"][2] = np.nan
            for name, grad in grads.items():
                params[name].accumulate(grad)
            opt.step()
            if step == 2:
                kept = {n: xp.asnumpy(p.value) for n, p in params.items()}
    assert syncs.total == len(SHAPES), syncs   # only the copies kept above, one per parameter
    assert opt.n_steps == 4 and len(reads) == 4
    with pytest.raises(NonFiniteStepError, match=r"gradient of b .* index \(2,\), step 3 \(step 3\)"):
        reads.read()
    assert opt.n_steps == 2                  # back to the last good step
    for name, p in params.items():           # the device made no update from step 3 on
        assert_array_equal(xp.asnumpy(p.value), kept[name])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [(), (0,), (3,), (700,), (255, 256), (1000, 257)])
def test_first_nonfinite_finds_the_first_bad_entry(mode, bad):
    # a readable scan is the oracle; 1003 entries span several strides of the CUDA block
    from refdml.gpu.optim import first_nonfinite

    xp = _xp()
    if mode == "cpu" and xp is not np:
        pytest.skip("the CPU twin takes NumPy arrays (the NumPy session runs it)")
    host = np.linspace(-1.0, 1.0, 1003).reshape(17, 59)
    for k, index in enumerate(bad):
        host.reshape(-1)[index] = (np.nan, np.inf, -np.inf)[k % 3]
    expected = next((i for i, v in enumerate(host.reshape(-1)) if not np.isfinite(v)), -1)
    checks = xp.asarray(np.array([7, 7, 7], dtype=np.int64))
    with use_kernels(mode):
        first_nonfinite(xp.asarray(host.astype(np.float32)), checks, 1)
    got = xp.asnumpy(checks) if xp is not np else checks
    assert got.tolist() == [7, expected, 7]
