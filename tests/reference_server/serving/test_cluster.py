"""ClusterBackend with real worker processes on 127.0.0.1 (tiny model).

One colocated cluster (2 workers) and one disaggregated cluster (1 prefill + 2 decode)
are started once per module and shared; the tests that kill workers restart them. Every
output is compared token for token with a plain greedy run of the same engine config.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time

import pytest
import torch

from reference_server.engine import Engine, EngineConfig, TenantConfig
from reference_server.model import SamplingParams
from reference_server.serving.backend import BackendUnavailable, GenerateRequest
from reference_server.serving.cluster import ClusterBackend
from reference_server.serving.gateway_metrics import GatewayMetrics
from reference_server.serving.worker_hooks import WorkerObserver

torch.set_num_threads(1)
pytestmark = pytest.mark.timeout(120)

TENANTS = tuple(TenantConfig(n) for n in ("default", "acme", "globex", "initech"))
CONFIG = EngineConfig(model="tiny", block_size=16, num_device_blocks=128, device="cpu", tenants=TENANTS)
PROMPTS = [f"Request {i} asks about topic {i * 7} and nothing else." for i in range(6)]
SHORT = SamplingParams(max_tokens=12, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, ignore_eos=True)
SEEDED_LONG = SamplingParams(max_tokens=200, temperature=1.0, seed=7, ignore_eos=True)


class LoopThread:
    """An event loop on a thread, shared by a module's tests (the cluster lives on it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 90.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Events(WorkerObserver):
    def __init__(self) -> None:
        self.events: list = []

    def on_kv_transfer_start(self, e):
        self.events.append(e)

    def on_kv_transfer_end(self, e):
        self.events.append(e)

    def on_route(self, e):
        self.events.append(e)

    def on_redispatch(self, e):
        self.events.append(e)

    def on_worker_stopped(self, e):
        self.events.append(e)

    def named(self, kind: str) -> list:
        return [e for e in self.events if type(e).__name__ == kind]


def expected_tokens(prompts: list[str], sampling: SamplingParams) -> list[tuple[int, ...]]:
    return [c.token_ids for c in expected_completions(prompts, sampling)]


def expected_completions(prompts: list[str], sampling: SamplingParams) -> list:
    with Engine(CONFIG) as engine:
        return engine.generate(prompts, sampling)


def text_of(events: list) -> str:
    return "".join(e.text for e in events)


def make_request(backend, rid: str, prompt: str, sampling: SamplingParams, tenant: str = "default",
                 deadline_ms: int = 500) -> GenerateRequest:
    now = time.monotonic_ns()
    return GenerateRequest(rid, tuple(backend.tokenizer.encode(prompt)), sampling, tenant, "interactive", now,
                           now + deadline_ms * 1_000_000)


async def collect(backend, req: GenerateRequest) -> list:
    return [e async for e in backend.generate(req)]


async def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


# Workers sleep 2 ms before every decode step, so that a LONG stream (200 tokens) runs for at least
# 0.4 s: the tests that kill a worker or disconnect after a stream's first tokens need it still running
# then, and on a busy machine the tiny model could otherwise finish it first.
DECODE_DELAY = "decode_step=2ms"


def start_cluster(loop: LoopThread, **kw) -> tuple[ClusterBackend, Events]:
    kw.setdefault("delays", DECODE_DELAY)
    kw.setdefault("restart_dead_workers", False)  # these tests kill workers and restart them by hand
    backend = ClusterBackend(CONFIG, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0, **kw)
    events = Events()
    backend.add_observer(events)
    loop.run(backend.start(), timeout=120)
    return backend, events


@pytest.fixture(scope="module")
def colocated(loop):
    backend, events = start_cluster(loop, mode="colocated", num_instances=2)
    yield backend, events
    loop.run(backend.stop())


@pytest.fixture(scope="module")
def disagg(loop):
    backend, events = start_cluster(loop, mode="disagg", num_prefill=1, num_decode=2)
    yield backend, events
    loop.run(backend.stop())


@pytest.fixture(scope="module")
def reference():
    return expected_completions(PROMPTS, SHORT)


# ---------------------------------------------------------------------- both modes

@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_streams_equal_plain_greedy_output(mode, request, loop, reference):
    backend, events = request.getfixturevalue(mode)

    async def go():
        reqs = [make_request(backend, f"{mode}-eq-{i}", p, SHORT) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = loop.run(go())
    for got, want in zip(results, reference):
        assert tuple(e.token_id for e in got) == want.token_ids
        assert text_of(got) == want.text
        assert [e.index for e in got] == list(range(12))
        assert got[-1].finish_reason == "length"
    if mode == "disagg":
        assert {e.instance for e in results[0][:1]} == {"prefill-0"}  # the first token comes from prefill
        assert {e.instance for e in results[0][1:]} <= {"decode-0", "decode-1"}
        sends = [e for e in events.named("KVTransferEnd") if e.direction == "send"]
        recvs = [e for e in events.named("KVTransferEnd") if e.direction == "recv"]
        assert len(sends) >= 6 and len(recvs) >= 6 and all(e.ok and e.num_bytes > 0 for e in sends + recvs)
        assert loop.run(wait_until(lambda: backend.stats().instance("prefill-0").num_kv_bytes_sent > 0))


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_fifty_concurrent_requests_across_tenants(mode, request, loop):
    backend, _ = request.getfixturevalue(mode)
    tenants = ["acme", "globex", "initech"]

    async def go():
        reqs = [make_request(backend, f"{mode}-c-{i}", f"tenant {tenants[i % 3]} request {i}",
                             SamplingParams(max_tokens=8 + i % 5, ignore_eos=True), tenant=tenants[i % 3])
                for i in range(50)]
        results = await asyncio.gather(*(collect(backend, r) for r in reqs))
        return reqs, results

    reqs, results = loop.run(go())
    for req, events in zip(reqs, results):
        assert [e.index for e in events] == list(range(req.sampling.max_tokens))
        assert events[-1].finish_reason == "length"


def test_kv_transfers_share_one_connection_per_decode_worker(disagg, loop):
    # 30 concurrent disaggregated requests: every KV transfer to a decode worker rides the one connection the
    # prefill worker keeps open to it; neither side opens or accepts a connection per transfer.
    backend, events = disagg
    sent_before = len([e for e in events.named("KVTransferEnd") if e.direction == "send" and e.ok])

    async def go():
        reqs = [make_request(backend, f"kvlink-{i}", f"kv link request {i} " * (1 + i % 4), SHORT)
                for i in range(30)]
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = loop.run(go())
    assert all(len(r) == SHORT.max_tokens for r in results)

    def sends() -> list:  # relayed by the prefill worker after each acknowledgement (the stream may end first)
        return [e for e in events.named("KVTransferEnd") if e.direction == "send" and e.ok]

    assert loop.run(wait_until(lambda: len(sends()) - sent_before >= 30))
    sends = sends()
    assert all(e.start_ns <= e.first_sent_ns <= e.end_ns for e in sends)
    peers = {e.peer for e in sends}
    sent = sum(e.num_bytes for e in events.named("KVTransferEnd") if e.direction == "send")
    received = {name: sum(e.num_bytes for e in events.named("KVTransferEnd")
                          if e.direction == "recv" and e.instance == name) for name in peers}

    def counted() -> bool:  # every worker's last pong came after all of the transfers above
        w = backend.workers
        return (w["prefill-0"].stats.get("num_kv_bytes_sent") == sent
                and all(w[n].stats.get("num_kv_bytes_received") == received[n] for n in peers))

    assert loop.run(wait_until(counted))
    stats = {name: h.stats for name, h in backend.workers.items()}
    assert stats["prefill-0"]["num_kv_connections"] == len(peers)
    for name in peers:  # the controller's connection and the prefill worker's
        assert stats[name]["num_connections_accepted"] == 2
    assert all(s["num_gc_frozen"] > 0 for s in stats.values())  # the start-up heap is out of the collector's way


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_disconnect_frees_blocks_on_every_worker(mode, request, loop):
    backend, _ = request.getfixturevalue(mode)

    async def go():
        streams = [backend.generate(make_request(backend, f"{mode}-d-{i}", PROMPTS[i % 6] * 3, LONG))
                   for i in range(6)]
        for s in streams[:4]:
            await s.__anext__()  # some have a token (disagg: their KV may be in flight or on a decoder)
            await s.__anext__()
        for s in streams[4:]:  # the others disconnect before their first token
            task = asyncio.ensure_future(s.__anext__())
            await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for s in streams:
            await s.aclose()

        def all_free() -> bool:
            st = backend.stats()
            return all(i.num_blocks_used == (0, 0, 0) and i.num_running == 0 and i.num_waiting == 0
                       for i in st.instances)

        await asyncio.sleep(0.3)  # fresh heartbeat stats
        return await wait_until(all_free), backend.stats()

    freed, stats = loop.run(go())
    assert freed, stats
    assert len(stats.instances) == (2 if mode == "colocated" else 3)


def test_prefix_aware_routes_a_shared_prefix_to_its_instance(colocated, loop):
    backend, events = colocated
    shared = "A long shared system prompt that spans several KV blocks of sixteen tokens. " * 2

    async def go():
        first = await collect(backend, make_request(backend, "px-0", shared + "First question?", SHORT))
        hits_before = {i.name: i.num_prefix_hit_tokens for i in backend.stats().instances}
        # make the holder the busier one: prefix affinity must still win within the balance slack
        busy = backend.generate(make_request(backend, "px-busy", shared + "busy", LONG))
        await busy.__anext__()
        second = await collect(backend, make_request(backend, "px-1", shared + "Second question?", SHORT))
        await busy.aclose()
        await asyncio.sleep(0.4)
        return first, second, hits_before, {i.name: i.num_prefix_hit_tokens for i in backend.stats().instances}

    first, second, before, after = loop.run(go())
    holder = first[0].instance
    assert second[0].instance == holder
    assert after[holder] - before[holder] >= 64  # the shared blocks were hits on that worker
    routes = [e for e in events.named("RouteDecision") if e.request_id == "px-1"]
    assert routes[0].instance == holder and routes[0].policy == "prefix_aware"


# ---------------------------------------------------------------------- recovery

def kill_and_finish(backend, loop, victim_of, prompts, sampling, prefix: str):
    """Start streams, SIGKILL the worker chosen by ``victim_of(first events)``, finish them."""
    async def go():
        reqs = [make_request(backend, f"{prefix}-{i}", p, sampling, deadline_ms=100 * (len(prompts) - i))
                for i, p in enumerate(prompts)]
        streams = [backend.generate(r) for r in reqs]
        heads = [[await s.__anext__(), await s.__anext__()] for s in streams]
        victim = victim_of(heads)
        os.kill(backend.worker_pid(victim), signal.SIGKILL)
        killed_at = time.monotonic()
        outcomes = []
        for head, s in zip(heads, streams):
            try:
                outcomes.append(head + [e async for e in s])
            except BackendUnavailable as exc:
                outcomes.append(exc)
        return victim, killed_at, outcomes

    return loop.run(go())


async def _stats(backend):
    return backend.stats()  # on the cluster's loop, as the gateway reads it


def test_colocated_worker_killed_mid_stream_then_restarted(colocated, loop):
    backend, events = colocated
    prompts = PROMPTS[:4]
    want = expected_completions(prompts, LONG)
    before = backend.num_redispatched
    victim, _, outcomes = kill_and_finish(backend, loop, lambda heads: heads[0][1].instance, prompts, LONG, "kc")
    for got, completion in zip(outcomes, want):
        assert tuple(e.token_id for e in got) == completion.token_ids
        assert text_of(got) == completion.text
        assert [e.index for e in got] == list(range(200))
    assert backend.num_redispatched > before
    redispatches = [e for e in events.named("Redispatch") if e.from_instance == victim]
    assert redispatches and all(r.to_instance not in (None, victim) for r in redispatches)
    stopped = [e for e in events.named("WorkerStopped") if e.instance == victim]
    assert stopped and stopped[0].num_inflight >= 1 and stopped[0].reason.startswith("connection_lost")
    assert not backend.stats().instance(victim).alive
    # The dead worker's last gauges (KV blocks, queues) are gone from /metrics; only up = 0 stays.
    victim_lines = [line for line in GatewayMetrics(lambda: loop.run(_stats(backend))).render().decode().splitlines()
                    if f'instance="{victim}"' in line]
    assert victim_lines == [f'reference_server_instance_up{{instance="{victim}",role="colocated"}} 0.0']

    loop.run(backend.restart_worker(victim))

    async def after_restart():
        reqs = [make_request(backend, f"kc-after-{i}", p, SHORT) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    results = loop.run(after_restart())
    assert backend.stats().instance(victim).alive
    assert victim in {r[0].instance for r in results}  # the restarted worker serves again


def test_decode_worker_killed_mid_stream_continues_identically(disagg, loop):
    # Seeded sampling, not greedy: prefilled on one worker, decoded on another, resumed on a third after
    # the kill, and still the tokens of one plain engine (each token's draws depend on seed and index).
    backend, events = disagg
    prompts = PROMPTS[:4]
    want = expected_completions(prompts, SEEDED_LONG)
    assert want[0].token_ids != expected_completions(prompts[:1], LONG)[0].token_ids  # really sampled
    before = backend.num_redispatched
    victim, _, outcomes = kill_and_finish(backend, loop, lambda heads: heads[0][1].instance, prompts, SEEDED_LONG,
                                          "kd")
    assert victim.startswith("decode-")
    for got, completion in zip(outcomes, want):
        assert tuple(e.token_id for e in got) == completion.token_ids
        assert text_of(got) == completion.text
        assert [e.index for e in got] == list(range(200))
    assert backend.num_redispatched > before
    redispatches = [e for e in events.named("Redispatch") if e.from_instance == victim]
    assert redispatches and all(r.to_instance is not None and r.to_instance != victim for r in redispatches)
    deadlines = [r.ttft_deadline_ns for r in redispatches]
    assert deadlines == sorted(deadlines)  # earliest TTFT deadline first
    loop.run(backend.restart_worker(victim))
    assert backend.stats().instance(victim).alive


def test_killing_the_only_prefill_worker_ends_new_streams_with_an_error(disagg, loop):
    backend, events = disagg
    long_prompts = [f"{i} " + "a very long prompt indeed, " * 14 for i in range(10)]

    async def go():
        reqs = [make_request(backend, f"kp-{i}", p, SHORT) for i, p in enumerate(long_prompts)]
        tasks = [asyncio.ensure_future(collect(backend, r)) for r in reqs]
        await asyncio.sleep(0)  # every request is dispatched
        os.kill(backend.worker_pid("prefill-0"), signal.SIGKILL)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        with pytest.raises(BackendUnavailable, match="no live prefill worker"):
            await collect(backend, make_request(backend, "kp-late", "too late", SHORT))
        return outcomes

    outcomes = loop.run(go())
    want = expected_tokens(long_prompts, SHORT)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert errors and all(isinstance(e, BackendUnavailable) and "prefill" in str(e) for e in errors)
    for got, tokens in zip(outcomes, want):
        if not isinstance(got, BaseException):  # those that had reached a decoder complete exactly
            assert tuple(e.token_id for e in got) == tokens

    loop.run(backend.restart_worker("prefill-0"))
    result = loop.run(collect(backend, make_request(backend, "kp-after", PROMPTS[0], SHORT)))
    assert result[0].instance == "prefill-0" and len(result) == 12


def test_hung_worker_is_declared_dead_by_heartbeat_and_its_streams_continue(colocated, loop):
    backend, events = colocated
    prompts = PROMPTS[2:5]
    want = expected_tokens(prompts, LONG)

    async def go():
        streams = [backend.generate(make_request(backend, f"hb-{i}", p, LONG)) for i, p in enumerate(prompts)]
        heads = [[await s.__anext__()] for s in streams]
        victim = heads[0][0].instance
        os.kill(backend.worker_pid(victim), signal.SIGSTOP)  # no EOF: only the heartbeat can tell
        stopped_ns = time.monotonic_ns()
        outcomes = [head + [e async for e in s] for head, s in zip(heads, streams)]
        return victim, stopped_ns, outcomes

    victim, stopped_ns, outcomes = loop.run(go())
    for got, tokens in zip(outcomes, want):
        assert tuple(e.token_id for e in got) == tokens
    stopped = [e for e in events.named("WorkerStopped") if e.instance == victim and e.t_ns > stopped_ns]
    assert [e.reason for e in stopped] == ["heartbeat_timeout"]
    # 1 s without a pong; the last pong may predate the SIGSTOP by one 0.2 s ping interval
    assert stopped[0].t_ns - stopped_ns >= 800_000_000
    with pytest.raises(ValueError, match="is alive"):
        loop.run(backend.restart_worker("colocated-0" if victim == "colocated-1" else "colocated-1"))
    loop.run(backend.restart_worker(victim))
    assert backend.stats().instance(victim).alive
