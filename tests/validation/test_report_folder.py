"""``refdml verify --report DIR`` writes the folder as a whole: a re-run leaves no figure of
the previous report (issue 38, item 3), and a report written before refdml marked its
folders is still recognised and replaced."""

from __future__ import annotations

import re

import pytest

from refdml._io import FOLDER_MARKER
from refdml.cli import main

_CLAIM = "gsp.sec4.2.uniform_limit"   # a cheap claim with a figure


def _linked(report) -> list[str]:
    return re.findall(r"\]\(([^)]+\.png)\)", (report / "report.md").read_text())


def test_a_rerun_leaves_no_stale_figure(tmp_path):
    pytest.importorskip("matplotlib")
    report = tmp_path / "report"
    argv = ["verify", "--quick", "--only", _CLAIM, "--report", str(report)]
    assert main(argv) == 0
    (report / "figures" / "stale_from_an_old_run.png").write_bytes(b"old figure")
    (report / "figures" / "gsp_uniform_limit.png").write_bytes(b"to be redrawn")
    assert main(argv) == 0
    figures = sorted(p.name for p in (report / "figures").iterdir())
    assert figures == ["gsp_uniform_limit.png"]
    assert (report / "figures" / "gsp_uniform_limit.png").read_bytes()[:4] == b"\x89PNG"
    linked = _linked(report)
    assert linked == ["figures/gsp_uniform_limit.png"]
    assert all((report / name).is_file() for name in linked)
    assert sorted(p.name for p in report.iterdir()) == [FOLDER_MARKER, "claims", "data", "figures",
                                                        "report.md"]
    assert sorted(p.name for p in (report / "data").iterdir()) == ["gsp_uniform_limit.csv"]
    assert [p.name for p in tmp_path.iterdir()] == ["report"]     # no staging folder left


def test_a_report_written_before_the_marker_is_replaced(tmp_path):
    from refdml.validation._report import is_report_folder

    report = tmp_path / "report"
    (report / "figures").mkdir(parents=True)
    (report / "report.md").write_text("# refdml verify: numerical checks of the claims of the "
                                      "four papers\n\nold\n")
    (report / "figures" / "old.png").write_bytes(b"old")
    assert is_report_folder(report)
    (report / "notes.txt").write_text("a file of the user's")
    assert not is_report_folder(report)
    (report / "notes.txt").unlink()
    assert main(["verify", "--quick", "--only", "gsp.appA3.hinv", "--report", str(report)]) == 0
    assert not (report / "figures" / "old.png").exists()
    assert (report / FOLDER_MARKER).is_file()
