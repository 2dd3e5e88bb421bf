"""Tenants and their API keys, from a TOML or JSON config file.

File shape (TOML; JSON is the same structure)::

    [tenants.acme]
    api_keys = ["sk-acme-1", "sk-acme-2"]
    weight = 2                         # share under weighted-fair scheduling
    max_concurrency = 8                # running requests at most (optional)
    max_tokens_per_s = 2000            # token bucket (optional)
    burst_tokens = 4000                # bucket size (optional, needs max_tokens_per_s)
    default_slo_class = "interactive"  # when a request names none (optional)

    [tenants.batchco]
    api_keys = ["sk-batch-1"]
    default_slo_class = "batch"

    [admin]
    api_keys = ["sk-ops-1"]            # may read /metrics and /health in full (optional)

:func:`load_tenants` returns the engine's :class:`TenantConfig` list (for the
``EngineConfig`` the backend is built from), the key -> tenant map and the per-tenant
default SLO class. :class:`TenantAuth` is what the gateway checks requests against
(:meth:`TenantAuth.from_file` also reads the admin keys). With tenants configured,
``/metrics`` and ``/health`` show everything only to an admin key; a tenant's key sees
its own series and the overall status, and no key gets 401.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference_server.engine import TenantConfig

__all__ = ["DEFAULT_TENANT", "TenantAuth", "load_tenants", "parse_tenants", "parse_admin_keys"]

DEFAULT_TENANT = "default"  # the tenant of every request when auth is off
_TENANT_FIELDS = ("weight", "max_concurrency", "max_tokens_per_s", "burst_tokens")
_KNOWN_KEYS = frozenset({"api_keys", "default_slo_class", *_TENANT_FIELDS})
_TOP_LEVEL = ("tenants", "admin")


def _read_document(path: str | Path) -> tuple[Path, Any]:
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"cannot read tenants file {file}: {reason}") from None
    try:
        return file, json.loads(text) if file.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ValueError(f"tenants file {file}: syntax error: {exc}") from None


def load_tenants(path: str | Path) -> tuple[list[TenantConfig], dict[str, str], dict[str, str]]:
    """Read a tenants file (``.toml`` or ``.json``, chosen by suffix; other suffixes are
    tried as TOML). Returns ``(tenants, api_key -> tenant name, tenant name -> default SLO
    class)``. Raises ``ValueError`` naming the file and the problem (missing file, syntax
    error, unknown field, wrong type, an empty key list, a key shared by two tenants, no
    tenants)."""
    file, raw = _read_document(path)
    try:
        return parse_tenants(raw)
    except ValueError as exc:
        raise ValueError(f"tenants file {file}: {exc}") from None


def parse_tenants(raw: Any) -> tuple[list[TenantConfig], dict[str, str], dict[str, str]]:
    """:func:`load_tenants` on an already-parsed document (``{"tenants": {name: {...}}}``)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("tenants"), Mapping) or not raw["tenants"]:
        raise ValueError("expected a non-empty 'tenants' table")
    unknown_tables = sorted(str(k) for k in raw if k not in _TOP_LEVEL)
    if unknown_tables:
        raise ValueError(f"unknown top-level field(s) {', '.join(unknown_tables)}; known: {', '.join(_TOP_LEVEL)}")
    tenants: list[TenantConfig] = []
    keys: dict[str, str] = {}
    defaults: dict[str, str] = {}
    for name, entry in raw["tenants"].items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"tenants.{name} must be a table")
        unknown = sorted(set(entry) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"tenants.{name}: unknown field(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted(_KNOWN_KEYS))}")
        tenants.append(_tenant_config(name, entry))
        for key in (_api_keys(name, entry["api_keys"]) if "api_keys" in entry else []):
            if key in keys:
                raise ValueError(f"API key of tenants.{name} is also a key of tenants.{keys[key]}")
            keys[key] = name
        slo = entry.get("default_slo_class")
        if slo is not None:
            if not isinstance(slo, str) or not slo:
                raise ValueError(f"tenants.{name}.default_slo_class must be a non-empty string")
            defaults[name] = slo
    return tenants, keys, defaults


def parse_admin_keys(raw: Any, tenant_keys: Mapping[str, str]) -> frozenset[str]:
    """The ``[admin] api_keys`` of a parsed tenants document (empty if it has no ``admin``
    table). ``ValueError`` for a malformed table, an empty key list or a key that is also a
    tenant's."""
    admin = raw.get("admin") if isinstance(raw, Mapping) else None
    if admin is None:
        return frozenset()
    if not isinstance(admin, Mapping):
        raise ValueError("admin must be a table with api_keys")
    unknown = sorted(str(k) for k in admin if k != "api_keys")
    if unknown:
        raise ValueError(f"admin: unknown field(s) {', '.join(unknown)}; known: api_keys")
    keys = _api_keys("admin", admin.get("api_keys"), prefix="")
    for key in keys:
        if key in tenant_keys:
            raise ValueError(f"an admin API key is also a key of tenants.{tenant_keys[key]}")
    return frozenset(keys)


def _tenant_config(name: str, entry: Mapping[str, Any]) -> TenantConfig:
    kwargs: dict[str, Any] = {}
    for fname in _TENANT_FIELDS:
        value = entry.get(fname)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"tenants.{name}.{fname} must be a number, got {value!r}")
        if fname == "max_concurrency" and not isinstance(value, int):
            raise ValueError(f"tenants.{name}.max_concurrency must be an integer, got {value!r}")
        kwargs[fname] = value if fname == "max_concurrency" else float(value)
    try:
        return TenantConfig(name, **kwargs)
    except ValueError as exc:
        raise ValueError(f"tenants.{name}: {exc}") from None


def _api_keys(name: str, value: Any, *, prefix: str = "tenants.") -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(k, str) and k for k in value):
        raise ValueError(f"{prefix}{name}.api_keys must be a list of non-empty strings")
    if not value:
        raise ValueError(f"{prefix}{name}.api_keys is empty, so no request could use it: list at least one key "
                         f"(or leave api_keys out for a tenant that only configures scheduling)")
    if not all(k.isprintable() and " " not in k and k.isascii() for k in value):
        raise ValueError(f"{prefix}{name}.api_keys must be printable ASCII without spaces (they travel in an "
                         f"HTTP header)")
    return value


@dataclass(frozen=True, slots=True)
class TenantAuth:
    """API keys -> tenants for the gateway. ``keys`` ``None`` turns auth off: every request
    is tenant ``default_tenant``. ``default_slo_classes`` maps a tenant to the SLO class its
    requests get when they name none; others get ``default_slo_class``."""

    keys: Mapping[str, str] | None = None
    default_slo_classes: Mapping[str, str] = field(default_factory=dict)
    default_tenant: str = DEFAULT_TENANT
    default_slo_class: str = "interactive"
    admin_keys: frozenset[str] = frozenset()  # may read /metrics and /health in full

    @classmethod
    def from_file(cls, path: str | Path, *, default_slo_class: str = "interactive") -> TenantAuth:
        """Auth on, with the keys, defaults and admin keys of a tenants file."""
        file, raw = _read_document(path)
        try:
            _, keys, defaults = parse_tenants(raw)
            admin = parse_admin_keys(raw, keys)
        except ValueError as exc:
            raise ValueError(f"tenants file {file}: {exc}") from None
        return cls(keys=keys, default_slo_classes=defaults, default_slo_class=default_slo_class, admin_keys=admin)

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization`` header value (``Bearer <key>``); ``None``
        when auth is on and the key is missing or unknown."""
        if self.keys is None:
            return self.default_tenant
        key = _bearer_key(authorization)
        return None if key is None else self.keys.get(key)

    def is_admin(self, authorization: str | None) -> bool:
        """Whether the header carries an admin key (always True when auth is off)."""
        if self.keys is None:
            return True
        key = _bearer_key(authorization)
        return key is not None and key in self.admin_keys

    def slo_class_for(self, tenant: str) -> str:
        """The default SLO class of ``tenant``."""
        return self.default_slo_classes.get(tenant, self.default_slo_class)


def _bearer_key(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    return key.strip() if scheme.lower() == "bearer" else None
