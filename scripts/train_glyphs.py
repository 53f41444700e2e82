"""Train the `glyphs` study.

    python scripts/train_glyphs.py --out DIR [--epochs N] [--config FILE.toml] ...

A thin wrapper over `refdml train --study glyphs` (refdml.train._cli);
flags and TOML keys in docs/train.md ("Running a training").
"""

import sys

from refdml.train._cli import main_for_study

if __name__ == "__main__":
    sys.exit(main_for_study("glyphs"))
