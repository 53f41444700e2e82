"""Benchmark: batched Sinkhorn divergences vs a loop over POT, and greedy k-center at scale.

Not a test. Prints a table of times and ratios measured side by side in one run.

1. Sinkhorn divergence between all pairs of B point clouds (n points, d dims, uniform
   weights, cost ||x - y||^2): refdml's batched solvers (every problem in one vectorised
   loop) vs a Python loop over ``ot.sinkhorn2(method="sinkhorn_log")`` (the
   B (B - 1) / 2 cross terms and the B self terms), at the same eps and tolerance; all
   compute the transport-cost variant of Eq. (4), the one POT's sinkhorn2 returns. refdml
   twice: the fast path, ``refdml.gpu.ot.pairwise_sinkhorn_divergence`` on NumPy (its
   compiled CPU twin under ``"auto"``), and the reference,
   ``refdml.ot.pairwise_sinkhorn_divergence`` (its readable NumPy form, the only one it
   has since issue 45). Each: the median of 5 calls after one untimed call on tiny clouds;
   POT: one loop. Equal accuracy is reported as the max |difference| of the fast path's
   divergences from POT's.
2. Greedy k-center on N x 128 points: wall time and peak traced memory of the fast path's
   CPU twin (``refdml.gpu.kcenter``) and of the reference's readable traversal
   (``refdml.kcenter``).

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


def _median_time(fn, calls=5):
    """(median seconds of ``calls`` calls, the last result): the first calls of a process are
    up to 2.5x slower (fresh pages, thread start-up)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), result


def bench_divergences(n_clouds, n_points, dim, eps, tol, max_iter, seed=0):
    from refdml.gpu.ot import pairwise_sinkhorn_divergence as fast
    from refdml.ot import pairwise_sinkhorn_divergence as reference

    clouds = _clouds(np.random.default_rng(seed), n_clouds, n_points, dim)
    kw = dict(eps=eps, p=2, value="transport_cost", tol=tol, max_iter=max_iter)
    with warnings.catch_warnings():
        # POT warns on its own non-convergence; the warm-up's three points at the default
        # tol may not converge either (it only loads the kernels)
        warnings.simplefilter("ignore")
        # the CPU twin loads from Numba's cache (or compiles) on the first call: not timed
        fast(clouds[:2, :3], eps=eps, p=2, value="transport_cost")
        t_fast, ours = _median_time(lambda: fast(clouds, **kw))
        t_reference, readable = _median_time(lambda: reference(clouds, **kw))
        start = time.perf_counter()
        theirs = _pot_loop(clouds, eps, tol, max_iter)
        t_pot = time.perf_counter() - start
    np.testing.assert_allclose(readable, ours, rtol=0, atol=1e-6)
    return (t_fast, t_reference, t_pot, float(np.abs(ours - theirs).max()),
            float(np.abs(theirs).max()))


def bench_kcenter(n_points, dim, k, seed=0):
    from refdml.gpu.kcenter import greedy_k_center as fast
    from refdml.kcenter import greedy_k_center as reference

    points = np.random.default_rng(seed).standard_normal((n_points, dim))
    fast(points[:10], 2, rng=seed)                     # cache load / compile: not timed
    out = {}
    for name, greedy_k_center in (("fast path (refdml.gpu.kcenter, CPU twin)", fast),
                                  ("reference (refdml.kcenter, readable)", reference)):
        tracemalloc.start()
        start = time.perf_counter()
        result = greedy_k_center(points, k, rng=seed)
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out[name] = elapsed, peak, points.nbytes, float(result.radii[-1])
    return out


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
        "the fast path (refdml.gpu.ot.pairwise_sinkhorn_divergence, its CPU twin) and the "
        "reference (refdml.ot.pairwise_sinkhorn_divergence, readable), median of 5 calls each, "
        "vs a Python loop over POT's ot.sinkhorn2(method='sinkhorn_log') (one loop); speed-up "
        "= POT loop / refdml; max |diff|: the fast path's divergences vs POT's",
        ["eps", "tol", "fast path [s]", "reference [s]", "POT loop [s]", "speed-up fast path",
         "speed-up reference", "max |diff|", "max |SD|"])
    print(f"{'eps':>6} {'tol':>7} {'fast [s]':>9} {'reference [s]':>14} {'POT loop [s]':>13} "
          f"{'POT/fast':>9} {'POT/ref':>8} {'max |diff|':>11} {'max |SD|':>9}")
    for eps in (0.1, 0.05):
        tol = 1e-6
        t_fast, t_ref, t_pot, diff, scale = bench_divergences(eps=eps, tol=tol, max_iter=10_000,
                                                              **sizes)
        c = divergences.add(f"{eps:g}", f"{tol:.0e}", f"{t_fast:.2f}", f"{t_ref:.2f}",
                            f"{t_pot:.2f}", f"{t_pot / t_fast:.1f}x", f"{t_pot / t_ref:.1f}x",
                            f"{diff:.1e}", f"{scale:.2e}")
        print(f"{c[0]:>6} {c[1]:>7} {c[2]:>9} {c[3]:>14} {c[4]:>13} {c[5]:>9} {c[6]:>8} "
              f"{c[7]:>11} {c[8]:>9}")

    kcenter = Table(
        f"Greedy k-center, {kc['n_points']} x {kc['dim']} float64 points, k = {kc['k']}: wall "
        "time and peak traced memory (tracemalloc) beyond the input, the fast path's CPU twin "
        "and the reference's readable traversal",
        ["path", "time [s]", "peak extra memory [MiB]", "input [MiB]", "radius"])
    print(f"\nGreedy k-center, {kc['n_points']} x {kc['dim']} points, k = {kc['k']}")
    print(f"{'path':<42} {'time [s]':>9} {'peak extra memory [MiB]':>24} {'input [MiB]':>12} "
          f"{'radius':>8}")
    for name, (elapsed, peak, data, radius) in bench_kcenter(**kc).items():
        c = kcenter.add(name, f"{elapsed:.2f}", f"{peak / 2**20:.1f}", f"{data / 2**20:.1f}",
                        f"{radius:.3f}")
        print(f"{c[0]:<42} {c[1]:>9} {c[2]:>24} {c[3]:>12} {c[4]:>8}")
    if args.json:
        import ot

        write_json(args.json, script=__file__, argv=argv, tables=[divergences, kcenter],
                   notes=[f"POT {ot.__version__}; OPENBLAS_NUM_THREADS="
                          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
                          "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])


if __name__ == "__main__":
    main()
