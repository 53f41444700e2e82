"""Benchmarks of the fast path (:mod:`refdml.gpu`) against the float64 reference (not a test).

    python scripts/bench_gpu.py                  # every section
    python scripts/bench_gpu.py --only gsp       # one section
    python scripts/bench_gpu.py --repeats 15     # more interleaved repeats

One section per family, each an independent function ``bench_<family>(repeats)`` that
prints its own rows. Every timing is the median of ``repeats`` runs, the reference and
the fast path interleaved in one process, so their ratio is comparable on a busy
machine (the absolute times are not).

BLAS threads: OpenBLAS's worker threads spin while they wait, and on a machine whose
cores are busy with other work they make a matrix product many times slower, not
faster. The script therefore pins BLAS to ``REFDML_BENCH_BLAS_THREADS`` threads
(default 1) for both paths unless ``OPENBLAS_NUM_THREADS`` is already set.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ.get("REFDML_BENCH_BLAS_THREADS", "1"))

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


def _interleaved(functions: dict, repeats: int) -> dict:
    """Median seconds of each function, the functions run in turn ``repeats`` times."""
    times = {name: [] for name in functions}
    for fn in functions.values():  # warm-up
        fn()
    for _ in range(repeats):
        for name, fn in functions.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def bench_gsp(repeats: int) -> None:
    """GSP pooling forward + backward, B=256, m=64, n=49, d=128, mu=0.3, inverse_temperature=5."""
    from refdml import gsp
    from refdml.gpu import gsp as fast

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_gsp import _data

    batch, m, n, d, mu, inverse_temperature = 256, 64, 49, 128, 0.3, 5.0
    features, prototypes = _data(np.random.default_rng(0), batch, m, n, d)
    rng = np.random.default_rng(1)
    d_pooled, d_z = rng.standard_normal((batch, d)), rng.standard_normal((batch, m))
    args = dict(mu=mu, inverse_temperature=inverse_temperature)

    def layer(module, dtype):
        f, w = features.astype(dtype), prototypes.astype(dtype)
        up_pooled, up_z = d_pooled.astype(dtype), d_z.astype(dtype)

        def run():
            (pooled, z), ctx = module.gsp_pool_forward(f, w, **args)
            return module.gsp_pool_backward(ctx, up_pooled, up_z), ctx
        return run

    runs = {
        "reference float64": layer(gsp, np.float64),
        "fast float64": layer(fast, np.float64),
        "fast float32": layer(fast, np.float32),
    }
    (ref_grads, ref_ctx), (grads32, ctx32) = runs["reference float64"](), runs["fast float32"]()
    medians = _interleaved(runs, repeats)
    print(f"GSP pooling forward + backward, B={batch} m={m} n={n} d={d} mu={mu} "
          f"inverse_temperature={inverse_temperature} (median of {repeats}, interleaved; "
          f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    reference = medians["reference float64"]
    for name, seconds in medians.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms   {reference / seconds:5.1f}x the reference")
    error = max(
        float(np.max(np.abs(getattr(grads32, k) - getattr(ref_grads, k))))
        / float(np.max(np.abs(getattr(ref_grads, k))))
        for k in ("features", "prototypes")
    )
    result = ctx32.transport
    print(f"  float32: converged={result.converged}, max residual "
          f"{float(np.max(result.residual)):.2e} <= tol {result.tol:.2e} (the float32 floor), "
          f"{result.n_iter} Newton sweeps; gradients vs the reference: max rel err {error:.2e}")


SECTIONS = {"gsp": bench_gsp}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    for name in args.only or SECTIONS:
        SECTIONS[name](args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
