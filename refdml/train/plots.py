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
    NumPy's SVD), one colour per class, a legend when there are at most 20 classes.

``gsp_weights(model, ctx)`` reads ``w`` from the context of a forward pass (of a
:class:`~refdml.train.Sequential` holding a :class:`~refdml.train.layers.GSPHead`, or of
the head itself): no second forward, no trainer needed. docs/train_plots.md shows a run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from refdml._io import save_figure
from refdml._validation import _describe
from refdml._xp import to_numpy
from refdml.train._conv import LocalLinearContext
from refdml.train._heads import GSPHead, HeadContext
from refdml.train._layer import Layer, Sequential

__all__ = [
    "feature_grid",
    "gsp_weights",
    "pca_2d",
    "plot_attention",
    "plot_curves",
    "plot_embeddings_2d",
    "upsample_weights",
]

#: At most this many classes get a legend entry (and a distinct qualitative colour).
MAX_LEGEND_CLASSES = 20


def _figure_class():
    """matplotlib's Figure, or an ImportError that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            'refdml.train.plots needs matplotlib: pip install "refdml[plot]"'
        ) from error
    return Figure


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
    on a GPU: :func:`refdml._xp.to_numpy` brings them to the host).
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
    """
    w = to_numpy(weights)
    if w.ndim == 1:
        w = w[None]
    gh, gw = (int(s) for s in grid)
    height, width = (int(s) for s in image_shape)
    if w.ndim != 2 or w.shape[1] != gh * gw:
        raise ValueError(
            f"weights has shape {w.shape}, expected (B, {gh * gw}) for the grid {gh} x {gw}"
        )
    rows = np.arange(height) * gh // height
    cols = np.arange(width) * gw // width
    return w.reshape(-1, gh, gw)[:, rows[:, None], cols[None, :]]


# --------------------------------------------------------------------------- curves
def _read_rows(log_path_or_rows) -> tuple[list[dict], str | None]:
    if isinstance(log_path_or_rows, (str, Path)):
        path = Path(log_path_or_rows)
        if path.is_dir():
            path = path / "log.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return rows, path.resolve().parent.name
    if isinstance(log_path_or_rows, Sequence) and all(isinstance(r, dict) for r in log_path_or_rows):
        return list(log_path_or_rows), None
    raise TypeError(
        "log_path_or_rows must be a path to log.jsonl (or its run folder) or a list of log "
        f"rows (dicts), got {_describe(log_path_or_rows)}"
    )


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
    rows, run = _read_rows(log_path_or_rows)
    if not rows:
        raise ValueError("the log has no rows: nothing to plot")
    Figure = _figure_class()
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
    map_ax.legend(loc="best", fontsize="small")
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
    images = np.asarray(to_numpy(images), dtype=np.float64)
    if images.ndim == 4 and images.shape[1] == 1:
        images = images[:, 0]
    if images.ndim != 3:
        raise ValueError(
            f"images must be (N, H, W) or (N, 1, H, W) grey-level images, got shape {images.shape}"
        )
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
    max_images : int
        Rows drawn (the first ``max_images`` images).
    """
    images = _images_2d(images)
    w = np.asarray(to_numpy(weights), dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != images.shape[0]:
        raise ValueError(
            f"weights must be (N, n) with N = {images.shape[0]} images, got shape {w.shape}"
        )
    n_images = min(images.shape[0], int(max_images))
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
    Figure = _figure_class()
    fig = Figure(figsize=(6.2, 2.6 * n_images + 0.6), layout="constrained")
    axes = np.asarray(fig.subplots(n_images, 2, squeeze=False))
    last_map = None
    for i in range(n_images):
        image_ax, map_ax = axes[i]
        image_ax.imshow(images[i], cmap="gray_r", vmin=0.0, vmax=max(1.0, images[i].max()))
        last_map = map_ax.imshow(maps[i], cmap="viridis", vmin=0.0, vmax=vmax)
        name = ""
        if labels is not None:
            label = int(np.asarray(to_numpy(labels))[i])
            if callable(class_names):
                name = str(class_names(label))
            elif class_names is not None:
                name = str(class_names[label])
            else:
                name = str(label)
            name = f"class {name}"
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
    """
    x = np.asarray(to_numpy(embeddings), dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"embeddings must be (N, d) with N >= 2, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("embeddings contain NaN or inf")
    centred = x - x.mean(axis=0)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    vt = vt[:2]
    signs = np.sign(vt[np.arange(vt.shape[0]), np.argmax(np.abs(vt), axis=1)])
    vt = vt * np.where(signs == 0, 1.0, signs)[:, None]
    coords = centred @ vt.T
    total = float(np.sum(s ** 2))
    ratio = s[:2] ** 2 / total if total > 0 else np.zeros(min(2, s.shape[0]))
    if coords.shape[1] < 2:
        coords = np.concatenate([coords, np.zeros((coords.shape[0], 1))], axis=1)
        ratio = np.concatenate([ratio, [0.0]])
    return coords, ratio


def plot_embeddings_2d(embeddings, labels, out_path, *, class_names=None,
                       title: str = "test embeddings (PCA)"):
    """Scatter of the embeddings' first two principal components, one colour per class.

    A legend (class names via ``class_names``, a callable or mapping) when there are at
    most 20 classes; otherwise colours from a continuous map and no legend. Returns the Figure.
    """
    coords, ratio = pca_2d(embeddings)
    labels = np.asarray(to_numpy(labels))
    if labels.shape != (coords.shape[0],):
        raise ValueError(f"labels has shape {labels.shape}, expected ({coords.shape[0]},)")
    classes = np.unique(labels)
    Figure = _figure_class()
    fig = Figure(figsize=(6.5, 5), layout="constrained")
    ax = fig.subplots()
    few = classes.shape[0] <= MAX_LEGEND_CLASSES
    from matplotlib import colormaps

    cmap = colormaps["tab10" if classes.shape[0] <= 10 else "tab20" if few else "viridis"]
    for k, c in enumerate(classes):
        where = labels == c
        colour = cmap(k % cmap.N) if few else cmap(k / max(1, classes.shape[0] - 1))
        if callable(class_names):
            name = str(class_names(c))
        elif class_names is not None:
            name = str(class_names[c])
        else:
            name = str(c)
        ax.scatter(coords[where, 0], coords[where, 1], s=14, color=colour, alpha=0.8,
                   label=f"class {name}" if few else None)
    ax.set_xlabel(f"principal component 1 ({ratio[0]:.0%} of variance)")
    ax.set_ylabel(f"principal component 2 ({ratio[1]:.0%} of variance)")
    ax.set_title(f"{title}: {coords.shape[0]} samples, {classes.shape[0]} classes")
    ax.grid(alpha=0.3)
    if few:
        ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small",
                  title="class")
    _save(fig, out_path)
    return fig


def write_run_figures(run, out_dir, *, n_attention: int = 8) -> list[Path]:
    """The figures of a finished run (:func:`refdml.train.runs.build_run`), in ``out_dir/figures``.

    ``curves.png`` (loss and MAP@R per epoch), ``embeddings_2d.png`` (PCA of the test
    embeddings, validation if there is no test split), and for a digits-collage model with
    a GSP head ``attention.png`` (the pooling weights over ``n_attention`` test collages, the
    class cell outlined). Needs matplotlib (``pip install "refdml[plot]"``).
    """
    _figure_class()  # the install hint, before any work
    out_dir = Path(out_dir)
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
                       title=f"digits-collage: GSP pooling weights after epoch {trainer.epoch}")
        written.append(figures / "attention.png")
    return written

