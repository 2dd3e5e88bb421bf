"""The SSE side of a response: framing across reads, which chunks are tokens, heads and error bodies."""

from __future__ import annotations

from tokentrace.app.bench.connections import Want
from tokentrace.app.bench.requests import FailureKind
from tokentrace.app.bench.sse import MAX_ERROR_BODY, SseStream


def _feed(st: SseStream, *events: bytes) -> None:
    for i, e in enumerate(events):
        st.feed(e, 1000 + i)


def test_sse_framing_across_reads_and_crlf():
    st = SseStream(chat=False)
    st.feed(b'data: {"choices":[{"text":"a","finish_reason":null}]}\r\n\r\nda', 1)
    st.feed(b'ta: {"choices":[{"text":"b","finish_reason":null}]}\n\n: comment\n\ndata: [DONE]\n\n', 2)
    assert st.done and st.failure is None and st.token_times() == (1, 2)


def test_empty_chunks_are_tokens_when_usage_says_so():
    st = SseStream(chat=True)
    _feed(st, b'data: {"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":"length"}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n')
    assert st.token_times() == (1000, 1001)  # the reference server's first chunk carries role and token


def test_openai_bookkeeping_chunks_are_not_tokens_without_usage():
    st = SseStream(chat=True)
    _feed(st, b'data: {"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"x"},"finish_reason":null}]}\n\n',
          b'data: {"choices":[{"delta":{"content":"y"},"finish_reason":null}]}\n\n',
          b'data: {"choices":[{"delta":{"content":""},"finish_reason":"stop"}]}\n\n')
    assert st.token_times() == (1001, 1002)


def test_one_stamp_per_read_for_every_event_in_it():
    st = SseStream(chat=False)
    assert st.on_head(200, {"content-type": "text/event-stream; charset=utf-8"}) is Want.MORE
    two = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":"b"}]}\n\n'
    assert st.on_body(two, 7) is Want.MORE
    assert st.on_body(b'data: {"choices":[{"text":"c"}]}\n\ndata: [DONE]\n\n', 9) is Want.DRAIN
    assert st.token_times() == (7, 7, 9) and st.done_ns == 9 and st.failure is None


def test_a_head_that_is_not_an_event_stream_closes():
    st = SseStream(chat=False)
    assert st.on_head(200, {"content-type": "application/json"}) is Want.CLOSE
    assert st.failure is FailureKind.MALFORMED_SSE
    gz = SseStream(chat=False)
    assert gz.on_head(200, {"content-type": "text/event-stream", "content-encoding": "gzip"}) is Want.CLOSE
    assert "gzip" in gz.detail


def test_an_error_body_is_kept_up_to_its_cap():
    st = SseStream(chat=False)
    assert st.on_head(503, {}) is Want.MORE and st.on_body(b"busy", 1) is Want.MORE
    assert st.on_body(b"x" * MAX_ERROR_BODY, 2) is Want.CLOSE
    assert len(st.error_body) == MAX_ERROR_BODY and st.error_body.startswith(b"busy") and not st.times


def test_an_error_event_mid_stream_stops_the_stream():
    st = SseStream(chat=True)
    st.on_head(200, {"content-type": "text/event-stream"})
    assert st.on_body(b'data: {"error":{"message":"backend died"}}\n\n', 3) is Want.CLOSE
    assert st.failure is FailureKind.STREAM_ERROR and st.detail == "backend died"
