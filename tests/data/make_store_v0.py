"""Generate tests/data/store_v0: a tiny store in the version-0 (pre-release) layout.

Version 0 differs from version 1 in ways the reader must undo
(``tokentrace.store.files.MIGRATIONS``):

* spans: the bounds were called ``t0_ns`` / ``t1_ns``; ``stage`` was int32;
  ``kv_tier`` and ``batch_num_seqs`` did not exist.
* instances: the clock offset was called ``offset_ns``; no ``clock_rtt_ns``.
* tokens: no ``recv_ns``.  requests: no ``otel_trace_id``.

The v0 layout is spelled out here on purpose instead of being derived from
the reader's migration table, so the test that reads it checks that table.
Run from the repository root to regenerate (the output is committed):

    .venv/bin/python tests/data/make_store_v0.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokentrace.schema import INSTANCES, REQUESTS, SCHEMA_VERSION_KEY, SPANS, TABLE_NAME_KEY, TOKENS, col

OUT = Path(__file__).resolve().parent / "store_v0"
RUN_ID = "v0-fixture"
WRITER_ID = 1  # the one writer of the fixture run
V0 = b"0"

# table name -> list of (v0 column name, v0 type, values)
V0_TABLES: dict[str, list[tuple[str, pa.DataType, list]]] = {
    REQUESTS.name: [
        (col.REQUEST_ID, pa.int64(), [11, 12]),
        (col.REQUEST_KEY, pa.string(), ["req-a", "req-b"]),
        (col.INSTANCE_ID, pa.int64(), [1, 1]),
        (col.TENANT, pa.string(), ["acme", ""]),
        (col.SLO_CLASS, pa.string(), ["interactive", "batch"]),
        (col.ARRIVAL_NS, pa.int64(), [100, 150]),
        (col.FIRST_TOKEN_NS, pa.int64(), [400, None]),
        (col.FINISH_NS, pa.int64(), [900, 950]),
        (col.NUM_PROMPT_TOKENS, pa.int64(), [8, 16]),
        (col.NUM_CACHED_TOKENS, pa.int64(), [0, 4]),
        (col.NUM_OUTPUT_TOKENS, pa.int64(), [3, 0]),
        (col.STATUS, pa.int8(), [0, 1]),
        (col.ERROR, pa.string(), ["", "oom"]),
    ],
    SPANS.name: [
        (col.REQUEST_ID, pa.int64(), [11, 11, 12]),
        (col.STAGE, pa.int32(), [0, 6, 3]),
        (col.TOKEN_INDEX, pa.int32(), [-1, -1, -1]),
        ("t0_ns", pa.int64(), [100, 200, 150]),
        ("t1_ns", pa.int64(), [200, 400, 950]),
        (col.INSTANCE_ID, pa.int64(), [1, 1, 1]),
        (col.STEP, pa.int64(), [None, 1, None]),
        (col.NUM_BYTES, pa.int64(), [None, None, None]),
    ],
    TOKENS.name: [
        (col.REQUEST_ID, pa.int64(), [11, 11, 11]),
        (col.TOKEN_INDEX, pa.int32(), [0, 1, 2]),
        (col.EMIT_NS, pa.int64(), [390, 600, 850]),
        (col.SENT_NS, pa.int64(), [400, 610, 860]),
        (col.STEP, pa.int64(), [1, 2, 3]),
        (col.INSTANCE_ID, pa.int64(), [1, 1, 1]),
    ],
    INSTANCES.name: [
        (col.INSTANCE_ID, pa.int64(), [1]),
        (col.ROLE, pa.int8(), [3]),
        (col.NAME, pa.string(), ["colocated-0"]),
        (col.HOST, pa.string(), ["fixture-host"]),
        (col.PID, pa.int64(), [4242]),
        (col.MONO_ANCHOR_NS, pa.int64(), [50]),
        (col.WALL_ANCHOR_NS, pa.int64(), [1_780_000_000_000_000_000]),
        ("offset_ns", pa.int64(), [-7]),
    ],
}

RUN_MANIFEST = {
    "format": "tokentrace-run",
    "run": RUN_ID,
    "created": "2026-06-01T12:00:00.000000Z",
    "tokentrace_version": "0.0.1",
    "schema_version": 0,
    "python": "3.11.0",
    "platform": "fixture",
    "config": {"generator": "tests/data/make_store_v0.py"},
}

FRAGMENT = {
    "writer": WRITER_ID,
    "pid": 4242,
    "host": "fixture-host",
    "started": "2026-06-01T12:00:00.000000Z",
    "closed": True,
    "instances": [{"instance": 1, "role": "colocated", "name": "colocated-0"}],
    "counters": {"dropped": 2, "sampled_out": 5},
}


def _write_table(run_dir: Path, name: str, spec: list[tuple[str, pa.DataType, list]]) -> None:
    fields = [pa.field(n, t) for n, t, _ in spec]
    schema = pa.schema(fields, metadata={SCHEMA_VERSION_KEY: V0, TABLE_NAME_KEY: name.encode()})
    data = pa.Table.from_arrays([pa.array(v, type=t) for _, t, v in spec], schema=schema)
    folder = run_dir / name / f"instance={WRITER_ID}"
    folder.mkdir(parents=True)
    pq.write_table(data, folder / "part-000001.parquet", compression="zstd")


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    run_dir = OUT / RUN_ID
    (run_dir / "manifest.d").mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps(RUN_MANIFEST, indent=2, sort_keys=True) + "\n")
    (run_dir / "manifest.d" / f"{WRITER_ID}.json").write_text(json.dumps(FRAGMENT, indent=2, sort_keys=True) + "\n")
    for name, spec in V0_TABLES.items():
        _write_table(run_dir, name, spec)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
