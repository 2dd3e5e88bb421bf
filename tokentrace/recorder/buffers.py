"""The recorder's column buffers: one append-only int64 array per table.

Each table's events are packed by ``struct`` into one ``array('q')``, row after
row (row-major). Measured on CPython 3.11 (benchmarks/recorder.py), packing a
row with a precompiled ``Struct.pack`` and appending it with
``array.frombytes`` costs about a third of ``array.extend(tuple)`` (which
converts and resizes item by item) and is all-or-nothing: ``pack`` validates
every field before a byte is appended, so a bad argument never leaves half a
row behind.

Thread-safety argument (CPython with the GIL). Producers only ever append
whole rows at the end with one ``frombytes`` call; the flusher only copies and
then deletes a prefix of whole rows (``arr[:n]``, ``del arr[:n]``), each a
single C call that runs to completion under the GIL and calls no Python code.
So a drain never sees a partial row and never loses an append that races with
it, and no buffer object is ever swapped under a producer that still holds a
reference to it (the hazard of swapping buffers without a lock).

Memory accounting without a lock. Every table has a budget of rows, held as a
pool of free row slots: a ``bytearray`` with one byte per free slot. A
producer reserves a slot with ``slots.pop()`` (one C call: atomic under the
GIL, and raising ``IndexError`` when the pool is empty, i.e. the table is at
its budget) before it appends; the flusher gives the slots of drained rows
back only after their batch was written. So at every instant

    buffered rows + rows being written + rows between reserve and append
        + free slots == capacity_rows,

whatever the interleaving of threads: the cap can never be overshot and every
refused event is counted. (A ``len(arr) < limit`` check before the append
would be cheaper to read but races: a thread switch between the check and the
append lets several threads pass the same check.)

Both arguments rest on the GIL; a free-threaded CPython build would need a
lock around reserve-and-append (about 70 ns per event on the benchmark box).
"""

from __future__ import annotations

import enum
import itertools
import struct
from array import array
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pyarrow as pa

from tokentrace.schema import (
    CACHE_EVENTS,
    INSTANCES,
    LOOP_LAGS,
    NULL_INT,
    REQUESTS,
    SPANS,
    SPEC_STEPS,
    STEPS,
    TOKENS,
    Table,
    col,
)

__all__ = [
    "Layout",
    "LAYOUTS",
    "TableBuffer",
    "StringDecoder",
    "MIN_ROWS",
    "count_value",
    "int_array",
    "string_array",
    "to_record_batch",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """How one table's rows sit in its buffer."""

    table: Table
    fields: tuple[str, ...]
    """Buffer row order: the table's columns minus ``instance_id`` (filled at flush)."""
    extra_bytes: int = 0
    """Bytes per row held outside the buffer (side strings), counted against the cap."""
    budget_share: float = 0.0
    """Fraction of the recorder's memory cap this table's rows may hold."""

    @property
    def width(self) -> int:
        """Int64 items per row."""
        return len(self.fields)

    @property
    def row_bytes(self) -> int:
        """Bytes a buffered row is accounted at (8 per field plus side data)."""
        return 8 * len(self.fields) + self.extra_bytes

    @property
    def packer(self) -> struct.Struct:
        """Native int64 struct for one row."""
        return struct.Struct(f"={len(self.fields)}q")


REQUEST_SIDE_BYTES = 256
"""Accounted bytes per request row for its key and trace id strings (side store)."""

# Buffer row order of each table: the order the recorder's methods pack their
# arguments in. Arrow batches are assembled by column name, so the schema's own
# column order may differ; _check_layout verifies the two name the same columns.
LAYOUTS: dict[str, Layout] = {
    SPANS.name: Layout(
        SPANS,
        (col.REQUEST_ID, col.STAGE, col.TOKEN_INDEX, col.START_NS, col.END_NS,
         col.STEP, col.NUM_BYTES, col.TIER, col.BATCH_SIZE),
        budget_share=0.40,
    ),
    TOKENS.name: Layout(
        TOKENS,
        (col.REQUEST_ID, col.TOKEN_INDEX, col.EMIT_NS, col.SENT_NS, col.RECV_NS, col.STEP),
        budget_share=0.21,
    ),
    STEPS.name: Layout(
        STEPS,
        (col.STEP, col.START_NS, col.END_NS, col.NUM_SEQS, col.NUM_PREFILL_TOKENS,
         col.NUM_DECODE_TOKENS, col.NUM_WAITING, col.NUM_RUNNING, col.NUM_PREEMPTED,
         col.NUM_BLOCKS_USED_DEVICE, col.NUM_BLOCKS_TOTAL_DEVICE, col.NUM_BLOCKS_USED_HOST,
         col.NUM_BLOCKS_TOTAL_HOST, col.NUM_BLOCKS_USED_DISK, col.NUM_BLOCKS_TOTAL_DISK),
        budget_share=0.08,
    ),
    CACHE_EVENTS.name: Layout(
        CACHE_EVENTS,
        (col.REQUEST_ID, col.KIND, col.TIER, col.NUM_BLOCKS, col.NUM_TOKENS, col.NUM_BYTES,
         col.START_NS, col.END_NS, col.STEP),
        budget_share=0.08,
    ),
    LOOP_LAGS.name: Layout(
        LOOP_LAGS,
        (col.START_NS, col.END_NS, col.ARMED_NS, col.LOOP_CPU_NS, col.PROCESS_CPU_NS),
        budget_share=0.01,
    ),
    SPEC_STEPS.name: Layout(
        SPEC_STEPS,
        (col.REQUEST_ID, col.STEP, col.DRAFT_SOURCE, col.NUM_PROPOSED, col.NUM_ACCEPTED, col.FIRST_TOKEN_INDEX,
         col.DRAFT_START_NS, col.DRAFT_END_NS, col.VERIFY_START_NS, col.VERIFY_END_NS, col.BATCH_SIZE,
         col.NUM_SPEC_SEQS),
        budget_share=0.04,
    ),
    REQUESTS.name: Layout(
        REQUESTS,
        (col.REQUEST_ID, col.REQUEST_KEY, col.TENANT, col.SLO_CLASS, col.ARRIVAL_NS,
         col.FIRST_TOKEN_NS, col.FIRST_CONTENT_NS, col.FINISH_NS, col.NUM_PROMPT_TOKENS, col.NUM_CACHED_TOKENS,
         col.NUM_OUTPUT_TOKENS, col.STATUS, col.ERROR, col.TRACE_ID, col.SESSION, col.SESSION_TURN),
        extra_bytes=REQUEST_SIDE_BYTES,
        budget_share=0.08,
    ),
    INSTANCES.name: Layout(
        INSTANCES,
        (col.ROLE, col.NAME, col.HOST, col.PID, col.MONO_ANCHOR_NS, col.WALL_ANCHOR_NS,
         col.CLOCK_OFFSET_NS, col.CLOCK_RTT_NS),
        budget_share=0.01,
    ),
}
"""Buffer layout of every table. The remaining 9% of the cap is for open
intervals and open requests (see ``tokentrace.recorder``)."""


def _check_layout(layout: Layout) -> None:
    expected = {c.name for c in layout.table.columns} - {col.INSTANCE_ID}
    if set(layout.fields) != expected or len(layout.fields) != len(expected):
        raise RuntimeError(
            f"recorder layout of {layout.table.name} is out of date with tokentrace.schema: "
            f"missing {sorted(expected - set(layout.fields))}, "
            f"unknown {sorted(set(layout.fields) - expected)}"
        )


for _layout in LAYOUTS.values():
    _check_layout(_layout)

MIN_ROWS = 16
"""Every table can hold at least this many rows, however small the cap."""

_SCHEMAS = {name: layout.table.schema for name, layout in LAYOUTS.items()}  # Table.schema builds one per call


def count_value(counter: itertools.count) -> int:
    """Current value of an ``itertools.count`` without advancing it.

    Producers bump counters with ``next(counter)``, one GIL-atomic C call, so
    concurrent increments are never lost (``x += 1`` on an attribute can be).
    """
    return int(repr(counter)[len("count(") : -1])


class TableBuffer:
    """One table's row buffer plus its over-cap drop counter.

    Producers (any thread) use ``reserve``, ``put`` and ``drops``
    directly; the flusher (one thread at a time, under the recorder's flush
    lock) uses :meth:`take`, :meth:`done` and :meth:`close`.
    """

    __slots__ = ("layout", "width", "capacity_rows", "arr", "put", "slots", "reserve", "drops", "closed")

    def __init__(self, layout: Layout, *, cap_bytes: int) -> None:
        self.layout = layout
        self.width = layout.width
        self.capacity_rows = max(MIN_ROWS, int(cap_bytes * layout.budget_share) // layout.row_bytes)
        self.arr = array("q")  # whole rows, row-major
        self.put = self.arr.frombytes  # bound once: producers call it per event
        self.slots = bytearray(self.capacity_rows)  # one byte per free row slot
        self.reserve = self.slots.pop  # IndexError when the table is at its budget
        self.drops = itertools.count()
        self.closed = False

    def num_rows(self) -> int:
        """Rows buffered now (any thread)."""
        return len(self.arr) // self.width

    def take(self, max_rows: int) -> array | None:
        """Remove and return up to ``max_rows`` oldest rows (flusher only).

        Their slots stay reserved until :meth:`done`.
        """
        n = min(len(self.arr) // self.width, max_rows) * self.width
        if n == 0:
            return None
        chunk = self.arr[:n]
        del self.arr[:n]  # only a prefix: producers append at the end meanwhile
        return chunk

    def done(self, num_rows: int) -> None:
        """``num_rows`` taken rows were written (or dropped): free their slots.

        Call under the same lock as :meth:`close`, so a closed buffer never
        gets slots back.
        """
        if not self.closed:
            self.slots.extend(bytes(num_rows))

    def close(self) -> None:
        """Refuse every later row (they are counted as dropped)."""
        self.closed = True
        self.slots.clear()


def rows_matrix(chunk: array, width: int) -> np.ndarray:
    """Column-major copy of drained rows: shape ``(width, num_rows)``, int64."""
    return np.frombuffer(chunk, dtype=np.int64).reshape(-1, width).T.copy()


_NP_TYPES = {pa.int8(): np.int8, pa.int32(): np.int32, pa.int64(): np.int64}


def _enum_mask(values: np.ndarray, codes: type[enum.IntEnum], *, nullable: bool) -> np.ndarray:
    """True where ``values`` is a member of ``codes`` (or NULL_INT when ``nullable``)."""
    members = sorted(int(v) for v in codes)
    if members == list(range(members[0], members[-1] + 1)):  # contiguous: a range check
        good = (values >= members[0]) & (values <= members[-1])
    else:
        good = np.isin(values, members)
    if nullable:
        good |= values == NULL_INT
    return good


def valid_rows(layout: Layout, cols: np.ndarray) -> np.ndarray | None:
    """Mask of rows whose narrow and enum-coded fields are in range; None if all are.

    ``cols`` is the ``(width, num_rows)`` matrix from :func:`rows_matrix`.
    """
    ok: np.ndarray | None = None
    for j, name in enumerate(layout.fields):
        c = layout.table.column(name)
        if c.enum is not None:
            good = _enum_mask(cols[j], c.enum, nullable=c.nullable)
        elif c.type in (pa.int8(), pa.int32()):
            info = np.iinfo(_NP_TYPES[c.type])
            good = (cols[j] >= info.min) & (cols[j] <= info.max)
        else:
            continue
        if not good.all():
            ok = good if ok is None else ok & good
    return ok


def int_array(values: np.ndarray, column_type: pa.DataType, *, nullable: bool) -> pa.Array:
    """Arrow array of one int column; ``NULL_INT`` becomes null when ``nullable``.

    Built from raw buffers: ``pa.array(ndarray)`` would import pandas on first
    use (pyarrow probes for it), which is slow and fails at interpreter exit.
    """
    data = np.ascontiguousarray(values, dtype=_NP_TYPES[column_type])
    validity = None
    num_nulls = 0
    if nullable:
        mask = values == NULL_INT
        num_nulls = int(np.count_nonzero(mask))
        if num_nulls:
            validity = pa.py_buffer(np.packbits(~mask, bitorder="little"))
    return pa.Array.from_buffers(column_type, len(data), [validity, pa.py_buffer(data)], null_count=num_nulls)


def string_array(strings: list[str]) -> pa.Array:
    """Arrow ``string`` array of ``strings`` (no nulls), built from raw buffers."""
    encoded = [s.encode("utf-8", "backslashreplace") for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int32)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = pa.py_buffer(b"".join(encoded))
    return pa.Array.from_buffers(pa.string(), len(encoded), [None, pa.py_buffer(offsets), data], null_count=0)


StringDecoder = Callable[[np.ndarray], list[str]]
"""Turns one string column's buffered ids into the strings (flusher only)."""


def to_record_batch(
    layout: Layout,
    chunk: array,
    *,
    instance_id: int,
    decoders: dict[str, StringDecoder],
) -> tuple[pa.RecordBatch, int]:
    """Drained rows -> a record batch matching ``layout.table.schema`` exactly.

    Rows whose narrow or enum-coded fields are out of range are left out; the
    second value returned is how many. String columns are decoded by
    ``decoders[column name]``; ``instance_id`` fills the instance column.
    """
    cols = rows_matrix(chunk, layout.width)
    position = {name: j for j, name in enumerate(layout.fields)}
    # Strings are decoded for every row, kept or not, so side-stored strings
    # of left-out rows are released too.
    strings = {
        c.name: decoders[c.name](cols[position[c.name]])
        for c in layout.table.columns
        if pa.types.is_string(c.type)
    }
    ok = valid_rows(layout, cols)
    num_invalid = 0
    if ok is not None:
        num_invalid = int(ok.size - np.count_nonzero(ok))
        cols = cols[:, ok]
        keep = ok.tolist()
        strings = {name: [s for s, k in zip(values, keep) if k] for name, values in strings.items()}
    num_rows = cols.shape[1]
    arrays = []
    for c in layout.table.columns:
        if c.name == col.INSTANCE_ID:
            arrays.append(int_array(np.full(num_rows, instance_id, dtype=np.int64), c.type, nullable=False))
        elif c.name in strings:
            arrays.append(string_array(strings[c.name]))
        else:
            arrays.append(int_array(cols[position[c.name]], c.type, nullable=c.nullable))
    return pa.RecordBatch.from_arrays(arrays, schema=_SCHEMAS[layout.table.name]), num_invalid
