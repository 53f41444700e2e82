"""Data for :mod:`refdml.train`: the datasets, class-disjoint splits, the P x K sampler.

- ``tokens``: the GSP synthetic token study (supp. Sec. 2.1), :func:`make_tokens`.
- ``digits-collage``: GSP's Cifar Collage rebuilt from scikit-learn's bundled 8x8 digits
  (supp. Sec. 2.2, Fig. 11), :func:`make_digits_collage`.
- ``glyphs``: about 600 character classes drawn by matplotlib's bundled fonts and distorted,
  split class-disjointly (about 180 unseen test classes), :func:`make_glyphs`, and their
  collages, :func:`make_glyph_collages`.
- ``features``: a user's ``.npz`` of local features ``(N, n, d)`` with labels, :func:`load_features`.
- :func:`class_disjoint_split` and :class:`PKBatchSampler` (seeded, resumable).

Everything random takes one ``rng`` argument (None, a seed or a numpy Generator). The data
live on the host as NumPy arrays; the trainer moves batches to the device. Recipes and the
decisions where the paper is silent: docs/train_data.md.
"""

from refdml.train.data._collage import CollageSplit, DigitsCollage, make_digits_collage
from refdml.train.data._features import FeatureSet, load_features
from refdml.train.data._glyphs import (
    GLYPH_FAMILIES,
    GLYPH_FONTS,
    GlyphClasses,
    GlyphCollages,
    GlyphDistortion,
    Glyphs,
    GlyphSplit,
    glyph_classes,
    make_glyph_collages,
    make_glyphs,
    render_glyphs,
)
from refdml.train.data._sampler import PKBatchSampler
from refdml.train.data._splits import ClassSplit, class_disjoint_split
from refdml.train.data._tokens import (
    PAPER_BATCH,
    TOKEN_VALUE_RANGE,
    TokenSamples,
    TokenSplits,
    clip_token_table,
    init_token_table,
    make_token_splits,
    make_tokens,
)

__all__ = [
    "PAPER_BATCH",
    "TOKEN_VALUE_RANGE",
    "TokenSamples",
    "TokenSplits",
    "make_tokens",
    "make_token_splits",
    "init_token_table",
    "clip_token_table",
    "CollageSplit",
    "DigitsCollage",
    "make_digits_collage",
    "GLYPH_FAMILIES",
    "GLYPH_FONTS",
    "GlyphClasses",
    "GlyphCollages",
    "GlyphDistortion",
    "GlyphSplit",
    "Glyphs",
    "glyph_classes",
    "make_glyphs",
    "make_glyph_collages",
    "render_glyphs",
    "FeatureSet",
    "load_features",
    "ClassSplit",
    "class_disjoint_split",
    "PKBatchSampler",
]
