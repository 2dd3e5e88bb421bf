"""The gateway's piece of a disaggregated request's ``transfer.kv`` whatever order the workers' reports come in.

The gateway alone knows both workers' clocks, so it records ``[the prefill worker's first KV chunk left, that
chunk reached the decode worker)``. Three reports make it: the prefill worker's hand-out of token 0, the decode
worker's receipt of the first chunk (``KVTransferStart`` "recv") and the prefill worker's ``KVTransferEnd``
"send", which comes only after the receiver acknowledged the last chunk, on the prefill worker's own link. On a
busy machine that report can come after the decode worker's first token, or after the request finished; the
piece must still be recorded, once, and never overlap the prefill worker's own piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from instrument.reference_gateway import GatewayTracer
from reference_server.serving import gateway_hooks as gh
from reference_server.serving.worker_hooks import KVTransferEnd, KVTransferStart
from tokentrace.clock import OffsetBook
from tokentrace.clock.sync import ClockEstimate
from tokentrace.schema import Stage

PREFILL, DECODE = "prefill-0", "decode-0"
OFFSETS = {PREFILL: 1_000_000, DECODE: -2_000_000}  # worker clock + offset = gateway clock
KEY = "cmpl-1"


@dataclass
class FakeRecorder:
    """Keeps what the tracer records (the parts this test reads)."""

    spans: list[tuple[Any, ...]] = field(default_factory=list)

    def span(self, rid: int, stage: Stage, start_ns: int, end_ns: int, token_index: int, *rest: Any) -> None:
        self.spans.append((stage, start_ns, end_ns, token_index))

    def __getattr__(self, name: str) -> Any:  # token, request_begin, request_end, loop lag rows: not read here
        return lambda *args, **kwargs: None


def _tracer() -> tuple[GatewayTracer, FakeRecorder]:
    book = OffsetBook()
    for name, offset in OFFSETS.items():
        book.update(name, ClockEstimate(offset_ns=offset, rtt_ns=10_000, num_samples=8))
    rec = FakeRecorder()
    tracer = GatewayTracer(rec, clocks=book)  # type: ignore[arg-type]
    tracer.on_request_received(gh.RequestReceived(KEY, 100_000, "/v1/completions", "", None, None, None))
    tracer.on_tokenized(gh.Tokenized(KEY, 110_000, 120_000, 5))
    tracer.on_routed(gh.Routed(KEY, 120_000, 130_000, PREFILL))
    return tracer, rec


def _chunk(tracer: GatewayTracer, index: int, instance: str, emitted_gateway_ns: int) -> None:
    received = emitted_gateway_ns + 50_000
    tracer.on_chunk_written(gh.ChunkWritten(
        KEY, index, 7, instance, received, received + 1_000, received + 2_000, received + 3_000, received + 4_000,
        40, emitted_ns=emitted_gateway_ns - OFFSETS[instance]))


# gateway clock: token 0 handed out at 1.0 ms, first chunk left the prefill worker at 1.2 ms and reached the
# decode worker at 1.5 ms; the decode worker hands out token 1 at 3.0 ms
TOKEN0_OUT, FIRST_SENT, FIRST_ARRIVED, TOKEN1_OUT = 1_000_000, 1_200_000, 1_500_000, 3_000_000


def _recv(tracer: GatewayTracer) -> None:
    tracer.on_kv_transfer_start(KVTransferStart(KEY, DECODE, PREFILL, "recv", 4, 4096,
                                                FIRST_ARRIVED - OFFSETS[DECODE]))


def _send_end(tracer: GatewayTracer) -> None:
    tracer.on_kv_transfer_end(KVTransferEnd(KEY, PREFILL, DECODE, "send", 4, 4096, 1, 900_000 - OFFSETS[PREFILL],
                                            1_800_000 - OFFSETS[PREFILL], True,
                                            first_sent_ns=FIRST_SENT - OFFSETS[PREFILL]))


def _finish(tracer: GatewayTracer) -> None:
    tracer.on_request_finished(gh.GatewayRequestFinished(KEY, 4_000_000, 200, "stop", 5, 2, None))


def _transfers(rec: FakeRecorder) -> list[tuple[int, int, int]]:
    return [(start, end, index) for stage, start, end, index in rec.spans if stage == Stage.TRANSFER_KV]


def test_the_piece_runs_from_the_first_chunk_sent_to_its_arrival_when_the_reports_come_in_order() -> None:
    tracer, rec = _tracer()
    _chunk(tracer, 0, PREFILL, TOKEN0_OUT)
    _recv(tracer)
    _send_end(tracer)
    _chunk(tracer, 1, DECODE, TOKEN1_OUT)
    _finish(tracer)
    assert _transfers(rec) == [(FIRST_SENT, FIRST_ARRIVED, 1)]


def test_a_send_report_after_the_decode_workers_first_token_still_gives_the_piece() -> None:
    tracer, rec = _tracer()
    _chunk(tracer, 0, PREFILL, TOKEN0_OUT)
    _recv(tracer)
    _chunk(tracer, 1, DECODE, TOKEN1_OUT)
    _chunk(tracer, 2, DECODE, TOKEN1_OUT + 500_000)
    _send_end(tracer)
    _finish(tracer)
    assert _transfers(rec) == [(FIRST_SENT, FIRST_ARRIVED, 1)]


def test_a_send_report_after_the_request_finished_still_gives_the_piece() -> None:
    tracer, rec = _tracer()
    _chunk(tracer, 0, PREFILL, TOKEN0_OUT)
    _recv(tracer)
    _chunk(tracer, 1, DECODE, TOKEN1_OUT)
    _finish(tracer)
    assert _transfers(rec) == []  # waits: starting it at the hand-out would overlap the prefill worker's piece
    _send_end(tracer)
    assert _transfers(rec) == [(FIRST_SENT, FIRST_ARRIVED, 1)]
    tracer.close()
    assert _transfers(rec) == [(FIRST_SENT, FIRST_ARRIVED, 1)]


def test_a_send_report_that_never_comes_gives_the_piece_from_the_hand_out_at_close() -> None:
    tracer, rec = _tracer()
    _chunk(tracer, 0, PREFILL, TOKEN0_OUT)
    _recv(tracer)
    _chunk(tracer, 1, DECODE, TOKEN1_OUT)
    _finish(tracer)
    tracer.close()
    assert _transfers(rec) == [(TOKEN0_OUT, FIRST_ARRIVED, 1)]
    _send_end(tracer)  # too late: recorded once
    assert len(_transfers(rec)) == 1
