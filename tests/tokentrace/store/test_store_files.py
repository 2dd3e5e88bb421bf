"""Reading single part files: old schema versions, corrupt files, statistics."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokentrace.schema import (
    INSTANCES,
    REQUESTS,
    SCHEMA_VERSION_KEY,
    SPANS,
    STEPS,
    TOKENS,
    Stage,
    col,
)
from tokentrace.store import CorruptFileWarning, StoreError, StoreWriter, open_run
from tokentrace.store import files as store_files
from tokentrace.store.files import column_min_max, renames_since

STORE_V0 = Path(__file__).resolve().parents[2] / "data" / "store_v0"


def steps_batch(first_step: int, num_rows: int) -> pa.RecordBatch:
    """Steps whose ``step`` column is first_step, first_step + 1, ...; other columns 1."""
    data = {n: [1] * num_rows for n in STEPS.names}
    data[col.STEP] = list(range(first_step, first_step + num_rows))
    return pa.RecordBatch.from_pydict(data)


# --------------------------------------------------------------------------- versions


def test_version_0_store_reads_with_renamed_columns_mapped_and_new_ones_null(tmp_path):
    store = tmp_path / "v0"
    shutil.copytree(STORE_V0, store)  # never touch the committed fixture
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run = open_run(store)
        spans = run.table(SPANS.name)
    assert run.run_id == "v0-fixture"
    assert spans.schema.equals(SPANS.schema, check_metadata=True)
    assert spans.column(col.START_NS).to_pylist() == [100, 200, 150]  # was t0_ns
    assert spans.column(col.END_NS).to_pylist() == [200, 400, 950]  # was t1_ns
    assert spans.column(col.STAGE).to_pylist() == [Stage.GATEWAY_RECEIVE, Stage.PREFILL_COMPUTE, Stage.SCHEDULE_QUEUE]
    assert spans.column(col.TIER).null_count == 3 and spans.column(col.BATCH_SIZE).null_count == 3
    assert run.table(TOKENS.name).column(col.RECV_NS).to_pylist() == [None, None, None]
    assert run.table(REQUESTS.name).column(col.TRACE_ID).to_pylist() == [None, None]
    instances = run.table(INSTANCES.name, columns=[col.CLOCK_OFFSET_NS, col.CLOCK_RTT_NS, col.NAME])
    assert instances.to_pylist() == [{col.CLOCK_OFFSET_NS: -7, col.CLOCK_RTT_NS: None, col.NAME: "colocated-0"}]
    assert run.time_span_ns() == (100, 950)
    assert run.counters() == {"dropped": 2, "sampled_out": 5}


def test_version_0_and_current_files_mix_in_one_run(tmp_path):
    store = tmp_path / "mixed"
    shutil.copytree(STORE_V0, store)
    with StoreWriter(store, run_id="v0-fixture") as w:
        batch = open_run(store).table(SPANS.name).slice(0, 1).to_batches()[0]
        w.write(SPANS, batch)
    spans = open_run(store).table(SPANS.name)
    assert spans.num_rows == 4
    assert sorted(spans.column(col.START_NS).to_pylist()) == [100, 100, 150, 200]


def test_renames_compose_over_several_versions(monkeypatch):
    t = SPANS.name
    monkeypatch.setattr(store_files, "SCHEMA_VERSION", 3)
    monkeypatch.setattr(
        store_files,
        "MIGRATIONS",
        {0: {t: {"a": "b"}}, 1: {t: {"b": "c"}, REQUESTS.name: {"q": "r"}}, 2: {t: {"x": "y"}}},
    )
    assert renames_since(0, t) == {"a": "c", "x": "y"}
    assert renames_since(1, t) == {"b": "c", "x": "y"}
    assert renames_since(3, t) == {}
    assert renames_since(0, REQUESTS.name) == {"q": "r"}


def _write_with_version(path: Path, version: bytes) -> None:
    data = pa.Table.from_batches([steps_batch(0, 2)])
    meta = {SCHEMA_VERSION_KEY: version}
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(data.replace_schema_metadata(meta), path)


@pytest.mark.parametrize("version", [b"99", b"-1", b"abc"])
def test_unreadable_schema_versions_are_store_errors_naming_the_file(tmp_path, version):
    StoreWriter(tmp_path, run_id="r").close()
    part = tmp_path / "r" / STEPS.name / "instance=5" / "part-000001.parquet"
    _write_with_version(part, version)
    with pytest.raises(StoreError, match="part-000001.parquet"):
        open_run(tmp_path).table(STEPS.name)


def test_file_without_version_metadata_is_taken_as_current(tmp_path):
    StoreWriter(tmp_path, run_id="r").close()
    part = tmp_path / "r" / STEPS.name / "instance=5" / "part-000001.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_batches([steps_batch(0, 3)]).replace_schema_metadata(None), part)
    assert open_run(tmp_path).table(STEPS.name).column(col.STEP).to_pylist() == [0, 1, 2]


# --------------------------------------------------------------------------- damaged files


def test_truncated_and_corrupt_files_are_skipped_with_a_warning_naming_them(tmp_path):
    with StoreWriter(tmp_path, run_id="bad") as w:
        for k in range(4):
            w.write(STEPS, steps_batch(10 * k, 3))
    first, truncated, corrupt, last = open_run(tmp_path).files(STEPS.name)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    corrupt.write_bytes(b"\x00garbage\xff" * 50)
    run = open_run(tmp_path)
    with pytest.warns(CorruptFileWarning) as caught:
        table = run.table(STEPS.name)
    assert table.column(col.STEP).to_pylist() == [0, 1, 2, 30, 31, 32]
    messages = " ".join(str(w.message) for w in caught)
    assert truncated.name in messages and str(corrupt) in messages
    with pytest.warns(CorruptFileWarning) as caught:
        assert run.num_rows(STEPS.name) == 6
    assert sorted(Path(str(w.message).split()[4].rstrip(":")).name for w in caught) == [truncated.name, corrupt.name]
    with pytest.warns(CorruptFileWarning):
        info = run.table_info(STEPS.name)
    assert (info.num_files, info.num_bytes) == (2, first.stat().st_size + last.stat().st_size)


def test_a_file_whose_columns_cannot_be_cast_is_skipped_with_a_warning(tmp_path):
    StoreWriter(tmp_path, run_id="r").close()
    part = tmp_path / "r" / STEPS.name / "instance=5" / "part-000001.parquet"
    part.parent.mkdir(parents=True)
    pq.write_table(pa.table({col.STEP: ["not a number"]}), part)
    with pytest.warns(CorruptFileWarning, match="part-000001"):
        assert open_run(tmp_path).table(STEPS.name).num_rows == 0


# --------------------------------------------------------------------------- statistics


def test_min_max_from_statistics_and_from_data_agree(tmp_path):
    data = pa.Table.from_batches([steps_batch(5, 10)]).cast(STEPS.schema)
    with_stats, without = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pq.write_table(data, with_stats, row_group_size=3)
    pq.write_table(data, without, write_statistics=False)
    assert pq.ParquetFile(without).metadata.row_group(0).column(1).statistics is None
    assert column_min_max(with_stats, STEPS, col.STEP) == (5, 14)
    assert column_min_max(without, STEPS, col.STEP) == (5, 14)


def test_min_max_of_all_null_or_absent_column_is_none(tmp_path):
    batch = pa.Table.from_batches([steps_batch(0, 3)]).cast(STEPS.schema)
    nulls = batch.set_column(
        STEPS.names.index(col.NUM_BLOCKS_USED_HOST), col.NUM_BLOCKS_USED_HOST, pa.nulls(3, pa.int64())
    )
    path = tmp_path / "n.parquet"
    pq.write_table(nulls, path)
    assert column_min_max(path, STEPS, col.NUM_BLOCKS_USED_HOST) is None
    without = nulls.drop_columns([col.NUM_BLOCKS_USED_DISK])  # a nullable column a file may lack
    pq.write_table(without, path)
    assert column_min_max(path, STEPS, col.NUM_BLOCKS_USED_DISK) is None  # not in the file
