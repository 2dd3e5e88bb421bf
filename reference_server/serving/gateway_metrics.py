"""Prometheus metrics of the gateway, in a registry of its own (one per app).

Latency histograms are named after the OpenTelemetry GenAI semantic conventions with the
dots turned into underscores and the unit appended, as Prometheus requires:

* ``gen_ai_server_time_to_first_token_seconds``: arrival of the request -> its first token
  written to the client (non-streaming: received by the gateway);
* ``gen_ai_server_time_per_output_token_seconds``: between consecutive output tokens
  (inter-token latency), one observation per token after the first;
* ``gen_ai_server_request_duration_seconds``: arrival -> the last byte of the answer.

Their labels: ``gen_ai_operation_name`` (text_completion / chat), ``gen_ai_request_model``,
``tenant``, ``slo_class``. Token counts go to ``gen_ai_server_prompt_tokens_total`` and
``gen_ai_server_output_tokens_total``; requests to ``gateway_requests_total{endpoint,
status, outcome}``.

The backend's state is read at scrape time from ``backend.stats()``: gauges
``reference_server_num_requests_{waiting,running,preempted}{instance,role}``,
``reference_server_kv_blocks_{used,total}{instance,role,tier}``,
``reference_server_instance_up{instance,role}``, and counters
``reference_server_prefix_cache_{query,hit}_tokens_total{instance,role}``,
``reference_server_kv_transfer_{sent,received}_bytes_total{instance,role}``,
``reference_server_redispatched_requests_total``. A dead instance keeps only its ``up``
gauge (0): its last reported queue lengths, KV blocks and counters describe a process that
is gone (a restarted one starts its counters afresh).

:meth:`GatewayMetrics.render_tenant` is what one tenant's key may read: the series
labelled with that tenant, nothing about other tenants or the backend.

All methods run on the event-loop thread (``backend.stats()`` requires it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["GatewayMetrics", "TIER_NAMES"]

TIER_NAMES = ("device", "host", "disk")  # index order of the backend's per-tier tuples
_LATENCY_LABELS = ("gen_ai_operation_name", "gen_ai_request_model", "tenant", "slo_class")
# Buckets follow the OpenTelemetry GenAI recommendations, extended downwards for a CPU model.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)


class GatewayMetrics:
    """The metric objects of one gateway; ``render()`` gives the exposition text."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        """``stats``: the backend's ``stats`` method (called at each scrape)."""
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
                              "Time from request arrival to its first output token (gen_ai.server.time_to_first_token)",
                              _LATENCY_LABELS, buckets=_TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
                              "Time between consecutive output tokens (gen_ai.server.time_per_output_token)",
                              _LATENCY_LABELS, buckets=_TPOT_BUCKETS, registry=reg)
        self.duration = Histogram("gen_ai_server_request_duration_seconds",
                                  "Time from request arrival to the end of its answer (gen_ai.server.request.duration)",
                                  _LATENCY_LABELS, buckets=_DURATION_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("gen_ai_server_prompt_tokens", "Prompt tokens of answered requests",
                                     _LATENCY_LABELS, registry=reg)
        self.output_tokens = Counter("gen_ai_server_output_tokens", "Output tokens sent",
                                     _LATENCY_LABELS, registry=reg)
        self.requests = Counter("gateway_requests", "Requests by endpoint, HTTP status and outcome "
                                "(stop, length, aborted, error, rejected)",
                                ("endpoint", "status", "outcome"), registry=reg)
        reg.register(_BackendCollector(stats))

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)

    def render_tenant(self, tenant: str) -> bytes:
        """Only the samples labelled ``tenant=<tenant>``, in Prometheus text format."""
        return generate_latest(_TenantView(self.registry, tenant))  # type: ignore[arg-type]


class _TenantView:
    """A registry-like view (``collect``) keeping one tenant's samples."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self._registry, self._tenant = registry, tenant

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            samples = [s for s in family.samples if s.labels.get("tenant") == self._tenant]
            if samples:
                kept = Metric(family.name, family.documentation, family.type, family.unit)
                kept.samples = samples
                yield kept


class _BackendCollector(Collector):
    """Turns one ``BackendStats`` snapshot into gauges and counters at scrape time."""

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # metrics depend on the instances alive at scrape time

    def collect(self) -> Iterator[Metric]:
        snapshot = self._stats()
        inst_labels = ("instance", "role")
        tier_labels = ("instance", "role", "tier")
        families = {
            "up": GaugeMetricFamily("reference_server_instance_up", "1 when the instance is alive",
                                    labels=inst_labels),
            "waiting": GaugeMetricFamily("reference_server_num_requests_waiting", "Requests in the waiting queue",
                                         labels=inst_labels),
            "running": GaugeMetricFamily("reference_server_num_requests_running", "Requests being computed",
                                         labels=inst_labels),
            "preempted": GaugeMetricFamily("reference_server_num_requests_preempted", "Preempted requests",
                                           labels=inst_labels),
            "used": GaugeMetricFamily("reference_server_kv_blocks_used", "KV blocks held by requests, per tier",
                                      labels=tier_labels),
            "total": GaugeMetricFamily("reference_server_kv_blocks_total", "KV blocks in the pool, per tier",
                                       labels=tier_labels),
            "query": CounterMetricFamily("reference_server_prefix_cache_query_tokens",
                                         "Prompt tokens looked up in the prefix cache", labels=inst_labels),
            "hit": CounterMetricFamily("reference_server_prefix_cache_hit_tokens",
                                       "Prompt tokens found in the prefix cache", labels=inst_labels),
            "sent": CounterMetricFamily("reference_server_kv_transfer_sent_bytes",
                                        "KV transfer payload bytes sent", labels=inst_labels),
            "received": CounterMetricFamily("reference_server_kv_transfer_received_bytes",
                                            "KV transfer payload bytes received", labels=inst_labels),
        }
        for inst in snapshot.instances:
            labels = [inst.name, inst.role]
            families["up"].add_metric(labels, 1.0 if inst.alive else 0.0)
            if not inst.alive:  # its last reported gauges describe a process that is gone
                continue
            families["waiting"].add_metric(labels, inst.num_waiting)
            families["running"].add_metric(labels, inst.num_running)
            families["preempted"].add_metric(labels, inst.num_preempted)
            for tier, name in enumerate(TIER_NAMES):
                families["used"].add_metric([*labels, name], inst.num_blocks_used[tier])
                families["total"].add_metric([*labels, name], inst.num_blocks_total[tier])
            families["query"].add_metric(labels, inst.num_prefix_query_tokens)
            families["hit"].add_metric(labels, inst.num_prefix_hit_tokens)
            families["sent"].add_metric(labels, inst.num_kv_bytes_sent)
            families["received"].add_metric(labels, inst.num_kv_bytes_received)
        yield from families.values()
        redispatched = CounterMetricFamily("reference_server_redispatched_requests",
                                           "Requests sent again after their worker died")
        redispatched.add_metric([], snapshot.num_redispatched)
        yield redispatched
