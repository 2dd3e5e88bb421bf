"""Fuzz the store reader: whatever sits in a run folder (garbage bytes, Parquet files of any
schema, any JSON for the manifest and its fragments, damaged crash journals), reading it gives
rows of the table's schema, a ``CorruptFileWarning`` naming what was skipped, or one
``StoreError`` sentence, never another exception. Bounded: each property runs a fixed number
of examples, each in a fresh temporary store."""

from __future__ import annotations

import json
import tempfile
import warnings
from array import array
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokentrace.recorder.buffers import LAYOUTS
from tokentrace.schema import SPANS, STEPS, TABLES, col
from tokentrace.store import StoreError, StoreWriter, list_runs, open_run
from tokentrace.store.journal import encode_rows, journal_name

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
COLUMN_NAMES = sorted({c.name for t in TABLES.values() for c in t.columns} | {"t0_ns", "t1_ns", "colour"})
ARROW_TYPES = [pa.int8(), pa.int32(), pa.int64(), pa.uint64(), pa.float64(), pa.string(), pa.bool_(),
               pa.timestamp("ns"), pa.null()]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=15)


@st.composite
def arrow_tables(draw) -> pa.Table:
    names = draw(st.lists(st.sampled_from(COLUMN_NAMES), min_size=1, max_size=8, unique=True))
    num_rows = draw(st.integers(min_value=0, max_value=4))
    arrays = []
    for _ in names:
        t = draw(st.sampled_from(ARROW_TYPES))
        if t == pa.string():
            values = draw(st.lists(st.text(max_size=5) | st.none(), min_size=num_rows, max_size=num_rows))
        elif t == pa.float64():
            values = draw(st.lists(st.floats() | st.none(), min_size=num_rows, max_size=num_rows))
        elif t == pa.bool_():
            values = draw(st.lists(st.booleans() | st.none(), min_size=num_rows, max_size=num_rows))
        elif t == pa.null():
            values = [None] * num_rows
        else:
            lo, hi = {pa.uint64(): (0, 2**64 - 1), pa.timestamp("ns"): (0, 2**63 - 1)}.get(t, (-(2**7), 2**7 - 1))
            values = draw(st.lists(st.integers(min_value=lo, max_value=hi) | st.none(), min_size=num_rows,
                                   max_size=num_rows))
        arrays.append(pa.array(values, type=t))
    metadata = draw(st.sampled_from([None, {b"tokentrace.schema_version": b"2", b"tokentrace.table": b"spans"},
                                     {b"tokentrace.schema_version": b"0"}, {b"tokentrace.table": b"steps"},
                                     {b"tokentrace.schema_version": b"x"}]))
    return pa.Table.from_arrays(arrays, names=names).replace_schema_metadata(metadata)


def _read_everything(store: Path) -> None:
    """Every reader entry point; each gives its answer or one StoreError, and warnings."""
    from analyzers.source import Source  # the analyzers' DuckDB reader of the same files

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _answer_or_store_error(lambda: list_runs(store))
        try:
            run = open_run(store)
        except StoreError as err:
            assert "\n" not in str(err)
            return
        for name, table in TABLES.items():
            data = _answer_or_store_error(lambda: run.table(name))
            if data is not None:
                assert data.schema.names == list(table.names)
                assert all(data.schema.field(c.name).type == c.type for c in table.columns)
            _answer_or_store_error(lambda: run.table_info(name))
        _answer_or_store_error(run.time_span_ns)
        assert all(isinstance(v, int) and v >= 0 for v in run.counters().values())
        run.instances()
        source = _answer_or_store_error(lambda: Source.of_run(run))
        if source is not None:
            for name in ("spans", "steps", "requests"):
                source.scalar(f"SELECT count(*) FROM {name}")


def _answer_or_store_error(call):
    try:
        return call()
    except StoreError as err:
        assert str(err) and "\n" not in str(err)
        return None


def _store_with_one_run(tmp: Path) -> Path:
    with StoreWriter(tmp, run_id="r") as w:
        w.write(SPANS, pa.RecordBatch.from_pydict({n: [1, 2] for n in SPANS.names}))
    return tmp / "r"


@FUZZ
@given(data=arrow_tables(), table=st.sampled_from([SPANS.name, STEPS.name, "requests"]))
def test_a_parquet_part_of_any_schema_is_read_or_skipped(data: pa.Table, table: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _store_with_one_run(Path(tmp))
        part = run_dir / table / "instance=5" / "part-000001.parquet"
        part.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(data, part)
        _read_everything(Path(tmp))


@FUZZ
@given(raw=st.binary(max_size=400), keep=st.integers(min_value=0, max_value=4000))
def test_garbage_or_truncated_part_files_are_skipped(raw: bytes, keep: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _store_with_one_run(Path(tmp))
        (good,) = (run_dir / SPANS.name).rglob("part-*.parquet")
        whole = good.read_bytes()
        (good.parent / "part-000002.parquet").write_bytes(whole[:keep] + raw)
        (good.parent / "part-000003.parquet").write_bytes(raw)
        _read_everything(Path(tmp))


@FUZZ
@given(manifest=json_values, fragment=json_values, raw_fragment=st.binary(max_size=50))
def test_any_manifest_and_fragment_content_is_read_or_refused_in_one_sentence(manifest, fragment, raw_fragment):
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _store_with_one_run(Path(tmp))
        (run_dir / "manifest.json").write_text(json.dumps(manifest))
        (frag,) = (run_dir / "manifest.d").glob("*.json")
        frag.write_text(json.dumps(fragment))
        (run_dir / "manifest.d" / "12.json").write_bytes(raw_fragment)
        _read_everything(Path(tmp))


@FUZZ
@given(raw=st.binary(max_size=300), cut=st.integers(min_value=0, max_value=2000), flips=st.lists(
    st.integers(min_value=0, max_value=2000), max_size=3))
def test_damaged_crash_journals_of_dead_writers_never_stop_a_reader(raw: bytes, cut: int, flips: list[int]):
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = _store_with_one_run(Path(tmp))
        layout = LAYOUTS[STEPS.name]
        rows = array("q")
        for v in (7, 8, 9):
            rows.frombytes(layout.packer.pack(*([v] * layout.width)))
        record = bytearray(encode_rows(layout.fields, rows, {}, 99))
        for i in flips:
            record[i % len(record)] ^= 0xFF
        partition = run_dir / STEPS.name / "instance=99"
        partition.mkdir(parents=True)
        (partition / journal_name(1)).write_bytes(bytes(record[:cut]) + raw)
        (partition / journal_name(2)).write_bytes(raw)
        _read_everything(Path(tmp))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps = open_run(Path(tmp)).table(STEPS.name, columns=[col.STEP]).column(0).to_pylist()
        assert set(steps) <= {7, 8, 9}  # what a journal gives back is what was journaled, or nothing
