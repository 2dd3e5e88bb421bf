"""The crash journal: rows a writer holds in memory, also on disk, so a killed process loses
only what its recorder had not handed over yet (the last fraction of a second).

A :class:`~tokentrace.store.writer.StoreWriter` cuts a Parquet part every few seconds
(each part has a fixed cost); between two parts its rows sit in memory. So that a
SIGKILLed process (or a whole deployment killed at once) loses only what its recorder
had not yet handed over, every batch handed to the writer is also appended to a
journal file next to the part it will become::

    <run>/<table>/instance=<writer_id>/journal-000007.arrows   rows of the future part-000007.parquet
    <run>/journal.d/<writer_id>.lock                          held (flock) while the writer lives

Each journal file is a sequence of records ``magic | length | crc32 | payload``; a
payload is a one-line JSON header (column names, row count, the writing instance, the
text of the string ids) followed by the recorder's raw int64 rows, as they sat in its
buffer, so journaling costs a copy, not an Arrow conversion. Appends are single
``os.write`` calls on an ``O_APPEND`` descriptor: the bytes are in the kernel's page
cache as soon as the call returns, so they survive the process (not a power loss: no
``fsync``, as for the parts). A torn last record (the machine died mid-write) fails its
length or checksum and ends the journal there.

When the writer commits a part it writes ``part-<n>.parquet`` (temporary name, rename)
and then deletes ``journal-<n>.arrows``. A reader that finds a journal whose writer is
gone (its lock file is not locked: the kernel drops an ``flock`` when the process dies,
however it dies) turns it into ``part-<n>.parquet`` (:func:`recover_run`), unless that
part already exists (the writer died between the rename and the delete), and records
what it recovered in the writer's manifest fragment. A read-only store cannot be
recovered in place: the reader warns and reads the parts only.

Set-up and flush-thread code; never on a hot path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import warnings
import zlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokentrace.schema import NULL_INT, TABLES, Table, col
from tokentrace.store.batches import prepare_batch
from tokentrace.store.files import with_run_column
from tokentrace.store.layout import FRAGMENT_DIR, PARTITION_KEY, atomic_write_bytes, part_name, temp_path_for
from tokentrace.store.manifest import CorruptFileWarning

__all__ = [
    "JOURNAL_DIR",
    "TableJournal",
    "WriterLock",
    "RecoveryReport",
    "encode_rows",
    "journal_name",
    "journal_number",
    "read_journal",
    "recover_run",
    "unrecovered_journals",
]

JOURNAL_DIR = "journal.d"
"""Folder of the writers' lock files (``<writer_id>.lock``)."""

_PREFIX = "journal-"
_SUFFIX = ".arrows"
_DIGITS = 6  # as part numbers
_MAGIC = b"TTJ1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32 of the payload
_COMPRESSION = "zstd"


def journal_name(number: int) -> str:
    """File name of the journal of part ``number``: ``journal-000007.arrows``."""
    return f"{_PREFIX}{number:0{_DIGITS}d}{_SUFFIX}"


def journal_number(name: str) -> int | None:
    """The part number of a journal file name, or ``None`` if it is not one."""
    if not (name.startswith(_PREFIX) and name.endswith(_SUFFIX)):
        return None
    digits = name[len(_PREFIX):-len(_SUFFIX)]
    return int(digits) if digits.isdigit() else None


def encode_rows(fields: Sequence[str], rows: array, strings: Mapping[str, Mapping[int, str]],
                instance_id: int) -> bytes:
    """One journal record: the recorder's raw rows and what their string ids stand for.

    ``rows`` are row-major int64 values of the columns ``fields`` (the table's columns but
    ``instance_id``); the record keeps them as they are, after a small JSON header (the
    fields, the row count, ``instance_id`` and ``strings``), so journaling costs a copy, not
    a conversion. :func:`read_journal` turns records back into the table's rows.
    """
    width = len(fields)
    head = json.dumps({"fields": list(fields), "rows": len(rows) // width, "instance": instance_id,
                       "strings": {k: {str(i): v for i, v in m.items()} for k, m in strings.items()}},
                      separators=(",", ":"), ensure_ascii=True).encode()
    payload = head + b"\n" + rows.tobytes()
    return _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload)) + payload


def read_journal(path: Path, table: Table) -> tuple[pa.Table | None, bool]:
    """The rows of a journal file as ``table``'s rows, and whether it ended cleanly (False: a
    torn or bad record, where reading stopped).

    Rows whose coded or narrow columns are out of range are left out, as the recorder
    leaves them out of a part. ``OSError`` if the file cannot be read.
    """
    data = path.read_bytes()
    parts: list[pa.Table] = []
    pos = 0
    clean = True
    while pos < len(data):
        if len(data) - pos < _HEADER.size:
            clean = False
            break
        magic, length, crc = _HEADER.unpack_from(data, pos)
        payload = data[pos + _HEADER.size: pos + _HEADER.size + length]
        if magic != _MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
            clean = False
            break
        try:
            parts.append(_decode_record(table, payload))
        except (ValueError, KeyError, TypeError, pa.ArrowException):
            clean = False
            break
        pos += _HEADER.size + length
    if not parts:
        return None, clean
    return (parts[0] if len(parts) == 1 else pa.concat_tables(parts)), clean


def _decode_record(table: Table, payload: bytes) -> pa.Table:
    head_bytes, _, raw = payload.partition(b"\n")
    head = json.loads(head_bytes)
    fields, num_rows, instance_id = list(head["fields"]), int(head["rows"]), int(head["instance"])
    # As the recorder writes them: a lone surrogate (no UTF-8 form) kept as its escape.
    strings = {k: {int(i): str(v).encode("utf-8", "backslashreplace").decode("utf-8") for i, v in m.items()}
               for k, m in dict(head["strings"]).items()}
    values = np.frombuffer(raw, dtype=np.int64)
    if values.size != num_rows * len(fields):
        raise ValueError("the rows do not match the record's header")
    matrix = values.reshape(num_rows, len(fields))
    position = {name: j for j, name in enumerate(fields)}
    keep = np.ones(num_rows, dtype=bool)
    arrays: dict[str, Any] = {}
    for c in table.columns:
        if c.name == col.INSTANCE_ID:
            arrays[c.name] = pa.array(np.full(num_rows, instance_id, dtype=np.int64))
            continue
        column = matrix[:, position[c.name]]  # KeyError: a record of another layout
        if pa.types.is_string(c.type):
            names = strings.get(c.name, {})
            arrays[c.name] = pa.array([names.get(i, "") for i in column.tolist()], type=pa.string())
            continue
        keep &= _in_range(column, c)
        arrays[c.name] = pa.array(column)
    data = pa.table(arrays)
    if not keep.all():
        data = data.filter(pa.array(keep))
    return prepare_batch(table, data)


def _in_range(values: np.ndarray, c: Any) -> np.ndarray:
    """Rows whose value fits column ``c`` (its enum's members, or its integer type; -1 if nullable)."""
    if c.enum is not None:
        ok = np.isin(values, [int(m) for m in c.enum])
    elif c.type == pa.int8():
        ok = (values >= -(2**7)) & (values < 2**7)
    elif c.type == pa.int32():
        ok = (values >= -(2**31)) & (values < 2**31)
    else:
        return np.ones(values.shape, dtype=bool)
    return ok | (values == NULL_INT) if c.nullable else ok


class WriterLock:
    """``<run>/journal.d/<writer_id>.lock``, held with ``flock`` while the writer lives.

    ``flock`` locks belong to the open file description, so a reader in the same
    process (a second ``open``) sees the lock as taken, and the kernel releases it
    when the process dies, even by SIGKILL. Raises ``OSError`` when the file cannot
    be created or locked (then the writer runs without a journal).
    """

    def __init__(self, run_dir: Path, writer_id: int) -> None:
        folder = run_dir / JOURNAL_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{writer_id}.lock"
        # Locked under a temporary name, then renamed into place: a reader never sees this
        # writer's lock file unlocked (it would take the writer for dead).
        tmp = temp_path_for(self.path)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, self.path)
        except OSError:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        self._fd: int | None = fd

    def release(self, *, remove: bool) -> None:
        """Unlock (and with ``remove``, delete the lock file first); idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        if remove:
            _unlink_quietly(self.path)
        os.close(fd)

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptor (the parent keeps its lock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class TableJournal:
    """The open journal of one table's next part (one writer; calls under the writer's lock)."""

    __slots__ = ("path", "number", "_fd", "broken")

    def __init__(self, partition: Path, number: int) -> None:
        self.path = partition / journal_name(number)
        self.number = number
        self._fd: int | None = None
        self.broken = False  # an append failed: later records would sit behind a bad one

    def append(self, record: bytes) -> None:
        """Append one record; ``OSError`` (and the journal is marked broken) if it fails."""
        if self.broken:
            return
        try:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            written = os.write(self._fd, record)
            if written != len(record):
                raise OSError(errno.ENOSPC, f"short write to {self.path} ({written} of {len(record)} bytes)")
        except OSError:
            self.broken = True
            raise

    def discard(self) -> None:
        """Close and delete the file (its rows are in a part now, or are given up)."""
        self.close()
        _unlink_quietly(self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def forget_in_child(self) -> None:
        """In a forked child: close the inherited descriptor, never touching the file."""
        self.close()


@dataclass(frozen=True, slots=True)
class RecoveryReport:
    """What :func:`recover_run` did: rows turned into parts, journals it could not recover."""

    recovered_rows: dict[str, int]  # table name -> rows recovered
    num_files: int  # journal files turned into parts (or found already committed)
    unrecoverable: tuple[str, ...] = ()  # one sentence each


def unrecovered_journals(run_dir: Path) -> dict[int, list[tuple[Table, Path]]]:
    """Journal files of a run by writer id (live writers' included)."""
    found: dict[int, list[tuple[Table, Path]]] = {}
    for table in TABLES.values():
        table_dir = run_dir / table.name
        if not table_dir.is_dir():
            continue
        for partition in table_dir.iterdir():
            prefix = f"{PARTITION_KEY}="
            if not partition.name.startswith(prefix) or not partition.name[len(prefix):].isdigit():
                continue
            for f in partition.iterdir():
                if journal_number(f.name) is not None and f.is_file():
                    found.setdefault(int(partition.name[len(prefix):]), []).append((table, f))
    return found


def recover_run(run_dir: Path) -> RecoveryReport:
    """Turn the journals of writers that died into parts (see the module docstring).

    Journals of live writers (lock held) are left alone. Never raises for I/O
    problems: a journal that cannot be recovered (read-only store, unreadable file)
    is named in ``unrecoverable`` and warned about (``CorruptFileWarning``).
    """
    recovered: dict[str, int] = {}
    num_files = 0
    problems: list[str] = []
    pending = unrecovered_journals(run_dir)
    for writer_id in _locked_writers(run_dir):  # a writer that left its lock file but no journal: note it too
        pending.setdefault(writer_id, [])
    for writer_id, journals in sorted(pending.items()):
        lock = _lock_dead_writer(run_dir, writer_id)
        if lock is None:
            continue  # alive (or another reader is recovering it right now)
        fd, writable = lock
        try:
            if fd is None or not writable:
                if not journals:
                    continue  # a dead writer with nothing journaled: nothing to recover
                problems.append(f"run {run_dir.name}: {len(journals)} journal file(s) of writer {writer_id}, "
                                f"which ended without closing, cannot be recovered in a read-only store; "
                                f"open the store once with write access to recover them")
                continue
            rows = _recover_writer(run_dir, writer_id, journals, problems)
            num_files += len(journals)
            for name, n in rows.items():
                recovered[name] = recovered.get(name, 0) + n
            _note_in_fragment(run_dir, writer_id, rows, problems)
            _unlink_quietly(run_dir / JOURNAL_DIR / f"{writer_id}.lock")
        finally:
            if fd is not None:
                os.close(fd)
    for message in problems:
        warnings.warn(message, CorruptFileWarning, stacklevel=3)
    return RecoveryReport(recovered, num_files, tuple(problems))


def _locked_writers(run_dir: Path) -> list[int]:
    """Writer ids with a lock file (live writers, and writers that died without closing)."""
    folder = run_dir / JOURNAL_DIR
    if not folder.is_dir():
        return []
    return [int(f.stem) for f in folder.iterdir() if f.suffix == ".lock" and f.stem.isdigit()]


def _lock_dead_writer(run_dir: Path, writer_id: int) -> tuple[int | None, bool] | None:
    """``(descriptor holding the writer's lock, store writable)`` if the writer is gone, else None.

    In a read-only store a missing lock file cannot be created: the descriptor is None
    then (the writer is gone: a live writer creates its lock before any journal).
    """
    path = run_dir / JOURNAL_DIR / f"{writer_id}.lock"
    writable = os.access(run_dir, os.W_OK)
    try:
        if writable:
            path.parent.mkdir(exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, False
    except OSError:
        return None if writable else (None, False)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd, writable


def _recover_writer(run_dir: Path, writer_id: int, journals: list[tuple[Table, Path]],
                    problems: list[str]) -> dict[str, int]:
    rows: dict[str, int] = {}
    for table, path in sorted(journals, key=lambda item: (item[0].name, item[1].name)):
        final = path.with_name(part_name(journal_number(path.name) or 0))
        if final.exists():  # the writer committed this part and died before deleting the journal
            _unlink_quietly(path)
            continue
        try:
            data, clean = read_journal(path, table)
        except FileNotFoundError:
            continue  # another reader recovered it a moment ago
        except OSError as err:
            problems.append(f"cannot recover journal {path}: {err}")
            continue
        num_rows = 0 if data is None else data.num_rows
        try:
            if data is not None and num_rows:
                _write_part(with_run_column(data, run_dir.name), final)
                rows[table.name] = rows.get(table.name, 0) + num_rows
            if not clean:
                problems.append(f"journal {path} ends in a damaged record; the {num_rows} rows before it "
                                f"were recovered")
            _unlink_quietly(path)
        except (OSError, pa.ArrowException) as err:
            problems.append(f"cannot recover journal {path}: {err}")
    return rows


def _write_part(data: pa.Table, final: Path) -> None:
    tmp = temp_path_for(final)
    try:
        pq.write_table(data, tmp, compression=_COMPRESSION)
        os.replace(tmp, final)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def _note_in_fragment(run_dir: Path, writer_id: int, rows: dict[str, int], problems: list[str]) -> None:
    """Mark the dead writer's manifest fragment ``ended_without_closing`` with its ``recovered_rows``
    (it cannot do it any more)."""
    path = run_dir / FRAGMENT_DIR / f"{writer_id}.json"
    if not path.exists():
        return  # a writer that died before its first fragment: nothing to note it in
    try:
        frag = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(frag, dict) or (frag.get("closed") is True and not rows):
            return
        previous = frag.get("recovered_rows") if isinstance(frag.get("recovered_rows"), dict) else {}
        merged = {k: int(v) for k, v in previous.items() if isinstance(v, int)}
        for name, n in rows.items():
            merged[name] = merged.get(name, 0) + n
        frag["recovered_rows"] = dict(sorted(merged.items()))
        frag["ended_without_closing"] = frag.get("closed") is not True
        atomic_write_bytes(path, (json.dumps(frag, indent=2, sort_keys=True) + "\n").encode())
    except (OSError, ValueError) as err:
        problems.append(f"recovered rows of writer {writer_id} but could not note it in {path}: {err}")


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
