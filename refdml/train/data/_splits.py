r"""Class-disjoint train / validation / test splits.

Deep metric learning is evaluated on classes never seen in training (zero-shot retrieval):
:func:`class_disjoint_split` partitions the *classes* (not the samples), so every class lies
in exactly one split and every sample follows its class.

Sizes: with ``C`` classes and fractions ``(f_train, f_val, f_test)`` (normalised to sum 1),
``n_val = max(1, rint(f_val C))``, ``n_test = max(1, rint(f_test C))`` and the train split
gets the rest, which must be at least one class; otherwise a ValueError names the counts.
The classes are assigned by a seeded permutation of the sorted distinct labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import as_label_array, check_rng, check_scalar

__all__ = ["ClassSplit", "class_disjoint_split"]


@dataclass(frozen=True)
class ClassSplit:
    """Sample indices (sorted int64) and class labels (sorted int64) of each split."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    train_classes: np.ndarray
    val_classes: np.ndarray
    test_classes: np.ndarray


def class_disjoint_split(
    labels: Any, *, rng: Any, fractions: tuple[float, float, float] = (0.5, 0.25, 0.25)
) -> ClassSplit:
    """Partition the classes of ``labels`` (N,) into train / validation / test (see module doc)."""
    labels = as_label_array(labels, "labels")
    if not isinstance(fractions, (tuple, list)) or len(fractions) != 3:
        raise TypeError(f"fractions must be a tuple of 3 numbers (train, val, test), got {fractions!r}")
    f = np.array([check_scalar(v, f"fractions[{i}]", low=0.0, low_inclusive=False)
                  for i, v in enumerate(fractions)])
    f = f / f.sum()
    gen = check_rng(rng)
    classes = np.unique(labels)
    n_classes = classes.shape[0]
    n_val = max(1, int(np.rint(f[1] * n_classes)))
    n_test = max(1, int(np.rint(f[2] * n_classes)))
    n_train = n_classes - n_val - n_test
    if n_train < 1:
        raise ValueError(
            f"labels has {n_classes} classes; a class-disjoint split with fractions "
            f"{tuple(fractions)} needs at least 3 (one per split), got {n_val} validation "
            f"and {n_test} test classes and none left for training"
        )
    order = classes[gen.permutation(n_classes)]
    parts = (order[:n_train], order[n_train:n_train + n_val], order[n_train + n_val:])
    train_c, val_c, test_c = (np.sort(p) for p in parts)

    def members(cls: np.ndarray) -> np.ndarray:
        return np.flatnonzero(np.isin(labels, cls)).astype(np.int64)

    return ClassSplit(
        train=members(train_c), val=members(val_c), test=members(test_c),
        train_classes=train_c, val_classes=val_c, test_classes=test_c,
    )
