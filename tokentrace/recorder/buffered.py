"""The hot path: :class:`BufferedRecorder`, which instrumentation calls for every event.

Cost model. An event method packs its integer arguments into one row with a
precompiled ``struct.Struct.pack`` and appends it to the table's ``array('q')``
with one ``frombytes`` call: no lock, no Python object kept per event (the
packed ``bytes`` is freed at once). ``benchmarks/recorder.py`` measures it
against OpenTelemetry and a bare ``array`` append.

Contracts shared by every event method (``span``, ``stage_begin``,
``stage_end``, ``token``, ``step``, ``cache_event``, ``request_begin``,
``request_end``):

* any thread, including an asyncio event loop's: they never block (no lock is
  taken) and never raise; a non-integer or out-of-range argument, or an end
  without a begin, is counted in ``counters["dropped_invalid"]``;
* times are ``time.monotonic_ns()`` integers the caller read (``now_ns``);
* nullable integer arguments use ``-1`` (``NULL_INT``) for "absent", written as
  null;
* past the memory cap an event is dropped and counted exactly
  (``counters["dropped_<table>"]``), never queued.

The thread-safety argument (GIL-atomic appends, prefix-only drains) is in
``tokentrace.recorder.buffers``; the flush and journal threads are in ``tokentrace.recorder.flusher``.
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
from typing import Any

from tokentrace.clock import Anchor, now_ns, take_anchor
from tokentrace.recorder.buffers import LAYOUTS, TableBuffer, count_value
from tokentrace.recorder.flusher import Flusher
from tokentrace.recorder.interning import Labels, SideStrings
from tokentrace.recorder.lifecycle import register, unregister
from tokentrace.recorder.request_rows import OPEN_REQUEST_BYTES, RequestRows
from tokentrace.recorder.sink import Sink
from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    LOOP_LAGS,
    REQUESTS,
    SPANS,
    SPEC_STEPS,
    STEPS,
    TOKENS,
    RequestStatus,
    Role,
    col,
)

__all__ = ["BufferedRecorder"]

_pack_span = LAYOUTS[SPANS.name].packer.pack
_pack_token = LAYOUTS[TOKENS.name].packer.pack
_pack_step = LAYOUTS[STEPS.name].packer.pack
_pack_cache = LAYOUTS[CACHE_EVENTS.name].packer.pack
_pack_loop_lag = LAYOUTS[LOOP_LAGS.name].packer.pack
_pack_spec_step = LAYOUTS[SPEC_STEPS.name].packer.pack
_pack_instance = LAYOUTS[INSTANCES.name].packer.pack

OPEN_STAGE_BYTES = 256
"""Accounted bytes of one open interval (dict entry, key tuple, start time)."""
OPEN_STAGES_SHARE = 0.05
OPEN_REQUESTS_SHARE = 0.04
"""Fractions of the memory cap for open intervals and open requests; with the
tables' shares in ``tokentrace.recorder.buffers.LAYOUTS`` they sum to 1."""


class BufferedRecorder:
    """Records tokentrace events into column buffers flushed to a ``Sink``.

    ``memory_cap_bytes`` bounds the event payload held at once: buffered rows,
    rows being written, open intervals and open requests, each table with a
    fixed share of the cap (``buffers.LAYOUTS``). Array over-allocation and
    the transient Arrow copy of the one batch being written are not counted.
    ``flush_interval_s``: longest time a row waits in a buffer.
    ``batch_rows``: rows per ``sink.write`` at most; a table is also flushed as
    soon as it holds that many rows.
    ``journal_interval_s``: with a sink that keeps a crash journal (a
    ``JournalSink``: the store writer), longest time a row waits before it is
    journaled, i.e. the most a SIGKILLed process loses; ``None`` turns the
    journal off. Parts are still cut every ``flush_interval_s``.

    Lifecycle: a daemon thread flushes in the background (and, journaling, a
    second one keeps the crash journal); :meth:`close` (also run at
    interpreter exit) flushes the rest and closes the sink. After
    ``os.fork()`` the child starts afresh: empty buffers, zero counters, its
    own threads and, if the sink has ``fork_child()``, the sink that
    returns (and its ``instance_id``, if it has one); the parent's unflushed
    events stay with the parent.
    """

    def __init__(
        self,
        sink: Sink,
        *,
        instance_id: int,
        memory_cap_bytes: int = 64 << 20,
        flush_interval_s: float = 1.0,
        batch_rows: int = 65536,
        journal_interval_s: float | None = 0.25,
    ) -> None:
        if not hasattr(sink, "write") or not hasattr(sink, "close"):
            raise TypeError(f"sink must have write(table, batch) and close(); got {type(sink).__name__}")
        if type(instance_id) is not int or not 0 <= instance_id < 2**63:
            raise ValueError(f"instance_id must be an int in [0, 2**63), got {instance_id!r}")
        if memory_cap_bytes <= 0:
            raise ValueError(f"memory_cap_bytes must be positive, got {memory_cap_bytes}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be positive, got {flush_interval_s}")
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
        if journal_interval_s is not None and not journal_interval_s > 0:
            raise ValueError(f"journal_interval_s must be positive or None, got {journal_interval_s}")
        self._sink = sink
        self._instance_id = instance_id
        self._cap = int(memory_cap_bytes)
        self._flush_interval_s = float(flush_interval_s)
        self._batch_rows = int(batch_rows)
        self._journal_interval_s = None if journal_interval_s is None else float(journal_interval_s)
        self._closed = False
        self._close_lock = threading.Lock()
        self._instance_info: dict[str, Any] | None = None  # last instance() call, re-sent after fork
        self._reset()
        register(self)

    def _reset(self) -> None:
        """Fresh buffers, counters, string tables and flush thread (init and fork child)."""
        cap = self._cap
        self._bufs = {name: TableBuffer(layout, cap_bytes=cap) for name, layout in LAYOUTS.items()}
        self._spans = self._bufs[SPANS.name]
        self._tokens = self._bufs[TOKENS.name]
        self._steps = self._bufs[STEPS.name]
        self._cache = self._bufs[CACHE_EVENTS.name]
        self._loop_lags = self._bufs[LOOP_LAGS.name]
        self._spec_steps = self._bufs[SPEC_STEPS.name]
        self._instances = self._bufs[INSTANCES.name]
        self._labels = Labels()
        self._side = SideStrings()
        # (request_id, stage, token_index) -> start, local monotonic ns
        self._open_stages: dict[tuple[int, int, int], int] = {}
        self._max_open_stages = max(16, int(cap * OPEN_STAGES_SHARE) // OPEN_STAGE_BYTES)
        self._open_drops = itertools.count()
        self._invalid = itertools.count()
        self._request_rows = RequestRows(
            self._bufs[REQUESTS.name], self._labels, self._side,
            max_open=max(16, int(cap * OPEN_REQUESTS_SHARE) // OPEN_REQUEST_BYTES),
            invalid=self._invalid, open_drops=self._open_drops,
        )
        labels, side = self._labels.decode, self._side.decode
        self._flusher = Flusher(
            self._sink,
            list(self._bufs.values()),
            instance_id=self._instance_id,
            decoders={
                col.REQUEST_KEY: side,
                col.TRACE_ID: side,
                col.TENANT: labels,
                col.SESSION: labels,
                col.SLO_CLASS: labels,
                col.ERROR: labels,
                col.NAME: labels,
                col.HOST: labels,
            },
            flush_interval_s=self._flush_interval_s,
            batch_rows=self._batch_rows,
            journal_interval_s=self._journal_interval_s,
            peekers={
                col.REQUEST_KEY: self._side.peek,
                col.TRACE_ID: self._side.peek,
                col.TENANT: labels,
                col.SESSION: labels,
                col.SLO_CLASS: labels,
                col.ERROR: labels,
                col.NAME: labels,
                col.HOST: labels,
            },
            on_full_flush=self._report_counters,
            lead_table=INSTANCES.name,  # the row naming this process reaches the store before its events
        )
        self._flusher.start()

    # ------------------------------------------------------------------ hot path
    # Each event method repeats the same three steps inline (pack, reserve a
    # slot, append) because a shared helper would add a call (~60 ns) per event.

    def span(self, request_id: int, stage: int, start_ns: int, end_ns: int, token_index: int = -1,
             step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """Record one complete stage interval ``[start_ns, end_ns)`` (see module contract)."""
        b = self._spans
        try:
            row = _pack_span(request_id, stage, token_index, start_ns, end_ns, step, num_bytes, tier, batch_size)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    def stage_begin(self, request_id: int, stage: int, t_ns: int, token_index: int = -1) -> None:
        """Open the interval of ``stage`` for (request, token) at ``t_ns``.

        A second begin for the same key before its end restarts the interval.
        """
        d = self._open_stages
        try:
            if len(d) < self._max_open_stages:
                d[(request_id, stage, token_index)] = t_ns
            else:
                next(self._open_drops)
        except Exception:  # unhashable arguments
            next(self._invalid)

    def stage_end(self, request_id: int, stage: int, t_ns: int, token_index: int = -1,
                  step: int = -1, num_bytes: int = -1, tier: int = -1, batch_size: int = -1) -> None:
        """Close the interval opened by :meth:`stage_begin` and record it as a span.

        An end without a matching begin is counted in ``dropped_invalid``.
        """
        try:
            start_ns = self._open_stages.pop((request_id, stage, token_index), None)
        except Exception:
            start_ns = None
        if start_ns is None:
            next(self._invalid)
            return
        self.span(request_id, stage, start_ns, t_ns, token_index, step, num_bytes, tier, batch_size)

    def token(self, request_id: int, token_index: int, *, emit_ns: int = -1, sent_ns: int = -1,
              recv_ns: int = -1, step: int = -1) -> None:
        """Record one output token as seen by this process (see module contract)."""
        b = self._tokens
        try:
            row = _pack_token(request_id, token_index, emit_ns, sent_ns, recv_ns, step)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    def step(self, step: int, start_ns: int, end_ns: int, num_seqs: int, num_prefill_tokens: int,
             num_decode_tokens: int, num_waiting: int, num_running: int, num_preempted: int,
             blocks_used_device: int = -1, blocks_total_device: int = -1,
             blocks_used_host: int = -1, blocks_total_host: int = -1,
             blocks_used_disk: int = -1, blocks_total_disk: int = -1) -> None:
        """Record one engine iteration (counts after scheduling; -1 = tier absent)."""
        b = self._steps
        try:
            row = _pack_step(step, start_ns, end_ns, num_seqs, num_prefill_tokens, num_decode_tokens,
                             num_waiting, num_running, num_preempted, blocks_used_device,
                             blocks_total_device, blocks_used_host, blocks_total_host,
                             blocks_used_disk, blocks_total_disk)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    def cache_event(self, kind: int, tier: int, num_blocks: int, start_ns: int, end_ns: int,
                    request_id: int = -1, num_tokens: int = -1, num_bytes: int = -1,
                    step: int = -1) -> None:
        """Record one KV cache event (``kind``: CacheEventKind; instants: end = start)."""
        b = self._cache
        try:
            row = _pack_cache(request_id, kind, tier, num_blocks, num_tokens, num_bytes, start_ns, end_ns, step)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    def loop_lag(self, start_ns: int, end_ns: int, armed_ns: int = -1, loop_cpu_ns: int = -1,
                 process_cpu_ns: int = -1) -> None:
        """Record an event-loop tick due at ``start_ns`` that ran at ``end_ns``, with the CPU its thread and process
        used since it was armed at ``armed_ns`` (-1: not measured; see module contract)."""
        b = self._loop_lags
        try:
            row = _pack_loop_lag(start_ns, end_ns, armed_ns, loop_cpu_ns, process_cpu_ns)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    def spec_step(self, request_id: int, step: int, draft_source: int, num_proposed: int, num_accepted: int,
                  first_token_index: int, draft_start_ns: int, draft_end_ns: int, verify_start_ns: int,
                  verify_end_ns: int, batch_size: int, num_spec_seqs: int) -> None:
        """Record one request's speculative step (``draft_source``: DraftSource; see module contract)."""
        b = self._spec_steps
        try:
            row = _pack_spec_step(request_id, step, draft_source, num_proposed, num_accepted, first_token_index,
                                  draft_start_ns, draft_end_ns, verify_start_ns, verify_end_ns, batch_size,
                                  num_spec_seqs)
        except Exception:
            next(self._invalid)
            return
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)

    # ------------------------------------------------------------------ requests

    def request_begin(self, key: str, *, tenant: str = "", slo_class: str = "", arrival_ns: int,
                      num_prompt_tokens: int = -1, trace_id: str = "", session: str = "",
                      session_turn: int = -1) -> int:
        """Note a request's arrival; returns its ``request_id`` (``request_id_of(key, tenant)``:
        a key names a request among its tenant's only).

        ``session``: the session (conversation) the request is a turn of, interned like
        the tenant; ``session_turn``: its 0-based turn, ``-1`` when unknown.

        Nothing is written until :meth:`request_end`, which emits the row. Any
        thread; never raises: a non-str ``key`` returns ``NULL_INT`` and counts
        as invalid; past the open-request cap the begin is counted as dropped
        and the end still writes a row (without the begin's fields).
        """
        return self._request_rows.begin(key, tenant, slo_class, arrival_ns, num_prompt_tokens, trace_id,
                                        session, session_turn)

    def request_end(self, request_id: int, *, finish_ns: int, status: int = RequestStatus.OK,
                    first_token_ns: int = -1, num_output_tokens: int = -1,
                    num_cached_tokens: int = -1, error: str = "", first_content_ns: int = -1) -> None:
        """Write the request's row, combining what :meth:`request_begin` noted.

        ``first_token_ns``: the first output chunk (or token) this instance
        emitted, sent or received; ``first_content_ns``: the first one with
        visible content (non-empty text), when this instance can tell.

        Without a begin the row is still written: key, tenant, SLO class and
        trace id empty, ``arrival_ns`` and prompt tokens ``-1``. Any thread;
        never raises.
        """
        self._request_rows.end(request_id, finish_ns, status, first_token_ns, num_output_tokens,
                               num_cached_tokens, error, first_content_ns)

    # ------------------------------------------------------------------ instance

    def instance(self, *, role: int = Role.COLOCATED, name: str = "", host: str | None = None,
                 pid: int | None = None, anchor: Anchor | None = None, clock_offset_ns: int = 0,
                 clock_rtt_ns: int = -1) -> None:
        """Write this process's ``instances`` row (any thread; never blocks).

        May be called again, e.g. after a new clock-offset estimate: every call
        writes a new row and readers take the latest row of an instance. The
        defaults fill in the host name, ``os.getpid()`` and a fresh anchor;
        after a fork the child re-sends its row with its own pid and anchor.
        Raises ``ValueError`` for an unknown role or non-integer fields (this
        is set-up, not the hot path).
        """
        role = Role(role)
        info = dict(role=role, name=name, host=host, clock_offset_ns=clock_offset_ns, clock_rtt_ns=clock_rtt_ns)
        anchor = anchor or take_anchor()
        host = socket.gethostname() if host is None else host
        pid = os.getpid() if pid is None else pid
        try:
            row = _pack_instance(role, self._labels.intern(name), self._labels.intern(host), pid,
                                 anchor.mono_ns, anchor.wall_ns, clock_offset_ns, clock_rtt_ns)
        except Exception as e:
            raise ValueError(f"invalid instance fields: {e}") from None
        self._instance_info = info
        b = self._instances
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            next(b.drops)
            return
        b.put(row)
        register_instance = getattr(self._sink, "register_instance", None)
        if callable(register_instance):
            try:
                register_instance(self._instance_id, role.label, name)
            except Exception as e:  # advisory (manifest bookkeeping); rows still flow
                self._flusher.warn_once("registering the instance", e)

    # ------------------------------------------------------------------ control

    def clock(self) -> int:
        """Now on this recorder's clock: ``time.monotonic_ns()`` (ns)."""
        return now_ns()

    @property
    def instance_id(self) -> int:
        """Id written into every row's ``instance_id`` column."""
        return self._instance_id

    @property
    def sink(self) -> Sink:
        return self._sink

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def counters(self) -> dict[str, int]:
        """Rows written per table (keyed by table name) and what was lost.

        ``dropped``: events refused over the memory cap (sum of
        ``dropped_<table>`` and ``dropped_open``, begins refused over the open
        interval/request cap); ``dropped_invalid``: bad arguments, ends without
        begins, out-of-range codes; ``sink_errors``: rows a failing
        ``sink.write`` lost; ``buffered``: rows waiting for the next flush
        (in the buffers, or journaled by the sink and not yet in a part).
        For every table, rows attempted = written + ``dropped_<table>`` + its
        invalid and sink-error rows + buffered.
        """
        f = self._flusher
        out: dict[str, int] = dict(f.written)
        total = 0
        for name, b in self._bufs.items():
            n = count_value(b.drops)
            out[f"dropped_{name}"] = n
            total += n
        out["dropped_open"] = count_value(self._open_drops)
        out["dropped"] = total + out["dropped_open"]
        out["dropped_invalid"] = count_value(self._invalid) + f.invalid
        out["sink_errors"] = f.sink_errors
        out["buffered"] = sum(b.num_rows() for b in self._bufs.values()) + f.num_journaled
        return out

    def headroom(self) -> dict[str, tuple[int, int]]:
        """Each table's ``(free rows, capacity rows)``: how many more rows it takes before its share
        of the memory cap refuses them, and how many that share holds in all. Rows buffered, journaled
        or being written hold their place until their part is written (:meth:`flush` frees them).
        Any thread; for producers that can wait (a bulk import), not the hot path."""
        return {name: (len(b.slots), b.capacity_rows) for name, b in self._bufs.items()}

    def flush(self) -> None:
        """Write everything recorded so far to the sink (any thread; blocks on the sink)."""
        self._flusher.flush_all()

    def close(self) -> None:
        """Stop recording, flush, then ``sink.close()``. Idempotent; any thread.

        Events recorded after close are counted as dropped.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with self._flusher.lock:  # serialized with the flusher's done()
            for b in self._bufs.values():
                b.close()
        self._flusher.stop()
        self._flusher.flush_all()
        try:
            self._sink.close()
        except Exception as e:
            self._flusher.warn_once("closing", e)
        unregister(self)

    def _report_counters(self) -> None:
        update = getattr(self._sink, "update_counters", None)
        if callable(update):
            try:
                update(self.counters)
            except Exception as e:
                self._flusher.warn_once("updating counters", e)

    def _after_fork_in_child(self) -> None:
        """Runs in a forked child: start afresh and never write the parent's events."""
        if self._closed:
            return
        self._close_lock = threading.Lock()
        fork_child = getattr(self._sink, "fork_child", None)
        if callable(fork_child):
            new_sink = fork_child()
            if new_sink is not None:
                self._sink = new_sink
                try:
                    new_id = new_sink.instance_id  # the store writer's per-process id
                except AttributeError:
                    new_id = None
                if type(new_id) is int:
                    self._instance_id = new_id
        self._reset()
        if self._instance_info is not None:
            self.instance(**self._instance_info)

    def __enter__(self) -> BufferedRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
