"""What the two autodiff sides of refdml.conformance (``_jax.py``, ``_torch.py``) promise
alike, run on each framework that is installed (CI has JAX, not PyTorch): outputs unlike
the reference's are structure errors, non-floating dtypes and differentiated integers are
TypeErrors, an unknown device a ValueError naming it."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from refdml.conformance import get_framework
from refdml.conformance._frameworks import StructureError

UNKNOWN_DEVICE = {"jax": "tpu9", "torch": "warp"}


@pytest.fixture(params=sorted(UNKNOWN_DEVICE))
def name(request):
    if importlib.util.find_spec(request.param) is None:
        pytest.skip(f"{request.param} is not installed")
    return request.param


@pytest.fixture
def fw(name):
    return get_framework(name)


@pytest.mark.parametrize("returned, match", [
    (lambda x: (x, x), r"returned 2 output\(s\), the reference 1"),
    (lambda x: x[:1], r"output 0 has shape \(1,\), the reference's \(2,\)"),
])
def test_outputs_unlike_the_reference_are_structure_errors(fw, returned, match):
    x = fw.asarray(np.ones(2), "float64")
    with pytest.raises(StructureError, match=match):
        fw.run(lambda i: returned(i["x"]), {"x": x}, ("x",), (np.ones(2),))


def test_a_dtype_that_is_not_floating_is_a_type_error(fw):
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        fw.asarray(np.ones(2), "int32")


def test_differentiating_an_integer_input_is_a_type_error(fw):
    labels = fw.asarray(np.array([1, 2]), None)
    with pytest.raises(TypeError, match="input 'labels' is differentiated"):
        fw.run(lambda i: i["labels"] * 1.0, {"labels": labels}, ("labels",), (np.ones(2),))


def test_an_unknown_device_is_a_value_error(name):
    device = UNKNOWN_DEVICE[name]
    with pytest.raises(ValueError, match=f"device == '{device}'"):
        get_framework(name, device=device)
