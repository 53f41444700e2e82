"""refdml's training step against PyTorch autograd on the same model (scripts/_torch_twin.py).

The twin is the yardstick of scripts/bench_train.py; these tests keep it the same model:
from the same initial parameters and batch, in float64, the gradients of one step and the
parameters after three Adam steps agree with refdml's (the digits-collage model: the
convolutions, the per-location linear map, the GSP head, the objective; the token model).
They skip where torch is not installed (it is no dependency of refdml).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.train.runs import build_run

TWIN = Path(__file__).resolve().parents[2] / "scripts" / "_torch_twin.py"
STUDIES = {"collage": "digits-collage", "tokens": "tokens"}
# Both sides compute the same float64 maths in another order (PyTorch's convolution
# algorithm and BLAS against im2col and OpenBLAS): the gradients differ by rounding,
# measured at most 6e-15 of each parameter's largest gradient entry; 1e-13 leaves a factor
# above 10. Adam normalises every entry (its first update is about lr g / |g|), so an entry
# whose gradient is tiny next to the largest carries its large relative rounding into an
# O(lr) step: the values after three steps (measured 2e-14 of the largest entry) get 1e-12.
GRAD_RTOL = 1e-13
VALUE_RTOL = 1e-12


def _load_twin():
    """scripts/ is no package: the module is loaded from its file."""
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("torch_twin_under_test", TWIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(which):
    """A freshly built training run of ``which`` in float64 (fast path) and its first batch."""
    config = dict(dtype="float64", device="cpu", reference=False, epochs=0, progress=False)
    run = build_run(STUDIES[which], config, out_dir=tempfile.mkdtemp())
    trainer = run.trainer
    batch = next(iter(trainer.train_sampler))
    return run, trainer.train_x[batch], trainer.train_y[batch]


def _refdml_step(run, x, labels):
    optimizer = run.trainer.optimizer
    optimizer.zero_grad()
    outputs, ctx = run.model.forward(x)
    _, objective_ctx = run.objective.forward(outputs, labels)
    run.model.backward(ctx, run.objective.backward(objective_ctx, 1.0))
    optimizer.step()


def _assert_close(ours, theirs, rtol, what):
    scale = np.abs(ours).max()
    assert scale > 0, f"{what}: all zero, the comparison would be vacuous"
    assert_allclose(theirs, ours, rtol=0, atol=rtol * scale, err_msg=what)


@pytest.mark.parametrize("which", sorted(STUDIES))
def test_torch_twin_trains_like_refdml(which):
    twin_module = _load_twin()
    ours, x, labels = _run(which)
    theirs, _, _ = _run(which)   # the twin runs the head and objective through its own objects
    twin = twin_module.torch_twin(theirs.model, theirs.objective, theirs.trainer.optimizer,
                                  x, labels)
    params = ours.trainer.optimizer.params
    assert {p.name for p in params} == set(twin.named_parameters)
    start = {p.name: p.value.copy() for p in params}
    for step in range(3):
        _refdml_step(ours, x, labels)
        twin.step()
        if step == 0:
            for p in params:
                _assert_close(p.grad, twin.named_parameters[p.name].grad.numpy(), GRAD_RTOL,
                              f"{p.name} gradient")
    for p in params:
        _assert_close(p.value, twin.named_parameters[p.name].detach().numpy(), VALUE_RTOL,
                      f"{p.name} after 3 steps")
    moved = max(np.abs(p.value - start[p.name]).max() for p in params)
    assert moved > 1e-4, "the parameters did not move: the comparison would be vacuous"


def test_torch_twin_comparison_is_sensitive():
    """Not vacuous: one conv weight of the twin moved by 1e-9 of its scale fails the check."""
    twin_module = _load_twin()
    torch = pytest.importorskip("torch")
    ours, x, labels = _run("collage")
    theirs, _, _ = _run("collage")
    twin = twin_module.torch_twin(theirs.model, theirs.objective, theirs.trainer.optimizer,
                                  x, labels)
    weight = twin.named_parameters["conv3.weight"]
    with torch.no_grad():
        weight[0, 0, 1, 1] += 1e-9 * float(weight.abs().max())
    _refdml_step(ours, x, labels)
    twin.step()
    with pytest.raises(AssertionError):
        for p in ours.trainer.optimizer.params:
            _assert_close(p.grad, twin.named_parameters[p.name].grad.numpy(), GRAD_RTOL,
                          f"{p.name} gradient")

