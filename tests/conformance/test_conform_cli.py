"""``refdml conform``: the user's implementation loaded from PACKAGE.MODULE:CALLABLE, the
report printed and written as JSON, exit 0 on a pass, 1 on a failure, 2 (with a message
naming the flag and the value) on bad arguments.

The implementation is a small NumPy pair of ``normalize.l2_normalize`` written to a
temporary folder: NumPy needs no optional framework, and the operator is cheap.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
import textwrap
import uuid

import pytest

from refdml.cli import main
from refdml.conformance import check_implementation

PAIR = textwrap.dedent("""\
    import numpy as np


    def forward(x):
        # Divide by the largest entry first, so that squares neither overflow nor vanish.
        peak = np.max(np.abs(x), axis=-1, keepdims=True)
        scaled = x / peak
        norm = np.sqrt(np.sum(scaled * scaled, axis=-1, keepdims=True))
        y = scaled / norm
        return y, (y, peak * norm)


    def backward(ctx, d_y):
        y, norm = ctx
        return {"x": (d_y - y * np.sum(y * d_y, axis=-1, keepdims=True)) / norm}


    def backward_without_projection(ctx, d_y):
        # The planted defect: (I - y y^T) d_y / ||x|| without its projection.
        y, norm = ctx
        return {"x": d_y / norm}


    def forward_of_rows(vectors):
        # Another signature: the adapter below maps refdml's keyword x to it.
        return forward(vectors)


    def adapter(impl, inputs):
        return impl(inputs["x"])


    not_callable = 3
""")

JAX_L2 = textwrap.dedent("""\
    import jax
    import jax.numpy as jnp


    def l2_normalize(x):
        peak = jax.lax.stop_gradient(jnp.max(jnp.abs(x), axis=-1, keepdims=True))
        scaled = x / peak
        return scaled / jnp.sqrt(jnp.sum(scaled * scaled, axis=-1, keepdims=True))
""")

FAST = ["--op", "normalize.l2_normalize", "--framework", "numpy", "--seeds", "1", "--no-search"]


@pytest.fixture
def pair_module(tmp_path, monkeypatch):
    """The name of a fresh module holding :data:`PAIR`, in ``tmp_path`` (on sys.path and
    the current folder); forgotten by ``sys.modules`` afterwards. A name of its own per
    test, so that no test sees another's module from the import cache."""
    name = f"conform_pair_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PAIR)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    importlib.invalidate_caches()
    yield name
    sys.modules.pop(name, None)


def test_a_correct_pair_passes_and_the_json_report_is_written(pair_module, tmp_path, capsys):
    out = tmp_path / "reports" / "l2.json"
    code = main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
                 *FAST, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "PASS normalize.l2_normalize (numpy, float64)" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["failures"] == []
    assert report["op"] == "normalize.l2_normalize" and report["framework"] == "numpy"
    assert "seed 0" in report["cases"]
    assert not list(out.parent.glob(".*.tmp")), "the atomic writer left its temporary file"


def test_a_broken_backward_fails_with_exit_1_and_says_where(pair_module, tmp_path, capsys):
    out = tmp_path / "broken.json"
    code = main(["conform", f"{pair_module}:forward", "--backward",
                 f"{pair_module}:backward_without_projection", *FAST, "--dtype", "float32",
                 "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 1, printed
    assert "FAIL normalize.l2_normalize (numpy, float32)" in printed
    report = json.loads(out.read_text())
    assert report["passed"] is False
    failure = report["failures"][0]
    assert (failure["case"], failure["quantity"], failure["cause"]) == ("seed 0", "grad x",
                                                                        "gradient")
    assert failure["error"] > failure["tolerance"]
    # The forward is right: every failure is in the gradient.
    assert {f["quantity"] for f in report["failures"]} == {"grad x"}


def test_an_adapter_maps_refdmls_signature_to_the_implementations(pair_module, capsys):
    code = main(["conform", f"{pair_module}:forward_of_rows", "--backward",
                 f"{pair_module}:backward", "--adapter", f"{pair_module}:adapter", *FAST])
    assert code == 0, capsys.readouterr().out


def test_a_jax_implementation_through_autodiff(tmp_path, monkeypatch, capsys):
    pytest.importorskip("jax")
    name = f"conform_jax_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(JAX_L2)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        code = main(["conform", f"{name}:l2_normalize", "--op", "normalize.l2_normalize",
                     "--framework", "jax", "--dtype", "float32", "--seeds", "1",
                     "--no-search"])
    finally:
        sys.modules.pop(name, None)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "PASS normalize.l2_normalize (jax, float32)" in printed


def test_help_shows_check_implementations_defaults(capsys):
    defaults = inspect.signature(check_implementation).parameters
    with pytest.raises(SystemExit) as exited:
        main(["conform", "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())   # argparse wraps the lines
    assert "IMPLEMENTATION your implementation, PACKAGE.MODULE:CALLABLE" in shown
    assert f"(default: {defaults['seeds'].default})" in shown
    assert f"(default: {defaults['max_examples'].default})" in shown


def test_a_mistyped_flag_is_one_line_naming_conform(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["conform", "m:f", "--op", "normalize.l2_normalize", "--framework", "numpy",
              "--epochs", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("refdml conform: error: unrecognized arguments: --epochs 3")
    assert len(err.splitlines()) == 1


def test_the_current_folder_is_searched_without_being_on_sys_path(tmp_path, monkeypatch,
                                                                  capsys):
    # The installed `refdml` script does not put the current folder on sys.path, as
    # `python -m` does; the command searches it (after the installed packages) itself.
    name = f"conform_cwd_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(PAIR)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    path_before = list(sys.path)
    importlib.invalidate_caches()
    try:
        code = main(["conform", f"{name}:forward", "--backward", f"{name}:backward", *FAST])
    finally:
        sys.modules.pop(name, None)
    assert code == 0, capsys.readouterr()
    assert sys.path == path_before, "the current folder stayed on sys.path"


@pytest.mark.parametrize("argv, flag, fragment", [
    (["no_colon_here", "--backward", "{m}:backward"], "IMPLEMENTATION 'no_colon_here'",
     "is not PACKAGE.MODULE:CALLABLE"),
    (["{m}:", "--backward", "{m}:backward"], "IMPLEMENTATION '{m}:'",
     "is not PACKAGE.MODULE:CALLABLE"),
    (["no_such_module_xyz:forward", "--backward", "{m}:backward"],
     "IMPLEMENTATION 'no_such_module_xyz:forward'", "no module named 'no_such_module_xyz'"),
    (["{m}:forwrd", "--backward", "{m}:backward"], "IMPLEMENTATION '{m}:forwrd'",
     "has no attribute 'forwrd' (did you mean 'forward'"),
    (["{m}:not_callable", "--backward", "{m}:backward"], "IMPLEMENTATION '{m}:not_callable'",
     "is not callable: it is 3 (int)"),
    (["{m}:forward", "--backward", "{m}:nope"], "--backward '{m}:nope'",
     "has no attribute 'nope'"),
    (["{m}:forward", "--backward", "{m}:backward", "--adapter", "x.y"], "--adapter 'x.y'",
     "is not PACKAGE.MODULE:CALLABLE"),
    (["{m}:forward"], "--framework numpy", "needs --backward"),
], ids=["no-colon", "no-callable-name", "missing-module", "missing-attribute",
        "not-callable", "missing-backward-attribute", "malformed-adapter", "pair-without-backward"])
def test_bad_arguments_exit_2_naming_the_flag_and_value(pair_module, capsys, argv, flag,
                                                        fragment):
    argv = [a.format(m=pair_module) for a in argv]
    code = main(["conform", *argv, *FAST])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("refdml conform: error: ")
    assert flag.format(m=pair_module) in err and fragment.format(m=pair_module) in err, err


def test_an_unknown_operator_lists_the_catalogue(pair_module, capsys):
    code = main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
                 "--op", "normalize.l2_normalise", "--framework", "numpy"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--op 'normalize.l2_normalise' is not a catalogued operator" in err
    assert "did you mean normalize.l2_normalize" in err
    assert "\n  losses.contrastive\n" in err      # the list of names


def test_a_module_that_fails_to_import_is_a_usage_error(tmp_path, monkeypatch, capsys):
    name = f"conform_broken_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text("import numpy\nraise RuntimeError('half-written')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        code = main(["conform", f"{name}:forward", "--backward", f"{name}:backward", *FAST])
    finally:
        sys.modules.pop(name, None)
    err = capsys.readouterr().err
    assert code == 2
    assert f"importing '{name}' raised RuntimeError: half-written" in err


@pytest.mark.parametrize("argv, fragment", [
    # An unknown --framework or --dtype is refused by the command itself, in one line
    # (tests/conformance/test_describe.py).
    (["--framework", "numpy", "--seeds", "0"],
     "argument --seeds: --seeds == 0, must be an integer in [1, 1000]"),
    (["--framework", "numpy", "--seeds", "1000000"],
     "argument --seeds: --seeds == 1000000, must be an integer in [1, 1000]"),
    (["--framework", "numpy", "--max-examples", "10001"],
     "argument --max-examples: --max-examples == 10001, must be an integer in [1, 10000]"),
])
def test_argparse_refuses_unknown_choices_with_exit_2(pair_module, capsys, argv, fragment):
    with pytest.raises(SystemExit) as exited:
        main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
              "--op", "normalize.l2_normalize", *argv])
    assert exited.value.code == 2
    assert fragment in capsys.readouterr().err


def test_bfloat16_for_a_numpy_pair_is_one_line_and_exit_2(pair_module, capsys):
    code = main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
                 "--op", "normalize.l2_normalize", "--framework", "numpy", "--dtype",
                 "bfloat16"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert "--dtype bfloat16: dtype == 'bfloat16' needs framework 'torch' or 'jax': NumPy " \
           "has no bfloat16" in err


def test_help_lists_bfloat16_among_the_dtypes(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["conform", "--help"])
    assert exited.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "{float64,float32,float16,bfloat16}" in out
    assert "bfloat16 with torch and jax only" in out


def test_autodiff_frameworks_refuse_a_backward(pair_module, capsys):
    pytest.importorskip("jax")
    code = main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
                 "--op", "normalize.l2_normalize", "--framework", "jax"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--backward '{pair_module}:backward' is for --framework numpy or cupy" in err


def test_an_unwritable_json_path_is_refused_before_any_work(pair_module, tmp_path, capsys):
    folder = tmp_path / "a_folder"
    folder.mkdir()
    code = main(["conform", f"{pair_module}:forward", "--backward", f"{pair_module}:backward",
                 *FAST, "--json", str(folder)])
    assert code == 2
    assert f"--json {folder}: is a folder, not a file" in capsys.readouterr().err


def test_python_dash_m_from_the_implementations_folder(tmp_path):
    """The command as a user runs it, in a fresh process whose current folder holds the
    implementation (never the repository root, where the source tree would shadow the
    installed package)."""
    (tmp_path / "my_l2.py").write_text(PAIR)
    done = subprocess.run(
        [sys.executable, "-m", "refdml.cli", "conform", "my_l2:forward", "--backward",
         "my_l2:backward_without_projection", *FAST, "--json", "report.json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "FAIL normalize.l2_normalize (numpy, float64)" in done.stdout
    assert json.loads((tmp_path / "report.json").read_text())["passed"] is False
