from __future__ import annotations

import pytest

from reference_server.engine.config import EngineConfig, SLOClass, TenantConfig


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, "block_size"),
    ({"num_host_blocks": -1}, "num_host_blocks"),
    ({"preemption_mode": "kill"}, "preemption_mode"),
    ({"scheduling_policy": "random"}, "scheduling_policy"),
    ({"fair_share_by": "luck"}, "fair_share_by"),
    ({"watermark_blocks": 256}, "watermark_blocks"),
    ({"max_model_len": 1}, "max_model_len"),
    ({"tenants": (TenantConfig("a"), TenantConfig("a"))}, "duplicate name 'a'"),
    ({"tenants": (TenantConfig("a"),)}, "default_tenant 'default'"),
    ({"slo_classes": ()}, "slo_classes"),
])
def test_engine_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("make,message", [
    (lambda: TenantConfig("t", weight=0), "weight"),
    (lambda: TenantConfig("t", max_concurrency=0), "max_concurrency"),
    (lambda: TenantConfig("t", max_tokens_per_s=-1.0), "max_tokens_per_s"),
    (lambda: TenantConfig("t", burst_tokens=5.0), "burst_tokens needs"),
    (lambda: TenantConfig(""), "name"),
    (lambda: SLOClass("x", ttft_ms=0, tpot_ms=1), "ttft_ms"),
    (lambda: SLOClass("x", ttft_ms=1, tpot_ms=float("nan")), "tpot_ms"),
])
def test_tenant_and_class_validation(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bucket_capacity_defaults_to_one_second_of_tokens():
    assert TenantConfig("t").bucket_capacity is None
    assert TenantConfig("t", max_tokens_per_s=50.0).bucket_capacity == 50.0
    assert TenantConfig("t", max_tokens_per_s=0.5).bucket_capacity == 1.0
    assert TenantConfig("t", max_tokens_per_s=5.0, burst_tokens=20.0).bucket_capacity == 20.0


def test_max_model_len_is_capped_by_device_blocks_and_budget():
    assert EngineConfig(block_size=4, num_device_blocks=10).resolve_max_model_len(512) == 40
    assert EngineConfig(num_device_blocks=1000).resolve_max_model_len(512) == 512
    assert EngineConfig(num_device_blocks=1000, max_model_len=100).resolve_max_model_len(512) == 100
    no_chunks = EngineConfig(num_device_blocks=1000, enable_chunked_prefill=False, max_num_batched_tokens=64)
    assert no_chunks.resolve_max_model_len(512) == 64


def test_lookups_name_the_known_values():
    config = EngineConfig()
    assert config.slo_class("batch").priority == 0
    with pytest.raises(ValueError, match="known classes: interactive, batch"):
        config.slo_class("gold")
    with pytest.raises(ValueError, match="known tenants: default"):
        config.tenant("acme")
