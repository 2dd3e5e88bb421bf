"""Where a traced request's session (and turn) comes from: a header, the OpenAI ``user`` field,
or an OTLP span attribute.

A session is the conversation or agent loop a request is a turn of. Servers and clients say
so in different places, so the source is configurable, once, when a tracer is built:

* ``header`` (the default): ``X-Session-Id``; ``header:NAME`` names another header;
* ``user``: the ``user`` field of an OpenAI request body;
* ``attribute:KEY``: an OTLP span attribute (``attribute:gen_ai.conversation.id``); for
  tracers that see headers rather than attributes, ``http.request.header.<name>``
  attributes stand for headers.

The turn, when the client numbers its turns, comes from ``X-Session-Turn`` (or, over
OTLP, ``tokentrace.session.turn``); otherwise it is left unknown and analyzers number
turns by arrival. ``TOKENTRACE_SESSION_SOURCE`` sets the source for tracers built
without one (so a server started by ``tokentrace run`` can be told too).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["SESSION_SOURCE_ENV", "SessionSource", "parse_turn", "session_source"]

SESSION_SOURCE_ENV = "TOKENTRACE_SESSION_SOURCE"
MAX_SESSION_CHARS = 256  # longer ids are cut: a session is a label
_KINDS = ("header", "user", "attribute")


@dataclass(frozen=True, slots=True)
class SessionSource:
    """One place a session id is read from (see the module doc for the spellings)."""

    kind: str = "header"
    name: str = "X-Session-Id"
    turn_header: str = "X-Session-Turn"

    @classmethod
    def parse(cls, spec: str) -> "SessionSource":
        """``header``, ``header:NAME``, ``user`` or ``attribute:KEY``; ``ValueError`` otherwise."""
        kind, sep, name = spec.strip().partition(":")
        kind = kind.strip().lower()
        name = name.strip()
        if kind not in _KINDS:
            raise ValueError(f"unknown session source {spec!r}; use header, header:NAME, user or attribute:KEY")
        if kind == "header":
            return cls("header", name or "X-Session-Id")
        if kind == "user":
            if sep:
                raise ValueError(f"session source 'user' takes no name, got {spec!r}")
            return cls("user", "user")
        if not name:
            raise ValueError(f"session source {spec!r} needs an attribute key, e.g. attribute:gen_ai.conversation.id")
        return cls("attribute", name)

    def from_headers(self, headers: Mapping[str, str], *, user: str = "") -> str:
        """The session of a request whose headers (lower-case names) and ``user`` field are given."""
        if self.kind == "user":
            value = user
        elif self.kind == "header":
            value = headers.get(self.name.lower(), "")
        else:  # an attribute: only a header captured as one can be seen here
            prefix = "http.request.header."
            value = headers.get(self.name[len(prefix):].lower(), "") if self.name.startswith(prefix) else ""
        return (value or "")[:MAX_SESSION_CHARS]

    def turn_from_headers(self, headers: Mapping[str, str]) -> int:
        return parse_turn(headers.get(self.turn_header.lower()))


def parse_turn(text: object) -> int:
    """A turn number as sent (a non-negative integer, as text or int), else -1 (unknown)."""
    if isinstance(text, bool):
        return -1
    if isinstance(text, int):
        return text if 0 <= text < 2**31 else -1
    if isinstance(text, str) and text.strip().isdigit():
        n = int(text.strip())
        return n if n < 2**31 else -1
    return -1


def session_source(spec: str | SessionSource | None = None) -> SessionSource:
    """``spec`` parsed; without one, ``$TOKENTRACE_SESSION_SOURCE``, else the ``X-Session-Id`` header.
    ``ValueError`` for a bad spec (the environment's included)."""
    if isinstance(spec, SessionSource):
        return spec
    if spec is None:
        spec = os.environ.get(SESSION_SOURCE_ENV, "") or "header"
    return SessionSource.parse(spec)
