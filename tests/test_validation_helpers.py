import numpy as np
import pytest

from refdml._validation import as_float_array, as_label_array, check_rng, check_scalar


def test_float_array_converts_float32_and_int():
    assert as_float_array(np.ones(3, np.float32), "x").dtype == np.float64
    assert as_float_array([1, 2], "x").dtype == np.float64


@pytest.mark.parametrize("bad", [np.array([True, False]), np.array(["a"]), None, "abc"])
def test_float_array_type_errors(bad):
    with pytest.raises(TypeError, match="x must be an array of real numbers"):
        as_float_array(bad, "x")


def test_float_array_value_errors():
    with pytest.raises(ValueError, match="x must be finite, got inf at index \\(1,\\)"):
        as_float_array([1.0, np.inf], "x")
    with pytest.raises(ValueError, match="must have 2 dimensions"):
        as_float_array([1.0], "x", ndim=2)


def test_scalar_checks_name_parameter_and_value():
    assert check_scalar(0.5, "mu", low=0, high=1, low_inclusive=False) == 0.5
    with pytest.raises(ValueError, match=r"mu == 1.5, must be in \(0, 1\]"):
        check_scalar(1.5, "mu", low=0, high=1, low_inclusive=False)
    with pytest.raises(TypeError, match="eps must be a real number"):
        check_scalar("1", "eps")
    with pytest.raises(TypeError, match="k must be an integer"):
        check_scalar(2.5, "k", integer=True)
    with pytest.raises(ValueError, match="eps == nan, must be finite"):
        check_scalar(float("nan"), "eps")


def test_labels():
    np.testing.assert_array_equal(as_label_array([1.0, 2.0], "labels"), [1, 2])
    with pytest.raises(ValueError, match="labels has length 2, but 3 labels are needed"):
        as_label_array([1, 2], "labels", length=3)
    with pytest.raises(TypeError):
        as_label_array([1.5], "labels")


def test_rng():
    assert isinstance(check_rng(None), np.random.Generator)
    assert check_rng(3).integers(100) == np.random.default_rng(3).integers(100)
    with pytest.raises(TypeError, match="rng must be"):
        check_rng("seed")


def test_float_array_copy_option():
    x = np.arange(6.0).reshape(2, 3)
    assert as_float_array(x, "x", copy=False) is x or np.shares_memory(as_float_array(x, "x", copy=False), x)
    assert not np.shares_memory(as_float_array(x, "x"), x)
    # A conversion is still made when the dtype differs.
    assert as_float_array(x.astype(np.float32), "x", copy=False).dtype == np.float64


def test_features_prototypes_check():
    from refdml._validation import check_features_prototypes

    with pytest.raises(ValueError, match="same last dimension"):
        check_features_prototypes(np.ones((2, 3, 4)), np.ones((5, 3)))
    with pytest.raises(ValueError, match="features must have 3 dimensions"):
        check_features_prototypes(np.ones((3, 4)), np.ones((5, 4)))
