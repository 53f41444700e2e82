"""Benchmarks of the fast path (:mod:`refdml.gpu`) against the float64 reference (not a test).

    python scripts/bench_gpu.py                  # every section
    python scripts/bench_gpu.py --only gsp       # one section (repeatable)
    python scripts/bench_gpu.py --repeats 15     # more interleaved repeats
    python scripts/bench_gpu.py --quick          # 3 repeats, a smoke run

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
import sys  # noqa: E402

import numpy as np  # noqa: E402

from _bench import interleaved  # noqa: E402  (scripts/ is on sys.path when run as a script)


def _load() -> str:
    return "load average %.1f %.1f %.1f (shared machine)" % os.getloadavg()


def bench_gsp(repeats: int) -> None:
    """GSP pooling forward + backward, B=256, m=64, n=49, d=128, mu=0.3, inverse_temperature=5.

    The reference (float64), the array path (``use_kernels("array")``) and the Numba CPU
    twin (``use_kernels("cpu")``, :mod:`refdml.gpu._nb_gsp`) in float64 and float32, all
    interleaved in one run; then the B = 4096 throughput (images / s) of the float32 array
    path and CPU twin.
    """
    from refdml import gsp
    from refdml.gpu import gsp as fast
    from refdml.gpu import use_kernels

    sys.path.insert(0, os.path.dirname(__file__))
    from bench_gsp import _data

    batch, m, n, d, mu, inverse_temperature = 256, 64, 49, 128, 0.3, 5.0
    args = dict(mu=mu, inverse_temperature=inverse_temperature)

    def layer(module, dtype, kernels, features, prototypes, d_pooled, d_z):
        f, w = features.astype(dtype), prototypes.astype(dtype)
        up_pooled, up_z = d_pooled.astype(dtype), d_z.astype(dtype)

        def run():
            with use_kernels(kernels):
                (pooled, z), ctx = module.gsp_pool_forward(f, w, **args)
                return module.gsp_pool_backward(ctx, up_pooled, up_z), ctx
        return run

    def data(size):
        features, prototypes = _data(np.random.default_rng(0), size, m, n, d)
        rng = np.random.default_rng(1)
        return features, prototypes, rng.standard_normal((size, d)), rng.standard_normal((size, m))

    inputs = data(batch)
    runs = {
        "reference float64": layer(gsp, np.float64, "array", *inputs),
        "array float64": layer(fast, np.float64, "array", *inputs),
        "cpu twin float64": layer(fast, np.float64, "cpu", *inputs),
        "array float32": layer(fast, np.float32, "array", *inputs),
        "cpu twin float32": layer(fast, np.float32, "cpu", *inputs),
    }
    outputs = {name: run() for name, run in runs.items()}  # also compiles the twins
    print(f"GSP pooling forward + backward, B={batch} m={m} n={n} d={d} mu={mu} "
          f"inverse_temperature={inverse_temperature} (median of {repeats}, interleaved; "
          f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}, numba threads "
          f"{_numba_threads()}; {_load()})")
    medians = interleaved(runs, repeats)
    reference = medians["reference float64"]
    ref_grads = outputs["reference float64"][0]
    for name, seconds in medians.items():
        dtype = name.split()[-1]
        versus = (f"{medians['array ' + dtype] / seconds:5.2f}x the array path"
                  if "twin" in name else "")
        grads, ctx = outputs[name]
        error = max(
            float(np.max(np.abs(getattr(grads, k) - getattr(ref_grads, k))))
            / float(np.max(np.abs(getattr(ref_grads, k))))
            for k in ("features", "prototypes")
        )
        result = ctx.transport
        print(f"  {name:18s} {seconds * 1e3:8.2f} ms  {reference / seconds:5.1f}x the reference "
              f"{versus:26s} converged={result.converged} max residual "
              f"{float(np.max(result.residual)):.1e} (tol {result.tol:.1e}), n_iter "
              f"{result.n_iter}, gradients rel err {error:.1e}")
    big = 4096
    inputs = data(big)
    runs = {f"{k} float32": layer(fast, np.float32, k, *inputs) for k in ("array", "cpu")}
    medians = interleaved(runs, max(3, repeats // 3))
    print(f"  B={big} float32 throughput (median of {max(3, repeats // 3)}; {_load()}):")
    for name, seconds in medians.items():
        print(f"  {name:18s} {seconds * 1e3:8.1f} ms  {big / seconds:9.0f} images/s")


def _numba_threads() -> str:
    import numba

    return str(numba.get_num_threads())


_COMPILE_PROBE = """
import time
start = time.perf_counter()
import numpy as np
from refdml.gpu import gsp, use_kernels
from refdml.gpu._loss_kernels import masked_logsumexp
imported = time.perf_counter()
rng = np.random.default_rng(0)
for dtype in (np.float64, np.float32):
    f, w = rng.standard_normal((2, 5, 4)).astype(dtype), rng.standard_normal((3, 4)).astype(dtype)
    with use_kernels("cpu"):
        (p, z), ctx = gsp.gsp_pool_forward(f, w, mu=0.3, inverse_temperature=5.0)
        gsp.gsp_pool_backward(ctx, p, z)
        result = gsp.weight_transport(ctx.cost.cost, mu=0.3, inverse_temperature=5.0)
        gsp.weight_transport_backward(result, result.rho, result.pi)
gsp_done = time.perf_counter()
for dtype in (np.float64, np.float32):
    with use_kernels("cpu"):
        masked_logsumexp(np, rng.standard_normal((3, 4)).astype(dtype), rng.random((3, 4)) < 0.5)
        masked_logsumexp(np, rng.standard_normal((3, 4)).astype(dtype), None)
print(f"{imported - start:.2f} {gsp_done - imported:.2f} {time.perf_counter() - gsp_done:.2f}")
"""


def bench_compile(repeats: int) -> None:
    """First-call compile time of the Numba CPU twins (GSP; masked log-sum-exp), cold and warm.

    Each run is a fresh interpreter; ``NUMBA_CACHE_DIR`` points at an empty temporary folder
    for the cold run and at the same folder, now filled, for the warm one (the package's
    own ``__pycache__`` is left alone). Times: import, then the first calls of each dtype.
    """
    import subprocess
    import tempfile

    del repeats
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        print(f"Numba CPU twins: import + first calls (float64 and float32), seconds ({_load()})")
        for label in ("cold cache", "warm cache"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, cwd=root,
                                 capture_output=True, text=True, check=True).stdout.split()
            print(f"  {label}: import {out[0]} s, GSP pool fwd+bwd + transport fwd+bwd {out[1]} s, "
                  f"masked log-sum-exp {out[2]} s")


def bench_lse(repeats: int) -> None:
    """masked_logsumexp (the softmax-type losses' reduction): array path vs the CPU twin."""
    from refdml.gpu import use_kernels
    from refdml.gpu._loss_kernels import masked_logsumexp

    rng = np.random.default_rng(0)
    print(f"masked log-sum-exp with extra_zero, half the entries masked (median of {repeats}, "
          f"interleaved; numba threads {_numba_threads()}; {_load()})")
    for shape in ((256, 256), (1024, 1024)):
        for dtype in (np.float32, np.float64):
            z = (rng.standard_normal(shape) * 5).astype(dtype)
            mask = rng.random(shape) < 0.5

            def run(kernels):
                def go():
                    with use_kernels(kernels):
                        masked_logsumexp(np, z, mask, extra_zero=True)
                return go
            medians = interleaved({"array": run("array"), "cpu": run("cpu")}, repeats)
            print(f"  {shape} {np.dtype(dtype).name}: array path {medians['array'] * 1e3:7.3f} ms, "
                  f"CPU twin {medians['cpu'] * 1e3:7.3f} ms "
                  f"({medians['array'] / medians['cpu']:.2f}x)")


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
        t = interleaved({
            "ref": run(ref, np.float64),
            "f64": run(fast, np.float64),
            "f32": run(fast, np.float32),
        }, repeats)
        print(f"{label:32s} {1e3 * t['ref']:10.2f} {1e3 * t['f64']:9.2f} {1e3 * t['f32']:9.2f} "
              f"{t['ref'] / t['f64']:8.1f}x {t['ref'] / t['f32']:8.1f}x")


def _ot_clouds(rng, n_clouds, n_points, dim, n_classes=16):
    """Unit-norm local features: class centre + noise, normalised (costs in [0, 4])."""
    centres = rng.standard_normal((n_classes, dim))
    labels = np.arange(n_clouds) % n_classes
    points = centres[labels][:, None, :] + 0.8 * rng.standard_normal((n_clouds, n_points, dim))
    return points / np.linalg.norm(points, axis=-1, keepdims=True)


def bench_ot(repeats: int) -> None:
    """All-pairs Sinkhorn divergence (forward) of 64 clouds of 49 points in R^128, tol 1e-6
    (issue 10 goal: >= 2x in float32). float32 runs to the dtype's residual floor where it
    is above tol (refdml.gpu._ot_sinkhorn.residual_floor; printed)."""
    import warnings

    from refdml import ot as ref
    from refdml.gpu import _ot_sinkhorn
    from refdml.gpu import ot as fast

    n_clouds, n_points, dim, tol = 64, 49, 128, 1e-6
    clouds = _ot_clouds(np.random.default_rng(0), n_clouds, n_points, dim)
    print(f"\nOT: pairwise_sinkhorn_divergence_forward, {n_clouds} clouds of {n_points} points "
          f"in R^{dim} (unit norm), p=2, tol={tol:g}; medians of {repeats} interleaved repeats "
          f"(BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    print(f"{'eps':>6s} {'ref f64 ms':>10s} {'fast f64':>9s} {'fast f32':>9s} {'ratio f64':>9s} "
          f"{'ratio f32':>9s} {'f32 tol':>8s} {'max|d| f64':>10s} {'max|d| f32':>10s}")
    for eps in (0.1, 0.05):
        def run(module, dtype, eps=eps):
            data = clouds.astype(dtype)
            return lambda: module.pairwise_sinkhorn_divergence_forward(data, eps=eps, tol=tol)
        runs = {"ref": run(ref, np.float64), "f64": run(fast, np.float64),
                "f32": run(fast, np.float32)}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a benchmark of unconverged solves means nothing
            outs = {name: fn()[0] for name, fn in runs.items()}
            t = interleaved(runs, repeats)
        diff = {k: float(np.max(np.abs(outs[k].astype(np.float64) - outs["ref"])))
                for k in ("f64", "f32")}
        sq = np.sum((clouds[:, :, None] - clouds[:, None]) ** 2, axis=-1)
        tol32 = max(tol, _ot_sinkhorn.residual_floor(np.float32, float(sq.max()) / eps))
        print(f"{eps:6g} {1e3 * t['ref']:10.1f} {1e3 * t['f64']:9.1f} {1e3 * t['f32']:9.1f} "
              f"{t['ref'] / t['f64']:8.2f}x {t['ref'] / t['f32']:8.2f}x {tol32:8.1e} "
              f"{diff['f64']:10.1e} {diff['f32']:10.1e}")
    print(f"(max|SD| = {float(np.max(np.abs(outs['ref']))):.3g}; max|d| = max abs difference "
          "of the divergences vs the reference)")


def bench_kcenter(repeats: int) -> None:
    """Greedy k-center, 20,000 x 128 points, k = 200 (first centre drawn with seed 0)."""
    from refdml import kcenter as ref
    from refdml.gpu import kcenter as fast

    n, d, k = 20_000, 128, 200
    points = np.random.default_rng(0).standard_normal((n, d))
    p32 = points.astype(np.float32)
    runs = {
        "reference float64": lambda: ref.greedy_k_center(points, k, rng=0),
        "fast float64": lambda: fast.greedy_k_center(points, k, rng=0),
        "fast float32": lambda: fast.greedy_k_center(p32, k, rng=0),
    }
    results = {name: fn() for name, fn in runs.items()}
    medians = interleaved(runs, repeats)
    print(f"\ngreedy k-center, n={n} d={d} k={k} (median of {repeats}, interleaved; "
          f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    reference = medians["reference float64"]
    for name, seconds in medians.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms   {reference / seconds:5.1f}x the reference")
    r64, f64, f32 = (results[name] for name in runs)
    on_rounded = ref.greedy_k_center(p32.astype(np.float64), k, rng=0)
    same = int(np.argmax(f32.indices != on_rounded.indices)) if np.any(
        f32.indices != on_rounded.indices) else k
    print(f"  float64: picks equal to the reference: {bool(np.all(f64.indices == r64.indices))}, "
          f"radii max rel err {float(np.max(np.abs(f64.radii - r64.radii) / r64.radii)):.1e}")
    print(f"  float32 vs the reference on the float32-rounded points: first {same} of {k} picks "
          f"equal, radii max rel err over them "
          f"{float(np.max(np.abs(f32.radii[:same] - on_rounded.radii[:same]) / on_rounded.radii[:same])):.1e}")


def bench_metrics(repeats: int) -> None:
    """Retrieval metrics, same-set, 10,000 x 128 embeddings in 1,000 classes (Euclidean)."""
    from refdml import metrics as ref
    from refdml.gpu import metrics as fast

    n, d, n_classes = 10_000, 128, 1_000
    rng = np.random.default_rng(0)
    labels = rng.permutation(np.repeat(np.arange(n_classes), n // n_classes))
    # Class structure so that the metrics are not near zero: centre + noise.
    x = rng.standard_normal((n_classes, d))[labels] + 1.5 * rng.standard_normal((n, d))
    x32 = x.astype(np.float32)
    runs = {
        "reference float64": lambda: ref.retrieval_metrics(x, labels),
        "fast float64": lambda: fast.retrieval_metrics(x, labels),
        "fast float32": lambda: fast.retrieval_metrics(x32, labels),
    }
    results = {name: fn() for name, fn in runs.items()}
    medians = interleaved(runs, repeats)
    print(f"\nretrieval metrics, same-set, n={n} d={d}, {n_classes} classes (median of {repeats}, "
          f"interleaved; BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    reference = medians["reference float64"]
    for name, seconds in medians.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms   {reference / seconds:5.1f}x the reference")
    on_rounded = ref.retrieval_metrics(x32.astype(np.float64), labels)
    r64, f64, f32 = (results[name] for name in runs)
    print(f"  float64 metrics equal to the reference: {f64 == r64}")
    diff = {key: f32[key] - on_rounded[key] for key in on_rounded if f32[key] != on_rounded[key]}
    print(f"  float32 vs the reference on the float32-rounded inputs: "
          f"{'equal' if not diff else ', '.join(f'{k} {v:+.1e}' for k, v in diff.items())} "
          f"(MAP@R {r64['mean_average_precision_at_r']:.4f}, P@1 {r64['precision_at_1']:.4f})")


SECTIONS = {"gsp": bench_gsp, "compile": bench_compile, "lse": bench_lse,
            "losses": bench_losses, "ot": bench_ot,
            "kcenter": bench_kcenter, "metrics": bench_metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SECTIONS), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (median)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats == {args.repeats}, must be at least 1")
    repeats = args.repeats or (3 if args.quick else 9)
    for name in args.only or sorted(SECTIONS):
        SECTIONS[name](repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
