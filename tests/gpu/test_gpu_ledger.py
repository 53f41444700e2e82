"""scripts/gpu_ledger.py: the ledger of scripts/gpu_run.sh and README's GPU-ledger section
rendered from it (issue 21).

tests/data/gpu_ledger_fake.json is a FAKE ledger: every value in it is invented (device
"FAKE-GPU-FIXTURE", date 2000-01-01, versions 0.0), none was measured. The run folders
below are fake too, written by the tests themselves.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_ledger.py"
FAKE = Path(__file__).resolve().parents[1] / "data" / "gpu_ledger_fake.json"

BEFORE = "# Title\n\nText before the section.\n\n<!-- gpu-ledger:start -->\n"
AFTER = "<!-- gpu-ledger:end -->\n\nText after the section, | with a pipe.\n"
README = BEFORE + "hand-written text that the generator replaces\n" + AFTER


def _load_tool():
    """scripts/ is no package: the script is loaded from its file."""
    spec = importlib.util.spec_from_file_location("gpu_ledger_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _load_tool()


def run(*args, cwd=None):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=120)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def fake_ledger() -> dict:
    return json.loads(FAKE.read_text(encoding="utf-8"))


def test_fake_gpu_ledger_renders_and_round_trips(tmp_path):
    readme = write(tmp_path / "README.md", README)
    done = run("--readme", readme, "--ledger", FAKE)
    assert done.returncode == 0, done.stderr
    text = readme.read_text(encoding="utf-8")
    before, section, after = tool.split_readme(text)
    assert (before, after) == (BEFORE, AFTER)        # the rest of the file, byte for byte
    digest = hashlib.sha256(FAKE.read_bytes()).hexdigest()
    assert section == tool.render_section(fake_ledger(), digest)
    assert digest in section
    assert "FAKE-GPU-FIXTURE" in section and tool.NEVER not in section
    # The fixture's rows, formatted by hand: errors and tolerances as %.2e, time in ms.
    assert "| fake.array_op | CuPy array path | float32 | 1.50e-07 | 1.00e-04 | pass | 1.25 |" in section
    assert "| fake.kernel_op | CUDA kernel on CuPy | float64 | 7.00e-09 | 1.00e-10 | FAIL | 500 |" in section
    assert "fake.cpu_only_op" not in section         # a CPU twin's row is no GPU result
    assert "| parity | failed | 2 | exit status 1: fake failure |" in section
    assert "| fake_kernel_a | float32 | sm_90 | 11 | 0 |" in section
    assert ("| fake_section | fake path | float32 | B=1 | 250 | 1500 | 4 fakes/s | 2x fake other "
            "path | < 1 s: met | 1.00e-07 (tol 1.00e-04 vs fake twin) | - |") in section
    assert "| fake_workload | auto | B=1 | 4 | 2000 | 7 | 2 | 3 | 1 | fake note |" in section
    assert section.endswith("|\n\n")                 # a blank line before the end marker

    # Rendering again changes nothing, and --check agrees.
    assert run("--readme", readme, "--ledger", FAKE).returncode == 0
    assert readme.read_text(encoding="utf-8") == text
    assert run("--readme", readme, "--ledger", FAKE, "--check").returncode == 0
    # A hand edit inside the section is caught by --check, which writes nothing.
    edited = text.replace("FAKE-GPU-FIXTURE", "EDITED BY HAND")
    write(readme, edited)
    check = run("--readme", readme, "--ledger", FAKE, "--check")
    assert check.returncode == 1 and "differs" in check.stderr
    assert readme.read_text(encoding="utf-8") == edited
    # Written atomically: no temporary file is left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md"]


def _dry_run(ledger):
    ledger["dry_run"] = True


def _no_flag(ledger):
    del ledger["dry_run"]


def _simulator(ledger):
    ledger["device"]["simulator"] = True


def _standin(ledger):
    ledger["device"]["cupy_standin"] = True


def _no_device_name(ledger):
    ledger["device"]["name"] = None


@pytest.mark.parametrize("mark", [_dry_run, _no_flag, _simulator, _standin, _no_device_name])
def test_a_ledger_not_from_a_gpu_renders_never_run_on_a_gpu(tmp_path, mark):
    ledger = fake_ledger()
    mark(ledger)
    path = write(tmp_path / "ledger.json", json.dumps(ledger))
    readme = write(tmp_path / "README.md", README)
    done = run("--readme", readme, "--ledger", path)
    assert done.returncode == 0, done.stderr
    assert "not the ledger of a GPU run" in done.stderr
    section = tool.split_readme(readme.read_text(encoding="utf-8"))[1]
    assert f"GPU ledger: {tool.NEVER}" in section
    for measured in ("FAKE-GPU-FIXTURE", "1.50e-07", "fake.array_op", "fake_section"):
        assert measured not in section
    # The same words as with no ledger at all.
    bare = write(tmp_path / "BARE.md", README)
    assert run("--readme", bare).returncode == 0
    assert tool.split_readme(bare.read_text(encoding="utf-8"))[1] == section


@pytest.mark.parametrize("text", [
    "no markers\n",
    BEFORE + "no end marker\n",
    "text\n" + AFTER,
    BEFORE + BEFORE + AFTER,
    AFTER + BEFORE,
])
def test_bad_markers_are_refused_and_the_file_left_alone(tmp_path, text):
    readme = write(tmp_path / "README.md", text)
    done = run("--readme", readme, "--ledger", FAKE)
    assert done.returncode == 2
    assert "<!-- gpu-ledger:start -->" in done.stderr
    assert readme.read_text(encoding="utf-8") == text


def test_a_file_that_is_no_ledger_is_refused(tmp_path):
    readme = write(tmp_path / "README.md", README)
    for text in ("[]", '{"schema": 99}', "not json"):
        path = write(tmp_path / "x.json", text)
        done = run("--readme", readme, "--ledger", path)
        assert done.returncode == 2, text
        assert "ledger ==" in done.stderr
    assert readme.read_text(encoding="utf-8") == README


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_fake" name="test_pass" time="0.5"/>
<testcase classname="tests.test_fake" name="test_fail" time="0.25"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_fake" name="test_skip_a" time="0"><skipped type="pytest.skip" message="requires_cuda: no GPU here"/></testcase>
<testcase classname="tests.test_fake" name="test_skip_b" time="0"><skipped type="pytest.skip" message="requires_cuda: no GPU here"/></testcase>
</testsuite></testsuites>
"""


def test_junit_check_refuses_forbidden_skips_and_empty_runs(tmp_path):
    path = write(tmp_path / "junit.xml", JUNIT)
    summary = tool.junit_summary(path)
    assert {k: summary[k] for k in ("tests", "passed", "failed", "errors", "skipped", "ran")} == {
        "tests": 4, "passed": 1, "failed": 1, "errors": 0, "skipped": 2, "ran": 2}
    assert summary["skip_reasons"] == {"requires_cuda: no GPU here": 2}
    assert summary["failures"] == ["tests.test_fake::test_fail: assert 1 == 2"]
    assert run("--junit", path, "--forbid-skip", "requires_cupy").returncode == 0
    forbidden = run("--junit", path, "--forbid-skip", "requires_cupy", "requires_cuda")
    assert forbidden.returncode == 1 and "PROBLEM: 2 skipped: requires_cuda" in forbidden.stdout
    assert run("--junit", path, "--forbid-skip", "*").returncode == 1
    all_skipped = write(tmp_path / "skipped.xml", JUNIT.replace(
        '<testcase classname="tests.test_fake" name="test_pass" time="0.5"/>', "").replace(
        '<testcase classname="tests.test_fake" name="test_fail" time="0.25"><failure message="assert 1 == 2">trace</failure></testcase>', ""))
    done = run("--junit", all_skipped)
    assert done.returncode == 1 and "no test ran" in done.stdout
    assert run("--junit", tmp_path / "absent.xml").returncode == 2


def _fake_run_dir(tmp_path: Path) -> Path:
    """A run folder as gpu_run.sh leaves it, with invented values."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write(run_dir / "steps.tsv",
          "install\tpassed\t0\t1.5\t90\t\tbash -c install_wheels\n"
          "parity\tfailed\t2\t0.5\t120\texit status 2: bad flag\tpython3 -m refdml.cli gpu-check\n"
          "bench\tskipped\t\t0\t\tout of time\t\n")
    write(run_dir / "smoke.json", json.dumps({
        "simulator": True, "cupy_standin": True, "refdml_file": "/fake/site/refdml/__init__.py",
        "versions": {"refdml": "0.0.fake", "cupy": "0.0.fake"},
        "device": {"name": "FAKE stand-in", "compute_capability": "0.0"},
        "checks": {}, "lazy_imports": {"ot": True}, "problems": []}))
    # Python's json writes Infinity for a float inf: the ledger must stay strict JSON.
    # Rows as `refdml gpu-check --json` writes them, and one in an older spelling (no
    # device, no max_error, a time in ms, a result string).
    write(run_dir / "gpu_check.json", json.dumps([
        {"operator": "fake.op", "backend": "cupy", "path": "cuda", "device": "cupy/cuda",
         "dtype": "float32", "output_error": 2e-7, "gradient_error": 3e-6, "max_error": 3e-6,
         "tolerance": 1e-4, "passed": True, "seconds": 0.002, "problems": []},
        {"operator": "fake.op", "backend": "cupy", "kernels": "array", "dtype": "float64",
         "output_error": float("inf"), "gradient_error": 0.0, "tolerance": 1e-10,
         "time_ms": 4.0, "result": "FAIL output 0: shape"},
    ]))
    write(run_dir / "junit_gpu_tests.xml", JUNIT)
    (run_dir / "train_tokens").mkdir()
    write(run_dir / "train_tokens" / "log.jsonl", '{"epoch": 0}\n{"epoch": 1, "loss": 0.5}\n')
    return run_dir


def test_assemble_reads_every_step_output_and_keeps_a_dry_run_marked(tmp_path):
    run_dir = _fake_run_dir(tmp_path)
    out = tmp_path / "gpu_ledger.json"
    done = run("--assemble", run_dir, "--steps", run_dir / "steps.tsv", "--out", out, "--dry-run")
    assert done.returncode == 0, done.stderr

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    ledger = json.loads(out.read_text(encoding="utf-8"), parse_constant=refuse)
    assert ledger["schema"] == tool.SCHEMA and ledger["dry_run"] is True
    assert ledger["passed"] is False
    assert [(s["name"], s["status"], s["exit_code"], s["reason"]) for s in ledger["steps"]] == [
        ("install", "passed", 0, None), ("parity", "failed", 2, "exit status 2: bad flag"),
        ("bench", "skipped", None, "out of time")]
    first, second = ledger["parity"]["rows"]
    assert (first["label"], first["path"], first["passed"], first["error"], first["seconds"]) == (
        "CUDA kernel on CuPy", "cuda", True, 3e-6, 0.002)
    assert (second["device"], second["label"], second["passed"], second["error"], second["seconds"]) == (
        "cupy", "CuPy array path", False, "inf", 0.004)
    assert ledger["tests"]["gpu_tests"]["ran"] == 2
    assert [r["epoch"] for r in ledger["train"]["records"]] == [0, 1]
    assert ledger["device"]["simulator"] is True and ledger["device"]["cupy_standin"] is True
    assert any("gpu_check_compile.json" in m for m in ledger["missing"])
    assert any("bench_gpu.json" in m for m in ledger["missing"])

    # A dry run is never rendered as GPU results, even with every other field filled in.
    readme = write(tmp_path / "README.md", README)
    assert run("--readme", readme, "--ledger", out).returncode == 0
    section = tool.split_readme(readme.read_text(encoding="utf-8"))[1]
    assert f"GPU ledger: {tool.NEVER}" in section and "fake.op" not in section


def test_assemble_from_an_empty_run_still_writes_a_ledger(tmp_path):
    """A run whose steps all failed before writing anything still leaves its ledger."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write(run_dir / "steps.tsv", "install\tfailed\t1\t3.0\t90\texit status 1: no wheel\tbash\n")
    out = tmp_path / "gpu_ledger.json"
    done = run("--assemble", run_dir, "--steps", run_dir / "steps.tsv", "--out", out)
    assert done.returncode == 0, done.stderr
    ledger = json.loads(out.read_text(encoding="utf-8"))
    assert ledger["dry_run"] is False and ledger["passed"] is False
    assert ledger["parity"]["rows"] == [] and len(ledger["missing"]) >= 5
    assert not tool.is_gpu_ledger(ledger)            # no smoke report: no device, no claim


def test_a_malformed_steps_table_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write(run_dir / "steps.tsv", "install\tpassed\n")
    done = run("--assemble", run_dir, "--steps", run_dir / "steps.tsv", "--out", tmp_path / "l.json")
    assert done.returncode == 2 and "steps.tsv:1" in done.stderr
    assert not (tmp_path / "l.json").exists()


def test_source_digest_follows_the_wheels_sources_only(tmp_path):
    repo = tmp_path / "repo"
    for part in ("refdml", "refdml/gpu", "refdml/validation"):
        (repo / part).mkdir(parents=True)
        write(repo / part / "__init__.py", f"# {part}\n")
    write(repo / "pyproject.toml", "[project]\n")
    first = tool.source_digest(repo)
    (repo / "refdml" / "__pycache__").mkdir()
    write(repo / "refdml" / "__pycache__" / "x.cpython-311.pyc", "bytecode")
    write(repo / "notes.md", "not part of the wheel")
    assert tool.source_digest(repo) == first
    write(repo / "refdml" / "gpu" / "__init__.py", "# gpu, edited\n")
    assert tool.source_digest(repo) != first


def test_fixture_is_marked_fake():
    ledger = fake_ledger()
    assert ledger["_note"].startswith("FAKE") and ledger["device"]["name"] == "FAKE-GPU-FIXTURE"
    # The fixture is a GPU ledger as far as the renderer can tell: the round-trip test
    # above exercises the GPU rendering, not the "never run" one.
    assert tool.is_gpu_ledger(copy.deepcopy(ledger))


def test_docs_ledger_section_is_generated_from_the_recorded_ledger():
    # The site's GPU ledger (docs/results/gpu.md) must be what scripts/gpu_ledger.py renders
    # from the ledger a GPU run recorded (docs/gpu_ledger.json), or "never run on a GPU"
    # where none was recorded: a hand edit, or a new ledger without the page regenerated,
    # fails here.
    recorded = ROOT / "docs" / "gpu_ledger.json"
    page = ROOT / "docs" / "results" / "gpu.md"
    args = ["--readme", page, "--check"]
    if recorded.exists():
        args += ["--ledger", recorded]
    result = run(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    if not recorded.exists():
        assert "never run on a GPU" in page.read_text(encoding="utf-8")


def test_the_wheel_builds_copy_only_paths_that_exist():
    """gpu_prepare.sh (under ``set -e``) and gpu_run.sh's install step copy the wheel's
    sources before building it. After issue 35 moved ``gpu/`` and ``validation/`` into
    ``refdml/`` both still named them: gpu_prepare.sh stopped at the ``cp`` and gpu_run.sh
    built from a partial copy. Every path they copy must exist, and be a part the source
    digest covers (or the README and the LICENSE the build reads)."""
    import re
    import shlex

    repo = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo / "scripts"))
    try:
        import gpu_ledger
    finally:
        sys.path.pop(0)
    found = 0
    for script in ("gpu_prepare.sh", "gpu_run.sh"):
        for line in (repo / "scripts" / script).read_text().splitlines():
            if not re.match(r"\s*cp -R .*pyproject\.toml", line):
                continue
            found += 1
            sources = shlex.split(line.strip())[2:-1]
            names = [s.replace('"', "").replace("$REPO/", "") for s in sources]
            for name in names:
                assert (repo / name).exists(), f"{script} copies {name}, which does not exist"
            assert set(names) == {*gpu_ledger.SOURCE_PARTS, "README.md", "LICENSE"}, (script, names)
    assert found == 2
