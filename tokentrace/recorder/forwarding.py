"""One forwarding base for recorder wrappers.

:class:`ForwardingRecorder` implements the whole :class:`~tokentrace.recorder.protocol.Recorder`
surface by calling the same method of ``inner`` with the same arguments. A wrapper (sampling,
clock skew, live metrics) derives from it and overrides only the methods whose behaviour it
changes, so adding a column to one event touches the protocol, the recorder and the wrappers that
change that event, never a hand-written copy of every other method. The contract is the
protocol's: any thread, never blocks, never raises into the caller (whatever ``inner`` does).
"""

from __future__ import annotations

from tokentrace.clock import Anchor
from tokentrace.recorder.protocol import Recorder
from tokentrace.recorder.sink import Sink
from tokentrace.schema import RequestStatus, Role

__all__ = ["ForwardingRecorder"]


class ForwardingRecorder:
    """A :class:`Recorder` that hands every call to ``inner`` unchanged; wrappers override what they change."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner

    def clock(self) -> int:
        return self.inner.clock()

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        self.inner.span(request_id, stage, start_ns, end_ns, token_index, step, num_bytes, tier, batch_size)

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        self.inner.stage_begin(request_id, stage, t_ns, token_index)

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1,
                  step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        self.inner.stage_end(request_id, stage, t_ns, token_index, step, num_bytes, tier, batch_size)

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        self.inner.token(request_id, token_index, emit_ns=emit_ns, sent_ns=sent_ns, recv_ns=recv_ns, step=step)

    def step(self, step: int, start_ns: int, end_ns: int, num_seqs: int, num_prefill_tokens: int,
             num_decode_tokens: int, num_waiting: int, num_running: int, num_preempted: int,
             blocks_used_device: int = -1, blocks_total_device: int = -1,
             blocks_used_host: int = -1, blocks_total_host: int = -1,
             blocks_used_disk: int = -1, blocks_total_disk: int = -1) -> None:
        self.inner.step(step, start_ns, end_ns, num_seqs, num_prefill_tokens, num_decode_tokens, num_waiting,
                        num_running, num_preempted, blocks_used_device, blocks_total_device, blocks_used_host,
                        blocks_total_host, blocks_used_disk, blocks_total_disk)

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1,
                    step: int = -1) -> None:
        self.inner.cache_event(kind, tier, num_blocks, start_ns, end_ns, request_id, num_tokens, num_bytes, step)

    def loop_lag(self, start_ns: int, end_ns: int, armed_ns: int = -1, loop_cpu_ns: int = -1,
                 process_cpu_ns: int = -1) -> None:
        self.inner.loop_lag(start_ns, end_ns, armed_ns, loop_cpu_ns, process_cpu_ns)

    def spec_step(self, request_id: int, step: int, draft_source: int, num_proposed: int, num_accepted: int,
                  first_token_index: int, draft_start_ns: int, draft_end_ns: int, verify_start_ns: int,
                  verify_end_ns: int, batch_size: int, num_spec_seqs: int) -> None:
        self.inner.spec_step(request_id, step, draft_source, num_proposed, num_accepted, first_token_index,
                             draft_start_ns, draft_end_ns, verify_start_ns, verify_end_ns, batch_size, num_spec_seqs)

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        return self.inner.request_begin(key, tenant=tenant, slo_class=slo_class, arrival_ns=arrival_ns,
                                        num_prompt_tokens=num_prompt_tokens, trace_id=trace_id, session=session,
                                        session_turn=session_turn)

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1,
                    num_cached_tokens: int = -1, error: str = "", first_content_ns: int = -1) -> None:
        self.inner.request_end(request_id, finish_ns=finish_ns, status=status, first_token_ns=first_token_ns,
                               num_output_tokens=num_output_tokens, num_cached_tokens=num_cached_tokens, error=error,
                               first_content_ns=first_content_ns)

    def instance(self, *, role: int = Role.COLOCATED, name: str = "", host: str | None = None,
                 pid: int | None = None, anchor: Anchor | None = None, clock_offset_ns: int = 0,
                 clock_rtt_ns: int = -1) -> None:
        self.inner.instance(role=role, name=name, host=host, pid=pid, anchor=anchor, clock_offset_ns=clock_offset_ns,
                            clock_rtt_ns=clock_rtt_ns)

    @property
    def instance_id(self) -> int:
        return self.inner.instance_id

    @property
    def sink(self) -> Sink:
        return self.inner.sink

    @property
    def closed(self) -> bool:
        return self.inner.closed

    @property
    def counters(self) -> dict[str, int]:
        return self.inner.counters

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()
