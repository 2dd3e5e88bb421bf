"""The What-if view in a real browser: the fit's own error, the predicted latency and SLO attainment against the
request rate, and the capacity table. Screenshot: ``screenshots/whatif.png``."""

from __future__ import annotations

import pytest
from browser import graph_points, screenshot, severe_logs, texts, visit
from conftest import SCREENSHOTS

pytestmark = pytest.mark.timeout(180)

_SWEEP_JS = """
const gd = document.querySelector('#whatif-sweep .js-plotly-plot');
return gd ? gd.data.map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)})) : null;
"""


def test_whatif_view_shows_the_fit_the_rate_sweep_and_the_capacity_answer(browser, served):
    visit(browser, served.url + "/whatif?run=base", timeout_s=120)
    assert not texts(browser, ".tt-error"), texts(browser, ".tt-error")
    cards = " ".join(texts(browser, "#whatif-kpis .tt-kpi"))
    assert "highest rate meeting the SLO" in cards and "engine steps fitted" in cards
    metrics = texts(browser, "#whatif-fit td[data-dash-column='metric']")
    assert {"TTFT p50", "TTFT p99", "ITL p99", "E2E p99", "SLO attainment"} <= set(metrics)
    assert graph_points(browser).get("whatif-sweep", 0) > 0
    traces = browser.execute_script(_SWEEP_JS)
    ttft = next(t for t in traces if t["name"] == "TTFT p99")
    assert ttft["x"][0] == 0.25 and ttft["x"][-1] == 4.0
    assert ttft["y"][-1] >= ttft["y"][0]  # sixteen times the rate never queues less
    settings = texts(browser, "#whatif-capacity td[data-dash-column='setting']")
    assert settings[0] == "as run" and any("max_num_seqs" in s for s in settings)
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "whatif.png")


def test_a_run_without_steps_says_so(browser, served):
    visit(browser, served.url + "/whatif?run=partial")
    assert any("no engine steps" in t for t in texts(browser, ".tt-notice"))
