"""The Capacity view in a real browser: throughput, p50-p99, latency against load (windows and runs), TTFT against
prompt length, distributions, SLO target lines, and requests in flight and waiting on the latency's time axis.

A run with SLO targets close to its latencies (TTFT 20 ms / TPOT 9 ms for ``interactive``) shows the target lines
drawn; the session store's ``base`` run (targets of 500 ms over ~10 ms latencies) names them above the charts.
Screenshots: ``screenshots/capacity.png`` (by test_app), ``screenshots/capacity-slo.png``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from browser import graph_points, screenshot, severe_logs, texts, visit
from conftest import SCREENSHOTS
from synthetic_store import write_run

pytestmark = pytest.mark.timeout(120)

# Per graph: its traces' names and values, its shapes (SLO lines) and annotations.
_GRAPHS_JS = """
const out = {};
for (const g of document.querySelectorAll('.dash-graph')) {
  const gd = g.querySelector('.js-plotly-plot');
  if (!gd) continue;
  out[g.id] = {traces: gd.data.map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || []),
                                          yaxis: t.yaxis || 'y'})),
               shapes: (gd.layout.shapes || []).map(s => ({y0: s.y0, x0: s.x0, dash: (s.line || {}).dash})),
               notes: (gd.layout.annotations || []).map(a => a.text)};
}
return out;
"""


@pytest.fixture(scope="module")
def tight(serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("capacity")
    write_run(store, "light", num_requests=120, seed=5, rate_rps=20.0, slo_ms={"interactive": (20, 9)})
    time.sleep(0.01)
    write_run(store, "heavy", num_requests=400, seed=6, rate_rps=80.0, slo_ms={"interactive": (20, 9)})
    return serve(store)


def _graphs(browser: Any) -> dict[str, Any]:
    return browser.execute_script(_GRAPHS_JS)


def test_throughput_and_percentiles_up_to_p99(browser, served):
    visit(browser, served.url + "/capacity?run=base")
    cards = " ".join(texts(browser, "#capacity-kpis .tt-kpi"))
    assert "req/s" in cards and "tokens/s" in cards and "completed" in cards and "output tokens" in cards
    headers = texts(browser, "#capacity-percentiles th")
    assert [h for h in headers if h.startswith("p")] == ["p50 (ms)", "p90 (ms)", "p95 (ms)", "p99 (ms)"]
    assert set(texts(browser, "#capacity-percentiles td[data-dash-column='metric']")) == {
        "TTFT", "TPOT", "ITL", "end-to-end"}
    assert severe_logs(browser) == []


def test_in_flight_and_waiting_share_the_latency_time_axis(browser, served):
    visit(browser, served.url + "/capacity?run=base")
    over = _graphs(browser)["capacity-over-time"]
    by_name = {t["name"]: t for t in over["traces"]}
    for name in ("TTFT p50", "TTFT p95", "TTFT p99", "in flight", "waiting for a first token",
                 "waiting in engine queues", "offered req/s", "completed req/s", "output tokens/s"):
        assert name in by_name, (name, sorted(by_name))
    ttft, flight = by_name["TTFT p99"], by_name["in flight"]
    assert ttft["x"] == flight["x"]  # one time axis: the same windows
    assert ttft["yaxis"] != flight["yaxis"]  # stacked rows
    assert all(v > 0 for v in flight["y"]) and all(v > 0 for v in by_name["output tokens/s"]["y"])
    # the targets (500 ms, 30 s) are far above ~10 ms latencies: named, not drawn
    assert any("above the chart" in n for n in over["notes"]), over["notes"]


def test_slo_targets_are_lines_on_the_latency_charts(browser, tight):
    visit(browser, tight.url + "/capacity?run=heavy")
    graphs = _graphs(browser)
    for gid in ("capacity-over-time", "capacity-load-ttft", "capacity-prompt"):
        assert any(s["y0"] == 20 and s["dash"] == "dash" for s in graphs[gid]["shapes"]), (gid, graphs[gid]["shapes"])
    assert any(s["y0"] == 9 for s in graphs["capacity-load-itl"]["shapes"])  # ITL against the TPOT target
    cdf = graphs["capacity-cdf-long"]
    assert any(s["x0"] is not None for s in cdf["shapes"])  # a vertical TTFT target on the distribution
    assert any("SLO interactive: 20 ms" in n for n in cdf["notes"] + graphs["capacity-over-time"]["notes"])
    assert {gid: n for gid, n in graph_points(browser).items() if n <= 0} == {}
    assert severe_logs(browser) == []
    screenshot(browser, SCREENSHOTS / "capacity-slo.png")


def test_latency_against_offered_load_across_windows_and_runs(browser, tight):
    visit(browser, tight.url + "/capacity?run=heavy")
    graphs = _graphs(browser)
    windows = {t["name"]: t for t in graphs["capacity-load-ttft"]["traces"]}
    assert set(windows) >= {"TTFT p50", "TTFT p95", "TTFT p99"}
    assert len(windows["TTFT p99"]["x"]) >= 3 and windows["TTFT p99"]["x"] == sorted(windows["TTFT p99"]["x"])
    runs = {t["name"]: t for t in graphs["capacity-runs"]["traces"]}
    offered = runs["TTFT p50"]["x"]
    assert len(offered) == 2 and offered[1] > 2 * offered[0]  # light (~20 req/s) and heavy (~80 req/s)


def test_ttft_against_prompt_length_and_distributions(browser, served):
    visit(browser, served.url + "/capacity?run=base")
    graphs = _graphs(browser)
    prompt = {t["name"]: t for t in graphs["capacity-prompt"]["traces"]}
    assert len(prompt["TTFT p50"]["x"]) >= 10 and prompt["TTFT p50"]["x"] == sorted(prompt["TTFT p50"]["x"])
    for gid, names in (("capacity-cdf-long", {"TTFT", "end-to-end"}), ("capacity-cdf-short", {"ITL", "TPOT"})):
        traces = {t["name"]: t for t in graphs[gid]["traces"]}
        assert set(traces) == names
        for t in traces.values():
            assert t["y"][0] == 0 and t["y"][-1] == 1 and t["x"] == sorted(t["x"])  # a distribution function


def test_a_store_of_one_run_says_why_there_is_no_curve_across_runs(browser, serve, tmp_path):
    write_run(tmp_path, "only", num_requests=50, seed=1)
    s = serve(tmp_path)
    visit(browser, s.url + "/capacity")
    assert "This store holds one run" in " ".join(texts(browser, ".tt-notice"))
    assert severe_logs(browser) == []
