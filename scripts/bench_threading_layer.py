"""Benchmark: refdml's compiled parallel paths under each Numba threading layer (issue 20).

Not a test. A threading layer is fixed for the life of a process, so each layer gets its own
worker process (``NUMBA_THREADING_LAYER`` set in its environment); the workers warm up (the
Numba cache is loaded, one call of each path), then this process asks them in turn for one
timed call of every path, ``--repeats`` times (interleaved, as scripts/_bench.py does within
one process, so every layer runs under the same machine load; 0.5 s pause before each turn
so that the previous worker's threads are idle), and prints medians and the
ratio to ``omp`` (GNU OpenMP: Numba's default on Linux, which a forked child cannot use).
Layers: ``omp``, ``workqueue`` (what refdml picks on Linux without TBB) and ``tbb`` when a
compatible libtbb loads (the worker says when it does not). The results of every path are
asserted equal across layers (indices exactly, floats to 1e-12 relative: no refdml kernel
depends on the schedule, see docs/gpu/threading.md).

Paths (small shapes, meant for a shared 2-core machine; ``--scale`` multiplies ``n``):

* ``kcenter``: ``refdml.gpu.kcenter.greedy_k_center`` (its CPU twin), 20,000 x 64 float64,
  k = 200 (one parallel region per pick);
* ``kcenter_small``: 2,000 x 16, k = 1,000 (``n / 2``; the regions are tiny: launch
  latency);
* ``retrieval``: ``refdml.gpu.metrics.retrieval_metrics`` (its CPU twin), 6,000 x 64, 1,000
  classes, same set;
* ``ot_pairs``: ``refdml.gpu.ot.pairwise_sinkhorn_divergence`` (its CPU twin), 16 clouds of 49
  points in R^32, eps 0.1, tol 1e-6 (the compiled route: pair costs and the small-problem solver).

Then ``--first-calls`` fresh interpreters per layer (interleaved; warm Numba cache):
``import`` of the three modules, and the first call of each path on tiny inputs (which
loads the cached kernels and starts the layer's threads).

    python scripts/bench_threading_layer.py [--repeats 5] [--scale 1.0] [--first-calls 3]
                                            [--json PATH]

``--json PATH`` also writes the tables (schema refdml-bench/1, scripts/_bench.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402

LAYERS = ("omp", "workqueue", "tbb")
_PREFIX = "RESULT "


def _paths(scale: float) -> dict:
    from refdml.gpu.kcenter import greedy_k_center
    from refdml.gpu.metrics import retrieval_metrics
    from refdml.gpu.ot import pairwise_sinkhorn_divergence

    rng = np.random.default_rng(0)
    big = rng.standard_normal((int(20_000 * scale), 64))
    small = rng.standard_normal((int(2_000 * scale), 16))
    n_ret = int(6_000 * scale)
    emb = rng.standard_normal((n_ret, 64)).astype(np.float32)
    labels = rng.integers(0, 1_000, n_ret)
    clouds = rng.standard_normal((16, 49, 32))
    clouds /= np.linalg.norm(clouds, axis=-1, keepdims=True)

    def kcenter(points, k):
        result = greedy_k_center(points, k, rng=0)
        return {"indices": result.indices.tolist(), "radii": result.radii.tolist()}

    def retrieval():
        return {name: float(value) for name, value in retrieval_metrics(emb, labels).items()}

    def ot_pairs():
        return {"sd": pairwise_sinkhorn_divergence(clouds, eps=0.1, tol=1e-6).ravel().tolist()}

    return {
        "kcenter": lambda: kcenter(big, 200),
        "kcenter_small": lambda: kcenter(small, small.shape[0] // 2),
        "retrieval": retrieval,
        "ot_pairs": ot_pairs,
    }


def worker(scale: float) -> int:
    """Warm up, then one timed call of every path per ``run`` line on stdin."""
    import numba

    paths = _paths(scale)
    outputs = {name: fn() for name, fn in paths.items()}
    print(_PREFIX + json.dumps({"layer": numba.threading_layer(), "outputs": outputs}),
          flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        times = {}
        for name, fn in paths.items():
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        print(_PREFIX + json.dumps(times), flush=True)
    return 0


def _read(proc) -> dict | None:
    for line in proc.stdout:
        if line.startswith(_PREFIX):
            return json.loads(line[len(_PREFIX):])
    return None


def _assert_equal(base: dict, other: dict, layer: str) -> None:
    for path, values in base.items():
        for key, value in values.items():
            got = other[path][key]
            if key == "indices":
                assert got == value, (layer, path)
            else:
                np.testing.assert_allclose(got, value, rtol=1e-12, atol=0,
                                           err_msg=f"{layer} {path} {key}")


_FIRST_CALL = """
import time
t0 = time.perf_counter()
import numpy as np
from refdml.gpu.kcenter import greedy_k_center
from refdml.gpu.metrics import retrieval_metrics
from refdml.gpu.ot import pairwise_sinkhorn_divergence
t1 = time.perf_counter()
x = np.random.default_rng(0).standard_normal((50, 4))
greedy_k_center(x, 3, rng=0)
t2 = time.perf_counter()
retrieval_metrics(x, np.arange(50) % 5)
t3 = time.perf_counter()
pairwise_sinkhorn_divergence(x.reshape(5, 10, 4), eps=0.5)
t4 = time.perf_counter()
print(f"{t1 - t0} {t2 - t1} {t3 - t2} {t4 - t3}")
"""


def first_calls(layers, runs: int) -> Table:
    names = ("import", "k-center", "retrieval", "ot_pairs")
    times = {layer: [] for layer in layers}
    for _ in range(runs):
        for layer in layers:
            env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
            out = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, check=True,
                                 capture_output=True, text=True).stdout.split()
            times[layer].append([float(v) for v in out])
    load = f"load {os.getloadavg()[0]:.1f}"
    print(f"\nfirst calls in a fresh interpreter, warm cache (median of {runs}, interleaved; "
          f"{load}): " + " | ".join(names))
    table = Table(
        "First calls in a fresh interpreter per Numba threading layer, warm cache: import of "
        "the three modules, then the first call of each path on tiny inputs (loads the cached "
        f"kernels, starts the layer's threads); median of {runs}, interleaved",
        ["layer", *(f"{name} s" for name in names)], notes=[load])
    for layer in layers:
        medians = [statistics.median(t[i] for t in times[layer]) for i in range(len(names))]
        c = table.add(layer, *(f"{v:.3f}" for v in medians))
        print(f"  {layer:10s} " + " | ".join(f"{v:>6} s" for v in c[1:]))
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--first-calls", type=int, default=3)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.scale)

    procs, outputs, notes = {}, {}, []
    for layer in LAYERS:
        env = dict(os.environ, NUMBA_THREADING_LAYER=layer)
        proc = subprocess.Popen([sys.executable, __file__, "--worker", "--scale",
                                 str(args.scale)], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = _read(proc)
        if ready is None:
            notes.append(f"{layer}: not available here (the worker could not load it)")
            print(notes[-1])
            proc.wait()
            continue
        assert ready["layer"] == layer, ready["layer"]
        procs[layer], outputs[layer] = proc, ready["outputs"]
    if "omp" not in procs:
        print("omp, the baseline, did not load: nothing to compare")
        return 1
    for layer in procs:
        _assert_equal(outputs["omp"], outputs[layer], layer)

    times = {layer: [] for layer in procs}
    for _ in range(args.repeats):
        for layer, proc in procs.items():
            # Let the previous worker's threads go idle (a spinning pool would be load on
            # the cores this worker is about to use).
            time.sleep(0.5)
            proc.stdin.write("run\n")
            proc.stdin.flush()
            times[layer].append(_read(proc))
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()

    setting = (f"{os.cpu_count()} cores, NUMBA_NUM_THREADS="
               f"{os.environ.get('NUMBA_NUM_THREADS', 'unset')}, medians of {args.repeats} "
               f"interleaved calls")
    load = f"load {os.getloadavg()[0]:.1f}"
    print(f"{setting}, {load}; results equal across layers (asserted)")
    table = Table(
        "refdml's compiled parallel paths under each Numba threading layer (one worker process "
        f"per layer; --scale {args.scale:g}): time per call and ratio against omp (GNU "
        f"OpenMP, Numba's default on Linux); {setting}",
        ["path", *(column for layer in procs for column in (f"{layer} ms", f"{layer} / omp"))],
        notes=[load, "results equal across layers (asserted)"])
    paths = list(next(iter(times.values()))[0])
    print("  path            " + "".join(f"{layer:>22s}" for layer in procs))
    for path in paths:
        base = statistics.median(t[path] for t in times["omp"])
        cells = []
        for layer in procs:
            value = statistics.median(t[path] for t in times[layer])
            cells += [f"{value * 1e3:.1f}", f"{value / base:.2f}x"]
        c = table.add(path, *cells)
        print(f"  {path:15s} " + "".join(f"{f'{ms:>9} ms ({ratio:>5})':>22s}"
                                          for ms, ratio in zip(c[1::2], c[2::2])))
    tables = [table]
    if args.first_calls:
        tables.append(first_calls(list(procs), args.first_calls))
    if args.json:
        write_json(args.json, script=__file__, argv=argv, tables=tables, notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
