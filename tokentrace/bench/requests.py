"""The request values the load generator passes between its parts.

* :class:`TextRequest`: what to ask (system prompt, user prompt, output length), from a workload;
* :class:`PlannedRequest`: a text request plus when to send it, as whom, under which SLO class,
  and the request key sent as ``X-Request-Id`` (the join key with the server's records).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TextRequest", "PlannedRequest"]


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
