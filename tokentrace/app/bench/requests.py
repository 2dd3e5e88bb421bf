"""The request values the load generator passes between its parts.

* :class:`TextRequest`: what to ask (system prompt, user prompt, output length), from a workload;
* :class:`PlannedRequest`: a text request plus when to send it, as whom, under which SLO class,
  and the request key sent as ``X-Request-Id`` (the join key with the server's records);
* :class:`Outcome`: what the client saw of one request, and :class:`FailureKind`, why it failed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["TextRequest", "PlannedRequest", "FailureKind", "Outcome"]


@dataclass(frozen=True, slots=True)
class TextRequest:
    """One request's content.

    ``system`` is a shared system prompt ("" if none): sent as a system message
    to the chat endpoint and prepended to the prompt for the completions
    endpoint. ``num_prompt_tokens`` is the planned length (byte-level tokens:
    the text is ASCII, one character per token); the server's own count, when
    it reports usage, is preferred in summaries.
    """

    system: str
    prompt: str
    max_tokens: int

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.system) + len(self.prompt)


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """A request of the run's plan, in send order."""

    index: int  # 0-based position in the plan
    key: str  # sent as X-Request-Id; requests.request_key in the store
    text: TextRequest
    offset_s: float  # open-loop send time, seconds after the run start
    tenant: str = ""
    api_key: str = ""  # sent as "Authorization: Bearer <api_key>" when not empty
    slo_class: str = ""  # sent as X-SLO-Class when not empty
    session: str = ""  # sent as X-Session-Id when not empty: the session (conversation) this is a turn of
    session_turn: int = -1  # sent as X-Session-Turn when >= 0
    messages: tuple[tuple[str, str], ...] = ()  # chat endpoint: (role, content) history sent instead of the text


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
class Outcome:
    """What the client saw of one request (times: this host's monotonic clock, ns)."""

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
    text: str = ""  # the answer's text as streamed (session workloads feed it into the next turn)

    @property
    def ok(self) -> bool:
        return self.failure is None and not self.cancelled
