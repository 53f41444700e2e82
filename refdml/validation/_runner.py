"""Run the registered checks, with the self-checks of the operators they rely on."""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Callable, Iterable

# Re-exported: refdml.validation's public names since before the subcommand modules.
from refdml._cli_support import check_output_paths, select

from ._claims import load_claims
from ._framework import CHECKS, ClaimResult, ClaimSpec, Context, decide

__all__ = [
    "check_output_paths",
    "exit_status",
    "list_claims",
    "run_checks",
    "select",
    "summary_line",
]

_VERDICT_WIDTH = 29


def _self_checks(prefixes: tuple[str, ...], ctx: Context, cache: dict) -> list[dict]:
    """Gradient checks of the registered operators whose names start with a prefix."""
    if not prefixes:
        return []
    try:
        from refdml.catalog import all_operators

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


def list_claims() -> list[str]:
    """One line per registered claim: id, paper, and the statement cut to one line."""
    load_claims()
    width = max(len(i) for i in CHECKS) + 2
    lines = []
    for spec in CHECKS.values():
        text = f"{spec.paper}: {spec.statement}"
        lines.append(f"{spec.id:<{width}}{text if len(text) <= 110 else text[:107] + '...'}")
    return lines


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
    load_claims()
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


def exit_status(results: list[ClaimResult]) -> int:
    """0 when every check ran and every self-check passed, whatever the verdicts."""
    return 1 if any(r.crashed or r.self_check_failed for r in results) else 0
