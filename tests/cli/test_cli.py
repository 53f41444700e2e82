import subprocess
import sys

import pytest

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


def test_console_script_is_installed(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "refdml.cli", "--version"], capture_output=True, text=True,
        cwd=tmp_path,  # outside the checkout, whose refdml/ would shadow the installed package
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


# --------------------------------------------------------------------------- gradcheck


def test_gradcheck_columns_never_run_together(capsys):
    from refdml.catalog import all_operators

    longest = max((s.name for s in all_operators()), key=len)
    assert main(["gradcheck", "--only", longest]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[0], [line for line in lines[2:] if line.startswith(longest)]
    assert rows and header.split() == ["operator", "input", "mode", "max", "rel", "err", "rtol", "result"]
    for row in rows:
        assert row[len(longest):len(longest) + 2] == "  "  # at least two spaces after the name
        assert len(row.split()) == 6


def test_gradcheck_only_accepts_a_prefix(capsys):
    assert main(["gradcheck", "--only", "normalize"]) == 0
    out = capsys.readouterr().out
    assert "normalize.l2_normalize" in out and "normalize.clip_normalize" in out
    assert "distances." not in out


def test_gradcheck_mode_flag_runs_the_chosen_mode(capsys):
    assert main(["gradcheck", "--only", "distances.euclidean", "--mode", "fast"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("distances.euclidean")]
    assert rows and all(row[2] == "fast" and row[-1] == "pass" for row in rows)
    with pytest.raises(SystemExit) as exc:
        main(["gradcheck", "--mode", "quick"])
    assert exc.value.code == 2
    assert "invalid choice: 'quick'" in capsys.readouterr().err


def test_gradcheck_unknown_operator_lists_the_names(capsys):
    assert main(["gradcheck", "--only", "no.such.op"]) == 2
    err = capsys.readouterr().err
    assert "no.such.op matches no operator" in err and "normalize.l2_normalize" in err


@pytest.mark.parametrize("command", ["gradcheck", "verify"])
def test_negative_seed_is_a_named_error(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--seed", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "seed == -1, must be a non-negative integer" in err and f"refdml {command}: error" in err
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["gradcheck", "verify"])
def test_mistyped_flag_is_one_line_naming_the_subcommand(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, "--qiuck"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"refdml {command}: error: unrecognized arguments: --qiuck")
    assert len(err.splitlines()) == 1


# Every command's argparse errors: one line on stderr naming the flag and the value, exit 2,
# never argparse's usage block (README promises one line).
_ONE_LINE_ERRORS = [
    (["verify", "--quik"], "unrecognized arguments: --quik (did you mean --quick?)"),
    (["conform", "m:f", "--op", "normalize.l2_normalize", "--framework", "numpy",
      "--dtype", "float8"], "--dtype 'float8' is not one of"),
    (["conform", "m:f", "--op", "normalize.l2_normalize", "--framework", "tensorflow"],
     "--framework 'tensorflow' is not one of"),
    (["gradcheck", "--mode", "quick"], "argument --mode: invalid choice: 'quick'"),
    (["gpu-check", "--seeed", "1"], "unrecognized arguments: --seeed 1 (did you mean --seed?)"),
    (["train", "--study", "nope"], "argument --study: invalid choice: 'nope'"),
    (["reproduce", "--seeds", "0"], "--seeds"),
    (["verfy"], "invalid choice: 'verfy'"),
]


@pytest.mark.parametrize(("argv", "wanted"), _ONE_LINE_ERRORS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_argparse_errors_are_one_line(capsys, argv, wanted):
    try:  # argparse exits; a command that checks a flag itself returns the status
        status = main(argv)
    except SystemExit as exc:
        status = exc.code
    assert status == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    command = argv[0] if argv[0] != "verfy" else None
    assert lines[0].startswith(f"refdml {command}: error: " if command else "refdml: error: ")
    assert wanted in lines[0] and "usage:" not in lines[0]


def test_a_study_script_parser_is_one_line_too(capsys):
    from refdml.train._cli import main_for_study

    with pytest.raises(SystemExit) as exc:
        main_for_study("tokens", ["--out", "unused", "--epochz", "2"])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_tokens.py: error: unrecognized")
    assert "did you mean --epochs?" in lines[0]


# --------------------------------------------------------------------------- verify


def test_verify_help_explains_verdicts_and_exit_codes(capsys):
    from refdml.validation import Verdict

    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    out = capsys.readouterr().out
    for verdict in Verdict:
        assert verdict.value in out
    assert "exit status" in out and "  0  " in out and "  1  " in out and "  2  " in out


def test_verify_list_prints_every_id_with_a_description(capsys):
    from refdml.validation import CHECKS

    assert main(["verify", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(CHECKS)
    assert all(len(line.split()) > 3 and len(line) <= 150 for line in lines)


def _no_run(monkeypatch):
    """Make running a claim an error, to prove an argument is refused before any work."""
    import refdml.validation._runner as runner

    def boom(*args, **kwargs):
        raise AssertionError("a claim ran")

    monkeypatch.setattr(runner, "_run_one", boom)


def test_report_path_that_is_a_file_fails_before_the_run(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    target = tmp_path / "a_file"
    target.write_text("x")
    assert main(["verify", "--only", "gsp.fig9", "--report", str(target)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_report_folder_under_a_file_fails_before_the_run(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    (tmp_path / "f").write_text("x")
    assert main(["verify", "--report", str(tmp_path / "f" / "rep")]) == 2
    assert "cannot create the folder" in capsys.readouterr().err


def test_json_path_that_is_a_folder_fails_before_the_run(tmp_path, capsys, monkeypatch):
    _no_run(monkeypatch)
    assert main(["verify", "--json", str(tmp_path)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


def test_only_unknown_prefix_lists_the_ids(capsys, monkeypatch):
    _no_run(monkeypatch)
    assert main(["verify", "--only", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope matches no claim id" in err and "gsp.fig9.backward_cost" in err


def test_only_prefix_selects_and_progress_goes_to_stderr(capsys, monkeypatch):
    from refdml.validation import CHECKS, ClaimSpec, Finding, Reading

    def fine(ctx):
        return Finding(readings=(Reading("printed", "ok", 0.0, 1.0),), key_number="fine")

    for claim_id in ("zz.a.one", "zz.a.two", "zz.b"):
        monkeypatch.setitem(CHECKS, claim_id, ClaimSpec(claim_id, "none", "fake", "none", (), fine))
    assert main(["verify", "--only", "zz.a"]) == 0
    captured = capsys.readouterr()
    assert "zz.a.one" in captured.out and "zz.a.two" in captured.out and "zz.b " not in captured.out
    # not a TTY under pytest: one progress line per claim, with the elapsed time
    progress = [line for line in captured.err.splitlines() if "running" in line]
    assert len(progress) == 2 and progress[0].startswith("[ 1/2]") and " s  running zz.a.one" in progress[0]


def test_select_prefers_an_exact_name():
    from refdml.validation import select

    names = ["a.b", "a.bc", "a.c"]
    assert select(names, ["a.b"]) == (["a.b"], [])
    assert select(names, ["a."]) == (names, [])
    assert select(names, ["a.c", "zz"]) == (["a.c"], ["zz"])


def test_run_checks_refuses_a_negative_seed():
    from refdml.validation import run_checks

    with pytest.raises(ValueError, match="seed == -1"):
        run_checks(["gsp.fig9.backward_cost"], seed=-1)


# --------------------------------------------------------------------------- gpu-check


def test_gpu_check_prints_a_table_and_passes(capsys):
    from refdml.gpu import cupy_available

    # clip_normalize: an operator without compiled kernels (l2_normalize has them, which add
    # rows per kernel variant), so its rows are the array modules times the dtypes
    assert main(["gpu-check", "--only", "normalize.clip_normalize"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("operator"))
    assert header.split() == ["operator", "device", "dtype", "max", "rel", "err", "outputs", "max",
                              "rel", "err", "gradients", "tolerance", "time", "ms", "result"]
    rows = [line for line in lines if line.startswith("normalize.")]
    devices = 2 if cupy_available() else 1
    assert len(rows) == 2 * devices  # two dtypes x devices
    for row in rows:
        assert row.split()[-1] == "pass" and len(row.split()) == 8
    assert any("float32" in row for row in rows) and any("float64" in row for row in rows)
    if not cupy_available():
        assert any("no CuPy rows ran" in line for line in lines)
    assert any("0 failure(s)" in line for line in lines)


def test_gpu_check_reports_each_check_on_stderr_as_it_ends(capsys):
    # A GPU's first call of each kernel compiles it: the run must show it is moving.
    assert main(["gpu-check", "--only", "normalize", "--dtype", "float64"]) == 0
    captured = capsys.readouterr()
    table = [line for line in captured.out.splitlines() if line.startswith("normalize.")]
    lines = [line for line in captured.err.splitlines() if line.startswith("gpu-check [")]
    assert len(lines) == len(table) >= 2
    assert [line.split("]")[0] for line in lines] == [
        f"gpu-check [{k}/{len(table)}" for k in range(1, len(table) + 1)]
    assert all(line.endswith(" s)") and ": pass (" in line for line in lines)
    assert main(["gpu-check", "--only", "normalize", "--dtype", "float64", "--no-progress"]) == 0
    assert "gpu-check [" not in capsys.readouterr().err


def test_gpu_check_one_dtype_and_the_unmirrored_list(capsys):
    assert main(["gpu-check", "--only", "normalize.l2", "gsp.pool_unrolled",
                 "--dtype", "float32", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("normalize.l2_normalize ")]
    assert rows and all("float64" not in row for row in rows)
    tail = out.split("without a mirror", 1)[1]
    assert "gsp.pool_unrolled" in tail and "validation only" in tail


def test_gpu_check_failure_and_crash_exit_1(capsys, monkeypatch):
    import dataclasses

    from refdml.gradcheck import parity

    real = parity.check_parity

    def failing(spec, **kwargs):
        if spec.name == "normalize.l2_normalize":
            raise RuntimeError("boom")
        result = real(spec, **kwargs)
        return dataclasses.replace(result, passed=False, problems=("output 0: made up",))

    monkeypatch.setattr(parity, "check_parity", failing)
    assert main(["gpu-check", "--only", "normalize", "--dtype", "float64"]) == 1
    out = capsys.readouterr().out
    crash = next(line for line in out.splitlines() if line.startswith("normalize.l2_normalize"))
    fail = next(line for line in out.splitlines() if line.startswith("normalize.clip_normalize"))
    assert "CRASH RuntimeError('boom')" in crash
    assert "FAIL output 0: made up" in fail


def test_gpu_check_backend_selects_the_array_modules(capsys):
    from refdml.gpu import cupy_available

    assert main(["gpu-check", "--only", "normalize.clip_normalize", "--dtype", "float64",
                 "--backend", "numpy"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith("normalize.")]
    assert rows and {row[1] for row in rows} == {"numpy"}
    if not cupy_available():
        assert main(["gpu-check", "--only", "normalize", "--backend", "cupy"]) == 2
        assert "--backend cupy" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check", "--backend", "torch"])
    assert exc.value.code == 2


def test_gpu_check_bad_arguments(capsys):
    assert main(["gpu-check", "--only", "no.such.op"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check", "--dtype", "float16"])
    assert exc.value.code == 2
