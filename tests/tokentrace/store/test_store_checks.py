"""Versions and schemas checked on read: a run from a newer tokentrace is refused, a part that is
not its table's (foreign schema, a column of the wrong type) is skipped with a warning naming it,
a counter that is not a count is said, never summed silently."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands
from tokentrace.schema import SCHEMA_VERSION, SPANS, STEPS, TOKENS, col
from tokentrace.store import CorruptFileWarning, StoreError, StoreWriter, list_runs, open_run

register_commands()
runner = CliRunner()


def rows(table, num_rows: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({n: list(range(num_rows)) for n in table.names})


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    with StoreWriter(tmp_path, run_id="good") as w:
        w.write(SPANS, rows(SPANS, 3))
        w.update_counters({"dropped": 2})
    return tmp_path


def _set_manifest(run_dir: Path, **changes) -> None:
    path = run_dir / "manifest.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _add_part(run_dir: Path, table_name: str, data: pa.Table, number: int = 9) -> Path:
    part = run_dir / table_name / "instance=777" / f"part-{number:06d}.parquet"
    part.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(data, part)
    return part


# --------------------------------------------------------------------------- manifest


@pytest.mark.parametrize("changes,fragment", [
    ({"schema_version": 99},
     f"says schema version 99, newer than this tokentrace reads ({SCHEMA_VERSION}); upgrade tokentrace"),
    ({"schema_version": "two"}, "invalid schema version 'two'"),
    ({"schema_version": -1}, "older than the oldest readable"),
    ({"format": "someone-elses-run"}, "of format 'someone-elses-run'"),
])
def test_a_run_this_tokentrace_cannot_read_is_refused_with_one_sentence(store, changes, fragment):
    _set_manifest(store / "good", **changes)
    with pytest.raises(StoreError, match=re.escape(fragment)) as info:
        open_run(store)
    assert str(info.value).startswith("run good cannot be read: ")
    result = runner.invoke(app, ["inspect", str(store)])
    assert result.exit_code == 2 and result.stderr.startswith("error: run good cannot be read")
    report = runner.invoke(app, ["report", str(store)])
    assert report.exit_code == 2 and "cannot be read" in report.stderr and "Traceback" not in report.output


def test_listing_runs_leaves_out_an_unreadable_one_with_a_warning(store):
    with StoreWriter(store, run_id="future") as w:
        w.write(SPANS, rows(SPANS, 1))
    _set_manifest(store / "future", schema_version=99)
    with pytest.warns(CorruptFileWarning, match="run future cannot be read"):
        assert [info.run_id for info in list_runs(store)] == ["good"]


def test_a_counter_that_is_not_a_count_is_said_and_left_out(store):
    (fragment,) = (store / "good" / "manifest.d").glob("*.json")
    data = json.loads(fragment.read_text())
    data["counters"] = {"dropped": "many", "sink_errors": -3, "sampled_out": 4}
    fragment.write_text(json.dumps(data))
    with pytest.warns(CorruptFileWarning) as caught:
        counters = open_run(store).counters()
    messages = [str(w.message) for w in caught]
    assert any("counter 'dropped' is 'many', not a count" in m for m in messages)
    assert any("counter 'sink_errors' is -3" in m for m in messages)
    assert counters["sampled_out"] == 4 and "sink_errors" not in counters
    result = runner.invoke(app, ["inspect", str(store)])
    assert result.exit_code == 0
    warning_lines = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning_lines) == 2  # each said once, however often the manifest is read


def test_inspect_says_each_manifest_warning_once(store):
    (store / "good" / "manifest.d" / "99.json").write_text("{not json")
    result = runner.invoke(app, ["inspect", str(store)])
    assert result.exit_code == 0
    lines = [line for line in result.stderr.splitlines() if "99.json" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: skipping unreadable manifest file")


# --------------------------------------------------------------------------- parts


def test_a_part_of_another_table_or_of_no_table_is_skipped_with_a_warning(store):
    run_dir = store / "good"
    tokens_file = _add_part(run_dir, SPANS.name, pa.Table.from_batches([rows(TOKENS, 2)]).cast(TOKENS.schema))
    foreign = _add_part(run_dir, SPANS.name, pa.table({"colour": ["red"], "size": [3]}), number=10)
    run = open_run(store)
    with pytest.warns(CorruptFileWarning) as caught:
        assert run.table(SPANS.name).num_rows == 3
    messages = " ".join(str(w.message) for w in caught)
    assert f"{tokens_file}: its metadata says it holds 'tokens' rows, not 'spans' rows" in messages
    assert f"{foreign}: it is not a spans file: it lacks the column(s) {col.REQUEST_ID}" in messages
    with pytest.warns(CorruptFileWarning):
        assert run.num_rows(SPANS.name) == 3


def test_a_column_of_the_wrong_type_skips_the_file_in_every_reader(store):
    run_dir = store / "good"
    data = pa.Table.from_batches([rows(STEPS, 2)]).cast(STEPS.schema)
    bad = data.set_column(STEPS.names.index(col.START_NS), col.START_NS, pa.array(["soon", "later"]))
    part = _add_part(run_dir, STEPS.name, bad.replace_schema_metadata(None))
    _add_part(run_dir, STEPS.name, data, number=11)
    with pytest.warns(CorruptFileWarning, match=f"its column {col.START_NS} is of type string"):
        assert open_run(store).table(STEPS.name).num_rows == 2
    from analyzers.source import Source  # DuckDB: the file would fail its CAST to BIGINT

    with pytest.warns(CorruptFileWarning, match=part.name):
        source = Source.of_run(open_run(store))
    assert source.scalar("SELECT count(*) FROM steps") == 2


def test_a_wider_integer_column_whose_values_do_not_fit_is_skipped(store):
    run_dir = store / "good"
    columns = {n: pa.array([1, 2], pa.int64()) for n in SPANS.names}
    fits = _add_part(run_dir, SPANS.name, pa.table({**columns, col.STAGE: pa.array([3, 4], pa.int64())}))
    too_big = _add_part(run_dir, SPANS.name, pa.table({**columns, col.START_NS: pa.array([1, 2**64 - 1],
                                                                                       pa.uint64())}), number=10)
    too_wide = _add_part(run_dir, SPANS.name, pa.table({**columns, col.STAGE: pa.array([1, 300], pa.int64())}),
                         number=11)
    from analyzers.source import Source

    with pytest.warns(CorruptFileWarning) as caught:
        source = Source.of_run(open_run(store))
    messages = " ".join(str(w.message) for w in caught)
    assert str(too_big) in messages and str(too_wide) in messages and str(fits) not in messages
    assert f"its column {col.STAGE} (int64) holds values from 1 to 300, beyond what spans.{col.STAGE}" in messages
    assert source.scalar("SELECT count(*) FROM spans") == 5  # 3 good rows + the 2 that fit


def test_export_to_a_folder_names_the_folder_not_a_temporary_file(store, tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    result = runner.invoke(app, ["export", str(store), "--out", str(folder)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (f"error: --out {folder} is a folder; give the file to write, e.g. "
                                     f"--out {folder / 'trace.json'}")
    missing = runner.invoke(app, ["export", str(store), "--out", str(tmp_path / "nowhere" / "t.json")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr and ".tmp" not in missing.stderr
