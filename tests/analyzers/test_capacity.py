"""Capacity: throughput, requests in flight, latency against load and prompt length, distributions, by hand.

Three requests on one engine (times in ms):

* r1: arrives 0, tokens at 100, 200, 300 (finish 300), prompt 10;
* r2: arrives 500, tokens at 900, 1000 (finish 1000), prompt 30;
* r3: arrives 1500, token at 1600, finish 1700, status error, prompt 20.

The run spans 0 .. 1700 ms; windows of 1 s start at 0 and 1000.
"""

from __future__ import annotations

import math

import pytest

from analyzers import capacity
from tokentrace.schema import RequestStatus, col


@pytest.fixture
def src(handmade):
    h = handmade
    h.request(1, 0, 300, prompt=10).tokens(1, [100, 200, 300])
    h.request(2, 500, 1000, prompt=30).tokens(2, [900, 1000])
    h.request(3, 1500, 1700, prompt=20, status=int(RequestStatus.ERROR)).tokens(3, [1600])
    return h.source()


def test_throughput_per_window(src):
    tp = capacity.throughput(src, window_s=1.0).set_index("window_start_s")
    assert list(tp.index) == [0.0, 1.0]
    assert tp.loc[0.0, "offered_rps"] == 2 and tp.loc[1.0, "offered_rps"] == 1  # arrivals 0, 500 | 1500
    assert tp.loc[0.0, "completed_rps"] == 1 and tp.loc[1.0, "completed_rps"] == 1  # r1 at 300, r2 at 1000 (r3 failed)
    assert tp.loc[0.0, "output_tokens_per_s"] == 4 and tp.loc[1.0, "output_tokens_per_s"] == 2  # 100..900 | 1000, 1600
    assert tp.loc[0.0, "prompt_tokens_per_s"] == 40 and tp.loc[1.0, "prompt_tokens_per_s"] == 20
    # in flight: r1 300 ms + r2 500 ms in the first second; r3 200 ms in the second
    assert tp.loc[0.0, "in_flight"] == pytest.approx(0.8) and tp.loc[1.0, "in_flight"] == pytest.approx(0.2)
    # waiting for a first token: r1 100 ms + r2 400 ms; r3 100 ms
    assert tp.loc[0.0, "waiting_first_token"] == pytest.approx(0.5)
    assert tp.loc[1.0, "waiting_first_token"] == pytest.approx(0.1)


def test_throughput_summary_over_the_run(src):
    s = capacity.throughput_summary(src).iloc[0]
    assert s["duration_s"] == pytest.approx(1.7)
    assert (s["num_requests"], s["num_completed"], s[col.NUM_OUTPUT_TOKENS], s[col.NUM_PROMPT_TOKENS]) == (3, 2, 6, 60)
    assert s["completed_rps"] == pytest.approx(2 / 1.7) and s["output_tokens_per_s"] == pytest.approx(6 / 1.7)


def test_latency_against_load_per_window(src):
    ll = capacity.load_latency(src, window_s=1.0).set_index("window_start_s")
    assert ll.loc[0.0, "offered_rps"] == 2 and ll.loc[0.0, "num_requests"] == 2
    assert ll.loc[0.0, "ttft_p50_ms"] == pytest.approx(250.0)  # TTFTs 100 and 400
    assert ll.loc[0.0, "ttft_p95_ms"] == pytest.approx(100 + 0.95 * 300)
    assert ll.loc[1.0, "ttft_p99_ms"] == pytest.approx(100.0)
    assert ll.loc[0.0, "itl_p50_ms"] == pytest.approx(100.0)  # every gap is 100 ms
    assert math.isnan(ll.loc[1.0, "itl_p50_ms"])  # r3 has one token


def test_percentiles_include_p95(src):
    pct = capacity.percentiles(src).set_index("metric")
    assert {"p50_ms", "p90_ms", "p95_ms", "p99_ms"} <= set(pct.columns)
    # TTFTs 100, 100, 400; p95 at position 0.95 * 2 = 1.9: 100 + 0.9 * 300 (linear interpolation)
    assert pct.loc["ttft", "p95_ms"] == pytest.approx(370.0)


def test_cdf_is_each_metrics_quantiles(src):
    cdf = capacity.cdf(src, points=4)
    ttft = cdf[cdf["metric"] == "ttft"]
    assert list(ttft["quantile"]) == [0, 0.25, 0.5, 0.75, 1]
    assert list(ttft["value_ms"]) == pytest.approx([100, 100, 100, 250, 400])
    with pytest.raises(ValueError):
        capacity.cdf(src, points=1)


def test_ttft_by_prompt_length_bins(src):
    bins = capacity.ttft_by_prompt(src, bins=3)
    assert list(bins["prompt_tokens_lo"]) == [10, 20, 30] and list(bins["num_requests"]) == [1, 1, 1]
    assert list(bins["ttft_p50_ms"]) == pytest.approx([100, 100, 400])


def test_a_run_without_requests_gives_empty_frames(handmade):
    src = handmade.source()
    assert capacity.throughput(src, window_s=1).empty and capacity.load_latency(src, window_s=1).empty
    assert capacity.cdf(src).empty and capacity.ttft_by_prompt(src).empty
    assert capacity.throughput_summary(src).iloc[0]["num_requests"] == 0
    with pytest.raises(ValueError):
        capacity.throughput(src, window_s=0)


def test_offered_load_is_the_load_analysis_figure(src):
    # arrivals 0, 500 and 1500 ms: 2 gaps over a 1.5 s arrival window
    row = capacity.offered_load(src).iloc[0]
    assert (row["num_requests"], row["arrival_window_s"]) == (3, pytest.approx(1.5))
    assert row["offered_rps"] == pytest.approx(2 / 1.5)
    from analyzers.load import load

    assert row["offered_rps"] == load(src).row["offered_rps"]


def test_slo_targets_are_those_the_slo_analysis_judges_by(src):
    from analyzers.slo import slo_attainment

    targets = capacity.slo_targets(src)
    judged = slo_attainment(src)
    judged = judged[judged[col.SLO_CLASS] != "*"][[col.SLO_CLASS, "ttft_target_ms", "tpot_target_ms"]]
    assert targets.to_dict("records") == judged.reset_index(drop=True).to_dict("records")
    assert len(targets) == 1


def test_no_requests_no_offered_load(handmade):
    src = handmade.source()
    assert math.isnan(capacity.offered_load(src).iloc[0]["offered_rps"]) and capacity.slo_targets(src).empty
