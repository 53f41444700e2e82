"""The JAX side of refdml.conformance: the adapter alone, then ``check_implementation``
against independent JAX implementations of the GSP layer and the Sinkhorn divergence
(tests/conformance/impls_jax.py).

The adapter tests check against NumPy's own functions (``np.cos`` for the derivative of
``sin``), never against refdml. The correct implementations must pass; each broken one
must fail with the cause its defect predicts, on the input case and at the element that
expose it. Where an expected location is asserted, it is found from the case's inputs
with NumPy (which prototype sits on a feature, which point of x is a point of y), not
from the reference's outputs.
"""

from __future__ import annotations

import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings
from numpy.testing import assert_allclose, assert_array_equal

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import impls_jax as impls  # noqa: E402  (needs JAX)

from refdml.catalog import get  # noqa: E402
from refdml.conformance import check_implementation, get_framework  # noqa: E402
from refdml.conformance._frameworks import StructureError  # noqa: E402

# One seed of make_inputs plus the reference cases: the compilations (one per shape and
# hyperparameter) dominate the time, not the cases.
SEEDS = 1


def check(impl, op, dtype="float64", **options):
    options = {"seeds": SEEDS, "search": False, "error_cases": False, **options}
    return check_implementation(impl, op, framework="jax", dtype=dtype, **options)


def reference_case(op, name):
    """The inputs of the catalogue entry's reference case ``name`` (drawn, as
    check_implementation draws them, from ``default_rng(0)``)."""
    cases = {c.name: c for c in get(op).reference_inputs(np.random.default_rng(0))}
    return cases[name].inputs


def located(report):
    return {(f.case, f.quantity, f.cause) for f in report.failures}


# ------------------------------------------------------------------------------ adapter


@pytest.fixture(scope="module")
def fw():
    return get_framework("jax")


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_asarray_round_trip_keeps_values_and_dtypes(fw, dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4))
    array = fw.asarray(x, dtype)
    assert array.dtype == np.dtype(dtype)
    evaluation = fw.run(lambda inputs: inputs["x"], {"x": array}, ("x",), None)
    # A cast and a copy, no arithmetic: NumPy's own cast is the exact expectation.
    assert_array_equal(evaluation.outputs[0], x.astype(dtype))
    assert evaluation.outputs[0].dtype == np.dtype(dtype)
    assert evaluation.grads is None


def test_asarray_leaves_integers_and_booleans_integral(fw):
    labels = fw.asarray(np.array([0, 2, 1]), "float32")
    mask = fw.asarray(np.array([True, False]), "float64")
    assert jnp.issubdtype(labels.dtype, jnp.integer)
    assert_array_equal(np.asarray(labels), [0, 2, 1])
    assert mask.dtype == bool


def test_asarray_copes_with_read_only_and_strided_arrays(fw):
    x = np.arange(12.0)
    x.flags.writeable = False
    assert_array_equal(np.asarray(fw.asarray(x, "float64")), x)
    assert_array_equal(np.asarray(fw.asarray(x[::3], "float64")), x[::3])


@pytest.mark.parametrize("dtype, rtol", [("float64", 1e-15), ("float32", 1e-6)])
def test_vjp_of_sin_is_cos_times_the_cotangent(fw, dtype, rtol):
    rng = np.random.default_rng(1)
    x, cotangent = rng.uniform(-3.0, 3.0, 7), rng.standard_normal(7)
    inputs = {"x": fw.asarray(x, dtype), "scale": 2.0}
    evaluation = fw.run(lambda i: i["scale"] * jnp.sin(i["x"]), inputs, ("x",), (cotangent,))
    rounded = x.astype(dtype).astype(np.float64)
    assert evaluation.outputs[0].dtype == np.dtype(dtype)
    assert evaluation.grads["x"].dtype == np.dtype(dtype)
    assert_allclose(evaluation.outputs[0], 2.0 * np.sin(rounded), rtol=rtol)
    assert_allclose(evaluation.grads["x"], 2.0 * np.cos(rounded) * cotangent, rtol=rtol,
                    atol=rtol)


@given(values=hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=2, max_side=4),
                         elements=st.floats(-10.0, 10.0)),
       seed=st.integers(0, 2**16))
@settings(max_examples=8, deadline=None, derandomize=True)
def test_vjp_of_a_cubic_matches_its_derivative_for_any_shape(values, seed):
    fw = get_framework("jax")
    cotangent = np.random.default_rng(seed).standard_normal(values.shape)
    evaluation = fw.run(lambda i: i["x"] ** 3, {"x": fw.asarray(values, "float64")}, ("x",),
                        (cotangent,))
    assert evaluation.grads["x"].shape == values.shape
    assert_allclose(evaluation.grads["x"], 3.0 * values**2 * cotangent, rtol=1e-14, atol=0)


def test_float64_runs_in_x64_without_flipping_the_global_switch(fw):
    before = jax.config.jax_enable_x64
    x = fw.asarray(np.array([1.0 + 2.0**-40]), "float64")
    evaluation = fw.run(lambda i: i["x"] * 3.0, {"x": x}, ("x",), (np.ones(1),))
    # 1 + 2^-40 survives only in float64 (float32 rounds it to 1).
    assert evaluation.outputs[0][0] == 3.0 * (1.0 + 2.0**-40)
    assert evaluation.outputs[0].dtype == np.float64
    assert jax.config.jax_enable_x64 == before


def test_several_outputs_numbers_and_unused_inputs(fw):
    x = fw.asarray(np.array([0.5, -1.0]), "float64")
    y = fw.asarray(np.array([3.0]), "float64")
    cotangents = (np.array([2.0, -1.0]), np.array(0.5), np.array(4.0))
    evaluation = fw.run(lambda i: (i["x"] ** 2, jnp.sum(i["x"]), 1.5), {"x": x, "y": y},
                        ("x", "y"), cotangents)
    assert [o.shape for o in evaluation.outputs] == [(2,), (), ()]
    # d/dx [<c0, x^2> + c1 sum(x)] = 2 c0 x + c1; y and the constant output: no dependence.
    assert_allclose(evaluation.grads["x"], 2 * np.array([2.0, -1.0]) * [0.5, -1.0] + 0.5,
                    rtol=1e-15)
    assert_array_equal(evaluation.grads["y"], [0.0])


def test_integer_outputs_take_no_cotangent(fw):
    x = fw.asarray(np.array([0.5, 2.5]), "float64")
    evaluation = fw.run(lambda i: (3.0 * i["x"], jnp.argmax(i["x"])), {"x": x}, ("x",),
                        (np.ones(2), np.array(1.0)))
    assert int(evaluation.outputs[1]) == 1
    assert_allclose(evaluation.grads["x"], [3.0, 3.0], rtol=1e-15)


@pytest.mark.parametrize("returned, match", [
    (lambda x: {"value": x}, "output 0 is a builtins.dict"),
    (lambda x: "x", "output 0 is a builtins.str"),
    (lambda x: (x, x * 1j), "output 1 has dtype complex"),
])
def test_outputs_of_the_wrong_kind_are_structure_errors(fw, returned, match):
    x = fw.asarray(np.ones(2), "float64")
    with pytest.raises(StructureError, match=match):
        fw.run(lambda i: returned(i["x"]), {"x": x}, ("x",), (np.ones(2),))


# ------------------------------------------------------------------------ GSP pooling


@pytest.mark.parametrize("dtype, hard_cases", [
    ("float64", {"huge inverse temperature (1e300)", "mu near 0 (1e-300)",
                 "mu == 1 (GAP, Thm 4.1)", "huge scale (1e200)",
                 "a prototype on a feature, duplicate features, ε = 1e6"}),
    ("float32", {"mu == 1 (GAP, Thm 4.1)", "float32 edge"}),
])
def test_gsp_pool_solved_exactly_and_differentiated_by_jax_passes(dtype, hard_cases):
    report = check(impls.gsp_pool, "gsp.pool", dtype)
    assert report.passed, report.summary()
    # Not a vacuous pass: the hard cases were compared.
    assert hard_cases <= set(report.cases), report.cases


def test_gsp_pool_with_the_printed_eq_4_2_backward_fails_its_gradients():
    report = check(impls.gsp_pool_printed_42, "gsp.pool", reference_cases=False, search=True,
                   max_examples=5)
    # The forward is the correct one: only the gradients through (P2) are wrong, on the
    # catalogue's seed and on the search's shrunk case alike.
    assert {(f.quantity, f.cause) for f in report.failures} == {
        ("grad features", "gradient"), ("grad prototypes", "gradient")}, report.summary()
    assert {f.case for f in report.failures} == {"seed 0", report.cases[-1]}
    assert report.search.found and report.cases[-1].startswith("search")
    assert all(f.error > 1e-2 for f in report.failures), report.summary()


def test_gsp_pool_with_a_naive_norm_is_nan_where_a_prototype_sits_on_a_feature():
    report = check(impls.gsp_pool_naive_norm, "gsp.pool")
    name = "a prototype on a feature, duplicate features, ε = 1e6"
    case = reference_case("gsp.pool", name)
    # Which prototype coincides with which feature, from the inputs alone.
    hits = np.argwhere(np.all(case["prototypes"][:, None, None, :] == case["features"][None],
                              axis=-1))
    assert hits.shape == (1, 3), hits
    prototype, image, feature = (int(k) for k in hits[0])
    by_place = {(f.case, f.quantity): f for f in report.failures}
    assert by_place[name, "grad prototypes"].cause == "non-finite"
    assert by_place[name, "grad prototypes"].index[0] == prototype
    assert by_place[name, "grad features"].cause == "non-finite"
    assert by_place[name, "grad features"].index[:2] == (image, feature)
    assert np.isfinite(by_place[name, "grad features"].ref_value)
    # Away from zero costs and extreme scales the naive norm is right.
    assert not [f for f in report.failures if f.case == "seed 0"], report.summary()


# --------------------------------------------------------------- Sinkhorn divergence


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sinkhorn_divergence_passes_on_the_catalogue_seeds(dtype):
    report = check(impls.sinkhorn_divergence, "ot.sinkhorn_divergence", dtype, seeds=2,
                   reference_cases=False)
    assert report.passed, report.summary()


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_sinkhorn_divergence_passes_on_the_reference_cases(dtype):
    # The hard cases included: the cloud against itself (zero by cancellation, judged
    # against its cancelling terms), small eps (float32's tolerance scaled by cost / eps)
    # and large eps (where the reference was 1e-5 off a 50-digit solve until its last
    # half steps and the expm1 mass term; tests/operators/test_ot.py).
    report = check(impls.sinkhorn_divergence, "ot.sinkhorn_divergence", dtype)
    assert report.passed, report.summary()
    assert {"identical clouds (SD == 0)", "small eps (1/100 of the largest cost)",
            "large eps (1e6 of the largest cost)"} <= set(report.cases)


def test_sinkhorn_divergence_without_debiasing_fails_its_value():
    report = check(impls.sinkhorn_divergence_not_debiased, "ot.sinkhorn_divergence",
                   reference_cases=False)
    assert ("seed 0", "output 0", "value") in located(report), report.summary()
    value = next(f for f in report.failures if f.quantity == "output 0")
    # OT(a, b) alone exceeds the divergence by the mean of the two self terms (> 0).
    assert value.impl_value > value.ref_value


def test_sinkhorn_stopped_early_fails_its_value_with_the_not_converged_hint():
    report = check(impls.sinkhorn_divergence_stopped_early, "ot.sinkhorn_divergence")
    assert ("seed 0", "output 0", "value") in located(report), report.summary()
    # At a small eps the loose stop is far from convergence, and the report says why: the
    # value is much closer to the reference's own solve stopped at a loose tolerance.
    small_eps = {(f.case, f.quantity): f for f in report.failures}[
        "small eps (1/100 of the largest cost)", "output 0"]
    assert small_eps.cause == "value"
    assert small_eps.hint is not None and small_eps.hint.startswith("not converged"), small_eps


def test_sinkhorn_cost_through_sqrt_is_nan_at_the_zero_self_costs():
    report = check(impls.sinkhorn_divergence_sqrt_cost, "ot.sinkhorn_divergence",
                   reference_cases=False)
    # Every self term has a zero diagonal: NaN gradients on every case, right values.
    assert located(report) == {("seed 0", "grad x", "non-finite"),
                               ("seed 0", "grad y", "non-finite")}, report.summary()


def test_sinkhorn_cross_cost_through_sqrt_is_nan_only_at_coincident_points():
    report = check(impls.sinkhorn_divergence_nan_at_coincident, "ot.sinkhorn_divergence")
    non_finite = {(f.case, f.quantity): f for f in report.failures if f.cause == "non-finite"}
    assert {case for case, _ in non_finite} == {"identical clouds (SD == 0)",
                                                "duplicate and coincident points"}, \
        report.summary()
    case = reference_case("ot.sinkhorn_divergence", "duplicate and coincident points")
    # The points of x that are also points of y, from the inputs alone.
    shared_x = {int(i) for i, _ in np.argwhere(np.all(case["x"][:, None] == case["y"][None],
                                                      axis=-1))}
    shared_y = {int(j) for _, j in np.argwhere(np.all(case["x"][:, None] == case["y"][None],
                                                      axis=-1))}
    assert shared_x and shared_y
    assert non_finite["duplicate and coincident points", "grad x"].index[0] in shared_x
    assert non_finite["duplicate and coincident points", "grad y"].index[0] in shared_y
