r"""A user's local features from an ``.npz`` file, for training a pooling + embedding head.

The file holds ``features`` of shape ``(N, n, d)`` (N images, n local features each, e.g. the
``h w`` cells of a CNN feature map, d channels) and ``labels`` of shape ``(N,)``:

>>> np.savez("feats.npz", features=fmap.reshape(N, h * w, d), labels=y)  # doctest: +SKIP
>>> data = load_features("feats.npz")                                     # doctest: +SKIP

Checks (each a named error): the file exists and is an ``.npz`` archive (FileNotFoundError,
ValueError); both keys are present (KeyError listing the keys found); ``features`` is 3-d with
``N, n, d >= 1`` and real (ValueError / TypeError); every entry finite (ValueError with the
count and the first bad sample); ``labels`` 1-d of length N holding integers (integer dtype, or
floats with integral values; TypeError / ValueError otherwise); at least 2 classes and every
class with at least ``min_samples_per_class`` samples (default 2, what the P x K sampler needs
for a positive pair), ValueError listing the short classes otherwise. ``allow_pickle`` is off.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import check_float_dtype, check_scalar

__all__ = ["FeatureSet", "load_features"]


@dataclass(frozen=True)
class FeatureSet:
    """features : (N, n, d) float array (``dtype``); labels : (N,) int64."""

    features: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return int(self.labels.shape[0])


def load_features(
    path: Any,
    *,
    features_key: str = "features",
    labels_key: str = "labels",
    min_samples_per_class: int = 2,
    dtype: Any = np.float64,
) -> FeatureSet:
    """Load and check local features and labels from the ``.npz`` at ``path`` (see module doc)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    for key, name in ((features_key, "features_key"), (labels_key, "labels_key")):
        if not isinstance(key, str) or not key:
            raise TypeError(f"{name} must be a non-empty str, got {key!r}")
    min_samples_per_class = check_scalar(
        min_samples_per_class, "min_samples_per_class", low=1, integer=True)
    dtype = check_float_dtype(dtype, "dtype")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"path == {os.fspath(path)!r}: no such file")
    try:
        archive = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"path == {os.fspath(path)!r} is not a readable .npz archive: {exc}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"path == {os.fspath(path)!r} holds a single array, not an .npz archive "
                         f"with {features_key!r} and {labels_key!r}")
    with archive:
        found = sorted(archive.files)
        for key, name in ((features_key, "features_key"), (labels_key, "labels_key")):
            if key not in found:
                raise KeyError(f"{os.fspath(path)!r} has no array {key!r} ({name}); it holds {found}")
        try:
            features = archive[features_key]
            labels = archive[labels_key]
        except ValueError as exc:  # object arrays need pickle, which stays off
            raise TypeError(f"{os.fspath(path)!r}: {exc}") from None
    return FeatureSet(
        features=_check_features(features, features_key, dtype),
        labels=_check_labels(labels, labels_key, features.shape[0], min_samples_per_class),
    )


def _check_features(features: np.ndarray, key: str, dtype: Any) -> np.ndarray:
    if features.dtype == bool or not (np.issubdtype(features.dtype, np.floating)
                                      or np.issubdtype(features.dtype, np.integer)):
        raise TypeError(f"{key} must hold real numbers, got dtype {features.dtype}")
    if features.ndim != 3 or min(features.shape) < 1:
        raise ValueError(
            f"{key} must have shape (N, n, d) with N, n, d >= 1 (N samples of n local "
            f"features of dimension d), got shape {features.shape}")
    finite = np.isfinite(features)
    if not finite.all():
        bad_rows = np.flatnonzero(~finite.all(axis=(1, 2)))
        raise ValueError(
            f"{key} has {int((~finite).sum())} NaN or inf entries (first in sample "
            f"{int(bad_rows[0])}, {bad_rows.shape[0]} samples affected)")
    out = features.astype(dtype)
    if not np.isfinite(out).all():
        raise ValueError(f"{key} overflows {np.dtype(dtype)} (max |x| = {np.abs(features).max():.3g})")
    return out


def _check_labels(labels: np.ndarray, key: str, n_samples: int, min_per_class: int) -> np.ndarray:
    if labels.ndim != 1 or labels.shape[0] != n_samples:
        raise ValueError(f"{key} must have shape ({n_samples},) (one label per sample), "
                         f"got shape {labels.shape}")
    if labels.dtype == bool or not (np.issubdtype(labels.dtype, np.integer)
                                    or np.issubdtype(labels.dtype, np.floating)):
        raise TypeError(f"{key} must hold integer labels, got dtype {labels.dtype}")
    if np.issubdtype(labels.dtype, np.floating):
        integral = np.isfinite(labels) & (labels == np.round(labels))
        if not integral.all():
            first = int(np.flatnonzero(~integral)[0])
            raise ValueError(f"{key} must hold integer labels, got {labels[first].item()!r} at index {first}")
    labels = labels.astype(np.int64)
    classes, counts = np.unique(labels, return_counts=True)
    if classes.shape[0] < 2:
        raise ValueError(f"{key} has {classes.shape[0]} class; metric learning needs at least 2")
    short = classes[counts < min_per_class]
    if short.shape[0]:
        raise ValueError(
            f"{key} has {short.shape[0]} classes with fewer than min_samples_per_class == "
            f"{min_per_class} samples (first: {short[:10].tolist()}); the P x K sampler needs a "
            "positive pair per class: drop them or lower min_samples_per_class")
    return labels
