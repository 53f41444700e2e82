"""Benchmark: the Sinkhorn divergence with refdml's own solver vs POT's (``solver="pot"``).

Not a test. One table, measured side by side in one run: ``sinkhorn_divergence_forward``
and ``sinkhorn_divergence_backward`` (upstream 1) between two uniform clouds of ``n``
points each, L2-normalised (points on the unit sphere of R^d, like the local features of
Wasserstein DML), at ``eps`` relative to the largest cost, with the solvers' default
``tol = 1e-9`` and ``max_iter = 1000`` unless given. Each row: the median wall time of each
solver (``repeats`` calls, interleaved, after one untimed call of each: POT's import, 2 s,
is not timed), the iterations of the three problems (cross, self x, self y), whether POT
converged on all three (refdml's own did wherever this says nothing else), the difference
of the divergences relative to the largest cost, and of the gradients relative to their
largest entry.

``--accuracy`` adds a second table, no timing: over problems drawn at random (1 to 6
points in the unit disc per cloud, weights uniform in [0.01, 1], p = 1 and 2 in turn, both
conventions in turn; no two points closer than 0.01 at p = 1) the largest ratio of the
solvers' difference to each tolerance of tests/operators/test_ot_pot_solver.py (value,
gradients w.r.t. the points, w.r.t. the weights; 1 would be at the tolerance), at ordinary
eps (1/4 to 4 times the largest cost, max_iter 20000) and at small eps (0.003 to 0.1,
max_iter 2000), with how often each solver did not converge.

Usage: python scripts/bench_ot_solvers.py [--quick] [--repeats N] [--accuracy [--draws N]]
                                          [--json PATH]
BLAS threads: set OPENBLAS_NUM_THREADS=1 on a shared machine; both solvers run under it.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, interleaved, write_json  # noqa: E402


def _clouds(rng, n, dim):
    x = rng.standard_normal((2, n, dim))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _largest_cost(x, y, p):
    points = np.concatenate([x, y])
    return float(np.max(np.linalg.norm(points[:, None] - points[None], axis=-1))) ** p


def bench_row(n, dim, p, ratio, *, repeats, tol, max_iter, seed=0):
    from refdml.ot import sinkhorn_divergence_backward, sinkhorn_divergence_forward

    x, y = _clouds(np.random.default_rng(seed), n, dim)
    eps = ratio * _largest_cost(x, y, p)
    results = {}

    def call(solver):
        def run():
            sd, ctx = sinkhorn_divergence_forward(x, y, eps=eps, p=p, tol=tol,
                                                  max_iter=max_iter, solver=solver)
            results[solver] = (sd, ctx, sinkhorn_divergence_backward(ctx, 1.0))
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # non-convergence is reported in the table
        times = interleaved({s: call(s) for s in ("refdml", "pot")}, repeats)
    (sd_r, ctx_r, g_r), (sd_p, ctx_p, g_p) = results["refdml"], results["pot"]

    def iterations(ctx):
        return "/".join(str(int(t.n_iter[0])) for t in (ctx.xy, ctx.xx, ctx.yy))

    def converged(ctx):
        return all(bool(t.converged[0]) for t in (ctx.xy, ctx.xx, ctx.yy))

    scale = max(float(np.abs(np.concatenate([g_r.x, g_r.y])).max()), np.finfo(float).tiny)
    grad_diff = max(float(np.abs(g_r.x - g_p.x).max()), float(np.abs(g_r.y - g_p.y).max()))
    return dict(t_refdml=times["refdml"], t_pot=times["pot"], it_refdml=iterations(ctx_r),
                it_pot=iterations(ctx_p), conv_refdml=converged(ctx_r),
                conv_pot=converged(ctx_p), sd_diff=abs(sd_r - sd_p) / _largest_cost(x, y, p),
                grad_diff=grad_diff / scale)


# The tolerances of tests/operators/test_ot_pot_solver.py (its module docstring derives them).
_ROUNDING = 1e-13


def _weighted_residual(ctx) -> float:
    return float(ctx.xy.marginal_error[0]
                 + 0.5 * (ctx.xx.marginal_error[0] + ctx.yy.marginal_error[0]))


def _tolerance_ratios(x, y, a, b, eps, p, runs) -> dict:
    """|difference| / tolerance of the value and of the gradients (upstream 1)."""
    from refdml.ot import sinkhorn_divergence_backward

    (sd_r, ctx_r), (sd_p, ctx_p) = runs["refdml"], runs["pot"]
    points = np.concatenate([x, y])
    distance = float(np.max(np.linalg.norm(points[:, None] - points[None], axis=-1)))
    cost = distance ** p
    residual = _weighted_residual(ctx_r) + _weighted_residual(ctx_p) + _ROUNDING
    smallest = min(float((a / a.sum()).min()), float((b / b.sum()).min()))
    g_r, g_p = sinkhorn_divergence_backward(ctx_r, 1.0), sinkhorn_divergence_backward(ctx_p, 1.0)
    points_tol = p * distance ** (p - 1) * residual * max(1.0, cost / eps) / smallest
    weights_tol = max(eps, cost) * residual / smallest
    return {
        "value": abs(sd_r - sd_p) / (cost * residual),
        "points": max(float(np.abs(g_r.x - g_p.x).max()),
                      float(np.abs(g_r.y - g_p.y).max())) / points_tol,
        "weights": max(float(np.abs(g_r.a - g_p.a).max()) * a.sum(),
                       float(np.abs(g_r.b - g_p.b).max()) * b.sum()) / weights_tol,
    }


def accuracy_rows(draws, low, high, max_iter, seed):
    """Per convention: the largest tolerance ratios over ``draws`` problems with eps in
    ``[low, high]`` times the largest cost, and how many each solver left unconverged."""
    from refdml.ot import sinkhorn_divergence_forward

    rng = np.random.default_rng(seed)
    worst = {value: {"value": 0.0, "points": 0.0, "weights": 0.0, "draws": 0,
                     "unconverged": {"refdml": 0, "pot": 0}}
             for value in ("regularized", "transport_cost")}
    drawn = 0
    while drawn < draws:
        n, m = rng.integers(1, 7, 2)
        x, y = (_unit_disc(rng, k) for k in (n, m))
        p, value = (1.0, 2.0)[drawn % 2], ("regularized", "transport_cost")[(drawn // 2) % 2]
        points = np.concatenate([x, y])
        gaps = np.linalg.norm(points[:, None] - points[None], axis=-1)
        off = gaps[~np.eye(len(points), dtype=bool)]
        if gaps.max() < 0.05 or (p == 1.0 and off.size and off.min() < 0.01):
            continue                         # as the tests' assume()
        a, b = rng.uniform(0.01, 1.0, n), rng.uniform(0.01, 1.0, m)
        eps = float(np.exp(rng.uniform(np.log(low), np.log(high)))) * gaps.max() ** p
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs = {s: sinkhorn_divergence_forward(x, y, a, b, eps=eps, p=p, value=value,
                                                   tol=1e-12, max_iter=max_iter, solver=s)
                    for s in ("refdml", "pot")}
        row = worst[value]
        for key, ratio in _tolerance_ratios(x, y, a, b, eps, p, runs).items():
            row[key] = max(row[key], ratio)
        for solver, (_, ctx) in runs.items():
            row["unconverged"][solver] += not all(bool(t.converged[0])
                                                  for t in (ctx.xy, ctx.xx, ctx.yy))
        row["draws"] += 1
        drawn += 1
    return worst


def _unit_disc(rng, n):
    direction = rng.uniform(-1.0, 1.0, (n, 2))
    direction /= np.linalg.norm(direction, axis=1, keepdims=True)
    return direction * rng.uniform(0.05, 0.95, (n, 1))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per solver")
    parser.add_argument("--tol", type=float, default=1e-9)
    parser.add_argument("--max-iter", type=int, default=1000)
    parser.add_argument("--accuracy", action="store_true",
                        help="also the tolerance ratios of the tests over drawn problems")
    parser.add_argument("--draws", type=int, default=200, help="problems per eps range")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the table to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    sizes = (16,) if args.quick else (16, 64, 256)
    dims = (2,) if args.quick else (2, 16)
    ratios = (1.0, 0.01) if args.quick else (1.0, 0.1, 0.01)
    table = Table(
        "Sinkhorn divergence, forward + backward, two uniform clouds of n points on the unit "
        f"sphere of R^d, eps relative to the largest cost, tol = {args.tol:g}, max_iter = "
        f"{args.max_iter}: refdml's own solver vs POT's sinkhorn_log (solver='pot'), median "
        "of interleaved calls; iterations cross/self x/self y",
        ["n", "d", "p", "eps / max C", "refdml [ms]", "POT [ms]", "POT / refdml",
         "iterations refdml", "iterations POT", "converged refdml", "converged POT",
         "|dSD| / max C", "|d grad| / max |grad|"])
    print(" | ".join(table.columns))
    for n in sizes:
        for dim in dims:
            for p in (1, 2):
                for ratio in ratios:
                    row = bench_row(n, dim, p, ratio, repeats=args.repeats, tol=args.tol,
                                    max_iter=args.max_iter)
                    cells = table.add(
                        n, dim, p, f"{ratio:g}", f"{1e3 * row['t_refdml']:.1f}",
                        f"{1e3 * row['t_pot']:.1f}", f"{row['t_pot'] / row['t_refdml']:.1f}x",
                        row["it_refdml"], row["it_pot"], "yes" if row["conv_refdml"] else "no",
                        "yes" if row["conv_pot"] else "no", f"{row['sd_diff']:.1e}",
                        f"{row['grad_diff']:.1e}")
                    print(" | ".join(str(c) for c in cells), flush=True)
    tables = [table]
    if args.accuracy:
        accuracy = Table(
            f"refdml vs POT over {args.draws} drawn problems per eps range (1-6 points in the "
            "unit disc per cloud, weights uniform in [0.01, 1], p = 1 and 2, tol = 1e-12): the "
            "largest |difference| / tolerance of tests/operators/test_ot_pot_solver.py "
            "(1 = at the tolerance)",
            ["eps / max C", "max_iter", "value", "problems", "refdml unconverged",
             "POT unconverged", "SD", "grad x, y", "grad a, b"])
        print("\n" + " | ".join(accuracy.columns))
        for low, high, max_iter, seed in ((0.25, 4.0, 20000, 1), (0.003, 0.1, 2000, 2)):
            worst = accuracy_rows(args.draws, low, high, max_iter, seed)
            for value, row in worst.items():
                cells = accuracy.add(
                    f"{low:g} .. {high:g}", max_iter, value, row["draws"],
                    row["unconverged"]["refdml"], row["unconverged"]["pot"],
                    f"{row['value']:.2g}", f"{row['points']:.2g}", f"{row['weights']:.2g}")
                print(" | ".join(str(c) for c in cells), flush=True)
        tables.append(accuracy)
    if args.json:
        import ot

        write_json(args.json, script=__file__, argv=argv, tables=tables,
                   notes=[f"POT {ot.__version__}; OPENBLAS_NUM_THREADS="
                          f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}",
                          "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])


if __name__ == "__main__":
    main()
