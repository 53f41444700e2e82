"""The catalogue's hard inputs, bad inputs and invariants, held against the reference itself.

Every entry declares ``reference_inputs`` (hard cases: the reference runs them forward and
backward finitely, in float64 and at the inputs rounded to each dtype the case names),
``error_inputs`` (each one makes the reference's forward raise exactly the declared
``TypeError``/``ValueError`` with a message naming the parameter) and, where its outputs
carry a constraint, ``invariants`` (satisfied by the reference on ``make_inputs`` and on
every case, and violated by grossly wrong outputs, so the check can fail).
"""

import re
import warnings
from collections.abc import Mapping

import numpy as np
import pytest

from refdml.catalog import Case, ErrorCase, all_operators
from refdml.exceptions import ConvergenceWarning

SPECS = all_operators()
IDS = [s.name for s in SPECS]
WITH_INVARIANTS = [s for s in SPECS if s.invariants is not None]
# Constraints hold to rounding (and to tol = 1e-12 for the iterative solvers); 1e-9 leaves
# room for the conditioning of a sum of a few dozen terms, and nothing more.
INVARIANT_TOL = 1e-9
DTYPES = ("float64", "float32")


def _outputs(returned) -> tuple[np.ndarray, ...]:
    outputs, ctx = returned
    parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    return tuple(np.asarray(part, dtype=np.float64) for part in parts), ctx


def _grad(grads, name):
    return grads[name] if isinstance(grads, Mapping) else getattr(grads, name)


def _wrt(spec, inputs) -> tuple[str, ...]:
    if spec.wrt is not None:
        return spec.wrt
    return tuple(k for k, v in inputs.items()
                 if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating))


def _rounded(inputs: Mapping, dtype: str) -> dict:
    """Floating arrays rounded to ``dtype`` and back (what a conformance check feeds the
    reference); labels and Python hyperparameters untouched."""
    return {k: v.astype(dtype).astype(np.float64)
            if isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.floating) else v
            for k, v in inputs.items()}


def _run(spec, inputs, rng):
    """Forward and backward (standard normal upstream, never all ones), both finite."""
    with warnings.catch_warnings():
        # A hard case must still converge: a ConvergenceWarning is a broken case.
        warnings.simplefilter("error", ConvergenceWarning)
        outputs, ctx = _outputs(spec.forward(**inputs))
        for k, out in enumerate(outputs):
            assert np.all(np.isfinite(out)), f"output {k} is not finite: {out}"
        upstream = [rng.standard_normal(out.shape) for out in outputs]
        grads = spec.backward(ctx, *upstream)
    for name in _wrt(spec, inputs):
        grad = np.asarray(_grad(grads, name), dtype=np.float64)
        assert grad.shape == np.shape(inputs[name]), f"grad {name} has shape {grad.shape}"
        assert np.all(np.isfinite(grad)), f"grad {name} is not finite: {grad}"
    return outputs


def test_every_entry_declares_its_cases():
    missing = [s.name for s in SPECS if s.reference_inputs is None or s.error_inputs is None]
    assert not missing, f"entries without reference_inputs or error_inputs: {missing}"


def _reference_cases(spec, seed: int = 0) -> tuple[Case, ...]:
    if spec.reference_inputs is None:
        pytest.skip("no reference_inputs (listed by test_every_entry_declares_its_cases)")
    return tuple(spec.reference_inputs(np.random.default_rng(seed)))


def _error_cases(spec) -> tuple[ErrorCase, ...]:
    if spec.error_inputs is None:
        pytest.skip("no error_inputs (listed by test_every_entry_declares_its_cases)")
    return tuple(spec.error_inputs(np.random.default_rng(0)))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_reference_cases_are_well_formed(spec):
    cases = _reference_cases(spec)
    base = spec.make_inputs(np.random.default_rng(0))
    assert len(cases) >= 3, f"{spec.name}: only {len(cases)} reference cases"
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), f"{spec.name}: duplicate case names {names}"
    for case in cases:
        assert isinstance(case, Case), f"{spec.name}: {case!r} is not a Case"
        assert case.name and case.why.strip(), f"{spec.name}: case {case.name!r} has no why"
        assert case.dtypes is None or (case.dtypes and set(case.dtypes) <= set(DTYPES)), (
            f"{spec.name}: case {case.name!r} names dtypes {case.dtypes}")
        # Iterative entries keep make_inputs' tight solver settings: a hard case solved
        # loosely would hold other implementations to a loose answer.
        for key in ("tol", "max_iter"):
            if key in base:
                assert case.inputs.get(key) == base[key], (
                    f"{spec.name}: case {case.name!r} has {key} == {case.inputs.get(key)!r}, "
                    f"make_inputs has {base[key]!r}")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_cases_run_finitely(spec, seed):
    # The cases are drawn from an rng: every draw must be a valid hard case, not just one.
    for case in _reference_cases(spec, seed):
        for dtype in case.dtypes or DTYPES:
            inputs = _rounded(case.inputs, dtype)
            try:
                _run(spec, inputs, np.random.default_rng(1))
            except Exception as error:  # name the case, then fail with the original
                raise AssertionError(f"{spec.name}, case {case.name!r} ({dtype}): "
                                     f"{type(error).__name__}: {error}") from error


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_error_cases_are_refused_by_name(spec):
    cases = _error_cases(spec)
    assert len(cases) >= 3, f"{spec.name}: only {len(cases)} error cases"
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), f"{spec.name}: duplicate error case names {names}"
    for case in cases:
        assert isinstance(case, ErrorCase), f"{spec.name}: {case!r} is not an ErrorCase"
        assert case.error in (TypeError, ValueError), (
            f"{spec.name}, {case.name!r}: error must be TypeError or ValueError")
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            with pytest.raises(Exception) as info:
                spec.forward(**case.inputs)
        raised = info.value
        assert type(raised) is case.error, (
            f"{spec.name}, {case.name!r}: raised {type(raised).__name__} ({raised}), "
            f"expected exactly {case.error.__name__}")
        assert re.search(case.match, str(raised)), (
            f"{spec.name}, {case.name!r}: message {str(raised)!r} does not match "
            f"{case.match!r}")


def _residuals(spec, inputs, outputs) -> dict:
    residuals = dict(spec.invariants(inputs, outputs))
    assert residuals, f"{spec.name}: invariants returned no residual"
    for name, value in residuals.items():
        assert isinstance(value, float) and np.isfinite(value) and value >= 0.0, (
            f"{spec.name}: residual {name} == {value!r}, must be a finite float >= 0")
    return residuals


@pytest.mark.parametrize("spec", WITH_INVARIANTS, ids=[s.name for s in WITH_INVARIANTS])
def test_invariants_hold_on_the_reference(spec):
    inputs_list = [(f"seed {seed}", dict(spec.make_inputs(np.random.default_rng(seed))))
                   for seed in (0, 1, 2)]
    if spec.reference_inputs is not None:
        inputs_list += [(case.name, dict(case.inputs)) for case in _reference_cases(spec)]
    for label, inputs in inputs_list:
        outputs, _ = _outputs(spec.forward(**inputs))
        residuals = _residuals(spec, inputs, outputs)
        worst = max(residuals, key=residuals.get)
        assert residuals[worst] <= INVARIANT_TOL, (
            f"{spec.name}, {label}: invariant {worst} has residual {residuals[worst]:.3e}")


@pytest.mark.parametrize("spec", WITH_INVARIANTS, ids=[s.name for s in WITH_INVARIANTS])
def test_invariants_catch_wrong_outputs(spec):
    # Outputs shifted far down (by 10 times their scale) break every constraint declared
    # here (a sum, a norm, a bound below or a sign): the check is not vacuous.
    inputs = dict(spec.make_inputs(np.random.default_rng(0)))
    outputs, _ = _outputs(spec.forward(**inputs))
    wrong = tuple(out - 10.0 * (1.0 + np.max(np.abs(out))) for out in outputs)
    residuals = _residuals(spec, inputs, wrong)
    assert max(residuals.values()) > 1e-3, (
        f"{spec.name}: no invariant notices shifted outputs: {residuals}")
