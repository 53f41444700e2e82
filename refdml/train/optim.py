r"""Optimisers written by hand: SGD with momentum, Adam, AdamW.

Each optimiser holds a list of :class:`~refdml.train.Parameter` objects and, at
:meth:`~Optimizer.step`, reads every ``Parameter.grad`` and updates ``Parameter.value``
in place, in the parameter's dtype (float32 stays float32), with the parameter's array
module (NumPy on CPU, CuPy on a GPU: the same code). Hyperparameters are Python floats,
so ``float32_array * hyperparameter`` stays float32 (NEP 50 weak scalars; CuPy alike).
Per step, with gradient :math:`g`, weight :math:`w`, step count :math:`t` (1 at the first
step), learning rate :math:`\eta` (``lr``) and weight decay :math:`\lambda`
(``weight_decay``):

SGD (PyTorch's convention, dampening 0; Sutskever et al. 2013 for Nesterov):

.. math::

    g \leftarrow g + \lambda w, \qquad v \leftarrow \mu v + g, \qquad
    w \leftarrow w - \eta\,(g + \mu v \text{ if Nesterov else } v)

with :math:`v_0 = 0` (so :math:`v_1 = g_1` exactly, PyTorch's first-step buffer).

Adam (Kingma & Ba 2015, Algorithm 1; :math:`\lambda > 0` adds the coupled L2 term
:math:`g \leftarrow g + \lambda w` as PyTorch's ``Adam(weight_decay=...)``):

.. math::

    m \leftarrow \beta_1 m + (1-\beta_1) g, \qquad
    v \leftarrow \beta_2 v + (1-\beta_2) g^2, \qquad
    w \leftarrow w - \eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

(``eps`` is added to the square root in the denominator, outside it; this ``eps`` is the
Adam paper's :math:`\epsilon`, unrelated to the entropic-OT ``eps`` of :mod:`refdml.ot`.)
The code evaluates the last fraction as ``(lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)``
with ``bc_i = 1 - beta_i**t``, as PyTorch does (equal in exact arithmetic).

AdamW (Loshchilov & Hutter 2019, decoupled weight decay, PyTorch's ``AdamW``): first
:math:`w \leftarrow w\,(1 - \eta\lambda)`, then the Adam step above without the L2 term.

Parameter groups (PyTorch's ``param_groups``, reduced to what the papers use): ``params``
is an iterable of Parameter (one group, multiplier 1) or of dicts ``{"params": iterable of
Parameter, "lr_multiplier": float (finite, > 0, default 1), "name": str (default
"group<i>")}``. A parameter of a group with multiplier :math:`c` steps with the effective
learning rate :math:`c\,\eta` in every rule above (AdamW's decay factor too:
:math:`1 - c\,\eta\lambda`); a schedule sets the base :math:`\eta` (``lr``) alone, so every
group follows it. GSP and ASAP train their proxies at :math:`c = 100`.

Freezing (a warm-up that trains some parameters only): :meth:`~Optimizer.freeze` and
:meth:`~Optimizer.unfreeze`. :meth:`~Optimizer.step` skips a frozen parameter altogether
(as PyTorch skips a parameter whose ``grad`` is None): its value, its buffers and its Adam
step count stay as they are, and its gradient is not read (not even checked). ``n_steps``
counts the optimiser's steps; a parameter's own count :math:`t` is ``n_steps`` less its
step offset, and each step taken while a parameter is frozen adds one to that offset, so a
parameter that starts training late starts at :math:`t = 1`, as under PyTorch's
per-parameter ``step``. The frozen set is part of :meth:`~Optimizer.state_dict`.

A step is all or nothing. :meth:`~Optimizer.step` computes every parameter's new value
and buffers aside, and raises :class:`NonFiniteStepError` (a ``ValueError``) naming the
optimiser, the step and the parameter when a gradient is not finite or when the update
would make a value or a buffer NaN or inf (an ``lr`` or ``weight_decay`` far too large,
an overflowing ``g**2``): then nothing has changed (values, buffers, ``n_steps``), so the
caller holds the parameters of the last good step. Only when everything is finite are the
new values copied into the parameters (in place) and the buffers replaced.

Hyperparameter ranges (PyTorch's, plus what the maths needs): ``lr`` finite and > 0 (a
schedule may set 0); ``momentum`` and both ``betas`` in [0, 1) (a geometric average needs
a factor below 1); ``eps`` finite and > 0; ``weight_decay`` finite and >= 0; for AdamW
also ``lr * c * weight_decay <= 1`` for the largest multiplier ``c`` of its groups,
since the decoupled decay multiplies the weights by ``1 - lr * c * weight_decay`` (a
negative factor flips their sign every step, one below -1 makes them grow).

:meth:`~Optimizer.state_dict` returns host NumPy copies of every buffer, the step count,
the hyperparameters and, per parameter, its multiplier, step offset and whether it is
frozen; :meth:`~Optimizer.load_state_dict` checks them against this optimiser's parameters
(names, shapes, dtypes, multipliers) and restores them, so a resumed run is bit-for-bit
the same as an uninterrupted one.

Flat buffers. An optimiser keeps its parameters' values, their gradients and
its buffers in flat arrays, one set per dtype, and every ``Parameter.value`` /
``Parameter.grad`` becomes a view into them (a parameter whose value or gradient someone
rebinds is copied back in at the next :meth:`~Optimizer.zero_grad` or
:meth:`~Optimizer.step`). :meth:`~Optimizer.zero_grad` is one fill; :meth:`~Optimizer.step`
is :func:`refdml.gpu.optim.fused_step`: a preparation pass (each parameter's rate and bias
corrections, from per-parameter numbers kept on the device and a step count kept there),
a check pass (the first non-finite gradient and the first non-finite proposal, as flat
indices) and a commit pass that writes every proposal only when both are clean: three
CUDA launches on CuPy whatever the number of parameters, the compiled CPU twin on NumPy.
The per-parameter rules below (``_proposal``) are the readable form the fused step is
tested against (tests/train/test_optim_fused.py).

GPU synchronisation: none inside a step run within a
:func:`refdml._deferred.deferring` scope (the training loop's on a GPU): the refusal is
read with the scope's other reads, names the step, and puts ``n_steps`` back to the last
good step (the device made no update from the failed step on: the status is sticky).
Outside a scope a step on CuPy makes one device-to-host copy (the status) before it
returns, as before. A step copies nothing to the device.

The shared checkpoint checks and the three rules are kept side by side in this module so
they can be read against each other.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml import _deferred
from refdml._validation import _describe, check_scalar
from refdml._backend import get_backend, to_numpy
from refdml.exceptions import NonFiniteGradient
from refdml.gpu.optim import (ACTIVE, BAD_GRAD, BAD_UPDATE, BETA1, BETA2, DECAY, GATE, LR,
                              N_COEF, N_PLAN, N_SCALARS, OFFSET, SCALARS, fused_step)
from refdml.train._parameter import Parameter

__all__ = ["NonFiniteStepError", "Optimizer", "ParamGroup", "SGD", "Adam", "AdamW"]


class NonFiniteStepError(NonFiniteGradient):
    """An optimiser step refused: a gradient, or the value or buffer it would give, is NaN/inf.

    Raised by :meth:`Optimizer.step` before anything changes (parameter values, buffers
    and ``n_steps`` are those of before the call). It is a
    :class:`~refdml.exceptions.NonFiniteGradient`, so a ``ValueError`` (what a non-finite
    gradient always raised) and a ``FloatingPointError``.
    """


def _check_lr(lr: Any, name: str = "lr", *, allow_zero: bool = False) -> float:
    return check_scalar(lr, name, low=0.0, low_inclusive=allow_zero)


def _check_betas(betas: Any) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {_describe(betas)}")
    beta1 = check_scalar(betas[0], "betas[0]", low=0.0, high=1.0, high_inclusive=False)
    beta2 = check_scalar(betas[1], "betas[1]", low=0.0, high=1.0, high_inclusive=False)
    return (beta1, beta2)


#: The keys a parameter-group dict may hold.
GROUP_KEYS = ("params", "lr_multiplier", "name")


@dataclass(frozen=True)
class ParamGroup:
    """One parameter group of an :class:`Optimizer` (read-only): its ``name``, its
    ``lr_multiplier`` and the names of its parameters, in order."""

    name: str
    lr_multiplier: float
    params: tuple[str, ...]


def _check_param_list(params: Any, where: str) -> list[Parameter]:
    """``params`` as a list of Parameter objects (named errors; may be empty)."""
    if isinstance(params, (Parameter, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            f"{where} must be an iterable of Parameter objects, got {_describe(params)}")
    params = list(params)
    for index, param in enumerate(params):
        if not isinstance(param, Parameter):
            raise TypeError(f"{where}[{index}] must be a Parameter, got {_describe(param)}")
    return params


def _parse_groups(params: Any) -> list[tuple[str, float, list[Parameter]]]:
    """``(name, lr_multiplier, parameters)`` of each group of the ``params`` argument."""
    if isinstance(params, (Parameter, dict)) or not isinstance(params, Iterable):
        raise TypeError(
            "params must be an iterable of Parameter objects or of parameter-group dicts "
            f"{{'params': ..., 'lr_multiplier': ..., 'name': ...}}, got {_describe(params)}")
    entries = list(params)
    if not entries:
        raise ValueError("params is empty; an optimiser needs at least one Parameter")
    if not any(isinstance(entry, dict) for entry in entries):
        return [("group0", 1.0, _check_param_list(entries, "params"))]
    groups = []
    for index, group in enumerate(entries):
        where = f"params[{index}]"
        if not isinstance(group, dict):
            raise TypeError(f"params mixes Parameter objects and group dicts: {where} must "
                            f"be a parameter-group dict like the others, got {_describe(group)}")
        unknown = sorted(str(k) for k in group if k not in GROUP_KEYS)
        if unknown:
            raise ValueError(f"{where} has the unknown key(s) {unknown}; a group takes "
                             f"{list(GROUP_KEYS)} (other settings are the optimiser's)")
        if "params" not in group:
            raise ValueError(f"{where} lacks the key 'params'")
        name = group.get("name", f"group{index}")
        if not isinstance(name, str) or not name:
            raise TypeError(f"{where}['name'] must be a non-empty str, got {_describe(name)}")
        multiplier = check_scalar(group.get("lr_multiplier", 1.0),
                                  f"{where}['lr_multiplier']", low=0.0, low_inclusive=False)
        members = _check_param_list(group["params"], f"{where}['params']")
        if not members:
            raise ValueError(f"{where}['params'] is empty (group {name!r}); a group needs at "
                             "least one Parameter")
        groups.append((name, multiplier, members))
    names = [name for name, _, _ in groups]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"params holds two groups named {twice[0]!r}")
    owner: dict[int, str] = {}
    for name, _, members in groups:
        for param in members:
            if id(param) in owner and owner[id(param)] != name:
                raise ValueError(f"parameter {param.name} is in the groups {owner[id(param)]!r} "
                                 f"and {name!r}; a parameter belongs to one group")
            owner[id(param)] = name
    return groups


def _by_dtype(params: list[Parameter]) -> list[list[Parameter]]:
    """``params`` split by dtype, each list in the order of ``params``."""
    groups: dict[np.dtype, list[Parameter]] = {}
    for param in params:
        groups.setdefault(param.dtype, []).append(param)
    return list(groups.values())


class _FlatBuffers:
    """The parameters of one dtype, their gradients and the optimiser's buffers, each in one
    flat array; every ``Parameter.value`` / ``Parameter.grad`` and every buffer the
    optimiser hands out is a view into them (module docstring, "Flat buffers")."""

    def __init__(self, xp: Any, params: list[Parameter], buffer_names: tuple[str, ...]) -> None:
        self.xp = xp
        self.params = params
        self.dtype = params[0].dtype
        sizes = [int(np.prod(p.shape, dtype=np.int64)) for p in params]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n = int(self.starts[-1])
        self.values = xp.empty(n, dtype=self.dtype)
        self.grads = xp.empty(n, dtype=self.dtype)
        self.b1 = xp.zeros(n if len(buffer_names) >= 1 else 1, dtype=self.dtype)
        self.b2 = xp.zeros(n if len(buffer_names) >= 2 else 1, dtype=self.dtype)
        self.segment = xp.asarray(np.repeat(np.arange(len(params), dtype=np.int32), sizes))
        self.status = xp.asarray(self.clean_status())
        self.clock = xp.zeros(1, dtype=np.int64)
        self.coef = xp.zeros((len(params), N_COEF), dtype=self.dtype)
        self._plan: tuple[np.ndarray, Any] | None = None
        self._views: list[tuple[Any, Any]] = [(None, None)] * len(params)
        self.buffer_views = {
            p.name: {name: flat[a:b].reshape(p.shape)
                     for name, flat in zip(buffer_names, (self.b1, self.b2))}
            for p, a, b in zip(params, self.starts[:-1], self.starts[1:])}
        self._scalars: tuple[tuple[Any, ...], Any] | None = None
        self.bind()

    def clean_status(self) -> np.ndarray:
        n = self.values.shape[0]
        return np.array([n, n, 0], dtype=np.int64)

    def bind(self) -> None:
        """Make every parameter's ``value`` and ``grad`` the views into the flat arrays
        again where something rebound them (copying what they hold in first): host-side
        identity checks only, nothing launched when all are bound."""
        for index, (param, a, b) in enumerate(zip(self.params, self.starts[:-1],
                                                  self.starts[1:])):
            value_view, grad_view = self._views[index]
            if param.value is value_view and param.grad is grad_view:
                continue
            self.values[a:b] = param.value.reshape(-1)
            self.grads[a:b] = param.grad.reshape(-1)
            value_view = self.values[a:b].reshape(param.shape)
            grad_view = self.grads[a:b].reshape(param.shape)
            param.value, param.grad = value_view, grad_view
            self._views[index] = (value_view, grad_view)

    def uploaded(self, plan: np.ndarray) -> Any:
        """``plan`` on the device, copied there again only when it changed (a learning
        rate, the frozen set, a reset): a step copies nothing to the device."""
        if self._plan is None or not np.array_equal(self._plan[0], plan):
            self._plan = (plan, self.xp.asarray(plan))
        return self._plan[1]

    def scalars(self, constants: dict[str, Any]) -> Any:
        """The rule's constants as a device array, uploaded again only when they change."""
        key = tuple(constants.values())
        if self._scalars is None or self._scalars[0] != key:
            host = np.zeros(N_SCALARS, dtype=self.dtype)
            host[:len(key)] = key
            self._scalars = (key, self.xp.asarray(host))
        return self._scalars[1]

    def locate(self, flat_index: int) -> tuple[Parameter, tuple[int, ...]]:
        """The parameter and the index within it of element ``flat_index``."""
        row = int(np.searchsorted(self.starts, flat_index, side="right")) - 1
        param = self.params[row]
        local = flat_index - int(self.starts[row])
        return param, tuple(int(i) for i in np.unravel_index(local, param.shape))


class Optimizer:
    """Base class: the parameters and their groups, ``lr``, the step count, freezing,
    gradient checks, state.

    Subclasses implement ``_check_hyperparameters(values, allow_zero_lr, max_multiplier)
    -> dict`` (the named checks), ``_buffers_for(hyperparameters)`` (the per-parameter
    state arrays), ``_hyperparameters()`` and ``_proposal(param, buffers, n_steps)`` (the
    new value and buffers as new arrays; :meth:`step` checks them and commits;
    :meth:`_lr_of` is the parameter's effective learning rate).

    Parameters
    ----------
    params : iterable of Parameter, or iterable of dict
        Parameters: one group, multiplier 1. Dicts: parameter groups
        ``{"params": iterable of Parameter (non-empty), "lr_multiplier": float (finite,
        > 0; default 1.0), "name": str (default "group<i>")}`` (module docstring); a
        parameter belongs to one group. Non-empty, unique parameter names, all NumPy or
        all CuPy.
    lr : float
        Base learning rate, finite and > 0 (a group's is ``lr * lr_multiplier``). A
        schedule may later set ``lr`` to 0 (its end).

    Attributes
    ----------
    params : list of Parameter
        Every parameter, flat, group after group.
    """

    def __init__(self, params: Iterable[Parameter] | Iterable[dict[str, Any]], *,
                 lr: float) -> None:
        groups = _parse_groups(params)
        params = [param for _, _, members in groups for param in members]
        names: set[str] = set()
        for param in params:
            if param.name in names:
                raise ValueError(f"params holds two parameters named {param.name!r}")
            names.add(param.name)
        self._xp = get_backend(*(p.value for p in params)).xp
        self.params: list[Parameter] = params
        self._groups = tuple(ParamGroup(name, multiplier, tuple(p.name for p in members))
                             for name, multiplier, members in groups)
        self._multipliers: dict[str, float] = {
            p.name: multiplier for _, multiplier, members in groups for p in members}
        self._lr = _check_lr(lr)
        # Checked again with the groups known (AdamW bounds lr * multiplier * decay).
        self._check_hyperparameters({**self._hyperparameters(), "lr": self._lr},
                                    allow_zero_lr=False, max_multiplier=self._max_multiplier)
        self.n_steps = 0
        self._no_checks = self._xp.zeros(0, dtype=np.int64)
        self._flats = [_FlatBuffers(self._xp, members, self._buffers_for(self._hyperparameters()))
                       for members in _by_dtype(params)]
        self._buffers: dict[str, dict[str, Any]] = {
            name: views for flat in self._flats for name, views in flat.buffer_views.items()}
        #: Per parameter, the optimiser steps it did not take: ``n_steps`` at its last
        #: :meth:`reset_state` (0: never reset) plus the steps taken while it was frozen.
        #: Adam's bias correction counts ``n_steps`` less this.
        self._step_offsets: dict[str, int] = {p.name: 0 for p in params}
        self._frozen: set[str] = set()

    # -- learning rate (schedules write it) ------------------------------------------
    @property
    def lr(self) -> float:
        """The current base learning rate (a schedule may set it; finite, >= 0)."""
        return self._lr

    @lr.setter
    def lr(self, value: float) -> None:
        # Every check again: some bound lr jointly with another hyperparameter (AdamW).
        self._lr = self._check_hyperparameters(
            {**self._hyperparameters(), "lr": value}, allow_zero_lr=True,
            max_multiplier=self._max_multiplier)["lr"]

    # -- groups --------------------------------------------------------------------------
    @property
    def param_groups(self) -> tuple[ParamGroup, ...]:
        """The parameter groups (frozen dataclasses: name, lr_multiplier, parameter names)."""
        return self._groups

    @property
    def lr_multipliers(self) -> dict[str, float]:
        """``{parameter name: its group's lr_multiplier}`` (a copy: changing it changes
        nothing)."""
        return dict(self._multipliers)

    @property
    def _max_multiplier(self) -> float:
        return max(group.lr_multiplier for group in self._groups)

    def _lr_of(self, param: Parameter) -> float:
        """The effective learning rate of ``param``: ``lr * lr_multiplier``."""
        return self._lr * self._multipliers[param.name]

    # -- freezing --------------------------------------------------------------------------
    @property
    def frozen(self) -> tuple[str, ...]:
        """The names of the frozen parameters, in :attr:`params` order."""
        return tuple(p.name for p in self.params if p.name in self._frozen)

    def freeze(self, params: Iterable[Parameter]) -> None:
        """Freeze ``params`` (a subset of :attr:`params`; already frozen ones stay so):
        :meth:`step` skips them (module docstring) until :meth:`unfreeze`.

        Raises ``ValueError`` when that would leave no parameter to train.
        """
        params = self._own(params)
        frozen = self._frozen | {p.name for p in params}
        if len(frozen) == len(self.params):
            raise ValueError(
                f"freezing {sorted(p.name for p in params)} would leave no parameter of this "
                "optimiser to train; unfreeze some first")
        self._frozen = frozen

    def unfreeze(self, params: Iterable[Parameter] | None = None) -> None:
        """Let ``params`` (a subset of :attr:`params`; None: every parameter) train again;
        their next step is step 1 of Adam's bias correction when they never trained."""
        if params is None:
            self._frozen = set()
            return
        self._frozen -= {p.name for p in self._own(params)}

    def _own(self, params: Any) -> list[Parameter]:
        """``params``, checked to be an iterable of this optimiser's Parameter objects."""
        params = _check_param_list(params, "params")
        ours = {id(p) for p in self.params}
        for index, param in enumerate(params):
            if id(param) not in ours:
                raise ValueError(f"params[{index}] ({param.name}) is not a parameter of this "
                                 "optimiser")
        return params

    # -- the loop's two calls ----------------------------------------------------------
    def zero_grad(self) -> None:
        """Clear every parameter's accumulated gradient (in place: one fill per dtype)."""
        for flat in self._flats:
            flat.bind()
            flat.grads.fill(0)

    def step(self, gate: Any = None) -> None:
        """One update of every parameter that is not frozen, from its ``grad``, all or
        nothing: :func:`refdml.gpu.optim.fused_step` over the flat buffers (module
        docstring, "Flat buffers").

        ``gate``: the caller's own checks of this step (the training loop's: the loss and
        the objective's gradient); when one failed, nothing is updated either. None (no
        checks); a boolean, or a 0-d boolean array of the parameters' module (False: a
        check failed); or an int64 array of :func:`refdml.gpu.optim.first_nonfinite`'s
        slots (-1: passed). It is not read on the host.

        Raises ``TypeError`` / ``ValueError`` for a gradient of the wrong dtype or shape,
        before anything changes. A gradient that is not finite, or an update that would
        make a value or a buffer NaN or inf, is :class:`NonFiniteStepError` naming the
        parameter, the step and the first bad entry: at once (NumPy, or CuPy outside a
        :func:`refdml._deferred.deferring` scope: one host read per step), or, inside a
        scope on CuPy, when the scope's reads are read; the device then made no update
        from that step on, and the error puts ``n_steps`` back to the last good step.
        Frozen parameters' gradients are not read.
        """
        active = [p for p in self.params if p.name not in self._frozen]
        self._check_grad_shapes(active)
        n_steps = self.n_steps + 1
        hyper = self._hyperparameters()
        rule = self._rule
        for flat in self._flats:
            flat.bind()
            plan = self._flat_plan(flat)
            constants = self._constants(flat.dtype)
            # a failed check closes the gate, sticky: no later step of this status commits
            fused_step(rule, constants, flat.values, flat.grads, flat.b1, flat.b2,
                       flat.segment, flat.uploaded(plan), flat.coef, flat.scalars(constants),
                       flat.status, flat.clock, self._gate_checks(gate))
        offsets = dict(self._step_offsets)
        for name in self._frozen:
            self._step_offsets[name] += 1      # its own step count stays where it was
        self.n_steps = n_steps
        # each status with the device's step count after it (one launch each, as a copy):
        # the step a status belongs to is read from the device, so that a replayed
        # (captured) step, whose Python does not run, is named by its own count
        statuses = tuple(self._xp.concatenate([flat.status, flat.clock]) for flat in self._flats)
        _deferred.read_later(statuses, lambda values, where: self._settle(
            values, where, offsets, hyper))

    def _flat_plan(self, flat: _FlatBuffers) -> np.ndarray:
        """The host ``plan`` of one flat buffer (a row per parameter; zeros when frozen)."""
        plan = np.zeros((len(flat.params), N_PLAN))
        for row, param in enumerate(flat.params):
            if param.name not in self._frozen:
                plan[row] = self._plan(param)
        return plan

    def capture_key(self) -> tuple:
        """What a captured step bakes in from the host besides its device buffers: every
        flat buffer's plan and constants (learning rates, offsets, the frozen set) and the
        rule's settings. A training loop replays a graph only while this is unchanged (a
        new rate uploads a new plan, which a graph recorded before would not read), and
        captures no step while a parameter is frozen (its step offset moves every step)."""
        return (type(self).__name__, tuple(sorted(self._frozen)),
                tuple((self._flat_plan(flat).tobytes(),
                       tuple(self._constants(flat.dtype).values())) for flat in self._flats))

    def replayed_step(self) -> None:
        """Count on the host a step the device ran from a replayed graph (the Python of
        :meth:`step` did not run; the device's ``clock`` counted it)."""
        if self._frozen:
            raise RuntimeError("a step with frozen parameters is never replayed (their step "
                               "offsets move every step)")
        self.n_steps += 1

    def _gate_checks(self, gate: Any) -> Any:
        """``gate`` as :func:`refdml.gpu.optim.fused_step`'s ``checks``: an int64 array of
        first-bad indices (-1: passed) as :func:`refdml.gpu.optim.first_nonfinite` writes
        them, taken as it is; a boolean (host, or 0-d on the device) as one slot; None or
        True as none."""
        xp = self._xp
        if gate is None:
            return self._no_checks
        if isinstance(gate, (bool, np.bool_)):            # on the host already
            return self._no_checks if gate else xp.zeros(1, dtype=np.int64)
        if getattr(gate, "dtype", None) == np.int64 and getattr(gate, "ndim", 0) == 1:
            return gate
        return xp.where(gate, -1, 0).astype(np.int64).reshape(1)

    def _settle(self, values: np.ndarray, where: str, offsets: dict[str, int],
                hyper: dict[str, Any]) -> None:
        """The read statuses of one step, each followed by the device's step count after
        it (the step's number ``n_steps``): nothing to do when clean; else the step counts
        go back to before it, the statuses are cleared and :class:`NonFiniteStepError`
        names the first bad entry."""
        start, failure = 0, None
        n_steps = int(values[3])
        for flat in self._flats:
            status = values[start:start + 3].astype(np.int64)
            start += 4
            n = flat.values.shape[0]
            if failure is None and (status[BAD_GRAD] < n or status[BAD_UPDATE] < n
                                    or status[GATE] != 0):
                failure = (flat, status)
        if failure is None:
            return
        if n_steps - 1 < self.n_steps:        # the first failed step read puts the counts back
            self.n_steps = n_steps - 1
            self._step_offsets = offsets
        for flat in self._flats:
            flat.status[...] = self._xp.asarray(flat.clean_status())
            flat.clock[...] = self.n_steps
        flat, status = failure
        kind = type(self).__name__
        at = f" ({where})" if where else ""
        n = flat.values.shape[0]
        if status[BAD_GRAD] < n:
            param, index = flat.locate(int(status[BAD_GRAD]))
            raise NonFiniteStepError(
                f"{kind}: gradient of {param.name} is not finite (NaN or inf) at index {index}, "
                f"step {n_steps}{at}; no parameter was updated")
        if status[BAD_UPDATE] < n:
            param, index = flat.locate(int(status[BAD_UPDATE]))
            settings = ", ".join(f"{k} == {v!r}" for k, v in hyper.items())
            # Read at once, the inputs of that entry are still the step's: say which array.
            what = (self._overflowing(flat, int(status[BAD_UPDATE]), param, n_steps)
                    if not where else "its new value or a buffer")
            raise NonFiniteStepError(
                f"{kind} step {n_steps}{at} would make {param.name} not finite at index "
                f"{index} ({what} overflows to NaN or inf; {settings}); no parameter was "
                "updated: lower lr or weight_decay, or look for exploding gradients")
        raise NonFiniteStepError(
            f"{kind}: step {n_steps}{at} was refused by the caller's checks of the step (its "
            "loss or gradient is not finite); no parameter was updated")

    def reset_state(self, params: Iterable[Parameter]) -> None:
        """Forget the state of ``params`` (a subset of :attr:`params`): their buffers
        (momentum, Adam's moments) become zero and, for Adam/AdamW, their bias correction
        restarts (the next step is step 1 for them, as for a freshly built optimiser).
        The other parameters and ``n_steps`` are untouched. Used when parameters are
        re-initialised during training (ASAP's proxies at a new problem instance).
        """
        for param in self._own(params):
            for buffer in self._buffers[param.name].values():
                buffer[...] = 0
            self._step_offsets[param.name] = self.n_steps

    def _check_grad_shapes(self, params: list[Parameter]) -> None:
        for param in params:
            grad = param.grad
            if not isinstance(grad, type(param.value)):
                raise TypeError(
                    f"gradient of {param.name} must be a {type(param.value).__name__} like its "
                    f"value, got {_describe(grad)}"
                )
            if tuple(grad.shape) != param.shape:
                raise ValueError(
                    f"gradient of {param.name} has shape {tuple(grad.shape)}, "
                    f"must be {param.shape}"
                )
            if np.dtype(grad.dtype) != param.dtype:
                raise TypeError(
                    f"gradient of {param.name} has dtype {grad.dtype}, must be {param.dtype}"
                )

    def _overflowing(self, flat: _FlatBuffers, i: int, param: Parameter, n_steps: int) -> str:
        """Which array of entry ``i``'s proposal is not finite (the rule on that entry alone,
        by the per-parameter code: a few host reads, on the refusal's path only)."""
        xp = self._xp
        shadow = Parameter(flat.values[i:i + 1], param.name)
        shadow.grad = flat.grads[i:i + 1]
        names = self._buffers_for(self._hyperparameters())
        buffers = {name: buffer[i:i + 1] for name, buffer in zip(names, (flat.b1, flat.b2))}
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            proposal = self._proposal(shadow, buffers, n_steps)
        for key in proposal:          # the rule's order, as the per-parameter step named it
            if not bool(to_numpy(xp.isfinite(proposal[key])).all()):
                return "its new value" if key == "value" else f"its {key} buffer"
        return "its new value or a buffer"

    # -- subclass hooks ------------------------------------------------------------------
    @classmethod
    def _check_hyperparameters(cls, values: dict[str, Any], allow_zero_lr: bool,
                               max_multiplier: float = 1.0) -> dict:
        raise NotImplementedError

    @classmethod
    def _buffers_for(cls, hyperparameters: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _hyperparameters(self) -> dict[str, Any]:
        raise NotImplementedError

    def _set_hyperparameters(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(self, "_lr" if key == "lr" else key, value)

    def _proposal(self, param: Parameter, buffers: dict[str, Any], n_steps: int) -> dict:
        """New arrays ``{"value": ..., <buffer>: ...}`` of step ``n_steps``; changes nothing.
        The rule written per parameter, readably: the fused step's reference
        (tests/train/test_optim_fused.py)."""
        raise NotImplementedError

    #: The fused step's rule (:data:`refdml.gpu.optim.RULES`).
    _rule = ""

    def _plan(self, param: Parameter) -> list[float]:
        """The row of ``plan`` for ``param``, trained (:mod:`refdml.gpu.optim._layout`)."""
        raise NotImplementedError

    def _constants(self, dtype: np.dtype) -> dict[str, Any]:
        """The rule's constants (:data:`refdml.gpu.optim.SCALARS`) as numbers of ``dtype``."""
        raise NotImplementedError

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a bit-for-bit resume needs, on the host.

        ``{"optimizer": class name, "n_steps": int, "hyperparameters": {...},
        "params": {name: {"shape": tuple, "dtype": str, "lr_multiplier": float, "frozen":
        bool, "step_offset": int (when not 0), <buffer>: np.ndarray, ...}}}``; arrays are
        NumPy copies (from CuPy too), so the dict outlives the device. The group names are
        not recorded (the multipliers are what the arithmetic reads).
        """
        params = {}
        for param in self.params:
            entry: dict[str, Any] = {"shape": param.shape, "dtype": param.dtype.name,
                                     "lr_multiplier": self._multipliers[param.name],
                                     "frozen": param.name in self._frozen}
            if self._step_offsets[param.name]:
                entry["step_offset"] = self._step_offsets[param.name]
            for buffer_name, buffer in self._buffers[param.name].items():
                entry[buffer_name] = np.array(to_numpy(buffer), copy=True)
            params[param.name] = entry
        return {
            "optimizer": type(self).__name__,
            "n_steps": self.n_steps,
            "hyperparameters": self._hyperparameters(),
            "params": params,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; everything is checked before anything is set.

        Raises ``TypeError`` for a non-dict or wrong array dtype, ``ValueError`` for another
        optimiser's state, other parameter names, shapes, dtypes or learning-rate
        multipliers, or bad hyperparameters. A state without ``lr_multiplier`` (or
        ``frozen``) entries, from before parameter groups, reads as multiplier 1 (and not
        frozen). The frozen set is restored with the rest.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state must be a dict from state_dict(), got {_describe(state)}")
        missing = {"optimizer", "n_steps", "hyperparameters", "params"} - set(state)
        if missing:
            raise ValueError(f"state lacks the keys {sorted(missing)}")
        kind = type(self).__name__
        if state["optimizer"] != kind:
            raise ValueError(
                f"state['optimizer'] == {state['optimizer']!r}, this optimiser is {kind!r}"
            )
        n_steps = check_scalar(state["n_steps"], "state['n_steps']", low=0, integer=True)
        saved = state["params"]
        if not isinstance(saved, dict):
            raise TypeError(f"state['params'] must be a dict, got {_describe(saved)}")
        ours = [p.name for p in self.params]
        if set(saved) != set(ours):
            raise ValueError(
                "state['params'] names do not match this optimiser's parameters: "
                f"missing {sorted(set(ours) - set(saved))}, "
                f"unexpected {sorted(set(saved) - set(ours))}"
            )
        hyper = self._validated_hyperparameters(state["hyperparameters"])
        arrays: dict[str, dict[str, np.ndarray]] = {}
        offsets: dict[str, int] = {}
        frozen: set[str] = set()
        for param in self.params:
            entry = saved[param.name]
            where = f"state['params'][{param.name!r}]"
            if not isinstance(entry, dict):
                raise TypeError(f"{where} must be a dict, got {_describe(entry)}")
            if tuple(entry.get("shape", ())) != param.shape:
                raise ValueError(
                    f"{where} has shape {entry.get('shape')}, parameter {param.name} "
                    f"has shape {param.shape}"
                )
            if entry.get("dtype") != param.dtype.name:
                raise ValueError(
                    f"{where} has dtype {entry.get('dtype')!r}, parameter {param.name} "
                    f"has dtype {param.dtype.name!r}"
                )
            offsets[param.name] = check_scalar(
                entry.get("step_offset", 0), f"{where}['step_offset']", low=0, high=n_steps,
                integer=True)
            multiplier = check_scalar(entry.get("lr_multiplier", 1.0),
                                      f"{where}['lr_multiplier']", low=0.0, low_inclusive=False)
            if multiplier != self._multipliers[param.name]:
                raise ValueError(
                    f"{where} has lr_multiplier == {multiplier!r}, parameter {param.name} has "
                    f"lr_multiplier == {self._multipliers[param.name]!r} in this optimiser")
            is_frozen = entry.get("frozen", False)
            if not isinstance(is_frozen, (bool, np.bool_)):
                raise TypeError(f"{where}['frozen'] must be a bool, got {_describe(is_frozen)}")
            if is_frozen:
                frozen.add(param.name)
            arrays[param.name] = {}
            for buffer_name in self._buffers[param.name]:
                if buffer_name not in entry:
                    raise ValueError(f"{where} lacks the buffer {buffer_name!r}")
                host = entry[buffer_name]
                if not isinstance(host, np.ndarray) or host.dtype != param.dtype:
                    raise TypeError(
                        f"{where}[{buffer_name!r}] must be a NumPy {param.dtype.name} array, "
                        f"got {_describe(host)}"
                    )
                if host.shape != param.shape:
                    raise ValueError(
                        f"{where}[{buffer_name!r}] has shape {host.shape}, must be {param.shape}"
                    )
                if not np.all(np.isfinite(host)):
                    raise ValueError(f"{where}[{buffer_name!r}] is not finite")
                arrays[param.name][buffer_name] = host
        if len(frozen) == len(self.params):
            raise ValueError("state freezes every parameter; an optimiser needs one to train")
        # Everything checked: now set.
        self._set_hyperparameters(hyper)
        self.n_steps = n_steps
        for flat in self._flats:
            flat.clock[...] = n_steps
        self._step_offsets = offsets
        self._frozen = frozen
        for name, buffers in arrays.items():
            for buffer_name, host in buffers.items():
                # into the views of the flat buffers the fused step updates
                self._buffers[name][buffer_name][...] = self._xp.asarray(host)

    def _validated_hyperparameters(self, hyper: Any) -> dict[str, Any]:
        if not isinstance(hyper, dict):
            raise TypeError(
                f"state['hyperparameters'] must be a dict, got {_describe(hyper)}"
            )
        expected = set(self._hyperparameters())
        if set(hyper) != expected:
            raise ValueError(
                f"state['hyperparameters'] has keys {sorted(hyper)}, "
                f"{type(self).__name__} has {sorted(expected)}"
            )
        # The constructor's checks (named errors); a schedule may have left lr at 0.
        checked = self._check_hyperparameters(hyper, allow_zero_lr=True,
                                              max_multiplier=self._max_multiplier)
        ours = self._buffers_for(self._hyperparameters())
        theirs = self._buffers_for(checked)
        if ours != theirs:
            raise ValueError(
                f"state's hyperparameters keep the buffers {list(theirs)}, this "
                f"optimiser keeps {list(ours)} (e.g. momentum zero in one, not the other)"
            )
        return checked

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._hyperparameters().items())
        groups = "" if len(self._groups) == 1 and self._max_multiplier == 1.0 else (
            ", groups: " + ", ".join(f"{g.name} x{g.lr_multiplier:g} ({len(g.params)})"
                                     for g in self._groups))
        return f"{type(self).__name__}({len(self.params)} parameters, {args}{groups})"


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, Nesterov and (L2) weight decay.

    ``v = momentum * v + (g + weight_decay * w)``; ``w -= lr * v`` (or, with Nesterov,
    ``w -= lr * (g' + momentum * v)`` where ``g' = g + weight_decay * w``). PyTorch's
    ``torch.optim.SGD`` with ``dampening=0``.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float
        Learning rate, finite and > 0 (no default: there is no sensible one).
    momentum : float, default 0
        In [0, 1); 0 keeps no velocity buffer.
    weight_decay : float, default 0
        L2 coefficient added to the gradient, finite and >= 0.
    nesterov : bool, default False
        Nesterov momentum; needs ``momentum > 0``.
    """

    def __init__(
        self,
        params: Iterable[Parameter],
        *,
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
    ) -> None:
        self._set_hyperparameters(self._check_hyperparameters(
            {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
             "nesterov": nesterov},
            allow_zero_lr=False,
        ))
        super().__init__(params, lr=lr)

    @classmethod
    def _buffers_for(cls, hyperparameters: dict[str, Any]) -> tuple[str, ...]:
        return ("velocity",) if hyperparameters["momentum"] > 0 else ()

    def _hyperparameters(self) -> dict[str, Any]:
        return {"lr": self._lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov}

    @classmethod
    def _check_hyperparameters(cls, values: dict[str, Any], allow_zero_lr: bool,
                               max_multiplier: float = 1.0) -> dict:
        lr = _check_lr(values["lr"], allow_zero=allow_zero_lr)
        momentum = check_scalar(values["momentum"], "momentum", low=0.0, high=1.0,
                                high_inclusive=False)
        weight_decay = check_scalar(values["weight_decay"], "weight_decay", low=0.0)
        nesterov = values["nesterov"]
        if not isinstance(nesterov, (bool, np.bool_)):
            raise TypeError(f"nesterov must be a bool, got {_describe(nesterov)}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov == True needs momentum > 0, got momentum == 0.0")
        return {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                "nesterov": bool(nesterov)}

    _rule = "sgd"

    def _plan(self, param: Parameter) -> list[float]:
        row = [0.0] * N_PLAN
        row[ACTIVE], row[LR] = 1.0, self._lr_of(param)
        return row

    def _constants(self, dtype: np.dtype) -> dict[str, Any]:
        values = (self.momentum, self.weight_decay, float(self.nesterov),
                  float(self.momentum > 0))
        return {key: dtype.type(value) for key, value in zip(SCALARS["sgd"], values)}

    def _proposal(self, param: Parameter, buffers: dict[str, Any], n_steps: int) -> dict:
        w = param.value
        g = param.grad
        proposal = {}
        if self.weight_decay != 0:
            g = g + self.weight_decay * w  # a new array: param.grad is left as it was
        if self.momentum > 0:
            v = buffers["velocity"] * self.momentum
            v += g
            proposal["velocity"] = v
            g = g + self.momentum * v if self.nesterov else v
        proposal["value"] = w - self._lr_of(param) * g
        return proposal


class Adam(Optimizer):
    """Adam (Kingma & Ba 2015, Algorithm 1), bias-corrected; PyTorch's ``torch.optim.Adam``.

    Parameters
    ----------
    params : iterable of Parameter
    lr : float, default 1e-3
        Step size (the paper's alpha), finite and > 0.
    betas : (float, float), default (0.9, 0.999)
        Decay rates of the first and second moment estimates, each in [0, 1).
    eps : float, default 1e-8
        The paper's epsilon, added to ``sqrt(v_hat)`` in the denominator; finite, > 0.
    weight_decay : float, default 0
        Coupled L2 coefficient (``g += weight_decay * w``), finite, >= 0. For decoupled decay use
        :class:`AdamW`.
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Parameter],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        self._set_hyperparameters(self._check_hyperparameters(
            {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay},
            allow_zero_lr=False,
        ))
        super().__init__(params, lr=lr)

    @classmethod
    def _buffers_for(cls, hyperparameters: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _hyperparameters(self) -> dict[str, Any]:
        return {"lr": self._lr, "betas": self.betas, "eps": self.eps,
                "weight_decay": self.weight_decay}

    @classmethod
    def _check_hyperparameters(cls, values: dict[str, Any], allow_zero_lr: bool,
                               max_multiplier: float = 1.0) -> dict:
        lr = _check_lr(values["lr"], allow_zero=allow_zero_lr)
        betas = _check_betas(values["betas"])
        eps = check_scalar(values["eps"], "eps", low=0.0, low_inclusive=False)
        weight_decay = check_scalar(values["weight_decay"], "weight_decay", low=0.0)
        if cls._decoupled and max_multiplier == 1.0 and lr * weight_decay > 1.0:
            raise ValueError(
                f"lr * weight_decay == {lr * weight_decay:g} (lr == {lr!r}, weight_decay == "
                f"{weight_decay!r}), must be <= 1: {cls.__name__} multiplies the weights by "
                "1 - lr * weight_decay every step")
        if cls._decoupled and (lr * max_multiplier) * weight_decay > 1.0:
            product = (lr * max_multiplier) * weight_decay
            raise ValueError(
                f"lr * lr_multiplier * weight_decay == {product:g} (lr == {lr!r}, the largest "
                f"lr_multiplier == {max_multiplier!r}, weight_decay == {weight_decay!r}), must "
                f"be <= 1: {cls.__name__} multiplies the weights by 1 - lr * lr_multiplier * "
                "weight_decay every step")
        return {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}

    @property
    def _rule(self) -> str:
        return "adamw" if self._decoupled else "adam"

    def _plan(self, param: Parameter) -> list[float]:
        lr = self._lr_of(param)
        row = [0.0] * N_PLAN
        row[ACTIVE], row[LR], row[DECAY] = 1.0, lr, 1.0 - lr * self.weight_decay
        row[OFFSET] = self._step_offsets[param.name]
        row[BETA1], row[BETA2] = self.betas
        return row

    def _constants(self, dtype: np.dtype) -> dict[str, Any]:
        beta1, beta2 = self.betas
        values = (beta1, 1.0 - beta1, beta2, 1.0 - beta2, self.eps, self.weight_decay)
        return {key: dtype.type(value) for key, value in zip(SCALARS["adam"], values)}

    def _proposal(self, param: Parameter, buffers: dict[str, Any], n_steps: int) -> dict:
        xp = self._xp
        beta1, beta2 = self.betas
        w = param.value
        g = param.grad
        lr = self._lr_of(param)
        if self.weight_decay != 0:
            if self._decoupled:
                w = w * (1.0 - lr * self.weight_decay)
            else:
                g = g + self.weight_decay * w
        m = buffers["exp_avg"] * beta1
        m += (1.0 - beta1) * g
        g_sq = g * g
        g_sq *= 1.0 - beta2
        v = buffers["exp_avg_sq"] * beta2
        v += g_sq
        t = n_steps - self._step_offsets[param.name]   # its own steps since a reset_state
        bias_correction1 = 1.0 - beta1**t
        bias_correction2 = 1.0 - beta2**t
        update = xp.sqrt(v)
        update /= math.sqrt(bias_correction2)
        update += self.eps
        update = m / update
        update *= lr / bias_correction1
        return {"value": w - update, "exp_avg": m, "exp_avg_sq": v}


class AdamW(Adam):
    """AdamW (Loshchilov & Hutter 2019): Adam with decoupled weight decay.

    ``w *= 1 - lr * weight_decay`` before the Adam step (which then has no L2 term);
    PyTorch's ``torch.optim.AdamW``, whose default ``weight_decay=1e-2`` this follows.
    ``weight_decay`` is finite, >= 0 and at most ``1 / lr`` (the factor stays in [0, 1];
    a schedule that raises ``lr`` is held to it too). Other parameters as :class:`Adam`.
    """

    _decoupled = True

    def __init__(
        self,
        params: Iterable[Parameter],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
