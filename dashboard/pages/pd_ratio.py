"""PD ratio: whole instances per pool for the offered load, prefill and decode utilisation, watermarks, KV transfer."""

from __future__ import annotations

import math
from typing import Any

import dash

from analyzers.analysis import RunAnalysis
from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, bars_row, explained, fmt, graph_or_notice, kpis, table
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.app.report.headline import advice_sentence
from tokentrace.schema import col

PATH = "/pd-ratio"
dash.register_page(__name__, path=PATH, name="PD ratio", title="tokentrace · prefill:decode")

_ADVICE_COLUMNS = ["pool", "current_instances", "instances", "lacks", "utilisation_at_advice", "current_utilisation",
                   "max_utilisation", "limited_by", "work_per_s", "capacity_per_instance", "service_ms",
                   "slo_target_ms", "slo_reachable"]


def _count(value: Any) -> str:
    return str(int(value)) if value is not None and not (isinstance(value, float) and math.isnan(value)) else "—"


def _advice(rec: Any, demand: Any, kv: Any) -> list[Any]:
    if len(rec) == 0:
        return [notice("No steps with prefill or decode work: no capacity to advise on.")]
    d = demand.iloc[0]
    by_pool = rec.set_index("pool")
    cards = [(f"{pool} instances", f"{_count(r['instances'])} (has {_count(r['current_instances'])})")
             for pool, r in by_pool.iterrows()]
    if len(by_pool) == 2:
        cards.append(("P:D", " : ".join(_count(v) for v in by_pool["instances"])))
    cards += [("offered load", fmt(d["arrival_rate_rps"], "req/s", 2)),
              ("decode tokens per request", fmt(d["decode_tokens_per_request"], "", 1))]
    if len(kv):
        cards.append(("KV transfer share of ITL", fmt(100 * kv.iloc[0]["share_of_itl"], "%", 2)))
    sentence = dash.html.P(advice_sentence(rec, demand), id="pd-advice", className="tt-verdict tt-unjudged")
    return [sentence, kpis(cards, kpi_id="pd-kpis"), table(rec[_ADVICE_COLUMNS], "pd-advice-table")]


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Prefill:decode analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, RunAnalysis.pd_ratio)
    names = src.instance_names(rid)
    util = graph_or_notice(rep.utilisation, "pd-utilisation", lambda f: bars(
        f, col.INSTANCE_ID, ["prefill_utilisation", "decode_utilisation"], instance_names=names,
        title="Utilisation per instance", yaxis="share of wall time"), "This run has no engine steps.")
    pools = bars_row(rep.pools, "role", [("prefill_tokens_per_s", "Prefill throughput per busy second", "tokens/s"),
                                         ("decode_tokens_per_s", "Decode throughput per busy second", "tokens/s")],
                     "pd-pools", "This run has no engine steps.")
    marks = graph_or_notice(rep.watermarks, "pd-watermarks", lambda f: bars(
        f, col.INSTANCE_ID, ["max_waiting", "p95_waiting", "max_running", "p95_running"], instance_names=names,
        title="Queue watermarks", yaxis="requests"),
        "This run has no engine steps.")
    return [explained("Instances for the offered load", EXPLAIN["pd_recommendation"] + " " + EXPLAIN["pd_kv"],
                      *_advice(rep.recommendation, rep.demand, rep.kv_transfer)),
            explained("Utilisation", EXPLAIN["pd_utilisation"], util, pools),
            explained("Watermarks", EXPLAIN["pd_watermarks"], marks)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Prefill : decode", query, body, controls)


live_callback(PATH, body)
