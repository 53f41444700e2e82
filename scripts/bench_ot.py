"""Benchmark: batched Sinkhorn divergences vs a loop over POT, and greedy k-center at scale.

Not a test. Prints a table of times and ratios measured side by side in one run.

1. Sinkhorn divergence between all pairs of B point clouds (n points, d dims, uniform
   weights, cost ||x - y||^2): refdml.ot.pairwise_sinkhorn_divergence (every problem in one
   vectorised loop) vs a Python loop over ``ot.sinkhorn2(method="sinkhorn_log")`` (the
   B (B - 1) / 2 cross terms and the B self terms), at the same eps and tolerance; both
   compute the transport-cost variant of Eq. (4), the one POT's sinkhorn2 returns. refdml:
   the median of 5 calls after one untimed call on tiny clouds; POT: one loop.
   Equal accuracy is reported as the max |difference| of the divergences.
2. Greedy k-center on N x 128 points: wall time and peak traced memory.

Usage: python scripts/bench_ot.py [--quick] [--json PATH]
(``--json``: the tables also as JSON, schema refdml-bench/1, scripts/_bench.py.)
BLAS threads: set OPENBLAS_NUM_THREADS=1 on a shared machine (contended BLAS threads are
slower than one), the same setting applies to both sides.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import tracemalloc
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402


def _clouds(rng, n_clouds, n_points, dim):
    x = rng.standard_normal((n_clouds, n_points, dim))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)   # L2-normalised local features


def _pot_loop(clouds, eps, tol, max_iter):
    import ot

    n_clouds, n_points, _ = clouds.shape
    w = np.full(n_points, 1.0 / n_points)
    kw = dict(method="sinkhorn_log", stopThr=tol, numItermax=max_iter)
    self_terms = np.array([
        float(ot.sinkhorn2(w, w, ot.dist(c, c), eps, **kw)) for c in clouds
    ])
    out = np.zeros((n_clouds, n_clouds))
    for i in range(n_clouds):
        for j in range(i + 1, n_clouds):
            cross = float(ot.sinkhorn2(w, w, ot.dist(clouds[i], clouds[j]), eps, **kw))
            out[i, j] = out[j, i] = cross - 0.5 * (self_terms[i] + self_terms[j])
    return out


def bench_divergences(n_clouds, n_points, dim, eps, tol, max_iter, seed=0):
    from refdml.ot import pairwise_sinkhorn_divergence

    clouds = _clouds(np.random.default_rng(seed), n_clouds, n_points, dim)
    # the compiled kernels load from Numba's cache (or compile) on the first call: not timed
    pairwise_sinkhorn_divergence(clouds[:2, :3], eps=eps, p=2, value="transport_cost")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # POT warns on its own non-convergence
        times = []
        for _ in range(5):                   # median of 5: the first calls of a process are
            start = time.perf_counter()      # up to 2.5x slower (fresh pages, thread start-up)
            ours = pairwise_sinkhorn_divergence(clouds, eps=eps, p=2, value="transport_cost",
                                                tol=tol, max_iter=max_iter)
            times.append(time.perf_counter() - start)
        t_ours = float(np.median(times))
        start = time.perf_counter()
        theirs = _pot_loop(clouds, eps, tol, max_iter)
        t_pot = time.perf_counter() - start
    return t_ours, t_pot, float(np.abs(ours - theirs).max()), float(np.abs(theirs).max())


def bench_kcenter(n_points, dim, k, seed=0):
    from refdml.kcenter import greedy_k_center

    points = np.random.default_rng(seed).standard_normal((n_points, dim))
    greedy_k_center(points[:10], 2, rng=seed)          # cache load / compile: not timed
    tracemalloc.start()
    start = time.perf_counter()
    result = greedy_k_center(points, k, rng=seed)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed, peak, points.nbytes, float(result.radii[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    if args.quick:
        sizes = dict(n_clouds=12, n_points=16, dim=32)
        kc = dict(n_points=20_000, dim=128, k=100)
    else:
        sizes = dict(n_clouds=64, n_points=49, dim=128)
        kc = dict(n_points=100_000, dim=128, k=1000)

    print(f"Sinkhorn divergence, all pairs of {sizes['n_clouds']} clouds of "
          f"{sizes['n_points']} points in R^{sizes['dim']} (L2-normalised), cost |x-y|^2")
    divergences = Table(
        f"Sinkhorn divergence (transport-cost variant), all pairs of {sizes['n_clouds']} clouds "
        f"of {sizes['n_points']} points in R^{sizes['dim']} (L2-normalised), cost |x-y|^2: "
        "refdml.ot.pairwise_sinkhorn_divergence (median of 5 calls) vs a Python loop over POT's "
        "ot.sinkhorn2(method='sinkhorn_log') (one loop); speed-up = POT loop / refdml",
        ["eps", "tol", "refdml [s]", "POT loop [s]", "speed-up", "max |diff|", "max |SD|"])
    print(f"{'eps':>6} {'tol':>7} {'refdml [s]':>11} {'POT loop [s]':>13} {'speed-up':>9} "
          f"{'max |diff|':>11} {'max |SD|':>9}")
    for eps in (0.1, 0.05):
        tol = 1e-6
        t_ours, t_pot, diff, scale = bench_divergences(eps=eps, tol=tol, max_iter=10_000, **sizes)
        c = divergences.add(f"{eps:g}", f"{tol:.0e}", f"{t_ours:.2f}", f"{t_pot:.2f}",
                            f"{t_pot / t_ours:.1f}x", f"{diff:.1e}", f"{scale:.2e}")
        print(f"{c[0]:>6} {c[1]:>7} {c[2]:>11} {c[3]:>13} {c[4]:>9} {c[5]:>11} {c[6]:>9}")

    elapsed, peak, data, radius = bench_kcenter(**kc)
    kcenter = Table(
        f"Greedy k-center, {kc['n_points']} x {kc['dim']} float64 points, k = {kc['k']}: wall "
        "time and peak traced memory (tracemalloc) beyond the input",
        ["time [s]", "peak extra memory [MiB]", "input [MiB]", "radius"])
    c = kcenter.add(f"{elapsed:.2f}", f"{peak / 2**20:.1f}", f"{data / 2**20:.1f}", f"{radius:.3f}")
    print(f"\nGreedy k-center, {kc['n_points']} x {kc['dim']} points, k = {kc['k']}")
    print(f"{'time [s]':>9} {'peak extra memory [MiB]':>24} {'input [MiB]':>12} {'radius':>8}")
    print(f"{c[0]:>9} {c[1]:>24} {c[2]:>12} {c[3]:>8}")
    if args.json:
        import ot

        write_json(args.json, script=__file__, argv=argv, tables=[divergences, kcenter],
                   notes=[f"POT {ot.__version__}; OPENBLAS_NUM_THREADS="
                          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
                          "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])


if __name__ == "__main__":
    main()
