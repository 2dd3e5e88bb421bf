from __future__ import annotations

import pytest

from reference_server.engine import SLOClass
from reference_server.serving.gateway import GatewayConfig
from reference_server.serving.gateway_intake import InFlightIds, RequestContext, request_id_for
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
    with pytest.raises(ValueError, match="body_timeout_s"):
        GatewayConfig(body_timeout_s=0)
    config = GatewayConfig(slo_classes=(SLOClass("gold", 100.0, 10.0),),
                           auth=TenantAuth(default_slo_class="gold"))
    assert config.slo_classes[0].name == "gold"


def _ctx(request_id: str, tenant: str | None) -> RequestContext:
    return RequestContext(request_id, "/v1/completions", 0, tenant=tenant, traceparent=None)


def test_request_ids_in_flight_are_scoped_per_tenant() -> None:
    ids = InFlightIds()
    first = _ctx("r-1", "acme")
    ids.claim(first)
    assert (first.request_id, first.backend_id, first.traced, first.duplicate_of) == ("r-1", "r-1", True, None)
    again = _ctx("r-1", "acme")
    ids.claim(again)  # the tenant's own id: a fresh one, and the gateway answers 409
    assert again.duplicate_of == "r-1" and again.request_id.startswith("cmpl-") and again.traced
    other = _ctx("r-1", "globex")
    ids.claim(other)  # another tenant's: the same id in the answer, a private one for the backend, untraced
    assert other.request_id == "r-1" and other.backend_id.startswith("r-1~") and not other.traced
    for ctx in (other, again):
        ids.release(ctx)
    assert len(ids) == 1  # acme's r-1 is still in flight; globex's release freed nothing of it
    ids.release(first)
    later = _ctx("r-1", "globex")
    ids.claim(later)
    assert later.traced and later.backend_id == "r-1" and len(ids) == 1
