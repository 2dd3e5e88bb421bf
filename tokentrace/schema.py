"""The contract: every table, column, unit, clock and stage of a tokentrace store.

This module is the single place that names columns and stages. Everything else
refers to them through the constants defined here (``col.START_NS``,
``SPANS.schema``, ``Stage.PREFILL_COMPUTE``), never by spelling a column name as
a string literal; ``tests/tokentrace/test_schema.py`` enforces that.

Conventions
-----------
* Times are integer nanoseconds (``*_ns``). Unless a column says otherwise they
  are on the *recording process's monotonic clock* (``time.monotonic_ns()``).
  The ``instances`` table gives, per process, the offset that maps that clock
  onto the run's reference clock: ``t_ref = t_local + clock_offset_ns``.
* Sizes are bytes (``*_bytes``); counts start with ``num_``.
* Identifiers are integers. ``request_id`` is a stable 63-bit hash of the
  server's own request id string (see :func:`request_id_of`), so every process
  derives the same integer without coordination; the string itself is kept once
  per request in ``requests.request_key``.
* An integer column marked *nullable* uses ``NULL_INT`` (-1) as "absent" in the
  recorder's buffers; writers turn it into a Parquet null.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Iterator

import pyarrow as pa

__all__ = [
    "DEFAULT_TENANT",
    "MAX_LABEL_CHARS",
    "cap_label",
    "SCHEMA_VERSION",
    "MIN_READABLE_SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "NULL_INT",
    "Stage",
    "Role",
    "Tier",
    "CacheEventKind",
    "RequestStatus",
    "DraftSource",
    "Column",
    "Table",
    "col",
    "REQUESTS",
    "SPANS",
    "TOKENS",
    "STEPS",
    "CACHE_EVENTS",
    "LOOP_LAGS",
    "SPEC_STEPS",
    "INSTANCES",
    "ENGINE_CONFIGS",
    "SETUP_TABLES",
    "RUN_COLUMN",
    "TABLES",
    "table",
    "request_id_of",
    "column_names",
]

SCHEMA_VERSION = 6
"""Version of the on-disk layout; written into every Parquet file's metadata.

2: stages ``gateway.accept`` and ``stream.relay``; ``requests.first_content_ns``
(files of version 1 read it as null); table ``loop_lags``.
3: stages ``decode.draft`` and ``decode.verify``; table ``spec_steps`` (speculative decoding);
``requests.session_name`` and ``requests.session_turn`` (files of version 2 read them as null);
cache event kinds ``retain``, ``drop`` and ``carry``.
4: table ``engine_configs`` (each engine instance's serving configuration); runs written before it have
none, and readers see it as an empty table.
5: cache event kind ``miss_evicted`` (a prefix lookup's blocks the cache held once and evicted); runs
written before it have none.
6: ``loop_lags.armed_ns``, ``loop_lags.loop_cpu_ns`` and ``loop_lags.process_cpu_ns`` (the CPU time the loop's
thread and its process used while the tick waited; files of version 5 and older read them as null)."""

MIN_READABLE_SCHEMA_VERSION = 0
"""Oldest version readers still accept (version 0 is the pre-release layout)."""

SCHEMA_VERSION_KEY = b"tokentrace.schema_version"
"""Parquet key-value metadata key that holds :data:`SCHEMA_VERSION`."""

TABLE_NAME_KEY = b"tokentrace.table"
"""Parquet key-value metadata key that holds the table's name."""

NULL_INT = -1
"""Sentinel for "absent" in nullable integer columns while events sit in buffers."""


# --------------------------------------------------------------------------- enums


class Stage(enum.IntEnum):
    """The seventeen stages a request's (and each token's) time is split into.

    Each stage is an interval ``[start_ns, end_ns)``. For one request the stage
    intervals tile its lifetime without overlap; for one output token they tile
    that token's interval (token 0: arrival -> first token sent; token i:
    sent(i-1) -> sent(i)). Time no stage covers is reported as *unattributed*.
    Iteration order (definition order) is the pipeline's order; the integer
    values are what files store, so a new stage takes the next free value.
    """

    GATEWAY_ACCEPT = 13
    """The server read the request's first bytes -> the app received the request (parsing, a busy event loop)."""
    GATEWAY_RECEIVE = 0
    """Request bytes arrive -> request parsed and validated."""
    GATEWAY_TOKENIZE = 1
    """Prompt / chat template -> token ids."""
    GATEWAY_ROUTE = 2
    """Choose the instance (prefix- or load-aware) and hand the request over."""
    SCHEDULE_QUEUE = 3
    """Waiting for admission (queue position, no free KV blocks, tenant quota)."""
    CACHE_LOOKUP = 4
    """Prefix-cache match on block hashes."""
    CACHE_LOAD = 5
    """Cached KV brought up from a lower tier (host memory, disk, remote)."""
    PREFILL_COMPUTE = 6
    """A prefill forward pass; each chunk of a chunked prefill is its own interval."""
    TRANSFER_KV = 7
    """KV blocks moved from the prefill instance to the decode instance."""
    DECODE_QUEUE = 8
    """A token waits for the step that will produce it (batch formation, other requests' prefill chunks)."""
    DECODE_DRAFT = 15
    """The draft proposals of this request's speculative step: draft-model forward passes, early-exit layers, or
    n-gram prompt lookup. Only the first token a speculative step emits carries it (see docs/stages.md)."""
    DECODE_VERIFY = 16
    """The target model's verify pass of a speculative step, which checks the k proposals and emits the accepted
    ones plus one. Only the first token a speculative step emits carries it."""
    DECODE_COMPUTE = 9
    """The forward step that produced the token (shared by the batch)."""
    SCHEDULE_PREEMPTED = 10
    """The request is preempted (swapped out or evicted for recompute) until resumed."""
    DETOKENIZE = 11
    """Token id -> text delta."""
    STREAM_RELAY = 14
    """The token travels from the engine to the process that streams it (thread hand-off or socket frame)."""
    STREAM_SEND = 12
    """The delta is written to the client stream."""

    @property
    def label(self) -> str:
        """The dotted name used in reports and budgets, e.g. ``prefill.compute``."""
        return _STAGE_LABELS[self]

    @classmethod
    def from_label(cls, label: str) -> "Stage":
        """Parse a dotted stage name; raises ``ValueError`` naming the valid ones."""
        try:
            return _STAGES_BY_LABEL[label]
        except KeyError:
            valid = ", ".join(_STAGE_LABELS.values())
            raise ValueError(f"unknown stage {label!r}; valid stages: {valid}") from None


_STAGE_LABELS: dict[Stage, str] = {
    Stage.GATEWAY_ACCEPT: "gateway.accept",
    Stage.GATEWAY_RECEIVE: "gateway.receive",
    Stage.GATEWAY_TOKENIZE: "gateway.tokenize",
    Stage.GATEWAY_ROUTE: "gateway.route",
    Stage.SCHEDULE_QUEUE: "schedule.queue",
    Stage.CACHE_LOOKUP: "cache.lookup",
    Stage.CACHE_LOAD: "cache.load",
    Stage.PREFILL_COMPUTE: "prefill.compute",
    Stage.TRANSFER_KV: "transfer.kv",
    Stage.DECODE_QUEUE: "decode.queue",
    Stage.DECODE_DRAFT: "decode.draft",
    Stage.DECODE_VERIFY: "decode.verify",
    Stage.DECODE_COMPUTE: "decode.compute",
    Stage.SCHEDULE_PREEMPTED: "schedule.preempted",
    Stage.DETOKENIZE: "detokenize",
    Stage.STREAM_RELAY: "stream.relay",
    Stage.STREAM_SEND: "stream.send",
}
_STAGES_BY_LABEL: dict[str, Stage] = {v: k for k, v in _STAGE_LABELS.items()}

UNATTRIBUTED_LABEL = "unattributed"
"""Name under which analyzers report time no stage covers."""


class Role(enum.IntEnum):
    """What a traced process does in the deployment."""

    GATEWAY = 0
    PREFILL = 1
    DECODE = 2
    COLOCATED = 3
    """One engine that does both prefill and decode."""
    CLIENT = 4
    """The load generator: client-side ground truth."""
    OTHER = 5

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def from_label(cls, label: str) -> "Role":
        try:
            return cls[label.upper()]
        except KeyError:
            valid = ", ".join(r.label for r in cls)
            raise ValueError(f"unknown role {label!r}; valid roles: {valid}") from None


class Tier(enum.IntEnum):
    """Where KV cache blocks live."""

    DEVICE = 0
    """Accelerator memory (or the primary pool on a CPU-only engine)."""
    HOST = 1
    """Host (CPU) memory pool."""
    DISK = 2
    """Local disk pool."""
    REMOTE = 3
    """Another instance (e.g. a prefill worker's cache)."""

    @property
    def label(self) -> str:
        return self.name.lower()


class CacheEventKind(enum.IntEnum):
    """What happened to KV cache blocks."""

    HIT = 0
    """Prefix blocks found (``num_tokens`` cached tokens) in ``tier``."""
    MISS = 1
    """Prefix lookup that found nothing for the remaining blocks."""
    EVICT = 2
    """Cached free blocks dropped from ``tier`` to make room."""
    SWAP_OUT = 3
    """A preempted request's blocks copied down from ``tier`` to a lower tier."""
    SWAP_IN = 4
    """A resumed request's blocks copied back up into ``tier``."""
    OFFLOAD = 5
    """Evicted prefix blocks copied to a lower tier for later reuse."""
    LOAD = 6
    """Offloaded prefix blocks brought back up instead of recomputed."""
    PREFETCH = 7
    """Blocks loaded ahead of need."""
    RETAIN = 8
    """A finished session turn's blocks held in ``tier`` for the session's next turn by the
    retention policy: ``[turn end, release)``, released by the next turn's admission, the
    policy's TTL, its capacity bound or the device tier running short. ``request_id``: the finished turn."""
    DROP = 9
    """A finished session turn's cached blocks removed from ``tier`` by the retention policy
    at the turn's end (after an offload their copies live one tier down). ``request_id``: the finished turn."""
    CARRY = 10
    """At a session turn's admission: the leading prompt blocks (``num_blocks``, ``event_num_tokens``)
    whose KV the session's previous turn had computed, whether or not they are still cached.
    Carried minus hit blocks is what the think time cost. ``request_id``: the new turn."""
    MISS_EVICTED = 11
    """At a prefix lookup: the leading prompt blocks right after those found (``num_blocks``,
    ``event_num_tokens``) that the cache held once, an earlier request having computed them, and
    has since evicted from every tier; the request computes them again. ``request_id``: the
    request looked up. Recorded by tracers whose engine remembers evicted block hashes."""

    @property
    def label(self) -> str:
        return self.name.lower()


class RequestStatus(enum.IntEnum):
    """How a request ended."""

    OK = 0
    ERROR = 1
    ABORTED = 2
    """Cancelled, e.g. the client disconnected."""
    TIMEOUT = 3
    REJECTED = 4
    """Refused before admission (bad input, quota, auth)."""

    @property
    def label(self) -> str:
        return self.name.lower()


class DraftSource(enum.IntEnum):
    """Where a speculative step's proposals came from."""

    MODEL = 0
    """A smaller draft model, run autoregressively with its own KV cache."""
    NGRAM = 1
    """N-gram prompt lookup: the continuation of the last n-gram's earlier occurrence in the context."""
    EARLY_EXIT = 2
    """The target model's own first layers (self-speculative early exit)."""

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", "-")


# --------------------------------------------------------------------------- columns


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, Arrow type, unit, clock and meaning."""

    name: str
    type: pa.DataType
    doc: str
    unit: str = ""
    """``ns``, ``bytes``, ``count`` or empty for identifiers and labels."""
    clock: str = ""
    """For times: which clock (``local monotonic``, ``wall``)."""
    nullable: bool = False
    """Integer columns: ``NULL_INT`` in buffers means null."""
    enum: type[enum.IntEnum] | None = None
    """For coded columns: the enum whose values the integers are."""

    def field(self) -> pa.Field:
        meta = {b"doc": self.doc.encode()}
        if self.unit:
            meta[b"unit"] = self.unit.encode()
        if self.clock:
            meta[b"clock"] = self.clock.encode()
        if self.enum is not None:
            meta[b"enum"] = self.enum.__name__.encode()
        return pa.field(self.name, self.type, nullable=True, metadata=meta)


_LOCAL = "recording process's monotonic clock"


class col:
    """Column name constants; use these instead of spelling names.

    Each constant is the name string; the full definition (type, unit, clock,
    meaning) is in the table objects below (``SPANS.column(col.START_NS)``).
    Names are deliberately specific (``instance_role``, not ``role``) so that a
    column never collides with an everyday word such as an HTTP or JSON key.
    """

    RUN_ID = "run_id"
    """The run a row belongs to: :data:`RUN_COLUMN`, which the store writer adds to every part file."""
    REQUEST_ID = "request_id"
    REQUEST_KEY = "request_key"
    INSTANCE_ID = "instance_id"
    TENANT = "tenant_name"
    SESSION = "session_name"
    SESSION_TURN = "session_turn"
    SLO_CLASS = "slo_class_name"
    ARRIVAL_NS = "arrival_ns"
    FIRST_TOKEN_NS = "first_token_ns"
    FIRST_CONTENT_NS = "first_content_ns"
    FINISH_NS = "finish_ns"
    NUM_PROMPT_TOKENS = "num_prompt_tokens"
    NUM_CACHED_TOKENS = "num_cached_tokens"
    NUM_OUTPUT_TOKENS = "num_output_tokens"
    STATUS = "request_status"
    ERROR = "error_message"
    TRACE_ID = "otel_trace_id"
    STAGE = "stage_id"
    TOKEN_INDEX = "token_index"
    START_NS = "start_ns"
    END_NS = "end_ns"
    STEP = "engine_step"
    NUM_BYTES = "payload_bytes"
    TIER = "kv_tier"
    BATCH_SIZE = "batch_num_seqs"
    EMIT_NS = "emit_ns"
    SENT_NS = "sent_ns"
    RECV_NS = "recv_ns"
    NUM_SEQS = "step_num_seqs"
    NUM_PREFILL_TOKENS = "num_prefill_tokens"
    NUM_DECODE_TOKENS = "num_decode_tokens"
    NUM_WAITING = "num_waiting"
    NUM_RUNNING = "num_running"
    NUM_PREEMPTED = "num_preempted"
    NUM_BLOCKS_USED_DEVICE = "num_blocks_used_device"
    NUM_BLOCKS_TOTAL_DEVICE = "num_blocks_total_device"
    NUM_BLOCKS_USED_HOST = "num_blocks_used_host"
    NUM_BLOCKS_TOTAL_HOST = "num_blocks_total_host"
    NUM_BLOCKS_USED_DISK = "num_blocks_used_disk"
    NUM_BLOCKS_TOTAL_DISK = "num_blocks_total_disk"
    KIND = "cache_event_kind"
    NUM_BLOCKS = "num_blocks"
    NUM_TOKENS = "event_num_tokens"
    ROLE = "instance_role"
    NAME = "instance_name"
    HOST = "host_name"
    PID = "os_pid"
    MONO_ANCHOR_NS = "mono_anchor_ns"
    WALL_ANCHOR_NS = "wall_anchor_ns"
    CLOCK_OFFSET_NS = "clock_offset_ns"
    CLOCK_RTT_NS = "clock_rtt_ns"
    DRAFT_SOURCE = "draft_source"
    NUM_PROPOSED = "num_proposed"
    NUM_ACCEPTED = "num_accepted"
    FIRST_TOKEN_INDEX = "first_token_index"
    DRAFT_START_NS = "draft_start_ns"
    DRAFT_END_NS = "draft_end_ns"
    VERIFY_START_NS = "verify_start_ns"
    VERIFY_END_NS = "verify_end_ns"
    ARMED_NS = "armed_ns"
    LOOP_CPU_NS = "loop_cpu_ns"
    PROCESS_CPU_NS = "process_cpu_ns"
    NUM_SPEC_SEQS = "num_spec_seqs"
    MAX_NUM_SEQS = "config_max_num_seqs"
    MAX_NUM_BATCHED_TOKENS = "config_max_num_batched_tokens"
    KV_BLOCK_SIZE = "kv_block_size"
    SCHEDULING_POLICY = "scheduling_policy_name"
    PREEMPTION_MODE = "preemption_mode_name"
    CHUNKED_PREFILL = "chunked_prefill_enabled"
    PREFIX_CACHING = "prefix_caching_enabled"
    SPECULATIVE_SOURCE = "speculative_source_name"
    NUM_SPECULATIVE_TOKENS = "config_num_speculative_tokens"


@dataclass(frozen=True)
class Table:
    """A table of the store: its name, columns and Arrow schema."""

    name: str
    doc: str
    columns: tuple[Column, ...]
    _by_name: dict[str, Column] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name = {c.name: c for c in self.columns}
        if len(by_name) != len(self.columns):
            raise ValueError(f"duplicate column in table {self.name}")
        object.__setattr__(self, "_by_name", by_name)

    @property
    def schema(self) -> pa.Schema:
        """Arrow schema with per-field docs and the schema version in its metadata."""
        return pa.schema(
            [c.field() for c in self.columns],
            metadata={
                SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode(),
                TABLE_NAME_KEY: self.name.encode(),
            },
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def column(self, name: str) -> Column:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"table {self.name} has no column {name!r}") from None

    def __iter__(self) -> Iterator[Column]:
        return iter(self.columns)


def _i64(name: str, doc: str, **kw) -> Column:
    return Column(name, pa.int64(), doc, **kw)


def _i32(name: str, doc: str, **kw) -> Column:
    return Column(name, pa.int32(), doc, **kw)


def _i8(name: str, doc: str, **kw) -> Column:
    return Column(name, pa.int8(), doc, **kw)


def _str(name: str, doc: str) -> Column:
    return Column(name, pa.string(), doc)


def _ns(name: str, doc: str, *, nullable: bool = False, clock: str = _LOCAL) -> Column:
    return Column(name, pa.int64(), doc, unit="ns", clock=clock, nullable=nullable)


def _count(name: str, doc: str, *, nullable: bool = False) -> Column:
    return Column(name, pa.int64(), doc, unit="count", nullable=nullable)


_REQUEST_ID = _i64(col.REQUEST_ID, "Stable 63-bit hash of the server's request id string (request_id_of).")
_INSTANCE_ID = _i64(col.INSTANCE_ID, "The traced process that recorded the row (instances.instance_id).")
_STEP = _i64(col.STEP, "Engine iteration number on the recording instance; -1 = none.", nullable=True)
_TIER = _i8(col.TIER, "KV tier (Tier); -1 = not applicable.", nullable=True, enum=Tier)

REQUESTS = Table(
    "requests",
    "One row per request per instance that handled it; analyzers merge rows by request_id.",
    (
        _REQUEST_ID,
        _str(col.REQUEST_KEY, "The server's (or client's) own request id string."),
        _INSTANCE_ID,
        _str(col.TENANT, "Tenant the request belongs to (empty if unknown)."),
        _str(col.SLO_CLASS, "SLO class of the request, e.g. interactive or batch (empty if unknown)."),
        _ns(col.ARRIVAL_NS, "When the request reached this instance (client: when it was sent); null if unknown.", nullable=True),
        _ns(col.FIRST_TOKEN_NS, "When this instance emitted/sent/received the first output token.", nullable=True),
        _ns(col.FIRST_CONTENT_NS, "When this instance sent/received the first chunk with visible content "
            "(non-empty text; the TTFT of AIPerf and vllm bench); null if not observed.", nullable=True),
        _ns(col.FINISH_NS, "When the request ended on this instance.", nullable=True),
        _count(col.NUM_PROMPT_TOKENS, "Prompt length in tokens.", nullable=True),
        _count(col.NUM_CACHED_TOKENS, "Prompt tokens served from the prefix cache.", nullable=True),
        _count(col.NUM_OUTPUT_TOKENS, "Output tokens produced.", nullable=True),
        _i8(col.STATUS, "How the request ended (RequestStatus).", enum=RequestStatus),
        _str(col.ERROR, "Error kind or message when status is not ok; empty otherwise."),
        _str(col.TRACE_ID, "W3C / OpenTelemetry trace id (32 hex digits), empty if none."),
        _str(col.SESSION, "Session (conversation, agent loop) the request is a turn of; empty if none. "
             "Stored like tenant_name (an interned label)."),
        _i32(col.SESSION_TURN, "0-based turn of the request in its session, when the client said so "
             "(X-Session-Turn); null if unknown (analyzers then number turns by arrival).", nullable=True),
    ),
)

SPANS = Table(
    "spans",
    "One row per stage interval [start_ns, end_ns) of a request or of one of its tokens.",
    (
        _REQUEST_ID,
        _i8(col.STAGE, "Which stage (Stage).", enum=Stage),
        _i32(col.TOKEN_INDEX, "Output token the interval belongs to; -1 = request-level."),
        _ns(col.START_NS, "Interval start."),
        _ns(col.END_NS, "Interval end (exclusive)."),
        _INSTANCE_ID,
        _STEP,
        Column(col.NUM_BYTES, pa.int64(), "Bytes moved during the interval (KV transfer, tier load); -1 = n/a.", unit="bytes", nullable=True),
        _TIER,
        _count(col.BATCH_SIZE, "Sequences in the engine step the interval belongs to; -1 = n/a.", nullable=True),
    ),
)

TOKENS = Table(
    "tokens",
    "One row per output token per instance that saw it (engine emit, gateway send, client receive).",
    (
        _REQUEST_ID,
        _i32(col.TOKEN_INDEX, "0-based index of the output token."),
        _ns(col.EMIT_NS, "When the engine handed the token out: after sampling and detokenization (its text is "
                         "known), not when its id was sampled.", nullable=True),
        _ns(col.SENT_NS, "When the token's delta was written to the client stream.", nullable=True),
        _ns(col.RECV_NS, "When the client received the token's chunk (client role only).", nullable=True),
        _STEP,
        _INSTANCE_ID,
    ),
)

STEPS = Table(
    "steps",
    "One row per engine iteration.",
    (
        _INSTANCE_ID,
        _i64(col.STEP, "Engine iteration number on this instance."),
        _ns(col.START_NS, "Step start (scheduling decision made)."),
        _ns(col.END_NS, "Step end (outputs sampled)."),
        _count(col.NUM_SEQS, "Sequences in the batch."),
        _count(col.NUM_PREFILL_TOKENS, "Prompt tokens computed in the step (all prefill chunks)."),
        _count(col.NUM_DECODE_TOKENS, "Decode tokens computed in the step."),
        _count(col.NUM_WAITING, "Requests waiting for admission after scheduling."),
        _count(col.NUM_RUNNING, "Requests running after scheduling."),
        _count(col.NUM_PREEMPTED, "Requests preempted (swapped or to recompute) after scheduling."),
        _count(col.NUM_BLOCKS_USED_DEVICE, "KV blocks in use in the device tier.", nullable=True),
        _count(col.NUM_BLOCKS_TOTAL_DEVICE, "KV blocks in the device tier.", nullable=True),
        _count(col.NUM_BLOCKS_USED_HOST, "KV blocks in use in the host tier.", nullable=True),
        _count(col.NUM_BLOCKS_TOTAL_HOST, "KV blocks in the host tier.", nullable=True),
        _count(col.NUM_BLOCKS_USED_DISK, "KV blocks in use in the disk tier.", nullable=True),
        _count(col.NUM_BLOCKS_TOTAL_DISK, "KV blocks in the disk tier.", nullable=True),
    ),
)

CACHE_EVENTS = Table(
    "cache_events",
    "KV cache hits, misses, evictions, swaps, offloads, loads and prefetches.",
    (
        _INSTANCE_ID,
        _i64(col.REQUEST_ID, "Request concerned; -1 = none (e.g. background eviction).", nullable=True),
        _i8(col.KIND, "What happened (CacheEventKind).", enum=CacheEventKind),
        _TIER,
        _count(col.NUM_BLOCKS, "Blocks concerned."),
        _count(col.NUM_TOKENS, "Tokens concerned (cached tokens for hits).", nullable=True),
        Column(col.NUM_BYTES, pa.int64(), "Bytes copied; -1 = none.", unit="bytes", nullable=True),
        _ns(col.START_NS, "Event start (or instant)."),
        _ns(col.END_NS, "Event end; equals start_ns for instants."),
        _STEP,
    ),
)

LOOP_LAGS = Table(
    "loop_lags",
    "Event-loop ticks that ran late: the loop was busy (or stalled) from when a tick was due until it ran. "
    "Sampled by a tracer that lives on a serving process's event loop; only ticks late by a threshold are kept.",
    (
        _INSTANCE_ID,
        _ns(col.START_NS, "When the tick was due."),
        _ns(col.END_NS, "When it ran."),
        _ns(col.ARMED_NS, "When the tick was armed (at most one sampling period before it was due): where the "
            "two CPU columns start counting; -1 = not recorded (schema version 5 and older).", nullable=True),
        _ns(col.LOOP_CPU_NS, "CPU time of the loop's thread from armed_ns to end_ns (time.thread_time_ns "
            "difference): near the late interval's length when a callback on the loop kept it busy; -1 = not "
            "recorded.", nullable=True, clock="duration"),
        _ns(col.PROCESS_CPU_NS, "CPU time of the loop's whole process, all threads, from armed_ns to end_ns "
            "(time.process_time_ns difference): beyond loop_cpu_ns, another thread of the process ran (the GIL "
            "held away from the loop); near zero with loop_cpu_ns, the process was not running (a starved host); "
            "-1 = not recorded.", nullable=True, clock="duration"),
    ),
)

SPEC_STEPS = Table(
    "spec_steps",
    "One row per request per speculative engine step: what was proposed, what the target accepted, and when the "
    "draft and verify phases ran. A request's plain (non-speculative) decode steps have no row. Rejected draft work "
    "is derived (draft time x rejected / proposed; verify positions wasted), never stored as a ratio.",
    (
        _INSTANCE_ID,
        _REQUEST_ID,
        _i64(col.STEP, "Engine iteration number on this instance (steps.engine_step)."),
        _i8(col.DRAFT_SOURCE, "Where the proposals came from (DraftSource).", enum=DraftSource),
        _count(col.NUM_PROPOSED, "Draft tokens proposed in the step (k)."),
        _count(col.NUM_ACCEPTED, "Proposals the target accepted, 0..k; the step emitted num_accepted + 1 tokens "
               "unless the request finished within them."),
        _i32(col.FIRST_TOKEN_INDEX, "Index of the first output token the step emitted."),
        _ns(col.DRAFT_START_NS, "Start of the step's draft phase."),
        _ns(col.DRAFT_END_NS, "End of the step's draft phase."),
        _ns(col.VERIFY_START_NS, "Start of the target's verify pass."),
        _ns(col.VERIFY_END_NS, "End of the verify pass (accepted tokens known)."),
        _count(col.BATCH_SIZE, "Sequences in the verify pass (speculative and plain)."),
        _count(col.NUM_SPEC_SEQS, "Sequences of that batch that speculated in the step."),
    ),
)

INSTANCES = Table(
    "instances",
    "One row per traced process: role, identity and clock anchors.",
    (
        _i64(col.INSTANCE_ID, "Unique id of the traced process within the run."),
        _i8(col.ROLE, "What the process does (Role).", enum=Role),
        _str(col.NAME, "Human-readable instance name, e.g. decode-1."),
        _str(col.HOST, "Host name."),
        _i64(col.PID, "Operating-system process id."),
        _ns(col.MONO_ANCHOR_NS, "Monotonic clock reading taken together with wall_anchor_ns."),
        _ns(col.WALL_ANCHOR_NS, "Wall clock (time.time_ns) reading taken with mono_anchor_ns.", clock="wall"),
        _ns(
            col.CLOCK_OFFSET_NS,
            "Add to this instance's monotonic times to get the run's reference clock.",
            clock="difference of monotonic clocks",
        ),
        _ns(
            col.CLOCK_RTT_NS,
            "Round trip of the ping sample the offset came from (its uncertainty bound); -1 = not estimated.",
            nullable=True,
            clock="duration",
        ),
    ),
)

ENGINE_CONFIGS = Table(
    "engine_configs",
    "One row per engine instance (colocated, prefill or decode worker): the serving configuration it ran with, "
    "written once when the engine is instrumented. What a simulator of the engine needs and the steps do not say "
    "(limits, not usage). Readers take the latest row of an instance; runs without the table (schema version 3 "
    "and older, or a server that exposes no configuration) read it as empty.",
    (
        _INSTANCE_ID,
        _i8(col.ROLE, "What the engine does (Role): colocated, prefill or decode.", enum=Role),
        _count(col.MAX_NUM_SEQS, "Most sequences in one engine step."),
        _count(col.MAX_NUM_BATCHED_TOKENS, "Token budget of one engine step (prefill chunks and decode tokens)."),
        _count(col.KV_BLOCK_SIZE, "Tokens per KV cache block."),
        _count(col.NUM_BLOCKS_TOTAL_DEVICE, "KV blocks in the device tier.", nullable=True),
        _count(col.NUM_BLOCKS_TOTAL_HOST, "KV blocks in the host tier.", nullable=True),
        _count(col.NUM_BLOCKS_TOTAL_DISK, "KV blocks in the disk tier.", nullable=True),
        _str(col.SCHEDULING_POLICY, "Order of waiting requests, e.g. fcfs, slo (deadline first) or fair."),
        _str(col.PREEMPTION_MODE, "How a running request is preempted: recompute or swap (empty if unknown)."),
        _i8(col.CHUNKED_PREFILL, "1 if a long prompt is prefilled in chunks under the step budget; -1 = unknown.",
            nullable=True),
        _i8(col.PREFIX_CACHING, "1 if prompt prefixes are shared through the prefix cache; -1 = unknown.",
            nullable=True),
        _str(col.SPECULATIVE_SOURCE, "Speculative decoding's draft source (model, ngram, early-exit); empty = off."),
        _count(col.NUM_SPECULATIVE_TOKENS, "Proposals per request per speculative step (k); 0 when off.",
               nullable=True),
    ),
)

SETUP_TABLES: frozenset[str] = frozenset({ENGINE_CONFIGS.name})
"""Tables an adapter writes whole, once, at set-up (a one-row batch straight to the recorder's sink), not
through the recorder's hot-path buffers: they have no buffer layout and no recorder method."""

RUN_COLUMN = Column(
    col.RUN_ID, pa.string(),
    "The run the row belongs to (its run folder's name), so that globbing several runs stays safe. The store "
    "writer appends it to every part file it writes, after the table's columns; it is no field of the recorder's "
    "batches, and tokentrace's reader returns the table's own columns. Files written before it lack it: SQL "
    "engines read it as null there (DuckDB: union_by_name).")
"""A column of every stored part file, outside the tables' own column lists (see its doc)."""

TABLES: dict[str, Table] = {t.name: t for t in (REQUESTS, SPANS, TOKENS, STEPS, CACHE_EVENTS, LOOP_LAGS, SPEC_STEPS,
                                                  INSTANCES, ENGINE_CONFIGS)}
"""Every table of a store by name."""


def table(name: str) -> Table:
    """Look a table up by name; ``ValueError`` naming the valid ones if unknown."""
    try:
        return TABLES[name]
    except KeyError:
        raise ValueError(f"unknown table {name!r}; tables: {', '.join(TABLES)}") from None


def column_names() -> frozenset[str]:
    """Every column name of every table (what the no-literal check looks for)."""
    return frozenset(c.name for t in TABLES.values() for c in t.columns)


DEFAULT_TENANT = "default"
"""The tenant of a server that has no tenants (the reference server's, when no API keys are set)."""

MAX_LABEL_CHARS = 128
"""Longest tenant, SLO class, session or request key kept (characters); a longer one is cut
there, on every path (recorder, ASGI middleware, gateway tracer, OTLP). They are labels, not content."""


def cap_label(value: str) -> str:
    """``value`` cut to :data:`MAX_LABEL_CHARS` characters (tenant, SLO class, session, request key)."""
    return value if len(value) <= MAX_LABEL_CHARS else value[:MAX_LABEL_CHARS]


def request_id_of(key: str, tenant: str = "") -> int:
    """Stable non-negative 63-bit integer id of request ``key`` of ``tenant``.

    Every process computes the same value for the same (tenant, key), so spans from the
    gateway, prefill and decode workers join without a shared interning table. A request
    key names a request among its tenant's only: two tenants sending the same
    ``X-Request-Id`` get two ids. The empty tenant and :data:`DEFAULT_TENANT` (a server
    without tenants) are not part of the id, so a client that knows no tenant computes the
    server's id from the key alone. Both are capped (:func:`cap_label`) first, as the
    recorder stores them. Called once per request, never per event.
    """
    text = cap_label(key)
    if tenant and tenant != DEFAULT_TENANT:
        text = f"{cap_label(tenant)}\x1f{text}"  # unit separator: no tenant/key pair hashes as another
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF
