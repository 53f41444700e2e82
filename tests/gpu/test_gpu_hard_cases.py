"""The fast path (:mod:`refdml.gpu`) against the reference on every entry's hard cases.

tests/gpu/test_gpu_parity.py holds each mirror to the reference on the entry's
``make_inputs``; here every mirror also goes through the conformance check
(:func:`refdml.conformance.check_implementation`, framework ``"numpy"``, the mirror's
own backward) on the entry's ``reference_inputs`` (ties, duplicate points, extreme eps
and temperatures, tiny and huge scales, float32's range edge) and one seed, in float64
and float32, at the tolerances the check derives (docs/conformance.md).

Every (entry, dtype) passes except the cases in :data:`KNOWN`, each with the reason. The
test asserts that a known case still fails exactly as stated (the same quantities and
causes, and for a refusal its message), so a fix that makes it pass, or a change in how
it fails, shows up here and the table cannot go stale.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest

from refdml.catalog import all_operators
from refdml.conformance import check_implementation

MIRRORED = [s for s in all_operators() if s.mirror is not None]
DTYPES = ("float64", "float32")


@dataclass(frozen=True)
class Known:
    """How one reference case of one entry fails at one dtype, and why that is accepted.

    ``failures``: the (quantity, cause) pairs of the case's failures; ``message``: a
    fragment every one of their messages holds (a refusal's own wording), or "";
    ``causes``: where the failure's exact form depends on LAPACK's rounding (a matrix
    that is zero up to rounding), the causes it may take instead of ``failures``'s.
    """

    failures: frozenset[tuple[str, str]]
    why: str
    message: str = ""
    causes: frozenset[str] | None = None


LARGE_EPS = "large eps (1e6 of the largest cost)"
# refdml/gpu/ot/_sinkhorn._RELATIVE_EPS: float32 resolves eps up to 1e3 of the largest cost;
# above, the potentials' rounding eps * 2^-24 exceeds 1e-4 of the cost, and the fast path
# refuses with a ValueError naming eps (refdml/gpu/ot/__init__.py's docstring). The reference (float64)
# solves the case.
_REFUSED = Known(frozenset({("forward", "raised")}),
                 "documented float32 refusal: eps above 1e3 of the largest cost",
                 message="above 1000")
# The transport-cost gradient solves a Schur complement diag(b) - pi^T diag(1/a) pi by a
# pseudo-inverse that, in float32, drops eigenvalues below 1e-6 of the largest
# (refdml/gpu/ot/_common._PINV_RCOND; the reference keeps those above 1e-12, refdml/gpu/ot/__init__.py's
# docstring). At small eps the plan is nearly a permutation and that matrix is nearly
# zero, its eigenvalues rounding noise: which survive the cut depends on LAPACK's
# rounding, hence ``causes``.
_SCHUR = frozenset({"gradient", "raised", "non-finite"})

KNOWN: dict[tuple[str, str], dict[str, Known]] = {
    **{(name, "float32"): {LARGE_EPS: _REFUSED} for name in (
        "ot.entropic_ot", "ot.entropic_ot_batched", "ot.pairwise_sinkhorn_divergence",
        "ot.sinkhorn_divergence", "ot.wcontrastive", "ot.wcontrastive_p1", "ot.wtriplet")},
    ("ot.entropic_ot_transport_cost", "float32"): {
        LARGE_EPS: _REFUSED,
        "small eps (1e-3 of the largest cost)": Known(
            frozenset({("grad cost", "gradient")}),
            "float32 pseudo-inverse cut of a nearly singular Schur complement (above)",
            causes=_SCHUR),
    },
    ("ot.sinkhorn_divergence_transport_cost", "float32"): {
        LARGE_EPS: _REFUSED,
        # A defect, left for its owner: an eigenvalue of the self problem's Schur
        # complement is a float32 subnormal, its reciprocal inf, the weight gradient NaN,
        # and _weight_gradient reports that as "overflows float32 ... rescale a".
        "small eps (1/100 of the largest cost)": Known(
            frozenset({("gradients", "raised")}),
            "float32 pseudo-inverse of a Schur complement that is zero up to rounding",
            causes=_SCHUR),
    },
    # The mirror is refdml.train._heads.gap_forward (not in gpu/): it sums the float32
    # features before dividing by their count, and the sum of entries near 1.4e38
    # overflows where their mean does not.
    ("train.gap", "float32"): {
        "float32 mean in range, sum not": Known(
            frozenset({("output 0", "non-finite")}),
            "float32 sum-then-divide overflows (mirror outside gpu/)"),
    },
}


def _check(spec, dtype: str):
    with warnings.catch_warnings():
        # The hard cases are meant to strain a solver; a ConvergenceWarning or a warning
        # the mirror raises is part of what is checked (as a value or a raise), not an
        # error of this test.
        warnings.simplefilter("ignore")
        return check_implementation(spec.mirror, spec.name, framework="numpy",
                                    backward=spec.mirror_backward, dtype=dtype, seeds=1,
                                    search=False, error_cases=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", MIRRORED, ids=[s.name for s in MIRRORED])
def test_mirror_agrees_on_the_hard_cases(spec, dtype):
    report = _check(spec, dtype)
    known = KNOWN.get((spec.name, dtype), {})
    cases = set(report.cases)
    assert set(known) <= cases, (
        f"KNOWN names cases that {spec.name} no longer has at {dtype}: {set(known) - cases}")
    unexpected = [f for f in report.failures if f.case not in known]
    assert not unexpected, report.summary()
    for case, expected in known.items():
        got = [f for f in report.failures if f.case == case]
        assert got, (f"{spec.name} ({dtype}) now passes {case!r}: remove it from KNOWN "
                     f"({expected.why})")
        pairs = {(f.quantity, f.cause) for f in got}
        if expected.causes is None:
            assert pairs == expected.failures, (spec.name, dtype, case, report.summary())
        else:
            assert {cause for _, cause in pairs} <= expected.causes, (
                spec.name, dtype, case, report.summary())
        assert all(expected.message in f.message for f in got), (
            spec.name, dtype, case, [f.message for f in got])


def test_known_table_names_mirrored_entries():
    # A renamed or removed entry would leave its row here unchecked.
    names = {s.name for s in MIRRORED}
    assert {name for name, _ in KNOWN} <= names
    assert {dtype for _, dtype in KNOWN} <= set(DTYPES)
