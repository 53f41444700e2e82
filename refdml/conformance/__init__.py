"""Check other implementations of refdml's operators against the reference.

A reference implementation earns its keep when people check their own code against it.
:func:`check_implementation` calls an implementation (PyTorch, JAX, CuPy or NumPy) of a
catalogue entry (:mod:`refdml.catalog`) on the entry's inputs over several seeds, its
hard reference inputs and a hypothesis search, compares every output and every gradient
with the float64 reference at a tolerance derived from the dtype (float64, float32,
float16, or bfloat16 for PyTorch and JAX) and the measured conditioning, and says where
and why they disagree; :func:`describe` says what it will call, compare and allow for one
operator (``refdml conform --describe OP``). In a pytest suite, the ``refdml_conform``
marker and fixture (:mod:`refdml.pytest_plugin`) run it as one test item per case:

>>> import numpy as np
>>> from refdml.catalog import get
>>> from refdml.conformance import check_implementation
>>> spec = get("normalize.l2_normalize")
>>> report = check_implementation(spec.forward, "normalize.l2_normalize", framework="numpy",
...                               backward=spec.backward, search=False)
>>> report.passed
True
"""

from __future__ import annotations

from refdml.conformance._check import check_implementation
from refdml.conformance._describe import OperatorDescription, describe
from refdml.conformance._frameworks import FRAMEWORKS, Evaluation, Framework, get_framework
from refdml.conformance._report import (
    CAUSES,
    ConformanceReport,
    ErrorOutcome,
    Failure,
    SearchOutcome,
)
from refdml.conformance._tolerance import Tolerance

__all__ = [
    "CAUSES",
    "FRAMEWORKS",
    "ConformanceReport",
    "ErrorOutcome",
    "Evaluation",
    "Failure",
    "Framework",
    "OperatorDescription",
    "SearchOutcome",
    "Tolerance",
    "check_implementation",
    "describe",
    "get_framework",
]
