"""A serving engine's configuration -> one ``engine_configs`` row, written straight to the recorder's sink.

Used by the reference engine's tracers (``EngineConfig`` read by attribute, as a third-party server's
configuration would be) and by the OTLP ingest (an engine's resource attributes). Light on purpose: it
imports no server.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from tokentrace.recorder import Recorder
from tokentrace.schema import ENGINE_CONFIGS, Role, col

__all__ = ["engine_config_row", "record_engine_config"]


def engine_config_row(config: Any, *, instance_id: int, role: Role) -> dict[str, Any]:
    """The ``engine_configs`` row of a reference engine's ``EngineConfig`` (read by attribute, as a
    third-party server's config would be; a field the config lacks is null or empty)."""
    def count(name: str) -> int | None:
        value = getattr(config, name, None)
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    def flag(name: str) -> int | None:
        value = getattr(config, name, None)
        return int(bool(value)) if isinstance(value, bool) else None

    speculative = getattr(config, "speculative", None) or ""
    return {
        col.INSTANCE_ID: instance_id,
        col.ROLE: int(role),
        col.MAX_NUM_SEQS: count("max_num_seqs"),
        col.MAX_NUM_BATCHED_TOKENS: count("max_num_batched_tokens"),
        col.KV_BLOCK_SIZE: count("block_size"),
        col.NUM_BLOCKS_TOTAL_DEVICE: count("num_device_blocks"),
        col.NUM_BLOCKS_TOTAL_HOST: count("num_host_blocks"),
        col.NUM_BLOCKS_TOTAL_DISK: count("num_disk_blocks"),
        col.SCHEDULING_POLICY: str(getattr(config, "scheduling_policy", "") or ""),
        col.PREEMPTION_MODE: str(getattr(config, "preemption_mode", "") or ""),
        col.CHUNKED_PREFILL: flag("enable_chunked_prefill"),
        col.PREFIX_CACHING: flag("enable_prefix_caching"),
        col.SPECULATIVE_SOURCE: str(speculative).replace("_", "-"),
        col.NUM_SPECULATIVE_TOKENS: (count("num_speculative_tokens") or 0) if speculative else 0,
    }


def record_engine_config(recorder: Recorder, engine: Any, *, role: Role) -> bool:
    """Write ``engine``'s serving configuration (its ``config`` attribute) as one ``engine_configs`` row
    straight to ``recorder``'s sink (a set-up table: no hot-path buffer). Set-up time, any thread; returns
    False, without raising, when the engine exposes no configuration or the sink refuses the row (the run
    then simply has no configuration for this instance)."""
    config = getattr(engine, "config", None)
    if config is None or getattr(config, "max_num_seqs", None) is None:
        return False
    try:
        row = engine_config_row(config, instance_id=recorder.instance_id, role=role)
        batch = pa.RecordBatch.from_pylist([row], schema=ENGINE_CONFIGS.schema)
        recorder.sink.write(ENGINE_CONFIGS, batch)
    except Exception:  # advisory: tracing goes on without it
        return False
    return True
