"""The Parquet store: StoreWriter -> files on disk -> open_run / list_runs, end to end."""

from __future__ import annotations

import errno
import re
import warnings
from pathlib import Path

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tokentrace.schema import (
    NULL_INT,
    REQUESTS,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SPANS,
    STEPS,
    TABLE_NAME_KEY,
    TABLES,
    Table,
    col,
)
from tokentrace.store import StoreError, StoreWriter, list_runs, open_run
from tokentrace.store import writer as store_writer


def sample(table: Table, num_rows: int, *, offset: int = 0) -> pa.RecordBatch:
    """Rows with distinct values per column; nullable integer columns get real nulls."""
    arrays = []
    for j, c in enumerate(table.columns):
        if pa.types.is_string(c.type):
            values = [f"é-{table.name}-{offset + i}" if i % 3 else "" for i in range(num_rows)]
        else:
            values = [(offset + i + j) % 100 for i in range(num_rows)]
            if c.nullable:
                values = [None if i % 4 == 1 else v for i, v in enumerate(values)]
        arrays.append(pa.array(values, type=c.type))
    return pa.RecordBatch.from_arrays(arrays, schema=table.schema)


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_table_round_trips_with_exact_values_and_schema(tmp_path, name):
    t = TABLES[name]
    batches = [sample(t, 7), sample(t, 5, offset=50)]
    with StoreWriter(tmp_path, run_id="rt") as w:
        for b in batches:
            w.write(t, b)
    back = open_run(tmp_path).table(name)
    assert back.schema.equals(t.schema, check_metadata=True)
    assert back.equals(pa.Table.from_batches(batches, schema=t.schema))
    # Field-level docs and units survive too.
    assert back.schema.field(t.columns[0].name).metadata == t.schema.field(t.columns[0].name).metadata


def test_part_files_carry_version_table_name_and_zstd(tmp_path):
    w = StoreWriter(tmp_path, run_id="meta")
    w.write(SPANS, sample(SPANS, 3))
    w.close()
    (part,) = open_run(tmp_path).files(SPANS.name)
    assert part.parent.name == f"instance={w.instance_id}"
    assert part.name == "part-000001.parquet"
    meta = pq.read_schema(part).metadata
    assert meta[SCHEMA_VERSION_KEY] == str(SCHEMA_VERSION).encode()
    assert meta[TABLE_NAME_KEY] == SPANS.name.encode()
    assert pq.ParquetFile(part).metadata.row_group(0).column(0).compression == "ZSTD"


def test_null_sentinel_becomes_null_only_in_nullable_columns(tmp_path):
    batch = sample(SPANS, 2)
    columns = {n: batch.column(i).to_pylist() for i, n in enumerate(SPANS.names)}
    columns[col.STEP] = [NULL_INT, 5]  # nullable: -1 means absent
    columns[col.TOKEN_INDEX] = [NULL_INT, 0]  # not nullable: -1 means request-level
    batch = pa.RecordBatch.from_arrays(
        [pa.array(columns[n], type=SPANS.schema.field(n).type) for n in SPANS.names], schema=SPANS.schema
    )
    with StoreWriter(tmp_path, run_id="nulls") as w:
        w.write(SPANS, batch)
    back = open_run(tmp_path).table(SPANS.name, columns=[col.STEP, col.TOKEN_INDEX])
    assert back.column(col.STEP).to_pylist() == [None, 5]
    assert back.column(col.TOKEN_INDEX).to_pylist() == [NULL_INT, 0]


def test_batch_without_metadata_or_with_narrower_types_is_cast(tmp_path):
    plain = pa.RecordBatch.from_pydict({n: [1, 2] for n in STEPS.names})  # all int64, no metadata
    with StoreWriter(tmp_path, run_id="cast") as w:
        w.write(STEPS, plain)
    back = open_run(tmp_path).table(STEPS.name)
    assert back.schema.equals(STEPS.schema, check_metadata=True)
    assert back.column(col.STEP).to_pylist() == [1, 2]


def test_batch_with_wrong_columns_is_refused(tmp_path):
    w = StoreWriter(tmp_path, run_id="bad")
    with pytest.raises(ValueError, match="do not match the schema"):
        w.write(SPANS, sample(STEPS, 2))
    with pytest.raises(ValueError, match="unknown table"):
        w.write(Table("nope", "not a store table", SPANS.columns), sample(SPANS, 1))
    assert open_run(tmp_path).tables() == []


def test_empty_batch_writes_no_file_and_closed_writer_refuses(tmp_path):
    w = StoreWriter(tmp_path, run_id="empty")
    w.write(SPANS, sample(SPANS, 0))
    assert open_run(tmp_path).files(SPANS.name) == []
    w.close()
    w.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        w.write(SPANS, sample(SPANS, 1))


# --------------------------------------------------------------------------- ids


def test_default_run_id_sorts_by_time_and_bad_ids_are_refused(tmp_path):
    w = StoreWriter(tmp_path)
    assert re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{6}", w.run_id)
    assert (tmp_path / w.run_id / "manifest.json").is_file()
    for bad in ("", "../up", "a b", "x/y", ".hidden", "ü"):
        with pytest.raises(ValueError, match="invalid run id"):
            StoreWriter(tmp_path, run_id=bad)


def test_instance_ids_are_unique_positive_63_bit_and_fork_child_gets_a_new_one(tmp_path):
    w = StoreWriter(tmp_path, run_id="ids")
    child = w.fork_child()
    ids = {w.instance_id, child.instance_id} | {StoreWriter(tmp_path, run_id="ids").instance_id for _ in range(20)}
    assert len(ids) == 22
    assert all(0 < i < 2**63 for i in ids)
    assert (child.run_id, child.store_path) == (w.run_id, w.store_path)
    w.write(SPANS, sample(SPANS, 2))
    child.write(SPANS, sample(SPANS, 3))
    run = open_run(tmp_path)
    assert run.num_rows(SPANS.name) == 5
    writers = {frag["writer"]: frag for frag in run.manifest["writers"]}
    assert writers[child.instance_id]["parent_writer"] == w.instance_id


def test_config_must_be_json(tmp_path):
    with pytest.raises(ValueError, match="JSON-serializable"):
        StoreWriter(tmp_path, run_id="cfg", config={"x": object()})


# --------------------------------------------------------------------------- atomicity


def test_no_temporary_file_is_left_and_temporary_files_are_never_read(tmp_path):
    with StoreWriter(tmp_path, run_id="tmp") as w:
        for k in range(3):
            w.write(STEPS, sample(STEPS, 4, offset=k))
        w.update_counters({"dropped": 1})
    assert not [p for p in all_files(tmp_path) if p.name.startswith(".") or p.name.endswith(".tmp")]
    folder = open_run(tmp_path).files(STEPS.name)[0].parent
    (folder / ".tmp-part-000004.parquet.1.abcd").write_bytes(b"half a file")
    (folder / "part-000005.parquet.tmp").write_bytes(b"half a file")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an attempt to read a temp file would warn
        run = open_run(tmp_path)
        assert run.num_rows(STEPS.name) == 12
        assert run.table(STEPS.name).num_rows == 12


def test_failed_write_raises_leaves_no_file_and_keeps_earlier_files(tmp_path, monkeypatch):
    w = StoreWriter(tmp_path, run_id="full")
    w.write(SPANS, sample(SPANS, 3))
    before = {p: p.read_bytes() for p in all_files(tmp_path / "full" / SPANS.name)}

    def disk_full(data, where, **kwargs):
        Path(where).write_bytes(b"PAR1 partial")  # the writer got partway, then the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_writer.pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space left"):
        w.write(SPANS, sample(SPANS, 4))
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in all_files(tmp_path / "full" / SPANS.name)} == before
    w.write(SPANS, sample(SPANS, 5))
    assert open_run(tmp_path).num_rows(SPANS.name) == 8


# --------------------------------------------------------------------------- reading


def test_columns_and_filter_select_rows(tmp_path):
    with StoreWriter(tmp_path, run_id="sel") as w:
        w.write(SPANS, sample(SPANS, 6))
        w.write(SPANS, sample(SPANS, 4, offset=6))
    run = open_run(tmp_path)
    got = run.table(SPANS.name, columns=[col.END_NS, col.START_NS], filter=pc.field(col.START_NS) >= 10)
    assert got.column_names == [col.END_NS, col.START_NS]
    assert got.column(col.START_NS).to_pylist() == [10, 11, 12]
    assert got.schema.metadata == SPANS.schema.metadata
    frame = run.to_pandas(SPANS.name)
    assert len(frame) == 10 and str(frame[col.STEP].dtype) == "Int64"
    assert frame[col.STEP].isna().sum() == 3  # rows 1, 5, 9 were null


def test_bad_table_column_and_filter_are_store_errors(tmp_path):
    with StoreWriter(tmp_path, run_id="bad") as w:
        w.write(SPANS, sample(SPANS, 1))
    run = open_run(tmp_path)
    with pytest.raises(StoreError, match="unknown table 'span'"):
        run.table("span")
    with pytest.raises(StoreError, match="no column"):
        run.table(SPANS.name, columns=["nope"])
    with pytest.raises(StoreError, match="Expression"):
        run.table(SPANS.name, filter="x > 1")
    for name in (SPANS.name, REQUESTS.name):  # with rows, and with no file at all
        with pytest.raises(StoreError, match="cannot be applied"):
            run.table(name, filter=pc.field("nope") == 1)


def test_a_table_without_files_reads_empty_with_its_schema(tmp_path):
    with StoreWriter(tmp_path, run_id="few") as w:
        w.write(SPANS, sample(SPANS, 1))
    run = open_run(tmp_path)
    assert run.tables() == [SPANS.name]
    empty = run.table(REQUESTS.name)
    assert empty.num_rows == 0 and empty.schema.equals(REQUESTS.schema, check_metadata=True)
    assert run.num_rows(REQUESTS.name) == 0


def test_time_span_covers_spans_and_requests(tmp_path):
    spans = sample(SPANS, 5, offset=10)  # start_ns = 10+i+3, end_ns = 10+i+4
    requests = sample(REQUESTS, 3, offset=0)  # arrival_ns = i+5, finish_ns = i+7 (row 1 null)
    with StoreWriter(tmp_path, run_id="span") as w:
        w.write(SPANS, spans)
        w.write(REQUESTS, requests)
    assert open_run(tmp_path).time_span_ns() == (5, 18)


def test_dataset_glob_reads_with_duckdb(tmp_path):
    w1 = StoreWriter(tmp_path, run_id="duck")
    w2 = StoreWriter(tmp_path, run_id="duck")
    w1.write(SPANS, sample(SPANS, 4))
    w2.write(SPANS, sample(SPANS, 6))
    glob = open_run(tmp_path).dataset_glob(SPANS.name)
    # The temp name below must not match the glob.
    (tmp_path / "duck" / SPANS.name / f"instance={w1.instance_id}" / ".tmp-part-000009.parquet.x").write_bytes(b"x")
    rows = duckdb.sql(
        f"SELECT instance, count(*) FROM read_parquet('{glob}', hive_partitioning=true) GROUP BY 1 ORDER BY 2"
    ).fetchall()
    assert [(int(i), n) for i, n in rows] == [(w1.instance_id, 4), (w2.instance_id, 6)]


# --------------------------------------------------------------------------- finding runs


def _run(store: Path, run_id: str, created: str) -> None:
    """A run whose manifest says it was created at ``created`` (ISO, UTC)."""
    with StoreWriter(store, run_id=run_id) as w:
        w.write(SPANS, sample(SPANS, 2))
    manifest = store / run_id / "manifest.json"
    manifest.write_text(re.sub(r'"created": "[^"]*"', f'"created": "{created}"', manifest.read_text()))


def test_open_run_picks_the_newest_run_or_the_one_named(tmp_path):
    _run(tmp_path, "zeta", "2026-01-01T00:00:00.000000Z")
    _run(tmp_path, "alpha", "2026-02-01T00:00:00.000000Z")
    assert open_run(tmp_path).run_id == "alpha"
    assert open_run(tmp_path, "zeta").run_id == "zeta"
    assert open_run(tmp_path / "zeta").run_id == "zeta"  # a run folder opens directly
    assert [r.run_id for r in list_runs(tmp_path)] == ["zeta", "alpha"]


def test_list_runs_reports_rows_span_and_counters(tmp_path):
    with StoreWriter(tmp_path, run_id="one") as w:
        w.write(SPANS, sample(SPANS, 3))
        w.write(STEPS, sample(STEPS, 2))
        w.write(STEPS, sample(STEPS, 2))
        w.update_counters({"dropped": 4, "sampled_out": 9})
    (info,) = list_runs(tmp_path)
    assert info.run_id == "one" and info.path == tmp_path / "one"
    assert info.tables == {SPANS.name: 3, STEPS.name: 4}
    assert info.time_span_ns == (3, 6) and info.duration_ns == 3
    assert (info.num_dropped, info.num_sampled_out) == (4, 9)
    assert info.created is not None and info.created.endswith("Z")


def test_bad_paths_are_one_sentence_store_errors(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        open_run(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreError, match="not a folder"):
        open_run(tmp_path / "file")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="is empty"):
        list_runs(tmp_path / "empty")
    (tmp_path / "other" / "stuff").mkdir(parents=True)
    with pytest.raises(StoreError, match="not a tokentrace store"):
        open_run(tmp_path / "other")


def test_unknown_run_names_at_most_ten_available_runs(tmp_path):
    for k in range(12):
        StoreWriter(tmp_path, run_id=f"run-{k:02d}").close()
    with pytest.raises(StoreError) as info:
        open_run(tmp_path, "run-99")
    message = str(info.value)
    assert "unknown run id 'run-99'" in message and "and 2 more" in message
    assert len(re.findall(r"run-\d\d", message)) == 11  # the asked one + 10 listed
    assert isinstance(info.value, ValueError) and "\n" not in message
