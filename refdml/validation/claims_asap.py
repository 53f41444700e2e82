"""Checks of the claims of ASAP (deep metric learning with chance constraints).

Synthetic setting of the generalisation bounds: ``Z = [0, 1] x {0, 1}`` with ``x`` uniform
and the label a fair coin, the generalized contrastive loss of an identity embedding,
``l(z, z') = (iota (|x - x'| - beta) + alpha)_+`` with ``iota = +1`` for equal labels and
``-1`` otherwise: 1-Lipschitz in ``x`` and in ``x'`` (``zeta = 1``) and bounded by
``L = max(1 - beta, beta) + alpha``. Expectations over ``Z`` use a midpoint grid.

One self-contained check per claim of the paper, in the paper's order (see
:mod:`.claims_xml`); the bounds' synthetic setting above is shared by all of them.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import strategies as st

from refdml import kcenter as refdml_kcenter
from refdml.normalize import clip_normalize

from ._common import arrays, floats, jsonable_arrays
from ._framework import CORRECTION, PRINTED, Figure, Finding, Reading, claim, series

# --------------------------------------------------------------------------- Eq. (4.2)


@st.composite
def _pairs(draw, alpha_range, beta_range):
    k = draw(st.integers(1, 5))
    d = draw(arrays((k,), 0.0, 2.0))
    iota = np.array(draw(st.lists(st.sampled_from((-1.0, 1.0)), min_size=k, max_size=k)))
    return d, iota, draw(floats(*alpha_range)), draw(floats(*beta_range))


def _markov_excess(d, iota, alpha, beta) -> float:
    """P(iota (d - beta) >= 0) - (1/alpha) E[(iota (d - beta) + alpha)_+] on the empirical measure."""
    u = iota * (d - beta)
    return float(np.mean(u >= 0) - np.mean(np.maximum(u + alpha, 0.0)) / alpha)


@claim(
    "asap.eq4.2",
    paper="ASAP Eq. (4.2)",
    statement="For beta >= alpha > 0: P(iota (d_f - beta) >= 0) <= (1/alpha) E[(iota (d_f - beta) + alpha)_+] (Markov).",
    hypotheses="beta >= alpha > 0",
)
def check_eq_4_2(ctx) -> Finding:
    rng = ctx.rng("asap.eq4.2")
    f = rng.standard_normal((200, 2))
    labels = rng.integers(0, 3, 200)
    i, j = np.triu_indices(200, 1)
    d = np.linalg.norm(f[i] - f[j], axis=1)
    iota = np.where(labels[i] == labels[j], 1.0, -1.0)
    worst_in, worst_out, tight = -np.inf, -np.inf, []
    for alpha in (0.05, 0.2, 0.5, 1.0):
        for beta in (0.1, 0.5, 1.0, 2.0):
            excess = _markov_excess(d, iota, alpha, beta)
            if beta >= alpha:
                worst_in = max(worst_in, excess)
                tight.append(excess)
            else:
                worst_out = max(worst_out, excess)
    budget = ctx.pick(30, 100)
    cex = ctx.search(_pairs((0.01, 1.0), (0.0, 2.0)), lambda a: a[3] >= a[2] and _markov_excess(*a) > 1e-12,
                     max_examples=budget)
    beta_below = ctx.search(_pairs((0.01, 1.0), (0.0, 2.0)), lambda a: a[3] < a[2] and _markov_excess(*a) > 1e-12,
                            max_examples=budget)
    alpha_negative = ctx.search(_pairs((-1.0, -0.01), (0.0, 2.0)), lambda a: _markov_excess(*a) > 1e-12,
                                max_examples=budget)

    def as_json(c):
        return None if c is None else {**jsonable_arrays(d=c[0], iota=c[1]), "alpha": c[2], "beta": c[3],
                                       "excess": _markov_excess(*c)}

    return Finding(
        readings=(Reading(PRINTED, "Markov bound on the empirical and searched pair distributions", max(worst_in, 0.0), 1e-12,
                          as_json(cex), trials=budget),),
        key_number=f"max(LHS - RHS) = {worst_in:.2g} <= 0; beta < alpha: "
                   + ("counterexample" if beta_below else "no counterexample (hypothesis beta >= alpha not needed)"),
        sizes=[{"embeddings": 200, "pairs": int(d.size), "classes": 3}],
        seeds=[ctx.seed],
        details={"max_excess_inside": worst_in, "max_excess_beta_below_alpha": worst_out,
                 "search_beta_below_alpha": as_json(beta_below), "search_alpha_negative": as_json(alpha_negative),
                 "why": "pointwise 1(u >= 0) <= (u + alpha)_+ / alpha for every alpha > 0, whatever beta"},
        probe={"beta_below_alpha": as_json(beta_below), "alpha_negative": as_json(alpha_negative)},
    )


# --------------------------------------------------------------------------- Lemma 4.1


def _omega_row(W):  # the statement: "maximum sum of the input weights per neuron"
    return float(np.max(np.sum(np.abs(W), axis=1)))


def _omega_col(W):  # the proof: sum over i, j with s_i(j) = k, for every input k
    return float(np.max(np.sum(np.abs(W), axis=0)))


@st.composite
def _small_matrix(draw):
    r, c = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return draw(arrays((r, c), -1.0, 1.0))


def _maxpool(x, window, stride):
    return np.array([x[s : s + window].max() for s in range(0, len(x) - window + 1, stride)])


def _conv_matrix(kernel, length):
    """'valid' 1-d correlation as a dense (length - k + 1, length) matrix."""
    k = len(kernel)
    M = np.zeros((length - k + 1, length))
    for r in range(length - k + 1):
        M[r, r : r + k] = kernel
    return M


def _net_lipschitz(rng, layers, length, window, stride, samples):
    """Largest Jacobian norm found for conv -> ReLU -> maxpool -> ... -> FC (a lower bound of L)."""
    def forward(x):
        h = x
        for kind, param in layers:
            if kind == "lin":
                h = param @ h
            elif kind == "relu":
                h = np.maximum(h, 0.0)
            else:
                h = _maxpool(h, window, stride)
        return h

    best = 0.0
    for _ in range(samples):
        x = rng.standard_normal(length)
        step = 1e-6
        J = np.array([(forward(x + step * e) - forward(x - step * e)) / (2 * step) for e in np.eye(length)]).T
        best = max(best, float(np.linalg.norm(J, 2)))
    return best


@claim(
    "asap.lemma4.1",
    paper="ASAP Lemma 4.1 (App. B.1)",
    statement="The generalized contrastive loss is sqrt(2) omega^L-Lipschitz in (x, x') for an L-layer CNN (ReLU, "
              "max-pool, average-pool, final FC), omega the maximum sum of the (absolute) input weights per neuron; "
              "proof: |sum_j w_ij D_j|^2 <= sum_j |w_ij|^2 |D_j|^2, pooling 1-Lipschitz.",
    hypotheses="per layer, sum of |input weights| per neuron <= omega",
)
def check_lemma_4_1(ctx) -> Finding:
    rng = ctx.rng("asap.lemma4.1")
    budget = ctx.pick(30, 100)
    # The proof's inequality, with |.|^2 of a sum bounded by the sum of squares.
    step = ctx.search(st.tuples(arrays((2,), -1, 1), arrays((2,), -1, 1)),
                      lambda wd: np.sum(wd[0] * wd[1]) ** 2 > 1.5 * np.sum(wd[0] ** 2 * wd[1] ** 2) + 1e-12,
                      max_examples=budget)
    excess = {}
    cex = {}
    for name, omega in (("row", _omega_row), ("col", _omega_col),
                        ("schur", lambda W: np.sqrt(_omega_row(W)) * np.sqrt(_omega_col(W)))):
        found = ctx.search(_small_matrix(), lambda W, omega=omega: np.linalg.norm(W, 2) > omega(W) * (1 + 1e-12),
                           max_examples=budget)
        cex[name] = None if found is None else {"W": found.tolist(), "spectral_norm": float(np.linalg.norm(found, 2)),
                                                "omega": omega(found)}
        ratios = [np.linalg.norm(W, 2) / omega(W) for W in (rng.standard_normal((r, c)) for r in (2, 5, 20) for c in (2, 5, 20))]
        excess[name] = float(max(ratios))
    # Max-pooling: window 2, stride 1 (overlapping) vs stride 2; spike input against zero.
    spike = np.zeros(6)
    spike[2] = 1.0
    overlap = float(np.linalg.norm(_maxpool(spike, 2, 1) - _maxpool(np.zeros(6), 2, 1)))
    disjoint = max(np.linalg.norm(_maxpool(u, 2, 2) - _maxpool(v, 2, 2)) / np.linalg.norm(u - v)
                   for u, v in (rng.standard_normal((2, 6)) for _ in range(500)))
    # Small CNNs: conv (k=3) -> ReLU -> maxpool -> conv -> ReLU -> FC, L estimated from Jacobians.
    nets = []
    for window, stride in ((2, 1), (2, 2)):
        for trial in range(ctx.pick(2, 4)):
            length = 12
            k1, k2 = rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)  # non-negative weights: pooling overlap shows
            C1 = _conv_matrix(k1, length)
            pooled = (C1.shape[0] - window) // stride + 1
            C2 = _conv_matrix(k2, pooled)
            FC = rng.uniform(0, 1, (2, C2.shape[0]))
            layers = [("lin", C1), ("relu", None), ("pool", None), ("lin", C2), ("relu", None), ("lin", FC)]
            est = _net_lipschitz(rng, layers, length, window, stride, ctx.pick(10, 30))
            lin = [C1, C2, FC]
            printed = float(np.prod([_omega_row(W) for W in lin]))  # pooling counted as omega = 1
            pool_factor = np.sqrt(int(np.ceil(window / stride)))
            corrected = float(np.prod([np.sqrt(_omega_row(W) * _omega_col(W)) for W in lin])) * pool_factor
            nets.append({"window": window, "stride": stride, "L_estimate": est, "printed_bound": printed,
                         "corrected_bound": corrected})
    # Loss part: h(f, f') = ||f - f'|| is sqrt(2)-Lipschitz jointly.
    joint = max(abs(np.linalg.norm(f1 - g1) - np.linalg.norm(f2 - g2)) / np.linalg.norm(np.concatenate([f1 - f2, g1 - g2]))
                for f1, g1, f2, g2 in (rng.standard_normal((4, 3)) for _ in range(2000)))
    printed_violation = max([excess["row"] - 1, excess["col"] - 1, overlap - 1]
                            + [n["L_estimate"] / n["printed_bound"] - 1 for n in nets])
    corrected_violation = max([excess["schur"] - 1, disjoint - 1, joint / np.sqrt(2) - 1]
                              + [n["L_estimate"] / n["corrected_bound"] - 1 for n in nets])
    return Finding(
        readings=(
            Reading(PRINTED, "omega = max absolute input-weight sum per neuron (rows; the proof sums per input, "
                    "columns); max-pooling 1-Lipschitz", max(printed_violation, 0.0), 1e-9,
                    {"proof_step": None if step is None else {"w": step[0].tolist(), "D": step[1].tolist()},
                     "row_reading": cex["row"], "column_reading": cex["col"],
                     "overlapping_maxpool_spike_ratio": overlap}, trials=budget),
            Reading(CORRECTION, "per layer ||W||_2 <= sqrt(max row abs sum x max column abs sum) (Schur test); "
                    "max-pooling with window w and stride s is sqrt(ceil(w/s))-Lipschitz (1 when not overlapping); "
                    "then f is prod_l sqrt(r_l c_l) (x pooling factors)-Lipschitz and the loss sqrt(2) times that",
                    max(corrected_violation, 0.0), 1e-6, cex["schur"], trials=budget),
        ),
        key_number=f"||W||/omega up to {max(excess['row'], excess['col']):.2f} (row/col readings); "
                   f"overlapping max-pool ratio {overlap:.3f}; Schur bound holds",
        sizes=[{"matrices": "r, c in {2, 5, 20}"}, {"cnn_input_length": 12, "kernel": 3}],
        seeds=[ctx.seed],
        details={"max_spectral_over_omega_random": excess, "overlapping_maxpool_ratio": overlap,
                 "non_overlapping_maxpool_max_ratio": disjoint, "networks": nets,
                 "joint_norm_lipschitz_estimate": joint,
                 "loss_part": "h(f, f') = ||f - f'|| is sqrt(2)-Lipschitz jointly, the hinge 1-Lipschitz: as printed"},
    )


# --------------------------------------------------------------------------- Sec. 4.4 normalisation


@st.composite
def _vector_pair(draw):
    d = draw(st.integers(1, 3))
    return draw(arrays((d,), -3, 3)), draw(arrays((d,), -3, 3))


def _ratio(norm, u, v):
    gap = np.linalg.norm(u - v)
    return float(np.linalg.norm(norm(u) - norm(v)) / gap) if gap > 1e-9 else 0.0


@claim(
    "asap.sec4.4.normalisation",
    paper="ASAP Sec. 4.4 and App. B.1 (note after Lemma 4.1)",
    statement="The normalisation v_hat = v if ||v|| <= 1, v/||v|| otherwise, is 2-Lipschitz (unlike L2 normalisation, "
              "it is Lipschitz).",
    hypotheses="v in R^d",
    operators=("normalize.clip_normalize",),
)
def check_normalisation(ctx) -> Finding:
    rng = ctx.rng("asap.sec4.4.normalisation")
    inline = lambda v: v / max(1.0, float(np.linalg.norm(v)))  # noqa: E731 -- the printed formula
    agree = max(float(np.max(np.abs(clip_normalize(v) - inline(v)))) for v in rng.standard_normal((200, 4)) * 2)
    best = 0.0
    for scale in (0.5, 1.0, 2.0, 10.0):
        for u, v in (rng.standard_normal((2, 3)) * scale for _ in range(ctx.pick(500, 3000))):
            best = max(best, _ratio(clip_normalize, u, v))
    # Tangential pairs on the unit sphere are where the ratio approaches its supremum 1.
    theta = 1e-4
    tangent = _ratio(clip_normalize, np.array([1.0, 0.0]), np.array([np.cos(theta), np.sin(theta)]))
    cex = ctx.search(_vector_pair(), lambda p: _ratio(clip_normalize, *p) > 2.0 + 1e-12, max_examples=ctx.pick(30, 100))
    tight = ctx.search(_vector_pair(), lambda p: _ratio(clip_normalize, *p) > 1.0 + 1e-9, max_examples=ctx.pick(30, 100))
    l2 = lambda v: v / np.linalg.norm(v)  # noqa: E731
    l2_ratio = _ratio(l2, np.array([1e-6, 0.0]), np.array([-1e-6, 0.0]))
    return Finding(
        readings=(Reading(PRINTED, "sup ||n(u) - n(v)|| / ||u - v|| <= 2", max(best, tangent) - 2.0 if best > 2 else 0.0,
                          1e-12, None if cex is None else jsonable_arrays(u=cex[0], v=cex[1]),
                          trials=ctx.pick(30, 100)),),
        key_number=f"largest ratio found {max(best, tangent):.6f} (tight constant 1: projection onto the unit ball)",
        sizes=[{"d": 3, "pairs": 4 * ctx.pick(500, 3000)}],
        seeds=[ctx.seed],
        details={"max_ratio_random": best, "ratio_tangent_pair_on_sphere": tangent,
                 "search_ratio_above_1": None if tight is None else jsonable_arrays(u=tight[0], v=tight[1]),
                 "refdml_clip_normalize_vs_formula": agree,
                 "l2_normalisation_ratio_at_1e-6": l2_ratio,
                 "why": "the map is the Euclidean projection onto the closed unit ball, a convex set: 1-Lipschitz"},
    )


# --------------------------------------------------------------------------- Propositions 4.1 and 4.2

_ALPHA, _BETA, _GAMMA = 0.3, 0.4, 0.05
_L = max(1 - _BETA, _BETA) + _ALPHA
_GRID = (np.arange(400) + 0.5) / 400


def _loss(x1, y1, x2, y2):
    iota = np.where(y1[:, None] == y2[None, :], 1.0, -1.0)
    return np.maximum(iota * (np.abs(x1[:, None] - x2[None, :]) - _BETA) + _ALPHA, 0.0)


def _grid_points():
    x = np.concatenate([_GRID, _GRID])
    y = np.concatenate([np.zeros(_GRID.size), np.ones(_GRID.size)])
    return x, y


def _class_cover_radius(x_samples, x_space):
    """sup over x_space of the distance to the nearest sample (inf with no sample)."""
    if x_samples.size == 0:
        return np.inf
    return float(np.max(np.min(np.abs(x_space[:, None] - x_samples[None, :]), axis=1)))


def _draw(rng, n):
    return rng.uniform(0, 1, n), rng.integers(0, 2, n).astype(float)


@claim(
    "asap.prop4.1",
    paper="ASAP Proposition 4.1 (bound at the end of App. B.2)",
    statement="With probability >= 1 - gamma, |E_{z,z'} l - (1/m) sum_i E_z l(z_i, z)| <= zeta delta_S + "
              "L sqrt((2K log 2 + 2 log(1/gamma))/m), K the delta_S/2 covering number of Z "
              "(statement: O(zeta delta_S) + O(L sqrt(log(m/gamma))))",
    hypotheses="S i.i.d., each class a delta_S-cover of X; l zeta-Lipschitz in x, x' and bounded by L",
)
def check_prop_4_1(ctx) -> Finding:
    rng = ctx.rng("asap.prop4.1")
    gx, gy = _grid_points()
    L_full = _loss(gx, gy, gx, gy)
    expected = float(L_full.mean())
    per_point = L_full.mean(axis=1)  # E_z' l(z, z') on the grid
    ms = (10, 30, 100, 300) + (() if ctx.quick else (1000,))
    repeats = ctx.pick(100, 400)
    rows, coverage_ok = [], True
    for m in ms:
        gaps, bounds = [], []
        for _ in range(repeats):
            x, y = _draw(rng, m)
            delta = max(_class_cover_radius(x[y == k], _GRID) for k in (0, 1))
            if not np.isfinite(delta):
                continue
            K = 2 * int(np.ceil(1.0 / delta))
            bound = delta + _L * np.sqrt((2 * K * np.log(2) + 2 * np.log(1 / _GAMMA)) / m)
            hat = _loss(x, y, gx, gy).mean(axis=1)
            gaps.append(abs(expected - hat.mean()))
            bounds.append(bound)
        gaps, bounds = np.array(gaps), np.array(bounds)
        coverage = float(np.mean(gaps <= bounds))
        coverage_ok &= coverage >= 1 - _GAMMA
        rows.append({"m": m, "draws": int(gaps.size), "coverage": coverage, "median_gap": float(np.median(gaps)),
                     "q95_gap": float(np.quantile(gaps, 0.95)), "median_bound": float(np.median(bounds)),
                     "median_bound_over_L": float(np.median(bounds)) / _L,
                     "statement_term_L_sqrt_log_m_over_gamma": _L * np.sqrt(np.log(m / _GAMMA))})
    vacuous = all(r["median_bound_over_L"] >= 1 for r in rows)
    worst_coverage = min(r["coverage"] for r in rows)
    return Finding(
        readings=(Reading(PRINTED, f"the explicit bound holds with frequency >= 1 - gamma = {1 - _GAMMA}",
                          max(0.0, (1 - _GAMMA) - worst_coverage), 0.0, trials=repeats * len(ms)),),
        key_number=f"coverage >= {worst_coverage:.2f}; median bound/L from {rows[0]['median_bound_over_L']:.2f} (m={ms[0]}) "
                   f"to {rows[-1]['median_bound_over_L']:.2f} (m={ms[-1]}); 95% of gaps <= {max(r['q95_gap'] for r in rows):.2g}"
                   + (" (vacuous)" if vacuous else ""),
        sizes=[{"m": m} for m in ms],
        seeds=[ctx.seed],
        details={"setting": "x ~ U[0,1], y ~ Bernoulli(1/2); l = (iota(|x - x'| - beta) + alpha)_+, "
                            f"beta = {_BETA}, alpha = {_ALPHA}, zeta = 1, L = {_L:g}, gamma = {_GAMMA}; expectations on a 400-point grid",
                 "rows": rows, "vacuous_for_all_m": vacuous,
                 "statement_vs_proof": "the statement's O(L sqrt(log(m/gamma))) grows with m; the proof's "
                                       "L sqrt((2K log 2 + 2 log(1/gamma))/m) does not (K/m -> 0)"},
        figures=(Figure("asap_prop41", "Prop. 4.1: bound vs observed generalisation gap", "m (samples)",
                        "gap or bound (loss units)",
                        (series("median bound", ms, [r["median_bound"] for r in rows]),
                         series("95% quantile of the gap", ms, [r["q95_gap"] for r in rows]),
                         series("statement term L sqrt(log(m/gamma))", ms,
                                [r["statement_term_L_sqrt_log_m_over_gamma"] for r in rows])),
                        xscale="log", yscale="log", thresholds=((f"L = {_L:g} (trivial bound)", _L),)),),
    )


def _greedy_cover(x, k):
    """Farthest-first on 1-d points (first pick: the smallest x); returns the indices."""
    chosen = [int(np.argmin(x))]
    dist = np.abs(x - x[chosen[0]])
    while len(chosen) < min(k, x.size):
        nxt = int(np.argmax(dist))
        chosen.append(nxt)
        dist = np.minimum(dist, np.abs(x - x[nxt]))
    return np.array(chosen)


@claim(
    "asap.prop4.2",
    paper="ASAP Proposition 4.2 (bound at the end of App. B.3)",
    statement="With probability >= 1 - gamma, |(1/n^2) sum_ij l(z_i, z_j) - (1/(|s| n)) sum_{i in s, j} l(z_i, z_j)| <= "
              "zeta(3 delta_s + ε(n)) + e(A) + L(sqrt(log(2n/gamma)) + sqrt((2m log 2 + 2 log(1/gamma))/n)) "
              "(statement: O(zeta delta_s) + O(e(A)) + O(L sqrt(log(1/gamma)/n)))",
    hypotheses="z_i i.i.d.; s the union of per-class delta_s-covers; ε(n) the radius within which each class's "
               "samples cover Z; l zeta-Lipschitz, bounded by L",
)
def check_prop_4_2(ctx) -> Finding:
    rng = ctx.rng("asap.prop4.2")
    ns = (20, 50, 100, 200) + (() if ctx.quick else (500,))
    repeats = ctx.pick(50, 200)
    rows, worst_cov = [], 1.0
    for n in ns:
        gaps, printed, hoeffding = [], [], []
        for _ in range(repeats):
            x, y = _draw(rng, n)
            if min(np.sum(y == 0), np.sum(y == 1)) < 2:
                continue
            per_class = max(1, int(np.sqrt(n) / 2))
            s = np.concatenate([np.flatnonzero(y == k)[_greedy_cover(x[y == k], per_class)] for k in (0, 1)])
            delta_s = max(_class_cover_radius(x[s][y[s] == k], x[y == k]) for k in (0, 1))
            sample_cover_radius = max(_class_cover_radius(x[y == k], _GRID) for k in (0, 1))  # ε(n)
            pair = _loss(x, y, x, y)
            full, sub = pair.mean(), pair[s].mean()
            e_train = sub  # L3: the training loss over s x [n]
            m = s.size
            tail = _L * np.sqrt((2 * m * np.log(2) + 2 * np.log(1 / _GAMMA)) / n)
            printed.append(3 * delta_s + sample_cover_radius + e_train + _L * np.sqrt(np.log(2 * n / _GAMMA)) + tail)
            hoeffding.append(3 * delta_s + sample_cover_radius + e_train + _L * np.sqrt(np.log(2 / _GAMMA) / (2 * n)) + tail)
            gaps.append(abs(full - sub))
        gaps, printed, hoeffding = map(np.array, (gaps, printed, hoeffding))
        cov = float(np.mean(gaps <= printed))
        worst_cov = min(worst_cov, cov)
        rows.append({"n": n, "draws": int(gaps.size), "coverage_printed": cov,
                     "coverage_with_hoeffding_term": float(np.mean(gaps <= hoeffding)),
                     "q95_gap": float(np.quantile(gaps, 0.95)), "median_printed_bound_over_L": float(np.median(printed)) / _L,
                     "median_hoeffding_bound_over_L": float(np.median(hoeffding)) / _L,
                     "L_sqrt_log_2n_over_gamma_over_L": float(np.sqrt(np.log(2 * n / _GAMMA)))})
    vacuous = all(r["median_printed_bound_over_L"] >= 1 for r in rows)
    return Finding(
        readings=(Reading(PRINTED, f"the explicit bound holds with frequency >= 1 - gamma = {1 - _GAMMA}",
                          max(0.0, (1 - _GAMMA) - worst_cov), 0.0, trials=repeats * len(ns)),),
        key_number=f"coverage >= {worst_cov:.2f}; printed bound/L >= {min(r['median_printed_bound_over_L'] for r in rows):.2f}"
                   + (" (vacuous: the term L sqrt(log(2n/gamma)) alone exceeds L)" if vacuous else ""),
        sizes=[{"n": n} for n in ns],
        seeds=[ctx.seed],
        details={"setting": "as asap.prop4.1; s = per-class farthest-first covers of sqrt(n)/2 points; "
                            "fixed embedding, so e(A) is the loss over s x [n]",
                 "rows": rows, "vacuous_for_all_n": vacuous,
                 "printed_issue": "(T2.3) <= L sqrt(log(2n/gamma)) is >= L for n >= 2 (vacuous); a Hoeffding bound "
                                  "for one fixed function would read L sqrt(log(2/gamma)/(2n)); the main-text "
                                  "statement's O(L sqrt(log(1/gamma)/n)) matches that, the appendix's O(L sqrt(log(n/gamma))) does not"},
        figures=(Figure("asap_prop42", "Prop. 4.2: bounds vs observed gap, relative to L", "n (samples)",
                        "gap or bound / L",
                        (series("printed bound / L (median)", ns, [r["median_printed_bound_over_L"] for r in rows]),
                         series("with L sqrt(log(2/gamma)/(2n)) / L (median)", ns,
                                [r["median_hoeffding_bound_over_L"] for r in rows]),
                         series("95% quantile of the gap / L", ns, [r["q95_gap"] / _L for r in rows])),
                        xscale="log", yscale="log", thresholds=(("1 (a bound above it is vacuous)", 1.0),)),),
    )


# --------------------------------------------------------------------------- greedy k-center


def _radius(points, centers):
    return float(np.max(np.min(np.linalg.norm(points[:, None] - points[centers][None], axis=-1), axis=1)))


def _gonzalez(points, k, first=0):
    chosen = [first]
    dist = np.linalg.norm(points - points[first], axis=1)
    for _ in range(k - 1):
        nxt = int(np.argmax(dist))
        chosen.append(nxt)
        dist = np.minimum(dist, np.linalg.norm(points - points[nxt], axis=1))
    return chosen


def _optimum(points, k):
    return min(_radius(points, list(c)) for c in itertools.combinations(range(points.shape[0]), k))


@st.composite
def _point_set(draw):
    n, d = draw(st.integers(2, 7)), draw(st.integers(1, 2))
    return draw(arrays((n, d), -1, 1)), draw(st.integers(1, min(3, n - 1))), draw(st.integers(0, n - 1))


def _greedy_ratio(points, k, first) -> float:
    opt = _optimum(points, k)
    greedy = _radius(points, _gonzalez(points, k, first))
    return greedy / opt if opt > 0 else (0.0 if greedy == 0 else np.inf)


@claim(
    "asap.kcenter",
    paper="ASAP Algorithm 2 (greedy k-Center proxy selection, after Sener & Savarese 2018)",
    statement="Greedy (farthest-first) k-center selection covers the set within twice the optimal covering radius.",
    hypotheses="finite point set, centres chosen among the points, k >= 1",
)
def check_kcenter(ctx) -> Finding:
    rng = ctx.rng("asap.kcenter")
    worst, worst_refdml, trials = 0.0, 0.0, 0
    for n, d, k in ((8, 2, 2), (10, 2, 3), (12, 3, 3)) + (() if ctx.quick else ((14, 2, 4),)):
        for _ in range(ctx.pick(3, 8)):
            pts = rng.standard_normal((n, d))
            opt = _optimum(pts, k)
            worst = max(worst, _radius(pts, _gonzalez(pts, k, int(rng.integers(n)))) / opt)
            res = refdml_kcenter.greedy_k_center(pts, k, rng=int(rng.integers(1 << 30)))
            worst_refdml = max(worst_refdml, float(res.radii[-1]) / opt)
            trials += 1
    bound = 2.0
    cex = ctx.search(_point_set(), lambda a: _greedy_ratio(*a) > bound + 1e-12, max_examples=ctx.pick(30, 100))
    # Covering radius vs number of centres (figure).
    pts = rng.standard_normal((40, 2))
    ks = list(range(1, 16))
    greedy_r = [_radius(pts, _gonzalez(pts, k)) for k in ks]
    small = rng.standard_normal((16, 2))
    opt_ks = [1, 2, 3, 4]
    return Finding(
        readings=(Reading(PRINTED, "greedy radius <= 2 x optimal radius (brute force)", max(worst, worst_refdml) - bound
                          if max(worst, worst_refdml) > bound else 0.0, 1e-12,
                          None if cex is None else {**jsonable_arrays(points=cex[0]), "k": cex[1], "first": cex[2]},
                          trials=trials),),
        key_number=f"max greedy/optimal radius = {worst:.3f} (refdml.kcenter {worst_refdml:.3f})",
        sizes=[{"n": 8, "d": 2, "k": 2}, {"n": 10, "d": 2, "k": 3}, {"n": 12, "d": 3, "k": 3}],
        seeds=[ctx.seed],
        details={"max_ratio_own_greedy": worst,
                 "max_ratio_refdml_greedy_k_center": worst_refdml,
                 "small_set_optimum_vs_greedy": {str(k): {"optimum": _optimum(small, k),
                                                          "greedy": _radius(small, _gonzalez(small, k))} for k in opt_ks}},
        figures=(Figure("asap_kcenter", "Greedy / optimal covering radius (16 points in R^2, brute-force optimum)",
                        "number of centres k", "greedy radius / optimal radius",
                        (series("16 standard normal points", opt_ks,
                                [_radius(small, _gonzalez(small, k)) / _optimum(small, k) for k in opt_ks]),),
                        thresholds=(("bound 2", bound),)),
                 Figure("asap_kcenter_radius", "Greedy covering radius vs number of centres (40 points in R^2)",
                        "number of centres k", "covering radius", (series("greedy (farthest first)", ks, greedy_r),))),
    )
