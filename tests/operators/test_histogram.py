"""XML histogram operator: LP (2.1), Claim 2.1, entropic (2.4), convex combination (2.3)."""

import functools
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy.optimize import linprog, minimize

from refdml import histogram
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_closed_form_solves_the_lp(seed):
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((3, 6, 4))
    prototypes = rng.standard_normal((5, 4)) * rng.uniform(0.3, 3.0, (5, 1))
    lp = histogram.histogram_lp(features, prototypes)
    closed = histogram.histogram_closed_form(features, prototypes)
    np.testing.assert_allclose(lp.objective, closed.objective, rtol=1e-12)
    # Continuous random data: the argmax is unique, hence so is the LP solution.
    np.testing.assert_allclose(lp.pi, closed.pi, atol=1e-12)
    np.testing.assert_allclose(lp.z, closed.z, atol=1e-12)
    np.testing.assert_allclose(closed.z.sum(axis=1), 1.0, rtol=1e-15)


def test_claim_2_1_is_max_inner_product_not_nearest_prototype():
    features = np.array([[[1.0, 0.0]]])
    # nu_0 is nearer to x (distance 0.1) but nu_1 has the larger inner product (3 > 0.9).
    prototypes = np.array([[0.9, 0.0], [3.0, 3.0]])
    nearest = np.argmin(np.linalg.norm(prototypes - features[0, 0], axis=1))
    assert nearest == 0
    lp = histogram.histogram_lp(features, prototypes)
    np.testing.assert_allclose(lp.z, [[0.0, 1.0]], atol=1e-12)
    np.testing.assert_allclose(histogram.histogram_closed_form(features, prototypes).z, [[0.0, 1.0]])


def test_printed_constraint_of_2_4_is_infeasible():
    """sum_ij pi_ij = 1/n with sum_j pi_ij = z_i and z in the simplex: infeasible for n > 1."""
    m, n = 3, 4
    # Variables (pi row-major, z); the printed constraints only, any objective.
    a_eq = np.zeros((1 + m + 1, m * n + m))
    a_eq[0, : m * n] = 1.0                                      # sum_ij pi_ij = 1/n
    for i in range(m):
        a_eq[1 + i, i * n:(i + 1) * n] = 1.0                    # sum_j pi_ij - z_i = 0
        a_eq[1 + i, m * n + i] = -1.0
    a_eq[-1, m * n:] = 1.0                                      # z in the simplex
    b_eq = np.concatenate([[1.0 / n], np.zeros(m), [1.0]])
    printed = linprog(np.zeros(m * n + m), A_eq=a_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    assert printed.status == 2  # infeasible


def _entropic_by_convex_solver(scores, inverse_temperature):
    """Maximise (2.4) (corrected constraint) over pi with SLSQP; one image."""
    m, n = scores.shape

    def negative_objective(flat):
        pi = flat.reshape(m, n)
        return -(np.sum(scores * pi) - np.sum(pi * np.log(pi)) / inverse_temperature)

    def gradient(flat):
        pi = flat.reshape(m, n)
        return -(scores - (np.log(pi) + 1.0) / inverse_temperature).ravel()

    constraints = [{"type": "eq", "fun": lambda flat, j=j: flat.reshape(m, n)[:, j].sum() - 1.0 / n} for j in range(n)]
    start = np.full(m * n, 1.0 / (m * n))
    solution = minimize(
        negative_objective, start, jac=gradient, constraints=constraints,
        bounds=[(1e-12, None)] * (m * n), method="SLSQP", options={"ftol": 1e-15, "maxiter": 500},
    )
    assert solution.success
    return solution.x.reshape(m, n).sum(axis=1)


@pytest.mark.parametrize("inverse_temperature", [0.5, 2.0])
def test_entropic_softmax_solves_2_4(inverse_temperature):
    rng = np.random.default_rng(3)
    features, prototypes = rng.standard_normal((2, 4, 3)), rng.standard_normal((3, 3))
    z = histogram.histogram_entropic(features, prototypes, inverse_temperature=inverse_temperature)
    for b in range(2):
        scores = prototypes @ features[b].T
        np.testing.assert_allclose(z[b], _entropic_by_convex_solver(scores, inverse_temperature), atol=1e-6)


def test_entropic_matches_a_loop_and_tends_to_the_lp():
    rng = np.random.default_rng(4)
    features, prototypes = rng.standard_normal((2, 5, 3)), rng.standard_normal((4, 3))
    inverse_temperature = 1.7
    loop = np.zeros((2, 4))
    for b in range(2):
        for j in range(5):
            scores = [inverse_temperature * float(prototypes[i] @ features[b, j]) for i in range(4)]
            top = max(scores)
            weights = [np.exp(s - top) for s in scores]
            for i in range(4):
                loop[b, i] += weights[i] / sum(weights) / 5
    np.testing.assert_allclose(histogram.histogram_entropic(features, prototypes, inverse_temperature=inverse_temperature), loop, rtol=1e-13)
    closed = histogram.histogram_closed_form(features, prototypes).z
    gaps = [np.abs(histogram.histogram_entropic(features, prototypes, inverse_temperature=e) - closed).max() for e in (1, 10, 100, 1e4)]
    assert all(b < a for a, b in zip(gaps, gaps[1:]))
    assert gaps[-1] < 1e-12


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("inverse_temperature", [0.3, 2.0, 10.0])
def test_entropic_gradients_fixed_seeds(seed, inverse_temperature):
    rng = np.random.default_rng(seed)
    inputs = {"features": rng.standard_normal((2, 4, 3)), "prototypes": rng.standard_normal((3, 3))}
    forward = functools.partial(histogram.histogram_entropic_forward, inverse_temperature=inverse_temperature)
    assert_gradients(check_gradients(forward, histogram.histogram_entropic_backward, inputs, rng=seed), rtol=1e-6)


@given(rst.points_in_unit_ball(5, 3), rst.points_on_sphere(4, 3), st.floats(0.1, 10.0))
def test_entropic_gradients_hypothesis(features, prototypes, inverse_temperature):
    forward = functools.partial(histogram.histogram_entropic_forward, inverse_temperature=inverse_temperature)
    inputs = {"features": features[None], "prototypes": prototypes}
    assert_gradients(check_gradients(forward, histogram.histogram_entropic_backward, inputs, rng=0), rtol=1e-6)


def test_convex_combination_matches_a_loop():
    rng = np.random.default_rng(5)
    z, prototypes = rng.dirichlet(np.ones(4), size=3), rng.standard_normal((4, 2))
    loop = np.array([[sum(z[b, k] * prototypes[k, c] for k in range(4)) for c in range(2)] for b in range(3)])
    np.testing.assert_allclose(histogram.convex_combination(z, prototypes), loop, rtol=1e-14)


@given(
    rst.simplex_vectors(4, batch=3),
    # No subnormals: prototypes of 5e-324 give gradients of z that are single subnormal
    # units, below any finite difference's resolution (a draw that failed, not a bug).
    hnp.arrays(np.float64, (4, 2), elements=st.floats(-3, 3, allow_nan=False, width=64,
                                                      allow_subnormal=False)),
)
def test_convex_combination_gradients_hypothesis(z, prototypes):
    inputs = {"z": z, "prototypes": prototypes}
    result = check_gradients(
        histogram.convex_combination_forward, histogram.convex_combination_backward, inputs, rng=0
    )
    assert_gradients(result, rtol=1e-6)


def test_histogram_then_convex_combination_chain():
    rng = np.random.default_rng(6)
    inputs = {"features": rng.standard_normal((2, 4, 3)), "prototypes": rng.standard_normal((3, 3))}

    def forward(features, prototypes):
        z, hist_ctx = histogram.histogram_entropic_forward(features, prototypes, inverse_temperature=1.5)
        y, comb_ctx = histogram.convex_combination_forward(z, prototypes)
        return y, (hist_ctx, comb_ctx)

    def backward(ctx, d_y):
        hist_ctx, comb_ctx = ctx
        comb = histogram.convex_combination_backward(comb_ctx, d_y)
        hist = histogram.histogram_entropic_backward(hist_ctx, comb.z)
        return {"features": hist.features, "prototypes": hist.prototypes + comb.prototypes}

    assert_gradients(check_gradients(forward, backward, inputs, rng=0), rtol=1e-6)


_ONES = np.ones((1, 4, 3))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: histogram.histogram_entropic(np.ones((4, 3)), np.ones((2, 3)), inverse_temperature=1.0),
         ValueError, "features must have 3"),
        (lambda: histogram.histogram_entropic(_ONES, np.ones((2, 2)), inverse_temperature=1.0),
         ValueError, "same last dimension"),
        (lambda: histogram.histogram_entropic(_ONES, np.ones((2, 3)), inverse_temperature=0.0),
         ValueError, r"inverse_temperature == 0.0, must be in \(0, inf\)"),
        (lambda: histogram.histogram_entropic(_ONES, np.ones((2, 3)), inverse_temperature=np.nan),
         ValueError, "inverse_temperature == nan"),
        (lambda: histogram.histogram_lp(np.ones((1, 0, 3)), np.ones((2, 3))),
         ValueError, "features must not be empty"),
        (lambda: histogram.histogram_closed_form(_ONES, np.full((2, 3), np.nan)),
         ValueError, "prototypes must be finite"),
        (lambda: histogram.convex_combination(np.ones((2, 3)), np.ones((4, 5))),
         ValueError, "3 weights per row but there are 4"),
        (lambda: histogram.convex_combination("z", np.ones((4, 5))),
         TypeError, "z must be an array of real numbers"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_histograms_at_extreme_scales(scale):
    """The LP, the closed form and the entropic histogram at any magnitude.

    The LP and the closed form are invariant under a positive scaling of the scores
    (their objective scales); the entropic histogram depends on
    inverse_temperature * scores only, so features * s with inverse_temperature / s is
    the same problem.
    """
    rng = np.random.default_rng(40)
    features, prototypes = rng.standard_normal((2, 6, 3)), rng.standard_normal((4, 3))
    lp, closed = histogram.histogram_lp(features, prototypes), histogram.histogram_closed_form(features, prototypes)
    for scaled_features, scaled_prototypes, factor in (
        (features * scale, prototypes, scale),
        (features * scale, prototypes * scale, scale * scale),
    ):
        for solve, ref in ((histogram.histogram_lp, lp), (histogram.histogram_closed_form, closed)):
            if factor > 1e300:  # |objective| ~ 1e600
                with pytest.raises(ValueError, match="the optimal value overflows float64"):
                    solve(scaled_features, scaled_prototypes)
                continue
            result = solve(scaled_features, scaled_prototypes)
            np.testing.assert_allclose(result.z, ref.z, rtol=0, atol=1e-12)
            np.testing.assert_allclose(result.pi, ref.pi, rtol=0, atol=1e-12)
            if factor >= 1e-300:
                np.testing.assert_allclose(result.objective, ref.objective * factor, rtol=1e-12)
            else:  # ~1e-600: rounds to zero
                np.testing.assert_allclose(result.objective, 0.0, atol=1e-300)
    z = histogram.histogram_entropic(features, prototypes, inverse_temperature=2.0)
    same = histogram.histogram_entropic(features * scale, prototypes, inverse_temperature=2.0 / scale)
    np.testing.assert_allclose(same, z, rtol=1e-13)
    both = histogram.histogram_entropic(features * scale, prototypes / scale, inverse_temperature=2.0)
    np.testing.assert_allclose(both, z, rtol=1e-13)
    if scale > 1e200:  # inverse_temperature * nu^T x ~ 1e600
        with pytest.raises(ValueError, match=r"inverse_temperature \* nu\^T x overflows float64"):
            histogram.histogram_entropic(features * scale, prototypes * scale, inverse_temperature=2.0)
    elif scale > 1.0:  # scores ~ 1e300: the hard assignment of Claim 2.1
        hard = histogram.histogram_entropic(features * scale, prototypes * scale, inverse_temperature=2.0)
        np.testing.assert_allclose(hard, closed.z, rtol=0, atol=1e-15)
    else:  # scores ~ scale^2 underflow: the uniform histogram is the right answer
        tiny = histogram.histogram_entropic(features * scale, prototypes * scale, inverse_temperature=2.0)
        np.testing.assert_allclose(tiny, 0.25, rtol=1e-14)


# ---------------------------------------------------------------- issue 20: extreme magnitudes


def test_convex_combination_computes_where_only_partial_sums_overflow():
    # z = (2^996, -2^996) (weights that are not a histogram), nu rows 2^30 and 2^30 - 1:
    # each product is ~2^1026 (inf, once with only a RuntimeWarning) while the value is
    # 2^996 (2^996 * 2^30 - 2^996 * (2^30 - 1)); the second column 2^996 * (3 - 1).
    # Rows and columns scaled by powers of two make every step exact here.
    big = 2.0**996
    z = np.array([[big, -big], [0.25, 0.75]])
    prototypes = np.array([[2.0**30, 3.0], [2.0**30 - 1.0, 1.0]])
    y_hat, ctx = histogram.convex_combination_forward(z, prototypes)
    np.testing.assert_allclose(y_hat, [[big, 2 * big], [2.0**30 - 0.75, 1.5]], rtol=1e-15)
    # The gradient of z, d_y nu^T, the same way: 2^996 (2^30 - (2^30 - 1)) = 2^996.
    _, ctx = histogram.convex_combination_forward(np.ones((1, 1)), np.array([[2.0**30,
                                                                               2.0**30 - 1.0]]))
    grads = histogram.convex_combination_backward(ctx, np.array([[big, -big]]))
    np.testing.assert_allclose(grads.z, [[big]], rtol=1e-15)
    np.testing.assert_allclose(grads.prototypes, [[big, -big]], rtol=1e-15)


def test_convex_combination_beyond_float64_is_named():
    z, prototypes = np.array([[1e300, 1e300]]), np.array([[1e10], [1e10]])
    with pytest.raises(ValueError, match=r"^y_hat = z @ prototypes overflows float64 \(max \|z\| "
                                         r"== 1e\+300, max \|prototypes\| == 1e\+10\)"):
        histogram.convex_combination_forward(z, prototypes)
    _, ctx = histogram.convex_combination_forward(np.array([[0.5, 0.5]]), prototypes)
    with pytest.raises(ValueError, match=r"^the gradient of z, d_y @ prototypes.T, overflows "
                                         r"float64 \(max \|d_y\| == 1e\+300"):
        histogram.convex_combination_backward(ctx, np.array([[1e300]]))
    _, ctx = histogram.convex_combination_forward(np.array([[1e10, 1e10]]), 1e-10 * prototypes)
    with pytest.raises(ValueError, match=r"^the gradient of prototypes, z.T @ d_y, overflows"):
        histogram.convex_combination_backward(ctx, np.array([[1e300]]))


def _exact_product(left, right):
    """``left @ right`` and ``|left| @ |right|`` in rational arithmetic (Fractions)."""
    rows, inner, columns = left.shape[0], left.shape[1], right.shape[1]
    value = [[sum(Fraction(left[b, k]) * Fraction(right[k, c]) for k in range(inner))
              for c in range(columns)] for b in range(rows)]
    bound = [[sum(abs(Fraction(left[b, k]) * Fraction(right[k, c])) for k in range(inner))
              for c in range(columns)] for b in range(rows)]
    return value, bound


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(np.float64, (2, 3), elements=st.floats(-1.0, 1.0)),
    hnp.arrays(np.float64, (3, 2), elements=st.floats(-1.0, 1.0)),
    st.floats(-300.0, 308.0), st.floats(-300.0, 308.0),
)
def test_convex_combination_is_the_exact_product_or_named_hypothesis(z, prototypes, a, b):
    # Oracle: the product in rational arithmetic. Where every entry lies within float64
    # (below max / 2), the result is it to the rounding of a floating sum, (inner + 2) u
    # times the sum of the |terms|; where one lies beyond 2 max, a ValueError names it.
    z, prototypes = z * 10.0**a, prototypes * 10.0**b
    value, bound = _exact_product(z, prototypes)
    largest = Fraction(float(np.finfo(float).max))
    peak = max(abs(v) for row in value for v in row)
    assume(peak < largest / 2 or peak > 2 * largest)
    if peak > 2 * largest:
        with pytest.raises(ValueError, match=r"^y_hat = z @ prototypes overflows float64"):
            histogram.convex_combination_forward(z, prototypes)
        return
    y_hat, _ = histogram.convex_combination_forward(z, prototypes)
    unit = Fraction(float(np.finfo(float).eps))
    for row in range(2):
        for column in range(2):
            error = abs(Fraction(float(y_hat[row, column])) - value[row][column])
            # + 2^-1074: a value or a term that underflows carries one subnormal rounding.
            assert error <= 5 * unit * bound[row][column] + Fraction(2) ** -1070
