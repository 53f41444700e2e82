"""Transitional shim: the registry moved to :mod:`refdml.gradcheck.catalog`.

Removed once no operator module registers itself.
"""

from refdml.gradcheck.catalog import OperatorSpec, all_operators, get, register

OPERATOR_MODULES = ()

__all__ = ["OPERATOR_MODULES", "OperatorSpec", "all_operators", "get", "register"]
