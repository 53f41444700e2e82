"""The glyph datasets (refdml.train.data.make_glyphs / make_glyph_collages).

The class selection is checked against matplotlib's fonts read here directly (FT2Font's
character maps), the sampling of the distortion against scipy.ndimage.affine_transform, the
splits and collages by their definitions. The default selection is made (or read from the
user's cache) once per test session, as the reproduce studies' tests use it too.
"""

from __future__ import annotations

import socket
import string
import unicodedata

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")

from refdml.train.data import (  # noqa: E402
    GLYPH_FAMILIES,
    GLYPH_FONTS,
    GlyphDistortion,
    glyph_classes,
    make_glyph_collages,
    make_glyphs,
    render_glyphs,
)
from refdml.train.data import _glyphs  # noqa: E402


@pytest.fixture(scope="module")
def classes():
    # the default cache, as the studies use it: one selection per test session
    return glyph_classes()


def _charmaps():
    from pathlib import Path

    from matplotlib.ft2font import FT2Font

    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    return {stem: set(FT2Font(str(folder / f"{stem}.ttf")).get_charmap())
            for stem, _, _ in GLYPH_FONTS if (folder / f"{stem}.ttf").is_file()}


def test_every_class_is_drawn_by_enough_fonts_that_have_it(classes):
    maps = _charmaps()
    assert len(classes) >= 400          # several hundred classes
    for char, fonts in zip(classes.characters, classes.fonts):
        assert len(fonts) >= 10 and len(set(fonts)) == len(fonts)
        for stem in fonts:
            assert ord(char) in maps[stem], (char, stem)
            if stem.startswith("cm"):   # TeX-encoded: only ASCII letters and digits
                assert char in string.ascii_letters + string.digits
        assert unicodedata.category(char)[0] in "LNPS"
        assert unicodedata.normalize("NFKD", char) == char
    # the masters: one per (class, font), class by class, as the table says
    counts = np.bincount(classes.master_labels, minlength=len(classes))
    np.testing.assert_array_equal(counts, [len(f) for f in classes.fonts])
    stems = [s for s, _, _ in GLYPH_FONTS]
    for k in (0, len(classes) // 2, len(classes) - 1):
        assert [stems[f] for f in classes.master_fonts[classes.master_labels == k]] == list(
            classes.fonts[k])
    assert classes.masters.dtype == np.uint8 and classes.masters.shape[1:] == (32, 32)


def test_homoglyphs_are_one_class_and_lookalikes_stay_apart(classes):
    chars = set(classes.characters)
    assert "A" in chars and "\u0391" not in chars and "\u0410" not in chars  # Greek, Cyrillic A
    assert "o" in chars and "\u043e" not in chars                            # Cyrillic o
    assert {"E", "F", "O", "Q", "l", "1"} <= chars                            # not homoglyphs
    assert "\u00e9" not in chars and "." not in chars    # accented (NFKD), too small


#: Strict criteria (the characters every font draws, roughly): a selection of seconds.
_STRICT = {"min_fonts": 20, "min_distinct": 12, "min_extent": 0.4}


def test_the_selection_is_cached_and_a_damaged_cache_is_recomputed(tmp_path, classes):
    import json

    select = _glyphs._cached_selection.__wrapped__  # bypass the in-process memo
    path = _glyphs._cache_path(tmp_path, _STRICT)
    key = json.dumps(_STRICT, sort_keys=True)
    made = select(key, path)
    assert path.is_file() and 30 <= len(made) < len(classes)
    assert set(made.characters) <= set(classes.characters)
    loaded = select(key, path)
    assert loaded.characters == made.characters
    np.testing.assert_array_equal(loaded.masters, made.masters)
    path.write_bytes(b"not an npz")
    again = select(key, path)
    assert again.characters == made.characters
    np.testing.assert_array_equal(np.load(path)["masters"], made.masters)
    assert not list(tmp_path.glob("*.tmp"))


def test_splits_are_class_disjoint_with_enough_test_classes(classes):
    g = make_glyphs(rng=0, classes=classes, size=16, instances_per_font=1,
                    n_background=(3, 2, 3))
    parts = [set(s.classes) for s in (g.train, g.val, g.test)] + [set(b) for b in g.background]
    for i, a in enumerate(parts):
        for b in parts[i + 1:]:
            assert not a & b
    assert sum(map(len, parts)) == len(classes)
    assert len(g.test.classes) >= 100
    for split in (g.train, g.val, g.test):
        assert set(np.unique(split.labels)) == set(split.classes)
        assert split.images.shape[1:] == (1, 16, 16) and split.images.dtype == np.float32
        assert 0.0 <= split.images.min() and split.images.max() <= 1.0
        # one instance per (class, font) that draws it
        for k in split.classes[:5]:
            fonts = split.fonts[split.labels == k]
            assert sorted(fonts) == sorted(np.flatnonzero(np.isin(
                [s for s, _, _ in GLYPH_FONTS], classes.fonts[k])))


def test_same_seed_same_pixels_other_seed_other_pixels(classes):
    """Deterministic by construction: the draws come from the seeded generator in a fixed
    order and the arithmetic (NumPy elementwise, scipy's separable filters, a 2 x 2 inverse)
    runs single-threaded in one process, so two builds here are bit-identical."""
    a = make_glyphs(rng=5, classes=classes, size=12, max_classes=40)
    b = make_glyphs(rng=5, classes=classes, size=12, max_classes=40)
    c = make_glyphs(rng=6, classes=classes, size=12, max_classes=40)
    for x, y in ((a.train, b.train), (a.test, b.test)):
        np.testing.assert_array_equal(x.images, y.images)
        np.testing.assert_array_equal(x.labels, y.labels)
    assert a.train.classes != c.train.classes or not np.array_equal(a.train.images,
                                                                    c.train.images)


def test_no_network(monkeypatch, classes, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("the glyph datasets must not open a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    fresh = glyph_classes(cache_dir=tmp_path, **_STRICT)     # renders the fonts
    assert fresh.characters == _glyphs._cached_selection.__wrapped__(
        __import__("json").dumps(_STRICT, sort_keys=True), None).characters
    make_glyph_collages(rng=0, classes=classes, size=12, max_classes=30)


def test_sampling_matches_scipy_affine_transform(classes):
    """The vectorised bilinear affine sampling against scipy.ndimage.affine_transform
    (order 1) with the matrix derived here from the drawn angle, shear, scale and shift."""
    from scipy import ndimage

    masters = classes.masters[:12].astype(np.float32) / 255.0
    size = 20
    d = GlyphDistortion(rotation=40.0, scale=(0.7, 1.3), shear=0.4, translation=0.1,
                        dilation=(0,), blur=0.0, noise=0.0)
    draws = _glyphs._draw(masters.shape[0], size, d, np.random.default_rng(3))
    got = _glyphs._apply(masters, size, draws)
    smooth = _glyphs._antialiased(masters, size, draws["dilation"])
    zoom, c_m, c_s = 32 / size, (32 - 1) / 2, (size - 1) / 2
    for i in range(masters.shape[0]):
        th, k, s = draws["theta"][i], draws["shear"][i], draws["scale"][i]
        rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]])
        a_xy = s * rot @ np.array([[1.0, k], [0.0, 1.0]])     # on (x, y) = (col, row)
        swap = np.array([[0.0, 1.0], [1.0, 0.0]])
        m_rc = zoom * swap @ np.linalg.inv(a_xy) @ swap          # on (row, col)
        t_rc = draws["shift"][i][::-1]
        offset = c_m - m_rc @ (np.array([c_s, c_s]) + t_rc)
        want = ndimage.affine_transform(smooth[i].astype(np.float64), m_rc, offset=offset,
                                        output_shape=(size, size), order=1, mode="constant")
        np.testing.assert_allclose(got[i], np.clip(want, 0, 1), atol=2e-5)


def test_clean_renderings_are_centred_and_distortions_change_them(classes):
    ids = [classes.characters.index(c) for c in "Hx"]
    clean = render_glyphs(classes, ids, size=32, distortion=GlyphDistortion.none())
    rows, cols = np.indices((32, 32))
    for img in clean.images[:, 0]:
        mass = img.sum()
        assert abs((img * rows).sum() / mass - 15.5) < 2.5
        assert abs((img * cols).sum() / mass - 15.5) < 2.5
    noisy = render_glyphs(classes, ids, rng=0, size=32)
    assert np.abs(noisy.images - clean.images).mean() > 0.01


# The families, stated here from Unicode's own tables: what each family must hold.
_FAMILY_MEMBERS = {
    "digits": lambda c: unicodedata.decimal(c, None) is not None,
    "arrows": lambda c: 0x2190 <= ord(c) < 0x2200,
    "operators": lambda c: 0x2200 <= ord(c) < 0x2300,
    "currency": lambda c: unicodedata.category(c) == "Sc",
}


def test_distractor_families_are_shared_by_the_splits_and_their_characters_are_not(classes):
    """``families``: every member of each family is a distractor of exactly one split, every
    split has members of every family, and no member is a label (Cifar Collage's shared
    super-classes with sub-classes split across train / validation / test)."""
    assert set(GLYPH_FAMILIES) == set(_FAMILY_MEMBERS)
    g = make_glyphs(rng=3, classes=classes, size=12, instances_per_font=1,
                    families=tuple(GLYPH_FAMILIES))
    labels = set(g.train.classes) | set(g.val.classes) | set(g.test.classes)
    backgrounds = [set(b) for b in g.background]
    assert not any(a & b for i, a in enumerate(backgrounds) for b in backgrounds[i + 1:])
    assert not labels & set().union(*backgrounds)
    assert len(labels) + sum(map(len, backgrounds)) == len(classes)
    for name, member in _FAMILY_MEMBERS.items():
        ids = {i for i, c in enumerate(classes.characters) if member(c)}
        assert len(ids) >= 3, name
        assert ids <= set().union(*backgrounds), name
        for split in backgrounds:
            assert split & ids, name       # the kind is shared by every split
    # every distractor belongs to a family; the draw is the seed's
    assert set().union(*backgrounds) == {
        i for i, c in enumerate(classes.characters)
        if any(f[1](c) for f in GLYPH_FAMILIES.values())}
    again = make_glyphs(rng=3, classes=classes, size=12, instances_per_font=1,
                        families=tuple(GLYPH_FAMILIES))
    assert again.background == g.background
    np.testing.assert_array_equal(again.test.images, g.test.images)
    col = make_glyph_collages(rng=3, classes=classes, size=12, max_classes=40,
                              n_background=(0, 0, 0), families=("digits", "arrows"))
    for split, bg in zip((col.train, col.val, col.test), col.glyphs.background):
        assert set(split.shared_classes) == set(bg)
        assert {classes.characters[i] for i in bg} <= set(string.digits) | {
            chr(o) for o in range(0x2190, 0x2200)}


def test_collages_put_the_label_glyph_in_one_cell_and_distractors_elsewhere(classes):
    col = make_glyph_collages(rng=1, classes=classes, size=12, max_classes=60,
                              n_background=(3, 2, 2), collages_per_image=2)
    glyphs = col.glyphs
    label_classes = set(glyphs.train.classes) | set(glyphs.val.classes) | set(glyphs.test.classes)
    for split, glyph_split, bg in zip((col.train, col.val, col.test),
                                      (glyphs.train, glyphs.val, glyphs.test),
                                      glyphs.background):
        n = len(split)
        assert split.images.shape == (n, 1, 24, 24)
        assert set(split.shared_classes) == set(bg) and not set(bg) & label_classes
        tiles = split.images[:, 0].reshape(n, 2, 12, 2, 12).transpose(0, 1, 3, 2, 4)
        tiles = tiles.reshape(n, 4, 12, 12)
        mask = split.foreground.reshape(n, 2, 12, 2, 12).transpose(0, 1, 3, 2, 4)
        mask = mask.reshape(n, 4, 144)
        assert np.all(mask.all(axis=2).sum(axis=1) == 1)
        np.testing.assert_array_equal(mask.all(axis=2).argmax(axis=1), split.foreground_cell)
        # the class cell is a copy of one of the label class's instances
        for i in range(0, n, max(1, n // 10)):
            own = glyph_split.images[glyph_split.labels == split.labels[i], 0]
            cell = tiles[i, split.foreground_cell[i]]
            assert any(np.array_equal(cell, g) for g in own)
    counts = np.bincount(col.train.foreground_cell, minlength=4)
    assert counts.min() > 0.15 * len(col.train)


@pytest.mark.parametrize("call, error, match", [
    (lambda c: make_glyphs(rng=0, classes=c, size=4), ValueError, "size == 4"),
    (lambda c: make_glyphs(rng=0, classes=c, size=16.0), TypeError, "size"),
    (lambda c: make_glyphs(rng=0, classes=c, fractions=(1, 0, 1)), ValueError, r"fractions\[1\]"),
    (lambda c: make_glyphs(rng=0, classes=c, fractions=(1, 1)), TypeError, "fractions"),
    (lambda c: make_glyphs(rng=0, classes=c, max_classes=2), ValueError, "max_classes == 2"),
    (lambda c: make_glyphs(rng=0, classes=c, max_classes=10, n_background=(4, 4, 1)),
     ValueError, "none for training"),
    (lambda c: make_glyphs(rng=0, classes=c, n_background=(-1, 0, 0)), ValueError,
     r"n_background\[0\]"),
    (lambda c: make_glyphs(rng=0, classes=c, instances_per_font=0), ValueError,
     "instances_per_font == 0"),
    (lambda c: make_glyphs(rng=0, classes="abc"), TypeError, "classes must be"),
    (lambda c: make_glyphs(rng=-1, classes=c), ValueError, "rng == -1"),
    (lambda c: make_glyphs(rng=0, classes=c, distortion={"rotation": 3}), TypeError,
     "distortion must be"),
    (lambda c: make_glyphs(rng=0, classes=c, distortion=GlyphDistortion(scale=(2.0, 1.0))),
     ValueError, "low <= high"),
    (lambda c: make_glyphs(rng=0, classes=c, distortion=GlyphDistortion(noise=float("nan"))),
     ValueError, "distortion.noise"),
    (lambda c: render_glyphs(c, [0, 10**6]), ValueError, "class_ids must lie in"),
    (lambda c: render_glyphs(c, [0.5]), TypeError, "class_ids"),
    (lambda c: make_glyph_collages(rng=0, classes=c, grid=1), ValueError, "grid == 1"),
    (lambda c: make_glyph_collages(rng=0, classes=c, n_background=(1, 0, 1)), ValueError,
     "at least one distractor"),
    (lambda c: make_glyphs(rng=0, classes=c, families="digits"), TypeError, "families must"),
    (lambda c: make_glyphs(rng=0, classes=c, families=("letters",)), ValueError, "'letters'"),
    (lambda c: make_glyphs(rng=0, classes=c, families=("digits", "digits")), ValueError,
     "twice"),
    (lambda c: make_glyphs(rng=0, classes=c, families=("digits",), fractions=(1, 5, 5)),
     ValueError, "none of them for training"),
    (lambda c: glyph_classes(min_fonts=0), ValueError, "min_fonts == 0"),
    (lambda c: glyph_classes(cache_dir=3), TypeError, "cache_dir"),
])
def test_bad_input_is_refused_by_name(classes, call, error, match):
    with pytest.raises(error, match=match):
        call(classes)
