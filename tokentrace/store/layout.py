"""Where things live in a store folder, and how files get there whole.

A store is a folder of runs::

    <store>/<run_id>/manifest.json                      run-level, written once at creation
    <store>/<run_id>/manifest.d/<writer_id>.json        one fragment per writing process
    <store>/<run_id>/<table>/instance=<writer_id>/part-<n>.parquet

``<writer_id>`` is the :class:`~tokentrace.store.writer.StoreWriter`'s
``instance_id`` (one per process). Every file is first written under a temporary
name in its final folder (``.tmp-...``) and then renamed with ``os.replace``, so
readers see a file whole or not at all. Names starting with ``.`` or ending in
``.tmp`` are never data. This module only names paths and moves bytes; it knows
nothing of Arrow.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "StoreError",
    "MANIFEST_NAME",
    "FRAGMENT_DIR",
    "validate_run_id",
    "new_run_id",
    "new_instance_id",
    "is_temp_name",
    "part_name",
    "part_number",
    "partition_dir",
    "part_files",
    "temp_path_for",
    "atomic_write",
    "atomic_write_bytes",
    "is_special_file",
    "create_once",
]

MANIFEST_NAME = "manifest.json"
"""Run-level manifest file, written once when the run is created."""

FRAGMENT_DIR = "manifest.d"
"""Folder of per-writer manifest fragments (``<writer_id>.json``)."""

PARTITION_KEY = "instance"
"""Hive partition key of the per-writer folders (``instance=<writer_id>``)."""

_PART_PREFIX = "part-"
_PART_SUFFIX = ".parquet"
_PART_DIGITS = 6  # zero padding, so lexical order is write order up to 10**6 parts
_PART_RE = re.compile(r"^part-(\d+)\.parquet$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_TEMP_PREFIX = ".tmp-"


class StoreError(ValueError):
    """Bad input when opening or reading a store: one sentence saying what is wrong."""


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a usable folder name, else raise ``ValueError``.

    Allowed: letters, digits, ``.``, ``_`` and ``-``; not ``.`` or ``..``, not
    starting with ``.`` (hidden folders are skipped by readers).
    """
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id) or run_id.startswith("."):
        raise ValueError(
            f"invalid run id {run_id!r}: use only letters, digits, '.', '_' and '-', not starting with '.'"
        )
    return run_id


def new_run_id() -> str:
    """A fresh run id that sorts by creation time: ``20261129T101500Z-1a2b3c`` (UTC)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{stamp}-{secrets.token_hex(3)}"


def new_instance_id() -> int:
    """A random positive 63-bit writer id; collisions are negligible (2**-63 per pair)."""
    while True:
        value = secrets.randbits(63)
        if value > 0:
            return value


def is_temp_name(name: str) -> bool:
    """True for names that are never finished data files (temporary or hidden)."""
    return name.startswith(".") or name.endswith(".tmp")


def part_name(number: int) -> str:
    """File name of part ``number`` (1-based): ``part-000001.parquet``."""
    return f"{_PART_PREFIX}{number:0{_PART_DIGITS}d}{_PART_SUFFIX}"


def part_number(name: str) -> int | None:
    """The part number of a finished part file name, or ``None`` if it is not one."""
    match = _PART_RE.match(name)
    return int(match.group(1)) if match else None


def partition_dir(run_dir: Path, table_name: str, writer_id: int) -> Path:
    """``<run_dir>/<table>/instance=<writer_id>``."""
    return run_dir / table_name / f"{PARTITION_KEY}={writer_id}"


def part_files(table_dir: Path) -> list[Path]:
    """Finished part files of one table folder, ordered by (partition, part number).

    Temporary and hidden files are skipped; so is anything that is not named
    like a part file. Returns ``[]`` if the folder does not exist.
    """
    if not table_dir.is_dir():
        return []
    found: list[tuple[str, int, Path]] = []
    for partition in table_dir.iterdir():
        if not partition.is_dir() or is_temp_name(partition.name):
            continue
        if not partition.name.startswith(f"{PARTITION_KEY}="):
            continue
        for f in partition.iterdir():
            number = part_number(f.name)
            if number is not None and f.is_file():
                found.append((partition.name, number, f))
    found.sort(key=lambda item: (item[0], item[1]))
    return [f for _, _, f in found]


def temp_path_for(final: Path) -> Path:
    """A unique temporary name in ``final``'s folder (same file system, so rename is atomic)."""
    return final.with_name(f"{_TEMP_PREFIX}{final.name}.{os.getpid()}.{secrets.token_hex(4)}")


def atomic_write(final: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a temporary file next to ``final``, then rename it into place: readers see the old
    file or the new one, never a part.

    May raise ``OSError`` (disk full, read-only file system) or whatever ``write`` raises; then ``final`` is
    untouched and the temporary file is removed (best effort). A ``final`` that exists and is not a regular
    file (a device such as ``/dev/null`` or ``/dev/full``, a named pipe) is written in place by
    ``write(final)``, its errors raised: renaming over it would replace the device with a file.
    """
    if is_special_file(final):
        write(final)
        return
    tmp = temp_path_for(final)
    try:
        write(tmp)
        os.replace(tmp, final)
    except BaseException:
        _remove_quietly(tmp)
        raise


def is_special_file(path: Path) -> bool:
    """True if ``path`` (links followed) exists and is neither a regular file nor a folder."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def atomic_write_bytes(final: Path, data: bytes) -> None:
    """Write ``data`` to ``final`` atomically (:func:`atomic_write`)."""
    atomic_write(final, lambda tmp: tmp.write_bytes(data))


def create_once(final: Path, data: bytes) -> bool:
    """Create ``final`` with ``data`` unless it exists; atomic and race-free.

    The bytes go to a temporary file that is hard-linked to ``final``; linking
    fails if ``final`` exists, so of several processes creating it at once
    exactly one wins and the file is never seen half-written. Returns ``True``
    if this call created the file. On file systems without hard links it falls
    back to ``O_EXCL`` creation (then a reader racing the creator may briefly
    see a short file; readers treat an unparsable manifest as absent).
    """
    tmp = temp_path_for(final)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        try:
            os.link(tmp, final)
            return True
        except FileExistsError:
            return False
        except OSError:
            return _create_exclusive(final, data)
    finally:
        _remove_quietly(tmp)


def _create_exclusive(final: Path, data: bytes) -> bool:
    try:
        fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return True


def _remove_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
