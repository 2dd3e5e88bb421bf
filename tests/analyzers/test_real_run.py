"""Every analyzer and every report format over a real run (tests/data/real_run).

The fixture is the head of the Mooncake conversation trace replayed through the
reference server, disaggregated and traced with `tokentrace run`, with the
client's own view recorded by `tokentrace bench` (tests/data/make_real_run.py).
Hand-made stores test each formula; this test checks that the whole chain
holds up on data nobody shaped for it: every analysis runs, its answers are
consistent with each other and with the run's own rows, and the report renders.
"""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd
import pytest

import tokentrace
from tokentrace.app.report import FORMATS, make_report, render
from tokentrace.schema import REQUESTS, STEPS, TOKENS, UNATTRIBUTED_LABEL, Role, Stage, col
from tokentrace.store.derived import DERIVED_DIR

DATA = Path(__file__).resolve().parents[1] / "data"
STORE = DATA / "real_run"
RUN_ID = "mooncake-disagg"


@pytest.fixture(scope="module")
def run():
    return tokentrace.open(STORE, run=RUN_ID)


@pytest.fixture(scope="module")
def analysis(run):
    return run.analyze()


def test_the_fixture_is_a_real_disaggregated_run(run):
    roles = {Role.from_label(i["role"]) for i in run.instances()}
    assert roles == {Role.CLIENT, Role.GATEWAY, Role.PREFILL, Role.DECODE}
    bench = run.manifest["config"]["bench"]
    assert bench["workload"].endswith("mooncake_conversation_head100.jsonl")
    assert bench["scaling"]["length_scale"] == pytest.approx(1 / 64)
    size = sum(p.stat().st_size for p in STORE.rglob("*") if p.is_file() and DERIVED_DIR not in p.parts)
    assert size < 500_000


def test_latency_percentiles_are_ordered_and_cover_every_request(run, analysis):
    lat = analysis.latency().set_index("metric")
    assert set(lat.index) == {"ttft", "tpot", "itl", "e2e"}
    for _, r in lat.iterrows():
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"] <= r["p99.9_ms"]
    assert lat.loc["ttft", "count"] > 0
    assert lat.loc["e2e", "p50_ms"] >= lat.loc["ttft", "p50_ms"]
    by_tenant = analysis.latency(by="tenant")
    assert len(by_tenant) >= 4 * 2  # at least two of the three tenants, four metrics each


def test_stage_shares_sum_to_one_and_name_the_served_stages(analysis):
    bd = analysis.stage_breakdown()
    assert set(bd["stage"]) <= {s.label for s in Stage} | {UNATTRIBUTED_LABEL}
    for column in ("ttft_share", "itl_share"):
        assert bd[column].sum() == pytest.approx(1.0, abs=1e-6)
    took_time = set(bd.loc[bd["ttft_mean_ms"] > 0, "stage"])
    assert {Stage.PREFILL_COMPUTE.label, Stage.GATEWAY_RECEIVE.label} <= took_time
    assert Stage.DECODE_COMPUTE.label in set(bd.loc[bd["itl_mean_ms"] > 0, "stage"])
    share = analysis.unattributed_share()
    assert math.isfinite(share) and -1.0 < share < 1.0


def test_slo_goodput_and_fluidity(analysis):
    slo = analysis.slo()
    assert {"interactive", "batch", "*"} <= set(slo[col.SLO_CLASS])
    assert slo["attainment"].between(0, 1).all()
    assert len(analysis.goodput()) == len(slo)
    assert analysis.fluidity()["fluidity_index"].dropna().between(0, 1).all()


def test_critical_path_and_slowest_requests(analysis):
    cp = analysis.critical_path()
    assert {"p50", "p99"} <= set(cp["group"])
    slowest = analysis.slowest_requests(5)
    assert len(slowest) == 5
    assert slowest["e2e_ms"].is_monotonic_decreasing


def test_queues_and_littles_law(run, analysis):
    q = analysis.queues()
    assert len(q.timeline) > 0
    assert (q.timeline[col.NUM_WAITING] >= 0).all()
    ll = analysis.littles_law()
    assert len(ll) == 2  # the prefill and the decode worker each step their own engine
    assert run.table(STEPS.name).num_rows > 0


def test_cache_hit_rates_are_shares(analysis):
    c = analysis.cache()
    assert len(c.prefix) == 1
    assert 0.0 <= float(c.prefix["token_hit_rate"].iloc[0]) <= 1.0
    assert 0.0 <= float(c.prefix["request_hit_rate"].iloc[0]) <= 1.0


def test_pd_ratio_sees_both_pools(analysis):
    p = analysis.pd_ratio()
    assert {"prefill", "decode"} <= set(p.pools["role"])
    advice = p.recommendation.set_index("pool")
    assert list(advice.index) == ["prefill", "decode"]
    assert (advice["instances"] >= 1).all() and (advice["instances"] % 1 == 0).all()  # whole instances
    assert (advice["utilisation_at_advice"] <= advice["max_utilisation"] + 1e-9).all()
    assert (advice["current_instances"] == 1).all()
    # Decode work counts decode tokens only: token 0 comes from the prefill pass.
    assert p.demand.iloc[0]["decode_tokens_per_request"] == pytest.approx(
        p.demand.iloc[0]["mean_output_tokens"] - 1)


def test_batch_and_interference(analysis):
    b = analysis.batch()
    assert (b["num_steps"] > 0).all() and len(b) > 0
    assert isinstance(analysis.interference(), pd.DataFrame)


def test_tenants_fairness_and_noisy_neighbours(analysis):
    t = analysis.tenants()
    assert set(t.shares[col.TENANT]) == {"acme", "globex", "initech"}
    assert t.jain["jain_index"].dropna().between(0, 1).all()
    assert isinstance(analysis.noisy_neighbours(), pd.DataFrame)


def test_a_run_diffed_against_itself_flags_nothing(analysis):
    d = analysis.diff(analysis, resamples=200)
    assert len(d) > 0
    assert not d["significant"].astype(bool).any()
    assert not d["regression"].astype(bool).any()


def test_client_and_server_agree(run, analysis):
    ag = analysis.agreement().set_index("metric")
    num_clients = sum(1 for i in run.instances() if Role.from_label(i["role"]) is Role.CLIENT)
    assert num_clients == 1
    assert ag.loc["ttft", "count"] > 0 and ag.loc["itl", "count"] > 0
    assert ag.loc["ttft", "max_ms"] <= 1.0  # server TTFT never exceeds the client's (1 ms clock slack)
    assert abs(ag.loc["itl", "p50_ms"]) < 2.0
    assert run.table(TOKENS.name).num_rows > 0 and run.table(REQUESTS.name).num_rows > 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_report_renders_in_every_format(fmt):
    report = make_report(STORE, RUN_ID)
    text = render(report, fmt)
    assert text
    if fmt == "md":
        assert "Where the time went" in text and RUN_ID in text
    elif fmt == "html":
        assert text.lstrip().lower().startswith("<!doctype html") and "plotly" in text.lower()
    elif fmt == "json":
        doc = json.loads(text)
        assert doc["run"]["run_id"] == RUN_ID
    else:
        root = ET.fromstring(text)
        assert root.tag in ("testsuites", "testsuite")
