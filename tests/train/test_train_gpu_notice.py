"""The first training epoch on a GPU says that it compiles the kernels (issue 38, item 5).

CuPy compiles its kernels through NVRTC and numba-cuda refdml's at their first call, so
the first epoch on a GPU is the slow one; refdml.train's loop says so once per process,
before its first work on the device. Checked on the CuPy stand-in (tests/cupy_standin,
installed in a fresh interpreter, as scripts/ci_cupy_standin.sh runs ``refdml train``):
one line for two runs in one process, none with ``--no-progress`` or ``REFDML_QUIET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CONFIG = ["n_classes = 4", "n_classes_per_batch = 4", "n_train_per_class = 8",
          "n_val_per_class = 4", "n_test_per_class = 4", 'head = "gsp"', "n_prototypes = 3",
          "dim = 4", "embedding_dim = 4"]
LINE = "refdml: the first epoch on the GPU compiles its kernels"

_RUNS = r'''
import sys
sys.path.insert(0, sys.argv[1])
import cupy_standin

cupy_standin.install()
from refdml.cli import main

out = sys.argv[2]
for run, extra in enumerate(sys.argv[3:]):
    flags = extra.split()
    code = main(["train", "--study", "tokens", "--config", f"{out}/run.toml", "--out",
                 f"{out}/run{run}", "--seed", "0", "--epochs", "1", "--device", "cuda", *flags])
    assert code == 0, code
    print(f"run {run} done", file=sys.stderr, flush=True)
'''


def _train(tmp_path: Path, *runs: str, **env: str) -> list[str]:
    """stderr lines of ``refdml train --device cuda`` runs (extra flags each) in one process."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "run.toml").write_text("\n".join(CONFIG) + "\n")
    environment = {k: v for k, v in os.environ.items() if k != "REFDML_QUIET"}
    environment.update(REFDML_CUPY_STANDIN="1", NUMBA_ENABLE_CUDASIM="1",
                       REFDML_GPU_KERNELS="array", **env)
    result = subprocess.run([sys.executable, "-c", _RUNS, str(TESTS), str(tmp_path), *runs],
                            cwd=tmp_path, env=environment, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    return [line for line in result.stderr.splitlines()
            if line.startswith(LINE) or line.startswith("run ")]


def test_the_first_epoch_on_a_gpu_says_it_compiles_once_per_process(tmp_path):
    lines = _train(tmp_path, "--no-progress", "", "")
    assert lines[0] == "run 0 done"                # --no-progress: no line
    assert lines[1].startswith(LINE)               # the first run that may print
    assert "CuPy's in " in lines[1] and "NUMBA_CACHE_DIR" in lines[1]
    assert lines[2:] == ["run 1 done", "run 2 done"]   # once per process
    assert _train(tmp_path / "quiet", "", REFDML_QUIET="1") == ["run 0 done"]
