"""The side thread in training: the layers that run part of their work on it (refdml._backend's
``side_thread``, ``Backend.alongside`` and ``Backend.halves``) and the Trainer setting that
turns it on.

What is asserted: inside ``side_thread`` the convolution's forward and backward run on two
halves of the batch, one on the worker thread, the 1x1 layer's and the GSP layer's
parameter gradients beside their input's (seen by the thread that runs them), and the
results equal the one-thread results (each half is the same single-threaded computation on
the same operands, so they agree to the last bits; asserted to 1e-13 of the largest entry,
not bit for bit, as the BLAS is not ours to promise); a
Trainer runs its steps inside the block exactly when it may (on the CPU, with two CPUs or
more, ``side_thread=True``), and its trajectory does not depend on the setting.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from refdml._backend import get_backend
from refdml.gpu import gsp as fast_gsp
from refdml.gpu.gsp import _array as gsp_array
from refdml.train import side_thread
from refdml.train import _conv
from refdml.train._loop import usable_cpus
from refdml.train.layers import (
    conv2d_backward,
    conv2d_forward,
    local_linear_backward,
    local_linear_forward,
)
import test_train_runs
from test_train_runs import _steps

TIGHT = 1e-13


def _close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=0, atol=TIGHT * max(1.0, float(np.abs(b).max())))


def _threads_of(monkeypatch, module, name):
    """Record the thread that runs ``module.name`` (then run it)."""
    seen = []
    original = getattr(module, name)

    def recording(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recording)
    return seen


@pytest.mark.parametrize("input_grad", [True, False])
def test_the_convolutions_backward_runs_on_two_halves_of_the_batch(monkeypatch, input_grad):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 7, 6))
    weight, bias = rng.standard_normal((5, 4, 3, 3)), rng.standard_normal(5)
    y, ctx = conv2d_forward(x, weight, bias, stride=2, padding=1)
    d_y = rng.standard_normal(y.shape)
    alone = conv2d_backward(ctx, d_y, input_grad=input_grad)
    seen = _threads_of(monkeypatch, _conv, "_conv_parameter_grads")
    with side_thread():
        beside = conv2d_backward(ctx, d_y, input_grad=input_grad)
    # One half of the batch on each thread (Backend.halves), with or without d_x.
    assert sorted(seen) == sorted(["refdml-side_0", threading.current_thread().name])
    for name in ("weight", "bias"):
        _close(getattr(beside, name), getattr(alone, name))
    if input_grad:
        _close(beside.x, alone.x)
    else:
        assert beside.x is None


def test_the_convolutions_forward_runs_on_two_halves_of_the_batch(monkeypatch):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 6, 7))       # an odd batch: halves of 3 and 2 images
    weight, bias = rng.standard_normal((4, 3, 3, 3)), rng.standard_normal(4)
    alone, alone_ctx = conv2d_forward(x, weight, bias, stride=1, padding=1)
    seen = _threads_of(monkeypatch, _conv, "_im2col")
    with side_thread():
        beside, beside_ctx = conv2d_forward(x, weight, bias, stride=1, padding=1)
    assert sorted(seen) == sorted(["refdml-side_0", threading.current_thread().name])
    _close(beside, alone)
    _close(beside_ctx.cols, alone_ctx.cols)
    # And the halves are the whole: the product of the whole batch's patches at once.
    whole = (alone_ctx.cols @ alone_ctx.weight_matrix.T + bias).reshape(5, 6, 7, 4)
    _close(alone, whole.transpose(0, 3, 1, 2))


def test_the_one_by_one_layers_weight_gradient_runs_beside(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 6, 4, 5))
    weight, bias = rng.standard_normal((3, 6)), rng.standard_normal(3)
    y, ctx = local_linear_forward(x, weight, bias)
    d_y = rng.standard_normal(y.shape)
    alone = local_linear_backward(ctx, d_y)
    seen = _threads_of(monkeypatch, _conv, "matmul")
    with side_thread():
        beside = local_linear_backward(ctx, d_y)
    assert sorted(seen) == sorted(["refdml-side_0", threading.current_thread().name])
    for name in ("x", "weight", "bias"):
        _close(getattr(beside, name), getattr(alone, name))


def test_the_gsp_layer_gives_the_same_numbers_beside(monkeypatch):
    rng = np.random.default_rng(2)
    features = rng.standard_normal((3, 7, 5))
    prototypes = rng.standard_normal((4, 5))
    (pooled, z), ctx = fast_gsp.gsp_pool_forward(features, prototypes, mu=0.3,
                                                 inverse_temperature=5.0)
    d_pooled, d_z = rng.standard_normal(pooled.shape), rng.standard_normal(z.shape)
    alone = fast_gsp.gsp_pool_backward(ctx, d_pooled, d_z)
    seen = _threads_of(monkeypatch, gsp_array, "prototypes_backward")
    with side_thread():
        beside = fast_gsp.gsp_pool_backward(ctx, d_pooled, d_z)
        (pooled_beside, z_beside), _ = fast_gsp.gsp_pool_forward(
            features, prototypes, mu=0.3, inverse_temperature=5.0)
    assert seen == ["refdml-side_0"]
    _close(pooled_beside, pooled)
    _close(z_beside, z)
    _close(beside.features, alone.features)
    _close(beside.prototypes, alone.prototypes)


# --------------------------------------------------------------------------- the Trainer
def _where_alongside_runs() -> str:
    return get_backend(np.zeros(1)).alongside(lambda: threading.current_thread().name).result()


TOKENS = dict(n_classes=4, n_classes_per_batch=4, n_train_per_class=16, n_val_per_class=4,
              n_test_per_class=4, head="gsp", n_prototypes=4, dim=8, embedding_dim=8,
              dtype="float64", epochs=1, progress=False)
DIGITS = dict(test_train_runs.DIGITS, dtype="float64")


def _token_trainer(out_dir, **kwargs):
    from refdml.train.runs import build_run

    return build_run("tokens", dict(TOKENS, **kwargs), out_dir=out_dir).trainer


@pytest.mark.parametrize("enabled", [True, False])
def test_fit_runs_inside_the_block_when_it_may(tmp_path, enabled):
    trainer = _token_trainer(tmp_path, side_thread=enabled)
    assert trainer.side_thread is enabled
    where = []
    trainer.after_step = lambda: where.append(_where_alongside_runs())
    trainer.fit()
    assert where
    expected = enabled and usable_cpus() >= 2
    assert all(name.startswith("refdml-side") == expected for name in where), where
    # Outside fit the setting is off again.
    assert _where_alongside_runs() == threading.current_thread().name


def test_the_trajectory_does_not_depend_on_the_side_thread(tmp_path):
    from refdml.train.runs import build_run

    values, start = {}, None
    for enabled in (False, True):
        run = build_run("digits-collage", DIGITS, out_dir=tmp_path / str(enabled))
        start = {p.name: p.value.copy() for p in run.trainer.optimizer.params}
        with side_thread(enabled):
            _steps(run, 5)
        values[enabled] = {p.name: p.value.copy() for p in run.trainer.optimizer.params}
    moved = max(float(np.abs(values[False][k] - start[k]).max()) for k in start)
    assert moved > 1e-3, "the parameters barely moved: the comparison would be vacuous"
    for name in values[False]:
        _close(values[True][name], values[False][name])


@pytest.mark.parametrize("bad,error", [(1, TypeError), ("yes", TypeError), (None, ValueError)])
def test_the_config_checks_side_thread_by_name(tmp_path, bad, error):
    with pytest.raises(error, match="side_thread"):
        _token_trainer(tmp_path, side_thread=bad)


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_the_trainer_checks_side_thread_by_name(tmp_path, bad):
    from refdml.train import Trainer

    built = _token_trainer(tmp_path / "built")
    with pytest.raises(TypeError, match="side_thread must be True or False"):
        Trainer(built.model, built.objective, built.optimizer,
                train_sampler=built.train_sampler, train_data=(built.train_x, built.train_y),
                val_data=(built.val_x, built.val_y), out_dir=tmp_path / "t", epochs=1,
                seed=0, dtype="float64", side_thread=bad)
