"""The final summary: vLLM's definitions and names, goodput, text and JSON."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tokentrace.app.bench.client import FailureKind, Outcome
from tokentrace.app.bench.requests import PlannedRequest, TextRequest
from tokentrace.app.bench.summary import parse_slo, render_text, summarize

MS = 1_000_000


def _plan(n: int) -> list[PlannedRequest]:
    return [PlannedRequest(i, f"k{i}", TextRequest("", "x" * 10, 3), 0.0) for i in range(n)]


def _outcomes() -> list[Outcome]:
    """Request 0: sent 0, tokens 10, 14, 20 ms, done 21 ms (usage: 12 prompt tokens, 3 output).
    Request 1: sent 5, tokens 25, 27 ms, done 27 ms (no usage). Request 2: HTTP 500 at 6 ms."""
    return [
        Outcome(0, "k0", 0, (10 * MS, 14 * MS, 20 * MS), 21 * MS, 200, None, num_prompt_tokens=12,
                num_output_tokens=3),
        Outcome(1, "k1", 5 * MS, (25 * MS, 27 * MS), 27 * MS, 200, None),
        Outcome(2, "k2", 6 * MS, (), 6 * MS, 500, FailureKind.HTTP_5XX, "500"),
    ]


def test_vllm_definitions():
    s = summarize(_plan(3), _outcomes(), percentiles=(50, 99))
    d = s.as_dict()
    assert d["completed"] == 2 and d["failed"] == 1 and d["failures"]["http_5xx"] == 1
    assert d["duration"] == pytest.approx(0.027)
    assert d["total_input_tokens"] == 12 + 10  # usage, else the planned length
    assert d["total_output_tokens"] == 3 + 2
    assert d["request_throughput"] == pytest.approx(2 / 0.027)
    assert d["output_throughput"] == pytest.approx(5 / 0.027)
    assert d["mean_ttft_ms"] == pytest.approx(15.0)  # 10 and 20
    assert d["mean_tpot_ms"] == pytest.approx(((21 - 10) / 2 + (22 - 20) / 1) / 2)  # (E2EL - TTFT) / (n - 1)
    assert d["mean_itl_ms"] == pytest.approx((4 + 6 + 2) / 3)
    assert d["mean_e2el_ms"] == pytest.approx((21 + 22) / 2)
    assert d["median_e2el_ms"] == pytest.approx(21.5)
    assert d["p99_itl_ms"] <= 6.0 and d["p50_itl_ms"] == pytest.approx(4.0)
    assert d["request_goodput"] is None
    assert d["num_prompts"] == 3 and d["not_sent"] == 0
    json.dumps(d)  # JSON-ready


def test_requests_left_unsent_by_the_duration_bound_are_reported():
    s = summarize(_plan(5), _outcomes())
    assert s.as_dict()["not_sent"] == 2
    assert "Not sent (duration bound):" in render_text(s)


def test_goodput_counts_requests_meeting_every_target():
    s = summarize(_plan(3), _outcomes(), slo_ms=parse_slo("ttft=15ms,tpot=10ms"))
    assert s.num_good == 1  # request 0: ttft 10, tpot 5.5; request 1: ttft 20 misses
    assert s.as_dict()["request_goodput"] == pytest.approx(1 / 0.027)


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft=0.5s, tpot=50ms, e2el=2000") == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_slo("ttft=500us") == {"ttft": 0.5}
    for bad in ("ttft", "itl=5ms", "ttft=fast", "ttft=0ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_text_rendering_uses_vllm_labels():
    text = render_text(summarize(_plan(3), _outcomes(), slo_ms={"ttft": 15.0}))
    for label in ("Successful requests:", "Benchmark duration (s):", "Request goodput (req/s):",
                  "Mean TTFT (ms):", "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):", "http_5xx:"):
        assert label in text


def test_empty_run_gives_zeros_not_nans():
    d = summarize([], []).as_dict()
    assert d["completed"] == 0 and d["mean_ttft_ms"] == 0.0 and d["request_throughput"] == 0.0


def test_send_lag_is_each_send_against_its_due_time():
    # Due at start 100 ms + offsets 0, 2, 4 ms; sent at 0, 5, 6 ms after 100 ms: lags 0, 3, 2 ms.
    plan = [PlannedRequest(i, f"k{i}", TextRequest("", "x" * 10, 3), offset) for i, offset in
            enumerate((0.0, 0.002, 0.004))]
    shifted = [dataclasses.replace(o, send_ns=o.send_ns + 100 * MS, recv_ns=tuple(t + 100 * MS for t in o.recv_ns),
                                   finish_ns=o.finish_ns + 100 * MS) for o in _outcomes()]
    s = summarize(plan, shifted, start_ns=100 * MS)
    assert list(s.send_lag_ms) == pytest.approx([0.0, 3.0, 2.0])  # failed requests were sent too
    d = s.as_dict()
    assert (d["median_send_lag_ms"], d["max_send_lag_ms"]) == pytest.approx((2.0, 3.0))
    assert "P99 send lag (ms):" in render_text(s)
    unknown = summarize(plan, shifted)  # no start given: no lag, and the text leaves the section out
    assert unknown.send_lag_ms is None and unknown.as_dict()["p99_send_lag_ms"] is None
    assert "send lag" not in render_text(unknown)
