"""Recorder: exact round trips, nulls, threads, caps, invalid input, sink failures."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pyarrow as pa
import pytest

from tokentrace.clock import Anchor
from tokentrace.recorder import BufferedRecorder, Recorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    LOOP_LAGS,
    REQUESTS,
    SETUP_TABLES,
    SPANS,
    SPEC_STEPS,
    STEPS,
    TABLES,
    TOKENS,
    CacheEventKind,
    DraftSource,
    RequestStatus,
    Role,
    Stage,
    Tier,
    col,
    request_id_of,
)

BIG_CAP = 1 << 30  # nothing is dropped for size in tests that use it


def rows(sink: InMemorySink, table) -> list[dict]:
    return sink.table(table.name).to_pylist()


@pytest.fixture
def sink():
    return InMemorySink()


@pytest.fixture
def rec(sink):
    r = BufferedRecorder(sink, instance_id=42, memory_cap_bytes=BIG_CAP, flush_interval_s=60)
    yield r
    r.close()


def test_every_table_round_trips_exact_values(sink, rec):
    rid = rec.request_begin("req-1", tenant="acme", slo_class="interactive", arrival_ns=100,
                            num_prompt_tokens=12, trace_id="ab" * 16, session="chat-9", session_turn=3)
    assert rid == request_id_of("req-1", "acme")
    rec.span(rid, Stage.PREFILL_COMPUTE, 110, 150, 0, 7, 4096, Tier.HOST, 3)
    rec.token(rid, 0, emit_ns=150, sent_ns=160, recv_ns=170, step=7)
    rec.step(7, 110, 150, 3, 12, 2, 1, 3, 0, 10, 100, 5, 50, 1, 20)
    rec.cache_event(CacheEventKind.LOAD, Tier.DEVICE, 4, 105, 109, rid, 64, 8192, 7)
    rec.request_end(rid, finish_ns=200, status=RequestStatus.ERROR, first_token_ns=160,
                    num_output_tokens=1, num_cached_tokens=8, error="oom", first_content_ns=165)
    rec.instance(role=Role.DECODE, name="decode-1", host="h1", pid=99,
                 anchor=Anchor(mono_ns=5, wall_ns=6), clock_offset_ns=-7, clock_rtt_ns=8)
    rec.loop_lag(300, 340)
    rec.loop_lag(400, 450, 390, 55, 60)
    rec.spec_step(rid, 7, DraftSource.NGRAM, 4, 3, 5, 120, 125, 126, 150, 3, 2)
    rec.flush()

    assert rows(sink, REQUESTS) == [{
        col.REQUEST_ID: rid, col.REQUEST_KEY: "req-1", col.INSTANCE_ID: 42, col.TENANT: "acme",
        col.SLO_CLASS: "interactive", col.ARRIVAL_NS: 100, col.FIRST_TOKEN_NS: 160,
        col.FIRST_CONTENT_NS: 165, col.FINISH_NS: 200, col.NUM_PROMPT_TOKENS: 12, col.NUM_CACHED_TOKENS: 8,
        col.NUM_OUTPUT_TOKENS: 1, col.STATUS: int(RequestStatus.ERROR), col.ERROR: "oom",
        col.TRACE_ID: "ab" * 16, col.SESSION: "chat-9", col.SESSION_TURN: 3,
    }]
    assert rows(sink, SPANS) == [{
        col.REQUEST_ID: rid, col.STAGE: int(Stage.PREFILL_COMPUTE), col.TOKEN_INDEX: 0,
        col.START_NS: 110, col.END_NS: 150, col.INSTANCE_ID: 42, col.STEP: 7,
        col.NUM_BYTES: 4096, col.TIER: int(Tier.HOST), col.BATCH_SIZE: 3,
    }]
    assert rows(sink, TOKENS) == [{
        col.REQUEST_ID: rid, col.TOKEN_INDEX: 0, col.EMIT_NS: 150, col.SENT_NS: 160,
        col.RECV_NS: 170, col.STEP: 7, col.INSTANCE_ID: 42,
    }]
    assert rows(sink, STEPS) == [{
        col.INSTANCE_ID: 42, col.STEP: 7, col.START_NS: 110, col.END_NS: 150, col.NUM_SEQS: 3,
        col.NUM_PREFILL_TOKENS: 12, col.NUM_DECODE_TOKENS: 2, col.NUM_WAITING: 1,
        col.NUM_RUNNING: 3, col.NUM_PREEMPTED: 0, col.NUM_BLOCKS_USED_DEVICE: 10,
        col.NUM_BLOCKS_TOTAL_DEVICE: 100, col.NUM_BLOCKS_USED_HOST: 5,
        col.NUM_BLOCKS_TOTAL_HOST: 50, col.NUM_BLOCKS_USED_DISK: 1, col.NUM_BLOCKS_TOTAL_DISK: 20,
    }]
    assert rows(sink, CACHE_EVENTS) == [{
        col.INSTANCE_ID: 42, col.REQUEST_ID: rid, col.KIND: int(CacheEventKind.LOAD),
        col.TIER: int(Tier.DEVICE), col.NUM_BLOCKS: 4, col.NUM_TOKENS: 64, col.NUM_BYTES: 8192,
        col.START_NS: 105, col.END_NS: 109, col.STEP: 7,
    }]
    assert rows(sink, INSTANCES) == [{
        col.INSTANCE_ID: 42, col.ROLE: int(Role.DECODE), col.NAME: "decode-1", col.HOST: "h1",
        col.PID: 99, col.MONO_ANCHOR_NS: 5, col.WALL_ANCHOR_NS: 6, col.CLOCK_OFFSET_NS: -7,
        col.CLOCK_RTT_NS: 8,
    }]
    assert rows(sink, LOOP_LAGS) == [  # not measured: null
        {col.INSTANCE_ID: 42, col.START_NS: 300, col.END_NS: 340, col.ARMED_NS: None, col.LOOP_CPU_NS: None,
         col.PROCESS_CPU_NS: None},
        {col.INSTANCE_ID: 42, col.START_NS: 400, col.END_NS: 450, col.ARMED_NS: 390, col.LOOP_CPU_NS: 55,
         col.PROCESS_CPU_NS: 60}]
    assert rows(sink, SPEC_STEPS) == [{
        col.INSTANCE_ID: 42, col.REQUEST_ID: rid, col.STEP: 7, col.DRAFT_SOURCE: int(DraftSource.NGRAM),
        col.NUM_PROPOSED: 4, col.NUM_ACCEPTED: 3, col.FIRST_TOKEN_INDEX: 5, col.DRAFT_START_NS: 120,
        col.DRAFT_END_NS: 125, col.VERIFY_START_NS: 126, col.VERIFY_END_NS: 150, col.BATCH_SIZE: 3,
        col.NUM_SPEC_SEQS: 2,
    }]
    recorded = [name for name in TABLES if name not in SETUP_TABLES]
    for name in recorded:
        assert sink.table(name).schema.equals(TABLES[name].schema, check_metadata=True)
    counters = rec.counters
    assert {name: counters[name] for name in recorded} == {name: 2 if name == LOOP_LAGS.name else 1
                                                           for name in recorded}
    assert counters["dropped"] == counters["dropped_invalid"] == counters["sink_errors"] == 0


def test_nullable_columns_become_nulls_and_others_keep_minus_one(sink, rec):
    rec.span(1, Stage.DETOKENIZE, 10, 20)
    rec.token(1, 3, sent_ns=5)
    rec.step(1, 2, 3, 4, 5, 6, 7, 8, 9)
    rec.cache_event(CacheEventKind.EVICT, Tier.HOST, 2, 30, 30)
    rec.flush()
    span = rows(sink, SPANS)[0]
    assert span[col.TOKEN_INDEX] == -1  # not nullable: -1 means request-level
    assert span[col.STEP] is span[col.NUM_BYTES] is span[col.TIER] is span[col.BATCH_SIZE] is None
    token = rows(sink, TOKENS)[0]
    assert token[col.EMIT_NS] is None and token[col.RECV_NS] is None and token[col.SENT_NS] == 5
    step = rows(sink, STEPS)[0]
    assert step[col.NUM_BLOCKS_USED_DEVICE] is None and step[col.NUM_PREEMPTED] == 9
    event = rows(sink, CACHE_EVENTS)[0]
    assert event[col.REQUEST_ID] is None and event[col.NUM_TOKENS] is None
    assert sink.table(SPANS.name).column(col.STEP).null_count == 1


def test_stage_begin_end_pairs_make_spans_and_stray_ends_are_counted(sink, rec):
    rec.stage_begin(5, Stage.SCHEDULE_QUEUE, 100)
    rec.stage_begin(5, Stage.DECODE_QUEUE, 200, 3)
    rec.stage_end(5, Stage.DECODE_QUEUE, 260, 3, 11, -1, -1, 4)
    rec.stage_end(5, Stage.SCHEDULE_QUEUE, 150)
    rec.stage_end(5, Stage.SCHEDULE_QUEUE, 151)  # already closed
    rec.stage_end(6, Stage.STREAM_SEND, 1)  # never opened
    rec.flush()
    got = {(r[col.STAGE], r[col.TOKEN_INDEX]): (r[col.START_NS], r[col.END_NS], r[col.STEP], r[col.BATCH_SIZE])
           for r in rows(sink, SPANS)}
    assert got == {
        (int(Stage.SCHEDULE_QUEUE), -1): (100, 150, None, None),
        (int(Stage.DECODE_QUEUE), 3): (200, 260, 11, 4),
    }
    assert rec.counters["dropped_invalid"] == 2


def test_request_end_without_begin_still_writes_a_row(sink, rec):
    rec.request_end(77, finish_ns=500, status=RequestStatus.ABORTED)
    rec.flush()
    (row,) = rows(sink, REQUESTS)
    assert row[col.REQUEST_ID] == 77 and row[col.FINISH_NS] == 500
    assert row[col.REQUEST_KEY] == row[col.TENANT] == row[col.TRACE_ID] == ""
    assert row[col.STATUS] == int(RequestStatus.ABORTED)
    assert row[col.NUM_PROMPT_TOKENS] is None


def test_bad_arguments_never_raise_and_are_counted(sink, rec):
    rec.span(1, Stage.STREAM_SEND, 1.5, 2)  # float time
    rec.span(1, Stage.STREAM_SEND, None, 2)
    rec.span(2**64, Stage.STREAM_SEND, 1, 2)  # does not fit int64
    rec.span(1, 99, 1, 2)  # not a stage: caught at flush
    rec.span(1, Stage.STREAM_SEND, 1, 2, 2**40)  # token index beyond int32
    rec.token(1, 0, emit_ns="now")
    rec.step(1, 2, 3, 4, 5, 6, 7, 8, "x")
    rec.cache_event(99, Tier.DEVICE, 1, 2, 3)  # not a cache event kind
    rec.stage_begin([1], Stage.STREAM_SEND, 1)  # unhashable
    assert rec.request_begin(123, arrival_ns=1) == -1  # key must be a str
    rec.request_end(5, finish_ns=1.0)
    rec.span(1, Stage.STREAM_SEND, 1, 2)  # the one good event
    rec.flush()
    assert rec.counters["dropped_invalid"] == 11
    assert [r[col.START_NS] for r in rows(sink, SPANS)] == [1]
    assert sink.num_rows(REQUESTS.name) == sink.num_rows(CACHE_EVENTS.name) == 0


def _hammer(rec: Recorder, num_threads: int, num_events: int) -> None:
    def work(t: int) -> None:
        span = rec.span
        for i in range(num_events):
            span(t, Stage.DECODE_COMPUTE, i, i + 1, i % 1000)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(num_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def test_eight_threads_lose_nothing_under_the_cap():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1, memory_cap_bytes=BIG_CAP, flush_interval_s=0.05, batch_rows=20_000)
    _hammer(rec, 8, 100_000)
    rec.close()
    spans = sink.table(SPANS.name)
    assert spans.num_rows == 800_000
    per_thread = spans.group_by(col.REQUEST_ID).aggregate([(col.START_NS, "sum"), (col.START_NS, "count")])
    expected_sum = sum(range(100_000))
    assert sorted(per_thread.column(f"{col.START_NS}_sum").to_pylist()) == [expected_sum] * 8
    assert sorted(per_thread.column(f"{col.START_NS}_count").to_pylist()) == [100_000] * 8
    assert sorted(per_thread.column(col.REQUEST_ID).to_pylist()) == list(range(8))
    # Rows are whole: end = start + 1 everywhere, token index = start % 1000.
    starts = spans.column(col.START_NS).to_numpy()
    assert (spans.column(col.END_NS).to_numpy() == starts + 1).all()
    assert (spans.column(col.TOKEN_INDEX).to_numpy() == starts % 1000).all()
    c = rec.counters
    assert c[SPANS.name] == 800_000 and c["dropped"] == 0 and c["dropped_invalid"] == 0


class BudgetCheckingSink(InMemorySink):
    """At every write: span rows buffered + being written + free slots, at most the budget."""

    def __init__(self) -> None:
        super().__init__()
        self.recorder: Recorder | None = None
        self.max_accounted = 0

    def write(self, table, batch):
        if table is SPANS and self.recorder is not None:
            buf = self.recorder._spans
            accounted = buf.num_rows() + batch.num_rows + len(buf.slots)
            self.max_accounted = max(self.max_accounted, accounted)
        super().write(table, batch)


def test_small_cap_drops_exactly_what_it_does_not_record():
    sink = BudgetCheckingSink()
    rec = BufferedRecorder(sink, instance_id=1, memory_cap_bytes=256 << 10, flush_interval_s=0.05, batch_rows=1000)
    sink.recorder = rec
    capacity = rec._spans.capacity_rows
    assert capacity < 100_000  # the cap must bite
    _hammer(rec, 8, 100_000)
    for i in range(5000):
        rec.token(1, i, sent_ns=i)
    rec.close()
    c = rec.counters
    assert c[SPANS.name] + c["dropped_spans"] == 800_000
    assert sink.num_rows(SPANS.name) == c[SPANS.name]
    assert c["dropped_spans"] > 0
    assert c[TOKENS.name] + c["dropped_tokens"] == 5000
    assert c["dropped"] == c["dropped_spans"] + c["dropped_tokens"]
    assert c["buffered"] == 0
    assert 0 < sink.max_accounted <= capacity


def test_events_after_close_are_dropped_and_close_is_idempotent():
    class CountingSink(InMemorySink):
        num_closes = 0

        def close(self) -> None:
            self.num_closes += 1

    sink = CountingSink()
    rec = BufferedRecorder(sink, instance_id=3)
    rec.span(1, Stage.STREAM_SEND, 1, 2)
    rec.close()
    rec.close()
    rec.span(1, Stage.STREAM_SEND, 3, 4)
    rec.flush()
    assert sink.num_closes == 1 and rec.closed
    assert sink.num_rows(SPANS.name) == 1
    assert rec.counters["dropped_spans"] == 1


def test_failing_sink_counts_rows_and_warns_once(caplog):
    class BrokenSink:
        def write(self, table, batch):
            raise OSError("disk full")

        def close(self):
            pass

    rec = BufferedRecorder(BrokenSink(), instance_id=1, batch_rows=10, flush_interval_s=60)
    with caplog.at_level(logging.WARNING, logger="tokentrace"):
        for i in range(35):
            rec.span(1, Stage.STREAM_SEND, i, i + 1)
        rec.token(1, 0, sent_ns=1)
        rec.flush()
        rec.close()
    assert rec.counters["sink_errors"] == 36
    warnings = [r for r in caplog.records if r.name == "tokentrace" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "disk full" in warnings[0].getMessage()


def test_background_thread_flushes_without_being_asked(sink):
    rec = BufferedRecorder(sink, instance_id=1, flush_interval_s=0.02)
    rec.span(1, Stage.STREAM_SEND, 1, 2)
    deadline = time.monotonic() + 10
    while sink.num_rows(SPANS.name) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.num_rows(SPANS.name) == 1
    rec.close()


def test_full_buffers_are_written_in_batches_of_batch_rows(sink):
    rec = BufferedRecorder(sink, instance_id=1, batch_rows=100, flush_interval_s=60)
    for i in range(250):
        rec.span(1, Stage.STREAM_SEND, i, i + 1)
    rec.flush()
    assert [b.num_rows for b in sink._batches[SPANS.name]] == [100, 100, 50]
    assert sink.table(SPANS.name).column(col.START_NS).to_pylist() == list(range(250))
    rec.close()


def test_sink_bookkeeping_hooks_are_called(sink):
    class BookkeepingSink(InMemorySink):
        def __init__(self):
            super().__init__()
            self.counters = None
            self.instances = []

        def update_counters(self, counters):
            self.counters = dict(counters)

        def register_instance(self, instance_id, role, name):
            self.instances.append((instance_id, role, name))

    s = BookkeepingSink()
    rec = BufferedRecorder(s, instance_id=9)
    rec.instance(role=Role.PREFILL, name="p0")
    rec.span(1, Stage.STREAM_SEND, 1, 2)
    rec.close()
    assert s.instances == [(9, "prefill", "p0")]
    assert s.counters[SPANS.name] == 1 and s.counters[INSTANCES.name] == 1


def test_instance_may_be_rewritten_and_rejects_bad_roles(sink, rec):
    rec.instance(role=Role.GATEWAY, name="gw", clock_offset_ns=0)
    rec.instance(role=Role.GATEWAY, name="gw", clock_offset_ns=1234, clock_rtt_ns=50)
    with pytest.raises(ValueError):
        rec.instance(role=17)
    rec.flush()
    got = rows(sink, INSTANCES)
    assert [r[col.CLOCK_OFFSET_NS] for r in got] == [0, 1234]
    assert got[0][col.CLOCK_RTT_NS] is None and got[1][col.CLOCK_RTT_NS] == 50


def test_asyncio_tasks_record_concurrently(sink, rec):
    async def handle(i: int) -> None:
        rid = rec.request_begin(f"req-{i}", arrival_ns=i)
        for k in range(20):
            rec.token(rid, k, sent_ns=i * 100 + k)
            await asyncio.sleep(0)
        rec.request_end(rid, finish_ns=i + 1000, num_output_tokens=20)

    async def main() -> None:
        await asyncio.gather(*(handle(i) for i in range(200)))

    asyncio.run(main())
    rec.flush()
    assert sink.num_rows(TOKENS.name) == 4000
    keys = sink.table(REQUESTS.name).column(col.REQUEST_KEY).to_pylist()
    assert sorted(keys) == sorted(f"req-{i}" for i in range(200))


@pytest.mark.parametrize(
    "kwargs",
    [dict(instance_id=-1), dict(instance_id=1, memory_cap_bytes=0), dict(instance_id=1, flush_interval_s=0),
     dict(instance_id=1, batch_rows=0), dict(instance_id="a")],
)
def test_bad_options_are_rejected(kwargs):
    with pytest.raises(ValueError):
        BufferedRecorder(InMemorySink(), **kwargs)


def test_a_non_sink_is_rejected():
    with pytest.raises(TypeError, match="sink"):
        BufferedRecorder(object(), instance_id=1)


def test_batches_have_the_exact_schema_arrow_types(sink, rec):
    rec.span(1, Stage.STREAM_SEND, 1, 2, 5, 6, 7, Tier.DISK, 9)
    rec.flush()
    batch = sink._batches[SPANS.name][0]
    assert batch.schema.field(col.STAGE).type == pa.int8()
    assert batch.schema.field(col.TOKEN_INDEX).type == pa.int32()
    assert batch.schema.equals(SPANS.schema, check_metadata=True)


def test_open_intervals_and_requests_past_their_cap_are_counted():
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=1, memory_cap_bytes=1)  # every cap at its minimum (16)
    for i in range(20):
        rec.stage_begin(i, Stage.SCHEDULE_QUEUE, i)
        rec.request_begin(f"r{i}", tenant="t", arrival_ns=i)
    for i in range(20):
        rec.stage_end(i, Stage.SCHEDULE_QUEUE, i + 1)
    rec.request_end(request_id_of("r0", "t"), finish_ns=5)
    rec.request_end(request_id_of("r19", "t"), finish_ns=5)
    rec.close()
    c = rec.counters
    assert c["dropped_open"] == 8  # 4 stage begins + 4 request begins
    assert c[SPANS.name] == 16 and c["dropped_invalid"] == 4  # their ends had no begin
    got = {r[col.REQUEST_KEY]: r[col.TENANT] for r in rows(sink, REQUESTS)}
    assert got == {"r0": "t", "": ""}  # r19's begin was dropped: row without its fields
