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
largest magnitude of either derivative; for ``directions`` the 2-norm of ``J^T g``,
which bounds every directional derivative) and the relative error
``max_abs_error / scale``. A check passes when
``max_abs_error <= max(atol, noise_floor) + rtol * scale``, where the noise floor
``100 * eps * sum|g * f(x)| / h`` is the rounding error a central difference of the
contracted output cannot get below; it only matters when the true gradient is (close
to) zero, where a relative error is meaningless. The step is ``h = cbrt(machine epsilon) * max|x|`` (``cbrt(eps)`` when
``max|x| < 1e-8``) unless given: the step that balances truncation (O(h^2)) and rounding
(O(eps/h)) for a function whose scale of variation is that of its input.
Central differences across a kink (a hinge, a max, a norm at zero) are meaningless:
draw inputs away from kinks. Where the true gradient vanishes but the third derivative
does not (a cosine similarity of exactly parallel vectors), the O(h^2) truncation error is
all that is measured: pass a smaller ``step`` or an ``atol`` there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml._validation import check_choice, check_rng

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


class GradcheckError(AssertionError):
    """A backward pass disagrees with finite differences beyond the stated tolerance."""


@dataclass(frozen=True)
class InputCheck:
    """The comparison for one differentiated input."""

    name: str
    shape: tuple[int, ...]
    mode: str
    max_abs_error: float
    max_rel_error: float
    scale: float
    step: float
    n_forward_calls: int
    noise_floor: float = 0.0

    def passed(self, rtol: float, atol: float = 0.0) -> bool:
        """True when ``max_abs_error <= max(atol, noise_floor) + rtol * scale``."""
        return bool(self.max_abs_error <= max(atol, self.noise_floor) + rtol * self.scale)


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
        return all(c.passed(rtol, atol) for c in self.checks)

    def summary(self) -> str:
        rows = [f"{'input':<16}{'mode':<12}{'max abs err':>13}{'max rel err':>13}{'step':>11}"]
        for c in self.checks:
            rows.append(
                f"{c.name:<16}{c.mode:<12}{c.max_abs_error:>13.2e}"
                f"{c.max_rel_error:>13.2e}{c.step:>11.1e}"
            )
        return "\n".join(rows)


def assert_gradients(result: GradcheckResult, *, rtol: float, atol: float = 0.0) -> None:
    """Raise :class:`GradcheckError` unless every input passes (see :meth:`InputCheck.passed`)."""
    failed = [c for c in result.checks if not c.passed(rtol, atol)]
    if failed:
        names = ", ".join(c.name for c in failed)
        raise GradcheckError(
            f"gradient check failed for {names} (rtol={rtol:g}, atol={atol:g}):\n"
            + result.summary()
        )


def _as_tuple(outputs: Any) -> tuple[np.ndarray, ...]:
    if isinstance(outputs, (tuple, list)):
        return tuple(np.asarray(o, dtype=np.float64) for o in outputs)
    return (np.asarray(outputs, dtype=np.float64),)


def _get_grad(grads: Any, name: str) -> np.ndarray:
    if isinstance(grads, Mapping):
        value = grads[name]
    else:
        value = getattr(grads, name)
    return np.asarray(value, dtype=np.float64)


def _default_wrt(inputs: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(
        name
        for name, value in inputs.items()
        if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)
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
    wrt : sequence of str, optional
        Inputs to differentiate; default every floating-point ndarray in ``inputs``.
    mode : {"auto", "full", "vjp", "directions"}
        See the module docstring.
    step : float, optional
        Finite-difference step; default ``cbrt(eps) * max|x|`` per input.
    n_directions : int
        Number of random directions per input in ``"directions"`` mode.
    rng : None, int or numpy.random.Generator
        Source of the upstream gradient and the directions.

    Returns
    -------
    GradcheckResult
        Per input: max absolute and relative error, scale and step used.
    """
    check_choice(mode, "mode", _MODES)
    rng = check_rng(rng)
    inputs = dict(inputs)
    wrt = tuple(wrt) if wrt is not None else _default_wrt(inputs)
    if not wrt:
        raise ValueError("wrt is empty: no floating-point array input to differentiate")
    for name in wrt:
        if name not in inputs:
            raise ValueError(f"wrt names {name!r}, which is not among the inputs {list(inputs)}")
        inputs[name] = np.array(inputs[name], dtype=np.float64, copy=True)

    outputs, ctx = forward(**inputs)
    outputs = _as_tuple(outputs)
    upstream = tuple(rng.standard_normal(o.shape) for o in outputs)

    def phi(trial: Mapping[str, Any]) -> float:
        trial_out, _ = forward(**trial)
        return float(sum(np.sum(g * o) for g, o in zip(upstream, _as_tuple(trial_out))))

    contracted = float(sum(np.sum(np.abs(g * o)) for g, o in zip(upstream, outputs)))
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
        return _check_full(forward, backward, inputs, ctx, outputs, wrt, step)

    analytic = backward(ctx, *upstream)
    checks = []
    for name in wrt:
        x = inputs[name]
        a = _get_grad(analytic, name)
        if a.shape != x.shape:
            raise ValueError(
                f"backward returned a gradient of shape {a.shape} for {name} of shape {x.shape}"
            )
        h = _step(x, step)
        if mode == "vjp":
            fd = np.empty_like(x)
            for idx in np.ndindex(x.shape):
                fd[idx] = _central(phi, inputs, name, idx, None, h)
            checks.append(
                _compare(name, x.shape, "vjp", a, fd, None, h, 2 * x.size, _noise(contracted, h))
            )
        else:
            fd_dirs, an_dirs = [], []
            for _ in range(n_directions):
                v = rng.standard_normal(x.shape)
                v /= np.linalg.norm(v)
                fd_dirs.append(_central(phi, inputs, name, None, v, h))
                an_dirs.append(float(np.sum(a * v)))
            checks.append(
                _compare(
                    name,
                    x.shape,
                    "directions",
                    np.array(an_dirs),
                    np.array(fd_dirs),
                    float(np.linalg.norm(a)),
                    h,
                    2 * n_directions,
                    _noise(contracted, h),
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
    an upstream gradient of 1 (scaled by a random upstream scalar).
    """

    def forward(**kw):
        value, grads = loss(**kw)
        return float(value), grads

    def backward(grads, upstream):
        scale = float(np.asarray(upstream))
        names = wrt if wrt is not None else _default_wrt(inputs)
        return {name: scale * _get_grad(grads, name) for name in names}

    return check_gradients(
        forward, backward, inputs, wrt=wrt, mode=mode, step=step,
        n_directions=n_directions, rng=rng,
    )


def _step(x: np.ndarray, step: float | None) -> float:
    if step is not None:
        return float(step)
    magnitude = float(np.max(np.abs(x)))
    # Below 1e-8 (all-zero or subnormal inputs) a relative step would vanish; use 1.
    return float(np.cbrt(np.finfo(np.float64).eps) * (magnitude if magnitude > 1e-8 else 1.0))


def _central(phi, inputs, name, idx, direction, h) -> float:
    plus = dict(inputs)
    minus = dict(inputs)
    x = inputs[name]
    xp = x.copy()
    xm = x.copy()
    if direction is None:
        xp[idx] += h
        xm[idx] -= h
    else:
        xp += h * direction
        xm -= h * direction
    plus[name] = xp
    minus[name] = xm
    return (phi(plus) - phi(minus)) / (2.0 * h)


def _noise(magnitude: float, h: float) -> float:
    return 100.0 * np.finfo(np.float64).eps * magnitude / h


def _compare(name, shape, mode, analytic, fd, scale, h, calls, noise=0.0) -> InputCheck:
    diff = np.abs(np.asarray(analytic) - np.asarray(fd))
    max_abs = float(np.max(diff)) if diff.size else 0.0
    if scale is None:
        scale = float(max(np.max(np.abs(analytic), initial=0.0), np.max(np.abs(fd), initial=0.0)))
    if scale > 0:
        rel = max_abs / scale
    else:
        rel = 0.0 if max_abs == 0.0 else float("inf")
    return InputCheck(name, tuple(shape), mode, max_abs, rel, scale, h, calls, noise)


def _check_full(forward, backward, inputs, ctx, outputs, wrt, step) -> GradcheckResult:
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
            g = _get_grad(grads, name)
            if g.shape != inputs[name].shape:
                raise ValueError(
                    f"backward returned a gradient of shape {g.shape} for {name} "
                    f"of shape {inputs[name].shape}"
                )
            rows[name].append(g.ravel())

    magnitude = max((float(np.max(np.abs(o), initial=0.0)) for o in outputs), default=0.0)

    def flat_outputs(trial) -> np.ndarray:
        out, _ = forward(**trial)
        return np.concatenate([o.ravel() for o in _as_tuple(out)])

    checks = []
    for name in wrt:
        x = inputs[name]
        h = _step(x, step)
        analytic = np.array(rows[name])  # (n_out, x.size)
        fd = np.empty_like(analytic)
        for col, idx in enumerate(np.ndindex(x.shape)):
            plus, minus = dict(inputs), dict(inputs)
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            plus[name], minus[name] = xp, xm
            fd[:, col] = (flat_outputs(plus) - flat_outputs(minus)) / (2.0 * h)
        checks.append(
            _compare(name, x.shape, "full", analytic, fd, None, h, 2 * x.size, _noise(magnitude, h))
        )
    return GradcheckResult(tuple(checks))
