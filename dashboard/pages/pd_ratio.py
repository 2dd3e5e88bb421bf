"""PD ratio: prefill and decode utilisation per instance and pool, queue watermarks, KV transfer, the ratio to run."""

from __future__ import annotations

from typing import Any

import dash

from dashboard.components.controls import run_picker
from dashboard.components.explanations import EXPLAIN
from dashboard.components.figures import bars, bars_row, explained, fmt, graph_or_notice, kpis
from dashboard.components.shell import ViewQuery, live_callback, notice, page
from dashboard.data import DataSource
from tokentrace.schema import col

PATH = "/pd-ratio"
dash.register_page(__name__, path=PATH, name="PD ratio", title="tokentrace · prefill:decode")


def _instance_label(frame: Any) -> Any:
    return frame.assign(instance=frame["role"].astype(str) + " · " + frame[col.INSTANCE_ID].astype(str))


def _recommendation(rec: Any, kv: Any) -> Any:
    if len(rec) == 0:
        return notice("No steps with prefill or decode work: no ratio to recommend.")
    r = rec.iloc[0]
    cards = [("prefill : decode instances", f"{fmt(r['prefill_instances'], '', 2)} : {fmt(r['decode_instances'], '', 2)}"),
             ("ratio", fmt(r["prefill_to_decode_ratio"], "", 2)),
             ("arrival rate", fmt(r["arrival_rate_rps"], "req/s", 2)),
             ("prefill needed", fmt(r["prefill_tokens_per_s_needed"], "tok/s", 0)),
             ("decode needed", fmt(r["decode_tokens_per_s_needed"], "tok/s", 0))]
    if len(kv):
        cards.append(("KV transfer share of ITL", fmt(100 * kv.iloc[0]["share_of_itl"], "%", 2)))
    return kpis(cards, kpi_id="pd-kpis")


def body(src: DataSource, q: ViewQuery) -> list[Any]:
    """Prefill:decode analyses of run ``q.run``."""
    rid = src.resolve(q.run)
    rep = src.result(rid, "pd_ratio")
    util = graph_or_notice(rep.utilisation, "pd-utilisation", lambda f: bars(
        _instance_label(f), "instance", ["prefill_utilisation", "decode_utilisation"],
        title="Utilisation per instance", yaxis="share of wall time"), "This run has no engine steps.")
    pools = bars_row(rep.pools, "role", [("prefill_tokens_per_s", "Prefill throughput per busy second", "tokens/s"),
                                         ("decode_tokens_per_s", "Decode throughput per busy second", "tokens/s")],
                     "pd-pools", "This run has no engine steps.")
    marks = graph_or_notice(rep.watermarks, "pd-watermarks", lambda f: bars(
        f.assign(instance=f[col.INSTANCE_ID].astype(str)), "instance",
        ["max_waiting", "p95_waiting", "max_running", "p95_running"], title="Queue watermarks", yaxis="requests"),
        "This run has no engine steps.")
    return [explained("Recommended ratio", EXPLAIN["pd_recommendation"] + " " + EXPLAIN["pd_kv"],
                      _recommendation(rep.recommendation, rep.kv_transfer)),
            explained("Utilisation", EXPLAIN["pd_utilisation"], util, pools),
            explained("Watermarks", EXPLAIN["pd_watermarks"], marks)]


def controls(src: DataSource, q: ViewQuery) -> list[Any]:
    return [run_picker(src, q.run)]


def layout(**query: str) -> Any:
    return page(PATH, "Prefill : decode", query, body, controls)


live_callback(PATH, body)
