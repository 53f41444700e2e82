"""Benchmark of the GSP weight-transport solvers and backward passes (not a test).

    python scripts/bench_gsp.py            # B=256, m=64, n=49, d=128, mu=0.3 (issue 2, sec. 5)
    python scripts/bench_gsp.py --quick    # B=32, fewer repeats, for a smoke run
    python scripts/bench_gsp.py --json out.json   # the tables also as JSON (scripts/_bench.py)

Table 1, per inverse_temperature in {0.5, 5, 20}: the marginal residual reached and the time of
``method="exact"`` and of ``method="fixed_point"`` with k = 25, 50, 100 iterations
(``tol=0``: exactly k), for the solver step alone (on a precomputed cost) and for the
whole pooling forward; times are also given as ratios to ``exact``.

Table 2, at inverse_temperature = 5: forward + backward of the whole pooling layer, the forward run
with k fixed-point iterations, and the backward by the closed form (Prop. 4.3) or by
unrolling the k iterations; plus the backward alone.

Every timing is the median of ``--repeats`` runs, all measured in this one process, so
the ratios are comparable even on a busy machine (the absolute times are not).

Data: prototypes are random directions with norms in [0.5, 1.5]; in each image 30% of
the features are noisy copies of random prototypes (foreground) and the rest random
directions (background), so that large inverse_temperature concentrates the transport as with a
trained layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402

from refdml import ConvergenceWarning, gsp  # noqa: E402


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _data(rng: np.random.Generator, batch: int, m: int, n: int, d: int):
    directions = rng.standard_normal((m, d))
    prototypes = directions / np.linalg.norm(directions, axis=1, keepdims=True) * rng.uniform(0.5, 1.5, (m, 1))
    background = rng.standard_normal((batch, n, d))
    features = background / np.linalg.norm(background, axis=2, keepdims=True) * rng.uniform(0.5, 1.5, (batch, n, 1))
    foreground = rng.random((batch, n)) < 0.3
    owners = rng.integers(0, m, size=(batch, n))
    noisy = prototypes[owners] + 0.15 * rng.standard_normal((batch, n, d)) / np.sqrt(d)
    features[foreground] = noisy[foreground]
    return features, prototypes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B=32 and 2 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="runs per timing (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)

    batch = 32 if args.quick else 256
    repeats = args.repeats or (2 if args.quick else 5)
    m, n, d, mu = 64, 49, 128, 0.3
    rng = np.random.default_rng(args.seed)
    features, prototypes = _data(rng, batch, m, n, d)
    cost = gsp.cost_map(features, prototypes)
    warnings.simplefilter("ignore", ConvergenceWarning)  # fixed k is intended here (tol=0 also warns no more)

    sizes = f"B={batch} m={m} n={n} d={d} mu={mu}, median of {repeats} runs"
    print(sizes + "\n")
    print("Table 1: residual and time, exact vs fixed point (solver alone / whole pooling forward)")
    table1 = Table(
        "Weight transport: marginal residual and time of method=exact vs fixed_point with k "
        f"iterations (tol=0), the solver alone and the whole pooling forward; ratios against "
        f"exact ({sizes})",
        ["ε", "method", "residual", "rate r", "solver ms", "solver /exact", "pool fwd ms",
         "pool fwd /exact"])
    header = (
        f"{'ε':>5} {'method':<18}{'residual':>11}{'rate r':>9}{'solver ms':>11}{'/exact':>8}"
        f"{'pool fwd ms':>13}{'/exact':>8}"
    )
    print(header)
    print("-" * len(header))
    goal_met = True
    for inverse_temperature in (0.5, 5.0, 20.0):
        exact_solver, exact = _median_time(lambda: gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature), repeats)
        exact_pool, _ = _median_time(
            lambda: gsp.gsp_pool_forward(features, prototypes, mu=mu, inverse_temperature=inverse_temperature), repeats
        )
        rate = float(np.median(exact.contraction_rate))
        rows = [("exact", exact, exact_solver, exact_pool)]
        for k in (25, 50, 100):
            solver, result = _median_time(
                lambda: gsp.weight_transport(cost, mu=mu, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=k, tol=0.0),
                repeats,
            )
            pool, _ = _median_time(
                lambda: gsp.gsp_pool_forward(
                    features, prototypes, mu=mu, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=k, tol=0.0
                ),
                repeats,
            )
            rows.append((f"fixed_point k={k}", result, solver, pool))
        for name, result, solver, pool in rows:
            c = table1.add(
                f"{inverse_temperature:g}", name, f"{result.residual.max():.1e}", f"{rate:.3f}",
                f"{1e3 * solver:.2f}", f"{solver / exact_solver:.2f}",
                f"{1e3 * pool:.1f}", f"{pool / exact_pool:.2f}")
            print(f"{c[0]:>5} {c[1]:<18}{c[2]:>11}{c[3]:>9}{c[4]:>11}{c[5]:>8}{c[6]:>13}{c[7]:>8}")
        goal_met &= bool(exact.residual.max() <= 1e-12 and exact_solver <= rows[-1][2])
        note = table1.note(f"ε={inverse_temperature:g} (exact: {exact.n_iter} evaluations of g "
                           "at most: pivot search and Newton)")
        print(f"{'':>5} {note.split(' ', 1)[1]}")
    goal = table1.note(
        "goal (exact reaches residual <= 1e-12 at every inverse_temperature in no more time than k=100): "
        + ("met" if goal_met else "NOT met")
    )
    print(goal)

    inverse_temperature = 5.0
    print(f"\nTable 2: pooling layer forward + backward at inverse_temperature={inverse_temperature:g}, closed form vs unrolled")
    table2 = Table(
        f"Pooling layer forward + backward at inverse_temperature={inverse_temperature:g}, the "
        "forward with k fixed-point iterations, the backward by the closed form (Prop. 4.3) "
        f"or by unrolling; ratios unrolled / closed form ({sizes})",
        ["k", "fwd+bwd closed ms", "fwd+bwd unrolled ms", "fwd+bwd ratio", "bwd closed ms",
         "bwd unrolled ms", "bwd ratio"])
    header = (
        f"{'k':>5}{'fwd+bwd closed ms':>19}{'fwd+bwd unrolled ms':>21}{'ratio':>7}"
        f"{'bwd closed ms':>15}{'bwd unrolled ms':>17}{'ratio':>7}"
    )
    print(header)
    print("-" * len(header))
    d_pooled = rng.standard_normal((batch, d))
    d_z = rng.standard_normal((batch, m))
    for k in (10, 25, 50, 100):
        options = dict(mu=mu, inverse_temperature=inverse_temperature, method="fixed_point", max_iter=k, tol=0.0)

        def both(backward, options=options):
            _, ctx = gsp.gsp_pool_forward(features, prototypes, **options, backward=backward)
            return gsp.gsp_pool_backward(ctx, d_pooled, d_z)

        closed_total, _ = _median_time(lambda: both("closed_form"), repeats)
        unrolled_total, _ = _median_time(lambda: both("unrolled"), repeats)
        _, ctx = gsp.gsp_pool_forward(features, prototypes, **options)
        _, unrolled_ctx = gsp.gsp_pool_forward(features, prototypes, **options, backward="unrolled")
        closed, _ = _median_time(lambda: gsp.gsp_pool_backward(ctx, d_pooled, d_z), repeats)
        unrolled, _ = _median_time(
            lambda: gsp.gsp_pool_backward(unrolled_ctx, d_pooled, d_z), repeats
        )
        c = table2.add(
            k, f"{1e3 * closed_total:.1f}", f"{1e3 * unrolled_total:.1f}",
            f"{unrolled_total / closed_total:.2f}",
            f"{1e3 * closed:.1f}", f"{1e3 * unrolled:.1f}", f"{unrolled / closed:.2f}")
        print(f"{c[0]:>5}{c[1]:>19}{c[2]:>21}{c[3]:>7}{c[4]:>15}{c[5]:>17}{c[6]:>7}")
    if args.json:
        write_json(args.json, script=__file__, argv=sys.argv[1:] if argv is None else argv,
                   tables=[table1, table2],
                   notes=["every timing is the median of the runs, all measured in one "
                          "process: the ratios are comparable on a busy machine, the absolute "
                          "times are not",
                          "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
