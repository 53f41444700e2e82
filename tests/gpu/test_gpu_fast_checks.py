"""refdml._validation.fast_labels beyond the families' own tests: the labels check agrees with the
reference's ``as_label_array`` at the edge of int64 (issue 20)."""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from refdml._validation import as_label_array, fast_labels
from refdml._backend import get_backend, to_numpy
from refdml.gpu.metrics import retrieval_metrics

NS = get_backend(np.zeros(1))


@pytest.mark.parametrize("labels", [[1e300, 0.0, 0.0], [2.0**63, 1.0, 1.0],
                                    [-(2.0**63), 1.0, 1.0], [np.inf, 1.0, 1.0]])
def test_integral_floats_beyond_int64_are_refused_like_the_reference(labels):
    # Before the bound, 1e300 passed the integral check (it equals its rounding) and its cast
    # to int64 raised NumPy's RuntimeWarning (an error under pytest), or gave garbage labels.
    for check in (lambda: fast_labels(np.array(labels), "labels", NS),
                  lambda: as_label_array(np.array(labels), "labels")):
        with pytest.raises(TypeError, match=r"^labels must hold integer labels, got dtype "
                                            r"float64"):
            check()


def test_integral_floats_inside_int64_are_the_same_labels():
    # 2**62 and -2**62 are exact in float64 and in int64: the cast is exact.
    labels = np.array([2.0**62, -(2.0**62), 3.0])
    assert_array_equal(fast_labels(labels, "labels", NS), [2**62, -(2**62), 3])
    assert_array_equal(fast_labels(labels, "labels", NS), as_label_array(labels, "labels"))
    assert fast_labels(labels.astype(np.float32), "labels", NS).dtype == np.int64


def test_a_public_fast_path_function_names_its_huge_float_labels():
    embeddings = np.random.default_rng(0).standard_normal((4, 3))
    with pytest.raises(TypeError, match=r"^query_labels must hold integer labels"):
        retrieval_metrics(embeddings, np.array([1e300, 1e300, 0.0, 0.0]), k=(1,))


@pytest.mark.requires_cupy
def test_the_bound_holds_on_cupy_arrays_too():
    """Same check on a device array (one reduction)."""
    import cupy

    labels = cupy.asarray([1e300, 0.0, 0.0])
    ns = get_backend(labels)
    with pytest.raises(TypeError, match=r"^labels must hold integer labels"):
        fast_labels(labels, "labels", ns)
    exact = fast_labels(cupy.asarray([2.0**62, 3.0]), "labels", ns)
    assert_array_equal(to_numpy(exact), [2**62, 3])
