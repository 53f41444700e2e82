"""The statistics of refdml reproduce: paired bootstrap interval and verdict, and the
competence gate, checked against an exact enumeration, hand-computed cases and the normal
approximation."""

import itertools
import math

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.reproduce import (
    INCONCLUSIVE,
    NOT_REPRODUCED,
    REPRODUCED,
    compare,
    paired_bootstrap,
    summarise,
    verdict,
)


def test_hand_computed_two_differences():
    # d = (1, 3): a resample mean is 1 (p 1/4), 2 (p 1/2) or 3 (p 1/4), so the 2.5 % and
    # 97.5 % quantiles of 10,000 resamples are exactly 1 and 3.
    mean, low, high = paired_bootstrap([1.0, 3.0], n_resamples=10_000, seed=0)
    assert (mean, low, high) == (2.0, 1.0, 3.0)
    assert verdict(low, high, +1) == REPRODUCED
    assert verdict(low, high, -1) == NOT_REPRODUCED


def test_quantiles_match_exact_enumeration_of_resamples():
    d = np.array([0.3, -0.1, 0.5])
    # all 27 equally likely resamples: the exact distribution of the resample mean
    means = np.sort([d[list(idx)].mean() for idx in itertools.product(range(3), repeat=3)])
    exact_cdf = lambda x: np.searchsorted(means, x + 1e-12, side="right") / means.size  # noqa: E731
    _, low, high = paired_bootstrap(d, n_resamples=200_000, seed=1)
    # the bootstrap quantiles are atoms of the exact distribution at the right levels
    assert np.isclose(means, low).any() and np.isclose(means, high).any()
    assert exact_cdf(low) >= 0.025 and exact_cdf(low - 1e-9) <= 0.025 + 0.01
    assert exact_cdf(high) >= 0.975 - 0.01 and exact_cdf(high - 1e-9) <= 0.975


def test_large_sample_matches_normal_approximation():
    rng = np.random.default_rng(5)
    d = rng.normal(0.2, 1.0, size=500)
    mean, low, high = paired_bootstrap(d, n_resamples=10_000, seed=2)
    half = 1.959964 * d.std(ddof=1) / math.sqrt(d.size)
    assert_allclose(mean, d.mean(), rtol=0, atol=1e-15)
    assert_allclose([low, high], [d.mean() - half, d.mean() + half], rtol=0, atol=0.08 * half)


def test_interval_is_reproducible_and_seed_dependent():
    d = np.random.default_rng(0).normal(size=7)
    assert paired_bootstrap(d, seed=3) == paired_bootstrap(d, seed=3)
    assert paired_bootstrap(d, seed=3) != paired_bootstrap(d, seed=4)


@pytest.mark.parametrize("low, high, direction, expected", [
    (0.1, 0.3, 1, REPRODUCED), (-0.3, -0.1, 1, NOT_REPRODUCED), (-0.1, 0.2, 1, INCONCLUSIVE),
    (0.0, 0.2, 1, INCONCLUSIVE), (-0.3, -0.1, -1, REPRODUCED), (0.1, 0.3, -1, NOT_REPRODUCED),
    (-0.2, 0.0, -1, INCONCLUSIVE), (0.0, 0.0, 1, INCONCLUSIVE),
])
def test_verdict_rule(low, high, direction, expected):
    assert verdict(low, high, direction) == expected


def test_verdict_needs_two_seeds_and_a_direction():
    assert verdict(0.1, 0.2, 1, n=1) == INCONCLUSIVE
    with pytest.raises(ValueError, match="direction"):
        verdict(0.1, 0.2, 0)


def test_compare_pairs_by_seed():
    a = {0: 1.0, 1: 2.0, 2: 4.0, 7: 100.0}          # seed 7 has no partner: left out
    b = {0: 0.5, 1: 1.0, 2: 3.0, 5: -100.0}
    e = compare(a, b, direction=1)
    assert e.seeds == (0, 1, 2) and e.differences == (0.5, 1.0, 1.0)
    assert_allclose(e.effect, 2.5 / 3, rtol=1e-15)
    assert e.low == 0.5 and e.high == 1.0 and e.verdict == REPRODUCED
    assert compare({}, b, direction=1).verdict == INCONCLUSIVE


def test_summarise():
    s = summarise([1.0, 2.0, 4.0])
    assert_allclose([s.mean, s.std], [7 / 3, np.std([1, 2, 4], ddof=1)], rtol=1e-15)
    assert summarise([3.0]).std == 0.0 and summarise([]).n == 0


@pytest.mark.parametrize("bad, match", [([], "non-empty"), ([1.0, np.nan], "finite")])
def test_paired_bootstrap_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(bad)


# --------------------------------------------------------------------------- bounds and power
def test_seeds_needed_gives_the_stated_power_by_simulation():
    """n(delta) seeds: a paired 95% interval of differences N(delta, sd^2) excludes 0 with
    probability at least 80% (simulated with the normal-theory interval, known sd: the
    formula's model), and n - 1 seeds fall short of it."""
    from refdml.reproduce import seeds_needed

    rng = np.random.default_rng(0)
    for sd, delta in ((0.01, 0.02), (0.03, 0.02), (0.05, 0.01)):
        n = int(seeds_needed(sd, delta))

        def power(k):
            means = rng.normal(delta, sd, size=(40_000, k)).mean(axis=1)
            return float(np.mean(means - 1.959963984540054 * sd / np.sqrt(k) > 0))

        assert 0.795 <= power(n) <= 0.80 + 0.25 / n + 0.01, (sd, delta, n)
        if n > 2:
            assert power(n - 1) < 0.80 + 0.006
    assert seeds_needed(0.0, 0.02) == 2 and seeds_needed(0.01, 0.0) == math.inf
    assert math.isnan(seeds_needed(math.nan, 0.02))
    with pytest.raises(ValueError, match="sd == -1"):
        seeds_needed(-1.0, 0.02)


def test_an_inconclusive_comparison_is_bounded_by_its_interval():
    from refdml.reproduce import compare, paired_bootstrap
    from refdml.reproduce._stats import bound_text

    a = {s: 0.5 + 0.01 * v for s, v in enumerate([1.0, -2.0, 0.5, 1.5, -0.5])}
    b = {s: 0.5 for s in range(5)}
    effect = compare(a, b, direction=+1, resolution=0.02)
    mean, low, high = paired_bootstrap([a[s] - b[s] for s in range(5)])
    assert effect.verdict == "inconclusive" and low < 0 < high
    assert effect.bound == max(-low, high)
    d = np.array([a[s] - b[s] for s in range(5)])
    assert effect.sd == pytest.approx(d.std(ddof=1), rel=1e-12)
    need = math.ceil((2.8015852181 * effect.sd / 0.02) ** 2)
    assert effect.seeds_needed == max(2, need)
    text = bound_text(effect)
    assert f"< {effect.bound:.4f}" in text and f"~{need} seeds" in text
    decided = compare({0: 1.0, 1: 1.1, 2: 1.2}, {0: 0.0, 1: 0.0, 2: 0.0}, direction=+1)
    assert decided.verdict == "reproduced" and "in [" in bound_text(decided)
    assert bound_text(compare({0: 1.0}, {0: 0.0}, direction=+1)).startswith("too few")
    with pytest.raises(ValueError, match="resolution"):
        compare(a, b, direction=+1, resolution=0.0)


# --------------------------------------------------------------------------- competence gate
def _exact_resample_means(d):
    """Every one of the n**n equally likely resamples' means, sorted: the exact bootstrap
    distribution of the mean of ``d``."""
    d = np.asarray(d, dtype=np.float64)
    return np.sort([d[list(idx)].mean()
                    for idx in itertools.product(range(d.size), repeat=d.size)])


def test_competence_with_three_seeds_against_the_exact_enumeration():
    from refdml.reproduce._stats import competence

    untrained = {0: 0.015, 1: 0.016, 2: 0.014}
    trained = {0: 0.050, 1: 0.060, 2: 0.020}
    gains = [0.035, 0.044, 0.006]
    # Of the 27 resamples one is (min, min, min): probability 1/27 > 2.5 %, so the exact
    # 2.5 % quantile is the smallest gain (and the 97.5 % one the largest): with 3 seeds a
    # run learned iff every seed gained.
    means = _exact_resample_means(gains)
    assert means[0] == pytest.approx(min(gains), abs=1e-15)
    assert np.mean(means <= min(gains) + 1e-12) == pytest.approx(1 / 27)
    g = competence(trained, untrained)
    assert g.learned and g.n == 3 and g.seeds == (0, 1, 2)
    assert_allclose([g.gain, g.low, g.high], [sum(gains) / 3, 0.006, 0.044], rtol=0, atol=1e-12)
    assert_allclose([g.trained, g.untrained], [0.13 / 3, 0.045 / 3], rtol=0, atol=1e-15)
    # one seed lost a little: the smallest gain, the interval's lower end, is below 0
    g = competence({**trained, 2: 0.013}, untrained)
    assert not g.learned
    assert_allclose(g.low, -0.001, rtol=0, atol=1e-12)


def test_competence_zero_mean_gain_with_spread_did_not_learn():
    from refdml.reproduce._stats import competence

    untrained = {s: 0.015 for s in range(5)}
    trained = {s: 0.015 + v for s, v in enumerate([0.01, -0.01, 0.02, -0.02, 0.0])}
    g = competence(trained, untrained)
    assert not g.learned
    assert g.low < 0 < g.high
    assert_allclose(g.gain, 0.0, rtol=0, atol=1e-15)


def test_competence_margin_is_the_seed_spread():
    """For many seeds the rule is mean gain > z_0.975 * sd / sqrt(n): the same mean gain
    passes with a small spread and fails with a large one."""
    from refdml.reproduce._stats import competence

    n, sd = 400, 0.01
    z = np.random.default_rng(7).normal(size=n)
    z = (z - z.mean()) / z.std(ddof=1)                  # exactly mean 0, sd 1
    margin = 1.959963984540054 * sd / math.sqrt(n)      # 0.00098
    untrained = {s: 0.015 for s in range(n)}

    def gate(mean_gain, spread):
        return competence({s: 0.015 + mean_gain + spread * z[s] for s in range(n)}, untrained)

    assert gate(2 * margin, sd).learned
    assert not gate(0.5 * margin, sd).learned
    assert not gate(2 * margin, 4 * sd).learned          # same gain, four times the spread
    # the lower end is the normal interval's, within the bootstrap's own error
    assert_allclose(gate(2 * margin, sd).low, margin, rtol=0.1)


def test_competence_pairs_only_common_seeds_and_needs_two():
    from refdml.reproduce._stats import competence

    trained = {0: 0.10, 1: 0.12, 2: 0.11, 7: 0.0}       # seed 7 has no untrained partner
    untrained = {0: 0.02, 1: 0.02, 2: 0.02, 5: 0.9}     # nor seed 5 a trained one
    g = competence(trained, untrained)
    assert g.seeds == (0, 1, 2) and g.learned
    assert_allclose([g.trained, g.untrained, g.gain], [0.11, 0.02, 0.09], rtol=0, atol=1e-15)
    # one seed: a large gain, but no spread to judge it by -> not learned
    one = competence({0: 0.9}, {0: 0.01})
    assert one.n == 1 and not one.learned
    none = competence({}, {0: 0.01})
    assert none.n == 0 and not none.learned and math.isnan(none.gain)


def test_gate_text_and_the_new_verdict():
    from refdml.reproduce._stats import (
        BASELINE_DID_NOT_LEARN,
        VERDICT_MEANINGS,
        VERDICTS,
        competence,
        gate_text,
    )

    assert BASELINE_DID_NOT_LEARN == "baseline-did-not-learn"
    assert BASELINE_DID_NOT_LEARN in VERDICTS and BASELINE_DID_NOT_LEARN in VERDICT_MEANINGS
    # gains +0.002 and -0.001: with 2 seeds the interval is [min, max] (module docstring)
    g = competence({0: 0.018, 1: 0.015}, {0: 0.016, 1: 0.016})
    assert gate_text(g) == ("did not learn: test_map_at_r gain +0.0005 [-0.0010, +0.0020] "
                            "(0.0165 vs untrained 0.0160, 2 seeds)")
    assert gate_text(competence({0: 0.03, 1: 0.02}, {0: 0.01, 1: 0.01})).startswith(
        "learned: test_map_at_r gain +0.0150 [+0.0100, +0.0200]")
    # the JSON form (NaN as None) reads the same way
    assert gate_text({**g.__dict__, "gain": None, "low": None, "high": None, "n": 1}) == (
        "did not learn: test_map_at_r gain nan [nan, nan] (0.0165 vs untrained 0.0160, 1 seed)")
