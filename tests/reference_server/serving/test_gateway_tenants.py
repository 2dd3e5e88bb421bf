from __future__ import annotations

import json
from pathlib import Path

import pytest

from reference_server.engine import TenantConfig
from reference_server.serving.gateway_tenants import TenantAuth, load_tenants

TOML = """
[tenants.acme]
api_keys = ["sk-acme-1", "sk-acme-2"]
weight = 2
max_concurrency = 8
max_tokens_per_s = 2000
default_slo_class = "interactive"

[tenants.batchco]
api_keys = ["sk-batch-1"]
default_slo_class = "batch"

[tenants.default]
"""


def test_load_toml(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TOML)
    tenants, keys, defaults = load_tenants(path)
    assert tenants == [TenantConfig("acme", weight=2.0, max_concurrency=8, max_tokens_per_s=2000.0),
                       TenantConfig("batchco"), TenantConfig("default")]
    assert keys == {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-batch-1": "batchco"}
    assert defaults == {"acme": "interactive", "batchco": "batch"}


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"a": {"api_keys": "k1", "burst_tokens": 10, "max_tokens_per_s": 5}}}))
    tenants, keys, defaults = load_tenants(path)
    assert tenants == [TenantConfig("a", max_tokens_per_s=5.0, burst_tokens=10.0)]
    assert keys == {"k1": "a"} and defaults == {}


@pytest.mark.parametrize(("text", "message"), [
    ("[tenants.a]\nweight = 'heavy'\n", "tenants.a.weight must be a number"),
    ("[tenants.a]\nweight = 0\n", "weight must be > 0"),
    ("[tenants.a]\ncolour = 'red'\n", "unknown field"),
    ("[tenants.a]\napi_keys = ['k']\n[tenants.b]\napi_keys = ['k']\n", "also a key of tenants.a"),
    ("[tenants.a]\napi_keys = [1]\n", "api_keys must be a list"),
    ("[tenants.a]\nmax_concurrency = 1.5\n", "must be an integer"),
    ("title = 'x'\n", "non-empty 'tenants' table"),
    ("[tenants\n", "syntax error"),
    ("[tenants.a]\napi_keys = []\n", "tenants.a.api_keys is empty"),
    ("[tenants.a]\napi_keys = ['k']\n[tenant.b]\n", "unknown top-level field"),
])
def test_bad_files_raise_value_errors_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        load_tenants(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read tenants file"):
        load_tenants(tmp_path / "absent.toml")


def test_auth_resolution(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TOML)
    auth = TenantAuth.from_file(path)
    assert auth.enabled
    assert auth.tenant_for("Bearer sk-acme-2") == "acme"
    assert auth.tenant_for("bearer  sk-batch-1 ") == "batchco"
    assert auth.tenant_for("Bearer sk-nope") is None
    assert auth.tenant_for(None) is None
    assert auth.tenant_for("Basic sk-acme-1") is None
    assert auth.slo_class_for("batchco") == "batch"
    assert auth.slo_class_for("default") == "interactive"


def test_auth_off_serves_everyone_as_default() -> None:
    auth = TenantAuth()
    assert not auth.enabled
    assert auth.tenant_for(None) == "default"
    assert auth.tenant_for("Bearer whatever") == "default"


@pytest.mark.parametrize(("text", "message"), [
    ("[tenants.a]\napi_keys = ['k']\n[admin]\napi_keys = []\n", "admin.api_keys is empty"),
    ("[tenants.a]\napi_keys = ['k']\n[admin]\napi_keys = ['k']\n", "admin API key is also a key of tenants.a"),
    ("[tenants.a]\napi_keys = ['k']\n[admin]\nkeys = ['x']\n", "admin: unknown field"),
    ("admin = 'root'\n[tenants.a]\napi_keys = ['k']\n", "admin must be a table"),
])
def test_bad_admin_tables_raise_value_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        TenantAuth.from_file(path)


def test_admin_keys_read_everything_and_are_no_tenant(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    path.write_text(TOML + "\n[admin]\napi_keys = ['sk-ops']\n")
    auth = TenantAuth.from_file(path)
    assert auth.is_admin("Bearer sk-ops") and auth.tenant_for("Bearer sk-ops") is None
    assert not auth.is_admin("Bearer sk-acme-1") and not auth.is_admin(None)
    assert TenantAuth().is_admin(None)  # auth off: one tenant, who may read everything
