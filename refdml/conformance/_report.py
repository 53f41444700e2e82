"""What a conformance check found: failures by cause, tolerances, a one-line verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from refdml._io import to_jsonable
from refdml.conformance._tolerance import Tolerance

__all__ = ["CAUSES", "REASON_WIDTH", "ConformanceReport", "ErrorOutcome", "Failure",
           "SearchOutcome", "search_reason", "seed_reason", "short_reason", "with_reason"]

#: Why a case failed, in the order the summary lists them.
CAUSES = ("raised", "structure", "dtype", "non-finite", "missing gradient", "value", "gradient",
          "constraint")

#: What an implementation did with an input the reference refuses.
ERROR_OUTCOMES = ("refused", "raised another type", "returned finite", "returned non-finite",
                  "returned malformed", "not representable")


@dataclass(frozen=True)
class Failure:
    """One way the implementation disagreed with the reference on one input case.

    ``quantity`` is ``"output k"``, ``"grad <input>"``, ``"outputs"`` (their number), an
    invariant's name or ``"call"``; ``index`` is the worst element (the first non-finite
    one for ``cause == "non-finite"``), ``impl_value``/``ref_value`` the two values there,
    ``error`` the norm-wise relative error and ``tolerance`` the bound it broke (NaN where
    the cause has none). ``hint`` is a guess at the reason (``"not converged"``: the value
    agrees far better with the reference stopped at a loose tolerance). ``reason`` is why
    the case exists (the catalogue's :attr:`refdml.catalog.Case.why`, or what a seed or
    search case is), so that a failure can be read without the catalogue's source.
    """

    case: str
    quantity: str
    cause: str
    index: tuple[int, ...] | None
    impl_value: float
    ref_value: float
    error: float
    tolerance: float
    message: str
    hint: str | None = None
    reason: str = ""

    def line(self) -> str:
        """The failure located on one line: case, quantity, cause, worst element and both
        values there, then the message (and the hint); directly under it, indented, why the
        case exists (:func:`short_reason`), where it is known."""
        where = "" if self.index is None else f" at {tuple(self.index)}"
        values = ("" if math.isnan(self.impl_value) and math.isnan(self.ref_value) else
                  f" (implementation {_num(self.impl_value)}, reference "
                  f"{_num(self.ref_value)})")
        hint = f"; hint: {self.hint}" if self.hint else ""
        text = f"{self.case}: {self.quantity}: {self.cause}{where}{values}: {self.message}{hint}"
        if self.reason:
            text += f"\n    why this case: {short_reason(self.reason)}"
        return text


#: The widest a case's reason is shown under a failure; the full text is in the JSON report
#: and in :func:`refdml.conformance.describe`.
REASON_WIDTH = 110


def short_reason(reason: str, width: int = REASON_WIDTH) -> str:
    """``reason`` on one line of at most ``width`` characters: whitespace collapsed, and a
    longer one cut after its last clause (at ``"; "``, ``": "``, ``", "``) or word that
    fits, marked ``...``: the catalogue's reasons say first what makes the case hard."""
    text = " ".join(reason.split())
    if len(text) <= width:
        return text
    room = text[: width - 4]
    for stop in ("; ", ": ", ", ", " "):
        cut = room.rfind(stop)
        if cut >= width // 2:
            return room[:cut].rstrip(";:, ") + " ..."
    return room + " ..."


def seed_reason(k: int) -> str:
    """Why the seed case ``"seed k"`` exists."""
    return (f"ordinary inputs: the entry's make_inputs(default_rng({k})), well-conditioned "
            "and away from kinks, where a wrong formula shows as a plain value or gradient "
            "error")


def search_reason(seed: int, digits: int) -> str:
    """Why the search's minimal case exists."""
    return (f"the hypothesis search's smallest disagreement: make_inputs(default_rng({seed})) "
            f"with its floating inputs rounded to {digits} significant digits (rounding makes "
            "ties, duplicates and exact zeros)")


def with_reason(failures, reason: str) -> list[Failure]:
    """``failures`` with ``reason`` (why their case exists) set on each."""
    return [f if f.reason else Failure(**dict(vars(f), reason=reason)) for f in failures]


@dataclass(frozen=True)
class ErrorOutcome:
    """What the implementation did with one of the entry's error inputs (never a failure:
    frameworks differ in what they refuse). ``outcome`` is one of
    :data:`ERROR_OUTCOMES`; ``"refused"`` (a ``TypeError`` or ``ValueError``) is what the
    reference does."""

    case: str
    outcome: str
    detail: str
    expected: str


@dataclass(frozen=True)
class SearchOutcome:
    """The hypothesis search: ``examples`` draws compared; ``seed``/``digits`` (and the
    inputs they give) of the minimal disagreement, or None when none was found."""

    examples: int
    seed: int | None = None
    digits: int | None = None
    inputs: Mapping[str, Any] | None = None
    failures: tuple[Failure, ...] = ()
    note: str = ""

    @property
    def found(self) -> bool:
        return self.seed is not None


@dataclass(frozen=True)
class ConformanceReport:
    """The result of :func:`refdml.conformance.check_implementation`.

    ``cases`` names every input case compared (``"seed 0"``, the entry's reference
    inputs by name, the search's minimal case), ``skipped`` the cases not compared, with
    why: inputs ``dtype`` cannot hold (beyond its range, or underflowing to 0 entirely), a
    hard case the entry states for another range, or inputs the reference itself refuses, ``tolerances`` the base, conditioning and tolerance of
    each quantity in each case, ``notes`` warnings the implementation raised.
    """

    op: str
    framework: str
    dtype: str
    cases: tuple[str, ...]
    failures: tuple[Failure, ...]
    error_outcomes: tuple[ErrorOutcome, ...] = ()
    tolerances: tuple[Tolerance, ...] = ()
    search: SearchOutcome | None = None
    skipped: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """No failure, on at least one compared case: a check that compared nothing (the
        reference refused every input) cannot pass."""
        return bool(self.cases) and not self.failures

    def failures_by_cause(self) -> dict[str, list[Failure]]:
        """The failures grouped by cause, causes in the order of :data:`CAUSES`."""
        grouped: dict[str, list[Failure]] = {}
        for cause in CAUSES + tuple(sorted({f.cause for f in self.failures} - set(CAUSES))):
            members = [f for f in self.failures if f.cause == cause]
            if members:
                grouped[cause] = members
        return grouped

    def verdict(self) -> str:
        """One line: PASS or FAIL, the operator, framework and dtype, and the counts."""
        head = f"{self.op} ({self.framework}, {self.dtype})"
        n_cases = len(self.cases)
        if self.passed:
            text = f"PASS {head}: {n_cases} case{'s' if n_cases != 1 else ''} agree"
        elif not self.failures:
            text = (f"FAIL {head}: no case compared (the reference refused all "
                    f"{len(self.skipped)})")
        else:
            failing = len({f.case for f in self.failures})
            causes = ", ".join(f"{cause} x{len(members)}"
                               for cause, members in self.failures_by_cause().items())
            text = (f"FAIL {head}: {len(self.failures)} failure"
                    f"{'s' if len(self.failures) != 1 else ''} in {failing} of {n_cases} "
                    f"cases: {causes}")
        if self.error_outcomes:
            refused = sum(o.outcome == "refused" for o in self.error_outcomes)
            text += f"; refused {refused} of {len(self.error_outcomes)} error inputs"
        return text

    def summary(self) -> str:
        """A readable report: failures grouped by cause (case, quantity, index, both
        values, error, tolerance), the tolerances used, the error inputs, the search; the
        last line is :meth:`verdict`."""
        lines = [f"conformance of {self.op} ({self.framework}, {self.dtype}): "
                 f"{len(self.cases)} cases: {'; '.join(self.cases)}"]
        for cause, members in self.failures_by_cause().items():
            lines.append("")
            lines.append(f"{cause} ({len(members)}):")
            lines.append(f"  {'case':<22} {'quantity':<18} {'index':<12} {'impl':>13} "
                         f"{'reference':>13} {'error':>10} {'tolerance':>10}")
            for f in members:
                index = "" if f.index is None else str(tuple(f.index))
                lines.append(f"  {_cut(f.case, 22):<22} {_cut(f.quantity, 18):<18} "
                             f"{_cut(index, 12):<12} {_num(f.impl_value):>13} "
                             f"{_num(f.ref_value):>13} {_num(f.error, 3):>10} "
                             f"{_num(f.tolerance, 3):>10}")
                lines.append(f"      {f.message}")
                if f.hint:
                    lines.append(f"      hint: {f.hint}")
                if f.reason:
                    lines.append(f"      why this case: {short_reason(f.reason)}")
        if self.tolerances:
            lines.append("")
            lines.append("tolerances (rtol = max(base, 16 eps_dtype kappa), kappa the measured "
                         "conditioning; the case with the largest kappa still resolved):")
            for quantity, (base, kappa, rtol, case) in self._tolerance_table().items():
                lines.append(f"  {quantity:<22} base {_num(base, 3):>9}  kappa "
                             f"{_num(kappa, 3):>9}  rtol {_num(rtol, 3):>9}"
                             + (f"  ({case})" if kappa > 1.0 else ""))
        beyond = [t for t in self.tolerances if t.beyond_dtype]
        if beyond:
            lines.append("")
            lines.append(f"beyond {self.dtype} (the computation amplifies its roundoff past "
                         "the size of the result: the entry's roundoff hint times 16 eps_dtype "
                         "exceeds 1; checked for shape and finiteness only):")
            for case in dict.fromkeys(t.case for t in beyond):
                lines.append(f"  {case}: " + ", ".join(t.quantity for t in beyond
                                                       if t.case == case))
        jumping = [t for t in self.tolerances if t.jumping or math.isinf(t.kappa)]
        if jumping:
            lines.append("")
            lines.append("not compared (the reference jumps there under any move of the "
                         "inputs: a kink or a tie; checked for shape and finiteness only):")
            lines.extend(f"  {t.case}: {t.quantity}, "
                         + (f"{t.jumping} element{'s' if t.jumping != 1 else ''}"
                            if not math.isinf(t.kappa) else "all of it")
                         for t in jumping)
        absolute = [t for t in self.tolerances if not t.resolved and not math.isinf(t.kappa)
                    and not t.beyond_dtype]
        if absolute:
            lines.append("")
            lines.append("held to an absolute floor only (too ill-conditioned for a relative "
                         "error, as a quantity that is zero by cancellation; the floor is the "
                         "reference's rounding noise or the base tolerance times the terms "
                         "that cancel):")
            lines.extend(f"  {t.case}: {t.quantity}, |error| <= atol {_num(t.atol, 3)} "
                         f"(kappa {_num(t.kappa, 3)})" for t in absolute)
        if self.skipped:
            lines.append("")
            lines.append(f"skipped (not representable in {self.dtype}, stated for another "
                         "range, or refused by the reference):")
            lines.extend(f"  {name}: {why}" for name, why in self.skipped)
        if self.error_outcomes:
            lines.append("")
            lines.append("error inputs (reported, not failed):")
            width = max(len(o.case) for o in self.error_outcomes)
            lines.extend(f"  {o.case:<{width}}  {o.outcome:<20} {o.detail}"
                         for o in self.error_outcomes)
        if self.search is not None:
            lines.append("")
            if self.search.found:
                lines.append(f"search: {self.search.examples} draws; minimal disagreement "
                             f"at seed={self.search.seed}, digits={self.search.digits}")
            else:
                lines.append(f"search: {self.search.examples} draws, no disagreement"
                             + (f" ({self.search.note})" if self.search.note else ""))
        if self.notes:
            lines.append("")
            lines.append("notes:")
            lines.extend(f"  {note}" for note in self.notes)
        lines.append("")
        lines.append(self.verdict())
        return "\n".join(lines)

    def _tolerance_table(self) -> dict[str, tuple[float, float, float, str]]:
        """Per quantity: base, and the largest kappa and rtol with the case they come from."""
        table: dict[str, tuple[float, float, float, str]] = {}
        for t in self.tolerances:
            if not t.resolved:
                continue
            if t.quantity not in table or t.kappa > table[t.quantity][1]:
                table[t.quantity] = (t.base, t.kappa, t.rtol, t.case)
        return table

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able data: numbers as floats, NaN and inf as strings."""
        return to_jsonable({
            "op": self.op,
            "framework": self.framework,
            "dtype": self.dtype,
            "passed": self.passed,
            "verdict": self.verdict(),
            "cases": list(self.cases),
            "failures": [vars(f) for f in self.failures],
            "error_outcomes": [vars(o) for o in self.error_outcomes],
            "tolerances": [dict(vars(t), resolved=t.resolved, beyond_dtype=t.beyond_dtype)
                           for t in self.tolerances],
            "search": None if self.search is None else {
                "examples": self.search.examples, "found": self.search.found,
                "seed": self.search.seed, "digits": self.search.digits,
                "inputs": self.search.inputs, "note": self.search.note,
                "failures": [vars(f) for f in self.search.failures],
            },
            "skipped": [{"case": name, "why": why} for name, why in self.skipped],
            "notes": list(self.notes),
        })


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _num(value: float | None, digits: int = 6) -> str:
    if value is None:
        return ""
    return f"{value:.{digits}g}"
