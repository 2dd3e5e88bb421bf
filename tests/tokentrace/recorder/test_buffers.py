"""Column buffers: budgets, draining, conversion to exact Arrow batches."""

from __future__ import annotations

import itertools
from array import array

import numpy as np
import pyarrow as pa
import pytest

from tokentrace.recorder.buffers import LAYOUTS, MIN_ROWS, TableBuffer, count_value, string_array, to_record_batch
from tokentrace.recorder.interning import Labels, SideStrings
from tokentrace.schema import REQUESTS, SETUP_TABLES, SPANS, TABLES, Stage, col


def test_every_table_has_a_layout_covering_its_columns():
    assert set(LAYOUTS) == set(TABLES) - SETUP_TABLES  # set-up tables go to the sink whole
    for name, layout in LAYOUTS.items():
        assert set(layout.fields) | {col.INSTANCE_ID} == set(TABLES[name].names)
    assert abs(sum(l.budget_share for l in LAYOUTS.values()) - 0.91) < 1e-9


def test_slots_are_reserved_by_producers_and_freed_only_after_the_write():
    layout = LAYOUTS[SPANS.name]
    b = TableBuffer(layout, cap_bytes=100 * 72 * 10)  # spans get 40%: 400 rows
    assert b.capacity_rows == 400 and len(b.slots) == 400
    pack = layout.packer.pack
    for i in range(30):
        b.reserve()
        b.put(pack(1, int(Stage.STREAM_SEND), -1, i, i + 1, -1, -1, -1, -1))
    chunk = b.take(10)
    assert len(chunk) == 10 * b.width and b.num_rows() == 20
    assert len(b.slots) == 370  # the 10 taken rows still hold their slots
    assert np.frombuffer(chunk, dtype=np.int64).reshape(-1, b.width)[:, 3].tolist() == list(range(10))
    b.done(10)
    assert len(b.slots) == 380
    b.close()
    assert len(b.slots) == 0 and b.take(1000) is not None and b.take(1) is None
    b.done(20)
    assert len(b.slots) == 0  # a closed buffer never gets slots back
    with pytest.raises(IndexError):
        b.reserve()


def test_a_full_table_refuses_by_index_error():
    b = TableBuffer(LAYOUTS[SPANS.name], cap_bytes=1)
    for _ in range(b.capacity_rows):
        b.reserve()
    with pytest.raises(IndexError):
        b.reserve()


def test_tiny_caps_still_hold_a_few_rows():
    b = TableBuffer(LAYOUTS[REQUESTS.name], cap_bytes=1)
    assert b.capacity_rows == MIN_ROWS


def test_count_value_reads_without_advancing():
    c = itertools.count()
    for _ in range(7):
        next(c)
    assert count_value(c) == 7 and count_value(c) == 7


def test_out_of_range_rows_are_left_out_and_their_side_strings_released():
    layout = LAYOUTS[REQUESTS.name]
    labels, side = Labels(), SideStrings()
    pack = layout.packer.pack
    chunk = array("q")
    for status, key in ((0, "good"), (99, "bad-status"), (1, "also-good")):
        chunk.frombytes(pack(5, side.put(key), labels.intern("t"), 0, 1, -1, -1, 2, -1, -1, -1, status, 0, -1, 0, -1))
    decoders = {col.REQUEST_KEY: side.decode, col.TRACE_ID: side.decode, col.TENANT: labels.decode,
                col.SLO_CLASS: labels.decode, col.ERROR: labels.decode, col.SESSION: labels.decode}
    batch, num_invalid = to_record_batch(layout, chunk, instance_id=3, decoders=decoders)
    assert num_invalid == 1 and len(side) == 0
    assert batch.column(col.REQUEST_KEY).to_pylist() == ["good", "also-good"]
    assert batch.column(col.STATUS).to_pylist() == [0, 1]
    assert batch.column(col.INSTANCE_ID).to_pylist() == [3, 3]
    assert batch.column(col.FIRST_TOKEN_NS).to_pylist() == [None, None]
    assert batch.schema.equals(REQUESTS.schema, check_metadata=True)


def test_string_array_handles_unicode_and_lone_surrogates():
    arr = string_array(["", "héllo", "日本", "a\ud800b"])
    arr.validate(full=True)
    assert arr.type == pa.string()
    assert arr.to_pylist()[:3] == ["", "héllo", "日本"]
    assert arr.to_pylist()[3] == "a\\ud800b"
