r"""Figures of a training run: curves, GSP attention maps, a 2-D view of embeddings.

Matplotlib is the optional ``plot`` extra (``pip install "refdml[plot]"``); it is imported
only inside the plotting functions, so :func:`gsp_weights`, :func:`feature_grid`,
:func:`pca_2d` and :func:`upsample_weights` work without it. The figures are drawn on a
bare :class:`matplotlib.figure.Figure` (no pyplot, no global backend switch, no figure
left open), written atomically to ``out_path`` (:func:`refdml._io.save_figure`: format
from its suffix; parent folders created) and returned, so a caller (or a test) can
inspect the axes.

``plot_curves(log_path_or_rows, out_path)``
    The training loss (left) and the validation / test MAP@R (right) per epoch, from the
    trainer's ``log.jsonl`` (epoch 0 = the untrained model: no loss, but its MAP@R).
``plot_attention(images, weights, out_path, ...)``
    GSP's pooling weights as attention maps. With ``(rho, pi)`` the solution of (P2) on the
    cost map, the weight of local feature ``j`` is

    .. math::
        w_j = \frac{1 - n \rho_j}{\mu},\qquad w_j \in [0, 1/\mu],\qquad
        \frac1n \sum_j w_j = 1,

    (the pooled vector is ``(1/n) sum_j w_j f_j``, GSP Eq. 4.1; the mean is 1 because
    ``sum_j rho_j = 1 - mu``). Local feature ``j = h W' + w`` sits at cell ``(h, w)`` of the
    ``H' x W'`` feature map; each pixel of the ``H x W`` image takes the weight of the cell
    that covers it (nearest neighbour: cell ``(r H' // H, c W' // W)``). Each image is
    drawn beside its weight map; the true class cell of a collage (``CollageSplit.foreground``)
    is outlined on both, and the share of the weight mass that falls in it is printed
    (a uniform map puts 1/4 of it in one cell of the 2 x 2 collage).
``plot_embeddings_2d(embeddings, labels, out_path)``
    Test embeddings projected on their first two principal components (:func:`pca_2d`,
    NumPy's SVD); at most ten classes in colour with a legend (with more classes, ten spread
    evenly over the labels, the rest in grey, and the title says which).

``gsp_weights(model, ctx)`` reads ``w`` from the context of a forward pass (of a
:class:`~refdml.train.Sequential` holding a :class:`~refdml.train.layers.GSPHead`, or of
the head itself): no second forward, no trainer needed. docs/train_plots.md shows a run.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from refdml._io import read_lines, save_figure
from refdml._validation import _describe, as_float_array, as_label_array, check_scalar
from refdml._backend import to_numpy
from refdml.exceptions import MissingExtraError
from refdml.train._conv import LocalLinearContext
from refdml.train._heads import GSPHead, HeadContext
from refdml.train._layer import Layer, Sequential
from refdml.train.data import GLYPH_FONTS, GlyphClasses, GlyphDistortion, render_glyphs

__all__ = [
    "feature_grid",
    "gsp_weights",
    "pca_2d",
    "plot_attention",
    "plot_curves",
    "plot_embeddings_2d",
    "plot_glyphs",
    "upsample_weights",
]

#: An embedding plot shows at most this many classes in colour, with a legend (tab10's
#: ten qualitative colours); with more classes, the others are drawn in grey.
MAX_SHOWN_CLASSES = 10


def _figure_class():
    """matplotlib's Figure, or an ImportError that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # the "plot" extra
        raise MissingExtraError("plot", "matplotlib") from error
    return Figure


def _check_out_path(out_path) -> Path:
    """A figure file to write: a path, not a folder, whose suffix (if any) is a format
    matplotlib writes (checked before any drawing; matplotlib is imported by then)."""
    if isinstance(out_path, (bytes, bool)) or not isinstance(out_path, (str, os.PathLike)):
        raise TypeError(f"out_path must be a path (str or os.PathLike), got {_describe(out_path)}")
    text = os.fspath(out_path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"out_path == {text!r}, must name a file")
    path = Path(text)
    if path.is_dir():
        raise ValueError(f"out_path == {text!r} is a folder, not a file")
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = path.suffix[1:].lower()
    if suffix and suffix not in formats:
        raise ValueError(f"out_path == {text!r}: matplotlib writes no {suffix!r} files; use "
                         f"one of {sorted(formats)}")
    return path


def _check_title(title, *, optional: bool) -> None:
    if not (isinstance(title, str) or (optional and title is None)):
        wanted = "a str or None" if optional else "a str"
        raise TypeError(f"title must be {wanted}, got {_describe(title)}")


def _check_pair(value, name: str) -> tuple[int, int]:
    """``(rows, columns)``: two integers >= 1, each named ``name[i]``."""
    if not isinstance(value, (tuple, list, np.ndarray)) or len(value) != 2:
        raise TypeError(f"{name} must be a pair of integers (rows, columns), got "
                        f"{_describe(value)}")
    first, second = (check_scalar(v, f"{name}[{i}]", low=1, integer=True)
                     for i, v in enumerate(value))
    return first, second


def _class_name(class_names, label) -> str:
    """The name of class ``label``: ``class_names(label)``, ``class_names[label]`` or the label."""
    if class_names is None:
        return str(label)
    if callable(class_names):
        return str(class_names(label))
    if not hasattr(class_names, "__getitem__") or isinstance(class_names, (str, bytes)):
        raise TypeError(f"class_names must be a callable or a mapping (label -> name), got "
                        f"{_describe(class_names)}")
    try:
        return str(class_names[label])
    except (KeyError, IndexError):
        raise ValueError(f"class_names has no name for class {label}") from None


def _save(fig, out_path) -> Path:
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out_path, dpi=120, bbox_inches="tight")


# --------------------------------------------------------------------------- GSP weights
def _gsp_contexts(model: Layer, ctx: Any) -> list[tuple[GSPHead, HeadContext, Any]]:
    """``(head, head_ctx, local_ctx)`` for every GSP head of ``model``, in layer order.

    ``local_ctx`` is the context of the last LocalLinear before the head (None if none).
    """
    if isinstance(model, GSPHead):
        return [(model, model.check_own_context(ctx), None)]
    if not isinstance(model, Sequential):
        raise TypeError(f"model must be a Sequential or a GSPHead, got {_describe(model)}")
    model.check_own_context(ctx)
    found = []
    previous = None
    for layer, layer_ctx in zip(model.layers, ctx.contexts):
        if isinstance(layer, Sequential):
            inner = _gsp_contexts(layer, layer_ctx)
            found.extend((h, c, p if p is not None else previous) for h, c, p in inner)
        elif isinstance(layer, GSPHead):
            found.append((layer, layer_ctx, previous))
        if isinstance(layer_ctx, LocalLinearContext):
            previous = layer_ctx
    return found


def _one_head(model, ctx, head: int):
    found = _gsp_contexts(model, ctx)
    if not found:
        raise ValueError(f"model has no GSPHead: {model!r}")
    if not isinstance(head, int) or isinstance(head, bool):
        raise TypeError(f"head must be an int, got {_describe(head)}")
    if not -len(found) <= head < len(found):
        raise ValueError(f"head == {head}, model has {len(found)} GSPHead(s)")
    return found[head]


def gsp_weights(model: Layer, ctx: Any, *, head: int = 0):
    r"""The pooling weights ``w = (1 - n rho) / mu`` (B, n) of a forward pass of ``model``.

    ``model`` is a :class:`~refdml.train.Sequential` (nested ones included) holding a
    :class:`~refdml.train.layers.GSPHead`, or the head itself; ``ctx`` is the context its
    ``forward`` returned. ``head`` picks the GSP head (in layer order) when there are several.
    The weights are those the forward pooled with (the pooling context's ``weights``, for
    the reference and the fast path alike), in the model's array module and dtype (CuPy
    on a GPU: :func:`refdml._backend.to_numpy` brings them to the host).
    """
    _, head_ctx, _ = _one_head(model, ctx, head)
    return head_ctx.inner.weights


def feature_grid(model: Layer, ctx: Any, *, head: int = 0) -> tuple[int, int] | None:
    """``(H', W')`` of the feature map the GSP head pooled, or None if unknown.

    Known when a :class:`~refdml.train.layers.LocalLinear` (the 1x1 conv that turns a
    ``(B, C, H', W')`` map into local features ``j = h W' + w``) comes before the head
    (shape-keeping layers such as a ReLU may sit between) and ``H' W'`` is the head's ``n``.
    """
    _, head_ctx, local = _one_head(model, ctx, head)
    if local is None:
        return None
    grid = tuple(int(s) for s in local.x_shape[2:])
    return grid if grid[0] * grid[1] == head_ctx.inner.features.shape[1] else None


def upsample_weights(weights, grid: tuple[int, int], image_shape: tuple[int, int]) -> np.ndarray:
    """Per-location weights (B, H' W') as (B, H, W) maps on the image grid (nearest cell).

    Pixel ``(r, c)`` takes the weight of feature cell ``(r H' // H, c W' // W)``: with a
    stride-2 feature map of a 16 x 16 image, each weight covers a 2 x 2 block of pixels.
    ``weights``: real and finite, NumPy or CuPy, one map (n,) or a batch (B, n); the maps
    come back in float64 on the host. ``grid`` and ``image_shape``: pairs of integers >= 1.
    """
    if weights is None:
        raise TypeError("weights must be an array of real numbers, got None")
    w = as_float_array(to_numpy(weights), "weights", ndim=(1, 2), allow_empty=True)
    if w.ndim == 1:
        w = w[None]
    gh, gw = _check_pair(grid, "grid")
    height, width = _check_pair(image_shape, "image_shape")
    if w.shape[1] != gh * gw:
        raise ValueError(
            f"weights has shape {w.shape}, expected (B, {gh * gw}) for the grid {gh} x {gw}"
        )
    if w.shape[0] * height * width >= 2**63:   # NumPy could not index such an array
        raise ValueError(f"image_shape == {(height, width)}: {w.shape[0]} maps of that size "
                         "exceed 2**63 entries")
    rows = np.arange(height) * gh // height
    cols = np.arange(width) * gw // width
    return w.reshape(-1, gh, gw)[:, rows[:, None], cols[None, :]]


# --------------------------------------------------------------------------- curves
#: The numbers plot_curves draws, with their range (None: any finite value).
_CURVE_KEYS = {"train_loss": None, "val_map_at_r": (0.0, 1.0), "test_map_at_r": (0.0, 1.0)}


def _read_rows(log_path_or_rows) -> tuple[list[dict], str | None]:
    """The log's rows, checked (named errors), and the run folder's name (None for rows).

    A file is read as :meth:`~refdml.train.Trainer.resume` reads it
    (:func:`refdml._io.read_lines`): a last line cut by a kill (no newline) is dropped.
    """
    if isinstance(log_path_or_rows, (str, os.PathLike)):
        path = Path(log_path_or_rows)
        if path.is_dir():
            path = path / "log.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"log_path_or_rows: no training log at {path}")
        try:
            lines = read_lines(path)
        except UnicodeDecodeError as error:
            raise ValueError(f"{path} is not UTF-8 text ({error})") from None
        rows = []
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise ValueError(f"{path} line {number} is not a log row (JSON): "
                                 f"{line[:80]!r}") from None
            rows.append((f"{path} line {number}", row))
        _check_rows(rows)
        return [row for _, row in rows], path.resolve().parent.name
    if isinstance(log_path_or_rows, Sequence) and not isinstance(log_path_or_rows, (str, bytes)):
        rows = [(f"log_path_or_rows[{i}]", row) for i, row in enumerate(log_path_or_rows)]
        _check_rows(rows)
        return [row for _, row in rows], None
    raise TypeError(
        "log_path_or_rows must be a path to log.jsonl (or its run folder) or a list of log "
        f"rows (dicts), got {_describe(log_path_or_rows)}"
    )


def _check_rows(rows: list[tuple[str, Any]]) -> None:
    """Each row a dict with an integer ``epoch`` >= 0, epochs increasing, and the plotted
    numbers finite (MAP@R in [0, 1]) or null."""
    previous = None
    for where, row in rows:
        if not isinstance(row, dict):
            raise TypeError(f"{where} must be a log row (a dict), got {_describe(row)}")
        if "epoch" not in row:
            raise ValueError(f"{where} has no 'epoch'")
        epoch = check_scalar(row["epoch"], f"{where}['epoch']", low=0, integer=True)
        if previous is not None and epoch <= previous:
            raise ValueError(f"{where} has epoch {epoch} after epoch {previous}: the epochs "
                             "of a log increase")
        previous = epoch
        for key, bounds in _CURVE_KEYS.items():
            if row.get(key) is not None:
                low, high = bounds or (None, None)
                check_scalar(row[key], f"{where}[{key!r}]", low=low, high=high)


def _series(rows, key):
    xs = [r["epoch"] for r in rows if r.get(key) is not None]
    ys = [r[key] for r in rows if r.get(key) is not None]
    return xs, ys


def plot_curves(log_path_or_rows, out_path, *, title: str | None = None):
    """Training loss and validation / test MAP@R per epoch (two panels); returns the Figure.

    ``log_path_or_rows``: the trainer's ``log.jsonl``, its run folder, or the rows
    :meth:`~refdml.train.Trainer.fit` returned. ``title`` defaults to the run folder's
    name (``"training run"`` for rows). The epoch of the best validation MAP@R is marked.
    """
    Figure = _figure_class()
    out_path = _check_out_path(out_path)
    _check_title(title, optional=True)
    rows, run = _read_rows(log_path_or_rows)
    if not rows:
        raise ValueError("the log has no rows: nothing to plot")
    fig = Figure(figsize=(10, 4), layout="constrained")
    loss_ax, map_ax = fig.subplots(1, 2)
    xs, ys = _series(rows, "train_loss")
    loss_ax.plot(xs, ys, marker="o", color="C0", label="training loss (mean over the epoch)")
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("training loss")
    loss_ax.set_title("training loss")
    if not xs:
        loss_ax.text(0.5, 0.5, "no training epoch yet", ha="center", va="center",
                     transform=loss_ax.transAxes)
    for key, name, colour in (("val_map_at_r", "validation", "C1"), ("test_map_at_r", "test", "C2")):
        xs, ys = _series(rows, key)
        if xs:
            map_ax.plot(xs, ys, marker="o", color=colour, label=f"{name} classes")
    xs, ys = _series(rows, "val_map_at_r")
    if xs:
        best = int(np.argmax(ys))
        map_ax.axvline(xs[best], color="0.6", linestyle=":",
                       label=f"best validation (epoch {xs[best]})")
    map_ax.set_xlabel("epoch (0 = untrained model)")
    map_ax.set_ylabel("MAP@R")
    map_ax.set_title("retrieval on unseen classes")
    if map_ax.get_legend_handles_labels()[0]:
        map_ax.legend(loc="best", fontsize="small")
    else:
        map_ax.text(0.5, 0.5, "no MAP@R in the log", ha="center", va="center",
                    transform=map_ax.transAxes)
    epochs = [r["epoch"] for r in rows]
    for ax in (loss_ax, map_ax):
        ax.grid(alpha=0.3)
        if max(epochs) <= 20:
            ax.set_xticks(range(min(epochs), max(epochs) + 1))
    fig.suptitle(title or f"run: {run}" if (title or run) else "training run")
    _save(fig, out_path)
    return fig


# --------------------------------------------------------------------------- attention
def _images_2d(images) -> np.ndarray:
    wanted = "images must be (N, H, W) or (N, 1, H, W) grey-level images"
    if images is None:
        raise TypeError(f"{wanted}, got None")
    images = as_float_array(to_numpy(images), "images", allow_empty=True)
    if images.ndim == 4 and images.shape[1] == 1:
        images = images[:, 0]
    if images.ndim != 3 or min(images.shape) < 1:
        raise ValueError(f"{wanted}, N, H, W >= 1, got shape {images.shape}")
    return images


def _outline(ax, mask: np.ndarray, colour: str) -> None:
    """Draw the boundary of the True region of ``mask`` (H, W) along pixel edges."""
    m = np.pad(mask.astype(bool), 1)
    height, width = mask.shape
    for r in range(height + 1):  # horizontal edges between rows r-1 and r
        for c in np.nonzero(m[r, 1:-1] != m[r + 1, 1:-1])[0]:
            ax.plot([c - 0.5, c + 0.5], [r - 0.5, r - 0.5], color=colour, linewidth=2)
    for c in range(width + 1):
        for r in np.nonzero(m[1:-1, c] != m[1:-1, c + 1])[0]:
            ax.plot([c - 0.5, c - 0.5], [r - 0.5, r + 0.5], color=colour, linewidth=2)


def plot_attention(images, weights, out_path, *, grid: tuple[int, int] | None = None,
                   foreground=None, labels=None, class_names=None, mu: float | None = None,
                   title: str = "GSP pooling weights", max_images: int = 8):
    r"""Each image beside its GSP pooling-weight map; returns the Figure.

    Parameters
    ----------
    images : (N, H, W) or (N, 1, H, W)
        Grey-level images (e.g. ``CollageSplit.images``).
    weights : (N, n)
        ``w = (1 - n rho) / mu`` per local feature (:func:`gsp_weights`), NumPy or CuPy.
    grid : (H', W'), optional
        The feature map's shape, ``H' W' = n`` (:func:`feature_grid`); default: a square
        grid if ``n`` is a square, else the image's aspect ratio.
    foreground : (N, H, W) bool, optional
        The true class cell (``CollageSplit.foreground``): outlined, and the share of the
        weight mass inside it printed.
    labels, class_names : optional
        Per-image labels, and a callable (e.g. ``DigitsCollage.class_name``) or mapping
        naming them.
    mu : float, optional
        GSP's transported mass; fixes the colour scale to ``[0, 1/mu]`` (the weights'
        range), so maps of different images and runs compare. Default: ``[0, max w]``.
    max_images : int >= 1
        Rows drawn (the first ``max_images`` images).

    Raises
    ------
    ValueError
        Images and weights must be real and finite; ``mu`` in (0, 1]; ``labels`` integers,
        one per image; a class missing from a ``class_names`` mapping is a ValueError.
    """
    Figure = _figure_class()
    out_path = _check_out_path(out_path)
    _check_title(title, optional=False)
    images = _images_2d(images)
    if weights is None:
        raise TypeError("weights must be an array of real numbers, got None")
    w = as_float_array(to_numpy(weights), "weights", allow_empty=True)
    if w.ndim != 2 or w.shape[0] != images.shape[0] or w.shape[1] < 1:
        raise ValueError(
            f"weights must be (N, n) with N = {images.shape[0]} images and n >= 1, got shape "
            f"{w.shape}"
        )
    if grid is not None:
        grid = _check_pair(grid, "grid")
    if mu is not None:
        mu = check_scalar(mu, "mu", low=0.0, high=1.0, low_inclusive=False)
    if labels is not None:
        labels = as_label_array(to_numpy(labels), "labels", length=images.shape[0])
    n_images = min(images.shape[0], check_scalar(max_images, "max_images", low=1,
                                                 integer=True))
    height, width = images.shape[1:]
    n = w.shape[1]
    if grid is None:
        side = math.isqrt(n)
        if side * side == n:
            grid = (side, side)
        else:
            gh = round(math.sqrt(n * height / width))
            if gh < 1 or n % gh:
                raise ValueError(f"cannot infer the feature grid of n = {n} locations: pass grid")
            grid = (gh, n // gh)
    maps = upsample_weights(w[:n_images], grid, (height, width))
    if foreground is not None:
        foreground = np.asarray(to_numpy(foreground), dtype=bool)
        if foreground.shape != images.shape:
            raise ValueError(
                f"foreground has shape {foreground.shape}, must match the images {images.shape}"
            )
    vmax = 1.0 / mu if mu is not None else float(maps.max()) if maps.size else 1.0
    fig = Figure(figsize=(6.2, 2.6 * n_images + 0.6), layout="constrained")
    axes = np.asarray(fig.subplots(n_images, 2, squeeze=False))
    last_map = None
    for i in range(n_images):
        image_ax, map_ax = axes[i]
        image_ax.imshow(images[i], cmap="gray_r", vmin=0.0, vmax=max(1.0, images[i].max()))
        last_map = map_ax.imshow(maps[i], cmap="viridis", vmin=0.0, vmax=vmax)
        name = ""
        if labels is not None:
            name = f"class {_class_name(class_names, int(labels[i]))}"
        image_ax.set_title(f"image {i}" + (f", {name}" if name else ""), fontsize="medium")
        subtitle = f"weights on the {grid[0]}x{grid[1]} feature map"
        if foreground is not None:
            mask = foreground[i]
            _outline(image_ax, mask, "red")
            _outline(map_ax, mask, "red")
            share = maps[i][mask].sum() / maps[i].sum() if maps[i].sum() > 0 else float("nan")
            subtitle = f"weight in class cell: {share:.0%}"
        map_ax.set_title(subtitle, fontsize="medium")
        for ax in (image_ax, map_ax):
            ax.set_xticks(range(0, width, max(1, width // 4)))
            ax.set_yticks(range(0, height, max(1, height // 4)))
            ax.set_xlabel("x (pixel)")
            ax.set_ylabel("y (pixel)")
    fig.colorbar(last_map, ax=axes[:, 1].tolist(), shrink=0.8,
                 label=r"pooling weight $w_j = (1 - n\rho_j)/\mu$ (mean 1)")
    note = " (red: the class cell)" if foreground is not None else ""
    fig.suptitle(title + note)
    _save(fig, out_path)
    return fig


# --------------------------------------------------------------------------- embeddings
def pca_2d(embeddings) -> tuple[np.ndarray, np.ndarray]:
    """Project (N, d) on the first two principal components; returns ``(coords, ratio)``.

    ``coords`` (N, 2) = ``(X - mean) V[:, :2]`` with ``X - mean = U S V^T`` (NumPy's SVD),
    each component's sign fixed so its largest-magnitude loading is positive
    (deterministic); ``ratio`` (2,) the share of the total variance of each component.
    One-dimensional data give a zero second column.

    Any finite scale works (1e-300 .. 1e300): the data are first multiplied by the power
    of two ``2**-e`` that brings ``max |X|`` into [0.5, 1), which is exact (a change of
    the exponent only), and the coordinates are multiplied back by ``2**e``; ``ratio``
    does not depend on the scale. Coordinates beyond the float64 range (``|X|`` near
    1.8e308) are a ValueError. Real (integer or float), finite input only.
    """
    if embeddings is None:
        raise TypeError("embeddings must be an array of real numbers, got None")
    x = as_float_array(to_numpy(embeddings), "embeddings", allow_empty=True)
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 1:
        raise ValueError(f"embeddings must be (N, d) with N >= 2 and d >= 1, got shape {x.shape}")
    # Squares of 1e160 overflow and of 1e-160 underflow: work at max |x| in [0.5, 1).
    _, exponent = np.frexp(np.max(np.abs(x)))
    x = np.ldexp(x, -int(exponent))
    centred = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    vt = vt[:2]
    signs = np.sign(vt[np.arange(vt.shape[0]), np.argmax(np.abs(vt), axis=1)])
    vt = vt * np.where(signs == 0, 1.0, signs)[:, None]
    with np.errstate(over="ignore"):
        coords = np.ldexp(centred @ vt.T, int(exponent))
    if not np.all(np.isfinite(coords)):
        raise ValueError(
            f"embeddings: the principal coordinates exceed the float64 range (max "
            f"|embeddings| == {np.ldexp(np.max(np.abs(x)), int(exponent)):.3g})")
    total = float(np.sum(s ** 2))
    ratio = s[:2] ** 2 / total if total > 0 else np.zeros(min(2, s.shape[0]))
    if coords.shape[1] < 2:
        coords = np.concatenate([coords, np.zeros((coords.shape[0], 1))], axis=1)
        ratio = np.concatenate([ratio, [0.0]])
    return coords, ratio


def _shown_classes(classes: np.ndarray) -> np.ndarray:
    """The classes drawn in colour: all of them up to :data:`MAX_SHOWN_CLASSES`, else that
    many spread evenly over the ``C`` sorted labels, the first and the last included: the
    ones at indices ``floor(i (C - 1) / 9)``, ``i = 0 .. 9`` (in integers, so no rounding
    decides). The same labels give the same classes, whatever the embeddings."""
    if classes.shape[0] <= MAX_SHOWN_CLASSES:
        return classes
    steps = np.arange(MAX_SHOWN_CLASSES, dtype=np.int64)
    return classes[steps * (classes.shape[0] - 1) // (MAX_SHOWN_CLASSES - 1)]


def plot_embeddings_2d(embeddings, labels, out_path, *, class_names=None,
                       title: str = "test embeddings (PCA)"):
    """Scatter of the embeddings' first two principal components, one colour per class.

    At most :data:`MAX_SHOWN_CLASSES` (10) classes are drawn in colour, with a legend
    (class names via ``class_names``, a callable or mapping); with more, ten classes spread
    evenly over the sorted labels (:func:`_shown_classes`) are coloured, the others drawn
    small in grey, and the title says which: ``10 of 179 classes: 0, 19, ...``. The
    projection is of all the embeddings. Returns the Figure.
    """
    Figure = _figure_class()
    out_path = _check_out_path(out_path)
    _check_title(title, optional=False)
    coords, ratio = pca_2d(embeddings)
    labels = as_label_array(to_numpy(labels), "labels", length=coords.shape[0])
    classes = np.unique(labels)
    shown = _shown_classes(classes)
    names = [_class_name(class_names, int(c)) for c in shown]
    fig = Figure(figsize=(6.5, 5), layout="constrained")
    ax = fig.subplots()
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    if shown.shape[0] < classes.shape[0]:
        rest = ~np.isin(labels, shown)
        ax.scatter(coords[rest, 0], coords[rest, 1], s=5, color="0.75", alpha=0.5,
                   label=f"the other {classes.shape[0] - shown.shape[0]} classes")
    for k, (c, name) in enumerate(zip(shown, names)):
        where = labels == c
        ax.scatter(coords[where, 0], coords[where, 1], s=14, color=cmap(k), alpha=0.85,
                   label=f"class {name}")
    ax.set_xlabel(f"principal component 1 ({ratio[0]:.0%} of variance)")
    ax.set_ylabel(f"principal component 2 ({ratio[1]:.0%} of variance)")
    heading = f"{title}: {coords.shape[0]} samples, {classes.shape[0]} classes"
    if shown.shape[0] < classes.shape[0]:
        which = f"{shown.shape[0]} of {classes.shape[0]} classes: {', '.join(names)}"
        heading += "\n" + textwrap.shorten(which, 90, placeholder=" ...")
    ax.set_title(heading, fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", title="class")
    _save(fig, out_path)
    return fig


def _rectangle(x: float, y: float, width: float, height: float):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, height, fill=False, edgecolor="tab:red", linewidth=1.2)


def plot_glyphs(classes, out_path, *, n_classes: int = 16, collages=None,
                n_collages: int = 8, rng=0,
                title: str = "glyph classes (rows) in the fonts that draw them"):
    """The glyph benchmark at a glance: ``n_classes`` classes (rows, spread over the
    selection) in every font of :data:`~refdml.train.data.GLYPH_FONTS` (columns; blank
    where a font does not draw the character), clean renderings above, and, with
    ``collages`` (a :class:`~refdml.train.data.CollageSplit`), ``n_collages`` collages below,
    the class cell outlined in red. ``classes``: a :class:`~refdml.train.data.GlyphClasses`.
    Returns the Figure."""
    Figure = _figure_class()
    out_path = _check_out_path(out_path)
    _check_title(title, optional=False)
    if not isinstance(classes, GlyphClasses):
        raise TypeError(f"classes must be a GlyphClasses (refdml.train.data.glyph_classes()), "
                        f"got {_describe(classes)}")
    n_classes = check_scalar(n_classes, "n_classes", low=1, high=len(classes), integer=True)
    n_collages = check_scalar(n_collages, "n_collages", low=1, integer=True)
    ids = np.unique(np.linspace(0, len(classes) - 1, n_classes).astype(np.int64))
    clean = render_glyphs(classes, ids, size=32, distortion=GlyphDistortion.none())
    noisy = render_glyphs(classes, ids, rng=rng, size=32)
    n_fonts = len(GLYPH_FONTS)
    rows = 2 * ids.size
    extra = 0 if collages is None else 1
    fig = Figure(figsize=(0.42 * (n_fonts + 2), 0.46 * rows + 0.8 + 1.6 * extra),
                 layout="constrained")
    outer = fig.add_gridspec(1 + extra, 1, height_ratios=[0.46 * rows] + [1.6] * extra)
    grid = outer[0].subgridspec(rows, n_fonts + 2)
    for r, k in enumerate(ids):
        for variant, split in enumerate((clean, noisy)):
            row = 2 * r + variant
            label = fig.add_subplot(grid[row, :2])
            label.set_axis_off()
            label.text(0.0, 0.5, classes.name(int(k)) if variant == 0 else "distorted",
                       fontsize=7, va="center", family="DejaVu Sans")
            for image, font in zip(split.images[split.labels == k, 0],
                                   split.fonts[split.labels == k]):
                ax = fig.add_subplot(grid[row, 2 + int(font)])
                ax.imshow(image, cmap="gray_r", vmin=0.0, vmax=1.0)
                ax.set_xticks([])
                ax.set_yticks([])
                if r == 0 and variant == 0:
                    ax.set_title(GLYPH_FONTS[int(font)][0], fontsize=5, rotation=60,
                                 loc="left")
    if collages is not None:
        pick = np.unique(np.linspace(0, len(collages) - 1, n_collages).astype(np.int64))
        sub = outer[1].subgridspec(1, pick.size)
        for j, i in enumerate(pick):
            ax = fig.add_subplot(sub[0, j])
            ax.imshow(collages.images[i, 0], cmap="gray_r", vmin=0.0, vmax=1.0)
            rows_, cols_ = np.nonzero(collages.foreground[i])
            ax.add_patch(_rectangle(cols_.min() - 0.5, rows_.min() - 0.5,
                                    cols_.max() - cols_.min() + 1,
                                    rows_.max() - rows_.min() + 1))
            ax.set_axis_off()
            ax.set_title(classes.name(int(collages.labels[i])), fontsize=6)
    fig.suptitle(title, fontsize=9)
    _save(fig, out_path)
    return fig


def write_run_figures(run, out_dir, *, n_attention: int = 8) -> list[Path]:
    """The figures of a finished run (:func:`refdml.train.runs.build_run`), in ``out_dir/figures``.

    ``curves.png`` (loss and MAP@R per epoch), ``embeddings_2d.png`` (PCA of the test
    embeddings, validation if there is no test split), and for a collage model
    (digits-collage, glyph-collage) with a GSP head ``attention.png`` (the pooling weights
    over ``n_attention`` test collages, the class cell outlined). Needs matplotlib
    (``pip install "refdml[plot]"``).
    """
    _figure_class()  # the install hint, before any work
    from refdml.train.trainer import Trainer, _check_out_dir

    if not isinstance(getattr(run, "trainer", None), Trainer):
        raise TypeError(f"run must be a Run of refdml.train.runs.build_run, got {_describe(run)}")
    n_attention = check_scalar(n_attention, "n_attention", low=1, integer=True)
    out_dir = _check_out_dir(out_dir)
    figures = out_dir / "figures"
    trainer = run.trainer
    written = []
    plot_curves(out_dir / "log.jsonl", figures / "curves.png")
    written.append(figures / "curves.png")
    inputs, labels = (trainer.test_x, trainer.test_y) if trainer.test_x is not None else (
        trainer.val_x, trainer.val_y)
    plot_embeddings_2d(to_numpy(trainer.embed(inputs)), labels, figures / "embeddings_2d.png",
                       title=f"{run.study}: test embeddings after epoch {trainer.epoch} (PCA)")
    written.append(figures / "embeddings_2d.png")
    has_gsp = any(isinstance(layer, GSPHead) for layer in getattr(run.model, "layers", ()))
    if run.collage is not None and has_gsp:
        test = run.collage.test
        pick = np.linspace(0, test.images.shape[0] - 1, min(n_attention, test.images.shape[0]))
        pick = np.unique(pick.astype(np.int64))
        x, _ = trainer._to_device(test.images[pick], np.zeros(0))
        _, ctx = run.model.forward(x)
        head = next(layer for layer in run.model.layers if isinstance(layer, GSPHead))
        plot_attention(test.images[pick], gsp_weights(run.model, ctx),
                       figures / "attention.png", grid=feature_grid(run.model, ctx),
                       foreground=test.foreground[pick], labels=test.labels[pick], mu=head.mu,
                       title=f"{run.study}: GSP pooling weights after epoch {trainer.epoch}")
        written.append(figures / "attention.png")
    return written

