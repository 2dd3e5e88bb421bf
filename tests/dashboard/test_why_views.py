"""The dashboard says why first: the overview leads with the SLO verdict and the ranked causes with their
fixes, above the load verdict; the request explorer shows the chosen request's causes beside its waterfall.

A simulated run with a known truth (arrivals at 2.25x the decode pool's capacity,
``tests/analyzers/simulated.py``): every late request waited because arrivals outran service.
Screenshots: ``screenshots/overview-why.png``, ``screenshots/explorer-why.png``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from browser import screenshot, severe_logs, texts, visit
from conftest import SCREENSHOTS

import tokentrace
from tokentrace.schema import col

sys.path.append(str(Path(__file__).resolve().parents[1] / "analyzers"))  # the simulated-run helpers

from handmade import HandMade  # noqa: E402
from simulated import simulate  # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def overloaded(serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("dash-why")
    h = HandMade()
    simulate(h, [i * 200.0 for i in range(100)], decode_step_ms=50.0)  # 5 req/s against 2.22 req/s of decode
    h.write(store, run_id="overloaded")
    return store, serve(store)


def test_overview_leads_with_the_slo_verdict_and_the_causes_with_their_fixes(browser, overloaded):
    _, served = overloaded
    visit(browser, served.url + "/?run=overloaded")
    verdict = browser.find_element("css selector", "#overview-slo-verdict")
    assert verdict.text.startswith("SLO MISSED: ") and "tt-saturated" in verdict.get_attribute("class")
    causes = texts(browser, "#overview-causes li")
    assert causes and causes[0].startswith("Why #1: overload") and "Fix: add instances" in causes[0], causes
    load = browser.find_element("css selector", "#overview-load-verdict")
    assert verdict.location["y"] < load.location["y"]  # why before how loaded
    advice = browser.find_element("css selector", "#overview-advice").text
    assert "has enough instances" not in advice
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "overview-why.png")


def test_the_explorer_shows_the_chosen_requests_causes_beside_its_waterfall(browser, overloaded):
    store, served = overloaded
    d = tokentrace.open(store, "overloaded").analyze().diagnosis()
    worst = d.requests.iloc[0]
    visit(browser, served.url + f"/explorer?run=overloaded&request={int(worst[col.REQUEST_ID])}")
    why = browser.find_element("css selector", "#explorer-why").text
    assert why.startswith(f"{worst[col.REQUEST_KEY]} (tenant a, class interactive) missed "), why
    assert "ITL in 1 token gap," in why  # it waited for the decode pool after its first token
    assert "(overload," in why and "decode pool saturates" in why and "overload (decode.queue)" in why
    waterfall = browser.find_element("css selector", "#explorer-waterfall")
    assert waterfall.is_displayed()
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "explorer-why.png")


def test_a_request_that_met_its_targets_says_so(browser, overloaded):
    store, served = overloaded
    d = tokentrace.open(store, "overloaded").analyze().diagnosis()
    met = sorted(set(range(1, 101)) - set(d.requests[col.REQUEST_ID].astype(int)))
    assert met, "the first requests arrive before the queue builds"
    visit(browser, served.url + f"/explorer?run=overloaded&request={met[0]}")
    assert "met its SLO targets" in browser.find_element("css selector", "#explorer-why").text
