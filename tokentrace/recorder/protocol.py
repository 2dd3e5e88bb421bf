"""The ``Recorder`` protocol: what every adapter records into.

:class:`~tokentrace.recorder.buffered.BufferedRecorder` is the implementation
(column buffers flushed to a sink by a background thread). Wrappers that sit in
front of one (``instrument.sampling.SamplingRecorder`` keeps or drops whole
requests, ``instrument.clock_sync.SkewedRecorder`` shifts a test process's
clock) implement the same protocol, so adapters are written against this
surface and never look methods up by name.

Contract shared by the event methods (``span`` ... ``instance``): callable from
any thread, including an asyncio event loop's; they never block and never
raise into the caller; times are integers on the recorder's clock
(:meth:`Recorder.clock`, ns); nullable integer arguments use ``-1``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokentrace.clock import Anchor
from tokentrace.recorder.sink import Sink
from tokentrace.schema import RequestStatus, Role

__all__ = ["Recorder"]


@runtime_checkable
class Recorder(Protocol):
    """Receives tokentrace events of one traced process (see the module contract)."""

    def clock(self) -> int:
        """Now, on the clock this recorder's times are on (ns)."""
        ...

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """One complete stage interval ``[start_ns, end_ns)``."""
        ...

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        """Open the interval of ``stage`` for (request, token) at ``t_ns``."""
        ...

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1,
                  step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """Close the interval :meth:`stage_begin` opened and record it as a span."""
        ...

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        """One output token as seen by this process."""
        ...

    def step(self, step: int, start_ns: int, end_ns: int, num_seqs: int, num_prefill_tokens: int,
             num_decode_tokens: int, num_waiting: int, num_running: int, num_preempted: int,
             blocks_used_device: int = -1, blocks_total_device: int = -1,
             blocks_used_host: int = -1, blocks_total_host: int = -1,
             blocks_used_disk: int = -1, blocks_total_disk: int = -1) -> None:
        """One engine iteration."""
        ...

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1,
                    step: int = -1) -> None:
        """One KV cache event (``kind``: ``CacheEventKind``)."""
        ...

    def loop_lag(self, start_ns: int, end_ns: int, armed_ns: int = -1, loop_cpu_ns: int = -1,
                 process_cpu_ns: int = -1) -> None:
        """An event-loop tick armed at ``armed_ns`` and due at ``start_ns`` ran at ``end_ns``; meanwhile the loop's
        thread used ``loop_cpu_ns`` of CPU and its process ``process_cpu_ns`` (-1: not measured)."""
        ...

    def spec_step(self, request_id: int, step: int, draft_source: int, num_proposed: int, num_accepted: int,
                  first_token_index: int, draft_start_ns: int, draft_end_ns: int, verify_start_ns: int,
                  verify_end_ns: int, batch_size: int, num_spec_seqs: int) -> None:
        """One request's speculative engine step (``draft_source``: ``DraftSource``)."""
        ...

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        """Note a request's arrival (and the session it is a turn of); returns its ``request_id``."""
        ...

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1,
                    num_cached_tokens: int = -1, error: str = "", first_content_ns: int = -1) -> None:
        """Write the request's row."""
        ...

    def instance(self, *, role: int = Role.COLOCATED, name: str = "", host: str | None = None,
                 pid: int | None = None, anchor: Anchor | None = None, clock_offset_ns: int = 0,
                 clock_rtt_ns: int = -1) -> None:
        """Write this process's ``instances`` row."""
        ...

    @property
    def instance_id(self) -> int:
        """The id of this process's rows."""
        ...

    @property
    def sink(self) -> Sink:
        """Where the recorded batches go."""
        ...

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        ...

    @property
    def counters(self) -> dict[str, int]:
        """Dropped and recorded event counts so far."""
        ...

    def flush(self) -> None:
        """Write everything recorded so far (blocks on the sink; not for the hot path)."""
        ...

    def close(self) -> None:
        """Flush and stop; idempotent."""
        ...
