"""refdml.jax: refdml's operators as ``jax.custom_vjp`` functions through ``pure_callback``.

Gradients are held to finite differences (``jax.test_util.check_grads``, and a central
difference along a drawn tangent against a drawn cotangent), never to an autodiff of
refdml's maths; values and gradients to the float64 reference of the catalogue (a second
implementation: the wrapped ops run the fast path). Everything in float64 runs inside
``jax.enable_x64(True)``; the global switch is left as the user has it (off here), so the
float32 tests run as a float32 model does.
"""

from __future__ import annotations

import sys
import warnings

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import assume, given, settings
from numpy.testing import assert_allclose

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

import refdml.jax  # noqa: E402
from refdml._interop import BRIDGED, bridged, named_gradients  # noqa: E402
from refdml.catalog import get  # noqa: E402
from refdml.exceptions import MissingExtraError  # noqa: E402
from refdml.gradcheck import strategies as rst  # noqa: E402
from refdml.jax import _ops  # noqa: E402

#: One operator of each kind: the GSP layer (two outputs), a normalisation, a pair loss, a
#: proxy loss, an entropic OT solve, the cross-batch loss.
REPRESENTATIVE = ("gsp.pool", "normalize.l2_normalize", "losses.contrastive",
                  "losses.proxy_anchor", "ot.sinkhorn_divergence", "crossbatch.xml_loss")
X64 = jax.enable_x64


def catalogue_inputs(name, seed=0):
    return get(name).make_inputs(np.random.default_rng(seed))


def split(name, inputs):
    """(floating arrays differentiated, the other keywords) of a catalogue input dict."""
    spec = bridged(name)
    wrt = tuple(k for k in spec.differentiable if inputs.get(k) is not None)
    return wrt, {k: v for k, v in inputs.items() if k not in wrt}


def as_jax(value, dtype=None):
    if isinstance(value, np.ndarray):
        return jnp.asarray(value, dtype=dtype if value.dtype.kind == "f" else None)
    return value


def function_of(name, inputs):
    """``f(*floating arrays)`` of the wrapped op, the rest of ``inputs`` fixed, and the
    floating arrays' names and values."""
    wrt, rest = split(name, inputs)
    fixed = {k: as_jax(v) for k, v in rest.items()}
    op = refdml.jax.op(name)

    def f(*arrays):
        return op(**fixed, **dict(zip(wrt, arrays)))

    return f, wrt, tuple(jnp.asarray(inputs[k]) for k in wrt)


def outputs_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# ------------------------------------------------------------------ gradients


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_check_grads_on_catalogue_inputs(name, seed):
    with X64(True):
        f, _, args = function_of(name, catalogue_inputs(name, seed))
        check_grads(f, args, order=1, modes=["rev"])


def _pairwise(x):
    diff = x[:, None, :] - x[None, :, :]
    return np.sqrt(np.sum(diff * diff, axis=-1))[np.triu_indices(len(x), 1)]


@st.composite
def drawn_inputs(draw, name):
    """Catalogue inputs of ``name`` with their floating arrays drawn by refdml's strategies
    (same shapes, so JAX compiles each callback once), away from the losses' kinks.

    The two losses with hinges on distances between rows (the contrastive loss, and the XML
    loss on its ridge predictions) take a catalogue input of a drawn seed, moved by drawn
    points of a small ball: drawn from scratch, hypothesis's favourite inputs (equal rows)
    sit on the hinge at distance 0.
    """
    def moved(array, radius):
        rows = array.reshape(-1, array.shape[-1])
        step = draw(rst.points_in_unit_ball(*rows.shape, min_radius=0.0))
        return (rows + radius * step).reshape(array.shape)

    if name in ("losses.contrastive", "crossbatch.xml_loss", "losses.proxy_anchor"):
        inputs = dict(catalogue_inputs(name, draw(st.integers(0, 7))))
    else:
        inputs = dict(catalogue_inputs(name))
    if name == "gsp.pool":
        features = draw(rst.points_in_unit_ball(8, 3))
        prototypes = draw(rst.points_in_unit_ball(3, 3))
        # Away from the cost's kink: a prototype on a feature (a cost of 0, where the
        # distance has only a subgradient) is hypothesis's favourite draw.
        gaps = np.linalg.norm(features[:, None, :] - prototypes[None, :, :], axis=-1)
        assume(gaps.min() > 0.05)
        # and from ties: two equal features of an image have equal costs, where (P2)'s
        # solution has only a one-sided derivative.
        for image in features.reshape(2, 4, 3):
            assume(_pairwise(image).min() > 0.05)
        inputs["features"] = features.reshape(2, 4, 3)
        inputs["prototypes"] = prototypes
    elif name == "normalize.l2_normalize":
        inputs["x"] = draw(rst.points_in_unit_ball(6, 4, min_radius=0.2))
    elif name == "losses.contrastive":
        x = moved(inputs["embeddings"], 0.05)
        # The hinges sit at d == pos_margin and d == neg_margin (and the norm's at 0).
        kinks = (0.0, inputs["pos_margin"], inputs["neg_margin"])
        assume(all(np.min(np.abs(_pairwise(x) - kink)) > 0.003 for kink in kinks))
        inputs["embeddings"] = x
    elif name == "losses.proxy_anchor":
        # Moved from a catalogue input: drawn from scratch, hypothesis's favourite rows are
        # parallel (cos == 1, where the cosine's gradient is 0 and a finite difference
        # measures only its curvature).
        inputs["embeddings"] = moved(inputs["embeddings"], 0.05)
        inputs["proxies"] = moved(inputs["proxies"], 0.05)
    elif name == "ot.sinkhorn_divergence":
        inputs["x"] = draw(rst.points_in_unit_ball(4, 2))
        inputs["y"] = draw(rst.points_in_unit_ball(3, 2))
        inputs["a"] = 4 * draw(rst.simplex_vectors(4, min_entry=0.2))
        inputs["b"] = 3 * draw(rst.simplex_vectors(3, min_entry=0.2))
    elif name == "crossbatch.xml_loss":
        inputs["Z"] = moved(inputs["Z"], 0.02)
        inputs["Y"] = moved(inputs["Y"], 0.05)
    return inputs


def _cotangents(draw, outputs):
    """Drawn cotangents, one per output, entries in [-2, 2] and not all 1."""
    drawn = []
    for out in outputs:
        size = int(np.prod(out.shape))
        values = draw(st.lists(st.floats(-2.0, 2.0), min_size=size, max_size=size))
        drawn.append(np.asarray(values, dtype=np.float64).reshape(out.shape))
    assume(not all(np.all(c == 1.0) for c in drawn))
    return drawn


@pytest.mark.parametrize("name", REPRESENTATIVE)
@settings(max_examples=12)
@given(data=st.data())
def test_gradients_on_drawn_inputs(name, data):
    """check_grads on drawn inputs, and the vector-Jacobian product with a drawn cotangent
    c along a drawn tangent t against the central difference of <c, f> along t."""
    inputs = data.draw(drawn_inputs(name))
    with X64(True):
        f, _, args = function_of(name, inputs)
        # eps 1e-6: JAX's default step leaves a truncation error of the order of the drawn
        # inputs' curvature (alpha = 8, near-parallel rows), above check_grads' tolerance.
        check_grads(f, args, order=1, modes=["rev"], eps=1e-6)

        outputs, vjp = jax.vjp(lambda *a: outputs_tuple(f(*a)), *args)
        cotangents = _cotangents(data.draw, outputs)
        tangents = [np.asarray(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=a.size,
                                                  max_size=a.size))).reshape(a.shape)
                    for a in args]
        grads = vjp(tuple(jnp.asarray(c) for c in cotangents))
        vjp_side = sum(float(np.sum(np.asarray(g) * t)) for g, t in zip(grads, tangents))

        h = 1e-6

        def pairing(sign):
            moved = [a + sign * h * jnp.asarray(t) for a, t in zip(args, tangents)]
            return sum(float(np.sum(np.asarray(o) * c))
                       for o, c in zip(outputs_tuple(f(*moved)), cotangents))

        difference = (pairing(+1) - pairing(-1)) / (2 * h)
    scale = sum(float(np.sum(np.abs(np.asarray(g)) * np.abs(t))) for g, t in zip(grads, tangents))
    # A wrong term or factor is an O(1) relative error; 1e-5 leaves room for the central
    # difference's truncation at a drawn point of large curvature.
    assert abs(vjp_side - difference) <= 1e-5 * max(scale, 1.0), (vjp_side, difference)


# ------------------------------------------------------------------ against the reference


@pytest.mark.parametrize("name", refdml.jax.names())
def test_values_and_gradients_equal_the_float64_reference(name):
    entry = get(name)
    inputs = catalogue_inputs(name)
    reference, context = entry.forward(**inputs)
    reference = outputs_tuple(reference)
    rng = np.random.default_rng(1)
    cotangents = [rng.standard_normal(np.shape(r)) for r in reference]
    wrt, _ = split(name, inputs)
    expected = named_gradients(entry.backward(context, *cotangents), wrt)
    rtol = (entry.mirror_rtol or {}).get("float64", 1e-10)
    with X64(True):
        f, _, args = function_of(name, inputs)
        outputs, vjp = jax.vjp(lambda *a: outputs_tuple(f(*a)), *args)
        grads = vjp(tuple(jnp.asarray(c) for c in cotangents))
    assert len(outputs) == len(reference)
    for out, ref in zip(outputs, reference):
        assert out.dtype == jnp.float64
        assert_allclose(np.asarray(out), ref, rtol=rtol, atol=rtol * np.max(np.abs(ref)))
    for k, (grad, ref) in enumerate(zip(grads, expected)):
        assert grad.dtype == jnp.float64 and grad.shape == args[k].shape
        if ref is None:   # the reference's "no gradient" is JAX's zeros
            assert not np.any(np.asarray(grad)), wrt[k]
        else:
            assert_allclose(np.asarray(grad), ref, rtol=rtol,
                            atol=rtol * max(np.max(np.abs(ref)), 1e-300), err_msg=wrt[k])


def test_gsp_pool_returns_its_two_outputs():
    inputs = catalogue_inputs("gsp.pool")
    with X64(True):
        out = refdml.jax.op("gsp.pool")(**{k: as_jax(v) for k, v in inputs.items()})
    assert isinstance(out, tuple) and len(out) == 2
    batch, _, dim = inputs["features"].shape
    assert out[0].shape == (batch, dim)
    assert out[1].shape == (batch, inputs["prototypes"].shape[0])


def test_subnormal_inputs_are_computed_as_ieee_numbers():
    """XLA runs a callback with denormals flushed to zero; refdml runs on its own thread,
    where a row of subnormals is a (tiny) vector, not a zero one."""
    x = np.array([[3e-310, 4e-310], [1.0, 0.0]])
    with X64(True):
        y = refdml.jax.op("normalize.l2_normalize")(x=jnp.asarray(x))
    # The 3-4-5 triangle: the exact unit vector of (3, 4) times any scale.
    assert_allclose(np.asarray(y), [[0.6, 0.8], [1.0, 0.0]], rtol=1e-15)


# ------------------------------------------------------------------ jit and vmap


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_jit_and_vmap_agree_with_eager(name):
    inputs = [catalogue_inputs(name, seed) for seed in (0, 1)]
    with X64(True):
        eager = []
        for one in inputs:
            f, _, args = function_of(name, one)
            value = outputs_tuple(f(*args))
            grads = jax.grad(lambda *a: sum(jnp.sum(o * o) for o in outputs_tuple(f(*a))),
                             argnums=tuple(range(len(args))))(*args)
            eager.append((value, grads))

        f, wrt, args = function_of(name, inputs[0])
        jitted = jax.jit(lambda *a: outputs_tuple(f(*a)))(*args)
        for got, want in zip(jitted, eager[0][0]):
            assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-13, atol=0)

        # vmap over every array, the integer ones (labels, a split) included.
        spec = bridged(name)
        arrays = tuple(k for k in spec.arrays if isinstance(inputs[0].get(k), np.ndarray))
        options = {k: v for k, v in inputs[0].items() if k not in arrays}
        stacked = tuple(jnp.asarray(np.stack([one[k] for one in inputs])) for k in arrays)
        op = refdml.jax.op(name)

        def loss(*batch):
            out = outputs_tuple(op(**options, **dict(zip(arrays, batch))))
            return sum(jnp.sum(o * o) for o in out)

        floating = tuple(arrays.index(k) for k in wrt)
        batched = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=floating)))(*stacked)
    for row, (value, grads) in enumerate(eager):
        want = sum(float(np.sum(np.asarray(o) ** 2)) for o in value)
        assert_allclose(float(batched[0][row]), want, rtol=1e-12)
        for got, g in zip(batched[1], grads):
            assert_allclose(np.asarray(got[row]), np.asarray(g), rtol=1e-12,
                            atol=1e-12 * np.max(np.abs(np.asarray(g))))


def test_optional_arrays_may_be_left_out_under_jit():
    inputs = catalogue_inputs("ot.sinkhorn_divergence")
    inputs.pop("a"), inputs.pop("b")
    op = refdml.jax.op("ot.sinkhorn_divergence")
    options = {k: v for k, v in inputs.items() if k not in ("x", "y")}
    with X64(True):
        x, y = jnp.asarray(inputs["x"]), jnp.asarray(inputs["y"])
        eager = jax.value_and_grad(lambda x: op(x=x, y=y, **options))(x)
        jitted = jax.jit(jax.value_and_grad(lambda x: op(x=x, y=y, **options)))(x)
    reference, context = get("ot.sinkhorn_divergence").forward(**inputs)
    assert_allclose(float(eager[0]), reference, rtol=1e-10)
    assert_allclose(np.asarray(jitted[1]), np.asarray(eager[1]), rtol=1e-13)
    assert_allclose(np.asarray(eager[1]),
                    get("ot.sinkhorn_divergence").backward(context, 1.0).x, rtol=1e-10)


# ------------------------------------------------------------------ dtypes


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("name", ["gsp.pool", "losses.proxy_anchor", "ot.sinkhorn_divergence"])
def test_low_precision_outputs_and_gradients_keep_the_input_dtype(name, dtype):
    """Computed in float32 (float64 for the entropic OT ops, even with x64 off), rounded to
    the input dtype: within a few units of that dtype's rounding of the reference."""
    inputs = catalogue_inputs(name)
    wrt, rest = split(name, inputs)
    low = jnp.dtype(dtype)
    rounded = {k: np.asarray(jnp.asarray(inputs[k], dtype=low).astype(jnp.float32))
               .astype(np.float64) for k in wrt}
    reference, _ = get(name).forward(**rest, **rounded)
    op = refdml.jax.op(name)
    fixed = {k: as_jax(v) for k, v in rest.items()}
    args = tuple(jnp.asarray(inputs[k], dtype=low) for k in wrt)

    def loss(*a):
        out = outputs_tuple(op(**fixed, **dict(zip(wrt, a))))
        assert all(o.dtype == low for o in out)
        return sum(jnp.sum(o.astype(jnp.float32)) for o in out)

    value, grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))))(*args)
    assert all(g.dtype == low and g.shape == a.shape for g, a in zip(grads, args))
    assert all(np.all(np.isfinite(np.asarray(g, dtype=np.float32))) for g in grads)
    want = sum(float(np.sum(r)) for r in outputs_tuple(reference))
    eps = float(jnp.finfo(low).eps)
    scale = sum(float(np.sum(np.abs(r))) for r in outputs_tuple(reference))
    # Each output element is rounded once to the dtype (eps / 2 of it), after a float32
    # computation whose error on these well-conditioned inputs is far below 1e-5 of it.
    assert abs(float(value) - want) <= (eps + 1e-5) * scale


# ------------------------------------------------------------------ bad input


def _gsp(**overrides):
    inputs = catalogue_inputs("gsp.pool")
    arrays = {"features": jnp.asarray(inputs["features"], dtype=jnp.float32),
              "prototypes": jnp.asarray(inputs["prototypes"], dtype=jnp.float32)}
    arrays.update(mu=inputs["mu"], inverse_temperature=inputs["inverse_temperature"])
    arrays.update(overrides)
    return arrays


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"prototypes": [[0.0, 1.0, 2.0]]}, TypeError,
     r"^prototypes is a list; refdml\.jax ops take jax arrays: pass jax\.numpy\.asarray"),
    ({"features": 1.5}, TypeError, r"^features is a float; refdml\.jax ops take jax arrays"),
    ({"features": np.ones((2, 4, 3), np.int64)}, TypeError,
     r"^features is a int\d\d jax array; gsp\.pool needs floating point"),
    ({"features": jnp.ones((2, 4, 3), dtype=jnp.int32)}, TypeError,
     r"^features is a int32 jax array; gsp\.pool needs floating point"),
    ({"prototypes": jnp.ones((3, 3), dtype=jnp.float16)}, TypeError,
     r"^prototypes is float16 and features float32; give gsp\.pool one floating dtype"),
    ({"prototypes": None}, TypeError, r"^gsp\.pool needs the array prototypes"),
    ({"mu": jnp.float32(0.5)}, TypeError,
     r"^mu is a float32 jax array; refdml\.jax takes hyperparameters as Python values"),
])
def test_bad_arrays_are_refused_in_one_line_naming_the_argument(overrides, error, match):
    with pytest.raises(error, match=match) as raised:
        refdml.jax.op("gsp.pool")(**_gsp(**overrides))
    assert "\n" not in str(raised.value)


def test_positional_arrays_follow_the_rows_order_and_are_checked():
    op = refdml.jax.op("gsp.pool")
    kw = _gsp()
    features, prototypes = kw.pop("features"), kw.pop("prototypes")
    by_position = op(features, prototypes, **kw)
    by_keyword = op(features=features, prototypes=prototypes, **kw)
    for got, want in zip(by_position, by_keyword):
        assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=0)
    with pytest.raises(TypeError, match="at most 2 positional arrays"):
        op(features, prototypes, prototypes, **kw)
    with pytest.raises(TypeError, match="got features both positionally and by keyword"):
        op(features, features=features, prototypes=prototypes, **kw)


def test_an_unknown_name_lists_the_close_ones():
    with pytest.raises(ValueError, match=r"gsp\.pools.*did you mean 'gsp\.pool'"):
        refdml.jax.op("gsp.pools")


def test_refdmls_own_errors_surface_as_refdml_raises_them():
    with X64(True):
        x = jnp.asarray(np.array([[1.0, np.nan], [1.0, 2.0]]))
        l2 = refdml.jax.op("normalize.l2_normalize")
        for _ in range(2):   # the second call dispatches through JAX's cached fast path
            with pytest.raises(ValueError, match=r"^x must be finite, got nan at index \(0, 1\)$"):
                l2(x=x)
        with pytest.raises(ValueError, match=r"^x must be finite"):
            jax.grad(lambda x: l2(x=x).sum())(x)
        with pytest.raises(ValueError, match=r"^mu == 1\.5, must be in \(0, 1\]$"):
            refdml.jax.op("gsp.pool")(**_gsp(mu=1.5))
        # Under jit the callback runs after tracing, outside refdml.jax: JAX's own error,
        # whose text ends with refdml's.
        with pytest.raises(jax.errors.JaxRuntimeError) as raised:
            jax.jit(lambda x: l2(x=x))(x).block_until_ready()
    last = str(raised.value).strip().splitlines()[-1]
    assert last == "ValueError: x must be finite, got nan at index (0, 1)"


def test_second_derivatives_are_refused():
    with X64(True):
        x = jnp.asarray(catalogue_inputs("normalize.l2_normalize")["x"])
        l2 = refdml.jax.op("normalize.l2_normalize")
        with pytest.raises(RuntimeError, match=r"^refdml's backward of normalize\.l2_normalize "
                                               r"is first order"):
            jax.grad(lambda x: jnp.sum(jax.grad(lambda x: l2(x=x)[0, 0])(x)))(x)
        with pytest.raises(TypeError, match="forward-mode"):   # JAX's, for any custom_vjp
            jax.hessian(lambda x: l2(x=x)[0, 0])(x)


# ------------------------------------------------------------------ the CPU route


def test_arrays_off_the_cpu_warn_once_per_op_in_one_line(monkeypatch):
    monkeypatch.setattr(_ops, "device_platform", lambda array: "gpu")
    ops = [refdml.jax.op("gsp.pool"), refdml.jax.op("normalize.l2_normalize")]
    for op in ops:
        monkeypatch.setattr(op, "_warned", False)
    x = jnp.ones((2, 3), dtype=jnp.float32)
    with pytest.warns(refdml.jax.HostRoundTripWarning) as record:
        for _ in range(3):
            ops[0](**_gsp())
            ops[1](x=x)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2, messages
    assert all("\n" not in m and "jax.pure_callback" in m and "copied to the host" in m
               for m in messages)
    assert "gsp.pool" in messages[0] and "normalize.l2_normalize" in messages[1]


def test_cpu_arrays_do_not_warn(monkeypatch):
    op = refdml.jax.op("normalize.l2_normalize")
    monkeypatch.setattr(op, "_warned", False)
    assert _ops.device_platform(jnp.ones(2)) == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op(x=jnp.ones((2, 3)))


# ------------------------------------------------------------------ the table


def test_names_are_every_catalogue_name_of_the_table():
    expected = sorted(alias for spec in BRIDGED.values() for alias in spec.catalogue_names)
    assert list(refdml.jax.names()) == expected
    for name in refdml.jax.names():
        assert get(name).name == name
        assert refdml.jax.op(name).spec is bridged(name)


def test_without_jax_the_import_names_the_extra(monkeypatch):
    # None in sys.modules is how Python marks a module as not importable; JAX itself, loaded
    # already, is neither unloaded nor imported again (a second import aborts jaxlib).
    monkeypatch.setitem(sys.modules, "jax", None)
    for name in [m for m in sys.modules if m == "refdml.jax" or m.startswith("refdml.jax.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(MissingExtraError,
                       match=r'^needs the "jax" extra \(jax is not installed\): '
                             r'pip install "refdml\[jax\]"$'):
        import refdml.jax  # noqa: F401
