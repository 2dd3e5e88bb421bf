"""What tracing falls back to when its store cannot be opened: a recorder that records nothing.

``tokentrace.instrument(target, store=...)`` must never stop the server it wraps. When
the store cannot be created (a read-only mount, a path under a file, a full disk), it
logs one warning and returns a handle whose recorder is an :class:`UntracedRecorder`:
every event method is a no-op, nothing is attached to the target, and ``reason`` says
why, in one sentence.
"""

from __future__ import annotations

import pyarrow as pa

from tokentrace.clock import Anchor, now_ns
from tokentrace.schema import NULL_INT, RequestStatus, Role, Table

__all__ = ["UntracedRecorder", "NullSink"]


class NullSink:
    """Takes every batch and keeps none."""

    def write(self, table: Table, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> None:
        pass


class UntracedRecorder:
    """A ``Recorder`` that records nothing; ``reason``: why tracing is off (any thread, never raises)."""

    __slots__ = ("reason", "_sink", "_closed")

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self._sink = NullSink()
        self._closed = False

    def clock(self) -> int:
        return now_ns()

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        pass

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        pass

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1,
                  step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        pass

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        pass

    def step(self, step: int, start_ns: int, end_ns: int, num_seqs: int, num_prefill_tokens: int,
             num_decode_tokens: int, num_waiting: int, num_running: int, num_preempted: int,
             blocks_used_device: int = -1, blocks_total_device: int = -1,
             blocks_used_host: int = -1, blocks_total_host: int = -1,
             blocks_used_disk: int = -1, blocks_total_disk: int = -1) -> None:
        pass

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1,
                    step: int = -1) -> None:
        pass

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        return NULL_INT

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1,
                    num_cached_tokens: int = -1, error: str = "", first_content_ns: int = -1) -> None:
        pass

    def instance(self, *, role: int = Role.COLOCATED, name: str = "", host: str | None = None,
                 pid: int | None = None, anchor: Anchor | None = None, clock_offset_ns: int = 0,
                 clock_rtt_ns: int = -1) -> None:
        pass

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
