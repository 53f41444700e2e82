"""W_1, Kantorovich-Rubinstein gaps and (lazy) greedy facility location."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linprog
from scipy.stats import wasserstein_distance

from refdml import ot as rot
from refdml.coresets import (
    facility_location_greedy,
    kantorovich_rubinstein_gaps,
    wasserstein1,
    wcraig,
)


def _lp_w1(x, y, a, b):
    """W_1 as a linear program solved by HiGHS (independent of POT's network simplex)."""
    cost = np.linalg.norm(x[:, None] - y[None], axis=-1)
    n, m = cost.shape
    rows = np.kron(np.eye(n), np.ones(m))
    cols = np.kron(np.ones(n), np.eye(m))
    res = linprog(cost.ravel(), A_eq=np.vstack([rows, cols]), b_eq=np.r_[a, b], bounds=(0, None),
                  method="highs")
    assert res.status == 0
    return res.fun


def test_w1_matches_a_linear_program_and_the_1d_formula():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((7, 3)), rng.standard_normal((5, 3))
    a, b = rng.uniform(0.1, 1, 7), rng.uniform(0.1, 1, 5)
    np.testing.assert_allclose(wasserstein1(x, y, a, b), _lp_w1(x, y, a / a.sum(), b / b.sum()),
                               rtol=1e-9)
    u, v = rng.standard_normal(9), rng.standard_normal(4)
    np.testing.assert_allclose(wasserstein1(u, v), wasserstein_distance(u, v), rtol=1e-12)


@settings(max_examples=10)
@given(st.integers(0, 10_000), st.integers(1, 6))
def test_every_lipschitz_gap_is_below_w1(seed, k):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((12, 2))
    coreset = x[rng.choice(12, size=k, replace=False)]
    w1 = wasserstein1(x, coreset)
    gaps = kantorovich_rubinstein_gaps(x, coreset, n_functions=32, rng=seed)
    assert gaps.shape == (32,) and np.all(gaps <= w1 + 1e-12)


def test_the_optimal_kantorovich_potential_attains_w1():
    # LP duals (u, v) with u_i + v_j <= |x_i - y_j| give phi(z) = min_j (|z - y_j| - v_j),
    # 1-Lipschitz with E_mu phi - E_nu phi = W_1 (Kantorovich-Rubinstein).
    import ot as pot

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((8, 2)), rng.standard_normal((5, 2))
    a, b = np.full(8, 1 / 8), np.full(5, 1 / 5)
    _, log = pot.emd(a, b, np.linalg.norm(x[:, None] - y[None], axis=-1), log=True)
    v = log["v"]

    def phi(z):
        return np.min(np.linalg.norm(z[:, None] - y[None], axis=-1) - v[None], axis=1)

    gap = kantorovich_rubinstein_gaps(x, y, functions=[phi])[0]
    np.testing.assert_allclose(gap, wasserstein1(x, y), rtol=1e-9)


def _objective(sim, subset):
    return sim[:, list(subset)].max(axis=1).sum()


@settings(max_examples=15)
@given(st.integers(0, 10_000), st.integers(1, 4))
def test_greedy_is_within_1_minus_1_over_e_of_brute_force(seed, k):
    rng = np.random.default_rng(seed)
    sim = rng.uniform(0, 1, (9, 9))
    result = facility_location_greedy(sim, k)
    best = max(_objective(sim, s) for s in itertools.combinations(range(9), k))
    np.testing.assert_allclose(result.objective[-1], _objective(sim, result.indices), rtol=1e-12)
    assert result.objective[-1] >= (1 - 1 / np.e) * best - 1e-12
    plain = facility_location_greedy(sim, k, lazy=False)
    np.testing.assert_array_equal(result.indices, plain.indices)
    np.testing.assert_array_equal(result.objective, plain.objective)


def test_lazy_greedy_saves_evaluations_and_weights_count_the_served():
    rng = np.random.default_rng(2)
    points = rng.standard_normal((200, 2))
    sim = 10.0 - np.linalg.norm(points[:, None] - points[None], axis=-1)
    lazy = facility_location_greedy(np.maximum(sim, 0.0), 10)
    plain = facility_location_greedy(np.maximum(sim, 0.0), 10, lazy=False)
    np.testing.assert_array_equal(lazy.indices, plain.indices)
    assert lazy.n_evaluations < plain.n_evaluations / 2
    assert lazy.weights.sum() == 200
    served = np.argmax(np.maximum(sim, 0.0)[:, lazy.indices], axis=1)
    np.testing.assert_array_equal(lazy.weights, np.bincount(served, minlength=10))


def test_wcraig_on_sinkhorn_divergences():
    rng = np.random.default_rng(3)
    centres = np.array([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]])
    clouds = centres[np.repeat(np.arange(3), 4)][:, None, :] + 0.3 * rng.standard_normal((12, 5, 2))
    divergence = rot.pairwise_sinkhorn_divergence(clouds, eps=0.5, p=2, tol=1e-9)
    result = wcraig(divergence, 3)
    # One image per well-separated group, each serving its own group.
    assert sorted(result.indices // 4) == [0, 1, 2]
    np.testing.assert_array_equal(result.weights, [4, 4, 4])
    delta = 1e-2 * divergence[~np.eye(12, dtype=bool)].mean()
    np.testing.assert_allclose(result.objective[-1],
                               _objective(1.0 / (np.maximum(divergence, 0) + delta), result.indices),
                               rtol=1e-12)
    crai = wcraig(divergence, 3, similarity="max_minus")
    assert sorted(crai.indices // 4) == [0, 1, 2]


def test_inputs_are_validated():
    with pytest.raises(ValueError, match="similarity must be non-negative"):
        facility_location_greedy(-np.ones((3, 3)), 1)
    with pytest.raises(ValueError, match="k == 4"):
        facility_location_greedy(np.ones((3, 3)), 4)
    with pytest.raises(ValueError, match="delta == 0.0"):
        wcraig(np.ones((3, 3)), 1, delta=0.0)
    with pytest.raises(ValueError, match="delta is only used"):
        wcraig(np.ones((3, 3)), 1, delta=1.0, similarity="max_minus")
    with pytest.raises(ValueError, match="x and y must have the same dimension"):
        wasserstein1(np.zeros((2, 2)), np.zeros((2, 3)))


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_w1_is_exact_at_extreme_scales(scale):
    # W_1 is 1-homogeneous; the reference is the LP (HiGHS) on the unscaled points.
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((6, 2)), rng.standard_normal((4, 2))
    a, b = rng.uniform(0.1, 1, 6), rng.uniform(0.1, 1, 4)
    expected = scale * _lp_w1(x, y, a / a.sum(), b / b.sum())
    np.testing.assert_allclose(wasserstein1(scale * x, scale * y, a, b), expected, rtol=1e-9)
    # Weights of extreme scale are normalised without overflow.
    np.testing.assert_allclose(wasserstein1(x, y, 1e300 * a, 1e-300 * b), expected / scale,
                               rtol=1e-9)


def test_w1_that_overflows_is_a_named_error():
    with pytest.raises(ValueError, match="overflows float64"):
        wasserstein1(np.array([[-1.5e308]]), np.array([[1.5e308]]))
    with pytest.raises(ValueError, match="a must be non-negative with a positive sum"):
        wasserstein1(np.zeros((2, 2)), np.zeros((2, 2)), a=np.zeros(2))


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_kantorovich_rubinstein_gaps_are_one_homogeneous_at_extreme_scales(scale):
    # The default family is drawn on the exactly rescaled points, so scaling the data by
    # s scales every gap by s (bounded by W_1, which is exact at any scale).
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((7, 3)), rng.standard_normal((5, 3)) + 0.5
    base = kantorovich_rubinstein_gaps(x, y, rng=0)
    scaled = kantorovich_rubinstein_gaps(x * scale, y * scale, rng=0)
    assert np.all(np.isfinite(scaled))
    np.testing.assert_allclose(scaled / scale, base, rtol=1e-12, atol=0.0)
    assert np.all(scaled <= wasserstein1(x * scale, y * scale) * (1 + 1e-9))


def test_kantorovich_rubinstein_gaps_name_overflowing_functions():
    x, y = np.zeros((2, 1)), np.ones((2, 1))
    with pytest.raises(ValueError, match=r"functions\[0\]\(x\) is inf at point 0"):
        kantorovich_rubinstein_gaps(x, y, functions=[lambda p: np.full(p.shape[0], np.inf)])
    # Finite values whose difference overflows: the gap itself is named.
    with pytest.raises(ValueError, match="a gap .* is not finite"):
        kantorovich_rubinstein_gaps(x, y, functions=[lambda p: 1.7e308 * (2 * p[:, 0] - 1)])


# ------------------------------------------------------------ issue 20: extreme inputs


def _divergence_matrix(seed, n=7):
    """Symmetric, zero diagonal, off-diagonal entries in [0.5, 1) (a power-of-two range)."""
    rng = np.random.default_rng(seed)
    d = rng.uniform(0.5, 1.0, (n, n))
    d = 0.5 * (d + d.T)
    np.fill_diagonal(d, 0.0)
    return d


@pytest.mark.parametrize(
    "similarity, exponent",
    [("reciprocal", -1000), ("reciprocal", 1023), ("max_minus", -1000), ("max_minus", 1021)],
)
def test_wcraig_picks_do_not_depend_on_the_scale_of_the_divergence(similarity, exponent):
    # With the default delta (1e-2 times the mean off-diagonal divergence) both similarities
    # scale with 2^-exponent (reciprocal) or 2^exponent (max_minus): the same picks, the
    # objective scaled. At 2^1023 the sum of the divergences overflows (the mean did); at
    # 2^1021 the bound 2 n max(SD) of the max_minus objective does, its value does not.
    divergence = _divergence_matrix(5)
    base = wcraig(divergence, 3, similarity=similarity)
    scaled = wcraig(np.ldexp(divergence, exponent), 3, similarity=similarity)
    np.testing.assert_array_equal(scaled.indices, base.indices)
    np.testing.assert_array_equal(scaled.weights, base.weights)
    power = -exponent if similarity == "reciprocal" else exponent
    np.testing.assert_allclose(scaled.objective, np.ldexp(base.objective, power), rtol=1e-12)


def test_wcraig_refuses_a_delta_whose_objective_overflows():
    divergence = _divergence_matrix(6)
    with pytest.raises(ValueError, match=r"^delta == 1e-310 is too small: .*n / the largest"):
        wcraig(divergence, 2, delta=1e-310)
    with pytest.raises(ValueError, match=r"^divergence is too small for similarity='reciprocal'"):
        wcraig(1e-310 * divergence, 2)


def test_wcraig_with_a_subnormal_delta_and_a_nonzero_diagonal_is_right():
    # Every divergence 1 (the diagonal too): every similarity is 1 / (1 + delta) = 1 in
    # float64, so F(S) = n for any S; picks by index.
    result = wcraig(np.ones((3, 3)), 2, delta=5e-324)
    np.testing.assert_array_equal(result.indices, [0, 1])
    np.testing.assert_allclose(result.objective, [3.0, 3.0], rtol=1e-15)


def test_facility_location_near_the_float64_limit():
    # F(S) <= n max(similarity) overflows as a bound but not as a value: computed.
    sim = np.ldexp(_divergence_matrix(7, n=5) + np.eye(5), 1021)      # entries <= 2^1021
    expected = facility_location_greedy(np.ldexp(sim, -1021), 2)
    result = facility_location_greedy(sim, 2)
    np.testing.assert_array_equal(result.indices, expected.indices)
    np.testing.assert_allclose(result.objective, np.ldexp(expected.objective, 1021), rtol=1e-12)
    with pytest.raises(ValueError, match=r"objective F\(S\) = .* overflows float64"):
        facility_location_greedy(np.full((3, 3), 1e308), 1)
    with pytest.raises(TypeError, match="lazy must be True or False"):
        facility_location_greedy(np.ones((3, 3)), 1, lazy="yes")


@pytest.mark.parametrize(
    "functions, error, match",
    [
        ([1, 2], TypeError, r"functions\[0\] must be a callable"),
        (lambda z: z[:, 0], TypeError, "functions must be a sequence of callables"),
        ("abc", TypeError, "functions must be a sequence of callables"),
        (5, TypeError, "functions must be a sequence of callables"),
        ([], ValueError, "functions must hold at least one callable"),
        ([lambda z: z], ValueError, r"functions\[0\]\(x\) has shape \(5, 2\), must be \(5,\)"),
        ([lambda z: z[:2, 0]], ValueError, r"functions\[0\]\(x\) has shape \(2,\)"),
        ([lambda z: np.full(z.shape[0], "a")], TypeError, r"functions\[0\]\(x\) must be an array of real"),
        ([lambda z: z[:, 0] + 1j], TypeError, r"functions\[0\]\(x\) must be an array of real"),
        ([lambda z: z[:, 0], lambda z: np.full(len(z), np.nan)], ValueError,
         r"functions\[1\]\(x\) is nan at point 0"),
    ],
)
def test_kantorovich_rubinstein_gaps_name_bad_functions(functions, error, match):
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((5, 2)), rng.standard_normal((4, 2))
    with pytest.raises(error, match=match):
        kantorovich_rubinstein_gaps(x, y, functions=functions)


def test_sizes_beyond_an_array_are_named_not_a_hang():
    from refdml.coresets import random_lipschitz_functions

    with pytest.raises(ValueError, match="n_functions == 1180591620717411303424"):
        kantorovich_rubinstein_gaps(np.ones((2, 1)), np.zeros((2, 1)), n_functions=2**70)
    with pytest.raises(ValueError, match="n_cones == 1073741824"):
        random_lipschitz_functions(2**40, 1, n_cones=2**30)
