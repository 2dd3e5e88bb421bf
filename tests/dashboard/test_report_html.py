"""The HTML report opened in the same headless Chromium as the dashboard: every chart drawn, offline.

The report inlines tokentrace's plotly.js partial bundle; these tests check that this bundle
draws every chart the report makes (each trace type registered, data on every chart, no console
error) from a ``file://`` URL, with nothing fetched from the network.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from browser import screenshot, severe_logs
from conftest import SCREENSHOTS

from tokentrace.app.report import make_report, render
from tokentrace.app.report.plotly_bundle import BUNDLE_NAME, TRACE_TYPES, bundle_text
from tokentrace.palette import label_colour

# Per chart: drawn (plotly's layout and SVG exist), trace types, finite values; the resources fetched.
_CHARTS_JS = """
const charts = {};
for (const gd of document.querySelectorAll('.plotly-graph-div')) {
  const finite = a => Array.from(a || []).filter(v => typeof v === 'number' && isFinite(v)).length;
  charts[gd.id] = {
    drawn: Boolean(gd._fullLayout && gd.querySelector('.main-svg')),
    types: (gd.data || []).map(t => t.type || 'scatter'),
    values: (gd._fullData || []).reduce((n, t) => n + finite(t.y), 0),  // y decoded from base64
  };
}
return {charts: charts, registered: window.Plotly ? Object.keys(Plotly.PlotSchema.get().traces) : [],
        fetched: performance.getEntriesByType('resource').map(e => e.name)};
"""


def _open(driver: Any, page: Path, *, timeout_s: float = 30.0) -> dict[str, Any]:
    driver.get(page.as_uri())
    deadline = time.monotonic() + timeout_s
    while True:
        state = driver.execute_script(_CHARTS_JS)
        if state["charts"] and all(c["drawn"] for c in state["charts"].values()):
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"report charts not drawn within {timeout_s:.0f} s: {state['charts']}")
        time.sleep(0.05)


def test_html_report_draws_every_chart_offline_with_the_basic_bundle(browser, stores, tmp_path):
    report = make_report(stores["store"], "cand", baseline=f"{stores['store']}:base")
    page = tmp_path / "report.html"
    page.write_text(render(report, "html"), encoding="utf-8")
    assert bundle_text() in page.read_text(encoding="utf-8")
    assert page.stat().st_size < 2_000_000  # the basic bundle, not plotly's full 4.8 MB one

    severe_logs(browser)  # drop what earlier pages logged
    state = _open(browser, page)
    charts = state["charts"]
    assert set(charts) == {"chart-latency", "chart-stages", "chart-latency-time", "chart-queues", "chart-diff"}
    assert {gid: c["values"] for gid, c in charts.items() if c["values"] <= 0} == {}
    asked = {t for c in charts.values() for t in c["types"]}
    assert asked <= set(state["registered"]) and asked <= TRACE_TYPES, (asked, state["registered"])
    assert set(state["registered"]) >= TRACE_TYPES, f"{BUNDLE_NAME} does not register {TRACE_TYPES}"
    assert [u for u in state["fetched"] if not u.startswith("file:")] == []
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "report.png")


# The stage chart's colours; every table's overflow (wider than its box?) and the page's own width; the text.
_LOOK_JS = """
const gd = document.getElementById('chart-stages');
const colours = {}; for (const t of gd.data) colours[t.name] = t.marker.color;
const wraps = Array.from(document.querySelectorAll('.table-wrap'));
return {colours: colours, text: document.body.innerText, tables: document.querySelectorAll('table').length,
        wrapped: wraps.length, page: document.documentElement.scrollWidth, window: window.innerWidth,
        headers: Array.from(document.querySelectorAll('th')).map(th => th.textContent)};
"""


def test_html_report_reads_as_a_person_reads_it(browser, stores, tmp_path):
    """The dashboard's stage colours, tables that stay in the page (each scrolls sideways in its own box),
    readable headers, instances by name and no 15+ digit number."""
    report = make_report(stores["store"], "base")
    page = tmp_path / "report.html"
    page.write_text(render(report, "html"), encoding="utf-8")
    _open(browser, page)
    look = browser.execute_script(_LOOK_JS)
    assert look["colours"] and all(c == label_colour(stage) for stage, c in look["colours"].items()), look["colours"]
    assert look["tables"] == look["wrapped"] and look["page"] <= look["window"]  # nothing runs off to the right
    assert "p99 (ms)" in look["headers"] and "p99_ms" not in look["headers"]
    assert not re.findall(r"\d{15,}", look["text"])
    assert "colocated · engine-0" in look["text"]  # the engine, named
    assert "charted in the HTML report" not in look["text"]
    assert f"{len(stores['runs']['base'].request_ids)} requests (" in look["text"]  # requests, not request rows
    assert severe_logs(browser) == []
