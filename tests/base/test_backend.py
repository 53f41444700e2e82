"""The backend object (refdml._backend): what differs between NumPy and CuPy, one method each."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from refdml._backend import get_backend

# ---- for refdml.gpu.metrics

#: float32's unit roundoff (half its machine epsilon: 24 significant bits, rounded to nearest).
_FLOAT32_ROUNDOFF = float(np.finfo(np.float32).eps) / 2
#: TF32 keeps 10 of float32's 23 explicit mantissa bits: one unit in its last place is
#: 2^13 float32 units, the most by which its rounding (or truncation) moves a value, relatively.
_TF32_ROUNDOFF = float(np.finfo(np.float32).eps) * 2**13


@pytest.mark.parametrize("setting", [None, "", "0", "1"])
def test_numpy_matmul_inputs_are_float32_whatever_cupy_tf32_says(monkeypatch, setting):
    if setting is None:
        monkeypatch.delenv("CUPY_TF32", raising=False)
    else:
        monkeypatch.setenv("CUPY_TF32", setting)
    assert get_backend(np.zeros(2, dtype=np.float32)).matmul_input_roundoff() == _FLOAT32_ROUNDOFF


@pytest.mark.parametrize("setting, expected", [
    (None, _FLOAT32_ROUNDOFF), ("", _FLOAT32_ROUNDOFF), ("0", _FLOAT32_ROUNDOFF),
    ("1", _TF32_ROUNDOFF)])
def test_cupy_matmul_inputs_round_to_tf32_under_cupy_tf32(monkeypatch, setting, expected):
    # The rule on a backend named "cupy" (its array module does not enter it), so that it is
    # tested where CuPy is absent; the real CuPy backend below.
    if setting is None:
        monkeypatch.delenv("CUPY_TF32", raising=False)
    else:
        monkeypatch.setenv("CUPY_TF32", setting)
    cupy_like = dataclasses.replace(get_backend(np.zeros(1)), name="cupy")
    assert cupy_like.matmul_input_roundoff() == expected


@pytest.mark.requires_cupy
def test_the_cupy_backend_reads_cupy_tf32(monkeypatch):
    import cupy

    backend = get_backend(cupy.zeros(2, dtype=cupy.float32))
    monkeypatch.setenv("CUPY_TF32", "1")
    assert backend.matmul_input_roundoff() == _TF32_ROUNDOFF
    monkeypatch.setenv("CUPY_TF32", "0")
    assert backend.matmul_input_roundoff() == _FLOAT32_ROUNDOFF
