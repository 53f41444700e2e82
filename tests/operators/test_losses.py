"""DML losses: values against slow loop oracles written from the papers' formulas, gradients
against finite differences of the forward/backward pairs (refdml.gradcheck, rtol 1e-6, float64,
random upstream d_value), extreme scales, edge cases and input checks.

Each oracle returns ``(value, gap)`` where ``gap`` is the distance of the nearest hinge,
mining threshold or argmax tie to its kink; gradient checks only run with ``gap > 1e-4``
(central differences use a step of about 6e-6 * max|x|).
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from refdml import losses
from refdml.gradcheck import assert_gradients, check_gradients
from refdml.gradcheck import strategies as rst

KINK = 1e-4


# ------------------------------------------------------------------ loop oracles


def _dist(a, b):
    # math.hypot scales internally: right from 1e-300 to 1e300.
    return math.hypot(*(u - v for u, v in zip(a, b)))


def _cos(a, b):
    dot = sum(u * v for u, v in zip(a, b))
    return dot / math.sqrt(sum(u * u for u in a)) / math.sqrt(sum(v * v for v in b))


def _reduce_loop(terms, reduction):
    if reduction == "sum":
        return sum(terms)
    if reduction == "mean":
        return sum(terms) / len(terms) if terms else 0.0
    nonzero = [t for t in terms if t > 0]
    return sum(nonzero) / len(nonzero) if nonzero else 0.0


def contrastive_loop(x, y, pos_margin, neg_margin, form, reduction):
    """One term per unordered pair, positive or negative; no special case without positives."""
    terms, gap = [], math.inf
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            if form == "euclidean":
                d = _dist(x[i], x[j])
                pre = d - pos_margin if y[i] == y[j] else neg_margin - d
            else:
                s = _cos(x[i], x[j])
                pre = pos_margin - s if y[i] == y[j] else s - neg_margin
            terms.append(max(pre, 0.0))
            gap = min(gap, abs(pre))
    return _reduce_loop(terms, reduction), gap


def generalized_contrastive_loop(x, y, alpha, beta, reduction):
    """ASAP Eq. (4.2): (iota (d - beta) + alpha)_+, iota = +1 same class, -1 otherwise."""
    terms, gap = [], math.inf
    for i in range(len(x)):
        for j in range(i + 1, len(x)):
            iota = 1.0 if y[i] == y[j] else -1.0
            pre = iota * (_dist(x[i], x[j]) - beta) + alpha
            terms.append(max(pre, 0.0))
            gap = min(gap, abs(pre))
    return _reduce_loop(terms, reduction), gap


def triplet_loop(x, y, margin, mining, reduction):
    n = len(x)
    d = [[_dist(x[i], x[j]) for j in range(n)] for i in range(n)]
    terms, gap = [], math.inf
    for a in range(n):
        positives = [p for p in range(n) if p != a and y[p] == y[a]]
        negatives = [q for q in range(n) if y[q] != y[a]]
        if mining == "all":
            triplets = [(p, q) for p in positives for q in negatives]
        elif positives and negatives:
            hardest_p = max(positives, key=lambda p: d[a][p])
            hardest_n = min(negatives, key=lambda q: d[a][q])
            triplets = [(hardest_p, hardest_n)]
            for group in (sorted(d[a][p] for p in positives), sorted(d[a][q] for q in negatives)):
                gap = min([gap] + [b - c for b, c in zip(group[1:], group[:-1])])
        else:
            triplets = []
        for p, q in triplets:
            pre = d[a][p] - d[a][q] + margin
            terms.append(max(pre, 0.0))
            gap = min(gap, abs(pre))
    return _reduce_loop(terms, reduction), gap


def multi_similarity_loop(x, y, alpha, beta, base, eps, reduction):
    """Wang et al. 2019: mining (Eqs. 7-8) then Eq. 9, per anchor."""
    n = len(x)
    terms, gap = [], math.inf
    for i in range(n):
        pos = [_cos(x[i], x[k]) for k in range(n) if k != i and y[k] == y[i]]
        neg = [_cos(x[i], x[k]) for k in range(n) if y[k] != y[i]]
        gap = _ms_anchor(pos, neg, alpha, beta, base, eps, terms, gap)
    if not terms:
        return 0.0, gap
    return _reduce_loop(terms, reduction), gap


def _ms_anchor(pos, neg, alpha, beta, base, eps, terms, gap):
    """One anchor's multi-similarity term appended to ``terms`` (none without a positive
    or a negative); returns ``gap`` updated with its mining thresholds' distances."""
    if not pos or not neg:
        return gap
    mined_neg = [s for s in neg if s + eps > min(pos)]
    mined_pos = [s for s in pos if s - eps < max(neg)]
    gap = min([gap] + [abs(s + eps - min(pos)) for s in neg] + [abs(s - eps - max(neg)) for s in pos])
    if not mined_neg or not mined_pos:
        terms.append(0.0)
        return gap
    term = math.log(1 + sum(math.exp(-alpha * (s - base)) for s in mined_pos)) / alpha
    term += math.log(1 + sum(math.exp(beta * (s - base)) for s in mined_neg)) / beta
    terms.append(term)
    return gap


def _unit(a):
    norm = math.hypot(*a)
    return [u / norm for u in a]


def proxy_contrastive_loop(x, y, proxies, proxy_labels, pos_margin, neg_margin, form, reduction):
    """ASAP Eq. (4.11) with C2 (C1): one term per (sample, proxy) pair, on unit rows."""
    terms, gap = [], math.inf
    for xi, yi in zip(x, y):
        for p, cls in zip(proxies, proxy_labels):
            if form == "euclidean":
                d = _dist(_unit(xi), _unit(p))
                pre = d - pos_margin if yi == cls else neg_margin - d
                gap = min(gap, d)          # the distance's own kink at 0
            else:
                s = _cos(xi, p)
                pre = pos_margin - s if yi == cls else s - neg_margin
            terms.append(max(pre, 0.0))
            gap = min(gap, abs(pre))
    return _reduce_loop(terms, reduction), gap


def proxy_multi_similarity_loop(x, y, proxies, proxy_labels, alpha, beta, base, eps, reduction):
    """Multi-similarity with each sample an anchor, its class's proxies its positives."""
    terms, gap = [], math.inf
    for xi, yi in zip(x, y):
        pos = [_cos(xi, p) for p, cls in zip(proxies, proxy_labels) if cls == yi]
        neg = [_cos(xi, p) for p, cls in zip(proxies, proxy_labels) if cls != yi]
        gap = _ms_anchor(pos, neg, alpha, beta, base, eps, terms, gap)
    if not terms:
        return 0.0, gap
    return _reduce_loop(terms, reduction), gap


def proxy_anchor_loop(x, y, proxies, proxy_labels, delta, alpha, reduction):
    """Kim et al. 2020 Eq. 4."""
    pos_terms, neg_terms = [], []
    for p, cls in zip(proxies, proxy_labels):
        members = [xi for xi, yi in zip(x, y) if yi == cls]
        others = [xi for xi, yi in zip(x, y) if yi != cls]
        if members:
            pos_terms.append(math.log(1 + sum(math.exp(-alpha * (_cos(xi, p) - delta)) for xi in members)))
        neg_terms.append(math.log(1 + sum(math.exp(alpha * (_cos(xi, p) + delta)) for xi in others)))
    return _reduce_loop(pos_terms, reduction) + _reduce_loop(neg_terms, reduction)


def proxy_nca_loop(x, y, proxies, proxy_labels, temperature, reduction):
    """ProxyNCA++: -log softmax of -||x^ - p^||^2 / T, positive proxies in the denominator."""
    terms = []
    for xi, yi in zip(x, y):
        xu = [v / math.sqrt(sum(u * u for u in xi)) for v in xi]
        scores = []
        for p in proxies:
            pu = [v / math.sqrt(sum(u * u for u in p)) for v in p]
            scores.append(math.exp(-sum((a - b) ** 2 for a, b in zip(xu, pu)) / temperature))
        own = sum(s for s, cls in zip(scores, proxy_labels) if cls == yi)
        terms.append(-math.log(own / sum(scores)))
    return _reduce_loop(terms, reduction)


def soft_triple_loop(x, y, centers, center_labels, lam, gamma, tau, delta, reduction):
    """Qian et al. 2019: relaxed similarity, Eq. 10, regulariser with denominator C K (K - 1)."""
    classes = sorted(set(center_labels))
    terms = []
    for xi, yi in zip(x, y):
        logits = {}
        for c in classes:
            sims = [_cos(xi, w) for w, cl in zip(centers, center_labels) if cl == c]
            weights = [math.exp(s / gamma) for s in sims]
            relaxed = sum(w * s for w, s in zip(weights, sims)) / sum(weights)
            logits[c] = lam * (relaxed - (delta if c == yi else 0.0))
        terms.append(-math.log(math.exp(logits[yi]) / sum(math.exp(v) for v in logits.values())))
    value = _reduce_loop(terms, reduction)
    reg, denominator = 0.0, 0
    for c in classes:
        members = [w for w, cl in zip(centers, center_labels) if cl == c]
        k = len(members)
        denominator += k * (k - 1)
        for t in range(k):
            for s in range(t + 1, k):
                reg += math.sqrt(2 + 1e-5 - 2 * _cos(members[t], members[s]))
    return value + (tau * reg / denominator if denominator else 0.0)


# ----------------------------------------------------------------- strategies


@st.composite
def batches(draw, d=3, n_classes=(2, 4), per_class=(2, 3)):
    n = draw(st.integers(*n_classes))
    labels = draw(rst.labels(n, per_class))
    x = draw(rst.points_in_unit_ball(labels.size, d, min_radius=0.1))
    return x, labels


REDUCTIONS = st.sampled_from(["mean", "mean_nonzero", "sum"])


def _assume_well_separated(x):
    # ||x_i - x_j|| has curvature 1 / d: near d = 0 the central-difference error grows
    # like (step / d)^2, so gradient checks of Euclidean losses need d >> step ~ 6e-6.
    d = np.linalg.norm(x[:, None] - x[None, :], axis=-1)[np.triu_indices(len(x), k=1)]
    assume(d.size == 0 or d.min() > 1e-2)


def _assume_value_comparable(gap, reduction):
    # The count of non-zero terms jumps where a term crosses 0, so a rounding difference
    # at a kink changes the "mean_nonzero" value; the other reductions are continuous.
    if reduction == "mean_nonzero":
        assume(gap > KINK)


def _gradcheck(loss, inputs, **hyper):
    """Finite differences of the pair ``<loss>_forward`` / ``<loss>_backward`` with a random
    upstream ``d_value``, on batches and reductions beyond the catalogue's fixed entries."""
    forward = getattr(losses, f"{loss.__name__}_forward")
    backward = getattr(losses, f"{loss.__name__}_backward")

    def wrapped(**kw):
        return forward(**kw, **hyper)

    result = check_gradients(wrapped, backward, inputs, rng=0)
    assert_gradients(result, rtol=1e-6)
    return result


def _fixed_batch(seed, n_per_class=(3, 2, 3, 2), d=4, scale=0.5):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(len(n_per_class)), n_per_class)
    return scale * rng.standard_normal((labels.size, d)), labels


# ------------------------------------------------------------------ contrastive


@given(batches(), REDUCTIONS, st.sampled_from([(0.0, 0.6), (0.2, 0.9), (0.2652, 0.5409)]))
def test_contrastive_euclidean_matches_loop_and_gradcheck(batch, reduction, margins):
    x, y = batch
    expected, gap = contrastive_loop(x, y, *margins, "euclidean", reduction)
    _assume_value_comparable(gap, reduction)
    value, grads = losses.contrastive(x, y, pos_margin=margins[0], neg_margin=margins[1], reduction=reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-15)
    assert grads.embeddings.shape == x.shape
    # With m+ = 0 the positive term is d itself: keep positive pairs off d = 0 as well.
    assume(gap > KINK)
    _assume_well_separated(x)
    _gradcheck(losses.contrastive, {"embeddings": x, "labels": y},
               pos_margin=margins[0], neg_margin=margins[1], reduction=reduction)


@given(batches(d=4), REDUCTIONS)
def test_contrastive_cosine_matches_loop_and_gradcheck(batch, reduction):
    x, y = batch
    expected, gap = contrastive_loop(x, y, 1.0, 0.5, "cosine", reduction)
    _assume_value_comparable(gap, reduction)
    value, _ = losses.contrastive(x, y, form="cosine", reduction=reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-15)
    assume(gap > KINK)
    _gradcheck(losses.contrastive, {"embeddings": x, "labels": y}, form="cosine", reduction=reduction)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("form", ["euclidean", "cosine"])
def test_contrastive_fixed_seeds(seed, form):
    x, y = _fixed_batch(seed)
    pos, neg = (0.2, 0.9) if form == "euclidean" else (0.8, 0.1)
    expected, gap = contrastive_loop(x, y, pos, neg, form, "mean")
    assert gap > KINK
    value, _ = losses.contrastive(x, y, pos_margin=pos, neg_margin=neg, form=form)
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    _gradcheck(losses.contrastive, {"embeddings": x, "labels": y}, pos_margin=pos, neg_margin=neg, form=form)


def test_contrastive_defaults_are_the_documented_margins():
    x, y = _fixed_batch(3)
    np.testing.assert_allclose(losses.contrastive(x, y)[0], contrastive_loop(x, y, 0.0, 0.3841, "euclidean", "mean")[0], rtol=1e-12)
    np.testing.assert_allclose(losses.contrastive(x, y, form="cosine")[0], contrastive_loop(x, y, 1.0, 0.5, "cosine", "mean")[0], rtol=1e-12)


def test_contrastive_cosine_gradient_matches_xbm_official_form():
    # XBM's code: per anchor, sum_{pos} (1 - s) + sum_{neg, s > 0.5} s, averaged over the
    # n anchors. Its gradient equals ours with reduction="sum" scaled by 2 / n (ordered
    # pairs count each unordered pair twice); checked by finite differences of that code.
    x, y = _fixed_batch(4, d=3, scale=1.0)
    n = len(x)

    def xbm(emb):
        total = 0.0
        for i in range(n):
            for j in range(n):
                if i == j:
                    continue
                s = _cos(emb[i], emb[j])
                total += (1 - s) if y[i] == y[j] else (s if s > 0.5 else 0.0)
        return total / n

    _, grads = losses.contrastive(x, y, form="cosine", reduction="sum")
    h = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        fd[idx] = (xbm(xp) - xbm(xm)) / (2 * h)
    np.testing.assert_allclose(2.0 / n * grads.embeddings, fd, rtol=1e-6, atol=1e-8)


def test_contrastive_zero_distance_positive_pair_has_finite_gradient():
    x = np.array([[0.1, 0.2], [0.1, 0.2], [1.0, -1.0]])
    value, grads = losses.contrastive(x, [0, 0, 1], neg_margin=0.5)
    # The coincident pair contributes d = 0 with the subgradient 0; the negatives are
    # farther than the margin: value 0, gradient exactly 0.
    assert value == 0.0
    np.testing.assert_array_equal(grads.embeddings, np.zeros_like(x))


# ----------------------------------------------------- generalized contrastive


@given(batches(), REDUCTIONS, st.sampled_from([(0.1, 0.4), (0.3, 0.6), (0.2, 0.2)]))
def test_generalized_contrastive_matches_loop_and_gradcheck(batch, reduction, ab):
    x, y = batch
    alpha, beta = ab
    expected, gap = generalized_contrastive_loop(x, y, alpha, beta, reduction)
    _assume_value_comparable(gap, reduction)
    value, _ = losses.generalized_contrastive(x, y, alpha=alpha, beta=beta, reduction=reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-15)
    assume(gap > KINK)
    _assume_well_separated(x)
    _gradcheck(losses.generalized_contrastive, {"embeddings": x, "labels": y},
               alpha=alpha, beta=beta, reduction=reduction)


def test_generalized_contrastive_bounds_the_violation_probability():
    # ASAP Eq. (4.2): P(iota (d - beta) >= 0) <= E[(iota (d - beta) + alpha)_+] / alpha,
    # checked on the empirical pair distribution of a batch.
    x, y = _fixed_batch(5, n_per_class=(5, 5, 5, 5))
    alpha, beta = 0.3, 0.7
    value, _ = losses.generalized_contrastive(x, y, alpha=alpha, beta=beta)
    rows, cols = np.triu_indices(len(x), k=1)
    d = np.linalg.norm(x[rows] - x[cols], axis=1)
    iota = np.where(y[rows] == y[cols], 1.0, -1.0)
    violation = np.mean(iota * (d - beta) >= 0)
    assert 0.0 < violation <= value / alpha


# ----------------------------------------------------------------------- triplet


@given(batches(), REDUCTIONS, st.sampled_from(["all", "batch_hard"]))
def test_triplet_matches_loop_and_gradcheck(batch, reduction, mining):
    x, y = batch
    expected, gap = triplet_loop(x, y, 0.3, mining, reduction)
    _assume_value_comparable(gap, reduction)
    value, _ = losses.triplet(x, y, margin=0.3, mining=mining, reduction=reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-12, atol=1e-15)
    assume(gap > KINK)
    _assume_well_separated(x)
    _gradcheck(losses.triplet, {"embeddings": x, "labels": y}, margin=0.3, mining=mining, reduction=reduction)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mining", ["all", "batch_hard"])
def test_triplet_fixed_seeds(seed, mining):
    x, y = _fixed_batch(seed)
    expected, gap = triplet_loop(x, y, 0.4, mining, "mean")
    assert gap > KINK
    np.testing.assert_allclose(losses.triplet(x, y, margin=0.4, mining=mining)[0], expected, rtol=1e-12)
    _gradcheck(losses.triplet, {"embeddings": x, "labels": y}, margin=0.4, mining=mining)


def test_triplet_reductions_relate_by_counts():
    x, y = _fixed_batch(7)
    # Valid triplets: per anchor (class size - 1) positives times (10 - class size) negatives.
    sizes = np.array([3, 3, 3, 2, 2, 3, 3, 3, 2, 2])
    n_triplets = int(np.sum((sizes - 1) * (10 - sizes)))
    total, _ = losses.triplet(x, y, margin=0.4, reduction="sum")
    mean, _ = losses.triplet(x, y, margin=0.4, reduction="mean")
    np.testing.assert_allclose(mean * n_triplets, total, rtol=1e-13)


# --------------------------------------------------------------- multi-similarity


@given(batches(d=4, n_classes=(2, 3), per_class=(2, 4)), REDUCTIONS,
       st.sampled_from([(2.0, 40.0, 0.5, 0.1), (2.0, 10.0, 0.5, 0.4), (8.49, 57.38, 0.41, 0.1)]))
def test_multi_similarity_matches_loop_and_gradcheck(batch, reduction, hyper):
    x, y = batch
    alpha, beta, base, eps = hyper
    expected, gap = multi_similarity_loop(x, y, alpha, beta, base, eps, reduction)
    # The mined sets jump at their thresholds: compare values only away from them.
    assume(gap > KINK)
    value, _ = losses.multi_similarity(x, y, alpha=alpha, beta=beta, base=base,
                                       mining_margin=eps, reduction=reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-11, atol=1e-15)
    assume(gap > KINK)
    # beta = 57 magnifies the curvature: relative error ~ h^2 * beta^2; still < 1e-6.
    _gradcheck(losses.multi_similarity, {"embeddings": x, "labels": y}, alpha=alpha, beta=beta,
               base=base, mining_margin=eps, reduction=reduction)


@pytest.mark.parametrize("seed", [0, 1])
def test_multi_similarity_fixed_seeds(seed):
    x, y = _fixed_batch(seed)
    expected, gap = multi_similarity_loop(x, y, 2.0, 40.0, 0.5, 0.3, "mean")
    assert gap > KINK
    np.testing.assert_allclose(losses.multi_similarity(x, y, mining_margin=0.3)[0], expected, rtol=1e-12)
    _gradcheck(losses.multi_similarity, {"embeddings": x, "labels": y}, mining_margin=0.3)


# ------------------------------------------------------------------ proxy losses


def _proxy_batch(seed, absent_class=True):
    rng = np.random.default_rng(seed)
    labels = np.array([0, 0, 1, 1, 1, 2, 0, 2])
    # Class 3 has proxies but no embedding in the batch when absent_class is set.
    proxy_labels = np.array([0, 1, 2, 3, 0, 2]) if absent_class else np.array([0, 1, 2, 0])
    return rng.standard_normal((labels.size, 4)), labels, rng.standard_normal((proxy_labels.size, 4)), proxy_labels


PROXY_CASES = [
    (losses.proxy_anchor, proxy_anchor_loop, {"delta": 0.1, "alpha": 32.0}),
    (losses.proxy_anchor, proxy_anchor_loop, {"delta": 0.2, "alpha": 4.0}),
    (losses.proxy_nca, proxy_nca_loop, {"temperature": 0.11}),
    (losses.proxy_nca, proxy_nca_loop, {"temperature": 1.0}),
    (losses.soft_triple, soft_triple_loop, {"lambda_": 20.0, "gamma": 0.1, "tau": 0.2, "delta": 0.01}),
    (losses.soft_triple, soft_triple_loop, {"lambda_": 5.0, "gamma": 0.5, "tau": 1.0, "delta": 0.3}),
]
PROXY_IDS = ["pa-paper", "pa-soft", "nca-paper", "nca-T1", "st-paper", "st-soft"]


@pytest.mark.parametrize(("loss", "oracle", "hyper"), PROXY_CASES, ids=PROXY_IDS)
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
@pytest.mark.parametrize("seed", [0, 1])
def test_proxy_losses_match_loop_and_gradcheck(loss, oracle, hyper, reduction, seed):
    x, y, p, pl = _proxy_batch(seed)
    value, grads = loss(x, y, proxies=p, proxy_labels=pl, reduction=reduction, **hyper)
    expected = oracle(x, y, p, pl, *hyper.values(), reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-11)
    assert grads.embeddings.shape == x.shape and grads.proxies.shape == p.shape
    _gradcheck(loss, {"embeddings": x, "labels": y, "proxies": p},
               proxy_labels=pl, reduction=reduction, **hyper)


@given(data=st.data())
@pytest.mark.parametrize(("loss", "oracle", "hyper"), PROXY_CASES[1::2], ids=PROXY_IDS[1::2])
def test_proxy_losses_hypothesis(loss, oracle, hyper, data):
    x, y = data.draw(batches(d=4, n_classes=(2, 4), per_class=(1, 3)))
    n_classes = int(y.max()) + 1
    per_class = data.draw(st.integers(1, 3))
    pl = np.repeat(np.arange(n_classes), per_class)
    p = data.draw(rst.points_on_sphere(pl.size, 4)) * data.draw(st.floats(0.5, 2.0))
    value, _ = loss(x, y, proxies=p, proxy_labels=pl, **hyper)
    np.testing.assert_allclose(value, oracle(x, y, p, pl, *hyper.values(), "mean"), rtol=1e-11)
    _gradcheck(loss, {"embeddings": x, "labels": y, "proxies": p}, proxy_labels=pl, **hyper)


@pytest.mark.parametrize(("loss", "oracle", "hyper"), PROXY_CASES[::2], ids=PROXY_IDS[::2])
def test_proxy_losses_normalise_inside(loss, oracle, hyper):
    x, y, p, pl = _proxy_batch(2)
    v1, g1 = loss(x, y, proxies=p, proxy_labels=pl, **hyper)
    v2, g2 = loss(3.0 * x, y, proxies=0.5 * p, proxy_labels=pl, **hyper)
    np.testing.assert_allclose(v2, v1, rtol=1e-12)
    # Scale invariance: the gradient scales with the inverse of the input scale.
    np.testing.assert_allclose(3.0 * g2.embeddings, g1.embeddings, rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(0.5 * g2.proxies, g1.proxies, rtol=1e-10, atol=1e-14)


# ---------------------------------------------- pair losses between samples and proxies

SAMPLE_PROXY_CASES = [
    (losses.proxy_contrastive, proxy_contrastive_loop,
     {"pos_margin": 0.0, "neg_margin": 0.3841, "form": "euclidean"}),
    (losses.proxy_contrastive, proxy_contrastive_loop,
     {"pos_margin": 0.9, "neg_margin": 1.5, "form": "euclidean"}),
    (losses.proxy_contrastive, proxy_contrastive_loop,
     {"pos_margin": 0.6, "neg_margin": -0.1, "form": "cosine"}),
    (losses.proxy_multi_similarity, proxy_multi_similarity_loop,
     {"alpha": 2.0, "beta": 40.0, "base": 0.5, "mining_margin": 0.1}),
    (losses.proxy_multi_similarity, proxy_multi_similarity_loop,
     {"alpha": 4.0, "beta": 10.0, "base": 0.2, "mining_margin": 0.5}),
]
SAMPLE_PROXY_IDS = ["c2-paper", "c2-wide", "c1", "ms-paper", "ms-soft"]


@pytest.mark.parametrize(("loss", "oracle", "hyper"), SAMPLE_PROXY_CASES, ids=SAMPLE_PROXY_IDS)
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
@pytest.mark.parametrize("seed", [0, 1])
def test_sample_proxy_losses_match_loop_and_gradcheck(loss, oracle, hyper, reduction, seed):
    x, y, p, pl = _proxy_batch(seed)
    value, grads = loss(x, y, proxies=p, proxy_labels=pl, reduction=reduction, **hyper)
    expected, gap = oracle(x, y, p, pl, *hyper.values(), reduction)
    np.testing.assert_allclose(value, expected, rtol=1e-11)
    assert grads.embeddings.shape == x.shape and grads.proxies.shape == p.shape
    # The fixed batches are away from every hinge and mining threshold (a precondition of
    # central differences, step ~ 6e-6 |x|).
    assert gap > KINK, gap
    _gradcheck(loss, {"embeddings": x, "labels": y, "proxies": p},
               proxy_labels=pl, reduction=reduction, **hyper)


@given(data=st.data())
@pytest.mark.parametrize(("loss", "oracle", "hyper"), SAMPLE_PROXY_CASES, ids=SAMPLE_PROXY_IDS)
def test_sample_proxy_losses_hypothesis(loss, oracle, hyper, data):
    x, y = data.draw(batches(d=4, n_classes=(2, 4), per_class=(1, 3)))
    n_classes = int(y.max()) + 1
    per_class = data.draw(st.integers(1, 3))
    pl = np.repeat(np.arange(n_classes), per_class)
    p = data.draw(rst.points_on_sphere(pl.size, 4)) * data.draw(st.floats(0.5, 2.0))
    reduction = data.draw(REDUCTIONS)
    expected, gap = oracle(x, y, p, pl, *hyper.values(), reduction)
    assume(gap > KINK)
    value, _ = loss(x, y, proxies=p, proxy_labels=pl, reduction=reduction, **hyper)
    np.testing.assert_allclose(value, expected, rtol=1e-11)
    _gradcheck(loss, {"embeddings": x, "labels": y, "proxies": p}, proxy_labels=pl,
               reduction=reduction, **hyper)


def test_sample_proxy_defaults_are_the_papers_cub_values():
    x, y, p, pl = _proxy_batch(0)
    value, _ = losses.proxy_contrastive(x, y, proxies=p, proxy_labels=pl)
    expected, _ = proxy_contrastive_loop(x, y, p, pl, 0.0, 0.3841, "euclidean", "mean")
    np.testing.assert_allclose(value, expected, rtol=1e-11)
    value, _ = losses.proxy_multi_similarity(x, y, proxies=p, proxy_labels=pl)
    expected, _ = proxy_multi_similarity_loop(x, y, p, pl, 2.0, 40.0, 0.5, 0.1, "mean")
    np.testing.assert_allclose(value, expected, rtol=1e-11)


def test_proxy_contrastive_mean_is_over_every_sample_proxy_pair():
    # Eq. (4.11)'s 1 / (m |rho|): the mean is the sum over all n * n_proxies pairs divided
    # by their number, whether or not a term is active.
    x, y, p, pl = _proxy_batch(1)
    total, _ = losses.proxy_contrastive(x, y, proxies=p, proxy_labels=pl, reduction="sum")
    mean, _ = losses.proxy_contrastive(x, y, proxies=p, proxy_labels=pl)
    np.testing.assert_allclose(mean, total / (x.shape[0] * p.shape[0]), rtol=1e-14)


def test_proxy_contrastive_at_a_proxy_takes_the_subgradient_zero():
    # A sample exactly on its own proxy with m+ = 0: d = 0, where the distance has the unit
    # ball as subdifferential; the reference takes 0 (as euclidean_backward). Next to the
    # proxy the gradient stays finite, each active pair's share of norm <= 1 / |x|.
    x, y, p, pl = _proxy_batch(0)
    x = np.array(x)
    own = np.flatnonzero(pl == y[0])
    x[0] = p[own[0]]
    _, ctx = losses.proxy_contrastive_forward(x, y, proxies=p, proxy_labels=pl, neg_margin=0.01)
    assert ctx.d_similarity[0, own[0]] == 0.0
    x[0] = p[own[0]] + 1e-9 * np.eye(4)[0]
    _, grads = losses.proxy_contrastive(x, y, proxies=p, proxy_labels=pl, neg_margin=0.01,
                                        reduction="sum")
    assert np.all(np.isfinite(grads.embeddings)) and np.all(np.isfinite(grads.proxies))
    # neg_margin 0.01: no negative is active; m+ = 0: every own-class proxy is.
    assert np.linalg.norm(grads.embeddings[0]) <= own.size / np.linalg.norm(x[0]) * (1 + 1e-9)


def test_proxy_multi_similarity_without_negatives_has_no_term():
    x, y, p, _ = _proxy_batch(0)
    value, grads = losses.proxy_multi_similarity(x, np.zeros_like(y), proxies=p,
                                                 proxy_labels=np.zeros(p.shape[0], dtype=int))
    assert value == 0.0
    assert not np.any(grads.embeddings) and not np.any(grads.proxies)


def test_default_proxy_labels_are_one_per_class():
    x, y, p, _ = _proxy_batch(0, absent_class=False)
    p = p[:3]
    for loss in (losses.proxy_anchor, losses.proxy_nca, losses.soft_triple):
        explicit, _ = loss(x, y, proxies=p, proxy_labels=[0, 1, 2])
        implicit, _ = loss(x, y, proxies=p)
        assert implicit == explicit


def test_proxy_anchor_is_stable_at_large_alpha():
    # alpha = 32 with similarities near 1: exp(35) terms must not overflow into inf/NaN.
    x = np.array([[1.0, 0.0], [0.999, 0.04], [0.0, 1.0]])
    p = np.array([[0.0, 1.0], [1.0, 0.01]])
    value, grads = losses.proxy_anchor(x, [1, 1, 0], proxies=p, alpha=320.0)
    expected = proxy_anchor_loop(x, [1, 1, 0], p, [0, 1], 0.1, 320.0, "mean")
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    assert np.all(np.isfinite(grads.embeddings)) and np.all(np.isfinite(grads.proxies))


def test_soft_triple_one_center_per_class_has_no_regulariser():
    x, y, p, _ = _proxy_batch(1, absent_class=False)
    with_tau, _ = losses.soft_triple(x, y, proxies=p[:3], tau=5.0)
    without, _ = losses.soft_triple(x, y, proxies=p[:3], tau=0.0)
    np.testing.assert_allclose(with_tau, without, rtol=1e-15)


# ------------------------------------------------- degenerate batches and API


_PAIR_LOSSES = [
    (losses.contrastive, {}),
    (losses.contrastive, {"form": "cosine"}),
    (losses.generalized_contrastive, {"alpha": 0.1, "beta": 0.5}),
]
_ANCHOR_LOSSES = [
    (losses.triplet, {}),
    (losses.triplet, {"mining": "batch_hard"}),
    (losses.multi_similarity, {}),
]
# A single sample: no pair at all. All-distinct labels: no positive, hence no triplet and
# no multi-similarity anchor. One class: no negative, the same. (Pair losses have terms in
# the last two cases: see test_pair_losses_without_positive_pair_sum_their_negative_terms.)
_DEGENERATE = (
    [(loss, kw, [7]) for loss, kw in _PAIR_LOSSES + _ANCHOR_LOSSES]
    + [(loss, kw, labels) for loss, kw in _ANCHOR_LOSSES for labels in ([0, 1, 2, 3], [5, 5, 5, 5])]
)


@pytest.mark.parametrize("loss,kwargs,labels", _DEGENERATE)
def test_no_valid_pair_or_triplet_gives_zero_not_nan(loss, kwargs, labels):
    x = np.random.default_rng(0).standard_normal((len(labels), 3))
    value, grads = loss(x, labels, **kwargs)
    assert value == 0.0
    np.testing.assert_array_equal(grads.embeddings, np.zeros_like(x))


def test_forward_backward_compose_with_upstream_gradient():
    x, y = _fixed_batch(0)
    p = np.random.default_rng(9).standard_normal((4, 4))
    for name, kwargs in [("contrastive", {}), ("triplet", {}), ("multi_similarity", {}),
                         ("generalized_contrastive", {"alpha": 0.2, "beta": 0.5}),
                         ("proxy_anchor", {"proxies": p}), ("proxy_nca", {"proxies": p}),
                         ("soft_triple", {"proxies": p})]:
        forward = getattr(losses, f"{name}_forward")
        backward = getattr(losses, f"{name}_backward")
        value, ctx = forward(x, y, **kwargs)
        full_value, full_grads = getattr(losses, name)(x, y, **kwargs)
        assert value == full_value
        scaled = backward(ctx, 2.5)
        np.testing.assert_allclose(scaled.embeddings, 2.5 * full_grads.embeddings, rtol=1e-13, atol=1e-16)


@pytest.mark.parametrize("call, match", [
    (lambda x: losses.contrastive(x, [0, 0, 1]), "labels has length 3"),
    (lambda x: losses.contrastive(np.where(np.eye(4, 3) > 0, np.nan, x), [0, 0, 1, 1]), "embeddings must be finite"),
    (lambda x: losses.contrastive(x, [0, 0, 1, 1], neg_margin=0.0), "neg_margin == 0.0"),
    (lambda x: losses.contrastive(x, [0, 0, 1, 1], pos_margin=-0.1), "pos_margin == -0.1"),
    (lambda x: losses.contrastive(x, [0, 0, 1, 1], form="cosine", neg_margin=1.5), "neg_margin == 1.5"),
    (lambda x: losses.contrastive(x, [0, 0, 1, 1], form="manhattan"), "form == 'manhattan'"),
    (lambda x: losses.contrastive(x, [0, 0, 1, 1], reduction="max"), "reduction == 'max'"),
    (lambda x: losses.generalized_contrastive(x, [0, 0, 1, 1], alpha=0.0, beta=0.5), "alpha == 0.0"),
    (lambda x: losses.generalized_contrastive(x, [0, 0, 1, 1], alpha=0.5, beta=0.2), "beta == 0.2"),
    (lambda x: losses.triplet(x, [0, 0, 1, 1], margin=0.0), "margin == 0.0"),
    (lambda x: losses.triplet(x, [0, 0, 1, 1], mining="semi_hard"), "mining == 'semi_hard'"),
    (lambda x: losses.multi_similarity(x, [0, 0, 1, 1], beta=-1.0), "beta == -1.0"),
    (lambda x: losses.proxy_anchor(x, [0, 0, 1, 1], proxies=np.ones((2, 2))), "proxies have dimension 2"),
    (lambda x: losses.proxy_nca(x, [0, 0, 1, 2], proxies=np.ones((2, 3))), "class 2, which no proxy"),
    (lambda x: losses.proxy_nca(x, [0, 0, 1, 1], proxies=np.ones((2, 3)), temperature=0.0), "temperature == 0.0"),
    (lambda x: losses.soft_triple(x, [0, 0, 1, 1], proxies=np.ones((2, 3)), proxy_labels=[0]), "proxy_labels has length 1"),
    (lambda x: losses.soft_triple(x, [0, 0, 1, 1], proxies=np.ones((2, 3)), gamma=0.0), "gamma == 0.0"),
    (lambda x: losses.multi_similarity(np.vstack([x[:3], np.zeros(3)]), [0, 0, 1, 1]), "embeddings has a zero vector at row 3"),
    (lambda x: losses.proxy_anchor(x, [0, 0, 1, 1], proxies=np.zeros((2, 3))), "proxies has a zero vector at row 0"),
    (lambda x: losses.triplet(x[0], [0, 0, 1]), "embeddings must have 2 dimensions"),
])
def test_invalid_input_raises_value_error_naming_the_parameter(call, match):
    x = np.random.default_rng(0).standard_normal((4, 3))
    with pytest.raises(ValueError, match=match):
        call(x)


def test_wrong_types_raise_type_error():
    x = np.ones((2, 3))
    with pytest.raises(TypeError, match="labels must hold integer labels"):
        losses.contrastive(x, [0.5, 1.0])
    with pytest.raises(TypeError, match="margin must be a real number"):
        losses.triplet(x, [0, 1], margin="0.1")
    with pytest.raises(TypeError):
        losses.contrastive(x, [0, 1], 0.1)  # hyperparameters are keyword-only


@pytest.mark.parametrize("name", sorted(losses.PAPER_HYPERPARAMETERS))
def test_paper_hyperparameters_are_accepted_and_match_the_oracles(name):
    # Every dataset's published setting runs, is finite, and agrees with the loop oracle.
    x, y, p, pl = _proxy_batch(0)
    for dataset, hyper in losses.PAPER_HYPERPARAMETERS[name].items():
        if name.startswith("contrastive"):
            value, grads = losses.contrastive(x, y, **hyper)
            expected = contrastive_loop(x, y, hyper["pos_margin"], hyper["neg_margin"],
                                        hyper.get("form", "euclidean"), "mean")[0]
        elif name == "triplet":
            value, grads = losses.triplet(x, y, **hyper)
            expected = triplet_loop(x, y, hyper["margin"], "all", "mean")[0]
        elif name == "multi_similarity":
            value, grads = losses.multi_similarity(x, y, **hyper)
            expected = multi_similarity_loop(x, y, hyper["alpha"], hyper["beta"], hyper["base"], 0.1, "mean")[0]
        else:
            value, grads = getattr(losses, name)(x, y, proxies=p, proxy_labels=pl, **hyper)
            oracle = {"proxy_anchor": proxy_anchor_loop, "proxy_nca": proxy_nca_loop,
                      "soft_triple": soft_triple_loop}[name]
            expected = oracle(x, y, p, pl, *hyper.values(), "mean")
        np.testing.assert_allclose(value, expected, rtol=1e-11, err_msg=dataset)
        assert np.all(np.isfinite(grads.embeddings)), dataset


# ------------------------------------------------ batches without a positive pair


def _negative_term(x, i, j, form, neg_margin):
    if form == "euclidean":
        return max(neg_margin - _dist(x[i], x[j]), 0.0)
    return max(_cos(x[i], x[j]) - neg_margin, 0.0)


def _positive_term(x, i, j, form, pos_margin):
    if form == "euclidean":
        return max(_dist(x[i], x[j]) - pos_margin, 0.0)
    return max(pos_margin - _cos(x[i], x[j]), 0.0)


@pytest.mark.parametrize("form, pos, neg", [("euclidean", 0.1, 0.9), ("cosine", 0.8, 0.1)])
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
def test_pair_losses_without_positive_pair_sum_their_negative_terms(form, pos, neg, reduction):
    x = 0.4 * np.random.default_rng(11).standard_normal((6, 3))
    distinct = np.arange(6)
    value, grads = losses.contrastive(x, distinct, pos_margin=pos, neg_margin=neg, form=form,
                                      reduction=reduction)
    expected, gap = contrastive_loop(x, distinct, pos, neg, form, reduction)
    assert gap > KINK and expected > 0.0       # some negative terms are active
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    assert np.any(grads.embeddings != 0.0)
    if reduction == "sum":
        # Exactly as when one positive pair appears: relabelling pair (0, 1) as positive
        # swaps its negative term for its positive term and changes nothing else.
        one_positive = np.array([0, 0, 2, 3, 4, 5])
        with_positive, _ = losses.contrastive(x, one_positive, pos_margin=pos, neg_margin=neg,
                                              form=form, reduction="sum")
        swapped = value - _negative_term(x, 0, 1, form, neg) + _positive_term(x, 0, 1, form, pos)
        np.testing.assert_allclose(with_positive, swapped, rtol=1e-12)


def test_generalized_contrastive_without_positive_pair_sums_its_negative_terms():
    x = 0.4 * np.random.default_rng(12).standard_normal((5, 3))
    value, _ = losses.generalized_contrastive(x, np.arange(5), alpha=0.3, beta=0.6)
    expected, _ = generalized_contrastive_loop(x, np.arange(5), 0.3, 0.6, "mean")
    assert expected > 0.0
    np.testing.assert_allclose(value, expected, rtol=1e-12)


# ------------------------------------------------------------------ extreme scales


SCALES = [1e-300, 1e-150, 1e150, 1e300]


def contrastive_grad_loop(x, y, pos_margin, neg_margin):
    """d/dx of the mean Euclidean contrastive loss: +-(x_i - x_j) / d_ij per active pair."""
    n, g = len(x), np.zeros_like(x)
    for i in range(n):
        for j in range(i + 1, n):
            d = _dist(x[i], x[j])
            unit = np.array([(u - v) / d for u, v in zip(x[i], x[j])])
            if y[i] == y[j] and d - pos_margin > 0:
                g[i] += unit
                g[j] -= unit
            elif y[i] != y[j] and neg_margin - d > 0:
                g[i] -= unit
                g[j] += unit
    return g / (n * (n - 1) / 2)


def triplet_grad_loop(x, y, margin, mining):
    """d/dx of the mean triplet loss, triplet by triplet."""
    n = len(x)
    d = [[_dist(x[i], x[j]) for j in range(n)] for i in range(n)]

    def unit(a, b):
        return np.array([(u - v) / d[a][b] for u, v in zip(x[a], x[b])])

    triplets = []
    for a in range(n):
        positives = [p for p in range(n) if p != a and y[p] == y[a]]
        negatives = [q for q in range(n) if y[q] != y[a]]
        if mining == "all":
            triplets += [(a, p, q) for p in positives for q in negatives]
        elif positives and negatives:
            triplets.append((a, max(positives, key=lambda p: d[a][p]),
                             min(negatives, key=lambda q: d[a][q])))
    g = np.zeros_like(x)
    for a, p, q in triplets:
        if d[a][p] - d[a][q] + margin > 0:
            g[a] += unit(a, p) - unit(a, q)
            g[p] -= unit(a, p)
            g[q] += unit(a, q)
    return g / len(triplets)


@pytest.mark.parametrize("scale", SCALES)
def test_euclidean_losses_are_right_at_extreme_scales(scale):
    x, y = _fixed_batch(0)
    x = scale * x
    value, grads = losses.contrastive(x, y, pos_margin=0.2, neg_margin=0.9)
    np.testing.assert_allclose(value, contrastive_loop(x, y, 0.2, 0.9, "euclidean", "mean")[0], rtol=1e-12)
    np.testing.assert_allclose(grads.embeddings, contrastive_grad_loop(x, y, 0.2, 0.9), rtol=1e-10, atol=1e-12)
    value, _ = losses.generalized_contrastive(x, y, alpha=0.3, beta=0.6)
    np.testing.assert_allclose(value, generalized_contrastive_loop(x, y, 0.3, 0.6, "mean")[0], rtol=1e-12)
    for mining in ("all", "batch_hard"):
        value, grads = losses.triplet(x, y, margin=0.4, mining=mining)
        np.testing.assert_allclose(value, triplet_loop(x, y, 0.4, mining, "mean")[0], rtol=1e-12)
        np.testing.assert_allclose(grads.embeddings, triplet_grad_loop(x, y, 0.4, mining), rtol=1e-10, atol=1e-12)
        assert np.all(np.isfinite(grads.embeddings))


def test_euclidean_losses_name_the_overflow_where_the_answer_is_not_representable():
    # One class of 10 points: 45 positive terms d_ij, each below 1.6e308, whose sum is not.
    x = 4e307 * np.random.default_rng(1).uniform(-1.0, 1.0, (10, 4))
    y = np.zeros(10, dtype=int)
    scaled_sum = math.fsum(_dist(a, b) / 1e300 for k, a in enumerate(x) for b in x[k + 1:])
    assert scaled_sum > 1.8e8
    # The mean is representable although the sum of the terms is not: right answer.
    value, _ = losses.contrastive(x, y, pos_margin=0.0, neg_margin=0.5)
    np.testing.assert_allclose(value, 1e300 * (scaled_sum / 45), rtol=1e-12)
    with pytest.raises(ValueError, match="exceeds the float64 range"):
        losses.contrastive(x, y, pos_margin=0.0, neg_margin=0.5, reduction="sum")
    # The top binade (|x| >= 2^1023 ~ 9e307) with representable distances: right answer.
    top = np.array([[1.7e308, 0.0], [1.7e308, 1e300], [1.6e308, 0.0], [1.6e308, 3e307]])
    for labels in ([0, 0, 1, 1], [0, 1, 2, 3]):
        value, grads = losses.contrastive(top, labels, pos_margin=0.0, neg_margin=0.5)
        np.testing.assert_allclose(value, contrastive_loop(top, labels, 0.0, 0.5, "euclidean", "mean")[0], rtol=1e-12)
        np.testing.assert_allclose(grads.embeddings, contrastive_grad_loop(top, labels, 0.0, 0.5), rtol=1e-10, atol=1e-12)
        value, _ = losses.triplet(top, [0, 0, 1, 1], margin=0.1)
        np.testing.assert_allclose(value, triplet_loop(top, [0, 0, 1, 1], 0.1, "all", "mean")[0], rtol=1e-12)
    # Distances beyond float64: a named error, never inf or NaN.
    far = np.array([[1.5e308, 0.0], [-1.5e308, 0.0], [0.0, 1.0]])
    for call in (lambda: losses.contrastive(far, [0, 0, 1]), lambda: losses.triplet(far, [0, 0, 1]),
                 lambda: losses.generalized_contrastive(far, [0, 0, 1], alpha=0.1, beta=0.2)):
        with pytest.raises(ValueError, match="embeddings has pairwise distances beyond"):
            call()


def _cosine_cases():
    x, y, p, pl = _proxy_batch(3)
    return [
        ("contrastive_cosine", lambda e, q: losses.contrastive(e, y, form="cosine", neg_margin=0.1), x, None),
        ("multi_similarity", lambda e, q: losses.multi_similarity(e, y, mining_margin=0.3), x, None),
        ("proxy_anchor", lambda e, q: losses.proxy_anchor(e, y, proxies=q, proxy_labels=pl), x, p),
        ("proxy_nca", lambda e, q: losses.proxy_nca(e, y, proxies=q, proxy_labels=pl), x, p),
        ("soft_triple", lambda e, q: losses.soft_triple(e, y, proxies=q, proxy_labels=pl), x, p),
        ("proxy_contrastive",
         lambda e, q: losses.proxy_contrastive(e, y, proxies=q, proxy_labels=pl, pos_margin=0.5,
                                               neg_margin=1.4), x, p),
        ("proxy_contrastive_cosine",
         lambda e, q: losses.proxy_contrastive(e, y, proxies=q, proxy_labels=pl, form="cosine",
                                               pos_margin=0.5, neg_margin=0.0), x, p),
        ("proxy_multi_similarity",
         lambda e, q: losses.proxy_multi_similarity(e, y, proxies=q, proxy_labels=pl,
                                                    mining_margin=0.5), x, p),
    ]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("case", _cosine_cases(), ids=lambda c: c[0])
def test_cosine_losses_are_scale_invariant_at_extreme_scales(case, scale):
    _, loss, x, p = case
    value, grads = loss(x, p)
    # Proxies at the reciprocal scale: embeddings and proxies are rescaled separately.
    p_scale = 1.0 / scale
    scaled_value, scaled = loss(scale * x, None if p is None else p_scale * p)
    np.testing.assert_allclose(scaled_value, value, rtol=1e-12)
    # The gradient of a scale-invariant loss scales as 1 / s.
    peak = np.max(np.abs(grads.embeddings))
    np.testing.assert_allclose(scale * scaled.embeddings, grads.embeddings, rtol=1e-9, atol=1e-12 * peak)
    if p is not None:
        peak = np.max(np.abs(grads.proxies))
        np.testing.assert_allclose(p_scale * scaled.proxies, grads.proxies, rtol=1e-9, atol=1e-12 * peak)


@pytest.mark.parametrize("case", _cosine_cases(), ids=lambda c: c[0])
def test_cosine_losses_are_invariant_to_each_rows_scale(case):
    # Rows from 1e-300 to 1e300 in one batch: each row is rescaled on its own.
    _, loss, x, p = case
    row = np.array(SCALES * 4)[: x.shape[0], None]
    value, grads = loss(x, p)
    scaled_value, scaled = loss(row * x, None if p is None else row[::-1][: p.shape[0]] * p)
    np.testing.assert_allclose(scaled_value, value, rtol=1e-12)
    np.testing.assert_allclose(row * scaled.embeddings, grads.embeddings, rtol=1e-9,
                               atol=1e-12 * np.max(np.abs(grads.embeddings)))


# ---------------------------------------------------------------------- bad input


def _all_forwards():
    x, y, p, pl = _proxy_batch(0)
    proxy = {"proxies": p, "proxy_labels": pl}
    return x, y, [
        ("contrastive", {}), ("generalized_contrastive", {"alpha": 0.2, "beta": 0.5}),
        ("triplet", {}), ("multi_similarity", {}), ("proxy_anchor", proxy),
        ("proxy_nca", proxy), ("soft_triple", proxy), ("proxy_contrastive", proxy),
        ("proxy_multi_similarity", proxy),
    ]


def test_every_loss_names_a_reduction_typo_and_a_wrong_label_length():
    x, y, cases = _all_forwards()
    for name, kwargs in cases:
        for fn in (getattr(losses, name), getattr(losses, f"{name}_forward")):
            with pytest.raises(ValueError, match=r"reduction == 'meen', must be one of"):
                fn(x, y, reduction="meen", **kwargs)
            with pytest.raises(ValueError, match=r"labels has length 7, .* \(one per embedding\)"):
                fn(x, y[:-1], **kwargs)
            with pytest.raises(TypeError, match="reduction must be one of"):
                fn(x, y, reduction=None, **kwargs)


def test_proxy_labels_length_has_its_own_message():
    x, y, p, pl = _proxy_batch(0)
    for loss in (losses.proxy_anchor, losses.proxy_nca, losses.soft_triple,
                 losses.proxy_contrastive, losses.proxy_multi_similarity):
        with pytest.raises(ValueError, match="proxy_labels has length 5, but there are 6 proxies") as info:
            loss(x, y, proxies=p, proxy_labels=pl[:-1])
        assert "embedding" not in str(info.value)


def test_every_backward_checks_its_context_and_upstream():
    x, y, cases = _all_forwards()
    contexts = {name: getattr(losses, f"{name}_forward")(x, y, **kw)[1] for name, kw in cases}
    for name, _ in cases:
        backward = getattr(losses, f"{name}_backward")
        ctx = contexts[name]
        reference = backward(ctx).embeddings
        # A scalar in any real form: Python float, NumPy scalar, 0-d array.
        for d_value in (2.0, np.float32(2.0), np.array(2.0), 2):
            np.testing.assert_allclose(backward(ctx, d_value).embeddings, 2.0 * reference, rtol=1e-15)
        for bad, match in ((np.nan, "d_value == nan"), (np.inf, "d_value == inf"),
                           (np.ones(1), r"d_value has shape \(1,\)"), (np.ones((1, 1)), "d_value has shape")):
            with pytest.raises(ValueError, match=match):
                backward(ctx, bad)
        for bad in ("1.0", None, True, 1j):
            with pytest.raises(TypeError, match="d_value"):
                backward(ctx, bad)
        with pytest.raises(TypeError, match="ctx must be the"):
            backward(object())
        with pytest.raises(TypeError, match="ctx must be the"):
            backward((1.0, ctx))
        # Another loss's context is refused; one of the same class names both forwards.
        for other, other_ctx in contexts.items():
            if other == name:
                continue
            same_class = type(other_ctx) is type(ctx)
            match = (rf"returned by {name}_forward, got the one returned by {other}_forward"
                     if same_class else "ctx must be the")
            with pytest.raises(TypeError, match=match):
                backward(other_ctx)


# ---------------------------------------------- issue 20: extreme hyperparameters, rows


_X4 = np.random.default_rng(50).standard_normal((8, 3))
_Y4 = np.array([0, 0, 1, 1, 2, 2, 3, 3])
_P4 = np.random.default_rng(51).standard_normal((4, 3))
_C8, _CL8 = np.random.default_rng(52).standard_normal((8, 3)), np.repeat(np.arange(4), 2)

# (call, message): hyperparameters whose logits, values or gradients leave float64 at
# |s| <= 1 are refused by name (before: RuntimeWarnings, NaN, or inf returned silently).
EXTREME_HYPERPARAMETERS = [
    (lambda m: m.multi_similarity(_X4, _Y4, alpha=1e-310), r"^alpha == 1e-310 is too small"),
    (lambda m: m.multi_similarity(_X4, _Y4, beta=5e-324), r"^beta == 5e-324 is too small"),
    (lambda m: m.proxy_nca(_X4, _Y4, proxies=_P4, temperature=1e-310),
     r"^temperature == 1e-310 is too small: .* at least 2.2\de-308"),
    (lambda m: m.proxy_anchor(_X4, _Y4, proxies=_P4, delta=1e308),
     r"^alpha == 32.0 with delta == 1e\+308: the Proxy-Anchor logits"),
    (lambda m: m.soft_triple(_X4, _Y4, proxies=_C8, proxy_labels=_CL8, gamma=1e-310),
     r"^gamma == 1e-310 is too small"),
    (lambda m: m.soft_triple(_X4, _Y4, proxies=_C8, proxy_labels=_CL8, lambda_=1e308),
     r"^lambda_ == 1e\+308 with delta == 0.01"),
    (lambda m: m.soft_triple(_X4, _Y4, proxies=_C8, proxy_labels=_CL8, tau=1e308),
     r"^the soft_triple loss or its gradient overflows float64 with .*tau == 1e\+308"),
    (lambda m: m.generalized_contrastive(_X4, _Y4, alpha=1e308, beta=1.7e308),
     r"^alpha \+ beta overflows float64 \(alpha == 1e\+308, beta == 1.7e\+308\)"),
    (lambda m: m.generalized_contrastive(_X4, _Y4, alpha=1.0, beta=0.5),
     r"^beta == 0.5, must be >= alpha == 1.0"),
    (lambda m: m.triplet(1e307 * _X4, _Y4, margin=1.7e308),
     r"^a triplet term d_ap - d_an \+ margin exceeds the float64 range: the margin is too large"),
    (lambda m: m.contrastive(_X4, _Y4, neg_margin=1.7e308, reduction="sum"),
     r"exceeds the float64 range: the margins are too large \(pos_margin == 0.0, neg_margin"),
]


@pytest.mark.parametrize("call, match", EXTREME_HYPERPARAMETERS)
def test_extreme_hyperparameters_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(losses)


@pytest.mark.parametrize("hyper", [{"alpha": 1e-300}, {"beta": 1e-300}])
def test_multi_similarity_at_tiny_alpha_beta_is_the_loop_value(hyper):
    # log(1 + sum exp(-alpha (s - base))) / alpha ~ log(1 + |P|) / alpha ~ 1e300: finite,
    # and the oracle's value (which forms exp and log directly, exact here).
    value, grads = losses.multi_similarity(_X4, _Y4, **hyper)
    kwargs = {"alpha": 2.0, "beta": 40.0, **hyper}
    expected = multi_similarity_loop(_X4, _Y4, kwargs["alpha"], kwargs["beta"], 0.5, 0.1, "mean")[0]
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    assert np.all(np.isfinite(grads.embeddings))


@pytest.mark.parametrize("loss, kwargs", [
    ("multi_similarity", {}),
    ("contrastive", {"form": "cosine"}),
    ("proxy_nca", {"proxies": _P4}),
    ("proxy_anchor", {"proxies": _P4}),
])
def test_cosine_gradients_of_subnormal_rows_are_named(loss, kwargs):
    # A cosine's gradient scales as 1 / ||row||: beyond float64 at rows of norm ~1e-310.
    x = _X4.copy()
    x[2] *= 1e-310
    value, ctx = getattr(losses, f"{loss}_forward")(x, _Y4, **kwargs)
    assert np.isfinite(value)
    with pytest.raises(ValueError, match=r"gradient with respect to embeddings overflows float64 "
                                         r"at row 2: a cosine's gradient scales as 1 / \|\|row\|\|"):
        getattr(losses, f"{loss}_backward")(ctx)
