"""A run's derived tables (tokentrace.store.derived): written whole, read back only for the part files and the
format they were written for, invisible to the run's table listing."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest

from tokentrace.schema import REQUESTS, col
from tokentrace.store import StoreWriter, open_run
from tokentrace.store.derived import DERIVED_DIR, parts_fingerprint, read_derived, remove_derived, write_derived

FORMAT = "1/test"


def _requests(ids: list[int]) -> pa.Table:
    """Rows of ``requests`` with ids and arrivals, every other column null."""
    given = {col.REQUEST_ID: ids, col.ARRIVAL_NS: [10 * i for i in ids]}
    return pa.table({c.name: pa.array(given.get(c.name, [None] * len(ids)), c.type) for c in REQUESTS.columns})


def _run(tmp_path, rows: int = 3):
    with StoreWriter(tmp_path, run_id="r") as w:
        w.write(REQUESTS, _requests(list(range(rows))))
    return tmp_path / "r"


def _facts(n: int) -> pa.Table:
    return pa.table({col.REQUEST_ID: pa.array(range(n), pa.int64()), "latency_ns": pa.array([7] * n, pa.int64())})


def test_round_trip_with_extra_metadata(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    path = write_derived(run, "token_times", _facts(4), fingerprint=fp, format_key=FORMAT, extra={"one_row": "1"})
    assert path == run / DERIVED_DIR / "token_times.parquet"
    found = read_derived(run, fp, FORMAT)
    assert list(found) == ["token_times"]
    assert found["token_times"].extra == {"one_row": "1"}
    assert found["token_times"].path == path


def test_streamed_batches_are_written_whole(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    reader = pa.RecordBatchReader.from_batches(_facts(1).schema, _facts(5).to_batches(max_chunksize=2))
    write_derived(run, "token_steps", reader, fingerprint=fp, format_key=FORMAT)
    import pyarrow.parquet as pq

    assert pq.read_table(run / DERIVED_DIR / "token_steps.parquet").num_rows == 5
    assert not [p for p in (run / DERIVED_DIR).iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.parametrize("change", ["new part", "rewritten part", "removed part"])
def test_facts_go_stale_when_the_parts_change(tmp_path, change):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    write_derived(run, "request_facts", _facts(3), fingerprint=fp, format_key=FORMAT)
    part = next((run / "requests").rglob("part-*.parquet"))
    if change == "new part":
        with StoreWriter(tmp_path, run_id="r") as w:
            w.write(REQUESTS, _requests([99]))
    elif change == "rewritten part":
        st = part.stat()
        os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    else:
        part.unlink()
    new_fp = parts_fingerprint(run)
    assert new_fp != fp
    assert read_derived(run, new_fp, FORMAT) == {}
    assert list(read_derived(run, fp, FORMAT)) == ["request_facts"]  # still there, for the old parts only


def test_other_format_and_foreign_files_are_ignored(tmp_path):
    run = _run(tmp_path)
    fp = parts_fingerprint(run)
    write_derived(run, "token_times", _facts(2), fingerprint=fp, format_key=FORMAT)
    (run / DERIVED_DIR / "broken.parquet").write_bytes(b"PAR1 truncated")
    (run / DERIVED_DIR / "notes.txt").write_text("not a derived table")
    assert read_derived(run, fp, "2/test") == {}
    assert list(read_derived(run, fp, FORMAT)) == ["token_times"]


def test_the_folder_is_not_a_table_of_the_run(tmp_path):
    run = _run(tmp_path)
    write_derived(run, "token_times", _facts(2), fingerprint=parts_fingerprint(run), format_key=FORMAT)
    opened = open_run(tmp_path, "r")
    assert opened.tables() == ["requests"]
    assert opened.table("requests").num_rows == 3


def test_bad_names_and_removal(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(ValueError, match="identifier"):
        write_derived(run, "../escape", _facts(1), fingerprint="x", format_key=FORMAT)
    write_derived(run, "a", _facts(1), fingerprint="x", format_key=FORMAT)
    write_derived(run, "b", _facts(1), fingerprint="x", format_key=FORMAT)
    assert remove_derived(run) == 2
    assert not (run / DERIVED_DIR).exists()
    assert remove_derived(run) == 0
