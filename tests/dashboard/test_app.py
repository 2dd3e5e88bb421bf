"""The dashboard in a real headless Chromium: every view, the explorer's waterfall, compare, bad input, live mode.

Screenshots of every view go to ``screenshots/`` at the repository root.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from browser import SCREENSHOT_NAMES, graph_points, screenshot, severe_logs, texts, visit, wait_rendered
from conftest import SCREENSHOTS
from synthetic_store import write_run

from tokentrace.schema import col

pytestmark = pytest.mark.timeout(120)

# view path -> graphs it must draw on the synthetic run "base"
VIEWS: dict[str, int] = {
    "/": 5, "/breakdown": 7, "/explorer": 0, "/queues": 2, "/cache": 4, "/pd-ratio": 3, "/batch": 2,
    "/tenants": 3, "/compare": 1,
}
ENGINE_LANE = "tokens · colocated · engine-0"
CLIENT_LANE = "tokens · client · client-0"


# Trace types the page's graphs ask for, the trace types the loaded plotly.js registered, and the
# plotly.js files the page fetched.
_PLOTLY_JS = """
const asked = Array.from(document.querySelectorAll('.js-plotly-plot')).flatMap(gd => gd.data.map(t => t.type || 'scatter'));
const files = performance.getEntriesByType('resource').map(e => e.name.split('?')[0].split('/').pop())
  .filter(n => n.startsWith('plotly'));
return {asked: Array.from(new Set(asked)), registered: Object.keys(Plotly.PlotSchema.get().traces), files: files};
"""


def _no_console_errors(driver: Any) -> None:
    errors = severe_logs(driver)
    assert errors == [], f"browser console errors: {errors}"


@pytest.mark.parametrize("path", list(VIEWS))
def test_every_view_renders_with_data_and_no_console_error(browser, served, path):
    query = "?run=cand&base=base" if path == "/compare" else "?run=base"
    visit(browser, served.url + path + query)
    points = graph_points(browser)
    assert len(points) >= VIEWS[path], f"{path}: expected at least {VIEWS[path]} graphs, got {sorted(points)}"
    empty = {gid: n for gid, n in points.items() if n <= 0}
    assert not empty, f"{path}: graphs without data: {empty}"
    assert not texts(browser, ".tt-error"), f"{path}: error shown: {texts(browser, '.tt-error')}"
    plotly = browser.execute_script(_PLOTLY_JS)
    # The dashboard's own partial bundle draws every graph; Dash's full plotly.min.js is never fetched.
    assert plotly["files"] == ["plotly-basic.min.js"], plotly["files"]
    assert set(plotly["asked"]) <= set(plotly["registered"]), plotly
    _no_console_errors(browser)
    screenshot(browser, SCREENSHOTS / SCREENSHOT_NAMES[path])


def test_selecting_a_request_draws_its_waterfall_with_one_tick_per_token(browser, served, stores):
    run = stores["runs"]["base"]
    tokens_of = dict(zip(run.request_ids.tolist(), run.num_output_tokens.tolist()))
    visit(browser, served.url + "/explorer?run=base")
    assert not browser.find_elements("css selector", "#explorer-waterfall")
    cells = browser.find_elements("css selector", f"#explorer-table td[data-dash-column='{col.REQUEST_ID}']")
    assert len(cells) == 20  # one page, server-side paged
    chosen = int(cells[3].text)
    cells[3].click()
    deadline = time.time() + 30
    while not browser.find_elements("css selector", "#explorer-waterfall .main-svg") and time.time() < deadline:
        time.sleep(0.1)
    wait_rendered(browser)
    assert f"request={chosen}" in browser.current_url  # the selection is in the URL
    ticks = browser.execute_script("""
        const gd = document.querySelector('#explorer-waterfall .js-plotly-plot');
        const out = {}; for (const t of gd.data) { if (t.name.startsWith('tokens · ')) out[t.name] = t.x.length; }
        return out;""")
    assert ticks == {ENGINE_LANE: tokens_of[chosen], CLIENT_LANE: tokens_of[chosen]}
    lanes = browser.execute_script("""
        const gd = document.querySelector('#explorer-waterfall .js-plotly-plot');
        return Array.from(new Set(gd.data.flatMap(t => Array.from(t.y))));""")
    assert set(lanes) == {"gateway · gateway-0", "colocated · engine-0", "client · client-0"}
    _no_console_errors(browser)
    screenshot(browser, SCREENSHOTS / "explorer-waterfall.png")


def test_explorer_pages_on_the_server(browser, served):
    visit(browser, served.url + "/explorer?run=base")
    first = [c.text for c in browser.find_elements("css selector", f"#explorer-table td[data-dash-column='{col.REQUEST_ID}']")]
    browser.find_element("css selector", "#explorer-table .next-page").click()
    deadline = time.time() + 20
    second = first
    while second == first and time.time() < deadline:
        time.sleep(0.1)
        second = [c.text for c in
                  browser.find_elements("css selector", f"#explorer-table td[data-dash-column='{col.REQUEST_ID}']")]
    assert len(second) == 20 and not set(first) & set(second)
    e2e = [float(c.text) for c in browser.find_elements("css selector", "#explorer-table td[data-dash-column='e2e_ms']")]
    assert e2e == sorted(e2e, reverse=True)  # still the slowest first
    _no_console_errors(browser)


def test_compare_flags_the_planted_regression_and_nothing_the_other_way(browser, served):
    visit(browser, served.url + "/compare?run=cand&base=base")
    summary = browser.find_element("css selector", "#compare-summary")
    assert "tt-regressions" in summary.get_attribute("class")
    assert "ttft" in summary.text and "itl" in summary.text
    red_rows = browser.execute_script("""
        return Array.from(document.querySelectorAll('#compare-table td[data-dash-column="regression"]'))
               .filter(td => td.textContent.trim() === 'True').length;""")
    assert red_rows >= 2
    visit(browser, served.url + "/compare?run=base&base=cand")  # the faster run against the slower one
    summary = browser.find_element("css selector", "#compare-summary")
    assert "tt-no-regressions" in summary.get_attribute("class"), summary.text
    _no_console_errors(browser)


@pytest.mark.parametrize(("path", "expected"), [
    ("/?run=no-such-run", "is not a run of this store"),
    ("/?run=../../etc", "is not a run of this store"),
    ("/explorer?run=base&request=12345", "request 12345 is not in run base"),
    ("/explorer?run=base&request=abc", "is not a request id"),
    ("/?run=base&by=colour", "is not one of"),
    ("/queues?run=partial", "no engine steps"),
])
def test_bad_input_is_a_sentence_on_the_page(browser, served, path, expected):
    visit(browser, served.url + path)
    shown = " ".join(texts(browser, ".tt-notice"))
    assert expected in shown, shown
    assert "Traceback" not in browser.page_source
    _no_console_errors(browser)


def test_run_without_spans_still_renders_every_view(browser, served):
    for path in VIEWS:
        if path != "/compare":
            visit(browser, served.url + path + "?run=partial")
            assert "Traceback" not in browser.page_source
            assert not [t for t in texts(browser, ".tt-error") if "could not be computed" in t], path
    shown = " ".join(texts(browser, ".tt-notice"))
    visit(browser, served.url + "/?run=partial")
    assert "5 events dropped" in " ".join(texts(browser, ".tt-notice")), shown
    _no_console_errors(browser)


@pytest.mark.parametrize(("which", "expected"), [("missing", "does not exist"), ("empty", "is empty")])
def test_missing_or_empty_store_says_so(browser, serve, stores, which, expected):
    s = serve(stores[which])
    for path in ("/", "/explorer", "/compare"):
        visit(browser, s.url + path)
        assert expected in " ".join(texts(browser, ".tt-notice"))
    _no_console_errors(browser)


def test_live_mode_shows_a_run_that_appears_while_the_page_is_open(browser, serve, stores):
    live_store = stores["root"] / "live"
    live_store.mkdir()
    s = serve(live_store, live=True, refresh_s=0.5)
    visit(browser, s.url + "/")
    assert "is empty" in " ".join(texts(browser, ".tt-notice"))
    write_run(live_store, "arriving", num_requests=40, seed=3)
    deadline = time.time() + 30
    while not browser.find_elements("css selector", "#overview-kpis") and time.time() < deadline:
        time.sleep(0.2)
    assert browser.find_elements("css selector", "#overview-kpis"), "live page did not pick up the new run"
    _no_console_errors(browser)
