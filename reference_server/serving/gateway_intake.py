"""Taking a request in: its id, its per-request state, and reading its body under a size
limit and a time limit.

Event-loop thread only. Errors are :class:`~reference_server.serving.gateway_openai.OpenAIError`
(413 for a body over the limit, 408 for one that does not arrive in time, 400 for one that
is not JSON).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any

from starlette.requests import ClientDisconnect, Request

from reference_server.serving.gateway_openai import OpenAIError

__all__ = ["InFlightIds", "RequestContext", "read_json_body", "request_id_for", "session_of"]

MAX_SESSION_CHARS = 256  # a longer session id is cut (it is a label, not content)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def session_of(header_value: str | None, user: str | None) -> str:
    """The session a request is a turn of, for KV retention: the ``X-Session-Id`` header,
    else the OpenAI ``user`` field, else "" (none)."""
    return (header_value or user or "")[:MAX_SESSION_CHARS]


def request_id_for(header_value: str | None) -> str:
    """The client's ``X-Request-Id`` when it is valid (1-128 chars of ``[A-Za-z0-9._:-]``),
    else a fresh ``cmpl-<uuid hex>``."""
    if header_value is not None and _REQUEST_ID.match(header_value):
        return header_value
    return f"cmpl-{uuid.uuid4().hex}"


class RequestContext:
    """What the gateway knows about one request while serving it (mutable, one task)."""

    __slots__ = ("request_id", "endpoint", "operation", "arrival_ns", "created", "tenant", "slo_class",
                 "model", "stream", "include_usage", "traceparent", "num_prompt_tokens", "route_start_ns",
                 "backend_id", "traced", "duplicate_of")

    def __init__(self, request_id: str, endpoint: str, arrival_ns: int, *, tenant: str | None,
                 traceparent: str | None) -> None:
        self.request_id = request_id
        self.backend_id = request_id  # the id the backend and engines see (unique among requests in flight)
        self.traced = True  # False: observers do not see this request (its id is another tenant's)
        self.duplicate_of: str | None = None  # the client's id, when it is already in flight for this tenant
        self.endpoint = endpoint  # URL path
        self.operation = ""  # gen_ai.operation.name, set when parsed
        self.arrival_ns = arrival_ns  # gateway monotonic clock, ns
        self.created = int(time.time())  # wall clock, s: OpenAI's "created" field
        self.tenant = tenant
        self.slo_class = ""
        self.model = ""  # model name as the client sent it (echoed in answers)
        self.stream = False
        self.include_usage = False
        self.traceparent = traceparent
        self.num_prompt_tokens = 0
        self.route_start_ns = 0  # gateway monotonic clock, ns

    def metric_labels(self) -> tuple[str, str, str, str]:
        """Label values of the latency histograms (operation, model, tenant, SLO class)."""
        return (self.operation, self.model, self.tenant or "", self.slo_class)


class InFlightIds:
    """The ids of the requests the gateway is serving, and whose tenant each one is.

    An ``X-Request-Id`` names a request among its own tenant's only. :meth:`claim` keeps a
    free id; a tenant reusing its own id still in flight gets a fresh one and
    ``ctx.duplicate_of`` (the gateway answers 409); an id in flight for another tenant (or a
    request with no tenant yet) keeps its id for the answer, gets a private ``backend_id``
    and ``traced = False`` (observers would mix it with the other tenant's request), so that
    nothing in the answer depends on another tenant's ids. :meth:`release` frees an id when
    its request is done.
    """

    _FREE: Any = object()

    def __init__(self) -> None:
        self._tenant_of: dict[str, str | None] = {}  # request id -> its tenant

    def claim(self, ctx: RequestContext) -> None:
        wanted = ctx.request_id
        owner = self._tenant_of.get(wanted, self._FREE)
        if owner is self._FREE:
            self._tenant_of[wanted] = ctx.tenant
        elif owner == ctx.tenant and ctx.tenant is not None:  # the tenant's own id: it may know
            ctx.duplicate_of = wanted
            ctx.request_id = ctx.backend_id = f"cmpl-{uuid.uuid4().hex}"
            self._tenant_of[ctx.request_id] = ctx.tenant
        else:
            ctx.traced = False
            ctx.backend_id = f"{wanted}~{uuid.uuid4().hex[:12]}"

    def release(self, ctx: RequestContext) -> None:
        if ctx.traced and self._tenant_of.get(ctx.request_id, self._FREE) == ctx.tenant:
            del self._tenant_of[ctx.request_id]

    def __len__(self) -> int:
        return len(self._tenant_of)


async def read_json_body(request: Request, *, max_bytes: int, timeout_s: float | None = None) -> Any:
    """The parsed JSON body. A ``Content-Length`` over ``max_bytes`` is refused before
    reading anything; a body that grows past it while streaming in is refused at once
    (413). A body not complete within ``timeout_s`` of this call -> 408 (a client trickling
    bytes must not hold a connection and a task forever). Malformed JSON or UTF-8, numbers
    too long to convert, or nesting deeper than the parser's recursion limit -> 400. A
    client leaving mid-body -> 400 (nobody reads it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise OpenAIError(400, "invalid Content-Length header", param=None)
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    try:
        async with asyncio.timeout(timeout_s):
            await _read_chunks(request, chunks, max_bytes)
    except TimeoutError:
        raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s", param=None,
                          code="request_timeout") from None
    except ClientDisconnect:
        raise OpenAIError(400, "the client disconnected while sending the body", param=None) from None
    try:
        return json.loads(b"".join(chunks))
    except RecursionError:
        raise OpenAIError(400, "We could not parse the JSON body of your request: it is nested too deeply",
                          param=None) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}", param=None) from None


async def _read_chunks(request: Request, chunks: list[bytes], max_bytes: int) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the limit of {max_bytes} bytes", param=None,
                       code="request_too_large")
