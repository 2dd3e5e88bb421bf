"""The Speculative view and the report's speculative charts, in a real headless Chromium.

A store with a speculating run (:mod:`speculative_store`: its verify pass grows with the batch, so speculation
is slower than plain decoding at batch sizes 9-16) and a run that never speculated (empty state: one sentence).
Screenshots: ``screenshots/speculative.png`` and ``screenshots/report-speculative.png``.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from browser import graph_points, screenshot, severe_logs, texts, visit, what_people_see
from conftest import SCREENSHOTS
from speculative_store import ENGINE_ID, write_speculative_run
from synthetic_store import write_run

from tokentrace.app.report import make_report, render
from tokentrace.app.report.speculative import NO_SPECULATION
from tokentrace.palette import stage_colour
from tokentrace.schema import Stage

pytestmark = pytest.mark.timeout(120)

SPEC_GRAPHS = ("spec-acceptance", "spec-accepted", "spec-cost", "spec-itl-batch")
RAW_COLUMN = re.compile(r"^[a-z0-9.]+_[a-z0-9_.]+$")  # a legend that is a column name


@pytest.fixture(scope="module")
def spec_store(tmp_path_factory):
    store = tmp_path_factory.mktemp("speculative")
    write_run(store, "plain", num_requests=40, seed=3)
    time.sleep(0.01)  # creation times order the runs
    write_speculative_run(store, "spec", seed=0)
    return store


@pytest.fixture(scope="module")
def spec_served(serve, spec_store):
    return serve(spec_store)


# Per graph: trace names, colours, and how many finite values each has on its value axis.
_GRAPHS_JS = """
const out = {};
for (const g of document.querySelectorAll('.dash-graph')) {
  const gd = g.querySelector('.js-plotly-plot');
  if (!gd) continue;
  const finite = a => Array.from(a || []).filter(v => typeof v === 'number' && isFinite(v)).length;
  out[g.id] = {traces: gd.data.map(t => ({name: t.name, colour: (t.marker || {}).color,
                                          n: finite(t.orientation === 'h' ? t.x : t.y), x: Array.from(t.x || [])})),
               notes: (gd.layout.annotations || []).map(a => a.text), title: gd.layout.title.text,
               ytitle: (gd.layout.yaxis.title || {}).text, xtitle: (gd.layout.xaxis.title || {}).text};
}
return out;
"""


def test_the_view_draws_acceptance_cost_and_itl_by_batch_size(browser, spec_served):
    visit(browser, spec_served.url + "/speculative?run=spec")
    points = graph_points(browser)
    assert {gid: points.get(gid, 0) for gid in SPEC_GRAPHS if points.get(gid, 0) <= 0} == {}
    graphs = browser.execute_script(_GRAPHS_JS)
    acceptance = {t["name"]: t for t in graphs["spec-acceptance"]["traces"]}
    assert set(acceptance) == {"accepted (of the steps that proposed it)", "accepted when the position before was"}
    assert acceptance["accepted (of the steps that proposed it)"]["x"] == [f"position {j}" for j in range(1, 5)]
    assert graphs["spec-accepted"]["traces"][0]["x"] == ["0", "1", "2", "3", "4"]
    itl = {t["name"]: t for t in graphs["spec-itl-batch"]["traces"]}
    assert set(itl) == {"speculative: mean ITL", "plain: mean ITL", "speculative: amortized step time per token",
                        "plain: amortized step time per token"}
    # the stage palette: speculative work in decode.verify's colour, plain steps in decode.compute's
    assert itl["speculative: mean ITL"]["colour"] == stage_colour(Stage.DECODE_VERIFY)
    assert itl["plain: mean ITL"]["colour"] == stage_colour(Stage.DECODE_COMPUTE)
    cost = {t["name"]: t["colour"] for t in graphs["spec-cost"]["traces"]}
    assert cost["draft, rejected proposals"] == stage_colour(Stage.DECODE_DRAFT)
    assert "9-16" in itl["speculative: mean ITL"]["x"]
    assert "speculation slower" in graphs["spec-itl-batch"]["notes"]  # the planted slowdown at batch 9-16
    assert graphs["spec-itl-batch"]["ytitle"] == "ms" and "batch size" in graphs["spec-itl-batch"]["xtitle"]
    cards = " ".join(texts(browser, "#spec-kpis .tt-kpi"))
    for label in ("acceptance rate", "tokens per verify step", "draft share of decode compute",
                  "speculative: step time per token", "plain: step time per token"):
        assert label in cards, cards
    sentences = " ".join(texts(browser, "#spec-sentences p"))
    assert "were accepted" in sentences and "slower than plain decoding at batch size 9-16" in sentences
    assert "Plain decode tokens that shared their step with speculating requests" in sentences
    steps = [c.text for c in browser.find_elements("css selector", "#spec-neighbours-table td[data-dash-column='step']")]
    assert steps == ["no speculation in the step", "beside speculating requests"]
    slower = [c.text for c in browser.find_elements("css selector", "#spec-batch-table td[data-dash-column='slower']")]
    assert "yes" in slower and "no" in slower
    headers = texts(browser, "#spec-batch-table th")
    assert "speculative mean ITL (ms)" in headers and "spec_mean_itl_ms" not in headers
    seen = what_people_see(browser)
    assert str(ENGINE_ID)[:12] not in seen["text"] and not re.findall(r"\d{15,}", seen["text"])
    assert not [n for n in seen["names"] if RAW_COLUMN.match(n)], seen["names"]
    assert not [t for t in seen["svg"] if re.search(r"\d[eE][+-]?\d", t)]
    assert not texts(browser, ".tt-error")
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "speculative.png")


def test_a_run_without_speculation_says_so_in_one_sentence(browser, spec_served):
    visit(browser, spec_served.url + "/speculative?run=plain")
    assert NO_SPECULATION in " ".join(texts(browser, ".tt-notice"))
    assert graph_points(browser) == {}  # no empty pair of axes
    assert "Speculative" in " ".join(texts(browser, ".tt-nav-link"))
    assert severe_logs(browser) == []


# Per chart of the HTML report: drawn, and finite values on its value axis.
_REPORT_JS = """
const charts = {};
for (const gd of document.querySelectorAll('.plotly-graph-div')) {
  const finite = a => Array.from(a || []).filter(v => typeof v === 'number' && isFinite(v)).length;
  charts[gd.id] = {drawn: Boolean(gd._fullLayout && gd.querySelector('.main-svg')),
                   values: (gd._fullData || []).reduce((n, t) => n + finite(t.orientation === 'h' ? t.x : t.y), 0)};
}
return {charts: charts, text: document.body.innerText};
"""


def _open_report(browser: Any, page: Any) -> dict[str, Any]:
    browser.get(page.as_uri())
    deadline = time.monotonic() + 30
    while True:
        state = browser.execute_script(_REPORT_JS)
        if state["charts"] and all(c["drawn"] for c in state["charts"].values()):
            return state
        assert time.monotonic() < deadline, state["charts"]
        time.sleep(0.05)


def test_the_html_report_charts_speculation_and_says_one_sentence_without_it(browser, spec_store, tmp_path):
    page = tmp_path / "spec.html"
    page.write_text(render(make_report(spec_store, "spec"), "html"), encoding="utf-8")
    state = _open_report(browser, page)
    spec = {gid: c["values"] for gid, c in state["charts"].items() if gid.startswith("chart-spec-")}
    assert set(spec) == {"chart-spec-acceptance", "chart-spec-accepted", "chart-spec-cost", "chart-spec-itl"}
    assert all(v > 0 for v in spec.values()), spec
    assert "Speculative decoding" in state["text"] and "were accepted" in state["text"]
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "report-speculative.png")

    plain = tmp_path / "plain.html"
    plain.write_text(render(make_report(spec_store, "plain"), "html"), encoding="utf-8")
    state = _open_report(browser, plain)
    assert not [gid for gid in state["charts"] if gid.startswith("chart-spec-")]
    assert NO_SPECULATION in state["text"]
