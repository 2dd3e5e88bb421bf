"""The dashboard says what the report says first: saturated or not, which pool, what the deployment lacks.

A simulated run with a known truth (arrivals at 2.25x the decode pool's capacity,
``tests/analyzers/simulated.py``) is served beside the synthetic ``base`` run, which
is not saturated. Screenshots: ``screenshots/overview-saturated.png``,
``screenshots/pd-ratio-saturated.png``, ``screenshots/compare-identical.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from browser import screenshot, severe_logs, texts, visit
from conftest import SCREENSHOTS
from synthetic_store import write_run

sys.path.append(str(Path(__file__).resolve().parents[1] / "analyzers"))  # the simulated-run helpers

from handmade import HandMade  # noqa: E402
from simulated import simulate  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def overloaded(serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("dash-load")
    h = HandMade()
    simulate(h, [i * 200.0 for i in range(100)], decode_step_ms=50.0)  # 5 req/s against 2.22 req/s of decode
    h.write(store, run_id="overloaded")
    return serve(store)


def test_overview_leads_with_the_saturation_verdict_and_the_pool(browser, overloaded):
    visit(browser, overloaded.url + "/?run=overloaded")
    verdict = browser.find_element("css selector", "#overview-load-verdict")
    assert verdict.text.startswith("SATURATED: arrivals outran service, offered 5.00 req/s")
    assert "The decode pool saturates" in verdict.text and "tt-saturated" in verdict.get_attribute("class")
    kpi = browser.find_element("css selector", "#overview-kpis")
    assert verdict.location["y"] < kpi.location["y"]  # above the latency figures
    cards = " ".join(texts(browser, "#overview-load .tt-kpi"))
    assert "5.00 req/s" in cards and "2.22 req/s" in cards and "decode" in cards
    advice = browser.find_element("css selector", "#overview-advice").text
    assert "decode 3 (75% busy; has 1)" in advice and "lacks 2 decode" in advice
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "overview-saturated.png")


def test_pd_page_asks_for_whole_instances_of_the_saturated_pool(browser, overloaded):
    visit(browser, overloaded.url + "/pd-ratio?run=overloaded")
    assert "lacks 2 decode instance(s)" in browser.find_element("css selector", "#pd-advice").text
    cards = texts(browser, "#pd-kpis .tt-kpi")
    assert any("3 (has 1)" in c and "decode" in c for c in cards), cards
    assert any("1 : 3" in c for c in cards), cards
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "pd-ratio-saturated.png")


def test_a_run_that_is_not_saturated_says_so(browser, served):
    visit(browser, served.url + "/?run=base")
    verdict = browser.find_element("css selector", "#overview-load-verdict")
    assert verdict.text.startswith("Not saturated") and "tt-not-saturated" in verdict.get_attribute("class")


def test_identical_runs_compare_with_no_flagged_change(browser, serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("dash-identical")
    write_run(store, "first", num_requests=120, seed=4)
    write_run(store, "second", num_requests=120, seed=4)
    s = serve(store)
    visit(browser, s.url + "/compare?run=second&base=first")
    summary = browser.find_element("css selector", "#compare-summary")
    assert "tt-no-regressions" in summary.get_attribute("class"), summary.text
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "compare-identical.png")
