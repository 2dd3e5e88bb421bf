"""EngineConfig and SamplingParams to and from JSON-safe dicts, for the worker protocol
and the worker command line (the cluster passes the engine config to each worker)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from reference_server.engine import EngineConfig, SLOClass, TenantConfig
from reference_server.model import SamplingParams

__all__ = ["engine_config_from_json", "engine_config_to_json", "sampling_from_dict", "sampling_to_dict"]


def engine_config_to_json(config: EngineConfig) -> str:
    """A JSON object with every EngineConfig field (tenants and SLO classes as lists)."""
    return json.dumps(dataclasses.asdict(config), separators=(",", ":"))


def engine_config_from_json(text: str) -> EngineConfig:
    """Inverse of :func:`engine_config_to_json`. ``ValueError`` on bad JSON or fields."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"engine config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("engine config must be a JSON object")
    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"unknown engine config field(s): {', '.join(unknown)}")
    if "slo_classes" in raw:
        raw["slo_classes"] = tuple(SLOClass(**c) for c in raw["slo_classes"])
    if "tenants" in raw:
        raw["tenants"] = tuple(TenantConfig(**t) for t in raw["tenants"])
    return EngineConfig(**raw)


def sampling_to_dict(sampling: SamplingParams) -> dict[str, Any]:
    d = dataclasses.asdict(sampling)
    d["stop"] = list(sampling.stop)
    return d


def sampling_from_dict(d: dict[str, Any]) -> SamplingParams:
    """``ValueError`` naming the bad field."""
    return SamplingParams.from_dict(d)
