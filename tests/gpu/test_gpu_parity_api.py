"""refdml.gradcheck.parity.check_parity as a library function (the suite itself: test_gpu_parity.py)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from refdml.catalog import get
from refdml.gpu import cupy_available
from refdml.gradcheck.parity import ParityResult, available_backends, check_parity


def test_result_fields_and_values():
    result = check_parity(get("normalize.l2_normalize"), dtype="float32", seed=1)
    assert isinstance(result, ParityResult)
    assert (result.name, result.backend, result.dtype) == ("normalize.l2_normalize", "numpy", "float32")
    assert result.passed and result.problems == ()
    assert 0.0 <= result.output_error <= result.tolerance == 1e-4
    assert 0.0 <= result.gradient_error <= 1e-4
    assert result.seconds > 0.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.passed = False


def test_a_wrong_mirror_fails_with_the_reason():
    spec = get("normalize.l2_normalize")
    from refdml.gpu import normalize

    def doubled(x):
        y, ctx = normalize.l2_normalize_forward(x)
        return 2 * y, ctx

    wrong = dataclasses.replace(spec, mirror=doubled)
    result = check_parity(wrong, dtype="float64", timing_repeats=0)
    assert not result.passed
    assert result.output_error == pytest.approx(1.0, rel=1e-12)  # |2y - y| / max|y|
    assert result.gradient_error <= 1e-10
    assert any("output 0" in p for p in result.problems)


def test_any_operator_description_will_do():
    """The harness reads attributes only: it never imports refdml.catalog."""
    spec = get("normalize.l2_normalize")
    described = types.SimpleNamespace(
        name="described.l2", forward=spec.forward, backward=spec.backward,
        make_inputs=spec.make_inputs, mirror_kernels=(), no_mirror=None,
        mirror_pair=lambda: (spec.mirror, spec.mirror_backward),
        mirror_tolerance=spec.mirror_tolerance)
    result = check_parity(described, dtype="float32", seed=1, timing_repeats=0)
    expected = check_parity(spec, dtype="float32", seed=1, timing_repeats=0)
    assert result.passed and result.name == "described.l2"
    # Same inputs, same code, same process: the errors agree to rounding.
    np.testing.assert_allclose([result.output_error, result.gradient_error],
                               [expected.output_error, expected.gradient_error], rtol=1e-12)
    del described.mirror_pair
    with pytest.raises(TypeError, match="without mirror_pair"):
        check_parity(described)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="backend == 'torch'"):
        check_parity(get("normalize.l2_normalize"), backend="torch")
    with pytest.raises(ValueError, match="dtype == 'float16'"):
        check_parity(get("normalize.l2_normalize"), dtype="float16")
    with pytest.raises(ValueError, match="validation only"):
        check_parity(get("gsp.pool_unrolled"))
    with pytest.raises(TypeError, match="spec must be"):
        check_parity(3)
    # A name is not an operator: the harness knows no catalogue (refdml.catalog.get does).
    with pytest.raises(TypeError, match="spec must be"):
        check_parity("normalize.l2_normalize")


def test_cupy_backend_without_a_gpu():
    if cupy_available():
        assert available_backends() == ("numpy", "cupy")
        return
    assert available_backends() == ("numpy",)
    with pytest.raises(RuntimeError, match="CUDA device"):
        check_parity(get("normalize.l2_normalize"), backend="cupy")
