"""refdml.torch's custom ops (skipped without torch; CI runs them in the PyTorch leg).

Held to the float64 reference (the catalogue's forward and backward, an implementation the
ops do not call: the ops run the fast-path mirror), to finite differences
(``torch.autograd.gradcheck``: PyTorch's own numerical Jacobian), to PyTorch's checker of
custom ops (``torch.library.opcheck``), and to the refusals a user must get.
"""

from __future__ import annotations

import dataclasses
import gc
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.testing import assert_allclose

torch = pytest.importorskip("torch")

import refdml.torch as rt  # noqa: E402
from refdml import catalog  # noqa: E402
from refdml.gradcheck import strategies as rst  # noqa: E402
from refdml._interop import bridged, encode_options  # noqa: E402
from refdml.torch import _convert  # noqa: E402
from refdml.torch._ops import live_contexts  # noqa: E402

NAMES = rt.names()


def _tensors(inputs: dict, *, dtype=torch.float64, requires_grad=True) -> dict:
    """The catalogue's inputs as the op takes them: arrays as tensors (floating ones in
    ``dtype``, differentiable), hyperparameters unchanged."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, np.ndarray):
            tensor = torch.from_numpy(value.copy())
            if np.issubdtype(value.dtype, np.floating):
                tensor = tensor.to(dtype).requires_grad_(requires_grad)
            out[key] = tensor
        else:
            out[key] = value
    return out


def _as_tuple(value):
    return value if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("name", NAMES)
def test_values_and_gradients_are_the_float64_references(name):
    spec, row = catalog.get(name), bridged(name)
    rng = np.random.default_rng(7)
    inputs = spec.make_inputs(rng)
    args = _tensors(inputs)
    outputs = _as_tuple(rt.op(name)(**args))
    ref_outputs, ctx = spec.forward(**inputs)
    ref_outputs = _as_tuple(ref_outputs)
    assert len(outputs) == len(ref_outputs)
    upstream = [rng.standard_normal(np.shape(r)) + 1.5 for r in ref_outputs]  # never all ones
    for out, ref in zip(outputs, ref_outputs):
        assert out.dtype == torch.float64
        assert_allclose(out.detach().numpy(), ref, rtol=1e-10, atol=1e-13)
    leaves = [k for k in row.differentiable if isinstance(args.get(k), torch.Tensor)]
    grads = torch.autograd.grad(outputs, [args[k] for k in leaves],
                                [torch.from_numpy(np.asarray(u)) for u in upstream],
                                allow_unused=True)
    ref_grads = spec.backward(ctx, *upstream)
    for key, grad in zip(leaves, grads):
        expected = getattr(ref_grads, key)
        if expected is None:
            assert grad is None or not torch.any(grad), key
            continue
        assert_allclose(grad.numpy(), expected, rtol=1e-9, atol=1e-12 * np.abs(expected).max(),
                        err_msg=f"{name}: gradient of {key}")


# Operators whose catalogue inputs gradcheck in a few seconds (an OT solve per perturbed
# entry is the slow part; tol 1e-12 keeps their finite differences clean).
@pytest.mark.parametrize("name", NAMES)
def test_gradients_pass_torch_gradcheck(name):
    spec, row = catalog.get(name), bridged(name)
    inputs = spec.make_inputs(np.random.default_rng(3))
    args = _tensors(inputs)
    leaves = [k for k in row.differentiable if isinstance(args.get(k), torch.Tensor)]

    def call(*values):
        return rt.op(name)(**{**args, **dict(zip(leaves, values))})

    assert torch.autograd.gradcheck(call, tuple(args[k] for k in leaves), eps=1e-6,
                                    atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("name", ["gsp.pool", "normalize.l2_normalize", "losses.proxy_anchor"])
def test_second_derivatives_say_they_are_not_derived(name):
    spec = catalog.get(name)
    args = _tensors(spec.make_inputs(np.random.default_rng(0)))
    leaf = bridged(name).differentiable[0]

    def call(value):
        return rt.op(name)(**{**args, leaf: value})

    with pytest.raises(RuntimeError, match="first order: second derivatives"):
        torch.autograd.gradgradcheck(call, (args[leaf],))


# --- hypothesis-drawn inputs, away from kinks ------------------------------------------
def _finite(low, high):
    return st.floats(low, high, allow_nan=False, allow_infinity=False)


def _moved(base: np.ndarray, steps: np.ndarray, radius: float) -> np.ndarray:
    """``base`` (a catalogue input, away from kinks and ties) moved by drawn points of a
    ball of ``radius``: drawn from scratch, hypothesis's favourite arrays have equal rows
    (ties, parallel rows), where these operators have only one-sided derivatives."""
    return base + radius * steps.reshape(base.shape)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 7), steps=rst.points_in_unit_ball(11, 3, min_radius=0.0),
       mu=_finite(0.1, 0.9), inverse_temperature=_finite(0.5, 8.0))
def test_gsp_pool_gradcheck_on_drawn_inputs(seed, steps, mu, inverse_temperature):
    base = catalog.get("gsp.pool").make_inputs(np.random.default_rng(seed))
    # Norms 0.4 .. 2.5, none within 0.2 of the clip's kink at 1: a step of 0.1 keeps it so.
    f = torch.from_numpy(_moved(base["features"], steps[:8], 0.1)).requires_grad_()
    p = torch.from_numpy(_moved(base["prototypes"], steps[8:], 0.1)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: rt.op("gsp.pool")(a, b, mu=mu, inverse_temperature=inverse_temperature),
        (f, p), eps=1e-6, atol=1e-6, rtol=1e-4)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 7), steps=rst.points_in_unit_ball(7, 2, min_radius=0.0),
       eps=_finite(0.3, 3.0), p=st.sampled_from([1.5, 2.0]))
def test_sinkhorn_divergence_gradcheck_on_drawn_inputs(seed, steps, eps, p):
    # Moved from the catalogue's clouds: drawn from scratch, coincident points are a
    # favourite, where the cost |x - y|^1.5 has an unbounded second derivative.
    base = catalog.get("ot.sinkhorn_divergence").make_inputs(np.random.default_rng(seed))
    xt = torch.from_numpy(_moved(base["x"], steps[:4], 0.1)).requires_grad_()
    yt = torch.from_numpy(_moved(base["y"], steps[4:], 0.1)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: rt.op("ot.sinkhorn_divergence")(a, b, eps=eps, p=p, tol=1e-13),
        (xt, yt), eps=1e-6, atol=1e-6, rtol=1e-4)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 7), steps=rst.points_in_unit_ball(18, 4, min_radius=0.0),
       alpha=_finite(1.0, 16.0))
def test_proxy_anchor_gradcheck_on_drawn_inputs(seed, steps, alpha):
    base = catalog.get("losses.proxy_anchor").make_inputs(np.random.default_rng(seed))
    e = torch.from_numpy(_moved(base["embeddings"], steps[:10], 0.05)).requires_grad_()
    p = torch.from_numpy(_moved(base["proxies"], steps[10:], 0.05)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: rt.op("losses.proxy_anchor")(
            a, torch.from_numpy(base["labels"]), b, torch.from_numpy(base["proxy_labels"]),
            alpha=alpha),
        (e, p), eps=1e-6, atol=1e-6, rtol=1e-4)


# --- PyTorch's own checks of a custom op -------------------------------------------------
@pytest.mark.parametrize("name", ["gsp.pool", "normalize.clip_normalize", "ot.sinkhorn_divergence",
                                  "losses.contrastive", "crossbatch.xml_loss"])
def test_torch_library_opcheck(name):
    spec, row = catalog.get(name), bridged(name)
    args = _tensors(spec.make_inputs(np.random.default_rng(0)))
    tensors = tuple(args.pop(k, None) for k in row.arrays)
    forward = getattr(torch.ops.refdml, row.symbol).default
    # Not "test_aot_dispatch_dynamic": it compares every output of two calls, and the
    # handle output is a fresh token per call by design (test_torch_compile.py compares a
    # compiled model's values and gradients with eager ones instead).
    torch.library.opcheck(forward, (*tensors, encode_options(args)),
                          test_utils=("test_schema", "test_autograd_registration",
                                      "test_faketensor"))
    assert repr(rt.op(name)) == f"refdml.torch.op({name!r})"


# --- zero copy ---------------------------------------------------------------------------
def test_float64_and_float32_cross_without_a_copy(monkeypatch):
    row = bridged("normalize.l2_normalize")
    seen = {}
    forward, backward = row.forward, row.backward

    def spy_forward(**arrays):
        seen["x"] = arrays["x"]
        out, ctx = forward(**arrays)
        seen["y"] = out
        return out, ctx

    def spy_backward(ctx, d_y):
        seen["d_y"] = d_y
        grads = backward(ctx, d_y)
        seen["d_x"] = grads.x
        return grads

    op = rt.op("normalize.l2_normalize")
    monkeypatch.setattr(op, "spec", dataclasses.replace(row, forward=spy_forward,
                                                        backward=spy_backward))
    for dtype in (torch.float64, torch.float32):
        x = torch.randn(5, 3, dtype=dtype, requires_grad=True)
        y = op(x)
        d_y = torch.randn(5, 3, dtype=dtype)
        (d_x,) = torch.autograd.grad(y, x, d_y)
        # The arrays refdml saw are the tensors' memory, and the tensors PyTorch got back
        # are refdml's arrays.
        assert seen["x"].ctypes.data == x.data_ptr()
        assert seen["y"].ctypes.data == y.data_ptr()
        assert seen["d_y"].ctypes.data == d_y.data_ptr()
        assert seen["d_x"].ctypes.data == d_x.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_computed_in_float32_and_returned_in_its_dtype(dtype):
    x = torch.randn(4, 3, dtype=torch.float64)
    y = rt.op("normalize.l2_normalize")(x.to(dtype).requires_grad_())
    assert y.dtype == dtype
    expected, _ = catalog.get("normalize.l2_normalize").forward(x=x.to(dtype).double().numpy())
    assert_allclose(y.double().detach().numpy(), expected, rtol=2 ** -7)


def test_an_output_equal_to_an_input_is_not_an_alias():
    x = torch.full((3, 2), 0.1, dtype=torch.float64)  # inside the unit ball: clip is the identity
    y = rt.op("normalize.clip_normalize")(x)
    assert y.data_ptr() != x.data_ptr()
    assert_allclose(y.numpy(), x.numpy())


# --- the forward context: kept by the graph, freed with it --------------------------------
def test_contexts_live_as_long_as_their_graph():
    gc.collect()
    before = live_contexts()
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = rt.op("normalize.l2_normalize")(x)
    assert live_contexts() == before + 1
    (y * 2).sum().backward(retain_graph=True)
    first = x.grad.clone()
    (y * 2).sum().backward()                       # the retained graph runs again
    assert_allclose(x.grad.numpy(), 2 * first.numpy())
    del y
    gc.collect()
    assert live_contexts() == before
    with torch.no_grad():
        rt.op("normalize.l2_normalize")(x)
    gc.collect()
    assert live_contexts() == before


def test_an_in_place_change_before_backward_is_pytorchs_error():
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = rt.op("normalize.l2_normalize")(x)
    y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# --- refusals ------------------------------------------------------------------------------
def test_bad_tensors_are_refused_naming_the_argument():
    op = rt.op("gsp.pool")
    f = torch.randn(2, 4, 3, dtype=torch.float64)
    p = torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"features is a torch.int64 tensor .*needs floating point"):
        op(f.long(), p, mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"prototypes is a ndarray; .*torch.as_tensor\(prototypes\)"):
        op(f, p.numpy(), mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"prototypes is torch.float32 and features torch.float64"):
        op(f, p.float(), mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"gsp.pool needs the tensor prototypes"):
        op(features=f, mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"at most 2 positional tensors"):
        op(f, p, p, mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"features both positionally and by keyword"):
        op(f, features=f, prototypes=p, mu=0.4, inverse_temperature=3.0)
    with pytest.raises(TypeError, match=r"rng is a Generator"):
        rt.op("crossbatch.xml_loss")(torch.randn(4, 3, dtype=torch.float64),
                                     torch.randn(4, 2, dtype=torch.float64),
                                     torch.tensor([0, 0, 1, 1]), ridge=0.1,
                                     rng=np.random.default_rng(0))


def test_refdmls_own_refusals_come_through():
    op = rt.op("gsp.pool")
    f = torch.randn(2, 4, 3, dtype=torch.float64)
    p = torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"mu"):
        op(f, p, mu=1.5, inverse_temperature=3.0)
    f[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"features must be finite"):
        op(f, p, mu=0.4, inverse_temperature=3.0)
    with pytest.raises(ValueError, match=r"name == 'gsp.pol'"):
        rt.op("gsp.pol")


def test_a_cuda_tensor_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_convert, "device_type", lambda tensor: "cuda")
    monkeypatch.setitem(sys.modules, "cupy", None)       # `import cupy` raises ImportError
    x = torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"x is on cpu, and refdml runs CUDA tensors through "
                                         r"CuPy, which is not installed: pip install cupy"):
        rt.op("normalize.l2_normalize")(x)


def test_meta_tensors_get_shapes_and_other_devices_are_refused(monkeypatch):
    features = torch.empty(2, 7, 3, dtype=torch.float64, device="meta")
    prototypes = torch.empty(5, 3, dtype=torch.float64, device="meta")
    pooled, z = rt.op("gsp.pool")(features, prototypes, mu=0.4, inverse_temperature=3.0)
    assert (pooled.shape, z.shape, pooled.device.type) == ((2, 3), (2, 5), "meta")
    monkeypatch.setattr(_convert, "device_type", lambda tensor: "xpu")
    with pytest.raises(ValueError, match=r"x is on cpu; refdml's ops run on cpu and cuda"):
        rt.op("normalize.l2_normalize")(torch.ones(3, 2, dtype=torch.float64))
