"""A missing optional extra (issue 38): one line naming it, exit status 2, no traceback, and
before the work; the Python API raises :class:`refdml.exceptions.MissingExtraError` with the
same message. The extras' packages are hidden from a child process by a meta-path finder that
refuses them, as if they were not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _hidden_modules import child_argv

from refdml.exceptions import MissingExtraError

#: refdml's CLI, run in a child process with the top-level modules in argv[1] (comma
#: separated) refused, as a core-only install would (tests/_hidden_modules.py).
_CLI = """
    from refdml.cli import main

    sys.exit(main(sys.argv[2:]))
"""

#: Every extra's top-level package: a core-only install has none of them.
EXTRA_PACKAGES = "distributed,dask,sklearn,matplotlib,tomli,jax,mpmath,numba,llvmlite,numba_cuda"


def _refdml(blocked, *argv, cwd):
    return subprocess.run(child_argv(_CLI, blocked, *argv), cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_reproduce_without_distributed_is_one_line_and_exit_2(tmp_path):
    done = _refdml("distributed", "reproduce", "--quick", "--report", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr == ('refdml reproduce: error: needs the "reproduce" extra (distributed '
                           'is not installed): pip install "refdml[reproduce]"\n')
    assert done.stdout == ""                     # before the work: not even its header line
    assert not (tmp_path / "out").exists()


def test_reproduce_without_the_train_packages_names_its_extra(tmp_path):
    done = _refdml("sklearn", "reproduce", "--quick", "--in-process", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        'refdml reproduce: error: needs the "reproduce" extra (scikit-learn is not installed): '
        'pip install "refdml[reproduce]"']


def test_verify_report_without_matplotlib_stops_before_the_work(tmp_path):
    done = _refdml("matplotlib", "verify", "--only", "asap.eq4.2", "--report", "rep",
                   cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        'refdml verify: error: needs the "plot" extra (matplotlib is not installed): '
        'pip install "refdml[plot]"']
    assert done.stdout == "" and not (tmp_path / "rep").exists()


def test_core_only_commands_run_with_every_extra_missing(tmp_path):
    # verify without --report, reproduce --list and every --help need no extra.
    done = _refdml(EXTRA_PACKAGES, "verify", "--quick", "--only", "asap.eq4.2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "asap.eq4.2" in done.stdout and "holds" in done.stdout
    assert _refdml(EXTRA_PACKAGES, "reproduce", "--list", cwd=tmp_path).returncode == 0
    for command in ("gradcheck", "gpu-check", "verify", "train", "reproduce", "conform"):
        done = _refdml(EXTRA_PACKAGES, command, "--help", cwd=tmp_path)
        assert done.returncode == 0 and "usage: refdml" in done.stdout, (command, done.stderr)


def test_importing_the_cli_and_the_plugin_loads_no_extra(tmp_path):
    code = ("import sys, refdml, refdml.cli, refdml.pytest_plugin; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & set(sys.argv[1].split(','))))")
    done = subprocess.run([sys.executable, "-c", code, EXTRA_PACKAGES], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_api_raises_missing_extra_error_with_its_cause(monkeypatch):
    from refdml.reproduce import _runner

    monkeypatch.setitem(sys.modules, "distributed", None)   # `import distributed` fails
    with pytest.raises(MissingExtraError) as info:
        _runner._run_dask([], 1, None, lambda *a: None)
    error = info.value
    assert isinstance(error, ImportError) and error.extra == "reproduce"
    assert error.name == "distributed"
    assert str(error).startswith('needs the "reproduce" extra')
    assert str(error).endswith('pip install "refdml[reproduce]"')
    assert isinstance(error.__cause__, ImportError)


def test_the_digits_study_without_scikit_learn_names_the_train_extra(monkeypatch):
    from refdml.train.data import _collage

    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(MissingExtraError, match=r'pip install "refdml\[train\]"'):
        _collage._class_pools(None)


def test_require_looks_up_without_importing(monkeypatch):
    monkeypatch.delitem(sys.modules, "refdml_no_such_package", raising=False)
    MissingExtraError.require("plot", "json")                   # present: nothing raised
    with pytest.raises(MissingExtraError) as info:
        MissingExtraError.require("train", "json", "refdml_no_such_package")
    assert info.value.name == "refdml_no_such_package" and info.value.extra == "train"
    assert "refdml_no_such_package" not in sys.modules
