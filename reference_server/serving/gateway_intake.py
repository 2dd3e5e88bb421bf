"""Taking a request in: its id, its per-request state, and reading its body under a size limit.

Event-loop thread only. Errors are :class:`~reference_server.serving.gateway_openai.OpenAIError`
(413 for a body over the limit, 400 for one that is not JSON).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from starlette.requests import ClientDisconnect, Request

from reference_server.serving.gateway_openai import OpenAIError

__all__ = ["RequestContext", "read_json_body", "request_id_for"]

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


def request_id_for(header_value: str | None) -> str:
    """The client's ``X-Request-Id`` when it is valid (1-128 chars of ``[A-Za-z0-9._:-]``),
    else a fresh ``cmpl-<uuid hex>``."""
    if header_value is not None and _REQUEST_ID.match(header_value):
        return header_value
    return f"cmpl-{uuid.uuid4().hex}"


class RequestContext:
    """What the gateway knows about one request while serving it (mutable, one task)."""

    __slots__ = ("request_id", "endpoint", "operation", "arrival_ns", "created", "tenant", "slo_class",
                 "model", "stream", "include_usage", "traceparent", "num_prompt_tokens", "route_start_ns")

    def __init__(self, request_id: str, endpoint: str, arrival_ns: int, *, tenant: str | None,
                 traceparent: str | None) -> None:
        self.request_id = request_id
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


async def read_json_body(request: Request, *, max_bytes: int) -> Any:
    """The parsed JSON body. A ``Content-Length`` over ``max_bytes`` is refused before
    reading anything; a body that grows past it while streaming in is refused at once
    (413). Malformed JSON or UTF-8 -> 400. A client leaving mid-body -> 400 (nobody reads it)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise OpenAIError(400, "invalid Content-Length header", param=None)
        if int(declared) > max_bytes:
            raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise OpenAIError(400, "the client disconnected while sending the body", param=None) from None
    try:
        return json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"We could not parse the JSON body of your request: {exc}", param=None) from None


def _too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(413, f"request body is larger than the limit of {max_bytes} bytes", param=None,
                       code="request_too_large")
