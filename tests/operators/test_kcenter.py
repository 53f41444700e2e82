"""Greedy k-center against brute force and a readable loop of ASAP Algorithm 2."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _kcenter_checks import FACTOR, assert_same_traversal
from refdml.gradcheck import strategies as rst
from refdml.kcenter import KCenterResult, greedy_k_center, select_proxies

pytestmark = pytest.mark.cpu_exact


def _radius(points, centers):
    d = np.linalg.norm(points[:, None, :] - centers[None, :, :], axis=-1)
    return d.min(axis=1).max()


def _optimal_radius(points, k):
    return min(_radius(points, points[list(s)]) for s in itertools.combinations(range(len(points)), k))


@settings(max_examples=15)
@given(rst.points_in_unit_ball(9, 2), st.integers(1, 4), st.integers(0, 8))
def test_radius_is_within_twice_the_brute_force_optimum(points, k, seed):
    result = greedy_k_center(points, k, rng=seed)
    assert len(set(result.indices.tolist())) == k
    np.testing.assert_allclose(result.radii[-1], _radius(points, points[result.indices]), rtol=1e-9,
                               atol=1e-12)
    assert result.radii[-1] <= 2.0 * _optimal_radius(points, k) + 1e-12


def test_radii_follow_a_readable_farthest_first_loop():
    rng = np.random.default_rng(0)
    points = rng.standard_normal((40, 3))
    result = greedy_k_center(points, 6, initial=np.array([3]))
    chosen, radii = [3], []
    for pick in range(6):
        dist = [min(np.linalg.norm(p - points[c]) for c in chosen) for p in points]
        chosen.append(int(np.argmax(dist)))
        radii.append(max(min(np.linalg.norm(p - points[c]) for c in chosen) for p in points))
    loop = KCenterResult(np.array(chosen[1:]), np.array(radii), result.initial_radius)
    # The picks are discrete: equal wherever rounding cannot swap them (tests/_kcenter_checks).
    assert_same_traversal(result, loop, points, initial=np.array([3]))
    np.testing.assert_allclose(result.radii, radii, rtol=1e-12)
    assert np.all(np.diff(result.radii) <= 1e-15)


def test_initial_points_and_indices_agree_and_are_not_returned():
    rng = np.random.default_rng(1)
    points = rng.standard_normal((50, 4))
    by_index = greedy_k_center(points, 5, initial=np.array([7, 11]))
    by_points = greedy_k_center(points, 5, initial=points[[7, 11]])
    # Exactly equal by construction: the same centre values, scale and arithmetic.
    np.testing.assert_array_equal(by_index.indices, by_points.indices)
    assert not {7, 11} & set(by_index.indices.tolist())
    np.testing.assert_allclose(by_index.initial_radius, _radius(points, points[[7, 11]]), rtol=1e-12)


def test_chunk_size_does_not_change_the_result():
    rng = np.random.default_rng(2)
    points = rng.standard_normal((257, 5))
    a = greedy_k_center(points, 10, rng=3, initial=None)
    b = greedy_k_center(points, 10, rng=3, chunk_size=7)
    # Exactly equal by construction: each row's distance is computed by itself (no block
    # enters its sum), so the blocking cannot change a bit.
    np.testing.assert_array_equal(a.indices, b.indices)
    np.testing.assert_allclose(a.radii, b.radii, rtol=1e-12)


def test_duplicates_are_never_picked_twice():
    points = np.repeat(np.eye(2), 3, axis=0)    # exact small integers in any order: ties exact
    result = greedy_k_center(points, 6, rng=0)
    assert sorted(result.indices.tolist()) == list(range(6))
    np.testing.assert_array_equal(result.radii[1:], 0.0)


@pytest.mark.parametrize("k, initial, match", [
    (0, None, "k == 0"), (11, None, "k == 11"), (9, np.arange(2), "k == 9"),
])
def test_bad_k_is_an_error(k, initial, match):
    with pytest.raises(ValueError, match=match):
        greedy_k_center(np.zeros((10, 2)), k, initial=initial)


def test_empty_and_malformed_input_are_errors():
    with pytest.raises(ValueError, match="points must not be empty"):
        greedy_k_center(np.zeros((0, 3)), 1)
    with pytest.raises(ValueError, match="points must have 2 dimensions"):
        greedy_k_center(np.zeros(5), 1)
    with pytest.raises(TypeError, match="k must be an integer"):
        greedy_k_center(np.zeros((5, 2)), 1.5)
    with pytest.raises(ValueError, match="initial centres have dimension 3"):
        greedy_k_center(np.zeros((5, 2)), 1, initial=np.zeros((1, 3)))


def _loop_select_proxies(embeddings, labels, proxies, proxy_labels, budget, rng):
    """ASAP Algorithm 2 as printed, one class and one pick at a time.

    Each pick must beat the runner-up by more than the rounding of two implementations
    (tests/_kcenter_checks.py), so that an exact comparison of the picks is well posed.
    """
    d = embeddings.shape[1]
    scale = max(np.max(np.sum(embeddings**2, axis=1)), np.max(np.sum(proxies**2, axis=1)))
    margin = 2 * FACTOR * (d + 3) * np.finfo(np.float64).eps * scale
    out = np.empty(len(proxies), dtype=int)
    for c in np.unique(proxy_labels):
        slots = np.flatnonzero(proxy_labels == c)
        members = np.flatnonzero(labels == c)
        pool = rng.choice(members, size=min(budget, members.size), replace=False)
        centres = [proxies[s] for s in slots]
        picked = []
        while len(picked) < len(slots):
            best, best_d, runner_up = None, -1.0, -1.0
            for u in pool:
                if u in picked:
                    continue
                dist = min(np.linalg.norm(embeddings[u] - v) for v in centres)
                if dist > best_d:
                    best, best_d, runner_up = u, dist, best_d
                else:
                    runner_up = max(runner_up, dist)
            assert best_d**2 - runner_up**2 > margin, "a near-tie: pick another seed"
            picked.append(best)
            centres.append(embeddings[best])
        out[slots] = picked
    return out


def test_select_proxies_follows_algorithm_2():
    rng = np.random.default_rng(4)
    embeddings = rng.standard_normal((60, 3))
    labels = np.repeat(np.arange(3), 20)
    proxy_labels = np.array([0, 0, 1, 1, 1, 2])
    proxies = rng.standard_normal((6, 3))
    result = select_proxies(embeddings, labels, proxies, proxy_labels, budget=8, rng=5)
    expected = _loop_select_proxies(embeddings, labels, proxies, proxy_labels, 8,
                                    np.random.default_rng(5))
    np.testing.assert_array_equal(result.indices, expected)
    np.testing.assert_array_equal(labels[result.indices], proxy_labels)
    np.testing.assert_array_equal(result.proxies, embeddings[result.indices])


def test_select_proxies_budget_must_cover_the_proxies():
    embeddings = np.zeros((10, 2))
    labels = np.repeat([0, 1], 5)
    with pytest.raises(ValueError, match="class 0 has 3 proxies but only 2 candidates"):
        select_proxies(embeddings, labels, np.zeros((3, 2)), [0, 0, 0], budget=2, rng=0)


@pytest.mark.parametrize("scale", [1e-300, 1e-150, 1e150, 1e300])
def test_radii_and_picks_at_extreme_scales(scale):
    # Reference: brute-force covering radii of the unscaled picks, times the scale.
    rng = np.random.default_rng(5)
    points = rng.standard_normal((30, 3))
    plain = greedy_k_center(points, 6, rng=1)
    scaled = greedy_k_center(scale * points, 6, rng=1)
    # scale * points is rounded (scale is no power of two): the picks are the same up to a
    # near-tie within rounding (tests/_kcenter_checks.py).
    plain_scaled = KCenterResult(plain.indices, scale * plain.radii, plain.initial_radius)
    assert_same_traversal(scaled, plain_scaled, scale * points)
    radii = [_radius(points, points[plain.indices[: i + 1]]) for i in range(6)]
    np.testing.assert_allclose(scaled.radii, scale * np.array(radii), rtol=1e-12)
    by_points = greedy_k_center(scale * points, 4, initial=scale * points[[2, 9]])
    by_index = greedy_k_center(points, 4, initial=np.array([2, 9]))
    by_index_scaled = KCenterResult(by_index.indices, scale * by_index.radii,
                                    scale * by_index.initial_radius)
    assert_same_traversal(by_points, by_index_scaled, scale * points,
                          initial=scale * points[[2, 9]])
    np.testing.assert_allclose(by_points.initial_radius, scale * _radius(points, points[[2, 9]]),
                               rtol=1e-12)
