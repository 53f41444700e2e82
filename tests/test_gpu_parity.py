"""The fast path (:mod:`refdml.gpu`) against the reference, for every catalogued operator.

One test body runs over catalogue x {NumPy float64, NumPy float32, CuPy float64, CuPy
float32}: the mirror named by the entry gets the entry's ``make_inputs`` (floating arrays
cast to the dtype and moved to the device under test), and its outputs and gradients
(for one random upstream gradient) must match the float64 reference to the entry's
tolerance for that dtype. An entry with neither a mirror nor a stated reason fails. CuPy
rows skip, with the reason, where there is no GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml.gpu import cupy_available
from refdml.gradcheck.catalog import all_operators

SPECS = all_operators()
IDS = [s.name for s in SPECS]
MIRRORED = [s for s in SPECS if s.mirror is not None]
BACKENDS = [
    ("numpy", "float64"),
    ("numpy", "float32"),
    ("cupy", "float64"),
    ("cupy", "float32"),
]


def _device(backend: str):
    if backend == "numpy":
        return np
    if not cupy_available():
        pytest.skip("CuPy rows need CuPy and a CUDA device; none here")
    import cupy

    return cupy


def _cast(value, xp, dtype):
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        return xp.asarray(value.astype(dtype))
    if isinstance(value, np.ndarray):
        return xp.asarray(value)
    return value


def _host(value) -> np.ndarray:
    return value.get() if hasattr(value, "get") else np.asarray(value)


def _fields(grads) -> dict:
    if isinstance(grads, dict):
        return dict(grads)
    return {f.name: getattr(grads, f.name) for f in dataclasses.fields(grads)}


def _as_tuple(outputs):
    return outputs if isinstance(outputs, tuple) else (outputs,)


def _compare(actual, expected, rtol, what):
    actual = _host(actual).astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    # Relative to the largest magnitude of the reference: entries near zero are compared at
    # the precision of the whole output, which is what a float32 computation can promise.
    scale = max(float(np.max(np.abs(expected), initial=0.0)), np.finfo(np.float64).tiny)
    err = float(np.max(np.abs(actual - expected), initial=0.0)) / scale
    assert err <= rtol, f"{what}: max relative error {err:.2e} > {rtol:.0e}"


def check_parity(spec, backend: str, dtype_name: str, seed: int) -> None:
    xp = _device(backend)
    forward, backward = spec.mirror_pair()
    rng = np.random.default_rng(seed)
    inputs = dict(spec.make_inputs(rng))
    ref_out, ref_ctx = spec.forward(**inputs)
    ref_out = _as_tuple(ref_out)
    upstream = [rng.standard_normal(np.shape(o)) for o in ref_out]
    ref_grads = _fields(spec.backward(ref_ctx, *upstream))

    dtype = np.dtype(dtype_name)
    fast_inputs = {k: _cast(v, xp, dtype) for k, v in inputs.items()}
    out, ctx = forward(**fast_inputs)
    out = _as_tuple(out)
    rtol = spec.mirror_tolerance(dtype_name)
    for k, (a, e) in enumerate(zip(out, ref_out)):
        if hasattr(a, "dtype") and np.ndim(e) > 0:
            assert np.dtype(a.dtype) == dtype, f"output {k} has dtype {a.dtype}, not {dtype}"
        _compare(a, e, rtol, f"{spec.name} output {k}")
    fast_upstream = [
        xp.asarray(g.astype(dtype)) if np.ndim(g) else float(g) for g in upstream
    ]
    grads = _fields(backward(ctx, *fast_upstream))
    for name, expected in ref_grads.items():
        assert name in grads, f"{spec.name}: the mirror returns no gradient for {name}"
        _compare(grads[name], expected, rtol, f"{spec.name} gradient {name}")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_entry_has_a_mirror_or_a_reason(spec):
    assert (spec.mirror is None) != (spec.no_mirror is None), (
        f"{spec.name} needs exactly one of a mirror or a no_mirror reason"
    )
    if spec.mirror is not None:
        spec.mirror_pair()  # imports, and names that exist


@pytest.mark.parametrize("backend, dtype_name", BACKENDS, ids=[f"{b}-{d}" for b, d in BACKENDS])
@pytest.mark.parametrize("spec", MIRRORED, ids=[s.name for s in MIRRORED])
@pytest.mark.parametrize("seed", [0, 1])
def test_mirror_matches_reference(spec, backend, dtype_name, seed):
    check_parity(spec, backend, dtype_name, seed)


@pytest.mark.parametrize("spec", MIRRORED, ids=[s.name for s in MIRRORED])
@settings(max_examples=3)
@given(seed=st.integers(min_value=2, max_value=2**32 - 1))
def test_mirror_matches_reference_hypothesis_seeds(spec, seed):
    check_parity(spec, "numpy", "float64", seed)
    check_parity(spec, "numpy", "float32", seed)
