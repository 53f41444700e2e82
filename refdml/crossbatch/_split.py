"""The random class-disjoint split of a batch that both cross-batch losses use."""

from __future__ import annotations

import numpy as np

from refdml._validation import as_label_array, check_rng

__all__ = ["class_disjoint_split"]


def class_disjoint_split(labels, *, rng=None) -> np.ndarray:
    """A boolean mask over the batch: ``True`` = half 1, ``False`` = half 2.

    The classes are visited in a random order (from ``rng``) and each is put whole into
    the half that has fewer samples so far, so the halves are class-disjoint, cover the
    batch, both non-empty and balanced in size up to the largest class. Deterministic
    given ``labels`` and ``rng``. Fewer than two classes: ValueError.
    """
    labels = as_label_array(labels, "labels")
    return draw_split(labels, check_rng(rng))


def draw_split(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    classes, counts = np.unique(labels, return_counts=True)
    if classes.size < 2:
        raise ValueError(
            f"labels contain {classes.size} class(es); a batch with fewer than two classes "
            "cannot be split into two class-disjoint halves"
        )
    sizes = [0, 0]
    in_first = np.zeros(classes.size, dtype=bool)
    for k in rng.permutation(classes.size):
        half = 0 if sizes[0] <= sizes[1] else 1
        in_first[k] = half == 0
        sizes[half] += counts[k]
    return np.isin(labels, classes[in_first])


def check_mask(split, n_samples: int) -> np.ndarray:
    """A boolean mask of length ``n_samples`` with both halves non-empty (a copy)."""
    mask = np.asarray(split)
    if mask.dtype != bool:
        raise TypeError(f"split must be a boolean mask over the batch, got dtype {mask.dtype}")
    if mask.shape != (n_samples,):
        raise ValueError(f"split has shape {mask.shape}, expected ({n_samples},) (one per sample)")
    if mask.all() or not mask.any():
        raise ValueError("split leaves one half empty; both halves need samples")
    return mask.copy()


def check_split(split, labels: np.ndarray, rng) -> np.ndarray:
    """The given class-disjoint ``split``, or one drawn from ``rng`` when it is None."""
    if split is None:
        return draw_split(labels, check_rng(rng))
    mask = check_mask(split, labels.shape[0])
    shared = np.intersect1d(labels[mask], labels[~mask])
    if shared.size:
        raise ValueError(f"split is not class-disjoint: classes {shared.tolist()} are in both halves")
    return mask
