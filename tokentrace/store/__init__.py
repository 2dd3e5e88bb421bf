"""The Parquet store: write a run (:class:`StoreWriter`), read it back (:func:`open_run`).

A store is a folder of runs, each a Hive-partitioned Parquet dataset::

    <store>/<run_id>/manifest.json
    <store>/<run_id>/manifest.d/<writer_id>.json
    <store>/<run_id>/<table>/instance=<writer_id>/part-<n>.parquet

This module is the facade; the parts live in ``layout`` (paths, atomic
file creation), ``manifest`` (run manifest and per-writer fragments),
``writer`` (the sink), ``batches`` (a batch brought to its table's schema),
``journal`` (the crash journal a killed writer's rows are recovered from),
``files`` (one file: versions, schema checks, migration, statistics) and
``reader`` (runs and tables). See ``docs/store.md``.
"""

from __future__ import annotations

from tokentrace.store.files import MIGRATIONS
from tokentrace.store.layout import StoreError, new_run_id, validate_run_id
from tokentrace.store.manifest import DROPPED, SAMPLED_OUT, CorruptFileWarning
from tokentrace.store.reader import Run, RunInfo, TableInfo, list_runs, open_run
from tokentrace.store.writer import StoreWriter

__all__ = [
    "StoreWriter",
    "Run",
    "RunInfo",
    "TableInfo",
    "open_run",
    "list_runs",
    "StoreError",
    "CorruptFileWarning",
    "MIGRATIONS",
    "DROPPED",
    "SAMPLED_OUT",
    "new_run_id",
    "validate_run_id",
]
