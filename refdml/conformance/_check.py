"""Check another implementation of a catalogued operator against refdml's reference."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refdml import catalog
from refdml._validation import _describe, check_choice, check_flag, check_rng, check_scalar
from refdml.conformance._frameworks import (
    FRAMEWORKS,
    Framework,
    StructureError,
    get_framework,
    named_gradient,
)
from refdml.conformance._formats import DTYPES, FORMATS, unsupported
from refdml.conformance._report import (
    ConformanceReport,
    ErrorOutcome,
    Failure,
    seed_reason,
    with_reason,
)
from refdml.conformance._tolerance import (
    Tolerance,
    base_tolerance,
    compare,
    is_floating_array,
    kind_scales,
    measure,
    overflowing,
    resolution_limit,
    round_to_dtype,
    rounding_floor,
    tolerance,
)

__all__ = ["MAX_EXAMPLES", "MAX_SEEDS", "Conformance", "PlannedCase", "check_implementation",
           "Settings", "check_dtype", "check_output_dtype", "check_settings", "get_spec",
           "plan_cases", "unrepresentable"]

#: The loose solver tolerances the "not converged" hint re-runs an iterative reference at.
LOOSE_TOLS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7, 1e-8)

_NAN = float("nan")


#: Upper bounds of the counts (``seeds``, ``max_examples``): far beyond any useful check
#: (each case runs the reference a dozen times), low enough that a slip (``seeds=10**9``)
#: is refused instead of starting days of work.
MAX_SEEDS = 1000
MAX_EXAMPLES = 10_000


def check_implementation(
    impl: Callable[..., Any],
    op: str,
    *,
    framework: str,
    dtype: str = "float64",
    adapter: Callable[[Callable[..., Any], dict[str, Any]], Any] | None = None,
    backward: Callable[..., Any] | None = None,
    device: str | None = None,
    seeds: int = 3,
    reference_cases: bool = True,
    error_cases: bool = True,
    search: bool = True,
    max_examples: int = 30,
    rng: Any = 0,
    output_dtype: str | None = None,
) -> ConformanceReport:
    """Compare ``impl``, another implementation of the catalogue entry ``op``, with refdml.

    ``impl`` is called with the entry's forward arguments (floating arrays as arrays of
    ``framework`` in ``dtype``, integer arrays with their dtype, hyperparameters as Python
    values), through ``adapter(impl, inputs)`` when given, and returns the forward's
    outputs (``"numpy"``/``"cupy"``: ``(outputs, ctx)``, with ``backward(ctx,
    *cotangents)`` giving the gradients; ``"torch"``/``"jax"``: the outputs, differentiated
    by the framework's autodiff). Each output and each gradient is compared, on every input
    case, with the float64 reference run at the same inputs rounded to ``dtype`` and with
    the same random cotangents (rounded likewise), within a tolerance from the dtype and the
    measured conditioning (:mod:`refdml.conformance._tolerance`).

    ``dtype`` is one of ``"float64"``, ``"float32"``, ``"float16"`` and ``"bfloat16"`` (a
    NumPy dtype such as ``np.float32`` is read as its name); bfloat16 only with
    ``framework="torch"`` or ``"jax"``: NumPy and CuPy have none.

    Input cases: ``spec.make_inputs`` with the generators ``default_rng(0)``, ...,
    ``default_rng(seeds - 1)`` (``"seed k"``); the entry's ``reference_inputs`` (hard
    cases) admitted at ``dtype`` (a case stated for some formats is admitted in those and in
    the formats of the same range: bfloat16 takes float32's cases); its ``error_inputs``,
    whose outcome is reported and never fails; and, with ``search``, a hypothesis search over
    make_inputs' seed and the number of significant digits its floating inputs keep, that
    shrinks a disagreement to a minimal case. A case whose inputs ``dtype`` cannot hold
    (beyond its range, or all below its smallest number), or that the entry states for
    another range, is not compared and listed in ``report.skipped`` with the reason.
    ``rng`` draws the cotangents and the conditioning perturbations.

    Output dtype. Asked for float16 or bfloat16, the implementation must return its
    floating outputs (and, for a NumPy or CuPy pair, its gradients) in that dtype: one that
    computes in float32 and never casts back would be held to the low format's wide
    tolerance without having been exercised in it, so each case fails with a ``"dtype"``
    line saying what it returned. An implementation that upcasts on purpose declares it,
    ``output_dtype="float32"``, and the report's notes say so. In float32 and float64 an
    output narrower than asked (float32 for a float64 check) fails the same way, and a
    wider one is compared as returned with a note (a float64 loss of float32 inputs is the
    common, deliberate accumulation; refdml's own float32 losses return one).
    ``output_dtype`` is one of the dtypes, at least as precise as ``dtype``. A Python
    number has no dtype and is not judged.

    Every argument is checked before any work (``TypeError``/``ValueError`` naming it);
    ``seeds`` is at most 1000 and ``max_examples`` at most 10000.

    Returns a :class:`ConformanceReport`: ``report.passed``, ``print(report.summary())``.
    """
    conformance = Conformance(
        impl, op, framework=framework, dtype=dtype, adapter=adapter, backward=backward,
        device=device, seeds=seeds, reference_cases=reference_cases,
        error_cases=error_cases, search=search, max_examples=max_examples, rng=rng,
        output_dtype=output_dtype)
    results = [conformance.check_case(case) for case in conformance.cases()]
    outcomes = conformance.error_outcomes() if conformance.error_cases else ()
    search_outcome = None
    if conformance.search:
        search_outcome, found = conformance.run_search()
        if found is not None:
            results.append(found)
    return conformance.report(results, outcomes, search_outcome)


@dataclass(frozen=True)
class Settings:
    """What a check runs, its arguments checked (:func:`check_settings`)."""

    spec: Any
    dtype: str
    seeds: int
    reference_cases: bool
    error_cases: bool
    search: bool
    max_examples: int
    output_dtype: str | None = None


def check_settings(op, *, framework, dtype, seeds, reference_cases, error_cases, search,
                   max_examples, output_dtype=None) -> Settings:
    """The settings of a check that need neither the implementation nor its framework,
    checked (``TypeError``/``ValueError`` naming the argument): what
    :class:`Conformance` checks first, and the pytest plugin checks at collection."""
    spec = get_spec(op)
    check_choice(framework, "framework", FRAMEWORKS)
    dtype = check_dtype(dtype)
    refused = unsupported(framework, dtype)
    if refused is not None:
        raise ValueError(refused)
    output_dtype = check_output_dtype(output_dtype, dtype)
    return Settings(
        spec, dtype,
        check_scalar(seeds, "seeds", low=1, high=MAX_SEEDS, integer=True, one_sided=True),
        check_flag(reference_cases, "reference_cases"),
        check_flag(error_cases, "error_cases"),
        check_flag(search, "search"),
        check_scalar(max_examples, "max_examples", low=1, high=MAX_EXAMPLES, integer=True,
                     one_sided=True),
        output_dtype)


def check_output_dtype(output_dtype: Any, dtype: str) -> str | None:
    """``output_dtype`` (None, or a dtype as :func:`check_dtype` reads it) checked against
    the checked ``dtype``: it declares an upcast, so it is at least as precise."""
    if output_dtype is None:
        return None
    output_dtype = check_dtype(output_dtype, "output_dtype")
    if FORMATS[output_dtype].precision < FORMATS[dtype].precision:
        raise ValueError(f"output_dtype == {output_dtype!r} is less precise than dtype == "
                         f"{dtype!r}; it declares an upcast (outputs returned in a wider "
                         "format than the inputs')")
    return output_dtype


@dataclass(frozen=True)
class PlannedCase:
    """One input case of a check: its inputs, the seed of the generator that draws its
    cotangents and perturbations, and (``skip``) why it is not compared in this dtype,
    where that is known before running anything; ``why`` says why the case exists (set on
    its failures)."""

    name: str
    inputs: Mapping[str, Any]
    seed: int
    scale_inputs: Mapping[str, Any] | None = None
    skip: str | None = None
    why: str = ""


class Conformance:
    """A conformance check with its arguments validated (those of
    :func:`check_implementation`), run one input case at a time: what
    :func:`check_implementation` runs in full and the pytest plugin
    (:mod:`refdml.pytest_plugin`) runs as one test item per case. Both see
    the same cases with the same cotangents."""

    def __init__(self, impl, op, *, framework, dtype="float64", adapter=None, backward=None,
                 device=None, seeds=3, reference_cases=True, error_cases=True, search=True,
                 max_examples=30, rng=0, output_dtype=None) -> None:
        if not callable(impl):
            raise TypeError(f"impl must be callable, got {_describe(impl)}")
        settings = check_settings(op, framework=framework, dtype=dtype, seeds=seeds,
                                  reference_cases=reference_cases, error_cases=error_cases,
                                  search=search, max_examples=max_examples,
                                  output_dtype=output_dtype)
        self.output_dtype = settings.output_dtype
        self.spec, self.dtype, self.seeds = settings.spec, settings.dtype, settings.seeds
        self.reference_cases, self.error_cases = settings.reference_cases, settings.error_cases
        self.search, self.max_examples = settings.search, settings.max_examples
        if adapter is not None and not callable(adapter):
            raise TypeError(f"adapter must be None or callable(impl, inputs), got "
                            f"{_describe(adapter)}")
        self.generator = check_rng(rng)
        self.fw = get_framework(framework, backward=backward, device=device)

        def call(inputs: dict[str, Any]) -> Any:
            return adapter(impl, inputs) if adapter is not None else impl(**inputs)

        self.checker = _CaseChecker(self.spec, self.fw, call, self.dtype, self.output_dtype)
        self._cases: list[PlannedCase] | None = None

    def cases(self) -> list[PlannedCase]:
        """The seeds' cases, then the entry's reference cases (if asked for), in order."""
        if self._cases is None:
            self._cases = plan_cases(self.spec, self.dtype, self.seeds,
                                     self.reference_cases, self.generator)
        return self._cases

    def check_case(self, case: PlannedCase) -> CaseResult:
        if case.skip is not None:
            return CaseResult(case.name, case.inputs, skipped=case.skip)
        result = self.checker.check(case.name, dict(case.inputs),
                                    np.random.default_rng(case.seed),
                                    scale_inputs=case.scale_inputs)
        result.failures[:] = with_reason(result.failures, case.why)
        return result

    def error_outcomes(self) -> tuple[ErrorOutcome, ...]:
        if self.spec.error_inputs is None:
            return ()
        return tuple(self.checker.error_case(case)
                     for case in self.spec.error_inputs(np.random.default_rng(0)))

    def run_search(self):
        """The hypothesis search: its :class:`SearchOutcome` and the minimal disagreeing
        case's result (None if none)."""
        from refdml.conformance._search import run_search

        return run_search(self.checker, self.spec.make_inputs, self.max_examples)

    def report(self, results, outcomes=(), search_outcome=None) -> ConformanceReport:
        spec = self.spec
        notes = tuple(dict.fromkeys(note for r in results for note in r.notes))
        if self.reference_cases and spec.reference_inputs is None:
            notes += (f"{spec.name} declares no reference inputs (hard cases) yet",)
        if self.error_cases and spec.error_inputs is None:
            notes += (f"{spec.name} declares no error inputs yet",)
        if self.output_dtype is not None and self.output_dtype != self.dtype:
            notes += (f"output dtype declared {self.output_dtype} (output_dtype) for a "
                      f"{self.dtype} check: the outputs are compared as returned, so the "
                      f"steps computed in {self.output_dtype} are not held to "
                      f"{self.dtype}",)
        compared = [r for r in results if r.skipped is None]
        return ConformanceReport(
            op=spec.name,
            framework=self.fw.name,
            dtype=self.dtype,
            cases=tuple(r.case for r in compared),
            failures=tuple(f for r in compared for f in r.failures),
            error_outcomes=tuple(outcomes),
            tolerances=tuple(t for r in compared for t in r.tolerances),
            search=search_outcome,
            skipped=tuple((r.case, r.skipped) for r in results if r.skipped is not None),
            notes=notes,
        )


def plan_cases(spec, dtype: str, seeds: int, reference_cases: bool,
               generator: np.random.Generator) -> list[PlannedCase]:
    """The input cases of a check of ``spec`` in ``dtype``: ``seeds`` draws of make_inputs,
    then (``reference_cases``) the entry's hard cases, each with a seed drawn from
    ``generator`` and the reason it is not compared, where that is known beforehand (a case
    stated for another range, inputs the dtype cannot hold). One seed is drawn for every
    case in order, admitted or not, so that a case gets the same cotangents however many
    of the others run (one pytest item per case runs exactly what the full check runs)."""
    named: list[tuple[str, Mapping[str, Any], Mapping[str, Any] | None, str | None, str]] = [
        (f"seed {k}", dict(spec.make_inputs(np.random.default_rng(k))), None, None,
         seed_reason(k))
        for k in range(seeds)]
    if reference_cases and spec.reference_inputs is not None:
        named += [(case.name, dict(case.inputs), case.scale_inputs,
                   _not_admitted(case.dtypes, dtype), case.why)
                  for case in spec.reference_inputs(np.random.default_rng(0))]
    return [PlannedCase(name, inputs, int(generator.integers(2**63)), scale,
                        skip or unrepresentable(inputs, dtype), why)
            for name, inputs, scale, skip, why in named]


def _not_admitted(case_dtypes: tuple[str, ...] | None, dtype: str) -> str | None:
    """Why a reference case stated for ``case_dtypes`` is not run in ``dtype`` (None: it
    is): a case is stated for the formats whose range its extremes probe, so it is also
    admitted in a format of the same exponent range (bfloat16 shares float32's)."""
    if case_dtypes is None or dtype in case_dtypes:
        return None
    own = FORMATS[dtype]
    if any((FORMATS[d].min_exponent, FORMATS[d].max_exponent)
           == (own.min_exponent, own.max_exponent) for d in case_dtypes if d in FORMATS):
        return None
    return (f"the entry states it for {' and '.join(case_dtypes)} only: its extremes probe "
            f"that range, not {dtype}'s")


def unrepresentable(inputs: Mapping[str, Any], dtype: str) -> str | None:
    """Why ``dtype`` cannot hold ``inputs`` (None if it can): a finite input beyond its
    range (it would become inf), or one whose every non-zero element is below its
    smallest number (it would become 0: another case)."""
    rounded = round_to_dtype(inputs, dtype)
    beyond = overflowing(inputs, rounded)
    # A real hyperparameter beyond the range (eps = 1e6 in float16) cannot be held by an
    # implementation that computes in dtype either. One below it is not refused: a
    # stopping tolerance of 1e-12 is compared with, not computed in, the dtype.
    beyond += [f"{name} == {value!r}" for name, value in inputs.items()
               if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
               and math.isfinite(value) and abs(value) > FORMATS[dtype].max]
    if beyond:
        return (f"{', '.join(beyond)} beyond {dtype}'s range (largest finite "
                f"{FORMATS[dtype].max:.4g})")
    vanished = [name for name, value in inputs.items() if is_floating_array(value)
                and np.any(value != 0) and not np.any(rounded[name] != 0)]
    if vanished:
        return (f"every non-zero element of {', '.join(vanished)} underflows to 0 in "
                f"{dtype} (smallest {FORMATS[dtype].smallest_subnormal:.4g})")
    return None


def get_spec(op: Any):
    names = [s.name for s in catalog.all_operators()]
    if not isinstance(op, str):
        raise TypeError(f"op must be the name of a catalogue entry (a string), got "
                        f"{_describe(op)}")
    if op not in names:
        raise ValueError(f"op == {op!r} is not in the catalogue; known: {names}")
    return catalog.get(op)


def check_dtype(dtype: Any, label: str = "dtype") -> str:
    """``dtype`` as one of :data:`DTYPES`: the name, or a NumPy dtype (or scalar type, or
    JAX's ``jnp.bfloat16``) with that name. None is refused: NumPy would read it as
    float64, a default silently put in place of a missing value. ``label`` is the
    parameter the errors name."""
    if not isinstance(dtype, str):
        name = None
        if dtype is not None:
            try:
                name = np.dtype(dtype).name
            except (TypeError, ValueError):
                name = None
        if name is None:
            raise TypeError(f"{label} must be one of {DTYPES} (a string or a NumPy dtype), "
                            f"got {_describe(dtype)}")
        dtype = name
    return check_choice(dtype, label, DTYPES)


@dataclass
class CaseResult:
    """The comparison of one input case (``skipped`` says why the reference refused it)."""

    case: str
    inputs: Mapping[str, Any]
    failures: list[Failure] = field(default_factory=list)
    tolerances: list[Tolerance] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


@dataclass(frozen=True)
class _Reference:
    outputs: tuple[np.ndarray, ...]
    grads: dict[str, np.ndarray]


class _CaseChecker:
    """Runs the reference and the implementation on one case and compares them."""

    def __init__(self, spec, fw: Framework, call, dtype: str,
                 output_dtype: str | None = None) -> None:
        # Per case, set by check(): the elements where the reference jumps, and the
        # absolute floor of each quantity from the reference's rounding noise.
        self._jumps: dict[str, np.ndarray | None] = {}
        self._atol: dict[str, float] = {}
        # The dtype of each output of the implementation's last run, read before the
        # framework turns it into NumPy (which has no bfloat16: torch's and JAX's come
        # back as float32); None for a Python number.
        self._returned: tuple[str | None, ...] = ()
        self.spec = spec
        self.fw = fw
        self.dtype = dtype
        self.output_dtype = output_dtype
        pair = fw.pair

        def recording(inputs: dict[str, Any]) -> Any:
            returned = call(inputs)
            outputs = returned
            if pair:  # (outputs, ctx); anything else is a structure error, found later
                outputs = returned[0] if isinstance(returned, tuple) and len(returned) == 2 else ()
            parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
            self._returned = tuple(_dtype_name(part) for part in parts)
            return returned

        self.call = recording
        self.base = base_tolerance(spec, dtype)
        self.limit = resolution_limit(dtype)
        # The base is stated at make_inputs: a case that amplifies roundoff more (an OT
        # solve at a smaller eps) scales it by the ratio (OperatorSpec.roundoff).
        self.calibration = None
        if spec.roundoff is not None:
            # At the inputs rounded to dtype, as every case is measured.
            self.calibration = max(float(spec.roundoff(round_to_dtype(spec.make_inputs(
                np.random.default_rng(k)), dtype))) for k in range(3))

    def case_base(self, inputs: Mapping[str, Any]) -> float:
        """The base tolerance at ``inputs``: the entry's, times how much more these
        inputs amplify roundoff than make_inputs do (at least 1)."""
        if self.calibration is None or not self.calibration > 0:
            return self.base
        try:
            ratio = float(self.spec.roundoff(inputs)) / self.calibration
        except Exception:  # noqa: BLE001 - inputs the hint cannot read keep the base
            return self.base
        return self.base * max(1.0, ratio) if np.isfinite(ratio) else self.base

    # -- the reference ----------------------------------------------------------------

    def wrt(self, inputs: Mapping[str, Any]) -> tuple[str, ...]:
        if self.spec.wrt is not None:
            return tuple(self.spec.wrt)
        return tuple(name for name, value in inputs.items() if is_floating_array(value))

    def reference(self, inputs, wrt, cotangents) -> _Reference:
        """The float64 reference's outputs and (given cotangents) gradients; warnings
        (a solver's non-convergence at a perturbed input, say) do not interrupt it."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outputs, ctx = self.spec.forward(**inputs)
            outputs = tuple(np.asarray(o, dtype=np.float64)
                            for o in (outputs if isinstance(outputs, (tuple, list))
                                      else (outputs,)))
            if cotangents is None:
                return _Reference(outputs, {})
            grads = self.spec.backward(ctx, *cotangents)
        found = {}
        for name in wrt:
            g = named_gradient(grads, name)
            if g is not None:
                found[name] = np.asarray(g, dtype=np.float64)
        return _Reference(outputs, found)

    def _reference_or_none(self, inputs, wrt, cotangents) -> dict[str, np.ndarray] | None:
        try:
            ref = self.reference(inputs, wrt, cotangents)
        except Exception:  # noqa: BLE001 - a refused perturbation is not measured
            return None
        return _quantities(ref)

    # -- the implementation -------------------------------------------------------------

    def framework_inputs(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {name: self.fw.asarray(value, self.dtype) if isinstance(value, np.ndarray)
                else value for name, value in inputs.items()}

    def run_impl(self, inputs, wrt, cotangents, notes: list[str], case: str):
        """``self.fw.run`` with the implementation's warnings recorded, not raised."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return self.fw.run(self.call, self.framework_inputs(inputs), wrt, cotangents)
            finally:
                for w in caught:
                    notes.append(f"{case}: the implementation warned "
                                 f"{w.category.__name__}: {w.message}")

    # -- one case -----------------------------------------------------------------------

    def check(self, case: str, inputs: dict[str, Any], rng: np.random.Generator,
              scale_inputs: Mapping[str, Any] | None = None) -> CaseResult:
        result = CaseResult(case, inputs)
        rounded = round_to_dtype(inputs, self.dtype)
        wrt = self.wrt(inputs)
        result.skipped = unrepresentable(inputs, self.dtype)
        if result.skipped is not None:
            return result
        try:
            forward_only = self.reference(rounded, wrt, None)
        except Exception as error:  # noqa: BLE001 - reported as a skipped case
            result.skipped = f"the reference raised {type(error).__name__}: {error}"
            return result
        # Rounded to the dtype, as the inputs are: the implementation's cotangents are
        # exactly the reference's.
        cotangents = tuple(FORMATS[self.dtype].round(rng.standard_normal(o.shape))
                           for o in forward_only.outputs)
        try:
            ref = self.reference(rounded, wrt, cotangents)
        except Exception as error:  # noqa: BLE001
            result.skipped = f"the reference's backward raised {type(error).__name__}: {error}"
            return result
        quantities = _quantities(ref)
        measured = measure(lambda moved: self._reference_or_none(moved, wrt, cotangents),
                           rounded, quantities, rng)
        base = self.case_base(rounded)
        rtol, self._jumps, self._atol = {}, {}, {}
        for q, m in measured.items():
            # A base above 1: the computation amplifies this dtype's roundoff beyond the
            # size of its results (bfloat16 at a small eps): no digit can be asked of it,
            # and the noise floor, measured in float64 and scaled linearly, does not hold
            # either. Shape and finiteness only (rtol inf), reported as beyond the dtype.
            rtol[q] = tolerance(base, m.kappa, self.dtype) if base <= 1 else np.inf
            self._jumps[q] = m.jumps
            # The noise floor is for a quantity the relative error cannot measure (rtol
            # beyond the resolution limit: zero by cancellation, ill-conditioned). On a
            # resolved one it would only widen the relative rule: 64 samples of float64
            # noise of an ordinary value (a unit or two in its last place) scaled to
            # bfloat16 are 0.3 to 0.5 of the value itself, which let a ProxyNCA++ without
            # the positive proxy in its denominator (a 25% error) pass in bfloat16.
            self._atol[q] = (rounding_floor(m.noise, self.dtype) if rtol[q] > self.limit
                             else 0.0)
            jumping = 0 if m.jumps is None else int(m.jumps.sum())
            result.tolerances.append(Tolerance(case, q, base, float(m.kappa), rtol[q],
                                               jumping, self._atol[q], self.limit))
        if scale_inputs is not None:
            self._cancelling_floor(result, scale_inputs, wrt, cotangents, base)
        scales = kind_scales(quantities)

        self._returned = ()
        evaluation = self._evaluate(result, inputs, wrt, cotangents, ref.outputs)
        if evaluation is None:
            return result
        self._check_dtypes(result, evaluation)
        if len(evaluation.outputs) != len(ref.outputs):
            result.failures.append(Failure(
                case, "outputs", "structure", None, _NAN, _NAN, _NAN, _NAN,
                f"the implementation returned {len(evaluation.outputs)} output(s), the "
                f"reference {len(ref.outputs)}"))
            return result
        for k, (actual, expected) in enumerate(zip(evaluation.outputs, ref.outputs)):
            self._compare(result, f"output {k}", "value", actual, expected,
                          rtol[f"output {k}"], scales["output"])
        if evaluation.grads is not None:
            for name, expected in ref.grads.items():
                actual = evaluation.grads.get(name)
                quantity = f"grad {name}"
                if actual is None:
                    if np.any(expected != 0):
                        index = _worst(np.abs(expected))
                        result.failures.append(Failure(
                            case, quantity, "missing gradient", index, _NAN,
                            float(expected[index]), _NAN, rtol[quantity],
                            f"the implementation gives no gradient for {name!r} (None or "
                            f"absent) where the reference's is non-zero"))
                    continue
                self._compare(result, quantity, "gradient", actual, expected,
                              rtol[quantity], scales["grad"])
        if not any(f.cause == "structure" for f in result.failures):
            self._invariants(result, rounded, evaluation.outputs, ref.outputs,
                             max(rtol[f"output {k}"] for k in range(len(ref.outputs))))
        if any(f.cause in ("value", "gradient") for f in result.failures):
            self._convergence_hint(result, rounded, wrt, cotangents, evaluation)
        return result

    def _check_dtypes(self, result: CaseResult, evaluation) -> None:
        """A ``"dtype"`` failure for each floating output (and a pair's gradient) not in
        the dtype asked for (or declared by ``output_dtype``); see
        :func:`check_implementation`."""
        found = [(f"output {k}", name) for k, name in enumerate(self._returned)]
        if self.fw.pair and evaluation.grads:
            # A pair's backward is the user's code; autodiff's products take the
            # dtype of their input.
            found += [(f"grad {name}", np.asarray(g).dtype.name)
                      for name, g in evaluation.grads.items() if g is not None]
        asked = self.output_dtype or self.dtype
        for quantity, name in found:
            # A declared upcast that is not taken (the dtype asked for) is no fault.
            if name is None or name in (asked, self.dtype) or name not in FORMATS:
                continue
            wider = FORMATS[name].precision > FORMATS[asked].precision
            if self.output_dtype is None and wider and self.dtype in ("float32", "float64"):
                result.notes.append(f"{quantity} is {name}, asked for {self.dtype}: compared "
                                    f"as returned (declare output_dtype=\"{name}\" to say "
                                    "so)")
                continue
            what = "declared" if self.output_dtype is not None else "asked for"
            advice = (f"; compute in {asked} or declare output_dtype=\"{name}\""
                      if self.output_dtype is None and wider else
                      f"; return it in {asked}")
            result.failures.append(Failure(
                result.case, quantity, "dtype", None, _NAN, _NAN, _NAN, _NAN,
                f"{quantity} is {name}, {what} {asked}{advice}"))

    def _cancelling_floor(self, result, scale_inputs, wrt, cotangents, base) -> None:
        """Where the case's quantities are zero by cancellation (``Case.scale_inputs``),
        an element within ``base`` times the magnitude of the cancelling terms agrees: the
        largest of the reference's quantities of its kind (outputs, gradients) at
        ``scale_inputs``, as the norm-wise error measures an all-zero quantity."""
        try:
            terms = kind_scales(_quantities(self.reference(
                round_to_dtype(scale_inputs, self.dtype), wrt, cotangents)))
        except Exception:  # noqa: BLE001 - no floor where the reference refuses them
            return
        for k, t in enumerate(result.tolerances):
            if t.case != result.case:
                continue
            floor = base * terms["grad" if t.quantity.startswith("grad ") else "output"]
            if floor > self._atol.get(t.quantity, 0.0):
                self._atol[t.quantity] = floor
                result.tolerances[k] = dataclasses.replace(t, atol=floor)

    def _evaluate(self, result: CaseResult, inputs, wrt, cotangents, ref_outputs):
        case = result.case
        try:
            return self.run_impl(inputs, wrt, cotangents, result.notes, case)
        except Exception as error:  # noqa: BLE001 - localised below
            first = error
        # Which half failed: with the forward alone, its values can still be compared.
        try:
            evaluation = self.run_impl(inputs, wrt, None, result.notes, case)
        except StructureError as error:
            result.failures.append(Failure(case, "outputs", "structure", None, _NAN, _NAN,
                                           _NAN, _NAN, str(error)))
            return None
        except Exception as error:  # noqa: BLE001
            result.failures.append(Failure(
                case, "forward", "raised", None, _NAN, _NAN, _NAN, _NAN,
                f"the implementation raised {type(error).__name__}: {error}"))
            return None
        if [np.shape(o) for o in evaluation.outputs] != [o.shape for o in ref_outputs]:
            # Cotangents shaped for the reference's outputs cannot fit: the outputs' structure
            # is the failure (reported by the caller), not the product.
            return evaluation
        cause = "structure" if isinstance(first, StructureError) else "raised"
        result.failures.append(Failure(
            case, "gradients", cause, None, _NAN, _NAN, _NAN, _NAN,
            f"the forward ran but the vector-Jacobian product "
            f"{'was malformed' if cause == 'structure' else 'raised'}: "
            f"{type(first).__name__}: {first}"))
        return evaluation

    def _compare(self, result, quantity, cause, actual, expected, rtol, fallback) -> None:
        case = result.case
        actual = np.asarray(actual)
        if actual.shape != expected.shape:
            result.failures.append(Failure(
                case, quantity, "structure", None, _NAN, _NAN, _NAN, rtol,
                f"{quantity} has shape {actual.shape}, the reference's {expected.shape}"))
            return
        actual = actual.astype(np.float64)
        bad = ~np.isfinite(actual) & np.isfinite(expected)
        if np.any(bad):
            index = tuple(int(i) for i in np.argwhere(bad)[0])
            result.failures.append(Failure(
                case, quantity, "non-finite", index, float(actual[index]),
                float(expected[index]), _NAN, rtol,
                f"{quantity} is {actual[index]} at {index} where the reference is finite "
                f"({int(bad.sum())} of {bad.size} elements)"))
            return
        if not np.isfinite(rtol):  # every element jumps (a kink, a tie): finiteness only
            return
        found = compare(actual, expected, fallback, self._jumps.get(quantity))
        atol = self._atol.get(quantity, 0.0)
        # Within the reference's own rounding noise is agreement, whatever the relative
        # error (a quantity that is zero by cancellation); where the relative tolerance
        # would exceed the dtype's resolution limit it means nothing, and that noise is the
        # only bound.
        unresolved = rtol > self.limit
        relative_fails = found.error > rtol or unresolved
        if relative_fails and found.abs_error > atol:
            if unresolved:
                why = (f"|error| {found.abs_error:.3g} > atol {atol:.3g} (the relative "
                       f"tolerance {rtol:.3g} means nothing this ill-conditioned)")
            else:
                why = (f"{found.error:.3g} (max |error| over max |reference|) > rtol "
                       f"{rtol:.3g}, and |error| {found.abs_error:.3g} > atol {atol:.3g}")
            result.failures.append(Failure(
                case, quantity, cause, found.index, found.impl_value, found.ref_value,
                found.error, atol if unresolved else rtol,
                f"{quantity} differs from the reference by {why}; the worst element is "
                f"{found.index}"))

    def _invariants(self, result, rounded, outputs, ref_outputs, rtol) -> None:
        if self.spec.invariants is None:
            return
        as_float = tuple(np.asarray(o, dtype=np.float64) for o in outputs)
        if not all(np.all(np.isfinite(o)) for o in as_float):
            return  # already a "non-finite" failure; a residual of NaN would say it twice
        try:
            with warnings.catch_warnings(), np.errstate(all="ignore"):
                warnings.simplefilter("ignore")
                own = dict(self.spec.invariants(rounded, as_float))
                reference = dict(self.spec.invariants(rounded, ref_outputs))
        except Exception as error:  # noqa: BLE001 - a constraint that cannot be evaluated
            result.notes.append(f"{result.case}: the invariants could not be evaluated on "
                                f"the implementation's outputs ({type(error).__name__}: "
                                f"{error})")
            return
        for name, residual in own.items():
            # The reference's own residual (a solver's stopping tolerance) is allowed too.
            bound = max(rtol, 2.0 * float(reference.get(name, 0.0)))
            residual = float(residual)
            if not residual <= bound:
                result.failures.append(Failure(
                    result.case, name, "constraint", None, residual,
                    float(reference.get(name, _NAN)), residual, bound,
                    f"the constraint {name!r} has relative residual {residual:.3g} on the "
                    f"implementation's outputs > {bound:.3g} (the reference's: "
                    f"{float(reference.get(name, _NAN)):.3g})"))

    def _convergence_hint(self, result, rounded, wrt, cotangents, evaluation) -> None:
        """For a solver (inputs ``tol`` and ``max_iter``): does the implementation agree
        far better with the reference stopped early? Then say so on its failures."""
        if "tol" not in rounded or "max_iter" not in rounded:
            return
        failing = [f for f in result.failures if f.cause in ("value", "gradient")]
        actual = _quantities(_Reference(
            tuple(np.asarray(o, dtype=np.float64) for o in evaluation.outputs),
            {name: np.asarray(g, dtype=np.float64)
             for name, g in (evaluation.grads or {}).items() if g is not None}))
        best: tuple[float, float] | None = None
        for loose in LOOSE_TOLS:
            moved = self._reference_or_none(dict(rounded, tol=loose), wrt, cotangents)
            if moved is None:
                continue
            errors = []
            for f in failing:
                if f.quantity not in moved or moved[f.quantity].shape != actual[f.quantity].shape:
                    break
                scales = kind_scales(moved)
                kind = "grad" if f.quantity.startswith("grad ") else "output"
                errors.append(compare(actual[f.quantity], moved[f.quantity],
                                      scales[kind]).error / f.error)
            else:
                ratio = max(errors)
                if best is None or ratio < best[1]:
                    best = (loose, ratio)
        if best is None or best[1] > 0.1:
            return
        hint = (f"not converged: agrees with the reference stopped at tol={best[0]:g} "
                f"({1 / max(best[1], 1e-300):.3g} times closer than to the converged one): "
                f"a solver stopped early?")
        hinted = {id(f) for f in failing}
        result.failures[:] = [
            Failure(**dict(vars(f), hint=hint)) if id(f) in hinted else f
            for f in result.failures
        ]

    # -- error inputs -------------------------------------------------------------------

    def error_case(self, case) -> ErrorOutcome:
        expected = f"{case.error.__name__} matching {case.match!r}"
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                # A value beyond the dtype's range becomes inf here: still a bad input.
                inputs = self.framework_inputs(case.inputs)
            except Exception as error:  # noqa: BLE001
                return ErrorOutcome(case.name, "not representable",
                                    f"{self.fw.name} cannot hold the input: "
                                    f"{type(error).__name__}: {error}", expected)
            try:
                evaluation = self.fw.run(self.call, inputs, (), None)
            except StructureError as error:
                return ErrorOutcome(case.name, "returned malformed", str(error), expected)
            except (TypeError, ValueError) as error:
                return ErrorOutcome(case.name, "refused", _first_line(error), expected)
            except Exception as error:  # noqa: BLE001
                return ErrorOutcome(case.name, "raised another type", _first_line(error),
                                    expected)
        finite = all(np.all(np.isfinite(np.asarray(o, dtype=np.float64)))
                     for o in evaluation.outputs)
        return ErrorOutcome(case.name, "returned finite" if finite else "returned non-finite",
                            "returned without an error", expected)


def _dtype_name(value: Any) -> str | None:
    """The name of ``value``'s dtype as :data:`DTYPES` spells it (``torch.bfloat16`` ->
    ``"bfloat16"``; NumPy's, CuPy's and JAX's dtypes, ml_dtypes' bfloat16 among them,
    print their name), None for a value without one (a Python number)."""
    dtype = getattr(value, "dtype", None)
    return None if dtype is None else str(dtype).rsplit(".", 1)[-1]


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _quantities(ref: _Reference) -> dict[str, np.ndarray]:
    quantities = {f"output {k}": out for k, out in enumerate(ref.outputs)}
    quantities.update({f"grad {name}": g for name, g in ref.grads.items()})
    return quantities


def _worst(magnitude: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(magnitude)), magnitude.shape))
