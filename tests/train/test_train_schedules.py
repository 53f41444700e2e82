"""refdml.train.schedules: closed forms at given epochs, plateau behaviour on scripted
metric sequences (traced by hand from the rule), resume, named errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.train import SGD, Adam, CosineAnnealing, Parameter, ReduceOnPlateau, StepDecay


def _optimizer(lr=1.0):
    return SGD([Parameter(np.zeros(2), "w")], lr=lr)


def _trace(schedule, n_epochs, metrics=None):
    """The optimiser's lr at epochs 0..n_epochs (after construction, then each step)."""
    lrs = [schedule.optimizer.lr]
    for e in range(n_epochs):
        lrs.append(schedule.step() if metrics is None else schedule.step(metrics[e]))
    return lrs


def test_step_decay_closed_form():
    schedule = StepDecay(_optimizer(0.8), step_size=3, gamma=0.5)
    assert _trace(schedule, 9) == [0.8, 0.8, 0.8, 0.4, 0.4, 0.4, 0.2, 0.2, 0.2, 0.1]
    assert schedule.lr_at(30) == 0.8 * 0.5**10


def test_cosine_without_warmup_is_the_sgdr_formula():
    base, min_lr, t_max = 0.1, 1e-3, 10
    schedule = CosineAnnealing(_optimizer(base), t_max=t_max, min_lr=min_lr)
    lrs = _trace(schedule, 14)
    expected = [min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * e / t_max))
                for e in range(t_max + 1)] + [min_lr] * 4
    assert_allclose(lrs, expected, rtol=1e-15)
    # landmarks: start, half-way (the mean), end
    assert lrs[0] == base
    assert_allclose(lrs[5], (base + min_lr) / 2, rtol=1e-15)
    assert_allclose(lrs[10], min_lr, rtol=1e-15)


def test_cosine_with_warmup():
    schedule = CosineAnnealing(_optimizer(0.4), t_max=7, warmup_epochs=3)
    lrs = _trace(schedule, 8)
    # warm-up 0.4 * (e + 1) / 4, then cos over the remaining 4 epochs, then 0
    expected = [0.1, 0.2, 0.3, 0.4,
                0.2 * (1 + math.cos(math.pi / 4)), 0.2, 0.2 * (1 + math.cos(3 * math.pi / 4)),
                0.0, 0.0]
    assert_allclose(lrs, expected, rtol=1e-15, atol=1e-17)
    assert all(b > a for a, b in zip(lrs[:3], lrs[1:4]))  # rising warm-up
    assert all(b < a for a, b in zip(lrs[3:7], lrs[4:8]))  # falling cosine


def test_plateau_max_mode_gsp_settings():
    # GSP supp.: factor 0.5, patience 5, on validation MAP@R (mode max).
    schedule = ReduceOnPlateau(_optimizer(1e-4), mode="max", factor=0.5, patience=5)
    metrics = [0.10, 0.20, 0.25, 0.25, 0.24, 0.25, 0.25, 0.25, 0.25, 0.26, 0.26, 0.26, 0.26,
               0.26, 0.26, 0.26]
    lrs = _trace(schedule, len(metrics), metrics)
    # lrs[k] is the rate after metric k-1. Best 0.25 at index 2; indices 3..8 are 6 bad
    # epochs (0.25, 0.24 do not beat 0.25 * (1 + 1e-4)) -> halve after index 8 (lrs[9]);
    # 0.26 at index 9 improves; indices 10..15 are 6 bad epochs -> halve again (lrs[16]).
    expected = [1e-4] * 9 + [5e-5] * 7 + [2.5e-5]
    assert_allclose(lrs, expected, rtol=1e-15)
    assert schedule.n_reductions == 2 and schedule.best == 0.26


def test_plateau_min_mode_threshold_cooldown_and_floor():
    schedule = ReduceOnPlateau(_optimizer(1.0), mode="min", factor=0.1, patience=1,
                               threshold=0.1, threshold_mode="abs", cooldown=2, min_lr=0.005)
    metrics = [1.0, 0.95, 0.92, 0.5, 0.45, 0.44, 0.43, 0.42, 0.41, 0.41, 0.41, 0.41]
    lrs = _trace(schedule, len(metrics), metrics)
    # idx0 best 1.0; idx1,2 bad (not < 0.9) -> 2 bad > patience 1 -> lr 0.1, cooldown 2;
    # idx3 0.5 best (cooldown 2 -> 1); idx4 bad but cooldown (1 -> 0) resets count;
    # idx5 bad 1; idx6 bad 2 -> lr 0.01, cooldown 2; idx7, idx8 in cooldown;
    # idx9 bad 1; idx10 bad 2 -> max(0.001, 0.005) = 0.005; idx11 in cooldown.
    expected = [1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.1, 0.01, 0.01, 0.01, 0.01, 0.005, 0.005]
    assert_allclose(lrs, expected, rtol=1e-15)
    assert schedule.n_reductions == 3
    for m in [0.5] * 10:  # at the floor: no further reduction is counted
        schedule.step(m)
    assert schedule.lr == 0.005 and schedule.n_reductions == 3


def test_plateau_relative_threshold_with_negative_metric():
    schedule = ReduceOnPlateau(_optimizer(1.0), mode="min", threshold=0.1, patience=0)
    schedule.step(-1.0)
    assert not schedule.is_improvement(-1.05)  # within 10% of |best|
    assert schedule.is_improvement(-1.2)
    schedule.step(-1.05)  # a bad epoch with patience 0 -> reduce
    assert schedule.lr == pytest.approx(0.1, rel=1e-15)


@pytest.mark.parametrize("make,metrics", [
    (lambda o: StepDecay(o, step_size=2, gamma=0.3), None),
    (lambda o: CosineAnnealing(o, t_max=9, warmup_epochs=2, min_lr=1e-3), None),
    (lambda o: ReduceOnPlateau(o, mode="max", factor=0.5, patience=1),
     [0.1, 0.2, 0.2, 0.15, 0.2, 0.3, 0.3, 0.3, 0.3, 0.3]),
])
def test_schedule_and_optimizer_resume_bit_for_bit(make, metrics):
    def fresh():
        param = Parameter(np.array([1.0, -2.0, 0.5]), "w")
        optimizer = Adam([param], lr=0.05)
        return param, optimizer, make(optimizer)

    def epoch(param, optimizer, schedule, e):
        optimizer.zero_grad()
        param.accumulate(2 * param.value + np.sin(e + np.arange(3)))
        optimizer.step()
        return schedule.step() if metrics is None else schedule.step(metrics[e])

    param, optimizer, schedule = fresh()
    straight = [epoch(param, optimizer, schedule, e) for e in range(10)]
    final = param.value.copy()

    param, optimizer, schedule = fresh()
    first = [epoch(param, optimizer, schedule, e) for e in range(5)]
    saved = (param.value.copy(), optimizer.state_dict(), schedule.state_dict())
    param, optimizer, schedule = fresh()
    param.value[...] = saved[0]
    schedule.load_state_dict(saved[2])
    optimizer.load_state_dict(saved[1])
    second = [epoch(param, optimizer, schedule, e) for e in range(5, 10)]
    assert first + second == straight
    assert np.array_equal(param.value, final)


@pytest.mark.parametrize("make,error,match", [
    (lambda o: StepDecay(o, step_size=0), ValueError, r"step_size == 0, must be in \[1"),
    (lambda o: StepDecay(o, step_size=2.5), TypeError, r"step_size must be an integer"),
    (lambda o: StepDecay(o, step_size=2, gamma=0.0), ValueError, r"gamma == 0\.0"),
    (lambda o: StepDecay(o, step_size=2, gamma=1.5), ValueError, r"gamma == 1\.5"),
    (lambda o: CosineAnnealing(o, t_max=0), ValueError, r"t_max == 0"),
    (lambda o: CosineAnnealing(o, t_max=5, min_lr=-1.0), ValueError, r"min_lr == -1\.0"),
    (lambda o: CosineAnnealing(o, t_max=5, min_lr=2.0), ValueError,
     r"min_lr == 2\.0, must be <= the optimiser's lr == 1\.0"),
    (lambda o: CosineAnnealing(o, t_max=5, warmup_epochs=5), ValueError,
     r"warmup_epochs == 5, must be < t_max == 5"),
    (lambda o: ReduceOnPlateau(o, mode="maximum"), ValueError, r"mode == 'maximum'"),
    (lambda o: ReduceOnPlateau(o, factor=1.0), ValueError, r"factor == 1\.0, must be in \(0"),
    (lambda o: ReduceOnPlateau(o, patience=-1), ValueError, r"patience == -1"),
    (lambda o: ReduceOnPlateau(o, threshold=float("nan")), ValueError, r"threshold == nan"),
    (lambda o: ReduceOnPlateau(o, threshold_mode="relative"), ValueError, r"threshold_mode"),
    (lambda o: ReduceOnPlateau(o, cooldown=-2), ValueError, r"cooldown == -2"),
    (lambda o: ReduceOnPlateau(o, min_lr=float("inf")), ValueError, r"min_lr == inf"),
    (lambda o: StepDecay(object(), step_size=1), TypeError, r"optimizer must be"),
])
def test_bad_arguments_are_named(make, error, match):
    with pytest.raises(error, match=match):
        make(_optimizer(1.0))


def test_plateau_rejects_nonfinite_metric():
    schedule = ReduceOnPlateau(_optimizer())
    with pytest.raises(ValueError, match=r"metric == nan, must be finite"):
        schedule.step(float("nan"))
    assert schedule.epoch == 0


def test_load_state_dict_rejects_mismatches_and_changes_nothing():
    source = CosineAnnealing(_optimizer(0.5), t_max=4)
    target = CosineAnnealing(_optimizer(1.0), t_max=8)
    target.step()
    lr_before = target.lr
    plateau = ReduceOnPlateau(_optimizer()).state_dict()
    cases = [
        (StepDecay(_optimizer(), step_size=2).state_dict(), ValueError,
         r"state\['schedule'\] == 'StepDecay', this schedule is 'CosineAnnealing'"),
        (plateau, ValueError, "keys"),
        ({**source.state_dict(), "epoch": -1}, ValueError, r"epoch'\] == -1"),
        ({**source.state_dict(), "base_lr": 0.0}, ValueError, r"base_lr'\] == 0\.0"),
        ({**source.state_dict(), "arguments": {"t_max": 4}}, ValueError, "arguments"),
        ({**source.state_dict(), "arguments": {"t_max": 4, "min_lr": 0.0,
                                               "warmup_epochs": 9}}, ValueError,
         "warmup_epochs == 9"),
        ("state", TypeError, "state must be a dict"),
    ]
    for state, error, match in cases:
        with pytest.raises(error, match=match):
            target.load_state_dict(state)
        assert (target.t_max, target.epoch, target.base_lr, target.lr) == (8, 1, 1.0, lr_before)
    target.load_state_dict(source.state_dict())
    assert (target.t_max, target.base_lr, target.lr) == (4, 0.5, 0.5)
    bad_plateau = ReduceOnPlateau(_optimizer())
    with pytest.raises(ValueError, match=r"n_bad_epochs'\] == -3"):
        bad_plateau.load_state_dict({**plateau, "n_bad_epochs": -3})
