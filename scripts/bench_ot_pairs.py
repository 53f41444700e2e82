"""Benchmark: all-pairs Sinkhorn divergences, the compiled CPU twin against the NumPy array path.

Not a test. Issue 11's shape: 64 clouds of 49 L2-normalised points in R^128, eps 0.1 and
0.05, tol 1e-6, float64, ``value="transport_cost"`` (what POT returns). Measured side by
side in one run (medians of interleaved repeats, scripts/_bench.py), at the user's default
thread settings (no OPENBLAS_NUM_THREADS):

* ``cpu``: :func:`refdml.gpu.ot.pairwise_sinkhorn_divergence_forward` under
  ``use_kernels("cpu")`` (the small-problem Sinkhorn's CPU twin; also what the fast path
  runs on NumPy input under ``"auto"``);
* ``array``: the same under ``use_kernels("array")`` (the NumPy array path of issue 10:
  kernel scalings as batched mat-vecs);
* ``refdml.ot (readable reference)`` (``--readable``): the reference's public
  ``pairwise_sinkhorn_divergence_forward``, which since issue 45 runs its readable form
  only (its own costs and its batched log-domain solver; until then its default was the
  CPU twin's route);
* POT's batched solver ``ot.batch.solve_batch(method="log_sinkhorn")`` (NumPy backend),
  once (it is slow), on the same cost matrices.

Every route's divergences are asserted equal to the array path's to 1e-6 (POT's with its
own stopping rule at tol 1e-9, so that it is converged as far as ours).

The bound: the solver must evaluate at least one exponential per kernel entry and
stage (``n m`` per cross problem, ``2 n m`` per self problem: the column log-sum-exp and
the kernel rebuild) and two multiply-adds per entry and iteration (``K v`` and ``K^T u``;
one for the symmetric self problems), counted from the iterations the solver reports.
The time of that many ``exp`` and FMAs is measured with bare ``numba`` loops (``prange``
over the same tile shapes, L1-resident) in the same run; the ratio kernel / bound says
how far the kernel is from it.

Usage: python scripts/bench_ot_pairs.py [--quick] [--readable] [--no-pot] [--json PATH]
(``--json``: the tables also as JSON, schema refdml-bench/1, scripts/_bench.py.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings

import numpy as np
from numba import njit, prange

sys.path.insert(0, os.path.dirname(__file__))
from _bench import Table, interleaved, write_json  # noqa: E402


def _clouds(rng, n_clouds, n_points, dim):
    x = rng.standard_normal((n_clouds, n_points, dim))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@njit(parallel=True, cache=True)
def _bare_exp(values, out):
    for p in prange(values.shape[0]):
        s = 0.0
        for k in range(values.shape[1]):
            s += math.exp(values[p, k])
        out[p] = s


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
def _bare_fma(tiles, vec, repeats, out):
    """``repeats`` row products ``K v`` per (n, n) tile: n * n FMAs each."""
    n = tiles.shape[1]
    for p in prange(tiles.shape[0]):
        acc = 0.0
        for _ in range(repeats):
            for i in range(n):
                r = 0.0
                for j in range(n):
                    r += tiles[p, i, j] * vec[p, j]
                acc += r
        out[p] = acc


def _per_op_times(n, repeats=20):
    """Seconds per exp and per FMA of the bare loops (2,080 tiles of n x n)."""
    rng = np.random.default_rng(0)
    tiles = rng.uniform(0, 1, (2080, n, n))
    vec = rng.uniform(0, 1, (2080, n))
    out = np.empty(2080)
    flat = -rng.uniform(0, 30, (2080, n * n))
    _bare_exp(flat, out)
    _bare_fma(tiles, vec, 1, out)
    t = interleaved({"exp": lambda: _bare_exp(flat, out),
                     "fma": lambda: _bare_fma(tiles, vec, repeats, out)}, 5)
    return t["exp"] / flat.size, t["fma"] / (tiles.size * repeats)


def _counts(ctx):
    """Lower bounds on (exponentials, FMAs) of the kernel's solve, from the reported iterations."""
    cross, self_ = ctx.pairs.cross, ctx.pairs.self_
    n, m = cross.plan.shape[1:]
    it_cross, it_self = cross.n_iter.astype(float), self_.n_iter.astype(float)
    exps = cross.plan.shape[0] * n * m + self_.plan.shape[0] * 2 * n * n
    fmas = float(np.sum((2 * it_cross + 1) * n * m) + np.sum((it_self + 1) * n * n))
    return exps, fmas


def _solver_only(ctx, mode, tol, max_iter):
    """The two solves of the route alone (cross batch, symmetric self batch) on its costs."""
    from refdml.gpu.ot import IMPLEMENTATIONS
    from refdml.gpu.ot import _sinkhorn as solver
    from refdml.gpu import use_kernels

    def run():
        with use_kernels(mode):
            for batch, symmetric in ((ctx.cross, False), (ctx.self_, True)):
                solver.solve_batch(np, batch.a, batch.b, batch.cost, eps=batch.eps,
                                   max_iter=max_iter, tol=tol, eps_scaling=None,
                                   symmetric=symmetric, unit=batch.unit, small_kernels=True,
                                   impl=IMPLEMENTATIONS.choose(batch.cost))
    return run


def _pot_batched(clouds, eps, max_iter):
    import ot
    import ot.batch

    n_clouds, n, _ = clouds.shape
    first, second = np.triu_indices(n_clouds, k=1)
    cost_cross = ot.batch.dist_batch(clouds[first], clouds[second])
    cost_self = ot.batch.dist_batch(clouds, clouds)
    kw = dict(reg=eps, method="log_sinkhorn", tol=1e-9, max_iter=max_iter)
    cross = ot.batch.solve_batch(cost_cross, **kw).value_linear
    selves = ot.batch.solve_batch(cost_self, **kw).value_linear
    out = np.zeros((n_clouds, n_clouds))
    out[first, second] = cross - 0.5 * (selves[first] + selves[second])
    return out + out.T


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 clouds, 3 repeats")
    parser.add_argument("--readable", action="store_true",
                        help="also time the reference (its readable form)")
    parser.add_argument("--no-pot", action="store_true", help="skip POT's batched solver")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)

    from refdml.gpu import use_kernels
    from refdml.gpu.ot import pairwise_sinkhorn_divergence_forward as fast
    from refdml.ot import pairwise_sinkhorn_divergence_forward as reference_forward

    n_clouds, n_points, dim, tol, max_iter = (16 if args.quick else 64), 49, 128, 1e-6, 1000
    repeats = 3 if args.quick else 7
    clouds = _clouds(np.random.default_rng(0), n_clouds, n_points, dim)
    notes = [f"machine: {os.cpu_count()} cores, load average {os.getloadavg()} (shared with "
             "other processes); default thread settings"]
    print(notes[-1])
    start = time.perf_counter()
    with use_kernels("cpu"):
        fast(clouds[:2], eps=0.1, tol=tol)
    notes.append(f"first call of the CPU twin in this process (compile or cache load): "
                 f"{time.perf_counter() - start:.2f} s")
    print(notes[-1])
    t_exp, t_fma = _per_op_times(n_points)
    notes.append(f"bare numba loops: {1e9 * t_exp:.2f} ns per exp, {1e9 * t_fma:.3f} ns per "
                 "FMA (2 threads, prange)")
    print(notes[-1])
    tables = []
    solver_table = Table(
        f"Sinkhorn solver alone (cross + self batches on the route's costs), {n_clouds} clouds "
        f"x {n_points} points in R^{dim}, tol {tol:g}, median of {repeats} interleaved: the "
        "CPU twin vs the array path, and the CPU twin against the bound (the exp and FMA "
        "count of the reported iterations x the bare numba loops' time per op)",
        ["eps", "cpu s", "array s", "array / cpu", "exp", "FMA", "bound s",
         "cpu solver / bound"])
    pot_table = Table(
        f"POT's batched solver ot.batch.solve_batch (log_sinkhorn, NumPy backend, tol 1e-9, "
        f"once) vs refdml's CPU twin, {n_clouds} clouds x {n_points} points in R^{dim}",
        ["eps", "POT s", "POT / cpu", "max |diff|"])
    for eps in (0.1, 0.05):
        kw = dict(eps=eps, p=2, value="transport_cost", tol=tol, max_iter=max_iter)
        runs = {}

        def route(mode):
            def run():
                with use_kernels(mode):
                    runs[mode] = fast(clouds, **kw)
            return run

        functions = {"cpu": route("cpu"), "array": route("array")}
        if args.readable:
            readable = "refdml.ot (readable reference)"
            functions[readable] = lambda: runs.__setitem__(
                readable, reference_forward(clouds, **kw))
        with warnings.catch_warnings():
            warnings.simplefilter("error")               # every problem converges
            times = interleaved(functions, repeats)
        reference = runs["array"][0]
        for name, (values, _) in runs.items():
            np.testing.assert_allclose(values, reference, rtol=0, atol=1e-6)
        exps, fmas = _counts(runs["cpu"][1])
        bound = exps * t_exp + fmas * t_fma
        ctx = runs["cpu"][1].pairs
        sizes = (ctx.cross.plan.shape[0], ctx.self_.plan.shape[0])
        solve_times = interleaved({"cpu": _solver_only(ctx, "cpu", tol, max_iter),
                                   "array": _solver_only(ctx, "array", tol, max_iter)}, repeats)
        setting = (f"{n_clouds} clouds x {n_points} points in R^{dim}, eps {eps}, tol {tol:g}, "
                   f"{sizes[0]} cross + {sizes[1]} self problems, mean iterations "
                   f"{ctx.cross.n_iter.mean():.1f} (cross), {ctx.self_.n_iter.mean():.1f} (self)")
        load = f"load {os.getloadavg()[0]:.1f}"
        print(f"\n{setting}; {load}")
        routes = Table(
            f"All-pairs Sinkhorn divergences (value=transport_cost, float64), {setting}: each "
            f"route's time, median of {repeats} interleaved runs; ratios array path / route",
            ["route", "time s", "array / route"], notes=[load])
        tables.append(routes)
        for name, seconds in times.items():
            c = routes.add(name, f"{seconds:.3f}", f"{times['array'] / seconds:.2f}x")
            print(f"  {name:30s} {c[1]:>8} s   array / route = {c[2]:>6}")
        c = solver_table.add(f"{eps:g}", f"{solve_times['cpu']:.3f}", f"{solve_times['array']:.3f}",
                             f"{solve_times['array'] / solve_times['cpu']:.2f}x", f"{exps:.3g}",
                             f"{fmas:.3g}", f"{bound:.3f}", f"{solve_times['cpu'] / bound:.1f}x")
        print(f"  solver alone (cross + self batches): cpu {c[1]} s, array {c[2]} s, "
              f"array / cpu = {c[3]}")
        print(f"  bound: >= {c[4]} exp + {c[5]} FMA = {c[6]} s; cpu solver / bound = {c[7]}")
        if not args.no_pot and eps == 0.1:
            try:
                import ot.batch  # noqa: F401
            except ImportError:
                print("  " + pot_table.note("POT's batched solver: not installed"))
                continue
            start = time.perf_counter()
            pot = _pot_batched(clouds, eps, 10 * max_iter)
            t_pot = time.perf_counter() - start
            np.testing.assert_allclose(pot, reference, rtol=0, atol=1e-6)
            c = pot_table.add(f"{eps:g}", f"{t_pot:.3f}", f"{t_pot / times['cpu']:.1f}x",
                              f"{np.abs(pot - reference).max():.1e}")
            print(f"  POT ot.batch.solve_batch (log_sinkhorn, NumPy, once) {c[1]:>8} s   "
                  f"POT / cpu = {c[2]:>6}   (max |diff| {c[3]})")
    if args.json:
        tables.append(solver_table)
        if pot_table.rows or pot_table.notes:
            tables.append(pot_table)
        notes.append("every route's divergences equal the array path's to 1e-6 (asserted)")
        write_json(args.json, script=__file__, argv=argv, tables=tables, notes=notes)


if __name__ == "__main__":
    main()
