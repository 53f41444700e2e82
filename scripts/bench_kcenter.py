"""Greedy k-center by the fast path's compiled CPU twin (and the compile times of its kernels).

Since issue 45 the reference ``refdml.kcenter.greedy_k_center`` runs its readable traversal
only; the compiled traversal is the fast path's CPU twin, ``refdml.gpu.kcenter.greedy_k_center``
on NumPy input (``"auto"``: :mod:`refdml.gpu.kcenter._compiled`). Sections (each in one
run, the machine load printed beside every number):

``bound``
    The CPU twin (one fused update + arg-max pass per pick) on 100,000 x 128 float64,
    k = 1,000, against the memory-bandwidth bound: bytes read per pick (``n d`` points +
    ``|x|^2`` + ``m``, 8 bytes each) times ``k`` over the copy bandwidth measured in the
    same run (``np.copyto`` of the points, bandwidth = bytes copied / second; a copy also
    writes them, so the read-only bandwidth can be up to 2x this: the stricter ratio is
    printed too).
``threads``
    k = 100 at the default thread settings: the CPU twin vs the reference's readable
    traversal (exact products and NumPy's fixed-order row sums per pick, no BLAS since
    issue 20, so that duplicate points tie on every CPU) at the default BLAS threads and
    with BLAS held at one thread (threadpoolctl; it does not matter to the readable
    traversal, and the two rows show that), interleaved medians.
``compile``
    First-call times in fresh interpreters: cold (the Numba cache files of the CPU twins,
    ``_compiled.*`` in the ``__pycache__`` of :mod:`refdml.gpu.kcenter` and
    :mod:`refdml.gpu.metrics`, deleted first) and warm (cache present): import + first call
    of the fast path's ``greedy_k_center`` and ``retrieval_metrics`` on tiny inputs.

Run WITHOUT OPENBLAS_NUM_THREADS set (the default a user has).

    python scripts/bench_kcenter.py [--only bound threads compile] [--quick] [--json PATH]

``--json PATH`` also writes the tables (schema refdml-bench/1, scripts/_bench.py).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _bench import Table, interleaved, write_json  # noqa: E402

from refdml import kcenter  # noqa: E402
from refdml.gpu import kcenter as fast  # noqa: E402


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


def bench_bound(n: int, d: int, k: int) -> Table:
    points = np.random.default_rng(0).standard_normal((n, d))
    fast.greedy_k_center(points[:1000], 5, rng=0)               # compile or load the cache
    dst = np.empty_like(points)
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, points)
        copies.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    result = fast.greedy_k_center(points, k, rng=0)
    seconds = time.perf_counter() - t0
    for _ in range(5):                                           # copies after, too
        t0 = time.perf_counter()
        np.copyto(dst, points)
        copies.append(time.perf_counter() - t0)
    bandwidth = points.nbytes / float(np.median(copies))
    per_pick = 8 * n * (d + 2)
    bound = k * per_pick / bandwidth
    table = Table(
        f"Greedy k-center {n} x {d} float64, k={k} (the fast path's CPU twin) against the "
        "memory-bandwidth bound (bytes read per pick x k / copy bandwidth; the stricter bound "
        "assumes reads at 2x the copy rate)",
        ["copy GB/s", "MiB read per pick", "bound s", "stricter bound s", "time s",
         "time / bound", "time / stricter bound", "final radius"],
        notes=[load(), f"copy bandwidth: np.copyto of {points.nbytes / 2**20:.0f} MiB, median "
               "of 10, bytes copied per second"])
    c = table.add(f"{bandwidth / 1e9:.2f}", f"{per_pick / 2**20:.1f}", f"{bound:.2f}",
                  f"{bound / 2:.2f}", f"{seconds:.2f}", f"{seconds / bound:.2f}",
                  f"{2 * seconds / bound:.2f}", f"{result.radii[-1]:.4f}")
    print(f"\ngreedy k-center {n} x {d} float64, k={k} (the fast path's CPU twin), {load()}")
    print(f"  copy bandwidth (np.copyto of {points.nbytes / 2**20:.0f} MiB, median of 10): "
          f"{c[0]} GB/s of bytes copied")
    print(f"  bytes read per pick {c[1]} MiB -> bound {c[2]} s "
          f"(if reads ran at 2x the copy rate: {c[3]} s)")
    print(f"  time {c[4]} s = {c[5]}x the bound ({c[6]}x the stricter one); final radius {c[7]}")
    return table


def bench_threads(n: int, d: int, k: int, repeats: int) -> Table:
    from threadpoolctl import threadpool_info, threadpool_limits

    points = np.random.default_rng(1).standard_normal((n, d))
    blas = [(i["internal_api"], i["num_threads"]) for i in threadpool_info()
            if i["user_api"] == "blas"]

    def readable_one_thread():
        with threadpool_limits(limits=1, user_api="blas"):
            return kcenter.greedy_k_center(points, k, rng=0)

    twin = "CPU twin (refdml.gpu.kcenter.greedy_k_center)"
    runs = {
        twin: lambda: fast.greedy_k_center(points, k, rng=0),
        "reference (readable), default BLAS threads": lambda: kcenter.greedy_k_center(
            points, k, rng=0),
        "reference (readable), BLAS held at 1 thread": readable_one_thread,
    }
    a, b = runs[twin](), readable_one_thread()
    assert np.array_equal(a.indices, b.indices)
    np.testing.assert_allclose(a.radii, b.radii, rtol=1e-13)
    medians = interleaved(runs, repeats)
    threads = (f"default threads (BLAS {blas}, "
               f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')})")
    print(f"\ngreedy k-center {n} x {d}, k={k}, {threads}, "
          f"median of {repeats} interleaved, {load()}")
    table = Table(
        f"Greedy k-center {n} x {d} float64, k={k}: the fast path's CPU twin vs the reference's "
        f"readable traversal, {threads}, median of {repeats} interleaved runs; ratios against "
        "the CPU twin", ["path", "time s", "x the CPU twin"], notes=[load()])
    base = medians[twin]
    for name, seconds in medians.items():
        c = table.add(name, f"{seconds:.3f}", f"{seconds / base:.2f}")
        print(f"  {c[0]:46s} {c[1]:>7s} s  {c[2]:>6s}x the CPU twin")
    print("  " + table.note("picks equal, radii to 1e-13: True (asserted)"))
    return table


_FIRST_CALL = """
import time
t0 = time.perf_counter()
import numpy as np
from refdml.gpu.kcenter import greedy_k_center
from refdml.gpu.metrics import retrieval_metrics
t1 = time.perf_counter()
greedy_k_center(np.random.default_rng(0).standard_normal((50, 4)), 3, rng=0)
t2 = time.perf_counter()
retrieval_metrics(np.random.default_rng(0).standard_normal((50, 4)), np.arange(50) % 5)
retrieval_metrics(np.random.default_rng(0).standard_normal((50, 4)), np.arange(50) % 5,
                  np.random.default_rng(1).standard_normal((40, 4)), np.arange(40) % 5,
                  metric="cosine")
t3 = time.perf_counter()
print(f"{t1 - t0:.2f} {t2 - t1:.2f} {t3 - t2:.2f}")
"""


def bench_compile() -> Table:
    import refdml.gpu.kcenter
    import refdml.gpu.metrics

    caches = [os.path.join(os.path.dirname(package.__file__), "__pycache__")
              for package in (refdml.gpu.kcenter, refdml.gpu.metrics)]
    print(f"\nfirst-call times in a fresh interpreter ({load()}): import | greedy_k_center | "
          "retrieval_metrics (same-set euclidean + separate cosine), the fast path's")
    table = Table(
        "First-call times in a fresh interpreter, cold Numba cache (the k-center and retrieval "
        "CPU twins' cache files deleted) and warm: import, then the first calls of the fast "
        "path's greedy_k_center and retrieval_metrics (same-set euclidean + separate cosine) "
        "on tiny inputs", ["cache", "import s", "k-center s", "retrieval s"], notes=[load()])
    for label in ("cold cache", "warm cache"):
        if label == "cold cache":
            for cache in caches:
                for path in glob.glob(os.path.join(cache, "_compiled.*.nb[ic]")):
                    os.remove(path)
        out = subprocess.run([sys.executable, "-c", _FIRST_CALL], capture_output=True,
                             text=True, check=True).stdout.split()
        table.add(label, *out[:3])
        print(f"  {label:10s}  import {out[0]} s | k-center {out[1]} s | retrieval {out[2]} s")
    return table


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=["bound", "threads", "compile"])
    parser.add_argument("--quick", action="store_true", help="20,000 points, k = 100 / 20")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    first = (f"{os.cpu_count()} cores, machine shared with other jobs; "
             f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    print(first)
    n = 20_000 if args.quick else 100_000
    tables = []
    if "bound" in args.only:
        tables.append(bench_bound(n, 128, 100 if args.quick else 1_000))
    if "threads" in args.only:
        tables.append(bench_threads(n, 128, 20 if args.quick else 100, args.repeats))
    if "compile" in args.only:
        tables.append(bench_compile())
    if args.json:
        write_json(args.json, script=__file__, argv=argv, tables=tables, notes=[first])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
