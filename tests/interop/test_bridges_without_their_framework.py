"""Without torch, ``import refdml.torch`` is one line naming the extra (refdml's
MissingExtraError), not a traceback from deep inside."""

from __future__ import annotations

import subprocess
import sys


def test_refdml_torch_without_torch_names_its_extra():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from refdml.exceptions import MissingExtraError\n"
            "try:\n    import refdml.torch\n"
            "except MissingExtraError as error:\n    print(error)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ('needs the "torch" extra (torch is not installed): '
                                   'pip install "refdml[torch]"')


def test_no_test_folder_shadows_a_framework():
    # tests/ is on sys.path (its conftest.py), so a folder tests/torch/ is a namespace
    # package `torch` wherever torch is not installed: importorskip("torch") then imports it
    # instead of skipping, and the docs' examples think torch is there.
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    shadows = [name for name in ("torch", "jax", "jaxlib", "cupy", "numba", "ot", "dask")
               if (tests / name).is_dir()]
    assert not shadows, f"test folders named like an importable package: {shadows}"
