"""refdml.train.data: the tokens study against GSP supp. 2.1, digits-collage, npz features,
class-disjoint splits and the P x K sampler (batches, determinism, resume)."""

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from numpy.testing import assert_allclose, assert_array_equal

from refdml.train.data import (
    TOKEN_VALUE_RANGE,
    PKBatchSampler,
    class_disjoint_split,
    clip_token_table,
    init_token_table,
    load_features,
    make_digits_collage,
    make_token_splits,
    make_tokens,
)

# ----------------------------------------------------------------------------- tokens


@pytest.fixture(scope="module")
def tokens():
    return make_tokens(400, rng=0)


def test_tokens_layout_matches_the_paper(tokens):
    # 16 classes x 4 class tokens + 4 shared background tokens, 50 tokens per sample.
    assert tokens.token_ids.shape == (16 * 400, 50)
    assert tokens.n_tokens == 68
    assert_array_equal(np.bincount(tokens.labels), np.full(16, 400))
    fg, ids = tokens.foreground, tokens.token_ids
    background = np.unique(ids[~fg])
    assert_array_equal(background, np.arange(64, 68))
    for c in range(16):
        rows = tokens.labels == c
        class_ids = np.unique(ids[rows][fg[rows]])
        assert_array_equal(class_ids, np.arange(4 * c, 4 * c + 4))  # exactly its 4 tokens
    # Drawn with replacement, uniformly: each class token ~ 1/4 of a class's class tokens.
    share = np.bincount(ids[fg] % 4, minlength=4) / fg.sum()
    assert_allclose(share, 0.25, atol=0.01)
    share_bg = np.bincount(ids[~fg] - 64, minlength=4) / (~fg).sum()
    assert_allclose(share_bg, 0.25, atol=0.01)


def test_tokens_mixing_ratio_statistics(tokens):
    mu = tokens.mixing_ratio
    # N(0.5, 0.1) (std 0.1) over 6400 samples: standard errors 0.00125 (mean), 0.0009 (std).
    assert_allclose(mu.mean(), 0.5, atol=0.006)
    assert_allclose(mu.std(), 0.1, atol=0.005)
    n_fg = tokens.foreground.sum(axis=1)
    assert_array_equal(n_fg, np.rint(50 * mu))
    # Background share of a sample is 1 - mu up to the rounding to whole tokens.
    assert np.all(np.abs((~tokens.foreground).mean(axis=1) - (1 - mu)) <= 0.01 + 1e-12)
    assert_allclose((~tokens.foreground).mean(), 0.5, atol=0.006)


def test_tokens_worked_example_mu_04_gives_20_class_and_30_background_tokens():
    t = make_tokens(3, rng=1, mixing_mean=0.4, mixing_std=0.0)
    assert_array_equal(t.foreground.sum(axis=1), np.full(48, 20))
    assert_array_equal((t.token_ids >= 64).sum(axis=1), np.full(48, 30))


def test_tokens_positions_are_shuffled(tokens):
    # Class tokens are not always the first ones: every position holds both kinds.
    per_position = tokens.foreground.mean(axis=0)
    assert_allclose(per_position, tokens.foreground.mean(), atol=0.05)


def test_tokens_deterministic_under_a_seed():
    a, b, c = make_tokens(5, rng=7), make_tokens(5, rng=7), make_tokens(5, rng=8)
    assert_array_equal(a.token_ids, b.token_ids)
    assert_array_equal(a.foreground, b.foreground)
    assert not np.array_equal(a.token_ids, c.token_ids)
    s1, s2 = make_token_splits(rng=3), make_token_splits(rng=3)
    assert_array_equal(s1.test.token_ids, s2.test.token_ids)
    assert not np.array_equal(s1.train.token_ids[:16], s1.val.token_ids[:16])  # independent draws
    assert (len(s1.train), len(s1.val), len(s1.test)) == (64 * 16, 16 * 16, 16 * 16)


def test_token_table_value_range():
    low, high = TOKEN_VALUE_RANGE
    assert (low, high) == (-0.3, 0.3)
    table = init_token_table(68, 32, rng=0)
    assert table.shape == (68, 32) and table.dtype == np.float64
    assert table.min() >= low and table.max() <= high
    assert table.min() < -0.29 and table.max() > 0.29  # fills the range
    assert init_token_table(4, 2, rng=0, dtype=np.float32).dtype == np.float32
    moved = table * 3.0
    expected = np.clip(moved, low, high)
    out = clip_token_table(moved)
    assert out is moved  # in place
    assert_array_equal(moved, expected)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"n_per_class": 0}, ValueError, "n_per_class"),
        ({"n_per_class": 2.5}, TypeError, "n_per_class"),
        ({"n_per_class": 2, "rng": -1}, ValueError, "rng"),
        ({"n_per_class": 2, "mixing_std": -0.1}, ValueError, "mixing_std"),
        ({"n_per_class": 2, "mixing_mean": 1.5}, ValueError, "mixing_mean"),
        ({"n_per_class": 2, "n_classes": 1}, ValueError, "n_classes"),
    ],
)
def test_tokens_named_errors(kwargs, error, name):
    with pytest.raises(error, match=name):
        make_tokens(**{"rng": 0, **kwargs})


def test_token_table_named_errors():
    with pytest.raises(TypeError, match="dtype"):
        init_token_table(4, 2, rng=0, dtype=np.int32)
    with pytest.raises(ValueError, match="dim"):
        init_token_table(4, 0, rng=0)


# ----------------------------------------------------------------------------- splits


@given(
    counts=st.lists(st.integers(1, 6), min_size=3, max_size=25),
    seed=st.integers(0, 2**32 - 1),
)
def test_class_disjoint_split_partitions_the_classes(counts, seed):
    labels = np.repeat(np.arange(len(counts)) * 3 + 1, counts)  # non-contiguous class ids
    labels = labels[np.random.default_rng(seed).permutation(labels.shape[0])]
    split = class_disjoint_split(labels, rng=seed)
    parts = (split.train_classes, split.val_classes, split.test_classes)
    assert all(p.shape[0] >= 1 for p in parts)
    assert_array_equal(np.sort(np.concatenate(parts)), np.unique(labels))  # cover, disjoint
    idx = (split.train, split.val, split.test)
    assert_array_equal(np.sort(np.concatenate(idx)), np.arange(labels.shape[0]))
    for i, c in zip(idx, parts):
        assert_array_equal(np.unique(labels[i]), c)
    again = class_disjoint_split(labels, rng=seed)
    assert_array_equal(again.test, split.test)


def test_class_disjoint_split_sizes_and_errors():
    labels = np.repeat(np.arange(20), 2)
    s = class_disjoint_split(labels, rng=0, fractions=(0.5, 0.25, 0.25))
    assert (len(s.train_classes), len(s.val_classes), len(s.test_classes)) == (10, 5, 5)
    with pytest.raises(ValueError, match="at least 3"):
        class_disjoint_split([0, 0, 1, 1], rng=0)
    with pytest.raises(ValueError, match="fractions"):
        class_disjoint_split(labels, rng=0, fractions=(0.5, 0.0, 0.5))
    with pytest.raises(TypeError, match="labels"):
        class_disjoint_split([0.5, 1.0, 2.0], rng=0)


# ----------------------------------------------------------------------------- sampler


def _check_batches(batches, labels, p, k):
    for b in batches:
        assert b.dtype == np.int64 and b.shape == (p * k,)
        cls = labels[b].reshape(p, k)
        assert np.all(cls == cls[:, :1])  # grouped class by class, K each
        assert np.unique(cls[:, 0]).shape[0] == p  # P distinct classes


def test_sampler_batches_are_p_classes_by_k_samples():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(12), rng.integers(4, 15, size=12))
    labels = labels[rng.permutation(labels.shape[0])]
    s = PKBatchSampler(labels, n_classes_per_batch=5, n_samples_per_class=4, rng=1)
    epoch = list(s)
    assert len(epoch) >= 1
    _check_batches(epoch, labels, 5, 4)
    flat = np.concatenate(epoch)
    assert np.unique(flat).shape[0] == flat.shape[0]  # no sample twice in an epoch
    # Chunks available: sum floor(m / K); at most P - 1 classes' chunks can be stranded.
    chunks = np.bincount(labels) // 4
    assert len(epoch) * 5 <= chunks.sum()
    assert len(epoch) * 5 >= chunks.sum() - 4 * chunks.max()
    assert s.epoch == 1
    second = list(s)
    assert not all(np.array_equal(a, b) for a, b in zip(epoch, second))  # reshuffled


def test_sampler_deterministic_under_a_seed():
    labels = np.repeat(np.arange(16), 8)
    a = PKBatchSampler(labels, n_classes_per_batch=16, n_samples_per_class=4, rng=3)
    b = PKBatchSampler(labels, n_classes_per_batch=16, n_samples_per_class=4, rng=3)
    for _ in range(2):
        for x, y in zip(list(a), list(b), strict=True):
            assert_array_equal(x, y)
    # The paper's token batch: 16 classes x 4 samples, 8 per class -> 2 batches an epoch.
    assert len(a) == 2


def test_sampler_short_classes():
    labels = np.array([0] * 8 + [1] * 8 + [2] * 2 + [3] * 8)
    rep = PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=4, rng=0)
    seen = np.concatenate([np.concatenate(list(rep)) for _ in range(4)])
    _check_batches([seen[i:i + 8] for i in range(0, seen.shape[0], 8)], labels, 2, 4)
    short = seen[labels[seen] == 2]
    assert short.shape[0] > 0 and set(short.tolist()) == {16, 17}  # both, topped up
    skip = PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=4, rng=0,
                          short_classes="skip")
    assert not np.any(labels[np.concatenate(list(skip))] == 2)
    with pytest.raises(ValueError, match="single sample"):
        PKBatchSampler(np.array([0, 0, 1, 1, 2]), n_classes_per_batch=2, n_samples_per_class=2, rng=0)
    with pytest.raises(ValueError, match="fewer than n_classes_per_batch"):
        PKBatchSampler(labels, n_classes_per_batch=4, n_samples_per_class=4, rng=0,
                       short_classes="skip")
    with pytest.raises(ValueError, match="short_classes"):
        PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=4, rng=0,
                       short_classes="drop")
    with pytest.raises(ValueError, match="n_samples_per_class"):
        PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=0, rng=0)


@pytest.mark.parametrize("stop_after", [0, 3, 7, 8])
def test_sampler_resume_gives_identical_batches(stop_after):
    rng = np.random.default_rng(5)
    labels = np.repeat(np.arange(10), rng.integers(3, 12, size=10))
    kw = dict(n_classes_per_batch=3, n_samples_per_class=3)
    a = PKBatchSampler(labels, rng=11, **kw)
    list(a)  # a full epoch first
    it = iter(a)
    for _ in range(min(stop_after, len(a))):
        next(it)
    state = json.loads(json.dumps(a.state_dict()))  # survives a JSON checkpoint
    rest_a = list(it) + list(a) + list(a)
    b = PKBatchSampler(labels, rng=999, **kw)
    b.load_state_dict(state)
    # a finished its current epoch, then two more; b, from the state, yields the same stream
    # (an epoch saved complete, position == len, continues with the next epoch).
    rest_b = []
    while len(rest_b) < len(rest_a):
        rest_b.extend(b)
    assert len(rest_a) > 0
    for x, y in zip(rest_a, rest_b[:len(rest_a)], strict=True):
        assert_array_equal(x, y)


def test_sampler_resume_rejects_another_setup():
    labels = np.repeat(np.arange(6), 4)
    a = PKBatchSampler(labels, n_classes_per_batch=2, n_samples_per_class=2, rng=0)
    other = PKBatchSampler(labels, n_classes_per_batch=3, n_samples_per_class=2, rng=0)
    with pytest.raises(ValueError, match="other labels or with other settings"):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="lacks"):
        a.load_state_dict({"seed": 1})
    with pytest.raises(TypeError, match="state"):
        a.load_state_dict([1, 2])


# ----------------------------------------------------------------------------- digits-collage


@pytest.fixture(scope="module")
def collage():
    return make_digits_collage(rng=0)


def test_collage_shapes_and_values(collage):
    for s in (collage.train, collage.val, collage.test):
        n = len(s)
        assert s.images.shape == (n, 1, 16, 16) and s.images.dtype == np.float64
        assert s.images.min() >= 0.0 and s.images.max() <= 1.0
        assert s.foreground.shape == (n, 16, 16)
        assert_array_equal(s.foreground.sum(axis=(1, 2)), np.full(n, 64))  # one 8x8 cell
        assert_array_equal(np.unique(s.labels), s.classes)
    assert (len(collage.train.classes), len(collage.val.classes), len(collage.test.classes)) == (8, 4, 4)
    assert len(collage.train) + len(collage.val) + len(collage.test) < 1797  # shared digits excluded


def test_collage_classes_disjoint_foreground_and_background(collage):
    splits = (collage.train, collage.val, collage.test)
    used = [set(s.classes) | set(s.shared_classes) for s in splits]
    for i in range(3):
        for j in range(i + 1, 3):
            assert not used[i] & used[j]
    shared_digits = {c // 2 for s in splits for c in s.shared_classes}
    assert len(shared_digits) == 2
    assert not shared_digits & {c // 2 for s in splits for c in s.classes}
    assert set().union(*used) == set(range(20))


def test_collage_cells_hold_the_right_images(collage):
    # Oracle: the raw digits. The class cell is an image of the labelled digit in the labelled
    # orientation; every other cell is an image of a shared class of the same split.
    from sklearn.datasets import load_digits

    d = load_digits()
    raw = d.images / 16.0
    lookup = {}
    for img, t in zip(raw, d.target):
        lookup.setdefault(img.tobytes(), set()).add(2 * t)
        lookup.setdefault(np.ascontiguousarray(np.rot90(img)).tobytes(), set()).add(2 * t + 1)
    for s in (collage.train, collage.test):
        for i in range(0, len(s), 37):
            img = s.images[i, 0]
            for cell in range(4):
                r, c = divmod(cell, 2)
                tile = np.ascontiguousarray(img[8 * r:8 * r + 8, 8 * c:8 * c + 8])
                owners = lookup[tile.tobytes()]
                if cell == s.foreground_cell[i]:
                    assert s.labels[i] in owners
                    assert s.foreground[i, 8 * r, 8 * c]
                else:
                    assert owners & set(s.shared_classes)
                    assert not s.foreground[i, 8 * r:8 * r + 8, 8 * c:8 * c + 8].any()


def test_collage_deterministic_and_named_errors(collage):
    again = make_digits_collage(rng=0)
    assert_array_equal(again.test.images, collage.test.images)
    other = make_digits_collage(rng=1)
    assert not np.array_equal(other.train.labels, collage.train.labels) or not np.array_equal(
        other.train.images, collage.train.images)
    two = make_digits_collage(rng=0, collages_per_image=2)
    assert len(two.train) == 2 * len(collage.train)
    with pytest.raises(ValueError, match="collages_per_image"):
        make_digits_collage(rng=0, collages_per_image=0)
    # Evaluation splits with their own count; the training split does not change.
    mixed = make_digits_collage(rng=0, collages_per_image=2, eval_collages_per_image=1)
    assert_array_equal(mixed.train.images, two.train.images)
    assert (len(mixed.val), len(mixed.test)) == (len(collage.val), len(collage.test))
    assert len(two.val) == 2 * len(collage.val)
    with pytest.raises(ValueError, match="eval_collages_per_image"):
        make_digits_collage(rng=0, eval_collages_per_image=0)


# ----------------------------------------------------------------------------- features npz


def _write(tmp_path, name="f.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


def test_load_features_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5, 3)).astype(np.float32)
    y = np.array([0, 0, 1, 1, 2, 2], dtype=np.int32)
    data = load_features(_write(tmp_path, features=x, labels=y))
    assert data.features.dtype == np.float64 and data.labels.dtype == np.int64
    assert_array_equal(data.features, x.astype(np.float64))
    assert_array_equal(data.labels, y)
    f32 = load_features(_write(tmp_path, "g.npz", X=x, y=y.astype(float)), features_key="X",
                        labels_key="y", dtype=np.float32)
    assert f32.features.dtype == np.float32 and len(f32) == 6


_X = np.zeros((4, 3, 2))
_Y = np.array([0, 0, 1, 1])


@pytest.mark.parametrize(
    "arrays, error, match",
    [
        ({"labels": _Y}, KeyError, "'features'"),
        ({"features": _X}, KeyError, "'labels'"),
        ({"features": np.zeros((4, 6)), "labels": _Y}, ValueError, r"\(N, n, d\)"),
        ({"features": np.zeros((4, 0, 2)), "labels": _Y}, ValueError, r"\(N, n, d\)"),
        ({"features": _X, "labels": _Y[:3]}, ValueError, r"shape \(4,\)"),
        ({"features": _X, "labels": _Y[:, None]}, ValueError, r"shape \(4,\)"),
        ({"features": np.where(np.arange(24).reshape(4, 3, 2) == 7, np.nan, 0.0), "labels": _Y},
         ValueError, "1 NaN or inf entries .first in sample 1"),
        ({"features": np.full((4, 3, 2), np.inf), "labels": _Y}, ValueError, "NaN or inf"),
        ({"features": _X.astype(complex), "labels": _Y}, TypeError, "real numbers"),
        ({"features": _X, "labels": np.array([0, 0.5, 1, 1])}, ValueError, "integer labels, got 0.5"),
        ({"features": _X, "labels": np.array(["a", "a", "b", "b"])}, TypeError, "integer labels"),
        ({"features": _X, "labels": np.zeros(4, dtype=int)}, ValueError, "at least 2"),
        ({"features": _X, "labels": np.array([0, 0, 0, 1])}, ValueError,
         r"fewer than min_samples_per_class == 2 samples \(first: \[1\]\)"),
        ({"features": np.array([[[object()]]] * 4, dtype=object), "labels": _Y}, TypeError, "pickle"),
    ],
)
def test_load_features_named_errors(tmp_path, arrays, error, match):
    with pytest.raises(error, match=match):
        load_features(_write(tmp_path, **arrays))


def test_load_features_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_features(tmp_path / "missing.npz")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_features(garbage)
    single = tmp_path / "single.npy"
    np.save(single, _X)
    with pytest.raises(ValueError, match="single array"):
        load_features(single)
    with pytest.raises(TypeError, match="path"):
        load_features(3)
    ok = _write(tmp_path, features=_X, labels=_Y)
    with pytest.raises(ValueError, match="min_samples_per_class"):
        load_features(ok, min_samples_per_class=0)
    assert len(load_features(ok, min_samples_per_class=1)) == 4
