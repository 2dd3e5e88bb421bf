"""One report, one story: on real planted-fault runs, numbers that describe the same quantity agree.

Each run of :mod:`planted_runs` (head-of-line blocking, a tiny prefix cache, preemption, a slow KV
transfer, a noisy tenant, a slow stream send, a 3x overload and a fault-free run; colocated and
disaggregated) is analysed once, and its report is checked against itself:

* every share lies in 0..100% and a critical path's shares sum to 100%;
* the KV transfer's share of ITL is one figure (stage table and PD section);
* the load sentence's direction words agree with the numbers they name, and no verdict is given
  under its minimum sample or window;
* batch tables keep roles apart; the cache's lookup rates and token rates describe the same
  lookups; a hit's value comes only from enough comparable requests; the agreement summary's tail
  is absolute and no row repeats another by construction;
* no stage hidden as negligible that a slowest request shows;
* a stage's time per request is one figure (the load table's stage growth, the queueing delay, the
  cache's per-request stage times and the slowest requests all count a span only inside the
  request's token intervals, as the breakdown does), and a request's stages never add up past its
  latency;
* one TTFT in every section (to the first visible content) and |unattributed| under 1% on TTFT and
  ITL.

Nothing about timing is asserted: only that the report's numbers agree with each other.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

sys.path.append(str(Path(__file__).resolve().parents[3]))  # planted_runs

from planted_runs import KINDS, SCENARIOS  # noqa: E402

from analyzers.analysis import RunAnalysis  # noqa: E402
from analyzers.cache import MIN_VALUE_REQUESTS  # noqa: E402
from analyzers.groups import ALL  # noqa: E402
from analyzers.load import MIN_REQUESTS, MIN_WINDOW_S, arrival_window  # noqa: E402
from analyzers.timing import request_table  # noqa: E402
from tokentrace.app.report import make_report  # noqa: E402
from tokentrace.app.report.sections import hidden_stages  # noqa: E402
from tokentrace.schema import CACHE_EVENTS, INSTANCES, SPANS, UNATTRIBUTED_LABEL, CacheEventKind, Role, Stage, Tier, col  # noqa: E402,E501
from tokentrace.store import open_run  # noqa: E402

RUNS = [pytest.param((kind, mode), id=f"{kind}-{mode}") for kind in KINDS for mode in SCENARIOS[kind].modes]
REL = 0.02  # two numbers of one quantity agree within 2%
ATTRIBUTION = 0.01  # |unattributed| bound, share of TTFT and of ITL
STAGES = [s.label for s in Stage]


@dataclass(frozen=True)
class Views:
    """A planted run's report and the analyses it is built from."""

    name: str
    report: Any
    latency: pd.DataFrame
    breakdown: pd.DataFrame
    attribution: pd.DataFrame
    critical_path: pd.DataFrame
    slowest: pd.DataFrame
    pd_ratio: Any
    batch: pd.DataFrame
    cache: Any
    agreement: pd.DataFrame
    load: Any
    queues: Any
    per_request: pd.DataFrame  # every request with its stage times (the slowest-requests table of all of them)
    arrivals: pd.DataFrame  # request_id, arrival_ns
    window: tuple[int, int, int] | None


@pytest.fixture(scope="module", params=RUNS)
def views(request, planted_run) -> Views:
    run = planted_run(*request.param)
    analysis = RunAnalysis(open_run(run.store, run.run))
    src = analysis.source
    arrivals = src.df(f"SELECT {col.REQUEST_ID}, {col.ARRIVAL_NS} FROM {request_table(src)}")
    return Views(run.run, make_report(run.store, run.run), analysis.latency(), analysis.stage_breakdown(),
                 analysis.attribution(), analysis.critical_path(), analysis.slowest_requests(10), analysis.pd_ratio(),
                 analysis.batch(), analysis.cache(), analysis.agreement(), analysis.load(), analysis.queues(),
                 analysis.slowest_requests(max(1, len(arrivals))), arrivals, arrival_window(src))


def _close(a: float, b: float, *, rel: float = REL, abs_tol: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=abs_tol)


# ----------------------------------------------------------------------------------------- shares


def test_every_share_lies_between_0_and_100_percent(views):
    bd = views.breakdown[views.breakdown["stage"] != UNATTRIBUTED_LABEL]
    for column in ("ttft_share", "itl_share", "ttft_tail_share", "itl_tail_share"):
        values = bd[column].dropna()
        assert values.between(-1e-9, 1 + 1e-9).all(), (views.name, column, bd[["stage", column]])
    cp = views.critical_path
    assert cp["share_of_ttft"].between(0, 1 + 1e-9).all(), (views.name, cp)
    assert (cp["mean_ms"] >= 0).all(), (views.name, cp)
    kv = views.pd_ratio.kv_transfer.iloc[0]
    for column in ("share_of_ttft", "share_of_itl"):
        assert math.isnan(kv[column]) or 0 <= kv[column] <= 1 + 1e-9, (views.name, kv)
    prefix = views.cache.prefix.iloc[0]
    for column in ("token_hit_rate", "request_hit_rate"):
        assert math.isnan(prefix[column]) or 0 <= prefix[column] <= 1, (views.name, prefix)
    assert views.cache.tiers["lookup_hit_rate"].between(0, 1).all(), views.cache.tiers
    util = views.pd_ratio.utilisation
    for column in (c for c in util.columns if c.endswith("_utilisation")):
        assert util[column].dropna().between(0, 1 + 1e-9).all(), (views.name, util)


def test_each_critical_path_sums_to_its_ttft(views):
    for group, rows in views.critical_path.groupby("group"):
        assert rows["share_of_ttft"].sum() == pytest.approx(1.0, abs=1e-9), (views.name, group, rows)


# ------------------------------------------------------------------------------- the same quantity twice


def test_one_kv_transfer_share_of_ttft_and_of_itl(views):
    kv = views.pd_ratio.kv_transfer.iloc[0]
    stage = views.breakdown.set_index("stage").loc[Stage.TRANSFER_KV.label]
    for kind in ("ttft", "itl"):
        pd_share, bd_share = kv[f"share_of_{kind}"], stage[f"{kind}_share"]
        if not (math.isnan(pd_share) and math.isnan(bd_share)):
            assert _close(pd_share, bd_share, abs_tol=1e-6), (views.name, kind, pd_share, bd_share)


def test_lookup_rates_and_request_rates_describe_the_same_lookups(views):
    """Each request's first lookup decides its cached tokens: requests that report cached tokens are the first
    lookups that hit (one device tier in these runs)."""
    tiers, prefix = views.cache.tiers, views.cache.prefix.iloc[0]
    if tiers.empty or math.isnan(prefix["request_hit_rate"]):
        return
    hit_lookups = int(tiers["num_lookups_hit"].sum())
    assert hit_lookups == round(prefix["request_hit_rate"] * prefix["num_requests"]), (views.name, tiers, prefix)


def test_the_value_of_a_hit_comes_from_enough_comparable_requests_or_says_what_is_missing(views):
    hv = views.cache.hit_value.set_index("group")
    if math.isnan(hv.loc["hit", "saved_ms_per_hit"]):
        assert hv.loc["hit", "value_note"], (views.name, hv)
        assert "not measured: " + hv.loc["hit", "value_note"] in views.report.section("cache").note
    else:
        assert (hv["num_compared"] >= MIN_VALUE_REQUESTS).all(), (views.name, hv)


def test_agreement_tails_are_absolute_and_no_row_repeats_another(views):
    ag = views.agreement.set_index("metric")
    assert "ttft_stages" not in ag.index and "p99_ms" not in ag.columns
    for metric, row in ag.iterrows():
        if row["count"]:
            assert 0 <= row["p50_abs_ms"] <= row["p99_abs_ms"] <= row["max_abs_ms"] + 1e-9, (views.name, metric, row)
            assert abs(row["max_ms"]) <= row["max_abs_ms"] + 1e-9


def test_batch_tables_keep_each_roles_steps(views):
    batch = views.batch
    prefill = batch[batch["role"] == "prefill"]
    assert (prefill["num_tokens"] == 0).all(), (views.name, batch)  # a prefill worker's steps make no decode token
    titles = [title for title, _ in views.report.section("batch").tables]
    if len(prefill):
        assert "Prefill step time by batch size (prefill role)" in titles, titles
        assert not any(t.startswith("Decode") and "prefill role" in t for t in titles), titles


def _raw(run_dir: Path, table: str) -> pd.DataFrame:
    return pa.concat_tables([pq.read_table(p) for p in sorted((run_dir / table).glob("*/*.parquet"))]).to_pandas()


@pytest.mark.parametrize("kind", ["preemption", "kv_transfer"])
def test_a_decode_worker_times_the_transfer_to_its_last_kv_chunk_and_the_wait_for_room_apart(planted_run, kind):
    """Decided from the raw files: the decode worker's transfer.kv lies within its KV receipt (the remote-tier
    load event, first to last chunk, on the same process's clock); waiting for room in a full decode pool after
    it is not transfer."""
    run = planted_run(kind, "disagg")
    run_dir = run.store / run.run
    roles = _raw(run_dir, INSTANCES.name).groupby(col.INSTANCE_ID)[col.ROLE].last()  # a worker names its role last
    decode = set(roles[roles == int(Role.DECODE)].index)
    spans = _raw(run_dir, SPANS.name)
    kv = spans[(spans[col.STAGE] == int(Stage.TRANSFER_KV)) & spans[col.INSTANCE_ID].isin(decode)]
    ev = _raw(run_dir, CACHE_EVENTS.name)
    loads = ev[(ev[col.KIND] == int(CacheEventKind.LOAD)) & (ev[col.TIER] == int(Tier.REMOTE))]
    both = kv.merge(loads, on=[col.INSTANCE_ID, col.REQUEST_ID], suffixes=("", "_load"))
    assert len(both) == len(kv) == len(run.outcomes), (len(both), len(kv))
    assert (both[col.START_NS] >= both[f"{col.START_NS}_load"]).all()
    assert (both[col.END_NS] <= both[f"{col.END_NS}_load"]).all(), both[[col.END_NS, f"{col.END_NS}_load"]]


# ------------------------------------------------------------------------------------------ sentences

_CHANGE = re.compile(r"(grew|fell) from ([0-9][0-9,.]*) to ([0-9][0-9,.]*)")


def test_direction_words_agree_with_their_numbers(views):
    text = " ".join([views.report.load.get("verdict") or "", *views.report.headline])
    for word, early, late in _CHANGE.findall(text):
        a, b = float(early.replace(",", "")), float(late.replace(",", ""))
        assert (b > a) if word == "grew" else (b < a), (views.name, word, early, late, text)


def test_no_load_verdict_under_its_minimum_sample_or_window(views):
    load = views.report.load
    n, window = load.get("num_requests") or 0, load.get("arrival_window_s")
    if n < MIN_REQUESTS or (window is not None and window < MIN_WINDOW_S):
        assert load["saturated"] is None, (views.name, load)
        verdict = load["verdict"]  # after the SLO verdict and its causes on the first screen
        assert verdict in views.report.headline and verdict.startswith("Load not judged"), verdict


def test_the_prefill_workers_kv_transfer_is_not_listed_under_the_gateway(views):
    stages = views.report.section("load").tables
    growth = [table for title, table in stages if title.startswith("Stages whose time")]
    for table in growth:
        kv = table[table["stage"] == Stage.TRANSFER_KV.label]
        assert "gateway" not in set(kv["role"]), (views.name, table)


# ------------------------------------------------------------------------ one TTFT


def test_one_ttft_in_the_latency_table_the_breakdown_and_the_attribution(views):
    lat = views.latency.set_index("metric").loc["ttft"]
    bd_ttft = views.breakdown["ttft_mean_ms"].sum()  # stages and unattributed tile token 0's interval
    att = views.attribution.set_index("kind").loc["ttft"]
    assert _close(bd_ttft, lat["mean_ms"]), (views.name, bd_ttft, lat["mean_ms"])
    assert _close(att["latency_ms"] / att["num_tokens"], lat["mean_ms"]), (views.name, att, lat)


def test_unattributed_time_is_under_1_percent_of_ttft_and_itl_everywhere(views):
    bd = views.breakdown.set_index("stage").loc[UNATTRIBUTED_LABEL]
    assert abs(bd["ttft_share"]) < ATTRIBUTION and abs(bd["itl_share"]) < ATTRIBUTION, (views.name, bd)
    cp = views.critical_path
    rest = cp[cp["stage"] == UNATTRIBUTED_LABEL]
    assert (rest["share_of_ttft"] < ATTRIBUTION).all(), (views.name, cp)


def test_a_requests_stages_never_add_up_past_its_latency(views):
    per = views.per_request
    stage_ms = per[STAGES].sum(axis=1)
    assert (stage_ms <= per["e2e_ms"] * (1 + ATTRIBUTION) + 1e-6).all(), (views.name, per[stage_ms > per["e2e_ms"]])


def test_a_stages_time_per_request_is_one_figure_in_the_load_queue_and_cache_sections(views):
    """The load table's early and late stage times, the queueing delay and the cache's queue time per request
    are the slowest-requests table's stage times (the breakdown's clipping) averaged over the same requests."""
    per = views.per_request.set_index(col.REQUEST_ID)
    arrival = views.arrivals.set_index(col.REQUEST_ID)[col.ARRIVAL_NS]
    queue = Stage.SCHEDULE_QUEUE.label
    delay = views.queues.delay.set_index(col.SLO_CLASS).loc[ALL]
    if len(per) == delay["count"]:  # every request delivered a token
        assert _close(delay["mean_ms"], per[queue].mean(), abs_tol=1e-6), (views.name, delay, per[queue])
        assert _close(delay["max_ms"], per[queue].max(), abs_tol=1e-6), (views.name, delay, per[queue])
    hv = views.cache.hit_value
    measured = hv[hv["num_measured"] > 0]
    if len(measured) and measured["num_measured"].sum() == len(per):
        mean = (measured["mean_queue_ms"] * measured["num_measured"]).sum() / measured["num_measured"].sum()
        assert _close(mean, per[queue].mean(), abs_tol=1e-6), (views.name, hv, per[queue])
    stages = views.load.stages
    if views.window is None or stages.empty:
        return
    a0, a1, _ = views.window
    third = (a1 - a0) / 3
    parts = {"early": arrival[arrival < int(a0 + third)].index, "late": arrival[arrival >= int(a1 - third)].index}
    for part, ids in parts.items():
        rows = per.reindex(ids).dropna(subset=["e2e_ms"])
        if rows.empty or len(rows) != len(ids):
            continue
        load_ms = stages.groupby("stage")[f"{part}_ms"].sum()  # a stage's roles together
        for stage, ms in load_ms.items():
            assert _close(ms, rows[stage].mean(), abs_tol=1e-3), (views.name, part, stage, ms, rows[stage].mean())


def test_no_stage_hidden_as_negligible_that_a_slowest_request_shows(views):
    hidden = [s for s in hidden_stages(views.breakdown) if s in views.slowest.columns]
    slow = views.slowest
    for stage in hidden:
        share = (slow[stage] / slow["e2e_ms"]).max()
        assert share < ATTRIBUTION, (views.name, stage, share)
