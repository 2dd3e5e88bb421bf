"""Put every instance's times on the run's reference clock.

Each traced process records times on its own monotonic clock and writes, in the
``instances`` table, the offset that maps it onto the run's reference clock
(``t_ref = t_local + clock_offset_ns``). Analyzers call :func:`align` on every
table before joining rows from different processes.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from tokentrace.schema import TABLES, Role, col

__all__ = ["latest_instances", "align", "time_columns", "client_instance_ids"]


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


def _offsets(instances: pa.Table) -> dict[int, int]:
    inst = latest_instances(instances)
    return dict(zip(inst.column(col.INSTANCE_ID).to_pylist(), inst.column(col.CLOCK_OFFSET_NS).to_pylist()))


def align(table: pa.Table, table_name: str, instances: pa.Table) -> pa.Table:
    """``table`` with its time columns shifted by each row's instance clock offset.

    Rows of instances missing from ``instances`` keep their times (offset 0).
    Null times stay null.
    """
    offsets = _offsets(instances)
    if table.num_rows == 0 or not any(offsets.values()):
        return table
    iid = table.column(col.INSTANCE_ID)
    keys = pa.array(list(offsets.keys()), pa.int64())
    vals = pa.array(list(offsets.values()), pa.int64())
    idx = pc.index_in(iid, value_set=keys)
    per_row = pc.fill_null(pc.take(vals, idx), 0)
    for name in time_columns(table_name):
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pc.add(table.column(i), per_row))
    return table


def client_instance_ids(instances: pa.Table) -> list[int]:
    """Instances whose role is ``client`` (the load generator's independent view)."""
    inst = latest_instances(instances)
    return [i for i, r in zip(inst.column(col.INSTANCE_ID).to_pylist(), inst.column(col.ROLE).to_pylist())
            if r == Role.CLIENT]

