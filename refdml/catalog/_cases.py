"""Small builders of the catalogue's hard inputs and bad inputs (:class:`ErrorCase`).

Every builder takes a valid set of ``forward`` keyword arguments (usually the entry's
``make_inputs``) and returns a copy with one thing changed, so each error case breaks exactly
one rule and the rest of the call stays valid. The ``match`` of each :class:`ErrorCase` is the
wording of :mod:`refdml._validation` (``"mu == 1.5, must be in ..."``, ``"x must be finite"``,
``"x must have 2 dimensions"``), anchored on the parameter's name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from refdml.catalog._spec import ErrorCase

__all__ = [
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "bad_scalar",
    "bad_type",
    "flat",
    "non_integer_labels",
    "replaced",
    "scaled",
    "truncated",
    "with_entry",
    "with_extra_axis",
    "with_inf",
    "with_nan",
    "without_axis",
]

#: The largest finite float32 and the smallest normal one: a float32 case sits near them.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def replaced(inputs: Mapping[str, Any], **changes: Any) -> dict:
    """A copy of ``inputs`` with ``changes`` applied (arrays copied, so cases share nothing)."""
    out = {key: np.array(value, copy=True) if isinstance(value, np.ndarray) else value
           for key, value in inputs.items()}
    out.update(changes)
    return out


def scaled(inputs: Mapping[str, Any], factor: float, *names: str) -> dict:
    """``inputs`` with the arrays ``names`` multiplied by ``factor``."""
    return replaced(inputs, **{name: np.asarray(inputs[name], dtype=np.float64) * factor
                               for name in names})


def with_entry(inputs: Mapping[str, Any], name: str, value: float, index=None) -> dict:
    """``inputs`` with one entry of the array ``name`` (default its last) set to ``value``."""
    array = np.array(inputs[name], dtype=np.float64, copy=True)
    array[np.unravel_index(array.size - 1, array.shape) if index is None else index] = value
    return replaced(inputs, **{name: array})


def _named(name: str) -> str:
    # The parameter's name as a whole word at the start of the message or after a space.
    return rf"(^|\s){re.escape(name)}\b"


def with_nan(inputs: Mapping[str, Any], name: str) -> ErrorCase:
    """A NaN in the array ``name``: a correct implementation refuses it (not a NaN output)."""
    return ErrorCase(f"nan in {name}", with_entry(inputs, name, np.nan), ValueError,
                     _named(name) + r".*finite")


def with_inf(inputs: Mapping[str, Any], name: str) -> ErrorCase:
    """An infinity in the array ``name``."""
    return ErrorCase(f"inf in {name}", with_entry(inputs, name, np.inf), ValueError,
                     _named(name) + r".*finite")


def without_axis(inputs: Mapping[str, Any], name: str) -> ErrorCase:
    """The array ``name`` with its leading axis dropped (one dimension too few)."""
    array = np.asarray(inputs[name], dtype=np.float64)
    return ErrorCase(f"{name} with one dimension too few", replaced(inputs, **{name: array[0]}),
                     ValueError, _named(name) + r".*dimensions")


def with_extra_axis(inputs: Mapping[str, Any], name: str) -> ErrorCase:
    """The array ``name`` with an extra leading axis of length 2 (one dimension too many)."""
    array = np.asarray(inputs[name], dtype=np.float64)
    return ErrorCase(f"{name} with one dimension too many",
                     replaced(inputs, **{name: np.stack([array, array])}),
                     ValueError, _named(name) + r".*dimensions")


def flat(inputs: Mapping[str, Any], name: str) -> ErrorCase:
    """The array ``name`` flattened to 1-d."""
    array = np.asarray(inputs[name], dtype=np.float64)
    return ErrorCase(f"{name} flattened to 1-d", replaced(inputs, **{name: array.ravel()}),
                     ValueError, _named(name) + r".*dimensions")


def bad_scalar(inputs: Mapping[str, Any], name: str, value: float,
               label: str | None = None) -> ErrorCase:
    """The hyperparameter ``name`` set to ``value`` outside its domain (``ValueError``)."""
    return ErrorCase(label or f"{name} == {value!r}", replaced(inputs, **{name: value}),
                     ValueError, _named(name) + r" == ")


def bad_type(inputs: Mapping[str, Any], name: str, value: Any,
             label: str | None = None) -> ErrorCase:
    """The input ``name`` given a value of the wrong type (``TypeError``)."""
    return ErrorCase(label or f"{name} of type {type(value).__name__}",
                     replaced(inputs, **{name: value}), TypeError, _named(name) + r" must be")


def truncated(inputs: Mapping[str, Any], name: str, label: str | None = None) -> ErrorCase:
    """The array ``name`` one row short, so its length no longer matches the other inputs'.

    The message names ``name`` and its length (``"labels has length 9, but 10 ..."``,
    ``"Z has 8 rows but Y has 7"``).
    """
    array = np.asarray(inputs[name])
    return ErrorCase(label or f"{name} one row short", replaced(inputs, **{name: array[:-1]}),
                     ValueError, _named(name) + r" has ")


def non_integer_labels(inputs: Mapping[str, Any], name: str = "labels") -> ErrorCase:
    """Class labels given as non-integral floats (``label + 0.5``): a ``TypeError``.

    Integral floats (``1.0``) are accepted as labels, so the case adds one half.
    """
    halves = np.asarray(inputs[name]) + 0.5
    return ErrorCase(f"non-integer {name}", replaced(inputs, **{name: halves}), TypeError,
                     _named(name) + r" must hold integer labels")
