"""One streamed request to an OpenAI-compatible server, timed per network read.

Timing: ``send_ns`` is read just before the request takes a connection (a new
connection's set-up counts, as in ``vllm bench serve``); every network read of the
response is stamped with ``time.monotonic_ns()`` in the connection's protocol
callback, before any parsing (:mod:`~tokentrace.app.bench.connections`), and each SSE
event in that read gets that stamp (:mod:`~tokentrace.app.bench.sse`, which also says
which chunks count as tokens). All times are on this host's monotonic clock, ns.

The request's bytes can be built ahead (:func:`encode_request`), so that sending at
the due time is a socket write.

Failures are classified, never raised (:class:`FailureKind`): the caller counts
them per kind. Cancelling the task that runs :func:`send_request` (the runner does
so at its duration bound) makes it return an outcome marked ``cancelled`` with the
tokens that arrived, instead of raising ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from tokentrace.app.bench.connections import ConnectFailed, ConnectionPool, End
from tokentrace.app.bench.requests import FailureKind, Outcome, PlannedRequest
from tokentrace.app.bench.sse import SseStream

__all__ = ["ENDPOINTS", "FailureKind", "Outcome", "RequestOptions", "send_request", "request_body",
           "request_headers", "encode_request", "new_pool"]

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How requests are sent: endpoint, model and timeouts (seconds)."""

    base_url: str
    endpoint: str = "completions"  # completions | chat
    model: str = ""
    ignore_eos: bool = True  # vLLM / reference-server extension: generate exactly max_tokens
    include_usage: bool = True  # ask for a final usage chunk (stream_options.include_usage)
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0  # longest silence between two reads of a response
    total_timeout_s: float = 600.0  # longest whole request

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"unknown endpoint {self.endpoint!r}; choose one of {', '.join(ENDPOINTS)}")
        if not self.base_url.startswith(("http://", "https://")) or not urlsplit(self.base_url).hostname:
            raise ValueError(f"--url must be http:// or https:// and a host, got {self.base_url!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


def request_body(req: PlannedRequest, opts: RequestOptions) -> dict[str, Any]:
    """The JSON body for ``req`` on ``opts.endpoint`` (streaming, greedy)."""
    text = req.text
    body: dict[str, Any] = {"model": opts.model, "max_tokens": text.max_tokens, "stream": True,
                            "temperature": 0.0}
    if opts.include_usage:
        body["stream_options"] = {"include_usage": True}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat" and req.messages:
        body["messages"] = [{"role": role, "content": content} for role, content in req.messages]
    elif opts.endpoint == "chat":
        messages = [{"role": "system", "content": text.system}] if text.system else []
        messages.append({"role": "user", "content": text.prompt})
        body["messages"] = messages
    else:
        body["prompt"] = text.system + text.prompt
    return body


def request_headers(req: PlannedRequest) -> dict[str, str]:
    headers = {"X-Request-Id": req.key, "Accept": "text/event-stream", "Content-Type": "application/json"}
    if req.api_key:
        headers["Authorization"] = f"Bearer {req.api_key}"
    if req.slo_class:
        headers["X-SLO-Class"] = req.slo_class
    if req.session:
        headers["X-Session-Id"] = req.session
        if req.session_turn >= 0:
            headers["X-Session-Turn"] = str(req.session_turn)
    return headers


def new_pool(opts: RequestOptions) -> ConnectionPool:
    """The connection pool for ``opts`` (use as ``async with new_pool(opts) as pool``)."""
    return ConnectionPool(opts.base_url, connect_timeout_s=opts.connect_timeout_s,
                          read_timeout_s=opts.read_timeout_s)


def encode_request(pool: ConnectionPool, req: PlannedRequest, opts: RequestOptions) -> bytes:
    """The whole HTTP request for ``req``. ``ValueError`` if a header value holds a line break."""
    body = json.dumps(request_body(req, opts)).encode()
    return pool.encode_post(ENDPOINTS[opts.endpoint], body, request_headers(req))


async def send_request(pool: ConnectionPool, req: PlannedRequest, opts: RequestOptions, *,
                       encoded: bytes | None = None, keep_text: bool = False) -> Outcome:
    """Send ``req`` (its bytes ``encoded`` if built ahead), stream the answer, and return what
    was seen; never raises (see module doc). Runs on the caller's event loop. ``keep_text``:
    the outcome carries the answer's text (session workloads send it back in the next turn)."""
    st = SseStream(opts.endpoint == "chat", keep_text=keep_text)
    cancelled = False
    send_ns = time.monotonic_ns()
    try:
        data = encoded if encoded is not None else encode_request(pool, req, opts)
        async with asyncio.timeout(opts.total_timeout_s):
            end, why = await pool.request(data, st)
        _classify_end(st, end, why, opts)
    except ConnectFailed as err:
        st.fail(FailureKind.CONNECT, str(err))
    except ValueError as err:  # a header that cannot be sent (a line break in an API key)
        st.fail(FailureKind.CONNECT, str(err))
    except TimeoutError:
        if not st.done:  # (a timeout while draining after [DONE] does not matter)
            st.fail(FailureKind.TIMEOUT, f"over the total timeout of {opts.total_timeout_s:g} s")
    except asyncio.CancelledError:  # the run's duration bound: keep what arrived, report it as cancelled
        cancelled = not st.done
    finish_ns = st.done_ns if st.done else time.monotonic_ns()
    failed = st.failure is not None and not cancelled
    return Outcome(
        index=req.index, key=req.key, send_ns=send_ns, recv_ns=st.token_times(), finish_ns=finish_ns,
        http_status=st.status, failure=st.failure if failed else None, detail=st.detail if failed else "",
        num_prompt_tokens=st.usage_int("prompt_tokens"), num_output_tokens=st.usage_int("completion_tokens"),
        num_cached_tokens=st.cached_tokens(), cancelled=cancelled,
        text="".join(st.text_parts) if st.text_parts is not None else "",
    )


def _classify_end(st: SseStream, end: End, why: str, opts: RequestOptions) -> None:
    """Set ``st``'s failure from how the exchange ended, unless the stream already failed."""
    if st.failure is not None:
        return
    if st.status and st.status != 200:
        detail = f"{st.status} {st.error_body.decode('utf-8', 'replace')}"[:200]
        st.fail(FailureKind.HTTP_5XX if st.status >= 500 else FailureKind.HTTP_4XX, detail)
    elif st.done:
        if not st.times:
            st.fail(FailureKind.MALFORMED_SSE, "the stream finished without any token")
    elif end is End.READ_TIMEOUT:
        st.fail(FailureKind.TIMEOUT, f"no data for {opts.read_timeout_s:g} s (read timeout)")
    elif not st.status:  # the connection closed or spoke no HTTP before a response head
        st.fail(FailureKind.CONNECT, f"no HTTP response: {why or end.value}"[:200])
    else:
        st.fail(FailureKind.STREAM_CUT, f"the stream ended before [DONE]: {why or end.value}"[:200])
