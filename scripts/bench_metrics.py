"""Benchmark of refdml.metrics.retrieval_metrics at the shape of the SOP test split.

60,000 random 128-d embeddings in 11,316 classes (every class has at least two members),
same-set mode. For a few chunk sizes the script reports wall time and peak traced memory
(tracemalloc, which sees NumPy's buffers), and the ratios to the default chunk size, all
measured in the same run; then the process's peak resident set size. A smaller problem
compares the chunked computation with a direct one that builds the full distance matrix
and sorts every row (the memory the chunking avoids). Last, the partition scores
(NMI, AMI, pairwise F1) of two random labelings of the same shape (sparse contingency
table; the dense one would be n_classes^2 int64) and ``clustering_metrics`` on a
smaller set.

``retrieval_metrics`` runs its readable ranking only (issue 45), whose score blocks
``chunk_size`` sets, so the chunk rows here time blocks of different sizes. From issue 11
until then it ran the compiled CPU twin (now :func:`refdml.gpu.metrics.retrieval_metrics`
on NumPy), whose tiles do not depend on ``chunk_size``. scripts/bench_retrieval.py is the
issue-11 benchmark (bounds, faiss, the readable path, RSS peak).

    python scripts/bench_metrics.py            # full size (slow: the readable ranking)
    python scripts/bench_metrics.py --quick    # 6,000 x 128, 1,131 classes (seconds)
    python scripts/bench_metrics.py --json out.json   # the tables also as JSON (scripts/_bench.py)
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench import Table, write_json  # noqa: E402

from refdml import metrics as metrics_module  # noqa: E402
from refdml.metrics import (  # noqa: E402
    adjusted_mutual_information,
    clustering_metrics,
    normalized_mutual_information,
    pairwise_f1,
    retrieval_metrics,
)


def make_data(n: int, n_classes: int, d: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = np.concatenate([np.repeat(np.arange(n_classes), 2), rng.integers(0, n_classes, n - 2 * n_classes)])
    x = rng.standard_normal((n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x, rng.permutation(labels)


def timed(fn) -> tuple[object, float, float]:
    """Result, seconds, peak traced MiB above the memory traced before the call."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return result, seconds, peak / 2**20


def full_matrix_metrics(x: np.ndarray, labels: np.ndarray) -> float:
    """Direct P@1 / MAP@R with the whole distance matrix and a full stable sort per row."""
    sq = np.einsum("ij,ij->i", x, x)
    dist = sq[None, :] - 2.0 * (x @ x.T)
    np.fill_diagonal(dist, np.inf)
    order = np.argsort(dist, axis=1, kind="stable")
    hits = labels[order] == labels[:, None]
    r = np.bincount(labels)[labels] - 1
    ranks = np.arange(1, x.shape[0] + 1)
    within = ranks[None, :] <= r[:, None]
    precision = np.cumsum(hits & within, axis=1) / ranks
    return float(np.mean(np.sum(precision * (hits & within), axis=1) / r))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6,000 x 128 instead of 60,000 x 128")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH",
                        help="also write the tables to PATH (schema refdml-bench/1)")
    args = parser.parse_args(argv)

    n, n_classes, d = (6_000, 1_131, 128) if args.quick else (60_000, 11_316, 128)
    x, labels = make_data(n, n_classes, d, args.seed)
    print(f"retrieval_metrics, same-set mode: {n} x {d} float64, {n_classes} classes")
    print(f"numpy {np.__version__}, python {sys.version.split()[0]}")
    full_matrix_mib = n * n * 8 / 2**20
    print(f"(a full {n} x {n} float64 distance matrix would be {full_matrix_mib:,.0f} MiB)\n")

    retrieval_metrics(x[:2000], labels[:2000] % 100)  # warm-up: BLAS threads, page faults
    rows = []
    reference = None
    for chunk_size in (None, 64, 512):
        result, seconds, peak = timed(lambda: retrieval_metrics(x, labels, chunk_size=chunk_size))
        if reference is None:
            reference = (result, seconds, peak)
        assert result == reference[0], "results differ between chunk sizes"
        default_chunk = max(1, metrics_module._CHUNK_BYTES // (8 * n))
        label = f"chunked (default, {metrics_module._CHUNK_BYTES >> 20} MiB blocks)"
        rows.append(("chunked" if chunk_size else label, chunk_size or default_chunk, seconds, peak))

    tables = []
    chunks = Table(
        f"retrieval_metrics, same-set mode, {n} x {d} float64, {n_classes} classes: wall time "
        "and peak traced memory (tracemalloc) per chunk size; ratios against the default "
        "chunk size", ["computation", "chunk", "time s", "peak MiB", "time ratio", "mem ratio"],
        notes=[f"a full {n} x {n} float64 distance matrix would be {full_matrix_mib:,.0f} MiB"])
    tables.append(chunks)
    print(f"{'computation':<34}{'chunk':>7}{'time s':>9}{'peak MiB':>10}{'time ratio':>12}{'mem ratio':>11}")
    for name, chunk, seconds, peak in rows:
        c = chunks.add(name, chunk, f"{seconds:.2f}", f"{peak:.1f}",
                       f"{seconds / reference[1]:.2f}", f"{peak / reference[2]:.2f}")
        print(f"{c[0]:<34}{c[1]:>7}{c[2]:>9}{c[3]:>10}{c[4]:>12}{c[5]:>11}")
    maxrss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(chunks.note(f"process peak resident set size so far (data included): {maxrss_mib:,.0f} MiB"))
    result = reference[0]
    print("\nmetrics (random embeddings, so near chance):")
    values = Table(f"retrieval_metrics of the {n} x {d} random embeddings (near chance)",
                   ["metric", "value"])
    tables.append(values)
    for key, value in result.items():
        c = values.add(key, f"{value:.6g}" if isinstance(value, float) else value)
        print(f"  {c[0]:<30}{c[1]}")

    # Chunked vs full matrix on a problem small enough for the full matrix.
    small = 4_000
    xs, ls = make_data(small, small // 5, d, args.seed + 1)
    chunked, t_chunked, m_chunked = timed(lambda: retrieval_metrics(xs, ls))
    direct, t_direct, m_direct = timed(lambda: full_matrix_metrics(xs, ls))
    np.testing.assert_allclose(chunked["mean_average_precision_at_r"], direct, rtol=1e-12)
    print(f"\n{small} x {d}: chunked vs full matrix + full sort (same MAP@R)")
    direct_table = Table(
        f"retrieval_metrics, {small} x {d} float64, {small // 5} classes: chunked (top-K only) "
        "vs the full distance matrix and a full argsort of every row (same MAP@R, asserted); "
        "ratios against the chunked computation",
        ["computation", "time s", "peak MiB", "time ratio", "mem ratio"])
    tables.append(direct_table)
    print(f"{'computation':<34}{'time s':>9}{'peak MiB':>10}{'time ratio':>12}{'mem ratio':>11}")
    for c in (direct_table.add("chunked, top-K only", f"{t_chunked:.2f}", f"{m_chunked:.1f}",
                               f"{1.0:.2f}", f"{1.0:.2f}"),
              direct_table.add("full matrix, argsort", f"{t_direct:.2f}", f"{m_direct:.1f}",
                               f"{t_direct / t_chunked:.2f}", f"{m_direct / m_chunked:.2f}")):
        print(f"{c[0]:<34}{c[1]:>9}{c[2]:>10}{c[3]:>12}{c[4]:>11}")

    # Partition scores at full size: two random labelings into n_classes blocks.
    rng = np.random.default_rng(args.seed + 2)
    predicted = rng.integers(0, n_classes, n)
    dense_mib = n_classes * n_classes * 8 / 2**20
    print(f"\npartition scores, {n} samples, {n_classes} x {n_classes} contingency "
          f"(dense: {dense_mib:,.0f} MiB)")
    partition = Table(
        f"Partition scores of two random labelings of {n} samples into {n_classes} blocks "
        f"(sparse {n_classes} x {n_classes} contingency; dense: {dense_mib:,.0f} MiB)",
        ["score", "value", "time s", "peak MiB"])
    tables.append(partition)
    print(f"{'score':<34}{'value':>12}{'time s':>9}{'peak MiB':>10}")
    for name, fn in (("normalized_mutual_information", normalized_mutual_information),
                     ("adjusted_mutual_information", adjusted_mutual_information),
                     ("pairwise_f1", pairwise_f1)):
        value, seconds, peak = timed(lambda fn=fn: fn(labels, predicted))
        c = partition.add(name, f"{value:.3g}", f"{seconds:.3f}", f"{peak:.1f}")
        print(f"{c[0]:<34}{c[1]:>12}{c[2]:>9}{c[3]:>10}")

    n_small, classes_small = 6_000, 100
    xc, lc = make_data(n_small, classes_small, d, args.seed + 3)
    result, seconds, peak = timed(lambda: clustering_metrics(xc, lc, rng=args.seed))
    clustering = Table(
        f"clustering_metrics, {n_small} x {d} float64, {classes_small} classes (k-means, 20 "
        "iterations)", ["time s", "peak MiB", *result])
    c = clustering.add(f"{seconds:.2f}", f"{peak:.1f}", *(f"{v:.3g}" for v in result.values()))
    tables.append(clustering)
    print(f"\nclustering_metrics, {n_small} x {d}, {classes_small} classes (k-means, 20 iterations): "
          f"{c[0]} s, peak {c[1]} MiB, "
          + ", ".join(f"{k} {v}" for k, v in zip(result, c[2:])))
    if args.json:
        write_json(args.json, script=__file__, argv=argv, tables=tables,
                   notes=[f"numpy {np.__version__}, python {sys.version.split()[0]}; times "
                          "are single runs on a machine that may be shared"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
