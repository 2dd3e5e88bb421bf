"""The report's capacity (what-if) section: the rate at which the SLO breaks and the setting that moves it most."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokentrace.app.report import make_report, render
from tokentrace.app.report.whatif import CANDIDATES, RATE_GRID

STORE = Path(__file__).resolve().parents[3] / "data" / "real_run"


@pytest.fixture(scope="module")
def report():
    return make_report(STORE)


def test_the_section_names_the_breaking_rate_and_the_setting_that_moves_it(report):
    section = report.section("whatif")
    (caption, frame), = section.tables
    assert list(frame["setting"])[0] == "as run" and len(frame) == 1 + len(CANDIDATES)
    assert "decode_instances=2" in " ".join(frame["setting"])  # disaggregated: one more decode instance
    for v in frame["highest_rate_scale"]:
        assert v is None or v in RATE_GRID
    assert section.note.startswith("Predicted: ")
    assert "the setting that moves it most is" in section.note or "none of the single changes" in section.note
    assert "largest latency error on this run itself" in section.note


def test_every_format_renders_the_section(report):
    doc = json.loads(render(report, "json"))
    assert "whatif" in doc["sections"]
    assert "Capacity (what-if)" in render(report, "md")
