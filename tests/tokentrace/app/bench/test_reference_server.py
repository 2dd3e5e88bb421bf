"""The load generator against the reference server (LocalBackend, tiny model) on loopback:
every workload kind, tenants and SLO classes, and a Mooncake replay whose prefix-cache hits
match the best possible computed from the trace's hash ids."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch

from analyzers.agreement import DIFF_NS, agreement_summary, ttft_agreement
from instrument.reference_engine import EngineTracer
from reference_server.engine.config import EngineConfig
from reference_server.serving.backend import LocalBackend
from reference_server.serving.gateway import GatewayConfig, create_app
from reference_server.serving.gateway_tenants import TenantAuth
from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.plan import build_plan, parse_mix, parse_tenants, resolve_workload_path
from tokentrace.app.bench.prefix import best_prefix_hit_tokens
from tokentrace.app.bench.runner import RunLimits, run_bench
from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec
from tokentrace.app.bench.workloads import load_trace
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, Role, col
from tokentrace.store import open_run
from tokentrace.store.writer import StoreWriter

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reference(serve_app) -> Iterator[tuple[str, LocalBackend]]:
    backend = LocalBackend(EngineConfig(model="tiny", num_device_blocks=512))
    with serve_app(create_app(backend, config=GatewayConfig())) as url:
        yield url, backend


def _run(url: str, plan, **kw):
    return run_bench(plan, RequestOptions(url, model="tiny", **kw.pop("opts", {})), RunLimits(duration_s=60, **kw))


def test_synthetic_chat_with_shared_system_prompts_and_slo_classes(reference, tmp_path):
    url, _ = reference
    spec = SyntheticSpec(LengthDist("uniform", 8, 40), LengthDist("lognormal", 6, 0.5, max=12), 2, 0.5, 32)
    plan = build_plan(synthetic=spec, max_requests=12, arrivals=Arrivals("gamma", 50.0, 0.5),
                      slo_mix=parse_mix("interactive:1,batch:1"), key_prefix="syn")
    result = run_bench(plan, RequestOptions(url, endpoint="chat", model="tiny"), RunLimits(duration_s=60),
                       store=tmp_path, run_id="syn")
    assert all(o.ok for o in result.outcomes), [o.detail for o in result.outcomes if not o.ok]
    for o, r in zip(result.outcomes, plan.requests):
        assert o.num_output_tokens == r.text.max_tokens  # ignore_eos: exact lengths
        assert 1 <= len(o.recv_ns) <= o.num_output_tokens  # chunks: no empty one before the last
    tok = open_run(tmp_path, "syn").table(TOKENS.name)
    assert tok.num_rows == sum(len(o.recv_ns) for o in result.outcomes)  # one client row per chunk


@pytest.mark.parametrize("workload", ["azure-code", "azure-conv"])
def test_azure_replay(reference, workload, tmp_path):
    url, _ = reference
    plan = build_plan(workload=workload, max_requests=8, time_scale=0.01, length_scale=0.02,
                      arrivals=Arrivals("trace"))
    result = run_bench(plan, RequestOptions(url, model="tiny"), RunLimits(duration_s=60), store=tmp_path,
                       run_id="az")
    assert all(o.ok for o in result.outcomes), [o.detail for o in result.outcomes if not o.ok]
    assert [o.num_output_tokens for o in result.outcomes] == [r.text.max_tokens for r in plan.requests]
    # The server's prompt count is the planned text plus the tokenizer's bos token.
    assert [o.num_prompt_tokens for o in result.outcomes] == [r.text.num_prompt_tokens + 1 for r in plan.requests]
    req = open_run(tmp_path, "az").table(REQUESTS.name).to_pandas()
    assert len(req) == 8 and (req[col.NUM_PROMPT_TOKENS] > 0).all()


def _mooncake_hits(serve_app, num_device_blocks: int, n: int) -> tuple[list, list[int], object, int]:
    backend = LocalBackend(EngineConfig(model="tiny", num_device_blocks=num_device_blocks))
    plan = build_plan(workload="mooncake", max_requests=n, length_scale=1 / 64, server_block_size=16)
    with serve_app(create_app(backend, config=GatewayConfig())) as url:
        # One request at a time: each prompt is in the cache before the next arrives.
        result = _run(url, plan, concurrency=1)
        stats = backend.stats().instances[0]
    bos = len(backend.tokenizer.encode("a")) - 1
    return list(result.outcomes), [plan.config["scaling"]["prompt_block_tokens"]], stats, bos


def test_mooncake_replay_hits_the_best_possible_prefix_cache_rate(serve_app):
    n = 30
    outcomes, (bt,), stats, bos = _mooncake_hits(serve_app, 4096, n)
    trace = load_trace(resolve_workload_path("mooncake"), max_requests=n, length_scale=1 / 64).requests
    served = [t for t, o in zip(trace, outcomes) if o.ok]  # prompts over the tiny model's context are refused
    assert len(served) >= n - 3
    best = best_prefix_hit_tokens(served, block_tokens=bt, server_block_size=16, bos_tokens=bos)
    assert sum(best) > 0
    # A cache that never evicts, fed one request at a time, gets exactly the best possible hits:
    assert [o.num_cached_tokens for o in outcomes if o.ok] == best
    assert stats.num_prefix_hit_tokens == sum(best)
    best_rate = sum(best) / sum(o.num_prompt_tokens for o in outcomes if o.ok)
    assert stats.num_prefix_hit_tokens / stats.num_prefix_query_tokens == pytest.approx(best_rate)


def test_mooncake_replay_on_a_small_cache_stays_below_the_best_rate(serve_app):
    n = 30
    outcomes, (bt,), stats, bos = _mooncake_hits(serve_app, 48, n)  # 768 tokens of KV: evictions
    trace = load_trace(resolve_workload_path("mooncake"), max_requests=n, length_scale=1 / 64).requests
    served = [t for t, o in zip(trace, outcomes) if o.ok]
    best = best_prefix_hit_tokens(served, block_tokens=bt, server_block_size=16, bos_tokens=bos)
    assert all(o.num_cached_tokens <= b for o, b in zip([o for o in outcomes if o.ok], best))
    assert stats.num_prefix_hit_tokens <= sum(best)


def test_tenants_send_their_api_keys(serve_app):
    auth = TenantAuth(keys={"sk-acme": "default", "sk-globex": "default"})
    backend = LocalBackend(EngineConfig(model="tiny", num_device_blocks=128))
    plan = build_plan(synthetic=SyntheticSpec(LengthDist("fixed", 8), LengthDist("fixed", 2)), max_requests=6,
                      tenants=parse_tenants("acme:sk-acme,globex:sk-globex,intruder:sk-wrong:0.5"), seed=3)
    with serve_app(create_app(backend, config=GatewayConfig(auth=auth))) as url:
        result = _run(url, plan)
    for o, r in zip(result.outcomes, plan.requests):
        assert o.ok == (r.tenant != "intruder"), (r.tenant, o.detail)
        if r.tenant == "intruder":
            assert o.http_status == 401 and o.failure.label == "http_4xx"
    assert {r.tenant for r in plan.requests} == {"acme", "globex", "intruder"}


def test_client_and_engine_views_agree_causally(serve_app, tmp_path):
    """The engine records its own view of the same run into the same store; the agreement
    analyzer joins both on the X-Request-Id the client sent. On one host's monotonic clock
    the client sends before the server sees the request and receives after the engine
    emits, so every server TTFT is at most the client's."""
    backend = LocalBackend(EngineConfig(model="tiny", num_device_blocks=256))
    writer = StoreWriter(tmp_path, run_id="both")
    recorder = BufferedRecorder(writer, instance_id=writer.instance_id)
    recorder.instance(role=Role.COLOCATED, name="engine")
    backend.engine.add_observer(EngineTracer(recorder))
    plan = build_plan(synthetic=SyntheticSpec(LengthDist("fixed", 24), LengthDist("fixed", 6)), max_requests=10,
                      arrivals=Arrivals("poisson", 40.0), key_prefix="agree")
    with serve_app(create_app(backend, config=GatewayConfig())) as url:
        result = run_bench(plan, RequestOptions(url, model="tiny"), RunLimits(duration_s=60), store=tmp_path,
                           run_id="both")
    recorder.close()
    assert all(o.ok for o in result.outcomes)
    run = open_run(tmp_path, "both")
    tables = [run.table(t.name) for t in (REQUESTS, TOKENS, INSTANCES)]
    per_request = ttft_agreement(*tables, run.table(SPANS.name))
    assert len(per_request) == 10
    assert (per_request[DIFF_NS] <= 0).all()
    summary = agreement_summary(*tables, run.table(SPANS.name)).set_index("metric")
    # one ITL per chunk after the first (the server holds back tokens that complete no character)
    assert summary.loc["itl", "count"] == sum(len(o.recv_ns) - 1 for o in result.outcomes)
    assert summary.loc["ttft", "count"] == 10 and "ttft_stages" not in summary.index
