"""Hand-made stores for the analyzer tests: a small builder with times in milliseconds.

:class:`HandMade`: add instances, requests, tokens, spans, steps and cache events,
then take ``.source()`` (in-memory Arrow tables), ``.analysis()`` (a RunAnalysis
over them) or ``.write(dir)`` (real Parquet files in the store layout, opened with
``tokentrace.open``). The ``handmade`` fixture (conftest) returns a fresh one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from analyzers.analysis import RunAnalysis
from analyzers.source import Source
from tokentrace.schema import TABLES, Role, Stage, col
from tokentrace.store.layout import part_name, partition_dir
from tokentrace.store.manifest import write_run_manifest

MS = 1_000_000


def ns(ms: float | None) -> int | None:
    return None if ms is None else int(round(ms * MS))


class HandMade:
    """Rows of every table, built with readable helper calls (all times in ms)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {name: [] for name in TABLES}

    def instance(self, iid: int = 1, role: Role = Role.COLOCATED, offset_ms: float = 0) -> "HandMade":
        self.rows["instances"].append({
            col.INSTANCE_ID: iid, col.ROLE: int(role), col.NAME: f"{role.label}-{iid}", col.HOST: "h",
            col.PID: 1, col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: ns(offset_ms)})
        return self

    def request(self, rid: int, arrival: float | None, finish: float | None = None, *, tenant: str = "a",
                cls: str = "interactive", prompt: int | None = None, cached: int | None = None, inst: int = 1,
                status: int = 0, output: int | None = None, first_content: float | None = None) -> "HandMade":
        self.rows["requests"].append({
            col.REQUEST_ID: rid, col.REQUEST_KEY: f"r{rid}", col.INSTANCE_ID: inst, col.TENANT: tenant,
            col.SLO_CLASS: cls, col.ARRIVAL_NS: ns(arrival), col.FINISH_NS: ns(finish),
            col.NUM_PROMPT_TOKENS: prompt, col.NUM_CACHED_TOKENS: cached, col.STATUS: status,
            col.NUM_OUTPUT_TOKENS: output, col.FIRST_CONTENT_NS: ns(first_content)})
        return self

    def tokens(self, rid: int, times: list[float], *, inst: int = 1, steps: list[int] | None = None,
               kind: str = "emit", first: int = 0) -> "HandMade":
        """Token ``first + i`` of ``rid`` emitted (``kind="sent"``: sent, ``"recv"``: received by a client)
        at ``times[i]``."""
        column = {"emit": col.EMIT_NS, "sent": col.SENT_NS, "recv": col.RECV_NS}[kind]
        for i, t in enumerate(times):
            self.rows["tokens"].append({
                col.REQUEST_ID: rid, col.TOKEN_INDEX: first + i, column: ns(t), col.INSTANCE_ID: inst,
                col.STEP: None if steps is None else steps[i]})
        return self

    def span(self, rid: int, stage: Stage, start: float, end: float, idx: int = -1, *, inst: int = 1,
             step: int | None = None, nbytes: int | None = None) -> "HandMade":
        self.rows["spans"].append({
            col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx, col.START_NS: ns(start),
            col.END_NS: ns(end), col.INSTANCE_ID: inst, col.STEP: step, col.NUM_BYTES: nbytes})
        return self

    def step(self, step: int, start: float, end: float, *, seqs: int = 1, prefill: int = 0, decode: int = 0,
             waiting: int = 0, running: int = 0, preempted: int = 0, inst: int = 1) -> "HandMade":
        self.rows["steps"].append({
            col.INSTANCE_ID: inst, col.STEP: step, col.START_NS: ns(start), col.END_NS: ns(end),
            col.NUM_SEQS: seqs, col.NUM_PREFILL_TOKENS: prefill, col.NUM_DECODE_TOKENS: decode,
            col.NUM_WAITING: waiting, col.NUM_RUNNING: running, col.NUM_PREEMPTED: preempted})
        return self

    def cache(self, kind: int, tier: int, blocks: int, start: float, end: float | None = None, *, rid: int = -1,
              tokens: int | None = None, nbytes: int | None = None, inst: int = 1) -> "HandMade":
        self.rows["cache_events"].append({
            col.INSTANCE_ID: inst, col.REQUEST_ID: rid, col.KIND: int(kind), col.TIER: int(tier),
            col.NUM_BLOCKS: blocks, col.NUM_TOKENS: tokens, col.NUM_BYTES: nbytes, col.START_NS: ns(start),
            col.END_NS: ns(start if end is None else end)})
        return self

    def spec_step(self, rid: int, step: int, *, proposed: int, accepted: int, first: int, draft: tuple[float, float],
                  verify: tuple[float, float], batch: int, spec_seqs: int = 1, source: int = 0,
                  inst: int = 1) -> "HandMade":
        """One speculative step of ``rid``: ``proposed`` drafts, ``accepted`` of them, first emitted token
        ``first``; ``draft`` and ``verify`` are (start, end) in ms."""
        self.rows["spec_steps"].append({
            col.INSTANCE_ID: inst, col.REQUEST_ID: rid, col.STEP: step, col.DRAFT_SOURCE: source,
            col.NUM_PROPOSED: proposed, col.NUM_ACCEPTED: accepted, col.FIRST_TOKEN_INDEX: first,
            col.DRAFT_START_NS: ns(draft[0]), col.DRAFT_END_NS: ns(draft[1]), col.VERIFY_START_NS: ns(verify[0]),
            col.VERIFY_END_NS: ns(verify[1]), col.BATCH_SIZE: batch, col.NUM_SPEC_SEQS: spec_seqs})
        return self

    def table(self, name: str) -> pa.Table:
        t = TABLES[name]
        rows = self.rows[name]
        return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)

    def tables(self) -> dict[str, pa.Table]:
        if not self.rows["instances"]:
            self.instance()
        return {name: self.table(name) for name in TABLES}

    def source(self, manifest: dict | None = None) -> Source:
        return Source.of_tables(manifest=manifest, **self.tables())

    def analysis(self, manifest: dict | None = None) -> RunAnalysis:
        return RunAnalysis.of(self.source(manifest))

    def write(self, root: Path, run_id: str = "run-1", config: dict | None = None) -> Path:
        """Write every non-empty table as Parquet in the store layout, one partition per instance."""
        tables = self.tables()
        run_dir = Path(root) / run_id
        run_dir.mkdir(parents=True)
        write_run_manifest(run_dir, run_id, config)
        for name, t in tables.items():
            if not t.num_rows:
                continue
            for iid in sorted(set(t.column(col.INSTANCE_ID).to_pylist())):
                part = t.filter(pc.equal(t.column(col.INSTANCE_ID), iid))
                folder = partition_dir(run_dir, name, iid)
                folder.mkdir(parents=True, exist_ok=True)
                pq.write_table(part, folder / part_name(1))
        return Path(root)
