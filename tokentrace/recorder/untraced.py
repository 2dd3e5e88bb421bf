"""What tracing falls back to when its store cannot be opened: a recorder that records nothing.

``tokentrace.instrument(target, store=...)`` must never stop the server it wraps. When
the store cannot be created (a read-only mount, a path under a file, a full disk), it
logs one warning and returns a handle whose recorder is an :class:`UntracedRecorder`:
every event method is a no-op, nothing is attached to the target, and ``reason`` says
why, in one sentence.
"""

from __future__ import annotations

import pyarrow as pa

from tokentrace.clock import now_ns
from tokentrace.recorder.protocol import Recorder
from tokentrace.schema import NULL_INT, Table

__all__ = ["UntracedRecorder", "NullSink"]


class NullSink:
    """Takes every batch and keeps none."""

    def write(self, table: Table, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> None:
        pass


class UntracedRecorder(Recorder):
    """A ``Recorder`` that records nothing; ``reason``: why tracing is off (any thread, never raises).

    The event methods are the protocol's own, which do nothing; only what must answer is written here."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._sink = NullSink()
        self._closed = False

    def clock(self) -> int:
        return now_ns()

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        return NULL_INT

    @property
    def instance_id(self) -> int:
        return 0

    @property
    def sink(self) -> NullSink:
        return self._sink

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def counters(self) -> dict[str, int]:
        return {}

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._closed = True
