"""Putting a run's recorded times on one clock, and that clock on the calendar.

Each traced process records times on its own monotonic clock and writes, in
the ``instances`` table, the offset that maps it onto the run's reference clock
(``t_ref = t_local + clock_offset_ns``, see :mod:`tokentrace.clock.sync`). A
later row of an instance refines an earlier one: the latest row wins, for the
whole run. :class:`RunClocks` is that mapping; every reader of a store converts
through it: the analyzers (Arrow with :meth:`RunClocks.align`, DuckDB SQL with
:func:`aligned_time_sql` over :meth:`RunClocks.offsets_table`), the exporters
(:meth:`RunClocks.to_wall_ns`) and the dashboard. Pure functions; any thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from tokentrace.clock.local import Anchor, take_anchor
from tokentrace.schema import TABLES, col

__all__ = [
    "OFFSET_COLUMN",
    "RunClocks",
    "latest_instances",
    "time_columns",
    "align",
    "aligned_time_sql",
]

OFFSET_COLUMN = "offset_ns"
"""The offset column of :meth:`RunClocks.offsets_table` (beside ``instance_id``)."""


def time_columns(table_name: str) -> list[str]:
    """The columns of ``table_name`` that are points on the recording process's clock."""
    t = TABLES[table_name]
    return [c.name for c in t.columns if c.unit == "ns" and c.clock.startswith("recording")]


def latest_instances(instances: pa.Table) -> pa.Table:
    """One row per instance: the last one written (a later row refines the clock offset)."""
    if instances.num_rows == 0:
        return instances
    ids = instances.column(col.INSTANCE_ID).to_pylist()
    last: dict[int, int] = {}
    for i, iid in enumerate(ids):
        last[iid] = i
    return instances.take(sorted(last.values()))


@dataclass(frozen=True, slots=True)
class RunClocks:
    """Each instance's offset to the run's reference clock, and that clock's wall-clock anchor."""

    offsets: Mapping[int, int] = field(default_factory=dict)
    """instance id -> ns to add to its recorded times to reach the reference clock."""
    wall_shift_ns: int | None = None
    """ns to add to a reference-clock time to get Unix time; None when no instance has an anchor."""

    @classmethod
    def from_instances(cls, instances: pa.Table | None) -> RunClocks:
        """The clocks described by an ``instances`` table (raw rows; the latest per instance wins).

        The reference instance is the first with offset 0 (the process the
        others synchronised to), else the first instance; its (monotonic, wall)
        anchor places the reference clock on the calendar.
        """
        if instances is None or instances.num_rows == 0:
            return cls()
        inst = latest_instances(instances)
        ids = inst.column(col.INSTANCE_ID).to_pylist()
        offsets = {i: int(o or 0) for i, o in zip(ids, inst.column(col.CLOCK_OFFSET_NS).to_pylist())}
        walls = inst.column(col.WALL_ANCHOR_NS).to_pylist()
        monos = inst.column(col.MONO_ANCHOR_NS).to_pylist()
        anchored = [k for k, (w, m) in enumerate(zip(walls, monos)) if w is not None and m is not None]
        if not anchored:
            return cls(offsets)
        ref = next((k for k in anchored if offsets[ids[k]] == 0), anchored[0])
        # wall = t_local + (wall_anchor - mono_anchor) of the reference, and t_local = t_ref - offset
        return cls(offsets, walls[ref] - monos[ref] - offsets[ids[ref]])

    def offset(self, instance_id: int) -> int:
        """The offset of ``instance_id`` (0 for an instance the run does not describe)."""
        return self.offsets.get(instance_id, 0)

    def to_reference_ns(self, instance_id: int, t_ns: int) -> int:
        """A time recorded by ``instance_id``, on the reference clock."""
        return t_ns + self.offsets.get(instance_id, 0)

    def to_wall_ns(self, t_ref_ns: int) -> int:
        """A reference-clock time as Unix ns; without an anchor in the run, this host's clock is assumed."""
        shift = self.wall_shift_ns
        if shift is None:
            a = take_anchor()
            shift = a.wall_ns - a.mono_ns
        return t_ref_ns + shift

    def reference_anchor(self) -> Anchor | None:
        """An anchor of the reference clock (its times against Unix time), None when no instance has one.

        ``reference_anchor().to_mono_ns(unix_ns)`` puts a wall-clock time (a load generator's
        send time, an exported span's start) on the reference clock: the inverse of
        :meth:`to_wall_ns`. The pair is exact up to the anchors' own uncertainty.
        """
        if self.wall_shift_ns is None:
            return None
        return Anchor(mono_ns=0, wall_ns=self.wall_shift_ns)

    @property
    def is_shifted(self) -> bool:
        """Whether any instance's times move (some offset is not 0)."""
        return any(self.offsets.values())

    def offsets_table(self) -> pa.Table:
        """``(instance_id, offset_ns)`` rows, to join in SQL (see :func:`aligned_time_sql`)."""
        return pa.table({col.INSTANCE_ID: pa.array(list(self.offsets), pa.int64()),
                         OFFSET_COLUMN: pa.array(list(self.offsets.values()), pa.int64())})

    def align(self, table: pa.Table, table_name: str) -> pa.Table:
        """``table`` (of schema table ``table_name``) with its time columns on the reference clock.

        Rows of instances the run does not describe keep their times; null times stay null.
        """
        if table.num_rows == 0 or not self.is_shifted:
            return table
        keys = pa.array(list(self.offsets.keys()), pa.int64())
        vals = pa.array(list(self.offsets.values()), pa.int64())
        idx = pc.index_in(table.column(col.INSTANCE_ID), value_set=keys)
        per_row = pc.fill_null(pc.take(vals, idx), 0)
        for name in time_columns(table_name):
            i = table.schema.get_field_index(name)
            if i >= 0:
                table = table.set_column(i, table.schema.field(i), pc.add(table.column(i), per_row))
        return table


def align(table: pa.Table, table_name: str, instances: pa.Table | None) -> pa.Table:
    """``RunClocks.from_instances(instances).align(table, table_name)``."""
    return RunClocks.from_instances(instances).align(table, table_name)


def aligned_time_sql(time_expr: str, offset_expr: str) -> str:
    """SQL of a recorded time moved onto the reference clock, given its instance's offset column.

    ``offset_expr`` comes from a LEFT JOIN on :meth:`RunClocks.offsets_table`;
    a row without an offset keeps its time, as in :meth:`RunClocks.align`.
    """
    return f"{time_expr} + COALESCE({offset_expr}, 0)"
