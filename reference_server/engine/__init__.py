"""The engine side of the reference server: KV block manager, scheduler, engine loop.

Public API:

* :class:`EngineConfig`, :class:`TenantConfig`, :class:`SLOClass`;
* :class:`Engine` (``add_request`` / ``abort`` / ``step`` / ``generate`` / ``stats``),
  :class:`EngineLoop` (the engine stepped on a background thread, fed through an inbox)
  and :class:`AsyncEngine` (async token streams over an ``EngineLoop``);
* :class:`EngineObserver` and the event types of :mod:`reference_server.engine.hooks`;
* :class:`BlockManager`, :class:`Scheduler` and the named policies of
  :mod:`reference_server.engine.cache_policies` and
  :mod:`reference_server.engine.scheduling_policies`, usable without a model.
"""

from __future__ import annotations

from reference_server.engine.async_engine import AsyncEngine
from reference_server.engine.block_manager import BlockManager, BlockUsage, CopyOp, KVBlocks
from reference_server.engine.cache_policies import (
    DropOnEvict,
    LRUEviction,
    NoPrefetch,
    OffloadOnEvict,
    PrefetchWaitingPrefixes,
    WatermarkAdmission,
)
from reference_server.engine.config import DEFAULT_SLO_CLASSES, EngineConfig, SLOClass, TenantConfig
from reference_server.engine.engine import Engine
from reference_server.engine.engine_loop import EngineLoop, EngineStoppedError, RequestSink
from reference_server.engine.hooks import EngineObserver, RecordingObserver
from reference_server.engine.outputs import Completion, EngineStats, RequestOutput, TokenDelta
from reference_server.engine.prefix_cache import PrefixMatch
from reference_server.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from reference_server.engine.scheduling_policies import FCFSPolicy, SLODeadlinePolicy, WeightedFairPolicy
from reference_server.engine.sequence import FinishReason, PreemptionMode, Sequence, SequenceStatus

__all__ = [
    "DEFAULT_SLO_CLASSES", "AsyncEngine", "BlockManager", "BlockUsage", "Completion", "CopyOp", "DropOnEvict",
    "Engine", "EngineConfig", "EngineLoop", "EngineObserver", "EngineStats", "EngineStoppedError", "FCFSPolicy",
    "FinishReason", "KVBlocks", "LRUEviction", "NoPrefetch", "OffloadOnEvict", "PreemptionMode",
    "PrefetchWaitingPrefixes", "PrefixMatch", "RecordingObserver", "RequestOutput", "RequestSink", "SLOClass",
    "SLODeadlinePolicy", "ScheduledChunk", "Scheduler", "SchedulerOutput", "Sequence", "SequenceStatus",
    "TenantConfig", "TokenDelta", "WatermarkAdmission", "WeightedFairPolicy",
]
