"""Received OTLP spans -> tokentrace requests, for each emitter (see docs/instrument-otel.md's table).

:class:`OtlpMapper` sorts every span of a payload into one of four families and builds one
:class:`~instrument.otlp_requests.RequestBuild` per request (receiver monotonic clock, ns):

* **tokentrace's own export** (``llm_request`` carrying ``tokentrace.request_status``, from
  :mod:`tokentrace.app.export.otlp`): exact: every child stage span with its token, step,
  bytes, tier and batch size, every ``tokens`` row from the ``tokentrace.token`` events, tenant,
  SLO class, first content, each on the instance its resource names;
* **vLLM's** ``llm_request`` (``vllm/v1/engine/output_processor.py``, ``do_tracing``): arrival =
  span start ``A``, first token ``F = A + time_to_first_token``, finish ``A + e2e``; queue and
  prefill end at ``F`` (token 0); the last token at ``F + time_in_model_decode``, and when the
  span carries no per-token times, the tokens between are spaced evenly (an *estimate*, counted
  in ``otlp_token_times_interpolated``) so that TPOT and ITL equal
  ``time_in_model_decode / (completion_tokens - 1)``; the decode time is ``decode.compute`` of
  tokens 1..n-1. Per-token arrays (open-telemetry/semantic-conventions-genai#75, as
  vllm-project/vllm#32573 sends them) replace the estimate with measured times, and the
  request-lifecycle spans of vllm-project/vllm#44402 (``vllm_queue``, ``vllm_async_kv_transfer``,
  ``vllm_prefill``, ``vllm_decode``, ``vllm_preempted``) replace the latencies derived from
  attributes;
* **SGLang's** request trace (``--enable-trace``, ``sglang/srt/tracing/trace.py``): the root
  ``Req`` span (attribute ``rid``) is the request; its top-level ``trace_slice`` spans, named by
  ``RequestStage``, are its stages (:data:`instrument.semconv.SGLANG_STAGES`);
* anything else is counted in ``otlp_spans_ignored``.

A root span (``llm_request``, SGLang's ``Req``) comes when its request ends; children that
arrive first wait for it (:class:`~instrument.otlp_requests.TraceBook`), children that
arrive later join the recorded request. What a source does not carry stays -1 (not reported),
never 0. Not thread-safe: :class:`~instrument.otlp_ingest.OtlpIngestor` serializes calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterable, Mapping

from instrument import semconv as sc
from instrument.engine_config import record_engine_config
from instrument.otlp_attributes import (
    MAX_BATCH_SIZE,
    MAX_INT,
    MAX_LATENCY_S,
    count,
    finish_status,
    int64,
    numbers,
    seconds_ns,
    unix_ns,
)
from instrument.otlp_decode import OtlpSpan
from instrument.otlp_requests import (
    IngestOptions,
    Replicas,
    RequestBuild,
    RequestRow,
    Room,
    StageInterval,
    TokenRow,
    TraceBook,
    first_str,
    record_request,
    split_interval,
)
from instrument.sessions import parse_turn
from tokentrace.clock import Anchor
from tokentrace.recorder import Recorder
from tokentrace.schema import SPANS, RequestStatus, Role, Stage, Tier, request_id_of

__all__ = ["OtlpMapper", "SPANS_MAPPED", "SPANS_IGNORED", "TOKENS_INTERPOLATED", "SPANS_UNMATCHED", "SPANS_REJECTED",
           "MAX_LATENCY_S", "MAX_INTERPOLATED_TOKENS", "MAX_INT"]

SPANS_MAPPED = "otlp_spans_mapped"
SPANS_IGNORED = "otlp_spans_ignored"
TOKENS_INTERPOLATED = "otlp_token_times_interpolated"
"""Tokens whose time is an even split of vLLM's decode time, not a measurement."""
SPANS_UNMATCHED = "otlp_spans_unmatched"
"""Child spans whose request's root span never came (counted as ignored too)."""
MAX_INTERPOLATED_TOKENS = 1 << 16
"""A request reporting more output tokens than this gets no per-token estimate (only token 0)."""
SPANS_REJECTED = "otlp_spans_rejected"
"""Spans refused: request spans whose times cannot be stored, spans of traced processes past the
receiver's instance cap. Their neighbours are stored."""

_ROOT, _CHILD, _STEP, _OTHER = range(4)
_STATUS_BY_LABEL = {s.label: s for s in RequestStatus}


class OtlpMapper:
    """Maps decoded spans into the replicas' recorders (see the module docstring)."""

    def __init__(self, replicas: Replicas, anchor: Anchor, options: IngestOptions | None = None) -> None:
        self.replicas = replicas
        self.options = options or IngestOptions()
        self._to_mono = anchor.to_mono_ns
        self._book = TraceBook()
        self._reasons: dict[str, None] = {}  # why spans were refused, in order, since take_reasons
        self.counts = {SPANS_MAPPED: 0, SPANS_IGNORED: 0, TOKENS_INTERPOLATED: 0, SPANS_UNMATCHED: 0,
                       SPANS_REJECTED: 0}
        self._configured: set[int] = set()  # recorders whose engine configuration was written (id)
        self.room = Room()  # flushes a recorder before a row its full table would drop

    # -- sorting

    @classmethod
    def is_root(cls, span: OtlpSpan) -> bool:
        """Whether ``span`` is a request's root span (mapped after the children of its payload)."""
        return cls._family(span) == _ROOT

    @staticmethod
    def _family(span: OtlpSpan) -> int:
        a = span.attributes
        if span.name == sc.LLM_REQUEST_SPAN or (sc.SGLANG_RID in a and " Req " in f" {span.name} "):
            return _ROOT
        if sc.TT_STAGE in a or span.name in sc.VLLM_LIFECYCLE_SPANS or span.name in sc.SGLANG_STAGES:
            return _CHILD
        if span.name in sc.VLLM_STEP_SPANS:
            return _STEP
        return _OTHER

    def map_spans(self, spans: Iterable[OtlpSpan]) -> int:
        """Map one payload's spans (children before roots); returns how many were used or held."""
        by_family: dict[int, list[OtlpSpan]] = {_ROOT: [], _CHILD: [], _STEP: [], _OTHER: []}
        instances = 0
        self.room.refresh()
        for s in spans:
            if not self.replicas.admit(s.resource):
                self._reject(f"more than {self.replicas.max_instances} traced processes (service.instance.id); "
                             "start ingest-otlp with a larger --max-instances to record more")
                continue
            self._may_record_config(s.resource)
            if s.name == sc.TT_INSTANCE_SPAN:  # an exported instance: known before its token rows come
                self.replicas.for_resource(s.resource)
                instances += 1
                continue
            by_family[self._family(s)].append(s)
        for child in by_family[_CHILD]:
            done = self._book.recorded(child.trace_id)
            if done is not None and self._late_child(done, child):
                continue
            self._book.hold(child.trace_id, child)
        used = len(by_family[_CHILD]) + instances
        for root in by_family[_ROOT]:
            used += self._map_root(root)
        self.counts[SPANS_MAPPED] += used
        self.counts[SPANS_IGNORED] += len(by_family[_STEP]) + len(by_family[_OTHER])
        return used

    def _may_record_config(self, resource: Mapping[str, Any]) -> None:
        """An engine's serving configuration from its resource (``sc.TT_ENGINE_CONFIG_KEYS``), once per
        instance; a value that is not a positive integer (or, for the policy, a name) counts as absent."""
        if "tokentrace.engine.max_num_seqs" not in resource:
            return
        recorder = self.replicas.for_resource(resource)
        if id(recorder) in self._configured:
            return
        self._configured.add(id(recorder))
        fields: dict[str, Any] = {}
        for key, name in sc.TT_ENGINE_CONFIG_KEYS.items():
            value = resource.get(key)
            if name == "scheduling_policy":
                if isinstance(value, str) and value:
                    fields[name] = value
            elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
                fields[name] = value
            elif isinstance(value, str) and value.isdigit() and int(value) > 0:
                fields[name] = int(value)
        if "max_num_seqs" not in fields:
            return
        role = resource.get(sc.TT_INSTANCE_ROLE)
        try:
            parsed = Role.from_label(role) if isinstance(role, str) else Role.COLOCATED
        except ValueError:
            parsed = Role.COLOCATED
        if parsed not in (Role.PREFILL, Role.DECODE):
            parsed = Role.COLOCATED
        record_engine_config(recorder, SimpleNamespace(config=SimpleNamespace(**fields)), role=parsed)

    def _map_root(self, root: OtlpSpan) -> int:
        """Build and record one request from its root span and the children held for it: 1, or
        0 when the root cannot be mapped (counted in ``otlp_spans_rejected``; its children stay
        held for a root that can). The request is built completely before anything is recorded,
        so a bad root leaves no partial rows and costs no other span of the payload."""
        children = self._book.take(root.trace_id)
        mine = [c for c in children if self._belongs(root, c)]
        try:
            if not (0 <= root.start_unix_ns <= MAX_INT and 0 <= root.end_unix_ns <= MAX_INT):
                raise ValueError("span times out of range")
            build = self._build(root, mine)
            bounds = build.boundaries()
        except (ArithmeticError, ValueError, TypeError):  # a value no check above anticipated
            for c in children:
                self._book.hold(root.trace_id, c)
            self._reject("a request span's start or end time is out of range")
            return 0
        for c in children:
            if all(c is not m for m in mine):
                self._book.hold(root.trace_id, c)
        record_request(build, self.room)
        self._book.remember(root.trace_id, _Recorded(build.key, build.tenant, build.recorder, build.arrival_ns, bounds))
        return 1

    def _reject(self, reason: str) -> None:
        """Count one span refused, and why (:meth:`take_reasons` gives the reasons to the sender)."""
        self.counts[SPANS_REJECTED] += 1
        self._reasons[reason] = None

    def take_reasons(self) -> list[str]:
        """Why spans were refused since the last call (each reason once)."""
        reasons, self._reasons = list(self._reasons), {}
        return reasons

    @staticmethod
    def _belongs(root: OtlpSpan, child: OtlpSpan) -> bool:
        if sc.SGLANG_RID in root.attributes:  # slices hang under per-thread spans: the whole trace
            return True
        return child.parent_span_id == root.span_id or not child.parent_span_id

    def close(self) -> None:
        """Count the children whose root never came (as ignored, and unmatched)."""
        left = len(self._book.drain()) + self._book.dropped
        self._book.dropped = 0
        self.counts[SPANS_MAPPED] -= left
        self.counts[SPANS_IGNORED] += left
        self.counts[SPANS_UNMATCHED] += left

    # -- building

    def _build(self, root: OtlpSpan, children: list[OtlpSpan]) -> RequestBuild:
        if sc.TT_STATUS in root.attributes:
            return self._tokentrace(root, children)
        if sc.SGLANG_RID in root.attributes and root.name != sc.LLM_REQUEST_SPAN:
            return self._sglang(root, children)
        return self._vllm(root, children)

    def _base(self, root: OtlpSpan, key: str) -> RequestBuild:
        a = root.attributes
        arrival = self._to_mono(root.start_unix_ns)
        finish = max(arrival, self._to_mono(root.end_unix_ns))
        b = RequestBuild(key=key, recorder=self.replicas.for_resource(root.resource), arrival_ns=arrival,
                         finish_ns=finish, trace_id=root.trace_id if any(root.trace_id.strip("0")) else "")
        b.tenant = first_str(a, self.options.tenant_keys, root.resource)
        b.slo_class = first_str(a, self.options.slo_class_keys, root.resource)
        b.session = first_str(a, self.options.session_keys, root.resource)
        b.session_turn = next((t for t in (parse_turn(a.get(k)) for k in self.options.session_turn_keys) if t >= 0), -1)
        b.num_prompt_tokens = count(a, sc.GEN_AI_USAGE_INPUT_TOKENS, sc.GEN_AI_USAGE_PROMPT_TOKENS)
        b.num_output_tokens = count(a, sc.GEN_AI_USAGE_OUTPUT_TOKENS, sc.GEN_AI_USAGE_COMPLETION_TOKENS)
        b.num_cached_tokens = count(a, sc.GEN_AI_USAGE_CACHE_READ_DOT_INPUT_TOKENS,
                                     sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS, sc.GEN_AI_ITERATION_PER_TOKEN_CACHED_TOKENS)
        if root.is_error:
            kind = a.get(sc.ERROR_TYPE)
            b.status = RequestStatus.ERROR
            b.error = str(kind)[:64] if isinstance(kind, str) and kind else (root.status_message[:64] or "span_error")
        elif (finished := finish_status(a)) is not None:
            b.status, b.error = finished
        return b

    def _child_stage(self, child: OtlpSpan, stage: Stage, token: int | None) -> StageInterval:
        return StageInterval(int(stage), self._to_mono(child.start_unix_ns), self._to_mono(child.end_unix_ns), token,
                             recorder=self.replicas.for_resource(child.resource))

    # vLLM ---------------------------------------------------------------------------------

    def _vllm(self, root: OtlpSpan, children: list[OtlpSpan]) -> RequestBuild:
        a = root.attributes
        key = a.get(sc.GEN_AI_REQUEST_ID)
        b = self._base(root, str(key) if isinstance(key, (str, int)) and str(key) else root.span_id)
        arrival = b.arrival_ns
        ttft, e2e = seconds_ns(a, sc.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN), seconds_ns(a, sc.GEN_AI_LATENCY_E2E)
        queue, prefill = seconds_ns(a, sc.GEN_AI_LATENCY_TIME_IN_QUEUE), seconds_ns(a, sc.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL)
        decode = seconds_ns(a, sc.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE)
        if e2e is not None:
            b.finish_ns = arrival + e2e
        generated = numbers(a, sc.GEN_AI_LATENCY_PER_TOKEN_GENERATION_TIME)
        if ttft is not None:
            first = arrival + ttft
        elif generated:
            first = arrival + round(generated[0] * 1e9)
        else:  # lay queue, then prefill, from the arrival
            first = arrival + (queue or 0) + prefill if prefill is not None else -1
        b.first_token_ns = first
        lifecycle = [(c, Stage.from_label(sc.VLLM_LIFECYCLE_SPANS[c.name])) for c in children
                     if c.name in sc.VLLM_LIFECYCLE_SPANS]
        if generated:
            b.token_times = sorted(arrival + round(x * 1e9) for x in generated)
        elif first >= 0:
            b.token_times = [first]
            n = b.num_output_tokens
            if decode is not None and 2 <= n <= MAX_INTERPOLATED_TOKENS:
                last = max(first, min(first + decode, b.finish_ns))
                b.token_times += [first + (last - first) * i // (n - 1) for i in range(1, n)]
                self.counts[TOKENS_INTERPOLATED] += n - 2
        if lifecycle:
            for child, stage in lifecycle:
                token = 0 if stage in (Stage.SCHEDULE_QUEUE, Stage.TRANSFER_KV, Stage.PREFILL_COMPUTE) else None
                b.stages.append(self._child_stage(child, stage, token))
            return b
        self._vllm_token0(b, queue, prefill, ttft is not None)
        scheduled = numbers(a, sc.GEN_AI_LATENCY_PER_TOKEN_SCHEDULED_TIME)
        batch = numbers(a, sc.GEN_AI_ITERATION_PER_TOKEN_BATCH_SIZE, high=MAX_BATCH_SIZE)
        times = b.token_times
        if generated and scheduled and len(scheduled) == len(times):
            for i in range(1, len(times)):
                s = max(times[i - 1], arrival + round(scheduled[i] * 1e9))
                size = int(batch[i]) if batch and len(batch) == len(times) else -1
                b.stages.append(StageInterval(Stage.DECODE_QUEUE, times[i - 1], min(s, times[i]), i))
                b.stages.append(StageInterval(Stage.DECODE_COMPUTE, min(s, times[i]), times[i], i, batch_size=size))
        elif len(times) >= 2:
            b.stages.append(StageInterval(Stage.DECODE_COMPUTE, times[0], times[-1], None))
        return b

    @staticmethod
    def _vllm_token0(b: RequestBuild, queue: int | None, prefill: int | None, has_ttft: bool) -> None:
        arrival, first = b.arrival_ns, b.first_token_ns
        if has_ttft:
            prefill_start = max(arrival, first - (prefill or 0))
            queue_start = max(arrival, prefill_start - (queue or 0))
        else:
            queue_start, prefill_start = arrival, arrival + (queue or 0)
        if queue is not None and prefill_start > queue_start:
            b.stages.append(StageInterval(Stage.SCHEDULE_QUEUE, queue_start, prefill_start, 0))
        if prefill is not None and first > prefill_start:
            b.stages.append(StageInterval(Stage.PREFILL_COMPUTE, prefill_start, first, 0))

    # SGLang -------------------------------------------------------------------------------

    def _sglang(self, root: OtlpSpan, children: list[OtlpSpan]) -> RequestBuild:
        b = self._base(root, str(root.attributes[sc.SGLANG_RID]).split("_")[-1] or root.span_id)
        slices = {c.span_id for c in children}
        first = -1
        for c in children:
            if c.name not in sc.SGLANG_STAGES or c.parent_span_id in slices:
                continue  # a nested slice: its time is inside its parent's
            stage = Stage.from_label(sc.SGLANG_STAGES[c.name])
            b.stages.append(self._child_stage(c, stage, None))
            if c.name in ("prefill_forward", "chunked_prefill", "fake_output"):
                first = max(first, self._to_mono(c.end_unix_ns))  # SGLang emits the first token from it
        if first >= 0:
            b.first_token_ns = first
            b.token_times = [first]
        return b

    # tokentrace ---------------------------------------------------------------------------

    def _tokentrace(self, root: OtlpSpan, children: list[OtlpSpan]) -> RequestBuild:
        a = root.attributes
        key = a.get(sc.GEN_AI_REQUEST_ID)
        b = self._base(root, str(key) if isinstance(key, str) and key else root.span_id)
        status = _STATUS_BY_LABEL.get(str(a.get(sc.TT_STATUS)))
        if status is not None:
            b.status = status
            if status == RequestStatus.OK:
                b.error = ""
        ttft = seconds_ns(a, sc.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN)
        if ttft is not None:
            b.first_token_ns = b.arrival_ns + ttft
        content = unix_ns(a.get(sc.TT_FIRST_CONTENT_UNIX_NS))
        if content is not None:
            b.first_content_ns = self._to_mono(content)
        for c in children:
            self._tokentrace_stage(b, c)
        for e in root.events:
            if e.name == sc.TT_REQUEST_EVENT:
                b.rows.append(self._request_row(e.attributes))
                continue
            if e.name != sc.TOKEN_EVENT:
                continue
            idx = int64(e.attributes, sc.TT_TOKEN_INDEX)
            if idx < 0:
                continue
            t = self._to_mono(e.time_unix_ns)
            kind = e.attributes.get(sc.TT_TOKEN_TIME, "sent")
            rec = self.replicas.by_instance_id(int64(e.attributes, sc.TT_INSTANCE_ID))
            b.token_rows.append(TokenRow(idx, emit_ns=t if kind == "emit" else -1, sent_ns=t if kind == "sent" else -1,
                                         recv_ns=t if kind == "recv" else -1,
                                         step=int64(e.attributes, sc.TT_ENGINE_STEP), recorder=rec))
        return b

    def _request_row(self, ea: Mapping[str, Any]) -> RequestRow:
        def unix(key: str) -> int:
            v = unix_ns(ea.get(key))
            return -1 if v is None else self._to_mono(v)

        status = _STATUS_BY_LABEL.get(str(ea.get(sc.TT_STATUS)), RequestStatus.OK)
        error = ea.get(sc.ERROR_TYPE)
        return RequestRow(
            self.replicas.by_instance_id(int64(ea, sc.TT_INSTANCE_ID)), unix(sc.TT_ARRIVAL_UNIX_NS),
            unix(sc.TT_FINISH_UNIX_NS), unix(sc.TT_FIRST_TOKEN_UNIX_NS), unix(sc.TT_FIRST_CONTENT_UNIX_NS),
            first_str(ea, (sc.TT_TENANT,)), first_str(ea, (sc.TT_SLO_CLASS,)), status,
            str(error)[:64] if isinstance(error, str) else "",
            count(ea, sc.GEN_AI_USAGE_INPUT_TOKENS), count(ea, sc.GEN_AI_USAGE_OUTPUT_TOKENS),
            count(ea, sc.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS), session=first_str(ea, (sc.TT_SESSION,)),
            session_turn=parse_turn(ea.get(sc.TT_SESSION_TURN)))

    def _tokentrace_stage(self, b: RequestBuild, c: OtlpSpan) -> None:
        iv = self._tokentrace_interval(c)
        if iv is not None:
            b.stages.append(iv)

    def _tokentrace_interval(self, c: OtlpSpan) -> StageInterval | None:
        ca = c.attributes
        try:
            stage = Stage.from_label(str(ca.get(sc.TT_STAGE)))
        except ValueError:
            return None
        tier = ca.get(sc.TT_KV_TIER)
        tier_code = Tier[tier.upper()].value if isinstance(tier, str) and tier.upper() in Tier.__members__ else -1
        return StageInterval(
            int(stage), self._to_mono(c.start_unix_ns), self._to_mono(c.end_unix_ns), int64(ca, sc.TT_TOKEN_INDEX),
            step=int64(ca, sc.TT_ENGINE_STEP), num_bytes=int64(ca, sc.TT_BYTES), tier=tier_code,
            batch_size=int64(ca, sc.TT_BATCH_SIZE), recorder=self.replicas.for_resource(c.resource))

    # late children ----------------------------------------------------------------------

    def _late_child(self, done: _Recorded, child: OtlpSpan) -> bool:
        """Record a child that came after its request was recorded; False if it is not one we map."""
        if sc.TT_STAGE in child.attributes:
            iv = self._tokentrace_interval(child)
        elif child.name in sc.VLLM_LIFECYCLE_SPANS:
            iv = self._child_stage(child, Stage.from_label(sc.VLLM_LIFECYCLE_SPANS[child.name]), None)
        elif child.name in sc.SGLANG_STAGES:
            iv = self._child_stage(child, Stage.from_label(sc.SGLANG_STAGES[child.name]), None)
        else:
            iv = None
        if iv is None:
            return False
        rid = request_id_of(done.key, done.tenant)
        target: Recorder = iv.recorder or done.recorder
        pieces = ([(iv.token, iv.start_ns, iv.end_ns)] if iv.token is not None
                  else split_interval(iv, done.arrival_ns, done.bounds))
        for token, start, end in pieces:
            if end > start:
                self.room.take(target, SPANS.name)
                target.span(rid, iv.stage, start, end, token, step=iv.step, num_bytes=iv.num_bytes, tier=iv.tier,
                            batch_size=iv.batch_size)
        return True


@dataclass(frozen=True, slots=True)
class _Recorded:
    """What a late child of a recorded request needs (the request's rows are already written)."""

    key: str
    tenant: str
    recorder: Recorder
    arrival_ns: int
    bounds: list[int]
