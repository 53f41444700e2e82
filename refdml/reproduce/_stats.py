r"""Statistics of an experiment: per-method summaries, the paired bootstrap, the verdict.

For a comparison "method A beats baseline B on metric M" and seeds :math:`s = 1..n` run by
both, the paired differences are :math:`d_s = M_A(s) - M_B(s)` (paired by seed: the two
runs share the data draw and the split of that seed, so the difference removes the
seed-to-seed variation of the data). The effect is their mean :math:`\bar d`; its
confidence interval is the percentile interval of the bootstrap distribution of the mean:

.. math::

    \bar d^{*(b)} = \frac1n \sum_{i=1}^n d_{J_{b,i}},\quad J_{b,i} \sim \mathcal U\{1..n\}
    \text{ i.i.d.},\quad b = 1..B,\qquad
    \mathrm{CI} = [q_{\alpha/2}(\bar d^*),\ q_{1-\alpha/2}(\bar d^*)],

with :math:`B` resamples drawn from ``numpy.random.default_rng(seed)`` (so the interval is
reproducible) and NumPy's default (linear) quantile.

Verdict, with ``direction`` = +1 when the paper claims A's metric is higher, -1 when it
claims lower (e.g. a covering radius):

- ``reproduced``: the interval lies entirely on the claimed side of 0
  (``direction * lo > 0`` for the near end);
- ``not-reproduced``: the interval lies entirely on the other side;
- ``inconclusive``: the interval contains 0 (or touches it), or fewer than 2 paired seeds.

An inconclusive comparison is still *bounded*: with 95 % confidence the effect lies in the
interval, so ``|effect| < bound = max(|low|, |high|)`` (:attr:`Effect.bound`): the run rules
out every effect larger than that. And it says what would decide it: with ``s`` the sample
standard deviation of the paired differences, a true effect ``delta`` is decided (the 95 %
interval excludes 0) with probability 80 % by

.. math::

    n(\delta) = \left\lceil \left(\frac{(z_{0.975} + z_{0.80})\, s}{\delta}\right)^2
    \right\rceil\ \text{seeds}

(the normal approximation of the paired test; :func:`seeds_needed`). :attr:`Effect.seeds_needed`
is ``n`` at the comparison's *resolution* (0.02 by default: the MAP@R difference the glyph
studies are sized to decide), :attr:`Effect.seeds_for_observed` at the observed mean.

Competence gate (:func:`competence`). A comparison "A beats baseline B" says something only
when B learned: a baseline that ends at or below an untrained model makes any method look
good (or bad) against noise. With :math:`M_B(s)` the baseline's gate metric (test MAP@R)
after training and :math:`U_B(s)` the same network's metric before any training (its seed's
initial weights, same data and split), the gains :math:`g_s = M_B(s) - U_B(s)` are paired by
seed exactly as the comparisons' differences are, and go through the same bootstrap. The
baseline *learned* iff the lower end of the 95 % interval of the mean gain is above 0,
i.e. iff the gate comparison "trained > untrained" would read ``reproduced``.

The margin the mean gain must clear is thus not a constant but the seeds' own spread: for
many seeds the percentile interval's lower end is :math:`\bar g - z_{0.975}\, s_g/\sqrt n`
(normal approximation of the mean, :math:`s_g` the sample std of the gains), so the rule
reads :math:`\bar g > z_{0.975}\, s_g / \sqrt n`: a mean gain that a true gain of 0 would
produce by chance in under 2.5 % of seed draws. For few seeds the rule is simpler: with 2
seeds the resample means are :math:`g_1, (g_1+g_2)/2, g_2` with probabilities 1/4, 1/2,
1/4, so the 2.5 % quantile is :math:`\min(g_1, g_2)` and the rule is "both seeds gained";
with 3, the resample of the smallest gain three times has probability 1/27 > 2.5 %, so
again every seed must gain. With fewer than 2 paired seeds the spread is unknown and the
baseline counts as not learned (cannot tell), never as learned by default. A comparison
whose baseline did not learn gets the verdict ``baseline-did-not-learn``
(:data:`BASELINE_DID_NOT_LEARN`); its effect and interval are still computed and shown,
and it counts neither as reproduced nor as not reproduced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["REPRODUCED", "NOT_REPRODUCED", "INCONCLUSIVE", "BASELINE_DID_NOT_LEARN",
           "VERDICTS", "VERDICT_MEANINGS", "RESOLUTION", "Summary", "Effect", "Gate",
           "summarise", "paired_bootstrap", "verdict", "compare", "competence",
           "seeds_needed", "bound_text", "gate_text"]

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not-reproduced"
INCONCLUSIVE = "inconclusive"
BASELINE_DID_NOT_LEARN = "baseline-did-not-learn"
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, BASELINE_DID_NOT_LEARN)
VERDICT_MEANINGS = {
    REPRODUCED: "the confidence interval of the paired difference lies entirely on the "
                "side of 0 the paper claims",
    NOT_REPRODUCED: "the interval lies entirely on the other side of 0 (the numbers "
                    "contradict the claim)",
    INCONCLUSIVE: "the interval contains 0 (the seeds cannot tell the effect from noise), "
                  "or too few seeds finished",
    BASELINE_DID_NOT_LEARN: "not judged: the baseline's test metric is not above an "
                            "untrained model's (the 95% interval of its paired gain over "
                            "seeds reaches 0); the effect is shown, not counted",
}


#: The effect a comparison is sized to decide unless it says otherwise (a MAP@R difference).
RESOLUTION = 0.02
#: z_{0.975} + z_{0.80}: a two-sided 95 % interval, 80 % power.
_POWER_Z = 1.959963984540054 + 0.8416212335729143


@dataclass(frozen=True)
class Summary:
    """Mean, sample standard deviation (ddof 1; 0 for one value) and count of a metric."""

    mean: float
    std: float
    n: int
    values: tuple[float, ...]


@dataclass(frozen=True)
class Effect:
    """A paired comparison: mean difference, its bootstrap interval, the verdict."""

    effect: float
    low: float
    high: float
    n: int
    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    verdict: str
    confidence: float
    sd: float = math.nan                 # sample std of the differences (ddof 1)
    bound: float = math.nan              # max(|low|, |high|): |effect| < bound at confidence
    resolution: float = RESOLUTION
    seeds_needed: float = math.nan       # seeds that decide an effect of ``resolution``
    seeds_for_observed: float = math.nan  # ... of the observed mean


def seeds_needed(sd: float, effect: float, *, minimum: int = 2) -> float:
    """Seeds whose paired 95 % interval excludes 0 with probability 80 % when the true mean
    difference is ``effect`` and the differences' standard deviation ``sd`` (module
    docstring); ``inf`` for ``effect == 0`` with ``sd > 0``, ``minimum`` for ``sd == 0``,
    nan when either is nan."""
    if not (math.isfinite(sd) and math.isfinite(effect)):
        return math.nan
    if sd < 0:
        raise ValueError(f"sd == {sd}, must be >= 0")
    if sd == 0:
        return float(minimum)
    if effect == 0:
        return math.inf
    return float(max(minimum, math.ceil((_POWER_Z * sd / abs(effect)) ** 2)))


def bound_text(effect: "Effect | dict", metric: str = "effect") -> str:
    """What a comparison decides or bounds, in words: the interval when decided; for an
    inconclusive one ``|effect| < bound`` and the seeds that would decide its resolution."""
    get = effect.get if isinstance(effect, dict) else lambda k: getattr(effect, k)
    if get("n") < 2 or not math.isfinite(get("bound")):
        return "too few seeds to bound the effect"
    confidence = f"{100 * get('confidence'):.0f}%"
    if get("verdict") != INCONCLUSIVE:
        return (f"{metric} in [{get('low'):+.4f}, {get('high'):+.4f}] ({confidence} "
                "confidence)")
    need = get("seeds_needed")
    seeds = ("" if not math.isfinite(need) else
             f"; ~{need:.0f} seeds would decide a {get('resolution'):g} effect")
    return f"|{metric}| < {get('bound'):.4f} ({confidence} confidence){seeds}"


def summarise(values) -> Summary:
    v = np.asarray(list(values), dtype=np.float64)
    if v.size == 0:
        return Summary(math.nan, math.nan, 0, ())
    std = float(v.std(ddof=1)) if v.size > 1 else 0.0
    return Summary(float(v.mean()), std, int(v.size), tuple(float(x) for x in v))


def paired_bootstrap(differences, *, n_resamples: int = 10_000, confidence: float = 0.95,
                     seed: int = 0) -> tuple[float, float, float]:
    """``(mean, low, high)``: the mean of ``differences`` and its percentile bootstrap interval.

    ``differences`` (n,) finite, n >= 1; ``n_resamples`` >= 1; ``confidence`` in (0, 1).
    Deterministic given ``seed``.
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"differences must be a non-empty 1-D array, got shape {d.shape}")
    if not np.all(np.isfinite(d)):
        raise ValueError("differences must be finite")
    if isinstance(n_resamples, bool) or not isinstance(n_resamples, int) or n_resamples < 1:
        raise ValueError(f"n_resamples == {n_resamples!r}, must be an integer >= 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence == {confidence!r}, must be in (0, 1)")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(n_resamples, d.size))
    means = d[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = np.quantile(means, [alpha / 2, 1.0 - alpha / 2])
    return float(d.mean()), float(low), float(high)


def verdict(low: float, high: float, direction: int, n: int = 2) -> str:
    """The verdict of an interval ``[low, high]`` for a claim of sign ``direction`` (+1/-1)."""
    if direction not in (1, -1):
        raise ValueError(f"direction == {direction!r}, must be 1 or -1")
    if n < 2 or not (math.isfinite(low) and math.isfinite(high)):
        return INCONCLUSIVE
    if low > high:
        raise ValueError(f"low == {low} > high == {high}")
    lo, hi = (low, high) if direction == 1 else (-high, -low)
    if lo > 0:
        return REPRODUCED
    if hi < 0:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def compare(a: dict[int, float], b: dict[int, float], *, direction: int,
            n_resamples: int = 10_000, confidence: float = 0.95, seed: int = 0,
            resolution: float = RESOLUTION) -> Effect:
    """Paired comparison of ``a`` and ``b`` (seed -> metric), over the seeds both have;
    ``resolution`` the effect whose seeds :attr:`Effect.seeds_needed` counts."""
    if not (isinstance(resolution, (int, float)) and math.isfinite(resolution)
            and resolution > 0):
        raise ValueError(f"resolution == {resolution!r}, must be a finite number > 0")
    seeds = tuple(sorted(set(a) & set(b)))
    d = np.array([a[s] - b[s] for s in seeds], dtype=np.float64)
    if d.size == 0:
        return Effect(math.nan, math.nan, math.nan, 0, (), (), INCONCLUSIVE, confidence,
                      resolution=float(resolution))
    mean, low, high = paired_bootstrap(d, n_resamples=n_resamples, confidence=confidence,
                                       seed=seed)
    sd = float(d.std(ddof=1)) if d.size > 1 else math.nan
    return Effect(mean, low, high, int(d.size), seeds, tuple(float(x) for x in d),
                  verdict(low, high, direction, int(d.size)), confidence, sd=sd,
                  bound=max(abs(low), abs(high)), resolution=float(resolution),
                  seeds_needed=seeds_needed(sd, resolution),
                  seeds_for_observed=seeds_needed(sd, mean))


@dataclass(frozen=True)
class Gate:
    """Whether a run learned: its ``metric`` against the untrained model's, paired by seed.

    ``learned``: the lower end of the bootstrap interval of the mean gain is above 0 (module
    docstring); ``gain``, ``low``, ``high``: the mean gain ``trained - untrained`` and its
    interval; ``trained``, ``untrained``: the two means over the paired ``seeds``."""

    metric: str
    learned: bool
    gain: float
    low: float
    high: float
    n: int
    seeds: tuple[int, ...]
    trained: float
    untrained: float
    confidence: float


def competence(trained: dict[int, float], untrained: dict[int, float], *,
               metric: str = "test_map_at_r", n_resamples: int = 10_000,
               confidence: float = 0.95, seed: int = 0) -> Gate:
    """The competence gate of a run: ``trained`` (seed -> its ``metric`` after training)
    against ``untrained`` (seed -> the same network's ``metric`` before any training), over
    the seeds both have, with :func:`compare`'s bootstrap. Fewer than 2 paired seeds: not
    learned."""
    effect = compare(trained, untrained, direction=+1, n_resamples=n_resamples,
                     confidence=confidence, seed=seed)
    seeds = effect.seeds

    def mean(values: dict[int, float]) -> float:
        return float(np.mean([values[s] for s in seeds])) if seeds else math.nan

    return Gate(metric=metric, learned=effect.verdict == REPRODUCED, gain=effect.effect,
                low=effect.low, high=effect.high, n=effect.n, seeds=seeds,
                trained=mean(trained), untrained=mean(untrained), confidence=confidence)


def gate_text(gate: "Gate | dict") -> str:
    """A gate in words: ``learned: gain +0.0500 [+0.0400, +0.0600] (0.0650 vs untrained
    0.0150, 4 seeds)``, or ``did not learn: ...``."""
    get = gate.get if isinstance(gate, dict) else lambda k: getattr(gate, k)

    def num(x, fmt):
        return "nan" if x is None or not math.isfinite(x) else fmt.format(x)

    head = "learned" if get("learned") else "did not learn"
    return (f"{head}: {get('metric')} gain {num(get('gain'), '{:+.4f}')} "
            f"[{num(get('low'), '{:+.4f}')}, {num(get('high'), '{:+.4f}')}] "
            f"({num(get('trained'), '{:.4f}')} vs untrained {num(get('untrained'), '{:.4f}')}, "
            f"{get('n')} seed{'s' if get('n') != 1 else ''})")
