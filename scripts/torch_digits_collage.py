r"""The digits-collage model in plain PyTorch with refdml's GSP layer, checked against refdml.train.

    python scripts/torch_digits_collage.py                   # 20 steps, float64, batch 64
    python scripts/torch_digits_collage.py --steps 5 --samples-per-class 4

The model is GSP's digits-collage study (supp. 2.2; docs/train.md): three 3x3 convolutions
with ReLU, a per-location linear map to local features ``(B, n, d)``, the GSP pooling
layer, a linear embedding and an L2 normalisation; the objective is GSP Alg. 1,
``(1 - lambda) L_contrastive(y) + lambda L_ZSR(z)``, with learned class embeddings. Every
layer is PyTorch's own (``torch.nn``), differentiated by autograd and trained by
``torch.optim.Adam``, except what PyTorch does not have:

- the GSP layer, :class:`refdml.torch.GSPPool` (its prototypes an ``nn.Parameter``);
- the contrastive loss and the zero-shot regulariser, :class:`refdml.torch.ContrastiveLoss`
  and :class:`refdml.torch.ZeroShotLoss` (``refdml.torch.op("losses.contrastive")`` and
  ``refdml.torch.op("crossbatch.zero_shot_loss")`` as modules).

Their forwards are refdml's, their backwards refdml's hand-derived ones (custom ops,
``torch.library``). :class:`CollageNet`, :class:`GSPObjective` and :func:`train_step` are
what a PyTorch user writes; the rest of the file is the check: it builds the same run with
``refdml.train`` (``refdml train --study digits-collage`` in float64), copies its initial
parameter values into the PyTorch model, trains both on the same batches of the run's own
P x K sampler, with the same class-disjoint splits of the zero-shot regulariser (drawn
from a copy of the objective's generator, as refdml's objective draws them), and prints
both loss trajectories and their largest relative difference. Exit status 1 when that
difference is above ``--tolerance`` (1e-10): the two run the same maths in float64, so
only rounding may differ.

A refdml step is what :class:`refdml.train.Trainer` does per batch: model forward,
objective forward and backward, model backward, Adam step, ``zero_grad``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import sys
import tempfile
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import nn

import refdml.torch
from refdml.crossbatch import class_disjoint_split

__all__ = ["CollageNet", "GSPObjective", "compare", "main", "train_step"]

STEPS = 20
TOLERANCE = 1e-10


# =========================================================================== the PyTorch model
class CollageNet(nn.Module):
    """Images ``(B, 1, H, W)`` -> ``(y (B, embedding_dim), z (B, n_prototypes))``.

    ``y`` is the L2-normalised embedding of the GSP-pooled local features, ``z`` the
    attribute histogram of the GSP layer (what the zero-shot regulariser sees).
    """

    def __init__(self, *, channels: Sequence[int] = (16, 32, 32),
                 strides: Sequence[int] = (1, 2, 2), local_dim: int = 64,
                 n_prototypes: int = 128, mu: float = 0.2, inverse_temperature: float = 10.0,
                 embedding_dim: int = 64) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 1
        for c_out, stride in zip(channels, strides, strict=True):
            layers += [nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1),
                       nn.ReLU()]
            c_in = c_out
        self.trunk = nn.Sequential(*layers)
        self.local = nn.Linear(c_in, local_dim)        # a 1x1 convolution, channels last
        self.gsp = refdml.torch.GSPPool(n_prototypes, local_dim, mu=mu,
                                        inverse_temperature=inverse_temperature)
        self.embed = nn.Linear(local_dim, embedding_dim)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        maps = self.trunk(images)                                   # (B, C, H', W')
        features = self.local(maps.flatten(2).transpose(1, 2))      # (B, H' W', d)
        pooled, z = self.gsp(features)                              # (B, d), (B, m)
        y = self.embed(pooled)
        return y / torch.linalg.vector_norm(y, dim=1, keepdim=True), z


class GSPObjective(nn.Module):
    """GSP Alg. 1: ``(1 - lambda_) contrastive(y) + lambda_ ZSR(z)``, with learned class
    embeddings ``(n_classes, attribute_dim)`` (drawn N(0, 1/attribute_dim))."""

    def __init__(self, n_classes: int, attribute_dim: int, *, lambda_: float = 0.5,
                 ridge: float = 0.05, scale: float = 9.5, **contrastive_options) -> None:
        super().__init__()
        self.lambda_ = lambda_
        self.class_embeddings = nn.Parameter(
            torch.randn(n_classes, attribute_dim) / math.sqrt(attribute_dim))
        self.contrastive = refdml.torch.ContrastiveLoss(**contrastive_options)
        self.zero_shot = refdml.torch.ZeroShotLoss(ridge=ridge, scale=scale)

    def forward(self, y, z, labels, split):
        """``split``: a boolean mask of the batch, the two class-disjoint halves of the
        zero-shot regulariser (:func:`refdml.crossbatch.class_disjoint_split`)."""
        loss = y.new_zeros(())
        if self.lambda_ < 1.0:
            loss = loss + (1.0 - self.lambda_) * self.contrastive(y, labels)
        if self.lambda_ > 0.0:
            loss = loss + self.lambda_ * self.zero_shot(z, labels, self.class_embeddings, split)
        return loss


def train_step(net: CollageNet, objective: GSPObjective, optimizer: torch.optim.Optimizer,
               images: torch.Tensor, labels: torch.Tensor, split: torch.Tensor) -> float:
    """One step: forward, loss, backward, Adam; returns the loss."""
    optimizer.zero_grad()
    y, z = net(images)
    loss = objective(y, z, labels, split)
    loss.backward()
    optimizer.step()
    return loss.item()


# =========================================================================== the check
def build_refdml_run(config: dict):
    """refdml.train's digits-collage run in float64 (``epochs = 0``: nothing trained)."""
    from refdml.train.runs import build_run

    options = {"dtype": "float64", "epochs": 0, "progress": False, **config}
    return build_run("digits-collage", options, out_dir=tempfile.mkdtemp(prefix="refdml-torch-"))


def torch_twin_of(run) -> tuple[CollageNet, GSPObjective, torch.optim.Adam]:
    """The PyTorch model, objective and Adam of ``run``, with its initial values copied."""
    c = run.config
    if c.head != "gsp" or not c.zero_shot or c.loss != "contrastive":
        raise ValueError(f"the PyTorch model is GSP + ZSR with the contrastive loss; the run "
                         f"has head {c.head!r}, zero_shot {c.zero_shot!r}, loss {c.loss!r}")
    net = CollageNet(channels=c.conv_channels, strides=c.conv_strides, local_dim=c.local_dim,
                     n_prototypes=c.n_prototypes, mu=c.mu,
                     inverse_temperature=c.inverse_temperature,
                     embedding_dim=c.embedding_dim).double()
    ours = run.objective
    objective = GSPObjective(ours.class_embeddings.value.shape[0],
                             ours.class_embeddings.value.shape[1], lambda_=ours.lambda_,
                             ridge=ours.ridge, scale=ours.scale,
                             **ours.base.hyperparameters).double()
    # refdml's parameters in forward order; PyTorch's in the order the modules were made,
    # which is the same order of the same layers.
    theirs = [p for _, p in run.model.named_parameters()]
    mine = list(net.parameters())
    if [tuple(p.value.shape) for p in theirs] != [tuple(p.shape) for p in mine]:
        raise ValueError("the PyTorch model's parameters do not match refdml's: "
                         f"{[n for n, _ in run.model.named_parameters()]}")
    with torch.no_grad():
        for param, value in zip(mine, theirs):
            param.copy_(torch.from_numpy(np.asarray(value.value)))
        objective.class_embeddings.copy_(torch.from_numpy(ours.class_embeddings.value))
    optim = run.trainer.optimizer
    groups = {group.name: group.lr_multiplier for group in optim.param_groups}
    optimizer = torch.optim.Adam(
        [{"params": list(net.parameters()), "lr": optim.lr * groups["model"]},
         {"params": list(objective.parameters()), "lr": optim.lr * groups["objective"]}],
        lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay)
    return net, objective, optimizer


def batches(run, steps: int) -> list[np.ndarray]:
    """The first ``steps`` batches (sample indices) of the run's P x K sampler, epoch after
    epoch, as the Trainer draws them."""
    def forever() -> Iterator[np.ndarray]:
        while True:
            yield from run.trainer.train_sampler
    return [np.asarray(batch) for batch in itertools.islice(forever(), steps)]


def refdml_losses(run, chosen: list[np.ndarray]) -> list[float]:
    """refdml.train's loss at each of the batches ``chosen`` (the Trainer's step)."""
    trainer, model, objective = run.trainer, run.model, run.objective
    losses = []
    trainer.optimizer.zero_grad()
    for batch in chosen:
        x, _ = trainer._to_device(trainer.train_x[batch], np.zeros(0))
        outputs, ctx = model.forward(x)
        value, objective_ctx = objective.forward(outputs, trainer.train_y[batch])
        model.backward(ctx, objective.backward(objective_ctx, 1.0))
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        losses.append(float(value))
    return losses


def torch_losses(run, chosen: list[np.ndarray], split_rng: np.random.Generator) -> list[float]:
    """The PyTorch twin's loss at each batch, from ``run``'s initial values; the splits are
    drawn from ``split_rng`` (a copy of refdml's objective's generator before training)."""
    net, objective, optimizer = torch_twin_of(run)
    losses = []
    for batch in chosen:
        images = torch.from_numpy(run.trainer.train_x[batch].astype(np.float64))
        host_labels = run.trainer.train_y[batch]
        split = class_disjoint_split(host_labels, rng=split_rng)
        losses.append(train_step(net, objective, optimizer, images,
                                 torch.from_numpy(host_labels), torch.from_numpy(split)))
    return losses


def compare(steps: int = STEPS, config: dict | None = None) -> dict:
    """Both trajectories over ``steps`` steps of the run of ``config`` (keys of ``refdml
    train --study digits-collage``) and their largest relative difference."""
    run = build_refdml_run(config or {})
    chosen = batches(run, steps)
    # The PyTorch side starts from the values before refdml trains them: its twin is made
    # from a second, identical run (same seed), so the first one can be trained in place.
    twin_run = build_refdml_run(config or {})
    split_rng = copy.deepcopy(twin_run.objective.rng)
    ours = refdml_losses(run, chosen)
    theirs = torch_losses(twin_run, chosen, split_rng)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ours, theirs))
    return {"refdml": ours, "torch": theirs, "max_relative_difference": worst}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps ({STEPS})")
    parser.add_argument("--classes-per-batch", type=int, default=None,
                        help="P of the P x K batches (the study's 8)")
    parser.add_argument("--samples-per-class", type=int, default=None,
                        help="K of the P x K batches (the study's 8)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (0)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE,
                        help=f"largest relative difference accepted ({TOLERANCE:g})")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps == {args.steps}, must be >= 1")
    config = {"seed": args.seed}
    if args.classes_per_batch is not None:
        config["n_classes_per_batch"] = args.classes_per_batch
    if args.samples_per_class is not None:
        config["n_samples_per_class"] = args.samples_per_class
    result = compare(args.steps, config)
    print(f"digits-collage, float64, {args.steps} steps: refdml.train against PyTorch "
          f"{torch.__version__} with refdml.torch.GSPPool")
    print(f"{'step':>4}  {'refdml.train':>22}  {'PyTorch':>22}  {'rel. diff':>9}")
    for step, (a, b) in enumerate(zip(result["refdml"], result["torch"]), start=1):
        print(f"{step:>4}  {a:>22.16g}  {b:>22.16g}  {abs(a - b) / abs(a):>9.1e}")
    worst = result["max_relative_difference"]
    verdict = "within" if worst <= args.tolerance else "ABOVE"
    print(f"max relative difference {worst:.2e}, {verdict} the tolerance {args.tolerance:g}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
