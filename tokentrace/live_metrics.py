"""Live Prometheus exposition from a traced process (``instrument(metrics_port=...)``,
``tokentrace run --metrics-port``).

:class:`MetricsRecorder` sits in front of the process's recorder: every event goes through
unchanged, and as each token is delivered the token's interval (token 0: arrival -> first
token; token i: delivery i-1 -> delivery i) is split into the stages this process recorded for
it, as the stage breakdown splits it (spans clipped to the interval; time no span covers is
``unattributed``, time claimed twice ``overlap``). A token is evaluated when the next one is
delivered or the request ends, so spans recorded just after the delivery still count.
:func:`serve_metrics` serves the registry over HTTP (``/metrics``, the text exposition format).

Metrics (names as the OpenTelemetry GenAI semantic conventions' server metrics, in Prometheus
form, and vLLM's ``vllm:*`` histograms for the same quantities; buckets as vLLM's):

* ``gen_ai_server_time_to_first_token_seconds`` (histogram): arrival -> first token delivered;
* ``gen_ai_server_time_per_output_token_seconds`` (histogram): each later token's latency (ITL);
* ``gen_ai_server_request_duration_seconds`` (histogram): arrival -> finish;
* ``tokentrace_ttft_stage_seconds{stage}`` and ``tokentrace_itl_stage_seconds{stage}``
  (histograms, one observation per request / per token and stage, ``unattributed`` and
  ``overlap`` among the stages): where this process's share of TTFT and ITL went;
* ``tokentrace_requests_total{status}`` (counter) and ``tokentrace_dropped_events_total``
  (the recorder's ``dropped`` counter: events lost to the memory bound).

What a process measures is its own view: a gateway that hands requests to worker processes
sees their time as ``unattributed``; the store's breakdown joins every process. Cost: a lock
and a few dictionary operations per event, plus one histogram observation per stage per
token; opt-in, never on by default.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from tokentrace.recorder import ForwardingRecorder, Recorder
from tokentrace.schema import UNATTRIBUTED_LABEL, RequestStatus, Stage

__all__ = ["MetricsRecorder", "serve_metrics", "MetricsServer", "OVERLAP_LABEL", "TTFT_BUCKETS_S", "ITL_BUCKETS_S",
           "STAGE_BUCKETS_S", "MAX_OPEN_REQUESTS"]

log = logging.getLogger("tokentrace")

OVERLAP_LABEL = "overlap"
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's ``vllm:time_to_first_token_seconds`` buckets."""
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
"""vLLM's ``vllm:inter_token_latency_seconds`` buckets."""
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's ``vllm:e2e_request_latency_seconds`` buckets."""
STAGE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0, 30.0)
"""Finer than the latency buckets: one stage is often well under a millisecond."""
MAX_OPEN_REQUESTS = 100_000
"""Requests followed at once; later ones pass through unmeasured (``tokentrace_untracked_requests_total``)."""
MAX_SPANS_PER_TOKEN = 256


@dataclass(slots=True)
class _Open:
    arrival: int | None
    last: int | None = None  # delivery of the latest token (this process's clock, ns)
    pending: tuple[int, int, int] | None = None  # (token, start, end) delivered, not yet evaluated
    spans: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)  # token -> (stage, start, end)


def _metrics(registry: Any) -> dict[str, Any]:
    from prometheus_client import Counter, Histogram

    return {
        "ttft": Histogram("gen_ai_server_time_to_first_token_seconds", "Time to first token: arrival to first "
                          "token delivered (OTel gen_ai.server.time_to_first_token).", buckets=TTFT_BUCKETS_S,
                          registry=registry),
        "tpot": Histogram("gen_ai_server_time_per_output_token_seconds", "Latency of each output token after the "
                          "first (OTel gen_ai.server.time_per_output_token).", buckets=ITL_BUCKETS_S,
                          registry=registry),
        "e2e": Histogram("gen_ai_server_request_duration_seconds", "Arrival to finish of a request "
                         "(OTel gen_ai.server.request.duration).", buckets=E2E_BUCKETS_S, registry=registry),
        "ttft_stage": Histogram("tokentrace_ttft_stage_seconds", "Time of each stage within a request's first-token "
                                "interval, unattributed and overlap included.", ["stage"], buckets=STAGE_BUCKETS_S,
                                registry=registry),
        "itl_stage": Histogram("tokentrace_itl_stage_seconds", "Time of each stage within a later token's interval, "
                               "unattributed and overlap included.", ["stage"], buckets=STAGE_BUCKETS_S,
                               registry=registry),
        "requests": Counter("tokentrace_requests", "Requests finished, by status.", ["status"], registry=registry),
        "untracked": Counter("tokentrace_untracked_requests", "Requests past the open-request bound, not measured.",
                             registry=registry),
    }


class MetricsRecorder(ForwardingRecorder):
    """A :class:`~tokentrace.recorder.Recorder` that forwards to ``inner`` and keeps live metrics.

    ``registry``: a ``prometheus_client.CollectorRegistry`` (default: a new one, so two traced
    components in one process never clash). Any thread; never raises into the caller (a failure
    in the metrics is logged once and the event still goes through).
    """

    def __init__(self, inner: Recorder, *, registry: Any = None) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.core import CounterMetricFamily

        super().__init__(inner)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._m = _metrics(self.registry)
        self._open: dict[int, _Open] = {}
        self._lock = threading.Lock()
        self._warned = False
        self._uses_sent = False  # set once this process records a send time (it streams to clients)
        self.server: MetricsServer | None = None

        class _Dropped:
            def collect(self) -> Any:  # prometheus_client's collector protocol
                family = CounterMetricFamily("tokentrace_dropped_events", "Events the recorder dropped "
                                             "(memory bound or invalid values).")
                counters = inner.counters
                family.add_metric([], float(counters.get("dropped", 0) + counters.get("dropped_invalid", 0)))
                yield family

        self.registry.register(_Dropped())

    # -- the events that feed the metrics

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        rid = self.inner.request_begin(key, tenant=tenant, slo_class=slo_class, arrival_ns=arrival_ns,
                                       num_prompt_tokens=num_prompt_tokens, trace_id=trace_id,
                                       session=session, session_turn=session_turn)
        self._guard(self._begin, rid, arrival_ns)
        return rid

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        self.inner.span(request_id, stage, start_ns, end_ns, token_index, step, num_bytes, tier, batch_size)
        if token_index >= 0:
            self._guard(self._span, request_id, stage, start_ns, end_ns, token_index)

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        self.inner.token(request_id, token_index, emit_ns=emit_ns, sent_ns=sent_ns, recv_ns=recv_ns, step=step)
        if sent_ns >= 0:
            self._uses_sent = True  # this process streams: a token is delivered when it is sent
            self._guard(self._deliver, request_id, token_index, sent_ns, True)
        elif not self._uses_sent and (emit_ns >= 0 or recv_ns >= 0):
            self._guard(self._deliver, request_id, token_index, emit_ns if emit_ns >= 0 else recv_ns, False)

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1,
                    num_cached_tokens: int = -1, error: str = "", first_content_ns: int = -1) -> None:
        self.inner.request_end(request_id, finish_ns=finish_ns, status=status, first_token_ns=first_token_ns,
                               num_output_tokens=num_output_tokens, num_cached_tokens=num_cached_tokens,
                               error=error, first_content_ns=first_content_ns)
        self._guard(self._end, request_id, finish_ns, status)

    # -- everything else passes through (ForwardingRecorder); stage_begin/stage_end pairs are kept by the
    # inner recorder: live metrics see spans only

    def close(self) -> None:
        """Stop serving (if :func:`serve_metrics` started a server) and close the inner recorder."""
        if self.server is not None:
            self.server.stop()
        self.inner.close()

    # -- bookkeeping (under the lock)

    def _guard(self, fn: Any, *args: Any) -> None:
        try:
            with self._lock:
                fn(*args)
        except Exception as err:  # never into the traced program
            if not self._warned:
                self._warned = True
                log.warning("tokentrace: live metrics failed (%s); events are still recorded", err)

    def _get(self, rid: int, arrival: int | None = None) -> _Open | None:
        state = self._open.get(rid)
        if state is None:
            if len(self._open) >= MAX_OPEN_REQUESTS:
                self._m["untracked"].inc()
                return None
            state = self._open[rid] = _Open(arrival)
        return state

    def _begin(self, rid: int, arrival: int) -> None:
        state = self._get(rid, arrival if arrival >= 0 else None)
        if state is not None and state.arrival is None and arrival >= 0:
            state.arrival = arrival

    def _span(self, rid: int, stage: int, start: int, end: int, token: int) -> None:
        state = self._get(rid)
        if state is not None:
            spans = state.spans.setdefault(token, [])
            if len(spans) < MAX_SPANS_PER_TOKEN:
                spans.append((stage, start, end))

    def _deliver(self, rid: int, token: int, t: int, sent: bool) -> None:
        state = self._get(rid)
        if state is None:
            return
        if state.pending is not None and state.pending[0] == token and sent:
            state.pending = (token, state.pending[1], max(t, state.pending[1]))  # its send replaces its emit
            state.last = t
            return
        if state.pending is not None and state.pending[0] >= token:
            return  # a second view of a token already delivered
        if state.pending is not None:
            self._evaluate(state, *state.pending)
        start = state.arrival if token == 0 else state.last
        state.pending = (token, start, t) if start is not None and t >= start else None
        state.last = t

    def _end(self, rid: int, finish: int, status: int) -> None:
        state = self._open.pop(rid, None)
        if state is not None:
            if state.pending is not None:
                self._evaluate(state, *state.pending)
            if state.arrival is not None and finish >= state.arrival:
                self._m["e2e"].observe((finish - state.arrival) / 1e9)
        try:
            label = RequestStatus(status).label
        except ValueError:
            label = str(status)
        self._m["requests"].labels(label).inc()

    def _evaluate(self, state: _Open, token: int, start: int, end: int) -> None:
        """Observe token ``token``'s latency ``(start, end]`` and how its stages split it."""
        length = end - start
        (self._m["ttft"] if token == 0 else self._m["tpot"]).observe(length / 1e9)
        pieces = []
        per_stage: dict[int, int] = {}
        for stage, a, b in state.spans.pop(token, ()):
            a, b = max(a, start), min(b, end)
            if b > a:
                pieces.append((a, b))
                per_stage[stage] = per_stage.get(stage, 0) + b - a
        covered, reach = 0, start
        for a, b in sorted(pieces):
            if b > reach:
                covered += b - max(a, reach)
                reach = b
        hist = self._m["ttft_stage" if token == 0 else "itl_stage"]
        for stage, ns in per_stage.items():
            hist.labels(Stage(stage).label).observe(ns / 1e9)
        hist.labels(UNATTRIBUTED_LABEL).observe((length - covered) / 1e9)
        hist.labels(OVERLAP_LABEL).observe((sum(per_stage.values()) - covered) / 1e9)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint."""

    host: str
    port: int
    _server: Any
    _thread: Any

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(recorder: MetricsRecorder, *, port: int, host: str = "127.0.0.1", tries: int = 16) -> MetricsServer:
    """Serve ``recorder``'s registry on ``host:port`` in a daemon thread; port 0 picks a free one.

    A taken port moves on to the next (up to ``tries`` ports), so the processes of one
    ``tokentrace run`` (a gateway and its workers) each get one: ``port``, ``port + 1``, ...
    Raises ``OSError`` naming the range when none is free.
    """
    from prometheus_client import start_http_server

    last: OSError | None = None
    for candidate in ([0] if port == 0 else range(port, min(port + tries, 65536))):
        try:
            server, thread = start_http_server(candidate, addr=host, registry=recorder.registry)
        except OSError as err:
            last = err
            continue
        bound = MetricsServer(host, server.server_address[1], server, thread)
        recorder.server = bound
        log.info("tokentrace: live metrics at %s", bound.url)
        return bound
    raise OSError(getattr(last, "errno", None), f"cannot serve metrics on {host}:{port}..{port + tries - 1}: "
                                                f"{getattr(last, 'strerror', None) or last}")
