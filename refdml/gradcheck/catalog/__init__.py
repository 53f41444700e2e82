"""The operator catalogue: one entry per differentiable operator of refdml.

The catalogue sits above the operators, as PyTorch's OpInfo database does: the operator
modules know nothing of it, and each file here (one per family) imports its operators and
describes them with :class:`OperatorSpec`: the forward/backward pair, how to make
well-conditioned inputs, the paper equation, the tolerance of the gradient check, and the
fast-path mirror (or the reason there is none). ``refdml gradcheck``, the test loops, the
GPU parity tests and the training layers' checks all iterate over :func:`all_operators`,
so an operator without a check or a mirror is a failing test, not a forgotten one.

>>> from refdml.gradcheck.catalog import all_operators, get
>>> spec = get("normalize.l2_normalize")
>>> spec.check(rng=0).passed(spec.rtol, spec.atol)
True
"""

from __future__ import annotations

import importlib

from refdml.gradcheck.catalog._spec import OperatorSpec

__all__ = ["FAMILIES", "OperatorSpec", "all_operators", "get", "register"]

#: Catalogue files, one per family of operators (``refdml.gradcheck.catalog.<family>``).
FAMILIES = (
    "normalize",
    "distances",
    "gsp",
    "histogram",
    "losses",
    "prototypes",
    "crossbatch",
    "ot",
    "train",
)

_CATALOGUE: dict[str, OperatorSpec] = {}


def register(spec: OperatorSpec) -> OperatorSpec:
    """Add ``spec`` to the catalogue; a second entry of the same name is an error."""
    if not isinstance(spec, OperatorSpec):
        raise TypeError(f"spec must be an OperatorSpec, got {type(spec).__name__}")
    existing = _CATALOGUE.get(spec.name)
    if existing is not None and existing is not spec:
        raise ValueError(f"an operator named {spec.name!r} is already in the catalogue")
    _CATALOGUE[spec.name] = spec
    return spec


def all_operators() -> list[OperatorSpec]:
    """Load every catalogue file and return the entries, sorted by name."""
    for family in FAMILIES:
        importlib.import_module(f"{__name__}.{family}")
    return [_CATALOGUE[name] for name in sorted(_CATALOGUE)]


def get(name: str) -> OperatorSpec:
    """Return the entry named ``name`` (``ValueError`` listing the names if there is none)."""
    all_operators()
    try:
        return _CATALOGUE[name]
    except KeyError:
        raise ValueError(
            f"no operator named {name!r} in the catalogue; known: {sorted(_CATALOGUE)}"
        ) from None
