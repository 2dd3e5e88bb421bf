"""One streamed request to an OpenAI-compatible server, timed per SSE chunk.

Timing: ``send_ns`` is read just before the request is handed to httpx, and every
network read of the response body is stamped with ``time.monotonic_ns()`` as soon
as httpx yields it, before any parsing; each SSE event in that read gets that
stamp. All times are on this process's monotonic clock, ns.

A chunk counts as an output token when its first choice carries content
(``text`` for completions, ``delta.content`` for chat). Content-less bookkeeping
chunks are dropped: chat's role announcement (``{"role": "assistant",
"content": ""}`` first) and an empty closing chunk that only carries
``finish_reason``. When the server reports ``usage.completion_tokens``, those
empty chunks are dropped only as far as needed to match it: a server may stream
a real token whose text delta is empty (half a UTF-8 character), and the
reference server's first chat chunk carries both the role and the first token.

Failures are classified, never raised (:class:`FailureKind`): the caller counts
them per kind. Cancelling the task that runs :func:`send_request` (the runner does
so at its duration bound) makes it return an outcome marked ``cancelled`` with the
tokens that arrived, instead of raising ``CancelledError``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import httpx

from tokentrace.bench.requests import PlannedRequest

__all__ = ["ENDPOINTS", "FailureKind", "Outcome", "RequestOptions", "send_request", "request_body", "new_client",
           "ClientShards"]

ENDPOINTS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_ERROR_BODY = 2048  # bytes of an error response kept for the detail text
_DRAIN_S = 1.0  # longest wait for the body's end after [DONE]


class FailureKind(enum.Enum):
    """Why a request failed, as counted in the summary."""

    CONNECT = "connect"  # no connection or no response at all: the server is down or refused
    HTTP_4XX = "http_4xx"  # a non-2xx status below 500 (bad request, auth, quota)
    HTTP_5XX = "http_5xx"  # status 500 or above
    MALFORMED_SSE = "malformed_sse"  # the body is not the expected SSE / JSON chunks
    STREAM_CUT = "stream_cut"  # the stream ended (or the connection broke) before [DONE]
    STREAM_ERROR = "stream_error"  # the server sent an error event mid-stream
    TIMEOUT = "timeout"  # no progress within the read timeout, or over the total timeout

    @property
    def label(self) -> str:
        return self.value


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
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--url must start with http:// or https://, got {self.base_url!r}")
        for name in ("connect_timeout_s", "read_timeout_s", "total_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + ENDPOINTS[self.endpoint]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the client saw of one request (times: local monotonic clock, ns)."""

    index: int
    key: str
    send_ns: int
    recv_ns: tuple[int, ...]  # arrival of each output token's chunk
    finish_ns: int  # [DONE] received, or the request failed or was cancelled
    http_status: int  # 0 = no response
    failure: FailureKind | None
    detail: str = ""  # short human explanation of a failure
    num_prompt_tokens: int = -1  # server's usage.prompt_tokens; -1 = not reported
    num_output_tokens: int = -1  # server's usage.completion_tokens; -1 = not reported
    num_cached_tokens: int = -1  # usage.prompt_tokens_details.cached_tokens; -1 = not reported
    cancelled: bool = False  # stopped by the run's duration bound, not a failure

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.cancelled


def request_body(req: PlannedRequest, opts: RequestOptions) -> dict[str, Any]:
    """The JSON body for ``req`` on ``opts.endpoint`` (streaming, greedy)."""
    text = req.text
    body: dict[str, Any] = {"model": opts.model, "max_tokens": text.max_tokens, "stream": True,
                            "temperature": 0.0}
    if opts.include_usage:
        body["stream_options"] = {"include_usage": True}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.endpoint == "chat":
        messages = [{"role": "system", "content": text.system}] if text.system else []
        messages.append({"role": "user", "content": text.prompt})
        body["messages"] = messages
    else:
        body["prompt"] = text.system + text.prompt
    return body


def request_headers(req: PlannedRequest) -> dict[str, str]:
    headers = {"X-Request-Id": req.key, "Accept": "text/event-stream"}
    if req.api_key:
        headers["Authorization"] = f"Bearer {req.api_key}"
    if req.slo_class:
        headers["X-SLO-Class"] = req.slo_class
    return headers


def new_client(opts: RequestOptions, *, ssl_context: Any = None,
               max_keepalive_connections: int = 64) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` for streams (HTTP/1.1 keep-alive, no cap on connections).

    ``ssl_context``: share one between clients; building one loads the CA bundle (~40 ms).
    """
    timeout = httpx.Timeout(opts.read_timeout_s, connect=opts.connect_timeout_s, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive_connections)
    return httpx.AsyncClient(timeout=timeout, limits=limits, verify=ssl_context or httpx.create_ssl_context())


class ClientShards:
    """Several httpx clients, each with its own small connection pool; request ``i`` uses shard ``i % n``.

    httpx's pool (httpcore) rescans all its connections whenever a request starts or ends,
    so one pool costs O(connections) per request and O(n^2) over a busy run; with shards
    each pool stays small and thousands of concurrent streams stay cheap. Event-loop
    thread only; use as ``async with ClientShards(opts) as shards``.
    """

    def __init__(self, opts: RequestOptions, *, num_shards: int = 64) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        ssl_context = httpx.create_ssl_context()
        self._clients = [new_client(opts, ssl_context=ssl_context) for _ in range(num_shards)]

    def for_request(self, index: int) -> httpx.AsyncClient:
        return self._clients[index % len(self._clients)]

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    async def __aenter__(self) -> ClientShards:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _Stream:
    """Parse state of one response: SSE framing, token chunks, usage, outcome."""

    __slots__ = ("buf", "times", "empty", "finish_flags", "usage", "done", "done_ns", "failure", "detail", "chat",
                 "role_first")

    def __init__(self, chat: bool) -> None:
        self.buf = b""
        self.times: list[int] = []  # recv ns of each content chunk
        self.empty: list[bool] = []  # that chunk's content was ""
        self.finish_flags: list[bool] = []  # that chunk carried a finish_reason
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.done_ns = 0  # arrival of the read that held [DONE]
        self.failure: FailureKind | None = None
        self.detail = ""
        self.chat = chat
        self.role_first = False  # the first content chunk was a chat role announcement with content ""

    def feed(self, data: bytes, t_ns: int) -> None:
        """Consume one network read that arrived at ``t_ns``; stops at [DONE] or a failure."""
        buf = self.buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        while not self.done and self.failure is None:
            end = buf.find(b"\n\n")
            if end < 0:
                break
            self._event(buf[:end], t_ns)
            buf = buf[end + 2:]
        self.buf = buf

    def _event(self, raw: bytes, t_ns: int) -> None:
        data = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data:"):
                data.append(line[5:].lstrip(b" "))
            elif line and not line.startswith((b":", b"event:", b"id:", b"retry:")):
                self.fail(FailureKind.MALFORMED_SSE, f"not an SSE line: {line[:80]!r}")
                return
        if not data:
            return
        payload = b"\n".join(data)
        if payload == b"[DONE]":
            self.done, self.done_ns = True, t_ns
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            self.fail(FailureKind.MALFORMED_SSE, f"SSE data is not JSON: {payload[:80]!r}")
            return
        if not isinstance(obj, dict):
            self.fail(FailureKind.MALFORMED_SSE, "SSE data is not a JSON object")
            return
        if obj.get("error") is not None:
            err = obj["error"]
            message = err.get("message", "") if isinstance(err, dict) else str(err)
            self.fail(FailureKind.STREAM_ERROR, str(message)[:200])
            return
        self._chunk(obj, t_ns)

    def _chunk(self, obj: dict[str, Any], t_ns: int) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        choices = obj.get("choices")
        if not choices:
            if "choices" not in obj and self.usage is None:
                self.fail(FailureKind.MALFORMED_SSE, "chunk has neither choices nor usage")
            return
        choice = choices[0]
        if not isinstance(choice, dict):
            self.fail(FailureKind.MALFORMED_SSE, "a choice is not a JSON object")
            return
        if self.chat:
            delta = choice.get("delta") or {}
            content = delta.get("content") if isinstance(delta, dict) else None
            if content == "" and "role" in delta and not self.times:
                self.role_first = True  # OpenAI's role announcement (or a first token with an empty delta)
        else:
            content = choice.get("text")
        if not isinstance(content, str):
            if choice.get("finish_reason") is None:
                self.fail(FailureKind.MALFORMED_SSE, "a choice has no text content")
            return
        self.times.append(t_ns)
        self.empty.append(content == "")
        self.finish_flags.append(choice.get("finish_reason") is not None)

    def fail(self, kind: FailureKind, detail: str) -> None:
        self.failure, self.detail = kind, detail

    def token_times(self) -> tuple[int, ...]:
        """Receive times of the output tokens (see the module doc for the counting rule)."""
        times = list(self.times)
        empty, fin = list(self.empty), list(self.finish_flags)
        reported = self.usage_int("completion_tokens")
        if reported >= 0:  # drop empty bookkeeping chunks only as far as the server's count says
            if len(times) > reported and self.role_first:
                del times[0], empty[0], fin[0]
            while len(times) > reported and empty and empty[-1]:
                times.pop()
                empty.pop()
        else:  # no count: OpenAI's conventions
            if self.role_first and len(times) > 1:
                del times[0], empty[0], fin[0]
            if len(times) > 1 and empty[-1] and fin[-1]:
                times.pop()
        return tuple(times)

    def usage_int(self, name: str) -> int:
        value = self.usage.get(name) if self.usage else None
        return value if isinstance(value, int) else -1

    def cached_tokens(self) -> int:
        details = self.usage.get("prompt_tokens_details") if self.usage else None
        value = details.get("cached_tokens") if isinstance(details, dict) else None
        return value if isinstance(value, int) else -1


async def send_request(client: httpx.AsyncClient, req: PlannedRequest, opts: RequestOptions) -> Outcome:
    """Send ``req``, stream the answer, and return what was seen; never raises (see module doc).

    Runs on the caller's event loop; each await yields to other requests.
    """
    st = _Stream(opts.endpoint == "chat")
    status = 0
    cancelled = False
    body = json.dumps(request_body(req, opts)).encode()
    headers = request_headers(req) | {"Content-Type": "application/json"}
    send_ns = time.monotonic_ns()
    try:
        async with asyncio.timeout(opts.total_timeout_s):
            async with client.stream("POST", opts.url, content=body, headers=headers) as resp:
                status = resp.status_code
                if status != 200:
                    detail = (await _read_capped(resp)).decode("utf-8", "replace")[:200]
                    st.fail(FailureKind.HTTP_5XX if status >= 500 else FailureKind.HTTP_4XX, f"{status} {detail}")
                else:
                    await _read_stream(resp, st)
    except TimeoutError:
        if not st.done:  # (a timeout while draining after [DONE] does not matter)
            st.fail(FailureKind.TIMEOUT, f"over the total timeout of {opts.total_timeout_s:g} s")
    except httpx.TimeoutException as e:
        kind = FailureKind.CONNECT if isinstance(e, httpx.ConnectTimeout) else FailureKind.TIMEOUT
        st.fail(kind, type(e).__name__)
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as e:
        st.fail(FailureKind.CONNECT, f"{type(e).__name__}: {e}"[:200])
    except httpx.TransportError as e:  # protocol or read error: before a response = no server answer
        st.fail(FailureKind.STREAM_CUT if status else FailureKind.CONNECT, f"{type(e).__name__}: {e}"[:200])
    except asyncio.CancelledError:  # the run's duration bound: keep what arrived, report it as cancelled
        cancelled = not st.done
    finish_ns = st.done_ns if st.done else time.monotonic_ns()
    failed = st.failure is not None and not cancelled
    return Outcome(
        index=req.index, key=req.key, send_ns=send_ns, recv_ns=st.token_times(), finish_ns=finish_ns,
        http_status=status, failure=st.failure if failed else None, detail=st.detail if failed else "",
        num_prompt_tokens=st.usage_int("prompt_tokens"), num_output_tokens=st.usage_int("completion_tokens"),
        num_cached_tokens=st.cached_tokens(), cancelled=cancelled,
    )


async def _read_stream(resp: httpx.Response, st: _Stream) -> None:
    """Feed a 200 response's body to ``st``, stamping each read on arrival; classify how it ended."""
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        st.fail(FailureKind.MALFORMED_SSE, f"content-type {resp.headers.get('content-type')!r}")
        return
    body_reads = resp.aiter_raw()
    async for data in body_reads:
        st.feed(data, time.monotonic_ns())
        if st.done or st.failure is not None:
            break
    if st.done:  # read the body's end so the connection is reused (keep-alive)
        await _drain(body_reads)
    if not st.done and st.failure is None:
        st.fail(FailureKind.STREAM_CUT, "the stream ended before [DONE]")
    elif st.done and not st.times:
        st.fail(FailureKind.MALFORMED_SSE, "the stream finished without any token")


async def _drain(body_reads: AsyncIterator[bytes]) -> None:
    """Consume what follows [DONE] (normally just the end of the chunked body), for at most 1 s."""
    try:
        async with asyncio.timeout(_DRAIN_S):
            async for _ in body_reads:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass  # the connection is closed instead of reused; the answer was already complete


async def _read_capped(resp: httpx.Response) -> bytes:
    out = b""
    async for data in resp.aiter_raw():
        out += data
        if len(out) >= _MAX_ERROR_BODY:
            break
    return out[:_MAX_ERROR_BODY]
