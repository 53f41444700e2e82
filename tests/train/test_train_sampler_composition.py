"""The P x K batches the papers train with, counted: 32 classes x 1 sample (the proxy
losses) and 8 classes x 4 samples (the pair losses), on about 100 classes of unequal sizes.

Counted from the outside with collections.Counter over the labels of the indices the
sampler hands out; the promises checked are those of PKBatchSampler's docstring:
every batch holds exactly P distinct classes with exactly K samples each, grouped class by
class; within an epoch a sample appears at most once (a class with fewer than K samples
gives at most one chunk: all its samples plus draws again from them); batches are made
while P classes have chunks left, so fewer than P classes end an epoch with chunks unused.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from refdml.train.data import PKBatchSampler

N_CLASSES = 100


def _labels(low: int, high: int, seed: int = 0) -> np.ndarray:
    """~100 classes with sizes drawn in [low, high], shuffled (indices not sorted by class)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(low, high + 1, size=N_CLASSES)
    labels = np.repeat(np.arange(N_CLASSES) * 3 + 7, sizes)   # ids that are not 0..C-1
    return labels[rng.permutation(labels.shape[0])]


@pytest.mark.parametrize("p,k,low,high", [
    (32, 1, 1, 9),     # the proxy losses: 32 classes x 1 sample; single-sample classes too
    (8, 4, 2, 13),     # the pair losses: 8 classes x 4 samples; classes below 4 are topped up
])
@pytest.mark.parametrize("seed", [0, 1])
def test_batches_hold_p_classes_of_k_samples(p, k, low, high, seed):
    labels = _labels(low, high, seed)
    sizes = Counter(labels.tolist())
    assert len(sizes) == N_CLASSES and len(set(sizes.values())) > 3     # unequal sizes
    sampler = PKBatchSampler(labels, n_classes_per_batch=p, n_samples_per_class=k, rng=seed)
    for epoch in range(3):
        n_batches = len(sampler)
        batches = list(sampler)
        assert len(batches) == n_batches > 0
        visits: Counter = Counter()          # chunks each class gave this epoch
        seen: Counter = Counter()            # how often each index was handed out
        for batch in batches:
            assert batch.dtype == np.int64 and batch.shape == (p * k,)
            per_class = Counter(labels[batch].tolist())
            assert len(per_class) == p and set(per_class.values()) == {k}
            # grouped class by class: row j is one class's chunk
            rows = labels[batch].reshape(p, k)
            assert all(len(set(row.tolist())) == 1 for row in rows)
            for row, chunk in zip(rows, batch.reshape(p, k)):
                cls = int(row[0])
                visits[cls] += 1
                if sizes[cls] >= k:
                    seen.update(chunk.tolist())
                else:
                    # a short class: all of its samples, the rest drawn again from them
                    assert set(chunk.tolist()) == set(np.flatnonzero(labels == cls).tolist())
        assert max(seen.values()) == 1          # no sample twice in an epoch
        unused = 0
        for cls, size in sizes.items():
            chunks = size // k if size >= k else 1
            assert visits[cls] <= chunks
            unused += visits[cls] < chunks
        assert unused < p                       # batches stop only when < P classes are left


def test_every_class_is_visited_within_a_few_epochs():
    # Not a promise of every epoch (a small class may be stranded at an epoch's end), but
    # classes are drawn in proportion to their remaining chunks: over 3 epochs of 32 x 1
    # batches each of the 100 classes comes up.
    labels = _labels(1, 9)
    sampler = PKBatchSampler(labels, n_classes_per_batch=32, n_samples_per_class=1, rng=3)
    visited = set()
    for _ in range(3):
        for batch in sampler:
            visited.update(labels[batch].tolist())
    assert visited == set(labels.tolist())
