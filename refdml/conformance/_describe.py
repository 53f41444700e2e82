"""What a conformance check of one operator calls, compares and allows: ``describe(op)``.

Everything here is read from the catalogue entry and the code that runs the check, never
restated: the keyword arguments are those the check passes (``make_inputs`` and the hard
cases), their meanings come from the reference forward's docstring
(:func:`refdml.catalog.OperatorSpec.parameter_docs`), the shapes from ``make_inputs``, the
outputs from one run of the reference, the cases (and the dtypes each runs in) from the
plan a check makes, and the tolerances from :mod:`refdml.conformance._tolerance`.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.catalog import OperatorSpec
from refdml.catalog._spec import DEFAULT_MIRROR_RTOL, _callable_name
from refdml.conformance._check import _not_admitted, get_spec, plan_cases
from refdml.conformance._formats import DTYPES, FORMATS
from refdml.conformance._report import seed_reason
from refdml.conformance._tolerance import (
    ROUNDOFF_UNITS,
    base_tolerance,
    is_floating_array,
    resolution_limit,
)

__all__ = ["CaseInfo", "OperatorDescription", "Parameter", "describe"]

#: The width the description is wrapped to.
WIDTH = 92
#: A parameter's meaning is shown up to this many characters (about three lines).
MEANING_CHARS = 260


@dataclass(frozen=True)
class Parameter:
    """One keyword argument the check passes: ``value`` what it passes on the first seed
    (``"float array (6, 4)"``, ``"0.5"``), ``default`` the reference forward's (None:
    required, or not in its signature), ``meaning`` from the forward's docstring."""

    name: str
    value: str
    meaning: str
    default: str | None = None
    differentiated: bool = False


@dataclass(frozen=True)
class CaseInfo:
    """One input case: its name, why it exists, the dtypes it is compared in (``runs``),
    and why not in a dtype the entry states it for (``skipped``: its inputs beyond the
    dtype's range, say); a dtype of another range is simply not in ``runs``."""

    name: str
    why: str
    runs: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class OperatorDescription:
    """What :func:`describe` returns; ``str()`` is the readable text, :meth:`to_dict` the
    same as data."""

    op: str
    paper: str
    forward: str
    parameters: tuple[Parameter, ...]
    other_parameters: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    gradients: tuple[str, ...]
    cases: tuple[CaseInfo, ...]
    tolerances: tuple[tuple[str, float, float, str], ...]
    tolerance_notes: tuple[str, ...]
    error_cases: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        return self.text()

    def text(self, width: int = WIDTH) -> str:
        out = [f"{self.op}: {self.paper}", f"reference forward: {self.forward}", ""]
        out.append("keyword arguments (what the check passes the implementation, on seed 0):")
        for p in self.parameters:
            head = f"  {p.name}: {p.value}"
            notes = []
            if p.differentiated:
                notes.append("differentiated")
            if p.default is not None:
                notes.append(f"the reference's default {p.default}")
            if notes:
                head += f" ({'; '.join(notes)})"
            out.append(head)
            out.extend(_wrap(_cut(p.meaning or "(not documented)", MEANING_CHARS), width, 6))
        if self.other_parameters:
            out.append("other keyword arguments of the reference (never passed: an "
                       "implementation need not take them):")
            out.extend(f"  {name} = {default}" for name, default in self.other_parameters)
        out.append("")
        out.append("outputs (the failures' 'output k'):")
        out.extend(f"  output {k}: {o}" for k, o in enumerate(self.outputs))
        out.append("gradients compared (the failures' 'grad NAME'): "
                   + (", ".join(self.gradients) or "none"))
        out.append("")
        out.append("cases (compared in " + ", ".join(DTYPES) + " unless said otherwise):")
        for case in self.cases:
            where = ""
            if case.runs != DTYPES:
                where = f"  [in {', '.join(case.runs) or 'no dtype'}]"
            out.append(f"  {case.name}{where}")
            out.extend(_wrap(case.why, width, 6))
            for dtype, why in case.skipped:
                out.extend(_wrap(f"not in {dtype}: {why}", width, 6, "- "))
        out.append("")
        out.extend(_wrap(f"tolerances: per quantity and case, rtol = max(base, "
                         f"{ROUNDOFF_UNITS:g} eps_dtype kappa), kappa its measured "
                         "conditioning; a quantity whose rtol exceeds the limit is checked "
                         "for shape and finiteness only:", width, 0))
        out.append(f"  {'dtype':<9} {'base':>9} {'eps_dtype':>10} {'limit':>6}")
        for dtype, base, limit, why in self.tolerances:
            out.append(f"  {dtype:<9} {base:>9.3g} {FORMATS[dtype].eps:>10.3g} {limit:>6.3g}"
                       f"  {why}")
        out.extend(line for note in self.tolerance_notes for line in _wrap(note, width, 2))
        if self.error_cases:
            out.append("")
            out.append("error inputs (the reference refuses them; an implementation's answer "
                       "is reported, never failed):")
            w = max(len(name) for name, _ in self.error_cases)
            out.extend(f"  {name:<{w}}  {expected}" for name, expected in self.error_cases)
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op, "paper": self.paper, "forward": self.forward,
            "parameters": [vars(p) for p in self.parameters],
            "other_parameters": [{"name": n, "default": d} for n, d in self.other_parameters],
            "outputs": list(self.outputs), "gradients": list(self.gradients),
            "cases": [{"name": c.name, "why": c.why, "runs": list(c.runs),
                       "skipped": dict(c.skipped)} for c in self.cases],
            "tolerances": [{"dtype": d, "base": b, "limit": lim, "why": why}
                           for d, b, lim, why in self.tolerances],
            "tolerance_notes": list(self.tolerance_notes),
            "error_cases": [{"name": n, "expected": e} for n, e in self.error_cases],
        }


def _cut(text: str, chars: int) -> str:
    text = " ".join(text.split())
    if len(text) <= chars:
        return text
    return text[: text.rfind(" ", 0, chars - 4)] + " ..."


def _wrap(text: str, width: int, indent: int, first: str = "") -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False,
                         initial_indent=" " * indent + first,
                         subsequent_indent=" " * (indent + len(first)))


def _value(value: Any) -> str:
    if isinstance(value, np.ndarray):
        kind = ("floating (cast to the dtype under test)" if is_floating_array(value)
                else str(value.dtype))
        return f"{kind} array, shape {value.shape}"
    if isinstance(value, Mapping):
        return f"mapping {dict(value)!r}"
    return f"{type(value).__name__} {value!r}"


def describe(op: str) -> OperatorDescription:
    """What ``refdml conform --op OP`` (and :func:`check_implementation`) calls, compares
    and allows for the catalogue entry ``op``: the keyword arguments passed to the
    implementation (with their meaning, what is passed, the reference's defaults), its
    outputs and the gradients compared, every input case with why it exists and the
    dtypes it runs in, the tolerance of each dtype, and the error inputs.
    ``print(describe("gsp.pool"))`` reads it; ``.to_dict()`` gives it as data. An unknown
    ``op`` is a ``ValueError`` naming the catalogue's operators."""
    spec: OperatorSpec = get_spec(op)
    seed_inputs = dict(spec.make_inputs(np.random.default_rng(0)))
    hard = tuple(spec.reference_inputs(np.random.default_rng(0))
                 if spec.reference_inputs is not None else ())
    passed = list(seed_inputs)
    for case in hard:
        passed += [name for name in case.inputs if name not in passed]
    meanings = spec.parameter_docs()
    signature = _signature(spec.forward)
    wrt = tuple(spec.wrt) if spec.wrt is not None else tuple(
        name for name, value in seed_inputs.items() if is_floating_array(value))
    parameters = []
    for name in passed:
        value = seed_inputs.get(name)
        shown = _value(value) if name in seed_inputs else "only in some hard cases"
        default = signature.get(name)
        parameters.append(Parameter(name, shown, meanings.get(name, ""),
                                    None if default is None else repr(default), name in wrt))
    others = tuple((name, repr(default)) for name, default in signature.items()
                   if name not in passed and default is not None)

    outputs, _ = spec.forward(**seed_inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    shown_outputs = tuple(
        f"array, shape {np.shape(o)}" if np.ndim(o) else "scalar" for o in outputs)

    cases = _cases(spec)
    tolerances, notes = _tolerances(spec)
    errors = ()
    if spec.error_inputs is not None:
        errors = tuple((c.name, f"{c.error.__name__} matching {c.match!r}")
                       for c in spec.error_inputs(np.random.default_rng(0)))
    return OperatorDescription(spec.name, spec.paper, _callable_name(spec.forward),
                               tuple(parameters), others, shown_outputs, wrt, cases,
                               tolerances, notes, errors)


def _signature(forward: Any) -> dict[str, Any]:
    """The reference forward's keyword parameters: name -> default (None: required)."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: (None if p.default is inspect.Parameter.empty else p.default)
            for p in parameters
            if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)}


def _cases(spec: OperatorSpec) -> tuple[CaseInfo, ...]:
    """The seed cases (one line for all) and every hard case, with the dtypes it runs in:
    the plan a check makes in each dtype (one seed shown: the others are alike)."""
    plans = {dtype: plan_cases(spec, dtype, 1, True, np.random.default_rng(0))
             for dtype in DTYPES}
    cases = [CaseInfo("seed 0, seed 1, ... (--seeds, default 3)",
                      seed_reason(0).replace("default_rng(0)", "default_rng(k)"), DTYPES)]
    stated = ({case.name: case.dtypes for case in spec.reference_inputs(np.random.default_rng(0))}
              if spec.reference_inputs is not None else {})
    for k, planned in enumerate(plans[DTYPES[0]][1:], start=1):
        runs = tuple(d for d in DTYPES if plans[d][k].skip is None)
        skipped = tuple((d, plans[d][k].skip) for d in DTYPES if plans[d][k].skip is not None
                        and _not_admitted(stated.get(planned.name), d) is None)
        cases.append(CaseInfo(planned.name, planned.why, runs, skipped))
    return tuple(cases)


def _tolerances(spec: OperatorSpec) -> tuple[tuple, tuple[str, ...]]:
    rows, notes = [], []
    for dtype in DTYPES:
        base = base_tolerance(spec, dtype)
        if dtype in ("float64", "float32"):
            default = DEFAULT_MIRROR_RTOL[dtype]
            why = "refdml's fast path's (mirror_rtol)"
            if base != default:
                why += f", widened from the default {default:g} by the entry"
        else:
            why = f"{ROUNDOFF_UNITS:g} eps_dtype (no mirror runs in {dtype})"
        rows.append((dtype, base, resolution_limit(dtype), why))
    if spec.roundoff is not None:
        notes.append("The base grows, case by case, with how much more a case amplifies "
                     "roundoff than make_inputs does (the entry's roundoff hint: an "
                     "iterative solve at a smaller eps, say).")
    return tuple(rows), tuple(notes)
