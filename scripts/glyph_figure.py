"""The glyph benchmark's figure in the docs: classes in their fonts (clean and distorted) and
a few test collages, the class cell outlined.

    python scripts/glyph_figure.py docs/img/glyphs_and_collages.png

The data are those of ``refdml reproduce``'s glyph studies (seed 0, the default selection of
classes; collages as in ``gsp.glyph_collage``: 28-pixel glyphs, the distractor families).
"""

from __future__ import annotations

import sys

from refdml.train.data import GLYPH_FAMILIES, glyph_classes, make_glyph_collages
from refdml.train.plots import plot_glyphs


def main(out: str) -> None:
    classes = glyph_classes()
    collages = make_glyph_collages(rng=0, size=28, instances_per_font=1,
                                   n_background=(0, 0, 0), families=tuple(GLYPH_FAMILIES))
    plot_glyphs(classes, out, n_classes=8, collages=collages.test, n_collages=8,
                title=f"{len(classes)} glyph classes (8 shown) in the fonts that draw them, "
                      "clean and distorted; below, test collages (class cell in red)")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
