"""The fast path (:mod:`refdml.gpu`) against the reference, for every catalogued operator.

One test body runs over catalogue x {NumPy float64, NumPy float32, CuPy float64, CuPy
float32}: the entry's mirror gets the entry's ``make_inputs`` (floating arrays
cast to the dtype and moved to the device under test), and its outputs and gradients
(for one random upstream gradient) must match the float64 reference to the entry's
tolerance for that dtype (the rule is :func:`refdml.gradcheck.parity.check_parity`, also run by
``refdml gpu-check``). An entry with neither a mirror nor a stated reason fails. CuPy
rows (marker ``requires_cupy``) and CUDA kernel rows (``requires_cuda``) skip, with the
reason, where nothing can run them (tests/conftest.py).
"""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refdml.catalog import all_operators
from refdml.gradcheck import parity

SPECS = all_operators()
IDS = [s.name for s in SPECS]
MIRRORED = [s for s in SPECS if s.mirror is not None]
BACKENDS = [
    pytest.param(backend, dtype_name, id=f"{backend}-{dtype_name}",
                 marks=pytest.mark.requires_cupy if backend == "cupy" else ())
    for backend in ("numpy", "cupy") for dtype_name in ("float64", "float32")
]


KERNEL_ROWS = [pytest.param(s, k, id=f"{s.name}-{k}",
                            marks=pytest.mark.requires_cuda if k == "cuda" else ())
               for s, k in parity.kernel_cases(SPECS)]
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
# The CuPy stand-in (tests/cupy_standin, REFDML_CUPY_STANDIN=1): CuPy arrays in the simulator.
STANDIN = getattr(sys.modules.get("cupy"), "__refdml_standin__", False)


def check_parity(spec, backend: str, dtype_name: str, seed: int, kernels: str = "array") -> None:
    """The rule of :func:`refdml.gradcheck.parity.check_parity`, asserted."""
    result = parity.check_parity(spec, backend=backend, dtype=dtype_name, seed=seed,
                                 timing_repeats=0, kernels=kernels)
    assert result.passed, (f"{spec.name} ({backend} {dtype_name}, {kernels} kernels): "
                           + "; ".join(result.problems))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_entry_has_a_mirror_or_a_reason(spec):
    assert (spec.mirror is None) != (spec.no_mirror is None), (
        f"{spec.name} needs exactly one of a mirror or a no_mirror reason"
    )
    if spec.mirror is not None:
        assert all(callable(f) for f in spec.mirror_pair())


@pytest.mark.parametrize("backend, dtype_name", BACKENDS)
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


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("spec, kernels", KERNEL_ROWS)
def test_kernel_matches_reference(spec, kernels, dtype_name):
    """Each compiled kernel of a mirror, held to the reference by the same rule.

    The CPU twin runs on NumPy. The CUDA kernel runs on CuPy where there is a GPU (or the
    CuPy stand-in, REFDML_CUPY_STANDIN=1), and on NumPy under Numba's CUDA simulator
    otherwise (tests/conftest.py switches it on).
    """
    if kernels == "cuda" and (not SIMULATED or STANDIN):
        check_parity(spec, "cupy", dtype_name, 0, kernels)
    else:
        check_parity(spec, "numpy", dtype_name, 0, kernels)
