r"""The one training loop of refdml: epochs, steps, the divergence rule, problem instances,
evaluation and model selection. What becomes of the results is a sink's business.

:class:`TrainingLoop` runs the epochs; a :class:`TrainingSink` is told, in this order:

- ``start(loop)``: once, before the epoch-0 evaluation (not again after a resume);
- ``end_epoch(loop, row)``: after every epoch (0 included), with its complete row and
  the loop's state (epoch, best, schedule, early stopping) already updated;
- ``new_best(loop, row)``: right after ``end_epoch`` when that epoch's ``select`` value
  beat every earlier selectable epoch's;
- ``end(loop)``: when :meth:`TrainingLoop.fit` returns (all epochs done or an early stop),
  not when it raises;
- ``diverged_note(loop) -> str``: appended to the :class:`TrainingDiverged` message (where
  the last good state is).

Two sinks exist: :class:`~refdml.train.trainer.DiskSink` (``config.json``, ``log.jsonl``,
``checkpoint.npz``, ``best.npz``; :class:`~refdml.train.trainer.Trainer` is this loop with
it, plus resume) and :class:`MemorySink` (the rows and the best parameters in memory;
:func:`refdml.reproduce._train.fit` runs the loop with it, as a grid of short runs on remote
workers wants no files).

A row: ``epoch``, ``train_loss`` (None for epoch 0, the untrained model), ``lr`` (the rate
the epoch trained with), ``n_steps`` (optimiser steps so far), the evaluation's entries,
``best_<select>`` (with a ``select``), with problem instances (``instance_every`` or
``instance_patience``) ``instance`` (how many instances have started: 0 at epoch 0, 1 from
epoch 1 on, ...), and ``seconds``. The evaluation is ``evaluate()``
when given, else the built-in one: MAP@R, P@1 and R@1 of the validation (``val_``) and test
(``test_``) data and, when the objective has ``covering_radius``, ``proxy_covering_radius``
on the training embeddings.

Warm-up (GSP supp. and ASAP: "1 epoch warm-up training of the embedding layer"): with
``warmup_epochs = W > 0``, epochs 1..W train only ``warmup_params`` (the optimiser freezes
every other parameter: :meth:`~refdml.train.optim.Optimizer.freeze`), and from epoch W + 1
on everything trains (the loop unfreezes what it froze). The loop sets this at the start of
every epoch, so a resumed run freezes as the uninterrupted one did. A parameter that first
trains at epoch W + 1 takes Adam's step 1 there (its own step count, as PyTorch keeps it).
``warmup_params`` is usually :func:`~refdml.train.models.embedding_layer_parameters` of the
model plus the objective's parameters (the proxies), as Proxy-Anchor's public training
code does.

Divergence: a NaN or inf loss is refused before the backward; the objective's gradient
of the outputs is checked after it (:class:`~refdml.exceptions.NonFiniteGradient`, naming
the first bad entry), and the optimiser refuses a non-finite gradient or update before
touching any parameter (:class:`~refdml.train.optim.NonFiniteStepError`, a
``NonFiniteGradient``). The loop turns each into :class:`TrainingDiverged` naming the
epoch and step; the parameters are those of the last good step. A batch's floating inputs
are checked on the host before they go to the device (``ValueError`` naming the step and
the entry).

On a GPU (``device="cuda"``) a step reads nothing back. It runs inside a
:func:`refdml._deferred.deferring` scope: the loss stays on the device; the loss and the
objective's gradient of the outputs are checked there (one launch each, no read) and
gate the optimiser's fused update, whose own pass checks every parameter gradient and
update; the operators hand their data checks of the step's intermediates to these (a
non-finite intermediate reaches the loss or a gradient). Every ``log_every`` steps and at
the end of the epoch the loop reads, in one transfer, the checks and losses since the last
read: a failure is raised then, as :class:`TrainingDiverged` naming the epoch and step
where it happened, the tensor and its first bad entry; the device made no update from that
step on (the optimiser's status is sticky) and the optimiser's step count is put back, so
the parameters are still those of the last good step. Nothing is dropped, only read
later. The progress bar's loss changes at those reads. With ``capture=True`` the device
step is recorded once per shape as a CUDA graph and replayed (:mod:`refdml.train._capture`:
what is staged before the captured region, how replayed steps' checks are read and named).
The loop also says once per
process, on stderr (with ``progress``), that the first epoch compiles the kernels (or
loads them from their caches); ``REFDML_QUIET=1`` silences it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from refdml._deferred import DeferredReads, check_finite_later, deferring, read_later
from refdml.gpu.optim import first_nonfinite
from refdml.gpu._support.notice import silenced
from refdml._validation import (_describe, as_label_array, check_choice, check_flag,
                                check_float_dtype, check_scalar)
from refdml._backend import side_thread, to_numpy
from refdml.exceptions import NonFiniteGradient
from refdml.train._capture import StepCapture
from refdml.train._parameter import Parameter
from refdml.train.data import PKBatchSampler
from refdml.train.optim import Optimizer
from refdml.train.schedules import Schedule

__all__ = ["TrainingLoop", "TrainingSink", "MemorySink", "TrainingDiverged", "METRIC_KEYS"]

#: Retrieval metrics of the built-in evaluation (key suffix -> key of ``retrieval_metrics``).
METRIC_KEYS = {
    "map_at_r": "mean_average_precision_at_r",
    "precision_at_1": "precision_at_1",
    "recall_at_1": "recall_at_1",
}
_INPUT_FIELDS = ("token_ids", "images", "features", "inputs")
#: Row entries the loop writes itself (an evaluation may not use these names).
_ROW_KEYS = ("epoch", "train_loss", "lr", "n_steps", "instance", "seconds")

# The first-epoch line on a GPU is printed once per process (_note_gpu_compilation).
_GPU_NOTE_LOCK = threading.Lock()
_GPU_NOTED: list[bool] = []


def _note_gpu_compilation() -> None:
    """Say once per process, before a loop's first work on a GPU, that the first epoch
    compiles its kernels (CuPy's through NVRTC, refdml's Numba ones at their first launch)
    or reads them back from their disk caches, so that it is slower than the later ones.
    A Numba kernel that compiles slowly also prints its own line
    (:mod:`refdml.gpu._support.notice`)."""
    with _GPU_NOTE_LOCK:
        if _GPU_NOTED:
            return
        _GPU_NOTED.append(True)
    cupy_cache = os.environ.get("CUPY_CACHE_DIR") or os.path.join("~", ".cupy", "kernel_cache")
    print("refdml: the first epoch on the GPU compiles its kernels, or loads them from the "
          f"caches (CuPy's in {cupy_cache}, Numba's in NUMBA_CACHE_DIR where set, else "
          "the __pycache__ folders of refdml/gpu): it takes longer than the later epochs", file=sys.stderr,
          flush=True)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _check_finite_inputs(inputs: np.ndarray, where: str) -> None:
    """``ValueError`` naming the step and the first non-finite entry of a batch's floating
    inputs: checked on the host before they go to the device (free there)."""
    if not np.issubdtype(inputs.dtype, np.floating):
        return
    finite = np.isfinite(inputs)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise ValueError(f"the training inputs of {where} are not finite: "
                         f"{inputs[index]} at index {index} of the batch")


class TrainingDiverged(RuntimeError, FloatingPointError):
    """A NaN or inf loss or gradient; the parameters are those of the last good step.

    Also a ``FloatingPointError``, what the in-memory loop of :mod:`refdml.reproduce`
    raised for a non-finite loss before it ran on :class:`TrainingLoop`.
    """


class TrainingSink:
    """What a :class:`TrainingLoop` does with its results (module docstring); every method
    does nothing here: a sink overrides the ones it needs."""

    def start(self, loop: TrainingLoop) -> None:
        """Before the epoch-0 evaluation of a run that was not resumed."""

    def end_epoch(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        """After every epoch, with its row; ``loop.epoch`` is that epoch."""

    def new_best(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        """After :meth:`end_epoch` of an epoch that is the new best (``loop.best_epoch``)."""

    def end(self, loop: TrainingLoop) -> None:
        """When :meth:`TrainingLoop.fit` returns."""

    def diverged_note(self, loop: TrainingLoop) -> str:
        """Text appended to the :class:`TrainingDiverged` message (e.g. ``"; the last good
        checkpoint is ..."``)."""
        return ""


class MemorySink(TrainingSink):
    """The rows and the best epoch's parameters, kept in memory.

    Parameters
    ----------
    restore_best : bool, default False
        At :meth:`end`, put the best epoch's parameter values back into the parameters
        (when the last epoch is not the best), so whatever the caller measures afterwards
        is the selected model's.

    Attributes
    ----------
    rows : list of dict
        Every row the loop reported, in order (what :class:`~refdml.train.trainer.DiskSink`
        appends to ``log.jsonl``).
    best_epoch : int or None
        The last epoch reported to :meth:`new_best` (None before any).
    best_parameters : dict of str to ndarray
        Host copies of every optimised parameter's value at ``best_epoch`` (what
        ``best.npz`` holds under ``param/``).
    """

    def __init__(self, *, restore_best: bool = False) -> None:
        self.restore_best = check_flag(restore_best, "restore_best")
        self.rows: list[dict[str, Any]] = []
        self.best_epoch: int | None = None
        self.best_parameters: dict[str, np.ndarray] = {}

    def end_epoch(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        self.rows.append(dict(row))

    def new_best(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        self.best_epoch = loop.epoch
        self.best_parameters = {name: np.array(to_numpy(p.value), copy=True)
                                for name, p in loop.parameters.items()}

    def end(self, loop: TrainingLoop) -> None:
        if self.restore_best and self.best_epoch is not None and self.best_epoch != loop.epoch:
            xp = loop._xp
            for name, value in self.best_parameters.items():
                loop.parameters[name].value[...] = xp.asarray(value)

    def curves(self, keys: Any = None) -> dict[str, list[Any]]:
        """``{key: [value of each row]}`` for ``keys`` (default: every key of the first row)."""
        if not self.rows:
            return {}
        keys = list(self.rows[0]) if keys is None else list(keys)
        return {key: [row.get(key) for row in self.rows] for key in keys}


def _check_retrieval_labels(labels: np.ndarray, name: str) -> None:
    """Same-set retrieval needs a class with two samples (a query with a true reference)."""
    if labels.shape[0] == 0 or np.unique(labels, return_counts=True)[1].max() < 2:
        raise ValueError(
            f"{name} has no class with two or more samples ({labels.shape[0]} sample(s)): "
            "same-set retrieval (MAP@R, P@1, R@1) needs a query with a class mate")


def _as_dataset(data: Any, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` host arrays of a data set object or an ``(inputs, labels)`` pair."""
    if isinstance(data, tuple) and len(data) == 2:
        inputs, labels = data
    else:
        field = next((f for f in _INPUT_FIELDS if hasattr(data, f)), None)
        if field is None or not hasattr(data, "labels"):
            raise TypeError(
                f"{name} must be an (inputs, labels) pair or a data set with .labels and one "
                f"of {_INPUT_FIELDS} (TokenSamples, CollageSplit, FeatureSet), got "
                f"{_describe(data)}"
            )
        inputs, labels = getattr(data, field), data.labels
    inputs, labels = np.asarray(inputs), np.asarray(labels)
    if inputs.dtype == bool or not (np.issubdtype(inputs.dtype, np.floating)
                                    or np.issubdtype(inputs.dtype, np.integer)):
        raise TypeError(f"{name} inputs must hold real numbers (floating inputs or integer "
                        f"token ids), got dtype {inputs.dtype}")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{name} labels must be a 1-D integer array, got {_describe(labels)}")
    if inputs.ndim < 1 or inputs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{name} has {inputs.shape[0] if inputs.ndim else 0} inputs and "
            f"{labels.shape[0]} labels; they must match"
        )
    return inputs, labels


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the platform tells it, else
    ``os.cpu_count()``): with one, :class:`TrainingLoop`'s side thread is left off."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class TrainingLoop:
    """Train ``model`` with ``objective`` and ``optimizer``, reporting to ``sink``.

    The arguments shared with :class:`~refdml.train.trainer.Trainer` mean what they mean
    there (see its docstring); ``val_data`` is required unless ``evaluate`` is given.

    Parameters
    ----------
    evaluate : callable, optional
        ``evaluate() -> dict`` of the row entries of an epoch (called after each epoch,
        epoch 0 included); None: the built-in evaluation of ``val_data`` and ``test_data``
        (module docstring).
    select : str or None, default "val_map_at_r"
        The evaluation entry that selects the best epoch (higher is better), drives early
        stopping and a schedule whose ``uses_metric``; None: no selection.
    select_from : int >= 0, default 0
        The first epoch that may be selected: 0 lets the untrained model be the best (as
        ``best.npz``), 1 selects among trained models only (the papers' protocol).
    instance_patience : int >= 1, optional
        Start problem instances on a validation plateau (ASAP Sec. 4.4: "early stopping
        patience of 3 to pass the next projection") instead of every ``instance_every``
        epochs (give at most one of the two): the first instance starts at epoch 1, and a
        new one at the epoch after ``instance_patience`` epochs in a row without a strict
        improvement of the ``select`` value over the current instance's own best, which
        starts at the value evaluated just before the instance's first epoch. Needs
        ``select`` and an objective with ``new_problem_instance``. The run's early stopping
        is unchanged (over the run's best): with ``instance_patience = k`` and
        ``early_stopping_patience = 2k`` (and ``early_stopping_min_delta = 0``), the run
        stops exactly when an instance after the first has not beaten the run's best within
        its first k epochs: it started k epochs after the previous instance's best, which
        was the run's last improvement (a previous instance that never beat the run's best
        ran into the run's patience first). :attr:`instance_starts` lists the epochs that
        started an instance, and each row's ``instance`` counts them (module docstring).
    instance_embed : callable, optional
        ``instance_embed() -> embeddings`` of all training samples, given to the objective's
        ``new_problem_instance``; None: :meth:`embed` of the training inputs.
    sink : TrainingSink, optional
        Told of the start, each epoch, each new best and the end; None: a sink that keeps
        nothing.
    warmup_epochs : int >= 0, default 0
        Epochs 1..``warmup_epochs`` train only ``warmup_params`` (module docstring); at most
        ``epochs``.
    warmup_params : iterable of Parameter, optional
        Required when ``warmup_epochs > 0`` (and refused when it is 0): a non-empty subset
        of the optimiser's parameters.
    log_every : int >= 1, default 20
        On a GPU, the steps between two host reads of the steps' deferred checks and
        losses (module docstring, "On a GPU"); also how often the progress bar's loss
        changes there. On the CPU every step is read (reads are free).
    capture : bool, default False
        On a GPU (``device="cuda"``), record the step once per shape as a CUDA graph and
        replay it (:mod:`refdml.train._capture`): each key of shapes runs uncaptured twice
        first, a batch of another shape (the epoch's last) and every step while a
        parameter is frozen run uncaptured, and the checks and losses of replayed steps
        are read every ``log_every`` steps, as the uncaptured ones are. The trajectory is
        the uncaptured loop's. The objective draws its host randomness before the step
        (its ``host_draws``) and lists what it uploads (its ``staged_uploads``).
    """

    def __init__(
        self, model: Any, objective: Any, optimizer: Optimizer, *,
        schedule: Schedule | None = None, train_sampler: PKBatchSampler, train_data: Any,
        val_data: Any = None, test_data: Any = None, epochs: int,
        early_stopping_patience: int | None = None, early_stopping_min_delta: float = 0.0,
        early_stopping_target: float | None = None, blas_threads: int | None = 1,
        side_thread: bool = True,
        seed: int, dtype: Any, device: str = "cpu", progress: bool = True,
        after_step: Callable[[], None] | None = None, eval_batch_size: int = 1024,
        instance_every: int | None = None, instance_patience: int | None = None,
        instance_embed: Callable[[], Any] | None = None,
        evaluate: Callable[[], dict[str, Any]] | None = None,
        select: str | None = "val_map_at_r", select_from: int = 0,
        sink: TrainingSink | None = None, warmup_epochs: int = 0,
        warmup_params: Any = None, log_every: int = 20, capture: bool = False,
    ) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be an Optimizer, got {_describe(optimizer)}")
        if schedule is not None and not isinstance(schedule, Schedule):
            raise TypeError(f"schedule must be a Schedule or None, got {_describe(schedule)}")
        if schedule is not None and schedule.optimizer is not optimizer:
            raise ValueError("schedule drives another optimiser than optimizer")
        for method in ("forward", "backward"):
            if not callable(getattr(model, method, None)):
                raise TypeError(f"model has no method {method}(), got {_describe(model)}; "
                                "see refdml.train.layers")
        if not isinstance(train_sampler, PKBatchSampler):
            raise TypeError(
                f"train_sampler must be a PKBatchSampler, got {_describe(train_sampler)}")
        for method in ("parameters", "forward", "backward"):
            if not callable(getattr(objective, method, None)):
                raise TypeError(f"objective has no method {method}(); see refdml.train.objectives")
        for name, hook in (("after_step", after_step), ("evaluate", evaluate),
                           ("instance_embed", instance_embed)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be callable or None, got {_describe(hook)}")
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.schedule, self.train_sampler, self.after_step = schedule, train_sampler, after_step
        self.train_x, self.train_y = _as_dataset(train_data, "train_data")
        if val_data is None and evaluate is None:
            raise TypeError("val_data is required unless evaluate is given (the built-in "
                            "evaluation ranks the validation data)")
        self.val_x, self.val_y = (None, None) if val_data is None else _as_dataset(
            val_data, "val_data")
        self.test_x, self.test_y = (None, None) if test_data is None else _as_dataset(
            test_data, "test_data")
        if val_data is not None:
            _check_retrieval_labels(self.val_y, "val_data")
        if test_data is not None:
            _check_retrieval_labels(self.test_y, "test_data")
        if train_sampler._labels.shape != self.train_y.shape or not np.array_equal(
                train_sampler._labels, self.train_y):
            raise ValueError("train_sampler was built over other labels than train_data's")
        self.epochs = check_scalar(epochs, "epochs", low=0, integer=True)
        self.early_stopping_patience = None if early_stopping_patience is None else check_scalar(
            early_stopping_patience, "early_stopping_patience", low=1, integer=True)
        self.early_stopping_min_delta = float(check_scalar(
            early_stopping_min_delta, "early_stopping_min_delta", low=0.0))
        self.early_stopping_target = None if early_stopping_target is None else float(
            check_scalar(early_stopping_target, "early_stopping_target", low=0.0, high=1.0,
                         low_inclusive=False))
        self.blas_threads = None if blas_threads is None else check_scalar(
            blas_threads, "blas_threads", low=1, integer=True)
        self.side_thread = check_flag(side_thread, "side_thread")
        self.seed = check_scalar(seed, "seed", low=0, integer=True)
        self.dtype = check_float_dtype(dtype)
        self.device = check_choice(device, "device", ("cpu", "cuda"))
        self.progress = check_flag(progress, "progress")
        self.log_every = check_scalar(log_every, "log_every", low=1, integer=True)
        self.capture = check_flag(capture, "capture")
        if self.capture and self.device != "cuda":
            raise ValueError(f"capture == True records the step as a CUDA graph: it needs "
                             f"device == 'cuda', got {self.device!r}")
        self._step_capture: StepCapture | None = None
        self._slots: dict[int, Any] = {}
        self.eval_batch_size = check_scalar(eval_batch_size, "eval_batch_size", low=1,
                                            integer=True)
        self.instance_every = None if instance_every is None else check_scalar(
            instance_every, "instance_every", low=1, integer=True)
        self.instance_patience = None if instance_patience is None else check_scalar(
            instance_patience, "instance_patience", low=1, integer=True)
        if self.instance_every is not None and self.instance_patience is not None:
            raise ValueError(f"instance_every == {self.instance_every} and instance_patience "
                             f"== {self.instance_patience}: a run starts its problem "
                             "instances by one rule; give one of them")
        for name in ("instance_every", "instance_patience"):
            if getattr(self, name) is not None and not callable(
                    getattr(objective, "new_problem_instance", None)):
                raise TypeError(f"{name} needs an objective with new_problem_instance(); "
                                f"{type(objective).__name__} has none")
        self._evaluate, self._instance_embed = evaluate, instance_embed
        if select is not None and not isinstance(select, str):
            raise TypeError(f"select must be a str or None, got {_describe(select)}")
        if select is None and (early_stopping_patience is not None
                               or early_stopping_target is not None
                               or (schedule is not None and schedule.uses_metric)):
            raise ValueError("select == None, but early stopping and a schedule that uses a "
                             "metric need the metric that select names")
        if select is None and self.instance_patience is not None:
            raise ValueError(f"select == None, but instance_patience == "
                             f"{self.instance_patience} waits on the metric that select names")
        self.select = select
        self.select_from = check_scalar(select_from, "select_from", low=0, integer=True)
        if sink is not None and not isinstance(sink, TrainingSink):
            raise TypeError(f"sink must be a TrainingSink or None, got {_describe(sink)}")
        self.sink = TrainingSink() if sink is None else sink
        self.parameters = {p.name: p for p in optimizer.params}
        self.warmup_epochs, self.warmup_params = self._check_warmup(warmup_epochs,
                                                                    warmup_params)
        for p in self.parameters.values():
            if p.dtype != self.dtype:
                raise TypeError(f"parameter {p.name} is {p.dtype.name}, dtype is {self.dtype.name}")
        if self.device == "cuda":
            import cupy

            self._xp = cupy
        else:
            self._xp = np
        self.rng = np.random.default_rng(self.seed)
        self.epoch = 0            # the last finished epoch (0: the untrained model evaluated)
        self.started = False      # epoch 0 evaluated (or resumed)
        self.best_metric = -math.inf
        self.best_epoch = 0
        self.improved_metric = -math.inf   # best metric of the epochs that improved by min_delta
        self.improved_epoch = 0
        self.stopped_early = False
        # Problem instances (instance_every or instance_patience): the epochs that started
        # one, and for instance_patience the current instance's best select value, the
        # epoch of that best (the instance's start counts: the epoch before its first) and
        # the epoch the next instance starts at (None: not due yet).
        self.instance_starts: list[int] = []
        self.instance_best_metric = -math.inf
        self.instance_best_epoch = 0
        self.next_instance_epoch: int | None = 1 if self.instance_patience is not None else None
        self.evaluation_keys: tuple[str, ...] = ()   # the last evaluation's entries, in order

    def _check_warmup(self, warmup_epochs: Any, warmup_params: Any
                      ) -> tuple[int, tuple[Any, ...]]:
        """``(warmup_epochs, warmup_params as a tuple)``, checked (``()`` without a warm-up)."""
        warmup_epochs = check_scalar(warmup_epochs, "warmup_epochs", low=0, integer=True)
        if warmup_epochs > self.epochs:
            raise ValueError(f"warmup_epochs == {warmup_epochs}, must be <= epochs == "
                             f"{self.epochs}")
        if warmup_epochs == 0:
            if warmup_params is not None:
                raise ValueError("warmup_params is given, but warmup_epochs == 0 (no warm-up "
                                 "would use it); leave it None or set warmup_epochs")
            return 0, ()
        if warmup_params is None:
            raise ValueError(f"warmup_epochs == {warmup_epochs} needs warmup_params (the "
                             "parameters the warm-up trains, e.g. embedding_layer_parameters("
                             "model) and the objective's)")
        if isinstance(warmup_params, (Parameter, dict, str, bytes)) or not isinstance(
                warmup_params, Iterable):
            raise TypeError(f"warmup_params must be an iterable of Parameter objects, got "
                            f"{_describe(warmup_params)}")
        warmup_params = tuple(warmup_params)
        if not warmup_params:
            raise ValueError("warmup_params is empty; a warm-up must train some parameter")
        ours = {id(p) for p in self.optimizer.params}
        for index, param in enumerate(warmup_params):
            if not isinstance(param, Parameter):
                raise TypeError(f"warmup_params[{index}] must be a Parameter, got "
                                f"{_describe(param)}")
            if id(param) not in ours:
                raise ValueError(f"warmup_params[{index}] ({param.name}) is not a parameter "
                                 "of the optimiser")
        return warmup_epochs, warmup_params

    def _set_warmup(self, epoch: int) -> None:
        """Freeze what epoch ``epoch`` does not train (a warm-up epoch) or unfreeze it."""
        if not self.warmup_epochs:
            return
        trained = {id(p) for p in self.warmup_params}
        others = [p for p in self.optimizer.params if id(p) not in trained]
        if epoch <= self.warmup_epochs:
            self.optimizer.freeze(others)
        else:
            self.optimizer.unfreeze(others)

    # -- configuration -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """Every hyperparameter the loop knows (plain JSON types)."""
        objective_config = (self.objective.config() if callable(getattr(
            self.objective, "config", None)) else repr(self.objective))
        sampler = self.train_sampler
        optimizer = {"name": type(self.optimizer).__name__,
                     **self.optimizer._hyperparameters(), "lr": self.optimizer.lr
                     if self.schedule is None else self.schedule.base_lr}
        # Recorded only when they change the arithmetic, so the config of a run without
        # them reads (and resumes) as before parameter groups, warm-ups and instance
        # patience existed.
        if any(g.lr_multiplier != 1.0 for g in self.optimizer.param_groups):
            optimizer["param_groups"] = [
                {"name": g.name, "lr_multiplier": g.lr_multiplier, "params": list(g.params)}
                for g in self.optimizer.param_groups]
        patience = ({} if self.instance_patience is None
                    else {"instance_patience": self.instance_patience})
        warmup = {} if not self.warmup_epochs else {"warmup": {
            "epochs": self.warmup_epochs, "params": [p.name for p in self.warmup_params]}}
        return {
            "epochs": self.epochs,
            "early_stopping_patience": self.early_stopping_patience,
            "early_stopping_min_delta": self.early_stopping_min_delta,
            "early_stopping_target": self.early_stopping_target,
            "seed": self.seed,
            "dtype": self.dtype.name,
            "device": self.device,
            "eval_batch_size": self.eval_batch_size,
            "instance_every": self.instance_every,
            **patience,
            "after_step": None if self.after_step is None else getattr(
                self.after_step, "__name__", repr(self.after_step)),
            "model": {"repr": repr(self.model), "parameters": {
                name: list(p.shape) for name, p in self.parameters.items()}},
            "objective": objective_config,
            "optimizer": optimizer,
            **warmup,
            "schedule": None if self.schedule is None else {
                "name": type(self.schedule).__name__, **self.schedule._arguments()},
            "sampler": {"n_classes_per_batch": sampler.n_classes_per_batch,
                        "n_samples_per_class": sampler.n_samples_per_class,
                        "short_classes": sampler.short_classes,
                        "seed": sampler.state_dict()["seed"]},
            "data": {split: None if y is None else {
                "n_samples": int(y.shape[0]), "n_classes": int(np.unique(y).shape[0]),
                "input_shape": list(x.shape[1:]), "input_dtype": x.dtype.name}
                for split, x, y in (("train", self.train_x, self.train_y),
                                    ("val", self.val_x, self.val_y),
                                    ("test", self.test_x, self.test_y))},
        }

    # -- data to the device --------------------------------------------------------------
    def _to_device(self, inputs: np.ndarray, labels: np.ndarray) -> tuple[Any, Any]:
        if np.issubdtype(inputs.dtype, np.floating):
            inputs = inputs.astype(self.dtype, copy=False)
        return self._xp.asarray(inputs), self._xp.asarray(labels)

    # -- evaluation ----------------------------------------------------------------------
    @staticmethod
    def _check_inputs(inputs: Any, name: str = "inputs") -> Any:
        """Host (NumPy) or device samples ``(N, ...)``, N >= 1, of a real dtype."""
        wanted = f"{name} must be an array of N >= 1 samples (N, ...)"
        if inputs is None or isinstance(inputs, (str, bytes)):
            raise TypeError(f"{wanted}, got {_describe(inputs)}")
        if not (hasattr(inputs, "shape") and hasattr(inputs, "dtype")):
            try:
                inputs = np.asarray(inputs)
            except ValueError:   # a ragged nested list
                raise TypeError(f"{wanted}, got {_describe(inputs)}") from None
        if inputs.ndim < 1 or inputs.shape[0] < 1:
            raise ValueError(f"{wanted}, got shape {tuple(inputs.shape)}")
        kind = np.dtype(inputs.dtype)
        if kind == bool or not (np.issubdtype(kind, np.floating)
                                or np.issubdtype(kind, np.integer)):
            raise TypeError(f"{name} must hold real numbers (floating inputs or integer token "
                            f"ids), got dtype {kind}")
        return inputs

    def embed(self, inputs: np.ndarray) -> Any:
        """L2-normalised embeddings (the model's first output) of ``inputs``, on the device."""
        from refdml.gpu.normalize import l2_normalize_forward

        inputs = self._check_inputs(inputs)
        xp = self._xp
        parts = []
        for start in range(0, inputs.shape[0], self.eval_batch_size):
            x, _ = self._to_device(inputs[start:start + self.eval_batch_size], np.zeros(0))
            outputs, _ = self.model.forward(x)
            y = outputs[0] if isinstance(outputs, tuple) else outputs
            parts.append(l2_normalize_forward(y)[0])
        return xp.concatenate(parts, axis=0)

    def evaluate(self, inputs: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """MAP@R, P@1 and R@1 of the L2-normalised embeddings, same-set retrieval."""
        from refdml.gpu.metrics import retrieval_metrics

        inputs = self._check_inputs(inputs)
        labels = as_label_array(to_numpy(labels), "labels", length=inputs.shape[0])
        _check_retrieval_labels(labels, "labels")
        embeddings = self.embed(inputs)
        result = retrieval_metrics(embeddings, self._xp.asarray(labels), k=(1,))
        return {key: float(result[name]) for key, name in METRIC_KEYS.items()}

    def _evaluation(self) -> dict[str, Any]:
        """The evaluation entries of a row: ``evaluate()``'s, or the built-in ones."""
        if self._evaluate is not None:
            entries = self._evaluate()
            if not isinstance(entries, dict):
                raise TypeError(f"evaluate() must return a dict, got {_describe(entries)}")
            clash = [k for k in entries if k in _ROW_KEYS or k == f"best_{self.select}"]
            if clash:
                raise ValueError(f"evaluate() returned {clash}, names the loop's row uses")
        else:
            entries = {f"val_{k}": v for k, v in self.evaluate(self.val_x, self.val_y).items()}
            if self.test_x is not None:
                entries.update({f"test_{k}": v for k, v in self.evaluate(
                    self.test_x, self.test_y).items()})
            if callable(getattr(self.objective, "covering_radius", None)):
                entries["proxy_covering_radius"] = float(self.objective.covering_radius(
                    self.embed(self.train_x), self.train_y))
        if self.select is not None and self.select not in entries:
            raise ValueError(f"select == {self.select!r} is not an entry of the evaluation "
                             f"({sorted(entries)})")
        self.evaluation_keys = tuple(entries)
        return entries

    # -- problem instances ---------------------------------------------------------------
    def instance_due(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (1-based) starts a new problem instance.

        With ``instance_every`` any epoch's answer is known in advance; with
        ``instance_patience`` it depends on the metric, so only epochs up to the next one
        (``self.epoch + 1``) have an answer (the record of :attr:`instance_starts`, then
        the rule) and a later epoch is a ValueError."""
        epoch = check_scalar(epoch, "epoch", low=0, integer=True)
        if self.instance_patience is not None:
            if epoch > self.epoch + 1:
                raise ValueError(
                    f"epoch == {epoch}: with instance_patience, whether an epoch starts a "
                    f"problem instance is known only up to the next epoch ({self.epoch + 1})")
            if epoch <= self.epoch:
                return epoch in self.instance_starts
            return epoch == self.next_instance_epoch
        return self.instance_every is not None and epoch >= 1 and (
            (epoch - 1) % self.instance_every == 0)

    def _update_instance_patience(self, epoch: int, metric: float) -> None:
        """The instance-patience rule after epoch ``epoch`` evaluated ``metric``: a strict
        improvement on the current instance's best moves that best; ``instance_patience``
        epochs since it without one make the next epoch start a new instance, whose best
        starts at this epoch's value (the metric at its start)."""
        if epoch == 0 or metric > self.instance_best_metric:
            self.instance_best_metric, self.instance_best_epoch = metric, epoch
        elif epoch - self.instance_best_epoch >= self.instance_patience:
            self.instance_best_metric, self.instance_best_epoch = metric, epoch
            self.next_instance_epoch = epoch + 1

    def new_problem_instance(self, epoch: int) -> Any:
        """Embed the training samples, call the objective's ``new_problem_instance`` with
        :attr:`rng`, reset the optimiser state of the objective's parameters; returns what
        the objective returned."""
        if not callable(getattr(self.objective, "new_problem_instance", None)):
            raise TypeError(f"objective has no method new_problem_instance(); "
                            f"{type(self.objective).__name__} cannot start a problem instance")
        embeddings = (self.embed(self.train_x) if self._instance_embed is None
                      else self._instance_embed())
        result = self.objective.new_problem_instance(embeddings, self.train_y, self.rng)
        params = list(self.objective.parameters())
        if params:
            self.optimizer.reset_state(params)
        return result

    # -- one epoch -----------------------------------------------------------------------
    def _train_epoch(self, epoch: int) -> float:
        from tqdm import tqdm

        self.optimizer.zero_grad()
        for p in self.objective.parameters():
            p.zero_grad()
        on_device = self.device == "cuda"
        reads = DeferredReads()
        scope = deferring(reads) if on_device else contextlib.nullcontext()
        capture = None
        if self.capture:
            if self._step_capture is None:
                self._step_capture = StepCapture(self)
            capture = self._step_capture
        losses: list[Any] = []             # the losses not yet read (on the device)
        values: list[float] = []           # the losses read (a captured step's as its row's)
        total, n_steps = 0.0, 0
        bar = tqdm(total=len(self.train_sampler), desc=f"epoch {epoch}", unit="batch",
                   leave=False, disable=None if self.progress else True)

        def read() -> None:
            nonlocal total
            values.clear()
            if losses:
                reads.add(self._xp.stack(losses), lambda v, where: values.extend(v.tolist()))
            try:
                reads.read()
            except NonFiniteGradient as error:
                where = reads.failed_where or f"epoch {epoch}"
                raise TrainingDiverged(self._diverged_at(where, str(error))) from error
            finally:
                if capture is not None:
                    capture.after_read()
            losses.clear()
            total += math.fsum(values)
            if values:
                bar.set_postfix(loss=f"{values[-1]:.4g}")

        outer = capture.enter() if capture is not None else None
        try:
            with scope:
                for step, batch in enumerate(self.train_sampler, start=1):
                    where = f"epoch {epoch}, step {step}"
                    reads.where = where
                    inputs = self.train_x[batch]
                    _check_finite_inputs(inputs, where)
                    labels = self.train_y[batch]
                    if capture is not None:
                        if np.issubdtype(inputs.dtype, np.floating):
                            inputs = inputs.astype(self.dtype, copy=False)
                        capture.step(inputs, labels, reads, values.append)
                        self._after_step(bar)
                        n_steps += 1
                        if step % self.log_every == 0:
                            read()
                        continue
                    # the labels stay on the host: the objectives upload them themselves,
                    # and one that needs them there (GSP's split) reads nothing back
                    x, _ = self._to_device(inputs, np.zeros(0))
                    outputs, ctx = self.model.forward(x)
                    value, objective_ctx = self.objective.forward(outputs, labels)
                    if on_device and _is_array(value):
                        self._device_step(value, objective_ctx, ctx)
                        losses.append(value)
                    else:     # the loss is on the host already (the CPU, or a host float)
                        total += self._host_step(value, objective_ctx, ctx, where)
                    self._after_step(bar)
                    n_steps += 1
                    if on_device and step % self.log_every == 0:
                        read()
                read()
        finally:
            if capture is not None:
                capture.leave(outer)
            bar.close()
        if n_steps == 0:
            raise ValueError(f"train_sampler gave no batch in epoch {epoch}")
        return total / n_steps

    def _after_step(self, bar: Any) -> None:
        """The hook, the cleared gradients and the progress bar after each step."""
        if self.after_step is not None:
            self.after_step()
        self.optimizer.zero_grad()
        bar.update(1)

    def _host_step(self, value: Any, objective_ctx: Any, ctx: Any, where: str) -> float:
        """The rest of a step whose loss is read at once (the CPU: reads are free): the loss
        refused before the backward, the objective's gradient checked, then the update."""
        value = float(value)
        if not math.isfinite(value):
            raise TrainingDiverged(self._diverged_at(where, f"the loss is {value}"))
        try:
            d_outputs = self.objective.backward(objective_ctx, 1.0)
            gate = self._check_finite_gradient(d_outputs)
            self.model.backward(ctx, d_outputs)
            self.optimizer.step(gate=gate)
        except NonFiniteGradient as error:
            raise TrainingDiverged(self._diverged_at(where, str(error))) from error
        return value

    def _device_step(self, value: Any, objective_ctx: Any, ctx: Any) -> None:
        """The rest of a step on the device, without a host read: the loss and the
        objective's gradient are checked there (:func:`refdml.gpu.optim.first_nonfinite`:
        one launch each, into one array of slots) and gate the optimiser's update, whose own
        check covers every parameter gradient; the slots are read with the losses every
        ``log_every`` steps and name the first bad entry of what failed."""
        d_outputs = self.objective.backward(objective_ctx, 1.0)
        arrays = d_outputs if isinstance(d_outputs, tuple) else (d_outputs,)
        checked = [("the objective's gradient of the outputs"
                    + (f" (output {index})" if len(arrays) > 1 else ""), array)
                   for index, array in enumerate(arrays) if array is not None]
        if _is_array(value):
            checked.insert(0, ("the loss", value))
        else:                                    # read already: checked at once
            check_finite_later(value, "the loss")
        checks = self._check_slots(len(checked))
        for slot, (_, array) in enumerate(checked):
            first_nonfinite(array, checks, slot)
        names = [(name, tuple(array.shape)) for name, array in checked]

        def on_read(values: np.ndarray, where: str) -> None:
            for (name, shape), first in zip(names, values):
                if first >= 0:
                    index = tuple(int(i) for i in np.unravel_index(int(first), shape))
                    at = f" at {where}" if where else ""
                    raise NonFiniteGradient(
                        f"{name} is not finite (NaN or inf) at index {index}{at}")

        read_later(checks.copy(), on_read)
        self.model.backward(ctx, d_outputs)
        self.optimizer.step(gate=checks)

    def _check_slots(self, count: int) -> Any:
        """The device array the step's own checks write (one slot each), kept per count."""
        slots = self._slots.get(count)
        if slots is None:
            slots = self._slots[count] = self._xp.zeros(count, dtype=np.int64)
        return slots

    @staticmethod
    def _check_finite_gradient(d_outputs: Any) -> Any:
        """The objective's gradient of the outputs checked by
        :func:`~refdml._deferred.check_finite_later` (at once on the host, deferred on the
        device): :class:`NonFiniteGradient` naming the output and the first bad entry.
        Returns the 0-d "all finite" of the arrays' module."""
        arrays = d_outputs if isinstance(d_outputs, tuple) else (d_outputs,)
        gate = None
        for index, array in enumerate(arrays):
            if array is not None:
                finite = check_finite_later(
                    array, "the objective's gradient of the outputs"
                    + (f" (output {index})" if len(arrays) > 1 else ""))
                gate = finite if gate is None else gate & finite
        return gate

    def _diverged_at(self, where: str, what: str) -> str:
        return (f"training diverged at {where} ({what}); stopped without updating the "
                f"parameters{self.sink.diverged_note(self)}")

    # -- the run -------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train to ``epochs`` (or the early stop); return the rows of this call's epochs."""
        with contextlib.ExitStack() as stack:
            if self.device == "cpu" and self.blas_threads is not None:
                from threadpoolctl import threadpool_limits

                stack.enter_context(threadpool_limits(limits=self.blas_threads,
                                                      user_api="blas"))
            stack.enter_context(side_thread(self.side_thread and self.device == "cpu"
                                            and usable_cpus() >= 2))
            return self._fit()

    def _fit(self) -> list[dict[str, Any]]:
        rows = []
        if self.device == "cuda" and self.progress and not silenced():
            _note_gpu_compilation()
        if not self.started:
            self.sink.start(self)
            rows.append(self._end_epoch(0, None, time.perf_counter()))
            self.started = True
        while self.epoch < self.epochs and not self.stopped_early:
            epoch = self.epoch + 1
            start = time.perf_counter()
            if self.instance_due(epoch):
                self.new_problem_instance(epoch)
                self.instance_starts.append(epoch)
                self.next_instance_epoch = None
            self._set_warmup(epoch)
            loss = self._train_epoch(epoch)
            rows.append(self._end_epoch(epoch, loss, start))
        self.sink.end(self)
        return rows

    def _end_epoch(self, epoch: int, train_loss: float | None, start: float) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": epoch, "train_loss": train_loss,
                               "lr": self.optimizer.lr, "n_steps": self.optimizer.n_steps}
        row.update(self._evaluation())
        improved = False
        if self.select is not None:
            metric = row[self.select]
            improved = epoch >= self.select_from and metric > self.best_metric
            if improved:
                self.best_metric, self.best_epoch = metric, epoch
            if metric > self.improved_metric + self.early_stopping_min_delta or epoch == 0:
                self.improved_metric, self.improved_epoch = metric, epoch
            if epoch > 0 and self.schedule is not None:
                if self.schedule.uses_metric:
                    self.schedule.step(metric)
                else:
                    self.schedule.step()
            patience = self.early_stopping_patience
            target = self.early_stopping_target
            waited = patience is not None and epoch - self.improved_epoch >= patience
            reached = target is not None and epoch >= 1 and metric >= target
            self.stopped_early = waited or reached
            row[f"best_{self.select}"] = self.best_metric
            if self.instance_patience is not None:
                self._update_instance_patience(epoch, metric)
        elif epoch > 0 and self.schedule is not None:
            self.schedule.step()
        if self.instance_every is not None or self.instance_patience is not None:
            row["instance"] = len(self.instance_starts)
        self.epoch = epoch
        row["seconds"] = time.perf_counter() - start
        self.sink.end_epoch(self, row)
        if improved:
            self.sink.new_best(self, row)
        return row
