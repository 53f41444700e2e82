r"""``digits-collage``: GSP's "Cifar Collage" (supp. Sec. 2.2, Fig. 11) rebuilt from 8x8 digits.

The paper's recipe: Cifar100's 20 super-classes of 5 sub-classes each; 4 super-classes are
*shared* (background) classes; each collage stitches one image of a (foreground) class with 3
images of shared classes; the sub-classes of every super-class are split train 2 / val 1 /
test 2, so "both the background and the foreground classes are disjoint across training,
validation and test sets". Fig. 11 shows a 2 x 2 grid of 4 images, one of them the class image.

Rebuilt from scikit-learn's bundled digits (``sklearn.datasets.load_digits``: 1797 8x8 images,
values 0..16, about 180 per digit; no download):

1. **Classes.** 10 digits x 2 orientations (upright, rotated 90 degrees counter-clockwise) =
   20 classes, the stand-in for Cifar's super/sub-class structure (the two orientations of a
   digit are siblings, like two sub-classes of a super-class). Class ``2 d`` is digit ``d``
   upright, class ``2 d + 1`` digit ``d`` rotated. Each digit's images are shuffled and split in
   half between its two classes, so no image (in any orientation) belongs to two classes.
   No 180-degree rotations: a 6 turned upside down is a 9.
2. **Shared classes.** 2 digits (drawn from ``rng``) are shared; their 4 classes only ever
   appear as background and are split train 2 / val 1 / test 1 (Cifar: 8 / 4 / 8).
3. **Foreground classes.** The other 16 classes are split train 8 / val 4 / test 4
   (Cifar: 32 / 16 / 32); a split's labels are the foreground class ids.
4. **Collages.** Every image of a split's foreground classes gives ``collages_per_image``
   collages: the class image goes to a uniformly drawn cell of a 2 x 2 grid and each other
   cell gets an image of a shared class *of the same split* (class and image drawn uniformly,
   with replacement). Result: 16 x 16 images in [0, 1] (pixel / 16), shape (N, 1, 16, 16).

So no class of the validation or test split, foreground or background, is seen in training.
``foreground`` marks the class image's pixels (for the attention maps of the GSP pooling
weights). The paper's "4x4-stitched" contradicts its Fig. 11 and "one image ... and 3 images
from shared classes" (4 images): we follow the figure and the sentence, a 2 x 2 grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import check_rng, check_scalar
from refdml.exceptions import MissingExtraError

__all__ = ["CollageSplit", "DigitsCollage", "make_digits_collage"]

_N_DIGITS = 10
_N_SHARED_DIGITS = 2
_SHARED_SPLIT = (2, 1, 1)
_FOREGROUND_SPLIT = (8, 4, 4)
_TILE = 8


@dataclass(frozen=True)
class CollageSplit:
    """One split of the collage data.

    images : (N, 1, 16, 16) float64 in [0, 1].
    labels : (N,) int64 foreground class id (``2 digit + orientation``).
    foreground : (N, 16, 16) bool, True on the class image's 8 x 8 cell.
    foreground_cell : (N,) int64 grid cell of the class image (0 top-left, 1 top-right, 2, 3).
    classes : sorted foreground class ids; shared_classes : sorted background class ids.
    """

    images: np.ndarray
    labels: np.ndarray
    foreground: np.ndarray
    foreground_cell: np.ndarray
    classes: tuple[int, ...]
    shared_classes: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class DigitsCollage:
    train: CollageSplit
    val: CollageSplit
    test: CollageSplit

    @staticmethod
    def class_name(class_id: int) -> str:
        """``"3"`` for class 6 (digit 3 upright), ``"3r"`` for class 7 (digit 3 rotated)."""
        return f"{class_id // 2}{'r' if class_id % 2 else ''}"


def _class_pools(gen: np.random.Generator) -> list[np.ndarray]:
    try:
        from sklearn.datasets import load_digits  # bundled with scikit-learn: no download
    except ImportError as exc:  # the "train" extra
        raise MissingExtraError("train", "sklearn") from exc

    digits = load_digits()
    images = digits.images.astype(np.float64) / 16.0
    pools: list[np.ndarray] = []
    for d in range(_N_DIGITS):
        mine = images[digits.target == d]
        mine = mine[gen.permutation(mine.shape[0])]
        half = mine.shape[0] // 2
        pools.append(mine[:half])
        pools.append(np.rot90(mine[half:], k=1, axes=(1, 2)))
    return pools


def _compose(fg_images: np.ndarray, fg_labels: np.ndarray, shared: np.ndarray,
             pools: list[np.ndarray], gen: np.random.Generator) -> CollageSplit:
    n = fg_images.shape[0]
    cell = gen.integers(4, size=n)
    bg_class = shared[gen.integers(shared.shape[0], size=(n, 3))]
    sizes = np.array([pools[c].shape[0] for c in range(len(pools))])
    bg_index = np.floor(gen.random((n, 3)) * sizes[bg_class]).astype(np.int64)
    bg = np.empty((n, 3, _TILE, _TILE))
    for c in np.unique(bg_class):
        where = bg_class == c
        bg[where] = pools[c][bg_index[where]]
    others = np.array([[j for j in range(4) if j != p] for p in range(4)])[cell]  # (n, 3)
    rows = np.arange(n)
    tiles = np.empty((n, 4, _TILE, _TILE))
    tiles[rows, cell] = fg_images
    tiles[rows[:, None], others] = bg
    grid = tiles.reshape(n, 2, 2, _TILE, _TILE).transpose(0, 1, 3, 2, 4).reshape(n, 2 * _TILE, 2 * _TILE)
    mask = np.zeros((n, 4, _TILE, _TILE), dtype=bool)
    mask[rows, cell] = True
    mask = mask.reshape(n, 2, 2, _TILE, _TILE).transpose(0, 1, 3, 2, 4).reshape(n, 2 * _TILE, 2 * _TILE)
    return CollageSplit(
        images=grid[:, None], labels=fg_labels.astype(np.int64), foreground=mask,
        foreground_cell=cell.astype(np.int64),
        classes=tuple(int(c) for c in np.unique(fg_labels)),
        shared_classes=tuple(int(c) for c in np.sort(shared)),
    )


def make_digits_collage(*, rng: Any, collages_per_image: int = 1,
                        eval_collages_per_image: int | None = None) -> DigitsCollage:
    """Build the class-disjoint train / val / test collages (recipe in the module doc).

    ``collages_per_image`` collages per foreground image of the training split (each with
    its own cell and background draws), ``eval_collages_per_image`` (default: the same) per
    image of the validation and test splits. Several collages of one image in an evaluation
    split are near-duplicates (the same digit image on other backgrounds) that a query
    finds first, which flatters P@1; ``refdml train`` uses 1 there. Sizes at 1: about
    720 / 360 / 360 collages. Deterministic given ``rng``.
    """
    collages_per_image = check_scalar(collages_per_image, "collages_per_image", low=1, integer=True)
    eval_collages_per_image = collages_per_image if eval_collages_per_image is None else (
        check_scalar(eval_collages_per_image, "eval_collages_per_image", low=1, integer=True))
    gen = check_rng(rng)
    pools = _class_pools(gen)
    shared_digits = gen.choice(_N_DIGITS, size=_N_SHARED_DIGITS, replace=False)
    shared_classes = np.sort(np.concatenate([2 * shared_digits, 2 * shared_digits + 1]))
    fg_classes = np.setdiff1d(np.arange(2 * _N_DIGITS), shared_classes)
    shared_classes = shared_classes[gen.permutation(shared_classes.shape[0])]
    fg_classes = fg_classes[gen.permutation(fg_classes.shape[0])]
    splits = []
    s0 = f0 = 0
    for split, (n_shared, n_fg) in enumerate(zip(_SHARED_SPLIT, _FOREGROUND_SPLIT)):
        copies = collages_per_image if split == 0 else eval_collages_per_image
        shared = shared_classes[s0:s0 + n_shared]
        fg = np.sort(fg_classes[f0:f0 + n_fg])
        s0, f0 = s0 + n_shared, f0 + n_fg
        images = np.concatenate([pools[c] for c in fg])
        labels = np.concatenate([np.full(pools[c].shape[0], c) for c in fg])
        if images.size * copies >= 2**63:   # np.repeat's size would wrap (a NumPy segfault)
            name = "collages_per_image" if split == 0 else "eval_collages_per_image"
            raise ValueError(f"{name} == {copies}: {images.shape[0]} images x {copies} copies "
                             "exceed 2**63 pixels")
        images = np.repeat(images, copies, axis=0)
        labels = np.repeat(labels, copies)
        splits.append(_compose(images, labels, shared, pools, gen))
    return DigitsCollage(*splits)
