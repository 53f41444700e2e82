"""Central finite-difference checks of hand-written backward passes.

Conventions
-----------
An operator is a pure pair

* ``forward(**inputs) -> (outputs, ctx)``: ``outputs`` is an array, a float or a tuple
  of arrays; ``ctx`` is whatever ``backward`` needs;
* ``backward(ctx, *grad_outputs) -> grads``: one upstream gradient per output, shaped
  like it; ``grads`` names the gradient of every differentiated input, either as a
  mapping or as attributes (``grads.x``).

Losses that return ``value, grads = loss(**inputs)`` are checked with :func:`check_loss`.

Every check contracts the outputs with a random upstream gradient ``g`` (standard normal,
cast to each output's dtype) and compares the hand-written vector-Jacobian product
``J^T g`` with central differences of ``phi(x) = <g, f(x)>``, evaluated in float64:

``"full"``
    the whole Jacobian: one backward call per output component against one pair of
    forward calls per input component (small problems only);
``"vjp"``
    every component of ``J^T g`` against central differences of ``phi``;
``"directions"``
    ``<J^T g, v>`` against the central difference of ``phi`` along ``n_directions``
    random unit directions ``v`` (large inputs);
``"fast"``
    ``"directions"`` with one direction: two forward calls per input, whatever its size.
    One direction can miss little (a wrong element adds its error times a random
    component of ``v``), so it is a screen, not a proof of a sparse Jacobian.

``"auto"`` picks ``full`` when inputs times outputs is at most ``FULL_JACOBIAN_LIMIT``,
``vjp`` when the inputs have at most ``VJP_LIMIT`` components, else ``directions``.

Localisation
------------
A ``"fast"`` or ``"directions"`` check that fails is localised (``localize=True``): an
input of at most ``VJP_LIMIT`` elements is re-checked element by element (``"vjp"``); a
larger one by bisection: the failing direction is restricted to each half of the index
set (renormalised to unit length), each half is compared, and the half (at most two per
level) whose disagreement exceeds its tolerance is followed down to one element, about
``4 log2(n)`` forward calls for a sparse bug. Every result names the worst element
(``worst_index``; ``worst_output`` too in ``"full"`` mode), the backward and the
finite-difference values there and the tolerance, never a whole Jacobian.

Dtypes, steps and tolerances
----------------------------
Differentiated inputs keep their dtype (float16, float32 or float64; other real types
become float64): the forward runs at that dtype. The step is
``h = cbrt(eps) * max|x|`` with the input's ``eps`` (``cbrt(eps)`` when
``max|x| < 1e-8``) unless given: it balances truncation (O(h^2)) and rounding
(O(eps/h)) for a function whose scale of variation is that of its input. The perturbed
points are rounded to the dtype, so the step taken is measured from them, in float64,
and used for both sides (``(x+h)-(x-h)`` in float16 is not ``2h``); an element that a
given step does not move gives a difference of 0, judged against every output's rounding
at the nominal step.
The check's dtype (``GradcheckResult.dtype``) is the coarsest of the inputs' and the
outputs'. :func:`default_tolerances` gives ``rtol = 5 * eps^(2/3)``: ``eps^(2/3)`` is
the relative error of a central difference at its optimal step, and the factor 5 leaves
room for a third derivative of a few times the gradient over the input's scale (rtol 1.8e-10
float64, 1.2e-4 float32, 4.9e-2 float16: a 1% error is caught in float32, a 10% error in
float16 element by element, not along random directions); ``atol = 0``: an absolute
tolerance cannot be derived from a dtype, and the noise floor below covers vanishing
gradients. ``rtol``/``atol`` of None, in the checks, :meth:`InputCheck.passed` and
:func:`assert_gradients`, mean the check's own tolerances, whose defaults these are.

Errors
------
For each input the harness reports the largest absolute difference, the scale (the
largest magnitude of either derivative; for ``directions`` also the 2-norm of ``J^T g``,
which bounds every directional derivative) and the relative error ``max_abs_error /
scale``. A check passes when ``max_abs_error <= atol + rtol * scale``, or when every
difference is within ``noise + rtol * scale`` where ``noise`` is the rounding error of
that very central difference: ``R * eps * sum_k |g_k| (|f_k(x+h)| + |f_k(x-h)|) / (2h)``
over the output components ``k`` that the step changed, with the ``eps`` of each
output's dtype and ``R = 100`` (``R = 2`` in float16, where 100 ulps would exceed the
gradient itself at the default step: a float16 forward is assumed to round within 2
ulps, as NumPy's float16 arithmetic, computed in float32 and rounded once per operation,
does for a few operations). Outputs the step leaves bitwise unchanged while it moves
others do not depend on that input: they add no rounding error (and none is excused), so
a huge output that does not depend on an input cannot hide a wrong gradient of that
input; the differences are contracted component by component, ``sum_k g_k (f_k(x+h) -
f_k(x-h))``, so such an output costs no precision either. Where the step moves no output
at all (the forward is numerically flat there, e.g. an input the constraints pin down),
the sum runs over every output: that is all the difference can resolve. The floor
matters only where the true gradient is (close to) zero; a gradient whose error exceeds
the rounding of its own finite difference always fails, whatever the size of the
outputs. The largest such floor is reported as ``noise_floor``; a check whose ``scale``
is below it could not resolve the gradient at this step. Where the true gradient
vanishes but the third derivative does not (a cosine similarity of exactly parallel
vectors), the O(h^2) truncation error is all that is measured: pass a smaller ``step``
or an ``atol`` there.

Kinks
-----
Central differences across a kink (ReLU, a max with a tie, ``|x|`` at 0) are
meaningless. For every element that fails (the 16 worst), and for the element a
bisection found, the one-sided differences of ``phi`` are taken at ``h`` and ``h/4``:
where they disagree beyond the tolerance plus four times their rounding, the gap does
not shrink with the step (at a smooth point it shrinks four-fold) and the backward lies
between them, the element sits on a kink, or within ``h/4`` of one (a backward outside
them is wrong on either side: a failure). It is reported as such (:class:`Kink`), left
out of the gradient error, and the check's status is ``"kink"``: not passed, since the
harness never passes what it cannot check; :func:`assert_gradients` raises
:class:`NonDifferentiablePoint`. Move the check point off the kink. A backward that
returns the mean of the one-sided derivatives there (``sign(0) = 0`` for ``|x|``) agrees
with the central difference and passes: that is a subgradient.

Non-deterministic backwards
---------------------------
``nondet_tol=None`` calls the backward once per upstream gradient. A float calls it twice
with the same upstream gradient and raises :class:`GradcheckError` (naming the input, the
element and both values) where the two gradients differ by more than ``nondet_tol``
(GPU reductions with atomics).

What the harness refuses
------------------------
It never turns a defect into a pass. ``ValueError`` (naming the parameter and the value)
for ``rtol``/``atol``/``nondet_tol`` negative, NaN or infinite, ``step`` not a finite
positive number, ``n_directions <= 0`` (``TypeError`` if not an integer), ``localize``
not a bool (``TypeError``), ``wrt`` naming an input that is missing, empty, non-finite
(``TypeError`` if it is not floating point, and for a ``wrt`` that is not a tuple or
list of names: a bare string included), and a forward (or :func:`check_loss`'s loss,
named as such) whose outputs are non-finite at the check point or at a finite-difference
point; ``TypeError`` for a forward that does not return ``(outputs, ctx)`` with real
outputs (a loss: ``(value, grads)``, a real scalar value); :class:`GradcheckError` when
the backward returns no gradient for a differentiated input, one of the wrong shape, or
a non-finite one.

The modes share the step, the noise floor, the comparison rule and the argument checks,
and are one algorithm read together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import _describe, check_choice, check_flag, check_rng, check_scalar

__all__ = [
    "FULL_JACOBIAN_LIMIT",
    "VJP_LIMIT",
    "GradcheckError",
    "GradcheckResult",
    "InputCheck",
    "Kink",
    "MODES",
    "NonDifferentiablePoint",
    "assert_gradients",
    "check_gradients",
    "check_loss",
    "default_tolerances",
]

FULL_JACOBIAN_LIMIT = 4096
VJP_LIMIT = 2000
#: The comparison modes of :func:`check_gradients`.
MODES = ("auto", "full", "vjp", "directions", "fast")
#: Rounding error of one forward evaluation, in units of machine epsilon times |f|.
_ROUNDING_FACTOR = 100.0
#: float16: 100 ulps at the default step would be the size of the gradient itself.
_ROUNDING_FACTOR_HALF = 2.0
#: Safety factor of the default rtol over eps^(2/3) (see the module docstring).
_TOLERANCE_SAFETY = 5.0
#: Failing elements probed for a kink, worst first (4 forward calls each).
_KINK_PROBES = 16
#: Halves followed per level of a bisection.
_BISECTION_BRANCHES = 2
_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class GradcheckError(AssertionError):
    """A backward pass is wrong: it disagrees with finite differences beyond the stated
    tolerance, or it returned a missing, misshapen, non-finite or non-deterministic
    gradient."""


class NonDifferentiablePoint(GradcheckError):
    """The check point sits on a kink of the forward, where no gradient can be checked."""


def default_tolerances(dtype: Any) -> tuple[float, float]:
    """``(rtol, atol)`` of a check in ``dtype`` (float16, float32 or float64):
    ``(5 * eps^(2/3), 0.0)``; see the module docstring for why."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError):
        dt = None
    if dtype is None or dt is None or dt not in _DTYPES:
        raise TypeError(f"dtype must be float16, float32 or float64, got {_describe(dtype)}")
    return _TOLERANCE_SAFETY * float(np.finfo(dt).eps) ** (2.0 / 3.0), 0.0


def _check_tolerances(rtol: Any, atol: Any) -> tuple[float, float]:
    return (
        float(check_scalar(rtol, "rtol", low=0.0)),
        float(check_scalar(atol, "atol", low=0.0)),
    )


def _coarsest(dtypes) -> np.dtype:
    return max(dtypes, key=lambda d: float(np.finfo(d).eps))


def _where(name: str, index: tuple[int, ...] | None) -> str:
    if index is None:
        return f"{name} along a random direction"
    return f"{name}[{', '.join(map(str, index))}]" if index else name


@dataclass(frozen=True)
class Kink:
    """An element of an input at (or within ``h/4`` of) a kink of the forward.

    ``left`` and ``right`` are the backward and forward one-sided derivatives of
    ``<g, f>`` (of the output component ``output`` in ``"full"`` mode) at step ``h/4``.
    """

    index: tuple[int, ...]
    left: float
    right: float
    output: tuple[int, ...] | None = None


@dataclass(frozen=True)
class InputCheck:
    """The comparison for one differentiated input.

    ``max_error_above_noise`` is the largest amount by which a difference exceeds the
    rounding error of its own finite difference (0 when every difference is within it);
    ``noise_floor`` is the largest such rounding error. Elements on a kink (``kinks``)
    are left out of the errors. ``worst_index`` (``worst_output``: the output number and
    the component's index, ``"full"`` mode) locates the worst element, where the backward
    gave ``backward_value``, the finite difference ``numerical_value`` and its rounding
    error was ``worst_noise``; None for a direction that was not localised.
    ``localization`` says how a failing ``"fast"``/``"directions"`` check was localised
    (``"vjp"``, ``"bisection"``). ``rtol``/``atol`` are the tolerances the check used
    (None: :func:`default_tolerances` of ``dtype``).
    """

    name: str
    shape: tuple[int, ...]
    mode: str
    max_abs_error: float
    max_rel_error: float
    scale: float
    step: float
    n_forward_calls: int
    noise_floor: float = 0.0
    max_error_above_noise: float | None = None
    worst_index: tuple[int, ...] | None = None
    worst_output: tuple[int, ...] | None = None
    backward_value: float | None = None
    numerical_value: float | None = None
    worst_noise: float = 0.0
    kinks: tuple[Kink, ...] = ()
    localization: str | None = None
    dtype: str = "float64"
    rtol: float | None = None
    atol: float | None = None

    def _tolerances(self, rtol, atol) -> tuple[float, float]:
        default_rtol, default_atol = default_tolerances(self.dtype)
        if rtol is None:
            rtol = default_rtol if self.rtol is None else self.rtol
        if atol is None:
            atol = default_atol if self.atol is None else self.atol
        return _check_tolerances(rtol, atol)

    @property
    def tolerance(self) -> float:
        """The tolerance at the worst element with the check's own rtol and atol."""
        return self.tolerance_for()

    def tolerance_for(self, rtol: float | None = None, atol: float | None = None) -> float:
        """``max(atol, worst_noise) + rtol * scale``: the tolerance at the worst element."""
        rtol, atol = self._tolerances(rtol, atol)
        return max(atol, self.worst_noise) + rtol * self.scale

    def status(self, rtol: float | None = None, atol: float | None = None) -> str:
        """``"passed"``, ``"failed"`` (see :meth:`passed`) or ``"kink"`` (the elements off
        the kinks pass, but some sit on one)."""
        rtol, atol = self._tolerances(rtol, atol)
        bound = rtol * self.scale
        ok = self.max_abs_error <= atol + bound
        if not ok:
            above = self.max_error_above_noise
            if above is None:  # built by hand without per-component floors
                above = self.max_abs_error - self.noise_floor
            ok = above <= bound
        if not ok:
            return "failed"
        return "kink" if self.kinks else "passed"

    def passed(self, rtol: float | None = None, atol: float | None = None) -> bool:
        """True when ``max_abs_error <= atol + rtol * scale``, or when every difference is
        within its own rounding error plus ``rtol * scale`` (see the module docstring), and
        no element sits on a kink.

        ``rtol`` and ``atol`` must be finite and non-negative (``ValueError`` otherwise);
        None means the check's own (default: :func:`default_tolerances` of ``dtype``).
        """
        return self.status(rtol, atol) == "passed"

    def describe(self, rtol: float | None = None, atol: float | None = None) -> list[str]:
        """One line for the worst element of a check that did not pass, one per kink."""
        lines = []
        status = self.status(rtol, atol)
        if status == "failed":
            where = _where(self.name, self.worst_index)
            if self.worst_output is not None:
                out = self.worst_output
                where += f" (output {out[0]}{list(out[1:]) if out[1:] else ''})"
            if self.backward_value is None:
                lines.append(f"{where}: error {self.max_abs_error:.3g}")
            else:
                error = abs(self.backward_value - self.numerical_value)
                lines.append(
                    f"{where}: backward {self.backward_value:.3g}, finite differences "
                    f"{self.numerical_value:.3g}, error {error:.3g} > tolerance "
                    f"{self.tolerance_for(rtol, atol):.2g}"
                )
            if self.worst_index is None and self.mode in ("fast", "directions"):
                lines[-1] += " (not localised to one element)"
        for kink in self.kinks:
            lines.append(
                f"input {_where(self.name, kink.index)} sits on a kink: one-sided "
                f"derivatives {kink.left:.3g} and {kink.right:.3g} (ReLU, max, |.|); "
                "move the check point"
            )
        return lines


@dataclass(frozen=True)
class GradcheckResult:
    """Per-input comparisons of one gradient check, in ``dtype`` (the coarsest of the
    differentiated inputs' and the outputs' dtypes)."""

    checks: tuple[InputCheck, ...]
    dtype: str = "float64"

    @property
    def max_rel_error(self) -> float:
        return max((c.max_rel_error for c in self.checks), default=0.0)

    @property
    def max_abs_error(self) -> float:
        return max((c.max_abs_error for c in self.checks), default=0.0)

    def __getitem__(self, name: str) -> InputCheck:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def status(self, rtol: float | None = None, atol: float | None = None) -> str:
        """``"failed"`` if an input fails, else ``"kink"`` if one sits on a kink, else
        ``"passed"``."""
        statuses = {c.status(rtol, atol) for c in self.checks}
        for status in ("failed", "kink"):
            if status in statuses:
                return status
        return "passed"

    def passed(self, rtol: float | None = None, atol: float | None = None) -> bool:
        return all(c.passed(rtol, atol) for c in self.checks)

    def summary(self, rtol: float | None = None, atol: float | None = None) -> str:
        rows = [
            f"{'input':<16}{'mode':<12}{'max abs err':>13}{'max rel err':>13}"
            f"{'noise floor':>13}{'step':>11}  result"
        ]
        notes = []
        for c in self.checks:
            rows.append(
                f"{c.name:<16}{c.mode:<12}{c.max_abs_error:>13.2e}"
                f"{c.max_rel_error:>13.2e}{c.noise_floor:>13.2e}{c.step:>11.1e}"
                f"  {c.status(rtol, atol)}"
            )
            notes += c.describe(rtol, atol)
        return "\n".join(rows + notes)


def assert_gradients(result: GradcheckResult, *, rtol: float | None = None,
                     atol: float | None = None) -> None:
    """Raise :class:`GradcheckError` unless every input passes (see :meth:`InputCheck.passed`),
    :class:`NonDifferentiablePoint` where the only failures are kinks. ``rtol``/``atol`` of
    None: the check's own tolerances."""
    if not isinstance(result, GradcheckResult):
        raise TypeError(f"result must be a GradcheckResult, got {type(result).__name__}")
    if rtol is not None:
        rtol = float(check_scalar(rtol, "rtol", low=0.0))
    if atol is not None:
        atol = float(check_scalar(atol, "atol", low=0.0))
    status = result.status(rtol, atol)
    if status == "passed":
        return
    used = [c._tolerances(rtol, atol) for c in result.checks]
    shown = (f"rtol={'/'.join(sorted({f'{r:.2g}' for r, _ in used}))}, "
             f"atol={'/'.join(sorted({f'{a:g}' for _, a in used}))}")
    if status == "kink":
        names = ", ".join(c.name for c in result.checks if c.status(rtol, atol) == "kink")
        raise NonDifferentiablePoint(
            f"gradient check cannot judge {names}: the check point sits on a kink "
            f"({shown}):\n" + result.summary(rtol, atol)
        )
    names = ", ".join(c.name for c in result.checks if c.status(rtol, atol) == "failed")
    raise GradcheckError(
        f"gradient check failed for {names} ({shown}):\n" + result.summary(rtol, atol)
    )


# --- what the forward and the backward hand back ----------------------------------------


def _real_parts(outputs: Any, what: str) -> tuple[np.ndarray, ...]:
    """The outputs as real arrays at their dtype; ``TypeError`` naming ``what`` otherwise."""
    parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    arrays = []
    for k, part in enumerate(parts):
        array = np.asarray(part) if not isinstance(part, (str, bytes)) else None
        if array is None or array.dtype == bool or not (
            np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
        ):
            raise TypeError(f"{what} returned a non-real output {k}: {_describe(part)}; "
                            "outputs must be real arrays or numbers")
        arrays.append(array)
    return tuple(arrays)


def _output_dtype(array: np.ndarray) -> np.dtype:
    """The dtype whose rounding an output carries (integers: exact, read as float64)."""
    return array.dtype if array.dtype in _DTYPES else np.dtype(np.float64)


def _evaluate(forward, inputs: Mapping[str, Any], what: str,
              dtypes: list | None = None) -> tuple[tuple[np.ndarray, ...], Any]:
    """``(outputs as float64 arrays, ctx)`` of ``forward(**inputs)``, its structure checked;
    the outputs' dtypes are appended to ``dtypes`` when given."""
    returned = forward(**inputs)
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TypeError(f"{what} must return a pair (outputs, ctx), got {_describe(returned)}")
    outputs, ctx = returned
    parts = _real_parts(outputs, what)
    if dtypes is not None:
        dtypes.extend(_output_dtype(p) for p in parts)
    return tuple(np.asarray(p, dtype=np.float64) for p in parts), ctx


def _first_bad(array: np.ndarray) -> str:
    bad = np.argwhere(~np.isfinite(array))[0]
    return f"{array[tuple(bad)]} at index {tuple(int(i) for i in bad)}"


def _check_outputs(outputs: tuple[np.ndarray, ...], where: str, what: str) -> None:
    for k, out in enumerate(outputs):
        if not np.all(np.isfinite(out)):
            raise ValueError(
                f"{what} returned a non-finite output {k} ({_first_bad(out)}) {where}; "
                f"finite differences need a neighbourhood of the check point where the "
                f"{what} is finite: move the check point (or pass a smaller step)"
            )


def _returned_fields(grads: Any) -> list[str]:
    if isinstance(grads, Mapping):
        return [str(k) for k in grads]
    if dataclasses.is_dataclass(grads):
        return [f.name for f in dataclasses.fields(grads)]
    return sorted(n for n in dir(grads) if not n.startswith("_"))


def _get_grad(grads: Any, name: str, shape: tuple[int, ...] | None = None, *,
              what: str = "backward") -> np.ndarray:
    """The gradient of ``name`` in what ``what`` (the backward, or a loss) returned, checked
    (GradcheckError), as float64."""
    if grads is None:
        raise GradcheckError(
            f"{what} returned None; it must return the gradients named after the inputs "
            "(a mapping or an object with one attribute per differentiated input)"
        )
    if isinstance(grads, Mapping):
        present = name in grads
        value = grads[name] if present else None
    else:
        present = hasattr(grads, name)
        value = getattr(grads, name) if present else None
    if not present:
        raise GradcheckError(
            f"{what} returned no gradient for {name!r} "
            f"(it returned {type(grads).__name__} with fields: {_returned_fields(grads)})"
        )
    if value is None:
        raise GradcheckError(f"{what} returned None as the gradient of {name!r}")
    array = np.asarray(value)
    if array.dtype == bool or not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise GradcheckError(
            f"{what} returned a gradient of dtype {array.dtype} for {name!r}; "
            "it must be real"
        )
    array = np.asarray(array, dtype=np.float64)
    if shape is not None and array.shape != tuple(shape):
        raise GradcheckError(
            f"{what} returned a gradient of shape {array.shape} for {name!r} "
            f"of shape {tuple(shape)}"
        )
    if not np.all(np.isfinite(array)):
        raise GradcheckError(
            f"{what} returned a non-finite gradient for {name!r}: {_first_bad(array)}"
        )
    return array


def _gradients(backward, ctx, upstream, wrt, inputs, nondet_tol) -> dict[str, np.ndarray]:
    """The backward's float64 gradients for ``upstream``; with ``nondet_tol``, a second call
    with the same upstream must agree within it (GradcheckError naming where not)."""
    grads = backward(ctx, *upstream)
    first = {name: _get_grad(grads, name, inputs[name].shape) for name in wrt}
    if nondet_tol is None:
        return first
    again = backward(ctx, *upstream)
    for name in wrt:
        second = _get_grad(again, name, inputs[name].shape)
        gap = np.abs(first[name] - second)
        if gap.size and float(np.max(gap)) > nondet_tol:
            index = np.unravel_index(int(np.argmax(gap)), gap.shape)
            index = tuple(int(i) for i in index)
            raise GradcheckError(
                f"backward is not deterministic for {_where(name, index)}: two calls with "
                f"the same upstream gradient gave {first[name][index]!r} and "
                f"{second[index]!r} (difference {gap[index]:.3g} > nondet_tol {nondet_tol:g})"
            )
    return first


def _default_wrt(inputs: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in inputs.items()
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)
    )


def _check_wrt(wrt: Any, inputs: Mapping[str, Any]) -> tuple[str, ...]:
    if wrt is None:
        names = _default_wrt(inputs)
        if not names:
            raise ValueError("wrt is empty: no floating-point array input to differentiate")
        return names
    if not isinstance(wrt, (tuple, list)):
        hint = f" (write wrt=({wrt!r},))" if isinstance(wrt, str) else ""
        raise TypeError(f"wrt must be a tuple or list of input names, got {_describe(wrt)}{hint}")
    names = tuple(wrt)
    if not names:
        raise ValueError("wrt is empty: name at least one input to differentiate")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"wrt must hold input names (str), got {name!r}")
        if name not in inputs:
            raise ValueError(f"wrt names {name!r}, which is not among the inputs {list(inputs)}")
    if len(set(names)) != len(names):
        raise ValueError(f"wrt names an input twice: {list(names)}")
    return names


def _as_checked_input(value: Any, name: str) -> np.ndarray:
    """A copy of a differentiated input at its dtype (float16/32/64; other floating types
    as float64); only floating-point inputs qualify."""
    array = np.asarray(value) if not isinstance(value, (str, bytes)) else None
    if (
        array is None
        or isinstance(value, bool)
        or not np.issubdtype(array.dtype, np.floating)
    ):
        what = type(value).__name__
        if array is not None:
            what += f" of dtype {array.dtype}"
        raise TypeError(
            f"wrt names {name!r}, which is a {what}; only floating-point inputs can be "
            "differentiated (integer arrays such as labels are passed through, not perturbed)"
        )
    dtype = array.dtype if array.dtype in _DTYPES else np.dtype(np.float64)
    array = np.array(array, dtype=dtype, copy=True)
    if array.size == 0:
        raise ValueError(f"{name} is empty (shape {array.shape}): nothing to differentiate")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite at the check point, got {_first_bad(array)}")
    return array


# --- the finite differences --------------------------------------------------------------


def _step(x: np.ndarray, step: float | None) -> float:
    if step is not None:
        return float(step)
    magnitude = float(np.max(np.abs(x.astype(np.float64))))
    # Below 1e-8 (all-zero or subnormal inputs) a relative step would vanish; use 1.
    eps_dtype = float(np.finfo(x.dtype).eps)
    return float(np.cbrt(eps_dtype) * (magnitude if magnitude > 1e-8 else 1.0))


class _Differencer:
    """Central (and one-sided) differences of the outputs, component by component, with
    their rounding, at the steps actually taken by the rounded perturbed inputs."""

    def __init__(self, forward, inputs, outputs, out_dtypes, what):
        self.forward = forward
        self.inputs = inputs
        self.shapes = tuple(o.shape for o in outputs)
        self.f0 = np.concatenate([o.ravel() for o in outputs])
        factors = [
            (_ROUNDING_FACTOR_HALF if d == np.float16 else _ROUNDING_FACTOR)
            * float(np.finfo(d).eps)
            for d in out_dtypes
        ]
        self.rounding = np.concatenate(
            [np.full(o.size, f) for o, f in zip(outputs, factors)]
        ) if outputs else np.zeros(0)
        self.what = what
        self.calls = 0

    def _outputs(self, trial, where) -> np.ndarray:
        self.calls += 1
        out, _ = _evaluate(self.forward, trial, self.what)
        if tuple(o.shape for o in out) != self.shapes:
            raise ValueError(
                f"{self.what} returned outputs of shapes {[o.shape for o in out]} {where}, "
                f"but {list(self.shapes)} at the check point"
            )
        _check_outputs(out, where, self.what)
        return np.concatenate([o.ravel() for o in out])

    def _points(self, name, idx, direction, h):
        """``x + h v`` and ``x - h v`` rounded to the input's dtype, and where they are."""
        x = self.inputs[name]
        x64 = x.astype(np.float64)
        if direction is None:
            xp, xm = x.copy(), x.copy()
            xp[idx] = x64[idx] + h
            xm[idx] = x64[idx] - h
            where = f"at {_where(name, idx)} +/- h (h = {h:.3g})"
        else:
            with np.errstate(over="ignore"):
                xp = (x64 + h * direction).astype(x.dtype)
                xm = (x64 - h * direction).astype(x.dtype)
            where = f"at {name} +/- h v along a random direction v (h = {h:.3g})"
        return xp, xm, where

    def _noise(self, fp, fm, h):
        with np.errstate(over="ignore", invalid="ignore"):
            noise = (0.5 * np.abs(fp) + 0.5 * np.abs(fm)) * self.rounding / h
            # Where the step moves some outputs, those it leaves bitwise unchanged do not
            # depend on this input: they carry no rounding error of the difference and must
            # not excuse one elsewhere. Where it moves none, the forward is numerically flat
            # along the step and every output's rounding bounds what the difference resolves.
            changed = fp != fm
            if np.any(changed):
                noise = np.where(changed, noise, 0.0)
        return noise

    def columns(self, name, idx, direction, h):
        """``(f(x + h v) - f(x - h v)) / 2h`` and its rounding error, per output component,
        and the direction taken, ``(x + h v) - (x - h v)`` over ``2h`` in float64 (for an
        element ``idx``, the difference is divided by the step taken there instead)."""
        xp, xm, where = self._points(name, idx, direction, h)
        taken = (xp.astype(np.float64) - xm.astype(np.float64)) / (2.0 * h)
        scale = 1.0
        if direction is None:
            # A step below the spacing of x there moves nothing: the difference is 0 and
            # every output's rounding at the nominal step bounds what it resolves.
            scale = float(taken[idx]) or 1.0
        fp = self._outputs({**self.inputs, name: xp}, where)
        fm = self._outputs({**self.inputs, name: xm}, where)
        with np.errstate(over="ignore", invalid="ignore"):
            fd = (fp - fm) / (2.0 * h * scale)
            noise = self._noise(fp, fm, h * scale)
        if not (np.all(np.isfinite(fd)) and np.all(np.isfinite(noise))):
            raise ValueError(
                f"the central difference of the forward overflows float64 {where}: the "
                "outputs are too large for the step; rescale the inputs or pass a larger step"
            )
        return fd, noise, taken

    def contracted(self, name, idx, direction, h, upstream) -> tuple[float, float, np.ndarray]:
        """``sum_k g_k (f_k(x + h v) - f_k(x - h v)) / 2h``, its rounding error and the
        direction taken (see :meth:`columns`)."""
        fd, noise, taken = self.columns(name, idx, direction, h)
        with np.errstate(over="ignore", invalid="ignore"):
            value = float(np.sum(upstream * fd))
            err = float(np.sum(np.abs(upstream) * noise))
        if not (np.isfinite(value) and np.isfinite(err)):
            raise ValueError(
                f"the contracted central difference for {name} overflows float64: the "
                "outputs are too large; rescale the inputs"
            )
        return value, err, taken

    def one_sided(self, name, idx, h):
        """Backward and forward one-sided differences per output component at element
        ``idx`` with step ``h``, and the rounding error of each."""
        x = self.inputs[name]
        xp, xm, where = self._points(name, idx, None, h)
        up = float(xp[idx]) - float(x[idx])
        down = float(x[idx]) - float(xm[idx])
        if up <= 0.0 or down <= 0.0:
            return None
        fp = self._outputs({**self.inputs, name: xp}, where)
        fm = self._outputs({**self.inputs, name: xm}, where)
        with np.errstate(over="ignore", invalid="ignore"):
            right, left = (fp - self.f0) / up, (self.f0 - fm) / down
            noise_right = self._noise(fp, self.f0, 0.5 * up)
            noise_left = self._noise(self.f0, fm, 0.5 * down)
        return left, right, noise_left, noise_right


# --- the comparisons -----------------------------------------------------------------------


def _kink_verdicts(limit, probed, analytic, rows) -> np.ndarray:
    """Rows (of one failing element) on a kink: the one-sided derivatives at ``h/4``
    disagree by more than the tolerance plus four times their rounding (an iterative
    solver's forward rounds beyond the model), the gap does not shrink with the step (a
    smooth one shrinks four-fold), and the backward lies between them (a value outside
    is wrong on either side: a failure, not a kink). The slack of that last test adds the
    drift of each side from ``h`` to ``h/4``, their truncation error."""
    left1, right1, left4, right4, noise4 = probed
    gap1, gap4 = np.abs(right1 - left1), np.abs(right4 - left4)
    slack = limit + noise4 + np.abs(left1 - left4) + np.abs(right1 - right4)
    between = ((analytic >= np.minimum(left4, right4) - slack)
               & (analytic <= np.maximum(left4, right4) + slack))
    on_kink = (gap4 > limit + 4.0 * noise4) & (gap4 > 0.5 * gap1) & between
    rows = np.asarray(rows, dtype=int)
    return rows[on_kink[rows]]


def _elementwise(name, x, mode, analytic, fd, noise, h, probe, tol, dtype, out_index=None):
    """The :class:`InputCheck` of an element-by-element comparison.

    ``analytic``, ``fd`` and ``noise`` are ``(rows, x.size)``: one row, the contracted
    ``J^T g`` (``"vjp"``), or one per output component (``"full"``). ``probe(idx)`` gives
    the one-sided differences at ``idx`` per row (left and right at h, left and right at
    h/4, the rounding of the latter), or None.
    """
    rtol, atol = tol
    with np.errstate(over="ignore", invalid="ignore"):
        diff = np.abs(analytic - fd)
    largest = float(max(np.max(np.abs(analytic), initial=0.0), np.max(np.abs(fd), initial=0.0)))
    limit = np.maximum(atol, noise) + rtol * largest
    excess = diff - limit
    kink = np.zeros(diff.shape, dtype=bool)
    kinks = []
    failing = np.nonzero(np.any(excess > 0, axis=0))[0]
    order = failing[np.argsort(-np.max(excess[:, failing], axis=0), kind="stable")]
    for col in order[:_KINK_PROBES]:
        idx = tuple(int(i) for i in np.unravel_index(col, x.shape))
        probed = probe(idx)
        if probed is None:
            continue
        rows = _kink_verdicts(limit[:, col], probed, analytic[:, col],
                              np.nonzero(excess[:, col] > 0)[0])
        if rows.size:
            kink[rows, col] = True
            left4, right4 = probed[2], probed[3]
            r = int(rows[np.argmax(np.abs(right4 - left4)[rows])])
            kinks.append(Kink(idx, float(left4[r]), float(right4[r]),
                              out_index(r) if out_index else None))
    keep = ~kink
    kept = np.where(keep, diff, 0.0)
    max_abs = float(np.max(kept, initial=0.0))
    above = float(np.max(np.where(keep, diff - noise, 0.0), initial=0.0))
    if largest > 0:
        rel = max_abs / largest
    else:
        rel = 0.0 if max_abs == 0.0 else float("inf")
    ranked = np.where(keep, diff - np.maximum(atol, noise), -np.inf)
    row, col = np.unravel_index(int(np.argmax(ranked)), diff.shape)
    return InputCheck(
        name, tuple(x.shape), mode, max_abs, rel, largest, h, 0,
        float(np.max(noise, initial=0.0)), max(above, 0.0),
        worst_index=tuple(int(i) for i in np.unravel_index(col, x.shape)),
        worst_output=out_index(int(row)) if out_index else None,
        backward_value=float(analytic[row, col]), numerical_value=float(fd[row, col]),
        worst_noise=float(noise[row, col]), kinks=tuple(kinks),
        dtype=str(dtype), rtol=rtol, atol=atol,
    )


def _contracted_probe(differ, name, h, upstream):
    def probe(idx):
        sides = []
        for step in (h, h / 4.0):
            found = differ.one_sided(name, idx, step)
            if found is None:
                return None
            left, right, noise_left, noise_right = found
            sides.append((float(np.sum(upstream * left)), float(np.sum(upstream * right)),
                          float(np.sum(np.abs(upstream) * (noise_left + noise_right)))))
        (l1, r1, _), (l4, r4, n4) = sides
        return tuple(np.array([v]) for v in (l1, r1, l4, r4, n4))

    return probe


def _vjp_check(differ, name, x, a, h, upstream, tol, dtype, mode="vjp") -> InputCheck:
    start = differ.calls
    fd, noise = np.empty(x.shape), np.empty(x.shape)
    for idx in np.ndindex(x.shape):
        fd[idx], noise[idx], _ = differ.contracted(name, idx, None, h, upstream)
    check = _elementwise(name, x, mode, a.reshape(1, -1), fd.reshape(1, -1),
                         noise.reshape(1, -1), h, _contracted_probe(differ, name, h, upstream),
                         tol, dtype)
    return dataclasses.replace(check, n_forward_calls=differ.calls - start)


def _directional_check(name, x, mode, an, fd, noise, a_norm, h, tol, dtype, calls):
    rtol, atol = tol
    an, fd, noise = np.asarray(an), np.asarray(fd), np.asarray(noise)
    diff = np.abs(an - fd)
    scale = float(max(a_norm, np.max(np.abs(an)), np.max(np.abs(fd))))
    max_abs = float(np.max(diff))
    rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0.0 else float("inf"))
    k = int(np.argmax(diff - np.maximum(atol, noise)))
    return InputCheck(
        name, tuple(x.shape), mode, max_abs, rel, scale, h, calls,
        float(np.max(noise)), max(float(np.max(diff - noise)), 0.0),
        backward_value=float(an[k]), numerical_value=float(fd[k]), worst_noise=float(noise[k]),
        dtype=str(dtype), rtol=rtol, atol=atol,
    ), k


def _directions(differ, name, x, a, h, upstream, n_directions, rng, mode, tol, dtype,
                localize) -> InputCheck:
    """``"directions"``/``"fast"``: random unit directions; localised when it fails."""
    start = differ.calls
    fd, noise, an, directions = [], [], [], []
    for _ in range(n_directions):
        v = rng.standard_normal(x.shape)
        v /= np.linalg.norm(v)
        value, err, taken = differ.contracted(name, None, v, h, upstream)
        fd.append(value)
        noise.append(err)
        an.append(float(np.sum(a * taken)))
        directions.append(v)
    a_norm = float(np.linalg.norm(a))
    check, k = _directional_check(name, x, mode, an, fd, noise, a_norm, h, tol, dtype,
                                  differ.calls - start)
    if not localize or check.status() != "failed":
        return check
    if x.size <= VJP_LIMIT:
        local = _vjp_check(differ, name, x, a, h, upstream, tol, dtype, mode)
        return dataclasses.replace(local, n_forward_calls=differ.calls - start,
                                   localization="vjp")
    return _bisect(differ, check, x, a, directions[k], h, upstream, tol, start)


def _bisect(differ, check, x, a, v, h, upstream, tol, start) -> InputCheck:
    """Follow the halves of ``v``'s index set whose restricted (renormalised) direction
    disagrees beyond the tolerance, down to one element (module docstring)."""
    rtol, atol = tol
    name, n = check.name, x.size
    flat_v = v.ravel()
    frontier, leaf = [np.arange(n)], None
    while frontier and leaf is None:
        found = []
        for subset in frontier:
            for half in np.array_split(subset, 2):
                d = np.zeros(n)
                d[half] = flat_v[half]
                norm = float(np.linalg.norm(d))
                if norm == 0.0:
                    continue
                value, err, taken = differ.contracted(name, None, (d / norm).reshape(x.shape),
                                                      h, upstream)
                an = float(np.sum(a * taken))
                excess = abs(an - value) - (max(atol, err) + rtol * check.scale)
                if excess > 0:
                    found.append((excess, half, value, err, taken))
        found.sort(key=lambda f: -f[0])
        singles = [f for f in found if f[1].size == 1]
        leaf = singles[0] if singles else None
        frontier = [f[1] for f in found[:_BISECTION_BRANCHES]]
    if leaf is None:  # the disagreement is spread over many elements
        return dataclasses.replace(check, n_forward_calls=differ.calls - start,
                                   localization="bisection")
    _, half, value, err, taken = leaf
    i = int(half[0])
    idx = tuple(int(j) for j in np.unravel_index(i, x.shape))
    t = float(taken.ravel()[i])
    local = dataclasses.replace(
        check, worst_index=idx, backward_value=float(a[idx]), numerical_value=value / t,
        worst_noise=err / abs(t), localization="bisection",
    )
    probed = _contracted_probe(differ, name, h, upstream)(idx)
    if probed is not None:
        limit = np.array([max(atol, local.worst_noise) + rtol * check.scale])
        if _kink_verdicts(limit, probed, np.array([float(a[idx])]), [0]).size:
            # The element is a kink: judge the direction without it.
            w = v.copy()
            w[idx] = 0.0
            w /= np.linalg.norm(w)
            value, err, taken = differ.contracted(name, None, w, h, upstream)
            rest, _ = _directional_check(name, x, check.mode, [float(np.sum(a * taken))],
                                         [value], [err], check.scale, h, tol, check.dtype, 0)
            local = dataclasses.replace(
                rest, kinks=(Kink(idx, float(probed[2][0]), float(probed[3][0])),),
                localization="bisection",
            )
    return dataclasses.replace(local, n_forward_calls=differ.calls - start)


def check_gradients(
    forward: Callable[..., tuple[Any, Any]],
    backward: Callable[..., Any],
    inputs: Mapping[str, Any],
    *,
    wrt: tuple[str, ...] | list[str] | None = None,
    mode: str = "auto",
    step: float | None = None,
    n_directions: int = 8,
    rng: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    localize: bool = True,
    nondet_tol: float | None = None,
) -> GradcheckResult:
    """Compare ``backward`` with central finite differences of ``forward``.

    Parameters
    ----------
    forward : callable
        ``forward(**inputs) -> (outputs, ctx)``. It must not modify its inputs.
    backward : callable
        ``backward(ctx, *grad_outputs) -> grads`` with ``grads`` a mapping or an object
        with one attribute per name in ``wrt``.
    inputs : mapping
        Keyword arguments of ``forward``. Non-array entries (hyperparameters, labels)
        are passed through unchanged.
    wrt : tuple or list of str, optional
        Inputs to differentiate (floating-point arrays or scalars, kept at their dtype);
        default every floating-point ndarray in ``inputs``. A bare string is refused
        (``TypeError``).
    mode : {"auto", "full", "vjp", "directions", "fast"}
        See the module docstring.
    step : float, optional
        Finite-difference step (finite, > 0); default ``cbrt(eps) * max|x|`` per input.
    n_directions : int
        Number of random directions per input in ``"directions"`` mode (>= 1).
    rng : None, int or numpy.random.Generator
        Source of the upstream gradient and the directions.
    rtol, atol : float, optional
        Tolerances the check judges by (finite, >= 0): which elements to probe for kinks,
        whether to localise; stored in the result. Default :func:`default_tolerances`.
    localize : bool
        Localise a failing ``"fast"``/``"directions"`` check to one element.
    nondet_tol : float, optional
        Call the backward twice and bound the difference of its gradients (>= 0).

    Returns
    -------
    GradcheckResult
        Per input: max absolute and relative error, scale, noise floor, step, the worst
        element and any kinks.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, or a forward that is non-finite at or next to the check point.
    GradcheckError
        The backward returned a missing, misshapen, non-finite or (``nondet_tol``)
        non-deterministic gradient.
    """
    return _check_gradients(forward, backward, inputs, wrt=wrt, mode=mode, step=step,
                            n_directions=n_directions, rng=rng, rtol=rtol, atol=atol,
                            localize=localize, nondet_tol=nondet_tol, what="forward")


def _check_gradients(forward, backward, inputs, *, wrt, mode, step, n_directions, rng,
                     rtol, atol, localize, nondet_tol, what: str) -> GradcheckResult:
    """:func:`check_gradients`; ``what`` names the user's function in errors ("forward",
    "loss")."""
    if not callable(forward):
        raise TypeError(f"forward must be callable, got {type(forward).__name__}")
    if not callable(backward):
        raise TypeError(f"backward must be callable, got {type(backward).__name__}")
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a mapping of keyword arguments, got {type(inputs).__name__}"
        )
    check_choice(mode, "mode", MODES)
    if step is not None:
        step = float(check_scalar(step, "step", low=0.0, low_inclusive=False))
    n_directions = int(check_scalar(n_directions, "n_directions", low=1, integer=True))
    rng = check_rng(rng)
    if rtol is not None:
        rtol = float(check_scalar(rtol, "rtol", low=0.0))
    if atol is not None:
        atol = float(check_scalar(atol, "atol", low=0.0))
    localize = check_flag(localize, "localize")
    if nondet_tol is not None:
        nondet_tol = float(check_scalar(nondet_tol, "nondet_tol", low=0.0))
    inputs = dict(inputs)
    wrt = _check_wrt(wrt, inputs)
    for name in wrt:
        inputs[name] = _as_checked_input(inputs[name], name)

    out_dtypes: list[np.dtype] = []
    outputs, ctx = _evaluate(forward, inputs, what, out_dtypes)
    _check_outputs(outputs, "at the check point", what)
    differ = _Differencer(forward, inputs, outputs, out_dtypes, what)
    coarse = _coarsest(out_dtypes) if out_dtypes else np.dtype(np.float64)
    dtypes = {name: _coarsest([inputs[name].dtype, coarse]) for name in wrt}
    tols = {
        name: (default_tolerances(dtypes[name])[0] if rtol is None else rtol,
               0.0 if atol is None else atol)
        for name in wrt
    }
    dtype = str(_coarsest([coarse, *dtypes.values()]))

    n_out = sum(o.size for o in outputs)
    n_in = sum(inputs[name].size for name in wrt)
    if mode == "auto":
        if n_in * n_out <= FULL_JACOBIAN_LIMIT:
            mode = "full"
        elif n_in <= VJP_LIMIT:
            mode = "vjp"
        else:
            mode = "directions"
    if mode == "full":
        checks = _check_full(differ, backward, inputs, ctx, outputs, out_dtypes, wrt, step,
                             tols, dtypes, nondet_tol)
        return GradcheckResult(checks, dtype)

    upstream = tuple(np.asarray(rng.standard_normal(o.shape), dtype=d)
                     for o, d in zip(outputs, out_dtypes))
    flat_upstream = np.concatenate([g.astype(np.float64).ravel() for g in upstream])
    analytic = _gradients(backward, ctx, upstream, wrt, inputs, nondet_tol)
    checks = []
    for name in wrt:
        x, a, h = inputs[name], analytic[name], _step(inputs[name], step)
        if mode == "vjp":
            checks.append(_vjp_check(differ, name, x, a, h, flat_upstream, tols[name],
                                     dtypes[name]))
        else:
            count = 1 if mode == "fast" else n_directions
            checks.append(_directions(differ, name, x, a, h, flat_upstream, count, rng, mode,
                                      tols[name], dtypes[name], localize))
    return GradcheckResult(tuple(checks), dtype)


def check_loss(
    loss: Callable[..., tuple[float, Any]],
    inputs: Mapping[str, Any],
    *,
    wrt: tuple[str, ...] | list[str] | None = None,
    mode: str = "auto",
    step: float | None = None,
    n_directions: int = 8,
    rng: Any = None,
    rtol: float | None = None,
    atol: float | None = None,
    localize: bool = True,
) -> GradcheckResult:
    """Check a loss of the form ``value, grads = loss(**inputs)``.

    The gradient returned with the value is treated as the vector-Jacobian product for
    an upstream gradient of 1 (scaled by a random upstream scalar). Arguments and errors
    as in :func:`check_gradients` (no ``nondet_tol``: the gradient comes with the value,
    from one call).
    """
    if not callable(loss):
        raise TypeError(f"loss must be callable, got {type(loss).__name__}")
    if not isinstance(inputs, Mapping):
        raise TypeError(
            f"inputs must be a mapping of keyword arguments, got {type(inputs).__name__}"
        )
    names = _check_wrt(wrt, inputs)

    def forward(**kw):
        returned = loss(**kw)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise TypeError(f"loss must return a pair (value, grads), got {_describe(returned)}")
        value, grads = returned
        (value,) = _real_parts(value, "loss")
        if value.shape != ():
            raise ValueError(f"loss must return a scalar value, got one of shape {value.shape}")
        return value, grads

    def backward(grads, upstream):
        scale = float(np.asarray(upstream))
        return {name: scale * _get_grad(grads, name, what="loss") for name in names}

    return _check_gradients(
        forward, backward, inputs, wrt=names, mode=mode, step=step,
        n_directions=n_directions, rng=rng, rtol=rtol, atol=atol, localize=localize,
        nondet_tol=None, what="loss",
    )


def _check_full(differ, backward, inputs, ctx, outputs, out_dtypes, wrt, step, tols, dtypes,
                nondet_tol) -> tuple[InputCheck, ...]:
    """Whole Jacobian: backward with unit upstream vectors vs column-wise differences."""
    sizes = [o.size for o in outputs]
    n_out = sum(sizes)
    owners = [(k, o.shape) for k, o in enumerate(outputs) for _ in range(o.size)]
    offsets = np.cumsum([0, *sizes])

    def out_index(row):
        k, shape = owners[row]
        return (k, *(int(i) for i in np.unravel_index(row - offsets[k], shape)))

    # Rows of the analytic Jacobian, one backward call per output component.
    rows: dict[str, list[np.ndarray]] = {name: [] for name in wrt}
    for k in range(n_out):
        parts = []
        for j, (o, d) in enumerate(zip(outputs, out_dtypes)):
            unit = np.zeros(o.size, dtype=d)
            if offsets[j] <= k < offsets[j + 1]:
                unit[k - offsets[j]] = 1
            parts.append(unit.reshape(o.shape))
        grads = _gradients(backward, ctx, parts, wrt, inputs, nondet_tol)
        for name in wrt:
            rows[name].append(grads[name].ravel())

    checks = []
    for name in wrt:
        start = differ.calls
        x = inputs[name]
        h = _step(x, step)
        analytic = np.array(rows[name]).reshape(n_out, x.size)
        fd = np.empty_like(analytic)
        noise = np.empty_like(analytic)
        for col, idx in enumerate(np.ndindex(x.shape)):
            fd[:, col], noise[:, col], _ = differ.columns(name, idx, None, h)

        def probe(idx, name=name, h=h):
            sides = []
            for s in (h, h / 4.0):
                found = differ.one_sided(name, idx, s)
                if found is None:
                    return None
                sides.append(found)
            (l1, r1, _, _), (l4, r4, nl4, nr4) = sides
            return l1, r1, l4, r4, nl4 + nr4

        check = _elementwise(name, x, "full", analytic, fd, noise, h, probe, tols[name],
                             dtypes[name], out_index)
        checks.append(dataclasses.replace(check, n_forward_calls=differ.calls - start))
    return tuple(checks)
