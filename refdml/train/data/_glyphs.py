r"""``glyphs``: a many-class, class-disjoint retrieval benchmark drawn from matplotlib's fonts.

Deep metric learning is evaluated on classes never seen in training, with many classes
(CUB-200: 100 test classes; SOP: 11,318). No package that installs with refdml ships such an
image set, but matplotlib does ship 22 text fonts, and a character drawn by a dozen type
designs and then distorted is an Omniglot-like many-class, few-shot benchmark built from
files already on disk (no network).

**Fonts** (:data:`GLYPH_FONTS`, those of matplotlib's ``mpl-data/fonts/ttf`` that draw
text): DejaVu Sans, DejaVu Sans Mono and DejaVu Serif in four styles each, STIX General in
four, and six Computer Modern fonts (cmr10, cmb10, cmti10, cmmi10, cmss10, cmtt10). The
Computer Modern files are matplotlib's BaKoMa fonts, in TeX's own encoding: their character
map claims Unicode code points, but outside ``A-Z a-z 0-9`` the glyph at a code point is
another character (``<`` is an inverted exclamation mark, ``"`` a closing quote), so only
those 62 characters are taken from them.

**Classes** (:func:`glyph_classes`): the characters that

1. are letters, numbers, punctuation or symbols (Unicode categories L, N, P, S) with no
   compatibility decomposition (``NFKD(c) == c``: accented letters, which repeat their base
   letter with a mark of a few pixels, ligatures, superscripts and fractions are left out);
2. are drawn by at least ``min_fonts`` (10) of the fonts;
3. are drawn *differently* by at least ``min_distinct`` (8) of them: renderings (compared
   at 16 x 16) whose normalised L1 distance :math:`\sum|a - b| / \sum(a + b)` is below
   0.15 count once (the DejaVu styles share their box-drawing characters and arrows, for
   instance);
4. are not too small: the median extent (the larger side of the inked box) over the fonts
   is at least ``min_extent`` (0.4) em (dots, commas, single quotes and the like are left
   out: centred, they are a few pixels of one shape);
5. are not a homoglyph of a kept character: a candidate is dropped when a kept character of
   lower code point renders within 0.05 of it (the distance of 3.) in at least half of the
   fonts that draw both (Latin A, Greek Alpha and Cyrillic A are one class, ``A``; E and F,
   0.14 apart, stay two).

The selection is a pure function of the font files and these criteria (about 600 classes
with matplotlib 3.11's fonts). It renders every candidate in every font, so it is cached on
disk with the masters (``cache_dir``, one ``.npz`` keyed by matplotlib's version, the fonts' bytes, the
rendering constants and the criteria), so it is computed once per installation.

**Rendering.** Each (class, font) pair is rendered by FreeType (matplotlib's ``FT2Font``, no
hinting, anti-aliased) into a *master*: a 32 x 32 coverage map with an em of 22 pixels and
the inked box centred (a glyph larger than 28 pixels is rendered smaller to fit). Letter
case survives this (``o`` is smaller than ``O``): the em, not the glyph, sets the scale. The
masters are stored with the selection (uint8, exactly FreeType's coverage levels).

**Instances** (:class:`GlyphDistortion`). ``instances_per_font`` instances per (class, font),
each a seeded random distortion of the master: dilation of the strokes by 0 or 1 master
pixel (stroke width), a Gaussian anti-aliasing blur of 0.45 M / S master pixels, then the
affine map

.. math::
    m = c_M + \frac{M}{S}\, (R_\theta\, H_\kappa\, s)^{-1} (o - c_S - t)

from output pixel ``o`` to master coordinates ``m`` (rotation ``theta``, shear ``kappa``,
scale ``s``, translation ``t``; ``c`` the centres), sampled bilinearly, a three-tap blur of
weight ``b`` on each side and additive Gaussian noise, clipped to [0, 1]. Everything is
vectorised over instances.

**Splits** (:func:`make_glyphs`): the classes are shuffled by ``rng`` and cut into
train / validation / test (``fractions``, default 0.55 / 0.15 / 0.30), so the test classes
are never seen in training; optionally ``n_background`` classes per split, or the members
of distractor ``families`` (:data:`GLYPH_FAMILIES`), are set aside as the distractors of
:func:`make_glyph_collages` (never a label anywhere).

**Collages** (:func:`make_glyph_collages`, GSP supp. Sec. 2.2's Cifar Collage): a ``grid``
x ``grid`` image whose label is one cell's glyph class and whose other cells hold glyphs of
the split's background classes, the class cell drawn uniformly per image. The distractor
classes of a split are few and shared by all its collages; like the labels, they differ
between the splits. Cifar Collage draws them from 4 super-classes shared by every split
(each super-class's sub-classes split 2 / 1 / 2), so what a model learns to ignore in
training is the *kind* of thing it meets as background at test time. ``n_background``
classes drawn at random share nothing across the splits: nothing learnt about the training
distractors tells a model which test glyphs are the distractors. ``families`` restores the
shared kind: digits, arrows, operators and currency symbols are distractors in every
split, and their members are split like the sub-classes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import string
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from refdml._io import atomic_path
from refdml._validation import _describe, check_rng, check_scalar
from refdml.exceptions import MissingExtraError
from refdml.train.data._collage import CollageSplit

__all__ = ["GLYPH_FAMILIES", "GLYPH_FONTS", "GlyphClasses", "GlyphDistortion", "GlyphSplit",
           "Glyphs", "GlyphCollages", "glyph_classes", "make_glyphs", "make_glyph_collages",
           "render_glyphs"]

#: The text fonts matplotlib ships: ``(file stem, family, style)``.
GLYPH_FONTS: tuple[tuple[str, str, str], ...] = (
    ("DejaVuSans", "DejaVu Sans", "regular"),
    ("DejaVuSans-Bold", "DejaVu Sans", "bold"),
    ("DejaVuSans-Oblique", "DejaVu Sans", "oblique"),
    ("DejaVuSans-BoldOblique", "DejaVu Sans", "bold oblique"),
    ("DejaVuSansMono", "DejaVu Sans Mono", "regular"),
    ("DejaVuSansMono-Bold", "DejaVu Sans Mono", "bold"),
    ("DejaVuSansMono-Oblique", "DejaVu Sans Mono", "oblique"),
    ("DejaVuSansMono-BoldOblique", "DejaVu Sans Mono", "bold oblique"),
    ("DejaVuSerif", "DejaVu Serif", "regular"),
    ("DejaVuSerif-Bold", "DejaVu Serif", "bold"),
    ("DejaVuSerif-Italic", "DejaVu Serif", "italic"),
    ("DejaVuSerif-BoldItalic", "DejaVu Serif", "bold italic"),
    ("STIXGeneral", "STIX General", "regular"),
    ("STIXGeneralBol", "STIX General", "bold"),
    ("STIXGeneralItalic", "STIX General", "italic"),
    ("STIXGeneralBolIta", "STIX General", "bold italic"),
    ("cmr10", "Computer Modern Roman", "regular"),
    ("cmb10", "Computer Modern Roman", "bold"),
    ("cmti10", "Computer Modern Roman", "italic"),
    ("cmmi10", "Computer Modern Math Italic", "italic"),
    ("cmss10", "Computer Modern Sans", "regular"),
    ("cmtt10", "Computer Modern Typewriter", "regular"),
)

#: Kinds of character that collages can take their distractors from (``families`` of
#: :func:`make_glyphs`): name -> (what it holds, the test on one character). Each family's
#: members are split across train / validation / test like Cifar Collage's shared
#: super-classes, whose sub-classes are (GSP supp. Sec. 2.2): the kind is shared, the
#: characters are not.
GLYPH_FAMILIES: dict[str, tuple[str, Callable[[str], bool]]] = {
    "digits": ("decimal digits (Unicode category Nd)",
               lambda c: unicodedata.category(c) == "Nd"),
    "arrows": ("the Arrows block, U+2190-U+21FF", lambda c: 0x2190 <= ord(c) <= 0x21FF),
    "operators": ("the Mathematical Operators block, U+2200-U+22FF",
                  lambda c: 0x2200 <= ord(c) <= 0x22FF),
    "currency": ("currency symbols (Unicode category Sc)",
                 lambda c: unicodedata.category(c) == "Sc"),
}

#: The only characters taken from the Computer Modern (BaKoMa, TeX-encoded) fonts.
_TEX_ENCODED_SAFE = frozenset(string.ascii_letters + string.digits)

MASTER = 32          # master canvas (pixels)
EM = 22              # the em in master pixels
MAX_EXTENT = 28      # a glyph's inked box must fit in this many master pixels
SAME = 0.15          # normalised L1 distance under which two renderings look alike
HOMOGLYPH = 0.05     # ... under which two characters' renderings are the same drawing
_COMPARE = 16        # renderings are compared at 16 x 16 (4 x 4 master-pixel blocks)
_SELECTION_VERSION = 1


def _matplotlib():
    try:
        import matplotlib
        from matplotlib import ft2font
    except ImportError as exc:  # the "train" extra: the glyphs are matplotlib's bundled fonts
        raise MissingExtraError("train", "matplotlib") from exc
    return matplotlib, ft2font


@functools.lru_cache(maxsize=1)
def _font_paths() -> tuple[tuple[str, Path], ...]:
    """``(stem, path)`` of every font of :data:`GLYPH_FONTS` this matplotlib has."""
    matplotlib, _ = _matplotlib()
    folder = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    found = tuple((stem, folder / f"{stem}.ttf") for stem, _, _ in GLYPH_FONTS
                  if (folder / f"{stem}.ttf").is_file())
    if len(found) < 10:
        raise RuntimeError(f"matplotlib's font folder {folder} holds {len(found)} of the "
                           f"{len(GLYPH_FONTS)} fonts of GLYPH_FONTS; the glyph datasets need "
                           "at least 10")
    return found


@functools.lru_cache(maxsize=None)
def _font(stem: str):
    _, ft2font = _matplotlib()
    return ft2font.FT2Font(str(dict(_font_paths())[stem]))


def _no_hinting() -> int:
    _, ft2font = _matplotlib()
    flags = getattr(ft2font, "LoadFlags", None)      # matplotlib >= 3.10
    return flags.NO_HINTING if flags is not None else ft2font.LOAD_NO_HINTING


def _raster(stem: str, char: str, em: float) -> np.ndarray:
    font = _font(stem)
    font.set_size(em * 72.0 / 100.0, 100)            # points at 100 dpi: em pixels
    font.set_text(char, 0.0, flags=_no_hinting())
    font.draw_glyphs_to_bitmap(antialiased=True)
    image = np.asarray(font.get_image(), dtype=np.float32) / 255.0
    rows, cols = np.flatnonzero(image.any(axis=1)), np.flatnonzero(image.any(axis=0))
    if rows.size == 0:
        return image[:0, :0]
    return image[rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1]


def _master(stem: str, char: str) -> tuple[np.ndarray, float]:
    """The 32 x 32 master of ``char`` in font ``stem`` and its extent (in em)."""
    ink = _raster(stem, char, EM)
    extent = max(ink.shape) / EM if ink.size else 0.0
    if max(ink.shape, default=0) > MAX_EXTENT:
        ink = _raster(stem, char, EM * MAX_EXTENT / max(ink.shape) * 0.98)
    out = np.zeros((MASTER, MASTER), np.float32)
    if ink.size:
        h, w = ink.shape
        top, left = (MASTER - h) // 2, (MASTER - w) // 2
        out[top:top + h, left:left + w] = ink[:MASTER, :MASTER]
    return out, extent


def _small(master: np.ndarray) -> np.ndarray:
    k = MASTER // _COMPARE
    return master.reshape(_COMPARE, k, _COMPARE, k).mean(axis=(1, 3)).ravel()


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).sum() / max(float(a.sum() + b.sum()), 1e-12))


# --------------------------------------------------------------------------- selection
@dataclass(frozen=True, eq=False)
class GlyphClasses:
    """The selected characters, the fonts (stems) that draw each, and their masters.

    masters : (P, 32, 32) uint8 coverage (255 = ink) of every (class, font) pair, class by
    class; master_labels, master_fonts : (P,) int64 the class id and the index into
    :data:`GLYPH_FONTS` of each master.
    """

    characters: tuple[str, ...]
    fonts: tuple[tuple[str, ...], ...]
    masters: np.ndarray = field(repr=False)
    master_labels: np.ndarray = field(repr=False)
    master_fonts: np.ndarray = field(repr=False)
    criteria: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.characters)

    def name(self, class_id: int) -> str:
        """``"U+0041 A"``: the code point and the character of class ``class_id``."""
        c = self.characters[class_id]
        return f"U+{ord(c):04X} {c}"


def _default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "refdml" / "glyphs"


def _selection_key(criteria: dict) -> str:
    """Hash of everything the selection and the masters depend on."""
    matplotlib, _ = _matplotlib()
    settings = {"matplotlib": matplotlib.__version__, "version": _SELECTION_VERSION,
                "master": MASTER, "em": EM, "max_extent": MAX_EXTENT, "same": SAME,
                "homoglyph": HOMOGLYPH, **criteria}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for stem, path in _font_paths():
        digest.update(stem.encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:20]


def _coverage() -> dict[str, list[str]]:
    cover: dict[str, list[str]] = {}
    for stem, _ in _font_paths():
        codes = _font(stem).get_charmap()
        for code in sorted(codes):
            char = chr(code)
            if stem.startswith("cm") and char not in _TEX_ENCODED_SAFE:
                continue
            cover.setdefault(char, []).append(stem)
    return cover


def _eligible(char: str) -> bool:
    return (unicodedata.category(char)[0] in "LNPS" and char != "\ufffd"
            and unicodedata.normalize("NFKD", char) == char)


def _select(min_fonts: int, min_distinct: int, min_extent: float) -> dict[str, np.ndarray]:
    """The selection as arrays: ``codes`` (K,), ``masters`` (P, 32, 32) uint8,
    ``master_labels`` and ``master_fonts`` (P,)."""
    cover = _coverage()
    order = [s for s, _ in _font_paths()]
    codes: list[int] = []
    masters_out: list[np.ndarray] = []
    labels_out: list[int] = []
    fonts_out: list[int] = []
    # per font, the 16 x 16 renderings of the kept characters (rows) and their indices:
    # the homoglyph test of a candidate is one vectorised distance per font
    kept = {stem: ([], []) for stem in order}
    for char in sorted(c for c, stems in cover.items()
                       if len(stems) >= min_fonts and _eligible(c)):
        full, small, extents = {}, {}, []
        for stem in cover[char]:
            master, extent = _master(stem, char)
            if extent > 0:
                full[stem] = master
                small[stem] = _small(master)
                extents.append(extent)
        if len(small) < min_fonts or float(np.median(extents)) < min_extent:
            continue
        distinct: list[np.ndarray] = []
        for m in small.values():
            if all(_distance(m, d) >= SAME for d in distinct):
                distinct.append(m)
        if len(distinct) < min_distinct or _is_homoglyph(small, kept, len(codes)):
            continue
        for stem, m in small.items():
            kept[stem][0].append(m)
            kept[stem][1].append(len(codes))
        for stem in sorted(full, key=order.index):
            masters_out.append(np.rint(full[stem] * 255.0).astype(np.uint8))
            labels_out.append(len(codes))
            fonts_out.append([s for s, _, _ in GLYPH_FONTS].index(stem))
        codes.append(ord(char))
    return {"codes": np.asarray(codes, np.int64), "masters": np.stack(masters_out),
            "master_labels": np.asarray(labels_out, np.int64),
            "master_fonts": np.asarray(fonts_out, np.int64)}


def _is_homoglyph(masters: dict[str, np.ndarray], kept: dict, n_kept: int) -> bool:
    """Whether a kept character renders within :data:`HOMOGLYPH` of ``masters`` in at least
    half of the fonts that draw both."""
    same = np.zeros(n_kept, np.int64)
    shared = np.zeros(n_kept, np.int64)
    for stem, m in masters.items():
        rows, index = kept[stem]
        if not rows:
            continue
        k = np.asarray(rows)
        d = np.abs(k - m).sum(axis=1) / np.maximum(k.sum(axis=1) + m.sum(), 1e-12)
        index = np.asarray(index)
        shared[index] += 1
        same[index] += d < HOMOGLYPH
    return bool(np.any((shared > 0) & (2 * same >= shared)))


def glyph_classes(*, min_fonts: int = 10, min_distinct: int = 8, min_extent: float = 0.4,
                  cache_dir: Any = "default") -> GlyphClasses:
    """The characters that make the glyph classes (criteria in the module docstring), with
    their masters.

    ``cache_dir``: where the selection and the masters are kept, one ``.npz`` of about
    10 MB per set of criteria (``"default"``: ``$XDG_CACHE_HOME/refdml/glyphs`` or
    ``~/.cache/refdml/glyphs``; ``None``: no cache). The file is written atomically; an
    unreadable one is recomputed and an unwritable folder only costs the recomputation.
    """
    n_fonts = len(_font_paths())
    min_fonts = check_scalar(min_fonts, "min_fonts", low=1, high=n_fonts, integer=True)
    min_distinct = check_scalar(min_distinct, "min_distinct", low=1, high=n_fonts,
                                integer=True)
    min_extent = check_scalar(min_extent, "min_extent", low=0.0, high=2.0)
    criteria = {"min_fonts": min_fonts, "min_distinct": min_distinct, "min_extent": min_extent}
    return _cached_selection(json.dumps(criteria, sort_keys=True),
                             _cache_path(cache_dir, criteria))


def _cache_path(cache_dir: Any, criteria: dict) -> Path | None:
    if cache_dir is None:
        return None
    if isinstance(cache_dir, str) and cache_dir == "default":
        cache_dir = _default_cache_dir()
    if not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a path, 'default' or None, got {_describe(cache_dir)}")
    return Path(cache_dir) / f"glyphs-{_selection_key(criteria)}.npz"


_ARRAYS = ("codes", "masters", "master_labels", "master_fonts")


def _load(path: Path) -> dict[str, np.ndarray] | None:
    try:
        with np.load(path, allow_pickle=False) as stored:
            arrays = {k: stored[k] for k in _ARRAYS}
    except (OSError, ValueError, KeyError):
        return None   # missing, damaged or foreign: recomputed and overwritten
    masters = arrays["masters"]
    if (masters.dtype != np.uint8 or masters.shape[1:] != (MASTER, MASTER)
            or arrays["master_labels"].shape != masters.shape[:1]):
        return None
    return arrays


@functools.lru_cache(maxsize=8)
def _cached_selection(criteria_json: str, path: Path | None) -> GlyphClasses:
    arrays = _load(path) if path is not None else None
    if arrays is None:
        arrays = _select(**json.loads(criteria_json))
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_path(path) as tmp:
                    with open(tmp, "wb") as handle:
                        np.savez(handle, **arrays)
            except OSError:
                pass  # a read-only home: the selection is recomputed next time
    stems = [s for s, _, _ in GLYPH_FONTS]
    labels, fonts = arrays["master_labels"], arrays["master_fonts"]
    per_class = tuple(tuple(stems[f] for f in fonts[labels == k])
                      for k in range(arrays["codes"].shape[0]))
    return GlyphClasses(tuple(chr(c) for c in arrays["codes"]), per_class,
                        masters=arrays["masters"], master_labels=labels, master_fonts=fonts,
                        criteria=json.loads(criteria_json))


# --------------------------------------------------------------------------- instances
@dataclass(frozen=True, kw_only=True)
class GlyphDistortion:
    """The per-instance random distortion (module docstring), each drawn uniformly.

    rotation : maximal |angle| in degrees; scale : (low, high) factor, drawn log-uniformly;
    shear : maximal |shear| (x += shear * y); translation : maximal |shift| as a fraction of
    the image side; dilation : the stroke dilations (master pixels) drawn among;
    blur : maximal weight of each side tap of the 3-tap blur [b, 1 - 2b, b];
    noise : maximal standard deviation of the additive Gaussian noise.
    :meth:`none` is the identity (clean renderings, as in the class figures).
    """

    rotation: float = 12.0
    scale: tuple[float, float] = (0.85, 1.15)
    shear: float = 0.2
    translation: float = 0.06
    dilation: tuple[int, ...] = (0, 1)
    blur: float = 0.2
    noise: float = 0.05

    @classmethod
    def none(cls) -> "GlyphDistortion":
        return cls(rotation=0.0, scale=(1.0, 1.0), shear=0.0, translation=0.0,
                   dilation=(0,), blur=0.0, noise=0.0)

    def checked(self) -> "GlyphDistortion":
        check_scalar(self.rotation, "distortion.rotation", low=0.0, high=180.0)
        if not (isinstance(self.scale, tuple) and len(self.scale) == 2):
            raise TypeError(f"distortion.scale must be a (low, high) tuple, got {self.scale!r}")
        lo = check_scalar(self.scale[0], "distortion.scale[0]", low=0.25, high=4.0)
        hi = check_scalar(self.scale[1], "distortion.scale[1]", low=0.25, high=4.0)
        if lo > hi:
            raise ValueError(f"distortion.scale == {self.scale!r}, must have low <= high")
        check_scalar(self.shear, "distortion.shear", low=0.0, high=1.0)
        check_scalar(self.translation, "distortion.translation", low=0.0, high=0.5)
        if not (isinstance(self.dilation, tuple) and self.dilation):
            raise TypeError(f"distortion.dilation must be a non-empty tuple of integers, "
                            f"got {self.dilation!r}")
        for i, d in enumerate(self.dilation):
            check_scalar(d, f"distortion.dilation[{i}]", low=0, high=2, integer=True)
        check_scalar(self.blur, "distortion.blur", low=0.0, high=1.0 / 3.0)
        check_scalar(self.noise, "distortion.noise", low=0.0, high=1.0)
        return self


def _disk(radius: int) -> np.ndarray:
    r = np.arange(-radius, radius + 1)
    return (r[:, None] ** 2 + r[None, :] ** 2) <= radius * radius


def _bilinear(images: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """``images`` (n, M, M) sampled bilinearly at (n, S, S) coordinates, zero outside.

    In the zero-padded frame a coordinate is clipped to [0, M + 1]; there the floor is at
    most M, so the four neighbours are in the frame and a point outside the image reads the
    zero border with weight 1."""
    n, m, _ = images.shape
    width = m + 2
    flat = np.pad(images, ((0, 0), (1, 1), (1, 1))).ravel()
    r = np.clip(rows + 1, 0, m + 1).astype(np.float32)
    c = np.clip(cols + 1, 0, m + 1).astype(np.float32)
    r0 = np.minimum(np.floor(r), m)
    c0 = np.minimum(np.floor(c), m)
    fr, fc = r - r0, c - c0
    base = ((np.arange(n) * width * width)[:, None, None] + r0.astype(np.int64) * width
            + c0.astype(np.int64))
    top = flat[base] * (1 - fc) + flat[base + 1] * fc
    bottom = flat[base + width] * (1 - fc) + flat[base + width + 1] * fc
    return top * (1 - fr) + bottom * fr


def _draw(n: int, size: int, d: GlyphDistortion, gen: np.random.Generator) -> dict:
    """The random parameters of ``n`` instances, every draw for all instances in a fixed
    order (the pixels depend on the seed only)."""
    return {
        "dilation": np.asarray(d.dilation)[gen.integers(len(d.dilation), size=n)],
        "theta": np.deg2rad(gen.uniform(-d.rotation, d.rotation, size=n)),
        "scale": np.exp(gen.uniform(np.log(d.scale[0]), np.log(d.scale[1]), size=n)),
        "shear": gen.uniform(-d.shear, d.shear, size=n),
        "shift": gen.uniform(-d.translation, d.translation, size=(n, 2)) * size,
        "blur": gen.uniform(0.0, d.blur, size=n).astype(np.float32),
        "noise": gen.uniform(0.0, d.noise, size=n).astype(np.float32),
        "gaussian": gen.standard_normal((n, size, size), dtype=np.float32),
    }


def _inverse_maps(draws: dict) -> np.ndarray:
    """(n, 2, 2) inverses of ``A = s R(theta) H(shear)`` acting on (x, y) = (col, row)."""
    theta, shear, scale = draws["theta"], draws["shear"], draws["scale"]
    cos, sin = np.cos(theta), np.sin(theta)
    a = np.empty((theta.shape[0], 2, 2))
    a[:, 0, 0], a[:, 0, 1] = cos, cos * shear - sin
    a[:, 1, 0], a[:, 1, 1] = sin, sin * shear + cos
    return np.linalg.inv(a * scale[:, None, None])


def _antialiased(masters: np.ndarray, size: int, dilation: np.ndarray) -> np.ndarray:
    """The masters dilated per instance, then blurred for sampling every M / S pixels."""
    from scipy import ndimage

    x = masters.copy()
    for radius in np.unique(dilation):
        if radius > 0:
            pick = dilation == radius
            x[pick] = ndimage.grey_dilation(x[pick], footprint=_disk(int(radius))[None])
    sigma = 0.45 * MASTER / size
    return ndimage.gaussian_filter(x, sigma=(0, sigma, sigma), mode="constant")


def _apply(masters: np.ndarray, size: int, draws: dict) -> np.ndarray:
    """The instances of ``masters`` (n, M, M) under ``draws`` (module docstring)."""
    n = masters.shape[0]
    x = _antialiased(masters, size, draws["dilation"])
    # output (row, col) -> master: m = c_M + zoom * A^-1 (o - c_S - t)
    inv = _inverse_maps(draws).astype(np.float32)
    shift = draws["shift"].astype(np.float32)
    grid = np.arange(size, dtype=np.float32) - np.float32((size - 1) / 2.0)
    ox = grid[None, None, :] - shift[:, 0, None, None]        # (n, 1, S) columns
    oy = grid[None, :, None] - shift[:, 1, None, None]        # (n, S, 1) rows
    zoom, centre = np.float32(MASTER / size), np.float32((MASTER - 1) / 2.0)
    cols = centre + zoom * (inv[:, 0, 0, None, None] * ox + inv[:, 0, 1, None, None] * oy)
    rows = centre + zoom * (inv[:, 1, 0, None, None] * ox + inv[:, 1, 1, None, None] * oy)
    out = _bilinear(x, rows, cols)
    b = draws["blur"][:, None, None]
    for axis in (1, 2):
        pad = [(0, 0), (0, 0), (0, 0)]
        pad[axis] = (1, 1)
        padded = np.pad(out, pad)
        lo = padded[:, :-2] if axis == 1 else padded[:, :, :-2]
        hi = padded[:, 2:] if axis == 1 else padded[:, :, 2:]
        out = (1 - 2 * b) * out + b * (lo + hi)
    out = out + draws["noise"][:, None, None] * draws["gaussian"]
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def render_glyphs(classes: GlyphClasses, class_ids, *, rng: Any = None, size: int = 28,
                  instances_per_font: int = 1,
                  distortion: GlyphDistortion | None = None) -> "GlyphSplit":
    """Instances of ``class_ids`` (indices into ``classes``): every font of each class,
    ``instances_per_font`` distorted copies each (``distortion=None``: the default
    :class:`GlyphDistortion`; :meth:`GlyphDistortion.none` for clean renderings)."""
    size = check_scalar(size, "size", low=8, high=256, integer=True)
    instances_per_font = check_scalar(instances_per_font, "instances_per_font", low=1,
                                      high=1000, integer=True)
    distortion = (GlyphDistortion() if distortion is None else distortion)
    if not isinstance(distortion, GlyphDistortion):
        raise TypeError(f"distortion must be a GlyphDistortion or None, got "
                        f"{_describe(distortion)}")
    distortion = distortion.checked()
    gen = check_rng(rng)
    ids = np.asarray(class_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) and ids.size:
        raise TypeError(f"class_ids must be a 1-d sequence of integers, got {_describe(class_ids)}")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= len(classes)):
        raise ValueError(f"class_ids must lie in [0, {len(classes)}), got values from "
                         f"{ids.min()} to {ids.max()}")
    labels, fonts = classes.master_labels, classes.master_fonts
    pick = np.flatnonzero(np.isin(labels, ids))
    pick = np.repeat(pick, instances_per_font)
    images = np.empty((pick.size, size, size), np.float32)
    chunk = 2048
    # one child generator per chunk, spawned in order: same seed, same pixels
    children = gen.spawn((pick.size + chunk - 1) // chunk) if pick.size else []
    for i, child in enumerate(children):
        part = pick[i * chunk:(i + 1) * chunk]
        masters = classes.masters[part].astype(np.float32) / np.float32(255.0)
        draws = _draw(part.size, size, distortion, child)
        images[i * chunk:i * chunk + part.size] = _apply(masters, size, draws)
    return GlyphSplit(images=images[:, None], labels=labels[pick], fonts=fonts[pick],
                      classes=tuple(int(c) for c in np.unique(ids)))


# --------------------------------------------------------------------------- splits
@dataclass(frozen=True)
class GlyphSplit:
    """One split of glyph instances.

    images : (N, 1, S, S) float32 in [0, 1] (ink 1, paper 0).
    labels : (N,) int64 class ids (indices into :attr:`Glyphs.classes`).
    fonts : (N,) int64 index into :data:`GLYPH_FONTS` of the font each instance comes from.
    classes : sorted class ids of the split.
    """

    images: np.ndarray
    labels: np.ndarray
    fonts: np.ndarray
    classes: tuple[int, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])


@dataclass(frozen=True)
class Glyphs:
    """Class-disjoint glyph splits and the class table.

    ``background``: per split (train, val, test), the class ids set aside as collage
    distractors (empty unless ``n_background`` or ``families`` was given); they are in no
    split's labels.
    """

    train: GlyphSplit
    val: GlyphSplit
    test: GlyphSplit
    classes: GlyphClasses
    background: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    size: int

    def class_name(self, class_id: int) -> str:
        return self.classes.name(class_id)


def _check_counts(value, name: str, kind: type) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise TypeError(f"{name} must be a tuple of 3 numbers (train, val, test), got {value!r}")
    if kind is int:
        return tuple(check_scalar(v, f"{name}[{i}]", low=0, integer=True)
                     for i, v in enumerate(value))
    return tuple(check_scalar(v, f"{name}[{i}]", low=0.0, low_inclusive=False)
                 for i, v in enumerate(value))


def _split_sizes(n: int, f: np.ndarray) -> tuple[int, int, int]:
    """``(train, val, test)`` sizes of ``n`` items cut by the fractions ``f`` (summing to 1):
    validation and test rounded, at least one each; training the rest (may be < 1)."""
    n_val = max(1, int(np.rint(f[1] * n)))
    n_test = max(1, int(np.rint(f[2] * n)))
    return n - n_val - n_test, n_val, n_test


def _cut(items: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n_train, n_val, _ = _split_sizes(items.size, f)
    return items[:n_train], items[n_train:n_train + n_val], items[n_train + n_val:]


def _check_families(families) -> None:
    if isinstance(families, str) or not isinstance(families, (tuple, list)):
        raise TypeError(f"families must be a tuple of names of GLYPH_FAMILIES, got "
                        f"{families!r}")
    for name in families:
        if name not in GLYPH_FAMILIES:
            raise ValueError(f"families: {name!r} is not one of {tuple(GLYPH_FAMILIES)}")
    if len(set(families)) != len(families):
        raise ValueError(f"families == {tuple(families)} names a family twice")


def _family_background(classes: GlyphClasses, families, f: np.ndarray, fractions,
                       gen: np.random.Generator) -> tuple[list[list[int]], np.ndarray]:
    """Per split, the family members that are its distractors (each family shuffled by
    ``gen`` and cut by ``f``), and the (n_classes,) mask of every family member."""
    in_family = np.zeros(len(classes), dtype=bool)
    background: list[list[int]] = [[], [], []]
    for name in families:
        member = GLYPH_FAMILIES[name][1]
        ids = np.array([i for i, c in enumerate(classes.characters) if member(c)], np.int64)
        if ids.size < 3:
            raise ValueError(f"families: {name!r} has {ids.size} member(s) in this "
                             "selection, fewer than the 3 splits")
        part = _cut(gen.permutation(ids), f)
        if part[0].size < 1:
            raise ValueError(f"families: {name!r} has {ids.size} members, and fractions == "
                             f"{fractions} leave none of them for training")
        for split, chosen in zip(background, part):
            split.extend(int(c) for c in chosen)
        in_family[ids] = True
    return background, in_family


def make_glyphs(*, rng: Any, size: int = 28, instances_per_font: int = 2,
                fractions: tuple[float, float, float] = (0.55, 0.15, 0.30),
                max_classes: int | None = None, n_background: tuple[int, int, int] = (0, 0, 0),
                families: tuple[str, ...] = (), eval_instances_per_font: int | None = None,
                distortion: GlyphDistortion | None = None,
                classes: GlyphClasses | None = None) -> Glyphs:
    """Class-disjoint train / validation / test glyphs (module docstring).

    ``rng`` draws the class split (``max_classes`` classes at most, drawn first) and the
    distortions: same seed, same pixels. ``fractions`` are of the label classes, after
    ``n_background`` classes per split are set aside as collage distractors; each split
    gets at least one class. ``families`` (names of :data:`GLYPH_FAMILIES`): every member
    of each family is a distractor too, never a label; each family's members are shuffled
    and cut by ``fractions`` (at least one per split), so the splits share the families and
    none of their characters. They are set aside before ``max_classes`` draws.
    ``instances_per_font`` copies per (class, font) in training,
    ``eval_instances_per_font`` (default the same) in validation and test. ``classes``:
    a :func:`glyph_classes` selection (default: its defaults).
    """
    classes = glyph_classes() if classes is None else classes
    if not isinstance(classes, GlyphClasses):
        raise TypeError(f"classes must be a GlyphClasses (glyph_classes()), got "
                        f"{_describe(classes)}")
    fractions = _check_counts(fractions, "fractions", float)
    n_background = _check_counts(n_background, "n_background", int)
    eval_copies = (instances_per_font if eval_instances_per_font is None else
                   check_scalar(eval_instances_per_font, "eval_instances_per_font", low=1,
                                high=1000, integer=True))
    _check_families(families)
    gen = check_rng(rng)
    f = np.asarray(fractions) / sum(fractions)
    family_background, in_family = _family_background(classes, families, f, fractions, gen)
    others = np.flatnonzero(~in_family)     # all classes without families: the same draw
    order = others[gen.permutation(others.size)]
    if max_classes is not None:
        max_classes = check_scalar(max_classes, "max_classes", low=3, integer=True)
        order = order[:max_classes]
    n_labels = order.size - sum(n_background)
    n_train, n_val, n_test = _split_sizes(n_labels, f)
    if n_train < 1:
        raise ValueError(f"{order.size} classes with n_background == {n_background} and "
                         f"fractions == {fractions} leave {n_labels} label classes, "
                         f"{n_val} + {n_test} of them for validation and test and none "
                         "for training")
    background = []
    start = 0
    for count, extra in zip(n_background, family_background):
        background.append(tuple(sorted([int(c) for c in order[start:start + count]] + extra)))
        start += count
    parts = _cut(order[start:], f)
    splits = [render_glyphs(classes, np.sort(part), rng=gen, size=size,
                            instances_per_font=instances_per_font if i == 0 else eval_copies,
                            distortion=distortion)
              for i, part in enumerate(parts)]
    return Glyphs(*splits, classes=classes, background=tuple(background), size=size)


# --------------------------------------------------------------------------- collages
@dataclass(frozen=True)
class GlyphCollages:
    """Glyph collages per split (:class:`~refdml.train.data.CollageSplit` s: images
    (N, 1, g S, g S), labels, foreground masks, the class cell) and their glyphs."""

    train: CollageSplit
    val: CollageSplit
    test: CollageSplit
    glyphs: Glyphs

    def class_name(self, class_id: int) -> str:
        return self.glyphs.class_name(class_id)


def _collage_split(split: GlyphSplit, distractors: GlyphSplit, grid: int, copies: int,
                   gen: np.random.Generator) -> CollageSplit:
    n_cells = grid * grid
    images = np.repeat(split.images[:, 0], copies, axis=0)
    labels = np.repeat(split.labels, copies)
    n, size = images.shape[0], images.shape[-1]
    cell = gen.integers(n_cells, size=n)
    pool = distractors.images[:, 0]
    other = pool[gen.integers(pool.shape[0], size=(n, n_cells - 1))]
    tiles = np.empty((n, n_cells, size, size), np.float32)
    rows = np.arange(n)
    others = np.array([[j for j in range(n_cells) if j != p] for p in range(n_cells)])[cell]
    tiles[rows, cell] = images
    tiles[rows[:, None], others] = other
    side = grid * size

    def stitch(t):
        return t.reshape(n, grid, grid, size, size).transpose(0, 1, 3, 2, 4).reshape(n, side, side)

    mask = np.zeros((n, n_cells, size, size), dtype=bool)
    mask[rows, cell] = True
    return CollageSplit(images=stitch(tiles)[:, None], labels=labels, foreground=stitch(mask),
                        foreground_cell=cell.astype(np.int64), classes=split.classes,
                        shared_classes=distractors.classes)


def make_glyph_collages(*, rng: Any, grid: int = 2, collages_per_image: int = 1,
                        eval_collages_per_image: int = 1,
                        n_background: tuple[int, int, int] = (8, 4, 8),
                        families: tuple[str, ...] = (),
                        **glyph_options: Any) -> GlyphCollages:
    """Glyph collages (module docstring): :func:`make_glyphs` with ``n_background``
    distractor classes per split and the members of ``families`` (each family's characters
    split across the splits; ``glyph_options`` are passed on), then per glyph
    ``collages_per_image`` (training) / ``eval_collages_per_image`` (validation and test)
    collages of ``grid`` x ``grid`` cells, the label's glyph in a uniformly drawn cell and
    distractor instances of the same split in the others. Deterministic given ``rng``."""
    grid = check_scalar(grid, "grid", low=2, high=8, integer=True)
    copies = check_scalar(collages_per_image, "collages_per_image", low=1, high=1000,
                          integer=True)
    eval_copies = check_scalar(eval_collages_per_image, "eval_collages_per_image", low=1,
                               high=1000, integer=True)
    n_background = _check_counts(n_background, "n_background", int)
    if min(n_background) < 1 and not families:
        raise ValueError(f"n_background == {n_background} and no families: every split needs "
                         "at least one distractor class")
    gen = check_rng(rng)
    glyphs = make_glyphs(rng=gen, n_background=n_background, families=families,
                         **glyph_options)
    distractors = [render_glyphs(glyphs.classes, ids, rng=gen, size=glyphs.size,
                                 distortion=glyph_options.get("distortion"))
                   for ids in glyphs.background]
    splits = [_collage_split(s, d, grid, copies if i == 0 else eval_copies, gen)
              for i, (s, d) in enumerate(zip((glyphs.train, glyphs.val, glyphs.test),
                                              distractors))]
    return GlyphCollages(*splits, glyphs=glyphs)
