"""Run the registered checks, with the self-checks of the operators they rely on."""

from __future__ import annotations

import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from refdml._io import write_json_atomic

from ._framework import CHECKS, ClaimResult, ClaimSpec, Context, decide

__all__ = [
    "check_output_paths",
    "exit_status",
    "list_claims",
    "run_checks",
    "run_cli",
    "select",
    "summary_line",
]

_VERDICT_WIDTH = 29


def _self_checks(prefixes: tuple[str, ...], ctx: Context, cache: dict) -> list[dict]:
    """Gradient checks of the registered operators whose names start with a prefix."""
    if not prefixes:
        return []
    try:
        from refdml.gradcheck.catalog import all_operators

        specs = [s for s in all_operators() if s.name.startswith(prefixes)]
    except Exception as exc:  # an operator module that does not import is our own failure
        return [{"name": "refdml operator catalogue", "passed": False, "error": repr(exc)}]
    if not specs:
        return [{"name": f"{', '.join(prefixes)}*", "passed": None,
                 "note": "no registered operator with this prefix (nothing to self-check)"}]
    seeds = (ctx.seed,) if ctx.quick else (ctx.seed, ctx.seed + 1)
    rows = []
    for spec in specs:
        for seed in seeds:
            key = (spec.name, seed)
            if key not in cache:
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("error", RuntimeWarning)
                        result = spec.check(seed)
                    cache[key] = {
                        "name": spec.name, "seed": seed, "rtol": spec.rtol,
                        "max_rel_error": result.max_rel_error,
                        "passed": bool(result.passed(spec.rtol, spec.atol)),
                    }
                except Exception as exc:
                    cache[key] = {"name": spec.name, "seed": seed, "rtol": spec.rtol,
                                  "passed": False, "error": repr(exc)}
            rows.append(cache[key])
    return rows


def _run_one(spec: ClaimSpec, ctx: Context, cache: dict) -> ClaimResult:
    start = time.perf_counter()
    base = dict(id=spec.id, paper=spec.paper, statement=spec.statement, hypotheses=spec.hypotheses)
    self_checks = _self_checks(spec.operators, ctx, cache)
    failed = any(row["passed"] is False for row in self_checks)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # A numpy overflow or 0/0 inside a check is a bug of the check: let it crash.
            warnings.simplefilter("error", RuntimeWarning)
            finding = spec.function(ctx)
        verdict, carrier = decide(finding.readings, finding.inconclusive)
    except Exception as exc:
        return ClaimResult(
            **base, verdict="crashed", error=None, tolerance=None, counterexample=None,
            correction=None, extra_hypothesis=None, key_number=f"crashed: {exc!r}"[:120],
            self_checks=tuple(self_checks), self_check_failed=failed, crashed=True,
            crash=traceback.format_exc(), runtime_s=time.perf_counter() - start,
        )
    printed = next(r for r in finding.readings if r.kind == "printed")
    details = dict(finding.details)
    if caught:
        details["warnings"] = sorted({f"{w.category.__name__}: {w.message}" for w in caught})
    return ClaimResult(
        **base,
        verdict=verdict.value,
        error=float(carrier.error),
        tolerance=float(carrier.tolerance),
        counterexample=printed.counterexample,
        correction=carrier.statement if carrier.kind == "correction" else None,
        extra_hypothesis=carrier.statement if carrier.kind == "extra-hypothesis" else None,
        key_number=finding.key_number,
        printed_error=float(printed.error),
        probe_counterexample=finding.probe,
        readings=tuple(
            {"kind": r.kind, "statement": r.statement, "error": float(r.error),
             "tolerance": float(r.tolerance), "passed": r.passed,
             "counterexample": r.counterexample, "trials": r.trials}
            for r in finding.readings
        ),
        sizes=tuple(finding.sizes),
        seeds=tuple(finding.seeds),
        details=details,
        figures=tuple(finding.figures),
        self_checks=tuple(self_checks),
        self_check_failed=failed,
        inconclusive_reason=finding.inconclusive,
        runtime_s=time.perf_counter() - start,
    )


def summary_line(result: ClaimResult) -> str:
    flag = "  [self-check FAILED]" if result.self_check_failed else ""
    return (f"{result.id:<28}{result.verdict:<{_VERDICT_WIDTH}}{result.runtime_s:>7.1f} s  "
            f"{result.key_number}{flag}")


def select(names: Iterable[str], patterns: Iterable[str]) -> tuple[list[str], list[str]]:
    """The names matched by ``patterns``, in the order of ``names``, and the patterns matching none.

    A pattern that is a name selects that name only; otherwise it is a prefix
    (``gsp`` or ``gsp.fig9`` for claims, ``losses`` for operators).
    """
    names = list(names)
    chosen: set[str] = set()
    unmatched = []
    for pattern in patterns:
        hits = [pattern] if pattern in names else [n for n in names if n.startswith(pattern)]
        if not hits:
            unmatched.append(pattern)
        chosen.update(hits)
    return [n for n in names if n in chosen], unmatched


def list_claims() -> list[str]:
    """One line per registered claim: id, paper, and the statement cut to one line."""
    from . import _load_claims

    _load_claims()
    width = max(len(i) for i in CHECKS) + 2
    lines = []
    for spec in CHECKS.values():
        text = f"{spec.paper}: {spec.statement}"
        lines.append(f"{spec.id:<{width}}{text if len(text) <= 110 else text[:107] + '...'}")
    return lines


def check_output_paths(report: str | None, json_path: str | None) -> str | None:
    """Make the report folder and check both outputs can be written; the problem, or None.

    Run before any check, so a bad path costs nothing instead of a minute of work.
    """
    if report is not None:
        directory = Path(report)
        if directory.exists() and not directory.is_dir():
            return f"--report {report}: is a file, not a folder"
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"--report {report}: cannot create the folder ({exc.strerror or exc})"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"--report {report}: the folder is not writable"
    if json_path is not None:
        path = Path(json_path)
        if path.is_dir():
            return f"--json {json_path}: is a folder, not a file"
        parent = path.parent
        existing = next((p for p in (parent, *parent.parents) if p.exists()), Path("."))
        if not existing.is_dir():
            return f"--json {json_path}: {existing} is a file, not a folder"
        if not os.access(existing, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return f"--json {json_path}: not writable"
    return None


def run_checks(
    ids: Iterable[str] | None = None,
    *,
    quick: bool = False,
    seed: int = 0,
    echo: Callable[[str], None] | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[ClaimResult]:
    """Run the checks of ``ids`` (default: all, in registration order).

    ``echo`` receives the summary line of each finished claim; ``progress(i, total, id)``
    is called before claim ``i`` (0-based) starts.
    """
    from . import _load_claims

    _load_claims()
    ids = list(CHECKS) if ids is None else list(ids)
    unknown = [i for i in ids if i not in CHECKS]
    if unknown:
        raise ValueError(f"unknown claim id(s): {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed == {seed!r}, must be a non-negative integer")
    ctx = Context(quick=quick, seed=seed)
    cache: dict = {}
    results = []
    for i, claim_id in enumerate(ids):
        if progress is not None:
            progress(i, len(ids), claim_id)
        result = _run_one(CHECKS[claim_id], ctx, cache)
        results.append(result)
        if echo is not None:
            echo(summary_line(result))
    return results


class _Progress:
    """Which claim is running and for how long: a tqdm bar on a terminal, else one line per claim.

    Both go to stderr, so stdout keeps only the table (and can be piped).
    """

    def __init__(self, total: int):
        self.start = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, file=sys.stderr, unit="claim", leave=False,
                            bar_format="{n_fmt}/{total_fmt} claims [{elapsed}] {desc}")

    def before(self, i: int, total: int, claim_id: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"running {claim_id}")
        else:
            elapsed = time.perf_counter() - self.start
            print(f"[{i + 1:>2}/{total}] {elapsed:6.1f} s  running {claim_id}", file=sys.stderr, flush=True)

    def echo(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stdout)
            self.bar.update(1)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def exit_status(results: list[ClaimResult]) -> int:
    """0 when every check ran and every self-check passed, whatever the verdicts."""
    return 1 if any(r.crashed or r.self_check_failed for r in results) else 0


def run_cli(args) -> int:
    """Entry point of ``refdml verify`` (arguments parsed by :mod:`refdml.cli`).

    Returns the exit status: 0, 1 (a check crashed or a self-check failed) or 2 (bad
    arguments: an ``--only`` pattern matching no claim, an output path that cannot be written).
    """
    from . import _load_claims

    if getattr(args, "list", False):
        print("\n".join(list_claims()))
        return 0
    _load_claims()
    ids = None
    if args.only:
        ids, unmatched = select(CHECKS, args.only)
        if unmatched:
            print(f"refdml verify: error: --only {' '.join(unmatched)} matches no claim id "
                  f"(a full id or a prefix such as 'gsp' or 'gsp.fig9'); the ids are:", file=sys.stderr)
            print("\n".join(f"  {i}" for i in CHECKS), file=sys.stderr)
            return 2
    problem = check_output_paths(args.report, args.json)
    if problem is not None:
        print(f"refdml verify: error: {problem}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    mode = "quick" if args.quick else "default"
    print(f"refdml verify ({mode} mode, seed {args.seed})")
    print(f"{'claim':<28}{'verdict':<{_VERDICT_WIDTH}}{'time':>9}  key number")
    print("-" * 100)
    progress = _Progress(len(ids) if ids is not None else len(CHECKS))
    try:
        results = run_checks(ids, quick=args.quick, seed=args.seed, echo=progress.echo, progress=progress.before)
    finally:
        progress.close()
    elapsed = time.perf_counter() - start
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    print("-" * 100)
    print(f"{len(results)} claims in {elapsed:.1f} s: "
          + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    bad_self = [r.id for r in results if r.self_check_failed]
    crashed = [r.id for r in results if r.crashed]
    if crashed:
        print(f"CRASHED: {', '.join(crashed)}")
    if bad_self:
        print(f"SELF-CHECK FAILED (a gradient check of refdml's own code): {', '.join(bad_self)}")
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, [r.as_json() for r in results], indent=2)
        print(f"JSON written to {path}")
    if args.report:
        from ._report import write_report

        report = write_report(results, args.report, quick=args.quick, seed=args.seed, runtime_s=elapsed)
        print(f"report written to {report}")
    return exit_status(results)
