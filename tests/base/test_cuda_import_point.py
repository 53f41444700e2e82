"""refdml.gpu._support.cuda, the one import point of numba.cuda, and its compatibility step.

numba-cuda 0.30.x registers an overload of ``np.row_stack`` at its first compilation, and
NumPy 2.5 removed that alias: every CUDA kernel failed to compile there (Python 3.12+ with
NumPy 2.5, as on the GPU machine). These tests take ``row_stack`` away from whatever NumPy
runs them (in a child process), so that the NumPy 2.5 condition is tested on every NumPy,
and compile a kernel for sm_90 without a GPU (numba-cuda's ``compile_ptx``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
needs_numba_cuda = pytest.mark.skipif(not NUMBA_CUDA, reason="numba-cuda is not installed "
                                      "(refdml[gpu])")

# Compiles a small kernel for sm_90 in a child process whose NumPy has no row_stack (as
# NumPy 2.5), importing numba.cuda either through refdml's import point or directly.
_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    if hasattr(np, "row_stack"):              # NumPy < 2.5: make it look like 2.5
        del np.row_stack
        np.__all__ = [name for name in np.__all__ if name != "row_stack"]
    if sys.argv[1] == "refdml":
        from refdml.gpu._support.cuda import COMPAT_STEPS, cuda
    else:
        from numba import cuda
        COMPAT_STEPS = ()

    def axpy(a, x, y):
        i = cuda.grid(1)
        if i < y.shape[0]:
            y[i] = a * x[i] + y[i]

    try:
        ptx, _ = cuda.compile_ptx(axpy, "void(float64, float64[::1], float64[::1])",
                                  cc=(9, 0))
        error = None
    except Exception as exc:
        ptx, error = "", f"{type(exc).__name__}: {exc}"
    print(json.dumps({"steps": list(COMPAT_STEPS), "compiled": ".entry" in ptx,
                      "error": error, "row_stack_after": hasattr(np, "row_stack")}))
""")


def _run_json(script: str, *args: str, simulator: str = "0"):
    """The JSON value ``script`` prints last, run in a child Python with the simulator set."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM=simulator)
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child(how: str) -> dict:
    return _run_json(_CHILD, how)


@needs_numba_cuda
def test_without_the_step_numba_cuda_fails_on_a_numpy_without_row_stack():
    # The failure the step exists for (if numba-cuda ever stops needing it, this test says
    # so, and the step can go).
    got = _child("numba")
    assert not got["compiled"]
    assert "row_stack" in got["error"], got


@needs_numba_cuda
def test_through_the_import_point_a_kernel_compiles_and_numpy_is_left_as_it_was():
    got = _child("refdml")
    assert got["error"] is None and got["compiled"], got
    assert got["steps"] == ["numpy.row_stack placeholder while numba.cuda.np.arrayobj loads"]
    assert got["row_stack_after"] is False        # no alias appears for the user's code


def test_under_the_simulator_no_step_is_taken():
    script = ("import json, numpy as np\n"
              "if hasattr(np, 'row_stack'):\n"
              "    del np.row_stack\n"
              "    np.__all__ = [n for n in np.__all__ if n != 'row_stack']\n"
              "from refdml.gpu._support.cuda import COMPAT_STEPS, cuda\n"
              "from refdml.gpu._support import cuda as _cuda\n"
              "print(json.dumps([list(COMPAT_STEPS), _cuda._simulated(), "
              "hasattr(np, 'row_stack')]))\n")
    steps, simulator, row_stack = _run_json(script, simulator="1")
    assert steps == [] and row_stack is False
    assert simulator                              # numba.cuda is the simulator's here


def test_a_numpy_with_row_stack_needs_no_step():
    script = ("import json, numpy as np\n"
              "np.row_stack = np.vstack\n"
              "from refdml.gpu._support.cuda import COMPAT_STEPS\n"
              "print(json.dumps([list(COMPAT_STEPS), np.row_stack is np.vstack]))\n")
    assert _run_json(script) == [[], True]
