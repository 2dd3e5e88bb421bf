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

Integrity and concurrency:

* **verified before use**: beside each file, ``<name>.parquet.sum`` holds the CRC-32 and the
  length of its bytes, written before the file is renamed into place (a checksum made for
  accidental damage, and at twice the speed of a cryptographic digest: the sidecar lies beside
  the file, so a digest would guard against nothing more); a file whose bytes do not
  match (a disk error, a partial copy, bytes overwritten in the middle) is stale, never read.
  :func:`read_derived` checks every current file, or (``verify=False``) leaves the check to
  :meth:`DerivedFile.is_intact`, taken by the reader before it first reads that file, so an
  analysis hashes only the files it reads;
* **one writer at a time**: writing and removing hold an exclusive lock on
  ``<run>/_derived.lock`` (``flock``), so two processes deriving at once take turns instead
  of deleting each other's files;
* **readers see a snapshot**: :func:`read_derived` hard-links each current file to a
  private name (``<fact>.parquet.snap-<pid>-<random>``, not hidden: Spark skips files whose
  names start with a dot) and returns that path. Writers only ever replace or
  remove the public names, so a reader's file stays whole and in place however the facts
  are rewritten or removed meanwhile; a snapshot is removed when its :class:`DerivedFile`
  is dropped, at exit, or by the next writer once its process is gone;
* **the fingerprint sees rewrites**: each part's inode and change time (``ctime``, which no
  tool can set back) are part of it, so a part rewritten to the same size with its
  modification time restored makes the facts stale. (Copying a store elsewhere does too:
  the facts are derived again there.)

The leading ``_`` keeps the folder out of table listings (``Run.tables``) and out of
Hive-style dataset globs of other engines. This module names paths and moves Arrow
tables; what the facts hold is decided by :mod:`analyzers.derivation`.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import secrets
import weakref
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tokentrace.schema import TABLES
from tokentrace.store.layout import atomic_write, atomic_write_bytes, part_files

__all__ = ["held_copy", "DERIVED_DIR", "DerivedFile", "parts_fingerprint", "read_derived", "write_derived", "remove_derived"]

DERIVED_DIR = "_derived"
"""Folder of a run's derived tables."""

_FINGERPRINT_KEY = b"tokentrace.derived.fingerprint"
_FORMAT_KEY = b"tokentrace.derived.format"
_EXTRA_PREFIX = b"tokentrace.derived.extra."
_SUFFIX = ".parquet"
_SUM_SUFFIX = ".sum"  # <name>.parquet.sum: the digest of <name>.parquet's bytes
_SNAPSHOT_MARK = ".snap-"  # <name>.parquet.snap-<pid>-<random>: one reader's view of a derived file
_LOCK_NAME = "_derived.lock"  # in the run's folder, beside _derived (which removal deletes)
_COMPRESSION = "zstd"
_READ_CHUNK = 1 << 20  # bytes hashed per read


@dataclass(frozen=True, slots=True, weakref_slot=True)
class DerivedFile:
    """One current derived table of a run: its file and the extra metadata it was written with.

    ``path`` is this reader's snapshot of the file (in place until this object is dropped), or the file
    itself where the file system has no hard links. ``digest``: the digest recorded beside the file when it
    was written ("" once verified by :func:`read_derived`); :meth:`is_intact` checks the snapshot against it."""

    name: str
    path: Path
    extra: dict[str, str]
    digest: str = ""

    def is_intact(self) -> bool:
        """Whether the snapshot's bytes have the recorded digest (reads the whole file; True when
        :func:`read_derived` verified it already)."""
        return not self.digest or _verified(self.path, self.digest.encode())


def _digest_of(path: Path) -> str:
    """``crc32:<CRC-32 of the bytes, 8 hex digits>:<length>``."""
    crc, length = 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_READ_CHUNK):
            crc = zlib.crc32(chunk, crc)
            length += len(chunk)
    return f"crc32:{crc:08x}:{length}"


@contextlib.contextmanager
def _writer_lock(run: Path) -> Iterator[None]:
    """Hold the run's derived-facts lock (exclusive, blocking) for the block; a no-op where
    ``flock`` does not exist."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fd = os.open(run / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


_live_snapshots: set[str] = set()  # this process's snapshot paths, removed at exit (a reader killed leaves them
# to the next writer, which removes those of processes that are gone)


def _drop_snapshot(path: str) -> None:
    _live_snapshots.discard(path)
    with contextlib.suppress(OSError):
        os.unlink(path)


atexit.register(lambda: [_drop_snapshot(p) for p in list(_live_snapshots)])


def _snapshot(f: Path) -> Path | None:
    """A private hard link to ``f`` (None: no hard links here, or ``f`` is gone)."""
    snap = f.with_name(f"{f.name}{_SNAPSHOT_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.link(f, snap)
    except OSError:
        return None
    _live_snapshots.add(str(snap))
    return snap


def _is_snapshot(name: str) -> bool:
    return _SNAPSHOT_MARK in name


def _is_orphan_snapshot(name: str) -> bool:
    """A snapshot whose process is gone."""
    pid = name.rsplit(_SNAPSHOT_MARK, 1)[-1].split("-", 1)[0]
    if not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, someone else's
        return False
    return False


def _verified(f: Path, expected: bytes) -> bool:
    """Whether ``f``'s bytes have the digest its sidecar recorded."""
    try:
        return _digest_of(f) == expected.decode("ascii", "replace").strip()
    except OSError:
        return False


def parts_fingerprint(run_path: str | os.PathLike[str]) -> str:
    """A digest of every finished part file of the run (table, relative path, size, mtime and ctime in ns,
    inode).

    Changes when a part is added, removed, rewritten or recovered, also when rewritten to the same size
    with its modification time set back (the change time cannot be); costs one ``stat`` per part.
    """
    run = Path(run_path)
    digest = hashlib.sha256()
    for name in TABLES:
        for f in part_files(run / name):
            try:
                st = f.stat()
            except OSError:  # removed while listing: the fingerprint will not match a later one either
                continue
            digest.update(f"{f.relative_to(run).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
                          f"{st.st_ino}\n".encode())
    return digest.hexdigest()


def read_derived(run_path: str | os.PathLike[str], fingerprint: str, format_key: str, *,
                 verify: bool = True) -> dict[str, DerivedFile]:
    """The run's derived tables written for exactly these part files (``fingerprint``) and ``format_key``,
    each returned as this reader's snapshot (see the module doc) and verified against its recorded digest.

    Stale, unreadable and foreign files are left out (never raises for them); so are corrupted ones, where
    ``verify`` (reads each current file once, for its digest, and the footers of the others). With
    ``verify=False`` only the footers are read: the caller checks :meth:`DerivedFile.is_intact` before it
    reads a file.
    """
    folder = Path(run_path) / DERIVED_DIR
    if not folder.is_dir():
        return {}
    found: dict[str, DerivedFile] = {}
    for f in sorted(folder.iterdir()):
        if not f.name.endswith(_SUFFIX) or f.name.startswith(".") or not f.is_file():
            continue
        try:
            expected = (f.parent / (f.name + _SUM_SUFFIX)).read_bytes()
        except OSError:
            continue  # written before digests were recorded, or its digest is gone: derived afresh
        snap = _snapshot(f)
        path = snap or f
        try:
            meta = pq.read_schema(path).metadata or {}
        except (OSError, pa.ArrowInvalid):
            meta = {}
        current = meta.get(_FINGERPRINT_KEY) == fingerprint.encode() and meta.get(_FORMAT_KEY) == format_key.encode()
        if not current or (verify and not _verified(path, expected)):
            if snap is not None:
                _drop_snapshot(str(snap))
            continue
        extra = {k[len(_EXTRA_PREFIX):].decode(): v.decode() for k, v in meta.items() if k.startswith(_EXTRA_PREFIX)}
        name = f.name[: -len(_SUFFIX)]
        digest = "" if verify else (expected.decode("ascii", "replace").strip() or "-")  # "-": matches no file
        found[name] = DerivedFile(name, path, extra, digest)
        if snap is not None:
            weakref.finalize(found[name], _drop_snapshot, str(snap))
    return found


def held_copy(path: str | os.PathLike[str]) -> DerivedFile | None:
    """This reader's snapshot of a derived file it has just written (see the module doc): in place until the
    returned object is dropped, whatever another process does to the public name meanwhile. None when the file
    is gone already (another process removed it) or the file system has no hard links."""
    f = Path(path)
    snap = _snapshot(f)
    if snap is None:
        return None
    held = DerivedFile(f.name[: -len(_SUFFIX)], snap, {})
    weakref.finalize(held, _drop_snapshot, str(snap))
    return held


def write_derived(run_path: str | os.PathLike[str], name: str, data: pa.Table | pa.RecordBatchReader, *,
                  fingerprint: str, format_key: str, extra: dict[str, str] | None = None) -> Path:
    """Write ``data`` (a table, or a stream of record batches) as the run's derived table ``name``, replacing an
    older one, whole or not at all, with the digest of its bytes beside it; under the run's derived-facts
    lock (another process writing waits its turn).

    ``fingerprint``: :func:`parts_fingerprint` taken *before* the part files were read, so that a part added
    meanwhile leaves the file stale rather than wrongly current. ``extra``: small string metadata read back by
    :func:`read_derived`. ``OSError`` when the store is not writable (then nothing changes); ``ValueError`` for
    a name that is not a plain identifier.
    """
    if not name.isidentifier():
        raise ValueError(f"derived table name must be an identifier, got {name!r}")
    run = Path(run_path)
    folder = run / DERIVED_DIR
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
        # The digest goes in first: a reader between the two renames sees a mismatch (stale), never a
        # wrong file taken as verified.
        atomic_write_bytes(folder / (final.name + _SUM_SUFFIX), _digest_of(tmp).encode())

    with _writer_lock(run):
        folder.mkdir(exist_ok=True)
        _remove_orphan_snapshots(folder)
        atomic_write(final, write)
    return final


def _remove_orphan_snapshots(folder: Path) -> None:
    for f in folder.iterdir():
        if _is_snapshot(f.name) and _is_orphan_snapshot(f.name):
            with contextlib.suppress(OSError):
                f.unlink()


def remove_derived(run_path: str | os.PathLike[str]) -> int:
    """Delete the run's derived tables (they are a cache; the raw tables are untouched), under the run's
    derived-facts lock. Readers' snapshots of live processes stay (the folder then too). Returns the
    tables removed."""
    run = Path(run_path)
    folder = run / DERIVED_DIR
    if not folder.is_dir():
        return 0
    removed = 0
    with _writer_lock(run):
        try:
            entries = list(folder.iterdir())
        except FileNotFoundError:  # another process removed them while this one waited for the lock
            return 0
        for f in entries:
            if not f.is_file() or (_is_snapshot(f.name) and not _is_orphan_snapshot(f.name)):
                continue
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                removed += f.name.endswith(_SUFFIX) and not f.name.startswith(".")
        try:
            folder.rmdir()
        except OSError:
            pass
    return removed
