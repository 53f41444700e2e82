"""The description of one catalogued operator."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from refdml._validation import check_rng
from refdml.catalog._docs import parameter_docs
from refdml.gpu._support.modes import Implementations
from refdml.gradcheck import check_gradients

__all__ = ["DEFAULT_MIRROR_RTOL", "Case", "ErrorCase", "OperatorSpec"]

#: The mirror's relative tolerance against the reference where an entry states none.
DEFAULT_MIRROR_RTOL = {"float64": 1e-10, "float32": 1e-4}


@dataclass(frozen=True)
class Case:
    """A named hard input of one operator, as ``forward``'s keyword arguments.

    ``inputs`` hold float64 arrays (a conformance check casts them to the dtype under
    test), integer labels and Python hyperparameters; ``why`` says what makes the case hard
    (a tie, a zero cost, an extreme temperature) and what a wrong implementation does
    there. ``dtypes`` names the dtypes the case is meant for (default: all); a case at the
    edge of float32's range, say, names ``("float32",)`` only when it means nothing in
    float64. ``scale_inputs``, for a case whose outputs and gradients are zero by
    cancellation (a divergence of a cloud with itself), are the inputs of a nearby problem
    where they are not: their magnitudes there are those of the terms that cancel, against
    which an implementation's error is measured here (a relative error of a zero means
    nothing).
    """

    name: str
    inputs: Mapping[str, Any]
    why: str
    dtypes: tuple[str, ...] | None = None
    scale_inputs: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ErrorCase:
    """A bad input that a correct implementation must refuse.

    The reference raises ``error`` (a ``TypeError`` or ``ValueError``) with a message that
    matches the regular expression ``match`` (it names the parameter, e.g. ``"mu"``); CI
    holds the reference to that. A conformance check only reports how another
    implementation reacts, since frameworks differ in what they refuse.
    """

    name: str
    inputs: Mapping[str, Any]
    error: type[Exception]
    match: str


@dataclass(frozen=True)
class OperatorSpec:
    """How to check one forward/backward pair, and which fast-path pair mirrors it.

    Attributes
    ----------
    name : str
        ``"<family>.<operator>"``, e.g. ``"gsp.weight_transport"``.
    forward : callable
        ``forward(**inputs) -> (outputs, ctx)``; ``outputs`` an array, a float or a
        tuple of arrays.
    backward : callable
        ``backward(ctx, *d_outputs) -> grads``: one upstream gradient per output, shaped
        like it; ``grads`` names each differentiated input (attribute or mapping key).
    make_inputs : callable
        ``make_inputs(rng) -> dict``: keyword arguments of ``forward`` (arrays to
        differentiate, labels and hyperparameters), well-conditioned (away from kinks).
    paper : str
        The paper, equation, proposition or algorithm it implements.
    wrt : tuple of str, optional
        Inputs to differentiate (default: every floating-point array input).
    rtol, atol : float
        Tolerance of the finite-difference check (see :mod:`refdml.gradcheck`).
    mode : str
        Mode of :func:`refdml.gradcheck.check_gradients`.
    mirror : callable, optional
        The fast-path forward in :mod:`refdml.gpu` that mirrors ``forward``
        (``refdml.gpu.losses.contrastive_forward``), imported by the catalogue file, so a
        name that does not exist fails when the catalogue is imported. The GPU parity
        suite calls it with the same ``make_inputs`` keywords as ``forward`` (cast to the
        dtype and device under test), so hyperparameters belong in ``make_inputs``, not in
        an adapter.
    mirror_backward : callable, optional
        The mirror's backward; given exactly when ``mirror`` is.
    mirror_rtol : dict, optional
        Relative tolerance of the mirror against the reference per dtype name, default
        ``{"float64": 1e-10, "float32": 1e-4}``; widen an entry only with a reason in
        ``paper`` or a comment beside it.
    kernel_family : Implementations, optional
        The kernel family whose compiled kernels the mirror runs beside its array path (its
        :class:`~refdml.gpu._support.modes.Implementations` object, registered in
        :data:`refdml.gpu.families.KERNEL_FAMILIES`). :attr:`mirror_kernels` is derived from it.
    no_mirror : str, optional
        Why there is no mirror (e.g. ``"validation only"``); the GPU parity suite fails on
        an entry with neither.
    tags : tuple of str
        Free-form labels (``"slow"``, ``"loss"``, ...).
    reference_inputs : callable, optional
        ``reference_inputs(rng) -> tuple of Case``: the hard inputs of this operator
        (extreme temperatures and eps, ties and duplicate points, zero costs, no positive
        pair, tiny and huge scales), on which other implementations are checked
        (:mod:`refdml.conformance`); the reference runs finitely on every one (CI).
    error_inputs : callable, optional
        ``error_inputs(rng) -> tuple of ErrorCase``: bad inputs the reference refuses
        with a named error (CI checks each one).
    invariants : callable, optional
        ``invariants(inputs, outputs) -> {name: residual}``: constraints the outputs
        satisfy whatever computed them (GSP's marginals, say), each residual a
        non-negative float relative to the scale of the quantity, 0 when exact. A
        conformance check holds other implementations to them without the reference.
    roundoff : callable, optional
        ``roundoff(inputs) -> float``: how much the operator amplifies the roundoff of a
        computation at these inputs, beyond what the inputs' conditioning shows (an
        entropic OT solve: the largest cost over ``eps``, the condition of its fixed
        point). ``mirror_rtol`` is stated at ``make_inputs``; a conformance check scales it
        by the ratio of a case's ``roundoff`` to the largest of ``make_inputs`` (never
        below 1).

    Every entry is a pair: a loss is ``value, ctx = loss_forward(...)`` with
    ``grads = loss_backward(ctx, d_value)``, checked with a random scalar ``d_value``.
    """

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    make_inputs: Callable[[np.random.Generator], Mapping[str, Any]]
    paper: str
    wrt: tuple[str, ...] | None = None
    rtol: float = 1e-6
    atol: float = 0.0
    mode: str = "auto"
    mirror: Callable[..., Any] | None = None
    mirror_backward: Callable[..., Any] | None = None
    mirror_rtol: Mapping[str, float] | None = None
    kernel_family: Implementations | None = None
    no_mirror: str | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    reference_inputs: Callable[[np.random.Generator], tuple[Case, ...]] | None = None
    error_inputs: Callable[[np.random.Generator], tuple[ErrorCase, ...]] | None = None
    invariants: Callable[[Mapping[str, Any], tuple[Any, ...]], Mapping[str, float]] | None = None
    roundoff: Callable[[Mapping[str, Any]], float] | None = None

    @property
    def mirror_kernels(self) -> tuple[str, ...]:
        """The compiled kernels the mirror has beside its array path, from its
        ``kernel_family``: ``"cpu"`` (a Numba ``@njit`` twin) and/or ``"cuda"`` (a Numba
        ``@cuda.jit`` kernel). The parity suite runs the mirror once per kernel as well
        (:func:`refdml.gpu.use_kernels`), the CUDA kernel under Numba's simulator where
        there is no GPU."""
        return () if self.kernel_family is None else self.kernel_family.kernel_modes

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    def __post_init__(self) -> None:
        for field_name in ("forward", "backward", "make_inputs"):
            if not callable(getattr(self, field_name)):
                raise TypeError(f"{self.name}: {field_name} must be callable, got "
                                f"{type(getattr(self, field_name)).__name__}")
        if (self.mirror is None) != (self.mirror_backward is None):
            raise ValueError(f"{self.name}: mirror and mirror_backward go together "
                             "(give both or neither)")
        for field_name in ("mirror", "mirror_backward", "reference_inputs", "error_inputs",
                           "invariants", "roundoff"):
            value = getattr(self, field_name)
            if value is not None and not callable(value):
                raise TypeError(f"{self.name}: {field_name} must be callable, got "
                                f"{type(value).__name__}")

    def mirror_pair(self) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
        """The mirror's ``(forward, backward)``, or None without a mirror."""
        if self.mirror is None:
            return None
        return self.mirror, self.mirror_backward

    def mirror_tolerance(self, dtype_name: str) -> float:
        """Relative tolerance of the mirror against the reference for ``dtype_name``."""
        return dict(DEFAULT_MIRROR_RTOL, **(self.mirror_rtol or {}))[dtype_name]

    def parameter_docs(self) -> dict[str, str]:
        """The meaning of each parameter of ``forward``, ``{name: "type: description"}``,
        from the ``Parameters`` section of its docstring (references such as ``As in
        :func:`weight_transport``` followed; see :mod:`refdml.catalog._docs`)."""
        return parameter_docs(self.forward)

    def __repr__(self) -> str:
        parts = [repr(self.name), f"forward={_callable_name(self.forward)}",
                 f"paper={self.paper!r}"]
        if self.mirror is not None:
            parts.append(f"mirror={_callable_name(self.mirror)}")
        else:
            parts.append(f"no_mirror={self.no_mirror!r}")
        if self.tags:
            parts.append(f"tags={self.tags!r}")
        return f"OperatorSpec({', '.join(parts)})"

    def __str__(self) -> str:
        """A few readable lines: the operator, its paper, its forward with the meaning of
        each keyword argument ``make_inputs`` passes, and where the rest is."""
        lines = [f"{self.name}: {self.paper}",
                 f"  forward:  {_callable_name(self.forward)}",
                 f"  backward: {_callable_name(self.backward)}",
                 "  mirror:   " + (_callable_name(self.mirror) if self.mirror is not None
                                   else f"none ({self.no_mirror})")]
        docs = self.parameter_docs()
        lines.append("  keyword arguments:")
        for name in self.make_inputs(np.random.default_rng(0)):
            meaning = " ".join(docs.get(name, "(not documented)").split())
            lines.append(f"    {name}: {meaning if len(meaning) <= 90 else meaning[:86] + ' ...'}")
        lines.append(f"  cases, tolerances and error inputs: refdml conform --describe {self.name}")
        return "\n".join(lines)

    def check(self, rng: Any = None, mode: str | None = None):
        """Run the gradient check on freshly made inputs (in ``mode``, default the entry's);
        return the GradcheckResult."""
        rng = check_rng(rng)
        inputs = dict(self.make_inputs(rng))
        return check_gradients(
            self.forward, self.backward, inputs, wrt=self.wrt,
            mode=self.mode if mode is None else mode, rng=rng,
        )


def _callable_name(function: Any) -> str:
    """``module.qualname`` of a function, ``functools.partial`` keywords shown."""
    keywords: dict[str, Any] = {}
    while hasattr(function, "func") and hasattr(function, "keywords"):   # functools.partial
        keywords = {**function.keywords, **keywords}
        function = function.func
    name = (f"{getattr(function, '__module__', '?')}."
            f"{getattr(function, '__qualname__', type(function).__name__)}")
    if keywords:
        name += "(" + ", ".join(f"{k}={v!r}" for k, v in keywords.items()) + ")"
    return name
