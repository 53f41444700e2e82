"""Retrieval metrics at the SOP test split's shape: the fast path's CPU twin vs its bounds.

60,000 x 128 float32 embeddings (unit rows, class centre + noise; synthetic, seeded) in
11,316 classes of 2-12 images (2 each plus a multinomial share of the rest, mean 5.3 like
SOP's test split), same-set mode, Euclidean. In ONE run, interleaved medians
(scripts/_bench.py) of:

- ``refdml.gpu.metrics.retrieval_metrics`` on NumPy input (the fast path's compiled CPU
  twin, :mod:`refdml.gpu.metrics._compiled`: float32 tiles, running top-K, certified
  float64 re-rank; issue 11). Since issue 45 the reference ``refdml.metrics.retrieval_metrics``
  runs its readable ranking only (below), so the twin is timed through the fast path;
- the bare chunked 60k x 60k x 128 matrix product, float32 and float64 (NumPy at the default
  BLAS threads, 4,096 query rows per chunk, nothing else done): the issue's bound;
- faiss-cpu's flat index (``IndexFlatL2``, K+1 nearest, self removed) where faiss is
  installed (not a dependency: ``pip install faiss-cpu``), the named alternative;

then once: the reference's readable ranking (``refdml.metrics._nearest``: the ordered score
without BLAS, ``d`` elementwise passes per score block) on ``--readable-queries`` queries
drawn at random (all of them with ``--quick``; ``--no-readable`` skips it), whose neighbour
lists must EQUAL the CPU twin's on the same queries (asserted; equal neighbours for
every query is what makes the metrics equal).
Peak memory above the input: resident set size sampled every 2 ms from /proc/self/statm in a
thread (sees Numba's allocations, which tracemalloc does not), minus the RSS just before the
call; tracemalloc's peak (NumPy buffers only) beside it. Default thread settings: do not set
OPENBLAS_NUM_THREADS (the script says what it sees). The machine load (``os.getloadavg``)
is printed with every number.

    python scripts/bench_retrieval.py [--quick] [--repeats 2] [--no-readable]
                                      [--readable-queries 2000] [--json PATH]

``--json PATH`` also writes the tables (schema refdml-bench/1, scripts/_bench.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _bench import Table, interleaved, write_json  # noqa: E402

from refdml import metrics  # noqa: E402
from refdml.gpu import metrics as fast  # noqa: E402


def make_data(n: int, n_classes: int, d: int, seed: int):
    rng = np.random.default_rng(seed)
    sizes = 2 + rng.multinomial(n - 2 * n_classes, np.full(n_classes, 1.0 / n_classes))
    labels = rng.permutation(np.repeat(np.arange(n_classes), sizes))
    centres = rng.standard_normal((n_classes, d))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    x = centres[labels] + 0.12 * rng.standard_normal((n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32), labels, sizes


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_memory(fn):
    """(result, RSS peak above the start in MiB, tracemalloc peak in MiB)."""
    base = _rss()
    peak = [base]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    thread.start()
    try:
        result = fn()
    finally:
        done.set()
        thread.join()
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    peak[0] = max(peak[0], _rss())
    return result, (peak[0] - base) / 2**20, traced / 2**20


def load() -> str:
    return "load %.1f %.1f %.1f" % os.getloadavg()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6,000 x 128, 1,131 classes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-readable", action="store_true")
    parser.add_argument("--readable-queries", type=int, default=2_000,
                        help="queries checked against the readable ranking (all: --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    n, n_classes, d = (6_000, 1_131, 128) if args.quick else (60_000, 11_316, 128)
    x, labels, sizes = make_data(n, n_classes, d, args.seed)
    x64 = x.astype(np.float64)
    setting = (f"same-set, {n} x {d} float32 embeddings, {n_classes} classes "
               f"(sizes {sizes.min()}-{sizes.max()}, mean {sizes.mean():.2f})")
    notes = [f"retrieval, {setting}; "
             f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
             f"{os.cpu_count()} cores; machine shared with other jobs; {load()}"]
    print(notes[-1])

    t0 = time.perf_counter()
    fast.retrieval_metrics(x[:500], labels[:500] % 50)        # compile or load the cache
    notes.append(f"first call (compile or cache load): {time.perf_counter() - t0:.2f} s")
    print(notes[-1])

    def bare_matmul(a):
        for start in range(0, a.shape[0], 4096):
            a[start:start + 4096] @ a.T

    twin = "refdml.gpu.metrics.retrieval_metrics (CPU twin)"
    runs = {
        twin: lambda: fast.retrieval_metrics(x, labels),
        "bare matmul float32": lambda: bare_matmul(x),
        "bare matmul float64": lambda: bare_matmul(x64),
    }
    faiss_result = None
    try:
        import faiss

        n_keep = int(sizes.max()) - 1

        def faiss_flat():
            index = faiss.IndexFlatL2(d)
            index.add(x)
            _, found = index.search(x, n_keep + 1)
            return found

        runs["faiss-cpu IndexFlatL2"] = faiss_flat
        level = faiss.SIMDConfig.get_level_name() if hasattr(faiss, "SIMDConfig") else "?"
        notes.append(f"faiss {faiss.__version__}, {faiss.omp_get_max_threads()} OpenMP "
                     f"threads, SIMD level {level} (its dynamic dispatch; AVX512* = the "
                     "AVX-512 build)")
    except ImportError:
        notes.append("faiss-cpu not installed: no faiss row")
    print(notes[-1])

    memory = Table(
        f"Peak memory above the input ({x.nbytes / 2**20:.0f} MiB float32), {setting}: "
        "resident set size sampled every 2 ms, and tracemalloc's peak (NumPy buffers only)",
        ["path", "RSS peak MiB", "tracemalloc peak MiB"])
    result, rss, traced = peak_memory(runs[twin])
    c = memory.add(twin, f"{rss:.0f}", f"{traced:.0f}")
    print(f"peak memory above the input ({x.nbytes / 2**20:.0f} MiB float32): "
          f"RSS sampled {c[1]} MiB, tracemalloc {c[2]} MiB; {memory.note(load())}")
    if "faiss-cpu IndexFlatL2" in runs:
        found, rss_f, traced_f = peak_memory(runs["faiss-cpu IndexFlatL2"])
        own = found == np.arange(n)[:, None]
        same_order = int(np.sum(np.all(found[:, :1] == np.arange(n)[:, None], axis=1)))
        c = memory.add("faiss-cpu IndexFlatL2", f"{rss_f:.0f}", f"{traced_f:.0f}")
        print(f"faiss: RSS sampled {c[1]} MiB above the input; " + memory.note(
              f"faiss: self ranked first for {same_order} of {n} queries "
              f"({int(own.any(axis=1).sum())} found themselves)").split(": ", 1)[1])
    medians = interleaved(runs, args.repeats, warmups=0)
    print(f"\nmedian of {args.repeats} interleaved runs ({load()}):")
    times = Table(
        f"retrieval_metrics (the fast path's CPU twin), {setting}, Euclidean, against its "
        "bound (the bare chunked n x n x d matrix product at the default BLAS threads) and "
        f"faiss-cpu's flat index where installed; median of {args.repeats} interleaved runs; "
        "ratios against the float32 matmul", ["path", "time s", "x the float32 matmul"],
        notes=[load()])
    base = medians["bare matmul float32"]
    for name, seconds in medians.items():
        c = times.add(name, f"{seconds:.2f}", f"{seconds / base:.2f}")
        print(f"  {c[0]:48s} {c[1]:>8} s   {c[2]:>5}x the float32 matmul")

    if not args.no_readable:
        from refdml._numerics import common_scale
        from refdml.gpu.metrics._compiled import nearest_cpu

        rng = np.random.default_rng(args.seed + 1)
        n_check = n if args.quick else min(n, args.readable_queries)
        rows = np.sort(rng.choice(n, size=n_check, replace=False))
        scaled = x64 / common_scale(x64)
        n_keep = max(int(sizes.max()) - 1, 8)
        t0 = time.perf_counter()
        readable = metrics._nearest(scaled, rows, scaled, n_keep, True, "euclidean", 256)
        seconds = time.perf_counter() - t0
        compiled = nearest_cpu(scaled, rows, scaled, n_keep, True, "euclidean")
        print(f"\nthe reference's readable ranking (refdml.metrics._nearest) of {n_check} "
              f"queries, once: {seconds:.1f} s ({load()})")
        np.testing.assert_array_equal(compiled, readable)
        print(f"neighbours of those {n_check} queries by the CPU twin equal to the readable "
              "ranking's: True (asserted)")
        times.note(f"the reference's readable ranking (refdml.metrics._nearest) of {n_check} "
                   f"queries, once: {seconds:.1f} s; their neighbours equal the CPU twin's "
                   "(asserted)")
    values = Table(f"retrieval_metrics of the synthetic embeddings ({setting})",
                   ["metric", "value"])
    for k, v in result.items():
        values.add(k, f"{v:.6g}" if isinstance(v, float) else v)
    print("metrics: " + ", ".join(f"{k} {v}" for k, v in values.rows))
    if args.json:
        write_json(args.json, script=__file__, argv=argv, tables=[times, memory, values],
                   notes=notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
