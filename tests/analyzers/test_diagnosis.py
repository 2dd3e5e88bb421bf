"""The diagnosis rules on small hand-made stores with hand-computed answers, one store per rule.

Each store plants one cause in a request that misses its target (times in ms) and checks the
first cause, its milliseconds (scaled to the time over target when it explains more), its
evidence and fix; a request that met its targets has no row. Simulated runs (:mod:`simulated`)
give the load-driven causes: a sustained overload and a transient burst.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from handmade import HandMade
from simulated import simulate

from analyzers.diagnosis import CAUSES, FIXES, Targets, diagnose
from tokentrace.app.report.diagnosis import request_json, request_story
from tokentrace.schema import CacheEventKind, Role, Stage, Tier, col


def _short(h: HandMade, rid: int, arrival: float, *, queue: tuple[float, float] | None = None,
           prefill: tuple[float, float, int] = (0, 0, 0), tokens: list[float] | None = None, prompt: int = 10,
           cached: int = 0, tenant: str = "a", inst: int = 1) -> HandMade:
    """A request: optional queue, one prefill span (start, end, step), tokens emitted at ``tokens``."""
    toks = tokens or [prefill[1]]
    h.request(rid, arrival, toks[-1], prompt=prompt, cached=cached, tenant=tenant, inst=inst)
    if queue is not None:
        h.span(rid, Stage.SCHEDULE_QUEUE, queue[0], queue[1], 0, inst=inst)
    if prefill[1] > prefill[0]:
        h.span(rid, Stage.PREFILL_COMPUTE, prefill[0], prefill[1], 0, inst=inst, step=prefill[2])
    return h.tokens(rid, toks, inst=inst)


def _causes(d, rid: int) -> list[dict]:
    return d.causes[d.causes[col.REQUEST_ID] == rid].sort_values("rank").to_dict("records")


def test_a_request_within_its_targets_has_no_row(handmade):
    _short(handmade, 1, 0, prefill=(0, 20, 1), tokens=[20, 30, 40])
    d = diagnose(handmade.source())
    assert d.num_judged == 1 and d.num_missed == 0 and len(d.causes) == 0 and len(d.summary) == 0


def test_head_of_line_names_the_long_prompt_its_length_and_the_step_budget(handmade):
    h = handmade
    for step, (a, b) in enumerate([(0, 100), (100, 200), (200, 300), (300, 400)], 1):  # a 1,000-token prompt
        h.step(step, a, b, prefill=32)
        h.span(9, Stage.PREFILL_COMPUTE, a, b, 0, step=step)
    h.request(9, 0, 420, prompt=1000).tokens(9, [400])
    h.step(5, 400, 410, prefill=10)
    _short(h, 1, 10, queue=(10, 400), prefill=(400, 410, 5), tokens=[410])
    for rid in (2, 3, 4):  # short prompts that met their targets: the run's median prompt is short
        _short(h, rid, 500 + rid * 100, prefill=(500 + rid * 100, 505 + rid * 100, 10 + rid))
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    first = _causes(d, 1)[0]
    assert first["cause"] == "head_of_line" and first["rank"] == 1
    assert first["ms"] == pytest.approx(300.0) and first["share"] == pytest.approx(1.0)  # 390 ms held, 300 over
    assert first["requests"] == "r9" and "r9's 1,000-token prefill" in first["evidence"]
    assert "32-token step budget" in first["evidence"] and "--max-num-batched-tokens" in first["fix"]
    long_first = _causes(d, 9)[0]  # the long prompt's own TTFT is its own prefill, not head-of-line blocking
    assert long_first["cause"] == "long_prefill"


def test_a_prefill_step_shared_with_a_long_prompt_is_head_of_line_for_the_others_share(handmade):
    h = handmade
    h.step(1, 0, 200, prefill=100)
    h.span(9, Stage.PREFILL_COMPUTE, 0, 200, 0, step=1)
    h.request(9, 0, 200, prompt=1000).tokens(9, [200])
    _short(h, 1, 0, prefill=(0, 200, 1), tokens=[200])  # 10 of the step's 100 prefill tokens were its own
    for rid in (2, 3):
        _short(h, rid, 300 + rid * 50, prefill=(300 + rid * 50, 302 + rid * 50, rid + 1))
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    first = _causes(d, 1)[0]
    assert first["cause"] == "head_of_line" and first["stage"] == "prefill.compute"
    assert first["ms"] == pytest.approx(150.0)  # 180 ms of others' work, scaled to the 150 ms over target


def test_a_prefill_step_shared_with_ordinary_prompts_is_coscheduled_prefill(handmade):
    h = handmade
    h.step(1, 0, 200, prefill=100)  # three prompts of 20, 40 and 40 tokens computed in one step: none is long
    _short(h, 1, 0, prefill=(0, 200, 1), tokens=[200], prompt=20)
    for rid in (2, 3):
        _short(h, rid, 0, prefill=(0, 200, 1), tokens=[200], prompt=40)
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    first = _causes(d, 1)[0]
    assert first["cause"] == "coscheduled_prefill" and first["stage"] == "prefill.compute"
    assert first["ms"] == pytest.approx(150.0)  # 160 ms of others' work (80 of 100 tokens), scaled to 150 over
    assert first["requests"] == "r2, r3" and "80 prompt tokens of other requests" in first["evidence"]
    assert "r2 (40 tokens)" in first["evidence"] and "--max-num-batched-tokens" in first["fix"]
    assert _causes(d, 2)[0]["ms"] == pytest.approx(120.0)  # 200 x 60/100 of others' work, 150 over: not scaled


def test_a_chunked_prompt_counts_as_its_own_at_most_what_was_left_of_it(handmade):
    h = handmade
    h.step(1, 0, 100, prefill=32).step(2, 100, 200, prefill=32)
    h.span(1, Stage.PREFILL_COMPUTE, 0, 100, 0, step=1)  # 40 tokens: 32 in step 1, the last 8 in step 2
    h.request(1, 0, 200, prompt=40).tokens(1, [200])
    _short(h, 2, 100, prefill=(100, 200, 2), tokens=[200], prompt=24)
    h.span(1, Stage.PREFILL_COMPUTE, 100, 200, 0, step=2)
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    causes = {c["cause"]: c for c in _causes(d, 1)}
    assert causes["coscheduled_prefill"]["ms"] == pytest.approx(75.0)  # step 2: 24 of its 32 tokens were r2's
    assert causes["coscheduled_prefill"]["requests"] == "r2"


def test_sustained_overload_is_overload_and_names_the_pool():
    h = HandMade()
    capacity = 1000 / (9 * 50.0)
    simulate(h, [i * 1000.0 / (2.25 * capacity) for i in range(int(2.25 * capacity * 20))], decode_step_ms=50.0,
             output=10)
    d = diagnose(h.source())
    assert d.num_missed > 10
    late = d.requests.sort_values(col.ARRIVAL_NS).tail(10)
    assert set(late["first_cause"]) == {"overload"}, late
    top = d.summary.iloc[0]
    assert top["cause"] == "overload" and "decode pool saturates" in top["evidence"] and top["fix"]


def test_a_saturated_decode_pools_wait_before_the_first_visible_content_is_overload_in_that_pool():
    h = HandMade()
    capacity = 1000 / (9 * 50.0)  # requests/s of the one decode instance
    simulate(h, [i * 1000.0 / (2.25 * capacity) for i in range(int(2.25 * capacity * 20))], decode_step_ms=50.0,
             output=10)
    token1 = {r[col.REQUEST_ID]: r[col.EMIT_NS] for r in h.rows["tokens"] if r[col.TOKEN_INDEX] == 1}
    for r in h.rows["requests"]:  # token 0 carries no text: the first visible content comes with token 1
        r[col.FIRST_CONTENT_NS] = token1[r[col.REQUEST_ID]]
    d = diagnose(h.source(), targets=Targets(ttft_ms=200, itl_ms=1_000))
    late = d.requests.sort_values(col.ARRIVAL_NS).tail(10)
    assert set(late["missed"]) == {"ttft"} and set(late["first_cause"]) == {"overload"}, late
    for rid in late[col.REQUEST_ID]:
        first = _causes(d, int(rid))[0]
        assert first["stage"] == "decode.queue" and first["share"] > 0.9, first
        assert "the decode pool saturates" in first["evidence"], first


def test_a_decode_workers_wait_for_admission_is_a_wait_however_short(handmade):
    h = handmade
    h.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    for rid in range(1, 6):  # five requests at once; the decode pool has room for them only at 44 ms
        a = rid - 1.0
        h.request(rid, a, 124, prompt=10, inst=1, first_content=84).tokens(rid, [a + 5], inst=1)
        h.tokens(rid, [84, 124], inst=2, first=1)
        h.span(rid, Stage.PREFILL_COMPUTE, a, a + 5, 0, inst=1, step=rid)
        h.span(rid, Stage.TRANSFER_KV, a + 5, a + 10, 1, inst=2)
        h.span(rid, Stage.DECODE_QUEUE, a + 10, 44, 1, inst=2)  # back-pressure: under two of its 40 ms steps
        h.span(rid, Stage.DECODE_COMPUTE, 44, 84, 1, inst=2, step=1)
        h.span(rid, Stage.DECODE_COMPUTE, 84, 124, 2, inst=2, step=2)
    h.step(1, 44, 84, seqs=5, decode=5, inst=2).step(2, 84, 124, seqs=5, decode=5, inst=2)
    h.request(6, 3_000, 3_005, prompt=10, inst=1).tokens(6, [3_005], inst=1)  # the mean rate stays low
    d = diagnose(h.source(), targets=Targets(ttft_ms=20, itl_ms=1_000))
    first = _causes(d, 5)[0]
    assert first["cause"] == "burst" and first["stage"] == "decode.queue", _causes(d, 5)
    assert first["ms"] == pytest.approx(30.0) and "5 requests arrived" in first["evidence"]


def test_a_decode_workers_spans_tagged_token_0_count_in_its_first_tokens_gap(handmade):
    h = handmade
    h.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    for rid in range(1, 6):  # five requests at once; token 0 is visible; the decode worker queues, tagging 0
        a = rid - 1.0
        h.request(rid, a, 64, prompt=10, inst=1, first_content=a + 5).tokens(rid, [a + 5], inst=1)
        h.tokens(rid, [54, 64], inst=2, first=1)
        h.span(rid, Stage.PREFILL_COMPUTE, a, a + 5, 0, inst=1, step=rid)
        h.span(rid, Stage.SCHEDULE_QUEUE, a + 10, 44, 0, inst=2)
        h.span(rid, Stage.DECODE_COMPUTE, 44, 54, 1, inst=2, step=1)
        h.span(rid, Stage.DECODE_COMPUTE, 54, 64, 2, inst=2, step=2)
    h.step(1, 44, 54, seqs=5, decode=5, inst=2).step(2, 54, 64, seqs=5, decode=5, inst=2)
    h.request(6, 3_000, 3_005, prompt=10, inst=1).tokens(6, [3_005], inst=1)
    d = diagnose(h.source(), targets=Targets(ttft_ms=1_000, itl_ms=25))
    row = d.requests.set_index(col.REQUEST_ID).loc[5]
    assert row["missed"] == "itl" and row["excess_ms"] == pytest.approx(45.0 - 25.0)  # token 1 at 54, 45 ms after 9
    first = _causes(d, 5)[0]  # its 30 ms wait explains all 20 ms over target
    assert first["cause"] == "burst" and first["stage"] == "schedule.queue" and first["ms"] == pytest.approx(20.0)
    assert d.gaps.set_index(col.REQUEST_ID).loc[5, "cause"] == "burst"


def test_a_burst_under_capacity_is_a_burst_with_its_size_and_rate():
    h = HandMade()
    arrivals = [i * 1000.0 for i in range(20)] + [20_000 + i * 10.0 for i in range(8)] + [24_000 + i * 1000.0
                                                                                          for i in range(6)]
    simulate(h, arrivals, mode="colocated", decode_step_ms=20.0, output=10, prompt=20)
    d = diagnose(h.source())
    burst = d.requests[d.requests[col.ARRIVAL_NS] >= 20_000 * 1e6]
    assert len(burst) >= 4 and set(burst["first_cause"]) == {"burst"}, d.requests
    last = _causes(d, int(burst.sort_values(col.ARRIVAL_NS).iloc[-1][col.REQUEST_ID]))[0]
    assert "8 requests arrived in 0.07 s" in last["evidence"], last["evidence"]
    assert set(d.requests["first_cause"]) == {"burst"}  # the steady requests met their targets


def test_a_burst_of_requests_at_one_instant_is_told_by_its_window_not_a_rate():
    h = HandMade()
    arrivals = [i * 1000.0 for i in range(20)] + [20_000 + i * 1.0 for i in range(8)] + [24_000 + i * 1000.0
                                                                                         for i in range(6)]
    simulate(h, arrivals, mode="colocated", decode_step_ms=20.0, output=10, prompt=20)
    d = diagnose(h.source())
    burst = d.requests[d.requests[col.ARRIVAL_NS] >= 20_000 * 1e6]
    last = _causes(d, int(burst.sort_values(col.ARRIVAL_NS).iloc[-1][col.REQUEST_ID]))[0]
    assert last["cause"] == "burst", last
    assert "8 requests arrived within 7.0 ms at t=20.0 s (against a mean of" in last["evidence"], last["evidence"]


def test_a_noisy_tenants_burst_is_named_with_the_tenant():
    h = HandMade()
    quiet = [i * 500.0 for i in range(30)]
    noisy = [4_900 + i * 5.0 for i in range(10)]  # 10 requests in 45 ms; each holds the instance 54 ms
    tenants = ["quiet"] * len(quiet) + ["noisy"] * len(noisy)
    simulate(h, quiet + noisy, mode="colocated", decode_step_ms=10.0, output=6, prompt=20, tenants=tenants)
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    victims = d.requests[d.requests[col.TENANT] == "quiet"]
    assert len(victims) >= 1 and set(victims["first_cause"]) == {"noisy_neighbour"}, d.requests
    first = _causes(d, int(victims.iloc[0][col.REQUEST_ID]))[0]
    assert first["tenant"] == "noisy" and "tenant noisy's requests held 100% of the engine's batch seats" in first["evidence"]
    assert "--scheduling-policy fair" in first["fix"]
    noisy = d.requests[d.requests[col.TENANT] == "noisy"]  # its own requests queued behind its own burst
    last = _causes(d, int(noisy.sort_values(col.ARRIVAL_NS).iloc[-1][col.REQUEST_ID]))[0]
    assert last["cause"] == "burst" and "10 requests arrived within 45.0 ms" in last["evidence"], last
    assert "; 9 of them tenant noisy's" in last["evidence"], last["evidence"]  # the burst is told as noisy's


def test_a_quiet_request_behind_the_backlog_a_noisy_burst_built_is_a_noisy_neighbours_victim():
    h = HandMade()
    quiet = [i * 120.0 for i in range(40)]  # two quiet tenants, 45% of the instance between them
    noisy = [2_000 + i * 5.0 for i in range(10)]  # 540 ms of work in 45 ms
    tenants = ["quiet-a", "quiet-b"] * 20 + ["noisy"] * len(noisy)
    sim = simulate(h, quiet + noisy, mode="colocated", decode_step_ms=10.0, output=6, prompt=20, tenants=tenants)
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    last_noisy_end = max(sim.finish[len(quiet):])
    late = d.requests[(d.requests[col.TENANT] != "noisy") & (d.requests[col.ARRIVAL_NS] > last_noisy_end * 1e6)]
    assert len(late) >= 1 and set(late["first_cause"]) == {"noisy_neighbour"}, d.requests
    first = _causes(d, int(late.iloc[0][col.REQUEST_ID]))[0]  # only quiet requests held its seats: its backlog's
    assert first["tenant"] == "noisy" and "behind the backlog tenant noisy's burst built" in first["evidence"]
    early = d.requests[d.requests[col.ARRIVAL_NS] < 2_000 * 1e6]
    assert not len(early), early  # before the burst the quiet tenants met their target


def test_a_burst_every_tenant_sends_its_share_of_is_a_burst_not_a_noisy_neighbour():
    """A trace whose requests of every tenant come at one instant (as in a replayed production trace): the
    tenant with the most seats sent its usual share of the burst, so no tenant is the others' neighbour."""
    h = HandMade()
    mix = ["acme", "acme", "globex", "initech"]  # acme sends half of everything, in and out of the burst
    arrivals = [i * 1000.0 for i in range(20)] + [20_000 + i * 10.0 for i in range(8)] + [24_000 + i * 1000.0
                                                                                          for i in range(6)]
    tenants = [mix[i % 4] for i in range(len(arrivals))]
    simulate(h, arrivals, mode="colocated", decode_step_ms=20.0, output=10, prompt=20, tenants=tenants)
    d = diagnose(h.source())
    late = d.requests[d.requests[col.ARRIVAL_NS] >= 20_000 * 1e6]
    assert len(late) >= 4 and set(late["first_cause"]) == {"burst"}, d.requests
    assert "noisy_neighbour" not in set(d.causes["cause"]), d.causes[["cause", "evidence"]]


def test_a_wait_that_began_after_the_noisy_backlog_drained_is_not_a_noisy_neighbours(handmade):
    """q1 queued behind tenant noisy's burst (its share of the seats counts for noisy), then the queue drained
    (a step with nobody waiting after noisy's last request finished); q2 arrived later and waited for q1's
    seat: that wait is not the burst's."""
    h = handmade
    for rid in (1, 2, 3, 4):  # noisy's burst: 4 requests in 3 ms, prefilled in the first two steps
        _short(h, rid, rid - 1, prefill=(0 if rid < 3 else 25, 25 if rid < 3 else 50, 1 if rid < 3 else 2),
               tenant="noisy")
    h.step(1, 0, 25, prefill=40, waiting=1).step(2, 25, 50, prefill=40, waiting=1).step(3, 50, 60, prefill=10)
    q1_tokens = [60 + 20 * k for k in range(18)]  # decodes to 400 alone, one step per token
    _short(h, 5, 4, queue=(4, 50), prefill=(50, 60, 3), tokens=q1_tokens, tenant="quiet")
    for k, t in enumerate(q1_tokens[1:], 4):
        h.step(k, t - 20, t, decode=1, waiting=1 if t > 200 else 0)
        h.span(5, Stage.DECODE_COMPUTE, t - 20, t, k - 3, step=k)
    h.step(30, 400, 410, prefill=10)
    _short(h, 6, 200, queue=(200, 400), prefill=(400, 410, 30), tokens=[410], tenant="quiet")
    for rid in range(7, 13):  # the quiet tenant's steady requests, served at once, later
        _short(h, rid, 1000 + 200 * rid, prefill=(1000 + 200 * rid, 1005 + 200 * rid, 100 + rid), tenant="quiet")
    d = diagnose(h.source(), targets=Targets(ttft_ms=40))
    assert [c["cause"] for c in _causes(d, 6)] and "noisy_neighbour" not in {c["cause"] for c in _causes(d, 6)}, \
        _causes(d, 6)
    assert _causes(d, 5)[0]["cause"] == "noisy_neighbour", _causes(d, 5)  # q1 waited behind the burst itself


def test_preemption_counts_the_preempted_time_and_the_recompute(handmade):
    h = handmade
    h.request(1, 0, 300, prompt=10).tokens(1, [300])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.SCHEDULE_PREEMPTED, 10, 250, 0, step=2)
    h.span(1, Stage.PREFILL_COMPUTE, 250, 300, 0, step=3)
    d = diagnose(h.source(), targets=Targets(ttft_ms=10))
    first = _causes(d, 1)[0]
    assert first["cause"] == "preemption" and first["ms"] == pytest.approx(290.0)  # 240 preempted + 50 again
    assert "preempted 1 time(s) for 240.0 ms" in first["evidence"] and "recomputed 50.0 ms" in first["evidence"]
    assert "--num-device-blocks" in first["fix"]


def test_a_preemption_in_a_token_gap_is_one_cause_and_the_steps_it_sat_out_are_no_batch_interference(handmade):
    h = handmade
    h.request(1, 0, 200, prompt=10).tokens(1, [10, 200])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.DECODE_COMPUTE, 10, 20, 1, step=2)
    h.span(1, Stage.SCHEDULE_PREEMPTED, 20, 150, 1)
    h.span(1, Stage.PREFILL_COMPUTE, 150, 180, 1, step=4)  # the recompute of its prompt and first token
    h.span(1, Stage.DECODE_COMPUTE, 180, 200, 1, step=5)
    h.step(1, 0, 10, prefill=10).step(2, 10, 20, seqs=2, decode=2).step(3, 100, 140, prefill=50)
    h.step(4, 150, 180, prefill=11).step(5, 180, 200, seqs=2, decode=2)
    _short(h, 2, 100, prefill=(100, 140, 3), tokens=[140], prompt=50)
    d = diagnose(h.source(), targets=Targets(itl_ms=40))
    causes = _causes(d, 1)
    assert [c["cause"] for c in causes] == ["preemption"], causes  # gap 190 ms, 150 over: 130 held + 30 again
    assert causes[0]["ms"] == pytest.approx(150.0) and causes[0]["stage"] == "schedule.preempted"
    assert "was preempted for 130.0 ms and recomputed 30.0 ms of prefill before token 1" in causes[0]["evidence"]


def test_a_token_gap_over_the_itl_target_explained_by_its_kv_transfer(handmade):
    h = handmade
    h.instance(1, Role.PREFILL).instance(2, Role.DECODE)
    h.request(1, 0, 160, prompt=10, inst=1).tokens(1, [10], inst=1).tokens(1, [150, 160], inst=2, first=1)
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, inst=1, step=1)
    h.span(1, Stage.TRANSFER_KV, 10, 140, 1, inst=2)
    h.span(1, Stage.DECODE_COMPUTE, 140, 150, 1, inst=2, step=1)
    h.span(1, Stage.DECODE_COMPUTE, 150, 160, 2, inst=2, step=2)
    h.step(1, 140, 150, decode=1, inst=2).step(2, 150, 160, decode=1, inst=2)
    d = diagnose(h.source(), targets=Targets(itl_ms=40))
    row = d.requests.iloc[0]
    assert row["missed"] == "itl" and row["num_gaps_missed"] == 1 and row["excess_ms"] == pytest.approx(100.0)
    first = _causes(d, 1)[0]
    assert first["cause"] == "kv_transfer" and first["ms"] == pytest.approx(100.0)
    gap = d.gaps.iloc[0]
    assert gap[col.TOKEN_INDEX] == 1 and gap["gap_ms"] == pytest.approx(140.0) and gap["cause"] == "kv_transfer"


def test_a_kv_transfer_says_which_piece_of_the_handoff_held_the_time(handmade):
    """The prefill worker records its part up to its first chunk written, the gateway the flight to the decode
    worker's first read, the decode worker its receiving: the evidence names the piece that held the time."""
    h = handmade
    h.instance(1, Role.PREFILL).instance(2, Role.DECODE).instance(3, Role.GATEWAY)
    h.request(1, 0, 160, prompt=10, inst=1).tokens(1, [10], inst=1).tokens(1, [150, 160], inst=2, first=1)
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, inst=1, step=1)
    h.span(1, Stage.TRANSFER_KV, 10, 120, 1, inst=1)  # the prefill worker's own wait before its first chunk
    h.span(1, Stage.TRANSFER_KV, 120, 130, 1, inst=3)
    h.span(1, Stage.TRANSFER_KV, 130, 140, 1, inst=2)
    h.span(1, Stage.DECODE_COMPUTE, 140, 150, 1, inst=2, step=1)
    h.span(1, Stage.DECODE_COMPUTE, 150, 160, 2, inst=2, step=2)
    h.step(1, 140, 150, decode=1, inst=2).step(2, 150, 160, decode=1, inst=2)
    first = _causes(diagnose(h.source(), targets=Targets(itl_ms=40)), 1)[0]
    assert first["cause"] == "kv_transfer" and first["ms"] == pytest.approx(100.0)
    assert "110.0 ms" in first["evidence"] and "the prefill worker's part" in first["evidence"]
    assert "(and 2 more like it)" in first["evidence"]
    assert "prefill worker" in first["fix"] and "link" in first["fix"]


def test_a_prefix_evicted_before_it_came_back_is_a_prefix_miss(handmade):
    h = handmade
    _short(h, 1, 0, prefill=(0, 5, 1), prompt=48, cached=40)  # some request reused a 40-token prefix
    h.cache(CacheEventKind.EVICT, Tier.DEVICE, 12, 50)
    _short(h, 2, 100, prefill=(100, 200, 2), prompt=48, cached=0)
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    first = _causes(d, 2)[0]
    assert first["cause"] == "prefix_miss" and first["ms"] == pytest.approx(50.0)  # 100 x 40/48 = 83, scaled
    assert "evicted 12 cached block(s)" in first["evidence"] and "--num-host-blocks" in first["fix"]


def test_a_prefix_the_store_says_was_evicted_is_a_prefix_miss_of_those_tokens(handmade):
    h = handmade  # nothing in the run was ever reused: only the miss_evicted event tells the miss
    _short(h, 1, 0, prefill=(0, 5, 1), prompt=48)
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 6, 100, rid=2, tokens=24)
    _short(h, 2, 100, prefill=(100, 148, 2), prompt=48, cached=0)
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 2, 300, rid=3, tokens=8)  # a later lookup of its own
    _short(h, 3, 200, prefill=(200, 248, 3), prompt=48, cached=0)
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 10, 200, rid=3, tokens=40)  # its first lookup
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 12, 330, rid=4, tokens=48)  # readmitted after a preemption
    _short(h, 4, 300, prefill=(300, 320, 4), prompt=48, cached=0)
    h.span(4, Stage.SCHEDULE_PREEMPTED, 320, 330, 0)
    h.span(4, Stage.PREFILL_COMPUTE, 330, 350, 0, step=5)
    d = diagnose(h.source(), targets=Targets(ttft_ms=10))
    first = _causes(d, 2)[0]
    assert first["cause"] == "prefix_miss" and first["ms"] == pytest.approx(24.0)  # 48 ms x 24/48
    assert "the next 24 had been computed by an earlier request and evicted" in first["evidence"]
    third = _causes(d, 3)[0]  # its first lookup's 40 tokens, not the later one's 8: 48 x 40/48 = 40, scaled to 38
    assert third["cause"] == "prefix_miss" and third["ms"] == pytest.approx(38.0) and "the next 40" in third["evidence"]
    assert "prefix_miss" not in {c["cause"] for c in _causes(d, 1)}
    assert "prefix_miss" not in {c["cause"] for c in _causes(d, 4)}  # its own blocks, lost to the preemption


def test_with_miss_evicted_events_in_the_run_a_miss_without_one_is_no_prefix_miss(handmade):
    h = handmade  # the bound rule would claim request 2 (a 40-token prefix hit, 12 blocks evicted before it)
    _short(h, 1, 0, prefill=(0, 5, 1), prompt=48, cached=40)
    h.cache(CacheEventKind.EVICT, Tier.DEVICE, 12, 50)
    _short(h, 2, 100, prefill=(100, 200, 2), prompt=48, cached=0)
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 2, 300, rid=3, tokens=8)
    _short(h, 3, 300, prefill=(300, 302, 3), prompt=48, cached=0)
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    assert "prefix_miss" not in {c["cause"] for c in _causes(d, 2)}


def test_a_wait_while_the_engine_recomputed_others_evicted_prefixes_is_a_prefix_miss(handmade):
    h = handmade  # request 1 recomputes 36 evicted tokens of the 48 it computes: 75% of its 90 ms prefill
    h.cache(CacheEventKind.MISS_EVICTED, Tier.DEVICE, 9, 0, rid=1, tokens=36)
    _short(h, 1, 0, prefill=(10, 100, 1), prompt=48, cached=0)
    _short(h, 2, 10, queue=(10, 100), prefill=(100, 110, 2), prompt=48, cached=40)
    # on another instance, the same wait behind a prompt never seen before is no prefix miss
    _short(h, 3, 0, prefill=(10, 100, 1), prompt=48, cached=0, inst=2)
    _short(h, 4, 10, queue=(10, 100), prefill=(100, 110, 2), prompt=48, cached=40, inst=2)
    d = diagnose(h.source(), targets=Targets(ttft_ms=20))
    first = _causes(d, 2)[0]
    assert first["cause"] == "prefix_miss" and first["ms"] == pytest.approx(67.5)  # 90 ms x 36/48
    assert first["stage"] == "schedule.queue" and "r1's 36 tokens" in first["evidence"]
    assert "--num-host-blocks" in first["fix"]
    assert "prefix_miss" not in {c["cause"] for c in _causes(d, 4)}


def _steady_steps(h: HandMade, start: float, end: float, *, every: float = 2.0, first_step: int = 100,
                  inst: int = 1) -> HandMade:
    """Back-to-back 1.5 ms decode steps of one sequence over ``[start, end)`` (another request's), ``every`` ms."""
    t, n = start, first_step
    while t + 1.5 <= end:
        h.step(n, t, t + 1.5, seqs=1, decode=1, running=1, inst=inst)
        t, n = t + every, n + 1
    return h


def test_a_wait_while_the_engine_ran_no_step_is_an_engine_stall(handmade):
    h = handmade
    _steady_steps(h, 0, 100)  # the engine steps every 2 ms, then runs nothing from 100 ms to 400 ms
    _steady_steps(h, 400, 500, first_step=200)
    _short(h, 1, 90, queue=(90, 410), prefill=(410, 415, 300), tokens=[415])
    h.step(300, 410, 415, prefill=10, seqs=1)
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    first = _causes(d, 1)[0]
    assert first["cause"] == "engine_stall" and first["stage"] == "schedule.queue", _causes(d, 1)
    assert first["ms"] == pytest.approx(275.0)  # 300.5 ms without a step (99.5 to 400) explain all 275 over target
    assert "ran no engine step" in first["evidence"] and "300.5 ms" in first["evidence"], first["evidence"]
    assert first["fix"] == FIXES["engine_stall"]


def test_a_wait_while_the_engine_stepped_for_others_is_no_engine_stall(handmade):
    h = handmade
    _steady_steps(h, 0, 500)  # the engine worked the whole time: the wait is for capacity, not a stall
    _short(h, 1, 90, queue=(90, 410), prefill=(410, 415, 300), tokens=[415])
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    assert "engine_stall" not in {c["cause"] for c in _causes(d, 1)}, _causes(d, 1)


def test_a_decode_step_of_its_usual_batch_that_took_many_times_its_usual_time_is_an_engine_stall(handmade):
    h = handmade
    h.request(1, 0, 300, prompt=10).tokens(1, [10, 12, 14, 214, 216])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.step(1, 0, 10, prefill=10)
    for i, (a, b) in enumerate([(10, 12), (12, 14), (14, 214), (214, 216)], start=1):
        h.span(1, Stage.DECODE_COMPUTE, a, b, i, step=1 + i)
        h.step(1 + i, a, b, seqs=1, decode=1, running=1)
    _steady_steps(h, 300, 340, first_step=10)  # the instance's usual decode step: 1.5-2 ms
    d = diagnose(h.source(), targets=Targets(itl_ms=20))
    first = _causes(d, 1)[0]
    assert first["cause"] == "engine_stall" and first["stage"] == "decode.compute", _causes(d, 1)
    assert first["ms"] == pytest.approx(180.0)  # 200 - 1.5 ms beyond the median step, scaled to 200 - 20 over target
    assert "took 200.0 ms" in first["evidence"], first["evidence"]


def test_prefill_in_the_decode_step_is_batch_interference(handmade):
    h = handmade
    h.request(1, 0, 130, prompt=10).tokens(1, [10, 130])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.DECODE_COMPUTE, 10, 130, 1, step=2)
    h.step(1, 0, 10, prefill=10).step(2, 10, 130, prefill=300, decode=1, seqs=2)
    d = diagnose(h.source(), targets=Targets(itl_ms=20))
    first = _causes(d, 1)[0]
    assert first["cause"] == "batch_interference" and first["ms"] == pytest.approx(100.0)  # 120 x 300/301, scaled
    assert "300 prefill tokens" in first["evidence"]


def test_a_stage_slow_for_every_request_is_slow_stage_with_the_stage(handmade):
    h = handmade
    for rid in (1, 2, 3):
        t0 = rid * 1000
        h.request(rid, t0, t0 + 65, prompt=10).tokens(rid, [t0 + 5, t0 + 35, t0 + 65], kind="sent")
        h.span(rid, Stage.PREFILL_COMPUTE, t0, t0 + 4, 0, step=rid * 10)
        for i, start in enumerate((t0 + 4, t0 + 34)):
            h.span(rid, Stage.STREAM_SEND, start + 1, start + 30, i + 1)
            h.span(rid, Stage.DECODE_COMPUTE, start, start + 1, i + 1)
    d = diagnose(h.source(), targets=Targets(itl_ms=20))
    assert set(d.requests["first_cause"]) == {"slow_stage"}
    first = _causes(d, 1)[0]
    assert first["stage"] == "stream.send" and "takes 29.0 ms per span for every request" in first["evidence"]


def test_late_event_loop_ticks_inside_a_gateway_stage_are_event_loop_lag(handmade):
    h = handmade
    h.request(1, 0, 120, prompt=10).tokens(1, [120])
    h.span(1, Stage.GATEWAY_ACCEPT, 0, 100, 0)
    h.span(1, Stage.PREFILL_COMPUTE, 100, 120, 0, step=1)
    for rid in (2, 3):  # accepted in 1 ms: the stage is not slow for every request
        h.request(rid, rid * 1000, rid * 1000 + 21, prompt=10).tokens(rid, [rid * 1000 + 21])
        h.span(rid, Stage.GATEWAY_ACCEPT, rid * 1000, rid * 1000 + 1, 0)
    h.rows["loop_lags"].append({col.INSTANCE_ID: 1, col.START_NS: 10_000_000, col.END_NS: 90_000_000})
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    first = _causes(d, 1)[0]
    assert first["cause"] == "event_loop_lag" and first["stage"] == "gateway.accept"
    assert first["ms"] == pytest.approx(70.0)  # 80 ms late, the 70 ms over target


def test_a_held_back_tokens_relay_beside_the_engine_delays_nothing(handmade):
    h = handmade  # token 0 carries no text: the first visible content comes with token 1, at 110 ms
    h.request(1, 0, 110, prompt=10, first_content=110).tokens(1, [10, 95]).tokens(1, [60, 110], inst=2, kind="sent")
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.STREAM_RELAY, 10, 60, 0, inst=2)  # beside token 1's decode: a late loop there costs nothing
    h.span(1, Stage.DECODE_COMPUTE, 10, 95, 1, step=2)
    h.span(1, Stage.STREAM_RELAY, 95, 110, 1, inst=2)  # the first content's own relay
    for rid in (2, 3, 4, 5):  # relayed in 1 ms: the stage is not slow for every request
        h.request(rid, rid * 1000, rid * 1000 + 21, prompt=10).tokens(rid, [rid * 1000 + 20])
        h.tokens(rid, [rid * 1000 + 21], inst=2, kind="sent")
        h.span(rid, Stage.PREFILL_COMPUTE, rid * 1000, rid * 1000 + 20, 0, step=rid * 10)
        h.span(rid, Stage.STREAM_RELAY, rid * 1000 + 20, rid * 1000 + 21, 0, inst=2)
    for lo, hi in ((20, 50), (102, 108)):
        h.rows["loop_lags"].append({col.INSTANCE_ID: 2, col.START_NS: lo * 1_000_000, col.END_NS: hi * 1_000_000})
    d = diagnose(h.source(), targets=Targets(ttft_ms=50))
    lag = [c for c in _causes(d, 1) if c["cause"] == "event_loop_lag"]
    assert len(lag) == 1 and lag[0]["ms"] == pytest.approx(6.0), _causes(d, 1)  # 102-108, not 20-50 too


def test_rejected_draft_work_is_speculation(handmade):
    h = handmade
    h.request(1, 0, 100, prompt=10).tokens(1, [10, 100])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.DECODE_DRAFT, 10, 90, 1, step=2)
    h.span(1, Stage.DECODE_VERIFY, 90, 100, 1, step=2)
    h.spec_step(1, 2, proposed=4, accepted=1, first=1, draft=(10, 90), verify=(90, 100), batch=1)
    d = diagnose(h.source(), targets=Targets(itl_ms=50))
    first = _causes(d, 1)[0]
    assert first["cause"] == "speculation" and first["ms"] == pytest.approx(40.0)  # 60 ms rejected, 40 over


def test_time_only_the_client_saw_is_outside_server(handmade):
    h = handmade
    h.instance(1).instance(9, Role.CLIENT)
    for rid in (1, 2, 3):
        t0 = rid * 1000
        _short(h, rid, t0, prefill=(t0, t0 + 20, rid), tokens=[t0 + 20])
        h.request(rid, t0 - 1, t0 + 21 + (200 if rid == 2 else 0), inst=9)
        h.tokens(rid, [t0 + 21 + (200 if rid == 2 else 0)], inst=9, kind="recv")
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    assert list(d.requests[col.REQUEST_ID]) == [2]  # the server's TTFT met the target; the client's did not
    first = _causes(d, 2)[0]
    assert first["cause"] == "outside_server" and first["ms"] == pytest.approx(122.0)


def test_a_40_ms_step_every_request_pays_is_named_as_nagle_meeting_delayed_acks(handmade):
    """A gap the whole run shows is no cause by the median rule, but the delayed-ACK step is one: the
    server's socket without TCP_NODELAY (the reference gateway had it: every kept-alive stream +40 ms)."""
    h = handmade
    h.instance(1).instance(9, Role.CLIENT)
    for rid in range(1, 7):
        t0 = rid * 1000
        _short(h, rid, t0, prefill=(t0, t0 + 5, rid), tokens=[t0 + 5])
        seen = t0 + 5 + (41 if rid % 3 else 1)  # two requests of three on a kept-alive connection
        h.request(rid, t0, seen, inst=9).tokens(rid, [seen], inst=9, kind="recv")
    d = diagnose(h.source(), targets=Targets(ttft_ms=20))
    assert sorted(d.requests[col.REQUEST_ID]) == [1, 2, 4, 5]
    for rid in (1, 2, 4, 5):
        first = _causes(d, rid)[0]
        assert first["cause"] == "outside_server" and first["ms"] == pytest.approx(26.0)
        assert "TCP_NODELAY" in first["evidence"] and "67%" in first["evidence"]


def test_an_occasional_40_ms_gap_is_not_called_nagle(handmade):
    h = handmade
    h.instance(1).instance(9, Role.CLIENT)
    for rid in range(1, 11):
        t0 = rid * 1000
        _short(h, rid, t0, prefill=(t0, t0 + 5, rid), tokens=[t0 + 5])
        seen = t0 + 5 + (41 if rid == 3 else 1)
        h.request(rid, t0, seen, inst=9).tokens(rid, [seen], inst=9, kind="recv")
    first = _causes(diagnose(h.source(), targets=Targets(ttft_ms=20)), 3)[0]
    assert first["cause"] == "outside_server" and "TCP_NODELAY" not in first["evidence"]


def test_a_miss_only_the_client_saw_names_the_servers_causes_too(handmade):
    h = handmade
    h.instance(1).instance(9, Role.CLIENT)
    for rid in (1, 2, 3):
        t0 = rid * 1000
        if rid == 2:  # preempted for 60 ms inside a 90 ms server TTFT; the client saw 131 ms
            h.request(rid, t0, t0 + 90, prompt=10).tokens(rid, [t0 + 90])
            h.span(rid, Stage.PREFILL_COMPUTE, t0, t0 + 10, 0, step=rid)
            h.span(rid, Stage.SCHEDULE_PREEMPTED, t0 + 10, t0 + 70, 0, step=rid + 1)
            h.span(rid, Stage.PREFILL_COMPUTE, t0 + 70, t0 + 90, 0, step=rid + 2)
        else:
            _short(h, rid, t0, prefill=(t0, t0 + 20, rid), tokens=[t0 + 20])
        seen = t0 + (130 if rid == 2 else 21)
        h.request(rid, t0 - 1, seen, inst=9).tokens(rid, [seen], inst=9, kind="recv")
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    assert list(d.requests[col.REQUEST_ID]) == [2] and d.requests.iloc[0]["excess_ms"] == pytest.approx(31.0)
    causes = {c["cause"]: c for c in _causes(d, 2)}
    assert _causes(d, 2)[0]["cause"] == "preemption" and "outside_server" in causes, causes
    assert sum(c["ms"] for c in causes.values()) == pytest.approx(31.0)  # 80 + 39 ms found, scaled to the excess


def test_what_no_rule_explains_is_unknown_and_comes_last(handmade):
    _short(handmade, 1, 0, queue=(0, 10), prefill=(10, 400, 1), tokens=[400])
    d = diagnose(handmade.source(), targets=Targets(ttft_ms=100))
    causes = _causes(d, 1)
    assert [c["cause"] for c in causes] == ["unknown"] and causes[0]["ms"] == pytest.approx(300.0)


def test_the_runs_causes_rank_unknown_last_however_large(handmade):
    h = handmade
    for step, (a, b) in enumerate([(0, 100), (100, 200), (200, 300), (300, 400)], 1):  # head-of-line, as above
        h.step(step, a, b, prefill=32)
        h.span(9, Stage.PREFILL_COMPUTE, a, b, 0, step=step)
    h.request(9, 0, 420, prompt=1000).tokens(9, [400])
    h.step(5, 400, 410, prefill=10)
    _short(h, 1, 10, queue=(10, 400), prefill=(400, 410, 5), tokens=[410])
    for rid in (2, 3, 4):
        _short(h, rid, 500 + rid * 100, prefill=(500 + rid * 100, 505 + rid * 100, 10 + rid))
    _short(h, 20, 1000, prefill=(1000, 1800, 20), tokens=[1800])  # 700 ms over target that no rule explains
    d = diagnose(h.source(), targets=Targets(ttft_ms=100))
    assert _causes(d, 20)[0]["cause"] == "unknown" and _causes(d, 20)[0]["ms"] == pytest.approx(700.0)
    ranked = list(d.summary["cause"])
    assert ranked[-1] == "unknown" and ranked[0] == "head_of_line", d.summary[["cause", "ms"]]
    assert d.summary.set_index("cause").loc["unknown", "ms"] > d.summary.set_index("cause").loc["head_of_line", "ms"]


def test_the_story_and_the_json_say_what_the_rows_say(handmade):
    h = handmade
    h.request(1, 0, 300, prompt=10).tokens(1, [300])
    h.span(1, Stage.PREFILL_COMPUTE, 0, 10, 0, step=1)
    h.span(1, Stage.SCHEDULE_PREEMPTED, 10, 250, 0, step=2)
    h.span(1, Stage.PREFILL_COMPUTE, 250, 300, 0, step=3)
    d = diagnose(h.source(), targets=Targets(ttft_ms=100, e2e_ms=100))
    row, causes = d.requests.iloc[0], d.causes
    doc = request_json(row, causes)
    assert doc[col.REQUEST_KEY] == "r1" and doc["missed"] == ["ttft", "e2e"] and doc["excess_ms"] == 200.0
    assert doc["causes"][0]["cause"] == "preemption" and doc["causes"][0]["fix"] == FIXES["preemption"]
    assert doc["causes"][0]["share"] == 1.0 and doc["causes"][0]["stage"] == "schedule.preempted"
    story = request_story(row, causes)
    assert story.startswith("r1 (tenant a, class interactive) missed TTFT 300.0 ms against 100.0 ms; E2E")
    assert "It was preempted 1 time(s) for 240.0 ms" in story and "Fix: more KV blocks" in story


def test_bad_targets_are_a_clear_error():
    with pytest.raises(ValueError, match="positive number of ms"):
        Targets(ttft_ms=-1)


def test_every_cause_is_documented_with_its_rule():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "diagnosis.md").read_text(encoding="utf-8")
    assert [c for c in CAUSES if f"| `{c}` |" not in doc] == []
