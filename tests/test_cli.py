import subprocess
import sys

import refdml
from refdml.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert refdml.__version__ in capsys.readouterr().out


def test_gradcheck_subcommand_prints_a_table(capsys):
    assert main(["gradcheck", "--only", "distances.euclidean", "normalize.l2_normalize"]) == 0
    out = capsys.readouterr().out
    assert "distances.euclidean" in out and "pass" in out and "0 failure(s)" in out


def test_gradcheck_unknown_operator(capsys):
    assert main(["gradcheck", "--only", "no.such.op"]) == 2


def test_console_script_is_installed():
    completed = subprocess.run(
        [sys.executable, "-m", "refdml.cli", "--version"], capture_output=True, text=True
    )
    assert completed.returncode == 0 and refdml.__version__ in completed.stdout


def test_gpu_and_validation_install_under_refdml():
    import importlib.metadata
    import importlib.util

    assert importlib.util.find_spec("refdml.gpu") is not None
    assert importlib.util.find_spec("refdml.validation") is not None
    # The installed distribution has a single top-level package: no bare `gpu` or
    # `validation` (a check of the metadata, not of sys.path, which may hold the checkout).
    top_level = importlib.metadata.distribution("refdml").read_text("top_level.txt")
    assert top_level.split() == ["refdml"]
