"""The worker-side KV receipt of a disaggregated request: transfer.kv ends when the last chunk arrived; the wait
for room in a full decode pool that follows is decode.queue (back-pressure), never transfer.kv."""

from __future__ import annotations

from instrument.reference_cluster import ServingEngineTracer
from reference_server.engine import hooks
from reference_server.engine.handoff import HANDOFF_FINISH_REASON
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import Stage, col

MS = 1_000_000


def _imported_spans(recv_end_ns: int, added_ns: int):
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=3, flush_interval_s=0.05)
    tracer = ServingEngineTracer(rec)
    tracer.kv_imports["r1"] = [10 * MS, recv_end_ns, 4096]  # first chunk at 10 ms
    tracer.on_request_added(hooks.RequestAdded("r1", "default", "interactive", 0, added_ns, 8))
    tracer.on_token_emitted(hooks.TokenEmitted("r1", 7, 1, 65, "A", added_ns + 2 * MS, added_ns + 3 * MS))
    rec.close()
    spans = sink.table("spans").to_pandas()
    return spans[spans[col.TOKEN_INDEX] == 1].set_index(col.STAGE)


def test_waiting_for_room_after_the_last_chunk_is_decode_queue_not_transfer():
    spans = _imported_spans(recv_end_ns=14 * MS, added_ns=90 * MS)  # 4 ms of transfer, then 76 ms with no room
    kv = spans.loc[Stage.TRANSFER_KV]
    assert (kv[col.START_NS], kv[col.END_NS]) == (10 * MS, 14 * MS)
    waiting = spans[spans.index == Stage.DECODE_QUEUE]
    assert (waiting[col.START_NS].min(), waiting[col.END_NS].min()) == (14 * MS, 90 * MS)


def test_a_receipt_taken_at_once_is_all_transfer():
    spans = _imported_spans(recv_end_ns=14 * MS, added_ns=14 * MS)
    kv = spans.loc[Stage.TRANSFER_KV]
    assert (kv[col.START_NS], kv[col.END_NS]) == (10 * MS, 14 * MS)
    assert not ((spans.index == Stage.DECODE_QUEUE) & (spans[col.END_NS] <= 14 * MS)).any()


def _sender_spans(first_sent_ns: int, end_ns: int):
    """A prefill worker's request: token 0 emitted at 5 ms (its step ends at 6 ms), handed to a decode worker;
    its KV send ends with its first chunk out at ``first_sent_ns``."""
    sink = InMemorySink()
    rec = BufferedRecorder(sink, instance_id=4, flush_interval_s=0.05)
    tracer = ServingEngineTracer(rec)
    tracer.on_request_added(hooks.RequestAdded("r1", "default", "interactive", 0, 1 * MS, 8))
    tracer.on_token_emitted(hooks.TokenEmitted("r1", 0, 0, 65, "A", 4 * MS, 5 * MS))
    tracer.on_step_end(hooks.StepEnd(0, 1 * MS, 2 * MS, 4 * MS, 6 * MS, (hooks.BatchEntry("r1", 8, 0),), 0, 1, 0,
                                     (1, 0, 0), (64, 0, 0)))
    tracer.on_request_finished(hooks.RequestFinished("r1", 0, HANDOFF_FINISH_REASON, 1, 0, 7 * MS))
    tracer.kv_sent("r1", first_sent_ns, end_ns, 4096)
    tracer.kv_sent("r1", first_sent_ns, end_ns, 4096)  # reported once per transfer: a repeat records nothing
    rec.close()
    spans = sink.table("spans").to_pandas()
    return spans[spans[col.STAGE] == Stage.TRANSFER_KV]


def test_the_sender_records_its_own_wait_before_the_first_chunk_left():
    # The export, the hand-over to the worker's event loop, its turn there, connecting: from token 0's emit
    # until the first chunk went into the socket, recorded by the prefill worker as token 1's transfer.kv.
    kv = _sender_spans(first_sent_ns=40 * MS, end_ns=45 * MS)
    assert len(kv) == 1
    row = kv.iloc[0]
    assert (row[col.START_NS], row[col.END_NS], row[col.TOKEN_INDEX]) == (5 * MS, 40 * MS, 1)
    assert (row[col.NUM_BYTES], row[col.INSTANCE_ID]) == (4096, 4)


def test_a_send_that_never_got_a_chunk_out_is_the_senders_until_it_ended():
    kv = _sender_spans(first_sent_ns=-1, end_ns=30 * MS)
    assert [(r[col.START_NS], r[col.END_NS]) for _, r in kv.iterrows()] == [(5 * MS, 30 * MS)]
