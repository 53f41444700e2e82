"""refdml._backend: the methods of the backend object, on NumPy and on CuPy.

The CuPy side runs on the CuPy module already imported in this session (the stand-in of
tests/cupy_standin under REFDML_CUPY_STANDIN=1, or a real one), else on a stand-in built
for the test and removed after it, so these tests run in every session.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import cupy_standin
from refdml import _backend
from refdml._backend import get_backend


@pytest.fixture
def cupy_module(monkeypatch):
    """A CuPy module that :func:`refdml._backend.get_backend` recognises, for one test.

    The backend object it builds is not kept past the test (``_CUPY`` is restored), so a
    later test of the session that installs another CuPy module meets a fresh one.
    """
    present = sys.modules.get("cupy")
    if present is not None:
        return present
    for name, module in cupy_standin.build_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(_backend, "_CUPY", None)
    return sys.modules["cupy"]


# --------------------------------------------------------------------------- for refdml.train
def test_is_own_array_on_numpy_takes_arrays_and_numpy_scalars_only(cupy_module):
    backend = get_backend(np.zeros(2))
    assert backend.is_own_array(np.zeros((2, 3)))
    assert backend.is_own_array(np.zeros(3).sum())           # a NumPy scalar, from a reduction
    assert backend.is_own_array(np.float32(1.5))
    assert not backend.is_own_array([0.0, 1.0])
    assert not backend.is_own_array(1.5)
    assert not backend.is_own_array(None)
    assert not backend.is_own_array(cupy_module.zeros(3))


def test_is_own_array_on_cupy_takes_its_arrays_only(cupy_module):
    backend = get_backend(cupy_module.zeros(2))
    assert backend.name == "cupy"
    assert backend.is_own_array(cupy_module.zeros((2, 3)))
    assert backend.is_own_array(cupy_module.zeros(3).sum())  # CuPy's reductions give 0-d arrays
    assert not backend.is_own_array(np.zeros(3))
    assert not backend.is_own_array(np.float64(1.0))
    assert not backend.is_own_array([0.0])
