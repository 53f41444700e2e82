"""Catalogue entries of :mod:`refdml.losses`: the seven losses as forward/backward pairs.

:func:`refdml.gradcheck.check_gradients` contracts the scalar value with a random upstream
``d_value`` (not 1), so each entry also checks that the backward scales by it. The input
makers keep every hinge, mining threshold and argmax at least ``_KINK_GAP`` from its kink,
so that central differences (step ~ 6e-6 |x|) never straddle one.
"""

from __future__ import annotations

import numpy as np

from refdml import losses
from refdml.catalog._spec import OperatorSpec
from refdml.gpu import losses as fast

_KINK_GAP = 1e-3
_LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])


def _distances(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)


def _cosines(x: np.ndarray) -> np.ndarray:
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    return unit @ unit.T


def _draw_away_from_kinks(rng: np.random.Generator, gap_fn, scale: float = 0.5) -> np.ndarray:
    for _ in range(1000):
        x = scale * rng.standard_normal((_LABELS.size, 4))
        # Also keep points apart: ||x_i - x_j|| has curvature 1 / d, which spoils central
        # differences for d close to the step.
        separated = np.min(_distances(x)[np.triu_indices(_LABELS.size, k=1)]) > 1e-2
        if separated and gap_fn(x) > _KINK_GAP:
            return x
    raise RuntimeError("could not draw inputs away from the kinks in 1000 tries")


def _pair_gap(matrix: np.ndarray, pos_margin: float, neg_margin: float) -> float:
    rows, cols = np.triu_indices(_LABELS.size, k=1)
    same = _LABELS[rows] == _LABELS[cols]
    values = matrix[rows, cols]
    return float(np.min(np.abs(values - np.where(same, pos_margin, neg_margin))))


def _triplet_gap(x: np.ndarray, margin: float) -> float:
    d = _distances(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    pos = same & ~np.eye(_LABELS.size, dtype=bool)
    pre = d[:, :, None] - d[:, None, :] + margin
    gap = np.min(np.abs(pre[pos[:, :, None] & ~same[:, None, :]]))
    # Batch-hard: also a gap between the two largest positive / two smallest negative distances.
    for row in range(_LABELS.size):
        for values in (np.sort(d[row, pos[row]]), np.sort(d[row, ~same[row]])):
            if values.size > 1:
                gap = min(gap, float(np.min(np.diff(values))))
    return float(gap)


def _ms_gap(x: np.ndarray, mining_margin: float) -> float:
    s = _cosines(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    pos = same & ~np.eye(_LABELS.size, dtype=bool)
    gaps = []
    for i in range(_LABELS.size):
        gaps.append(np.abs(s[i, ~same[i]] + mining_margin - s[i, pos[i]].min()))
        gaps.append(np.abs(s[i, pos[i]] - mining_margin - s[i, ~same[i]].max()))
    return float(np.min(np.concatenate(gaps)))


def _contrastive_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(_distances(x), 0.2, 0.9))
    return {"embeddings": x, "labels": _LABELS, "pos_margin": 0.2, "neg_margin": 0.9}


def _contrastive_cosine_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(-_cosines(x), -1.0, -0.2))
    return {"embeddings": x, "labels": _LABELS, "form": "cosine", "neg_margin": 0.2}


def _contrastive_no_positive_inputs(rng):
    # All labels distinct: only negative terms (they are summed, not dropped).
    labels = np.arange(6)
    for _ in range(1000):
        x = 0.3 * rng.standard_normal((labels.size, 3))
        d = _distances(x)[np.triu_indices(labels.size, k=1)]
        if d.min() > 1e-2 and np.min(np.abs(d - 0.9)) > _KINK_GAP and np.any(d < 0.9):
            return {"embeddings": x, "labels": labels, "neg_margin": 0.9}
    raise RuntimeError("could not draw inputs away from the kinks in 1000 tries")


def _generalized_contrastive_inputs(rng):
    # m+ = beta - alpha = 0.3, m- = beta + alpha = 0.9.
    x = _draw_away_from_kinks(rng, lambda x: _pair_gap(_distances(x), 0.3, 0.9))
    return {"embeddings": x, "labels": _LABELS, "alpha": 0.3, "beta": 0.6}


def _triplet_inputs(rng, mining):
    x = _draw_away_from_kinks(rng, lambda x: _triplet_gap(x, 0.4))
    return {"embeddings": x, "labels": _LABELS, "margin": 0.4, "mining": mining}


def _multi_similarity_inputs(rng):
    x = _draw_away_from_kinks(rng, lambda x: _ms_gap(x, 0.3))
    return {"embeddings": x, "labels": _LABELS, "mining_margin": 0.3}


def _proxy_inputs(rng, **hyper):
    # Two centres per class: the several-proxies-per-class case of ASAP.
    return {
        "embeddings": rng.standard_normal((_LABELS.size, 4)),
        "labels": _LABELS,
        "proxies": rng.standard_normal((8, 4)),
        "proxy_labels": np.repeat(np.arange(4), 2),
        **hyper,
    }


# The losses whose mirror runs refdml.gpu._loss_kernels.masked_logsumexp on these inputs
# (so its Numba kernels, refdml.gpu._nb_losses, under use_kernels("cpu") / ("cuda")).
# Proxy-Anchor and ProxyNCA++ reach it only past their exp bound, not on these inputs.
MASKED_LSE_KERNELS = ("cpu", "cuda")
_THROUGH_MASKED_LSE = {"multi_similarity", "soft_triple"}

# name, reference pair, mirror pair, input maker, paper
_ROWS = (
    ("contrastive", losses.contrastive_forward, losses.contrastive_backward,
     fast.contrastive_forward, fast.contrastive_backward,
     _contrastive_inputs, "C2 contrastive with positive margin (GSP supp. 1.6.6; ASAP Sec. 5)"),
    ("contrastive_cosine", losses.contrastive_forward, losses.contrastive_backward,
     fast.contrastive_forward, fast.contrastive_backward,
     _contrastive_cosine_inputs, "C1 contrastive on cosine similarity (XBM; GSP supp. 1.6.7)"),
    ("contrastive_no_positive", losses.contrastive_forward, losses.contrastive_backward,
     fast.contrastive_forward, fast.contrastive_backward,
     _contrastive_no_positive_inputs,
     "C2 contrastive on a batch without positive pairs (negative terms only; ASAP Sec. 5)"),
    ("generalized_contrastive", losses.generalized_contrastive_forward,
     losses.generalized_contrastive_backward,
     fast.generalized_contrastive_forward, fast.generalized_contrastive_backward,
     _generalized_contrastive_inputs, "ASAP Eq. (4.2), generalized contrastive loss"),
    ("triplet", losses.triplet_forward, losses.triplet_backward,
     fast.triplet_forward, fast.triplet_backward,
     lambda rng: _triplet_inputs(rng, "all"),
     "triplet loss over all batch triplets (ASAP Sec. 5; GSP supp. 1.6.6)"),
    ("triplet_batch_hard", losses.triplet_forward, losses.triplet_backward,
     fast.triplet_forward, fast.triplet_backward,
     lambda rng: _triplet_inputs(rng, "batch_hard"),
     "triplet loss with batch-hard mining (Hermans et al. 2017)"),
    ("multi_similarity", losses.multi_similarity_forward, losses.multi_similarity_backward,
     fast.multi_similarity_forward, fast.multi_similarity_backward,
     _multi_similarity_inputs, "multi-similarity loss, Wang et al. 2019 Eqs. 7-9"),
    ("proxy_anchor", losses.proxy_anchor_forward, losses.proxy_anchor_backward,
     fast.proxy_anchor_forward, fast.proxy_anchor_backward,
     lambda rng: _proxy_inputs(rng, alpha=8.0), "Proxy-Anchor loss, Kim et al. 2020 Eq. 4"),
    ("proxy_nca", losses.proxy_nca_forward, losses.proxy_nca_backward,
     fast.proxy_nca_forward, fast.proxy_nca_backward,
     lambda rng: _proxy_inputs(rng, temperature=0.5), "ProxyNCA++ loss, Teh et al. 2020 Eq. 5"),
    ("soft_triple", losses.soft_triple_forward, losses.soft_triple_backward,
     fast.soft_triple_forward, fast.soft_triple_backward,
     lambda rng: _proxy_inputs(rng, lambda_=5.0, gamma=0.3, tau=0.5),
     "SoftTriple loss with regulariser, Qian et al. 2019 Eqs. 8-10"),
)
OPERATORS = tuple(
    OperatorSpec(
        name=f"losses.{name}", forward=forward, backward=backward, make_inputs=make,
        paper=paper, tags=("loss",), mirror=mirror, mirror_backward=mirror_backward,
        mirror_kernels=MASKED_LSE_KERNELS if name in _THROUGH_MASKED_LSE else (),
    )
    for name, forward, backward, mirror, mirror_backward, make, paper in _ROWS
)
