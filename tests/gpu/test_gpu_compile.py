"""``refdml gpu-check --compile-only``: every CUDA kernel compiled for real GPUs, no GPU.

Numba's simulator (on in this session: tests/conftest.py) never types a kernel for the CUDA
target, and numba reads ``NUMBA_ENABLE_CUDASIM`` once, at import: every compilation here
runs in a child process with the simulator off, started in ``tmp_path`` (from the
repository root the source ``refdml/``, which has no ``gpu/``, would shadow the installed
package). The children need numba-cuda (the ``gpu`` extra): without it they skip, except
in CI (``CI=true``), which installs the extra, so there a missing numba-cuda fails.

The registry tests run here, in the simulator's session: they need no toolchain.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import refdml.gpu
from refdml.cli import main
from refdml.gpu.families import KERNEL_FAMILIES
from refdml.gpu.kcenter import _cuda as kcenter_cuda
from refdml.gpu.ot import _cuda as sinkhorn_cuda
from refdml.gpu import _compile_check
from refdml.gpu._support.launch import BLOCK

FAST_PATH = Path(refdml.gpu.__file__).parent
_NO_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is None
needs_numba_cuda = pytest.mark.skipif(
    _NO_NUMBA_CUDA and os.environ.get("CI") != "true",
    reason="numba-cuda is not installed (the gpu extra: pip install 'refdml[gpu]')",
)


def _child(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``python *args`` with the simulator off, in ``cwd``."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1200)


# --------------------------------------------------------------------------- the registry
def _is_cuda_jit(node: ast.AST) -> bool:
    """``cuda.jit`` (or ``numba.cuda.jit``), or refdml's declaring decorator
    ``cuda_kernel``, as an expression."""
    if isinstance(node, ast.Name):
        return node.id == "cuda_kernel"
    return (isinstance(node, ast.Attribute) and node.attr == "jit"
            and ((isinstance(node.value, ast.Name) and node.value.id == "cuda")
                 or (isinstance(node.value, ast.Attribute) and node.value.attr == "cuda")))


def _device_flag(call: ast.Call) -> bool:
    for keyword in call.keywords:
        if keyword.arg == "device":
            assert isinstance(keyword.value, ast.Constant), (
                f"cuda.jit(device=...) must be a literal for this scan, line {call.lineno}")
            return bool(keyword.value.value)
    return False


def _function_name(node: ast.AST, where: str) -> str:
    """The kernel name of ``cuda.jit(...)(node)``: ``f`` for ``f`` or ``f.py_func``."""
    if isinstance(node, ast.Attribute) and node.attr == "py_func":
        node = node.value
    assert isinstance(node, ast.Name), f"{where}: cannot tell the name of the kernel built here"
    return node.id


def _kernels_in(path: Path) -> set[str]:
    """Names of the ``@cuda.jit`` kernels (not device functions) defined in ``path``:
    decorated functions, nested ones included, and kernels made by calling ``cuda.jit``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found, decorators = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                decorators.add(id(dec))
                if _is_cuda_jit(dec) or (isinstance(dec, ast.Call) and _is_cuda_jit(dec.func)
                                         and not _device_flag(dec)):
                    found.add(node.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or id(node) in decorators:
            continue
        where = f"{path.name}:{node.lineno}"
        if isinstance(node.func, ast.Call) and _is_cuda_jit(node.func.func):
            if not _device_flag(node.func):                   # cuda.jit(...)(function)
                found.add(_function_name(node.args[0], where))
        elif _is_cuda_jit(node.func) and not _device_flag(node):
            if node.args and not (isinstance(node.args[0], ast.Constant)
                                  and isinstance(node.args[0].value, str)):
                found.add(_function_name(node.args[0], where))  # cuda.jit(function)
    return found


def test_the_ast_scan_sees_each_way_of_making_a_kernel(tmp_path):
    source = tmp_path / "kernels.py"
    source.write_text(
        "from numba import cuda\n"
        "@cuda.jit\ndef bare(x): pass\n"
        "@cuda.jit(cache=True)\ndef with_options(x): pass\n"
        "@cuda.jit(device=True)\ndef helper(x): pass\n"
        "def factory():\n    @cuda.jit\n    def nested(x): pass\n    return nested\n"
        "def plain(x): pass\n"
        "made = cuda.jit('void(float64[::1])')(plain)\n"
        "also_made = cuda.jit(helper.py_func)\n"
        "device_made = cuda.jit(device=True)(plain)\n"
        "@cuda_kernel(signatures={}, cache=True)\ndef declared(x): pass\n"
    )
    assert _kernels_in(source) == {"bare", "with_options", "nested", "plain", "helper",
                                   "declared"}


def _package_sources():
    # refdml/gpu/_support/cuda.py, the import point, defines the declaring decorator itself
    root = FAST_PATH.parent
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts
                  and p != FAST_PATH / "_support" / "cuda.py")


def test_every_cuda_kernel_is_declared_in_a_cuda_family_module():
    """Every ``@cuda.jit`` kernel of refdml (an AST scan of the whole package) is defined
    in the ``_cuda.py`` module of a family package ``refdml/gpu/<family>/``, that family is
    registered in :data:`refdml.gpu.families.KERNEL_FAMILIES` with a CUDA member, and each kernel
    is declared with its launch types (:func:`cuda_kernel`)."""
    found = {path: _kernels_in(path) for path in _package_sources()}
    outside = {str(p): sorted(k) for p, k in found.items()
               if k and not (p.name == "_cuda.py" and p.parent.parent == FAST_PATH)}
    assert outside == {}, "CUDA kernels outside refdml/gpu/<family>/_cuda.py"
    cuda_families = sorted(p.parent.name for p in FAST_PATH.glob("*/_cuda.py"))
    assert cuda_families == sorted(name for name, family in KERNEL_FAMILIES.items()
                                   if "cuda" in family.kernel_modes)
    defined = set().union(*found.values())
    registered = set(_compile_check.registry())
    assert defined, "the scan found no @cuda.jit kernel"
    assert defined - registered == set(), "kernels without declared launch signatures"
    assert registered - defined == set(), "declared names that no module defines"


def test_every_registered_signature_parses_with_a_dtype_key():
    from numba.core import sigutils, types

    for name, by_dtype in _compile_check.registry().items():
        # both dtypes, or one set of types that serves both
        assert set(by_dtype) in ({"float32", "float64"}, {_compile_check.ANY_DTYPE}), name
        for dtype, signature in by_dtype.items():
            args, return_type = sigutils.normalize_signature(signature)
            assert return_type == types.void, (name, dtype)
            if dtype != _compile_check.ANY_DTYPE:        # the dtype's arrays are its own
                assert any(getattr(a, "dtype", None) == getattr(types, dtype) for a in args)
            if dtype == "float32":      # and only those differ from the float64 launch
                assert signature.replace("float32", "float64") == by_dtype["float64"], name


def test_signatures_of_answers_by_the_python_function_name():
    assert _compile_check.signatures_of("refdml_loss_masked_lse") == [
        f"void({dt}[:, ::1], boolean[:, ::1], boolean, boolean, {dt}[::1], {dt}[:, ::1])"
        for dt in ("float32", "float64")]
    assert len(_compile_check.signatures_of("refdml_kcenter_step")) == 2
    with pytest.raises(KeyError, match="'no_such_kernel' is not a registered CUDA kernel"):
        _compile_check.signatures_of("no_such_kernel")


# --------------------------------------------------------------------------- the CLI here
def test_compile_only_refuses_bad_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["gpu-check", "--compile-only", "--arch", "sm_91"])
    assert exc.value.code == 2
    assert "arch == 'sm_91', must be one of" in capsys.readouterr().err
    assert main(["gpu-check", "--arch", "sm_80"]) == 2
    assert "--arch needs --compile-only" in capsys.readouterr().err
    assert main(["gpu-check", "--compile-only", "--dtype", "float32"]) == 2
    assert "--dtype belongs to the parity check" in capsys.readouterr().err
    assert main(["gpu-check", "--compile-only", "--json", str(tmp_path)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                    reason="the simulator is off in this session (a GPU machine)")
def test_compile_only_stops_under_the_simulator(capsys):
    assert main(["gpu-check", "--compile-only"]) == 2
    expected = "install refdml[gpu]" if _NO_NUMBA_CUDA else "NUMBA_ENABLE_CUDASIM=0"
    assert expected in capsys.readouterr().err


_PARITY_KEYS = {"operator", "backend", "path", "device", "dtype", "output_error",
                "gradient_error", "max_error", "tolerance", "passed", "seconds", "problems"}


def test_parity_rows_as_json(capsys, tmp_path):
    out = tmp_path / "sub" / "parity.json"
    assert main(["gpu-check", "--only", "normalize", "--dtype", "float64", "--json",
                 str(out)]) == 0
    table = [line.split() for line in capsys.readouterr().out.splitlines()
             if line.startswith("normalize.")]
    rows = json.loads(out.read_text())
    assert len(rows) == len(table) > 0
    for row, cells in zip(rows, table):
        assert set(row) == _PARITY_KEYS
        assert (row["operator"], row["device"], row["dtype"]) == tuple(cells[:3])
        assert [f"{row['output_error']:.2e}", f"{row['gradient_error']:.2e}",
                f"{row['tolerance']:.0e}"] == cells[3:6]
        assert row["path"] in ("array", "cpu", "cuda") and row["passed"] is True
        assert row["max_error"] == max(row["output_error"], row["gradient_error"])
        assert row["max_error"] <= row["tolerance"] and row["problems"] == []
        assert row["seconds"] > 0


def test_parity_json_keeps_a_crash(monkeypatch, tmp_path):
    from refdml.gradcheck import parity

    def crashing(spec, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(parity, "check_parity", crashing)
    out = tmp_path / "parity.json"
    assert main(["gpu-check", "--only", "normalize.l2", "--dtype", "float32", "--json",
                 str(out)]) == 1
    rows = json.loads(out.read_text())
    assert rows and all(set(r) == _PARITY_KEYS for r in rows)
    for row in rows:
        assert row["passed"] is False and row["problems"] == ["CRASH RuntimeError('boom')"]
        assert row["max_error"] is None and row["seconds"] is None


# --------------------------------------------------------------------------- compiled
@needs_numba_cuda
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path):
    from refdml.gpu._support.occupancy import theoretical_occupancy

    out = tmp_path / "compile.json"
    run = _child(["-m", "refdml.cli", "gpu-check", "--compile-only", "--json", str(out)],
                 tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())
    expected = {(name, dtype, arch) for name, by_dtype in _compile_check.registry().items()
                for dtype in by_dtype for arch in _compile_check.DEFAULT_ARCHS}
    assert sorted((r["kernel"], r["signature"], r["arch"]) for r in rows) == sorted(expected)
    for row in rows:
        assert row["status"] == "ok" and row["passed"] and row["problems"] == [], row
        assert row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0, row
        assert 0 <= row["shared_bytes"] <= _compile_check.STATIC_SHARED_LIMIT, row
        assert 8 <= row["registers"] <= 255, row
        assert row["local_bytes"] >= 0, row
        assert row["kernel"] in run.stdout
        # occupancy at BLOCK threads: a fraction in (0, 1], the occupancy function's on the
        # row's own registers and shared memory, and the same cells in the printed table
        assert row["block_threads"] == BLOCK, row
        assert 0 < row["occupancy"] <= 1, row
        occ = theoretical_occupancy(row["arch"], row["registers"], row["shared_bytes"], BLOCK)
        assert (row["occupancy"], row["occupancy_limit"]) == (occ.fraction, occ.limited_by)
        printed = [line for line in run.stdout.splitlines()
                   if line.split()[:3] == [row["kernel"], row["signature"], row["arch"]]]
        assert len(printed) == 1, row
        assert f" {100 * row['occupancy']:.2f}% " in printed[0], printed
        assert f" {row['occupancy_limit']} " in printed[0], printed
    assert f"occupancy at {BLOCK} thr/block" in run.stdout
    # The static shared memory read from the log is what the kernels declare (their sources:
    # float64 (6, BLOCK) trees for GSP; for the k-center step the centre's chunk (float64),
    # float64 + int64 BLOCK arg-max slots and an int32 flag;
    # the Sinkhorn tile of TILE_BYTES plus nine float64 BLOCK vectors and three int32 flags).
    declared = {"refdml_gsp_transport": 6 * BLOCK * 8,
                "refdml_kcenter_step": (kcenter_cuda.CENTRE_CHUNK + 2 * BLOCK) * 8 + 4,
                "refdml_loss_masked_lse": 2 * BLOCK * 8,
                "refdml_ot_sinkhorn_small": sinkhorn_cuda.TILE_BYTES + 9 * BLOCK * 8 + 3 * 4,
                "refdml_ot_lse_half_step": 0}
    for row in rows:
        if row["kernel"] in declared:
            assert row["shared_bytes"] == declared[row["kernel"]], row


# For every registered kernel: whether numba-cuda caches it on disk, and its cache index
# key (numba_cuda's CUDACache._index_key: the signature, the code's bytes and the closure's
# values pickled) hashed, with a stand-in for the codegen's part of the key.
_CACHE_KEYS = """
import hashlib, json
from numba.cuda.dispatcher import CUDACache
from refdml.gpu import _compile_check

class Codegen:
    def magic_tuple(self):
        return ("sm_90",)

keys = {}
for launch in _compile_check.launches():
    kernel = launch.dispatcher
    key = CUDACache(kernel.py_func)._index_key(launch.numba_signature, Codegen())
    keys[f"{launch.kernel} {launch.signature}"] = [
        type(kernel._cache).__name__, hashlib.sha256(repr(key).encode()).hexdigest()]
print(json.dumps(keys))
"""


@needs_numba_cuda
def test_every_kernel_is_cached_on_disk_under_a_key_that_holds_across_processes(tmp_path):
    # numba-cuda finds a cached kernel by a key that includes its closure, pickled: the GSP
    # kernels, once built in a factory, pickled differently in every process (their
    # closures reached Numba CPU dispatchers, each pickled with a fresh uuid), so every
    # process compiled them again. Two processes must compute the same key for every kernel.
    runs = []
    for _ in range(2):
        run = _child(["-c", _CACHE_KEYS], tmp_path)
        assert run.returncode == 0, run.stderr
        runs.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert set(runs[0]) == {f"{k} {d}" for k, by in _compile_check.registry().items() for d in by}
    for name, (cache, key) in runs[0].items():
        assert cache == "CUDACache", f"{name} is not cached on disk (@cuda.jit(cache=True))"
        assert runs[1][name][1] == key, f"{name}: its cache key differs between processes"


@needs_numba_cuda
def test_failures_are_rows_and_exit_status_1(tmp_path):
    """Throwaway kernels through the same functions: a CUDA type error (``np.zeros`` in a
    kernel: the simulator runs it, the CUDA target has no allocation), static shared memory
    over 48 KiB, over a lower limit, a forced spill; and the CLI's exit status."""
    run = _child([__file__, "failure-cases", str(tmp_path)], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads((tmp_path / "cases.json").read_text())
    rows = {r["kernel"]: r for r in result["rows"]}
    assert rows["copy_kernel"]["passed"] and rows["copy_kernel"]["registers"] > 0
    assert not rows["scratch_kernel"]["passed"]
    assert "compile error: TypingError" in rows["scratch_kernel"]["problems"][0]
    assert rows["scratch_kernel"]["registers"] is None
    assert rows["scratch_kernel"]["occupancy"] is None
    assert 0 < rows["copy_kernel"]["occupancy"] <= 1
    assert not rows["too_much_shared"]["passed"]
    assert "too much shared data" in rows["too_much_shared"]["problems"][0]
    limited = rows["some_shared"]
    assert limited["shared_bytes"] == 512 * 8 and not limited["passed"]
    assert limited["problems"] == [f"static shared memory {512 * 8} B > 2048 B"]
    spilled = rows["spilling"]
    assert not spilled["passed"] and spilled["spill_store_bytes"] > 0
    assert spilled["problems"][0].startswith("spills: ")
    # the CLI over a broken and a good kernel: both rows, exit status 1
    assert result["cli_status"] == 1
    cli = json.loads((tmp_path / "cli.json").read_text())
    assert [(r["kernel"], r["passed"]) for r in cli] == [("scratch_kernel", False),
                                                         ("copy_kernel", True)]


def _failure_cases(out_dir: Path) -> None:
    """The child of :func:`test_failures_are_rows_and_exit_status_1` (simulator off)."""
    import numpy as np
    from numba import cuda, float64

    from refdml.gpu._compile_check import Launch, STATIC_SHARED_LIMIT, check_kernel, rows_to_json

    too_big = STATIC_SHARED_LIMIT // 8 + 1

    @cuda.jit
    def copy_kernel(x, y):
        i = cuda.grid(1)
        if i < x.shape[0]:
            y[i] = x[i]

    @cuda.jit
    def scratch_kernel(x):
        tmp = np.zeros(4)
        tmp[0] = x[0]
        x[1] = tmp[0]

    @cuda.jit
    def too_much_shared(x):
        s = cuda.shared.array(too_big, float64)
        s[cuda.threadIdx.x] = x[0]
        cuda.syncthreads()
        x[cuda.threadIdx.x] = s[cuda.threadIdx.x + 1]

    @cuda.jit
    def some_shared(x):
        s = cuda.shared.array(512, float64)
        s[cuda.threadIdx.x] = x[0]
        cuda.syncthreads()
        x[cuda.threadIdx.x] = s[cuda.threadIdx.x + 1]

    @cuda.jit(max_registers=24)
    def spilling(x, y):
        # 16 float64 chains live across the loop: 32+ registers wanted, 24 allowed
        t = cuda.threadIdx.x
        a0, a1, a2, a3, a4, a5, a6, a7 = x[t], x[t + 1], x[t + 2], x[t + 3], x[t + 4], \
            x[t + 5], x[t + 6], x[t + 7]
        b0, b1, b2, b3, b4, b5, b6, b7 = x[t + 8], x[t + 9], x[t + 10], x[t + 11], \
            x[t + 12], x[t + 13], x[t + 14], x[t + 15]
        for j in range(y.shape[0]):
            v = y[j]
            a0 = a0 * v + b7
            a1 = a1 * v + a0
            a2 = a2 * v + a1
            a3 = a3 * v + a2
            a4 = a4 * v + a3
            a5 = a5 * v + a4
            a6 = a6 * v + a5
            a7 = a7 * v + a6
            b0 = b0 * v + a7
            b1 = b1 * v + b0
            b2 = b2 * v + b1
            b3 = b3 * v + b2
            b4 = b4 * v + b3
            b5 = b5 * v + b4
            b6 = b6 * v + b5
            b7 = b7 * v + b6
        x[t] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + b0 + b1 + b2 + b3 + b4 + b5 + b6 + b7

    one, two = "void(float64[::1])", "void(float64[::1], float64[::1])"
    rows = [check_kernel(copy_kernel, two, "sm_80"),
            check_kernel(scratch_kernel, one, "sm_80"),
            check_kernel(too_much_shared, one, "sm_90"),
            check_kernel(some_shared, one, "sm_80", shared_limit=2048),
            check_kernel(spilling, two, "sm_80")]
    from refdml import cli
    from refdml.gpu import _compile_check

    _compile_check.launches = lambda: [Launch("scratch_kernel", "float64", one, scratch_kernel),
                                      Launch("copy_kernel", "float64", two, copy_kernel)]
    status = cli.main(["gpu-check", "--compile-only", "--arch", "sm_80", "--json",
                       str(out_dir / "cli.json")])
    (out_dir / "cases.json").write_text(json.dumps(
        {"rows": rows_to_json(rows), "cli_status": status}))


if __name__ == "__main__" and sys.argv[1:2] == ["failure-cases"]:
    _failure_cases(Path(sys.argv[2]))
