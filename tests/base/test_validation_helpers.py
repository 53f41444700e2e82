import dataclasses
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdml import _validation
from refdml._validation import as_float_array, as_label_array, check_flag, check_rng, check_scalar
from refdml import _backend


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


# --- one home for the reference's and the fast path's checks (issue 22) ------------------


def test_one_sided_bounds_are_stated_as_inequalities():
    assert check_scalar(3, "stride", low=1, integer=True, one_sided=True) == 3
    with pytest.raises(ValueError, match=r"^stride == 0, must be >= 1$"):
        check_scalar(0, "stride", low=1, integer=True, one_sided=True)
    with pytest.raises(ValueError, match=r"^tol == 0.0, must be > 0$"):
        check_scalar(0.0, "tol", low=0.0, low_inclusive=False, one_sided=True)
    with pytest.raises(ValueError, match=r"^p == 3.5, must be <= 2$"):
        check_scalar(3.5, "p", high=2.0, one_sided=True)
    with pytest.raises(ValueError, match=r"^d_in == 10{30}, must be at most 9223372036854775807 "
                                         r"\(int64\)$"):
        check_scalar(10**30, "d_in", low=1, integer=True, one_sided=True)
    # The bound comes before the int64 limit: a negative beyond int64 is "below 1" first.
    with pytest.raises(ValueError, match=r"^n == -10{30}, must be >= 1$"):
        check_scalar(-(10**30), "n", low=1, integer=True, one_sided=True)
    with pytest.raises(TypeError, match=r"^padding must be an integer, got 1.5$"):
        check_scalar(1.5, "padding", low=0, integer=True, one_sided=True)


@given(value=st.integers(min_value=-(2**70), max_value=2**70),
       low=st.integers(min_value=-5, max_value=5), width=st.integers(min_value=0, max_value=10))
def test_one_sided_accepts_and_refuses_what_the_interval_form_does(value, low, width):
    # Only the wording differs: both forms accept the same integers and return them unchanged.
    def outcome(one_sided):
        try:
            return check_scalar(value, "n", low=low, high=low + width, integer=True,
                                one_sided=one_sided)
        except ValueError:
            return "refused"

    expected = value if low <= value <= low + width else "refused"
    assert outcome(False) == expected
    assert outcome(True) == expected


@pytest.mark.parametrize("bad, kind", [
    (None, TypeError), ("abc", TypeError), (np.array([True]), TypeError),
    (np.array([1 + 2j]), TypeError), (np.zeros((0, 2)), ValueError), (np.ones(3), ValueError),
    (np.array([[1.0, np.nan]]), ValueError), (np.array([[1.0], [-np.inf]]), ValueError),
])
def test_fast_and_reference_array_checks_say_the_same(bad, kind):
    messages = []
    for check in (_validation.as_float_array, _validation.as_fast_array):
        with pytest.raises(kind) as info:
            check(bad, "x", ndim=2)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("bad, kind", [
    (None, TypeError), ("abc", TypeError), (np.array([[True, False]]), TypeError),
    (np.ones((2, 1)), ValueError), (np.array([[1.0, np.inf]]), ValueError),
])
def test_fast_and_reference_upstream_checks_say_the_same(bad, kind):
    ns = _validation.get_backend(np.zeros(1))
    messages = []
    for check in (lambda: _validation.check_upstream(bad, "d_y", (1, 2)),
                  lambda: _validation.check_fast_upstream(bad, "d_y", (1, 2), ns, np.float32)):
        with pytest.raises(kind) as info:
            check()
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_scalar_upstream_non_finite_says_the_same():
    ns = _validation.get_backend(np.zeros(1))
    for value in (np.array(np.nan), np.array(np.inf, np.float32)):
        with pytest.raises(ValueError) as ref:
            _validation.check_upstream(value, "d_value", ())
        with pytest.raises(ValueError) as fast:
            _validation.check_fast_upstream(value, "d_value", (), ns, value.dtype)
        assert str(ref.value) == str(fast.value) and str(ref.value).startswith("d_value == ")


def test_finite_checks_switch_is_refdml_gpus_and_skips_only_off_numpy():
    import refdml.gpu

    assert refdml.gpu.set_finite_checks is _backend.set_finite_checks
    device = dataclasses.replace(_validation.get_backend(np.zeros(1)), name="device",
                                 xp=types.ModuleType("not_numpy"), free_host_reads=False)
    host = _validation.get_backend(np.zeros(1))
    try:
        refdml.gpu.set_finite_checks(False)
        assert not _validation.data_checks(device) and _validation.data_checks(host)
        # NumPy inputs are always checked, whatever the switch says.
        with pytest.raises(ValueError, match="x must be finite"):
            _validation.as_fast_array(np.array([np.nan]), "x")
    finally:
        refdml.gpu.set_finite_checks(True)
    assert _validation.data_checks(device)
    with pytest.raises(TypeError, match="enabled must be a bool, got 1"):
        refdml.gpu.set_finite_checks(1)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_check_flag_accepts_booleans_as_python_bools(value):
    out = check_flag(value, "progress")
    assert out is bool(value)


@pytest.mark.parametrize("value", [1, 0, "no", None, 1.0, np.array(True)])
def test_check_flag_refuses_what_is_not_true_or_false(value):
    with pytest.raises(TypeError, match=r"^progress must be True or False, got "):
        check_flag(value, "progress")


# --------------------------------------------------------------------------- foreign tensors


def _fake_tensor(module: str, name: str):
    """An object whose type lives in ``module``, as a torch/JAX/TF tensor's does (those
    libraries are not installed here; the check reads only the type's module)."""
    return type(name, (), {"__module__": module, "__array__": lambda self, *a, **k: np.ones(3)})()


@pytest.mark.parametrize(("module", "what", "how"), [
    ("torch", "a torch.Tensor", "x.detach().cpu().numpy()"),
    ("jaxlib.xla_extension", "a jax.Array", "numpy.asarray(x) outside jax.jit"),
    ("jax._src.array", "a jax.Array", "numpy.asarray(x) outside jax.jit"),
    ("tensorflow.python.framework.ops", "a tensorflow.Tensor", "x.numpy()"),
])
def test_a_framework_tensor_is_refused_with_the_conversion_to_use(module, what, how):
    from refdml._validation import as_fast_array, as_inputs, as_label_array

    tensor = _fake_tensor(module, "Tensor")
    for check in (lambda: as_float_array(tensor, "x"), lambda: as_fast_array(tensor, "x"),
                  lambda: as_label_array(tensor, "x"), lambda: as_inputs({"x": (tensor, 1)})):
        with pytest.raises(TypeError) as info:
            check()
        message = str(info.value)
        assert message.startswith(f"x is {what};") and message.endswith(f"pass {how}")


def test_a_torch_tensor_reaching_an_operator_is_a_refdml_error():
    torch = pytest.importorskip("torch")
    from refdml.normalize import l2_normalize

    x = torch.ones(2, 3, requires_grad=True)
    with pytest.raises(TypeError, match=r"^x is a torch\.Tensor; .*pass x\.detach\(\)\.cpu\(\)\.numpy\(\)"):
        l2_normalize(x)
