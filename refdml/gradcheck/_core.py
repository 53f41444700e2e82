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

Every check contracts the outputs with a random upstream gradient ``g`` and compares
the hand-written vector-Jacobian product ``J^T g`` with central differences of
``phi(x) = <g, f(x)>`` in float64:

``"full"``
    the whole Jacobian: one backward call per output component against one pair of
    forward calls per input component (small problems only);
``"vjp"``
    every component of ``J^T g`` against central differences of ``phi``;
``"directions"``
    ``<J^T g, v>`` against the central difference of ``phi`` along random unit
    directions ``v`` (large inputs).

``"auto"`` picks ``full`` when inputs times outputs is at most ``FULL_JACOBIAN_LIMIT``,
``vjp`` when the inputs have at most ``VJP_LIMIT`` components, else ``directions``.

Errors
------
For each input the harness reports the largest absolute difference, the scale (the
largest magnitude of either derivative; for ``directions`` also the 2-norm of ``J^T g``,
which bounds every directional derivative) and the relative error
``max_abs_error / scale``. A check passes when
``max_abs_error <= atol + rtol * scale``, or when every difference is within
``noise + rtol * scale`` where ``noise`` is the rounding error of that very central
difference: ``100 * eps * sum_k |g_k| (|f_k(x+h)| + |f_k(x-h)|) / (2h)`` over the output
components ``k`` that the step changed. Outputs the step leaves bitwise unchanged while it
moves others do not depend on that input: they add no rounding error (and none is
excused), so a huge output that does not depend on an input cannot hide a wrong gradient
of that input; the differences are contracted component by component,
``sum_k g_k (f_k(x+h) - f_k(x-h))``, so such an output costs no precision either. Where the
step moves no output at all (the forward is numerically flat there, e.g. an input the
constraints pin down), the sum runs over every output: that is all the difference can
resolve. The floor matters only where the true gradient is (close to) zero; a gradient
whose error exceeds the rounding of its own finite difference always fails, whatever the
size of the outputs. The largest such floor is reported as ``noise_floor``; a check whose
``scale`` is below it could not resolve the gradient at this step.

The step is ``h = cbrt(machine epsilon) * max|x|`` (``cbrt(eps)`` when ``max|x| < 1e-8``)
unless given: the step that balances truncation (O(h^2)) and rounding (O(eps/h)) for a
function whose scale of variation is that of its input.
Central differences across a kink (a hinge, a max, a norm at zero) are meaningless:
draw inputs away from kinks. Where the true gradient vanishes but the third derivative
does not (a cosine similarity of exactly parallel vectors), the O(h^2) truncation error is
all that is measured: pass a smaller ``step`` or an ``atol`` there.

What the harness refuses
------------------------
It never turns a defect into a pass. ``ValueError`` (naming the parameter and the value)
for ``rtol``/``atol`` negative, NaN or infinite, ``step`` not a finite positive number,
``n_directions <= 0`` (``TypeError`` if not an integer), ``wrt`` naming an input that is
missing, empty, non-finite (``TypeError`` if it is not floating point, and for a ``wrt``
that is not a tuple or list of names: a bare string included), and a forward (or
:func:`check_loss`'s loss, named as such) whose outputs are non-finite at the check point
or at a finite-difference point; ``TypeError`` for a forward that does not return
``(outputs, ctx)`` with real outputs (a loss: ``(value, grads)``, a real scalar value);
:class:`GradcheckError` when the backward returns no gradient for a differentiated input,
one of the wrong shape, or a non-finite one.

The three modes share the step, the noise floor, the comparison rule and the argument
checks, and are one algorithm read together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import _describe, check_choice, check_rng, check_scalar

__all__ = [
    "FULL_JACOBIAN_LIMIT",
    "VJP_LIMIT",
    "GradcheckError",
    "GradcheckResult",
    "InputCheck",
    "assert_gradients",
    "check_gradients",
    "check_loss",
]

FULL_JACOBIAN_LIMIT = 4096
VJP_LIMIT = 2000
_MODES = ("auto", "full", "vjp", "directions")
#: Rounding error of one forward evaluation, in units of machine epsilon times |f|.
_ROUNDING_FACTOR = 100.0
_EPS = float(np.finfo(np.float64).eps)


class GradcheckError(AssertionError):
    """A backward pass is wrong: it disagrees with finite differences beyond the stated
    tolerance, or it returned a missing, misshapen or non-finite gradient."""


def _check_tolerances(rtol: Any, atol: Any) -> tuple[float, float]:
    return (
        float(check_scalar(rtol, "rtol", low=0.0)),
        float(check_scalar(atol, "atol", low=0.0)),
    )


@dataclass(frozen=True)
class InputCheck:
    """The comparison for one differentiated input.

    ``max_error_above_noise`` is the largest amount by which a difference exceeds the
    rounding error of its own finite difference (0 when every difference is within it);
    ``noise_floor`` is the largest such rounding error.
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

    def passed(self, rtol: float, atol: float = 0.0) -> bool:
        """True when ``max_abs_error <= atol + rtol * scale``, or when every difference is
        within its own rounding error plus ``rtol * scale`` (see the module docstring).

        ``rtol`` and ``atol`` must be finite and non-negative (``ValueError`` otherwise).
        """
        rtol, atol = _check_tolerances(rtol, atol)
        bound = rtol * self.scale
        if self.max_abs_error <= atol + bound:
            return True
        above = self.max_error_above_noise
        if above is None:  # built by hand without per-component floors
            above = self.max_abs_error - self.noise_floor
        return bool(above <= bound)


@dataclass(frozen=True)
class GradcheckResult:
    """Per-input comparisons of one gradient check."""

    checks: tuple[InputCheck, ...]

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

    def passed(self, rtol: float, atol: float = 0.0) -> bool:
        rtol, atol = _check_tolerances(rtol, atol)
        return all(c.passed(rtol, atol) for c in self.checks)

    def summary(self) -> str:
        rows = [
            f"{'input':<16}{'mode':<12}{'max abs err':>13}{'max rel err':>13}"
            f"{'noise floor':>13}{'step':>11}"
        ]
        for c in self.checks:
            rows.append(
                f"{c.name:<16}{c.mode:<12}{c.max_abs_error:>13.2e}"
                f"{c.max_rel_error:>13.2e}{c.noise_floor:>13.2e}{c.step:>11.1e}"
            )
        return "\n".join(rows)


def assert_gradients(result: GradcheckResult, *, rtol: float, atol: float = 0.0) -> None:
    """Raise :class:`GradcheckError` unless every input passes (see :meth:`InputCheck.passed`)."""
    if not isinstance(result, GradcheckResult):
        raise TypeError(f"result must be a GradcheckResult, got {type(result).__name__}")
    rtol, atol = _check_tolerances(rtol, atol)
    failed = [c for c in result.checks if not c.passed(rtol, atol)]
    if failed:
        names = ", ".join(c.name for c in failed)
        raise GradcheckError(
            f"gradient check failed for {names} (rtol={rtol:g}, atol={atol:g}):\n"
            + result.summary()
        )


# --- what the forward and the backward hand back ----------------------------------------


def _as_tuple(outputs: Any, what: str) -> tuple[np.ndarray, ...]:
    """The outputs as float64 arrays; ``TypeError`` naming ``what`` for a non-real one."""
    parts = tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)
    arrays = []
    for k, part in enumerate(parts):
        array = np.asarray(part) if not isinstance(part, (str, bytes)) else None
        if array is None or array.dtype == bool or not (
            np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
        ):
            raise TypeError(f"{what} returned a non-real output {k}: {_describe(part)}; "
                            "outputs must be real arrays or numbers")
        arrays.append(np.asarray(array, dtype=np.float64))
    return tuple(arrays)


def _evaluate(forward, inputs: Mapping[str, Any], what: str) -> tuple[tuple[np.ndarray, ...], Any]:
    """``(outputs as float64 arrays, ctx)`` of ``forward(**inputs)``, its structure checked."""
    returned = forward(**inputs)
    if not (isinstance(returned, tuple) and len(returned) == 2):
        raise TypeError(f"{what} must return a pair (outputs, ctx), got {_describe(returned)}")
    outputs, ctx = returned
    return _as_tuple(outputs, what), ctx


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
    (GradcheckError)."""
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
    """A copy of a differentiated input as float64; only floating-point inputs qualify."""
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
    array = np.array(array, dtype=np.float64, copy=True)
    if array.size == 0:
        raise ValueError(f"{name} is empty (shape {array.shape}): nothing to differentiate")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite at the check point, got {_first_bad(array)}")
    return array


# --- the finite differences --------------------------------------------------------------


def _step(x: np.ndarray, step: float | None) -> float:
    if step is not None:
        return float(step)
    magnitude = float(np.max(np.abs(x)))
    # Below 1e-8 (all-zero or subnormal inputs) a relative step would vanish; use 1.
    return float(np.cbrt(_EPS) * (magnitude if magnitude > 1e-8 else 1.0))


class _Differencer:
    """Central differences of the outputs, component by component, with their rounding."""

    def __init__(self, forward, inputs, shapes, what):
        self.forward = forward
        self.inputs = inputs
        self.shapes = shapes
        self.what = what

    def _outputs(self, trial, where) -> np.ndarray:
        out, _ = _evaluate(self.forward, trial, self.what)
        if tuple(o.shape for o in out) != self.shapes:
            raise ValueError(
                f"{self.what} returned outputs of shapes {[o.shape for o in out]} {where}, "
                f"but {list(self.shapes)} at the check point"
            )
        _check_outputs(out, where, self.what)
        return np.concatenate([o.ravel() for o in out])

    def columns(self, name, idx, direction, h) -> tuple[np.ndarray, np.ndarray]:
        """``(f(x + h v) - f(x - h v)) / 2h`` and its rounding error, per output component."""
        x = self.inputs[name]
        xp, xm = x.copy(), x.copy()
        if direction is None:
            xp[idx] += h
            xm[idx] -= h
            where = f"at {name}[{', '.join(map(str, idx))}] +/- h (h = {h:.3g})"
        else:
            xp += h * direction
            xm -= h * direction
            where = f"at {name} +/- h v along a random direction v (h = {h:.3g})"
        fp = self._outputs({**self.inputs, name: xp}, where)
        fm = self._outputs({**self.inputs, name: xm}, where)
        with np.errstate(over="ignore", invalid="ignore"):
            fd = (fp - fm) / (2.0 * h)
            noise = (0.5 * np.abs(fp) + 0.5 * np.abs(fm)) * (_ROUNDING_FACTOR * _EPS) / h
            # Where the step moves some outputs, those it leaves bitwise unchanged do not
            # depend on this input: they carry no rounding error of the difference and must
            # not excuse one elsewhere. Where it moves none, the forward is numerically flat
            # along the step and every output's rounding bounds what the difference resolves.
            changed = fp != fm
            if np.any(changed):
                noise = np.where(changed, noise, 0.0)
        if not (np.all(np.isfinite(fd)) and np.all(np.isfinite(noise))):
            raise ValueError(
                f"the central difference of the forward overflows float64 {where}: the "
                "outputs are too large for the step; rescale the inputs or pass a larger step"
            )
        return fd, noise

    def contracted(self, name, idx, direction, h, upstream) -> tuple[float, float]:
        """``sum_k g_k (f_k(x + h v) - f_k(x - h v)) / 2h`` and its rounding error."""
        fd, noise = self.columns(name, idx, direction, h)
        with np.errstate(over="ignore", invalid="ignore"):
            value = float(np.sum(upstream * fd))
            err = float(np.sum(np.abs(upstream) * noise))
        if not (np.isfinite(value) and np.isfinite(err)):
            raise ValueError(
                f"the contracted central difference for {name} overflows float64: the "
                "outputs are too large; rescale the inputs"
            )
        return value, err


def _compare(name, shape, mode, analytic, fd, noise, scale, h, calls) -> InputCheck:
    analytic, fd, noise = np.asarray(analytic), np.asarray(fd), np.asarray(noise)
    with np.errstate(over="ignore"):
        diff = np.abs(analytic - fd)
    max_abs = float(np.max(diff)) if diff.size else 0.0
    above = float(np.max(diff - noise)) if diff.size else 0.0
    largest = float(max(np.max(np.abs(analytic), initial=0.0), np.max(np.abs(fd), initial=0.0)))
    scale = largest if scale is None else max(float(scale), largest)
    if scale > 0:
        rel = max_abs / scale
    else:
        rel = 0.0 if max_abs == 0.0 else float("inf")
    return InputCheck(
        name, tuple(shape), mode, max_abs, rel, scale, h, calls,
        float(np.max(noise, initial=0.0)), max(above, 0.0),
    )


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
        Inputs to differentiate (floating-point arrays or scalars); default every
        floating-point ndarray in ``inputs``. A bare string is refused (``TypeError``).
    mode : {"auto", "full", "vjp", "directions"}
        See the module docstring.
    step : float, optional
        Finite-difference step (finite, > 0); default ``cbrt(eps) * max|x|`` per input.
    n_directions : int
        Number of random directions per input in ``"directions"`` mode (>= 1).
    rng : None, int or numpy.random.Generator
        Source of the upstream gradient and the directions.

    Returns
    -------
    GradcheckResult
        Per input: max absolute and relative error, scale, noise floor and step used.

    Raises
    ------
    TypeError, ValueError
        Bad arguments, or a forward that is non-finite at or next to the check point.
    GradcheckError
        The backward returned a missing, misshapen or non-finite gradient.
    """
    return _check_gradients(forward, backward, inputs, wrt=wrt, mode=mode, step=step,
                            n_directions=n_directions, rng=rng, what="forward")


def _check_gradients(forward, backward, inputs, *, wrt, mode, step, n_directions, rng,
                     what: str) -> GradcheckResult:
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
    check_choice(mode, "mode", _MODES)
    if step is not None:
        step = float(check_scalar(step, "step", low=0.0, low_inclusive=False))
    n_directions = int(check_scalar(n_directions, "n_directions", low=1, integer=True))
    rng = check_rng(rng)
    inputs = dict(inputs)
    wrt = _check_wrt(wrt, inputs)
    for name in wrt:
        inputs[name] = _as_checked_input(inputs[name], name)

    outputs, ctx = _evaluate(forward, inputs, what)
    _check_outputs(outputs, "at the check point", what)
    shapes = tuple(o.shape for o in outputs)
    differ = _Differencer(forward, inputs, shapes, what)

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
        return _check_full(differ, backward, inputs, ctx, outputs, wrt, step)

    upstream = tuple(rng.standard_normal(o.shape) for o in outputs)
    flat_upstream = np.concatenate([g.ravel() for g in upstream])
    analytic = backward(ctx, *upstream)
    checks = []
    for name in wrt:
        x = inputs[name]
        a = _get_grad(analytic, name, x.shape)
        h = _step(x, step)
        if mode == "vjp":
            fd, noise = np.empty_like(x), np.empty_like(x)
            for idx in np.ndindex(x.shape):
                fd[idx], noise[idx] = differ.contracted(name, idx, None, h, flat_upstream)
            checks.append(_compare(name, x.shape, "vjp", a, fd, noise, None, h, 2 * x.size))
        else:
            fd_dirs, noise_dirs, an_dirs = [], [], []
            for _ in range(n_directions):
                v = rng.standard_normal(x.shape)
                v /= np.linalg.norm(v)
                value, err = differ.contracted(name, None, v, h, flat_upstream)
                fd_dirs.append(value)
                noise_dirs.append(err)
                an_dirs.append(float(np.sum(a * v)))
            checks.append(
                _compare(
                    name, x.shape, "directions", an_dirs, fd_dirs, noise_dirs,
                    float(np.linalg.norm(a)), h, 2 * n_directions,
                )
            )
    return GradcheckResult(tuple(checks))


def check_loss(
    loss: Callable[..., tuple[float, Any]],
    inputs: Mapping[str, Any],
    *,
    wrt: tuple[str, ...] | list[str] | None = None,
    mode: str = "auto",
    step: float | None = None,
    n_directions: int = 8,
    rng: Any = None,
) -> GradcheckResult:
    """Check a loss of the form ``value, grads = loss(**inputs)``.

    The gradient returned with the value is treated as the vector-Jacobian product for
    an upstream gradient of 1 (scaled by a random upstream scalar). Arguments and errors
    as in :func:`check_gradients`.
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
        (value,) = _as_tuple(value, "loss")
        if value.shape != ():
            raise ValueError(f"loss must return a scalar value, got one of shape {value.shape}")
        return value, grads

    def backward(grads, upstream):
        scale = float(np.asarray(upstream))
        return {name: scale * _get_grad(grads, name, what="loss") for name in names}

    return _check_gradients(
        forward, backward, inputs, wrt=names, mode=mode, step=step,
        n_directions=n_directions, rng=rng, what="loss",
    )


def _check_full(differ, backward, inputs, ctx, outputs, wrt, step) -> GradcheckResult:
    """Whole Jacobian: backward with unit upstream vectors vs column-wise differences."""
    sizes = [o.size for o in outputs]
    n_out = sum(sizes)
    # Rows of the analytic Jacobian, one backward call per output component.
    rows: dict[str, list[np.ndarray]] = {name: [] for name in wrt}
    for k in range(n_out):
        unit = np.zeros(n_out)
        unit[k] = 1.0
        parts, start = [], 0
        for o, s in zip(outputs, sizes):
            parts.append(unit[start : start + s].reshape(o.shape))
            start += s
        grads = backward(ctx, *parts)
        for name in wrt:
            rows[name].append(_get_grad(grads, name, inputs[name].shape).ravel())

    checks = []
    for name in wrt:
        x = inputs[name]
        h = _step(x, step)
        analytic = np.array(rows[name]).reshape(n_out, x.size)
        fd = np.empty_like(analytic)
        noise = np.empty_like(analytic)
        for col, idx in enumerate(np.ndindex(x.shape)):
            fd[:, col], noise[:, col] = differ.columns(name, idx, None, h)
        checks.append(_compare(name, x.shape, "full", analytic, fd, noise, None, h, 2 * x.size))
    return GradcheckResult(tuple(checks))
