"""Live Prometheus metrics of a traced process, scraped over HTTP and parsed with prometheus_client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import tokentrace
from tokentrace.live_metrics import MetricsRecorder, serve_metrics
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import REQUESTS, RequestStatus, Stage

MS = 1_000_000
REPO = Path(__file__).resolve().parents[2]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the exposition: (name, sorted labels) -> value, parsed by prometheus_client."""
    text = httpx.get(url, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _one_request(rec) -> None:
    """A request whose stages are known: token 0 = [0, 40 ms], token 1 = (40, 60 ms]."""
    rid = rec.request_begin("r1", arrival_ns=1_000 * MS)
    t = 1_000 * MS
    rec.span(rid, Stage.SCHEDULE_QUEUE, t, t + 10 * MS, 0)
    rec.span(rid, Stage.PREFILL_COMPUTE, t + 10 * MS, t + 30 * MS, 0)
    rec.token(rid, 0, emit_ns=t + 35 * MS)  # an engine's emit, then the gateway's send: the send counts
    rec.token(rid, 0, sent_ns=t + 40 * MS)
    rec.span(rid, Stage.DECODE_COMPUTE, t + 38 * MS, t + 50 * MS, 1)  # clipped to (40, 50]
    rec.span(rid, Stage.STREAM_SEND, t + 45 * MS, t + 55 * MS, 1)  # overlaps decode by 5 ms
    rec.token(rid, 1, emit_ns=t + 50 * MS)
    rec.token(rid, 1, sent_ns=t + 60 * MS)
    rec.request_end(rid, finish_ns=t + 60 * MS, first_token_ns=t + 40 * MS, num_output_tokens=2)


def test_stage_histograms_split_ttft_and_itl_with_unattributed_and_overlap():
    sink = InMemorySink()
    live = MetricsRecorder(BufferedRecorder(sink, instance_id=7))
    server = serve_metrics(live, port=0)
    try:
        _one_request(live)
        m = _scrape(server.url)
    finally:
        live.close()
    assert sink.table(REQUESTS.name).num_rows == 1  # every event still reaches the store

    def h(name: str, stage: str | None = None, part: str = "sum") -> float:
        labels = (("stage", stage),) if stage else ()
        return m[(f"{name}_{part}", labels)]

    assert h("gen_ai_server_time_to_first_token_seconds") == pytest.approx(0.040)
    assert h("gen_ai_server_time_per_output_token_seconds") == pytest.approx(0.020)
    assert h("gen_ai_server_request_duration_seconds") == pytest.approx(0.060)
    assert h("tokentrace_ttft_stage_seconds", "schedule.queue") == pytest.approx(0.010)
    assert h("tokentrace_ttft_stage_seconds", "prefill.compute") == pytest.approx(0.020)
    assert h("tokentrace_ttft_stage_seconds", "unattributed") == pytest.approx(0.010)
    assert h("tokentrace_ttft_stage_seconds", "overlap") == pytest.approx(0.0)
    assert h("tokentrace_itl_stage_seconds", "decode.compute") == pytest.approx(0.010)
    assert h("tokentrace_itl_stage_seconds", "stream.send") == pytest.approx(0.010)
    assert h("tokentrace_itl_stage_seconds", "unattributed") == pytest.approx(0.005)  # (55, 60]
    assert h("tokentrace_itl_stage_seconds", "overlap") == pytest.approx(0.005)  # [45, 50) claimed twice
    assert h("tokentrace_itl_stage_seconds", "decode.compute", "count") == 1
    assert m[("tokentrace_requests_total", (("status", RequestStatus.OK.label),))] == 1
    assert m[("tokentrace_dropped_events_total", ())] == 0
    # a TTFT of 40 ms falls in vLLM's 0.04 s bucket
    assert m[("gen_ai_server_time_to_first_token_seconds_bucket", (("le", "0.04"),))] == 1


def test_instrument_serves_metrics_and_a_taken_port_moves_to_the_next(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with tokentrace.instrument(store=tmp_path, run="live", role="gateway", metrics_port=port) as handle:
            assert handle.recorder.server.port != port  # the next free one
            _one_request(handle.recorder)
            m = _scrape(handle.recorder.server.url)
    assert m[("gen_ai_server_time_to_first_token_seconds_count", ())] == 1
    assert tokentrace.open(tmp_path, run="live").table(REQUESTS.name).num_rows == 1


SCRIPT = """
import json, sys
import httpx
from instrument.autoinstrument import process_handle
from tokentrace.schema import Role
handle = process_handle(role=Role.GATEWAY, name="gw")
rec = handle.recorder
rid = rec.request_begin("x", arrival_ns=rec.clock())
rec.token(rid, 0, sent_ns=rec.clock() + 5_000_000)
rec.request_end(rid, finish_ns=rec.clock() + 6_000_000)
print(json.dumps({"url": rec.server.url, "text": httpx.get(rec.server.url, timeout=10).text}))
handle.close()
"""


def test_tokentrace_run_metrics_port_reaches_the_traced_process(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run", "--store",
                          str(tmp_path), "--run", "r", "--metrics-port", str(port), "--", sys.executable, "-c", SCRIPT],
                         capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["url"].startswith("http://127.0.0.1:") and int(got["url"].split(":")[2].split("/")[0]) >= port
    families = {f.name: f for f in text_string_to_metric_families(got["text"])}
    assert families["gen_ai_server_time_to_first_token_seconds"].type == "histogram"
    count = [s for s in families["gen_ai_server_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert count[0].value == 1


def test_the_grafana_dashboard_queries_only_metrics_the_exposition_has():
    import re

    dashboard = json.loads((REPO / "docs" / "grafana-tokentrace.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if isinstance(v.get("query"), dict)]
    live = MetricsRecorder(BufferedRecorder(InMemorySink(), instance_id=1))
    server = serve_metrics(live, port=0)
    try:
        _one_request(live)
        exposed = {name for name, _ in _scrape(server.url)}
    finally:
        live.close()
    used = {m for e in exprs for m in re.findall(r"\b((?:gen_ai|tokentrace)_[a-z_]+)\b", e)}
    assert len(used) >= 7 and used <= exposed, sorted(used - exposed)
    labels = {m for e in exprs for m in re.findall(r"by \(([a-z_, ]+)\)", e)}
    assert {"stage", "status", "le"} <= {x.strip() for group in labels for x in group.split(",")}
