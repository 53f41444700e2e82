"""Benchmarks of the fast path (:mod:`refdml.gpu`): on the CPU against the float64
reference, and on a GPU (CuPy) against the array path, the CPU and POT (not a test).

    python scripts/bench_gpu.py                  # every CPU section
    python scripts/bench_gpu.py --only gsp       # one section (repeatable)
    python scripts/bench_gpu.py --repeats 15     # more interleaved repeats
    python scripts/bench_gpu.py --quick          # 3 repeats, a smoke run
    python scripts/bench_gpu.py --json out.json  # the CPU tables also as JSON
    python scripts/bench_gpu.py --device cuda --json bench_gpu.json   # the GPU sections
    python scripts/bench_gpu.py --device cuda --dry-run               # the same, no GPU

``--device cpu`` (default): one section per family, each an independent function
``bench_<family>(repeats)`` that prints its own rows and returns them as tables
(scripts/_bench.py's ``Table``). Every timing is the median of ``repeats`` runs, the
reference and the fast path interleaved in one process, so their ratio is comparable on a
busy machine (the absolute times are not). ``--json PATH`` writes the tables as a document
of schema ``refdml-bench/1`` (scripts/_bench.py).

``--device cuda`` (issue 21; docs/gpu/gpu-machine.md, "GPU benchmarks"): the sections of
``CUDA_SECTIONS`` on CuPy arrays, each an independent function ``cuda_<name>(run)`` adding
rows (:class:`Row`) to the run. A time is the wall time of one call between two device
synchronisations; the first call of each path (compilation, caches) is timed apart; the
paths of a group run interleaved, ``--repeats`` rounds or fewer once the group has taken
``--max-seconds``; every path's result is checked against a twin before it is timed.
``--json PATH`` writes every row and a header (GPU, driver, CUDA, CuPy, numba-cuda,
date) atomically, after every section: a document of schema ``refdml-bench/1``
(scripts/_bench.py; one table per section) with the keys ``complete``, ``header``,
``rows`` and ``rows_schema`` (``refdml.bench_gpu/1``, the layout of those three, which
scripts/gpu_ledger.py embeds) beside the schema's. ``--dry-run`` runs the same code at tiny sizes on
refdml's CuPy stand-in (tests/cupy_standin) under Numba's CUDA simulator, so CI can keep
the script from rotting; its rows say so and measure nothing. Without ``--dry-run`` and
without CuPy and a GPU, ``--device cuda`` exits with status 2 and the reason. Exit status
1: some row has an error (a failed section, a parity check outside its tolerance).

Roofline: each section with a goal prints, before its rows, a roofline estimate of the goal's
work at the GPU run's sizes (scripts/_roofline.py: the bytes that must move, the flops that
must be done, and the lower bound on time they give at the copy bandwidth and float32 matmul
rate measured on the 2026-11-28 H200 run; the memory term at the H200's and H100 SXM's
spec-sheet bandwidths), also under ``--dry-run``, whose own sizes are smaller. Rows of that
work in float32 carry it as ``roofline`` (the printed line's "roofline >= ..."; a dict in
``--json``). An estimate, never a measurement.

Anchor rows: beside refdml's rows, the ``gsp``, ``retrieval`` and ``train`` sections time
what a user would pick instead, in PyTorch on the same GPU in the same run
(scripts/_torch_anchors.py: a GSP layer written as its authors describe it, retrieval by
``torch.matmul`` + ``torch.topk``, the digits-collage step under autograd), each checked
against refdml before it is timed, with ratios against refdml's rows and back. Where torch
cannot be imported or sees no CUDA device, each such row says why it was skipped; under
``--dry-run`` they run on torch's CPU at the dry run's sizes, where torch is importable.

BLAS threads: OpenBLAS's worker threads spin while they wait, and on a machine whose
cores are busy with other work they make a matrix product many times slower, not
faster. The script therefore pins BLAS to ``REFDML_BENCH_BLAS_THREADS`` threads
(default 1) for both paths unless ``OPENBLAS_NUM_THREADS`` is already set.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ.get("REFDML_BENCH_BLAS_THREADS", "1"))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

# scripts/ is on sys.path when run as a script
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _roofline  # noqa: E402
from _bench import Table, clocked, interleaved, timed_rounds, write_json  # noqa: E402
from _bench import document as bench_document  # noqa: E402


def _load() -> str:
    return "load average %.1f %.1f %.1f (shared machine)" % os.getloadavg()


def bench_gsp(repeats: int) -> list[Table]:
    """GSP pooling forward + backward, B=256, m=64, n=49, d=128, mu=0.3, inverse_temperature=5.

    The reference (float64), the array path (``use_kernels("array")``) and the Numba CPU
    twin (``use_kernels("cpu")``, :mod:`refdml.gpu.gsp._compiled`) in float64 and float32, all
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
    setting = (f"B={batch} m={m} n={n} d={d} mu={mu} "
               f"inverse_temperature={inverse_temperature} (median of {repeats}, interleaved; "
               f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']}, numba threads "
               f"{_numba_threads()}")
    print(f"GSP pooling forward + backward, {setting}; {_load()})")
    table = Table(
        f"GSP pooling forward + backward, {setting}): the float64 reference, the fast path's "
        "array path and its Numba CPU twin; ratios: the reference's time / the path's, and "
        "the array path's / the twin's", ["path", "ms", "x the reference", "x the array path",
                                          "converged", "max residual", "tol", "n_iter",
                                          "gradients rel err"], notes=[_load()])
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
        table.add(name, f"{seconds * 1e3:.2f}", f"{reference / seconds:.1f}",
                  f"{medians['array ' + dtype] / seconds:.2f}" if "twin" in name else "",
                  str(result.converged),
                  f"{float(np.max(result.residual)):.1e}", f"{result.tol:.1e}",
                  str(result.n_iter), f"{error:.1e}")
        print(f"  {name:18s} {seconds * 1e3:8.2f} ms  {reference / seconds:5.1f}x the reference "
              f"{versus:26s} converged={result.converged} max residual "
              f"{float(np.max(result.residual)):.1e} (tol {result.tol:.1e}), n_iter "
              f"{result.n_iter}, gradients rel err {error:.1e}")
    big = 4096
    inputs = data(big)
    runs = {f"{k} float32": layer(fast, np.float32, k, *inputs) for k in ("array", "cpu")}
    medians = interleaved(runs, max(3, repeats // 3))
    print(f"  B={big} float32 throughput (median of {max(3, repeats // 3)}; {_load()}):")
    throughput = Table(
        f"GSP pooling forward + backward throughput, B={big} m={m} n={n} d={d} float32: the "
        f"array path vs the Numba CPU twin (median of {max(3, repeats // 3)}, interleaved)",
        ["path", "ms", "images/s"], notes=[_load()])
    for name, seconds in medians.items():
        c = throughput.add(name, f"{seconds * 1e3:.1f}", f"{big / seconds:.0f}")
        print(f"  {c[0]:18s} {c[1]:>8} ms  {c[2]:>9} images/s")
    return [table, throughput]


def _numba_threads() -> str:
    import numba

    return str(numba.get_num_threads())


_COMPILE_PROBE = """
import time
start = time.perf_counter()
import numpy as np
from refdml.gpu import use_kernels
from refdml.gpu import gsp
from refdml.gpu.losses._kernels import masked_logsumexp
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
        masked_logsumexp(rng.standard_normal((3, 4)).astype(dtype), rng.random((3, 4)) < 0.5)
        masked_logsumexp(rng.standard_normal((3, 4)).astype(dtype), None)
print(f"{imported - start:.2f} {gsp_done - imported:.2f} {time.perf_counter() - gsp_done:.2f}")
"""


def bench_compile(repeats: int) -> list[Table]:
    """First-call compile time of the Numba CPU twins (GSP; masked log-sum-exp), cold and warm.

    Each run is a fresh interpreter; ``NUMBA_CACHE_DIR`` points at an empty temporary folder
    for the cold run and at the same folder, now filled, for the warm one (the package's
    own ``__pycache__`` is left alone). Times: import, then the first calls of each dtype.
    The child runs in an empty temporary folder: ``python -c`` puts its working directory
    first on ``sys.path``, and from the repository root the source ``refdml/`` would shadow
    an installed wheel, which is what is timed (issue 21).
    """
    import subprocess
    import tempfile

    del repeats
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cwd:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        print(f"Numba CPU twins: import + first calls (float64 and float32), seconds ({_load()})")
        table = Table(
            "Numba CPU twins: import + first calls (float64 and float32) in a fresh "
            "interpreter, with an empty NUMBA_CACHE_DIR (cold) and the same one filled (warm)",
            ["cache", "import s", "GSP pool fwd+bwd + transport fwd+bwd s",
             "masked log-sum-exp s"], notes=[_load()])
        for label in ("cold cache", "warm cache"):
            out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], env=env, cwd=cwd,
                                 capture_output=True, text=True, check=True).stdout.split()
            table.add(label, *out[:3])
            print(f"  {label}: import {out[0]} s, GSP pool fwd+bwd + transport fwd+bwd {out[1]} s, "
                  f"masked log-sum-exp {out[2]} s")
    return [table]


def bench_lse(repeats: int) -> list[Table]:
    """masked_logsumexp (the softmax-type losses' reduction): array path vs the CPU twin."""
    from refdml.gpu import use_kernels
    from refdml.gpu.losses._kernels import masked_logsumexp

    rng = np.random.default_rng(0)
    print(f"masked log-sum-exp with extra_zero, half the entries masked (median of {repeats}, "
          f"interleaved; numba threads {_numba_threads()}; {_load()})")
    table = Table(
        "masked_logsumexp (the softmax-type losses' reduction) with extra_zero, half the "
        f"entries masked: the array path vs the Numba CPU twin (median of {repeats}, "
        f"interleaved; numba threads {_numba_threads()}); ratio array / twin",
        ["shape", "dtype", "array path ms", "CPU twin ms", "array / twin"], notes=[_load()])
    for shape in ((256, 256), (1024, 1024)):
        for dtype in (np.float32, np.float64):
            z = (rng.standard_normal(shape) * 5).astype(dtype)
            mask = rng.random(shape) < 0.5

            def run(kernels):
                def go():
                    with use_kernels(kernels):
                        masked_logsumexp(z, mask, extra_zero=True)
                return go
            medians = interleaved({"array": run("array"), "cpu": run("cpu")}, repeats)
            c = table.add(str(shape), np.dtype(dtype).name, f"{medians['array'] * 1e3:.3f}",
                          f"{medians['cpu'] * 1e3:.3f}", f"{medians['array'] / medians['cpu']:.2f}x")
            print(f"  {c[0]} {c[1]}: array path {c[2]:>7} ms, CPU twin {c[3]:>7} ms ({c[4]})")
    return [table]


def bench_losses(repeats: int) -> list[Table]:
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
    table = Table(
        f"DML losses, forward + backward, n={n}, d={d}, {n_classes} classes (4 per class): the "
        f"float64 reference vs the fast path in float64 and float32, medians of {repeats} "
        "interleaved repeats; ratios: the reference's time / the fast path's",
        ["loss", "ref f64 ms", "fast f64 ms", "fast f32 ms", "ratio f64", "ratio f32"],
        notes=[_load()])
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
        c = table.add(label, f"{1e3 * t['ref']:.2f}", f"{1e3 * t['f64']:.2f}",
                      f"{1e3 * t['f32']:.2f}", f"{t['ref'] / t['f64']:.1f}x",
                      f"{t['ref'] / t['f32']:.1f}x")
        print(f"{c[0]:32s} {c[1]:>10} {c[2]:>9} {c[3]:>9} {c[4]:>9} {c[5]:>9}")
    return [table]


def _ot_clouds(rng, n_clouds, n_points, dim, n_classes=16):
    """Unit-norm local features: class centre + noise, normalised (costs in [0, 4])."""
    centres = rng.standard_normal((n_classes, dim))
    labels = np.arange(n_clouds) % n_classes
    points = centres[labels][:, None, :] + 0.8 * rng.standard_normal((n_clouds, n_points, dim))
    return points / np.linalg.norm(points, axis=-1, keepdims=True)


def bench_ot(repeats: int) -> list[Table]:
    """All-pairs Sinkhorn divergence (forward) of 64 clouds of 49 points in R^128, tol 1e-6
    (issue 10 goal: >= 2x in float32). float32 runs to the dtype's residual floor where it
    is above tol (refdml.gpu.ot._sinkhorn.residual_floor; printed)."""
    import warnings

    from refdml import ot as ref
    from refdml.gpu.ot import _sinkhorn as _ot_sinkhorn
    from refdml.gpu import ot as fast

    n_clouds, n_points, dim, tol = 64, 49, 128, 1e-6
    clouds = _ot_clouds(np.random.default_rng(0), n_clouds, n_points, dim)
    print(f"\nOT: pairwise_sinkhorn_divergence_forward, {n_clouds} clouds of {n_points} points "
          f"in R^{dim} (unit norm), p=2, tol={tol:g}; medians of {repeats} interleaved repeats "
          f"(BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    table = Table(
        f"pairwise_sinkhorn_divergence_forward, {n_clouds} clouds of {n_points} points in "
        f"R^{dim} (unit norm), p=2, tol={tol:g}: the float64 reference (its readable form) vs "
        f"the fast path (its CPU twin) in float64 and float32, medians of {repeats} "
        "interleaved repeats (BLAS threads "
        f"{os.environ['OPENBLAS_NUM_THREADS']}); ratios: the reference's time / the fast "
        "path's; max|d|: max abs difference of the divergences vs the reference",
        ["eps", "ref f64 ms", "fast f64 ms", "fast f32 ms", "ratio f64", "ratio f32",
         "f32 tol", "max|d| f64", "max|d| f32"], notes=[_load()])
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
        c = table.add(f"{eps:g}", f"{1e3 * t['ref']:.1f}", f"{1e3 * t['f64']:.1f}",
                      f"{1e3 * t['f32']:.1f}", f"{t['ref'] / t['f64']:.2f}x",
                      f"{t['ref'] / t['f32']:.2f}x", f"{tol32:.1e}", f"{diff['f64']:.1e}",
                      f"{diff['f32']:.1e}")
        print(f"{c[0]:>6} {c[1]:>10} {c[2]:>9} {c[3]:>9} {c[4]:>9} {c[5]:>9} {c[6]:>8} "
              f"{c[7]:>10} {c[8]:>10}")
    table.note(f"max|SD| = {float(np.max(np.abs(outs['ref']))):.3g}")
    print(f"(max|SD| = {float(np.max(np.abs(outs['ref']))):.3g}; max|d| = max abs difference "
          "of the divergences vs the reference)")
    return [table]


def bench_kcenter(repeats: int) -> list[Table]:
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
    setting = (f"n={n} d={d} k={k} (median of {repeats}, interleaved; "
               f"BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    print(f"\ngreedy k-center, {setting}")
    table = Table(f"Greedy k-center, {setting}: the float64 reference (its readable "
                  "traversal) vs the fast path (its CPU twin); ratio: the reference's time "
                  "/ the path's", ["path", "ms", "x the reference"],
                  notes=[_load()])
    reference = medians["reference float64"]
    for name, seconds in medians.items():
        c = table.add(name, f"{seconds * 1e3:.2f}", f"{reference / seconds:.1f}")
        print(f"  {c[0]:20s} {c[1]:>8} ms   {c[2]:>5}x the reference")
    r64, f64, f32 = (results[name] for name in runs)
    on_rounded = ref.greedy_k_center(p32.astype(np.float64), k, rng=0)
    same = int(np.argmax(f32.indices != on_rounded.indices)) if np.any(
        f32.indices != on_rounded.indices) else k
    print("  " + table.note(
          f"float64: picks equal to the reference: {bool(np.all(f64.indices == r64.indices))}, "
          f"radii max rel err {float(np.max(np.abs(f64.radii - r64.radii) / r64.radii)):.1e}"))
    print("  " + table.note(
          f"float32 vs the reference on the float32-rounded points: first {same} of {k} picks "
          f"equal, radii max rel err over them "
          f"{float(np.max(np.abs(f32.radii[:same] - on_rounded.radii[:same]) / on_rounded.radii[:same])):.1e}"))
    return [table]


def bench_metrics(repeats: int) -> list[Table]:
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
    setting = (f"same-set, n={n} d={d}, {n_classes} classes (median of {repeats}, "
               f"interleaved; BLAS threads {os.environ['OPENBLAS_NUM_THREADS']})")
    print(f"\nretrieval metrics, {setting}")
    table = Table(f"Retrieval metrics (Euclidean), {setting}: the float64 reference (its "
                  "readable ranking) vs the fast path (its CPU twin); ratio: the "
                  "reference's time / the path's",
                  ["path", "ms", "x the reference"], notes=[_load()])
    reference = medians["reference float64"]
    for name, seconds in medians.items():
        c = table.add(name, f"{seconds * 1e3:.2f}", f"{reference / seconds:.1f}")
        print(f"  {c[0]:20s} {c[1]:>8} ms   {c[2]:>5}x the reference")
    on_rounded = ref.retrieval_metrics(x32.astype(np.float64), labels)
    r64, f64, f32 = (results[name] for name in runs)
    print("  " + table.note(f"float64 metrics equal to the reference: {f64 == r64}"))
    diff = {key: f32[key] - on_rounded[key] for key in on_rounded if f32[key] != on_rounded[key]}
    print("  " + table.note(
          f"float32 vs the reference on the float32-rounded inputs: "
          f"{'equal' if not diff else ', '.join(f'{k} {v:+.1e}' for k, v in diff.items())} "
          f"(MAP@R {r64['mean_average_precision_at_r']:.4f}, P@1 {r64['precision_at_1']:.4f})"))
    return [table]


def bench_torch_gsp(repeats: int) -> list[Table]:
    """The PyTorch GSP layer on the CPU (float32, forward + backward), the anchor of the
    ``gsp`` section's float32 rows: the same sizes and inputs (B = 256 and the B = 4096
    throughput), at one torch thread and at torch's default, interleaved; its gradients
    are first checked against refdml's float64 reference (untimed).

    An anchor section runs only when named (``--only torch_gsp``) and alone in its process:
    torch in the process that times refdml changes NumPy's heap history (glibc's
    thresholds for handing large blocks back), which doubled the B = 4096 array path's time
    when they were interleaved; the two are run side by side as processes instead (as
    scripts/bench_train.py does, and scripts/bench_compare_commits.py alternates them).
    """
    anchor = _torch_on_cpu()
    if anchor.anchors is None:
        print(f"torch GSP layer: {anchor.note}")
        return [Table("PyTorch GSP layer on the CPU", ["path"], notes=[anchor.note])]
    torch_ = anchor.torch
    default = torch_.get_num_threads()
    m, n, d = 64, 49, 128
    table = Table(
        f"PyTorch GSP layer (scripts/_torch_anchors.py: (P2) by {anchor.anchors.N_ITER} "
        "fixed-point iterations of Prop. 4.2, the closed-form backward of Prop. 4.3 in a "
        "custom torch.autograd.Function) forward + backward on the CPU, float32, m=64 n=49 "
        f"d=128 mu={_GSP_ARGS['mu']} inverse_temperature={_GSP_ARGS['inverse_temperature']}, "
        f"at 1 torch thread and at torch's default ({default}); median of {repeats} "
        f"interleaved at B=256, of {max(3, repeats // 3)} at B=4096; rel err: pooled and "
        "both gradients against refdml's float64 reference, relative to each one's largest "
        "entry", ["path", "B", "torch threads", "ms", "images/s", "rel err"],
        notes=[f"{anchor.note}; {_load()}"])
    print(f"PyTorch GSP layer on the CPU, float32 ({anchor.note}; {_load()})")
    for batch, rounds in ((256, repeats), (4096, max(3, repeats // 3))):
        host = _gsp_inputs(batch, m, n, d)
        layer = _gsp_torch(anchor, host)
        errors = ""
        if batch == 256:           # pooled, d_features, d_prototypes (torch: on the CPU)
            worst = max(float(np.max(np.abs(g.detach().numpy().astype(np.float64) - w)))
                        / float(np.max(np.abs(w)))
                        for g, w in zip(layer(), _gsp_reference(host)(), strict=True))
            errors = f"{worst:.1e}"

        def at(threads):
            def call():
                torch_.set_num_threads(threads)
                try:
                    return layer()
                finally:
                    torch_.set_num_threads(default)
            return call
        runs = {threads: at(threads) for threads in sorted({1, default})}
        medians = interleaved(runs, rounds)
        for threads, seconds in medians.items():
            c = table.add("torch GSP layer float32", batch, threads, f"{seconds * 1e3:.2f}",
                          f"{batch / seconds:.0f}", errors)
            print(f"  B={c[1]:<5} {c[2]} thread(s) {c[3]:>9} ms {c[4]:>7} images/s"
                  + (f"  rel err {errors}" if errors else ""))
    return [table]


SECTIONS = {"gsp": bench_gsp, "compile": bench_compile, "lse": bench_lse,
            "losses": bench_losses, "ot": bench_ot,
            "kcenter": bench_kcenter, "metrics": bench_metrics}
#: Sections that time a PyTorch anchor on the CPU: run only when named, alone (see
#: :func:`bench_torch_gsp`).
ANCHOR_SECTIONS = {"torch_gsp": bench_torch_gsp}



# ======================================================================= --device cuda
# Issue 21, section 3. Every section runs on CuPy arrays (the CuPy stand-in under
# --dry-run), adds its rows to the run as it goes, and never writes a number anywhere but
# the rows (printed, and in --json).

_SCRIPTS = os.path.dirname(os.path.abspath(__file__))
_REPOSITORY = os.path.dirname(_SCRIPTS)
_DRY_NOTE = "dry run: not a measurement"
#: Version of the layout of the ``--json`` document's ``complete``, ``header`` and ``rows``
#: (its ``rows_schema``; the GPU ledger embeds the document). The document itself is of
#: schema ``refdml-bench/1`` (scripts/_bench.py), one table per section.
JSON_SCHEMA = "refdml.bench_gpu/1"
#: What each CUDA section's table measures (its title, before the sizes).
_SECTION_TITLES = {
    "imports": "Imports of the fast path",
    "gsp": "GSP pooling forward + backward on the GPU: the CUDA kernels, the CuPy array path "
           "and the CPU fast path (goal < 0.5 ms in float32 at B=256)",
    "launch_sync": "The GSP layer's CUDA kernels with and without numba-cuda's "
                   "synchronisation of every array argument",
    "train": "One refdml train step of digits-collage on the GPU (goal < 5 ms in float32) "
             "beside the CPU fast path",
    "kcenter": "Greedy k-center on the GPU: the CUDA kernels and the CuPy array path against "
               "the memory-bandwidth bound (a device-to-device copy)",
    "retrieval": "Retrieval metrics on the GPU: the CUDA kernel and the CuPy array path "
                 "against the float32 matrix-product bound",
    "sinkhorn": "All-pairs Sinkhorn divergences on the GPU: refdml's fast path vs POT's "
                "batched solver (goal 20x POT's problems/s)",
}
_ROW_COLUMNS = ["path", "dtype", "device", "size", "median", "repeats", "first call", "rate",
                "ratios", "goal", "parity", "note"]
#: What every time in the CUDA tables is (also in the JSON header).
TIMING = ("wall time of one call between two device synchronisations "
          "(cudaDeviceSynchronize: every stream, CuPy's and torch's), so it includes the host "
          "work, the launches and the synchronisations the call makes itself; the median of "
          "interleaved rounds; the first call (compilation, caches, allocations) is timed apart")
#: Parity of a GSP path against the CPU fast path in float64: the largest error over pooled
#: and both gradients relative to the largest entry, the catalogue's mirror tolerances
#: (OperatorSpec.mirror_tolerance; 1e-10 float64, 1e-4 float32) with float64's widened 10x
#: for FMA contraction on the device (measured on the CPU: 1.5e-14 and 7e-6).
_GSP_PARITY = {"float32": 1e-4, "float64": 1e-9}
_GSP_ARGS = {"mu": 0.3, "inverse_temperature": 5.0}
_GSP_GOAL_S = 0.5e-3
_OT_EPS = 0.05
# Both solvers stop at 1e-5: refdml on the L1 norm of the row-marginal error (its float32
# floor, u (1 + max C / eps), is 4.9e-6 for costs <= 4 at eps 0.05), POT on the L2 norm
# (<= L1, so POT's test is the looser one) every 10 iterations; POT's float32 log-Sinkhorn
# stalls near 1.2e-6 (measured on the dry run's clouds), so 1e-6 would run it to max_iter.
_OT_TOL = 1e-5
_OT_MAX_ITER = 5000
# |SD_refdml - SD_POT| on unit-norm clouds (costs in [0, 4], divergences ~0.01-1): each
# solve's value is off by about tol x the largest cost (4e-5), three solves per divergence
# and two solvers; 1e-3 is well above that and far below what a wrong problem gives.
_OT_PARITY = 1e-3
# Pairs per ot.batch.solve_batch call: POT builds (pairs, n, d) copies of both clouds and
# (pairs, n, n) costs, so all 523,776 pairs at once would need ~30 GB for the copies alone.
_POT_CHUNK = 16384
_OT_GOAL = 20.0
# Largest |difference| of the retrieval metrics between the CUDA kernel and the array path
# (averages over the queries): 1e-3 is 10 queries in 10,000 whose neighbours differ where
# the kernel's FMA contraction reorders references whose distances agree to ~1e-16
# relative (refdml/gpu/metrics/_cuda.py; the family docstring, refdml/gpu/metrics/__init__.py).
_RETRIEVAL_PARITY = 1e-3
_RETRIEVAL_BLOCK = 16384
# k-center: radii of the CUDA kernel and the array path over their common first picks,
# relative (float32; FMA on the device).
_KCENTER_PARITY = 1e-4
_TRAIN_GOAL_S = 5e-3


@dataclasses.dataclass
class Row:
    """One line of the CUDA tables and one entry of the ``--json`` document's ``rows``.

    ``ratios`` maps what a ratio is relative to onto ``time(that) / time(this row)``: above
    1 this row is that many times faster; against a bound (the matrix product, the memory
    bandwidth) it is the fraction of the bound this row reaches. ``rate`` is in
    ``rate_unit`` (per second). ``goal_met`` is None where no goal applies or nothing was
    measured (a dry run, an error). ``error`` set: the row failed (exit status 1).
    """

    section: str
    name: str
    device: str
    dtype: str | None = None
    size: str = ""
    median_s: float | None = None
    repeats: int | None = None
    first_call_s: float | None = None
    rate: float | None = None
    rate_unit: str | None = None
    ratios: dict = dataclasses.field(default_factory=dict)
    goal: str | None = None
    goal_met: bool | None = None
    parity_error: float | None = None
    parity_tolerance: float | None = None
    parity_against: str | None = None
    measurement: bool = True
    note: str = ""
    error: str | None = None
    roofline: dict | None = None       # scripts/_roofline.py's estimate of this row's work


@dataclasses.dataclass
class _Run:
    """What the CUDA sections share: the array module, the clock, the rows so far."""

    xp: Any                       # cupy, or the stand-in under --dry-run
    dry_run: bool
    repeats: int
    max_seconds: float
    sync: Any                     # waits for the device
    json_path: str | None = None
    argv: list | None = None      # the script's arguments, for the document's command
    capture: bool = False         # --capture: the train section times the captured step too
    header: dict = dataclasses.field(default_factory=dict)
    rows: list = dataclasses.field(default_factory=list)

    @property
    def device(self) -> str:
        return "cuda (dry run: simulator + CuPy stand-in)" if self.dry_run else "cuda"

    def sizes(self, full, dry):
        return dry if self.dry_run else full

    def warm(self, functions: dict) -> tuple[dict, dict]:
        """The first call of each function, timed apart: ``(seconds, outputs)`` by name."""
        seconds, outputs = {}, {}
        for name, fn in functions.items():
            seconds[name], outputs[name] = clocked(fn, self.sync)
        return seconds, outputs

    def time(self, functions: dict) -> dict[str, list[float]]:
        return timed_rounds(functions, self.repeats, sync=self.sync, max_s=self.max_seconds)

    def add(self, section: str, name: str, *, times=None, device=None, **fields) -> Row:
        """Record (and print) a row; ``times``: the timed calls, summarised as their median."""
        if times:
            fields.update(median_s=statistics.median(times), repeats=len(times))
        if self.dry_run:
            fields.update(goal_met=None, measurement=False,
                          note="; ".join(filter(None, (_DRY_NOTE, fields.get("note")))))
        if fields.get("error"):
            fields["goal_met"] = None
        row = Row(section, name, device or self.device, **fields)
        self.rows.append(row)
        print(_format_row(row), flush=True)
        return row

    def write_json(self, complete: bool) -> None:
        if self.json_path is None:
            return
        from refdml._io import write_json_atomic

        name = self.header.get("device", {}).get("name")
        device = self.device if self.dry_run or not name else name
        notes = [f"every time: {TIMING}"] + ([_DRY_NOTE] if self.dry_run else [])
        document = bench_document(script=__file__, argv=self.argv, tables=self.tables(),
                                  notes=notes, device=device)
        document.update(complete=complete, header=self.header, rows_schema=JSON_SCHEMA,
                        rows=[dataclasses.asdict(row) for row in self.rows])
        write_json_atomic(self.json_path, _finite(document), indent=1)

    def tables(self) -> list[Table]:
        """One table per section, its rows as :func:`_format_row` prints them, cell by cell."""
        tables: dict[str, Table] = {}
        for row in self.rows:
            if row.section not in tables:
                title = _SECTION_TITLES.get(row.section, row.section)
                tables[row.section] = Table(
                    f"{title}; ratios: the named path's time / this row's (against a bound: the "
                    "fraction of it reached)", _ROW_COLUMNS)
            tables[row.section].add(*_row_cells(row))
        return list(tables.values())


def _finite(value):
    """``value`` with every NaN or infinity replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _row_cells(row: Row) -> list[str]:
    """The cells of ``row`` in :data:`_ROW_COLUMNS`, as :func:`_format_row` prints them."""
    repeats = rate = goal = parity = ""
    if row.median_s is not None:
        repeats = "(computed)" if row.repeats is None else f"x{row.repeats}"
    if row.rate is not None:
        rate = f"{row.rate:,.4g} {row.rate_unit}"
    if row.goal is not None:
        goal = f"{row.goal}: " + {True: "met", False: "NOT met", None: "not judged"}[row.goal_met]
    if row.parity_error is not None:
        parity = (f"{row.parity_error:.2e} (tol {row.parity_tolerance:.0e} vs "
                  f"{row.parity_against})")
    return [
        row.name, row.dtype or "", row.device, row.size, _ms(row.median_s), repeats,
        _ms(row.first_call_s), rate,
        "; ".join(f"{value:.3g}x {other}" for other, value in row.ratios.items()), goal, parity,
        "; ".join(text for text in (row.note, row.error and f"ERROR {row.error}") if text),
    ]


def _format_row(row: Row) -> str:
    parts = [f"{row.section:11s} {row.name:46s} {row.dtype or '':7s}"]
    if row.median_s is not None:
        parts.append(f"{_ms(row.median_s):>11s} " + ("(computed)" if row.repeats is None
                                                      else f"x{row.repeats}"))
    if row.first_call_s is not None:
        parts.append(f"first call {_ms(row.first_call_s)}")
    if row.rate is not None:
        parts.append(f"{row.rate:,.4g} {row.rate_unit}")
    parts += [f"{value:.3g}x {other}" for other, value in row.ratios.items()]
    if row.goal is not None:
        met = {True: "met", False: "NOT met", None: "not judged"}[row.goal_met]
        parts.append(f"goal {row.goal}: {met}")
    if row.parity_error is not None:
        parts.append(f"parity {row.parity_error:.2e} (tol {row.parity_tolerance:.0e} vs "
                     f"{row.parity_against})")
    if row.roofline is not None:
        parts.append(f"roofline >= {_ms(row.roofline['lower_bound_s'])} (estimate at "
                     f"{row.roofline['size']}, {row.roofline['device']})")
    parts += [text for text in (row.note, row.error and f"ERROR {row.error}") if text]
    return " | ".join(parts)


#: The device whose figures the rows' roofline estimates use.
ROOFLINE_DEVICE = _roofline.H200_MEASURED


def _roofline_works(run: _Run, section: str) -> list:
    """Print the roofline estimates of ``section``'s goals (scripts/_roofline.py) at the GPU
    run's sizes, and return their works, whose ``as_dict`` the section's rows carry."""
    works = _roofline.section_works(section)
    for work in works:
        print(f"{section:11s} {work.describe(ROOFLINE_DEVICE)}"
              + (" (the dry run's sizes are smaller)" if run.dry_run else ""), flush=True)
        for device in _roofline.DEVICES:
            if device is not ROOFLINE_DEVICE:
                print(f"{'':11s}   {_ms(work.bound(device).seconds)} for the bytes alone at "
                      f"{device.name} ({device.source})", flush=True)
    return works


def _ratios(medians: dict, name: str, others) -> dict:
    return {other: medians[other] / medians[name] for other in others
            if other in medians and other != name and medians[name] > 0}


def _host(value) -> np.ndarray:
    from refdml._backend import to_numpy

    if hasattr(value, "detach"):                # a torch tensor (POT's rows)
        return value.detach().cpu().numpy()
    return to_numpy(value)


def _relative_error(got, want) -> float:
    """Largest over the paired arrays of ``max |got - want| / max |want|`` (on the host)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        g, w = _host(g).astype(np.float64), _host(w).astype(np.float64)
        scale = float(np.max(np.abs(w))) or 1.0
        worst = max(worst, float(np.max(np.abs(g - w))) / scale)
    return worst


def _gated(run: _Run, section: str, size: str, functions: dict, *, against: str,
           tolerance, error=_relative_error) -> tuple[dict, dict, dict, dict]:
    """Warm every function up (its first call, timed apart), then check its output against
    ``functions[against]``'s before anything is timed: a function outside
    ``tolerance(name)`` becomes an error row and is not timed.
    ``(timed functions, first-call seconds, outputs, {name: parity error})``."""
    first, outputs = run.warm(functions)
    keep, parity = {}, {}
    for name, fn in functions.items():
        if name != against:
            parity[name] = error(outputs[name], outputs[against])
            if not parity[name] <= tolerance(name):         # NaN fails too
                run.add(section, name, size=size, first_call_s=first[name],
                        parity_error=parity[name], parity_tolerance=tolerance(name),
                        parity_against=against, error="parity outside its tolerance; not timed")
                continue
        keep[name] = fn
    return keep, first, outputs, parity


@contextlib.contextmanager
def _environment(name: str, value: str | None):
    """``os.environ[name] = value`` (None: unset) inside the block, then as it was."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


# --------------------------------------------------------------------------- PyTorch anchors
@dataclasses.dataclass(frozen=True)
class _Torch:
    """Where the PyTorch anchor rows run: ``anchors`` (scripts/_torch_anchors.py), the
    ``torch`` module and its ``device``; or, all three None, ``note`` says why they are
    skipped. ``row_device``: the rows' device column (None: the run's)."""

    anchors: Any
    torch: Any
    device: Any
    row_device: str | None
    note: str


def _torch_setup(run: _Run) -> _Torch:
    """The PyTorch anchors on the run's GPU (torch on the CPU under --dry-run), or why not.

    On a GPU the tensors share CuPy's device (CuPy's current one), so the run's clock, a
    device-wide synchronisation, waits for torch's streams too. Float32 runs as full IEEE
    float32 there (``_torch_anchors.use_full_float32``: no TF32 in cuDNN), as refdml's does.
    """
    try:
        import torch
    except ImportError as exc:
        return _Torch(None, None, None, None, f"skipped: torch cannot be imported ({exc})")

    if run.dry_run:
        device, row_device = torch.device("cpu"), "cpu"
    elif not torch.cuda.is_available():
        return _Torch(None, None, None, None, "skipped: torch sees no CUDA device")
    else:
        device, row_device = torch.device("cuda", run.xp.cuda.Device().id), None
    import _torch_anchors as anchors

    anchors.use_full_float32()
    return _Torch(anchors, torch, device, row_device,
                  f"torch {torch.__version__} on {device}, float32 without TF32")


def _torch_on_cpu() -> _Torch:
    """The PyTorch anchors on the CPU for the ``--device cpu`` sections (float32 at torch's
    default threads), or why they are skipped."""
    try:
        import torch
    except ImportError as exc:
        return _Torch(None, None, None, None, f"skipped: torch cannot be imported ({exc})")
    import _torch_anchors as anchors

    return _Torch(anchors, torch, torch.device("cpu"), "cpu",
                  f"torch {torch.__version__} on the CPU, {torch.get_num_threads()} threads")


def _to_torch(torch_, value, device):
    """``value`` (CuPy, the stand-in's or NumPy) as a tensor on ``device``: shared through
    DLPack on the GPU, a host copy otherwise."""
    if device.type == "cuda":
        return torch_.from_dlpack(value)
    return torch_.from_numpy(np.ascontiguousarray(_host(value)))


def _anchor_failed(run: _Run, section: str, name: str, anchor: _Torch, exc: Exception,
                   **fields) -> None:
    """An anchor that raised (out of memory, a torch error): its own error row, so that
    refdml's rows of the section still run."""
    import traceback

    traceback.print_exc()
    run.add(section, name, dtype="float32", device=anchor.row_device,
            error=f"{type(exc).__name__}: {exc}", note=anchor.note, **fields)


def _merge_anchor(keep: dict, first: dict, parity: dict, against_of: dict, gated, against):
    """Add the anchor paths of a second :func:`_gated` call (against ``against``, a path
    that is checked but not timed) to the first call's dicts."""
    keep_2, first_2, _, parity_2 = gated
    for name in keep_2:
        if name != against:
            keep[name], first[name] = keep_2[name], first_2[name]
    for name, error in parity_2.items():
        parity[name], against_of[name] = error, against


# --------------------------------------------------------------------------- GSP
def _gsp_inputs(batch: int, m: int, n: int, d: int):
    from bench_gsp import _data

    features, prototypes = _data(np.random.default_rng(0), batch, m, n, d)
    rng = np.random.default_rng(1)
    return features, prototypes, rng.standard_normal((batch, d)), rng.standard_normal((batch, m))


def _gsp_layer(xp, host, dtype: str, kernels: str):
    """One forward + backward of the GSP pooling layer on ``xp`` arrays of ``dtype`` under
    ``use_kernels(kernels)``; the call returns (pooled, d_features, d_prototypes) where they
    were computed (no copy in the timed call)."""
    from refdml.gpu import gsp as fast
    from refdml.gpu import use_kernels

    features, prototypes, d_pooled, d_z = (xp.asarray(a.astype(dtype)) for a in host)

    def call():
        with use_kernels(kernels):
            (pooled, _), ctx = fast.gsp_pool_forward(features, prototypes, **_GSP_ARGS)
            grads = fast.gsp_pool_backward(ctx, d_pooled, d_z)
        return pooled, grads.features, grads.prototypes
    return call


def _gsp_reference(host):
    """refdml's float64 reference GSP layer (exact (P2), Prop. 4.3) on the host arrays:
    the call returns (pooled, d_features, d_prototypes)."""
    from refdml import gsp

    features, prototypes, d_pooled, d_z = host

    def call():
        (pooled, _), ctx = gsp.gsp_pool_forward(features, prototypes, **_GSP_ARGS)
        grads = gsp.gsp_pool_backward(ctx, d_pooled, d_z)
        return pooled, grads.features, grads.prototypes
    return call


def _gsp_torch(anchor: _Torch, host):
    """The PyTorch GSP layer written as its authors describe it (scripts/_torch_anchors.py:
    (P2) by 100 fixed-point iterations of Prop. 4.2, the closed-form backward of Prop. 4.3
    as a custom autograd function) in float32 on the anchor's device, forward + backward
    (``torch.autograd.grad``); the call returns (pooled, d_features, d_prototypes)."""
    torch_ = anchor.torch
    features, prototypes, d_pooled, d_z = (
        torch_.as_tensor(a.astype(np.float32), device=anchor.device) for a in host)
    features.requires_grad_(True)
    prototypes.requires_grad_(True)

    def call():
        pooled, z = anchor.anchors.gsp_pool(features, prototypes, **_GSP_ARGS)
        d_features, d_prototypes = torch_.autograd.grad((pooled, z), (features, prototypes),
                                                        (d_pooled, d_z))
        return pooled.detach(), d_features, d_prototypes
    return call


def cuda_gsp(run: _Run) -> None:
    """GSP pooling forward + backward (issue 21: < 0.5 ms in float32 at B = 256).

    At B = 256 in both dtypes: the CUDA kernels (``use_kernels("cuda")``), the CuPy array
    path (``use_kernels("array")``) and the CPU fast path on NumPy (``"auto"``), all
    interleaved; then images per second at B = 4096 in float32, the same three paths.
    Beside them in float32, where torch sees the GPU: the anchor a user would
    pick instead, a PyTorch GSP layer written as its authors describe it (:func:`_gsp_torch`),
    timed interleaved with refdml's paths and checked against refdml's float64 reference
    (:func:`_gsp_reference`, untimed).
    """
    section = "gsp"
    batch, big, m, n, d = run.sizes((256, 4096, 64, 49, 128), (3, 5, 4, 5, 8))
    paths = {"cuda kernel": (run.xp, "cuda"), "cupy array path": (run.xp, "array"),
             "cpu fast path": (np, "auto")}
    anchor = _torch_setup(run)
    reference = "refdml float64 reference (cpu)"
    works = _roofline_works(run, section)          # B = 256, then B = 4096
    for work, (size_b, dtypes) in zip(works, ((batch, ("float32", "float64")),
                                              (big, ("float32",))), strict=True):
        size = (f"B={size_b} m={m} n={n} d={d} mu={_GSP_ARGS['mu']} "
                f"inverse_temperature={_GSP_ARGS['inverse_temperature']}")
        host = _gsp_inputs(size_b, m, n, d)
        label = {(path, dtype): f"{path} {dtype}" + (f" B={size_b}" if size_b != batch else "")
                 for dtype in dtypes for path in paths}
        dtype_of = {name: dtype for (_, dtype), name in label.items()}
        functions = {name: _gsp_layer(paths[path][0], host, dtype, paths[path][1])
                     for (path, dtype), name in label.items()}
        against = label["cpu fast path", dtypes[-1]]
        keep, first, _, parity = _gated(run, section, size, functions, against=against,
                                        tolerance=lambda name: _GSP_PARITY[dtype_of[name]])
        against_of = dict.fromkeys(parity, against)
        torch_name = "torch GSP layer float32" + (f" B={size_b}" if size_b != batch else "")
        dtype_of[torch_name] = "float32"
        torch_note = anchor.note + ("; (P2) by 100 fixed-point iterations (Prop. 4.2), "
                                    "closed-form backward (Prop. 4.3) in a custom "
                                    "torch.autograd.Function; parity vs refdml's float64 "
                                    "reference (exact (P2))")
        if anchor.anchors is None:
            run.add(section, torch_name, dtype="float32", size=size, note=anchor.note)
        else:
            try:
                gated = _gated(run, section, size, {reference: _gsp_reference(host),
                                                    torch_name: _gsp_torch(anchor, host)},
                               against=reference, tolerance=lambda name: _GSP_PARITY["float32"])
            except Exception as exc:
                _anchor_failed(run, section, torch_name, anchor, exc, size=size)
            else:
                _merge_anchor(keep, first, parity, against_of, gated, reference)
        times = run.time(keep)
        medians = {name: statistics.median(t) for name, t in times.items()}
        for name in keep:
            dtype = dtype_of[name]
            goal = {}
            if name == "cuda kernel float32":
                goal = dict(goal=f"< {_GSP_GOAL_S * 1e3:g} ms per call",
                            goal_met=medians[name] < _GSP_GOAL_S)
            device = "cpu" if name.startswith("cpu") else None
            if name == torch_name:
                device = anchor.row_device
            run.add(section, name, dtype=dtype, size=size, times=times[name], device=device,
                    first_call_s=first[name], rate=size_b / medians[name], rate_unit="images/s",
                    ratios=_ratios(medians, name,
                                   [label[p, dtype] for p in paths]
                                   + ([torch_name] if dtype == "float32" else [])),
                    parity_error=parity.get(name),
                    parity_tolerance=_GSP_PARITY[dtype] if name in parity else None,
                    parity_against=against_of.get(name),
                    note=torch_note if name == torch_name else "",
                    roofline=work.as_dict(ROOFLINE_DEVICE) if dtype == "float32" else None,
                    **goal)


def cuda_launch_sync(run: _Run) -> None:
    """The GSP layer's CUDA kernels (B = 256, float32) with and without numba-cuda's
    synchronisation of every array argument (``REFDML_CUDA_LAUNCH_SYNC=1`` / unset).

    :func:`refdml.gpu._support.launch.cuda_launch` reads the switch at every launch, so the
    two variants alternate in one process (checked first: a switch read once would make
    both variants the same).
    """
    from refdml.gpu._support import launch as _launch

    section, variable = "launch_sync", "REFDML_CUDA_LAUNCH_SYNC"
    batch, m, n, d = run.sizes((256, 64, 49, 128), (3, 4, 5, 8))
    size = f"B={batch} m={m} n={n} d={d} (GSP pooling forward + backward, CUDA kernels)"
    probe = getattr(_launch, "_launch_sync", None)
    seen = []
    for value in ("1", None):
        with _environment(variable, value):
            seen.append(probe() if probe is not None else None)
    if seen != [True, False]:
        raise RuntimeError(f"refdml.gpu._support.launch does not read {variable} at each "
                           "launch as this section assumes; run the two variants in separate "
                           "processes instead")
    layer = _gsp_layer(run.xp, _gsp_inputs(batch, m, n, d), "float32", "cuda")

    def under(value):
        def call():
            with _environment(variable, value):
                return layer()
        return call
    synced = f"per-array sync ({variable}=1, numba-cuda's default)"
    free = f"no per-array sync ({variable} unset, refdml's default)"
    keep, first, _, parity = _gated(run, section, size, {synced: under("1"), free: under(None)},
                                    against=synced, tolerance=lambda name: _GSP_PARITY["float32"])
    times = run.time(keep)
    medians = {name: statistics.median(t) for name, t in times.items()}
    fastest = min(medians, key=medians.get)
    for name in keep:
        run.add(section, name, dtype="float32", size=size, times=times[name],
                first_call_s=first[name], rate=batch / medians[name], rate_unit="images/s",
                ratios=_ratios(medians, name, keep), parity_error=parity.get(name),
                parity_tolerance=_GSP_PARITY["float32"] if name in parity else None,
                parity_against=synced if name in parity else None,
                note=f"faster: {fastest.split(' (')[0]}" if len(medians) == 2 else "")


# --------------------------------------------------------------------------- training
class _TrainStep:
    """One optimisation step of ``refdml train --study digits-collage`` on the run's first
    batch: what :class:`refdml.train.Trainer` does per batch (zero_grad, model forward,
    objective forward and backward, model backward, Adam step), as scripts/bench_train.py's
    ``Step``, with config overrides (the dry run's small batch), under
    ``use_kernels(kernels)``. On the device it is the loop's step (issue 46): inside a
    :func:`refdml._deferred.deferring` scope, the loss and gradient checks deferred and
    read, with the losses, every ``LOG_EVERY`` calls (the loop's default ``log_every``)."""

    LOG_EVERY = 20

    def __init__(self, device: str, dtype: str, overrides: dict, out_dir: str,
                 kernels: str = "auto") -> None:
        from refdml.train.runs import build_run

        self.kernels = kernels
        config = dict(dtype=dtype, device=device, epochs=0, progress=False, **overrides)
        run = build_run("digits-collage", config, out_dir=out_dir)
        trainer = run.trainer
        batch = next(iter(trainer.train_sampler))
        self.batch_size = len(batch)
        # The labels stay on the host, as TrainingLoop keeps them: the objectives upload them
        # themselves, and GSP's split is drawn from them without a read back (device labels
        # cost a copy to the host and a synchronisation per step, which the loop never makes).
        self.x, _ = trainer._to_device(trainer.train_x[batch], np.zeros(0))
        self.labels = trainer.train_y[batch]
        self.model, self.objective, self.optimizer = run.model, run.objective, trainer.optimizer
        self.trainer, self.on_device, self.calls = trainer, device == "cuda", 0
        from refdml._deferred import DeferredReads

        self.reads = DeferredReads()

    def __call__(self):
        from refdml._deferred import deferring
        from refdml.gpu import use_kernels

        with use_kernels(self.kernels):
            self.optimizer.zero_grad()
            if not self.on_device:
                outputs, ctx = self.model.forward(self.x)
                loss, octx = self.objective.forward(outputs, self.labels)
                self.model.backward(ctx, self.objective.backward(octx, 1.0))
                self.optimizer.step()
                return loss
            with deferring(self.reads):
                outputs, ctx = self.model.forward(self.x)
                loss, octx = self.objective.forward(outputs, self.labels)
                self.trainer._device_step(loss, octx, ctx)
            self.calls += 1
            if self.calls % self.LOG_EVERY == 0:
                self.reads.read()             # the loop's read: raises what failed
        return loss


class _CapturedTrainStep(_TrainStep):
    """:class:`_TrainStep` on the device as ``TrainingLoop(capture=True)`` runs it
    (:class:`refdml.train._capture.StepCapture`): each call stages the batch, its labels and
    the drawn ZSR split into fixed device buffers, then runs the step uncaptured (the first
    two calls), captures it (the third) or replays the graph; the deferred checks and the
    losses are read every ``LOG_EVERY`` calls, as the loop reads them. Each call also orders
    the capture stream after the caller's and back (two events), as the loop does once per
    epoch, since the other rows of a round run on the default stream in between."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from refdml.train._capture import StepCapture

        trainer = self.trainer
        batch = next(iter(trainer.train_sampler))
        self.host_inputs = trainer.train_x[batch].astype(trainer.dtype)
        self.host_labels = trainer.train_y[batch]
        trainer.log_every = self.LOG_EVERY
        self.steps = StepCapture(trainer)
        self.losses: list[float] = []

    def __call__(self):
        from refdml._deferred import deferring
        from refdml.gpu import use_kernels

        with use_kernels(self.kernels), deferring(self.reads):
            outer = self.steps.enter()
            try:
                self.steps.step(self.host_inputs, self.host_labels, self.reads,
                                self.losses.append)
                self.calls += 1
                if self.calls % self.LOG_EVERY == 0:
                    try:
                        self.reads.read()         # the loop's read: raises what failed
                    finally:
                        self.steps.after_read()
                        self.losses.clear()
            finally:
                self.steps.leave(outer)


#: The digits-collage anchor's gradients (float32, on the GPU) against refdml's float64
#: ones (CPU fast path, held to the reference at 1e-10) at the same parameters, batch and
#: ZSR split, relative to each parameter's largest gradient entry (and the loss value's
#: relative difference): float32 rounding through a dozen layers (measured 1.7e-6 on the
#: CPU with torch 2.13) and 100 fixed-point iterations against the exact (P2) solve of
#: refdml's head (8.6e-15 apart in float64 at the study's mu 0.2, inverse temperature 10).
_TRAIN_PARITY = 1e-4


def _train_torch(anchor: _Torch, step: _TrainStep):
    """The digits-collage step as a PyTorch model trained by autograd on the anchor's
    device (scripts/_torch_anchors.py's ``collage_twin``), float32, from the parameters
    and batch of ``step`` (a float64 refdml step on the CPU); and its parity with ``step``:
    ``(twin.step, parity error)``."""
    from refdml.crossbatch import class_disjoint_split

    torch_ = anchor.torch
    x, labels = step.x, step.labels
    twin = anchor.anchors.collage_twin(step.model, step.objective, step.optimizer, x, labels,
                                       device=anchor.device, dtype=torch_.float32)
    split = class_disjoint_split(labels, rng=0)
    step.optimizer.zero_grad()
    outputs, ctx = step.model.forward(x)
    value, objective_ctx = step.objective.forward(outputs, labels, split=split)
    step.model.backward(ctx, step.objective.backward(objective_ctx, 1.0))
    twin.split = split
    twin.optimizer.zero_grad()
    loss = twin.loss()
    loss.backward()
    twin.split = None
    error = abs(float(loss.detach()) - float(value)) / abs(float(value))
    for param in step.optimizer.params:
        got = _host(twin.named_parameters[param.name].grad).astype(np.float64)
        want = _host(param.grad)
        error = max(error, float(np.max(np.abs(got - want))) / float(np.max(np.abs(want))))
    twin.optimizer.zero_grad()
    return twin.step, error


def cuda_train(run: _Run) -> None:
    """One ``refdml train`` step of digits-collage at batch 64 on ``--device cuda`` (goal
    < 5 ms in float32), beside float64 and the CPU fast path (float32) of the same run.
    Beside them, where torch sees the GPU: the same model as a user would write
    it in PyTorch, trained by autograd on the GPU (:func:`_train_torch`), from the same
    parameters and batch, checked against refdml's float64 gradients before it is timed."""
    import tempfile

    section = "train"
    overrides = run.sizes({}, {"n_classes_per_batch": 2, "n_samples_per_class": 2})
    # The dry run takes the array path on the stand-in and leaves float64 out: a step of
    # simulated kernels took 20-25 s on the loaded 2-core machine, and the other sections
    # run the same kernels under the simulator already.
    kernels = run.sizes("auto", "array")
    paths = run.sizes((("cuda", "float32"), ("cuda", "float64"), ("cpu", "float32")),
                      (("cuda", "float32"), ("cpu", "float32")))
    (work,) = _roofline_works(run, section)
    roofline = work.as_dict(ROOFLINE_DEVICE)
    with tempfile.TemporaryDirectory() as out_dir:
        steps = {f"{device} {dtype}": _TrainStep(device, dtype, overrides,
                                                 os.path.join(out_dir, f"{device}-{dtype}"),
                                                 kernels)
                 for device, dtype in paths}
        if run.capture and not run.dry_run:
            steps["cuda float32 captured"] = _CapturedTrainStep(
                "cuda", "float32", overrides, os.path.join(out_dir, "captured"), kernels)
        elif run.capture:
            run.add(section, "digits-collage step, cuda float32 captured", dtype="float32",
                    note="not run in the dry run: it takes the array path, which calls "
                         "cuBLAS and reads sizes back (not capture-safe), and the simulated kernels are too slow; "
                         "tests/train/test_train_capture.py checks the captured step")
        torch_name = "digits-collage step, torch float32 (autograd)"
        anchor = _torch_setup(run)
        functions, parity = dict(steps), {}
        if anchor.anchors is None:
            run.add(section, torch_name, dtype="float32", note=anchor.note)
        else:
            try:
                parity_step = _TrainStep("cpu", "float64", overrides,
                                         os.path.join(out_dir, "parity"), "auto")
                twin_step, parity[torch_name] = _train_torch(anchor, parity_step)
                torch_first, _ = clocked(twin_step, run.sync)
            except Exception as exc:
                _anchor_failed(run, section, torch_name, anchor, exc)
            else:
                if parity[torch_name] <= _TRAIN_PARITY:
                    functions[torch_name] = twin_step
                else:                                            # NaN fails too
                    run.add(section, torch_name, dtype="float32", device=anchor.row_device,
                            size=f"batch {parity_step.batch_size}",
                            parity_error=parity[torch_name], parity_tolerance=_TRAIN_PARITY,
                            parity_against="refdml float64 (cpu)",
                            error="parity outside its tolerance; not timed")
        first, _ = run.warm(steps)
        captured_name = "cuda float32 captured"
        if captured_name in steps:
            # Through its capture (the call after its warm-up steps) before the rounds: a
            # step that cannot be captured is a row of its own with the error, and the
            # other paths are still timed (the H200 run of 2026-11-30 lost the section
            # to CuPy's refusal of cuBLAS inside the capture).
            try:
                for _ in range(steps[captured_name].steps.warmup):
                    clocked(steps[captured_name], run.sync)
            except Exception as exc:                    # noqa: BLE001 - reported as a row
                del steps[captured_name], functions[captured_name]
                run.add(section, f"digits-collage step, {captured_name}", dtype="float32",
                        error=f"{type(exc).__name__}: {exc}")
        if torch_name in functions:
            first[torch_name] = torch_first
        times = run.time(functions)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, step in steps.items():
        device, dtype = name.split()[:2]
        goal = {}
        if name in ("cuda float32", "cuda float32 captured"):
            goal = dict(goal=f"< {_TRAIN_GOAL_S * 1e3:g} ms per step",
                        goal_met=medians[name] < _TRAIN_GOAL_S)
        run.add(section, f"digits-collage step, {name}", dtype=dtype,
                device=run.device if device == "cuda" else "cpu",
                size=f"batch {step.batch_size}", times=times[name], first_call_s=first[name],
                rate=1.0 / medians[name], rate_unit="steps/s",
                ratios=_ratios(medians, name, ["cpu float32", torch_name]
                               + (["cuda float32"] if name.endswith("captured") else [])),
                **goal,
                note="" if kernels == "auto" else f'use_kernels("{kernels}")',
                roofline=roofline if dtype == "float32" else None)
    if torch_name in functions:
        run.add(section, torch_name, dtype="float32", device=anchor.row_device,
                size=f"batch {parity_step.batch_size}", times=times[torch_name],
                first_call_s=first[torch_name], rate=1.0 / medians[torch_name],
                rate_unit="steps/s", ratios=_ratios(medians, torch_name,
                                                    ["cuda float32", "cpu float32"]),
                parity_error=parity[torch_name], parity_tolerance=_TRAIN_PARITY,
                parity_against="refdml float64 (cpu)", roofline=roofline, note=(
                    f"{anchor.note}; the same model, initial parameters and batch as "
                    "refdml's: torch's conv2d, linear layers and torch.optim.Adam under "
                    "autograd (scripts/_torch_twin.py), the GSP head by the PyTorch GSP layer "
                    "of the gsp section ((P2) by 100 fixed-point iterations where refdml "
                    "solves it exactly), contrastive + ZSR loss in torch; the ZSR split drawn "
                    "on the host each step, as refdml's"))


# --------------------------------------------------------------------------- OT
def _pot_divergences(clouds, first, second, *, index, concatenate):
    """All-pairs Sinkhorn divergences by POT's batched solver (``ot.batch``), the pairs in
    chunks of ``_POT_CHUNK``: ``OT(i, j) - (OT(i, i) + OT(j, j)) / 2`` with POT's
    KL-regularised value (``reg_type="kl"``: refdml's ``value="regularized"``).
    ``clouds`` a torch tensor (or a NumPy array); ``index`` turns a NumPy index array into
    one for ``clouds``. Returns (divergences, largest iteration count)."""
    import ot.batch

    def values(rows, cols):
        out, iterations = [], 0
        for start in range(0, len(rows), _POT_CHUNK):
            r, c = index(rows[start:start + _POT_CHUNK]), index(cols[start:start + _POT_CHUNK])
            cost = ot.batch.dist_batch(clouds[r], clouds[c], metric="sqeuclidean")
            result = ot.batch.solve_batch(cost, reg=_OT_EPS, max_iter=_OT_MAX_ITER, tol=_OT_TOL,
                                          method="log_sinkhorn", reg_type="kl", grad="detach")
            out.append(result.value)
            iterations = max(iterations, int(result.log["n_iter"]) + 1)
        return concatenate(out), iterations

    selves = np.arange(clouds.shape[0])
    cross, cross_iterations = values(first, second)
    self_values, self_iterations = values(selves, selves)
    divergence = cross - 0.5 * (self_values[index(first)] + self_values[index(second)])
    return divergence, max(cross_iterations, self_iterations)


def _pot_inputs(run: _Run, device_clouds, host_clouds):
    """POT's inputs on the same GPU: a torch tensor sharing CuPy's memory (DLPack), with its
    index and concatenate; under --dry-run NumPy arrays. ``(None, why)`` where POT or
    torch cannot run (the row then says so and the section goes on)."""
    import importlib.util

    if importlib.util.find_spec("ot") is None:
        return None, "POT not installed"
    if run.dry_run:
        return (host_clouds, np.asarray, np.concatenate), "POT's NumPy backend (dry run)"
    if importlib.util.find_spec("torch") is None:
        return None, "torch not installed (POT's GPU backend)"
    import torch

    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    clouds = torch.from_dlpack(device_clouds)
    return ((clouds, lambda a: torch.as_tensor(a, device=clouds.device), torch.cat),
            f"POT's torch backend (torch {torch.__version__}, {clouds.device})")


def cuda_sinkhorn(run: _Run) -> None:
    """All-pairs Sinkhorn divergence of 1,024 clouds of 49 points (eps 0.05), float32:
    problems per second of refdml's fast path and of POT's batched solver on the same GPU
    (goal 20x POT), after checking that the two agree on every divergence."""
    import warnings

    from refdml.exceptions import ConvergenceWarning
    from refdml.gpu import ot as fast

    section = "sinkhorn"
    # The dry run keeps R^128: tiny clouds in R^8 at eps 0.05 stall above float32's
    # residual floor on every path (CPU ones too), and the simulator would run max_iter.
    n_clouds, n_points, dim = run.sizes((1024, 49, 128), (6, 5, 128))
    host = _ot_clouds(np.random.default_rng(0), n_clouds, n_points, dim).astype(np.float32)
    first, second = np.triu_indices(n_clouds, k=1)
    n_problems = first.size + n_clouds
    size = (f"{n_clouds} clouds of {n_points} points in R^{dim} (unit norm), p=2, "
            f"eps={_OT_EPS}, tol={_OT_TOL:g}: {n_problems} OT problems (pairs + selves)")
    clouds = run.xp.asarray(host)
    ours = "refdml fast path"
    (work,) = _roofline_works(run, section)

    def refdml_call():
        return fast.pairwise_sinkhorn_divergence_forward(clouds, eps=_OT_EPS, tol=_OT_TOL,
                                                         max_iter=_OT_MAX_ITER)[0]
    functions = {ours: refdml_call}
    pot_inputs, backend = _pot_inputs(run, clouds, host)
    pot = f"POT ot.batch.solve_batch log_sinkhorn, chunks of {_POT_CHUNK}"
    if pot_inputs is not None:
        pot_clouds, index, concatenate = pot_inputs
        functions[pot] = lambda: _pot_divergences(pot_clouds, first, second, index=index,
                                                  concatenate=concatenate)
    else:
        run.add(section, pot, dtype="float32", size=size, note=backend)
    with warnings.catch_warnings():
        # A timing of unconverged solves means nothing: the section fails instead.
        warnings.simplefilter("error", ConvergenceWarning)
        first_s, outputs = run.warm(functions)
    parity = {}
    if pot in functions:
        divergence, iterations = outputs[pot]
        mine = _host(outputs[ours])[first, second].astype(np.float64)
        parity[pot] = float(np.max(np.abs(_host(divergence).astype(np.float64) - mine)))
        failure = None
        if iterations >= _OT_MAX_ITER:
            failure = f"POT did not converge in {_OT_MAX_ITER} iterations"
        elif not parity[pot] <= _OT_PARITY:
            failure = "parity outside its tolerance; not timed"
        if failure:
            run.add(section, pot, dtype="float32", size=size, first_call_s=first_s[pot],
                    parity_error=parity[pot], parity_tolerance=_OT_PARITY, parity_against=ours,
                    error=failure)
            del functions[pot]
        else:
            backend += f"; {iterations} iterations at most"
    times = run.time(functions)
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name in functions:
        goal = {}
        if name == ours:
            goal = dict(goal=f">= {_OT_GOAL:g}x POT's problems/s",
                        goal_met=medians[ours] * _OT_GOAL <= medians[pot] if pot in medians
                        else None)
        run.add(section, name, dtype="float32", size=size, times=times[name],
                first_call_s=first_s[name], rate=n_problems / medians[name],
                rate_unit="problems/s", ratios=_ratios(medians, name, functions),
                parity_error=parity.get(name),
                parity_tolerance=_OT_PARITY if name in parity else None,
                parity_against=ours if name in parity else None,
                note=backend if name == pot else "", roofline=work.as_dict(ROOFLINE_DEVICE),
                **goal)


# --------------------------------------------------------------------------- scans
def _metrics_error(got: dict, want: dict) -> float:
    """Largest |difference| over the metrics both report (the PyTorch anchor reports P@1,
    R-precision, MAP@R and the number of queries, refdml also Recall@k)."""
    return max(abs(float(got[key]) - float(want[key])) for key in want if key in got)


def _retrieval_torch(anchor: _Torch, query, query_labels, reference, ref_labels):
    """PyTorch retrieval (scripts/_torch_anchors.py): blocked ``torch.matmul`` of the
    queries against ``_RETRIEVAL_BLOCK`` references at a time, ``torch.topk``, then P@1,
    R-precision and MAP@R in torch, on the same arrays as refdml's paths."""
    tensors = [_to_torch(anchor.torch, a, anchor.device)
               for a in (query, query_labels, reference, ref_labels)]

    def call():
        return anchor.anchors.retrieval_metrics(*tensors, block=_RETRIEVAL_BLOCK)
    return call


def _p_at_1_check(got: dict, want: dict) -> tuple[str, str | None]:
    """P@1 of the anchor against refdml's, exactly up to the anchor's near-ties (queries
    whose first two neighbours have different labels and distances within rounding):
    ``(note, error or None)``."""
    differ = round(abs(got["precision_at_1"] - want["precision_at_1"]) * want["n_queries"])
    ties = got["near_ties_at_1"]
    if differ > ties:
        return "", (f"P@1 differs from the array path's in {differ} queries, more than the "
                    f"{ties} near-ties that rounding may order either way")
    if differ == 0:
        return f"P@1 equal to the array path's ({ties} near-ties)", None
    return f"P@1 differs in {differ} queries, all among the {ties} near-ties", None


def cuda_retrieval(run: _Run) -> None:
    """Retrieval metrics of 10,000 queries against 1,000,000 x 128 references (float32,
    Euclidean, 10,000 classes of 100): queries per second of the CUDA kernel and of the
    CuPy array path, and their ratio to the float32 matrix-product bound of the same run
    (``cupy.matmul`` of the query block by every reference block: the product the array
    path makes, without the top-K). Beside them, where torch sees the GPU, the
    anchor a user would pick instead: the same retrieval in PyTorch
    (:func:`_retrieval_torch`), its metrics checked against the array path's (P@1 exactly
    up to near-ties, :func:`_p_at_1_check`)."""
    from refdml.gpu import metrics as fast
    from refdml.gpu import use_kernels

    section, xp = "retrieval", run.xp
    n_ref, n_query, dim, n_classes = run.sizes((1_000_000, 10_000, 128, 10_000), (96, 12, 8, 6))
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((n_classes, dim), dtype=np.float32)
    ref_labels = rng.permutation(np.arange(n_ref) % n_classes)
    reference = centres[ref_labels]
    reference += 1.5 * rng.standard_normal((n_ref, dim), dtype=np.float32)
    query_labels = rng.integers(0, n_classes, n_query)
    query = centres[query_labels] + 1.5 * rng.standard_normal((n_query, dim), dtype=np.float32)
    reference, ref_labels, query, query_labels = (
        xp.asarray(a) for a in (reference, ref_labels, query, query_labels))
    size = (f"{n_query} queries x {n_ref} references of dimension {dim}, {n_classes} classes, "
            "Euclidean")

    def metrics(kernels):
        def call():
            with use_kernels(kernels):
                return fast.retrieval_metrics(query, query_labels, reference, ref_labels)
        return call

    def matmul_bound():
        for start in range(0, n_ref, _RETRIEVAL_BLOCK):
            xp.matmul(query, reference[start:start + _RETRIEVAL_BLOCK].T)

    kernel, array, bound = "cuda kernel", "cupy array path", "float32 matmul bound"
    torch_name = "torch matmul + topk"
    (work,) = _roofline_works(run, section)
    keep, first, outputs, parity = _gated(run, section, size, {array: metrics("array"),
                                                                kernel: metrics("cuda")},
                                          against=array, tolerance=lambda name: _RETRIEVAL_PARITY,
                                          error=_metrics_error)
    anchor = _torch_setup(run)
    notes = {bound: ""}
    if anchor.anchors is None:
        run.add(section, torch_name, dtype="float32", size=size, note=anchor.note)
    else:
        # Its own gate against the array path (called once more, untimed), so that a torch
        # failure costs only this row.
        try:
            gated = _gated(run, section, size, {array: metrics("array"), torch_name:
                                                _retrieval_torch(anchor, query, query_labels,
                                                                 reference, ref_labels)},
                           against=array, tolerance=lambda name: _RETRIEVAL_PARITY,
                           error=_metrics_error)
        except Exception as exc:
            _anchor_failed(run, section, torch_name, anchor, exc, size=size)
        else:
            _merge_anchor(keep, first, parity, {}, gated, array)
            outputs[torch_name] = gated[2].get(torch_name)
    if torch_name in keep:
        ties_note, failure = _p_at_1_check(outputs[torch_name], outputs[array])
        if failure:
            run.add(section, torch_name, dtype="float32", size=size,
                    first_call_s=first[torch_name], parity_error=parity[torch_name],
                    parity_tolerance=_RETRIEVAL_PARITY, parity_against=array,
                    device=anchor.row_device, error=failure + "; not timed")
            del keep[torch_name]
        notes[torch_name] = "; ".join((anchor.note, ties_note, (
            f"blocks of {_RETRIEVAL_BLOCK} references; averages in float64")))
    bound_first, _ = clocked(matmul_bound, run.sync)
    keep[bound] = matmul_bound
    first[bound] = bound_first
    times = run.time(keep)
    medians = {name: statistics.median(t) for name, t in times.items()}
    flops = 2.0 * n_query * n_ref * dim
    notes[bound] = f"{flops / medians[bound] / 1e12:.3g} TFLOP/s, blocks of {_RETRIEVAL_BLOCK} references"
    for name in keep:
        run.add(section, name, dtype="float32", size=size, times=times[name],
                first_call_s=first[name], rate=n_query / medians[name], rate_unit="queries/s",
                ratios=_ratios(medians, name, [bound, array, kernel, torch_name]),
                parity_error=parity.get(name),
                parity_tolerance=_RETRIEVAL_PARITY if name in parity else None,
                parity_against=array if name in parity else None,
                device=anchor.row_device if name == torch_name else None,
                note=notes.get(name, ""),
                roofline=work.as_dict(ROOFLINE_DEVICE) if name != bound else None)


def _kcenter_error(got, want) -> float:
    """Largest relative radius difference over the common first picks (inf: none)."""
    got_i, want_i = _host(got.indices), _host(want.indices)
    differ = np.flatnonzero(got_i != want_i)
    common = int(differ[0]) if differ.size else got_i.size
    if common == 0:
        return math.inf
    g = _host(got.radii)[:common].astype(np.float64)
    w = _host(want.radii)[:common].astype(np.float64)
    return float(np.max(np.abs(g - w) / np.maximum(np.abs(w), np.finfo(np.float32).tiny)))


def cuda_kcenter(run: _Run) -> None:
    """Greedy k-center of 1,000,000 x 128 points (float32), k = 1,000: time of the CUDA
    kernels and of the CuPy array path, and their ratio to the memory-bandwidth bound.

    The bound: every pick must read all the points (``n d`` values; they do not fit in any
    cache) and read and write the running distances (``2 n``), so ``k n (d + 2) 4`` bytes
    at the device's bandwidth, measured in the same run as a device-to-device copy of the
    points (``2 n d 4`` bytes moved: read + write)."""
    from refdml.gpu import kcenter as fast
    from refdml.gpu import use_kernels

    section, xp = "kcenter", run.xp
    n, dim, k = run.sizes((1_000_000, 128, 1000), (200, 8, 6))
    points = xp.asarray(np.random.default_rng(0).standard_normal((n, dim), dtype=np.float32))
    copy = xp.empty_like(points)
    size = f"n={n} d={dim} k={k}, first centre drawn with rng=0"

    def picks(kernels):
        def call():
            with use_kernels(kernels):
                return fast.greedy_k_center(points, k, rng=0)
        return call

    def device_copy():
        copy[...] = points

    kernel, array, copied = "cuda kernel", "cupy array path", "device-to-device copy"
    (work,) = _roofline_works(run, section)
    keep, first, outputs, parity = _gated(run, section, size, {array: picks("array"),
                                                               kernel: picks("cuda")},
                                          against=array, tolerance=lambda name: _KCENTER_PARITY,
                                          error=_kcenter_error)
    first[copied], _ = clocked(device_copy, run.sync)
    keep[copied] = device_copy
    times = run.time(keep)
    medians = {name: statistics.median(t) for name, t in times.items()}
    bandwidth = 2.0 * points.nbytes / medians[copied]
    bound = "memory-bandwidth bound"
    medians[bound] = k * n * (dim + 2) * points.itemsize / bandwidth
    for name in keep:
        if name == copied:
            run.add(section, name, dtype="float32", size=f"{points.nbytes} bytes",
                    times=times[name], first_call_s=first[name], rate=bandwidth,
                    rate_unit="bytes/s (read + written)")
            continue
        common = ""
        if name in parity:
            got, want = _host(outputs[name].indices), _host(outputs[array].indices)
            differ = np.flatnonzero(got != want)
            common = f"first {int(differ[0]) if differ.size else k} of {k} picks as the array path"
        run.add(section, name, dtype="float32", size=size, times=times[name],
                first_call_s=first[name], rate=k / medians[name], rate_unit="picks/s",
                ratios=_ratios(medians, name, [bound, array]), parity_error=parity.get(name),
                parity_tolerance=_KCENTER_PARITY if name in parity else None,
                parity_against=array if name in parity else None, note=common,
                roofline=work.as_dict(ROOFLINE_DEVICE))
    run.add(section, bound, dtype="float32", size=size, median_s=medians[bound],
            note=f"k n (d + 2) 4 bytes at the copy's {bandwidth / 1e9:.4g} GB/s (computed, "
                 "not timed)")


CUDA_SECTIONS = {"gsp": cuda_gsp, "launch_sync": cuda_launch_sync, "train": cuda_train,
                 "kcenter": cuda_kcenter, "retrieval": cuda_retrieval, "sinkhorn": cuda_sinkhorn}


# --------------------------------------------------------------------------- the run
def _prepare_cuda(dry_run: bool) -> str | None:
    """Make ``--device cuda`` runnable, or say why it is not (None: runnable).

    Dry run: Numba's CUDA simulator and refdml's CuPy stand-in (tests/cupy_standin), set up
    before Numba or CuPy is imported. Otherwise: real CuPy seeing a device, numba-cuda
    seeing it too, the simulator off, and an importable refdml.gpu.
    """
    if dry_run:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        os.environ["REFDML_CUPY_STANDIN"] = "1"
        tests = os.path.join(_REPOSITORY, "tests")
        if not os.path.isdir(os.path.join(tests, "cupy_standin")):
            return f"--dry-run needs the CuPy stand-in of the repository ({tests}/cupy_standin)"
        sys.path.insert(0, tests)
        import cuda_simulator_tuning
        import cupy_standin

        cupy_standin.install()
        cuda_simulator_tuning.tune()    # what the test suite runs the simulator with
    else:
        if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
            return ("NUMBA_ENABLE_CUDASIM=1: the simulator's timings mean nothing; unset it on a "
                    "GPU machine, or add --dry-run")
        if os.environ.get("REFDML_CUPY_STANDIN") == "1":
            return "REFDML_CUPY_STANDIN=1: the CuPy stand-in is no GPU; unset it, or add --dry-run"
    try:
        import refdml.gpu  # noqa: F401
    except ImportError as exc:
        return f"refdml.gpu cannot be imported ({exc}); install refdml (README)"
    if not dry_run:
        from refdml.gpu._support.modes import cuda_unavailable_reason

        reason = cuda_unavailable_reason()
        if reason is not None:
            return (f"{reason} (a GPU machine with cupy-cuda12x/13x and refdml[gpu] needed), "
                    "or add --dry-run")
    return None


def _eager_imports() -> list[str]:
    """Which of POT, dask and distributed (absent on the GPU machine) importing the fast
    path and refdml.train pulls in; must run before anything imports POT on purpose."""
    import refdml.gpu.gsp, refdml.gpu.kcenter, refdml.gpu.metrics, refdml.gpu.ot  # noqa: E401, F401
    import refdml.train.runs  # noqa: F401

    return sorted(name for name in ("ot", "dask", "distributed") if name in sys.modules)


def _cuda_version(number: int) -> str:
    return f"{number // 1000}.{number % 1000 // 10}"


def _device_header(xp) -> dict:
    """The current device of array module ``xp`` (CuPy or the stand-in) as the JSON
    headers record it; ``error`` where it cannot be read (a header never stops a run)."""
    try:
        runtime = xp.cuda.runtime
        properties = runtime.getDeviceProperties(xp.cuda.Device().id)
        name = properties["name"]
        return {
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": f"{properties['major']}.{properties['minor']}",
            "memory_bytes": int(properties["totalGlobalMem"]),
            "multiprocessors": int(properties["multiProcessorCount"]),
            "driver_cuda_version": _cuda_version(runtime.driverGetVersion()),
            "runtime_cuda_version": _cuda_version(runtime.runtimeGetVersion()),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _versions_header(xp) -> dict:
    """Python's and the installed packages' versions, as the JSON headers record them."""
    import importlib.metadata
    import platform

    import numba

    def version(distribution):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "refdml": version("refdml"),
            "numpy": np.__version__, "cupy": getattr(xp, "__version__", None),
            "numba": numba.__version__, "numba-cuda": version("numba-cuda"),
            "POT": version("POT"), "torch": version("torch")}


def _header(run: _Run, eager: list[str]) -> dict:
    import datetime
    import platform

    import numba

    import refdml

    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dry_run": run.dry_run,
        "note": _DRY_NOTE if run.dry_run else "",
        "device": _device_header(run.xp),
        "versions": _versions_header(run.xp),
        "refdml_path": os.path.dirname(refdml.__file__),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(),
                 "numba_threads": numba.get_num_threads()},
        "environment": {name: os.environ.get(name) for name in (
            "NUMBA_ENABLE_CUDASIM", "REFDML_CUPY_STANDIN", "REFDML_CUDA_LAUNCH_SYNC",
            "REFDML_GPU_KERNELS", "CUPY_TF32", "OPENBLAS_NUM_THREADS", "NUMBA_CACHE_DIR",
            "CUPY_CACHE_DIR")},
        "timing": TIMING,
        "repeats": run.repeats,
        "max_seconds": run.max_seconds,
        "eager_imports": eager,
        "command": [os.path.basename(sys.argv[0])] + sys.argv[1:],
        "sections_s": {},
    }


def _free_device_memory(xp) -> None:
    """Hand cached blocks back between sections, so that one section's pool does not
    starve the next (or torch's allocator, for POT)."""
    try:
        xp.get_default_memory_pool().free_all_blocks()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass


def run_cuda(sections: list[str], *, dry_run: bool, repeats: int, max_seconds: float,
             json_path: str | None, argv: list | None = None, capture: bool = False) -> int:
    """The CUDA sections in order, each failure a row (the others still run); the JSON
    document is rewritten after every section. Exit status: 0, 1 if a row has an error,
    2 if ``--device cuda`` cannot run here."""
    import traceback
    import warnings

    reason = _prepare_cuda(dry_run)
    if reason is not None:
        print(f"bench_gpu.py --device cuda: {reason}", file=sys.stderr)
        return 2
    import cupy

    # numba-cuda warns of low occupancy at every small grid (the dry run's, GSP's per-image
    # launches); it says nothing about correctness and would bury the table.
    warnings.filterwarnings("ignore", message="Grid size .* under-utilization")
    device = cupy.cuda.Device()
    run = _Run(xp=cupy, dry_run=dry_run, repeats=repeats, max_seconds=max_seconds,
               sync=device.synchronize, json_path=json_path, argv=argv, capture=capture)
    eager = _eager_imports()
    run.header = _header(run, eager)
    print(f"bench_gpu.py --device cuda{' --dry-run' if dry_run else ''}: "
          f"{run.header['device'].get('name')}; {TIMING}; up to {repeats} rounds, "
          f"{max_seconds:g} s per group", flush=True)
    try:
        run.write_json(complete=False)          # an unwritable --json fails now, not later
    except OSError as exc:
        print(f"bench_gpu.py --device cuda: --json {json_path}: {exc}", file=sys.stderr)
        return 2
    if eager:
        run.add("imports", "refdml.gpu + refdml.train.runs", error=(
            f"imported {', '.join(eager)} eagerly (absent on the GPU machine)"))
    for name in sections:
        start = time.perf_counter()
        try:
            CUDA_SECTIONS[name](run)
        except Exception as exc:                 # out of memory, a kernel fault, ...
            traceback.print_exc()
            run.add(name, "section failed", error=f"{type(exc).__name__}: {exc}")
        finally:
            _free_device_memory(cupy)
        run.header["sections_s"][name] = round(time.perf_counter() - start, 3)
        run.write_json(complete=False)
    run.write_json(complete=True)
    return 1 if any(row.error for row in run.rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the fast path on NumPy against the reference (default); "
                             "cuda: the CuPy benchmarks of issue 21")
    parser.add_argument("--only", choices=sorted(set(SECTIONS) | set(ANCHOR_SECTIONS)
                                                 | set(CUDA_SECTIONS)),
                        action="append", help="run only these sections (repeatable)")
    parser.add_argument("--quick", action="store_true", help="3 repeats")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved rounds (median)")
    parser.add_argument("--max-seconds", type=float, default=10.0,
                        help="--device cuda: a group's timed rounds stop once they have taken "
                             "this long, after at least one (default 10)")
    parser.add_argument("--capture", action="store_true",
                        help="train section (--device cuda): also time the step recorded as a "
                             "CUDA graph and replayed (TrainingLoop(capture=True)'s), beside the "
                             "uncaptured step and the PyTorch anchor")
    parser.add_argument("--dry-run", action="store_true",
                        help="--device cuda at tiny sizes on the CuPy stand-in under Numba's "
                             "CUDA simulator (no GPU; CI): checks the script, measures nothing")
    parser.add_argument("--json", metavar="PATH",
                        help="write the tables to PATH atomically (schema refdml-bench/1; "
                             "--device cuda: also every row and a header)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats == {args.repeats}, must be at least 1")
    if not args.max_seconds >= 0:
        parser.error(f"--max-seconds == {args.max_seconds}, must be >= 0")
    sections = SECTIONS | ANCHOR_SECTIONS if args.device == "cpu" else CUDA_SECTIONS
    for name in args.only or ():
        if name not in sections:
            parser.error(f"--only {name!r} is not a section of --device {args.device}; "
                         f"choose from {', '.join(sections)}")
    anchors = set(args.only or ()) & set(ANCHOR_SECTIONS)
    if anchors and len(set(args.only)) > 1:
        parser.error(f"--only {sorted(anchors)[0]} runs alone (torch in the process would "
                     "change the other sections' times; see bench_torch_gsp)")
    if args.device == "cpu":
        if args.dry_run:
            parser.error("--dry-run goes with --device cuda")
        repeats = args.repeats or (3 if args.quick else 9)
        tables = []
        for name in args.only or sorted(SECTIONS):
            tables += sections[name](repeats)
        if args.json:
            write_json(args.json, script=__file__, argv=argv, tables=tables, notes=[
                "every timing is the median of interleaved runs in one process: the ratios "
                "are comparable on a busy machine, the absolute times are not",
                f"BLAS threads (OPENBLAS_NUM_THREADS) {os.environ['OPENBLAS_NUM_THREADS']}",
                "load average at the end: %.2f %.2f %.2f" % os.getloadavg()])
        return 0
    repeats = args.repeats or (1 if args.dry_run else 3 if args.quick else 9)
    return run_cuda(list(dict.fromkeys(args.only or CUDA_SECTIONS)), dry_run=args.dry_run,
                    repeats=repeats, max_seconds=args.max_seconds, json_path=args.json,
                    argv=argv, capture=args.capture)


if __name__ == "__main__":
    raise SystemExit(main())
