"""How close an implementation must come to the reference, and how far it is.

For a quantity ``q`` (an output, or the gradient of one input) computed in ``dtype``, the
relative tolerance is

.. math::
    \\mathrm{rtol}_q = \\max\\big(\\mathrm{base},\\; 16\\,\\varepsilon_{\\mathrm{dtype}}\\,\\kappa_q\\big)

with ``eps_dtype`` the spacing of the format's numbers at 1 (float64 ``2**-52``, float32
``2**-23``, float16 ``2**-10``, bfloat16 ``2**-7``: its 8-bit significand), ``base`` the
catalogue entry's mirror tolerance for float32 and float64 (how far refdml's own fast path
may stray) and, in float16 and bfloat16, where no mirror runs and the catalogue states
none, the rule itself at ``kappa = 1`` (``16 eps_dtype``: 1/64 and 1/8), and ``kappa_q`` the
measured conditioning of ``q``: its relative change when the floating
inputs move by a random relative ``1e-7`` (two draws, the larger kept), over ``1e-7``,
floored at 1. A well-conditioned quantity then gets a few units of roundoff, one near a
kink or a tie (where a tiny move changes the answer) as much as its conditioning says.
Where the change does not shrink with the move (a hundredfold smaller move changes ``q``
by a third as much: ``kappa = inf``), or the tolerance would exceed the dtype's
:func:`resolution_limit` (a tenth; a half in bfloat16, see there), the reference itself
jumps under a move of the inputs far below any rounding, or the format cannot resolve the
quantity: the case sits on a kink, a tie or a discontinuity (a gradient at duplicate
points, say), where implementations legitimately pick different subgradients. Such a
quantity is compared for shape and finiteness only, and against the reference's rounding
noise, and the report lists it as unresolved rather than stretching a tolerance until it
means nothing. The error is norm-wise, ``max_i |a_i - e_i| / max_i |e_i|``: elementwise
relative errors would fail every implementation on the near-zero entries of an array whose
other entries are large.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refdml.conformance._formats import DTYPES, FORMATS

__all__ = ["JUMP_FLOOR", "JUMP_RATIO", "PERTURBATION", "RESOLVED_KAPPA", "UNRESOLVED",
           "Conditioning", "resolution_limit",
           "NOISE_UNITS", "ROUNDING_PERTURBATION", "Tolerance", "measure", "rounding_floor", "base_tolerance", "compare", "conditioning",
           "is_floating_array", "overflowing", "round_digits", "round_to_dtype", "tolerance"]

#: Relative size of the input perturbation that measures conditioning: far above float64
#: roundoff (so the measured change is not noise) and far below any feature of the inputs.
PERTURBATION = 1e-7

#: Above this relative tolerance a quantity is unresolved at its case (see the module
#: docstring): checked for shape and finiteness, not values.
UNRESOLVED = 0.1

#: Units of roundoff per unit of conditioning that an independent implementation may use.
ROUNDOFF_UNITS = 16.0

#: In every format, a quantity at most this ill-conditioned is compared by value (see
#: :func:`resolution_limit`): on the catalogue's random inputs the losses, layers and
#: divergences and their gradients measure kappa from 1 to about 3.5.
RESOLVED_KAPPA = 4.0


def resolution_limit(dtype: str) -> float:
    """The largest relative tolerance that still compares values in ``dtype``:
    :data:`UNRESOLVED` (a tenth), or the tolerance of a quantity of conditioning
    :data:`RESOLVED_KAPPA` where that is larger. The second binds in bfloat16 only, whose
    8-bit significand gives even a perfectly conditioned quantity ``16 eps_dtype = 1/8``: with a
    tenth as the limit nothing would be compared there. A relative error up to a half still
    tells a wrong sign, a dropped factor or a missing term of comparable size from roundoff.
    """
    return max(UNRESOLVED, ROUNDOFF_UNITS * FORMATS[dtype].eps * RESOLVED_KAPPA)


@dataclass(frozen=True)
class Tolerance:
    """The tolerance of one quantity in one case: ``rtol = max(base, 16 eps_dtype kappa)``."""

    case: str
    quantity: str
    base: float
    kappa: float
    rtol: float
    jumping: int = 0
    atol: float = 0.0
    limit: float = UNRESOLVED

    @property
    def resolved(self) -> bool:
        """False where the reference is too ill-conditioned here to compare values in this
        dtype (``rtol`` above ``limit``, the dtype's :func:`resolution_limit`; the quantity
        is then checked for shape, finiteness and the absolute floor only). ``jumping``
        counts the elements left out of the comparison of a resolved quantity (see
        :func:`measure`); ``atol`` is the absolute floor from the reference's rounding
        noise (:func:`rounding_floor`): an element within it of the reference agrees."""
        return self.rtol <= self.limit

    @property
    def beyond_dtype(self) -> bool:
        """True where the case's base tolerance exceeds 1: the computation amplifies the
        dtype's roundoff (the entry's ``roundoff`` hint times ``16 eps_dtype``) beyond the size
        of the quantity, as a Sinkhorn solve at a small eps does in bfloat16. Then no
        value is compared (``rtol`` is inf): shape and finiteness only."""
        return math.isinf(self.rtol) and not math.isinf(self.kappa)


def is_floating_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)


def round_to_dtype(inputs: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """``inputs`` with every floating array rounded to ``dtype`` (held as float64), so the
    reference sees exactly the numbers the implementation sees."""
    # An input beyond the dtype's range becomes inf: the caller skips the case.
    return {name: FORMATS[dtype].round(value) if is_floating_array(value) else value
            for name, value in inputs.items()}


def overflowing(inputs: Mapping[str, Any], rounded: Mapping[str, Any]) -> list[str]:
    """The floating inputs that are finite but not after rounding to the dtype."""
    return [name for name, value in inputs.items() if is_floating_array(value)
            and np.any(np.isfinite(value) & ~np.isfinite(rounded[name]))]


def round_digits(array: np.ndarray, digits: int) -> np.ndarray:
    """``array`` rounded to ``digits`` significant decimal digits (0 stays 0)."""
    array = np.asarray(array, dtype=np.float64)
    magnitude = np.abs(array)
    safe = np.where(magnitude > 0, magnitude, 1.0)
    scale = 10.0 ** (digits - 1 - np.floor(np.log10(safe)))
    return np.where(magnitude > 0, np.round(array * scale) / scale, 0.0)


def base_tolerance(spec: Any, dtype: str) -> float:
    """The floor of every quantity's tolerance: the entry's mirror tolerance for ``dtype``
    (float32, float64), or, in a format no mirror runs in (float16, bfloat16), the
    roundoff rule at ``kappa = 1``: ``16 eps_dtype`` (see the module docstring)."""
    if dtype in ("float16", "bfloat16"):
        return ROUNDOFF_UNITS * FORMATS[dtype].eps
    return float(spec.mirror_tolerance(dtype))


def tolerance(base: float, kappa: float, dtype: str) -> float:
    return max(base, ROUNDOFF_UNITS * FORMATS[dtype].eps * kappa)


def _scale(array: np.ndarray) -> float:
    finite = array[np.isfinite(array)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def conditioning(
    evaluate: Callable[[Mapping[str, Any]], Mapping[str, np.ndarray] | None],
    inputs: Mapping[str, Any],
    quantities: Mapping[str, np.ndarray],
    rng: np.random.Generator,
    draws: int = 2,
) -> dict[str, float]:
    """``kappa`` of each quantity (see :func:`measure`), ``inf`` where every element jumps."""
    return {name: m.kappa for name, m in measure(evaluate, inputs, quantities, rng,
                                                 draws).items()}


@dataclass(frozen=True)
class Conditioning:
    """The measured conditioning of one quantity: ``kappa`` over the elements that move
    smoothly, ``jumps`` a boolean mask of the elements that do not (None: none), and
    ``noise`` the reference's own rounding noise in it (absolute, float64)."""

    kappa: float
    jumps: np.ndarray | None = None
    noise: float = 0.0


def measure(
    evaluate: Callable[[Mapping[str, Any]], Mapping[str, np.ndarray] | None],
    inputs: Mapping[str, Any],
    quantities: Mapping[str, np.ndarray],
    rng: np.random.Generator,
    draws: int = 2,
) -> dict[str, Conditioning]:
    """The :class:`Conditioning` of each quantity: ``evaluate(perturbed inputs) ->
    {quantity: array}`` (None where the reference refuses the perturbed inputs) at
    ``draws`` random relative perturbations of size :data:`PERTURBATION` of the floating
    inputs, each repeated along the same direction at a hundredth of the size and at
    :data:`ROUNDING_PERTURBATION`.

    *Jumps.* A smooth element moves a hundred times less under the hundredfold smaller
    move; one that still moves by more than :data:`JUMP_RATIO` of its first change (a
    visible one: a kappa above :data:`JUMP_FLOOR`) jumps there: the case sits on a kink, a
    tie or a discontinuity of the reference for that element (the gradient of a point
    that coincides with another, say), however small the step. Such elements are left out
    of ``kappa``, of ``noise`` and of the comparison; where every element jumps, ``kappa``
    is ``inf``.

    *Noise.* Under the move of a few units of roundoff, a smooth element changes by the
    first move's change scaled down (linearity) plus the reference's own rounding error,
    which is therefore the difference of the two: the floor below which no implementation
    can be asked to agree. It is what measures a quantity that is exactly zero by
    cancellation (a divergence of a cloud with itself), where a relative error means
    nothing, and the amplification of roundoff inside a computation (a Sinkhorn plan at
    small eps) that the input's conditioning does not show.

    A quantity that is all zero is measured against the largest scale of the quantities
    of its kind (outputs, gradients), as :func:`compare` does; one whose perturbed values
    are not finite is ill-conditioned without bound (``inf``); one that could not be
    measured keeps 1.
    """
    kappa = dict.fromkeys(quantities, 1.0)
    noise = dict.fromkeys(quantities, 0.0)
    jumps: dict[str, np.ndarray] = {}
    scales = {name: _scale(np.asarray(value)) or kind_scales(quantities)[_kind(name)]
              for name, value in quantities.items()}
    for _ in range(draws):
        direction = {name: rng.uniform(-1.0, 1.0, size=value.shape)
                     for name, value in inputs.items() if is_floating_array(value)}
        large_moves, small_moves, tiny_moves = (
            _moves(evaluate, inputs, quantities, direction, size)
            for size in (PERTURBATION, PERTURBATION / 100.0, ROUNDING_PERTURBATION))
        for name, large in large_moves.items():
            small, tiny = small_moves.get(name), tiny_moves.get(name)
            if any(m is not None and not np.all(np.isfinite(m)) for m in (large, small, tiny)):
                kappa[name] = np.inf
                continue
            if small is not None:
                jumped = ((np.abs(large) > JUMP_FLOOR * PERTURBATION * scales[name])
                          & (np.abs(small) > JUMP_RATIO * np.abs(large)))
                jumps[name] = jumps.get(name, np.zeros(large.shape, bool)) | jumped
            smooth = ~jumps[name] if name in jumps else np.ones(large.shape, bool)
            if not smooth.any():
                kappa[name] = np.inf
                continue
            if scales[name] > 0:
                slope = float(np.max(np.abs(large[smooth]))) / scales[name] / PERTURBATION
                kappa[name] = max(kappa[name], slope)
            if tiny is not None:
                rounding = np.abs(tiny - large * (ROUNDING_PERTURBATION / PERTURBATION))
                noise[name] = max(noise[name], float(np.max(rounding[smooth])))
    return {name: Conditioning(kappa[name], jumps[name] if name in jumps and
                               jumps[name].any() else None, noise[name])
            for name in quantities}


#: A hundredfold smaller step that still moves an element by this fraction of the first
#: change means a jump, not a slope (a smooth element keeps a hundredth of it).
JUMP_RATIO = 0.3
#: ... provided the first change is visible: a kappa below this is never called a jump
#: (roundoff of an iterative solver stopped at tol 1e-12 stays far below it).
JUMP_FLOOR = 1e3
#: The relative move that measures the reference's rounding noise: a few units of float64
#: roundoff, so that the linear part of the change is of the order of the noise itself.
ROUNDING_PERTURBATION = 1e-15


def _moves(evaluate, inputs, quantities, direction, size) -> dict[str, np.ndarray]:
    """The signed change of each quantity, element by element, when every floating input
    ``x`` moves to ``x (1 + size * direction)``; NaN/inf where the moved value is not
    finite but the quantity is."""
    perturbed = {name: value * (1.0 + size * direction[name]) if name in direction else value
                 for name, value in inputs.items()}
    moved = evaluate(perturbed)
    found: dict[str, np.ndarray] = {}
    if moved is None:
        return found
    for name, value in quantities.items():
        other = moved.get(name)
        if other is None or np.shape(other) != np.shape(value):
            continue
        value = np.asarray(value, dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            change = np.asarray(other, dtype=np.float64) - value
        # Elements the reference itself gives as non-finite are judged by the non-finite
        # check, not measured here.
        found[name] = np.where(np.isfinite(value), change, 0.0).reshape(value.shape)
    return found


#: Units of the sampled rounding noise an implementation may use: the noise is the largest
#: of a few samples of the reference's rounding error, not a bound on it (a sample's
#: maximum falls short of the bound by a few times), hence four times ROUNDOFF_UNITS.
NOISE_UNITS = 64.0


def rounding_floor(noise: float, dtype: str) -> float:
    """The absolute agreement that an implementation in ``dtype`` can be held to where the
    reference's own rounding noise is ``noise`` (float64): the same computation's noise in
    ``dtype``, times :data:`NOISE_UNITS`."""
    ratio = FORMATS[dtype].eps / FORMATS["float64"].eps
    return NOISE_UNITS * noise * ratio


def _kind(quantity: str) -> str:
    return "grad" if quantity.startswith("grad ") else "output"


def kind_scales(quantities: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The largest scale among the outputs and among the gradients of one case."""
    scales = {"output": 0.0, "grad": 0.0}
    for name, value in quantities.items():
        scales[_kind(name)] = max(scales[_kind(name)], _scale(np.asarray(value)))
    return scales


@dataclass(frozen=True)
class Comparison:
    """The worst element of an implementation's quantity against the reference's."""

    error: float
    index: tuple[int, ...]
    impl_value: float
    ref_value: float
    abs_error: float = 0.0


def compare(actual: np.ndarray, expected: np.ndarray, fallback_scale: float,
            skip: np.ndarray | None = None) -> Comparison:
    """Norm-wise relative error ``max |a - e| / max |e|`` over the elements where the
    reference is finite, and the index of the worst element; an all-zero reference is
    measured against ``fallback_scale`` (the largest of its kind in the case), or in
    absolute terms when that is zero too."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    finite = np.isfinite(expected)
    if skip is not None:  # elements where the reference jumps (measure): not compared
        finite = finite & ~skip
    with np.errstate(invalid="ignore", over="ignore"):
        difference = np.where(finite, np.abs(actual - expected), 0.0)
    if difference.size == 0:
        return Comparison(0.0, (), float("nan"), float("nan"))
    flat = int(np.argmax(difference))
    index = tuple(int(i) for i in np.unravel_index(flat, difference.shape))
    scale = _scale(expected) or fallback_scale or 1.0
    return Comparison(float(difference.flat[flat]) / scale, index,
                      float(actual.flat[flat]), float(expected.flat[flat]),
                      float(difference.flat[flat]))
