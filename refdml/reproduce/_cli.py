"""``refdml reproduce``: arguments, the run, the lines, JSON and the report."""

from __future__ import annotations

import argparse
import sys
import time

from pathlib import Path

from refdml._cli_support import (
    at_least,
    check_output_paths,
    path_problem,
    shown,
    writable_folder_problem,
    write_outputs,
)
from refdml.reproduce._experiments import SCALES
from refdml.reproduce.stats import VERDICT_MEANINGS

__all__ = ["DESCRIPTION", "EPILOG", "HELP", "add_arguments", "run"]

HELP = "run the papers' experiments over seeds on Dask, with computed verdicts"
DESCRIPTION = ("Train the papers' experiments at small scale (refdml.train) over seeds, "
               "on a Dask LocalCluster (or --scheduler), with a disk cache; one line per "
               "experiment: verdict and the paired effect with its Student-t interval "
               "(docs/reproduce.md). --quick is a smoke run: its verdicts are 'smoke'.")

DEFAULT_CACHE = ".refdml-cache/reproduce"


def _epilog() -> str:
    width = max(map(len, VERDICT_MEANINGS))
    lines = "\n".join(f"  {k:<{width}}  {v}" for k, v in VERDICT_MEANINGS.items())
    return ("verdicts (computed from the paired 95% Student-t interval over seeds, the gates,\n"
            "the plateau, power and Holm's adjustment; docs/reproduce.md, Statistics):\n" + lines
            + "\n\nexit status:\n  0  every task ran (whatever the verdicts)\n"
            "  1  a task failed (its traceback is printed; the others were kept), or an\n"
            "     output could not be written\n"
            "  2  bad arguments (an output path or --cache folder that cannot be written,\n"
            "     a --report folder that is not empty and not a refdml report, ...), found\n"
            "     before any task runs\n\n"
            "--report DIR is written as a whole: the previous report there is replaced (no\n"
            "stale figure survives), and a run stopped before the end leaves it as it was.\n\n"
            "examples:\n  refdml reproduce --quick --report out/\n"
            "  refdml reproduce --only gsp.synthetic wdml --workers 4\n"
            "  refdml reproduce --scheduler tcp://10.0.0.5:8786 --json results.json")


#: The verdicts, the exit statuses and examples (``refdml reproduce --help``).
EPILOG = _epilog()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="5 seeds (the glyph experiments 3) and short runs (under 15 "
                             "minutes on 2 cores); default: 10 seeds (glyphs 4) and longer runs")
    parser.add_argument("--only", nargs="+", metavar="ID",
                        help="run only these experiments (ids or prefixes, e.g. 'gsp' 'asap.proxies')")
    parser.add_argument("--list", action="store_true", help="print the experiments and exit")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--report", metavar="DIR",
                        help="write a Markdown report with figures here, replacing the report "
                             "there as a whole; checked before the run")
    parser.add_argument("--workers", type=at_least("--workers"), default=2,
                        help="worker processes of the embedded Dask LocalCluster (default 2)")
    parser.add_argument("--scheduler", metavar="ADDRESS",
                        help="use this running Dask scheduler (tcp://host:port) instead of a "
                             "LocalCluster; its workers need refdml installed")
    parser.add_argument("--seeds", type=at_least("--seeds", 2), default=None,
                        help="seeds per run, every experiment (default: 5 with --quick, 10 "
                             "without; the glyph experiments 3 and 4)")
    parser.add_argument("--cache", metavar="DIR", default=DEFAULT_CACHE,
                        help=f"finished tasks are kept here (default {DEFAULT_CACHE}); a re-run "
                             "reuses them")
    parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    parser.add_argument("--cached-only", action="store_true",
                        help="compute nothing: report what the cache holds (e.g. while a run "
                             "goes on); missing seeds are left out of the comparisons")
    parser.add_argument("--in-process", action="store_true",
                        help="run the tasks one by one in this process, without Dask")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="train on the CPU (NumPy, the default) or on a GPU (CuPy; "
                             "install the cupy wheel of your CUDA, e.g. cupy-cuda12x)")
    parser.add_argument("--scale", choices=SCALES, default="small",
                        help="small (default): settings sized for a 2-core CPU; large: more "
                             "glyph instances, larger glyphs, models and epochs, and the "
                             "glyph-collage experiment (meant for --device cuda)")


def _list() -> int:
    from refdml.reproduce._experiments import EXPERIMENTS

    width = max(map(len, EXPERIMENTS)) + 2
    for e in EXPERIMENTS.values():
        only = "" if e.scales == SCALES else f" [--scale {' / '.join(e.scales)} only]"
        print(f"{e.id:<{width}}{e.paper}{only}: {e.claim}")
    return 0


def _check_device(device: str) -> str | None:
    """Why ``device`` cannot be used here, or None."""
    if device == "cpu":
        return None
    try:
        import cupy
    except ImportError:
        return ("--device cuda needs CuPy: install the wheel of your CUDA version "
                "(e.g. pip install cupy-cuda12x)")
    if getattr(cupy, "__refdml_standin__", False):
        return None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device: CuPy's own error says which
        return f"--device cuda: CuPy finds no GPU ({exc})"
    return None if count > 0 else "--device cuda: CuPy finds no GPU"


def _check_outputs(args: argparse.Namespace, recognise) -> str | None:
    """``--json`` and ``--report`` can be written, and the report (replaced as a whole)
    does not hold the cache; the problem, or None."""
    problem = check_output_paths(args.report, args.json, recognise=recognise)
    if problem is None and args.report is not None and not args.no_cache:
        problem = path_problem("--cache", args.cache)
        cache, report = Path(args.cache).resolve(), Path(args.report).resolve()
        if problem is None and (cache == report or report in cache.parents):
            problem = (f"--cache {shown(args.cache)} lies inside --report "
                       f"{shown(args.report)}, which is replaced as a whole; keep the cache "
                       "elsewhere")
    return problem


def _check_cache(args: argparse.Namespace) -> str | None:
    """``--cache`` can be created and written (``--cached-only``: only read, so only a
    usable path that is not a file); the problem, or None. Run before any task: a cache
    that cannot be written would fail at the first finished task, after its work."""
    if args.no_cache:
        return None
    if args.cached_only:
        problem = path_problem("--cache", args.cache)
        if problem is None and Path(args.cache).exists() and not Path(args.cache).is_dir():
            problem = f"--cache {shown(args.cache)}: is a file, not a folder"
        return problem
    return writable_folder_problem("--cache", args.cache)


def run(args: argparse.Namespace) -> int:
    """Run ``refdml reproduce`` with the flags of :func:`add_arguments`; its exit status."""
    from refdml.reproduce._experiments import EXPERIMENTS
    from refdml.reproduce._report import (
        evaluate_experiment,
        is_report_folder,
        summary_header,
        summary_lines,
        write_json,
        write_report,
    )
    from refdml.reproduce._runner import run_tasks
    from refdml.reproduce._tasks import code_version
    from refdml.validation import select

    if args.list:
        return _list()
    ids = list(EXPERIMENTS)
    if args.only:
        ids, unmatched = select(ids, args.only)
        if unmatched:
            print(f"refdml reproduce: error: --only {' '.join(unmatched)} matches no experiment "
                  "(an id or a prefix such as 'gsp'); the experiments are:", file=sys.stderr)
            print("\n".join(f"  {i}" for i in EXPERIMENTS), file=sys.stderr)
            return 2
    if args.scheduler is not None and not args.scheduler.strip():
        print("refdml reproduce: error: --scheduler '' is empty; give tcp://host:port",
              file=sys.stderr)
        return 2
    problem = _check_device(args.device) or _check_outputs(args, is_report_folder)
    if problem is not None:
        print(f"refdml reproduce: error: {problem}", file=sys.stderr)
        return 2
    mode = "quick" if args.quick else "full"
    skipped = [i for i in ids if args.scale not in EXPERIMENTS[i].scales]
    if args.only and skipped:
        print(f"refdml reproduce: error: --only {' '.join(skipped)}: not run at --scale "
              f"{args.scale} (see refdml reproduce --list)", file=sys.stderr)
        return 2
    problem = _check_cache(args)   # last of the checks: it creates the cache folder
    if problem is not None:
        print(f"refdml reproduce: error: {problem}", file=sys.stderr)
        return 2
    experiments = [EXPERIMENTS[i] for i in ids if i not in skipped]
    grid = dict(scale=args.scale, device=args.device)
    tasks = [t for e in experiments for ts in e.tasks(mode, args.seeds, **grid).values()
             for t in ts]
    where = ("the cache only" if args.cached_only else f"scheduler {args.scheduler}"
             if args.scheduler else "in this process" if args.in_process
             else f"LocalCluster of {args.workers} worker process(es)")
    unique = len(set(tasks))
    print(f"refdml reproduce ({mode} mode, {args.scale} scale, {args.device}): "
          f"{len(experiments)} experiment(s), {unique} task(s), {where}, code version "
          f"{code_version()}", flush=True)
    start = time.perf_counter()
    outcome = run_tasks(tasks, workers=args.workers, scheduler=args.scheduler,
                        cache_dir=None if args.no_cache else args.cache,
                        in_process=args.in_process, compute=not args.cached_only)
    wall = time.perf_counter() - start
    results = [evaluate_experiment(e, mode, outcome, seeds=args.seeds, **grid)
               for e in experiments]
    print("\n".join(summary_header()))
    print("-" * 100)
    for r in results:
        print("\n".join(summary_lines(r)))
    print("-" * 100)
    cpu = sum(outcome.results[t].get("cpu_seconds", 0.0) for t in outcome.computed)
    print(f"{len(results)} experiment(s) in {wall:.1f} s: {len(outcome.computed)} task(s) computed, "
          f"{len(outcome.cached)} from the cache, {len(outcome.failures)} failed"
          + (f", {len(outcome.missing)} not in the cache (--cached-only)" if outcome.missing
             else "") + f"; CPU time of the computed tasks {cpu:.0f} s")
    payload = {"mode": mode, "scale": args.scale, "device": args.device, "wall_seconds": wall, "task_cpu_seconds": cpu, "workers": where,
               "code_version": code_version(), "experiments": results,
               "tasks": {"computed": len(outcome.computed), "cached": len(outcome.cached),
                         "failed": len(outcome.failures), "missing": len(outcome.missing)}}
    written = write_outputs("reproduce", json_path=args.json,
                            write_json=lambda path: write_json(path, payload),
                            report=args.report,
                            write_report=lambda folder: write_report(folder, payload),
                            recognise=is_report_folder)
    return 1 if outcome.failures or not written else 0
