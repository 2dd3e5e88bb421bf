"""A run with client rows only (the server was not traced) reports the client's latencies and says so."""

from __future__ import annotations

from pathlib import Path

from tokentrace.app.report import make_report
from tokentrace.app.report.model import NO_SERVER_LANE
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import Role
from tokentrace.store import StoreWriter

NUM_REQUESTS = 12


def _client_only_run(store: Path) -> None:
    writer = StoreWriter(store, run_id="client-only")
    rec = BufferedRecorder(writer, instance_id=writer.instance_id, flush_interval_s=600)
    rec.instance(role=Role.CLIENT, name="bench-client")
    for n in range(NUM_REQUESTS):
        base = n * 500_000_000  # one request every 0.5 s
        rid = rec.request_begin(f"req-{n}", tenant="acme", arrival_ns=base, num_prompt_tokens=4)
        for i in range(4):  # TTFT 40 ms, then a token every 10 ms
            rec.token(rid, i, sent_ns=base + 40_000_000 + i * 10_000_000)
        rec.request_end(rid, first_token_ns=base + 40_000_000, finish_ns=base + 70_000_000, num_output_tokens=4)
    rec.close()


def test_client_rows_only_report_the_clients_latencies_and_no_server_lane(tmp_path: Path) -> None:
    _client_only_run(tmp_path / "st")
    report = make_report(tmp_path / "st", "client-only")
    assert NO_SERVER_LANE in report.headline
    sections = {s.key: s for s in report.sections}
    latency = sections["latency"]
    assert "client view" in latency.title
    ttft = latency.tables[0][1].set_index("metric").loc["ttft"]
    assert int(ttft["count"]) == NUM_REQUESTS
    assert abs(float(ttft["mean_ms"]) - 40.0) < 1e-6
    assert "no server lane" in sections["agreement"].note
