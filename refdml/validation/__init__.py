"""Numerical checks of the claims of the four papers (installed as ``refdml.validation``).

Each claim of GSP, XML, ASAP and Wasserstein DML has one check, registered under its id
(``gsp.prop4.3``, ``xml.eq2.7``, ...). A check tests the claim as printed, inside its
hypotheses, with a method independent of the code under test (an LP or generic convex
solver, finite differences, POT, Monte Carlo, brute force), probes just outside the
hypotheses with a shrinking hypothesis search, and tries the plausible corrections
where the printed form fails. The verdict is computed from those numbers by
:func:`decide`; see ``docs/validation.md``.

``refdml verify`` (:func:`run_cli`) runs them; :func:`run_checks` is the library entry.
The searches use ``hypothesis`` and the progress bar ``tqdm`` (both core dependencies);
figures need ``matplotlib`` (the ``plot`` extra).
"""

from __future__ import annotations

from ._claims import CLAIM_MODULES
from ._framework import (
    CHECKS,
    ClaimResult,
    ClaimSpec,
    Context,
    Figure,
    Finding,
    Reading,
    Series,
    VERDICT_MEANINGS,
    Verdict,
    claim,
    decide,
    find_counterexample,
)
from ._cli import run as run_cli
from ._runner import check_output_paths, exit_status, list_claims, run_checks, select

__all__ = [
    "CHECKS",
    "CLAIM_MODULES",
    "ClaimResult",
    "ClaimSpec",
    "Context",
    "Figure",
    "Finding",
    "Reading",
    "Series",
    "VERDICT_MEANINGS",
    "Verdict",
    "check_output_paths",
    "claim",
    "decide",
    "exit_status",
    "find_counterexample",
    "list_claims",
    "run_checks",
    "run_cli",
    "select",
]
