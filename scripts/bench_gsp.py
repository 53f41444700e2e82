"""Benchmark of the GSP weight-transport solvers and backward passes (not a test).

    python scripts/bench_gsp.py            # B=256, m=64, n=49, d=128, mu=0.3 (issue 2, sec. 5)
    python scripts/bench_gsp.py --quick    # B=32, fewer repeats, for a smoke run

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
import statistics
import time
import warnings

import numpy as np

from refdml import ConvergenceWarning, gsp


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
    args = parser.parse_args(argv)

    batch = 32 if args.quick else 256
    repeats = args.repeats or (2 if args.quick else 5)
    m, n, d, mu = 64, 49, 128, 0.3
    rng = np.random.default_rng(args.seed)
    features, prototypes = _data(rng, batch, m, n, d)
    cost = gsp.cost_map(features, prototypes)
    warnings.simplefilter("ignore", ConvergenceWarning)  # fixed k is intended here (tol=0 also warns no more)

    print(f"B={batch} m={m} n={n} d={d} mu={mu}, median of {repeats} runs\n")
    print("Table 1: residual and time, exact vs fixed point (solver alone / whole pooling forward)")
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
            print(
                f"{inverse_temperature:>5g} {name:<18}{result.residual.max():>11.1e}{rate:>9.3f}"
                f"{1e3 * solver:>11.2f}{solver / exact_solver:>8.2f}"
                f"{1e3 * pool:>13.1f}{pool / exact_pool:>8.2f}"
            )
        goal_met &= bool(exact.residual.max() <= 1e-12 and exact_solver <= rows[-1][2])
        print(f"{'':>5} (exact: {exact.n_iter} evaluations of g at most: pivot search and "
              "Newton)")
    print(
        "goal (exact reaches residual <= 1e-12 at every inverse_temperature in no more time than k=100): "
        + ("met" if goal_met else "NOT met")
    )

    inverse_temperature = 5.0
    print(f"\nTable 2: pooling layer forward + backward at inverse_temperature={inverse_temperature:g}, closed form vs unrolled")
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
        print(
            f"{k:>5}{1e3 * closed_total:>19.1f}{1e3 * unrolled_total:>21.1f}"
            f"{unrolled_total / closed_total:>7.2f}"
            f"{1e3 * closed:>15.1f}{1e3 * unrolled:>17.1f}{unrolled / closed:>7.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
