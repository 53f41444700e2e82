"""The package's metadata (issue 38): a lean core, extras named for their job, a licence file
and a PEP 639 licence expression, one source for the version. scripts/ci_package.sh builds
the sdist and the wheel and checks the built metadata; these tests read pyproject.toml."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

import refdml

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
META = PROJECT["project"]
EXTRAS = META["optional-dependencies"]


def _names(requirements):
    return {re.match(r"[A-Za-z0-9_.\-]+", r).group(0).lower() for r in requirements}


def test_the_core_holds_no_extra_package():
    # What `refdml verify` and the operators import; the rest sits in extras.
    core = _names(META["dependencies"])
    assert not core & {"distributed", "dask", "scikit-learn", "matplotlib", "tomli", "jax",
                       "mpmath", "pytest", "numba", "numba-cuda"}, core
    assert {"numpy", "scipy", "pot", "hypothesis", "tqdm", "threadpoolctl"} <= core


def test_each_job_has_its_extra():
    assert {"plot", "fast", "train", "reproduce", "gpu", "docs", "test", "release"} <= set(EXTRAS)
    assert "matplotlib" in _names(EXTRAS["plot"])
    assert _names(EXTRAS["fast"]) == {"numba"}
    # Training and the CUDA kernels run the fast path's compiled kernels: they bring Numba.
    for extra in ("train", "gpu"):
        assert any(r.replace(" ", "") == "refdml[fast]" for r in EXTRAS[extra]), extra
    assert {"scikit-learn", "matplotlib"} <= _names(EXTRAS["train"])
    assert "distributed" in _names(EXTRAS["reproduce"])
    assert any(r.replace(" ", "") == "refdml[train,plot]" for r in EXTRAS["reproduce"])
    # The test suite runs every extra's code: the extras by self-reference, not restated.
    assert any(r.replace(" ", "") == "refdml[train,reproduce,plot]" for r in EXTRAS["test"])
    assert {"build", "twine"} <= _names(EXTRAS["release"])
    # The docs build reads the sources with griffe and imports nothing: no refdml extra.
    assert not any(r.startswith("refdml") for r in EXTRAS["docs"])


def test_licence_is_a_pep639_expression_with_its_file():
    assert META["license"] == "BSD-3-Clause"
    assert META["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("BSD 3-Clause License")
    assert "Copyright (c) 2026, the refdml developers" in text
    # PEP 639: the expression replaces the licence classifiers.
    assert not [c for c in META["classifiers"] if c.startswith("License ::")]
    requires = PROJECT["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in requires), requires


def test_classifiers_name_the_supported_pythons():
    classifiers = set(META["classifiers"])
    lowest = META["requires-python"].removeprefix(">=")
    assert f"Programming Language :: Python :: {lowest}" in classifiers
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        assert f"Programming Language :: Python :: {minor}" in classifiers
    assert "Intended Audience :: Science/Research" in classifiers


def test_the_version_has_one_source():
    assert "version" not in META and "version" in META["dynamic"]
    attr = PROJECT["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "refdml.__version__"


def test_refdml_version_is_the_installed_metadata(tmp_path):
    done = subprocess.run([sys.executable, "-m", "refdml.cli", "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"refdml {importlib.metadata.version('refdml')}"
    assert refdml.__version__ == importlib.metadata.version("refdml")


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_readmes_two_commands_are_the_whole_set_up_and_ci_runs_the_second():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    section = readme.split("## Two commands on a fresh machine", 1)[1].split("\n## ", 1)[0]
    verify, test = (b.strip() for b in _bash_blocks(section))
    # python3: many systems have no `python`; each command makes its own venv.
    for command in (verify, test):
        assert command.startswith("python3 -m venv ") and "pip install " in command
        assert not re.search(r"(^|[\s;&|])python\s", command), command
    assert 'pip install ".[plot]"' in verify and "refdml verify --report " in verify
    extras = re.search(r'pip install "\.\[([a-z,]+)\]"', test).group(1).split(",")
    assert set(extras) <= set(EXTRAS) and "test" in extras
    # .ci/run quotes the test command verbatim, on a line of its own.
    assert test in ci.splitlines(), "README's test command and .ci/run differ"
    assert re.search(r"^bash scripts/ci_package\.sh$", ci, re.M), "no packaging leg in .ci/run"
    assert '"$package"' in ci                        # its status decides CI's
    # Each command says how long it takes (a newcomer otherwise wonders whether it hung).
    prose = [part for part in re.split(r"```bash\n.*?```", section, flags=re.S) if part.strip()]
    assert all(re.search(r"about\s+[0-9.]+\s+min", part) for part in prose[:2]), prose[:2]
    # The example that promises figures writes a report, not only JSON.
    example = readme.split("**Verify a claim**", 1)[1]
    assert "--report " in _bash_blocks(example)[0]
    # Contributor details live in docs/contributing.md, linked from README.
    assert "(docs/contributing.md)" in readme and (ROOT / "docs" / "contributing.md").exists()
