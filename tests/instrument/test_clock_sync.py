"""Clock alignment between processes: the reference clock server and a worker's pings."""

from __future__ import annotations

import time

import pytest

from instrument.clock_sync import ClockServer, ClockSync, SkewedRecorder, skew_for
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import Role, col


def test_worker_recovers_a_planted_skew_within_half_the_round_trip() -> None:
    skew = 3_000_000_000  # this "worker" runs 3 s ahead of the reference clock
    server = ClockServer()
    sink = InMemorySink()
    rec = SkewedRecorder(BufferedRecorder(sink, instance_id=5, flush_interval_s=0.05), skew)
    sync = ClockSync(rec, server.address, role=Role.DECODE, name="decode-0", clock=rec.clock, num_pings=8)
    try:
        est = sync.sync_once()
    finally:
        server.close()
        rec.close()
    assert est.num_samples == 8 and est.rtt_ns > 0
    assert abs(est.offset_ns - skew) <= est.rtt_ns // 2 + 1
    row = sink.table("instances").to_pylist()[-1]
    assert row[col.NAME] == "decode-0" and row[col.ROLE] == Role.DECODE
    assert row[col.CLOCK_OFFSET_NS] == -est.offset_ns  # t_ref = t_worker + offset
    assert row[col.CLOCK_RTT_NS] == est.rtt_ns


def test_skewed_recorder_shifts_every_time_and_nothing_else() -> None:
    sink = InMemorySink()
    rec = SkewedRecorder(BufferedRecorder(sink, instance_id=1), 1000)
    rid = rec.request_begin("r", arrival_ns=10)
    rec.span(rid, 3, 20, 30, 0)
    rec.token(rid, 0, emit_ns=40)
    rec.request_end(rid, finish_ns=50, first_token_ns=40)
    rec.close()
    span = sink.table("spans").to_pylist()[0]
    assert (span[col.START_NS], span[col.END_NS], span[col.TOKEN_INDEX]) == (1020, 1030, 0)
    token = sink.table("tokens").to_pylist()[0]
    assert token[col.EMIT_NS] == 1040 and token[col.SENT_NS] is None
    req = sink.table("requests").to_pylist()[0]
    assert (req[col.ARRIVAL_NS], req[col.FIRST_TOKEN_NS], req[col.FINISH_NS]) == (1010, 1040, 1050)


def test_skew_for_reads_only_the_named_instance() -> None:
    env = {"TOKENTRACE_TEST_CLOCK_SKEW_NS": "decode-0=5, prefill-0=-7"}
    assert skew_for("decode-0", env) == 5 and skew_for("prefill-0", env) == -7 and skew_for("gw", env) == 0
    with pytest.raises(ValueError, match="name=ns"):
        skew_for("x", {"TOKENTRACE_TEST_CLOCK_SKEW_NS": "oops"})


def test_unreachable_clock_server_is_logged_once_and_retried(caplog: pytest.LogCaptureFixture) -> None:
    server = ClockServer()
    address = server.address
    server.close()  # nobody answers any more
    rec = BufferedRecorder(InMemorySink(), instance_id=2)
    sync = ClockSync(rec, address, role=Role.PREFILL, name="p", num_pings=1, resync_s=0.05, timeout_s=0.02)
    with caplog.at_level("WARNING", logger="tokentrace"):
        sync.start()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.01)
        time.sleep(0.2)  # a few more failed rounds
        sync.close()
    rec.close()
    assert sync.estimate is None
    assert len([r for r in caplog.records if "clock sync" in r.getMessage()]) == 1
