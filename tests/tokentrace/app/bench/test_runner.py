"""The run loop: store records, open-loop timing, closed-loop bound, duration bound, failures."""

from __future__ import annotations

import pyarrow.compute as pc
import pytest

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.plan import build_plan, parse_mix, parse_tenants
from tokentrace.app.bench.runner import CANCELLED_ERROR, RunLimits, run_bench
from tokentrace.app.bench.summary import summarize
from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec
from tokentrace.schema import REQUESTS, TOKENS, RequestStatus, Role, col, request_id_of
from tokentrace.store import open_run
from tokentrace.store.writer import StoreWriter

SPEC = SyntheticSpec(LengthDist("fixed", 16), LengthDist("fixed", 4))


def test_client_view_is_recorded_in_the_store(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=12, arrivals=Arrivals("poisson", 200.0),
                      tenants=parse_tenants("a:ka,b:kb"), slo_mix=parse_mix("interactive:1"), key_prefix="rec")
    result = run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=20), store=tmp_path,
                       run_id="r1")
    run = open_run(tmp_path, "r1")
    assert run.manifest["config"]["bench"]["synthetic"]["input"] == "fixed 16"
    roles = {i["role"] for i in run.instances()}
    assert roles == {Role.CLIENT.label}
    req = run.table(REQUESTS.name).to_pandas()
    assert sorted(req[col.REQUEST_KEY]) == [r.key for r in plan.requests]
    assert set(req[col.REQUEST_ID]) == {request_id_of(r.key, r.tenant) for r in plan.requests}
    assert set(req[col.STATUS]) == {int(RequestStatus.OK)} and set(req[col.SLO_CLASS]) == {"interactive"}
    assert set(req[col.TENANT]) <= {"a", "b"} and len(set(req[col.TENANT])) == 2
    tok = run.table(TOKENS.name)
    assert tok.num_rows == 12 * 4 and pc.all(pc.is_valid(tok.column(col.RECV_NS))).as_py()
    by_key = {o.key: o for o in result.outcomes}
    row = req[req[col.REQUEST_KEY] == plan.requests[3].key].iloc[0]
    o = by_key[plan.requests[3].key]
    assert row[col.ARRIVAL_NS] == o.send_ns and row[col.FIRST_TOKEN_NS] == o.recv_ns[0]
    assert row[col.FINISH_NS] == o.finish_ns and row[col.NUM_OUTPUT_TOKENS] == 4
    assert result.counters[REQUESTS.name] == 12 and result.counters["dropped"] == 0
    assert result.config_recorded


def test_a_run_created_by_another_writer_still_records_the_bench_config(fake_url, tmp_path):
    StoreWriter(tmp_path, run_id="shared", config={"server": 1}).close()
    plan = build_plan(synthetic=SPEC, max_requests=2)
    result = run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=20), store=tmp_path,
                       run_id="shared")
    assert result.config_recorded and len(result.outcomes) == 2


@pytest.mark.parametrize("processes", [0, 2])
def test_open_loop_never_sends_early(fake_url, processes):
    plan = build_plan(synthetic=SPEC, max_requests=8, arrivals=Arrivals("constant", 40.0))
    result = run_bench(plan, RequestOptions(fake_url, model="ok"), RunLimits(duration_s=20), processes=processes)
    assert result.start_ns > 0
    for o, r in zip(result.outcomes, plan.requests):
        # Due at start + offset; a send may be late (a busy machine), never early. (Measured against
        # the first send instead, a late first send made punctual later ones look early.)
        assert o.send_ns >= result.start_ns + round(r.offset_s * 1e9), (o.index, o.send_ns - result.start_ns)
    assert len(result.outcomes) == 8 and all(o.ok for o in result.outcomes)
    lag = summarize(plan.requests, result.outcomes, start_ns=result.start_ns).send_lag_ms
    assert lag is not None and len(lag) == 8 and (lag >= 0).all()


def test_concurrency_bounds_requests_in_flight(recording_server):
    url, _, counters = recording_server
    plan = build_plan(synthetic=SPEC, max_requests=16)
    result = run_bench(plan, RequestOptions(url, model="ok"), RunLimits(duration_s=20, concurrency=3))
    assert all(o.ok for o in result.outcomes) and len(result.outcomes) == 16
    assert counters.max_in_flight == 3


def test_duration_bounds_the_run_and_cancels_what_is_left(fake_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=50, arrivals=Arrivals("constant", 10.0))
    result = run_bench(plan, RequestOptions(fake_url, model="slow"), RunLimits(duration_s=0.45, drain_s=0.2),
                       store=tmp_path, run_id="short")
    assert 3 <= len(result.outcomes) <= 6  # sends at 0, 0.1, ..., 0.4 s; nothing after the bound
    assert all(o.cancelled and len(o.recv_ns) == 1 for o in result.outcomes)
    req = open_run(tmp_path, "short").table(REQUESTS.name).to_pandas()
    assert set(req[col.STATUS]) == {int(RequestStatus.ABORTED)} and set(req[col.ERROR]) == {CANCELLED_ERROR}


def test_failures_are_recorded_with_their_kind_and_the_run_completes(dead_url, tmp_path):
    plan = build_plan(synthetic=SPEC, max_requests=5)
    result = run_bench(plan, RequestOptions(dead_url, model="ok"), RunLimits(duration_s=20), store=tmp_path,
                       run_id="down")
    assert len(result.outcomes) == 5 and not any(o.ok for o in result.outcomes)
    req = open_run(tmp_path, "down").table(REQUESTS.name).to_pandas()
    assert set(req[col.ERROR]) == {"connect"} and set(req[col.STATUS]) == {int(RequestStatus.ERROR)}
