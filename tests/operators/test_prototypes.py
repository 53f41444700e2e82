"""Ridge fits, the RLS recursion and Eq. (2.9) of XML Sec. 2.2-2.3 (refdml.prototypes).

Oracles: ``numpy.linalg.lstsq`` on the stacked, row-weighted least-squares system
``[sqrt(w_i) Z_i; sqrt(beta) I] V = [sqrt(w_i) Y_i; 0]`` (SVD, never the normal
equations), literal matrix inverses of the printed formulas, and finite differences.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refdml import prototypes
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst


def _lstsq_ridge(blocks_Z, blocks_Y, weights, beta):
    """argmin sum_i w_i ||Z_i V - Y_i||^2 + beta ||V||^2 by SVD least squares."""
    m, d = blocks_Z[0].shape[1], blocks_Y[0].shape[1]
    rows_Z = [np.sqrt(w) * Zi for w, Zi in zip(weights, blocks_Z)]
    rows_Y = [np.sqrt(w) * Yi for w, Yi in zip(weights, blocks_Y)]
    if beta > 0:
        rows_Z.append(np.sqrt(beta) * np.eye(m))
        rows_Y.append(np.zeros((m, d)))
    return np.linalg.lstsq(np.vstack(rows_Z), np.vstack(rows_Y), rcond=None)[0]


def _batch(rng, b, m, d):
    return rng.dirichlet(np.ones(m), size=b), rng.standard_normal((b, d))


# --------------------------------------------------------------------------- ridge


@pytest.mark.parametrize("b, m", [(9, 4), (4, 9), (5, 5)])
def test_ridge_primal_equals_kernel_equals_lstsq(b, m):
    rng = np.random.default_rng(b * 10 + m)
    Z, Y = _batch(rng, b, m, 3)
    primal = prototypes.ridge_fit(Z, Y, ridge=0.05, form="primal")
    kernel = prototypes.ridge_fit(Z, Y, ridge=0.05, form="kernel")
    np.testing.assert_allclose(primal, kernel, rtol=0, atol=1e-10 * np.abs(primal).max())
    np.testing.assert_allclose(primal, _lstsq_ridge([Z], [Y], [1.0], 0.05), rtol=1e-10, atol=1e-12)
    # First-order optimality of the ridge objective.
    np.testing.assert_allclose(Z.T @ (Z @ primal - Y) + 0.05 * primal, 0.0, atol=1e-12)


@given(
    st.integers(1, 8), st.integers(1, 8),
    st.floats(1e-3, 10.0), st.data(),
)
def test_ridge_forms_agree_hypothesis(b, m, eps, data):
    Z = data.draw(rst.simplex_vectors(m, batch=b))
    Y = data.draw(rst.points_in_unit_ball(b, 2))
    primal = prototypes.ridge_fit(Z, Y, ridge=eps, form="primal")
    kernel = prototypes.ridge_fit(Z, Y, ridge=eps, form="kernel")
    np.testing.assert_allclose(primal, kernel, rtol=0, atol=1e-10 * max(1.0, np.abs(primal).max()))


def test_ridge_auto_solves_the_smaller_system():
    rng = np.random.default_rng(0)
    Z, Y = _batch(rng, 3, 8, 2)
    assert prototypes.ridge_fit_forward(Z, Y, ridge=0.1)[1].form == "kernel"
    assert prototypes.ridge_fit_forward(Z.T @ Z, Z.T @ Y, ridge=0.1)[1].form == "primal"


@pytest.mark.parametrize("form", ["primal", "kernel"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ridge_gradients_fixed_seeds(form, seed):
    rng = np.random.default_rng(seed)
    Z, Y = _batch(rng, 6 if form == "primal" else 3, 4, 3)

    def forward(Z, Y):
        return prototypes.ridge_fit_forward(Z, Y, ridge=0.2, form=form)

    result = check_gradients(forward, prototypes.ridge_fit_backward, {"Z": Z, "Y": Y}, rng=seed)
    assert_gradients(result, rtol=1e-6)


@given(st.integers(1, 6), st.integers(1, 6), st.floats(0.05, 2.0), st.data())
def test_ridge_gradients_hypothesis(b, m, eps, data):
    Z = data.draw(rst.simplex_vectors(m, batch=b))
    Y = data.draw(rst.points_in_unit_ball(b, 2))
    for form in ("primal", "kernel"):
        def forward(Z, Y):
            return prototypes.ridge_fit_forward(Z, Y, ridge=eps, form=form)

        result = check_gradients(forward, prototypes.ridge_fit_backward, {"Z": Z, "Y": Y}, rng=0)
        assert_gradients(result, rtol=1e-6)


def test_ridge_backward_matches_the_closed_form_of_the_brief():
    # S = M^{-1} G: dY = Z S, dZ = (Y - Z V) S^T - Z S V^T, evaluated with a dense solve.
    rng = np.random.default_rng(5)
    Z, Y = _batch(rng, 3, 6, 2)
    G = rng.standard_normal((6, 2))
    V, ctx = prototypes.ridge_fit_forward(Z, Y, ridge=0.3, form="kernel")
    S = np.linalg.solve(Z.T @ Z + 0.3 * np.eye(6), G)
    grads = prototypes.ridge_fit_backward(ctx, G)
    np.testing.assert_allclose(grads.Y, Z @ S, rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(grads.Z, (Y - Z @ V) @ S.T - Z @ S @ V.T, rtol=1e-10, atol=1e-13)


# --------------------------------------------------------------------------- RLS


def _check_against_batch(alpha, beta, batches, m, d, rtol):
    estimator = prototypes.RecursivePrototypes(m, d, alpha=alpha, ridge=beta)
    seen_Z, seen_Y = [], []
    for Z, Y in batches:
        estimator.update(Z, Y)
        seen_Z.append(Z)
        seen_Y.append(Y)
        K = len(seen_Z)
        weights = alpha ** (K - 1 - np.arange(K, dtype=float))
        expected = _lstsq_ridge(seen_Z, seen_Y, weights, beta)
        got = estimator.prototypes
        np.testing.assert_allclose(got, expected, rtol=0, atol=rtol * max(1.0, np.abs(expected).max()))
        info = sum(w * Zi.T @ Zi for w, Zi in zip(weights, seen_Z)) + beta * np.eye(m)
        np.testing.assert_allclose(estimator.information, info, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("beta", [0.3, 2.0])
def test_rls_equals_batch_solution_after_every_update(alpha, beta):
    rng = np.random.default_rng(int(alpha * 10 + beta * 100))
    batches = [_batch(rng, int(rng.integers(1, 6)), 5, 3) for _ in range(25)]
    _check_against_batch(alpha, beta, batches, 5, 3, 1e-10)


@pytest.mark.parametrize("alpha", [1.0, 0.8])
def test_rls_with_beta_zero_starts_once_r_k_is_invertible(alpha):
    rng = np.random.default_rng(4)
    estimator = prototypes.RecursivePrototypes(4, 2, alpha=alpha, ridge=0.0)
    with pytest.raises(ValueError, match="R_K is singular after 0 updates"):
        estimator.prototypes
    estimator.update(*_batch(rng, 3, 4, 2))  # 3 rows cannot span 4 prototypes
    with pytest.raises(ValueError, match="no unique solution"):
        estimator.prototypes
    seen = [_batch(rng, 3, 4, 2)]
    seen_Z, seen_Y = [seen[0][0]], [seen[0][1]]
    estimator = prototypes.RecursivePrototypes(4, 2, alpha=alpha, ridge=0.0).update(*seen[0])
    for _ in range(12):
        Z, Y = _batch(rng, 3, 4, 2)
        estimator.update(Z, Y)
        seen_Z.append(Z)
        seen_Y.append(Y)
        K = len(seen_Z)
        expected = _lstsq_ridge(seen_Z, seen_Y, alpha ** (K - 1 - np.arange(K, dtype=float)), 0.0)
        np.testing.assert_allclose(estimator.prototypes, expected, rtol=0, atol=1e-9 * np.abs(expected).max())


@st.composite
def _batch_sequences(draw):
    m = draw(st.integers(1, 5))
    d = draw(st.integers(1, 3))
    n_batches = draw(st.integers(1, 8))
    batches = []
    for _ in range(n_batches):
        b = draw(st.integers(1, 5))
        Z = draw(rst.simplex_vectors(m, batch=b))
        Y = draw(rst.points_in_unit_ball(b, d, min_radius=0.0))
        batches.append((Z, Y))
    return m, d, batches


@given(
    st.one_of(st.just(1.0), st.floats(0.3, 0.99)),
    st.floats(0.05, 3.0),
    _batch_sequences(),
)
def test_rls_equals_batch_solution_hypothesis(alpha, beta, sequence):
    m, d, batches = sequence
    _check_against_batch(alpha, beta, batches, m, d, 1e-9)


@pytest.mark.parametrize("alpha, beta", [(1.0, 0.5), (0.95, 0.5), (0.95, 0.0)])
def test_rls_drift_after_thousands_of_updates(alpha, beta):
    # (1, 0.5) and (0.95, 0) take the Woodbury branch, (0.95, 0.5) the Cholesky one.
    rng = np.random.default_rng(11)
    m, d, n_updates = 6, 4, 2000
    estimator = prototypes.RecursivePrototypes(m, d, alpha=alpha, ridge=beta)
    seen_Z, seen_Y = [], []
    for _ in range(n_updates):
        Z, Y = _batch(rng, 4, m, d)
        estimator.update(Z, Y)
        seen_Z.append(Z)
        seen_Y.append(Y)
    weights = alpha ** (n_updates - 1 - np.arange(n_updates, dtype=float))
    expected = _lstsq_ridge(seen_Z, seen_Y, weights, beta)
    drift = np.abs(estimator.prototypes - expected).max() / np.abs(expected).max()
    print(f"RLS drift after {n_updates} updates (alpha={alpha}, beta={beta}): {drift:.2e}")
    assert drift < 1e-11


def _literal_printed_weights(R_K, R, alpha):
    inv = np.linalg.inv
    return inv(R) @ inv(inv(R_K) + alpha * inv(R))


@pytest.mark.parametrize("alpha", [1.0, 0.7])
def test_recursion_weights_against_literal_formulas(alpha):
    rng = np.random.default_rng(2)
    m, beta = 4, 0.4
    estimator = prototypes.RecursivePrototypes(m, 2, alpha=alpha, ridge=beta)
    for _ in range(5):
        estimator.update(*_batch(rng, 3, m, 2))
    R_K = estimator.information
    Z, _ = _batch(rng, 6, m, 2)
    R = Z.T @ Z + (1 - alpha) * beta * np.eye(m)
    derived = prototypes.recursion_weights(R_K, Z, alpha=alpha, ridge=beta)
    printed = prototypes.recursion_weights(R_K, Z, alpha=alpha, ridge=beta, printed=True)
    inv = np.linalg.inv
    np.testing.assert_allclose(derived, alpha * inv(R) @ inv(inv(R_K) + alpha * inv(R)), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(printed, _literal_printed_weights(R_K, R, alpha), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("alpha", [1.0, 0.7])
def test_printed_recursion_reproduces_v_next_only_for_alpha_one(alpha):
    """Finding, not a bug: the printed W_K of Eq. (2.7) lacks a factor alpha."""
    rng = np.random.default_rng(8)
    m, d, beta = 4, 3, 0.4
    estimator = prototypes.RecursivePrototypes(m, d, alpha=alpha, ridge=beta)
    for _ in range(6):
        estimator.update(*_batch(rng, 3, m, d))
    V_K, R_K = estimator.prototypes, estimator.information
    Z, Y = _batch(rng, 6, m, d)  # b >= m, so R = Z^T Z + (1-alpha) beta I is invertible
    V_batch = _lstsq_ridge([Z], [Y], [1.0], (1 - alpha) * beta)
    V_next = estimator.update(Z, Y).prototypes

    def step(W):
        return W @ V_K + (np.eye(m) - W) @ V_batch

    derived = prototypes.recursion_weights(R_K, Z, alpha=alpha, ridge=beta)
    printed = prototypes.recursion_weights(R_K, Z, alpha=alpha, ridge=beta, printed=True)
    np.testing.assert_allclose(step(derived), V_next, rtol=0, atol=1e-10)
    printed_error = np.abs(step(printed) - V_next).max() / np.abs(V_next).max()
    if alpha == 1.0:
        np.testing.assert_allclose(printed, derived, rtol=0, atol=1e-14)
        assert printed_error < 1e-10
    else:
        np.testing.assert_allclose(printed, derived / alpha, rtol=1e-12, atol=1e-14)
        assert printed_error > 1e-2, printed_error


# --------------------------------------------------------------------------- Eq. (2.9)


@pytest.mark.parametrize("b1, b2, m", [(3, 4, 5), (6, 7, 3)])
def test_two_batch_decomposition_recovers_the_whole_batch_fit(b1, b2, m):
    rng = np.random.default_rng(b1 + b2 + m)
    Z1, Y1 = _batch(rng, b1, m, 2)
    Z2, Y2 = _batch(rng, b2, m, 2)
    eps = 0.1
    result = prototypes.two_batch_decomposition(Z1, Y1, Z2, Y2, ridge=eps)
    whole = _lstsq_ridge([np.vstack([Z1, Z2])], [np.vstack([Y1, Y2])], [1.0], eps)
    np.testing.assert_allclose(result.V, whole, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(result.V1, _lstsq_ridge([Z1], [Y1], [1.0], eps / 2), rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(result.V2, _lstsq_ridge([Z2], [Y2], [1.0], eps / 2), rtol=1e-9, atol=1e-11)
    R1 = Z1.T @ Z1 + eps / 2 * np.eye(m)
    R2 = Z2.T @ Z2 + eps / 2 * np.eye(m)
    inv = np.linalg.inv
    np.testing.assert_allclose(result.W, inv(R2) @ inv(inv(R1) + inv(R2)), rtol=1e-9, atol=1e-12)


def test_printed_two_batch_weight_is_the_literal_formula_and_is_wrong():
    rng = np.random.default_rng(3)
    m, eps = 4, 0.1
    Z1, Y1 = _batch(rng, 5, m, 2)
    Z2, Y2 = _batch(rng, 5, m, 2)
    printed = prototypes.two_batch_decomposition(Z1, Y1, Z2, Y2, ridge=eps, printed=True)
    R1 = Z1.T @ Z1 + eps / 2 * np.eye(m)
    R2 = Z2.T @ Z2 + eps / 2 * np.eye(m)
    inv = np.linalg.inv
    literal = inv(R2) @ inv(inv(R1) + inv(R1) @ inv(R1))
    np.testing.assert_allclose(printed.W, literal, rtol=1e-8, atol=1e-12)
    whole = _lstsq_ridge([np.vstack([Z1, Z2])], [np.vstack([Y1, Y2])], [1.0], eps)
    assert np.abs(printed.V - whole).max() > 1e-2 * np.abs(whole).max()


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_rejected_naming_the_parameter():
    Z, Y = _batch(np.random.default_rng(0), 3, 4, 2)
    with pytest.raises(ValueError, match=r"ridge == 0.0, must be in \(0, inf\)"):
        prototypes.ridge_fit(Z, Y, ridge=0.0)
    with pytest.raises(ValueError, match="ridge == -1.0"):
        prototypes.two_batch_decomposition(Z, Y, Z, Y, ridge=-1.0)
    with pytest.raises(ValueError, match="Z has 3 rows but Y has 2"):
        prototypes.ridge_fit(Z, Y[:2], ridge=0.1)
    with pytest.raises(ValueError, match="form == 'dual'"):
        prototypes.ridge_fit(Z, Y, ridge=0.1, form="dual")
    bad = Z.copy()
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match="Z must be finite"):
        prototypes.ridge_fit(bad, Y, ridge=0.1)
    with pytest.raises(ValueError, match=r"alpha == 0.0, must be in \(0, 1\]"):
        prototypes.RecursivePrototypes(4, 2, alpha=0.0, ridge=1.0)
    with pytest.raises(ValueError, match="alpha == 1.5"):
        prototypes.RecursivePrototypes(4, 2, alpha=1.5, ridge=1.0)
    with pytest.raises(ValueError, match="ridge == -0.1"):
        prototypes.RecursivePrototypes(4, 2, alpha=0.5, ridge=-0.1)
    with pytest.raises(ValueError, match="alpha == 2.0"):
        prototypes.recursion_weights(np.eye(4), Z, alpha=2.0, ridge=1.0)
    with pytest.raises(ValueError, match="R_K has shape"):
        prototypes.recursion_weights(np.eye(3), Z, alpha=1.0, ridge=1.0)
    estimator = prototypes.RecursivePrototypes(4, 2, alpha=0.5, ridge=1.0)
    with pytest.raises(ValueError, match="expected n_prototypes=4"):
        estimator.update(Z[:, :3], Y)
    with pytest.raises(ValueError, match="expected dim=2"):
        estimator.update(Z, np.hstack([Y, Y]))
    with pytest.raises(ValueError, match="Y must be finite"):
        estimator.update(Z, Y * np.inf)
    with pytest.raises(TypeError, match="n_prototypes must be an integer"):
        prototypes.RecursivePrototypes(4.5, 2, alpha=0.5, ridge=1.0)
    with pytest.raises(ValueError, match="the halves must have the same columns"):
        prototypes.two_batch_decomposition(Z, Y, Z[:, :3], Y, ridge=0.1)


# --------------------------------------------------------------------------- extreme input

SCALES = [1e-300, 1e-150, 1e150, 1e300]


def _pow2(x):
    """The power of two nearest to x (rescaling by it is exact)."""
    return float(np.ldexp(1.0, int(np.round(np.log2(x)))))


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("form", ["primal", "kernel"])
def test_ridge_fit_at_extreme_scales_of_Z_and_Y(scale, form):
    # ridge fixed; V(tZ, Y; r) = W(Z, Y; r / t^2) / t, with the oracle on the rescaled data
    # (lstsq of the augmented system; r / t^2 -> 0 gives the minimum-norm lstsq solution,
    # r / t^2 -> inf gives Z^T Y / (r / t^2)).
    rng = np.random.default_rng(7)
    b, m = (9, 4) if form == "primal" else (4, 9)
    Z, Y = _batch(rng, b, m, 3)
    t, ridge = _pow2(scale), 0.05
    V = prototypes.ridge_fit(t * Z, Y, ridge=ridge, form=form)
    with np.errstate(over="ignore", under="ignore", divide="ignore"):
        reduced = np.float64(ridge) / np.float64(t) ** 2
    if reduced < 1e-20:  # the ridge is negligible: minimum-norm least squares
        oracle = np.linalg.lstsq(Z, Y, rcond=None)[0] / t
    elif reduced > 1.0:  # (G + r' I)^{-1} = (G / r' + I)^{-1} / r', and 1 / (r' t) = t / ridge
        oracle = np.linalg.solve(Z.T @ Z / reduced + np.eye(m), Z.T @ Y) * (t / ridge)
    else:
        oracle = np.linalg.solve(Z.T @ Z + reduced * np.eye(m), Z.T @ Y) / t
    np.testing.assert_allclose(V, oracle, rtol=1e-9, atol=0)
    # Y is linear: V(Z, sY) = s V(Z, Y).
    s = _pow2(scale)
    np.testing.assert_allclose(prototypes.ridge_fit(Z, s * Y, ridge=ridge, form=form),
                               s * _lstsq_ridge([Z], [Y], [1.0], ridge), rtol=1e-10, atol=0)
    # The backward works on the same rescaled system: gradients stay finite.
    _, ctx = prototypes.ridge_fit_forward(t * Z, Y, ridge=ridge, form=form)
    grads = prototypes.ridge_fit_backward(ctx, np.ones((m, 3)))
    assert np.all(np.isfinite(grads.Z)) and np.all(np.isfinite(grads.Y))


def test_ridge_fit_overflow_and_singular_systems_are_named():
    rng = np.random.default_rng(0)
    Z, Y = _batch(rng, 9, 4, 3)
    with pytest.raises(ValueError, match="V overflows float64"):
        prototypes.ridge_fit(Z * 1e-10, Y * 1e300, ridge=1e-30)
    # b > m in the kernel form: Z Z^T (9 x 9, rank 4) with the ridge rounded away.
    with pytest.raises(ValueError, match=r"Z Z\^T \+ ridge I \(kernel form\) is numerically singular"):
        prototypes.ridge_fit(Z * 1e300, Y, ridge=1.0, form="kernel")


@pytest.mark.parametrize("ridge", [1e-300, 1e-200, 1e-30])
def test_two_batch_decomposition_with_tiny_ridge_is_a_named_error_or_right(ridge):
    rng = np.random.default_rng(1)
    Z1, Y1 = _batch(rng, 2, 5, 2)
    Z2, Y2 = _batch(rng, 2, 5, 2)  # 4 rows cannot span 5 prototypes
    with pytest.raises(ValueError, match=r"R_1 \+ R_2 .* is numerically singular.*ridge =="):
        prototypes.two_batch_decomposition(Z1, Y1, Z2, Y2, ridge=ridge)
    with pytest.raises(ValueError, match=r"R_2 = Z2\^T Z2"):
        prototypes.two_batch_decomposition(Z1, Y1, Z2, Y2, ridge=ridge, printed=True)
    # Enough rows: R_1 + R_2 is definite and the decomposition is the whole-batch fit.
    Z1, Y1 = _batch(rng, 6, 3, 2)
    Z2, Y2 = _batch(rng, 6, 3, 2)
    result = prototypes.two_batch_decomposition(Z1, Y1, Z2, Y2, ridge=ridge)
    whole = _lstsq_ridge([np.vstack([Z1, Z2])], [np.vstack([Y1, Y2])], [1.0], ridge)
    np.testing.assert_allclose(result.V, whole, rtol=1e-8, atol=0)


@pytest.mark.parametrize("scale", SCALES)
def test_two_batch_decomposition_at_extreme_scales(scale):
    rng = np.random.default_rng(2)
    Z1, Y1 = _batch(rng, 6, 3, 2)
    Z2, Y2 = _batch(rng, 6, 3, 2)
    t = _pow2(scale)
    ridge = 0.1 * t * t if 1e-150 <= scale <= 1e150 else 0.1
    result = prototypes.two_batch_decomposition(t * Z1, Y1, t * Z2, Y2, ridge=ridge)
    np.testing.assert_allclose(
        result.V, prototypes.ridge_fit(t * np.vstack([Z1, Z2]), np.vstack([Y1, Y2]), ridge=ridge),
        rtol=1e-8, atol=0)


def _assert_updates_give_the_batch_solution(estimator, rng, n_updates, b, alpha,
                                            seen_Z=(), seen_Y=()):
    """``n_updates`` batches of ``b`` rows; after each, the prototypes must be the weighted
    least-squares solution of every batch so far (a negligible ridge), to 1e-9 of their size."""
    seen_Z, seen_Y = list(seen_Z), list(seen_Y)
    m, c = estimator.n_prototypes, estimator.dim
    for _ in range(n_updates):
        Z, Y = _batch(rng, b, m, c)
        estimator.update(Z, Y)
        seen_Z.append(Z)
        seen_Y.append(Y)
        K = len(seen_Z)
        expected = _lstsq_ridge(seen_Z, seen_Y, alpha ** (K - 1 - np.arange(K, dtype=float)), 0.0)
        np.testing.assert_allclose(estimator.prototypes, expected, rtol=0,
                                   atol=1e-9 * np.abs(expected).max())


@pytest.mark.parametrize("alpha", [1.0, 0.9])
def test_rls_with_tiny_ridge_waits_for_a_definite_r_k_then_is_right(alpha):
    rng = np.random.default_rng(5)
    ridge = 1e-300
    estimator = prototypes.RecursivePrototypes(4, 2, alpha=alpha, ridge=ridge)
    np.testing.assert_array_equal(estimator.prototypes, 0.0)  # V_0 = 0 exactly
    Z, Y = _batch(rng, 3, 4, 2)
    estimator.update(Z, Y)  # 3 rows cannot span 4 prototypes: R_1 numerically singular
    with pytest.raises(ValueError, match="ridge == 1e-300.*no unique solution"):
        estimator.prototypes
    _assert_updates_give_the_batch_solution(estimator, rng, 6, 3, alpha, [Z], [Y])


def test_rls_overflowing_batch_is_named_and_leaves_the_state():
    estimator = prototypes.RecursivePrototypes(3, 2, alpha=0.9, ridge=0.5)
    Z, Y = _batch(np.random.default_rng(0), 4, 3, 2)
    estimator.update(Z, Y)
    before = estimator.prototypes
    with pytest.raises(ValueError, match=r"Z\^T Z overflows float64"):
        estimator.update(Z * 1e200, Y)
    np.testing.assert_array_equal(estimator.prototypes, before)
    assert estimator.n_updates == 1


def test_two_batch_messages_name_the_parameter_passed():
    Z, Y = _batch(np.random.default_rng(0), 3, 4, 2)
    with pytest.raises(ValueError, match="Z1 has 3 rows but Y1 has 2"):
        prototypes.two_batch_decomposition(Z, Y[:2], Z, Y, ridge=0.1)
    with pytest.raises(ValueError, match="Z2 must be finite"):
        prototypes.two_batch_decomposition(Z, Y, Z * np.nan, Y, ridge=0.1)


def test_ridge_backward_rejects_foreign_context_and_bad_upstream():
    Z, Y = _batch(np.random.default_rng(0), 5, 3, 2)
    _, ctx = prototypes.ridge_fit_forward(Z, Y, ridge=0.1)
    with pytest.raises(TypeError, match="ctx must be the RidgeContext"):
        prototypes.ridge_fit_backward(object(), np.ones((3, 2)))
    with pytest.raises(ValueError, match=r"d_V has shape \(2, 3\)"):
        prototypes.ridge_fit_backward(ctx, np.ones((2, 3)))
    with pytest.raises(ValueError, match="d_V must be finite"):
        prototypes.ridge_fit_backward(ctx, np.full((3, 2), np.nan))


# ----------------------------------------------------- issue 20: the RLS at extreme input


@pytest.mark.parametrize("alpha", [1.0, 0.9])
@pytest.mark.parametrize("b", [3, 5, 8])
def test_rls_with_a_tiny_ridge_and_b_at_least_m_rows_is_right(alpha, b):
    # P_0 = I / 1e-300: the Woodbury matrix I_b + Z P_0 Z^T (b >= m = 3) loses its I_b to
    # rounding and is not definite in float64; the update refactors R_{K+1} instead of
    # raising SciPy's LinAlgError, and stays the batch solution (ridge negligible).
    rng = np.random.default_rng(30)
    estimator = prototypes.RecursivePrototypes(3, 2, alpha=alpha, ridge=1e-300)
    _assert_updates_give_the_batch_solution(estimator, rng, 4, b, alpha)


def _exact_ridge(blocks_Z, blocks_Y, weights, beta):
    """``R^{-1} Q`` in exact rational arithmetic (``fractions``), rounded once to float64.

    ``R = sum_i w_i Z_i^T Z_i + beta I``, ``Q = sum_i w_i Z_i^T Y_i``. SVD least squares is
    no oracle at mixed scales: where the fit is tiny next to the residual (a ridge far
    above ``||Z||^2``) its backward error, relative to ``||Y||``, is 1e-7 of the answer.
    """
    from fractions import Fraction

    m, d = blocks_Z[0].shape[1], blocks_Y[0].shape[1]
    R = [[Fraction(beta) if i == j else Fraction(0) for j in range(m)] for i in range(m)]
    Q = [[Fraction(0)] * d for _ in range(m)]
    for w, Zi, Yi in zip(weights, blocks_Z, blocks_Y):
        w = Fraction(w)
        for i in range(m):
            for j in range(m):
                R[i][j] += w * sum(Fraction(a) * Fraction(b) for a, b in zip(Zi[:, i], Zi[:, j]))
            for j in range(d):
                Q[i][j] += w * sum(Fraction(a) * Fraction(b) for a, b in zip(Zi[:, i], Yi[:, j]))
    rows = [R[i] + Q[i] for i in range(m)]                  # Gauss-Jordan, exact
    for col in range(m):
        pivot = next(r for r in range(col, m) if rows[r][col] != 0)
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(m):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return np.array([[float(rows[i][m + j] / rows[i][i]) for j in range(d)] for i in range(m)])


def _check_mixed_scales(alpha, ridge, scales, seed, rtol):
    rng = np.random.default_rng(seed)
    m, d = 3, 2
    estimator = prototypes.RecursivePrototypes(m, d, alpha=alpha, ridge=ridge)
    seen_Z, seen_Y = [], []
    for scale in scales:
        Z, Y = _batch(rng, m + 1, m, d)      # full column rank: R_K is definite at once
        estimator.update(scale * Z, Y)
        seen_Z.append(scale * Z)
        seen_Y.append(Y)
        K = len(seen_Z)
        weights = [alpha ** (K - 1 - i) for i in range(K)]
        expected = _exact_ridge(seen_Z, seen_Y, weights, ridge)
        np.testing.assert_allclose(estimator.prototypes, expected, rtol=0,
                                   atol=rtol * np.abs(expected).max())


@pytest.mark.parametrize("alpha", [1.0, 0.9, 0.5])
@pytest.mark.parametrize("scales", [[1e-100, 1.0], [1.0, 1e100], [1e-150, 1e-50, 1e50, 1.0]])
def test_rls_with_batches_of_very_different_scales_is_the_batch_solution(alpha, scales):
    # A batch far larger than those before shrinks V by orders of magnitude in one step:
    # the innovation form would lose those digits (V 1e84 times off before the fix); the
    # update solves R_{K+1} V = alpha R_K V_K + Z^T Y there instead.
    _check_mixed_scales(alpha, 1e-300, scales, seed=31, rtol=1e-10)


@given(
    st.sampled_from([1.0, 0.9]),
    st.sampled_from([0.0, 1e-300, 1e-6]),
    st.lists(st.integers(-150, 150), min_size=1, max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_rls_at_mixed_scales_hypothesis(alpha, ridge, exponents, seed):
    _check_mixed_scales(alpha, ridge, [float(np.ldexp(1.0, e)) for e in exponents], seed,
                        rtol=1e-10)


@pytest.mark.parametrize("seed", [200123, 39])
def test_rls_first_woodbury_step_from_a_small_ridge_is_the_batch_solution(seed):
    # Found by the hypothesis test above: P_0 = 1e6 I, and one batch of full column rank
    # gives P_1 = R_1^{-1} with ||R_1|| ~ 2: the Woodbury subtraction cancels ~6 digits in
    # the direction where P_1 is smallest, though P's largest entry shrinks only 5e3-fold
    # (below the old 1e4 guard), so V_1 was 2.5e-10 off (seed 39: 1.1e-10). The guard now
    # measures the largest eigenvalue of I_b + Z P_0 Z^T (2.3e6) and refactors R_1.
    _check_mixed_scales(1.0, 1e-6, [1.0], seed, rtol=1e-12)


@pytest.mark.parametrize("alpha, ridge, exponents, seed, rtol", [
    (0.9, 0.0, [97, 110], 284199005, 1e-12),            # cond(R_K) <= 155
    (1.0, 0.0, [131, -68, 82, 134], 1579000847, 1e-12),  # cond(R_K) <= 463
    (1.0, 1e-300, [-106, -96, -82], 4254561195, 1e-10),  # cond(R_2) = 2.1e5
])
def test_rls_batch_that_outweighs_the_past_is_the_batch_solution(alpha, ridge, exponents, seed,
                                                                 rtol):
    # A batch 2^7 .. 2^13 times the scale of the last: the innovation form's error is that
    # of (Z^T Z) V_K times R_{K+1}^{-1}, 2e-11 .. 4e-11 here (4e-8 for the third before the
    # Woodbury guard measured the right direction); the batch form's is that of
    # alpha R_K V_K, far lighter (now 1e-15 .. 2e-13). Each rtol is above eps cond(R_K),
    # what a direct solve may lose. Powers of two: the scaled batches are exact.
    _check_mixed_scales(alpha, ridge, [float(np.ldexp(1.0, e)) for e in exponents], seed, rtol)


def test_rls_below_the_normal_range_is_named_and_leaves_the_state():
    estimator = prototypes.RecursivePrototypes(3, 2, alpha=0.9, ridge=1e-310)
    np.testing.assert_array_equal(estimator.prototypes, 0.0)       # V_0 = 0 exactly
    Z, Y = _batch(np.random.default_rng(32), 4, 3, 2)
    with pytest.raises(ValueError, match=r"R_K = .* would lie below float64's normal range"):
        estimator.update(1e-160 * Z, Y)                             # Z^T Z ~ 1e-320
    assert estimator.n_updates == 0
    np.testing.assert_array_equal(estimator.prototypes, 0.0)
    estimator.update(Z, Y)                                           # normal data: fine
    np.testing.assert_allclose(estimator.prototypes, _lstsq_ridge([Z], [Y], [1.0], 0.0),
                               rtol=0, atol=1e-9)


def test_rls_never_raises_a_raw_error_at_extreme_input():
    # Ridges down to the smallest subnormal, batches of 1e-160 .. 1e150, rank-deficient and
    # zero batches: every outcome is a finite V, or a ValueError of the estimator's own.
    own = ("R_K is singular", "overflows float64", "below float64's normal range")
    rng = np.random.default_rng(33)
    for trial in range(150):
        m, d = int(rng.integers(1, 5)), int(rng.integers(1, 3))
        ridge = float(rng.choice([0.0, 5e-324, 1e-310, 1e-300, 1e-200, 1e-16, 1.0]))
        alpha = float(rng.choice([1.0, 0.999999, 0.5]))
        estimator = prototypes.RecursivePrototypes(m, d, alpha=alpha, ridge=ridge)
        for _ in range(int(rng.integers(1, 6))):
            Z = float(rng.choice([1.0, 1e-160, 1e-100, 1e100, 1e150])) * rng.random(
                (int(rng.integers(1, 6)), m))
            kind = int(rng.integers(0, 4))
            if kind == 1:
                Z[:] = Z[0]
            elif kind == 2:
                Z[:, 0] = 0.0
            elif kind == 3:
                Z[:] = 0.0
            try:
                estimator.update(Z, rng.random((Z.shape[0], d)))
                V = estimator.prototypes
            except ValueError as error:
                assert any(text in str(error) for text in own), str(error)
                continue
            assert np.all(np.isfinite(V))


def test_recursion_weights_refuses_a_non_symmetric_r_k():
    Z, _ = _batch(np.random.default_rng(34), 3, 4, 2)
    R_K = np.eye(4)
    R_K[0, 1] = 0.5
    with pytest.raises(ValueError, match=r"R_K must be symmetric .* up to 0.5"):
        prototypes.recursion_weights(R_K, Z, alpha=0.9, ridge=0.1)
