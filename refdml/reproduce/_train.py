"""The experiments' training: :class:`refdml.train.Trainer`'s loop without files.

:class:`refdml.train.Trainer` writes a log, a config and checkpoints per epoch, which a
grid of hundreds of short runs does not need (and a remote worker could not return).
:func:`fit` runs the same loop (:class:`~refdml.train.trainer.TrainingLoop`: the same step,
divergence rule and problem-instance schedule) with
:class:`~refdml.train.trainer.MemorySink`, which keeps the rows and the best parameters in
memory. ASAP's problem instances: at epochs 1, 1 + k, ... the loop calls
``objective.new_problem_instance(instance_embed(), labels, rng)`` and resets the
optimiser state of the objective's parameters.

Model selection (``select``): the papers' protocol, "we recover the parameters with the best
validation performance" (GSP supp., fair evaluation; ASAP Sec. 5 monitors validation MAP@R
too): after every epoch the parameters of the model and the objective are kept when the
``select`` curve (a validation metric) beats every earlier epoch's (epochs 1..E: a trained
model), and they are restored at the end, so whatever the caller measures afterwards is the
selected model's. Training runs all ``epochs``, or with ``patience`` stops after that many
epochs in a row without a new best (:class:`~refdml.train.trainer.TrainingLoop`'s early stop,
counted from the untrained epoch 0); the selection is then over the epochs that ran, and the
curves end at the stop.

Training to a plateau (what a verdict needs: a run the budget ended may still be rising):
``instance_patience`` starts ASAP's next problem instance on a validation plateau (ASAP
Sec. 4.4, "early stopping patience of 3 to pass the next projection"; the loop's rule),
``plateau_factor`` / ``plateau_patience`` reduce the learning rate when the ``select``
curve stalls (:class:`~refdml.train.ReduceOnPlateau`, mode "max"; GSP supp. 2.2), and
:meth:`Fitted.metrics` says how the run ended: ``epochs_trained``, ``stopped_early``,
``still_rising`` (the selected epoch is the last one trained and no early stop ended the
run: the budget did, not a plateau) and, with problem instances, ``instances``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from refdml._backend import to_numpy
from refdml.train.data import PKBatchSampler
from refdml.train.runs import build_optimizer
from refdml.train.schedules import ReduceOnPlateau
from refdml.train.trainer import MemorySink, TrainingLoop

__all__ = ["Fitted", "at_epoch", "fit", "embed", "map_at_r", "map_at_r_from_distances",
           "covering_radius"]


def _cast(x: np.ndarray, dtype) -> np.ndarray:
    return x.astype(dtype, copy=False) if np.issubdtype(x.dtype, np.floating) else x


def embed(model, x: np.ndarray, dtype, *, batch: int = 512, pool_local: bool = False,
          device: str = "cpu"):
    """The model's first output on host ``x`` (batched), L2-normalised, float64 on the host;
    ``device="cuda"``: the batches go to the GPU (CuPy) and the outputs come back.

    ``pool_local``: the output is local features (B, n, d); their mean is embedded.
    """
    parts = []
    for start in range(0, x.shape[0], batch):
        inputs = _cast(x[start:start + batch], dtype)
        if device == "cuda":
            import cupy

            inputs = cupy.asarray(inputs)
        out, _ = model.forward(inputs)
        y = out[0] if isinstance(out, tuple) else out
        y = np.asarray(to_numpy(y), dtype=np.float64)
        if pool_local:
            y = y.mean(axis=1)
        parts.append(y)
    y = np.concatenate(parts)
    return y / np.maximum(np.linalg.norm(y, axis=1, keepdims=True), 1e-300)


def map_at_r(embeddings: np.ndarray, labels: np.ndarray) -> float:
    """MAP@R of same-set retrieval (Euclidean) by :func:`refdml.gpu.metrics.retrieval_metrics`
    (on NumPy its CPU twin: the reference's metrics exactly, compiled)."""
    from refdml.gpu.metrics import retrieval_metrics

    return float(retrieval_metrics(embeddings, labels, k=(1,))["mean_average_precision_at_r"])


def map_at_r_from_distances(distances: np.ndarray, labels: np.ndarray) -> float:
    r"""MAP@R of same-set retrieval from a (N, N) distance matrix (ties broken by index).

    For query ``i`` with ``R_i`` other samples of its class, rank the others by distance;
    ``MAP@R_i = (1/R_i) sum_{k <= R_i} P@k [k-th neighbour relevant]``; the mean over
    queries with ``R_i >= 1``.
    """
    d = np.array(distances, dtype=np.float64)
    labels = np.asarray(labels)
    n = d.shape[0]
    np.fill_diagonal(d, np.inf)
    scores = []
    for i in range(n):
        r = int((labels == labels[i]).sum()) - 1
        if r < 1:
            continue
        order = np.argsort(d[i], kind="stable")[:r]
        rel = (labels[order] == labels[i]).astype(np.float64)
        precision = np.cumsum(rel) / np.arange(1, r + 1)
        scores.append(float((precision * rel).sum() / r))
    return float(np.mean(scores))


def covering_radius(embeddings, labels, proxies, proxy_labels) -> float:
    """``max_i min_{p of class y_i} ||e_i - p/||p|| ||`` (as ASAPObjective.covering_radius)."""
    e = np.asarray(embeddings, dtype=np.float64)
    y = np.asarray(labels)
    p = np.asarray(proxies, dtype=np.float64)
    p = p / np.maximum(np.linalg.norm(p, axis=1, keepdims=True), 1e-300)
    pl = np.asarray(proxy_labels)
    radius = 0.0
    for c in np.unique(y):
        own, x = p[pl == c], e[y == c]
        d2 = ((x[:, None, :] - own[None, :, :]) ** 2).sum(axis=2)
        radius = max(radius, float(np.sqrt(d2.min(axis=1).max())))
    return radius


@dataclass(frozen=True)
class Fitted:
    """What :func:`fit` returns: the curves, the selected epoch and how the run ended.

    Attributes
    ----------
    curves : dict of str to list of float
        ``train_loss`` and ``evaluate()``'s keys per epoch (entry 0 the untrained model,
        ``train_loss`` NaN there); they end at the last epoch trained.
    selected_epoch : int
        The epoch whose parameters the model and the objective hold (:func:`fit`).
    epochs_trained : int
        The last epoch trained (``epochs``, or the early stop's epoch).
    stopped_early : bool
        Whether ``patience`` ran out (which ends the run, at the latest at ``epochs``).
    instance_starts : tuple of int or None
        The epochs that started a problem instance (``instance_every`` or
        ``instance_patience``); None without problem instances.
    """

    curves: dict[str, list[float]]
    selected_epoch: int
    epochs_trained: int
    stopped_early: bool
    instance_starts: tuple[int, ...] | None = None

    @property
    def still_rising(self) -> bool:
        """The selected epoch is the last one trained and no early stop ended the run: the
        budget did, while the ``select`` curve was still at its best (no plateau seen)."""
        return self.selected_epoch == self.epochs_trained and not self.stopped_early

    def plateau(self) -> dict[str, float]:
        """``epochs_trained``, ``stopped_early`` and ``still_rising`` (1.0 / 0.0) and, with
        problem instances, ``instances`` (how many ran), as metrics-row entries."""
        row = {"epochs_trained": float(self.epochs_trained),
               "stopped_early": float(self.stopped_early),
               "still_rising": float(self.still_rising)}
        if self.instance_starts is not None:
            row["instances"] = float(len(self.instance_starts))
        return row

    def metrics(self) -> dict[str, float]:
        """:func:`at_epoch` of the selected epoch plus :meth:`plateau`'s entries."""
        return {**at_epoch(self.curves, self.selected_epoch), **self.plateau()}


def fit(model, objective, train_x: np.ndarray, train_y: np.ndarray, *, epochs: int, lr: float,
        n_classes_per_batch: int, n_samples_per_class: int, seed: int, dtype,
        evaluate: Callable[[], dict[str, float]], after_step: Callable[[], None] | None = None,
        instance_every: int | None = None, instance_patience: int | None = None,
        instance_embed: Callable[[], Any] | None = None,
        select: str | None = None, patience: int | None = None,
        plateau_factor: float | None = None, plateau_patience: int | None = None,
        betas: tuple[float, float] = (0.9, 0.999), weight_decay: float = 0.0,
        proxy_lr_multiplier: float = 1.0, warmup_epochs: int = 0,
        device: str = "cpu") -> Fitted:
    """Train for ``epochs`` epochs; return a :class:`Fitted`: the curves (``train_loss`` and
    ``evaluate()``'s keys, entry 0 the untrained model, ``train_loss`` NaN there), the
    selected epoch and how the run ended. The selected epoch: with ``select`` (a key of
    ``evaluate()``), the epoch in 1..``epochs`` of its highest value (the first of ties),
    whose parameters the model and objective hold on return (module docstring); without,
    the last epoch. ``patience`` (needs ``select``): stop after that many epochs without a
    strict improvement of the ``select`` curve; None trains all ``epochs``.

    Problem instances (an objective with ``new_problem_instance``, ASAP's): every
    ``instance_every`` epochs, or with ``instance_patience`` (needs ``select``) at the
    epoch after that many epochs without a strict improvement of the ``select`` curve over
    the current instance's best (:class:`~refdml.train.trainer.TrainingLoop`); at most one
    of the two. ``plateau_factor`` and ``plateau_patience`` (both or neither; need
    ``select``): :class:`~refdml.train.ReduceOnPlateau` in mode "max" on the ``select``
    curve, the learning rate times ``plateau_factor`` after ``plateau_patience`` epochs
    without an improvement.

    The papers' protocol (docs/reproduce.md, "Training protocols"): Adam with ``betas`` and
    coupled ``weight_decay``; the objective's parameters (proxies) in a group of their own at
    ``proxy_lr_multiplier`` times ``lr``; for the first ``warmup_epochs`` epochs only the
    embedding layer (the model's last ``Linear``) and the objective's parameters train.

    ``device``: where the loop runs (``"cuda"``: CuPy; the model must live there).
    Raises :class:`~refdml.train.TrainingDiverged` (also a ``FloatingPointError``) on a
    NaN or inf loss or gradient."""
    if (plateau_factor is None) != (plateau_patience is None):
        raise ValueError(f"plateau_factor == {plateau_factor!r} and plateau_patience == "
                         f"{plateau_patience!r}: the reduce-on-plateau schedule needs both "
                         "(or neither: no schedule)")
    optimizer, warmup_params = build_optimizer(
        model, objective, lr=lr, betas=betas, weight_decay=weight_decay,
        proxy_lr_multiplier=proxy_lr_multiplier, warmup_epochs=warmup_epochs)
    schedule = None if plateau_factor is None else ReduceOnPlateau(
        optimizer, mode="max", factor=plateau_factor, patience=plateau_patience)
    sampler = PKBatchSampler(train_y, n_classes_per_batch=n_classes_per_batch,
                             n_samples_per_class=n_samples_per_class, rng=seed + 2)
    sink = MemorySink(restore_best=True)
    # blas_threads=None: a task runs under whatever BLAS setting its worker has; no side
    # thread: the workers already use every core, one task each.
    loop = TrainingLoop(model, objective, optimizer, train_sampler=sampler,
                        train_data=(train_x, train_y), epochs=epochs, blas_threads=None,
                        side_thread=False,
                        seed=seed + 3, dtype=dtype, device=device, progress=False,
                        after_step=after_step, schedule=schedule,
                        instance_every=instance_every, instance_patience=instance_patience,
                        instance_embed=instance_embed,
                        evaluate=evaluate, select=select, select_from=1, sink=sink,
                        early_stopping_patience=patience, warmup_epochs=warmup_epochs,
                        warmup_params=warmup_params)
    loop.fit()
    curves = sink.curves(["train_loss", *loop.evaluation_keys])
    curves["train_loss"][0] = math.nan    # the row's None: no training before epoch 1
    best = loop.epoch if sink.best_epoch is None else sink.best_epoch
    instances = (None if instance_every is None and instance_patience is None
                 else tuple(loop.instance_starts))
    return Fitted(curves=curves, selected_epoch=best, epochs_trained=loop.epoch,
                  stopped_early=loop.stopped_early, instance_starts=instances)


def at_epoch(curves: dict[str, list[float]], epoch: int) -> dict[str, float]:
    """Every curve's value at ``epoch`` (``train_loss`` as ``final_train_loss``: the loss
    of the selected epoch), the epoch itself as ``selected_epoch`` and, where the curves
    have ``test_map_at_r``, its epoch-0 value (the untrained model) as
    ``untrained_test_map_at_r``."""
    row = {("final_train_loss" if k == "train_loss" else k): v[epoch]
           for k, v in curves.items()}
    row["selected_epoch"] = float(epoch)
    if "test_map_at_r" in curves:     # epoch 0: the untrained model (the competence gate's level)
        row["untrained_test_map_at_r"] = curves["test_map_at_r"][0]
    return row
