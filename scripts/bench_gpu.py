"""Benchmark of the fast path :mod:`refdml.gpu` against the float64 reference (not a test).

    python scripts/bench_gpu.py                    # every section
    python scripts/bench_gpu.py --only losses      # one section
    python scripts/bench_gpu.py --quick            # fewer repeats, smoke run

Each section times the reference (float64 NumPy) and the fast path on NumPy float32 (and
float64) on the same data in this one process, repeats interleaved, and prints medians
and the ratio reference / fast path: comparable even on a busy machine (the absolute
times are not). On a loaded machine pin BLAS to one thread
(``OPENBLAS_NUM_THREADS=1``): multi-threaded OpenBLAS on busy cores makes 0.3 ms matrix
products take 5 ms at random. One function per family (``bench_<family>``), so sections merge cleanly.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _interleaved(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, the calls interleaved (one of each per round)."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_losses(repeats: int) -> None:
    """The DML losses, forward + backward, at batch 256 x 128 (issue 10 goal: >= 2x)."""
    from refdml import losses as ref
    from refdml.gpu import losses as fast

    rng = np.random.default_rng(0)
    n, d, n_classes = 256, 128, 64
    x = rng.standard_normal((n, d))
    labels = np.repeat(np.arange(n_classes), n // n_classes)  # 4 per class (m-per-class)
    proxies = rng.standard_normal((n_classes, d))
    centers = rng.standard_normal((2 * n_classes, d))
    center_labels = np.repeat(np.arange(n_classes), 2)
    cases = {
        "contrastive": ("contrastive", {}, {}),
        "contrastive (cosine)": ("contrastive", {"form": "cosine"}, {}),
        "generalized_contrastive": ("generalized_contrastive", {"alpha": 0.3, "beta": 0.6}, {}),
        "triplet (all)": ("triplet", {"mining": "all"}, {}),
        "triplet (batch_hard)": ("triplet", {"mining": "batch_hard"}, {}),
        "multi_similarity": ("multi_similarity", {}, {}),
        "proxy_anchor": ("proxy_anchor", {}, {"proxies": proxies}),
        "proxy_nca": ("proxy_nca", {}, {"proxies": proxies}),
        "soft_triple (2 centres/class)": (
            "soft_triple", {"proxy_labels": center_labels}, {"proxies": centers}),
    }
    print(f"\nlosses: forward + backward, n={n}, d={d}, {n_classes} classes; medians of "
          f"{repeats} interleaved repeats")
    print(f"{'loss':32s} {'ref f64 ms':>10s} {'fast f64':>9s} {'fast f32':>9s} "
          f"{'ratio f64':>9s} {'ratio f32':>9s}")
    for label, (name, hyper, arrays) in cases.items():
        def run(module, dtype, name=name, hyper=hyper, arrays=arrays):
            cast = {k: v.astype(dtype) for k, v in arrays.items()}
            xx = x.astype(dtype)

            def call():
                value, ctx = getattr(module, f"{name}_forward")(xx, labels, **hyper, **cast)
                return getattr(module, f"{name}_backward")(ctx, 1.0)
            return call
        t = _interleaved({
            "ref": run(ref, np.float64),
            "f64": run(fast, np.float64),
            "f32": run(fast, np.float32),
        }, repeats)
        print(f"{label:32s} {1e3 * t['ref']:10.2f} {1e3 * t['f64']:9.2f} {1e3 * t['f32']:9.2f} "
              f"{t['ref'] / t['f64']:8.1f}x {t['ref'] / t['f32']:8.1f}x")


SECTIONS = {"losses": bench_losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (median)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 15)
    for name in args.only or sorted(SECTIONS):
        SECTIONS[name](repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
