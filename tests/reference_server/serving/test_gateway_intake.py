from __future__ import annotations

import pytest

from reference_server.engine import SLOClass
from reference_server.serving.gateway import GatewayConfig
from reference_server.serving.gateway_intake import request_id_for
from reference_server.serving.gateway_tenants import TenantAuth


@pytest.mark.parametrize("value", ["abc", "A.b_c:d-9", "x" * 128])
def test_valid_client_request_ids_are_kept(value: str) -> None:
    assert request_id_for(value) == value


@pytest.mark.parametrize("value", [None, "", "has space", "x" * 129, "semi;colon", "ünï"])
def test_other_request_ids_are_generated(value: str | None) -> None:
    generated = request_id_for(value)
    assert generated.startswith("cmpl-") and len(generated) == 5 + 32
    assert generated != request_id_for(value)


def test_gateway_config_checks_default_slo_classes() -> None:
    with pytest.raises(ValueError, match="gold"):
        GatewayConfig(auth=TenantAuth(keys={}, default_slo_classes={"t": "gold"}))
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewayConfig(max_body_bytes=0)
    config = GatewayConfig(slo_classes=(SLOClass("gold", 100.0, 10.0),),
                           auth=TenantAuth(default_slo_class="gold"))
    assert config.slo_classes[0].name == "gold"
