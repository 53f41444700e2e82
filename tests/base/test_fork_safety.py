"""Fork safety of the compiled parallel paths (issue 20): Numba's threading layer.

Numba's default layer on Linux, GNU OpenMP, terminates a child forked after a parallel
region; refdml asks Numba for its "forksafe" layer instead (refdml.gpu._support.threading_layer,
docs/gpu/threading.md). The runs happen in a fresh interpreter (a threading layer is fixed for the
life of a process, so this process's own state must not matter): the compiled paths in the
parent, then in children forked by multiprocessing and by os.fork (one of them while
another thread holds the launch lock), then in a spawned child, and from three threads at
once. The static checks below keep every kernel launch behind ``parallel_launch`` and
every ``prange`` free of reductions (what would make a result depend on the schedule).
"""

import ast
import functools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINUX = sys.platform.startswith("linux")
TIMEOUT = 240   # seconds for one fresh interpreter; a cold Numba cache compiles here

# The compiled paths of the issue on tiny inputs, and the scenarios around them. A child
# sends its results back through a pipe; the parent prints one JSON line.
SCENARIOS = r'''
import json, multiprocessing, os, pickle, sys, threading
import numpy as np


def compute():
    import numba
    from refdml.gpu.kcenter import greedy_k_center
    from refdml.gpu.metrics import retrieval_metrics
    from refdml.gpu.ot import pairwise_sinkhorn_divergence

    rng = np.random.default_rng(0)
    points = rng.standard_normal((300, 8))
    picks = greedy_k_center(points, 12, rng=0)
    metrics = retrieval_metrics(points, rng.integers(0, 10, 300))
    divergence = pairwise_sinkhorn_divergence(rng.standard_normal((4, 6, 3)), eps=0.5)
    return {"layer": numba.threading_layer(), "indices": picks.indices.tolist(),
            "radii": picks.radii.tolist(),
            "metrics": {name: float(value) for name, value in metrics.items()},
            "divergence": divergence.ravel().tolist()}


def send(connection):
    connection.send(compute())
    connection.close()


def in_process(context):
    receive, send_end = context.Pipe(duplex=False)
    child = context.Process(target=send, args=(send_end,))
    child.start()
    send_end.close()
    try:
        result = receive.recv() if receive.poll(120) else None
    except EOFError:                     # the child died before it sent anything
        result = None
    child.join(120)
    return {"exitcode": child.exitcode, "result": result}


def in_os_fork():
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.write(write, pickle.dumps(compute()))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as stream:
        data = stream.read()
    _, status = os.waitpid(pid, 0)
    return {"exitcode": os.waitstatus_to_exitcode(status),
            "result": pickle.loads(data) if data else None}


def fork_while_lock_held():
    """os.fork while another thread is inside parallel_launch (holding the launch lock)."""
    from refdml.gpu._support.threading_layer import parallel_launch

    inside, leave = threading.Event(), threading.Event()

    def hold():
        with parallel_launch():
            inside.set()
            leave.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(60)
    try:
        return in_os_fork()
    finally:
        leave.set()
        holder.join()


def from_threads(n_threads=3, calls=15):
    """The kernels from several threads at once (workqueue aborts on concurrent launches)."""
    results, errors = [], []

    def work():
        try:
            for _ in range(calls):
                results.append(compute())
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"errors": errors, "results": results[:: calls]}


if __name__ == "__main__":
    report = {"parent": compute()}
    report["mp_fork"] = in_process(multiprocessing.get_context("fork"))
    report["os_fork"] = in_os_fork()
    report["os_fork_lock_held"] = fork_while_lock_held()
    report["threads"] = from_threads()
    report["mp_spawn"] = in_process(multiprocessing.get_context("spawn"))
    print("REPORT " + json.dumps(report))
'''

# What the layer of one kcenter call is; argv[1]: a layer to set in numba.config first.
LAYER_PROBE = r'''
import sys
import numpy as np
if len(sys.argv) > 1:
    import numba
    numba.config.THREADING_LAYER = sys.argv[1]
import numba
from refdml.gpu.kcenter import greedy_k_center
greedy_k_center(np.random.default_rng(0).standard_normal((50, 3)), 3, rng=0)
print("LAYER " + numba.threading_layer())
'''

# Numba's own resolution of "forksafe" on this machine, without refdml.
NUMBA_FORKSAFE = r'''
import numpy as np
import numba
@numba.njit(parallel=True)
def fill(x):
    for i in numba.prange(x.shape[0]):
        x[i] = i
fill(np.empty(8))
print("LAYER " + numba.threading_layer())
'''


def _env(**extra):
    """This environment without any threading-layer choice (refdml's default is tested) and
    without a kernel mode that would bypass the compiled paths; two Numba threads."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY",
                        "REFDML_GPU_KERNELS")}
    env["NUMBA_NUM_THREADS"] = "2"
    env.update(extra)
    return env


def _run(path, *args, env, tag):
    done = subprocess.run([sys.executable, str(path), *args], env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=path.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith(tag + " ")]
    assert line, done.stdout[-2000:] + done.stderr[-2000:]
    return line[-1][len(tag) + 1:]


def _script(tmp_path_factory, name, text):
    path = tmp_path_factory.mktemp("fork_safety") / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if not hasattr(os, "fork"):
        pytest.skip("fork(2) is POSIX only")
    path = _script(tmp_path_factory, "scenarios.py", SCENARIOS)
    return json.loads(_run(path, env=_env(), tag="REPORT"))


def _layer(tmp_path_factory, text, *args, **env):
    path = _script(tmp_path_factory, "probe.py", text)
    return _run(path, *args, env=_env(**env), tag="LAYER")


def assert_same_results(got, want):
    """Equal results. By construction they are equal to the bit on one machine: no kernel
    depends on the schedule (test_no_prange_reduction), the thread count is the same (2) and
    host BLAS runs one thread inside the kernels. The float tolerance only allows for a BLAS
    whose GEMM rounding depends on the alignment of its inputs (MKL without CNR mode)."""
    assert got is not None
    assert got["layer"] == want["layer"]
    assert got["indices"] == want["indices"]
    np.testing.assert_allclose(got["radii"], want["radii"], rtol=1e-13, atol=0)
    assert got["metrics"].keys() == want["metrics"].keys()
    for name, value in want["metrics"].items():
        np.testing.assert_allclose(got["metrics"][name], value, rtol=1e-13, atol=0,
                                   err_msg=name)
    np.testing.assert_allclose(got["divergence"], want["divergence"], rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("scenario", ["mp_fork", "os_fork", "os_fork_lock_held", "mp_spawn"])
def test_child_after_parent_succeeds_with_equal_results(report, scenario):
    child = report[scenario]
    assert child["exitcode"] == 0, f"{scenario}: exit code {child['exitcode']}"
    assert_same_results(child["result"], report["parent"])


def test_parallel_paths_from_several_threads_at_once(report):
    threads = report["threads"]
    assert threads["errors"] == []
    assert len(threads["results"]) == 3
    for result in threads["results"]:
        assert_same_results(result, report["parent"])


def test_default_layer_is_numbas_forksafe_choice(report, tmp_path_factory):
    want = _layer(tmp_path_factory, NUMBA_FORKSAFE, NUMBA_THREADING_LAYER="forksafe")
    assert report["parent"]["layer"] == want
    if LINUX:
        assert want in ("tbb", "workqueue")   # never GNU OpenMP


# The explicit choice: GNU OpenMP on Linux (the user who never forks and wants it back),
# elsewhere a layer that always loads.
EXPLICIT = "omp" if LINUX else "workqueue"


def test_explicit_environment_variable_is_respected(tmp_path_factory):
    assert _layer(tmp_path_factory, LAYER_PROBE, NUMBA_THREADING_LAYER=EXPLICIT) == EXPLICIT


def test_explicit_numba_config_is_respected(tmp_path_factory):
    assert _layer(tmp_path_factory, LAYER_PROBE, EXPLICIT) == EXPLICIT


# --------------------------------------------------------------------------- static checks
SOURCES = sorted((ROOT / "refdml").rglob("*.py"))


def _is_parallel_njit(decorator) -> bool:
    if not isinstance(decorator, ast.Call):
        return False
    name = getattr(decorator.func, "id", getattr(decorator.func, "attr", None))
    return name == "njit" and any(
        k.arg == "parallel" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in decorator.keywords)


def _is_njit(decorator) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return getattr(target, "id", getattr(target, "attr", None)) in ("njit", "jit")


@functools.cache
def _trees():
    return {path: ast.parse(path.read_text(), filename=str(path)) for path in SOURCES}


def _parallel_kernels(trees):
    found = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(map(_is_parallel_njit,
                                                             node.decorator_list)):
                found[node.name] = path
    return found


def test_the_static_checks_see_the_kernels():
    kernels = _parallel_kernels(_trees())
    # the paths: k-center, retrieval, the OT pair route (costs and solver)
    for name in ("_traverse_cpu", "_candidates32", "_rerank", "refdml_ot_pair_sq_cpu",
                 "refdml_ot_sinkhorn_small_cpu"):
        assert name in kernels


def _launches_outside_parallel_launch(tree, kernels, kernel_modules):
    """Calls of a parallel kernel (or of get_num_threads, which starts Numba's threads)
    from Python code that no enclosing ``with parallel_launch()`` covers."""
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def covered(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef) and any(map(_is_njit, node.decorator_list)):
                return True                                   # compiled caller
            if isinstance(node, ast.With) and any(
                    isinstance(item.context_expr, ast.Call)
                    and getattr(item.context_expr.func, "id",
                                getattr(item.context_expr.func, "attr", None))
                    == "parallel_launch" for item in node.items):
                return True
        return False

    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = getattr(func, "id", getattr(func, "attr", None))
        dynamic = (isinstance(func, ast.Call) and getattr(func.func, "id", None) == "getattr"
                   and getattr(func.args[0], "id", None) in kernel_modules)
        if (name in kernels or name == "get_num_threads" or dynamic) and not covered(node):
            bad.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def test_every_parallel_launch_goes_through_parallel_launch():
    trees = _trees()
    kernels = _parallel_kernels(trees)
    kernel_modules = {path.stem for path in kernels.values()}
    bad = {str(path.relative_to(ROOT)): found for path, tree in trees.items()
           if (found := _launches_outside_parallel_launch(tree, kernels, kernel_modules))}
    assert bad == {}


def test_launch_check_finds_an_unguarded_call():
    """The check above can fail: calls outside ``with parallel_launch()`` are found."""
    tree = ast.parse(
        "def run(x):\n"
        "    with parallel_launch():\n"
        "        kernel(x)\n"
        "    mod.kernel(x)\n"
        "    getattr(mod, 'kernel')(x)\n"
        "    return get_num_threads()\n")
    found = _launches_outside_parallel_launch(tree, {"kernel"}, {"mod"})
    assert sorted(line.split(":")[0] for line in found) == ["line 4", "line 5", "line 6"]


def _reduction_names(loop: ast.For) -> set:
    """Names that the body of ``loop`` reads before it binds them and also rebinds: live
    into the loop and updated by it, which Numba turns into a reduction across threads
    whose partial results depend on the schedule. Private names start with a store."""
    body = ast.Module(body=loop.body, type_ignores=[])
    # A binding happens after the expression that it binds is evaluated: at the end of
    # its statement (of the iterable, for a loop target).
    bound_at = {}
    for node in ast.walk(body):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            where = (node.end_lineno, node.end_col_offset)
        elif isinstance(node, ast.For):
            targets, where = [node.target], (node.iter.end_lineno, node.iter.end_col_offset)
        else:
            continue
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    bound_at[id(name)] = where
    events = []
    for node in ast.walk(body):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            events.append((node.lineno, node.col_offset, node.target.id, "load"))
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Store):
                events.append((*bound_at.get(id(node), (node.lineno, node.col_offset)),
                               node.id, "store"))
            else:
                events.append((node.lineno, node.col_offset, node.id, "load"))
    first, stored = {}, set()
    for _, _, name, kind in sorted(events):
        first.setdefault(name, kind)
        if kind == "store":
            stored.add(name)
    return {name for name in stored if first[name] == "load"}


def test_no_prange_reduction():
    """Every prange iteration writes its own outputs; a reduction (a name updated across
    iterations) would combine per-thread partials in a schedule-dependent way under TBB."""
    found = {}
    for path, tree in _trees().items():
        for func in ast.walk(tree):
            if not (isinstance(func, ast.FunctionDef)
                    and any(map(_is_parallel_njit, func.decorator_list))):
                continue
            for loop in ast.walk(func):
                if (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)
                        and getattr(loop.iter.func, "id", None) == "prange"):
                    names = _reduction_names(loop)
                    if names:
                        found[f"{path.name}:{func.name}:{loop.lineno}"] = sorted(names)
    assert found == {}


def test_reduction_check_finds_a_reduction():
    """The check above can fail: a prange sum into an outer name is found, a private one is not."""
    tree = ast.parse(
        "def f(x):\n"
        "    total = 0.0\n"
        "    for i in prange(x.shape[0]):\n"
        "        acc = 0.0\n"
        "        for j in range(3):\n"
        "            acc += x[i, j]\n"
        "        total += acc\n"
        "        other = other + acc\n"
        "    return total\n")
    loop = next(n for n in ast.walk(tree) if isinstance(n, ast.For))
    assert _reduction_names(loop) == {"total", "other"}
