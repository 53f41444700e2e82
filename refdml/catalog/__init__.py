"""The operator catalogue: one entry per differentiable operator of refdml.

The catalogue sits above what it describes, as PyTorch's OpInfo database does: the
operators, their fast-path mirrors (:mod:`refdml.gpu`) and the training layers
(:mod:`refdml.train.layers`) know nothing of it, and each file here (one per family)
imports its operators and mirrors and lists them in ``OPERATORS`` as
:class:`OperatorSpec` entries holding callables: the forward/backward pair, how to make
well-conditioned inputs, the paper equation, the tolerance of the gradient check, and the
mirror's forward/backward (or the reason there is none). A mirror that does not exist is
an ``ImportError`` when this package is imported, not a failure of a later lookup.
``refdml gradcheck``, ``refdml gpu-check``, the self-checks of ``refdml verify`` and the
test loops all iterate over :func:`all_operators`, so an operator without a check or a
mirror is a failing test, not a forgotten one. Only the applications and the tests
import this package.

>>> from refdml.catalog import all_operators, get
>>> spec = get("normalize.l2_normalize")
>>> spec.check(rng=0).passed(spec.rtol, spec.atol)
True
"""

from __future__ import annotations

from refdml.catalog import (
    crossbatch,
    distances,
    gsp,
    histogram,
    losses,
    normalize,
    ot,
    prototypes,
    train,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu.families import KERNEL_FAMILIES, KernelFamilies

__all__ = ["FAMILIES", "Case", "ErrorCase", "OperatorSpec", "all_operators", "get",
           "kernel_family_problems", "register"]

_FAMILY_MODULES = (normalize, distances, gsp, histogram, losses, prototypes, crossbatch, ot, train)

#: Catalogue files, one per family of operators (``refdml.catalog.<family>``).
FAMILIES = tuple(module.__name__.rpartition(".")[2] for module in _FAMILY_MODULES)

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


for _module in _FAMILY_MODULES:
    for _entry in _module.OPERATORS:
        register(_entry)
del _module, _entry


def all_operators() -> list[OperatorSpec]:
    """Every entry of the catalogue, sorted by name."""
    return [_CATALOGUE[name] for name in sorted(_CATALOGUE)]


def get(name: str) -> OperatorSpec:
    """Return the entry named ``name`` (``ValueError`` listing the names if there is none)."""
    try:
        return _CATALOGUE[name]
    except KeyError:
        raise ValueError(
            f"no operator named {name!r} in the catalogue; known: {sorted(_CATALOGUE)}"
        ) from None


def kernel_family_problems(specs: list[OperatorSpec] | None = None,
                           families: KernelFamilies = KERNEL_FAMILIES) -> list[str]:
    """Entries whose ``kernel_family`` is not the object registered under its name in the
    fast path's one registration (:data:`refdml.gpu.families.KERNEL_FAMILIES`): their kernel
    variants would come from a family the compile check does not compile. ``specs``: the
    catalogue by default. Empty when every entry's family is registered."""
    specs = all_operators() if specs is None else specs
    return [f"{spec.name}: its kernel family {spec.kernel_family.family!r} is not registered "
            "in refdml.gpu.families.KERNEL_FAMILIES"
            for spec in specs if spec.kernel_family is not None
            and families.get(spec.kernel_family.family) is not spec.kernel_family]
