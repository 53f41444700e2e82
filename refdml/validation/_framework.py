"""The machinery of a claim check: verdicts, readings, results, the claim list, the search.

A check is a function ``(ctx) -> Finding`` registered with :func:`claim`. It computes,
for the claim as printed and for each plausible correction or added hypothesis, a
:class:`Reading`: the largest error it measured, the tolerance that error is held to, and
the smallest counterexample a search found. :func:`decide` turns the readings into the
verdict, so no verdict is ever written by hand: change the mathematics and the numbers,
hence the verdict, change with it.
"""

from __future__ import annotations

import contextlib
import enum
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refdml._io import to_jsonable

__all__ = [
    "CHECKS",
    "ClaimResult",
    "ClaimSpec",
    "Context",
    "Figure",
    "Finding",
    "Reading",
    "Series",
    "VERDICT_MEANINGS",
    "Verdict",
    "claim",
    "decide",
    "find_counterexample",
    "series",
    "to_jsonable",
]


class Verdict(str, enum.Enum):
    HOLDS = "holds"
    HOLDS_WITH_CORRECTION = "holds-with-correction"
    HOLDS_UNDER_EXTRA_HYPOTHESIS = "holds-under-extra-hypothesis"
    FAILS = "fails"
    INCONCLUSIVE = "inconclusive"


#: One line per verdict, for ``refdml verify --help`` and the report (the rule is :func:`decide`).
VERDICT_MEANINGS = {
    Verdict.HOLDS: "the claim as printed passed every check inside its hypotheses",
    Verdict.HOLDS_WITH_CORRECTION: "the printed form fails; a corrected statement (given) passes",
    Verdict.HOLDS_UNDER_EXTRA_HYPOTHESIS: "the printed form fails; it passes under an added hypothesis (given)",
    Verdict.FAILS: "the printed form is refuted (counterexample or error above tolerance) and no repair passed",
    Verdict.INCONCLUSIVE: "the numbers cannot decide (e.g. the claim depends on data we cannot reproduce)",
}

PRINTED = "printed"
CORRECTION = "correction"
EXTRA_HYPOTHESIS = "extra-hypothesis"
_KINDS = (PRINTED, CORRECTION, EXTRA_HYPOTHESIS)


@dataclass(frozen=True)
class Reading:
    """One reading of a claim and how the numbers treated it.

    ``kind`` is ``"printed"`` (the claim as printed, inside its hypotheses),
    ``"correction"`` (a corrected statement) or ``"extra-hypothesis"`` (the printed
    statement under an added hypothesis). It passes when no counterexample was found
    and ``error <= tolerance`` (a NaN error never passes).
    """

    kind: str
    statement: str
    error: float
    tolerance: float
    counterexample: Any = None
    trials: int = 0

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"kind == {self.kind!r}, must be one of {_KINDS}")

    @property
    def passed(self) -> bool:
        error = float(self.error)
        return self.counterexample is None and not math.isnan(error) and error <= self.tolerance


@dataclass(frozen=True)
class Series:
    """One curve of a figure; ``style="points"`` draws markers only (a counterexample, a sample)."""

    label: str
    x: tuple[float, ...]
    y: tuple[float, ...]
    style: str = "line"


@dataclass(frozen=True)
class Figure:
    """Data of one figure of the report; drawn only when matplotlib is available.

    One figure shows one data set. ``thresholds`` are labelled horizontal lines (the
    tolerance a plotted ratio is held to, a bound); the report's title adds the paper and
    the claim id.
    """

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: tuple[Series, ...]
    xscale: str = "linear"
    yscale: str = "linear"
    thresholds: tuple[tuple[str, float], ...] = ()


def series(label: str, x, y, *, style: str = "line") -> Series:
    if style not in ("line", "points"):
        raise ValueError(f"style == {style!r}, must be 'line' or 'points'")
    return Series(label, tuple(float(v) for v in x), tuple(float(v) for v in y), style)


@dataclass(frozen=True)
class Finding:
    """What a check returns: its readings and the evidence behind them.

    ``inconclusive`` names why the numbers cannot decide (then the verdict is
    ``inconclusive`` whatever the readings say).
    """

    readings: tuple[Reading, ...]
    key_number: str
    sizes: tuple = ()
    seeds: tuple = ()
    details: dict = field(default_factory=dict)
    figures: tuple[Figure, ...] = ()
    probe: Any = None  # counterexample found just outside the hypotheses, if any
    inconclusive: str | None = None


def decide(readings: Sequence[Reading], inconclusive: str | None = None) -> tuple[Verdict, Reading]:
    """The verdict, and the reading that carries it.

    ``holds`` if the printed reading passes; else ``holds-with-correction`` for the first
    passing correction; else ``holds-under-extra-hypothesis`` for the first passing
    extra hypothesis; else ``fails`` when the printed reading was refuted (a
    counterexample, or a finite error above its tolerance), ``inconclusive`` otherwise.
    """
    printed = [r for r in readings if r.kind == PRINTED]
    if len(printed) != 1:
        raise ValueError(f"a finding needs exactly one printed reading, got {len(printed)}")
    printed = printed[0]
    if inconclusive is not None:
        return Verdict.INCONCLUSIVE, printed
    if printed.passed:
        return Verdict.HOLDS, printed
    for kind, verdict in (
        (CORRECTION, Verdict.HOLDS_WITH_CORRECTION),
        (EXTRA_HYPOTHESIS, Verdict.HOLDS_UNDER_EXTRA_HYPOTHESIS),
    ):
        for reading in readings:
            if reading.kind == kind and reading.passed:
                return verdict, reading
    refuted = printed.counterexample is not None or (
        not math.isnan(float(printed.error)) and printed.error > printed.tolerance
    )
    return (Verdict.FAILS if refuted else Verdict.INCONCLUSIVE), printed


@dataclass(frozen=True)
class Context:
    """What every check receives: the run mode and the base seed."""

    quick: bool = False
    seed: int = 0

    def rng(self, salt: str) -> np.random.Generator:
        """A generator that depends on the base seed and ``salt`` only (not on run order)."""
        return np.random.default_rng([self.seed, zlib.crc32(salt.encode())])

    def pick(self, quick, full):
        """``quick`` in ``--quick`` mode, else ``full``."""
        return quick if self.quick else full

    def search(self, strategy, violates: Callable[[Any], bool], *, max_examples: int):
        """Smallest example of ``strategy`` for which ``violates`` is true, or None.

        In quick mode the example is not shrunk (shrinking re-runs ``violates`` on many
        smaller examples); it is still a counterexample, just not the smallest one.
        """
        return find_counterexample(strategy, violates, max_examples=max_examples, shrink=not self.quick)


@contextlib.contextmanager
def _without_local_constants() -> Iterator[None]:
    """Hypothesis (6.131 and later) also draws, now and then, literals it finds in the
    source of every *local* module the process has loaded (anything outside site-packages
    and the standard library). A search's draws then depended on which refdml modules
    happened to be imported (``refdml verify`` found other counterexamples once its command
    line imported the training layers) and on whether refdml is installed from a wheel or
    as source. For the search, that pool is pinned empty; Hypothesis's own constants stay.
    A Hypothesis without the pool (older) or with another layout runs unchanged: the
    search is then as deterministic as that version makes it.
    """
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None or not hasattr(cache, "cache"):
        yield
        return
    empty = Constants()
    cache.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()


def find_counterexample(
    strategy, violates: Callable[[Any], bool], *, max_examples: int, shrink: bool = True
):
    """Deterministic hypothesis search for an example with ``violates(example)`` true.

    Returns the example (shrunk unless ``shrink=False``), or None when ``max_examples``
    draws found none. The search is derandomised, keeps no database and draws no
    constants from the source of loaded modules (:func:`_without_local_constants`), so
    every run sees the same draws, whatever else the process has imported.
    """
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    config = settings(
        phases=phases,
        database=None,
        derandomize=True,
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    try:
        with _without_local_constants():
            return find(strategy, violates, settings=config)
    except (NoSuchExample, Unsatisfiable):
        return None


@dataclass(frozen=True)
class ClaimSpec:
    id: str
    paper: str
    statement: str
    hypotheses: str
    operators: tuple[str, ...]
    function: Callable[[Context], Finding]


CHECKS: dict[str, ClaimSpec] = {}


def claim(id: str, *, paper: str, statement: str, hypotheses: str, operators: Sequence[str] = ()):
    """Register ``function(ctx) -> Finding`` as the check of claim ``id``.

    ``operators`` are prefixes of names in :mod:`refdml.catalog` whose
    gradient checks the claim relies on; the runner runs them as self-checks.
    """

    def register(function: Callable[[Context], Finding]) -> Callable[[Context], Finding]:
        if id in CHECKS:
            raise ValueError(f"claim {id!r} is registered twice")
        CHECKS[id] = ClaimSpec(id, paper, statement, hypotheses, tuple(operators), function)
        return function

    return register


@dataclass(frozen=True)
class ClaimResult:
    """Everything the report and the JSON say about one claim."""

    id: str
    verdict: str  # a Verdict value, or "crashed"
    paper: str
    statement: str
    hypotheses: str
    error: float | None
    tolerance: float | None
    counterexample: Any
    correction: str | None
    extra_hypothesis: str | None
    key_number: str
    printed_error: float | None = None
    probe_counterexample: Any = None
    readings: tuple[dict, ...] = ()
    sizes: tuple = ()
    seeds: tuple = ()
    details: dict = field(default_factory=dict)
    figures: tuple[Figure, ...] = ()
    self_checks: tuple[dict, ...] = ()
    self_check_failed: bool = False
    crashed: bool = False
    crash: str | None = None
    inconclusive_reason: str | None = None
    runtime_s: float = 0.0

    def as_json(self) -> dict:
        out = {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if name != "figures"
        }
        out["figures"] = [
            {
                "name": f.name,
                "title": f.title,
                "xlabel": f.xlabel,
                "ylabel": f.ylabel,
                "series": [{"label": s.label, "x": list(s.x), "y": list(s.y), "style": s.style} for s in f.series],
                "thresholds": [{"label": label, "y": y} for label, y in f.thresholds],
            }
            for f in self.figures
        ]
        return to_jsonable(out)
