"""Timings of refdml.prototypes, measured side by side in one run.

1. ridge_fit: primal (m x m Cholesky) against kernel (b x b Cholesky) form, for several
   batch sizes b and prototype counts m; the ratio shows where ``form="auto"`` (the
   smaller system) is the right rule.
2. RecursivePrototypes.update: the rank-b Woodbury step (alpha = 1) against the exact
   full-rank step (alpha < 1, a Cholesky of R_{K+1}), and both against refitting the
   batch solution R_K^{-1} Q_K from scratch.

Usage: python scripts/bench_prototypes.py [--repeat N] [--json PATH]
(``--json``: the tables also as JSON, schema refdml-bench/1, scripts/_bench.py.)

BLAS runs single-threaded unless OMP_NUM_THREADS / OPENBLAS_NUM_THREADS are set: on a
shared machine multithreaded timings of these small factorisations are noise.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import sys  # noqa: E402
import timeit  # noqa: E402

import numpy as np  # noqa: E402
from scipy.linalg import cho_factor, cho_solve  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402

from refdml.prototypes import RecursivePrototypes, ridge_fit  # noqa: E402


def _best(fn, repeat: int) -> float:
    number = max(1, int(0.02 / max(1e-7, timeit.timeit(fn, number=1))))
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def bench_ridge(repeat: int) -> Table:
    rng = np.random.default_rng(0)
    table = Table(
        "ridge_fit, d = 128, ridge 0.05: the primal form (m x m Cholesky) vs the kernel form "
        f"(b x b Cholesky), best of {repeat} timeit repeats; ratio primal / kernel",
        ["b", "m", "primal [ms]", "kernel [ms]", "primal/kernel"])
    print("ridge_fit, d = 128                  primal [ms]  kernel [ms]  primal/kernel")
    for b, m in ((32, 512), (64, 256), (128, 128), (256, 64), (512, 32)):
        Z = rng.dirichlet(np.ones(m), size=b)
        Y = rng.standard_normal((b, 128))
        t_primal = _best(lambda: ridge_fit(Z, Y, ridge=0.05, form="primal"), repeat)
        t_kernel = _best(lambda: ridge_fit(Z, Y, ridge=0.05, form="kernel"), repeat)
        c = table.add(b, m, f"{1e3 * t_primal:.3f}", f"{1e3 * t_kernel:.3f}",
                      f"{t_primal / t_kernel:.2f}")
        print(f"  b = {b:4d}, m = {m:4d}{'':14}{c[2]:>9}  {c[3]:>11}  {c[4]:>13}")
    return table


def bench_rls(repeat: int) -> Table:
    rng = np.random.default_rng(1)
    d, b = 64, 16
    table = Table(
        f"RecursivePrototypes.update, b = {b}, d = {d}, ridge 0.5: the rank-b Woodbury step "
        "(alpha = 1) vs the exact full-rank step (alpha = 0.99, a Cholesky of R_{K+1}) and a "
        f"refit R_K^-1 Q_K from scratch, best of {repeat} timeit repeats; ratios against "
        "Woodbury", ["m", "Woodbury [ms]", "Cholesky [ms]", "refit [ms]", "Cholesky/Woodbury",
                     "refit/Woodbury"])
    print(f"RLS update, b = {b}, d = {d}      Woodbury [ms]  Cholesky [ms]  refit [ms]  "
          "Cholesky/Woodbury  refit/Woodbury")
    for m in (64, 256, 512):
        Z = rng.dirichlet(np.ones(m), size=b)
        Y = rng.standard_normal((b, d))
        woodbury = RecursivePrototypes(m, d, alpha=1.0, ridge=0.5)
        exact = RecursivePrototypes(m, d, alpha=0.99, ridge=0.5)
        R = exact.information
        Q = np.zeros((m, d))

        def refit():
            R_new = 0.99 * R + Z.T @ Z + 0.005 * np.eye(m)
            return cho_solve(cho_factor(R_new, lower=True), 0.99 * Q + Z.T @ Y)

        t_w = _best(lambda: woodbury.update(Z, Y), repeat)
        t_c = _best(lambda: exact.update(Z, Y), repeat)
        t_r = _best(refit, repeat)
        c = table.add(m, f"{1e3 * t_w:.3f}", f"{1e3 * t_c:.3f}", f"{1e3 * t_r:.3f}",
                      f"{t_c / t_w:.2f}", f"{t_r / t_w:.2f}")
        print(f"  m = {m:4d}{'':24}{c[1]:>9}  {c[2]:>13}  {c[3]:>10}  {c[4]:>17}  {c[5]:>14}")
    return table


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)
    tables = [bench_ridge(args.repeat)]
    print()
    tables.append(bench_rls(args.repeat))
    if args.json:
        threads = {var: os.environ[var] for var in
                   ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        write_json(args.json, script=__file__, argv=argv, tables=tables,
                   notes=[f"BLAS threads: {threads} (1 unless set: small factorisations)",
                          "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])


if __name__ == "__main__":
    main()
