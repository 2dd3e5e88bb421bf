"""Derived tables: facts computed from a run's part files, kept next to the run as a cache.

A run's raw tables are what its processes recorded; analyses first derive per-token
and per-request facts from them (token intervals on the reference clock, per-request
latencies, per-token stage sums). On a big run that derivation is most of the cost
of an analysis, so it can be written once and read back::

    <store>/<run_id>/_derived/<name>.parquet

Each file is written whole (temporary name, then rename) and carries in its Parquet
metadata the **fingerprint** of the part files it was derived from (every finished
part of every table: path, size, modification time) and a **format** key (what the
deriving code produces: its version and the stages it knew). A derived file whose
fingerprint or format is not the current one is stale and is never read: a new part
(a live run, a recovered crash journal, a late writer) or other analysis code makes
the raw tables the only source again until the facts are derived afresh. The raw
tables always win; a derived table is a cache of what they say.

The leading ``_`` keeps the folder out of table listings (``Run.tables``) and out of
Hive-style dataset globs of other engines. This module names paths and moves Arrow
tables; what the facts hold is decided by :mod:`analyzers.derivation`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokentrace.schema import TABLES
from tokentrace.store.layout import atomic_write, part_files

__all__ = ["DERIVED_DIR", "DerivedFile", "parts_fingerprint", "read_derived", "write_derived", "remove_derived"]

DERIVED_DIR = "_derived"
"""Folder of a run's derived tables."""

_FINGERPRINT_KEY = b"tokentrace.derived.fingerprint"
_FORMAT_KEY = b"tokentrace.derived.format"
_EXTRA_PREFIX = b"tokentrace.derived.extra."
_SUFFIX = ".parquet"
_COMPRESSION = "zstd"


@dataclass(frozen=True, slots=True)
class DerivedFile:
    """One current derived table of a run: its file and the extra metadata it was written with."""

    name: str
    path: Path
    extra: dict[str, str]


def parts_fingerprint(run_path: str | os.PathLike[str]) -> str:
    """A digest of every finished part file of the run (table, relative path, size, mtime in ns).

    Changes when a part is added, removed, rewritten or recovered; costs one ``stat`` per part.
    """
    run = Path(run_path)
    digest = hashlib.sha256()
    for name in TABLES:
        for f in part_files(run / name):
            try:
                st = f.stat()
            except OSError:  # removed while listing: the fingerprint will not match a later one either
                continue
            digest.update(f"{f.relative_to(run).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def read_derived(run_path: str | os.PathLike[str], fingerprint: str, format_key: str) -> dict[str, DerivedFile]:
    """The run's derived tables written for exactly these part files (``fingerprint``) and ``format_key``.

    Stale, unreadable and foreign files are left out (never raises for them). Reads only Parquet footers.
    """
    folder = Path(run_path) / DERIVED_DIR
    if not folder.is_dir():
        return {}
    found: dict[str, DerivedFile] = {}
    for f in sorted(folder.iterdir()):
        if not f.name.endswith(_SUFFIX) or f.name.startswith(".") or not f.is_file():
            continue
        try:
            meta = pq.read_schema(f).metadata or {}
        except (OSError, pa.ArrowInvalid):
            continue
        if meta.get(_FINGERPRINT_KEY) != fingerprint.encode() or meta.get(_FORMAT_KEY) != format_key.encode():
            continue
        extra = {k[len(_EXTRA_PREFIX):].decode(): v.decode() for k, v in meta.items() if k.startswith(_EXTRA_PREFIX)}
        name = f.name[: -len(_SUFFIX)]
        found[name] = DerivedFile(name, f, extra)
    return found


def write_derived(run_path: str | os.PathLike[str], name: str, data: pa.Table | pa.RecordBatchReader, *,
                  fingerprint: str, format_key: str, extra: dict[str, str] | None = None) -> Path:
    """Write ``data`` (a table, or a stream of record batches) as the run's derived table ``name``, replacing an
    older one, whole or not at all.

    ``fingerprint``: :func:`parts_fingerprint` taken *before* the part files were read, so that a part added
    meanwhile leaves the file stale rather than wrongly current. ``extra``: small string metadata read back by
    :func:`read_derived`. ``OSError`` when the store is not writable (then nothing changes); ``ValueError`` for
    a name that is not a plain identifier.
    """
    if not name.isidentifier():
        raise ValueError(f"derived table name must be an identifier, got {name!r}")
    folder = Path(run_path) / DERIVED_DIR
    folder.mkdir(exist_ok=True)
    meta = dict(data.schema.metadata or {})
    meta[_FINGERPRINT_KEY] = fingerprint.encode()
    meta[_FORMAT_KEY] = format_key.encode()
    for k, v in (extra or {}).items():
        meta[_EXTRA_PREFIX + k.encode()] = v.encode()
    final = folder / f"{name}{_SUFFIX}"

    def write(tmp: Path) -> None:
        with pq.ParquetWriter(tmp, data.schema.with_metadata(meta), compression=_COMPRESSION) as out:
            for batch in data.to_batches() if isinstance(data, pa.Table) else data:
                out.write_batch(batch)

    atomic_write(final, write)
    return final


def remove_derived(run_path: str | os.PathLike[str]) -> int:
    """Delete the run's derived tables (they are a cache; the raw tables are untouched). Returns files removed."""
    folder = Path(run_path) / DERIVED_DIR
    if not folder.is_dir():
        return 0
    removed = 0
    for f in folder.iterdir():
        if f.is_file():
            f.unlink()
            removed += 1
    try:
        folder.rmdir()
    except OSError:
        pass
    return removed
