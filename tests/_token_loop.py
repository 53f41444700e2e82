"""The tiny token model the training-loop tests share (tests/train/test_train_loop.py,
test_train_warmup.py, test_train_instance_patience.py): Embedding -> GAP -> Linear ->
L2Normalize on 4 classes of the token study, the contrastive loss, Adam at 1e-2, batches of
4 x 4 (4 steps per epoch), float64."""

from __future__ import annotations

import numpy as np

from refdml.train import Adam
from refdml.train.data import PKBatchSampler, make_token_splits
from refdml.train.layers import GAP, Embedding, L2Normalize, Linear, Sequential
from refdml.train.objectives import LossObjective

DIM = 16


def token_loop_pieces(seed=0) -> dict:
    """The keyword arguments of a ``TrainingLoop`` (or ``Trainer``) over the tiny model."""
    splits = make_token_splits(rng=seed, n_classes=4, n_train_per_class=16,
                               n_val_per_class=8, n_test_per_class=8)
    rng = np.random.default_rng(seed)
    model = Sequential([Embedding(splits.train.n_tokens, DIM, rng=rng), GAP(),
                        Linear(DIM, DIM, rng=rng), L2Normalize()])
    optimizer = Adam(model.parameters(), lr=1e-2)
    sampler = PKBatchSampler(splits.train.labels, n_classes_per_batch=4,
                             n_samples_per_class=4, rng=seed)
    return dict(model=model, objective=LossObjective("contrastive"), optimizer=optimizer,
                train_sampler=sampler, train_data=splits.train, val_data=splits.val,
                test_data=splits.test, seed=seed, dtype="float64", progress=False)


class InstanceRecorder:
    """The contrastive loss with a ``new_problem_instance`` that records, in ``calls``, the
    epoch each problem instance starts at (the loop's last finished epoch + 1; set ``loop``
    to the TrainingLoop), or None without a loop."""

    def __init__(self):
        self.base = LossObjective("contrastive")
        self.loop = None
        self.calls = []

    def parameters(self):
        return []

    def forward(self, outputs, labels):
        return self.base.forward(outputs, labels)

    def backward(self, ctx, d_value):
        return self.base.backward(ctx, d_value)

    def new_problem_instance(self, embeddings, labels, rng):
        self.calls.append(None if self.loop is None else self.loop.epoch + 1)
