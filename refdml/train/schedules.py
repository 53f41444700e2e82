r"""Learning-rate schedules: step decay, cosine annealing with warm-up, reduce-on-plateau.

A schedule holds an :class:`~refdml.train.optim.Optimizer` and writes its ``lr`` once per
epoch. Every schedule has one protocol, ``schedule.step(metric=None)``, called at the end of
each epoch after the epoch's optimiser steps: a schedule whose ``uses_metric`` is true
(:class:`ReduceOnPlateau`) needs the epoch's metric, the closed-form ones
(:class:`StepDecay`, :class:`CosineAnnealing`) take none; the other way round is a
TypeError naming ``metric`` (a metric handed to a closed-form schedule would be silently
ignored). At construction the epoch is 0 and ``lr`` is already set to the epoch-0
value. ``base_lr`` is the optimiser's ``lr`` when the schedule is built. With
:math:`\eta_0` = ``base_lr`` and epoch :math:`e`:

Step decay: :math:`\eta_e = \eta_0\,\gamma^{\lfloor e / s \rfloor}` (``step_size`` s,
``gamma`` :math:`\gamma`), PyTorch's ``StepLR``.

Cosine annealing (Loshchilov & Hutter 2017, SGDR without restarts) after a linear
warm-up of :math:`W` epochs, reaching ``min_lr`` :math:`\eta_{min}` at epoch ``t_max``
:math:`T` and staying there:

.. math::

    \eta_e = \begin{cases}
      \eta_0 \frac{e + 1}{W + 1} & e < W \\
      \eta_{min} + \frac{\eta_0 - \eta_{min}}{2}
        \left(1 + \cos\frac{\pi (e - W)}{T - W}\right) & W \le e < T \\
      \eta_{min} & e \ge T
    \end{cases}

With :math:`W = 0` and :math:`e \le T` this is PyTorch's ``CosineAnnealingLR`` (whose
closed form keeps oscillating past :math:`T`; here the rate stays at the minimum).

Reduce-on-plateau (PyTorch's ``ReduceLROnPlateau``; the GSP supplement trains with
``factor=0.5, patience=5``): a metric *improves* on the best so far when it beats it by more
than ``threshold`` (relative: ``threshold * |best|``; absolute: ``threshold``), in
the direction of ``mode``. After more than ``patience`` epochs without improvement the
rate becomes ``max(lr * factor, min_lr)`` and the bad-epoch count restarts; for
``cooldown`` epochs after a reduction, bad epochs are not counted. The relative threshold
uses ``|best|`` so that a negative metric (a loss below zero) moves the right way;
PyTorch's ``best * (1 - threshold)`` agrees for positive metrics.

Every schedule has ``state_dict()`` / ``load_state_dict()`` (arguments, ``base_lr``, epoch,
plateau counters; checked on load, named errors) for a bit-for-bit resume; save it with
the optimiser's state.
"""

from __future__ import annotations

import math
from typing import Any

from refdml._validation import _describe, check_choice, check_scalar
from refdml.train.optim import Optimizer

__all__ = ["Schedule", "StepDecay", "CosineAnnealing", "ReduceOnPlateau"]


def _check_min_lr(value: Any, base_lr: float) -> float:
    """A floor of the rate in ``[0, base_lr]``, named ``min_lr``."""
    min_lr = check_scalar(value, "min_lr", low=0.0)
    if min_lr > base_lr:
        raise ValueError(f"min_lr == {min_lr!r}, must be <= the optimiser's lr == {base_lr!r}")
    return min_lr


class Schedule:
    """Base class: the optimiser, ``base_lr``, the epoch counter and the state dict.

    Subclasses implement ``_check_arguments(values, base_lr) -> dict`` (named checks),
    ``_arguments()``, and either ``lr_at(epoch)`` or their own ``_step_on(metric)`` (with
    ``uses_metric = True``).
    """

    _extra_state: tuple[str, ...] = ()
    #: Whether :meth:`step` needs the epoch's metric (the trainer passes the validation
    #: MAP@R) or takes none (a closed-form schedule of the epoch).
    uses_metric: bool = False

    def __init__(self, optimizer: Optimizer, arguments: dict[str, Any]) -> None:
        if type(self) is Schedule:
            raise TypeError("Schedule is the base class; build a StepDecay, a "
                            "CosineAnnealing or a ReduceOnPlateau")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a refdml.train.optim.Optimizer, got {_describe(optimizer)}"
            )
        self.optimizer = optimizer
        self.base_lr = optimizer.lr
        self._set(self._check_arguments(arguments, self.base_lr))
        self.epoch = 0

    def _set(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(self, key, value)

    @classmethod
    def _check_arguments(cls, values: dict[str, Any], base_lr: float) -> dict[str, Any]:
        raise NotImplementedError

    def _arguments(self) -> dict[str, Any]:
        raise NotImplementedError

    @property
    def lr(self) -> float:
        """The optimiser's current learning rate."""
        return self.optimizer.lr

    def state_dict(self) -> dict[str, Any]:
        """``{"schedule": class name, "arguments": {...}, "base_lr", "epoch", ...}``."""
        state = {
            "schedule": type(self).__name__,
            "arguments": self._arguments(),
            "base_lr": self.base_lr,
            "epoch": self.epoch,
        }
        state.update({key: getattr(self, key) for key in self._extra_state})
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked first; named errors), then set the
        optimiser's ``lr`` to this epoch's value (closed-form schedules)."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {_describe(state)}")
        keys = {"schedule", "arguments", "base_lr", "epoch", *self._extra_state}
        if set(state) != keys:
            raise ValueError(f"state has keys {sorted(state)}, expected {sorted(keys)}")
        kind = type(self).__name__
        if state["schedule"] != kind:
            raise ValueError(
                f"state['schedule'] == {state['schedule']!r}, this schedule is {kind!r}"
            )
        base_lr = check_scalar(state["base_lr"], "state['base_lr']", low=0.0,
                               low_inclusive=False)
        epoch = check_scalar(state["epoch"], "state['epoch']", low=0, integer=True)
        arguments = state["arguments"]
        if not isinstance(arguments, dict) or set(arguments) != set(self._arguments()):
            raise ValueError(
                f"state['arguments'] must be a dict with keys {sorted(self._arguments())}, "
                f"got {_describe(arguments)}"
            )
        checked = self._check_arguments(arguments, base_lr)
        extra = self._check_extra_state(state)
        self._set(checked)
        self._set(extra)
        self.base_lr, self.epoch = base_lr, epoch
        self._apply()

    def _check_extra_state(self, state: dict[str, Any]) -> dict[str, Any]:
        return {}

    def _apply(self) -> None:
        self.optimizer.lr = self.lr_at(self.epoch)

    def lr_at(self, epoch: int) -> float:
        raise NotImplementedError

    def step(self, metric: float | None = None) -> float:
        """End of an epoch: advance the epoch, set and return the optimiser's ``lr``.

        ``metric``: the epoch's metric where :attr:`uses_metric` (finite), else ``None``;
        anything else is a TypeError naming ``metric``, and the epoch does not advance.
        """
        kind = type(self).__name__
        if self.uses_metric:
            if metric is None:
                raise TypeError(f"metric is None: {kind}.step(metric) needs the epoch's metric")
            metric = check_scalar(metric, "metric")
        elif metric is not None:
            raise TypeError(
                f"metric == {_describe(metric)}: {kind} is a closed-form schedule of the epoch "
                f"and steps without a metric ({kind}.step()); ReduceOnPlateau takes one")
        self.epoch += 1
        self._step_on(metric)
        return self.optimizer.lr

    def _step_on(self, metric: float | None) -> None:
        """The new epoch's rate (``self.epoch`` is already advanced)."""
        self._apply()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._arguments().items())
        return f"{type(self).__name__}({args}, base_lr={self.base_lr!r}, epoch={self.epoch})"


class StepDecay(Schedule):
    """``lr = base_lr * gamma ** (epoch // step_size)``.

    Parameters
    ----------
    optimizer : Optimizer
    step_size : int
        Epochs between decays, >= 1.
    gamma : float, default 0.1
        Multiplicative decay, in (0, 1].
    """

    def __init__(self, optimizer: Optimizer, *, step_size: int, gamma: float = 0.1) -> None:
        super().__init__(optimizer, {"step_size": step_size, "gamma": gamma})
        self._apply()

    @classmethod
    def _check_arguments(cls, values: dict[str, Any], base_lr: float) -> dict[str, Any]:
        return {
            "step_size": check_scalar(values["step_size"], "step_size", low=1, integer=True),
            "gamma": check_scalar(values["gamma"], "gamma", low=0.0, high=1.0,
                                  low_inclusive=False),
        }

    def _arguments(self) -> dict[str, Any]:
        return {"step_size": self.step_size, "gamma": self.gamma}

    def lr_at(self, epoch: int) -> float:
        """The closed-form rate at ``epoch`` (>= 0)."""
        epoch = check_scalar(epoch, "epoch", low=0, integer=True)
        return self.base_lr * self.gamma ** (epoch // self.step_size)


class CosineAnnealing(Schedule):
    """Cosine annealing from ``base_lr`` to ``min_lr`` at epoch ``t_max``, after an optional
    linear warm-up (module docstring for the formula).

    Parameters
    ----------
    optimizer : Optimizer
    t_max : int
        The epoch at which the rate reaches ``min_lr`` (counting the warm-up), >= 1.
    min_lr : float, default 0
        Final rate, in [0, base_lr].
    warmup_epochs : int, default 0
        Linear warm-up ``base_lr * (e + 1) / (warmup_epochs + 1)``; in [0, t_max).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        t_max: int,
        min_lr: float = 0.0,
        warmup_epochs: int = 0,
    ) -> None:
        super().__init__(
            optimizer, {"t_max": t_max, "min_lr": min_lr, "warmup_epochs": warmup_epochs}
        )
        self._apply()

    @classmethod
    def _check_arguments(cls, values: dict[str, Any], base_lr: float) -> dict[str, Any]:
        t_max = check_scalar(values["t_max"], "t_max", low=1, integer=True)
        min_lr = _check_min_lr(values["min_lr"], base_lr)
        warmup = check_scalar(values["warmup_epochs"], "warmup_epochs", low=0, integer=True)
        if warmup >= t_max:
            raise ValueError(f"warmup_epochs == {warmup}, must be < t_max == {t_max}")
        return {"t_max": t_max, "min_lr": min_lr, "warmup_epochs": warmup}

    def _arguments(self) -> dict[str, Any]:
        return {"t_max": self.t_max, "min_lr": self.min_lr,
                "warmup_epochs": self.warmup_epochs}

    def lr_at(self, epoch: int) -> float:
        """The closed-form rate at ``epoch`` (>= 0)."""
        epoch = check_scalar(epoch, "epoch", low=0, integer=True)
        if epoch < self.warmup_epochs:
            return self.base_lr * (epoch + 1) / (self.warmup_epochs + 1)
        if epoch >= self.t_max:
            return self.min_lr
        progress = (epoch - self.warmup_epochs) / (self.t_max - self.warmup_epochs)
        return self.min_lr + (self.base_lr - self.min_lr) * (1 + math.cos(math.pi * progress)) / 2


class ReduceOnPlateau(Schedule):
    """Multiply ``lr`` by ``factor`` when a metric stops improving (PyTorch's
    ``ReduceLROnPlateau``; module docstring for the rule).

    Parameters
    ----------
    optimizer : Optimizer
    mode : {"min", "max"}, default "min"
        ``"max"`` for a metric to maximise (validation MAP@R), ``"min"`` for a loss.
    factor : float, default 0.1
        In (0, 1); the GSP supplement uses 0.5.
    patience : int, default 10
        Epochs without improvement tolerated, >= 0; the GSP supplement uses 5.
    threshold : float, default 1e-4
        Least improvement that counts, >= 0.
    threshold_mode : {"rel", "abs"}, default "rel"
    cooldown : int, default 0
        Epochs after a reduction during which bad epochs are not counted, >= 0.
    min_lr : float, default 0
        Floor of the rate, in [0, base_lr] (a floor above the optimiser's ``lr`` would
        raise the rate; checked again against the saved ``base_lr`` on load).
    """

    _extra_state = ("best", "n_bad_epochs", "cooldown_counter", "n_reductions")
    uses_metric = True

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        mode: str = "min",
        factor: float = 0.1,
        patience: int = 10,
        threshold: float = 1e-4,
        threshold_mode: str = "rel",
        cooldown: int = 0,
        min_lr: float = 0.0,
    ) -> None:
        super().__init__(optimizer, {
            "mode": mode, "factor": factor, "patience": patience, "threshold": threshold,
            "threshold_mode": threshold_mode, "cooldown": cooldown, "min_lr": min_lr,
        })
        self.best: float | None = None
        self.n_bad_epochs = 0
        self.cooldown_counter = 0
        self.n_reductions = 0

    @classmethod
    def _check_arguments(cls, values: dict[str, Any], base_lr: float) -> dict[str, Any]:
        return {
            "mode": check_choice(values["mode"], "mode", ("min", "max")),
            "factor": check_scalar(values["factor"], "factor", low=0.0, high=1.0,
                                   low_inclusive=False, high_inclusive=False),
            "patience": check_scalar(values["patience"], "patience", low=0, integer=True),
            "threshold": check_scalar(values["threshold"], "threshold", low=0.0),
            "threshold_mode": check_choice(values["threshold_mode"], "threshold_mode",
                                           ("rel", "abs")),
            "cooldown": check_scalar(values["cooldown"], "cooldown", low=0, integer=True),
            "min_lr": _check_min_lr(values["min_lr"], base_lr),
        }

    def _arguments(self) -> dict[str, Any]:
        return {"mode": self.mode, "factor": self.factor, "patience": self.patience,
                "threshold": self.threshold, "threshold_mode": self.threshold_mode,
                "cooldown": self.cooldown, "min_lr": self.min_lr}

    def _check_extra_state(self, state: dict[str, Any]) -> dict[str, Any]:
        best = state["best"]
        if best is not None:
            best = check_scalar(best, "state['best']")
        return {
            "best": best,
            "n_bad_epochs": check_scalar(state["n_bad_epochs"], "state['n_bad_epochs']",
                                         low=0, integer=True),
            "cooldown_counter": check_scalar(state["cooldown_counter"],
                                             "state['cooldown_counter']", low=0, integer=True),
            "n_reductions": check_scalar(state["n_reductions"], "state['n_reductions']",
                                         low=0, integer=True),
        }

    def _apply(self) -> None:
        pass  # the rate lives in the optimiser's state; nothing is recomputed on load

    def is_improvement(self, metric: float) -> bool:
        """Whether ``metric`` beats the best so far by more than the threshold."""
        if self.best is None:
            return True
        margin = self.threshold * abs(self.best) if self.threshold_mode == "rel" else self.threshold
        if self.mode == "min":
            return metric < self.best - margin
        return metric > self.best + margin

    def _step_on(self, metric: float | None) -> None:
        """Count the epoch as good or bad on its (checked, finite) ``metric``; reduce."""
        if self.is_improvement(metric):
            self.best = metric
            self.n_bad_epochs = 0
        else:
            self.n_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.n_bad_epochs = 0
        if self.n_bad_epochs > self.patience:
            old = self.optimizer.lr
            new = max(old * self.factor, self.min_lr)
            if new < old:
                self.optimizer.lr = new
                self.n_reductions += 1
            self.cooldown_counter = self.cooldown
            self.n_bad_epochs = 0
