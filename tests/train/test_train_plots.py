"""refdml.train.plots: files written, titled and labelled figures, the PCA view, GSP weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
from numpy.testing import assert_allclose

from refdml.train.layers import GSPHead, L2Normalize, LocalLinear, ReLU, Sequential
from refdml.train.plots import feature_grid, gsp_weights, pca_2d, upsample_weights

MU = 0.3


def _model(reference=False):
    rng = np.random.default_rng(0)
    return Sequential([
        LocalLinear(3, 8, rng=rng), ReLU(),
        GSPHead(5, 8, mu=MU, inverse_temperature=5.0, reference=reference, rng=rng),
        L2Normalize(reference=reference),
    ])


@pytest.mark.parametrize("reference", [False, True])
def test_gsp_weights_equal_the_heads_rho(reference):
    model = _model(reference)
    x = np.random.default_rng(1).standard_normal((4, 3, 2, 3))
    _, ctx = model.forward(x)
    w = gsp_weights(model, ctx)
    rho = ctx.contexts[2].inner.transport.rho  # the head's (P2) solution
    n = 6
    assert w.shape == (4, n)
    assert_allclose(w, (1.0 - n * rho) / MU, rtol=1e-10, atol=1e-12)
    assert_allclose(w.mean(axis=1), 1.0, rtol=1e-10)  # sum_j rho_j = 1 - mu
    assert feature_grid(model, ctx) == (2, 3)
    # The head on its own, and a nested model.
    head = model.layers[2]
    features, _ = model.layers[0].forward(x)
    _, head_ctx = head.forward(np.maximum(features, 0))
    assert_allclose(gsp_weights(head, head_ctx), w, rtol=1e-12)
    outer = Sequential([model], name="outer")
    _, outer_ctx = outer.forward(x)
    assert_allclose(gsp_weights(outer, outer_ctx), w, rtol=1e-12)


def test_gsp_weights_named_errors():
    model = _model()
    x = np.random.default_rng(1).standard_normal((2, 3, 2, 2))
    _, ctx = model.forward(x)
    with pytest.raises(TypeError, match="ctx"):
        gsp_weights(model, object())
    with pytest.raises(ValueError, match=r"ctx was returned by the forward of another object"):
        gsp_weights(_model(), ctx)
    with pytest.raises(ValueError, match="head == 1"):
        gsp_weights(model, ctx, head=1)
    plain = Sequential([ReLU()])
    _, plain_ctx = plain.forward(np.ones((2, 3)))
    with pytest.raises(ValueError, match="no GSPHead"):
        gsp_weights(plain, plain_ctx)


def test_upsample_weights_nearest_cell():
    w = np.arange(6.0).reshape(1, 6)  # grid 2 x 3, cell (h, w) = 3 h + w
    up = upsample_weights(w, (2, 3), (4, 6))
    expected = np.array([[0, 0, 1, 1, 2, 2]] * 2 + [[3, 3, 4, 4, 5, 5]] * 2, dtype=float)
    assert_allclose(up[0], expected, rtol=0)
    with pytest.raises(ValueError, match="grid 2 x 2"):
        upsample_weights(w, (2, 2), (4, 4))


def test_pca_2d_is_the_svd_projection():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((30, 5)) @ np.diag([5.0, 3.0, 1.0, 0.5, 0.1]) + 7.0
    coords, ratio = pca_2d(x)
    # Readable oracle: centre, SVD, scores U S on the two leading components.
    centred = x - x.mean(axis=0)
    u, s, vt = np.linalg.svd(centred)
    scores = u[:, :2] * s[:2]
    signs = np.sign(np.sum(coords * scores, axis=0))  # a component is defined up to sign
    assert_allclose(coords, scores * signs, rtol=1e-10, atol=1e-10)
    assert_allclose(ratio, s[:2] ** 2 / np.sum(s ** 2), rtol=1e-12)
    # The sign rule: each component's largest-magnitude loading is positive.
    loadings = np.linalg.lstsq(centred, coords, rcond=None)[0]
    assert np.all(loadings[np.argmax(np.abs(loadings), axis=0), [0, 1]] > 0)


matplotlib = pytest.importorskip("matplotlib", reason='plots need matplotlib: pip install "refdml[plot]"')
from refdml.train.plots import plot_attention, plot_curves, plot_embeddings_2d  # noqa: E402


def _labelled(ax):
    return ax.get_title() and ax.get_xlabel() and ax.get_ylabel()


def _rows():
    rows = [{"epoch": 0, "train_loss": None, "val_map_at_r": 0.1, "test_map_at_r": 0.12}]
    for epoch in range(1, 4):
        rows.append({"epoch": epoch, "train_loss": 2.0 / epoch, "val_map_at_r": 0.1 + 0.1 * epoch,
                     "test_map_at_r": 0.1 + 0.05 * epoch})
    return rows


def test_plot_curves_from_log_file(tmp_path):
    run = tmp_path / "my_run"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    fig = plot_curves(run / "log.jsonl", tmp_path / "figs" / "curves.png")
    assert (tmp_path / "figs" / "curves.png").stat().st_size > 0
    assert "my_run" in fig._suptitle.get_text()
    loss_ax, map_ax = fig.axes
    assert _labelled(loss_ax) and _labelled(map_ax)
    assert loss_ax.get_ylabel() == "training loss" and map_ax.get_ylabel() == "MAP@R"
    # Loss from epoch 1 (epoch 0 is the untrained model); MAP@R from epoch 0.
    assert_allclose(loss_ax.lines[0].get_xdata(), [1, 2, 3])
    assert_allclose(loss_ax.lines[0].get_ydata(), [2.0, 1.0, 2.0 / 3.0])
    assert_allclose(map_ax.lines[0].get_ydata(), [0.1, 0.2, 0.3, 0.4])
    assert [t.get_text() for t in map_ax.get_legend().get_texts()][:2] == [
        "validation classes", "test classes"]
    fig2 = plot_curves(_rows(), tmp_path / "curves.svg", title="tokens, seed 0")
    assert fig2._suptitle.get_text() == "tokens, seed 0"
    assert (tmp_path / "curves.svg").read_text().startswith("<?xml")


def test_plot_attention(tmp_path):
    rng = np.random.default_rng(3)
    images = rng.random((3, 1, 8, 8))
    foreground = np.zeros((3, 8, 8), dtype=bool)
    foreground[:, :4, :4] = True
    weights = np.zeros((3, 16))
    weights[:, [0, 1, 4, 5]] = 4.0  # grid 4 x 4: all the mass in the top-left 2 x 2 cells
    fig = plot_attention(images, weights, tmp_path / "attention.png", foreground=foreground,
                         labels=[1, 2, 3], class_names=lambda c: f"c{c}", mu=0.25)
    assert (tmp_path / "attention.png").stat().st_size > 0
    assert fig._suptitle.get_text().startswith("GSP pooling weights")
    image_axes = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(image_axes) == 6 and all(_labelled(ax) for ax in image_axes)
    assert image_axes[0].get_title() == "image 0, class c1"
    assert image_axes[1].get_title() == "weight in class cell: 100%"
    shown = image_axes[1].images[0].get_array()
    assert_allclose(shown, upsample_weights(weights[:1], (4, 4), (8, 8))[0])
    colorbar = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert colorbar and "pooling weight" in colorbar[0].get_ylabel()
    with pytest.raises(ValueError, match="weights must be"):
        plot_attention(images, weights[:2], tmp_path / "bad.png")


def test_plot_embeddings_2d(tmp_path):
    rng = np.random.default_rng(4)
    labels = np.repeat(np.arange(4), 10)
    y = rng.standard_normal((40, 6)) + 3.0 * np.eye(6)[labels]
    fig = plot_embeddings_2d(y, labels, tmp_path / "emb.png")
    assert (tmp_path / "emb.png").stat().st_size > 0
    (ax,) = fig.axes
    assert _labelled(ax) and "40 samples, 4 classes" in ax.get_title()
    assert "principal component 1" in ax.get_xlabel()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [f"class {c}" for c in range(4)]
    coords, _ = pca_2d(y)
    assert_allclose(ax.collections[0].get_offsets(), coords[labels == 0], rtol=1e-12)


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_an_embedding_plot_of_many_classes_shows_ten_and_says_which(tmp_path):
    """179 classes in viridis could not be told apart (issue 48): ten classes spread evenly
    over the sorted labels are coloured (tab10) and named in the legend and the title; the
    others are grey. The labels are not 0..C-1, so the choice must go by rank."""
    rng = np.random.default_rng(7)
    n_classes = 179
    ranks = np.repeat(np.arange(n_classes), 2)
    labels = 1000 + 3 * ranks
    y = rng.standard_normal((ranks.size, 5))
    fig = plot_embeddings_2d(y, labels, tmp_path / "many.png", class_names=lambda c: f"g{c}")
    (ax,) = fig.axes
    # ranks floor(i * 178 / 9): 178 / 9 = 19.78, so 0, 19, 39, 59, 79, 98, 118, 138, 158, 178
    picked = [0, 19, 39, 59, 79, 98, 118, 138, 158, 178]
    names = [f"g{1000 + 3 * r}" for r in picked]
    assert _legend(ax) == [f"the other {n_classes - 10} classes"] + [f"class {n}" for n in names]
    assert f"{ranks.size} samples, {n_classes} classes" in ax.get_title()
    assert f"10 of {n_classes} classes: " + ", ".join(names) in ax.get_title().replace("\n", " ")
    grey, *coloured = ax.collections
    coords, _ = pca_2d(y)
    for collection, rank in zip(coloured, picked):
        assert_allclose(collection.get_offsets(), coords[ranks == rank], rtol=1e-12)
    palette = [matplotlib.colors.to_rgba(c)[:3] for c in matplotlib.colormaps["tab10"].colors]
    assert [tuple(c.get_facecolor()[0][:3]) for c in coloured] == palette   # ten distinct hues
    assert len(grey.get_offsets()) == ranks.size - 2 * 10
    # another draw of the same labels (other embeddings) picks the same classes
    again = plot_embeddings_2d(rng.standard_normal((ranks.size, 5)), labels, tmp_path / "b.png",
                               class_names=lambda c: f"g{c}")
    assert _legend(again.axes[0]) == _legend(ax)


@pytest.mark.parametrize("n_classes,picked", [
    (10, list(range(10))),                       # ten or fewer: every class, no grey
    (11, [0, 1, 2, 3, 4, 5, 6, 7, 8, 10]),       # floor(i * 10 / 9)
    (12, [0, 1, 2, 3, 4, 6, 7, 8, 9, 11]),       # floor(i * 11 / 9)
    (19, list(range(0, 19, 2))),                 # floor(i * 18 / 9) = 2 i
])
def test_the_coloured_classes_are_spread_evenly_first_and_last_included(tmp_path, n_classes, picked):
    labels = np.arange(2 * n_classes) % n_classes
    y = np.random.default_rng(n_classes).standard_normal((labels.size, 3))
    ax = plot_embeddings_2d(y, labels, tmp_path / "e.png").axes[0]
    grey = [] if n_classes <= 10 else [f"the other {n_classes - 10} classes"]
    assert _legend(ax) == grey + [f"class {c}" for c in picked]
    assert ("of %d classes" % n_classes in ax.get_title()) == (n_classes > 10)
