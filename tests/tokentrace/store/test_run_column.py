"""Every part file names its run (the ``run_id`` column), so globbing several runs is safe."""

from __future__ import annotations

import glob

import duckdb
import pyarrow.parquet as pq

import tokentrace
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import RUN_COLUMN, SPANS, Stage, col
from tokentrace.store import StoreWriter


def _run(store, run_id: str, num_requests: int) -> None:
    writer = StoreWriter(store, run_id=run_id)
    rec = BufferedRecorder(writer, instance_id=writer.instance_id)
    rec.instance(name="engine")
    for n in range(num_requests):
        rid = rec.request_begin("same-key-%d" % n, arrival_ns=10 + n)  # keys repeat across the runs
        rec.span(rid, Stage.PREFILL_COMPUTE, 10 + n, 20 + n, 0)
        rec.request_end(rid, finish_ns=30 + n)
    rec.close()


def test_every_part_file_carries_its_run_and_a_glob_over_runs_keeps_them_apart(tmp_path):
    _run(tmp_path, "first", 2)
    _run(tmp_path, "second", 3)
    files = glob.glob(str(tmp_path / "*" / "*" / "instance=*" / "part-*.parquet"))
    assert files
    for path in files:
        table = pq.read_table(path)
        assert table.column_names[-1] == col.RUN_ID
        assert set(table.column(col.RUN_ID).to_pylist()) == {path.split("/")[-4]}
        assert table.schema.field(col.RUN_ID).metadata[b"doc"] == RUN_COLUMN.doc.encode()
    counts = duckdb.sql(f"""
        SELECT {col.RUN_ID}, count(*) AS n, count(DISTINCT {col.REQUEST_ID}) AS requests
        FROM read_parquet('{tmp_path}/*/{SPANS.name}/instance=*/part-*.parquet', hive_partitioning = true)
        GROUP BY {col.RUN_ID} ORDER BY {col.RUN_ID}""").fetchall()
    assert counts == [("first", 2, 2), ("second", 3, 3)]
    # tokentrace's reader returns the table's own columns
    assert tokentrace.open(tmp_path, run="first").table(SPANS.name).column_names == list(SPANS.names)
