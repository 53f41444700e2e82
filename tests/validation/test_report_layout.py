"""``refdml verify --report DIR`` is a report a person reads (issue 48, item 7): report.md
holds, per claim, the statement, the readings, the counterexample and the figures, in a
number of lines that does not grow with the sizes of a run; the numbers behind a figure, and
any table of more than ``MAX_TABLE_ROWS`` rows, are CSV files in ``DIR/data`` that read back
to the values the claim computed; the rest of a claim's evidence is on ``DIR/claims/<id>.md``.

Before, report.md was 2,989 lines in the default mode, 1,339 of them ``gsp.prop4.2``'s: its
two figures as a 1,000-row and a 200-row Markdown table. The whole default run is too slow
for the suite; the quick run of every claim (tests/validation/test_validation.py) holds
report.md under 500 lines, and here the default ``gsp.prop4.2`` section is shown to be as
long as its quick one (a section's length depends on its readings and figures only).
"""

from __future__ import annotations

import csv
import math
import re

import numpy as np
import pytest

from refdml.validation import run_checks
from refdml.validation._framework import Figure, series
from refdml.validation._report import MAX_TABLE_ROWS, figure_rows, write_report

_CLAIM = "gsp.prop4.2"


def _write(results, folder, *, quick):
    return write_report(results, folder, quick=quick, seed=0, runtime_s=1.0)


@pytest.fixture(scope="module")
def default_prop42(tmp_path_factory):
    """The default-mode gsp.prop4.2 (its largest figure: 1,000 iterations) and its report."""
    (result,) = run_checks([_CLAIM], quick=False)
    folder = tmp_path_factory.mktemp("report")
    _write([result], folder, quick=False)
    return result, folder


def _section(text: str, claim: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"## `{claim}`")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _table_lengths(text: str) -> list[int]:
    """The number of body rows of every Markdown table of ``text``."""
    lengths, rows = [], 0
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            rows += 1
        elif rows:
            lengths.append(rows - 2)   # less the header and the |---| line
            rows = 0
    return lengths


def _read_csv(path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="", encoding="utf-8") as handle:
        header, *rows = list(csv.reader(handle))
    return header, rows


def _points(header, rows, column: int) -> list[tuple[float, float]]:
    return [(float(row[0]), float(row[column])) for row in rows if row[column] != ""]


def test_the_figure_data_are_csv_files_that_read_back_exactly(default_prop42):
    result, folder = default_prop42
    assert [f.name for f in result.figures] == ["gsp_prop42_convergence", "gsp_prop42_mu1"]
    for figure in result.figures:
        path = folder / "data" / f"{figure.name}.csv"
        header, rows = _read_csv(path)
        assert header == [figure.xlabel] + [s.label for s in figure.series]
        for column, s in enumerate(figure.series, start=1):
            # repr of a float64 parses back to the same float64: an exact round trip
            assert sorted(_points(header, rows, column)) == sorted(zip(s.x, s.y))
        # numpy reads the numbers too (a missing point is NaN)
        array = np.genfromtxt(path, delimiter=",", skip_header=1)
        assert array.shape == (len(rows), len(figure.series) + 1)
        np.testing.assert_array_equal(array[:, 0], [float(row[0]) for row in rows])
    header, rows = _read_csv(folder / "data" / "gsp_prop42_mu1.csv")
    assert len(rows) == 1000 == len(result.figures[1].series[0].x)


def test_report_md_links_the_data_and_holds_no_long_table(default_prop42):
    result, folder = default_prop42
    text = (folder / "report.md").read_text()
    for figure in result.figures:
        assert f"[data/{figure.name}.csv](data/{figure.name}.csv)" in text
        assert f"](figures/{figure.name}.png)" in text or "matplotlib is not installed" in text
    page = (folder / "claims" / f"{_CLAIM}.md").read_text()
    assert f"[claims/{_CLAIM}.md](claims/{_CLAIM}.md)" in text
    for body in (text, page):
        assert max(_table_lengths(body), default=0) <= MAX_TABLE_ROWS
        for link in re.findall(r"\]\(([^)#]+)\)", body):
            base = folder if body is text else folder / "claims"
            assert (base / link).resolve().is_file(), link


def test_a_long_evidence_table_goes_to_csv_with_its_first_rows_shown(default_prop42):
    result, folder = default_prop42
    page = (folder / "claims" / f"{_CLAIM}.md").read_text()
    rates = result.details["rate_predicted_vs_observed"]
    assert len(rates) > MAX_TABLE_ROWS
    name = f"data/{_CLAIM}-rate_predicted_vs_observed.csv"
    assert f"all of them: [{name}](../{name})" in page
    header, rows = _read_csv(folder / name)
    assert header == list(rates[0])
    assert [[float(v) for v in row] for row in rows] == [[float(r[k]) for k in header] for r in rates]
    sizes = list(result.sizes)
    header, rows = _read_csv(folder / f"data/{_CLAIM}-sizes.csv")
    assert len(rows) == len(sizes) > MAX_TABLE_ROWS
    assert [[float(v) for v in row] for row in rows] == [[float(s[k]) for k in header] for s in sizes]


def test_a_claims_section_does_not_grow_with_the_sizes_of_the_run(default_prop42, tmp_path):
    result, folder = default_prop42
    (quick,) = run_checks([_CLAIM], quick=True)
    _write([quick], tmp_path, quick=True)
    default_lines = _section((folder / "report.md").read_text(), _CLAIM)
    quick_lines = _section((tmp_path / "report.md").read_text(), _CLAIM)
    # 36 sizes and rates in default mode against 12 in quick mode (tables of 36 rows on
    # the claim's page before), and the same section
    assert len(result.sizes) > MAX_TABLE_ROWS >= len(quick.sizes)
    assert len(default_lines) == len(quick_lines) <= 20


def test_figure_rows_keep_every_point_of_series_with_other_or_repeated_x():
    figure = Figure("f", "title", "x", "y", (
        series("a, with a comma", [1.0, 2.0, 2.0, 3.0], [10.0, 20.0, 21.0, 0.1 + 0.2]),
        series("b", [2.0, 5.0], [math.inf, 1e-300], style="points"),
    ))
    header, rows = figure_rows(figure)
    assert header == ["x", "a, with a comma", "b"]
    assert rows == [[1.0, 10.0, None], [2.0, 20.0, math.inf], [2.0, 21.0, None],
                    [3.0, 0.1 + 0.2, None], [5.0, None, 1e-300]]


def test_the_csv_of_a_figure_round_trips_through_csv_and_numpy(tmp_path):
    from refdml.validation._framework import ClaimResult

    x = np.geomspace(1e-12, 1e12, 7)
    figure = Figure("odd_values", "title", "x, log", "y", (
        series("one", x, np.sqrt(x) / 3.0), series("two", x[::2], -x[::2] / 7.0)))
    result = ClaimResult(id="test.csv", verdict="holds", paper="p", statement="s", hypotheses="h",
                         error=0.0, tolerance=1.0, counterexample=None, correction=None,
                         extra_hypothesis=None, key_number="k", figures=(figure,),
                         readings=({"kind": "printed", "statement": "s", "error": 0.0,
                                    "tolerance": 1.0, "counterexample": None, "passed": True,
                                    "trials": 1},))
    _write([result], tmp_path, quick=True)
    path = tmp_path / "data" / "odd_values.csv"
    header, rows = _read_csv(path)
    assert header == ["x, log", "one", "two"]
    assert _points(header, rows, 1) == list(zip(x, np.sqrt(x) / 3.0))
    assert _points(header, rows, 2) == list(zip(x[::2], -x[::2] / 7.0))
    array = np.genfromtxt(path, delimiter=",", skip_header=1)
    np.testing.assert_array_equal(array[:, 1], np.sqrt(x) / 3.0)
    np.testing.assert_array_equal(np.isnan(array[:, 2]), [False, True] * 3 + [False])
