"""The report's figures read well at their real size (issue 38, item 8): no float noise in
any text (``L = 0.8999999999999999``), and the tick labels of an axis stand apart (the log
axis of ``asap_prop42``, whose minor ticks matplotlib labelled ``2x10^1 3x10^1 4x10^1``:
10.8 px apart in quick mode, overlapping by 6.5 px in default mode, with n up to 500).

Every figure of every claim is checked, from one quick run of the checks, and the default
mode's ``asap_prop42`` (a second)."""

from __future__ import annotations

import re
import pytest

from refdml.validation import run_checks

_NOISE = re.compile(r"\d\.\d{7,}")    # 0.8999999999999999, 2.220446049250313e-16
_MIN_GAP_PX = 12   # between neighbouring tick labels at the report's 110 dpi (1.5 characters)


@pytest.fixture(scope="module")
def results():
    return run_checks(quick=True) + run_checks(["asap.prop4.2"], quick=False)


def _texts(figure):
    yield figure.title
    yield figure.xlabel
    yield figure.ylabel
    yield from (s.label for s in figure.series)
    yield from (label for label, _ in figure.thresholds)


def test_no_figure_text_shows_float_noise(results):
    figures = [(r.id, f) for r in results for f in r.figures]
    assert len(figures) >= 15                      # every figure of the report
    noisy = [(claim, figure.name, text) for claim, figure in figures for text in _texts(figure)
             if _NOISE.search(text)]
    assert noisy == []


def _tick_label_boxes(fig, axis):
    lo, hi = sorted(axis.get_view_interval())
    boxes = []
    renderer = fig.canvas.get_renderer()
    for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
        label = tick.label1
        inside = lo - 1e-12 * abs(lo) <= tick.get_loc() <= hi + 1e-12 * abs(hi)
        if label.get_visible() and label.get_text().strip() and inside:
            boxes.append((label.get_text(), label.get_window_extent(renderer)))
    return boxes


def crowded_tick_labels(fig) -> list[tuple[str, str, float]]:
    """Neighbouring tick labels of one axis of ``fig`` less than :data:`_MIN_GAP_PX` apart
    (negative: overlapping), once drawn: ``(label, label, gap in pixels)``."""
    fig.canvas.draw()
    crowded = []
    for ax in fig.axes:
        for axis, low, high in ((ax.xaxis, "x0", "x1"), (ax.yaxis, "y0", "y1")):
            boxes = sorted(_tick_label_boxes(fig, axis), key=lambda item: getattr(item[1], low))
            for (a, box_a), (b, box_b) in zip(boxes, boxes[1:]):
                gap = float(getattr(box_b, low) - getattr(box_a, high))
                if gap < _MIN_GAP_PX:
                    crowded.append((a, b, round(gap, 1)))
    return crowded


def test_tick_labels_stand_apart(results):
    pytest.importorskip("matplotlib")
    from refdml.validation._report import _figure, _pyplot

    plt = _pyplot()
    crowded = {}
    for r in results:
        for figure in r.figures:
            fig = _figure(plt, figure, r)
            try:
                found = crowded_tick_labels(fig)
            finally:
                plt.close(fig)
            if found:
                crowded[f"{figure.name} ({len(figure.series[0].x)} points)"] = found
    assert crowded == {}
