"""Generate tests/data/real_run: a real trace replayed through the traced reference server.

The run is what ``tokentrace demo`` records, made smaller: the first
:data:`NUM_REQUESTS` requests of the Mooncake conversation trace (the shipped
head, ``mooncake_conversation_head100.jsonl``; provenance in README.md), at
their real arrival times, lengths x1/64, three tenants and two SLO classes,
sent by the load generator to the reference server run disaggregated (one
prefill and one decode worker, the ``small`` model, CPU) under
``tokentrace run``. Every process's rows are in it: client, gateway, prefill
and decode workers.

Run from the repository root (about a minute on a CPU; the output is committed):

    .venv/bin/python tests/data/make_real_run.py

The flusher writes a part file per table and process about once a second;
each small Parquet file costs a few KB of footer, so the generator then merges
every partition's parts, in order, into one file (:func:`compact`): the rows,
their order and each file's schema metadata are unchanged (the manifests'
``parts_written`` still count the parts as flushed).

Timings depend on the machine, so a regenerated run differs from the committed
one in its numbers, never in its shape; tests/analyzers/test_real_run.py checks
only what holds for any such run.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from tokentrace.app.demo import DemoOptions, run_demo

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OUT = HERE / "real_run"
RUN_ID = "mooncake-disagg"
TRACE = Path("tests/data/mooncake_conversation_head100.jsonl")  # relative to REPO: the manifest records it
NUM_REQUESTS = 40  # ~13 s of the trace's arrivals; keeps the store well under 500 KB
MAX_BYTES = 500_000


def compact(run_path: Path) -> int:
    """Merge each ``<table>/instance=<id>/part-*.parquet`` partition into one part; files removed."""
    removed = 0
    for partition in sorted(run_path.glob("*/instance=*")):
        parts = sorted(partition.glob("part-*.parquet"))
        if len(parts) < 2:
            continue
        tables = [pq.read_table(p) for p in parts]
        merged = pa.concat_tables(tables).replace_schema_metadata(tables[0].schema.metadata)
        tmp = partition / ".compact.tmp"
        pq.write_table(merged, tmp, compression="zstd")
        for p in parts:
            p.unlink()
        tmp.rename(parts[0])
        removed += len(parts) - 1
    return removed


def main() -> int:
    os.chdir(REPO)  # so the paths the run's manifest records are the repository's, not this machine's
    if OUT.exists():
        shutil.rmtree(OUT)
    opts = DemoOptions(store=OUT, num_requests=NUM_REQUESTS, model="small", trace=TRACE, run=RUN_ID,
                       dashboard=False, device="cpu", load_duration_s=120.0, load_drain_s=60.0)
    result = run_demo(opts, console=Console(stderr=True))
    merged = compact(result.run_path)
    print(f"compacted: {merged} part files merged into their partition's first part")
    size = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"{OUT}: run {result.run_id}, {result.num_ok}/{result.num_sent} requests ok, {size} bytes")
    if size > MAX_BYTES:
        print(f"error: the fixture is {size} bytes, over {MAX_BYTES}; lower NUM_REQUESTS", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
