"""Engine configuration: SLO classes, tenants and the engine's knobs.

All three are frozen values, validated on construction (``ValueError`` naming the
field). The engine reads them once at start; nothing here changes while it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RETENTION_POLICIES = ("lru", "keep", "offload", "drop")
"""KV retention policies between a session's turns (:mod:`reference_server.engine.retention`)."""
from reference_server.model.bundled import resolve_checkpoint

__all__ = [
    "DEFAULT_SLO_CLASSES",
    "DEFAULT_TENANTS",
    "PREEMPTION_MODES",
    "SCHEDULING_POLICIES",
    "SPECULATIVE_SOURCES",
    "EngineConfig",
    "SLOClass",
    "TenantConfig",
]

PREEMPTION_MODES = ("recompute", "swap")
"""``recompute`` drops a victim's KV and recomputes it on resume; ``swap`` copies it to
the host (or disk) tier and back."""

SPECULATIVE_SOURCES = ("model", "ngram", "early_exit")
"""Where speculative proposals come from: a draft model with its own KV cache, n-gram
lookup in the request's own tokens, or the target's first layers (early exit)."""

SCHEDULING_POLICIES = ("fcfs", "slo", "fair")
"""Order of waiting requests: first come first served (baseline), earliest TTFT
deadline first, or weighted-fair by tokens served per tenant."""


@dataclass(frozen=True, slots=True)
class SLOClass:
    """A service-level class: latency targets and a priority.

    ``ttft_ms`` (time to first token) sets the deadline used by the deadline-aware
    policy: ``arrival + ttft_ms``. ``tpot_ms`` (time per output token) is carried for
    analysis (SLO attainment) only. A larger ``priority`` is more important: when KV
    blocks run out, the lowest priority running request is preempted first.
    """

    name: str
    ttft_ms: float
    tpot_ms: float
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("SLOClass.name must be a non-empty string")
        for fname in ("ttft_ms", "tpot_ms"):
            value = getattr(self, fname)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SLOClass.{fname} must be a positive finite number, got {value!r}")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """A tenant: its share of the engine and its quotas.

    ``weight`` is the tenant's share under weighted-fair scheduling (tokens served
    divided by weight is its virtual time). ``max_concurrency`` caps its running
    requests. ``max_tokens_per_s`` is a token bucket on the engine clock charged with
    every token the engine computes for the tenant (prefill and decode); it holds up to
    ``burst_tokens`` (default: one second's worth). A tenant with an empty bucket gets
    nothing scheduled (its running requests pause, keeping their blocks) until it
    refills; a prefill chunk is capped at the tokens left, or, without chunked prefill,
    may overdraw the bucket once. ``None`` means no limit.
    """

    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    max_tokens_per_s: float | None = None
    burst_tokens: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("TenantConfig.name must be a non-empty string")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"TenantConfig.weight must be > 0, got {self.weight!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"TenantConfig.max_concurrency must be >= 1 or None, got {self.max_concurrency!r}")
        for fname in ("max_tokens_per_s", "burst_tokens"):
            value = getattr(self, fname)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"TenantConfig.{fname} must be > 0 or None, got {value!r}")
        if self.burst_tokens is not None and self.max_tokens_per_s is None:
            raise ValueError("TenantConfig.burst_tokens needs max_tokens_per_s")

    @property
    def bucket_capacity(self) -> float | None:
        """Tokens the bucket holds when full (``None`` = unlimited)."""
        if self.max_tokens_per_s is None:
            return None
        return self.burst_tokens if self.burst_tokens is not None else max(self.max_tokens_per_s, 1.0)


DEFAULT_SLO_CLASSES: tuple[SLOClass, ...] = (
    SLOClass("interactive", ttft_ms=500.0, tpot_ms=100.0, priority=1),
    SLOClass("batch", ttft_ms=30_000.0, tpot_ms=1_000.0, priority=0),
)
DEFAULT_TENANTS: tuple[TenantConfig, ...] = (TenantConfig("default"),)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything an :class:`~reference_server.engine.engine.Engine` is built from.

    Block counts are per tier: 0 device (the cache the model reads), 1 host memory,
    2 disk. ``max_model_len`` defaults to the model's context window, capped so that one
    sequence always fits in the device tier (otherwise it could never be scheduled).
    """

    model: str = "tiny"  # ModelConfig preset or bundled model name (model.bundled), ignored when checkpoint is set
    checkpoint: str | None = None  # local HF-format folder
    seed: int = 0  # weight init seed for random models
    device: str | None = None  # None = cuda if available else cpu
    block_size: int = 16  # tokens per KV block
    num_device_blocks: int = 256
    num_host_blocks: int = 0
    num_disk_blocks: int = 0
    disk_path: str | None = None  # None = a temp dir owned by the storage
    max_num_batched_tokens: int = 512  # token budget per step (prefill + decode)
    max_num_seqs: int = 64  # sequences per step
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    fair_share_by: str = "tokens"  # "tokens", "requests" or "compute_time": what the fair policy counts
    offload_on_evict: bool = True  # evicted prefix blocks go to the next lower tier
    prefetch_waiting: bool = True  # bring waiting requests' lower-tier prefixes up early
    max_prefetch_blocks_per_step: int = 16
    watermark_blocks: int = 0  # free device blocks kept back when admitting new requests
    kv_retention: str = "lru"  # a finished session turn's blocks: lru | keep | offload | drop (engine/retention.py)
    kv_retention_ttl_s: float | None = None  # longest a "keep" pin lasts; None = until the next turn
    kv_retention_max_blocks: int | None = None  # most device blocks pinned at once; None = half the device tier
    slo_classes: tuple[SLOClass, ...] = DEFAULT_SLO_CLASSES
    tenants: tuple[TenantConfig, ...] = DEFAULT_TENANTS
    default_tenant: str = "default"
    # speculative decoding (engine/speculative.py)
    speculative: str | None = None  # draft source: model | ngram | early_exit; None = off
    num_speculative_tokens: int = 4  # proposals per request per step (k) while the batch is small
    speculative_budget: int = 16  # proposals per step over the batch: k = min(k, budget // decodes); 0 = off
    speculative_draft_model: str = "trained-draft"  # source "model": a bundled model, preset or checkpoint folder
    speculative_exit_layer: int = 2  # source "early_exit": target layers the draft runs
    speculative_ngram_min: int = 2  # source "ngram": shortest suffix looked up (of 3 down to this)

    def __post_init__(self) -> None:
        positive = ("block_size", "num_device_blocks", "max_num_batched_tokens", "max_num_seqs")
        for fname in positive:
            if getattr(self, fname) < 1:
                raise ValueError(f"EngineConfig.{fname} must be >= 1, got {getattr(self, fname)!r}")
        for fname in ("num_host_blocks", "num_disk_blocks", "max_prefetch_blocks_per_step", "watermark_blocks"):
            if getattr(self, fname) < 0:
                raise ValueError(f"EngineConfig.{fname} must be >= 0, got {getattr(self, fname)!r}")
        if self.kv_retention not in RETENTION_POLICIES:
            raise ValueError(f"EngineConfig.kv_retention must be one of {RETENTION_POLICIES}, got {self.kv_retention!r}")
        if self.kv_retention_ttl_s is not None and not self.kv_retention_ttl_s > 0:
            raise ValueError(f"EngineConfig.kv_retention_ttl_s must be positive, got {self.kv_retention_ttl_s!r}")
        if self.kv_retention_max_blocks is not None and self.kv_retention_max_blocks < 0:
            raise ValueError(f"EngineConfig.kv_retention_max_blocks must be >= 0, got {self.kv_retention_max_blocks!r}")
        if self.watermark_blocks >= self.num_device_blocks:
            raise ValueError("EngineConfig.watermark_blocks must be smaller than num_device_blocks")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"EngineConfig.preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"EngineConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.fair_share_by not in ("tokens", "requests", "compute_time"):
            raise ValueError(
                f"EngineConfig.fair_share_by must be tokens, requests or compute_time, got {self.fair_share_by!r}"
            )
        _check_unique("slo_classes", [c.name for c in self.slo_classes])
        _check_unique("tenants", [t.name for t in self.tenants])
        if not self.slo_classes:
            raise ValueError("EngineConfig.slo_classes must not be empty")
        if self.default_tenant not in {t.name for t in self.tenants}:
            raise ValueError(f"EngineConfig.default_tenant {self.default_tenant!r} is not among tenants")
        if self.speculative is not None and self.speculative not in SPECULATIVE_SOURCES:
            raise ValueError(
                f"EngineConfig.speculative must be one of {SPECULATIVE_SOURCES} or None, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"EngineConfig.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens!r}")
        if self.speculative_budget < 0:
            raise ValueError(f"EngineConfig.speculative_budget must be >= 0, got {self.speculative_budget!r}")
        if not 1 <= self.speculative_ngram_min <= 3:
            raise ValueError(f"EngineConfig.speculative_ngram_min must be in [1, 3], got {self.speculative_ngram_min!r}")
        if self.speculative_exit_layer < 1:
            raise ValueError(f"EngineConfig.speculative_exit_layer must be >= 1, got {self.speculative_exit_layer!r}")

    @property
    def checkpoint_path(self) -> str | None:
        """The checkpoint folder to load: ``checkpoint``, else a bundled model's folder
        (``model="trained"``), else None (a preset with seeded random weights)."""
        return resolve_checkpoint(self.model, self.checkpoint)

    def resolve_max_model_len(self, context_window: int) -> int:
        """Longest sequence (prompt + output tokens) the engine accepts."""
        limit = min(context_window, self.num_device_blocks * self.block_size)
        if not self.enable_chunked_prefill:
            limit = min(limit, self.max_num_batched_tokens)
        if self.max_model_len is not None:
            limit = min(limit, self.max_model_len)
        return limit

    def slo_class(self, name: str) -> SLOClass:
        """The class named ``name``; ``ValueError`` listing the known ones otherwise."""
        for cls in self.slo_classes:
            if cls.name == name:
                return cls
        known = ", ".join(c.name for c in self.slo_classes)
        raise ValueError(f"unknown slo_class {name!r}; known classes: {known}")

    def tenant(self, name: str) -> TenantConfig:
        """The tenant named ``name``; ``ValueError`` listing the known ones otherwise."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        known = ", ".join(t.name for t in self.tenants)
        raise ValueError(f"unknown tenant {name!r}; known tenants: {known}")


def _check_unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"EngineConfig.{what} has a duplicate name {name!r}")
        seen.add(name)
