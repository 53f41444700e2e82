"""refdml's layers pass refdml's own conformance: ``check_implementation`` run on the
wrapped ops (``refdml.torch.op(name)``, differentiated by torch.autograd) against the
float64 reference, for every bridged catalogue name in float64, float32 and bfloat16, on
the catalogue's seeds, hard cases and bad inputs (the property search on a few in float64).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import refdml.torch as rt  # noqa: E402
from refdml.conformance import check_implementation  # noqa: E402


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", rt.names())
def test_the_wrapped_op_passes_refdmls_conformance(name, dtype):
    report = check_implementation(rt.op(name), name, framework="torch", dtype=dtype,
                                  search=False)
    assert report.passed, report.summary()


@pytest.mark.parametrize("name", ["gsp.pool", "losses.proxy_nca", "normalize.l2_normalize"])
def test_the_wrapped_op_passes_the_property_search(name):
    report = check_implementation(rt.op(name), name, framework="torch", dtype="float64",
                                  search=True, max_examples=10)
    assert report.passed, report.summary()


def test_refdml_conform_from_the_shell_on_a_wrapped_op(tmp_path):
    # What a user types to check refdml's own layer as they would check theirs.
    (tmp_path / "my_layers.py").write_text(
        'import refdml.torch\n\ngsp_pool = refdml.torch.op("gsp.pool")\n', encoding="utf-8")
    paths = [str(tmp_path), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    done = subprocess.run(
        [sys.executable, "-m", "refdml.cli", "conform", "--op", "gsp.pool", "--framework",
         "torch", "--dtype", "bfloat16", "--no-search", "my_layers:gsp_pool"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pass" in done.stdout.lower(), done.stdout
