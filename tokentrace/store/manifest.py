"""The run manifest: one run-level file plus one fragment per writing process.

Several processes (gateway, prefill and decode workers, forked children) write
one run at the same time, so no file is ever shared between writers:

* ``<run>/manifest.json`` is created once, by whichever writer gets there first
  (:func:`~tokentrace.store.layout.create_once`), and never rewritten. It holds
  what is true of the whole run: id, creation time, versions, platform, config.
* ``<run>/manifest.d/<writer_id>.json`` belongs to one writer, which replaces it
  atomically whenever its content changes: the process's pid and host, the
  traced instances it reported (id, role, name), its counters (dropped,
  sampled-out, ...) as cumulative totals, and what it wrote.

Readers merge them (:func:`read_manifest`): counters are summed over writers,
instances are the union. A fragment that cannot be parsed is skipped with a
warning naming it.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokentrace.schema import MIN_READABLE_SCHEMA_VERSION, SCHEMA_VERSION, Role
from tokentrace.store.layout import FRAGMENT_DIR, MANIFEST_NAME, atomic_write_bytes, create_once
from tokentrace.version import __version__

__all__ = [
    "DROPPED",
    "SAMPLED_OUT",
    "FORMAT",
    "CorruptFileWarning",
    "check_config",
    "run_manifest",
    "write_run_manifest",
    "WriterFragment",
    "read_fragments",
    "read_manifest",
    "manifest_problem",
    "now_iso",
]

FORMAT = "tokentrace-run"
"""Value of the run manifest's ``format`` key."""

DROPPED = "dropped"
"""Counter key: events dropped by the recorder (memory cap, sink errors)."""

SAMPLED_OUT = "sampled_out"
"""Counter key: events deliberately not recorded by sampling."""


class CorruptFileWarning(UserWarning):
    """A store file could not be read and was skipped; the message names the file."""


def now_iso() -> str:
    """Current UTC wall-clock time, ISO 8601 with microseconds and a ``Z``."""
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _tokentrace_version() -> str:
    return __version__


def run_manifest(run_id: str, config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The run-level manifest for a run being created now (JSON-ready)."""
    return {
        "format": FORMAT,
        "run": run_id,
        "created": now_iso(),
        "tokentrace_version": _tokentrace_version(),
        "schema_version": SCHEMA_VERSION,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "config": dict(config or {}),
    }


def _dumps(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def check_config(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return ``config`` as a dict; ``ValueError`` if it is not a JSON-serializable mapping."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a mapping, got {type(config).__name__}")
    try:
        json.dumps(dict(config))
    except (TypeError, ValueError) as err:
        raise ValueError(f"config must be JSON-serializable: {err}") from None
    return dict(config)


def write_run_manifest(run_dir: Path, run_id: str, config: Mapping[str, Any] | None) -> bool:
    """Create ``<run_dir>/manifest.json`` unless it exists; ``True`` if this call created it."""
    return create_once(run_dir / MANIFEST_NAME, _dumps(run_manifest(run_id, config)))


@dataclass(slots=True)
class WriterFragment:
    """One writer's part of the manifest; mutable, owned by one ``StoreWriter``.

    Not thread-safe: the owning writer serializes calls with its lock.
    """

    writer_id: int
    config: dict[str, Any] = field(default_factory=dict)  # what this writer was created with
    parent_writer_id: int | None = None
    pid: int = field(default_factory=os.getpid)
    host: str = field(default_factory=socket.gethostname)
    started: str = field(default_factory=now_iso)
    closed: bool = False
    instances: dict[int, dict[str, str]] = field(default_factory=dict)  # reported: id -> role, name
    instance_ids_seen: set[int] = field(default_factory=set)  # values of the rows' instance_id column
    counters: dict[str, int] = field(default_factory=dict)
    parts_written: dict[str, int] = field(default_factory=dict)
    rows_written: dict[str, int] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # what failed -> the first error, one sentence

    def register_instance(self, instance_id: int, role: Role | str | int, name: str) -> None:
        """Record a traced instance; ``ValueError`` for a bad id or role."""
        if isinstance(instance_id, bool) or not isinstance(instance_id, int) or instance_id < 0:
            raise ValueError(f"instance id must be a non-negative int, got {instance_id!r}")
        self.instances[instance_id] = {"role": _role_label(role), "name": str(name)}

    def update_counters(self, counters: Mapping[str, int]) -> None:
        """Set cumulative totals (replacing earlier values of the same keys)."""
        for key, value in counters.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"counters must map str to int, got {key!r}: {value!r}")
        self.counters.update(counters)

    def note_error(self, action: str, err: BaseException | str) -> bool:
        """Keep the first error of ``action`` (e.g. "writing spans rows"); True if it is the first."""
        if action in self.errors:
            return False
        self.errors[action] = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
        return True

    def add_part(self, table_name: str, num_rows: int, instance_ids: Iterable[int]) -> None:
        """Count one written part file and the instance ids its rows carry."""
        self.parts_written[table_name] = self.parts_written.get(table_name, 0) + 1
        self.rows_written[table_name] = self.rows_written.get(table_name, 0) + num_rows
        self.instance_ids_seen.update(instance_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "writer": self.writer_id,
            "config": self.config,
            "parent_writer": self.parent_writer_id,
            "pid": self.pid,
            "host": self.host,
            "started": self.started,
            "updated": now_iso(),
            "closed": self.closed,
            "instances": [{"instance": k, **v} for k, v in sorted(self.instances.items())],
            "instance_ids_seen": sorted(self.instance_ids_seen),
            "counters": dict(sorted(self.counters.items())),
            "parts_written": dict(sorted(self.parts_written.items())),
            "rows_written": dict(sorted(self.rows_written.items())),
            "errors": dict(sorted(self.errors.items())),
        }

    def save(self, run_dir: Path) -> None:
        """Atomically replace ``<run_dir>/manifest.d/<writer_id>.json``; may raise ``OSError``."""
        folder = run_dir / FRAGMENT_DIR
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"{self.writer_id}.json", _dumps(self.to_json()))


def _role_label(role: Role | str | int) -> str:
    if isinstance(role, Role):
        return role.label
    if isinstance(role, int) and not isinstance(role, bool):
        try:
            return Role(role).label
        except ValueError:
            raise ValueError(f"unknown role code {role}") from None
    if isinstance(role, str):
        return Role.from_label(role).label
    raise ValueError(f"role must be a Role, its label or its code, got {role!r}")


def _load_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        warnings.warn(f"skipping unreadable manifest file {path}: {err}", CorruptFileWarning, stacklevel=3)
        return None
    if not isinstance(data, dict):
        warnings.warn(f"skipping manifest file {path}: not a JSON object", CorruptFileWarning, stacklevel=3)
        return None
    return data


def read_fragments(run_dir: Path) -> list[dict[str, Any]]:
    """Every writer fragment of a run, oldest writer first; bad ones skipped with a warning."""
    folder = run_dir / FRAGMENT_DIR
    if not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        if path.name.startswith("."):
            continue
        data = _load_json(path)
        if data is not None:
            out.append(data)
    out.sort(key=lambda frag: str(frag.get("started", "")))
    return out


def read_manifest(run_dir: Path) -> dict[str, Any]:
    """The merged manifest of a run.

    Keys of the run-level file (empty if it is missing or unreadable), plus
    ``config`` (the run-level file's config, completed with keys that only
    later writers were given: the first writer to name a key wins),
    ``writers`` (the fragments, each with its own ``config``), ``instances`` (one entry per instance id
    seen in written rows or reported with ``register_instance``; role and
    name are ``None`` unless reported; later writers win) and ``counters`` (summed over writers;
    ``dropped`` and ``sampled_out`` always present).
    """
    base: dict[str, Any] = {}
    if (run_dir / MANIFEST_NAME).is_file():
        base = _load_json(run_dir / MANIFEST_NAME) or {}
    fragments = read_fragments(run_dir)
    merged = dict(base)
    merged["writers"] = fragments
    merged["config"] = _merge_configs(base.get("config"), fragments)
    merged["instances"] = _merge_instances(fragments)
    merged["counters"] = _sum_counters(fragments)
    return merged


def _merge_configs(run_config: Any, fragments: list[dict[str, Any]]) -> dict[str, Any]:
    config = dict(run_config) if isinstance(run_config, dict) else {}
    for frag in fragments:
        extra = frag.get("config")
        if isinstance(extra, dict):
            for key, value in extra.items():
                config.setdefault(key, value)
    return config


def _merge_instances(fragments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every instance id seen in rows or reported, with role and name where reported (else None)."""
    by_id: dict[int, dict[str, Any]] = {}
    for frag in fragments:
        where = {"pid": frag.get("pid"), "host": frag.get("host"), "writer": frag.get("writer")}
        for seen in frag.get("instance_ids_seen", []):
            if isinstance(seen, int) and seen not in by_id:
                by_id[seen] = {"instance": seen, "role": None, "name": None, **where}
        for inst in frag.get("instances", []):
            if isinstance(inst, dict) and isinstance(inst.get("instance"), int):
                by_id[inst["instance"]] = {**inst, **where}
    return [by_id[k] for k in sorted(by_id)]


def _sum_counters(fragments: list[dict[str, Any]]) -> dict[str, int]:
    """Counters summed over fragments; a value that is not a count is left out with a warning."""
    total: dict[str, int] = {DROPPED: 0, SAMPLED_OUT: 0}
    for frag in fragments:
        counters = frag.get("counters", {})
        where = f"manifest fragment of writer {frag.get('writer', '?')}"
        if not isinstance(counters, dict):
            warnings.warn(f"{where}: counters must be an object of counts, got {counters!r}; its counters "
                          f"are left out", CorruptFileWarning, stacklevel=4)
            continue
        for key, value in counters.items():
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                total[key] = total.get(key, 0) + value
            else:
                warnings.warn(f"{where}: counter {key!r} is {value!r}, not a count (a non-negative integer); "
                              f"it is left out, so the run's {key} total is not known", CorruptFileWarning,
                              stacklevel=4)
    return dict(sorted(total.items()))


def manifest_problem(manifest: Mapping[str, Any]) -> str | None:
    """Why a run whose merged manifest is ``manifest`` cannot be read by this tokentrace, or None.

    A run-level manifest of another format, or one whose ``schema_version`` is not an
    integer or is newer (older) than this tokentrace reads. A missing run-level manifest
    is no problem (its fragments and parts still describe the run).
    """
    if "format" in manifest and manifest["format"] != FORMAT:
        return f"its manifest is of format {manifest['format']!r}, not {FORMAT!r}"
    if "schema_version" not in manifest and "format" not in manifest:
        return None  # no (readable) run-level manifest
    version = manifest.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        return f"its manifest has an invalid schema version {version!r}"
    if version > SCHEMA_VERSION:
        return (f"its manifest says schema version {version}, newer than this tokentrace reads "
                f"({SCHEMA_VERSION}); upgrade tokentrace")
    if version < MIN_READABLE_SCHEMA_VERSION:
        return (f"its manifest says schema version {version}, older than the oldest readable "
                f"({MIN_READABLE_SCHEMA_VERSION})")
    return None
