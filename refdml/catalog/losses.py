"""Catalogue entries of :mod:`refdml.losses`: the nine losses as forward/backward pairs.

:func:`refdml.gradcheck.check_gradients` contracts the scalar value with a random upstream
``d_value`` (not 1), so each entry also checks that the backward scales by it. The input
makers keep every hinge, mining threshold and argmax at least ``_KINK_GAP`` from its kink,
so that central differences (step ~ 6e-6 |x|) never straddle one.

Each entry's ``reference_inputs`` are its hard cases (exact ties, duplicate points, a
batch with one class or no positive pair, extreme temperatures, tiny and huge scales,
float32 at the edge of its range) and its ``error_inputs`` the bad inputs it refuses. The
hard cases keep the same distance from the kinks, with one exception that is the point of
the duplicate-point cases: a zero distance, where the reference takes the documented
subgradient 0 of the Euclidean distance.
"""

from __future__ import annotations

import numpy as np

from refdml import losses
from refdml.catalog._cases import (
    FLOAT32_MAX,
    FLOAT32_TINY,
    bad_scalar,
    flat,
    non_integer_labels,
    replaced,
    scaled,
    truncated,
    with_nan,
)
from refdml.catalog._spec import Case, ErrorCase, OperatorSpec
from refdml.gpu import losses as fast

_KINK_GAP = 1e-3
# The seeds' own gap, where drawing it is cheap (the pair losses): a distance or cosine
# near 1 computed in bfloat16 is off by a few units of 2**-8 (0.004 each), so a hinge
# 1e-3 from its kink can flip in a correct bfloat16 implementation and its gradient term
# with it (a contrastive seed at 0.005 did). 0.02 keeps the seeds smooth in every format.
_SEED_GAP = 0.02
_LABELS = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3, 3])


def _distances(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)


def _cosines(x: np.ndarray) -> np.ndarray:
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    return unit @ unit.T


def _draw_away_from_kinks(rng: np.random.Generator, gap_fn, scale: float = 0.5,
                          gap: float = _SEED_GAP) -> np.ndarray:
    for _ in range(1000):
        x = scale * rng.standard_normal((_LABELS.size, 4))
        # Also keep points apart: ||x_i - x_j|| has curvature 1 / d, which spoils central
        # differences for d close to the step.
        separated = np.min(_distances(x)[np.triu_indices(_LABELS.size, k=1)]) > 1e-2
        if separated and gap_fn(x) > gap:
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
    # The triplets' gaps (every triplet and the batch-hard order) at 0.02 take some 10^4
    # draws: the hinge keeps the central-difference gap; bfloat16 may flip a term there.
    x = _draw_away_from_kinks(rng, lambda x: _triplet_gap(x, 0.4), gap=_KINK_GAP)
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


def _proxy_nca_inputs(rng):
    """Embeddings scattered about one proxy of their class (spread 0.7 against proxies of
    norm ~2), at row norms from 0.5 to 2, T = 0.5: a batch part-way through training.

    Random embeddings give each class about its share of the softmax (P ~ 1/4); a
    ProxyNCA++ that leaves the positive proxy out of its denominator then changes the value
    by -log(1 - P) ~ 0.29 of a loss ~ -log P ~ 1.4, a relative 0.2: within the reach of
    bfloat16's rounding on some seeds (a tolerance 16 * 2**-7 = 0.125 at conditioning 1, up
    to 0.2 measured). About their own proxy P ~ 0.5 to 0.9, and the same defect moves the
    value by 0.6 to 2.8 of itself and each gradient by 0.27 to 2.4 (5 to 20 times the
    tolerance), while a correct bfloat16 implementation stays within 0.01. The varied row
    norms make a dropped normalisation visible too.
    """
    proxies = rng.standard_normal((_PROXY_LABELS.size, 4))
    own = 2 * _LABELS + rng.integers(0, 2, _LABELS.size)
    x = proxies[own] + 0.7 * rng.standard_normal((_LABELS.size, 4))
    x *= rng.uniform(0.5, 2.0, (_LABELS.size, 1))
    return {"embeddings": x, "labels": _LABELS, "proxies": proxies,
            "proxy_labels": _PROXY_LABELS, "temperature": 0.5}


# ------------------------------------------------------------- hard and bad inputs
#
# Scales at which a naive implementation breaks: the squares of entries of 1e-170
# (1e170) under- (over-)flow float64, those of 1e-25 (3e19) float32. The reference
# rescales by powers of two (refdml.losses._common) and is right at all of them.
_TINY, _HUGE = 1e-170, 1e170
_F32_TINY, _F32_HUGE = 1e-25, 3e19
_F64 = ("float64",)     # a scale float32 cannot hold: the case means nothing there
_F32 = ("float32",)
_SQRT_AT_ZERO = (
    "naive autodiff of sqrt(sum (x_i - x_j)^2) gives 0/0 = NaN at a zero distance; the "
    "reference uses the subgradient 0 of the distance at coincident points (documented in "
    "refdml.distances.euclidean_backward)"
)


def _signed_basis() -> np.ndarray:
    """``+-e_k`` in 5 dimensions, one row per entry of ``_LABELS``: every distance is
    ``sqrt(2)`` or 2 and every cosine 0 or -1, exactly (integer arithmetic): exact ties."""
    return np.vstack([np.eye(5), -np.eye(5)])


def _duplicated(x: np.ndarray) -> np.ndarray:
    """Row 1 := row 0 (same class) and row 3 := row 2 (classes 0 and 1)."""
    x = np.array(x, copy=True)
    x[1], x[3] = x[0], x[2]
    return x


def _duplicate_case(rng, make, gap_fn, why: str, duplicate=_duplicated) -> Case:
    """``make(rng)`` with rows made to coincide, redrawn until ``gap_fn`` of the new
    embeddings keeps every hinge and mining threshold ``_KINK_GAP`` from its kink (moving
    a row changes which margin its pairs meet)."""
    for _ in range(1000):
        inputs = make(rng)
        x = duplicate(inputs["embeddings"])
        if gap_fn(x) > _KINK_GAP:
            return Case("duplicate points", replaced(inputs, embeddings=x), why)
    raise RuntimeError("could not draw a duplicate-point case away from the kinks in 1000 tries")


def _without_pair(matrix: np.ndarray, i: int, j: int, value: float) -> np.ndarray:
    matrix = np.array(matrix, copy=True)
    matrix[i, j] = matrix[j, i] = value
    return matrix


def _all_triplet_gap(x: np.ndarray, margin: float) -> float:
    d = _distances(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    pos = same & ~np.eye(_LABELS.size, dtype=bool)
    pre = d[:, :, None] - d[:, None, :] + margin
    return float(np.min(np.abs(pre[pos[:, :, None] & ~same[:, None, :]])))


def _scale_cases(inputs, names=("embeddings",), cosine=False) -> tuple[Case, ...]:
    """The same inputs at the scales where squares leave the float64 / float32 range."""
    what = ("the value is scale-invariant and the gradient of a row scales as 1 / its norm"
            if cosine else "distances scale with the embeddings")
    naive = "0/0 = NaN" if cosine else "zero distances and NaN gradients"
    return (
        Case("tiny scale", scaled(inputs, _TINY, *names),
             f"entries of 1e-170: their squares underflow float64, so a naive norm gives "
             f"{naive}; {what}", dtypes=_F64),
        Case("huge scale", scaled(inputs, _HUGE, *names),
             f"entries of 1e170: their squares overflow float64 (inf, then NaN); {what}",
             dtypes=_F64),
        Case("float32 range edge",
             scaled(inputs, _F32_TINY if cosine else _F32_HUGE, *names),
             f"entries of {_F32_TINY if cosine else _F32_HUGE:g}: their squares leave "
             f"float32's range ({FLOAT32_TINY:.2g} .. {FLOAT32_MAX:.2g}), so an unscaled "
             "float32 norm is 0 or inf", dtypes=_F32),
    )


def _zero_row(inputs, name: str) -> ErrorCase:
    array = np.array(inputs[name], dtype=np.float64, copy=True)
    array[-1] = 0.0
    return ErrorCase(f"zero row in {name}", replaced(inputs, **{name: array}), ValueError,
                     rf"{name} has a zero vector")


def _label_errors(inputs) -> tuple[ErrorCase, ...]:
    return (
        with_nan(inputs, "embeddings"),
        flat(inputs, "embeddings"),
        non_integer_labels(inputs),
        truncated(inputs, "labels"),
    )


def _contrastive_cases(rng) -> tuple[Case, ...]:
    inputs = _contrastive_inputs(rng)
    return (
        _duplicate_case(
            rng, _contrastive_inputs, lambda x: _pair_gap(_distances(x), 0.2, 0.9),
            "a positive pair and a negative pair at distance 0 (the negative hinge active "
            f"there): {_SQRT_AT_ZERO}"),
        Case("exact ties, positive margin 0",
             replaced(inputs, embeddings=_signed_basis(), pos_margin=0.0),
             "every distance is sqrt(2) or 2 exactly and m+ == 0 (every positive term active, "
             "d > 0 so differentiable): an implementation that mines or sorts the pairs "
             "must not drop tied ones"),
        Case("one class", replaced(inputs, labels=np.zeros_like(_LABELS)),
             "no negative pair: the loss is the reduction of the positive terms, not 0/0 "
             "from a mean over an empty set of negatives"),
        *_scale_cases(inputs),
    )


def _contrastive_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _contrastive_inputs(rng)
    return (*_label_errors(inputs), bad_scalar(inputs, "neg_margin", -0.5),
            bad_scalar(inputs, "pos_margin", -0.1))


def _contrastive_cosine_cases(rng) -> tuple[Case, ...]:
    inputs = _contrastive_cosine_inputs(rng)
    return (
        _duplicate_case(
            # The positive pair (0, 1) sits at s == 1 == m+, the end of the feasible range:
            # [1 - s]_+ = 1 - s there, smooth with gradient 0, so it is left out of the gap.
            rng, _contrastive_cosine_inputs,
            lambda x: _pair_gap(_without_pair(-_cosines(x), 0, 1, 0.0), -1.0, -0.2),
            "cosines exactly 1 (a positive and a negative pair): the loss is smooth there "
            "(the cosine's gradient along parallel vectors is 0), but a cosine formed from "
            "rounded norms can exceed 1 or have a non-zero gradient"),
        Case("exact ties", replaced(inputs, embeddings=_signed_basis()),
             "every cosine is 0 or -1 exactly: tied pairs all count"),
        *_scale_cases(inputs, cosine=True),
    )


def _contrastive_cosine_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _contrastive_cosine_inputs(rng)
    return (*_label_errors(inputs), bad_scalar(inputs, "neg_margin", 1.0),
            _zero_row(inputs, "embeddings"))


def _first_row_twice(x: np.ndarray) -> np.ndarray:
    x = np.array(x, copy=True)
    x[1] = x[0]
    return x


def _contrastive_no_positive_cases(rng) -> tuple[Case, ...]:
    inputs = _contrastive_no_positive_inputs(rng)
    return (
        _duplicate_case(
            rng, _contrastive_no_positive_inputs,
            lambda x: np.min(np.abs(_distances(x) - 0.9)),
            f"two points of different classes coincide, their hinge active: {_SQRT_AT_ZERO}",
            duplicate=_first_row_twice),
        Case("exact ties", replaced(inputs, embeddings=_signed_basis()[:6],
                                    neg_margin=1.5),
             "every distance is sqrt(2) or 2 exactly, the tied sqrt(2) pairs inside the "
             "margin: a batch without positives still has all its negative terms (not 0)"),
        *_scale_cases(inputs),
    )


def _contrastive_no_positive_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _contrastive_no_positive_inputs(rng)
    return (*_label_errors(inputs),
            bad_scalar(inputs, "neg_margin", 0.0, label="neg_margin exactly 0"))


def _generalized_contrastive_cases(rng) -> tuple[Case, ...]:
    inputs = _generalized_contrastive_inputs(rng)
    return (
        Case("positive margin exactly 0", replaced(inputs, embeddings=_signed_basis(),
                                                   alpha=0.6, beta=0.6),
             "beta == alpha makes m+ = beta - alpha exactly 0 (every positive term active) "
             "on exactly tied distances sqrt(2) and 2"),
        _duplicate_case(
            rng, _generalized_contrastive_inputs, lambda x: _pair_gap(_distances(x), 0.3, 0.9),
            f"a positive and a negative pair at distance 0, the negative hinge active: "
            f"{_SQRT_AT_ZERO}"),
        Case("no positive pair", replaced(inputs, labels=np.arange(_LABELS.size)),
             "all labels distinct: the loss is the mean of the negative terms (ASAP Eq. (4.2) "
             "sums over all pairs), not 0 and not 0/0"),
        *_scale_cases(inputs),
    )


def _generalized_contrastive_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _generalized_contrastive_inputs(rng)
    return (*_label_errors(inputs), bad_scalar(inputs, "alpha", 0.0, label="alpha exactly 0"),
            ErrorCase("beta < alpha", replaced(inputs, beta=0.1), ValueError,
                      r"beta == 0\.1, must be >= alpha"))


def _triplet_cases(rng) -> tuple[Case, ...]:
    inputs = _triplet_inputs(rng, "all")
    return (
        _duplicate_case(
            rng, lambda rng: _triplet_inputs(rng, "all"), lambda x: _all_triplet_gap(x, 0.4),
            f"an anchor on its positive and on a negative (d == 0 in active triplets): "
            f"{_SQRT_AT_ZERO}"),
        Case("exact ties", replaced(inputs, embeddings=_signed_basis()),
             "d_ap and d_an tied at sqrt(2) (terms exactly the margin) or 2: no term is "
             "dropped or double-counted"),
        Case("one class", replaced(inputs, labels=np.zeros_like(_LABELS)),
             "no negative, so no triplet: value 0 and zero gradient, not 0/0"),
        Case("no positive pair", replaced(inputs, labels=np.arange(_LABELS.size)),
             "no positive, so no triplet: value 0 and zero gradient, not 0/0"),
        *_scale_cases(inputs),
    )


def _triplet_errors(rng, mining) -> tuple[ErrorCase, ...]:
    inputs = _triplet_inputs(rng, mining)
    return (*_label_errors(inputs),
            bad_scalar(inputs, "margin", 0.0, label="margin exactly 0"),
            ErrorCase("unknown mining", replaced(inputs, mining="semi_hard"), ValueError,
                      r"mining == 'semi_hard'"))


def _unique_hardest(x: np.ndarray, labels: np.ndarray) -> bool:
    """Whether each anchor's farthest positive and nearest negative are unique (no tie)."""
    d = _distances(x)
    same = labels[:, None] == labels[None, :]
    for row in range(labels.size):
        for values in (-d[row, same[row] & (np.arange(labels.size) != row)], d[row, ~same[row]]):
            if values.size > 1 and np.sort(values)[1] - np.min(values) < _KINK_GAP:
                return False
    return True


def _triplet_batch_hard_cases(rng) -> tuple[Case, ...]:
    inputs = _triplet_inputs(rng, "batch_hard")
    # The two points of class 3 coincide at L, far from the rest, with a point of class 2
    # at distance 0.3 < margin (their terms active) and one of class 1 at 0.1 from that
    # one (its nearest negative, so that no anchor's nearest negative is the coincident
    # pair, a tie broken by the lowest index: a convention other implementations need
    # not share). The rest is redrawn until every hardest choice is unique.
    corner = np.array([3.0, 0.0, 0.0, 0.0])
    for _ in range(1000):
        x = 0.5 * rng.standard_normal((_LABELS.size, 4))
        x[8] = x[9] = corner
        x[7] = corner + [0.0, 0.3, 0.0, 0.0]
        x[4] = corner + [0.0, 0.3, 0.1, 0.0]
        if _unique_hardest(x, _LABELS) and _triplet_gap_active(x, 0.4):
            break
    else:
        raise RuntimeError("could not draw a batch-hard duplicate case in 1000 tries")
    return (
        Case("anchor on its only positive", replaced(inputs, embeddings=x),
             f"class 3's two points coincide (d_ap == 0, the term active): {_SQRT_AT_ZERO}; "
             "every hardest positive and negative is unique (no tie-breaking convention)"),
        Case("one class", replaced(inputs, labels=np.zeros_like(_LABELS)),
             "no anchor has a negative: value 0 and zero gradient, not the mean of nothing"),
        Case("no positive pair", replaced(inputs, labels=np.arange(_LABELS.size)),
             "no anchor has a positive: value 0 and zero gradient"),
        *_scale_cases(inputs),
    )


def _triplet_gap_active(x: np.ndarray, margin: float) -> bool:
    """Every batch-hard term at least ``_KINK_GAP`` from its hinge."""
    d = _distances(x)
    same = _LABELS[:, None] == _LABELS[None, :]
    far = np.max(np.where(same, d, -np.inf), axis=1)
    near = np.min(np.where(same, np.inf, d), axis=1)
    return bool(np.min(np.abs(far - near + margin)) > _KINK_GAP)


def _multi_similarity_cases(rng) -> tuple[Case, ...]:
    inputs = _multi_similarity_inputs(rng)
    return (
        Case("large alpha and beta", replaced(inputs, alpha=1e4, beta=1e4),
             "alpha (s - base) and beta (s - base) reach 1e4: a naive exp overflows (inf, then "
             "NaN); log(1 + sum exp) must be a shifted log-sum-exp"),
        Case("exact ties", replaced(inputs, embeddings=_signed_basis()),
             "every cosine 0 or -1 exactly, none at a mining threshold (margin 0.3): tied "
             "pairs are mined together and weighted equally"),
        _duplicate_case(
            rng, _multi_similarity_inputs, lambda x: _ms_gap(x, 0.3),
            "cosines exactly 1 for a positive and for a negative pair (smooth there: "
            "every mining decision at least 1e-3 from its threshold)"),
        Case("no positive pair", replaced(inputs, labels=np.arange(_LABELS.size)),
             "no anchor has a positive, so no term: value 0 and zero gradient, not 0/0"),
        *_scale_cases(inputs, cosine=True),
    )


def _multi_similarity_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _multi_similarity_inputs(rng)
    return (*_label_errors(inputs), _zero_row(inputs, "embeddings"),
            bad_scalar(inputs, "mining_margin", -0.1),
            bad_scalar(inputs, "alpha", 0.0, label="alpha exactly 0"))


def _proxy_basis(inputs) -> dict:
    """Embeddings and proxies on ``+-e_k``: every cosine -1, 0 or 1 exactly (exact ties)."""
    signed = np.vstack([np.eye(4), -np.eye(4)])
    return replaced(inputs, embeddings=np.vstack([signed, np.eye(4)[:2]]),
                    proxies=signed[[0, 4, 1, 5, 2, 6, 3, 7]])


def _proxy_shared_cases(inputs) -> tuple[Case, ...]:
    x = _duplicated(inputs["embeddings"])
    # Embeddings 0 and 1 (class 0) exactly on proxy 0 (class 0), 3 on 2 across classes.
    x[0] = x[1] = inputs["proxies"][0]
    return (
        Case("exact ties", _proxy_basis(inputs),
             "embeddings and proxies on +-e_k, every cosine -1, 0 or 1 exactly: tied logits "
             "share the softmax weight equally (an arg-max shortcut does not)"),
        Case("duplicate points", replaced(inputs, embeddings=x),
             "two embeddings of class 0 exactly on a proxy of their class, and two of "
             "different classes coincide: the cosine is smooth there (s == 1), but a "
             "distance ||x^ - p^|| formed with a square root has a NaN gradient at 0"),
        Case("one class in the batch", replaced(inputs, labels=np.zeros_like(_LABELS)),
             "every embedding of class 0; the proxies of classes 1-3 have no positive in the "
             "batch"),
        *_scale_cases(inputs, names=("embeddings", "proxies"), cosine=True),
    )


def _proxy_errors(inputs, hyper_errors) -> tuple[ErrorCase, ...]:
    return (
        *_label_errors(inputs),
        with_nan(inputs, "proxies"),
        truncated(inputs, "proxy_labels"),
        ErrorCase("class without proxy", replaced(inputs, labels=_LABELS + 1), ValueError,
                  r"labels has class 4, which no proxy represents"),
        *hyper_errors,
    )


def _proxy_anchor_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_inputs(rng, alpha=8.0)
    absent = np.where(_LABELS == 3, 2, _LABELS)
    return (
        Case("large alpha", replaced(inputs, alpha=1e4),
             "logits alpha (s +- delta) reach 1.1e4: a naive exp overflows; the positive and "
             "negative log(1 + sum exp) need a shifted log-sum-exp"),
        Case("delta exactly 0, a class absent", replaced(inputs, delta=0.0, labels=absent),
             "class 3 is absent from the batch: its proxies leave the positive average "
             "(over P+, not all proxies) but keep their negative terms; margin delta == 0"),
        *_proxy_shared_cases(inputs),
    )


def _proxy_anchor_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _proxy_inputs(rng, alpha=8.0)
    return _proxy_errors(inputs, (bad_scalar(inputs, "alpha", 0.0, label="alpha exactly 0"),
                                  bad_scalar(inputs, "delta", -0.1)))


def _proxy_nca_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_inputs(rng, temperature=0.5)
    single = replaced(inputs, labels=np.zeros_like(_LABELS),
                      proxy_labels=np.zeros(8, dtype=_LABELS.dtype))
    return (
        Case("small temperature", replaced(inputs, temperature=1e-3),
             "logits -||x^ - p^||^2 / T reach -4000: a naive exp underflows to 0 for every "
             "proxy and the ratio is 0/0 = NaN; needs a log-sum-exp"),
        Case("one class of proxies", single,
             "every proxy and embedding of one class: each term log(sum / sum) is exactly 0 "
             "(no rounding residue below 0, no 0/0)"),
        *_proxy_shared_cases(inputs),
    )


def _proxy_nca_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _proxy_inputs(rng, temperature=0.5)
    return _proxy_errors(inputs, (
        bad_scalar(inputs, "temperature", 0.0, label="temperature exactly 0"),
        bad_scalar(inputs, "temperature", -0.1)))


def _soft_triple_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_inputs(rng, lambda_=5.0, gamma=0.3, tau=0.5)
    p = np.array(inputs["proxies"], copy=True)
    p[1] = p[0]
    return (
        Case("small gamma, large lambda", replaced(inputs, gamma=1e-3, lambda_=1e3),
             "s / gamma reaches 1000 and lambda S' 1000: a naive exp overflows, and a "
             "careless softmax drops the centres' terms"),
        Case("coincident centres", replaced(inputs, proxies=p),
             "the two centres of class 0 coincide: the regulariser's sqrt(2 + 1e-5 - 2 <w_t, "
             "w_s>) stays at sqrt(1e-5) (an implementation without the 1e-5 has an infinite "
             "gradient)"),
        *_proxy_shared_cases(inputs),
    )


def _soft_triple_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _proxy_inputs(rng, lambda_=5.0, gamma=0.3, tau=0.5)
    return _proxy_errors(inputs, (
        bad_scalar(inputs, "gamma", 0.0, label="gamma exactly 0"),
        bad_scalar(inputs, "tau", -0.1),
        bad_scalar(inputs, "lambda_", -1.0)))


# ---------------------------------------------- pair losses between samples and proxies
_PROXY_LABELS = np.repeat(np.arange(4), 2)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _sample_proxy_distances(x: np.ndarray, p: np.ndarray) -> np.ndarray:
    return np.linalg.norm(_unit(x)[:, None, :] - _unit(p)[None, :, :], axis=-1)


def _sample_proxy_contrastive_gap(x, p, pos_margin, neg_margin) -> float:
    d = _sample_proxy_distances(x, p)
    same = _LABELS[:, None] == _PROXY_LABELS[None, :]
    return float(np.min(np.abs(d - np.where(same, pos_margin, neg_margin))))


def _sample_proxy_ms_gap(x, p, mining_margin) -> float:
    s = _unit(x) @ _unit(p).T
    same = _LABELS[:, None] == _PROXY_LABELS[None, :]
    gaps = []
    for i in range(_LABELS.size):
        gaps.append(np.abs(s[i, ~same[i]] + mining_margin - s[i, same[i]].min()))
        gaps.append(np.abs(s[i, same[i]] - mining_margin - s[i, ~same[i]].max()))
    return float(np.min(np.concatenate(gaps)))


def _draw_sample_proxy(rng: np.random.Generator, gap_fn, **hyper) -> dict:
    """Embeddings and two proxies per class with ``gap_fn(x, p)`` above ``_KINK_GAP`` and
    no sample within 1e-2 of a proxy's direction (the distance's curvature is 1 / d)."""
    for _ in range(1000):
        x = rng.standard_normal((_LABELS.size, 4))
        p = rng.standard_normal((_PROXY_LABELS.size, 4))
        if np.min(_sample_proxy_distances(x, p)) > 1e-2 and gap_fn(x, p) > _KINK_GAP:
            return {"embeddings": x, "labels": _LABELS, "proxies": p,
                    "proxy_labels": _PROXY_LABELS, **hyper}
    raise RuntimeError("could not draw inputs away from the kinks in 1000 tries")


def _proxy_contrastive_inputs(rng):
    return _draw_sample_proxy(
        rng, lambda x, p: _sample_proxy_contrastive_gap(x, p, 0.9, 1.5),
        pos_margin=0.9, neg_margin=1.5)


def _proxy_contrastive_cosine_inputs(rng):
    def gap(x, p):
        same = _LABELS[:, None] == _PROXY_LABELS[None, :]
        return float(np.min(np.abs(_unit(x) @ _unit(p).T - np.where(same, 0.6, -0.1))))

    return _draw_sample_proxy(rng, gap, form="cosine", pos_margin=0.6, neg_margin=-0.1)


def _proxy_multi_similarity_inputs(rng):
    return _draw_sample_proxy(rng, lambda x, p: _sample_proxy_ms_gap(x, p, 0.3),
                              mining_margin=0.3)


def _on_own_proxy(inputs) -> dict:
    """Sample 0 exactly on proxy 0 (its class's), sample 3 on proxy 2 (its class's)."""
    x = np.array(inputs["embeddings"], copy=True)
    x[0], x[3] = 2.0 * inputs["proxies"][0], 0.5 * inputs["proxies"][2]
    return replaced(inputs, embeddings=x)


def _proxy_contrastive_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_contrastive_inputs(rng)
    return (
        Case("sample on its proxy, positive margin 0",
             replaced(_on_own_proxy(inputs), pos_margin=0.0),
             "two samples on their own class's proxy directions (unit-row distance exactly 0) "
             f"with m+ == 0, so their positive terms are active at d == 0: {_SQRT_AT_ZERO}"),
        Case("exact ties", replaced(_proxy_basis(inputs), pos_margin=0.0, neg_margin=1.5),
             "samples and proxies on +-e_k: every unit-row distance is 0, sqrt(2) or 2 "
             "exactly; the sqrt(2) negatives are all inside the margin and count alike"),
        Case("one class in the batch", replaced(inputs, labels=np.zeros_like(_LABELS)),
             "every sample of class 0: the other proxies are all negatives, the loss the "
             "mean over all n * n_proxies pairs still"),
        *_scale_cases(inputs, names=("embeddings", "proxies"), cosine=True),
    )


def _proxy_contrastive_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _proxy_contrastive_inputs(rng)
    return _proxy_errors(inputs, (bad_scalar(inputs, "neg_margin", -0.5),
                                  bad_scalar(inputs, "pos_margin", -0.1),
                                  _zero_row(inputs, "proxies"),
                                  ErrorCase("unknown form", replaced(inputs, form="angular"),
                                            ValueError, r"form == 'angular'")))


def _proxy_contrastive_cosine_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_contrastive_cosine_inputs(rng)
    return (
        Case("exact ties", _proxy_basis(inputs),
             "every cosine -1, 0 or 1 exactly: tied pairs all count"),
        *_scale_cases(inputs, names=("embeddings", "proxies"), cosine=True),
    )


def _proxy_multi_similarity_cases(rng) -> tuple[Case, ...]:
    inputs = _proxy_multi_similarity_inputs(rng)
    return (
        Case("large alpha and beta", replaced(inputs, alpha=1e4, beta=1e4),
             "alpha (s - base) and beta (s - base) reach 1e4: a naive exp overflows; "
             "log(1 + sum exp) must be a shifted log-sum-exp"),
        Case("one class of proxies",
             replaced(inputs, labels=np.zeros_like(_LABELS),
                      proxy_labels=np.zeros_like(_PROXY_LABELS)),
             "every proxy of the samples' class: no anchor has a negative, so no term: "
             "value 0 and zero gradients, not 0/0"),
        *_proxy_shared_cases(inputs),
    )


def _proxy_multi_similarity_errors(rng) -> tuple[ErrorCase, ...]:
    inputs = _proxy_multi_similarity_inputs(rng)
    return _proxy_errors(inputs, (bad_scalar(inputs, "mining_margin", -0.1),
                                  bad_scalar(inputs, "alpha", 0.0, label="alpha exactly 0"),
                                  _zero_row(inputs, "proxies")))


_REFERENCE_INPUTS = {
    "contrastive": _contrastive_cases,
    "contrastive_cosine": _contrastive_cosine_cases,
    "contrastive_no_positive": _contrastive_no_positive_cases,
    "generalized_contrastive": _generalized_contrastive_cases,
    "triplet": _triplet_cases,
    "triplet_batch_hard": _triplet_batch_hard_cases,
    "multi_similarity": _multi_similarity_cases,
    "proxy_anchor": _proxy_anchor_cases,
    "proxy_nca": _proxy_nca_cases,
    "soft_triple": _soft_triple_cases,
    "proxy_contrastive": _proxy_contrastive_cases,
    "proxy_contrastive_cosine": _proxy_contrastive_cosine_cases,
    "proxy_multi_similarity": _proxy_multi_similarity_cases,
}
_ERROR_INPUTS = {
    "contrastive": _contrastive_errors,
    "contrastive_cosine": _contrastive_cosine_errors,
    "contrastive_no_positive": _contrastive_no_positive_errors,
    "generalized_contrastive": _generalized_contrastive_errors,
    "triplet": lambda rng: _triplet_errors(rng, "all"),
    "triplet_batch_hard": lambda rng: _triplet_errors(rng, "batch_hard"),
    "multi_similarity": _multi_similarity_errors,
    "proxy_anchor": _proxy_anchor_errors,
    "proxy_nca": _proxy_nca_errors,
    "soft_triple": _soft_triple_errors,
    "proxy_contrastive": _proxy_contrastive_errors,
    "proxy_contrastive_cosine": lambda rng: _proxy_errors(
        _proxy_contrastive_cosine_inputs(rng),
        (bad_scalar(_proxy_contrastive_cosine_inputs(rng), "neg_margin", 1.0),)),
    "proxy_multi_similarity": _proxy_multi_similarity_errors,
}


# The losses whose mirror runs the masked log-sum-exp (the losses family's kernels,
# refdml.gpu.losses.IMPLEMENTATIONS) on these inputs, so its Numba kernels under
# use_kernels("cpu") / ("cuda"). Proxy-Anchor and ProxyNCA++ reach it only past their exp
# bound, not on these inputs.
_THROUGH_MASKED_LSE = {"multi_similarity", "soft_triple", "proxy_multi_similarity"}

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
     _proxy_nca_inputs, "ProxyNCA++ loss, Teh et al. 2020 Eq. 5"),
    ("soft_triple", losses.soft_triple_forward, losses.soft_triple_backward,
     fast.soft_triple_forward, fast.soft_triple_backward,
     lambda rng: _proxy_inputs(rng, lambda_=5.0, gamma=0.3, tau=0.5),
     "SoftTriple loss with regulariser, Qian et al. 2019 Eqs. 8-10"),
    ("proxy_contrastive", losses.proxy_contrastive_forward, losses.proxy_contrastive_backward,
     fast.proxy_contrastive_forward, fast.proxy_contrastive_backward,
     _proxy_contrastive_inputs,
     "C2 contrastive between samples and proxies, on unit rows: C2-ASAP's loss, "
     "ASAP Eq. (4.11) and Sec. 5.1"),
    ("proxy_contrastive_cosine", losses.proxy_contrastive_forward,
     losses.proxy_contrastive_backward,
     fast.proxy_contrastive_forward, fast.proxy_contrastive_backward,
     _proxy_contrastive_cosine_inputs,
     "C1 contrastive on cosine between samples and proxies: C1-ASAP's loss, ASAP Sec. 5.1"),
    ("proxy_multi_similarity", losses.proxy_multi_similarity_forward,
     losses.proxy_multi_similarity_backward,
     fast.proxy_multi_similarity_forward, fast.proxy_multi_similarity_backward,
     _proxy_multi_similarity_inputs,
     "multi-similarity with samples as anchors and proxies as pairs: MS-ASAP's loss, "
     "ASAP Eq. (4.11); Wang et al. 2019 Eqs. 7-9"),
)
OPERATORS = tuple(
    OperatorSpec(
        name=f"losses.{name}", forward=forward, backward=backward, make_inputs=make,
        paper=paper, tags=("loss",), mirror=mirror, mirror_backward=mirror_backward,
        kernel_family=fast.IMPLEMENTATIONS if name in _THROUGH_MASKED_LSE else None,
        reference_inputs=_REFERENCE_INPUTS[name], error_inputs=_ERROR_INPUTS[name],
    )
    for name, forward, backward, mirror, mirror_backward, make, paper in _ROWS
)
