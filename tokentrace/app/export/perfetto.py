"""A run as a Chrome trace-event JSON file that ui.perfetto.dev (and chrome://tracing) opens.

The "JSON Object Format" of the Trace Event Format: ``{"traceEvents": [...],
"displayTimeUnit": "ms", "otherData": {...}}``. Mapping:

* one *process* per traced instance (``pid`` 1, 2, ... in role and name order;
  ``process_name`` = ``<role>-<name>``, the instance id in its args);
* one *thread* per request within each instance it touched (``tid`` 1, 2, ... in
  order of the request's first event there; ``thread_name`` = the request key);
* each stage interval is a complete event (``ph: "X"``, ``name`` = stage label,
  ``cat`` = the stage's area) on its request's thread, in the stage's colour of the
  one palette (:mod:`tokentrace.palette`): ``cname`` is the nearest of the colour
  names chrome://tracing takes, ``args.colour`` the palette's own ``#RRGGBB``
  (ui.perfetto.dev colours slices by a hash of their name and ignores ``cname``);
* each output token is a thread-scoped instant (``ph: "i"``, ``s: "t"``) at the
  time it was sent (else emitted, else received by the client);
* each engine step gives counters (``ph: "C"``) on its instance: queue lengths
  (waiting, running, preempted) and KV blocks used per tier.

Times are on the run's reference clock (every instance aligned with
:meth:`tokentrace.clock.RunClocks.align`), in microseconds as floats (``ts``, ``dur``),
relative to the run's earliest recorded time (``otherData.t0_ns``). Intervals
with a missing bound or an end before their start are left out and counted in
``otherData.skipped_spans``. Events are sorted by ``ts``; metadata comes first.
The whole trace is built in memory: fine for runs of a few million rows.
"""

from __future__ import annotations

import json
import os
from itertools import chain
from pathlib import Path
from typing import Any, Iterable, TextIO

import numpy as np
import pyarrow as pa

from tokentrace.clock import RunClocks, latest_instances, time_columns
from tokentrace.palette import STAGE_COLOURS, TRACE_COLOUR_NAMES
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, STEPS, TOKENS, Role, Stage, Tier, col
from tokentrace.store.layout import atomic_write

__all__ = ["trace_events", "perfetto_trace", "write_perfetto"]

_NS_PER_US = 1e3
_BLOCK_COLUMNS = ((Tier.DEVICE, col.NUM_BLOCKS_USED_DEVICE), (Tier.HOST, col.NUM_BLOCKS_USED_HOST),
                  (Tier.DISK, col.NUM_BLOCKS_USED_DISK))
_QUEUE_COLUMNS = ((col.NUM_WAITING, "waiting"), (col.NUM_RUNNING, "running"), (col.NUM_PREEMPTED, "preempted"))
_STAGE_LABELS = {int(s): s.label for s in Stage}
_STAGE_CNAMES = {int(s): TRACE_COLOUR_NAMES[s] for s in Stage}
_STAGE_COLOURS = {int(s): STAGE_COLOURS[s] for s in Stage}


Columns = dict[str, list[Any]]
"""A table as column name -> Python list (nulls as None): fast to walk row by row."""


def _aligned(run: Any, name: str, instances: pa.Table, columns: tuple[str, ...]) -> Columns:
    """``columns`` of table ``name`` on the run's reference clock, as lists."""
    wanted = list(dict.fromkeys((col.INSTANCE_ID, *columns, *time_columns(name))))
    t = RunClocks.from_instances(instances).align(run.table(name, columns=wanted), name)
    return {c: t.column(c).to_pylist() for c in columns}


def _process_names(instances: pa.Table, seen: Iterable[int]) -> dict[int, tuple[int, str]]:
    """instance id -> (pid, process name); ids seen in data but absent from ``instances`` included."""
    known: dict[int, str] = {}
    for iid, role_id, name in zip(instances.column(col.INSTANCE_ID).to_pylist(),
                                  instances.column(col.ROLE).to_pylist(), instances.column(col.NAME).to_pylist()):
        role = Role(role_id).label if role_id is not None else "instance"
        name = name or ""
        known[iid] = name if name.startswith(f"{role}-") else f"{role}-{name}" if name else f"{role}-{iid}"
    for iid in seen:
        known.setdefault(iid, f"instance-{iid}")
    order = sorted(known, key=lambda i: (known[i], i))
    return {iid: (pid, known[iid]) for pid, iid in enumerate(order, start=1)}


def _thread_ids(rows: Iterable[tuple[int, int, int | None]]) -> dict[tuple[int, int], int]:
    """(instance id, request id) -> tid from (instance, request, time) rows, numbered per instance
    in order of each request's first time there."""
    first: dict[tuple[int, int], int] = {}
    for iid, rid, t in rows:
        if t is None:
            continue
        key = (iid, rid)
        if key not in first or t < first[key]:
            first[key] = t
    out: dict[tuple[int, int], int] = {}
    count: dict[int, int] = {}
    for (iid, rid), _ in sorted(first.items(), key=lambda kv: (kv[0][0], kv[1], kv[0][1])):
        count[iid] = count.get(iid, 0) + 1
        out[(iid, rid)] = count[iid]
    return out


def _token_times(tokens: Columns) -> list[int | None]:
    """Per token: sent, else emitted, else received by the client (ns, reference clock)."""
    return [s if s is not None else e if e is not None else r
            for s, e, r in zip(tokens[col.SENT_NS], tokens[col.EMIT_NS], tokens[col.RECV_NS])]


def _request_name(keys: dict[int, str], rid: int) -> str:
    return keys.get(rid) or f"{rid:016x}"


def _span_events(spans: Columns, t0: int, pids: dict, tids: dict, keys: dict) -> tuple[list[dict], int]:
    events, skipped = [], 0
    extras = ((col.STEP, "step"), (col.NUM_BYTES, "bytes"), (col.BATCH_SIZE, "batch_size"))
    rows = zip(spans[col.INSTANCE_ID], spans[col.REQUEST_ID], spans[col.STAGE], spans[col.TOKEN_INDEX],
               spans[col.START_NS], spans[col.END_NS], spans[col.TIER], *(spans[c] for c, _ in extras))
    for iid, rid, stage, idx, start, end, tier, *extra in rows:
        if start is None or end is None or end < start:
            skipped += 1
            continue
        label = _STAGE_LABELS.get(stage, f"stage-{stage}")
        args: dict[str, Any] = {"request": _request_name(keys, rid), col.TOKEN_INDEX: idx}
        args.update((key, v) for (_, key), v in zip(extras, extra) if v is not None)
        if tier is not None:
            args["tier"] = Tier(tier).label
        event = {"name": label, "cat": label.split(".")[0], "ph": "X", "ts": (start - t0) / _NS_PER_US,
                 "dur": (end - start) / _NS_PER_US, "pid": pids[iid][0], "tid": tids[(iid, rid)], "args": args}
        if stage in _STAGE_CNAMES:
            event["cname"] = _STAGE_CNAMES[stage]
            args["colour"] = _STAGE_COLOURS[stage]
        events.append(event)
    return events, skipped


def _token_events(tokens: Columns, times: list[int | None], t0: int, pids: dict, tids: dict,
                  keys: dict) -> list[dict]:
    events = []
    for iid, rid, idx, step, t in zip(tokens[col.INSTANCE_ID], tokens[col.REQUEST_ID], tokens[col.TOKEN_INDEX],
                                      tokens[col.STEP], times):
        if t is None:
            continue
        args: dict[str, Any] = {"request": _request_name(keys, rid), col.TOKEN_INDEX: idx}
        if step is not None:
            args["step"] = step
        events.append({"name": f"token {idx}", "cat": "token", "ph": "i", "s": "t", "ts": (t - t0) / _NS_PER_US,
                       "pid": pids[iid][0], "tid": tids[(iid, rid)], "args": args})
    return events


def _counter_events(steps: Columns, t0: int, pids: dict) -> list[dict]:
    events = []
    queue_keys = [key for _, key in _QUEUE_COLUMNS]
    tier_keys = [tier.label for tier, _ in _BLOCK_COLUMNS]
    rows = zip(steps[col.INSTANCE_ID], steps[col.START_NS], *(steps[c] for c, _ in _QUEUE_COLUMNS),
               *(steps[c] for _, c in _BLOCK_COLUMNS))
    for iid, start, *values in rows:
        if start is None:
            continue
        base = {"ph": "C", "ts": (start - t0) / _NS_PER_US, "pid": pids[iid][0], "tid": 0}
        queue = {k: v for k, v in zip(queue_keys, values[:len(queue_keys)]) if v is not None}
        if queue:
            events.append({**base, "name": "queue", "args": queue})
        blocks = {k: v for k, v in zip(tier_keys, values[len(queue_keys):]) if v is not None}
        if blocks:
            events.append({**base, "name": "kv blocks used", "args": blocks})
    return events


def _metadata(pids: dict, tids: dict, keys: dict) -> list[dict]:
    events = []
    for iid, (pid, name) in sorted(pids.items(), key=lambda kv: kv[1][0]):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                       "args": {"name": name, col.INSTANCE_ID: str(iid)}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    for (iid, rid), tid in sorted(tids.items(), key=lambda kv: (pids[kv[0][0]][0], kv[1])):
        events.append({"name": "thread_name", "ph": "M", "pid": pids[iid][0], "tid": tid,
                       "args": {"name": keys.get(rid) or f"request {rid:016x}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pids[iid][0], "tid": tid,
                       "args": {"sort_index": tid}})
    return events


def _origin(*columns: list[int | None]) -> int:
    lows = [min(v for v in c if v is not None) for c in columns if any(v is not None for v in c)]
    return min(lows) if lows else 0


_SPAN_COLUMNS = (col.INSTANCE_ID, col.REQUEST_ID, col.STAGE, col.TOKEN_INDEX, col.START_NS, col.END_NS, col.TIER,
                 col.STEP, col.NUM_BYTES, col.BATCH_SIZE)
_TOKEN_COLUMNS = (col.INSTANCE_ID, col.REQUEST_ID, col.TOKEN_INDEX, col.STEP, col.EMIT_NS, col.SENT_NS, col.RECV_NS)
_STEP_COLUMNS = (col.INSTANCE_ID, col.START_NS, *(c for c, _ in _QUEUE_COLUMNS), *(c for _, c in _BLOCK_COLUMNS))


def perfetto_trace(run: Any) -> dict[str, Any]:
    """The trace of ``run`` (an opened ``Run``) as a JSON-ready dict (see the module docstring).

    Reads the run's tables (corrupt files are skipped by the reader, with a
    warning). Runs on the caller's thread; memory grows with the run's size.
    """
    inst_table = run.table(INSTANCES.name)
    spans = _aligned(run, SPANS.name, inst_table, _SPAN_COLUMNS)
    tokens = _aligned(run, TOKENS.name, inst_table, _TOKEN_COLUMNS)
    steps = _aligned(run, STEPS.name, inst_table, _STEP_COLUMNS)
    requests = _aligned(run, REQUESTS.name, inst_table, (col.REQUEST_ID, col.REQUEST_KEY))
    keys = dict(zip(requests[col.REQUEST_ID], requests[col.REQUEST_KEY]))
    times = _token_times(tokens)
    seen = set(spans[col.INSTANCE_ID]) | set(tokens[col.INSTANCE_ID]) | set(steps[col.INSTANCE_ID])
    pids = _process_names(latest_instances(inst_table), seen - {None})
    tids = _thread_ids(chain(zip(spans[col.INSTANCE_ID], spans[col.REQUEST_ID], spans[col.START_NS]),
                             zip(tokens[col.INSTANCE_ID], tokens[col.REQUEST_ID], times)))
    t0 = _origin(spans[col.START_NS], times, steps[col.START_NS])
    span_events, skipped = _span_events(spans, t0, pids, tids, keys)
    timed = span_events + _token_events(tokens, times, t0, pids, tids, keys) + _counter_events(steps, t0, pids)
    order = np.argsort(np.array([e["ts"] for e in timed], dtype=float), kind="stable")
    return {
        "traceEvents": _metadata(pids, tids, keys) + [timed[i] for i in order],
        "displayTimeUnit": "ms",
        "otherData": {"producer": "tokentrace export --format perfetto", "run_id": run.run_id,
                      "clock": "run reference clock; ts 0 = t0_ns", "t0_ns": str(t0),
                      "skipped_spans": str(skipped)},
    }


def trace_events(run: Any) -> list[dict[str, Any]]:
    """Just the ``traceEvents`` list of :func:`perfetto_trace`."""
    return perfetto_trace(run)["traceEvents"]


_CHUNK = 10_000  # events serialized per write


def _write_json(trace: dict[str, Any], f: TextIO) -> None:
    """``trace`` as compact JSON, events encoded in chunks by the C encoder (json.dump's
    streaming encoder is pure Python and ~5x slower)."""
    events = trace["traceEvents"]
    rest = {k: v for k, v in trace.items() if k != "traceEvents"}
    f.write('{"traceEvents":[')
    for i in range(0, len(events), _CHUNK):
        if i:
            f.write(",")
        f.write(",".join(json.dumps(e, separators=(",", ":")) for e in events[i:i + _CHUNK]))
    f.write("]")
    for key, value in rest.items():
        f.write(f",{json.dumps(key)}:{json.dumps(value, separators=(',', ':'))}")
    f.write("}\n")


def write_perfetto(run: Any, out: str | os.PathLike[str] | TextIO) -> int:
    """Write the trace of ``run`` to a file path or a text stream; returns the number of events.

    A path is written through a temporary file and renamed, so it appears whole (a device or a pipe is
    written in place: :func:`tokentrace.store.layout.atomic_write`). ``OSError`` if it cannot be written.
    """
    trace = perfetto_trace(run)
    if hasattr(out, "write"):
        _write_json(trace, out)
    else:
        def write(path: Path) -> None:
            with open(path, "w", encoding="utf-8") as f:
                _write_json(trace, f)

        atomic_write(Path(os.fspath(out)), write)
    return len(trace["traceEvents"])
