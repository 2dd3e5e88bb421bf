"""Building a run's plan: workloads, scaling, tenants, SLO classes, Mooncake prompt blocks."""

from __future__ import annotations

from collections import Counter

import pytest

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.plan import aligned_block_tokens, build_plan, parse_mix, parse_tenants, resolve_workload_path
from tokentrace.app.bench.prefix import PREFIX_BOUND_KEY, best_prefix_hit_tokens, prefix_bound
from tokentrace.app.bench.workloads import TraceRequest, best_prefix_hit_rate, load_trace


def test_parse_tenants_and_mix():
    t = parse_tenants("acme:sk-a:3, beta:sk-b")
    assert [(x.name, x.api_key, x.share) for x in t] == [("acme", "sk-a", 3.0), ("beta", "sk-b", 1.0)]
    assert parse_mix("interactive:3,batch:1") == {"interactive": 0.75, "batch": 0.25}
    for bad in ("acme", "acme:sk:zero", "acme:sk:-1", ""):
        with pytest.raises(ValueError):
            parse_tenants(bad)
    for bad in ("interactive:x", ":1", "a:0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_tenants_and_classes_follow_their_shares_and_keys_are_unique():
    plan = build_plan(max_requests=2000, tenants=parse_tenants("a:ka:3,b:kb:1"),
                      slo_mix=parse_mix("interactive:1,batch:1"), key_prefix="k", seed=5)
    by_tenant = Counter(r.tenant for r in plan.requests)
    assert by_tenant["a"] / 2000 == pytest.approx(0.75, abs=0.04)
    assert all(r.api_key == {"a": "ka", "b": "kb"}[r.tenant] for r in plan.requests)
    assert Counter(r.slo_class for r in plan.requests)["batch"] / 2000 == pytest.approx(0.5, abs=0.04)
    assert len({r.key for r in plan.requests}) == 2000 and plan.requests[7].key == "k-000007"
    assert "sk" not in str(plan.config) and "ka" not in str(plan.config.get("tenants"))  # keys stay secret


def test_azure_trace_is_scaled_and_the_scaling_reported():
    plan = build_plan(workload="azure-conv", max_requests=5, time_scale=0.5, length_scale=0.1,
                      arrivals=Arrivals("trace"))
    wl = load_trace(resolve_workload_path("azure-conv"), max_requests=5)
    scaling = plan.config["scaling"]
    assert scaling["time_scale"] == 0.5 and scaling["length_scale"] == 0.1 and scaling["max_requests"] == 5
    assert scaling["num_requests_in_file"] > 5
    assert any("first 5 of" in line and "x0.5" in line for line in plan.description)
    for planned, orig in zip(plan.requests, wl.requests):
        assert planned.offset_s == pytest.approx(orig.arrival_s * 0.5)
        assert planned.text.num_prompt_tokens == max(1, round(orig.num_prompt_tokens * 0.1))
        assert planned.text.max_tokens == max(1, round(orig.num_output_tokens * 0.1))


def test_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="azure-code"):
        build_plan(workload="nope.csv")


def test_mooncake_prompts_sharing_hash_ids_share_byte_identical_blocks():
    plan = build_plan(workload="mooncake", max_requests=200, length_scale=1 / 16, server_block_size=16)
    wl = load_trace(resolve_workload_path("mooncake"), max_requests=200, length_scale=1 / 16)
    bt = plan.config["scaling"]["prompt_block_tokens"]
    assert bt % 16 == 0
    prompts = [r.text.prompt for r in plan.requests]
    num_shared_pairs = 0
    for i in range(len(wl.requests)):
        for j in range(i + 1, min(i + 40, len(wl.requests))):
            a, b = wl.requests[i].hash_ids, wl.requests[j].hash_ids
            common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shared = min(common * bt, len(prompts[i]), len(prompts[j]))
            assert prompts[i].encode()[:shared] == prompts[j].encode()[:shared]
            if common * bt < min(len(prompts[i]), len(prompts[j])):  # the next block differs
                assert prompts[i][common * bt:common * bt + bt] != prompts[j][common * bt:common * bt + bt]
            num_shared_pairs += common > 0
    assert num_shared_pairs > 100


def test_aligned_block_tokens():
    assert aligned_block_tokens(32, 16) == 32
    assert aligned_block_tokens(44, 16) == 48
    assert aligned_block_tokens(4, 16) == 16
    assert aligned_block_tokens(33, None) == 33


def test_best_prefix_hits_by_hand():
    reqs = [TraceRequest(0, 40, 1, (1, 2, 3)), TraceRequest(0, 40, 1, (1, 2, 9)), TraceRequest(0, 20, 1, (1, 2)),
            TraceRequest(0, 40, 1, (5, 6, 7))]
    # block_tokens 16, server blocks 8, one bos token: request 2 shares 32 chars (+1 bos) -> 4 blocks of 8;
    # request 3 (20 chars + bos = 21 tokens) shares 20 chars -> 2 full blocks; request 4 shares nothing.
    assert best_prefix_hit_tokens(reqs, block_tokens=16, server_block_size=8, bos_tokens=1) == [0, 32, 16, 0]
    assert best_prefix_hit_rate(reqs) == pytest.approx(4 / 11)  # block level, for comparison


def test_the_best_achievable_hit_rate_goes_into_the_plans_config():
    reqs = [TraceRequest(0, 40, 1, (1, 2, 3)), TraceRequest(0, 40, 1, (1, 2, 9)), TraceRequest(0, 20, 1, (1, 2)),
            TraceRequest(0, 40, 1, (5, 6, 7))]
    bound = prefix_bound(reqs, block_tokens=16, server_block_size=8)
    # The hand-computed hits above (one bos token, the reference server's): 48 of 140 + 4 prompt tokens.
    assert bound["best_token_hit_rate"] == pytest.approx(48 / 144)
    assert bound["best_block_hit_rate"] == pytest.approx(4 / 11)
    assert "best_token_hit_rate" not in prefix_bound(reqs, block_tokens=16, server_block_size=None)
    plan = build_plan(workload="mooncake", max_requests=30, length_scale=1 / 64, server_block_size=16)
    recorded = plan.config[PREFIX_BOUND_KEY]
    assert 0 < recorded["best_token_hit_rate"] < 1 and recorded["server_block_size"] == 16
    assert PREFIX_BOUND_KEY not in build_plan(max_requests=3).config  # synthetic prompts carry no block hashes
