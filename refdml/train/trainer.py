r"""The training loop: P x K batches, hand-written backward, retrieval metrics, checkpoints.

One epoch of :meth:`Trainer.fit`, for each index batch of the
:class:`~refdml.train.data.PKBatchSampler`:

1. gather the batch on the host (NumPy), cast floating inputs to ``dtype`` (integer inputs
   such as token ids stay integers), move inputs and labels to the device (CuPy only when
   ``device="cuda"``);
2. ``outputs, ctx = model.forward(x)``; ``value, octx = objective.forward(outputs, labels)``;
   a NaN or inf ``value`` stops the run (:class:`TrainingDiverged`, naming epoch and step);
3. ``d_outputs = objective.backward(octx, 1.0)``; ``model.backward(ctx, d_outputs)``;
4. ``optimizer.step()`` (it refuses a non-finite gradient before touching any parameter:
   also :class:`TrainingDiverged`); ``after_step()`` if given (e.g. the token study's clip to
   [-0.3, 0.3]); ``optimizer.zero_grad()``.

After the epoch: the mean training loss over its steps; MAP@R, P@1 and R@1
(:func:`refdml.gpu.metrics.retrieval_metrics`, the fast-path mirror, which is exact in
float64 and runs on NumPy or CuPy) of the L2-normalised embeddings (the model's first
output) of the validation and the test data, each in same-set mode (every sample a query
against the others of its split); the schedule's step (a schedule whose ``uses_metric``
is true, :class:`~refdml.train.ReduceOnPlateau`, gets the validation MAP@R); a row
appended to ``out_dir/log.jsonl`` (``epoch``, ``train_loss``, ``lr``: the rate this epoch
trained with, ``n_steps``: optimiser steps so far, ``val_map_at_r``, ``val_precision_at_1``, ``val_recall_at_1``, the same for ``test_``,
``best_val_map_at_r``, ``seconds``); ``out_dir/checkpoint.npz``
and, when the validation MAP@R improved, ``out_dir/best.npz``. Epoch 0 evaluates the
untrained model (``train_loss`` null) and checkpoints it, so a run that diverges in its
first epoch still leaves a checkpoint.

Early stopping: an epoch *improves* when its validation MAP@R exceeds the best of the
earlier improving epochs by more than ``early_stopping_min_delta`` (default 0: strictly);
the best checkpoint (``best.npz``, :attr:`best_metric`) still follows every strict
increase. The run stops after ``early_stopping_patience`` consecutive epochs without an
improvement, or at once when the validation MAP@R of a trained epoch (1, 2, ...) reaches
``early_stopping_target`` (e.g. 1.0, the maximum: every validation query ranks all its
class mates first, nothing is left to learn on that metric); ``None`` for both trains all
epochs.

BLAS threads: on the CPU, :meth:`fit` runs under ``threadpoolctl.threadpool_limits(
blas_threads, "blas")`` (default 1). NumPy and SciPy each ship their own OpenBLAS; with
two threads each, one library's threads spin while the other's work, and the small
matrix products of these models (at most (B n) x 144 by 144 x 32) gain nothing from a
second thread: measured on 2 cores, a tokens epoch 0.11-0.20 s with one thread against
0.25-3.8 s with two (2-11 s against 1.1-1.7 s for digits-collage), the spread from the
load of other processes. ``blas_threads=None`` leaves the process's setting alone.

Resuming (:meth:`Trainer.resume`): a trainer built exactly as the interrupted one (same
model architecture, objective, optimiser, schedule, sampler and data; ``epochs`` may grow)
loads ``checkpoint.npz`` (parameter values, optimiser buffers and step count, schedule,
sampler position, the trainer's Generator ``bit_generator.state``, the objective's
``state_dict()`` if it has one, the epoch and the early-stopping counters), drops log rows
after that epoch, and :meth:`fit` continues bit-for-bit: the same parameters and log rows
(except ``seconds``) as an uninterrupted run. ``config.json`` (every hyperparameter the
trainer knows) must match, apart from ``epochs``, or a ValueError names the difference.

Killed at any instant: ``config.json``, ``checkpoint.npz`` and ``best.npz`` are replaced
atomically (:mod:`refdml._io`: a temporary file, fsync, :func:`os.replace`); a log row is
appended in one ``os.write`` before the epoch's checkpoint. :meth:`resume` keeps the rows
up to the checkpoint's epoch, drops a last line cut by the kill, rewrites the log
atomically and rewrites ``best.npz`` when the checkpoint is the best epoch (a kill between
the two checkpoint files), so every finished epoch appears once, and a run killed before
its first checkpoint starts again from epoch 0.

New problem instances (ASAP Alg. 1's outer loop): when ``instance_every`` is set and the
objective has ``new_problem_instance(embeddings, labels, rng)``, the trainer calls it at the
start of epochs ``1, 1 + instance_every, 1 + 2 instance_every, ...``, before the epoch's
first step, with the L2-normalised embeddings of ALL training samples (:meth:`embed`, the
current model), the training labels (on the host) and :attr:`rng` (which draws ASAP's
per-class pools); then it resets the optimiser's state of the objective's
``parameters()`` (:meth:`~refdml.train.optim.Optimizer.reset_state`: zero moments, Adam's
bias correction restarted), since the re-initialised values are new parameters. An
objective cannot do that itself (it does not know the optimiser). Everything the hook
changes is in the checkpoint (parameter values, optimiser buffers and step offsets,
the objective's ``state_dict``, e.g. ASAP's ``theta*``, and :attr:`rng`), so a resume
across an instance boundary is bit-for-bit. When the objective has
``covering_radius(embeddings, labels) -> float``, each log row (epoch 0 too) also holds
``proxy_covering_radius``, evaluated on the training embeddings after the epoch.

Randomness: :attr:`Trainer.rng` (``numpy.random.default_rng(seed)``) is for objectives and
hooks that draw during training (e.g. re-initialising proxies); it is checkpointed. The
sampler has its own seed (and state); the model is initialised by its own ``rng`` before
the trainer sees it.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from refdml._io import (append_line, read_lines, write_bytes_atomic, write_json_atomic,
                        write_text_atomic)
from refdml._validation import (_describe, as_label_array, check_choice, check_float_dtype,
                                check_scalar)
from refdml._xp import to_numpy
from refdml.train._checkpoint import load_checkpoint, save_checkpoint
from refdml.train.data import PKBatchSampler
from refdml.train.optim import Optimizer
from refdml.train.schedules import Schedule

__all__ = ["Trainer", "TrainingDiverged", "METRIC_KEYS"]

#: Retrieval metrics logged per split (log key suffix -> key of ``retrieval_metrics``).
METRIC_KEYS = {
    "map_at_r": "mean_average_precision_at_r",
    "precision_at_1": "precision_at_1",
    "recall_at_1": "recall_at_1",
}
_INPUT_FIELDS = ("token_ids", "images", "features", "inputs")
#: The entries of a checkpoint's ``meta`` that :meth:`Trainer.resume` reads.
# What resume() sets besides the state dicts, the parameters and the Generator.
_RESUMED_ATTRIBUTES = ("epoch", "best_epoch", "best_metric", "improved_metric",
                       "improved_epoch", "stopped_early", "started")
_CHECKPOINT_META = frozenset({"epoch", "best_val_map_at_r", "best_epoch", "stopped_early",
                              "rng", "sampler", "schedule", "objective"})


def _without_run_epochs(value: Any, key: str) -> Any:
    """The ``"run"`` entry of a config less the keys a resume may change."""
    if key != "run" or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if k not in ("epochs", "progress")}


class TrainingDiverged(RuntimeError):
    """A NaN or inf loss or gradient; the last good checkpoint is left in place."""


def _check_out_dir(value: Any, name: str = "out_dir") -> Path:
    """A run folder: a non-empty path (str or os.PathLike) that is not an existing file."""
    if isinstance(value, (bytes, bool)) or not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {_describe(value)}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {_describe(value)}")
    if not text:
        # Path("") is the current folder: a run would silently write its files there
        raise ValueError(f"{name} == '', must name a folder")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} == {text!r} is an existing file, not a folder")
    # the folder is created by fit(): refuse now one that could not be created then
    blocking = next((parent for parent in path.parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"{name} == {text!r} lies under {str(blocking)!r}, which is a file")
    return path


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


class Trainer:
    """Train ``model`` with ``objective`` and ``optimizer`` (see the module docstring).

    Parameters
    ----------
    model : Layer
        ``forward(x) -> (outputs, ctx)``, ``backward(ctx, d_outputs)`` (both checked to
        exist); ``outputs`` is the embedding ``y`` (B, d) or a tuple whose first entry is
        ``y``.
    objective : object
        ``parameters()``, ``forward(outputs, labels) -> (value, ctx)``,
        ``backward(ctx, d_value) -> d_outputs``; optional ``state_dict``/``load_state_dict``.
    optimizer : Optimizer
        Over the model's and the objective's parameters (names must be unique).
    schedule : Schedule, optional
        Stepped once per epoch (with the validation MAP@R when its ``uses_metric``, as
        ``ReduceOnPlateau``'s).
    train_sampler : PKBatchSampler
        Over ``train_data``'s labels.
    train_data, val_data, test_data
        ``TokenSamples``, ``CollageSplit``, ``FeatureSet`` or an ``(inputs, labels)`` pair
        of host arrays. ``test_data`` is optional. Validation and test need a class with
        two or more samples (same-set retrieval: a query with a class mate).
    out_dir : str or os.PathLike
        Required, non-empty, not a file nor under one; created if missing; holds
        ``config.json``, ``log.jsonl``, ``checkpoint.npz``, ``best.npz``.
    epochs : int >= 0
        Training epochs after the epoch-0 evaluation.
    early_stopping_patience : int >= 1, optional
    early_stopping_min_delta : float >= 0, default 0
        An epoch improves only when its validation MAP@R beats the best of the earlier
        improving epochs by more than this.
    early_stopping_target : float in (0, 1], optional
        Stop as soon as the validation MAP@R reaches it.
    blas_threads : int >= 1 or None, default 1
        BLAS threads during :meth:`fit` on the CPU (``None``: unchanged).
    seed : int >= 0
        Seeds :attr:`rng`.
    dtype : "float32" or "float64"
        Of the floating inputs; must be the parameters' dtype.
    device : "cpu" or "cuda"
    progress : bool (or numpy.bool_)
        A tqdm bar over each epoch's batches (only on a terminal).
    after_step : callable, optional
        Called with no argument after every optimiser step (e.g. a projection).
    eval_batch_size : int, default 1024
        Samples per forward pass when embedding the validation and test data.
    instance_every : int >= 1, optional
        Epochs per problem instance: calls the objective's ``new_problem_instance`` at
        the start of epochs 1, 1 + k, 1 + 2k, ... (see the module docstring); needs an
        objective that has that method. ``None``: never.
    run_config : dict, optional
        The plain config a run was built from (:func:`refdml.train.runs.build_run`),
        recorded as ``"run"`` in ``config.json`` (JSON types only: checked here).
    """

    def __init__(
        self, model: Any, objective: Any, optimizer: Optimizer, *,
        schedule: Schedule | None = None, train_sampler: PKBatchSampler, train_data: Any,
        val_data: Any, test_data: Any = None, out_dir: Any, epochs: int,
        early_stopping_patience: int | None = None, early_stopping_min_delta: float = 0.0,
        early_stopping_target: float | None = None, blas_threads: int | None = 1,
        seed: int, dtype: Any,
        device: str = "cpu", progress: bool = True,
        after_step: Callable[[], None] | None = None, eval_batch_size: int = 1024,
        run_config: dict[str, Any] | None = None, instance_every: int | None = None,
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
        if after_step is not None and not callable(after_step):
            raise TypeError(f"after_step must be callable or None, got {_describe(after_step)}")
        self.model, self.objective, self.optimizer = model, objective, optimizer
        self.schedule, self.train_sampler, self.after_step = schedule, train_sampler, after_step
        self.train_x, self.train_y = _as_dataset(train_data, "train_data")
        self.val_x, self.val_y = _as_dataset(val_data, "val_data")
        self.test_x, self.test_y = (None, None) if test_data is None else _as_dataset(
            test_data, "test_data")
        _check_retrieval_labels(self.val_y, "val_data")
        if test_data is not None:
            _check_retrieval_labels(self.test_y, "test_data")
        if train_sampler._labels.shape != self.train_y.shape or not np.array_equal(
                train_sampler._labels, self.train_y):
            raise ValueError("train_sampler was built over other labels than train_data's")
        self.out_dir = _check_out_dir(out_dir)
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
        self.seed = check_scalar(seed, "seed", low=0, integer=True)
        self.dtype = check_float_dtype(dtype)
        self.device = check_choice(device, "device", ("cpu", "cuda"))
        if not isinstance(progress, (bool, np.bool_)):
            raise TypeError(f"progress must be True or False, got {_describe(progress)}")
        self.progress = bool(progress)
        if run_config is not None and not isinstance(run_config, dict):
            raise TypeError(f"run_config must be a dict or None, got {_describe(run_config)}")
        if run_config is not None:
            try:   # written to config.json by fit(): refused here, not after epoch 0
                json.dumps(run_config)
            except (TypeError, ValueError) as error:
                raise TypeError(f"run_config must hold JSON types only: {error}") from None
        self.run_config = None if run_config is None else dict(run_config)
        self.eval_batch_size = check_scalar(eval_batch_size, "eval_batch_size", low=1,
                                            integer=True)
        self.instance_every = None if instance_every is None else check_scalar(
            instance_every, "instance_every", low=1, integer=True)
        if self.instance_every is not None and not callable(
                getattr(objective, "new_problem_instance", None)):
            raise TypeError("instance_every needs an objective with new_problem_instance(); "
                            f"{type(objective).__name__} has none")
        self.parameters = {p.name: p for p in optimizer.params}
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
        self.improved_metric = -math.inf   # best MAP@R of the epochs that improved by min_delta
        self.improved_epoch = 0
        self.stopped_early = False

    # -- configuration -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """Every hyperparameter the trainer knows (written to ``config.json``)."""
        objective_config = (self.objective.config() if callable(getattr(
            self.objective, "config", None)) else repr(self.objective))
        sampler = self.train_sampler
        return {
            "run": self.run_config,
            "epochs": self.epochs,
            "early_stopping_patience": self.early_stopping_patience,
            "early_stopping_min_delta": self.early_stopping_min_delta,
            "early_stopping_target": self.early_stopping_target,
            "seed": self.seed,
            "dtype": self.dtype.name,
            "device": self.device,
            "eval_batch_size": self.eval_batch_size,
            "instance_every": self.instance_every,
            "after_step": None if self.after_step is None else getattr(
                self.after_step, "__name__", repr(self.after_step)),
            "model": {"repr": repr(self.model), "parameters": {
                name: list(p.shape) for name, p in self.parameters.items()}},
            "objective": objective_config,
            "optimizer": {"name": type(self.optimizer).__name__,
                          **self.optimizer._hyperparameters(), "lr": self.optimizer.lr
                          if self.schedule is None else self.schedule.base_lr},
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

    # -- problem instances ---------------------------------------------------------------
    def instance_due(self, epoch: int) -> bool:
        """Whether epoch ``epoch`` (1-based) starts a new problem instance."""
        epoch = check_scalar(epoch, "epoch", low=0, integer=True)
        return self.instance_every is not None and epoch >= 1 and (
            (epoch - 1) % self.instance_every == 0)

    def new_problem_instance(self, epoch: int) -> Any:
        """Embed the training samples, call the objective's ``new_problem_instance`` with
        :attr:`rng`, reset the optimiser state of the objective's parameters; returns what
        the objective returned."""
        if not callable(getattr(self.objective, "new_problem_instance", None)):
            raise TypeError(f"objective has no method new_problem_instance(); "
                            f"{type(self.objective).__name__} cannot start a problem instance")
        embeddings = self.embed(self.train_x)
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
        total, n_steps = 0.0, 0
        bar = tqdm(total=len(self.train_sampler), desc=f"epoch {epoch}", unit="batch",
                   leave=False, disable=None if self.progress else True)
        try:
            for step, batch in enumerate(self.train_sampler, start=1):
                x, labels = self._to_device(self.train_x[batch], self.train_y[batch])
                outputs, ctx = self.model.forward(x)
                value, objective_ctx = self.objective.forward(outputs, labels)
                value = float(value)
                if not math.isfinite(value):
                    raise TrainingDiverged(self._diverged(epoch, step, f"the loss is {value}"))
                d_outputs = self.objective.backward(objective_ctx, 1.0)
                if not self._finite(d_outputs):
                    raise TrainingDiverged(self._diverged(
                        epoch, step, "the objective's gradient of the outputs is not finite"))
                self.model.backward(ctx, d_outputs)
                try:
                    self.optimizer.step()
                except ValueError as error:
                    if "not finite" not in str(error):
                        raise
                    raise TrainingDiverged(self._diverged(epoch, step, str(error))) from error
                if self.after_step is not None:
                    self.after_step()
                self.optimizer.zero_grad()
                total += value
                n_steps += 1
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4g}")
        finally:
            bar.close()
        if n_steps == 0:
            raise ValueError(f"train_sampler gave no batch in epoch {epoch}")
        return total / n_steps

    def _finite(self, d_outputs: Any) -> bool:
        arrays = [a for a in (d_outputs if isinstance(d_outputs, tuple) else (d_outputs,))
                  if a is not None]
        xp = self._xp
        # One device-to-host transfer for all outputs.
        return bool(to_numpy(xp.stack([xp.isfinite(a).all() for a in arrays])).all())

    def _diverged(self, epoch: int, step: int, what: str) -> str:
        return (f"training diverged at epoch {epoch}, step {step} ({what}); stopped without "
                f"updating the parameters; the last good checkpoint (epoch {self.epoch}) is "
                f"{self.out_dir / 'checkpoint.npz'}")

    # -- the run -------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train to ``epochs`` (or the early stop); return the log rows written by this call."""
        if self.device == "cpu" and self.blas_threads is not None:
            from threadpoolctl import threadpool_limits

            with threadpool_limits(limits=self.blas_threads, user_api="blas"):
                return self._fit()
        return self._fit()

    def _fit(self) -> list[dict[str, Any]]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        rows = []
        if not self.started:
            write_json_atomic(self.out_dir / "config.json", self.config(), indent=2,
                              sort_keys=True)
            write_text_atomic(self.out_dir / "log.jsonl", "")
            rows.append(self._end_epoch(0, None, time.perf_counter()))
            self.started = True
        while self.epoch < self.epochs and not self.stopped_early:
            epoch = self.epoch + 1
            start = time.perf_counter()
            if self.instance_due(epoch):
                self.new_problem_instance(epoch)
            loss = self._train_epoch(epoch)
            rows.append(self._end_epoch(epoch, loss, start))
        return rows

    def _end_epoch(self, epoch: int, train_loss: float | None, start: float) -> dict[str, Any]:
        row: dict[str, Any] = {"epoch": epoch, "train_loss": train_loss,
                               "lr": self.optimizer.lr, "n_steps": self.optimizer.n_steps}
        val = self.evaluate(self.val_x, self.val_y)
        row.update({f"val_{k}": v for k, v in val.items()})
        if self.test_x is not None:
            row.update({f"test_{k}": v for k, v in self.evaluate(self.test_x, self.test_y).items()})
        if callable(getattr(self.objective, "covering_radius", None)):
            row["proxy_covering_radius"] = float(self.objective.covering_radius(
                self.embed(self.train_x), self.train_y))
        metric = val["map_at_r"]
        improved = metric > self.best_metric
        if improved:
            self.best_metric, self.best_epoch = metric, epoch
        if metric > self.improved_metric + self.early_stopping_min_delta or epoch == 0:
            self.improved_metric, self.improved_epoch = metric, epoch
        if epoch > 0 and self.schedule is not None:
            if self.schedule.uses_metric:
                self.schedule.step(metric)
            else:
                self.schedule.step()
        self.epoch = epoch
        patience = self.early_stopping_patience
        target = self.early_stopping_target
        waited = patience is not None and epoch - self.improved_epoch >= patience
        reached = target is not None and epoch >= 1 and metric >= target
        self.stopped_early = waited or reached
        row["best_val_map_at_r"] = self.best_metric
        row["seconds"] = time.perf_counter() - start
        # The row goes first: a kill before the checkpoint leaves a row of an epoch the
        # checkpoint does not hold, which resume() drops (the epoch then runs again).
        append_line(self.out_dir / "log.jsonl", json.dumps(row))
        self._save(self.out_dir / "checkpoint.npz")
        if improved:
            self._save(self.out_dir / "best.npz")
        return row

    # -- checkpoints ---------------------------------------------------------------------
    def _save(self, path: Path) -> None:
        objective_state = (self.objective.state_dict() if callable(getattr(
            self.objective, "state_dict", None)) else None)
        meta = {
            "epoch": self.epoch,
            "best_val_map_at_r": self.best_metric,
            "best_epoch": self.best_epoch,
            "improved_val_map_at_r": self.improved_metric,
            "improved_epoch": self.improved_epoch,
            "stopped_early": self.stopped_early,
            "rng": self.rng.bit_generator.state,
            "sampler": self.train_sampler.state_dict(),
            "schedule": None if self.schedule is None else self.schedule.state_dict(),
            "objective": objective_state,
        }
        save_checkpoint(path, parameters={name: np.array(to_numpy(p.value), copy=True)
                                          for name, p in self.parameters.items()},
                        optimizer_state=self.optimizer.state_dict(), meta=meta)

    def resume(self, out_dir: Any = None) -> None:
        """Load ``<out_dir>/checkpoint.npz`` (default: this trainer's ``out_dir``) and the
        log up to its epoch; the next :meth:`fit` continues bit-for-bit.

        Whatever instant the interrupted run was killed at, each finished epoch (one whose
        checkpoint was written) is kept exactly once: log rows after the checkpoint's epoch
        and a last line cut by the kill are dropped, and the log is rewritten atomically.
        A run killed before its epoch-0 checkpoint has no finished epoch: with
        ``config.json`` matching and no ``checkpoint.npz`` in this trainer's own
        ``out_dir``, nothing is loaded and :meth:`fit` starts from epoch 0.
        """
        source = self.out_dir if out_dir is None else _check_out_dir(out_dir)
        saved_config = self._read_config(source)
        ours = json.loads(json.dumps(self.config()))   # tuples -> lists, as saved
        differ = sorted(k for k in set(ours) | set(saved_config)
                        if k != "epochs" and _without_run_epochs(ours.get(k), k)
                        != _without_run_epochs(saved_config.get(k), k))
        if differ:
            raise ValueError(
                f"cannot resume from {source}: its config.json differs in {differ} "
                "(only 'epochs' may change)")
        if source == self.out_dir and not (source / "checkpoint.npz").is_file():
            return
        parameters, optimizer_state, meta = self._read_checkpoint(source)
        if set(parameters) != set(self.parameters):
            raise ValueError(
                f"checkpoint parameters {sorted(parameters)} differ from the optimiser's "
                f"{sorted(self.parameters)}")
        for name, value in parameters.items():
            p = self.parameters[name]
            if value.shape != p.shape or value.dtype != p.dtype:
                raise ValueError(f"checkpoint {name} is {value.dtype}{value.shape}, parameter "
                                 f"is {p.dtype}{p.shape}")
        # The log is read before any state is set: a bad log leaves this trainer as it was.
        rows = self._read_log_rows(source, int(meta["epoch"]))
        # The parts are loaded one after another, each checked before it is set: a later
        # part refused (a damaged or mismatched checkpoint) would leave the earlier ones
        # applied, so everything is restored from a snapshot then (all or nothing).
        snapshot = self._resume_snapshot()
        try:
            self._load_resumed(source, parameters, optimizer_state, meta)
        except BaseException:
            self._restore_snapshot(snapshot)
            raise
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out_dir / "config.json", ours, indent=2, sort_keys=True)
        write_text_atomic(self.out_dir / "log.jsonl", "".join(r + "\n" for r in rows))
        if source != self.out_dir:
            self._save(self.out_dir / "checkpoint.npz")
        if self.best_epoch == self.epoch:
            # best.npz is written after checkpoint.npz: a kill between the two leaves an
            # older best.npz, and this state (the checkpoint's) is the best one
            self._save(self.out_dir / "best.npz")
        elif source != self.out_dir and (source / "best.npz").is_file():
            write_bytes_atomic(self.out_dir / "best.npz", (source / "best.npz").read_bytes())

    def _load_resumed(self, source: Path, parameters: dict[str, Any],
                      optimizer_state: dict[str, Any], meta: dict[str, Any]) -> None:
        """Set every part of the state from a read checkpoint (:meth:`resume`)."""
        self.optimizer.load_state_dict(optimizer_state)
        self.train_sampler.load_state_dict(meta["sampler"])
        if (meta["schedule"] is None) != (self.schedule is None):
            raise ValueError("checkpoint and trainer disagree on having a schedule")
        if self.schedule is not None:
            self.schedule.load_state_dict(meta["schedule"])
        if meta["objective"] is not None:
            self.objective.load_state_dict(meta["objective"])
        for name, value in parameters.items():
            self.parameters[name].value[...] = self._xp.asarray(value)
        try:
            self.rng.bit_generator.state = meta["rng"]
        except (TypeError, ValueError, KeyError) as error:   # NumPy's own name no file
            raise ValueError(
                f"cannot resume from {source}: checkpoint.npz holds an rng state that the "
                f"trainer's {type(self.rng.bit_generator).__name__} refuses "
                f"({type(error).__name__}: {error})") from None
        self.epoch, self.best_epoch = int(meta["epoch"]), int(meta["best_epoch"])
        self.best_metric = float(meta["best_val_map_at_r"])
        self.improved_metric = float(meta.get("improved_val_map_at_r", self.best_metric))
        self.improved_epoch = int(meta.get("improved_epoch", self.best_epoch))
        self.stopped_early = bool(meta["stopped_early"])
        self.started = True

    def _resume_snapshot(self) -> dict[str, Any]:
        """Copies of everything :meth:`_load_resumed` sets (state dicts deep-copied: a
        ``load_state_dict`` may write into the arrays its object's ``state_dict`` shared)."""
        stateful = callable(getattr(self.objective, "state_dict", None))
        return {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "sampler": copy.deepcopy(self.train_sampler.state_dict()),
            "schedule": None if self.schedule is None else copy.deepcopy(
                self.schedule.state_dict()),
            "objective": copy.deepcopy(self.objective.state_dict()) if stateful else None,
            "parameters": {name: p.value.copy() for name, p in self.parameters.items()},
            "rng": copy.deepcopy(self.rng.bit_generator.state),
            "attributes": {name: getattr(self, name) for name in _RESUMED_ATTRIBUTES},
        }

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Undo a partial :meth:`_load_resumed`; the optimiser last, as a schedule's load
        sets its learning rate."""
        self.train_sampler.load_state_dict(snapshot["sampler"])
        if self.schedule is not None:
            self.schedule.load_state_dict(snapshot["schedule"])
        if snapshot["objective"] is not None:
            self.objective.load_state_dict(snapshot["objective"])
        self.optimizer.load_state_dict(snapshot["optimizer"])
        for name, value in snapshot["parameters"].items():
            self.parameters[name].value[...] = value
        self.rng.bit_generator.state = snapshot["rng"]
        for name, value in snapshot["attributes"].items():
            setattr(self, name, value)

    # -- reading a run folder (named errors: a folder that is not a run, a damaged file) --
    @staticmethod
    def _read_config(source: Path) -> dict[str, Any]:
        path = source / "config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"cannot resume from {source}: it has no config.json (not a refdml.train "
                "run folder)")
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError) as error:
            raise ValueError(f"cannot resume from {source}: config.json is not valid JSON "
                             f"({error})") from None
        if not isinstance(saved, dict):
            raise ValueError(f"cannot resume from {source}: config.json holds "
                             f"{type(saved).__name__}, not the trainer's record (an object)")
        return saved

    @staticmethod
    def _read_checkpoint(source: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        path = source / "checkpoint.npz"
        if not path.is_file():
            raise FileNotFoundError(f"cannot resume from {source}: it has no checkpoint.npz")
        try:
            parameters, optimizer_state, meta = load_checkpoint(path)
        except (OSError, EOFError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as error:
            # np.load's own errors (a pickle it refuses, EOF, a bad zip) name no file
            raise ValueError(f"cannot resume from {source}: checkpoint.npz is not a readable "
                             f"checkpoint ({type(error).__name__}: {error})") from None
        missing = sorted(_CHECKPOINT_META - set(meta))
        if missing:
            raise ValueError(f"cannot resume from {source}: checkpoint.npz lacks {missing}")
        for key in ("epoch", "best_epoch"):
            if isinstance(meta[key], bool) or not isinstance(meta[key], int) or meta[key] < 0:
                raise ValueError(f"cannot resume from {source}: checkpoint.npz has {key} == "
                                 f"{meta[key]!r}, not an epoch")
        return parameters, optimizer_state, meta

    @staticmethod
    def _read_log_rows(source: Path, last_epoch: int) -> list[str]:
        """The log lines of epochs up to ``last_epoch`` (a cut last line dropped)."""
        log = source / "log.jsonl"
        if not log.is_file():
            raise FileNotFoundError(f"cannot resume from {source}: it has no log.jsonl (the "
                                    f"checkpoint is at epoch {last_epoch})")
        try:
            lines = read_lines(log)   # drops a last line cut by a kill
        except UnicodeDecodeError as error:
            raise ValueError(f"cannot resume from {source}: log.jsonl is not UTF-8 text "
                             f"({error})") from None
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                epoch = json.loads(line)["epoch"]
            except (ValueError, TypeError, KeyError, IndexError):
                raise ValueError(f"{log} line {number} is not a log row: {line[:80]!r}") from None
            if isinstance(epoch, bool) or not isinstance(epoch, int):
                raise ValueError(f"{log} line {number} has epoch == {epoch!r}, not an integer")
            if epoch <= last_epoch:
                rows.append(line)
        return rows
