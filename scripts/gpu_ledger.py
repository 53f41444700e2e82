"""The GPU ledger of ``scripts/gpu_run.sh``: assemble it, check a step's JUnit XML, and write
the site's GPU-ledger section from it (docs/results/gpu.md; docs/gpu/gpu-machine.md, "Running on
a GPU machine").

    python3 scripts/gpu_ledger.py --assemble RUN_DIR --steps RUN_DIR/steps.tsv --out gpu_ledger.json [--dry-run]
    python3 scripts/gpu_ledger.py --junit FILE.xml [--forbid-skip PREFIX ...]
    python3 scripts/gpu_ledger.py --readme docs/results/gpu.md [--ledger gpu_ledger.json] [--check]
    python3 scripts/gpu_ledger.py --build-info WHEEL --repo . --out build_info.json
    python3 scripts/gpu_ledger.py --source-digest .

Standard library only: gpu_run.sh calls it before refdml is installed (``--build-info``,
``--source-digest``) and whatever state the run is in (``--assemble``).

``--readme PAGE`` (any Markdown page; the site's is docs/results/gpu.md) rewrites what
lies between the lines ``<!-- gpu-ledger:start -->`` and
``<!-- gpu-ledger:end -->`` (atomically; the rest of the file is left byte for byte). Only
a ledger of a real GPU run is rendered as results: with no ledger, or one marked
``"dry_run": true`` (simulator and CuPy stand-in), or one whose smoke test saw the
simulator or the stand-in, the section says the code has never run on a GPU. ``--check``
writes nothing and exits 1 when the section differs from what the ledger renders (the
section carries the ledger's SHA-256, so the page cannot silently disagree with it).

Exit statuses: 0 done, 1 a check failed (``--junit``, ``--check``), 2 bad arguments or
unreadable input.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

START = "<!-- gpu-ledger:start -->"
END = "<!-- gpu-ledger:end -->"
SCHEMA = 1
NEVER = "never run on a GPU"

# Column order of steps.tsv, written by gpu_run.sh (one line per step, tab-separated).
STEP_FIELDS = ("name", "status", "exit_code", "seconds", "limit_s", "reason", "command")

# What the refdml wheel is built from (its packages hold Python files only): a change here
# makes a carried wheel stale. README.md, the wheel's long description, is left out.
SOURCE_PARTS = ("pyproject.toml", "refdml")


class LedgerError(Exception):
    """Bad input: reported on stderr with exit status 2."""


# --------------------------------------------------------------------------- files


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and
    ``os.replace``, keeping the mode of a file already there."""
    path = Path(path)
    if path.exists():
        mode = path.stat().st_mode & 0o7777
    else:  # what open() would give a new file (mkstemp's is 0o600)
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float as a string (``"inf"``, ``"nan"``): the
    ledger stays strict JSON, which ``json.dump`` would not write by default."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(ledger: dict) -> str:
    return json.dumps(_finite(ledger), indent=2, sort_keys=False, allow_nan=False) + "\n"


def _load_json(path: Path) -> tuple[Any, str | None]:
    """The JSON in ``path`` and None, or None and why it could not be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle), None
    except FileNotFoundError:
        return None, f"{path.name} was not written"
    except (OSError, ValueError) as exc:
        return None, f"{path.name} is not readable JSON ({type(exc).__name__}: {exc})"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def source_digest(repo: Path) -> str:
    """SHA-256 over the relative path and bytes of pyproject.toml and every ``*.py`` file
    of the packages (``SOURCE_PARTS``), in sorted order: what the wheel is built from, and
    nothing a cache or an editor leaves beside it."""
    repo = Path(repo)
    files = []
    for part in SOURCE_PARTS:
        top = repo / part
        if top.is_file():
            files.append(top)
        elif top.is_dir():
            files.extend(p for p in top.rglob("*.py") if p.is_file())
    if not files:
        raise LedgerError(f"repo == {str(repo)!r}: none of {', '.join(SOURCE_PARTS)} is there")
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(repo).as_posix()):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _git(repo: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_info(wheel: Path, repo: Path) -> dict:
    """What a refdml wheel was built from: its hash, the source digest, the git commit."""
    wheel, repo = Path(wheel), Path(repo)
    if not wheel.is_file():
        raise LedgerError(f"wheel == {str(wheel)!r}: no such file")
    commit = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=normal", "--", *SOURCE_PARTS)
    return {
        "wheel": wheel.name,
        "wheel_sha256": sha256_file(wheel),
        "source_digest": source_digest(repo),
        "git_commit": commit,
        # Uncommitted changes to the wheel's sources: results belong to no commit.
        "git_dirty": None if status is None else bool(status),
        "built": _now(),
    }


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- JUnit


def junit_summary(path: Path) -> dict:
    """Counts of a pytest JUnit XML file, the skip reasons (with counts) and the first
    line of each failure or error."""
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise LedgerError(f"{path} was not written") from None
    except ET.ParseError as exc:
        raise LedgerError(f"{path} is not readable XML ({exc})") from None
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    skips: dict[str, int] = {}
    failures: list[str] = []
    seconds = 0.0
    for case in root.iter("testcase"):
        counts["tests"] += 1
        seconds += float(case.get("time") or 0.0)
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "errors"
                first = (child.get("message") or child.text or "").strip().splitlines()
                failures.append(f"{name}: {first[0][:300] if first else child.tag}")
                break
            if child.tag == "skipped":
                outcome = "skipped"
                reason = (child.get("message") or "").strip() or "(no reason)"
                skips[reason] = skips.get(reason, 0) + 1
                break
        counts[outcome] += 1
    ran = counts["tests"] - counts["skipped"]
    return {**counts, "ran": ran, "seconds": round(seconds, 3), "skip_reasons": skips,
            "failures": failures}


def junit_problems(summary: dict, forbid_skip: list[str]) -> list[str]:
    """Why a test step that exited 0 still did not test what it had to: nothing ran, or a
    test skipped for a reason it must not (``"*"`` forbids every skip)."""
    problems = []
    if summary["ran"] == 0:
        problems.append(f"no test ran ({summary['tests']} collected, all skipped)")
    for reason, count in summary["skip_reasons"].items():
        if any(p == "*" or reason.startswith(p) for p in forbid_skip):
            problems.append(f"{count} skipped: {reason}")
    return problems


# --------------------------------------------------------------------------- assemble


def read_steps(path: Path) -> list[dict]:
    steps = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise LedgerError(f"steps == {str(path)!r}: no such file") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) != len(STEP_FIELDS):
            raise LedgerError(f"{path}:{number}: {len(cells)} tab-separated cells, "
                              f"expected {len(STEP_FIELDS)} ({', '.join(STEP_FIELDS)})")
        step = dict(zip(STEP_FIELDS, cells))
        for key, kind in (("exit_code", int), ("seconds", float), ("limit_s", float)):
            try:
                step[key] = kind(step[key]) if step[key] != "" else None
            except ValueError:
                raise LedgerError(f"{path}:{number}: {key} == {step[key]!r} is not a number") from None
        step["reason"] = step["reason"] or None
        steps.append(step)
    return steps


def _first(row: dict, *keys: str) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)  # "inf" and "nan" written by _finite, "1.2e-07" by a table
    except (TypeError, ValueError):
        return None


def _rows(data: Any) -> list[dict]:
    """A JSON list of row dicts, or a dict holding one under ``"rows"``."""
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = data["rows"]
    if isinstance(data, list):
        return [row for row in data if isinstance(row, dict)]
    return []


def _bench(data: Any) -> dict:
    """``scripts/bench_gpu.py --json``'s document (``schema``, ``complete``, ``header``,
    ``rows``) as it is, or a bare list of rows; whatever else it holds is kept whole under
    ``data``, so that nothing measured is lost."""
    if isinstance(data, dict):
        return {**{k: v for k, v in data.items() if k != "rows"}, "rows": _rows(data)}
    rows = _rows(data)
    return {"rows": rows} if rows or data is None else {"rows": [], "data": data}


def parity_row(row: dict) -> dict:
    """One ``refdml gpu-check --json`` row (keys in the docstring of
    ``refdml.checks._gpu_check_cli.run``) with the ledger's own fields added: ``label``
    (what ran, in words), ``error`` (the larger of the output and gradient errors),
    ``passed`` and ``seconds``, whatever the row's own spelling of them; the row's fields
    are kept as they are."""
    device = _first(row, "device")
    if device is None:
        backend, kernels = _first(row, "backend") or "numpy", _first(row, "path", "kernels") or "array"
        device = backend if kernels == "array" else f"{backend}/{kernels}"
    device = str(device)
    labels = {"cupy": "CuPy array path", "cupy/cuda": "CUDA kernel on CuPy",
              "numpy": "NumPy array path", "numpy/cpu": "CPU twin on NumPy",
              "cuda-simulator": "CUDA kernel under the simulator"}
    error = _number(_first(row, "max_error"))
    if error is None:
        errors = [_number(_first(row, "output_error")), _number(_first(row, "gradient_error"))]
        errors = [e for e in errors if e is not None]
        error = max(errors) if errors else None
    passed = _first(row, "passed")
    if not isinstance(passed, bool):
        result = _first(row, "result", "status")
        passed = isinstance(result, str) and result.strip().lower().startswith("pass")
    seconds = _number(_first(row, "seconds", "time_s"))
    if seconds is None and _number(_first(row, "time_ms")) is not None:
        seconds = _number(row["time_ms"]) / 1e3
    return {**row, "operator": _first(row, "operator", "name"), "device": device,
            "label": labels.get(device, device), "dtype": _first(row, "dtype"), "error": error,
            "passed": passed, "seconds": seconds}


def assemble(run_dir: Path, steps_path: Path, *, dry_run: bool) -> dict:
    """The ledger of one gpu_run.sh call from what its steps wrote into ``run_dir``.

    A file a step did not write leaves its section empty with a ``missing`` note: the
    ledger is written whatever failed, so that one failure never loses the rest.
    """
    run_dir = Path(run_dir)
    missing: list[str] = []

    def load(name: str) -> Any:
        data, why = _load_json(run_dir / name)
        if why:
            missing.append(why)
        return data

    steps = read_steps(steps_path)
    smoke = load("smoke.json") or {}
    build = load("build_info.json") or {}
    compile_data = load("gpu_check_compile.json")
    parity_data = load("gpu_check.json")
    bench_data = load("bench_gpu.json")
    profile_data = load("gpu_profile.json")

    tests = {}
    for key, name in (("gpu_tests", "junit_gpu_tests.xml"), ("train_crosscheck", "junit_train_crosscheck.xml")):
        try:
            tests[key] = junit_summary(run_dir / name)
        except LedgerError as exc:
            missing.append(str(exc))

    train: dict = {"records": [], "config": None}
    train_dir = run_dir / "train_tokens"
    try:
        for line in (train_dir / "log.jsonl").read_text(encoding="utf-8").splitlines():
            if line.strip():
                train["records"].append(json.loads(line))
    except (OSError, ValueError) as exc:
        missing.append(f"train_tokens/log.jsonl not readable ({type(exc).__name__})")
    train["config"], why = _load_json(train_dir / "config.json")
    if why:
        missing.append(f"train_tokens/{why}")

    device = dict(smoke.get("device") or {})
    device.setdefault("simulator", smoke.get("simulator"))
    device.setdefault("cupy_standin", smoke.get("cupy_standin"))
    return {
        "schema": SCHEMA,
        "generator": "scripts/gpu_ledger.py",
        # A dry run (simulator, CuPy stand-in) is never GPU evidence: renderers check this.
        "dry_run": bool(dry_run),
        "date": _now(),
        "passed": bool(steps) and all(s["status"] == "passed" for s in steps),
        "device": device,
        "versions": smoke.get("versions") or {},
        "refdml": {**build, "file": smoke.get("refdml_file"),
                   "version": (smoke.get("versions") or {}).get("refdml")},
        "steps": steps,
        "smoke": {k: smoke.get(k) for k in ("checks", "lazy_imports", "problems", "compat_steps")
                  if k in smoke},
        "compile": {"rows": _rows(compile_data)},
        "parity": {"rows": [parity_row(r) for r in _rows(parity_data)]},
        "tests": tests,
        "bench": _bench(bench_data),
        "profile": _bench(profile_data),
        "train": train,
        "missing": missing,
    }


# --------------------------------------------------------------------------- README


def is_gpu_ledger(ledger: Any) -> bool:
    """True only for the ledger of a real GPU run: not a dry run, the simulator off, the
    real CuPy, and a device name."""
    if not isinstance(ledger, dict) or ledger.get("dry_run") is not False:
        return False
    device = ledger.get("device") or {}
    return (device.get("simulator") is False and device.get("cupy_standin") is False
            and bool(device.get("name")))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return f"{value:g}"
        return f"{value:.2e}" if abs(value) < 1e-3 or abs(value) >= 1e6 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _generic_table(rows: list[dict]) -> list[str]:
    """Rows of unknown shape (the compile check's, the benchmarks'): one column per key,
    in order of first appearance."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    return _table(keys, [[row.get(k) for k in keys] for row in rows])


def _bench_table(rows: list[dict]) -> list[str]:
    """``scripts/bench_gpu.py``'s rows (``section``, ``name``, ``median_s``, ``ratios``, ...),
    one line each; rows of another shape as they are. Where some row carries a
    ``roofline`` estimate (scripts/_roofline.py), a column gives its lower bound in ms,
    marked as an estimate, so that a time can be read against it."""
    if not all("section" in r and "name" in r and "median_s" in r for r in rows):
        return _generic_table(rows)

    def ms(value):
        return None if _number(value) is None else 1e3 * _number(value)

    def goal(row):
        if not row.get("goal"):
            return None
        verdict = {True: "met", False: "NOT met"}.get(row.get("goal_met"), "not judged")
        return f"{row['goal']}: {verdict}"

    def parity(row):
        if row.get("parity_error") is None:
            return None
        return (f"{_cell(_number(row['parity_error']))} (tol {_cell(_number(row.get('parity_tolerance')))}"
                f"{' vs ' + str(row['parity_against']) if row.get('parity_against') else ''})")

    def note(row):
        parts = [str(row.get("note") or "")]
        if row.get("measurement") is False:
            parts.append("not a measurement")
        if row.get("error"):
            parts.append(f"ERROR: {row['error']}")
        return "; ".join(p for p in parts if p) or None

    def roofline(row):
        estimate = row.get("roofline")
        if not isinstance(estimate, dict) or _number(estimate.get("lower_bound_s")) is None:
            return None
        return (f">= {_cell(ms(estimate['lower_bound_s']))} (estimate at "
                f"{estimate.get('size')}, {estimate.get('device')})")

    header = ["section", "path", "dtype", "size", "median ms", "first call ms", "rate",
              "ratios", "goal", "parity error", "note"]
    cells = [[r.get("section"), r.get("name"), r.get("dtype"), r.get("size") or None,
              ms(r.get("median_s")), ms(r.get("first_call_s")),
              None if _number(r.get("rate")) is None else f"{_cell(_number(r['rate']))} {r.get('rate_unit') or ''}".strip(),
              "; ".join(f"{_cell(_number(v))}x {k}" for k, v in (r.get("ratios") or {}).items()) or None,
              goal(r), parity(r), note(r)] for r in rows]
    if any(roofline(r) is not None for r in rows):    # a ledger from before has none
        header.insert(9, "roofline ms (estimate)")
        for row, line in zip(rows, cells):
            line.insert(9, roofline(row))
    return _table(header, cells)


def _profile_table(rows: list[dict]) -> list[str]:
    """``scripts/gpu_profile.py``'s rows (``workload``, ``wall_s``, launches, syncs, device
    time), one line each; rows of another shape as they are."""
    if not all("workload" in r and "wall_s" in r for r in rows):
        return _generic_table(rows)

    def ms(value):
        return None if _number(value) is None else 1e3 * _number(value)

    return _table(
        ["workload", "kernels", "size", "wall ms", "first call ms", "kernel launches",
         "refdml launches", "host syncs", "device kernel ms", "note"],
        [[r.get("workload"), r.get("kernels"), r.get("size"), ms(r.get("wall_s")),
          ms(r.get("first_call_s")), r.get("kernel_launches"), r.get("refdml_launches"),
          r.get("host_syncs"), ms(r.get("device_kernel_s")),
          "; ".join(str(n) for n in (r.get("notes") or []) + ([f"ERROR: {r['error']}"]
                                                             if r.get("error") else []))
          or None] for r in rows])


def render_section(ledger: Any, digest: str | None = None) -> str:
    """The lines between the markers for ``ledger`` (None: no ledger), ending in a
    newline; ``digest`` is the SHA-256 of the ledger file, quoted in the section."""
    note = "<!-- generated by scripts/gpu_ledger.py --readme{}; do not edit by hand -->"
    if not is_gpu_ledger(ledger):
        return "\n".join([
            note.format(""),
            f"**GPU ledger: {NEVER}.** No ledger of a GPU machine has been recorded: every "
            "CUDA kernel has run only under Numba's CUDA simulator and every CuPy path only "
            "on NumPy arrays or the CuPy stand-in. `bash scripts/gpu_run.sh` on a GPU "
            "machine writes one (docs/gpu/gpu-machine.md).", "", ""])
    device, versions = ledger.get("device") or {}, ledger.get("versions") or {}
    build = ledger.get("refdml") or {}
    commit = build.get("git_commit")
    source = (f"commit {commit[:12]}" if commit else "commit unknown") + (
        ", with uncommitted changes" if build.get("git_dirty") else "")
    lines = [note.format(f" from a ledger with sha256 {digest}" if digest else ""),
             f"**GPU ledger**: last run {ledger.get('date', '-')} on {device.get('name')} "
             f"(compute capability {_cell(device.get('compute_capability'))}), driver "
             f"{_cell(device.get('driver_release'))} (CUDA {_cell(device.get('driver_cuda_version'))}), "
             f"CUDA runtime {_cell(device.get('runtime_cuda_version'))}, CuPy {_cell(versions.get('cupy'))}, "
             f"numba {_cell(versions.get('numba'))}, numba-cuda {_cell(versions.get('numba_cuda'))}, "
             f"NumPy {_cell(versions.get('numpy'))}; refdml {_cell(build.get('version'))} ({source}). "
             f"All steps passed: {_cell(ledger.get('passed'))}.", ""]
    lines += _table(["step", "status", "seconds", "note"],
                    [[s.get("name"), s.get("status"), s.get("seconds"), s.get("reason")]
                     for s in ledger.get("steps") or []])
    for key, label in (("gpu_tests", "GPU tests"), ("train_crosscheck", "CPU-vs-GPU training test")):
        summary = (ledger.get("tests") or {}).get(key)
        if summary:
            lines += ["", f"{label}: {summary['passed']} passed, {summary['failed']} failed, "
                          f"{summary['errors']} errors, {summary['skipped']} skipped."]
    gpu_rows = [r for r in (ledger.get("parity") or {}).get("rows") or []
                if str(r.get("device", "")).startswith("cupy")]
    lines += ["", "Parity with the float64 reference on the GPU (`refdml gpu-check`; max "
                  "relative error over outputs and gradients):", ""]
    if gpu_rows:
        lines += _table(["operator", "path", "dtype", "error", "tolerance", "result", "time ms"],
                        [[r.get("operator"), r.get("label"), r.get("dtype"), r.get("error"),
                          r.get("tolerance"), "pass" if r.get("passed") else "FAIL",
                          None if r.get("seconds") is None else 1e3 * r["seconds"]]
                         for r in gpu_rows])
    else:
        lines.append("(no GPU parity rows in this ledger)")
    for key, title, table in (
            ("compile", "Kernels compiled (`refdml gpu-check --compile-only`):", _generic_table),
            ("bench", "Benchmarks (`scripts/bench_gpu.py --device cuda`):", _bench_table),
            ("profile", "Where the time goes (`scripts/gpu_profile.py`: one call of each "
                        "workload):", _profile_table)):
        if key not in ledger and key == "profile":
            continue                 # a ledger from before gpu_run.sh had a profile step
        rows = (ledger.get(key) or {}).get("rows") or []
        lines += ["", title, ""] + (table(rows) if rows else ["(none in this ledger)"])
    # A blank line last: a table must not run into the end marker.
    return "\n".join(lines + ["", ""])


def split_readme(text: str, path: str = "README.md") -> tuple[str, str, str]:
    """``(before, section, after)`` around the markers; each marker must stand on a line of
    its own, once, start before end."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.strip() == START]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or starts[0] > ends[0]:
        raise LedgerError(
            f"{path}: needs one line {START} and, after it, one line {END} (found "
            f"{len(starts)} start and {len(ends)} end marker(s){', end first' if starts and ends and starts[0] > ends[0] else ''})")
    s, e = starts[0], ends[0]
    return "".join(lines[: s + 1]), "".join(lines[s + 1: e]), "".join(lines[e:])


def update_readme(text: str, section: str, path: str = "README.md") -> str:
    before, _, after = split_readme(text, path)
    if not before.endswith("\n"):
        before += "\n"
    return before + section + after


def _ledger_and_digest(path: str | None) -> tuple[Any, str | None]:
    if path is None:
        return None, None
    data, why = _load_json(Path(path))
    if why:
        raise LedgerError(f"ledger == {path!r}: {why}")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise LedgerError(f"ledger == {path!r}: not a schema-{SCHEMA} GPU ledger")
    return data, sha256_file(Path(path))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--assemble", metavar="RUN_DIR", help="write the ledger of a run to --out")
    mode.add_argument("--junit", metavar="FILE", help="summarise a JUnit XML file; exit 1 "
                      "if no test ran or one skipped for a --forbid-skip reason")
    mode.add_argument("--readme", metavar="README", help="rewrite its GPU-ledger section")
    mode.add_argument("--build-info", metavar="WHEEL", help="write what WHEEL was built from to --out")
    mode.add_argument("--source-digest", metavar="REPO", help="print the digest of the wheel's sources")
    parser.add_argument("--steps", metavar="TSV", help="--assemble: the steps' table of gpu_run.sh")
    parser.add_argument("--out", metavar="PATH", help="--assemble, --build-info: the file to write")
    parser.add_argument("--dry-run", action="store_true", help="--assemble: mark the ledger a dry run")
    parser.add_argument("--forbid-skip", nargs="*", default=[], metavar="PREFIX",
                        help="--junit: skip reasons starting so fail the check ('*': any skip)")
    parser.add_argument("--ledger", metavar="JSON", help="--readme: the ledger (none: 'never run on a GPU')")
    parser.add_argument("--check", action="store_true", help="--readme: write nothing; exit 1 if stale")
    parser.add_argument("--repo", metavar="DIR", default=".", help="--build-info: the repository")
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except LedgerError as exc:
        print(f"gpu_ledger.py: error: {exc}", file=sys.stderr)
        return 2


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.assemble:
        if not args.steps or not args.out:
            parser.error("--assemble needs --steps and --out")
        ledger = assemble(Path(args.assemble), Path(args.steps), dry_run=args.dry_run)
        write_atomic(Path(args.out), dumps(ledger))
        print(f"ledger: {args.out} ({len(ledger['steps'])} steps, {len(ledger['parity']['rows'])} "
              f"parity rows, {len(ledger['compile']['rows'])} compile rows, "
              f"{len(ledger['bench']['rows'])} benchmark rows"
              + (f"; missing: {'; '.join(ledger['missing'])}" if ledger["missing"] else "") + ")")
        return 0
    if args.junit:
        summary = junit_summary(Path(args.junit))
        problems = junit_problems(summary, args.forbid_skip)
        print(f"{args.junit}: {summary['tests']} tests, {summary['passed']} passed, "
              f"{summary['failed']} failed, {summary['errors']} errors, {summary['skipped']} skipped")
        for reason, count in summary["skip_reasons"].items():
            print(f"  skipped x{count}: {reason}")
        for problem in problems:
            print(f"  PROBLEM: {problem}")
        return 1 if problems else 0
    if args.build_info:
        if not args.out:
            parser.error("--build-info needs --out")
        write_atomic(Path(args.out), json.dumps(build_info(Path(args.build_info), Path(args.repo)),
                                                indent=2) + "\n")
        return 0
    if args.source_digest:
        print(source_digest(Path(args.source_digest)))
        return 0
    path = Path(args.readme)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LedgerError(f"readme == {args.readme!r}: {exc.strerror or exc}") from None
    ledger, digest = _ledger_and_digest(args.ledger)
    if ledger is not None and not is_gpu_ledger(ledger):
        print(f"gpu_ledger.py: {args.ledger} is not the ledger of a GPU run (dry run, simulator "
              f"or CuPy stand-in): the section says '{NEVER}'", file=sys.stderr)
        digest = None
    new = update_readme(text, render_section(ledger, digest), args.readme)
    if args.check:
        if new != text:
            print(f"{args.readme}: the GPU-ledger section differs from what "
                  f"{args.ledger or 'no ledger'} renders; run without --check to rewrite it",
                  file=sys.stderr)
            return 1
        print(f"{args.readme}: the GPU-ledger section is up to date")
        return 0
    if new != text:
        write_atomic(path, new)
    print(f"{args.readme}: GPU-ledger section {'rewritten' if new != text else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
