"""ASGI middleware: trace any OpenAI-compatible (streaming) Starlette/FastAPI server.

``TokenTraceMiddleware(app)`` wraps the ASGI app; what it records for each
traced HTTP request (all on this process's monotonic clock, ns, read by the
middleware itself):

* a ``requests`` row: key = the ``X-Request-Id`` request header (or a fresh
  UUID when absent), tenant from a configurable header, session and turn from
  ``X-Session-Id`` / ``X-Session-Turn`` or the body's ``user`` field
  (``sessions``, see :mod:`instrument.sessions`), trace id from a W3C
  ``traceparent`` header, ``arrival_ns`` = when uvicorn read the request's
  first bytes (:mod:`instrument.transport`; else when the server handed the
  request to the middleware), ``first_token_ns`` = ``first_content_ns`` = the
  first token's ``sent_ns`` (the first chunk with visible text: the TTFT of
  AIPerf and ``vllm bench``), ``finish_ns`` = end of
  the last body ``send`` (or when the app returned, if it never finished the
  response); prompt, output and cached token counts from the ``usage`` object
  of the final SSE chunk or the JSON body (output tokens fall back to the
  number of token chunks); status: 2xx/3xx ``ok``, 4xx ``rejected``, 5xx,
  an exception from the app, or an ``error`` object in a 2xx body (an SSE
  error event) ``error``, a client that went away before the end
  ``aborted``; the error label is the body's ``error.type`` (or ``code``),
  else ``http_<status>``, the exception's class name or ``client_disconnected``;
* ``gateway.accept`` (token 0): from the first byte read until the request
  reached the middleware (uvicorn's parsing, the event loop's queue);
* ``gateway.receive`` (token 0): from then until the app has read the
  whole request body (or until it starts the response without reading it);
* while the app serves the request, ``tokentrace.current_request()`` returns its
  :class:`tokentrace.api.RequestContext` (request id, recorder, tenant), so engine
  code joins its stages to this request with no header or id handling;
* for an SSE response (``text/event-stream``): one ``tokens`` row per
  ``data:`` event whose choices carry text (``text``, ``delta.content``, ...),
  with ``sent_ns`` = when the ``send`` call of the chunk holding it returned;
  the role-only chunk, the usage-only chunk and ``[DONE]`` are not tokens
  (``instrument.sse``); one ``stream.send`` span per body chunk: the time spent
  in its ``send`` call, with the index of the first token in the chunk
  (request-level, ``-1``, for chunks without a token; none for the empty
  closing message).

The middleware is pure ASGI (no ``BaseHTTPMiddleware``): the app's own
message objects are passed through unchanged (zero copy; only a JSON
response's body chunks are also kept by reference, up to
``max_json_bytes``, to read its usage at the end). Its own failures never
reach the app or the server: they are logged once and the request is left
untraced; exceptions of the app and of the server's ``send`` propagate
unchanged. ``recorder=None`` uses the recorder bound by
``tokentrace.instrument`` at request time (no tracing while none is bound); under
``tokentrace run`` with none bound, the middleware binds the process's own
(:func:`join_tokentrace_run`), so one ``app.add_middleware(TokenTraceMiddleware)`` traces the app.
``recorder`` may be any object with the recorder's event methods, e.g. an
``instrument.sampling.SamplingRecorder``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from typing import Any, Awaitable, Callable, Collection, MutableMapping

from instrument import transport
from instrument.loop_lag import LoopLagSampler
from instrument.sessions import SessionSource, session_source
from instrument.sse import EventInfo, SseScanner, Usage, classify_event
from tokentrace import api
from tokentrace.clock import now_ns
from tokentrace.recorder import Recorder
from tokentrace.schema import MAX_LABEL_CHARS, RequestStatus, Role, Stage, cap_label, request_id_of

__all__ = ["TokenTraceMiddleware", "DEFAULT_PATHS", "parse_traceparent", "request_context", "join_tokentrace_run",
           "ASGI_APP_NAME"]

log = logging.getLogger("tokentrace")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_PATHS = ("/v1/completions", "/v1/chat/completions")
"""Request paths traced by default (the OpenAI generation endpoints)."""

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: str) -> str:
    """The trace id (32 lowercase hex digits) of a W3C ``traceparent`` value, or ``""`` if invalid."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff" or m.group(2) == "0" * 32 or m.group(3) == "0" * 16:
        return ""
    return m.group(2)


def _label(raw: bytes) -> str:
    """A header's value as a label: decoded, stripped, cut to ``MAX_LABEL_CHARS`` (a 100 KB
    ``X-Tenant`` is stored as its first characters, as on every other path)."""
    return cap_label(raw[:4 * MAX_LABEL_CHARS].decode("latin-1").strip())


class _Exchange:
    """What the middleware learns about one HTTP request/response (event-loop thread only)."""

    __slots__ = ("rec", "rid", "key", "tenant", "slo_class", "trace_id", "t_first_byte", "t_arrival", "receive_end_ns",
                 "status_code", "sse", "json_parts", "json_bytes", "max_json_bytes", "scanner",
                 "num_tokens", "t_first_token", "last_send_ns", "complete", "usage", "error",
                 "status", "body_error", "session", "turn", "sessions", "request_parts")

    def __init__(self, rec: Any, headers: dict[bytes, bytes], arrival_ns: int, mw: TokenTraceMiddleware,
                 first_byte_ns: int = -1) -> None:
        self.rec = rec
        key = _label(headers.get(mw.request_id_header, b""))
        self.key = key or uuid.uuid4().hex
        self.tenant = _label(headers.get(mw.tenant_header, b"")) if mw.tenant_header else ""
        self.rid = request_id_of(self.key, self.tenant)  # a key names a request among its tenant's only
        self.slo_class = _label(headers.get(mw.slo_class_header, b"")) if mw.slo_class_header else ""
        self.trace_id = parse_traceparent(headers.get(b"traceparent", b"").decode("latin-1"))
        text_headers = {k.decode("latin-1"): v.decode("latin-1").strip() for k, v in headers.items()}
        self.sessions = mw.sessions
        self.session = mw.sessions.from_headers(text_headers)
        self.turn = mw.sessions.turn_from_headers(text_headers)
        # the request body, kept only to read the OpenAI ``user`` field when that names the session
        self.request_parts: list[bytes] | None = [] if mw.sessions.kind == "user" else None
        self.t_arrival = arrival_ns  # the request reached the middleware
        self.t_first_byte = first_byte_ns if 0 <= first_byte_ns <= arrival_ns else -1
        self.receive_end_ns = -1
        self.status_code = 0
        self.sse = False
        self.json_parts: list[bytes] | None = None
        self.json_bytes = 0
        self.max_json_bytes = mw.max_json_bytes
        self.scanner: SseScanner | None = None
        self.num_tokens = 0
        self.t_first_token = -1
        self.last_send_ns = -1
        self.complete = False
        self.usage: Usage | None = None
        self.error = ""
        self.status = RequestStatus.OK
        self.body_error = ""  # kind of the first ``error`` object in the response body

    def on_receive(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.request":
            parts = self.request_parts
            if parts is not None:
                body = message.get("body", b"")
                if sum(map(len, parts)) + len(body) <= self.max_json_bytes:
                    parts.append(body)
                else:
                    self.request_parts = None
            if not message.get("more_body", False) and self.receive_end_ns < 0:
                self.receive_end_ns = now_ns()
        elif kind == "http.disconnect" and not self.complete:
            self._fail(RequestStatus.ABORTED, "client_disconnected")

    def on_start(self, message: Message, t_ns: int) -> None:
        if self.receive_end_ns < 0:
            self.receive_end_ns = t_ns
        self.status_code = int(message.get("status", 200))
        content_type = b""
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type":
                content_type = value.lower()
        if content_type.startswith(b"text/event-stream"):
            self.sse = True
            self.scanner = SseScanner()
        elif content_type.startswith(b"application/json"):
            self.json_parts = []

    def on_body(self, message: Message, start_ns: int, end_ns: int) -> None:
        body = message.get("body", b"")
        first_index = -1
        if self.scanner is not None and body:
            for data in self.scanner.feed(body):
                info = classify_event(data)
                if info.has_token:
                    if first_index < 0:
                        first_index = self.num_tokens
                    if self.t_first_token < 0:
                        self.t_first_token = end_ns
                    self.rec.token(self.rid, self.num_tokens, sent_ns=end_ns)
                    self.num_tokens += 1
                self._note(info)
        elif self.json_parts is not None and body:
            self.json_bytes += len(body)
            if self.json_bytes <= self.max_json_bytes:
                self.json_parts.append(body)
        if self.sse and body:  # the empty closing message carries no data
            self.rec.span(self.rid, Stage.STREAM_SEND, start_ns, end_ns, first_index)
        self.last_send_ns = end_ns
        if not message.get("more_body", False):
            self.complete = True

    def _note(self, info: EventInfo) -> None:
        if info.usage is not None:
            self.usage = info.usage
        if info.error is not None and not self.body_error:
            self.body_error = info.error

    def _fail(self, status: RequestStatus, error: str) -> None:
        if self.status == RequestStatus.OK:
            self.status, self.error = status, error

    def on_app_error(self, exc: BaseException) -> None:
        if self.complete:
            return
        if isinstance(exc, (OSError, ConnectionError)) or type(exc).__name__ == "CancelledError":
            self._fail(RequestStatus.ABORTED, type(exc).__name__)
        else:
            self._fail(RequestStatus.ERROR, type(exc).__name__)

    def finish(self) -> None:
        """Write the request's row and its ``gateway.receive`` span."""
        end_ns = now_ns()
        if self.json_parts and self.json_bytes <= self.max_json_bytes:
            self._note(classify_event(b"".join(self.json_parts)))
        code = self.status_code
        if code >= 500:
            self._fail(RequestStatus.ERROR, self.body_error or f"http_{code}")
        elif code >= 400:
            self._fail(RequestStatus.REJECTED, self.body_error or f"http_{code}")
        elif code == 0:
            self._fail(RequestStatus.ERROR, "no_response")
        elif self.body_error:
            self._fail(RequestStatus.ERROR, self.body_error)
        elif not self.complete:
            self._fail(RequestStatus.ABORTED, "incomplete_response")
        usage = self.usage or Usage()
        rec = self.rec
        if 0 <= self.t_first_byte < self.t_arrival:
            rec.span(self.rid, Stage.GATEWAY_ACCEPT, self.t_first_byte, self.t_arrival, 0)
        if self.receive_end_ns >= 0:
            rec.span(self.rid, Stage.GATEWAY_RECEIVE, self.t_arrival, self.receive_end_ns, 0)
        arrival = self.t_first_byte if self.t_first_byte >= 0 else self.t_arrival
        if self.request_parts:
            self.session = self.sessions.from_headers({}, user=_user_field(b"".join(self.request_parts)))
        rec.request_begin(self.key, tenant=self.tenant, slo_class=self.slo_class, arrival_ns=arrival,
                          num_prompt_tokens=usage.num_prompt_tokens, trace_id=self.trace_id, session=self.session,
                          session_turn=self.turn)
        num_output = usage.num_output_tokens
        if num_output < 0 and self.sse:
            num_output = self.num_tokens
        rec.request_end(self.rid, finish_ns=self.last_send_ns if self.complete else end_ns,
                        status=self.status, first_token_ns=self.t_first_token,
                        num_output_tokens=num_output, num_cached_tokens=usage.num_cached_tokens,
                        error=self.error, first_content_ns=self.t_first_token)


def _user_field(body: bytes) -> str:
    """The ``user`` string of a JSON request body, else ""."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    user = obj.get("user") if isinstance(obj, dict) else None
    return user if isinstance(user, str) else ""


ASGI_APP_NAME = "asgi-app"
"""Instance name prefix of an app traced by the middleware alone under ``tokentrace run``."""


def join_tokentrace_run() -> None:
    """Under ``tokentrace run`` (its environment names a store) with no recorder bound yet, bind this
    process's, so the middleware records into the run with no ``tokentrace.instrument()`` call (the
    instance is named ``asgi-app-<pid>``). Set-up code; never raises (a failure is warned once)."""
    from instrument.child_env import ENV_STORE

    if api.current() is not None or not os.environ.get(ENV_STORE):
        return
    from instrument.autoinstrument import process_handle

    process_handle(role=Role.GATEWAY, name=f"{ASGI_APP_NAME}-{os.getpid()}")


def request_context(ex: _Exchange) -> api.RequestContext:
    """The :class:`tokentrace.api.RequestContext` of a traced exchange: the app finds it with
    ``tokentrace.current_request()`` and joins its engine's stages to this request's row."""
    return api.RequestContext(ex.rid, ex.key, ex.rec, tenant=ex.tenant, slo_class=ex.slo_class,
                              receive_end=lambda: ex.receive_end_ns)


def _noting_send_start(context: api.RequestContext, send: Send) -> Send:
    """``send``, noting in ``context`` when each response body send begins (where a token's relay
    from the engine ends: an engine adapter closes its ``stream.relay`` span there)."""
    async def send_noted(message: Message) -> None:
        if message.get("type") == "http.response.body":
            context.last_send_start_ns = now_ns()
        await send(message)

    return send_noted


class TokenTraceMiddleware:
    """Pure ASGI middleware recording each traced request (see the module docstring).

    ``paths``: exact request paths to trace (default :data:`DEFAULT_PATHS`;
    ``None`` traces every HTTP request); other requests, websockets and
    lifespan events pass through untouched. Header options name request
    headers, case-insensitive; ``None`` disables one. Runs on the server's
    event loop; adds no await of its own and never blocks (the recorder's
    methods do not).
    """

    def __init__(self, app: ASGIApp, *, recorder: Recorder | Any | None = None,
                 tenant_header: str | None = "x-tenant", slo_class_header: str | None = "x-slo-class",
                 request_id_header: str = "x-request-id", paths: Collection[str] | None = DEFAULT_PATHS,
                 max_json_bytes: int = 1 << 20, sessions: SessionSource | str | None = None) -> None:
        if max_json_bytes < 0:
            raise ValueError(f"max_json_bytes must be >= 0, got {max_json_bytes}")
        if not request_id_header:
            raise ValueError("request_id_header must name a header")
        self.app = app
        self.recorder = recorder
        self.tenant_header = tenant_header.lower().encode("latin-1") if tenant_header else None
        self.slo_class_header = slo_class_header.lower().encode("latin-1") if slo_class_header else None
        self.request_id_header = request_id_header.lower().encode("latin-1")
        self.paths = None if paths is None else frozenset(paths)
        self.max_json_bytes = int(max_json_bytes)
        self.sessions = session_source(sessions)
        self._warned = False
        self._samplers: dict[int, LoopLagSampler] = {}  # by recorder identity
        self._num_in_flight = 0  # traced requests being served (on the server's loop)
        transport.install()  # first-byte times for gateway.accept, when the server is uvicorn
        if recorder is None:
            join_tokentrace_run()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http" or (self.paths is not None and scope.get("path") not in self.paths):
            await self.app(scope, receive, send)
            return
        rec = self.recorder if self.recorder is not None else api.current()
        if rec is None:
            await self.app(scope, receive, send)
            return
        arrival_ns = now_ns()
        try:
            self._sample_loop(rec)
            ex = _Exchange(rec, {k.lower(): v for k, v in scope.get("headers", ())}, arrival_ns, self,
                           transport.first_byte_ns(scope))
        except Exception as e:
            self._warn(e)
            await self.app(scope, receive, send)
            return
        context = request_context(ex)
        entered = api.enter_request(context)
        self._num_in_flight += 1
        try:
            await self.app(scope, self._receive(ex, receive), self._send(ex, _noting_send_start(context, send)))
        except BaseException as exc:
            self._guard(ex.on_app_error, exc)
            raise
        finally:
            self._num_in_flight -= 1
            api.leave_request(entered)
            self._guard(ex.finish)

    def _sample_loop(self, rec: Any) -> None:
        """Sample this server's event loop into ``rec`` while traced requests are in flight."""
        sampler = self._samplers.get(id(rec))
        if sampler is None:
            sampler = self._samplers[id(rec)] = LoopLagSampler(rec, is_idle=self._is_idle)
        sampler.ensure_running()

    def _is_idle(self) -> bool:
        return self._num_in_flight == 0

    def close(self) -> None:
        """Stop sampling the event loop (any thread; idempotent)."""
        for sampler in self._samplers.values():
            sampler.close()

    def _receive(self, ex: _Exchange, receive: Receive) -> Receive:
        async def traced_receive() -> Message:
            message = await receive()
            self._guard(ex.on_receive, message)
            return message

        return traced_receive

    def _send(self, ex: _Exchange, send: Send) -> Send:
        sampler = self._samplers.get(id(ex.rec))  # this request's loop sampler (see _sample_loop)

        async def traced_send(message: Message) -> None:
            kind = message.get("type")
            if kind == "http.response.body":
                start_ns = now_ns()
                await send(message)
                end_ns = now_ns()
                self._guard(ex.on_body, message, start_ns, end_ns)
                if sampler is not None and end_ns >= sampler.poke_from_ns:  # it may stand in for a tick
                    sampler.poke(end_ns)
                return
            if kind == "http.response.start":
                self._guard(ex.on_start, message, now_ns())
            await send(message)

        return traced_send

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a bookkeeping step; its failure is logged once and never propagates."""
        try:
            fn(*args)
        except Exception as e:
            self._warn(e)

    def _warn(self, e: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("tokentrace ASGI middleware: tracing step failed (%s: %s); the request is "
                        "served normally; this warning is shown once", type(e).__name__, e)
