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
second thread (docs/train.md has the measurement). ``blas_threads=None`` leaves the process's setting alone.
The second core goes to the side thread instead (``side_thread=True``, the default, where the
process may run on two CPUs or more): :meth:`fit` runs inside
:func:`refdml.train.side_thread`, where the layers hand a worker thread the work that
releases the GIL: the convolutions' forward and backward and the GSP layer's large passes
for half of the batch, the 1x1 layer's and the GSP prototypes' weight gradients beside the
input gradients. The same computations, the same numbers, ready sooner (docs/train.md,
"The side thread").

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
start of epochs ``1, 1 + instance_every, 1 + 2 instance_every, ...`` (with
``instance_patience`` instead: at epoch 1, then at the epoch after that many epochs without
a strict improvement of the validation MAP@R over the current instance's best, ASAP Sec.
4.4's "early stopping patience of 3 to pass the next projection"), before the epoch's
first step, with the L2-normalised embeddings of ALL training samples (:meth:`embed`, the
current model), the training labels (on the host) and :attr:`rng` (which draws ASAP's
per-class pools); then it resets the optimiser's state of the objective's
``parameters()`` (:meth:`~refdml.train.optim.Optimizer.reset_state`: zero moments, Adam's
bias correction restarted), since the re-initialised values are new parameters. An
objective cannot do that itself (it does not know the optimiser). Everything the hook
changes is in the checkpoint (parameter values, optimiser buffers and step offsets,
the objective's ``state_dict``, e.g. ASAP's ``theta*``, and :attr:`rng`), and so is
the instances' bookkeeping (the epochs that started one, and instance patience's best and
next start), so a resume across an instance boundary is bit-for-bit. Each log row then
holds ``instance``, the number of instances started so far. When the objective has
``covering_radius(embeddings, labels) -> float``, each log row (epoch 0 too) also holds
``proxy_covering_radius``, evaluated on the training embeddings after the epoch.

Randomness: :attr:`Trainer.rng` (``numpy.random.default_rng(seed)``) is for objectives and
hooks that draw during training (e.g. re-initialising proxies); it is checkpointed. The
sampler has its own seed (and state); the model is initialised by its own ``rng`` before
the trainer sees it.

The loop and the files are apart: :class:`Trainer` is :class:`~refdml.train._loop.TrainingLoop`
(epochs, steps, the divergence rule, problem instances, evaluation, the best epoch, early
stopping) reporting to :class:`DiskSink` (``config.json``, ``log.jsonl``, ``checkpoint.npz``,
``best.npz``), plus :meth:`Trainer.resume`. The same loop with
:class:`~refdml.train._loop.MemorySink` keeps the rows and the best parameters in memory
(:mod:`refdml.reproduce`).
"""

from __future__ import annotations

import copy
import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from refdml._cli_support import path_problem
from refdml._io import (append_line, read_lines, write_bytes_atomic, write_json_atomic,
                        write_text_atomic)
from refdml._validation import _describe
from refdml._backend import to_numpy
from refdml.train._checkpoint import load_checkpoint, save_checkpoint
from refdml.train._loop import (METRIC_KEYS, MemorySink, TrainingDiverged, TrainingLoop,
                                TrainingSink)
from refdml.train.data import PKBatchSampler
from refdml.train.optim import Optimizer
from refdml.train.schedules import Schedule

__all__ = ["Trainer", "TrainingDiverged", "METRIC_KEYS", "DiskSink", "MemorySink",
           "TrainingLoop", "TrainingSink"]

# What resume() sets besides the state dicts, the parameters and the Generator.
_RESUMED_ATTRIBUTES = ("epoch", "best_epoch", "best_metric", "improved_metric",
                       "improved_epoch", "stopped_early", "started", "instance_starts",
                       "instance_best_metric", "instance_best_epoch", "next_instance_epoch")
#: The entries of a checkpoint's ``meta`` that :meth:`Trainer.resume` reads.
_CHECKPOINT_META = frozenset({"epoch", "best_val_map_at_r", "best_epoch", "stopped_early",
                              "rng", "sampler", "schedule", "objective"})


#: Keys of the ``"run"`` entry a resume may change: how long, and how the steps are read and
#: launched (``log_every``, ``capture``: the trajectory is the same either way).
_RESUME_MAY_CHANGE = ("epochs", "progress", "log_every", "capture")

#: Keys of the ``"run"`` entry added after run folders were written; None (their default,
#: the behaviour before them) compares equal to absent, so such a folder still resumes.
_LATER_RUN_KEYS = ("instance_patience",)


def _without_run_epochs(value: Any, key: str) -> Any:
    """The ``"run"`` entry of a config less the keys a resume may change (and the later
    keys at their default: :data:`_LATER_RUN_KEYS`)."""
    if key != "run" or not isinstance(value, dict):
        return value
    return {k: v for k, v in value.items() if k not in _RESUME_MAY_CHANGE
            and not (k in _LATER_RUN_KEYS and v is None)}


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
    # a name too long, a folder that may not be searched: refused here, where Python
    # 3.11's exists() would raise, and before fit() fails to make the folder
    problem = path_problem(name, text)
    if problem is not None:
        raise ValueError(problem)
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{name} == {text!r} is an existing file, not a folder")
    # the folder is created by fit(): refuse now one that could not be created then
    blocking = next((parent for parent in path.parents if parent.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ValueError(f"{name} == {text!r} lies under {str(blocking)!r}, which is a file")
    return path


class DiskSink(TrainingSink):
    """The files of a run folder ``out_dir`` (module docstring), each written atomically.

    ``start``: ``config.json`` (``loop.config()``) and an empty ``log.jsonl``; each epoch:
    its row appended to ``log.jsonl`` in one write, then ``checkpoint.npz``; a new best:
    ``best.npz`` (the same content as that epoch's checkpoint).
    """

    def __init__(self, out_dir: Any) -> None:
        self.out_dir = _check_out_dir(out_dir)

    def start(self, loop: TrainingLoop) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.out_dir / "config.json", loop.config(), indent=2,
                          sort_keys=True)
        write_text_atomic(self.out_dir / "log.jsonl", "")

    def end_epoch(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        # The row goes first: a kill before the checkpoint leaves a row of an epoch the
        # checkpoint does not hold, which resume() drops (the epoch then runs again).
        append_line(self.out_dir / "log.jsonl", json.dumps(row))
        self.save(loop, self.out_dir / "checkpoint.npz")

    def new_best(self, loop: TrainingLoop, row: dict[str, Any]) -> None:
        self.save(loop, self.out_dir / "best.npz")

    def diverged_note(self, loop: TrainingLoop) -> str:
        return (f"; the last good checkpoint (epoch {loop.epoch}) is "
                f"{self.out_dir / 'checkpoint.npz'}")

    @staticmethod
    def save(loop: TrainingLoop, path: Path) -> None:
        """Write the loop's whole state (what :meth:`Trainer.resume` reads) to ``path``."""
        objective_state = (loop.objective.state_dict() if callable(getattr(
            loop.objective, "state_dict", None)) else None)
        meta = {
            "epoch": loop.epoch,
            "best_val_map_at_r": loop.best_metric,
            "best_epoch": loop.best_epoch,
            "improved_val_map_at_r": loop.improved_metric,
            "improved_epoch": loop.improved_epoch,
            "stopped_early": loop.stopped_early,
            "instance_starts": list(loop.instance_starts),
            "rng": loop.rng.bit_generator.state,
            "sampler": loop.train_sampler.state_dict(),
            "schedule": None if loop.schedule is None else loop.schedule.state_dict(),
            "objective": objective_state,
        }
        if loop.instance_patience is not None:
            meta["instance_patience"] = {"best_metric": loop.instance_best_metric,
                                         "best_epoch": loop.instance_best_epoch,
                                         "next_epoch": loop.next_instance_epoch}
        save_checkpoint(path, parameters={name: np.array(to_numpy(p.value), copy=True)
                                          for name, p in loop.parameters.items()},
                        optimizer_state=loop.optimizer.state_dict(), meta=meta)


class Trainer(TrainingLoop):
    """Train ``model`` with ``objective`` and ``optimizer`` (see the module docstring):
    :class:`~refdml.train._loop.TrainingLoop` writing its run folder through
    :class:`DiskSink`, selecting on the validation MAP@R from epoch 0.

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
    side_thread : bool, default True
        On the CPU, where the process may use two CPUs or more: :meth:`fit` runs part of
        the layers' work on a worker thread (module docstring); the numbers are the same
        either way. False: one thread.
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
    instance_patience : int >= 1, optional
        Instead of ``instance_every``: a new problem instance at the epoch after that many
        epochs without a strict improvement of the validation MAP@R over the current
        instance's own best (:class:`~refdml.train._loop.TrainingLoop`; ASAP Sec. 4.4).
        The instances' bookkeeping is in the checkpoint, so a resume is bit-for-bit.
    run_config : dict, optional
        The plain config a run was built from (:func:`refdml.train.runs.build_run`),
        recorded as ``"run"`` in ``config.json`` (JSON types only: checked here).
    warmup_epochs : int >= 0, default 0
        Epochs 1..``warmup_epochs`` train only ``warmup_params``, the optimiser freezing the
        rest (:class:`~refdml.train._loop.TrainingLoop`); at most ``epochs``. Recorded in
        ``config.json`` (``"warmup"``) when > 0. A resumed trainer freezes as the
        interrupted one did (the loop sets the frozen set at the start of every epoch, and
        the optimiser's state holds it).
    warmup_params : iterable of Parameter, optional
        Required iff ``warmup_epochs > 0``; a non-empty subset of the optimiser's
        parameters (e.g. :func:`~refdml.train.models.embedding_layer_parameters` of the
        model plus the objective's parameters).
    log_every : int >= 1, default 20
        On a GPU, steps between two host reads of the steps' deferred checks and losses
        (:class:`~refdml.train._loop.TrainingLoop`).
    capture : bool, default False
        On a GPU, record the step once per shape as a CUDA graph and replay it
        (:class:`~refdml.train._loop.TrainingLoop`, :mod:`refdml.train._capture`).
    """

    def __init__(
        self, model: Any, objective: Any, optimizer: Optimizer, *,
        schedule: Schedule | None = None, train_sampler: PKBatchSampler, train_data: Any,
        val_data: Any, test_data: Any = None, out_dir: Any, epochs: int,
        early_stopping_patience: int | None = None, early_stopping_min_delta: float = 0.0,
        early_stopping_target: float | None = None, blas_threads: int | None = 1,
        side_thread: bool = True, seed: int, dtype: Any,
        device: str = "cpu", progress: bool = True,
        after_step: Callable[[], None] | None = None, eval_batch_size: int = 1024,
        run_config: dict[str, Any] | None = None, instance_every: int | None = None,
        instance_patience: int | None = None, warmup_epochs: int = 0, warmup_params: Any = None,
        log_every: int = 20, capture: bool = False,
    ) -> None:
        super().__init__(
            model, objective, optimizer, schedule=schedule, train_sampler=train_sampler,
            train_data=train_data, val_data=val_data, test_data=test_data, epochs=epochs,
            early_stopping_patience=early_stopping_patience,
            early_stopping_min_delta=early_stopping_min_delta,
            early_stopping_target=early_stopping_target, blas_threads=blas_threads,
            side_thread=side_thread, seed=seed, dtype=dtype, device=device, progress=progress,
            after_step=after_step,
            eval_batch_size=eval_batch_size, instance_every=instance_every,
            instance_patience=instance_patience, select="val_map_at_r", select_from=0,
            warmup_epochs=warmup_epochs, warmup_params=warmup_params, log_every=log_every,
            capture=capture)
        self.sink = DiskSink(out_dir)
        self.out_dir = self.sink.out_dir
        if run_config is not None and not isinstance(run_config, dict):
            raise TypeError(f"run_config must be a dict or None, got {_describe(run_config)}")
        if run_config is not None:
            try:   # written to config.json by fit(): refused here, not after epoch 0
                json.dumps(run_config)
            except (TypeError, ValueError) as error:
                raise TypeError(f"run_config must hold JSON types only: {error}") from None
        self.run_config = None if run_config is None else dict(run_config)

    # -- configuration -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """Every hyperparameter the trainer knows (written to ``config.json``)."""
        return {"run": self.run_config, **super().config()}

    # -- the run -------------------------------------------------------------------------
    def _fit(self) -> list[dict[str, Any]]:
        # also after a resume: the folder may have been removed since
        self.out_dir.mkdir(parents=True, exist_ok=True)
        return super()._fit()

    # -- checkpoints ---------------------------------------------------------------------
    def _save(self, path: Path) -> None:
        DiskSink.save(self, path)

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
        self._load_instances(source, meta)
        self.started = True

    def _load_instances(self, source: Path, meta: dict[str, Any]) -> None:
        """The problem instances' bookkeeping of a read checkpoint. One written before it
        was saved (an ``instance_every`` run) gets its starts back from the rule."""
        starts = meta.get("instance_starts")
        if starts is None:
            starts = [e for e in range(1, self.epoch + 1) if self.instance_due(e)]
        if not isinstance(starts, list) or any(
                isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= self.epoch
                for e in starts):
            raise ValueError(f"cannot resume from {source}: checkpoint.npz has "
                             f"instance_starts == {starts!r}, not a list of epochs")
        self.instance_starts = list(starts)
        if self.instance_patience is None:
            return
        state = meta.get("instance_patience")
        if not isinstance(state, dict) or set(state) != {"best_metric", "best_epoch",
                                                          "next_epoch"}:
            raise ValueError(f"cannot resume from {source}: checkpoint.npz lacks the "
                             "instance_patience state (best_metric, best_epoch, next_epoch)")
        self.instance_best_metric = float(state["best_metric"])
        self.instance_best_epoch = int(state["best_epoch"])
        self.next_instance_epoch = (None if state["next_epoch"] is None
                                    else int(state["next_epoch"]))

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
            "attributes": {name: copy.copy(getattr(self, name))
                           for name in _RESUMED_ATTRIBUTES},
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
